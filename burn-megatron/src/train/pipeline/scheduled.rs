//! A pipeline stage that carries its schedule (`LlamaStage::with_schedule`) runs its part of a
//! step on its own: a training step over the microbatches ([`scheduled_step`]: `run_actions`,
//! the loss on every rank) and a forward-only pass ([`forward_loss`]). Burn's Learner drives
//! stages through them (`train::learner`), as the training step does (`train::Trainer`).
//!
//! Legend: `b` a rank's sequences, `s` sequence, `m` microbatches.

use burn::tensor::{DType, Tensor};
use burn_megatron_dist::{ProcessGroup, ReduceOp};

use super::run::{StageTiming, Timing, run_actions};
use crate::error::{ConfigError, LayerError};
use crate::layers::moe::Load;
use crate::models::llama::LlamaStage;
use crate::params::param_values;
use crate::train::batch::TokenBatch;

/// What [`scheduled_step`] produced.
pub struct ScheduledStep {
    /// The mean loss over the microbatches, `[1]` f32, on every stage.
    pub loss: Tensor<1>,
    /// Each parameter's gradient, flattened, in traversal order, summed over the microbatches
    /// (`None` for one the step did not reach); a parameter other stages hold too (tied
    /// embeddings) has this stage's part, summed over its holders after the dp reduction
    /// (`StageCopies::sum_over_holders`, as `MegatronStrategy` does).
    pub grads: Vec<Option<Tensor<1>>>,
    /// This rank's MoE blocks' loads over the step, in block order.
    pub loads: Vec<Load>,
    pub timing: StageTiming,
}

/// One training step of this rank over its schedule: `batch` (this dp rank's whole
/// sequences, the same on every stage; under context parallelism each cp rank takes its
/// chunks) cut into the microbatches, its actions timed as `timing` says. Every rank of the
/// pipeline calls it.
pub fn scheduled_step(stage: &LlamaStage, batch: TokenBatch, timing: Timing) -> Result<ScheduledStep, LayerError> {
    let schedule = stage.schedule.as_ref().ok_or(ConfigError::NoSchedule)?;
    let pp = &schedule.pp;
    let batches = batch
        .context_shard(&stage.context_layout())?
        .split(schedule.microbatches)?;
    let step = run_actions(stage, &schedule.actions, &batches, pp, timing)?;
    let device = batches[0].ids.device();
    let loss = match step.loss {
        Some(loss) => loss.detach().without_autodiff().cast(DType::F32),
        None => Tensor::zeros([1], (&device, DType::F32)).without_autodiff(),
    };
    Ok(ScheduledStep {
        loss: pp.all_reduce(loss, ReduceOp::Sum)?,
        grads: step.grads,
        loads: step.loads,
        timing: step.timing,
    })
}

/// The loss of `batch` (whole sequences; under context parallelism each cp rank takes its
/// chunks) through the whole pipeline, forward only and unsplit: each virtual stage in turn,
/// its activations sent to the next; the head's loss plus every stage's router losses, `[1]`
/// f32 on every stage, as [`Llama::forward_loss`](crate::models::llama::Llama::forward_loss).
/// Every rank of `pp` calls it.
pub fn forward_loss(stage: &LlamaStage, batch: TokenBatch, pp: &ProcessGroup) -> Result<Tensor<1>, LayerError> {
    let TokenBatch {
        ids,
        targets,
        documents,
    } = batch.context_shard(&stage.context_layout())?;
    let (rank, size) = (pp.group_rank(), pp.size());
    let stages = size * stage.chunks.len();
    let [b, s] = ids.dims();
    let device = ids.device();
    let dtype = param_values(stage).first().map_or(DType::F32, |p| p.value.dtype());
    let mut total = Tensor::<1>::zeros([1], (&device, DType::F32));
    // Rank r holds virtual stages r, r + pp, …: each waits on the one before it, on the
    // previous rank, which ran it earlier in its own order.
    for v in (rank..stages).step_by(size) {
        let x = match v {
            0 => stage.embed(ids.clone())?,
            _ => {
                let like = Tensor::<3>::zeros(stage.activation_shape(b, s), (&device, dtype));
                pp.recv(like, (v - 1) % size)?
            }
        };
        let (y, report) = stage.forward_chunk(v / size, x, documents.as_ref())?;
        if let Some(routed) = report.loss() {
            total = total + routed.cast(DType::F32);
        }
        match v + 1 == stages {
            true => total = total + stage.loss(y, targets.clone())?.cast(DType::F32),
            false => pp.send(y.detach(), (v + 1) % size)?,
        }
    }
    pp.flush()?;
    Ok(pp.all_reduce(total, ReduceOp::Sum)?)
}
