//! The layer suite: every parallel layer at the harness's tp, with and without sequence
//! parallelism, against its tp = 1 twin built from the same full weights. Outputs, input
//! gradients and every parameter gradient (the rank's shard of the twin's) must agree.
//!
//! Both sides initialize in `InitMode::Full` from one seed, so the parallel layer's parameters
//! are exact slices of the twin's. The loss is `Σ out ⊙ w` with a fixed `w`; with sequence
//! parallelism each rank sees its shard of `w`, so the ranks' losses add up to the twin's.

use burn::module::Param;
use burn::tensor::{Device, Gradients, Int, Tensor, TensorData};
use burn_megatron::init::{InitMode, ParamInit, Shard};
use burn_megatron::layers::*;
use burn_megatron_dist::{ProcessGroup, ProcessGroups, RankContext};
use burn_megatron_kernels::Gemm;

use crate::Harness;
use crate::data::{assert_close, fixed};

mod gpt;
pub use gpt::{layer_norm, position_embedding, tied_output};

const SEED: u64 = 42;
const B: usize = 2;
const S: usize = 8;
const D: usize = 32;

/// One rank's view: its device (autodiff), its groups (and its tp group) and the groups of the
/// single-device twin.
struct Rank<'a> {
    h: &'a Harness,
    dev: Device,
    groups: ProcessGroups,
    tp: ProcessGroup,
    single: ProcessGroups,
    init: ParamInit,
}

impl<'a> Rank<'a> {
    fn new(h: &'a Harness, ctx: &RankContext) -> Self {
        let init = ParamInit::new(SEED, InitMode::Full).with_dtype(h.float);
        let (groups, single) = (ctx.groups.clone(), ProcessGroups::single());
        Self {
            h,
            dev: ctx.device.clone().autodiff(),
            tp: groups.tp.clone(),
            groups,
            single,
            init,
        }
    }

    fn t<const N: usize>(&self, shape: [usize; N], seed: u64) -> Tensor<N> {
        fixed(shape, seed, &self.dev, self.h.float)
    }

    /// This rank's sequence shard (dim 1) when `sp`, else the whole tensor.
    fn seq<const N: usize>(&self, x: Tensor<N>, sp: bool) -> Tensor<N> {
        if sp {
            Shard::new(1, self.tp.group_rank(), self.tp.size()).slice(x)
        } else {
            x
        }
    }

    fn shard<const N: usize>(&self, x: Tensor<N>, dim: usize) -> Tensor<N> {
        Shard::new(dim, self.tp.group_rank(), self.tp.size()).slice(x)
    }

    /// Burn's `Linear` forward, the outside reference, evaluated on the CPU: on CUDA Burn's
    /// matmul rounds f32 operands to TF32, which the f32 tolerance does not allow.
    fn burn_linear(&self, linear: &burn::nn::Linear, x: Tensor<3>) -> Tensor<3> {
        let cpu = Device::flex();
        let linear = burn::module::Module::to_device(linear.clone(), &cpu);
        linear.forward(x.detach().to_device(&cpu)).to_device(&self.dev)
    }

    fn close<const N: usize>(&self, actual: Tensor<N>, expected: Tensor<N>, what: &str) {
        assert_close(
            &actual,
            &expected,
            self.h.matmul_tolerance,
            &format!("tp={} {what}", self.tp.size()),
        );
    }

    /// Runs `forward` on the rank's input `x` (a leaf) and back-propagates `Σ out ⊙ part(w)`,
    /// where `w` is a fixed tensor of the whole output's shape `full` and `part` takes this
    /// rank's share of it.
    fn run(
        &self,
        x: Tensor<3>,
        full: [usize; 3],
        part: impl Fn(Tensor<3>) -> Tensor<3>,
        forward: impl Fn(Tensor<3>) -> Tensor<3>,
    ) -> Run {
        let x = x.require_grad();
        let out = forward(x.clone());
        let grads = (out.clone() * part(self.t(full, 7))).sum().backward();
        Run {
            dx: x.grad(&grads).expect("input gradient"),
            out,
            grads,
        }
    }

