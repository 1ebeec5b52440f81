//! Softmax attention as a backend extension, [`AttentionOps`], with its own backward: on CUDA
//! the flash kernels of [`flash`] (bf16, head dim 128, smaller ones zero-padded to it: no O(s²)
//! memory), everywhere else, and for what those kernels do not take, the plain tensor-op twin in
//! [`reference`].
//!
//! Both paths keep, for the backward, the output and each query row's `lse₂`: the log₂ of the
//! sum of 2 to the power of its `scale · log₂(e)`-scaled scores (so `P = 2^(s·scale·log₂e − lse₂)`).
//!
//! Legend: `b` batch, `h` heads, `s` sequence, `d` head dim.

mod documents;
#[cfg(feature = "cuda")]
mod flash;
#[cfg(feature = "cuda")]
mod launch;
pub mod reference;
pub mod rotary;

pub use documents::document_attention;
#[cfg(feature = "cuda")]
pub use launch::{Unsupported, supports};
pub use rotary::{RotaryAttentionOps, rotary_attention, rotary_attention_rotated};

use crate::quant::notes::AmaxNotes;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Autodiff, AutodiffBackend, Backend};
use burn::tensor::{Int, Tensor};
use reference::Mask;

extension! {
    /// The backend extension behind [`attention`].
    pub trait AttentionOps, cuda: launch;

    /// `softmax(q·kᵀ·scale [+ causal mask]) · v` and each row's `lse₂` (f32); with `note`, the
    /// output's amax noted for the FP8 cast that quantizes it next where the kernel takes it
    /// (CUDA's flash kernel: [`crate::quant::notes`]).
    ///
    /// # Shapes
    /// `[b, h, s, d]` × 3 → `[b, h, s, d]`, `[b, h, s]`
    fn attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        causal: bool,
        scale: f32,
        note: Option<AmaxNotes>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let t = |x| Tensor::<4>::from_primitive::<Self>(x);
        let (out, lse) = reference::forward(t(q), t(k), t(v), causal, scale);
        (
            out.try_into_primitive::<Self>().expect("flex"),
            lse.try_into_primitive::<Self>().expect("flex"),
        )
    }

    /// The gradients of q, k and v, given the forward's output and `lse₂` and the output's
    /// gradient.
    fn attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        causal: bool,
        scale: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let t = |x| Tensor::<4>::from_primitive::<Self>(x);
        let lse = Tensor::<3>::from_primitive::<Self>(lse);
        let (dq, dk, dv) = reference::backward(t(q), t(k), t(v), t(out), lse, t(grad), causal, scale);
        let p = |x: Tensor<4>| x.try_into_primitive::<Self>().expect("flex");
        (p(dq), p(dk), p(dv))
    }

    /// [`attention_forward`](AttentionOps::attention_forward) of rows packing several documents
    /// ([`documents`]): each query sees the keys of its own document up to itself, `starts`
    /// `[b, s]` its document's first position. The f32 reference (the flash kernels on CUDA).
    fn document_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        starts: IntTensor<Self>,
        scale: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let t = |x| Tensor::<4>::from_primitive::<Self>(x);
        let starts = Tensor::<2, Int>::from_primitive::<Self>(starts);
        let (out, lse) = reference::forward_masked(t(q), t(k), t(v), Mask::Documents(&starts), scale);
        (
            out.try_into_primitive::<Self>().expect("flex"),
            lse.try_into_primitive::<Self>().expect("flex"),
        )
    }

    /// [`document_attention_forward`](AttentionOps::document_attention_forward)'s gradients.
    fn document_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        starts: IntTensor<Self>,
        scale: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let t = |x| Tensor::<4>::from_primitive::<Self>(x);
        let lse = Tensor::<3>::from_primitive::<Self>(lse);
        let starts = Tensor::<2, Int>::from_primitive::<Self>(starts);
        let mask = Mask::Documents(&starts);
        let (dq, dk, dv) = reference::backward_masked(t(q), t(k), t(v), t(out), lse, t(grad), mask, scale);
        let p = |x: Tensor<4>| x.try_into_primitive::<Self>().expect("flex");
        (p(dq), p(dk), p(dv))
    }
}

/// The keys a saved forward hid: above the diagonal (where causal), or outside each query's
/// document (`starts`).
#[derive(Clone, Debug)]
enum Hidden<B: Backend> {
    Causal(bool),
    Documents(IntTensor<B>),
}

#[derive(Debug)]
struct AttentionBackward;

impl<B: Backend + AttentionOps> Backward<B, 3> for AttentionBackward {
    /// q, k, v, the output and `lse₂`, the mask and the scale.
    type State = (
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        Hidden<B>,
        f32,
    );

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_q, node_k, node_v] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (q, k, v, out, lse, hidden, scale) = ops.state;
        let (dq, dk, dv) = match hidden {
            Hidden::Causal(causal) => B::attention_backward(q, k, v, out, lse, grad, causal, scale),
            Hidden::Documents(starts) => B::document_attention_backward(q, k, v, out, lse, grad, starts, scale),
        };
        for (node, grad) in [(node_q, dq), (node_k, dk), (node_v, dv)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

impl<B: Backend + AttentionOps, C: CheckpointStrategy> AttentionOps for Autodiff<B, C> {
    fn attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        causal: bool,
        scale: f32,
        note: Option<AmaxNotes>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        tracked::<B, C>([q, k, v], Hidden::Causal(causal), scale, |q, k, v| {
            B::attention_forward(q, k, v, causal, scale, note)
        })
    }

    /// The inner backend's backward, as constants (no second-order gradients).
    fn attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        causal: bool,
        scale: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        constant_grads::<B, C, 6>([q, k, v, out, lse, grad], |[q, k, v, out, lse, grad]| {
            B::attention_backward(q, k, v, out, lse, grad, causal, scale)
        })
    }

    fn document_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        starts: IntTensor<Self>,
        scale: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        tracked::<B, C>([q, k, v], Hidden::Documents(starts.clone()), scale, |q, k, v| {
            B::document_attention_forward(q, k, v, starts, scale)
        })
    }

    /// The inner backend's backward, as constants (no second-order gradients).
    fn document_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        starts: IntTensor<Self>,
        scale: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        constant_grads::<B, C, 6>([q, k, v, out, lse, grad], |[q, k, v, out, lse, grad]| {
            B::document_attention_backward(q, k, v, out, lse, grad, starts, scale)
        })
    }
}

