//! How activations lie along the sequence between the tensor-parallel layers.

use burn::config::Config;
use burn::tensor::Tensor;
use burn_megatron_dist::mappings::copy_to_tp;
use burn_megatron_dist::{CommError, ProcessGroup};

use super::column::ColumnInput;
use super::row::RowOutput;

/// The layout of a layer's input and output activations over the tensor-parallel group.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum SequenceLayout {
    /// Every tp rank holds the whole sequence (tensor parallelism alone).
    Whole,
    /// Each tp rank holds its shard of the sequence, dim `D-2` (sequence parallelism).
    Sharded,
}

impl SequenceLayout {
    /// A parameter every tp rank holds whole (a norm's weight and bias, learned positions) as a
    /// layer reading activations in this layout uses it. Sharded, each rank's tokens give only
    /// part of its gradient, so the backward pass sums the gradient over `tp` (`copy_to_tp`)
    /// and every rank steps it alike; whole, each rank's gradient is the whole one already and
    /// the parameter passes as it is.
    pub fn replicated<const D: usize>(self, param: Tensor<D>, tp: &ProcessGroup) -> Result<Tensor<D>, CommError> {
        match self {
            Self::Sharded => copy_to_tp(param, tp),
            Self::Whole => Ok(param),
        }
    }
}

/// What a column-parallel layer reads when the activations before it lie as `layout` says:
/// gathered along the sequence first under sequence parallelism.
impl From<SequenceLayout> for ColumnInput {
    fn from(layout: SequenceLayout) -> Self {
        match layout {
            SequenceLayout::Sharded => Self::SequenceSharded,
            SequenceLayout::Whole => Self::Replicated,
        }
    }
}

/// What a row-parallel layer writes when the activations after it lie as `layout` says:
/// reduce-scattered along the sequence under sequence parallelism.
impl From<SequenceLayout> for RowOutput {
    fn from(layout: SequenceLayout) -> Self {
        match layout {
            SequenceLayout::Sharded => Self::SequenceScattered,
            SequenceLayout::Whole => Self::Reduced,
        }
    }
}
