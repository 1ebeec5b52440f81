//! The pipeline suite: a Llama split over pp stages, each rank running its schedule's action
//! list, against the whole model on one rank: the mean loss over the microbatches and every
//! parameter's gradient after one step.

use std::collections::HashMap;

use burn::tensor::{Int, Tensor, TensorData};
use burn_megatron::init::{InitMode, ParamInit};
use burn_megatron::models::llama::LlamaConfig;
use burn_megatron::models::llama::MoeReport;
use burn_megatron::params::{ParamInfo, param_grads, param_infos, param_values};
use burn_megatron::plan::PipelineSchedule;
use burn_megatron::plan::pipeline::stages::{rank_chunks, virtual_stages};
use burn_megatron::recompute::{Recompute, RecomputeMethod};
use burn_megatron::train::TokenBatch;
use burn_megatron::train::pipeline::{Timing, run_actions};
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

/// The gradients of the parameters gradients train, by path, on the host.
fn trained(infos: Vec<ParamInfo>, grads: Vec<Option<Tensor<1>>>) -> Grads {
    infos
        .into_iter()
        .zip(grads)
        .filter(|(info, _)| info.trainable)
        .map(|(info, g)| {
            (
                info.path,
                g.expect("a gradient").to_device(&burn::tensor::Device::flex()),
            )
        })
        .collect()
}

/// The router biases (DeepSeek-V3's expert bias) of `model`'s MoE blocks, by path.
fn biases<M: burn::module::Module>(model: &M) -> HashMap<String, Vec<f32>> {
    param_infos(model)
        .into_iter()
        .zip(param_values(model))
        .filter(|(info, _)| info.path.ends_with("router.bias"))
        .map(|(info, p)| {
            (
                info.path,
                p.value.into_data().convert::<f32>().try_to_vec::<f32>().expect("f32"),
            )
        })
        .collect()
}

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
    // DeepSeek-V3's expert bias: each stage's blocks moved by their own loads summed over the
    // microbatches, as the whole model's by the whole batch's.
    let mut biased = moe_config();
    biased.moe.as_mut().expect("MoE blocks").layer.router.expert_bias = true;
    let cases = [
        (PipelineSchedule::OneForwardOneBackward, 2, Recompute::None),
        (PipelineSchedule::Interleaved { virtual_stages: 2 }, 2, Recompute::None),
    ];
    stages_match(h, biased, &cases);
}

/// Tied word embeddings: the embedding on the first stage, its copy as the output layer on
/// the last; their two gradients (the lookup's and the output product's) add up to the whole
/// model's, at pp 2, pp 2 × vpp 2 and pp 4.
pub fn tied_stages_match_one_rank(h: &Harness) {
    let cases = [
        (PipelineSchedule::OneForwardOneBackward, 2, Recompute::None),
        (PipelineSchedule::Interleaved { virtual_stages: 2 }, 2, Recompute::None),
        (PipelineSchedule::OneForwardOneBackward, 4, Recompute::None),
    ];
    stages_match(h, tied_config(), &cases);
}

/// [`config`] with the output layer tied to the embedding.
fn tied_config() -> LlamaConfig {
    config().with_word_embeddings(burn_megatron::models::llama::WordEmbeddings::Tied)
}

