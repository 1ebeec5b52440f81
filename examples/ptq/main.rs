//! Post-training quantization of a real model, evaluated on real text: SmolLM2-135M-Instruct
//! (its GGUF file, `scripts/fetch-smollm2.sh`, or a Hugging Face directory) calibrated on windows
//! of Shakespeare's plays (`scripts/fetch-shakespeare.sh`; all but the last tenth), quantized
//! in each format, and measured on the held-out last tenth: perplexity and a greedy answer
//! beside the unquantized model's, in one table (`docs/posttrain.md`).
//!
//!   ptq [--export DIR]     (`ptq --help`: every flag)
//!
//! Rows (`precision::ptq`): int8 weights per channel by the largest magnitude, a percentile or
//! the least squared error; int4 weights in groups of 128, symmetric and with a zero point (each
//! clipping, AWQ's scales, GPTQ's rounding in natural and activation order), with a zero
//! point in groups of 32, and with each group's minimum (GGUF's Q4_1) in groups of 32 and 128; W8A8 in int8 (static ranges by max, percentile and MSE, SmoothQuant,
//! per token) and in FP8 (per tensor with static ranges, per channel with per-token inputs or
//! with inputs in 1×128 tiles), each with its weights alone and with GPTQ; FP8 weights alone; NVFP4 weights, and weights and
//! activations. `--only` keeps the rows whose name contains one of the TEXTs. `--export`
//! writes the FP8 W8A8 model (per tensor, static max ranges), or the row named by
//! `--export-row` (a row's name as the table prints it, e.g. `w:fp8-channel-max a:fp8-tiles
//! gptq-act-order`), in compressed-tensors' layout (with the tokenizer, so `examples/distill
//! --teacher-hf DIR` takes it) and loads it back: its perplexity must be the in-memory one.

#[path = "../common/mod.rs"]
mod common;

use std::path::PathBuf;
use std::time::Instant;

use burn_megatron::init::InitMode;
use burn_megatron::models::llama::generate::{GenerateConfig, Sampling, generate};
use burn_megatron::models::llama::{Llama, LlamaConfig, hf};
use burn_megatron::plan::{ParallelPlan, TensorParallel};
use burn_megatron::posttrain::ptq;
use burn_megatron::precision::PrecisionPolicy;
use burn_megatron::precision::ptq::{
    ActivationScheme, Clipping, Codes, Collect, Gptq, Granularity, PtqConfig, Smoothing, WeightScheme,
};
use burn_megatron_dist::{ParallelDims, ProcessGroups};

use clap::Parser;
use common::cli::{ModelFiles, at_least_one};
use common::{DEFAULT_MODEL, Shared, Text, mean_loss, windows};

/// Post-training quantization of a real model in every scheme, calibrated on the text and
/// measured on its held-out tenth: perplexity and a greedy answer, row by row.
#[derive(Parser, Debug)]
#[command(name = "ptq", args_override_self = true)]
struct Args {
    #[command(flatten)]
    model: ModelFiles,
    #[command(flatten)]
    shared: Shared,
    /// Calibration windows.
    #[arg(long, value_name = "N", default_value_t = 64, value_parser = at_least_one)]
    calibration: usize,
    /// Tokens a calibration window.
    #[arg(long, value_name = "N", default_value_t = 256, value_parser = at_least_one)]
    calibration_seq: usize,
    /// Keep the rows whose name contains one of these (comma-separated).
    #[arg(long, value_name = "TEXT[,TEXT…]")]
    only: Option<String>,
    /// Write the FP8 W8A8 model (or --export-row's) here in compressed-tensors' layout, and
    /// load it back.
    #[arg(long, value_name = "DIR")]
    export: Option<PathBuf>,
    /// The row --export writes, by its name in the table.
    #[arg(long, value_name = "NAME", requires = "export")]
    export_row: Option<String>,
}

