//! Row kernels, a block of 256 threads a row (vectors of 8 along the row where it allows, a
//! shuffle-and-shared-memory sum): RMSNorm's forward and `dx`, with a column-sum kernel for its
//! `dw` that leaves one partial row per 64 input rows, summed after; cross-entropy's row sums,
//! with an elementwise kernel for their backward.

use burn::backend::Cube;
use burn::backend::ops::FloatTensorOps;
use burn::tensor::{DType, Shape};
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use half::{bf16, f16};

use crate::cross_entropy::reference as ce_reference;
use crate::elementwise::{compact_input, compact_output, launch_float};
use crate::rms_norm::reference;

/// Threads a block: 8 warps.
const THREADS: u32 = 256;
/// Input rows a `dw` block sums.
const DW_ROWS: u32 = 64;

#[cube]
pub(crate) fn hsum<N: Size>(v: Vector<f32, N>) -> f32 {
    let mut sum = 0.0f32;
    #[unroll]
    for i in 0..v.vector_size() {
        sum += v.extract(i);
    }
    sum
}

/// The sum of `x` over the block's 256 threads, on every thread.
#[cube]
pub(crate) fn block_sum(x: f32) -> f32 {
    block_reduce(x, false)
}

/// The largest `x` over the block's 256 threads, on every thread.
#[cube]
pub(crate) fn block_max(x: f32) -> f32 {
    block_reduce(x, true)
}

/// The sum, or with `max` the largest, of `x` over the block's 256 threads: each warp's by
/// shuffles, then the 8 warps' through shared memory.
#[cube]
fn block_reduce(x: f32, #[comptime] max: bool) -> f32 {
    let mut partial = Shared::<[f32]>::new_slice(8usize);
    let warp = if comptime!(max) { plane_max(x) } else { plane_sum(x) };
    if UNIT_POS_PLANE == 0 {
        partial[PLANE_POS as usize] = warp;
    }
    sync_cube();
    let mut total = partial[0];
    #[unroll]
    for i in 1..8usize {
        if comptime!(max) {
            total = f32::max(total, partial[i]);
        } else {
            total += partial[i];
        }
    }
    total
}

/// Grid: one block a row. `columns` counts vectors, `width` elements.
#[cube(launch_unchecked)]
fn forward_kernel<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    weight: &Tensor<Vector<F, N>>,
    y: &mut Tensor<Vector<F, N>>,
    rstd: &mut Tensor<f32>,
    columns: u32,
    width: f32,
    epsilon: f32,
) {
    let base = CUBE_POS * columns as usize;
    let mut squares = 0.0f32;
    for c in range_stepped(UNIT_POS, columns, THREADS) {
        let v = Vector::<f32, N>::cast_from(x[base + c as usize]);
        squares += hsum(v * v);
    }
    let r = 1.0f32 / (block_sum(squares) / width + epsilon).sqrt();
    for c in range_stepped(UNIT_POS, columns, THREADS) {
        let v = Vector::<f32, N>::cast_from(x[base + c as usize]);
        y[base + c as usize] = Vector::<F, N>::cast_from(v * Vector::new(r)) * weight[c as usize];
    }
    if UNIT_POS == 0 {
        rstd[CUBE_POS] = r;
    }
}

/// Grid: one block a row; `dx = rstd · (g∘w − x̂ · mean(g∘w∘x̂))`.
#[cube(launch_unchecked)]
fn dx_kernel<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    weight: &Tensor<Vector<F, N>>,
    rstd: &Tensor<f32>,
    grad: &Tensor<Vector<F, N>>,
    dx: &mut Tensor<Vector<F, N>>,
    columns: u32,
    width: f32,
) {
    let base = CUBE_POS * columns as usize;
    let r = Vector::<f32, N>::new(rstd[CUBE_POS]);
    let mut dot = 0.0f32;
    for c in range_stepped(UNIT_POS, columns, THREADS) {
        let i = base + c as usize;
        let gw = Vector::<f32, N>::cast_from(grad[i]) * Vector::<f32, N>::cast_from(weight[c as usize]);
        dot += hsum(gw * Vector::<f32, N>::cast_from(x[i]) * r);
    }
    let mean = Vector::<f32, N>::new(block_sum(dot) / width);
    for c in range_stepped(UNIT_POS, columns, THREADS) {
        let i = base + c as usize;
        let gw = Vector::<f32, N>::cast_from(grad[i]) * Vector::<f32, N>::cast_from(weight[c as usize]);
        dx[i] = Vector::cast_from(r * (gw - Vector::<f32, N>::cast_from(x[i]) * r * mean));
    }
}

