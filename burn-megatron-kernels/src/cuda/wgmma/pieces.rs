//! The pieces the wgmma GEMM kernels share (`gemm_kernel`, the blockwise FP8 GEMM, the grouped
//! GEMM): the tile order, the producer's TMA loads through the stages, the shared-memory layout
//! with its barriers, and the consumers' stores through TMA.

use cubecl::prelude::*;
use cubecl_cpp::cuda::ptx::generic_to_shared;

use super::{A_STAGE_BYTES, BLOCK_M, BLOCK_N, CONSUMER_WARPS, Major, STAGE_BYTES, k_slice};
use crate::cuda::hopper::*;

/// Tiles are numbered down columns of `GROUP_M` tile rows, so the blocks running at once share
/// a few A panels and a few B panels in L2: row by row, 132 blocks of the output layer (128
/// tiles a row) read all 128 MiB of its weight once per row of tiles, from DRAM.
const GROUP_M: u32 = 8;

/// Tile `t`'s `(row, column)` in the `rows × columns` tile grid ([`GROUP_M`]).
#[cube]
pub(crate) fn tile_position(t: u32, rows: u32, columns: u32) -> (u32, u32) {
    let per_group = GROUP_M * columns;
    let first = (t / per_group) * GROUP_M;
    let height = select(rows - first < GROUP_M, rows - first, GROUP_M);
    let local = t % per_group;
    (first + local % height, local / height)
}

/// Loads one operand's 64-deep slice for the block into `tile`: one box of `rows` × 64 k when
/// K-major, else `rows / 64` boxes of 64 k × 64, 8 KiB apart.
#[cube]
pub(crate) fn load_operand(
    tile: u32,
    map: u64,
    k0: u32,
    row0: u32,
    bar: u32,
    #[comptime] rows: u32,
    #[comptime] major: Major,
) {
    match comptime!(major) {
        Major::K => tma_load_2d(tile, map, k0, row0, bar),
        Major::Mn =>
        {
            #[unroll]
            for j in 0..rows / 64 {
                tma_load_2d(tile + j * 8192, map, row0 + j * 64, k0, bar);
            }
        }
    }
}

/// A GEMM kernel's block tile and pipeline, as its producer loads them ([`produce`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Pipeline {
    pub block_m: u32,
    pub block_n: u32,
    /// The k extent of a stage's slice.
    pub depth: u32,
    pub stages: u32,
    /// Bytes of A's slice, where B's starts in a stage.
    pub a_bytes: u32,
    pub stage_bytes: u32,
    pub a_major: Major,
    pub b_major: Major,
    /// B's stage filled from two maps, `block_n / 2` rows each at the same columns (the gated
    /// GEMM's gate and up weights, `super::gated`), else from the first.
    pub split_b: bool,
}

impl Pipeline {
    /// The 128 × 256 block tile of [`super::gemm_kernel`] and the kernels built on it: `stages`
    /// stages of [`STAGE_BYTES`], each a `depth`-deep slice of A then of B (from one map).
    pub(crate) const fn wide(stages: u32, depth: u32, a_major: Major, b_major: Major) -> Self {
        Self {
            block_m: BLOCK_M,
            block_n: BLOCK_N,
            depth,
            stages,
            a_bytes: A_STAGE_BYTES,
            stage_bytes: STAGE_BYTES,
            a_major,
            b_major,
            split_b: false,
        }
    }

    /// The same with B's stage filled from two maps ([`Pipeline::split_b`]).
    pub(crate) const fn split(self) -> Self {
        Self { split_b: true, ..self }
    }
}

