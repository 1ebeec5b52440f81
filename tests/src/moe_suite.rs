//! The MoE suite: the mixture-of-experts layer and a MoE Llama split over ep (both
//! dispatchers), and over tp × ep, against ep = 1 built from the same seed.
//!
//! Each data-parallel rank routes its own tokens. The twin is the whole layer on one rank run
//! on the same tokens, so routing is identical by construction. Outputs, input gradients and
//! router gradients match the twin's on every rank; an expert's gradient on its rank is the sum
//! of the twins' gradients over the ranks of its ep group (each routed copies to it), sliced to
//! the rank's hidden features under tp.

use burn::module::Param;
use burn::tensor::{Device, Gradients, Int, Tensor, TensorData};
use burn_megatron::checkpoint;
use burn_megatron::init::{InitMode, ParamInit, Shard};
use burn_megatron::layers::SequenceLayout;
use burn_megatron::layers::moe::{Capacity, Moe, MoeConfig, RouterConfig};
use burn_megatron::models::llama::{Llama, recipes};
use burn_megatron::optim::{DistributedAdamW, DistributedAdamWConfig};
use burn_megatron::plan::{ExpertParallel, ExpertParallelLayer, ParallelPlan, TensorParallel, TensorParallelLayer};
use burn_megatron_dist::mappings::reduce_from_tp;
use burn_megatron_dist::{ParallelDims, ProcessGroups, ReduceOp};

use crate::Harness;
use crate::data::{assert_close, fixed};

const SEED: u64 = 11;
const B: usize = 2;
const S: usize = 8;
const D: usize = 16;
const E: usize = 8;

/// A layout of the layer test.
#[derive(Clone, Copy, Debug)]
struct Layout {
    tp: usize,
    /// Expert tensor parallelism below tp (`None`: etp = tp).
    etp: Option<usize>,
    ep: usize,
    sp: bool,
    dispatcher: ExpertParallel,
    /// Bias the router away from the last ep rank's experts: that rank receives no copy.
    starve: bool,
    /// Each expert's rows padded to a multiple of this (fillers that must add nothing).
    rows_multiple: Option<usize>,
    /// An expert capacity (each rank cuts its own tokens' copies, as the twin does).
    capacity: Option<Capacity>,
}

impl Layout {
    fn new(tp: usize, ep: usize, dispatcher: ExpertParallel) -> Self {
        Self {
            tp,
            etp: None,
            ep,
            sp: false,
            dispatcher,
            starve: false,
            rows_multiple: None,
            capacity: None,
        }
    }

    /// ep over dp and the tp ranks outside an etp group: `dp = ep · etp / tp`.
    fn dims(&self) -> ParallelDims {
        let etp = self.etp.unwrap_or(self.tp);
        ParallelDims {
            ep: self.ep,
            etp: self.etp,
            ..ParallelDims::tp_dp(self.tp, self.ep * etp / self.tp)
        }
    }
}

/// Top 2 of 8 experts with every router loss, a shared expert, the weights renormalized; with
/// `bias`, a selection bias.
fn config(bias: bool) -> MoeConfig {
    let router = RouterConfig::new(D, E, 2)
        .with_normalize(true)
        .with_aux_loss(1e-2)
        .with_seq_aux_loss(1e-2)
        .with_z_loss(1e-3)
        .with_expert_bias(bias);
    MoeConfig::new(router, 12).with_shared_d_ff(Some(8))
}

