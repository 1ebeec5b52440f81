//! Saving: a [`Snapshot`] taken on the training thread (the collectives and the copies to the
//! host), then written by the writers and completed by global rank 0, which waits on
//! the files themselves rather than on a collective — so the writing can run on a thread of its
//! own ([`AsyncSaver`]) while training goes on over the same groups. A writer that fails leaves
//! a marker saying so, rank 0 then abandons the save, and every rank agrees on the outcome
//! before it goes on: a failed save is an error everywhere, and `latest` still names the
//! previous checkpoint, whole.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use burn::module::Module;
use burn::tensor::{Device, Int, Tensor};
use burn_megatron_dist::{ParallelDims, ProcessGroups, ReduceOp};

use super::files::{FORMAT, Index, Piece, shard_bytes, shard_file};
use super::storage::{Disk, Storage, checksum, write_synced};
use super::{CheckpointError, OPTIMIZER, local_values, optimizer_device, optimizer_name, placement, state_parts};
use crate::optim::DistributedAdamW;
use crate::optim::shared::StageCopies;
use crate::params::param_infos;

/// How long rank 0 waits for the other writers' shards before giving up on a save.
const WRITERS_TIMEOUT: Duration = Duration::from_secs(600);

/// Whether `rank` writes a shard: the first rank of dp × cp (the parameters other than experts)
/// or of its expert-data-parallel group (its experts). Their (pp, tp, ep) ranks name their files
/// apart: with etp = tp these are every tp × ep of a stage, with a smaller etp the tp ranks of
/// one ep rank differ.
fn writes(dims: &ParallelDims, rank: usize) -> bool {
    let at = dims.coordinates(rank);
    (at.dp == 0 && at.cp == 0) || dims.expert_coordinates(rank).ep_dp == 0
}

/// What a save writes beside the model and optimizer, what it removes, and where it writes.
#[derive(Clone, Debug)]
pub struct SaveOptions {
    /// Files written into the checkpoint by name (a run's job), read back with
    /// [`attachment`](super::attachment).
    pub attachments: Vec<(String, Vec<u8>)>,
    /// Once the save is complete, remove all but the newest `keep_last` checkpoints.
    pub keep_last: Option<usize>,
    /// Where the writes go: the file system ([`Disk`]) unless a test fails them on purpose.
    pub storage: Arc<dyn Storage>,
}

impl Default for SaveOptions {
    fn default() -> Self {
        Self {
            attachments: Vec::new(),
            keep_last: None,
            storage: Arc::new(Disk),
        }
    }
}

impl SaveOptions {
    /// The same options writing through `storage`.
    pub fn with_storage(mut self, storage: Arc<dyn Storage>) -> Self {
        self.storage = storage;
        self
    }
}

/// Everything one rank writes for one save, on the host.
struct Snapshot {
    step: u64,
    optimizer_steps: u64,
    /// The save's staging directory name, the same on every rank.
    staging: String,
    tp_rank: usize,
    tp: usize,
    ep_rank: usize,
    ep: usize,
    pp_rank: usize,
    pp: usize,
    dp: usize,
    global_rank: usize,
    /// This rank's shard, when it writes one: the first rank of its expert-data-parallel group
    /// writes its experts, and the first of dp × cp the other parameters ([`writes`]).
    pieces: Option<BTreeMap<String, Piece>>,
    dims: ParallelDims,
    /// Every tensor's global shape on this rank's stage (rank 0 gathers every stage's from the
    /// writers' markers and writes them into the index).
    tensors: BTreeMap<String, Vec<usize>>,
    /// Written and applied by global rank 0.
    options: SaveOptions,
}

