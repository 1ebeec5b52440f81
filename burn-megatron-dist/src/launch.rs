//! Runs a closure on every rank: as threads of this process (the default), or as this process's
//! one rank when a launcher such as torchrun or SLURM set `RANK` and `WORLD_SIZE`.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::time::Duration;

use burn::tensor::Device;

use crate::comm::in_process::{DEFAULT_TIMEOUT, InProcessWorld};
use crate::comm::{Payload, ProcessGroup, Transport};
use crate::error::LaunchError;
use crate::groups::ProcessGroups;
use crate::mesh::ParallelDims;

/// What one rank's closure receives.
#[derive(Clone, Debug)]
pub struct RankContext {
    pub global_rank: usize,
    /// This rank's index among the ranks of its node (its GPU).
    pub local_rank: usize,
    pub groups: ProcessGroups,
    pub device: Device,
}

/// How [`launch`] runs the ranks.
#[derive(Clone, Debug)]
pub struct LaunchOptions {
    /// How long a collective waits for a missing peer before failing.
    pub timeout: Duration,
}

impl Default for LaunchOptions {
    fn default() -> Self {
        Self {
            timeout: DEFAULT_TIMEOUT,
        }
    }
}

/// Runs `body` on every rank of `dims` and returns the ranks' results in global-rank order.
///
/// `device_of(local_rank)` gives each rank its device. With `RANK`/`WORLD_SIZE` set (torchrun,
/// SLURM via `srun` with those variables), this process is one rank: it joins the others
/// through NCCL and returns its own result alone.
pub fn launch<T: Send>(
    dims: ParallelDims,
    device_of: impl Fn(usize) -> Device + Sync,
    body: impl Fn(RankContext) -> T + Sync,
) -> Result<Vec<T>, LaunchError> {
    launch_with(dims, LaunchOptions::default(), device_of, body)
}

/// [`launch`] with options.
pub fn launch_with<T: Send>(
    dims: ParallelDims,
    options: LaunchOptions,
    device_of: impl Fn(usize) -> Device + Sync,
    body: impl Fn(RankContext) -> T + Sync,
) -> Result<Vec<T>, LaunchError> {
    if std::env::var_os("RANK").is_some() || std::env::var_os("WORLD_SIZE").is_some() {
        return launch_process(dims, options, device_of, body);
    }
    launch_threads(dims, options, device_of, body)
}

/// Every rank a thread of this process. A rank on a CUDA device (in a `cuda` build) joins its
/// groups through NCCL, the others through the in-process transport (`thread_transport`).
pub fn launch_threads<T: Send>(
    dims: ParallelDims,
    options: LaunchOptions,
    device_of: impl Fn(usize) -> Device + Sync,
    body: impl Fn(RankContext) -> T + Sync,
) -> Result<Vec<T>, LaunchError> {
    let world_size = dims.world_size();
    dims.validate(world_size)?;
    let world = InProcessWorld::with_timeout(world_size, options.timeout);
    let results: Vec<Result<T, String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..world_size)
            .map(|global_rank| {
                let (world, body, device_of) = (&world, &body, &device_of);
                scope.spawn(move || {
                    let device = device_of(global_rank);
                    let groups = ProcessGroups::build(dims, global_rank, |axis, members| {
                        let transport = thread_transport(world, axis, &members, global_rank, &device);
                        ProcessGroup::new(transport, members)
                    });
                    let context = RankContext {
                        global_rank,
                        local_rank: global_rank,
                        groups,
                        device,
                    };
                    catch_unwind(AssertUnwindSafe(|| body(context))).map_err(|panic| {
                        let message = panic_message(panic);
                        world.abort(global_rank, message.clone());
                        message
                    })
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank threads catch their panics"))
            .collect()
    });
    let mut out = Vec::with_capacity(world_size);
    let mut failures = Vec::new();
    for (global_rank, result) in results.into_iter().enumerate() {
        match result {
            Ok(value) => out.push(value),
            Err(message) => failures.push(LaunchError::RankPanicked { global_rank, message }),
        }
    }
    // The rank that failed first is the cause; the others failed because it was gone.
    match world.first_failure() {
        Some((global_rank, message)) if !failures.is_empty() => Err(LaunchError::RankPanicked { global_rank, message }),
        _ => match failures.into_iter().next() {
            Some(error) => Err(error),
            None => Ok(out),
        },
    }
}

/// The transport of a rank thread on `device` for one of its groups: NCCL for a CUDA device,
/// made at the group's first collective if its ranks each have a GPU of their own (the
/// rendezvous carries the data of ranks that share one); the rendezvous alone otherwise.
#[cfg(feature = "cuda")]
fn thread_transport(
    world: &InProcessWorld,
    axis: &str,
    members: &[usize],
    global_rank: usize,
    device: &Device,
) -> Arc<dyn Transport> {
    use crate::comm::nccl::{NcclThreadsTransport, cuda_index};
    match cuda_index(device) {
        Some(_) => Arc::new(NcclThreadsTransport::new(world, axis, members, global_rank)),
        None => Arc::new(world.transport(axis, members, global_rank, Payload::to_device)),
    }
}

/// The transport of a rank thread for one of its groups: the rendezvous, without NCCL.
#[cfg(not(feature = "cuda"))]
fn thread_transport(
    world: &InProcessWorld,
    axis: &str,
    members: &[usize],
    global_rank: usize,
    _device: &Device,
) -> Arc<dyn Transport> {
    Arc::new(world.transport(axis, members, global_rank, Payload::to_device))
}

#[cfg(feature = "cuda")]
fn launch_process<T: Send>(
    dims: ParallelDims,
    options: LaunchOptions,
    device_of: impl Fn(usize) -> Device + Sync,
    body: impl Fn(RankContext) -> T + Sync,
) -> Result<Vec<T>, LaunchError> {
    let process = crate::comm::nccl::ProcessRank::get()?;
    dims.validate(process.world_size())?;
    let device = device_of(process.local_rank());
    let groups = process.groups(dims, &device, options.timeout)?;
    let context = RankContext {
        global_rank: process.global_rank(),
        local_rank: process.local_rank(),
        groups,
        device,
    };
    Ok(vec![body(context)])
}

#[cfg(not(feature = "cuda"))]
fn launch_process<T: Send>(
    _dims: ParallelDims,
    _options: LaunchOptions,
    _device_of: impl Fn(usize) -> Device + Sync,
    _body: impl Fn(RankContext) -> T + Sync,
) -> Result<Vec<T>, LaunchError> {
    Err(LaunchError::Env {
        name: "RANK",
        detail: "is set, but one process a rank needs NCCL: build with the `cuda` feature".into(),
    })
}

fn panic_message(panic: Box<dyn std::any::Any + Send>) -> String {
    match panic.downcast::<String>() {
        Ok(s) => *s,
        Err(panic) => match panic.downcast::<&str>() {
            Ok(s) => s.to_string(),
            Err(_) => "a panic without a message".into(),
        },
    }
}
