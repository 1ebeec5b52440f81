//! The training step, written once: forward and backward over the step's microbatches (the
//! gradients of all but the last held, the last's reduced over dp bucket by bucket while its
//! backward runs), a parameter several pipeline stages hold summed over them, the distributed
//! optimizer's update, and what the model moves outside the gradient after it (expert biases,
//! delayed FP8 histories). [`Trainer`] runs it for any [`TrainModel`] (a whole Llama, a
//! pipeline stage) at every layout; Burn's Learner (`MegatronStrategy`), the `train`, `bench`
//! and `distill` examples all step through it. [`Trainer::read`] reads a step the one way:
//! the loss averaged over the batch's ranks, stopped on a launch the device could not run or a
//! loss that is not finite; a step whose gradients were not all finite updated nothing, and
//! the run's [`Guard`] stops there or skips it.

use burn::module::Module;
use burn::tensor::{DType, Device, Tensor};
use burn_megatron_dist::ProcessGroups;
use burn_megatron_kernels::quant::notes::AmaxNotes;

use super::batch::TokenBatch;
use super::guard::{Guard, GuardConfig, NonFinite, Stopped};
use super::pipeline::{StageTiming, Timing};
use super::report::StepValues;
use crate::error::{ConfigError, LayerError};
use crate::layers::moe::Load;
use crate::models::llama::MoeReport;
use crate::optim::{DistributedAdamW, DistributedAdamWConfig, FiniteCheck, Overlap};
use crate::params::{param_values, take_grads};

/// A model [`Trainer`] trains: one microbatch's forward and backward, and what moves outside
/// the gradient after the optimizer's update.
pub trait TrainModel: Module + Sized {
    /// Forward and backward of `batch` (this rank's whole sequences), its loss counted
    /// `pass.weight` of the step's.
    fn forward_backward(&self, batch: TokenBatch, pass: Pass) -> Result<Backward, LayerError>;

    /// The loss of `batch` (this rank's whole sequences), forward only, `[1]` f32: on every
    /// rank of a pipeline. Called on the model as inference sees it ([`Module::valid`]).
    fn eval_loss(&self, batch: TokenBatch) -> Result<Tensor<1>, LayerError>;

    /// Whether one backward brings each parameter's gradient whole, so a reduction may start
    /// inside it (a pipeline stage's come from each of its microbatches' backwards).
    fn reduces_during_backward(&self) -> bool;

    /// The model after the update: `loads` are the step's loads of its MoE blocks, in block
    /// order. Every rank calls it at the same point (it may run collectives).
    fn after_step(self, loads: &[Load], groups: &ProcessGroups) -> Result<Self, LayerError>;

    /// Where the model's FP8 casts take the amaxes of its weights, for the optimizer to keep
    /// the new weights' in.
    fn amax_notes(&self) -> AmaxNotes;
}

/// How one microbatch's forward and backward run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Pass {
    /// The share of the step's loss this microbatch's is (1 / microbatches).
    pub weight: f64,
    /// Whether to return the gradients: false when the parameters' taps took them.
    pub collect: bool,
    /// Whether a pipeline stage times its forwards and backwards.
    pub timing: Timing,
}

/// What one forward and backward produced.
pub struct Backward {
    /// The microbatch's weighted loss, `[1]` f32, detached.
    pub loss: Tensor<1>,
    /// Named parts of the loss, weighted, `[1]` f32, detached: a mixture of experts' router
    /// losses (each summed over the MoE blocks), distillation's KL and data terms.
    pub parts: Vec<(String, Tensor<1>)>,
    /// The load of each of the model's MoE blocks, in block order.
    pub loads: Vec<Load>,
    /// Each parameter's gradient, flattened, in traversal order (`None` for one the loss did
    /// not reach), when [`Pass::collect`] asked.
    pub grads: Option<Vec<Option<Tensor<1>>>>,
    /// Where a pipeline stage's time went.
    pub timing: Option<StageTiming>,
}

