//! CubeCL kernels for burn-megatron's hot paths, each a Burn backend extension in a folder of its
//! own: the op and its backward (`mod.rs`), its CPU twin in plain tensor ops (`reference.rs`: the
//! CPU path and the kernels' test oracle) and its CUDA kernel (`kernel.rs`, with the `cuda`
//! feature). What the CUDA kernels share — launch helpers, block reductions, the Hopper pieces
//! (mbarriers, TMA, the `wgmma` GEMM) and their PTX — lives in [`cuda`].
//!
//! ```
//! use burn::tensor::{Device, Distribution, Tensor};
//! use burn_megatron_kernels::swiglu::swiglu;
//!
//! let device = Device::flex();
//! let a = Tensor::<2>::random([4, 8], Distribution::Normal(0.0, 1.0), &device);
//! let b = Tensor::<2>::random([4, 8], Distribution::Normal(0.0, 1.0), &device);
//! let y = swiglu(a, b); // `silu(a) ∘ b`: one fused kernel each way on CUDA
//! assert_eq!(y.dims(), [4, 8]);
//! ```
//!
//! The ops, by what they serve:
//! - products: [`gemm`] (the linear layers' product, [`Gemm`] naming which kernel runs: our
//!   Hopper `wgmma` GEMM, Burn's matmul, or a low-precision recipe), [`grouped_gemm`] (a mixture
//!   of experts' grouped product), [`gated_mlp`] (a SwiGLU MLP's products with the SwiGLU in the
//!   GEMM's epilogue);
//! - a Llama block's row and elementwise ops: [`rms_norm`] (with the links that let its backward
//!   add the residual stream's gradient), [`rope`], [`swiglu`], [`attention`] (flash attention
//!   forward and backward);
//! - the loss and the embedding: [`cross_entropy`] (vocab-parallel sums), [`embedding`];
//! - a mixture of experts' routing: [`router`], [`top_k`], [`order`], [`rows`];
//! - the optimizer: [`adamw`], [`grad_norm`];
//! - low precision: [`quant`] (FP8/FP4 formats, scalings, recipes and the quantized product);
//! - generation: [`decode`] (one decoding step against a KV cache), [`cuda::graph`] (a step
//!   captured into a CUDA graph);
//! - [`failures`]: what CubeCL reports only to a logger, as a typed error.
//!
//! `docs/kernels.md` describes each kernel and what it measures.

// `extension!` walks each op's signatures a token at a time: a deep but bounded recursion.
#![recursion_limit = "512"]

#[macro_use]
mod extension;

pub mod adamw;
pub mod attention;
pub mod cross_entropy;
pub mod cuda;
pub mod decode;
pub mod embedding;
pub mod failures;
pub mod gated_mlp;
pub mod gemm;
pub mod grad_norm;
pub mod grouped_gemm;
pub mod memory;
pub mod order;
pub mod quant;
pub mod rms_norm;
pub mod rope;
pub mod router;
pub mod rows;
pub mod swiglu;
pub mod top_k;

pub use gemm::{Gemm, gemm, linear, linear_onto, linear_over, linear_rotated};
