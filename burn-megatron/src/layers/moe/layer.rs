//! The MoE layer: route, dispatch, run the experts, combine with the routing weights, plus an
//! optional shared expert every token passes through (DeepSeek/Qwen). One rank holds every
//! expert (ep = 1); expert parallelism adds the all-to-all between dispatch and experts.
//!
//! Legend: `b` batch, `s` sequence, `d` d_model.

use burn::config::Config;
use burn::module::Module;
use burn::tensor::{Device, Tensor};
use burn_megatron_dist::ProcessGroups;

use super::capacity::{Capacity, dispatch_with_capacity};
use super::dispatch::{dispatch, permute, unpermute};
use super::experts::{Experts, ExpertsConfig};
use super::router::{Router, RouterConfig, Routing};
use crate::error::LayerError;
use crate::init::ParamInit;
use crate::layers::{ParallelMlp, ParallelMlpConfig};

#[derive(Config, Debug)]
pub struct MoeConfig {
    pub router: RouterConfig,
    /// Each routed expert's hidden size.
    pub d_ff: usize,
    /// The shared expert's hidden size, if there is one.
    #[config(default = "None")]
    pub shared_d_ff: Option<usize>,
    /// Dropless (`None`) or a capacity each expert's copies are cut to.
    #[config(default = "None")]
    pub capacity: Option<Capacity>,
}

#[derive(Module, Debug)]
pub struct Moe {
    pub router: Router,
    pub experts: Experts,
    pub shared: Option<ParallelMlp>,
    #[module(skip)]
    pub capacity: Option<Capacity>,
}

/// The copies each expert ran on in one call, and those dropped for capacity.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Load {
    pub per_expert: Vec<usize>,
    pub dropped: usize,
}

impl MoeConfig {
    pub fn init(
        &self,
        device: &Device,
        groups: &ProcessGroups,
        init: &ParamInit,
        name: &str,
    ) -> Result<Moe, LayerError> {
        let (d, e) = (self.router.d_model, self.router.n_experts);
        if let Some(capacity) = &self.capacity {
            capacity.check()?;
        }
        let router = self.router.init(device, init, &format!("{name}.router"))?;
        let experts = ExpertsConfig::new(d, self.d_ff, e).init(device, init, &format!("{name}.experts"));
        let shared = match self.shared_d_ff {
            Some(f) => Some(ParallelMlpConfig::new(d, f).init(device, groups, init, &format!("{name}.shared"))?),
            None => None,
        };
        Ok(Moe {
            router,
            experts,
            shared,
            capacity: self.capacity,
        })
    }
}

impl Moe {
    /// The layer's output, its routing (the router's losses among it) and the experts' load.
    ///
    /// # Shapes
    /// `x`: `[b, s, d]` → `[b, s, d]`
    pub fn forward(&self, x: Tensor<3>) -> Result<(Tensor<3>, Routing, Load), LayerError> {
        let [b, s, d] = x.dims();
        let tokens = x.clone().reshape([b * s, d]);
        let routing = self.router.forward(tokens.clone(), b)?;
        let e = self.experts.w1.dims()[0];
        let (plan, dropped, pad_to) = match &self.capacity {
            None => (dispatch(routing.experts.clone(), e), 0, None),
            Some(capacity) => {
                let (plan, dropped) = dispatch_with_capacity(routing.experts.clone(), &routing.weights, e, capacity);
                let pad_to = capacity
                    .pad
                    .then(|| capacity.per_expert(b * s, routing.experts.dims()[1], e));
                (plan, dropped, pad_to)
            }
        };
        let routed = self.experts.forward(permute(tokens, &plan), &plan.counts, pad_to);
        let y = unpermute(routed, routing.weights.clone(), &plan).reshape([b, s, d]);
        let y = match &self.shared {
            Some(mlp) => y + mlp.forward(x)?,
            None => y,
        };
        let load = Load {
            per_expert: plan.counts,
            dropped,
        };
        Ok((y, routing, load))
    }
}

#[cfg(test)]
mod tests {
    use burn::module::Param;
    use burn::tensor::activation::silu;
    use burn::tensor::{Distribution, IndexingUpdateOp, Tolerance};

    use super::*;
    use crate::init::InitMode;
    use crate::layers::moe::Scoring;

