//! Burn's `SupervisedTraining` driven by [`MegatronStrategy`]: one epoch at tp2 × dp2 against
//! the same epoch at tp1 × dp1, for each way the strategy can reduce and step.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::data::dataset::InMemDataset;
use burn::optim::AdamWConfig;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn::train::metric::LossMetric;
use burn::train::{Learner, SupervisedTraining, TrainingStrategy};
use burn_megatron::init::{InitMode, ParamInit};
use burn_megatron::models::llama::{Llama, LlamaConfig};
use burn_megatron::optim::{BucketConfig, DistributedAdamWConfig};
use burn_megatron::params::{param_infos, param_values};
use burn_megatron::plan::{ParallelPlan, PipelineSchedule, TensorParallel};
use burn_megatron::train::TokenBatch;
use burn_megatron::train::learner::{LmOutput, MegatronStrategy, Silent, StrategyOptimizer, TokenBatcher};
use burn_megatron_dist::{ParallelDims, RankContext};

use crate::Harness;

const SEQ: usize = 16;
const VOCAB: usize = 64;
/// Sequences in the epoch; the global batch is 4, so 4 steps.
const ITEMS: usize = 16;
const GLOBAL_BATCH: usize = 4;

/// How the strategy is set up in one run.
#[derive(Clone, Debug)]
pub struct Setup {
    optimizer: StrategyOptimizer,
    overlap: bool,
    /// Small buckets, so that a step reduces several.
    bucket_bytes: usize,
}

fn sequences() -> Vec<Vec<u32>> {
    (0..ITEMS as u32)
        .map(|i| {
            (0..=SEQ as u32)
                .map(|t| (i * 7 + t * t * 3 + t) % VOCAB as u32)
                .collect()
        })
        .collect()
}

/// The epoch's sequences in the order one rank of `dp` reads them, so that step `k` of the
/// single-rank run sees the union of the dp ranks' step-`k` batches.
fn in_dp_order(items: Vec<Vec<u32>>, dp: usize) -> Vec<Vec<u32>> {
    if dp != 1 {
        return items;
    }
    let (half, per) = (ITEMS / 2, GLOBAL_BATCH / 2);
    (0..ITEMS / GLOBAL_BATCH)
        .flat_map(|k| {
            let first = items[k * per..(k + 1) * per].iter();
            let second = items[half + k * per..half + (k + 1) * per].iter();
            first.chain(second).cloned().collect::<Vec<_>>()
        })
        .collect()
}

fn model(ctx: &RankContext, device: &Device) -> Llama {
    seeded_model(ctx, device, 11)
}

fn seeded_model(ctx: &RankContext, device: &Device, seed: u64) -> Llama {
    let dims = ParallelDims::tp_dp(ctx.groups.tp.size(), ctx.groups.dp.size());
    let config = LlamaConfig::llama(VOCAB, 64, 2, 4, 4, 128, SEQ);
    let config = ParallelPlan::new(dims)
        .with_tensor(TensorParallel::SequenceParallel)
        .apply(config, dims.world_size(), SEQ)
        .unwrap();
    config
        .init(device, &ctx.groups, &ParamInit::new(seed, InitMode::Full))
        .unwrap()
}

/// The loss of the epoch's first two sequences.
fn eval_loss(model: &Llama, device: &Device) -> f64 {
    let ids: Vec<i64> = sequences()[..2].iter().flatten().map(|&t| t as i64).collect();
    let all = Tensor::<2, Int>::from_data(TensorData::new(ids, [2, SEQ + 1]), device);
    model
        .forward_loss(all.clone().narrow(1, 0, SEQ), all.narrow(1, 1, SEQ))
        .unwrap()
        .into_scalar::<f64>()
}

fn scratch(name: &str, rank: usize) -> PathBuf {
    std::env::temp_dir().join(format!("burn-megatron-learner-{name}-{}-{rank}", std::process::id()))
}

/// One epoch through `SupervisedTraining` on every rank of `dims`; each rank's loss on two
/// training sequences before and after.
fn train(h: &Harness, dims: ParallelDims, setup: &Setup) -> Vec<(f64, f64)> {
    h.run(dims, |ctx| {
        let device = ctx.device.clone();
        // Built on the autodiff device, as for Burn's own strategies: parameters made on a
        // plain device are not trainable after `fork`.
        let initial = model(&ctx, &device.clone().autodiff());
        let before = eval_loss(&initial, &device);
        let trained = fit_model(&ctx, initial, setup, in_dp_order(sequences(), ctx.groups.dp.size()));
        (before, eval_loss(&trained, &device.clone().autodiff()))
    })
}

