//! Column-parallel layers that read one input, multiplied as one product of their weights side
//! by side (`[i, o₁/tp + o₂/tp + …]`): q, k and v's three short products, or the gate and up
//! projections' two, run as one long one, and backward sums one gradient of the input where it
//! summed one a layer. The parameters stay the layers' own (checkpoints, Hugging Face names and
//! the post-training passes see them as before): the forward concatenates them, and each gets
//! its columns of the product's weight gradient.
//!
//! Under a quantized product the concatenated weight is quantized as one tensor, as Megatron's
//! fused projections are: one per-tensor scale for q, k and v together (for the gate and up
//! projections together).

use burn::tensor::Tensor;

use super::column::{ColumnInput, ColumnOutput, ColumnParallelLinear, Product, column_parallel};
use crate::error::LayerError;
use crate::precision::ptq::InputQuantizer;

/// Whether `layers` can multiply as one product: inside the tensor-parallel region with their
/// outputs sharded (over the first layer's group: the layers of one block share theirs), one
/// GEMM, and nothing that keeps a layer's product its own:
/// no delayed scaling's history (each layer records its own amaxes), no input quantizer
/// (post-training calibration observes each layer's input), no kept weight codes (a pipeline's
/// microbatches reuse each layer's own), biases on all of them or on none.
pub fn fusable(layers: &[&ColumnParallelLinear]) -> bool {
    let Some(first) = layers.first() else { return false };
    layers.iter().all(|l| {
        l.input == ColumnInput::InRegion
            && l.output == ColumnOutput::Sharded
            && l.gemm == first.gemm
            && l.amax_history.is_none()
            && matches!(l.input_quantizer, InputQuantizer::None)
            && l.weight_codes.is_none()
            && l.bias.is_some() == first.bias.is_some()
    })
}

/// `x` through every layer of `layers` (which must be [`fusable`]) as one product: their
/// outputs side by side.
///
/// # Shapes
/// `[.., s, i]` → `[.., s, Σ o_j/tp]`
pub fn fused_forward<const D: usize>(layers: &[&ColumnParallelLinear], x: Tensor<D>) -> Result<Tensor<D>, LayerError> {
    debug_assert!(fusable(layers), "layers that multiply apart");
    let first = layers[0];
    let weight = Tensor::cat(layers.iter().map(|l| l.weight.val()).collect(), 1);
    let bias = first.bias.as_ref().map(|_| {
        Tensor::cat(
            layers.iter().filter_map(|l| l.bias.as_ref().map(|b| b.val())).collect(),
            0,
        )
    });
    let product = Product {
        gemm: first.gemm,
        quantizer: &InputQuantizer::None,
        delayed: None,
        shared: None,
        weight_codes: None,
    };
    column_parallel(
        x,
        weight,
        bias,
        ColumnInput::InRegion,
        ColumnOutput::Sharded,
        product,
        &first.tp,
    )
}