/// `acc` plus one bf16 stage's slice for a consumer warpgroup of a [`Pipeline::wide`] tile:
/// waits until the producer has filled the stage of the block's `slice`-th slice (of
/// `stages`), multiplies the warpgroup's 64 rows of A by B's 256, and frees the stage.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn consume_slice(
    acc: &Acc256,
    tiles: u32,
    full: u32,
    empty: u32,
    slice: u32,
    consumer: u32,
    #[comptime] stages: u32,
    #[comptime] a_major: Major,
    #[comptime] b_major: Major,
) -> Acc256 {
    let stage = slice % stages;
    mbarrier_wait(full + stage * 8, (slice / stages) & 1);
    let tile = tiles + stage * STAGE_BYTES;
    // This warpgroup's 64 rows of A start 8 KiB into the stage in either layout.
    let desc_a = descriptor(tile + consumer * 8192, comptime!(a_major.tile(BLOCK_M)));
    let desc_b = descriptor(tile + A_STAGE_BYTES, comptime!(b_major.tile(BLOCK_N)));
    let out = chain_256(
        acc,
        desc_a,
        desc_b,
        comptime!(k_slice(Operands::Bf16, a_major, b_major)),
    );
    if UNIT_POS.is_multiple_of(32) {
        mbarrier_arrive(empty + stage * 8);
    }
    out
}

/// The producer thread's loop: this block's `mine` tiles (the `CUBE_POS_X`-th, then every
/// `CUBE_COUNT_X`-th, in [`tile_position`]'s order), each slice of their `k_tiles` loaded by TMA
/// into the next stage once the consumers have freed it (the block's slice count so far picks
/// the stage and its round, across tiles). `maps`: A's, B's, and B's second half's where
/// [`Pipeline::split_b`] says (otherwise unread).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn produce(
    maps: (u64, u64, u64),
    tiles: u32,
    full: u32,
    empty: u32,
    mine: u32,
    k_tiles: u32,
    grid: (u32, u32),
    #[comptime] p: Pipeline,
) {
    let (stages, depth, stage_bytes) = comptime!((p.stages, p.depth, p.stage_bytes));
    let (block_m, block_n, a_bytes) = comptime!((p.block_m, p.block_n, p.a_bytes));
    for i in 0..mine {
        let (row, column) = tile_position(CUBE_POS_X + i * CUBE_COUNT_X, grid.0, grid.1);
        for kt in 0..k_tiles {
            let slice = i * k_tiles + kt;
            let stage = slice % stages;
            let round = slice / stages;
            if round > 0 {
                mbarrier_wait(empty + stage * 8, (round - 1) & 1);
            }
            let bar = full + stage * 8;
            mbarrier_expect(bar, stage_bytes);
            let tile = tiles + stage * stage_bytes;
            load_operand(
                tile,
                maps.0,
                kt * depth,
                row * block_m,
                bar,
                block_m,
                comptime!(p.a_major),
            );
            if comptime!(p.split_b) {
                // A 128-byte row a B row of the slice: the second half's rows follow the first's.
                let half = comptime!(block_n / 2);
                load_operand(
                    tile + a_bytes,
                    maps.1,
                    kt * depth,
                    column * half,
                    bar,
                    half,
                    comptime!(p.b_major),
                );
                load_operand(
                    tile + a_bytes + comptime!(half * 128),
                    maps.2,
                    kt * depth,
                    column * half,
                    bar,
                    half,
                    comptime!(p.b_major),
                );
            } else {
                load_operand(
                    tile + a_bytes,
                    maps.1,
                    kt * depth,
                    column * block_n,
                    bar,
                    block_n,
                    comptime!(p.b_major),
                );
            }
        }
    }
}

/// A GEMM block's shared memory (`smem_bytes` in all), laid out and its barriers initialized:
/// `stages` stages of `stage_bytes` from an address aligned to the 1 KiB the 128-byte swizzle
/// repeats over, the consumer warpgroups' staging (`staging_bytes` for both), then each stage's
/// "full" barrier (the producer's arrival and its TMA bytes) and "empty" one (an arrival a
/// consumer warp). Returns `(tiles, staging, full, empty)`, shared-memory addresses.
#[cube]
pub(crate) fn pipeline_smem(
    #[comptime] smem_bytes: u32,
    #[comptime] stages: u32,
    #[comptime] stage_bytes: u32,
    #[comptime] staging_bytes: u32,
) -> (u32, u32, u32, u32) {
    let smem = Shared::<[u32]>::new_aligned_slice(comptime!((smem_bytes / 4) as usize), 1024usize);
    let raw = generic_to_shared::<u32>(smem.as_ptr());
    let tiles = (raw + 1023) & !1023u32;
    let staging = tiles + stages * stage_bytes;
    let full = staging + staging_bytes;
    let empty = full + stages * 8;
    if UNIT_POS == 0 {
        #[unroll]
        for s in 0..stages {
            mbarrier_init(full + s * 8, 1u32);
            mbarrier_init(empty + s * 8, CONSUMER_WARPS);
        }
        mbarrier_init_fence();
    }
    sync_cube();
    (tiles, staging, full, empty)
}

