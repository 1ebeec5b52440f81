//! The quantization CUDA kernels (`crate::quant`): FP8 in 1×128 tiles, one warp a tile; FP8 with
//! one scale a tensor from its amax (`partials_kernel`), cast and optionally transposed in one pass;
//! the uniform draws of stochastic rounding.

use burn::tensor::{DType, Shape};
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use cubecl::{e4m3, e5m2};
use half::{bf16, f16};

use crate::elementwise::{compact_input, compact_output, launch_float};
use crate::quant::format::Minifloat;
use crate::quant::tiles::TILE;
use crate::row_kernels::block_max;

/// Warps a block: 8 tiles a block.
const WARPS: u32 = 8;

/// Grid: one warp a tile of `TILE` values of a row; lane `l` reads columns `l + 32·j`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn quantize_tiles_kernel<F: Float>(
    x: &Tensor<F>,
    codes: &mut Tensor<u8>,
    scales: &mut Tensor<f32>,
    rows: u32,
    columns: u32,
    tiles: u32,
    max: f32,
    #[comptime] e5m2_codes: bool,
) {
    let tile_id = CUBE_POS as u32 * WARPS + UNIT_POS_Y;
    if tile_id < rows * tiles {
        let row = tile_id / tiles;
        let first = (tile_id % tiles) * 128u32;
        let mut amax = 0.0f32;
        #[unroll]
        for j in 0..4u32 {
            let col = first + UNIT_POS_X + 32u32 * j;
            if col < columns {
                amax = f32::max(amax, f32::abs(f32::cast_from(x[(row * columns + col) as usize])));
            }
        }
        let amax = plane_max(amax);
        // As the reference: amax / max, 1 for a zero or non-finite amax or one whose scale is
        // below f32's normal range; values times 1 / scale.
        let mut scale = 1.0f32;
        if amax <= 3.4028235e38f32 && amax / max >= 1.1754944e-38f32 {
            scale = amax / max;
        }
        let factor = 1.0f32 / scale;
        #[unroll]
        for j in 0..4u32 {
            let col = first + UNIT_POS_X + 32u32 * j;
            if col < columns {
                let at = (row * columns + col) as usize;
                codes[at] = fp8_code(f32::cast_from(x[at]) * factor, e5m2_codes);
            }
        }
        if UNIT_POS_X == 0 {
            scales[tile_id as usize] = scale;
        }
    }
}

/// Codes `[r, c]` (u8) and scales `[r, ⌈c / 128⌉]` (f32) of `x` in `format`.
pub(crate) fn quantize_tiles(x: CubeTensor, format: Minifloat) -> (CubeTensor, CubeTensor) {
    let x = match matches!(x.dtype, DType::BF16 | DType::F16 | DType::F32) {
        true => x,
        false => {
            use burn::backend::ops::FloatTensorOps;
            burn::backend::Cube::float_cast(x, burn::tensor::FloatDType::F32)
        }
    };
    let x = compact_input(x).expect("a row-major copy");
    let dims = x.meta.shape().clone();
    let (r, c) = (dims[0], dims[1]);
    let tiles = c.div_ceil(TILE);
    let codes = compact_output(&x, Shape::new([r, c]), DType::U8);
    let scales = compact_output(&x, Shape::new([r, tiles]), DType::F32);
    let count = ((r * tiles) as u32).div_ceil(WARPS);
    if count > 0 {
        launch_float!(
            x.dtype,
            quantize_tiles_kernel,
            &x.client,
            CubeCount::Static(count, 1, 1),
            CubeDim::new_2d(32, WARPS),
            x.clone().into_tensor_arg(),
            codes.clone().into_tensor_arg(),
            scales.clone().into_tensor_arg(),
            r as u32,
            c as u32,
            tiles as u32,
            format.max(),
            format == Minifloat::E5M2,
        );
    }
    (codes, scales)
}

