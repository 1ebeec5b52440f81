//! Hugging Face Llama checkpoints: `config.json` plus `model.safetensors`, or shards listed in
//! `model.safetensors.index.json`. They load into the model at any tp (each rank keeps its
//! slice) and save back whole, written by global rank 0.
//!
//! Names and layouts: Hugging Face stores linear weights as `[out, in]`, Burn as `[in, out]`, so
//! every projection is transposed on the way; both rotate the two halves of each head, so q and k
//! need no permutation.

use std::collections::BTreeMap;
use std::path::Path;

use burn::module::Module;
use burn::tensor::{Tensor, TensorData};
use burn_megatron_dist::{CommError, ProcessGroups};
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde::{Deserialize, Serialize};

use super::model::{Llama, LlamaConfig};
use crate::params::{ParamInfo, map_params, param_infos, param_values};

#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum HfError {
    #[error("{path}: {detail}")]
    Io { path: String, detail: String },
    #[error("{path}: {detail}")]
    Format { path: String, detail: String },
    #[error("tensor {name}: {detail}")]
    Incompatible { name: String, detail: String },
    #[error(transparent)]
    Comm(#[from] CommError),
}

/// The fields of a Hugging Face `config.json` this model reads and writes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HfConfig {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    pub vocab_size: usize,
    #[serde(default = "default_positions")]
    pub max_position_embeddings: usize,
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    #[serde(default)]
    pub tie_word_embeddings: bool,
}

fn default_positions() -> usize {
    2048
}
fn default_theta() -> f64 {
    10000.0
}
fn default_eps() -> f64 {
    1e-6
}

impl HfConfig {
    /// The model this configuration describes (no parallelism applied yet).
    pub fn to_llama(&self) -> LlamaConfig {
        let mut config = LlamaConfig::llama(
            self.vocab_size,
            self.hidden_size,
            self.num_hidden_layers,
            self.num_attention_heads,
            self.num_key_value_heads.unwrap_or(self.num_attention_heads),
            self.intermediate_size,
            self.max_position_embeddings,
        );
        config.attention.rope_theta = self.rope_theta;
        config.norm.epsilon = self.rms_norm_eps;
        config
    }

    pub fn from_llama(config: &LlamaConfig) -> Self {
        Self {
            hidden_size: config.attention.d_model,
            intermediate_size: config.mlp.d_ff,
            num_hidden_layers: config.n_layers,
            num_attention_heads: config.attention.n_heads,
            num_key_value_heads: Some(config.attention.n_kv_heads),
            vocab_size: config.embedding.vocab_size,
            max_position_embeddings: config.attention.max_seq_len,
            rope_theta: config.attention.rope_theta,
            rms_norm_eps: config.norm.epsilon,
            tie_word_embeddings: false,
        }
    }
}

/// Reads `dir/config.json`.
pub fn read_config(dir: &Path) -> Result<HfConfig, HfError> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| io(&path, e))?;
    serde_json::from_str(&text).map_err(|e| HfError::Format {
        path: path.display().to_string(),
        detail: e.to_string(),
    })
}

fn io(path: &Path, e: std::io::Error) -> HfError {
    HfError::Io {
        path: path.display().to_string(),
        detail: e.to_string(),
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

/// A whole tensor in f32, row-major.
struct Whole {
    shape: Vec<usize>,
    values: Vec<f32>,
}

impl Whole {
    fn transposed(self) -> Self {
        let [r, c] = [self.shape[0], self.shape[1]];
        let mut values = vec![0.0; r * c];
        for i in 0..r {
            for j in 0..c {
                values[j * r + i] = self.values[i * c + j];
            }
        }
        Self {
            shape: vec![c, r],
            values,
        }
    }
}

fn decode(view: &TensorView<'_>) -> Option<Vec<f32>> {
    let data = view.data();
    Some(match view.dtype() {
        Dtype::F32 => data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        Dtype::BF16 => data
            .chunks_exact(2)
            .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16))
            .collect(),
        Dtype::F16 => data
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        _ => return None,
    })
}