/// Stores a consumer warpgroup's 64 × `128 · passes` results (`acc`, an `m64n{128 · passes}`
/// accumulator) times `factor` at `(row0, col0)` of C, in passes of 128 columns through its
/// staging `buffer` ([`stage_pass`], [`send_pass`]): TMA writes C in whole lines and lets the
/// warpgroup go on to its next tile while it does (`barrier`: the warpgroup's named barrier).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn store_tile<N: Size>(
    acc: &Vector<f32, N>,
    factor: f32,
    buffer: u32,
    map: u64,
    row0: u32,
    col0: u32,
    barrier: u32,
    storer: bool,
    #[comptime] passes: u32,
) {
    #[unroll]
    for pass in 0..passes {
        stage_pass(acc, factor, buffer, barrier, storer, pass, false);
        send_pass(map, col0 + pass * 128, row0, buffer, barrier, storer);
    }
}

/// Writes 128 columns of a consumer warpgroup's results (`acc`'s registers from `64 · pass`,
/// times `factor`) into its staging `buffer` as bf16 pairs, two swizzled 64 × 64 boxes, once
/// the stores from it before have read it ([`free_buffer`]).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn stage_pass<N: Size>(
    acc: &Vector<f32, N>,
    factor: f32,
    buffer: u32,
    barrier: u32,
    storer: bool,
    #[comptime] pass: u32,
    #[comptime] double: bool,
) {
    free_buffer(barrier, storer, double);
    #[unroll]
    for jj in 0..16u32 {
        #[unroll]
        for half in 0..2u32 {
            let addr = buffer + staged_pair(jj, half);
            let reg = comptime!((4 * (16 * pass + jj) + 2 * half) as usize);
            st_shared_u32(
                addr,
                pack_bf16(acc.extract(reg) * factor, acc.extract(reg + 1) * factor),
            );
        }
    }
}

/// Where this thread's accumulator pair `(jj, half)` of a 128-column pass sits in a staging
/// buffer of two swizzled 64 × 64 bf16 boxes (TMA's layout of them, loaded or stored), in
/// bytes: the accumulator layout of `hopper`'s module docs puts it at row
/// `16 · warp + lane / 4 + 8 · half`, columns `8 · jj + 2 · (lane % 4)` (+ 1), and the 128-byte
/// swizzle puts 16-byte chunk c of row r at chunk c ^ (r % 8).
#[cube]
pub(crate) fn staged_pair(jj: u32, half: u32) -> u32 {
    let lane = UNIT_POS % 32;
    let r = ((UNIT_POS % 128) / 32) * 16 + lane / 4 + half * 8;
    let chunk = (jj % 8) ^ (r % 8);
    (jj / 8) * 8192 + r * 128 + chunk * 16 + (lane % 4) * 4
}

/// Waits until a warpgroup's staging buffer is free: the stores from it before have read it
/// (`storer`'s bulk groups; with `double` buffers, all but the last, which read the other one).
#[cube]
pub(crate) fn free_buffer(barrier: u32, storer: bool, #[comptime] double: bool) {
    if storer {
        if comptime!(double) {
            bulk_wait_read_but_last();
        } else {
            bulk_wait_read();
        }
    }
    named_barrier(barrier, 128u32);
}

/// Hands a staged 64 × 128 pass to TMA (`storer`), to `(row0, col0)` of `map`'s tensor, once the
/// whole warpgroup has written it.
#[cube]
pub(crate) fn send_pass(map: u64, col0: u32, row0: u32, buffer: u32, barrier: u32, storer: bool) {
    fence_proxy_async_shared();
    named_barrier(barrier, 128u32);
    if storer {
        tma_store_box(map, col0, row0, buffer);
        tma_store_box(map, col0 + 64, row0, buffer + 8192);
        bulk_commit();
    }
}
