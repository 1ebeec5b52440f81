//! The Llama and its pipeline stages as [`TrainModel`]s: a whole model's step is one forward
//! and backward of its chunks of the sequences (context parallelism); a stage's runs its
//! schedule's actions over the pipeline (`LlamaStage::with_schedule`). After the update both
//! move each MoE block's expert bias by the step's loads and each delayed-FP8 layer's amax
//! history.

use burn::tensor::{DType, Tensor};
use burn_megatron_dist::ProcessGroups;
use burn_megatron_kernels::quant::notes::AmaxNotes;

use super::batch::TokenBatch;
use super::pipeline::{forward_loss, scheduled_step};
use super::step::{Backward, Pass, TrainModel, router_parts};
use crate::error::LayerError;
use crate::layers::context::ContextLayout;
use crate::layers::moe::Load;
use crate::models::llama::{Llama, LlamaBlock, LlamaStage, MoeReport};
use crate::precision::linear::advance_histories;

impl TrainModel for Llama {
    fn forward_backward(&self, batch: TokenBatch, pass: Pass) -> Result<Backward, LayerError> {
        let batch = context_shard(self, batch)?;
        let (loss, report) = self.forward_loss_documents(batch.ids, batch.targets, batch.documents.as_ref())?;
        let loss = match pass.weight == 1.0 {
            true => loss,
            false => loss.mul_scalar(pass.weight),
        };
        Ok(Backward::of(self, loss, router_parts(&report), report.loads, pass))
    }

    fn eval_loss(&self, batch: TokenBatch) -> Result<Tensor<1>, LayerError> {
        let batch = context_shard(self, batch)?;
        let (loss, _) = self.forward_loss_documents(batch.ids, batch.targets, batch.documents.as_ref())?;
        Ok(loss.cast(DType::F32))
    }

    fn reduces_during_backward(&self) -> bool {
        true
    }

    fn after_step(mut self, loads: &[Load], groups: &ProcessGroups) -> Result<Self, LayerError> {
        let report = MoeReport {
            loads: loads.to_vec(),
            ..MoeReport::default()
        };
        self = self.update_expert_bias(&report, groups)?;
        advance_histories(self.blocks_mut().flat_map(LlamaBlock::linear_precisions), groups)?;
        Ok(self)
    }

    fn amax_notes(&self) -> AmaxNotes {
        Llama::amax_notes(self)
    }
}

impl TrainModel for LlamaStage {
    /// This rank's part of a pipeline step over its schedule: the gradients of its parameters
    /// summed over the schedule's microbatches, the mean loss on every stage.
    fn forward_backward(&self, batch: TokenBatch, pass: Pass) -> Result<Backward, LayerError> {
        let step = scheduled_step(self, batch, pass.timing)?;
        let weigh = |x: Tensor<1>| match pass.weight == 1.0 {
            true => x,
            false => x.mul_scalar(pass.weight),
        };
        Ok(Backward {
            loss: weigh(step.loss.cast(DType::F32)),
            parts: Vec::new(),
            loads: step.loads,
            grads: pass
                .collect
                .then(|| step.grads.into_iter().map(|g| g.map(weigh)).collect()),
            timing: Some(step.timing),
        })
    }

    fn eval_loss(&self, batch: TokenBatch) -> Result<Tensor<1>, LayerError> {
        let pp = &self.schedule.as_ref().ok_or(crate::error::ConfigError::NoSchedule)?.pp;
        forward_loss(self, batch, pp)
    }

    fn reduces_during_backward(&self) -> bool {
        false
    }

    fn after_step(self, loads: &[Load], groups: &ProcessGroups) -> Result<Self, LayerError> {
        let mut stage = self.update_expert_bias(loads, groups)?;
        advance_histories(
            stage
                .layers
                .iter_mut()
                .flatten()
                .flat_map(LlamaBlock::linear_precisions),
            groups,
        )?;
        Ok(stage)
    }

    fn amax_notes(&self) -> AmaxNotes {
        LlamaStage::amax_notes(self)
    }
}

/// This rank's chunks of the batch's sequences under context parallelism (the batch as it is
/// at cp = 1), their packed documents' positions with them.
pub(crate) fn context_shard(model: &Llama, batch: TokenBatch) -> Result<TokenBatch, LayerError> {
    match model.layers.first() {
        Some(block) => Ok(batch.context_shard(&ContextLayout::new(block.context_group()))?),
        None => Ok(batch),
    }
}
