//! Minitron-style pruning of a real model: SmolLM2-135M-Instruct (its GGUF file or a Hugging
//! Face directory) ranked on windows of Shakespeare's plays (all but the held-out last tenth),
//! pruned in depth (whole blocks, by the loss without each) and width (embedding channels, FFN
//! channels, query heads within each kv group, by their activations) to a target size, and
//! saved as a Hugging Face directory for `examples/distill`.
//!
//!   prune [--out data/pruned]     (`prune --help`: every flag)
//!
//! The defaults take SmolLM2-135M (30 blocks of 576, FFN 1536, 9 heads over 3 kv heads) to
//! about 87M parameters. Prints the blocks' and channels' rankings, the parameter counts, and the
//! held-out perplexity before and after (the pruned model before any distillation).

#[path = "../common/mod.rs"]
mod common;

use std::path::PathBuf;
use std::time::Instant;

use burn_megatron::init::InitMode;
use burn_megatron::models::llama::{Llama, LlamaConfig, hf};
use burn_megatron::params::param_values;
use burn_megatron::plan::{ParallelPlan, TensorParallel};
use burn_megatron::posttrain::prune::{self, PruneTarget};
use burn_megatron::precision::PrecisionPolicy;
use burn_megatron_dist::{ParallelDims, ProcessGroups};

use clap::Parser;
use common::cli::{ModelFiles, at_least_one};
use common::{DEFAULT_MODEL, Shared, Text, mean_loss, windows};

/// Minitron-style pruning of a real model in depth and width to a target size, ranked on the
/// text, saved as a Hugging Face directory for `distill`.
#[derive(Parser, Debug)]
#[command(name = "prune", args_override_self = true)]
struct Args {
    #[command(flatten)]
    model: ModelFiles,
    #[command(flatten)]
    shared: Shared,
    /// Calibration windows the rankings read.
    #[arg(long, value_name = "N", default_value_t = 32, value_parser = at_least_one)]
    calibration: usize,
    /// Tokens a calibration window (at least 2).
    #[arg(long, value_name = "N", default_value_t = 256, value_parser = common::at_least_two)]
    calibration_seq: usize,
    /// Blocks to keep (SmolLM2's default: 26).
    #[arg(long, value_name = "N", value_parser = at_least_one)]
    layers: Option<usize>,
    /// Embedding channels to keep (512).
    #[arg(long, value_name = "N", value_parser = at_least_one)]
    d_model: Option<usize>,
    /// FFN channels to keep (1024).
    #[arg(long, value_name = "N", value_parser = at_least_one)]
    d_ff: Option<usize>,
    /// Query heads to keep in each kv group.
    #[arg(long, value_name = "N", value_parser = at_least_one)]
    heads_per_kv: Option<usize>,
    /// Where the pruned model's Hugging Face directory goes.
    #[arg(long, value_name = "DIR", default_value = "data/pruned")]
    out: PathBuf,
}

fn parse() -> Result<Args, String> {
    Ok(Args::parse())
}

/// The target: the flags over SmolLM2's defaults, scaled to the model where it is another.
fn target(args: &Args, config: &LlamaConfig) -> PruneTarget {
    let has = PruneTarget::of(config);
    let smollm2 = has.n_layers == 30 && has.d_model == 576 && has.d_ff == 1536;
    let default = match smollm2 {
        true => PruneTarget {
            n_layers: 26,
            d_model: 512,
            d_ff: 1024,
            heads_per_kv: has.heads_per_kv,
        },
        false => has,
    };
    PruneTarget {
        n_layers: args.layers.unwrap_or(default.n_layers),
        d_model: args.d_model.unwrap_or(default.d_model),
        d_ff: args.d_ff.unwrap_or(default.d_ff),
        heads_per_kv: args.heads_per_kv.unwrap_or(default.heads_per_kv),
    }
}

fn parameters(model: &Llama) -> usize {
    param_values(model)
        .iter()
        .map(|p| p.dims.iter().product::<usize>())
        .sum()
}

fn main() {
    common::main(parse, run)
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
    let seq = config.attention.max_seq_len;
    let planned = ParallelPlan::new(ParallelDims::single())
        .with_tensor(TensorParallel::Plain)
        .apply(config.clone(), 1, seq)
        .map_err(|e| e.to_string())?;
    let planned = policy.apply(planned);
    let model = planned
        .init(&device, &groups, &policy.init(1, InitMode::PerShard))
        .map_err(|e| e.to_string())?;
    let model = common::load(&args.model.source(DEFAULT_MODEL), model, &groups)?;
    let target = target(args, &config);

    let begun = Instant::now();
    let batches = windows(&text.train, args.calibration, args.calibration_seq + 1, 4, &device);
    let importance = prune::importance(&model, &batches).map_err(|e| e.to_string())?;
    println!(
        "importance from {} windows of {} tokens in {:.1} s",
        args.calibration,
        args.calibration_seq,
        begun.elapsed().as_secs_f64()
    );
    let blocks: Vec<f32> = importance.blocks.iter().map(|b| *b as f32).collect();
    let kept = prune::top(&blocks, target.n_layers);
    let dropped: Vec<String> = (0..blocks.len())
        .filter(|b| !kept.contains(b))
        .map(|b| format!("{b} ({:+.4} nats without it)", importance.blocks[b]))
        .collect();
    println!("blocks dropped: {}", dropped.join(", "));
    let (pruned_config, pruned) = prune::prune(&model, &planned, &importance, target).map_err(|e| e.to_string())?;
    let (before, after) = (parameters(&model), parameters(&pruned));
    println!(
        "{:?} → {target:?}: {:.1}M → {:.1}M parameters",
        PruneTarget::of(&planned),
        before as f64 / 1e6,
        after as f64 / 1e6
    );
    let ppl = |m: &Llama| {
        mean_loss(
            m,
            &text.held_out,
            args.shared.eval_windows,
            args.shared.eval_seq,
            &device,
        )
        .map(f64::exp)
    };
    println!(
        "held-out perplexity ({} windows of {} tokens): {:.2} before, {:.2} pruned (before distillation)",
        args.shared.eval_windows,
        args.shared.eval_seq,
        ppl(&model)?,
        ppl(&pruned)?
    );
    let options = hf::ExportOptions::new().with_dtype(match args.shared.device.cuda() {
        true => hf::ExportDType::BF16,
        false => hf::ExportDType::F32,
    });
    hf::save(&args.out, &pruned, &pruned_config, &groups, &options).map_err(|e| e.to_string())?;
    tokenizer
        .save(args.out.join("tokenizer.json"), false)
        .map_err(|e| e.to_string())?;
    println!(
        "saved to {} (config.json, model.safetensors, tokenizer.json)",
        args.out.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use common::cli::testing::{errors_say_what, help_is_on_stdout};

    #[test]
    fn help_and_bad_values() {
        help_is_on_stdout::<Args>("prune");
        errors_say_what::<Args, _>(
            "prune",
            Ok,
            &[
                ("--layers 0", "invalid value '0' for '--layers <N>'"),
                ("--calibration-seq 1", "at least 2"),
                ("--d-ff many", "invalid value 'many'"),
                ("--device gpu", "invalid value 'gpu' for '--device"),
                ("--frobnicate", "unexpected argument '--frobnicate'"),
            ],
        );
    }
}
