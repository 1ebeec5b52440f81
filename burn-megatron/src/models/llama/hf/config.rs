//! `config.json`: read in transformers 4.x's layout (`rope_theta`, `rope_scaling`) or 5.x's
//! (`rope_parameters` holding `rope_theta`, `rope_type` and the scaling fields), refusing by
//! name every field whose value this model does not build; written in 5.x's layout with the
//! fields transformers needs to open it. What each family adds to the Llama's fields is its
//! own file's (`family/`).

use std::path::Path;

use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::family::{Choices, DeepseekRouting, Family, HfLatent, HfMoe};
use super::{HfError, format_error, io};
use crate::layers::LatentAttentionConfig;
use crate::layers::RopeScaling;
use crate::layers::moe::{GroupLimit, MoeConfig, RouterConfig, Scoring};
use crate::models::llama::{Llama, LlamaBlock, LlamaConfig, LlamaStage, MoeBlocks, WordEmbeddings};
use burn_megatron_dist::ProcessGroups;

/// What this model reads of a Hugging Face `config.json`, checked.
#[derive(Clone, Debug, PartialEq)]
pub struct HfConfig {
    /// The family the file names (`model_type`).
    pub family: Family,
    /// What the family chooses beyond the Llama's sizes and rope.
    pub choices: Choices,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub rms_norm_eps: f64,
    pub tie_word_embeddings: bool,
}

/// The file as transformers writes it; absent fields take transformers' `LlamaConfig` defaults.
/// The fields after `rope_parameters` are the families' own (`family/`).
#[derive(Deserialize)]
pub(super) struct Raw {
    model_type: Option<String>,
    hidden_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    vocab_size: usize,
    #[serde(default = "default_positions")]
    max_position_embeddings: usize,
    #[serde(default = "default_eps")]
    rms_norm_eps: f64,
    #[serde(default)]
    tie_word_embeddings: bool,
    #[serde(default = "default_act")]
    hidden_act: String,
    #[serde(default)]
    mlp_bias: bool,
    rope_theta: Option<f64>,
    rope_scaling: Option<Map<String, Value>>,
    rope_parameters: Option<Map<String, Value>>,
    #[serde(default)]
    pub attention_bias: bool,
    pub sliding_window: Option<usize>,
    pub use_sliding_window: Option<bool>,
    pub layer_types: Option<Vec<String>>,
    pub num_local_experts: Option<usize>,
    pub num_experts: Option<usize>,
    pub num_experts_per_tok: Option<usize>,
    pub moe_intermediate_size: Option<usize>,
    pub norm_topk_prob: Option<bool>,
    pub decoder_sparse_step: Option<usize>,
    pub mlp_only_layers: Option<Vec<usize>>,
    pub router_jitter_noise: Option<f64>,
    pub intermediate_size: usize,
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: Option<usize>,
    pub qk_nope_head_dim: Option<usize>,
    pub qk_rope_head_dim: Option<usize>,
    pub v_head_dim: Option<usize>,
    pub rope_interleave: Option<bool>,
    pub n_routed_experts: Option<usize>,
    pub n_shared_experts: Option<usize>,
    pub n_group: Option<usize>,
    pub topk_group: Option<usize>,
    pub first_k_dense_replace: Option<usize>,
    pub routed_scaling_factor: Option<f64>,
    pub scoring_func: Option<String>,
    pub topk_method: Option<String>,
    pub moe_layer_freq: Option<usize>,
    pub num_nextn_predict_layers: Option<usize>,
}

fn default_positions() -> usize {
    2048
}
fn default_eps() -> f64 {
    1e-6
}
fn default_act() -> String {
    "silu".into()
}

fn unsupported(field: &'static str, value: impl ToString, detail: &str) -> HfError {
    HfError::Unsupported {
        field,
        value: value.to_string(),
        detail: detail.to_string(),
    }
}

