//! The CUDA kernels of one decoding step (`crate::decode`): a cache append (one thread a pair
//! of a head's elements, rotated on the way in), the attention of one query a row (one block
//! of 256 threads a row's head: the rotated query in shared memory, the cached positions in
//! chunks of 256 with an online softmax, 16-byte loads of the cache), and the greedy choice (a
//! block a row). All read the position from the device, so a replayed graph sees each step's.

use burn::backend::Cube;
use burn::tensor::DType;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use half::{bf16, f16};

use crate::cuda::launch::{compact_input, compact_output, is_compact, launch_dims, launch_float};
use crate::cuda::reduce::{block_max, block_sum};
use crate::decode::reference;

/// Threads a block of the attention kernel, and positions a chunk.
const THREADS: u32 = 256;
/// Elements a load of the cache in the attention kernel (16 bytes of bf16).
const VECTOR: usize = 8;

/// Grid: a thread for each of a head's first-half elements. `new` `[b·g, k]` and `cache`
/// `[b·g, c, k]`, both compact; the tables `[≥ c, k/2]`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn append_kernel<F: Float>(
    cache: &mut Tensor<F>,
    new: &Tensor<F>,
    cos: &Tensor<f32>,
    sin: &Tensor<f32>,
    position: &Tensor<f32>,
    capacity: u32,
    head_dim: u32,
    #[comptime] rotate: bool,
) {
    let half = head_dim / 2;
    let t = ABSOLUTE_POS as u32;
    let p = u32::cast_from(position[0]);
    if t < (new.len() as u32) / 2 && p < capacity {
        let head = t / half;
        let j = t % half;
        let src = head * head_dim + j;
        let x1 = f32::cast_from(new[src as usize]);
        let x2 = f32::cast_from(new[(src + half) as usize]);
        let mut o1 = x1;
        let mut o2 = x2;
        if comptime!(rotate) {
            let c = cos[(p * half + j) as usize];
            let s = sin[(p * half + j) as usize];
            o1 = x1 * c - x2 * s;
            o2 = x2 * c + x1 * s;
        }
        let dst = (head * capacity + p) * head_dim + j;
        cache[dst as usize] = F::cast_from(o1);
        cache[(dst + half) as usize] = F::cast_from(o2);
    }
}

/// Grid: one block a row's query head. `q` `[b·h, k]` scalars, `keys`/`values` `[b·g, c, k]` and
/// `out` `[b·h, k]` in vectors of `N`, compact; `head_vectors = k / N` divides 256. A thread
/// scores a position (its key's `k/N` vector loads unrolled, so they are in flight together);
/// for the values the block is `256 / head_vectors` groups of positions by `head_vectors`
/// vectors of dims, each thread `head_vectors` rows of its group, the groups summed at the end.
/// The scale `1/√k` is folded into the query.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn attention_kernel<F: Float, N: Size>(
    q: &Tensor<F>,
    keys: &Tensor<Vector<F, N>>,
    values: &Tensor<Vector<F, N>>,
    cos: &Tensor<f32>,
    sin: &Tensor<f32>,
    position: &Tensor<f32>,
    first: &Tensor<f32>,
    out: &mut Tensor<Vector<F, N>>,
    heads: u32,
    group: u32,
    capacity: u32,
    scale: f32,
    #[comptime] head_vectors: u32,
) {
    let width = keys.vector_size().comptime() as u32;
    let head_dim = head_vectors * width;
    let groups = THREADS / head_vectors;
    let row_head = CUBE_POS as u32;
    let row = row_head / heads;
    let kv = row * (heads / group) + (row_head % heads) / group;
    let half = head_dim / 2;
    let tid = UNIT_POS;
    let p = u32::cast_from(position[0]);
    let start = u32::cast_from(first[row as usize]);
    let mut query = Shared::<[f32]>::new_slice(256usize);
    let mut weights = Shared::<[f32]>::new_slice(256usize);
    let mut partials = Shared::<[Vector<f32, N>]>::new_slice(256usize);
    if tid < half {
        let src = row_head * head_dim + tid;
        let x1 = f32::cast_from(q[src as usize]);
        let x2 = f32::cast_from(q[(src + half) as usize]);
        let c = cos[(p * half + tid) as usize];
        let s = sin[(p * half + tid) as usize];
        query[tid as usize] = (x1 * c - x2 * s) * scale;
        query[(tid + half) as usize] = (x2 * c + x1 * s) * scale;
    }
    sync_cube();
    let base = kv * capacity * head_vectors;
    let slot = tid / head_vectors;
    let lane = tid % head_vectors;
    // Below any score a finite query and key make: `exp` of it minus a real score is 0.
    let mut running_max = f32::new(-3.0e38);
    let mut total = 0.0f32;
    let mut acc = Vector::<f32, N>::new(0.0f32);
    let mut chunk = start;
    loop {
        if chunk > p {
            break;
        }
        let t = chunk + tid;
        let mut score = f32::new(-3.0e38);
        if t <= p {
            let at = base + t * head_vectors;
            let mut dot = 0.0f32;
            #[unroll]
            for v in 0..head_vectors {
                let key = Vector::<f32, N>::cast_from(keys[(at + v) as usize]);
                #[unroll]
                for i in 0..width {
                    dot += query[(v * width + i) as usize] * key.extract(i as usize);
                }
            }
            score = dot;
        }
        let new_max = f32::max(running_max, block_max(score));
        let mut w = 0.0f32;
        if t <= p {
            w = (score - new_max).exp();
        }
        weights[tid as usize] = w;
        let correction = (running_max - new_max).exp();
        total = total * correction + block_sum(w);
        sync_cube();
        let n = u32::min(THREADS, p + 1 - chunk);
        let mut sum = Vector::<f32, N>::new(0.0f32);
        #[unroll]
        for i in 0..head_vectors {
            let j = slot + i * groups;
            if j < n {
                let value = Vector::<f32, N>::cast_from(values[(base + (chunk + j) * head_vectors + lane) as usize]);
                sum += Vector::new(weights[j as usize]) * value;
            }
        }
        acc = acc * Vector::new(correction) + sum;
        sync_cube();
        running_max = new_max;
        chunk += THREADS;
    }
    partials[tid as usize] = acc;
    sync_cube();
    if tid < head_vectors {
        let mut o = partials[tid as usize];
        for g in 1..groups {
            o += partials[(g * head_vectors + tid) as usize];
        }
        out[(row_head * head_vectors + tid) as usize] = Vector::cast_from(o / Vector::new(total));
    }
}

