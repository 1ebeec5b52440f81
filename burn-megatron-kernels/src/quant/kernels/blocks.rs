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
//! - Both kinds of tiles of one tensor (`x` for forward and wgrad, `dy` for dgrad and wgrad),
//!   where both sides are multiples of 8: one kernel, one read, a block a 128 × 128 region.

use burn::tensor::{DType, Shape};
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use half::{bf16, f16};

use crate::cuda::launch::float_input;
use crate::cuda::launch::{compact_output, launch_float};
use crate::cuda::reduce::block_max;
use crate::quant::format::Minifloat;
use crate::quant::kernels::cast::{CastFactors, CastScales, fp8_code, transposing_cast};
use crate::quant::scaling::TILE;

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

/// Values a thread of [`tiles_both_kernel`] reads, and codes it writes, at once.
const VECTOR: usize = 8;

/// One block of 256 threads a 128 × 128 region of `x`, read once: the codes of `x` in 1×128
/// tiles along its rows (`codes`, `row_scales` `[r, ⌈c/128⌉]`) and of `xᵀ` in 128×1 tiles down
/// `x`'s columns (`transposed` `[c, r]`, `column_scales` `[⌈r/128⌉, c]`). Thread `t` holds an
/// 8 × 8 square, rows `8·(t / 16)..` and columns `8·(t % 16)..` of the region, read as vectors
/// of 8 along the rows: a row's amax is the max over the 16 neighbouring lanes that share it, a
/// column's over the 16 squares down the region through shared memory. Each row's 8 codes go
/// to `codes` as a vector. Each column's 8 codes (a chunk of 8 bytes of a row of `xᵀ`) go into
/// a shared tile of `xᵀ`'s 128 rows, at chunk `g ^ v` of the row (`g`, `v` the square's row and
/// column of squares), so the 32 lanes of a store hit 32 banks; each warp then writes two whole
/// rows of it, 8 bytes a lane.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn tiles_both_kernel<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    codes: &mut Tensor<Vector<u8, N>>,
    row_scales: &mut Tensor<f32>,
    transposed: &mut Tensor<Vector<u8, N>>,
    column_scales: &mut Tensor<f32>,
    rows: u32,
    columns: u32,
    max: f32,
    #[comptime] e5m2_codes: bool,
) {
    let mut partial = Shared::<[f32]>::new_slice(2048usize);
    let mut column_factor = Shared::<[f32]>::new_slice(128usize);
    // `xᵀ`'s 128 rows of 128 codes, 32 words each.
    let mut tile = Shared::<[u32]>::new_slice(4096usize);
    let (r0, c0) = (CUBE_POS_Y * BLOCK, CUBE_POS_X * BLOCK);
    let (v, g) = (UNIT_POS % 16, UNIT_POS / 16);
    let (r, c) = (r0 + g * 8, c0 + v * 8);
    // Both sides are multiples of 8: a thread's square lies wholly inside `x` or outside.
    let inside = r < rows && c < columns;
    // Value (r + j, c + e) at 8·j + e.
    let mut held = Vector::<f32, Const<64>>::empty();
    let mut row_factors = Vector::<f32, Const<8>>::empty();
    let mut column_amax = Vector::<f32, N>::new(0.0f32);
    #[unroll]
    for j in 0..8u32 {
        let mut value = Vector::<f32, N>::new(0.0f32);
        if inside {
            value = Vector::<f32, N>::cast_from(x[(((r + j) * columns + c) / 8) as usize]);
        }
        let mut amax = 0.0f32;
        #[unroll]
        for e in 0..8u32 {
            let a = f32::abs(value.extract(e as usize));
            held.insert((8 * j + e) as usize, value.extract(e as usize));
            amax = f32::max(amax, a);
            column_amax.insert(e as usize, f32::max(column_amax.extract(e as usize), a));
        }
        // The row's 16 threads are neighbouring lanes (a warp holds two rows of squares).
        amax = f32::max(amax, plane_shuffle_xor(amax, 1u32));
        amax = f32::max(amax, plane_shuffle_xor(amax, 2u32));
        amax = f32::max(amax, plane_shuffle_xor(amax, 4u32));
        amax = f32::max(amax, plane_shuffle_xor(amax, 8u32));
        let scale = block_scale(amax, max);
        row_factors.insert(j as usize, 1.0f32 / scale);
        if v == 0 && inside {
            row_scales[((r + j) * columns.div_ceil(BLOCK) + CUBE_POS_X) as usize] = scale;
        }
    }
    #[unroll]
    for e in 0..8u32 {
        partial[(g * BLOCK + v * 8 + e) as usize] = column_amax.extract(e as usize);
    }
    sync_cube();
    if UNIT_POS < BLOCK {
        let mut amax = 0.0f32;
        for group in 0..16u32 {
            amax = f32::max(amax, partial[(group * BLOCK + UNIT_POS) as usize]);
        }
        let scale = block_scale(amax, max);
        column_factor[UNIT_POS as usize] = 1.0f32 / scale;
        if c0 + UNIT_POS < columns {
            column_scales[(CUBE_POS_Y * columns + c0 + UNIT_POS) as usize] = scale;
        }
    }
    sync_cube();
    if inside {
        #[unroll]
        for j in 0..8u32 {
            let mut packed = Vector::<u8, N>::empty();
            #[unroll]
            for e in 0..8u32 {
                let value = held.extract((8 * j + e) as usize) * row_factors.extract(j as usize);
                packed.insert(e as usize, fp8_code(value, e5m2_codes));
            }
            codes[(((r + j) * columns + c) / 8) as usize] = packed;
        }
    }
    // Column e's codes, rows j = 0..8 of the square: two words, rows 0..4 and 4..8, low byte
    // first. Lanes of an even square row store their first word first, of an odd one their
    // second: the two half-warps take even and odd banks.
    #[unroll]
    for e in 0..8u32 {
        let factor = column_factor[(v * 8 + e) as usize];
        let mut low = 0u32;
        let mut high = 0u32;
        #[unroll]
        for j in 0..8u32 {
            let code = u32::cast_from(fp8_code(held.extract((8 * j + e) as usize) * factor, e5m2_codes));
            if comptime!(j < 4) {
                low |= code << (8 * j);
            } else {
                high |= code << (8 * (j - 4));
            }
        }
        let chunk = (v * 8 + e) * 32 + 2 * (g ^ v);
        let first = g & 1;
        tile[(chunk + first) as usize] = select(first == 0, low, high);
        tile[(chunk + 1 - first) as usize] = select(first == 0, high, low);
    }
    sync_cube();
    // Warp w writes rows 16·p + 2·w and the next of `xᵀ`, 8 bytes a lane: physical chunk
    // `lane % 16`, holding rows `8·(chunk ^ (row / 8))..` of `x`.
    #[unroll]
    for p in 0..8u32 {
        let row = 16 * p + 2 * (UNIT_POS / 32) + (UNIT_POS % 32) / 16;
        let chunk = UNIT_POS % 16;
        let first = row & 1;
        let a = tile[(row * 32 + 2 * chunk + first) as usize];
        let b = tile[(row * 32 + 2 * chunk + 1 - first) as usize];
        let low = select(first == 0, a, b);
        let high = select(first == 0, b, a);
        let x_row = r0 + 8 * (chunk ^ (row / 8));
        if c0 + row < columns && x_row < rows {
            let mut packed = Vector::<u8, N>::empty();
            #[unroll]
            for i in 0..4u32 {
                packed.insert(i as usize, u8::cast_from((low >> (8 * i)) & 0xffu32));
                packed.insert((i + 4) as usize, u8::cast_from((high >> (8 * i)) & 0xffu32));
            }
            transposed[(((c0 + row) * rows + x_row) / 8) as usize] = packed;
        }
    }
}

