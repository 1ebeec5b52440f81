//! Cross-entropy over a vocabulary split across the tensor-parallel group. No rank ever holds
//! the logits of the whole vocabulary: the softmax's maximum and sum, and the target's logit,
//! are combined over the group.
//!
//! Legend: `b` batch, `s` sequence, `v` padded vocabulary, `n = b·s` tokens.

use burn::config::Config;
use burn::tensor::{DType, Int, Tensor};
use burn_megatron_dist::mappings::reduce_from_tp;
use burn_megatron_dist::{ProcessGroup, ReduceOp};

use crate::error::LayerError;

/// Configuration of a [`VocabParallelCrossEntropy`].
#[derive(Config, Debug)]
pub struct VocabParallelCrossEntropyConfig {
    /// The true vocabulary: logits of padded ids at or past it are ignored.
    pub vocab_size: usize,
    /// Targets equal to this contribute nothing (PyTorch's default, -100).
    #[config(default = "Some(-100)")]
    pub ignore_index: Option<i64>,
    /// Weight ε of the uniform distribution mixed into the targets.
    #[config(default = 0.0)]
    pub label_smoothing: f64,
}

/// The mean token loss over a tensor-parallel × data-parallel batch.
#[derive(Clone, Debug)]
pub struct VocabParallelCrossEntropy {
    pub vocab_size: usize,
    pub ignore_index: Option<i64>,
    pub label_smoothing: f64,
    pub tp: ProcessGroup,
    /// The ranks that hold different samples of the batch (data parallelism).
    pub batch: ProcessGroup,
}

impl VocabParallelCrossEntropyConfig {
    pub fn init(&self, tp: &ProcessGroup, batch: &ProcessGroup) -> VocabParallelCrossEntropy {
        VocabParallelCrossEntropy {
            vocab_size: self.vocab_size,
            ignore_index: self.ignore_index,
            label_smoothing: self.label_smoothing,
            tp: tp.clone(),
            batch: batch.clone(),
        }
    }
}

impl VocabParallelCrossEntropy {
    /// The loss of this rank's share of the batch, normalized so that the average over the
    /// batch group is the mean over every counted token of the global batch: this rank's sum
    /// times `batch.size() / global count`. Averaging gradients over the batch group (as data
    /// parallelism does) then gives the global mean's gradient.
    ///
    /// # Shapes
    /// - logits: `[b, s, v/tp]`, this rank's vocabulary slice
    /// - targets: `[b, s]`
    /// - output: `[1]`
    pub fn forward(&self, logits: Tensor<3>, targets: Tensor<2, Int>) -> Result<Tensor<1>, LayerError> {
        let [b, s, columns] = logits.dims();
        let n = b * s;
        let start = self.tp.group_rank() * columns;
        let device = logits.device();
        let logits = logits.reshape([n, columns]).cast(DType::F32); // [n, v/tp]

        // Padded vocabulary columns take no part.
        let ids = Tensor::<1, Int>::arange(start as i64..(start + columns) as i64, &device).unsqueeze::<2>(); // [1, v/tp]
        let padded = ids.greater_equal_elem(self.vocab_size as i64).expand([n, columns]);
        let logits = logits.mask_fill(padded.clone(), f32::NEG_INFINITY);

        // Softmax statistics over the whole vocabulary.
        let local_max = logits.clone().detach().max_dim(1); // [n, 1]
        let max = self.tp.all_reduce(local_max, ReduceOp::Max)?;
        let shifted = logits - max; // [n, v/tp]
        let sum_exp = reduce_from_tp(shifted.clone().exp().sum_dim(1), &self.tp)?; // [n, 1]
        let log_sum_exp = sum_exp.log();

        // The target's logit, from the rank that holds it.
        let targets = targets.reshape([n]);
        let here = targets.clone().greater_equal_elem(start as i64).bool_and(targets.clone().lower_elem((start + columns) as i64));
        let local = targets.clone().sub_scalar(start as i64).mask_fill(here.clone().bool_not(), 0);
        let picked = shifted.clone().gather(1, local.unsqueeze_dim(1)).mask_fill(here.bool_not().unsqueeze_dim(1), 0.0);
        let target_logit = reduce_from_tp(picked, &self.tp)?; // [n, 1]
        let mut token_loss = log_sum_exp.clone() - target_logit; // [n, 1]

        if self.label_smoothing > 0.0 {
            let real = shifted.mask_fill(padded, 0.0).sum_dim(1); // [n, 1]
            let mean_logit = reduce_from_tp(real, &self.tp)?.div_scalar(self.vocab_size as f64);
            let smooth = log_sum_exp - mean_logit;
            token_loss = token_loss.mul_scalar(1.0 - self.label_smoothing) + smooth.mul_scalar(self.label_smoothing);
        }

        let counted = match self.ignore_index {
            Some(ignore) => targets.not_equal_elem(ignore),
            None => Tensor::<1, Int>::ones([n], &device).equal_elem(1),
        };
        let token_loss = token_loss.reshape([n]).mask_fill(counted.clone().bool_not(), 0.0);
        let count = self.batch.all_reduce(counted.int().sum(), ReduceOp::Sum)?.into_scalar::<i64>().max(1);
        Ok(token_loss.sum().mul_scalar(self.batch.size() as f64 / count as f64))
    }
}
