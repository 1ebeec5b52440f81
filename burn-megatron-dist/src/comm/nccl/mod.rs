//! NCCL on CUDA devices, for both ways of running ranks: one process a GPU
//! ([`NcclTransport`], started by torchrun, SLURM or any launcher that sets `RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR` and `MASTER_PORT`; it works across nodes), and
//! ranks as threads of one process, one GPU each ([`NcclThreadsTransport`], on the in-process
//! rendezvous).
//!
//! [`NcclComm`] is one rank's communicator for one group. Its collectives run on a stream of
//! its own, ordered against CubeCL's compute stream on the GPU ([`order`]): nothing on the host
//! waits for a kernel or for NCCL. The [watchdog](flights) aborts a communicator whose
//! collective is stuck past the timeout, so a lost peer is reported instead of hanging.

use std::sync::{Arc, Mutex};
use std::thread::ThreadId;
use std::time::Duration;

use burn::backend::Cube;
use burn::tensor::{DType, Device, Int, Tensor};
use burn_cubecl::tensor::CubeTensor;
use cubecl_cuda::CudaRuntime;
use cubecl_runtime::runtime::Runtime;
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaContext, CudaStream};
use cudarc::nccl::{result as nccl, sys};

use super::{Collective, Payload, ReduceOp, Ticket};
use crate::error::CommError;

mod collectives;
mod flights;
mod order;
mod process;
mod threads;
mod transport;

pub use process::ProcessRank;
pub use threads::NcclThreadsTransport;
pub use transport::NcclTransport;

use flights::Flights;
use order::GpuOrder;

type CudaServer = <CudaRuntime as Runtime>::Server;
fn transport_error(group: &str, collective: &'static str, error: impl std::fmt::Debug) -> CommError {
    CommError::Transport {
        group: group.to_string(),
        collective,
        detail: format!("{error:?}"),
    }
}

/// An NCCL communicator, destroyed with its transport.
struct Comm(sys::ncclComm_t);

// Safety: an NCCL communicator may be used from any thread as long as calls on it are not
// concurrent; its lock in [`Flights`] serializes them.
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

/// A fresh NCCL unique id, made by a group's first rank and handed to the others.
pub(crate) fn unique_id() -> Result<Vec<u8>, CommError> {
    let id = nccl::get_uniqueid().map_err(|e| transport_error("nccl", "init", e))?;
    Ok(id.internal.iter().map(|&c| c as u8).collect())
}

/// The CUDA ordinal of a device, if it is a CUDA device.
pub(crate) fn cuda_index(device: &Device) -> Option<usize> {
    use burn::backend::DispatchDevice;
    match device.as_dispatch() {
        DispatchDevice::Cube(cubecl::Device::Cuda(cuda)) => Some(cuda.index),
        _ => None,
    }
}

/// One rank's NCCL communicator for one group, on one CUDA device.
pub(crate) struct NcclComm {
    label: String,
    size: usize,
    group_rank: usize,
    device: Device,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    flights: Arc<Flights>,
    /// The GPU-side order, and the thread whose CubeCL stream it orders against.
    order: Mutex<(GpuOrder, Option<ThreadId>)>,
    /// Sends not posted yet: they go out with the next call (see [`Transport::send`](super::Transport::send)).
    pending: Mutex<Vec<PendingSend>>,
}

/// When the calling thread's stream waits for a collective: at once, or at
/// [`NcclComm::wait_for`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Wait {
    Now,
    Later,
}

/// A send waiting for the group's next call.
struct PendingSend {
    payload: Payload,
    peer: usize,
    ty: sys::ncclDataType_t,
}

impl Drop for NcclComm {
    /// A send still deferred leaves before the communicator goes, and everything queued
    /// finishes (or is aborted at the deadline); a failure here has no caller to go to, and the
    /// peer reports it.
    fn drop(&mut self) {
        let _ = self.flush();
        let _ = self.flights.drain();
    }
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclComm({} @ {})", self.label, self.group_rank)
    }
}

impl NcclComm {
    /// Joins the group: every member calls this, each from its own thread or process, with the
    /// same `id` (from [`unique_id`]). Blocks until all have.
    pub(crate) fn join(
        label: String,
        size: usize,
        group_rank: usize,
        id: &[u8],
        device: &Device,
        timeout: Duration,
    ) -> Result<Self, CommError> {
        let fail = |e: &dyn std::fmt::Debug| transport_error(&label, "init", e);
        let index = cuda_index(device).ok_or_else(|| fail(&format!("{device:?} is not a CUDA device")))?;
        let ctx = CudaContext::new(index).map_err(|e| fail(&e))?;
        // Safety: no cudarc buffer is ever made on this context (NCCL gets CubeCL's), so there
        // is nothing for its event tracking to order. Left on, the first stream made on the
        // context synchronizes the whole device: a stall, and a wait on other groups' spins.
        unsafe { ctx.disable_event_tracking() };
        let mut unique = sys::ncclUniqueId { internal: [0; 128] };
        for (dst, &src) in unique.internal.iter_mut().zip(id) {
            *dst = src as _;
        }
        ctx.bind_to_thread().map_err(|e| fail(&e))?;
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // Safety: `comm` is a valid out-pointer; every member calls this with the same id.
        unsafe { nccl::comm_init_rank(&mut comm, size as i32, unique, group_rank as i32) }.map_err(|e| fail(&e))?;
        let comm = Comm(comm);
        let stream = ctx.new_stream().map_err(|e| fail(&e))?;
        let order = GpuOrder::new(device).map_err(|e| fail(&e))?;
        let flights = Flights::start(label.clone(), timeout, ctx.clone(), comm);
        Ok(Self {
            label,
            size,
            group_rank,
            device: device.clone(),
            ctx,
            stream,
            flights,
            order: Mutex::new((order, None)),
            pending: Mutex::new(Vec::new()),
        })
    }

