//! Knowledge distillation on real text: a student Llama (a Hugging Face directory, such as
//! `examples/prune`'s output; `--scratch` re-initializes it) trained toward SmolLM2-135M's
//! softened distributions on Shakespeare's plays (all but the held-out last tenth), at any
//! tp × dp, the teacher in inference mode.
//!
//!   distill --student data/pruned --steps 60     (`distill --help`: every flag)
//!
//! Prints each step's line (its loss, `kl`: `T²·KL`, and `data`: the data's cross-entropy) and
//! the student's held-out perplexity before and after, beside the teacher's; `--metrics FILE`
//! writes the steps as JSON lines.
//! `--teacher-hf` takes any checkpoint, `examples/ptq --export`'s compressed FP8 one included;
//! `--teacher-precision fp8` runs the teacher's block linears in FP8 (E4M3, per-tensor current
//! scaling). `--scratch --kl-weight 0 --data-weight 1` trains the same student from scratch on
//! the data alone, for the same tokens: the baseline distillation must beat.

#[path = "../common/mod.rs"]
mod common;

use std::path::PathBuf;

use burn::tensor::{Int, Tensor, TensorData};
use burn_megatron::init::InitMode;
use burn_megatron::models::llama::{LlamaConfig, hf};
use burn_megatron::optim::DistributedAdamWConfig;
use burn_megatron::plan::{ParallelPlan, TensorParallel};
use burn_megatron::posttrain::distill::{self, DistillConfig, Distillation};
use burn_megatron::precision::PrecisionPolicy;
use burn_megatron::train::{Lines, LrSchedule, Routine, Throughput, TokenBatch, Trainer};
use burn_megatron_dist::{ParallelDims, launch};
use burn_megatron_kernels::quant::recipe::Recipe;

use clap::{Parser, ValueEnum};
use common::cli::{ModelFiles, at_least_one, non_negative};
use common::{DEFAULT_MODEL, Shared, Text, mean_loss};

/// Knowledge distillation on real text: a student Llama trained toward a teacher's softened
/// next-token distributions, at any tp × dp, the teacher in inference mode.
#[derive(Parser, Debug)]
#[command(name = "distill", args_override_self = true)]
struct Args {
    /// The student's Hugging Face directory (examples/prune's output).
    #[arg(long, value_name = "DIR", default_value = "data/pruned")]
    student: PathBuf,
    /// Re-initialize the student (the baseline distillation must beat).
    #[arg(long)]
    scratch: bool,
    /// The teacher's GGUF file (SmolLM2-135M-Instruct's by default).
    #[arg(long, value_name = "GGUF", conflicts_with = "teacher_hf")]
    teacher: Option<PathBuf>,
    /// The teacher's Hugging Face directory (examples/ptq --export's FP8 one included).
    #[arg(long, value_name = "DIR")]
    teacher_hf: Option<PathBuf>,
    /// The teacher's block linears in FP8 (E4M3, per-tensor current scaling).
    #[arg(long, value_enum, default_value_t = TeacherPrecision::Default)]
    teacher_precision: TeacherPrecision,
    #[command(flatten)]
    shared: Shared,
    /// Optimizer steps.
    #[arg(long, value_name = "N", default_value_t = 60, value_parser = at_least_one, visible_alias = "train-iters")]
    steps: usize,
    /// Sequences a step over every data-parallel rank.
    #[arg(long, value_name = "N", default_value_t = 8, value_parser = at_least_one, visible_alias = "global-batch-size")]
    batch: usize,
    /// Tokens a sequence (at least 2).
    #[arg(long, value_name = "N", default_value_t = 128, value_parser = common::at_least_two, visible_alias = "seq-length")]
    seq: usize,
    /// The peak learning rate; warm-up, then cosine decay to a tenth of it.
    #[arg(long, value_name = "LR", default_value_t = 3e-4, allow_negative_numbers = true)]
    lr: f64,
    /// Warm-up steps.
    #[arg(long, value_name = "N", default_value_t = 10, visible_alias = "lr-warmup-iters")]
    warmup: usize,
    /// The softmax temperature of both distributions.
    #[arg(long, value_name = "T", default_value_t = 1.0, value_parser = non_negative)]
    temperature: f64,
    /// The weight of `T² · KL(teacher ‖ student)`.
    #[arg(long, value_name = "W", default_value_t = 1.0, value_parser = non_negative)]
    kl_weight: f64,
    /// The weight of the data's cross-entropy.
    #[arg(long, value_name = "W", default_value_t = 0.0, value_parser = non_negative)]
    data_weight: f64,
    /// Tensor-parallel ranks.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = at_least_one, visible_alias = "tensor-model-parallel-size")]
    tp: usize,
    /// Data-parallel ranks.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = at_least_one)]
    dp: usize,
    /// Split master weights and moments over dp (ZeRO-1).
    #[arg(long, visible_alias = "use-distributed-optimizer")]
    zero1: bool,
    #[arg(long, value_name = "N", default_value_t = 1)]
    seed: u64,
    /// The metrics file (JSON lines: a step's loss, its KL and data parts, the rate).
    #[arg(long, value_name = "FILE")]
    metrics: Option<PathBuf>,
}

