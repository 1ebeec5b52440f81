//! One product a group, in backend ops, from starts on the host: the CPU path, the test
//! oracle, and CUDA's path for what the grouped kernel does not take. `matmul` is the 2-D
//! product to use.

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, TensorMetadata};
use burn::tensor::{FloatDType, Slice};

/// Rows `start..start + n` of `x`.
fn rows<B: Backend>(x: FloatTensor<B>, start: usize, n: usize) -> FloatTensor<B> {
    let mut slices = vec![Slice::from(start..start + n)];
    slices.extend((1..x.shape().num_dims()).map(|_| Slice::from(..)));
    B::float_slice(x, &slices)
}

/// Weight `g` of `w` (`[e, k, n]`), as `[k, n]`.
fn weight<B: Backend>(w: FloatTensor<B>, g: usize) -> FloatTensor<B> {
    let [_, k, n] = w.shape().dims();
    B::float_reshape(rows::<B>(w, g, 1), [k, n].into())
}

/// Each group's rows times its (possibly transposed) weight, then zero rows for the rows
/// of no group.
fn each<B: Backend>(
    x: FloatTensor<B>,
    w: FloatTensor<B>,
    starts: &[usize],
    transposed: bool,
    matmul: impl Fn(FloatTensor<B>, FloatTensor<B>) -> FloatTensor<B>,
) -> FloatTensor<B> {
    let [r, _] = x.shape().dims();
    let [_, k, n] = w.shape().dims();
    let width = if transposed { k } else { n };
    let mut parts = Vec::new();
    for (g, range) in starts.windows(2).enumerate() {
        if range[1] > range[0] {
            let w_g = weight::<B>(w.clone(), g);
            let w_g = if transposed { B::float_transpose(w_g) } else { w_g };
            parts.push(matmul(rows::<B>(x.clone(), range[0], range[1] - range[0]), w_g));
        }
    }
    let end = starts[starts.len() - 1];
    if r > end || parts.is_empty() {
        let dtype = FloatDType::from(x.dtype());
        parts.push(B::float_zeros([r - end, width].into(), &x.device(), dtype));
    }
    B::float_cat(parts, 0)
}

pub fn forward<B: Backend>(
    x: FloatTensor<B>,
    w: FloatTensor<B>,
    starts: &[usize],
    matmul: impl Fn(FloatTensor<B>, FloatTensor<B>) -> FloatTensor<B>,
) -> FloatTensor<B> {
    each::<B>(x, w, starts, false, matmul)
}

pub fn dgrad<B: Backend>(
    dy: FloatTensor<B>,
    w: FloatTensor<B>,
    starts: &[usize],
    matmul: impl Fn(FloatTensor<B>, FloatTensor<B>) -> FloatTensor<B>,
) -> FloatTensor<B> {
    each::<B>(dy, w, starts, true, matmul)
}

pub fn wgrad<B: Backend>(
    x: FloatTensor<B>,
    dy: FloatTensor<B>,
    starts: &[usize],
    matmul: impl Fn(FloatTensor<B>, FloatTensor<B>) -> FloatTensor<B>,
) -> FloatTensor<B> {
    let ([_, k], [_, n]) = (x.shape().dims(), dy.shape().dims());
    let device = x.device();
    let dtype = FloatDType::from(x.dtype());
    let parts = starts
        .windows(2)
        .map(|range| {
            let (start, c) = (range[0], range[1] - range[0]);
            let part = match c {
                0 => B::float_zeros([k, n].into(), &device, dtype),
                _ => matmul(
                    B::float_transpose(rows::<B>(x.clone(), start, c)),
                    rows::<B>(dy.clone(), start, c),
                ),
            };
            B::float_reshape(part, [1, k, n].into())
        })
        .collect();
    B::float_cat(parts, 0)
}
