//! Loading: every file memory-mapped, each rank decoding only its own slice of each tensor to
//! f32 (an 8B model at tp 8 as threads maps the files once a rank but never holds them whole in
//! f32). Everything is read and checked before the model changes.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::tensor::{Tensor, TensorData};
use burn_megatron_dist::ProcessGroups;
use memmap2::Mmap;
use safetensors::tensor::{Dtype, SafeTensors};
use serde::Deserialize;

use super::compressed::{Compression, Input, is_block_linear, scale_names};
use super::config::{HfConfig, read_config};
use super::{FileTensor, HfError, MTP_SHARED, RopeColumns, format_error, io, is_vocab, rope_columns, tensor_of};
use crate::models::llama::{Llama, LlamaBlock, LlamaConfig, LlamaStage, WordEmbeddings};
use crate::models::llama::{Site, linear_mut};
use crate::params::{map_params, param_infos, param_values};
use crate::precision::delayed::is_history;
use crate::precision::ptq::Codes;

/// The checkpoint's files, mapped, and where each tensor lies in them.
struct Checkpoint {
    maps: Vec<Mmap>,
    tensors: BTreeMap<String, Stored>,
}

/// One tensor: its file, dtype, shape and byte range in the mapping.
struct Stored {
    file: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: std::ops::Range<usize>,
}

impl Checkpoint {
    fn open(dir: &Path) -> Result<Self, HfError> {
        let index = dir.join("model.safetensors.index.json");
        let files: Vec<String> = if index.exists() {
            #[derive(Deserialize)]
            struct Index {
                weight_map: BTreeMap<String, String>,
            }
            let text = std::fs::read_to_string(&index).map_err(|e| io(&index, e))?;
            let parsed: Index = serde_json::from_str(&text).map_err(|e| format_error(&index, e))?;
            let files: BTreeSet<String> = parsed.weight_map.into_values().collect();
            files.into_iter().collect()
        } else {
            vec!["model.safetensors".to_string()]
        };
        let mut maps = Vec::with_capacity(files.len());
        let mut tensors = BTreeMap::new();
        for (i, file) in files.iter().enumerate() {
            let path: PathBuf = dir.join(file);
            let handle = File::open(&path).map_err(|e| io(&path, e))?;
            // SAFETY: the mapping is only read, and lives as long as `Checkpoint`. Another
            // process truncating or rewriting the file while it is loaded would change what we
            // read (or fault); checkpoints are not written while they are loaded.
            let map = unsafe { Mmap::map(&handle) }.map_err(|e| io(&path, e))?;
            let (header, metadata) = SafeTensors::read_metadata(&map).map_err(|e| format_error(&path, e))?;
            let start = 8 + header;
            for (name, info) in metadata.tensors() {
                let (a, b) = info.data_offsets;
                tensors.insert(
                    name,
                    Stored {
                        file: i,
                        dtype: info.dtype,
                        shape: info.shape.clone(),
                        bytes: start + a..start + b,
                    },
                );
            }
            maps.push(map);
        }
        Ok(Self { maps, tensors })
    }

    fn bytes(&self, t: &Stored) -> &[u8] {
        &self.maps[t.file][t.bytes.clone()]
    }

    /// The file's multi-token prediction modules beyond the model's `depth` first ones, left
    /// out as transformers leaves them all; the built ones' copies of the shared embedding and
    /// output layer, which must be the model's (its modules share them). Each goes into `used`.
    fn mtp_modules(&self, config: &HfConfig, depth: usize, used: &mut BTreeSet<String>) -> Result<(), HfError> {
        for k in 0..config.choices.mtp_layers {
            let block = format!("model.layers.{}.", config.num_hidden_layers + k);
            if k >= depth {
                used.extend(self.tensors.keys().filter(|name| name.starts_with(&block)).cloned());
                continue;
            }
            for (copy, shared) in MTP_SHARED {
                let name = format!("{block}{copy}");
                let Some(stored) = self.tensors.get(&name) else {
                    continue;
                };
                // A tied model's output layer is its embedding.
                let model = self
                    .tensors
                    .get(shared)
                    .or_else(|| self.tensors.get(MTP_SHARED[0].1))
                    .filter(|t| t.dtype == stored.dtype && t.shape == stored.shape);
                if model.is_none_or(|t| self.bytes(t) != self.bytes(stored)) {
                    return Err(HfError::Incompatible {
                        name,
                        detail: format!("differs from {shared}, which the modules share here"),
                    });
                }
                used.insert(name);
            }
        }
        Ok(())
    }

