//! Export: the model whole in Hugging Face's names and layout, in f32 or bf16, one tensor
//! gathered at a time and written by global rank 0 in shards of at most
//! [`ExportOptions::max_shard_bytes`] (`model.safetensors`, or `model-0000i-of-0000n.safetensors`
//! with `model.safetensors.index.json`), and a `config.json` that transformers'
//! `AutoModelForCausalLM.from_pretrained` opens. [`save_quantized`] writes a post-training
//! quantization's block linears in compressed-tensors' layout instead (`compressed.rs`).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use burn::config::Config;
use burn_megatron_dist::{CommError, ProcessGroups};
use safetensors::tensor::{Dtype, TensorView};
use serde_json::json;

use super::compressed::{Compression, is_block_linear, scale_names};
use super::config::HfConfig;
use super::{HfError, MTP_SHARED, RopeColumns, format_error, io, is_vocab, rope_columns, tensor_of};
use crate::models::llama::{Llama, LlamaConfig};
use crate::params::{param_infos, param_values};
use crate::precision::delayed::is_history;
use crate::precision::ptq::{InputQuantizer, Quantization};

/// The dtype the exported weights are stored in.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum ExportDType {
    F32,
    /// bfloat16, rounded to nearest even.
    BF16,
}

impl ExportDType {
    fn bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::BF16 => 2,
        }
    }

    /// Its name in `config.json` (`torch_dtype`, `dtype`).
    fn torch_name(self) -> &'static str {
        match self {
            Self::F32 => "float32",
            Self::BF16 => "bfloat16",
        }
    }

    fn safetensors(self) -> Dtype {
        match self {
            Self::F32 => Dtype::F32,
            Self::BF16 => Dtype::BF16,
        }
    }

    fn encode(self, values: &[f32]) -> Vec<u8> {
        match self {
            Self::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            Self::BF16 => values
                .iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                .collect(),
        }
    }
}

/// How [`save`] writes.
#[derive(Config, Debug)]
pub struct ExportOptions {
    #[config(default = "ExportDType::F32")]
    pub dtype: ExportDType,
    /// The largest shard file, in bytes (transformers' `save_pretrained` uses 5 GB). A tensor
    /// larger than this gets a shard of its own.
    #[config(default = 5_000_000_000)]
    pub max_shard_bytes: u64,
}

/// One tensor of the export: where it comes from and what it becomes.
#[derive(Clone)]
struct Entry {
    index: usize,
    /// Our parameter path.
    path: String,
    name: String,
    transposed: bool,
    split_dim: Option<usize>,
    /// The expert of a stack of experts this tensor is (`[e, ..]` of ours, one tensor an expert
    /// in the file).
    expert: Option<usize>,
    /// Its shape in the file, Hugging Face's `[out, in]`, the vocabulary unpadded.
    shape: Vec<usize>,
}

/// Saves `model` (built from `config`) in Hugging Face's layout to `dir`. Every rank calls it
/// (the tensors are gathered over tp one at a time); global rank 0 writes, and returns any
/// error writing, after taking part in every gather.
pub fn save(
    dir: &Path,
    model: &Llama,
    config: &LlamaConfig,
    groups: &ProcessGroups,
    options: &ExportOptions,
) -> Result<(), HfError> {
    write_checkpoint(dir, model, config, groups, options, None)
}

/// Saves `model` after a post-training quantization (`posttrain::ptq::quantize`, which gives
/// both) as [`save`] does, its block linears as `quantization` says, in compressed-tensors'
/// layout: 8-bit codes, `weight_scale` and, for static inputs, `input_scale` (`compressed.rs`).
/// Int4, group scales and NVFP4 have no layout here ([`HfError::Unsupported`]).
pub fn save_quantized(
    dir: &Path,
    model: &Llama,
    quantization: &Quantization,
    config: &LlamaConfig,
    groups: &ProcessGroups,
    options: &ExportOptions,
) -> Result<(), HfError> {
    let compression = Compression::of(&quantization.config)?;
    write_checkpoint(dir, model, config, groups, options, Some((compression, quantization)))
}

