//! The Learner driver (the default): the run through Burn's `SupervisedTraining` with
//! [`MegatronStrategy`], whose steps are the library's and whose routine is the plain loop's.
//! In a terminal Burn's dashboard shows the run; elsewhere a line a step, never Burn's debug
//! lines. With `--pp` each rank's Learner trains its pipeline stage.

use std::io::IsTerminal;
use std::sync::Arc;

use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::data::dataset::InMemDataset;
use burn::optim::AdamWConfig;
use burn::train::metric::LossMetric;
use burn::train::{InferenceStep, Learner, LearnerModel, SupervisedTraining, TrainStep, TrainingStrategy};
use burn_megatron::train::learner::{LmOutput, MegatronStrategy, Silent, StrategyOptimizer, TokenBatcher};
use burn_megatron::train::routine::Hook;
use burn_megatron::train::{Lines, Reporter, Targeted, TokenBatch, TrainModel};
use burn_megatron_dist::{RankContext, launch};

use crate::rank::{RankModel, Run};

/// Reports nothing: Burn's dashboard shows the run.
struct Dashboard;

impl Reporter for Dashboard {
    fn step(&mut self, _: &burn_megatron::train::StepValues, _: &burn_megatron::train::StepRate) {}
    fn eval(&mut self, _: u64, _: f64) {}
    fn note(&mut self, _: &str) {}
}

/// The run's sequences in the order the strategy's dp slices read them: rank `r`'s `k`-th
/// batch is the plain loop's batch of step `done + k` on rank `r`.
fn sequences(run: &Run) -> Result<Vec<Targeted>, String> {
    let job = &run.job;
    let (dp, per_rank, seq) = (job.dims().dp, job.per_rank, job.seq);
    let steps = run.done + 1..=job.config.steps;
    (0..dp)
        .flat_map(|r| {
            steps
                .clone()
                .flat_map(move |step| (0..per_rank).map(move |i| (step, r * per_rank + i)))
        })
        .map(|(step, index)| run.corpus.targeted(step, index, seq))
        .collect()
}

/// Trains the run through Burn's Learner on every rank; returns the losses the reporting rank
/// read.
pub fn run(run: &Run) -> Result<Vec<f64>, String> {
    let terminal = std::io::stdout().is_terminal();
    let train = sequences(run)?;
    // Burn's validation at the end: the first global batch of the run.
    let valid: Vec<Targeted> = train.iter().take(run.job.per_rank).cloned().collect();
    let results = launch(
        run.job.dims(),
        crate::device_of(run),
        |ctx| -> Result<Vec<f64>, String> {
            let device = ctx.device.clone().autodiff();
            let data = (train.clone(), valid.clone());
            match run.model(&ctx, &device)? {
                RankModel::Whole(model) => fit(run, &ctx, model, data, terminal, run.hooks(&ctx)),
                RankModel::Stage(stage) => fit(run, &ctx, stage, data, terminal, None),
            }
        },
    )
    .map_err(|e| e.to_string())?;
    crate::reported(results)
}

/// One epoch of `model` (a whole model, or this rank's stage) through Burn's
/// `SupervisedTraining` on this rank.
fn fit<M>(
    run: &Run,
    ctx: &RankContext,
    model: M,
    (train, valid): (Vec<Targeted>, Vec<Targeted>),
    terminal: bool,
    hook: Option<Hook<M>>,
) -> Result<Vec<f64>, String>
where
    M: LearnerModel
        + TrainModel
        + TrainStep<Input = TokenBatch, Output = LmOutput>
        + InferenceStep<Input = TokenBatch, Output = LmOutput>,
{
    let job = &run.job;
    let loader = |items: Vec<Targeted>| -> Arc<dyn DataLoader<TokenBatch>> {
        DataLoaderBuilder::new(TokenBatcher)
            .batch_size(job.per_rank)
            .build(InMemDataset::new(items))
    };
    let reporter: Box<dyn Reporter> = match terminal {
        true => Box::new(Dashboard),
        false => Box::new(Lines),
    };
    let losses = Arc::new(std::sync::Mutex::new(Vec::new()));
    let routine = run.routine(ctx, Box::new(Collect(reporter, losses.clone())), hook)?;
    let strategy = MegatronStrategy::new(ctx)
        .with_optimizer(StrategyOptimizer::Distributed(job.optimizer()))
        .with_accumulation(job.accumulation())
        .with_guard(job.config.guard.clone())
        .with_resume(job.config.checkpoint.load.clone())
        .with_routine(routine);
    let dir = std::env::temp_dir().join(format!("burn-megatron-train/rank-{}", ctx.global_rank));
    let mut training = SupervisedTraining::new(dir, loader(train), loader(valid))
        .metrics((LossMetric::new(),))
        .num_epochs(1)
        .with_application_logger(None)
        .with_training_strategy(TrainingStrategy::Custom(Arc::new(strategy)));
    // Burn's dashboard on the reporting rank in a terminal; elsewhere nothing of Burn's.
    if !(terminal && burn_megatron::train::routine::reports(&ctx.groups)) {
        training = training.renderer(Box::new(Silent));
    }
    // The Learner's own optimizer goes unused: the strategy steps with the distributed one.
    let result = training.launch(Learner::new(model, AdamWConfig::new().init(), job.scheduler()));
    if let Some(error) = result.error {
        return Err(error.to_string());
    }
    let losses = losses.lock().expect("not poisoned").clone();
    Ok(losses)
}

/// A reporter that keeps each step's loss beside reporting it.
struct Collect(Box<dyn Reporter>, Arc<std::sync::Mutex<Vec<f64>>>);

impl Reporter for Collect {
    fn step(&mut self, values: &burn_megatron::train::StepValues, rate: &burn_megatron::train::StepRate) {
        self.1.lock().expect("not poisoned").push(values.loss);
        self.0.step(values, rate);
    }

    fn eval(&mut self, step: u64, loss: f64) {
        self.0.eval(step, loss);
    }

    fn note(&mut self, text: &str) {
        self.0.note(text);
    }
}
