//! Llama under Burn's Learner: a batch of token sequences in, the next-token loss out.

use burn::data::dataloader::batcher::Batcher;
use burn::tensor::{Device, ExecutionError, Int, Tensor, TensorData};
use burn::train::metric::{Adaptor, ItemLazy, LossInput};
use burn::train::{InferenceStep, TrainOutput, TrainStep};

use burn_megatron_dist::ProcessGroups;

use super::AfterStep;
use crate::error::ConfigError;
use crate::layers::context::ContextLayout;
use crate::layers::moe::Load;
use crate::models::llama::{Llama, LlamaStage, MoeReport};
use crate::params::{grads_params, param_values};
use crate::train::pipeline::{forward_loss, scheduled_step};

/// Token ids and the ids that follow them.
///
/// # Shapes
/// `ids`, `targets`: `[b, s]`
#[derive(Clone, Debug)]
pub struct TokenBatch {
    pub ids: Tensor<2, Int>,
    pub targets: Tensor<2, Int>,
}

/// Batches sequences of `s + 1` token ids: the first `s` are read, the last `s` predicted.
#[derive(Clone, Copy, Debug, Default)]
pub struct TokenBatcher;

impl Batcher<Vec<u32>, TokenBatch> for TokenBatcher {
    fn batch(&self, items: Vec<Vec<u32>>, device: &Device) -> TokenBatch {
        let (b, s) = (items.len(), items.first().map_or(0, |x| x.len().saturating_sub(1)));
        let mut ids = Vec::with_capacity(b * s);
        let mut targets = Vec::with_capacity(b * s);
        for item in &items {
            assert_eq!(item.len(), s + 1, "every sequence of a batch has the same length");
            ids.extend(item[..s].iter().map(|&t| t as i64));
            targets.extend(item[1..].iter().map(|&t| t as i64));
        }
        TokenBatch {
            ids: Tensor::from_data(TensorData::new(ids, [b, s]), device),
            targets: Tensor::from_data(TensorData::new(targets, [b, s]), device),
        }
    }
}

/// What a step reports: the loss, for Burn's `LossMetric`, and what each of the rank's MoE
/// blocks routed (in block order), for the expert bias ([`after_step`]).
#[derive(Clone, Debug)]
pub struct LmOutput {
    /// `[1]`
    pub loss: Tensor<1>,
    pub loads: Vec<Load>,
}

impl ItemLazy for LmOutput {
    fn sync(self) -> Result<Self, ExecutionError> {
        self.loss.device().flush()?;
        Ok(Self {
            loss: self.loss.without_autodiff(),
            loads: self.loads,
        })
    }
}

/// What a Llama's training moves outside the gradient after each step under
/// [`MegatronStrategy`](crate::train::MegatronStrategy), as the plain loop does: each MoE
/// block's expert bias by the step's loads, and each delayed-FP8 layer's amax history.
pub fn after_step() -> AfterStep {
    AfterStep::new(|model: Llama, output: &LmOutput, groups: &ProcessGroups| {
        let report = MoeReport {
            losses: Vec::new(),
            loads: output.loads.clone(),
        };
        let mut model = model.update_expert_bias(&report, groups).map_err(|e| e.to_string())?;
        crate::precision::linear::advance_histories(
            model
                .layers
                .iter_mut()
                .flat_map(crate::models::llama::LlamaBlock::linear_precisions),
            groups,
        )
        .map_err(|e| e.to_string())?;
        Ok(model)
    })
}

/// [`after_step`] for a pipeline stage: its own blocks' biases and histories.
pub fn stage_after_step() -> AfterStep {
    AfterStep::new(|stage: LlamaStage, output: &LmOutput, groups: &ProcessGroups| {
        let mut stage = stage
            .update_expert_bias(&output.loads, groups)
            .map_err(|e| e.to_string())?;
        crate::precision::linear::advance_histories(
            stage
                .layers
                .iter_mut()
                .flatten()
                .flat_map(crate::models::llama::LlamaBlock::linear_precisions),
            groups,
        )
        .map_err(|e| e.to_string())?;
        Ok(stage)
    })
}

impl Adaptor<LossInput> for LmOutput {
    fn adapt(&self) -> LossInput {
        LossInput::new(self.loss.clone())
    }
}

impl TrainStep for Llama {
    type Input = TokenBatch;
    type Output = LmOutput;

    /// Forward and backward. A failed collective (a lost peer) panics with its error: a
    /// Learner step cannot return one.
    fn step(&self, batch: TokenBatch) -> TrainOutput<LmOutput> {
        let batch = context_shard(self, batch);
        let (loss, report) = self
            .forward_loss_report(batch.ids, batch.targets)
            .unwrap_or_else(|e| panic!("{e}"));
        let grads = loss.backward();
        let item = LmOutput {
            loss: loss.detach(),
            loads: report.loads,
        };
        TrainOutput::new(self, grads, item)
    }
}

impl InferenceStep for Llama {
    type Input = TokenBatch;
    type Output = LmOutput;

    fn step(&self, batch: TokenBatch) -> LmOutput {
        let batch = context_shard(self, batch);
        let (loss, report) = self
            .forward_loss_report(batch.ids, batch.targets)
            .unwrap_or_else(|e| panic!("{e}"));
        LmOutput {
            loss,
            loads: report.loads,
        }
    }
}

impl TrainStep for LlamaStage {
    type Input = TokenBatch;
    type Output = LmOutput;

    /// This rank's part of a pipeline step over its schedule
    /// ([`LlamaStage::with_schedule`]): the batch cut into the microbatches, the gradients of
    /// this stage's parameters summed over them, the mean loss on every stage (Burn's metrics
    /// read it on any rank). A failed collective or a stage without a schedule panics with its
    /// error: a Learner step cannot return one.
    fn step(&self, batch: TokenBatch) -> TrainOutput<LmOutput> {
        let step = scheduled_step(self, batch.ids, batch.targets).unwrap_or_else(|e| panic!("{e}"));
        let values = param_values(self);
        let grads = step
            .grads
            .into_iter()
            .zip(values)
            .map(|(g, p)| g.unwrap_or_else(|| p.value.zeros_like()))
            .collect();
        TrainOutput {
            grads: grads_params(self, grads),
            item: LmOutput {
                loss: step.loss,
                loads: step.loads,
            },
        }
    }
}

impl InferenceStep for LlamaStage {
    type Input = TokenBatch;
    type Output = LmOutput;

    /// The batch's loss through the whole pipeline, forward only, on every stage.
    fn step(&self, batch: TokenBatch) -> LmOutput {
        let pp = &self
            .schedule
            .as_ref()
            .unwrap_or_else(|| panic!("{}", ConfigError::NoSchedule))
            .pp;
        let loss = forward_loss(self, batch.ids, batch.targets, pp).unwrap_or_else(|e| panic!("{e}"));
        LmOutput {
            loss,
            loads: Vec::new(),
        }
    }
}

/// This rank's chunks of the batch's sequences under context parallelism (the batch as it is
/// at cp = 1). A sequence that does not split into 2·cp chunks panics with the typed error's
/// text: a Learner step cannot return one (plan the model for the loader's sequence length).
fn context_shard(model: &Llama, batch: TokenBatch) -> TokenBatch {
    let Some(block) = model.layers.first() else {
        return batch;
    };
    let layout = ContextLayout::new(&block.attention.cp);
    let shard = |x| layout.shard(x, 1).unwrap_or_else(|e| panic!("{e}"));
    TokenBatch {
        ids: shard(batch.ids),
        targets: shard(batch.targets),
    }
}
