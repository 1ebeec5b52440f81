//! A branch's last product added onto the residual stream in its epilogue: `x + a · b`, where
//! the block wrote `a · b` and a kernel of its own added it to `x` (reading both, writing the
//! sum: three passes over the stream a residual add, 0.9 ms of a llama-1b step on an H100).
//! The epilogue reads `x`'s tile by TMA while the tile is computed and leaves the sum of `x` and
//! the f32 accumulators, rounded once.

use burn_cubecl::tensor::CubeTensor;

use super::loaded::{Epilogue, launch_loaded, readable};
use super::*;

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
