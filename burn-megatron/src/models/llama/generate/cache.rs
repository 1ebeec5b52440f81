//! The KV cache and the cached forward pass: every block's keys and values for the positions
//! decoded so far, preallocated for `capacity` positions and split over tp by kv heads (each
//! rank holds its own heads'). A batch of prompts of different lengths is left-padded: each
//! row's keys before its first token are masked, and since RoPE's scores depend only on the
//! distance between positions, a row shifted right by its padding attends exactly as it would
//! alone.
//!
//! Legend: `b` batch, `s` new tokens, `t` positions cached after them, `c` capacity, `h`/`g`
//! (kv) heads on this rank, `k` head_dim.

use burn::tensor::activation::softmax;
use burn::tensor::{Bool, DType, Device, Int, Tensor, TensorData};
use burn_megatron_dist::mappings::copy_to_tp;

use crate::error::{ConfigError, LayerError};
use crate::layers::{ParallelAttention, SequenceLayout};
use crate::models::llama::{Llama, MoeReport};

/// One block's cached keys and values, `[b, g, c, k]` each.
#[derive(Clone, Debug)]
struct LayerCache {
    k: Tensor<4>,
    v: Tensor<4>,
}

/// Every block's keys and values, the positions filled, and which hold a token.
#[derive(Clone, Debug)]
pub struct KvCache {
    layers: Vec<LayerCache>,
    /// Positions filled, the same in every row.
    len: usize,
    capacity: usize,
    /// `valid[i][j]`: row `i` has a token (not padding) at position `j`.
    valid: Vec<Vec<bool>>,
}

impl KvCache {
    /// An empty cache for `batch` rows of up to `capacity` positions (at most the model's
    /// `max_seq_len`), in the model's dtype on `device`. The model must be planned without
    /// sequence or context parallelism.
    pub fn new(model: &Llama, batch: usize, capacity: usize, device: &Device) -> Result<Self, LayerError> {
        let attention = &model.layers.first().expect("a Llama has blocks").attention;
        if attention.sequence == SequenceLayout::Sharded {
            return Err(ConfigError::DecodingSequenceParallel.into());
        }
        if attention.cp.size() > 1 {
            return Err(ConfigError::DecodingContextParallel.into());
        }
        let max = attention.rope.max_seq_len();
        if capacity > max {
            return Err(ConfigError::CacheFull {
                tokens: capacity,
                capacity: max,
            }
            .into());
        }
        let dtype = model.embedding.weight.val().dtype();
        let shape = [batch, attention.n_kv_heads, capacity, attention.head_dim];
        let layer = || LayerCache {
            k: Tensor::zeros(shape, (device, dtype)),
            v: Tensor::zeros(shape, (device, dtype)),
        };
        Ok(Self {
            layers: (0..model.layers.len()).map(|_| layer()).collect(),
            len: 0,
            capacity,
            valid: vec![Vec::with_capacity(capacity); batch],
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The mask of one forward over positions `len..len + s`: `[b, 1, s, t]`, true where a
    /// query may not read a key (a later position, or padding other than itself, so that a
    /// padding query reads something and stays finite).
    fn blocked(&self, s: usize, device: &Device) -> Tensor<4, Bool> {
        let (b, t) = (self.valid.len(), self.len + s);
        let mut out = Vec::with_capacity(b * s * t);
        for row in &self.valid {
            for i in 0..s {
                let query = self.len + i;
                out.extend((0..t).map(|j| j > query || (!row[j] && j != query)));
            }
        }
        Tensor::<4, Bool>::from_data(TensorData::new(out, [b, 1, s, t]), device)
    }
}

impl Llama {
    /// The logits of `ids` after the cached positions, and the cache with them added.
    /// `padding[i]`: whether row `i`'s token at each of these positions is padding (left
    /// padding: only a prompt's first positions).
    ///
    /// # Shapes
    /// `[b, s]` → `[b, s, v']`, `v'` this rank's share of the vocabulary
    pub fn forward_cached(
        &self,
        ids: Tensor<2, Int>,
        padding: &[Vec<bool>],
        cache: &mut KvCache,
    ) -> Result<Tensor<3>, LayerError> {
        let [b, s] = ids.dims();
        if cache.len + s > cache.capacity {
            return Err(ConfigError::CacheFull {
                tokens: cache.len + s,
                capacity: cache.capacity,
            }
            .into());
        }
        for (row, pads) in cache.valid.iter_mut().zip(padding).take(b) {
            row.extend(pads.iter().map(|p| !p));
        }
        let device = ids.device();
        let blocked = cache.blocked(s, &device);
        let start = cache.len;
        let mut x = self.embedding.forward(ids)?;
        for (block, layer) in self.layers.iter().zip(&mut cache.layers) {
            let h = block.attention_norm.forward(x.clone())?;
            let attention = attend_cached(&block.attention, h, layer, start, blocked.clone())?;
            x = block.feed_forward(x + attention, &mut MoeReport::default())?;
        }
        cache.len += s;
        self.head(x)
    }
}

/// Attention over the cache and `x`'s positions, `x`'s keys and values written into it.
///
/// # Shapes
/// `x`: `[b, s, d]`, `blocked`: `[b, 1, s, t]` → `[b, s, d]`
fn attend_cached(
    attention: &ParallelAttention,
    x: Tensor<3>,
    cache: &mut LayerCache,
    start: usize,
    blocked: Tensor<4, Bool>,
) -> Result<Tensor<3>, LayerError> {
    let a = attention;
    let x = copy_to_tp(x, &a.tp)?;
    let [b, s, _] = x.dims();
    let (h, g, k) = (a.n_heads, a.n_kv_heads, a.head_dim);
    let heads = |y: Tensor<3>, n: usize| y.reshape([b, s, n, k]).swap_dims(1, 2);
    let q = a.rope.apply_from(heads(a.wq.forward(x.clone())?, h), start); // [b, h, s, k]
    let new_k = a.rope.apply_from(heads(a.wk.forward(x.clone())?, g), start); // [b, g, s, k]
    let new_v = heads(a.wv.forward(x)?, g);
    let t = start + s;
    cache.k = cache.k.clone().slice_assign([0..b, 0..g, start..t, 0..k], new_k);
    cache.v = cache.v.clone().slice_assign([0..b, 0..g, start..t, 0..k], new_v);
    // Each kv head serves h/g query heads, in Hugging Face's order.
    let expand = |x: Tensor<4>| {
        x.narrow(2, 0, t)
            .unsqueeze_dim::<5>(2)
            .repeat_dim(2, h / g)
            .reshape([b, h, t, k])
    };
    let (keys, values) = (expand(cache.k.clone()), expand(cache.v.clone()));
    let dtype = q.dtype();
    let scores = q
        .cast(DType::F32)
        .matmul(keys.cast(DType::F32).swap_dims(2, 3))
        .div_scalar((k as f64).sqrt()); // [b, h, s, t]
    let weights = softmax(scores.mask_fill(blocked.expand([b, h, s, t]), f32::NEG_INFINITY), 3);
    let out = weights.matmul(values.cast(DType::F32)).cast(dtype); // [b, h, s, k]
    a.wo.forward(out.swap_dims(1, 2).reshape([b, s, h * k]))
}