impl HfConfig {
    /// Parses and checks `text`, the contents of `path`.
    pub fn parse(text: &str, path: &Path) -> Result<Self, HfError> {
        let raw: Raw = serde_json::from_str(text).map_err(|e| format_error(path, e))?;
        let family = Family::of_model_type(raw.model_type.as_deref().unwrap_or("llama"))?;
        if raw.hidden_act != "silu" {
            return Err(unsupported("hidden_act", &raw.hidden_act, "the MLP is SwiGLU (silu)"));
        }
        if raw.mlp_bias {
            return Err(unsupported("mlp_bias", true, "MLP projections have no bias"));
        }
        let heads = raw.num_attention_heads.max(1);
        // transformers' default: the heads together as wide as the model.
        let head_dim = raw.head_dim.unwrap_or(raw.hidden_size / heads);
        if raw.head_dim.is_none() && !raw.hidden_size.is_multiple_of(heads) {
            return Err(unsupported(
                "num_attention_heads",
                heads,
                &format!(
                    "hidden_size {} is no multiple of it and no head_dim is given",
                    raw.hidden_size
                ),
            ));
        }
        let (rope_theta, rope_scaling) = rope(&raw, path)?;
        Self {
            family,
            choices: (family.spec().read)(&raw)?,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_hidden_layers: raw.num_hidden_layers,
            num_attention_heads: raw.num_attention_heads,
            num_key_value_heads: raw.num_key_value_heads.unwrap_or(raw.num_attention_heads),
            head_dim,
            vocab_size: raw.vocab_size,
            max_position_embeddings: raw.max_position_embeddings,
            rope_theta,
            rope_scaling,
            rms_norm_eps: raw.rms_norm_eps,
            tie_word_embeddings: raw.tie_word_embeddings,
        }
        .checked()
    }

    /// The configuration, its sizes checked ([`LlamaConfig::check_sizes`]) before anything is
    /// sized by them.
    pub fn checked(self) -> Result<Self, HfError> {
        self.to_llama().check_sizes().map_err(HfError::Size)?;
        Ok(self)
    }

    /// The model this configuration describes (no parallelism applied yet).
    pub fn to_llama(&self) -> LlamaConfig {
        let mut config = LlamaConfig::llama(
            self.vocab_size,
            self.hidden_size,
            self.num_hidden_layers,
            self.num_attention_heads,
            self.num_key_value_heads,
            self.intermediate_size,
            self.max_position_embeddings,
        );
        // Checked: a file's sizes may be anything before `check_sizes` refuses them.
        if self.head_dim.checked_mul(self.num_attention_heads) != Some(self.hidden_size) {
            config.attention.head_dim = Some(self.head_dim);
        }
        config.attention.rope_theta = self.rope_theta;
        config.attention.rope_scaling = self.rope_scaling;
        config.norm.epsilon = self.rms_norm_eps;
        config.word_embeddings = match self.tie_word_embeddings {
            true => WordEmbeddings::Tied,
            false => WordEmbeddings::Untied,
        };
        let choices = &self.choices;
        config.attention.qkv_bias = choices.qkv_bias;
        // The heads' norms take the model's ε (transformers' `Qwen3RMSNorm(head_dim, rms_norm_eps)`).
        config.attention.qk_norm = choices.qk_norm.then_some(self.rms_norm_eps);
        config.attention.sliding_window = choices.sliding_window;
        config.moe = choices.moe.map(|moe| {
            let router = RouterConfig::new(self.hidden_size, moe.experts, moe.top_k).with_normalize(moe.normalize);
            match moe.deepseek {
                Some(d) => {
                    let router = router
                        .with_scoring(Scoring::Sigmoid)
                        .with_expert_bias(true)
                        .with_group_limit(Some(GroupLimit::new(d.groups, d.top_groups)))
                        .with_scaling(d.scaling);
                    let shared = (d.shared_size > 0).then_some(d.shared_size);
                    let layer = MoeConfig::new(router, moe.expert_size).with_shared_d_ff(shared);
                    MoeBlocks::new(layer).with_first_dense(d.first_dense)
                }
                None => MoeBlocks::new(MoeConfig::new(router, moe.expert_size)),
            }
        });
        config.latent = choices.latent.map(|l| {
            LatentAttentionConfig::new(
                self.hidden_size,
                self.num_attention_heads,
                l.kv_rank,
                l.qk_nope_dim,
                l.qk_rope_dim,
                l.v_dim,
                self.max_position_embeddings,
            )
            .with_q_rank(l.q_rank)
            .with_rope_theta(self.rope_theta)
            .with_rope_scaling(self.rope_scaling)
        });
        config
    }

