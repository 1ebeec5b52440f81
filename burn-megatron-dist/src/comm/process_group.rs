//! The front end of a communicator: tensors of any rank and kind, checked calls.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use burn::tensor::kind::Numeric;
use burn::tensor::{Float, Int, Shape, Tensor};

use super::check::{self, Collective, Record};
use super::in_process::InProcessWorld;
use super::{Payload, ReduceOp, Ticket, Transport};
use crate::error::CommError;

/// A group of ranks that run collectives together: one axis of the mesh, as seen from one rank.
///
/// Every rank of the group must call the same collectives in the same order. Each call first
/// checks, on the host, that all ranks agree on the collective, dtype, shape and arguments; a
/// disagreement is [`CommError::Mismatch`] on every rank.
#[derive(Clone)]
pub struct ProcessGroup {
    transport: Arc<dyn Transport>,
    /// Global ranks of the members, in group-rank order.
    members: Arc<[usize]>,
    seq: Arc<AtomicU64>,
    /// Point-to-point call counters, per (direction, peer).
    p2p_seq: Arc<Mutex<HashMap<(bool, usize), u64>>>,
}

impl fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ProcessGroup({} @ {})", self.label(), self.group_rank())
    }
}

impl ProcessGroup {
    /// Wraps a transport; `members` are the global ranks of the group in group-rank order.
    pub fn new(transport: Arc<dyn Transport>, members: Vec<usize>) -> Self {
        assert_eq!(transport.size(), members.len(), "one member per transport rank");
        Self {
            transport,
            members: members.into(),
            seq: Arc::default(),
            p2p_seq: Arc::default(),
        }
    }

    /// A group whose only member is this rank: every collective is the identity.
    pub fn solo() -> Self {
        InProcessWorld::new(1).group("solo", vec![0], 0)
    }

    pub fn size(&self) -> usize {
        self.members.len()
    }

    /// This rank's index in the group.
    pub fn group_rank(&self) -> usize {
        self.transport.group_rank()
    }

    /// Global ranks of the members, in group-rank order.
    pub fn members(&self) -> &[usize] {
        &self.members
    }

    pub fn label(&self) -> &str {
        self.transport.label()
    }

    /// Sums, averages or takes the maximum of `x` over the group.
    ///
    /// # Shapes
    /// `[..]` → `[..]`, the same on every rank.
    pub fn all_reduce<const D: usize, K: Numeric>(
        &self,
        x: Tensor<D, K>,
        op: ReduceOp,
    ) -> Result<Tensor<D, K>, CommError> {
        self.all_reduce_async(x, op)?.wait()
    }

    /// [`all_reduce`](Self::all_reduce) that returns while the reduction may still run on the
    /// device: this rank's later device work runs alongside it until [`InFlight::wait`] hands
    /// the result over. On NCCL, the reduction then overlaps whatever comes before the wait
    /// (a gradient bucket's, the rest of backward); other transports finish before returning.
    pub fn all_reduce_async<const D: usize, K: Numeric>(
        &self,
        x: Tensor<D, K>,
        op: ReduceOp,
    ) -> Result<InFlight<D, K>, CommError> {
        let collective = Collective::AllReduce;
        if op == ReduceOp::Avg && !x.dtype().is_float() {
            return Err(self.invalid(collective, "Avg needs a float tensor".into()));
        }
        self.agree(self.record(collective, &x, vec![op.code()]), None)?;
        if self.size() == 1 {
            return Ok(InFlight::done(x));
        }
        let (shape, autodiff) = (x.shape(), x.device().is_autodiff());
        let deferred = self.transport.all_reduce_deferred(view(x, 0), op)?;
        Ok(InFlight::deferred(deferred, shape, autodiff, &self.transport))
    }

