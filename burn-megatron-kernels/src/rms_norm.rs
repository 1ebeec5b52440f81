//! RMSNorm, `y = x / √(mean(x²) + ε) · w` over the last dim, as a backend extension,
//! [`RmsNormOps`], with its own backward: on CUDA one kernel a row each way plus a column-sum
//! kernel for the weight's gradient ([`crate::row_kernels`]); elsewhere the tensor-op twin,
//! [`reference`]. Both normalize in f32, round to the input's dtype, then scale by the weight in
//! that dtype (Burn's and Hugging Face's order), and keep `rstd = 1/√(mean(x²) + ε)` per row
//! (f32, the input's shape with a last dim of 1) for the backward. Where an FP8 tensorwise
//! product quantizes the output next, the CUDA kernel leaves each row's largest magnitude for its
//! amax ([`NoteAmaxes`]).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, AutodiffBackend, Backend, Flex, backend_extension};
use burn::tensor::Tensor;

use crate::quant::notes::NoteAmaxes;

/// The backend extension behind [`rms_norm`].
#[backend_extension(Flex, Cube: cfg(feature = "cuda"), Autodiff)]
pub trait RmsNormOps: Backend {
    /// `(y, rstd)` for `x` `[.., c]` and `weight` `[c]`; `y`'s amax noted where
    /// `notes.output` asks (the input gradient's never is: the residual stream takes it).
    fn rms_norm(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        epsilon: f32,
        notes: NoteAmaxes,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// The gradients of `x` and `weight` given the output's.
    fn rms_norm_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
}

/// The plain tensor-op twin, on any backend's primitives: the CPU path and the kernels' oracle.
pub mod reference {
    use burn::backend::tensor::FloatTensor;
    use burn::backend::{Backend, Scalar, TensorMetadata};
    use burn::tensor::{FloatDType, Shape};

    fn f32<B: Backend>(t: FloatTensor<B>) -> FloatTensor<B> {
        B::float_cast(t, FloatDType::F32)
    }

    /// The weight `[c]` as `[1, .., 1, c]`, to broadcast against a rank-`rank` input.
    fn broadcast<B: Backend>(weight: FloatTensor<B>, rank: usize) -> FloatTensor<B> {
        let mut dims = vec![1; rank];
        dims[rank - 1] = weight.shape()[0];
        B::float_reshape(weight, Shape::from(dims))
    }

    pub fn forward<B: Backend>(
        x: FloatTensor<B>,
        weight: FloatTensor<B>,
        epsilon: f32,
    ) -> (FloatTensor<B>, FloatTensor<B>) {
        let dtype = FloatDType::from(x.dtype());
        let last = x.shape().num_dims() - 1;
        let weight = broadcast::<B>(weight, last + 1);
        let x = f32::<B>(x);
        let mean_square = B::float_mean_dim(B::float_mul(x.clone(), x.clone()), last);
        let rstd = B::float_recip(B::float_sqrt(B::float_add_scalar(mean_square, Scalar::from(epsilon))));
        let normed = B::float_cast(B::float_mul(x, rstd.clone()), dtype);
        (B::float_mul(normed, weight), rstd)
    }

    /// With `x̂ = x · rstd` and `gw = g ∘ w`: `dx = rstd · (gw − x̂ · mean(gw ∘ x̂))`,
    /// `dw = Σ_rows g ∘ x̂`.
    pub fn backward<B: Backend>(
        x: FloatTensor<B>,
        weight: FloatTensor<B>,
        rstd: FloatTensor<B>,
        grad: FloatTensor<B>,
    ) -> (FloatTensor<B>, FloatTensor<B>) {
        let (dtype, weight_dtype) = (FloatDType::from(x.dtype()), FloatDType::from(weight.dtype()));
        let shape = x.shape();
        let last = shape.num_dims() - 1;
        let columns = shape[last];
        let (x, weight, grad) = (f32::<B>(x), f32::<B>(broadcast::<B>(weight, last + 1)), f32::<B>(grad));
        let normed = B::float_mul(x, rstd.clone());
        let gw = B::float_mul(grad.clone(), weight);
        let mean = B::float_mean_dim(B::float_mul(gw.clone(), normed.clone()), last);
        let dx = B::float_mul(rstd, B::float_sub(gw, B::float_mul(normed.clone(), mean)));
        let rows = shape.num_elements() / columns;
        let dw = B::float_reshape(B::float_mul(grad, normed), Shape::from([rows, columns]));
        let dw = B::float_reshape(B::float_sum_dim(dw, 0), Shape::from([columns]));
        (B::float_cast(dx, dtype), B::float_cast(dw, weight_dtype))
    }
}

impl RmsNormOps for Flex {
    fn rms_norm(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        epsilon: f32,
        _: NoteAmaxes,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        reference::forward::<Flex>(x, weight, epsilon)
    }

