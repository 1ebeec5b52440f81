//! Decoding with latent attention (DeepSeek-V3): the cache holds each position's compressed
//! key/value latent `[b, 1, c, ckv]` and its rotated shared key `[b, 1, c, r]`, not every head's
//! keys and values (`ckv + r` numbers a position against `h·(n + r + v)`); each pass expands the
//! cached latents through the up projection for the heads it attends with.
//!
//! Legend: `b` batch, `s` new tokens, `t` positions cached after them, `c` capacity, `h` heads on
//! this rank, `n`/`r`/`v` the unrotated, rotated and value widths, `ckv` the latent's.

use burn::tensor::activation::softmax;
use burn::tensor::{Bool, DType, Tensor};
use burn_megatron_kernels::gemm::f32_matmul::matmul;

use super::cache::LayerCache;
use crate::error::LayerError;
use crate::layers::LatentAttention;

/// An empty block of the cache: the latents of `capacity` positions.
pub(super) fn empty(
    layer: &LatentAttention,
    batch: usize,
    capacity: usize,
    device: &burn::tensor::Device,
    dtype: DType,
) -> LayerCache {
    LayerCache {
        k: Tensor::zeros([batch, 1, capacity, layer.kv_rank], (device, dtype)),
        v: Tensor::zeros([batch, 1, capacity, layer.qk_rope_dim], (device, dtype)),
    }
}

/// Latent attention over the cache and `x`'s positions `start..start + s`, `x`'s latents
/// written into it (`cache.k` the latent, `cache.v` the rotated shared key).
///
/// # Shapes
/// `x`: `[b, s, d]`, `blocked`: `[b, 1, s, t]` → `[b, s, d]`
pub(super) fn attend_cached(
    a: &LatentAttention,
    x: Tensor<3>,
    cache: LayerCache,
    start: usize,
    blocked: Tensor<4, Bool>,
) -> Result<(Tensor<3>, LayerCache), LayerError> {
    let [b, s, _] = x.dims();
    let (h, n, r) = (a.n_heads, a.qk_nope_dim, a.qk_rope_dim);
    let q = a.queries(x.clone())?; // [b, h, s, n + r]
    let (c_kv, k_rope) = a.latents(x)?; // [b, s, ckv], [b, s, r]
    let k_rope = a.rope.apply_from(k_rope.unsqueeze_dim::<4>(1), start); // [b, 1, s, r]
    let t = start + s;
    // The cache moved in, so nothing else holds its buffers: written in place.
    let cache = LayerCache {
        k: cache
            .k
            .slice_assign([0..b, 0..1, start..t, 0..a.kv_rank], c_kv.unsqueeze_dim::<4>(1)),
        v: cache.v.slice_assign([0..b, 0..1, start..t, 0..r], k_rope),
    };
    let latent = cache.k.clone().narrow(2, 0, t).reshape([b, t, a.kv_rank]);
    let (k_nope, values) = a.keys_values(latent)?; // [b, h, t, n], [b, h, t, v]
    let k_rope = cache.v.clone().narrow(2, 0, t).expand([b, h, t, r]);
    let keys = Tensor::cat(vec![k_nope, k_rope], 3);
    let q_rope = a.rope.apply_from(q.clone().narrow(3, n, r), start);
    let q = Tensor::cat(vec![q.narrow(3, 0, n), q_rope], 3).mul_scalar(a.score_scale);
    let dtype = q.dtype();
    // f32 products kept in f32, as the grouped-query cache computes them.
    let scale = ((n + r) as f64).sqrt();
    let scores = matmul(q.cast(DType::F32), keys.cast(DType::F32).swap_dims(2, 3)).div_scalar(scale); // [b, h, s, t]
    let weights = softmax(scores.mask_fill(blocked.expand([b, h, s, t]), f32::NEG_INFINITY), 3);
    let out = matmul(weights, values.cast(DType::F32)).cast(dtype); // [b, h, s, v]
    let out = out.swap_dims(1, 2).reshape([b, s, h * a.v_dim]);
    Ok((a.wo.forward(out)?, cache))
}
