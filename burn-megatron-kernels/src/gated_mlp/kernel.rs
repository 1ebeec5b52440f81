//! A SwiGLU MLP's products on CUDA: the gate's and up projection's products in one wgmma GEMM
//! with the SwiGLU in its epilogue, and the down projection's data gradient with the SwiGLU's
//! backward in its own, for bf16 products of our GEMM; the ops apart otherwise.

use burn::backend::Cube;
use burn_cubecl::tensor::CubeTensor;

use super::reference::{apart, down, down_backward_apart, swiglu_then_down};
use crate::gemm::Gemm;
use crate::rms_norm::link::NormLink;

pub(crate) fn gated_projection(
    x_gate: CubeTensor,
    x_up: CubeTensor,
    w_gate: CubeTensor,
    w_up: CubeTensor,
    kind: Gemm,
) -> (CubeTensor, CubeTensor, CubeTensor) {
    let fused = match kind {
        Gemm::Wgmma => crate::cuda::wgmma::gated_gemm(x_gate.clone(), w_gate.clone(), w_up.clone()),
        Gemm::Burn | Gemm::Quantized(_) => None,
    };
    fused.unwrap_or_else(|| apart::<Cube>(x_gate, x_up, w_gate, w_up, kind))
}

pub(crate) fn gated_mlp(
    x_gate: CubeTensor,
    x_up: CubeTensor,
    w_gate: CubeTensor,
    w_up: CubeTensor,
    w_down: CubeTensor,
    kind: Gemm,
) -> CubeTensor {
    let (hidden, ..) = gated_projection(x_gate, x_up, w_gate, w_up, kind);
    down::<Cube>(hidden, w_down, kind, None)
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn gated_mlp_onto(
    stream: CubeTensor,
    x_gate: CubeTensor,
    x_up: CubeTensor,
    w_gate: CubeTensor,
    w_up: CubeTensor,
    w_down: CubeTensor,
    kind: Gemm,
    link: NormLink,
) -> CubeTensor {
    let (hidden, ..) = gated_projection(x_gate, x_up, w_gate, w_up, kind);
    down::<Cube>(hidden, w_down, kind, Some((stream, link)))
}

pub(crate) fn swiglu_down(gate: CubeTensor, up: CubeTensor, w_down: CubeTensor, kind: Gemm) -> CubeTensor {
    swiglu_then_down::<Cube>(gate, up, w_down, kind)
}

pub(crate) fn gated_down_backward(
    grad: CubeTensor,
    w_down: CubeTensor,
    gate: CubeTensor,
    up: CubeTensor,
    kind: Gemm,
) -> (CubeTensor, CubeTensor) {
    let fused = match kind {
        Gemm::Wgmma => crate::cuda::wgmma::gated_dgrad(grad.clone(), w_down.clone(), gate.clone(), up.clone()),
        Gemm::Burn | Gemm::Quantized(_) => None,
    };
    fused.unwrap_or_else(|| down_backward_apart::<Cube>(grad, w_down, gate, up, kind))
}
