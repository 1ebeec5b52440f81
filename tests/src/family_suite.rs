//! The model families beside Llama against transformers: the fixtures `make_family_fixtures.py`
//! wrote with transformers 5.25 (Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE; `tests/fixtures/hf/`)
//! loaded at the harness's tp, with and without sequence parallelism, the MoE families also with
//! their experts over ep; against transformers' loss, logits, every gradient norm and greedy
//! generation; exported and read back bit for bit; trained 20 steps at tp 2 × dp 2 (ep 2, pp 2)
//! with the losses of one rank; and what a family cannot build refused by name.
//!
//! Legend: `b` batch, `s` sequence, `v` vocabulary (99), `v'` this rank's padded share.

use std::path::Path;

use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_megatron::init::{InitMode, ParamInit};
use burn_megatron::layers::context::ContextLayout;
use burn_megatron::models::llama::generate::{GenerateConfig, Sampling, generate};
use burn_megatron::models::llama::hf::{self, ExportDType, ExportOptions, HfError};
use burn_megatron::models::llama::{Llama, LlamaConfig, MtpConfig};
use burn_megatron::optim::DistributedAdamWConfig;
use burn_megatron::params::{param_grads, param_infos};
use burn_megatron::plan::{ParallelPlan, PipelineSchedule, TensorParallel};
use burn_megatron::precision::PrecisionPolicy;
use burn_megatron::train::{TokenBatch, TrainModel, Trainer};
use burn_megatron::{ConfigError, LayerError};
use burn_megatron_dist::{ParallelDims, ProcessGroups, ReduceOp};
use burn_megatron_kernels::Gemm;
use burn_megatron_kernels::quant::recipe::Recipe;
use serde_json::Value;

use crate::Harness;
use crate::hf_suite::{batch, expected, fixture};

const SEQ: usize = 16;
const VOCAB: usize = 99;

/// How a fixture is laid out over the harness's ranks.
#[derive(Clone, Copy, Debug)]
enum Layout {
    /// tp over every rank, plain or with sequence parallelism (a MoE block's experts split
    /// along their hidden features over tp, every rank holding every expert).
    Tensor { sp: bool },
    /// tp with sequence parallelism over every rank and the experts over the same ranks (ep,
    /// each expert whole: etp 1).
    Experts,
    /// Context parallelism over every rank (ring attention): each rank its chunks of every
    /// sequence.
    Context,
}

impl Layout {
    fn dims(self, world: usize) -> ParallelDims {
        match self {
            Self::Tensor { .. } => ParallelDims::tp_dp(world, 1),
            Self::Experts => ParallelDims {
                ep: world,
                etp: Some(1),
                ..ParallelDims::tp_dp(world, 1)
            },
            Self::Context => ParallelDims {
                cp: world,
                ..ParallelDims::single()
            },
        }
    }

    fn tensor(self) -> TensorParallel {
        match self {
            Self::Tensor { sp: false } | Self::Context => TensorParallel::Plain,
            _ => TensorParallel::SequenceParallel,
        }
    }
}

/// The fixture's configuration planned for `layout` over `world` ranks.
fn planned(dir: &Path, layout: Layout, world: usize) -> LlamaConfig {
    let dims = layout.dims(world);
    let config = hf::config(dir).expect("the fixture's config builds");
    ParallelPlan::new(dims)
        .with_tensor(layout.tensor())
        .apply(config, dims.world_size(), SEQ)
        .unwrap()
}

/// The fixture loaded into a model planned for `layout`, initialized from another seed first
/// (every value must come from the checkpoint).
fn loaded(dir: &Path, layout: Layout, groups: &ProcessGroups, device: &Device) -> (Llama, LlamaConfig) {
    let config = planned(dir, layout, groups.world.size());
    let model = config
        .init(device, groups, &ParamInit::new(11, InitMode::Full))
        .unwrap();
    (hf::load(dir, model, groups).unwrap(), config)
}

fn max_abs(values: impl Iterator<Item = f64>) -> f64 {
    values.fold(0.0, |m, v| m.max(v.abs()))
}

