//! The plain tensor-op twin, on any backend's primitives: the CPU path and the kernels' oracle.

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Scalar, TensorMetadata};
use burn::tensor::FloatDType;

/// `σ(a)` of an f32 tensor.
fn sigmoid<B: Backend>(a: FloatTensor<B>) -> FloatTensor<B> {
    B::float_recip(B::float_add_scalar(B::float_exp(B::float_neg(a)), Scalar::from(1.0f32)))
}

fn f32<B: Backend>(t: FloatTensor<B>) -> FloatTensor<B> {
    B::float_cast(t, FloatDType::F32)
}

pub fn forward<B: Backend>(a: FloatTensor<B>, b: FloatTensor<B>) -> FloatTensor<B> {
    let dtype = FloatDType::from(a.dtype());
    let a = f32::<B>(a);
    let silu = B::float_mul(a.clone(), sigmoid::<B>(a));
    B::float_cast(B::float_mul(silu, f32::<B>(b)), dtype)
}

/// `da = g ∘ b ∘ σ(a)(1 + a(1 − σ(a)))`, `db = g ∘ a ∘ σ(a)`.
pub fn backward<B: Backend>(
    a: FloatTensor<B>,
    b: FloatTensor<B>,
    grad: FloatTensor<B>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let dtype = FloatDType::from(a.dtype());
    let (a, b, grad) = (f32::<B>(a), f32::<B>(b), f32::<B>(grad));
    let s = sigmoid::<B>(a.clone());
    let one_minus_s = B::float_add_scalar(B::float_neg(s.clone()), Scalar::from(1.0f32));
    let slope = B::float_mul(
        s.clone(),
        B::float_add_scalar(B::float_mul(a.clone(), one_minus_s), Scalar::from(1.0f32)),
    );
    let da = B::float_mul(B::float_mul(grad.clone(), b), slope);
    let db = B::float_mul(grad, B::float_mul(a, s));
    (B::float_cast(da, dtype), B::float_cast(db, dtype))
}
