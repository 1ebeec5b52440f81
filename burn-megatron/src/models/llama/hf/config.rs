//! `config.json`: read in transformers 4.x's layout (`rope_theta`, `rope_scaling`) or 5.x's
//! (`rope_parameters` holding `rope_theta`, `rope_type` and the scaling fields), refusing by
//! name every field whose value this model does not build; written in 5.x's layout with the
//! fields transformers needs to open it.

use std::path::Path;

use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::{HfError, format_error, io};
use crate::layers::RopeScaling;
use crate::models::llama::{Llama, LlamaConfig, WordEmbeddings};

/// What this model reads of a Hugging Face Llama `config.json`, checked.
#[derive(Clone, Debug, PartialEq)]
pub struct HfConfig {
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
#[derive(Deserialize)]
struct Raw {
    model_type: Option<String>,
    hidden_size: usize,
    intermediate_size: usize,
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
    attention_bias: bool,
    #[serde(default)]
    mlp_bias: bool,
    rope_theta: Option<f64>,
    rope_scaling: Option<Map<String, Value>>,
    rope_parameters: Option<Map<String, Value>>,
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
        if let Some(model_type) = raw.model_type.as_deref().filter(|t| *t != "llama") {
            return Err(unsupported("model_type", model_type, "only Llama is built"));
        }
        if raw.hidden_act != "silu" {
            return Err(unsupported("hidden_act", &raw.hidden_act, "the MLP is SwiGLU (silu)"));
        }
        if raw.attention_bias {
            return Err(unsupported(
                "attention_bias",
                true,
                "attention projections have no bias",
            ));
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
        config
    }

    /// The configuration of `config`'s model (planned or not: the vocabulary is the unpadded one).
    pub fn from_llama(config: &LlamaConfig) -> Self {
        Self {
            hidden_size: config.attention.d_model,
            intermediate_size: config.mlp.d_ff,
            num_hidden_layers: config.n_layers,
            num_attention_heads: config.attention.n_heads,
            num_key_value_heads: config.attention.n_kv_heads,
            head_dim: config.attention.head_dim(),
            vocab_size: config.embedding.vocab_size,
            max_position_embeddings: config.attention.max_seq_len,
            rope_theta: config.attention.rope_theta,
            rope_scaling: config.attention.rope_scaling,
            rms_norm_eps: config.norm.epsilon,
            tie_word_embeddings: config.word_embeddings == WordEmbeddings::Tied,
        }
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
        }
        json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "attention_bias": false,
            "attention_dropout": 0.0,
            "mlp_bias": false,
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
        })
    }

    /// Checks this configuration against `model`, built at `tp`: every size, the heads, the
    /// vocabulary, tied or not, the rope and the norm's ε.
    pub fn check_model(&self, model: &Llama, tp: usize) -> Result<(), HfError> {
        let mismatch = |field: &'static str, checkpoint: String, model: String| {
            if checkpoint == model {
                Ok(())
            } else {
                Err(HfError::Mismatch {
                    field,
                    checkpoint,
                    model,
                })
            }
        };
        if model.layers.iter().any(|layer| layer.moe.is_some()) {
            return Err(HfError::Unsupported {
                field: "model_type",
                value: "llama".into(),
                detail: "this model has mixture-of-experts blocks; a Hugging Face Llama's blocks are dense".into(),
            });
        }
        let s = |v: usize| v.to_string();
        let [_, d] = model.embedding.weight.dims();
        mismatch("hidden_size", s(self.hidden_size), s(d))?;
        mismatch("vocab_size", s(self.vocab_size), s(model.embedding.vocab_size))?;
        mismatch("num_hidden_layers", s(self.num_hidden_layers), s(model.layers.len()))?;
        let tied = model.word_embeddings() == WordEmbeddings::Tied;
        mismatch(
            "tie_word_embeddings",
            self.tie_word_embeddings.to_string(),
            tied.to_string(),
        )?;
        mismatch(
            "rms_norm_eps",
            self.rms_norm_eps.to_string(),
            model.norm.epsilon.to_string(),
        )?;
        if let Some(layer) = model.layers.first() {
            let attention = &layer.attention;
            mismatch(
                "num_attention_heads",
                s(self.num_attention_heads),
                s(attention.n_heads * tp),
            )?;
            mismatch(
                "num_key_value_heads",
                s(self.num_key_value_heads),
                s(attention.n_kv_heads * tp),
            )?;
            mismatch("head_dim", s(self.head_dim), s(attention.head_dim))?;
            let [_, f] = layer.mlp.as_ref().map_or([0, 0], |mlp| mlp.w1.weight.dims());
            mismatch("intermediate_size", s(self.intermediate_size), s(f * tp))?;
            mismatch(
                "rope_theta",
                self.rope_theta.to_string(),
                attention.rope.theta().to_string(),
            )?;
            mismatch(
                "rope_scaling",
                format!("{:?}", self.rope_scaling),
                format!("{:?}", attention.rope.scaling()),
            )?;
        }
        Ok(())
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
        other => {
            return Err(unsupported(
                "rope_type",
                other,
                "the rope types built are default, linear and llama3",
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
        assert_eq!(HfConfig::from_llama(&config.to_llama()), config);
    }

    #[test]
    fn a_missing_scaling_field_is_named() {
        let err = parse(&format!(
            r#"{{{SIZES}, "rope_parameters": {{"rope_type": "llama3", "factor": 8.0}}}}"#
        ))
        .unwrap_err();
        assert!(err.to_string().contains("low_freq_factor"), "{err}");
    }

    /// A model with mixture-of-experts blocks is no Hugging Face Llama: checking it against a
    /// Llama config (as load and export do) is a typed error naming why.
    #[test]
    fn a_mixture_of_experts_is_refused() {
        use burn_megatron_dist::ProcessGroups;

        use crate::init::{InitMode, ParamInit};
        use crate::models::llama::recipes;
        let config = recipes::tiny_moe().model;
        let hf = HfConfig::from_llama(&config);
        let model = config
            .init(
                &burn::tensor::Device::flex(),
                &ProcessGroups::single(),
                &ParamInit::new(0, InitMode::Full),
            )
            .unwrap();
        match hf.check_model(&model, 1) {
            Err(HfError::Unsupported { field, detail, .. }) => {
                assert_eq!(field, "model_type");
                assert!(detail.contains("mixture-of-experts"), "{detail}");
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
    }
}
