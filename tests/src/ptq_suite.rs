//! The post-training quantization suite, on the `llama3` Hugging Face fixture (transformers'
//! tiny Llama 3: grouped-query attention, tied embeddings): a quantized model exported in
//! compressed-tensors' layout holds what the layout says (8-bit codes `[out, in]`, their scales,
//! the static inputs' scales, the `quantization_config`) and loads back at tp 1 and 2 computing
//! what the quantized model computed; bad configurations are typed errors.

use std::path::{Path, PathBuf};

use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_megatron::error::LayerError;
use burn_megatron::models::llama::Llama;
use burn_megatron::models::llama::hf::{self, ExportOptions, HfError};
use burn_megatron::models::llama::sites::linear_mut;
use burn_megatron::posttrain::ptq;
use burn_megatron::precision::ptq::{
    ActivationScheme, Clipping, Codes, Collect, Gptq, Granularity, InputQuantizer, PtqConfig, PtqError, Smoothing,
    WeightScheme,
};
use burn_megatron_dist::{ParallelDims, ProcessGroups};
use safetensors::tensor::Dtype;
use serde_json::Value;

use crate::Harness;
use crate::hf_suite::{fixture, loaded};

const SEQ: usize = 16;

fn scratch(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("burn-megatron-ptq-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Four calibration batches of `[2, 16]` ids of the fixture's vocabulary (99).
fn batches(device: &Device) -> Vec<Tensor<2, Int>> {
    (0..4)
        .map(|b| {
            let ids: Vec<i64> = (0..2 * SEQ as i64).map(|i| (i * 37 + b * 11 + 5) % 99).collect();
            Tensor::from_data(TensorData::new(ids, [2, SEQ]), device)
        })
        .collect()
}

/// The exportable families: FP8 per tensor with static inputs (MSE ranges, after SmoothQuant),
/// int8 per channel with per-token inputs (rounded by GPTQ: its values are codes of the same
/// grid, so the layout is the same), and FP8 per channel with inputs in 1×128 tiles.
fn exported() -> [PtqConfig; 3] {
    let weights = |codes, granularity| WeightScheme::Uniform {
        codes,
        granularity,
        clipping: Clipping::Max,
    };
    [
        PtqConfig::weight_only(weights(Codes::Fp8, Granularity::Tensor))
            .with_activations(ActivationScheme::Static {
                codes: Codes::Fp8,
                clipping: Clipping::Mse,
            })
            .with_smoothing(Smoothing::SmoothQuant { alpha: 0.5 }),
        PtqConfig::weight_only(weights(Codes::Int8, Granularity::Channel))
            .with_activations(ActivationScheme::PerToken { codes: Codes::Int8 })
            .with_gptq(Gptq::default()),
        PtqConfig::weight_only(weights(Codes::Fp8, Granularity::Channel)).with_activations(ActivationScheme::Fp8Tiles),
    ]
}

/// The logits of `model` on the first batch, gathered over the vocabulary, `[b, s, v]`.
fn logits(model: &Llama, groups: &ProcessGroups, device: &Device) -> Vec<f32> {
    let ids = batches(device).remove(0);
    let shard = model.forward(ids).unwrap();
    let whole = groups.tp.all_gather(shard, 2).unwrap().narrow(2, 0, 99);
    whole.into_data().try_to_vec().unwrap()
}

/// Each exportable scheme: the files hold the layout, and the export loaded at tp 1 and 2
/// computes the quantized model's logits; with input tiles, tp 2 splits the fixture's tiles
/// (the attention output's 64 features, 32 a rank, the first row-parallel shard), a typed
/// error on the forward.
pub fn compressed_export_loads_at_any_tp(h: &Harness) {
    for (k, config) in exported().into_iter().enumerate() {
        let dir = scratch(&format!("export-{k}"));
        let source = fixture("llama3");
        let in_memory = h
            .run(ParallelDims::single(), |ctx| {
                let device = ctx.device.clone();
                let (model, planned) = loaded(&source, &ctx.groups, &device, false);
                let collect = Collect::default().with_hessian();
                let calibration = ptq::calibrate(&model, &batches(&device), collect).unwrap();
                let quantized = ptq::quantize(model, &config, &calibration, &batches(&device)).unwrap();
                hf::save_quantized(
                    &dir,
                    &quantized.model,
                    &quantized.quantization,
                    &planned,
                    &ctx.groups,
                    &ExportOptions::new(),
                )
                .unwrap();
                logits(&quantized.model, &ctx.groups, &device)
            })
            .remove(0);
        check_layout(&dir, &config);
        let tiles = config.activations == Some(ActivationScheme::Fp8Tiles);
        if tiles {
            h.run(ParallelDims::tp_dp(2, 1), |ctx| {
                let device = ctx.device.clone();
                let (model, _) = loaded(&dir, &ctx.groups, &device, false);
                let error = model.forward(batches(&device).remove(0)).unwrap_err();
                assert!(
                    matches!(
                        error,
                        LayerError::GroupsAcrossShards {
                            features: 32,
                            group: 128
                        }
                    ),
                    "{error}"
                );
            });
        }
        for tp in if tiles { vec![1] } else { vec![1, 2] } {
            let reloaded = h.run(ParallelDims::tp_dp(tp, 1), |ctx| {
                let device = ctx.device.clone();
                let (model, _) = loaded(&dir, &ctx.groups, &device, false);
                logits(&model, &ctx.groups, &device)
            });
            for got in reloaded {
                let worst = got
                    .iter()
                    .zip(&in_memory)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0, f32::max);
                let largest = in_memory.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                // The codes and scales are exact; at tp 2 the products are split over ranks and
                // sum in another order (the harness's split tolerance), and a value that lands
                // within that rounding of a rounding boundary may take the neighbouring code:
                // 10× the split tolerance of the largest logit.
                let tolerance = match tp {
                    1 => 1e-6,
                    _ => 10.0 * h.matmul_tolerance,
                } * largest as f64;
                assert!(
                    (worst as f64) <= tolerance,
                    "{} at tp {tp}: logits moved by {worst} (largest {largest})",
                    config.name()
                );
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// compressed-tensors' layout, read back from the files: codes `[out, in]` in `F8_E4M3` or
/// `I8`, `weight_scale` `[1]` a tensor or `[out, 1]` a channel, `input_scale` `[1]` for
/// static inputs only, the norms and the embedding as they were, and the scheme in
/// `config.json` (dynamic inputs per token, or in groups of 128 for the tiles).
fn check_layout(dir: &Path, config: &PtqConfig) {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let q = file.tensor("model.layers.0.self_attn.q_proj.weight").unwrap();
    let (codes, per_channel) = match config.weights {
        WeightScheme::Uniform {
            codes: Codes::Fp8,
            granularity,
            ..
        } => (Dtype::F8_E4M3, granularity == Granularity::Channel),
        _ => (Dtype::I8, true),
    };
    assert_eq!(q.dtype(), codes);
    assert_eq!(q.shape(), [64, 64], "[out, in]");
    let scale = file.tensor("model.layers.0.self_attn.q_proj.weight_scale").unwrap();
    assert_eq!(scale.dtype(), Dtype::F32);
    assert_eq!(scale.shape(), if per_channel { vec![64, 1] } else { vec![1] });
    let down = file.tensor("model.layers.1.mlp.down_proj.weight").unwrap();
    assert_eq!((down.dtype(), down.shape()), (codes, &[64usize, 128][..]));
    let static_inputs = matches!(config.activations, Some(ActivationScheme::Static { .. }));
    assert_eq!(
        file.tensor("model.layers.1.mlp.down_proj.input_scale").is_ok(),
        static_inputs
    );
    let norm = file.tensor("model.layers.0.input_layernorm.weight").unwrap();
    assert_eq!(norm.dtype(), Dtype::F32);
    assert!(
        file.tensor("lm_head.weight").is_err(),
        "tied: the embedding is the output"
    );
    let json: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let q = &json["quantization_config"];
    assert_eq!(q["quant_method"], "compressed-tensors");
    let group = &q["config_groups"]["group_0"];
    assert_eq!(group["targets"], serde_json::json!(["Linear"]));
    assert_eq!(
        group["weights"]["strategy"],
        if per_channel { "channel" } else { "tensor" }
    );
    let input = &group["input_activations"];
    let tiles = config.activations == Some(ActivationScheme::Fp8Tiles);
    let strategy = match (static_inputs, tiles) {
        (true, _) => "tensor",
        (false, true) => "group",
        (false, false) => "token",
    };
    assert_eq!(input["strategy"], strategy);
    assert_eq!(input["dynamic"], !static_inputs);
    assert_eq!(
        input["group_size"],
        if tiles { serde_json::json!(128) } else { Value::Null }
    );
}

/// GPTQ on the fixture, int4 with zero points in groups of 32 (plain, after AWQ, in activation
/// order): the logits on the calibration batches lie closer to the float model's than round to
/// nearest's. Each layer's output error on its calibration inputs is what GPTQ lowers; the
/// model's logits follow unless the errors of successive layers interact badly, which on 4
/// batches of this fixture they do not: a margin of 10% is asked of each.
pub fn gptq_lowers_the_error(h: &Harness) {
    let source = fixture("llama3");
    h.run(ParallelDims::single(), |ctx| {
        let device = ctx.device.clone();
        let (model, _) = loaded(&source, &ctx.groups, &device, false);
        let collect = Collect::sample(64).with_hessian();
        let calibration = ptq::calibrate(&model, &batches(&device), collect).unwrap();
        let float = logits(&model, &ctx.groups, &device);
        let error = |config: PtqConfig| {
            let quantized = ptq::quantize(model.clone(), &config, &calibration, &batches(&device)).unwrap();
            let got = logits(&quantized.model, &ctx.groups, &device);
            got.iter()
                .zip(&float)
                .map(|(a, b)| ((a - b) as f64).powi(2))
                .sum::<f64>()
        };
        let int4 = PtqConfig::weight_only(WeightScheme::Asymmetric {
            bits: 4,
            group: 32,
            clipping: Clipping::Max,
        });
        let awq = int4.with_smoothing(Smoothing::Awq { grid: 4 });
        let act_order = Gptq {
            act_order: true,
            ..Gptq::default()
        };
        for (nearest, gptq) in [
            (int4, int4.with_gptq(Gptq::default())),
            (int4, int4.with_gptq(act_order)),
            (awq, awq.with_gptq(Gptq::default())),
        ] {
            let (e_nearest, e_gptq) = (error(nearest), error(gptq));
            assert!(
                e_gptq < 0.9 * e_nearest,
                "{}: {e_gptq} against {}'s {e_nearest}",
                gptq.name(),
                nearest.name()
            );
        }
    });
}

/// Typed errors: a model split over tp, no calibration batches, AWQ without a token sample,
/// GPTQ without the Hessians or on NVFP4, a scheme compressed-tensors' 8-bit layouts do not
/// hold, and a checkpoint of another method.
pub fn ptq_errors(h: &Harness) {
    let source = fixture("llama3");
    h.run(ParallelDims::tp_dp(2, 1), |ctx| {
        let device = ctx.device.clone();
        let (model, _) = loaded(&source, &ctx.groups, &device, false);
        assert_eq!(
            ptq::calibrate(&model, &batches(&device), Collect::default()).unwrap_err(),
            PtqError::TensorParallel { tp: 2 }
        );
    });
    h.run(ParallelDims::single(), |ctx| {
        let device = ctx.device.clone();
        let (model, planned) = loaded(&source, &ctx.groups, &device, false);
        assert_eq!(
            ptq::calibrate(&model, &[], Collect::default()).unwrap_err(),
            PtqError::NoCalibration
        );
        let calibration = ptq::calibrate(&model, &batches(&device), Collect::default()).unwrap();
        let int4 = WeightScheme::Uniform {
            codes: Codes::Int4,
            granularity: Granularity::Group(32),
            clipping: Clipping::Max,
        };
        let awq = PtqConfig::weight_only(int4).with_smoothing(Smoothing::Awq { grid: 4 });
        let error = ptq::quantize(model.clone(), &awq, &calibration, &batches(&device)).unwrap_err();
        assert_eq!(error, PtqError::NoSample);
        let gptq = PtqConfig::weight_only(int4).with_gptq(Gptq::default());
        let error = ptq::quantize(model.clone(), &gptq, &calibration, &[]).unwrap_err();
        assert_eq!(error, PtqError::NoHessian);
        let nvfp4 = PtqConfig::weight_only(WeightScheme::Nvfp4).with_gptq(Gptq::default());
        let error = ptq::quantize(model.clone(), &nvfp4, &calibration, &[]).unwrap_err();
        assert_eq!(error, PtqError::GptqScheme { scheme: "nvfp4".into() });
        let plain = ptq::quantize(model.clone(), &PtqConfig::weight_only(int4), &calibration, &[]).unwrap();
        // FP8 inputs in tiles run (the fixture's 64 and 128 features hold whole tiles or one
        // ragged one); with int8 weights they have no layout in the export.
        let int8 = WeightScheme::Uniform {
            codes: Codes::Int8,
            granularity: Granularity::Channel,
            clipping: Clipping::Max,
        };
        let tiles = PtqConfig::weight_only(int8).with_activations(ActivationScheme::Fp8Tiles);
        let tiled = ptq::quantize(model, &tiles, &calibration, &[]).unwrap();
        tiled.model.forward(batches(&device)[0].clone()).unwrap();
        let dir = scratch("refused");
        for refused in [&plain, &tiled] {
            let error = hf::save_quantized(
                &dir,
                &refused.model,
                &refused.quantization,
                &planned,
                &ctx.groups,
                &ExportOptions::new(),
            )
            .unwrap_err();
            assert!(
                matches!(
                    error,
                    HfError::Unsupported {
                        field: "quantization_config",
                        ..
                    }
                ),
                "{error}"
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    });
    // FP8 input tiles on a row-parallel layer whose shard (64 of the MLP's 128 features) would
    // split a tile: a typed error, not other scales than one device's.
    h.run(ParallelDims::tp_dp(2, 1), |ctx| {
        let device = ctx.device.clone();
        let (mut model, _) = loaded(&source, &ctx.groups, &device, false);
        let w2 = linear_mut(&mut model.layers[0], "mlp.w2").expect("a dense block");
        w2.precision.input_quantizer = InputQuantizer::Fp8Tiles;
        let error = model.forward(batches(&device)[0].clone()).unwrap_err();
        assert!(
            matches!(
                error,
                LayerError::GroupsAcrossShards {
                    features: 64,
                    group: 128
                }
            ),
            "{error}"
        );
    });
}
