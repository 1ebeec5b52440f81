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
    codes: &mut Tensor<u8>,
    dequant: &mut Tensor<f32>,
    count: u32,
    max: f32,
    #[comptime] e5m2_codes: bool,
) {
    let i = ABSOLUTE_POS as u32;
    let factor = fp8_factor(amax[0], max);
    if i < count {
        codes[i as usize] = fp8_code(f32::cast_from(x[i as usize]) * factor, e5m2_codes);
    }
    if i == 0 {
        dequant[0] = 1.0f32 / factor;
    }
}

/// The transposing cast: a 32 × 8 block a 32 × 32 tile, read along `x`'s rows and written
/// along the codes' rows (`[c, r]`) through shared memory, so both sides are coalesced.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn quantize_transposed_kernel<F: Float>(
    x: &Tensor<F>,
    amax: &Tensor<f32>,
    codes: &mut Tensor<u8>,
    dequant: &mut Tensor<f32>,
    rows: u32,
    columns: u32,
    max: f32,
    #[comptime] e5m2_codes: bool,
) {
    // 33 words a row: the column reads of the second half fall in 32 different banks.
    let mut tile = Shared::<[u32]>::new_slice(1056usize);
    let factor = fp8_factor(amax[0], max);
    let (r0, c0) = (CUBE_POS_Y * 32u32, CUBE_POS_X * 32u32);
    let (tx, ty) = (UNIT_POS_X, UNIT_POS_Y);
    #[unroll]
    for j in 0..4u32 {
        let (r, c) = (r0 + ty + 8u32 * j, c0 + tx);
        if r < rows && c < columns {
            let code = fp8_code(f32::cast_from(x[(r * columns + c) as usize]) * factor, e5m2_codes);
            tile[((ty + 8u32 * j) * 33u32 + tx) as usize] = u32::cast_from(code);
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

/// `x` (`[r, c]`) quantized to `format` with one scale from its amax (current scaling), the
/// amax (`[1]`) passed through `reduce` first (over the ranks holding pieces of the tensor):
/// codes `[r, c]`, or `[c, r]` when `transposed` (the cast and the transpose in one pass), and
/// the dequantization scale `[1]`. `x` is read row-major (copied first if it is a view).
pub(crate) fn quantize_tensor(
    x: CubeTensor,
    format: Minifloat,
    transposed: bool,
    reduce: impl FnOnce(CubeTensor) -> CubeTensor,
) -> (CubeTensor, CubeTensor) {
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
        Some(partials) => Cube::float_max(partials),
        None => Cube::float_zeros(Shape::new([1]), &x.device, burn::tensor::FloatDType::F32),
    };
    let amax = reduce(amax);
    let shape = if transposed { [c, r] } else { [r, c] };
    let codes = compact_output(&x, Shape::new(shape), DType::U8);
    let dequant = compact_output(&x, Shape::new([1]), DType::F32);
    let e5m2_codes = format == Minifloat::E5M2;
    match transposed {
        false => launch_float!(
            x.dtype,
            quantize_tensor_kernel,
            &x.client,
            CubeCount::Static(((r * c) as u32).div_ceil(256).max(1), 1, 1),
            CubeDim::new_1d(256),
            x.clone().into_tensor_arg(),
            amax.into_tensor_arg(),
            codes.clone().into_tensor_arg(),
            dequant.clone().into_tensor_arg(),
            (r * c) as u32,
            format.max(),
            e5m2_codes,
        ),
        true => launch_float!(
            x.dtype,
            quantize_transposed_kernel,
            &x.client,
            CubeCount::Static((c as u32).div_ceil(32).max(1), (r as u32).div_ceil(32).max(1), 1),
            CubeDim::new_2d(32, 8),
            x.clone().into_tensor_arg(),
            amax.into_tensor_arg(),
            codes.clone().into_tensor_arg(),
            dequant.clone().into_tensor_arg(),
            r as u32,
            c as u32,
            format.max(),
            e5m2_codes,
        ),
    }
    (codes, dequant)
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
