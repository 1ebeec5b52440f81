//! The device memory a run holds, as CubeCL's pools count it: what tensors use and what the
//! pools reserve from the driver. CUDA devices only: Burn's CPU backend keeps no pools.

use burn::tensor::Device;

/// Bytes of a device's memory, over every stream's pools.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceMemory {
    /// Held by live tensors.
    pub in_use: u64,
    /// Taken from the driver by the pools (at least `in_use`).
    pub reserved: u64,
    /// The device's capacity, where its runtime reports one.
    pub total: Option<u64>,
}

impl DeviceMemory {
    /// What the pools have not taken of the device's capacity (other processes' use unseen).
    pub fn free(&self) -> Option<u64> {
        self.total.map(|total| total.saturating_sub(self.reserved))
    }
}

/// `device`'s memory once its queued work has run; `None` for a device without CubeCL pools.
pub fn device_memory(device: &Device) -> Option<DeviceMemory> {
    #[cfg(feature = "cuda")]
    {
        use burn::backend::Cube;
        use burn::tensor::Tensor;
        use burn_cubecl::cubecl::MemoryScope;
        let probe = Tensor::<1>::zeros([1], device).try_into_primitive::<Cube>().ok()?;
        let usage = probe.client.memory_report(MemoryScope::Device).usage();
        Some(DeviceMemory {
            in_use: usage.bytes_in_use,
            reserved: usage.bytes_reserved,
            total: probe.client.properties().memory.max_memory(),
        })
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = device;
        None
    }
}
