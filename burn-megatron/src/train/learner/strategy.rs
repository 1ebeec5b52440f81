//! [`MegatronStrategy`]: one rank's loop under Burn's `SupervisedTraining`, following the event
//! protocol of Burn's own strategies so that metrics, the dashboard, checkpointers, LR
//! schedulers and early stopping work unchanged; each step is the library's
//! ([`Trainer`]), and what a run does around it the plain loop's ([`Routine`]).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use burn::data::dataloader::{DataLoader, Progress};
use burn::tensor::Device;
use burn::train::train::WorkerFailure;
use burn::train::{
    EventProcessorTraining, InferenceStep, Interrupter, Learner, LearnerEvent, LearnerModel,
    SupervisedLearningStrategy, SupervisedTrainingEventProcessor, TrainLoader, TrainingComponents, TrainingError,
    TrainingItem, ValidLoader,
};
use burn_megatron_dist::{ProcessGroups, RankContext};

use super::llama::LmOutput;
use crate::checkpoint;
use crate::optim::{BucketConfig, DistributedAdamWConfig};
use crate::params::grads_params;
use crate::train::routine::Routine;
use crate::train::{GuardConfig, TokenBatch, TrainModel, Trainer};

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

/// Runs one rank of the mesh as a `TrainingStrategy::Custom`.
///
/// - Data: the rank reads its data-parallel slice of each loader (`dp` contiguous slices of
///   the dataset, as Burn's DDP splits it); tensor-parallel peers read the same slice. The
///   global batch is `dp ×` the loader's batch size.
/// - Steps: the library's [`Trainer`] (accumulation over microbatches, gradients averaged over
///   dp in buckets, with `overlap` reduced from inside backward); after each, the
///   [`Routine`] given (`with_routine`: metrics file, evaluation, checkpoints, samples).
/// - Validation runs on every rank (tensor-parallel layers need all their ranks).
/// - Pipeline stages (`LlamaStage::with_schedule`): their gradients are reduced after the step.
pub struct MegatronStrategy<M> {
    pub(super) groups: ProcessGroups,
    global_rank: usize,
    pub(super) device: Device,
    pub(super) optimizer: StrategyOptimizer,
    pub(super) buckets: BucketConfig,
    pub(super) overlap: bool,
    accumulation: usize,
    guard: GuardConfig,
    resume: Option<PathBuf>,
    /// Taken by `fit`: the strategy is shared behind an `Arc`.
    routine: Mutex<Option<Routine<M>>>,
}

impl<M> std::fmt::Debug for MegatronStrategy<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MegatronStrategy")
            .field("global_rank", &self.global_rank)
            .field("optimizer", &self.optimizer)
            .field("overlap", &self.overlap)
            .field("accumulation", &self.accumulation)
            .field("guard", &self.guard)
            .field("resume", &self.resume)
            .finish()
    }
}

