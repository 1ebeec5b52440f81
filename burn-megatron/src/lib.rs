//! burn-megatron: tensor and sequence parallelism as Burn modules.
//!
//! - [`layers`]: column/row-parallel linears, the vocabulary-parallel embedding and
//!   cross-entropy, attention, the SwiGLU MLP and a sequence-parallel RMSNorm.
//! - [`models::llama`]: a Llama model built from them; its plan applies TP and SP.
//! - [`init`]: deterministic, shard-aware initialization.
//!
//! The process mesh, communicators and collectives live in [`burn_megatron_dist`], re-exported
//! as [`dist`].

pub use burn_megatron_dist as dist;

// The README's examples run as doc tests.
#[doc = include_str!("../../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

pub mod checkpoint;
pub mod error;
pub mod init;
pub mod layers;
pub mod models;
pub mod optim;
#[cfg(feature = "learner")]
pub mod train;

pub use error::{ConfigError, LayerError};
