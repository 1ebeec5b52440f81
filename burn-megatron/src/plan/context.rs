//! Context parallelism: each sequence split over the cp group. Not built yet; its room in the
//! plan, so a run asking for it is refused by name.

use crate::error::ConfigError;

/// How attention sees the whole sequence when it is split over the cp group.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ContextParallel {
    /// K/V blocks passed around the cp ring, overlapped with attention (Megatron's `p2p`).
    #[default]
    Ring,
    /// Heads scattered, the sequence gathered around attention (Ulysses, `a2a`).
    AllToAll,
    /// K/V gathered whole on every cp rank (Llama 3's `all_gather`).
    AllGather,
}

impl ContextParallel {
    /// Context parallelism over `cp` ranks: only `cp = 1` runs today.
    pub fn check(self, cp: usize) -> Result<(), ConfigError> {
        match cp {
            1 => Ok(()),
            size => Err(ConfigError::NotBuilt {
                dimension: "context parallelism",
                size,
            }),
        }
    }
}
