//! Typed errors of the mesh and of the collectives.

use std::time::Duration;

use crate::mesh::ParallelDims;

/// A layout that cannot be built.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MeshError {
    #[error("parallel axis {axis} has size 0; every axis needs at least one rank")]
    ZeroSize { axis: &'static str },
    #[error("layout {dims:?} needs tp·cp·dp·pp = {product} ranks, but the world has {world_size}")]
    WorldSizeMismatch {
        dims: ParallelDims,
        product: usize,
        world_size: usize,
    },
    #[error(
        "ep = {ep} must divide (tp/etp)·dp·cp = {ranks}: expert layers fold ep over the data and context ranks, and the tp ranks outside an etp group"
    )]
    ExpertsDoNotDivide { ep: usize, ranks: usize },
    #[error("etp = {etp} must divide tp = {tp}: an expert's hidden features split over consecutive tp ranks")]
    ExpertTpDoesNotDivide { etp: usize, tp: usize },
}

/// A collective that failed. The same error is returned on every rank of the group whenever the
/// failure can be seen by all of them (a mismatch is checked before any data moves).
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum CommError {
    #[error("{group}: {collective} #{seq}: ranks disagree: {detail}")]
    Mismatch {
        group: String,
        collective: &'static str,
        seq: u64,
        detail: String,
    },
    #[error("{group}: {collective} #{seq} timed out after {timeout:?}: group ranks {missing:?} never arrived")]
    Timeout {
        group: String,
        collective: &'static str,
        seq: u64,
        timeout: Duration,
        missing: Vec<usize>,
    },
    #[error("{group}: {collective}: group rank {rank} is gone: {reason}")]
    PeerLost {
        group: String,
        collective: &'static str,
        rank: usize,
        reason: String,
    },
    #[error("{group}: {collective}: invalid call: {detail}")]
    InvalidArgument {
        group: String,
        collective: &'static str,
        detail: String,
    },
    #[error("{group}: {collective}: transport failure: {detail}")]
    Transport {
        group: String,
        collective: &'static str,
        detail: String,
    },
}

/// A launch that cannot start or whose ranks failed.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error(transparent)]
    Mesh(#[from] MeshError),
    #[error("environment variable {name}: {detail}")]
    Env { name: &'static str, detail: String },
    #[error("rendezvous at {address}: {detail}")]
    Rendezvous { address: String, detail: String },
    #[error("global rank {global_rank} panicked: {message}")]
    RankPanicked { global_rank: usize, message: String },
    #[error(transparent)]
    Comm(#[from] CommError),
}
