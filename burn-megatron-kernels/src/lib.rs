//! CubeCL kernels for burn-megatron's hot paths, each as a Burn backend extension beside its
//! reference twin (plain tensor ops, the test oracle and the CPU path).
//!
//! - [`linear`]: the linear layers' matrix product with its backward, the [`Gemm`] each layer's
//!   configuration names: on CUDA our Hopper GEMM, [`wgmma`] (`wgmma` + TMA through inline PTX;
//!   the shared pieces in `hopper`), with Burn's matmul as the fallback.
//! - [`attention`]: flash attention forward and backward (no O(s²) memory).
//! - [`f32_matmul`]: f32 products kept in f32 on CUDA, where Burn's matmul would round to TF32.
//! - [`grouped`]: a mixture of experts' grouped product (one weight a group of rows) and its
//!   backward; on CUDA one launch of the wgmma GEMM's grouped variant.
//! - [`rms_norm`], [`swiglu`], [`rope`]: the fused row and elementwise ops of a Llama block;
//!   [`gated`]: a SwiGLU MLP's gate and up products with the SwiGLU in one GEMM.
//! - [`decode`]: one decoding step's KV-cache append and attention, with the position on the
//!   device; [`graph`]: such a step captured into a CUDA graph and replayed.
//! - [`embedding`]: token embedding lookups with ids outside the table reading zero rows (a
//!   vocabulary-parallel rank's), and a gradient that sorts the positions by token.
//! - [`rows`]: row gathers whose gradient is a gather, and the weighted sum of each token's
//!   expert outputs (a mixture of experts' permutations).
//! - [`order`]: a mixture of experts' dispatch order (copies by expert, fillers to the grouped
//!   product's tile), decided where the routing's ids are.
//! - [`router`]: a mixture of experts' router product in f32 (few experts: skinny products).
//! - [`top_k`]: each row's k highest columns, ties to the lower index on every device (a
//!   mixture of experts' routing choice).
//! - [`cross_entropy`]: the full-vocabulary sums of (vocab-parallel) cross-entropy and their
//!   backward, on the logits in their dtype.
//! - [`adamw`]: one AdamW update a parameter in one kernel (of fp32 master weights too, writing
//!   the model's copy in the same pass); [`norm`]: the sum of squares of a global gradient norm.
//!
//! `docs/perf/kernels.md` describes each and what it measured.

pub mod adamw;
#[cfg(feature = "cuda")]
mod amax_kernels;
pub mod attention;
pub mod cross_entropy;
pub mod decode;
#[cfg(feature = "cuda")]
mod decode_kernels;
#[cfg(feature = "cuda")]
mod elementwise;
pub mod embedding;
#[cfg(feature = "cuda")]
mod embedding_kernels;
pub mod f32_matmul;
pub mod failures;
pub mod gated;
pub mod graph;
pub mod grouped;
#[cfg(feature = "cuda")]
mod grouped_kernel;
#[cfg(feature = "cuda")]
mod hopper;
#[cfg(feature = "cuda")]
mod known_amax;
pub mod linear;
#[cfg(any(feature = "cuda", test))]
mod mma_ptx;
pub mod norm;
pub mod norm_link;
#[cfg(feature = "cuda")]
mod optim_kernels;
pub mod order;
#[cfg(feature = "cuda")]
mod order_kernel;
pub mod quant;
#[cfg(feature = "cuda")]
mod quant_blocks;
#[cfg(feature = "cuda")]
mod quant_emulated;
#[cfg(feature = "cuda")]
mod quant_kernels;
pub mod rms_norm;
pub mod rope;
pub mod router;
#[cfg(feature = "cuda")]
mod router_kernels;
#[cfg(feature = "cuda")]
mod row_kernels;
pub mod rows;
#[cfg(feature = "cuda")]
mod rows_kernels;
#[cfg(feature = "cuda")]
mod skinny;
pub mod swiglu;
pub mod top_k;
#[cfg(feature = "cuda")]
pub mod wgmma;
#[cfg(any(feature = "cuda", test))]
mod wgmma_ptx;

pub use linear::{Gemm, gemm, linear, linear_onto, linear_over, linear_rotated};
