//! The quantization CUDA kernels (`crate::quant`): FP8 with one scale a tensor from its amax
//! (`crate::cuda::reduce`), cast and optionally transposed in one pass (the cast also takes block
//! scales: `super::blocks`); the uniform draws of stochastic rounding.

use burn::tensor::{DType, Shape};
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use cubecl::{e4m3, e5m2};
use half::{bf16, f16};

use crate::cuda::launch::{compact_output, float_input, launch_float};
use crate::cuda::reduce::tensor_amax;
use crate::quant::format::Minifloat;
use crate::quant::notes::AmaxNotes;

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
pub(crate) fn fp8_code(value: f32, #[comptime] e5m2_codes: bool) -> u8 {
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

/// Where the transposing casts take each value's factor from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum CastScales {
    /// One factor from the tensor's amax (or the kept one), its inverse written to `dequant`.
    Tensor,
    /// `1 / scale` of the value's 128 × 128 block, `scales` `[⌈r/128⌉, ⌈c/128⌉]`.
    Squares,
    /// `1 / scale` of the value's 128 × 1 tile (128 rows of a column), `scales` `[⌈r/128⌉, c]`.
    RowTiles,
}

/// The factor value `(r, c)` of a `columns`-wide tensor is multiplied by before encoding.
#[cube]
fn cast_factor(
    tensor_factor: f32,
    scales: &Tensor<f32>,
    r: u32,
    c: u32,
    columns: u32,
    #[comptime] blocks: CastScales,
) -> f32 {
    match comptime!(blocks) {
        CastScales::Tensor => tensor_factor,
        CastScales::Squares => 1.0f32 / scales[((r / 128u32) * columns.div_ceil(128u32) + c / 128u32) as usize],
        CastScales::RowTiles => 1.0f32 / scales[((r / 128u32) * columns + c) as usize],
    }
}

