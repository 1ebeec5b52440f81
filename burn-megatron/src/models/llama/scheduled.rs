//! A pipeline stage that carries its schedule, so that it runs its part of a step on its own:
//! a training step over the microbatches (`run_actions`, the loss on every rank) and a
//! forward-only pass. Burn's Learner drives
//! stages through them (`learner.rs`); `pipeline::train_step` is the plain loop's.
//!
//! Legend: `b` a rank's sequences, `s` sequence, `m` microbatches.

use burn::tensor::{DType, Int, Tensor};
use burn_megatron_dist::{ProcessGroup, ReduceOp};

use super::pipeline::{Timing, run_actions};
use super::stage::LlamaStage;
use crate::error::{ConfigError, LayerError};
use crate::layers::context::ContextLayout;
use crate::layers::moe::Load;
use crate::params::param_values;
use crate::plan::PipelineSchedule;
use crate::plan::pipeline::schedule::Action;

/// This rank's actions of a schedule over `microbatches`, and the pipeline group they run on.
#[derive(Clone, Debug)]
pub struct StageSchedule {
    pub actions: Vec<Action>,
    pub microbatches: usize,
    pub pp: ProcessGroup,
}

/// What [`LlamaStage::scheduled_step`] produced.
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
}

impl LlamaStage {
    /// How this stage's attention splits sequences over cp (every stage holds a block).
    pub fn context_layout(&self) -> ContextLayout {
        let block = self.layers.iter().flatten().next().expect("a stage holds a block");
        ContextLayout::new(&block.attention.cp)
    }

    /// The stage with its rank's actions of `schedule` over `microbatches` on `pp`: the
    /// microbatches must suit the schedule and its model chunks the stage's.
    pub fn with_schedule(
        mut self,
        schedule: PipelineSchedule,
        microbatches: usize,
        pp: &ProcessGroup,
    ) -> Result<Self, ConfigError> {
        if schedule.chunks() != self.chunks.len() {
            return Err(ConfigError::StageChunks {
                schedule: schedule.chunks(),
                stage: self.chunks.len(),
            });
        }
        let mut actions = schedule.actions(pp.size(), microbatches)?;
        self.schedule = Some(StageSchedule {
            actions: actions.ranks.swap_remove(pp.group_rank()),
            microbatches,
            pp: pp.clone(),
        });
        Ok(self)
    }

    /// One training step of this rank over its schedule: `ids` and `targets` (`[b, s]`, this
    /// dp rank's whole sequences, the same on every stage; under context parallelism each cp
    /// rank takes its chunks) cut into the microbatches. Every rank of the pipeline calls it.
    pub fn scheduled_step(&self, ids: Tensor<2, Int>, targets: Tensor<2, Int>) -> Result<ScheduledStep, LayerError> {
        let schedule = self.schedule.as_ref().ok_or(ConfigError::NoSchedule)?;
        let pp = &schedule.pp;
        let context = self.context_layout();
        let (ids, targets) = (context.shard(ids, 1)?, context.shard(targets, 1)?);
        let [b, _] = ids.dims();
        let m = schedule.microbatches;
        if b < m || !b.is_multiple_of(m) {
            return Err(ConfigError::MicrobatchSplit {
                sequences: b,
                microbatches: m,
            }
            .into());
        }
        let per = b / m;
        let batches: Vec<_> = (0..m)
            .map(|i| {
                (
                    ids.clone().narrow(0, i * per, per),
                    targets.clone().narrow(0, i * per, per),
                )
            })
            .collect();
        // No device synchronization between actions: the host runs ahead of the device.
        let step = run_actions(self, &schedule.actions, &batches, pp, Timing::Off)?;
        let device = ids.device();
        let loss = match step.loss {
            Some(loss) => loss.detach().without_autodiff().cast(DType::F32),
            None => Tensor::zeros([1], (&device, DType::F32)).without_autodiff(),
        };
        Ok(ScheduledStep {
            loss: pp.all_reduce(loss, ReduceOp::Sum)?,
            grads: step.grads,
            loads: step.loads,
        })
    }

    /// The loss of `ids` against `targets` (`[b, s]`, whole sequences; under context
    /// parallelism each cp rank takes its chunks) through the whole pipeline, forward only and
    /// unsplit: each virtual stage in turn, its activations sent to the next; the head's loss
    /// plus every stage's router losses, `[1]` f32 on every stage, as
    /// [`Llama::forward_loss`](super::Llama::forward_loss). Every rank of `pp` calls it.
    pub fn forward_loss(
        &self,
        ids: Tensor<2, Int>,
        targets: Tensor<2, Int>,
        pp: &ProcessGroup,
    ) -> Result<Tensor<1>, LayerError> {
        let context = self.context_layout();
        let (ids, targets) = (context.shard(ids, 1)?, context.shard(targets, 1)?);
        let (rank, size) = (pp.group_rank(), pp.size());
        let stages = size * self.chunks.len();
        let [b, s] = ids.dims();
        let device = ids.device();
        let dtype = param_values(self).first().map_or(DType::F32, |p| p.value.dtype());
        let mut total = Tensor::<1>::zeros([1], (&device, DType::F32));
        // Rank r holds virtual stages r, r + pp, …: each waits on the one before it, on the
        // previous rank, which ran it earlier in its own order.
        for v in (rank..stages).step_by(size) {
            let x = match v {
                0 => self.embed(ids.clone())?,
                _ => {
                    let like = Tensor::<3>::zeros(self.activation_shape(b, s), (&device, dtype));
                    pp.recv(like, (v - 1) % size)?
                }
            };
            let (y, report) = self.forward_chunk(v / size, x)?;
            if let Some(routed) = report.loss() {
                total = total + routed.cast(DType::F32);
            }
            match v + 1 == stages {
                true => total = total + self.loss(y, targets.clone())?.cast(DType::F32),
                false => pp.send(y.detach(), (v + 1) % size)?,
            }
        }
        pp.flush()?;
        Ok(pp.all_reduce(total, ReduceOp::Sum)?)
    }
}
