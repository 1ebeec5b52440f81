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
use burn_megatron_kernels::decode::positions;
use burn_megatron_kernels::gemm::f32_matmul::matmul;

use crate::layers::{ParallelAttention, SequenceLayout};
use crate::models::llama::{Llama, MoeReport};

/// What one decoding step reads: the tokens `[b, 1]`, the position they take `[1]` (f32, the
/// number of positions cached before them) and each row's first token `[b]` (f32).
#[derive(Clone, Debug)]
pub(crate) struct StepInputs {
    pub ids: Tensor<2, Int>,
    pub position: Tensor<1>,
    pub first: Tensor<1>,
}

/// One block's cached keys and values, `[b, g, c, k]` each; under latent attention its latent
/// `[b, 1, c, ckv]` and rotated shared key `[b, 1, c, r]` (`latent.rs`).
#[derive(Clone, Debug)]
pub(super) struct LayerCache {
    pub(super) k: Tensor<4>,
    pub(super) v: Tensor<4>,
}

/// Every block's keys and values, the positions filled, and which hold a token.
#[derive(Clone, Debug)]
pub struct KvCache {
    /// Empty after a step that failed (its blocks' tensors went into the step).
    pub(super) layers: Vec<LayerCache>,
    /// Positions filled, the same in every row.
    pub(super) len: usize,
    pub(super) capacity: usize,
    /// `valid[i][j]`: row `i` has a token (not padding) at position `j`.
    valid: Vec<Vec<bool>>,
}

