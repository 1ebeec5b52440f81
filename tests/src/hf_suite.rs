//! The Hugging Face suite: the fixtures that transformers 5.17 made (`tests/fixtures/hf/`,
//! `make_fixtures.py`) loaded at the harness's tp, in both config layouts, against
//! transformers' own loss, logits and gradient norms; every refused config field and checkpoint
//! as its typed error; a tied model through the optimizer and a resharded checkpoint; and the
//! export read back.
//!
//! Legend: `b` batch, `s` sequence, `v` vocabulary (99), `v'` this rank's padded share.

use std::path::{Path, PathBuf};

use burn::optim::GradientsParams;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_megatron::checkpoint;
use burn_megatron::init::{InitMode, ParamInit};
use burn_megatron::models::llama::hf::{self, ExportDType, ExportOptions, HfError};
use burn_megatron::models::llama::{Llama, LlamaConfig, WordEmbeddings};
use burn_megatron::optim::DistributedAdamWConfig;
use burn_megatron::params::param_infos;
use burn_megatron::plan::{ParallelPlan, TensorParallel};
use burn_megatron_dist::{ParallelDims, ProcessGroups};
use serde_json::Value;

use crate::Harness;
use crate::family_suite::{check_grad_norms, check_logits};

const SEQ: usize = 16;
const VOCAB: usize = 99;

