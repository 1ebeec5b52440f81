//! Reductions the kernels share: a block's sum or maximum, and a tensor's largest magnitude in
//! one launch.
//!
//! A tensor's largest magnitude in one launch (FP8's current scaling takes one for every tensor
//! it quantizes). Each block reduces its chunk, folds its maximum into an accumulator with an
//! atomic maximum (non-negative f32 values order as their bits do), publishes it and takes a
//! ticket; the block that takes the last ticket writes the accumulator out and leaves the
//! accumulator and the ticket at zero for the next launch. Before, each block wrote a partial and
//! a second launch took their maximum: a launch, ~20 µs of the host's issue time, a quantized
//! tensor.
//!
//! The accumulator and the ticket outlive a launch, one pair a device and stream: a stream runs
//! its launches in order, so no two launches hold one pair at once. The AdamW master kernel counts
//! its blocks on the same ticket ([`last_block`]) to sum the global norm's partials.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use burn::tensor::{DType, Shape};
use burn_cubecl::CubeDevice;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use cubecl_environment::stream::StreamId;
use half::{bf16, f16};

use crate::cuda::launch::{compact_output, float_input, launch_float};

/// Vectors a block reduces (eight of 256 threads' 16-byte loads each).
const CHUNK: u32 = 2048;

/// Counts the block done on `state[1]` once its writes are published, and tells every unit of
/// it whether it was the launch's last; the last sees every other block's writes, and leaves
/// `state[1]` at zero for the next launch. Every unit of the block reaches it.
#[cube]
pub(crate) fn last_block(state: &mut Tensor<Atomic<u32>>) -> bool {
    let mut last = Shared::<[u32]>::new_slice(1usize);
    // The block's writes are published before its ticket counts it done.
    sync_storage();
    if UNIT_POS == 0 {
        let done = state[1].fetch_add(1u32) + 1u32;
        last[0] = 0u32;
        if done == CUBE_COUNT as u32 {
            last[0] = 1u32;
            state[1].store(0u32);
        }
    }
    sync_cube();
    let is_last = last[0] == 1u32;
    if is_last {
        // Every other block's writes were published before its ticket, which this block saw.
        sync_storage();
    }
    is_last
}

/// Folds the block's `value` (≥ 0 and not NaN, the same on every unit) into `state`'s
/// accumulator (`state[0]`, f32 bits); the launch's last block ([`last_block`]) writes the
/// maximum to `out[0]` and zeroes the accumulator. Every unit of the block reaches it.
#[cube]
pub(crate) fn finish_max(value: f32, state: &mut Tensor<Atomic<u32>>, out: &mut Tensor<f32>) {
    if UNIT_POS == 0 {
        state[0].fetch_max(u32::reinterpret(value));
    }
    let last = last_block(state);
    if last && UNIT_POS == 0 {
        out[0] = f32::reinterpret(state[0].exchange(0u32));
    }
}

/// The largest |value| of `x`'s first `vectors` (NaN ignored), its chunks of [`CHUNK`] vectors
/// strided over the grid, then [`finish_max`]. A whole chunk is read in one unrolled sweep, so
/// a thread has all its loads in flight at once; the last, partial chunk in a loop.
#[cube(launch_unchecked)]
fn amax_kernel<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    state: &mut Tensor<Atomic<u32>>,
    out: &mut Tensor<f32>,
    vectors: u32,
) {
    let mut acc = 0.0f32;
    for start in range_stepped(CUBE_POS as u32 * CHUNK, vectors, CUBE_COUNT as u32 * CHUNK) {
        if start + CHUNK <= vectors {
            #[unroll]
            for i in 0..CHUNK / 256 {
                acc = vector_max(acc, x[(start + UNIT_POS + i * 256) as usize]);
            }
        } else {
            for i in range_stepped(start + UNIT_POS, vectors, 256u32) {
                acc = vector_max(acc, x[i as usize]);
            }
        }
    }
    finish_max(block_max(acc), state, out);
}

/// Blocks of 256 threads for a launch of `units` of work that folds one maximum a block
/// ([`finish_max`]): at most four an SM, so the blocks' closing fences and atomics are few, and
/// a launch runs in about one wave.
pub(crate) fn folding_blocks(like: &CubeTensor, units: u32) -> u32 {
    let sms = like
        .client
        .properties()
        .hardware
        .num_streaming_multiprocessors
        .unwrap_or(256);
    units.clamp(1, 4 * sms)
}

/// The largest of `acc` and `v`'s magnitudes (NaN ignored: `max` takes the other operand).
#[cube]
pub(crate) fn vector_max<F: Float, N: Size>(acc: f32, v: Vector<F, N>) -> f32 {
    let value = Vector::<f32, N>::cast_from(v);
    let mut acc = acc;
    #[unroll]
    for j in 0..value.vector_size() {
        acc = f32::max(acc, f32::abs(value.extract(j)));
    }
    acc
}

