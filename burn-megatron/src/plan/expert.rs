//! Expert parallelism: a mixture of experts' experts split over the ep group (folded over
//! dp × cp). The MoE layer runs at ep = 1 (`layers/moe`); splitting its experts over ep is not
//! built yet, so a run asking for ep > 1 is refused by name.

use crate::error::ConfigError;

/// How tokens reach the experts of other ep ranks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ExpertParallel {
    /// Uneven all-to-all over the ep group (Megatron's `alltoall` dispatcher).
    #[default]
    AllToAll,
    /// Every ep rank gathers all tokens and keeps its experts' (small ep).
    AllGather,
}

impl ExpertParallel {
    /// Expert parallelism over `ep` ranks: only `ep = 1` runs today.
    pub fn check(self, ep: usize) -> Result<(), ConfigError> {
        match ep {
            1 => Ok(()),
            size => Err(ConfigError::NotBuilt {
                dimension: "expert parallelism",
                size,
            }),
        }
    }
}
