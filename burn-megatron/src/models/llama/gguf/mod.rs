//! Llama models in llama.cpp's GGUF files (SmolLM2-135M-Instruct's Q4_1 file, say):
//!
//! - [`GgufFile`] reads the container from a memory map (`file.rs`), [`BlockType`] dequantizes
//!   its blocks to f32 (`quant.rs`: F32, F16, BF16, Q4_0, Q4_1, Q8_0);
//! - [`config`] builds our [`LlamaConfig`] from the `llama.*` metadata (a tied output when the
//!   file has no `output.weight`), refusing by name what this model does not build;
//! - [`load`] fills a model at any tp with each rank's slice of every tensor, dequantized;
//! - [`tokenizer`] builds a `tokenizers::Tokenizer` from the file's own vocabulary and merges
//!   (`tokenizer.rs`).
//!
//! Layouts: GGUF lists a matrix's dims fastest first, so `[in, out]` there is PyTorch's
//! `[out, in]`, which every projection transposes into Burn's `[in, out]`. llama.cpp's converter
//! permutes the rows of q and k within each head from Hugging Face's halves (rows `i` and
//! `i + k/2` rotate together) into pairs (rows `2i` and `2i + 1`); our RoPE rotates halves, so
//! [`load`] puts them back.

mod file;
mod quant;
mod tokenizer;

pub use file::{GgufFile, TensorInfo, Value};
pub use quant::BlockType;
pub use tokenizer::{ChatTemplateText, chat_template, tokenizer};

use std::path::Path;

use burn::tensor::{Tensor, TensorData};
use burn_megatron_dist::ProcessGroups;

use super::hf::{Choices, Family, HfConfig, HfError};
use crate::layers::RopeScaling;
use crate::models::llama::{Llama, LlamaConfig};
use crate::params::{map_params, param_infos, param_values};
use crate::precision::delayed::is_history;

#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum GgufError {
    #[error("{path}: {detail}")]
    Io { path: String, detail: String },
    #[error("{path} is not a GGUF file this reads: {detail}")]
    Format { path: String, detail: String },
    #[error("the GGUF file has no {key}")]
    Missing { key: String },
    #[error("{what} is not supported")]
    Unsupported { what: String },
    #[error("tensor {name}: {detail}")]
    Incompatible { name: String, detail: String },
    /// The file's model disagrees with the model it is loaded into.
    #[error(transparent)]
    Model(#[from] HfError),
}

/// The file's model as Hugging Face's configuration fields, checked.
fn hf_config(file: &GgufFile) -> Result<HfConfig, GgufError> {
    let arch = file.get("general.architecture")?.as_str().unwrap_or_default();
    if arch != "llama" {
        return Err(GgufError::Unsupported {
            what: format!("architecture {arch:?} (only llama is built)"),
        });
    }
    let size = |key: &str| -> Result<usize, GgufError> {
        let key = format!("llama.{key}");
        file.get(&key)?.as_usize().ok_or(GgufError::Missing { key })
    };
    let float = |key: &str, default: f64| {
        file.metadata
            .get(&format!("llama.{key}"))
            .and_then(Value::as_f64)
            .unwrap_or(default)
    };
    if let Some(kind) = file.metadata.get("llama.rope.scaling.type").and_then(Value::as_str)
        && kind != "none"
    {
        return Err(GgufError::Unsupported {
            what: format!("llama.rope.scaling.type {kind:?}"),
        });
    }
    let (d, heads) = (size("embedding_length")?, size("attention.head_count")?.max(1));
    let head_dim = d / heads;
    if let Some(rope) = file
        .metadata
        .get("llama.rope.dimension_count")
        .and_then(Value::as_usize)
        && rope != head_dim
    {
        return Err(GgufError::Unsupported {
            what: format!("RoPE over {rope} of a head's {head_dim} dims"),
        });
    }
    let vocab = match file.metadata.get("llama.vocab_size").and_then(Value::as_usize) {
        Some(v) => v,
        None => file.get("tokenizer.ggml.tokens")?.as_list().map_or(0, <[Value]>::len),
    };
    Ok(HfConfig {
        family: Family::Llama,
        choices: Choices::default(),
        hidden_size: d,
        intermediate_size: size("feed_forward_length")?,
        num_hidden_layers: size("block_count")?,
        num_attention_heads: heads,
        num_key_value_heads: file
            .metadata
            .get("llama.attention.head_count_kv")
            .and_then(Value::as_usize)
            .unwrap_or(heads),
        head_dim,
        vocab_size: vocab,
        max_position_embeddings: size("context_length")?,
        rope_theta: float("rope.freq_base", 10000.0),
        rope_scaling: RopeScaling::None,
        // Stored as f32: 1e-5 reads back 9.99999974e-6, which is the value llama.cpp uses.
        rms_norm_eps: float("attention.layer_norm_rms_epsilon", 1e-5),
        tie_word_embeddings: !file.tensors.contains_key("output.weight"),
    }
    .checked()?)
}