/// The factor values are multiplied by before encoding: `max / amax` (1 for a zero or
/// non-finite amax, as [`crate::quant::scaling::quantize_scale`]).
#[cube]
fn fp8_factor(amax: f32, max: f32) -> f32 {
    // As `quant::scaling::quantize_scale`: 1 unless `max / amax` is finite.
    let mut factor = 1.0f32;
    if amax > 0.0f32 && amax <= 3.4028235e38f32 && max / amax <= 3.4028235e38f32 {
        factor = max / amax;
    }
    factor
}

/// The amax a tensor scales by: `kept` (a delayed-scaling history's) where the recipe keeps one
/// and it is above zero, else the call's own `amax`.
#[cube]
fn scaling_amax(amax: &Tensor<f32>, kept: &Tensor<f32>, #[comptime] delayed: bool) -> f32 {
    let mut chosen = amax[0];
    if comptime!(delayed) {
        let k = kept[0];
        if k > 0.0f32 {
            chosen = k;
        }
    }
    chosen
}

/// The FP8 code of `value`, as a byte.
#[cube]
fn fp8_code(value: f32, #[comptime] e5m2_codes: bool) -> u8 {
    if comptime!(e5m2_codes) {
        u8::reinterpret(e5m2::cast_from(value))
    } else {
        u8::reinterpret(e4m3::cast_from(value))
    }
}

/// One thread a value: `x · factor` encoded at `[row, col]` of the codes; thread 0 writes
/// `1 / factor` to `dequant[0]`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn quantize_tensor_kernel<F: Float>(
    x: &Tensor<F>,
    amax: &Tensor<f32>,
    kept: &Tensor<f32>,
    codes: &mut Tensor<u8>,
    dequant: &mut Tensor<f32>,
    count: u32,
    max: f32,
    #[comptime] e5m2_codes: bool,
    #[comptime] delayed: bool,
) {
    let i = ABSOLUTE_POS as u32;
    let factor = fp8_factor(scaling_amax(amax, kept, delayed), max);
    if i < count {
        codes[i as usize] = fp8_code(f32::cast_from(x[i as usize]) * factor, e5m2_codes);
    }
    if i == 0 {
        dequant[0] = 1.0f32 / factor;
    }
}

/// The transposing cast: a 32 × 8 block a 32 × 32 tile, read along `x`'s rows and written
/// along the codes' rows (`[c, r]`) through shared memory, so both sides are coalesced; with
/// `direct`, the codes of `x` itself (`[r, c]`) written from the same read.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn quantize_transposed_kernel<F: Float>(
    x: &Tensor<F>,
    amax: &Tensor<f32>,
    kept: &Tensor<f32>,
    codes: &mut Tensor<u8>,
    direct_codes: &mut Tensor<u8>,
    dequant: &mut Tensor<f32>,
    rows: u32,
    columns: u32,
    max: f32,
    #[comptime] e5m2_codes: bool,
    #[comptime] direct: bool,
    #[comptime] delayed: bool,
) {
    // 33 words a row: the column reads of the second half fall in 32 different banks.
    let mut tile = Shared::<[u32]>::new_slice(1056usize);
    let factor = fp8_factor(scaling_amax(amax, kept, delayed), max);
    let (r0, c0) = (CUBE_POS_Y * 32u32, CUBE_POS_X * 32u32);
    let (tx, ty) = (UNIT_POS_X, UNIT_POS_Y);
    #[unroll]
    for j in 0..4u32 {
        let (r, c) = (r0 + ty + 8u32 * j, c0 + tx);
        if r < rows && c < columns {
            let at = r * columns + c;
            let code = fp8_code(f32::cast_from(x[at as usize]) * factor, e5m2_codes);
            tile[((ty + 8u32 * j) * 33u32 + tx) as usize] = u32::cast_from(code);
            if comptime!(direct) {
                direct_codes[at as usize] = code;
            }
        }
    }
    sync_cube();
    #[unroll]
    for j in 0..4u32 {
        let (c, r) = (c0 + ty + 8u32 * j, r0 + tx);
        if r < rows && c < columns {
            codes[(c * rows + r) as usize] = u8::cast_from(tile[(tx * 33u32 + ty + 8u32 * j) as usize]);
        }
    }
    if CUBE_POS_X == 0 && CUBE_POS_Y == 0 && UNIT_POS == 0 {
        dequant[0] = 1.0f32 / factor;
    }
}

