//! FP8 in blocks on CUDA (the blockwise recipe's quantizers, `quant::fp8`), each matching
//! `quant::scaling::quantize` with `Scaling::Blocks` bit for bit: a block's scale is
//! `amax / max` (1 for a zero or non-finite amax, or one whose scale is below f32's normal
//! range) and its values are encoded times `1 / scale`.
//!
//! - 1×128 tiles along a row: one kernel, one warp a tile (the cast and the amax in one read).
//! - 128×1 tiles down a column, written as the codes of `xᵀ` (K-major for wgrad, whose K is the
//!   tokens): the tiles' scales, then the transposing cast reading them.
//! - 128×128 blocks (a weight, the same blocks in `w` and `wᵀ`): the blocks' scales, then the
//!   transposing cast writing both layouts from one read.

use burn::tensor::{DType, Shape};
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use half::{bf16, f16};

use crate::elementwise::{compact_output, launch_float};
use crate::quant::format::Minifloat;
use crate::quant::tiles::TILE;
use crate::quant_kernels::{CastFactors, CastScales, float_input, fp8_code, transposing_cast};
use crate::row_kernels::block_max;

/// Rows (and columns) of a tile or block along which one scale is shared.
const BLOCK: u32 = TILE as u32;

/// A block's dequantization scale from its amax, as the reference derives it.
#[cube]
fn block_scale(amax: f32, max: f32) -> f32 {
    let mut scale = 1.0f32;
    if amax <= 3.4028235e38f32 && amax / max >= 1.1754944e-38f32 {
        scale = amax / max;
    }
    scale
}

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
        let scale = block_scale(plane_max(amax), max);
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
    let x = float_input(x);
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

/// One thread a 128-row tile of `N` neighbouring columns: its scales, `[⌈r/128⌉, c]` (vectors).
#[cube(launch_unchecked)]
fn row_tile_scales_kernel<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    scales: &mut Tensor<Vector<f32, N>>,
    rows: u32,
    vectors: u32,
    max: f32,
) {
    let id = ABSOLUTE_POS as u32;
    if id < rows.div_ceil(BLOCK) * vectors {
        let (tile, v) = (id / vectors, id % vectors);
        let start = tile * BLOCK;
        let end = min(start + BLOCK, rows);
        let mut amax = Vector::<f32, N>::new(0.0f32);
        for r in start..end {
            let value = Vector::<f32, N>::cast_from(x[(r * vectors + v) as usize]);
            #[unroll]
            for e in 0..value.vector_size() {
                amax.insert(e, f32::max(amax.extract(e), f32::abs(value.extract(e))));
            }
        }
        let mut out = Vector::<f32, N>::empty();
        #[unroll]
        for e in 0..out.vector_size() {
            out.insert(e, block_scale(amax.extract(e), max));
        }
        scales[id as usize] = out;
    }
}

/// One block of 256 threads a 128 × 128 block: its scale, at `[CUBE_POS_Y, CUBE_POS_X]` of
/// `[⌈r/128⌉, ⌈c/128⌉]`. Thread `t` reads column `t % 128` of every other row.
#[cube(launch_unchecked)]
fn square_scales_kernel<F: Float>(x: &Tensor<F>, scales: &mut Tensor<f32>, rows: u32, columns: u32, max: f32) {
    let c = CUBE_POS_X * BLOCK + UNIT_POS % BLOCK;
    let mut amax = 0.0f32;
    if c < columns {
        for i in 0..BLOCK / 2 {
            let r = CUBE_POS_Y * BLOCK + UNIT_POS / BLOCK + 2 * i;
            if r < rows {
                amax = f32::max(amax, f32::abs(f32::cast_from(x[(r * columns + c) as usize])));
            }
        }
    }
    let amax = block_max(amax);
    if UNIT_POS == 0 {
        scales[(CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize] = block_scale(amax, max);
    }
}

/// The codes of `xᵀ` (`[c, r]`) in 128×1 tiles down `x`'s columns (1×128 tiles along the rows
/// of `xᵀ`) and their scales as `[c, ⌈r/128⌉]` (a transposed view).
pub(crate) fn quantize_row_tiles(x: CubeTensor, format: Minifloat) -> (CubeTensor, CubeTensor) {
    use burn::backend::Cube;
    use burn::backend::ops::FloatTensorOps;
    let x = float_input(x);
    let dims = x.meta.shape().clone();
    let (r, c) = (dims[0], dims[1]);
    let scales = compact_output(&x, Shape::new([r.div_ceil(TILE), c]), DType::F32);
    let vector = if c.is_multiple_of(8) { 8 } else { 1 };
    let threads = (r.div_ceil(TILE) * c / vector) as u32;
    if threads > 0 {
        launch_float!(
            x.dtype,
            row_tile_scales_kernel,
            &x.client,
            CubeCount::Static(threads.div_ceil(256), 1, 1),
            CubeDim::new_1d(256),
            vector,
            x.clone().into_tensor_arg(),
            scales.clone().into_tensor_arg(),
            r as u32,
            (c / vector) as u32,
            format.max(),
        );
    }
    let factors = CastFactors::blocks(scales.clone(), CastScales::RowTiles);
    let (_, codes) = transposing_cast(&x, format, factors, false);
    (codes, Cube::float_transpose(scales))
}

/// FP8 codes of `x` in 128 × 128 blocks: those of `x` (`[r, c]`) with `direct`, those of `xᵀ`
/// (`[c, r]`), and the blocks' scales `[⌈r/128⌉, ⌈c/128⌉]` (`xᵀ`'s are their transpose).
pub(crate) fn quantize_squares(
    x: CubeTensor,
    format: Minifloat,
    direct: bool,
) -> (Option<CubeTensor>, CubeTensor, CubeTensor) {
    let x = float_input(x);
    let dims = x.meta.shape().clone();
    let (r, c) = (dims[0], dims[1]);
    let grid = (c.div_ceil(TILE) as u32, r.div_ceil(TILE) as u32);
    let scales = compact_output(&x, Shape::new([grid.1 as usize, grid.0 as usize]), DType::F32);
    if grid.0 * grid.1 > 0 {
        launch_float!(
            x.dtype,
            square_scales_kernel,
            &x.client,
            CubeCount::Static(grid.0, grid.1, 1),
            CubeDim::new_1d(256),
            x.clone().into_tensor_arg(),
            scales.clone().into_tensor_arg(),
            r as u32,
            c as u32,
            format.max(),
        );
    }
    let factors = CastFactors::blocks(scales.clone(), CastScales::Squares);
    let (direct, transposed) = transposing_cast(&x, format, factors, direct);
    (direct, transposed, scales)
}
