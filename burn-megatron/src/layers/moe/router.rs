//! The router of a mixture of experts (Megatron Core's `TopKRouter`): each token's scores over
//! the experts from a linear layer computed in f32, its top k experts and their weights.
//!
//! - Scoring: softmax (Switch, Mixtral) or sigmoid (DeepSeek-V3) of the logits.
//! - Selection: the k highest scores; with an expert bias (DeepSeek-V3's auxiliary-loss-free
//!   balancing) the highest `score + bias`, the bias steering the choice only, never the weights.
//!   Group-limited routing first keeps the `top_groups` groups of experts whose two best scores
//!   sum highest, then picks the k among them. Ties go to the lower expert index.
//! - Weights: the chosen experts' scores, renormalized to sum to 1 when `normalize` (always
//!   meaningful for sigmoid scores), times `scaling`.
//!
//! Legend: `t` tokens, `d` d_model, `e` experts, `k` top k.

use burn::config::Config;
use burn::module::{Module, Param};
use burn::tensor::{DType, Device, Int, Tensor};
pub use burn_megatron_kernels::top_k::top_k;

use super::balance::{LossWeights, RouterLosses, balance_losses, counts};
use crate::error::ConfigError;
use crate::init::{ParamInit, Shard};

/// How logits become scores.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum Scoring {
    Softmax,
    Sigmoid,
}

/// Group-limited routing: experts in `groups` equal groups, tokens routed within the best
/// `top_groups` of them (DeepSeek-V3's node-limited routing).
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub struct GroupLimit {
    pub groups: usize,
    pub top_groups: usize,
}

#[derive(Config, Debug)]
pub struct RouterConfig {
    pub d_model: usize,
    pub n_experts: usize,
    pub top_k: usize,
    #[config(default = "Scoring::Softmax")]
    pub scoring: Scoring,
    /// Renormalize the chosen experts' weights to sum to 1.
    #[config(default = false)]
    pub normalize: bool,
    /// A factor on the weights (DeepSeek-V3's `routed_scaling_factor`).
    #[config(default = 1.0)]
    pub scaling: f64,
    #[config(default = "None")]
    pub group_limit: Option<GroupLimit>,
    /// Keep a per-expert bias that steers selection (auxiliary-loss-free balancing).
    #[config(default = false)]
    pub expert_bias: bool,
    /// How far the bias moves a step (DeepSeek-V3's γ; Megatron's `moe_router_bias_update_rate`).
    #[config(default = 1e-3)]
    pub bias_update_rate: f64,
    /// Coefficient of the Switch/GShard load-balancing loss over the whole batch.
    #[config(default = 0.0)]
    pub aux_loss: f64,
    /// Coefficient of the same loss per sequence, averaged over sequences (DeepSeek-V3's).
    #[config(default = 0.0)]
    pub seq_aux_loss: f64,
    /// Coefficient of the router z-loss, the mean squared log-sum-exp of the logits.
    #[config(default = 0.0)]
    pub z_loss: f64,
    #[config(default = 0.02)]
    pub init_std: f64,
}

/// The router's parameters: the scoring layer and, optionally, the selection bias (not trained
/// by gradients: [`Router::update_bias`] moves it).
#[derive(Module, Debug)]
pub struct Router {
    /// `[d, e]`, Burn's layout.
    pub weight: Param<Tensor<2>>,
    /// `[e]`, f32.
    pub bias: Option<Param<Tensor<1>>>,
    #[module(skip)]
    pub settings: RouterSettings,
}

/// The router's choices, kept beside its parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RouterSettings {
    pub top_k: usize,
    pub bias_update_rate: f64,
    pub scoring: Scoring,
    pub normalize: bool,
    pub scaling: f64,
    pub group_limit: Option<GroupLimit>,
    pub aux_loss: f64,
    pub seq_aux_loss: f64,
    pub z_loss: f64,
}

/// Where each token goes.
#[derive(Clone, Debug)]
pub struct Routing {
    /// `[t, k]`: the chosen experts, best first.
    pub experts: Tensor<2, Int>,
    /// `[t, k]`, f32: their weights (differentiable through the scores).
    pub weights: Tensor<2>,
    /// `[t, e]`, f32: every expert's score.
    pub scores: Tensor<2>,
    /// `[e]`: the tokens each expert received.
    pub tokens_per_expert: Tensor<1, Int>,
    pub losses: RouterLosses,
}

