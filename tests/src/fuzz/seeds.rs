//! Writes the fuzzing corpora's seeds and the files the targets load beside their input
//! (`tests/fuzz/`), from small models this project writes: GGUF files of a 1-block model in
//! F32, Q8_0 and Q4_1 with a byte-level BPE tokenizer, the tiny model's Hugging Face directory
//! (config, weights in f32 and bf16, a shard index), its checkpoint after one step, the
//! fixtures' `config.json`s and the example job files. Run once, and after a format changes:
//! `cargo test -p burn-megatron-tests --test fuzz_cpu -- --ignored write_seeds`.

use std::collections::BTreeMap;
use std::path::Path;

use burn::optim::GradientsParams;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_megatron::checkpoint;
use burn_megatron::init::{InitMode, ParamInit};
use burn_megatron::models::llama::{Llama, LlamaConfig, gguf, hf};
use burn_megatron::optim::DistributedAdamWConfig;
use burn_megatron_dist::ProcessGroups;
use safetensors::SafeTensors;

use super::corpus;
use super::targets::{tiny_config, tiny_model};
use crate::gguf_writer::{Entry, Meta, Store, llama_metadata, write};
use crate::posttrain_suite::gguf_name;

fn put(target: &str, name: &str, bytes: &[u8]) {
    let dir = corpus(target);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(name), bytes).unwrap();
}

