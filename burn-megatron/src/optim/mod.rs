//! Optimizers that know the mesh: AdamW with fp32 master weights, data-parallel averaging and
//! the ZeRO-1 distributed optimizer; and [`FusedAdamW`], Burn's optimizer interface on the fused
//! AdamW kernel.

pub mod adamw;
pub mod buckets;
pub mod finite;
pub mod fused;
pub mod overlap;
pub mod shared;

pub use adamw::{DistributedAdamW, DistributedAdamWConfig, ParamState, StepReport, check_lr};
pub use buckets::{BucketConfig, GradGroup, GradReducer, Reduction};
pub use finite::{FiniteCheck, NonFiniteGradient};
pub use fused::{FusedAdamW, FusedAdamWConfig};
pub use overlap::Overlap;

use burn::tensor::Device;

/// Hands the device memory CubeCL's pools have given back to the driver; a training loop calls
/// it once a step ([`DistributedAdamW::step_reduced`] and the Learner strategy do).
///
/// CubeCL 0.11's CUDA storage only queues the pages its pools give back (`GpuStorage::dealloc`)
/// and frees them at a flush (`GpuStorage::flush`, reached through `Client::flush`), which
/// nothing else in a step calls: without one, every page the pools outgrew while the first step
/// grew them stays allocated (11.2 GiB beside llama-1b's 23.2 GiB of pools,
/// `docs/performance.md`). With nothing queued it waits for nothing (the pools stop giving pages
/// back once grown); a device that failed reports it at the next read, as every queued launch
/// does. Elsewhere than CUDA it does nothing.
pub fn release_freed_pages(device: &Device) {
    device.flush().ok();
}
