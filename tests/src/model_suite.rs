//! The model suite: the tiny Llama at the harness's tp, with and without sequence parallelism,
//! against the tp = 1 model from the same seed: the loss, every parameter gradient, and the
//! losses of 20 AdamW steps.

use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Gradients, Int, Tensor, TensorData};
use burn_megatron::init::{InitMode, ParamInit};
use burn_megatron::models::llama::{Llama, recipes};
use burn_megatron::params::{param_grads, param_values};
use burn_megatron::plan::{ParallelPlan, TensorParallel};
use burn_megatron_dist::{ParallelDims, ProcessGroups};

use crate::Harness;

const SEQ: usize = 64;
const BATCH: usize = 2;

/// The tiny preset planned for `tp` (with or without SP), initialized from one seed.
fn tiny(h: &Harness, groups: &ProcessGroups, device: &Device, sp: bool) -> Llama {
    let tp = groups.tp.size();
    let tensor = if sp {
        TensorParallel::SequenceParallel
    } else {
        TensorParallel::Plain
    };
    let plan = ParallelPlan::new(ParallelDims::tp_dp(tp, 1)).with_tensor(tensor);
    let config = plan
        .apply(recipes::tiny().model, tp, SEQ)
        .expect("tiny plans at every tp ≤ 4");
    config
        .init(device, groups, &ParamInit::new(3, InitMode::Full).with_dtype(h.float))
        .expect("init")
}

/// Token ids and next-token targets, the same on every rank.
fn batch(device: &Device, step: u64) -> (Tensor<2, Int>, Tensor<2, Int>) {
    let n = BATCH * (SEQ + 1);
    let ids: Vec<i64> = (0..n as u64)
        .map(|i| ((i * 2654435761 + step * 97) % 1024) as i64)
        .collect();
    let all = Tensor::<2, Int>::from_data(TensorData::new(ids, [BATCH, SEQ + 1]), device);
    (all.clone().narrow(1, 0, SEQ), all.narrow(1, 1, SEQ))
}

/// The losses of 20 AdamW steps (lr 3e-3, PyTorch's ε and weight decay) on `batch`'s batches.
fn adamw_losses(mut model: Llama, device: &Device) -> Vec<f64> {
    let mut optim = AdamWConfig::new().with_epsilon(1e-8).with_weight_decay(0.01).init();
    (0..20)
        .map(|step| {
            let (ids, targets) = batch(device, step);
            let loss = model.forward_loss(ids, targets).unwrap();
            let value = loss.clone().into_scalar::<f64>();
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(3e-3, model.clone(), grads);
            value
        })
        .collect()
}

/// Every parameter's gradient, in traversal order, as (shape, values).
fn gradients(model: &Llama, grads: &Gradients) -> Vec<(Vec<usize>, Vec<f64>)> {
    param_grads(model, grads)
        .into_iter()
        .zip(param_values(model))
        .map(|(grad, p)| {
            let grad = grad.expect("every parameter takes part in the loss");
            (
                p.dims,
                grad.into_data().convert::<f64>().try_into_vec::<f64>().expect("f64"),
            )
        })
        .collect()
}

/// This rank's shard of a whole tensor: the dim where the shapes differ, split in `parts`.
fn shard_of(whole: &(Vec<usize>, Vec<f64>), shard_dims: &[usize], index: usize) -> Vec<f64> {
    let (dims, values) = whole;
    let Some(dim) = (0..dims.len()).find(|&d| dims[d] != shard_dims[d]) else {
        return values.clone();
    };
    let outer: usize = dims[..dim].iter().product();
    let inner: usize = dims[dim + 1..].iter().product();
    let part = shard_dims[dim];
    (0..outer)
        .flat_map(|o| (index * part..(index + 1) * part).flat_map(move |n| (0..inner).map(move |i| (o, n, i))))
        .map(|(o, n, i)| values[(o * dims[dim] + n) * inner + i])
        .collect()
}

