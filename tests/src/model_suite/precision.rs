//! The model under low-precision recipes against bf16 and f32: each recipe's loss curve within
//! its band, and delayed scaling's amax histories (their steps, and each on its own layer).

use super::*;
use crate::Harness;
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use burn_megatron::init::{InitMode, ParamInit};
use burn_megatron::models::llama::{Llama, recipes};
use burn_megatron::precision::PrecisionPolicy;
use burn_megatron_dist::ParallelDims;
use burn_megatron_kernels::Gemm;
use burn_megatron_kernels::quant::recipe::Recipe;

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
            let wq = &model.layers[0].attention.as_ref().unwrap().wq;
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
