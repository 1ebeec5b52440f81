//! A SwiGLU MLP's gate and up projections in one wgmma GEMM, the SwiGLU in its epilogue: each
//! block tile is 128 rows × 128 columns of both products (B's stage holds 128 columns of the gate
//! weight, then the same 128 of the up weight, so one `m64n256` accumulator holds both), and its
//! results leave three times through the consumers' staging: the gate's, the up projection's
//! (both kept for the backward), and `silu(gate) ∘ up` from the two as rounded to bf16, the
//! values the SwiGLU's own kernel computes from them. That kernel's pass (reading both products
//! and writing the result: 276 MB a llama-1b layer) is gone; the epilogue writes the result from
//! registers.

use burn_cubecl::cubecl::ir::{ElemType, FloatKind};
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use cubecl_cpp::cuda::ptx::tensor_map_address;
use half::bf16;

use super::pieces::{consume_slice, free_buffer, send_pass, stage_pass, staged_pair};
use super::*;

/// Columns of each product a block tile covers: half of B's stage.
const HALF_N: u32 = BLOCK_N / 2;
/// Three stages, so that each consumer stages its three passes a tile through two buffers in
/// turn, a pass written while the one before it is stored: with the plain GEMM's four stages
/// and one buffer, each pass waited for the last one's store to read it: 579 µs a llama-1b layer
/// under ncu, 566 this way (the two products apart take 508, the SwiGLU's kernel 86).
const GATED_STAGES: u32 = 3;
/// Both consumers' two staging buffers.
const GATED_STAGING: u32 = 4 * STAGING_BYTES;
const GATED_SMEM: u32 = GATED_STAGES * STAGE_BYTES + GATED_STAGING + 1024 + 1024;
const _: () = assert!(GATED_SMEM <= 227 * 1024);

/// `x · w_gate`, `x · w_up` and `silu(x · w_gate) ∘ (x · w_up)`, bf16, for `x` `[m, k]` and the
/// weights `[k, n]` each (as [`gemm_kernel`] reads its operands: `a_major`, `b_major`), through
/// [`GATED_STAGES`] stages.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn gated_kernel(
    a: &TensorMap<bf16, Tiled>,
    b_gate: &TensorMap<bf16, Tiled>,
    b_up: &TensorMap<bf16, Tiled>,
    gate: &mut TensorMap<bf16, Tiled>,
    up: &mut TensorMap<bf16, Tiled>,
    out: &mut TensorMap<bf16, Tiled>,
    m: u32,
    n: u32,
    k: u32,
    #[comptime] a_major: Major,
    #[comptime] b_major: Major,
) {
    let (tiles, staging, full, empty) = pipeline_smem(GATED_SMEM, GATED_STAGES, STAGE_BYTES, GATED_STAGING);
    let k_tiles = k.div_ceil(BLOCK_K);
    let (rows, columns) = (m.div_ceil(BLOCK_M), n.div_ceil(HALF_N));
    let mine = (rows * columns - CUBE_POS_X).div_ceil(CUBE_COUNT_X);
    let warpgroup = UNIT_POS / 128;
    if warpgroup == 0 {
        if UNIT_POS == 0 {
            let pipeline = comptime!(Pipeline::wide(GATED_STAGES, BLOCK_K, a_major, b_major).split());
            let maps = (
                tensor_map_address(a),
                tensor_map_address(b_gate),
                tensor_map_address(b_up),
            );
            produce(maps, tiles, full, empty, mine, k_tiles, (rows, columns), pipeline);
        }
    } else {
        let consumer = warpgroup - 1;
        let buffers = staging + consumer * 2 * STAGING_BYTES;
        let storer = UNIT_POS.is_multiple_of(128);
        let barrier = 1 + consumer;
        let maps = (store_map_address(gate), store_map_address(up), store_map_address(out));
        for i in 0..mine {
            let (row, column) = tile_position(CUBE_POS_X + i * CUBE_COUNT_X, rows, columns);
            let mut acc = Acc256::zeroed();
            for kt in 0..k_tiles {
                acc = consume_slice(
                    &acc,
                    tiles,
                    full,
                    empty,
                    i * k_tiles + kt,
                    consumer,
                    GATED_STAGES,
                    a_major,
                    b_major,
                );
            }
            let (row0, col0) = (row * BLOCK_M + consumer * 64, column * HALF_N);
            // Three passes a tile through the two buffers in turn (pass `3i + p` in buffer
            // `(3i + p) % 2`). Registers 0..63 hold the gate's 128 columns, 64..127 the up
            // projection's.
            let first = buffers + (i % 2) * STAGING_BYTES;
            let second = buffers + ((i + 1) % 2) * STAGING_BYTES;
            stage_pass(&acc, 1.0f32, first, barrier, storer, 0u32, true);
            send_pass(maps.0, col0, row0, first, barrier, storer);
            stage_pass(&acc, 1.0f32, second, barrier, storer, 1u32, true);
            send_pass(maps.1, col0, row0, second, barrier, storer);
            stage_swiglu(&acc, first, barrier, storer);
            send_pass(maps.2, col0, row0, first, barrier, storer);
        }
        if storer {
            bulk_wait();
        }
    }
}

