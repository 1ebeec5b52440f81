//! The collectives of [`NcclComm`], with the [`Transport`](crate::comm::Transport) contract
//! (`[o, n, i]` payloads, dim 1): each one allocates its outputs, then hands NCCL the raw
//! buffers through [`NcclComm::run`].

use cudarc::nccl::result as nccl;

use super::{NcclComm, PendingSend, Wait, check, contiguous, nccl_op, numel};
use crate::comm::payload::split_points;
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

    /// `[o, Σ send, i]` → `[o, Σ recv, i]` in one output buffer: each rank's entries are
    /// received straight into their place by grouped sends and receives, this rank's own part
    /// included (NCCL copies it), so nothing is concatenated after. With `o > 1` an entry of
    /// dim 1 is not one run of memory: the input is laid out `[Σ send, o, i]` first and the
    /// output, received that way, is viewed back.
    pub(crate) fn all_to_all(&self, x: Payload, send: &[usize], recv: &[usize]) -> Result<Payload, CommError> {
        let c = Collective::AllToAll;
        let ty = self.nccl_type(c, x.dtype())?;
        let [o, _, i] = x.dims();
        let total = recv.iter().sum();
        let (x, out) = match o {
            1 => {
                let out = self.output_like(&x, [1, total, i]);
                (x, out)
            }
            _ => {
                let out = self.output_like(&x, [total, o, i]);
                (x.swap_outer(), out)
            }
        };
        // Elements, and bytes, an entry of dim 1.
        let unit = o * i;
        let entry_bytes = (unit * x.dtype().size()) as u64;
        let offsets =
            |sizes: &[usize]| -> Vec<u64> { split_points(sizes).map(|r| r.start as u64 * entry_bytes).collect() };
        let (send_at, recv_at) = (offsets(send), offsets(recv));
        // An empty side has no buffer to hand NCCL (and posts nothing).
        let inputs: Vec<&Payload> = [&x].into_iter().filter(|p| numel(p) > 0).collect();
        let outputs: Vec<&Payload> = [&out].into_iter().filter(|p| numel(p) > 0).collect();
        self.run(c, &inputs, &outputs, Wait::Now, |comm, inp, outp, s| unsafe {
            // Safety: rank j's part starts `send_at[j]` bytes into the input (`recv_at[j]` into the
            // output) and holds `send[j]` (`recv[j]`) entries of `unit` elements; a side with no
            // entries posts nothing, so an empty buffer's missing pointer is never read.
            check(nccl::group_start())?;
            let posted = (0..self.size).try_for_each(|j| {
                let (sent, received) = (send[j] * unit, recv[j] * unit);
                if sent > 0 {
                    check(nccl::send((inp[0] + send_at[j]) as _, sent, ty, j as i32, comm, s))?;
                }
                if received > 0 {
                    check(nccl::recv((outp[0] + recv_at[j]) as _, received, ty, j as i32, comm, s))?;
                }
                Ok(())
            });
            // The group is closed whatever happened inside it.
            posted.and(check(nccl::group_end()))
        })?;
        Ok(match o {
            1 => out,
            _ => out.swap_outer(),
        })
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
