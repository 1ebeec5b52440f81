//! The NCCL-threads transport: ranks are threads of one process, each driving a GPU, and a
//! group whose ranks each have a GPU of their own runs its data through an [`NcclComm`],
//! ordered on the GPU.
//!
//! It is built on the [in-process transport](crate::comm::in_process), whose rendezvous it keeps
//! for what must meet on the host: the agreement checks, the meeting that makes the
//! communicator, the shapes of point-to-point messages (for the receiver's check), and the data
//! of a group whose ranks share a GPU (NCCL refuses that) or of tensors not on CUDA.
//!
//! The communicator is made at the group's first collective on CUDA tensors, where every rank
//! of the group is present: the ranks meet once more to compare devices and take group rank 0's
//! NCCL id.

use std::sync::{Mutex, OnceLock};

use burn::tensor::Device;

use super::{NcclComm, Wait, cuda_index, unique_id};
use crate::comm::in_process::{InProcessTransport, InProcessWorld};
use crate::comm::{Collective, Payload, ReduceOp, Ticket, Transport};
use crate::error::CommError;

/// One rank's handle on a group of rank threads that drive GPUs.
#[derive(Debug)]
pub struct NcclThreadsTransport {
    /// The rendezvous, and the data path where NCCL is not used.
    rendezvous: InProcessTransport,
    /// NCCL, once the group's first collective on CUDA found every rank on a GPU of its own.
    nccl: OnceLock<Option<NcclComm>>,
}

impl NcclThreadsTransport {
    /// This rank's handle on the group `members` (global ranks in group-rank order) of `world`.
    /// Every member calls this with the same `axis` and `members` to join the same group; the
    /// communicator comes later, at the first collective on CUDA.
    pub fn new(world: &InProcessWorld, axis: &str, members: &[usize], global_rank: usize) -> Self {
        let rendezvous = world.transport(axis, members, global_rank, copy_queued);
        Self {
            rendezvous,
            nccl: OnceLock::new(),
        }
    }

    /// The group's NCCL communicator for `x`, made on the first collective that needs it; `None`
    /// when `x` is not on CUDA or the group's ranks do not each have a GPU of their own.
    fn nccl(&self, collective: Collective, x: &Payload) -> Result<Option<&NcclComm>, CommError> {
        let device = x.device();
        let Some(index) = cuda_index(&device) else {
            return Ok(None);
        };
        if let Some(comm) = self.nccl.get() {
            return Ok(comm.as_ref().filter(|c| c.device() == &device));
        }
        let group_rank = self.rendezvous.group_rank();
        let id = match group_rank {
            0 => unique_id()?,
            _ => Vec::new(),
        };
        let mut record = (index as u64).to_le_bytes().to_vec();
        record.extend(id);
        let records = self.rendezvous.share(collective, record)?;
        let indices: Vec<[u8; 8]> = records
            .iter()
            .map(|r| r[..8].try_into().expect("8-byte index"))
            .collect();
        let distinct = indices
            .iter()
            .enumerate()
            .all(|(i, a)| indices[..i].iter().all(|b| b != a));
        let comm = match distinct {
            true => {
                let (label, size) = (self.rendezvous.label().to_string(), self.rendezvous.size());
                let timeout = self.rendezvous.timeout();
                Some(NcclComm::join(
                    label,
                    size,
                    group_rank,
                    &records[0][8..],
                    &device,
                    timeout,
                )?)
            }
            false => None,
        };
        let _ = self.nccl.set(comm);
        Ok(self.nccl_if_joined(x))
    }

    /// `x` on the host, for the rendezvous path of a group whose ranks share a GPU: read by this
    /// rank on its own stream, so no other rank's stream reads or outlives this rank's device
    /// memory; the collective's result is uploaded to this rank's device after. With ranks as
    /// threads on one H200, handing device tensors over (settled, then read by the receiver)
    /// left one step's averaged loss wrong in 2 of 4 runs of the MoE suite.
    /// Tensors off CUDA pass as they are.
    fn staged(x: Payload) -> Payload {
        match cuda_index(&x.device()) {
            Some(_) => x.to_device(&Device::flex()),
            None => x,
        }
    }

    /// `x` once this rank's queued work on its GPU is done, for the rendezvous path: another
    /// rank thread reads it there on its own stream, and CubeCL orders no work across the two
    /// streams (a payload still being computed was read stale on a shared H200,
    /// `comm_suite::deferred_collectives`). Tensors off CUDA pass as they are.
    fn settled(&self, collective: Collective, x: Payload) -> Result<Payload, CommError> {
        if cuda_index(&x.device()).is_some() {
            x.device().sync().map_err(|e| CommError::Transport {
                group: self.rendezvous.label().to_string(),
                collective: collective.name(),
                detail: format!("synchronizing before the rendezvous: {e:?}"),
            })?;
        }
        Ok(x)
    }

    /// The communicator for `x` if the group already has one: point-to-point calls, which not
    /// every rank of the group makes, never create it.
    fn nccl_if_joined(&self, x: &Payload) -> Option<&NcclComm> {
        self.nccl.get()?.as_ref().filter(|c| c.device() == &x.device())
    }
}

