//! What every CUDA kernel's launch needs: compact inputs and outputs, the grid of an
//! elementwise pass, and a launch for each float dtype ([`launch_float!`]).

use burn::tensor::{DType, Shape};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

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
pub(crate) fn vector_size(len: usize) -> usize {
    if len.is_multiple_of(8) { 8 } else { 1 }
}

pub(crate) fn launch_dims(len: usize, vector: usize) -> (CubeCount, CubeDim) {
    let units = (len / vector) as u32;
    (CubeCount::Static(units.div_ceil(256), 1, 1), CubeDim::new_1d(256))
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

/// `x` compact in a float dtype the kernels are built for (cast to f32 otherwise).
pub(crate) fn float_input(x: CubeTensor) -> CubeTensor {
    use burn::backend::Cube;
    use burn::backend::ops::FloatTensorOps;
    let x = match matches!(x.dtype, DType::BF16 | DType::F16 | DType::F32) {
        true => x,
        false => Cube::float_cast(x, burn::tensor::FloatDType::F32),
    };
    compact_input(x).expect("a row-major copy")
}