/// A compressed export's scheme and the quantization it writes.
type Compressed<'a> = Option<(Compression, &'a Quantization)>;

fn write_checkpoint(
    dir: &Path,
    model: &Llama,
    config: &LlamaConfig,
    groups: &ProcessGroups,
    options: &ExportOptions,
    compressed: Compressed,
) -> Result<(), HfError> {
    let hf = HfConfig::from_llama(config)?;
    hf.check_model(model, groups)?;
    let tp = groups.tp.size();
    let infos = param_infos(model);
    let values = param_values(model);
    let mut entries = Vec::with_capacity(infos.len());
    for (index, (info, p)) in infos.iter().zip(&values).enumerate() {
        // Delayed FP8 scaling's amax histories are training state, not weights.
        if is_history(&info.path) {
            continue;
        }
        let file = tensor_of(&hf, &info.path).ok_or_else(|| HfError::Incompatible {
            name: info.path.clone(),
            detail: "no Hugging Face name".into(),
        })?;
        let mut shape = p.dims.clone();
        if let Some(d) = info.split_dim {
            shape[d] *= if info.expert { groups.etp.size() } else { tp };
        }
        let experts = match file.per_expert {
            true => {
                // One tensor an expert: the stack's dim 0 is gone, the experts whole.
                let experts = shape.remove(0) * groups.ep.size();
                (0..experts).map(Some).collect()
            }
            false => vec![None],
        };
        if file.transposed {
            shape.reverse();
        }
        if is_vocab(&info.path) {
            shape[0] = hf.vocab_size;
        }
        for expert in experts {
            entries.push(Entry {
                index,
                path: info.path.clone(),
                name: expert.map_or(file.name.clone(), |j| file.name.replace("{j}", &j.to_string())),
                transposed: file.transposed,
                split_dim: info.split_dim,
                expert,
                shape: shape.clone(),
            });
        }
    }
    // DeepSeek-V3's files keep copies of the shared embedding and output layer under each
    // multi-token prediction module's block.
    for k in 0..hf.choices.mtp_layers {
        for (copy, shared) in MTP_SHARED {
            let shared = match hf.tie_word_embeddings {
                true => MTP_SHARED[0].1,
                false => shared,
            };
            let original = entries.iter().find(|e| e.name == shared).cloned();
            let original = original.expect("the model's embedding and output layer are written");
            entries.push(Entry {
                name: format!("model.layers.{}.{copy}", hf.num_hidden_layers + k),
                ..original
            });
        }
    }
    let codes = |entry: &Entry| compressed.is_some() && is_block_linear(&entry.path);
    // Shards in traversal order, each as full as the limit allows.
    let mut shards: Vec<Vec<&Entry>> = vec![Vec::new()];
    let mut filled = 0u64;
    for entry in &entries {
        let width = if codes(entry) { 1 } else { options.dtype.bytes() };
        let bytes = (entry.shape.iter().product::<usize>() * width) as u64;
        if filled > 0 && filled + bytes > options.max_shard_bytes {
            shards.push(Vec::new());
            filled = 0;
        }
        filled += bytes;
        shards.last_mut().expect("a shard").push(entry);
    }
    let writer = groups.global_rank == 0;
    let file_name = |i: usize| match shards.len() {
        1 => "model.safetensors".to_string(),
        n => format!("model-{:05}-of-{n:05}.safetensors", i + 1),
    };
    if writer {
        std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    }
    let mut failed: Option<HfError> = None;
    let mut stack = Vec::new();
    let mut weight_map = BTreeMap::new();
    let mut total_size = 0usize;
    for (i, shard) in shards.iter().enumerate() {
        let mut tensors: Vec<Stored> = Vec::with_capacity(shard.len());
        for entry in shard {
            let whole = match entry.expert {
                // The whole stack once, at its first expert; each expert a slice of it.
                Some(j) => {
                    if j == 0 {
                        stack = gather_experts(&values[entry.index], entry.split_dim, groups)?;
                    }
                    let n = entry.shape.iter().product::<usize>();
                    stack[j * n..(j + 1) * n].to_vec()
                }
                None => gather(&values[entry.index], entry.split_dim, groups)?,
            };
            let whole = match rope_columns(&hf, &entry.path) {
                // The file's `[out, in]`: our whole `[in, out]` has `out` columns.
                Some(columns) => interleaved(whole, entry.shape[0], columns),
                None => whole,
            };
            if !writer || failed.is_some() {
                continue;
            }
            let stored = match compressed {
                Some((scheme, quantized)) if codes(entry) => match compress(entry, whole, scheme, quantized) {
                    Ok(stored) => stored,
                    Err(e) => {
                        failed = Some(e);
                        continue;
                    }
                },
                _ => {
                    let bytes = options.dtype.encode(&hf_layout(entry, whole));
                    vec![(
                        entry.name.clone(),
                        options.dtype.safetensors(),
                        entry.shape.clone(),
                        bytes,
                    )]
                }
            };
            for tensor in stored {
                total_size += tensor.3.len();
                weight_map.insert(tensor.0.clone(), file_name(i));
                tensors.push(tensor);
            }
        }
        if writer && failed.is_none() {
            failed = write_file(&dir.join(file_name(i)), &tensors).err();
        }
    }
    if !writer {
        return Ok(());
    }
    if let Some(error) = failed {
        return Err(error);
    }
    let index_path = dir.join("model.safetensors.index.json");
    if shards.len() > 1 {
        let index = json!({"metadata": {"total_size": total_size}, "weight_map": weight_map});
        write(
            &index_path,
            &serde_json::to_vec_pretty(&index).expect("index serializes"),
        )?;
    } else if index_path.exists() {
        // A stale index from an earlier sharded export would shadow the single file.
        std::fs::remove_file(&index_path).map_err(|e| io(&index_path, e))?;
    }
    let mut json = hf.to_json(options.dtype.torch_name());
    if let Some((scheme, _)) = compressed {
        json["quantization_config"] = scheme.to_json();
    }
    let json = serde_json::to_vec_pretty(&json).expect("config serializes");
    write(&dir.join("config.json"), &json)
}

