//! The collectives of [`NcclComm`], with the [`Transport`](crate::comm::Transport) contract
//! (`[o, n, i]` payloads, dim 1): each one allocates its outputs, then hands NCCL the raw
//! buffers through [`NcclComm::run`].

use cudarc::nccl::result as nccl;

use super::{NcclComm, PendingSend, Wait, check, contiguous, nccl_op, numel};
use crate::comm::{Collective, Payload, ReduceOp, Ticket};
use crate::error::CommError;

impl NcclComm {
    /// The all-reduce, its result readable once the calling thread's stream has waited (`wait`).
    pub(crate) fn all_reduce(&self, x: Payload, op: ReduceOp, wait: Wait) -> Result<(Payload, Ticket), CommError> {
        let c = Collective::AllReduce;
        let ty = self.nccl_type(c, x.dtype())?;
        let out = self.output_like(&x, x.dims());
        let n = numel(&x);
        let ticket = self.run(c, &[&x], &[&out], wait, |comm, i, o, s| unsafe {
            // Safety: both buffers hold `n` elements of `ty` and stay alive until the wait ends.
            check(nccl::all_reduce(i[0] as _, o[0] as _, n, ty, nccl_op(op), comm, s))
        })?;
        Ok((out, ticket))
    }

    pub(crate) fn all_gather(&self, x: Payload) -> Result<Payload, CommError> {
        // NCCL gathers whole buffers; gather along dim 1 of [o, n, i] is gather along dim 0 of
        // [size, o, n, i] followed by a transpose, done on the gathered tensor.
        let c = Collective::AllGather;
        let ty = self.nccl_type(c, x.dtype())?;
        let [o, n, i] = x.dims();
        let out = self.output_like(&x, [self.size * o, n, i]);
        let count = numel(&x);
        self.run(c, &[&x], &[&out], Wait::Now, |comm, inp, outp, s| unsafe {
            // Safety: the output holds `size · count` elements.
            check(nccl::all_gather(inp[0] as _, outp[0] as _, count, ty, comm, s))
        })?;
        Ok(stacked_to_dim1(out, self.size, [o, n, i]))
    }

    /// The reduce-scatter, its result readable once the calling thread's stream has waited.
    pub(crate) fn reduce_scatter(&self, x: Payload, op: ReduceOp, wait: Wait) -> Result<(Payload, Ticket), CommError> {
        let c = Collective::ReduceScatter;
        let ty = self.nccl_type(c, x.dtype())?;
        let [o, n, i] = x.dims();
        let part = n / self.size;
        // NCCL scatters contiguous blocks: bring rank j's block of dim 1 to the front.
        let blocks = dim1_to_stacked(x, self.size, [o, part, i]);
        let out = self.output_like(&blocks, [o, part, i]);
        let count = o * part * i;
        let ticket = self.run(c, &[&blocks], &[&out], wait, |comm, inp, outp, s| unsafe {
            // Safety: the input holds `size · count` elements, the output `count`.
            check(nccl::reduce_scatter(
                inp[0] as _,
                outp[0] as _,
                count,
                ty,
                nccl_op(op),
                comm,
                s,
            ))
        })?;
        Ok((out, ticket))
    }