    /// [`run`](Self::run) for the twin: the whole input and the whole output.
    fn run_twin(&self, x: Tensor<3>, full: [usize; 3], forward: impl Fn(Tensor<3>) -> Tensor<3>) -> Run {
        self.run(x, full, |w| w, forward)
    }
}

/// The sequence layout of a layer run with (`sp`) or without sequence parallelism.
fn layout(sp: bool) -> SequenceLayout {
    if sp {
        SequenceLayout::Sharded
    } else {
        SequenceLayout::Whole
    }
}

struct Run {
    out: Tensor<3>,
    dx: Tensor<3>,
    grads: Gradients,
}

impl Run {
    fn grad<const N: usize>(&self, p: &Param<Tensor<N>>) -> Tensor<N> {
        p.val().grad(&self.grads).expect("parameter gradient")
    }
}

/// Column-parallel linear, every input and output style, with a bias.
pub fn column_linear(h: &Harness) {
    h.run(h.tp_world(), |ctx| {
        let r = Rank::new(h, &ctx);
        for (input, output) in [
            (ColumnInput::Replicated, ColumnOutput::Sharded),
            (ColumnInput::Replicated, ColumnOutput::Gathered),
            (ColumnInput::SequenceSharded, ColumnOutput::Sharded),
            (ColumnInput::SequenceSharded, ColumnOutput::Gathered),
        ] {
            let config = ColumnParallelLinearConfig::new(D, 4 * D)
                .with_bias(true)
                .with_input(input)
                .with_output(output);
            let mut par = config.init(&r.dev, &r.groups, &r.init, "c").unwrap();
            let mut twin = config.init(&r.dev, &r.single, &r.init, "c").unwrap();
            // A non-zero bias, so its gradient path is exercised with real values.
            twin.bias = Some(Param::from_tensor(r.t([4 * D], 3)));
            par.bias = Some(Param::from_tensor(r.shard(r.t([4 * D], 3), 0)));
            let sp = input == ColumnInput::SequenceSharded;
            let x = r.t([B, S, D], 1);
            let out_dim = if output == ColumnOutput::Sharded { Some(2) } else { None };
            let expect = |x: Tensor<3>| match out_dim {
                Some(d) => r.shard(x, d),
                None => x,
            };
            let full = [B, S, 4 * D];
            let p = r.run(r.seq(x.clone(), sp), full, expect, |x| par.forward(x).unwrap());
            let t = r.run_twin(x, full, |x| twin.forward(x).unwrap());
            let what = format!("column {input:?}/{output:?}");
            r.close(p.out.clone(), expect(t.out.clone()), &format!("{what} output"));
            r.close(p.dx.clone(), r.seq(t.dx.clone(), sp), &format!("{what} input grad"));
            r.close(
                p.grad(&par.weight),
                r.shard(t.grad(&twin.weight), 1),
                &format!("{what} weight grad"),
            );
            r.close(
                p.grad(par.bias.as_ref().unwrap()),
                r.shard(t.grad(twin.bias.as_ref().unwrap()), 0),
                &format!("{what} bias grad"),
            );
        }
    });
}

