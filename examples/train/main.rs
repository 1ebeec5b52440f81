//! Trains a Llama from a job: a preset of this crate (tiny by default, on the CPU with ranks as
//! threads) or a Hugging Face or GGUF model, at any tp × cp × dp layout with ep and pp, through
//! Burn's Learner or a plain loop.
//!
//!   cargo run --release --example train -- --tp 2 --sp --dp 2 --steps 20
//!   cargo run --release --example train -- --config examples/jobs/tiny.toml --optimizer.lr 1e-3
//!
//! Prints the resolved job, then a line a step (`step N loss X … lr Y tokens/s`; a MoE adds its
//! router losses and each expert's token copies), evaluations, greedy samples, and the speed at
//! the end; writes the metrics file and checkpoints the job names. The same seed and job print
//! the same losses at every layout (within f32 rounding): every layout builds the same model
//! (`init = "full"`) and reads the same data in the same order. A loss that is not finite, or a
//! launch the device could not run, stops the run naming the step.

#[path = "../common/mod.rs"]
mod common;

mod cli;
mod data;
#[cfg(feature = "learner")]
mod learner;
mod plain;
mod progress;
mod rank;
mod sample;
#[cfg(test)]
mod tests;

use std::io::IsTerminal;
use std::process::ExitCode;

use burn::tensor::Device;
use burn_megatron::checkpoint;
use burn_megatron::job::{DeviceKind, Driver, Job, JobConfig};
use burn_megatron::train::{Lines, Reporter};
use clap::Parser;

use data::Corpus;
use rank::Run;

fn main() -> ExitCode {
    let (rest, dotted) = match cli::split(std::env::args_os()) {
        Ok(split) => split,
        Err(message) => {
            eprintln!("error: {message}");
            return ExitCode::from(2);
        }
    };
    let args = cli::Args::parse_from(rest);
    let job = match args.job(&dotted).and_then(|job| job.resolve()) {
        Ok(job) => job,
        Err(message) => {
            eprintln!("error: {message}");
            return ExitCode::from(2);
        }
    };
    common::logging::init();
    match train(job) {
        Ok(_) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::FAILURE
        }
    }
}

/// Trains `job`; returns the losses the reporting rank read.
fn train(job: Job) -> Result<Vec<f64>, String> {
    let run = prepare(job)?;
    println!("# the job, resolved\n{}", run.job.config.to_toml());
    match run.job.config.logging.driver {
        #[cfg(feature = "learner")]
        Driver::Learner => learner::run(&run),
        #[cfg(not(feature = "learner"))]
        Driver::Learner => Err("logging.driver = \"learner\" needs the examples' `learner` feature (on by default; GPU builds leave it out): use --plain".into()),
        Driver::Plain => {
            let (done, steps) = (run.done, run.job.config.steps);
            let bar = std::io::stdout().is_terminal();
            plain::run(&run, move || -> Box<dyn Reporter> {
                match bar {
                    true => Box::new(progress::Bar::new(done, steps)),
                    false => Box::new(Lines),
                }
            })
        }
    }
}

/// The run's data, prompt, and the checkpoint it resumes from (held to the job that saved it).
fn prepare(mut job: Job) -> Result<Run, String> {
    if job.config.data.sft {
        // The loss counts the assistant's tokens only.
        job.model.loss.ignore_index = Some(data::IGNORED);
    }
    let (corpus, held_out) = Corpus::of(&job)?;
    corpus.check_len(job.seq)?;
    if let Some(held) = &held_out {
        held.check_len(job.seq).map_err(|e| format!("data.held_out: {e}"))?;
    }
    if job.model.embedding.vocab_size < corpus.vocab_size() {
        return Err(format!(
            "the tokens need a vocabulary of {}; the model has {}",
            corpus.vocab_size(),
            job.model.embedding.vocab_size
        ));
    }
    let mut done = 0;
    if let Some(dir) = &job.config.checkpoint.load {
        done = checkpoint::latest_step(dir).map_err(|e| e.to_string())? as usize;
        match checkpoint::attachment(dir, "job.toml").map_err(|e| e.to_string())? {
            Some(bytes) => {
                let text = String::from_utf8_lossy(&bytes);
                let saved = JobConfig::from_toml(&text).map_err(|e| format!("{}: {e}", dir.display()))?;
                job.config.check_resume(&saved).map_err(|e| e.to_string())?;
            }
            None => tracing::warn!(
                "{} holds no job (saved by an older build): resuming without checking it",
                dir.display()
            ),
        }
    }
    let files = job.config.data.path.is_some() || !job.config.data.prefixes.is_empty();
    let (prompt, pad) = match files {
        true => (
            corpus.head(job.seq / 2)?,
            corpus.encode("\n").first().copied().unwrap_or(0),
        ),
        false => (corpus.encode("\n417+385="), corpus.encode("\n")[0]),
    };
    Ok(Run {
        job,
        corpus,
        held_out,
        done,
        prompt,
        pad,
    })
}

/// The device of local rank `local`.
fn device_of(run: &Run) -> impl Fn(usize) -> Device + Sync + Copy {
    common::device_of(run.job.config.device == DeviceKind::Cuda)
}

/// The reporting rank's losses (the others return none), or the first rank's error.
fn reported(results: Vec<Result<Vec<f64>, String>>) -> Result<Vec<f64>, String> {
    let mut printed = Vec::new();
    for losses in results {
        let losses = losses?;
        if !losses.is_empty() {
            printed = losses;
        }
    }
    Ok(printed)
}

/// The pipeline's bubble: the schedule's on paper beside the stages' `measured` share.
fn bubble_line(run: &Run, measured: f64) -> Result<String, String> {
    let job = &run.job;
    let actions = job
        .plan
        .pipeline
        .actions(job.dims().pp, job.microbatches)
        .map_err(|e| e.to_string())?;
    let predicted = burn_megatron::plan::pipeline::simulate::simulate(&actions)
        .map_err(|e| e.to_string())?
        .bubble;
    Ok(format!(
        "bubble: {predicted:.3} predicted (the schedule run on paper: forward 1/v, backward 2/v, messages free), {measured:.3} measured (the stages' mean share of a step outside their forwards and backwards)"
    ))
}