/// An attention's output and `lse₂`.
type OutLse<B> = (FloatTensor<B>, FloatTensor<B>);

/// The gradients of q, k and v.
type Grads<B> = (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>);

/// An attention backward of the inner backend (`backward` of the `N` tensors' values), its
/// gradients as constants of the autodiff backend (no second-order gradients).
fn constant_grads<B: Backend, C: CheckpointStrategy, const N: usize>(
    tensors: [FloatTensor<Autodiff<B, C>>; N],
    backward: impl FnOnce([FloatTensor<B>; N]) -> Grads<B>,
) -> Grads<Autodiff<B, C>> {
    let (dq, dk, dv) = backward(tensors.map(|t| t.into_parts().0));
    let outer = |t| <Autodiff<B, C> as AutodiffBackend>::from_inner(t);
    (outer(dq), outer(dk), outer(dv))
}

/// The inner backend's attention (`forward` of q, k and v) as an op of the autodiff graph,
/// keeping q, k, v, the output, `lse₂` and what it hid for its backward; `lse₂` leaves as a
/// constant: nothing differentiates through it.
fn tracked<B: Backend + AttentionOps, C: CheckpointStrategy>(
    [q, k, v]: [FloatTensor<Autodiff<B, C>>; 3],
    hidden: Hidden<B>,
    scale: f32,
    forward: impl FnOnce(FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) -> OutLse<B>,
) -> OutLse<Autodiff<B, C>> {
    let nodes = [q.node(), k.node(), v.node()];
    let (q, k, v) = (q.into_parts().0, k.into_parts().0, v.into_parts().0);
    let (out, lse) = forward(q.clone(), k.clone(), v.clone());
    let lse_out = <Autodiff<B, C> as AutodiffBackend>::from_inner(lse.clone());
    let out = match AttentionBackward.prepare::<C>(nodes).compute_bound().stateful() {
        OpsKind::Tracked(prep) => prep.finish((q, k, v, out.clone(), lse, hidden, scale), out),
        OpsKind::UnTracked(prep) => prep.finish(out),
    };
    (out, lse_out)
}

/// Softmax attention `softmax(q·kᵀ / √d [+ causal mask]) · v` through [`AttentionOps`]:
/// differentiable, and on CUDA (bf16, head dim 128) flash attention.
///
/// # Shapes
/// `[b, h, s, d]` × 3 → `[b, h, s, d]`
pub fn attention(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, causal: bool) -> Tensor<4> {
    attention_noting(q, k, v, causal, None)
}

/// [`attention`]; with `note`, the output's amax noted where it is written (CUDA's flash
/// kernel) for the FP8 tensorwise cast of the product that reads it next
/// ([`crate::quant::notes`]): its `[b, s, h·d]` rows (the output with its dims swapped back).
///
/// # Shapes
/// `[b, h, s, d]` × 3 → `[b, h, s, d]`
pub fn attention_noting(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, causal: bool, note: Option<AmaxNotes>) -> Tensor<4> {
    let scale = (q.dims()[3] as f32).sqrt().recip();
    let (out, _) = <burn::backend::Dispatch as AttentionOps>::attention_forward(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        causal,
        scale,
        note,
    );
    Tensor::from_dispatch(out)
}

/// [`attention`]'s output and each row's `lse₂` (f32), with `scale` given: the pieces a caller
/// merging several blocks' attention by log-sum-exp needs (context parallelism). Not
/// differentiable: the caller's own backward takes [`attention_grads`].
///
/// # Shapes
/// `[b, h, s, d]` × 3 → `[b, h, s, d]`, `[b, h, s]`
pub fn attention_parts(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, causal: bool, scale: f32) -> (Tensor<4>, Tensor<3>) {
    let (out, lse) = <burn::backend::Dispatch as AttentionOps>::attention_forward(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        causal,
        scale,
        None,
    );
    (Tensor::from_dispatch(out), Tensor::from_dispatch(lse))
}

/// The gradients of q, k and v of one block of attention, from the output and `lse₂` of the
/// whole attention the block is part of (flash attention's backward: `P = 2^(s·scale·log₂e −
/// lse₂)`, `δ = rowsum(dO ∘ O)`), so each block's share adds up to the whole's gradient.
///
/// # Shapes
/// q `[b, h, s, d]`, k and v `[b, h, t, d]`, out and grad `[b, h, s, d]`, lse `[b, h, s]` →
/// the shapes of q, k, v
#[allow(clippy::too_many_arguments)]
pub fn attention_grads(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    out: Tensor<4>,
    lse: Tensor<3>,
    grad: Tensor<4>,
    causal: bool,
    scale: f32,
) -> (Tensor<4>, Tensor<4>, Tensor<4>) {
    let (dq, dk, dv) = <burn::backend::Dispatch as AttentionOps>::attention_backward(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        out.into_dispatch(),
        lse.into_dispatch(),
        grad.into_dispatch(),
        causal,
        scale,
    );
    (
        Tensor::from_dispatch(dq),
        Tensor::from_dispatch(dk),
        Tensor::from_dispatch(dv),
    )
}
