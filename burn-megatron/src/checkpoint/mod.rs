//! Sharded checkpoints: one safetensors file per tensor- and expert-parallel rank, each tensor
//! stored with its global shape and its offsets, plus an index. Loading reshards to any
//! tp × dp × ep layout, the optimizer state too.
//!
//! A save writes into a staging directory, fsyncs every file, then renames the directory into
//! place and moves the `latest` pointer (itself written to a temporary name, fsynced and
//! renamed): a crash or a failed write at any point leaves the previous checkpoint whole and
//! `latest` pointing at it, and a failed write is an error on every rank ([`storage`]).
//! [`AsyncSaver`] does the writing on a thread of its own, so training goes on meanwhile. The
//! index keeps each file's length and CRC-32; a load reads and checks everything before it
//! changes anything, so a truncated, corrupted or incompatible checkpoint is an error naming the
//! file, and the model is untouched.

mod files;
mod save;
mod saver;
pub mod storage;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::tensor::{Tensor, TensorData};
use burn_megatron_dist::{CommError, ProcessGroups};

pub use files::{Index, Placement};
use files::{Piece, READS, read_checked, read_shard};
pub use save::{AsyncSaver, SaveOptions, save, save_with};
pub use saver::Saver;

use crate::optim::{DistributedAdamW, ParamState};
use crate::params::{ParamInfo, map_params, param_infos, param_values};

#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum CheckpointError {
    #[error("{path}: {detail}", path = path.display())]
    Io { path: PathBuf, detail: String },
    #[error("{path} is not a valid checkpoint file: {detail}", path = path.display())]
    Format { path: PathBuf, detail: String },
    #[error("no checkpoint in {dir}: {detail}", dir = dir.display())]
    NotFound { dir: PathBuf, detail: String },
    #[error("checkpoint tensor {name} does not fit this model: {detail}")]
    Incompatible { name: String, detail: String },
    #[error(transparent)]
    Comm(#[from] CommError),
}

/// Every parameter's values on this rank, flattened to f32, with its local shape.
fn local_values<M: Module>(model: &M) -> Vec<(Vec<usize>, Vec<f32>)> {
    param_values(model)
        .into_iter()
        .map(|p| {
            (
                p.dims,
                p.value
                    .into_data()
                    .convert::<f32>()
                    .try_into_vec::<f32>()
                    .expect("f32 values"),
            )
        })
        .collect()
}

fn placement(info: &ParamInfo, shape: &[usize], groups: &ProcessGroups) -> Placement {
    let mut global_shape = shape.to_vec();
    let mut offsets = vec![0; shape.len()];
    if let Some(d) = info.split_dim {
        // Experts' hidden features split over etp, everything else over tp.
        let split = if info.expert { &groups.etp } else { &groups.tp };
        global_shape[d] *= split.size();
        offsets[d] = split.group_rank() * shape[d];
    }
    if info.expert {
        global_shape[0] *= groups.ep.size();
        offsets[0] = groups.ep.group_rank() * shape[0];
    }
    Placement {
        global_shape,
        split_dim: info.split_dim,
        offsets,
    }
}

const OPTIMIZER: [&str; 3] = ["master", "m", "v"];

fn optimizer_name(part: &str, path: &str) -> String {
    format!("optimizer.{part}.{path}")
}

fn state_parts(state: &ParamState) -> Vec<Vec<f32>> {
    [&state.master, &state.m, &state.v]
        .into_iter()
        .map(|t| t.to_data().convert::<f32>().try_into_vec::<f32>().expect("f32 values"))
        .collect()
}

