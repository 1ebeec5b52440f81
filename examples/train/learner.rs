//! `train --learner`: the same run through Burn's `SupervisedTraining` and
//! [`MegatronStrategy`], so progress and metrics show the way Burn's Learner shows them (its
//! dashboard in a terminal, its plain renderer otherwise). With `--pp` each rank's Learner
//! trains its pipeline stage, which runs its schedule's part of every step.

use std::sync::Arc;

use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::data::dataset::InMemDataset;
use burn::optim::AdamWConfig;
use burn::tensor::Device;
use burn::train::metric::LossMetric;
use burn::train::{InferenceStep, Learner, LearnerModel, SupervisedTraining, TrainStep, TrainingStrategy};
use burn_megatron::init::ParamInit;
use burn_megatron::models::llama::LlamaConfig;
use burn_megatron::optim::DistributedAdamWConfig;
use burn_megatron::plan::ParallelPlan;
use burn_megatron::train::learner::{LmOutput, MegatronStrategy, Silent, StrategyOptimizer, TokenBatcher};
use burn_megatron::train::{TokenBatch, TrainModel};
use burn_megatron_dist::{RankContext, launch};

use crate::args::Args;
use crate::data::Corpus;
use crate::pipeline;

/// The run's sequences in the order the strategy's dp slices read them: rank `r`'s `k`-th
/// batch is sequences `r·per_rank..(r+1)·per_rank` of step `k`, what the plain loop reads.
fn sequences(corpus: &Corpus, dp: usize, per_rank: usize, steps: usize, seq: usize) -> Vec<Vec<u32>> {
    (0..dp)
        .flat_map(|r| (1..=steps).flat_map(move |step| (0..per_rank).map(move |i| (step, r * per_rank + i))))
        .map(|(step, index)| corpus.window(step, index, seq).to_vec())
        .collect()
}

#[allow(clippy::too_many_arguments)]
pub fn run(
    args: &Args,
    plan: &ParallelPlan,
    config: &LlamaConfig,
    corpus: &Corpus,
    init: &ParamInit,
    device_of: impl Fn(usize) -> Device + Sync,
    per_rank: usize,
    seq: usize,
) -> Result<(), String> {
    let dims = plan.dims;
    let train = sequences(corpus, dims.dp, per_rank, args.steps, seq);
    // Validation: the first batch of a step past the run.
    let valid = sequences(corpus, dims.dp, per_rank, 1, seq);
    let results = launch(dims, device_of, |ctx| -> Result<(), String> {
        let device = ctx.device.clone().autodiff();
        let fail = |e: &dyn std::fmt::Display| e.to_string();
        let data = (train.clone(), valid.clone());
        match dims.pp {
            1 => {
                let model = config.init(&device, &ctx.groups, init).map_err(|e| fail(&e))?;
                fit(args, &ctx, model, data, per_rank)
            }
            _ => {
                let stage = config
                    .init_planned_stage(plan, pipeline::microbatches(args), &device, &ctx.groups, init)
                    .map_err(|e| fail(&e))?;
                fit(args, &ctx, stage, data, per_rank)
            }
        }
    })
    .map_err(|e| e.to_string())?;
    results.into_iter().collect()
}

/// One epoch of `model` (a whole model, or this rank's pipeline stage) through Burn's
/// `SupervisedTraining` on this rank: `data` the training and validation sequences.
fn fit<M>(
    args: &Args,
    ctx: &RankContext,
    model: M,
    (train, valid): (Vec<Vec<u32>>, Vec<Vec<u32>>),
    per_rank: usize,
) -> Result<(), String>
where
    M: LearnerModel
        + TrainModel
        + TrainStep<Input = TokenBatch, Output = LmOutput>
        + InferenceStep<Input = TokenBatch, Output = LmOutput>,
{
    let loader = |items: Vec<Vec<u32>>| -> Arc<dyn DataLoader<TokenBatch>> {
        DataLoaderBuilder::new(TokenBatcher)
            .batch_size(per_rank)
            .build(InMemDataset::new(items))
    };
    // The optimizer of the plain loop: the same losses at every layout.
    let optimizer = StrategyOptimizer::Distributed(DistributedAdamWConfig::new().with_zero1(args.zero1));
    let strategy = MegatronStrategy::new(ctx).with_optimizer(optimizer);
    let dir = std::env::temp_dir().join(format!("burn-megatron-train-learner/rank-{}", ctx.global_rank));
    let mut training = SupervisedTraining::new(dir, loader(train), loader(valid))
        .metrics((LossMetric::new(),))
        .num_epochs(1)
        .with_training_strategy(TrainingStrategy::Custom(Arc::new(strategy)));
    if ctx.global_rank != 0 {
        training = training.renderer(Box::new(Silent)).with_application_logger(None);
    }
    // The Learner's own optimizer goes unused: the strategy steps with the distributed one.
    let result = training.launch(Learner::new(model, AdamWConfig::new().init(), args.lr));
    match result.error {
        Some(error) => Err(error.to_string()),
        None => Ok(()),
    }
}
