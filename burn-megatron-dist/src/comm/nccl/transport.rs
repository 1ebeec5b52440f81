//! The one-process-a-GPU transport: an [`NcclComm`] for the data, the rendezvous
//! [store](crate::comm::store) for everything on the host.
//!
//! Global rank 0 serves the store at `MASTER_ADDR:MASTER_PORT`. Each group's NCCL unique id,
//! every call's agreement record and every send's header go through it, so a missing rank is
//! caught on the host, by name, before any NCCL call is made.

use std::sync::Arc;
use std::time::Duration;

use burn::tensor::Device;

use super::{NcclComm, Wait, unique_id};
use crate::comm::store::StoreClient;
use crate::comm::{Collective, Payload, ReduceOp, Ticket, Transport};
use crate::error::CommError;

/// One rank's NCCL communicator for one group, met through the store.
pub struct NcclTransport {
    comm: NcclComm,
    /// Prefix of this group's keys in the store.
    namespace: String,
    size: usize,
    store: Arc<StoreClient>,
    timeout: Duration,
}

impl std::fmt::Debug for NcclTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclTransport({:?})", self.comm)
    }
}

impl NcclTransport {
    /// Joins the group `members` (global ranks) as `global_rank`: its first member puts the
    /// NCCL id in the store, the others read it there.
    pub(super) fn join(
        label: String,
        namespace: String,
        members: &[usize],
        global_rank: usize,
        store: &Arc<StoreClient>,
        device: &Device,
        timeout: Duration,
    ) -> Result<Self, CommError> {
        let size = members.len();
        let group_rank = members
            .iter()
            .position(|&r| r == global_rank)
            .expect("member of its group");
        let key = format!("{namespace}/nccl-id");
        let fail = |e: std::io::Error| CommError::Transport {
            group: label.clone(),
            collective: "init",
            detail: e.to_string(),
        };
        let id = if group_rank == 0 {
            let id = unique_id()?;
            store.set(&key, &id, (size - 1) as u32).map_err(fail)?;
            id
        } else {
            store
                .get(&key, timeout)
                .map_err(fail)?
                .ok_or_else(|| CommError::Timeout {
                    group: label.clone(),
                    collective: "init",
                    seq: 0,
                    timeout,
                    missing: vec![0],
                })?
        };
        let comm = NcclComm::join(label, size, group_rank, &id, device, timeout)?;
        Ok(Self {
            comm,
            namespace,
            size,
            store: store.clone(),
            timeout,
        })
    }

    fn store_error(&self, collective: Collective, error: std::io::Error) -> CommError {
        CommError::Transport {
            group: self.comm.label().to_string(),
            collective: collective.name(),
            detail: error.to_string(),
        }
    }

    /// The header a send leaves in the store for its receiver to check.
    fn header(x: &Payload) -> String {
        format!("{:?} {:?} {}", x.dtype(), x.dims(), x.is_float())
    }
}

impl Transport for NcclTransport {
    fn size(&self) -> usize {
        self.size
    }

    fn group_rank(&self) -> usize {
        self.comm.group_rank()
    }

    fn label(&self) -> &str {
        self.comm.label()
    }

    /// One round trip to the store, which answers once every rank's record is there.
    fn exchange(&self, collective: Collective, seq: u64, record: Vec<u8>) -> Result<Vec<Vec<u8>>, CommError> {
        let key = format!("{}/check/{seq}", self.namespace);
        let gathered = self
            .store
            .gather(&key, self.group_rank(), self.size, &record, self.timeout)
            .map_err(|e| self.store_error(collective, e))?;
        gathered.map_err(|missing| CommError::Timeout {
            group: self.label().to_string(),
            collective: collective.name(),
            seq,
            timeout: self.timeout,
            missing,
        })
    }

    fn all_reduce(&self, x: Payload, op: ReduceOp) -> Result<Payload, CommError> {
        self.comm.all_reduce(x, op, Wait::Now).map(|(out, _)| out)
    }

    fn all_reduce_deferred(&self, x: Payload, op: ReduceOp) -> Result<(Payload, Ticket), CommError> {
        self.comm.all_reduce(x, op, Wait::Later)
    }

    fn reduce_scatter_deferred(&self, x: Payload, op: ReduceOp) -> Result<(Payload, Ticket), CommError> {
        self.comm.reduce_scatter(x, op, Wait::Later)
    }

    fn wait_for(&self, ticket: Ticket) -> Result<(), CommError> {
        self.comm.wait_for(ticket)
    }

    fn all_gather(&self, x: Payload) -> Result<Payload, CommError> {
        self.comm.all_gather(x)
    }

    fn reduce_scatter(&self, x: Payload, op: ReduceOp) -> Result<Payload, CommError> {
        self.comm.reduce_scatter(x, op, Wait::Now).map(|(out, _)| out)
    }

    fn all_to_all(&self, x: Payload, send: &[usize], recv: &[usize]) -> Result<Payload, CommError> {
        self.comm.all_to_all(x, send, recv)
    }

    fn broadcast(&self, x: Payload, root: usize) -> Result<Payload, CommError> {
        self.comm.broadcast(x, root)
    }

    fn send(&self, x: Payload, peer: usize, seq: u64) -> Result<(), CommError> {
        let key = format!("{}/p2p/{}-{peer}/{seq}", self.namespace, self.group_rank());
        self.store
            .set(&key, Self::header(&x).as_bytes(), 1)
            .map_err(|e| self.store_error(Collective::Send, e))?;
        self.comm.send(x, peer)
    }

    fn flush(&self) -> Result<(), CommError> {
        self.comm.flush()
    }

    fn recv(&self, like: Payload, peer: usize, seq: u64) -> Result<Payload, CommError> {
        let c = Collective::Recv;
        let key = format!("{}/p2p/{peer}-{}/{seq}", self.namespace, self.group_rank());
        let header = self
            .store
            .get(&key, self.timeout)
            .map_err(|e| self.store_error(c, e))?
            .ok_or_else(|| CommError::Timeout {
                group: self.label().to_string(),
                collective: c.name(),
                seq,
                timeout: self.timeout,
                missing: vec![peer],
            })?;
        let (header, expected) = (String::from_utf8_lossy(&header).into_owned(), Self::header(&like));
        if header != expected {
            let detail = format!("group rank {peer} sent {header} but this rank expects {expected}");
            return Err(CommError::Mismatch {
                group: self.label().to_string(),
                collective: c.name(),
                seq,
                detail,
            });
        }
        self.comm.recv(like, peer)
    }
}
