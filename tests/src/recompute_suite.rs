//! The recomputation suite: the tiny Llama (4 blocks) with selective and full recomputation
//! against the same model keeping every activation, at tp = 1 and at the harness's tp with
//! sequence parallelism: the loss and every parameter gradient, then 5 AdamW steps.

use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_megatron::init::{InitMode, ParamInit};
use burn_megatron::models::llama::{Llama, LlamaConfig, recipes};
use burn_megatron::params::param_grads;
use burn_megatron::plan::{ParallelPlan, TensorParallel};
use burn_megatron::recompute::{Recompute, RecomputeMethod};
use burn_megatron_dist::{ParallelDims, ProcessGroups};

use crate::Harness;
use crate::data::assert_close;

const SEQ: usize = 32;
const BATCH: usize = 2;

/// Every choice the suite runs, the first keeping everything.
fn choices() -> [Recompute; 5] {
    let full = |method, layers| Recompute::Full { method, layers };
    [
        Recompute::None,
        Recompute::Selective,
        full(RecomputeMethod::Uniform, 1),
        full(RecomputeMethod::Uniform, 3),
        full(RecomputeMethod::Block, 2),
    ]
}

/// The tiny preset (4 blocks) planned for `groups.tp` (with SP above 1), recomputing as asked.
fn config(groups: &ProcessGroups, recompute: Recompute) -> LlamaConfig {
    let tp = groups.tp.size();
    let tensor = match tp {
        1 => TensorParallel::Plain,
        _ => TensorParallel::SequenceParallel,
    };
    let plan = ParallelPlan::new(ParallelDims::tp_dp(tp, 1)).with_tensor(tensor);
    let mut model = recipes::tiny().model;
    model.n_layers = 4;
    let config = plan.apply(model, tp, SEQ).expect("tiny plans at every tp ≤ 4");
    config.with_recompute(recompute)
}

fn model(h: &Harness, groups: &ProcessGroups, device: &Device, recompute: Recompute) -> Llama {
    config(groups, recompute)
        .init(device, groups, &ParamInit::new(5, InitMode::Full).with_dtype(h.float))
        .expect("init")
}

/// Token ids and next-token targets, the same on every rank.
fn batch(device: &Device, step: u64) -> (Tensor<2, Int>, Tensor<2, Int>) {
    let n = BATCH * (SEQ + 1);
    let ids: Vec<i64> = (0..n as u64)
        .map(|i| ((i * 2654435761 + step * 31) % 512) as i64)
        .collect();
    let all = Tensor::<2, Int>::from_data(TensorData::new(ids, [BATCH, SEQ + 1]), device);
    (all.clone().narrow(1, 0, SEQ), all.narrow(1, 1, SEQ))
}

/// One choice's loss, every gradient (traversal order) and the losses of 5 AdamW steps.
type Run = (f64, Vec<Tensor<1>>, Vec<f64>);

fn run(h: &Harness, groups: &ProcessGroups, device: &Device, recompute: Recompute) -> Run {
    let mut model = model(h, groups, device, recompute);
    let (ids, targets) = batch(device, 0);
    let loss = model.forward_loss(ids, targets).unwrap();
    let value = loss.clone().into_scalar::<f64>();
    let grads = param_grads(&model, &loss.backward())
        .into_iter()
        .map(|g| g.expect("every parameter reaches the loss").to_device(&Device::flex()))
        .collect();
    let mut optim = AdamWConfig::new().with_epsilon(1e-8).init();
    let losses = (1..=5)
        .map(|step| {
            let (ids, targets) = batch(device, step);
            let loss = model.forward_loss(ids, targets).unwrap();
            let value = loss.clone().into_scalar::<f64>();
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(3e-3, model.clone(), grads);
            value
        })
        .collect();
    (value, grads, losses)
}

/// Each choice against keeping every activation, at tp = 1 and at the harness's tp with SP.
/// The recomputed regions run the same kernels on the same values, so only the order in which
/// a gradient's pieces are added differs: f32 rounding (the harness's tolerance).
pub fn recomputation_matches_keeping(h: &Harness) {
    for dims in [ParallelDims::single(), h.tp_world()] {
        let results = h.run(dims, |ctx| {
            let device = ctx.device.clone().autodiff();
            choices().map(|choice| run(h, &ctx.groups, &device, choice))
        });
        for (rank, runs) in results.into_iter().enumerate() {
            let [(loss, grads, losses), rest @ ..] = runs;
            for (choice, (other_loss, other_grads, other_losses)) in choices()[1..].iter().zip(rest) {
                let what = format!("tp {} rank {rank} {choice:?}", dims.tp);
                assert!(
                    (loss - other_loss).abs() <= h.tolerance * loss.abs(),
                    "{what}: loss {other_loss} vs {loss}"
                );
                for (i, (a, b)) in other_grads.iter().zip(&grads).enumerate() {
                    assert_close(a, b, h.tolerance, &format!("{what}: parameter {i}"));
                }
                for (step, (a, b)) in other_losses.iter().zip(&losses).enumerate() {
                    // Adam carries a gradient's last bits from step to step (f32: 1e-4; bf16's
                    // roundings, the harness's product tolerance).
                    let tolerance = h.matmul_tolerance.max(1e-4);
                    assert!(
                        (a - b).abs() <= tolerance * b.abs(),
                        "{what}: step {} loss {a} vs {b}",
                        step + 1
                    );
                }
            }
        }
    }
}

/// Bad choices are typed errors before any tensor: no blocks, more blocks than the model has,
/// and full recomputation of a mixture of experts.
pub fn bad_recomputation(h: &Harness) {
    use burn_megatron::error::{ConfigError, LayerError};
    let groups = ProcessGroups::single();
    let device = h.device(0).autodiff();
    let init = ParamInit::new(5, InitMode::Full);
    for layers in [0, 5] {
        let choice = Recompute::Full {
            method: RecomputeMethod::Block,
            layers,
        };
        match config(&groups, choice).init(&device, &groups, &init) {
            Err(LayerError::Config(ConfigError::RecomputeLayers { layers: l, n_layers: 4 })) => assert_eq!(l, layers),
            other => panic!("{layers} blocks: {:?}", other.err()),
        }
    }
    let full = Recompute::Full {
        method: RecomputeMethod::Uniform,
        layers: 1,
    };
    let moe = recipes::preset("tiny-moe")
        .expect("tiny-moe")
        .model
        .with_recompute(full);
    assert!(matches!(
        moe.init(&device, &groups, &init),
        Err(LayerError::Config(ConfigError::RecomputeMoe))
    ));
}