/// The model in `path` (no parallelism applied yet).
pub fn config(path: &Path) -> Result<LlamaConfig, GgufError> {
    Ok(hf_config(&GgufFile::open(path)?)?.to_llama())
}

/// Our parameter path → (GGUF name, whether the weight is a projection stored `[out, in]`).
fn gguf_name(path: &str) -> Option<(String, bool)> {
    let fixed = match path {
        "embedding.weight" => Some(("token_embd.weight", false)),
        "norm.weight" => Some(("output_norm.weight", false)),
        "output.weight" => Some(("output.weight", true)),
        _ => None,
    };
    if let Some((name, transposed)) = fixed {
        return Some((name.to_string(), transposed));
    }
    let (index, field) = path.strip_prefix("layers.")?.split_once('.')?;
    let (name, transposed) = match field {
        "attention_norm.weight" => ("attn_norm.weight", false),
        "mlp_norm.weight" => ("ffn_norm.weight", false),
        "attention.wq.weight" => ("attn_q.weight", true),
        "attention.wk.weight" => ("attn_k.weight", true),
        "attention.wv.weight" => ("attn_v.weight", true),
        "attention.wo.weight" => ("attn_output.weight", true),
        "mlp.w1.weight" => ("ffn_gate.weight", true),
        "mlp.w2.weight" => ("ffn_down.weight", true),
        "mlp.w3.weight" => ("ffn_up.weight", true),
        _ => return None,
    };
    Some((format!("blk.{index}.{name}"), transposed))
}

/// Rows of q or k (`[heads · k, in]`, row-major) from llama.cpp's pairs back to halves: row
/// `h·k + 2i + j` of the file is row `h·k + j·k/2 + i` of Hugging Face's.
fn unpermute(values: &[f32], rows: usize, cols: usize, head_dim: usize) -> Vec<f32> {
    let mut out = vec![0.0; values.len()];
    let half = head_dim / 2;
    for row in 0..rows {
        let (head, within) = (row / head_dim, row % head_dim);
        let target = head * head_dim + (within % 2) * half + within / 2;
        out[target * cols..(target + 1) * cols].copy_from_slice(&values[row * cols..(row + 1) * cols]);
    }
    out
}

