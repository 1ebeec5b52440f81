//! The context-parallel suite: each exchange (ring, all-to-all, all-gather) at cp 2 and 4
//! against causal attention over the whole sequence on one rank (output and the gradients of
//! q, k and v, grouped-query attention included), and the tiny Llama at cp 2 and tp 2 × cp 2
//! (with SP) against cp 1: the loss and every parameter gradient, rows packing documents too.
//! Bad layouts are typed errors.
//!
//! Legend: `b` batch, `h` query heads, `g` kv heads, `s` the whole sequence, `d` head_dim.

use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use burn_megatron::ConfigError;
use burn_megatron::init::{InitMode, ParamInit};
use burn_megatron::layers::Documents;
use burn_megatron::layers::context::{ContextLayout, context_attention};
use burn_megatron::models::llama::{Llama, recipes};
use burn_megatron::plan::{ContextParallel, ParallelPlan, TensorParallel};
use burn_megatron::train::TokenBatch;
use burn_megatron_dist::{ParallelDims, ProcessGroups, ReduceOp};

use crate::Harness;
use crate::data::fixed;
use crate::model_suite::{gradients, shard_of};

const EXCHANGES: [ContextParallel; 3] = [
    ContextParallel::Ring,
    ContextParallel::AllToAll,
    ContextParallel::AllGather,
];

fn cp_dims(cp: usize) -> ParallelDims {
    ParallelDims {
        cp,
        ..ParallelDims::single()
    }
}

/// A whole `[b, heads, s, d]` tensor of values in [−2, 2) in `dtype`, the same on every rank.
fn whole(heads: usize, s: usize, d: usize, seed: u64, device: &Device, dtype: DType) -> Tensor<4> {
    fixed([2, heads, s, d], seed, device, DType::F32)
        .mul_scalar(2.0)
        .cast(dtype)
}

fn values(x: Tensor<4>) -> Vec<f32> {
    x.into_data().convert::<f32>().try_into_vec().unwrap()
}

/// Each exchange at cp 2 and 4, 4 query heads over 2 kv heads (all-to-all: 4 over 4 at cp 4,
/// where 2 kv heads do not scatter over 4 ranks), on a sequence of 4 chunks a rank: each rank's
/// output, and the gradients of its q, k and v under a fixed weighting of the output, are the
/// whole attention's rows of its chunks. In bf16 the heads are 128 wide, so on CUDA every block
/// and the reference run on the flash kernels.
pub fn attention_matches_one_rank(h: &Harness) {
    let d = match h.float {
        DType::F32 => 8,
        _ => 128,
    };
    for cp in [2, 4] {
        for context in EXCHANGES {
            let kv_heads = if context == ContextParallel::AllToAll && cp == 4 {
                4
            } else {
                2
            };
            let s = 8 * cp;
            h.run(cp_dims(cp), |ctx| {
                let device = ctx.device.clone().autodiff();
                let t = |heads, seed| whole(heads, s, d, seed, &device, h.float);
                let (q, k, v, w) = (
                    t(4, 1).require_grad(),
                    t(kv_heads, 2).require_grad(),
                    t(kv_heads, 3).require_grad(),
                    t(4, 4),
                );
                let repeat = |x: Tensor<4>| match kv_heads {
                    4 => x,
                    _ => {
                        let [b, g, s, d] = x.dims();
                        x.unsqueeze_dim::<5>(2).repeat_dim(2, 4 / g).reshape([b, 4, s, d])
                    }
                };
                let reference =
                    burn_megatron_kernels::attention::attention(q.clone(), repeat(k.clone()), repeat(v.clone()), true);
                let ref_grads = (reference.clone() * w.clone()).sum().backward();
                let layout = ContextLayout::new(&ctx.groups.cp);
                let mine = |x: Tensor<4>| layout.shard(x, 2).unwrap();
                // Fresh leaves of this rank's chunks.
                let (lq, lk, lv) = (
                    mine(q.clone()).detach().require_grad(),
                    mine(k.clone()).detach().require_grad(),
                    mine(v.clone()).detach().require_grad(),
                );
                let out = context_attention(lq.clone(), lk.clone(), lv.clone(), context, &ctx.groups.cp).unwrap();
                let grads = (out.clone() * mine(w)).sum().backward();
                let what = format!("{context:?} at cp {cp}, rank {}", ctx.groups.cp.group_rank());
                // f32: attention merged over blocks in another order, a few ulps of values of
                // order 1 (the reference's own test allows 2e-5). bf16: each block's output is
                // rounded to bf16 (2⁻⁹ relative) before the merge, where one flash pass rounds
                // once: the harness's bf16 tolerance of the largest value.
                let close = |a: Vec<f32>, b: Vec<f32>, name: &str| {
                    let worst = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max);
                    let largest = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                    let tolerance = match h.float {
                        DType::F32 => 2e-5,
                        _ => h.tolerance as f32 * largest,
                    };
                    assert!(worst <= tolerance, "{what}: {name} off by {worst} (largest {largest})");
                };
                close(values(out), values(mine(reference)), "output");
                close(
                    values(lq.grad(&grads).unwrap()),
                    values(mine(q.grad(&ref_grads).unwrap())),
                    "dq",
                );
                close(
                    values(lk.grad(&grads).unwrap()),
                    values(mine(k.grad(&ref_grads).unwrap())),
                    "dk",
                );
                close(
                    values(lv.grad(&grads).unwrap()),
                    values(mine(v.grad(&ref_grads).unwrap())),
                    "dv",
                );
            });
        }
    }
}

