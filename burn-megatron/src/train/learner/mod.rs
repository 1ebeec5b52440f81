//! Training with Burn's `SupervisedTraining` (the Learner): [`MegatronStrategy`] is a
//! `TrainingStrategy::Custom` that runs one rank of the mesh through the library's one training
//! step ([`Trainer`](crate::train::Trainer)) — its data-parallel slice of the data, gradients
//! reduced over dp in buckets while backward runs, and either the Learner's own optimizer or the
//! [`DistributedAdamW`](crate::optim::DistributedAdamW) (fp32 master weights, ZeRO-1,
//! global-norm clipping).
//!
//! Every rank builds its own Learner inside [`launch`](burn_megatron_dist::launch) (its layers
//! hold its shard), so Burn's metrics, checkpointers, LR schedulers and early stopping work
//! unchanged on each; ranks other than 0 render with [`Silent`]. A Llama and its pipeline
//! stages train under it as they are ([`TokenBatcher`], [`LmOutput`]).

mod llama;
mod silent;
mod strategy;

pub use llama::{LmOutput, TokenBatcher};
pub use silent::Silent;
pub use strategy::{MegatronStrategy, StrategyOptimizer};