/// Loads the model in the GGUF file `path` into `model` (built from [`config`], planned for
/// `groups.tp`), each rank keeping its slice of every tensor, dequantized. The file's model
/// must be `model`'s (an [`HfError::Mismatch`] names the field that differs), and every tensor
/// of the file must be used. Everything is read and checked before the model changes.
pub fn load(path: &Path, model: Llama, groups: &ProcessGroups) -> Result<Llama, GgufError> {
    let file = GgufFile::open(path)?;
    let config = hf_config(&file)?;
    config.check_model(&model, groups)?;
    let infos = param_infos(&model);
    let shapes: Vec<Vec<usize>> = param_values(&model).into_iter().map(|p| p.dims).collect();
    let (tp, tp_rank) = (groups.tp.size(), groups.tp.group_rank());
    let mut used = std::collections::BTreeSet::new();
    let mut values = Vec::with_capacity(infos.len());
    for (info, local) in infos.iter().zip(&shapes) {
        // Delayed FP8 scaling's amax histories are training state, no weight of the file: kept.
        if is_history(&info.path) {
            values.push(None);
            continue;
        }
        let incompatible = |detail: String| GgufError::Incompatible {
            name: info.path.clone(),
            detail,
        };
        let (name, transposed) = gguf_name(&info.path).ok_or_else(|| incompatible("no GGUF name".into()))?;
        let stored = file
            .tensors
            .get(&name)
            .ok_or_else(|| incompatible(format!("{name} is not in the file")))?;
        let mut shape = stored.shape(); // [out, in] for a projection
        let mut data = file.values(&name).expect("the tensor is listed");
        if name.ends_with("attn_q.weight") || name.ends_with("attn_k.weight") {
            data = unpermute(&data, shape[0], shape.get(1).copied().unwrap_or(1), config.head_dim);
        }
        if transposed && shape.len() == 2 {
            data = transpose(&data, shape[0], shape[1]);
            shape.reverse();
        }
        let dim = info.split_dim.unwrap_or(0);
        let parts = if info.split_dim.is_some() { tp } else { 1 };
        let vocab = matches!(info.path.as_str(), "embedding.weight" | "output.weight");
        let fits = shape.len() == local.len()
            && shape.iter().zip(local).enumerate().all(|(d, (g, l))| match d == dim {
                true if vocab => *g <= l * parts,
                true => *g == l * parts,
                false => g == l,
            });
        if !fits {
            return Err(incompatible(format!(
                "{name} is {:?}: it does not fit a local shape {local:?} over {parts} ranks",
                stored.shape()
            )));
        }
        let start = if info.split_dim.is_some() {
            tp_rank * local[dim]
        } else {
            0
        };
        values.push(Some(slice(&data, &shape, local, dim, start)));
        used.insert(name);
    }
    let left_over: Vec<&String> = file.tensors.keys().filter(|n| !used.contains(*n)).collect();
    if !left_over.is_empty() {
        return Err(GgufError::Unsupported {
            what: format!("tensors the model has no parameter for: {left_over:?}"),
        });
    }
    Ok(map_params(model, &mut |i, old, _| match values[i].take() {
        Some(v) => {
            let n = v.len();
            Tensor::<1>::from_data(TensorData::new(v, [n]), &old.device()).cast(old.dtype())
        }
        None => old,
    }))
}

/// `[rows, cols]` → `[cols, rows]`.
fn transpose(values: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; values.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = values[r * cols + c];
        }
    }
    out
}

/// The box of `local` shape at `start` along `dim` of the whole `values` (`shape`); positions
/// past the whole along `dim` (vocabulary padding) are zeros.
fn slice(values: &[f32], shape: &[usize], local: &[usize], dim: usize, start: usize) -> Vec<f32> {
    let mut out = vec![0.0; local.iter().product()];
    match local.len() {
        1 => {
            let n = local[0].min(shape[0].saturating_sub(start));
            out[..n].copy_from_slice(&values[start..start + n]);
        }
        _ => {
            let (rows, cols) = (local[0], local[1]);
            for r in 0..rows {
                let (gr, gc) = if dim == 0 { (start + r, 0) } else { (r, start) };
                if gr >= shape[0] {
                    break;
                }
                let n = cols.min(shape[1].saturating_sub(gc));
                let src = gr * shape[1] + gc;
                out[r * cols..r * cols + n].copy_from_slice(&values[src..src + n]);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows of one head of 4: the file's pairs (0 1)(2 3) are halves' rows (0 2)(1 3).
    #[test]
    fn q_and_k_rows_return_to_halves() {
        let file: Vec<f32> = vec![0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0]; // two heads, one column
        assert_eq!(unpermute(&file, 8, 1, 4), [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]);
    }

    #[test]
    fn slices_pad_the_vocabulary_with_zeros() {
        let whole: Vec<f32> = (0..6).map(|x| x as f32).collect(); // [3, 2]
        assert_eq!(slice(&whole, &[3, 2], &[2, 2], 0, 2), [4.0, 5.0, 0.0, 0.0]);
        assert_eq!(slice(&whole, &[3, 2], &[3, 1], 1, 1), [1.0, 3.0, 5.0]);
        assert_eq!(transpose(&whole, 3, 2), [0.0, 2.0, 4.0, 1.0, 3.0, 5.0]);
    }
}
