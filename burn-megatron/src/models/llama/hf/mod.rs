//! Hugging Face Llama checkpoints: `config.json` plus `model.safetensors`, or shards listed in
//! `model.safetensors.index.json`.
//!
//! - [`config`] builds our [`LlamaConfig`] from `config.json` (transformers 4.x's `rope_theta` +
//!   `rope_scaling` or 5.x's `rope_parameters`), refusing by name what this model does not
//!   build (`config.rs`);
//! - [`load`] reads each rank's slice of every tensor from memory-mapped files, after checking
//!   the checkpoint's configuration against the model, and refuses tensors it does not use
//!   (`load.rs`);
//! - [`save`] writes the model whole, in f32 or bf16, in shards of at most 5 GB, with a
//!   `config.json` that transformers' `AutoModelForCausalLM` opens (`export.rs`);
//!   [`save_quantized`] writes a post-training quantization in compressed-tensors' 8-bit layout,
//!   which [`load`] reads back (`compressed.rs`).
//!
//! Names and layouts: Hugging Face stores linear weights as `[out, in]`, Burn as `[in, out]`, so
//! every projection is transposed on the way; both rotate the two halves of each head, so q and k
//! need no permutation. Tied word embeddings are one tensor, `model.embed_tokens.weight`.

mod compressed;
mod config;
mod export;
mod load;
mod tokenizer;

pub use compressed::{Compression, Input};
pub use config::{HfConfig, config, read_config};
pub use export::{ExportDType, ExportOptions, save, save_quantized};
pub use load::load;
pub use tokenizer::tokenizer;

use std::path::Path;

use burn_megatron_dist::CommError;

use crate::error::ConfigError;

#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum HfError {
    #[error("{path}: {detail}")]
    Io { path: String, detail: String },
    #[error("{path}: {detail}")]
    Format { path: String, detail: String },
    /// A configuration field this model does not build, such as `rope_type = "yarn"` or
    /// `attention_bias = true`.
    #[error("config.json: {field} = {value} is not supported: {detail}")]
    Unsupported {
        field: &'static str,
        value: String,
        detail: String,
    },
    /// The checkpoint's configuration disagrees with the model it is loaded into.
    #[error("config.json: {field} = {checkpoint}, but the model has {model}")]
    Mismatch {
        field: &'static str,
        checkpoint: String,
        model: String,
    },
    /// Tensors of the checkpoint that no parameter of the model takes.
    #[error("tensors in the checkpoint that the model has no parameter for: {names:?}")]
    LeftOver { names: Vec<String> },
    #[error("tensor {name}: {detail}")]
    Incompatible { name: String, detail: String },
    /// A size in the configuration past what any model has.
    #[error("config.json: {0}")]
    Size(ConfigError),
    /// A `tokenizer.json` that could not be read.
    #[error("{path}: {detail}")]
    Tokenizer { path: String, detail: String },
    #[error(transparent)]
    Comm(#[from] CommError),
}

fn io(path: &Path, e: std::io::Error) -> HfError {
    HfError::Io {
        path: path.display().to_string(),
        detail: e.to_string(),
    }
}

fn format_error(path: &Path, detail: impl ToString) -> HfError {
    HfError::Format {
        path: path.display().to_string(),
        detail: detail.to_string(),
    }
}

/// Our parameter path → (Hugging Face name, whether the weight is transposed).
fn hf_name(path: &str) -> Option<(String, bool)> {
    let fixed = match path {
        "embedding.weight" => Some(("model.embed_tokens.weight".to_string(), false)),
        "norm.weight" => Some(("model.norm.weight".to_string(), false)),
        "output.weight" => Some(("lm_head.weight".to_string(), true)),
        _ => None,
    };
    if fixed.is_some() {
        return fixed;
    }
    let rest = path.strip_prefix("layers.")?;
    let (index, field) = rest.split_once('.')?;
    let (name, transposed) = match field {
        "attention_norm.weight" => ("input_layernorm.weight", false),
        "mlp_norm.weight" => ("post_attention_layernorm.weight", false),
        "attention.wq.weight" => ("self_attn.q_proj.weight", true),
        "attention.wk.weight" => ("self_attn.k_proj.weight", true),
        "attention.wv.weight" => ("self_attn.v_proj.weight", true),
        "attention.wo.weight" => ("self_attn.o_proj.weight", true),
        "mlp.w1.weight" => ("mlp.gate_proj.weight", true),
        "mlp.w2.weight" => ("mlp.down_proj.weight", true),
        "mlp.w3.weight" => ("mlp.up_proj.weight", true),
        _ => return None,
    };
    Some((format!("model.layers.{index}.{name}"), transposed))
}

/// Whether our parameter `path` has the vocabulary along its split dim (padded to tp).
fn is_vocab(path: &str) -> bool {
    matches!(path, "embedding.weight" | "output.weight")
}

/// Our parameter path of a Hugging Face name (the inverse of the mapping above), for tests and
/// tools that compare with transformers by name.
pub fn our_path(hf: &str) -> Option<String> {
    let fixed = match hf {
        "model.embed_tokens.weight" => Some("embedding.weight"),
        "model.norm.weight" => Some("norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        _ => None,
    };
    if let Some(path) = fixed {
        return Some(path.to_string());
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (index, field) = rest.split_once('.')?;
    let ours = match field {
        "input_layernorm.weight" => "attention_norm.weight",
        "post_attention_layernorm.weight" => "mlp_norm.weight",
        "self_attn.q_proj.weight" => "attention.wq.weight",
        "self_attn.k_proj.weight" => "attention.wk.weight",
        "self_attn.v_proj.weight" => "attention.wv.weight",
        "self_attn.o_proj.weight" => "attention.wo.weight",
        "mlp.gate_proj.weight" => "mlp.w1.weight",
        "mlp.down_proj.weight" => "mlp.w2.weight",
        "mlp.up_proj.weight" => "mlp.w3.weight",
        _ => return None,
    };
    Some(format!("layers.{index}.{ours}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_both_ways() {
        for path in [
            "embedding.weight",
            "norm.weight",
            "output.weight",
            "layers.3.attention_norm.weight",
            "layers.0.attention.wk.weight",
            "layers.1.mlp.w2.weight",
        ] {
            let (hf, _) = hf_name(path).unwrap();
            assert_eq!(our_path(&hf).as_deref(), Some(path));
        }
    }
}
