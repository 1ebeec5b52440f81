//! The loaders fuzzed, one [`Target`] each: GGUF files (header, metadata, tensors, the
//! tokenizer), a Hugging Face directory's `config.json`, weights and shard index, a
//! `tokenizer.json`, this project's checkpoints (index and shards), job files and a tokenized
//! dataset's index (`.idx`).

use std::path::Path;

use burn::tensor::Device;
use burn_megatron::checkpoint;
use burn_megatron::data::{IndexedDataset, indexed};
use burn_megatron::init::{InitMode, ParamInit};
use burn_megatron::job::JobConfig;
use burn_megatron::models::llama::{Llama, LlamaConfig, gguf, hf};
use burn_megatron::optim::DistributedAdamWConfig;
use burn_megatron::plan::{ParallelPlan, TensorParallel};
use burn_megatron_dist::{ParallelDims, ProcessGroups};

/// One loader under fuzzing: `run` writes the input where the loader reads it (under the
/// scratch directory) and loads it, saying whether the loader accepted it.
pub struct Target {
    pub name: &'static str,
    /// Whether the input is text (numbers in it get swapped too).
    pub text: bool,
    pub run: fn(&[u8], &Path) -> bool,
}

pub const TARGETS: [Target; 9] = [
    Target {
        name: "gguf",
        text: false,
        run: gguf_file,
    },
    Target {
        name: "hf-config",
        text: true,
        run: hf_config,
    },
    Target {
        name: "hf-weights",
        text: false,
        run: hf_weights,
    },
    Target {
        name: "hf-index",
        text: true,
        run: hf_index,
    },
    Target {
        name: "hf-tokenizer",
        text: true,
        run: hf_tokenizer,
    },
    Target {
        name: "checkpoint-index",
        text: true,
        run: checkpoint_index,
    },
    Target {
        name: "checkpoint-shard",
        text: false,
        run: checkpoint_shard,
    },
    Target {
        name: "job",
        text: true,
        run: job,
    },
    Target {
        name: "data-index",
        text: false,
        run: data_index,
    },
];

/// The files the targets write beside their input (`tests/fuzz/fixed/`).
pub fn fixed(name: &str) -> Vec<u8> {
    let path = super::corpus("fixed").join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The small model the seeds were written from: 1 block, d 8, 2 heads, ffn 16, vocab 16.
pub fn tiny_config() -> LlamaConfig {
    LlamaConfig::llama(16, 8, 1, 2, 2, 16, 8)
}

/// [`tiny_config`]'s model on the CPU, initialized.
pub fn tiny_model() -> Llama {
    tiny_config()
        .init(
            &Device::flex(),
            &ProcessGroups::single(),
            &ParamInit::new(1, InitMode::Full),
        )
        .expect("the tiny model")
}

fn write(path: &Path, bytes: &[u8]) {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).unwrap();
    }
    std::fs::write(path, bytes).unwrap();
}

/// A GGUF file: its configuration, every tensor dequantized, its tokenizer (encoding a line).
fn gguf_file(input: &[u8], scratch: &Path) -> bool {
    let path = scratch.join("model.gguf");
    write(&path, input);
    let config = gguf::config(&path);
    if let Ok(file) = gguf::GgufFile::open(&path) {
        for name in file.tensors.keys() {
            file.values(name);
        }
    }
    if let Ok(tokenizer) = gguf::tokenizer(&path)
        && let Ok(encoding) = tokenizer.encode("hello world 12", false)
    {
        let _ = tokenizer.decode(encoding.get_ids(), false);
    }
    config.is_ok_and(|config| describe(&config))
}

/// A model configuration's derived numbers, as a job computes them: planned at tp 1 (which
/// checks it), its FLOPs and its memory estimate. Whether the plan accepted it.
fn describe(config: &LlamaConfig) -> bool {
    let seq = config.attention.max_seq_len.clamp(1, 16);
    let _ = config.flops_per_token(seq);
    let _ = config.memory(ParallelDims::single(), TensorParallel::Plain, seq, 2, false);
    ParallelPlan::new(ParallelDims::single())
        .apply(config.clone(), 1, seq)
        .is_ok()
}

