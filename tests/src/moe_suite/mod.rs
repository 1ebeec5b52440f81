//! The MoE suite: the mixture-of-experts layer and a MoE Llama split over ep (both
//! dispatchers), and over tp × ep, against ep = 1 built from the same seed.
//!
//! Each data-parallel rank routes its own tokens. The twin is the whole layer on one rank run
//! on the same tokens, so routing is identical by construction. Outputs, input gradients and
//! router gradients match the twin's on every rank; an expert's gradient on its rank is the sum
//! of the twins' gradients over the ranks of its ep group (each routed copies to it), sliced to
//! the rank's hidden features under tp.

use burn::module::Param;
use burn::tensor::{Gradients, Tensor};
use burn_megatron::init::{InitMode, ParamInit, Shard};
use burn_megatron::layers::SequenceLayout;
use burn_megatron::layers::moe::{Capacity, Moe, MoeConfig, RouterConfig};
use burn_megatron::plan::{ExpertParallel, ExpertParallelLayer, ParallelPlan, TensorParallel, TensorParallelLayer};
use burn_megatron_dist::mappings::reduce_from_tp;
use burn_megatron_dist::{ParallelDims, ProcessGroups, ReduceOp};

use crate::Harness;
use crate::data::{assert_close, fixed};

mod model;

pub use model::{bad_expert_layouts, expert_bias_balances, experts_reshard_in_checkpoints, moe_steps_match};

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
