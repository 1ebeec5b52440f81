//! Knowledge distillation on real text: a student Llama (a Hugging Face directory, such as
//! `examples/prune`'s output; `--scratch` re-initializes it) trained toward SmolLM2-135M's
//! softened distributions on Shakespeare's plays (all but the held-out last tenth), at any
//! tp × dp, the teacher in inference mode.
//!
//!   distill --student data/pruned [--scratch] [--teacher GGUF | --teacher-hf DIR]
//!           [--teacher-precision default|fp8] [--data data/shakespeare.txt] [--steps 60]
//!           [--batch 8] [--seq 128] [--lr 3e-4] [--warmup 10] [--temperature 1]
//!           [--kl-weight 1] [--data-weight 0] [--tp 1] [--dp 1] [--zero1] [--seed 1]
//!           [--eval-windows 16] [--eval-seq 256] [--log FILE] [--device cpu|cuda]
//!
//! Prints each step's losses (`T²·KL`, the data's cross-entropy) and the student's held-out
//! perplexity before and after, beside the teacher's; `--log` writes the steps as CSV.
//! `--teacher-hf` takes any checkpoint, `examples/ptq --export`'s compressed FP8 one included;
//! `--teacher-precision fp8` runs the teacher's block linears in FP8 (E4M3, per-tensor current
//! scaling). `--scratch --kl-weight 0 --data-weight 1` trains the same student from scratch on
//! the data alone, for the same tokens: the baseline distillation must beat.

#[path = "../common/mod.rs"]
mod common;

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use burn::optim::GradientsParams;
use burn::tensor::{DType, Int, Tensor, TensorData};
use burn_megatron::init::InitMode;
use burn_megatron::models::llama::{LlamaConfig, hf};
use burn_megatron::optim::DistributedAdamWConfig;
use burn_megatron::plan::{ParallelPlan, TensorParallel};
use burn_megatron::posttrain::distill::{self, DistillConfig};
use burn_megatron::precision::PrecisionPolicy;
use burn_megatron_dist::{ParallelDims, ReduceOp, launch};
use burn_megatron_kernels::quant::recipe::Recipe;

use common::{Shared, Text, mean_loss, real, whole};

struct Args {
    student: PathBuf,
    scratch: bool,
    /// The teacher (`--teacher`, `--teacher-hf`), the text, the evaluation and the device.
    shared: Shared,
    teacher_fp8: bool,
    steps: usize,
    batch: usize,
    seq: usize,
    lr: f64,
    warmup: usize,
    distill: DistillConfig,
    tp: usize,
    dp: usize,
    zero1: bool,
    seed: u64,
    log: Option<PathBuf>,
}