/// The teacher's linears' precision.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum TeacherPrecision {
    /// The student's dtype.
    Default,
    Fp8,
}

fn parse() -> Result<Args, String> {
    checked(Args::parse())
}

/// The command line's values checked against each other and the student's directory.
fn checked(args: Args) -> Result<Args, String> {
    burn_megatron::optim::check_lr(args.lr).map_err(|e| e.to_string())?;
    if !args.batch.is_multiple_of(args.dp) {
        return Err(format!("--batch {} must be a multiple of --dp {}", args.batch, args.dp));
    }
    if args.temperature <= 0.0 || args.kl_weight + args.data_weight <= 0.0 {
        return Err("--temperature must be above 0, and --kl-weight or --data-weight too".into());
    }
    if !args.student.join("config.json").exists() {
        return Err(format!(
            "{}: no config.json (make a student with `examples/prune --out DIR`)",
            args.student.display()
        ));
    }
    Ok(args)
}

impl Args {
    fn teacher(&self) -> common::Source {
        let files = ModelFiles {
            gguf: self.teacher.clone(),
            hf: self.teacher_hf.clone(),
        };
        files.source(DEFAULT_MODEL)
    }

    fn distill(&self) -> DistillConfig {
        DistillConfig::new()
            .with_temperature(self.temperature)
            .with_kl_weight(self.kl_weight)
            .with_data_weight(self.data_weight)
    }
}

fn main() {
    common::main(parse, run)
}

/// The global batch of step `step`: `batch` windows of `seq + 1` tokens at starts drawn from
/// `seed` (the same on every rank), `[batch, seq + 1]`.
fn batch_ids(tokens: &[u32], batch: usize, seq: usize, step: usize, seed: u64) -> Vec<i64> {
    let mut state = seed ^ (step as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let span = (tokens.len() - seq - 1) as u64;
    (0..batch)
        .flat_map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let start = ((state >> 33) % span) as usize;
            tokens[start..start + seq + 1].iter().map(|&t| t as i64)
        })
        .collect()
}