/// One accumulator and ticket (`[2]` u32, zero between launches) for the launches `like`'s
/// device takes from this stream.
pub(crate) fn state(like: &CubeTensor) -> CubeTensor {
    state_at(like, 0)
}

/// The `index`-th of this stream's accumulators and tickets ([`state`]), for a launch that
/// takes several maxima (one each).
pub(crate) fn state_at(like: &CubeTensor, index: u8) -> CubeTensor {
    type States = Mutex<HashMap<(CubeDevice, u64, u8), CubeTensor>>;
    // Process state, and the only such in the kernels: the accumulator a launch folds into must
    // outlive it and be the one the next launch on the same stream finds zeroed, and CubeCL keeps
    // no slot a stream for a kernel's scratch. One 8-byte tensor a device, stream and index, held
    // for the process's life; no value flows through it from one op to another.
    static STATES: OnceLock<States> = OnceLock::new();
    let key = (like.device.clone(), StreamId::current().value, index);
    let mut states = STATES
        .get_or_init(Default::default)
        .lock()
        .expect("the amax states' lock");
    states
        .entry(key)
        .or_insert_with(|| {
            let handle = like.client.create_from_slice(&[0u8; 8]);
            CubeTensor::new_contiguous(
                like.client.clone(),
                like.device.clone(),
                Shape::new([2]),
                handle,
                DType::U32,
            )
        })
        .clone()
}

/// The largest magnitude of `x` (any layout, a float dtype), `[1]` f32, NaN ignored; 0 for an
/// empty `x`. One launch (a copy first for a view or another dtype).
pub(crate) fn tensor_amax(x: CubeTensor) -> CubeTensor {
    use burn::backend::Cube;
    use burn::backend::ops::FloatTensorOps;
    let n = x.meta.num_elements();
    if n == 0 {
        return Cube::float_zeros(Shape::new([1]), &x.device, burn::tensor::FloatDType::F32);
    }
    let x = float_input(x);
    let vector = [8, 4, 2, 1]
        .into_iter()
        .find(|v| n.is_multiple_of(*v))
        .expect("1 divides");
    let blocks = folding_blocks(&x, ((n / vector) as u32).div_ceil(CHUNK));
    let out = compact_output(&x, Shape::new([1]), DType::F32);
    // SAFETY (`launch_float!`): every load is below `vectors`, whole vectors of the compact `x`;
    // one unit of the last block writes `out`, and the state holds two words.
    launch_float!(
        x.dtype,
        amax_kernel,
        &x.client,
        CubeCount::Static(blocks, 1, 1),
        CubeDim::new_1d(256),
        vector,
        x.clone().into_tensor_arg(),
        state(&x).into_tensor_arg(),
        out.clone().into_tensor_arg(),
        (n / vector) as u32,
    );
    out
}
/// The noting kernels' grid for `len` elements in vectors of `vector` ([`folding_blocks`]).
pub(crate) fn noting_dims(like: &CubeTensor, len: usize, vector: usize) -> (CubeCount, CubeDim) {
    let blocks = folding_blocks(like, ((len / vector) as u32).div_ceil(256));
    (CubeCount::Static(blocks, 1, 1), CubeDim::new_1d(256))
}

/// A new `[1]` f32 for an amax a kernel writes.
pub(crate) fn amax_output(like: &CubeTensor) -> CubeTensor {
    compact_output(like, Shape::new([1]), DType::F32)
}

#[cube]
pub(crate) fn hsum<N: Size>(v: Vector<f32, N>) -> f32 {
    let mut sum = 0.0f32;
    #[unroll]
    for i in 0..v.vector_size() {
        sum += v.extract(i);
    }
    sum
}

/// The sum of `x` over the block's 256 threads, on every thread.
#[cube]
pub(crate) fn block_sum(x: f32) -> f32 {
    block_reduce(x, false)
}

/// The largest `x` over the block's 256 threads, on every thread.
#[cube]
pub(crate) fn block_max(x: f32) -> f32 {
    block_reduce(x, true)
}

/// The sum, or with `max` the largest, of `x` over the block's 256 threads: each warp's by
/// shuffles, then the 8 warps' through shared memory.
#[cube]
fn block_reduce(x: f32, #[comptime] max: bool) -> f32 {
    let mut partial = Shared::<[f32]>::new_slice(8usize);
    let warp = if comptime!(max) { plane_max(x) } else { plane_sum(x) };
    if UNIT_POS_PLANE == 0 {
        partial[PLANE_POS as usize] = warp;
    }
    sync_cube();
    let mut total = partial[0];
    #[unroll]
    for i in 1..8usize {
        if comptime!(max) {
            total = f32::max(total, partial[i]);
        } else {
            total += partial[i];
        }
    }
    total
}