    /// Decodes elements `from..from + out.len()` of `t` (row-major) into `out`.
    fn decode(&self, t: &Stored, from: usize, out: &mut [f32]) {
        let size = t.dtype.bitsize() / 8;
        let bytes = &self.bytes(t)[from * size..(from + out.len()) * size];
        let chunks = bytes.chunks_exact(size).zip(out.iter_mut());
        match t.dtype {
            Dtype::F32 => chunks.for_each(|(c, o)| *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            Dtype::BF16 => chunks.for_each(|(c, o)| *o = half::bf16::from_le_bytes([c[0], c[1]]).to_f32()),
            Dtype::F16 => chunks.for_each(|(c, o)| *o = half::f16::from_le_bytes([c[0], c[1]]).to_f32()),
            // A compressed checkpoint's codes, before their scales.
            Dtype::F8_E4M3 => chunks.for_each(|(c, o)| *o = Compression::decode(Codes::Fp8, c[0])),
            Dtype::I8 => chunks.for_each(|(c, o)| *o = Compression::decode(Codes::Int8, c[0])),
            _ => unreachable!("dtypes are checked before decoding"),
        }
    }

    /// The `len` values of the scale tensor `name` (f32, bf16 or f16; `[len]`, `[len, 1]` or a
    /// scalar).
    fn scale(&self, name: &str, len: usize) -> Result<Vec<f32>, HfError> {
        let incompatible = |detail: String| HfError::Incompatible {
            name: name.to_string(),
            detail,
        };
        let t = self
            .tensors
            .get(name)
            .ok_or_else(|| incompatible("a compressed weight's scale is missing".into()))?;
        let elements: usize = t.shape.iter().product();
        if !matches!(t.dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16) || elements != len {
            return Err(incompatible(format!(
                "stored {:?} {:?}: {len} f32, bf16 or f16 scales expected",
                t.dtype, t.shape
            )));
        }
        let mut out = vec![0.0; len];
        self.decode(t, 0, &mut out);
        Ok(out)
    }

    /// This rank's part of a stack of experts, `local` `[e/ep, ..]`, from one tensor an expert
    /// (`file.name` with `{j}` the expert): its ep rank's experts, of each its etp rank's slice
    /// of the hidden features along our `split_dim` (2 for the gate and up projections' `[d, f]`,
    /// 1 for the down projection's `[f, d]`). Each name read goes into `used`.
    fn read_experts(
        &self,
        file: &FileTensor,
        local: &[usize],
        split_dim: Option<usize>,
        groups: &ProcessGroups,
        used: &mut BTreeSet<String>,
    ) -> Result<Vec<f32>, HfError> {
        let (experts, one) = (local[0], &local[1..]);
        let dim = split_dim.map_or(0, |d| d - 1);
        let parts = if split_dim.is_some() { groups.etp.size() } else { 1 };
        let start = groups.etp.group_rank() * one[dim] * usize::from(split_dim.is_some());
        let first = groups.ep.group_rank() * experts;
        let mut out = Vec::with_capacity(local.iter().product());
        // The other ep ranks read their experts: none of them is left over.
        used.extend((0..experts * groups.ep.size()).map(|j| file.name.replace("{j}", &j.to_string())));
        for j in first..first + experts {
            let name = file.name.replace("{j}", &j.to_string());
            let incompatible = |detail: String| HfError::Incompatible {
                name: name.clone(),
                detail,
            };
            let stored = self
                .tensors
                .get(&name)
                .ok_or_else(|| incompatible("an expert's tensor is not in the checkpoint".into()))?;
            if !matches!(stored.dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16) {
                return Err(incompatible(format!("unsupported dtype {:?}", stored.dtype)));
            }
            let global: Vec<usize> = match file.transposed {
                true => stored.shape.iter().rev().copied().collect(),
                false => stored.shape.clone(),
            };
            let fits = global.len() == one.len()
                && global.iter().zip(one).enumerate().all(|(d, (g, l))| match d == dim {
                    true => *g == l * parts,
                    false => g == l,
                });
            if !fits {
                return Err(incompatible(format!(
                    "stored {:?}: it does not fit an expert's local shape {one:?} over {parts} ranks",
                    stored.shape
                )));
            }
            out.extend(self.read_local(stored, file.transposed, one, dim, start));
        }
        Ok(out)
    }

    /// This rank's part of `t` for a parameter of local shape `local`, split along our `dim`
    /// from `start`; `transposed`: `t` is stored `[out, in]` and ours is `[in, out]`. Along the
    /// split dim, positions past the stored tensor (vocabulary padding) are zeros.
    fn read_local(&self, t: &Stored, transposed: bool, local: &[usize], dim: usize, start: usize) -> Vec<f32> {
        let mut out = vec![0.0f32; local.iter().product()];
        let global: Vec<usize> = match transposed {
            true => t.shape.iter().rev().copied().collect(),
            false => t.shape.clone(),
        };
        let range = |d: usize| {
            let from = if d == dim { start } else { 0 };
            from..(from + local[d]).min(global[d])
        };
        match local.len() {
            1 => {
                let rows = range(0);
                let n = rows.len();
                self.decode(t, rows.start, &mut out[..n]);
            }
            2 => {
                let (rows, cols) = (range(0), range(1));
                let width = local[1];
                if !transposed {
                    for r in rows.clone() {
                        let dst = (r - rows.start) * width;
                        self.decode(t, r * global[1] + cols.start, &mut out[dst..dst + cols.len()]);
                    }
                } else {
                    // Stored row `c` holds our column `c`: decode its run of our rows, scatter.
                    let mut run = vec![0.0f32; rows.len()];
                    for c in cols.clone() {
                        self.decode(t, c * global[0] + rows.start, &mut run);
                        for (k, v) in run.iter().enumerate() {
                            out[k * width + (c - cols.start)] = *v;
                        }
                    }
                }
            }
            _ => unreachable!("Llama's parameters are vectors and matrices"),
        }
        out
    }
}

/// Loads the Hugging Face checkpoint in `dir` into `model`, each rank reading its slice. The
/// checkpoint's `config.json` must describe `model` ([`HfError::Mismatch`] names the field
/// that differs), and every tensor must be used ([`HfError::LeftOver`]). A compressed-tensors
/// checkpoint (`compressed.rs`) loads its block linears' codes times their scales, and sets
/// each one's input quantizer as its `quantization_config` says.
pub fn load(dir: &Path, model: Llama, groups: &ProcessGroups) -> Result<Llama, HfError> {
    let config = read_config(dir)?;
    config.check_model(&model, groups)?;
    let tied = model.word_embeddings() == WordEmbeddings::Tied;
    let mut read = Read::new(dir, &config, &model, groups, &Held::All, tied)?;
    let mut model = read.apply(model);
    read.quantize_inputs(model.layers.iter_mut().enumerate())?;
    Ok(model)
}

/// [`load`] for one pipeline stage built from `whole` (the whole model's configuration, which
/// the checkpoint's config must describe): the stage reads the tensors of the parts it holds,
/// and leaves the other stages' to them (each rank's slices, as [`load`]'s).
pub fn load_stage(
    dir: &Path,
    stage: LlamaStage,
    whole: &LlamaConfig,
    groups: &ProcessGroups,
) -> Result<LlamaStage, HfError> {
    let config = read_config(dir)?;
    config.check_stage(&stage, whole, groups)?;
    let held = Held::Stage {
        layers: stage.layers.iter().map(Option::is_some).collect(),
        embedding: stage.embedding.is_some(),
        head: stage.norm.is_some(),
    };
    let tied = whole.word_embeddings == WordEmbeddings::Tied;
    let mut read = Read::new(dir, &config, &stage, groups, &held, tied)?;
    let mut stage = read.apply(stage);
    let blocks = stage.layers.iter_mut().enumerate();
    read.quantize_inputs(blocks.filter_map(|(i, block)| block.as_mut().map(|b| (i, b))))?;
    Ok(stage)
}

/// Which of the file's tensors this rank's part of the model holds: any other one not read is
/// left over.
enum Held {
    All,
    /// A pipeline stage: the blocks it holds (by index), the embedding (on the first stage, and
    /// as the tied output layer on the last), the final norm and output layer.
    Stage {
        layers: Vec<bool>,
        embedding: bool,
        head: bool,
    },
}

impl Held {
    /// Whether the tensor `name` of the file is this rank's to read: another stage's is not. A
    /// name of no part the model has (a block past its last) is this rank's, and left over.
    fn holds(&self, name: &str) -> bool {
        let Self::Stage {
            layers,
            embedding,
            head,
        } = self
        else {
            return true;
        };
        match name {
            "model.embed_tokens.weight" => *embedding,
            "model.norm.weight" | "lm_head.weight" => *head,
            _ => {
                let index = name
                    .strip_prefix("model.layers.")
                    .and_then(|rest| rest.split('.').next());
                match index.and_then(|i| i.parse::<usize>().ok()).and_then(|i| layers.get(i)) {
                    Some(held) => *held,
                    None => true,
                }
            }
        }
    }
}

/// Every parameter's slice of one model, read and checked, before the model changes.
struct Read {
    values: Vec<Option<Vec<f32>>>,
    /// Each compressed linear's input scale, by our layer path (`layers.0.attention.wq`).
    input_scales: BTreeMap<String, f32>,
    compression: Option<Compression>,
}

impl Read {
    fn new<M: Module>(
        dir: &Path,
        config: &HfConfig,
        model: &M,
        groups: &ProcessGroups,
        held: &Held,
        tied: bool,
    ) -> Result<Self, HfError> {
        let config_path = dir.join("config.json");
        let raw = std::fs::read_to_string(&config_path).map_err(|e| io(&config_path, e))?;
        let raw: serde_json::Value = serde_json::from_str(&raw).map_err(|e| format_error(&config_path, e))?;
        let compression = Compression::from_json(&raw)?;
        let checkpoint = Checkpoint::open(dir)?;
        let infos = param_infos(model);
        let shapes: Vec<Vec<usize>> = param_values(model).into_iter().map(|p| p.dims).collect();
        let (tp, tp_rank) = (groups.tp.size(), groups.tp.group_rank());
        let mut used = BTreeSet::new();
        let mut values = Vec::with_capacity(infos.len());
        let mut input_scales = BTreeMap::new();
        let depth = infos
            .iter()
            .filter_map(|info| mtp_module(&info.path))
            .map(|k| k + 1)
            .max();
        checkpoint.mtp_modules(config, depth.unwrap_or(0), &mut used)?;
        for (info, local) in infos.iter().zip(&shapes) {
            // Delayed FP8 scaling's amax histories are training state, no checkpoint weight: kept.
            if is_history(&info.path) {
                values.push(None);
                continue;
            }
            let incompatible = |detail: String| HfError::Incompatible {
                name: info.path.clone(),
                detail,
            };
            let file = tensor_of(config, &info.path).ok_or_else(|| incompatible("no Hugging Face name".into()))?;
            if file.per_expert {
                values.push(Some(checkpoint.read_experts(
                    &file,
                    local,
                    info.split_dim,
                    groups,
                    &mut used,
                )?));
                continue;
            }
            let FileTensor { name, transposed, .. } = file;
            let stored = checkpoint
                .tensors
                .get(&name)
                .ok_or_else(|| incompatible(format!("{name} is not in the checkpoint")))?;
            let compressed = compression.filter(|_| is_block_linear(&info.path));
            let dtype_fits = match compressed {
                Some(scheme) => stored.dtype == scheme.dtype(),
                None => matches!(stored.dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16),
            };
            if !dtype_fits {
                return Err(incompatible(format!("{name}: unsupported dtype {:?}", stored.dtype)));
            }
            let global: Vec<usize> = match transposed {
                true => stored.shape.iter().rev().copied().collect(),
                false => stored.shape.clone(),
            };
            let dim = info.split_dim.unwrap_or(0);
            let parts = if info.split_dim.is_some() { tp } else { 1 };
            // Along the split dim the whole is `local · parts`, less the padding for the vocabulary.
            let fits = global.len() == local.len()
                && global.iter().zip(local).enumerate().all(|(d, (g, l))| match d == dim {
                    true if is_vocab(&info.path) => *g == config.vocab_size && *g <= l * parts,
                    true => *g == l * parts,
                    false => g == l,
                });
            if !fits {
                return Err(incompatible(format!(
                    "{name} is stored {:?}: it does not fit a local shape {local:?} over {parts} ranks",
                    stored.shape
                )));
            }
            let start = if info.split_dim.is_some() {
                tp_rank * local[dim]
            } else {
                0
            };
            let mut local_values = checkpoint.read_local(stored, transposed, local, dim, start);
            if let Some(columns) = rope_columns(config, &info.path) {
                local_values = halves(local_values, local[1], columns);
            }
            if let Some(scheme) = compressed {
                // Our [in, out'] slice: output channel `c` is global `c + offset`.
                let offset = if info.split_dim == Some(1) { start } else { 0 };
                let (scale_name, input_name) = scale_names(&name);
                let out = global[1];
                let scales = checkpoint.scale(&scale_name, if scheme.per_channel { out } else { 1 })?;
                for (i, v) in local_values.iter_mut().enumerate() {
                    *v *= scales[if scheme.per_channel { offset + i % local[1] } else { 0 }];
                }
                used.insert(scale_name);
                if scheme.input == Input::Static {
                    let layer = info.path.strip_suffix(".weight").expect("a weight").to_string();
                    input_scales.insert(layer, checkpoint.scale(&input_name, 1)?[0]);
                    used.insert(input_name);
                }
            }
            values.push(Some(local_values));
            used.insert(name);
        }
        let left_over: Vec<String> = checkpoint
            .tensors
            .iter()
            .filter(|(name, _)| !used.contains(*name) && held.holds(name))
            // Rotary frequencies that older exports kept as buffers: derived, not weights.
            .filter(|(name, _)| !name.ends_with("rotary_emb.inv_freq"))
            // A tied checkpoint may store the output weight too; it must then be the embedding.
            .filter(|(name, stored)| {
                let same_as_embedding = || {
                    let embed = &checkpoint.tensors["model.embed_tokens.weight"];
                    embed.dtype == stored.dtype
                        && embed.shape == stored.shape
                        && checkpoint.bytes(embed) == checkpoint.bytes(stored)
                };
                !(tied && name.as_str() == "lm_head.weight" && same_as_embedding())
            })
            .map(|(name, _)| name.clone())
            .collect();
        if !left_over.is_empty() {
            return Err(HfError::LeftOver { names: left_over });
        }
        Ok(Self {
            values,
            input_scales,
            compression,
        })
    }