fn scratch() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("burn-megatron-seeds-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `model`'s Hugging Face export under `dir` in `dtype`: the weights file's bytes.
fn export(dir: &Path, model: &Llama, config: &LlamaConfig, dtype: hf::ExportDType) -> Vec<u8> {
    let options = hf::ExportOptions::new().with_dtype(dtype);
    hf::save(dir, model, config, &ProcessGroups::single(), &options).unwrap();
    std::fs::read(dir.join("model.safetensors")).unwrap()
}

/// Every seed and fixed file.
pub fn write_all() {
    // Megatron's indexed datasets (`tests/fixtures/data`): its indexes, and a `.bin` that holds
    // either's sequences.
    let data = crate::data_suite::fixtures();
    for name in ["megatron_u16.idx", "megatron_i32.idx"] {
        put("data-index", name, &std::fs::read(data.join(name)).unwrap());
    }
    put(
        "fixed",
        "data.bin",
        &std::fs::read(data.join("megatron_i32.bin")).unwrap(),
    );

    let dir = scratch();
    let config = tiny_config();
    let model = tiny_model();

    // A Hugging Face directory of the tiny model.
    let f32s = export(&dir.join("hf"), &model, &config, hf::ExportDType::F32);
    put("fixed", "hf.safetensors", &f32s);
    put(
        "fixed",
        "hf.config.json",
        &std::fs::read(dir.join("hf/config.json")).unwrap(),
    );
    put("hf-weights", "tiny-f32.safetensors", &f32s);
    let bf16s = export(&dir.join("hf-bf16"), &model, &config, hf::ExportDType::BF16);
    put("hf-weights", "tiny-bf16.safetensors", &bf16s);
    let names: BTreeMap<String, String> = SafeTensors::deserialize(&f32s)
        .unwrap()
        .names()
        .into_iter()
        .map(|n| (n.to_string(), "model-00001-of-00001.safetensors".to_string()))
        .collect();
    let index = serde_json::json!({ "metadata": { "total_size": f32s.len() }, "weight_map": names });
    put(
        "hf-index",
        "index.json",
        serde_json::to_string_pretty(&index).unwrap().as_bytes(),
    );
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/hf");
    for (name, file) in [
        ("llama2.json", "llama2/config.json"),
        ("llama2-v4.json", "llama2/config-v4.json"),
        ("llama3.json", "llama3/config.json"),
        ("llama3-v4.json", "llama3/config-v4.json"),
    ] {
        put("hf-config", name, &std::fs::read(fixtures.join(file)).unwrap());
    }

    // GGUF files of a model whose rows hold whole quantization blocks (32 values).
    let wide = LlamaConfig::llama(16, 32, 1, 2, 2, 64, 8);
    let wide_model = wide
        .init(
            &Device::flex(),
            &ProcessGroups::single(),
            &ParamInit::new(2, InitMode::Full),
        )
        .unwrap();
    let weights = export(&dir.join("wide"), &wide_model, &wide, hf::ExportDType::F32);
    let file = SafeTensors::deserialize(&weights).unwrap();
    for store in [Store::F32, Store::Q8_0, Store::Q4_1] {
        let tensors: BTreeMap<String, Entry> = file
            .tensors()
            .into_iter()
            .map(|(name, view)| {
                let values: Vec<f32> = view
                    .data()
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                let shape = view.shape().to_vec();
                let store = if shape.len() == 2 { store } else { Store::F32 };
                (gguf_name(&name), Entry { shape, values, store })
            })
            .collect();
        let path = dir.join("model.gguf");
        write(&path, &gguf_metadata(), &tensors);
        gguf::config(&path).expect("the seed loads");
        put(
            "gguf",
            &format!("wide-{store:?}.gguf").to_lowercase(),
            &std::fs::read(&path).unwrap(),
        );
        if store == Store::F32 {
            let tokenizer = gguf::tokenizer(&path).expect("the seed's tokenizer");
            put(
                "hf-tokenizer",
                "bpe.json",
                tokenizer.to_string(true).unwrap().as_bytes(),
            );
        }
    }

    // The tiny model's checkpoint after one step; the shard target's index has no checksums.
    let ckpt = dir.join("checkpoint");
    let groups = ProcessGroups::single();
    let device = Device::flex().autodiff();
    let trained = config
        .init(&device, &groups, &ParamInit::new(1, InitMode::Full))
        .unwrap();
    let mut optim = DistributedAdamWConfig::new().init(&groups);
    let ids = Tensor::<2, Int>::from_data(
        TensorData::new((0..18).map(|i| i % 16).collect::<Vec<i64>>(), [2, 9]),
        &device,
    );
    let loss = trained
        .forward_loss(ids.clone().narrow(1, 0, 8), ids.narrow(1, 1, 8))
        .unwrap();
    let grads = GradientsParams::from_grads(loss.backward(), &trained);
    let (trained, _) = optim.step(1e-3, trained, grads).unwrap();
    checkpoint::save(&ckpt, 1, &trained, &optim, &groups).unwrap();
    let latest = std::fs::read_to_string(ckpt.join("latest")).unwrap();
    let step = ckpt.join(latest.trim());
    let shard = std::fs::read(step.join("tp-000-of-001-ep-000-of-001.safetensors")).unwrap();
    let index = std::fs::read(step.join("index.json")).unwrap();
    put("fixed", "checkpoint.safetensors", &shard);
    put("checkpoint-shard", "tiny.safetensors", &shard);
    put("checkpoint-index", "index.json", &index);
    let mut unchecked: serde_json::Value = serde_json::from_slice(&index).unwrap();
    unchecked["format"] = "burn-megatron/2".into();
    unchecked.as_object_mut().unwrap().remove("checksums");
    put(
        "fixed",
        "checkpoint.index.json",
        serde_json::to_string_pretty(&unchecked).unwrap().as_bytes(),
    );

    // The example job files.
    let jobs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/jobs");
    for name in ["tiny.toml", "tiny-moe.toml", "llama-1b.toml"] {
        put("job", name, &std::fs::read(jobs.join(name)).unwrap());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The GGUF metadata of the wide seed model, with a byte-level BPE tokenizer of 16 tokens.
fn gguf_metadata() -> BTreeMap<String, Meta> {
    let tokens: Vec<String> = [
        "<|endoftext|>",
        "h",
        "e",
        "l",
        "o",
        "Ġ",
        "w",
        "r",
        "d",
        "he",
        "ll",
        "Ġw",
        "or",
        "ld",
        "1",
        "2",
    ]
    .map(String::from)
    .to_vec();
    let merges = ["h e", "l l", "Ġ w", "o r", "l d"].map(String::from).to_vec();
    let types: Vec<i32> = (0..tokens.len()).map(|i| if i == 0 { 3 } else { 1 }).collect();
    let mut metadata = llama_metadata(1, 32, 64, (2, 16), 8, 16);
    metadata.extend([
        ("tokenizer.ggml.model".to_string(), Meta::Text("gpt2".into())),
        ("tokenizer.ggml.pre".to_string(), Meta::Text("smollm".into())),
        ("tokenizer.ggml.tokens".to_string(), Meta::Texts(tokens)),
        ("tokenizer.ggml.merges".to_string(), Meta::Texts(merges)),
        ("tokenizer.ggml.token_type".to_string(), Meta::I32s(types)),
    ]);
    metadata
}
