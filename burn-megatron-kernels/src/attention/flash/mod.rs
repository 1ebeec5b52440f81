//! Flash attention on Hopper for head dim 128, bf16: the forward, and the backward as one
//! kernel sweeping q tiles for a block of keys, writing dK and dV and adding its share of dQ
//! into f32 sums (TMA reductions), five products a tile. Scores and probabilities live in
//! registers (dS also in shared memory, for dQ): no O(s²) memory.
//!
//! A block owns 128 rows (two warpgroups of 64) of the tensor it writes and sweeps tiles of the
//! others through a TMA pipeline whose copies thread 0 issues ([`Sweep`]: the forward 128-row
//! tiles in 3 stages, the backward 64-row tiles in 2). Every product is a `wgmma` chain
//! ([`crate::cuda::hopper`]): scores over the 128-deep head dim, the updates as `m64n128` with the
//! probabilities (or their gradients) as the A operand straight from registers. Softmax runs in base 2 on `scale · log2(e)`-scaled scores;
//! the forward saves `lse₂`, each row's log₂-sum-exp₂, for the backward.
//!
//! Tensors: q, k, v, o, dO are `[b, h, s, 128]` views with a contiguous head dim; outputs are
//! written as `[b, s, h, 128]` (what the attention layer reshapes next); `lse₂` and
//! `delta = rowsum(dO ∘ O)` are `[b, h, s]` f32.

use cubecl::prelude::*;
use cubecl_cpp::cuda::ptx::generic_to_shared;

use crate::cuda::hopper::*;

mod backward;
mod forward;

pub(crate) use backward::{DELTA_LANES, DELTA_VECTOR, DQ_VECTOR, delta_kernel, dq_out_kernel, dqkv_kernel};
pub(crate) use forward::forward_kernel;

/// The head dim these kernels take.
pub const HEAD_DIM: usize = 128;
/// Rows a block owns: two warpgroups of 64.
const BLOCK: u32 = 128;
/// Rows of the tiles the backward kernels sweep.
const TILE: u32 = 64;
const BLOCK_BYTES: u32 = BLOCK * 256;

/// How a kernel lays out its shared memory: the block tiles it keeps (1 or 2), `stages` stages
/// of two sweep tiles of `rows` rows, and `scratch` bytes of its own (multiples of 1 KiB).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Sweep {
    blocks: u32,
    stages: u32,
    rows: u32,
    scratch: u32,
}

impl Sweep {
    const fn tile_bytes(self) -> u32 {
        self.rows * 256
    }

    /// The block tiles, the stages, the scratch, 128 bytes of barriers, 1 KiB to align.
    const fn smem_bytes(self) -> u32 {
        self.blocks * BLOCK_BYTES + 2 * self.stages * self.tile_bytes() + self.scratch + 128 + 1024
    }
}

/// dS of a block's 128 keys against a 64-query tile, bf16 (the dQ product's A operand).
const DS_BYTES: u32 = BLOCK * TILE * 2;
/// A warpgroup's dQ partial on its way out: 64 queries × 64 columns of f32.
const PARTIAL_BYTES: u32 = TILE * 64 * 4;
/// The backward: two block tiles (k and v), two stages of 64-row tiles (q and dO); scratch for
/// two dS tiles (one being written while the other is read) and the two warpgroups' dQ partials.
const BACKWARD: Sweep = Sweep {
    blocks: 2,
    stages: 2,
    rows: TILE,
    scratch: 2 * DS_BYTES + 2 * PARTIAL_BYTES,
};
/// The backward's bytes a sweep tile.
const TILE_BYTES: u32 = BACKWARD.tile_bytes();
/// One arrival per warp frees a stage.
const WARPS: u32 = 8;

