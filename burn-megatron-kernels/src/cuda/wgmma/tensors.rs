//! The GEMMs on Burn tensors (CUDA, without autodiff), for the kernel suite and the GEMM study.

use burn::backend::Cube;
use burn_cubecl::tensor::CubeTensor;

use super::{Accumulation, BScales, Schedule, WgmmaError, fp8_blockwise_gemm, fp8_gemm, gemm};
use crate::quant::format::Minifloat;

/// [`gemm`] on Burn tensors (CUDA, without autodiff): for the kernel suite and the GEMM study.
///
/// # Shapes
/// `[m, k]`, `[k, n]` → `[m, n]`
pub fn matmul(
    lhs: burn::tensor::Tensor<2>,
    rhs: burn::tensor::Tensor<2>,
    schedule: Schedule,
) -> Result<burn::tensor::Tensor<2>, WgmmaError> {
    let lhs: CubeTensor = lhs.try_into_primitive::<Cube>().map_err(|_| WgmmaError::NotCuda)?;
    let rhs: CubeTensor = rhs.try_into_primitive::<Cube>().map_err(|_| WgmmaError::NotCuda)?;
    Ok(burn::tensor::Tensor::from_primitive::<Cube>(gemm(lhs, rhs, schedule)?))
}

/// [`fp8_gemm`] on Burn tensors (CUDA, without autodiff): `a` `[m, k]` and `b` `[n, k]` u8
/// codes, their dequantization scales `[1]` f32.
///
/// # Shapes
/// `[m, k]`, `[n, k]`, `[1]` and `[1]` → `[m, n]`
pub fn fp8_matmul(
    a: burn::tensor::Tensor<2, burn::tensor::Int>,
    b: burn::tensor::Tensor<2, burn::tensor::Int>,
    formats: (Minifloat, Minifloat),
    [scale_a, scale_b]: [burn::tensor::Tensor<1>; 2],
    schedule: Schedule,
    accumulation: Accumulation,
) -> Result<burn::tensor::Tensor<2>, WgmmaError> {
    let a: CubeTensor = a.try_into_primitive::<Cube>().map_err(|_| WgmmaError::NotCuda)?;
    let b: CubeTensor = b.try_into_primitive::<Cube>().map_err(|_| WgmmaError::NotCuda)?;
    let cuda = |t: burn::tensor::Tensor<1>| t.try_into_primitive::<Cube>().map_err(|_| WgmmaError::NotCuda);
    let scales = [cuda(scale_a)?, cuda(scale_b)?];
    Ok(burn::tensor::Tensor::from_primitive::<Cube>(fp8_gemm(
        a,
        b,
        formats,
        scales,
        schedule,
        accumulation,
    )?))
}

/// [`fp8_blockwise_gemm`] on Burn tensors (CUDA, without autodiff): codes u8, scales f32.
///
/// # Shapes
/// `[m, k]`, `[m, ⌈k/128⌉]`, `[n, k]`, `[⌈n/128⌉ or n, ⌈k/128⌉]` → `[m, n]`
pub fn fp8_blockwise_matmul(
    a: (burn::tensor::Tensor<2, burn::tensor::Int>, burn::tensor::Tensor<2>),
    b: (burn::tensor::Tensor<2, burn::tensor::Int>, burn::tensor::Tensor<2>),
    b_blocks: BScales,
    formats: (Minifloat, Minifloat),
) -> Result<burn::tensor::Tensor<2>, WgmmaError> {
    let codes =
        |t: burn::tensor::Tensor<2, burn::tensor::Int>| t.try_into_primitive::<Cube>().map_err(|_| WgmmaError::NotCuda);
    let scales = |t: burn::tensor::Tensor<2>| t.try_into_primitive::<Cube>().map_err(|_| WgmmaError::NotCuda);
    Ok(burn::tensor::Tensor::from_primitive::<Cube>(fp8_blockwise_gemm(
        (codes(a.0)?, scales(a.1)?),
        (codes(b.0)?, scales(b.1)?),
        b_blocks,
        formats,
    )?))
}
