//! The CUDA kernels of [`rows`](crate::rows): a block of 256 threads a row, vectors of 8 along
//! the row where it allows, sums in f32. The index tensors are read as i32.

use burn::backend::Cube;
use burn::backend::ops::IntTensorOps;
use burn::tensor::{DType, IntDType, Shape};
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use half::{bf16, f16};

use crate::cuda::launch::{compact_input, compact_output, launch_float};
use crate::cuda::reduce::{block_sum, hsum};
use crate::rows::reference;

/// Threads a block: 8 warps.
pub(crate) const THREADS: u32 = 256;

/// Grid: one block an output row. `out[i] = x[index[i]]`, a zero row where `index[i] ≥ rows`.
#[cube(launch_unchecked)]
fn gather_kernel<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    index: &Tensor<i32>,
    out: &mut Tensor<Vector<F, N>>,
    columns: u32,
    rows: u32,
) {
    let source = u32::cast_from(index[CUBE_POS]);
    let base = CUBE_POS * columns as usize;
    let from = source as usize * columns as usize;
    for c in range_stepped(UNIT_POS, columns, THREADS) {
        let mut v = Vector::<f32, N>::new(0.0f32);
        if source < rows {
            v = Vector::<f32, N>::cast_from(x[from + c as usize]);
        }
        out[base + c as usize] = Vector::cast_from(v);
    }
}

/// Grid: one block a source row. `out[s] = Σ_j grad[readers[s, j]]`, readers `≥ m` skipped.
#[cube(launch_unchecked)]
fn gather_back_kernel<F: Float, N: Size>(
    grad: &Tensor<Vector<F, N>>,
    readers: &Tensor<i32>,
    out: &mut Tensor<Vector<F, N>>,
    columns: u32,
    m: u32,
    #[comptime] c: u32,
) {
    let base = CUBE_POS * columns as usize;
    for col in range_stepped(UNIT_POS, columns, THREADS) {
        let mut sum = Vector::<f32, N>::new(0.0f32);
        #[unroll]
        for j in 0..c {
            let reader = u32::cast_from(readers[CUBE_POS * c as usize + j as usize]);
            if reader < m {
                sum += Vector::<f32, N>::cast_from(grad[reader as usize * columns as usize + col as usize]);
            }
        }
        out[base + col as usize] = Vector::cast_from(sum);
    }
}

/// Grid: one block a token. `out[i] = Σ_j weights[i, j] · y[rows[i, j]]`, rows `≥ r` skipped.
#[cube(launch_unchecked)]
fn combine_kernel<F: Float, N: Size>(
    y: &Tensor<Vector<F, N>>,
    weights: &Tensor<f32>,
    rows: &Tensor<i32>,
    out: &mut Tensor<Vector<F, N>>,
    columns: u32,
    r: u32,
    #[comptime] k: u32,
) {
    let base = CUBE_POS * columns as usize;
    for col in range_stepped(UNIT_POS, columns, THREADS) {
        let mut sum = Vector::<f32, N>::new(0.0f32);
        #[unroll]
        for j in 0..k {
            let slot = CUBE_POS * k as usize + j as usize;
            let row = u32::cast_from(rows[slot]);
            if row < r {
                let v = Vector::<f32, N>::cast_from(y[row as usize * columns as usize + col as usize]);
                sum += Vector::new(weights[slot]) * v;
            }
        }
        out[base + col as usize] = Vector::cast_from(sum);
    }
}