    /// The configuration of `config`'s model (planned or not: the vocabulary is the unpadded
    /// one), as the family that builds its choices ([`Family::of_choices`]); a choice no family
    /// here writes (a MoE block that is not every block, shared experts, sigmoid routing, …) is
    /// refused by name.
    pub fn from_llama(config: &LlamaConfig) -> Result<Self, HfError> {
        let moe = match &config.moe {
            Some(blocks) => Some(hf_moe(blocks)?),
            None => None,
        };
        let attention = &config.attention;
        let latent = config.latent.as_ref().map(|l| HfLatent {
            q_rank: l.q_rank,
            kv_rank: l.kv_rank,
            qk_nope_dim: l.qk_nope_dim,
            qk_rope_dim: l.qk_rope_dim,
            v_dim: l.v_dim,
            // Written in DeepSeek-V3's layout.
            interleaved: true,
        });
        let choices = Choices {
            qkv_bias: attention.qkv_bias,
            qk_norm: attention.qk_norm.is_some(),
            sliding_window: attention.sliding_window,
            moe,
            latent,
            mtp_layers: config.mtp.map_or(0, |m| m.depth),
        };
        if let Some(epsilon) = attention.qk_norm.filter(|e| *e != config.norm.epsilon) {
            return Err(unsupported(
                "rms_norm_eps",
                config.norm.epsilon,
                &format!("the heads' norms have ε {epsilon}: Hugging Face's share the model's"),
            ));
        }
        let family = Family::of_choices(&choices)?;
        // Mixtral's `intermediate_size` is its experts'; it has no dense block.
        let intermediate_size = match (family, &choices.moe) {
            (Family::Mixtral, Some(moe)) => moe.expert_size,
            _ => config.mlp.d_ff,
        };
        Ok(Self {
            family,
            choices,
            hidden_size: attention.d_model,
            intermediate_size,
            num_hidden_layers: config.n_layers,
            num_attention_heads: attention.n_heads,
            num_key_value_heads: attention.n_kv_heads,
            head_dim: attention.head_dim(),
            vocab_size: config.embedding.vocab_size,
            max_position_embeddings: attention.max_seq_len,
            rope_theta: attention.rope_theta,
            rope_scaling: attention.rope_scaling,
            rms_norm_eps: config.norm.epsilon,
            tie_word_embeddings: config.word_embeddings == WordEmbeddings::Tied,
        })
    }

