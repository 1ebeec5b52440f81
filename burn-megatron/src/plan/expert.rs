//! Expert parallelism: a mixture of experts' experts split over the ep group (folded over
//! dp × cp: `ep` consecutive ranks of it), each rank holding `e/ep` of them; the token copies
//! travel to their expert's rank and back (`layers/moe/exchange.rs`). Expert parameters are
//! averaged over the expert-data-parallel group (the dp × cp ranks holding the same experts)
//! by the optimizer, not over dp × cp.
//!
//! A model names its expert layers ([`ExpertParallelLayer`]); the plan checks that each splits
//! over ep and sets its dispatcher.

use burn::config::Config;

use crate::error::ConfigError;

/// How token copies reach the experts of other ep ranks.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum ExpertParallel {
    /// Uneven all-to-all over the ep group (Megatron's `alltoall` dispatcher).
    AllToAll,
    /// Every ep rank gathers all tokens and runs its experts' copies; the outputs are
    /// reduce-scattered back (Megatron's `allgather` dispatcher, for a small ep).
    AllGather,
}

/// A layer configuration expert parallelism can lay out.
pub trait ExpertParallelLayer {
    /// Checks that the layer's experts split over `ep` ranks and sets how copies travel.
    fn plan_expert(&mut self, ep: usize, dispatcher: ExpertParallel) -> Result<(), ConfigError>;
}

impl<T: ExpertParallelLayer + ?Sized> ExpertParallelLayer for &mut T {
    fn plan_expert(&mut self, ep: usize, dispatcher: ExpertParallel) -> Result<(), ConfigError> {
        (**self).plan_expert(ep, dispatcher)
    }
}

/// Experts split over ep ranks, `e/ep` each.
impl ExpertParallelLayer for crate::layers::moe::MoeConfig {
    fn plan_expert(&mut self, ep: usize, dispatcher: ExpertParallel) -> Result<(), ConfigError> {
        self.router.check()?;
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
