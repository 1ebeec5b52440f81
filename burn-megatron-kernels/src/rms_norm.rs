//! RMSNorm, `y = x / √(mean(x²) + ε) · w` over the last dim, as a backend extension,
//! [`RmsNormOps`], with its own backward: on CUDA one kernel a row each way plus a column-sum
//! kernel for the weight's gradient ([`crate::row_kernels`]); elsewhere the tensor-op twin,
//! [`reference`]. Both normalize in f32, round to the input's dtype, then scale by the weight in
//! that dtype (Burn's and Hugging Face's order), and keep `rstd = 1/√(mean(x²) + ε)` per row
//! (f32, the input's shape with a last dim of 1) for the backward. Where an FP8 tensorwise
//! product quantizes the output next, the CUDA kernel leaves each row's largest magnitude for its
//! amax ([`NoteAmaxes`]).
//!
//! A pre-norm block normalizes its residual stream `x` and adds a branch computed from the
//! result back to it: `h = x + f(rms_norm(x))`. `x`'s gradient is then the sum of `h`'s and the
//! norm's input gradient, which autodiff would add in a pass of its own. Linked by a
//! [`ResidualLink`] ([`rms_norm_linked`], [`residual_add`]), the add hands `h`'s gradient to the
//! norm's backward, whose kernel adds it as it writes `dx` (one read, one rounding) and can take
//! the sum's amax for the FP8 casts of the previous block's products that read it next.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, AutodiffBackend, Backend, Flex, backend_extension};
use burn::tensor::Tensor;
use std::sync::{Arc, Mutex};

use crate::quant::notes::NoteAmaxes;

/// Where a residual add ([`residual_add`]) hands its input's gradient to the backward of the
/// RMSNorm of the same input ([`rms_norm_linked`]), which adds it to the gradient it writes. The
/// norm's backward runs after the add's (the branch the add sums is computed from the norm's
/// output), so the gradient is always handed over before it is taken; where the norm is not
/// differentiated (an untracked input) the add registers the gradient itself.
#[derive(Clone, Debug, Default)]
pub struct ResidualLink(Arc<Mutex<Linked>>);

#[derive(Debug, Default)]
struct Linked {
    /// A differentiated norm will take the gradient.
    norm: bool,
    /// The gradient handed over, a backend's float primitive.
    grad: Option<Box<dyn std::any::Any + Send>>,
}

impl ResidualLink {
    fn lock(&self) -> std::sync::MutexGuard<'_, Linked> {
        self.0.lock().expect("a residual link's lock")
    }
}

/// The backend extension behind [`rms_norm`].
#[backend_extension(Flex, Cube: cfg(feature = "cuda"), Autodiff)]
pub trait RmsNormOps: Backend {
    /// `(y, rstd)` for `x` `[.., c]` and `weight` `[c]`; `y`'s amax noted where
    /// `notes.output` asks, the input gradient's where `notes.input_grads` does; the gradient
    /// `link`'s residual add hands over added to the input gradient.
    fn rms_norm(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        epsilon: f32,
        notes: NoteAmaxes,
        link: Option<ResidualLink>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// The gradients of `x` (its amax noted where `note`) and of `weight` given the output's.
    fn rms_norm_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        note: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// [`rms_norm_backward`](Self::rms_norm_backward) with `residual` added to `x`'s gradient
    /// (in f32, rounded once).
    fn rms_norm_backward_adding(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        residual: FloatTensor<Self>,
        note: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// `x + branch`; differentiated, `x`'s gradient goes to `link`'s norm.
    fn residual_add(x: FloatTensor<Self>, branch: FloatTensor<Self>, link: ResidualLink) -> FloatTensor<Self>;
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

    /// With `x̂ = x · rstd` and `gw = g ∘ w`: `dx = rstd · (gw − x̂ · mean(gw ∘ x̂))` (plus
    /// `residual`, in f32), `dw = Σ_rows g ∘ x̂`.
    pub fn backward<B: Backend>(
        x: FloatTensor<B>,
        weight: FloatTensor<B>,
        rstd: FloatTensor<B>,
        grad: FloatTensor<B>,
        residual: Option<FloatTensor<B>>,
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
        let dx = match residual {
            Some(residual) => B::float_add(dx, f32::<B>(residual)),
            None => dx,
        };
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
        _: Option<ResidualLink>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        reference::forward::<Flex>(x, weight, epsilon)
    }

    fn rms_norm_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        _: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        reference::backward::<Flex>(x, weight, rstd, grad, None)
    }

    fn rms_norm_backward_adding(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        residual: FloatTensor<Self>,
        _: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        reference::backward::<Flex>(x, weight, rstd, grad, Some(residual))
    }

    fn residual_add(x: FloatTensor<Self>, branch: FloatTensor<Self>, _: ResidualLink) -> FloatTensor<Self> {
        use burn::backend::ops::FloatTensorOps;
        Flex::float_add(x, branch)
    }
}

#[cfg(feature = "cuda")]
impl RmsNormOps for burn::backend::Cube {
    fn rms_norm(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        epsilon: f32,
        notes: NoteAmaxes,
        _: Option<ResidualLink>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        crate::row_kernels::forward(x, weight, epsilon, notes.output)
    }

