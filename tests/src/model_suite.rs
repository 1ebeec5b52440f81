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

/// 200 AdamW steps of the tiny model under every low-precision recipe (emulated on the CPU),
/// against the same model in the harness's float dtype: each learns as fast within its band
/// ([`band`], on windows of [`WINDOW`] steps), differs (the products were quantized) and repeats
/// bit for bit; a promoted recipe's curve is its fast twin's (checked on its first steps).
/// `CURVES_OUT=path` writes the curves as a table.
pub fn quantized_recipes_track_the_curve(h: &Harness) -> Vec<(Recipe, Vec<f64>, Vec<f64>)> {
    let losses = |gemm: Gemm, steps: u64| -> Vec<f64> {
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
            adamw_curve(model, &dev, steps, 1e-3)
        })
        .remove(0)
    };
    let plain = losses(Gemm::Burn, CURVE_STEPS);
    let mut curves: Vec<(Recipe, Vec<f64>)> = Vec::new();
    for recipe in Recipe::ALL {
        // The CPU's products are f32 throughout, so a promoted recipe (its fast twin's
        // quantizers, `Recipe::promotes`) trains its twin's curve bit for bit: its first steps
        // show it, rather than 200 more (a curve is about a minute, this binary's longest test).
        // On a GPU, whose promoted products sum otherwise, this check would fail, not pass.
        let twin = match recipe {
            Recipe::Fp8TensorwisePromoted => Some(Recipe::Fp8Tensorwise),
            Recipe::Fp8TensorwiseE4m3Promoted => Some(Recipe::Fp8TensorwiseE4m3),
            _ => None,
        };
        let curve = match twin.and_then(|twin| curves.iter().find(|(r, _)| *r == twin)) {
            Some((twin, curve)) => {
                let first = losses(Gemm::Quantized(recipe), 5);
                assert_eq!(first, curve[..5], "{recipe:?} trains as {twin:?} on the CPU");
                curve.clone()
            }
            None => losses(Gemm::Quantized(recipe), CURVE_STEPS),
        };
        curves.push((recipe, curve));
    }
    if let Ok(path) = std::env::var("CURVES_OUT") {
        let mut text = String::from("step f32");
        for (recipe, _) in &curves {
            text += &format!(" {}", recipe.name());
        }
        for step in 0..CURVE_STEPS as usize {
            text += &format!("\n{step} {}", plain[step]);
            for (_, curve) in &curves {
                text += &format!(" {}", curve[step]);
            }
        }
        std::fs::write(path, text + "\n").expect("the curves written");
    }
    for (recipe, ours) in &curves {
        let band = band(*recipe);
        for (window, (a, b)) in windows(&plain).zip(windows(ours)).enumerate() {
            assert!(
                (a - b).abs() <= band,
                "{recipe:?} steps {}..{}: f32 mean loss {a}, quantized {b}, band {band} nats",
                window * WINDOW,
                (window + 1) * WINDOW
            );
        }
        let last = CURVE_STEPS as usize - 1;
        assert!(
            ours[last] < 0.5 * ours[0],
            "{recipe:?} learns: {} → {}",
            ours[0],
            ours[last]
        );
        assert!(
            plain.iter().zip(ours).any(|(a, b)| a != b),
            "{recipe:?} quantized nothing"
        );
        // Deterministic: the same first steps again, bit for bit (stochastic rounding too).
        let again = losses(Gemm::Quantized(*recipe), 5);
        assert_eq!(again, ours[..5], "{recipe:?} repeats");
    }
    curves
        .into_iter()
        .map(|(recipe, ours)| (recipe, plain.clone(), ours))
        .collect()
}

/// The means of successive windows of [`WINDOW`] losses: the tiny model's loss spikes on single
/// steps (FP8 tensorwise was 15% below f32 at step 98, 1% on its window of 20).
fn windows(losses: &[f64]) -> impl Iterator<Item = f64> + '_ {
    losses.chunks(WINDOW).map(|w| w.iter().sum::<f64>() / w.len() as f64)
}

const WINDOW: usize = 20;

/// Steps of the recipes' loss curves.
const CURVE_STEPS: u64 = 200;

/// How far a recipe's windowed loss may stray from f32's, in nats. The tiny model falls from
/// ln 1024 ≈ 6.9 to about 0.5 in 200 steps, the last 50 steeply (up to 0.1 nats a step), and a
/// quantized run keeps pace within a few steps: on this machine the windows' largest gaps were
/// 0.11 (FP8 tensorwise), 0.08 (tensorwise with E4M3 gradients), 0.06 (blockwise), 0.30
/// (MXFP8, 3 steps ahead at the end) and 0.17 nats (NVFP4). The bands allow 5 steps of lag for FP8 and 10 for FP4 at the steepest; a recipe
/// that stops learning misses them by nats.
fn band(recipe: Recipe) -> f64 {
    match recipe {
        Recipe::Nvfp4 => 1.0,
        _ => 0.5,
    }
}