    /// `config.json` as transformers 5.x writes it, for weights stored in `dtype` (`float32`,
    /// `bfloat16`); the rope also as 4.x's top-level `rope_theta`.
    pub fn to_json(&self, dtype: &str) -> Value {
        let mut rope = Map::new();
        rope.insert("rope_theta".into(), json!(self.rope_theta));
        match self.rope_scaling {
            RopeScaling::None => {
                rope.insert("rope_type".into(), json!("default"));
            }
            RopeScaling::Linear { factor } => {
                rope.insert("rope_type".into(), json!("linear"));
                rope.insert("factor".into(), json!(factor));
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                rope.insert("rope_type".into(), json!("llama3"));
                rope.insert("factor".into(), json!(factor));
                rope.insert("low_freq_factor".into(), json!(low_freq_factor));
                rope.insert("high_freq_factor".into(), json!(high_freq_factor));
                rope.insert(
                    "original_max_position_embeddings".into(),
                    json!(original_max_position_embeddings),
                );
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                attention_factor,
                mscale,
                mscale_all_dim,
                truncate,
            } => {
                rope.insert("rope_type".into(), json!("yarn"));
                rope.insert("factor".into(), json!(factor));
                rope.insert(
                    "original_max_position_embeddings".into(),
                    json!(original_max_position_embeddings),
                );
                rope.insert("beta_fast".into(), json!(beta_fast));
                rope.insert("beta_slow".into(), json!(beta_slow));
                rope.insert("truncate".into(), json!(truncate));
                for (field, value) in [
                    ("attention_factor", attention_factor),
                    ("mscale", mscale),
                    ("mscale_all_dim", mscale_all_dim),
                ] {
                    if let Some(value) = value {
                        rope.insert(field.into(), json!(value));
                    }
                }
            }
        }
        let mut json = json!({
            "architectures": [self.family.architecture()],
            "model_type": self.family.model_type(),
            "attention_dropout": 0.0,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": Value::Object(rope),
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": dtype,
            "dtype": dtype,
            "use_cache": true,
        });
        let fields = json.as_object_mut().expect("an object");
        (self.family.spec().write)(self, fields);
        json
    }

    /// Checks this configuration against `model`, built over `groups`: every size, the heads,
    /// the vocabulary, tied or not, the rope, the norm's ε, and the family's layer choices
    /// (q/k/v biases, the heads' norms, the experts).
    pub fn check_model(&self, model: &Llama, groups: &ProcessGroups) -> Result<(), HfError> {
        let [_, hidden] = model.embedding.weight.dims();
        self.check_outline(Outline {
            hidden,
            vocab: model.embedding.vocab_size,
            layers: model.layers.len(),
            tied: model.word_embeddings() == WordEmbeddings::Tied,
            epsilon: model.norm.epsilon,
        })?;
        if model.mtp.len() > self.choices.mtp_layers {
            return Err(HfError::Mismatch {
                field: "num_nextn_predict_layers",
                checkpoint: self.choices.mtp_layers.to_string(),
                model: format!("{} multi-token prediction modules", model.mtp.len()),
            });
        }
        let modules = model.mtp.iter().map(|m| (self.num_hidden_layers, &m.block));
        self.check_blocks(model.layers.iter().enumerate().chain(modules), groups)
    }

    /// Checks this configuration against a pipeline stage built over `groups` from `whole`, the
    /// whole model's configuration (which every stage knows, whichever parts it holds): as
    /// [`check_model`](Self::check_model), the blocks those the stage holds.
    pub fn check_stage(&self, stage: &LlamaStage, whole: &LlamaConfig, groups: &ProcessGroups) -> Result<(), HfError> {
        self.check_outline(Outline {
            hidden: whole.embedding.d_model,
            vocab: whole.embedding.vocab_size,
            layers: whole.n_layers,
            tied: whole.word_embeddings == WordEmbeddings::Tied,
            epsilon: whole.norm.epsilon,
        })?;
        let held = stage.layers.iter().enumerate();
        self.check_blocks(held.filter_map(|(i, block)| block.as_ref().map(|b| (i, b))), groups)
    }

    fn check_outline(&self, model: Outline) -> Result<(), HfError> {
        let s = |v: usize| v.to_string();
        mismatch("hidden_size", s(self.hidden_size), s(model.hidden))?;
        mismatch("vocab_size", s(self.vocab_size), s(model.vocab))?;
        mismatch("num_hidden_layers", s(self.num_hidden_layers), s(model.layers))?;
        mismatch(
            "tie_word_embeddings",
            self.tie_word_embeddings.to_string(),
            model.tied.to_string(),
        )?;
        mismatch("rms_norm_eps", self.rms_norm_eps.to_string(), model.epsilon.to_string())
    }

