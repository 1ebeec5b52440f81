//! One decoding step on the device alone: every row's new token at one position, each block's
//! keys and values appended to the cache in place and the query attending to it through the two
//! step kernels (`burn_megatron_kernels::decode`). The position and each row's first token are
//! device tensors and nothing is read back, so on CUDA the step can be recorded as a graph
//! (`graph.rs`) and replayed with only its inputs rewritten.

use burn::tensor::Tensor;
use burn_megatron_dist::mappings::copy_to_tp;
use burn_megatron_kernels::decode::{cache_append, decode_attention};

use super::cache::{KvCache, LayerCache, StepInputs};
use crate::error::{ConfigError, LayerError};
use crate::layers::ParallelAttention;
use crate::models::llama::{Llama, MoeReport};

impl Llama {
    /// The logits `[b, 1, v']` of one decoding step over `layers`, the cache's blocks (taken
    /// from `cache`, put back written). The caller advances the cache's length.
    pub(super) fn decode_step(
        &self,
        inputs: &StepInputs,
        layers: Vec<LayerCache>,
        cache: &mut KvCache,
    ) -> Result<Tensor<3>, LayerError> {
        let mut x = self.embedding.forward(inputs.ids.clone())?;
        for (block, layer) in self.layers.iter().zip(layers) {
            let h = block.attention_norm.forward(x.clone())?;
            // `decodes_by_kernels`: every block has grouped-query attention here.
            let attention = block.attention.as_ref().ok_or(ConfigError::DecodingLatentAttention)?;
            let (attention, layer) = attend_step(attention, h, layer, inputs)?;
            cache.layers.push(layer);
            x = block.feed_forward(x + attention, &mut MoeReport::default())?;
        }
        self.head(x)
    }
}

/// Attention of one new token a row over the cache, its key and value appended first.
///
/// # Shapes
/// `x`: `[b, 1, d]` → `[b, 1, d]`
fn attend_step(
    a: &ParallelAttention,
    x: Tensor<3>,
    cache: LayerCache,
    inputs: &StepInputs,
) -> Result<(Tensor<3>, LayerCache), LayerError> {
    let x = copy_to_tp(x, &a.tp)?;
    let b = x.dims()[0];
    let rows = |y: Tensor<3>| {
        let width = y.dims()[2];
        y.reshape([b, width])
    };
    // Each head RMS-normalized before the kernels rotate it, where the layer says.
    let heads = |y: Tensor<3>, n: usize| y.reshape([b, n, a.head_dim]);
    let q = rows(
        a.norm_queries(heads(a.wq.forward(x.clone())?, a.n_heads))?
            .reshape([b, 1, a.n_heads * a.head_dim]),
    );
    let new_k = a.norm_keys(heads(a.wk.forward(x.clone())?, a.n_kv_heads))?;
    let new_k = rows(new_k.reshape([b, 1, a.n_kv_heads * a.head_dim]));
    let new_v = rows(a.wv.forward(x)?);
    let tables = a.rope.tables();
    // The cache moved in, so nothing else holds its buffers: appended in place.
    let keys = cache_append(cache.k, new_k, tables.clone(), inputs.position.clone(), true);
    let values = cache_append(cache.v, new_v, tables.clone(), inputs.position.clone(), false);
    let out = decode_attention(
        q,
        keys.clone(),
        values.clone(),
        tables,
        inputs.position.clone(),
        inputs.first.clone(),
    );
    let width = out.dims()[1];
    let y = a.wo.forward(out.reshape([b, 1, width]))?;
    Ok((y, LayerCache { k: keys, v: values }))
}