impl Backward {
    /// Backward of `loss` on `model` (the loss already weighted), beside the loss's named parts
    /// (unweighted) and the MoE blocks' loads: a model whose loss comes out of one forward pass.
    pub fn of<M: Module>(
        model: &M,
        loss: Tensor<1>,
        parts: Vec<(String, Tensor<1>)>,
        loads: Vec<Load>,
        pass: Pass,
    ) -> Self {
        let value = loss.clone().detach().cast(DType::F32);
        let grads = loss.backward();
        let grads = pass
            .collect
            .then(|| take_grads(model, burn::optim::GradientsParams::from_grads(grads, model)));
        let weigh = |(name, part): (String, Tensor<1>)| (name, part.detach().cast(DType::F32).mul_scalar(pass.weight));
        Self {
            loss: value,
            parts: parts.into_iter().map(weigh).collect(),
            loads,
            grads,
            timing: None,
        }
    }
}

/// A mixture of experts' router losses, each summed over its MoE blocks, by name.
pub fn router_parts(report: &MoeReport) -> Vec<(String, Tensor<1>)> {
    let mut parts: Vec<(String, Tensor<1>)> = Vec::new();
    let mtp = report.mtp.clone().map(|loss| ("mtp_loss", loss));
    for (name, value) in report.losses.iter().flat_map(|l| l.named()).chain(mtp) {
        match parts.iter_mut().find(|(n, _)| n == name) {
            Some((_, sum)) => *sum = sum.clone() + value,
            None => parts.push((name.to_string(), value)),
        }
    }
    parts
}

/// A step that ran: its values still on the device until [`read`](Stepped::read).
pub struct Stepped {
    /// The steps taken, this one included.
    pub step: u64,
    pub lr: f64,
    /// This rank's loss of the step (the mean over its microbatches), `[1]` f32.
    pub loss: Tensor<1>,
    /// The loss's named parts ([`Backward::parts`]), the mean over the microbatches.
    pub parts: Vec<(String, Tensor<1>)>,
    /// Each MoE block's load, summed over the microbatches.
    pub loads: Vec<Load>,
    /// The global gradient norm before clipping, if the optimizer took one.
    pub norm: Option<Tensor<1>>,
    pub timing: Option<StageTiming>,
    /// Whether every gradient was finite, where the gradients were checked.
    pub check: Option<FiniteCheck>,
    /// Whether the trainer's optimizer took the update (else an optimizer of the caller's).
    own_update: bool,
}

/// Why a training step stopped.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum TrainError {
    #[error("step {step}: the loss is {value}; training stops")]
    NonFiniteLoss { step: u64, value: f64 },
    #[error("step {step}: {failure}; training stops")]
    Device {
        step: u64,
        failure: burn_megatron_kernels::failures::DeviceFailure,
    },
    #[error("step {step}: {stopped}; training stops (the step updated nothing)")]
    Gradient { step: u64, stopped: Stopped },
    #[error("step {step}: {error}")]
    Layer { step: u64, error: LayerError },
}

impl TrainError {
    /// `error`, met during step `step`.
    pub fn at(step: u64, error: impl Into<LayerError>) -> Self {
        Self::Layer {
            step,
            error: error.into(),
        }
    }
}

/// One rank's step's gradients, reduced, and what its forwards reported.
pub struct Gradients {
    /// Each parameter's gradient averaged over dp (this rank's shard under ZeRO-1), in
    /// traversal order; a parameter stages share summed over them.
    pub reduced: Vec<Tensor<1>>,
    pub forwarded: Forwarded,
}

/// What a step's forwards reported, summed over its microbatches.
pub struct Forwarded {
    pub loss: Tensor<1>,
    pub parts: Vec<(String, Tensor<1>)>,
    pub loads: Vec<Load>,
    pub timing: Option<StageTiming>,
}

