//! The NCCL transport: one process a GPU, started by torchrun, SLURM or any launcher that sets
//! `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR` and `MASTER_PORT`. It works across nodes.
//!
//! Global rank 0 serves the [store](super::store) at `MASTER_ADDR:MASTER_PORT`. Each group's
//! NCCL unique id and every call's agreement record go through it, so a missing rank is caught
//! on the host, by name, before any NCCL call is made.
//!
//! CubeCL's CUDA streams are private, so NCCL runs on a stream of its own, fenced on the host:
//! every buffer is read back once (one element) before a collective, and the collective's
//! stream is waited for after it (the
//! single-process path of [`in_process`](super::in_process) runs on CubeCL's own transport
//! instead, without host fences). The wait for NCCL is a poll with a deadline; past it the
//! communicator is aborted and the call fails instead of hanging.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use burn::backend::Cube;
use burn::tensor::{DType, Device, Int, Tensor};
use cubecl_runtime::runtime::Runtime;
use burn_cubecl::tensor::CubeTensor;
use cubecl_cuda::CudaRuntime;
use cudarc::driver::{CudaContext, CudaStream};
use cudarc::nccl::{result as nccl, sys};

use super::store::StoreClient;
use super::{Collective, Payload, ReduceOp, Transport};
use crate::error::CommError;

mod collectives;
mod process;

pub use process::ProcessRank;

type CudaServer = <CudaRuntime as Runtime>::Server;
fn transport_error(group: &str, collective: &'static str, error: impl std::fmt::Debug) -> CommError {
    CommError::Transport { group: group.to_string(), collective, detail: format!("{error:?}") }
}

/// An NCCL communicator, destroyed with its transport.
struct Comm(sys::ncclComm_t);

// Safety: an NCCL communicator may be used from any thread as long as calls on it are not
// concurrent; `NcclTransport` serializes them with its lock.
unsafe impl Send for Comm {}
unsafe impl Sync for Comm {}

impl Drop for Comm {
    fn drop(&mut self) {
        // Safety: the communicator was initialized and is dropped once.
        unsafe {
            let _ = nccl::comm_destroy(self.0);
        }
    }
}

/// One rank's NCCL communicator for one group.
pub struct NcclTransport {
    label: String,
    /// Prefix of this group's keys in the store.
    namespace: String,
    size: usize,
    group_rank: usize,
    comm: Mutex<Option<Comm>>,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    store: Arc<StoreClient>,
    device: Device,
    timeout: Duration,
    /// Sends not posted yet: they go out with the next call (see [`Transport::send`]).
    pending: Mutex<Vec<PendingSend>>,
}

/// A send waiting for the group's next call.
struct PendingSend {
    payload: Payload,
    peer: usize,
    ty: sys::ncclDataType_t,
}

impl Drop for NcclTransport {
    /// A send still deferred leaves before the communicator goes; a failure here has no caller
    /// to go to, and the peer's `recv` reports it (a timeout naming this rank).
    fn drop(&mut self) {
        let _ = self.flush();
    }
}

impl std::fmt::Debug for NcclTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclTransport({} @ {})", self.label, self.group_rank)
    }
}

impl NcclTransport {
    fn join(
        label: String,
        namespace: String,
        members: &[usize],
        process: &ProcessRank,
        ctx: &Arc<CudaContext>,
        device: &Device,
        timeout: Duration,
    ) -> Result<Self, CommError> {
        let size = members.len();
        let group_rank = members.iter().position(|&r| r == process.global_rank).expect("member of its group");
        let fail = |e: &dyn std::fmt::Debug| transport_error(&label, "init", e);
        let key = format!("{namespace}/nccl-id");
        let id = if group_rank == 0 {
            let id = nccl::get_uniqueid().map_err(|e| fail(&e))?;
            let bytes: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
            process.store.set(&key, &bytes, (size - 1) as u32).map_err(|e| fail(&e))?;
            id
        } else {
            let bytes = process.store.get(&key, timeout).map_err(|e| fail(&e))?.ok_or_else(|| {
                CommError::Timeout {
                    group: label.clone(),
                    collective: "init",
                    seq: 0,
                    timeout,
                    missing: vec![0],
                }
            })?;
            let mut id = sys::ncclUniqueId { internal: [0; 128] };
            for (dst, src) in id.internal.iter_mut().zip(bytes) {
                *dst = src as _;
            }
            id
        };
        ctx.bind_to_thread().map_err(|e| fail(&e))?;
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // Safety: `comm` is a valid out-pointer; every member calls this with the same id.
        unsafe { nccl::comm_init_rank(&mut comm, size as i32, id, group_rank as i32) }.map_err(|e| fail(&e))?;
        let stream = ctx.new_stream().map_err(|e| fail(&e))?;
        Ok(Self {
            label,
            namespace,
            size,
            group_rank,
            comm: Mutex::new(Some(Comm(comm))),
            ctx: ctx.clone(),
            stream,
            store: process.store.clone(),
            device: device.clone(),
            timeout,
            pending: Mutex::new(Vec::new()),
        })
    }