/// The tensor's factor under [`CastScales::Tensor`] (1 otherwise, unread).
#[cube]
fn tensor_factor(
    amax: &Tensor<f32>,
    kept: &Tensor<f32>,
    max: f32,
    #[comptime] delayed: bool,
    #[comptime] blocks: CastScales,
) -> f32 {
    let mut factor = 1.0f32;
    if comptime!(blocks == CastScales::Tensor) {
        factor = fp8_factor(scaling_amax(amax, kept, delayed), max);
    }
    factor
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
    scales: &Tensor<f32>,
    rows: u32,
    columns: u32,
    max: f32,
    #[comptime] e5m2_codes: bool,
    #[comptime] direct: bool,
    #[comptime] delayed: bool,
    #[comptime] blocks: CastScales,
) {
    // 33 words a row: the column reads of the second half fall in 32 different banks.
    let mut tile = Shared::<[u32]>::new_slice(1056usize);
    let factor = tensor_factor(amax, kept, max, delayed, blocks);
    let (r0, c0) = (CUBE_POS_Y * 32u32, CUBE_POS_X * 32u32);
    let (tx, ty) = (UNIT_POS_X, UNIT_POS_Y);
    #[unroll]
    for j in 0..4u32 {
        let (r, c) = (r0 + ty + 8u32 * j, c0 + tx);
        if r < rows && c < columns {
            let at = r * columns + c;
            let factor = cast_factor(factor, scales, r, c, columns, blocks);
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
    if comptime!(blocks == CastScales::Tensor) && CUBE_POS_X == 0 && CUBE_POS_Y == 0 && UNIT_POS == 0 {
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
    scales: &Tensor<f32>,
    rows: u32,
    columns: u32,
    max: f32,
    #[comptime] e5m2_codes: bool,
    #[comptime] direct: bool,
    #[comptime] delayed: bool,
    #[comptime] blocks: CastScales,
) {
    // 65 words a row: a column's reads fall in different banks (two threads a bank at most).
    let mut tile = Shared::<[u32]>::new_slice(4160usize);
    let factor = tensor_factor(amax, kept, max, delayed, blocks);
    let (r0, c0) = (CUBE_POS_Y * TILE_64, CUBE_POS_X * TILE_64);
    let (lane_row, lane_vector) = (UNIT_POS / 8u32, UNIT_POS % 8u32);
    let vector = CAST_VECTOR as u32;
    #[unroll]
    for j in 0..2u32 {
        let row = lane_row + 32u32 * j;
        let (r, c) = (r0 + row, c0 + lane_vector * vector);
        if r < rows && c < columns {
            let at = ((r * columns + c) / vector) as usize;
            let values = Vector::<f32, N>::cast_from(x[at]);
            let mut packed = Vector::<u8, N>::empty();
            #[unroll]
            for e in 0..values.vector_size() {
                let factor = cast_factor(factor, scales, r, c + e as u32, columns, blocks);
                let code = fp8_code(values.extract(e) * factor, e5m2_codes);
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
    if comptime!(blocks == CastScales::Tensor) && CUBE_POS_X == 0 && CUBE_POS_Y == 0 && UNIT_POS == 0 {
        dequant[0] = 1.0f32 / factor;
    }
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

/// `x` (`[r, c]`) quantized to `format` with one scale from its amax (current scaling: the one
/// the kernel that wrote `x` noted in `notes`, else one pass of its own), the
/// amax (`[1]`) passed through `reduce` first (over the ranks holding pieces of the tensor),
/// which may also give a kept amax (`[1]`, delayed scaling) to scale by where it is above zero:
/// one amax pass, then one cast writing the codes in each of `layouts` (`[r, c]`, `[c, r]`: the
/// cast and the transpose in one pass). `x` is read row-major (copied first if it is a view).
pub(crate) fn quantize_tensor(
    x: CubeTensor,
    format: Minifloat,
    layouts: Layouts,
    notes: Option<&AmaxNotes>,
    reduce: impl FnOnce(CubeTensor) -> (CubeTensor, Option<CubeTensor>),
) -> Fp8Codes {
    let x = float_input(x);
    let dims = x.meta.shape().clone();
    let (r, c) = (dims[0], dims[1]);
    // The amax the kernel that wrote `x` took, where it was asked to (SwiGLU, RMSNorm, RoPE).
    let noted = notes.and_then(|notes| notes.take_primitive(&x));
    let local = noted.unwrap_or_else(|| tensor_amax(x.clone()));
    let (amax, kept) = reduce(local);
    let delayed = kept.is_some();
    // Without a kept amax the kernels never read it: the call's own stands in.
    let kept = kept.unwrap_or_else(|| amax.clone());
    let dequant = compact_output(&x, Shape::new([1]), DType::F32);
    if !layouts.transposed {
        let direct = compact_output(&x, Shape::new([r, c]), DType::U8);
        launch_float!(
            x.dtype,
            quantize_tensor_kernel,
            &x.client,
            CubeCount::Static(((r * c) as u32).div_ceil(256).max(1), 1, 1),
            CubeDim::new_1d(256),
            x.clone().into_tensor_arg(),
            amax.into_tensor_arg(),
            kept.into_tensor_arg(),
            direct.clone().into_tensor_arg(),
            dequant.clone().into_tensor_arg(),
            (r * c) as u32,
            format.max(),
            format == Minifloat::E5M2,
            delayed,
        );
        return Fp8Codes {
            direct: layouts.direct.then_some(direct),
            transposed: None,
            dequant,
        };
    }
    let factors = CastFactors {
        scales: amax.clone(),
        amax,
        kept,
        dequant: dequant.clone(),
        delayed,
        blocks: CastScales::Tensor,
    };
    let (direct, transposed) = transposing_cast(&x, format, factors, layouts.direct);
    Fp8Codes {
        direct,
        transposed: Some(transposed),
        dequant,
    }
}

/// What the transposing cast scales by: the tensor's amax (and kept amax), writing `dequant`,
/// or block `scales` ([`CastScales`]); the kernel reads only what `blocks` names.
pub(crate) struct CastFactors {
    pub amax: CubeTensor,
    pub kept: CubeTensor,
    pub dequant: CubeTensor,
    pub scales: CubeTensor,
    pub delayed: bool,
    pub blocks: CastScales,
}

impl CastFactors {
    /// Block scales (`[⌈r/128⌉, ⌈c/128⌉]` or `[⌈r/128⌉, c]`, as `blocks` says); one f32 stands
    /// in for the tensor's amax, kept amax and dequantization scale, which the cast never touches.
    pub(crate) fn blocks(scales: CubeTensor, blocks: CastScales) -> Self {
        let unused = compact_output(&scales, Shape::new([1]), DType::F32);
        Self {
            amax: unused.clone(),
            kept: unused.clone(),
            dequant: unused,
            scales,
            delayed: false,
            blocks,
        }
    }
}

/// The codes of `xᵀ` (`[c, r]`) and, with `direct`, of `x` (`[r, c]`), from one read of the
/// compact `x`: tiles of 64 × 64 in vectors of 8 where both sides allow, else 32 × 32.
pub(crate) fn transposing_cast(
    x: &CubeTensor,
    format: Minifloat,
    factors: CastFactors,
    direct: bool,
) -> (Option<CubeTensor>, CubeTensor) {
    let dims = x.meta.shape().clone();
    let (r, c) = (dims[0], dims[1]);
    let transposed = compact_output(x, Shape::new([c, r]), DType::U8);
    let direct_codes = direct.then(|| compact_output(x, Shape::new([r, c]), DType::U8));
    // Without `direct` the kernel never writes its direct output: a vector's bytes stand in.
    let direct_arg = direct_codes
        .clone()
        .unwrap_or_else(|| compact_output(x, Shape::new([CAST_VECTOR]), DType::U8));
    let e5m2_codes = format == Minifloat::E5M2;
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
                factors.amax.into_tensor_arg(),
                factors.kept.into_tensor_arg(),
                transposed.clone().into_tensor_arg(),
                direct_arg.into_tensor_arg(),
                factors.dequant.into_tensor_arg(),
                factors.scales.into_tensor_arg(),
                r as u32,
                c as u32,
                format.max(),
                e5m2_codes,
                direct,
                factors.delayed,
                factors.blocks,
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
    (direct_codes, transposed)
}

/// `quant::fake::hash32` (lowbias32), on the device.
#[cube]
pub(crate) fn hash32(x: u32) -> u32 {
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
