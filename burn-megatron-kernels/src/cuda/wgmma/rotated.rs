//! q's or k's projection with RoPE in its epilogue: each 128 columns of the product a head,
//! rotated for its row's position before it leaves, where RoPE's own kernel read the product
//! and wrote it again (0.7 ms of a llama-1b step on an H100 for q and k). A head is one of the
//! consumer's two 128-column passes, and a thread holds both halves of each pair it rotates:
//! column `c` and `c + 64` of a pass are registers 32 apart (`hopper`'s accumulator layout).

use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::pieces::{free_buffer, staged_pair};
use super::*;

/// A head's columns: a pass of the epilogue.
pub(crate) const HEAD_DIM: usize = 128;

/// This thread's values of a `[≥ seq, 64]` table for a consumer's 64 rows from `row0`: for each
/// of its two rows (`half`), position `row % seq`, the frequencies `8 · jj + 2 · (lane % 4)` and
/// the next, at `16 · half + 2 · jj` (+ 1). Loaded as a tile starts, so they arrive while it is
/// computed: +9.2 µs a llama-1b q or k product on an H100 over the plain one,
/// where loaded after, each pass waiting for them, +17.5.
#[cube]
pub(crate) fn table_values(table: &Tensor<f32>, row0: u32, seq: u32) -> Acc64 {
    let lane = UNIT_POS % 32;
    let row = row0 + ((UNIT_POS % 128) / 32) * 16 + lane / 4;
    let mut values = Acc64::zeroed();
    #[unroll]
    for half in 0..2u32 {
        let at = ((row + 8 * half) % seq) * 64 + 2 * (lane % 4);
        #[unroll]
        for jj in 0..8u32 {
            let slot = comptime!((16 * half + 2 * jj) as usize);
            let f = (at + 8 * jj) as usize;
            values.insert(slot, table[f]);
            values.insert(slot + 1, table[f + 1]);
        }
    }
    values
}

/// Writes a pass's 128 columns (one head) of a consumer warpgroup's results into its staging
/// `buffer` rotated as [`crate::rope`] rotates: `(x₁, x₂) → (x₁cos − x₂sin, x₂cos + x₁sin)` for
/// the halves `x₁ = c`, `x₂ = c + 64` and this thread's table values ([`table_values`]), in f32
/// from the accumulators, rounded once.
#[cube]
pub(crate) fn stage_rotated<N: Size>(
    acc: &Vector<f32, N>,
    cos: &Acc64,
    sin: &Acc64,
    buffer: u32,
    barrier: u32,
    storer: bool,
    #[comptime] pass: u32,
) {
    free_buffer(barrier, storer, false);
    #[unroll]
    for half in 0..2u32 {
        #[unroll]
        for jj in 0..8u32 {
            let first = comptime!((4 * (16 * pass + jj) + 2 * half) as usize);
            let second = comptime!(first + 32);
            let slot = comptime!((16 * half + 2 * jj) as usize);
            let (c0, c1) = (cos.extract(slot), cos.extract(slot + 1));
            let (s0, s1) = (sin.extract(slot), sin.extract(slot + 1));
            let (x0, x1) = (acc.extract(first), acc.extract(first + 1));
            let (y0, y1) = (acc.extract(second), acc.extract(second + 1));
            st_shared_u32(
                buffer + staged_pair(jj, half),
                pack_bf16(x0 * c0 - y0 * s0, x1 * c1 - y1 * s1),
            );
            st_shared_u32(
                buffer + staged_pair(jj + 8, half),
                pack_bf16(y0 * c0 + x0 * s0, y1 * c1 + x1 * s1),
            );
        }
    }
}

/// `lhs · rhs` on the wgmma kernel with each head of its `[m, n]` result rotated by RoPE for
/// position `row % seq` (rows `[b, s]` flattened) as it leaves: the `[b, s, n]` product whose
/// `[b, n/128, s, 128]` heads [`crate::rope`] would rotate. `None` where it does not take the
/// operands (not bf16, k zero or no multiple of 8, heads of another size than 128, `m` no
/// multiple of `seq`, tables that are not `[≥ seq, 64]` f32), which the caller computes apart.
///
/// # Shapes
/// `[m, k]`, `[k, n]`, `[≥ seq, 64]` × 2 → `[m, n]`; the operands may be transposed views.
pub fn gemm_rotated(
    lhs: CubeTensor,
    rhs: CubeTensor,
    cos: CubeTensor,
    sin: CubeTensor,
    seq: usize,
) -> Option<CubeTensor> {
    let (m, k) = (lhs.meta.shape()[0], lhs.meta.shape()[1]);
    let n = rhs.meta.shape()[1];
    let bf16 = lhs.dtype == DType::BF16 && rhs.dtype == DType::BF16;
    let table = |t: &CubeTensor| {
        let shape = t.meta.shape();
        t.dtype == DType::F32 && shape.len() == 2 && shape[0] >= seq && shape[1] == HEAD_DIM / 2
    };
    let aligned = k > 0 && k.is_multiple_of(8) && rhs.meta.shape()[0] == k;
    if !bf16
        || !aligned
        || !n.is_multiple_of(HEAD_DIM)
        || seq == 0
        || !m.is_multiple_of(seq)
        || !table(&cos)
        || !table(&sin)
    {
        return None;
    }
    let (a, a_major) = operand(lhs, true);
    let (b, b_major) = operand(rhs, false);
    let rotation = Rotation {
        cos: into_contiguous(cos),
        sin: into_contiguous(sin),
        seq,
    };
    Some(launch(
        [(a, a_major), (b, b_major)],
        [m, n, k],
        Operands::Bf16,
        None,
        Schedule::Persistent,
        Some(rotation),
    ))
}