/// Both kinds of tiles of `x` (`[r, c]`) from one read ([`tiles_both_kernel`]), where `r` and
/// `c` are multiples of 8: the codes of `x` in 1×128 tiles and their scales `[r, ⌈c/128⌉]`, and
/// those of `xᵀ` (`[c, r]`) in 128×1 tiles of `x` with their scales as `[c, ⌈r/128⌉]` (a
/// transposed view). `None` for other shapes.
pub(crate) type TilePair = ((CubeTensor, CubeTensor), (CubeTensor, CubeTensor));
pub(crate) fn quantize_tiles_both(x: CubeTensor, format: Minifloat) -> Option<TilePair> {
    use burn::backend::Cube;
    use burn::backend::ops::FloatTensorOps;
    let dims = x.meta.shape().clone();
    let (r, c) = (dims[0], dims[1]);
    if !(r.is_multiple_of(VECTOR) && c.is_multiple_of(VECTOR)) || r == 0 || c == 0 {
        return None;
    }
    let x = float_input(x);
    let codes = compact_output(&x, Shape::new([r, c]), DType::U8);
    let row_scales = compact_output(&x, Shape::new([r, c.div_ceil(TILE)]), DType::F32);
    let transposed = compact_output(&x, Shape::new([c, r]), DType::U8);
    let column_scales = compact_output(&x, Shape::new([r.div_ceil(TILE), c]), DType::F32);
    launch_float!(
        x.dtype,
        tiles_both_kernel,
        &x.client,
        CubeCount::Static(c.div_ceil(TILE) as u32, r.div_ceil(TILE) as u32, 1),
        CubeDim::new_1d(256),
        VECTOR,
        x.clone().into_tensor_arg(),
        codes.clone().into_tensor_arg(),
        row_scales.clone().into_tensor_arg(),
        transposed.clone().into_tensor_arg(),
        column_scales.clone().into_tensor_arg(),
        r as u32,
        c as u32,
        format.max(),
        format == Minifloat::E5M2,
    );
    Some(((codes, row_scales), (transposed, Cube::float_transpose(column_scales))))
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