/// A rank's model and optimizer between steps, and how it steps: see the module docs. A step
/// that fails leaves the trainer spent (its model went into the step): the run stops.
pub struct Trainer<M> {
    /// Taken by a step while it runs: the update then owns the weights alone, so it may write
    /// them in place.
    model: Option<M>,
    optim: DistributedAdamW,
    groups: ProcessGroups,
    /// The rank's device (without autodiff), where reductions land.
    device: Device,
    accumulation: usize,
    overlap: bool,
    timing: Timing,
    steps: u64,
    guard: Guard,
}

impl<M: TrainModel> Trainer<M> {
    /// A trainer of `model` with the distributed AdamW `optim` builds, keeping its new weights'
    /// amaxes in the model's notes; one microbatch a step, the reduction overlapped with
    /// backward. `device` is the rank's.
    pub fn new(model: M, optim: &DistributedAdamWConfig, groups: &ProcessGroups, device: &Device) -> Self {
        let optim = optim.init(groups).keeping_amaxes(model.amax_notes());
        Self {
            model: Some(model),
            optim,
            groups: groups.clone(),
            device: device.clone(),
            accumulation: 1,
            overlap: true,
            timing: Timing::Off,
            steps: 0,
            guard: Guard::new(GuardConfig::default()),
        }
    }

    /// Guards the steps as `guard` says (by default a step whose gradients are not all finite
    /// stops the run); `NonFinite::Off` takes the check out of the optimizer's step too.
    pub fn with_guard(mut self, guard: GuardConfig) -> Result<Self, ConfigError> {
        self.optim.set_check_finite(guard.nonfinite != NonFinite::Off);
        self.guard = Guard::new(guard.checked()?);
        Ok(self)
    }

    /// Each step's batch split into `microbatches`, their gradients accumulated (under pp,
    /// the schedule's microbatches come on top: give 1).
    pub fn with_accumulation(mut self, microbatches: usize) -> Result<Self, ConfigError> {
        if microbatches == 0 {
            return Err(ConfigError::Zero {
                what: "gradient accumulation's microbatches",
            });
        }
        self.accumulation = microbatches;
        Ok(self)
    }

    /// Reduce each bucket during the last microbatch's backward (the default), or all of them
    /// after it.
    pub fn with_overlap(mut self, overlap: bool) -> Self {
        self.overlap = overlap;
        self
    }

    /// Whether a pipeline stage times its forwards and backwards (the measured bubble).
    pub fn with_timing(mut self, timing: Timing) -> Self {
        self.timing = timing;
        self
    }

    pub fn model(&self) -> &M {
        self.model.as_ref().expect("a trainer whose step failed is spent")
    }

    pub fn optimizer(&self) -> &DistributedAdamW {
        &self.optim
    }

    /// Steps taken (a resumed run counts the checkpoint's).
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// The model and optimizer, the trainer done.
    pub fn into_parts(self) -> (M, DistributedAdamW) {
        (self.model.expect("a trainer whose step failed is spent"), self.optim)
    }

    /// Replaces the model and optimizer with what `load` makes of them (a checkpoint's), which
    /// also names the steps they had taken.
    pub fn restore<E>(&mut self, load: impl FnOnce(M, &mut DistributedAdamW) -> Result<(M, u64), E>) -> Result<u64, E> {
        let (model, steps) = load(self.model().clone(), &mut self.optim)?;
        self.model = Some(model);
        self.steps = steps;
        Ok(steps)
    }

    /// The mean loss over `batches` (this rank's held-out sequences), forward only, averaged
    /// over the ranks that split the batch. Every rank calls it with as many batches.
    pub fn evaluate(&self, batches: impl IntoIterator<Item = TokenBatch>) -> Result<f64, TrainError> {
        let at = |e: LayerError| TrainError::at(self.steps, e);
        let model = self.model().valid();
        let mut total: Option<Tensor<1>> = None;
        let mut count = 0;
        for batch in batches {
            let loss = model.eval_loss(batch).map_err(at)?;
            total = Some(match total {
                Some(sum) => sum + loss,
                None => loss,
            });
            count += 1;
        }
        let Some(total) = total else { return Ok(f64::NAN) };
        let mean = total.div_scalar(count as f64);
        let mean = self
            .groups
            .grad_sync()
            .all_reduce(mean, burn_megatron_dist::ReduceOp::Avg)
            .map_err(|e| at(e.into()))?;
        Ok(mean.into_scalar::<f64>())
    }

