//! `train --pp N [--vpp V] [--microbatches M]`: the Llama over `pp` pipeline stages, each rank
//! running its schedule's actions (1F1B; interleaved 1F1B over `V` model chunks a stage), the
//! per-rank batch split into `M` microbatches (`pp` by default). The last stage prints the
//! losses, which are pp = 1's (the mean over the microbatches is the batch's mean) for dense
//! models; a mixture of experts' router losses are each microbatch's, as in Megatron. `--save`
//! writes every stage's blocks under the whole model's paths (on a thread of its own with
//! `--async-save`), so `--resume` continues at any pp (and tp, dp).

use std::time::Instant;

use burn::tensor::Device;
use burn_megatron::ConfigError;
use burn_megatron::checkpoint;
use burn_megatron::init::ParamInit;
use burn_megatron::models::llama::LlamaConfig;
use burn_megatron::optim::DistributedAdamWConfig;
use burn_megatron::plan::pipeline::simulate::simulate;
use burn_megatron::plan::{ParallelPlan, PipelineSchedule};
use burn_megatron::train::pipeline::Timing;
use burn_megatron::train::{TokenBatch, Trainer};
use burn_megatron_dist::{ReduceOp, launch};

use crate::args::Args;
use crate::data::Corpus;
use crate::saves::Saves;

pub fn schedule(args: &Args) -> PipelineSchedule {
    match args.vpp {
        1 => PipelineSchedule::OneForwardOneBackward,
        v => PipelineSchedule::Interleaved { virtual_stages: v },
    }
}

pub fn microbatches(args: &Args) -> usize {
    args.microbatches.unwrap_or(args.pp)
}

/// Everything a pipeline run needs that can be wrong beyond the plan's checks (the blocks split
/// into `pp · vpp` chunks), before any tensor: the rank's batch splits into the microbatches,
/// the microbatches suit the schedule.
pub fn check(args: &Args, per_rank: usize) -> Result<(), ConfigError> {
    let m = microbatches(args);
    schedule(args).check_microbatches(args.pp, m)?;
    if !per_rank.is_multiple_of(m) || per_rank < m {
        return Err(ConfigError::MicrobatchSplit {
            sequences: per_rank,
            microbatches: m,
        });
    }
    Ok(())
}

/// Trains `config` over the pipeline; returns the losses the last stage printed.
pub fn run(
    args: &Args,
    plan: &ParallelPlan,
    config: &LlamaConfig,
    corpus: &Corpus,
    init: &ParamInit,
    device_of: impl Fn(usize) -> Device + Sync,
    (per_rank, seq, batch): (usize, usize, usize),
) -> Result<Vec<f64>, String> {
    let (pp, m) = (args.pp, microbatches(args));
    let actions = plan.pipeline.actions(pp, m).map_err(|e| e.to_string())?;
    let predicted = simulate(&actions).map_err(|e| e.to_string())?.bubble;
    let results = launch(plan.dims, device_of, |ctx| -> Result<Vec<f64>, String> {
        let device = ctx.device.clone().autodiff();
        let last = ctx.groups.pp.group_rank() == pp - 1;
        let stage = config
            .init_planned_stage(plan, m, &device, &ctx.groups, init)
            .map_err(|e| e.to_string())?;
        // The microbatches of a step quantize each weight once (FP8 current scaling, blockwise).
        let stage = match m > 1 {
            true => stage.keeping_weight_codes(),
            false => stage,
        };
        let optim = DistributedAdamWConfig::new().with_zero1(args.zero1);
        // Each forward and backward timed whole: the measured bubble below.
        let mut trainer = Trainer::new(stage, &optim, &ctx.groups, &ctx.device).with_timing(Timing::Synchronized);
        let mut done = 0;
        if let Some(dir) = &args.resume {
            // Any layout's checkpoint: each stage reads its own blocks by their paths.
            let load = |stage, optim: &mut _| checkpoint::load(dir, stage, optim, &ctx.groups);
            done = trainer.restore(load).map_err(|e| e.to_string())? as usize;
        }
        let mut saves = Saves::new(args);
        let dp_rank = ctx.groups.dp.group_rank();
        let prints = last && dp_rank == 0 && ctx.groups.tp.group_rank() == 0 && ctx.groups.cp.group_rank() == 0;
        let start = Instant::now();
        let mut losses = Vec::new();
        // Each step's share outside the forwards and backwards (the first, warming up, left out).
        let mut idle = Vec::new();
        for step in done + 1..=args.steps {
            let (ids, targets) = corpus.batch(step, dp_rank * per_rank, per_rank, seq, &device);
            let values = trainer
                .step(args.lr, TokenBatch { ids, targets })
                .and_then(|stepped| stepped.read(&ctx.groups))
                .map_err(|e| e.to_string())?;
            if step > done + 1 || args.steps == done + 1 {
                idle.extend(values.timing.and_then(|t| t.idle()));
            }
            if prints {
                println!("{values}");
                losses.push(values.loss);
            }
            if args.save_every.is_some_and(|k| step % k == 0 && step < args.steps) {
                saves.save(trainer.model(), trainer.optimizer(), step, &ctx.groups)?;
            }
        }
        let ran = args.steps.saturating_sub(done);
        // The measured bubble: the pp ranks' mean idle share of a step.
        let mean = idle.iter().sum::<f64>() / idle.len().max(1) as f64;
        let measured = ctx
            .groups
            .pp
            .all_reduce(burn::tensor::Tensor::<1>::from_floats([mean as f32], &ctx.device), ReduceOp::Avg)
            .map_err(|e| e.to_string())?
            .into_scalar::<f64>();
        if prints && ran > 0 {
            let seconds = start.elapsed().as_secs_f64();
            println!(
                "{ran} steps in {seconds:.1} s: {:.0} tokens/s ({pp} stages, {m} microbatches)",
                (ran * batch * seq) as f64 / seconds
            );
            println!(
                "bubble: {:.3} predicted (the schedule run on paper: forward 1/v, backward 2/v, messages free), {measured:.3} measured (the stages' mean share of a step outside their forwards and backwards)",
                predicted
            );
        }
        saves.save(trainer.model(), trainer.optimizer(), args.steps.max(done), &ctx.groups)?;
        saves.finish(&ctx.groups)?;
        Ok(losses)
    })
    .map_err(|e| e.to_string())?;
    super::printed_losses(results)
}
