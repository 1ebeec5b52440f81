//! The backward kernels: `delta`, then dQ, dK and dV in one kernel sweeping query and
//! output-gradient tiles (dQ added into f32 sums by TMA reductions), then dQ's sums as bf16.

use cubecl::prelude::*;
use cubecl_cpp::cuda::ptx::tensor_map_address;
use half::bf16;

use super::*;

/// Stages of the backward kernels' sweeps.
const STAGES: u32 = BACKWARD.stages;

/// The dQ product: dS (128 keys × 64 queries, read MN-major: A is queries × keys) times the
/// block's k tile read MN-major (rows are the keys), for one warpgroup's 64 of the head dim.
const DQ: Chain = Chain {
    operands: Operands::Bf16,
    n: 64,
    steps: BLOCK / 16,
    accumulate: false,
    a: ASource::Smem(Tile::MnMajor { box_bytes: DS_BYTES }),
    b: Tile::MnMajor {
        box_bytes: BLOCK_BYTES / 2,
    },
};
// Hopper gives a block at most 227 KiB of shared memory.
const _: () = assert!(BACKWARD.smem_bytes() <= 227 * 1024);

/// dQ, dK and dV: grid `(s / 128, h, b)`, 256 threads (with `unrotate`, dK leaves through the
/// inverse of RoPE's rotation, [`store_rows_unrotated`]); each block owns 128 key rows and sweeps
/// the q and dO tiles. Works on the transposed scores `K·Qᵀ`, so rows are keys, columns queries.
/// Each tile's dS goes through shared memory to both warpgroups; each multiplies it by its half
/// of the block's k into a 64 × 64 dQ partial, which TMA adds into `dq` (f32 `[b·h·s, 128]`,
/// zeroed by the delta kernel; unscaled). A warpgroup multiplies tile `t`'s dS after its own
/// products of tile `t + 1`, so neither waits for the other in lockstep: with a barrier between
/// the warpgroups every tile (both multiplying at once, then both in the softmax at once) the
/// kernel took 643 µs a llama-1b layer where this takes 602 (the two kernels before, 620: one
/// H100).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn dqkv_kernel(
    k: &TensorMap<bf16, Tiled>,
    v: &TensorMap<bf16, Tiled>,
    q: &TensorMap<bf16, Tiled>,
    d_out: &TensorMap<bf16, Tiled>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dq: &mut TensorMap<f32, Tiled>,
    dk: &mut Tensor<u32>,
    dv: &mut Tensor<u32>,
    cos: &Tensor<f32>,
    sin: &Tensor<f32>,
    starts: &Tensor<f32>,
    seq: u32,
    heads: u32,
    scale_log2: f32,
    scale: f32,
    #[comptime] causal: bool,
    #[comptime] unrotate: bool,
    #[comptime] documents: bool,
) {
    let s = smem(BACKWARD);
    // Heaviest first: the first key blocks see the most queries under the causal mask.
    let at = place();
    let (head, batch) = (at.head, at.batch);
    let k0 = at.rank * BLOCK;
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
    let map_dq = store_map_address(dq);
    load_block(&s, map_k, map_v, k0, head, batch, true);
    // Sweep tiles are numbered from 0 for the pipeline; tile `t` holds queries from (first + t)·64.
    if first < tiles {
        load_sweep(&s, map_q, map_o, 0, first * TILE, head, batch, BACKWARD);
    }

    // dS tile `t` sits in buffer `t % 2`: full once both warpgroups wrote their halves, empty once
    // both multiplied it.
    let ds_full = s.empty + STAGES * 8;
    let ds_empty = ds_full + 16;
    if UNIT_POS == 0 {
        #[unroll]
        for b in 0..2u32 {
            mbarrier_init(ds_full + b * 8, 256u32);
            mbarrier_init(ds_empty + b * 8, 256u32);
        }
        mbarrier_init_fence();
    }
    sync_cube();

    let wg = UNIT_POS / 128;
    let row0 = k0 + wg * 64;
    let l = lane();
    let stats = (batch * heads + head) * seq;
    let partial = s.scratch + comptime!(2 * DS_BYTES) + wg * PARTIAL_BYTES;
    // One thread a warpgroup hands its partials to TMA.
    let storer = UNIT_POS.is_multiple_of(128);
    let dq_out = DqOut {
        k_half: s.first + wg * comptime!(BLOCK_BYTES / 2),
        partial,
        map: map_dq,
        row0: stats + first * TILE,
        wg,
        storer,
    };
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
        let mut ds_frags = Frags64::zeroed();
        // A tile of queries all before this warpgroup's first key adds nothing: its dS is zero.
        if !causal || q0 + 63 >= row0 {
            let q_tile = s.sweep_a + stage * TILE_BYTES;
            let o_tile = s.sweep_b + stage * TILE_BYTES;
            // Read before the product that needs them, so the loads' latency hides under it.
            let lse_cols = column_values(lse, &l, q0, stats, seq);
            // The queries' first visible keys: their documents' (none read without documents).
            let mut first_cols = Cols::empty();
            if comptime!(documents) {
                first_cols = column_values(starts, &l, q0, batch * seq, seq);
            }
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
            // Any key may lie before its query's document.
            if comptime!(documents) {
                edge = true;
            }
            let p = if edge {
                key_probs(
                    &scores,
                    &lse_cols,
                    &first_cols,
                    &l,
                    row0,
                    q0,
                    seq,
                    scale_log2,
                    true,
                    causal,
                    documents,
                )
            } else {
                key_probs(
                    &scores,
                    &lse_cols,
                    &first_cols,
                    &l,
                    row0,
                    q0,
                    seq,
                    scale_log2,
                    false,
                    causal,
                    documents,
                )
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
            ds_frags = fragments(&ds);
            dk_acc = chain_128(&dk_acc, &ds_frags, descriptor(q_tile, comptime!(UPDATE.b)), UPDATE);
        }
        if UNIT_POS.is_multiple_of(32) {
            mbarrier_arrive(s.empty + stage * 8);
        }
        // The buffer's last tile (t − 2) multiplied by both warpgroups.
        let buffer = t % 2;
        if t >= 2 {
            mbarrier_wait(ds_empty + buffer * 8, (t / 2 - 1) & 1);
        }
        store_ds(s.scratch + buffer * DS_BYTES, &ds_frags, &l, wg);
        fence_proxy_async_shared();
        mbarrier_arrive(ds_full + buffer * 8);
        if t >= 1 {
            add_dq(&s, &dq_out, t - 1, ds_full, ds_empty, &l);
        }
    }
    if count >= 1 {
        add_dq(&s, &dq_out, count - 1, ds_full, ds_empty, &l);
    }
    if storer {
        bulk_wait();
    }
    if comptime!(unrotate) {
        store_rows_unrotated(dk, &dk_acc, scale, cos, sin, row0, head, batch, heads, seq);
    } else {
        store_rows(dk, &dk_acc, scale, scale, row0, head, batch, heads, seq, false);
    }
    store_rows(dv, &dv_acc, 1.0f32, 1.0f32, row0, head, batch, heads, seq, false);
}

