//! Expert parallelism: a mixture of experts' experts split over the ep group (folded over
//! dp × cp, and the tp ranks outside an etp group: `burn_megatron_dist::mesh`), each rank holding
//! `e/ep` of them and of each its `f/etp` hidden features (expert tensor parallelism, etp = tp
//! unless the dims say less); the token copies travel to their expert's rank and back
//! (`layers/moe/exchange.rs`). Expert parameters are averaged over the expert-data-parallel
//! group (the ranks holding the same experts) by the optimizer, not over dp × cp.
//!
//! A model names its expert layers ([`ExpertParallelLayer`]); the plan checks that each splits
//! over ep and etp and sets its dispatcher.

use burn_megatron_dist::ParallelDims;

use crate::error::{ConfigError, divisible};
use crate::layers::SequenceLayout;
pub use crate::layers::moe::ExpertParallel;

/// A layer configuration expert parallelism can lay out.
pub trait ExpertParallelLayer {
    /// Checks that the layer's experts split over `dims.ep` ranks and their hidden features
    /// over etp, and sets how copies travel. Runs after the tensor plan (the layer's sequence
    /// layout is set).
    fn plan_expert(&mut self, dims: &ParallelDims, dispatcher: ExpertParallel) -> Result<(), ConfigError>;
}

impl<T: ExpertParallelLayer + ?Sized> ExpertParallelLayer for &mut T {
    fn plan_expert(&mut self, dims: &ParallelDims, dispatcher: ExpertParallel) -> Result<(), ConfigError> {
        (**self).plan_expert(dims, dispatcher)
    }
}

/// Experts split over ep ranks, `e/ep` each, their hidden features over etp; below tp, etp
/// needs the sequence split over tp (each etp group dispatches its own part).
impl ExpertParallelLayer for crate::layers::moe::MoeConfig {
    fn plan_expert(&mut self, dims: &ParallelDims, dispatcher: ExpertParallel) -> Result<(), ConfigError> {
        self.router.check()?;
        let (tp, etp, ep) = (dims.tp, dims.expert_tp(), dims.ep);
        if etp < tp && self.sequence != SequenceLayout::Sharded {
            return Err(ConfigError::ExpertTpNeedsSequenceParallel { etp, tp });
        }
        divisible("d_ff", self.d_ff, etp)?;
        match self.router.n_experts.is_multiple_of(ep) {
            true => {
                self.dispatcher = dispatcher;
                Ok(())
            }
            false => Err(ConfigError::ExpertsNotDivisible {
                experts: self.router.n_experts,
                ep,
            }),
        }
    }
}
