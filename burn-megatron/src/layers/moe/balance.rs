//! The router's auxiliary losses, each present when its coefficient is above 0:
//!
//! - `aux` (Switch/GShard, Megatron's `aux_loss`): `coeff · e · Σ_e f_e · P_e`, `f_e` the share of
//!   the batch's `t·k` assignments that went to expert `e` (no gradient), `P_e` the mean over
//!   tokens of its probability (the scores, normalized per token for sigmoid scoring). It is
//!   `coeff` when routing is balanced and grows as tokens crowd onto experts the router favours.
//! - `seq_aux` (DeepSeek-V3's sequence-wise loss, Megatron's `seq_aux_loss`): the same per
//!   sequence, averaged over sequences.
//! - `z` (ST-MoE's router z-loss): `coeff · mean_t (log Σ_e exp logits[t, e])²`, which keeps the
//!   logits small.

use burn::tensor::{Int, Tensor};

use super::router::{RouterSettings, Scoring, counts};

/// The router's losses of one call, `[1]` each, f32.
#[derive(Clone, Debug)]
pub struct RouterLosses {
    pub aux: Option<Tensor<1>>,
    pub seq_aux: Option<Tensor<1>>,
    pub z: Option<Tensor<1>>,
}

impl RouterLosses {
    /// Each loss present, by name (for reporting).
    pub fn named(&self) -> Vec<(&'static str, Tensor<1>)> {
        [
            ("aux_loss", &self.aux),
            ("seq_aux_loss", &self.seq_aux),
            ("z_loss", &self.z),
        ]
        .into_iter()
        .filter_map(|(name, loss)| loss.clone().map(|l| (name, l)))
        .collect()
    }

    /// Their sum, to add to the model's loss; `None` when there is none.
    pub fn total(&self) -> Option<Tensor<1>> {
        self.named().into_iter().map(|(_, l)| l).reduce(|a, b| a + b)
    }
}

/// The losses of a call that scored `t` tokens (`per_sequence` a sequence) into `scores`
/// `[t, e]` from `logits` and chose `experts` `[t, k]`, `chosen` `[e]` times each.
pub fn balance_losses(
    settings: &RouterSettings,
    logits: &Tensor<2>,
    scores: &Tensor<2>,
    (experts, chosen): (&Tensor<2, Int>, &Tensor<1, Int>),
    per_sequence: usize,
) -> RouterLosses {
    // Softmax scores are probabilities already; sigmoid scores are normalized per token.
    let probabilities = match settings.scoring {
        Scoring::Softmax => scores.clone(),
        Scoring::Sigmoid => scores.clone() / scores.clone().sum_dim(1),
    };
    let aux = (settings.aux_loss > 0.0).then(|| {
        let [_, k] = experts.dims();
        switch_loss(probabilities.clone(), chosen.clone(), k).mul_scalar(settings.aux_loss)
    });
    let seq_aux = (settings.seq_aux_loss > 0.0).then(|| {
        let [t, _] = scores.dims();
        let sequences = t / per_sequence.max(1);
        let each: Vec<Tensor<1>> = (0..sequences)
            .map(|i| {
                let rows = i * per_sequence..(i + 1) * per_sequence;
                let [_, e] = scores.dims();
                let [_, k] = experts.dims();
                let chosen = counts(experts.clone().slice([rows.clone()]), e);
                switch_loss(probabilities.clone().slice([rows]), chosen, k)
            })
            .collect();
        Tensor::cat(each, 0).mean().mul_scalar(settings.seq_aux_loss)
    });
    let z = (settings.z_loss > 0.0).then(|| {
        let lse = logits.clone().exp().sum_dim(1).log(); // [t, 1]
        lse.square().mean().mul_scalar(settings.z_loss)
    });
    RouterLosses { aux, seq_aux, z }
}

/// `e · Σ_e f_e · P_e` of `probabilities` `[t, e]` and each expert's share of the `t·k`
/// choices, counted in `chosen` `[e]`.
fn switch_loss(probabilities: Tensor<2>, chosen: Tensor<1, Int>, k: usize) -> Tensor<1> {
    let [t, e] = probabilities.dims();
    let share = chosen.float().div_scalar((t * k) as f64); // f_e, no gradient
    // `Σ_e f_e · P_e = Σ_t Σ_e p[t, e] · f_e / t`: one elementwise product and a sum over
    // everything. (Burn's reduction over dim 0 ran in one block, 0.8 ms for moe-4b's [8192,
    // 32] on an H200; the mean as a product with a row of 1/t, 0.30 ms.)
    let share = share.cast(probabilities.dtype()).unsqueeze::<2>();
    let weighted = probabilities * share;
    weighted.sum().mul_scalar(e as f64 / t as f64)
}
