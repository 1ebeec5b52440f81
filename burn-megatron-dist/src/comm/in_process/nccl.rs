//! NCCL for ranks as threads: a group whose ranks each drive a GPU of their own runs its data
//! through an [`NcclComm`], ordered on the GPU, instead of through the rendezvous.
//!
//! The communicator is made at the group's first collective on CUDA tensors, where every rank
//! of the group is present: the ranks meet once more to compare devices and take group rank 0's
//! NCCL id. Ranks sharing a GPU (NCCL refuses that) keep the rendezvous path.

use super::{InProcessTransport, Value};
use crate::comm::nccl::{NcclComm, cuda_index, unique_id};
use crate::comm::{Collective, Payload};
use crate::error::CommError;

impl InProcessTransport {
    /// The group's NCCL communicator for `x`, made on the first collective that needs it; `None`
    /// when `x` is not on CUDA or the group's ranks do not each have a GPU of their own.
    pub(super) fn nccl(&self, collective: Collective, x: &Payload) -> Result<Option<&NcclComm>, CommError> {
        let device = x.device();
        let Some(index) = cuda_index(&device) else { return Ok(None) };
        if let Some(comm) = self.nccl.get() {
            return Ok(comm.as_ref().filter(|c| c.device() == &device));
        }
        let id = match self.group_rank {
            0 => unique_id()?,
            _ => Vec::new(),
        };
        let mut record = (index as u64).to_le_bytes().to_vec();
        record.extend(id);
        let records: Vec<Vec<u8>> = self
            .meet_data(collective, Value::Bytes(record))?
            .into_iter()
            .map(|v| match v {
                Value::Bytes(b) => b,
                other => panic!("expected a device record, got {other:?}"),
            })
            .collect();
        let indices: Vec<[u8; 8]> = records.iter().map(|r| r[..8].try_into().expect("8-byte index")).collect();
        let distinct = indices.iter().enumerate().all(|(i, a)| indices[..i].iter().all(|b| b != a));
        let comm = match distinct {
            true => {
                let (label, size) = (self.shared.label.clone(), self.shared.size);
                let timeout = self.shared.world.timeout;
                Some(NcclComm::join(label, size, self.group_rank, &records[0][8..], &device, timeout)?)
            }
            false => None,
        };
        let _ = self.nccl.set(comm);
        Ok(self.nccl_if_joined(x))
    }

    /// The communicator for `x` if the group already has one: point-to-point calls, which not
    /// every rank of the group makes, never create it.
    pub(super) fn nccl_if_joined(&self, x: &Payload) -> Option<&NcclComm> {
        self.nccl.get()?.as_ref().filter(|c| c.device() == &x.device())
    }
}