/// Grid `(columns / 256, rows / 64)`: `partial[row block, c] = Σ g ∘ x · rstd` over 64 rows.
#[cube(launch_unchecked)]
fn dw_kernel<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    rstd: &Tensor<f32>,
    grad: &Tensor<Vector<F, N>>,
    partial: &mut Tensor<Vector<f32, N>>,
    columns: u32,
    rows: u32,
) {
    let c = CUBE_POS_X * THREADS + UNIT_POS;
    if c < columns {
        let first = CUBE_POS_Y * DW_ROWS;
        let last = min(first + DW_ROWS, rows);
        let mut sum = Vector::<f32, N>::new(0.0f32);
        for r in first..last {
            let i = (r * columns + c) as usize;
            sum += Vector::<f32, N>::cast_from(grad[i])
                * Vector::<f32, N>::cast_from(x[i])
                * Vector::new(rstd[r as usize]);
        }
        partial[(CUBE_POS_Y * columns + c) as usize] = sum;
    }
}

/// `(rows, columns, vector)` when the kernels take `x` and `weight`: compact, one float dtype,
/// a weight as long as a row.
fn layout(x: &CubeTensor, weight: &CubeTensor) -> Option<(usize, usize, usize)> {
    let columns = *x.meta.shape().last()?;
    let fits = x.dtype == weight.dtype
        && matches!(x.dtype, DType::BF16 | DType::F16 | DType::F32)
        && weight.meta.shape().num_dims() == 1
        && weight.meta.shape()[0] == columns
        && columns > 0;
    let vector = if columns.is_multiple_of(8) { 8 } else { 1 };
    fits.then_some((x.meta.num_elements() / columns, columns, vector))
}

/// `x`'s shape with a last dim of 1.
fn row_shape(x: &CubeTensor) -> Shape {
    let mut dims: Vec<usize> = x.meta.shape().iter().copied().collect();
    *dims.last_mut().expect("rank ≥ 1") = 1;
    Shape::from(dims)
}

pub(crate) fn forward(x: CubeTensor, weight: CubeTensor, epsilon: f32) -> (CubeTensor, CubeTensor) {
    let (Some((rows, columns, vector)), Some(xc), Some(wc)) = (
        layout(&x, &weight),
        compact_input(x.clone()),
        compact_input(weight.clone()),
    ) else {
        return reference::forward::<Cube>(x, weight, epsilon);
    };
    let y = compact_output(&xc, xc.meta.shape().clone(), xc.dtype);
    let rstd = compact_output(&xc, row_shape(&xc), DType::F32);
    let count = CubeCount::Static(rows as u32, 1, 1);
    let args = (
        xc.clone().into_tensor_arg(),
        wc.into_tensor_arg(),
        y.clone().into_tensor_arg(),
        rstd.clone().into_tensor_arg(),
    );
    launch_float!(
        xc.dtype,
        forward_kernel,
        &xc.client,
        count,
        CubeDim::new_1d(THREADS),
        vector,
        args.0,
        args.1,
        args.2,
        args.3,
        (columns / vector) as u32,
        columns as f32,
        epsilon
    );
    (y, rstd)
}