    fn error(&self, collective: Collective, error: impl std::fmt::Debug) -> CommError {
        transport_error(&self.label, collective.name(), error)
    }

    /// Runs `launch` on this group's stream once the device's queued work is done, and waits
    /// for it with a deadline. `launch` gets the raw pointers of `inputs` and `outputs`.
    fn run(
        &self,
        collective: Collective,
        inputs: &[&Payload],
        outputs: &[&Payload],
        launch: impl FnOnce(sys::ncclComm_t, &[u64], &[u64], sys::cudaStream_t) -> Result<(), sys::ncclResult_t>,
    ) -> Result<(), CommError> {
        let guard = self.comm.lock().expect("communicator lock");
        let comm = guard.as_ref().ok_or_else(|| CommError::PeerLost {
            group: self.label.clone(),
            collective: collective.name(),
            rank: usize::MAX,
            reason: "the communicator was aborted by an earlier timeout".into(),
        })?;
        // Inputs are made contiguous first, so the fence below also covers those copies.
        // Outputs come from `output_like`, compact already: NCCL must write the very buffer
        // that is returned.
        debug_assert!(outputs.iter().all(|p| cube(p).is_contiguous()), "outputs come from output_like");
        // Deferred sends go out first, in one NCCL group with this call.
        let pending = std::mem::take(&mut *self.pending.lock().expect("pending sends lock"));
        let contiguous: Vec<Payload> = inputs
            .iter()
            .map(|p| contiguous(p))
            .chain(outputs.iter().map(|p| (*p).clone()))
            .chain(pending.iter().map(|send| send.payload.clone()))
            .collect();
        // The fence: a read of one element of each buffer returns only once every operation
        // queued before it on the buffer's CubeCL stream has run: the kernels that write the
        // inputs, and those still using an output's memory before CubeCL handed it out again.
        for p in &contiguous {
            p.read_first().map_err(|e| self.error(collective, e))?;
        }
        let tensors: Vec<CubeTensor> = contiguous.iter().map(cube).collect();
        let resources = tensors
            .iter()
            .map(|t| t.client.get_resource::<CudaServer>(t.handle.clone()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| self.error(collective, e))?;
        let ptrs: Vec<u64> = resources.iter().map(|r| r.resource().ptr).collect();
        self.ctx.bind_to_thread().map_err(|e| self.error(collective, e))?;
        let stream = self.stream.cu_stream() as sys::cudaStream_t;
        let (ptrs, send_ptrs) = ptrs.split_at(inputs.len() + outputs.len());
        let (input_ptrs, output_ptrs) = ptrs.split_at(inputs.len());
        let launched = if pending.is_empty() {
            launch(comm.0, input_ptrs, output_ptrs, stream)
        } else {
            // Safety: each pending payload holds the counted elements and is kept alive (in
            // `contiguous`) until the wait below ends.
            unsafe {
                check(nccl::group_start()).and_then(|()| {
                    let sent = pending.iter().zip(send_ptrs).try_for_each(|(send, &ptr)| {
                        check(nccl::send(ptr as _, numel(&send.payload), send.ty, send.peer as i32, comm.0, stream))
                    });
                    // The group is closed whatever happened inside it.
                    let launched = sent.and_then(|()| launch(comm.0, input_ptrs, output_ptrs, stream));
                    launched.and(check(nccl::group_end()))
                })
            }
        };
        launched.map_err(|e| self.error(collective, e))?;
        let done = self.stream.record_event(None).map_err(|e| self.error(collective, e))?;
        let deadline = Instant::now() + self.timeout;
        loop {
            match done.try_is_complete() {
                Ok(true) => break,
                Ok(false) if Instant::now() < deadline => std::thread::yield_now(),
                Ok(false) => {
                    drop(guard);
                    self.abort();
                    return Err(CommError::Timeout {
                        group: self.label.clone(),
                        collective: collective.name(),
                        seq: 0,
                        timeout: self.timeout,
                        missing: vec![],
                    });
                }
                Err(e) => return Err(self.error(collective, e)),
            }
        }
        drop(resources);
        Ok(())
    }

    fn abort(&self) {
        if let Some(comm) = self.comm.lock().expect("communicator lock").take() {
            // Safety: aborting a live communicator; it is not used again.
            unsafe {
                let _ = nccl::comm_abort(comm.0);
            }
            std::mem::forget(comm);
        }
    }

    /// An output buffer for NCCL to fill: compact (`[o, n, i]` strides), uninitialized.
    ///
    /// Not `Tensor::zeros`/`empty`: CubeCL may pitch those (pad each row for vector loads), and
    /// NCCL writes a dense buffer. A pitched output passed through [`contiguous`] would have
    /// NCCL fill a temporary copy while the returned tensor kept its zeros: that was the
    /// one-process-a-GPU bug behind every `[3, 5]`-shaped collective reading back zeros.
    fn output_like(&self, x: &Payload, dims: [usize; 3]) -> Payload {
        let bytes = dims.iter().product::<usize>() * x.dtype().size();
        if bytes == 0 {
            let options = (&self.device, x.dtype());
            return match x {
                Payload::Float(_) => Payload::Float(Tensor::zeros(dims, options)),
                Payload::Int(_) => Payload::Int(Tensor::<3, Int>::zeros(dims, options)),
            };
        }
        let like = cube(x);
        let handle = like.client.empty(bytes);
        let t = CubeTensor::new_contiguous(like.client, like.device, dims.into(), handle, like.dtype);
        match x {
            Payload::Float(_) => Payload::Float(Tensor::from_primitive::<Cube>(t)),
            Payload::Int(_) => Payload::Int(Tensor::from_primitive::<Cube>(t)),
        }
    }

    fn nccl_type(&self, collective: Collective, dtype: DType) -> Result<sys::ncclDataType_t, CommError> {
        use sys::ncclDataType_t::*;
        Ok(match dtype {
            DType::F32 => ncclFloat32,
            DType::BF16 => ncclBfloat16,
            DType::F16 => ncclFloat16,
            DType::F64 => ncclFloat64,
            DType::I32 => ncclInt32,
            DType::I64 => ncclInt64,
            DType::I8 => ncclInt8,
            DType::U8 => ncclUint8,
            DType::U32 => ncclUint32,
            DType::U64 => ncclUint64,
            other => {
                return Err(CommError::InvalidArgument {
                    group: self.label.clone(),
                    collective: collective.name(),
                    detail: format!("NCCL has no {other:?}"),
                });
            }
        })
    }
}

fn nccl_op(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
    }
}

fn numel(p: &Payload) -> usize {
    p.dims().iter().product()
}

/// The CubeCL tensor behind a payload (contiguous, from [`contiguous`]).
fn cube(p: &Payload) -> CubeTensor {
    match p.clone() {
        Payload::Float(t) => t.try_into_primitive::<Cube>(),
        Payload::Int(t) => t.try_into_primitive::<Cube>(),
    }
    .expect("NCCL payloads live on CUDA devices, without autodiff")
}

/// The payload with its data laid out contiguously (a copy if it was a strided view).
fn contiguous(p: &Payload) -> Payload {
    let t = cube(p);
    if t.is_contiguous() {
        return p.clone();
    }
    let t = burn_cubecl::kernel::into_contiguous(t);
    match p {
        Payload::Float(_) => Payload::Float(Tensor::from_primitive::<Cube>(t)),
        Payload::Int(_) => Payload::Int(Tensor::from_primitive::<Cube>(t)),
    }
}

fn check(status: Result<nccl::NcclStatus, nccl::NcclError>) -> Result<(), sys::ncclResult_t> {
    status.map(|_| ()).map_err(|e| e.0)
}