    /// The blocks `(index, block)`: heads, sizes, rope and the family's layer choices.
    fn check_blocks<'a>(
        &self,
        blocks: impl Iterator<Item = (usize, &'a LlamaBlock)>,
        groups: &ProcessGroups,
    ) -> Result<(), HfError> {
        let (s, tp) = (|v: usize| v.to_string(), groups.tp.size());
        let choices = &self.choices;
        for (i, layer) in blocks {
            let heads = match (&layer.attention, &layer.latent) {
                (Some(attention), _) => attention.n_heads,
                (None, Some(latent)) => latent.n_heads,
                (None, None) => unreachable!("a block has grouped-query or latent attention"),
            };
            mismatch("num_attention_heads", s(self.num_attention_heads), s(heads * tp))?;
            let rope = match (&layer.attention, &layer.latent) {
                (Some(attention), _) => {
                    mismatch(
                        "num_key_value_heads",
                        s(self.num_key_value_heads),
                        s(attention.n_kv_heads * tp),
                    )?;
                    mismatch("head_dim", s(self.head_dim), s(attention.head_dim))?;
                    let bias = attention.wq.bias.is_some();
                    mismatch("q/k/v biases", choices.qkv_bias.to_string(), bias.to_string())?;
                    let norms = attention.q_norm.is_some();
                    mismatch("q/k norms", choices.qk_norm.to_string(), norms.to_string())?;
                    mismatch("latent attention", format!("{:?}", choices.latent), "None".into())?;
                    &attention.rope
                }
                (None, Some(latent)) => {
                    let ours = HfLatent {
                        q_rank: latent.q_norm.as_ref().map(|norm| norm.weight.dims()[0]),
                        kv_rank: latent.kv_rank,
                        qk_nope_dim: latent.qk_nope_dim,
                        qk_rope_dim: latent.qk_rope_dim,
                        v_dim: latent.v_dim,
                        interleaved: choices.latent.is_some_and(|l| l.interleaved),
                    };
                    mismatch(
                        "latent attention",
                        format!("{:?}", choices.latent),
                        format!("{:?}", Some(ours)),
                    )?;
                    &latent.rope
                }
                (None, None) => unreachable!("a block has grouped-query or latent attention"),
            };
            if let Some(mlp) = &layer.mlp {
                let [_, f] = mlp.w1.weight.dims();
                mismatch("intermediate_size", s(self.intermediate_size), s(f * tp))?;
            }
            mismatch("rope_theta", self.rope_theta.to_string(), rope.theta().to_string())?;
            mismatch(
                "rope_scaling",
                format!("{:?}", self.rope_scaling),
                format!("{:?}", rope.scaling()),
            )?;
            // The experts block `i` should have, and those it has.
            let first_dense = choices.moe.and_then(|m| m.deepseek).map_or(0, |d| d.first_dense);
            let expected = choices.moe.filter(|_| i >= first_dense);
            let experts = layer.moe.as_ref().map(|moe| {
                let settings = &moe.router.settings;
                let deepseek = (settings.scoring == Scoring::Sigmoid).then(|| {
                    let limit = settings.group_limit.unwrap_or(GroupLimit::new(1, 1));
                    DeepseekRouting {
                        groups: limit.groups,
                        top_groups: limit.top_groups,
                        scaling: settings.scaling,
                        shared_size: moe.shared.as_ref().map_or(0, |mlp| mlp.w1.weight.dims()[1] * tp),
                        first_dense,
                    }
                });
                HfMoe {
                    experts: moe.n_experts,
                    top_k: settings.top_k,
                    expert_size: moe.experts.w1.dims()[2] * groups.etp.size(),
                    normalize: settings.normalize,
                    deepseek,
                }
            });
            mismatch("mixture of experts", format!("{expected:?}"), format!("{experts:?}"))?;
        }
        Ok(())
    }
}

