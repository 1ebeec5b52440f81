//! Trains a Llama preset on the CPU (ranks as threads) or on CUDA GPUs, at any tp × cp × dp
//! layout (with ep, or pp stages).
//!
//!   cargo run --release --example train -- --preset tiny --tp 2 --sp --steps 20 --seed 7
//!
//! Prints `step N loss X` for every step (a MoE preset adds its router losses, each expert's
//! copies and the copies dropped, over the whole batch), a greedy sample now and then, and the
//! throughput at the end. The same seed and preset print the same losses at every layout (within f32
//! rounding), since every layout builds the same model (`InitMode::Full`) and reads the same
//! data in the same order. A loss that is not finite stops the run, naming the step.

mod args;
mod data;
#[cfg(feature = "learner")]
mod learner;
mod pipeline;
mod sample;
mod saves;

use std::time::Instant;

use burn::module::Module;
use burn::tensor::Device;
use burn_megatron::ConfigError;
use burn_megatron::checkpoint;
use burn_megatron::init::InitMode;
use burn_megatron::models::llama::{LlamaConfig, preset};
use burn_megatron::optim::{DistributedAdamWConfig, check_lr};
use burn_megatron::plan::{ParallelPlan, TensorParallel};
use burn_megatron::precision::{KeptBlocks, PrecisionPolicy};
use burn_megatron::train::{TokenBatch, Trainer};
use burn_megatron_dist::{ParallelDims, launch};
use burn_megatron_kernels::failures;

use args::{Args, DeviceKind};
use data::Corpus;
use saves::Saves;

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

/// A run's configuration, every number checked before any tensor exists.
struct Job {
    config: LlamaConfig,
    plan: ParallelPlan,
    policy: PrecisionPolicy,
    seq: usize,
    /// Sequences per global batch, and per data-parallel rank.
    batch: usize,
    per_rank: usize,
}

/// The preset with the flags' overrides, planned for the flags' layout and precision.
fn configure(args: &Args) -> Result<Job, ConfigError> {
    let mut recipe = preset(&args.preset)?;
    recipe.seq_len = args.seq.unwrap_or(recipe.seq_len);
    recipe.batch_size = args.batch.unwrap_or(recipe.batch_size);
    recipe.model.n_layers = args.layers.unwrap_or(recipe.model.n_layers);
    recipe.model.recompute = args.recompute;
    if args.tied {
        recipe.model.word_embeddings = burn_megatron::models::llama::WordEmbeddings::Tied;
    }
    let dims = ParallelDims {
        ep: args.ep,
        etp: args.etp,
        cp: args.cp,
        pp: args.pp,
        ..ParallelDims::tp_dp(args.tp, args.dp)
    };
    let tensor = if args.sp {
        TensorParallel::SequenceParallel
    } else {
        TensorParallel::Plain
    };
    let plan = ParallelPlan::new(dims)
        .with_tensor(tensor)
        .with_expert(args.dispatcher)
        .with_context(args.context)
        .with_pipeline(pipeline::schedule(args));
    let policy = match args.bf16 {
        true => PrecisionPolicy::bf16(),
        false => PrecisionPolicy::f32(),
    };
    let policy = match args.quantized {
        Some(recipe) => policy.with_gemm(burn_megatron_kernels::Gemm::Quantized(recipe)),
        None => policy,
    };
    let policy = match args.kept_blocks {
        Some((first, last)) => policy.with_kept_blocks(KeptBlocks::Count { first, last }),
        None => policy,
    };
    let config = policy.apply(plan.apply(recipe.model.clone(), dims.world_size(), recipe.seq_len)?);
    let per_rank = recipe.per_rank_batch(args.dp)?;
    check_lr(args.lr)?;
    if args.pp > 1 {
        pipeline::check(args, per_rank)?;
    }
    Ok(Job {
        config,
        plan,
        policy,
        seq: recipe.seq_len,
        batch: recipe.batch_size,
        per_rank,
    })
}