/// The layer at `layout` against the twin on every rank's tokens.
fn layer_matches_twin(h: &Harness, layout: Layout) {
    h.run(layout.dims(), |ctx| {
        let dev = ctx.device.clone().autodiff();
        let g = &ctx.groups;
        let (tp, etp, ep) = (&g.tp, &g.etp, &g.ep);
        let init = ParamInit::new(SEED, InitMode::Full).with_dtype(h.float);
        let sequence = match layout.sp {
            true => SequenceLayout::Sharded,
            false => SequenceLayout::Whole,
        };
        let mut planned = config(layout.starve).with_capacity(layout.capacity);
        planned.plan_tensor(layout.tp, sequence).unwrap();
        planned.plan_expert(&layout.dims(), layout.dispatcher).unwrap();
        planned.rows_multiple = layout.rows_multiple;
        let mut par = planned.init(&dev, g, &init, "moe").unwrap();
        let mut twin = config(layout.starve)
            .with_capacity(layout.capacity)
            .init(&dev, &ProcessGroups::single(), &init, "moe")
            .unwrap();
        if layout.starve {
            let per = E / layout.ep;
            let bias: Vec<f32> = (0..E).map(|x| if x >= E - per { -100.0 } else { 0.0 }).collect();
            for moe in [&mut par, &mut twin] {
                let values = Tensor::<1>::from_floats(bias.as_slice(), &dev);
                moe.router.bias = Some(Param::from_tensor(values).set_require_grad(false));
            }
        }
        let seq = |x: Tensor<3>| match layout.sp {
            true => Shard::new(1, tp.group_rank(), tp.size()).slice(x),
            false => x,
        };
        let data = g.dp.group_rank() as u64;
        let x = fixed([B, S, D], 100 + data, &dev, h.float);
        let w = fixed([B, S, D], 200 + data, &dev, h.float);
        // Every tp rank's loss is the whole loss (the model's convention): the output's shards
        // summed over tp under SP, the router losses once.
        let run = |moe: &Moe, x: Tensor<3>, w: Tensor<3>, whole: bool| {
            let x = x.require_grad();
            let (y, routing, load) = moe.forward(x.clone()).unwrap();
            let mut loss = (y.clone() * w).sum();
            if !whole {
                loss = reduce_from_tp(loss, tp).unwrap();
            }
            let dtype = loss.dtype();
            let loss = loss + routing.losses.total().unwrap().cast(dtype);
            let grads = loss.backward();
            (y, x.grad(&grads).unwrap(), grads, routing.experts, load)
        };
        let (y, dx, grads, chosen, load) = run(&par, seq(x.clone()), seq(w.clone()), !layout.sp);
        let (ty, tdx, tgrads, tchosen, tload) = run(&twin, x, w, true);
        let what = |part: &str| format!("{layout:?} rank {}: {part}", ctx.global_rank);
        assert_eq!(
            crate::data::int_values(chosen),
            crate::data::int_values(tchosen),
            "{}",
            what("routing")
        );
        assert_eq!(
            (load.read(), load.dropped),
            (tload.read(), tload.dropped),
            "{}",
            what("load")
        );
        let tol = h.matmul_tolerance;
        assert_close(&y, &seq(ty), tol, &what("output"));
        assert_close(&dx, &seq(tdx), tol, &what("input grad"));
        let grad = |p: &Param<Tensor<2>>, grads: &Gradients| p.grad(grads).unwrap();
        assert_close(
            &grad(&par.router.weight, &grads),
            &grad(&twin.router.weight, &tgrads),
            tol,
            &what("router grad"),
        );
        // The experts: the twins' gradients summed over the ep group, this rank's block. Below
        // etp = tp the group holds tp/etp ranks of each dp rank, whose parts of the sequence
        // add up to one twin.
        let per = E / layout.ep;
        let peers = (tp.size() / etp.size()) as f64;
        for (name, ours, theirs, hidden) in [
            ("w1", &par.experts.w1, &twin.experts.w1, 2),
            ("w2", &par.experts.w2, &twin.experts.w2, 1),
            ("w3", &par.experts.w3, &twin.experts.w3, 2),
        ] {
            let summed = ep.all_reduce(theirs.grad(&tgrads).unwrap(), ReduceOp::Sum).unwrap() / peers;
            let block =
                Shard::new(hidden, etp.group_rank(), etp.size()).slice(summed.narrow(0, ep.group_rank() * per, per));
            // Experts no copy reached are outside the graph: no gradient, which is zero.
            let mine = ours.grad(&grads).unwrap_or_else(|| ours.val().zeros_like());
            assert_close(&mine, &block, tol, &what(name));
            if layout.starve && ep.group_rank() == layout.ep - 1 {
                let g = mine.abs().max().into_scalar::<f32>();
                assert_eq!(g, 0.0, "{}", what("a starved rank's experts get no gradient"));
            }
        }
        let (shared, tshared) = (par.shared.as_ref().unwrap(), twin.shared.as_ref().unwrap());
        let slice = |t: Tensor<2>, dim| Shard::new(dim, tp.group_rank(), tp.size()).slice(t);
        assert_close(
            &grad(&shared.w1.weight, &grads),
            &slice(grad(&tshared.w1.weight, &tgrads), 1),
            tol,
            &what("shared w1"),
        );
        assert_close(
            &grad(&shared.w2.weight, &grads),
            &slice(grad(&tshared.w2.weight, &tgrads), 0),
            tol,
            &what("shared w2"),
        );
    });
}

/// ep = 2 over dp = 2, all-to-all.
pub fn ep2_all_to_all(h: &Harness) {
    layer_matches_twin(h, Layout::new(1, 2, ExpertParallel::AllToAll));
}

/// ep = 2 over dp = 2, all-gather.
pub fn ep2_all_gather(h: &Harness) {
    layer_matches_twin(h, Layout::new(1, 2, ExpertParallel::AllGather));
}

