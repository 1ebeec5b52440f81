//! [`Routine`]: what a run does after each step, whichever loop drives it (a plain loop, or
//! Burn's Learner through `MegatronStrategy`): read the step, report it and write its metrics
//! line, evaluate on the held-out batches and save on their intervals (and at the end), run the
//! caller's own hook (a greedy sample). One rank reports: the last pipeline stage's first
//! tensor-, context- and data-parallel rank.

use std::path::PathBuf;
use std::time::Instant;

use burn::tensor::{Device, Tensor};
use burn_megatron_dist::{ProcessGroups, ReduceOp};
use burn_megatron_kernels::memory::device_memory;

use super::batch::TokenBatch;
use super::metrics::{MetricsLog, StepRate};
use super::report::StepValues;
use super::step::{Stepped, TrainError, TrainModel, Trainer};
use crate::checkpoint::{CheckpointError, Saver};

/// Where a run's lines go.
pub trait Reporter: Send {
    /// A step, read, and its speed.
    fn step(&mut self, values: &StepValues, rate: &StepRate);
    /// An evaluation's mean held-out loss after `step`.
    fn eval(&mut self, step: u64, loss: f64);
    /// Any other line (a sample, the summary).
    fn note(&mut self, text: &str);
}

/// A line a step on standard output: `step N loss X … lr Y grad_norm G T tokens/s`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Lines;

impl Reporter for Lines {
    fn step(&mut self, values: &StepValues, rate: &StepRate) {
        let norm = values.grad_norm.map_or(String::new(), |g| format!(" grad_norm {g:.3}"));
        println!("{values} lr {:.3e}{norm} {:.0} tokens/s", values.lr, rate.tokens_per_s);
    }

    fn eval(&mut self, step: u64, loss: f64) {
        println!("eval step {step} loss {loss:.6}");
    }

    fn note(&mut self, text: &str) {
        println!("{text}");
    }
}

/// Reports nothing: the ranks other than the reporting one.
struct Quiet;

impl Reporter for Quiet {
    fn step(&mut self, _: &StepValues, _: &StepRate) {}
    fn eval(&mut self, _: u64, _: f64) {}
    fn note(&mut self, _: &str) {}
}

/// Whether this rank reports: the last pipeline stage's first tp, cp and dp rank.
pub fn reports(groups: &ProcessGroups) -> bool {
    groups.pp.group_rank() + 1 == groups.pp.size()
        && groups.tp.group_rank() == 0
        && groups.cp.group_rank() == 0
        && groups.dp.group_rank() == 0
}

/// Why a run stopped around its steps.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Train(#[from] TrainError),
    #[error("checkpoint: {0}")]
    Checkpoint(#[from] CheckpointError),
    #[error("{path}: {detail}", path = path.display())]
    Metrics { path: PathBuf, detail: String },
    /// The caller's hook failed.
    #[error("step {step}: {detail}")]
    Hook { step: u64, detail: String },
}

/// The caller's own work after a step, on the model (every rank calls it): a line to report,
/// if any.
pub type Hook<M> = Box<dyn FnMut(&M, u64) -> Result<Option<String>, String> + Send>;

/// A run's speed and size, for the rates it reports.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Throughput {
    /// Tokens a step over every rank.
    pub tokens_per_step: usize,
    /// A step's FLOPs a token (`LlamaConfig::flops_per_token`).
    pub flops_per_token: f64,
    /// Devices the run uses.
    pub devices: usize,
    /// A device's dense peak FLOP/s, where known (MFU).
    pub peak_flops: Option<f64>,
}

/// What the run did, once its steps are done.
#[derive(Clone, Debug, PartialEq)]
pub struct Summary {
    /// Steps this run took (a resumed run's own).
    pub steps: usize,
    pub seconds: f64,
    pub tokens_per_s: f64,
    /// The pipeline stages' mean share of a step outside their forwards and backwards, when
    /// they were timed (the first step, warming up, left out).
    pub bubble: Option<f64>,
}

/// See the module docs.
pub struct Routine<M> {
    groups: ProcessGroups,
    device: Device,
    reporter: Box<dyn Reporter>,
    metrics: Option<(MetricsLog, PathBuf)>,
    saver: Option<Saver>,
    eval: Option<(usize, Vec<TokenBatch>)>,
    hook: Option<Hook<M>>,
    last_step: usize,
    throughput: Throughput,
    started: Instant,
    clock: Instant,
    /// Seconds the hooks and evaluations took (left out of the summary's rate).
    aside: f64,
    ran: usize,
    idle: Vec<f64>,
}

impl<M: TrainModel> Routine<M> {
    /// The routine of a run ending at step `last_step` on this rank (`groups`, `device`):
    /// `reporter` on the reporting rank ([`reports`]), nothing elsewhere.
    pub fn new(
        groups: &ProcessGroups,
        device: &Device,
        reporter: Box<dyn Reporter>,
        last_step: usize,
        throughput: Throughput,
    ) -> Self {
        let reporter = match reports(groups) {
            true => reporter,
            false => Box::new(Quiet),
        };
        Self {
            groups: groups.clone(),
            device: device.clone(),
            reporter,
            metrics: None,
            saver: None,
            eval: None,
            hook: None,
            last_step,
            throughput,
            started: Instant::now(),
            clock: Instant::now(),
            aside: 0.0,
            ran: 0,
            idle: Vec::new(),
        }
    }

