//! The elementwise CUDA kernels (SwiGLU, RoPE), on vectors of elements.

use burn::backend::Cube;
use burn::tensor::{DType, Shape};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use half::{bf16, f16};

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

#[cube(launch_unchecked)]
fn swiglu_kernel<F: Float, N: Size>(
    a: &Tensor<Vector<F, N>>,
    b: &Tensor<Vector<F, N>>,
    out: &mut Tensor<Vector<F, N>>,
) {
    let i = ABSOLUTE_POS;
    if i < out.len() {
        let x = Vector::<f32, N>::cast_from(a[i]);
        out[i] = Vector::cast_from(x * sigmoid(x) * Vector::<f32, N>::cast_from(b[i]));
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
        let x = Vector::<f32, N>::cast_from(a[i]);
        let y = Vector::<f32, N>::cast_from(b[i]);
        let g = Vector::<f32, N>::cast_from(grad[i]);
        let s = sigmoid(x);
        let one = Vector::new(1.0f32);
        da[i] = Vector::cast_from(g * y * s * (one + x * (one - s)));
        db[i] = Vector::cast_from(g * x * s);
    }
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

pub(crate) fn swiglu(a: CubeTensor, b: CubeTensor) -> CubeTensor {
    let (Some(a), Some(b)) = (
        float_like(&a, &b).then(|| compact_input(a.clone())).flatten(),
        compact_input(b.clone()),
    ) else {
        return reference::forward::<Cube>(a, b);
    };
    let out = compact_output(&a, a.meta.shape().clone(), a.dtype);
    let len = a.meta.num_elements();
    let vector = vector_size(len);
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

pub(crate) fn swiglu_backward(a: CubeTensor, b: CubeTensor, grad: CubeTensor) -> (CubeTensor, CubeTensor) {
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
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn rope_kernel<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    cos: &Tensor<Vector<f32, N>>,
    sin: &Tensor<Vector<f32, N>>,
    out: &mut Tensor<Vector<F, N>>,
    input: Strides3,
    output: Strides3,
    count: u32,
    heads: u32,
    seq: u32,
    half: u32,
    sign: f32,
) {
    let t = ABSOLUTE_POS as u32;
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
        out[o as usize] = Vector::cast_from(x1 * c - x2 * s);
        out[(o + half) as usize] = Vector::cast_from(x2 * c + x1 * s);
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

pub(crate) fn rope(x: CubeTensor, cos: CubeTensor, sin: CubeTensor, inverse: bool) -> CubeTensor {
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
        in_vectors(&x),
        in_vectors(&out),
        threads as u32,
        shape[1] as u32,
        s as u32,
        (half / vector) as u32,
        sign,
    );
    out
}
