//! [`BlockAttention`] as one autodiff op, a Burn backend extension ([`ContextOps`]): the
//! concrete backends run its forward and backward on their own tensors; the `Autodiff`
//! implementation records one node keeping q, k, v, the output and its lse₂, whose backward
//! runs the block backward (sending and receiving over the cp group, every rank in the same
//! order). A failure to communicate in the forward pass is returned; in backward, which cannot
//! return it through Burn's `backward()`, it panics with the error's text.

use std::sync::{Arc, Mutex};

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, AutodiffBackend, Backend, DispatchKindConversion, Flex, backend_extension};
use burn::tensor::{BackendPrimitive, DispatchTensor, Float, Tensor};
use burn_megatron_dist::CommError;

use super::blocks::BlockAttention;

/// The op's parameters, and the first error its forward met (an extension op returns only
/// tensors).
#[derive(Clone, Debug)]
pub struct ContextOp {
    pub blocks: BlockAttention,
    error: Arc<Mutex<Option<CommError>>>,
}

/// The backend extension behind [`block_attention`].
#[backend_extension(Flex, Cube: cfg(feature = "cuda"), Autodiff)]
pub trait ContextOps: Backend {
    /// [`BlockAttention::forward`]: the output and lse₂.
    fn context_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        op: ContextOp,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// [`BlockAttention::backward`]: the gradients of q, k and v.
    #[allow(clippy::too_many_arguments)]
    fn context_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        op: ContextOp,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
}

/// The forward on a concrete backend; a failure is kept in `op` and zeros returned.
fn forward_concrete<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    op: &ContextOp,
) -> (FloatTensor<B>, FloatTensor<B>)
where
    Float: BackendPrimitive<B, Primitive = FloatTensor<B>>,
    DispatchTensor: DispatchKindConversion<B>,
{
    let t = |x| Tensor::<4>::from_primitive::<B>(x);
    let q = t(q);
    let (out, lse) = match op.blocks.forward(q.clone(), t(k), t(v)) {
        Ok(parts) => parts,
        Err(error) => {
            op.error.lock().expect("op error").get_or_insert(error);
            let [b, h, s, _] = q.dims();
            (q.zeros_like(), Tensor::zeros([b, h, s], &q.device()))
        }
    };
    let p4 = |x: Tensor<4>| x.try_into_primitive::<B>().expect("the backend's tensor");
    (p4(out), lse.try_into_primitive::<B>().expect("the backend's tensor"))
}

/// The backward on a concrete backend.
#[allow(clippy::too_many_arguments)]
fn backward_concrete<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    out: FloatTensor<B>,
    lse: FloatTensor<B>,
    grad: FloatTensor<B>,
    op: &ContextOp,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>)
where
    Float: BackendPrimitive<B, Primitive = FloatTensor<B>>,
    DispatchTensor: DispatchKindConversion<B>,
{
    let t = |x| Tensor::<4>::from_primitive::<B>(x);
    let lse = Tensor::<3>::from_primitive::<B>(lse);
    let (dq, dk, dv) = op
        .blocks
        .backward(t(q), t(k), t(v), t(out), lse, t(grad))
        .unwrap_or_else(|error| panic!("context-parallel attention's backward failed: {error}"));
    let p = |x: Tensor<4>| x.try_into_primitive::<B>().expect("the backend's tensor");
    (p(dq), p(dk), p(dv))
}

/// The concrete backends' implementation: the block attention on their own tensors.
macro_rules! concrete_context_ops {
    ($backend:ty) => {
        impl ContextOps for $backend {
            fn context_forward(
                q: FloatTensor<Self>,
                k: FloatTensor<Self>,
                v: FloatTensor<Self>,
                op: ContextOp,
            ) -> (FloatTensor<Self>, FloatTensor<Self>) {
                forward_concrete::<Self>(q, k, v, &op)
            }

            fn context_backward(
                q: FloatTensor<Self>,
                k: FloatTensor<Self>,
                v: FloatTensor<Self>,
                out: FloatTensor<Self>,
                lse: FloatTensor<Self>,
                grad: FloatTensor<Self>,
                op: ContextOp,
            ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
                backward_concrete::<Self>(q, k, v, out, lse, grad, &op)
            }
        }
    };
}

concrete_context_ops!(Flex);
#[cfg(feature = "cuda")]
concrete_context_ops!(burn::backend::Cube);

#[derive(Debug)]
struct ContextBackward;

impl<B: Backend + ContextOps> Backward<B, 3> for ContextBackward {
    /// q, k, v, the output and lse₂, and the op.
    type State = (
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        ContextOp,
    );

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_q, node_k, node_v] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (q, k, v, out, lse, op) = ops.state;
        let (dq, dk, dv) = B::context_backward(q, k, v, out, lse, grad, op);
        for (node, grad) in [(node_q, dq), (node_k, dk), (node_v, dv)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

impl<B: Backend + ContextOps, C: CheckpointStrategy> ContextOps for Autodiff<B, C> {
    fn context_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        op: ContextOp,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let nodes = [q.node(), k.node(), v.node()];
        let (q, k, v) = (q.into_parts().0, k.into_parts().0, v.into_parts().0);
        let (out, lse) = B::context_forward(q.clone(), k.clone(), v.clone(), op.clone());
        // lse₂ leaves as a constant: nothing differentiates through it.
        let lse_out = <Self as AutodiffBackend>::from_inner(lse.clone());
        let out = match ContextBackward.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish((q, k, v, out.clone(), lse, op), out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        };
        (out, lse_out)
    }

    /// The inner backend's backward, as constants (no second-order gradients).
    fn context_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        op: ContextOp,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let inner = |t: FloatTensor<Self>| t.into_parts().0;
        let (dq, dk, dv) = B::context_backward(inner(q), inner(k), inner(v), inner(out), inner(lse), inner(grad), op);
        let outer = |t| <Self as AutodiffBackend>::from_inner(t);
        (outer(dq), outer(dk), outer(dv))
    }
}

/// Causal attention of this rank's load-balanced chunks over the whole sequence, differentiable
/// (`blocks.rs`).
///
/// # Shapes
/// q `[b, h, 2L, d]`, k and v `[b, g, 2L, d]` → `[b, h, 2L, d]`
pub fn block_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    blocks: BlockAttention,
) -> Result<Tensor<4>, CommError> {
    let op = ContextOp {
        blocks,
        error: Arc::default(),
    };
    let (out, _) = <burn::backend::Dispatch as ContextOps>::context_forward(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        op.clone(),
    );
    if let Some(error) = op.error.lock().expect("op error").take() {
        return Err(error);
    }
    Ok(Tensor::from_dispatch(out))
}
