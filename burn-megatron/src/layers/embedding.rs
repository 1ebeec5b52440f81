//! Token embedding with the vocabulary split over the tensor-parallel group.
//!
//! Legend: `b` batch, `s` sequence, `d` d_model, `v` padded vocabulary.

use burn::config::Config;
use burn::module::{Module, Param};
use burn::nn::Embedding;
use burn::tensor::{Device, Int, Tensor};
use burn_megatron_dist::mappings::{reduce_from_tp, reduce_scatter_to_sp};
use burn_megatron_dist::{ProcessGroup, ProcessGroups};
use burn_megatron_kernels::Gemm;
use burn_megatron_kernels::embedding::embedding_rows;

use super::column::{ColumnInput, ColumnOutput, column_parallel};
use super::sequence::SequenceLayout;

use crate::error::LayerError;
use crate::init::{ParamInit, Shard};
use crate::precision::linear::LinearPrecision;

/// The vocabulary size padded up to a multiple of `multiple · tp`, so every rank holds the same
/// number of rows.
pub fn padded_vocab(vocab_size: usize, multiple: usize, tp: usize) -> usize {
    let step = multiple.max(1) * tp;
    vocab_size.div_ceil(step) * step
}

/// Configuration of a [`VocabParallelEmbedding`].
#[derive(Config, Debug)]
pub struct VocabParallelEmbeddingConfig {
    pub vocab_size: usize,
    pub d_model: usize,
    /// The padded vocabulary is a multiple of this times tp.
    #[config(default = 1)]
    pub pad_vocab_to_multiple_of: usize,
    /// The output's layout along the sequence (sequence parallelism: shards).
    #[config(default = "SequenceLayout::Whole")]
    pub sequence: SequenceLayout,
    #[config(default = 0.02)]
    pub init_std: f64,
}

/// Each rank holds the rows of a contiguous range of token ids; a token's embedding comes from
/// the rank that holds it and is summed over the group.
#[derive(Module, Debug)]
pub struct VocabParallelEmbedding {
    /// `[v/tp, d]`
    pub weight: Param<Tensor<2>>,
    pub vocab_size: usize,
    #[module(skip)]
    pub sequence: SequenceLayout,
    #[module(skip)]
    pub tp: ProcessGroup,
}

impl VocabParallelEmbeddingConfig {
    /// This rank's rows over `groups.tp`; `name` is the layer's path, which seeds it.
    pub fn init(
        &self,
        device: &Device,
        groups: &ProcessGroups,
        init: &ParamInit,
        name: &str,
    ) -> VocabParallelEmbedding {
        let tp = &groups.tp;
        let v = padded_vocab(self.vocab_size, self.pad_vocab_to_multiple_of, tp.size());
        let shard = Shard::new(0, tp.group_rank(), tp.size());
        let weight = init.normal(
            &format!("{name}.weight"),
            [v, self.d_model],
            shard,
            self.init_std,
            device,
        );
        VocabParallelEmbedding {
            weight: Param::from_tensor(weight),
            vocab_size: self.vocab_size,
            sequence: self.sequence,
            tp: tp.clone(),
        }
    }
}

impl VocabParallelEmbedding {
    /// This rank's rows over `groups.tp` of a whole Burn `Embedding`, padded with zero rows.
    pub fn from_embedding(
        embedding: Embedding,
        pad_vocab_to_multiple_of: usize,
        sequence: SequenceLayout,
        groups: &ProcessGroups,
    ) -> Self {
        let tp = &groups.tp;
        let weight = embedding.weight.val();
        let [vocab_size, d] = weight.dims();
        let v = padded_vocab(vocab_size, pad_vocab_to_multiple_of, tp.size());
        let weight = match v - vocab_size {
            0 => weight,
            extra => Tensor::cat(
                vec![
                    weight.clone(),
                    Tensor::zeros([extra, d], (&weight.device(), weight.dtype())),
                ],
                0,
            ),
        };
        VocabParallelEmbedding {
            weight: Param::from_tensor(Shard::new(0, tp.group_rank(), tp.size()).slice(weight).detach()),
            vocab_size,
            sequence,
            tp: tp.clone(),
        }
    }

    /// # Shapes
    /// `[b, s]` token ids → `[b, s, d]`, or `[b, s/tp, d]` with sequence parallelism.
    pub fn forward(&self, ids: Tensor<2, Int>) -> Result<Tensor<3>, LayerError> {
        let [rows, d] = self.weight.dims();
        let [b, s] = ids.dims();
        // This rank holds the ids [start, start + rows): another rank's fall outside the local
        // table, read zero rows and send no gradient.
        let start = (self.tp.group_rank() * rows) as i64;
        let local = ids.sub_scalar(start).reshape([b * s]);
        let partial = embedding_rows(self.weight.val(), local).reshape([b, s, d]);
        Ok(match self.sequence {
            SequenceLayout::Sharded => reduce_scatter_to_sp(partial, &self.tp, 1)?,
            SequenceLayout::Whole => reduce_from_tp(partial, &self.tp)?,
        })
    }

    /// The output layer tied to this embedding (GPT-2's): `x` against each vocabulary row this
    /// rank holds, the weight's gradient summing both uses. `x` lies along the sequence as
    /// this embedding's output does, and is gathered first under sequence parallelism; the
    /// logits stay split over the vocabulary for [`VocabParallelCrossEntropy`](super::VocabParallelCrossEntropy).
    ///
    /// # Shapes
    /// `[b, s, d]`, or `[b, s/tp, d]` with sequence parallelism → logits `[b, s, v/tp]`
    pub fn tied_logits(&self, x: Tensor<3>) -> Result<Tensor<3>, LayerError> {
        let weight = self.weight.val().transpose(); // [d, v/tp]
        let layout = (ColumnInput::from(self.sequence), ColumnOutput::Sharded);
        let precision = LinearPrecision::plain(Gemm::Wgmma);
        column_parallel(x, weight, None, layout, &precision, None, &self.tp)
    }
}

#[cfg(test)]
mod tests {
    use burn::module::Param;
    use burn::nn::EmbeddingConfig;
    use burn::tensor::{Device, TensorData};

    use super::*;

    /// At tp = 1 the layer is Burn's Embedding.
    #[test]
    fn matches_burn_embedding() {
        let dev = Device::flex();
        let mut theirs = EmbeddingConfig::new(11, 4).init(&dev);
        theirs.weight = Param::from_tensor(crate::init::normal([11, 4], 3, 1.0, &dev));
        let ours =
            VocabParallelEmbedding::from_embedding(theirs.clone(), 1, SequenceLayout::Whole, &ProcessGroups::single());
        let ids = Tensor::<2, Int>::from_data(TensorData::new(vec![0i64, 5, 10, 3, 3, 7], [2, 3]), &dev);
        // A lookup copies rows: exactly equal.
        ours.forward(ids.clone())
            .unwrap()
            .into_data()
            .assert_eq(&theirs.forward(ids).into_data(), true);
        // The tied output at tp = 1 is Burn's linear by the weight transposed; the product is
        // taken as one [b·s, d] matrix rather than per batch: f32 sums in another order.
        let x = crate::init::normal([2, 3, 4], 5, 1.0, &dev);
        let tied = ours.tied_logits(x.clone()).unwrap();
        let burn = burn::tensor::module::linear(x, theirs.weight.val().transpose(), None);
        let diff = (tied - burn).abs().max().into_scalar::<f32>();
        assert!(diff < 1e-6, "{diff}");
    }
}
