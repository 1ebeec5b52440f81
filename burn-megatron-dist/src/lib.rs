//! Who talks to whom, and how: the process mesh, communicators, differentiable collectives and
//! the launcher of burn-megatron.
//!
//! ```
//! use burn::tensor::{Device, Tensor};
//! use burn_megatron_dist::{ParallelDims, ReduceOp, launch};
//!
//! // Four ranks as threads, tp 2 × dp 2: each sums its rank over its tensor-parallel group.
//! let sums = launch(ParallelDims::tp_dp(2, 2), |_| Device::flex(), |ctx| {
//!     let mine = Tensor::<1>::from_floats([ctx.global_rank as f32], &ctx.device);
//!     ctx.groups.tp.all_reduce(mine, ReduceOp::Sum).unwrap().into_scalar::<f32>()
//! })
//! .unwrap();
//! assert_eq!(sums, [1.0, 1.0, 5.0, 5.0]); // ranks 0+1 and 2+3: tp is the fastest axis
//! ```
//!
//! - [`mesh`]: [`ParallelDims`] and the rank grid, in Megatron's order.
//! - [`groups`]: the [`ProcessGroups`] of one rank, built from the mesh.
//! - [`comm`]: the [`ProcessGroup`] front end and its transports (in-process threads; NCCL).
//! - [`mappings`]: collectives as autodiff ops, each forward paired with its backward.
//! - [`launch`](mod@launch): run a closure on every rank, as threads or as one process a GPU.

pub mod comm;
pub mod error;
pub mod groups;
pub mod launch;
pub mod mappings;
pub mod mesh;

pub use comm::{InFlight, ProcessGroup, ReduceOp};
pub use error::{CommError, LaunchError};
pub use groups::ProcessGroups;
pub use launch::{RankContext, launch};
pub use mesh::{Axis, Coordinates, ExpertCoordinates, MeshError, ParallelDims};
