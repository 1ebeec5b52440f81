//! The FP8 wgmma GEMM with block scales (DeepSeek-V3's blockwise recipe): `C = A · Bᵀ` of FP8
//! codes, both K-major, where A carries an f32 scale for each row and 128-deep slice of K (its
//! 1×128 tiles) and B one for each 128 × 128 block ([`BScales::Squares`], a weight) or for each
//! row and slice ([`BScales::Rows`], wgrad's activations).
//!
//! A scale changes with every slice, so the slices cannot share one accumulator: each consumer
//! warpgroup multiplies a slice into a fresh `m64n128` accumulator and adds it, times the
//! slice's scales, to the tile's (the "promotion" of DeepGEMM, on every slice). Two accumulators
//! fit a thread's registers at 128 columns (64 f32 each), so a block computes 128 × 128 tiles:
//! two consumers of 64 rows, fed by the producer warpgroup through `STAGES` stages of one
//! 128-deep slice of A and of B (16 KiB each); while one consumer promotes, the other's `wgmma`
//! keeps the tensor cores busy. Every scale a slice needs is loaded before the consumer waits
//! for the slice, so its latency hides behind the wait and the product: B's 128 row scales
//! ([`BScales::Rows`]) one a thread, handed to the threads that use them through shared memory.

use burn::tensor::DType;
use burn_cubecl::cubecl::ir::{ElemType, UIntKind};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use cubecl_cpp::cuda::ptx::tensor_map_address;
use half::bf16;

use super::{
    Major, Pipeline, STAGING_BYTES, WgmmaError, fresh_slice, output, persistent_blocks, pipeline_smem, produce,
    store_map, store_tile, tile_position,
};
use crate::cuda::hopper::*;
use crate::quant::format::Minifloat;

/// Rows and columns of a block's tile of C, and the depth of a slice: the blocks' 128.
pub const BLOCK: u32 = 128;
/// Pipeline depth: 5 × 32 KiB of the 227 KiB a block may use.
const STAGES: u32 = 5;
/// A slice of A (or B): 128 rows of 128 codes.
const OPERAND_BYTES: u32 = BLOCK * BLOCK;
const STAGE_BYTES: u32 = 2 * OPERAND_BYTES;
/// Tiles, the two consumers' staging, the barriers, and 1 KiB to align the tiles.
const SMEM_BYTES: u32 = STAGES * STAGE_BYTES + 2 * STAGING_BYTES + 1024 + 1024;

/// What the producer loads: 128 × 128 tiles of C, 128-deep slices of both K-major operands.
const PIPELINE: Pipeline = Pipeline {
    block_m: BLOCK,
    block_n: BLOCK,
    depth: BLOCK,
    stages: STAGES,
    a_bytes: OPERAND_BYTES,
    stage_bytes: STAGE_BYTES,
    a_major: Major::K,
    b_major: Major::K,
    split_b: false,
};

/// How B's codes are scaled.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BScales {
    /// One scale a 128 × 128 block: `[⌈n / 128⌉, ⌈k / 128⌉]`.
    Squares,
    /// One scale a row and 128-deep slice: `[n, ⌈k / 128⌉]`.
    Rows,
}

