//! The distillation suite: the vocabulary-parallel KL at tp 2 against tp 1 (value and the
//! student's logit gradients), and a smoke run: the `llama3` fixture as teacher, its pruned copy
//! as student, 8 AdamW steps of KL at tp 1, tp 2 and dp 2 giving the same falling losses, the
//! student still another model than its teacher.

use burn::optim::GradientsParams;
use burn::tensor::{DType, Tensor};
use burn_megatron::layers::padded_vocab;
use burn_megatron::models::llama::hf::{self, ExportOptions};
use burn_megatron::optim::DistributedAdamWConfig;
use burn_megatron::posttrain::distill::{self, DistillConfig, VocabParallelKl};
use burn_megatron::posttrain::prune::{self, PruneTarget};
use burn_megatron_dist::{ParallelDims, ProcessGroups};

use crate::Harness;
use crate::data::fixed;
use crate::hf_suite::{fixture, loaded};
use crate::prune_suite::windows;

const VOCAB: usize = 99;

/// Logits `[2, 3, 99]` of the student and teacher in [−6, 6), the same on every rank.
fn logits(device: &burn::tensor::Device) -> (Tensor<3>, Tensor<3>) {
    let logits = |seed| fixed([2, 3, VOCAB], seed, device, DType::F32).mul_scalar(6.0);
    (logits(7), logits(8))
}

/// This rank's padded vocabulary slice of `x` (`[.., 99]` → `[.., v/tp]`, the padding columns
/// filled with `fill`).
fn slice(x: Tensor<3>, groups: &ProcessGroups, fill: f32) -> Tensor<3> {
    let tp = groups.tp.size();
    let padded = padded_vocab(VOCAB, 1, tp);
    let [b, s, _] = x.dims();
    let x = Tensor::cat(
        vec![
            x.clone(),
            x.full_like(fill).narrow(2, 0, 1).repeat_dim(2, padded - VOCAB),
        ],
        2,
    );
    let width = padded / tp;
    x.narrow(2, groups.tp.group_rank() * width, width)
        .reshape([b, s, width])
}

/// At tp 2 each rank holds half the (padded) vocabulary: the loss is tp 1's, and the student's
/// gradient is tp 1's slice of it; padding columns (filled with large logits, which would move
/// the softmax were they counted) take no part.
pub fn kl_is_the_same_at_tp_2(h: &Harness) {
    let reference = h
        .run(ParallelDims::single(), |ctx| {
            let device = ctx.device.clone().autodiff();
            let (s, t) = logits(&device);
            let s = s.require_grad();
            let kl = VocabParallelKl::new(VOCAB, 1.5, &ctx.groups)
                .forward(s.clone(), t)
                .unwrap();
            let grad = s.grad(&kl.backward()).unwrap();
            let value = kl.into_scalar::<f64>();
            (value, grad.into_data().try_to_vec::<f32>().unwrap())
        })
        .remove(0);
    h.run(ParallelDims::tp_dp(2, 1), |ctx| {
        let device = ctx.device.clone().autodiff();
        let (s, t) = logits(&device);
        let (s, t) = (slice(s, &ctx.groups, 50.0).require_grad(), slice(t, &ctx.groups, 50.0));
        let kl = VocabParallelKl::new(VOCAB, 1.5, &ctx.groups)
            .forward(s.clone(), t)
            .unwrap();
        let grad = s.grad(&kl.backward()).unwrap();
        let value = kl.into_scalar::<f64>();
        // Sums over the two halves, combined in another order: f32 rounding.
        assert!(
            (value - reference.0).abs() <= 1e-5 * reference.0.abs(),
            "{value} vs {}",
            reference.0
        );
        let grad: Vec<f32> = grad.into_data().try_to_vec().unwrap();
        let width = padded_vocab(VOCAB, 1, 2) / 2;
        let start = ctx.groups.tp.group_rank() * width;
        for row in 0..6 {
            for c in 0..width {
                let got = grad[row * width + c];
                let want = match start + c < VOCAB {
                    true => reference.1[row * VOCAB + start + c],
                    false => 0.0,
                };
                assert!(
                    (got - want).abs() <= 1e-6,
                    "row {row}, column {}: {got} vs {want}",
                    start + c
                );
            }
        }
    });
}

/// The teacher (the fixture) and a pruned student (1 block of 48, FFN 64): 8 clipped AdamW
/// steps of KL at tp 1, tp 2 and dp 2 print the same losses, which fall; the student is still
/// not its teacher.
pub fn distillation_smoke(h: &Harness) {
    let dir = std::env::temp_dir().join(format!("burn-megatron-distill-student-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    h.run(ParallelDims::single(), |ctx| {
        let device = ctx.device.clone();
        let (model, config) = loaded(&fixture("llama3"), &ctx.groups, &device, false);
        let importance = prune::importance(&model, &windows(&device)).unwrap();
        let target = PruneTarget {
            n_layers: 1,
            d_model: 48,
            d_ff: 64,
            ..PruneTarget::of(&config)
        };
        let (config, pruned) = prune::prune(&model, &config, &importance, target).unwrap();
        hf::save(&dir, &pruned, &config, &ctx.groups, &ExportOptions::new()).unwrap();
    });
    let run = |dims: ParallelDims| {
        h.run(dims, |ctx| {
            let device = ctx.device.clone().autodiff();
            let teacher = distill::teacher(loaded(&fixture("llama3"), &ctx.groups, &device, false).0);
            let mut student = loaded(&dir, &ctx.groups, &device, false).0;
            let distiller = DistillConfig::new().with_temperature(2.0).init(VOCAB, &ctx.groups);
            let mut optim = DistributedAdamWConfig::new()
                .with_max_grad_norm(Some(1.0))
                .init(&ctx.groups);
            let batches = windows(&device);
            let mut losses = Vec::new();
            for step in 0..8 {
                // The same 2 sequences every step, split over dp.
                let all = batches[step % 2].clone();
                let per = 2 / ctx.groups.dp.size();
                let mine = all.narrow(0, ctx.groups.dp.group_rank() * per, per);
                let (ids, targets) = (mine.clone().narrow(1, 0, 16), mine.narrow(1, 1, 16));
                let loss = distiller.loss(&student, &teacher, ids, targets).unwrap();
                let grads = GradientsParams::from_grads(loss.total.backward(), &student);
                student = optim.step(3e-3, student, grads).unwrap().0;
                let kl = ctx
                    .groups
                    .dp
                    .all_reduce(loss.kl.cast(DType::F32), burn_megatron_dist::ReduceOp::Sum)
                    .unwrap();
                losses.push(kl.into_scalar::<f64>() / ctx.groups.dp.size() as f64);
            }
            losses
        })
        .remove(0)
    };
    let reference = run(ParallelDims::single());
    // Two alternating batches: compare each batch's first and last visit.
    assert!(
        reference[6] < 0.9 * reference[0] && reference[7] < 0.9 * reference[1],
        "{reference:?}"
    );
    assert!(reference[7] > 1e-3, "the student became its teacher: {reference:?}");
    for dims in [ParallelDims::tp_dp(2, 1), ParallelDims::tp_dp(1, 2)] {
        let losses = run(dims);
        for (a, b) in losses.iter().zip(&reference) {
            // Split products and sums in another order, carried through 8 Adam steps: 10× the
            // split tolerance.
            assert!(
                (a - b).abs() <= 10.0 * h.matmul_tolerance * b.abs().max(1e-2),
                "{dims:?}: {losses:?} vs {reference:?}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