    /// `model` with every value read; the others (delayed scaling's histories) as they were.
    fn apply<M: Module>(&mut self, model: M) -> M {
        let values = &mut self.values;
        map_params(model, &mut |i, old, _| match values[i].take() {
            Some(v) => {
                let n = v.len();
                Tensor::<1>::from_data(TensorData::new(v, [n]), &old.device()).cast(old.dtype())
            }
            None => old,
        })
    }

    /// A compressed checkpoint's input quantizers on the blocks `(index, block)`.
    fn quantize_inputs<'a>(&self, blocks: impl Iterator<Item = (usize, &'a mut LlamaBlock)>) -> Result<(), HfError> {
        let Some(scheme) = self.compression else {
            return Ok(());
        };
        for (i, block) in blocks {
            for path in Site::ALL.iter().flat_map(|s| s.linears()) {
                let input_scale = self.input_scales.get(&format!("layers.{i}.{path}")).copied();
                let linear = linear_mut(block, path).ok_or_else(|| HfError::Incompatible {
                    name: format!("layers.{i}.{path}"),
                    detail: "a mixture-of-experts block has no such layer".into(),
                })?;
                linear.precision.input_quantizer = scheme.input_quantizer(input_scale);
            }
        }
        Ok(())
    }
}

/// The multi-token prediction module our parameter `path` belongs to (`mtp.{k}.…`).
fn mtp_module(path: &str) -> Option<usize> {
    path.strip_prefix("mtp.")?.split_once('.')?.0.parse().ok()
}

/// `values` (`[in, out]`, out features in the file's order, whole heads) with each run's rotated
/// features moved from interleaved pairs into halves ([`RopeColumns::file_index`]).
fn halves(values: Vec<f32>, width: usize, columns: RopeColumns) -> Vec<f32> {
    let sources: Vec<usize> = (0..width).map(|c| columns.file_index(c)).collect();
    values
        .chunks_exact(width)
        .flat_map(|row| sources.iter().map(|&c| row[c]))
        .collect()
}