    fn rms_norm_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        reference::backward::<Flex>(x, weight, rstd, grad)
    }
}

#[cfg(feature = "cuda")]
impl RmsNormOps for burn::backend::Cube {
    fn rms_norm(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        epsilon: f32,
        notes: NoteAmaxes,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        crate::row_kernels::forward(x, weight, epsilon, notes.output)
    }

    fn rms_norm_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        crate::row_kernels::backward(x, weight, rstd, grad)
    }
}

#[derive(Debug)]
struct RmsNormBackward;

impl<B: Backend + RmsNormOps> Backward<B, 2> for RmsNormBackward {
    /// x, the weight and rstd.
    type State = (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_weight] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (x, weight, rstd) = ops.state;
        let (dx, dw) = B::rms_norm_backward(x, weight, rstd, grad);
        for (node, grad) in [(node_x, dx), (node_weight, dw)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

impl<B: Backend + RmsNormOps, C: CheckpointStrategy> RmsNormOps for Autodiff<B, C> {
    fn rms_norm(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        epsilon: f32,
        notes: NoteAmaxes,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let nodes = [x.node(), weight.node()];
        let (x, weight) = (x.into_parts().0, weight.into_parts().0);
        let (y, rstd) = B::rms_norm(x.clone(), weight.clone(), epsilon, notes);
        let rstd_out = <Self as AutodiffBackend>::from_inner(rstd.clone());
        let y = match RmsNormBackward.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish((x, weight, rstd), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        };
        (y, rstd_out)
    }

    /// The inner backend's backward, as constants (no second-order gradients).
    fn rms_norm_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let inner = |t: FloatTensor<Self>| t.into_parts().0;
        let (dx, dw) = B::rms_norm_backward(inner(x), inner(weight), inner(rstd), inner(grad));
        (
            <Self as AutodiffBackend>::from_inner(dx),
            <Self as AutodiffBackend>::from_inner(dw),
        )
    }
}

/// RMSNorm of `x` over its last dim, scaled by `weight`, through [`RmsNormOps`], differentiable.
///
/// # Shapes
/// `[.., c]`, `[c]` → `[.., c]`
pub fn rms_norm<const D: usize>(x: Tensor<D>, weight: Tensor<1>, epsilon: f32) -> Tensor<D> {
    rms_norm_noting(x, weight, epsilon, NoteAmaxes::default())
}

/// [`rms_norm`], its output's amax taken as it is written where `notes.output` asks (CUDA), for
/// the FP8 tensorwise cast that quantizes it next.
pub fn rms_norm_noting<const D: usize>(x: Tensor<D>, weight: Tensor<1>, epsilon: f32, notes: NoteAmaxes) -> Tensor<D> {
    let (y, _) =
        <burn::backend::Dispatch as RmsNormOps>::rms_norm(x.into_dispatch(), weight.into_dispatch(), epsilon, notes);
    Tensor::from_dispatch(y)
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, Distribution, Tensor, Tolerance};

    /// On the CPU the extension is the layer's former formula differentiated by autodiff: the
    /// same values and gradients.
    #[test]
    fn matches_autodiff_with_gradients() {
        let device = Device::flex().autodiff();
        let x = Tensor::<3>::random([2, 5, 12], Distribution::Normal(0.0, 2.0), &device).require_grad();
        let w = Tensor::<1>::random([12], Distribution::Normal(1.0, 0.5), &device).require_grad();
        let ours = super::rms_norm(x.clone(), w.clone(), 1e-5);
        let rms = x.clone().square().mean_dim(2).add_scalar(1e-5).sqrt();
        let theirs = x.clone() / rms * w.clone().unsqueeze::<3>();
        // f32 both ways, the derivative written out instead of chained: a few ulps.
        let tolerance = Tolerance::absolute(1e-5);
        ours.to_data().assert_approx_eq::<f32>(&theirs.to_data(), tolerance);
        let weights = Tensor::<3>::random([2, 5, 12], Distribution::Normal(0.0, 1.0), &device);
        let (g1, g2) = (
            (ours * weights.clone()).sum().backward(),
            (theirs * weights).sum().backward(),
        );
        x.grad(&g1)
            .unwrap()
            .to_data()
            .assert_approx_eq::<f32>(&x.grad(&g2).unwrap().to_data(), tolerance);
        w.grad(&g1)
            .unwrap()
            .to_data()
            .assert_approx_eq::<f32>(&w.grad(&g2).unwrap().to_data(), tolerance);
    }
}
