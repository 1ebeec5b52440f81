//! [`MegatronStrategy`]: one rank's loop under Burn's `SupervisedTraining`, following the event
//! protocol of Burn's own strategies so that metrics, the dashboard, checkpointers, LR
//! schedulers and early stopping work unchanged.

use std::sync::Arc;

use burn::data::dataloader::{DataLoader, Progress};
use burn::tensor::Device;
use burn::train::train::WorkerFailure;
use burn::train::{
    EventProcessorTraining, InferenceStep, Interrupter, Learner, LearnerEvent, LearnerModel,
    SupervisedLearningStrategy, SupervisedTrainingEventProcessor, TrainLoader, TrainingComponents, TrainingError,
    TrainingItem, ValidLoader,
};
use burn_megatron_dist::{ProcessGroups, RankContext};

use super::after_step::AfterStep;
use crate::optim::shared::StageCopies;
use crate::optim::{BucketConfig, DistributedAdamWConfig};
use crate::optim::{DistributedAdamW, GradGroup, GradReducer, Overlap, Reduction};
use crate::params::{grads_params, param_infos, param_values, take_grads};
use burn::module::Module;
use burn::tensor::{DType, Tensor};
use burn::train::TrainStep;
use burn_megatron_dist::CommError;
use burn_megatron_kernels::quant::notes::AmaxNotes;

/// Which optimizer steps the model.
#[derive(Clone, Debug)]
pub enum StrategyOptimizer {
    /// The Learner's own optimizer, given the dp-averaged gradients: Burn's optimizers, their
    /// clipping and their checkpoints, as they are.
    Learner,
    /// [`DistributedAdamW`]: fp32 master weights, ZeRO-1, clipping by the global norm over tp
    /// and dp. The Learner's optimizer goes unused; Burn's checkpoints hold the model and the
    /// scheduler, and [`checkpoint`](crate::checkpoint) holds this optimizer's state.
    Distributed(DistributedAdamWConfig),
}

/// Runs one rank of a tp × dp mesh as a `TrainingStrategy::Custom`.
///
/// - Data: the rank reads its data-parallel slice of each loader (`dp` contiguous slices of
///   the dataset, as Burn's DDP splits it); tensor-parallel peers read the same slice. The
///   global batch is `dp ×` the loader's batch size.
/// - Gradients: averaged over dp in buckets ([`BucketConfig`]); with `overlap`, each bucket is
///   reduced from inside backward as soon as its last gradient exists.
/// - Validation runs on every rank (tensor-parallel layers need all their ranks).
/// - Pipeline stages (a model whose `TrainStep` runs its part of a schedule, as
///   `LlamaStage::with_schedule`'s): their gradients are reduced after the step.
#[derive(Clone, Debug)]
pub struct MegatronStrategy {
    pub(super) groups: ProcessGroups,
    global_rank: usize,
    pub(super) device: Device,
    pub(super) optimizer: StrategyOptimizer,
    pub(super) buckets: BucketConfig,
    pub(super) overlap: bool,
    pub(super) after_step: Option<AfterStep>,
    /// The model's amax notes, for the distributed optimizer to keep its weights' amaxes in.
    amax_notes: Option<AmaxNotes>,
}

impl MegatronStrategy {
    /// The strategy of the rank `ctx` describes: the Learner's optimizer, default buckets,
    /// overlapped reduction.
    pub fn new(ctx: &RankContext) -> Self {
        Self {
            groups: ctx.groups.clone(),
            global_rank: ctx.global_rank,
            device: ctx.device.clone(),
            optimizer: StrategyOptimizer::Learner,
            buckets: BucketConfig::new(),
            overlap: true,
            after_step: None,
            amax_notes: None,
        }
    }

    /// With [`StrategyOptimizer::Distributed`], keep each new weight's amax in `notes` (the
    /// model's, `Llama::amax_notes`) for its FP8 tensorwise casts.
    pub fn with_amax_notes(mut self, notes: AmaxNotes) -> Self {
        self.amax_notes = Some(notes);
        self
    }

    /// Runs `update` on the model after each optimizer step (see [`AfterStep`]); the Learner
    /// then holds the updated model too (with [`StrategyOptimizer::Learner`], by loading its
    /// record every step).
    pub fn with_after_step(mut self, update: AfterStep) -> Self {
        self.after_step = Some(update);
        self
    }

    pub fn with_optimizer(mut self, optimizer: StrategyOptimizer) -> Self {
        self.optimizer = optimizer;
        self
    }

    pub fn with_buckets(mut self, buckets: BucketConfig) -> Self {
        self.buckets = buckets;
        self
    }