    pub(crate) fn device(&self) -> &Device {
        &self.device
    }

    pub(crate) fn label(&self) -> &str {
        &self.label
    }

    pub(crate) fn group_rank(&self) -> usize {
        self.group_rank
    }

    fn error(&self, collective: Collective, error: impl std::fmt::Debug) -> CommError {
        transport_error(&self.label, collective.name(), error)
    }

    /// Queues `launch` on this group's stream, after the work the calling thread queued on the
    /// device, and the calling thread's later work after it (`Wait::Now`) or after
    /// [`wait_for`](Self::wait_for) with the returned ticket (`Wait::Later`); returns without
    /// waiting on the host. `launch` gets the raw pointers of `inputs` and `outputs`.
    fn run(
        &self,
        collective: Collective,
        inputs: &[&Payload],
        outputs: &[&Payload],
        wait: Wait,
        launch: impl FnOnce(sys::ncclComm_t, &[u64], &[u64], sys::cudaStream_t) -> Result<(), sys::ncclResult_t>,
    ) -> Result<Ticket, CommError> {
        let mut order = self.order.lock().expect("order lock");
        let (order, thread) = &mut *order;
        // The order holds against one CubeCL stream, the calling thread's. A call from another
        // thread first lets everything queued finish, so its stream cannot overtake the last.
        let here = std::thread::current().id();
        if thread.is_some_and(|t| t != here) {
            self.flights.drain()?;
        }
        *thread = Some(here);
        let guard = self.flights.comm(collective.name())?;
        let comm = guard.as_ref().expect("checked by Flights::comm");
        // Outputs come from `output_like`, compact already: NCCL must write the very buffer
        // that is returned.
        debug_assert!(
            outputs.iter().all(|p| cube(p).is_contiguous()),
            "outputs come from output_like"
        );
        // Deferred sends go out first, in one NCCL group with this call.
        let pending = std::mem::take(&mut *self.pending.lock().expect("pending sends lock"));
        let buffers: Vec<Payload> = inputs
            .iter()
            .map(|p| contiguous(p))
            .chain(outputs.iter().map(|p| (*p).clone()))
            .chain(pending.iter().map(|send| send.payload.clone()))
            .collect();
        // Each lookup also orders the calling thread's stream after any other CubeCL stream
        // that wrote the buffer: the signal below comes after all of it.
        let tensors: Vec<CubeTensor> = buffers.iter().map(cube).collect();
        let resources = tensors
            .iter()
            .map(|t| t.client.get_resource::<CudaServer>(t.handle.clone()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| self.error(collective, e))?;
        let ptrs: Vec<u64> = resources.iter().map(|r| r.resource().ptr).collect();
        self.ctx.bind_to_thread().map_err(|e| self.error(collective, e))?;
        let call = order.before(&self.stream).map_err(|e| self.error(collective, e))?;
        let stream = self.stream.cu_stream() as sys::cudaStream_t;
        let (ptrs, send_ptrs) = ptrs.split_at(inputs.len() + outputs.len());
        let (input_ptrs, output_ptrs) = ptrs.split_at(inputs.len());
        let launched = if pending.is_empty() {
            launch(comm.0, input_ptrs, output_ptrs, stream)
        } else {
            // Safety: each pending payload holds the counted elements and is kept alive (in
            // `buffers`) until the collective has finished.
            unsafe {
                check(nccl::group_start()).and_then(|()| {
                    let sent = pending.iter().zip(send_ptrs).try_for_each(|(send, &ptr)| {
                        check(nccl::send(
                            ptr as _,
                            numel(&send.payload),
                            send.ty,
                            send.peer as i32,
                            comm.0,
                            stream,
                        ))
                    });
                    // The group is closed whatever happened inside it.
                    let launched = sent.and_then(|()| launch(comm.0, input_ptrs, output_ptrs, stream));
                    launched.and(check(nccl::group_end()))
                })
            }
        };
        // The release comes whatever happened: the NCCL stream already waits for this call's
        // signal, and every later spin would wait for it.
        order.after(&self.stream, call).map_err(|e| self.error(collective, e))?;
        if wait == Wait::Now {
            order.spin(call);
        }
        launched.map_err(|e| self.error(collective, e))?;
        let done = self
            .stream
            .record_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(|e| self.error(collective, e))?;
        drop(resources);
        self.flights.push(collective.name(), done, buffers);
        Ok(Ticket(Some(call)))
    }

    /// Makes the calling thread's later device work wait for the collective of `ticket`.
    pub(crate) fn wait_for(&self, ticket: Ticket) -> Result<(), CommError> {
        let Ticket(Some(call)) = ticket else { return Ok(()) };
        let mut order = self.order.lock().expect("order lock");
        let (order, thread) = &mut *order;
        // Another thread's stream is not the one the call was ordered against: the host waits.
        if thread.is_some_and(|t| t != std::thread::current().id()) {
            self.flights.drain()?;
        }
        order.spin(call);
        Ok(())
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