/// Scores `A·Bᵀ` of a warpgroup's 64 block rows against a 64-row sweep tile, over the head dim.
const SCORES: Chain = Chain {
    operands: Operands::Bf16,
    n: 64,
    steps: 8,
    accumulate: false,
    a: ASource::Smem(Tile::KMajor { rows: BLOCK }),
    b: Tile::KMajor { rows: TILE },
};
/// `acc + P·B`: P (64 × 64, registers) times a sweep tile read MN-major (rows are the k).
const UPDATE: Chain = Chain {
    operands: Operands::Bf16,
    n: 128,
    steps: 4,
    accumulate: true,
    a: ASource::Registers,
    b: Tile::MnMajor { box_bytes: TILE * 128 },
};

/// Shared-memory addresses of one kernel's tiles and barriers.
#[derive(CubeType, Clone, Copy)]
struct Smem {
    /// The block's 128-row tiles (`second` only where the sweep keeps two).
    first: u32,
    second: u32,
    /// Stage 0 of the two sweep tiles (stage `i` follows each by `i` tiles).
    sweep_a: u32,
    sweep_b: u32,
    /// The kernel's own bytes.
    scratch: u32,
    /// Barriers: block tiles loaded; sweep stage loaded (one a stage); sweep stage free.
    block_full: u32,
    full: u32,
    empty: u32,
}

#[cube]
fn smem(#[comptime] sweep: Sweep) -> Smem {
    let raw = Shared::<[u32]>::new_aligned_slice(comptime!((sweep.smem_bytes() / 4) as usize), 1024usize);
    let stages = comptime!(sweep.stages);
    let first = (generic_to_shared::<u32>(raw.as_ptr()) + 1023) & !1023u32;
    let second = first + BLOCK_BYTES;
    let sweep_a = first + comptime!(sweep.blocks * BLOCK_BYTES);
    let sweep_b = sweep_a + comptime!(sweep.stages * sweep.tile_bytes());
    let scratch = sweep_b + comptime!(sweep.stages * sweep.tile_bytes());
    let block_full = scratch + comptime!(sweep.scratch);
    let smem = Smem {
        first,
        second,
        sweep_a,
        sweep_b,
        scratch,
        block_full,
        full: block_full + 8,
        empty: block_full + 8 + stages * 8,
    };
    if UNIT_POS == 0 {
        mbarrier_init(smem.block_full, 1u32);
        #[unroll]
        for s in 0..stages {
            mbarrier_init(smem.full + s * 8, 1u32);
            mbarrier_init(smem.empty + s * 8, WARPS);
        }
        mbarrier_init_fence();
    }
    sync_cube();
    smem
}

/// `rows` rows of a `[b, h, s, 128]` tensor from `row0` into `dst`: two 64-wide boxes of the head
/// dim, `rows × 128` bytes apart.
#[cube]
fn load_rows(dst: u32, map: u64, row0: u32, head: u32, batch: u32, bar: u32, #[comptime] rows: u32) {
    tma_load_4d(dst, map, 0, row0, head, batch, bar);
    tma_load_4d(dst + rows * 128, map, 64, row0, head, batch, bar);
}

/// Thread 0: the block's two tiles (`first` may be the only one, `second_map` then unused).
#[cube]
fn load_block(s: &Smem, first: u64, second: u64, row0: u32, head: u32, batch: u32, #[comptime] both: bool) {
    if UNIT_POS == 0 {
        let bytes = comptime!(if both { 2 * BLOCK_BYTES } else { BLOCK_BYTES });
        mbarrier_expect(s.block_full, bytes);
        load_rows(s.first, first, row0, head, batch, s.block_full, BLOCK);
        if comptime!(both) {
            load_rows(s.second, second, row0, head, batch, s.block_full, BLOCK);
        }
    }
}

/// Thread 0: sweep tile `t` (both tensors) into its stage, once the stage is free.
#[cube]
fn load_sweep(s: &Smem, a: u64, b: u64, t: u32, row0: u32, head: u32, batch: u32, #[comptime] sweep: Sweep) {
    if UNIT_POS == 0 {
        let stages = comptime!(sweep.stages);
        let bytes = comptime!(sweep.tile_bytes());
        let stage = t % stages;
        if t >= stages {
            mbarrier_wait(s.empty + stage * 8, (t / stages - 1) & 1);
        }
        let bar = s.full + stage * 8;
        mbarrier_expect(bar, comptime!(2 * sweep.tile_bytes()));
        load_rows(s.sweep_a + stage * bytes, a, row0, head, batch, bar, sweep.rows);
        load_rows(s.sweep_b + stage * bytes, b, row0, head, batch, bar, sweep.rows);
    }
}