fn parse() -> Result<Args, String> {
    checked(Args::parse())
}

/// The command line's values checked against each other.
fn checked(args: Args) -> Result<Args, String> {
    if let Some(name) = &args.export_row
        && !rows().iter().any(|row| &row.name() == name)
    {
        return Err(format!("--export-row {name:?}: no row of the table has that name"));
    }
    Ok(args)
}

/// The table's rows after the unquantized model.
fn rows() -> Vec<PtqConfig> {
    let uniform = |codes, granularity, clipping| WeightScheme::Uniform {
        codes,
        granularity,
        clipping,
    };
    let clippings = [Clipping::Max, Clipping::Percentile(99.9), Clipping::Mse];
    let mut rows = Vec::new();
    for clipping in clippings {
        rows.push(PtqConfig::weight_only(uniform(
            Codes::Int8,
            Granularity::Channel,
            clipping,
        )));
    }
    // int4: symmetric for reference; with a zero point (AWQ's and GPTQ's), every clipping and
    // AWQ's scales; in the GGUF file's own groups of 32.
    rows.push(PtqConfig::weight_only(uniform(
        Codes::Int4,
        Granularity::Group(128),
        Clipping::Max,
    )));
    let asym = |group, clipping| WeightScheme::Asymmetric {
        bits: 4,
        group,
        clipping,
    };
    for clipping in clippings {
        rows.push(PtqConfig::weight_only(asym(128, clipping)));
    }
    let awq = Smoothing::Awq { grid: 20 };
    for clipping in [Clipping::Max, Clipping::Mse] {
        rows.push(PtqConfig::weight_only(asym(128, clipping)).with_smoothing(awq));
    }
    let gptq = Gptq::default();
    let act_order = Gptq {
        act_order: true,
        ..gptq
    };
    rows.push(PtqConfig::weight_only(asym(128, Clipping::Max)).with_gptq(gptq));
    rows.push(PtqConfig::weight_only(asym(128, Clipping::Max)).with_gptq(act_order));
    rows.push(PtqConfig::weight_only(asym(128, Clipping::Mse)).with_gptq(act_order));
    rows.push(
        PtqConfig::weight_only(asym(128, Clipping::Max))
            .with_smoothing(awq)
            .with_gptq(act_order),
    );
    rows.push(PtqConfig::weight_only(asym(32, Clipping::Max)));
    // The GGUF file's own format (Q4_1: groups of 32 with a minimum and a step), and the same
    // in groups of 128.
    for group in [32, 128] {
        rows.push(PtqConfig::weight_only(WeightScheme::Minimum { bits: 4, group }));
    }
    let smoothquant = Smoothing::SmoothQuant { alpha: 0.5 };
    let w8 = |codes, granularity| PtqConfig::weight_only(uniform(codes, granularity, Clipping::Max));
    for codes in [Codes::Int8, Codes::Fp8] {
        let granularity = match codes {
            Codes::Fp8 => Granularity::Tensor,
            _ => Granularity::Channel,
        };
        for clipping in [Clipping::Max, Clipping::Percentile(99.99), Clipping::Mse] {
            rows.push(w8(codes, granularity).with_activations(ActivationScheme::Static { codes, clipping }));
        }
        let mse = ActivationScheme::Static {
            codes,
            clipping: Clipping::Mse,
        };
        rows.push(w8(codes, granularity).with_activations(mse).with_smoothing(smoothquant));
        let token = ActivationScheme::PerToken { codes };
        rows.push(w8(codes, Granularity::Channel).with_activations(token));
        rows.push(
            w8(codes, Granularity::Channel)
                .with_activations(token)
                .with_smoothing(smoothquant),
        );
        // The weights' share of the error, and GPTQ's rounding of them.
        rows.push(w8(codes, Granularity::Channel).with_gptq(act_order));
        rows.push(
            w8(codes, Granularity::Channel)
                .with_activations(token)
                .with_smoothing(smoothquant)
                .with_gptq(act_order),
        );
    }
    // FP8 inputs in DeepSeek-V3's 1×128 tiles, one scale each.
    let tiles = ActivationScheme::Fp8Tiles;
    let fp8_token = ActivationScheme::PerToken { codes: Codes::Fp8 };
    rows.push(
        w8(Codes::Fp8, Granularity::Channel)
            .with_activations(fp8_token)
            .with_gptq(act_order),
    );
    rows.push(w8(Codes::Fp8, Granularity::Channel).with_activations(tiles));
    rows.push(
        w8(Codes::Fp8, Granularity::Channel)
            .with_activations(tiles)
            .with_gptq(act_order),
    );
    rows.push(
        w8(Codes::Fp8, Granularity::Channel)
            .with_activations(tiles)
            .with_smoothing(smoothquant)
            .with_gptq(act_order),
    );
    rows.push(w8(Codes::Fp8, Granularity::Channel));
    rows.push(PtqConfig::weight_only(WeightScheme::Nvfp4));
    rows.push(PtqConfig::weight_only(WeightScheme::Nvfp4).with_activations(ActivationScheme::Nvfp4));
    rows
}

