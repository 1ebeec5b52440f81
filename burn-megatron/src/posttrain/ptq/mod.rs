//! Post-training quantization of a trained Llama's blocks (the embedding, the output layer and
//! the norms stay in the compute dtype), as NVIDIA ModelOpt and llm-compressor do it:
//!
//! 1. [`calibrate`]: the model runs over calibration text with an
//!    [`Observer`](crate::precision::ptq::Observer) at each input [`Site`] of every block's linear
//!    layers;
//! 2. optional [`Smoothing`] (SmoothQuant, AWQ) moves per-channel scales from each input into the
//!    weights that read it, folded into the layer that made it (`smooth.rs`);
//! 3. [`quantize`]: every linear weight replaced by the values of its codes
//!    ([`WeightScheme`]: int8 or FP8 per tensor or channel, int4 in groups, NVFP4), rounded to the
//!    nearest code or by GPTQ, and every linear's input quantized as the [`ActivationScheme`] says
//!    (static ranges from the calibration, dynamic per token, FP8 in 1×128 tiles, NVFP4), through
//!    the layers' [`InputQuantizer`].
//!
//! The schemes themselves are `precision::ptq`'s. Values are emulated (quantized and dequantized
//! in f32, the product in the compute dtype), so a quantized model runs everywhere the model
//! does. Quantization runs at tp = 1; the export (`models::llama::hf::save_quantized`,
//! compressed-tensors' layout) loads at any tp.

mod smooth;

use std::collections::BTreeMap;

use burn::tensor::{Int, Tensor};

use crate::models::llama::{Llama, Site, linear_mut};
use crate::precision::ptq::{
    ActivationScheme, Clipping, Collect, InputQuantizer, LinearQuantization, Observer, PtqConfig, PtqError,
    Quantization, Smoothing, Statistics, WeightScheme, gptq,
};

/// What each block's input sites saw, `[block][site]` in [`Site::ALL`]'s order.
#[derive(Clone, Debug)]
pub struct Calibration {
    pub blocks: Vec<[Statistics; 4]>,
}

impl Calibration {
    pub fn site(&self, block: usize, site: Site) -> &Statistics {
        let index = Site::ALL.iter().position(|s| *s == site).expect("a site");
        &self.blocks[block][index]
    }
}

/// Runs `model` over `batches` (`[b, s]` token ids each) with an observer at every input site,
/// keeping what `collect` asks for (a sample of tokens for AWQ's search, `XᵀX` for GPTQ).
pub fn calibrate(model: &Llama, batches: &[Tensor<2, Int>], collect: Collect) -> Result<Calibration, PtqError> {
    check(model)?;
    if batches.is_empty() {
        return Err(PtqError::NoCalibration);
    }
    let mut observed = model.clone();
    let mut observers = Vec::with_capacity(observed.layers.len());
    for block in &mut observed.layers {
        let mut four = Vec::with_capacity(4);
        for site in Site::ALL {
            // The site's first layer stands for all of them: they read the same tensor.
            let observer = Observer::new(collect);
            let linear = linear_mut(block, site.linears()[0]).ok_or(PtqError::MixtureOfExperts)?;
            linear.precision.input_quantizer = InputQuantizer::Observe(observer.clone());
            four.push(observer);
        }
        observers.push(four);
    }
    for ids in batches {
        observed.forward(ids.clone())?;
    }
    let blocks = observers
        .iter()
        .map(|four| std::array::from_fn(|s| four[s].statistics()))
        .collect();
    Ok(Calibration { blocks })
}

/// A quantized model and how each of its block linears (by path, `layers.3.attention.wq`) was
/// quantized: what an export stores beside the codes
/// ([`save_quantized`](crate::models::llama::hf::save_quantized)).
#[derive(Clone, Debug)]
pub struct Quantized {
    pub model: Llama,
    pub quantization: Quantization,
}

