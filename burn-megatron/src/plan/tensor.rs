//! Tensor parallelism: each layer's weights split over the tp group, with or without sequence
//! parallelism (activations between the layers split along the sequence, Megatron's SP).
//!
//! Each layer configuration says how it splits ([`TensorParallelLayer`], its *style* in
//! torchtitan's words); a model lists its layers by name (`models/llama/plan.rs`) and the plan
//! lays each out.

use crate::error::{ConfigError, divisible};
use crate::layers::{
    ColumnInput, ColumnParallelLinearConfig, LayerNormConfig, ParallelAttentionConfig, ParallelMlpConfig,
    PositionEmbeddingConfig, RmsNormConfig, RowOutput, RowParallelLinearConfig, SequenceLayout,
    VocabParallelEmbeddingConfig,
};

/// The plan's choice for the tensor dimension.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TensorParallel {
    /// Weights split over tp; activations between layers whole on every tp rank.
    #[default]
    Plain,
    /// Weights split over tp; activations between layers split along the sequence, gathered
    /// before and reduce-scattered after each tensor-parallel region (Megatron's SP).
    SequenceParallel,
}

impl TensorParallel {
    /// The activations' layout between layers at `tp` ranks for sequences of `seq_len` tokens:
    /// sequence parallelism needs the sequence to split evenly, and means nothing at tp = 1.
    pub fn layout(self, tp: usize, seq_len: usize) -> Result<SequenceLayout, ConfigError> {
        match self {
            Self::SequenceParallel if tp > 1 => match seq_len.is_multiple_of(tp) {
                true => Ok(SequenceLayout::Sharded),
                false => Err(ConfigError::SequenceNotDivisible { seq_len, tp }),
            },
            _ => Ok(SequenceLayout::Whole),
        }
    }
}

/// A layer configuration tensor parallelism can lay out: its style.
pub trait TensorParallelLayer {
    /// Checks that the layer splits over `tp` ranks and sets the layout of the activations it
    /// reads and writes.
    fn plan_tensor(&mut self, tp: usize, sequence: SequenceLayout) -> Result<(), ConfigError>;
}

/// A layer of a model's table, borrowed.
impl<T: TensorParallelLayer + ?Sized> TensorParallelLayer for &mut T {
    fn plan_tensor(&mut self, tp: usize, sequence: SequenceLayout) -> Result<(), ConfigError> {
        (**self).plan_tensor(tp, sequence)
    }
}

/// Vocabulary rows split; the output summed over tp, or reduce-scattered along the sequence.
impl TensorParallelLayer for VocabParallelEmbeddingConfig {
    fn plan_tensor(&mut self, _tp: usize, sequence: SequenceLayout) -> Result<(), ConfigError> {
        // The vocabulary is padded to a multiple of tp at init: any size splits.
        self.sequence = sequence;
        Ok(())
    }
}

/// Heads split: q, k and v column-wise, the output projection row-wise.
impl TensorParallelLayer for ParallelAttentionConfig {
    fn plan_tensor(&mut self, tp: usize, sequence: SequenceLayout) -> Result<(), ConfigError> {
        self.validate(tp)?;
        self.sequence = sequence;
        Ok(())
    }
}

/// Heads split: the latents' up projections column-wise, the output projection row-wise; the
/// down projections and the latents' norms whole on every rank.
impl TensorParallelLayer for crate::layers::LatentAttentionConfig {
    fn plan_tensor(&mut self, tp: usize, sequence: SequenceLayout) -> Result<(), ConfigError> {
        self.validate(tp)?;
        self.sequence = sequence;
        Ok(())
    }
}

/// Hidden features split: gate and up projections column-wise, the down projection row-wise.
impl TensorParallelLayer for ParallelMlpConfig {
    fn plan_tensor(&mut self, tp: usize, sequence: SequenceLayout) -> Result<(), ConfigError> {
        divisible("d_ff", self.d_ff, tp)?;
        self.sequence = sequence;
        Ok(())
    }
}

/// The shared expert's hidden features split as the dense MLP's; the router replicated, routing
/// the whole tokens. The routed experts' split (over etp) is the expert plan's.
impl TensorParallelLayer for crate::layers::moe::MoeConfig {
    fn plan_tensor(&mut self, tp: usize, sequence: SequenceLayout) -> Result<(), ConfigError> {
        if let Some(f) = self.shared_d_ff {
            divisible("shared_d_ff", f, tp)?;
        }
        self.sequence = sequence;
        Ok(())
    }
}

/// The weight replicated; under SP each rank normalizes its own tokens.
impl TensorParallelLayer for RmsNormConfig {
    fn plan_tensor(&mut self, _tp: usize, sequence: SequenceLayout) -> Result<(), ConfigError> {
        self.sequence = sequence;
        Ok(())
    }
}

/// The weight and bias replicated; under SP each rank normalizes its own tokens.
impl TensorParallelLayer for LayerNormConfig {
    fn plan_tensor(&mut self, _tp: usize, sequence: SequenceLayout) -> Result<(), ConfigError> {
        self.sequence = sequence;
        Ok(())
    }
}

/// The table replicated; under SP each rank adds the rows of its own positions.
impl TensorParallelLayer for PositionEmbeddingConfig {
    fn plan_tensor(&mut self, _tp: usize, sequence: SequenceLayout) -> Result<(), ConfigError> {
        self.sequence = sequence;
        Ok(())
    }
}

/// Output features split; the input is gathered along the sequence first under SP. The output
/// layout (sharded or gathered) is the layer's own choice.
impl TensorParallelLayer for ColumnParallelLinearConfig {
    fn plan_tensor(&mut self, tp: usize, sequence: SequenceLayout) -> Result<(), ConfigError> {
        divisible("d_output", self.d_output, tp)?;
        self.input = ColumnInput::from(sequence);
        Ok(())
    }
}

/// Input features split, partial products summed; the sum reduce-scattered along the sequence
/// under SP. The input layout (sharded or replicated) is the layer's own choice.
impl TensorParallelLayer for RowParallelLinearConfig {
    fn plan_tensor(&mut self, tp: usize, sequence: SequenceLayout) -> Result<(), ConfigError> {
        divisible("d_input", self.d_input, tp)?;
        self.output = RowOutput::from(sequence);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequence_parallelism_needs_an_even_split_and_more_than_one_rank() {
        assert_eq!(
            TensorParallel::SequenceParallel.layout(2, 8),
            Ok(SequenceLayout::Sharded)
        );
        assert_eq!(TensorParallel::SequenceParallel.layout(1, 7), Ok(SequenceLayout::Whole));
        assert_eq!(TensorParallel::Plain.layout(4, 7), Ok(SequenceLayout::Whole));
        assert_eq!(
            TensorParallel::SequenceParallel.layout(4, 7),
            Err(ConfigError::SequenceNotDivisible { seq_len: 7, tp: 4 })
        );
    }

    #[test]
    fn a_row_parallel_layer_scatters_its_sum_under_sequence_parallelism() {
        let mut row = RowParallelLinearConfig::new(8, 4);
        row.plan_tensor(2, SequenceLayout::Sharded).unwrap();
        assert_eq!(row.output, RowOutput::SequenceScattered);
        assert_eq!(
            row.plan_tensor(3, SequenceLayout::Whole),
            Err(ConfigError::NotDivisible {
                what: "d_input",
                size: 8,
                tp: 3
            })
        );
    }
}
