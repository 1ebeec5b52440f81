//! Multi-token prediction against DeepSeek-V3's definition written out here.

use burn::tensor::activation::log_softmax;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_megatron::init::{InitMode, ParamInit};
use burn_megatron::models::llama::{Llama, LlamaConfig, MtpConfig};
use burn_megatron::params::{param_grads, param_infos};
use burn_megatron::plan::{ParallelPlan, TensorParallel};
use burn_megatron_dist::{ParallelDims, ProcessGroups, ReduceOp};

use crate::Harness;

const SEQ: usize = 12;
const VOCAB: usize = 64;

/// A tiny model with 2 multi-token prediction modules of weight 0.3, a MoE block among its own
/// (and so in its modules) when `moe`.
fn config(moe: bool) -> LlamaConfig {
    let mut config =
        LlamaConfig::llama(VOCAB, 32, 2, 4, 4, 64, SEQ).with_mtp(Some(MtpConfig::new(2).with_loss_weight(0.3)));
    if moe {
        let router = burn_megatron::layers::moe::RouterConfig::new(32, 4, 2).with_normalize(true);
        let layer = burn_megatron::layers::moe::MoeConfig::new(router, 16);
        config.moe = Some(burn_megatron::models::llama::MoeBlocks::new(layer).with_first_dense(1));
    }
    config
}

fn batch(device: &Device) -> (Tensor<2, Int>, Tensor<2, Int>) {
    let b = 2;
    let ids: Vec<i64> = (0..b * (SEQ + 1)).map(|i| ((i * 29 + 7) % VOCAB) as i64).collect();
    let all = Tensor::<2, Int>::from_data(TensorData::new(ids, [b, SEQ + 1]), device);
    (all.clone().narrow(1, 0, SEQ), all.narrow(1, 1, SEQ))
}

/// `x` RMS-normalized over its last dim with `weight` (ε 1e-5, the model's).
fn rms(x: Tensor<3>, weight: Tensor<1>) -> Tensor<3> {
    let mean = x.clone().powi_scalar(2).mean_dim(2);
    x / (mean + 1e-5).sqrt() * weight.unsqueeze::<3>()
}

/// The mean next-token cross-entropy of the first `valid` positions of each row.
fn cross_entropy(logits: Tensor<3>, targets: Tensor<2, Int>, valid: usize) -> Tensor<1> {
    let logp = log_softmax(logits.narrow(1, 0, valid), 2);
    let picked = logp.gather(2, targets.narrow(1, 0, valid).unsqueeze_dim::<3>(2));
    picked.mean().neg()
}

/// DeepSeek-V3's loss with multi-token prediction, written out on a one-rank model: the main
/// next-token loss, then for depth k = 1, 2 the module's hidden states
/// `block(W·[rms(emb(t_{i+k})); rms(h_{k-1})])` (the order of DeepSeek-V3's `eh_proj` in its
/// files) read through its norm and the shared output
/// layer against `t_{i+k+1}`, over the positions that have one; λ times their mean added.
fn written_out(model: &Llama, ids: Tensor<2, Int>, targets: Tensor<2, Int>) -> Tensor<1> {
    let [b, s] = ids.dims();
    let out =
        |h: Tensor<3>, norm: Tensor<1>| rms(h, norm).matmul(model.output.as_ref().unwrap().weight.val().unsqueeze());
    let mut h = model.embedding.forward(ids.clone()).unwrap();
    for block in &model.layers {
        h = block.forward(h).unwrap();
    }
    let main = cross_entropy(out(h.clone(), model.norm.weight.val()), targets.clone(), s);
    let mut modules = Vec::new();
    for (k, module) in model.mtp.iter().enumerate() {
        let k = k + 1;
        let device = ids.device();
        let pad = Tensor::<2, Int>::zeros([b, k], &device);
        let ahead = Tensor::cat(vec![ids.clone().narrow(1, k, s - k), pad.clone()], 1);
        let embedded = model.embedding.forward(ahead).unwrap();
        let both = Tensor::cat(
            vec![
                rms(embedded, module.embedding_norm.weight.val()),
                rms(h, module.hidden_norm.weight.val()),
            ],
            2,
        );
        h = module
            .block
            .forward(both.matmul(module.projection.weight.val().unsqueeze()))
            .unwrap();
        let later = Tensor::cat(vec![targets.clone().narrow(1, k, s - k), pad], 1);
        modules.push(cross_entropy(out(h.clone(), module.norm.weight.val()), later, s - k));
    }
    let mean = modules.into_iter().reduce(|a, b| a + b).unwrap().div_scalar(2.0);
    main + mean.mul_scalar(0.3)
}

/// The model's loss with 2 multi-token prediction modules at the harness's tp with sequence
/// parallelism (and a MoE block, whose router adds no loss) against the definition written out
/// on one rank from the same seed: the same loss, and every parameter's gradient norm (the
/// split ones' squares summed over tp).
pub fn mtp_matches_its_definition(h: &Harness) {
    for moe in [false, true] {
        let dims = ParallelDims::tp_dp(h.world, 1);
        let plan = ParallelPlan::new(dims).with_tensor(TensorParallel::SequenceParallel);
        let planned = plan.apply(config(moe), h.world, SEQ).unwrap();
        let init = ParamInit::new(5, InitMode::Full).with_dtype(h.float);
        h.run(dims, |ctx| {
            let dev = ctx.device.clone().autodiff();
            let tp = &ctx.groups.tp;
            let model = planned.init(&dev, &ctx.groups, &init).unwrap();
            let (ids, targets) = batch(&dev);
            let (loss, report) = model.forward_loss_report(ids.clone(), targets.clone()).unwrap();
            assert!(report.mtp.is_some(), "the modules report their loss");
            let grads = loss.backward();
            let single = config(moe).init(&dev, &ProcessGroups::single(), &init).unwrap();
            let want = written_out(&single, ids, targets);
            let want_grads = want.backward();
            let (ours, theirs) = (loss.into_scalar::<f64>(), want.into_scalar::<f64>());
            // The same f32 arithmetic summed in another order (split products, fused kernels),
            // rounding at f32's 1e-7; 1e-5 as the Hugging Face fixtures allow.
            assert!(
                (ours - theirs).abs() <= 1e-5 * theirs,
                "moe {moe}: loss {ours} vs {theirs}"
            );
            let reference: Vec<(String, f64)> = param_infos(&single)
                .into_iter()
                .zip(param_grads(&single, &want_grads))
                .filter_map(|(info, g)| g.map(|g| (info.path, g.clone().mul(g).sum().into_scalar::<f64>().sqrt())))
                .collect();
            for (info, grad) in param_infos(&model).into_iter().zip(param_grads(&model, &grads)) {
                let Some(grad) = grad else {
                    continue;
                };
                let mut squares = grad.clone().mul(grad).sum();
                if info.tp_split {
                    squares = tp.all_reduce(squares, ReduceOp::Sum).unwrap();
                }
                let norm = squares.into_scalar::<f64>().sqrt();
                let (_, want) = reference
                    .iter()
                    .find(|(path, _)| *path == info.path)
                    .unwrap_or_else(|| panic!("no reference gradient for {}", info.path));
                // As the loss; gradient norms average the rounding over each tensor: 1e-4 for
                // the smallest (a norm's weight).
                assert!(
                    (norm - want).abs() <= 1e-4 * want.max(1e-3),
                    "moe {moe} tp {}: |grad {}| {norm} vs {want}",
                    tp.size(),
                    info.path
                );
            }
        });
    }
}
