//! The parallel plan: tensor and sequence parallelism applied to a Llama configuration before
//! `init`, with every invariant checked up front.

use burn_megatron_dist::ParallelDims;

use super::model::LlamaConfig;
use crate::error::{ConfigError, divisible};
use crate::layers::{ColumnInput, ColumnOutput};

/// How a model is split.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParallelPlan {
    pub dims: ParallelDims,
    /// Sequence parallelism: activations outside attention and MLP are sequence shards.
    pub sequence_parallel: bool,
}

impl ParallelPlan {
    pub fn new(dims: ParallelDims, sequence_parallel: bool) -> Self {
        Self { dims, sequence_parallel }
    }

    /// Checks every invariant and rewrites `config` for this plan. `world_size` is the number
    /// of ranks the run has; `seq_len` the training sequence length.
    pub fn apply(&self, mut config: LlamaConfig, world_size: usize, seq_len: usize) -> Result<LlamaConfig, ConfigError> {
        self.dims.validate(world_size)?;
        let tp = self.dims.tp;
        let sp = self.sequence_parallel && tp > 1;
        config.attention.validate(tp)?;
        divisible("d_ff", config.mlp.d_ff, tp)?;
        if sp && seq_len % tp != 0 {
            return Err(ConfigError::SequenceNotDivisible { seq_len, tp });
        }
        config.embedding.sequence_parallel = sp;
        config.attention.sequence_parallel = sp;
        config.mlp.sequence_parallel = sp;
        config.norm.sequence_parallel = sp;
        // The output layer is as wide as the padded vocabulary, split over tp; its logits stay
        // split for the vocabulary-parallel loss.
        config.output.d_output = crate::layers::padded_vocab(
            config.embedding.vocab_size,
            config.embedding.pad_vocab_to_multiple_of,
            tp,
        );
        config.output.input = if sp { ColumnInput::SequenceSharded } else { ColumnInput::Replicated };
        config.output.output = ColumnOutput::Sharded;
        Ok(config)
    }
}
