//! The training step (`train::Trainer`) against itself: gradient accumulation over microbatches
//! gives the parameters of the whole batch, at tp 2 × dp 2 with ZeRO-1 and at pp 2 (whose
//! microbatches the schedule runs); a gradient that is not finite on one rank updates nothing
//! anywhere and is named; exactly one rank reports at every layout.

use std::collections::HashMap;

use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_megatron::init::{InitMode, ParamInit};
use burn_megatron::models::llama::LlamaConfig;
use burn_megatron::optim::DistributedAdamWConfig;
use burn_megatron::params::{param_infos, param_values};
use burn_megatron::plan::{ParallelPlan, TensorParallel};
use burn_megatron::train::routine::reports;
use burn_megatron::train::{GuardConfig, NonFinite, Stopped, TokenBatch, TrainError, TrainModel, Trainer};
use burn_megatron_dist::{ParallelDims, RankContext};

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
    TokenBatch::new(all.clone().narrow(1, 0, SEQ), all.narrow(1, 1, SEQ))
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

/// A NaN (tp 2 × dp 2, SP, ZeRO-1, clipping) or an infinity (pp 2, no clipping) put into one
/// element of one gradient shard on one rank, after the reductions: under the default guard
/// the step stops every rank naming that rank and parameter, and no weight, master weight,
/// moment or step count moved anywhere (compared bit for bit: nothing may have run on them);
/// under `skip` the step reads as skipped, Burn's Learner path's check sees it too, and the
/// next step trains.
pub fn nonfinite_gradient_updates_nothing(h: &Harness) {
    let init = ParamInit::new(5, InitMode::Full).with_dtype(h.float);
    let tp_dp = ParallelDims::tp_dp(2, 2);
    let pp = ParallelDims {
        pp: 2,
        ..ParallelDims::single()
    };
    // (layout, clipping, the rank and parameter index that get the bad value, the value)
    let cases = [(tp_dp, Some(1.0), 3, 2, f32::NAN), (pp, None, 1, 1, f32::INFINITY)];
    for (dims, clip, bad_rank, bad_param, bad) in cases {
        let optim = DistributedAdamWConfig::new()
            .with_zero1(dims.dp > 1)
            .with_max_grad_norm(clip);
        let plan = match dims.tp {
            1 => ParallelPlan::new(dims),
            _ => ParallelPlan::new(dims).with_tensor(TensorParallel::SequenceParallel),
        };
        let planned = plan.apply(config(), dims.world_size(), SEQ).unwrap();
        let per = BATCH / dims.dp;
        let outcomes = h.run(dims, |ctx| {
            let device = ctx.device.clone().autodiff();
            let dp_rank = ctx.groups.dp.group_rank();
            let share = |step| batch(&device, step, dp_rank * per, per);
            let bad = Spoil {
                rank: bad_rank,
                param: bad_param,
                value: bad,
            };
            match dims.pp {
                1 => spoil_one_rank(
                    planned.init(&device, &ctx.groups, &init).unwrap(),
                    &ctx,
                    &optim,
                    share,
                    bad,
                ),
                _ => {
                    let stage = planned
                        .init_planned_stage(&plan, 1, &device, &ctx.groups, &init)
                        .unwrap();
                    spoil_one_rank(stage, &ctx, &optim, share, bad)
                }
            }
        });
        let bad_path = outcomes[bad_rank].1.clone();
        for (rank, (error, _, untouched, learner_check, skipped, untouched_again, trained)) in
            outcomes.into_iter().enumerate()
        {
            let at = format!("{dims:?}, rank {rank}");
            match &error {
                TrainError::Gradient {
                    step: 2,
                    stopped: Stopped::NonFinite(found),
                } => {
                    assert_eq!(found.first, Some((bad_rank, bad_path.clone())), "{at}");
                    assert_eq!(found.ranks, vec![bad_rank], "{at}");
                }
                other => panic!("{at}: {other}"),
            }
            assert!(error.to_string().contains(&bad_path), "{at}: {error}");
            assert!(untouched && untouched_again, "{at}: a state moved");
            assert!(!learner_check, "{at}: the Learner path's check passed it");
            assert!(skipped && trained, "{at}: skipped {skipped}, trained after {trained}");
        }
    }
}

/// Where [`nonfinite_gradient_updates_nothing`] puts its bad value: the global rank, the
/// parameter's index, the value.
#[derive(Clone, Copy)]
struct Spoil {
    rank: usize,
    param: usize,
    value: f32,
}

/// What one rank saw: the stopping error, the bad parameter's path here, whether every state
/// stayed, the Learner path's check, whether the `skip` step read skipped and left every state,
/// whether the step after it trained.
type Outcome = (TrainError, String, bool, bool, bool, bool, bool);