fn run(args: &Args) -> Result<(), String> {
    let (teacher_config, tokenizer) = common::open(&args.teacher())?;
    let student_config = hf::config(&args.student).map_err(|e| e.to_string())?;
    let text = Text::read(&args.shared.data, &tokenizer)?;
    if text.train.len() <= args.seq + 1 {
        return Err(format!(
            "{}: fewer than {} training tokens",
            args.shared.data.display(),
            args.seq + 2
        ));
    }
    let dims = ParallelDims::tp_dp(args.tp, args.dp);
    let policy = match args.shared.device.cuda() {
        true => PrecisionPolicy::bf16(),
        false => PrecisionPolicy::f32(),
    };
    let teacher_policy = match args.teacher_precision {
        TeacherPrecision::Fp8 => policy.with_gemm(burn_megatron_kernels::Gemm::Quantized(Recipe::Fp8TensorwiseE4m3)),
        TeacherPrecision::Default => policy,
    };
    let plan = |config: LlamaConfig, policy: PrecisionPolicy| -> Result<LlamaConfig, String> {
        let planned = ParallelPlan::new(dims)
            .with_tensor(TensorParallel::Plain)
            .apply(config, dims.world_size(), args.seq.max(args.shared.eval_seq))
            .map_err(|e| e.to_string())?;
        Ok(policy.apply(planned))
    };
    let (teacher_config, student_config) = (plan(teacher_config, teacher_policy)?, plan(student_config, policy)?);
    let vocab = student_config.embedding.vocab_size;
    if teacher_config.embedding.vocab_size != vocab {
        return Err(format!(
            "the teacher's vocabulary ({}) is not the student's ({vocab})",
            teacher_config.embedding.vocab_size
        ));
    }
    let schedule = LrSchedule::WarmupCosine {
        warmup: args.warmup,
        min_lr: args.lr / 10.0,
    };
    schedule.scheduler(args.lr, args.steps).map_err(|e| e.to_string())?;
    let optim = DistributedAdamWConfig::new()
        .with_zero1(args.zero1)
        .with_max_grad_norm(Some(1.0));
    let throughput = Throughput {
        tokens_per_step: args.batch * args.seq,
        flops_per_token: student_config.flops_per_token(args.seq),
        devices: dims.world_size(),
        peak_flops: None,
    };
    let results = launch(
        dims,
        common::device_of(args.shared.device.cuda()),
        |ctx| -> Result<(), String> {
            let device = ctx.device.clone().autodiff();
            let seed_init = policy.init(args.seed, InitMode::PerShard);
            let teacher = teacher_config
                .init(&device, &ctx.groups, &teacher_policy.init(2, InitMode::PerShard))
                .map_err(|e| e.to_string())?;
            let teacher = distill::teacher(common::load(&args.teacher(), teacher, &ctx.groups)?);
            let student = student_config
                .init(&device, &ctx.groups, &seed_init)
                .map_err(|e| e.to_string())?;
            let student = match args.scratch {
                true => student,
                false => hf::load(&args.student, student, &ctx.groups).map_err(|e| e.to_string())?,
            };
            let perplexity = |model: &burn_megatron::models::llama::Llama| {
                mean_loss(
                    model,
                    &text.held_out,
                    args.shared.eval_windows,
                    args.shared.eval_seq,
                    &device,
                )
                .map(f64::exp)
            };
            let (teacher_ppl, before) = (perplexity(&teacher)?, perplexity(&student)?);
            let pair = Distillation {
                student,
                teacher,
                distiller: args.distill().init(vocab, &ctx.groups),
            };
            let mut trainer = Trainer::new(pair, &optim, &ctx.groups, &ctx.device);
            let mut routine = Routine::new(&ctx.groups, &ctx.device, Box::new(Lines), args.steps, throughput)
                .with_metrics(args.metrics.clone())
                .map_err(|e| e.to_string())?;
            let mut scheduler = schedule.scheduler(args.lr, args.steps).map_err(|e| e.to_string())?;
            let (per_rank, dp_rank) = (args.batch / args.dp, ctx.groups.dp.group_rank());
            routine.start();
            for step in 1..=args.steps {
                let ids = batch_ids(&text.train, args.batch, args.seq, step, args.seed);
                let all = Tensor::<2, Int>::from_data(TensorData::new(ids, [args.batch, args.seq + 1]), &device);
                let mine = all.narrow(0, dp_rank * per_rank, per_rank);
                let batch = TokenBatch::new(mine.clone().narrow(1, 0, args.seq), mine.narrow(1, 1, args.seq));
                let stepped = trainer
                    .step(scheduler.step().base(), batch)
                    .map_err(|e| e.to_string())?;
                routine.after_step(&mut trainer, stepped).map_err(|e| e.to_string())?;
            }
            routine.finish().map_err(|e| e.to_string())?;
            let after = perplexity(&trainer.model().student)?;
            routine.note(&format!(
                "held-out perplexity: teacher {teacher_ppl:.2}, student {before:.2} before, {after:.2} after"
            ));
            Ok(())
        },
    )
    .map_err(|e| e.to_string())?;
    results.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use common::cli::testing::{errors_say_what, help_is_on_stdout};

    #[test]
    fn help_and_bad_values() {
        help_is_on_stdout::<Args>("distill");
        errors_say_what::<Args, _>(
            "distill",
            checked,
            &[
                ("--lr -1", "learning rate -1 must be"),
                ("--lr 0", "learning rate 0 must be"),
                ("--batch 3 --dp 2", "--batch 3 must be a multiple of --dp 2"),
                ("--temperature 0", "--temperature must be above 0"),
                ("--kl-weight 0", "--kl-weight or --data-weight"),
                ("--seq 1", "at least 2"),
                ("--teacher-precision fp4", "invalid value 'fp4'"),
                ("--student /nonexistent", "no config.json"),
                ("--teacher a.gguf --teacher-hf dir", "cannot be used with"),
                ("--frobnicate", "unexpected argument '--frobnicate'"),
            ],
        );
    }
}