/// Rows (and columns) of the tile one block of [`quantize_transposed_vectors_kernel`] casts.
const TILE_64: u32 = 64;
/// Values a thread of [`quantize_transposed_vectors_kernel`] reads, and codes it writes, at once.
const CAST_VECTOR: usize = 8;

/// The transposing cast of a tensor whose both sides are multiples of [`CAST_VECTOR`]: a block
/// of 256 threads a 64 × 64 tile; each thread reads vectors of 8 values along `x`'s rows (16
/// bytes of bf16), writes their 8 codes along the direct codes' rows with `direct`, and after
/// the tile passes through shared memory, 8 codes along a row of the transposed codes (`[c, r]`).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn quantize_transposed_vectors_kernel<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    amax: &Tensor<f32>,
    kept: &Tensor<f32>,
    codes: &mut Tensor<Vector<u8, N>>,
    direct_codes: &mut Tensor<Vector<u8, N>>,
    dequant: &mut Tensor<f32>,
    rows: u32,
    columns: u32,
    max: f32,
    #[comptime] e5m2_codes: bool,
    #[comptime] direct: bool,
    #[comptime] delayed: bool,
) {
    // 65 words a row: a column's reads fall in different banks (two threads a bank at most).
    let mut tile = Shared::<[u32]>::new_slice(4160usize);
    let factor = fp8_factor(scaling_amax(amax, kept, delayed), max);
    let (r0, c0) = (CUBE_POS_Y * TILE_64, CUBE_POS_X * TILE_64);
    let (lane_row, lane_vector) = (UNIT_POS / 8u32, UNIT_POS % 8u32);
    let vector = CAST_VECTOR as u32;
    #[unroll]
    for j in 0..2u32 {
        let row = lane_row + 32u32 * j;
        let (r, c) = (r0 + row, c0 + lane_vector * vector);
        if r < rows && c < columns {
            let at = ((r * columns + c) / vector) as usize;
            let values = Vector::<f32, N>::cast_from(x[at]) * Vector::new(factor);
            let mut packed = Vector::<u8, N>::empty();
            #[unroll]
            for e in 0..values.vector_size() {
                let code = fp8_code(values.extract(e), e5m2_codes);
                packed.insert(e, code);
                tile[(row * 65u32 + lane_vector * vector + e as u32) as usize] = u32::cast_from(code);
            }
            if comptime!(direct) {
                direct_codes[at] = packed;
            }
        }
    }
    sync_cube();
    #[unroll]
    for j in 0..2u32 {
        let column = lane_row + 32u32 * j;
        let (c, r) = (c0 + column, r0 + lane_vector * vector);
        if c < columns && r < rows {
            let mut packed = Vector::<u8, N>::empty();
            #[unroll]
            for e in 0..packed.vector_size() {
                packed.insert(
                    e,
                    u8::cast_from(tile[((lane_vector * vector + e as u32) * 65u32 + column) as usize]),
                );
            }
            codes[((c * rows + r) / vector) as usize] = packed;
        }
    }
    if CUBE_POS_X == 0 && CUBE_POS_Y == 0 && UNIT_POS == 0 {
        dequant[0] = 1.0f32 / factor;
    }
}

/// One block: `out[0]` the largest of `count` partial amaxes (each ≥ 0).
#[cube(launch_unchecked)]
fn max_of_partials_kernel(partials: &Tensor<f32>, out: &mut Tensor<f32>, count: u32) {
    let mut acc = 0.0f32;
    for i in range_stepped(UNIT_POS, count, 256u32) {
        acc = f32::max(acc, partials[i as usize]);
    }
    let total = block_max(acc);
    if UNIT_POS == 0 {
        out[0] = total;
    }
}

