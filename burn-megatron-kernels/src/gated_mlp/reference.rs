//! A SwiGLU MLP's products as separate ops, on any backend with the products and the SwiGLU:
//! the CPU path of [`GatedOps`](super::GatedOps), and CUDA's where its fused kernels do not take
//! the operands.

use burn::backend::tensor::FloatTensor;

use crate::gemm::{Gemm, GemmOps};
use crate::quant::notes::NoteAmaxes;
use crate::rms_norm::link::NormLink;
use crate::swiglu::SwigluOps;

/// The two products and the SwiGLU, each its own op.
pub(crate) fn apart<B: GemmOps + SwigluOps>(
    x_gate: FloatTensor<B>,
    x_up: FloatTensor<B>,
    w_gate: FloatTensor<B>,
    w_up: FloatTensor<B>,
    kind: Gemm,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    let (gate, up) = (B::gemm(x_gate, w_gate, kind), B::gemm(x_up, w_up, kind));
    (B::swiglu(gate.clone(), up.clone(), NoteAmaxes::default()), gate, up)
}

/// `hidden · w_down`, onto the residual stream where given.
pub(crate) fn down<B: GemmOps>(
    hidden: FloatTensor<B>,
    w_down: FloatTensor<B>,
    kind: Gemm,
    onto: Option<(FloatTensor<B>, NormLink)>,
) -> FloatTensor<B> {
    match onto {
        Some((x, link)) => B::gemm_onto(x, hidden, w_down, kind, link),
        None => B::gemm(hidden, w_down, kind),
    }
}

/// The SwiGLU, then the down projection, each its own op.
pub(crate) fn swiglu_then_down<B: GemmOps + SwigluOps>(
    gate: FloatTensor<B>,
    up: FloatTensor<B>,
    w_down: FloatTensor<B>,
    kind: Gemm,
) -> FloatTensor<B> {
    B::gemm(B::swiglu(gate, up, NoteAmaxes::default()), w_down, kind)
}

/// The down projection's data gradient, then the SwiGLU's backward, each its own op.
pub(crate) fn down_backward_apart<B: GemmOps + SwigluOps>(
    grad: FloatTensor<B>,
    w_down: FloatTensor<B>,
    gate: FloatTensor<B>,
    up: FloatTensor<B>,
    kind: Gemm,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let hidden_grad = B::gemm(grad, B::float_transpose(w_down), kind);
    B::swiglu_backward(gate, up, hidden_grad, None)
}
