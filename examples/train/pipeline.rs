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
use burn_megatron::train::pipeline::{Timing, train_step};
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
        let rank = ctx.groups.pp.group_rank();
        let last = rank == pp - 1;
        let mut stage = config
            .init_planned_stage(plan, m, &device, &ctx.groups, init)
            .map_err(|e| e.to_string())?;
        let config = DistributedAdamWConfig::new().with_zero1(args.zero1);
        let mut optim = config.init(&ctx.groups).keeping_amaxes(stage.amax_notes());
        let mut done = 0;
        if let Some(dir) = &args.resume {
            // Any layout's checkpoint: each stage reads its own blocks by their paths.
            let (loaded, step) = checkpoint::load(dir, stage, &mut optim, &ctx.groups).map_err(|e| e.to_string())?;
            (stage, done) = (loaded, step as usize);
        }
        // The microbatches of a step quantize each weight once (FP8 current scaling, blockwise).
        if m > 1 {
            stage = stage.keeping_weight_codes();
        }
        let mut saves = Saves::new(args);
        let dp_rank = ctx.groups.dp.group_rank();
        let per_micro = per_rank / m;
        let context = stage.context_layout();
        let prints = last && dp_rank == 0;
        let start = Instant::now();
        let mut losses = Vec::new();
        // Each step's share outside the forwards and backwards (the first, warming up, left out).
        let mut idle = Vec::new();
        for step in done + 1..=args.steps {
            // Under context parallelism each cp rank reads the same sequences and keeps its chunks.
            let batches = (0..m)
                .map(|i| {
                    let (ids, targets) = corpus.batch(step, dp_rank * per_rank + i * per_micro, per_micro, seq, &device);
                    Ok((context.shard(ids, 1)?, context.shard(targets, 1)?))
                })
                .collect::<Result<Vec<_>, ConfigError>>()
                .map_err(|e| e.to_string())?;
            let (next, report) = train_step(
                stage,
                &mut optim,
                args.lr,
                &actions.ranks[rank],
                &batches,
                &ctx.groups.pp,
                // Each forward and backward timed whole: the measured bubble below.
                Timing::Synchronized,
            )
            .map_err(|e| e.to_string())?;
            // The expert bias of each of this stage's MoE blocks, by its load over the step.
            stage = next
                .update_expert_bias(&report.loads, &ctx.groups)
                .map_err(|e| e.to_string())?;
            if step > done + 1 || args.steps == done + 1 {
                idle.extend(report.timing.idle());
            }
            // Delayed FP8 scaling: the step's amaxes onto each of this stage's histories.
            burn_megatron::precision::linear::advance_histories(stage.layers.iter_mut().flatten().flat_map(burn_megatron::models::llama::LlamaBlock::linear_precisions), &ctx.groups)
                .map_err(|e| e.to_string())?;
            // The last stage's loss on every rank, so that every stage stops on a loss that
            // is not finite.
            let loss = match report.loss {
                Some(loss) => loss.cast(burn::tensor::DType::F32),
                None => burn::tensor::Tensor::<1>::zeros([1], (&ctx.device, burn::tensor::DType::F32)),
            };
            let loss = ctx.groups.pp.all_reduce(loss, ReduceOp::Sum).map_err(|e| e.to_string())?;
            let reported = ctx
                .groups
                .grad_sync()
                .all_reduce(loss, ReduceOp::Avg)
                .map_err(|e| e.to_string())?;
            let value = reported.into_scalar::<f64>();
            burn_megatron_kernels::failures::check().map_err(|e| format!("step {step}: {e}; training stops"))?;
            if !value.is_finite() {
                return Err(format!("step {step}: the loss is {value}; training stops"));
            }
            if prints {
                println!("step {step} loss {value:.6}");
                losses.push(value);
            }
            if args.save_every.is_some_and(|k| step % k == 0 && step < args.steps) {
                saves.save(&stage, &optim, step, &ctx.groups)?;
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
        saves.save(&stage, &optim, args.steps.max(done), &ctx.groups)?;
        saves.finish(&ctx.groups)?;
        Ok(losses)
    })
    .map_err(|e| e.to_string())?;
    super::printed_losses(results)
}