/// One rank of [`nonfinite_gradient_updates_nothing`] with `model`.
fn spoil_one_rank<M: TrainModel>(
    model: M,
    ctx: &RankContext,
    optim: &DistributedAdamWConfig,
    share: impl Fn(usize) -> TokenBatch,
    bad: Spoil,
) -> Outcome {
    // Each parameter's bits, its optimizer state's, and the optimizer's step count.
    let state = |trainer: &Trainer<M>| {
        let numels: Vec<usize> = param_values(trainer.model())
            .iter()
            .map(|p| p.value.dims()[0])
            .collect();
        let optim = trainer.optimizer();
        let states: Vec<Vec<u32>> = optim
            .export_state(&numels)
            .unwrap()
            .into_iter()
            .flat_map(|s| [s.master, s.m, s.v])
            .map(|t| bits(t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap()))
            .collect();
        let mut weights: Vec<(String, Vec<u32>)> =
            values(trainer.model()).into_iter().map(|(p, v)| (p, bits(v))).collect();
        weights.sort();
        (weights, states, optim.steps())
    };
    // Step `step`'s gradients, the bad value in the first element on the bad rank.
    let spoiled = |trainer: &mut Trainer<M>, step| {
        let mut gradients = trainer.gradients(share(step)).unwrap();
        if ctx.global_rank == bad.rank {
            let g = gradients.reduced[bad.param].clone();
            let n = g.dims()[0];
            let first = g.clone().narrow(0, 0, 1).mul_scalar(0.0).add_scalar(bad.value);
            gradients.reduced[bad.param] = Tensor::cat(vec![first, g.narrow(0, 1, n - 1)], 0);
        }
        gradients
    };
    let path = param_infos(&model)[bad.param].path.clone();
    let mut trainer = Trainer::new(model, optim, &ctx.groups, &ctx.device);
    let first = trainer.step(3e-3, share(0)).unwrap();
    trainer.read(first).unwrap();
    let before = state(&trainer);
    let gradients = spoiled(&mut trainer, 1);
    let stepped = trainer.update(3e-3, gradients).unwrap();
    let error = trainer.read(stepped).expect_err("a gradient is not finite");
    let untouched = state(&trainer) == before;
    let skip = GuardConfig {
        nonfinite: NonFinite::Skip,
        ..GuardConfig::default()
    };
    let mut trainer = trainer.with_guard(skip).unwrap();
    let gradients = spoiled(&mut trainer, 2);
    let learner_check = trainer.check(&gradients).unwrap().expect("checked").finite();
    let stepped = trainer.update(3e-3, gradients).unwrap();
    let skipped = trainer.read(stepped).unwrap().skipped;
    let untouched_again = state(&trainer) == before;
    let next = trainer.step(3e-3, share(3)).unwrap();
    let trained = !trainer.read(next).unwrap().skipped && state(&trainer).0 != before.0;
    (error, path, untouched, learner_check, skipped, untouched_again, trained)
}

fn bits(values: Vec<f32>) -> Vec<u32> {
    values.into_iter().map(f32::to_bits).collect()
}

/// Two runs of 20 steps at tp 2 with SP and the same seed give the same losses and weights bit
/// for bit: no kernel of a training step adds floats in an order the hardware picks (the
/// embedding's gradient sorts its positions, every reduction sums in a fixed order, Burn runs
/// without autotune).
pub fn two_runs_are_bitwise_identical(h: &Harness) {
    let init = ParamInit::new(11, InitMode::Full).with_dtype(h.float);
    let optim = DistributedAdamWConfig::new().with_max_grad_norm(Some(1.0));
    let dims = ParallelDims::tp_dp(2, 1);
    let plan = ParallelPlan::new(dims).with_tensor(TensorParallel::SequenceParallel);
    let planned = plan.apply(config(), dims.world_size(), SEQ).unwrap();
    let run = || {
        h.run(dims, |ctx| {
            let device = ctx.device.clone().autodiff();
            let model = planned.init(&device, &ctx.groups, &init).unwrap();
            let mut trainer = Trainer::new(model, &optim, &ctx.groups, &ctx.device);
            let losses: Vec<u64> = (0..20)
                .map(|step| {
                    let stepped = trainer.step(3e-3, batch(&device, step, 0, BATCH)).unwrap();
                    trainer.read(stepped).unwrap().loss.to_bits()
                })
                .collect();
            let mut weights: Vec<(String, Vec<u32>)> =
                values(trainer.model()).into_iter().map(|(p, v)| (p, bits(v))).collect();
            weights.sort();
            (losses, weights)
        })
    };
    let (first, second) = (run(), run());
    for (rank, (a, b)) in first.iter().zip(&second).enumerate() {
        assert_eq!(a.0, b.0, "rank {rank}: the losses differ");
        assert!(a.1 == b.1, "rank {rank}: the weights differ");
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
