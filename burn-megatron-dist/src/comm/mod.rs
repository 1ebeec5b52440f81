//! Communicators: one [`Transport`] trait, several implementations, one front end.
//!
//! [`ProcessGroup`] is what layers and users hold. It takes tensors of any rank and kind,
//! checks that every rank of the group makes the same call (shape, dtype, arguments), reshapes
//! to the transport's rank-3 view and back, and keeps the group's call counter. A [`Transport`]
//! only moves data: the in-process one between threads, through a rendezvous; with the `cuda`
//! feature, NCCL between processes (`NcclTransport`) or between threads on GPUs of their own
//! (`NcclThreadsTransport`).

mod check;
pub mod in_process;
#[cfg(feature = "cuda")]
pub mod nccl;
mod payload;
mod process_group;
pub mod store;

pub use check::{Collective, Record};
pub use payload::Payload;
pub use process_group::{InFlight, ProcessGroup};

use std::fmt::Debug;

use crate::error::CommError;

/// How an all-reduce or reduce-scatter combines the ranks' values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    /// The mean over the group (float tensors only).
    Avg,
    Max,
}

impl ReduceOp {
    fn code(self) -> usize {
        self as usize
    }
}

/// Names a collective that may still be running on the device when its call returned
/// ([`Transport::all_reduce_deferred`]); [`Transport::wait_for`] takes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ticket(pub(crate) Option<u32>);

impl Ticket {
    /// A collective that was complete when its call returned.
    pub const DONE: Ticket = Ticket(None);
}

/// Moves payloads between the ranks of one group. Calls arrive already checked: every rank of
/// the group calls the same method, in the same order, with agreeing shapes and dtypes.
///
/// Every method gives up with [`CommError::Timeout`] or [`CommError::PeerLost`] instead of
/// waiting forever.
pub trait Transport: Send + Sync + Debug {
    /// The number of ranks in the group.
    fn size(&self) -> usize;
    /// This rank's index in the group.
    fn group_rank(&self) -> usize;
    /// A short name for errors, such as `tp[0, 1]`.
    fn label(&self) -> &str;

    /// Exchanges a small host-side record with every rank of the group: returns every rank's
    /// record, in group-rank order. The agreement checks run on this.
    fn exchange(&self, collective: Collective, seq: u64, record: Vec<u8>) -> Result<Vec<Vec<u8>>, CommError>;

    /// `[o, n, i]` → `[o, n, i]`, reduced over the group.
    fn all_reduce(&self, x: Payload, op: ReduceOp) -> Result<Payload, CommError>;
    /// [`all_reduce`](Self::all_reduce) whose result the calling thread may read on the device
    /// only after [`wait_for`](Self::wait_for) with the ticket; its other device work meanwhile
    /// runs alongside the collective (gradient buckets during backward).
    fn all_reduce_deferred(&self, x: Payload, op: ReduceOp) -> Result<(Payload, Ticket), CommError> {
        Ok((self.all_reduce(x, op)?, Ticket::DONE))
    }
    /// [`reduce_scatter`](Self::reduce_scatter), deferred as
    /// [`all_reduce_deferred`](Self::all_reduce_deferred) is.
    fn reduce_scatter_deferred(&self, x: Payload, op: ReduceOp) -> Result<(Payload, Ticket), CommError> {
        Ok((self.reduce_scatter(x, op)?, Ticket::DONE))
    }
    /// Makes the calling thread's later device work wait for the collective of `ticket`.
    fn wait_for(&self, ticket: Ticket) -> Result<(), CommError> {
        debug_assert_eq!(
            ticket,
            Ticket::DONE,
            "this transport completes every call before returning"
        );
        Ok(())
    }
    /// `[o, n, i]` → `[o, size·n, i]`, the ranks' tensors in group-rank order.
    fn all_gather(&self, x: Payload) -> Result<Payload, CommError>;
    /// `[o, size·n, i]` → `[o, n, i]`: this rank's part of the reduction.
    fn reduce_scatter(&self, x: Payload, op: ReduceOp) -> Result<Payload, CommError>;
    /// `[o, Σ send, i]` → `[o, Σ recv, i]`: sends `send[j]` consecutive entries of dim 1 to
    /// group rank `j`, and lays what each rank sent here out in group-rank order, one buffer
    /// (`recv[j]` entries from rank `j`). Sizes may differ (MoE token routing) or be zero.
    fn all_to_all(&self, x: Payload, send: &[usize], recv: &[usize]) -> Result<Payload, CommError>;
    /// The root's tensor, on every rank.
    fn broadcast(&self, x: Payload, root: usize) -> Result<Payload, CommError>;
    /// Sends to one group rank. It may return before the data has left: a transport that
    /// defers it posts it with this rank's next call on the group, or at [`flush`](Self::flush).
    fn send(&self, x: Payload, peer: usize, seq: u64) -> Result<(), CommError>;
    /// Posts every deferred send now.
    fn flush(&self) -> Result<(), CommError> {
        Ok(())
    }
    /// Receives from one group rank into a tensor shaped like `like`.
    fn recv(&self, like: Payload, peer: usize, seq: u64) -> Result<Payload, CommError>;
}