/// The fixture directory `name` (`llama2`, `llama3`): under the crate cargo runs the test for
/// (its `CARGO_MANIFEST_DIR` at run time: a test binary cargo reuses may have been built in
/// another checkout, since removed), under the crate that was built, or, where the binary runs
/// from a copy of the checkout elsewhere (the GPU suite on the device machine), under the
/// working directory's `tests/`.
pub fn fixture(name: &str) -> PathBuf {
    let running = std::env::var_os("CARGO_MANIFEST_DIR").map(|dir| Path::new(&dir).join("fixtures/hf"));
    let root = running
        .into_iter()
        .chain([Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/hf")])
        .find(|dir| dir.exists())
        .unwrap_or_else(|| PathBuf::from("tests/fixtures/hf"));
    root.join(name)
}

fn scratch(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("burn-megatron-hf-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A copy of fixture `name` whose `config.json` is the fixture's `config_file`.
fn staged(name: &str, config_file: &str, tag: &str) -> PathBuf {
    let dir = scratch(tag);
    let from = fixture(name);
    std::fs::copy(from.join(config_file), dir.join("config.json")).unwrap();
    std::fs::copy(from.join("model.safetensors"), dir.join("model.safetensors")).unwrap();
    dir
}

pub(crate) fn expected(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture(name).join("expected.json")).unwrap()).unwrap()
}

/// The fixture's batch: inputs and targets `[b, s]`.
pub(crate) fn batch(expected: &Value, device: &Device) -> (Tensor<2, Int>, Tensor<2, Int>) {
    let ids = |key: &str| {
        let rows = expected[key].as_array().unwrap();
        let flat: Vec<i64> = rows
            .iter()
            .flat_map(|r| r.as_array().unwrap().iter().map(|v| v.as_i64().unwrap()))
            .collect();
        Tensor::<2, Int>::from_data(TensorData::new(flat, [rows.len(), SEQ]), device)
    };
    (ids("inputs"), ids("targets"))
}

/// Our configuration for the checkpoint in `dir`, planned over `groups` (tp × dp).
pub(crate) fn planned(dir: &Path, groups: &ProcessGroups, sp: bool) -> LlamaConfig {
    let dims = ParallelDims::tp_dp(groups.tp.size(), groups.dp.size());
    let tensor = match sp {
        true => TensorParallel::SequenceParallel,
        false => TensorParallel::Plain,
    };
    let config = hf::config(dir).expect("the fixture's config builds");
    ParallelPlan::new(dims)
        .with_tensor(tensor)
        .apply(config, dims.world_size(), SEQ)
        .unwrap()
}

/// The checkpoint in `dir` loaded into a model planned over `groups`, initialized from another
/// seed first (every value must come from the checkpoint).
pub(crate) fn loaded(dir: &Path, groups: &ProcessGroups, device: &Device, sp: bool) -> (Llama, LlamaConfig) {
    let config = planned(dir, groups, sp);
    let model = config
        .init(device, groups, &ParamInit::new(11, InitMode::Full))
        .unwrap();
    (hf::load(dir, model, groups).unwrap(), config)
}

/// Loads fixture `name` with each config layout (5.x with sequence parallelism, 4.x without)
/// and compares the loss, the logits and every gradient norm with transformers'.
fn matches_transformers(h: &Harness, name: &str) {
    let expected = expected(name);
    for (layout, sp) in [("config.json", true), ("config-v4.json", false)] {
        let dir = staged(name, layout, &format!("{name}-{layout}-tp{}", h.world));
        h.run(h.tp_world(), |ctx| {
            let dev = ctx.device.clone().autodiff();
            let tp = &ctx.groups.tp;
            let (model, _) = loaded(&dir, &ctx.groups, &dev, sp);
            let (ids, targets) = batch(&expected, &dev);
            let logits = model.forward(ids).unwrap(); // [b, s, v']
            let loss = model.loss.forward(logits.clone(), targets).unwrap();
            let grads = loss.backward();
            let what = format!("{name} {layout} tp={}", tp.size());

            // transformers' f32 sums run in another order (its matmuls, softmax, RMSNorm, and
            // its f32 rope angles against our f64 ones): measured 1e-7 relative in the loss,
            // a mean over 32 tokens. 1e-5 leaves room for other SIMD widths; dropping the
            // llama3 scaling moves the loss by 2.5e-2, so the test still sees a wrong rope.
            let loss = loss.into_scalar::<f64>();
            let want = expected["loss"].as_f64().unwrap();
            assert!((loss - want).abs() <= 1e-5 * want, "{what}: loss {loss} vs {want}");

            let logits = tp.all_gather(logits.detach(), 2).unwrap().narrow(2, 0, VOCAB); // [b, s, v]
            check_logits(logits, &expected, &what);
            let config = hf::read_config(&dir).unwrap();
            check_grad_norms(&model, &grads, &ctx.groups, &config, &expected, &what);
        });
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// Llama 2 style: θ 1e4, multi-head attention, untied.
pub fn llama2_matches_transformers(h: &Harness) {
    matches_transformers(h, "llama2");
}

/// Llama 3 style: θ 5e5 with `llama3` rope scaling, grouped-query attention, tied embeddings
/// (one parameter: its gradient is the sum of the lookup's and the logits').
pub fn llama3_matches_transformers(h: &Harness) {
    matches_transformers(h, "llama3");
}

/// A tied model trained 2 AdamW steps at tp 2 with sequence parallelism and saved; resumed at
/// tp 1 and tp 4 (the vocabulary padded to 100 there), the next 2 losses are those of going on.
/// It has one embedding parameter and no output weight.
pub fn tied_checkpoint_resumes_at_other_tp(h: &Harness) {
    let src = fixture("llama3");
    let dir = scratch("tied-checkpoint");
    let exp = expected("llama3");
    let train = |model: &mut Llama, optim: &mut burn_megatron::optim::DistributedAdamW, dev: &Device, n: usize| {
        (0..n)
            .map(|_| {
                let (ids, targets) = batch(&exp, dev);
                let loss = model.forward_loss(ids, targets).unwrap();
                let value = loss.clone().into_scalar::<f64>();
                let grads = GradientsParams::from_grads(loss.backward(), &*model);
                *model = optim.step(1e-2, model.clone(), grads).unwrap().0;
                value
            })
            .collect::<Vec<f64>>()
    };
    let reference = h.run(ParallelDims::tp_dp(2, 1), |ctx| {
        let dev = ctx.device.clone().autodiff();
        let (mut model, _) = loaded(&src, &ctx.groups, &dev, true);
        let paths: Vec<String> = param_infos(&model).into_iter().map(|i| i.path).collect();
        assert!(paths.contains(&"embedding.weight".to_string()) && !paths.iter().any(|p| p.starts_with("output")));
        let mut optim = DistributedAdamWConfig::new().init(&ctx.groups);
        train(&mut model, &mut optim, &dev, 2);
        checkpoint::save(&dir, 2, &model, &optim, &ctx.groups).unwrap();
        train(&mut model, &mut optim, &dev, 2)
    })[0]
        .clone();
    for tp in [1, 4] {
        let resumed = h.run(ParallelDims::tp_dp(tp, 1), |ctx| {
            let dev = ctx.device.clone().autodiff();
            // A fresh model from another seed: every value comes from the checkpoint.
            let config = planned(&src, &ctx.groups, tp > 1);
            let fresh = config
                .init(&dev, &ctx.groups, &ParamInit::new(5, InitMode::Full))
                .unwrap();
            let mut optim = DistributedAdamWConfig::new().init(&ctx.groups);
            let (mut model, step) = checkpoint::load(&dir, fresh, &mut optim, &ctx.groups).unwrap();
            assert_eq!(step, 2);
            train(&mut model, &mut optim, &dev, 2)
        });
        for losses in resumed {
            for (a, b) in losses.iter().zip(&reference) {
                // Another tp sums its products in another order; two Adam steps from the same
                // state carry that rounding (see the model suite): 10× the split tolerance.
                assert!(
                    (a - b).abs() <= 10.0 * h.matmul_tolerance * b.abs(),
                    "tp={tp}: {losses:?} vs {reference:?}"
                );
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The loss of the fixture batch on a model loaded from `dir` at tp (plain), one value a rank.
fn loss_at(h: &Harness, dir: &Path, tp: usize, expected: &Value) -> Vec<f64> {
    h.run(ParallelDims::tp_dp(tp, 1), |ctx| {
        let dev = ctx.device.clone();
        let (model, _) = loaded(dir, &ctx.groups, &dev, false);
        let (ids, targets) = batch(expected, &dev);
        model.forward_loss(ids, targets).unwrap().into_scalar::<f64>()
    })
}

/// The llama3 fixture loaded at tp 2 and exported, in f32 over several shards and in bf16 in
/// one file: `config.json` has what transformers needs, the tied output is not stored, and the
/// f32 export loads back (at tp 1 and 4) with the same loss; the bf16 one within bf16 rounding.
pub fn export_round_trip(h: &Harness) {
    let src = fixture("llama3");
    let expected = expected("llama3");
    let want = expected["loss"].as_f64().unwrap();
    for (dtype, max_shard_bytes) in [(ExportDType::F32, 40_000), (ExportDType::BF16, 5_000_000_000)] {
        let out = scratch(&format!("export-{dtype:?}"));
        let options = ExportOptions::new()
            .with_dtype(dtype)
            .with_max_shard_bytes(max_shard_bytes);
        h.run(ParallelDims::tp_dp(2, 1), |ctx| {
            let (model, config) = loaded(&src, &ctx.groups, &ctx.device, true);
            hf::save(&out, &model, &config, &ctx.groups, &options).unwrap();
        });
        let config: Value = serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
        let torch_dtype = match dtype {
            ExportDType::F32 => "float32",
            ExportDType::BF16 => "bfloat16",
        };
        for (field, value) in [
            ("model_type", serde_json::json!("llama")),
            ("architectures", serde_json::json!(["LlamaForCausalLM"])),
            ("hidden_act", serde_json::json!("silu")),
            ("attention_bias", serde_json::json!(false)),
            ("mlp_bias", serde_json::json!(false)),
            ("tie_word_embeddings", serde_json::json!(true)),
            ("head_dim", serde_json::json!(8)),
            ("num_key_value_heads", serde_json::json!(4)),
            ("vocab_size", serde_json::json!(VOCAB)),
            ("rope_theta", serde_json::json!(500000.0)),
            ("torch_dtype", serde_json::json!(torch_dtype)),
            ("dtype", serde_json::json!(torch_dtype)),
        ] {
            assert_eq!(config[field], value, "config.json {field}");
        }
        let rope = &config["rope_parameters"];
        assert_eq!(rope["rope_type"], "llama3");
        assert_eq!(rope["original_max_position_embeddings"], 16);
        assert_eq!(rope["factor"], 8.0);
        let files: Vec<PathBuf> = match dtype {
            ExportDType::F32 => {
                let index: Value =
                    serde_json::from_str(&std::fs::read_to_string(out.join("model.safetensors.index.json")).unwrap())
                        .unwrap();
                let map = index["weight_map"].as_object().unwrap();
                assert_eq!(map.len(), 20, "every tensor but the tied output");
                let mut files: Vec<PathBuf> = map.values().map(|f| out.join(f.as_str().unwrap())).collect();
                files.sort();
                files.dedup();
                assert!(files.len() > 1, "40 kB shards split the 320 kB model");
                files
            }
            ExportDType::BF16 => vec![out.join("model.safetensors")],
        };
        for file in &files {
            let bytes = std::fs::read(file).unwrap();
            let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            assert!(st.tensor("lm_head.weight").is_err(), "the tied output is not stored");
            assert!(st.iter().all(|(_, t)| t.dtype() == dtype_of(dtype)));
            let data: usize = st.iter().map(|(_, t)| t.data().len()).sum();
            assert!(
                data <= max_shard_bytes as usize || st.len() == 1,
                "{file:?}: {data} bytes"
            );
        }
        for tp in [1, 4] {
            for loss in loss_at(h, &out, tp, &expected) {
                let tolerance = match dtype {
                    // The same f32 weights: the fixture comparison's tolerance.
                    ExportDType::F32 => 1e-5,
                    // Weights rounded to 8 bits of mantissa (2^-9 relative each), averaged
                    // over many products: measured 6.5e-4 of the loss; 5e-3.
                    ExportDType::BF16 => 5e-3,
                };
                assert!(
                    (loss - want).abs() <= tolerance * want,
                    "{dtype:?} export at tp={tp}: {loss} vs {want}"
                );
            }
        }
        let _ = std::fs::remove_dir_all(&out);
    }
}

fn dtype_of(dtype: ExportDType) -> safetensors::Dtype {
    match dtype {
        ExportDType::F32 => safetensors::Dtype::F32,
        ExportDType::BF16 => safetensors::Dtype::BF16,
    }
}

/// A config field this model does not build is refused by name, in either layout.
pub fn refused_config_fields(_h: &Harness) {
    let base: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("llama3").join("config.json")).unwrap()).unwrap();
    let base_v4: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("llama3").join("config-v4.json")).unwrap()).unwrap();
    type Edit = fn(&mut Value);
    let cases: [(&str, Value, Edit); 7] = [
        ("rope_type", base.clone(), |c| {
            c["rope_parameters"]["rope_type"] = "longrope".into()
        }),
        ("rope_type", base_v4.clone(), |c| {
            c["rope_scaling"] = serde_json::json!({"type": "dynamic", "factor": 2.0})
        }),
        ("attention_bias", base.clone(), |c| c["attention_bias"] = true.into()),
        ("mlp_bias", base.clone(), |c| c["mlp_bias"] = true.into()),
        ("hidden_act", base.clone(), |c| c["hidden_act"] = "gelu".into()),
        ("num_attention_heads", base.clone(), |c| {
            c["num_attention_heads"] = 7.into();
            c.as_object_mut().unwrap().remove("head_dim");
        }),
        ("partial_rotary_factor", base.clone(), |c| {
            c["rope_parameters"]["partial_rotary_factor"] = 0.5.into()
        }),
    ];
    for (i, (field, mut config, edit)) in cases.into_iter().enumerate() {
        edit(&mut config);
        let dir = scratch(&format!("refused-{i}"));
        std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
        match hf::config(&dir) {
            Err(HfError::Unsupported { field: f, .. }) if f == field => {}
            other => panic!("case {i}: expected {field} refused, got {other:?}"),
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
    // Heads wider than hidden_size / num_attention_heads are built, with their own width.
    let mut wide = base.clone();
    wide["head_dim"] = 16.into();
    let dir = scratch("wide-heads");
    std::fs::write(dir.join("config.json"), wide.to_string()).unwrap();
    let config = hf::config(&dir).unwrap();
    assert_eq!((config.attention.head_dim, config.attention.head_dim()), (Some(16), 16));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A tensor the model has no parameter for is refused by name; the loaded model is unchanged.
pub fn left_over_tensor_is_refused(_h: &Harness) {
    let dir = staged("llama2", "config.json", "left-over");
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let extra = vec![0u8; 64 * 4];
    let mut views: Vec<(String, safetensors::tensor::TensorView<'_>)> = st.tensors();
    views.push((
        "model.layers.0.self_attn.q_proj.bias".into(),
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![64], &extra).unwrap(),
    ));
    let written = safetensors::serialize(views, None).unwrap();
    std::fs::write(dir.join("model.safetensors"), written).unwrap();
    let groups = ProcessGroups::single();
    let config = planned(&dir, &groups, false);
    let model = config
        .init(&Device::flex(), &groups, &ParamInit::new(1, InitMode::Full))
        .unwrap();
    match hf::load(&dir, model, &groups) {
        Err(HfError::LeftOver { names }) => assert_eq!(names, ["model.layers.0.self_attn.q_proj.bias"]),
        other => panic!("expected the bias refused, got {:?}", other.map(|_| ())),
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A checkpoint whose configuration disagrees with the model it is loaded into is refused,
/// naming the field: heads, kv heads, tied or not, sizes, vocabulary, rope.
pub fn config_mismatching_the_model_is_refused(_h: &Harness) {
    let dir = fixture("llama2");
    let groups = ProcessGroups::single();
    type Edit = fn(&mut LlamaConfig);
    let cases: [(&str, Edit); 6] = [
        ("num_attention_heads", |c| {
            c.attention.n_heads = 8;
            c.attention.n_kv_heads = 8;
        }),
        ("num_key_value_heads", |c| c.attention.n_kv_heads = 2),
        ("tie_word_embeddings", |c| c.word_embeddings = WordEmbeddings::Tied),
        ("intermediate_size", |c| c.mlp.d_ff = 64),
        ("vocab_size", |c| {
            c.embedding.vocab_size = 98;
            c.output.d_output = 98;
            c.loss.vocab_size = 98;
        }),
        ("rope_theta", |c| c.attention.rope_theta = 500000.0),
    ];
    for (field, edit) in cases {
        let mut config = hf::config(&dir).unwrap();
        edit(&mut config);
        let model = config
            .init(&Device::flex(), &groups, &ParamInit::new(1, InitMode::Full))
            .unwrap();
        match hf::load(&dir, model, &groups) {
            Err(HfError::Mismatch { field: f, .. }) if f == field => {}
            other => panic!("expected a {field} mismatch, got {:?}", other.map(|_| ())),
        }
    }
}
