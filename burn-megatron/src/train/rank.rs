//! One rank's training state between steps: its model, its optimizer (when the strategy
//! steps with the distributed one) and the dp reduction of each step's gradients.

use std::sync::{Arc, Mutex};

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Tensor};
use burn::train::{Learner, LearnerModel, TrainStep};
use burn_megatron_dist::mappings::{GradTap, tap_grad};
use burn_megatron_dist::{CommError, ProcessGroups};

use super::strategy::{MegatronStrategy, StrategyOptimizer};
use crate::optim::adamw::param_numels;
use crate::optim::{DistributedAdamW, GradReducer, Reduction};

/// One rank's model, optimizer and gradient reducer between steps.
pub(super) struct RankTrainer<'a, M> {
    strategy: &'a MegatronStrategy,
    pub(super) model: M,
    optim: Option<DistributedAdamW>,
    /// Whether `model` is ahead of the Learner's (the distributed optimizer steps it alone).
    learner_behind: bool,
}

impl<'a, M: LearnerModel> RankTrainer<'a, M> {
    pub(super) fn new(strategy: &'a MegatronStrategy, model: M) -> Self {
        let optim = match &strategy.optimizer {
            StrategyOptimizer::Learner => None,
            StrategyOptimizer::Distributed(config) => Some(config.init(&strategy.groups)),
        };
        Self { strategy, model, optim, learner_behind: false }
    }

    /// Forward, backward, the dp reduction and the optimizer step.
    pub(super) fn step(&mut self, learner: &mut Learner<M>, item: <M as TrainStep>::Input) -> Result<<M as TrainStep>::Output, String> {
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
    pub(super) fn sync_learner(&mut self, learner: &mut Learner<M>) {
        if self.learner_behind {
            learner.load_model(self.model.clone().into_record());
            self.learner_behind = false;
        }
    }
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