/// The latest checkpoint under `dir`: its directory and its index, checked to be of a format a
/// load reads.
fn latest(dir: &Path) -> Result<(PathBuf, Index), CheckpointError> {
    let not_found = |detail: String| CheckpointError::NotFound {
        dir: dir.to_path_buf(),
        detail,
    };
    let latest = std::fs::read_to_string(dir.join("latest")).map_err(|e| not_found(e.to_string()))?;
    let root = dir.join(latest.trim());
    let index_path = root.join("index.json");
    let index_bytes = std::fs::read(&index_path).map_err(|e| not_found(e.to_string()))?;
    let index: Index = serde_json::from_slice(&index_bytes).map_err(|e| CheckpointError::Format {
        path: index_path.clone(),
        detail: e.to_string(),
    })?;
    if !READS.contains(&index.format.as_str()) {
        return Err(CheckpointError::Format {
            path: index_path,
            detail: format!("format {:?}, expected one of {READS:?}", index.format),
        });
    }
    Ok((root, index))
}

/// The file `name` attached to the latest checkpoint under `dir` ([`SaveOptions::attachments`]),
/// if it has one, checked against the index's checksum.
pub fn attachment(dir: &Path, name: &str) -> Result<Option<Vec<u8>>, CheckpointError> {
    let (root, index) = latest(dir)?;
    let path = root.join(name);
    match path.exists() {
        true => read_checked(&path, name, &index.checksums).map(Some),
        false => Ok(None),
    }
}

/// The step the latest checkpoint under `dir` was saved at.
pub fn latest_step(dir: &Path) -> Result<u64, CheckpointError> {
    Ok(latest(dir)?.1.step)
}

/// Loads the latest checkpoint under `dir` into `model` and `optim`, resharded to this layout;
/// returns the model and the step it was saved at. Every rank calls it.
pub fn load<M: Module>(
    dir: &Path,
    model: M,
    optim: &mut DistributedAdamW,
    groups: &ProcessGroups,
) -> Result<(M, u64), CheckpointError> {
    let (model, states, optimizer_steps, step) = read(dir, model, groups, true)?;
    if optimizer_steps > 0 {
        let device = optimizer_device(&model);
        let tensor = |v: &Vec<f32>| Tensor::<1>::from_data(TensorData::new(v.clone(), [v.len()]), &device);
        let states = states
            .iter()
            .map(|p| ParamState {
                master: tensor(&p[0]),
                m: tensor(&p[1]),
                v: tensor(&p[2]),
            })
            .collect();
        optim.import_state(&model, states, optimizer_steps);
    }
    Ok((model, step))
}

/// [`load`] of the model alone (its weights, for inference or an export): the optimizer's
/// state is left unread.
pub fn load_model<M: Module>(dir: &Path, model: M, groups: &ProcessGroups) -> Result<(M, u64), CheckpointError> {
    let (model, _, _, step) = read(dir, model, groups, false)?;
    Ok((model, step))
}

/// The latest checkpoint's values of `model`'s parameters at this layout, and with
/// `optimizer` each one's master weights and moments: the model changed, the states, the
/// optimizer's steps and the checkpoint's step.
type Read<M> = (M, Vec<Vec<Vec<f32>>>, u64, u64);

fn read<M: Module>(dir: &Path, model: M, groups: &ProcessGroups, optimizer: bool) -> Result<Read<M>, CheckpointError> {
    let (root, index) = latest(dir)?;
    let mut stored = BTreeMap::new();
    for file in &index.files {
        let path = root.join(file);
        stored.extend(
            read_shard(&path, &read_checked(&path, file, &index.checksums)?)?
                .into_iter()
                .map(|(name, piece)| ((name, piece.placement.offsets.clone()), piece)),
        );
    }
    let infos = param_infos(&model);
    let locals = local_values(&model);
    let mut params = Vec::with_capacity(infos.len());
    let mut states = Vec::with_capacity(infos.len());
    let optimizer = optimizer && index.optimizer_steps > 0;
    for (info, (shape, _)) in infos.iter().zip(&locals) {
        let want = placement(info, shape, groups);
        params.push(assemble(&stored, &index, &info.path, shape, &want)?);
        if optimizer {
            let parts = OPTIMIZER
                .iter()
                .map(|part| assemble(&stored, &index, &optimizer_name(part, &info.path), shape, &want))
                .collect::<Result<Vec<_>, _>>()?;
            states.push(parts);
        }
    }
    // Everything is read and checked: now change the model.
    let model = map_params(model, &mut |i, old, _| {
        let n = params[i].len();
        Tensor::<1>::from_data(TensorData::new(params[i].clone(), [n]), &old.device()).cast(old.dtype())
    });
    let optimizer_steps = if optimizer { index.optimizer_steps } else { 0 };
    Ok((model, states, optimizer_steps, index.step))
}

