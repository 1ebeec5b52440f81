//! `train`'s command line: a job file (`--config`), its fields as flags (Megatron's names as
//! aliases), and any field by its dotted path (`--optimizer.lr 3e-4`). Each becomes an
//! [`Override`] of the job, applied in the order given after the file.

use std::ffi::OsString;
use std::path::PathBuf;

use burn_megatron::job::{JobConfig, JobError, Override};
use clap::{Parser, ValueEnum};
use toml::Value;

use crate::common::cli::{DeviceArg, DtypeArg, Layout, at_least_one, non_negative};

const AFTER_HELP: &str = "\
Any field of the job is also a flag by its dotted path: --optimizer.lr 3e-4, --schedule.kind warmup-cosine,
--checkpoint.keep_last 3 (`--SECTION.FIELD VALUE` or `--SECTION.FIELD=VALUE`). The job's sections:
model, parallel, precision, optimizer, schedule, data, batch, checkpoint, eval, logging; examples/jobs/
holds one file a preset and docs/training.md lists every field. The command line wins over the file.";

/// Trains a Llama (a preset of this crate, or a Hugging Face or GGUF model) on the CPU with its
/// ranks as threads, or on CUDA GPUs, at any tp × cp × dp layout with ep and pp, through Burn's
/// Learner (the default) or a plain loop that prints a line a step.
#[derive(Parser, Debug, Default)]
#[command(name = "train", after_help = AFTER_HELP, args_override_self = true)]
pub struct Args {
    /// The job file (TOML); the defaults, the tiny preset, when not given.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// tiny, tiny-moe, llama-1b, llama-1b-32k, moe-4b, llama-8b, smollm2-135m, qwen3-1.7b, qwen3-moe-2b or dsv3-2b.
    #[arg(long, value_name = "NAME")]
    pub preset: Option<String>,
    /// Fine-tune a Hugging Face model from its directory.
    #[arg(long, value_name = "DIR", conflicts_with = "gguf")]
    pub hf: Option<PathBuf>,
    /// Fine-tune a GGUF model.
    #[arg(long, value_name = "FILE")]
    pub gguf: Option<PathBuf>,
    /// Blocks, instead of the model's.
    #[arg(long, value_name = "N", visible_alias = "num-layers", value_parser = at_least_one)]
    pub layers: Option<usize>,
    /// Tie the output layer to the embedding.
    #[arg(long, visible_alias = "tie-embeddings")]
    pub tied: bool,
    /// What the blocks run again in backward: none, selective, full:N or full-block:N.
    #[arg(long, value_name = "SPEC")]
    pub recompute: Option<String>,
    /// full: every parameter generated whole and sliced (the same model at every layout);
    /// per-shard: each rank only its slice.
    #[arg(long, value_enum)]
    pub init: Option<InitArg>,
    #[command(flatten)]
    pub layout: Layout,
    #[arg(long, value_enum)]
    pub device: Option<DeviceArg>,
    /// Parameters' and activations' dtype (fp32 master weights either way).
    #[arg(long, value_enum)]
    pub dtype: Option<DtypeArg>,
    /// The blocks' linear layers in a low-precision recipe: fp8-tensorwise,
    /// fp8-tensorwise-promoted, fp8-tensorwise-e4m3, fp8-tensorwise-e4m3-promoted,
    /// fp8-delayed[:LEN[:max|most-recent]], fp8-blockwise, mxfp8, nvfp4, or default (none).
    #[arg(long, value_name = "RECIPE")]
    pub precision: Option<String>,
    /// The first and last blocks that keep the compute dtype's product under --precision.
    #[arg(long, value_name = "FIRST,LAST", value_parser = blocks)]
    pub bf16_blocks: Option<[usize; 2]>,
    /// Optimizer steps.
    #[arg(long, value_name = "N", visible_alias = "train-iters", value_parser = at_least_one)]
    pub steps: Option<usize>,
    #[arg(long, value_name = "N")]
    pub seed: Option<u64>,
    /// The peak learning rate.
    #[arg(allow_negative_numbers = true, long, value_name = "LR")]
    pub lr: Option<f64>,
    /// The schedule: constant, warmup-cosine or warmup-stable-decay.
    #[arg(long, value_enum, visible_alias = "lr-decay-style")]
    pub schedule: Option<ScheduleArg>,
    /// Warm-up steps.
    #[arg(long, value_name = "N", visible_alias = "lr-warmup-iters")]
    pub warmup: Option<usize>,
    /// warmup-stable-decay's decay steps.
    #[arg(long, value_name = "N", visible_alias = "lr-wsd-decay-iters")]
    pub decay: Option<usize>,
    /// The rate the schedule decays to.
    #[arg(allow_negative_numbers = true, long, value_name = "LR", value_parser = non_negative)]
    pub min_lr: Option<f64>,
    #[arg(allow_negative_numbers = true, long, value_name = "X", value_parser = non_negative)]
    pub weight_decay: Option<f64>,
    /// Clip gradients to this global norm.
    #[arg(allow_negative_numbers = true, long, value_name = "NORM")]
    pub clip_grad: Option<f64>,
    /// Split master weights and moments over dp (ZeRO-1).
    #[arg(long, visible_alias = "use-distributed-optimizer")]
    pub zero1: bool,
    /// Sequences a step over every data-parallel rank.
    #[arg(long, value_name = "N", visible_alias = "global-batch-size")]
    pub batch: Option<usize>,
    /// Sequences a microbatch on one data-parallel rank (gradient accumulation, or a
    /// pipeline's microbatches).
    #[arg(long, value_name = "N", visible_alias = "micro-batch-size", value_parser = at_least_one)]
    pub micro_batch: Option<usize>,
    /// Tokens a sequence.
    #[arg(long, value_name = "N", visible_alias = "seq-length")]
    pub seq: Option<usize>,
    /// A text file or a directory of them (byte-level tokens unless --tokenizer).
    #[arg(long, value_name = "PATH")]
    pub data: Option<PathBuf>,
    /// A Hugging Face tokenizer.json for the text.
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,
    /// The share of the text held out for evaluation.
    #[arg(allow_negative_numbers = true, long, value_name = "SHARE", value_parser = non_negative)]
    pub held_out: Option<f64>,
    /// Evaluate every K steps (and at the end).
    #[arg(long, value_name = "K", visible_alias = "eval-every")]
    pub eval_interval: Option<usize>,
    /// Global batches an evaluation reads.
    #[arg(long, value_name = "N", visible_alias = "eval-batches")]
    pub eval_iters: Option<usize>,
    /// Save checkpoints here (at the end, and every --save-interval steps).
    #[arg(long, value_name = "DIR")]
    pub save: Option<PathBuf>,
    #[arg(long, value_name = "K", visible_alias = "save-every")]
    pub save_interval: Option<usize>,
    /// Keep the newest N checkpoints.
    #[arg(long, value_name = "N")]
    pub keep_last: Option<usize>,
    /// Write checkpoints on a thread of their own.
    #[arg(long)]
    pub async_save: bool,
    /// Continue from the latest checkpoint here.
    #[arg(long, value_name = "DIR", visible_alias = "resume")]
    pub load: Option<PathBuf>,
    /// The metrics file (JSON lines); DIR/metrics.jsonl with --save DIR.
    #[arg(long, value_name = "FILE")]
    pub metrics: Option<PathBuf>,
    /// A greedy sample every K steps (0: never).
    #[arg(long, value_name = "K")]
    pub sample_every: Option<usize>,
    /// A line a step through a plain loop instead of Burn's Learner.
    #[arg(long, conflicts_with = "learner")]
    pub plain: bool,
    /// Burn's Learner (the default where it is built).
    #[arg(long)]
    pub learner: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum InitArg {
    Full,
    PerShard,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ScheduleArg {
    Constant,
    WarmupCosine,
    WarmupStableDecay,
}

/// `FIRST,LAST`.
fn blocks(text: &str) -> Result<[usize; 2], String> {
    let (first, last) = text.split_once(',').ok_or("expected FIRST,LAST")?;
    let number = |t: &str| {
        t.trim()
            .parse::<usize>()
            .map_err(|_| format!("{t:?} is not a whole number"))
    };
    Ok([number(first)?, number(last)?])
}

/// The command line split: `--SECTION.FIELD VALUE` pairs (as overrides), and the rest for
/// clap. A dotted flag without a value is an error naming it.
pub fn split(args: impl IntoIterator<Item = OsString>) -> Result<(Vec<OsString>, Vec<Override>), String> {
    let mut rest = Vec::new();
    let mut dotted = Vec::new();
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        let text = arg.to_string_lossy().into_owned();
        let Some(key) = text
            .strip_prefix("--")
            .filter(|k| k.split('=').next().is_some_and(|k| k.contains('.')))
        else {
            rest.push(arg);
            continue;
        };
        let (key, value) = match key.split_once('=') {
            Some((key, value)) => (key.to_string(), value.to_string()),
            None => {
                let value = args.next().ok_or_else(|| format!("--{key} needs a value"))?;
                (key.to_string(), value.to_string_lossy().into_owned())
            }
        };
        dotted.push(Override::parse(&key, &value));
    }
    Ok((rest, dotted))
}

impl Args {
    /// The flags given, as overrides of the job's fields.
    pub fn overrides(&self) -> Vec<Override> {
        let mut o = Vec::new();
        let mut put = |key: &str, value: Option<Value>| {
            if let Some(value) = value {
                o.push(Override::new(key, value));
            }
        };
        let text = |s: &Option<String>| s.clone().map(Value::String);
        let int = |n: Option<usize>| n.map(|n| Value::Integer(n as i64));
        let float = |x: Option<f64>| x.map(Value::Float);
        let path = |p: &Option<PathBuf>| p.as_ref().map(|p| Value::String(p.display().to_string()));
        let on = |flag: bool| flag.then_some(Value::Boolean(true));
        let named = |v: Option<String>| v.map(Value::String);
        put("model.preset", text(&self.preset));
        put("model.hf", path(&self.hf));
        put("model.gguf", path(&self.gguf));
        put("model.layers", int(self.layers));
        put("model.tied", on(self.tied));
        put("model.recompute", text(&self.recompute));
        put("model.init", named(self.init.map(|i| value_name(&i))));
        let l = &self.layout;
        put("parallel.tp", int(l.tp));
        put("parallel.dp", int(l.dp));
        put("parallel.cp", int(l.cp));
        put("parallel.ep", int(l.ep));
        put("parallel.etp", int(l.etp));
        put("parallel.pp", int(l.pp));
        put("parallel.vpp", int(l.vpp));
        put("parallel.sp", on(l.sp));
        put("parallel.context", named(l.context.map(|c| value_name(&c))));
        put("parallel.dispatcher", named(l.dispatcher.map(|d| value_name(&d))));
        put("device", named(self.device.map(|d| value_name(&d))));
        put("precision.dtype", named(self.dtype.map(|d| value_name(&d))));
        put("precision.recipe", text(&self.precision));
        let pair = self
            .bf16_blocks
            .map(|[a, b]| Value::Array(vec![Value::Integer(a as i64), Value::Integer(b as i64)]));
        put("precision.bf16_blocks", pair);
        put("steps", int(self.steps));
        put("seed", self.seed.map(|s| Value::Integer(s as i64)));
        put("optimizer.lr", float(self.lr));
        put("optimizer.weight_decay", float(self.weight_decay));
        put("optimizer.clip_grad", float(self.clip_grad));
        put("optimizer.zero1", on(self.zero1));
        put("schedule.kind", named(self.schedule.map(|s| value_name(&s))));
        put("schedule.warmup", int(self.warmup));
        put("schedule.decay", int(self.decay));
        put("schedule.min_lr", float(self.min_lr));
        put("batch.global", int(self.batch));
        put("batch.micro", int(self.micro_batch));
        put("data.seq", int(self.seq));
        put("data.path", path(&self.data));
        put("data.tokenizer", path(&self.tokenizer));
        put("data.held_out", float(self.held_out));
        put("eval.interval", int(self.eval_interval));
        put("eval.batches", int(self.eval_iters));
        put("checkpoint.dir", path(&self.save));
        put("checkpoint.interval", int(self.save_interval));
        put("checkpoint.keep_last", int(self.keep_last));
        put("checkpoint.async", on(self.async_save));
        put("checkpoint.load", path(&self.load));
        put("logging.metrics", path(&self.metrics));
        put("logging.sample_every", int(self.sample_every));
        let driver = match (self.plain, self.learner) {
            (true, _) => Some("plain"),
            (_, true) => Some("learner"),
            _ => None,
        };
        put("logging.driver", driver.map(|d| Value::String(d.into())));
        o
    }

    /// The job these flags name: the file, then the dotted overrides, then the flags.
    pub fn job(&self, dotted: &[Override]) -> Result<JobConfig, JobError> {
        let mut overrides = dotted.to_vec();
        overrides.extend(self.overrides());
        JobConfig::parse(self.config.as_deref(), &overrides)
    }
}

/// A value enum's name on the command line, which the job's field takes too.
fn value_name<E: ValueEnum>(value: &E) -> String {
    value
        .to_possible_value()
        .expect("no variant is skipped")
        .get_name()
        .to_string()
}