impl Snapshot {
    /// Runs the collectives a save needs (the optimizer state gathered over dp, the staging
    /// name agreed) and copies this rank's part to the host. Every rank calls it.
    fn take<M: Module>(
        step: u64,
        model: &M,
        optim: &DistributedAdamW,
        groups: &ProcessGroups,
        options: &SaveOptions,
    ) -> Result<Self, CheckpointError> {
        let infos = param_infos(model);
        let values = local_values(model);
        let numels: Vec<usize> = values.iter().map(|(s, _)| s.iter().product()).collect();
        let states = optim.export_state(&numels)?;
        // Rank 0's clock names the staging directory; the max over the world is rank 0's own
        // value on every rank (the others send 0). 31 bits of microseconds: an Int tensor may
        // be i32, and two saves of one step 36 minutes apart with the same name only share a
        // staging directory that the first one already renamed away.
        let nonce = match groups.global_rank {
            0 => std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| (d.as_micros() & 0x7fff_ffff) as i64 | 1)
                .unwrap_or(1),
            _ => 0,
        };
        let nonce = Tensor::<1, Int>::from_data([nonce], &optimizer_device(model));
        let nonce: i64 = groups.world.all_reduce(nonce, ReduceOp::Max)?.into_scalar();
        let mut tensors = BTreeMap::new();
        let mut pieces = BTreeMap::new();
        let writes_dense = groups.grad_sync().group_rank() == 0;
        let writes_experts = groups.ep_dp.group_rank() == 0;
        // A parameter several stages hold (tied embeddings) is written by the first of them.
        let copies = StageCopies::find(&infos, &groups.pp, &optimizer_device(model))?;
        for (i, (info, (shape, data))) in infos.iter().zip(values).enumerate() {
            let placement = placement(info, &shape, groups);
            tensors.insert(info.path.clone(), placement.global_shape.clone());
            let writes = if info.expert { writes_experts } else { writes_dense } && copies.counted_here(i);
            for (part, state) in OPTIMIZER.iter().zip(states.get(i).map(state_parts).unwrap_or_default()) {
                let name = optimizer_name(part, &info.path);
                tensors.insert(name.clone(), placement.global_shape.clone());
                if !writes {
                    continue;
                }
                pieces.insert(
                    name,
                    Piece {
                        shape: shape.clone(),
                        values: state,
                        placement: placement.clone(),
                    },
                );
            }
            if writes {
                pieces.insert(
                    info.path.clone(),
                    Piece {
                        shape,
                        values: data,
                        placement,
                    },
                );
            }
        }
        Ok(Self {
            step,
            optimizer_steps: optim.steps(),
            staging: format!(".step-{step:08}-{nonce:x}.partial"),
            tp_rank: groups.tp.group_rank(),
            tp: groups.tp.size(),
            ep_rank: groups.ep.group_rank(),
            ep: groups.ep.size(),
            pp_rank: groups.pp.group_rank(),
            pp: groups.pp.size(),
            dp: groups.grad_sync().size(),
            global_rank: groups.global_rank,
            pieces: (writes_dense || writes_experts).then_some(pieces),
            dims: groups.dims,
            tensors,
            options: match groups.global_rank {
                0 => options.clone(),
                _ => SaveOptions {
                    storage: options.storage.clone(),
                    ..SaveOptions::default()
                },
            },
        })
    }

    /// Writes this rank's shard (a marker saying it failed, where it did); on global rank 0,
    /// waits for every shard and completes the checkpoint (index, rename, `latest`, retention),
    /// or abandons it where a shard failed.
    fn write(self, dir: &Path) -> Result<(), CheckpointError> {
        let staging = dir.join(&self.staging);
        if let Some(pieces) = &self.pieces {
            let file = shard_file(
                (self.pp_rank, self.pp),
                (self.tp_rank, self.tp),
                (self.ep_rank, self.ep),
            );
            if let Err(error) = self.write_shard(&staging, &file, pieces) {
                // Rank 0 waits for this shard: tell it, in a staging directory made again if
                // making it was what failed (if even this fails, rank 0 waits out its timeout).
                let storage = &*self.options.storage;
                let _ = storage.create_dir(&staging).and_then(|_| {
                    write_synced(
                        storage,
                        &staging.join(failed_marker(&file)),
                        error.to_string().as_bytes(),
                    )
                });
                return Err(error);
            }
        }
        match self.global_rank {
            0 => self.complete(dir, &staging),
            _ => Ok(()),
        }
    }

    /// This rank's shard `file` into `staging`, then its marker: the shard's checksum and the
    /// stage's tensors' global shapes, for rank 0.
    fn write_shard(&self, staging: &Path, file: &str, pieces: &BTreeMap<String, Piece>) -> Result<(), CheckpointError> {
        let storage = &*self.options.storage;
        storage.create_dir(staging).map_err(|e| io(staging, e))?;
        let path = staging.join(file);
        let bytes = shard_bytes(&path, pieces)?;
        write_synced(storage, &path, &bytes).map_err(|e| io(&path, e))?;
        let marker = Marker {
            checksum: checksum(&bytes),
            tensors: self.tensors.clone(),
        };
        let marker_path = staging.join(done_marker(file));
        let json = serde_json::to_vec(&marker).expect("a marker serializes");
        write_synced(storage, &marker_path, &json).map_err(|e| io(&marker_path, e))
    }

    /// Rank 0's part: every shard's marker read, the attachments and index written, the
    /// staging directory renamed into place, `latest` moved to it, older checkpoints removed.
    fn complete(&self, dir: &Path, staging: &Path) -> Result<(), CheckpointError> {
        let storage = &*self.options.storage;
        let (pp, tp, ep, dims) = (self.pp, self.tp, self.ep, self.dims);
        let files: Vec<String> = (0..dims.world_size())
            .filter(|&rank| writes(&dims, rank))
            .map(|rank| {
                let at = dims.coordinates(rank);
                shard_file((at.pp, pp), (at.tp, tp), (dims.expert_coordinates(rank).ep, ep))
            })
            .collect();
        wait_for_markers(staging, &files)?;
        let mut tensors = BTreeMap::new();
        let mut checksums = BTreeMap::new();
        for file in &files {
            let marker_path = staging.join(done_marker(file));
            let bytes = std::fs::read(&marker_path).map_err(|e| io(&marker_path, e))?;
            let marker: Marker = serde_json::from_slice(&bytes).map_err(|e| CheckpointError::Format {
                path: marker_path.clone(),
                detail: e.to_string(),
            })?;
            tensors.extend(marker.tensors);
            checksums.insert(file.clone(), marker.checksum);
            storage.remove_file(&marker_path).map_err(|e| io(&marker_path, e))?;
        }
        for (name, bytes) in &self.options.attachments {
            let path = staging.join(name);
            write_synced(storage, &path, bytes).map_err(|e| io(&path, e))?;
            checksums.insert(name.clone(), checksum(bytes));
        }
        let index = Index {
            format: FORMAT.into(),
            step: self.step,
            optimizer_steps: self.optimizer_steps,
            tp: self.tp,
            dp: self.dp,
            ep: self.ep,
            pp: self.pp,
            files,
            tensors,
            checksums,
        };
        let json = serde_json::to_vec_pretty(&index).expect("index serializes");
        let index_path = staging.join("index.json");
        write_synced(storage, &index_path, &json).map_err(|e| io(&index_path, e))?;
        let name = self
            .staging
            .trim_start_matches('.')
            .trim_end_matches(".partial")
            .to_string();
        let target = dir.join(&name);
        storage.rename(staging, &target).map_err(|e| io(&target, e))?;
        let latest = dir.join("latest");
        if let Err(e) = write_synced(storage, &latest, name.as_bytes()) {
            // `latest` still names the previous checkpoint: this one goes, so nothing
            // complete is left that nothing names.
            let _ = storage.remove_dir(&target);
            return Err(io(&latest, e));
        }
        // Earlier saves of the same step are superseded now that `latest` names this one.
        let prefix = format!("step-{:08}-", self.step);
        let mut kept = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(|e| io(dir, e))?.flatten() {
            let other = entry.file_name().to_string_lossy().into_owned();
            if other != name && other.starts_with(&prefix) {
                let _ = storage.remove_dir(&entry.path());
            } else if other.starts_with("step-") {
                kept.push(other);
            }
        }
        // The names sort by step (eight digits), then by the save's clock.
        kept.sort();
        if let Some(keep) = self.options.keep_last {
            for old in kept.iter().rev().skip(keep).filter(|old| **old != name) {
                let path = dir.join(old);
                storage.remove_dir(&path).map_err(|e| io(&path, e))?;
            }
        }
        Ok(())
    }
}

