//! The model suite: the tiny Llama at the harness's tp, with and without sequence parallelism,
//! against the tp = 1 model from the same seed: the loss, every parameter gradient, and the
//! losses of 20 AdamW steps.

use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{DType, Device, Gradients, Int, Tensor, TensorData};
use burn_megatron::init::{InitMode, ParamInit};
use burn_megatron::models::llama::{Llama, recipes};
use burn_megatron::params::{param_grads, param_values};
use burn_megatron::plan::{ParallelPlan, TensorParallel};
use burn_megatron::precision::PrecisionPolicy;
use burn_megatron_dist::{ParallelDims, ProcessGroups};
use burn_megatron_kernels::Gemm;
use burn_megatron_kernels::quant::recipe::Recipe;

use crate::Harness;

mod mtp;
mod precision;

pub use mtp::mtp_matches_its_definition;

pub use precision::{
    delayed_histories_land_on_their_layers, delayed_scaling_histories, quantized_recipes_track_the_curve,
};

const SEQ: usize = 64;
const BATCH: usize = 2;

/// The tiny preset planned for `tp` (with or without SP), initialized from one seed.
fn tiny(h: &Harness, groups: &ProcessGroups, device: &Device, sp: bool) -> Llama {
    tiny_with(h, groups, device, sp, Gemm::Wgmma)
}