    /// One training step of `batch` (this rank's sequences) at learning rate `lr`: its
    /// [`gradients`](Self::gradients), then their [`update`](Self::update).
    pub fn step(&mut self, lr: f64, batch: TokenBatch) -> Result<Stepped, TrainError> {
        let gradients = self.gradients(batch)?;
        self.update(lr, gradients)
    }

    /// The update of the model by the trainer's optimizer from a step's `gradients` (checked
    /// first, where the guard checks: then a gradient not finite on any rank updates nothing),
    /// and the step's end.
    pub fn update(&mut self, lr: f64, gradients: Gradients) -> Result<Stepped, TrainError> {
        let step = self.steps + 1;
        let model = self.model.take().expect("a trainer whose step failed is spent");
        let (model, report) = self
            .optim
            .step_reduced(lr, model, gradients.reduced)
            .map_err(|e| TrainError::at(step, e))?;
        let mut stepped = self.finish(model, lr, gradients.forwarded, report.norm, report.check)?;
        stepped.own_update = true;
        Ok(stepped)
    }

    /// Whether every one of `gradients` is finite on every rank, for an update by an optimizer
    /// of the caller's (Burn's Learner's), which should leave the model alone where not; none
    /// where the guard does not check. Reads the check (waiting for the gradients); a
    /// collective over every rank.
    pub fn check(&mut self, gradients: &Gradients) -> Result<Option<FiniteCheck>, TrainError> {
        if self.guard.config().nonfinite == NonFinite::Off {
            return Ok(None);
        }
        let model = self.model.as_ref().expect("a trainer whose step failed is spent");
        self.optim
            .check_finite(model, &gradients.reduced)
            .map_err(|e| TrainError::at(self.steps + 1, e))
    }

    /// The step's values, read: the loss averaged over the ranks that split the batch, the MoE
    /// summary over them, the gradient norm. Stops on a launch the device could not run, then on
    /// a loss that is not finite, each naming the step; a step whose gradients were not all
    /// finite updated nothing: the guard stops the run there (naming the parameter and the
    /// rank) or counts it skipped. Every rank calls it, before the next step.
    pub fn read(&mut self, mut stepped: Stepped) -> Result<StepValues, TrainError> {
        let (step, own) = (stepped.step, stepped.own_update);
        let check = stepped.check.take();
        let mut values = StepValues::read(stepped, &self.groups)?;
        let found = match check {
            Some(check) => self.optim.skipped(&check, own).map_err(|e| TrainError::at(step, e))?,
            None => None,
        };
        match found {
            Some(found) => {
                values.skipped = true;
                self.guard
                    .skip(found)
                    .map_err(|stopped| TrainError::Gradient { step, stopped })?;
            }
            None => values.spike = self.guard.kept(values.loss),
        }
        Ok(values)
    }

    /// Steps the guard skipped so far.
    pub fn skipped(&self) -> u64 {
        self.guard.skipped()
    }

