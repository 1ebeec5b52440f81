//! A linear layer whole on every tensor-parallel rank (Megatron's `duplicated` linears): the
//! low-rank down projections of multi-head latent attention, which every rank's heads read.
//!
//! Legend: `i` input features, `o` output features.

use burn::config::Config;
use burn::module::{Module, Param};
use burn::tensor::{Device, Tensor};
use burn_megatron_dist::{ProcessGroup, ProcessGroups};
use burn_megatron_kernels::Gemm;

use super::sequence::SequenceLayout;
use crate::error::LayerError;
use crate::init::{ParamInit, Shard};
use crate::precision::linear::LinearPrecision;

/// Configuration of a [`ReplicatedLinear`].
#[derive(Config, Debug)]
pub struct ReplicatedLinearConfig {
    pub d_input: usize,
    pub d_output: usize,
    /// The input's layout along the sequence: under sequence parallelism each rank multiplies
    /// its own tokens, and the weight's gradient is summed over tp.
    #[config(default = "SequenceLayout::Whole")]
    pub sequence: SequenceLayout,
    #[config(default = "Gemm::Wgmma")]
    pub gemm: Gemm,
    #[config(default = 0.02)]
    pub init_std: f64,
}

/// `y = x·W` with `W` `[i, o]` whole on every rank. Its output's gradient must be whole on every
/// rank (the caller maps the output into the tensor-parallel region, whose backward sums it over
/// tp), so the weight's gradient is too; with sequence shards it is summed over tp.
#[derive(Module, Debug)]
pub struct ReplicatedLinear {
    /// `[i, o]`, Burn's layout.
    pub weight: Param<Tensor<2>>,
    pub precision: LinearPrecision,
    #[module(skip)]
    pub sequence: SequenceLayout,
    #[module(skip)]
    pub tp: ProcessGroup,
}

impl ReplicatedLinearConfig {
    /// The whole weight on every rank; `name` is its path, which seeds it.
    pub fn init(&self, device: &Device, groups: &ProcessGroups, init: &ParamInit, name: &str) -> ReplicatedLinear {
        let weight = init.normal(
            &format!("{name}.weight"),
            [self.d_input, self.d_output],
            Shard::WHOLE,
            self.init_std,
            device,
        );
        ReplicatedLinear {
            weight: Param::from_tensor(weight),
            precision: LinearPrecision::plain(self.gemm),
            sequence: self.sequence,
            tp: groups.tp.clone(),
        }
    }
}

impl ReplicatedLinear {
    /// # Shapes
    /// `[.., i]` → `[.., o]`
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Result<Tensor<D>, LayerError> {
        let weight = self.sequence.replicated(self.weight.val(), &self.tp)?;
        let sharded = self.sequence == SequenceLayout::Sharded;
        self.precision.product(x, weight, None, sharded, None, &self.tp)
    }
}
