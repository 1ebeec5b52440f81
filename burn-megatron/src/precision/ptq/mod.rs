//! The schemes of post-training quantization, what a linear layer's weight and input become:
//! codes on a grid with their clipping ([`Codes`], `codes.rs`), weight schemes ([`WeightScheme`]:
//! int8 or FP8 per tensor or channel, int4 in groups, NVFP4; `weights.rs`) and GPTQ's
//! error-compensating rounding ([`gptq`]), input schemes and the layers' [`InputQuantizer`]
//! (`activations.rs`), the calibration observers ([`Observer`], `calibrate.rs`) and the choice
//! of smoothing ([`Smoothing`]). `posttrain::ptq` runs them over a model.

mod activations;
mod calibrate;
mod codes;
pub mod gptq;
mod smoothing;
mod weights;

pub use activations::{ActivationScheme, InputQuantizer};
pub use calibrate::{Collect, Hessian, Histogram, Observer, Statistics};
pub use codes::{Clipping, Codes};
pub use gptq::Gptq;
pub use smoothing::Smoothing;
pub use weights::{Granularity, QuantizedWeight, WeightScheme};

use std::collections::BTreeMap;

use burn::tensor::Tensor;

use crate::error::LayerError;

#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum PtqError {
    #[error(
        "post-training quantization runs at tp = 1 (this model is split over tp = {tp}); its export loads at any tp"
    )]
    TensorParallel { tp: usize },
    #[error("mixture-of-experts blocks are not quantized: their experts are no block linear layers")]
    MixtureOfExperts,
    #[error("latent attention is not quantized or pruned: its sites are grouped-query attention's")]
    LatentAttention,
    #[error("calibration needs at least one batch of token ids")]
    NoCalibration,
    #[error("this scheme needs the calibration's token sample: calibrate with sample_tokens > 0")]
    NoSample,
    #[error("GPTQ needs each site's XᵀX: calibrate with Collect::with_hessian")]
    NoHessian,
    #[error("GPTQ rounds onto a uniform or zero-point grid; {scheme} has none it can walk row by row")]
    GptqScheme { scheme: String },
    #[error("GPTQ's damped XᵀX is not positive definite at input row {row}: raise the damping")]
    GptqHessian { row: usize },
    #[error(transparent)]
    Layer(#[from] LayerError),
}

/// A post-training quantization of a model's blocks.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PtqConfig {
    pub weights: WeightScheme,
    /// The linears' inputs; `None`: weight-only.
    pub activations: Option<ActivationScheme>,
    pub smoothing: Smoothing,
    /// Round the weights by GPTQ rather than to the nearest code.
    pub gptq: Option<Gptq>,
}

impl PtqConfig {
    /// Weight-only quantization with no smoothing.
    pub fn weight_only(weights: WeightScheme) -> Self {
        Self {
            weights,
            activations: None,
            smoothing: Smoothing::None,
            gptq: None,
        }
    }

    /// The same with the inputs quantized as `activations` says.
    pub fn with_activations(self, activations: ActivationScheme) -> Self {
        Self {
            activations: Some(activations),
            ..self
        }
    }

    pub fn with_smoothing(self, smoothing: Smoothing) -> Self {
        Self { smoothing, ..self }
    }

    pub fn with_gptq(self, gptq: Gptq) -> Self {
        Self {
            gptq: Some(gptq),
            ..self
        }
    }

    /// Its name in a table: `w:int8-channel-max`, `w:fp8-tensor-max a:fp8-static-max`,
    /// `w:int4-g128-max awq`, `w:int4-asym-g128-max gptq`.
    pub fn name(&self) -> String {
        let mut name = format!("w:{}", self.weights.name());
        if let Some(a) = self.activations {
            name += &format!(" a:{}", a.name());
        }
        if self.smoothing != Smoothing::None {
            name += &format!(" {}", self.smoothing.name());
        }
        if let Some(gptq) = self.gptq {
            name += &format!(" {}", gptq.name());
        }
        name
    }
}

/// One block linear's quantization.
#[derive(Clone, Debug)]
pub struct LinearQuantization {
    /// Its weight's scales ([`QuantizedWeight::scales`]).
    pub weight_scales: Option<Tensor<2>>,
    /// What its input goes through.
    pub input: InputQuantizer,
}

/// What a post-training quantization did to a model's block linears, beside their new values:
/// the config, and each linear's weight scales and input quantizer by its parameter path (what
/// an export writes, `models::llama::hf::save_quantized`).
#[derive(Clone, Debug)]
pub struct Quantization {
    pub config: PtqConfig,
    pub linears: BTreeMap<String, LinearQuantization>,
}