/// Where a warpgroup's dQ partials go: its half of the block's k tile (the product's B), its
/// staging buffer, the sums' map, the sums' row of sweep tile 0, and whether it stores.
#[derive(CubeType, Clone, Copy)]
struct DqOut {
    k_half: u32,
    partial: u32,
    map: u64,
    row0: u32,
    wg: u32,
    storer: bool,
}

/// dQ of sweep tile `u`: once both halves of its dS are in, this warpgroup's half of the head
/// dim over the block's 128 keys, added into the sums.
#[cube]
fn add_dq(s: &Smem, out: &DqOut, u: u32, ds_full: u32, ds_empty: u32, l: &Lane) {
    let buffer = u % 2;
    mbarrier_wait(ds_full + buffer * 8, (u / 2) & 1);
    let partial_dq = chain_64(
        descriptor(s.scratch + buffer * DS_BYTES, comptime!(DQ.a_tile())),
        descriptor(out.k_half, comptime!(DQ.b)),
        DQ,
    );
    mbarrier_arrive(ds_empty + buffer * 8);
    add_partial(
        &partial_dq,
        out.partial,
        out.map,
        out.row0 + u * TILE,
        out.wg,
        out.storer,
        l,
    );
}

/// A warpgroup's 64 rows of dK (`acc`, times `factor`) through the inverse of RoPE's rotation at
/// each key's position, as bf16 pairs into `[b, s, h, 128]`: columns `j` and `j + 64` (registers
/// `i` and `i + 32` of the same thread) rotated in f32 by `cos`/`sin` (`[≥ s, 64]` f32) before
/// the one rounding. The gradient of the keys before RoPE, where a kernel of its own had read
/// and written dK again.
#[cube]
#[allow(clippy::too_many_arguments)]
fn store_rows_unrotated(
    out: &mut Tensor<u32>,
    acc: &Acc128,
    factor: f32,
    cos: &Tensor<f32>,
    sin: &Tensor<f32>,
    row0: u32,
    head: u32,
    batch: u32,
    heads: u32,
    seq: u32,
) {
    let l = lane();
    let half = comptime!(HEAD_DIM as u32 / 2);
    #[unroll]
    for pair in 0..16u32 {
        let i = comptime!(2 * pair);
        let r = row(&l, row0, i);
        if r < seq {
            let c = column(&l, 0u32, i);
            let t = r * half + c;
            let a0 = acc.extract(i as usize) * factor;
            let a1 = acc.extract(comptime!((i + 1) as usize)) * factor;
            let b0 = acc.extract(comptime!((i + 32) as usize)) * factor;
            let b1 = acc.extract(comptime!((i + 33) as usize)) * factor;
            let c0 = cos[t as usize];
            let c1 = cos[(t + 1) as usize];
            let s0 = sin[t as usize];
            let s1 = sin[(t + 1) as usize];
            // The pair index of column `c`; its partner `c + 64` is 32 pairs on.
            let at = ((batch * seq + r) * heads + head) * half + c / 2;
            out[at as usize] = pack_bf16(a0 * c0 + b0 * s0, a1 * c1 + b1 * s1);
            out[(at + half / 2) as usize] = pack_bf16(b0 * c0 - a0 * s0, b1 * c1 - a1 * s1);
        }
    }
}

