//! CubeCL kernels for burn-megatron's hot paths, each as a Burn backend extension beside its
//! reference twin (plain tensor ops, the test oracle and the CPU path).
//!
//! - [`linear`]: the linear layers' matrix product as a backend extension with its backward,
//!   running the fastest measured routine on CUDA.
//! - [`gemm`] (CUDA): every matrix-multiply routine of cubek, callable by name on Burn tensors,
//!   to measure them against cuBLAS and to pick the best for each linear's shapes.
//!
//! The fused RMSNorm / RoPE / SwiGLU / cross-entropy, flash attention and fused AdamW kernels
//! are still to come (the GPU performance issue).

pub mod adamw;
pub mod attention;
#[cfg(feature = "cuda")]
mod elementwise;
#[cfg(feature = "cuda")]
pub mod gemm;
#[cfg(feature = "cuda")]
mod hopper;
pub mod linear;
#[cfg(feature = "cuda")]
mod norm_kernels;
pub mod rms_norm;
pub mod rope;
pub mod swiglu;
#[cfg(feature = "cuda")]
pub mod wgmma;

pub use linear::{gemm, linear};