/// Copies a payload to another device for the rendezvous path: a point-to-point message before
/// the group has a communicator, or a group whose ranks share some of their GPUs.
///
/// Between two CUDA devices this is an NCCL send on one and a receive on the other, each
/// queued on its device's communication stream. Two transfers in opposite directions queued in
/// different orders on the two devices would wait for each other forever, so transfers between
/// CUDA devices are queued one at a time, process-wide: every device sees them in one order.
///
/// A peer's payload on this rank's own GPU (ranks sharing one) is copied through host memory:
/// handed over as it is, the buffer of another rank's stream would be read on this rank's and
/// then freed to the pool while that read may still be queued; another stream then reused it
/// (MoE's all-to-all on a shared H200 read another tensor's values). The synchronous read
/// leaves this rank a buffer of its own.
fn copy_queued(x: Payload, device: &Device) -> Payload {
    if &x.device() == device {
        return match cuda_index(device) {
            Some(_) => x.to_device(&Device::flex()).to_device(device),
            None => x,
        };
    }
    if cuda_index(device).is_some() && cuda_index(&x.device()).is_some() {
        static QUEUE: Mutex<()> = Mutex::new(());
        let _queued = QUEUE.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        return x.to_device(device);
    }
    x.to_device(device)
}

impl Transport for NcclThreadsTransport {
    fn size(&self) -> usize {
        self.rendezvous.size()
    }

    fn group_rank(&self) -> usize {
        self.rendezvous.group_rank()
    }

    fn label(&self) -> &str {
        self.rendezvous.label()
    }

    fn exchange(&self, collective: Collective, seq: u64, record: Vec<u8>) -> Result<Vec<Vec<u8>>, CommError> {
        self.rendezvous.exchange(collective, seq, record)
    }

    fn all_reduce(&self, x: Payload, op: ReduceOp) -> Result<Payload, CommError> {
        let (out, ticket) = self.all_reduce_deferred(x, op)?;
        self.wait_for(ticket)?;
        Ok(out)
    }

    fn all_reduce_deferred(&self, x: Payload, op: ReduceOp) -> Result<(Payload, Ticket), CommError> {
        if let Some(nccl) = self.nccl(Collective::AllReduce, &x)? {
            return nccl.all_reduce(x, op, Wait::Later);
        }
        let device = x.device();
        let (out, ticket) = self.rendezvous.all_reduce_deferred(Self::staged(x), op)?;
        Ok((out.to_device(&device), ticket))
    }

    fn wait_for(&self, ticket: Ticket) -> Result<(), CommError> {
        if let Some(Some(nccl)) = self.nccl.get() {
            return nccl.wait_for(ticket);
        }
        self.rendezvous.wait_for(ticket)
    }

    fn all_gather(&self, x: Payload) -> Result<Payload, CommError> {
        if let Some(nccl) = self.nccl(Collective::AllGather, &x)? {
            return nccl.all_gather(x);
        }
        let device = x.device();
        Ok(self.rendezvous.all_gather(Self::staged(x))?.to_device(&device))
    }

    fn reduce_scatter(&self, x: Payload, op: ReduceOp) -> Result<Payload, CommError> {
        let (out, ticket) = self.reduce_scatter_deferred(x, op)?;
        self.wait_for(ticket)?;
        Ok(out)
    }

    fn reduce_scatter_deferred(&self, x: Payload, op: ReduceOp) -> Result<(Payload, Ticket), CommError> {
        if let Some(nccl) = self.nccl(Collective::ReduceScatter, &x)? {
            return nccl.reduce_scatter(x, op, Wait::Later);
        }
        let device = x.device();
        let (out, ticket) = self.rendezvous.reduce_scatter_deferred(Self::staged(x), op)?;
        Ok((out.to_device(&device), ticket))
    }

    fn all_to_all(&self, x: Payload, send: &[usize], recv: &[usize]) -> Result<Payload, CommError> {
        if let Some(nccl) = self.nccl(Collective::AllToAll, &x)? {
            return nccl.all_to_all(x, send, recv);
        }
        let device = x.device();
        Ok(self
            .rendezvous
            .all_to_all(Self::staged(x), send, recv)?
            .to_device(&device))
    }

    fn broadcast(&self, x: Payload, root: usize) -> Result<Payload, CommError> {
        if let Some(nccl) = self.nccl(Collective::Broadcast, &x)? {
            return nccl.broadcast(x, root);
        }
        let device = x.device();
        Ok(self.rendezvous.broadcast(Self::staged(x), root)?.to_device(&device))
    }

    /// The payload goes by mail; under NCCL the mail only serves the receiver's check of its
    /// shape, and the data goes with this rank's next call on the group.
    fn send(&self, x: Payload, peer: usize, seq: u64) -> Result<(), CommError> {
        if let Some(nccl) = self.nccl_if_joined(&x) {
            nccl.send(x.clone(), peer)?;
            return self.rendezvous.send(x, peer, seq);
        }
        self.rendezvous.send(self.settled(Collective::Send, x)?, peer, seq)
    }

    fn flush(&self) -> Result<(), CommError> {
        if let Some(Some(nccl)) = self.nccl.get() {
            return nccl.flush();
        }
        self.rendezvous.flush()
    }

    fn recv(&self, like: Payload, peer: usize, seq: u64) -> Result<Payload, CommError> {
        let x = self.rendezvous.take_mail(&like, peer, seq)?;
        match self.nccl_if_joined(&like) {
            Some(nccl) => nccl.recv(like, peer),
            None => Ok(self.rendezvous.move_to(x, &like.device(), true)),
        }
    }
}