/// The largest of a block's partial amaxes, `[1]`: one block of 256 threads (Burn's general
/// reduction took 27 µs a call over the ~1 000 partials of a llama-1b activation, ncu).
fn max_of_partials(partials: CubeTensor) -> CubeTensor {
    let count = partials.meta.num_elements() as u32;
    let out = compact_output(&partials, Shape::new([1]), DType::F32);
    // SAFETY: one block; every read is below `count`, the partials' length, and one thread writes.
    unsafe {
        max_of_partials_kernel::launch_unchecked(
            &partials.client,
            CubeCount::Static(1, 1, 1),
            CubeDim::new_1d(256),
            partials.clone().into_tensor_arg(),
            out.clone().into_tensor_arg(),
            count,
        )
    };
    out
}

/// Which layouts of a tensor's FP8 codes one quantization pass writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Layouts {
    /// The codes of `x`, `[r, c]`.
    pub direct: bool,
    /// The codes of `xᵀ`, `[c, r]`.
    pub transposed: bool,
}

/// FP8 codes of a tensor in the layouts asked for, and their dequantization scale `[1]`.
#[derive(Clone, Debug)]
pub(crate) struct Fp8Codes {
    pub direct: Option<CubeTensor>,
    pub transposed: Option<CubeTensor>,
    pub dequant: CubeTensor,
}

/// `x` (`[r, c]`) quantized to `format` with one scale from its amax (current scaling), the
/// amax (`[1]`) passed through `reduce` first (over the ranks holding pieces of the tensor),
/// which may also give a kept amax (`[1]`, delayed scaling) to scale by where it is above zero:
/// one amax pass, then one cast writing the codes in each of `layouts` (`[r, c]`, `[c, r]`: the
/// cast and the transpose in one pass). `x` is read row-major (copied first if it is a view).
pub(crate) fn quantize_tensor(
    x: CubeTensor,
    format: Minifloat,
    layouts: Layouts,
    reduce: impl FnOnce(CubeTensor) -> (CubeTensor, Option<CubeTensor>),
) -> Fp8Codes {
    use burn::backend::Cube;
    use burn::backend::ops::FloatTensorOps;
    let x = match matches!(x.dtype, DType::BF16 | DType::F16 | DType::F32) {
        true => x,
        false => Cube::float_cast(x, burn::tensor::FloatDType::F32),
    };
    let x = compact_input(x).expect("a row-major copy");
    let dims = x.meta.shape().clone();
    let (r, c) = (dims[0], dims[1]);
    let amax = match crate::optim_kernels::partials(x.clone(), crate::optim_kernels::Reduction::MaxAbs) {
        Some(partials) => max_of_partials(partials),
        None => Cube::float_zeros(Shape::new([1]), &x.device, burn::tensor::FloatDType::F32),
    };
    let (amax, kept) = reduce(amax);
    let delayed = kept.is_some();
    // Without a kept amax the kernels never read it: the call's own stands in.
    let kept = kept.unwrap_or_else(|| amax.clone());
    let dequant = compact_output(&x, Shape::new([1]), DType::F32);
    let e5m2_codes = format == Minifloat::E5M2;
    let direct = layouts
        .direct
        .then(|| compact_output(&x, Shape::new([r, c]), DType::U8));
    if !layouts.transposed {
        let codes = direct
            .clone()
            .unwrap_or_else(|| compact_output(&x, Shape::new([r, c]), DType::U8));
        launch_float!(
            x.dtype,
            quantize_tensor_kernel,
            &x.client,
            CubeCount::Static(((r * c) as u32).div_ceil(256).max(1), 1, 1),
            CubeDim::new_1d(256),
            x.clone().into_tensor_arg(),
            amax.into_tensor_arg(),
            kept.into_tensor_arg(),
            codes.into_tensor_arg(),
            dequant.clone().into_tensor_arg(),
            (r * c) as u32,
            format.max(),
            e5m2_codes,
            delayed,
        );
        return Fp8Codes {
            direct,
            transposed: None,
            dequant,
        };
    }
    let transposed = compact_output(&x, Shape::new([c, r]), DType::U8);
    // Without `direct` the kernel never writes its direct output: a vector's bytes stand in.
    let direct_arg = direct
        .clone()
        .unwrap_or_else(|| compact_output(&x, Shape::new([CAST_VECTOR]), DType::U8));
    // One argument list for both casts; the vector kernel takes its vector size first.
    macro_rules! cast {
        ($kernel:ident, $count:expr, $dim:expr $(, $vector:expr)?) => {
            launch_float!(
                x.dtype,
                $kernel,
                &x.client,
                $count,
                $dim,
                $($vector,)?
                x.clone().into_tensor_arg(),
                amax.into_tensor_arg(),
                kept.into_tensor_arg(),
                transposed.clone().into_tensor_arg(),
                direct_arg.into_tensor_arg(),
                dequant.clone().into_tensor_arg(),
                r as u32,
                c as u32,
                format.max(),
                e5m2_codes,
                layouts.direct,
                delayed,
            )
        };
    }
    let blocks = |n: usize, tile: u32| (n as u32).div_ceil(tile).max(1);
    if r.is_multiple_of(CAST_VECTOR) && c.is_multiple_of(CAST_VECTOR) {
        let count = CubeCount::Static(blocks(c, TILE_64), blocks(r, TILE_64), 1);
        cast!(
            quantize_transposed_vectors_kernel,
            count,
            CubeDim::new_1d(256),
            CAST_VECTOR
        );
    } else {
        let count = CubeCount::Static(blocks(c, 32), blocks(r, 32), 1);
        cast!(quantize_transposed_kernel, count, CubeDim::new_2d(32, 8));
    }
    Fp8Codes {
        direct,
        transposed: Some(transposed),
        dequant,
    }
}

