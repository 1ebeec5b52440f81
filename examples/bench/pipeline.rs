//! `bench --pp N [--vpp V] [--microbatches M]`: training throughput over pipeline stages, each
//! rank its stage running its part of the schedule (`train::pipeline::train_step`), the
//! distributed optimizer's fp32 master weights on every stage; the steps run unsynchronized
//! (`Timing::Off`), then one more synchronized step measures the bubble beside the schedule's
//! prediction.

use std::time::Instant;

use burn::tensor::{Int, Tensor};
use burn_megatron::init::InitMode;
use burn_megatron::layers::context::ContextLayout;
use burn_megatron::models::llama::LlamaConfig;
use burn_megatron::optim::DistributedAdamWConfig;
use burn_megatron::plan::ParallelPlan;
use burn_megatron::plan::pipeline::simulate::simulate;
use burn_megatron::precision::PrecisionPolicy;
use burn_megatron::train::pipeline::{Timing, train_step};
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
    (ids, targets): (Tensor<2, Int>, Tensor<2, Int>),
    warmup: usize,
    steps: usize,
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
    let mut stage = match microbatches > 1 {
        true => stage.keeping_weight_codes(),
        false => stage,
    };
    let actions = plan
        .pipeline
        .actions(pp.size(), microbatches)
        .unwrap_or_else(|e| panic!("{e}"));
    let bubble_predicted = simulate(&actions).unwrap_or_else(|e| panic!("{e}")).bubble;
    let actions = &actions.ranks[pp.group_rank()];
    let [b, _] = ids.dims();
    let per = b / microbatches;
    let context = ContextLayout::new(&ctx.groups.cp);
    let shard = |x| context.shard(x, 1).unwrap_or_else(|e| panic!("{e}"));
    let batches: Vec<_> = (0..microbatches)
        .map(|i| {
            let cut = |x: &Tensor<2, Int>| shard(x.clone().narrow(0, i * per, per));
            (cut(&ids), cut(&targets))
        })
        .collect();
    let mut optim = DistributedAdamWConfig::new()
        .init(&ctx.groups)
        .keeping_amaxes(stage.amax_notes());
    // One step, and the loss the last stage reports (averaged over dp × cp) on every rank.
    let mut step = |stage, timing| {
        let (mut stage, report) =
            train_step(stage, &mut optim, LR, actions, &batches, pp, timing).unwrap_or_else(|e| panic!("{e}"));
        // Delayed FP8 scaling's histories move with the step, as in training.
        burn_megatron::precision::linear::advance_histories(
            stage
                .layers
                .iter_mut()
                .flatten()
                .flat_map(burn_megatron::models::llama::LlamaBlock::linear_precisions),
            &ctx.groups,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        (stage, report)
    };
    let reported = |loss: Option<Tensor<1>>| -> f64 {
        let loss = loss.unwrap_or_else(|| Tensor::<1>::zeros([1], &ctx.device));
        let loss = pp
            .all_reduce(loss.cast(burn::tensor::DType::F32), ReduceOp::Sum)
            .expect("loss");
        let loss = ctx.groups.grad_sync().all_reduce(loss, ReduceOp::Avg).expect("loss");
        loss.into_scalar::<f64>()
    };
    let mut memory = vec![Mark::take("stage built", &ctx.device)];
    for i in 0..warmup {
        let start = Instant::now();
        let report;
        (stage, report) = step(stage, Timing::Off);
        let loss = reported(report.loss);
        crate::timing::check_failures(&format!("warm-up step {i}"));
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
        let report;
        (stage, report) = step(stage, Timing::Off);
        last = report.loss;
    }
    ctx.device.sync().expect("sync");
    let step_s = start.elapsed().as_secs_f64() / steps as f64;
    memory.push(Mark::take("after the timed steps", &ctx.device));
    let loss = reported(last);
    // One more step, each forward and backward synchronized: the stages' idle share.
    let (_, report) = step(stage, Timing::Synchronized);
    let idle = Tensor::<1>::from_floats([report.timing.idle().unwrap_or(0.0) as f32], &ctx.device);
    let bubble_measured = pp.all_reduce(idle, ReduceOp::Avg).expect("bubble").into_scalar::<f64>();
    PipelineRun {
        step_s,
        loss,
        bubble_predicted,
        bubble_measured,
        memory,
    }
}