/// A Hugging Face `config.json`.
fn hf_config(input: &[u8], scratch: &Path) -> bool {
    let path = scratch.join("config.json");
    let Ok(text) = std::str::from_utf8(input) else {
        return false;
    };
    match hf::HfConfig::parse(text, &path) {
        Ok(config) => describe(&config.to_llama()),
        Err(_) => false,
    }
}

/// A Hugging Face directory's `model.safetensors`, loaded into the tiny model.
fn hf_weights(input: &[u8], scratch: &Path) -> bool {
    let dir = scratch.join("hf");
    write(&dir.join("config.json"), &fixed("hf.config.json"));
    write(&dir.join("model.safetensors"), input);
    let _ = std::fs::remove_file(dir.join("model.safetensors.index.json"));
    hf::load(&dir, tiny_model(), &ProcessGroups::single()).is_ok()
}

/// A Hugging Face directory's `model.safetensors.index.json`, naming the tiny model's shard.
fn hf_index(input: &[u8], scratch: &Path) -> bool {
    let dir = scratch.join("hf-sharded");
    write(&dir.join("config.json"), &fixed("hf.config.json"));
    write(&dir.join("model-00001-of-00001.safetensors"), &fixed("hf.safetensors"));
    write(&dir.join("model.safetensors.index.json"), input);
    hf::load(&dir, tiny_model(), &ProcessGroups::single()).is_ok()
}

/// A `tokenizer.json` (`hf::tokenizer`, around the `tokenizers` crate's parser), encoding and
/// decoding a line.
fn hf_tokenizer(input: &[u8], scratch: &Path) -> bool {
    let path = scratch.join("tokenizer.json");
    write(&path, input);
    match hf::tokenizer(&path) {
        Ok(tokenizer) => {
            if let Ok(encoding) = tokenizer.encode("hello world 12", false) {
                let _ = tokenizer.decode(encoding.get_ids(), false);
            }
            true
        }
        Err(_) => false,
    }
}

/// A checkpoint of the tiny model whose index is `index` and shard `shard`, loaded.
fn load_checkpoint(scratch: &Path, index: &[u8], shard: &[u8]) -> bool {
    let dir = scratch.join("checkpoint");
    write(&dir.join("latest"), b"step-1");
    write(&dir.join("step-1/index.json"), index);
    write(&dir.join("step-1/tp-000-of-001-ep-000-of-001.safetensors"), shard);
    let groups = ProcessGroups::single();
    let mut optim = DistributedAdamWConfig::new().init(&groups);
    checkpoint::load(&dir, tiny_model(), &mut optim, &groups).is_ok()
}

/// A checkpoint's `index.json` (the shard as written).
fn checkpoint_index(input: &[u8], scratch: &Path) -> bool {
    load_checkpoint(scratch, input, &fixed("checkpoint.safetensors"))
}

/// A checkpoint's shard, under an index without checksums (format 2), so that a damaged
/// shard reaches the parser and the placements.
fn checkpoint_shard(input: &[u8], scratch: &Path) -> bool {
    load_checkpoint(scratch, &fixed("checkpoint.index.json"), input)
}

/// A job file: parsed, resolved (every number checked), its memory estimated against 80 GiB,
/// written back and parsed again.
fn job(input: &[u8], _: &Path) -> bool {
    let Ok(text) = std::str::from_utf8(input) else {
        return false;
    };
    let Ok(config) = JobConfig::from_toml(text) else {
        return false;
    };
    let Ok(job) = config.resolve() else {
        return false;
    };
    let _ = job.check_memory(80 << 30);
    let again = JobConfig::from_toml(&job.config.to_toml()).expect("a resolved job's file parses");
    assert_eq!(again, job.config, "a resolved job round-trips");
    true
}

/// A tokenized dataset's index (`.idx`) beside a fixed `.bin` (`fixed/data.bin`): every
/// document's range and every sequence read.
fn data_index(input: &[u8], scratch: &Path) -> bool {
    let prefix = scratch.join("data");
    let (bin, idx) = indexed::paths(&prefix);
    write(&idx, input);
    write(&bin, &fixed("data.bin"));
    let Ok(data) = IndexedDataset::open(&prefix) else {
        return false;
    };
    let sequences = (0..data.documents()).map(|d| data.document(d).len()).sum::<usize>();
    sequences == data.len() && (0..data.len()).all(|i| data.sequence(i, 1 << 20).is_ok())
}