/// What a writer tells rank 0 beside its shard.
#[derive(serde::Serialize, serde::Deserialize)]
struct Marker {
    checksum: String,
    tensors: BTreeMap<String, Vec<usize>>,
}

fn io(path: &Path, e: std::io::Error) -> CheckpointError {
    CheckpointError::Io {
        path: path.to_path_buf(),
        detail: e.to_string(),
    }
}

fn done_marker(file: &str) -> String {
    format!("{file}.done")
}

fn failed_marker(file: &str) -> String {
    format!("{file}.failed")
}

/// Waits until every one of `files` has its marker, or one has failed (its marker's text in
/// the error).
fn wait_for_markers(staging: &Path, files: &[String]) -> Result<(), CheckpointError> {
    let start = Instant::now();
    loop {
        if let Some(file) = files.iter().find(|f| staging.join(failed_marker(f)).exists()) {
            let why = std::fs::read_to_string(staging.join(failed_marker(file))).unwrap_or_default();
            return Err(CheckpointError::Io {
                path: staging.join(file),
                detail: format!("its writer failed: {why}"),
            });
        }
        let missing: Vec<&String> = files
            .iter()
            .filter(|f| !staging.join(done_marker(f)).exists())
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        if start.elapsed() > WRITERS_TIMEOUT {
            return Err(CheckpointError::Io {
                path: staging.to_path_buf(),
                detail: format!("the shards {missing:?} were not written within {WRITERS_TIMEOUT:?}"),
            });
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A save's writing, done or in flight: where, and how its ranks agree on it.
struct Settle {
    dir: PathBuf,
    staging: PathBuf,
    storage: Arc<dyn Storage>,
    /// The model's device, where the ranks' flags meet.
    device: Device,
}

impl Settle {
    fn of(snapshot: &Snapshot, dir: &Path, device: Device) -> Self {
        Self {
            dir: dir.to_path_buf(),
            staging: dir.join(&snapshot.staging),
            storage: snapshot.options.storage.clone(),
            device,
        }
    }

    /// `result`, this rank's part of the save (every writer's done), agreed over every rank:
    /// an error everywhere where any rank's part failed (this rank's own, or one saying another
    /// rank's failed), and then rank 0 removes what the save left. A collective.
    fn agree(&self, result: Result<(), CheckpointError>, groups: &ProcessGroups) -> Result<(), CheckpointError> {
        let failed = Tensor::<1, Int>::from_data([result.is_err() as i64], &self.device);
        let failed: i64 = groups.world.all_reduce(failed, ReduceOp::Max)?.into_scalar();
        if failed != 0 && groups.global_rank == 0 {
            // Nothing names the staging directory: best effort, as the disk may be what failed.
            let _ = self.storage.remove_dir(&self.staging);
        }
        match (result, failed) {
            (Err(error), _) => Err(error),
            (Ok(()), 0) => Ok(()),
            (Ok(()), _) => Err(CheckpointError::Io {
                path: self.dir.clone(),
                detail: "another rank's part of the save failed (its error names it); the previous checkpoint stays the latest".into(),
            }),
        }
    }
}

/// Saves `model` and `optim` as checkpoint `step` under `dir` and returns once it is complete.
/// Every rank calls it.
pub fn save<M: Module>(
    dir: &Path,
    step: u64,
    model: &M,
    optim: &DistributedAdamW,
    groups: &ProcessGroups,
) -> Result<(), CheckpointError> {
    save_with(dir, step, model, optim, groups, &SaveOptions::default())
}

/// [`save`] with `options`' attachments and retention.
pub fn save_with<M: Module>(
    dir: &Path,
    step: u64,
    model: &M,
    optim: &DistributedAdamW,
    groups: &ProcessGroups,
    options: &SaveOptions,
) -> Result<(), CheckpointError> {
    let snapshot = Snapshot::take(step, model, optim, groups, options)?;
    let settle = Settle::of(&snapshot, dir, optimizer_device(model));
    settle.agree(snapshot.write(dir), groups)
}

/// Saves without stalling training: [`save`](Self::save) takes the snapshot (its collectives
/// and host copies) and returns; a thread writes the files. A save waits for the one before it,
/// and [`wait`](Self::wait) for the last; either reports a failed write.
#[derive(Default)]
pub struct AsyncSaver {
    writing: Option<Writing>,
}

/// A save in flight: how its ranks settle it, the thread writing it.
struct Writing {
    settle: Settle,
    handle: JoinHandle<Result<(), CheckpointError>>,
}

impl AsyncSaver {
    pub fn new() -> Self {
        Self::default()
    }

    /// Every rank calls it, at the same step.
    pub fn save<M: Module>(
        &mut self,
        dir: &Path,
        step: u64,
        model: &M,
        optim: &DistributedAdamW,
        groups: &ProcessGroups,
    ) -> Result<(), CheckpointError> {
        self.save_with(dir, step, model, optim, groups, &SaveOptions::default())
    }

    /// [`save`](Self::save) with `options`' attachments and retention.
    pub fn save_with<M: Module>(
        &mut self,
        dir: &Path,
        step: u64,
        model: &M,
        optim: &DistributedAdamW,
        groups: &ProcessGroups,
        options: &SaveOptions,
    ) -> Result<(), CheckpointError> {
        // The save before this one, agreed: a rank must not go on to this one's collectives
        // alone.
        self.finish(groups)?;
        let snapshot = Snapshot::take(step, model, optim, groups, options)?;
        let target = dir.to_path_buf();
        self.writing = Some(Writing {
            settle: Settle::of(&snapshot, dir, optimizer_device(model)),
            handle: std::thread::spawn(move || snapshot.write(&target)),
        });
        Ok(())
    }

    /// Waits for the save in flight on every rank: afterwards `latest` names it everywhere.
    /// A failed save is an error on every rank. Every rank calls it.
    pub fn finish(&mut self, groups: &ProcessGroups) -> Result<(), CheckpointError> {
        // Saves are collective: every rank has one in flight, or none.
        let Some(writing) = self.writing.take() else {
            return Ok(());
        };
        let result = writing
            .handle
            .join()
            .unwrap_or_else(|_| Err(panicked(&writing.settle.dir)));
        writing.settle.agree(result, groups)
    }

    /// Waits for this rank's part of the save in flight, if any (rank 0's part completes the
    /// checkpoint; use [`finish`](Self::finish) to know it is complete everywhere).
    pub fn wait(&mut self) -> Result<(), CheckpointError> {
        match self.writing.take() {
            Some(writing) => writing
                .handle
                .join()
                .unwrap_or_else(|_| Err(panicked(&writing.settle.dir))),
            None => Ok(()),
        }
    }
}

fn panicked(dir: &Path) -> CheckpointError {
    CheckpointError::Io {
        path: dir.to_path_buf(),
        detail: "the checkpoint writer panicked".into(),
    }
}
