//! Which CUDA kernel runs each product of [`GemmOps`](super::GemmOps): a few rows (a decoding
//! step's) on the skinny product, bf16 on our Hopper GEMM (the residual stream added, or q's and
//! k's heads rotated, in its epilogue), f32 in f32, everything else on Burn's matmul.

use burn::backend::Cube;
use burn::backend::ops::FloatTensorOps;
use burn::tensor::DType;
use burn_cubecl::tensor::CubeTensor;

use super::Gemm;
use super::reference::rotate_heads;
use crate::rms_norm::link::NormLink;

pub(crate) fn gemm(lhs: CubeTensor, rhs: CubeTensor, kind: Gemm) -> CubeTensor {
    let bf16 = lhs.dtype == DType::BF16 && rhs.dtype == DType::BF16;
    match kind {
        // A few rows (decoding): bound by reading the weight, which 128-row tiles spread over
        // too few blocks.
        Gemm::Wgmma if bf16 => super::skinny::gemm(&lhs, &rhs).unwrap_or_else(|| {
            crate::cuda::wgmma::gemm(lhs.clone(), rhs.clone(), crate::cuda::wgmma::Schedule::Persistent)
                .unwrap_or_else(|_| Cube::float_matmul(lhs, rhs))
        }),
        _ if lhs.dtype == DType::F32 && rhs.dtype == DType::F32 => super::f32_matmul::cuda::matmul(lhs, rhs),
        Gemm::Wgmma | Gemm::Burn | Gemm::Quantized(_) => Cube::float_matmul(lhs, rhs),
    }
}

pub(crate) fn gemm_onto(x: CubeTensor, lhs: CubeTensor, rhs: CubeTensor, kind: Gemm, _link: NormLink) -> CubeTensor {
    let shape = x.meta.shape().clone();
    let flat = [lhs.meta.shape()[0], rhs.meta.shape()[1]];
    // A few rows (decoding) take the skinny product and an add.
    let fused = match kind {
        Gemm::Wgmma if flat[0] > super::skinny::MAX_ROWS => {
            crate::cuda::wgmma::gemm_onto(Cube::float_reshape(x.clone(), flat.into()), lhs.clone(), rhs.clone())
        }
        Gemm::Wgmma | Gemm::Burn | Gemm::Quantized(_) => None,
    };
    match fused {
        Some(sum) => Cube::float_reshape(sum, shape),
        None => Cube::float_add(x, Cube::float_reshape(gemm(lhs, rhs, kind), shape)),
    }
}

pub(crate) fn gemm_rotated(
    lhs: CubeTensor,
    rhs: CubeTensor,
    cos: CubeTensor,
    sin: CubeTensor,
    seq: usize,
    kind: Gemm,
) -> CubeTensor {
    // A few rows (decoding) take the skinny product and RoPE's kernel.
    let fused = match kind {
        Gemm::Wgmma if lhs.meta.shape()[0] > super::skinny::MAX_ROWS => {
            crate::cuda::wgmma::gemm_rotated(lhs.clone(), rhs.clone(), cos.clone(), sin.clone(), seq)
        }
        Gemm::Wgmma | Gemm::Burn | Gemm::Quantized(_) => None,
    };
    fused.unwrap_or_else(|| rotate_heads::<Cube>(gemm(lhs, rhs, kind), cos, sin, seq))
}
