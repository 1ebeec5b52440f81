//! `bench`'s memory figures, read from CubeCL's own pools rather than nvidia-smi: what the step's
//! tensors hold (`in_use`) beside what the pools keep from the driver (`reserved`) and what the
//! driver says the device has in use (`device_used`: the pools, the CUDA context, kernels' local
//! memory), at named points of a run, and each pool's shape, so a gap is located, not guessed.

use burn::backend::{Cube, DispatchDevice};
use burn::tensor::{Device, Tensor};
use burn_cubecl::cubecl::{MemoryPoolKind, MemoryPoolReport, MemoryReport, MemoryScope};
use burn_cubecl::tensor::CubeTensor;

const GIB: f64 = (1u64 << 30) as f64;

/// The device's memory at one point of a step.
pub struct Mark {
    label: &'static str,
    report: MemoryReport,
    /// `total - free` by the driver, and the context's stack a thread (the local memory the
    /// driver reserves for every thread the device can hold; it grows to the largest a launched
    /// kernel needed, and stays), in bytes.
    driver: Option<(u64, u64)>,
}

/// A tensor on `device`, for its CubeCL client.
fn probe(device: &Device) -> CubeTensor {
    Tensor::<1>::zeros([1], device)
        .try_into_primitive::<Cube>()
        .unwrap_or_else(|_| panic!("bench's memory marks read CUDA pools"))
}

impl Mark {
    /// Every stream's pools on `device`, read once the queued work has run.
    pub fn take(label: &'static str, device: &Device) -> Self {
        Self {
            label,
            report: probe(device).client.memory_report(MemoryScope::Device),
            driver: driver_counts(device),
        }
    }

    /// Bytes the pools reserve from the driver now.
    pub fn reserved(&self) -> u64 {
        self.report.usage().bytes_reserved
    }

    /// One `MEMORY {…}` line: the totals, then each non-empty pool of each stream.
    pub fn line(&self) -> String {
        let usage = self.report.usage();
        let pools: Vec<String> = self
            .report
            .streams
            .iter()
            .flat_map(|stream| {
                let pools = &stream.pools;
                let dynamic = pools.dynamic.iter().map(|pool| ("dynamic", pool));
                let fixed = [("persistent", &pools.persistent), ("dedicated", &pools.dedicated)];
                dynamic
                    .chain(fixed)
                    .filter(|(_, pool)| pool.usage.bytes_reserved > 0)
                    .map(move |(role, pool)| describe(stream.stream.value, role, pool))
            })
            .collect();
        format!(
            "MEMORY {{\"at\": \"{}\", \"in_use_gib\": {:.2}, \"reserved_gib\": {:.2}, \"device_used_gib\": {}, \"stack_bytes_a_thread\": {}, \"allocations\": {}, \"pools\": [{}]}}",
            self.label,
            usage.bytes_in_use as f64 / GIB,
            usage.bytes_reserved as f64 / GIB,
            self.driver
                .map_or("null".into(), |(used, _)| format!("{:.2}", used as f64 / GIB)),
            self.driver.map_or("null".into(), |(_, stack)| stack.to_string()),
            usage.number_allocs,
            pools.join(", ")
        )
    }
}

/// The device memory in use by the driver's count and the stack a thread, on `device`'s primary
/// context (CubeCL's).
fn driver_counts(device: &Device) -> Option<(u64, u64)> {
    let DispatchDevice::Cube(burn_cubecl::cubecl::Device::Cuda(cuda)) = device.as_dispatch() else {
        return None;
    };
    let context = cudarc::driver::CudaContext::new(cuda.index).ok()?;
    context.bind_to_thread().ok()?;
    let (free, total) = cudarc::driver::result::mem_get_info().ok()?;
    let stack = cudarc::driver::result::ctx::get_limit(cudarc::driver::sys::CUlimit::CU_LIMIT_STACK_SIZE).ok()?;
    Some(((total - free) as u64, stack as u64))
}

/// One pool as JSON: its kind and page size, what it holds and reserves, its pages now and at
/// their peak, and the largest allocation it served.
fn describe(stream: u64, role: &str, pool: &MemoryPoolReport) -> String {
    let kind = match pool.kind {
        MemoryPoolKind::Sliced { page_size, .. } => format!("sliced, pages {:.3} GiB", page_size as f64 / GIB),
        MemoryPoolKind::Adaptive {
            page_size,
            outdated_pages,
        } => {
            format!(
                "adaptive, pages {:.3} GiB, {outdated_pages} outdated",
                page_size as f64 / GIB
            )
        }
        MemoryPoolKind::Exclusive { .. } => "exclusive".into(),
        MemoryPoolKind::Direct => "direct".into(),
        MemoryPoolKind::Persistent => "persistent".into(),
    };
    format!(
        "{{\"stream\": {stream}, \"role\": \"{role}\", \"kind\": \"{kind}\", \"in_use_gib\": {:.2}, \"reserved_gib\": {:.2}, \"allocations\": {}, \"pages\": {}, \"pages_peak\": {}, \"largest_gib\": {:.3}}}",
        pool.usage.bytes_in_use as f64 / GIB,
        pool.usage.bytes_reserved as f64 / GIB,
        pool.usage.number_allocs,
        pool.pages,
        pool.pages_peak,
        pool.largest_alloc as f64 / GIB,
    )
}

/// The largest reservation among `marks`, in GiB: the pools never give memory back within a
/// step, so the last mark's is the run's peak unless a cleanup ran.
pub fn peak_gib(marks: &[Mark]) -> f64 {
    marks.iter().map(Mark::reserved).max().unwrap_or(0) as f64 / GIB
}
