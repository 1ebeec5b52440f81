//! The pipeline suite: a Llama split over pp stages, each rank running its schedule's action
//! list, against the whole model on one rank: the mean loss over the microbatches and every
//! parameter's gradient after one step.

use std::collections::HashMap;

use burn::tensor::{Int, Tensor, TensorData};
use burn_megatron::init::{InitMode, ParamInit};
use burn_megatron::models::llama::LlamaConfig;
use burn_megatron::models::llama::pipeline::run_actions;
use burn_megatron::params::{param_grads, param_infos};
use burn_megatron::plan::PipelineSchedule;
use burn_megatron::plan::pipeline::stages::{rank_chunks, virtual_stages};
use burn_megatron::recompute::{Recompute, RecomputeMethod};
use burn_megatron_dist::ParallelDims;

use crate::Harness;
use crate::data::assert_close;

const SEQ: usize = 16;
const MICROBATCHES: usize = 4;

/// 4 blocks of d 32, 4 heads, ffn 64, vocabulary 64.
fn config() -> LlamaConfig {
    LlamaConfig::llama(64, 32, 4, 4, 4, 64, SEQ)
}

/// Microbatch `i`'s ids and targets, one sequence each.
fn batches(device: &burn::tensor::Device) -> Vec<(Tensor<2, Int>, Tensor<2, Int>)> {
    (0..MICROBATCHES as i64)
        .map(|i| {
            let ids: Vec<i64> = (0..=SEQ as i64).map(|t| (t * 7 + i * 13) % 64).collect();
            let all = Tensor::<2, Int>::from_data(TensorData::new(ids, [1, SEQ + 1]), device);
            (all.clone().narrow(1, 0, SEQ), all.narrow(1, 1, SEQ))
        })
        .collect()
}

/// Each parameter's gradient by path, as f32 host tensors.
type Grads = HashMap<String, Tensor<1>>;

/// 4 blocks as [`config`]'s, blocks 0 and 2 mixtures of 4 experts of ffn 32 (top 2) with
/// their load-balancing and z losses.
fn moe_config() -> LlamaConfig {
    use burn_megatron::layers::moe::{MoeConfig, RouterConfig};
    use burn_megatron::models::llama::MoeBlocks;
    let router = RouterConfig::new(32, 4, 2).with_aux_loss(1e-2).with_z_loss(1e-3);
    let mut model = config();
    model.moe = Some(MoeBlocks::new(MoeConfig::new(router, 32)).with_every(2));
    model
}

pub fn stages_match_one_rank(h: &Harness) {
    let full = Recompute::Full {
        method: RecomputeMethod::Uniform,
        layers: 2,
    };
    // Recomputation inside the stages: the regions' backward runs between the stage's sends.
    let cases = [
        (PipelineSchedule::GPipe, 2, Recompute::None),
        (PipelineSchedule::OneForwardOneBackward, 2, Recompute::None),
        (PipelineSchedule::OneForwardOneBackward, 4, Recompute::None),
        (PipelineSchedule::Interleaved { virtual_stages: 2 }, 2, Recompute::None),
        (PipelineSchedule::OneForwardOneBackward, 2, full),
        (
            PipelineSchedule::Interleaved { virtual_stages: 2 },
            2,
            Recompute::Selective,
        ),
    ];
    stages_match(h, config(), &cases);
}