const SEQ: usize = 32;

/// The tiny preset (4 heads, 2 blocks of 256) planned for `groups`' tp and cp, with `context`.
fn tiny(groups: &ProcessGroups, device: &Device, sp: bool, context: ContextParallel) -> Llama {
    let dims = ParallelDims {
        cp: groups.cp.size(),
        ..ParallelDims::tp_dp(groups.tp.size(), 1)
    };
    let tensor = match sp {
        true => TensorParallel::SequenceParallel,
        false => TensorParallel::Plain,
    };
    let config = ParallelPlan::new(dims)
        .with_tensor(tensor)
        .with_context(context)
        .apply(recipes::tiny().model, dims.world_size(), SEQ)
        .unwrap();
    config.init(device, groups, &ParamInit::new(3, InitMode::Full)).unwrap()
}

/// Ids and next-token targets `[2, 32]`, the same on every rank.
fn batch(device: &Device) -> (Tensor<2, Int>, Tensor<2, Int>) {
    let ids: Vec<i64> = (0..2 * (SEQ as i64 + 1))
        .map(|i| (i * 2654435761 % 1024 + 7) % 1024)
        .collect();
    let all = Tensor::<2, Int>::from_data(TensorData::new(ids, [2, SEQ + 1]), device);
    (all.clone().narrow(1, 0, SEQ), all.narrow(1, 1, SEQ))
}

/// The tiny Llama at cp 2 (each exchange) and at tp 2 × cp 2 with SP: each rank's loss,
/// averaged over dp × cp, is cp 1's, and every parameter gradient averaged over dp × cp (what
/// the optimizer applies) is cp 1's, this rank's tp shard of it.
pub fn model_matches_one_rank(h: &Harness) {
    let mut layouts: Vec<(usize, bool, ContextParallel)> = EXCHANGES.iter().map(|c| (1, false, *c)).collect();
    layouts.push((2, true, ContextParallel::Ring));
    layouts.push((2, true, ContextParallel::AllToAll));
    matches_one_rank(h, &layouts, None);
}

/// Rows packing documents (of 5, 20 and 7 tokens, and 32: each chunk of a rank cuts one) at
/// cp 2 and tp 2 × cp 2 with SP, all-to-all (the whole sequence on each rank for the masked
/// attention): cp 1's loss and gradients, as [`model_matches_one_rank`]. The ring and
/// all-gather exchanges refuse them, naming themselves.
pub fn packed_documents_match_one_rank(h: &Harness) {
    let lengths = [vec![5, 20, 7], vec![SEQ]];
    let all_to_all = [
        (1, false, ContextParallel::AllToAll),
        (2, true, ContextParallel::AllToAll),
    ];
    matches_one_rank(h, &all_to_all, Some(&lengths));
    h.run(cp_dims(2), |ctx| {
        let device = ctx.device.clone().autodiff();
        let model = tiny(&ctx.groups, &device, false, ContextParallel::Ring);
        let (ids, targets) = batch(&device);
        let batch = TokenBatch {
            documents: Some(Documents::from_lengths(&lengths, SEQ, &device).unwrap()),
            ..TokenBatch::new(ids, targets)
        }
        .context_shard(&ContextLayout::new(&ctx.groups.cp))
        .unwrap();
        let error = model
            .forward_loss_documents(batch.ids, batch.targets, batch.documents.as_ref())
            .unwrap_err()
            .to_string();
        assert!(error.contains("ring exchange"), "{error}");
    });
}