/// Every tensor of the checkpoint in `dir`, by Hugging Face name.
fn read_tensors(dir: &Path) -> Result<BTreeMap<String, Whole>, HfError> {
    let index = dir.join("model.safetensors.index.json");
    let files: Vec<String> = if index.exists() {
        #[derive(Deserialize)]
        struct Index {
            weight_map: BTreeMap<String, String>,
        }
        let text = std::fs::read_to_string(&index).map_err(|e| io(&index, e))?;
        let parsed: Index = serde_json::from_str(&text).map_err(|e| HfError::Format {
            path: index.display().to_string(),
            detail: e.to_string(),
        })?;
        let mut files: Vec<String> = parsed.weight_map.into_values().collect();
        files.sort();
        files.dedup();
        files
    } else {
        vec!["model.safetensors".to_string()]
    };
    let mut out = BTreeMap::new();
    for file in files {
        let path = dir.join(&file);
        let bytes = std::fs::read(&path).map_err(|e| io(&path, e))?;
        let format = |detail: String| HfError::Format {
            path: path.display().to_string(),
            detail,
        };
        let st = SafeTensors::deserialize(&bytes).map_err(|e| format(e.to_string()))?;
        for (name, view) in st.tensors() {
            let values =
                decode(&view).ok_or_else(|| format(format!("{name}: unsupported dtype {:?}", view.dtype())))?;
            out.insert(
                name,
                Whole {
                    shape: view.shape().to_vec(),
                    values,
                },
            );
        }
    }
    Ok(out)
}

/// Loads the Hugging Face checkpoint in `dir` into `model`, each rank keeping its slice.
/// Everything is read and checked before the model changes.
pub fn load<M: Module>(dir: &Path, model: M, groups: &ProcessGroups) -> Result<M, HfError> {
    let mut tensors = read_tensors(dir)?;
    let infos = param_infos(&model);
    let shapes: Vec<Vec<usize>> = param_values(&model).into_iter().map(|p| p.dims).collect();
    let mut values = Vec::with_capacity(infos.len());
    for (info, shape) in infos.iter().zip(&shapes) {
        let incompatible = |detail: String| HfError::Incompatible {
            name: info.path.clone(),
            detail,
        };
        let (name, transposed) = hf_name(&info.path).ok_or_else(|| incompatible("no Hugging Face name".into()))?;
        let whole = tensors
            .remove(&name)
            .ok_or_else(|| incompatible(format!("{name} is not in the checkpoint")))?;
        let whole = if transposed { whole.transposed() } else { whole };
        values.push(slice(&whole, info, shape, groups).map_err(incompatible)?);
    }
    Ok(map_params(model, &mut |i, old, _| {
        let n = values[i].len();
        Tensor::<1>::from_data(TensorData::new(values[i].clone(), [n]), &old.device()).cast(old.dtype())
    }))
}

/// This rank's slice of `whole` for a parameter of local `shape`; along the split dim, rows past
/// the stored tensor (vocabulary padding) are zeros.
fn slice(whole: &Whole, info: &ParamInfo, shape: &[usize], groups: &ProcessGroups) -> Result<Vec<f32>, String> {
    let dim = info.split_dim.unwrap_or(0);
    let parts = if info.split_dim.is_some() { groups.tp.size() } else { 1 };
    let rank = if info.split_dim.is_some() {
        groups.tp.group_rank()
    } else {
        0
    };
    let fits = whole.shape.len() == shape.len()
        && whole
            .shape
            .iter()
            .zip(shape)
            .enumerate()
            .all(|(d, (w, s))| if d == dim { *w <= s * parts } else { w == s });
    if !fits {
        return Err(format!(
            "stored shape {:?} does not fit a local shape {shape:?} over {parts} ranks",
            whole.shape
        ));
    }
    let outer: usize = shape[..dim].iter().product();
    let inner: usize = shape[dim + 1..].iter().product();
    let start = rank * shape[dim];
    let mut out = vec![0.0; shape.iter().product()];
    for o in 0..outer {
        for n in 0..shape[dim] {
            let global = start + n;
            if global >= whole.shape[dim] {
                continue;
            }
            let src = (o * whole.shape[dim] + global) * inner;
            let dst = (o * shape[dim] + n) * inner;
            out[dst..dst + inner].copy_from_slice(&whole.values[src..src + inner]);
        }
    }
    Ok(out)
}