    /// Concatenates every rank's `x` along `dim`, in group-rank order.
    ///
    /// # Shapes
    /// `[.., n, ..]` → `[.., size·n, ..]` (`n` at `dim`).
    pub fn all_gather<const D: usize, K: Numeric>(
        &self,
        x: Tensor<D, K>,
        dim: usize,
    ) -> Result<Tensor<D, K>, CommError> {
        let collective = Collective::AllGather;
        self.check_dim::<D>(collective, dim)?;
        self.agree(self.record(collective, &x, vec![dim]), None)?;
        if self.size() == 1 {
            return Ok(x);
        }
        let (mut shape, autodiff) = (x.shape(), x.device().is_autodiff());
        shape[dim] *= self.size();
        let out = self.transport.all_gather(view(x, dim))?;
        Ok(unview(out, shape, autodiff))
    }

    /// Reduces `x` over the group and keeps this rank's slice of `dim`.
    ///
    /// # Shapes
    /// `[.., size·n, ..]` → `[.., n, ..]`.
    pub fn reduce_scatter<const D: usize, K: Numeric>(
        &self,
        x: Tensor<D, K>,
        dim: usize,
        op: ReduceOp,
    ) -> Result<Tensor<D, K>, CommError> {
        self.reduce_scatter_async(x, dim, op)?.wait()
    }

    /// [`reduce_scatter`](Self::reduce_scatter), returning while it may still run on the
    /// device, as [`all_reduce_async`](Self::all_reduce_async) does.
    pub fn reduce_scatter_async<const D: usize, K: Numeric>(
        &self,
        x: Tensor<D, K>,
        dim: usize,
        op: ReduceOp,
    ) -> Result<InFlight<D, K>, CommError> {
        let collective = Collective::ReduceScatter;
        self.check_dim::<D>(collective, dim)?;
        if op == ReduceOp::Avg && !x.dtype().is_float() {
            return Err(self.invalid(collective, "Avg needs a float tensor".into()));
        }
        self.agree(self.record(collective, &x, vec![dim, op.code()]), None)?;
        let n = x.dims()[dim];
        if !n.is_multiple_of(self.size()) {
            let detail = format!("dim {dim} of size {n} does not split over {} ranks", self.size());
            return Err(self.invalid(collective, detail));
        }
        if self.size() == 1 {
            return Ok(InFlight::done(x));
        }
        let (mut shape, autodiff) = (x.shape(), x.device().is_autodiff());
        shape[dim] /= self.size();
        let deferred = self.transport.reduce_scatter_deferred(view(x, dim), op)?;
        Ok(InFlight::deferred(deferred, shape, autodiff, &self.transport))
    }

    /// Splits `split_dim` into `size` equal parts, sends part `j` to group rank `j`, and
    /// concatenates what arrives along `concat_dim` (Ulysses-style context parallelism).
    ///
    /// # Shapes
    /// `[.., size·a, .., b, ..]` → `[.., a, .., size·b, ..]`.
    pub fn all_to_all<const D: usize, K: Numeric>(
        &self,
        x: Tensor<D, K>,
        split_dim: usize,
        concat_dim: usize,
    ) -> Result<Tensor<D, K>, CommError> {
        let collective = Collective::AllToAll;
        self.check_dim::<D>(collective, split_dim)?;
        self.check_dim::<D>(collective, concat_dim)?;
        self.agree(self.record(collective, &x, vec![split_dim, concat_dim]), None)?;
        let n = x.dims()[split_dim];
        if !n.is_multiple_of(self.size()) {
            let detail = format!("dim {split_dim} of size {n} does not split over {} ranks", self.size());
            return Err(self.invalid(collective, detail));
        }
        if self.size() == 1 {
            return Ok(x);
        }
        let size = self.size();
        let mut chunk_shape = x.shape();
        chunk_shape[split_dim] /= size;
        let mut out_shape = chunk_shape.clone();
        out_shape[concat_dim] *= size;
        let m = chunk_shape.num_elements();
        let autodiff = x.device().is_autodiff();
        // Rank j's part is the j-th entry of one `[1, size, m]` buffer. Where nothing precedes
        // the split dim, the parts are consecutive memory already; otherwise one copy.
        let send = match outer(&x.shape(), split_dim) {
            1 => reshape_any(x, [1, size, m]),
            _ => {
                let part = chunk_shape[split_dim];
                let parts = (0..size)
                    .map(|j| reshape_any(x.clone().narrow(split_dim, j * part, part), [1, 1, m]))
                    .collect();
                Tensor::cat(parts, 1)
            }
        };
        let even = vec![1; size];
        let received = self.transport.all_to_all(view(send, 1), &even, &even)?;
        let received: Tensor<3, K> = unview(received, [1, size, m].into(), autodiff);
        // Rank j's part goes j-th along the concat dim: where nothing precedes it, that is the
        // buffer as it arrived; otherwise one copy.
        Ok(match outer(&out_shape, concat_dim) {
            1 => reshape_any(received, out_shape.dims::<D>()),
            _ => {
                let parts = (0..size)
                    .map(|j| reshape_any(received.clone().narrow(1, j, 1), chunk_shape.dims::<D>()))
                    .collect();
                Tensor::cat(parts, concat_dim)
            }
        })
    }