/// Fixture `name` at `layout`: the loss, the logits and every gradient's norm against
/// transformers'.
fn matches_at(h: &Harness, name: &str, layout: Layout) {
    let (dir, expected) = (fixture(name), expected(name));
    let config = hf::read_config(&dir).unwrap();
    h.run(layout.dims(h.world), |ctx| {
        let dev = ctx.device.clone().autodiff();
        let g = &ctx.groups;
        let (model, _) = loaded(&dir, layout, g, &dev);
        let (ids, targets) = batch(&expected, &dev);
        // Under context parallelism each rank reads its chunks; its loss is scaled so that the
        // mean over cp is the whole batch's, and so are its gradients.
        let chunks = ContextLayout::new(&g.cp);
        let (ids, targets) = (chunks.shard(ids, 1).unwrap(), chunks.shard(targets, 1).unwrap());
        let (logits, _) = model.forward_report(ids).unwrap(); // [b, s, v']
        let loss = model.loss.forward(logits.clone(), targets).unwrap();
        let grads = loss.backward();
        let loss = g.cp.all_reduce(loss, ReduceOp::Avg).unwrap();
        let what = format!("{name} {layout:?} world {}", h.world);

        // transformers' f32 sums in another order, as for the Llama fixtures (hf_suite): measured
        // up to 2e-7 relative in the loss; 1e-5. Without the q/k norms (or the biases) the loss
        // moves by more than 1e-2, so the test sees a missing layer choice.
        let loss = loss.into_scalar::<f64>();
        let want = expected["loss"].as_f64().unwrap();
        assert!((loss - want).abs() <= 1e-5 * want, "{what}: loss {loss} vs {want}");

        // Under sequence parallelism each rank's logits are its tokens' whole vocabulary share;
        // under context parallelism its chunks', which the loss and gradients cover.
        let logits = g.tp.all_gather(logits.detach(), 2).unwrap().narrow(2, 0, VOCAB); // [b, s, v]
        if g.cp.size() > 1 {
            return check_grad_norms(&model, &grads, g, &config, &expected, &what);
        }
        check_logits(logits, &expected, &what);
        check_grad_norms(&model, &grads, g, &config, &expected, &what);
    });
}

/// The logits `[b, s, v]` (every rank's whole vocabulary) against transformers'.
pub(crate) fn check_logits(logits: Tensor<3>, expected: &Value, what: &str) {
    let ours = logits.into_data().convert::<f64>().try_into_vec::<f64>().unwrap();
    let theirs: Vec<f64> = expected["logits"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|b| b.as_array().unwrap().iter())
        .flat_map(|s| s.as_array().unwrap().iter().map(|v| v.as_f64().unwrap()))
        .collect();
    assert_eq!(ours.len(), theirs.len(), "{what}: logits");
    let scale = max_abs(theirs.iter().copied());
    let worst = max_abs(ours.iter().zip(&theirs).map(|(a, b)| a - b));
    // transformers' f32 sums in another order, element by element: measured 1.5e-6 of the
    // largest logit on the Llama fixtures; 1e-5 of it.
    assert!(
        worst <= 1e-5 * scale,
        "{what}: logits differ by {worst:e} (scale {scale:e})"
    );
}

/// Every trained parameter's gradient norm against transformers' (by its name in the file): a
/// split parameter's squares summed over its ranks (experts over etp and ep, the rest over tp),
/// each gradient averaged over cp first (each cp rank's is its chunks').
pub(crate) fn check_grad_norms(
    model: &Llama,
    grads: &burn::tensor::Gradients,
    g: &ProcessGroups,
    config: &hf::HfConfig,
    expected: &Value,
    what: &str,
) {
    let norms = expected["grad_norms"].as_object().unwrap();
    let infos = param_infos(model);
    // A router's selection bias is no trained parameter (transformers' is a buffer).
    let trained = infos.iter().filter(|info| info.trainable).count();
    assert_eq!(trained, norms.len(), "{what}: parameters {infos:?}");
    for (info, grad) in infos.iter().zip(param_grads(model, grads)) {
        if !info.trainable {
            continue;
        }
        let grad = grad.expect("every parameter takes part in the loss");
        let grad = g.cp.all_reduce(grad, ReduceOp::Avg).unwrap();
        let mut squares = grad.clone().mul(grad).sum();
        if info.expert {
            squares = g.etp.all_reduce(squares, ReduceOp::Sum).unwrap();
            squares = g.ep.all_reduce(squares, ReduceOp::Sum).unwrap();
        } else if info.tp_split {
            squares = g.tp.all_reduce(squares, ReduceOp::Sum).unwrap();
        }
        let norm = squares.into_scalar::<f64>().sqrt();
        let (file_name, want) = norms
            .iter()
            .find(|(n, _)| hf::our_path_in(config, n).as_deref() == Some(info.path.as_str()))
            .unwrap_or_else(|| panic!("{what}: no transformers gradient for {}", info.path));
        let want = want.as_f64().unwrap();
        // The reordered sums through the backward pass, a norm averaging their rounding
        // (hf_suite measured 6e-7 relative); 1e-5.
        assert!(
            (norm - want).abs() <= 1e-5 * want,
            "{what}: |grad {file_name}| {norm} vs {want}"
        );
    }
}