/// The loss and every parameter gradient, with and without SP.
pub fn tiny_loss_and_gradients(h: &Harness) {
    h.run(h.tp_world(), |ctx| {
        let dev = ctx.device.clone().autodiff();
        let single = ProcessGroups::single();
        let twin = tiny(h, &single, &dev, false);
        let (ids, targets) = batch(&dev, 0);
        let twin_loss = twin.forward_loss(ids.clone(), targets.clone()).unwrap();
        let twin_grads = gradients(&twin, &twin_loss.backward());
        let twin_loss = twin_loss.into_scalar::<f64>();
        for sp in [false, true] {
            let model = tiny(h, &ctx.groups, &dev, sp);
            let loss = model.forward_loss(ids.clone(), targets.clone()).unwrap();
            let grads = gradients(&model, &loss.backward());
            let loss = loss.into_scalar::<f64>();
            // The loss is a mean of log-probabilities over 128 tokens, so rounding averages out:
            // a tenth of the split-product tolerance (f32 on the CPU: 1e-5).
            assert!(
                (loss - twin_loss).abs() <= 0.1 * h.matmul_tolerance * twin_loss.abs(),
                "tp={} sp={sp}: loss {loss} vs {twin_loss}",
                ctx.groups.tp.size()
            );
            assert_eq!(grads.len(), twin_grads.len());
            for (i, ((dims, g), whole)) in grads.iter().zip(&twin_grads).enumerate() {
                let expected = shard_of(whole, dims, ctx.groups.tp.group_rank());
                let scale = expected.iter().fold(1e-12f64, |m, v| m.max(v.abs()));
                let worst = g.iter().zip(&expected).fold(0f64, |m, (a, b)| m.max((a - b).abs()));
                assert!(
                    worst <= h.matmul_tolerance * scale,
                    "tp={} sp={sp} parameter #{i} {dims:?}: {worst:e} vs scale {scale:e}",
                    ctx.groups.tp.size()
                );
            }
        }
    });
}

/// 20 AdamW steps at tp with SP against tp = 1: the same losses.
pub fn adamw_steps_match(h: &Harness) {
    let losses = |groups: &ProcessGroups, dev: &Device, sp: bool| adamw_losses(tiny(h, groups, dev, sp), dev);
    h.run(h.tp_world(), |ctx| {
        let dev = ctx.device.clone().autodiff();
        let par = losses(&ctx.groups, &dev, true);
        // Every rank of the group reports the same loss; one of them checks it.
        if ctx.groups.tp.group_rank() != 0 {
            return;
        }
        let twin = losses(&ProcessGroups::single(), &dev, false);
        for (step, (a, b)) in par.iter().zip(&twin).enumerate() {
            // Gradients differ from the twin's by rounding; Adam divides each update by the
            // gradient's RMS, which carries that rounding into the weights step after step.
            // Over 20 steps the losses stay within 10× the split-product tolerance (f32 on the
            // CPU: 1e-3 relative).
            assert!(
                (a - b).abs() <= 10.0 * h.matmul_tolerance * b.abs(),
                "step {step}: tp={} loss {a} vs tp=1 loss {b}",
                ctx.groups.tp.size()
            );
        }
        assert!(twin[19] < twin[0], "the model learns: {} → {}", twin[0], twin[19]);
    });
}

/// 20 AdamW steps of the tiny model with FP8 current scaling in its blocks' linear layers (E4M3
/// forward, E5M2 gradients, emulated on the CPU), against the same model in the harness's float
/// dtype: it learns as fast within a band, and differs (the products were quantized). One rank:
/// FP8 under tensor parallelism needs each amax reduced over tp, which is not built yet.
pub fn fp8_tensorwise_tracks_the_curve(h: &Harness) -> Vec<(f64, f64)> {
    use burn_megatron::precision::PrecisionPolicy;
    use burn_megatron_kernels::Gemm;
    let losses = |gemm: Gemm| -> Vec<f64> {
        h.run(ParallelDims::tp_dp(1, 1), |ctx| {
            let dev = ctx.device.clone().autodiff();
            let policy = PrecisionPolicy::f32().with_gemm(gemm);
            let config = policy.apply(recipes::tiny().model);
            let model = config
                .init(
                    &dev,
                    &ctx.groups,
                    &ParamInit::new(3, InitMode::Full).with_dtype(h.float),
                )
                .expect("init");
            adamw_losses(model, &dev)
        })
        .remove(0)
    };
    let (plain, fp8) = (losses(Gemm::Burn), losses(Gemm::Fp8Tensorwise));
    let pairs: Vec<(f64, f64)> = plain.iter().copied().zip(fp8.iter().copied()).collect();
    for (step, &(a, b)) in pairs.iter().enumerate() {
        // E4M3 rounds each operand by up to 2⁻⁴ relative, E5M2 gradients by 2⁻³: the loss of a
        // tiny model moves by a few percent at most. 5% is that band.
        assert!((a - b).abs() <= 0.05 * a, "step {step}: f32 loss {a}, FP8 loss {b}");
    }
    // The batches change every step and lr 3e-3 first lifts the loss: 20 steps bring both
    // below where they started (as in `adamw_steps_match`).
    assert!(
        plain[19] < plain[0] && fp8[19] < fp8[0],
        "both learn: f32 {} → {}, FP8 {} → {}",
        plain[0],
        plain[19],
        fp8[0],
        fp8[19]
    );
    assert!(pairs.iter().any(|(a, b)| a != b), "the FP8 run quantized nothing");
    pairs
}

