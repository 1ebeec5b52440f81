//! How a suite runs: on which devices, in which float dtype, with ranks launched how.

use std::time::Duration;

use burn::tensor::{DType, Device};
use burn_megatron_dist::launch::{LaunchOptions, launch_with};
use burn_megatron_dist::{ParallelDims, RankContext};

/// The environment of one suite run.
#[derive(Clone, Debug)]
pub struct Harness {
    /// The device of each local rank.
    pub device_of: fn(usize) -> Device,
    /// The float dtype the tensors are made in.
    pub float: DType,
    /// Relative tolerance for element-wise results reduced in another order than their twin.
    pub tolerance: f64,
    /// Relative tolerance for results of matrix products split over ranks.
    pub matmul_tolerance: f64,
    /// How many ranks the collective tests use.
    pub world: usize,
    /// The dtype a quantized (FP8/FP4) product writes its output in: f32 where it is emulated
    /// (the CPU), bf16 from the FP8 GEMMs on CUDA.
    pub quantized_output: DType,
}

impl Harness {
    /// Ranks as threads on the CPU, in f32.
    pub fn cpu(world: usize) -> Self {
        Self {
            device_of: |_| Device::flex(),
            float: DType::F32,
            // Results summed over ≤ 4 ranks in another order than the twin: a few f32 ulps.
            tolerance: 1e-5,
            // Products whose inner dim (≤ 688 terms) is split over ranks sum in another order:
            // f32 rounding grows with the terms, staying well under 1e-4 of the largest value.
            matmul_tolerance: 1e-4,
            world,
            quantized_output: DType::F32,
        }
    }

    /// Ranks on CUDA devices `0..world`, in `float`, with a relative `tolerance` whose reason
    /// the caller states.
    #[cfg(feature = "cuda")]
    pub fn cuda(world: usize, float: DType, tolerance: f64, matmul_tolerance: f64) -> Self {
        Self {
            device_of: |i| Device::cuda(i),
            float,
            tolerance,
            matmul_tolerance,
            world,
            quantized_output: DType::BF16,
        }
    }

    /// Every rank on CUDA device 0: ranks sharing a GPU exchange data through host memory (the
    /// in-process transport), so a one-GPU machine runs the parallel suites' numerics.
    #[cfg(feature = "cuda")]
    pub fn on_one_gpu(self) -> Self {
        Self {
            device_of: |_| Device::cuda(0),
            ..self
        }
    }

    /// The device of a local rank.
    pub fn device(&self, local_rank: usize) -> Device {
        (self.device_of)(local_rank)
    }

    /// Runs `body` on every rank of `dims`, panicking with the cause if a rank fails.
    pub fn run<T: Send>(&self, dims: ParallelDims, body: impl Fn(RankContext) -> T + Sync) -> Vec<T> {
        self.run_with_timeout(dims, Duration::from_secs(45), body)
    }

    /// [`run`](Self::run) with a collective timeout.
    pub fn run_with_timeout<T: Send>(
        &self,
        dims: ParallelDims,
        timeout: Duration,
        body: impl Fn(RankContext) -> T + Sync,
    ) -> Vec<T> {
        launch_with(dims, LaunchOptions { timeout }, self.device_of, body).unwrap_or_else(|error| panic!("{error}"))
    }

    /// A world of `self.world` ranks, all on one axis (tensor parallelism).
    pub fn tp_world(&self) -> ParallelDims {
        ParallelDims::tp_dp(self.world, 1)
    }
}
