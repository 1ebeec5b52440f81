//! The choice of how attention sees the whole sequence under context parallelism, which the
//! plan sets on each attention layer.

use burn::config::Config;

/// How attention sees the whole sequence when it is split over the cp group.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum ContextParallel {
    /// K/V blocks passed around the cp ring, each transfer posted before the block before it
    /// is computed (Megatron's `p2p`).
    Ring,
    /// Heads scattered and the sequence gathered around attention (Ulysses, Megatron's
    /// `a2a`): the heads on each tp rank, query and kv, must divide by cp.
    AllToAll,
    /// K/V gathered whole on every cp rank (Llama 3's, Megatron's `all_gather`).
    AllGather,
}

// Burn's `Config` derive keeps no `#[default]` on a variant: the impl is written out.
#[allow(clippy::derivable_impls)]
impl Default for ContextParallel {
    fn default() -> Self {
        Self::Ring
    }
}

impl ContextParallel {
    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::Ring => "ring",
            Self::AllToAll => "all-to-all",
            Self::AllGather => "all-gather",
        }
    }
}

impl std::str::FromStr for ContextParallel {
    type Err = String;

    fn from_str(name: &str) -> Result<Self, String> {
        [Self::Ring, Self::AllToAll, Self::AllGather]
            .into_iter()
            .find(|c| c.name() == name)
            .ok_or_else(|| format!("unknown context exchange {name:?}: ring, all-to-all or all-gather"))
    }
}
