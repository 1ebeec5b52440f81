//! Orders an NCCL stream against CubeCL's compute stream on the GPU, without the host.
//!
//! CubeCL 0.11 keeps its CUDA streams private, so no event can be recorded on them or waited
//! for there. Two 32-bit counters in device memory carry the order instead:
//!
//! ```text
//! compute stream (CubeCL)            NCCL stream (ours)
//! … kernels writing the inputs
//! signal: ready ← n  ──────────────▶ wait until ready ≥ n     (cuStreamWaitValue32)
//!                                    the collective
//!                                    done ← n                 (cuStreamWriteValue32, fenced)
//! … kernels not reading the outputs
//! spin until done ≥ n ◀────────────
//! … kernels reading the outputs
//! ```
//!
//! `signal` and `spin` are one-thread CubeCL kernels queued on the stream of the calling thread,
//! which is where CubeCL queued the work that wrote the inputs, and where it hands out the
//! outputs' memory. The spin holds one thread of one SM while NCCL runs.
//!
//! The spin may come right after the signal (the outputs are read at once) or later (a
//! gradient bucket's reduction runs while backward goes on), so calls need not alternate: the
//! compute stream may signal several calls before it waits for the first. Both counters only
//! grow, each side waits until the other's has reached the call's number, and "reached" is
//! CUDA's cyclic comparison (`(int32)(flag − n) ≥ 0`), so the numbers may wrap.

use burn::backend::Cube;
use burn::tensor::{DType, Device, Int};
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use cudarc::driver::CudaStream;
use cudarc::driver::sys::{self as cuda, CUresult};

use super::CudaServer;

/// `ready` is flag 0 (written by CubeCL, read by the NCCL stream), `done` flag 1.
const READY: usize = 0;
const DONE: usize = 1;

#[cube(launch_unchecked)]
fn signal_kernel(flags: &mut Tensor<Atomic<u32>>, call: u32) {
    flags[READY].store(call);
}

#[cube(launch_unchecked)]
fn spin_kernel(flags: &mut Tensor<Atomic<u32>>, call: u32) {
    // A volatile read each turn (CubeCL's atomic load); NCCL's write lands in L2. `done − call`
    // below 2³¹ is "done has reached call", wrapping like CUDA's own wait.
    loop {
        if flags[DONE].load() - call < 0x8000_0000 {
            break;
        }
    }
}

#[derive(Clone, Copy)]
enum Kernel {
    Signal,
    Spin,
}

/// The flags of one NCCL communicator, and its call counter.
pub(super) struct GpuOrder {
    flags: CubeTensor,
    /// The flags' device address, for the NCCL stream's memory operations.
    address: u64,
    /// The number of the last call; fresh flags (zeros) have reached none from 1 on.
    call: u32,
}

// Safety: the flags are a device buffer; the address is only handed to CUDA stream operations.
unsafe impl Send for GpuOrder {}

impl GpuOrder {
    /// Zeroed flags on `device`, and both kernels loaded: waits once, on the host, for them.
    ///
    /// Loading a kernel may synchronize the whole device (CUDA's lazy loading says so). Were
    /// `signal` loaded only at its first real use, that load would wait for the NCCL stream,
    /// which already waits for `signal`: a deadlock, seen on the H200s. So both run here first,
    /// on values that need no wait (call 0; the flags are zeros).
    pub(super) fn new(device: &Device) -> Result<Self, String> {
        let flags = burn::tensor::Tensor::<1, Int>::zeros([2], (device, DType::U32));
        let flags = flags
            .try_into_primitive::<Cube>()
            .map_err(|_| "NCCL runs on CUDA devices".to_string())?;
        let resource = flags
            .client
            .get_resource::<CudaServer>(flags.handle.clone())
            .map_err(|e| format!("{e:?}"))?;
        let order = Self {
            flags,
            address: resource.resource().ptr,
            call: 0,
        };
        order.launch(Kernel::Signal, 0);
        order.launch(Kernel::Spin, 0);
        let flags = burn::tensor::Tensor::<1, Int>::from_primitive::<Cube>(order.flags.clone());
        flags.try_into_data().map_err(|e| format!("{e:?}"))?;
        Ok(order)
    }

    fn launch(&self, kernel: Kernel, call: u32) {
        let flags = &self.flags;
        let (count, dim, arg) = (
            CubeCount::Static(1, 1, 1),
            CubeDim::new_1d(1),
            flags.clone().into_tensor_arg(),
        );
        // Safety: one thread stores into flag 0 (`signal`) or reads flag 1 (`spin`) of a
        // two-element u32 buffer.
        unsafe {
            match kernel {
                Kernel::Signal => signal_kernel::launch_unchecked(&flags.client, count, dim, arg, call),
                Kernel::Spin => spin_kernel::launch_unchecked(&flags.client, count, dim, arg, call),
            }
        }
    }

    /// Makes `stream` wait for everything the calling thread queued on the flags' device so far.
    /// Returns the call's number, for [`after`](Self::after).
    pub(super) fn before(&mut self, stream: &CudaStream) -> Result<u32, String> {
        self.call = self.call.wrapping_add(1);
        let call = self.call;
        self.launch(Kernel::Signal, call);
        // CubeCL launches from its device thread. A round trip through that thread puts the
        // signal on the CUDA stream before the NCCL stream waits for it: were a kernel queued
        // ahead of it loaded meanwhile, that load would wait for the whole device, the NCCL
        // stream included, while the signal still sat behind it.
        self.flags
            .client
            .get_resource::<CudaServer>(self.flags.handle.clone())
            .map_err(|e| format!("{e:?}"))?;
        let ready = self.address + (READY * 4) as u64;
        // Safety: the flags outlive the stream's use of them (they live as long as the
        // communicator, whose drop synchronizes its stream).
        check(unsafe {
            cuda::cuStreamWaitValue32_v2(
                stream.cu_stream(),
                ready,
                call,
                cuda::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
            )
        })?;
        Ok(call)
    }

    /// Marks call `call` done once `stream`'s work so far is: [`spin`](Self::spin) waits for it.
    pub(super) fn after(&self, stream: &CudaStream, call: u32) -> Result<(), String> {
        let done = self.address + (DONE * 4) as u64;
        // Safety: as in `before`. The default flags fence memory before the write, so NCCL's
        // output is visible once the flag is.
        check(unsafe {
            cuda::cuStreamWriteValue32_v2(
                stream.cu_stream(),
                done,
                call,
                cuda::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
            )
        })
    }

    /// Makes the calling thread's later work on the device wait until call `call` is done.
    pub(super) fn spin(&self, call: u32) {
        self.launch(Kernel::Spin, call);
    }
}

fn check(result: CUresult) -> Result<(), String> {
    match result {
        CUresult::CUDA_SUCCESS => Ok(()),
        error => Err(format!("{error:?}")),
    }
}
