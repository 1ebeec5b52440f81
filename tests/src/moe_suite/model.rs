//! A Llama with MoE blocks at every expert layout against ep = 1: the steps' losses, its
//! checkpoints resharded over ep, the expert bias's balancing, and the layouts refused.

use super::*;
use crate::Harness;
use burn::module::Param;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_megatron::checkpoint;
use burn_megatron::init::{InitMode, ParamInit};
use burn_megatron::models::llama::{Llama, recipes};
use burn_megatron::optim::{DistributedAdamW, DistributedAdamWConfig};
use burn_megatron::plan::{ExpertParallel, ParallelPlan, TensorParallel};
use burn_megatron_dist::{ParallelDims, ProcessGroups, ReduceOp};

/// The tiny MoE Llama (2 blocks) planned by `plan`, from `seed`.
fn moe_model(h: &Harness, plan: ParallelPlan, groups: &ProcessGroups, dev: &Device, seed: u64) -> Llama {
    let mut config = recipes::tiny_moe().model;
    config.n_layers = 2;
    let config = plan.apply(config, plan.dims.world_size(), SEQ).unwrap();
    let init = ParamInit::new(seed, InitMode::Full).with_dtype(h.float);
    config.init(dev, groups, &init).unwrap()
}

/// Steps `steps` of AdamW on fresh batches of 4 sequences, each dp rank its own; the losses
/// averaged over dp.
fn moe_train(
    model: &mut Llama,
    optim: &mut DistributedAdamW,
    groups: &ProcessGroups,
    dev: &Device,
    steps: std::ops::Range<u64>,
) -> Vec<f64> {
    moe_curve(model, optim, groups, dev, steps).losses
}

/// [`moe_train`] with each step's gradient norm and routing.
fn moe_curve(
    model: &mut Llama,
    optim: &mut DistributedAdamW,
    groups: &ProcessGroups,
    dev: &Device,
    steps: std::ops::Range<u64>,
) -> Curve {
    let per = BATCH / groups.dp.size();
    let first = groups.dp.group_rank() * per;
    let mut curve = Curve {
        losses: Vec::new(),
        norms: Vec::new(),
        loads: Vec::new(),
    };
    for step in steps {
        let n = BATCH * (SEQ + 1);
        let ids: Vec<i64> = (0..n as u64)
            .map(|i| ((i * 2654435761 + step * 97) % 1024) as i64)
            .collect();
        let tokens = Tensor::<2, Int>::from_data(TensorData::new(ids, [BATCH, SEQ + 1]), dev).narrow(0, first, per);
        let (ids, targets) = (tokens.clone().narrow(1, 0, SEQ), tokens.narrow(1, 1, SEQ));
        let (loss, report) = model.forward_loss_report(ids, targets).unwrap();
        let value = groups
            .grad_sync()
            .all_reduce(loss.clone().detach(), ReduceOp::Avg)
            .unwrap();
        let loads = report.loads.iter().flat_map(|l| l.read()).collect();
        let grads = burn::optim::GradientsParams::from_grads(loss.backward(), &*model);
        let report;
        (*model, report) = optim.step(3e-3, model.clone(), grads).unwrap();
        curve.losses.push(value.into_scalar::<f64>());
        curve.norms.push(report.grad_norm());
        curve.loads.push(loads);
    }
    curve
}

/// 20 steps of the tiny MoE Llama at `plan`: the curve of tp rank 0 of each dp rank.
fn moe_losses(h: &Harness, plan: ParallelPlan, zero1: bool) -> Vec<Curve> {
    let curves = h.run(plan.dims, |ctx| {
        let dev = ctx.device.clone().autodiff();
        let mut model = moe_model(h, plan, &ctx.groups, &dev, 5);
        let mut optim = DistributedAdamWConfig::new().with_zero1(zero1).init(&ctx.groups);
        moe_curve(&mut model, &mut optim, &ctx.groups, &dev, 0..20)
    });
    curves.into_iter().step_by(plan.dims.tp).collect()
}