/// Saves `model` in Hugging Face's layout to `dir` (`config.json`, `model.safetensors`, f32):
/// every rank gathers the whole tensors, global rank 0 writes them.
pub fn save(dir: &Path, model: &Llama, config: &LlamaConfig, groups: &ProcessGroups) -> Result<(), HfError> {
    let infos = param_infos(model);
    let gathered: Vec<Result<Whole, CommError>> = infos
        .iter()
        .zip(param_values(model))
        .map(|(info, p)| {
            let mut shape = p.dims;
            let whole = match info.split_dim {
                // Seen as [outer, split, inner], gathered along the middle.
                Some(dim) => {
                    let (outer, inner) = (shape[..dim].iter().product(), shape[dim + 1..].iter().product());
                    let value = p.value.reshape([outer, shape[dim], inner]);
                    shape[dim] *= groups.tp.size();
                    groups
                        .tp
                        .all_gather(value, 1)?
                        .reshape([shape.iter().product::<usize>()])
                }
                None => p.value,
            };
            Ok(Whole {
                shape,
                values: whole.into_data().convert::<f32>().try_into_vec::<f32>().expect("f32"),
            })
        })
        .collect();
    if groups.global_rank != 0 {
        return gathered
            .into_iter()
            .try_for_each(|r| r.map(|_| ()))
            .map_err(HfError::from);
    }
    let vocab = config.embedding.vocab_size;
    let mut named = BTreeMap::new();
    for (info, whole) in infos.iter().zip(gathered) {
        let mut whole = whole?;
        let (name, transposed) = hf_name(&info.path).ok_or_else(|| HfError::Incompatible {
            name: info.path.clone(),
            detail: "no Hugging Face name".into(),
        })?;
        // Drop the vocabulary padding: rows (embedding) or columns (output) past the vocabulary.
        if info.path == "embedding.weight" && whole.shape[0] > vocab {
            whole.values.truncate(vocab * whole.shape[1]);
            whole.shape[0] = vocab;
        }
        if info.path == "output.weight" && whole.shape[1] > vocab {
            let [d, v] = [whole.shape[0], whole.shape[1]];
            whole.values = (0..d)
                .flat_map(|i| whole.values[i * v..i * v + vocab].to_vec())
                .collect();
            whole.shape[1] = vocab;
        }
        named.insert(name, if transposed { whole.transposed() } else { whole });
    }
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    let bytes: Vec<(String, Vec<u8>, Vec<usize>)> = named
        .iter()
        .map(|(n, w)| {
            (
                n.clone(),
                w.values.iter().flat_map(|v| v.to_le_bytes()).collect(),
                w.shape.clone(),
            )
        })
        .collect();
    let path = dir.join("model.safetensors");
    let format = |e: safetensors::SafeTensorError| HfError::Format {
        path: path.display().to_string(),
        detail: e.to_string(),
    };
    let views = bytes
        .iter()
        .map(|(n, b, s)| TensorView::new(Dtype::F32, s.clone(), b).map(|v| (n.as_str(), v)))
        .collect::<Result<Vec<_>, _>>()
        .map_err(format)?;
    let buffer = safetensors::serialize(views, None).map_err(format)?;
    crate::checkpoint::write_synced(&path, &buffer).map_err(|e| HfError::Io {
        path: path.display().to_string(),
        detail: e.to_string(),
    })?;
    let json = serde_json::to_vec_pretty(&HfConfig::from_llama(config)).expect("config serializes");
    let config_path = dir.join("config.json");
    crate::checkpoint::write_synced(&config_path, &json).map_err(|e| HfError::Io {
        path: config_path.display().to_string(),
        detail: e.to_string(),
    })
}
