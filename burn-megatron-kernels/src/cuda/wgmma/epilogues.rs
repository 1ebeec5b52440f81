//! What the loaded epilogues compute (`super::loaded`), on a quarter of a consumer's buffer
//! from the f32 accumulators: the SwiGLU's backward for the down projection's data gradient
//! (`super::gated_dgrad`), and a residual stream plus the product (`super::onto`).

use cubecl::prelude::*;

use super::pieces::staged_pair;
use super::*;

/// Overwrites a quarter's `g` and `u` in a consumer's buffer with their gradients, from the
/// accumulator's `dh` (registers from `32 · quarter`, at [`staged_pair`]'s places: its box the
/// first for even quarters).
#[cube]
pub(crate) fn stage_grads<N: Size>(acc: &Vector<f32, N>, values: u32, #[comptime] quarter: u32) {
    let box_chunks = comptime!(8 * (quarter % 2));
    #[unroll]
    for j in 0..8u32 {
        #[unroll]
        for half in 0..2u32 {
            let at = values + staged_pair(j + box_chunks, half);
            let reg = comptime!((4 * (16 * (quarter / 2) + 8 * (quarter % 2) + j) + 2 * half) as usize);
            let dh = pack_bf16(acc.extract(reg), acc.extract(reg + 1));
            let (g, u) = (ld_shared_u32(at), ld_shared_u32(at + STAGING_BYTES));
            let (dg_lo, du_lo) = grads_of(low(g), low(u), low(dh));
            let (dg_hi, du_hi) = grads_of(high(g), high(u), high(dh));
            st_shared_u32(at, pack_bf16(dg_lo, dg_hi));
            st_shared_u32(at + STAGING_BYTES, pack_bf16(du_lo, du_hi));
        }
    }
}

/// The first bf16 of a pair, in f32.
#[cube]
fn low(pair: u32) -> f32 {
    f32::reinterpret(pair << 16u32)
}

/// The second bf16 of a pair, in f32.
#[cube]
fn high(pair: u32) -> f32 {
    f32::reinterpret(pair & 0xFFFF0000u32)
}

/// `(dg, du)` of `silu(g) · u` for its gradient `dh`, in f32; σ as `1 / (1 + 2^(−g·log₂e))`,
/// accurate in relative terms at both ends.
#[cube]
fn grads_of(g: f32, u: f32, dh: f32) -> (f32, f32) {
    let s = recip_approx(1.0f32 + exp2(g * -core::f32::consts::LOG2_E));
    let silu = g * s;
    (dh * u * (s + silu * (1.0f32 - s)), dh * silu)
}

/// Overwrites a quarter's `x` in a consumer's buffer with `x` plus the accumulators (registers
/// from `32 · quarter`, at [`staged_pair`]'s places: its box the first for even quarters).
#[cube]
pub(crate) fn stage_sum<N: Size>(acc: &Vector<f32, N>, values: u32, #[comptime] quarter: u32) {
    let box_chunks = comptime!(8 * (quarter % 2));
    #[unroll]
    for j in 0..8u32 {
        #[unroll]
        for half in 0..2u32 {
            let at = values + staged_pair(j + box_chunks, half);
            let reg = comptime!((4 * (16 * (quarter / 2) + 8 * (quarter % 2) + j) + 2 * half) as usize);
            let x = ld_shared_u32(at);
            let low = f32::reinterpret(x << 16u32) + acc.extract(reg);
            let high = f32::reinterpret(x & 0xFFFF0000u32) + acc.extract(reg + 1);
            st_shared_u32(at, pack_bf16(low, high));
        }
    }
}