/// The tiny Llama at each of `layouts` (tp, sp, exchange) × cp 2 against cp 1, its rows
/// packing documents of `lengths` where given.
fn matches_one_rank(h: &Harness, layouts: &[(usize, bool, ContextParallel)], lengths: Option<&[Vec<usize>]>) {
    let packed = |device: &Device| {
        let (ids, targets) = batch(device);
        TokenBatch {
            documents: lengths.map(|l| Documents::from_lengths(l, SEQ, device).unwrap()),
            ..TokenBatch::new(ids, targets)
        }
    };
    let reference = h
        .run(ParallelDims::single(), |ctx| {
            let device = ctx.device.clone().autodiff();
            let model = tiny(&ctx.groups, &device, false, ContextParallel::Ring);
            let batch = packed(&device);
            let (loss, _) = model
                .forward_loss_documents(batch.ids, batch.targets, batch.documents.as_ref())
                .unwrap();
            let grads = gradients(&model, &loss.backward());
            (loss.into_scalar::<f64>(), grads)
        })
        .remove(0);
    for &(tp, sp, context) in layouts {
        let dims = ParallelDims {
            cp: 2,
            ..ParallelDims::tp_dp(tp, 1)
        };
        h.run(dims, |ctx| {
            let device = ctx.device.clone().autodiff();
            let model = tiny(&ctx.groups, &device, sp, context);
            let batch = packed(&device)
                .context_shard(&ContextLayout::new(&ctx.groups.cp))
                .unwrap();
            let (loss, _) = model
                .forward_loss_documents(batch.ids, batch.targets, batch.documents.as_ref())
                .unwrap();
            let grads = loss.backward();
            let sync = ctx.groups.grad_sync();
            let loss = sync
                .all_reduce(loss.detach(), ReduceOp::Avg)
                .unwrap()
                .into_scalar::<f64>();
            let what = format!("tp {tp} × cp 2 {context:?}, documents {lengths:?}");
            // A mean of 64 tokens' log-probabilities split over ranks: f32 sums in another order.
            assert!(
                (loss - reference.0).abs() <= 1e-5 * reference.0.abs(),
                "{what}: loss {loss} vs {}",
                reference.0
            );
            for (i, ((dims, mine), whole)) in gradients(&model, &grads).into_iter().zip(&reference.1).enumerate() {
                let n = mine.len();
                let local = Tensor::<1>::from_data(TensorData::new(mine, [n]), &ctx.device);
                let averaged: Vec<f64> = sync
                    .all_reduce(local, ReduceOp::Avg)
                    .unwrap()
                    .into_data()
                    .convert::<f64>()
                    .try_into_vec()
                    .unwrap();
                let expected = shard_of(whole, &dims, ctx.groups.tp.group_rank());
                let scale = expected.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(1e-6);
                let worst = averaged
                    .iter()
                    .zip(&expected)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0, f64::max);
                // Products split over tp and sums over cp in another order: the harness's split
                // tolerance of the parameter's largest gradient.
                assert!(
                    worst <= h.matmul_tolerance * scale,
                    "{what}: parameter {i} off by {worst} (largest {scale})"
                );
            }
        });
    }
}

/// A sequence that does not split into 2·cp chunks, and all-to-all over heads that do not
/// scatter over cp, are typed errors before any tensor.
pub fn bad_context_layouts(_h: &Harness) {
    let plan = |cp, context| {
        ParallelPlan::new(ParallelDims {
            cp,
            ..ParallelDims::single()
        })
        .with_context(context)
    };
    let tiny = recipes::tiny().model;
    assert_eq!(
        plan(2, ContextParallel::Ring).apply(tiny.clone(), 2, 30).unwrap_err(),
        ConfigError::ContextChunks { seq_len: 30, cp: 2 }
    );
    assert_eq!(
        plan(8, ContextParallel::AllToAll)
            .apply(tiny.clone(), 8, 64)
            .unwrap_err(),
        ConfigError::ContextHeads {
            what: "n_heads",
            heads: 4,
            cp: 8
        }
    );
    assert!(
        plan(8, ContextParallel::Ring).apply(tiny, 8, 64).is_ok(),
        "the ring takes any heads"
    );
}
