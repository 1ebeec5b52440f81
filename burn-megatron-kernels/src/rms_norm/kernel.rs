//! RMSNorm's CUDA kernels, a block of 256 threads a row (vectors of 8 along the row where it
//! allows, a shuffle-and-shared-memory sum): the forward, and the backward taking `dx` and a
//! partial `dw` a block of rows from one read of the row, the partials summed by a column-sum
//! kernel.

use burn::backend::Cube;
use burn::tensor::{DType, Shape};
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use half::{bf16, f16};

use super::link::{FanOut, NormLink};
use super::reference;
use crate::cuda::launch::{compact_input, compact_output, launch_float};
use crate::cuda::reduce::{block_max, block_sum, hsum, vector_max};
use crate::quant::notes::{AmaxNotes, NoteAmaxes};

/// Threads a block: 8 warps.
const THREADS: u32 = 256;
/// Rows a block of [`backward_kernel`] takes: few enough that a step's 8192 rows make four
/// blocks an SM, so loads stay in flight.
const BACKWARD_ROWS: u32 = 16;
/// The most vectors of a row one thread of [`backward_kernel`] holds (hidden 8192 in vectors of
/// 8); wider rows take the tensor ops.
const MAX_SLOTS: usize = 4;
/// Column vectors a block of [`column_sum_kernel`] sums, and its lanes down the rows: hidden
/// 2048's 256 vectors make 32 blocks, 512 partial rows 16 loads a lane. (32 columns of 8 lanes
/// made 8 blocks of 64 loads a lane: 17 µs a llama-1b norm, on 8 of the SMs.)
const SUM_COLUMNS: u32 = 8;
const SUM_LANES: u32 = 32;
/// Rows a lane of [`column_sum_kernel`] loads at once.
const SUM_UNROLL: u32 = 8;

/// Grid: one block a row. `columns` counts vectors, `width` elements. With `note`, the row's
/// largest |y| (as written, NaN ignored) to `maxima[row]` (`known_amax`).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn forward_kernel<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    weight: &Tensor<Vector<F, N>>,
    y: &mut Tensor<Vector<F, N>>,
    rstd: &mut Tensor<f32>,
    maxima: &mut Tensor<f32>,
    columns: u32,
    width: f32,
    epsilon: f32,
    #[comptime] note: bool,
) {
    let base = CUBE_POS * columns as usize;
    let mut squares = 0.0f32;
    for c in range_stepped(UNIT_POS, columns, THREADS) {
        let v = Vector::<f32, N>::cast_from(x[base + c as usize]);
        squares += hsum(v * v);
    }
    let r = 1.0f32 / (block_sum(squares) / width + epsilon).sqrt();
    let mut top = 0.0f32;
    for c in range_stepped(UNIT_POS, columns, THREADS) {
        let v = Vector::<f32, N>::cast_from(x[base + c as usize]);
        let out = Vector::<F, N>::cast_from(v * Vector::new(r)) * weight[c as usize];
        y[base + c as usize] = out;
        if note {
            top = vector_max(top, out);
        }
    }
    if UNIT_POS == 0 {
        rstd[CUBE_POS] = r;
    }
    if note {
        let top = block_max(top);
        if UNIT_POS == 0 {
            maxima[CUBE_POS] = top;
        }
    }
}