/// Trains as `args` say; returns the losses printed (rank 0's, or the last stage's).
fn run(args: &Args) -> Result<Vec<f64>, String> {
    let Job {
        config,
        plan,
        policy,
        seq,
        batch,
        per_rank,
    } = configure(args).map_err(|e| e.to_string())?;
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
    let mode = if args.per_shard_init {
        InitMode::PerShard
    } else {
        InitMode::Full
    };
    let init = policy.init(args.seed, mode);
    let device_of = |local: usize| match args.device {
        DeviceKind::Cpu => Device::flex(),
        DeviceKind::Cuda => cuda(local),
    };
    // CubeCL reports a launch it could not run (past the device's memory) only to a logger;
    // the loops below check it after each step's loss. Refused where a logger is installed
    // already (an earlier run in this process: ours), which then keeps CubeCL's lines. Burn's
    // Learner installs its own, which writes them to its application log.
    if !args.learner {
        let _ = failures::watch();
    }
    if args.pp > 1 && !args.learner {
        return pipeline::run(args, &plan, &config, &corpus, &init, device_of, (per_rank, seq, batch));
    }
    if args.learner {
        #[cfg(feature = "learner")]
        return learner::run(args, &plan, &config, &corpus, &init, device_of, per_rank, seq).map(|_| Vec::new());
        #[cfg(not(feature = "learner"))]
        return Err("--learner needs the examples' `learner` feature (on by default)".into());
    }
    // Under context parallelism no rank holds a whole prompt: no samples.
    let sample_every = match args.cp {
        1 => args.sample_every.unwrap_or((args.steps / 5).max(1)),
        _ => 0,
    };
    let (prompt, pad) = match &args.data {
        Some(_) => (
            corpus.head(seq / 2).to_vec(),
            corpus.encode("\n").first().copied().unwrap_or(0),
        ),
        None => (corpus.encode("\n417+385="), corpus.encode("\n")[0]),
    };
    let dims = plan.dims;
    let results = launch(dims, device_of, |ctx| -> Result<Vec<f64>, String> {
        let device = ctx.device.clone().autodiff();
        let model = config.init(&device, &ctx.groups, &init).map_err(|e| e.to_string())?;
        let optim = DistributedAdamWConfig::new().with_zero1(args.zero1);
        let mut trainer = Trainer::new(model, &optim, &ctx.groups, &ctx.device);
        let mut losses = Vec::new();
        let mut done = 0;
        if let Some(dir) = &args.resume {
            let load = |model, optim: &mut _| checkpoint::load(dir, model, optim, &ctx.groups);
            done = trainer.restore(load).map_err(|e| e.to_string())? as usize;
        }
        let mut saves = Saves::new(args);
        let dp_rank = ctx.groups.dp.group_rank();
        let start = Instant::now();
        let mut sampling = 0.0;
        for step in done + 1..=args.steps {
            let (ids, targets) = corpus.batch(step, dp_rank * per_rank, per_rank, seq, &device);
            let values = trainer
                .step(args.lr, TokenBatch { ids, targets })
                .and_then(|stepped| stepped.read(&ctx.groups))
                .map_err(|e| e.to_string())?;
            if ctx.global_rank == 0 {
                println!("{values}");
                losses.push(values.loss);
            }
            if sample_every > 0 && (step % sample_every == 0 || step == args.steps) {
                let begun = Instant::now();
                // The model as inference sees it: no autodiff graph, and no amaxes recorded into
                // delayed FP8 histories.
                let model = trainer.model().valid();
                let text = sample::greedy(&model, &ctx.groups, &prompt, pad, 12, seq, &ctx.device)?;
                if ctx.global_rank == 0 {
                    println!("sample {:?} -> {:?}", corpus.decode(&prompt), corpus.decode(&text));
                }
                sampling += begun.elapsed().as_secs_f64();
            }
            if args.save_every.is_some_and(|k| step % k == 0 && step < args.steps) {
                saves.save(trainer.model(), trainer.optimizer(), step, &ctx.groups)?;
            }
        }
        let ran = args.steps.saturating_sub(done);
        if ran > 0 && ctx.global_rank == 0 {
            let seconds = start.elapsed().as_secs_f64() - sampling;
            println!(
                "{ran} steps in {seconds:.1} s: {:.0} tokens/s",
                (ran * batch * seq) as f64 / seconds
            );
        }
        if ctx.global_rank == 0 {
            // fp32 master weights and both moments: 1/dp of them per rank with ZeRO-1.
            println!(
                "optimizer state on rank 0: {:.2} MiB",
                trainer.optimizer().state_bytes() as f64 / (1 << 20) as f64
            );
        }
        saves.save(trainer.model(), trainer.optimizer(), args.steps.max(done), &ctx.groups)?;
        saves.finish(&ctx.groups)?;
        Ok(losses)
    })
    .map_err(|e| e.to_string())?;
    printed_losses(results)
}