    /// Sends `send_splits[j]` consecutive entries of `dim` to group rank `j`, and concatenates
    /// what arrives along the same dim (MoE token dispatch). Returns the tensor and the number
    /// of entries that came from each rank, which is the split to send them back with.
    ///
    /// # Shapes
    /// `[.., Σ send_splits, ..]` → `[.., Σ recv_splits, ..]`.
    pub fn all_to_all_uneven<const D: usize, K: Numeric>(
        &self,
        x: Tensor<D, K>,
        dim: usize,
        send_splits: &[usize],
    ) -> Result<(Tensor<D, K>, Vec<usize>), CommError> {
        let collective = Collective::AllToAll;
        self.check_dim::<D>(collective, dim)?;
        let mut record = self.record(collective, &x, vec![dim, dim]);
        record.splits = send_splits.to_vec();
        let records = self.agree(record, Some(dim))?;
        for (j, r) in records.iter().enumerate() {
            if r.splits.len() != self.size() || r.splits.iter().sum::<usize>() != r.shape[dim] {
                let detail = format!(
                    "group rank {j} sends splits {:?} of a dim of size {}; they must be {} sizes adding up to it",
                    r.splits,
                    r.shape[dim],
                    self.size()
                );
                return Err(self.invalid(collective, detail));
            }
        }
        let me = self.group_rank();
        let recv_splits: Vec<usize> = records.iter().map(|r| r.splits[me]).collect();
        if self.size() == 1 {
            return Ok((x, recv_splits));
        }
        let mut shape = x.shape();
        shape[dim] = recv_splits.iter().sum();
        let autodiff = x.device().is_autodiff();
        let out = self.transport.all_to_all(view(x, dim), send_splits, &recv_splits)?;
        Ok((unview(out, shape, autodiff), recv_splits))
    }

    /// The root's `x`, on every rank.
    pub fn broadcast<const D: usize, K: Numeric>(
        &self,
        x: Tensor<D, K>,
        root: usize,
    ) -> Result<Tensor<D, K>, CommError> {
        let collective = Collective::Broadcast;
        if root >= self.size() {
            return Err(self.invalid(collective, format!("root {root} is not a group rank")));
        }
        self.agree(self.record(collective, &x, vec![root]), None)?;
        if self.size() == 1 {
            return Ok(x);
        }
        let (shape, autodiff) = (x.shape(), x.device().is_autodiff());
        Ok(unview(self.transport.broadcast(view(x, 0), root)?, shape, autodiff))
    }

    /// Sends `x` to group rank `peer`, which must call [`recv`](Self::recv) with the same shape.
    ///
    /// Returns at once. On NCCL the send is posted together with this rank's next call on the
    /// group (a `recv`, a collective, a barrier) or at [`flush`](Self::flush): a ring of
    /// `send` then `recv` on every rank cannot deadlock, since each pair travels as one NCCL
    /// group. A rank whose last call on the group is a `send` calls `flush`.
    pub fn send<const D: usize, K: Numeric>(&self, x: Tensor<D, K>, peer: usize) -> Result<(), CommError> {
        let seq = self.p2p(Collective::Send, peer)?;
        self.transport.send(view(x, 0), peer, seq)
    }