/// The device of the model's first parameter (where the optimizer keeps its state).
fn optimizer_device<M: Module>(model: &M) -> burn::tensor::Device {
    param_values(model)
        .first()
        .map(|p| p.value.device())
        .unwrap_or_else(burn::tensor::Device::flex)
}

/// This rank's piece of `name` (local `shape` at placement `want`), cut from the stored pieces
/// whose boxes overlap it. Along the tp split dim, positions past the stored tensor (a
/// vocabulary padded further at this layout) are zeros; every other dim must match.
fn assemble(
    stored: &BTreeMap<(String, Vec<usize>), Piece>,
    index: &Index,
    name: &str,
    shape: &[usize],
    want: &Placement,
) -> Result<Vec<f32>, CheckpointError> {
    let incompatible = |detail: String| CheckpointError::Incompatible {
        name: name.to_string(),
        detail,
    };
    let global = index
        .tensors
        .get(name)
        .ok_or_else(|| incompatible("not in the checkpoint".into()))?;
    let fits = global.len() == want.global_shape.len()
        && global
            .iter()
            .zip(&want.global_shape)
            .enumerate()
            .all(|(d, (a, b))| a == b || want.split_dim == Some(d));
    if !fits {
        return Err(incompatible(format!(
            "stored with shape {global:?}, this model has {:?}",
            want.global_shape
        )));
    }
    let mut out = vec![0.0f32; shape.iter().product()];
    let range = (name.to_string(), Vec::new())..=(name.to_string(), vec![usize::MAX]);
    for ((piece_name, _), piece) in stored.range(range) {
        debug_assert_eq!(piece_name, name);
        copy_overlap(piece, &mut out, shape, &want.offsets);
    }
    Ok(out)
}

/// Copies the part of `piece` inside the box at `offsets` of `shape` into `out` (that box's
/// values, row-major), one run along the last dim at a time.
fn copy_overlap(piece: &Piece, out: &mut [f32], shape: &[usize], offsets: &[usize]) {
    let rank = shape.len();
    if rank == 0 {
        out.copy_from_slice(&piece.values[..out.len()]);
        return;
    }
    let (p_shape, p_offsets) = (&piece.shape, &piece.placement.offsets);
    let lo: Vec<usize> = (0..rank).map(|d| offsets[d].max(p_offsets[d])).collect();
    let hi: Vec<usize> = (0..rank)
        .map(|d| (offsets[d] + shape[d]).min(p_offsets[d] + p_shape[d]))
        .collect();
    if (0..rank).any(|d| lo[d] >= hi[d]) {
        return;
    }
    let flat = |at: &[usize], dims: &[usize], origin: &[usize]| {
        at.iter()
            .zip(dims)
            .zip(origin)
            .fold(0, |acc, ((&i, &n), &o)| acc * n + (i - o))
    };
    let run = hi[rank - 1] - lo[rank - 1];
    let mut at = lo.clone();
    loop {
        let src = flat(&at, p_shape, p_offsets);
        let dst = flat(&at, shape, offsets);
        out[dst..dst + run].copy_from_slice(&piece.values[src..src + run]);
        // The next run: count up over the dims before the last.
        let mut d = rank - 1;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            at[d] += 1;
            if at[d] < hi[d] {
                break;
            }
            at[d] = lo[d];
        }
    }
}
