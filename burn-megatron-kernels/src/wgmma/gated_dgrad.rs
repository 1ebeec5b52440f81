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
//! A consumer's 64 × 256 results leave in two passes of 128 columns through one buffer of the
//! pass's `g` and `u` (two swizzled 64 × 64 boxes each): the gradients are written over the
//! values they come from and stored from there. The first pass's values load while the tile is
//! computed; the second's once the first's stores have read the buffer (bringing them into L2
//! during the tile instead measured slower: 345 → 368 µs). The epilogue's math runs with the
//! tensor cores idle: 83 µs a layer over the plain product.

use burn::backend::Cube;
use burn::backend::ops::FloatTensorOps;
use burn_cubecl::cubecl::ir::{ElemType, FloatKind};
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use cubecl_cpp::cuda::ptx::tensor_map_address;
use half::bf16;

use super::pieces::{consume_slice, staged_pair};
use super::*;

/// Three stages: a fourth (48 KiB) would not leave the two consumers' buffers room.
const DGRAD_STAGES: u32 = 3;
/// A consumer's pass: 64 rows × 128 columns of `g`, then of `u`.
const PASS_BYTES: u32 = 2 * STAGING_BYTES;
const DGRAD_STAGING: u32 = 2 * PASS_BYTES;
const DGRAD_SMEM: u32 = DGRAD_STAGES * STAGE_BYTES + DGRAD_STAGING + 1024 + 1024;
const _: () = assert!(DGRAD_SMEM <= 227 * 1024);

/// `silu(g) ∘ u`'s input gradients for the output gradient `dy · w_downᵀ`: `dy` `[m, k]`, the
/// down weight as B `[k, n]` (read as `a_major`, `b_major`), `g` and `u` `[m, n]`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn gated_dgrad_kernel(
    a: &TensorMap<bf16, Tiled>,
    b: &TensorMap<bf16, Tiled>,
    gate: &TensorMap<bf16, Tiled>,
    up: &TensorMap<bf16, Tiled>,
    d_gate: &mut TensorMap<bf16, Tiled>,
    d_up: &mut TensorMap<bf16, Tiled>,
    m: u32,
    n: u32,
    k: u32,
    #[comptime] a_major: Major,
    #[comptime] b_major: Major,
) {
    let (tiles, staging, full, empty) = pipeline_smem(DGRAD_SMEM, DGRAD_STAGES, STAGE_BYTES, DGRAD_STAGING);
    // Each consumer's "pass loaded" barrier, after the stages' (the 1 KiB the layout keeps for
    // barriers holds them).
    let loaded = empty + DGRAD_STAGES * 8;
    if UNIT_POS == 0 {
        mbarrier_init(loaded, 1u32);
        mbarrier_init(loaded + 8, 1u32);
        mbarrier_init_fence();
    }
    sync_cube();
    let k_tiles = k.div_ceil(BLOCK_K);
    let (rows, columns) = (m.div_ceil(BLOCK_M), n.div_ceil(BLOCK_N));
    let mine = (rows * columns - CUBE_POS_X).div_ceil(CUBE_COUNT_X);
    let warpgroup = UNIT_POS / 128;
    if warpgroup == 0 {
        if UNIT_POS == 0 {
            let pipeline = comptime!(Pipeline::wide(DGRAD_STAGES, BLOCK_K, a_major, b_major));
            let b = tensor_map_address(b);
            let maps = (tensor_map_address(a), b, b);
            produce(maps, tiles, full, empty, mine, k_tiles, (rows, columns), pipeline);
        }
    } else {
        let consumer = warpgroup - 1;
        let values = staging + consumer * PASS_BYTES;
        let bar = loaded + consumer * 8;
        let storer = UNIT_POS.is_multiple_of(128);
        let barrier = 1 + consumer;
        let sources = (tensor_map_address(gate), tensor_map_address(up));
        let targets = (store_map_address(d_gate), store_map_address(d_up));
        for i in 0..mine {
            let (row, column) = tile_position(CUBE_POS_X + i * CUBE_COUNT_X, rows, columns);
            let (row0, col0) = (row * BLOCK_M + consumer * 64, column * BLOCK_N);
            let mut acc = Acc256::zeroed();
            for kt in 0..k_tiles {
                acc = consume_slice(
                    &acc,
                    tiles,
                    full,
                    empty,
                    i * k_tiles + kt,
                    consumer,
                    DGRAD_STAGES,
                    a_major,
                    b_major,
                );
                // After a slice the last tile's stores have long read the buffer: the first
                // pass's values load while this tile is computed.
                if kt == 0 && storer {
                    load_pass(sources, values, bar, col0, row0);
                }
            }
            // Two loads a tile: the first pass's phase is even, the second's odd.
            mbarrier_wait(bar, 0u32);
            stage_grads(&acc, values, 0u32);
            send_grads(targets, col0, row0, values, barrier, storer);
            if storer {
                load_pass(sources, values, bar, col0 + 128, row0);
            }
            mbarrier_wait(bar, 1u32);
            stage_grads(&acc, values, 1u32);
            send_grads(targets, col0 + 128, row0, values, barrier, storer);
        }
        if storer {
            bulk_wait();
        }
    }
}