/// 20 AdamW steps of a MoE Llama at ep = 2 and ep = 4 (both dispatchers, ZeRO-1 with one of
/// each), tp = 2 × ep = 2 with SP, and tp = 2 × dp = 2 with etp = 1 and ep = 4 (ZeRO-1), against
/// ep = 1 at the same dp.
///
/// - The first step's global gradient norm within 1e-4 relative (the split-product tolerance):
///   the same weights route the same, so every gradient, the experts' reduced over the
///   expert-data-parallel group and divided by ep, must be the twin's.
/// - As long as every token has taken the twin's experts in every block, every step so far,
///   each loss within 1e-3 relative. The weights then differ only by the order of sums (the
///   experts' gradients reduced over ep, the products split over tp), which AdamW's first
///   steps can enlarge to ~1e-4 of the loss where a gradient entry is near zero; an expert
///   updated at twice its gradient, or a token's copy lost or counted twice, moves the loss
///   by more.
/// - Routing is a discontinuous function of the weights: a token whose two best experts
///   score within that rounding may take the other one (on an H200 with ranks as threads,
///   from step 3 at ep 2; never on the CPU). From that step on
///   the run follows another, equally valid trajectory whose distance from the twin's grows
///   with every step (1e-6 at one step, 1e-2 ten steps later).
///   So the step of the first change is checked within 1e-2 (one token of the 128 a step
///   routes moves the mean loss by about 1e-3), and later steps only learn.
pub fn moe_steps_match(h: &Harness) {
    let twins = [2, 4].map(|dp| moe_losses(h, plan_dp(1, dp, 1, ExpertParallel::AllToAll, false), false));
    for twin in twins.iter().map(|t| &t[0]) {
        assert!(
            twin.losses[19] < twin.losses[0],
            "the model learns: {} → {}",
            twin.losses[0],
            twin.losses[19]
        );
    }
    for (tp, etp, dp, ep, dispatcher, zero1) in [
        (1, 1, 2, 2, ExpertParallel::AllToAll, false),
        (1, 1, 2, 2, ExpertParallel::AllGather, true),
        (2, 2, 2, 2, ExpertParallel::AllToAll, false),
        (1, 1, 4, 4, ExpertParallel::AllToAll, true),
        (1, 1, 4, 4, ExpertParallel::AllGather, false),
        (2, 1, 2, 4, ExpertParallel::AllToAll, true),
    ] {
        // Against ep = 1 at the same dp: each rank routes the same tokens.
        let twins = &twins[dp / 2 - 1];
        let plan = with_etp(plan_dp(tp, dp, ep, dispatcher, tp > 1), etp);
        let ranks = moe_losses(h, plan, zero1);
        let (twin, ours) = (&twins[0], &ranks[0]);
        let what = format!("tp {tp} etp {etp} ep {ep} {dispatcher:?} zero1 {zero1}");
        assert!(
            (ours.norms[0] - twin.norms[0]).abs() <= h.matmul_tolerance * twin.norms[0],
            "{what}: first gradient norm {} vs ep = 1 {}",
            ours.norms[0],
            twin.norms[0]
        );
        let changed = (0..20).find(|&s| ranks.iter().zip(twins).any(|(a, b)| a.loads[s] != b.loads[s]));
        println!("{what}: routing first differs from ep = 1 at step {changed:?}");
        for (step, (a, b)) in ours.losses.iter().zip(&twin.losses).enumerate() {
            let tolerance = match changed {
                Some(c) if step > c => break,
                Some(c) if step == c => 1e-2,
                _ => 1e-3,
            };
            assert!(
                (a - b).abs() <= tolerance * b.abs(),
                "{what}: step {step} loss {a} vs ep = 1 {b} (routing first differs at step {changed:?})"
            );
        }
        assert!(ours.losses[19] < ours.losses[0], "{what}: the model learns");
    }
}

