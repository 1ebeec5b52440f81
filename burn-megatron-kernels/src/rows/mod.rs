//! Row gathers whose gradient is a gather too, [`RowOps`]: what a mixture of experts moves its
//! token copies with.
//!
//! - [`gather_rows`]: Burn's `select` takes its gradient with `select_assign`, which on CUDA
//!   adds the rows one index after another (12 ms on an H200 for moe-4b's 35k rows of 2048
//!   bf16, where the gather itself takes 0.3 ms). Here the caller hands the inverse map with the
//!   gather: for each source row, the output rows that read it (at most `c`); the gradient
//!   gathers those rows back and adds the `c` of them.
//! - [`combine_rows`]: each token's `k` expert outputs weighted and summed, the un-permutation's
//!   arithmetic, with both gradients (to the rows, a scaled gather; to the weights, a dot
//!   product a copy).
//!
//! On CUDA each is one kernel a direction, 256 threads a row, summing in f32 (`rows_kernels`);
//! elsewhere the tensor-op twin, [`reference`].
//!
//! Legend: `n` source rows, `m` output rows, `d` row width, `c` readers a row at most, `t`
//! tokens, `k` copies a token, `r` copies' rows.

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
    /// The backend extension behind [`gather_rows`] and [`combine_rows`].
    pub trait RowOps, cuda: kernel;

    /// `out[i] = x[index[i]]`, a zero row where `index[i] = n`; `readers` is the inverse map
    /// the gradient uses (`[n, c]`, `m` where there is no reader).
    ///
    /// # Shapes
    /// `x`: `[n, d]`, `index`: `[m]`, `readers`: `[n, c]` → `[m, d]`
    fn gather_rows(x: FloatTensor<Self>, index: IntTensor<Self>, readers: IntTensor<Self>) -> FloatTensor<Self> {
        reference::gather::<Self>(x, index)
    }

    /// The gradient of a gather: for each source row, the sum of `grad`'s rows its readers
    /// name (`m` names none).
    ///
    /// # Shapes
    /// `grad`: `[m, d]`, `readers`: `[n, c]` → `[n, d]`
    fn gather_rows_back(grad: FloatTensor<Self>, readers: IntTensor<Self>) -> FloatTensor<Self> {
        reference::gather_back::<Self>(grad, readers)
    }

    /// `out[i] = Σ_j weights[i, j] · y[rows[i, j]]`, a copy whose row is `r` adding nothing;
    /// summed in f32, rounded to `y`'s dtype. `slots` is the inverse map the gradient uses
    /// (the copy `i·k + j` each row of `y` holds, `t·k` for a row nobody reads).
    ///
    /// # Shapes
    /// `y`: `[r, d]`, `weights`: `[t, k]`, `rows`: `[t, k]`, `slots`: `[r]` → `[t, d]`
    fn combine_rows(
        y: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        rows: IntTensor<Self>,
        slots: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        reference::combine::<Self>(y, weights, rows)
    }

    /// The gradients of [`combine_rows`](RowOps::combine_rows) given the output's: `dy[ρ] =
    /// weights[s] · grad[s / k]` for the copy `s = slots[ρ]` that reads row `ρ` (a zero row for
    /// `s = t·k`, a row nobody reads), and `dweights[i, j] = grad[i] · y[rows[i, j]]`.
    ///
    /// # Shapes
    /// `y`: `[r, d]`, `weights`, `rows`: `[t, k]`, `slots`: `[r]`, `grad`: `[t, d]` →
    /// (`[r, d]`, `[t, k]`)
    fn combine_rows_back(
        y: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        rows: IntTensor<Self>,
        slots: IntTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        reference::combine_back::<Self>(y, weights, rows, slots, grad)
    }
}

#[derive(Debug)]
struct GatherBackward;

impl<B: Backend + RowOps> Backward<B, 1> for GatherBackward {
    type State = IntTensor<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let readers = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| B::gather_rows_back(grad, readers));
    }
}