/// Grid: one block a row. The row's first `valid` of `columns` logits: the first of equal
/// maxima, as an f32 id (ids below 2²⁴ are exact).
#[cube(launch_unchecked)]
fn greedy_kernel<F: Float>(logits: &Tensor<F>, out: &mut Tensor<f32>, columns: u32, valid: u32) {
    let row = CUBE_POS as u32;
    let base = row * columns;
    // Every thread starts from the row's first logit, so every thread holds a real candidate.
    let mut best = f32::cast_from(logits[base as usize]);
    let mut at = 0u32;
    for c in range_stepped(UNIT_POS, valid, THREADS) {
        let x = f32::cast_from(logits[(base + c) as usize]);
        if x > best {
            best = x;
            at = c;
        }
    }
    let top = block_max(best);
    let mut candidate = valid as f32;
    if best == top {
        candidate = at as f32;
    }
    // The smallest id at the maximum, as the largest of the negated ids.
    let first = -block_max(-candidate);
    if UNIT_POS == 0 {
        out[row as usize] = first;
    }
}

fn is_float(t: &CubeTensor) -> bool {
    matches!(t.dtype, DType::BF16 | DType::F16 | DType::F32)
}

/// The position is the `[1]` f32 tensor the kernels read.
fn position_fits(position: &CubeTensor) -> bool {
    position.dtype == DType::F32 && position.meta.num_elements() == 1
}

/// The RoPE tables fit the kernels: f32 `[≥ c, k/2]`.
fn tables_fit(cos: &CubeTensor, sin: &CubeTensor, capacity: usize, half: usize) -> bool {
    let table = |t: &CubeTensor| {
        t.dtype == DType::F32
            && t.meta.shape().num_dims() == 2
            && t.meta.shape()[0] >= capacity
            && t.meta.shape()[1] == half
    };
    table(cos) && table(sin)
}

fn cube<const D: usize>(t: CubeTensor) -> burn::tensor::Tensor<D> {
    burn::tensor::Tensor::from_primitive::<Cube>(t)
}

fn primitive<const D: usize>(t: burn::tensor::Tensor<D>) -> CubeTensor {
    t.try_into_primitive::<Cube>().expect("a CUDA tensor")
}