/// Delayed FP8 scaling (a history of 4) at dp = 2, each rank its own half batch, 3 steps with
/// the distributed optimizer: every layer's history holds the steps' amaxes newest first,
/// the same on both ranks (the maximum over dp), and the optimizer leaves it alone (its entries
/// are amaxes, not weights moved by Adam); a checkpoint holds it, and a fresh model loads it.
pub fn delayed_scaling_histories(h: &Harness) {
    use burn_megatron::checkpoint;
    use burn_megatron::optim::DistributedAdamWConfig;
    use burn_megatron_kernels::quant::recipe::AmaxAlgo;
    let dir = std::env::temp_dir().join(format!("burn-megatron-delayed-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let recipe = Recipe::Fp8Delayed {
        history: 4,
        algo: AmaxAlgo::Max,
    };
    h.run(ParallelDims::tp_dp(1, 2), |ctx| {
        let dev = ctx.device.clone().autodiff();
        let mut model = tiny_with(h, &ctx.groups, &dev, false, Gemm::Quantized(recipe));
        let mut optim = DistributedAdamWConfig::new().init(&ctx.groups);
        let history = |model: &Llama| -> Vec<f32> {
            let wq = &model.layers[0].attention.wq;
            wq.precision
                .amax_history
                .as_ref()
                .expect("a history")
                .val()
                .into_data()
                .convert::<f32>()
                .try_to_vec()
                .unwrap()
        };
        assert_eq!(history(&model), vec![0.0; 12], "an empty history first");
        let mut seen = Vec::new();
        for step in 0..3 {
            let (ids, targets) = batch(&dev, step);
            let r = ctx.groups.dp.group_rank();
            let loss = model
                .forward_loss(ids.narrow(0, r, 1), targets.narrow(0, r, 1))
                .unwrap();
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(1e-3, model.clone(), grads).unwrap().0;
            burn_megatron::precision::linear::advance_histories(
                model
                    .layers
                    .iter_mut()
                    .flat_map(burn_megatron::models::llama::LlamaBlock::linear_precisions),
                &ctx.groups,
            )
            .unwrap();
            seen.push(history(&model));
        }
        // [3, 4] rows input, weight, output gradient; newest first: step 2's column 1 is step
        // 1's column 0, and so on; the oldest column still empty after 3 steps.
        for row in 0..3 {
            let at = |step: usize, column: usize| seen[step][row * 4 + column];
            assert!(
                at(2, 0) > 0.0 && at(2, 1) > 0.0 && at(2, 2) > 0.0 && at(2, 3) == 0.0,
                "{:?}",
                seen[2]
            );
            assert_eq!(at(2, 1), at(1, 0));
            assert_eq!(at(2, 2), at(0, 0));
        }
        let values = Tensor::<1>::from_floats(seen[2].as_slice(), &ctx.device);
        let (hi, lo) = (
            ctx.groups
                .dp
                .all_reduce(values.clone(), burn_megatron_dist::ReduceOp::Max)
                .unwrap(),
            ctx.groups
                .dp
                .all_reduce(values.neg(), burn_megatron_dist::ReduceOp::Max)
                .unwrap()
                .neg(),
        );
        assert_eq!(hi.into_data(), lo.into_data(), "the ranks' histories agree");
        checkpoint::save(&dir, 3, &model, &optim, &ctx.groups).unwrap();
        let fresh = tiny_with(h, &ctx.groups, &dev, false, Gemm::Quantized(recipe));
        let mut fresh_optim = DistributedAdamWConfig::new().init(&ctx.groups);
        let (loaded, _) = checkpoint::load(&dir, fresh, &mut fresh_optim, &ctx.groups).unwrap();
        assert_eq!(history(&loaded), seen[2], "the checkpoint holds the history");
    });
    let _ = std::fs::remove_dir_all(&dir);
}

/// Delayed scaling at dp = 2 with the same sequence on both ranks gives every layer's history,
/// bit for bit, as one rank does: `advance` reduces all layers' amaxes in one collective, and
/// each must land on its own layer (a row on the wrong layer, or a layer's rows shifted, would
/// show; `delayed_scaling_histories` checks one layer's with different data on each rank).
pub fn delayed_histories_land_on_their_layers(h: &Harness) {
    use burn_megatron::optim::DistributedAdamWConfig;
    use burn_megatron_kernels::quant::recipe::AmaxAlgo;
    let recipe = Recipe::Fp8Delayed {
        history: 4,
        algo: AmaxAlgo::Max,
    };
    let histories = |dp: usize| {
        h.run(ParallelDims::tp_dp(1, dp), |ctx| {
            let dev = ctx.device.clone().autodiff();
            let mut model = tiny_with(h, &ctx.groups, &dev, false, Gemm::Quantized(recipe));
            let mut optim = DistributedAdamWConfig::new().init(&ctx.groups);
            for step in 0..2 {
                let (ids, targets) = batch(&dev, step);
                let loss = model
                    .forward_loss(ids.narrow(0, 0, 1), targets.narrow(0, 0, 1))
                    .unwrap();
                let grads = GradientsParams::from_grads(loss.backward(), &model);
                model = optim.step(1e-3, model.clone(), grads).unwrap().0;
                burn_megatron::precision::linear::advance_histories(
                    model
                        .layers
                        .iter_mut()
                        .flat_map(burn_megatron::models::llama::LlamaBlock::linear_precisions),
                    &ctx.groups,
                )
                .unwrap();
            }
            let mut all: Vec<Vec<f32>> = Vec::new();
            for block in model.layers.iter_mut() {
                for precision in block.linear_precisions() {
                    if let Some(history) = &precision.amax_history {
                        all.push(history.val().into_data().convert::<f32>().try_to_vec().unwrap());
                    }
                }
            }
            all
        })
    };
    let one = histories(1).remove(0);
    assert_eq!(one.len(), 14, "two blocks of seven delayed layers");
    assert!(
        one.windows(2).any(|pair| pair[0] != pair[1]),
        "the layers' histories differ from one another"
    );
    for (rank, two) in histories(2).into_iter().enumerate() {
        assert_eq!(two, one, "rank {rank} of dp = 2 against one rank");
    }
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
