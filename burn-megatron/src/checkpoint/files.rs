//! The on-disk pieces of a checkpoint: one safetensors file per tensor- and expert-parallel
//! rank, each tensor described by its global shape and its place in it, an index, and atomic
//! writes.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde::{Deserialize, Serialize};

use super::CheckpointError;

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
}

fn one() -> usize {
    1
}

pub const FORMAT: &str = "burn-megatron/2";

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

/// Writes `pieces` as one safetensors file, their placements in its metadata.
pub fn write_shard(path: &Path, pieces: &BTreeMap<String, Piece>) -> Result<(), CheckpointError> {
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
    let views = bytes
        .iter()
        .map(|(name, data, shape)| Ok((name.as_str(), TensorView::new(Dtype::F32, shape.clone(), data)?)))
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()
        .map_err(|e| CheckpointError::Format {
            path: path.to_path_buf(),
            detail: e.to_string(),
        })?;
    let buffer = safetensors::serialize(views, Some(metadata)).map_err(|e| CheckpointError::Format {
        path: path.to_path_buf(),
        detail: e.to_string(),
    })?;
    write_synced(path, &buffer)
}

/// Reads every piece of one file; any damage is an error naming the file.
pub fn read_shard(path: &Path) -> Result<BTreeMap<String, Piece>, CheckpointError> {
    let bytes = fs::read(path).map_err(|e| CheckpointError::Io {
        path: path.to_path_buf(),
        detail: e.to_string(),
    })?;
    let format = |detail: String| CheckpointError::Format {
        path: path.to_path_buf(),
        detail,
    };
    let (_, metadata) = SafeTensors::read_metadata(&bytes).map_err(|e| format(e.to_string()))?;
    let placements: BTreeMap<String, Placement> = metadata
        .metadata()
        .as_ref()
        .and_then(|m| m.get("placements"))
        .ok_or_else(|| format("no placements in its metadata".into()))
        .and_then(|json| serde_json::from_str(json).map_err(|e| format(e.to_string())))?;
    let file = SafeTensors::deserialize(&bytes).map_err(|e| format(e.to_string()))?;
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

/// Writes `bytes` to a temporary name beside `path`, fsyncs it, and renames it into place.
pub fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let io = |e: std::io::Error| CheckpointError::Io {
        path: path.to_path_buf(),
        detail: e.to_string(),
    };
    let temporary = temporary_name(path);
    let mut file = File::create(&temporary).map_err(io)?;
    file.write_all(bytes).map_err(io)?;
    file.sync_all().map_err(io)?;
    fs::rename(&temporary, path).map_err(io)?;
    sync_dir(path.parent().unwrap_or(Path::new(".")))
}

/// Fsyncs a directory, so renames inside it survive a crash.
pub fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| CheckpointError::Io {
            path: dir.to_path_buf(),
            detail: e.to_string(),
        })
}

fn temporary_name(path: &Path) -> PathBuf {
    let mut name = path.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(format!(".tmp-{}", std::process::id()));
    path.with_file_name(name)
}
