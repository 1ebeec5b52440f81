//! AdamW as a Burn [`Optimizer`] whose step is one fused kernel a parameter on CUDA
//! (`burn_megatron_kernels::adamw`), with f32 moments. A drop-in for Burn's `AdamWConfig` where
//! a model trains without the distributed optimizer (Burn's `Learner`, the benchmarks). The
//! kernel updates a parameter and its moments in place when nothing else holds them. Burn's
//! optimizers step one tensor at a time, with no end of step: a loop of its own calls
//! [`release_freed_pages`](super::release_freed_pages) after each step.

use burn::config::Config;
use burn::optim::{AdaptiveMomentumState, LearningRate, ModuleOptimizer, Optimizer};
use burn::tensor::{DType, Device, Tensor};
use burn_megatron_kernels::adamw::{AdamWStep, adamw_step};

/// Configuration of a [`FusedAdamW`]. The defaults are PyTorch's and Megatron's (Burn's own
/// AdamW defaults to ε = 1e-5 and λ = 1e-4).
#[derive(Config, Debug)]
pub struct FusedAdamWConfig {
    #[config(default = 0.9)]
    pub beta_1: f32,
    #[config(default = 0.999)]
    pub beta_2: f32,
    #[config(default = 1e-8)]
    pub epsilon: f32,
    #[config(default = 0.01)]
    pub weight_decay: f32,
}

impl FusedAdamWConfig {
    /// The bare optimizer, for [`ModuleOptimizer::with_group`].
    pub fn build(&self) -> FusedAdamW {
        FusedAdamW {
            beta_1: self.beta_1,
            beta_2: self.beta_2,
            epsilon: self.epsilon,
            weight_decay: self.weight_decay,
        }
    }

    /// The optimizer of a whole module.
    pub fn init(&self) -> ModuleOptimizer {
        ModuleOptimizer::from(self.build())
    }
}

/// AdamW with decoupled weight decay, one fused update a parameter.
#[derive(Clone, Debug)]
pub struct FusedAdamW {
    beta_1: f32,
    beta_2: f32,
    epsilon: f32,
    weight_decay: f32,
}

impl Optimizer for FusedAdamW {
    /// Burn's Adam state (so Burn's checkpoints record it), with f32 moments.
    type State<const D: usize> = AdaptiveMomentumState<D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<D>, Option<Self::State<D>>) {
        let (time, m, v) = match state {
            Some(s) => (s.time + 1, s.moment_1, s.moment_2),
            None => {
                let zeros = Tensor::<D>::zeros(tensor.dims(), (&tensor.device(), DType::F32));
                (1, zeros.clone(), zeros)
            }
        };
        let step = AdamWStep {
            lr: lr as f32,
            beta_1: self.beta_1,
            beta_2: self.beta_2,
            epsilon: self.epsilon,
            weight_decay: self.weight_decay,
            time: time as u32,
            grad_scale: 1.0,
        };
        let (tensor, moment_1, moment_2) = adamw_step(tensor, grad, m, v, step);
        (tensor, Some(AdaptiveMomentumState::new(time, moment_1, moment_2)))
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device) -> Self::State<D> {
        AdaptiveMomentumState::new(
            state.time,
            state.moment_1.to_device(device),
            state.moment_2.to_device(device),
        )
    }
}

#[cfg(test)]
mod tests {
    use burn::module::{Module, Param};
    use burn::optim::{AdamWConfig, GradientsParams};
    use burn::tensor::{Device, Distribution, Tensor, Tolerance};

    use super::*;

    #[derive(Module, Debug)]
    struct Net {
        w: Param<Tensor<2>>,
    }

    /// Through `ModuleOptimizer`, three steps of a module match Burn's AdamW configured alike.
    #[test]
    fn matches_burns_adamw_on_a_module() {
        let device = Device::flex().autodiff();
        let w = Tensor::<2>::random([4, 6], Distribution::Normal(0.0, 1.0), &device);
        let (mut ours, mut theirs) = (
            Net {
                w: Param::from_tensor(w.clone()),
            },
            Net {
                w: Param::from_tensor(w),
            },
        );
        let mut fused = FusedAdamWConfig::new().init();
        let mut burn = AdamWConfig::new().with_epsilon(1e-8).with_weight_decay(0.01).init();
        let x = Tensor::<2>::random([3, 4], Distribution::Normal(0.0, 1.0), &device);
        for _ in 0..3 {
            let grads = GradientsParams::from_grads(x.clone().matmul(ours.w.val()).square().sum().backward(), &ours);
            ours = fused.step(1e-2, ours, grads);
            let grads =
                GradientsParams::from_grads(x.clone().matmul(theirs.w.val()).square().sum().backward(), &theirs);
            theirs = burn.step(1e-2, theirs, grads);
        }
        // f32 both ways: a few ulps of values of order 1.
        ours.w
            .val()
            .to_data()
            .assert_approx_eq::<f32>(&theirs.w.val().to_data(), Tolerance::absolute(1e-5));
    }
}
