//! Who talks to whom, and how: the process mesh, communicators, differentiable collectives and
//! the launcher of burn-megatron.
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