/// MoE blocks in the stages: each chunk's router losses differentiated with its output where
/// it runs, and summed over the pipeline into the loss. At pp 2 one MoE block on each stage; at
/// pp 2 × vpp 2 both on the first rank and none on the last; at pp 4 a stage each.
pub fn moe_stages_match_one_rank(h: &Harness) {
    let cases = [
        (PipelineSchedule::OneForwardOneBackward, 2, Recompute::None),
        (PipelineSchedule::Interleaved { virtual_stages: 2 }, 2, Recompute::None),
        (PipelineSchedule::OneForwardOneBackward, 4, Recompute::Selective),
    ];
    stages_match(h, moe_config(), &cases);
    // What a stage cannot hold: typed errors before any tensor.
    use burn_megatron::error::{ConfigError, LayerError};
    use burn_megatron::models::llama::WordEmbeddings;
    let mut biased = moe_config();
    biased.moe.as_mut().expect("MoE blocks").layer.router.expert_bias = true;
    let mut tied = config();
    tied.word_embeddings = WordEmbeddings::Tied;
    h.run(ParallelDims::single(), |ctx| {
        let init = ParamInit::new(3, InitMode::Full);
        for (config, what) in [(&biased, "the expert bias"), (&tied, "tied word embeddings")] {
            let chunks = std::iter::once(0..2).collect();
            let refused = config.init_stage(chunks, (true, false), &ctx.device, &ctx.groups, &init);
            match refused {
                Err(LayerError::Config(ConfigError::AcrossStages { what: said })) => {
                    assert!(said.starts_with(what), "{said}")
                }
                other => panic!("{what}: {:?}", other.map(|_| "a stage")),
            }
        }
    });
}

/// The loss over the microbatches and every parameter's gradient of `config` split over the
/// stages of each case, against the whole model on one rank.
fn stages_match(h: &Harness, config: LlamaConfig, cases: &[(PipelineSchedule, usize, Recompute)]) {
    let init = ParamInit::new(3, InitMode::Full).with_dtype(h.float);
    let (reference_loss, reference) = h
        .run(ParallelDims::single(), |ctx| {
            let dev = ctx.device.clone().autodiff();
            let model = config.init(&dev, &ctx.groups, &init).unwrap();
            let loss = batches(&dev)
                .into_iter()
                .map(|(ids, targets)| {
                    model
                        .forward_loss(ids, targets)
                        .unwrap()
                        .div_scalar(MICROBATCHES as f64)
                })
                .reduce(|a, b| a + b)
                .unwrap();
            let grads = loss.backward();
            let by_path: Grads = param_infos(&model)
                .into_iter()
                .zip(param_grads(&model, &grads))
                .map(|(info, g)| (info.path, g.unwrap().to_device(&burn::tensor::Device::flex())))
                .collect();
            (loss.into_scalar::<f64>(), by_path)
        })
        .remove(0);
    for &(schedule, pp, recompute) in cases {
        let dims = ParallelDims {
            pp,
            ..ParallelDims::single()
        };
        let results = h.run(dims, |ctx| {
            let dev = ctx.device.clone().autodiff();
            let rank = ctx.groups.pp.group_rank();
            let stages = virtual_stages(4, pp, schedule.chunks(), None).unwrap();
            let chunks = rank_chunks(&stages, pp, rank);
            let ends = (rank == 0, rank == pp - 1);
            let stage = config
                .clone()
                .with_recompute(recompute)
                .init_stage(chunks, ends, &dev, &ctx.groups, &init)
                .unwrap();
            let actions = schedule.actions(pp, MICROBATCHES).unwrap();
            let step = run_actions(&stage, &actions.ranks[rank], &batches(&dev), &ctx.groups.pp).unwrap();
            let by_path: Grads = param_infos(&stage)
                .into_iter()
                .zip(step.grads)
                .map(|(info, g)| (info.path, g.unwrap().to_device(&burn::tensor::Device::flex())))
                .collect();
            (step.loss.map(|l| l.into_scalar::<f64>()), by_path)
        });
        let mut seen = 0;
        for (rank, (loss, grads)) in results.into_iter().enumerate() {
            if let Some(loss) = loss {
                // The same sums in another order: f32 rounding.
                assert!(
                    (loss - reference_loss).abs() <= 1e-5 * reference_loss.abs(),
                    "{schedule:?} pp {pp} {recompute:?}: loss {loss} vs {reference_loss}"
                );
            }
            for (path, grad) in grads {
                // Each microbatch's gradient summed after backward instead of inside it.
                let what = format!("{schedule:?} pp {pp} {recompute:?} rank {rank}: {path}");
                assert_close(&grad, &reference[&path], h.tolerance, &what);
                seen += 1;
            }
        }
        assert_eq!(
            seen,
            reference.len(),
            "{schedule:?} pp {pp}: every parameter on one stage"
        );
    }
}

