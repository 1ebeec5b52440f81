//! The elementwise CUDA kernels (SwiGLU, RoPE), on vectors of elements; each may also take the
//! amax of what it writes, for the FP8 casts that quantize it next ([`known_amax`]).

use burn::backend::Cube;
use burn::tensor::{DType, Shape};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use half::{bf16, f16};

use crate::amax_kernels::{finish_max, folding_blocks, state, state_at, vector_max};
use crate::known_amax;
use crate::row_kernels::block_max;
use crate::swiglu::reference;

/// Whether `t` is laid out row-major with no padding.
pub(crate) fn is_compact(t: &CubeTensor) -> bool {
    let shape = t.meta.shape();
    let strides = t.meta.strides();
    let mut expected = 1;
    for d in (0..shape.num_dims()).rev() {
        if shape[d] != 1 && strides[d] != expected {
            return false;
        }
        expected *= shape[d];
    }
    true
}

/// `t` compact (copied if it is a view or padded), or `None` if even the copy is padded.
pub(crate) fn compact_input(t: CubeTensor) -> Option<CubeTensor> {
    let t = if is_compact(&t) { t } else { into_contiguous(t) };
    is_compact(&t).then_some(t)
}

/// A new compact tensor of `shape`.
pub(crate) fn compact_output(like: &CubeTensor, shape: Shape, dtype: DType) -> CubeTensor {
    let handle = like.client.empty(shape.num_elements() * dtype.size());
    CubeTensor::new_contiguous(like.client.clone(), like.device.clone(), shape, handle, dtype)
}

/// 8 elements a thread where the length allows (16-byte bf16 loads), else 1.
fn vector_size(len: usize) -> usize {
    if len.is_multiple_of(8) { 8 } else { 1 }
}

pub(crate) fn launch_dims(len: usize, vector: usize) -> (CubeCount, CubeDim) {
    let units = (len / vector) as u32;
    (CubeCount::Static(units.div_ceil(256), 1, 1), CubeDim::new_1d(256))
}

#[cube]
fn sigmoid<N: Size>(x: Vector<f32, N>) -> Vector<f32, N> {
    Vector::new(1.0f32) / (Vector::new(1.0f32) + (-x).exp())
}

/// `silu(a) ∘ b`, computed in f32 and rounded once.
#[cube]
fn swiglu_value<F: Float, N: Size>(a: Vector<F, N>, b: Vector<F, N>) -> Vector<F, N> {
    let x = Vector::<f32, N>::cast_from(a);
    Vector::cast_from(x * sigmoid(x) * Vector::<f32, N>::cast_from(b))
}

/// SwiGLU's input gradients `(da, db)` from `a`, `b` and the output's gradient `g`.
#[cube]
fn swiglu_grads<F: Float, N: Size>(a: Vector<F, N>, b: Vector<F, N>, g: Vector<F, N>) -> (Vector<F, N>, Vector<F, N>) {
    let x = Vector::<f32, N>::cast_from(a);
    let y = Vector::<f32, N>::cast_from(b);
    let g = Vector::<f32, N>::cast_from(g);
    let s = sigmoid(x);
    let one = Vector::new(1.0f32);
    (
        Vector::cast_from(g * y * s * (one + x * (one - s))),
        Vector::cast_from(g * x * s),
    )
}

#[cube(launch_unchecked)]
fn swiglu_kernel<F: Float, N: Size>(
    a: &Tensor<Vector<F, N>>,
    b: &Tensor<Vector<F, N>>,
    out: &mut Tensor<Vector<F, N>>,
) {
    let i = ABSOLUTE_POS;
    if i < out.len() {
        out[i] = swiglu_value(a[i], b[i]);
    }
}

#[cube(launch_unchecked)]
fn swiglu_backward_kernel<F: Float, N: Size>(
    a: &Tensor<Vector<F, N>>,
    b: &Tensor<Vector<F, N>>,
    grad: &Tensor<Vector<F, N>>,
    da: &mut Tensor<Vector<F, N>>,
    db: &mut Tensor<Vector<F, N>>,
) {
    let i = ABSOLUTE_POS;
    if i < da.len() {
        let (ga, gb) = swiglu_grads(a[i], b[i], grad[i]);
        da[i] = ga;
        db[i] = gb;
    }
}

