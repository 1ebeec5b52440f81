//! Your own Burn model, parallel: a GPT-2-style model written with Burn alone (`plain.rs`), the
//! same model tensor-, sequence- and data-parallel through burn-megatron (`parallel.rs`),
//! trained on generated arithmetic on the CPU with ranks as threads. `docs/own-model.md` walks
//! through it.
//!
//!   cargo run --release --example own-model -- --tp 2 --dp 2 --sp
//!
//! Prints the run, then `step N loss X` a step. Every layout prints the same losses within f32
//! rounding: each rank shards the same plain model and reads the same batches.

mod data;
mod parallel;
mod plain;
#[cfg(test)]
mod tests;

use std::process::ExitCode;

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::Device;
use burn_megatron::optim::DistributedAdamWConfig;
use burn_megatron::plan::{ParallelPlan, TensorParallel};
use burn_megatron::{ConfigError, LayerError};
use burn_megatron_dist::{LaunchError, ParallelDims, ReduceOp, launch};
use clap::Parser;

use data::Corpus;

/// Trains a GPT-2-style Burn model on generated arithmetic, tensor-, sequence- and
/// data-parallel over ranks that are threads of this process, on the CPU.
#[derive(Parser, Debug)]
#[command(name = "own-model")]
struct Args {
    /// Tensor-parallel ranks: each holds 1/tp of every block's heads and MLP features, and of
    /// the vocabulary.
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// Data-parallel ranks: each trains on 1/dp of every batch.
    #[arg(long, default_value_t = 1)]
    dp: usize,
    /// Sequence parallelism: between the tensor-parallel layers each tp rank holds 1/tp of the
    /// sequence.
    #[arg(long)]
    sp: bool,
    /// Optimizer steps.
    #[arg(long, default_value_t = 200)]
    steps: usize,
    /// AdamW's learning rate.
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Seeds the model's initialization and the data.
    #[arg(long, default_value_t = 7)]
    seed: u64,
}

/// A training run: the model, how it is split, its batches and its optimizer steps.
#[derive(Clone, Debug)]
struct Recipe {
    model: plain::GptConfig,
    plan: ParallelPlan,
    /// Tokens a sequence.
    seq_len: usize,
    /// Sequences a step, over every data-parallel rank.
    batch_size: usize,
    steps: usize,
    lr: f64,
    seed: u64,
}

impl Args {
    /// The layout the flags ask for.
    fn plan(&self) -> ParallelPlan {
        let tensor = match self.sp {
            true => TensorParallel::SequenceParallel,
            false => TensorParallel::Plain,
        };
        ParallelPlan::new(ParallelDims::tp_dp(self.tp, self.dp)).with_tensor(tensor)
    }
}

/// `main`'s run at the flags' layout, steps, learning rate and seed: 2 blocks, d_model 64, 4
/// heads; 8 sequences of 32 tokens a step.
fn small(args: &Args) -> Recipe {
    Recipe {
        model: plain::GptConfig::gpt(Corpus::vocab_size(), 64, 64, 4, 2),
        plan: args.plan(),
        seq_len: 32,
        batch_size: 8,
        steps: args.steps,
        lr: args.lr,
        seed: args.seed,
    }
}

/// A run that failed.
#[derive(Debug, thiserror::Error)]
enum RunError {
    #[error(transparent)]
    Layer(#[from] LayerError),
    #[error(transparent)]
    Launch(#[from] LaunchError),
}

impl From<ConfigError> for RunError {
    fn from(error: ConfigError) -> Self {
        Self::Layer(error.into())
    }
}

fn main() -> ExitCode {
    match train(&small(&Args::parse())) {
        Ok(_) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}

/// Trains `recipe` and prints each step's loss; returns them. Every number is checked before
/// any tensor exists.
fn train(recipe: &Recipe) -> Result<Vec<f64>, RunError> {
    let (dims, seq_len) = (recipe.plan.dims, recipe.seq_len);
    if recipe.steps == 0 {
        return Err(ConfigError::Zero { what: "steps" }.into());
    }
    let config = recipe
        .plan
        .apply(parallel::GptConfig::of(&recipe.model), dims.world_size(), seq_len)?;
    if !recipe.batch_size.is_multiple_of(dims.dp) {
        let (batch, dp) = (recipe.batch_size, dims.dp);
        return Err(ConfigError::BatchNotDivisible { batch, dp }.into());
    }
    let per_rank = recipe.batch_size / dims.dp;
    println!(
        "tp {} × dp {} ({:?}), {} ranks; {} blocks, d_model {}, {} heads; {} sequences of {seq_len} tokens a step",
        dims.tp,
        dims.dp,
        recipe.plan.tensor,
        dims.world_size(),
        recipe.model.n_layers,
        recipe.model.attention.d_model,
        recipe.model.attention.n_heads,
        recipe.batch_size,
    );
    let corpus = Corpus::arithmetic(1 << 16, recipe.seed);
    // The whole plain model, made once: Burn's random initialization draws from one generator
    // for the process, which rank threads would share.
    let device = Device::flex().autodiff();
    device.seed(recipe.seed);
    let plain = recipe.model.init(&device);
    // What the parallel model's first step must print: the plain model's loss on that batch.
    let (ids, targets) = corpus.batch(1, 0, recipe.batch_size, seq_len, &device);
    let reference = plain.loss(ids, targets).into_scalar::<f64>();
    println!("the plain model on step 1's batch: loss {reference:.6}");

    let ranks = launch(
        dims,
        |_| Device::flex(),
        |ctx| -> Result<Vec<f64>, LayerError> {
            let device = ctx.device.clone().autodiff();
            let mut model = config.shard(plain.clone().fork(&device), &ctx.groups)?;
            let mut optim = DistributedAdamWConfig::new().init(&ctx.groups);
            let first = ctx.groups.dp.group_rank() * per_rank;
            let mut losses = Vec::with_capacity(recipe.steps);
            for step in 1..=recipe.steps {
                let (ids, targets) = corpus.batch(step, first, per_rank, seq_len, &device);
                let loss = model.loss(ids, targets)?;
                let mean = ctx
                    .groups
                    .grad_sync()
                    .all_reduce(loss.clone().detach(), ReduceOp::Avg)?;
                let mean = mean.into_scalar::<f64>();
                // The optimizer averages the gradients over the data-parallel ranks.
                let grads = GradientsParams::from_grads(loss.backward(), &model);
                model = optim.step(recipe.lr, model, grads)?.0;
                if ctx.global_rank == 0 {
                    println!("step {step} loss {mean:.6}");
                }
                losses.push(mean);
            }
            Ok(losses)
        },
    )?;
    // Every rank computed the same means; the first error if any failed.
    let mut ranks = ranks.into_iter();
    let first = ranks.next().expect("a run has a rank")?;
    ranks.try_for_each(|rank| rank.map(drop))?;
    Ok(first)
}