/// Saved at ep = 2 with ZeRO-1 (experts and their optimizer state split over ep, dense state
/// over dp) and resumed at ep = 1; saved again there and resumed at tp = 2 × ep = 2 with SP:
/// each resumed run takes the same next steps as the run that never stopped.
pub fn experts_reshard_in_checkpoints(h: &Harness) {
    let dir = std::env::temp_dir().join(format!("burn-megatron-moe-{}", std::process::id()));
    let again = dir.join("again");
    let _ = std::fs::remove_dir_all(&dir);
    let through = h
        .run(plan(1, 2, ExpertParallel::AllToAll, false).dims, |ctx| {
            let dev = ctx.device.clone().autodiff();
            let layout = plan(1, 2, ExpertParallel::AllToAll, false);
            let mut model = moe_model(h, layout, &ctx.groups, &dev, 5);
            let mut optim = DistributedAdamWConfig::new().with_zero1(true).init(&ctx.groups);
            moe_train(&mut model, &mut optim, &ctx.groups, &dev, 0..3);
            checkpoint::save(&dir, 3, &model, &optim, &ctx.groups).unwrap();
            moe_train(&mut model, &mut optim, &ctx.groups, &dev, 3..5)
        })
        .remove(0);
    let resume = |layout: ParallelPlan, from: &std::path::Path, save: Option<&std::path::Path>| {
        h.run(layout.dims, |ctx| {
            let dev = ctx.device.clone().autodiff();
            // Another seed: every value must come from the checkpoint.
            let fresh = moe_model(h, layout, &ctx.groups, &dev, 99);
            let mut optim = DistributedAdamWConfig::new().init(&ctx.groups);
            let (mut model, step) = checkpoint::load(from, fresh, &mut optim, &ctx.groups).unwrap();
            assert_eq!(step, 3);
            if let Some(to) = save {
                checkpoint::save(to, 3, &model, &optim, &ctx.groups).unwrap();
            }
            moe_train(&mut model, &mut optim, &ctx.groups, &dev, 3..5)
        })
        .remove(0)
    };
    let at_ep1 = resume(plan(1, 1, ExpertParallel::AllToAll, false), &dir, Some(&again));
    let at_tp2_ep2 = resume(plan(2, 2, ExpertParallel::AllGather, true), &again, None);
    let at_etp1 = resume(with_etp(plan(2, 4, ExpertParallel::AllToAll, true), 1), &again, None);
    for (what, losses) in [
        ("ep 1", at_ep1),
        ("tp 2 × ep 2", at_tp2_ep2),
        ("tp 2, etp 1, ep 4", at_etp1),
    ] {
        for (a, b) in losses.iter().zip(&through) {
            // Another layout sums in another order (see `moe_steps_match`); two Adam steps
            // from the same state stay within this.
            assert!(
                (a - b).abs() <= 10.0 * h.matmul_tolerance * b.abs(),
                "{what}: {losses:?} vs {through:?}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// DeepSeek-V3's auxiliary-loss-free balancing through a training step at ep = 2 over dp = 2:
/// the optimizer leaves the router's selection bias as it is (no gradient trains it, and weight
/// decay must not shrink it), then `update_expert_bias` moves it by the rate toward balance,
/// `bias += rate · sign(mean − load)`, the load summed over both ranks' tokens (computed here
/// from every rank's report); it stays out of the gradient.
pub fn expert_bias_balances(h: &Harness) {
    let layout = plan(1, 2, ExpertParallel::AllToAll, false);
    h.run(layout.dims, |ctx| {
        let dev = ctx.device.clone().autodiff();
        let mut config = recipes::tiny_moe().model;
        config.n_layers = 2;
        let moe = config.moe.as_mut().unwrap();
        moe.layer.router = moe
            .layer
            .router
            .clone()
            .with_expert_bias(true)
            .with_bias_update_rate(0.01);
        let config = layout.apply(config, 2, SEQ).unwrap();
        let init = ParamInit::new(5, InitMode::Full).with_dtype(h.float);
        let mut model = config.init(&dev, &ctx.groups, &init).unwrap();
        let start: Vec<f32> = (0..8).map(|x| 0.1 * x as f32 - 0.3).collect();
        for layer in &mut model.layers {
            let router = &mut layer.moe.as_mut().unwrap().router;
            let bias = Tensor::<1>::from_floats(start.as_slice(), &dev);
            router.bias = Some(Param::from_tensor(bias).set_require_grad(false));
        }
        let bias = |model: &Llama, i: usize| -> Vec<f32> {
            let router = &model.layers[i].moe.as_ref().unwrap().router;
            router
                .bias
                .as_ref()
                .unwrap()
                .val()
                .into_data()
                .convert::<f32>()
                .try_to_vec::<f32>()
                .unwrap()
        };
        let mut optim = DistributedAdamWConfig::new().init(&ctx.groups);
        let tokens: Vec<i64> = (0..2 * (SEQ + 1) as i64).map(|i| (i * 37 + 11) % 1024).collect();
        let tokens = Tensor::<2, Int>::from_data(TensorData::new(tokens, [2, SEQ + 1]), &dev);
        let first = ctx.groups.dp.group_rank();
        let tokens = tokens.narrow(0, first, 1);
        let (ids, targets) = (tokens.clone().narrow(1, 0, SEQ), tokens.narrow(1, 1, SEQ));
        let (loss, report) = model.forward_loss_report(ids, targets).unwrap();
        let grads = burn::optim::GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(3e-3, model.clone(), grads).unwrap().0;
        for i in 0..2 {
            assert_eq!(bias(&model, i), start, "block {i}: the optimizer left the bias alone");
        }
        // The expected move, from both ranks' loads.
        let mine: Vec<i64> = report
            .loads
            .iter()
            .flat_map(|l| l.read().into_iter().map(|n| n as i64))
            .collect();
        let n = mine.len();
        let all = ctx
            .groups
            .grad_sync()
            .all_reduce(
                Tensor::<1, Int>::from_data(TensorData::new(mine, [n]), &dev),
                ReduceOp::Sum,
            )
            .unwrap();
        let all = crate::data::int_values(all);
        model = model.update_expert_bias(&report, &ctx.groups).unwrap();
        for i in 0..2 {
            let load = &all[i * 8..(i + 1) * 8];
            let mean = load.iter().sum::<i64>() as f32 / 8.0;
            let expected: Vec<f32> = start
                .iter()
                .zip(load)
                .map(|(b, &l)| b + 0.01 * (mean - l as f32).signum() * ((mean - l as f32) != 0.0) as i32 as f32)
                .collect();
            let ours = bias(&model, i);
            for (a, b) in ours.iter().zip(&expected) {
                // One f32 addition of 0.01: a rounding of the sum.
                assert!((a - b).abs() < 1e-6, "block {i}: bias {ours:?} vs {expected:?}");
            }
            let router = &model.layers[i].moe.as_ref().unwrap().router;
            assert!(
                !router.bias.as_ref().unwrap().val().is_require_grad(),
                "still out of the gradient"
            );
        }
    });
}

/// Bad expert layouts are typed errors before any tensor: experts that do not split over ep,
/// ep that does not divide dp × cp (and the tp ranks outside an etp group), top k above the
/// experts, etp that does not divide tp, etp below tp without SP, hidden features that do not
/// split over etp.
pub fn bad_expert_layouts(_h: &Harness) {
    use burn_megatron::ConfigError;
    use burn_megatron_dist::MeshError;
    let dims = |ep, dp| ParallelDims {
        ep,
        ..ParallelDims::tp_dp(1, dp)
    };
    let apply = |dims: ParallelDims, experts: usize, k: usize| {
        let mut config = recipes::tiny_moe().model;
        let moe = config.moe.as_mut().unwrap();
        moe.layer.router.n_experts = experts;
        moe.layer.router.top_k = k;
        ParallelPlan::new(dims).apply(config, dims.world_size(), 64).map(|_| ())
    };
    assert_eq!(
        apply(dims(3, 3), 8, 2),
        Err(ConfigError::ExpertsNotDivisible { experts: 8, ep: 3 })
    );
    assert!(matches!(
        apply(dims(4, 2), 8, 2),
        Err(ConfigError::Mesh(MeshError::ExpertsDoNotDivide { ep: 4, ranks: 2 }))
    ));
    assert_eq!(
        apply(dims(2, 2), 8, 9),
        Err(ConfigError::TopKAboveExperts { top_k: 9, experts: 8 })
    );
    assert!(apply(dims(2, 4), 8, 2).is_ok());
    let etp = |tp, etp, ep, sp: bool, d_ff| {
        let dims = ParallelDims {
            ep,
            etp: Some(etp),
            ..ParallelDims::tp_dp(tp, 1)
        };
        let mut config = recipes::tiny_moe().model;
        config.moe.as_mut().unwrap().layer.d_ff = d_ff;
        let tensor = match sp {
            true => TensorParallel::SequenceParallel,
            false => TensorParallel::Plain,
        };
        ParallelPlan::new(dims)
            .with_tensor(tensor)
            .apply(config, dims.world_size(), 64)
            .map(|_| ())
    };
    assert_eq!(
        etp(4, 3, 1, true, 128),
        Err(ConfigError::Mesh(MeshError::ExpertTpDoesNotDivide { etp: 3, tp: 4 }))
    );
    assert_eq!(
        etp(2, 1, 2, false, 128),
        Err(ConfigError::ExpertTpNeedsSequenceParallel { etp: 1, tp: 2 })
    );
    assert!(matches!(etp(4, 2, 2, true, 129), Err(ConfigError::NotDivisible { .. })));
    assert!(etp(2, 1, 2, true, 129).is_ok(), "etp 1 takes any hidden size");
}