/// The loss over the microbatches and every parameter's gradient of `config` split over the
/// stages of each case, against the whole model on one rank; a parameter two stages hold
/// (tied embeddings) against the sum of their gradients.
fn stages_match(h: &Harness, config: LlamaConfig, cases: &[(PipelineSchedule, usize, Recompute)]) {
    let init = ParamInit::new(3, InitMode::Full).with_dtype(h.float);
    let reference_loss = h
        .run(ParallelDims::single(), |ctx| {
            let dev = ctx.device.clone().autodiff();
            let model = config.init(&dev, &ctx.groups, &init).unwrap();
            let mut loads = MoeReport::default();
            let loss = batches(&dev)
                .into_iter()
                .map(|(ids, targets)| {
                    let (loss, report) = model.forward_loss_report(ids, targets).unwrap();
                    loads.add_loads(&report);
                    loss.div_scalar(MICROBATCHES as f64)
                })
                .reduce(|a, b| a + b)
                .unwrap();
            let grads = loss.backward();
            let by_path = trained(param_infos(&model), param_grads(&model, &grads));
            let model = model.update_expert_bias(&loads, &ctx.groups).unwrap();
            (loss.into_scalar::<f64>(), by_path, biases(&model))
        })
        .remove(0);
    let (reference_loss, reference, reference_biases) = (reference_loss.0, reference_loss.1, reference_loss.2);
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
            let step = run_actions(
                &stage,
                &actions.ranks[rank],
                &batches(&dev)
                    .into_iter()
                    .map(|(ids, targets)| TokenBatch::new(ids, targets))
                    .collect::<Vec<_>>(),
                &ctx.groups.pp,
                Timing::Off,
            )
            .unwrap();
            let by_path = trained(param_infos(&stage), step.grads);
            let stage = stage.update_expert_bias(&step.loads, &ctx.groups).unwrap();
            (step.loss.map(|l| l.into_scalar::<f64>()), by_path, biases(&stage))
        });
        let mut summed = Grads::new();
        for (loss, grads, biases) in results {
            for (path, bias) in biases {
                // Sign steps from the same whole-batch counts: the same bits.
                assert_eq!(
                    bias, reference_biases[&path],
                    "{schedule:?} pp {pp}: {path} after the step"
                );
            }
            if let Some(loss) = loss {
                // The same sums in another order: f32 rounding.
                assert!(
                    (loss - reference_loss).abs() <= 1e-5 * reference_loss.abs(),
                    "{schedule:?} pp {pp} {recompute:?}: loss {loss} vs {reference_loss}"
                );
            }
            for (path, grad) in grads {
                let sum = match summed.remove(&path) {
                    Some(other) => other + grad,
                    None => grad,
                };
                summed.insert(path, sum);
            }
        }
        assert_eq!(
            summed.len(),
            reference.len(),
            "{schedule:?} pp {pp}: every parameter on a stage"
        );
        for (path, grad) in summed {
            // Each microbatch's gradient summed after backward instead of inside it.
            let what = format!("{schedule:?} pp {pp} {recompute:?}: {path}");
            assert_close(&grad, &reference[&path], h.tolerance, &what);
        }
    }
}

/// 20 AdamW steps with gradients clipped to norm 1: the pipeline at pp 2 (1F1B) and pp 2 ×
/// vpp 2 (interleaved) against the whole model on one rank. The first step's gradient norm (over
/// every stage) within 1e-5 relative, every loss within 1e-3: the split sums differ by f32
/// rounding, which Adam carries from step to step (as in the model suite's steps). With tied
/// embeddings the norm counts the embedding once, and its two copies stay equal to the bit.
pub fn steps_match_one_rank(h: &Harness) {
    steps_match(h, config());
    steps_match(h, tied_config());
}

