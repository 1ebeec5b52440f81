//! The MoE layer: route, dispatch, run the experts, combine with the routing weights, plus an
//! optional shared expert every token passes through (DeepSeek/Qwen). One rank holds every
//! expert (ep = 1); expert parallelism adds the all-to-all between dispatch and experts.
//!
//! Legend: `b` batch, `s` sequence, `d` d_model.

use burn::config::Config;
use burn::module::Module;
use burn::tensor::{Device, Tensor};
use burn_megatron_dist::ProcessGroups;

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
}

#[derive(Module, Debug)]
pub struct Moe {
    pub router: Router,
    pub experts: Experts,
    pub shared: Option<ParallelMlp>,
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
        })
    }
}

impl Moe {
    /// The layer's output and its routing (the router's losses and each expert's load).
    ///
    /// # Shapes
    /// `x`: `[b, s, d]` → `[b, s, d]`
    pub fn forward(&self, x: Tensor<3>) -> Result<(Tensor<3>, Routing), LayerError> {
        let [b, s, d] = x.dims();
        let tokens = x.clone().reshape([b * s, d]);
        let routing = self.router.forward(tokens.clone(), b)?;
        let plan = dispatch(routing.experts.clone(), self.experts.w1.dims()[0]);
        let routed = self.experts.forward(permute(tokens, &plan), &plan.counts);
        let y = unpermute(routed, routing.weights.clone(), &plan).reshape([b, s, d]);
        let y = match &self.shared {
            Some(mlp) => y + mlp.forward(x)?,
            None => y,
        };
        Ok((y, routing))
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
        let [b, s, d] = x.dims();
        let tokens = x.clone().reshape([b * s, d]);
        let routing = moe.router.forward(tokens.clone(), b).unwrap();
        let [e, _, f] = moe.experts.w1.dims();
        let gates = Tensor::<2>::zeros([b * s, e], &x.device()).scatter(
            1,
            routing.experts,
            routing.weights,
            IndexingUpdateOp::Add,
        );
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
            let (ours, routing) = moe.forward(x.clone()).unwrap();
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
}
