//! The backward kernels: `delta`, then dQ (sweeping key and value tiles) and dK + dV (sweeping
//! query and output-gradient tiles).

use cubecl::prelude::*;
use cubecl_cpp::cuda::ptx::tensor_map_address;
use half::bf16;

use super::*;

/// Stages of the backward kernels' sweeps.
const STAGES: u32 = BACKWARD.stages;

/// dQ: grid `(s / 128, h, b)`, 256 threads; sweeps the k and v tiles.
#[cube(launch_unchecked)]
pub(crate) fn dq_kernel(
    q: &TensorMap<bf16, Tiled>,
    d_out: &TensorMap<bf16, Tiled>,
    k: &TensorMap<bf16, Tiled>,
    v: &TensorMap<bf16, Tiled>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dq: &mut Tensor<u32>,
    seq: u32,
    heads: u32,
    scale_log2: f32,
    scale: f32,
    #[comptime] causal: bool,
) {
    let s = smem(BACKWARD);
    let block = query_block(seq, causal, TILE);
    let (head, batch, q0, tiles) = (block.head, block.batch, block.q0, block.tiles);
    let map_q = tensor_map_address(q);
    let map_o = tensor_map_address(d_out);
    let map_k = tensor_map_address(k);
    let map_v = tensor_map_address(v);
    load_block(&s, map_q, map_o, q0, head, batch, true);
    if tiles > 0 {
        load_sweep(&s, map_k, map_v, 0, 0, head, batch, BACKWARD);
    }

    let wg = UNIT_POS / 128;
    let row0 = q0 + wg * 64;
    let l = lane();
    let stats = (batch * heads + head) * seq;
    let ra = (stats + min(row0 + l.row_a, seq - 1)) as usize;
    let rb = (stats + min(row0 + l.row_b, seq - 1)) as usize;
    let lse_a = lse[ra];
    let lse_b = lse[rb];
    let delta_a = delta[ra];
    let delta_b = delta[rb];
    let mut acc = Acc128::zeroed();
    mbarrier_wait(s.block_full, 0);
    for t in 0..tiles {
        if t + 1 < tiles {
            load_sweep(&s, map_k, map_v, t + 1, (t + 1) * TILE, head, batch, BACKWARD);
        }
        let stage = t % STAGES;
        mbarrier_wait(s.full + stage * 8, (t / STAGES) & 1);
        let k0 = t * TILE;
        if !causal || k0 <= row0 + 63 {
            let k_tile = s.sweep_a + stage * TILE_BYTES;
            let scores = chain_64(
                descriptor(s.first + wg * 8192, comptime!(SCORES.a_tile())),
                descriptor(k_tile, comptime!(SCORES.b)),
                SCORES,
            );
            let d_probs = chain_64(
                descriptor(s.second + wg * 8192, comptime!(SCORES.a_tile())),
                descriptor(s.sweep_b + stage * TILE_BYTES, comptime!(SCORES.b)),
                SCORES,
            );
            // Only tiles reaching past the diagonal or the sequence's end pay for the mask.
            let mut edge = k0 + TILE > seq;
            if comptime!(causal) {
                edge = edge || k0 + TILE - 1 > row0;
            }
            let stats = RowStats {
                lse_a,
                lse_b,
                delta_a,
                delta_b,
            };
            let ds = if edge {
                dq_scores(&scores, &d_probs, &stats, &l, row0, k0, seq, scale_log2, true, causal)
            } else {
                dq_scores(&scores, &d_probs, &stats, &l, row0, k0, seq, scale_log2, false, causal)
            };
            let frags = fragments(&ds);
            acc = chain_128(&acc, &frags, descriptor(k_tile, comptime!(UPDATE.b)), UPDATE);
        }
        if UNIT_POS.is_multiple_of(32) {
            mbarrier_arrive(s.empty + stage * 8);
        }
    }
    store_rows(dq, &acc, scale, scale, row0, head, batch, heads, seq, false);
}