pub(crate) fn backward(
    x: CubeTensor,
    weight: CubeTensor,
    rstd: CubeTensor,
    grad: CubeTensor,
) -> (CubeTensor, CubeTensor) {
    let inputs = (
        layout(&x, &weight),
        compact_input(x.clone()),
        compact_input(weight.clone()),
        compact_input(rstd.clone()),
        compact_input(grad.clone()),
    );
    let (Some((rows, columns, vector)), Some(xc), Some(wc), Some(rc), Some(gc)) = inputs else {
        return reference::backward::<Cube>(x, weight, rstd, grad);
    };
    if gc.dtype != xc.dtype {
        return reference::backward::<Cube>(x, weight, rstd, grad);
    }
    let client = xc.client.clone();
    let vectors = (columns / vector) as u32;
    let dx = compact_output(&xc, xc.meta.shape().clone(), xc.dtype);
    let row_blocks = (rows as u32).div_ceil(DW_ROWS);
    let partial = compact_output(&xc, Shape::from([row_blocks as usize, columns]), DType::F32);
    let dim = CubeDim::new_1d(THREADS);
    let dx_args = (
        xc.clone().into_tensor_arg(),
        wc.into_tensor_arg(),
        rc.clone().into_tensor_arg(),
        gc.clone().into_tensor_arg(),
        dx.clone().into_tensor_arg(),
    );
    launch_float!(
        xc.dtype,
        dx_kernel,
        &client,
        CubeCount::Static(rows as u32, 1, 1),
        dim,
        vector,
        dx_args.0,
        dx_args.1,
        dx_args.2,
        dx_args.3,
        dx_args.4,
        vectors,
        columns as f32
    );
    let dw_count = CubeCount::Static(vectors.div_ceil(THREADS), row_blocks, 1);
    let dw_args = (
        xc.clone().into_tensor_arg(),
        rc.into_tensor_arg(),
        gc.into_tensor_arg(),
        partial.clone().into_tensor_arg(),
    );
    launch_float!(
        xc.dtype,
        dw_kernel,
        &client,
        dw_count,
        dim,
        vector,
        dw_args.0,
        dw_args.1,
        dw_args.2,
        dw_args.3,
        vectors,
        rows as u32
    );
    let dw = Cube::float_reshape(Cube::float_sum_dim(partial, 0), Shape::from([columns]));
    (dx, Cube::float_cast(dw, weight.dtype.into()))
}

/// Grid: one block a row. `out[row]` the largest of the row's columns before `valid` (NaN
/// ignored; −∞ for none).
#[cube(launch_unchecked)]
fn ce_row_max_kernel<F: Float, N: Size>(
    logits: &Tensor<Vector<F, N>>,
    out: &mut Tensor<f32>,
    columns: u32,
    valid: u32,
) {
    let row = CUBE_POS;
    let base = row * columns as usize;
    let width = logits.vector_size().comptime() as u32;
    let mut acc = f32::new(f32::NEG_INFINITY);
    for c in range_stepped(UNIT_POS, columns, THREADS) {
        let v = Vector::<f32, N>::cast_from(logits[base + c as usize]);
        #[unroll]
        for lane in 0..logits.vector_size() {
            if c * width + (lane as u32) < valid {
                acc = f32::max(acc, v.extract(lane));
            }
        }
    }
    let acc = block_max(acc);
    if UNIT_POS == 0 {
        out[row] = acc;
    }
}