    fn rms_norm_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        note: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        crate::row_kernels::backward(x, weight, rstd, grad, None, note)
    }

    fn rms_norm_backward_adding(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        residual: FloatTensor<Self>,
        note: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        crate::row_kernels::backward(x, weight, rstd, grad, Some(residual), note)
    }

    fn residual_add(x: FloatTensor<Self>, branch: FloatTensor<Self>, _: ResidualLink) -> FloatTensor<Self> {
        use burn::backend::ops::FloatTensorOps;
        Self::float_add(x, branch)
    }
}

#[derive(Debug)]
struct RmsNormBackward;

impl<B: Backend + RmsNormOps> Backward<B, 2> for RmsNormBackward {
    /// x, the weight and rstd; whether to note the input gradient's amax, and where a residual
    /// add hands over its input's gradient.
    type State = (
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        bool,
        Option<ResidualLink>,
    );

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_weight] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (x, weight, rstd, note, link) = ops.state;
        let residual = link.and_then(|link| link.lock().grad.take());
        let (dx, dw) = match residual {
            Some(r) => {
                let residual = *r.downcast::<FloatTensor<B>>().expect("the residual add's gradient");
                B::rms_norm_backward_adding(x, weight, rstd, grad, residual, note)
            }
            None => B::rms_norm_backward(x, weight, rstd, grad, note),
        };
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
        link: Option<ResidualLink>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let x_tracked = x.is_tracked();
        let nodes = [x.node(), weight.node()];
        let (x, weight) = (x.into_parts().0, weight.into_parts().0);
        let (y, rstd) = B::rms_norm(x.clone(), weight.clone(), epsilon, notes, None);
        let rstd_out = <Self as AutodiffBackend>::from_inner(rstd.clone());
        let y = match RmsNormBackward.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                // Only a differentiated input takes the add's gradient.
                let link = link.filter(|_| x_tracked);
                if let Some(link) = &link {
                    link.lock().norm = true;
                }
                prep.finish((x, weight, rstd, notes.input_grads, link), y)
            }
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
        note: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let inner = |t: FloatTensor<Self>| t.into_parts().0;
        let (dx, dw) = B::rms_norm_backward(inner(x), inner(weight), inner(rstd), inner(grad), note);
        (
            <Self as AutodiffBackend>::from_inner(dx),
            <Self as AutodiffBackend>::from_inner(dw),
        )
    }

    fn rms_norm_backward_adding(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        residual: FloatTensor<Self>,
        note: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let inner = |t: FloatTensor<Self>| t.into_parts().0;
        let (dx, dw) =
            B::rms_norm_backward_adding(inner(x), inner(weight), inner(rstd), inner(grad), inner(residual), note);
        (
            <Self as AutodiffBackend>::from_inner(dx),
            <Self as AutodiffBackend>::from_inner(dw),
        )
    }

    fn residual_add(x: FloatTensor<Self>, branch: FloatTensor<Self>, link: ResidualLink) -> FloatTensor<Self> {
        let nodes = [x.node(), branch.node()];
        let (x, branch) = (x.into_parts().0, branch.into_parts().0);
        let sum = B::float_add(x, branch);
        match ResidualBackward.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(link, sum),
            OpsKind::UnTracked(prep) => prep.finish(sum),
        }
    }
}

#[derive(Debug)]
struct ResidualBackward;

impl<B: Backend> Backward<B, 2> for ResidualBackward {
    type State = ResidualLink;

    /// The sum's gradient is the branch's, and `x`'s: handed to the linked norm where one is
    /// differentiated (it adds it to its own), else registered here.
    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_branch] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        if let Some(node) = node_branch {
            grads.register::<B>(node.id, grad.clone());
        }
        if let Some(node) = node_x {
            let mut linked = ops.state.lock();
            match linked.norm && linked.grad.is_none() {
                true => linked.grad = Some(Box::new(grad)),
                false => grads.register::<B>(node.id, grad),
            }
        }
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
    norm(x, weight, epsilon, notes, None)
}