    /// Posts this rank's deferred sends and waits until they have left.
    pub fn flush(&self) -> Result<(), CommError> {
        self.transport.flush()
    }

    /// Receives from group rank `peer` a tensor shaped like `like` (same shape, dtype, device);
    /// a sender's tensor of another shape or dtype is [`CommError::Mismatch`].
    pub fn recv<const D: usize, K: Numeric>(&self, like: Tensor<D, K>, peer: usize) -> Result<Tensor<D, K>, CommError> {
        let seq = self.p2p(Collective::Recv, peer)?;
        let (shape, autodiff) = (like.shape(), like.device().is_autodiff());
        Ok(unview(self.transport.recv(view(like, 0), peer, seq)?, shape, autodiff))
    }

    /// Waits until every rank of the group has arrived.
    pub fn barrier(&self) -> Result<(), CommError> {
        let record = Record {
            collective: Collective::Barrier,
            dtype: String::new(),
            shape: vec![],
            args: vec![],
            splits: vec![],
        };
        self.transport.flush()?;
        self.agree(record, None).map(|_| ())
    }

    fn record<const D: usize, K: Numeric>(&self, collective: Collective, x: &Tensor<D, K>, args: Vec<usize>) -> Record {
        Record {
            collective,
            dtype: format!("{:?}", x.dtype()),
            shape: x.dims().to_vec(),
            args,
            splits: vec![],
        }
    }

    /// Exchanges the records and checks they agree; every rank reaches the same verdict.
    fn agree(&self, record: Record, varying_dim: Option<usize>) -> Result<Vec<Record>, CommError> {
        if self.size() == 1 {
            return Ok(vec![record]);
        }
        let collective = record.collective;
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let records = self
            .transport
            .exchange(collective, seq, record.encode())?
            .iter()
            .map(|bytes| Record::decode(bytes))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| CommError::Transport {
                group: self.label().to_string(),
                collective: collective.name(),
                detail: "a peer sent an unreadable call record".into(),
            })?;
        check::verify(&records, varying_dim)
            .map_err(|detail| check::mismatch(self.label(), collective, seq, detail))?;
        Ok(records)
    }

    fn p2p(&self, collective: Collective, peer: usize) -> Result<u64, CommError> {
        if peer >= self.size() || peer == self.group_rank() {
            let detail = format!("peer {peer} must be another rank of a group of {}", self.size());
            return Err(self.invalid(collective, detail));
        }
        let mut counters = self.p2p_seq.lock().expect("p2p counters");
        let seq = counters.entry((collective == Collective::Send, peer)).or_default();
        *seq += 1;
        Ok(*seq)
    }

    fn check_dim<const D: usize>(&self, collective: Collective, dim: usize) -> Result<(), CommError> {
        if dim >= D {
            return Err(self.invalid(collective, format!("dim {dim} of a rank-{D} tensor")));
        }
        Ok(())
    }

    fn invalid(&self, collective: Collective, detail: String) -> CommError {
        CommError::InvalidArgument {
            group: self.label().to_string(),
            collective: collective.name(),
            detail,
        }
    }
}

/// The result of a collective that may still be running on the device
/// ([`ProcessGroup::all_reduce_async`]). It is handed over only by [`wait`](Self::wait), which
/// orders this rank's later device work after the collective; dropped unwaited, the result is
/// simply never read.
#[must_use = "the result is only readable through `wait`"]
pub struct InFlight<const D: usize, K: Numeric = Float> {
    out: Landing<D, K>,
    /// The transport to wait on; `None` when the result was ready on return.
    wait: Option<(Arc<dyn Transport>, Ticket)>,
}