    pub(crate) fn all_to_all(
        &self,
        chunks: Vec<Payload>,
        recv_dims: Vec<[usize; 3]>,
    ) -> Result<Vec<Payload>, CommError> {
        let c = Collective::AllToAll;
        let ty = self.nccl_type(c, chunks[0].dtype())?;
        let outs: Vec<Payload> = recv_dims.iter().map(|&d| self.output_like(&chunks[0], d)).collect();
        let me = self.group_rank;
        let sends: Vec<&Payload> = chunks.iter().collect();
        let recvs: Vec<&Payload> = outs.iter().collect();
        let counts: Vec<(usize, usize)> = (0..self.size).map(|j| (numel(&chunks[j]), numel(&outs[j]))).collect();
        self.run(c, &sends, &recvs, Wait::Now, |comm, inp, outp, s| unsafe {
            // Safety: each send and receive buffer holds the counted elements.
            check(nccl::group_start())?;
            for (j, &(send, recv)) in counts.iter().enumerate() {
                if j == me {
                    continue;
                }
                if send > 0 {
                    check(nccl::send(inp[j] as _, send, ty, j as i32, comm, s))?;
                }
                if recv > 0 {
                    check(nccl::recv(outp[j] as _, recv, ty, j as i32, comm, s))?;
                }
            }
            check(nccl::group_end())
        })?;
        let mut outs = outs;
        outs[me] = chunks[me].clone();
        Ok(outs)
    }

    pub(crate) fn broadcast(&self, x: Payload, root: usize) -> Result<Payload, CommError> {
        let c = Collective::Broadcast;
        let ty = self.nccl_type(c, x.dtype())?;
        let out = self.output_like(&x, x.dims());
        let n = numel(&x);
        self.run(c, &[&x], &[&out], Wait::Now, |comm, i, o, s| unsafe {
            // Safety: both buffers hold `n` elements.
            check(nccl::broadcast(i[0] as _, o[0] as _, n, ty, root as i32, comm, s))
        })?;
        Ok(out)
    }

    /// Queues a send to group rank `peer`: it goes out in one NCCL group with this rank's next
    /// call, or at [`flush`](Self::flush), so a ring of sends then receives cannot deadlock.
    pub(crate) fn send(&self, x: Payload, peer: usize) -> Result<(), CommError> {
        let ty = self.nccl_type(Collective::Send, x.dtype())?;
        let send = PendingSend {
            payload: contiguous(&x),
            peer,
            ty,
        };
        self.pending.lock().expect("pending sends lock").push(send);
        Ok(())
    }

    pub(crate) fn flush(&self) -> Result<(), CommError> {
        if self.pending.lock().expect("pending sends lock").is_empty() {
            return Ok(());
        }
        self.run(Collective::Send, &[], &[], Wait::Now, |_, _, _, _| Ok(()))
            .map(|_| ())
    }

    /// Receives from group rank `peer` into a tensor shaped like `like`.
    pub(crate) fn recv(&self, like: Payload, peer: usize) -> Result<Payload, CommError> {
        let c = Collective::Recv;
        let ty = self.nccl_type(c, like.dtype())?;
        let out = self.output_like(&like, like.dims());
        let n = numel(&like);
        self.run(c, &[], &[&out], Wait::Now, |comm, _, o, s| unsafe {
            // Safety: the buffer holds `n` elements.
            check(nccl::recv(o[0] as _, n, ty, peer as i32, comm, s))
        })?;
        Ok(out)
    }
}

/// `[size·o, n, i]` (rank-major blocks) → `[o, size·n, i]`.
fn stacked_to_dim1(x: Payload, size: usize, [o, n, i]: [usize; 3]) -> Payload {
    match x {
        Payload::Float(t) => Payload::Float(t.reshape([size, o, n * i]).swap_dims(0, 1).reshape([o, size * n, i])),
        Payload::Int(t) => Payload::Int(t.reshape([size, o, n * i]).swap_dims(0, 1).reshape([o, size * n, i])),
    }
}

/// `[o, size·n, i]` → `[size·o, n, i]` (rank-major blocks), the inverse of [`stacked_to_dim1`].
fn dim1_to_stacked(x: Payload, size: usize, [o, n, i]: [usize; 3]) -> Payload {
    match x {
        Payload::Float(t) => Payload::Float(t.reshape([o, size, n * i]).swap_dims(0, 1).reshape([size * o, n, i])),
        Payload::Int(t) => Payload::Int(t.reshape([o, size, n * i]).swap_dims(0, 1).reshape([size * o, n, i])),
    }
}
