//! The forward kernel: output and `lse₂`, sweeping key and value tiles.
//!
//! Each warpgroup overlaps its softmax with the tensor cores: once tile `t`'s scores are issued
//! it issues the update with tile `t − 1`'s probabilities, waits for the scores only, and runs
//! tile `t`'s softmax while the update is still in flight. Three stages keep a tile's TMA load a
//! whole iteration ahead of its use, since a stage frees only when its update has finished.

use cubecl::prelude::*;
use cubecl_cpp::cuda::ptx::tensor_map_address;
use half::bf16;

use super::*;

/// Rows of the key and value tiles the forward sweeps.
const KEYS: u32 = 128;
/// One block tile (q), three stages of 128-row key and value tiles (224 KiB).
const SWEEP: Sweep = Sweep {
    blocks: 1,
    stages: 3,
    rows: KEYS,
    scratch: 0,
};
const STAGES: u32 = SWEEP.stages;
// Hopper gives a block at most 227 KiB of shared memory.
const _: () = assert!(SWEEP.smem_bytes() <= 227 * 1024);
const KEY_BYTES: u32 = SWEEP.tile_bytes();

/// Scores of a warpgroup's 64 query rows against a 128-row key tile, over the head dim.
const SCORES_128: Chain = Chain {
    operands: Operands::Bf16,
    n: 128,
    steps: 8,
    accumulate: false,
    a: ASource::Smem(Tile::KMajor { rows: BLOCK }),
    b: Tile::KMajor { rows: KEYS },
};
/// `acc + P·V`: P (64 × 128, registers) times a value tile read MN-major (rows are the k).
const UPDATE_128: Chain = Chain {
    operands: Operands::Bf16,
    n: 128,
    steps: 8,
    accumulate: true,
    a: ASource::Registers,
    b: Tile::MnMajor { box_bytes: KEYS * 128 },
};

/// A warpgroup's rows' running max (of scaled scores) and sum, and the factor that last
/// rescaled them (what the accumulator's rows are multiplied by next).
#[derive(CubeType, Clone, Copy)]
struct RowState {
    max_a: f32,
    max_b: f32,
    sum_a: f32,
    sum_b: f32,
    alpha_a: f32,
    alpha_b: f32,
}