/// Row-parallel linear, every input and output style, with a bias.
pub fn row_linear(h: &Harness) {
    h.run(h.tp_world(), |ctx| {
        let r = Rank::new(h, &ctx);
        for (input, output) in [
            (RowInput::Sharded, RowOutput::Reduced),
            (RowInput::Sharded, RowOutput::SequenceScattered),
            (RowInput::Replicated, RowOutput::Reduced),
            (RowInput::Replicated, RowOutput::SequenceScattered),
        ] {
            let config = RowParallelLinearConfig::new(4 * D, D)
                .with_bias(true)
                .with_input(input)
                .with_output(output);
            let mut par = config.init(&r.dev, &r.groups, &r.init, "r").unwrap();
            let mut twin = config.init(&r.dev, &r.single, &r.init, "r").unwrap();
            twin.bias = Some(Param::from_tensor(r.t([D], 3)));
            par.bias = Some(Param::from_tensor(r.t([D], 3)));
            let sp = output == RowOutput::SequenceScattered;
            let x = r.t([B, S, 4 * D], 1);
            // A sharded input is this rank's slice of the features, a leaf of its own.
            let x_par = if input == RowInput::Sharded {
                r.shard(x.clone(), 2)
            } else {
                x.clone()
            };
            let full = [B, S, D];
            let p = r.run(x_par, full, |w| r.seq(w, sp), |x| par.forward(x).unwrap());
            let t = r.run_twin(x, full, |x| twin.forward(x).unwrap());
            let what = format!("row {input:?}/{output:?}");
            r.close(p.out.clone(), r.seq(t.out.clone(), sp), &format!("{what} output"));
            let dx = if input == RowInput::Sharded {
                r.shard(t.dx.clone(), 2)
            } else {
                t.dx.clone()
            };
            r.close(p.dx.clone(), dx, &format!("{what} input grad"));
            r.close(
                p.grad(&par.weight),
                r.shard(t.grad(&twin.weight), 0),
                &format!("{what} weight grad"),
            );
            r.close(
                p.grad(par.bias.as_ref().unwrap()),
                t.grad(twin.bias.as_ref().unwrap()),
                &format!("{what} bias grad"),
            );
        }
    });
}

/// RMSNorm, with and without sequence parallelism (its weight gradient summed over the group).
pub fn rms_norm(h: &Harness) {
    h.run(h.tp_world(), |ctx| {
        let r = Rank::new(h, &ctx);
        for sp in [false, true] {
            let config = RmsNormConfig::new(D).with_sequence(layout(sp));
            let mut par = config.init(&r.dev, &r.groups, &r.init);
            let mut twin = config
                .clone()
                .with_sequence(SequenceLayout::Whole)
                .init(&r.dev, &r.single, &r.init);
            par.weight = Param::from_tensor(r.t([D], 5));
            twin.weight = Param::from_tensor(r.t([D], 5));
            let x = r.t([B, S, D], 1);
            let full = [B, S, D];
            let p = r.run(
                r.seq(x.clone(), sp),
                full,
                |w| r.seq(w, sp),
                |x| par.forward(x).unwrap(),
            );
            let t = r.run_twin(x, full, |x| twin.forward(x).unwrap());
            r.close(p.out.clone(), r.seq(t.out.clone(), sp), &format!("norm sp={sp} output"));
            r.close(
                p.dx.clone(),
                r.seq(t.dx.clone(), sp),
                &format!("norm sp={sp} input grad"),
            );
            r.close(
                p.grad(&par.weight),
                t.grad(&twin.weight),
                &format!("norm sp={sp} weight grad"),
            );
        }
    });
}