/// Grid: one block a row `ρ` of `y`. `dy[ρ] = weights[s] · grad[s / k]` for `s = slots[ρ]`, a
/// zero row for `s ≥ copies`.
#[cube(launch_unchecked)]
fn combine_dy_kernel<F: Float, N: Size>(
    grad: &Tensor<Vector<F, N>>,
    weights: &Tensor<f32>,
    slots: &Tensor<i32>,
    dy: &mut Tensor<Vector<F, N>>,
    columns: u32,
    copies: u32,
    k: u32,
) {
    let slot = u32::cast_from(slots[CUBE_POS]);
    let base = CUBE_POS * columns as usize;
    let token = (slot / k) as usize * columns as usize;
    for col in range_stepped(UNIT_POS, columns, THREADS) {
        let mut v = Vector::<f32, N>::new(0.0f32);
        if slot < copies {
            v = Vector::new(weights[slot as usize]) * Vector::<f32, N>::cast_from(grad[token + col as usize]);
        }
        dy[base + col as usize] = Vector::cast_from(v);
    }
}

/// Grid: one block a token. `dw[i, j] = grad[i] · y[rows[i, j]]`, zero for rows `≥ r`.
#[cube(launch_unchecked)]
fn combine_dw_kernel<F: Float, N: Size>(
    grad: &Tensor<Vector<F, N>>,
    y: &Tensor<Vector<F, N>>,
    rows: &Tensor<i32>,
    dw: &mut Tensor<f32>,
    columns: u32,
    r: u32,
    #[comptime] k: u32,
) {
    let base = CUBE_POS * columns as usize;
    #[unroll]
    for j in 0..k {
        let slot = CUBE_POS * k as usize + j as usize;
        let row = u32::cast_from(rows[slot]);
        let mut dot = 0.0f32;
        if row < r {
            let from = row as usize * columns as usize;
            for col in range_stepped(UNIT_POS, columns, THREADS) {
                let g = Vector::<f32, N>::cast_from(grad[base + col as usize]);
                dot += hsum(g * Vector::<f32, N>::cast_from(y[from + col as usize]));
            }
        }
        let total = block_sum(dot);
        if UNIT_POS == 0 {
            dw[slot] = total;
        }
        // The next copy's sum reuses the shared partials every thread has just read.
        sync_cube();
    }
}

/// `t` compact, its float dtype one the kernels take.
pub(crate) fn float_input(t: &CubeTensor) -> Option<CubeTensor> {
    matches!(t.dtype, DType::BF16 | DType::F16 | DType::F32)
        .then(|| compact_input(t.clone()))
        .flatten()
}

/// `t` compact as i32.
pub(crate) fn index_input(t: CubeTensor) -> Option<CubeTensor> {
    compact_input(Cube::int_cast(t, IntDType::I32))
}

/// `t` compact as f32.
fn f32_input(t: CubeTensor) -> Option<CubeTensor> {
    compact_input(burn_cubecl::kernel::cast(t, DType::F32))
}

/// 8 elements a thread where the row allows (16-byte bf16 loads), else 1.
pub(crate) fn vector(columns: usize) -> usize {
    if columns.is_multiple_of(8) { 8 } else { 1 }
}

pub(crate) fn rows_grid(rows: usize) -> (CubeCount, CubeDim) {
    (CubeCount::Static(rows as u32, 1, 1), CubeDim::new_1d(THREADS))
}

/// `RowOps::gather_rows`: the readers (its backward's) are not read forward.
pub(crate) fn gather_rows(x: CubeTensor, index: CubeTensor, _readers: CubeTensor) -> CubeTensor {
    gather(x, index)
}

pub(crate) fn gather(x: CubeTensor, index: CubeTensor) -> CubeTensor {
    let (Some(xc), Some(ic)) = (float_input(&x), index_input(index.clone())) else {
        return reference::gather::<Cube>(x, index);
    };
    let (n, d) = (xc.meta.shape()[0], xc.meta.shape()[1]);
    let m = ic.meta.num_elements();
    let out = compact_output(&xc, Shape::from([m, d]), xc.dtype);
    if m == 0 || d == 0 {
        return out;
    }
    let (count, dim) = rows_grid(m);
    launch_float!(
        xc.dtype,
        gather_kernel,
        &xc.client,
        count,
        dim,
        vector(d),
        xc.clone().into_tensor_arg(),
        ic.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        (d / vector(d)) as u32,
        n as u32
    );
    out
}

