//! [`Distillation`]: a student with its teacher beside it, as the training step trains it
//! (`train::Trainer`): the student's parameters only, its loss the distiller's (`T²·KL` and the
//! data's cross-entropy, each reported as a part of the loss).

use burn::module::Module;
use burn::tensor::{DType, Tensor};
use burn_megatron_dist::ProcessGroups;
use burn_megatron_kernels::quant::notes::AmaxNotes;

use super::Distiller;
use crate::error::LayerError;
use crate::layers::moe::Load;
use crate::models::llama::Llama;
use crate::train::{Backward, Pass, TokenBatch, TrainModel};

/// A student trained toward a teacher; see the module docs.
#[derive(Module, Debug)]
pub struct Distillation {
    pub student: Llama,
    /// In inference mode ([`teacher`](super::teacher)): outside the parameters and the graph.
    #[module(skip)]
    pub teacher: Llama,
    #[module(skip)]
    pub distiller: Distiller,
}

impl TrainModel for Distillation {
    fn forward_backward(&self, batch: TokenBatch, pass: Pass) -> Result<Backward, LayerError> {
        let loss = self
            .distiller
            .loss(&self.student, &self.teacher, batch.ids, batch.targets)?;
        let total = match pass.weight == 1.0 {
            true => loss.total,
            false => loss.total.mul_scalar(pass.weight),
        };
        let parts = vec![
            ("kl".to_string(), loss.kl.cast(DType::F32)),
            ("data".to_string(), loss.data.cast(DType::F32)),
        ];
        Ok(Backward::of(self, total, parts, Vec::new(), pass))
    }

    /// The student's next-token loss.
    fn eval_loss(&self, batch: TokenBatch) -> Result<Tensor<1>, LayerError> {
        self.student.eval_loss(batch)
    }

    fn reduces_during_backward(&self) -> bool {
        true
    }

    fn after_step(mut self, loads: &[Load], groups: &ProcessGroups) -> Result<Self, LayerError> {
        self.student = self.student.after_step(loads, groups)?;
        Ok(self)
    }

    fn amax_notes(&self) -> AmaxNotes {
        self.student.amax_notes()
    }
}