/// [`stage_pass`]'s layout (double-buffered) for `silu(g) ∘ u`, `g` and `u` the accumulator's
/// registers `r` and `r + 64` rounded to bf16 first (what was stored of them).
#[cube]
fn stage_swiglu<N: Size>(acc: &Vector<f32, N>, buffer: u32, barrier: u32, storer: bool) {
    free_buffer(barrier, storer, true);
    #[unroll]
    for jj in 0..16u32 {
        #[unroll]
        for half in 0..2u32 {
            let addr = buffer + staged_pair(jj, half);
            let reg = comptime!((4 * jj + 2 * half) as usize);
            let g = pack_bf16(acc.extract(reg), acc.extract(reg + 1));
            let u = pack_bf16(acc.extract(reg + 64), acc.extract(reg + 65));
            st_shared_u32(
                addr,
                pack_bf16(
                    swiglu_of(f32::reinterpret(g << 16u32), f32::reinterpret(u << 16u32)),
                    swiglu_of(f32::reinterpret(g & 0xFFFF0000u32), f32::reinterpret(u & 0xFFFF0000u32)),
                ),
            );
        }
    }
}

/// `silu(g) · u` in f32, as `g/2 · (1 + tanh(g/2)) · u`: one MUFU instruction a value, where
/// σ as `1 / (1 + 2^(−g·log₂e))` took two (`ex2` and the reciprocal), which the epilogue runs
/// with the tensor cores idle: 566 → 524 µs a llama-1b layer under ncu on an H100.
#[cube]
fn swiglu_of(g: f32, u: f32) -> f32 {
    let half = g * 0.5f32;
    half * (1.0f32 + tanh_approx(half)) * u
}

/// `(silu(x · w_gate) ∘ (x · w_up), x · w_gate, x · w_up)` on the gated kernel; `None` where it
/// does not take the operands (not bf16, k no multiple of 8, the weights laid out differently
/// or of different shapes), which the caller multiplies apart.
///
/// # Shapes
/// `[m, k]`, `[k, n]` × 2 → `[m, n]` × 3
pub fn gated_gemm(x: CubeTensor, w_gate: CubeTensor, w_up: CubeTensor) -> Option<(CubeTensor, CubeTensor, CubeTensor)> {
    let bf16 = [&x, &w_gate, &w_up].iter().all(|t| t.dtype == DType::BF16);
    let (m, k) = (x.meta.shape()[0], x.meta.shape()[1]);
    let n = w_gate.meta.shape()[1];
    if !bf16 || k % 8 != 0 || w_gate.meta.shape() != w_up.meta.shape() || w_gate.meta.shape()[0] != k {
        return None;
    }
    let (a, a_major) = operand(x, true);
    let ((b_gate, b_major), (b_up, up_major)) = (operand(w_gate, false), operand(w_up, false));
    if b_major != up_major {
        return None;
    }
    let (gate, up, out) = (output(&a, m, n), output(&a, m, n), output(&a, m, n));
    let client = out.client.clone();
    let map =
        |t: CubeTensor, major: Major, rows: u32| operand_map(t, major, rows, BLOCK_K, ElemType::Float(FloatKind::BF16));
    let tiles = (m as u32).div_ceil(BLOCK_M) * (n as u32).div_ceil(HALF_N);
    let blocks = persistent_blocks(&client, tiles);
    // SAFETY: the maps cover exactly the operands and the outputs (TMA fills out-of-range boxes
    // with zeros when loading and drops their out-of-range parts when storing).
    unsafe {
        gated_kernel::launch_unchecked(
            &client,
            CubeCount::Static(blocks, 1, 1),
            CubeDim::new_1d(384),
            map(a, a_major, BLOCK_M),
            map(b_gate, b_major, HALF_N),
            map(b_up, b_major, HALF_N),
            store_map(&gate),
            store_map(&up),
            store_map(&out),
            m as u32,
            n as u32,
            k as u32,
            a_major,
            b_major,
        );
    }
    Some((out, gate, up))
}
