//! Context parallelism: each sequence split over the cp group in `2·cp` load-balanced chunks
//! (`layers/context/layout.rs`: rank `r` holds chunks `r` and `2cp − 1 − r`), positions
//! following the chunks; attention sees the whole sequence through the chosen exchange; the
//! loss counts the tokens of every cp rank and gradients are averaged over dp × cp
//! ([`ProcessGroups::grad_sync`](burn_megatron_dist::ProcessGroups::grad_sync)), so nothing else
//! of the model changes.
//!
//! A model names its attention layers ([`ContextParallelLayer`]); the plan checks each against
//! cp and sets its exchange.

use burn::config::Config;

use crate::error::ConfigError;
use crate::layers::ParallelAttentionConfig;

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

/// A layer configuration context parallelism lays out.
pub trait ContextParallelLayer {
    /// Checks the layer against `cp` ranks (after tensor parallelism over `tp`) and sets how it
    /// sees the whole sequence.
    fn plan_context(&mut self, cp: usize, tp: usize, context: ContextParallel) -> Result<(), ConfigError>;
}

impl<T: ContextParallelLayer + ?Sized> ContextParallelLayer for &mut T {
    fn plan_context(&mut self, cp: usize, tp: usize, context: ContextParallel) -> Result<(), ConfigError> {
        (**self).plan_context(cp, tp, context)
    }
}

/// Attention: all-to-all scatters each tp rank's heads over cp.
impl ContextParallelLayer for ParallelAttentionConfig {
    fn plan_context(&mut self, cp: usize, tp: usize, context: ContextParallel) -> Result<(), ConfigError> {
        self.context = context;
        self.validate_context(cp, tp)
    }
}
