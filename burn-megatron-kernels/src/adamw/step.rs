//! What one AdamW step takes ([`AdamWStep`]: the hyper-parameters) and what an update of fp32
//! master weights gives back ([`MasterUpdate`]).

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, ExtensionType};

/// AdamW's hyper-parameters for one step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWStep {
    pub lr: f32,
    pub beta_1: f32,
    pub beta_2: f32,
    pub epsilon: f32,
    pub weight_decay: f32,
    /// The step number, from 1 (bias correction).
    pub time: u32,
    /// Multiplies the gradient first (clipping by a global norm).
    pub grad_scale: f32,
}

impl AdamWStep {
    /// The bias corrections `(1 − β₁ᵗ, 1 − β₂ᵗ)`.
    pub(crate) fn bias(&self) -> (f32, f32) {
        (
            1.0 - self.beta_1.powi(self.time as i32),
            1.0 - self.beta_2.powi(self.time as i32),
        )
    }
}

/// One step's new f32 master weights and moments, the parameter's copy of the master
/// weights in its own dtype, the running sum of squares with this gradient's added, and the
/// copy's amax.
#[derive(ExtensionType)]
pub struct MasterUpdate<B: Backend> {
    pub master: FloatTensor<B>,
    pub moment_1: FloatTensor<B>,
    pub moment_2: FloatTensor<B>,
    pub param: FloatTensor<B>,
    pub squares: FloatTensor<B>,
    pub amax: FloatTensor<B>,
}
