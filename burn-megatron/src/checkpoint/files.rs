//! The on-disk pieces of a checkpoint: one safetensors file per tensor- and expert-parallel
//! rank, each tensor described by its global shape and its place in it, and an index with each
//! file's checksum.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde::{Deserialize, Serialize};

use super::CheckpointError;
use super::storage::checksum;

/// Where one stored tensor sits in the whole tensor.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    pub global_shape: Vec<usize>,
    /// The dim split over the tensor-parallel group, if any (a vocabulary padded further at
    /// another tp may differ along it).
    pub split_dim: Option<usize>,
    /// The first index this piece holds along each dim (experts split along dim 0 over ep).
    pub offsets: Vec<usize>,
}

/// `index.json`: what a checkpoint holds and at which layout it was written.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Index {
    pub format: String,
    pub step: u64,
    /// Optimizer steps taken (AdamW's bias correction needs it).
    pub optimizer_steps: u64,
    pub tp: usize,
    pub dp: usize,
    pub ep: usize,
    /// Pipeline stages (1 in checkpoints written before pipelines saved).
    #[serde(default = "one")]
    pub pp: usize,
    pub files: Vec<String>,
    /// Every tensor's whole shape.
    pub tensors: BTreeMap<String, Vec<usize>>,
    /// Each file's length and CRC-32 (`storage::checksum`), the shards' and the attachments',
    /// checked as a load reads them (none in checkpoints of format 2).
    #[serde(default)]
    pub checksums: BTreeMap<String, String>,
}

fn one() -> usize {
    1
}

pub const FORMAT: &str = "burn-megatron/3";

/// Formats a load reads: this one, and 2 (written before files had checksums).
pub const READS: [&str; 2] = [FORMAT, "burn-megatron/2"];

/// The file of pipeline rank `pp_rank` of `pp` (named only above 1), tensor-parallel rank
/// `tp_rank` of `tp` and expert-parallel rank `ep_rank` of `ep`. A stage's file holds its own
/// blocks under the whole model's paths, so the names say where a file came from, and loading
/// reads every file whatever the layout.
pub fn shard_file(
    (pp_rank, pp): (usize, usize),
    (tp_rank, tp): (usize, usize),
    (ep_rank, ep): (usize, usize),
) -> String {
    let stage = match pp {
        1 => String::new(),
        _ => format!("pp-{pp_rank:03}-of-{pp:03}-"),
    };
    format!("{stage}tp-{tp_rank:03}-of-{tp:03}-ep-{ep_rank:03}-of-{ep:03}.safetensors")
}

/// A piece of a tensor held in memory: f32 values, local shape, placement.
#[derive(Clone, Debug)]
pub struct Piece {
    pub shape: Vec<usize>,
    pub values: Vec<f32>,
    pub placement: Placement,
}

/// `pieces` as one safetensors file's bytes, their placements in its metadata (`path` names
/// the file in an error).
pub fn shard_bytes(path: &Path, pieces: &BTreeMap<String, Piece>) -> Result<Vec<u8>, CheckpointError> {
    let placements: BTreeMap<&String, &Placement> = pieces.iter().map(|(k, p)| (k, &p.placement)).collect();
    let metadata = [(
        "placements".to_string(),
        serde_json::to_string(&placements).expect("placements serialize"),
    )]
    .into();
    let bytes: Vec<(String, Vec<u8>, Vec<usize>)> = pieces
        .iter()
        .map(|(name, p)| {
            (
                name.clone(),
                p.values.iter().flat_map(|v| v.to_le_bytes()).collect(),
                p.shape.clone(),
            )
        })
        .collect();
    let format = |e: safetensors::SafeTensorError| CheckpointError::Format {
        path: path.to_path_buf(),
        detail: e.to_string(),
    };
    let views = bytes
        .iter()
        .map(|(name, data, shape)| Ok((name.as_str(), TensorView::new(Dtype::F32, shape.clone(), data)?)))
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()
        .map_err(format)?;
    safetensors::serialize(views, Some(metadata)).map_err(format)
}

/// The bytes of `path`, checked against the index's `checksums` where it has one for `name`:
/// a truncated or corrupted file is an error naming it.
pub fn read_checked(path: &Path, name: &str, checksums: &BTreeMap<String, String>) -> Result<Vec<u8>, CheckpointError> {
    let bytes = fs::read(path).map_err(|e| CheckpointError::Io {
        path: path.to_path_buf(),
        detail: e.to_string(),
    })?;
    if let Some(expected) = checksums.get(name) {
        let found = checksum(&bytes);
        if &found != expected {
            return Err(CheckpointError::Format {
                path: path.to_path_buf(),
                detail: format!("truncated or corrupted: {found} (bytes:CRC-32), where the index recorded {expected}"),
            });
        }
    }
    Ok(bytes)
}

/// Every piece of one file's `bytes` (read from `path`); any damage is an error naming the file.
pub fn read_shard(path: &Path, bytes: &[u8]) -> Result<BTreeMap<String, Piece>, CheckpointError> {
    let format = |detail: String| CheckpointError::Format {
        path: path.to_path_buf(),
        detail,
    };
    let (_, metadata) = SafeTensors::read_metadata(bytes).map_err(|e| format(e.to_string()))?;
    let placements: BTreeMap<String, Placement> = metadata
        .metadata()
        .as_ref()
        .and_then(|m| m.get("placements"))
        .ok_or_else(|| format("no placements in its metadata".into()))
        .and_then(|json| serde_json::from_str(json).map_err(|e| format(e.to_string())))?;
    let file = SafeTensors::deserialize(bytes).map_err(|e| format(e.to_string()))?;
    let mut pieces = BTreeMap::new();
    for (name, view) in file.tensors() {
        if view.dtype() != Dtype::F32 {
            return Err(format(format!("{name} is {:?}, not F32", view.dtype())));
        }
        let placement = placements
            .get(&name)
            .cloned()
            .ok_or_else(|| format(format!("{name} has no placement")))?;
        let values = view
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect();
        pieces.insert(
            name,
            Piece {
                shape: view.shape().to_vec(),
                values,
                placement,
            },
        );
    }
    Ok(pieces)
}