/// The losses of the rank that prints them (the others return none), or the first rank's error.
fn printed_losses(results: Vec<Result<Vec<f64>, String>>) -> Result<Vec<f64>, String> {
    let mut printed = Vec::new();
    for losses in results {
        let losses = losses?;
        if !losses.is_empty() {
            printed = losses;
        }
    }
    Ok(printed)
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

    /// The same run through Burn's Learner: it trains and ends without an error.
    #[cfg(feature = "learner")]
    #[test]
    fn the_learner_runs_the_same_job() {
        for layout in [
            "--tp 2 --dp 2 --sp --zero1",
            "--cp 2 --dp 2 --sample-every 0",
            "--pp 2 --vpp 2 --dp 2 --layers 4 --microbatches 2 --tied",
            "--pp 2 --cp 2 --layers 4 --microbatches 2 --sample-every 0",
            "--precision fp8-delayed --preset tiny-moe --dp 2 --ep 2 --sample-every 0",
        ] {
            run(&args(&format!("--learner {layout} --steps 3 --seq 32 --batch 4"))).unwrap();
        }
    }

    /// Every bad flag or value is an error before any tensor exists, never a panic and never
    /// a silent run: zero, negative, too large, not divisible, not a number, unknown names.
    #[test]
    fn bad_flags_and_values_are_errors_before_training() {
        let table = [
            ("--seq 300", "longer than the model's 256 positions"),
            ("--seq 0", "sequence length must be at least 1"),
            ("--seq -5", "not a number"),
            ("--batch 0", "batch size must be at least 1"),
            ("--batch 3 --dp 2", "does not split evenly over dp = 2"),
            ("--lr -1", "learning rate -1 must be"),
            ("--lr 0", "learning rate 0 must be"),
            ("--lr nan", "learning rate NaN must be"),
            ("--lr inf", "learning rate inf must be"),
            ("--lr fast", "not a number"),
            ("--tp 0", "at least 1"),
            ("--ep 0", "at least 1"),
            ("--etp 0", "at least 1"),
            (
                "--preset tiny-moe --tp 2 --ep 2 --etp 1",
                "etp = 1 below tp = 2 needs sequence parallelism",
            ),
            ("--preset tiny-moe --tp 2 --sp --etp 3", "etp = 3 must divide tp = 2"),
            ("--preset tiny-moe --ep 2", "ep = 2 must divide (tp/etp)·dp·cp = 1"),
            (
                "--preset tiny-moe --ep 3 --dp 3 --batch 3",
                "8 experts do not split evenly over ep = 3",
            ),
            ("--dispatcher ring", "expected all-to-all or all-gather"),
            ("--pp 0", "at least 1"),
            (
                "--pp 3 --microbatches 2",
                "2 blocks do not split into 3 pipeline stages",
            ),
            ("--layers 0", "--layers must be at least 1"),
            (
                "--pp 2 --vpp 2 --layers 4 --microbatches 3 --batch 6",
                "3 microbatches do not form whole rounds of pp = 2",
            ),
            (
                "--pp 2 --microbatches 3",
                "2 sequences a rank do not split into 3 equal microbatches",
            ),
            ("--dp 0", "at least 1"),
            ("--cp 0", "at least 1"),
            ("--cp 2 --seq 30", "does not split into 2·cp = 4 equal chunks"),
            (
                "--cp 8 --context all-to-all --seq 64",
                "4 n_heads on each tp rank do not scatter over cp = 8",
            ),
            ("--cp 2 --sample-every 5", "--sample-every 0"),
            ("--context sideways", "unknown context exchange"),
            ("--tp 3", "n_heads = 4 is not divisible by tp = 3"),
            ("--tp 2 --sp --seq 255", "not divisible by tp = 2"),
            ("--steps 0", "--steps must be at least 1"),
            ("--steps 1.5", "not a number"),
            ("--preset llama-70b", "unknown preset"),
            ("--device tpu", "expected cpu or cuda"),
            ("--dtype f16", "expected f32 or bf16"),
            (
                "--precision fp4",
                "one of fp8-tensorwise, fp8-tensorwise-promoted, fp8-tensorwise-e4m3, fp8-tensorwise-e4m3-promoted, fp8-delayed, fp8-blockwise, mxfp8, nvfp4 or default",
            ),
            ("--precision fp8-delayed:0", "a length of at least 1"),
            ("--bf16-blocks 1,1", "needs one"),
            ("--precision fp8-tensorwise --bf16-blocks 1", "expected FIRST,LAST"),
            ("--precision fp8-tensorwise --bf16-blocks one,1", "not a number"),
            ("--init sparse", "expected full or per-shard"),
            ("--save-every 0 --save /tmp/x", "at least 1"),
            ("--save-every 5", "needs --save"),
            ("--frobnicate", "unknown flag"),
            ("--tp", "needs a value"),
        ];
        for (flags, expected) in table {
            let outcome = std::panic::catch_unwind(|| {
                Args::parse(flags.split_whitespace().map(String::from))
                    .and_then(|a| configure(&a).map(|_| ()).map_err(|e| e.to_string()))
            });
            let error = outcome
                .unwrap_or_else(|_| panic!("{flags}: panicked instead of an error"))
                .expect_err(flags);
            assert!(error.contains(expected), "{flags}: {error:?} does not say {expected:?}");
        }
    }

    /// `--bf16-blocks FIRST,LAST` keeps those blocks on the bf16 product under the recipe (it
    /// overrides the recipe's own choice, NVFP4's last 15%); without it FP8 keeps none.
    #[test]
    fn bf16_blocks_name_the_edges() {
        let edges = |flags: &str| {
            let job = configure(&args(flags)).unwrap();
            job.config.edge_blocks.map(|e| (e.first, e.last, e.gemm))
        };
        let bf16 = Some(burn_megatron_kernels::Gemm::Wgmma);
        assert_eq!(edges("--dtype bf16 --precision fp8-tensorwise"), None);
        assert_eq!(
            edges("--dtype bf16 --precision fp8-tensorwise --bf16-blocks 1,1"),
            bf16.map(|g| (1, 1, g))
        );
        assert_eq!(
            edges("--dtype bf16 --precision nvfp4 --bf16-blocks 0,1"),
            bf16.map(|g| (0, 1, g))
        );
    }

    /// Every low-precision recipe in the blocks' linear layers (emulated on the CPU), FP8
    /// tensorwise data-parallel and the others tensor-parallel with SP (amaxes reduced over tp):
    /// each trains and ends without an error.
    #[test]
    fn trains_with_every_recipe() {
        for recipe in burn_megatron_kernels::quant::recipe::Recipe::ALL {
            let layout = match recipe {
                burn_megatron_kernels::quant::recipe::Recipe::Fp8Tensorwise => "--dp 2",
                _ => "--tp 2 --sp",
            };
            let flags = format!(
                "--precision {} {layout} --steps 2 --seq 32 --batch 4 --sample-every 0",
                recipe.name()
            );
            run(&args(&flags)).unwrap_or_else(|e| panic!("{flags}: {e}"));
        }
    }

    /// The MoE preset trains with its experts over ep = 2 (both dispatchers, ZeRO-1 with one,
    /// tp = 2 with SP beside the other): each ends without an error.
    #[test]
    fn trains_a_mixture_of_experts_over_ep() {
        for flags in [
            "--preset tiny-moe --dp 2 --ep 2 --zero1",
            "--preset tiny-moe --tp 2 --sp --dp 2 --ep 2 --dispatcher all-gather",
            "--preset tiny-moe --tp 2 --sp --ep 2 --etp 1",
        ] {
            let flags = format!("{flags} --steps 2 --seq 32 --batch 4 --sample-every 0");
            run(&args(&flags)).unwrap_or_else(|e| panic!("{flags}: {e}"));
        }
    }

    /// A pipeline of 2 stages (1F1B; beside dp 2, over tp 2 with SP, and tp 2 × pp 2 × dp 2:
    /// world 8), and of 2 stages × 2 chunks (interleaved), over 4 blocks prints pp = 1's losses:
    /// the same data, the same model (`InitMode::Full` names every parameter by its path), the
    /// mean over microbatches the batch's mean. f32 sums in another order, carried 5 AdamW
    /// steps: 1e-4 relative.
    #[test]
    fn a_pipeline_prints_the_losses_of_one_stage() {
        let common = "--layers 4 --steps 5 --seq 32 --batch 4 --sample-every 0";
        let tiny4 = |flags: &str| {
            let mut a = args(&format!("{common} {flags}"));
            a.preset = "tiny".into();
            a
        };
        let reference = run(&tiny4("--microbatches 2")).unwrap();
        assert_eq!(reference.len(), 5);
        for (flags, one_stage) in [
            ("--pp 2", None),
            ("--pp 2 --vpp 2 --microbatches 2", None),
            ("--pp 2 --vpp 2 --microbatches 2 --recompute selective", None),
            ("--pp 2 --recompute full:1", None),
            ("--pp 2 --dp 2 --microbatches 2", Some("--dp 2")),
            ("--pp 2 --tp 2 --sp --microbatches 2", Some("--tp 2 --sp")),
            ("--pp 2 --tp 2 --sp --dp 2 --microbatches 2", Some("--tp 2 --sp --dp 2")),
            ("--pp 2 --tied", Some("--tied --microbatches 2")),
            (
                "--pp 2 --cp 2 --microbatches 2 --sample-every 0",
                Some("--cp 2 --sample-every 0"),
            ),
            (
                "--pp 2 --vpp 2 --cp 2 --tp 2 --sp --microbatches 2",
                Some("--cp 2 --tp 2 --sp"),
            ),
            (
                "--pp 2 --vpp 2 --microbatches 2 --tied --tp 2 --sp",
                Some("--tied --tp 2 --sp"),
            ),
        ] {
            let losses = run(&tiny4(flags)).unwrap_or_else(|e| panic!("{flags}: {e}"));
            let reference = match one_stage {
                Some(layout) => run(&tiny4(layout)).unwrap(),
                None => reference.clone(),
            };
            assert_eq!(losses.len(), 5, "{flags}");
            for (a, b) in losses.iter().zip(&reference) {
                assert!((a - b).abs() <= 1e-4 * b.abs(), "{flags}: {losses:?} vs {reference:?}");
            }
        }
    }

    /// A checkpoint saved by 2 pipeline stages after 3 steps resumes at pp 1 and at pp 4: the
    /// next 2 losses are those of the pp 2 run that went on without stopping (f32 sums in
    /// another order over 2 AdamW steps: 1e-4 relative). With tied embeddings the two stages'
    /// copies are written once, and read by both ends at pp 4.
    #[test]
    fn pipeline_checkpoints_resume_at_other_stage_counts() {
        for tied in ["", "--tied"] {
            let dir = std::env::temp_dir().join(format!("burn-megatron-pp-ckpt{tied}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            let common = format!("--layers 4 --seq 32 --batch 4 --microbatches 2 --sample-every 0 {tied}");
            let reference = run(&args(&format!("{common} --pp 2 --steps 5"))).unwrap();
            // Saved on the saver's thread (--async-save), as the loop without stages does.
            let saved = format!("{common} --pp 2 --steps 3 --save {} --async-save", dir.display());
            run(&args(&saved)).unwrap();
            for pp in [1, 4] {
                let flags = format!("{common} --pp {pp} --steps 5 --resume {}", dir.display());
                let losses = run(&args(&flags)).unwrap_or_else(|e| panic!("{flags}: {e}"));
                assert_eq!(losses.len(), 2, "{flags}");
                for (a, b) in losses.iter().zip(&reference[3..]) {
                    assert!((a - b).abs() <= 1e-4 * b.abs(), "{flags}: {losses:?} vs {reference:?}");
                }
            }
            let _ = std::fs::remove_dir_all(&dir);
        }
    }

    /// Context parallelism prints cp = 1's losses over 20 steps: cp 2 with each exchange, tp 2
    /// × cp 2 with SP, and cp 2 × dp 2 (world 4, against dp 2): the same data and model, each
    /// sequence's chunks over the cp ranks, the loss counting every rank's tokens. f32 sums in
    /// another order carried 20 AdamW steps: 1e-4 relative.
    #[test]
    fn context_parallelism_prints_the_losses_of_one_rank() {
        let common = "--steps 20 --seq 32 --batch 4 --sample-every 0";
        let reference = run(&args(common)).unwrap();
        let data_parallel = run(&args(&format!("{common} --dp 2"))).unwrap();
        for (flags, against) in [
            ("--cp 2", &reference),
            ("--cp 2 --context all-to-all", &reference),
            ("--cp 2 --context all-gather", &reference),
            ("--cp 2 --tp 2 --sp", &reference),
            ("--cp 2 --dp 2 --zero1", &data_parallel),
        ] {
            let losses = run(&args(&format!("{common} {flags}"))).unwrap_or_else(|e| panic!("{flags}: {e}"));
            assert_eq!(losses.len(), 20, "{flags}");
            for (a, b) in losses.iter().zip(against) {
                assert!((a - b).abs() <= 1e-4 * b.abs(), "{flags}: {losses:?} vs {against:?}");
            }
        }
    }

    /// A checkpoint saved at cp 2 after 3 steps resumes at cp 1 with the losses of going on at
    /// cp 2 (f32 sums in another order over 2 AdamW steps: 1e-4 relative).
    #[test]
    fn a_context_parallel_checkpoint_resumes_at_cp_1() {
        let dir = std::env::temp_dir().join(format!("burn-megatron-cp-ckpt-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let common = "--seq 32 --batch 4 --sample-every 0";
        let reference = run(&args(&format!("{common} --cp 2 --steps 5"))).unwrap();
        run(&args(&format!("{common} --cp 2 --steps 3 --save {}", dir.display()))).unwrap();
        let losses = run(&args(&format!("{common} --steps 5 --resume {}", dir.display()))).unwrap();
        assert_eq!(losses.len(), 2);
        for (a, b) in losses.iter().zip(&reference[3..]) {
            assert!((a - b).abs() <= 1e-4 * b.abs(), "{losses:?} vs {reference:?}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// An absurd learning rate overflows the weights: the run stops on the first loss that is
    /// not finite and says which step it was.
    #[test]
    fn a_loss_that_is_not_finite_stops_training() {
        // Every stage of a pipeline stops too (the loss travels from the last one).
        for layout in ["", "--pp 2 --layers 4"] {
            let error = run(&args(&format!(
                "--steps 6 --seq 32 --lr 1e30 --sample-every 0 {layout}"
            )))
            .unwrap_err();
            assert!(
                error.contains("step ") && error.contains("the loss is") && error.contains("training stops"),
                "{layout}: {error}"
            );
        }
    }
}