impl KvCache {
    /// An empty cache for `batch` rows of up to `capacity` positions (at most the model's
    /// `max_seq_len`), in the model's dtype on `device`. The model must be planned without
    /// sequence or context parallelism.
    pub fn new(model: &Llama, batch: usize, capacity: usize, device: &Device) -> Result<Self, LayerError> {
        let block = model.layers.first().expect("a Llama has blocks");
        let (sequence, cp, rope, window) = match (&block.attention, &block.latent) {
            (Some(a), _) => (a.sequence, &a.cp, &a.rope, a.sliding_window),
            (None, Some(l)) => (l.sequence, &l.cp, &l.rope, None),
            (None, None) => unreachable!("a block has grouped-query or latent attention"),
        };
        if sequence == SequenceLayout::Sharded {
            return Err(ConfigError::DecodingSequenceParallel.into());
        }
        if cp.size() > 1 {
            return Err(ConfigError::DecodingContextParallel.into());
        }
        let max = rope.max_seq_len();
        if capacity > max {
            return Err(ConfigError::CacheFull {
                tokens: capacity,
                capacity: max,
            }
            .into());
        }
        if let Some(window) = window.filter(|w| capacity > *w) {
            return Err(ConfigError::SequencePastWindow {
                seq_len: capacity,
                window,
            }
            .into());
        }
        let dtype = model.embedding.weight.val().dtype();
        let layer = |block: &crate::models::llama::LlamaBlock| match (&block.attention, &block.latent) {
            (Some(a), _) => {
                let shape = [batch, a.n_kv_heads, capacity, a.head_dim];
                LayerCache {
                    k: Tensor::zeros(shape, (device, dtype)),
                    v: Tensor::zeros(shape, (device, dtype)),
                }
            }
            (None, Some(latent)) => super::latent::empty(latent, batch, capacity, device, dtype),
            (None, None) => unreachable!("a block has grouped-query or latent attention"),
        };
        Ok(Self {
            layers: model.layers.iter().map(layer).collect(),
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

    /// Each row's first position that holds a token (its left padding's length).
    pub(super) fn first_tokens(&self) -> Vec<usize> {
        self.valid
            .iter()
            .map(|row| row.iter().position(|v| *v).unwrap_or(row.len()))
            .collect()
    }

    /// Checks that one more position fits and that the cache serves `model`.
    pub(super) fn check_step(&self, model: &Llama) -> Result<(), LayerError> {
        if self.len + 1 > self.capacity {
            return Err(ConfigError::CacheFull {
                tokens: self.len + 1,
                capacity: self.capacity,
            }
            .into());
        }
        self.check_model(model)
    }

    fn check_model(&self, model: &Llama) -> Result<(), LayerError> {
        if self.layers.len() != model.layers.len() {
            return Err(ConfigError::CacheUnusable {
                layers: self.layers.len(),
                blocks: model.layers.len(),
            }
            .into());
        }
        Ok(())
    }

    /// A cache with buffers of its own holding the same values (`clone` shares them).
    pub(super) fn duplicate(&self) -> Self {
        // `x · 1` is exact in every float dtype: a new buffer with the same bits' values.
        let own = |x: &Tensor<4>| x.clone().mul_scalar(1.0);
        Self {
            layers: self
                .layers
                .iter()
                .map(|layer| LayerCache {
                    k: own(&layer.k),
                    v: own(&layer.v),
                })
                .collect(),
            len: self.len,
            capacity: self.capacity,
            valid: self.valid.clone(),
        }
    }

    /// Counts one decoded position, a token in every row.
    pub(super) fn advance(&mut self) {
        for row in &mut self.valid {
            row.push(true);
        }
        self.len += 1;
    }

    /// One decoding step of `model` at the next position: its logits `[b, 1, v']`.
    pub(super) fn step(&mut self, model: &Llama, inputs: &StepInputs) -> Result<Tensor<3>, LayerError> {
        self.check_step(model)?;
        if !model.decodes_by_kernels() {
            // Latent attention's step is a cached pass of one position.
            let rows = vec![vec![false]; inputs.ids.dims()[0]];
            return model.forward_cached(inputs.ids.clone(), &rows, self);
        }
        let logits = self.record_step(model, inputs)?;
        self.advance();
        Ok(logits)
    }

    /// [`KvCache::step`] without counting the position: the run a graph records (its launches
    /// execute only when replayed, each replay checked with [`KvCache::check_step`]).
    pub(super) fn record_step(&mut self, model: &Llama, inputs: &StepInputs) -> Result<Tensor<3>, LayerError> {
        self.check_model(model)?;
        let layers = std::mem::take(&mut self.layers);
        model.decode_step(inputs, layers, self)
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
    /// Whether a decoding step runs the step kernels (`step.rs`): grouped-query attention's
    /// cache; latent attention's steps are cached passes of one position.
    pub(super) fn decodes_by_kernels(&self) -> bool {
        self.layers.iter().all(|block| block.attention.is_some())
    }

    /// The logits of `ids` after the cached positions, and the cache with them added.
    /// `padding[i]`: whether row `i`'s token at each of these positions is padding (left
    /// padding: only a prompt's first positions). A single position without padding runs the
    /// decoding step's kernels (`step.rs`). A pass that fails leaves the cache unusable
    /// ([`ConfigError::CacheUnusable`] from then on): its blocks were written in place.
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
        let device = ids.device();
        if s == 1 && padding.len() == b && padding.iter().all(|row| !row[0]) && self.decodes_by_kernels() {
            // A decoding step: the position on the device, two step kernels a block.
            let inputs = StepInputs {
                ids,
                position: positions(&[cache.len], &device),
                first: positions(&cache.first_tokens(), &device),
            };
            return cache.step(self, &inputs);
        }
        cache.check_model(self)?;
        let layers = std::mem::take(&mut cache.layers);
        for (row, pads) in cache.valid.iter_mut().zip(padding).take(b) {
            row.extend(pads.iter().map(|p| !p));
        }
        let blocked = cache.blocked(s, &device);
        let start = cache.len;
        let mut x = self.embedding.forward(ids)?;
        for (block, layer) in self.layers.iter().zip(layers) {
            let h = block.attention_norm.forward(x.clone())?;
            let (attention, layer) = match (&block.attention, &block.latent) {
                (Some(attention), _) => attend_cached(attention, h, layer, start, blocked.clone())?,
                (None, Some(latent)) => super::latent::attend_cached(latent, h, layer, start, blocked.clone())?,
                (None, None) => unreachable!("a block has grouped-query or latent attention"),
            };
            cache.layers.push(layer);
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
    cache: LayerCache,
    start: usize,
    blocked: Tensor<4, Bool>,
) -> Result<(Tensor<3>, LayerCache), LayerError> {
    let a = attention;
    let x = copy_to_tp(x, &a.tp)?;
    let [b, s, _] = x.dims();
    let (h, g, k) = (a.n_heads, a.n_kv_heads, a.head_dim);
    let heads = |y: Tensor<3>, n: usize| y.reshape([b, s, n, k]).swap_dims(1, 2);
    let q = a.norm_queries(heads(a.wq.forward(x.clone())?, h))?;
    let q = a.rope.apply_from(q, start); // [b, h, s, k]
    let new_k = a.norm_keys(heads(a.wk.forward(x.clone())?, g))?;
    let new_k = a.rope.apply_from(new_k, start); // [b, g, s, k]
    let new_v = heads(a.wv.forward(x)?, g);
    let t = start + s;
    // The cache moved in, so nothing else holds its buffers: written in place.
    let cache = LayerCache {
        k: cache.k.slice_assign([0..b, 0..g, start..t, 0..k], new_k),
        v: cache.v.slice_assign([0..b, 0..g, start..t, 0..k], new_v),
    };
    // Each kv head serves h/g query heads, in Hugging Face's order.
    let expand = |x: Tensor<4>| {
        x.narrow(2, 0, t)
            .unsqueeze_dim::<5>(2)
            .repeat_dim(2, h / g)
            .reshape([b, h, t, k])
    };
    let (keys, values) = (expand(cache.k.clone()), expand(cache.v.clone()));
    let dtype = q.dtype();
    // f32 products kept in f32 (Burn's CUDA matmul would round them to TF32).
    let scores = matmul(q.cast(DType::F32), keys.cast(DType::F32).swap_dims(2, 3)).div_scalar((k as f64).sqrt()); // [b, h, s, t]
    let weights = softmax(scores.mask_fill(blocked.expand([b, h, s, t]), f32::NEG_INFINITY), 3);
    let out = matmul(weights, values.cast(DType::F32)).cast(dtype); // [b, h, s, k]
    Ok((a.wo.forward(out.swap_dims(1, 2).reshape([b, s, h * k]))?, cache))
}
