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
use burn::backend::{Autodiff, AutodiffBackend, Backend, Flex, backend_extension};
use burn::tensor::{Int, Tensor};

/// The backend extension behind [`top_k`].
#[backend_extension(Flex, Cube: cfg(feature = "cuda"), Autodiff)]
pub trait TopKOps: Backend {
    /// The `k ≤ e` highest columns of each row of `scores`, best first, ties to the lower
    /// index, as f32 ids (scores are numbers: where a NaN goes is unspecified).
    ///
    /// # Shapes
    /// `scores`: `[t, e]` → `[t, k]`
    fn top_k(scores: FloatTensor<Self>, k: usize) -> FloatTensor<Self>;
}

/// The tensor-op twin: the CPU path and the kernel's oracle.
pub mod reference {
    use burn::tensor::{IndexingUpdateOp, Int, Tensor};

    pub fn top_k(scores: Tensor<2>, k: usize) -> Tensor<2, Int> {
        let mut scores = scores;
        let mut picks = Vec::with_capacity(k);
        for _ in 0..k {
            let best = scores.clone().argmax(1); // [t, 1], the first of equal maxima
            scores = scores.scatter(
                1,
                best.clone(),
                Tensor::full(best.dims(), f32::NEG_INFINITY, &best.device()),
                IndexingUpdateOp::Assign,
            );
            picks.push(best);
        }
        Tensor::cat(picks, 1)
    }
}

impl TopKOps for Flex {
    fn top_k(scores: FloatTensor<Self>, k: usize) -> FloatTensor<Self> {
        reference::top_k(Tensor::from_primitive::<Flex>(scores), k)
            .float()
            .try_into_primitive::<Flex>()
            .expect("a CPU tensor")
    }
}

#[cfg(feature = "cuda")]
impl TopKOps for burn::backend::Cube {
    fn top_k(scores: FloatTensor<Self>, k: usize) -> FloatTensor<Self> {
        kernel::top_k(scores, k)
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

#[cfg(feature = "cuda")]
mod kernel {
    use burn::backend::Cube;
    use burn::tensor::{DType, Shape};
    use burn_cubecl::tensor::CubeTensor;
    use cubecl::prelude::*;

    use crate::elementwise::{compact_input, compact_output};

    /// Grid: a thread a row. The row's best `k` in registers, best first: each column, in
    /// order, takes the first slot it beats (strictly, so it stays behind an equal value of a
    /// lower index) or the first empty one, and the entries from there down move one slot
    /// down (the last falls off).
    #[cube(launch_unchecked)]
    fn top_k_kernel(scores: &Tensor<f32>, ids: &mut Tensor<f32>, rows: u32, e: u32, #[comptime] k: u32) {
        let row = ABSOLUTE_POS as u32;
        if row < rows {
            let mut best = Array::<f32>::new(k as usize);
            let mut at = Array::<u32>::new(k as usize);
            #[unroll]
            for j in 0..k {
                best[j as usize] = 0.0f32;
                at[j as usize] = e;
            }
            for c in 0..e {
                let mut value = scores[(row * e + c) as usize];
                let mut column = c;
                // Once the column has found its place, every entry below moves down one.
                let mut shifting = false;
                #[unroll]
                for j in 0..k {
                    let slot = j as usize;
                    // The carried entry is an empty one (`e`) once an empty slot is taken.
                    if column < e && (shifting || at[slot] == e || value > best[slot]) {
                        let (held, held_at) = (best[slot], at[slot]);
                        best[slot] = value;
                        at[slot] = column;
                        value = held;
                        column = held_at;
                        shifting = true;
                    }
                }
            }
            #[unroll]
            for j in 0..k {
                ids[(row * k + j) as usize] = at[j as usize] as f32;
            }
        }
    }

    pub(super) fn top_k(scores: CubeTensor, k: usize) -> CubeTensor {
        let shape = scores.meta.shape().clone();
        let (t, e) = (shape[0], shape[1]);
        // The best k live in registers.
        let fits = e < 1 << 24 && k <= 16;
        let (true, Some(x)) = (
            fits,
            compact_input(burn_cubecl::kernel::cast(scores.clone(), DType::F32)),
        ) else {
            let scores = burn::tensor::Tensor::<2>::from_primitive::<Cube>(scores);
            return super::reference::top_k(scores, k)
                .float()
                .try_into_primitive::<Cube>()
                .expect("a CUDA tensor");
        };
        let ids = compact_output(&x, Shape::from([t, k]), DType::F32);
        if t == 0 || k == 0 {
            return ids;
        }
        // SAFETY: a thread a row, each checked against `rows`; both tensors compact with the
        // shapes the kernel indexes.
        unsafe {
            top_k_kernel::launch_unchecked(
                &x.client,
                CubeCount::Static((t as u32).div_ceil(128), 1, 1),
                CubeDim::new_1d(128),
                x.clone().into_tensor_arg(),
                ids.clone().into_tensor_arg(),
                t as u32,
                e as u32,
                k as u32,
            );
        }
        ids
    }
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