/// [`rms_norm_noting`] of a residual stream `x`, linked to the [`residual_add`] that adds a
/// branch computed from this norm's output back to `x`: the norm's backward adds the add's
/// gradient into `x`'s as it writes it, and notes the sum's amax where `notes.input_grads` asks.
pub fn rms_norm_linked<const D: usize>(
    x: Tensor<D>,
    weight: Tensor<1>,
    epsilon: f32,
    notes: NoteAmaxes,
    link: &ResidualLink,
) -> Tensor<D> {
    norm(x, weight, epsilon, notes, Some(link.clone()))
}

fn norm<const D: usize>(
    x: Tensor<D>,
    weight: Tensor<1>,
    epsilon: f32,
    notes: NoteAmaxes,
    link: Option<ResidualLink>,
) -> Tensor<D> {
    let (y, _) = <burn::backend::Dispatch as RmsNormOps>::rms_norm(
        x.into_dispatch(),
        weight.into_dispatch(),
        epsilon,
        notes,
        link,
    );
    Tensor::from_dispatch(y)
}

/// `x + branch`, where `branch` is computed from the output of `x`'s [`rms_norm_linked`] with
/// the same `link`: `x`'s gradient then reaches `x` through that norm's backward, added by its
/// kernel, instead of by a pass of its own.
///
/// # Shapes
/// both of one shape
pub fn residual_add<const D: usize>(x: Tensor<D>, branch: Tensor<D>, link: &ResidualLink) -> Tensor<D> {
    Tensor::from_dispatch(<burn::backend::Dispatch as RmsNormOps>::residual_add(
        x.into_dispatch(),
        branch.into_dispatch(),
        link.clone(),
    ))
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

    /// A pre-norm block's half, `h = x + (rms_norm(x) ∘ v)`, with the norm linked to the residual
    /// add against the same written with a plain norm and `+`: the same output and, bit for bit
    /// (f32: the norm's gradient and the stream's added once, in either order), the gradients of
    /// `x`, the weight and `v`. With `x` untracked the add keeps nothing for the norm, and `v`'s
    /// gradient is the same.
    #[test]
    fn linked_residual_matches_the_plain_sum() {
        use super::{ResidualLink, residual_add, rms_norm_linked};
        use crate::quant::notes::NoteAmaxes;
        let device = Device::flex().autodiff();
        let leaf = |dims: [usize; 3], mean: f64| {
            Tensor::<3>::random(dims, Distribution::Normal(mean, 1.0), &device).require_grad()
        };
        let (x, v) = (leaf([2, 5, 12], 0.0), leaf([2, 5, 12], 1.0));
        let w = Tensor::<1>::random([12], Distribution::Normal(1.0, 0.5), &device).require_grad();
        let weights = Tensor::<3>::random([2, 5, 12], Distribution::Normal(0.0, 1.0), &device);
        let link = ResidualLink::default();
        let linked = residual_add(
            x.clone(),
            rms_norm_linked(x.clone(), w.clone(), 1e-5, NoteAmaxes::default(), &link) * v.clone(),
            &link,
        );
        let plain = x.clone() + super::rms_norm(x.clone(), w.clone(), 1e-5) * v.clone();
        linked.to_data().assert_eq(&plain.to_data(), true);
        let (g1, g2) = (
            (linked * weights.clone()).sum().backward(),
            (plain * weights.clone()).sum().backward(),
        );
        for (name, t) in [("x", &x), ("v", &v)] {
            let (a, b) = (t.grad(&g1).unwrap(), t.grad(&g2).unwrap());
            assert_eq!(a.to_data(), b.to_data(), "{name}'s gradient");
        }
        assert_eq!(
            w.grad(&g1).unwrap().to_data(),
            w.grad(&g2).unwrap().to_data(),
            "w's gradient"
        );
        let untracked = x.clone().detach();
        let link = ResidualLink::default();
        let y = rms_norm_linked(untracked.clone(), w.clone(), 1e-5, NoteAmaxes::default(), &link) * v.clone();
        let g = (residual_add(untracked, y, &link) * weights).sum().backward();
        let (a, b) = (v.grad(&g).unwrap(), v.grad(&g2).unwrap());
        assert_eq!(a.to_data(), b.to_data(), "v's gradient with x untracked");
    }
}