    /// The dense twin: every expert on every token, each output times the token's weight for
    /// that expert (zero where it was not chosen), summed; the shared expert added.
    fn dense(moe: &Moe, x: Tensor<3>) -> Tensor<3> {
        dense_keeping(moe, x, None)
    }

    /// [`dense`] with only the copies `keep` (`[t, k]`, 1 or 0) weighted.
    fn dense_keeping(moe: &Moe, x: Tensor<3>, keep: Option<Tensor<2>>) -> Tensor<3> {
        let [b, s, d] = x.dims();
        let tokens = x.clone().reshape([b * s, d]);
        let routing = moe.router.forward(tokens.clone(), b).unwrap();
        let [e, _, f] = moe.experts.w1.dims();
        let weights = match keep {
            Some(keep) => routing.weights * keep,
            None => routing.weights,
        };
        let gates =
            Tensor::<2>::zeros([b * s, e], &x.device()).scatter(1, routing.experts, weights, IndexingUpdateOp::Add);
        let w = |p: &Param<Tensor<3>>, i: usize, shape: [usize; 2]| p.val().narrow(0, i, 1).reshape(shape);
        let mut y = Tensor::<2>::zeros([b * s, d], &x.device());
        for i in 0..e {
            let h = silu(tokens.clone().matmul(w(&moe.experts.w1, i, [d, f])))
                * tokens.clone().matmul(w(&moe.experts.w3, i, [d, f]));
            y = y + h.matmul(w(&moe.experts.w2, i, [f, d])) * gates.clone().narrow(1, i, 1);
        }
        let y = y.reshape([b, s, d]);
        match &moe.shared {
            Some(mlp) => y + mlp.forward(x).unwrap(),
            None => y,
        }
    }

    /// The layer against its dense twin, output and every gradient (input, router, experts,
    /// shared expert): the same f32 products summed in another order, within 1e-5. Softmax top 2
    /// with a shared expert; sigmoid with a bias that keeps expert 3 from every token, whose
    /// weights then get a zero gradient.
    #[test]
    fn matches_the_dense_twin() {
        let device = Device::flex().autodiff();
        let cases = [
            (RouterConfig::new(8, 4, 2).with_normalize(true), Some(12), None),
            (
                RouterConfig::new(8, 4, 2)
                    .with_scoring(Scoring::Sigmoid)
                    .with_expert_bias(true),
                None,
                Some(3),
            ),
        ];
        for (router, shared, starved) in cases {
            let config = MoeConfig::new(router, 16).with_shared_d_ff(shared);
            let mut moe = config
                .init(
                    &device,
                    &ProcessGroups::single(),
                    &ParamInit::new(5, InitMode::Full),
                    "moe",
                )
                .unwrap();
            if let Some(i) = starved {
                let mut bias = vec![0.0f32; 4];
                bias[i] = -100.0;
                moe.router.bias = Some(Param::from_tensor(Tensor::from_floats(bias.as_slice(), &device)));
            }
            let x = Tensor::<3>::random([2, 5, 8], Distribution::Normal(0.0, 1.0), &device).require_grad();
            let (ours, routing, _) = moe.forward(x.clone()).unwrap();
            let theirs = dense(&moe, x.clone());
            let tolerance = Tolerance::absolute(1e-5);
            ours.to_data().assert_approx_eq::<f32>(&theirs.to_data(), tolerance);
            let dy = Tensor::<3>::random([2, 5, 8], Distribution::Normal(0.0, 1.0), &device);
            let (g1, g2) = ((ours * dy.clone()).sum().backward(), (theirs * dy).sum().backward());
            let same =
                |a: burn::tensor::TensorData, b: burn::tensor::TensorData| a.assert_approx_eq::<f32>(&b, tolerance);
            same(x.grad(&g1).unwrap().into_data(), x.grad(&g2).unwrap().into_data());
            same(
                moe.router.weight.grad(&g1).unwrap().into_data(),
                moe.router.weight.grad(&g2).unwrap().into_data(),
            );
            for p in [&moe.experts.w1, &moe.experts.w2, &moe.experts.w3] {
                same(p.grad(&g1).unwrap().into_data(), p.grad(&g2).unwrap().into_data());
            }
            if let Some(mlp) = &moe.shared {
                same(
                    mlp.w1.weight.grad(&g1).unwrap().into_data(),
                    mlp.w1.weight.grad(&g2).unwrap().into_data(),
                );
            }
            if let Some(i) = starved {
                let load: Vec<i64> = routing
                    .tokens_per_expert
                    .into_data()
                    .convert::<i64>()
                    .try_to_vec()
                    .unwrap();
                assert_eq!(load[i], 0, "expert {i} starved: {load:?}");
                let g = moe.experts.w1.grad(&g1).unwrap().narrow(0, i, 1);
                assert_eq!(g.abs().max().into_scalar::<f32>(), 0.0);
            }
        }
    }