/// Fixture `name` at tp over every rank, plain and with sequence parallelism; a MoE family's
/// also with its experts over ep.
fn matches_transformers(h: &Harness, name: &str) {
    for sp in [false, true] {
        matches_at(h, name, Layout::Tensor { sp });
    }
    let choices = hf::read_config(&fixture(name)).unwrap().choices;
    if choices.moe.is_some() {
        matches_at(h, name, Layout::Experts);
    }
    // One dense family and latent attention (its q/k and v of unequal widths) under cp.
    if name == "mistral" || choices.latent.is_some() {
        matches_at(h, name, Layout::Context);
    }
}

/// Mistral: grouped-query attention within a window longer than the batch's sequences.
pub fn mistral_matches_transformers(h: &Harness) {
    matches_transformers(h, "mistral");
}

/// Qwen2: biases on q, k and v (split over tp with their columns), tied embeddings.
pub fn qwen2_matches_transformers(h: &Harness) {
    matches_transformers(h, "qwen2");
}

/// Qwen3: each head's q and k RMS-normalized before the rotation (one weight for every head,
/// its gradient summed over the tp ranks' heads), heads wider than the model's width allows.
pub fn qwen3_matches_transformers(h: &Harness) {
    matches_transformers(h, "qwen3");
}

/// Mixtral: 4 experts a block, softmax top 2 renormalized, read from the file's per-expert
/// tensors into our stacks.
pub fn mixtral_matches_transformers(h: &Harness) {
    matches_transformers(h, "mixtral");
}

/// Qwen3-MoE: Qwen3's attention with experts of their own hidden size.
pub fn qwen3_moe_matches_transformers(h: &Harness) {
    matches_transformers(h, "qwen3_moe");
}

/// DeepSeek-V3: multi-head latent attention (heads split over tp, the latents' down projections
/// and norms whole on every rank, its gradients summed over tp) with YaRN's mscale, the rotated
/// dims read from interleaved pairs; a dense first block, then sigmoid-scored experts with a
/// selection bias, group-limited top 2, scaled, and a shared expert.
pub fn deepseek_v3_matches_transformers(h: &Harness) {
    matches_transformers(h, "deepseek_v3");
}