/// Grid: a block [`BACKWARD_ROWS`] rows, each thread `slots` vectors of a row (vectors
/// `UNIT_POS + j·256`). For each row, `dx = rstd · (g∘w − x̂ · mean(g∘w∘x̂))` with `x̂ = x · rstd`;
/// and the block's `Σ g∘x̂` over its rows to `partial[block]` (`dw`'s share, summed by
/// [`column_sum_kernel`]). One read of `x` and `g` gives both gradients. `g` is `grad` plus
/// `more` (0 to 2) of `more_a`, `more_b` (the output's other readers' gradients); with `add`,
/// `dx` is `residual` plus the above (the residual stream's gradient); all summed in f32 and
/// rounded once. With `note`, the block's largest |dx| (as written, NaN ignored) to
/// `maxima[block]`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn backward_kernel<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    weight: &Tensor<Vector<F, N>>,
    rstd: &Tensor<f32>,
    grad: &Tensor<Vector<F, N>>,
    more_a: &Tensor<Vector<F, N>>,
    more_b: &Tensor<Vector<F, N>>,
    residual: &Tensor<Vector<F, N>>,
    dx: &mut Tensor<Vector<F, N>>,
    partial: &mut Tensor<Vector<f32, N>>,
    maxima: &mut Tensor<f32>,
    columns: u32,
    rows: u32,
    width: f32,
    #[comptime] slots: usize,
    #[comptime] more: u32,
    #[comptime] add: bool,
    #[comptime] note: bool,
) {
    let zero = Vector::<f32, N>::new(0.0f32);
    let mut w = Array::<Vector<f32, N>>::new(slots);
    let mut dw = Array::<Vector<f32, N>>::new(slots);
    let mut g = Array::<Vector<f32, N>>::new(slots);
    let mut normed = Array::<Vector<f32, N>>::new(slots);
    #[unroll]
    for j in 0..slots {
        let c = UNIT_POS + j as u32 * THREADS;
        w[j] = zero;
        if c < columns {
            w[j] = Vector::<f32, N>::cast_from(weight[c as usize]);
        }
        dw[j] = zero;
    }
    let first = CUBE_POS as u32 * BACKWARD_ROWS;
    let last = min(first + BACKWARD_ROWS, rows);
    let mut top = 0.0f32;
    for row in first..last {
        let base = row * columns;
        let r = Vector::<f32, N>::new(rstd[row as usize]);
        let mut dot = 0.0f32;
        #[unroll]
        for j in 0..slots {
            let c = UNIT_POS + j as u32 * THREADS;
            g[j] = zero;
            normed[j] = zero;
            if c < columns {
                let at = (base + c) as usize;
                g[j] = Vector::<f32, N>::cast_from(grad[at]);
                if comptime!(more > 0) {
                    g[j] += Vector::<f32, N>::cast_from(more_a[at]);
                }
                if comptime!(more > 1) {
                    g[j] += Vector::<f32, N>::cast_from(more_b[at]);
                }
                normed[j] = Vector::<f32, N>::cast_from(x[(base + c) as usize]) * r;
            }
            dot += hsum(g[j] * w[j] * normed[j]);
        }
        let mean = Vector::<f32, N>::new(block_sum(dot) / width);
        // The next row's sum writes the shared partials every thread has just read.
        sync_cube();
        #[unroll]
        for j in 0..slots {
            let c = UNIT_POS + j as u32 * THREADS;
            if c < columns {
                let at = (base + c) as usize;
                let mut value = r * (g[j] * w[j] - normed[j] * mean);
                if comptime!(add) {
                    value += Vector::<f32, N>::cast_from(residual[at]);
                }
                let written = Vector::<F, N>::cast_from(value);
                dx[at] = written;
                if comptime!(note) {
                    top = vector_max(top, written);
                }
                dw[j] += g[j] * normed[j];
            }
        }
    }
    if comptime!(note) {
        let top = block_max(top);
        if UNIT_POS == 0 {
            maxima[CUBE_POS] = top;
        }
    }
    #[unroll]
    for j in 0..slots {
        let c = UNIT_POS + j as u32 * THREADS;
        if c < columns {
            partial[(CUBE_POS as u32 * columns + c) as usize] = dw[j];
        }
    }
}

