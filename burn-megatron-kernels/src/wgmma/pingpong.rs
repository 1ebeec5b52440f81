//! The GEMM's ping-pong schedule ([`super::Schedule::PingPong`]): each consumer warpgroup owns
//! whole 128 × 128 tiles, the two taking the block's tiles by turns, so one stores a tile's
//! results while the other multiplies the next. In the cooperative kernel
//! (`gemm_kernel`) both warpgroups share a 128 × 256 tile and stop the tensor cores together
//! while they store it.
//!
//! The stages are read in the order the producer fills them, and the warpgroups' main loops
//! take turns: a warpgroup starts waiting for its tile's slices only once the other has issued
//! its last slice of the tile before (a named barrier each way). A stage's "full" barrier
//! tells phases apart by parity alone, so a warpgroup that waited for a slice two rounds ahead
//! of the producer would pass at once and read a stage not yet loaded; after the other's turn,
//! every slice before its tile's has been loaded, so it waits at most one round ahead. Each
//! keeps one slice issued ahead of the one it waits for, and alternates its two 64-row halves'
//! `wgmma`s (two accumulators), since one warpgroup alone must keep the tensor cores fed.

use cubecl::prelude::*;
use cubecl_cpp::cuda::ptx::tensor_map_address;
use half::bf16;

use super::{BLOCK_K, Major, Pipeline, STAGING_BYTES, block_k, pipeline_smem, produce, store_tile, tile_position};
use crate::hopper::*;

/// Rows of C a warpgroup's tile has: two stacked 64-row halves.
const BLOCK_M: u32 = 128;
/// Columns of C a tile has: one `m64n128` chain a half.
pub(crate) const BLOCK_N: u32 = 128;
const A_STAGE_BYTES: u32 = BLOCK_M * BLOCK_K * 2;
const STAGE_BYTES: u32 = A_STAGE_BYTES + BLOCK_N * BLOCK_K * 2;
/// As many 32 KiB stages as fit beside the staging and barriers: 6.
const STAGES: u32 = (227 * 1024 - 2 * STAGING_BYTES - 2048) / STAGE_BYTES;
/// The stages, each warpgroup's staging, then the barriers, plus the 1 KiB alignment: 226 KiB.
const SMEM_BYTES: u32 = STAGES * STAGE_BYTES + 2 * STAGING_BYTES + 1024 + 1024;
const _: () = assert!(SMEM_BYTES <= 227 * 1024);

/// One k-slice's stacked chain (four steps: k16 bf16, k32 FP8) onto both halves' accumulators.
const fn stacked_slice(operands: Operands, a: Major, b: Major) -> Chain {
    Chain {
        operands,
        n: BLOCK_N,
        steps: 4,
        accumulate: true,
        a: ASource::Smem(a.tile(BLOCK_M)),
        b: b.tile(BLOCK_N),
    }
}

/// A stage is read by one warpgroup: an arrival from each of its warps frees it.
const READER_WARPS: u32 = 4;
/// The named barrier consumer `c` waits at for its turn is `TURN + c` (1 and 2 are their
/// stores').
const TURN: u32 = 3;

/// Consumer `consumer`, having issued every slice of the block's tile `i`, gives the other
/// its turn, if the block has a tile after `i`.
#[cube]
fn hand_over(i: u32, mine: u32, consumer: u32) {
    if i + 1 < mine {
        named_arrive(TURN + 1 - consumer, 256u32);
    }
}

/// `gemm_kernel`'s product in ping-pong: the same operands and output; B's boxes are
/// [`BLOCK_N`] rows.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn pingpong_kernel<E: Scalar>(
    a: &TensorMap<E, Tiled>,
    b: &TensorMap<E, Tiled>,
    c: &mut TensorMap<bf16, Tiled>,
    scale_a: &Tensor<f32>,
    scale_b: &Tensor<f32>,
    m: u32,
    n: u32,
    k: u32,
    #[comptime] a_major: Major,
    #[comptime] b_major: Major,
    #[comptime] operands: Operands,
    #[comptime] scaled: bool,
) {
    let depth = comptime!(block_k(operands));
    let (tiles, staging, full, empty) = pipeline_smem(SMEM_BYTES, STAGES, STAGE_BYTES, READER_WARPS);

    let k_tiles = k.div_ceil(depth);
    let (rows, columns) = (m.div_ceil(BLOCK_M), n.div_ceil(BLOCK_N));
    let mine = (rows * columns - CUBE_POS_X).div_ceil(CUBE_COUNT_X);
    let warpgroup = UNIT_POS / 128;

    if warpgroup == 0 {
        if UNIT_POS == 0 {
            let pipeline = comptime!(Pipeline {
                block_m: BLOCK_M,
                block_n: BLOCK_N,
                depth,
                stages: STAGES,
                a_bytes: A_STAGE_BYTES,
                stage_bytes: STAGE_BYTES,
                a_major,
                b_major,
            });
            let maps = (tensor_map_address(a), tensor_map_address(b));
            produce(maps, tiles, full, empty, mine, k_tiles, (rows, columns), pipeline);
        }
    } else {
        let consumer = warpgroup - 1;
        let buffer = staging + consumer * STAGING_BYTES;
        let storer = UNIT_POS.is_multiple_of(128);
        let arriver = UNIT_POS.is_multiple_of(32);
        let map_c = store_map_address(c);
        let mut factor = 1.0f32;
        if comptime!(scaled) {
            factor = scale_a[0] * scale_b[0];
        }
        // The block's tiles `consumer`, `consumer + 2`, ….
        let turns = (mine + 1 - consumer) / 2;
        for turn in 0..turns {
            let i = consumer + 2 * turn;
            let (row, column) = tile_position(CUBE_POS_X + i * CUBE_COUNT_X, rows, columns);
            // This warpgroup's turn: the other has issued the tile before.
            if i > 0 {
                named_barrier(TURN + consumer, 256u32);
            }
            let mut acc = Acc256::zeroed();
            for kt in 0..k_tiles {
                let slice = i * k_tiles + kt;
                let stage = slice % STAGES;
                mbarrier_wait(full + stage * 8, (slice / STAGES) & 1);
                let at = tiles + stage * STAGE_BYTES;
                let desc_a = descriptor(at, comptime!(a_major.tile(BLOCK_M)));
                let desc_b = descriptor(at + A_STAGE_BYTES, comptime!(b_major.tile(BLOCK_N)));
                acc = issue_stacked(
                    &acc,
                    desc_a,
                    desc_b,
                    comptime!(stacked_slice(operands, a_major, b_major)),
                );
                // The slice before is done with its stage once only this one flies.
                if kt > 0 {
                    wgmma_wait(1u32);
                    if arriver {
                        mbarrier_arrive(empty + ((slice - 1) % STAGES) * 8);
                    }
                }
            }
            hand_over(i, mine, consumer);
            acc = settle_256(&acc, 0u32);
            if arriver {
                mbarrier_arrive(empty + ((i * k_tiles + k_tiles - 1) % STAGES) * 8);
            }
            let barrier = 1 + consumer;
            store_tile(
                &acc,
                factor,
                buffer,
                map_c,
                row * BLOCK_M,
                column * BLOCK_N,
                barrier,
                storer,
                2u32,
                true,
            );
        }
        if storer {
            bulk_wait();
        }
    }
}
