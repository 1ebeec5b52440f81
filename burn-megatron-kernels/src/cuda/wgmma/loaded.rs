//! The wgmma GEMM whose epilogue reads values of the output's shape by TMA and writes what it
//! computes from them and the accumulators ([`Epilogue`]): the SwiGLU's backward in the down
//! projection's data gradient (`super::gated_dgrad`), a residual stream added to a branch's last
//! product (`super::onto`). Either way a product's result is never written and read again.
//!
//! A consumer's 64 × 256 results leave in four quarters of 64 columns through one buffer of two
//! swizzled 64 × 64 boxes a tensor, the quarters taking the boxes in turn: each quarter's results
//! are written over the values they come from and stored from there. The first two quarters'
//! values load while the tile is computed; the third's into the first box as soon as the first
//! quarter's stores have read it, while the second quarter is computed, and the fourth's into
//! the second box likewise. (Two passes of 128 columns, the second's values loaded once the
//! first's stores had read the whole buffer, left that load's latency exposed: the gated data
//! gradient of a llama-1b layer 340.6 µs where the quarters take 335.0 on an H100;
//! the products onto the stream the same within the cards' spread. Bringing
//! the values into L2 during the tile measured slower: 345 → 368 µs.)

use burn_cubecl::cubecl::ir::{ElemType, FloatKind};
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use cubecl_cpp::cuda::ptx::tensor_map_address;
use half::bf16;

use super::pieces::consume_slice;
use super::*;

/// What the epilogue reads and writes, each a bf16 tensor of the output's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Epilogue {
    /// Reads `g` and `u`, writes `dg` and `du` of `silu(g) ∘ u` for the accumulators' gradient.
    SwigluBackward,
    /// Reads `x`, writes `x` plus the accumulators.
    Added,
}

impl Epilogue {
    /// Tensors read, as many as written.
    pub(crate) const fn tensors(self) -> u32 {
        match self {
            Epilogue::SwigluBackward => 2,
            Epilogue::Added => 1,
        }
    }

    /// A consumer's buffer: two boxes of 64 rows × 64 columns of each tensor read.
    const fn pass_bytes(self) -> u32 {
        self.tensors() * STAGING_BYTES
    }

    /// As many stages as leave the two consumers' buffers room: three with two tensors, the
    /// plain GEMM's four with one.
    const fn stages(self) -> u32 {
        (227 * 1024 - 2 * self.pass_bytes() - 2048) / STAGE_BYTES
    }

    const fn smem_bytes(self) -> u32 {
        self.stages() * STAGE_BYTES + 2 * self.pass_bytes() + 1024 + 1024
    }
}

const _: () = assert!(Epilogue::SwigluBackward.stages() == 3 && Epilogue::Added.stages() == 4);

/// `A · B` (`a` `[m, k]`, `b` `[k, n]`, read as `a_major`, `b_major`) through `epilogue`: it
/// reads `inputs` and writes `outputs`, each `[m, n]` (the second of each unread and unwritten
/// where the epilogue takes one).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn loaded_kernel(
    a: &TensorMap<bf16, Tiled>,
    b: &TensorMap<bf16, Tiled>,
    input_0: &TensorMap<bf16, Tiled>,
    input_1: &TensorMap<bf16, Tiled>,
    output_0: &mut TensorMap<bf16, Tiled>,
    output_1: &mut TensorMap<bf16, Tiled>,
    m: u32,
    n: u32,
    k: u32,
    #[comptime] a_major: Major,
    #[comptime] b_major: Major,
    #[comptime] epilogue: Epilogue,
) {
    let stages = comptime!(epilogue.stages());
    let pass_bytes = comptime!(epilogue.pass_bytes());
    let (tiles, staging, full, empty) = pipeline_smem(
        comptime!(epilogue.smem_bytes()),
        stages,
        STAGE_BYTES,
        comptime!(2 * pass_bytes),
    );
    // Each consumer's two "box loaded" barriers, after the stages' (the 1 KiB the layout keeps
    // for barriers holds them).
    let loaded = empty + stages * 8;
    if UNIT_POS == 0 {
        #[unroll]
        for b in 0..4u32 {
            mbarrier_init(loaded + 8 * b, 1u32);
        }
        mbarrier_init_fence();
    }
    sync_cube();
    let k_tiles = k.div_ceil(BLOCK_K);
    let (rows, columns) = (m.div_ceil(BLOCK_M), n.div_ceil(BLOCK_N));
    let mine = (rows * columns - CUBE_POS_X).div_ceil(CUBE_COUNT_X);
    let warpgroup = UNIT_POS / 128;
    if warpgroup == 0 {
        if UNIT_POS == 0 {
            let pipeline = comptime!(Pipeline::wide(stages, BLOCK_K, a_major, b_major));
            let b = tensor_map_address(b);
            let maps = (tensor_map_address(a), b, b);
            produce(maps, tiles, full, empty, mine, k_tiles, (rows, columns), pipeline);
        }
    } else {
        let consumer = warpgroup - 1;
        let values = staging + consumer * pass_bytes;
        let bars = (loaded + consumer * 16, loaded + consumer * 16 + 8);
        let storer = UNIT_POS.is_multiple_of(128);
        let barrier = 1 + consumer;
        let sources = (tensor_map_address(input_0), tensor_map_address(input_1));
        let targets = (store_map_address(output_0), store_map_address(output_1));
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
                    stages,
                    a_major,
                    b_major,
                );
                // After a slice the last tile's stores have long read the buffer: the first two
                // quarters' values load while this tile is computed.
                if kt == 0 && storer {
                    load_box(sources, values, bars.0, col0, row0, epilogue);
                    load_box(sources, values + 8192, bars.1, col0 + 64, row0, epilogue);
                }
            }
            // Two loads a tile into each box: the first's phase is even, the second's odd.
            mbarrier_wait(bars.0, 0u32);
            stage(&acc, values, 0u32, epilogue);
            send_box(targets, col0, row0, values, barrier, storer, epilogue);
            if storer {
                load_box(sources, values, bars.0, col0 + 128, row0, epilogue);
            }
            mbarrier_wait(bars.1, 0u32);
            stage(&acc, values, 1u32, epilogue);
            send_box(targets, col0 + 64, row0, values + 8192, barrier, storer, epilogue);
            if storer {
                load_box(sources, values + 8192, bars.1, col0 + 192, row0, epilogue);
            }
            mbarrier_wait(bars.0, 1u32);
            stage(&acc, values, 2u32, epilogue);
            send_box(targets, col0 + 128, row0, values, barrier, storer, epilogue);
            mbarrier_wait(bars.1, 1u32);
            stage(&acc, values, 3u32, epilogue);
            send_box(targets, col0 + 192, row0, values + 8192, barrier, storer, epilogue);
        }
        if storer {
            bulk_wait();
        }
    }
}