    /// Reduce each bucket during backward (the default), or all of them after it.
    pub fn with_overlap(mut self, overlap: bool) -> Self {
        self.overlap = overlap;
        self
    }

    fn fail(&self, interrupter: &Interrupter, message: String) {
        interrupter.fail(TrainingError::Workers(vec![WorkerFailure {
            device_id: self.global_rank,
            message,
        }]));
    }
}

impl<M: LearnerModel> SupervisedLearningStrategy<M> for MegatronStrategy {
    fn fit(
        &self,
        components: TrainingComponents<M>,
        mut learner: Learner<M>,
        train: TrainLoader<M>,
        valid: ValidLoader<M>,
        starting_epoch: usize,
    ) -> (M, SupervisedTrainingEventProcessor<M>) {
        let TrainingComponents {
            num_epochs,
            mut checkpointer,
            mut early_stopping,
            interrupter,
            mut event_processor,
            event_store,
            ..
        } = components;
        let autodiff = self.device.clone().autodiff();
        let train = dp_slice(train, &self.groups).to_device(&autodiff);
        let valid = dp_slice(valid, &self.groups).to_device(&self.device);
        learner.fork(&autodiff);
        let mut trainer = RankTrainer::new(self, learner.model());
        let report = |processor: &mut SupervisedTrainingEventProcessor<M>, event| {
            interrupter.fail_on_error(processor.process_train(event));
        };
        for epoch in starting_epoch..=num_epochs {
            report(
                &mut event_processor,
                LearnerEvent::StartSplit {
                    epoch_number: epoch,
                    total_items: train.num_items(),
                },
            );
            for_each_item(&train, &interrupter, |iteration, progress, item| {
                learner.lr_step();
                match trainer.step(&mut learner, item) {
                    Ok(output) => {
                        let item = TrainingItem::new(output, progress, Some(iteration), Some(learner.lr_current()));
                        report(&mut event_processor, LearnerEvent::ProcessedItem(item));
                        true
                    }
                    Err(error) => {
                        self.fail(&interrupter, format!("step {iteration} of epoch {epoch}: {error}"));
                        false
                    }
                }
            });
            report(&mut event_processor, LearnerEvent::EndSplit(epoch));
            if interrupter.should_stop() {
                break;
            }
            let model = trainer.model.valid();
            let start = LearnerEvent::StartSplit {
                epoch_number: epoch,
                total_items: valid.num_items(),
            };
            interrupter.fail_on_error(event_processor.process_valid(start));
            for_each_item(&valid, &interrupter, |iteration, progress, item| {
                let output = InferenceStep::step(&model, item);
                let event = LearnerEvent::ProcessedItem(TrainingItem::new(output, progress, Some(iteration), None));
                interrupter.fail_on_error(event_processor.process_valid(event));
                true
            });
            interrupter.fail_on_error(event_processor.process_valid(LearnerEvent::EndSplit(epoch)));
            report(&mut event_processor, LearnerEvent::EndEpoch(epoch));
            if checkpointer.is_some() || early_stopping.is_some() {
                interrupter.fail_on_error(event_processor.flush());
            }
            if interrupter.should_stop() {
                break;
            }
            if let Some(checkpointer) = &mut checkpointer {
                trainer.sync_learner(&mut learner);
                checkpointer.checkpoint(&learner, epoch, &event_store);
            }
            if let Some(early) = &mut early_stopping
                && early.should_stop(epoch, &event_store)
            {
                break;
            }
        }
        (trainer.model, event_processor)
    }
}

/// Runs `body(iteration, progress, item)` on each item of `loader`, counting from 1, until the
/// loader is done, an item fails to load (the interrupter gets the error), `body` returns
/// false, or a stop is asked.
fn for_each_item<I>(
    loader: &Arc<dyn DataLoader<I>>,
    interrupter: &Interrupter,
    mut body: impl FnMut(usize, Progress, I) -> bool,
) {
    let mut items = loader.iter();
    let mut iteration = 0;
    while let Some(item) = items.next() {
        let item = match item {
            Ok(item) => item,
            Err(error) => {
                interrupter.fail(error);
                return;
            }
        };
        iteration += 1;
        if !body(iteration, items.progress(), item) || interrupter.should_stop() {
            return;
        }
    }
}

/// The loader's `dp_rank`-th of `dp` contiguous slices.
fn dp_slice<O: Send + 'static>(loader: Arc<dyn DataLoader<O>>, groups: &ProcessGroups) -> Arc<dyn DataLoader<O>> {
    let (dp, dp_rank) = (groups.dp.size(), groups.dp.group_rank());
    if dp == 1 {
        return loader;
    }
    let n = loader.num_items();
    loader.slice(dp_rank * n / dp, (dp_rank + 1) * n / dp)
}

