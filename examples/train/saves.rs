//! `--save DIR [--save-every K] [--async-save]`: a run's checkpoints, written where the step
//! stands or, with `--async-save`, on a thread of their own while training goes on.

use std::path::PathBuf;

use burn::module::Module;
use burn_megatron::checkpoint::{self, AsyncSaver};
use burn_megatron::optim::DistributedAdamW;
use burn_megatron_dist::ProcessGroups;

use crate::args::Args;

/// Where a run saves, and how.
pub struct Saves {
    dir: Option<PathBuf>,
    background: bool,
    saver: AsyncSaver,
}

impl Saves {
    pub fn new(args: &Args) -> Self {
        Self {
            dir: args.save.clone(),
            background: args.async_save,
            saver: AsyncSaver::new(),
        }
    }

    /// Saves `model` (a Llama, or a pipeline stage) and `optim` at `step`; every rank calls it
    /// at the same step. Nothing without `--save`.
    pub fn save<M: Module>(
        &mut self,
        model: &M,
        optim: &DistributedAdamW,
        step: usize,
        groups: &ProcessGroups,
    ) -> Result<(), String> {
        let Some(dir) = &self.dir else { return Ok(()) };
        match self.background {
            true => self.saver.save(dir, step as u64, model, optim, groups),
            false => checkpoint::save(dir, step as u64, model, optim, groups),
        }
        .map_err(|e| e.to_string())
    }

    /// Waits for a save in flight on every rank.
    pub fn finish(&mut self, groups: &ProcessGroups) -> Result<(), String> {
        self.saver.finish(groups).map_err(|e| e.to_string())
    }
}