/// dK and dV: grid `(s / 128, h, b)`, 256 threads; each block owns 128 key rows and sweeps the
/// q and dO tiles. Works on the transposed scores `K·Qᵀ`, so rows are keys, columns queries.
#[cube(launch_unchecked)]
pub(crate) fn dkdv_kernel(
    k: &TensorMap<bf16, Tiled>,
    v: &TensorMap<bf16, Tiled>,
    q: &TensorMap<bf16, Tiled>,
    d_out: &TensorMap<bf16, Tiled>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dk: &mut Tensor<u32>,
    dv: &mut Tensor<u32>,
    seq: u32,
    heads: u32,
    scale_log2: f32,
    scale: f32,
    #[comptime] causal: bool,
) {
    let s = smem(BACKWARD);
    let head = CUBE_POS_Y;
    let batch = CUBE_POS_Z;
    let k0 = CUBE_POS_X * BLOCK;
    // Under the causal mask the queries before this block's first key see none of its keys.
    let mut first = 0u32;
    if comptime!(causal) {
        first = k0 / TILE;
    }
    let tiles = seq.div_ceil(TILE);
    let map_k = tensor_map_address(k);
    let map_v = tensor_map_address(v);
    let map_q = tensor_map_address(q);
    let map_o = tensor_map_address(d_out);
    load_block(&s, map_k, map_v, k0, head, batch, true);
    // Sweep tiles are numbered from 0 for the pipeline; tile `t` holds queries from (first + t)·64.
    if first < tiles {
        load_sweep(&s, map_q, map_o, 0, first * TILE, head, batch, BACKWARD);
    }

    let wg = UNIT_POS / 128;
    let row0 = k0 + wg * 64;
    let l = lane();
    let stats = (batch * heads + head) * seq;
    let mut dk_acc = Acc128::zeroed();
    let mut dv_acc = Acc128::zeroed();
    mbarrier_wait(s.block_full, 0);
    let count = tiles - min(first, tiles);
    for t in 0..count {
        if t + 1 < count {
            load_sweep(&s, map_q, map_o, t + 1, (first + t + 1) * TILE, head, batch, BACKWARD);
        }
        let stage = t % STAGES;
        mbarrier_wait(s.full + stage * 8, (t / STAGES) & 1);
        let q0 = (first + t) * TILE;
        // A tile of queries all before this warpgroup's first key adds nothing.
        if !causal || q0 + 63 >= row0 {
            let q_tile = s.sweep_a + stage * TILE_BYTES;
            let o_tile = s.sweep_b + stage * TILE_BYTES;
            // Read before the product that needs them, so the loads' latency hides under it.
            let lse_cols = column_values(lse, &l, q0, stats, seq);
            let scores = chain_64(
                descriptor(s.first + wg * 8192, comptime!(SCORES.a_tile())),
                descriptor(q_tile, comptime!(SCORES.b)),
                SCORES,
            );
            // Only tiles reaching past the diagonal or the sequence's end pay for the mask.
            let mut edge = q0 + TILE > seq || row0 + 64 > seq;
            if comptime!(causal) {
                edge = edge || row0 + 63 > q0;
            }
            let p = if edge {
                key_probs(&scores, &lse_cols, &l, row0, q0, seq, scale_log2, true, causal)
            } else {
                key_probs(&scores, &lse_cols, &l, row0, q0, seq, scale_log2, false, causal)
            };
            let delta_cols = column_values(delta, &l, q0, stats, seq);
            let frags = fragments(&p);
            dv_acc = chain_128(&dv_acc, &frags, descriptor(o_tile, comptime!(UPDATE.b)), UPDATE);
            let d_probs = chain_64(
                descriptor(s.second + wg * 8192, comptime!(SCORES.a_tile())),
                descriptor(o_tile, comptime!(SCORES.b)),
                SCORES,
            );
            let mut ds = Acc64::empty();
            #[unroll]
            for i in 0..32u32 {
                let d = delta_cols.extract(comptime!(column_slot(i)) as usize);
                ds.insert(i as usize, p.extract(i as usize) * (d_probs.extract(i as usize) - d));
            }
            let frags = fragments(&ds);
            dk_acc = chain_128(&dk_acc, &frags, descriptor(q_tile, comptime!(UPDATE.b)), UPDATE);
        }
        if UNIT_POS.is_multiple_of(32) {
            mbarrier_arrive(s.empty + stage * 8);
        }
    }
    store_rows(dk, &dk_acc, scale, scale, row0, head, batch, heads, seq, false);
    store_rows(dv, &dv_acc, 1.0f32, 1.0f32, row0, head, batch, heads, seq, false);
}

/// A dQ warpgroup's two rows' `lse₂` and `delta`.
#[derive(CubeType, Clone, Copy)]
struct RowStats {
    lse_a: f32,
    lse_b: f32,
    delta_a: f32,
    delta_b: f32,
}

