//! Hugging Face checkpoints of the families in `family/` (Llama, Mistral, Qwen2, Qwen3, Mixtral,
//! Qwen3-MoE, DeepSeek-V3): `config.json` plus `model.safetensors`, or shards listed in
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
//! need no permutation. Tied word embeddings are one tensor, `model.embed_tokens.weight`. A MoE
//! block's experts are one `[e, ..]` stack of ours and one tensor an expert in the file.
//! DeepSeek-V3's multi-token prediction modules follow the blocks (module `k` under block
//! `num_hidden_layers + k`, with copies of the shared embedding and output layer): a model
//! with `d` modules reads the file's first `d` and leaves the rest out, as transformers leaves
//! them all; one with more than the file holds is refused.

mod compressed;
mod config;
mod export;
mod family;
mod load;
mod tokenizer;

pub use compressed::{Compression, Input};
pub use config::{HfConfig, config, read_config};
pub use export::{ExportDType, ExportOptions, save, save_quantized};
pub use family::{Choices, DeepseekRouting, Family, HfLatent, HfMoe, RopeColumns};
pub use load::{load, load_stage};

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

/// Where one of our parameters lies in a family's file.
#[derive(Clone, Debug, PartialEq, Eq)]
struct FileTensor {
    /// Its name; for a stack of experts, expert `{j}`'s tensor's, `{j}` standing for the expert.
    name: String,
    /// Stored `[out, in]` where ours is `[in, out]` (each expert's, for a stack).
    transposed: bool,
    /// Ours is an `[e, ..]` stack of experts, one tensor an expert in the file.
    per_expert: bool,
}

/// A block's tensors every family names alike: ours, theirs under `model.layers.{i}.`, whether
/// transposed.
const BLOCK: [(&str, &str, bool); 14] = [
    ("attention_norm.weight", "input_layernorm.weight", false),
    ("mlp_norm.weight", "post_attention_layernorm.weight", false),
    ("attention.wq.weight", "self_attn.q_proj.weight", true),
    ("attention.wk.weight", "self_attn.k_proj.weight", true),
    ("attention.wv.weight", "self_attn.v_proj.weight", true),
    ("attention.wo.weight", "self_attn.o_proj.weight", true),
    ("attention.wq.bias", "self_attn.q_proj.bias", false),
    ("attention.wk.bias", "self_attn.k_proj.bias", false),
    ("attention.wv.bias", "self_attn.v_proj.bias", false),
    ("attention.q_norm.weight", "self_attn.q_norm.weight", false),
    ("attention.k_norm.weight", "self_attn.k_norm.weight", false),
    ("mlp.w1.weight", "mlp.gate_proj.weight", true),
    ("mlp.w2.weight", "mlp.down_proj.weight", true),
    ("mlp.w3.weight", "mlp.up_proj.weight", true),
];

/// A block's tensors under `family`'s names: [`BLOCK`] and its MoE block's router and experts
/// (ours, theirs, transposed, one tensor an expert).
fn block_names(family: Family) -> impl Iterator<Item = (&'static str, &'static str, bool, bool)> {
    let spec = family.spec();
    // The family's own first: its names win where the Llama's are the same (DeepSeek-V3's
    // `o_proj` is latent attention's).
    let dense = spec
        .block
        .iter()
        .chain(&BLOCK)
        .map(|&(ours, theirs, t)| (ours, theirs, t, false));
    let moe = spec.moe.as_ref().into_iter().flat_map(|names| {
        let bias = names.bias.map(|bias| ("moe.router.bias", bias, false, false));
        let shared = names.shared.into_iter().flat_map(|[gate, down, up]| {
            [
                ("moe.shared.w1.weight", gate, true, false),
                ("moe.shared.w2.weight", down, true, false),
                ("moe.shared.w3.weight", up, true, false),
            ]
        });
        [
            ("moe.router.weight", names.router, true, false),
            ("moe.experts.w1", names.gate, true, true),
            ("moe.experts.w2", names.down, true, true),
            ("moe.experts.w3", names.up, true, true),
        ]
        .into_iter()
        .chain(bias)
        .chain(shared)
    });
    dense.chain(moe)
}

/// Which of our parameter `path`'s output features `config`'s file stores in interleaved pairs.
fn rope_columns(config: &HfConfig, path: &str) -> Option<RopeColumns> {
    (config.family.spec().rope_columns)(config, block_field(path)?)
}

/// Where our parameter `path` lies in `family`'s file.
fn file_tensor(family: Family, path: &str) -> Option<FileTensor> {
    let fixed = match path {
        "embedding.weight" => Some(("model.embed_tokens.weight", false)),
        "norm.weight" => Some(("model.norm.weight", false)),
        "output.weight" => Some(("lm_head.weight", true)),
        _ => None,
    };
    if let Some((name, transposed)) = fixed {
        return Some(FileTensor {
            name: name.to_string(),
            transposed,
            per_expert: false,
        });
    }
    let (index, field) = path.strip_prefix("layers.")?.split_once('.')?;
    let (_, theirs, transposed, per_expert) = block_names(family).find(|(ours, ..)| *ours == field)?;
    Some(FileTensor {
        name: format!("model.layers.{index}.{theirs}"),
        transposed,
        per_expert,
    })
}

