//! The forward KL divergence `KL(p_teacher ‖ p_student)` of softened logits over a vocabulary
//! split across the tensor-parallel group: no rank holds a token's whole distribution; each
//! softmax's maximum and sum are combined over the group, as the cross-entropy does.
//!
//! With `z/T` the logits over the temperature, per token:
//!
//! ```text
//! KL = Σ_v p_t (log p_t − log p_s) = Σ_v p_t log p_t − Σ_v p_t z_s/T + logsumexp(z_s/T)
//! ```
//!
//! whose gradient in the student's logits is `(p_s − p_t) / T`; the loss is `T² · KL` (Hinton's
//! scaling, so the gradient's size does not shrink with `T`). The teacher's side carries no
//! gradient.
//!
//! Legend: `n` tokens, `v'` this rank's share of the padded vocabulary.

use burn::tensor::{DType, Tensor};
use burn_megatron_dist::mappings::reduce_from_tp;
use burn_megatron_dist::{ProcessGroup, ProcessGroups, ReduceOp};

use crate::error::LayerError;

/// The mean token KL over a tensor-parallel × data-parallel batch.
#[derive(Clone, Debug)]
pub struct VocabParallelKl {
    /// The true vocabulary: padded columns at or past it are ignored.
    pub vocab_size: usize,
    pub temperature: f64,
    pub tp: ProcessGroup,
    /// The ranks holding different tokens of the batch (data × context parallelism).
    pub batch: ProcessGroup,
}

impl VocabParallelKl {
    pub fn new(vocab_size: usize, temperature: f64, groups: &ProcessGroups) -> Self {
        Self {
            vocab_size,
            temperature,
            tp: groups.tp.clone(),
            batch: groups.grad_sync().clone(),
        }
    }

    /// `T² · KL` of this rank's tokens, normalized so that its average over the batch group is
    /// the mean over every token of the global batch (this rank's sum times
    /// `batch.size() / global count`).
    ///
    /// # Shapes
    /// - student, teacher: `[b, s, v']`, this rank's vocabulary slice of each
    /// - output: `[1]`
    pub fn forward(&self, student: Tensor<3>, teacher: Tensor<3>) -> Result<Tensor<1>, LayerError> {
        let [b, s, columns] = student.dims();
        let n = b * s;
        let start = self.tp.group_rank() * columns;
        let valid = self.vocab_size.saturating_sub(start).min(columns);
        let t = self.temperature;
        let device = student.device();
        let token_kl = match valid {
            // A rank holding only padding adds nothing to any sum.
            0 => {
                let zero = || Tensor::<2>::zeros([n, 1], (&device, DType::F32));
                let none = || Tensor::<2>::full([n, 1], f32::NEG_INFINITY, (&device, DType::F32));
                self.combine(zero(), zero(), none(), zero(), zero(), none())?
            }
            _ => {
                let scaled = |x: Tensor<3>| {
                    x.reshape([n, columns])
                        .narrow(1, 0, valid)
                        .cast(DType::F32)
                        .div_scalar(t)
                };
                let (zs, zt) = (scaled(student), scaled(teacher.detach()));
                let (max_s, max_t) = (zs.clone().detach().max_dim(1), zt.clone().max_dim(1));
                let (exp_s, exp_t) = (
                    (zs.clone() - max_s.clone()).exp().sum_dim(1),
                    (zt.clone() - max_t.clone()).exp(),
                );
                // Σ exp(z_t − m_t) · z over this slice, for the cross and entropy terms; the
                // normalizer comes after the sum over the group.
                let weighted_s = (exp_t.clone() * zs).sum_dim(1);
                let weighted_t = (exp_t.clone() * zt).sum_dim(1);
                self.combine(exp_s, weighted_s, max_s, exp_t.sum_dim(1), weighted_t, max_t)?
            }
        };
        let total = self
            .batch
            .all_reduce(Tensor::<1>::from_floats([n as f32], &device), ReduceOp::Sum)?;
        let count = total.into_scalar::<f64>().max(1.0);
        Ok(token_kl.sum().mul_scalar(t * t * self.batch.size() as f64 / count))
    }