pub(crate) fn cache_append(
    cache: CubeTensor,
    new: CubeTensor,
    cos: CubeTensor,
    sin: CubeTensor,
    position: CubeTensor,
    rotate: bool,
) -> CubeTensor {
    let shape = cache.meta.shape().clone();
    let fits = shape.num_dims() == 4
        && is_float(&cache)
        && new.dtype == cache.dtype
        && new.meta.shape().num_dims() == 2
        && new.meta.shape()[0] == shape[0]
        && new.meta.shape()[1] == shape[1] * shape[3]
        && shape[3].is_multiple_of(2)
        && position_fits(&position)
        && (!rotate || tables_fit(&cos, &sin, shape[2], shape[3] / 2));
    // Written in place: a buffer nothing else holds and laid out as the kernel indexes it.
    let cache = match (cache.can_mut(), is_compact(&cache)) {
        (true, true) => cache,
        (_, true) => cache.copy(),
        _ => into_contiguous(cache),
    };
    let inputs = (
        compact_input(new.clone()),
        compact_input(cos.clone()),
        compact_input(sin.clone()),
    );
    let (true, true, Some(new_c), Some(cos_c), Some(sin_c)) = (fits, is_compact(&cache), inputs.0, inputs.1, inputs.2)
    else {
        return primitive(reference::cache_append(
            cube(cache),
            cube(new),
            cube(cos),
            cube(sin),
            cube(position),
            rotate,
        ));
    };
    let (count, dim) = launch_dims(new_c.meta.num_elements() / 2, 1);
    launch_float!(
        cache.dtype,
        append_kernel,
        &cache.client,
        count,
        dim,
        cache.clone().into_tensor_arg(),
        new_c.into_tensor_arg(),
        cos_c.into_tensor_arg(),
        sin_c.into_tensor_arg(),
        position.into_tensor_arg(),
        shape[2] as u32,
        shape[3] as u32,
        rotate,
    );
    cache
}

pub(crate) fn decode_attention(
    q: CubeTensor,
    keys: CubeTensor,
    values: CubeTensor,
    cos: CubeTensor,
    sin: CubeTensor,
    position: CubeTensor,
    first: CubeTensor,
) -> CubeTensor {
    let shape = keys.meta.shape().clone();
    let (b, g, c, k) = (shape[0], shape[1], shape[2], shape[3]);
    let q_shape = q.meta.shape().clone();
    let h = q_shape[1].checked_div(k).unwrap_or(0);
    let fits = shape.num_dims() == 4
        && is_float(&q)
        && keys.dtype == q.dtype
        && values.dtype == q.dtype
        && values.meta.shape() == &shape
        && q_shape.num_dims() == 2
        && q_shape[0] == b
        && h * k == q_shape[1]
        && h > 0
        && h % g == 0
        && k.is_multiple_of(VECTOR)
        && (THREADS as usize).is_multiple_of(k / VECTOR)
        && first.dtype == DType::F32
        && first.meta.num_elements() == b
        && position_fits(&position)
        && tables_fit(&cos, &sin, c, k / 2);
    let inputs = [&q, &keys, &values, &cos, &sin, &first].map(|t| compact_input((*t).clone()));
    let (true, [Some(qc), Some(kc), Some(vc), Some(cos_c), Some(sin_c), Some(first_c)]) = (fits, inputs) else {
        return primitive(reference::decode_attention(
            cube(q),
            cube(keys),
            cube(values),
            cube(cos),
            cube(sin),
            cube(position),
            cube(first),
        ));
    };
    let out = compact_output(&qc, q_shape, qc.dtype);
    let count = CubeCount::Static((b * h) as u32, 1, 1);
    launch_float!(
        qc.dtype,
        attention_kernel,
        &qc.client,
        count,
        CubeDim::new_1d(THREADS),
        VECTOR,
        qc.clone().into_tensor_arg(),
        kc.into_tensor_arg(),
        vc.into_tensor_arg(),
        cos_c.into_tensor_arg(),
        sin_c.into_tensor_arg(),
        position.into_tensor_arg(),
        first_c.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        h as u32,
        (h / g) as u32,
        c as u32,
        1.0 / (k as f32).sqrt(),
        (k / VECTOR) as u32,
    );
    out
}

pub(crate) fn greedy(logits: CubeTensor, vocab: usize) -> CubeTensor {
    let shape = logits.meta.shape().clone();
    let fits = shape.num_dims() == 2 && is_float(&logits) && vocab >= 1 && vocab <= shape[1] && vocab < 1 << 24;
    let (true, Some(x)) = (fits, compact_input(logits.clone())) else {
        return primitive(reference::greedy(cube(logits), vocab));
    };
    let out = compact_output(&x, burn::tensor::Shape::from(vec![shape[0], 1]), DType::F32);
    launch_float!(
        x.dtype,
        greedy_kernel,
        &x.client,
        CubeCount::Static(shape[0] as u32, 1, 1),
        CubeDim::new_1d(THREADS),
        x.clone().into_tensor_arg(),
        out.clone().into_tensor_arg(),
        shape[1] as u32,
        vocab as u32,
    );
    out
}
