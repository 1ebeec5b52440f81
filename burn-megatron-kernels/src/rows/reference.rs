//! The tensor-op twin on any backend's primitives: the CPU path and the kernels' oracle.

use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Backend, TensorMetadata};
use burn::tensor::FloatDType;

fn f32<B: Backend>(t: FloatTensor<B>) -> FloatTensor<B> {
    B::float_cast(t, FloatDType::F32)
}

/// `x`'s rows at `index`, `n` (one past the last) reading a zero row.
pub fn gather<B: Backend>(x: FloatTensor<B>, index: IntTensor<B>) -> FloatTensor<B> {
    let d = x.shape()[1];
    let zero = B::float_zeros([1, d].into(), &x.device(), FloatDType::from(x.dtype()));
    B::float_select(B::float_cat(vec![x, zero], 0), 0, index)
}

/// The sum of `grad`'s rows each source row's `c` readers name (`m`, one past the last,
/// reads zeros).
pub fn gather_back<B: Backend>(grad: FloatTensor<B>, readers: IntTensor<B>) -> FloatTensor<B> {
    let (n, c) = (readers.shape()[0], readers.shape()[1]);
    let d = grad.shape()[1];
    let flat = B::int_reshape(readers, [n * c].into());
    let read = B::float_reshape(gather::<B>(grad, flat), [n, c, d].into());
    // The c readers added one slice at a time: Burn's reduction over a middle dim can run in
    // one block on CUDA.
    let slice = |j: usize| {
        let part = B::float_slice(read.clone(), &[(..).into(), (j..j + 1).into(), (..).into()]);
        B::float_reshape(part, [n, d].into())
    };
    (1..c).fold(slice(0), |sum, j| B::float_add(sum, slice(j)))
}

/// `y`'s rows each copy reads, `[t, k, d]` in f32.
fn copies<B: Backend>(y: FloatTensor<B>, rows: IntTensor<B>) -> FloatTensor<B> {
    let (t, k) = (rows.shape()[0], rows.shape()[1]);
    let d = y.shape()[1];
    let flat = B::int_reshape(rows, [t * k].into());
    B::float_reshape(f32::<B>(gather::<B>(y, flat)), [t, k, d].into())
}

pub fn combine<B: Backend>(y: FloatTensor<B>, weights: FloatTensor<B>, rows: IntTensor<B>) -> FloatTensor<B> {
    let dtype = FloatDType::from(y.dtype());
    let (t, k) = (rows.shape()[0], rows.shape()[1]);
    let d = y.shape()[1];
    let weighted = B::float_mul(
        copies::<B>(y, rows),
        B::float_reshape(f32::<B>(weights), [t, k, 1].into()),
    );
    let sum = B::float_reshape(B::float_sum_dim(weighted, 1), [t, d].into());
    B::float_cast(sum, dtype)
}

pub fn combine_back<B: Backend>(
    y: FloatTensor<B>,
    weights: FloatTensor<B>,
    rows: IntTensor<B>,
    slots: IntTensor<B>,
    grad: FloatTensor<B>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let (y_dtype, w_dtype) = (FloatDType::from(y.dtype()), FloatDType::from(weights.dtype()));
    let (t, k) = (rows.shape()[0], rows.shape()[1]);
    let d = y.shape()[1];
    let grad = B::float_reshape(f32::<B>(grad), [t, 1, d].into());
    let products = B::float_mul(copies::<B>(y, rows), grad.clone());
    let dw = B::float_reshape(B::float_sum_dim(products, 2), [t, k].into());
    let scaled = B::float_mul(grad, B::float_reshape(f32::<B>(weights), [t, k, 1].into()));
    let dy = gather::<B>(B::float_reshape(scaled, [t * k, d].into()), slots);
    (B::float_cast(dy, y_dtype), B::float_cast(dw, w_dtype))
}