/// [`tiny`] with every linear layer on `gemm` (the configuration's default, [`tiny`]'s, is
/// `Wgmma`; a quantized recipe leaves the output layer on Burn's).
fn tiny_with(h: &Harness, groups: &ProcessGroups, device: &Device, sp: bool, gemm: Gemm) -> Llama {
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
    let config = PrecisionPolicy::f32().with_gemm(gemm).apply(config);
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
fn adamw_losses(model: Llama, device: &Device) -> Vec<f64> {
    adamw_curve(model, device, 20, 3e-3)
}

/// The losses of `steps` AdamW steps at `lr`, as [`adamw_losses`].
fn adamw_curve(mut model: Llama, device: &Device, steps: u64, lr: f64) -> Vec<f64> {
    let mut optim = AdamWConfig::new().with_epsilon(1e-8).with_weight_decay(0.01).init();
    (0..steps)
        .map(|step| {
            let (ids, targets) = batch(device, step);
            let loss = model.forward_loss(ids, targets).unwrap();
            let value = loss.clone().into_scalar::<f64>();
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(lr, model.clone(), grads);
            // Delayed FP8 scaling's histories move with the step (dp = 1 here: no reduction).
            burn_megatron::precision::linear::advance_histories(
                model
                    .layers
                    .iter_mut()
                    .flat_map(burn_megatron::models::llama::LlamaBlock::linear_precisions),
                &ProcessGroups::single(),
            )
            .unwrap();
            value
        })
        .collect()
}

/// Every parameter's gradient, in traversal order, as (shape, values).
pub(crate) fn gradients(model: &Llama, grads: &Gradients) -> Vec<(Vec<usize>, Vec<f64>)> {
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
pub(crate) fn shard_of(whole: &(Vec<usize>, Vec<f64>), shard_dims: &[usize], index: usize) -> Vec<f64> {
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
    // The first step's loss: the same weights, products split over tp (f32 rounding).
    steps_match_with(h, Gemm::Wgmma, 1e-5, 10.0 * h.matmul_tolerance);
}

/// [`adamw_steps_match`] with FP8 current scaling in the blocks' linear layers: each rank's
/// amaxes are reduced over tp, so every rank scales its pieces as tp = 1 scales the whole
/// tensors, and the first loss (the same weights) matches to f32 rounding. After it, a value
/// within f32 rounding of an FP8 rounding boundary lands on the neighbouring code (one step,
/// 2⁻³ relative at most, on a handful of the ~10⁵ values a step), and Adam's first update is
/// each gradient element's sign (a near-zero element of the other sign moves by 2·lr): these
/// grow over 20 steps at lr 3e-3, where the tiny model's loss climbs before it falls. Measured
/// here: at most 1.0% (release build, both recipes), so 2e-2 relative.
///
/// Where the FP8 products write bf16 (CUDA), each rank's partial output is rounded to bf16
/// before the tp reduction sums it, where tp = 1 rounds the whole sum once: the first loss then
/// differs by bf16 rounding, 2⁻⁸ relative at most, and every later step starts from a product
/// rounded so, which moves more values across FP8 boundaries than f32 rounding does. Measured on
/// an H200 (tp 2 as threads on one GPU): 2.5% at step 13, so 5e-2.
pub fn fp8_steps_match(h: &Harness) {
    let (first, curve) = fp8_tolerances(h);
    steps_match_with(h, Gemm::Quantized(Recipe::Fp8Tensorwise), first, curve);
}

/// How far the first loss and the curve under FP8 may lie from tp = 1's: f32 rounding and the
/// CPU's measured 1.0% where the products are emulated in f32, bf16's rounding and the H200's
/// 2.5% where they write bf16 ([`fp8_steps_match`]); twice the measured drift either way.
fn fp8_tolerances(h: &Harness) -> (f64, f64) {
    match h.quantized_output {
        DType::BF16 => (2f64.powi(-8), 5e-2),
        _ => (1e-5, 2e-2),
    }
}

/// [`fp8_steps_match`] under delayed scaling: the amaxes recorded into each layer's history are
/// reduced over tp too, so every rank's histories, and scales, are tp = 1's.
pub fn fp8_delayed_steps_match(h: &Harness) {
    let (first, curve) = fp8_tolerances(h);
    steps_match_with(h, Gemm::Quantized(Recipe::FP8_DELAYED), first, curve);
}

/// 20 AdamW steps at the harness's tp with SP against tp = 1, every linear layer on `gemm`: the
/// first loss within `first` relative, each within `tolerance`.
fn steps_match_with(h: &Harness, gemm: Gemm, first: f64, tolerance: f64) {
    let losses =
        |groups: &ProcessGroups, dev: &Device, sp: bool| adamw_losses(tiny_with(h, groups, dev, sp, gemm), dev);
    h.run(h.tp_world(), |ctx| {
        let dev = ctx.device.clone().autodiff();
        let par = losses(&ctx.groups, &dev, true);
        // Every rank of the group reports the same loss; one of them checks it.
        if ctx.groups.tp.group_rank() != 0 {
            return;
        }
        let twin = losses(&ProcessGroups::single(), &dev, false);
        assert!(
            (par[0] - twin[0]).abs() <= first * twin[0].abs(),
            "{gemm:?}: first loss {} vs {}",
            par[0],
            twin[0]
        );
        for (step, (a, b)) in par.iter().zip(&twin).enumerate() {
            // Gradients differ from the twin's by rounding; Adam divides each update by the
            // gradient's RMS, which carries that rounding into the weights step after step.
            // Over 20 steps the losses stay within 10× the split-product tolerance (f32 on the
            // CPU: 1e-3 relative) in f32; FP8 states its own.
            assert!(
                (a - b).abs() <= tolerance * b.abs(),
                "{gemm:?} step {step}: tp={} loss {a} vs tp=1 loss {b}",
                ctx.groups.tp.size()
            );
        }
        assert!(twin[19] < twin[0], "the model learns: {} → {}", twin[0], twin[19]);
    });
}

const WINDOW: usize = 20;

/// Steps of the recipes' loss curves.
const CURVE_STEPS: u64 = 200;

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

/// On CUDA the optimizer keeps each new parameter value's amax, taken as its update writes it,
/// for the FP8 casts that read the value next: after a step every parameter's kept amax is the
/// amax pass's over the value the model holds, bit for bit, unsharded at dp 1 and under ZeRO-1 at
/// dp 2 (each shard's reduced over the group), kept in the model's notes (`Llama::amax_notes`);
/// a cast reads it without taking it. An optimizer not given the notes keeps nothing.
#[cfg(feature = "cuda")]
pub fn optimizer_keeps_weight_amaxes(h: &Harness) {
    use burn_megatron::optim::DistributedAdamWConfig;
    use burn_megatron_kernels::quant::kernels::fp8::amax;
    use burn_megatron_kernels::quant::notes::AmaxNotes;
    for (dp, zero1) in [(1, false), (2, true)] {
        h.run(ParallelDims::tp_dp(1, dp), |ctx| {
            let dev = ctx.device.clone().autodiff();
            let model = tiny(h, &ctx.groups, &dev, false);
            let notes = model.amax_notes();
            let config = DistributedAdamWConfig::new().with_zero1(zero1);
            let mut optim = config.init(&ctx.groups).keeping_amaxes(notes.clone());
            let (ids, targets) = batch(&dev, 0);
            let grads = GradientsParams::from_grads(model.forward_loss(ids, targets).unwrap().backward(), &model);
            let model = optim.step(3e-3, model.clone(), grads).unwrap().0;
            let bits = |t: Tensor<1>| t.into_scalar::<f32>().to_bits();
            let values = param_values(&model);
            for (i, p) in values.iter().enumerate() {
                let case = format!("dp {dp}, parameter {i} {:?}", p.dims);
                let kept = notes
                    .take(&p.value)
                    .unwrap_or_else(|| panic!("{case}: an amax is kept"));
                let n = p.value.dims()[0];
                assert_eq!(bits(kept), bits(amax(p.value.clone().reshape([1, n]))), "{case}");
                assert!(notes.take(&p.value).is_some(), "{case}: kept for the next cast");
            }
            let (model, notes) = (tiny(h, &ctx.groups, &dev, false), AmaxNotes::default());
            let mut optim = config.init(&ctx.groups);
            let (ids, targets) = batch(&dev, 0);
            let grads = GradientsParams::from_grads(model.forward_loss(ids, targets).unwrap().backward(), &model);
            let model = optim.step(3e-3, model.clone(), grads).unwrap().0;
            let stepped = param_values(&model);
            assert!(
                stepped
                    .iter()
                    .all(|p| notes.take(&p.value).is_none() && model.amax_notes().take(&p.value).is_none()),
                "an optimizer not given the notes keeps nothing"
            );
        });
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
            optim.step(1e-3, model.clone(), grads).unwrap().1.grad_norm()
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
