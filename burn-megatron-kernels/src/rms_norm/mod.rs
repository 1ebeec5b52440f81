//! RMSNorm, `y = x / √(mean(x²) + ε) · w` over the last dim, as a backend extension,
//! [`RmsNormOps`], with its own backward: on CUDA one kernel a row each way plus a column-sum
//! kernel for the weight's gradient ([`crate::rms_norm::kernel`]); elsewhere the tensor-op twin,
//! [`reference`]. Both normalize in f32, round to the input's dtype, then scale by the weight in
//! that dtype (Burn's and Hugging Face's order), and keep `rstd = 1/√(mean(x²) + ε)` per row
//! (f32, the input's shape with a last dim of 1) for the backward. Where an FP8 tensorwise
//! product quantizes the output next, the CUDA kernel leaves each row's largest magnitude for its
//! amax ([`NoteAmaxes`]).
//!
//! Linked ([`rms_norm_linked`], [`crate::rms_norm::link`]), the backward also adds the gradients the
//! ops around the norm hand it: the residual stream's into the input gradient, the output's
//! later readers' into the output gradient, each read once by the kernel instead of summed by
//! autodiff in a pass of its own.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, AutodiffBackend, Backend};
use burn::tensor::Tensor;

use crate::quant::notes::{AmaxNotes, NoteAmaxes};
use crate::rms_norm::link::{FanOut, NormLink, fan_out_use_tracked, leave_on_output, residual_add_tracked};

pub mod link;

#[cfg(feature = "cuda")]
pub(crate) mod kernel;
pub mod reference;

extension! {
    /// The backend extension behind [`rms_norm`].
    pub trait RmsNormOps, cuda: kernel;

    /// `(y, rstd)` for `x` `[.., c]` and `weight` `[c]`; `y`'s amax noted where
    /// `notes.output` asks, the input gradient's where `notes.input_grads` does; the gradients
    /// handed over through `link` added in the backward.
    fn rms_norm(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        epsilon: f32,
        notes: NoteAmaxes,
        link: Option<NormLink>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        reference::forward::<Self>(x, weight, epsilon)
    }

    /// The gradients of `x` (its amax noted where `note`) and of `weight` given the output's.
    fn rms_norm_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        note: Option<AmaxNotes>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        reference::backward::<Self>(x, weight, rstd, grad, Vec::new(), None)
    }

    /// [`rms_norm_backward`](Self::rms_norm_backward) with what `link` holds (this backend's
    /// float primitives, taken out of it) added: its readers' gradients to `grad`, the residual
    /// stream's to `x`'s gradient (in f32, rounded once).
    fn rms_norm_backward_linked(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        link: NormLink,
        note: Option<AmaxNotes>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let handed = link.lock().take::<FloatTensor<Self>>();
        reference::backward::<Self>(x, weight, rstd, grad, handed.uses, handed.residual)
    }

    /// `x + branch`; differentiated, `x`'s gradient goes to `link`'s norm
    /// ([`residual_add`](crate::rms_norm::residual_add)).
    fn residual_add(x: FloatTensor<Self>, branch: FloatTensor<Self>, link: NormLink) -> FloatTensor<Self> {
        use burn::backend::ops::FloatTensorOps;
        Self::float_add(x, branch)
    }

    /// `x` for one of `fan`'s readers ([`fan_out`](crate::rms_norm::fan_out)).
    fn fan_out_use(x: FloatTensor<Self>, fan: FanOut) -> FloatTensor<Self> {
        x
    }
}

#[derive(Debug)]
struct RmsNormBackward;

