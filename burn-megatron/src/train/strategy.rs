//! [`MegatronStrategy`]: one rank's loop under Burn's `SupervisedTraining`, following the event
//! protocol of Burn's own strategies so that metrics, the dashboard, checkpointers, LR
//! schedulers and early stopping work unchanged.

use std::sync::{Arc, Mutex};

use burn::data::dataloader::{DataLoader, Progress};
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Device, Tensor};
use burn::train::train::WorkerFailure;
use burn::train::{
    EventProcessorTraining, InferenceStep, Interrupter, Learner, LearnerEvent, LearnerModel, SupervisedLearningStrategy,
    SupervisedTrainingEventProcessor, TrainLoader, TrainStep, TrainingComponents, TrainingError, TrainingItem,
    ValidLoader,
};
use burn_megatron_dist::mappings::{GradTap, tap_grad};
use burn_megatron_dist::{CommError, ProcessGroups, RankContext};

use crate::optim::adamw::param_numels;
use crate::optim::{BucketConfig, DistributedAdamW, DistributedAdamWConfig, GradReducer, Reduction};

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
#[derive(Clone, Debug)]
pub struct MegatronStrategy {
    groups: ProcessGroups,
    rank: usize,
    device: Device,
    optimizer: StrategyOptimizer,
    buckets: BucketConfig,
    overlap: bool,
}

impl MegatronStrategy {
    /// The strategy of the rank `ctx` describes: the Learner's optimizer, default buckets,
    /// overlapped reduction.
    pub fn new(ctx: &RankContext) -> Self {
        Self {
            groups: ctx.groups.clone(),
            rank: ctx.global_rank,
            device: ctx.device.clone(),
            optimizer: StrategyOptimizer::Learner,
            buckets: BucketConfig::new(),
            overlap: true,
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

    fn fail(&self, interrupter: &Interrupter, message: String) {
        interrupter.fail(TrainingError::Workers(vec![WorkerFailure { device_id: self.rank, message }]));
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
        let mut rank = RankTrainer::new(self, learner.model());
        let report = |processor: &mut SupervisedTrainingEventProcessor<M>, event| {
            interrupter.fail_on_error(processor.process_train(event));
        };
        for epoch in starting_epoch..=num_epochs {
            report(&mut event_processor, LearnerEvent::StartSplit { epoch_number: epoch, total_items: train.num_items() });
            for_each_item(&train, &interrupter, |iteration, progress, item| {
                learner.lr_step();
                match rank.step(&mut learner, item) {
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
            let model = rank.model.valid();
            let start = LearnerEvent::StartSplit { epoch_number: epoch, total_items: valid.num_items() };
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
                rank.sync_learner(&mut learner);
                checkpointer.checkpoint(&learner, epoch, &event_store);
            }
            if let Some(early) = &mut early_stopping
                && early.should_stop(epoch, &event_store)
            {
                break;
            }
        }
        (rank.model, event_processor)
    }
}

/// One rank's model, optimizer and gradient reducer between steps.
struct RankTrainer<'a, M> {
    strategy: &'a MegatronStrategy,
    model: M,
    optim: Option<DistributedAdamW>,
    /// Whether `model` is ahead of the Learner's (the distributed optimizer steps it alone).
    learner_behind: bool,
}

impl<'a, M: LearnerModel> RankTrainer<'a, M> {
    fn new(strategy: &'a MegatronStrategy, model: M) -> Self {
        let optim = match &strategy.optimizer {
            StrategyOptimizer::Learner => None,
            StrategyOptimizer::Distributed(config) => Some(config.init(&strategy.groups)),
        };
        Self { strategy, model, optim, learner_behind: false }
    }

    /// Forward, backward, the dp reduction and the optimizer step.
    fn step(&mut self, learner: &mut Learner<M>, item: <M as TrainStep>::Input) -> Result<<M as TrainStep>::Output, String> {
        let s = self.strategy;
        let dp = &s.groups.dp;
        let reduction = match &self.optim {
            Some(optim) => optim.reducer(&self.model),
            None => GradReducer::new(dp, param_numels(&self.model), dtype_of(&self.model).size(), Reduction::AllReduce, &s.buckets),
        };
        let reducer = Arc::new(Mutex::new(reduction));
        let errors: Arc<Mutex<Vec<CommError>>> = Arc::default();
        let output = if s.overlap && dp.size() > 1 {
            let tapped = tap_params(self.model.clone(), &s.groups, &reducer, &errors);
            let output = TrainStep::step(&tapped, item);
            output.item
        } else {
            let output = TrainStep::step(&self.model, item);
            let grads = flat_grads(&self.model, output.grads);
            let mut reducer = reducer.lock().expect("reducer lock");
            for (index, grad) in grads.into_iter().enumerate().rev() {
                if let Some(grad) = grad {
                    reducer.add(index, grad).map_err(|e| e.to_string())?;
                }
            }
            output.item
        };
        if let Some(error) = errors.lock().expect("errors lock").drain(..).next() {
            return Err(error.to_string());
        }
        let inner = s.device.clone();
        let reduced = reducer.lock().expect("reducer lock").finish(&inner, dtype_of(&self.model)).map_err(|e| e.to_string())?;
        match &mut self.optim {
            Some(optim) => {
                let lr = learner.lr_current().base();
                self.model = optim.step_reduced(lr, self.model.clone(), reduced).map_err(|e| e.to_string())?.0;
                self.learner_behind = true;
            }
            None => {
                learner.optimizer_step(grads_params(&self.model, reduced));
                self.model = learner.model();
            }
        }
        Ok(output)
    }

    /// Brings the Learner's model up to this rank's (before a Burn checkpoint reads it).
    fn sync_learner(&mut self, learner: &mut Learner<M>) {
        if self.learner_behind {
            learner.load_model(self.model.clone().into_record());
            self.learner_behind = false;
        }
    }
}

/// Runs `body(iteration, progress, item)` on each item of `loader`, counting from 1, until the
/// loader is done, an item fails to load (the interrupter gets the error), `body` returns
/// false, or a stop is asked.
fn for_each_item<I>(loader: &Arc<dyn DataLoader<I>>, interrupter: &Interrupter, mut body: impl FnMut(usize, Progress, I) -> bool) {
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
    let (dp, rank) = (groups.dp.size(), groups.dp.group_rank());
    if dp == 1 {
        return loader;
    }
    let n = loader.num_items();
    loader.slice(rank * n / dp, (rank + 1) * n / dp)
}

/// The model with every parameter's value behind a tap that hands its gradient to `reducer`.
fn tap_params<M: Module>(model: M, groups: &ProcessGroups, reducer: &Arc<Mutex<GradReducer>>, errors: &Arc<Mutex<Vec<CommError>>>) -> M {
    struct Tap<'a> {
        index: usize,
        groups: &'a ProcessGroups,
        reducer: &'a Arc<Mutex<GradReducer>>,
        errors: &'a Arc<Mutex<Vec<CommError>>>,
    }
    impl ModuleMapper for Tap<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let index = self.index;
            self.index += 1;
            let (reducer, errors) = (self.reducer.clone(), self.errors.clone());
            let tap = GradTap::new(move |grad| {
                if let Err(error) = reducer.lock().expect("reducer lock").add(index, grad) {
                    errors.lock().expect("errors lock").push(error);
                }
            });
            let dp = &self.groups.dp;
            param.map(|value| tap_grad(value, dp, tap))
        }
    }
    model.map(&mut Tap { index: 0, groups, reducer, errors })
}

