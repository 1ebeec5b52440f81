//! Column-parallel linear: the output features are split over the tensor-parallel group.
//!
//! Legend: `b` batch, `s` sequence, `i` input features, `o` output features, `tp` group size.

use std::sync::Arc;

use burn::config::Config;
use burn::module::{Module, Param};
use burn::nn::Linear;
use burn::tensor::{Device, Tensor};
use burn_megatron_dist::mappings::{copy_to_tp, gather_from_sp, gather_from_tp};
use burn_megatron_dist::{ProcessGroup, ProcessGroups};
pub use burn_megatron_kernels::quant::product::{SharedInput, WeightCodes};
use burn_megatron_kernels::rope::RotatedHeads;
use burn_megatron_kernels::{Gemm, linear_rotated};

use crate::precision::linear::LinearPrecision;

use super::rope::Rope;
use crate::error::{LayerError, divisible};
use crate::init::{ParamInit, Shard};

/// What reaches a column-parallel layer.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum ColumnInput {
    /// The whole input, the same on every rank (its gradient is summed over the group).
    Replicated,
    /// This rank's shard of the sequence (dim `D-2`), gathered first (sequence parallelism).
    SequenceSharded,
    /// Already inside the tensor-parallel region: the caller applied the mapping once for
    /// several layers that share the input (q, k, v; the MLP's gate and up projections).
    InRegion,
}

/// What a column-parallel layer returns.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum ColumnOutput {
    /// This rank's slice of the output features (feeds a row-parallel layer).
    Sharded,
    /// All output features, gathered.
    Gathered,
}

/// Configuration of a [`ColumnParallelLinear`].
#[derive(Config, Debug)]
pub struct ColumnParallelLinearConfig {
    /// Input features.
    pub d_input: usize,
    /// Output features of the whole layer (all ranks together).
    pub d_output: usize,
    #[config(default = false)]
    pub bias: bool,
    #[config(default = "ColumnInput::Replicated")]
    pub input: ColumnInput,
    #[config(default = "ColumnOutput::Sharded")]
    pub output: ColumnOutput,
    /// The matrix product, forward and backward (set by a precision policy).
    #[config(default = "Gemm::Wgmma")]
    pub gemm: Gemm,
    /// Standard deviation of the normal initialization.
    #[config(default = 0.02)]
    pub init_std: f64,
}

/// `y = x·W + b` with `W` split by output columns: this rank holds `[i, o/tp]`.
#[derive(Module, Debug)]
pub struct ColumnParallelLinear {
    /// `[i, o/tp]`, Burn's `[d_in, d_out]` layout.
    pub weight: Param<Tensor<2>>,
    /// `[o/tp]`.
    pub bias: Option<Param<Tensor<1>>>,
    #[module(skip)]
    pub input: ColumnInput,
    #[module(skip)]
    pub output: ColumnOutput,
    /// How it multiplies: its GEMM, input quantizer, delayed scaling's history, kept codes.
    pub precision: LinearPrecision,
    #[module(skip)]
    pub tp: ProcessGroup,
}

impl ColumnParallelLinearConfig {
    /// Initializes this rank's shard over `groups.tp`; `name` is the parameter's path, which
    /// seeds it.
    pub fn init(
        &self,
        device: &Device,
        groups: &ProcessGroups,
        init: &ParamInit,
        name: &str,
    ) -> Result<ColumnParallelLinear, LayerError> {
        let tp = &groups.tp;
        divisible("d_output", self.d_output, tp.size())?;
        let shard = Shard::new(1, tp.group_rank(), tp.size());
        let weight = init.normal(
            &format!("{name}.weight"),
            [self.d_input, self.d_output],
            shard,
            self.init_std,
            device,
        );
        let bias = self.bias.then(|| {
            let bias_shard = Shard::new(0, tp.group_rank(), tp.size());
            init.zeros(bias_shard.shape([self.d_output]), device)
        });
        Ok(ColumnParallelLinear::from_parts(weight, bias, self.input, self.output, tp).with_gemm(self.gemm))
    }
}

impl ColumnParallelLinear {
    /// This rank's shard over `groups.tp` of a whole Burn `Linear` (the same on every rank),
    /// multiplying with [`Gemm::Wgmma`] until [`with_gemm`](Self::with_gemm).
    pub fn from_linear(
        linear: Linear,
        input: ColumnInput,
        output: ColumnOutput,
        groups: &ProcessGroups,
    ) -> Result<Self, LayerError> {
        let tp = &groups.tp;
        let [_, d_output] = linear.weight.dims();
        divisible("d_output", d_output, tp.size())?;
        let shard = |dim| Shard::new(dim, tp.group_rank(), tp.size());
        let weight = shard(1).slice(linear.weight.val());
        let bias = linear.bias.map(|b| shard(0).slice(b.val()));
        Ok(Self::from_parts(weight, bias, input, output, tp))
    }

