//! The CUDA kernels of [`embedding`](crate::embedding)'s gradient: the positions sorted by
//! token, then one block a table row adding its positions' gradient rows in position order.
//!
//! 1. `count_kernel`: each token's positions counted (atomics; a count is exact in any order).
//! 2. `tile_sums_kernel` and `scan_kernel`: `starts`, the counts' exclusive prefix sums (`n + 1`
//!    of them), a block a tile of 2048 rows (one block scanning all of llama's 32 768 took 68
//!    µs on an H100).
//! 3. `place_kernel`: each position into its token's bucket, in whatever order the atomics give.
//! 4. `rank_kernel`: each position's rank among its token's (how many of the bucket come before
//!    it) puts it in `order`, so a bucket lists its positions in increasing order.
//! 5. `sum_kernel`: a block a row, `Σ grad[order[k]]` over the row's bucket, in f32.
//!
//! Sorting costs `m` atomics twice and `Σ c²` comparisons for buckets of `c` positions: under
//! a thousand for llama-1b's 8192 random tokens, `m²/4` if half the positions were one token.

use burn::backend::Cube;
use burn::backend::ops::IntTensorOps;
use burn::tensor::{DType, IntDType, Shape};
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use half::{bf16, f16};

use crate::cuda::launch::{compact_output, launch_dims, launch_float};
use crate::embedding::reference;
use crate::order::kernel::block_scan;
use crate::rows::kernel::{THREADS, float_input, index_input, rows_grid, vector};

/// Grid over positions: `counts[t]` counts the positions whose id `t` is in `[0, n)`.
#[cube(launch_unchecked)]
fn count_kernel(ids: &Tensor<i32>, counts: &mut Tensor<Atomic<u32>>, n: u32) {
    if ABSOLUTE_POS < ids.len() {
        let t = u32::cast_from(ids[ABSOLUTE_POS]);
        if t < n {
            counts[t as usize].fetch_add(1u32);
        }
    }
}

/// Table rows a thread of the scan takes, in turn.
const RUN: u32 = 8;
/// Table rows a block of the scan takes: its tile.
const TILE: u32 = THREADS * RUN;

/// Grid: a block a tile of [`TILE`] table rows. `tiles[g]`: tile `g`'s counts summed.
#[cube(launch_unchecked)]
fn tile_sums_kernel(counts: &Tensor<u32>, tiles: &mut Tensor<u32>, n: u32) {
    let begin = CUBE_POS as u32 * TILE + UNIT_POS * RUN;
    let mut mine = 0u32;
    // Unrolled: the run's eight loads in flight at once.
    #[unroll]
    for j in 0..RUN {
        if begin + j < n {
            mine += counts[(begin + j) as usize];
        }
    }
    let total = block_scan(mine, true);
    if UNIT_POS == 0 {
        tiles[CUBE_POS] = total;
    }
}

/// Grid: a block a tile. `starts[t] = Σ_{u<t} counts[u]` for `t ≤ n`: the earlier tiles' sums,
/// then the tile's own scan, thread by thread.
#[cube(launch_unchecked)]
fn scan_kernel(counts: &Tensor<u32>, tiles: &Tensor<u32>, starts: &mut Tensor<u32>, n: u32) {
    let mut earlier = 0u32;
    for g in range_stepped(UNIT_POS, CUBE_POS as u32, THREADS) {
        earlier += tiles[g as usize];
    }
    let offset = block_scan(earlier, true);
    // The scan's shared sums are read by every thread before the next scan writes them.
    sync_cube();
    let begin = CUBE_POS as u32 * TILE + UNIT_POS * RUN;
    let mut run = Array::<u32>::new(RUN as usize);
    let mut mine = 0u32;
    #[unroll]
    for j in 0..RUN {
        run[j as usize] = 0u32;
        if begin + j < n {
            run[j as usize] = counts[(begin + j) as usize];
        }
        mine += run[j as usize];
    }
    let mut start = offset + block_scan(mine, false) - mine;
    #[unroll]
    for j in 0..RUN {
        if begin + j < n {
            starts[(begin + j) as usize] = start;
        }
        start += run[j as usize];
    }
    // The thread whose run holds the last row writes the end.
    if begin < n && n <= begin + RUN {
        starts[n as usize] = start;
    }
}

/// Grid over positions: each position into a free slot of its token's bucket, `counts[t]`
/// counting down to zero as the slots fill.
#[cube(launch_unchecked)]
fn place_kernel(
    ids: &Tensor<i32>,
    starts: &Tensor<u32>,
    counts: &mut Tensor<Atomic<u32>>,
    bucket: &mut Tensor<u32>,
    n: u32,
) {
    if ABSOLUTE_POS < ids.len() {
        let t = u32::cast_from(ids[ABSOLUTE_POS]);
        if t < n {
            let slot = counts[t as usize].fetch_sub(1u32) - 1u32;
            bucket[(starts[t as usize] + slot) as usize] = ABSOLUTE_POS as u32;
        }
    }
}

/// Grid over positions: each position at its rank within its token's bucket, in `order`.
#[cube(launch_unchecked)]
fn rank_kernel(ids: &Tensor<i32>, starts: &Tensor<u32>, bucket: &Tensor<u32>, order: &mut Tensor<u32>, n: u32) {
    if ABSOLUTE_POS < ids.len() {
        let t = u32::cast_from(ids[ABSOLUTE_POS]);
        if t < n {
            let me = ABSOLUTE_POS as u32;
            let (start, end) = (starts[t as usize], starts[t as usize + 1]);
            let mut rank = 0u32;
            for k in start..end {
                if bucket[k as usize] < me {
                    rank += 1;
                }
            }
            order[(start + rank) as usize] = me;
        }
    }
}