fn check(h: &Harness, setup: Setup) {
    let single = train(h, ParallelDims::tp_dp(1, 1), &setup)[0];
    let parallel = train(h, ParallelDims::tp_dp(2, 2), &setup);
    assert!(
        single.1 < single.0,
        "one epoch lowers the loss on two training sequences: {single:?}"
    );
    for (rank, (before, after)) in parallel.into_iter().enumerate() {
        assert!(
            (before - single.0).abs() <= h.matmul_tolerance * single.0,
            "rank {rank}: the same initial model"
        );
        // Averaging two half-batch gradients instead of one whole-batch gradient, and tp's
        // split products, reorder f32 sums; Adam carries that rounding through 4 steps (see
        // `model_suite::adamw_steps_match`): 10× the split-product tolerance.
        assert!(
            (after - single.1).abs() <= 10.0 * h.matmul_tolerance * single.1,
            "rank {rank}: loss on two training sequences {after} after the epoch at tp2 × dp2, {} at tp1 × dp1",
            single.1
        );
    }
}

/// The Learner's own optimizer (Burn's AdamW), buckets reduced from inside backward.
pub fn learner_optimizer_overlapped(h: &Harness) {
    check(
        h,
        Setup {
            optimizer: StrategyOptimizer::Learner,
            overlap: true,
            bucket_bytes: 64 * 1024,
        },
    );
}

/// The Learner's own optimizer, buckets reduced after backward.
pub fn learner_optimizer_after_backward(h: &Harness) {
    check(
        h,
        Setup {
            optimizer: StrategyOptimizer::Learner,
            overlap: false,
            bucket_bytes: 64 * 1024,
        },
    );
}

/// The distributed optimizer with ZeRO-1, overlapped reduce-scatters.
pub fn distributed_optimizer_zero1(h: &Harness) {
    let config = DistributedAdamWConfig::new()
        .with_zero1(true)
        .with_max_grad_norm(Some(1.0));
    check(
        h,
        Setup {
            optimizer: StrategyOptimizer::Distributed(config),
            overlap: true,
            bucket_bytes: 64 * 1024,
        },
    );
}

/// Burn's own checkpointers under the strategy: two epochs at tp2 × dp2 with the default
/// checkpointers (every rank its own directory, its own shard), then a fresh run from another
/// seed resumed at epoch 1 — model, optimizer and scheduler come back, and the second epoch
/// ends where it ended the first time.
pub fn burn_checkpointers_resume(h: &Harness) {
    let dims = ParallelDims::tp_dp(2, 2);
    let run = |seed: u64, resume: Option<usize>| {
        h.run(dims, |ctx| {
            let device = ctx.device.clone().autodiff();
            let dp = ctx.groups.dp.size();
            let loader = |items: Vec<Vec<u32>>| -> Arc<dyn DataLoader<TokenBatch>> {
                DataLoaderBuilder::new(TokenBatcher)
                    .batch_size(GLOBAL_BATCH / dp)
                    .build(InMemDataset::new(items))
            };
            let mut training = SupervisedTraining::new(
                scratch("checkpointers", ctx.global_rank),
                loader(sequences()),
                loader(sequences()[..GLOBAL_BATCH].to_vec()),
            )
            .metrics((LossMetric::new(),))
            .num_epochs(2)
            .with_default_checkpointers()
            .with_application_logger(None)
            .renderer(Box::new(Silent))
            .with_training_strategy(TrainingStrategy::Custom(Arc::new(MegatronStrategy::new(&ctx))));
            if let Some(epoch) = resume {
                training = training.checkpoint(epoch);
            }
            let optim = AdamWConfig::new().with_epsilon(1e-8).with_weight_decay(0.01).init();
            let result = training.launch(Learner::new(seeded_model(&ctx, &device, seed), optim, 3e-3));
            assert!(result.error.is_none(), "training failed: {:?}", result.error);
            eval_loss(&result.model, &device)
        })
    };
    let straight = run(11, None);
    let resumed = run(99, Some(1));
    for d in 0..4 {
        let _ = std::fs::remove_dir_all(scratch("checkpointers", d));
    }
    for (rank, (a, b)) in resumed.iter().zip(&straight).enumerate() {
        // The same layout replays the same epoch from the same state: only the checkpoint's
        // round trip of f32 values stands between them, which is exact.
        assert!(
            (a - b).abs() <= 1e-6 * b.abs(),
            "rank {rank}: resumed {a} vs straight {b}"
        );
    }
}

