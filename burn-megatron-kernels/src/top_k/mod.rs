//! The `k` highest columns of each row, best first, ties to the lower index: a mixture of
//! experts' routing choice, as a backend extension, [`TopKOps`]. On CUDA one kernel, a thread a
//! row, keeps the row's best `k` in registers; elsewhere the tensor-op twin, [`reference`]:
//! `k` rounds of taking the maximum (Burn's `argmax`, the first of equal maxima) and masking it.
//!
//! Burn's own `argtopk` is one kernel on CUDA too, but its order among equal values is not the
//! CPU's (measured on an H200: moe-4b's top 1 of scores full of ties differed), so routing
//! would depend on the device, and ep ranks that route slices of the batch could choose
//! otherwise than one rank routing it whole. Ids are f32 (exact below 2²⁴), as the project's
//! index tensors in kernels are.
//!
//! Legend: `t` rows, `e` columns.

use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, AutodiffBackend, Backend};
use burn::tensor::{Int, Tensor};

#[cfg(feature = "cuda")]
pub(crate) mod kernel;
pub mod reference;

extension! {
    /// The backend extension behind [`top_k`].
    pub trait TopKOps, cuda: kernel;

    /// The `k ≤ e` highest columns of each row of `scores`, best first, ties to the lower
    /// index, as f32 ids (scores are numbers: where a NaN goes is unspecified).
    ///
    /// # Shapes
    /// `scores`: `[t, e]` → `[t, k]`
    fn top_k(scores: FloatTensor<Self>, k: usize) -> FloatTensor<Self> {
        reference::top_k(Tensor::from_primitive::<Self>(scores), k)
            .float()
            .try_into_primitive::<Self>()
            .expect("a CPU tensor")
    }
}

/// Not differentiable: the inner backend's ids, as a constant.
impl<B: Backend + TopKOps, C: burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy> TopKOps
    for Autodiff<B, C>
{
    fn top_k(scores: FloatTensor<Self>, k: usize) -> FloatTensor<Self> {
        <Self as AutodiffBackend>::from_inner(B::top_k(scores.into_parts().0, k))
    }
}

/// The `k ≤ e` highest columns of each row of `scores`, best first, ties to the lower index
/// (the same on every device).
///
/// # Shapes
/// `scores`: `[t, e]` → `[t, k]`
pub fn top_k(scores: Tensor<2>, k: usize) -> Tensor<2, Int> {
    let [_, e] = scores.dims();
    assert!(k <= e, "top {k} of {e} columns");
    let ids: Tensor<2> = Tensor::from_dispatch(<burn::backend::Dispatch as TopKOps>::top_k(scores.into_dispatch(), k));
    ids.int()
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, Distribution, Tensor};

    /// The reference against a sort by hand (value descending, then index) on scores of five
    /// levels, so most rows hold ties, for every k up to e.
    #[test]
    fn the_reference_breaks_ties_to_the_lower_index() {
        let (t, e) = (40, 8);
        let device = Device::flex();
        let levels = Tensor::<2>::random([t, e], Distribution::Uniform(0.0, 5.0), &device).floor();
        let values: Vec<f32> = levels.to_data().try_to_vec().unwrap();
        for k in 1..=e {
            let got: Vec<i64> = super::top_k(levels.clone(), k)
                .into_data()
                .convert::<i64>()
                .try_to_vec()
                .unwrap();
            for row in 0..t {
                let v = &values[row * e..(row + 1) * e];
                let mut order: Vec<usize> = (0..e).collect();
                order.sort_by(|&a, &b| v[b].partial_cmp(&v[a]).unwrap().then(a.cmp(&b)));
                let expected: Vec<i64> = order[..k].iter().map(|&c| c as i64).collect();
                assert_eq!(&got[row * k..(row + 1) * k], expected.as_slice(), "k {k} row {row}");
            }
        }
    }
}
