//! Flash attention on Hopper for head dim 128, bf16: the forward, and the backward as two
//! kernels (dQ sweeping kv tiles, dK/dV sweeping q tiles), so neither needs atomics. Scores
//! and probabilities live in registers only: no O(s²) memory.
//!
//! A block owns 128 rows (two warpgroups of 64) of the tensor it writes and sweeps 64-row tiles
//! of the others through a 2-stage TMA pipeline (thread 0 issues the copies one tile ahead).
//! Every product is a `wgmma` chain ([`crate::hopper`]): scores as `m64n64` over the 128-deep
//! head dim, the updates as `m64n128` with the probabilities (or their gradients) as the A
//! operand straight from registers. Softmax runs in base 2 on `scale · log2(e)`-scaled scores;
//! the forward saves `lse₂`, each row's log₂-sum-exp₂, for the backward.
//!
//! Tensors: q, k, v, o, dO are `[b, h, s, 128]` views with a contiguous head dim; outputs are
//! written as `[b, s, h, 128]` (what the attention layer reshapes next); `lse₂` and
//! `delta = rowsum(dO ∘ O)` are `[b, h, s]` f32.

use cubecl::prelude::*;
use cubecl_cpp::cuda::ptx::{generic_to_shared, tensor_map_address};
use half::bf16;

use crate::hopper::*;

/// The head dim these kernels take.
pub const HEAD_DIM: usize = 128;
/// Rows a block owns: two warpgroups of 64.
const BLOCK: u32 = 128;
/// Rows of the tiles a block sweeps.
const TILE: u32 = 64;
const BLOCK_BYTES: u32 = BLOCK * 256;
const TILE_BYTES: u32 = TILE * 256;
/// Two block tiles, two stages of two sweep tiles, 64 bytes of barriers, 1 KiB to align.
const SMEM_BYTES: u32 = 2 * BLOCK_BYTES + 4 * TILE_BYTES + 64 + 1024;
/// One arrival per warp frees a stage.
const WARPS: u32 = 8;

/// Scores `A·Bᵀ` of a warpgroup's 64 block rows against a 64-row sweep tile, over the head dim.
const SCORES: Chain = Chain {
    n: 64,
    steps: 8,
    accumulate: false,
    a: ASource::Smem(Tile::KMajor { rows: BLOCK }),
    b: Tile::KMajor { rows: TILE },
};
/// `acc + P·B`: P (64 × 64, registers) times a sweep tile read MN-major (rows are the k).
const UPDATE: Chain = Chain {
    n: 128,
    steps: 4,
    accumulate: true,
    a: ASource::Registers,
    b: Tile::MnMajor { box_bytes: TILE * 128 },
};

/// Shared-memory addresses of one kernel's tiles and barriers.
#[derive(CubeType, Clone, Copy)]
struct Smem {
    /// The block's two 128-row tiles.
    first: u32,
    second: u32,
    /// Stage 0 of the two sweep tiles (stage 1 follows each by `TILE_BYTES`).
    sweep_a: u32,
    sweep_b: u32,
    /// Barriers: block tiles loaded; sweep stage loaded (2); sweep stage free (2).
    block_full: u32,
    full: u32,
    empty: u32,
}