enum Landing<const D: usize, K: Numeric> {
    /// A one-rank group's input, returned as is.
    Tensor(Tensor<D, K>),
    /// The transport's output, in its rank-3 view.
    Payload {
        payload: Payload,
        shape: Shape,
        autodiff: bool,
    },
}

impl<const D: usize, K: Numeric> InFlight<D, K> {
    fn done(x: Tensor<D, K>) -> Self {
        Self {
            out: Landing::Tensor(x),
            wait: None,
        }
    }

    /// The transport's `payload` (the result's rank-3 view), landing as `shape` once `ticket`
    /// is waited for on `transport`.
    fn deferred(
        (payload, ticket): (Payload, Ticket),
        shape: Shape,
        autodiff: bool,
        transport: &Arc<dyn Transport>,
    ) -> Self {
        Self {
            out: Landing::Payload {
                payload,
                shape,
                autodiff,
            },
            wait: Some((transport.clone(), ticket)),
        }
    }

    /// The result, once this rank's later device work is ordered after the collective.
    pub fn wait(self) -> Result<Tensor<D, K>, CommError> {
        if let Some((transport, ticket)) = self.wait {
            transport.wait_for(ticket)?;
        }
        Ok(match self.out {
            Landing::Tensor(x) => x,
            Landing::Payload {
                payload,
                shape,
                autodiff,
            } => unview(payload, shape, autodiff),
        })
    }
}

/// `[outer, n, inner]` around `dim`.
fn view_dims(shape: &Shape, dim: usize) -> [usize; 3] {
    let dims = shape.as_slice();
    [outer(shape, dim), dims[dim], dims[dim + 1..].iter().product()]
}

/// The number of elements before `dim` (the product of the dims that precede it).
fn outer(shape: &Shape, dim: usize) -> usize {
    shape.as_slice()[..dim].iter().product()
}

/// The transport's rank-3 view of `x` around `dim`, without autodiff: a plain collective is
/// not differentiable (the mappings are), and no rank's graph may reach into another's.
fn view<const D: usize, K: Numeric>(x: Tensor<D, K>, dim: usize) -> Payload {
    let dims = view_dims(&x.shape(), dim);
    let dispatch = reshape_any(x, dims).into_dispatch();
    if dispatch_is_float(&dispatch) {
        Payload::Float(Tensor::<3>::from_dispatch(dispatch).without_autodiff())
    } else {
        Payload::Int(Tensor::<3, Int>::from_dispatch(dispatch).without_autodiff())
    }
}

fn dispatch_is_float(x: &burn::tensor::DispatchTensor) -> bool {
    use burn::backend::TensorMetadata;
    x.dtype().is_float()
}

/// Back from the transport's view to the caller's rank and kind, on an autodiff device again if
/// the caller's tensor was on one.
fn unview<const D: usize, K: Numeric>(payload: Payload, shape: Shape, autodiff: bool) -> Tensor<D, K> {
    let dispatch = match (payload, autodiff) {
        (Payload::Float(t), false) => t.into_dispatch(),
        (Payload::Float(t), true) => t.autodiff().into_dispatch(),
        (Payload::Int(t), false) => t.into_dispatch(),
        (Payload::Int(t), true) => t.autodiff().into_dispatch(),
    };
    let dims: [usize; D] = shape.as_slice().try_into().expect("the caller's rank");
    reshape_any(Tensor::<3, K>::from_dispatch(dispatch), dims)
}

/// `x` reshaped to `dims`, empty tensors included: Burn's `reshape` reads a 0 in the target
/// as "keep this dim" (ONNX's rule), so an empty tensor is made afresh in its dtype instead.
fn reshape_any<const A: usize, const B: usize, K: Numeric>(x: Tensor<A, K>, dims: [usize; B]) -> Tensor<B, K> {
    match x.shape().num_elements() {
        0 => Tensor::zeros(dims, (&x.device(), x.dtype())),
        _ => x.reshape(dims),
    }
}