impl<M: TrainModel> MegatronStrategy<M> {
    /// The strategy of the rank `ctx` describes: the Learner's optimizer, default buckets,
    /// overlapped reduction, one microbatch a step.
    pub fn new(ctx: &RankContext) -> Self {
        Self {
            groups: ctx.groups.clone(),
            global_rank: ctx.global_rank,
            device: ctx.device.clone(),
            optimizer: StrategyOptimizer::Learner,
            buckets: BucketConfig::new(),
            overlap: true,
            accumulation: 1,
            guard: GuardConfig::default(),
            resume: None,
            routine: Mutex::new(None),
        }
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

    /// Each loader batch split into `microbatches`, their gradients accumulated (checked when
    /// training starts).
    pub fn with_accumulation(mut self, microbatches: usize) -> Self {
        self.accumulation = microbatches;
        self
    }

    /// Guards the steps as `guard` says (by default a step whose gradients are not all finite
    /// updates nothing and stops the run).
    pub fn with_guard(mut self, guard: GuardConfig) -> Self {
        self.guard = guard;
        self
    }

    /// Starts from the latest checkpoint under `dir` (the model and, with
    /// [`StrategyOptimizer::Distributed`], the optimizer): the loaders then hold the steps
    /// after it.
    pub fn with_resume(mut self, dir: Option<PathBuf>) -> Self {
        self.resume = dir;
        self
    }

    /// Runs `routine` after each step.
    pub fn with_routine(self, routine: Routine<M>) -> Self {
        *self.routine.lock().expect("not poisoned") = Some(routine);
        self
    }

    fn fail(&self, interrupter: &Interrupter, message: String) {
        interrupter.fail(TrainingError::Workers(vec![WorkerFailure {
            device_id: self.global_rank,
            message,
        }]));
    }
}

impl<M> SupervisedLearningStrategy<M> for MegatronStrategy<M>
where
    M: LearnerModel + TrainModel + burn::train::TrainStep<Input = TokenBatch, Output = LmOutput>,
{
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
        let mut trainer = match RankTrainer::new(self, &mut learner) {
            Ok(trainer) => trainer,
            Err(error) => {
                self.fail(&interrupter, error);
                return (learner.model(), event_processor);
            }
        };
        let mut routine = self.routine.lock().expect("not poisoned").take();
        if let Some(routine) = &mut routine {
            routine.start();
        }
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
                match trainer.step(&mut learner, item, routine.as_mut()) {
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
            if epoch == num_epochs
                && let Some(routine) = &mut routine
                && let Err(error) = routine.finish()
            {
                self.fail(&interrupter, error.to_string());
                break;
            }
            let model = trainer.trainer.model().valid();
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
        (trainer.trainer.into_parts().0, event_processor)
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

/// One rank's [`Trainer`] between steps, and whether the Learner's model is behind it.
struct RankTrainer<'a, M> {
    strategy: &'a MegatronStrategy<M>,
    trainer: Trainer<M>,
    /// Whether the trainer's model is ahead of the Learner's (the distributed optimizer steps it
    /// alone).
    learner_behind: bool,
}

impl<'a, M: LearnerModel + TrainModel> RankTrainer<'a, M> {
    /// The rank's trainer of the Learner's model (resumed from the strategy's checkpoint, the
    /// Learner's schedule moved past its steps).
    fn new(strategy: &'a MegatronStrategy<M>, learner: &mut Learner<M>) -> Result<Self, String> {
        let optim = match &strategy.optimizer {
            // Only its reducer serves: the Learner's optimizer steps the model.
            StrategyOptimizer::Learner => DistributedAdamWConfig::new().with_buckets(strategy.buckets.clone()),
            StrategyOptimizer::Distributed(config) => config.clone(),
        };
        let mut trainer = Trainer::new(learner.model(), &optim, &strategy.groups, &strategy.device)
            .with_overlap(strategy.overlap)
            .with_accumulation(strategy.accumulation)
            .and_then(|trainer| trainer.with_guard(strategy.guard.clone()))
            .map_err(|e| e.to_string())?;
        let mut learner_behind = false;
        if let Some(dir) = &strategy.resume {
            let groups = &strategy.groups;
            let load = |model, optim: &mut _| checkpoint::load(dir, model, optim, groups);
            let steps = trainer.restore(load).map_err(|e| e.to_string())?;
            for _ in 0..steps {
                learner.lr_step();
            }
            learner_behind = true;
        }
        let mut rank = Self {
            strategy,
            trainer,
            learner_behind,
        };
        rank.sync_learner(learner);
        Ok(rank)
    }

    /// One training step through the [`Trainer`], the update by the strategy's optimizer, then
    /// the routine.
    fn step(
        &mut self,
        learner: &mut Learner<M>,
        batch: TokenBatch,
        routine: Option<&mut Routine<M>>,
    ) -> Result<LmOutput, String> {
        let lr = learner.lr_current().base();
        let stepped = match &self.strategy.optimizer {
            StrategyOptimizer::Distributed(_) => {
                self.learner_behind = true;
                self.trainer.step(lr, batch).map_err(|e| e.to_string())?
            }
            StrategyOptimizer::Learner => {
                let gradients = self.trainer.gradients(batch).map_err(|e| e.to_string())?;
                // Burn's optimizers take any gradient: one not finite anywhere updates nothing.
                let check = self.trainer.check(&gradients).map_err(|e| e.to_string())?;
                if check.as_ref().is_none_or(|check| check.finite()) {
                    learner.optimizer_step(grads_params(self.trainer.model(), gradients.reduced));
                }
                crate::optim::release_freed_pages(&self.strategy.device);
                let stepped = self
                    .trainer
                    .finish(learner.model(), lr, gradients.forwarded, None, check)
                    .map_err(|e| e.to_string())?;
                // What moved outside the gradient (expert biases, amax histories), into the
                // model the Learner's optimizer steps next.
                learner.load_model(self.trainer.model().clone().into_record());
                stepped
            }
        };
        let output = LmOutput {
            loss: stepped.loss.clone(),
            loads: stepped.loads.clone(),
        };
        if let Some(routine) = routine {
            routine
                .after_step(&mut self.trainer, stepped)
                .map_err(|e| e.to_string())?;
        }
        Ok(output)
    }

    /// Brings the Learner's model up to this rank's (before a Burn checkpoint reads it).
    fn sync_learner(&mut self, learner: &mut Learner<M>) {
        if self.learner_behind {
            learner.load_model(self.trainer.model().clone().into_record());
            self.learner_behind = false;
        }
    }
}
