//! Cross-entropy's CUDA kernels: a block of 256 threads a row of logits for the row's sums (one
//! pass, each thread keeping its own max and its sum under it), and an elementwise kernel for
//! their backward.

use burn::backend::Cube;
use burn::tensor::{DType, Shape};
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use half::{bf16, f16};

use super::reference;
use crate::cuda::hopper::exp2;
use crate::cuda::launch::{compact_input, compact_output, launch_float};
use crate::cuda::reduce::{block_max, block_sum};

/// Threads a block: 8 warps.
const THREADS: u32 = 256;
/// `log₂ e`: `exp(x) = 2^(x·log₂ e)`, the exponential `ex2.approx` gives.
const LOG2_E: f32 = std::f32::consts::LOG2_E;

/// Grid: one block a row. `out[row] = (m, Σ exp x̃, x̃ at the target, Σ x̃)` over the columns
/// before `valid`, `x̃ = x − m` with `m` the row's max there (`crate::cross_entropy`): one pass,
/// each thread keeping its own max and its sum under it (rescaled when the max rises, once a
/// vector), the block's combined at the end. NaN is not ignored: a NaN logit makes the sums NaN.
#[cube(launch_unchecked)]
fn ce_partials_kernel<F: Float, N: Size>(
    logits: &Tensor<Vector<F, N>>,
    target: &Tensor<f32>,
    out: &mut Tensor<f32>,
    columns: u32,
    valid: u32,
) {
    let row = CUBE_POS;
    let base = row * columns as usize;
    let t = i32::cast_from(target[row]);
    let width = logits.vector_size().comptime() as u32;
    let mut m = f32::new(f32::NEG_INFINITY);
    let mut sum_exp = 0.0f32;
    let mut picked = 0.0f32;
    let mut real = 0.0f32;
    for c in range_stepped(UNIT_POS, columns, THREADS) {
        let v = Vector::<f32, N>::cast_from(logits[base + c as usize]);
        if (c + 1) * width <= valid {
            // A whole vector of real columns: one rescale at most.
            let mut top = v.extract(0usize);
            #[unroll]
            for lane in 1..logits.vector_size() {
                top = f32::max(top, v.extract(lane));
            }
            if top > m {
                sum_exp *= exp2((m - top) * LOG2_E);
                m = top;
            }
            #[unroll]
            for lane in 0..logits.vector_size() {
                let x = v.extract(lane);
                sum_exp += exp2((x - m) * LOG2_E);
                real += x;
                if i32::cast_from(c * width + lane as u32) == t {
                    picked = x;
                }
            }
        } else {
            #[unroll]
            for lane in 0..logits.vector_size() {
                let column = c * width + lane as u32;
                let x = v.extract(lane);
                if column < valid {
                    // The sum rescaled where x raises the max (never from −∞ to −∞: no NaN).
                    if x > m {
                        sum_exp *= exp2((m - x) * LOG2_E);
                        m = x;
                    }
                    sum_exp += exp2((x - m) * LOG2_E);
                    real += x;
                    if i32::cast_from(column) == t {
                        picked = x;
                    }
                }
            }
        }
    }
    let top = block_max(m);
    // A thread that saw no real column has m = −∞ and nothing to add.
    let mut mine = 0.0f32;
    if m > f32::new(f32::NEG_INFINITY) {
        mine = sum_exp * exp2((m - top) * LOG2_E);
    }
    let sum_exp = block_sum(mine);
    let picked = block_sum(picked);
    let real = block_sum(real);
    if UNIT_POS == 0 {
        let mut shifted_target = 0.0f32;
        let mut shifted_real = 0.0f32;
        if t >= 0 && (t as u32) < valid {
            shifted_target = picked - top;
        }
        if valid > 0 {
            shifted_real = real - valid as f32 * top;
        }
        out[row * 4] = top;
        out[row * 4 + 1] = sum_exp;
        out[row * 4 + 2] = shifted_target;
        out[row * 4 + 3] = shifted_real;
    }
}