/// Loads the 64 × 64 boxes of the inputs at `(row0, col0)` into a consumer's box at `to` (its
/// second tensor's [`STAGING_BYTES`] after), counted on `bar`, once this thread's stores have
/// read it.
#[cube]
fn load_box(maps: (u64, u64), to: u32, bar: u32, col0: u32, row0: u32, #[comptime] epilogue: Epilogue) {
    bulk_wait_read();
    mbarrier_expect(bar, comptime!(epilogue.tensors() * 8192));
    tma_load_2d(to, maps.0, col0, row0, bar);
    if comptime!(epilogue.tensors() == 2) {
        tma_load_2d(to + STAGING_BYTES, maps.1, col0, row0, bar);
    }
}

/// Overwrites a quarter's values in a consumer's buffer with the epilogue's results, from the
/// accumulator's registers from `32 · quarter` (its box: the first for even quarters).
#[cube]
fn stage<N: Size>(acc: &Vector<f32, N>, values: u32, #[comptime] quarter: u32, #[comptime] epilogue: Epilogue) {
    match comptime!(epilogue) {
        Epilogue::SwigluBackward => super::epilogues::stage_grads(acc, values, quarter),
        Epilogue::Added => super::epilogues::stage_sum(acc, values, quarter),
    }
}

/// Hands a quarter's results in the box at `from` to TMA (`storer`), to `(row0, col0)` of each
/// output, once the whole warpgroup has written them.
#[cube]
#[allow(clippy::too_many_arguments)]
fn send_box(
    maps: (u64, u64),
    col0: u32,
    row0: u32,
    from: u32,
    barrier: u32,
    storer: bool,
    #[comptime] epilogue: Epilogue,
) {
    fence_proxy_async_shared();
    named_barrier(barrier, 128u32);
    if storer {
        tma_store_box(maps.0, col0, row0, from);
        if comptime!(epilogue.tensors() == 2) {
            tma_store_box(maps.1, col0, row0, from + STAGING_BYTES);
        }
        bulk_commit();
    }
}

/// Whether the epilogue can read `t` for a `[m, n]` output: a bf16 matrix of that shape whose
/// rows TMA reads in place.
pub(crate) fn readable(t: &CubeTensor, m: usize, n: usize) -> bool {
    let shape = t.meta.shape();
    t.dtype == DType::BF16 && shape.len() == 2 && shape[0] == m && shape[1] == n && tma_rows(t)
}

/// Launches the kernel: `lhs · rhs` (bf16, k > 0 and a multiple of 8, `rhs` `[k, n]`, maybe a
/// view) through `epilogue`, reading `inputs` (`readable`) and writing as many new `[m, n]`
/// tensors, which it returns.
pub(crate) fn launch_loaded(
    lhs: CubeTensor,
    rhs: CubeTensor,
    inputs: &[CubeTensor],
    epilogue: Epilogue,
) -> Vec<CubeTensor> {
    let (m, k) = (lhs.meta.shape()[0], lhs.meta.shape()[1]);
    let n = rhs.meta.shape()[1];
    debug_assert!(k > 0 && k % 8 == 0 && inputs.len() == epilogue.tensors() as usize);
    let (a, a_major) = operand(lhs, true);
    let (b, b_major) = operand(rhs, false);
    let outputs: Vec<_> = inputs.iter().map(|_| output(&a, m, n)).collect();
    let client = a.client.clone();
    let elem = ElemType::Float(FloatKind::BF16);
    let tiles = (m as u32).div_ceil(BLOCK_M) * (n as u32).div_ceil(BLOCK_N);
    let blocks = persistent_blocks(&client, tiles);
    let second = |ts: &[CubeTensor]| ts.get(1).unwrap_or(&ts[0]).clone();
    // SAFETY: the maps cover exactly the operands, the inputs and the outputs (TMA fills
    // out-of-range boxes with zeros when loading and drops their out-of-range parts when
    // storing); k > 0, so every tile loads the four quarters it waits for.
    unsafe {
        loaded_kernel::launch_unchecked(
            &client,
            CubeCount::Static(blocks, 1, 1),
            CubeDim::new_1d(384),
            operand_map(a, a_major, BLOCK_M, BLOCK_K, elem),
            operand_map(b, b_major, BLOCK_N, BLOCK_K, elem),
            store_map(&inputs[0]),
            store_map(&second(inputs)),
            store_map(&outputs[0]),
            store_map(&second(&outputs)),
            m as u32,
            n as u32,
            k as u32,
            a_major,
            b_major,
            epilogue,
        );
    }
    outputs
}