/// 20 AdamW steps with gradients clipped to norm 1: the pipeline at pp 2 (1F1B) and pp 2 ×
/// vpp 2 (interleaved) against the whole model on one rank. The first step's gradient norm (over
/// every stage) within 1e-5 relative, every loss within 1e-3: the split sums differ by f32
/// rounding, which Adam carries from step to step (as in the model suite's steps).
pub fn steps_match_one_rank(h: &Harness) {
    use burn_megatron::models::llama::pipeline::train_step;
    use burn_megatron::optim::DistributedAdamWConfig;
    let init = ParamInit::new(3, InitMode::Full).with_dtype(h.float);
    let optim = || DistributedAdamWConfig::new().with_max_grad_norm(Some(1.0));
    let (reference, reference_norm) = h
        .run(ParallelDims::single(), |ctx| {
            let dev = ctx.device.clone().autodiff();
            let mut model = config().init(&dev, &ctx.groups, &init).unwrap();
            let mut adamw = optim().init(&ctx.groups);
            let mut first_norm = 0.0;
            let losses: Vec<f64> = (0..20)
                .map(|step| {
                    let loss = batches(&dev)
                        .into_iter()
                        .map(|(ids, targets)| {
                            model
                                .forward_loss(ids, targets)
                                .unwrap()
                                .div_scalar(MICROBATCHES as f64)
                        })
                        .reduce(|a, b| a + b)
                        .unwrap();
                    let value = loss.clone().into_scalar::<f64>();
                    let grads = burn::optim::GradientsParams::from_grads(loss.backward(), &model);
                    let report;
                    (model, report) = adamw.step(3e-3, model.clone(), grads).unwrap();
                    if step == 0 {
                        first_norm = report.grad_norm;
                    }
                    value
                })
                .collect();
            (losses, first_norm)
        })
        .remove(0);
    assert!(reference[19] < reference[0], "the model learns");
    for schedule in [
        PipelineSchedule::OneForwardOneBackward,
        PipelineSchedule::Interleaved { virtual_stages: 2 },
    ] {
        let dims = ParallelDims {
            pp: 2,
            ..ParallelDims::single()
        };
        let results = h.run(dims, |ctx| {
            let dev = ctx.device.clone().autodiff();
            let rank = ctx.groups.pp.group_rank();
            let stages = virtual_stages(4, 2, schedule.chunks(), None).unwrap();
            let ends = (rank == 0, rank == 1);
            let mut stage = config()
                .init_stage(rank_chunks(&stages, 2, rank), ends, &dev, &ctx.groups, &init)
                .unwrap();
            let actions = schedule.actions(2, MICROBATCHES).unwrap();
            let mut adamw = optim().init(&ctx.groups);
            let mut norms = Vec::new();
            let losses: Vec<Option<f64>> = (0..20)
                .map(|_| {
                    let (next, report) = train_step(
                        stage.clone(),
                        &mut adamw,
                        3e-3,
                        &actions.ranks[rank],
                        &batches(&dev),
                        &ctx.groups.pp,
                    )
                    .unwrap();
                    stage = next;
                    norms.push(report.optim.grad_norm);
                    // Each forward and backward timed inside the step.
                    assert!(report.timing.busy_s > 0.0 && report.timing.busy_s <= report.timing.total_s);
                    report.loss.map(|l| l.into_scalar::<f64>())
                })
                .collect();
            (losses, norms[0])
        });
        for (losses, norm) in results {
            assert!(
                (norm - reference_norm).abs() <= 1e-5 * reference_norm,
                "{schedule:?}: first gradient norm {norm} vs {reference_norm}"
            );
            for (step, (ours, theirs)) in losses.iter().zip(&reference).enumerate() {
                if let Some(ours) = ours {
                    assert!(
                        (ours - theirs).abs() <= 1e-3 * theirs.abs(),
                        "{schedule:?}: step {step} loss {ours} vs {theirs}"
                    );
                }
            }
        }
    }
}
