//! A branch's last product added onto the residual stream in its epilogue: `x + a · b`, where
//! the block wrote `a · b` and a kernel of its own added it to `x` (reading both, writing the
//! sum: three passes over the stream a residual add, 0.9 ms of a llama-1b step on an H100).
//! The epilogue reads `x`'s tile by TMA while the tile is computed and leaves the sum of `x` and
//! the f32 accumulators, rounded once.

use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::loaded::{Epilogue, launch_loaded, readable};
use super::pieces::staged_pair;
use super::*;

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

/// `x + lhs · rhs` on the wgmma kernel, `x` added in its epilogue; `None` where it does not take
/// the operands (not bf16, k zero or no multiple of 8, `x` not a `[m, n]` matrix whose rows TMA
/// reads in place), which the caller computes apart.
///
/// # Shapes
/// `x` `[m, n]`, `lhs` `[m, k]`, `rhs` `[k, n]` → `[m, n]`; the operands may be transposed views.
pub fn gemm_onto(x: CubeTensor, lhs: CubeTensor, rhs: CubeTensor) -> Option<CubeTensor> {
    let (m, k) = (lhs.meta.shape()[0], lhs.meta.shape()[1]);
    let n = rhs.meta.shape()[1];
    let bf16 = lhs.dtype == DType::BF16 && rhs.dtype == DType::BF16;
    if !bf16 || k == 0 || k % 8 != 0 || rhs.meta.shape()[0] != k || !readable(&x, m, n) {
        return None;
    }
    launch_loaded(lhs, rhs, &[x], Epilogue::Added).pop()
}