/// Pipeline stages under the Learner: one epoch with the strategy at pp 2 (tied embeddings,
/// Burn's AdamW; 1F1B over 2 microbatches), pp 2 × dp 2 (interleaved over 2 chunks of 1
/// block, the distributed optimizer with ZeRO-1 and clipping) and pp 2 × cp 2 (each sequence's
/// chunks over cp inside the stages), against the whole model at pp 1 with the same optimizer:
/// every stage's parameters after the epoch by path, and the validation loss every stage
/// reports.
pub fn pipeline_stages_match_one_rank(h: &Harness) {
    let distributed = StrategyOptimizer::Distributed(
        DistributedAdamWConfig::new()
            .with_zero1(true)
            .with_max_grad_norm(Some(1.0)),
    );
    let cases = [
        (
            1,
            1,
            PipelineSchedule::OneForwardOneBackward,
            2,
            true,
            StrategyOptimizer::Learner,
        ),
        (
            2,
            1,
            PipelineSchedule::Interleaved { virtual_stages: 2 },
            4,
            false,
            distributed.clone(),
        ),
        (1, 2, PipelineSchedule::OneForwardOneBackward, 2, false, distributed),
    ];
    for (dp, cp, schedule, layers, tied, optimizer) in cases {
        let setup = Setup {
            optimizer,
            overlap: true,
            bucket_bytes: 64 * 1024,
        };
        let config = pipeline_config(layers, tied);
        let single = &h.run(ParallelDims::single(), |ctx| {
            let device = ctx.device.clone().autodiff();
            let model = config
                .init(&device, &ctx.groups, &ParamInit::new(11, InitMode::Full))
                .unwrap();
            fit(&ctx, model, &setup, in_dp_order(sequences(), 1))
        })[0];
        let dims = ParallelDims {
            pp: 2,
            cp,
            ..ParallelDims::tp_dp(1, dp)
        };
        let plan = ParallelPlan::new(dims).with_pipeline(schedule);
        let staged_config = plan.apply(config.clone(), dims.world_size(), SEQ).unwrap();
        let staged = h.run(dims, |ctx| {
            let device = ctx.device.clone().autodiff();
            let init = ParamInit::new(11, InitMode::Full);
            let stage = staged_config
                .init_planned_stage(&plan, 2, &device, &ctx.groups, &init)
                .unwrap();
            fit(&ctx, stage, &setup, in_dp_order(sequences(), dp))
        });
        // Every stage reports the pipeline's loss, each rank its share (a cp rank's chunks
        // weighed so that the mean over dp × cp is the batch's mean): the same batch through
        // the same weights (to 1e-4, below), f32 sums in another order.
        let valid = staged.iter().map(|r| r.1).sum::<f64>() / staged.len() as f64;
        assert!(
            (valid - single.1).abs() <= 1e-3 * single.1,
            "{schedule:?} dp {dp} cp {cp}: valid loss {valid} vs {}",
            single.1
        );
        for (rank, (params, _)) in staged.iter().enumerate() {
            let what = format!("{schedule:?} dp {dp} cp {cp} rank {rank}");
            for (path, value) in params {
                let whole = &single.0[path];
                let worst = value.iter().zip(whole).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                // Gradients summed over microbatches (and averaged over dp) instead of one
                // batch's: f32 rounding carried through 4 Adam steps, measured ≤ 4e-6. One step
                // moves an element by up to lr = 3e-3, so a lost, doubled or missing update (a
                // microbatch, the tied copy's gradient) shows 30× above 1e-4.
                assert!(worst <= 1e-4, "{what}: {path} off by {worst}");
            }
        }
    }
}

