//! Row-parallel linear: the input features are split over the tensor-parallel group and the
//! partial products are summed.
//!
//! Legend: `b` batch, `s` sequence, `i` input features, `o` output features, `tp` group size.

use burn::config::Config;
use burn::module::{Module, Param};
use burn::nn::Linear;
use burn::tensor::{Device, Tensor};
use burn_megatron_dist::mappings::{copy_to_tp, reduce_from_tp, reduce_scatter_to_sp, scatter_to_sp};
use burn_megatron_dist::{ProcessGroup, ProcessGroups};
use burn_megatron_kernels::{Gemm, linear_onto};

use crate::layers::residual::Residual;
use crate::precision::linear::LinearPrecision;

use crate::error::{LayerError, divisible};
use crate::init::{ParamInit, Shard};

/// What reaches a row-parallel layer.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum RowInput {
    /// This rank's slice of the input features (the output of a column-parallel layer).
    Sharded,
    /// All input features, the same on every rank: each rank keeps its slice.
    Replicated,
}

/// What a row-parallel layer returns.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum RowOutput {
    /// The summed output, whole on every rank.
    Reduced,
    /// The summed output's shard of the sequence (dim `D-2`): sequence parallelism.
    SequenceScattered,
}

/// Configuration of a [`RowParallelLinear`].
#[derive(Config, Debug)]
pub struct RowParallelLinearConfig {
    /// Input features of the whole layer (all ranks together).
    pub d_input: usize,
    /// Output features.
    pub d_output: usize,
    #[config(default = false)]
    pub bias: bool,
    #[config(default = "RowInput::Sharded")]
    pub input: RowInput,
    #[config(default = "RowOutput::Reduced")]
    pub output: RowOutput,
    /// The matrix product, forward and backward (set by a precision policy).
    #[config(default = "Gemm::Wgmma")]
    pub gemm: Gemm,
    /// Standard deviation of the normal initialization.
    #[config(default = 0.02)]
    pub init_std: f64,
}

/// `y = Σ_ranks x_r·W_r + b` with `W` split by input rows: this rank holds `[i/tp, o]`.
#[derive(Module, Debug)]
pub struct RowParallelLinear {
    /// `[i/tp, o]`, Burn's `[d_in, d_out]` layout.
    pub weight: Param<Tensor<2>>,
    /// `[o]`, whole on every rank, added once after the sum.
    pub bias: Option<Param<Tensor<1>>>,
    #[module(skip)]
    pub input: RowInput,
    #[module(skip)]
    pub output: RowOutput,
    /// How it multiplies: its GEMM, input quantizer, delayed scaling's history, kept codes.
    pub precision: LinearPrecision,
    #[module(skip)]
    pub tp: ProcessGroup,
}

impl RowParallelLinearConfig {
    /// Initializes this rank's shard over `groups.tp`; `name` is the parameter's path, which
    /// seeds it.
    pub fn init(
        &self,
        device: &Device,
        groups: &ProcessGroups,
        init: &ParamInit,
        name: &str,
    ) -> Result<RowParallelLinear, LayerError> {
        let tp = &groups.tp;
        divisible("d_input", self.d_input, tp.size())?;
        let shard = Shard::new(0, tp.group_rank(), tp.size());
        let weight = init.normal(
            &format!("{name}.weight"),
            [self.d_input, self.d_output],
            shard,
            self.init_std,
            device,
        );
        let bias = self.bias.then(|| init.zeros([self.d_output], device));
        Ok(RowParallelLinear::from_parts(weight, bias, self.input, self.output, tp).with_gemm(self.gemm))
    }
}

