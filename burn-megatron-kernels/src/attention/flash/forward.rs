//! The forward kernel: output and `lse₂`, sweeping key and value tiles.

use cubecl::prelude::*;
use cubecl_cpp::cuda::ptx::tensor_map_address;
use half::bf16;

use super::*;

/// Grid `(s / 128, h, b)`, 256 threads.
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
    let block = query_block(seq, causal);
    let (head, batch, q0, tiles) = (block.head, block.batch, block.q0, block.tiles);
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
            let scores = chain_64(
                descriptor(s.first + wg * 8192, comptime!(SCORES.a_tile())),
                descriptor(s.sweep_a + stage * TILE_BYTES, comptime!(SCORES.b)),
                SCORES,
            );
            let mut x = Acc64::empty();
            let mut tile_a = neg_inf;
            let mut tile_b = neg_inf;
            #[unroll]
            for i in 0..32u32 {
                let value = select(
                    masked(row(&l, row0, i), column(&l, k0, i), seq, causal),
                    neg_inf,
                    scores.extract(i as usize) * scale_log2,
                );
                x.insert(i as usize, value);
                if comptime!(i % 4 < 2) {
                    tile_a = max(tile_a, value)
                } else {
                    tile_b = max(tile_b, value)
                }
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
            acc = chain_128(
                &acc,
                &frags,
                descriptor(s.sweep_b + stage * TILE_BYTES, comptime!(UPDATE.b)),
                UPDATE,
            );
        }
        if UNIT_POS.is_multiple_of(32) {
            mbarrier_arrive(s.empty + stage * 8);
        }
    }

    let l_a = quad_sum(l_a);
    let l_b = quad_sum(l_b);
    let inv_a = select(l_a > 0.0f32, 1.0f32 / l_a, 0.0f32);
    let inv_b = select(l_b > 0.0f32, 1.0f32 / l_b, 0.0f32);
    store_rows(out, &acc, inv_a, inv_b, row0, head, batch, heads, seq);
    if UNIT_POS.is_multiple_of(4) {
        let at = (batch * heads + head) * seq;
        if row0 + l.row_a < seq {
            lse[(at + row0 + l.row_a) as usize] = m_a + log2(l_a);
        }
        if row0 + l.row_b < seq {
            lse[(at + row0 + l.row_b) as usize] = m_b + log2(l_b);
        }
    }
}