/// Grid: a block [`SUM_COLUMNS`] vectors of columns, [`SUM_LANES`] lanes of threads down the rows of
/// `partial` (`[parts, columns]`); `out[c] = Σ partial[·, c]` in `F`, each lane's rows summed in
/// order, the lanes in order: the same sum every run.
#[cube(launch_unchecked)]
fn column_sum_kernel<F: Float, N: Size>(
    partial: &Tensor<Vector<f32, N>>,
    out: &mut Tensor<Vector<F, N>>,
    columns: u32,
    parts: u32,
) {
    let mut lanes = Shared::<[Vector<f32, N>]>::new_slice(THREADS as usize);
    let (column, lane) = (UNIT_POS % SUM_COLUMNS, UNIT_POS / SUM_COLUMNS);
    let c = CUBE_POS as u32 * SUM_COLUMNS + column;
    let mut sum = Vector::<f32, N>::new(0.0f32);
    if c < columns {
        for start in range_stepped(lane, parts, SUM_LANES * SUM_UNROLL) {
            // The chunk's loads are issued together.
            #[unroll]
            for i in 0..SUM_UNROLL {
                let part = start + i * SUM_LANES;
                if part < parts {
                    sum += partial[(part * columns + c) as usize];
                }
            }
        }
    }
    lanes[UNIT_POS as usize] = sum;
    sync_cube();
    if lane == 0 && c < columns {
        let mut total = lanes[column as usize];
        #[unroll]
        for l in 1..SUM_LANES {
            total += lanes[(l * SUM_COLUMNS + column) as usize];
        }
        out[c as usize] = Vector::cast_from(total);
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

/// RMSNorm's `(y, rstd)` (the link's gradients come in the backward); with `notes.output`,
/// `y`'s rows' maxima noted for the cast that quantizes it
/// ([`known_amax`]).
pub(crate) fn rms_norm(
    x: CubeTensor,
    weight: CubeTensor,
    epsilon: f32,
    notes: NoteAmaxes,
    _link: Option<NormLink>,
) -> (CubeTensor, CubeTensor) {
    let notes = notes.output.as_ref();
    let note = notes.is_some();
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
    // Without a note the kernel never writes the maxima.
    let maxima = compact_output(&xc, Shape::new([if note { rows } else { 1 }]), DType::F32);
    let args = (
        xc.clone().into_tensor_arg(),
        wc.into_tensor_arg(),
        y.clone().into_tensor_arg(),
        rstd.clone().into_tensor_arg(),
        maxima.clone().into_tensor_arg(),
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
        args.4,
        (columns / vector) as u32,
        columns as f32,
        epsilon,
        note
    );
    if let Some(notes) = notes {
        notes.lock().record_maxima(&y, maxima);
    }
    (y, rstd)
}

/// `RmsNormOps::rms_norm_backward`: [`backward`] with nothing handed over.
pub(crate) fn rms_norm_backward(
    x: CubeTensor,
    weight: CubeTensor,
    rstd: CubeTensor,
    grad: CubeTensor,
    note: Option<AmaxNotes>,
) -> (CubeTensor, CubeTensor) {
    backward(x, weight, rstd, grad, Vec::new(), None, note.as_ref())
}

/// `RmsNormOps::rms_norm_backward_linked`: [`backward`] adding what `link` holds.
pub(crate) fn rms_norm_backward_linked(
    x: CubeTensor,
    weight: CubeTensor,
    rstd: CubeTensor,
    grad: CubeTensor,
    link: NormLink,
    note: Option<AmaxNotes>,
) -> (CubeTensor, CubeTensor) {
    let handed = link.lock().take::<CubeTensor>();
    backward(x, weight, rstd, grad, handed.uses, handed.residual, note.as_ref())
}

/// `RmsNormOps::residual_add` off autodiff: the sum (nothing to hand over).
pub(crate) fn residual_add(x: CubeTensor, branch: CubeTensor, _link: NormLink) -> CubeTensor {
    use burn::backend::ops::FloatTensorOps;
    Cube::float_add(x, branch)
}

/// `RmsNormOps::fan_out_use` off autodiff: `x` itself.
pub(crate) fn fan_out_use(x: CubeTensor, _fan: FanOut) -> CubeTensor {
    x
}

/// RMSNorm's `(dx, dw)` from the output gradient `grad` plus `uses`, `dx` plus `residual` where
/// given (one rounding), its amax noted for the cast that quantizes it where `note`
/// ([`known_amax`]: one maximum a block of rows).
pub(crate) fn backward(
    x: CubeTensor,
    weight: CubeTensor,
    rstd: CubeTensor,
    grad: CubeTensor,
    uses: Vec<CubeTensor>,
    residual: Option<CubeTensor>,
    notes: Option<&AmaxNotes>,
) -> (CubeTensor, CubeTensor) {
    use burn::backend::ops::FloatTensorOps;
    let note = notes.is_some();
    // The kernel reads two more output gradients at most: any further ones are added first.
    let (mut uses, more) = (uses, Vec::new());
    let more = match uses.len() > 2 {
        true => uses.split_off(2),
        false => more,
    };
    let grad = more.into_iter().fold(grad, Cube::float_add);
    let twin =
        |x, weight, rstd, grad, uses, residual| reference::backward::<Cube>(x, weight, rstd, grad, uses, residual);
    let inputs = (
        layout(&x, &weight),
        compact_input(x.clone()),
        compact_input(weight.clone()),
        compact_input(rstd.clone()),
        compact_input(grad.clone()),
    );
    let (Some((rows, columns, vector)), Some(xc), Some(wc), Some(rc), Some(gc)) = inputs else {
        return twin(x, weight, rstd, grad, uses, residual);
    };
    let like_x =
        |t: &CubeTensor| compact_input(t.clone()).filter(|t| t.dtype == xc.dtype && t.meta.shape() == xc.meta.shape());
    let uses_c: Option<Vec<CubeTensor>> = uses.iter().map(like_x).collect();
    let residual_c = residual.as_ref().map(like_x);
    let (Some(uses_c), true, true) = (
        uses_c,
        residual_c.as_ref().is_none_or(Option::is_some),
        gc.dtype == xc.dtype,
    ) else {
        return twin(x, weight, rstd, grad, uses, residual);
    };
    let vectors = (columns / vector) as u32;
    let slots = (vectors as usize).div_ceil(THREADS as usize);
    if slots > MAX_SLOTS {
        return twin(x, weight, rstd, grad, uses, residual);
    }
    let client = xc.client.clone();
    let dx = compact_output(&xc, xc.meta.shape().clone(), xc.dtype);
    let parts = (rows as u32).div_ceil(BACKWARD_ROWS);
    let partial = compact_output(&xc, Shape::from([parts as usize, columns]), DType::F32);
    // Without a note the kernel never writes the maxima; `grad` stands in for the gradients not
    // given (never read).
    let maxima = compact_output(&xc, Shape::new([if note { parts as usize } else { 1 }]), DType::F32);
    let (more, add) = (uses_c.len() as u32, residual_c.is_some());
    let mut uses = uses_c.into_iter();
    let (more_a, more_b) = (
        uses.next().unwrap_or_else(|| gc.clone()),
        uses.next().unwrap_or_else(|| gc.clone()),
    );
    let residual = residual_c.flatten().unwrap_or_else(|| gc.clone());
    let args = (
        xc.clone().into_tensor_arg(),
        wc.into_tensor_arg(),
        rc.into_tensor_arg(),
        gc.into_tensor_arg(),
        more_a.into_tensor_arg(),
        more_b.into_tensor_arg(),
        residual.into_tensor_arg(),
        dx.clone().into_tensor_arg(),
        partial.clone().into_tensor_arg(),
        maxima.clone().into_tensor_arg(),
    );
    launch_float!(
        xc.dtype,
        backward_kernel,
        &client,
        CubeCount::Static(parts, 1, 1),
        CubeDim::new_1d(THREADS),
        vector,
        args.0,
        args.1,
        args.2,
        args.3,
        args.4,
        args.5,
        args.6,
        args.7,
        args.8,
        args.9,
        vectors,
        rows as u32,
        columns as f32,
        slots,
        more,
        add,
        note
    );
    if let Some(notes) = notes {
        notes.lock().record_maxima(&dx, maxima);
    }
    let dw = compact_output(&xc, Shape::from([columns]), xc.dtype);
    launch_float!(
        xc.dtype,
        column_sum_kernel,
        &client,
        CubeCount::Static(vectors.div_ceil(SUM_COLUMNS), 1, 1),
        CubeDim::new_1d(THREADS),
        vector,
        partial.into_tensor_arg(),
        dw.clone().into_tensor_arg(),
        vectors,
        parts
    );
    (dx, dw)
}
