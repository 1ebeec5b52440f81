//! Knowledge distillation: a student Llama trained toward a teacher's softened next-token
//! distributions (Hinton et al. 2015; Minitron's recovery after pruning), optionally plus the
//! data's own loss. The teacher runs in inference mode (its parameters out of the graph, so it
//! keeps no activations for backward), on the student's mesh: both models' logits are split over
//! the same tensor-parallel group, and the KL is taken slice by slice (`kl.rs`). Any precision
//! policy's teacher works, FP8 or a post-training quantization included. [`Distillation`] is the
//! pair as the training step trains it.

mod kl;
mod student;

pub use kl::VocabParallelKl;
pub use student::Distillation;

use burn::config::Config;
use burn::module::Module;
use burn::tensor::{Int, Tensor};
use burn_megatron_dist::ProcessGroups;

use crate::error::LayerError;
use crate::models::llama::Llama;

/// How the student's loss is made.
#[derive(Config, Debug)]
pub struct DistillConfig {
    /// The softmax temperature of both distributions.
    #[config(default = 1.0)]
    pub temperature: f64,
    /// The weight of `T² · KL(teacher ‖ student)`.
    #[config(default = 1.0)]
    pub kl_weight: f64,
    /// The weight of the data's next-token cross-entropy.
    #[config(default = 0.0)]
    pub data_weight: f64,
}

/// A student's loss against its teacher, and its parts.
#[derive(Clone, Debug)]
pub struct DistillLoss {
    /// `kl_weight · T² · KL + data_weight · cross-entropy` (`[1]`), what backward runs on.
    pub total: Tensor<1>,
    /// `T² · KL` (`[1]`, detached).
    pub kl: Tensor<1>,
    /// The data's cross-entropy (`[1]`, detached).
    pub data: Tensor<1>,
}

/// Distills into a student from a teacher on one mesh.
#[derive(Clone, Debug)]
pub struct Distiller {
    pub config: DistillConfig,
    pub kl: VocabParallelKl,
}

impl DistillConfig {
    /// The distiller of a vocabulary of `vocab_size` over `groups` (the student's and
    /// teacher's).
    pub fn init(&self, vocab_size: usize, groups: &ProcessGroups) -> Distiller {
        Distiller {
            config: self.clone(),
            kl: VocabParallelKl::new(vocab_size, self.temperature, groups),
        }
    }
}

/// `teacher` in inference mode: no parameter of it is tracked, so its forward pass keeps
/// nothing for backward.
pub fn teacher(model: Llama) -> Llama {
    model.no_grad()
}

impl Distiller {
    /// The student's loss on `ids` (`[b, s]`) against `targets` (`[b, s]`, for the data loss)
    /// and the teacher's logits on the same ids.
    pub fn loss(
        &self,
        student: &Llama,
        teacher: &Llama,
        ids: Tensor<2, Int>,
        targets: Tensor<2, Int>,
    ) -> Result<DistillLoss, LayerError> {
        let guide = teacher.forward(ids.clone())?.detach();
        let logits = student.forward(ids)?;
        let kl = self.kl.forward(logits.clone(), guide)?;
        let data = student.loss.forward(logits, targets)?;
        let dtype = kl.dtype();
        let total =
            kl.clone().mul_scalar(self.config.kl_weight) + data.clone().cast(dtype).mul_scalar(self.config.data_weight);
        Ok(DistillLoss {
            total,
            kl: kl.detach(),
            data: data.detach(),
        })
    }
}
