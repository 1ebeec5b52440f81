//! The plain tensor-op twin, on any backend's primitives: the CPU path and the kernels' oracle.

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Scalar, TensorMetadata};
use burn::tensor::{FloatDType, Shape};

fn f32<B: Backend>(t: FloatTensor<B>) -> FloatTensor<B> {
    B::float_cast(t, FloatDType::F32)
}

/// The weight `[c]` as `[1, .., 1, c]`, to broadcast against a rank-`rank` input.
fn broadcast<B: Backend>(weight: FloatTensor<B>, rank: usize) -> FloatTensor<B> {
    let mut dims = vec![1; rank];
    dims[rank - 1] = weight.shape()[0];
    B::float_reshape(weight, Shape::from(dims))
}

pub fn forward<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    epsilon: f32,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let dtype = FloatDType::from(x.dtype());
    let last = x.shape().num_dims() - 1;
    let weight = broadcast::<B>(weight, last + 1);
    let x = f32::<B>(x);
    let mean_square = B::float_mean_dim(B::float_mul(x.clone(), x.clone()), last);
    let rstd = B::float_recip(B::float_sqrt(B::float_add_scalar(mean_square, Scalar::from(epsilon))));
    let normed = B::float_cast(B::float_mul(x, rstd.clone()), dtype);
    (B::float_mul(normed, weight), rstd)
}

/// With `x̂ = x · rstd` and `gw = g ∘ w`: `dx = rstd · (gw − x̂ · mean(gw ∘ x̂))` (plus
/// `residual`), `dw = Σ_rows g ∘ x̂`, where `g` is `grad` plus `uses` (all in f32).
pub fn backward<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    rstd: FloatTensor<B>,
    grad: FloatTensor<B>,
    uses: Vec<FloatTensor<B>>,
    residual: Option<FloatTensor<B>>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let (dtype, weight_dtype) = (FloatDType::from(x.dtype()), FloatDType::from(weight.dtype()));
    let shape = x.shape();
    let last = shape.num_dims() - 1;
    let columns = shape[last];
    let (x, weight) = (f32::<B>(x), f32::<B>(broadcast::<B>(weight, last + 1)));
    let grad = uses
        .into_iter()
        .fold(f32::<B>(grad), |g, u| B::float_add(g, f32::<B>(u)));
    let normed = B::float_mul(x, rstd.clone());
    let gw = B::float_mul(grad.clone(), weight);
    let mean = B::float_mean_dim(B::float_mul(gw.clone(), normed.clone()), last);
    let dx = B::float_mul(rstd, B::float_sub(gw, B::float_mul(normed.clone(), mean)));
    let dx = match residual {
        Some(residual) => B::float_add(dx, f32::<B>(residual)),
        None => dx,
    };
    let rows = shape.num_elements() / columns;
    let dw = B::float_reshape(B::float_mul(grad, normed), Shape::from([rows, columns]));
    let dw = B::float_reshape(B::float_sum_dim(dw, 0), Shape::from([columns]));
    (B::float_cast(dx, dtype), B::float_cast(dw, weight_dtype))
}