/// `quant::fake::hash32` (lowbias32), on the device.
#[cube]
fn hash32(x: u32) -> u32 {
    let mut x = x;
    x ^= x >> 16u32;
    x *= 0x7feb_352du32;
    x ^= x >> 15u32;
    x *= 0x846c_a68bu32;
    x ^= x >> 16u32;
    x
}

/// One uniform draw in `[0, 1)` a value: the top 24 bits of `hash32(i ^ key)`.
#[cube(launch_unchecked)]
fn draws_kernel(out: &mut Tensor<f32>, count: u32, key: u32) {
    let i = ABSOLUTE_POS as u32;
    if i < count {
        out[i as usize] = f32::cast_from(hash32(i ^ key) >> 8u32) * (1.0f32 / 16_777_216.0f32);
    }
}

/// `out` (f32, compact) filled with `quant::fake::draws`'s values for `key`, bit for bit.
pub(crate) fn fill_draws(out: CubeTensor, key: u32) -> CubeTensor {
    let count = out.meta.shape().num_elements() as u32;
    // SAFETY: one thread a value, bounds-checked against `count`.
    unsafe {
        draws_kernel::launch_unchecked(
            &out.client,
            CubeCount::Static(count.div_ceil(256).max(1), 1, 1),
            CubeDim::new_1d(256),
            out.clone().into_tensor_arg(),
            count,
            key,
        )
    };
    out
}

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
pub(crate) fn history_push(history: CubeTensor, rows: [CubeTensor; 3]) -> CubeTensor {
    let history = f32_compact(history);
    let len = history.meta.shape()[1];
    let [input, weight, output_grad] = rows.map(f32_compact);
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
pub(crate) fn history_kept(history: CubeTensor, most_recent: bool) -> CubeTensor {
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
