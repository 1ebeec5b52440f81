//! The layers a GPT-2-style Burn model swaps in besides the linears (`docs/own-model.md`):
//! LayerNorm, learned positions and the output layer tied to the token embedding, each against
//! the Burn layer or op it replaces, with and without sequence parallelism.

use burn::module::Param;
use burn::nn::{EmbeddingConfig, LayerNormConfig as BurnLayerNormConfig};
use burn::tensor::module::linear;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_megatron::ConfigError;
use burn_megatron::LayerError;
use burn_megatron::layers::*;

use super::{B, D, Rank, S, layout};
use crate::Harness;

/// LayerNorm against Burn's: outputs, input gradients, and γ's and β's gradients (under SP
/// each rank's are summed over the group).
pub fn layer_norm(h: &Harness) {
    h.run(h.tp_world(), |ctx| {
        let r = Rank::new(h, &ctx);
        let mut twin = BurnLayerNormConfig::new(D).init(&r.dev);
        twin.gamma = Param::from_tensor(r.t([D], 5));
        twin.beta = Some(Param::from_tensor(r.t([D], 6)));
        for sp in [false, true] {
            let config = LayerNormConfig::new(D).with_sequence(layout(sp));
            let par = config.init_from(twin.clone(), &r.groups);
            let x = r.t([B, S, D], 1);
            let full = [B, S, D];
            let p = r.run(
                r.seq(x.clone(), sp),
                full,
                |w| r.seq(w, sp),
                |x| par.forward(x).unwrap(),
            );
            let t = r.run_twin(x, full, |x| twin.forward(x));
            let what = format!("layer norm sp={sp}");
            r.close(p.out.clone(), r.seq(t.out.clone(), sp), &format!("{what} output"));
            r.close(p.dx.clone(), r.seq(t.dx.clone(), sp), &format!("{what} input grad"));
            r.close(p.grad(&par.gamma), t.grad(&twin.gamma), &format!("{what} gamma grad"));
            let (beta, twin_beta) = (par.beta.as_ref().unwrap(), twin.beta.as_ref().unwrap());
            r.close(p.grad(beta), t.grad(twin_beta), &format!("{what} beta grad"));
        }
    });
}

/// Learned positions against Burn's `Embedding` of the positions `0..s`: the rows each rank
/// adds (its own positions under SP) and the table's gradient (summed over the group under
/// SP). A sequence SP cannot split is a typed error.
pub fn position_embedding(h: &Harness) {
    h.run(h.tp_world(), |ctx| {
        let r = Rank::new(h, &ctx);
        let mut twin = EmbeddingConfig::new(S + 3, D).init(&r.dev);
        twin.weight = Param::from_tensor(r.t([S + 3, D], 5));
        let positions = Tensor::<2, Int>::from_data(TensorData::new((0..S as i64).collect(), [1, S]), &r.dev);
        let w = r.t([1, S, D], 7);
        for sp in [false, true] {
            let par = PositionEmbedding::from_embedding(twin.clone(), layout(sp), &r.groups);
            let out = par.forward(S).unwrap();
            let grads = (out.clone() * r.seq(w.clone(), sp)).sum().backward();
            let twin_out = twin.forward(positions.clone());
            let twin_grads = (twin_out.clone() * w.clone()).sum().backward();
            let what = format!("positions sp={sp}");
            r.close(out, r.seq(twin_out, sp), &format!("{what} output"));
            let grad = |table: &Param<Tensor<2>>, grads| table.val().grad(grads).expect("the table's gradient");
            r.close(
                grad(&par.weight, &grads),
                grad(&twin.weight, &twin_grads),
                &format!("{what} table grad"),
            );
        }
        if r.tp.size() > 1 {
            let par = PositionEmbedding::from_embedding(twin, SequenceLayout::Sharded, &r.groups);
            let (seq_len, tp) = (S + 1, r.tp.size());
            let refused = LayerError::Config(ConfigError::SequenceNotDivisible { seq_len, tp });
            assert_eq!(par.forward(seq_len).unwrap_err(), refused);
        }
    });
}

/// The output layer tied to a vocabulary-parallel embedding against Burn's `linear` by the
/// whole table transposed: this rank's vocabulary columns of the logits, the input's gradient
/// (its sequence shard under SP) and the table's gradient; padded rows get none.
pub fn tied_output(h: &Harness) {
    h.run(h.tp_world(), |ctx| {
        let r = Rank::new(h, &ctx);
        let vocab = 37;
        let v = padded_vocab(vocab, 1, r.tp.size());
        let mut twin = EmbeddingConfig::new(vocab, D).init(&r.dev);
        twin.weight = Param::from_tensor(r.t([vocab, D], 5));
        // The loss's weights, none on the padded vocabulary (as the cross-entropy ignores it).
        let w = r.t([B, S, vocab], 7);
        let pad = Tensor::zeros([B, S, v - vocab], (&r.dev, h.float));
        let padded_w = Tensor::cat(vec![w.clone(), pad.clone()], 2);
        // The twin on the CPU: on CUDA Burn's f32 matmul may round its operands to TF32.
        let cpu = Device::flex().autodiff();
        let table = twin.weight.val().to_device(&cpu).detach().require_grad();
        let x = r.t([B, S, D], 1);
        let x_cpu = x.clone().to_device(&cpu).detach().require_grad();
        let twin_logits = linear(x_cpu.clone(), table.clone().transpose(), None);
        let twin_grads = (twin_logits.clone() * w.to_device(&cpu)).sum().backward();
        // The padded vocabulary's logits and gradient rows are zeros.
        let twin_logits = Tensor::cat(vec![twin_logits.detach().to_device(&r.dev), pad], 2);
        let twin_dx = x_cpu.grad(&twin_grads).unwrap().to_device(&r.dev);
        let twin_dw = table.grad(&twin_grads).unwrap().to_device(&r.dev);
        let twin_dw = Tensor::cat(vec![twin_dw, Tensor::zeros([v - vocab, D], (&r.dev, h.float))], 0);
        for sp in [false, true] {
            let par = VocabParallelEmbedding::from_embedding(twin.clone(), 1, layout(sp), &r.groups);
            let x_par = r.seq(x.clone(), sp).detach().require_grad();
            let logits = par.tied_logits(x_par.clone()).unwrap();
            let grads = (logits.clone() * r.shard(padded_w.clone(), 2)).sum().backward();
            let what = format!("tied output sp={sp}");
            r.close(logits, r.shard(twin_logits.clone(), 2), &format!("{what} logits"));
            let dx = x_par.grad(&grads).unwrap();
            r.close(dx, r.seq(twin_dx.clone(), sp), &format!("{what} input grad"));
            let dw = par.weight.val().grad(&grads).unwrap();
            r.close(dw, r.shard(twin_dw.clone(), 0), &format!("{what} table grad"));
        }
    });
}