impl RowParallelLinear {
    /// This rank's shard over `groups.tp` of a whole Burn `Linear` (the same on every rank),
    /// multiplying with [`Gemm::Wgmma`] until [`with_gemm`](Self::with_gemm).
    pub fn from_linear(
        linear: Linear,
        input: RowInput,
        output: RowOutput,
        groups: &ProcessGroups,
    ) -> Result<Self, LayerError> {
        let tp = &groups.tp;
        let [d_input, _] = linear.weight.dims();
        divisible("d_input", d_input, tp.size())?;
        let weight = Shard::new(0, tp.group_rank(), tp.size()).slice(linear.weight.val());
        Ok(Self::from_parts(
            weight,
            linear.bias.map(|b| b.val()),
            input,
            output,
            tp,
        ))
    }

    /// The whole layer as a Burn `Linear`, gathered from every rank.
    pub fn to_linear(&self) -> Result<Linear, LayerError> {
        let weight = self.tp.all_gather(self.weight.val().detach(), 0)?;
        let bias = self.bias.as_ref().map(|b| Param::from_tensor(b.val().detach()));
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
        input: RowInput,
        output: RowOutput,
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
    /// - input: `[.., s, i/tp]`, or `[.., s, i]` with [`RowInput::Replicated`]
    /// - output: `[.., s, o]`, or `[.., s/tp, o]` with [`RowOutput::SequenceScattered`]
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Result<Tensor<D>, LayerError> {
        let x = match self.input {
            RowInput::Sharded => x,
            RowInput::Replicated => scatter_to_sp(x, &self.tp, D - 1)?,
        };
        // This rank's input features only.
        let partial = self
            .precision
            .product(x, self.weight.val(), None, true, None, &self.tp)?;
        let y = self.sum_partials(partial)?;
        Ok(match &self.bias {
            None => y,
            // With a scattered output each rank adds the bias to its own tokens only, so the
            // bias gradient is a partial sum: all-reduce it over the group.
            Some(b) if self.output == RowOutput::SequenceScattered => y + copy_to_tp(b.val(), &self.tp)?.unsqueeze(),
            Some(b) => y + b.val().unsqueeze(),
        })
    }

    /// `stream + self.forward(x)`, the stream's gradient handed to its norm ([`Residual`]):
    /// added in the product's kernel where [`Self::plain_whole`] says, else after the product.
    ///
    /// # Shapes
    /// [`Self::forward`]'s, `stream` of the output's
    pub fn forward_onto(&self, x: Tensor<3>, stream: Residual) -> Result<Tensor<3>, LayerError> {
        Ok(match self.plain_whole() {
            Some(gemm) => {
                let (stream, link) = stream.into_parts();
                linear_onto(stream, x, self.weight.val(), gemm, &link)
            }
            None => stream.add_branch(self.forward(x)?),
        })
    }

    /// [`Self::plain_product`] where this rank's product is the whole output (a group of one:
    /// nothing to sum), so the op that computes it may add it onto the residual stream too.
    pub fn plain_whole(&self) -> Option<Gemm> {
        self.plain_product().filter(|_| self.tp.size() == 1)
    }

    /// The product as a plain bf16 product of this rank's input features (no bias, no
    /// quantization), or `None`: then another op may compute it (the MLP's fused SwiGLU and down
    /// projection, `burn_megatron_kernels::gated_mlp::gated_mlp`), leaving [`Self::sum_partials`] to
    /// this layer.
    pub fn plain_product(&self) -> Option<Gemm> {
        let mapped = self.bias.is_some() || self.input != RowInput::Sharded;
        self.precision.plain_gemm().filter(|_| !mapped)
    }

    /// This rank's partial product `[.., s, o]` summed over the group: whole, or each rank's
    /// sequence shard ([`RowOutput`]).
    pub fn sum_partials<const D: usize>(&self, partial: Tensor<D>) -> Result<Tensor<D>, LayerError> {
        Ok(match self.output {
            RowOutput::Reduced => reduce_from_tp(partial, &self.tp)?,
            RowOutput::SequenceScattered => reduce_scatter_to_sp(partial, &self.tp, D - 2)?,
        })
    }
}