    /// Each token's KL (`[n, 1]`) from this slice's sums: the student's `Σ exp(z_s − m_s)`,
    /// `Σ exp(z_t − m_t) z_s` and local max, the teacher's `Σ exp(z_t − m_t)`,
    /// `Σ exp(z_t − m_t) z_t` and local max. The maxima are combined first, each slice's sums
    /// rescaled to the common one, then summed over the group.
    fn combine(
        &self,
        exp_s: Tensor<2>,
        weighted_s: Tensor<2>,
        max_s: Tensor<2>,
        exp_t: Tensor<2>,
        weighted_t: Tensor<2>,
        max_t: Tensor<2>,
    ) -> Result<Tensor<2>, LayerError> {
        let global_s = self.tp.all_reduce(max_s.clone().detach(), ReduceOp::Max)?;
        let global_t = self.tp.all_reduce(max_t.clone(), ReduceOp::Max)?;
        // A slice's sums at its own max, brought to the group's (exp of −∞ is 0: a padding slice).
        let shift_s = (max_s.detach() - global_s.clone()).exp();
        let shift_t = (max_t - global_t.clone()).exp();
        let sum_s = reduce_from_tp(exp_s * shift_s, &self.tp)?;
        let sum_t = self.tp.all_reduce(exp_t * shift_t.clone(), ReduceOp::Sum)?;
        let cross = reduce_from_tp(weighted_s * shift_t.clone(), &self.tp)? / sum_t.clone();
        let entropy = self.tp.all_reduce(weighted_t * shift_t, ReduceOp::Sum)? / sum_t.clone();
        let log_sum_s = sum_s.log() + global_s;
        let log_sum_t = sum_t.log() + global_t;
        // Σ p_t log p_t = Σ p_t z_t − logsumexp(z_t); − Σ p_t z_s + logsumexp(z_s).
        Ok(entropy - log_sum_t - cross + log_sum_s)
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::activation::{log_softmax, softmax};
    use burn::tensor::{Device, Distribution, Tensor};
    use burn_megatron_dist::ProcessGroups;

    use super::*;

    /// At tp = 1 the loss is `T² · mean KL` written with Burn's `log_softmax`, and its gradient
    /// `T · (p_s − p_t) / n`; KL of a distribution with itself is 0.
    #[test]
    fn matches_log_softmax_written_out() {
        let device = Device::flex().autodiff();
        let (b, s, v, t) = (2, 3, 7, 2.0);
        let student = Tensor::<3>::random([b, s, v], Distribution::Normal(0.0, 2.0), &device).require_grad();
        let teacher = Tensor::<3>::random([b, s, v], Distribution::Normal(0.0, 2.0), &device);
        let kl = VocabParallelKl::new(v, t, &ProcessGroups::single());
        let ours = kl.forward(student.clone(), teacher.clone()).unwrap();
        let (ls, lt) = (
            log_softmax(student.clone().div_scalar(t), 2),
            log_softmax(teacher.clone().div_scalar(t), 2),
        );
        let theirs = (lt.clone().exp() * (lt - ls)).sum().mul_scalar(t * t / (b * s) as f64);
        let (a, e) = (ours.clone().into_scalar::<f64>(), theirs.into_scalar::<f64>());
        // Both in f32 over 7 terms a token: a few ulps of values around 1.
        assert!((a - e).abs() < 1e-5 * e.abs().max(1.0), "{a} vs {e}");
        let grad = student.grad(&ours.backward()).unwrap();
        let expected = (softmax(student.clone().div_scalar(t), 2) - softmax(teacher.clone().div_scalar(t), 2))
            .mul_scalar(t / (b * s) as f64);
        let worst = (grad - expected.inner()).abs().max().into_scalar::<f32>();
        assert!(worst < 1e-6, "gradient off by {worst}");
        let same = kl.forward(teacher.clone(), teacher).unwrap().into_scalar::<f64>();
        assert!(same.abs() < 1e-6, "KL(p ‖ p) = {same}");
    }
}