/// Qwen3's fixture (tied: the embedding on the first stage and, as the output layer, on the
/// last) and DeepSeek-V3's (latent attention, a dense block then an MoE one) loaded stage by
/// stage at pp 2 × tp 2, each stage reading its own blocks' tensors (`hf::load_stage`), have
/// transformers' loss and whole gradient norm on the fixture's batch, in two microbatches.
pub fn families_load_at_pp(h: &Harness) {
    let dims = ParallelDims {
        pp: 2,
        ..ParallelDims::tp_dp(2, 1)
    };
    let plan = ParallelPlan::new(dims).with_tensor(TensorParallel::SequenceParallel);
    for name in ["qwen3", "deepseek_v3"] {
        let (dir, expected) = (fixture(name), expected(name));
        let planned = plan.apply(hf::config(&dir).unwrap(), dims.world_size(), SEQ).unwrap();
        let reports = h.run(dims, |ctx| {
            let (g, device) = (&ctx.groups, ctx.device.clone().autodiff());
            let init = ParamInit::new(11, InitMode::Full);
            let stage = planned.init_planned_stage(&plan, 2, &device, g, &init).unwrap();
            let stage = hf::load_stage(&dir, stage, &planned, g).unwrap();
            // Clipping only to have the norm reported; no step moves a weight at lr 0.
            let optim = DistributedAdamWConfig::new().with_max_grad_norm(Some(1.0));
            let mut trainer = Trainer::new(stage, &optim, g, &ctx.device);
            let (ids, targets) = batch(&expected, &device);
            let stepped = trainer.step(0.0, TokenBatch::new(ids, targets)).unwrap();
            let values = trainer.read(stepped).unwrap();
            (values.loss, values.grad_norm.unwrap())
        });
        // Every rank reads the last stage's loss and the norm over every stage.
        let norms = expected["grad_norms"].as_object().unwrap().values();
        let norm = norms.map(|n| n.as_f64().unwrap().powi(2)).sum::<f64>().sqrt();
        let loss = expected["loss"].as_f64().unwrap();
        for (rank, (ours, our_norm)) in reports.into_iter().enumerate() {
            // As `matches_at`'s: transformers' f32 sums in another order (2e-7 measured), here
            // also the mean of two microbatches' means; a tensor read from another stage's
            // slice or left at its initial value moves the loss by more than 1e-2.
            assert!(
                (ours - loss).abs() <= 1e-5 * loss,
                "{name} rank {rank}: loss {ours} vs {loss}"
            );
            // The squares of every gradient summed over the stages and tp in f32: 1e-4.
            assert!(
                (our_norm - norm).abs() <= 1e-4 * norm,
                "{name} rank {rank}: gradient norm {our_norm} vs {norm}"
            );
        }
    }
}

/// Every family's greedy generation after the fixture's prompt, through the KV cache (prefill,
/// then decoding steps), is transformers' `generate` token for token, at tp over every rank.
pub fn families_generate_as_transformers(h: &Harness) {
    for name in FAMILIES {
        let (dir, expected) = (fixture(name), expected(name));
        let tokens = |key: &str| -> Vec<u32> {
            let values = expected[key].as_array().unwrap();
            values.iter().map(|v| v.as_u64().unwrap() as u32).collect()
        };
        let (prompt, want) = (tokens("prompt"), tokens("greedy"));
        let outputs = h.run(h.tp_world(), |ctx| {
            let (model, _) = loaded(&dir, Layout::Tensor { sp: false }, &ctx.groups, &ctx.device);
            let config = GenerateConfig {
                max_new_tokens: want.len(),
                sampling: Sampling::Greedy,
                stop: Vec::new(),
                pad: 0,
                seed: 0,
                graphs: false,
            };
            let prompts = [prompt.clone()];
            generate(&model, &ctx.groups.tp, &prompts, &config, &ctx.device)
                .unwrap()
                .tokens
        });
        for tokens in outputs {
            assert_eq!(tokens, std::slice::from_ref(&want), "{name} at tp {}", h.world);
        }
    }
}

