//! RoPE's CUDA kernel: one thread a vector of the first half of a head's row and its partner in
//! the second, reading and writing any `[b, h, s, d]` view through its strides; it may also take
//! the maxima of what it writes, for the FP8 cast that quantizes it next.

use burn::backend::Cube;
use burn::tensor::{DType, Shape};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use half::{bf16, f16};

use crate::cuda::launch::{compact_input, compact_output, launch_dims, launch_float};
use crate::cuda::reduce::{block_max, vector_max};
use crate::quant::notes::NoteAmaxes;

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
pub(crate) fn rope(x: CubeTensor, cos: CubeTensor, sin: CubeTensor, inverse: bool, notes: NoteAmaxes) -> CubeTensor {
    let notes = notes.output;
    let note = notes.is_some();
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
    if let Some(notes) = notes {
        notes.lock().record_maxima(&crate::cuda::known_amax::flat(&out), maxima);
    }
    out
}