#[cube]
fn smem() -> Smem {
    let raw = Shared::<[u32]>::new_aligned_slice(comptime!((SMEM_BYTES / 4) as usize), 1024usize);
    let first = (generic_to_shared::<u32>(raw.as_ptr()) + 1023) & !1023u32;
    let second = first + BLOCK_BYTES;
    let sweep_a = second + BLOCK_BYTES;
    let sweep_b = sweep_a + 2 * TILE_BYTES;
    let block_full = sweep_b + 2 * TILE_BYTES;
    let smem = Smem { first, second, sweep_a, sweep_b, block_full, full: block_full + 8, empty: block_full + 24 };
    if UNIT_POS == 0 {
        mbarrier_init(smem.block_full, 1u32);
        #[unroll]
        for s in 0..2u32 {
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
fn load_sweep(s: &Smem, a: u64, b: u64, t: u32, row0: u32, head: u32, batch: u32) {
    if UNIT_POS == 0 {
        let stage = t % 2;
        if t >= 2 {
            mbarrier_wait(s.empty + stage * 8, (t / 2 - 1) & 1);
        }
        let bar = s.full + stage * 8;
        mbarrier_expect(bar, 2 * TILE_BYTES);
        load_rows(s.sweep_a + stage * TILE_BYTES, a, row0, head, batch, bar, TILE);
        load_rows(s.sweep_b + stage * TILE_BYTES, b, row0, head, batch, bar, TILE);
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
    Lane { row_a, row_b: row_a + 8, col: 2 * (lane % 4) }
}

/// The column of accumulator register `i`, from the tile's first column `col0`.
#[cube]
fn column(l: &Lane, col0: u32, #[comptime] i: u32) -> u32 {
    col0 + l.col + comptime!((i / 4) * 8 + i % 2)
}

/// The absolute row of accumulator register `i`.
#[cube]
fn row(l: &Lane, row0: u32, #[comptime] i: u32) -> u32 {
    if comptime!(i % 4 < 2) { row0 + l.row_a } else { row0 + l.row_b }
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

/// A 64 × 64 f32 accumulator as the bf16 A operand of the next product (pair `t` is register
/// `t` of the fragments: see `hopper`'s module docs).
#[cube]
fn fragments(p: &Acc64) -> Frags64 {
    let mut frags = Frags64::empty();
    #[unroll]
    for t in 0..16u32 {
        frags.insert(t as usize, pack_bf16(p.extract((2 * t) as usize), p.extract((2 * t + 1) as usize)));
    }
    frags
}

/// Whether (query `q`, key `k`) is outside the attention pattern.
#[cube]
fn masked(q: u32, k: u32, seq: u32, #[comptime] causal: bool) -> bool {
    let out = q >= seq || k >= seq;
    if comptime!(causal) { out || k > q } else { out }
}

/// Writes a warpgroup's 64 × 128 result `acc · factor` into `[b, s, h, 128]` rows from `row0`.
#[cube]
fn store_rows(out: &mut Tensor<bf16>, acc: &Acc128, factor_a: f32, factor_b: f32, row0: u32, head: u32, batch: u32, heads: u32, seq: u32) {
    let l = lane();
    #[unroll]
    for i in 0..64u32 {
        let r = row(&l, row0, i);
        let factor = if comptime!(i % 4 < 2) { factor_a } else { factor_b };
        if r < seq {
            let at = ((batch * seq + r) * heads + head) as usize * HEAD_DIM + column(&l, 0u32, i) as usize;
            out[at] = bf16::cast_from(acc.extract(i as usize) * factor);
        }
    }
}

#[cube]
fn scale_rows(acc: &mut Acc128, a: f32, b: f32) {
    #[unroll]
    for i in 0..64u32 {
        let factor = if comptime!(i % 4 < 2) { a } else { b };
        acc.insert(i as usize, acc.extract(i as usize) * factor);
    }
}

/// Grid `(s / 128, h, b)`, 256 threads. Blocks run heaviest first under the causal mask.
#[cube(launch_unchecked)]
pub(crate) fn forward_kernel(
    q: &TensorMap<bf16, Tiled>,
    k: &TensorMap<bf16, Tiled>,
    v: &TensorMap<bf16, Tiled>,
    out: &mut Tensor<bf16>,
    lse: &mut Tensor<f32>,
    seq: u32,
    heads: u32,
    scale_log2: f32,
    #[comptime] causal: bool,
) {
    let s = smem();
    let head = CUBE_POS_Y;
    let batch = CUBE_POS_Z;
    let q0 = (seq.div_ceil(BLOCK) - 1 - CUBE_POS_X) * BLOCK;
    let end = if comptime!(causal) { min(q0 + BLOCK, seq) } else { seq };
    let tiles = end.div_ceil(TILE);
    let map_q = tensor_map_address(q);
    let map_k = tensor_map_address(k);
    let map_v = tensor_map_address(v);
    load_block(&s, map_q, map_q, q0, head, batch, false);
    if tiles > 0 {
        load_sweep(&s, map_k, map_v, 0, 0, head, batch);
    }

    let wg = UNIT_POS / 128;
    let row0 = q0 + wg * 64;
    let l = lane();
    let neg_inf = f32::new(f32::NEG_INFINITY);
    let mut m_a = neg_inf;
    let mut m_b = neg_inf;
    let mut l_a = 0.0f32;
    let mut l_b = 0.0f32;
    let mut acc = Acc128::zeroed();
    mbarrier_wait(s.block_full, 0);
    for t in 0..tiles {
        if t + 1 < tiles {
            load_sweep(&s, map_k, map_v, t + 1, (t + 1) * TILE, head, batch);
        }
        let stage = t % 2;
        mbarrier_wait(s.full + stage * 8, (t / 2) & 1);
        let k0 = t * TILE;
        // A tile wholly above this warpgroup's diagonal adds nothing.
        if !causal || k0 <= row0 + 63 {
            let scores = chain_64(descriptor(s.first + wg * 8192, comptime!(SCORES.a_tile())), descriptor(s.sweep_a + stage * TILE_BYTES, comptime!(SCORES.b)), SCORES);
            let mut x = Acc64::empty();
            let mut tile_a = neg_inf;
            let mut tile_b = neg_inf;
            #[unroll]
            for i in 0..32u32 {
                let value = select(masked(row(&l, row0, i), column(&l, k0, i), seq, causal), neg_inf, scores.extract(i as usize) * scale_log2);
                x.insert(i as usize, value);
                if comptime!(i % 4 < 2) { tile_a = max(tile_a, value) } else { tile_b = max(tile_b, value) }
            }
            let new_a = max(m_a, quad_max(tile_a));
            let new_b = max(m_b, quad_max(tile_b));
            // A row with nothing unmasked yet keeps a zero base, so exp2(-inf - base) = 0.
            let base_a = select(new_a == neg_inf, 0.0f32, new_a);
            let base_b = select(new_b == neg_inf, 0.0f32, new_b);
            let alpha_a = exp2(m_a - base_a);
            let alpha_b = exp2(m_b - base_b);
            m_a = new_a;
            m_b = new_b;
            let mut sum_a = 0.0f32;
            let mut sum_b = 0.0f32;
            #[unroll]
            for i in 0..32u32 {
                let p = exp2(x.extract(i as usize) - if comptime!(i % 4 < 2) { base_a } else { base_b });
                x.insert(i as usize, p);
                if comptime!(i % 4 < 2) { sum_a += p } else { sum_b += p }
            }
            l_a = l_a * alpha_a + sum_a;
            l_b = l_b * alpha_b + sum_b;
            scale_rows(&mut acc, alpha_a, alpha_b);
            let frags = fragments(&x);
            acc = chain_128(&acc, &frags, descriptor(s.sweep_b + stage * TILE_BYTES, comptime!(UPDATE.b)), UPDATE);
        }
        if UNIT_POS % 32 == 0 {
            mbarrier_arrive(s.empty + stage * 8);
        }
    }

    let l_a = quad_sum(l_a);
    let l_b = quad_sum(l_b);
    let inv_a = select(l_a > 0.0f32, 1.0f32 / l_a, 0.0f32);
    let inv_b = select(l_b > 0.0f32, 1.0f32 / l_b, 0.0f32);
    store_rows(out, &acc, inv_a, inv_b, row0, head, batch, heads, seq);
    if UNIT_POS % 4 == 0 {
        let at = (batch * heads + head) * seq;
        if row0 + l.row_a < seq {
            lse[(at + row0 + l.row_a) as usize] = m_a + log2(l_a);
        }
        if row0 + l.row_b < seq {
            lse[(at + row0 + l.row_b) as usize] = m_b + log2(l_b);
        }
    }
}

/// dQ: grid `(s / 128, h, b)`, 256 threads; sweeps the k and v tiles.
#[cube(launch_unchecked)]
pub(crate) fn dq_kernel(
    q: &TensorMap<bf16, Tiled>,
    d_out: &TensorMap<bf16, Tiled>,
    k: &TensorMap<bf16, Tiled>,
    v: &TensorMap<bf16, Tiled>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dq: &mut Tensor<bf16>,
    seq: u32,
    heads: u32,
    scale_log2: f32,
    scale: f32,
    #[comptime] causal: bool,
) {
    let s = smem();
    let head = CUBE_POS_Y;
    let batch = CUBE_POS_Z;
    let q0 = (seq.div_ceil(BLOCK) - 1 - CUBE_POS_X) * BLOCK;
    let end = if comptime!(causal) { min(q0 + BLOCK, seq) } else { seq };
    let tiles = end.div_ceil(TILE);
    let map_q = tensor_map_address(q);
    let map_o = tensor_map_address(d_out);
    let map_k = tensor_map_address(k);
    let map_v = tensor_map_address(v);
    load_block(&s, map_q, map_o, q0, head, batch, true);
    if tiles > 0 {
        load_sweep(&s, map_k, map_v, 0, 0, head, batch);
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
            load_sweep(&s, map_k, map_v, t + 1, (t + 1) * TILE, head, batch);
        }
        let stage = t % 2;
        mbarrier_wait(s.full + stage * 8, (t / 2) & 1);
        let k0 = t * TILE;
        if !causal || k0 <= row0 + 63 {
            let k_tile = s.sweep_a + stage * TILE_BYTES;
            let scores = chain_64(descriptor(s.first + wg * 8192, comptime!(SCORES.a_tile())), descriptor(k_tile, comptime!(SCORES.b)), SCORES);
            let d_probs = chain_64(descriptor(s.second + wg * 8192, comptime!(SCORES.a_tile())), descriptor(s.sweep_b + stage * TILE_BYTES, comptime!(SCORES.b)), SCORES);
            let mut ds = Acc64::empty();
            #[unroll]
            for i in 0..32u32 {
                let upper = comptime!(i % 4 < 2);
                let p = exp2(scores.extract(i as usize) * scale_log2 - if upper { lse_a } else { lse_b });
                let p = select(masked(row(&l, row0, i), column(&l, k0, i), seq, causal), 0.0f32, p);
                ds.insert(i as usize, p * (d_probs.extract(i as usize) - if upper { delta_a } else { delta_b }));
            }
            let frags = fragments(&ds);
            acc = chain_128(&acc, &frags, descriptor(k_tile, comptime!(UPDATE.b)), UPDATE);
        }
        if UNIT_POS % 32 == 0 {
            mbarrier_arrive(s.empty + stage * 8);
        }
    }
    store_rows(dq, &acc, scale, scale, row0, head, batch, heads, seq);
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
    dk: &mut Tensor<bf16>,
    dv: &mut Tensor<bf16>,
    seq: u32,
    heads: u32,
    scale_log2: f32,
    scale: f32,
    #[comptime] causal: bool,
) {
    let s = smem();
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
        load_sweep(&s, map_q, map_o, 0, first * TILE, head, batch);
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
            load_sweep(&s, map_q, map_o, t + 1, (first + t + 1) * TILE, head, batch);
        }
        let stage = t % 2;
        mbarrier_wait(s.full + stage * 8, (t / 2) & 1);
        let q0 = (first + t) * TILE;
        // A tile of queries all before this warpgroup's first key adds nothing.
        if !causal || q0 + 63 >= row0 {
            let q_tile = s.sweep_a + stage * TILE_BYTES;
            let o_tile = s.sweep_b + stage * TILE_BYTES;
            let scores = chain_64(descriptor(s.first + wg * 8192, comptime!(SCORES.a_tile())), descriptor(q_tile, comptime!(SCORES.b)), SCORES);
            let mut p = Acc64::empty();
            #[unroll]
            for i in 0..32u32 {
                let query = column(&l, q0, i);
                let out = masked(query, row(&l, row0, i), seq, causal);
                let at = (stats + min(query, seq - 1)) as usize;
                p.insert(i as usize, select(out, 0.0f32, exp2(scores.extract(i as usize) * scale_log2 - lse[at])));
            }
            let frags = fragments(&p);
            dv_acc = chain_128(&dv_acc, &frags, descriptor(o_tile, comptime!(UPDATE.b)), UPDATE);
            let d_probs = chain_64(descriptor(s.second + wg * 8192, comptime!(SCORES.a_tile())), descriptor(o_tile, comptime!(SCORES.b)), SCORES);
            let mut ds = Acc64::empty();
            #[unroll]
            for i in 0..32u32 {
                let at = (stats + min(column(&l, q0, i), seq - 1)) as usize;
                ds.insert(i as usize, p.extract(i as usize) * (d_probs.extract(i as usize) - delta[at]));
            }
            let frags = fragments(&ds);
            dk_acc = chain_128(&dk_acc, &frags, descriptor(q_tile, comptime!(UPDATE.b)), UPDATE);
        }
        if UNIT_POS % 32 == 0 {
            mbarrier_arrive(s.empty + stage * 8);
        }
    }
    store_rows(dk, &dk_acc, scale, scale, row0, head, batch, heads, seq);
    store_rows(dv, &dv_acc, 1.0f32, 1.0f32, row0, head, batch, heads, seq);
}

/// `delta = rowsum(dO ∘ O)` in f32, one thread a row of the `[b, h, s, 128]` views (any
/// strides, head dim contiguous), into a compact `[b, h, s]`.
#[cube(launch_unchecked)]
pub(crate) fn delta_kernel(out: &Tensor<bf16>, d_out: &Tensor<bf16>, delta: &mut Tensor<f32>, seq: u32, heads: u32) {
    let r = ABSOLUTE_POS as u32;
    if r < delta.len() as u32 {
        let batch = (r / (heads * seq)) as usize;
        let head = ((r / seq) % heads) as usize;
        let pos = (r % seq) as usize;
        let o = batch * out.stride(0) + head * out.stride(1) + pos * out.stride(2);
        let g = batch * d_out.stride(0) + head * d_out.stride(1) + pos * d_out.stride(2);
        let mut sum = 0.0f32;
        for i in 0..HEAD_DIM {
            sum += f32::cast_from(out[o + i]) * f32::cast_from(d_out[g + i]);
        }
        delta[r as usize] = sum;
    }
}