/// Grid: a block a table row. `out[t] = Σ grad[order[k]]` for `k` in the row's bucket, in
/// order; four rows loaded before the four are added, so a long bucket keeps loads in flight.
#[cube(launch_unchecked)]
fn sum_kernel<F: Float, N: Size>(
    grad: &Tensor<Vector<F, N>>,
    starts: &Tensor<u32>,
    order: &Tensor<u32>,
    out: &mut Tensor<Vector<F, N>>,
    columns: u32,
) {
    let (start, end) = (starts[CUBE_POS], starts[CUBE_POS + 1]);
    let whole = start + (end - start) / 4 * 4;
    let width = columns as usize;
    for col in range_stepped(UNIT_POS, columns, THREADS) {
        let c = col as usize;
        let mut sum = Vector::<f32, N>::new(0.0f32);
        for k in range_stepped(start, whole, 4u32) {
            let a = Vector::<f32, N>::cast_from(grad[order[k as usize] as usize * width + c]);
            let b = Vector::<f32, N>::cast_from(grad[order[k as usize + 1] as usize * width + c]);
            let d = Vector::<f32, N>::cast_from(grad[order[k as usize + 2] as usize * width + c]);
            let e = Vector::<f32, N>::cast_from(grad[order[k as usize + 3] as usize * width + c]);
            sum += a;
            sum += b;
            sum += d;
            sum += e;
        }
        for k in whole..end {
            sum += Vector::<f32, N>::cast_from(grad[order[k as usize] as usize * width + c]);
        }
        out[CUBE_POS * width + c] = Vector::cast_from(sum);
    }
}

/// A compact u32 tensor of `len` entries on `like`'s device, its contents unset.
fn words(like: &CubeTensor, len: usize) -> CubeTensor {
    compact_output(like, Shape::from([len]), DType::U32)
}

/// `EmbeddingOps::embedding_rows`: the table's rows by id, an id outside the table a zero row
/// (the rows' gather, which reads such ids as zero rows).
pub(crate) fn embedding_rows(weight: CubeTensor, ids: CubeTensor) -> CubeTensor {
    crate::rows::kernel::gather(weight, ids)
}

pub(crate) fn embedding_rows_back(grad: CubeTensor, ids: CubeTensor, n: usize) -> CubeTensor {
    let (Some(gc), Some(ic)) = (float_input(&grad), index_input(ids.clone())) else {
        return reference::backward::<Cube>(grad, ids, n);
    };
    let (m, d) = (gc.meta.shape()[0], gc.meta.shape()[1]);
    let out = compact_output(&gc, Shape::from([n, d]), gc.dtype);
    if n == 0 || d == 0 {
        return out;
    }
    let client = &gc.client;
    let counts = Cube::int_zeros(Shape::from([n]), &gc.device, IntDType::U32);
    let starts = words(&gc, n + 1);
    let (bucket, order) = (words(&gc, m.max(1)), words(&gc, m.max(1)));
    let (positions, threads) = launch_dims(m.max(1), 1);
    // SAFETY: every id is tested against `n` before it indexes `counts` or `starts` (`n` and
    // `n + 1` long); a token's slots lie in `[starts[t], starts[t + 1])`, within the `m`
    // positions, as the counts that made the starts also hand out the slots; the scan's tiles
    // cover `[0, n]`, each read tested against `n`; the sum's grid is the `n` rows of `out`, its reads the
    // `m` rows of `grad`.
    unsafe {
        if m > 0 {
            count_kernel::launch_unchecked(
                client,
                positions.clone(),
                threads,
                ic.clone().into_tensor_arg(),
                counts.clone().into_tensor_arg(),
                n as u32,
            );
        }
        let tiles = words(&gc, n.div_ceil(TILE as usize));
        let (tile_count, tile_dim) = (
            CubeCount::Static(n.div_ceil(TILE as usize) as u32, 1, 1),
            CubeDim::new_1d(THREADS),
        );
        tile_sums_kernel::launch_unchecked(
            client,
            tile_count.clone(),
            tile_dim,
            counts.clone().into_tensor_arg(),
            tiles.clone().into_tensor_arg(),
            n as u32,
        );
        scan_kernel::launch_unchecked(
            client,
            tile_count,
            tile_dim,
            counts.clone().into_tensor_arg(),
            tiles.into_tensor_arg(),
            starts.clone().into_tensor_arg(),
            n as u32,
        );
        if m > 0 {
            place_kernel::launch_unchecked(
                client,
                positions.clone(),
                threads,
                ic.clone().into_tensor_arg(),
                starts.clone().into_tensor_arg(),
                counts.into_tensor_arg(),
                bucket.clone().into_tensor_arg(),
                n as u32,
            );
            rank_kernel::launch_unchecked(
                client,
                positions,
                threads,
                ic.into_tensor_arg(),
                starts.clone().into_tensor_arg(),
                bucket.into_tensor_arg(),
                order.clone().into_tensor_arg(),
                n as u32,
            );
        }
    }
    let (count, dim) = rows_grid(n);
    launch_float!(
        gc.dtype,
        sum_kernel,
        client,
        count,
        dim,
        vector(d),
        gc.clone().into_tensor_arg(),
        starts.into_tensor_arg(),
        order.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        (d / vector(d)) as u32
    );
    out
}