/// Loads the 64 × 128 boxes of `g` and `u` at `(row0, col0)` into a consumer's buffer, counted
/// on `bar`, once this thread's stores from it have read it.
#[cube]
fn load_pass(maps: (u64, u64), values: u32, bar: u32, col0: u32, row0: u32) {
    bulk_wait_read();
    mbarrier_expect(bar, comptime!(PASS_BYTES));
    tma_load_2d(values, maps.0, col0, row0, bar);
    tma_load_2d(values + 8192, maps.0, col0 + 64, row0, bar);
    tma_load_2d(values + STAGING_BYTES, maps.1, col0, row0, bar);
    tma_load_2d(values + STAGING_BYTES + 8192, maps.1, col0 + 64, row0, bar);
}

/// Overwrites a pass's `g` and `u` in a consumer's buffer with their gradients, from the
/// accumulator's `dh` (registers from `64 · pass`, at [`staged_pair`]'s places).
#[cube]
fn stage_grads<N: Size>(acc: &Vector<f32, N>, values: u32, #[comptime] pass: u32) {
    #[unroll]
    for jj in 0..16u32 {
        #[unroll]
        for half in 0..2u32 {
            let at = values + staged_pair(jj, half);
            let reg = comptime!((4 * (16 * pass + jj) + 2 * half) as usize);
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

/// Hands a pass's two gradients to TMA (`storer`), to `(row0, col0)` of each, once the whole
/// warpgroup has written them.
#[cube]
fn send_grads(maps: (u64, u64), col0: u32, row0: u32, values: u32, barrier: u32, storer: bool) {
    fence_proxy_async_shared();
    named_barrier(barrier, 128u32);
    if storer {
        tma_store_box(maps.0, col0, row0, values);
        tma_store_box(maps.0, col0 + 64, row0, values + 8192);
        tma_store_box(maps.1, col0, row0, values + STAGING_BYTES);
        tma_store_box(maps.1, col0 + 64, row0, values + STAGING_BYTES + 8192);
        bulk_commit();
    }
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
    let bf16 = [&grad, &w_down, &gate, &up].iter().all(|t| t.dtype == DType::BF16);
    let (m, k) = (grad.meta.shape()[0], grad.meta.shape()[1]);
    let n = w_down.meta.shape()[0];
    let values_fit = [&gate, &up].iter().all(|t| {
        let shape = t.meta.shape();
        shape.len() == 2 && shape[0] == m && shape[1] == n && tma_rows(t)
    });
    if !bf16 || k == 0 || k % 8 != 0 || w_down.meta.shape()[1] != k || !values_fit {
        return None;
    }
    let (a, a_major) = operand(grad, true);
    let (b, b_major) = operand(Cube::float_transpose(w_down), false);
    let (d_gate, d_up) = (output(&a, m, n), output(&a, m, n));
    let client = d_gate.client.clone();
    let elem = ElemType::Float(FloatKind::BF16);
    let tiles = (m as u32).div_ceil(BLOCK_M) * (n as u32).div_ceil(BLOCK_N);
    let blocks = persistent_blocks(&client, tiles);
    // SAFETY: the maps cover exactly the operands, the values and the outputs (TMA fills
    // out-of-range boxes with zeros when loading and drops their out-of-range parts when
    // storing); k > 0, so every tile loads both passes it waits for.
    unsafe {
        gated_dgrad_kernel::launch_unchecked(
            &client,
            CubeCount::Static(blocks, 1, 1),
            CubeDim::new_1d(384),
            operand_map(a, a_major, BLOCK_M, BLOCK_K, elem),
            operand_map(b, b_major, BLOCK_N, BLOCK_K, elem),
            store_map(&gate),
            store_map(&up),
            store_map(&d_gate),
            store_map(&d_up),
            m as u32,
            n as u32,
            k as u32,
            a_major,
            b_major,
        );
    }
    Some((d_gate, d_up))
}
