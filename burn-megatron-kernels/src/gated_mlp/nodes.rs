//! [`GatedOps`] under autodiff: the gate's and up projection's results are the outputs of the
//! product nodes the ops apart would make ([`gemm_node`]), the down projection's that of a node
//! with three parents (both and the down weight), and a stream it is added onto the parent of
//! a residual add's node ([`residual_node`]).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, TensorMetadata};

use super::GatedOps;
use super::reference::down;
use crate::gemm::{Gemm, GemmOps, gemm_node};
use crate::quant::notes::NoteAmaxes;
use crate::rms_norm::link::{NormLink, residual_node};
use crate::swiglu::SwigluOps;

/// The down projection of a SwiGLU: its parents the gate's and up projection's products and the
/// down weight.
#[derive(Debug)]
struct GatedDownBackward;

impl<B: Backend + GatedOps + GemmOps> Backward<B, 3> for GatedDownBackward {
    /// The gate's and up projection's products, the SwiGLU of them, the down weight, the product.
    type State = (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>, FloatTensor<B>, Gemm);

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_gate, node_up, node_down] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (gate, up, hidden, w_down, kind) = ops.state;
        if let Some(node) = node_down {
            // d w_down = hiddenᵀ · d out: [n, m] · [m, o]
            grads.register::<B>(node.id, B::gemm(B::float_transpose(hidden), grad.clone(), kind));
        }
        if node_gate.is_some() || node_up.is_some() {
            let (d_gate, d_up) = B::gated_down_backward(grad, w_down, gate, up, kind);
            for (node, grad) in [(node_gate, d_gate), (node_up, d_up)] {
                if let Some(node) = node {
                    grads.register::<B>(node.id, grad);
                }
            }
        }
    }
}

impl<B: Backend + GatedOps + GemmOps + SwigluOps, C: CheckpointStrategy> GatedOps for Autodiff<B, C> {
    fn gated_projection(
        x_gate: FloatTensor<Self>,
        x_up: FloatTensor<Self>,
        w_gate: FloatTensor<Self>,
        w_up: FloatTensor<Self>,
        kind: Gemm,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let inner = |t: &FloatTensor<Self>| t.clone().into_parts().0;
        let (out, gate, up) = B::gated_projection(inner(&x_gate), inner(&x_up), inner(&w_gate), inner(&w_up), kind);
        let gate = gemm_node::<B, C>(x_gate, w_gate, kind, gate);
        let up = gemm_node::<B, C>(x_up, w_up, kind, up);
        let out = crate::swiglu::swiglu_node::<B, C>(gate.clone(), up.clone(), None, out);
        (out, gate, up)
    }

    fn gated_mlp(
        x_gate: FloatTensor<Self>,
        x_up: FloatTensor<Self>,
        w_gate: FloatTensor<Self>,
        w_up: FloatTensor<Self>,
        w_down: FloatTensor<Self>,
        kind: Gemm,
    ) -> FloatTensor<Self> {
        mlp_nodes::<B, C>(x_gate, x_up, w_gate, w_up, w_down, kind, None)
    }

    fn gated_mlp_onto(
        stream: FloatTensor<Self>,
        x_gate: FloatTensor<Self>,
        x_up: FloatTensor<Self>,
        w_gate: FloatTensor<Self>,
        w_up: FloatTensor<Self>,
        w_down: FloatTensor<Self>,
        kind: Gemm,
        link: NormLink,
    ) -> FloatTensor<Self> {
        mlp_nodes::<B, C>(x_gate, x_up, w_gate, w_up, w_down, kind, Some((stream, link)))
    }

    fn swiglu_down(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        w_down: FloatTensor<Self>,
        kind: Gemm,
    ) -> FloatTensor<Self> {
        let inner = |t: &FloatTensor<Self>| t.clone().into_parts().0;
        let hidden = B::swiglu(inner(&gate), inner(&up), NoteAmaxes::default());
        down_node::<B, C>(gate, up, w_down, hidden, kind, None)
    }

    /// The inner backend's backward, as constants (no second-order gradients).
    fn gated_down_backward(
        grad: FloatTensor<Self>,
        w_down: FloatTensor<Self>,
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        kind: Gemm,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let inner = |t: FloatTensor<Self>| t.into_parts().0;
        let (d_gate, d_up) = B::gated_down_backward(inner(grad), inner(w_down), inner(gate), inner(up), kind);
        let outer = |t| <Self as burn::backend::AutodiffBackend>::from_inner(t);
        (outer(d_gate), outer(d_up))
    }
}

/// The gated projection's two product nodes on the inner backend's one kernel, then
/// [`down_node`].
fn mlp_nodes<B: Backend + GatedOps + GemmOps + SwigluOps, C: CheckpointStrategy>(
    x_gate: FloatTensor<Autodiff<B, C>>,
    x_up: FloatTensor<Autodiff<B, C>>,
    w_gate: FloatTensor<Autodiff<B, C>>,
    w_up: FloatTensor<Autodiff<B, C>>,
    w_down: FloatTensor<Autodiff<B, C>>,
    kind: Gemm,
    onto: Option<(FloatTensor<Autodiff<B, C>>, NormLink)>,
) -> FloatTensor<Autodiff<B, C>> {
    let inner = |t: &FloatTensor<Autodiff<B, C>>| t.clone().into_parts().0;
    let (hidden, gate, up) = B::gated_projection(inner(&x_gate), inner(&x_up), inner(&w_gate), inner(&w_up), kind);
    let gate = gemm_node::<B, C>(x_gate, w_gate, kind, gate);
    let up = gemm_node::<B, C>(x_up, w_up, kind, up);
    down_node::<B, C>(gate, up, w_down, hidden, kind, onto)
}

/// `hidden · w_down` (`hidden` the inner backend's `silu(gate) ∘ up`, computed by the caller) as
/// the output of a node whose parents are `gate`, `up` and `w_down`: its backward is
/// [`GatedOps::gated_down_backward`] and the down weight's gradient. With `onto`, the residual
/// stream and its norm's link, the product is added onto the stream in its kernel
/// ([`GemmOps::gemm_onto`]): the node's output is the sum, which only the residual add's node
/// reads.
fn down_node<B: Backend + GatedOps + GemmOps, C: CheckpointStrategy>(
    gate: FloatTensor<Autodiff<B, C>>,
    up: FloatTensor<Autodiff<B, C>>,
    w_down: FloatTensor<Autodiff<B, C>>,
    hidden: FloatTensor<B>,
    kind: Gemm,
    onto: Option<(FloatTensor<Autodiff<B, C>>, NormLink)>,
) -> FloatTensor<Autodiff<B, C>> {
    let w_down_inner = w_down.clone().into_parts().0;
    let stream = onto.as_ref().map(|(x, link)| (x.clone().into_parts().0, link.clone()));
    let sum = down::<B>(hidden.clone(), w_down_inner.clone(), kind, stream);
    let out = B::float_reshape(sum.clone(), [hidden.shape()[0], w_down_inner.shape()[1]].into());
    let nodes = [gate.node(), up.node(), w_down.node()];
    let down = match GatedDownBackward.prepare::<C>(nodes).compute_bound().stateful() {
        OpsKind::Tracked(prep) => {
            let (gate, up) = (gate.into_parts().0, up.into_parts().0);
            prep.finish((gate, up, hidden, w_down_inner, kind), out)
        }
        OpsKind::UnTracked(prep) => prep.finish(out),
    };
    match onto {
        Some((x, link)) => {
            let branch = Autodiff::<B, C>::float_reshape(down, x.shape());
            residual_node::<B, C>(x, branch, link, sum)
        }
        None => down,
    }
}
