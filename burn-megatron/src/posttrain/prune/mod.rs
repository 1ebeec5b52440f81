//! Structured pruning of a trained Llama, as NVIDIA's Minitron does it: rank the pieces by
//! their [`Importance`] on calibration text (`importance.rs`), keep the most important to a
//! [`PruneTarget`] (depth: whole blocks; width: embedding channels, FFN channels, query heads
//! within each kv group), and copy the kept rows and columns into a smaller model. The pruned
//! model is then distilled from the original (`crate::posttrain::distill`).
//!
//! Pruning runs at tp = 1 on dense blocks; the result saves and loads at any tp like any Llama
//! (its heads may then be narrower or wider than `d_model / n_heads`:
//! `ParallelAttentionConfig::head_dim`).
//!
//! Legend: `v` vocabulary, `d` embedding channels, `f` FFN channels, `h` query heads, `g` kv
//! heads, `k` head_dim; primes are the pruned sizes.

mod importance;

pub use importance::{Importance, importance, top};

use burn::module::Param;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_megatron_dist::ProcessGroups;

use crate::error::LayerError;
use crate::init::{InitMode, ParamInit};
use crate::models::llama::{Llama, LlamaBlock, LlamaConfig};
use crate::precision::ptq::PtqError;

#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum PruneError {
    #[error("pruning runs at tp = 1 (this model is split over tp = {tp}); the pruned model loads at any tp")]
    TensorParallel { tp: usize },
    #[error("mixture-of-experts blocks are not pruned")]
    MixtureOfExperts,
    #[error("latent attention is not pruned: its heads are no grouped-query heads")]
    LatentAttention,
    #[error("{what} = {asked} cannot be kept: the model has {has} (keep at least 1)")]
    Target {
        what: &'static str,
        asked: usize,
        has: usize,
    },
    #[error("the importance was measured on another model: {what}")]
    Importance { what: &'static str },
    #[error(transparent)]
    Layer(#[from] LayerError),
}

impl From<PtqError> for PruneError {
    fn from(e: PtqError) -> Self {
        match e {
            PtqError::TensorParallel { tp } => PruneError::TensorParallel { tp },
            PtqError::MixtureOfExperts => PruneError::MixtureOfExperts,
            PtqError::LatentAttention => PruneError::LatentAttention,
            PtqError::Layer(e) => PruneError::Layer(e),
            // Importance calibrates with batches and no sample.
            PtqError::NoCalibration | PtqError::NoSample => PruneError::Importance {
                what: "no calibration batches",
            },
            // Importance only calibrates; nothing is rounded.
            PtqError::NoHessian | PtqError::GptqScheme { .. } | PtqError::GptqHessian { .. } => {
                PruneError::Importance {
                    what: "a quantization setting",
                }
            }
        }
    }
}

/// The sizes a pruned model keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PruneTarget {
    pub n_layers: usize,
    pub d_model: usize,
    pub d_ff: usize,
    /// Query heads kept for each kv head (all kv heads stay).
    pub heads_per_kv: usize,
}

impl PruneTarget {
    /// The sizes of `config` as it is.
    pub fn of(config: &LlamaConfig) -> Self {
        let a = &config.attention;
        Self {
            n_layers: config.n_layers,
            d_model: a.d_model,
            d_ff: config.mlp.d_ff,
            heads_per_kv: a.n_heads / a.n_kv_heads.max(1),
        }
    }

    /// `config` at these sizes (heads `head_dim` wide as before).
    pub fn apply(&self, config: &LlamaConfig) -> LlamaConfig {
        let mut pruned = config.clone();
        let head_dim = config.attention.head_dim();
        let n_heads = config.attention.n_kv_heads * self.heads_per_kv;
        pruned.n_layers = self.n_layers;
        pruned.embedding.d_model = self.d_model;
        pruned.attention.d_model = self.d_model;
        pruned.attention.n_heads = n_heads;
        pruned.attention.head_dim = (n_heads * head_dim != self.d_model).then_some(head_dim);
        pruned.mlp.d_model = self.d_model;
        pruned.mlp.d_ff = self.d_ff;
        pruned.norm.d_model = self.d_model;
        pruned.output.d_input = self.d_model;
        pruned
    }
}