impl<B: Backend + RmsNormOps> Backward<B, 2> for RmsNormBackward {
    /// x, the weight and rstd; where to note the input gradient's amax, if anywhere, and where the ops
    /// around the norm hand it gradients.
    type State = (
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        Option<AmaxNotes>,
        Option<NormLink>,
    );

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_weight] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (x, weight, rstd, note, link) = ops.state;
        let (dx, dw) = match link {
            Some(link) => B::rms_norm_backward_linked(x, weight, rstd, grad, link, note),
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
        link: Option<NormLink>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let nodes = [x.node(), weight.node()];
        let (x, weight) = (x.into_parts().0, weight.into_parts().0);
        let note = notes.input_grads.clone();
        let (y, rstd) = B::rms_norm(x.clone(), weight.clone(), epsilon, notes, None);
        let rstd_out = <Self as AutodiffBackend>::from_inner(rstd.clone());
        let y = match RmsNormBackward.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                if let Some(link) = &link {
                    link.lock().norm = true;
                }
                let y = prep.finish((x, weight, rstd, note, link.clone()), y);
                if let Some(link) = link {
                    leave_on_output(y.id(), &link);
                }
                y
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
        note: Option<AmaxNotes>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let inner = |t: FloatTensor<Self>| t.into_parts().0;
        let (dx, dw) = B::rms_norm_backward(inner(x), inner(weight), inner(rstd), inner(grad), note);
        (
            <Self as AutodiffBackend>::from_inner(dx),
            <Self as AutodiffBackend>::from_inner(dw),
        )
    }

    /// What `link` holds are this backend's tensors: handed on as the inner backend's.
    fn rms_norm_backward_linked(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        link: NormLink,
        note: Option<AmaxNotes>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let inner = |t: FloatTensor<Self>| t.into_parts().0;
        let handed = link.lock().take::<FloatTensor<Self>>();
        let inner_link = NormLink::default();
        {
            let mut linked = inner_link.lock();
            linked.residual = handed.residual.map(|r| Box::new(inner(r)) as _);
            linked.uses = handed.uses.into_iter().map(|u| Box::new(inner(u)) as _).collect();
        }
        let (dx, dw) = B::rms_norm_backward_linked(inner(x), inner(weight), inner(rstd), inner(grad), inner_link, note);
        (
            <Self as AutodiffBackend>::from_inner(dx),
            <Self as AutodiffBackend>::from_inner(dw),
        )
    }

    fn residual_add(x: FloatTensor<Self>, branch: FloatTensor<Self>, link: NormLink) -> FloatTensor<Self> {
        residual_add_tracked::<B, C>(x, branch, link)
    }

    fn fan_out_use(x: FloatTensor<Self>, fan: FanOut) -> FloatTensor<Self> {
        fan_out_use_tracked::<B, C>(x, fan)
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

/// [`rms_norm_noting`] linked to the ops around it ([`crate::rms_norm::link`]): the backward adds the
/// gradients they hand it (the residual stream's, through `link`; its output's later readers',
/// through [`crate::rms_norm::link::fan_out`]) and notes the input gradient's amax where
/// `notes.input_grads` asks.
pub fn rms_norm_linked<const D: usize>(
    x: Tensor<D>,
    weight: Tensor<1>,
    epsilon: f32,
    notes: NoteAmaxes,
    link: &NormLink,
) -> Tensor<D> {
    norm(x, weight, epsilon, notes, Some(link.clone()))
}

fn norm<const D: usize>(
    x: Tensor<D>,
    weight: Tensor<1>,
    epsilon: f32,
    notes: NoteAmaxes,
    link: Option<NormLink>,
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

/// `x + branch`, where `branch` is computed from the output of `x`'s
/// [`rms_norm_linked`](crate::rms_norm::rms_norm_linked) with the same `link`: `x`'s gradient
/// then reaches `x` through that norm's backward, added by its kernel.
///
/// # Shapes
/// both of one shape
pub fn residual_add<const D: usize>(x: Tensor<D>, branch: Tensor<D>, link: &NormLink) -> Tensor<D> {
    Tensor::from_dispatch(<burn::backend::Dispatch as RmsNormOps>::residual_add(
        x.into_dispatch(),
        branch.into_dispatch(),
        link.clone(),
    ))
}

/// `x` for `n` readers (the products that share a norm's output): where `x` is the own output
/// of `link`'s norm, the readers' gradients after the first are added by the norm's backward
/// kernel instead of by autodiff; elsewhere (no link, or `x` another tensor: a mapping of the
/// output over tp) `n` handles of `x`.
pub fn fan_out<const D: usize>(x: Tensor<D>, n: usize, link: Option<&NormLink>) -> Vec<Tensor<D>> {
    let fan = FanOut::new(link);
    (0..n)
        .map(|_| {
            Tensor::from_dispatch(<burn::backend::Dispatch as RmsNormOps>::fan_out_use(
                x.clone().into_dispatch(),
                fan.clone(),
            ))
        })
        .collect()
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
