use burn::backend::Cube;
use burn::tensor::{DType, Shape};
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use crate::cuda::launch::{compact_input, compact_output};

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