/// [`swiglu_kernel`] strided over the grid, the largest magnitude of what it writes (as
/// written, NaN ignored) into `amax` ([`finish_max`]).
#[cube(launch_unchecked)]
fn swiglu_noting_kernel<F: Float, N: Size>(
    a: &Tensor<Vector<F, N>>,
    b: &Tensor<Vector<F, N>>,
    out: &mut Tensor<Vector<F, N>>,
    state: &mut Tensor<Atomic<u32>>,
    amax: &mut Tensor<f32>,
) {
    let mut acc = 0.0f32;
    for i in range_stepped(ABSOLUTE_POS as u32, out.len() as u32, CUBE_COUNT as u32 * 256) {
        let o = swiglu_value(a[i as usize], b[i as usize]);
        out[i as usize] = o;
        acc = vector_max(acc, o);
    }
    finish_max(block_max(acc), state, amax);
}

/// [`swiglu_backward_kernel`] strided over the grid, the largest magnitudes of `da` and `db`
/// (as written, NaN ignored) into `amax_a` and `amax_b` ([`finish_max`]).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn swiglu_backward_noting_kernel<F: Float, N: Size>(
    a: &Tensor<Vector<F, N>>,
    b: &Tensor<Vector<F, N>>,
    grad: &Tensor<Vector<F, N>>,
    da: &mut Tensor<Vector<F, N>>,
    db: &mut Tensor<Vector<F, N>>,
    state_a: &mut Tensor<Atomic<u32>>,
    amax_a: &mut Tensor<f32>,
    state_b: &mut Tensor<Atomic<u32>>,
    amax_b: &mut Tensor<f32>,
) {
    let mut acc_a = 0.0f32;
    let mut acc_b = 0.0f32;
    for i in range_stepped(ABSOLUTE_POS as u32, da.len() as u32, CUBE_COUNT as u32 * 256) {
        let (ga, gb) = swiglu_grads(a[i as usize], b[i as usize], grad[i as usize]);
        da[i as usize] = ga;
        db[i as usize] = gb;
        acc_a = vector_max(acc_a, ga);
        acc_b = vector_max(acc_b, gb);
    }
    finish_max(block_max(acc_a), state_a, amax_a);
    finish_max(block_max(acc_b), state_b, amax_b);
}

/// The noting kernels' grid for `len` elements in vectors of `vector` ([`folding_blocks`]).
fn noting_dims(like: &CubeTensor, len: usize, vector: usize) -> (CubeCount, CubeDim) {
    let blocks = folding_blocks(like, ((len / vector) as u32).div_ceil(256));
    (CubeCount::Static(blocks, 1, 1), CubeDim::new_1d(256))
}

/// A new `[1]` f32 for an amax a kernel writes.
fn amax_output(like: &CubeTensor) -> CubeTensor {
    compact_output(like, Shape::new([1]), DType::F32)
}

/// Runs `$kernel::launch_unchecked::<F>` for the tensor's float dtype.
macro_rules! launch_float {
    ($dtype:expr, $kernel:ident, $($arg:expr),* $(,)?) => {
        // SAFETY: the callers' kernels check every index against their outputs' lengths (or
        // their grids cover the rows exactly), and every tensor is compact with the shape the
        // kernel indexes.
        unsafe {
            match $dtype {
                DType::BF16 => $kernel::launch_unchecked::<bf16>($($arg),*),
                DType::F16 => $kernel::launch_unchecked::<f16>($($arg),*),
                _ => $kernel::launch_unchecked::<f32>($($arg),*),
            }
        }
    };
}

pub(crate) use launch_float;

fn float_like(a: &CubeTensor, b: &CubeTensor) -> bool {
    a.dtype == b.dtype && matches!(a.dtype, DType::BF16 | DType::F16 | DType::F32) && a.meta.shape() == b.meta.shape()
}

/// SwiGLU's output; with `note`, its amax noted for the cast that quantizes it ([`known_amax`]).
pub(crate) fn swiglu(a: CubeTensor, b: CubeTensor, note: bool) -> CubeTensor {
    let (Some(a), Some(b)) = (
        float_like(&a, &b).then(|| compact_input(a.clone())).flatten(),
        compact_input(b.clone()),
    ) else {
        return reference::forward::<Cube>(a, b);
    };
    let out = compact_output(&a, a.meta.shape().clone(), a.dtype);
    let len = a.meta.num_elements();
    let vector = vector_size(len);
    if note {
        let amax = amax_output(&a);
        let (count, dim) = noting_dims(&a, len, vector);
        // SAFETY (`launch_float!`): every vector is checked against the length;
        // one unit of the last block writes `amax`, and the state holds two words.
        launch_float!(
            a.dtype,
            swiglu_noting_kernel,
            &a.client,
            count,
            dim,
            vector,
            a.clone().into_tensor_arg(),
            b.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            state(&a).into_tensor_arg(),
            amax.clone().into_tensor_arg(),
        );
        known_amax::record(&out, amax);
        return out;
    }
    let (count, dim) = launch_dims(len, vector);
    launch_float!(
        a.dtype,
        swiglu_kernel,
        &a.client,
        count,
        dim,
        vector,
        a.clone().into_tensor_arg(),
        b.into_tensor_arg(),
        out.clone().into_tensor_arg()
    );
    out
}