/// Grid `(s / 128, h, b)`, 256 threads. With `note`, each warp's largest magnitude of the
/// output (as written, NaN ignored) to `maxima[8 · block + warp]`: no wait at the block's end.
/// With `documents` (causal too), `starts` `[b, s]` is each query's document's first key (f32,
/// exact below 2²⁴), before which every key is hidden; else one unused word.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward_kernel(
    q: &TensorMap<bf16, Tiled>,
    k: &TensorMap<bf16, Tiled>,
    v: &TensorMap<bf16, Tiled>,
    out: &mut Tensor<u32>,
    lse: &mut Tensor<f32>,
    maxima: &mut Tensor<f32>,
    starts: &Tensor<f32>,
    seq: u32,
    heads: u32,
    scale_log2: f32,
    #[comptime] causal: bool,
    #[comptime] note: bool,
    #[comptime] documents: bool,
) {
    let s = smem(SWEEP);
    let block = query_block(seq, causal, KEYS);
    let (head, batch, q0, tiles) = (block.head, block.batch, block.q0, block.tiles);
    let map_q = tensor_map_address(q);
    let map_k = tensor_map_address(k);
    let map_v = tensor_map_address(v);
    load_block(&s, map_q, map_q, q0, head, batch, false);
    #[unroll]
    for t in 0..STAGES {
        if t < tiles {
            load_sweep(&s, map_k, map_v, t, t * KEYS, head, batch, SWEEP);
        }
    }

    let wg = UNIT_POS / 128;
    let row0 = q0 + wg * 64;
    // Tiles wholly above this warpgroup's diagonal add nothing: it only frees their stages.
    let mut live = tiles;
    if comptime!(causal) {
        live = min(tiles, (row0 + 64).div_ceil(KEYS));
    }
    let l = lane();
    // This thread's two rows' first visible keys: their documents' (0 without documents).
    let mut firsts = Firsts { a: 0u32, b: 0u32 };
    if comptime!(documents) {
        let at = batch * seq;
        firsts.a = u32::cast_from(starts[(at + min(row0 + l.row_a, seq - 1)) as usize]);
        firsts.b = u32::cast_from(starts[(at + min(row0 + l.row_b, seq - 1)) as usize]);
    }
    let neg_inf = f32::new(f32::NEG_INFINITY);
    let mut rows = RowState {
        max_a: neg_inf,
        max_b: neg_inf,
        sum_a: 0.0f32,
        sum_b: 0.0f32,
        alpha_a: 1.0f32,
        alpha_b: 1.0f32,
    };
    let mut acc = Acc128::zeroed();
    mbarrier_wait(s.block_full, 0);
    let q_desc = descriptor(s.first + wg * 8192, comptime!(SCORES_128.a_tile()));
    if live > 0 {
        mbarrier_wait(s.full, 0);
        let scores = chain_128_fresh(q_desc, descriptor(s.sweep_a, comptime!(SCORES_128.b)), SCORES_128);
        let mut probs = fragments_128(&softmax_tile(
            &scores, &mut rows, &l, &firsts, row0, 0u32, seq, scale_log2, causal, documents,
        ));
        for t in 1..live {
            let stage = t % STAGES;
            mbarrier_wait(s.full + stage * 8, (t / STAGES) & 1);
            let before = (t - 1) % STAGES;
            let issued = issue_128_fresh(
                q_desc,
                descriptor(s.sweep_a + stage * KEY_BYTES, comptime!(SCORES_128.b)),
                SCORES_128,
            );
            let updated = issue_128_wide(
                &acc,
                &probs,
                descriptor(s.sweep_b + before * KEY_BYTES, comptime!(UPDATE_128.b)),
                UPDATE_128,
            );
            let scores = settle_128(&issued, 1u32);
            let next = softmax_tile(
                &scores,
                &mut rows,
                &l,
                &firsts,
                row0,
                t * KEYS,
                seq,
                scale_log2,
                causal,
                documents,
            );
            acc = settle_128_wide(&updated, &probs, 0u32);
            free_tile(&s, map_k, map_v, t - 1, head, batch, tiles);
            scale_rows(&mut acc, rows.alpha_a, rows.alpha_b);
            // Packed only now: ptxas serializes every wgmma of a kernel that writes a later
            // wgmma's input registers while one is in flight.
            probs = fragments_128(&next);
        }
        let last = (live - 1) % STAGES;
        let updated = issue_128_wide(
            &acc,
            &probs,
            descriptor(s.sweep_b + last * KEY_BYTES, comptime!(UPDATE_128.b)),
            UPDATE_128,
        );
        acc = settle_128_wide(&updated, &probs, 0u32);
        free_tile(&s, map_k, map_v, live - 1, head, batch, tiles);
    }
    for t in live..tiles {
        mbarrier_wait(s.full + (t % STAGES) * 8, (t / STAGES) & 1);
        free_tile(&s, map_k, map_v, t, head, batch, tiles);
    }

    let sum_a = quad_sum(rows.sum_a);
    let sum_b = quad_sum(rows.sum_b);
    let inv_a = select(sum_a > 0.0f32, 1.0f32 / sum_a, 0.0f32);
    let inv_b = select(sum_b > 0.0f32, 1.0f32 / sum_b, 0.0f32);
    let peak = store_rows(out, &acc, inv_a, inv_b, row0, head, batch, heads, seq, note);
    if UNIT_POS.is_multiple_of(4) {
        let at = (batch * heads + head) * seq;
        if row0 + l.row_a < seq {
            lse[(at + row0 + l.row_a) as usize] = rows.max_a + log2(sum_a);
        }
        if row0 + l.row_b < seq {
            lse[(at + row0 + l.row_b) as usize] = rows.max_b + log2(sum_b);
        }
    }
    if comptime!(note) {
        let warp = plane_max(peak);
        if UNIT_POS_PLANE == 0 {
            maxima[CUBE_POS * 8 + PLANE_POS as usize] = warp;
        }
    }
}

/// This warp is done with sweep tile `t` (its stage may be reloaded); thread 0 then loads the
/// tile `STAGES` further on into it, once every warp has let it go.
#[cube]
fn free_tile(s: &Smem, map_k: u64, map_v: u64, t: u32, head: u32, batch: u32, tiles: u32) {
    if UNIT_POS.is_multiple_of(32) {
        mbarrier_arrive(s.empty + (t % STAGES) * 8);
    }
    let next = t + STAGES;
    if next < tiles {
        load_sweep(s, map_k, map_v, next, next * KEYS, head, batch, SWEEP);
    }
}