    /// The step's gradients without the update, for an optimizer of the caller's (Burn's
    /// Learner's): then [`finish`](Self::finish) with the updated model.
    pub fn gradients(&mut self, batch: TokenBatch) -> Result<Gradients, TrainError> {
        let step = self.steps + 1;
        let at = |e: LayerError| TrainError::at(step, e);
        let parts = batch.split(self.accumulation).map_err(|e| at(e.into()))?;
        let n = parts.len();
        let dp = self.groups.grad_sync();
        let overlap = Overlap::new(self.optim.reducer(self.model()));
        let tapped = self.overlap && dp.size() > 1 && self.model().reduces_during_backward();
        let mut forwarded: Option<Forwarded> = None;
        for (i, part) in parts.into_iter().enumerate() {
            let last = i + 1 == n;
            let into_taps = tapped && last;
            let model = match into_taps {
                true => overlap.tap(self.model().clone(), dp),
                false => self.model().clone(),
            };
            let pass = Pass {
                weight: 1.0 / n as f64,
                collect: !into_taps,
                timing: self.timing,
            };
            let backward = model.forward_backward(part, pass).map_err(at)?;
            for (index, grad) in backward.grads.unwrap_or_default().into_iter().enumerate().rev() {
                let Some(grad) = grad else { continue };
                match last {
                    true => overlap.add(index, grad).map_err(|e| at(e.into()))?,
                    false => overlap.hold(index, grad),
                }
            }
            let next = Forwarded {
                loss: backward.loss,
                parts: backward.parts,
                loads: backward.loads,
                timing: backward.timing,
            };
            forwarded = Some(match forwarded {
                Some(sum) => sum.add(next),
                None => next,
            });
        }
        let reduced = overlap
            .finish(&self.device, model_dtype(self.model()))
            .map_err(|e| at(e.into()))?;
        let reduced = self.sum_over_stages(reduced).map_err(at)?;
        Ok(Gradients {
            reduced,
            forwarded: forwarded.expect("one microbatch at least"),
        })
    }

    /// Completes a step the model was updated in (`model`, by an optimizer of the caller's
    /// where `check` said every gradient was finite): its after-step updates, and the step as
    /// [`Stepped`].
    pub fn finish(
        &mut self,
        model: M,
        lr: f64,
        forwarded: Forwarded,
        norm: Option<Tensor<1>>,
        check: Option<FiniteCheck>,
    ) -> Result<Stepped, TrainError> {
        let step = self.steps + 1;
        self.model = Some(
            model
                .after_step(&forwarded.loads, &self.groups)
                .map_err(|e| TrainError::at(step, e))?,
        );
        self.steps = step;
        Ok(Stepped {
            step,
            lr,
            loss: forwarded.loss,
            parts: forwarded.parts,
            loads: forwarded.loads,
            norm,
            timing: forwarded.timing,
            check,
            own_update: false,
        })
    }

    /// `reduced` with each parameter other pipeline stages hold too (tied embeddings) summed
    /// over them, after the dp reduction.
    fn sum_over_stages(&mut self, reduced: Vec<Tensor<1>>) -> Result<Vec<Tensor<1>>, LayerError> {
        let pp = self.groups.pp.clone();
        if pp.size() == 1 {
            return Ok(reduced);
        }
        let model = self.model.as_ref().expect("a trainer whose step failed is spent");
        let copies = self.optim.stage_copies(model)?;
        Ok(match copies.any() {
            true => copies.sum_over_holders(reduced, &pp)?,
            false => reduced,
        })
    }
}

impl Forwarded {
    /// Another microbatch's report added: the losses and parts by name, the loads block by
    /// block; the last timing kept.
    fn add(mut self, next: Forwarded) -> Self {
        self.loss = self.loss + next.loss;
        for (name, value) in next.parts {
            match self.parts.iter_mut().find(|(n, _)| *n == name) {
                Some((_, sum)) => *sum = sum.clone() + value,
                None => self.parts.push((name, value)),
            }
        }
        self.loads = match self.loads.is_empty() {
            true => next.loads,
            false => self.loads.iter().zip(&next.loads).map(|(a, b)| a.add(b)).collect(),
        };
        self.timing = next.timing.or(self.timing);
        self
    }
}

/// The dtype of the model's first parameter (f32 for a model without any): its gradients'.
fn model_dtype<M: Module>(model: &M) -> DType {
    param_values(model)
        .first()
        .map(|p| p.value.dtype())
        .unwrap_or(DType::F32)
}