impl RouterConfig {
    /// Checks the choices before any tensor exists.
    pub fn check(&self) -> Result<(), ConfigError> {
        let (e, k) = (self.n_experts, self.top_k);
        if e == 0 || k == 0 {
            return Err(ConfigError::Zero {
                what: "experts and top k",
            });
        }
        if k > e {
            return Err(ConfigError::TopKAboveExperts { top_k: k, experts: e });
        }
        if let Some(GroupLimit { groups, top_groups }) = self.group_limit {
            if groups == 0 || !e.is_multiple_of(groups) || top_groups == 0 || top_groups > groups {
                return Err(ConfigError::ExpertGroups {
                    experts: e,
                    groups,
                    top_groups,
                });
            }
            if k > top_groups * (e / groups) {
                return Err(ConfigError::TopKAboveExperts {
                    top_k: k,
                    experts: top_groups * (e / groups),
                });
            }
        }
        Ok(())
    }

    /// A router whose weight the parameter `name` seeds.
    pub fn init(&self, device: &Device, init: &ParamInit, name: &str) -> Result<Router, ConfigError> {
        self.check()?;
        let weight = init.normal(
            &format!("{name}.weight"),
            [self.d_model, self.n_experts],
            Shard::WHOLE,
            self.init_std,
            device,
        );
        let bias = self
            .expert_bias
            .then(|| Param::from_tensor(Tensor::zeros([self.n_experts], (device, DType::F32))).set_require_grad(false));
        Ok(Router {
            weight: Param::from_tensor(weight),
            bias,
            settings: RouterSettings {
                top_k: self.top_k,
                bias_update_rate: self.bias_update_rate,
                scoring: self.scoring,
                normalize: self.normalize,
                scaling: self.scaling,
                group_limit: self.group_limit,
                aux_loss: self.aux_loss,
                seq_aux_loss: self.seq_aux_loss,
                z_loss: self.z_loss,
            },
        })
    }
}

impl Router {
    /// Routes `x`'s tokens; `sequences` is how many sequences they are, of equal length (the
    /// per-sequence loss reads them).
    ///
    /// # Shapes
    /// `x`: `[t, d]`
    pub fn forward(&self, x: Tensor<2>, sequences: usize) -> Result<Routing, ConfigError> {
        let s = self.settings;
        let [t, _] = x.dims();
        if sequences == 0 || !t.is_multiple_of(sequences) {
            return Err(ConfigError::TokensNotInSequences { tokens: t, sequences });
        }
        // [t, e], the products in f32 (one kernel a direction on CUDA).
        let logits = burn_megatron_kernels::router::logits(x, self.weight.val());
        let [_, e] = logits.dims();
        let scores = match s.scoring {
            Scoring::Softmax => burn::tensor::activation::softmax(logits.clone(), 1),
            Scoring::Sigmoid => burn::tensor::activation::sigmoid(logits.clone()),
        };
        let mut choosing = scores.clone().detach();
        if let Some(bias) = &self.bias {
            choosing = choosing + bias.val().unsqueeze::<2>();
        }
        if let Some(limit) = s.group_limit {
            choosing = limit_groups(choosing, limit);
        }
        let experts = top_k(choosing, s.top_k); // [t, k]
        let chosen = scores.clone().gather(1, experts.clone());
        let weights = match s.normalize {
            true => chosen.clone() / chosen.sum_dim(1),
            false => chosen,
        };
        let weights = weights.mul_scalar(s.scaling);
        let tokens_per_expert = counts(experts.clone(), e);
        // Softmax scores are probabilities already; sigmoid scores are normalized per token.
        let probabilities = match s.scoring {
            Scoring::Softmax => scores.clone(),
            Scoring::Sigmoid => scores.clone() / scores.clone().sum_dim(1),
        };
        let weights_of_losses = LossWeights {
            aux: s.aux_loss,
            seq_aux: s.seq_aux_loss,
            z: s.z_loss,
        };
        let chosen = (&experts, &tokens_per_expert);
        let losses = balance_losses(weights_of_losses, &logits, &probabilities, chosen, t / sequences);
        Ok(Routing {
            experts,
            weights,
            scores,
            tokens_per_expert,
            losses,
        })
    }

    /// Auxiliary-loss-free balancing: each expert's bias moves by `rate` toward balance, up for
    /// an expert that received fewer tokens than the mean and down for one that received more
    /// (DeepSeek-V3's `bias += rate · sign(mean − load)`), outside the gradient. `load` is the
    /// tokens each expert received over the step (summed over the data-parallel ranks by the
    /// caller). A router without a bias is returned unchanged.
    pub fn update_bias(mut self, load: Tensor<1, Int>, rate: f64) -> Self {
        if let Some(bias) = self.bias.take() {
            let load = load.float().cast(DType::F32);
            let mean = load.clone().mean();
            let step = (mean.unsqueeze::<1>() - load).sign().mul_scalar(rate);
            self.bias = Some(bias.map(|b| (b.detach() + step).detach()));
        }
        self
    }
}

