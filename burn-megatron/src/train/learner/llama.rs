//! Llama under Burn's Learner: a batch of token sequences in, the next-token loss out. Burn's
//! `TrainStep` and `InferenceStep` for a whole model and a pipeline stage; `MegatronStrategy`
//! steps them through [`TrainModel`] instead, and Burn's own strategies through these.

use burn::data::dataloader::batcher::Batcher;
use burn::tensor::{Device, ExecutionError, Tensor, TensorData};
use burn::train::metric::{Adaptor, ItemLazy, LossInput};
use burn::train::{InferenceStep, TrainOutput, TrainStep};

use crate::error::ConfigError;
use crate::layers::moe::Load;
use crate::models::llama::{Llama, LlamaStage};
use crate::params::{grads_params, param_values};
use crate::train::llama::context_shard;
use crate::train::pipeline::{Timing, forward_loss};
use crate::train::{Pass, Targeted, TokenBatch, TrainModel};

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
        TokenBatch::new(
            Tensor::from_data(TensorData::new(ids, [b, s]), device),
            Tensor::from_data(TensorData::new(targets, [b, s]), device),
        )
    }
}

impl Batcher<Targeted, TokenBatch> for TokenBatcher {
    fn batch(&self, items: Vec<Targeted>, device: &Device) -> TokenBatch {
        // The datasets pack documents within their rows.
        TokenBatch::targeted(items, device).expect("documents that fit their rows")
    }
}

/// What a step reports: the loss, for Burn's `LossMetric`, and what each of the rank's MoE
/// blocks routed (in block order).
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

impl Adaptor<LossInput> for LmOutput {
    fn adapt(&self) -> LossInput {
        LossInput::new(self.loss.clone())
    }
}

/// One forward and backward of `model` as Burn's `TrainStep` returns it. A failed collective (a
/// lost peer) or a batch that does not fit the plan panics with its error: a Learner step
/// cannot return one.
fn train_step<M: TrainModel>(model: &M, batch: TokenBatch) -> TrainOutput<LmOutput> {
    let pass = Pass {
        weight: 1.0,
        collect: true,
        timing: Timing::Off,
    };
    let backward = model.forward_backward(batch, pass).unwrap_or_else(|e| panic!("{e}"));
    let values = param_values(model);
    let grads = backward
        .grads
        .expect("collected")
        .into_iter()
        .zip(values)
        .map(|(g, p)| g.unwrap_or_else(|| p.value.zeros_like()))
        .collect();
    TrainOutput {
        grads: grads_params(model, grads),
        item: LmOutput {
            loss: backward.loss,
            loads: backward.loads,
        },
    }
}

impl TrainStep for Llama {
    type Input = TokenBatch;
    type Output = LmOutput;

    fn step(&self, batch: TokenBatch) -> TrainOutput<LmOutput> {
        train_step(self, batch)
    }
}

impl InferenceStep for Llama {
    type Input = TokenBatch;
    type Output = LmOutput;

    fn step(&self, batch: TokenBatch) -> LmOutput {
        let batch = context_shard(self, batch).unwrap_or_else(|e| panic!("{e}"));
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
    /// ([`LlamaStage::with_schedule`]): the gradients of this stage's parameters summed over
    /// the microbatches, the mean loss on every stage (Burn's metrics read it on any rank).
    fn step(&self, batch: TokenBatch) -> TrainOutput<LmOutput> {
        train_step(self, batch)
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
        let loss = forward_loss(self, batch, pp).unwrap_or_else(|e| panic!("{e}"));
        LmOutput {
            loss,
            loads: Vec::new(),
        }
    }
}