/// `model` quantized as `config` says, from `calibration` (of `model` itself). With smoothing
/// and static activation ranges the smoothed model is calibrated again over `batches`, since
/// smoothing moves the ranges.
pub fn quantize(
    model: Llama,
    config: &PtqConfig,
    calibration: &Calibration,
    batches: &[Tensor<2, Int>],
) -> Result<Quantized, PtqError> {
    check(&model)?;
    if matches!(config.smoothing, Smoothing::Awq { .. })
        && calibration
            .blocks
            .iter()
            .any(|b| b.iter().any(|s| s.samples.is_empty()))
    {
        return Err(PtqError::NoSample);
    }
    if config.gptq.is_some() {
        if let WeightScheme::Minimum { .. } | WeightScheme::Nvfp4 = config.weights {
            return Err(PtqError::GptqScheme {
                scheme: config.weights.name(),
            });
        }
        if calibration.blocks.iter().any(|b| b.iter().any(|s| s.hessian.is_none())) {
            return Err(PtqError::NoHessian);
        }
    }
    let (mut model, scales) = smooth::smooth(model, calibration, config.smoothing, config.weights)?;
    let static_ranges = matches!(config.activations, Some(ActivationScheme::Static { .. }));
    let recalibrated = match config.smoothing != Smoothing::None && static_ranges {
        true => Some(calibrate(&model, batches, Collect::default())?),
        false => None,
    };
    let ranges = recalibrated.as_ref().unwrap_or(calibration);
    let mut linears = BTreeMap::new();
    for (i, block) in model.layers.iter_mut().enumerate() {
        for (s, site) in Site::ALL.into_iter().enumerate() {
            // AWQ's clip search: the layer's outputs on the sample as the smoothed model sees it.
            let awq = matches!(config.smoothing, Smoothing::Awq { .. });
            let sample = (awq && config.weights.clipping() == Some(Clipping::Mse)).then(|| {
                let x = calibration
                    .site(i, site)
                    .sample_tensor(&block.attention_norm.weight.val().device());
                match &scales {
                    Some(scales) => x / scales[i][s].clone().unsqueeze_dim::<2>(0),
                    None => x,
                }
            });
            let input = match config.activations {
                None => InputQuantizer::None,
                Some(ActivationScheme::Static { codes, clipping }) => InputQuantizer::Static {
                    codes,
                    amax: ranges.site(i, site).range(codes, clipping),
                },
                Some(ActivationScheme::PerToken { codes }) => InputQuantizer::PerToken { codes },
                Some(ActivationScheme::Fp8Tiles) => InputQuantizer::Fp8Tiles,
                Some(ActivationScheme::Nvfp4) => InputQuantizer::Nvfp4,
            };
            // GPTQ's XᵀX of the inputs as the smoothed model sees them: x / s.
            let factored = match config.gptq {
                None => None,
                Some(settings) => {
                    let gram = calibration.site(i, site).hessian.as_ref().and_then(|h| h.gram.clone());
                    let gram = gram.expect("checked above");
                    let gram = match &scales {
                        Some(scales) => {
                            let s = scales[i][s].clone();
                            gram / (s.clone().unsqueeze_dim::<2>(1) * s.unsqueeze_dim::<2>(0))
                        }
                        None => gram,
                    };
                    Some(gptq::factor(gram, settings)?)
                }
            };
            for path in site.linears() {
                let linear = linear_mut(block, path).ok_or(PtqError::MixtureOfExperts)?;
                let weight = linear.weight.val();
                let dtype = weight.dtype();
                let quantized = match &factored {
                    Some(factored) => gptq::quantize(config.weights, weight, factored)?,
                    None => config.weights.quantize_on(weight, sample.as_ref()),
                };
                *linear.weight = linear.weight.clone().map(|_| quantized.values.cast(dtype));
                linear.precision.input_quantizer = input.clone();
                let quantization = LinearQuantization {
                    weight_scales: quantized.scales,
                    input: input.clone(),
                };
                linears.insert(format!("layers.{i}.{path}"), quantization);
            }
        }
    }
    let quantization = Quantization {
        config: *config,
        linears,
    };
    Ok(Quantized { model, quantization })
}

/// Quantization runs on whole, dense blocks.
fn check(model: &Llama) -> Result<(), PtqError> {
    let tp = model.embedding.tp.size();
    if tp > 1 {
        return Err(PtqError::TensorParallel { tp });
    }
    if model.layers.iter().any(|b| b.moe.is_some()) {
        return Err(PtqError::MixtureOfExperts);
    }
    if model.layers.iter().any(|b| b.latent.is_some()) {
        return Err(PtqError::LatentAttention);
    }
    Ok(())
}