/// What a model has where the checkpoint's config says otherwise, by the config's field.
fn mismatch(field: &'static str, checkpoint: String, model: String) -> Result<(), HfError> {
    match checkpoint == model {
        true => Ok(()),
        false => Err(HfError::Mismatch {
            field,
            checkpoint,
            model,
        }),
    }
}

/// The whole model's sizes a checkpoint's config must match.
struct Outline {
    hidden: usize,
    vocab: usize,
    layers: usize,
    tied: bool,
    epsilon: f64,
}

/// A model's MoE blocks as a Hugging Face family's experts: every block with softmax routing
/// and nothing else (Mixtral, Qwen3-MoE), or DeepSeek-V3's routing after its dense blocks;
/// anything else refused by name.
fn hf_moe(blocks: &MoeBlocks) -> Result<HfMoe, HfError> {
    let router = &blocks.layer.router;
    let refuse = |what: &str, value: String| {
        Err(unsupported(
            "model_type",
            value,
            &format!("the MoE families written (Mixtral, Qwen3-MoE, DeepSeek-V3) have no {what}"),
        ))
    };
    if blocks.every != 1 {
        return refuse("MoE blocks between dense ones", format!("every {}", blocks.every));
    }
    if let Some(capacity) = &blocks.layer.capacity {
        return refuse("expert capacity", format!("{capacity:?}"));
    }
    let moe = |deepseek| HfMoe {
        experts: router.n_experts,
        top_k: router.top_k,
        expert_size: blocks.layer.d_ff,
        normalize: router.normalize,
        deepseek,
    };
    match router.scoring {
        Scoring::Sigmoid => {
            // DeepSeek-V3's: a selection bias, groups (one group: none), a shared expert of
            // whole routed experts' size (or none).
            let shared = blocks.layer.shared_d_ff.unwrap_or(0);
            if !router.expert_bias || !shared.is_multiple_of(blocks.layer.d_ff.max(1)) {
                return refuse(
                    "sigmoid routing without a selection bias, or shared experts of another size",
                    format!("bias {}, shared {shared}", router.expert_bias),
                );
            }
            let limit = router.group_limit.unwrap_or(GroupLimit::new(1, 1));
            Ok(moe(Some(DeepseekRouting {
                groups: limit.groups,
                top_groups: limit.top_groups,
                scaling: router.scaling,
                shared_size: shared,
                first_dense: blocks.first_dense,
            })))
        }
        Scoring::Softmax => {
            if blocks.first_dense != 0 {
                return refuse("dense blocks", format!("first {} dense", blocks.first_dense));
            }
            if let Some(f) = blocks.layer.shared_d_ff {
                return refuse("shared experts with softmax routing", format!("a shared expert of {f}"));
            }
            if router.expert_bias || router.group_limit.is_some() || router.scaling != 1.0 {
                return refuse(
                    "expert bias, group-limited routing or weight scaling with softmax routing",
                    format!(
                        "bias {}, groups {:?}, scaling {}",
                        router.expert_bias, router.group_limit, router.scaling
                    ),
                );
            }
            Ok(moe(None))
        }
    }
}

