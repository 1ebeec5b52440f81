//! One rank's training state between steps: its model, its optimizer (when the strategy
//! steps with the distributed one) and the dp reduction of each step's gradients.

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Tensor};
use burn::train::{Learner, LearnerModel, TrainStep};

use super::strategy::{MegatronStrategy, StrategyOptimizer};
use crate::optim::adamw::param_numels;
use crate::optim::{DistributedAdamW, GradReducer, Overlap, Reduction};

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
        let overlap = Overlap::new(reduction);
        let output = if s.overlap && dp.size() > 1 {
            TrainStep::step(&overlap.tap(self.model.clone(), dp), item).item
        } else {
            let output = TrainStep::step(&self.model, item);
            let grads = flat_grads(&self.model, output.grads);
            for (index, grad) in grads.into_iter().enumerate().rev() {
                if let Some(grad) = grad {
                    overlap.add(index, grad).map_err(|e| e.to_string())?;
                }
            }
            output.item
        };
        let reduced = overlap.finish(&s.device, dtype_of(&self.model)).map_err(|e| e.to_string())?;
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