/// [`seeded_model`]'s sizes with `layers` blocks, optionally tied, without tensor parallelism.
fn pipeline_config(layers: usize, tied: bool) -> LlamaConfig {
    let config = LlamaConfig::llama(VOCAB, 64, layers, 4, 4, 128, SEQ);
    match tied {
        true => config.with_word_embeddings(burn_megatron::models::llama::WordEmbeddings::Tied),
        false => config,
    }
}

/// One epoch of `model` under the strategy on this rank (its dp slice of `items`), then every
/// parameter's values by path and the loss the trained model's inference step gives on the
/// first two sequences.
fn fit<M>(ctx: &RankContext, model: M, setup: &Setup, items: Vec<Vec<u32>>) -> (HashMap<String, Vec<f32>>, f64)
where
    M: burn::train::LearnerModel
        + burn_megatron::train::TrainModel
        + burn::train::TrainStep<Input = TokenBatch, Output = LmOutput>
        + burn::train::InferenceStep<Input = TokenBatch, Output = LmOutput>,
{
    let trained = fit_model(ctx, model, setup, items);
    let batch = TokenBatcher.batch(sequences()[..2].to_vec(), &ctx.device);
    let valid = burn::train::InferenceStep::step(&trained.valid(), batch);
    (values_by_path(&trained), valid.loss.into_scalar::<f64>())
}

/// One epoch of `model` under the strategy as `setup` says on this rank, its dp slice of
/// `items`; validation on the first global batch. Returns the trained model.
fn fit_model<M>(ctx: &RankContext, model: M, setup: &Setup, items: Vec<Vec<u32>>) -> M
where
    M: burn::train::LearnerModel
        + burn_megatron::train::TrainModel
        + burn::train::TrainStep<Input = TokenBatch, Output = LmOutput>
        + burn::train::InferenceStep<Input = TokenBatch, Output = LmOutput>,
{
    let dp = ctx.groups.dp.size();
    let loader = |items: Vec<Vec<u32>>| -> Arc<dyn DataLoader<TokenBatch>> {
        DataLoaderBuilder::new(TokenBatcher)
            .batch_size(GLOBAL_BATCH / dp)
            .build(InMemDataset::new(items))
    };
    let strategy = MegatronStrategy::new(ctx)
        .with_optimizer(setup.optimizer.clone())
        .with_overlap(setup.overlap)
        .with_buckets(BucketConfig::new().with_bytes(setup.bucket_bytes));
    // Burn's AdamW with PyTorch's ε and weight decay, like `DistributedAdamWConfig`'s.
    let optim = AdamWConfig::new().with_epsilon(1e-8).with_weight_decay(0.01).init();
    let dir = scratch("epoch", ctx.global_rank);
    let result = SupervisedTraining::new(&dir, loader(items), loader(sequences()[..GLOBAL_BATCH].to_vec()))
        .metrics((LossMetric::new(),))
        .num_epochs(1)
        .with_application_logger(None)
        .renderer(Box::new(Silent))
        .with_training_strategy(TrainingStrategy::Custom(Arc::new(strategy)))
        .launch(Learner::new(model, optim, 3e-3));
    let _ = std::fs::remove_dir_all(&dir);
    assert!(result.error.is_none(), "training failed: {:?}", result.error);
    result.model
}

