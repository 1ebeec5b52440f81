//! burn-megatron: Megatron Core's parallelism as Burn modules.
//!
//! A model's configuration is planned for a layout before `init`, and every rank builds its
//! shard inside [`launch`](dist::launch); at tp 2 the loss is tp 1's:
//!
//! ```
//! use burn::tensor::{Device, Int, Tensor};
//! use burn_megatron::dist::{ParallelDims, launch};
//! use burn_megatron::init::{InitMode, ParamInit};
//! use burn_megatron::models::llama::LlamaConfig;
//! use burn_megatron::plan::{ParallelPlan, TensorParallel};
//!
//! let loss = |dims: ParallelDims| {
//!     let plan = ParallelPlan::new(dims).with_tensor(TensorParallel::SequenceParallel);
//!     let config = plan.apply(LlamaConfig::llama(64, 32, 2, 4, 4, 64, 8), dims.world_size(), 8).unwrap();
//!     launch(dims, |_| Device::flex(), |ctx| {
//!         let model = config.init(&ctx.device, &ctx.groups, &ParamInit::new(3, InitMode::Full)).unwrap();
//!         let ids = Tensor::<2, Int>::from_ints([[1, 2, 3, 4, 5, 6, 7, 8]], &ctx.device);
//!         let targets = Tensor::<2, Int>::from_ints([[2, 3, 4, 5, 6, 7, 8, 9]], &ctx.device);
//!         model.forward_loss(ids, targets).unwrap().into_scalar::<f32>()
//!     })
//!     .unwrap()[0]
//! };
//! let (one, two) = (loss(ParallelDims::single()), loss(ParallelDims::tp_dp(2, 1)));
//! // f32 products whose partial sums the ranks add in another order: a few ulps apart.
//! assert!((one - two).abs() < 1e-5, "{one} vs {two}");
//! ```
//!
//! - [`plan`]: the parallel plan, one room a dimension (tensor and sequence, context, expert,
//!   pipeline), every rule checked before any tensor exists, applied to a model's config.
//! - [`precision`]: precision policies (dtype, each linear's GEMM, master weights), each linear's
//!   [`LinearPrecision`](precision::linear::LinearPrecision), the FP8/FP4 training recipes'
//!   state, and the schemes of post-training quantization (`precision::ptq`).
//! - [`layers`]: column/row-parallel linears, the vocabulary-parallel embedding and
//!   cross-entropy, attention (with context parallelism), the SwiGLU MLP, mixtures of experts,
//!   sequence-parallel RMSNorm and LayerNorm, learned positions, and the residual stream a
//!   pre-norm branch adds into; a Burn model's own layers swap for them (`docs/own-model.md`).
//! - [`models::llama`]: a Llama model built from them, its layer table, recipes, Hugging Face and
//!   GGUF I/O, generation.
//! - [`optim`]: AdamW with fp32 master weights, bucketed gradient averaging and ZeRO-1.
//! - [`checkpoint`]: sharded checkpoints that reshard on load.
//! - [`data`]: tokenized datasets on disk (Megatron's indexed format).
//! - [`recompute`]: activation recomputation (full blocks or selective regions).
//! - [`train`]: the pipeline's runtime, and Burn's Learner running one rank (`learner` feature).
//! - [`posttrain`]: post-training quantization, Minitron-style pruning, distillation.
//! - [`job`]: the training job a user writes (a TOML file, overridable field by field),
//!   resolved into the planned model, the plan and the batch's split.
//! - [`init`]: deterministic, shard-aware initialization.
//!
//! The process mesh, communicators and collectives live in [`burn_megatron_dist`], re-exported
//! as [`dist`].

pub use burn_megatron_dist as dist;

// The README's examples run as doc tests.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

pub mod checkpoint;
pub mod data;
pub mod error;
pub mod init;
pub mod job;
pub mod layers;
pub mod models;
pub mod optim;
pub mod params;
pub mod plan;
pub mod posttrain;
pub mod precision;
pub mod recompute;
pub mod train;

pub use error::{ConfigError, LayerError};
