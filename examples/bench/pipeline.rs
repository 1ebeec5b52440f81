//! `bench --pp N [--vpp V] [--microbatches M]`: training throughput over pipeline stages, each
//! rank its stage running its part of the schedule through the library's training step, the
//! distributed optimizer's fp32 master weights on every stage; the steps run unsynchronized
//! (`Timing::Off`), then one more synchronized step measures the bubble beside the schedule's
//! prediction.

use std::time::Instant;

use burn::tensor::{Int, Tensor};
use burn_megatron::init::InitMode;
use burn_megatron::models::llama::LlamaConfig;
use burn_megatron::optim::DistributedAdamWConfig;
use burn_megatron::plan::ParallelPlan;
use burn_megatron::plan::pipeline::simulate::simulate;
use burn_megatron::precision::PrecisionPolicy;
use burn_megatron::train::pipeline::Timing;
use burn_megatron::train::{Stepped, TokenBatch, Trainer};
use burn_megatron_dist::{RankContext, ReduceOp};

use crate::memory::Mark;

/// The peers' learning rate (`docs/performance.md`).
const LR: f64 = 1e-4;

/// What one rank measured.
pub struct PipelineRun {
    /// Mean seconds a step over the timed steps.
    pub step_s: f64,
    /// The last timed step's loss (the last stage's, averaged over dp × cp).
    pub loss: f64,
    /// The schedule's bubble on paper, and the stages' mean idle share of a synchronized step.
    pub bubble_predicted: f64,
    pub bubble_measured: f64,
    /// This stage's pools once it is built, after the first step and after the timed steps.
    pub memory: Vec<Mark>,
}

/// Warm-up and timed steps of this rank's stage of `config` under `plan` over `microbatches`;
/// `(ids, targets)` this dp rank's whole sequences.
#[allow(clippy::too_many_arguments)]
pub fn run(
    ctx: &RankContext,
    config: &LlamaConfig,
    plan: &ParallelPlan,
    microbatches: usize,
    policy: PrecisionPolicy,
    optim: &DistributedAdamWConfig,
    (ids, targets): (Tensor<2, Int>, Tensor<2, Int>),
    (warmup, steps): (usize, usize),
) -> PipelineRun {
    let device = ctx.device.clone().autodiff();
    let pp = &ctx.groups.pp;
    let stage = config
        .init_planned_stage(
            plan,
            microbatches,
            &device,
            &ctx.groups,
            &policy.init(0, InitMode::PerShard),
        )
        .unwrap_or_else(|e| panic!("{e}"));
    // As `train`: the microbatches of a step quantize each weight once under FP8.
    let stage = match microbatches > 1 {
        true => stage.keeping_weight_codes(),
        false => stage,
    };
    let actions = plan
        .pipeline
        .actions(pp.size(), microbatches)
        .unwrap_or_else(|e| panic!("{e}"));
    let bubble_predicted = simulate(&actions).unwrap_or_else(|e| panic!("{e}")).bubble;
    let batch = TokenBatch::new(ids, targets);
    let mut trainer = Trainer::new(stage, optim, &ctx.groups, &ctx.device);
    // The loss the last stage reports (averaged over dp × cp), read on every rank.
    let read = |trainer: &mut Trainer<_>, stepped: Stepped, when: &str| -> f64 {
        trainer.read(stepped).unwrap_or_else(|e| panic!("by {when}: {e}")).loss
    };
    let mut memory = vec![Mark::take("stage built", &ctx.device)];
    for i in 0..warmup {
        let start = Instant::now();
        let stepped = trainer.step(LR, batch.clone()).unwrap_or_else(|e| panic!("{e}"));
        let loss = read(&mut trainer, stepped, &format!("warm-up step {i}"));
        if i == 0 {
            crate::timing::check_first_loss(loss as f32, config.embedding.vocab_size);
            memory.push(Mark::take("after the first step", &ctx.device));
        }
        if ctx.global_rank == 0 {
            eprintln!("warmup {i}: {:.1} s, loss {loss}", start.elapsed().as_secs_f64());
        }
    }
    ctx.device.sync().expect("sync");
    let start = Instant::now();
    let mut last = None;
    for _ in 0..steps {
        last = Some(trainer.step(LR, batch.clone()).unwrap_or_else(|e| panic!("{e}")));
    }
    ctx.device.sync().expect("sync");
    let step_s = start.elapsed().as_secs_f64() / steps as f64;
    memory.push(Mark::take("after the timed steps", &ctx.device));
    let loss = last.map_or(0.0, |stepped| read(&mut trainer, stepped, "the timed steps"));
    // One more step, each forward and backward synchronized: the stages' idle share.
    let mut trainer = trainer.with_timing(Timing::Synchronized);
    let stepped = trainer.step(LR, batch).unwrap_or_else(|e| panic!("{e}"));
    let idle = stepped.timing.and_then(|t| t.idle()).unwrap_or(0.0);
    let idle = Tensor::<1>::from_floats([idle as f32], &ctx.device);
    let bubble_measured = pp.all_reduce(idle, ReduceOp::Avg).expect("bubble").into_scalar::<f64>();
    PipelineRun {
        step_s,
        loss,
        bubble_predicted,
        bubble_measured,
        memory,
    }
}
