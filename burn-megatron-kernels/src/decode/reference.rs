//! The plain tensor-op twin: the CPU path and the kernels' oracle. It reads the position to the
//! host, which the kernels never do.

use burn::tensor::activation::softmax;
use burn::tensor::{Bool, DType, Tensor, TensorData};

// f32 products in f32 where this runs on CUDA (a fallback): Burn's would round to TF32.
use crate::gemm::f32_matmul::matmul;

fn whole(t: Tensor<1>) -> Vec<usize> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .expect("f32 positions")
        .into_iter()
        .map(|p| p as usize)
        .collect()
}

/// `x` `[b, n·k]` as `[b, n, 1, k]`, rotated for `position` when the tables are given.
fn heads(x: Tensor<2>, n: usize, tables: Option<(Tensor<2>, Tensor<2>)>, position: usize) -> Tensor<4> {
    let [b, width] = x.dims();
    let x = x.reshape([b, n, 1, width / n]);
    match tables {
        Some((cos, sin)) => {
            crate::rope::reference::rope(x, cos.narrow(0, position, 1), sin.narrow(0, position, 1), false)
        }
        None => x,
    }
}

pub fn cache_append(
    cache: Tensor<4>,
    new: Tensor<2>,
    cos: Tensor<2>,
    sin: Tensor<2>,
    position: Tensor<1>,
    rotate: bool,
) -> Tensor<4> {
    let [b, g, _, k] = cache.dims();
    let p = whole(position)[0];
    let new = heads(new, g, rotate.then_some((cos, sin)), p).cast(cache.dtype());
    cache.slice_assign([0..b, 0..g, p..p + 1, 0..k], new)
}

pub fn decode_attention(
    q: Tensor<2>,
    keys: Tensor<4>,
    values: Tensor<4>,
    cos: Tensor<2>,
    sin: Tensor<2>,
    position: Tensor<1>,
    first: Tensor<1>,
) -> Tensor<2> {
    let [b, g, c, k] = keys.dims();
    let h = q.dims()[1] / k;
    let device = q.device();
    let p = whole(position)[0];
    let first = whole(first);
    let dtype = q.dtype();
    let q = heads(q, h, Some((cos, sin)), p).cast(DType::F32); // [b, h, 1, k]
    let expand = |x: Tensor<4>| {
        x.unsqueeze_dim::<5>(2)
            .repeat_dim(2, h / g)
            .reshape([b, h, c, k])
            .cast(DType::F32)
    };
    let scores = matmul(q, expand(keys).swap_dims(2, 3)).div_scalar((k as f64).sqrt()); // [b, h, 1, c]
    let blocked: Vec<bool> = first
        .iter()
        .flat_map(|&f| (0..c).map(move |j| j < f || j > p))
        .collect();
    let blocked = Tensor::<4, Bool>::from_data(TensorData::new(blocked, [b, 1, 1, c]), &device);
    let weights = softmax(scores.mask_fill(blocked.expand([b, h, 1, c]), f32::NEG_INFINITY), 3);
    matmul(weights, expand(values)).cast(dtype).reshape([b, h * k])
}

pub fn greedy(logits: Tensor<2>, vocab: usize) -> Tensor<2> {
    let b = logits.dims()[0];
    let logits = logits.narrow(1, 0, vocab).cast(DType::F32);
    let ids = Tensor::<1, burn::tensor::Int>::arange(0..vocab as i64, &logits.device())
        .float()
        .cast(DType::F32)
        .reshape([1, vocab])
        .expand([b, vocab]);
    // The smallest id at the maximum.
    let best = logits.clone().max_dim(1).expand([b, vocab]);
    ids.mask_fill(logits.lower(best), vocab as f32).min_dim(1)
}
