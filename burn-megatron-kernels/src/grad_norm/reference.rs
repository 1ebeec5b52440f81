//! The plain tensor-op twin, on any backend's primitives: the CPU path and the kernel's oracle.

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, TensorMetadata};
use burn::tensor::FloatDType;

/// `x` flattened, squared and summed in f32: `[1]`.
pub fn sum_of_squares<B: Backend>(x: FloatTensor<B>) -> FloatTensor<B> {
    let x = B::float_cast(x, FloatDType::F32);
    let n = x.shape().num_elements();
    let flat = B::float_reshape(x, [n].into());
    B::float_sum(B::float_mul(flat.clone(), flat))
}