/// ZeRO-1 over dp = 2 against the unsharded optimizer on one rank: the same losses for 5 steps,
/// and half the optimizer state per rank.
pub fn zero1_matches_unsharded(h: &Harness) {
    use burn_megatron::optim::DistributedAdamWConfig;
    let run = |dp: usize, zero1: bool| {
        h.run(ParallelDims::tp_dp(1, dp), |ctx| {
            let dev = ctx.device.clone().autodiff();
            let mut model = tiny(h, &ctx.groups, &dev, false);
            let mut optim = DistributedAdamWConfig::new().with_zero1(zero1).init(&ctx.groups);
            let per = BATCH / dp;
            let losses: Vec<f64> = (0..5)
                .map(|step| {
                    let (ids, targets) = batch(&dev, step);
                    let first = ctx.groups.dp.group_rank() * per;
                    let loss = model
                        .forward_loss(ids.narrow(0, first, per), targets.narrow(0, first, per))
                        .unwrap();
                    let value = ctx
                        .groups
                        .dp
                        .all_reduce(loss.clone().detach(), burn_megatron_dist::ReduceOp::Avg)
                        .unwrap();
                    let grads = GradientsParams::from_grads(loss.backward(), &model);
                    model = optim.step(3e-3, model.clone(), grads).unwrap().0;
                    value.into_scalar::<f64>()
                })
                .collect();
            (losses, optim.state_bytes())
        })
    };
    let (single, single_bytes) = run(1, false).remove(0);
    for (losses, bytes) in run(2, true) {
        for (step, (a, b)) in losses.iter().zip(&single).enumerate() {
            // Averaging two half-batch gradients instead of one whole-batch gradient reorders
            // f32 sums; Adam carries that rounding through 5 steps (see `adamw_steps_match`).
            assert!(
                (a - b).abs() <= 10.0 * h.matmul_tolerance * b.abs(),
                "step {step}: ZeRO-1 loss {a} vs {b}"
            );
        }
        // Each parameter is padded to a multiple of dp: at most one element per parameter more.
        assert!(
            2 * bytes <= single_bytes + 2 * 12 * 32 && 2 * bytes >= single_bytes,
            "state bytes {bytes} vs {single_bytes}"
        );
    }
}

/// The global gradient norm at tp with SP (and at dp = 2 with ZeRO-1) equals the norm of the
/// single-device gradients: each parameter counted once.
pub fn grad_norm_counts_each_parameter_once(h: &Harness) {
    use burn_megatron::optim::DistributedAdamWConfig;
    let norm = |dims: ParallelDims, sp: bool| {
        h.run(dims, |ctx| {
            let dev = ctx.device.clone().autodiff();
            let model = tiny(h, &ctx.groups, &dev, sp);
            let mut optim = DistributedAdamWConfig::new().with_zero1(true).init(&ctx.groups);
            let per = BATCH / dims.dp;
            let first = ctx.groups.dp.group_rank() * per;
            let (ids, targets) = batch(&dev, 0);
            let loss = model
                .forward_loss(ids.narrow(0, first, per), targets.narrow(0, first, per))
                .unwrap();
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            optim.step(1e-3, model.clone(), grads).unwrap().1.grad_norm
        })
    };
    let single = norm(ParallelDims::tp_dp(1, 1), false)[0];
    let tp = h.world;
    for (what, dims, sp) in [
        ("tp+sp", ParallelDims::tp_dp(tp, 1), true),
        ("dp+zero1", ParallelDims::tp_dp(1, tp), false),
    ] {
        for n in norm(dims, sp) {
            // A sum of squares of every gradient: the split products' rounding (see
            // `tiny_loss_and_gradients`) averages out, as in the loss: a tenth of the tolerance.
            assert!(
                (n - single).abs() <= 0.1 * h.matmul_tolerance * single,
                "{what}: norm {n} vs {single}"
            );
        }
    }
}