/// θ and the scaling, from `rope_parameters` (5.x) or `rope_theta` and `rope_scaling` (4.x).
fn rope(raw: &Raw, path: &Path) -> Result<(f64, RopeScaling), HfError> {
    let empty = Map::new();
    let (params, theta) = match &raw.rope_parameters {
        Some(p) => (p, p.get("rope_theta").and_then(Value::as_f64).or(raw.rope_theta)),
        None => (raw.rope_scaling.as_ref().unwrap_or(&empty), raw.rope_theta),
    };
    let theta = theta.unwrap_or(10000.0);
    // 4.x wrote the type as `type` before `rope_type`.
    let kind = params
        .get("rope_type")
        .or_else(|| params.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    if let Some(p) = params
        .get("partial_rotary_factor")
        .and_then(Value::as_f64)
        .filter(|p| *p != 1.0)
    {
        return Err(unsupported("partial_rotary_factor", p, "RoPE rotates whole heads"));
    }
    let number = |field: &str| {
        params
            .get(field)
            .and_then(Value::as_f64)
            .ok_or_else(|| format_error(path, format!("rope type {kind} needs a number {field}")))
    };
    let scaling = match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear {
            factor: number("factor")?,
        },
        "llama3" => RopeScaling::Llama3 {
            factor: number("factor")?,
            low_freq_factor: number("low_freq_factor")?,
            high_freq_factor: number("high_freq_factor")?,
            original_max_position_embeddings: number("original_max_position_embeddings")? as usize,
        },
        "yarn" => {
            let original = number("original_max_position_embeddings")?;
            // transformers: no factor stretches the original positions to the model's.
            let factor = params
                .get("factor")
                .and_then(Value::as_f64)
                .unwrap_or(raw.max_position_embeddings as f64 / original);
            let optional = |field: &str| params.get(field).and_then(Value::as_f64);
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: original as usize,
                // transformers takes a missing or zero β as its default.
                beta_fast: optional("beta_fast").filter(|b| *b != 0.0).unwrap_or(32.0),
                beta_slow: optional("beta_slow").filter(|b| *b != 0.0).unwrap_or(1.0),
                attention_factor: optional("attention_factor"),
                mscale: optional("mscale"),
                mscale_all_dim: optional("mscale_all_dim"),
                truncate: params.get("truncate").and_then(Value::as_bool).unwrap_or(true),
            }
        }
        other => {
            return Err(unsupported(
                "rope_type",
                other,
                "the rope types built are default, linear, llama3 and yarn",
            ));
        }
    };
    Ok((theta, scaling))
}

/// Reads and checks `dir/config.json`.
pub fn read_config(dir: &Path) -> Result<HfConfig, HfError> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| io(&path, e))?;
    HfConfig::parse(&text, &path)
}

