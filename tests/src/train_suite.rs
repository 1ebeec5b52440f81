//! The training step (`train::Trainer`) against itself: gradient accumulation over microbatches
//! gives the parameters of the whole batch, at tp 2 × dp 2 with ZeRO-1 and at pp 2 (whose
//! microbatches the schedule runs); exactly one rank reports at every layout.

use std::collections::HashMap;

use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_megatron::init::{InitMode, ParamInit};
use burn_megatron::models::llama::LlamaConfig;
use burn_megatron::optim::DistributedAdamWConfig;
use burn_megatron::params::{param_infos, param_values};
use burn_megatron::plan::{ParallelPlan, TensorParallel};
use burn_megatron::train::routine::reports;
use burn_megatron::train::{TokenBatch, TrainModel, Trainer};
use burn_megatron_dist::ParallelDims;

use crate::Harness;

const SEQ: usize = 16;
/// Sequences a step, over every data-parallel rank.
const BATCH: usize = 8;

fn config() -> LlamaConfig {
    LlamaConfig::llama(64, 32, 4, 4, 4, 64, SEQ)
}

/// Step `step`'s sequences `first..first + count`.
fn batch(device: &Device, step: usize, first: usize, count: usize) -> TokenBatch {
    let ids: Vec<i64> = (0..BATCH * (SEQ + 1))
        .map(|i| ((i * 37 + step * 11 + i / 5) % 64) as i64)
        .collect();
    let all = Tensor::<2, Int>::from_data(TensorData::new(ids, [BATCH, SEQ + 1]), device).narrow(0, first, count);
    TokenBatch {
        ids: all.clone().narrow(1, 0, SEQ),
        targets: all.narrow(1, 1, SEQ),
    }
}

/// Every parameter's values on this rank by path.
fn values<M: burn::module::Module>(model: &M) -> HashMap<String, Vec<f32>> {
    param_infos(model)
        .into_iter()
        .zip(param_values(model))
        .map(|(info, p)| {
            (
                info.path,
                p.value.into_data().convert::<f32>().try_to_vec::<f32>().unwrap(),
            )
        })
        .collect()
}

/// 3 steps of `trainer` on this rank's share of each batch; its parameters by path.
fn steps<M: TrainModel>(
    mut trainer: Trainer<M>,
    device: &Device,
    (first, count): (usize, usize),
) -> HashMap<String, Vec<f32>> {
    for step in 0..3 {
        trainer.step(3e-3, batch(device, step, first, count)).unwrap();
    }
    values(trainer.model())
}

/// A rank's 4 sequences at tp 2 × dp 2 (SP, ZeRO-1) as 4 microbatches of 1 and 2 of 2, and a
/// pipeline's 8 as 4 microbatches and 8 at pp 2, against one batch (one microbatch) at the same
/// layout: the same parameters, rank by rank, after 3 AdamW steps with clipping. The gradients
/// are the same sums grouped otherwise in f32, and Adam's normalized update carries their
/// rounding: 1e-4 absolute on weights of order 0.02–1.
pub fn accumulation_matches_the_whole_batch(h: &Harness) {
    let init = ParamInit::new(3, InitMode::Full).with_dtype(h.float);
    let optim = DistributedAdamWConfig::new()
        .with_zero1(true)
        .with_max_grad_norm(Some(1.0));
    let dims = ParallelDims::tp_dp(2, 2);
    let plan = ParallelPlan::new(dims).with_tensor(TensorParallel::SequenceParallel);
    let planned = plan.apply(config(), dims.world_size(), SEQ).unwrap();
    let whole = |microbatches: usize| {
        h.run(dims, |ctx| {
            let device = ctx.device.clone().autodiff();
            let model = planned.init(&device, &ctx.groups, &init).unwrap();
            let trainer = Trainer::new(model, &optim, &ctx.groups, &ctx.device)
                .with_accumulation(microbatches)
                .unwrap();
            let per = BATCH / 2;
            steps(trainer, &device, (ctx.groups.dp.group_rank() * per, per))
        })
    };
    let pipeline = |microbatches: usize| {
        let dims = ParallelDims {
            pp: 2,
            ..ParallelDims::single()
        };
        let plan = ParallelPlan::new(dims);
        let planned = plan.apply(config(), dims.world_size(), SEQ).unwrap();
        h.run(dims, |ctx| {
            let device = ctx.device.clone().autodiff();
            let stage = planned
                .init_planned_stage(&plan, microbatches, &device, &ctx.groups, &init)
                .unwrap();
            steps(
                Trainer::new(stage, &optim, &ctx.groups, &ctx.device),
                &device,
                (0, BATCH),
            )
        })
    };
    // Each rank's parameters by path after the steps, at a number of microbatches.
    type Run<'a> = &'a dyn Fn(usize) -> Vec<HashMap<String, Vec<f32>>>;
    let cases: [(&str, Run, &[usize]); 2] = [("tp 2 × dp 2", &whole, &[4, 2]), ("pp 2", &pipeline, &[4, 8])];
    for (layout, run, others) in cases {
        let reference = run(1);
        for &m in others {
            for (rank, (ours, theirs)) in run(m).iter().zip(&reference).enumerate() {
                for (path, value) in ours {
                    let worst = value
                        .iter()
                        .zip(&theirs[path])
                        .fold(0f32, |w, (a, b)| w.max((a - b).abs()));
                    assert!(
                        worst <= 1e-4,
                        "{layout}, {m} microbatches, rank {rank}: {path} off by {worst}"
                    );
                }
            }
        }
    }
}

/// At every layout exactly one rank reports: the last stage's first tp, cp and dp rank.
pub fn one_rank_reports(h: &Harness) {
    for dims in [
        ParallelDims::single(),
        ParallelDims::tp_dp(2, 2),
        ParallelDims {
            pp: 2,
            ..ParallelDims::tp_dp(2, 1)
        },
        ParallelDims {
            cp: 2,
            pp: 2,
            ..ParallelDims::tp_dp(1, 1)
        },
        ParallelDims {
            ep: 2,
            ..ParallelDims::tp_dp(1, 2)
        },
    ] {
        let reporting = h.run(dims, |ctx| (reports(&ctx.groups), ctx.groups.pp.group_rank()));
        let who: Vec<_> = reporting.iter().filter(|(r, _)| *r).collect();
        assert_eq!(who.len(), 1, "{dims:?}: {reporting:?}");
        assert_eq!(who[0].1 + 1, dims.pp, "{dims:?}: the last stage reports");
    }
}