/// SwiGLU's input gradients; with `note`, their amaxes noted for the casts that quantize them
/// ([`known_amax`]).
pub(crate) fn swiglu_backward(a: CubeTensor, b: CubeTensor, grad: CubeTensor, note: bool) -> (CubeTensor, CubeTensor) {
    let fits = float_like(&a, &b) && float_like(&a, &grad);
    let (Some(a), Some(b), Some(grad)) = (
        fits.then(|| compact_input(a.clone())).flatten(),
        compact_input(b.clone()),
        compact_input(grad.clone()),
    ) else {
        return reference::backward::<Cube>(a, b, grad);
    };
    let (da, db) = (
        compact_output(&a, a.meta.shape().clone(), a.dtype),
        compact_output(&a, a.meta.shape().clone(), a.dtype),
    );
    let len = a.meta.num_elements();
    let vector = vector_size(len);
    if note {
        let (amax_a, amax_b) = (amax_output(&a), amax_output(&a));
        let (count, dim) = noting_dims(&a, len, vector);
        // SAFETY (`launch_float!`): as `swiglu`'s noting launch, with two states and amaxes.
        launch_float!(
            a.dtype,
            swiglu_backward_noting_kernel,
            &a.client,
            count,
            dim,
            vector,
            a.clone().into_tensor_arg(),
            b.into_tensor_arg(),
            grad.into_tensor_arg(),
            da.clone().into_tensor_arg(),
            db.clone().into_tensor_arg(),
            state_at(&a, 0).into_tensor_arg(),
            amax_a.clone().into_tensor_arg(),
            state_at(&a, 1).into_tensor_arg(),
            amax_b.clone().into_tensor_arg(),
        );
        known_amax::record(&da, amax_a);
        known_amax::record(&db, amax_b);
        return (da, db);
    }
    let (count, dim) = launch_dims(len, vector);
    launch_float!(
        a.dtype,
        swiglu_backward_kernel,
        &a.client,
        count,
        dim,
        vector,
        a.clone().into_tensor_arg(),
        b.into_tensor_arg(),
        grad.into_tensor_arg(),
        da.clone().into_tensor_arg(),
        db.clone().into_tensor_arg(),
    );
    (da, db)
}

/// RoPE: one thread a vector of the first half of a row and its partner in the second. `x` and
/// `out` are read and written through their strides (`[b, h, s]`, in vectors; head dim
/// contiguous); `count` is the number of threads, half the vectors.
/// With `note`, the block's largest |out| (as written, NaN ignored) to `maxima[block]`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn rope_kernel<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    cos: &Tensor<Vector<f32, N>>,
    sin: &Tensor<Vector<f32, N>>,
    out: &mut Tensor<Vector<F, N>>,
    maxima: &mut Tensor<f32>,
    input: Strides3,
    output: Strides3,
    count: u32,
    heads: u32,
    seq: u32,
    half: u32,
    sign: f32,
    #[comptime] note: bool,
) {
    let t = ABSOLUTE_POS as u32;
    let mut top = 0.0f32;
    if t < count {
        let row = t / half;
        let j = t % half;
        let pos = row % seq;
        let head = (row / seq) % heads;
        let batch = row / (seq * heads);
        let at = batch * input.b + head * input.h + pos * input.s + j;
        let x1 = Vector::<f32, N>::cast_from(x[at as usize]);
        let x2 = Vector::<f32, N>::cast_from(x[(at + half) as usize]);
        let c = cos[(pos * half + j) as usize];
        let s = sin[(pos * half + j) as usize] * Vector::new(sign);
        let o = batch * output.b + head * output.h + pos * output.s + j;
        let first = Vector::<F, N>::cast_from(x1 * c - x2 * s);
        let second = Vector::<F, N>::cast_from(x2 * c + x1 * s);
        out[o as usize] = first;
        out[(o + half) as usize] = second;
        if note {
            top = vector_max(vector_max(top, first), second);
        }
    }
    if note {
        let top = block_max(top);
        if UNIT_POS == 0 {
            maxima[CUBE_POS] = top;
        }
    }
}

