//! The collectives of [`NcclTransport`]: each one allocates its outputs, then hands NCCL the
//! raw buffers through [`NcclTransport::run`].

use std::time::{Duration, Instant};

use cudarc::nccl::result as nccl;

use super::{NcclTransport, PendingSend, check, contiguous, nccl_op, numel};
use crate::comm::{Collective, Payload, ReduceOp, Transport};
use crate::error::CommError;

impl Transport for NcclTransport {
    fn size(&self) -> usize {
        self.size
    }

    fn group_rank(&self) -> usize {
        self.group_rank
    }

    fn label(&self) -> &str {
        &self.label
    }

    fn exchange(&self, collective: Collective, seq: u64, record: Vec<u8>) -> Result<Vec<Vec<u8>>, CommError> {
        let key = |r: usize| format!("{}/check/{seq}/{r}", self.namespace);
        let fail = |e: std::io::Error| self.error(collective, e);
        self.store.set(&key(self.group_rank), &record, (self.size - 1) as u32).map_err(fail)?;
        let deadline = Instant::now() + self.timeout;
        let mut records = Vec::with_capacity(self.size);
        for r in 0..self.size {
            if r == self.group_rank {
                records.push(record.clone());
                continue;
            }
            let wait = deadline.saturating_duration_since(Instant::now());
            match self.store.get(&key(r), wait).map_err(fail)? {
                Some(bytes) => records.push(bytes),
                None => {
                    let missing = (r..self.size)
                        .filter(|&j| j != self.group_rank)
                        .filter(|&j| j == r || matches!(self.store.get(&key(j), Duration::ZERO), Ok(None)))
                        .collect();
                    return Err(CommError::Timeout {
                        group: self.label.clone(),
                        collective: collective.name(),
                        seq,
                        timeout: self.timeout,
                        missing,
                    });
                }
            }
        }
        Ok(records)
    }

    fn all_reduce(&self, x: Payload, op: ReduceOp) -> Result<Payload, CommError> {
        let c = Collective::AllReduce;
        let ty = self.nccl_type(c, x.dtype())?;
        let out = self.output_like(&x, x.dims());
        let n = numel(&x);
        self.run(c, &[&x], &[&out], |comm, i, o, s| unsafe {
            // Safety: both buffers hold `n` elements of `ty` and stay alive until the wait ends.
            check(nccl::all_reduce(i[0] as _, o[0] as _, n, ty, nccl_op(op), comm, s))
        })?;
        Ok(out)
    }

    fn all_gather(&self, x: Payload) -> Result<Payload, CommError> {
        // NCCL gathers whole buffers; gather along dim 1 of [o, n, i] is gather along dim 0 of
        // [size, o, n, i] followed by a transpose, done on the gathered tensor.
        let c = Collective::AllGather;
        let ty = self.nccl_type(c, x.dtype())?;
        let [o, n, i] = x.dims();
        let out = self.output_like(&x, [self.size * o, n, i]);
        let count = numel(&x);
        self.run(c, &[&x], &[&out], |comm, inp, outp, s| unsafe {
            // Safety: the output holds `size · count` elements.
            check(nccl::all_gather(inp[0] as _, outp[0] as _, count, ty, comm, s))
        })?;
        Ok(stacked_to_dim1(out, self.size, [o, n, i]))
    }

    fn reduce_scatter(&self, x: Payload, op: ReduceOp) -> Result<Payload, CommError> {
        let c = Collective::ReduceScatter;
        let ty = self.nccl_type(c, x.dtype())?;
        let [o, n, i] = x.dims();
        let part = n / self.size;
        // NCCL scatters contiguous blocks: bring rank j's block of dim 1 to the front.
        let blocks = dim1_to_stacked(x, self.size, [o, part, i]);
        let out = self.output_like(&blocks, [o, part, i]);
        let count = o * part * i;
        self.run(c, &[&blocks], &[&out], |comm, inp, outp, s| unsafe {
            // Safety: the input holds `size · count` elements, the output `count`.
            check(nccl::reduce_scatter(inp[0] as _, outp[0] as _, count, ty, nccl_op(op), comm, s))
        })?;
        Ok(out)
    }

    fn all_to_all(&self, chunks: Vec<Payload>, recv_dims: Vec<[usize; 3]>) -> Result<Vec<Payload>, CommError> {
        let c = Collective::AllToAll;
        let ty = self.nccl_type(c, chunks[0].dtype())?;
        let outs: Vec<Payload> = recv_dims.iter().map(|&d| self.output_like(&chunks[0], d)).collect();
        let me = self.group_rank;
        let sends: Vec<&Payload> = chunks.iter().collect();
        let recvs: Vec<&Payload> = outs.iter().collect();
        let counts: Vec<(usize, usize)> = (0..self.size).map(|j| (numel(&chunks[j]), numel(&outs[j]))).collect();
        self.run(c, &sends, &recvs, |comm, inp, outp, s| unsafe {
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

    fn broadcast(&self, x: Payload, root: usize) -> Result<Payload, CommError> {
        let c = Collective::Broadcast;
        let ty = self.nccl_type(c, x.dtype())?;
        let out = self.output_like(&x, x.dims());
        let n = numel(&x);
        self.run(c, &[&x], &[&out], |comm, i, o, s| unsafe {
            // Safety: both buffers hold `n` elements.
            check(nccl::broadcast(i[0] as _, o[0] as _, n, ty, root as i32, comm, s))
        })?;
        Ok(out)
    }

    fn send(&self, x: Payload, peer: usize, seq: u64) -> Result<(), CommError> {
        let c = Collective::Send;
        let ty = self.nccl_type(c, x.dtype())?;
        let header = format!("{:?} {:?} {}", x.dtype(), x.dims(), x.is_float());
        let key = format!("{}/p2p/{}-{peer}/{seq}", self.namespace, self.group_rank);
        self.store.set(&key, header.as_bytes(), 1).map_err(|e| self.error(c, e))?;
        let send = PendingSend { payload: contiguous(&x), peer, ty };
        self.pending.lock().expect("pending sends lock").push(send);
        Ok(())
    }

    fn flush(&self) -> Result<(), CommError> {
        if self.pending.lock().expect("pending sends lock").is_empty() {
            return Ok(());
        }
        self.run(Collective::Send, &[], &[], |_, _, _, _| Ok(()))
    }

    fn recv(&self, like: Payload, peer: usize, seq: u64) -> Result<Payload, CommError> {
        let c = Collective::Recv;
        let ty = self.nccl_type(c, like.dtype())?;
        let expected = format!("{:?} {:?} {}", like.dtype(), like.dims(), like.is_float());
        let key = format!("{}/p2p/{peer}-{}/{seq}", self.namespace, self.group_rank);
        let header = self.store.get(&key, self.timeout).map_err(|e| self.error(c, e))?.ok_or_else(|| {
            CommError::Timeout { group: self.label.clone(), collective: c.name(), seq, timeout: self.timeout, missing: vec![peer] }
        })?;
        let header = String::from_utf8_lossy(&header).into_owned();
        if header != expected {
            let detail = format!("group rank {peer} sent {header} but this rank expects {expected}");
            return Err(CommError::Mismatch { group: self.label.clone(), collective: c.name(), seq, detail });
        }
        let out = self.output_like(&like, like.dims());
        let n = numel(&like);
        self.run(c, &[], &[&out], |comm, _, o, s| unsafe {
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
