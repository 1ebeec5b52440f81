//! Typed errors of the collectives and of the launch (the mesh's are [`crate::mesh::MeshError`]).

use std::time::Duration;

use crate::mesh::MeshError;

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
