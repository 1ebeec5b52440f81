//! Command-line flags of the training example.

use std::str::FromStr;

use burn_megatron::plan::{ContextParallel, ExpertParallel};
use burn_megatron::recompute::Recompute;
use burn_megatron_kernels::quant::recipe::Recipe;

/// Where the ranks run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    Cpu,
    Cuda,
}

#[derive(Clone, Debug)]
pub struct Args {
    pub preset: String,
    pub tp: usize,
    pub dp: usize,
    /// Context parallelism: each sequence split over `cp` ranks in load-balanced chunks.
    pub cp: usize,
    /// How attention sees the whole sequence under context parallelism.
    pub context: ContextParallel,
    /// Expert parallelism, folded over dp (a MoE preset's experts split over `ep` ranks).
    pub ep: usize,
    /// Expert tensor parallelism: the tp ranks splitting each expert (`None`: all of tp).
    pub etp: Option<usize>,
    /// How token copies reach other ep ranks' experts.
    pub dispatcher: ExpertParallel,
    /// Pipeline stages, model chunks a stage (interleaved 1F1B above 1), microbatches a step.
    pub pp: usize,
    pub vpp: usize,
    pub microbatches: Option<usize>,
    /// Blocks, instead of the preset's.
    pub layers: Option<usize>,
    /// The output layer tied to the embedding (as SmolLM2's and Llama 3.2's), instead of the
    /// preset's choice.
    pub tied: bool,
    pub sp: bool,
    pub steps: usize,
    pub seed: u64,
    pub lr: f64,
    /// Sequences per global batch; the preset's when not given.
    pub batch: Option<usize>,
    /// Tokens per sequence; the preset's when not given.
    pub seq: Option<usize>,
    pub device: DeviceKind,
    /// Generate every parameter whole and keep the rank's slice (the same model at every
    /// layout), or only the slice.
    pub per_shard_init: bool,
    /// Split the optimizer state over the data-parallel group (ZeRO-1).
    pub zero1: bool,
    /// Write a checkpoint here at the end (and every `save_every` steps).
    pub save: Option<std::path::PathBuf>,
    pub save_every: Option<usize>,
    /// Continue from the latest checkpoint here, up to `steps`.
    pub resume: Option<std::path::PathBuf>,
    /// Train on this text file or directory of text (byte-level tokens) instead of the
    /// generated arithmetic corpus.
    pub data: Option<std::path::PathBuf>,
    /// Tokenize the text with this Hugging Face `tokenizer.json` instead of by bytes.
    pub tokenizer: Option<std::path::PathBuf>,
    /// Parameters and activations in bf16 (the optimizer keeps fp32 master weights).
    pub bf16: bool,
    /// The blocks' linear layers in a low-precision recipe (`--precision fp8-tensorwise`, …).
    pub quantized: Option<Recipe>,
    /// The first and last blocks that keep the compute dtype's product under `quantized`
    /// (`--bf16-blocks FIRST,LAST`); the recipe's own choice when absent.
    pub kept_blocks: Option<(usize, usize)>,
    /// Write checkpoints on a thread of their own while training goes on.
    pub async_save: bool,
    /// Print a greedy sample every this many steps (0: never); a fifth of the run by default.
    pub sample_every: Option<usize>,
    /// Run through Burn's `SupervisedTraining` with `MegatronStrategy` (Burn's progress and
    /// metrics) instead of the plain loop.
    pub learner: bool,
    /// What the blocks run again in backward instead of keeping.
    pub recompute: Recompute,
}

const USAGE: &str = "usage: train [--preset tiny|tiny-moe|llama-1b|moe-4b|llama-8b] [--tp N] [--dp N] [--cp N] \
[--context ring|all-to-all|all-gather] [--ep N] [--etp N] \
[--dispatcher all-to-all|all-gather] [--pp N] [--vpp V] [--microbatches M] [--layers N] [--tied] [--sp] [--steps N] \
[--seed N] [--lr X] [--batch N] [--seq N] [--device cpu|cuda] [--init full|per-shard] [--zero1] [--save DIR] [--save-every K] [--async-save] [--resume DIR] [--data PATH] [--tokenizer tokenizer.json] \
[--dtype f32|bf16] [--precision default|fp8-tensorwise|fp8-tensorwise-promoted|fp8-tensorwise-e4m3|fp8-tensorwise-e4m3-promoted|fp8-delayed[:LEN[:max|most-recent]]|fp8-blockwise|mxfp8|nvfp4] \
[--bf16-blocks FIRST,LAST] [--sample-every K] [--learner] \
[--recompute none|selective|full:N|full-block:N]";