/// Writes a warpgroup's 64 key rows of a dS tile (bf16 pairs, as its fragments hold them) into
/// `tile`: 128 key rows of 64 queries, 128 bytes each, with the 128-byte swizzle TMA would give
/// (16-byte chunk `c` of row `r` at chunk `c ^ (r % 8)`), so the dQ product reads it MN-major.
#[cube]
fn store_ds(tile: u32, frags: &Frags64, l: &Lane, wg: u32) {
    #[unroll]
    for pair in 0..16u32 {
        let i = comptime!(2 * pair);
        let key = row(l, wg * 64, i);
        // This pair's queries are `8 · (i / 4) + l.col + {0, 1}`: chunk `i / 4`, byte `2 · l.col`.
        let chunk = comptime!(i / 4) ^ (key % 8);
        st_shared_u32(tile + key * 128 + chunk * 16 + l.col * 2, frags.extract(pair as usize));
    }
}

/// Adds a warpgroup's 64 × 64 dQ partial into rows `row0` and columns `64 · wg` onward of the f32
/// dQ through `buffer`: two swizzled 64 × 32 boxes, each handed to a TMA reduction by `storer`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn add_partial(acc: &Acc64, buffer: u32, map: u64, row0: u32, wg: u32, storer: bool, l: &Lane) {
    // The buffer is free again once the last reduction from it has read it.
    if storer {
        bulk_wait_read();
    }
    named_barrier(2 + wg, 128u32);
    #[unroll]
    for pair in 0..16u32 {
        let i = comptime!(2 * pair);
        let r = row(l, 0u32, i);
        let c = column(l, 0u32, i);
        // Box `c / 32`, 128-byte rows of 32 f32, chunks of 4 swizzled as TMA's.
        let cc = c % 32;
        let chunk = (cc / 4) ^ (r % 8);
        st_shared_v2_f32(
            buffer + (c / 32) * comptime!(PARTIAL_BYTES / 2) + r * 128 + chunk * 16 + (cc % 4) * 4,
            acc.extract(i as usize),
            acc.extract(comptime!((i + 1) as usize)),
        );
    }
    fence_proxy_async_shared();
    named_barrier(2 + wg, 128u32);
    if storer {
        tma_reduce_add_box(map, wg * 64, row0, buffer);
        tma_reduce_add_box(map, wg * 64 + 32, row0, buffer + comptime!(PARTIAL_BYTES / 2));
        bulk_commit();
    }
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
/// `q0`, whose `lse₂` `lse_cols` holds and, with `documents`, whose first visible keys
/// `first_cols` holds); zero where masked if `mask`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn key_probs(
    scores: &Acc64,
    lse_cols: &Cols,
    first_cols: &Cols,
    l: &Lane,
    row0: u32,
    q0: u32,
    seq: u32,
    scale_log2: f32,
    #[comptime] mask: bool,
    #[comptime] causal: bool,
    #[comptime] documents: bool,
) -> Acc64 {
    let mut p = Acc64::empty();
    #[unroll]
    for i in 0..32u32 {
        let at = lse_cols.extract(comptime!(column_slot(i)) as usize);
        let mut value = exp2(scores.extract(i as usize) * scale_log2 - at);
        if comptime!(mask) {
            let key = row(l, row0, i);
            let mut out = masked(column(l, q0, i), key, seq, causal);
            if comptime!(documents) {
                out = out || f32::cast_from(key) < first_cols.extract(comptime!(column_slot(i)) as usize);
            }
            value = select(out, 0.0f32, value);
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
/// within the sixteen; also zeroes the row's dQ sums (`[b·h·s, 128]` f32). Launched with vectors
/// of [`DELTA_VECTOR`].
#[cube(launch_unchecked)]
pub(crate) fn delta_kernel<N: Size>(
    out: &Tensor<Vector<bf16, N>>,
    d_out: &Tensor<Vector<bf16, N>>,
    delta: &mut Tensor<f32>,
    sums: &mut Tensor<Vector<f32, N>>,
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
        sum = crate::cuda::reduce::hsum(product);
        // dQ's sums for this row start at zero: its 128 values, a vector a lane.
        sums[(r * DELTA_LANES) as usize + lane] = Vector::<f32, N>::new(0.0f32);
    }
    sum += plane_shuffle_xor(sum, 1u32);
    sum += plane_shuffle_xor(sum, 2u32);
    sum += plane_shuffle_xor(sum, 4u32);
    sum += plane_shuffle_xor(sum, 8u32);
    if r < delta.len() as u32 && lane == 0 {
        delta[r as usize] = sum;
    }
}

/// f32 values a thread of [`dq_out_kernel`] converts in each half of a row (two 16-byte loads,
/// one 16-byte store, each half).
pub(crate) const DQ_VECTOR: usize = 8;

/// `dq · scale` from the f32 `[b, h, s, 128]` sums the backward added into, as bf16 `[b, s, h,
/// 128]` (what the attention layer reshapes next); with `unrotate`, through the inverse of
/// RoPE's rotation at each query's position (`cos`/`sin`, `[≥ s, 64]` f32; unread without it).
/// A thread takes vector `j` of a row's first half and its partner `j + 64 / N` of the second.
/// Launched with vectors of [`DQ_VECTOR`].
#[cube(launch_unchecked)]
pub(crate) fn dq_out_kernel<N: Size>(
    sums: &Tensor<Vector<f32, N>>,
    cos: &Tensor<Vector<f32, N>>,
    sin: &Tensor<Vector<f32, N>>,
    out: &mut Tensor<Vector<bf16, N>>,
    seq: u32,
    heads: u32,
    scale: f32,
    #[comptime] unrotate: bool,
) {
    let at = ABSOLUTE_POS as u32;
    let half = comptime!((HEAD_DIM / 2 / DQ_VECTOR) as u32);
    if at < sums.len() as u32 / 2 {
        let (r, part) = (at / half, at % half);
        let (bh, pos) = (r / seq, r % seq);
        let (batch, head) = (bh / heads, bh % heads);
        let from = r * 2 * half + part;
        let to = ((batch * seq + pos) * heads + head) * 2 * half + part;
        let factor = Vector::<f32, N>::new(scale);
        let x1 = sums[from as usize] * factor;
        let x2 = sums[(from + half) as usize] * factor;
        if comptime!(unrotate) {
            let table = (pos * half + part) as usize;
            let c = cos[table];
            let s = sin[table];
            out[to as usize] = Vector::<bf16, N>::cast_from(x1 * c + x2 * s);
            out[(to + half) as usize] = Vector::<bf16, N>::cast_from(x2 * c - x1 * s);
        } else {
            out[to as usize] = Vector::<bf16, N>::cast_from(x1);
            out[(to + half) as usize] = Vector::<bf16, N>::cast_from(x2);
        }
    }
}
