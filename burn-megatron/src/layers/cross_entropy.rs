//! Cross-entropy over a vocabulary split across the tensor-parallel group. No rank ever holds
//! the logits of the whole vocabulary: the softmax's maximum and sum, and the target's logit,
//! are combined over the group. The sums over each slice come from one fused op on the logits in
//! their own dtype (`burn_megatron_kernels::cross_entropy`), so no f32 copy of them exists either.
//!
//! Legend: `b` batch, `s` sequence, `v` padded vocabulary, `n = b·s` tokens.

use burn::config::Config;
use burn::tensor::{DType, Int, Tensor};
use burn_megatron_dist::mappings::reduce_from_tp;
use burn_megatron_dist::{ProcessGroup, ProcessGroups, ReduceOp};
use burn_megatron_kernels::cross_entropy::partials;

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
    /// The ranks that hold different tokens of the batch (data × context parallelism).
    pub batch: ProcessGroup,
}

impl VocabParallelCrossEntropyConfig {
    /// The vocabulary split over `groups.tp`; tokens counted over `groups.grad_sync()`, the ranks
    /// that hold different tokens of the batch.
    pub fn init(&self, groups: &ProcessGroups) -> VocabParallelCrossEntropy {
        VocabParallelCrossEntropy {
            vocab_size: self.vocab_size,
            ignore_index: self.ignore_index,
            label_smoothing: self.label_smoothing,
            tp: groups.tp.clone(),
            batch: groups.grad_sync().clone(),
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
        let logits = logits.reshape([n, columns]); // [n, v/tp], in its own dtype
        // Padded vocabulary columns take no part.
        let valid = self.vocab_size.saturating_sub(start).min(columns);

        // The target's column in this slice, -1 where another rank holds it.
        let targets = targets.reshape([n]);
        let here = targets
            .clone()
            .greater_equal_elem(start as i64)
            .bool_and(targets.clone().lower_elem((start + valid) as i64));
        let column = targets
            .clone()
            .sub_scalar(start as i64)
            .mask_fill(here.clone().bool_not(), -1)
            .float()
            .cast(DType::F32);

        // This slice's row max and its sums under it in one pass over the logits, with no f32
        // copy of them (burn_megatron_kernels::cross_entropy).
        let sums = partials(logits, column, valid); // [n, 4]
        // Each slice's sums moved onto the rows' max over the whole vocabulary, by constants:
        // Σ exp scales by exp(m − max), each shifted logit moves by m − max (−∞ on a slice with
        // no real column, whose sums are zero and which holds no target).
        let local_max = sums.clone().narrow(1, 0, 1).detach(); // [n, 1]
        let max = self.tp.all_reduce(local_max.clone(), ReduceOp::Max)?;
        let shift = local_max - max; // [n, 1], ≤ 0
        let sum_exp = sums.clone().narrow(1, 1, 1) * shift.clone().exp();
        let log_sum_exp = reduce_from_tp(sum_exp, &self.tp)?.log(); // [n, 1]
        let target_shift = shift.clone().mask_fill(here.bool_not().reshape([n, 1]), 0.0);
        let target_logit = reduce_from_tp(sums.clone().narrow(1, 2, 1) + target_shift, &self.tp)?; // [n, 1]
        let mut token_loss = log_sum_exp.clone() - target_logit; // [n, 1]

        if self.label_smoothing > 0.0 {
            let real = match valid {
                0 => sums.narrow(1, 3, 1),
                _ => sums.narrow(1, 3, 1) + shift.mul_scalar(valid as f64),
            };
            let mean_logit = reduce_from_tp(real, &self.tp)?.div_scalar(self.vocab_size as f64);
            let smooth = log_sum_exp - mean_logit;
            token_loss = token_loss.mul_scalar(1.0 - self.label_smoothing) + smooth.mul_scalar(self.label_smoothing);
        }

        let counted = match self.ignore_index {
            Some(ignore) => targets.not_equal_elem(ignore),
            None => Tensor::<1, Int>::ones([n], &device).equal_elem(1),
        };
        let token_loss = token_loss.reshape([n]).mask_fill(counted.clone().bool_not(), 0.0);
        // The count stays on the device: reading it would wait for the forward pass each step.
        let count = self.batch.all_reduce(counted.int().sum(), ReduceOp::Sum)?.clamp_min(1);
        let scale = count
            .float()
            .cast(DType::F32)
            .recip()
            .mul_scalar(self.batch.size() as f64);
        Ok(token_loss.sum() * scale)
    }
}