/// One tensor of a file: its name, dtype, shape and bytes.
type Stored = (String, Dtype, Vec<usize>, Vec<u8>);

/// A block linear's codes in the file's `[out, in]`, its `weight_scale` and, where its input
/// has a static range, `input_scale`.
fn compress(
    entry: &Entry,
    whole: Vec<f32>,
    scheme: Compression,
    quantized: &Quantization,
) -> Result<Vec<Stored>, HfError> {
    let incompatible = |detail: String| HfError::Incompatible {
        name: entry.name.clone(),
        detail,
    };
    let linear = entry.path.strip_suffix(".weight").expect("a weight");
    let quantization = quantized
        .linears
        .get(linear)
        .ok_or_else(|| incompatible("the quantization does not hold it".into()))?;
    let scales = quantization
        .weight_scales
        .clone()
        .ok_or_else(|| incompatible("its quantization has no scales".into()))?;
    let scales: Vec<f32> = scales.into_data().convert::<f32>().try_into_vec().expect("f32 scales");
    let [out, inputs] = [entry.shape[0], entry.shape[1]];
    let per_channel = scales.len() == out && out > 1;
    if scales.len() != 1 && !per_channel {
        return Err(incompatible(format!(
            "{} scales for {out} output channels",
            scales.len()
        )));
    }
    let values = hf_layout(entry, whole); // [out, in]
    let codes: Vec<u8> = values
        .iter()
        .enumerate()
        .map(|(i, v)| scheme.encode(v / scales[if per_channel { i / inputs } else { 0 }]))
        .collect();
    let (scale_name, input_name) = scale_names(&entry.name);
    let scale_shape = if per_channel { vec![out, 1] } else { vec![1] };
    let f32_bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let mut stored = vec![
        (entry.name.clone(), scheme.dtype(), entry.shape.clone(), codes),
        (scale_name, Dtype::F32, scale_shape, f32_bytes(&scales)),
    ];
    if let InputQuantizer::Static { codes, amax } = quantization.input {
        stored.push((input_name, Dtype::F32, vec![1], f32_bytes(&[amax / codes.max()])));
    }
    Ok(stored)
}

