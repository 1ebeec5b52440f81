//! The three products in backend ops, the operands cast to f32 first, `matmul` the f32 product
//! to use: the CPU path, the kernels' oracle, and CUDA's path for shapes the kernels do not take.

use burn::backend::Backend;
use burn::backend::tensor::FloatTensor;
use burn::tensor::FloatDType;

fn f32<B: Backend>(t: FloatTensor<B>) -> FloatTensor<B> {
    B::float_cast(t, FloatDType::F32)
}

pub fn logits<B: Backend>(
    x: FloatTensor<B>,
    w: FloatTensor<B>,
    matmul: impl Fn(FloatTensor<B>, FloatTensor<B>) -> FloatTensor<B>,
) -> FloatTensor<B> {
    matmul(f32::<B>(x), f32::<B>(w))
}

pub fn dx<B: Backend>(
    grad: FloatTensor<B>,
    w: FloatTensor<B>,
    dtype: FloatDType,
    matmul: impl Fn(FloatTensor<B>, FloatTensor<B>) -> FloatTensor<B>,
) -> FloatTensor<B> {
    B::float_cast(matmul(f32::<B>(grad), B::float_transpose(f32::<B>(w))), dtype)
}

pub fn dw<B: Backend>(
    x: FloatTensor<B>,
    grad: FloatTensor<B>,
    dtype: FloatDType,
    matmul: impl Fn(FloatTensor<B>, FloatTensor<B>) -> FloatTensor<B>,
) -> FloatTensor<B> {
    B::float_cast(matmul(B::float_transpose(f32::<B>(x)), f32::<B>(grad)), dtype)
}