fn parse() -> Result<Args, String> {
    let mut args = Args {
        student: "data/pruned".into(),
        scratch: false,
        shared: Shared::default(),
        teacher_fp8: false,
        steps: 60,
        batch: 8,
        seq: 128,
        lr: 3e-4,
        warmup: 10,
        distill: DistillConfig::new(),
        tp: 1,
        dp: 1,
        zero1: false,
        seed: 1,
        log: None,
    };
    common::each_flag(|flag, value| {
        if args.shared.take(flag, ["--teacher", "--teacher-hf"], value)? {
            return Ok(true);
        }
        match flag {
            "--student" => args.student = value()?.into(),
            "--scratch" => args.scratch = true,
            "--teacher-precision" => {
                args.teacher_fp8 = match value()?.as_str() {
                    "default" => false,
                    "fp8" => true,
                    other => return Err(format!("--teacher-precision {other}: default or fp8")),
                }
            }
            "--steps" => args.steps = whole(flag, value()?)?,
            "--batch" => args.batch = whole(flag, value()?)?,
            "--seq" => args.seq = whole(flag, value()?)?,
            "--lr" => args.lr = real(flag, value()?)?,
            "--warmup" => args.warmup = whole(flag, value()?)?,
            "--temperature" => args.distill.temperature = real(flag, value()?)?,
            "--kl-weight" => args.distill.kl_weight = real(flag, value()?)?,
            "--data-weight" => args.distill.data_weight = real(flag, value()?)?,
            "--tp" => args.tp = whole(flag, value()?)?,
            "--dp" => args.dp = whole(flag, value()?)?,
            "--zero1" => args.zero1 = true,
            "--seed" => args.seed = whole(flag, value()?)? as u64,
            "--log" => args.log = Some(value()?.into()),
            _ => return Ok(false),
        }
        Ok(true)
    })?;
    burn_megatron::optim::check_lr(args.lr).map_err(|e| e.to_string())?;
    args.shared.check()?;
    if args.tp == 0 || args.dp == 0 || args.steps == 0 || args.seq < 2 {
        return Err("--tp, --dp and --steps must be at least 1, --seq at least 2".into());
    }
    if args.batch == 0 || !args.batch.is_multiple_of(args.dp) {
        return Err(format!(
            "--batch {} must be a positive multiple of --dp {}",
            args.batch, args.dp
        ));
    }
    if args.distill.temperature <= 0.0 || args.distill.kl_weight + args.distill.data_weight <= 0.0 {
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
    let (teacher_config, tokenizer) = common::open(&args.shared.source)?;
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
    let policy = match args.shared.cuda {
        true => PrecisionPolicy::bf16(),
        false => PrecisionPolicy::f32(),
    };
    let teacher_policy = match args.teacher_fp8 {
        true => policy.with_gemm(burn_megatron_kernels::Gemm::Quantized(Recipe::Fp8TensorwiseE4m3)),
        false => policy,
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
    // Each step's line is written as it comes, so a run cut short keeps its steps.
    let log = match &args.log {
        Some(path) => {
            let mut file = std::fs::File::create(path).map_err(|e| format!("{}: {e}", path.display()))?;
            writeln!(file, "step,total,kl,data").map_err(|e| e.to_string())?;
            Some(std::sync::Mutex::new(file))
        }
        None => None,
    };
    let results = launch(dims, common::device_of(args.shared.cuda), |ctx| -> Result<(), String> {
        let device = ctx.device.clone().autodiff();
        let first = ctx.global_rank == 0;
        let seed_init = policy.init(args.seed, InitMode::PerShard);
        let teacher = teacher_config
            .init(&device, &ctx.groups, &teacher_policy.init(2, InitMode::PerShard))
            .map_err(|e| e.to_string())?;
        let teacher = distill::teacher(common::load(&args.shared.source, teacher, &ctx.groups)?);
        let student = student_config
            .init(&device, &ctx.groups, &seed_init)
            .map_err(|e| e.to_string())?;
        let mut student = match args.scratch {
            true => student,
            false => hf::load(&args.student, student, &ctx.groups).map_err(|e| e.to_string())?,
        };
        let perplexity = |model: &burn_megatron::models::llama::Llama| {
            mean_loss(model, &text.held_out, args.shared.eval_windows, args.shared.eval_seq, &device).map(f64::exp)
        };
        let (teacher_ppl, before) = (perplexity(&teacher)?, perplexity(&student)?);
        let distiller = args.distill.init(vocab, &ctx.groups);
        let mut optim = DistributedAdamWConfig::new()
            .with_zero1(args.zero1)
            .with_max_grad_norm(Some(1.0))
            .init(&ctx.groups)
            .keeping_amaxes(student.amax_notes());
        let (per_rank, dp_rank) = (args.batch / args.dp, ctx.groups.dp.group_rank());
        let begun = Instant::now();
        for step in 1..=args.steps {
            let ids = batch_ids(&text.train, args.batch, args.seq, step, args.seed);
            let all = Tensor::<2, Int>::from_data(TensorData::new(ids, [args.batch, args.seq + 1]), &device);
            let mine = all.narrow(0, dp_rank * per_rank, per_rank);
            let (inputs, targets) = (mine.clone().narrow(1, 0, args.seq), mine.narrow(1, 1, args.seq));
            let loss = distiller
                .loss(&student, &teacher, inputs, targets)
                .map_err(|e| e.to_string())?;
            let grads = GradientsParams::from_grads(loss.total.backward(), &student);
            // Linear warm-up, then cosine decay to a tenth.
            let decay_steps = args.steps.saturating_sub(args.warmup).max(1);
            let progress = (step.saturating_sub(args.warmup) as f64 / decay_steps as f64).min(1.0);
            let lr = match step <= args.warmup {
                true => args.lr * step as f64 / args.warmup.max(1) as f64,
                false => args.lr * (0.1 + 0.45 * (1.0 + (std::f64::consts::PI * progress).cos())),
            };
            student = optim.step(lr, student, grads).map_err(|e| e.to_string())?.0;
            // The losses averaged over the data-parallel ranks (each normalized for it).
            let mean = |x: Tensor<1>| -> Result<f64, String> {
                let x = x.cast(DType::F32);
                let summed = ctx.groups.dp.all_reduce(x, ReduceOp::Sum).map_err(|e| e.to_string())?;
                Ok(summed.into_scalar::<f64>() / args.dp as f64)
            };
            let (total, kl, data) = (mean(loss.total.detach())?, mean(loss.kl)?, mean(loss.data)?);
            if !total.is_finite() {
                return Err(format!("step {step}: the loss is {total}"));
            }
            if first {
                println!("step {step} loss {total:.6} kl {kl:.6} data {data:.6}");
                if let Some(file) = &log {
                    let mut file = file.lock().expect("not poisoned");
                    writeln!(file, "{step},{total},{kl},{data}").map_err(|e| e.to_string())?;
                }
            }
        }
        let elapsed = begun.elapsed().as_secs_f64();
        let after = perplexity(&student)?;
        if first {
            let tokens = args.steps * args.batch * args.seq;
            println!(
                "{} steps of {} tokens in {elapsed:.1} s ({:.0} tokens/s); held-out perplexity: teacher {teacher_ppl:.2}, student {before:.2} before, {after:.2} after",
                args.steps,
                args.batch * args.seq,
                tokens as f64 / elapsed
            );
        }
        Ok(())
    })
    .map_err(|e| e.to_string())?;
    results.into_iter().collect()
}