    /// Writes the metrics file at `path` (the reporting rank), appending to one there.
    pub fn with_metrics(mut self, path: Option<PathBuf>) -> Result<Self, RunError> {
        if let Some(path) = path.filter(|_| reports(&self.groups)) {
            let log = MetricsLog::open(&path).map_err(|e| RunError::Metrics {
                path: path.clone(),
                detail: e.to_string(),
            })?;
            self.metrics = Some((log, path));
        }
        Ok(self)
    }

    pub fn with_saver(mut self, saver: Option<Saver>) -> Self {
        self.saver = saver;
        self
    }

    /// Evaluates on `batches` (this rank's held-out sequences) every `interval` steps and at the
    /// end (never at 0).
    pub fn with_eval(mut self, interval: usize, batches: Vec<TokenBatch>) -> Self {
        self.eval = (interval > 0 && !batches.is_empty()).then_some((interval, batches));
        self
    }

    pub fn with_hook(mut self, hook: Hook<M>) -> Self {
        self.hook = Some(hook);
        self
    }

    /// Restarts the clocks: the first step's rate counts from here.
    pub fn start(&mut self) {
        self.started = Instant::now();
        self.clock = Instant::now();
    }

    /// Everything after `stepped`, the step `trainer` just took: see the module docs. Every
    /// rank calls it.
    pub fn after_step(&mut self, trainer: &mut Trainer<M>, stepped: Stepped) -> Result<StepValues, RunError> {
        let values = trainer.read(stepped)?;
        let seconds = self.clock.elapsed().as_secs_f64();
        let t = self.throughput;
        let tokens_per_s = t.tokens_per_step as f64 / seconds.max(1e-9);
        let rate = StepRate {
            tokens_per_s,
            mfu: t
                .peak_flops
                .map(|peak| tokens_per_s * t.flops_per_token / t.devices as f64 / peak),
            memory_bytes: device_memory(&self.device).map(|m| m.in_use),
        };
        self.ran += 1;
        if self.ran > 1 || self.last_step == values.step as usize {
            self.idle.extend(values.timing.and_then(|t| t.idle()));
        }
        self.reporter.step(&values, &rate);
        if let Some((log, path)) = &mut self.metrics {
            log.step(&values, rate).map_err(|e| RunError::Metrics {
                path: path.clone(),
                detail: e.to_string(),
            })?;
        }
        let begun = std::time::Instant::now();
        let step = values.step as usize;
        let last = step >= self.last_step;
        if let Some((interval, batches)) = &self.eval
            && (step.is_multiple_of(*interval) || last)
        {
            let loss = trainer.evaluate(batches.iter().cloned())?;
            self.reporter.eval(values.step, loss);
            if let Some((log, path)) = &mut self.metrics {
                log.eval(values.step, loss).map_err(|e| RunError::Metrics {
                    path: path.clone(),
                    detail: e.to_string(),
                })?;
            }
        }
        if let Some(hook) = &mut self.hook {
            let line = hook(trainer.model(), values.step).map_err(|detail| RunError::Hook {
                step: values.step,
                detail,
            })?;
            if let Some(line) = line {
                self.reporter.note(&line);
            }
        }
        self.aside += begun.elapsed().as_secs_f64();
        if let Some(saver) = &mut self.saver {
            saver.step(step, last, trainer.model(), trainer.optimizer(), &self.groups)?;
        }
        self.clock = Instant::now();
        Ok(values)
    }

    /// Waits for a save in flight and returns the run's summary, reported. Every rank calls it.
    pub fn finish(&mut self) -> Result<Summary, RunError> {
        if let Some(saver) = &mut self.saver {
            saver.finish(&self.groups)?;
        }
        let seconds = self.started.elapsed().as_secs_f64() - self.aside;
        let bubble = match self.groups.pp.size() {
            1 => None,
            _ => {
                let mean = self.idle.iter().sum::<f64>() / self.idle.len().max(1) as f64;
                let mean = Tensor::<1>::from_floats([mean as f32], &self.device);
                let mean = self
                    .groups
                    .pp
                    .all_reduce(mean, ReduceOp::Avg)
                    .map_err(|e| RunError::Train(TrainError::at(self.last_step as u64, e)))?;
                (!self.idle.is_empty()).then(|| mean.into_scalar::<f64>())
            }
        };
        let summary = Summary {
            steps: self.ran,
            seconds,
            tokens_per_s: (self.ran * self.throughput.tokens_per_step) as f64 / seconds.max(1e-9),
            bubble,
        };
        if self.ran > 0 {
            self.reporter.note(&format!(
                "{} steps in {:.1} s: {:.0} tokens/s",
                summary.steps, summary.seconds, summary.tokens_per_s
            ));
        }
        Ok(summary)
    }

    /// Reports `text` (on the reporting rank).
    pub fn note(&mut self, text: &str) {
        self.reporter.note(text);
    }
}