/// The scale at `(row, slice)` of a scale tensor with these strides (a transposed view reads
/// in place).
#[cube]
fn scale_at(scales: &Tensor<f32>, row: u32, slice: u32, row_stride: u32, slice_stride: u32) -> f32 {
    scales[(row * row_stride + slice * slice_stride) as usize]
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn blockwise_kernel(
    a: &TensorMap<u8, Tiled>,
    b: &TensorMap<u8, Tiled>,
    c: &mut TensorMap<bf16, Tiled>,
    scale_a: &Tensor<f32>,
    scale_b: &Tensor<f32>,
    m: u32,
    n: u32,
    k: u32,
    a_row_stride: u32,
    a_slice_stride: u32,
    b_row_stride: u32,
    b_slice_stride: u32,
    #[comptime] operands: Operands,
    #[comptime] b_scales: BScales,
) {
    let (tiles, staging, full, empty) = pipeline_smem(SMEM_BYTES, STAGES, STAGE_BYTES, 2 * STAGING_BYTES);

    let k_tiles = k.div_ceil(BLOCK);
    let (rows, columns) = (m.div_ceil(BLOCK), n.div_ceil(BLOCK));
    let mine = (rows * columns - CUBE_POS_X).div_ceil(CUBE_COUNT_X);
    let warpgroup = UNIT_POS / 128;

    if warpgroup == 0 {
        if UNIT_POS == 0 {
            let b = tensor_map_address(b);
            let maps = (tensor_map_address(a), b, b);
            produce(maps, tiles, full, empty, mine, k_tiles, (rows, columns), PIPELINE);
        }
    } else {
        let consumer = warpgroup - 1;
        let buffer = staging + consumer * STAGING_BYTES;
        let storer = UNIT_POS.is_multiple_of(128);
        let map_c = store_map_address(c);
        let (lane, warp) = (UNIT_POS % 32, (UNIT_POS % 128) / 32);
        // Rows: each warpgroup's B scales of a slice, two slices' buffers of 128 by turns.
        let mut row_scales = Shared::<[f32]>::new_slice(512usize);
        for i in 0..mine {
            let (row, column) = tile_position(CUBE_POS_X + i * CUBE_COUNT_X, rows, columns);
            // This thread's two rows of the tile (`hopper`'s accumulator layout), clamped into
            // A: rows past m are zeros, whatever scale they take.
            let upper = row * BLOCK + consumer * 64 + warp * 16 + lane / 4;
            let lower = upper + 8;
            let (upper, lower) = (select(upper < m, upper, m - 1), select(lower < m, lower, m - 1));
            let mut acc = Acc128::zeroed();
            for kt in 0..k_tiles {
                let slice = i * k_tiles + kt;
                let stage = slice % STAGES;
                // Loaded before the wait, so their latency hides behind it and the product.
                let scale_upper = scale_at(scale_a, upper, kt, a_row_stride, a_slice_stride);
                let scale_lower = scale_at(scale_a, lower, kt, a_row_stride, a_slice_stride);
                // Squares: the tile's one block of B. Rows: this thread's row of B, clamped.
                let b_row = match comptime!(b_scales) {
                    BScales::Squares => column,
                    BScales::Rows => {
                        let r = column * BLOCK + UNIT_POS % 128;
                        select(r < n, r, n - 1)
                    }
                };
                let b_scale = scale_at(scale_b, b_row, kt, b_row_stride, b_slice_stride);
                mbarrier_wait(full + stage * 8, (slice / STAGES) & 1);
                let tile = tiles + stage * STAGE_BYTES;
                // This warpgroup's 64 rows of A start 8 KiB into the stage.
                let desc_a = descriptor(tile + consumer * 8192, comptime!(Tile::KMajor { rows: BLOCK }));
                let desc_b = descriptor(tile + OPERAND_BYTES, comptime!(Tile::KMajor { rows: BLOCK }));
                let part = chain_128_fresh(desc_a, desc_b, comptime!(fresh_slice(operands)));
                if UNIT_POS.is_multiple_of(32) {
                    mbarrier_arrive(empty + stage * 8);
                }
                match comptime!(b_scales) {
                    BScales::Squares => {
                        let (upper_factor, lower_factor) = (scale_upper * b_scale, scale_lower * b_scale);
                        #[unroll]
                        for r in 0..64u32 {
                            let factor = if comptime!(r % 4 < 2) {
                                upper_factor
                            } else {
                                lower_factor
                            };
                            acc.insert(r as usize, acc.extract(r as usize) + part.extract(r as usize) * factor);
                        }
                    }
                    BScales::Rows => {
                        // Slices take the two buffers by turns: the one written two slices ago
                        // has been read, as every thread of the warpgroup passed the barrier of
                        // the slice between.
                        let base = consumer * 256 + (slice % 2) * 128;
                        row_scales[(base + UNIT_POS % 128) as usize] = b_scale;
                        named_barrier(1 + consumer, 128u32);
                        // Registers `4j + e` (upper row) and `4j + 2 + e` (lower) hold column
                        // `8j + 2 · (lane % 4) + e`.
                        #[unroll]
                        for j in 0..16u32 {
                            #[unroll]
                            for e in 0..2u32 {
                                let scale = row_scales[(base + 8 * j + 2 * (lane % 4) + e) as usize];
                                let (u, l) = ((4 * j + e) as usize, (4 * j + 2 + e) as usize);
                                acc.insert(u, acc.extract(u) + part.extract(u) * (scale_upper * scale));
                                acc.insert(l, acc.extract(l) + part.extract(l) * (scale_lower * scale));
                            }
                        }
                    }
                }
            }
            store_tile(
                &acc,
                1.0f32,
                buffer,
                map_c,
                row * BLOCK + consumer * 64,
                column * BLOCK,
                1 + consumer,
                storer,
                1u32,
            );
        }
        if storer {
            bulk_wait();
        }
    }
}

/// `A · Bᵀ` of FP8 codes with block scales, in bf16: `a` holds `[m, k]` codes of `formats.0`
/// with `a_scales` `[m, ⌈k / 128⌉]` (each row's 1×128 tiles), `b` `[n, k]` codes of `formats.1`
/// with `b_scales` as `b_blocks` says; codes as u8, scales f32 dequantization factors (a value is
/// its code's value times its block's scale), either possibly a transposed view.
///
/// # Shapes
/// `[m, k]`, `[m, ⌈k/128⌉]`, `[n, k]`, `[⌈n/128⌉ or n, ⌈k/128⌉]` → `[m, n]`
pub fn fp8_blockwise_gemm(
    (a, a_scales): (CubeTensor, CubeTensor),
    (b, b_scales): (CubeTensor, CubeTensor),
    b_blocks: BScales,
    formats: (Minifloat, Minifloat),
) -> Result<CubeTensor, WgmmaError> {
    let fp8 = |f: Minifloat| matches!(f, Minifloat::E4M3 | Minifloat::E5M2);
    if a.dtype != DType::U8 || b.dtype != DType::U8 || !fp8(formats.0) || !fp8(formats.1) {
        return Err(WgmmaError::DType(a.dtype, b.dtype));
    }
    let (m, k) = (a.meta.shape()[0], a.meta.shape()[1]);
    let n = b.meta.shape()[0];
    if k % 16 != 0 || b.meta.shape()[1] != k {
        return Err(WgmmaError::Unaligned { k });
    }
    let slices = k.div_ceil(BLOCK as usize);
    let b_rows = match b_blocks {
        BScales::Squares => n.div_ceil(BLOCK as usize),
        BScales::Rows => n,
    };
    for (scales, expected) in [(&a_scales, [m, slices]), (&b_scales, [b_rows, slices])] {
        if scales.dtype != DType::F32 || scales.meta.shape().to_vec() != expected {
            return Err(WgmmaError::Scales {
                expected,
                found: scales.meta.shape().to_vec(),
            });
        }
    }
    let strides = |t: &CubeTensor| (t.meta.strides()[0] as u32, t.meta.strides()[1] as u32);
    let (a_strides, b_strides) = (strides(&a_scales), strides(&b_scales));
    let (a, b) = (into_contiguous(a), into_contiguous(b));
    let out = output(&a, m, n);
    let client = out.client.clone();
    let map = |t: CubeTensor| {
        let tile_size = cubecl::zspace::shape![BLOCK as usize, BLOCK as usize];
        TensorMapArg::new(
            TiledArgs { tile_size },
            t.into_tensor_arg(),
            ElemType::UInt(UIntKind::U8),
        )
        .with_swizzle(TensorMapSwizzle::B128)
    };
    let tiles = (m as u32).div_ceil(BLOCK) * (n as u32).div_ceil(BLOCK);
    let blocks = persistent_blocks(&client, tiles);
    // SAFETY: the maps cover exactly the operands and the output (TMA fills out-of-range boxes
    // with zeros when loading and drops their out-of-range parts when storing); every scale read
    // is clamped into the shapes checked above and indexed by their own strides.
    unsafe {
        blockwise_kernel::launch_unchecked(
            &client,
            CubeCount::Static(blocks, 1, 1),
            CubeDim::new_1d(384),
            map(a),
            map(b),
            store_map(&out),
            a_scales.into_tensor_arg(),
            b_scales.into_tensor_arg(),
            m as u32,
            n as u32,
            k as u32,
            a_strides.0,
            a_strides.1,
            b_strides.0,
            b_strides.1,
            Operands::Fp8(formats.0, formats.1),
            b_blocks,
        )
    };
    Ok(out)
}