    /// With a capacity, each expert keeps its highest-weighted copies (or its earliest), as a
    /// reference that decides by hand which copies survive; the dense twin weighting only those
    /// gives the same output and gradients, padding changes nothing, and the dropped copies are
    /// counted.
    #[test]
    fn capacity_drops_the_copies_the_reference_drops() {
        use crate::layers::moe::{Capacity, DropPolicy};
        let device = Device::flex().autodiff();
        let (t, k, e) = (16, 2, 4);
        let x = Tensor::<3>::random([2, 8, 8], Distribution::Normal(0.0, 1.0), &device).require_grad();
        for policy in [DropPolicy::Probs, DropPolicy::Position] {
            let mut outputs = Vec::new();
            for pad in [false, true] {
                let capacity = Capacity::new(0.5).with_policy(policy).with_pad(pad);
                let config = MoeConfig::new(RouterConfig::new(8, e, k), 16).with_capacity(Some(capacity));
                let moe = config
                    .init(
                        &device,
                        &ProcessGroups::single(),
                        &ParamInit::new(9, InitMode::Full),
                        "moe",
                    )
                    .unwrap();
                let (ours, routing, load) = moe.forward(x.clone()).unwrap();
                // The reference's choice: ⌈0.5 · 32 / 4⌉ = 4 copies an expert.
                let chosen: Vec<i64> = routing
                    .experts
                    .clone()
                    .into_data()
                    .convert::<i64>()
                    .try_to_vec()
                    .unwrap();
                let weight: Vec<f32> = routing.weights.clone().into_data().try_to_vec().unwrap();
                let mut keep = vec![0.0f32; t * k];
                for expert in 0..e as i64 {
                    let mut mine: Vec<usize> = (0..t * k).filter(|&c| chosen[c] == expert).collect();
                    if policy == DropPolicy::Probs {
                        mine.sort_by(|&a, &b| weight[b].partial_cmp(&weight[a]).unwrap().then(a.cmp(&b)));
                    }
                    mine.iter().take(4).for_each(|&c| keep[c] = 1.0);
                }
                let kept = keep.iter().filter(|&&v| v == 1.0).count();
                assert_eq!(load.dropped, t * k - kept, "{policy:?}");
                assert_eq!(load.per_expert.iter().sum::<usize>(), kept);
                assert!(load.dropped > 0 && load.per_expert.iter().all(|&n| n <= 4), "{load:?}");
                let keep = Tensor::<2>::from_data(burn::tensor::TensorData::new(keep, [t, k]), &device);
                let theirs = dense_keeping(&moe, x.clone(), Some(keep));
                let tolerance = Tolerance::absolute(1e-5);
                ours.to_data().assert_approx_eq::<f32>(&theirs.to_data(), tolerance);
                let (g1, g2) = (ours.clone().sum().backward(), theirs.sum().backward());
                x.grad(&g1)
                    .unwrap()
                    .into_data()
                    .assert_approx_eq::<f32>(&x.grad(&g2).unwrap().into_data(), tolerance);
                let (a, b) = (moe.experts.w2.grad(&g1).unwrap(), moe.experts.w2.grad(&g2).unwrap());
                a.into_data().assert_approx_eq::<f32>(&b.into_data(), tolerance);
                outputs.push(ours);
            }
            // Padding to the capacity: the same values.
            outputs[0]
                .to_data()
                .assert_approx_eq::<f32>(&outputs[1].to_data(), Tolerance::absolute(1e-6));
        }
        let bad = MoeConfig::new(RouterConfig::new(8, 4, 2), 16).with_capacity(Some(Capacity::new(0.0)));
        let error = bad
            .init(
                &device,
                &ProcessGroups::single(),
                &ParamInit::new(9, InitMode::Full),
                "moe",
            )
            .unwrap_err();
        assert_eq!(
            error,
            LayerError::Config(crate::error::ConfigError::CapacityFactor { factor: 0.0 })
        );
    }
}