/// The fixtures of `make_family_fixtures.py`.
const FAMILIES: [&str; 6] = ["mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "deepseek_v3"];

/// Every family loaded at tp over every rank (a MoE family's experts over ep) and exported in
/// f32: the same tensors as the fixture's file bit for bit, under the same names, and a
/// `config.json` that reads back as the fixture's.
pub fn families_export_round_trip(h: &Harness) {
    for name in FAMILIES {
        let dir = fixture(name);
        let moe = hf::read_config(&dir).unwrap().choices.moe.is_some();
        let layout = if moe {
            Layout::Experts
        } else {
            Layout::Tensor { sp: true }
        };
        let out = std::env::temp_dir().join(format!("burn-megatron-family-export-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&out);
        h.run(layout.dims(h.world), |ctx| {
            let (model, config) = loaded(&dir, layout, &ctx.groups, &ctx.device);
            hf::save(&out, &model, &config, &ctx.groups, &ExportOptions::new()).unwrap();
        });
        assert_same_checkpoint(&out, &dir, name);
        let _ = std::fs::remove_dir_all(&out);
    }
}

/// The export in `out` is the fixture in `dir`: a `config.json` that reads back as the
/// fixture's, the same tensors bit for bit under the same names.
fn assert_same_checkpoint(out: &Path, dir: &Path, name: &str) {
    let (theirs, ours) = (
        std::fs::read(dir.join("model.safetensors")).unwrap(),
        std::fs::read(out.join("model.safetensors")).unwrap(),
    );
    let (theirs, ours) = (
        safetensors::SafeTensors::deserialize(&theirs).unwrap(),
        safetensors::SafeTensors::deserialize(&ours).unwrap(),
    );
    // transformers writes DeepSeek-V3's default `num_nextn_predict_layers` (1) with no module in
    // the file; an export says how many modules it holds (blocks past `num_hidden_layers`).
    let mut want = hf::read_config(dir).unwrap();
    let blocks: std::collections::BTreeSet<usize> = theirs
        .names()
        .iter()
        .filter_map(|n| n.strip_prefix("model.layers.")?.split('.').next()?.parse().ok())
        .collect();
    want.choices.mtp_layers = blocks.len() - want.num_hidden_layers;
    assert_eq!(hf::read_config(out).unwrap(), want, "{name}: config.json");
    let mut names = ours.names();
    names.sort();
    let mut want = theirs.names();
    want.sort();
    assert_eq!(names, want, "{name}: tensor names");
    for tensor in names {
        let (a, b) = (ours.tensor(tensor).unwrap(), theirs.tensor(tensor).unwrap());
        assert_eq!((a.shape(), a.dtype()), (b.shape(), b.dtype()), "{name}: {tensor}");
        assert!(a.data() == b.data(), "{name}: {tensor} differs");
    }
}

/// DeepSeek-V3's fixture with a multi-token prediction module in DeepSeek's file layout
/// (`make_mtp_fixture.py`: the module written out around transformers' own decoder layer)
/// loaded into a model of one module at the fixture's weight, at tp over every rank with and
/// without sequence parallelism: the main, multi-token and total losses and every gradient's
/// norm, the module's own included, are the definition's; exported, it is the fixture's file bit
/// for bit. A model without modules leaves the file's out (the main loss); one of two modules is
/// refused.
pub fn deepseek_v3_mtp_matches_its_definition(h: &Harness) {
    let (dir, expected) = (fixture("deepseek_v3_mtp"), expected("deepseek_v3_mtp"));
    let file = hf::read_config(&dir).unwrap();
    let weight = expected["loss_weight"].as_f64().unwrap();
    let with_modules = |depth: usize, layout: Layout| {
        let dims = layout.dims(h.world);
        let config = hf::config(&dir)
            .unwrap()
            .with_mtp((depth > 0).then(|| MtpConfig::new(depth).with_loss_weight(weight)));
        ParallelPlan::new(dims)
            .with_tensor(layout.tensor())
            .apply(config, dims.world_size(), SEQ)
            .unwrap()
    };
    let out = std::env::temp_dir().join(format!("burn-megatron-mtp-export-{}-{}", h.world, std::process::id()));
    for sp in [false, true] {
        let layout = Layout::Tensor { sp };
        let config = with_modules(1, layout);
        h.run(layout.dims(h.world), |ctx| {
            let (g, dev) = (&ctx.groups, ctx.device.clone().autodiff());
            let model = config.init(&dev, g, &ParamInit::new(11, InitMode::Full)).unwrap();
            let model = hf::load(&dir, model, g).unwrap();
            let (ids, targets) = batch(&expected, &dev);
            let (loss, report) = model.forward_loss_report(ids, targets).unwrap();
            let grads = loss.backward();
            let what = format!("deepseek_v3_mtp sp {sp} tp {}", h.world);
            let mtp = report.mtp.unwrap().into_scalar::<f64>() / weight;
            // As `matches_at`'s losses: transformers' f32 sums in another order; 1e-5.
            for (ours, key) in [(mtp, "mtp_loss"), (loss.into_scalar::<f64>(), "loss")] {
                let want = expected[key].as_f64().unwrap();
                assert!((ours - want).abs() <= 1e-5 * want, "{what}: {key} {ours} vs {want}");
            }
            check_grad_norms(&model, &grads, g, &file, &expected, &what);
            if sp {
                hf::save(&out, &model, &config, g, &ExportOptions::new()).unwrap();
            }
        });
    }
    assert_same_checkpoint(&out, &dir, "deepseek_v3_mtp");
    let _ = std::fs::remove_dir_all(&out);

    let layout = Layout::Tensor { sp: false };
    let (without, two) = (with_modules(0, layout), with_modules(2, layout));
    h.run(layout.dims(h.world), |ctx| {
        let (g, dev) = (&ctx.groups, &ctx.device);
        let init = ParamInit::new(11, InitMode::Full);
        let model = hf::load(&dir, without.init(dev, g, &init).unwrap(), g).unwrap();
        let (ids, targets) = batch(&expected, dev);
        let loss = model.forward_loss(ids, targets).unwrap().into_scalar::<f64>();
        let want = expected["main_loss"].as_f64().unwrap();
        assert!((loss - want).abs() <= 1e-5 * want, "without modules: {loss} vs {want}");
        match hf::load(&dir, two.init(dev, g, &init).unwrap(), g) {
            Err(HfError::Mismatch { field, .. }) => assert_eq!(field, "num_nextn_predict_layers"),
            other => panic!("two modules from a file of one: {:?}", other.map(|_| ())),
        }
    });
}

/// Sequences a training step, over every data-parallel rank.
const STEP_BATCH: usize = 8;

/// The vocabulary the families train with: the fixtures' 99 padded to 100 at tp 2 would make a
/// seed's whole output weight `[d, 100]` another draw than `[d, 99]`.
const TRAIN_VOCAB: usize = 96;

/// Step `step`'s sequences `first..first + count` of the fixtures' vocabulary.
fn step_batch(device: &Device, step: usize, first: usize, count: usize) -> TokenBatch {
    let ids: Vec<i64> = (0..STEP_BATCH * (SEQ + 1))
        .map(|i| ((i * 37 + step * 11 + i / 5) % TRAIN_VOCAB) as i64)
        .collect();
    let all = Tensor::<2, Int>::from_data(TensorData::new(ids, [STEP_BATCH, SEQ + 1]), device);
    let all = all.narrow(0, first, count);
    TokenBatch::new(all.clone().narrow(1, 0, SEQ), all.narrow(1, 1, SEQ))
}

/// The mean loss of each of 20 AdamW steps (ZeRO-1, clipping at 1) of `trainer` on this rank's
/// `count` sequences from `first`, averaged over `mean_over`.
fn train_losses<M: TrainModel>(
    mut trainer: Trainer<M>,
    device: &Device,
    (first, count): (usize, usize),
    mean_over: &burn_megatron_dist::ProcessGroup,
) -> Vec<f64> {
    (0..20)
        .map(|step| {
            let stepped = trainer.step(1e-3, step_batch(device, step, first, count)).unwrap();
            let loss = mean_over.all_reduce(stepped.loss, ReduceOp::Avg).unwrap();
            loss.into_scalar::<f64>()
        })
        .collect()
}

/// Every family (its fixture's configuration, initialized from one seed: the same whole weights
/// at every layout) trained 20 steps at tp 2 × dp 2 with sequence parallelism, ZeRO-1 and
/// selective recomputation (the MoE families with ep 2 over dp) has the losses of one rank on
/// the whole batch; Qwen3 (tied embeddings, whose two uses sit on the first and last stage) also
/// at pp 2 and pp 2 × vpp 2, DeepSeek-V3 (latent attention, a dense block then MoE ones) at pp 2.
pub fn families_train_as_on_one_rank(h: &Harness) {
    let pp2 = ParallelDims {
        pp: 2,
        ..ParallelDims::single()
    };
    for name in FAMILIES {
        let mut config = training_config(name);
        // Four blocks where a pipeline interleaves: a block a model chunk.
        if name == "qwen3" {
            config.n_layers = 4;
        }
        let moe = config.moe.is_some();
        let reference = train_curve(
            h,
            &config,
            ParallelDims::single(),
            PipelineSchedule::OneForwardOneBackward,
        );
        let mut layouts = vec![(
            ParallelDims {
                ep: if moe { 2 } else { 1 },
                ..ParallelDims::tp_dp(2, 2)
            },
            PipelineSchedule::OneForwardOneBackward,
        )];
        match name {
            "qwen3" => layouts.extend([
                (pp2, PipelineSchedule::OneForwardOneBackward),
                (pp2, PipelineSchedule::Interleaved { virtual_stages: 2 }),
            ]),
            "deepseek_v3" => layouts.push((pp2, PipelineSchedule::OneForwardOneBackward)),
            _ => {}
        }
        for (dims, schedule) in layouts {
            let losses = train_curve(h, &config, dims, schedule);
            for (step, (a, b)) in losses.iter().zip(&reference).enumerate() {
                // The same sums grouped otherwise over the ranks in f32, carried by Adam's
                // normalized update through 20 steps at lr 1e-3: measured 1.2e-7 relative at
                // most (f32 rounding of the loss); the 1e-4 leaves room for other SIMD
                // widths and the GPU.
                assert!(
                    (a - b).abs() <= 1e-4 * b.abs(),
                    "{name} {dims:?} {schedule:?} step {step}: {a} vs one rank's {b} ({losses:?} vs {reference:?})"
                );
            }
            assert!(reference[19] < reference[0], "{name} learns: {reference:?}");
        }
    }
}

/// Qwen3's attention (q/k norms) and DeepSeek-V3's (latent, with its replicated down
/// projections), every linear layer under FP8 tensorwise scaling (emulated on the CPU), trained
/// 20 steps at tp 2 with sequence parallelism against one rank under the same recipe: each
/// rank's amaxes are reduced over tp, so the first loss is one rank's to f32 rounding and the
/// curve stays within the model suite's FP8 band (`model_suite::fp8_steps_match`: a value on an
/// FP8 rounding boundary may land on the neighbouring code, 1.0% measured there; 2e-2).
pub fn families_train_under_fp8(h: &Harness) {
    for name in ["qwen3", "deepseek_v3"] {
        let policy = PrecisionPolicy::f32().with_gemm(Gemm::Quantized(Recipe::Fp8Tensorwise));
        let config = policy.apply(training_config(name));
        let one = PipelineSchedule::OneForwardOneBackward;
        let reference = train_curve(h, &config, ParallelDims::single(), one);
        let losses = train_curve(h, &config, ParallelDims::tp_dp(2, 1), one);
        assert!(
            (losses[0] - reference[0]).abs() <= 1e-5 * reference[0],
            "{name}: first loss {} vs {}",
            losses[0],
            reference[0]
        );
        for (step, (a, b)) in losses.iter().zip(&reference).enumerate() {
            assert!(
                (a - b).abs() <= 2e-2 * b.abs(),
                "{name} FP8 step {step}: {a} vs one rank's {b}"
            );
        }
        assert!(reference[19] < reference[0], "{name} learns under FP8: {reference:?}");
    }
}

/// Fixture `name`'s configuration with the training vocabulary.
fn training_config(name: &str) -> LlamaConfig {
    let mut config = hf::config(&fixture(name)).unwrap();
    config.embedding.vocab_size = TRAIN_VOCAB;
    config.output.d_output = TRAIN_VOCAB;
    config.loss.vocab_size = TRAIN_VOCAB;
    config
}

/// The losses of 20 AdamW steps (ZeRO-1, clipping at 1) of `config` initialized from one seed,
/// planned over `dims` with sequence parallelism; a parallel run also recomputes each block's
/// attention and MLP in backward (selective), which must not change a value.
fn train_curve(h: &Harness, config: &LlamaConfig, dims: ParallelDims, schedule: PipelineSchedule) -> Vec<f64> {
    let init = ParamInit::new(3, InitMode::Full).with_dtype(h.float);
    let optim = DistributedAdamWConfig::new()
        .with_zero1(true)
        .with_max_grad_norm(Some(1.0));
    let plan = ParallelPlan::new(dims)
        .with_tensor(TensorParallel::SequenceParallel)
        .with_pipeline(schedule);
    let mut planned = plan.apply(config.clone(), dims.world_size(), SEQ).unwrap();
    if dims.world_size() > 1 {
        planned.recompute = burn_megatron::recompute::Recompute::Selective;
    }
    let ranks = h.run(dims, |ctx| {
        let (g, device) = (&ctx.groups, ctx.device.clone().autodiff());
        let per = STEP_BATCH / g.dp.size();
        let share = (g.dp.group_rank() * per, per);
        match dims.pp {
            1 => {
                let model = planned.init(&device, g, &init).unwrap();
                train_losses(Trainer::new(model, &optim, g, &ctx.device), &device, share, &g.dp)
            }
            _ => {
                let stage = planned.init_planned_stage(&plan, 2, &device, g, &init).unwrap();
                let losses = train_losses(Trainer::new(stage, &optim, g, &ctx.device), &device, share, &g.dp);
                // The last stage holds the loss.
                match g.pp.group_rank() + 1 == g.pp.size() {
                    true => losses,
                    false => Vec::new(),
                }
            }
        }
    });
    ranks.into_iter().find(|l| !l.is_empty()).unwrap()
}

/// Writes fixture `name` (any of `tests/fixtures/hf/`), loaded at tp 2 (its experts over ep 2)
/// and exported in `dtype`, to `out`: the input of `tests/fixtures/hf/check_export.py`, which
/// opens it with transformers.
pub fn write_export(out: &Path, name: &str, dtype: ExportDType) {
    let dir = fixture(name);
    let moe = hf::read_config(&dir).unwrap().choices.moe.is_some();
    let layout = if moe {
        Layout::Experts
    } else {
        Layout::Tensor { sp: false }
    };
    Harness::cpu(2).run(layout.dims(2), |ctx| {
        let (model, config) = loaded(&dir, layout, &ctx.groups, &ctx.device);
        let options = ExportOptions::new().with_dtype(dtype);
        hf::save(out, &model, &config, &ctx.groups, &options).unwrap();
    });
}

/// What a family cannot build is a typed error naming it: a Qwen3-MoE with dense blocks
/// between its MoE ones, Mixtral's router noise, an unknown `model_type`, Qwen3's
/// `attention_bias` (which biases the output projection too); and a Mistral trained or decoding
/// past its sliding window.
pub fn families_refuse_what_they_cannot_build(_h: &Harness) {
    let read = |name: &str| -> Value {
        serde_json::from_str(&std::fs::read_to_string(fixture(name).join("config.json")).unwrap()).unwrap()
    };
    type Edit = fn(&mut Value);
    let cases: [(&str, &str, Edit); 5] = [
        ("qwen3_moe", "decoder_sparse_step", |c| {
            c["decoder_sparse_step"] = 2.into()
        }),
        ("qwen3_moe", "mlp_only_layers", |c| {
            c["mlp_only_layers"] = serde_json::json!([0])
        }),
        ("mixtral", "router_jitter_noise", |c| {
            c["router_jitter_noise"] = 0.1.into()
        }),
        ("qwen3", "model_type", |c| c["model_type"] = "gemma3".into()),
        ("qwen3", "attention_bias", |c| c["attention_bias"] = true.into()),
    ];
    for (i, (name, field, edit)) in cases.into_iter().enumerate() {
        let mut config = read(name);
        edit(&mut config);
        let dir = std::env::temp_dir().join(format!("burn-megatron-family-refused-{i}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
        match hf::config(&dir) {
            Err(HfError::Unsupported { field: f, .. }) if f == field => {}
            other => panic!("case {i}: expected {field} refused, got {other:?}"),
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
    // The fixture's window is 32 tokens: 64-token sequences are refused by the plan, a cache
    // of 40 positions by generation.
    let config = hf::config(&fixture("mistral")).unwrap();
    let dims = ParallelDims::tp_dp(1, 1);
    match ParallelPlan::new(dims).apply(config.clone(), 1, 64) {
        Err(ConfigError::SequencePastWindow {
            seq_len: 64,
            window: 32,
        }) => {}
        other => panic!("expected the window to refuse 64 tokens, got {:?}", other.map(|_| ())),
    }
    let groups = ProcessGroups::single();
    let dev = Device::flex();
    let model = config.init(&dev, &groups, &ParamInit::new(1, InitMode::Full)).unwrap();
    let generated = generate(
        &model,
        &groups.tp,
        &[vec![1; 30]],
        &GenerateConfig {
            max_new_tokens: 10,
            sampling: Sampling::Greedy,
            stop: Vec::new(),
            pad: 0,
            seed: 0,
            graphs: false,
        },
        &dev,
    );
    match generated {
        Err(LayerError::Config(ConfigError::SequencePastWindow {
            seq_len: 40,
            window: 32,
        })) => {}
        other => panic!(
            "expected the window to refuse 40 positions, got {:?}",
            other.map(|_| ())
        ),
    }
}
