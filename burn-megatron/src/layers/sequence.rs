//! How activations lie along the sequence between the tensor-parallel layers.

use burn::config::Config;

/// The layout of a layer's input and output activations over the tensor-parallel group.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum SequenceLayout {
    /// Every tp rank holds the whole sequence (tensor parallelism alone).
    Whole,
    /// Each tp rank holds its shard of the sequence, dim `D-2` (sequence parallelism).
    Sharded,
}