impl Args {
    pub fn parse(args: impl IntoIterator<Item = String>) -> Result<Self, String> {
        let mut out = Args {
            preset: "tiny".into(),
            tp: 1,
            dp: 1,
            cp: 1,
            context: ContextParallel::Ring,
            ep: 1,
            etp: None,
            dispatcher: ExpertParallel::AllToAll,
            pp: 1,
            vpp: 1,
            microbatches: None,
            layers: None,
            tied: false,
            sp: false,
            steps: 200,
            seed: 7,
            lr: 3e-3,
            batch: None,
            seq: None,
            device: DeviceKind::Cpu,
            per_shard_init: false,
            zero1: false,
            save: None,
            save_every: None,
            resume: None,
            data: None,
            tokenizer: None,
            bf16: false,
            quantized: None,
            kept_blocks: None,
            async_save: false,
            recompute: Recompute::None,
            sample_every: None,
            learner: false,
        };
        let mut args = args.into_iter();
        while let Some(flag) = args.next() {
            let mut value = || args.next().ok_or_else(|| format!("{flag} needs a value\n{USAGE}"));
            match flag.as_str() {
                "--preset" => out.preset = value()?,
                "--tp" => out.tp = number(&flag, &value()?)?,
                "--dp" => out.dp = number(&flag, &value()?)?,
                "--cp" => out.cp = number(&flag, &value()?)?,
                "--context" => out.context = value()?.parse().map_err(|e| format!("--context: {e}"))?,
                "--ep" => out.ep = number(&flag, &value()?)?,
                "--etp" => out.etp = Some(number(&flag, &value()?)?),
                "--pp" => out.pp = number(&flag, &value()?)?,
                "--vpp" => out.vpp = number(&flag, &value()?)?,
                "--microbatches" => out.microbatches = Some(number(&flag, &value()?)?),
                "--layers" => out.layers = Some(number(&flag, &value()?)?),
                "--dispatcher" => {
                    out.dispatcher = match value()?.as_str() {
                        "all-to-all" => ExpertParallel::AllToAll,
                        "all-gather" => ExpertParallel::AllGather,
                        other => return Err(format!("--dispatcher {other}: expected all-to-all or all-gather")),
                    }
                }
                "--sp" => out.sp = true,
                "--tied" => out.tied = true,
                "--zero1" => out.zero1 = true,
                "--save" => out.save = Some(value()?.into()),
                "--save-every" => out.save_every = Some(number(&flag, &value()?)?),
                "--resume" => out.resume = Some(value()?.into()),
                "--data" => out.data = Some(value()?.into()),
                "--tokenizer" => out.tokenizer = Some(value()?.into()),
                "--async-save" => out.async_save = true,
                "--learner" => out.learner = true,
                "--sample-every" => out.sample_every = Some(number(&flag, &value()?)?),
                "--dtype" => {
                    out.bf16 = match value()?.as_str() {
                        "f32" => false,
                        "bf16" => true,
                        other => return Err(format!("--dtype {other}: expected f32 or bf16")),
                    }
                }
                "--precision" => {
                    out.quantized = match value()?.as_str() {
                        "default" => None,
                        recipe => Some(recipe.parse().map_err(|e| format!("--precision: {e} or default"))?),
                    }
                }
                "--bf16-blocks" => {
                    let text = value()?;
                    let (first, last) = text
                        .split_once(',')
                        .ok_or_else(|| format!("--bf16-blocks {text}: expected FIRST,LAST"))?;
                    out.kept_blocks = Some((number(&flag, first)?, number(&flag, last)?));
                }
                "--recompute" => out.recompute = value()?.parse().map_err(|e| format!("--recompute {e}"))?,
                "--steps" => out.steps = number(&flag, &value()?)?,
                "--seed" => out.seed = number(&flag, &value()?)?,
                "--lr" => out.lr = number(&flag, &value()?)?,
                "--batch" => out.batch = Some(number(&flag, &value()?)?),
                "--seq" => out.seq = Some(number(&flag, &value()?)?),
                "--device" => {
                    out.device = match value()?.as_str() {
                        "cpu" => DeviceKind::Cpu,
                        "cuda" => DeviceKind::Cuda,
                        other => return Err(format!("--device {other}: expected cpu or cuda")),
                    }
                }
                "--init" => {
                    out.per_shard_init = match value()?.as_str() {
                        "full" => false,
                        "per-shard" => true,
                        other => return Err(format!("--init {other}: expected full or per-shard")),
                    }
                }
                "--help" | "-h" => return Err(USAGE.into()),
                other => return Err(format!("unknown flag {other}\n{USAGE}")),
            }
        }
        if out.tp == 0 || out.dp == 0 || out.cp == 0 || out.ep == 0 || out.etp == Some(0) || out.pp == 0 || out.vpp == 0
        {
            return Err("--tp, --dp, --cp, --ep, --etp, --pp and --vpp must be at least 1".into());
        }
        if out.cp > 1 && out.sample_every.is_some_and(|k| k > 0) {
            return Err(
                "--cp splits every sequence over ranks: greedy samples of a whole prompt need --sample-every 0".into(),
            );
        }
        if out.layers == Some(0) {
            return Err("--layers must be at least 1".into());
        }
        if out.steps == 0 {
            return Err("--steps must be at least 1".into());
        }
        if out.kept_blocks.is_some() && out.quantized.is_none() {
            return Err("--bf16-blocks names the blocks a --precision recipe leaves in bf16: it needs one".into());
        }
        if out.save_every.is_some() && out.save.is_none() {
            return Err("--save-every needs --save DIR".into());
        }
        if out.learner && (out.save.is_some() || out.resume.is_some()) {
            return Err("--learner keeps Burn's checkpoints in its artifact directory; --save and --resume are the plain loop's".into());
        }
        if out.async_save && out.save.is_none() {
            return Err("--async-save needs --save DIR".into());
        }
        if out.save_every == Some(0) {
            return Err("--save-every must be at least 1".into());
        }
        Ok(out)
    }
}

fn number<T: FromStr>(flag: &str, value: &str) -> Result<T, String> {
    value.parse().map_err(|_| format!("{flag} {value}: not a number"))
}