/// SwiGLU MLP, with and without sequence parallelism.
pub fn mlp(h: &Harness) {
    h.run(h.tp_world(), |ctx| {
        let r = Rank::new(h, &ctx);
        for sp in [false, true] {
            let config = ParallelMlpConfig::new(D, 3 * 8 * r.tp.size().max(1)).with_sequence(layout(sp));
            let par = config.init(&r.dev, &r.groups, &r.init, "mlp").unwrap();
            let twin = config
                .clone()
                .with_sequence(SequenceLayout::Whole)
                .init(&r.dev, &r.single, &r.init, "mlp")
                .unwrap();
            let x = r.t([B, S, D], 1);
            let full = [B, S, D];
            let p = r.run(
                r.seq(x.clone(), sp),
                full,
                |w| r.seq(w, sp),
                |x| par.forward(x).unwrap(),
            );
            let t = r.run_twin(x, full, |x| twin.forward(x).unwrap());
            let what = format!("mlp sp={sp}");
            r.close(p.out.clone(), r.seq(t.out.clone(), sp), &format!("{what} output"));
            r.close(p.dx.clone(), r.seq(t.dx.clone(), sp), &format!("{what} input grad"));
            r.close(
                p.grad(&par.w1.weight),
                r.shard(t.grad(&twin.w1.weight), 1),
                &format!("{what} w1 grad"),
            );
            r.close(
                p.grad(&par.w3.weight),
                r.shard(t.grad(&twin.w3.weight), 1),
                &format!("{what} w3 grad"),
            );
            r.close(
                p.grad(&par.w2.weight),
                r.shard(t.grad(&twin.w2.weight), 0),
                &format!("{what} w2 grad"),
            );
        }
    });
}

/// Causal attention with grouped-query heads, with and without sequence parallelism.
pub fn attention(h: &Harness) {
    h.run(h.tp_world(), |ctx| {
        let r = Rank::new(h, &ctx);
        for sp in [false, true] {
            // 8 heads over 4 kv heads: GQA at every tp ≤ 4.
            let config = ParallelAttentionConfig::new(D, 8, 4, S).with_sequence(layout(sp));
            let par = config.init(&r.dev, &r.groups, &r.init, "attn").unwrap();
            let twin = config
                .clone()
                .with_sequence(SequenceLayout::Whole)
                .init(&r.dev, &r.single, &r.init, "attn")
                .unwrap();
            let x = r.t([B, S, D], 1);
            let full = [B, S, D];
            let p = r.run(
                r.seq(x.clone(), sp),
                full,
                |w| r.seq(w, sp),
                |x| par.forward(x).unwrap(),
            );
            let t = r.run_twin(x, full, |x| twin.forward(x).unwrap());
            let what = format!("attention sp={sp}");
            r.close(p.out.clone(), r.seq(t.out.clone(), sp), &format!("{what} output"));
            r.close(p.dx.clone(), r.seq(t.dx.clone(), sp), &format!("{what} input grad"));
            for (name, a, b) in [
                ("wq", &par.wq, &twin.wq),
                ("wk", &par.wk, &twin.wk),
                ("wv", &par.wv, &twin.wv),
            ] {
                r.close(
                    p.grad(&a.weight),
                    r.shard(t.grad(&b.weight), 1),
                    &format!("{what} {name} grad"),
                );
            }
            r.close(
                p.grad(&par.wo.weight),
                r.shard(t.grad(&twin.wo.weight), 0),
                &format!("{what} wo grad"),
            );
        }
    });
}

/// Vocabulary-parallel embedding over a vocabulary that tp does not divide (padded).
pub fn embedding(h: &Harness) {
    h.run(h.tp_world(), |ctx| {
        let r = Rank::new(h, &ctx);
        let vocab = 37;
        for sp in [false, true] {
            let config = VocabParallelEmbeddingConfig::new(vocab, D).with_sequence(layout(sp));
            let par = config.init(&r.dev, &r.groups, &r.init, "emb");
            let twin = config
                .clone()
                .with_sequence(SequenceLayout::Whole)
                .init(&r.dev, &r.single, &r.init, "emb");
            assert_eq!(par.weight.dims()[0] * r.tp.size(), padded_vocab(vocab, 1, r.tp.size()));
            let ids: Vec<i64> = (0..(B * S) as i64).map(|i| (i * 7 + 3) % vocab as i64).collect();
            let ids = Tensor::<2, Int>::from_data(TensorData::new(ids, [B, S]), &r.dev);
            let run = |layer: &VocabParallelEmbedding, sp_out: bool| {
                let out = layer.forward(ids.clone()).unwrap();
                let w = r.seq(r.t([B, S, D], 7), sp_out);
                let grads = (out.clone() * w).sum().backward();
                (out, layer.weight.val().grad(&grads).unwrap())
            };
            let (out, dw) = run(&par, sp);
            let (out1, dw1) = run(&twin, false);
            r.close(out, r.seq(out1, sp), &format!("embedding sp={sp} output"));
            // The twin's rows of this rank's id range; padded rows never receive a gradient.
            let rows = par.weight.dims()[0];
            let start = r.tp.group_rank() * rows;
            let real = rows.min(vocab.saturating_sub(start));
            r.close(
                dw.clone().narrow(0, 0, real),
                dw1.narrow(0, start, real),
                &format!("embedding sp={sp} weight grad"),
            );
            if real < rows {
                r.close(
                    dw.narrow(0, real, rows - real),
                    Tensor::zeros([rows - real, D], (&r.dev, h.float)),
                    "padded rows' grad",
                );
            }
        }
    });
}