/// Grid: one block a row. `out[row] = (Σ exp x̃, x̃ at the target, Σ x̃)` over the columns
/// before `valid` (`crate::cross_entropy`).
#[cube(launch_unchecked)]
fn ce_partials_kernel<F: Float, N: Size>(
    logits: &Tensor<Vector<F, N>>,
    shift: &Tensor<f32>,
    target: &Tensor<f32>,
    out: &mut Tensor<f32>,
    columns: u32,
    valid: u32,
) {
    let row = CUBE_POS;
    let base = row * columns as usize;
    let s = shift[row];
    let t = i32::cast_from(target[row]);
    let width = logits.vector_size().comptime() as u32;
    let mut sum_exp = 0.0f32;
    let mut picked = 0.0f32;
    let mut real = 0.0f32;
    for c in range_stepped(UNIT_POS, columns, THREADS) {
        let v = Vector::<f32, N>::cast_from(logits[base + c as usize]) - Vector::new(s);
        #[unroll]
        for lane in 0..logits.vector_size() {
            let column = c * width + lane as u32;
            let x = v.extract(lane);
            if column < valid {
                sum_exp += x.exp();
                real += x;
                if i32::cast_from(column) == t {
                    picked += x;
                }
            }
        }
    }
    let sum_exp = block_sum(sum_exp);
    let picked = block_sum(picked);
    let real = block_sum(real);
    if UNIT_POS == 0 {
        out[row * 3] = sum_exp;
        out[row * 3 + 1] = picked;
        out[row * 3 + 2] = real;
    }
}

/// `dlogits = g₀·exp x̃ + g₁·[j = t] + g₂` before `valid`, 0 after; one thread a vector.
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
        let (g0, g1, g2) = (grad[row * 3], grad[row * 3 + 1], grad[row * 3 + 2]);
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

pub(crate) fn cross_entropy_row_max(logits: CubeTensor, valid: usize) -> CubeTensor {
    let shape = logits.meta.shape().clone();
    let fits = shape.num_dims() == 2
        && matches!(logits.dtype, DType::BF16 | DType::F16 | DType::F32)
        && valid > 0
        && shape[0] > 0;
    let compact = fits.then(|| compact_input(logits.clone())).flatten();
    let Some(lc) = compact else {
        return ce_reference::row_max(tensor(logits), valid)
            .try_into_primitive::<Cube>()
            .expect("cuda");
    };
    let (rows, columns) = (shape[0], shape[1]);
    let vector = if columns.is_multiple_of(8) { 8 } else { 1 };
    let out = compact_output(&lc, Shape::from([rows]), DType::F32);
    launch_float!(
        lc.dtype,
        ce_row_max_kernel,
        &lc.client,
        CubeCount::Static(rows as u32, 1, 1),
        CubeDim::new_1d(THREADS),
        vector,
        lc.clone().into_tensor_arg(),
        out.clone().into_tensor_arg(),
        (columns / vector) as u32,
        valid as u32
    );
    out
}

pub(crate) fn cross_entropy_partials(
    logits: CubeTensor,
    shift: CubeTensor,
    target: CubeTensor,
    valid: usize,
) -> CubeTensor {
    let inputs = (
        ce_layout(&logits, &shift, &target),
        compact_input(logits.clone()),
        compact_input(shift.clone()),
        compact_input(target.clone()),
    );
    let (Some((rows, columns, vector)), Some(lc), Some(sc), Some(tc)) = inputs else {
        return ce_reference::partials(tensor(logits), tensor(shift), tensor(target), valid)
            .try_into_primitive::<Cube>()
            .expect("cuda");
    };
    let out = compact_output(&lc, Shape::from([rows, 3]), DType::F32);
    let count = CubeCount::Static(rows as u32, 1, 1);
    let args = (
        lc.clone().into_tensor_arg(),
        sc.into_tensor_arg(),
        tc.into_tensor_arg(),
        out.clone().into_tensor_arg(),
    );
    launch_float!(
        lc.dtype,
        ce_partials_kernel,
        &lc.client,
        count,
        CubeDim::new_1d(THREADS),
        vector,
        args.0,
        args.1,
        args.2,
        args.3,
        (columns / vector) as u32,
        valid as u32
    );
    out
}

pub(crate) fn cross_entropy_backward(
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
        return ce_reference::backward(tensor(logits), tensor(shift), tensor(target), valid, tensor(grad))
            .try_into_primitive::<Cube>()
            .expect("cuda");
    };
    if gc.dtype != DType::F32 || gc.meta.num_elements() != rows * 3 {
        return ce_reference::backward(tensor(logits), tensor(shift), tensor(target), valid, tensor(grad))
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
