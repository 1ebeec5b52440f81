//! Turns a checkpoint of `train` (any layout: tp, dp, ep, pp, cp) into a Hugging Face
//! directory transformers opens: the job saved beside the checkpoint rebuilds the model on one
//! rank, the latest checkpoint's weights reshard into it, and `hf::save` writes it with the
//! job's tokenizer (its `data.tokenizer`, or its Hugging Face model's).
//!
//!   convert --checkpoint DIR --output DIR [--dtype bf16]

use std::path::{Path, PathBuf};

use burn::tensor::Device;
use burn_megatron::checkpoint;
use burn_megatron::job::{JobConfig, ParallelSection};
use burn_megatron::models::llama::hf::{self, ExportDType, ExportOptions};
use burn_megatron_dist::ProcessGroups;
use clap::{Parser, ValueEnum};

#[cfg(test)]
mod tests;

/// Writes the latest checkpoint under a directory as a Hugging Face model.
#[derive(Parser, Debug)]
#[command(name = "convert", args_override_self = true)]
struct Args {
    /// A `train` checkpoint directory (`checkpoint.dir`).
    #[arg(long, value_name = "DIR")]
    checkpoint: PathBuf,
    /// The Hugging Face directory to write.
    #[arg(long, value_name = "DIR")]
    output: PathBuf,
    /// The weights' dtype in the files.
    #[arg(long, value_enum, default_value_t = Dtype::F32)]
    dtype: Dtype,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Dtype {
    F32,
    Bf16,
}

fn main() {
    let args = Args::parse();
    match convert(&args.checkpoint, &args.output, args.dtype) {
        Ok(line) => println!("{line}"),
        Err(e) => {
            eprintln!("convert: {e}");
            std::process::exit(1);
        }
    }
}

/// Converts the latest checkpoint under `checkpoint` into `output`; returns the line it prints.
fn convert(checkpoint: &Path, output: &Path, dtype: Dtype) -> Result<String, String> {
    let bytes = checkpoint::attachment(checkpoint, "job.toml")
        .map_err(|e| e.to_string())?
        .ok_or_else(|| {
            format!(
                "{}: no job.toml beside the checkpoint (saved by an older build)",
                checkpoint.display()
            )
        })?;
    let mut config =
        JobConfig::from_toml(&String::from_utf8_lossy(&bytes)).map_err(|e| format!("{}: {e}", checkpoint.display()))?;
    // One rank holds the whole model; the checkpoint reshards into it.
    config.parallel = ParallelSection::default();
    config.checkpoint = Default::default();
    let job = config.resolve().map_err(|e| e.to_string())?;
    let groups = ProcessGroups::single();
    let model = job
        .model
        .init(&Device::flex(), &groups, &job.init())
        .map_err(|e| e.to_string())?;
    let (model, step) = checkpoint::load_model(checkpoint, model, &groups).map_err(|e| e.to_string())?;
    let dtype = match dtype {
        Dtype::F32 => ExportDType::F32,
        Dtype::Bf16 => ExportDType::BF16,
    };
    hf::save(
        output,
        &model,
        &job.model,
        &groups,
        &ExportOptions::new().with_dtype(dtype),
    )
    .map_err(|e| e.to_string())?;
    let tokenizer = (job.config.data.tokenizer.clone())
        .or_else(|| job.config.model.hf.as_ref().map(|d| d.join("tokenizer.json")))
        .filter(|t| t.exists());
    if let Some(tokenizer) = &tokenizer {
        let to = output.join("tokenizer.json");
        std::fs::copy(tokenizer, &to).map_err(|e| format!("{}: {e}", to.display()))?;
    }
    Ok(format!(
        "{}: step {step} of {} as a Hugging Face model{}",
        output.display(),
        checkpoint.display(),
        match tokenizer {
            Some(_) => ", with its tokenizer",
            None => " (the job had no tokenizer)",
        }
    ))
}
