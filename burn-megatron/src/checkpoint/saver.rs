//! [`Saver`]: a run's checkpoints, every `interval` steps and at its end, written where the
//! step stands or on a thread of their own, with the run's attachments and retention.

use std::path::PathBuf;

use burn::module::Module;
use burn_megatron_dist::ProcessGroups;

use super::{AsyncSaver, CheckpointError, SaveOptions, save_with};
use crate::optim::DistributedAdamW;

/// Where a run saves, how often, and how.
pub struct Saver {
    dir: PathBuf,
    interval: Option<usize>,
    background: bool,
    options: SaveOptions,
    saver: AsyncSaver,
}

impl Saver {
    /// Saves under `dir` at the end of the run only, in the foreground, keeping every checkpoint.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            interval: None,
            background: false,
            options: SaveOptions::default(),
            saver: AsyncSaver::new(),
        }
    }

    /// Also every `interval` steps.
    pub fn with_interval(mut self, interval: Option<usize>) -> Self {
        self.interval = interval;
        self
    }

    /// Keep the newest `keep` checkpoints only.
    pub fn with_keep_last(mut self, keep: Option<usize>) -> Self {
        self.options.keep_last = keep;
        self
    }

    /// Write on a thread of its own while training goes on.
    pub fn in_background(mut self, background: bool) -> Self {
        self.background = background;
        self
    }

    /// Write `bytes` into every checkpoint as `name`.
    pub fn with_attachment(mut self, name: &str, bytes: Vec<u8>) -> Self {
        self.options.attachments.push((name.to_string(), bytes));
        self
    }

    /// Saves `model` and `optim` at `step` if it falls on the interval or is the run's `last`;
    /// returns whether it saved. Every rank calls it, at every step.
    pub fn step<M: Module>(
        &mut self,
        step: usize,
        last: bool,
        model: &M,
        optim: &DistributedAdamW,
        groups: &ProcessGroups,
    ) -> Result<bool, CheckpointError> {
        if !(last || self.interval.is_some_and(|k| step.is_multiple_of(k))) {
            return Ok(false);
        }
        let step = step as u64;
        match self.background {
            true => self
                .saver
                .save_with(&self.dir, step, model, optim, groups, &self.options)?,
            false => save_with(&self.dir, step, model, optim, groups, &self.options)?,
        }
        Ok(true)
    }

    /// Waits for a save in flight on every rank.
    pub fn finish(&mut self, groups: &ProcessGroups) -> Result<(), CheckpointError> {
        self.saver.finish(groups)
    }
}
