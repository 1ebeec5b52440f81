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
        if sp && !seq_len.is_multiple_of(tp) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::llama::recipes;
    use burn_megatron_dist::MeshError;

    fn plan(tp: usize, sp: bool) -> ParallelPlan {
        ParallelPlan::new(ParallelDims::tp_dp(tp, 1), sp)
    }

    #[test]
    fn every_bad_layout_is_a_typed_error_before_init() {
        let tiny = || recipes::tiny().model; // 4 heads, ffn 688, head_dim 64
        assert!(plan(4, true).apply(tiny(), 4, 256).is_ok());
        assert_eq!(
            plan(3, false).apply(tiny(), 3, 256).unwrap_err(),
            ConfigError::NotDivisible { what: "n_heads", size: 4, tp: 3 }
        );
        let mut gqa = tiny();
        gqa.attention.n_kv_heads = 2;
        assert_eq!(plan(4, false).apply(gqa, 4, 256).unwrap_err(), ConfigError::NotDivisible { what: "n_kv_heads", size: 2, tp: 4 });
        let mut ffn = tiny();
        ffn.mlp.d_ff = 690;
        assert_eq!(plan(4, false).apply(ffn, 4, 256).unwrap_err(), ConfigError::NotDivisible { what: "d_ff", size: 690, tp: 4 });
        assert_eq!(plan(4, true).apply(tiny(), 4, 254).unwrap_err(), ConfigError::SequenceNotDivisible { seq_len: 254, tp: 4 });
        // Without SP the sequence need not split.
        assert!(plan(4, false).apply(tiny(), 4, 254).is_ok());
        assert!(matches!(plan(2, false).apply(tiny(), 4, 256).unwrap_err(), ConfigError::Mesh(MeshError::WorldSizeMismatch { .. })));
        let mut odd = tiny();
        odd.attention.d_model = 4 * 63;
        assert_eq!(plan(1, false).apply(odd, 1, 256).unwrap_err(), ConfigError::OddHeadDim { head_dim: 63 });
        let mut kv = tiny();
        kv.attention.n_kv_heads = 3;
        assert_eq!(plan(1, false).apply(kv, 1, 256).unwrap_err(), ConfigError::HeadsNotMultipleOfKvHeads { n_heads: 4, n_kv_heads: 3 });
    }

    #[test]
    fn the_plan_sets_sequence_parallelism_and_the_output_layout() {
        let config = plan(2, true).apply(recipes::tiny().model, 2, 256).unwrap();
        assert!(config.attention.sequence_parallel && config.mlp.sequence_parallel && config.norm.sequence_parallel);
        assert!(config.embedding.sequence_parallel);
        assert_eq!(config.output.input, ColumnInput::SequenceSharded);
        // At tp = 1 SP means nothing and stays off.
        let single = plan(1, true).apply(recipes::tiny().model, 1, 256).unwrap();
        assert!(!single.attention.sequence_parallel);
    }
}
