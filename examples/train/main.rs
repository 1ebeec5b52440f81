//! Trains a Llama preset on the CPU (ranks as threads) or on CUDA GPUs, at any tp × dp layout.
//!
//!   cargo run --release --example train -- --preset tiny --tp 2 --sp --steps 20 --seed 7
//!
//! Prints `step N loss X` for every step, a greedy sample now and then, and the throughput at
//! the end. The same seed and preset print the same losses at every layout (within f32
//! rounding), since every layout builds the same model (`InitMode::Full`) and reads the same
//! data in the same order. A loss that is not finite stops the run, naming the step.

mod args;
mod data;
#[cfg(feature = "learner")]
mod learner;
mod sample;

use std::time::Instant;

use burn::tensor::{DType, Device};
use burn_megatron::checkpoint::{self, AsyncSaver};
use burn_megatron::init::{InitMode, ParamInit};
use burn_megatron::models::llama::{ParallelPlan, preset};
use burn_megatron::optim::{DistributedAdamWConfig, Overlap};
use burn_megatron_dist::{ParallelDims, ReduceOp, launch};

use args::{Args, DeviceKind};
use data::Corpus;

fn main() {
    let args = match Args::parse(std::env::args().skip(1)) {
        Ok(args) => args,
        Err(message) => {
            eprintln!("{message}");
            std::process::exit(2);
        }
    };
    if let Err(message) = run(&args) {
        eprintln!("error: {message}");
        std::process::exit(1);
    }
}

