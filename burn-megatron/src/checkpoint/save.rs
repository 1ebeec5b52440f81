//! Saving: a [`Snapshot`] taken on the training thread (the collectives and the copies to the
//! host), then written by the writers and completed by global rank 0, which waits on
//! the files themselves rather than on a collective — so the writing can run on a thread of its
//! own ([`AsyncSaver`]) while training goes on over the same groups.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use burn::module::Module;
use burn::tensor::{Int, Tensor};
use burn_megatron_dist::{ParallelDims, ProcessGroups, ReduceOp};

use super::files::{FORMAT, Index, Piece, shard_file, sync_dir, write_shard, write_synced};
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

/// What a save writes beside the model and optimizer, and what it removes.
#[derive(Clone, Debug, Default)]
pub struct SaveOptions {
    /// Files written into the checkpoint by name (a run's job), read back with
    /// [`attachment`](super::attachment).
    pub attachments: Vec<(String, Vec<u8>)>,
    /// Once the save is complete, remove all but the newest `keep_last` checkpoints.
    pub keep_last: Option<usize>,
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
                _ => SaveOptions::default(),
            },
        })
    }

    /// Writes this rank's shard; on global rank 0, waits for every shard and completes the
    /// checkpoint (index, rename, `latest`).
    fn write(self, dir: &Path) -> Result<(), CheckpointError> {
        let io = |path: &Path, e: std::io::Error| CheckpointError::Io {
            path: path.to_path_buf(),
            detail: e.to_string(),
        };
        let staging = dir.join(&self.staging);
        if let Some(pieces) = &self.pieces {
            std::fs::create_dir_all(&staging).map_err(|e| io(&staging, e))?;
            let file = shard_file(
                (self.pp_rank, self.pp),
                (self.tp_rank, self.tp),
                (self.ep_rank, self.ep),
            );
            write_shard(&staging.join(&file), pieces)?;
            // The marker carries the stage's tensors' global shapes to rank 0.
            let shapes = serde_json::to_vec(&self.tensors).expect("shapes serialize");
            write_synced(&staging.join(done_marker(&file)), &shapes)?;
        }
        if self.global_rank != 0 {
            return Ok(());
        }
        let (pp, tp, ep, dims) = (self.pp, self.tp, self.ep, self.dims);
        let files: Vec<String> = (0..dims.world_size())
            .filter(|&rank| writes(&dims, rank))
            .map(|rank| {
                let at = dims.coordinates(rank);
                shard_file((at.pp, pp), (at.tp, tp), (dims.expert_coordinates(rank).ep, ep))
            })
            .collect();
        wait_for_markers(&staging, &files)?;
        let mut tensors = BTreeMap::new();
        for file in &files {
            let marker = staging.join(done_marker(file));
            let shapes = std::fs::read(&marker).map_err(|e| io(&marker, e))?;
            let shapes: BTreeMap<String, Vec<usize>> =
                serde_json::from_slice(&shapes).map_err(|e| CheckpointError::Format {
                    path: marker.clone(),
                    detail: e.to_string(),
                })?;
            tensors.extend(shapes);
            std::fs::remove_file(&marker).map_err(|e| io(&marker, e))?;
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
        };
        for (name, bytes) in &self.options.attachments {
            write_synced(&staging.join(name), bytes)?;
        }
        let json = serde_json::to_vec_pretty(&index).expect("index serializes");
        write_synced(&staging.join("index.json"), &json)?;
        let name = self
            .staging
            .trim_start_matches('.')
            .trim_end_matches(".partial")
            .to_string();
        let target = dir.join(&name);
        std::fs::rename(&staging, &target).map_err(|e| io(&target, e))?;
        sync_dir(dir)?;
        write_synced(&dir.join("latest"), name.as_bytes())?;
        // Earlier saves of the same step are superseded now that `latest` names this one.
        let prefix = format!("step-{:08}-", self.step);
        let mut kept = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(|e| io(dir, e))?.flatten() {
            let other = entry.file_name().to_string_lossy().into_owned();
            if other != name && other.starts_with(&prefix) {
                let _ = std::fs::remove_dir_all(entry.path());
            } else if other.starts_with("step-") {
                kept.push(other);
            }
        }
        // The names sort by step (eight digits), then by the save's clock.
        kept.sort();
        if let Some(keep) = self.options.keep_last {
            for old in kept.iter().rev().skip(keep).filter(|old| **old != name) {
                let path = dir.join(old);
                std::fs::remove_dir_all(&path).map_err(|e| io(&path, e))?;
            }
        }
        Ok(())
    }
}

fn done_marker(file: &str) -> String {
    format!("{file}.done")
}

fn wait_for_markers(staging: &Path, files: &[String]) -> Result<(), CheckpointError> {
    let start = Instant::now();
    loop {
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
    Snapshot::take(step, model, optim, groups, options)?.write(dir)?;
    groups.world.barrier()?;
    Ok(())
}

/// Saves without stalling training: [`save`](Self::save) takes the snapshot (its collectives
/// and host copies) and returns; a thread writes the files. A save waits for the one before it,
/// and [`wait`](Self::wait) for the last; either reports a failed write.
#[derive(Default)]
pub struct AsyncSaver {
    writing: Option<(PathBuf, JoinHandle<Result<(), CheckpointError>>)>,
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
        self.wait()?;
        let snapshot = Snapshot::take(step, model, optim, groups, options)?;
        let target = dir.to_path_buf();
        let handle = std::thread::spawn(move || snapshot.write(&target));
        self.writing = Some((dir.to_path_buf(), handle));
        Ok(())
    }

    /// Waits for the save in flight on every rank: afterwards `latest` names it everywhere.
    pub fn finish(&mut self, groups: &ProcessGroups) -> Result<(), CheckpointError> {
        self.wait()?;
        groups.world.barrier()?;
        Ok(())
    }

    /// Waits for this rank's part of the save in flight, if any (rank 0's part completes the
    /// checkpoint; use [`finish`](Self::finish) to know it is complete everywhere).
    pub fn wait(&mut self) -> Result<(), CheckpointError> {
        match self.writing.take() {
            Some((dir, handle)) => handle.join().unwrap_or_else(|_| {
                Err(CheckpointError::Io {
                    path: dir,
                    detail: "the checkpoint writer panicked".into(),
                })
            }),
            None => Ok(()),
        }
    }
}