/// A multi-token prediction module's own tensors: ours under `mtp.{k}.`, theirs under the
/// module's block in DeepSeek-V3's files (`model.layers.{num_hidden_layers + k}.`), whether
/// transposed.
const MTP: [(&str, &str, bool); 4] = [
    ("embedding_norm.weight", "enorm.weight", false),
    ("hidden_norm.weight", "hnorm.weight", false),
    ("projection.weight", "eh_proj.weight", true),
    ("norm.weight", "shared_head.norm.weight", false),
];

/// The copies DeepSeek-V3's files keep under each module's block of what the modules share
/// with the model: the embedding and the output layer (theirs, the model's).
const MTP_SHARED: [(&str, &str); 2] = [
    ("embed_tokens.weight", "model.embed_tokens.weight"),
    ("shared_head.head.weight", "lm_head.weight"),
];

/// Where our parameter `path` lies in `config`'s file: [`file_tensor`]'s names, and multi-token
/// prediction module `k`'s (`mtp.{k}.…`) under the file's block `num_hidden_layers + k`, its
/// own tensors by [`MTP`], its block's as any block's.
fn tensor_of(config: &HfConfig, path: &str) -> Option<FileTensor> {
    let Some(module) = path.strip_prefix("mtp.") else {
        return file_tensor(config.family, path);
    };
    let (k, field) = module.split_once('.')?;
    let layer = config.num_hidden_layers + k.parse::<usize>().ok()?;
    let (theirs, transposed, per_expert) = match MTP.iter().find(|(ours, ..)| *ours == field) {
        Some(&(_, theirs, transposed)) => (theirs, transposed, false),
        None => {
            let field = field.strip_prefix("block.")?;
            let (_, theirs, transposed, per_expert) = block_names(config.family).find(|(ours, ..)| *ours == field)?;
            (theirs, transposed, per_expert)
        }
    };
    Some(FileTensor {
        name: format!("model.layers.{layer}.{theirs}"),
        transposed,
        per_expert,
    })
}

/// The field of our parameter `path` within its block: a block of the model's
/// (`layers.{i}.{field}`) or of a multi-token prediction module's (`mtp.{k}.block.{field}`).
fn block_field(path: &str) -> Option<&str> {
    if let Some(block) = path.strip_prefix("layers.") {
        return block.split_once('.').map(|(_, field)| field);
    }
    path.strip_prefix("mtp.")?.split_once('.')?.1.strip_prefix("block.")
}

/// Whether our parameter `path` has the vocabulary along its split dim (padded to tp).
fn is_vocab(path: &str) -> bool {
    matches!(path, "embedding.weight" | "output.weight")
}

/// Our parameter path of a name in `family`'s file (the inverse of the mapping above, a stack of
/// experts named with `*` for the expert: `model.layers.0.mlp.experts.*.gate_proj.weight`), for
/// tests and tools that compare with transformers by name.
pub fn our_path(family: Family, hf: &str) -> Option<String> {
    let fixed = match hf {
        "model.embed_tokens.weight" => Some("embedding.weight"),
        "model.norm.weight" => Some("norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        _ => None,
    };
    if let Some(path) = fixed {
        return Some(path.to_string());
    }
    let (index, field) = hf.strip_prefix("model.layers.")?.split_once('.')?;
    let (ours, ..) = block_names(family).find(|(_, theirs, ..)| theirs.replace("{j}", "*") == field)?;
    Some(format!("layers.{index}.{ours}"))
}

/// [`our_path`] in the file of `config`, its multi-token prediction modules' names too (those
/// of block `num_hidden_layers + k` as module `k`'s, `mtp.{k}.…`).
pub fn our_path_in(config: &HfConfig, hf: &str) -> Option<String> {
    let module = hf
        .strip_prefix("model.layers.")
        .and_then(|rest| rest.split_once('.'))
        .and_then(|(i, field)| Some((i.parse::<usize>().ok()?.checked_sub(config.num_hidden_layers)?, field)));
    let Some((k, field)) = module else {
        return our_path(config.family, hf);
    };
    if let Some((ours, ..)) = MTP.iter().find(|(_, theirs, _)| *theirs == field) {
        return Some(format!("mtp.{k}.{ours}"));
    }
    let block = our_path(config.family, &format!("model.layers.0.{field}"))?;
    Some(format!("mtp.{k}.block.{}", block.strip_prefix("layers.0.")?))
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
            "layers.0.attention.wk.bias",
            "layers.0.attention.k_norm.weight",
            "layers.1.mlp.w2.weight",
        ] {
            let file = file_tensor(Family::Qwen3, path).unwrap();
            assert_eq!(our_path(Family::Qwen3, &file.name).as_deref(), Some(path));
        }
        for path in ["layers.1.moe.router.weight", "layers.0.moe.experts.w2"] {
            let file = file_tensor(Family::Mixtral, path).unwrap();
            let stack = file.name.replace("{j}", "*");
            assert_eq!(our_path(Family::Mixtral, &stack).as_deref(), Some(path), "{file:?}");
        }
        let down = file_tensor(Family::Qwen3Moe, "layers.2.moe.experts.w2").unwrap();
        assert_eq!(down.name, "model.layers.2.mlp.experts.{j}.down_proj.weight");
        assert!(down.per_expert && down.transposed);
        assert_eq!(file_tensor(Family::Llama, "layers.0.moe.router.weight"), None);
    }
}