fn run(args: &Args) -> Result<(), String> {
    let recipe = preset(&args.preset).map_err(|e| e.to_string())?;
    let seq = args.seq.unwrap_or(recipe.seq_len);
    let batch = args.batch.unwrap_or(recipe.batch_size);
    if !batch.is_multiple_of(args.dp) {
        return Err(format!("--batch {batch} does not split over --dp {}", args.dp));
    }
    let dims = ParallelDims::tp_dp(args.tp, args.dp);
    let plan = ParallelPlan::new(dims, args.sp);
    let config = plan.apply(recipe.model, dims.world_size(), seq).map_err(|e| e.to_string())?;
    let corpus = match &args.data {
        Some(path) => Corpus::from_path(path)?,
        None => Corpus::arithmetic(1 << 20, args.seed),
    };
    let corpus = match &args.tokenizer {
        Some(path) => corpus.tokenized(path)?,
        None => corpus,
    };
    corpus.check_len(seq)?;
    if config.embedding.vocab_size < corpus.vocab_size() {
        return Err(format!(
            "the tokens need a vocabulary of {}; preset {} has {}",
            corpus.vocab_size(),
            args.preset,
            config.embedding.vocab_size
        ));
    }
    let mode = if args.per_shard_init { InitMode::PerShard } else { InitMode::Full };
    let dtype = if args.bf16 { DType::BF16 } else { DType::F32 };
    let init = ParamInit::new(args.seed, mode).with_dtype(dtype);
    let device_of = |local: usize| match args.device {
        DeviceKind::Cpu => Device::flex(),
        DeviceKind::Cuda => cuda(local),
    };
    let per_rank = batch / args.dp;
    if args.learner {
        #[cfg(feature = "learner")]
        return learner::run(args, dims, &config, &corpus, &init, device_of, per_rank, seq);
        #[cfg(not(feature = "learner"))]
        return Err("--learner needs the examples' `learner` feature (on by default)".into());
    }
    let sample_every = args.sample_every.unwrap_or((args.steps / 5).max(1));
    let (prompt, pad) = match &args.data {
        Some(_) => (corpus.head(seq / 2).to_vec(), corpus.encode("\n").first().copied().unwrap_or(0)),
        None => (corpus.encode("\n417+385="), corpus.encode("\n")[0]),
    };
    let results = launch(dims, device_of, |ctx| -> Result<(), String> {
        let device = ctx.device.clone().autodiff();
        let mut model = config.init(&device, &ctx.groups, &init).map_err(|e| e.to_string())?;
        let mut optim = DistributedAdamWConfig::new().with_zero1(args.zero1).init(&ctx.groups);
        let mut done = 0;
        if let Some(dir) = &args.resume {
            let (loaded, step) = checkpoint::load(dir, model, &mut optim, &ctx.groups).map_err(|e| e.to_string())?;
            (model, done) = (loaded, step as usize);
        }
        let mut saver = AsyncSaver::new();
        let mut save = |model: &_, optim: &_, step: usize| match &args.save {
            Some(dir) if args.async_save => saver.save(dir, step as u64, model, optim, &ctx.groups).map_err(|e| e.to_string()),
            Some(dir) => checkpoint::save(dir, step as u64, model, optim, &ctx.groups).map_err(|e| e.to_string()),
            None => Ok(()),
        };
        let dp_rank = ctx.groups.dp.group_rank();
        let start = Instant::now();
        let mut sampling = 0.0;
        for step in done + 1..=args.steps {
            let (ids, targets) = corpus.batch(step, dp_rank * per_rank, per_rank, seq, &device);
            // Gradients reach the dp reduction through taps, bucket by bucket during backward.
            let overlap = Overlap::new(optim.reducer(&model));
            let tapped = overlap.tap(model.clone(), &ctx.groups.dp);
            let loss = tapped.forward_loss(ids, targets).map_err(|e| e.to_string())?;
            let reported = ctx.groups.dp.all_reduce(loss.clone().detach(), ReduceOp::Avg).map_err(|e| e.to_string())?;
            let value = reported.into_scalar::<f64>();
            if !value.is_finite() {
                return Err(format!("step {step}: the loss is {value}; training stops"));
            }
            drop(loss.backward());
            let reduced = overlap.finish(&ctx.device, dtype).map_err(|e| e.to_string())?;
            model = optim.step_reduced(args.lr, model, reduced).map_err(|e| e.to_string())?.0;
            if ctx.global_rank == 0 {
                println!("step {step} loss {value:.6}");
            }
            if sample_every > 0 && (step % sample_every == 0 || step == args.steps) {
                let begun = Instant::now();
                let text = sample::greedy(&model, &ctx.groups, &prompt, pad, 12, seq, &device)?;
                if ctx.global_rank == 0 {
                    println!("sample {:?} -> {:?}", corpus.decode(&prompt), corpus.decode(&text));
                }
                sampling += begun.elapsed().as_secs_f64();
            }
            if args.save_every.is_some_and(|k| step % k == 0 && step < args.steps) {
                save(&model, &optim, step)?;
            }
        }
        let ran = args.steps.saturating_sub(done);
        if ran > 0 && ctx.global_rank == 0 {
            let seconds = start.elapsed().as_secs_f64() - sampling;
            println!("{ran} steps in {seconds:.1} s: {:.0} tokens/s", (ran * batch * seq) as f64 / seconds);
        }
        if ctx.global_rank == 0 {
            // fp32 master weights and both moments: 1/dp of them per rank with ZeRO-1.
            println!("optimizer state on rank 0: {:.2} MiB", optim.state_bytes() as f64 / (1 << 20) as f64);
        }
        save(&model, &optim, args.steps.max(done))?;
        saver.finish(&ctx.groups).map_err(|e| e.to_string())
    })
    .map_err(|e| e.to_string())?;
    results.into_iter().collect()
}

#[cfg(feature = "cuda")]
fn cuda(local_rank: usize) -> Device {
    Device::cuda(local_rank)
}

#[cfg(not(feature = "cuda"))]
fn cuda(_local_rank: usize) -> Device {
    eprintln!("error: --device cuda needs a build with `--features cuda`");
    std::process::exit(2);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(flags: &str) -> Args {
        Args::parse(flags.split_whitespace().map(String::from)).unwrap()
    }

    /// An absurd learning rate overflows the weights: the run stops on the first loss that is
    /// not finite and says which step it was.
    /// The same run through Burn's Learner: it trains and ends without an error.
    #[cfg(feature = "learner")]
    #[test]
    fn the_learner_runs_the_same_job() {
        run(&args("--learner --tp 2 --dp 2 --sp --zero1 --steps 3 --seq 32 --batch 4")).unwrap();
    }

    #[test]
    fn a_loss_that_is_not_finite_stops_training() {
        let error = run(&args("--steps 6 --seq 32 --lr 1e30 --sample-every 0")).unwrap_err();
        assert!(error.contains("step ") && error.contains("the loss is") && error.contains("training stops"), "{error}");
    }
}