/// Each parameter's gradient, flattened, in traversal order (`None` for an unused one).
fn flat_grads<M: Module>(model: &M, grads: GradientsParams) -> Vec<Option<Tensor<1>>> {
    struct Take(GradientsParams, Vec<Option<Tensor<1>>>);
    impl ModuleVisitor for Take {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let grad = self.0.remove::<D>(param.id).map(|g| {
                let n = g.shape().num_elements();
                g.reshape([n])
            });
            self.1.push(grad);
        }
    }
    let mut take = Take(grads, Vec::new());
    model.visit(&mut take);
    take.1
}

/// Reduced fp32 gradients, back in the parameters' shapes and dtypes, for the Learner's
/// optimizer.
fn grads_params<M: Module>(model: &M, reduced: Vec<Tensor<1>>) -> GradientsParams {
    struct Put(std::vec::IntoIter<Tensor<1>>, GradientsParams);
    impl ModuleVisitor for Put {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let value = param.val();
            let grad = self.0.next().expect("a gradient a parameter");
            let grad = grad.reshape(value.shape()).cast(value.dtype());
            self.1.register::<D>(param.id, grad);
        }
    }
    let mut put = Put(reduced.into_iter(), GradientsParams::new());
    model.visit(&mut put);
    put.1
}

/// The dtype of the model's first parameter (f32 for a model without any).
fn dtype_of<M: Module>(model: &M) -> DType {
    struct First(Option<DType>);
    impl ModuleVisitor for First {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.get_or_insert_with(|| param.val().dtype());
        }
    }
    let mut first = First(None);
    model.visit(&mut first);
    first.0.unwrap_or(DType::F32)
}