/// A `[b, h, s, d]` tensor's first three strides, in vectors.
#[derive(CubeType, CubeLaunch, Clone, Copy)]
struct Strides3 {
    b: u32,
    h: u32,
    s: u32,
}

/// Whether `t`'s strides lay its values out densely in some order of its dims (a permuted
/// compact tensor: no gaps, no overlaps), the last dim contiguous.
fn is_dense(t: &CubeTensor) -> bool {
    let (shape, strides) = (t.meta.shape(), t.meta.strides());
    let mut dims: Vec<usize> = (0..shape.num_dims()).collect();
    dims.sort_by_key(|&d| std::cmp::Reverse(strides[d]));
    let mut expected = 1;
    for &d in dims.iter().rev() {
        if shape[d] != 1 && strides[d] != expected {
            return false;
        }
        expected *= shape[d];
    }
    strides[shape.num_dims() - 1] == 1
}

/// `x` rotated; with `note`, the maxima of its blocks noted for the cast that quantizes it
/// ([`known_amax`], through its memory as one row: the product reads it with its dims swapped
/// back).
pub(crate) fn rope(x: CubeTensor, cos: CubeTensor, sin: CubeTensor, inverse: bool, note: bool) -> CubeTensor {
    let reference = |x: CubeTensor, cos: CubeTensor, sin: CubeTensor| {
        let table = |t| burn::tensor::Tensor::<2>::from_primitive::<Cube>(t);
        crate::rope::reference::rope(
            burn::tensor::Tensor::from_primitive::<Cube>(x),
            table(cos),
            table(sin),
            inverse,
        )
        .try_into_primitive::<Cube>()
        .expect("a CUDA tensor")
    };
    let shape = x.meta.shape().clone();
    let (d, s) = (shape[3], shape[2]);
    let half = d / 2;
    let vector = [8, 4, 2, 1].into_iter().find(|v| half % v == 0).expect("1 divides");
    let x = if x.meta.strides()[3] == 1 {
        x
    } else {
        into_contiguous(x)
    };
    let strides = x.meta.strides();
    let fits = matches!(x.dtype, DType::BF16 | DType::F16 | DType::F32)
        && d % 2 == 0
        && strides[..3].iter().all(|st| st % vector == 0)
        && cos.dtype == DType::F32
        && sin.dtype == DType::F32
        && cos.meta.shape()[0] >= s
        && cos.meta.shape()[1] == half
        && sin.meta.shape() == cos.meta.shape();
    let tables = (compact_input(cos.clone()), compact_input(sin.clone()));
    let (true, Some(cos_c), Some(sin_c)) = (fits, tables.0, tables.1) else {
        return reference(x, cos, sin);
    };
    // The output in the input's own layout where that is dense (the `[b, s, h, d]` memory of a
    // projection's heads, which the layer's reshape back then takes as it is), else compact.
    let out = match is_dense(&x) {
        true => CubeTensor::new(
            x.client.clone(),
            x.client.empty(shape.num_elements() * x.dtype.size()),
            cubecl::zspace::metadata::Metadata::new(shape.clone(), x.meta.strides().clone()),
            x.device.clone(),
            x.dtype,
        ),
        false => compact_output(&x, shape.clone(), x.dtype),
    };
    let in_vectors = |t: &CubeTensor| {
        let stride = |i: usize| (t.meta.strides()[i] / vector) as u32;
        Strides3Launch::new(stride(0), stride(1), stride(2))
    };
    let threads = shape.num_elements() / 2 / vector;
    let (count, dim) = launch_dims(shape.num_elements() / 2, vector);
    let blocks = (threads as u32).div_ceil(256) as usize;
    // Without a note the kernel never writes the maxima.
    let maxima = compact_output(&x, Shape::new([if note { blocks } else { 1 }]), DType::F32);
    let sign = if inverse { -1.0f32 } else { 1.0 };
    launch_float!(
        x.dtype,
        rope_kernel,
        &x.client,
        count,
        dim,
        vector,
        x.clone().into_tensor_arg(),
        cos_c.into_tensor_arg(),
        sin_c.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        maxima.clone().into_tensor_arg(),
        in_vectors(&x),
        in_vectors(&out),
        threads as u32,
        shape[1] as u32,
        s as u32,
        (half / vector) as u32,
        sign,
        note,
    );
    if note {
        known_amax::record_maxima(&known_amax::flat(&out), maxima);
    }
    out
}