/// Our model configuration for the checkpoint in `dir` (no parallelism applied yet: plan it).
pub fn config(dir: &Path) -> Result<LlamaConfig, HfError> {
    Ok(read_config(dir)?.to_llama())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<HfConfig, HfError> {
        HfConfig::parse(json, Path::new("config.json"))
    }

    const SIZES: &str = r#""hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "vocab_size": 99"#;

    #[test]
    fn both_rope_layouts_read_the_same() {
        let v5 = parse(&format!(
            r#"{{{SIZES}, "rope_parameters": {{"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}}}}"#
        ))
        .unwrap();
        let v4 = parse(&format!(
            r#"{{{SIZES}, "rope_theta": 5e5, "rope_scaling": {{"type": "linear", "factor": 2.0}}}}"#
        ))
        .unwrap();
        assert_eq!(v5, v4);
        assert_eq!(v5.rope_scaling, RopeScaling::Linear { factor: 2.0 });
        assert_eq!(v5.rope_theta, 5e5);
        let plain = parse(&format!(r#"{{{SIZES}, "rope_scaling": null}}"#)).unwrap();
        assert_eq!((plain.rope_theta, plain.rope_scaling), (10000.0, RopeScaling::None));
        assert_eq!(plain.num_key_value_heads, 4);
    }

    #[test]
    fn the_export_reads_back() {
        let config = parse(&format!(
            r#"{{{SIZES}, "tie_word_embeddings": true, "rms_norm_eps": 1e-5, "rope_parameters":
            {{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16, "rope_theta": 5e5}}}}"#
        ))
        .unwrap();
        let text = config.to_json("float32").to_string();
        assert_eq!(parse(&text).unwrap(), config);
        assert_eq!(HfConfig::from_llama(&config.to_llama()).unwrap(), config);
    }

    #[test]
    fn a_missing_scaling_field_is_named() {
        let err = parse(&format!(
            r#"{{{SIZES}, "rope_parameters": {{"rope_type": "llama3", "factor": 8.0}}}}"#
        ))
        .unwrap_err();
        assert!(err.to_string().contains("low_freq_factor"), "{err}");
    }

    /// Softmax top-k renormalized is Mixtral, with the heads' norms Qwen3-MoE; DeepSeek-V3's
    /// routing (sigmoid with a selection bias) is written only with its latent attention, and
    /// sigmoid routing without a bias by no family: each refusal names why.
    #[test]
    fn experts_are_written_as_the_family_that_has_them() {
        use crate::layers::moe::Scoring;
        use crate::models::llama::recipes;
        let mut config = recipes::tiny_moe().model;
        let moe = config.moe.as_mut().unwrap();
        moe.layer.router.normalize = true;
        moe.layer.router.aux_loss = 1e-2;
        assert_eq!(HfConfig::from_llama(&config).unwrap().family, Family::Mixtral);
        config.attention.qk_norm = Some(config.norm.epsilon);
        assert_eq!(HfConfig::from_llama(&config).unwrap().family, Family::Qwen3Moe);
        let refusal = |config: &LlamaConfig| match HfConfig::from_llama(config) {
            Err(HfError::Unsupported { field, detail, .. }) => {
                assert_eq!(field, "model_type");
                detail
            }
            other => panic!("expected a refusal, got {other:?}"),
        };
        config.moe.as_mut().unwrap().layer.router.scoring = Scoring::Sigmoid;
        assert!(refusal(&config).contains("without a selection bias"));
        config.moe.as_mut().unwrap().layer.router.expert_bias = true;
        assert!(refusal(&config).contains("DeepseekRouting"));
    }

    /// Each family's own fields read back as they are written, the MoE ones with their experts.
    #[test]
    fn every_family_reads_back_its_export() {
        let softmax = HfMoe {
            experts: 4,
            top_k: 2,
            expert_size: 32,
            normalize: true,
            deepseek: None,
        };
        let moe = Some(softmax);
        let deepseek = Some(HfMoe {
            deepseek: Some(DeepseekRouting {
                groups: 2,
                top_groups: 1,
                scaling: 2.5,
                shared_size: 64,
                first_dense: 1,
            }),
            ..softmax
        });
        let latent = Some(HfLatent {
            q_rank: None,
            kv_rank: 16,
            qk_nope_dim: 8,
            qk_rope_dim: 4,
            v_dim: 8,
            interleaved: true,
        });
        for (family, choices) in [
            (Family::Llama, Choices::default()),
            (
                Family::Mistral,
                Choices {
                    sliding_window: Some(32),
                    ..Choices::default()
                },
            ),
            (
                Family::Qwen2,
                Choices {
                    qkv_bias: true,
                    ..Choices::default()
                },
            ),
            (
                Family::Qwen3,
                Choices {
                    qk_norm: true,
                    sliding_window: Some(8),
                    ..Choices::default()
                },
            ),
            (
                Family::Mixtral,
                Choices {
                    moe,
                    ..Choices::default()
                },
            ),
            (
                Family::Qwen3Moe,
                Choices {
                    qk_norm: true,
                    moe,
                    ..Choices::default()
                },
            ),
            (
                Family::DeepseekV3,
                Choices {
                    moe: deepseek,
                    latent,
                    ..Choices::default()
                },
            ),
        ] {
            let mut config = parse(&format!(r#"{{{SIZES}}}"#)).unwrap();
            (config.family, config.choices) = (family, choices);
            if family == Family::Mixtral {
                config.intermediate_size = 32;
            }
            let back = parse(&config.to_json("float32").to_string()).unwrap();
            assert_eq!(back, config, "{family:?}");
            assert_eq!(HfConfig::from_llama(&config.to_llama()).unwrap(), config, "{family:?}");
        }
    }
}
