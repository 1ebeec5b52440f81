//! Training: the pipeline's runtime ([`pipeline`]) and, with the `learner` feature, Burn's
//! Learner running one rank of the mesh ([`learner`]: `MegatronStrategy`, the Llama's
//! `TrainStep`).

#[cfg(feature = "learner")]
pub mod learner;
pub mod pipeline;