/// Each expert's rows padded with fillers (as the grouped product's tile asks on CUDA), at
/// ep = 1, 2 (both dispatchers) and tp = 2 × ep = 2: the same outputs and gradients.
pub fn padded_expert_rows(h: &Harness) {
    for (tp, ep, dispatcher, multiple) in [
        (1, 1, ExpertParallel::AllToAll, 4),
        (1, 2, ExpertParallel::AllToAll, 4),
        (1, 2, ExpertParallel::AllGather, 3),
        (2, 2, ExpertParallel::AllToAll, 8),
    ] {
        layer_matches_twin(
            h,
            Layout {
                sp: tp > 1,
                rows_multiple: Some(multiple),
                ..Layout::new(tp, ep, dispatcher)
            },
        );
    }
}

/// A capacity factor of 0.5 at ep = 2 (both dispatchers, with and without padding to the
/// capacity) and tp = 2 × ep = 2: each rank drops the copies the twin drops from its tokens,
/// and the survivors give the twin's outputs and gradients (the drops counted alike).
pub fn capacity_over_ep(h: &Harness) {
    for (tp, dispatcher, pad) in [
        (1, ExpertParallel::AllToAll, false),
        (1, ExpertParallel::AllGather, false),
        (1, ExpertParallel::AllToAll, true),
        (2, ExpertParallel::AllGather, true),
    ] {
        let capacity = Capacity::new(0.5).with_pad(pad);
        layer_matches_twin(
            h,
            Layout {
                sp: tp > 1,
                capacity: Some(capacity),
                ..Layout::new(tp, 2, dispatcher)
            },
        );
    }
}

/// ep = 4 over dp = 4, both dispatchers.
pub fn ep4_both_dispatchers(h: &Harness) {
    for dispatcher in [ExpertParallel::AllToAll, ExpertParallel::AllGather] {
        layer_matches_twin(h, Layout::new(1, 4, dispatcher));
    }
}

/// tp = 2 × ep = 2: each expert's hidden features split over tp, with and without SP.
pub fn tp2_ep2(h: &Harness) {
    for (sp, dispatcher) in [(true, ExpertParallel::AllToAll), (false, ExpertParallel::AllGather)] {
        layer_matches_twin(
            h,
            Layout {
                sp,
                ..Layout::new(2, 2, dispatcher)
            },
        );
    }
}

/// Expert tensor parallelism below tp, under SP: etp = 1 at tp = 2 with ep = 2 over the tp
/// ranks alone (all-to-all) and ep = 4 over tp × dp = 2 × 2 (all-gather), and etp = 2 at tp = 4
/// with ep = 2 (each etp group its half of the sequence): the twin's outputs, gradients and
/// loads on every rank.
pub fn etp_below_tp(h: &Harness) {
    for (tp, etp, ep, dispatcher) in [
        (2, 1, 2, ExpertParallel::AllToAll),
        (2, 1, 4, ExpertParallel::AllGather),
        (4, 2, 2, ExpertParallel::AllToAll),
    ] {
        layer_matches_twin(
            h,
            Layout {
                sp: true,
                etp: Some(etp),
                ..Layout::new(tp, ep, dispatcher)
            },
        );
    }
}

/// The last ep rank's experts receive no copy: forward and backward still run, with both
/// dispatchers, and their gradient is zero.
pub fn starved_rank(h: &Harness) {
    for dispatcher in [ExpertParallel::AllToAll, ExpertParallel::AllGather] {
        layer_matches_twin(
            h,
            Layout {
                starve: true,
                ..Layout::new(1, 2, dispatcher)
            },
        );
    }
}

const SEQ: usize = 32;
const BATCH: usize = 4;

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

/// What each step of a run did.
struct Curve {
    /// The loss, averaged over dp.
    losses: Vec<f64>,
    /// The global gradient norm.
    norms: Vec<f64>,
    /// The copies of this rank's tokens each expert of each MoE block took: a token that
    /// changes experts changes these.
    loads: Vec<Vec<usize>>,
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

/// A plan of `tp` × dp 2 with experts over `ep`.
fn plan(tp: usize, ep: usize, dispatcher: ExpertParallel, sp: bool) -> ParallelPlan {
    plan_dp(tp, 2, ep, dispatcher, sp)
}

/// `plan` with the experts' hidden features split over `etp` tp ranks.
fn with_etp(plan: ParallelPlan, etp: usize) -> ParallelPlan {
    ParallelPlan {
        dims: ParallelDims {
            etp: Some(etp),
            ..plan.dims
        },
        ..plan
    }
}

/// A plan of `tp` × `dp` with experts over `ep`.
fn plan_dp(tp: usize, dp: usize, ep: usize, dispatcher: ExpertParallel, sp: bool) -> ParallelPlan {
    let dims = ParallelDims {
        ep,
        ..ParallelDims::tp_dp(tp, dp)
    };
    let tensor = match sp {
        true => TensorParallel::SequenceParallel,
        false => TensorParallel::Plain,
    };
    ParallelPlan::new(dims).with_tensor(tensor).with_expert(dispatcher)
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
