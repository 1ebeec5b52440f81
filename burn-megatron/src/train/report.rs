//! [`StepValues`]: a step read to the host, over the ranks that split its batch, and the
//! line a run prints for it.

use std::fmt;

use burn::tensor::{DType, Tensor};
use burn_megatron_dist::{ProcessGroups, ReduceOp};
use burn_megatron_kernels::failures;
use serde::Serialize;

use super::pipeline::StageTiming;
use super::step::{Stepped, TrainError};

/// One step's values on the host, the same on every rank.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StepValues {
    pub step: u64,
    /// The loss, averaged over dp × cp (every stage holds the last one's).
    pub loss: f64,
    pub lr: f64,
    /// The global gradient norm before clipping.
    pub grad_norm: Option<f64>,
    /// The loss's named parts, each averaged over dp × cp: a mixture of experts' router losses
    /// summed over the MoE blocks (whole models: a pipeline stage reports loads alone),
    /// distillation's KL and data terms.
    pub parts: Vec<(String, f64)>,
    /// Each expert's token copies over the batch and the MoE blocks, and those dropped.
    pub expert_load: Option<ExpertLoad>,
    /// The share of a pipeline stage's step spent outside its forwards and backwards, when
    /// they were timed.
    #[serde(skip)]
    pub timing: Option<StageTiming>,
    /// Whether the step updated nothing, a gradient not being finite (the guard skipped it).
    pub skipped: bool,
    /// The loss over its running mean, where it passed the guard's spike factor.
    pub spike: Option<f64>,
}

/// Token copies an expert took, summed over the batch and the MoE blocks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ExpertLoad {
    pub per_expert: Vec<i64>,
    pub dropped: i64,
}

impl StepValues {
    pub(super) fn read(stepped: Stepped, groups: &ProcessGroups) -> Result<Self, TrainError> {
        let step = stepped.step;
        let at = |e: burn_megatron_dist::CommError| TrainError::at(step, e);
        let batch = groups.grad_sync();
        let device = stepped.loss.device();
        let loss = batch
            .all_reduce(stepped.loss.cast(DType::F32), ReduceOp::Avg)
            .map_err(at)?
            .into_scalar::<f64>();
        // The read above waited for the step: a launch it could not run is logged by now.
        failures::check(&device).map_err(|failure| TrainError::Device { step, failure })?;
        if !loss.is_finite() {
            return Err(TrainError::NonFiniteLoss { step, value: loss });
        }
        let parts = stepped
            .parts
            .into_iter()
            .map(|(name, sum)| Ok((name, batch.all_reduce(sum, ReduceOp::Avg)?.into_scalar::<f64>())))
            .collect::<Result<Vec<_>, _>>()
            .map_err(at)?;
        // A stage's loads are its own blocks': summed over ranks that hold other blocks they
        // would mean nothing, and stages without MoE blocks could not join the sum.
        let load = stepped.loads.into_iter().reduce(|a, b| a.add(&b));
        let expert_load = match (groups.pp.size(), load) {
            (1, Some(load)) => {
                // The dropped copies beside the experts', in the counts' own int type.
                let dropped = load
                    .per_expert
                    .clone()
                    .narrow(0, 0, 1)
                    .zeros_like()
                    .add_scalar(load.dropped as i64);
                let counts = Tensor::cat(vec![load.per_expert, dropped], 0);
                let total = batch.all_reduce(counts, ReduceOp::Sum).map_err(at)?;
                let mut total: Vec<i64> = total
                    .into_data()
                    .convert::<i64>()
                    .try_into_vec::<i64>()
                    .expect("i64 counts");
                let dropped = total.pop().expect("the dropped count");
                Some(ExpertLoad {
                    per_expert: total,
                    dropped,
                })
            }
            _ => None,
        };
        Ok(Self {
            step,
            loss,
            lr: stepped.lr,
            grad_norm: stepped.norm.map(|n| n.into_scalar::<f64>()),
            parts,
            expert_load,
            timing: stepped.timing,
            skipped: false,
            spike: None,
        })
    }
}

/// `step N loss X`, then each part of the loss, each expert's copies and those dropped, and
/// whether the step was skipped or its loss spiked.
impl fmt::Display for StepValues {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "step {} loss {:.6}", self.step, self.loss)?;
        for (name, value) in &self.parts {
            write!(f, " {name} {value:.6}")?;
        }
        if let Some(load) = &self.expert_load {
            let per_expert: Vec<String> = load.per_expert.iter().map(i64::to_string).collect();
            write!(f, " load [{}] dropped {}", per_expert.join(" "), load.dropped)?;
        }
        if self.skipped {
            write!(f, " (skipped: a gradient is not finite)")?;
        }
        if let Some(ratio) = self.spike {
            write!(f, " (spike: {ratio:.1}x the running mean)")?;
        }
        Ok(())
    }
}