/// A thread's two rows' first visible keys (`row_a`'s and `row_b`'s).
#[derive(CubeType, Clone, Copy)]
struct Firsts {
    a: u32,
    b: u32,
}

/// Folds a 64 × 128 tile of raw scores (keys from `k0`) into the rows' running max and sum and
/// returns its probabilities (f32); `rows.alpha_*` is then the factor the accumulator's rows need
/// before this tile's update. The max is taken over the raw scores (the scale is positive, so
/// it commutes) and each probability is `exp2(score · scale − base)`, one fused multiply-add
/// before the exponential. Only tiles that reach past the diagonal, the sequence's end or before
/// a row's document pay for the mask.
#[cube]
#[allow(clippy::too_many_arguments)]
fn softmax_tile(
    scores: &Acc128,
    rows: &mut RowState,
    l: &Lane,
    firsts: &Firsts,
    row0: u32,
    k0: u32,
    seq: u32,
    scale_log2: f32,
    #[comptime] causal: bool,
    #[comptime] documents: bool,
) -> Acc128 {
    let mut edge = k0 + KEYS > seq;
    if comptime!(causal) {
        edge = edge || k0 + KEYS - 1 > row0;
    }
    if comptime!(documents) {
        edge = edge || k0 < max(firsts.a, firsts.b);
    }
    let mut x = if edge {
        raw_scores(scores, l, firsts, row0, k0, seq, true, causal, documents)
    } else {
        raw_scores(scores, l, firsts, row0, k0, seq, false, causal, documents)
    };
    let neg_inf = f32::new(f32::NEG_INFINITY);
    let mut tile_a = neg_inf;
    let mut tile_b = neg_inf;
    #[unroll]
    for i in 0..64u32 {
        if comptime!(i % 4 < 2) {
            tile_a = max(tile_a, x.extract(i as usize))
        } else {
            tile_b = max(tile_b, x.extract(i as usize))
        }
    }
    let new_a = max(rows.max_a, quad_max(tile_a) * scale_log2);
    let new_b = max(rows.max_b, quad_max(tile_b) * scale_log2);
    // A row with nothing unmasked yet keeps a zero base, so exp2(-inf - base) = 0.
    let base_a = select(new_a == neg_inf, 0.0f32, new_a);
    let base_b = select(new_b == neg_inf, 0.0f32, new_b);
    rows.alpha_a = exp2(rows.max_a - base_a);
    rows.alpha_b = exp2(rows.max_b - base_b);
    rows.max_a = new_a;
    rows.max_b = new_b;
    let mut sum_a = 0.0f32;
    let mut sum_b = 0.0f32;
    #[unroll]
    for i in 0..64u32 {
        let base = if comptime!(i % 4 < 2) { base_a } else { base_b };
        let p = exp2(x.extract(i as usize) * scale_log2 - base);
        x.insert(i as usize, p);
        if comptime!(i % 4 < 2) { sum_a += p } else { sum_b += p }
    }
    rows.sum_a = rows.sum_a * rows.alpha_a + sum_a;
    rows.sum_b = rows.sum_b * rows.alpha_b + sum_b;
    x
}

/// The tile's raw scores, `-inf` where masked if `mask`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn raw_scores(
    scores: &Acc128,
    l: &Lane,
    firsts: &Firsts,
    row0: u32,
    k0: u32,
    seq: u32,
    #[comptime] mask: bool,
    #[comptime] causal: bool,
    #[comptime] documents: bool,
) -> Acc128 {
    let mut x = Acc128::empty();
    #[unroll]
    for i in 0..64u32 {
        let value = scores.extract(i as usize);
        if comptime!(mask) {
            let key = column(l, k0, i);
            let mut out = masked(row(l, row0, i), key, seq, causal);
            if comptime!(documents) {
                let first = if comptime!(i % 4 < 2) { firsts.a } else { firsts.b };
                out = out || key < first;
            }
            x.insert(i as usize, select(out, f32::new(f32::NEG_INFINITY), value));
        } else {
            x.insert(i as usize, value);
        }
    }
    x
}