/// Vocabulary-parallel cross-entropy against `log_softmax` on the whole vocabulary, with an
/// ignored target, label smoothing and a padded vocabulary.
pub fn cross_entropy(h: &Harness) {
    h.run(h.tp_world(), |ctx| {
        let r = Rank::new(h, &ctx);
        let vocab = 37;
        let v = padded_vocab(vocab, 1, r.tp.size());
        for smoothing in [0.0, 0.1] {
            let loss = VocabParallelCrossEntropyConfig::new(vocab)
                .with_label_smoothing(smoothing)
                .init(&r.groups);
            let targets: Vec<i64> = (0..(B * S) as i64)
                .map(|i| if i == 5 { -100 } else { (i * 11 + 1) % vocab as i64 })
                .collect();
            let targets = Tensor::<2, Int>::from_data(TensorData::new(targets, [B, S]), &r.dev);
            let full = r.t([B, S, v], 9);
            let logits = r.shard(full.clone(), 2).require_grad();
            let value = loss.forward(logits.clone(), targets.clone()).unwrap();
            let dlogits = logits.grad(&value.backward()).unwrap();

            let whole = full.narrow(2, 0, vocab).require_grad();
            let log_p = burn::tensor::activation::log_softmax(whole.clone(), 2); // [b, s, vocab]
            let nll = -log_p
                .clone()
                .gather(2, targets.clone().clamp_min(0).unsqueeze_dim(2))
                .squeeze_dim::<2>(2);
            let smooth = -log_p.mean_dim(2).squeeze_dim::<2>(2);
            let token = nll.mul_scalar(1.0 - smoothing) + smooth.mul_scalar(smoothing);
            let counted = targets.not_equal_elem(-100);
            let expected = token
                .mask_fill(counted.clone().bool_not(), 0.0)
                .sum()
                .div_scalar((B * S - 1) as f64);
            let dwhole = whole.grad(&expected.backward()).unwrap();
            let what = format!("cross-entropy ε={smoothing}");
            assert_close(&value, &expected, h.tolerance * 10.0, &format!("{what} loss"));
            let padded_dw = Tensor::cat(vec![dwhole, Tensor::zeros([B, S, v - vocab], (&r.dev, h.float))], 2);
            r.close(dlogits, r.shard(padded_dw, 2), &format!("{what} logits grad"));
        }
    });
}

