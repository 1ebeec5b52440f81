//! CubeCL kernels for burn-megatron's hot paths, each as a Burn backend extension beside its
//! reference twin (plain tensor ops, the test oracle and the CPU path).
//!
//! - [`linear`]: the linear layers' matrix product with its backward, the [`Gemm`] each layer's
//!   configuration names: on CUDA our Hopper GEMM, [`wgmma`] (`wgmma` + TMA through inline PTX;
//!   the shared pieces in `hopper`), with Burn's matmul as the fallback.
//! - [`attention`]: flash attention forward and backward (no O(s²) memory).
//! - [`rms_norm`], [`swiglu`], [`rope`]: the fused row and elementwise ops of a Llama block.
//! - [`cross_entropy`]: the full-vocabulary sums of (vocab-parallel) cross-entropy and their
//!   backward, on the logits in their dtype.
//! - [`adamw`]: one AdamW update a parameter in one kernel.
//!
//! `docs/perf/kernels.md` describes each and what it measured.

pub mod adamw;
pub mod attention;
pub mod cross_entropy;
#[cfg(feature = "cuda")]
mod elementwise;
#[cfg(feature = "cuda")]
mod hopper;
pub mod linear;
pub mod rms_norm;
pub mod rope;
#[cfg(feature = "cuda")]
mod row_kernels;
pub mod swiglu;
#[cfg(feature = "cuda")]
pub mod wgmma;
#[cfg(any(feature = "cuda", test))]
mod wgmma_ptx;

pub use linear::{Gemm, gemm, linear};