/// dQ's `dS = P ∘ (dP − delta)` of a tile (keys from `k0`), `P` recomputed from the scores;
/// zero where masked if `mask`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn dq_scores(
    scores: &Acc64,
    d_probs: &Acc64,
    stats: &RowStats,
    l: &Lane,
    row0: u32,
    k0: u32,
    seq: u32,
    scale_log2: f32,
    #[comptime] mask: bool,
    #[comptime] causal: bool,
) -> Acc64 {
    let mut ds = Acc64::empty();
    #[unroll]
    for i in 0..32u32 {
        let upper = comptime!(i % 4 < 2);
        let mut p = exp2(scores.extract(i as usize) * scale_log2 - if upper { stats.lse_a } else { stats.lse_b });
        if comptime!(mask) {
            p = select(masked(row(l, row0, i), column(l, k0, i), seq, causal), 0.0f32, p);
        }
        ds.insert(
            i as usize,
            p * (d_probs.extract(i as usize) - if upper { stats.delta_a } else { stats.delta_b }),
        );
    }
    ds
}

/// One f32 per column this thread's accumulator registers cover: 16 of a 64-column tile.
type Cols = Vector<f32, Const<16>>;

/// The slot in [`Cols`] of accumulator register `i`'s column (registers `4j + {0, 1}` and
/// `4j + {2, 3}` share their columns).
const fn column_slot(i: u32) -> u32 {
    (i / 4) * 2 + i % 2
}

/// `stat` (`lse₂` or `delta`, `[b, h, s]`, this head's rows from `stats`) at this thread's
/// columns of the query tile from `q0`.
#[cube]
fn column_values(stat: &Tensor<f32>, l: &Lane, q0: u32, stats: u32, seq: u32) -> Cols {
    let mut out = Cols::empty();
    #[unroll]
    for slot in 0..16u32 {
        let query = column(l, q0, comptime!(4 * (slot / 2) + slot % 2));
        out.insert(slot as usize, stat[(stats + min(query, seq - 1)) as usize]);
    }
    out
}

/// dK/dV's probabilities of a transposed tile (keys are rows from `row0`, queries columns from
/// `q0`, whose `lse₂` `lse_cols` holds); zero where masked if `mask`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn key_probs(
    scores: &Acc64,
    lse_cols: &Cols,
    l: &Lane,
    row0: u32,
    q0: u32,
    seq: u32,
    scale_log2: f32,
    #[comptime] mask: bool,
    #[comptime] causal: bool,
) -> Acc64 {
    let mut p = Acc64::empty();
    #[unroll]
    for i in 0..32u32 {
        let at = lse_cols.extract(comptime!(column_slot(i)) as usize);
        let mut value = exp2(scores.extract(i as usize) * scale_log2 - at);
        if comptime!(mask) {
            value = select(masked(column(l, q0, i), row(l, row0, i), seq, causal), 0.0f32, value);
        }
        p.insert(i as usize, value);
    }
    p
}

/// Threads summing one row of [`delta_kernel`], each a vector of [`DELTA_VECTOR`] values.
pub(crate) const DELTA_LANES: u32 = 16;
/// bf16 values a thread of [`delta_kernel`] reads at once (16 bytes).
pub(crate) const DELTA_VECTOR: usize = 8;

/// `delta = rowsum(dO ∘ O)` in f32 over the `[b, h, s, 128]` views (head dim contiguous, other
/// strides multiples of 8), into a compact `[b, h, s]`: sixteen neighbouring threads a row, each
/// reading 16 bytes of both (a warp reads two whole rows of each at once), summed by shuffles
/// within the sixteen. Launched with vectors of [`DELTA_VECTOR`].
#[cube(launch_unchecked)]
pub(crate) fn delta_kernel<N: Size>(
    out: &Tensor<Vector<bf16, N>>,
    d_out: &Tensor<Vector<bf16, N>>,
    delta: &mut Tensor<f32>,
    seq: u32,
    heads: u32,
) {
    let r = ABSOLUTE_POS as u32 / DELTA_LANES;
    let lane = (ABSOLUTE_POS as u32 % DELTA_LANES) as usize;
    let mut sum = 0.0f32;
    // Every lane joins the shuffles below, a row past the end with a zero.
    if r < delta.len() as u32 {
        let batch = (r / (heads * seq)) as usize;
        let head = ((r / seq) % heads) as usize;
        let pos = (r % seq) as usize;
        let o = batch * out.stride(0) + head * out.stride(1) + pos * out.stride(2);
        let g = batch * d_out.stride(0) + head * d_out.stride(1) + pos * d_out.stride(2);
        let product = Vector::<f32, N>::cast_from(out[o / DELTA_VECTOR + lane])
            * Vector::<f32, N>::cast_from(d_out[g / DELTA_VECTOR + lane]);
        sum = crate::row_kernels::hsum(product);
    }
    sum += plane_shuffle_xor(sum, 1u32);
    sum += plane_shuffle_xor(sum, 2u32);
    sum += plane_shuffle_xor(sum, 4u32);
    sum += plane_shuffle_xor(sum, 8u32);
    if r < delta.len() as u32 && lane == 0 {
        delta[r as usize] = sum;
    }
}