/// `from_linear` keeps this rank's slice of a Burn `Linear`, and `to_linear` gathers it back.
pub fn linear_round_trip(h: &Harness) {
    h.run(h.tp_world(), |ctx| {
        let r = Rank::new(h, &ctx);
        // The same Linear on every rank (a random init would differ between rank threads).
        let fixed_linear = |d_in: usize, d_out: usize, seed: u64| burn::nn::Linear {
            weight: Param::from_tensor(r.t([d_in, d_out], seed)),
            bias: Some(Param::from_tensor(r.t([d_out], seed + 1))),
        };
        let linear = fixed_linear(D, 4 * D, 11);
        let (w, b) = (linear.weight.val(), linear.bias.as_ref().unwrap().val());
        let column = ColumnParallelLinear::from_linear(
            linear.clone(),
            ColumnInput::Replicated,
            ColumnOutput::Gathered,
            &r.groups,
        )
        .unwrap();
        let x = r.t([B, S, D], 1);
        r.close(
            column.forward(x.clone()).unwrap(),
            r.burn_linear(&linear, x),
            "column from_linear output",
        );
        let back = column.to_linear().unwrap();
        r.close(back.weight.val(), w.clone(), "column to_linear weight");
        r.close(back.bias.unwrap().val(), b.clone(), "column to_linear bias");
        let row_linear = fixed_linear(4 * D, D, 13);
        let row =
            RowParallelLinear::from_linear(row_linear.clone(), RowInput::Replicated, RowOutput::Reduced, &r.groups)
                .unwrap();
        let x = r.t([B, S, 4 * D], 2);
        r.close(
            row.forward(x.clone()).unwrap(),
            r.burn_linear(&row_linear, x),
            "row from_linear output",
        );
        r.close(
            row.to_linear().unwrap().weight.val(),
            row_linear.weight.val(),
            "row to_linear weight",
        );
    });
}

/// The GEMM is part of each layer's configuration, not of the process: in one process at the
/// harness's tp, a column- and a row-parallel layer on each product run exactly that product on
/// their shards (on CUDA in bf16 our wgmma kernel and Burn's matmul round differently; on the
/// CPU both are Burn's), and the two models agree with their single-device twin.
pub fn gemm_per_layer(h: &Harness) {
    h.run(h.tp_world(), |ctx| {
        let r = Rank::new(h, &ctx);
        // Without autodiff: the reference products take plain device tensors.
        let dev = ctx.device.clone();
        let x = fixed([B * S, D], 1, &dev, h.float);
        for gemm in [Gemm::Wgmma, Gemm::Burn] {
            let column = ColumnParallelLinearConfig::new(D, 4 * D)
                .with_gemm(gemm)
                .init(&dev, &r.groups, &r.init, "c")
                .unwrap();
            let row = RowParallelLinearConfig::new(4 * D, D)
                .with_input(RowInput::Replicated)
                .with_gemm(gemm);
            let row = row.init(&dev, &r.groups, &r.init, "r").unwrap();
            assert_eq!((column.precision.gemm, row.precision.gemm), (gemm, gemm));
            let hidden = column.forward(x.clone()).unwrap(); // [bs, 4d/tp]
            // The same kernel on the same operands: bit for bit.
            hidden
                .clone()
                .into_data()
                .assert_eq(&product(x.clone(), column.weight.val(), gemm).into_data(), true);
            let wide = x.clone().repeat_dim(1, 4); // [bs, 4d], whole on every rank
            let out = row.forward(wide.clone()).unwrap();
            let partial = product(r.shard(wide, 1), row.weight.val(), gemm);
            let summed = ctx
                .groups
                .tp
                .all_reduce(partial, burn_megatron_dist::ReduceOp::Sum)
                .unwrap();
            out.into_data().assert_eq(&summed.into_data(), true);
        }
    });
}

/// `x · w` by the kernel `gemm` names, called directly.
fn product(x: Tensor<2>, w: Tensor<2>, gemm: Gemm) -> Tensor<2> {
    #[cfg(feature = "cuda")]
    if gemm == Gemm::Wgmma && x.dtype() == burn::tensor::DType::BF16 {
        use burn_megatron_kernels::cuda::wgmma::{Schedule, matmul};
        if let Ok(out) = matmul(x.clone(), w.clone(), Schedule::Persistent) {
            return out;
        }
    }
    let _ = gemm;
    // What both products run otherwise: f32 operands stay f32 on CUDA, others take Burn's matmul.
    burn_megatron_kernels::gemm::f32_matmul::matmul(x, w)
}
