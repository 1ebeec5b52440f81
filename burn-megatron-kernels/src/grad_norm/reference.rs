//! The plain tensor-op twin, on any backend's primitives: the CPU path and the kernel's oracle.

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, TensorMetadata};
use burn::tensor::{FloatDType, Slice};

use super::{CHUNK, partials_count, vector};

/// `out` with `x`'s partial sums of squares written from `offset`, in f32: `x` flattened, padded
/// with zeros to whole chunks of [`CHUNK`] vectors, each chunk squared and summed.
pub fn partials_into<B: Backend>(x: FloatTensor<B>, out: FloatTensor<B>, offset: usize) -> FloatTensor<B> {
    let n = x.shape().num_elements();
    if n == 0 {
        return out;
    }
    let (count, chunk) = (partials_count(n), CHUNK * vector(n));
    let device = x.device();
    let flat = B::float_reshape(B::float_cast(x, FloatDType::F32), [n].into());
    let padded = match count * chunk - n {
        0 => flat,
        pad => B::float_cat(vec![flat, B::float_zeros([pad].into(), &device, FloatDType::F32)], 0),
    };
    let blocks = B::float_reshape(padded, [count, chunk].into());
    let sums = B::float_sum_dim(B::float_mul(blocks.clone(), blocks), 1);
    let sums = B::float_reshape(sums, [count].into());
    let range = [Slice::new(offset as isize, Some((offset + count) as isize), 1)];
    B::float_slice_assign(out, &range, sums)
}