fn steps_match(h: &Harness, config: LlamaConfig) {
    use burn_megatron::optim::DistributedAdamWConfig;
    use burn_megatron::train::{TokenBatch, Trainer};
    let init = ParamInit::new(3, InitMode::Full).with_dtype(h.float);
    let optim = || DistributedAdamWConfig::new().with_max_grad_norm(Some(1.0));
    let (reference, reference_norm) = h
        .run(ParallelDims::single(), |ctx| {
            let dev = ctx.device.clone().autodiff();
            let mut model = config.init(&dev, &ctx.groups, &init).unwrap();
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
                        first_norm = report.grad_norm();
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
            let stage = config
                .init_stage(rank_chunks(&stages, 2, rank), ends, &dev, &ctx.groups, &init)
                .unwrap()
                .with_schedule(schedule, MICROBATCHES, &ctx.groups.pp)
                .unwrap();
            let mut trainer = Trainer::new(stage, &optim(), &ctx.groups, &ctx.device).with_timing(Timing::Synchronized);
            // The microbatches as one batch, which the stage's schedule cuts again.
            let (ids, targets): (Vec<_>, Vec<_>) = batches(&dev).into_iter().unzip();
            let batch = TokenBatch::new(Tensor::cat(ids, 0), Tensor::cat(targets, 0));
            let mut norms = Vec::new();
            let losses: Vec<Option<f64>> = (0..20)
                .map(|_| {
                    let stepped = trainer.step(3e-3, batch.clone()).unwrap();
                    norms.push(stepped.norm.clone().expect("a norm").into_scalar::<f64>());
                    // Each forward and backward timed inside the step.
                    let timing = stepped.timing.expect("a stage's timing");
                    let busy = timing.busy_s.expect("timed");
                    assert!(busy > 0.0 && busy <= timing.total_s);
                    // Every stage holds the last one's loss.
                    Some(stepped.loss.into_scalar::<f64>())
                })
                .collect();
            let stage = trainer.into_parts().0;
            let embedding = stage.embedding.map(|e| e.weight.val().into_data());
            (losses, norms[0], embedding)
        });
        if config.word_embeddings == burn_megatron::models::llama::WordEmbeddings::Tied {
            let copies: Vec<_> = results.iter().filter_map(|r| r.2.clone()).collect();
            assert_eq!(copies.len(), 2, "{schedule:?}: the embedding on both ends");
            assert_eq!(copies[0], copies[1], "{schedule:?}: the tied copies after 20 steps");
        }
        for (losses, norm, _) in results {
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

/// What a stage cannot be, each a typed error before any step: chunks without blocks or past
/// the model's, a schedule of another chunk count, loads that are not one a MoE block, a step
/// without a schedule, a batch that does not split into the microbatches.
pub fn bad_stages_are_errors(h: &Harness) {
    use burn_megatron::error::{ConfigError, LayerError};
    fn config_error<T>(result: Result<T, LayerError>) -> ConfigError {
        match result {
            Err(LayerError::Config(e)) => e,
            Err(other) => panic!("{other}"),
            Ok(_) => panic!("accepted"),
        }
    }
    h.run(ParallelDims::single(), |ctx| {
        let dev = ctx.device.clone().autodiff();
        let init = ParamInit::new(3, InitMode::Full);
        let stage =
            |chunks: Vec<std::ops::Range<usize>>| config().init_stage(chunks, (true, true), &dev, &ctx.groups, &init);
        assert!(matches!(config_error(stage(vec![])), ConfigError::Zero { .. }));
        assert!(matches!(
            config_error(stage(vec![0..2, 2..2])),
            ConfigError::Zero { .. }
        ));
        assert_eq!(
            config_error(stage(std::iter::once(0..5).collect())),
            ConfigError::StageBlocks { end: 5, blocks: 4 }
        );
        let whole = stage(std::iter::once(0..4).collect()).unwrap();
        let interleaved = PipelineSchedule::Interleaved { virtual_stages: 2 };
        assert_eq!(
            whole.clone().with_schedule(interleaved, 2, &ctx.groups.pp).unwrap_err(),
            ConfigError::StageChunks { schedule: 2, stage: 1 }
        );
        let (ids, targets) = batches(&dev).remove(0);
        assert!(matches!(
            config_error(burn_megatron::train::pipeline::scheduled_step(
                &whole,
                TokenBatch::new(ids.clone(), targets.clone()),
                Timing::Off
            )),
            ConfigError::NoSchedule
        ));
        let experts = moe_config().init_stage(std::iter::once(0..4).collect(), (true, true), &dev, &ctx.groups, &init);
        assert_eq!(
            config_error(experts.unwrap().update_expert_bias(&[], &ctx.groups)),
            ConfigError::LoadsPerBlock { loads: 0, blocks: 2 }
        );
        let scheduled = whole
            .with_schedule(PipelineSchedule::OneForwardOneBackward, 2, &ctx.groups.pp)
            .unwrap();
        assert_eq!(
            config_error(burn_megatron::train::pipeline::scheduled_step(
                &scheduled,
                TokenBatch::new(ids, targets),
                Timing::Off
            )),
            ConfigError::MicrobatchSplit {
                sequences: 1,
                microbatches: 2
            }
        );
    });
}
