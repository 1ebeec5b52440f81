//! Token embedding lookups as a backend extension, [`EmbeddingOps`]: rows of a table by id, an id
//! outside the table reading a zero row (a vocabulary-parallel rank's tokens held by another
//! rank), and the table's gradient as each row's sum of the gradients of the positions that read
//! it, added in position order in f32 and rounded once.
//!
//! Burn's `embedding` takes its gradient with `select_assign`, which on CUDA gives each of the
//! `d` columns one thread that walks every position in turn, adding in the dtype: 3.2 ms on an
//! H100 for llama-1b's 8192 tokens of 2048, one launch of 2048 threads. On CUDA
//! the gradient here sorts the positions by token (a count, a scan and a placement; each
//! token's positions put in increasing order by their rank) and sums each row in one block
//! (`embedding_kernels`); elsewhere the tensor-op twin, [`reference`].
//!
//! Legend: `n` table rows, `d` row width, `m` positions.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Autodiff, AutodiffBackend, Backend};
use burn::tensor::{Int, Tensor};

#[cfg(feature = "cuda")]
pub(crate) mod kernel;
pub mod reference;

extension! {
    /// The backend extension behind [`embedding_rows`].
    pub trait EmbeddingOps, cuda: kernel;

    /// `out[i] = weight[ids[i]]`, a zero row where `ids[i]` is outside `[0, n)`.
    ///
    /// # Shapes
    /// `weight`: `[n, d]`, `ids`: `[m]` → `[m, d]`
    fn embedding_rows(weight: FloatTensor<Self>, ids: IntTensor<Self>) -> FloatTensor<Self> {
        reference::forward::<Self>(weight, ids)
    }

    /// The table's gradient given the output's: row `t` is the sum of `grad[i]` over the
    /// positions `i` with `ids[i] = t`, in increasing `i`, in f32, rounded to `grad`'s dtype.
    ///
    /// # Shapes
    /// `grad`: `[m, d]`, `ids`: `[m]` → `[n, d]`
    fn embedding_rows_back(grad: FloatTensor<Self>, ids: IntTensor<Self>, n: usize) -> FloatTensor<Self> {
        reference::backward::<Self>(grad, ids, n)
    }
}

/// The table's row count `n`.
#[derive(Debug)]
struct EmbeddingBackward(usize);

impl<B: Backend + EmbeddingOps> Backward<B, 1> for EmbeddingBackward {
    type State = IntTensor<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let ids = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            B::embedding_rows_back(grad, ids, self.0)
        });
    }
}

impl<B: Backend + EmbeddingOps, C: CheckpointStrategy> EmbeddingOps for Autodiff<B, C> {
    fn embedding_rows(weight: FloatTensor<Self>, ids: IntTensor<Self>) -> FloatTensor<Self> {
        let n = burn::backend::TensorMetadata::shape(&weight)[0];
        match EmbeddingBackward(n)
            .prepare::<C>([weight.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let out = B::embedding_rows(weight.into_parts().0, ids.clone());
                prep.finish(ids, out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::embedding_rows(weight.into_parts().0, ids)),
        }
    }

    /// The inner backend's, as a constant (no second-order gradients).
    fn embedding_rows_back(grad: FloatTensor<Self>, ids: IntTensor<Self>, n: usize) -> FloatTensor<Self> {
        <Self as AutodiffBackend>::from_inner(B::embedding_rows_back(grad.into_parts().0, ids, n))
    }
}

/// `weight`'s rows at `ids` (an id outside `[0, n)` reads a zero row and sends no gradient),
/// differentiable in `weight`.
///
/// # Shapes
/// `weight`: `[n, d]`, `ids`: `[m]` → `[m, d]`
pub fn embedding_rows(weight: Tensor<2>, ids: Tensor<1, Int>) -> Tensor<2> {
    Tensor::from_dispatch(<burn::backend::Dispatch as EmbeddingOps>::embedding_rows(
        weight.into_dispatch(),
        ids.into_dispatch(),
    ))
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, Distribution, Int, Tensor, TensorData, Tolerance};

    /// Against Burn's `embedding` on the ids inside the table, differentiated by autodiff: the
    /// same rows and table gradient, with ids read three times, once and never, and ids below
    /// and past the table reading zero rows and sending nothing back.
    #[test]
    fn matches_burn_embedding() {
        let device = Device::flex().autodiff();
        let (n, d) = (6, 5);
        let weight = Tensor::<2>::random([n, d], Distribution::Normal(0.0, 1.0), &device).require_grad();
        let ids = vec![4i64, 1, -2, 4, 6, 0, 4, 9];
        let inside: Vec<usize> = (0..ids.len()).filter(|&i| (0..n as i64).contains(&ids[i])).collect();
        let ours = super::embedding_rows(
            weight.clone(),
            Tensor::<1, Int>::from_data(TensorData::new(ids.clone(), [8]), &device),
        );
        let kept: Vec<i64> = inside.iter().map(|&i| ids[i]).collect();
        let kept = Tensor::<2, Int>::from_data(TensorData::new(kept, [1, inside.len()]), &device);
        let theirs = burn::tensor::module::embedding(weight.clone(), kept).reshape([inside.len(), d]);
        let rows = Tensor::<1, Int>::from_data(
            TensorData::new(inside.iter().map(|&i| i as i64).collect::<Vec<_>>(), [inside.len()]),
            &device,
        );
        // Copies: exact; the outside ids' rows zero.
        ours.clone()
            .select(0, rows.clone())
            .to_data()
            .assert_eq(&theirs.to_data(), true);
        let outside = Tensor::<1, Int>::from_data([2, 4, 7], &device);
        assert_eq!(ours.clone().select(0, outside).abs().sum().into_scalar::<f32>(), 0.0);
        let dy = Tensor::<2>::random([8, d], Distribution::Normal(0.0, 1.0), &device);
        let g1 = (ours * dy.clone()).sum().backward();
        let g2 = (theirs * dy.select(0, rows)).sum().backward();
        // f32 sums of at most three rows, in the same order: a few ulps.
        let tolerance = Tolerance::absolute(1e-6);
        weight
            .grad(&g1)
            .unwrap()
            .to_data()
            .assert_approx_eq::<f32>(&weight.grad(&g2).unwrap().to_data(), tolerance);
    }
}