#[derive(Debug)]
struct CombineBackward;

impl<B: Backend + RowOps> Backward<B, 2> for CombineBackward {
    /// `y`, the weights, the rows and the slots.
    type State = (FloatTensor<B>, FloatTensor<B>, IntTensor<B>, IntTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_y, node_w] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (y, weights, rows, slots) = ops.state;
        let (dy, dw) = B::combine_rows_back(y, weights, rows, slots, grad);
        for (node, grad) in [(node_y, dy), (node_w, dw)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

impl<B: Backend + RowOps, C: CheckpointStrategy> RowOps for Autodiff<B, C> {
    fn gather_rows(x: FloatTensor<Self>, index: IntTensor<Self>, readers: IntTensor<Self>) -> FloatTensor<Self> {
        match GatherBackward.prepare::<C>([x.node()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let out = B::gather_rows(x.into_parts().0, index, readers.clone());
                prep.finish(readers, out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::gather_rows(x.into_parts().0, index, readers)),
        }
    }

    /// The inner backend's, as a constant (no second-order gradients).
    fn gather_rows_back(grad: FloatTensor<Self>, readers: IntTensor<Self>) -> FloatTensor<Self> {
        <Self as AutodiffBackend>::from_inner(B::gather_rows_back(grad.into_parts().0, readers))
    }

    fn combine_rows(
        y: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        rows: IntTensor<Self>,
        slots: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        match CombineBackward
            .prepare::<C>([y.node(), weights.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (y, weights) = (y.into_parts().0, weights.into_parts().0);
                let out = B::combine_rows(y.clone(), weights.clone(), rows.clone(), slots.clone());
                prep.finish((y, weights, rows, slots), out)
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(B::combine_rows(y.into_parts().0, weights.into_parts().0, rows, slots))
            }
        }
    }

    /// The inner backend's, as constants (no second-order gradients).
    fn combine_rows_back(
        y: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        rows: IntTensor<Self>,
        slots: IntTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let inner = |t: FloatTensor<Self>| t.into_parts().0;
        let (dy, dw) = B::combine_rows_back(inner(y), inner(weights), rows, slots, inner(grad));
        (
            <Self as AutodiffBackend>::from_inner(dy),
            <Self as AutodiffBackend>::from_inner(dw),
        )
    }
}

/// `x`'s rows at `index` (`n`, one past the last row, reads a zero row), differentiable in `x`:
/// `readers[i]` lists the output rows that read row `i` (`m`, one past the last, for none), and
/// the gradient of row `i` is the sum of those rows' gradients. `readers` must list exactly the
/// rows that read each source row; the output rows it leaves out get no gradient through.
///
/// # Shapes
/// `x`: `[n, d]`, `index`: `[m]`, `readers`: `[n, c]` → `[m, d]`
pub fn gather_rows(x: Tensor<2>, index: Tensor<1, Int>, readers: Tensor<2, Int>) -> Tensor<2> {
    Tensor::from_dispatch(<burn::backend::Dispatch as RowOps>::gather_rows(
        x.into_dispatch(),
        index.into_dispatch(),
        readers.into_dispatch(),
    ))
}

/// Each of `t` tokens' `k` rows of `y` weighted and summed: `out[i] = Σ_j weights[i, j] ·
/// y[rows[i, j]]`, a copy whose row is `r` (one past the last) adding nothing; in f32, rounded
/// to `y`'s dtype. Differentiable in `y` and `weights`: `slots[ρ]` names the copy `i·k + j`
/// that reads row `ρ` (`t·k` for a row nobody reads, whose gradient is zero); it must be the
/// exact inverse of `rows`.
///
/// # Shapes
/// `y`: `[r, d]`, `weights`: `[t, k]`, `rows`: `[t, k]`, `slots`: `[r]` → `[t, d]`
pub fn combine_rows(y: Tensor<2>, weights: Tensor<2>, rows: Tensor<2, Int>, slots: Tensor<1, Int>) -> Tensor<2> {
    Tensor::from_dispatch(<burn::backend::Dispatch as RowOps>::combine_rows(
        y.into_dispatch(),
        weights.into_dispatch(),
        rows.into_dispatch(),
        slots.into_dispatch(),
    ))
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, Distribution, Int, Tensor, TensorData, Tolerance};

    fn ints<const D: usize>(values: Vec<i64>, shape: [usize; D], device: &Device) -> Tensor<D, Int> {
        Tensor::from_data(TensorData::new(values, shape), device)
    }

    /// Against Burn's `select`, whose gradient adds every reader: the same values and gradient,
    /// with a zero row read and a row read twice.
    #[test]
    fn matches_select() {
        let device = Device::flex().autodiff();
        let x = Tensor::<2>::random([4, 3], Distribution::Normal(0.0, 1.0), &device).require_grad();
        // Rows 2, 0, the zero row, 2, 3; row 1 read by nobody.
        let index = ints(vec![2, 0, 4, 2, 3], [5], &device);
        let readers = ints(vec![1, 5, 5, 5, 0, 3, 4, 5], [4, 2], &device);
        let ours = super::gather_rows(x.clone(), index.clone(), readers);
        let padded = Tensor::cat(vec![x.clone(), Tensor::zeros([1, 3], &device)], 0);
        let theirs = padded.select(0, index);
        ours.to_data().assert_eq(&theirs.to_data(), true);
        let dy = Tensor::<2>::random([5, 3], Distribution::Normal(0.0, 1.0), &device);
        let (g1, g2) = ((ours * dy.clone()).sum().backward(), (theirs * dy).sum().backward());
        let tolerance = Tolerance::absolute(1e-6);
        x.grad(&g1)
            .unwrap()
            .to_data()
            .assert_approx_eq::<f32>(&x.grad(&g2).unwrap().to_data(), tolerance);
    }

    /// Against Burn's `select`, product and sum differentiated by autodiff: three tokens of two
    /// copies each over six rows, token 1's second copy dropped and row 5 a filler nobody
    /// reads: the same output and gradients of the rows and the weights.
    #[test]
    fn combine_matches_burn() {
        let device = Device::flex().autodiff();
        let (t, k, r, d) = (3, 2, 6, 4);
        let y = Tensor::<2>::random([r, d], Distribution::Normal(0.0, 1.0), &device).require_grad();
        let weights = Tensor::<2>::random([t, k], Distribution::Uniform(0.0, 1.0), &device).require_grad();
        let rows = ints(vec![2, 0, 4, r as i64, 1, 3], [t, k], &device);
        let slots = ints(vec![1, 4, 0, 5, 2, (t * k) as i64], [r], &device);
        let ours = super::combine_rows(y.clone(), weights.clone(), rows.clone(), slots);
        let padded = Tensor::cat(vec![y.clone(), Tensor::zeros([1, d], &device)], 0);
        let copies = padded.select(0, rows.reshape([t * k])).reshape([t, k, d]);
        let theirs = (copies * weights.clone().unsqueeze_dim::<3>(2))
            .sum_dim(1)
            .reshape([t, d]);
        // f32 both ways, the sum in the same order: a few ulps.
        let tolerance = Tolerance::absolute(1e-6);
        ours.to_data().assert_approx_eq::<f32>(&theirs.to_data(), tolerance);
        let dout = Tensor::<2>::random([t, d], Distribution::Normal(0.0, 1.0), &device);
        let (g1, g2) = ((ours * dout.clone()).sum().backward(), (theirs * dout).sum().backward());
        for x in [&y, &weights] {
            x.grad(&g1)
                .unwrap()
                .to_data()
                .assert_approx_eq::<f32>(&x.grad(&g2).unwrap().to_data(), tolerance);
        }
    }
}