/// The FP8 W8A8 row `--export` writes: per-tensor weights and static inputs at their largest
/// magnitudes (vLLM's default FP8 checkpoint).
fn export_row() -> PtqConfig {
    let weights = WeightScheme::Uniform {
        codes: Codes::Fp8,
        granularity: Granularity::Tensor,
        clipping: Clipping::Max,
    };
    PtqConfig::weight_only(weights).with_activations(ActivationScheme::Static {
        codes: Codes::Fp8,
        clipping: Clipping::Max,
    })
}

fn main() {
    common::main(parse, run)
}

/// The planned, policy-applied configuration of a model at tp = 1.
fn plan(config: LlamaConfig, policy: PrecisionPolicy) -> Result<LlamaConfig, String> {
    let seq = config.attention.max_seq_len;
    let planned = ParallelPlan::new(ParallelDims::single())
        .with_tensor(TensorParallel::Plain)
        .apply(config, 1, seq)
        .map_err(|e| e.to_string())?;
    Ok(policy.apply(planned))
}

fn run(args: &Args) -> Result<(), String> {
    let device = common::device_of(args.shared.device.cuda())(0);
    let groups = ProcessGroups::single();
    let (config, tokenizer) = common::open(&args.model.source(DEFAULT_MODEL))?;
    let text = Text::read(&args.shared.data, &tokenizer)?;
    let policy = match args.shared.device.cuda() {
        true => PrecisionPolicy::bf16(),
        false => PrecisionPolicy::f32(),
    };
    let planned = plan(config, policy)?;
    let init = |config: &LlamaConfig| {
        config
            .init(&device, &groups, &policy.init(1, InitMode::PerShard))
            .map_err(|e| e.to_string())
    };
    let model = common::load(&args.model.source(DEFAULT_MODEL), init(&planned)?, &groups)?;

    let prompt = "<|im_start|>user\nWho wrote Romeo and Juliet?<|im_end|>\n<|im_start|>assistant\n";
    let prompt = tokenizer
        .encode(prompt, false)
        .map_err(|e| e.to_string())?
        .get_ids()
        .to_vec();
    let vocab = tokenizer.get_vocab(true);
    let stop: Vec<u32> = ["<|im_end|>", "<|endoftext|>"]
        .iter()
        .filter_map(|t| vocab.get(*t).copied())
        .collect();
    let answer_config = GenerateConfig {
        max_new_tokens: 24,
        sampling: Sampling::Greedy,
        stop,
        pad: 0,
        seed: 1,
        graphs: true,
    };
    let evaluate = |model: &Llama| -> Result<(f64, String), String> {
        let loss = mean_loss(
            model,
            &text.held_out,
            args.shared.eval_windows,
            args.shared.eval_seq,
            &device,
        )?;
        let out = generate(
            model,
            &groups.tp,
            std::slice::from_ref(&prompt),
            &answer_config,
            &device,
        )
        .map_err(|e| e.to_string())?;
        let answer = tokenizer.decode(&out.tokens[0], true).map_err(|e| e.to_string())?;
        Ok((loss.exp(), answer.replace('\n', " ").replace('|', "/")))
    };

    let begun = Instant::now();
    let batches = windows(&text.train, args.calibration, args.calibration_seq, 8, &device);
    let calibration =
        ptq::calibrate(&model, &batches, Collect::sample(512).with_hessian()).map_err(|e| e.to_string())?;
    println!(
        "calibrated on {} windows of {} tokens in {:.1} s",
        args.calibration,
        args.calibration_seq,
        begun.elapsed().as_secs_f64()
    );
    println!(
        "\nperplexity on the held-out tenth of the plays ({} windows of {} tokens):\n",
        args.shared.eval_windows, args.shared.eval_seq
    );
    println!("| format | perplexity | vs unquantized | greedy answer to \"Who wrote Romeo and Juliet?\" |");
    println!("|---|---|---|---|");
    let (base, answer) = evaluate(&model)?;
    println!("| unquantized ({:?}) | {base:.3} | | {answer} |", policy.compute);
    for row in rows() {
        let name = row.name();
        if args
            .only
            .as_ref()
            .is_some_and(|only| !only.split(',').any(|t| name.contains(t)))
        {
            continue;
        }
        let quantized = ptq::quantize(model.clone(), &row, &calibration, &batches).map_err(|e| e.to_string())?;
        let (perplexity, answer) = evaluate(&quantized.model)?;
        println!(
            "| {name} | {perplexity:.3} | {:+.2}% | {answer} |",
            100.0 * (perplexity / base - 1.0)
        );
    }
    println!("\n{:.1} s in all", begun.elapsed().as_secs_f64());

    if let Some(dir) = &args.export {
        let row = match &args.export_row {
            Some(name) => rows()
                .into_iter()
                .find(|row| &row.name() == name)
                .expect("checked by parse"),
            None => export_row(),
        };
        let quantized = ptq::quantize(model.clone(), &row, &calibration, &batches).map_err(|e| e.to_string())?;
        let (in_memory, _) = evaluate(&quantized.model)?;
        let options = hf::ExportOptions::new();
        hf::save_quantized(
            dir,
            &quantized.model,
            &quantized.quantization,
            &planned,
            &groups,
            &options,
        )
        .map_err(|e| e.to_string())?;
        tokenizer
            .save(dir.join("tokenizer.json"), false)
            .map_err(|e| e.to_string())?;
        let reread = plan(hf::config(dir).map_err(|e| e.to_string())?, policy)?;
        let reloaded = hf::load(dir, init(&reread)?, &groups).map_err(|e| e.to_string())?;
        let (loaded, _) = evaluate(&reloaded)?;
        println!(
            "\n{} written to {} (compressed-tensors) and loaded back: perplexity {loaded:.3}, in memory {in_memory:.3}",
            row.name(),
            dir.display()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use common::cli::testing::{errors_say_what, help_is_on_stdout};

    #[test]
    fn help_and_bad_values() {
        help_is_on_stdout::<Args>("ptq");
        errors_say_what::<Args, _>(
            "ptq",
            checked,
            &[
                ("--calibration 0", "invalid value '0' for '--calibration <N>'"),
                ("--export-row w:int8", "--export <DIR>"),
                (
                    "--export /tmp/x --export-row nothing",
                    "no row of the table has that name",
                ),
                ("--eval-seq 1", "at least 2"),
                ("--model a.gguf --hf dir", "cannot be used with"),
                ("--frobnicate", "unexpected argument '--frobnicate'"),
            ],
        );
    }
}
