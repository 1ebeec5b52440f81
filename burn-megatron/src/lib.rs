//! burn-megatron: Megatron Core's parallelism as Burn modules.
//!
//! - [`plan`]: the parallel plan, one room a dimension (tensor with sequence parallelism built;
//!   context, expert and pipeline refused by name until built), applied to a model's config.
//! - [`precision`]: precision policies (dtype, each linear's GEMM, master weights), the FP8/FP4
//!   training recipes and post-training quantization (`precision::ptq`).
//! - [`layers`]: column/row-parallel linears, the vocabulary-parallel embedding and
//!   cross-entropy, attention, the SwiGLU MLP and a sequence-parallel RMSNorm.
//! - [`models::llama`]: a Llama model built from them, and its layer table.
//! - [`optim`]: AdamW with fp32 master weights, bucketed gradient averaging and ZeRO-1.
//! - [`checkpoint`]: sharded checkpoints that reshard on load.
//! - [`recompute`]: activation recomputation (full blocks or selective regions).
//! - [`prune`] and [`distill`]: Minitron-style structured pruning and knowledge distillation.
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
pub mod distill;
pub mod error;
pub mod init;
pub mod layers;
pub mod models;
pub mod optim;
pub mod params;
pub mod plan;
pub mod precision;
pub mod prune;
pub mod recompute;
#[cfg(feature = "learner")]
pub mod train;

pub use error::{ConfigError, LayerError};
