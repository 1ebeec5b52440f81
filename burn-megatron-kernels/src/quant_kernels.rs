//! The quantization CUDA kernels (`crate::quant`): FP8 in 1×128 tiles, one warp a tile; FP8 with
//! one scale a tensor from its amax (`partials_kernel`), cast and optionally transposed in one pass.

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
        // As the reference: amax / max, 1 for a zero or non-finite amax; values times 1 / scale.
        let mut scale = 1.0f32;
        if amax > 0.0f32 && amax <= 3.4028235e38f32 {
            scale = amax / max;
        }
        let factor = 1.0f32 / scale;
        #[unroll]
        for j in 0..4u32 {
            let col = first + UNIT_POS_X + 32u32 * j;
            if col < columns {
                let at = (row * columns + col) as usize;
                let value = f32::cast_from(x[at]) * factor;
                if comptime!(e5m2_codes) {
                    codes[at] = u8::reinterpret(e5m2::cast_from(value));
                } else {
                    codes[at] = u8::reinterpret(e4m3::cast_from(value));
                }
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

/// One thread a value: `x · factor` encoded, `factor = max / amax[0]` (1 for a zero or
/// non-finite amax, as [`crate::quant::scaling::quantize_scale`]), written at `[row, col]` of
/// the codes, or at `[col, row]` when `transposed`; thread 0 writes `1 / factor` to
/// `dequant[0]`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn quantize_tensor_kernel<F: Float>(
    x: &Tensor<F>,
    amax: &Tensor<f32>,
    codes: &mut Tensor<u8>,
    dequant: &mut Tensor<f32>,
    rows: u32,
    columns: u32,
    max: f32,
    #[comptime] transposed: bool,
    #[comptime] e5m2_codes: bool,
) {
    let i = ABSOLUTE_POS as u32;
    let a = amax[0];
    let mut factor = 1.0f32;
    if a > 0.0f32 && a <= 3.4028235e38f32 {
        factor = max / a;
    }
    if i < rows * columns {
        let value = f32::cast_from(x[i as usize]) * factor;
        let mut at = i;
        if comptime!(transposed) {
            at = (i % columns) * rows + i / columns;
        }
        if comptime!(e5m2_codes) {
            codes[at as usize] = u8::reinterpret(e5m2::cast_from(value));
        } else {
            codes[at as usize] = u8::reinterpret(e4m3::cast_from(value));
        }
    }
    if i == 0 {
        dequant[0] = 1.0f32 / factor;
    }
}

/// `x` (`[r, c]`) quantized to `format` with one scale from its amax (current scaling): codes
/// `[r, c]`, or `[c, r]` when `transposed` (the cast and the transpose in one pass), and the
/// dequantization scale `[1]`. `x` is read row-major (copied first if it is a view).
pub(crate) fn quantize_tensor(x: CubeTensor, format: Minifloat, transposed: bool) -> (CubeTensor, CubeTensor) {
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
    let shape = if transposed { [c, r] } else { [r, c] };
    let codes = compact_output(&x, Shape::new(shape), DType::U8);
    let dequant = compact_output(&x, Shape::new([1]), DType::F32);
    let count = ((r * c) as u32).div_ceil(256).max(1);
    launch_float!(
        x.dtype,
        quantize_tensor_kernel,
        &x.client,
        CubeCount::Static(count, 1, 1),
        CubeDim::new_1d(256),
        x.clone().into_tensor_arg(),
        amax.into_tensor_arg(),
        codes.clone().into_tensor_arg(),
        dequant.clone().into_tensor_arg(),
        r as u32,
        c as u32,
        format.max(),
        transposed,
        format == Minifloat::E5M2,
    );
    (codes, dequant)
}
