//! A mixture of experts' router product in f32, [`RouterOps`]: `logits = x · w` for `t` tokens of
//! `d` features and `e` experts, the products and sums in f32 whatever the operands' dtypes
//! (the router scores in f32, as Megatron's `router_dtype = fp32` and PyTorch's default do), with
//! both gradients.
//!
//! With `e` small (32 for moe-4b) the three products are skinny: Burn's matmul on CUDA took
//! 0.12 ms forward and 0.39 ms for a gradient on moe-4b's `[8192, 2048] · [2048, 32]` on an H200
//! (TF32 tiles on a shape that fills few of them), on top of casting `x` to f32 and back. On
//! CUDA each direction here is one kernel reading `x` in its own dtype (the weight's gradient
//! two: partial sums over slices of the tokens, then their sum, in a fixed order), the experts
//! in groups of 32 (DeepSeek-style counts of 64–256 too); elsewhere the tensor-op twin
//! ([`reference`]), which CUDA also takes for shapes past u32 indices, with the f32 product of
//! [`crate::gemm::f32_matmul`] (no TF32).
//!
//! Legend: `t` tokens, `d` features, `e` experts.

use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, binary};
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, AutodiffBackend, Backend, TensorMetadata};
use burn::tensor::{FloatDType, Tensor};

#[cfg(feature = "cuda")]
pub(crate) mod kernel;
pub mod reference;

extension! {
    /// The backend extension behind [`logits`].
    pub trait RouterOps, cuda: kernel;

    /// `x · w` in f32.
    ///
    /// # Shapes
    /// `x`: `[t, d]`, `w`: `[d, e]` → `[t, e]` (f32)
    fn router_logits(x: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self> {
        reference::logits::<Self>(x, w, Self::float_matmul)
    }

    /// `grad · wᵀ` in f32, rounded to `dtype` (the input's).
    ///
    /// # Shapes
    /// `grad`: `[t, e]`, `w`: `[d, e]` → `[t, d]`
    fn router_logits_dx(grad: FloatTensor<Self>, w: FloatTensor<Self>, dtype: FloatDType) -> FloatTensor<Self> {
        reference::dx::<Self>(grad, w, dtype, Self::float_matmul)
    }

    /// `xᵀ · grad` in f32, rounded to `dtype` (the weight's).
    ///
    /// # Shapes
    /// `x`: `[t, d]`, `grad`: `[t, e]` → `[d, e]`
    fn router_logits_dw(x: FloatTensor<Self>, grad: FloatTensor<Self>, dtype: FloatDType) -> FloatTensor<Self> {
        reference::dw::<Self>(x, grad, dtype, Self::float_matmul)
    }
}

#[derive(Debug)]
struct LogitsBackward;

impl<B: Backend + RouterOps> Backward<B, 2> for LogitsBackward {
    /// `x` (for the weight's gradient), `w` (for the input's), and both dtypes.
    type State = (Option<NodeId>, Option<NodeId>, FloatDType, FloatDType);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, checkpointer: &mut Checkpointer) {
        let (x, w, x_dtype, w_dtype) = ops.state;
        let x: Option<FloatTensor<B>> = x.map(|id| checkpointer.retrieve_node_output(id));
        let w: Option<FloatTensor<B>> = w.map(|id| checkpointer.retrieve_node_output(id));
        binary::<B, _, _>(
            ops.parents,
            ops.node,
            grads,
            |grad| B::router_logits_dx(grad, w.expect("w saved for the input's gradient"), x_dtype),
            |grad| B::router_logits_dw(x.expect("x saved for the weight's gradient"), grad, w_dtype),
        );
    }
}

impl<B: Backend + RouterOps, C: CheckpointStrategy> RouterOps for Autodiff<B, C> {
    fn router_logits(x: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self> {
        let (x_tracked, w_tracked) = (x.is_tracked(), w.is_tracked());
        let dtypes = (FloatDType::from(x.dtype()), FloatDType::from(w.dtype()));
        match LogitsBackward
            .prepare::<C>([x.node(), w.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                // Each operand is kept for the other's gradient.
                let x_state = w_tracked.then(|| prep.checkpoint(&x));
                let w_state = x_tracked.then(|| prep.checkpoint(&w));
                let out = B::router_logits(x.into_parts().0, w.into_parts().0);
                prep.finish((x_state, w_state, dtypes.0, dtypes.1), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::router_logits(x.into_parts().0, w.into_parts().0)),
        }
    }

    fn router_logits_dx(grad: FloatTensor<Self>, w: FloatTensor<Self>, dtype: FloatDType) -> FloatTensor<Self> {
        <Self as AutodiffBackend>::from_inner(B::router_logits_dx(grad.into_parts().0, w.into_parts().0, dtype))
    }

    fn router_logits_dw(x: FloatTensor<Self>, grad: FloatTensor<Self>, dtype: FloatDType) -> FloatTensor<Self> {
        <Self as AutodiffBackend>::from_inner(B::router_logits_dw(x.into_parts().0, grad.into_parts().0, dtype))
    }
}

/// `x · w` with the products and sums in f32 (f32 out), differentiable in both: the input's
/// gradient comes back in `x`'s dtype, the weight's in `w`'s.
///
/// # Shapes
/// `x`: `[t, d]`, `w`: `[d, e]` → `[t, e]`
pub fn logits(x: Tensor<2>, w: Tensor<2>) -> Tensor<2> {
    assert_eq!(x.dims()[1], w.dims()[0], "the router's features");
    Tensor::from_dispatch(<burn::backend::Dispatch as RouterOps>::router_logits(
        x.into_dispatch(),
        w.into_dispatch(),
    ))
}

#[cfg(test)]
mod tests {
    use burn::tensor::{DType, Device, Distribution, Tensor, Tolerance};

    /// Against Burn's own f32 matmul with autodiff, bf16 inputs: the logits in f32 and both
    /// gradients in their operands' dtypes.
    #[test]
    fn matches_burns_matmul_in_f32() {
        let device = Device::flex().autodiff();
        let normal = Distribution::Normal(0.0, 1.0);
        let x = Tensor::<2>::random([9, 12], normal, (&device, DType::BF16)).require_grad();
        let w = Tensor::<2>::random([12, 5], normal, (&device, DType::F32)).require_grad();
        let ours = super::logits(x.clone(), w.clone());
        let theirs = x.clone().cast(DType::F32).matmul(w.clone());
        assert_eq!(ours.dtype(), DType::F32);
        // The same f32 products of the same values: equal up to the order of the sums.
        let tolerance = Tolerance::absolute(1e-4);
        ours.to_data().assert_approx_eq::<f32>(&theirs.to_data(), tolerance);
        let dy = Tensor::<2>::random([9, 5], normal, (&device, DType::F32));
        let (g1, g2) = ((ours * dy.clone()).sum().backward(), (theirs * dy).sum().backward());
        let (dx, dx_ref) = (x.grad(&g1).unwrap(), x.grad(&g2).unwrap());
        assert_eq!(dx.dtype(), DType::BF16);
        // Both rounded to bf16 once from f32 sums: one bf16 step of 2⁻⁸ relative at most.
        dx.cast(DType::F32)
            .to_data()
            .assert_approx_eq::<f32>(&dx_ref.cast(DType::F32).to_data(), Tolerance::rel_abs(1e-2, 1e-3));
        let (dw, dw_ref) = (w.grad(&g1).unwrap(), w.grad(&g2).unwrap());
        dw.to_data().assert_approx_eq::<f32>(&dw_ref.to_data(), tolerance);
    }
}
