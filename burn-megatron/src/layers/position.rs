//! Learned position embeddings (GPT-2's) that know about sequence parallelism.
//!
//! Legend: `s` sequence, `d` d_model, `tp` group size.

use burn::config::Config;
use burn::module::{Module, Param};
use burn::nn::Embedding;
use burn::tensor::{Device, Tensor};
use burn_megatron_dist::{ProcessGroup, ProcessGroups};

use super::sequence::SequenceLayout;

use crate::error::{ConfigError, LayerError};
use crate::init::{ParamInit, Shard};

/// Configuration of a [`PositionEmbedding`].
#[derive(Config, Debug)]
pub struct PositionEmbeddingConfig {
    /// The positions it holds: the longest sequence.
    pub max_seq_len: usize,
    pub d_model: usize,
    /// The layout along the sequence of the activations it is added to.
    #[config(default = "SequenceLayout::Whole")]
    pub sequence: SequenceLayout,
    /// Standard deviation of the normal initialization.
    #[config(default = 0.02)]
    pub init_std: f64,
}

/// One learned vector a position, whole on every rank. Under sequence parallelism each rank
/// adds the rows of its own positions only, so the table's gradient on a rank is a partial
/// sum, all-reduced over the tensor-parallel group in the backward pass
/// ([`SequenceLayout::replicated`]).
#[derive(Module, Debug)]
pub struct PositionEmbedding {
    /// `[max_seq_len, d]`
    pub weight: Param<Tensor<2>>,
    #[module(skip)]
    pub sequence: SequenceLayout,
    #[module(skip)]
    pub tp: ProcessGroup,
}

impl PositionEmbeddingConfig {
    /// The whole table on every rank; `name` is the layer's path, which seeds it.
    pub fn init(&self, device: &Device, groups: &ProcessGroups, init: &ParamInit, name: &str) -> PositionEmbedding {
        let shape = [self.max_seq_len, self.d_model];
        let weight = init.normal(&format!("{name}.weight"), shape, Shard::WHOLE, self.init_std, device);
        PositionEmbedding::from_table(weight, self.sequence, groups)
    }
}

impl PositionEmbedding {
    /// A Burn `Embedding` of positions (the same on every rank: each keeps all of it).
    pub fn from_embedding(embedding: Embedding, sequence: SequenceLayout, groups: &ProcessGroups) -> Self {
        Self::from_table(embedding.weight.val(), sequence, groups)
    }

    fn from_table(weight: Tensor<2>, sequence: SequenceLayout, groups: &ProcessGroups) -> Self {
        Self {
            // A new leaf: another module's parameter must not stay attached to it.
            weight: Param::from_tensor(weight.detach()),
            sequence,
            tp: groups.tp.clone(),
        }
    }

    /// The embeddings of this rank's positions in a sequence of `seq_len` tokens: all of
    /// them, or under sequence parallelism its shard, positions `[r·s/tp, (r+1)·s/tp)`.
    ///
    /// # Shapes
    /// `[1, s, d]`, or `[1, s/tp, d]` under sequence parallelism
    pub fn forward(&self, seq_len: usize) -> Result<Tensor<3>, LayerError> {
        let [max_seq_len, _] = self.weight.dims();
        if seq_len > max_seq_len {
            return Err(ConfigError::SequenceTooLong { seq_len, max_seq_len }.into());
        }
        let (start, len) = match self.sequence {
            SequenceLayout::Whole => (0, seq_len),
            SequenceLayout::Sharded => {
                let tp = self.tp.size();
                if !seq_len.is_multiple_of(tp) {
                    return Err(ConfigError::SequenceNotDivisible { seq_len, tp }.into());
                }
                (self.tp.group_rank() * seq_len / tp, seq_len / tp)
            }
        };
        let table = self.sequence.replicated(self.weight.val(), &self.tp)?;
        Ok(table.narrow(0, start, len).unsqueeze())
    }
}

#[cfg(test)]
mod tests {
    use burn::nn::EmbeddingConfig;
    use burn::tensor::{Int, TensorData};

    use super::*;
    use crate::init::normal;

    /// Without sequence parallelism the layer is Burn's `Embedding` of the positions `0..s`,
    /// value for value (a lookup copies rows); a sequence past the table is a typed error.
    #[test]
    fn matches_burn_embedding_of_positions() {
        let dev = Device::flex();
        let mut theirs = EmbeddingConfig::new(6, 4).init(&dev);
        theirs.weight = Param::from_tensor(normal([6, 4], 3, 1.0, &dev));
        let ours = PositionEmbedding::from_embedding(theirs.clone(), SequenceLayout::Whole, &ProcessGroups::single());
        let positions = Tensor::<2, Int>::from_data(TensorData::new(vec![0i64, 1, 2, 3], [1, 4]), &dev);
        ours.forward(4)
            .unwrap()
            .into_data()
            .assert_eq(&theirs.forward(positions).into_data(), true);
        assert_eq!(
            ours.forward(7).unwrap_err(),
            LayerError::Config(ConfigError::SequenceTooLong {
                seq_len: 7,
                max_seq_len: 6
            })
        );
    }
}