/// One rank's model, optimizer and gradient reducer between steps.
struct RankTrainer<'a, M> {
    strategy: &'a MegatronStrategy,
    model: M,
    optim: Option<DistributedAdamW>,
    /// The parameters other pipeline stages hold too (tied embeddings), found at the first
    /// step under pp.
    copies: Option<StageCopies>,
    /// Whether `model` is ahead of the Learner's (the distributed optimizer steps it alone).
    learner_behind: bool,
}

impl<'a, M: LearnerModel> RankTrainer<'a, M> {
    fn new(strategy: &'a MegatronStrategy, model: M) -> Self {
        let optim = match &strategy.optimizer {
            StrategyOptimizer::Learner => None,
            StrategyOptimizer::Distributed(config) => {
                let optim = config.init(&strategy.groups);
                Some(match &strategy.amax_notes {
                    Some(notes) => optim.keeping_amaxes(notes.clone()),
                    None => optim,
                })
            }
        };
        Self {
            strategy,
            model,
            optim,
            copies: None,
            learner_behind: false,
        }
    }

    /// Forward, backward, the dp reduction and the optimizer step.
    fn step(
        &mut self,
        learner: &mut Learner<M>,
        item: <M as TrainStep>::Input,
    ) -> Result<<M as TrainStep>::Output, String> {
        let s = self.strategy;
        let dp = s.groups.grad_sync();
        let reduction = match &self.optim {
            Some(optim) => optim.reducer(&self.model),
            None => {
                let numels = param_values(&self.model).into_iter().map(|p| p.value.dims()[0]);
                let params = numels.zip(GradGroup::for_model(&self.model, &s.groups)).collect();
                GradReducer::new(params, dtype_of(&self.model).size(), Reduction::AllReduce, &s.buckets)
            }
        };
        let overlap = Overlap::new(reduction);
        // A pipeline stage's backward runs once a microbatch: its gradients are reduced after
        // the step, not from inside backward.
        let output = if s.overlap && dp.size() > 1 && s.groups.pp.size() == 1 {
            TrainStep::step(&overlap.tap(self.model.clone(), dp), item).item
        } else {
            let output = TrainStep::step(&self.model, item);
            let grads = take_grads(&self.model, output.grads);
            for (index, grad) in grads.into_iter().enumerate().rev() {
                if let Some(grad) = grad {
                    overlap.add(index, grad).map_err(|e| e.to_string())?;
                }
            }
            output.item
        };
        let reduced = overlap
            .finish(&s.device, dtype_of(&self.model))
            .map_err(|e| e.to_string())?;
        let reduced = self.sum_over_stages(reduced).map_err(|e| e.to_string())?;
        match &mut self.optim {
            Some(optim) => {
                let lr = learner.lr_current().base();
                self.model = optim
                    .step_reduced(lr, self.model.clone(), reduced)
                    .map_err(|e| e.to_string())?
                    .0;
                self.learner_behind = true;
            }
            None => {
                learner.optimizer_step(grads_params(&self.model, reduced));
                self.model = learner.model();
                crate::optim::release_freed_pages(&s.device);
            }
        }
        if let Some(update) = &s.after_step {
            self.model = update.apply(self.model.clone(), &output, &s.groups)?;
            if self.optim.is_none() {
                // The Learner's optimizer steps the Learner's model next.
                learner.load_model(self.model.clone().into_record());
            }
        }
        Ok(output)
    }

    /// `reduced` with each parameter other pipeline stages hold too summed over them, after the
    /// dp reduction (`StageCopies::sum_over_holders`).
    fn sum_over_stages(&mut self, reduced: Vec<Tensor<1>>) -> Result<Vec<Tensor<1>>, CommError> {
        let pp = &self.strategy.groups.pp;
        if pp.size() == 1 {
            return Ok(reduced);
        }
        if self.copies.is_none() {
            let infos = param_infos(&self.model);
            self.copies = Some(StageCopies::find(&infos, pp, &self.strategy.device)?);
        }
        let copies = self.copies.as_ref().expect("found above");
        match copies.any() {
            true => copies.sum_over_holders(reduced, pp),
            false => Ok(reduced),
        }
    }

    /// Brings the Learner's model up to this rank's (before a Burn checkpoint reads it).
    fn sync_learner(&mut self, learner: &mut Learner<M>) {
        if self.learner_behind {
            learner.load_model(self.model.clone().into_record());
            self.learner_behind = false;
        }
    }
}

/// The dtype of the model's first parameter (f32 for a model without any).
fn dtype_of<M: Module>(model: &M) -> DType {
    param_values(model)
        .first()
        .map(|p| p.value.dtype())
        .unwrap_or(DType::F32)
}