/// This thread's place in the accumulator layout: its two rows (relative to the warpgroup's
/// first) and the first of its columns.
#[derive(CubeType, Clone, Copy)]
struct Lane {
    row_a: u32,
    row_b: u32,
    col: u32,
}

#[cube]
fn lane() -> Lane {
    let lane = UNIT_POS % 32;
    let warp = (UNIT_POS % 128) / 32;
    let row_a = warp * 16 + lane / 4;
    Lane {
        row_a,
        row_b: row_a + 8,
        col: 2 * (lane % 4),
    }
}

/// The column of accumulator register `i`, from the tile's first column `col0`.
#[cube]
fn column(l: &Lane, col0: u32, #[comptime] i: u32) -> u32 {
    col0 + l.col + comptime!((i / 4) * 8 + i % 2)
}

/// The absolute row of accumulator register `i`.
#[cube]
fn row(l: &Lane, row0: u32, #[comptime] i: u32) -> u32 {
    if comptime!(i % 4 < 2) {
        row0 + l.row_a
    } else {
        row0 + l.row_b
    }
}

#[cube]
fn quad_max(x: f32) -> f32 {
    let x = max(x, plane_shuffle_xor(x, 1u32));
    max(x, plane_shuffle_xor(x, 2u32))
}

#[cube]
fn quad_sum(x: f32) -> f32 {
    let x = x + plane_shuffle_xor(x, 1u32);
    x + plane_shuffle_xor(x, 2u32)
}

/// A 64 × 128 f32 accumulator as the bf16 A operand of the next product, as [`fragments`].
#[cube]
fn fragments_128(p: &Acc128) -> Frags128 {
    let mut frags = Frags128::empty();
    #[unroll]
    for t in 0..32u32 {
        frags.insert(
            t as usize,
            pack_bf16(p.extract((2 * t) as usize), p.extract((2 * t + 1) as usize)),
        );
    }
    frags
}

/// A 64 × 64 f32 accumulator as the bf16 A operand of the next product (pair `t` is register
/// `t` of the fragments: see `hopper`'s module docs).
#[cube]
fn fragments(p: &Acc64) -> Frags64 {
    let mut frags = Frags64::empty();
    #[unroll]
    for t in 0..16u32 {
        frags.insert(
            t as usize,
            pack_bf16(p.extract((2 * t) as usize), p.extract((2 * t + 1) as usize)),
        );
    }
    frags
}

/// Whether (query `q`, key `k`) is outside the attention pattern.
#[cube]
fn masked(q: u32, k: u32, seq: u32, #[comptime] causal: bool) -> bool {
    let out = q >= seq || k >= seq;
    if comptime!(causal) { out || k > q } else { out }
}