/// `scores` with every expert outside each token's best `top_groups` groups set to −∞; a
/// group's worth is the sum of its two best scores (one, for groups of one expert).
fn limit_groups(scores: Tensor<2>, limit: GroupLimit) -> Tensor<2> {
    let [t, e] = scores.dims();
    let size = e / limit.groups;
    let grouped: Tensor<3> = scores.clone().reshape([t, limit.groups, size]);
    let worth = grouped.topk(size.min(2), 2).sum_dim(2).reshape([t, limit.groups]);
    let keep = top_k(worth, limit.top_groups); // [t, top_groups]
    let kept = Tensor::<2>::zeros([t, limit.groups], &scores.device()).scatter(
        1,
        keep.clone(),
        Tensor::ones(keep.dims(), &scores.device()),
        burn::tensor::IndexingUpdateOp::Assign,
    );
    let mask: Tensor<2> = kept.unsqueeze_dim::<3>(2).repeat_dim(2, size).reshape([t, e]);
    scores.mask_fill(mask.equal_elem(0.0), f32::NEG_INFINITY)
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Distribution, TensorData};

    use super::*;
    use crate::init::InitMode;

    fn device() -> Device {
        Device::flex()
    }

    fn host(t: Tensor<2>) -> Vec<f32> {
        t.into_data().try_to_vec().unwrap()
    }

    fn ids(t: Tensor<2, Int>) -> Vec<i64> {
        t.into_data().convert::<i64>().try_to_vec().unwrap()
    }

    /// A router of `config` whose weight is `weight` (`[d, e]`, row-major).
    fn router(config: &RouterConfig, weight: Vec<f32>) -> Router {
        let mut r = config
            .init(&device(), &ParamInit::new(0, InitMode::Full), "router")
            .unwrap();
        let w = Tensor::<2>::from_data(TensorData::new(weight, [config.d_model, config.n_experts]), &device());
        r.weight = Param::from_tensor(w);
        r
    }

    /// The reference: scores and the top k (ties to the lower index) of one row, by hand.
    fn reference_top_k(row: &[f32], k: usize) -> Vec<usize> {
        let mut order: Vec<usize> = (0..row.len()).collect();
        order.sort_by(|&a, &b| row[b].partial_cmp(&row[a]).unwrap().then(a.cmp(&b)));
        order.truncate(k);
        order
    }

    #[test]
    fn top_k_breaks_ties_to_the_lower_index() {
        let scores = Tensor::<2>::from_data(
            [[0.1, 0.5, 0.5, 0.2], [1.0, 1.0, 1.0, 1.0], [0.0, -1.0, 3.0, 2.0]],
            &device(),
        );
        assert_eq!(ids(top_k(scores.clone(), 2)), [1, 2, 0, 1, 2, 3]);
        // k = e: every index, best first.
        assert_eq!(ids(top_k(scores, 4)), [1, 2, 3, 0, 0, 1, 2, 3, 2, 3, 0, 1]);
    }

    /// Softmax and sigmoid routing against a hand-written reference: the same experts (ties the
    /// same way) and weights within f32 rounding (1e-5 of values below 1).
    #[test]
    fn routing_matches_a_reference() {
        let (t, d, e, k) = (12, 8, 6, 2);
        let x = Tensor::<2>::random([t, d], Distribution::Normal(0.0, 1.0), &device());
        let w = host(Tensor::<2>::random([d, e], Distribution::Normal(0.0, 0.5), &device()));
        let xs = host(x.clone());
        for (scoring, normalize) in [
            (Scoring::Softmax, false),
            (Scoring::Softmax, true),
            (Scoring::Sigmoid, true),
        ] {
            let config = RouterConfig::new(d, e, k)
                .with_scoring(scoring)
                .with_normalize(normalize)
                .with_scaling(2.5);
            let routing = router(&config, w.clone()).forward(x.clone(), 1).unwrap();
            let (experts, weights) = (ids(routing.experts), host(routing.weights));
            for row in 0..t {
                let logits: Vec<f32> = (0..e)
                    .map(|j| (0..d).map(|i| xs[row * d + i] * w[i * e + j]).sum())
                    .collect();
                let scores: Vec<f32> = match scoring {
                    Scoring::Softmax => {
                        let top = logits.iter().cloned().fold(f32::MIN, f32::max);
                        let sum: f32 = logits.iter().map(|l| (l - top).exp()).sum();
                        logits.iter().map(|l| (l - top).exp() / sum).collect()
                    }
                    Scoring::Sigmoid => logits.iter().map(|l| 1.0 / (1.0 + (-l).exp())).collect(),
                };
                let chosen = reference_top_k(&scores, k);
                let total: f32 = chosen.iter().map(|&c| scores[c]).sum();
                for (slot, &c) in chosen.iter().enumerate() {
                    assert_eq!(experts[row * k + slot], c as i64, "{scoring:?} row {row}");
                    let expected = 2.5 * if normalize { scores[c] / total } else { scores[c] };
                    let got = weights[row * k + slot];
                    assert!(
                        (got - expected).abs() < 1e-5,
                        "{scoring:?} row {row}: {got} vs {expected}"
                    );
                }
            }
        }
    }

    /// The expert bias steers selection and never the weights: a large bias on expert 3 puts
    /// it in every token's top 2 with its own (unbiased) score as weight.
    #[test]
    fn the_bias_steers_selection_only() {
        let config = RouterConfig::new(4, 5, 2)
            .with_scoring(Scoring::Sigmoid)
            .with_expert_bias(true);
        let x = Tensor::<2>::random([7, 4], Distribution::Normal(0.0, 1.0), &device());
        let w = host(Tensor::<2>::random([4, 5], Distribution::Normal(0.0, 1.0), &device()));
        let mut r = router(&config, w);
        r.bias = Some(Param::from_tensor(Tensor::from_data(
            [0.0, 0.0, 0.0, 10.0, 0.0],
            &device(),
        )));
        let routing = r.forward(x, 1).unwrap();
        let (experts, weights, scores) = (ids(routing.experts), host(routing.weights), host(routing.scores));
        for row in 0..7 {
            assert_eq!(experts[row * 2], 3, "row {row}");
            assert_eq!(weights[row * 2], scores[row * 5 + 3], "row {row}");
        }
    }

    /// Group-limited routing picks within the best groups (worth: the sum of a group's two best
    /// scores), against a reference that masks the other groups by hand.
    #[test]
    fn group_limited_routing_stays_in_the_best_groups() {
        let (t, d, e) = (16, 6, 8);
        let config = RouterConfig::new(d, e, 3)
            .with_scoring(Scoring::Sigmoid)
            .with_group_limit(Some(GroupLimit::new(4, 2)));
        let x = Tensor::<2>::random([t, d], Distribution::Normal(0.0, 1.0), &device());
        let w = host(Tensor::<2>::random([d, e], Distribution::Normal(0.0, 1.0), &device()));
        let routing = router(&config, w).forward(x, 1).unwrap();
        let (experts, scores) = (ids(routing.experts), host(routing.scores));
        for row in 0..t {
            let s = &scores[row * e..(row + 1) * e];
            let worth: Vec<f32> = (0..4).map(|g| s[2 * g] + s[2 * g + 1]).collect();
            let groups = reference_top_k(&worth, 2);
            let masked: Vec<f32> = (0..e)
                .map(|j| {
                    if groups.contains(&(j / 2)) {
                        s[j]
                    } else {
                        f32::NEG_INFINITY
                    }
                })
                .collect();
            let expected: Vec<i64> = reference_top_k(&masked, 3).into_iter().map(|c| c as i64).collect();
            assert_eq!(&experts[row * 3..row * 3 + 3], expected.as_slice(), "row {row}");
        }
    }

    /// The losses in closed form: every token's logits `[a, 0, 0, 0]`, top 1, softmax. Every
    /// token picks expert 0 (f = [1, 0, 0, 0]) with probability `p = eᵃ / (eᵃ + 3)`, so
    /// aux = c · 4 · p (per sequence the same), z = c · ln(eᵃ + 3)².
    #[test]
    fn losses_have_their_closed_forms() {
        let a = 1.5f32;
        let config = RouterConfig::new(1, 4, 1)
            .with_aux_loss(0.01)
            .with_seq_aux_loss(0.1)
            .with_z_loss(0.001);
        let routing = router(&config, vec![a, 0.0, 0.0, 0.0])
            .forward(Tensor::ones([6, 1], &device()), 2)
            .unwrap();
        let p = a.exp() / (a.exp() + 3.0);
        let lse = (a.exp() + 3.0).ln();
        let value = |t: Option<Tensor<1>>| t.unwrap().into_scalar::<f32>();
        let names: Vec<&str> = routing.losses.named().iter().map(|(n, _)| *n).collect();
        assert_eq!(names, ["aux_loss", "seq_aux_loss", "z_loss"]);
        assert!((value(routing.losses.aux.clone()) - 0.01 * 4.0 * p).abs() < 1e-6);
        assert!((value(routing.losses.seq_aux.clone()) - 0.1 * 4.0 * p).abs() < 1e-6);
        assert!((value(routing.losses.z.clone()) - 0.001 * lse * lse).abs() < 1e-6);
        assert_eq!(
            routing
                .tokens_per_expert
                .into_data()
                .convert::<i64>()
                .try_to_vec::<i64>()
                .unwrap(),
            [6, 0, 0, 0]
        );
        // Balanced routing gives the coefficient itself: every token choosing all four experts
        // (k = 4), f = P = 1/4 and aux = c · 4 · 4 · 1/16 = c.
        let balanced = RouterConfig::new(1, 4, 4).with_aux_loss(0.01);
        let routing = router(&balanced, vec![0.0; 4])
            .forward(Tensor::ones([3, 1], &device()), 1)
            .unwrap();
        assert!((value(routing.losses.aux) - 0.01).abs() < 1e-7);
        // No coefficient, no loss.
        let plain = router(&RouterConfig::new(1, 4, 1), vec![0.0; 4])
            .forward(Tensor::ones([2, 1], &device()), 1)
            .unwrap();
        assert!(plain.losses.total().is_none());
    }

    /// The losses reach the router's weight: the aux loss pulls probability away from the
    /// crowded expert.
    #[test]
    fn the_aux_loss_has_a_gradient() {
        let dev = device().autodiff();
        let config = RouterConfig::new(1, 4, 1).with_aux_loss(1.0);
        let mut r = config.init(&dev, &ParamInit::new(0, InitMode::Full), "router").unwrap();
        r.weight = Param::from_tensor(Tensor::from_data([[1.5, 0.0, 0.0, 0.0]], &dev).require_grad());
        let routing = r.forward(Tensor::ones([4, 1], &dev), 1).unwrap();
        let grads = routing.losses.total().unwrap().backward();
        let g: Vec<f32> = r.weight.grad(&grads).unwrap().into_data().try_to_vec().unwrap();
        assert!(g[0] > 0.0 && g[1] < 0.0, "descending moves weight off expert 0: {g:?}");
    }

    /// The bias moves by the rate toward the mean load, outside the gradient.
    #[test]
    fn the_bias_update_follows_its_formula() {
        let config = RouterConfig::new(2, 4, 1).with_expert_bias(true);
        let r = config
            .init(&device(), &ParamInit::new(0, InitMode::Full), "router")
            .unwrap();
        let load = Tensor::<1, Int>::from_data([10, 2, 6, 6], &device());
        let bias: Vec<f32> = r
            .update_bias(load, 0.01)
            .bias
            .unwrap()
            .val()
            .into_data()
            .try_to_vec()
            .unwrap();
        assert_eq!(bias, [-0.01, 0.01, 0.0, 0.0]);
    }

    #[test]
    fn bad_choices_are_typed_errors() {
        let check = |c: RouterConfig| c.check().unwrap_err();
        assert_eq!(
            check(RouterConfig::new(8, 4, 5)),
            ConfigError::TopKAboveExperts { top_k: 5, experts: 4 }
        );
        assert_eq!(
            check(RouterConfig::new(8, 6, 2).with_group_limit(Some(GroupLimit::new(4, 2)))),
            ConfigError::ExpertGroups {
                experts: 6,
                groups: 4,
                top_groups: 2
            }
        );
        assert_eq!(
            check(RouterConfig::new(8, 8, 2).with_group_limit(Some(GroupLimit::new(4, 5)))),
            ConfigError::ExpertGroups {
                experts: 8,
                groups: 4,
                top_groups: 5
            }
        );
        assert_eq!(
            check(RouterConfig::new(8, 8, 5).with_group_limit(Some(GroupLimit::new(4, 2)))),
            ConfigError::TopKAboveExperts { top_k: 5, experts: 4 }
        );
        assert!(matches!(check(RouterConfig::new(8, 0, 1)), ConfigError::Zero { .. }));
        let r = router(&RouterConfig::new(1, 4, 1), vec![0.0; 4]);
        assert_eq!(
            r.forward(Tensor::ones([5, 1], &device()), 2).unwrap_err(),
            ConfigError::TokensNotInSequences {
                tokens: 5,
                sequences: 2
            }
        );
    }
}
