//! Context parallelism: each sequence split over the cp group in `2·cp` load-balanced chunks
//! (`layers/context/layout.rs`: rank `r` holds chunks `r` and `2cp − 1 − r`), positions
//! following the chunks; attention sees the whole sequence through the chosen exchange; the
//! loss counts the tokens of every cp rank and gradients are averaged over dp × cp
//! ([`ProcessGroups::grad_sync`](burn_megatron_dist::ProcessGroups::grad_sync)), so nothing else
//! of the model changes.
//!
//! A model names its attention layers ([`ContextParallelLayer`]); the plan checks each against
//! cp and sets its exchange.

use crate::error::ConfigError;
use crate::layers::ParallelAttentionConfig;
pub use crate::layers::context::ContextParallel;

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

/// Latent attention sees the whole sequence through `context`'s exchange of its heads' q, k
/// and v (the unequal widths of q/k and v included); all-to-all scatters each tp rank's heads
/// over cp.
impl ContextParallelLayer for crate::layers::LatentAttentionConfig {
    fn plan_context(&mut self, cp: usize, tp: usize, context: ContextParallel) -> Result<(), ConfigError> {
        self.context = context;
        let local = self.n_heads / tp.max(1);
        match cp > 1 && context == ContextParallel::AllToAll && !local.is_multiple_of(cp) {
            true => Err(ConfigError::ContextHeads {
                what: "n_heads",
                heads: local,
                cp,
            }),
            false => Ok(()),
        }
    }
}