    /// The whole layer as a Burn `Linear`, gathered from every rank.
    pub fn to_linear(&self) -> Result<Linear, LayerError> {
        let weight = self.tp.all_gather(self.weight.val().detach(), 1)?;
        let bias = match &self.bias {
            Some(b) => Some(Param::from_tensor(self.tp.all_gather(b.val().detach(), 0)?)),
            None => None,
        };
        Ok(Linear {
            weight: Param::from_tensor(weight),
            bias,
        })
    }

    /// The same layer multiplying with `gemm` (with delayed scaling, a history of its own).
    pub fn with_gemm(self, gemm: Gemm) -> Self {
        let precision = self.precision.with_gemm(gemm, &self.weight.val().device());
        Self { precision, ..self }
    }

    fn from_parts(
        weight: Tensor<2>,
        bias: Option<Tensor<1>>,
        input: ColumnInput,
        output: ColumnOutput,
        tp: &ProcessGroup,
    ) -> Self {
        Self {
            // New leaves: a slice of another module's parameter must not stay attached to it.
            weight: Param::from_tensor(weight.detach()),
            bias: bias.map(|b| Param::from_tensor(b.detach())),
            input,
            output,
            precision: LinearPrecision::plain(Gemm::Wgmma),
            tp: tp.clone(),
        }
    }

    /// # Shapes
    /// - input: `[.., s, i]`, or `[.., s/tp, i]` with [`ColumnInput::SequenceSharded`]
    /// - output: `[.., s, o/tp]`, or `[.., s, o]` with [`ColumnOutput::Gathered`]
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Result<Tensor<D>, LayerError> {
        self.forward_sharing(x, None)
    }

    /// The product when this layer's forward is exactly `x · weight` on its input as given: no
    /// mapping over tp, bias, input quantizer or output gather, and no quantized recipe (which
    /// quantizes its operands first). A caller fusing the product with others computes it
    /// itself then (`burn_megatron_kernels::gated_mlp`).
    pub fn plain_product(&self) -> Option<Gemm> {
        let mapped = self.bias.is_some() || self.input != ColumnInput::InRegion || self.output != ColumnOutput::Sharded;
        self.precision.plain_gemm().filter(|_| !mapped)
    }

    /// [`forward`](Self::forward) as heads of `rope`'s width, rotated by `rope` for their
    /// positions `0..s` in the product's epilogue where its kernel can (q's and k's projections:
    /// `burn_megatron_kernels::linear_rotated`), differentiable as the heads before the rotation
    /// ([`RotatedHeads`]); `None` unless the product is [`plain`](Self::plain_product).
    ///
    /// # Shapes
    /// `[b, s, i]` → `[b, o/(tp·k), s, k]`
    pub fn forward_rotated(&self, x: Tensor<3>, rope: &Rope) -> Option<RotatedHeads> {
        let (cos, sin) = rope.tables();
        linear_rotated(x, self.weight.val(), cos, sin, self.plain_product()?)
    }

    /// [`forward`](Self::forward), with this layer's quantization of its input shared with the
    /// other layers given the same `shared` in one call (q, k and v's projections of one input):
    /// quantized once where each would quantize it alike. An input quantizer that changes the
    /// input (post-training quantization) keeps it apart.
    ///
    /// # Shapes
    /// as [`forward`](Self::forward)
    pub fn forward_sharing<const D: usize>(
        &self,
        x: Tensor<D>,
        shared: Option<&Arc<SharedInput>>,
    ) -> Result<Tensor<D>, LayerError> {
        let bias = self.bias.as_ref().map(|b| b.val());
        let layout = (self.input, self.output);
        column_parallel(x, self.weight.val(), bias, layout, &self.precision, shared, &self.tp)
    }
}

/// A column-parallel product with a weight shard held elsewhere (tied word embeddings: the
/// embedding's rows, transposed): the input mapped as `input` says, multiplied under
/// `precision` (its quantization of the input shared as [`ColumnParallelLinear::forward_sharing`]
/// says), the output laid out as `output` says, exactly as [`ColumnParallelLinear::forward`]
/// does.
///
/// # Shapes
/// - `weight`: `[i, o/tp]`, `bias`: `[o/tp]`
/// - input and output: as [`ColumnParallelLinear::forward`]
pub fn column_parallel<const D: usize>(
    x: Tensor<D>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
    (input, output): (ColumnInput, ColumnOutput),
    precision: &LinearPrecision,
    shared: Option<&Arc<SharedInput>>,
    tp: &ProcessGroup,
) -> Result<Tensor<D>, LayerError> {
    let x = match input {
        ColumnInput::Replicated => copy_to_tp(x, tp)?,
        ColumnInput::SequenceSharded => gather_from_sp(x, tp, D - 2)?,
        ColumnInput::InRegion => x,
    };
    // The whole input on every rank: nothing of it is sharded.
    let y = precision.product(x, weight, bias, false, shared, tp)?;
    Ok(match output {
        ColumnOutput::Sharded => y,
        ColumnOutput::Gathered => gather_from_tp(y, tp, D - 1)?,
    })
}