/// Writes a warpgroup's 64 × 128 result `acc · factor` into `[b, s, h, 128]` rows from `row0`,
/// `out` seen as bf16 pairs (`u32`): each thread's two neighbouring columns in one 4-byte store,
/// so a warp's store writes 16 contiguous bytes of each of 8 rows (2-byte stores had touched
/// the same sectors twice as often). With `note`, returns the largest magnitude the thread wrote
/// (as written, NaN ignored; 0 without `note`).
#[cube]
#[allow(clippy::too_many_arguments)]
fn store_rows(
    out: &mut Tensor<u32>,
    acc: &Acc128,
    factor_a: f32,
    factor_b: f32,
    row0: u32,
    head: u32,
    batch: u32,
    heads: u32,
    seq: u32,
    #[comptime] note: bool,
) -> f32 {
    let l = lane();
    let mut peak = 0.0f32;
    #[unroll]
    for pair in 0..32u32 {
        let i = comptime!(2 * pair);
        let r = row(&l, row0, i);
        let factor = if comptime!(i % 4 < 2) { factor_a } else { factor_b };
        if r < seq {
            let at = ((batch * seq + r) * heads + head) * comptime!(HEAD_DIM as u32 / 2) + column(&l, 0u32, i) / 2;
            let (lo, hi) = (acc.extract(i as usize), acc.extract(comptime!((i + 1) as usize)));
            let packed = pack_bf16(lo * factor, hi * factor);
            out[at as usize] = packed;
            if comptime!(note) {
                // Each bf16 half as the f32 of the same value (its bits in the upper half).
                let (low, high) = (
                    f32::reinterpret(packed << 16u32),
                    f32::reinterpret(packed & 0xFFFF0000u32),
                );
                peak = f32::max(peak, f32::max(f32::abs(low), f32::abs(high)));
            }
        }
    }
    peak
}

#[cube]
fn scale_rows(acc: &mut Acc128, a: f32, b: f32) {
    #[unroll]
    for i in 0..64u32 {
        let factor = if comptime!(i % 4 < 2) { a } else { b };
        acc.insert(i as usize, acc.extract(i as usize) * factor);
    }
}

/// About two waves of blocks on 132 SMs: a launch takes as many heads (batch entries × heads)
/// together as fill it ([`Place`]).
const GROUP_BLOCKS: u32 = 256;

/// Where a block of a `(s / 128, h, b)` grid works: its rank among its head's blocks (rank 0
/// the heaviest under the causal mask), its head and batch entry.
///
/// Blocks start in launch order as SMs free up, so the causal mask's unequal blocks balance
/// best heaviest first. The grid's own order ran each head's blocks in turn, its heavy ones
/// started late, and SMs idled at the end; rank by rank over every head would spread what the
/// running blocks read over all heads' rows. So the blocks run a group of heads at a time
/// (about [`GROUP_BLOCKS`] blocks, one head when it has as many), rank by rank within it. By a
/// greedy schedule of the blocks' tile counts on 132 SMs this ends ~11% sooner on llama-1b's
/// shape (64 heads of 16 blocks: groups of 16) and ~20% on llama-8b's at tp 2 (16 heads of
/// 32: groups of 8); at 32k (256 blocks a head) the order is the grid's, which a group of 16
/// heads made 4% slower (L2).
#[derive(CubeType, Clone, Copy)]
struct Place {
    rank: u32,
    head: u32,
    batch: u32,
}

#[cube]
fn place() -> Place {
    let per_head = CUBE_COUNT_X;
    let heads = CUBE_COUNT_Y * CUBE_COUNT_Z;
    let group = max(1u32, GROUP_BLOCKS / per_head);
    let at = CUBE_POS as u32;
    let first = (at / (group * per_head)) * group;
    let size = min(group, heads - first);
    let within = at - first * per_head;
    let pair = first + within % size;
    Place {
        rank: within / size,
        head: pair % CUBE_COUNT_Y,
        batch: pair / CUBE_COUNT_Y,
    }
}

/// Where a query-outer block works: its head, its batch entry, its first query row (the
/// heaviest blocks first under the causal mask, [`Place`]) and how many `rows`-row key tiles
/// it sweeps.
#[derive(CubeType, Clone, Copy)]
struct QueryBlock {
    head: u32,
    batch: u32,
    q0: u32,
    tiles: u32,
}

#[cube]
fn query_block(seq: u32, #[comptime] causal: bool, #[comptime] rows: u32) -> QueryBlock {
    let at = place();
    let q0 = (seq.div_ceil(BLOCK) - 1 - at.rank) * BLOCK;
    let end = if comptime!(causal) { min(q0 + BLOCK, seq) } else { seq };
    QueryBlock {
        head: at.head,
        batch: at.batch,
        q0,
        tiles: end.div_ceil(rows),
    }
}
