//! The full-vocabulary part of (vocab-parallel) cross-entropy as a backend extension,
//! [`CrossEntropyOps`]: per row of this rank's logit slice, the three sums the loss needs, read
//! straight from the logits in their dtype; its backward writes the logits' gradient in their
//! dtype. No `[tokens, vocab]` f32 tensor exists on either pass. The tensor-parallel reductions
//! of those `[tokens, 3]` sums stay with the caller (`VocabParallelCrossEntropy`).
//!
//! Over the columns `j < valid` (the slice's real vocabulary; padded columns take no part), with
//! `m` the row's max there (a constant: −∞ where `valid` is 0) and `x̃ = x − m`, one pass gives
//! `(m, Σ exp x̃_j, x̃_t if the target t is in this slice else 0, Σ x̃_j)`, and the gradient of a
//! row is `g₀·exp x̃_j + g₁·[j = t] + g₂` on those columns, 0 on the padded ones (`g₀…g₂` the
//! three sums' gradients). The caller moves each slice's sums onto the rows' global max.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, AutodiffBackend, Backend, Flex, TensorMetadata};
use burn::tensor::Tensor;

#[cfg(feature = "cuda")]
pub(crate) mod kernel;
pub mod reference;

extension! {
    /// The backend extension behind [`partials`].
    pub trait CrossEntropyOps, cuda: kernel;

    /// The `[n, 4]` f32 max and sums of the module docs for `logits` `[n, c]` and `target` `[n]`
    /// (the target's column in this slice as f32, -1 where it lies in another).
    fn cross_entropy_partials(logits: FloatTensor<Self>, target: FloatTensor<Self>, valid: usize) -> FloatTensor<Self> {
        reference::partials(flex(logits), flex(target), valid)
            .try_into_primitive::<Self>()
            .expect("flex")
    }

    /// The logits' gradient given the output's `grad` `[n, 4]` (column 0, the max's, ignored),
    /// `shift` `[n]` the max the sums were taken under.
    fn cross_entropy_partials_backward(
        logits: FloatTensor<Self>,
        shift: FloatTensor<Self>,
        target: FloatTensor<Self>,
        valid: usize,
        grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        reference::backward(flex(logits), flex(shift), flex(target), valid, flex(grad))
            .try_into_primitive::<Self>()
            .expect("flex")
    }
}

fn flex<const D: usize>(t: FloatTensor<Flex>) -> Tensor<D> {
    Tensor::from_primitive::<Flex>(t)
}

#[derive(Debug)]
struct PartialsBackward;

impl<B: Backend + CrossEntropyOps> Backward<B, 1> for PartialsBackward {
    /// The logits, the rows' max (the sums' shift), the targets and the valid width.
    type State = (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>, usize);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (logits, shift, target, valid) = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            B::cross_entropy_partials_backward(logits, shift, target, valid, grad)
        });
    }
}

impl<B: Backend + CrossEntropyOps, C: CheckpointStrategy> CrossEntropyOps for Autodiff<B, C> {
    fn cross_entropy_partials(logits: FloatTensor<Self>, target: FloatTensor<Self>, valid: usize) -> FloatTensor<Self> {
        let target = target.into_parts().0;
        match PartialsBackward
            .prepare::<C>([logits.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let logits = logits.into_parts().0;
                let out = B::cross_entropy_partials(logits.clone(), target.clone(), valid);
                let n = out.shape()[0];
                let max = B::float_slice(out.clone(), &[(..).into(), (0..1).into()]);
                prep.finish((logits, B::float_reshape(max, [n].into()), target, valid), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::cross_entropy_partials(logits.into_parts().0, target, valid)),
        }
    }

    /// The inner backend's backward, as constants (no second-order gradients).
    fn cross_entropy_partials_backward(
        logits: FloatTensor<Self>,
        shift: FloatTensor<Self>,
        target: FloatTensor<Self>,
        valid: usize,
        grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let inner = |t: FloatTensor<Self>| t.into_parts().0;
        <Self as AutodiffBackend>::from_inner(B::cross_entropy_partials_backward(
            inner(logits),
            inner(shift),
            inner(target),
            valid,
            inner(grad),
        ))
    }
}

/// The `[n, 4]` max and sums of the module docs through [`CrossEntropyOps`], in one pass over
/// the logits, differentiable in `logits` through the sums (the max is a constant).
///
/// # Shapes
/// `[n, c]`, `[n]` → `[n, 4]`
pub fn partials(logits: Tensor<2>, target: Tensor<1>, valid: usize) -> Tensor<2> {
    let out = <burn::backend::Dispatch as CrossEntropyOps>::cross_entropy_partials(
        logits.into_dispatch(),
        target.into_dispatch(),
        valid,
    );
    Tensor::from_dispatch(out)
}

#[cfg(test)]
mod tests {
    use burn::tensor::{DType, Device, Distribution, Tensor, TensorData, Tolerance};

    /// On the CPU the extension's backward is the derivative autodiff finds for the twin's
    /// forward: the same max and sums and the same logit gradients (a weight on the max column
    /// too, which sends nothing back), with a padded column and a target in another slice.
    #[test]
    fn backward_matches_autodiff() {
        let device = Device::flex().autodiff();
        let logits = Tensor::<2>::random([4, 6], Distribution::Normal(0.0, 2.0), &device).require_grad();
        let target = Tensor::<1>::from_data(TensorData::from([2.0f32, -1.0, 0.0, 4.0]), &device);
        let ours = super::partials(logits.clone(), target.clone(), 5);
        let theirs = super::reference::partials(logits.clone(), target, 5);
        // f32 both ways, the same sums: ulps.
        let tolerance = Tolerance::absolute(1e-5);
        ours.to_data().assert_approx_eq::<f32>(&theirs.to_data(), tolerance);
        let weights = Tensor::<2>::random([4, 4], Distribution::Normal(0.0, 1.0), &device).cast(DType::F32);
        let (g1, g2) = (
            (ours * weights.clone()).sum().backward(),
            (theirs * weights).sum().backward(),
        );
        logits
            .grad(&g1)
            .unwrap()
            .to_data()
            .assert_approx_eq::<f32>(&logits.grad(&g2).unwrap().to_data(), tolerance);
    }

    /// Each row's max before `valid`, written out by hand: a larger value in a padded column is
    /// not counted; no column at all gives −∞ and zero sums.
    #[test]
    fn max_skips_the_padding() {
        let device = Device::flex();
        let rows = [[1.0f32, -3.0, 2.5, 9.0], [-4.0, -2.0, -7.0, 8.0]];
        let logits = Tensor::<2>::from_data(TensorData::from(rows), &device);
        let target = Tensor::<1>::from_data(TensorData::from([0.0f32, -1.0]), &device);
        let max = |valid| {
            let out = super::partials(logits.clone(), target.clone(), valid);
            out.narrow(1, 0, 1).into_data().try_to_vec::<f32>().unwrap()
        };
        assert_eq!(max(3), vec![2.5, -2.0]);
        assert_eq!(max(0), vec![f32::NEG_INFINITY; 2]);
        let none = super::partials(logits.clone(), target.clone(), 0).narrow(1, 1, 3);
        assert_eq!(none.into_data().try_to_vec::<f32>().unwrap(), vec![0.0; 6]);
    }
}
