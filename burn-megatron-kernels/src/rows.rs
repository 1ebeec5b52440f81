//! Row gathers whose gradient is a gather too, [`RowOps`]: what a mixture of experts moves its
//! token copies with. Burn's `select` takes its gradient with `select_assign`, which on CUDA
//! adds the rows one index after another (12 ms on an H200 for moe-4b's 35k rows of 2048 bf16,
//! a layer's un-permutation, where the gather itself takes 0.3 ms). Here the caller hands the
//! inverse map with the gather: for each source row, the output rows that read it (at most
//! `c`); the gradient gathers those rows back and adds the `c` of them.
//!
//! Legend: `n` source rows, `m` output rows, `d` row width, `c` readers a row at most.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Autodiff, Backend, Flex, TensorMetadata, backend_extension};
use burn::tensor::{FloatDType, Int, Tensor};

/// The backend extension behind [`gather_rows`].
#[backend_extension(Flex, Cube: cfg(feature = "cuda"), Autodiff)]
pub trait RowOps: Backend {
    /// `out[i] = x[index[i]]`, a zero row where `index[i] = n`; `readers` is the inverse map
    /// the gradient uses (`[n, c]`, `m` where there is no reader).
    ///
    /// # Shapes
    /// `x`: `[n, d]`, `index`: `[m]`, `readers`: `[n, c]` → `[m, d]`
    fn gather_rows(x: FloatTensor<Self>, index: IntTensor<Self>, readers: IntTensor<Self>) -> FloatTensor<Self>;
}

/// `x`'s rows at `index`, `n` (one past the last) reading a zero row.
fn gather<B: Backend>(x: FloatTensor<B>, index: IntTensor<B>) -> FloatTensor<B> {
    let shape = x.shape();
    let d = shape[1];
    let zero = B::float_zeros([1, d].into(), &x.device(), FloatDType::from(x.dtype()));
    B::float_select(B::float_cat(vec![x, zero], 0), 0, index)
}

/// The gradient of a gather: for each source row, the sum of the output gradient's rows its
/// `c` readers name (`m`, one past the last, reads zeros).
///
/// # Shapes
/// `grad`: `[m, d]`, `readers`: `[n, c]` → `[n, d]`
fn gather_back<B: Backend>(grad: FloatTensor<B>, readers: IntTensor<B>) -> FloatTensor<B> {
    let (rows, d) = {
        let shape = readers.shape();
        (shape[0], grad.shape()[1])
    };
    let c = readers.shape()[1];
    let flat = B::int_reshape(readers, [rows * c].into());
    let read = B::float_reshape(gather::<B>(grad, flat), [rows, c, d].into());
    // The c readers added one slice at a time: Burn's reduction over a middle dim can run in
    // one block.
    let slice = |j: usize| {
        let part = B::float_slice(read.clone(), &[(..).into(), (j..j + 1).into(), (..).into()]);
        B::float_reshape(part, [rows, d].into())
    };
    (1..c).fold(slice(0), |sum, j| B::float_add(sum, slice(j)))
}

impl RowOps for Flex {
    fn gather_rows(x: FloatTensor<Self>, index: IntTensor<Self>, _readers: IntTensor<Self>) -> FloatTensor<Self> {
        gather::<Flex>(x, index)
    }
}

#[cfg(feature = "cuda")]
impl RowOps for burn::backend::Cube {
    fn gather_rows(x: FloatTensor<Self>, index: IntTensor<Self>, _readers: IntTensor<Self>) -> FloatTensor<Self> {
        gather::<burn::backend::Cube>(x, index)
    }
}

#[derive(Debug)]
struct GatherBackward;

impl<B: Backend + RowOps> Backward<B, 1> for GatherBackward {
    type State = IntTensor<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let readers = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| gather_back::<B>(grad, readers));
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

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, Distribution, Int, Tensor, TensorData, Tolerance};

    /// Against Burn's `select`, whose gradient adds every reader: the same values and gradient,
    /// with a zero row read and a row read twice.
    #[test]
    fn matches_select() {
        let device = Device::flex().autodiff();
        let x = Tensor::<2>::random([4, 3], Distribution::Normal(0.0, 1.0), &device).require_grad();
        // Rows 2, 0, the zero row, 2, 3; row 1 read by nobody.
        let index = Tensor::<1, Int>::from_data(TensorData::new(vec![2i64, 0, 4, 2, 3], [5]), &device);
        let readers = Tensor::<2, Int>::from_data(TensorData::new(vec![1i64, 5, 5, 5, 0, 3, 4, 5], [4, 2]), &device);
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
}
