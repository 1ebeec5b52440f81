//! A SwiGLU MLP's down projection's data gradient with the SwiGLU's backward in its epilogue:
//! `dh = dy · w_downᵀ` is never written. Each block tile's `dh` stays in the accumulators while
//! the gate's and up projection's values for the same 128 × 256 elements come in by TMA, and
//! the tile leaves as their gradients, `dg = dh · u · σ(g)(1 + g(1 − σ(g)))` and
//! `du = dh · silu(g)`, from `dh` rounded to bf16 as the product apart would store it. That
//! product's write of `dh` and the SwiGLU backward's pass (reading `dh`, `g` and `u`, writing
//! both gradients: 460 MB a llama-1b layer) become the epilogue's reads of `g` and `u` and
//! writes of the gradients, the writes overlapped with the next tile's products. On an H100, a
//! llama-1b layer: 340 µs, where the product and the SwiGLU's backward apart took 258 + 147.
//!
//! The kernel is `super::loaded`'s, whose epilogue reads `g` and `u` and writes their gradients
//! over them. Its math runs with the tensor cores idle: 83 µs a layer over the plain product.

use burn::backend::Cube;
use burn::backend::ops::FloatTensorOps;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::loaded::{Epilogue, launch_loaded, readable};
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

/// `(dg, du)`, the gradients of `g` and `u` through `silu(g) ∘ u` and the down projection
/// `w_down`, given its output's gradient `grad`, on the fused kernel; `None` where it does not
/// take the operands (not bf16, k no multiple of 8, `g` or `u` not of `[m, n]` rows TMA reads in
/// place), which the caller computes apart.
///
/// # Shapes
/// `grad` `[m, k]`, `w_down` `[n, k]`, `g` and `u` `[m, n]` → `[m, n]` × 2
pub fn gated_dgrad(
    grad: CubeTensor,
    w_down: CubeTensor,
    gate: CubeTensor,
    up: CubeTensor,
) -> Option<(CubeTensor, CubeTensor)> {
    let (m, k) = (grad.meta.shape()[0], grad.meta.shape()[1]);
    let n = w_down.meta.shape()[0];
    let bf16 = grad.dtype == DType::BF16 && w_down.dtype == DType::BF16;
    let values_fit = readable(&gate, m, n) && readable(&up, m, n);
    if !bf16 || k == 0 || k % 8 != 0 || w_down.meta.shape()[1] != k || !values_fit {
        return None;
    }
    let mut grads = launch_loaded(
        grad,
        Cube::float_transpose(w_down),
        &[gate, up],
        Epilogue::SwigluBackward,
    );
    let d_up = grads.pop().expect("two gradients");
    Some((grads.pop().expect("two gradients"), d_up))
}
