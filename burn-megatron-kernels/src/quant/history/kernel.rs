//! Delayed scaling's CUDA kernels: a step's amaxes pushed in front of each `[3, len]` history,
//! and the amax each row scales by (its maximum or its most recent).

use burn::tensor::{DType, Shape};
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use crate::cuda::launch::{compact_input, compact_output};
use crate::cuda::reduce::block_max;
/// A block a row of a `[3, len]` history: `new[r, 0]` the step's amax of row `r`, `new[r, j]`
/// the old `[r, j − 1]`.
#[cube(launch_unchecked)]
fn history_push_kernel(
    old: &Tensor<f32>,
    input: &Tensor<f32>,
    weight: &Tensor<f32>,
    output_grad: &Tensor<f32>,
    new: &mut Tensor<f32>,
    len: u32,
) {
    let row = CUBE_POS as u32;
    for j in range_stepped(UNIT_POS, len, 256u32) {
        let at = (row * len + j) as usize;
        if j > 0 {
            new[at] = old[at - 1];
        } else if row == 0 {
            new[at] = input[0];
        } else if row == 1 {
            new[at] = weight[0];
        } else {
            new[at] = output_grad[0];
        }
    }
}

/// A block a row: `kept[r]` the row's largest amax, or with `most_recent` its newest.
#[cube(launch_unchecked)]
fn history_kept_kernel(history: &Tensor<f32>, kept: &mut Tensor<f32>, len: u32, #[comptime] most_recent: bool) {
    let row = CUBE_POS as u32;
    if comptime!(most_recent) {
        if UNIT_POS == 0 {
            kept[row as usize] = history[(row * len) as usize];
        }
    } else {
        let mut acc = 0.0f32;
        for j in range_stepped(UNIT_POS, len, 256u32) {
            acc = f32::max(acc, history[(row * len + j) as usize]);
        }
        let total = block_max(acc);
        if UNIT_POS == 0 {
            kept[row as usize] = total;
        }
    }
}

/// An f32 row-major copy of `t` (histories and amaxes are f32 already: no copy then).
fn f32_compact(t: CubeTensor) -> CubeTensor {
    use burn::backend::Cube;
    use burn::backend::ops::FloatTensorOps;
    let t = match t.dtype {
        DType::F32 => t,
        _ => Cube::float_cast(t, burn::tensor::FloatDType::F32),
    };
    compact_input(t).expect("a row-major copy")
}

/// `quant::history::HistoryOps::amax_push`: one launch.
pub(crate) fn amax_push(
    history: CubeTensor,
    input: CubeTensor,
    weight: CubeTensor,
    output_grad: CubeTensor,
) -> CubeTensor {
    let history = f32_compact(history);
    let len = history.meta.shape()[1];
    let [input, weight, output_grad] = [input, weight, output_grad].map(f32_compact);
    let new = compact_output(&history, history.meta.shape().clone(), DType::F32);
    // SAFETY: three blocks, one a row; every index is below the row's `len`.
    unsafe {
        history_push_kernel::launch_unchecked(
            &history.client,
            CubeCount::Static(3, 1, 1),
            CubeDim::new_1d(256),
            history.clone().into_tensor_arg(),
            input.into_tensor_arg(),
            weight.into_tensor_arg(),
            output_grad.into_tensor_arg(),
            new.clone().into_tensor_arg(),
            len as u32,
        )
    };
    new
}

/// `quant::history::HistoryOps::amax_kept`: one launch.
pub(crate) fn amax_kept(history: CubeTensor, most_recent: bool) -> CubeTensor {
    let history = f32_compact(history);
    let (rows, len) = (history.meta.shape()[0], history.meta.shape()[1]);
    let kept = compact_output(&history, Shape::new([rows]), DType::F32);
    // SAFETY: a block a row; every index is below the row's `len`.
    unsafe {
        history_kept_kernel::launch_unchecked(
            &history.client,
            CubeCount::Static(rows as u32, 1, 1),
            CubeDim::new_1d(256),
            history.clone().into_tensor_arg(),
            kept.clone().into_tensor_arg(),
            len as u32,
            most_recent,
        )
    };
    kept
}