/// The whole of one parameter, gathered over tp along its split dim, in f32 (`[n]`, our
/// layout) on every rank.
fn gather(
    p: &crate::params::ParamValue,
    split_dim: Option<usize>,
    groups: &ProcessGroups,
) -> Result<Vec<f32>, CommError> {
    let whole = match split_dim {
        // Seen as [outer, split, inner], gathered along the middle.
        Some(dim) => {
            let shape = &p.dims;
            let (outer, inner) = (shape[..dim].iter().product(), shape[dim + 1..].iter().product());
            let value = p.value.clone().reshape([outer, shape[dim], inner]);
            let whole = groups.tp.all_gather(value, 1)?;
            let n = whole.shape().num_elements();
            whole.reshape([n])
        }
        None => p.value.clone(),
    };
    Ok(whole
        .into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .expect("f32 values"))
}

/// A whole stack of experts in f32 (`[e, ..]`, our layout) on every rank: gathered over etp
/// along its hidden `split_dim`, then over ep along the experts.
fn gather_experts(
    p: &crate::params::ParamValue,
    split_dim: Option<usize>,
    groups: &ProcessGroups,
) -> Result<Vec<f32>, CommError> {
    let shape = &p.dims;
    let [e, a, b] = [shape[0], shape[1], shape[2]];
    let mut value = p.value.clone().reshape([e, a, b]);
    if let Some(dim) = split_dim {
        value = groups.etp.all_gather(value, dim)?;
    }
    let whole = groups.ep.all_gather(value, 0)?;
    let n = whole.shape().num_elements();
    Ok(whole
        .reshape([n])
        .into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .expect("f32 values"))
}

/// `values` (`[in, out]` whole, ours) with each run's rotated features put back from halves into
/// the file's interleaved pairs.
fn interleaved(values: Vec<f32>, width: usize, columns: RopeColumns) -> Vec<f32> {
    let mut out = vec![0.0; values.len()];
    for (row, into) in values.chunks_exact(width).zip(out.chunks_exact_mut(width)) {
        for (c, v) in row.iter().enumerate() {
            into[columns.file_index(c)] = *v;
        }
    }
    out
}

/// `values` (our layout, gathered) in the file's layout: transposed to `[out, in]`, rows past
/// the vocabulary (padding) dropped.
fn hf_layout(entry: &Entry, values: Vec<f32>) -> Vec<f32> {
    if entry.shape.len() != 2 {
        return values;
    }
    let n: usize = entry.shape.iter().product();
    if !entry.transposed {
        let mut values = values;
        values.truncate(n);
        return values;
    }
    // Ours is [in, out'] with out' ≥ out (padding); the file's [out, in].
    let [rows, cols] = [entry.shape[0], entry.shape[1]];
    let stride = values.len() / cols;
    let mut out = vec![0.0f32; n];
    for r in 0..rows {
        for c in 0..cols {
            out[r * cols + c] = values[c * stride + r];
        }
    }
    out
}

/// One safetensors file of `tensors`, written to a temporary name, synced and renamed.
fn write_file(path: &Path, tensors: &[Stored]) -> Result<(), HfError> {
    let views = tensors
        .iter()
        .map(|(n, dtype, s, b)| TensorView::new(*dtype, s.clone(), b).map(|v| (n.as_str(), v)))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format_error(path, e))?;
    // transformers refuses safetensors files whose metadata names no framework.
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let buffer = safetensors::serialize(views, Some(metadata)).map_err(|e| format_error(path, e))?;
    write(path, &buffer)
}

fn write(path: &Path, bytes: &[u8]) -> Result<(), HfError> {
    crate::checkpoint::storage::write_synced(&crate::checkpoint::storage::Disk, path, bytes).map_err(|e| HfError::Io {
        path: path.display().to_string(),
        detail: e.to_string(),
    })
}