/// `model` (built from `config`, tp = 1) pruned to `target` by `importance`: the configuration
/// of the pruned model and the model, holding the original's kept rows and columns.
pub fn prune(
    model: &Llama,
    config: &LlamaConfig,
    importance: &Importance,
    target: PruneTarget,
) -> Result<(LlamaConfig, Llama), PruneError> {
    let tp = model.embedding.tp.size();
    if tp > 1 {
        return Err(PruneError::TensorParallel { tp });
    }
    if model.layers.iter().any(|b| b.moe.is_some()) {
        return Err(PruneError::MixtureOfExperts);
    }
    if model.layers.iter().any(|b| b.latent.is_some()) {
        return Err(PruneError::LatentAttention);
    }
    let has = PruneTarget::of(config);
    for (what, asked, has) in [
        ("n_layers", target.n_layers, has.n_layers),
        ("d_model", target.d_model, has.d_model),
        ("d_ff", target.d_ff, has.d_ff),
        ("heads_per_kv", target.heads_per_kv, has.heads_per_kv),
    ] {
        if asked == 0 || asked > has {
            return Err(PruneError::Target { what, asked, has });
        }
    }
    if importance.blocks.len() != model.layers.len() || importance.embedding.len() != has.d_model {
        return Err(PruneError::Importance {
            what: "its blocks or embedding channels",
        });
    }
    let pruned_config = target.apply(config);
    let device = model.embedding.weight.device();
    let mut pruned = pruned_config.init(&device, &ProcessGroups::single(), &ParamInit::new(0, InitMode::Full))?;

    let blocks: Vec<f32> = importance.blocks.iter().map(|b| *b as f32).collect();
    let kept_blocks = top(&blocks, target.n_layers);
    let emb = indices(&top(&importance.embedding, target.d_model), &device);
    set(
        &mut pruned.embedding.weight,
        model.embedding.weight.val().select(1, emb.clone()),
    );
    set(&mut pruned.norm.weight, model.norm.weight.val().select(0, emb.clone()));
    if let (Some(out), Some(from)) = (pruned.output.as_mut(), model.output.as_ref()) {
        set(&mut out.weight, from.weight.val().select(0, emb.clone()));
    }
    for (new, &old) in pruned.layers.iter_mut().zip(&kept_blocks) {
        let heads = kept_heads(&model.layers[old], &importance.heads[old], target.heads_per_kv);
        let ffn = top(&importance.ffn[old], target.d_ff);
        copy_block(
            new,
            &model.layers[old],
            &emb,
            &indices(&heads, &device),
            &indices(&ffn, &device),
        );
    }
    Ok((pruned_config, pruned))
}

/// The output columns of the query heads kept in `block`: the `per_kv` most important of each
/// kv group, in order.
fn kept_heads(block: &LlamaBlock, scores: &[f32], per_kv: usize) -> Vec<usize> {
    let a = block.attention.as_ref().expect("checked: grouped-query attention");
    let group = a.n_heads / a.n_kv_heads;
    let k = a.head_dim;
    (0..a.n_kv_heads)
        .flat_map(|g| {
            top(&scores[g * group..(g + 1) * group], per_kv)
                .into_iter()
                .map(move |h| g * group + h)
        })
        .flat_map(|h| h * k..(h + 1) * k)
        .collect()
}

/// `new`'s weights from `old`'s kept embedding channels `emb`, query columns `q` and FFN
/// channels `ffn`.
fn copy_block(new: &mut LlamaBlock, old: &LlamaBlock, emb: &Tensor<1, Int>, q: &Tensor<1, Int>, ffn: &Tensor<1, Int>) {
    let rows = |w: Tensor<2>| w.select(0, emb.clone()); // [d, ·] → [d', ·]
    set(
        &mut new.attention_norm.weight,
        old.attention_norm.weight.val().select(0, emb.clone()),
    );
    set(
        &mut new.mlp_norm.weight,
        old.mlp_norm.weight.val().select(0, emb.clone()),
    );
    let checked = "checked: grouped-query attention";
    let (a, b) = (
        new.attention.as_mut().expect(checked),
        old.attention.as_ref().expect(checked),
    );
    set(&mut a.wq.weight, rows(b.wq.weight.val()).select(1, q.clone()));
    set(&mut a.wk.weight, rows(b.wk.weight.val()));
    set(&mut a.wv.weight, rows(b.wv.weight.val()));
    set(
        &mut a.wo.weight,
        b.wo.weight.val().select(0, q.clone()).select(1, emb.clone()),
    );
    let (Some(m), Some(n)) = (new.mlp.as_mut(), old.mlp.as_ref()) else {
        unreachable!("dense blocks are checked")
    };
    set(&mut m.w1.weight, rows(n.w1.weight.val()).select(1, ffn.clone()));
    set(&mut m.w3.weight, rows(n.w3.weight.val()).select(1, ffn.clone()));
    set(
        &mut m.w2.weight,
        n.w2.weight.val().select(0, ffn.clone()).select(1, emb.clone()),
    );
}

fn indices(kept: &[usize], device: &Device) -> Tensor<1, Int> {
    let values: Vec<i64> = kept.iter().map(|&i| i as i64).collect();
    Tensor::from_data(TensorData::new(values, [kept.len()]), device)
}

/// `param` holding `value` (its id kept).
fn set<const D: usize>(param: &mut Param<Tensor<D>>, value: Tensor<D>) {
    *param = param.clone().map(|old| value.cast(old.dtype()));
}