/// `dlogits = g₀·exp x̃ + g₁·[j = t] + g₂` before `valid`, 0 after, `(g₀, g₁, g₂)` the sums'
/// gradients (columns 1–3 of `grad`; the max, column 0, is a constant); one thread a vector.
#[cube(launch_unchecked)]
fn ce_backward_kernel<F: Float, N: Size>(
    logits: &Tensor<Vector<F, N>>,
    shift: &Tensor<f32>,
    target: &Tensor<f32>,
    grad: &Tensor<f32>,
    d_logits: &mut Tensor<Vector<F, N>>,
    columns: u32,
    valid: u32,
) {
    let i = ABSOLUTE_POS;
    if i < d_logits.len() {
        let row = i / columns as usize;
        let c = (i % columns as usize) as u32;
        let width = logits.vector_size().comptime() as u32;
        let t = i32::cast_from(target[row]);
        let (g0, g1, g2) = (grad[row * 4 + 1], grad[row * 4 + 2], grad[row * 4 + 3]);
        let v = Vector::<f32, N>::cast_from(logits[i]) - Vector::new(shift[row]);
        let mut d = Vector::<f32, N>::empty();
        #[unroll]
        for lane in 0..logits.vector_size() {
            let column = c * width + lane as u32;
            let value = g0 * v.extract(lane).exp() + select(i32::cast_from(column) == t, g1, 0.0f32) + g2;
            d.insert(lane, select(column < valid, value, 0.0f32));
        }
        d_logits[i] = Vector::cast_from(d);
    }
}

/// `(rows, columns, vector)` when the cross-entropy kernels take these tensors.
fn ce_layout(logits: &CubeTensor, shift: &CubeTensor, target: &CubeTensor) -> Option<(usize, usize, usize)> {
    let shape = logits.meta.shape();
    let fits = shape.num_dims() == 2
        && matches!(logits.dtype, DType::BF16 | DType::F16 | DType::F32)
        && shift.dtype == DType::F32
        && target.dtype == DType::F32
        && shift.meta.num_elements() == shape[0]
        && target.meta.num_elements() == shape[0];
    let vector = if shape[1].is_multiple_of(8) { 8 } else { 1 };
    fits.then_some((shape[0], shape[1], vector))
}

fn tensor<const D: usize>(t: CubeTensor) -> burn::tensor::Tensor<D> {
    burn::tensor::Tensor::from_primitive::<Cube>(t)
}

pub(crate) fn cross_entropy_partials(logits: CubeTensor, target: CubeTensor, valid: usize) -> CubeTensor {
    let shape = logits.meta.shape().clone();
    let fits = shape.num_dims() == 2
        && matches!(logits.dtype, DType::BF16 | DType::F16 | DType::F32)
        && target.dtype == DType::F32
        && target.meta.num_elements() == shape[0]
        && shape[0] > 0;
    let inputs = (compact_input(logits.clone()), compact_input(target.clone()));
    let (true, Some(lc), Some(tc)) = (fits, inputs.0, inputs.1) else {
        return reference::partials(tensor(logits), tensor(target), valid)
            .try_into_primitive::<Cube>()
            .expect("cuda");
    };
    let (rows, columns) = (shape[0], shape[1]);
    let vector = if columns.is_multiple_of(8) { 8 } else { 1 };
    let out = compact_output(&lc, Shape::from([rows, 4]), DType::F32);
    launch_float!(
        lc.dtype,
        ce_partials_kernel,
        &lc.client,
        CubeCount::Static(rows as u32, 1, 1),
        CubeDim::new_1d(THREADS),
        vector,
        lc.clone().into_tensor_arg(),
        tc.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        (columns / vector) as u32,
        valid as u32
    );
    out
}

pub(crate) fn cross_entropy_partials_backward(
    logits: CubeTensor,
    shift: CubeTensor,
    target: CubeTensor,
    valid: usize,
    grad: CubeTensor,
) -> CubeTensor {
    let inputs = (
        ce_layout(&logits, &shift, &target),
        compact_input(logits.clone()),
        compact_input(shift.clone()),
        compact_input(target.clone()),
        compact_input(grad.clone()),
    );
    let (Some((rows, columns, vector)), Some(lc), Some(sc), Some(tc), Some(gc)) = inputs else {
        return reference::backward(tensor(logits), tensor(shift), tensor(target), valid, tensor(grad))
            .try_into_primitive::<Cube>()
            .expect("cuda");
    };
    if gc.dtype != DType::F32 || gc.meta.num_elements() != rows * 4 {
        return reference::backward(tensor(logits), tensor(shift), tensor(target), valid, tensor(grad))
            .try_into_primitive::<Cube>()
            .expect("cuda");
    }
    let d_logits = compact_output(&lc, lc.meta.shape().clone(), lc.dtype);
    let units = (rows * columns / vector) as u32;
    let count = CubeCount::Static(units.div_ceil(THREADS), 1, 1);
    let args = (
        lc.clone().into_tensor_arg(),
        sc.into_tensor_arg(),
        tc.into_tensor_arg(),
        gc.into_tensor_arg(),
        d_logits.clone().into_tensor_arg(),
    );
    launch_float!(
        lc.dtype,
        ce_backward_kernel,
        &lc.client,
        count,
        CubeDim::new_1d(THREADS),
        vector,
        args.0,
        args.1,
        args.2,
        args.3,
        args.4,
        (columns / vector) as u32,
        valid as u32
    );
    d_logits
}