/// What moves outside the gradient after each step, under the strategy through the training
/// step's `TrainModel::after_step`: 4 blocks, 2 of them mixtures of 4 experts with
/// DeepSeek-V3's expert bias, every linear layer in delayed FP8 (a history of 4). One epoch
/// through the Learner against the same 4 steps by hand (forward, the distributed optimizer,
/// `update_expert_bias`, `advance_histories`): every parameter, the biases and histories among
/// them, by path. At pp 1 the same operations in the same order (exact); at pp 2 against the
/// steps by hand over the same 2 microbatches, the sums in another order (1e-4, as
/// [`pipeline_stages_match_one_rank`]).
pub fn after_step_moves_biases_and_histories(h: &Harness) {
    use burn_megatron::layers::moe::{MoeConfig, RouterConfig};
    use burn_megatron::models::llama::MoeBlocks;
    use burn_megatron::precision::PrecisionPolicy;
    use burn_megatron_kernels::Gemm;
    use burn_megatron_kernels::quant::recipe::{AmaxAlgo, Recipe};
    let router = RouterConfig::new(64, 4, 2).with_aux_loss(1e-2).with_expert_bias(true);
    let mut config = pipeline_config(4, false);
    config.moe = Some(MoeBlocks::new(MoeConfig::new(router, 64)).with_every(2));
    let recipe = Recipe::Fp8Delayed {
        history: 4,
        algo: AmaxAlgo::Max,
    };
    let config = PrecisionPolicy::f32().with_gemm(Gemm::Quantized(recipe)).apply(config);
    let init = ParamInit::new(11, InitMode::Full);
    let optimizer = DistributedAdamWConfig::new();
    let setup = Setup {
        optimizer: StrategyOptimizer::Distributed(optimizer.clone()),
        overlap: true,
        bucket_bytes: 64 * 1024,
    };
    // By hand over `m` microbatches a step: their losses' mean differentiated once (a
    // pipeline's router losses are each microbatch's, as Megatron's), their loads summed.
    let by_hand = |m: usize| {
        h.run(ParallelDims::single(), |ctx| {
            let device = ctx.device.clone().autodiff();
            let mut model = config.init(&device, &ctx.groups, &init).unwrap();
            let mut optim = optimizer.init(&ctx.groups);
            for batch in sequences().chunks(GLOBAL_BATCH) {
                let mut report = burn_megatron::models::llama::MoeReport::default();
                let loss = batch
                    .chunks(GLOBAL_BATCH / m)
                    .map(|micro| {
                        let micro = TokenBatcher.batch(micro.to_vec(), &device);
                        let (loss, r) = model.forward_loss_report(micro.ids, micro.targets).unwrap();
                        report.add_loads(&r);
                        loss.div_scalar(m as f64)
                    })
                    .reduce(|a, b| a + b)
                    .unwrap();
                let grads = burn::optim::GradientsParams::from_grads(loss.backward(), &model);
                model = optim.step(3e-3, model, grads).unwrap().0;
                model = model.update_expert_bias(&report, &ctx.groups).unwrap();
                burn_megatron::precision::linear::advance_histories(
                    model
                        .layers
                        .iter_mut()
                        .flat_map(burn_megatron::models::llama::LlamaBlock::linear_precisions),
                    &ctx.groups,
                )
                .unwrap();
            }
            values_by_path(&model)
        })
        .remove(0)
    };
    let moved = |params: &HashMap<String, Vec<f32>>, by_hand: &HashMap<String, Vec<f32>>, what: &str, tolerance| {
        for (path, value) in params {
            let worst = value
                .iter()
                .zip(&by_hand[path])
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(worst <= tolerance, "{what}: {path} off by {worst}");
        }
    };
    let whole_batch = by_hand(1);
    let whole = h
        .run(ParallelDims::single(), |ctx| {
            let device = ctx.device.clone().autodiff();
            let model = config.init(&device, &ctx.groups, &init).unwrap();
            fit(&ctx, model, &setup, sequences()).0
        })
        .remove(0);
    moved(&whole, &whole_batch, "pp 1", 0.0);
    let history = "layers.0.attention.wq.precision.amax_history";
    assert!(
        whole_batch[history].iter().any(|&a| a > 0.0),
        "by hand: {history} holds the steps' amaxes"
    );
    let microbatched = by_hand(2);
    let dims = ParallelDims {
        pp: 2,
        ..ParallelDims::single()
    };
    let plan = ParallelPlan::new(dims);
    let staged = h.run(dims, |ctx| {
        let device = ctx.device.clone().autodiff();
        let stage = config
            .init_planned_stage(&plan, 2, &device, &ctx.groups, &init)
            .unwrap();
        fit(&ctx, stage, &setup, sequences()).0
    });
    for (rank, params) in staged.iter().enumerate() {
        moved(params, &microbatched, &format!("pp 2 rank {rank}"), 1e-4);
    }
}

/// Every parameter's values by path.
fn values_by_path<M: burn::module::Module>(model: &M) -> HashMap<String, Vec<f32>> {
    param_infos(model)
        .into_iter()
        .zip(param_values(model))
        .map(|(info, p)| {
            (
                info.path,
                p.value.into_data().convert::<f32>().try_to_vec::<f32>().expect("f32"),
            )
        })
        .collect()
}