pub(crate) fn gather_rows_back(grad: CubeTensor, readers: CubeTensor) -> CubeTensor {
    let (Some(gc), Some(rc)) = (float_input(&grad), index_input(readers.clone())) else {
        return reference::gather_back::<Cube>(grad, readers);
    };
    let (m, d) = (gc.meta.shape()[0], gc.meta.shape()[1]);
    let (n, c) = (rc.meta.shape()[0], rc.meta.shape()[1]);
    let out = compact_output(&gc, Shape::from([n, d]), gc.dtype);
    if n == 0 || d == 0 {
        return out;
    }
    let (count, dim) = rows_grid(n);
    launch_float!(
        gc.dtype,
        gather_back_kernel,
        &gc.client,
        count,
        dim,
        vector(d),
        gc.clone().into_tensor_arg(),
        rc.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        (d / vector(d)) as u32,
        m as u32,
        c as u32
    );
    out
}

pub(crate) fn combine_rows(y: CubeTensor, weights: CubeTensor, rows: CubeTensor, _slots: CubeTensor) -> CubeTensor {
    let inputs = (float_input(&y), f32_input(weights.clone()), index_input(rows.clone()));
    let (Some(yc), Some(wc), Some(rc)) = inputs else {
        return reference::combine::<Cube>(y, weights, rows);
    };
    let (r, d) = (yc.meta.shape()[0], yc.meta.shape()[1]);
    let (t, k) = (rc.meta.shape()[0], rc.meta.shape()[1]);
    let out = compact_output(&yc, Shape::from([t, d]), yc.dtype);
    if t == 0 || d == 0 {
        return out;
    }
    let (count, dim) = rows_grid(t);
    launch_float!(
        yc.dtype,
        combine_kernel,
        &yc.client,
        count,
        dim,
        vector(d),
        yc.clone().into_tensor_arg(),
        wc.into_tensor_arg(),
        rc.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        (d / vector(d)) as u32,
        r as u32,
        k as u32
    );
    out
}

pub(crate) fn combine_rows_back(
    y: CubeTensor,
    weights: CubeTensor,
    rows: CubeTensor,
    slots: CubeTensor,
    grad: CubeTensor,
) -> (CubeTensor, CubeTensor) {
    let inputs = (
        float_input(&y),
        f32_input(weights.clone()),
        index_input(rows.clone()),
        index_input(slots.clone()),
        float_input(&grad).filter(|g| g.dtype == y.dtype),
    );
    let (Some(yc), Some(wc), Some(rc), Some(sc), Some(gc)) = inputs else {
        return reference::combine_back::<Cube>(y, weights, rows, slots, grad);
    };
    let (r, d) = (yc.meta.shape()[0], yc.meta.shape()[1]);
    let (t, k) = (rc.meta.shape()[0], rc.meta.shape()[1]);
    let dy = compact_output(&yc, Shape::from([r, d]), yc.dtype);
    let dw = compact_output(&yc, Shape::from([t, k]), DType::F32);
    let columns = (d / vector(d)) as u32;
    if r > 0 && d > 0 {
        let (count, dim) = rows_grid(r);
        launch_float!(
            yc.dtype,
            combine_dy_kernel,
            &yc.client,
            count,
            dim,
            vector(d),
            gc.clone().into_tensor_arg(),
            wc.into_tensor_arg(),
            sc.into_tensor_arg(),
            dy.clone().into_tensor_arg(),
            columns,
            (t * k) as u32,
            k as u32
        );
    }
    if t > 0 && d > 0 {
        let (count, dim) = rows_grid(t);
        launch_float!(
            yc.dtype,
            combine_dw_kernel,
            &yc.client,
            count,
            dim,
            vector(d),
            gc.into_tensor_arg(),
            yc.clone().into_tensor_arg(),
            rc.into_tensor_arg(),
            dw.clone().into_tensor_arg(),
            columns,
            r as u32,
            k as u32
        );
    }
    (dy, burn_cubecl::kernel::cast(dw, weights.dtype))
}
