//! One rank's training state between steps: its model, its optimizer (when the strategy
//! steps with the distributed one) and the dp reduction of each step's gradients.

use burn::module::Module;
use burn::tensor::{DType, Tensor};
use burn::train::{Learner, LearnerModel, TrainStep};
use burn_megatron_dist::CommError;

use super::strategy::{MegatronStrategy, StrategyOptimizer};
use crate::optim::{DistributedAdamW, GradGroup, GradReducer, Overlap, Reduction};
use crate::params::{grads_params, param_infos, param_values, take_grads};
use crate::plan::pipeline::shared::StageCopies;

/// One rank's model, optimizer and gradient reducer between steps.
pub(super) struct RankTrainer<'a, M> {
    strategy: &'a MegatronStrategy,
    pub(super) model: M,
    optim: Option<DistributedAdamW>,
    /// The parameters other pipeline stages hold too (tied embeddings), found at the first
    /// step under pp.
    copies: Option<StageCopies>,
    /// Whether `model` is ahead of the Learner's (the distributed optimizer steps it alone).
    learner_behind: bool,
}

impl<'a, M: LearnerModel> RankTrainer<'a, M> {
    pub(super) fn new(strategy: &'a MegatronStrategy, model: M) -> Self {
        let optim = match &strategy.optimizer {
            StrategyOptimizer::Learner => None,
            StrategyOptimizer::Distributed(config) => Some(config.init(&strategy.groups)),
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
    pub(super) fn step(
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
    pub(super) fn sync_learner(&mut self, learner: &mut Learner<M>) {
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
