//! Layer normalization that knows about sequence parallelism: Burn's `LayerNorm`, whose weight
//! and bias gradients are summed over the tensor-parallel group when each rank normalizes its
//! own shard of the sequence.

use burn::config::Config;
use burn::module::{Module, Param};
use burn::tensor::module::layer_norm;
use burn::tensor::{Device, Tensor};
use burn_megatron_dist::{ProcessGroup, ProcessGroups};

use super::sequence::SequenceLayout;

use crate::error::LayerError;
use crate::init::ParamInit;

/// Configuration of a [`LayerNorm`]; Burn's `LayerNormConfig` with the input's layout.
#[derive(Config, Debug)]
pub struct LayerNormConfig {
    pub d_model: usize,
    #[config(default = 1e-5)]
    pub epsilon: f64,
    /// Whether the norm adds a learned bias (β).
    #[config(default = true)]
    pub bias: bool,
    /// The input's layout along the sequence (sequence parallelism: shards).
    #[config(default = "SequenceLayout::Whole")]
    pub sequence: SequenceLayout,
}

/// `y = (x − mean(x)) / √(var(x) + ε) · γ + β` over the last dim, as Burn's `LayerNorm`.
///
/// γ and β are whole on every rank. With sequence parallelism each rank normalizes its own
/// tokens, so their gradients on a rank are partial sums, all-reduced over the tensor-parallel
/// group in the backward pass ([`SequenceLayout::replicated`]).
#[derive(Module, Debug)]
pub struct LayerNorm {
    /// `[d_model]`, Burn's name for the weight.
    pub gamma: Param<Tensor<1>>,
    /// `[d_model]`, Burn's name for the bias.
    pub beta: Option<Param<Tensor<1>>>,
    pub epsilon: f64,
    #[module(skip)]
    pub sequence: SequenceLayout,
    #[module(skip)]
    pub tp: ProcessGroup,
}

impl LayerNormConfig {
    /// γ ones and β zeros, whole on every rank; with sequence shards their gradients are
    /// summed over `groups.tp`.
    pub fn init(&self, device: &Device, groups: &ProcessGroups, init: &ParamInit) -> LayerNorm {
        let beta = self.bias.then(|| init.zeros([self.d_model], device));
        LayerNorm::from_parts(init.ones([self.d_model], device), beta, self, groups)
    }

    /// Burn's `norm` (the same on every rank: each keeps all of it), normalizing as this
    /// configuration says. Its ε is this configuration's: Burn's `LayerNorm` keeps its own
    /// private.
    pub fn init_from(&self, norm: burn::nn::LayerNorm, groups: &ProcessGroups) -> LayerNorm {
        LayerNorm::from_parts(norm.gamma.val(), norm.beta.map(|b| b.val()), self, groups)
    }
}

impl LayerNorm {
    fn from_parts(gamma: Tensor<1>, beta: Option<Tensor<1>>, config: &LayerNormConfig, groups: &ProcessGroups) -> Self {
        Self {
            // New leaves: another module's parameters must not stay attached to it.
            gamma: Param::from_tensor(gamma.detach()),
            beta: beta.map(|b| Param::from_tensor(b.detach())),
            epsilon: config.epsilon,
            sequence: config.sequence,
            tp: groups.tp.clone(),
        }
    }

    /// # Shapes
    /// `[.., d_model]` → `[.., d_model]`; under sequence parallelism `[b, s/tp, d_model]`.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Result<Tensor<D>, LayerError> {
        let gamma = self.sequence.replicated(self.gamma.val(), &self.tp)?;
        let beta = match &self.beta {
            Some(beta) => Some(self.sequence.replicated(beta.val(), &self.tp)?),
            None => None,
        };
        Ok(layer_norm(x, gamma, beta, self.epsilon))
    }
}

#[cfg(test)]
mod tests {
    use burn::nn::LayerNormConfig as BurnLayerNormConfig;

    use super::*;
    use crate::init::{InitMode, normal};

    /// Without sequence parallelism the layer is Burn's LayerNorm, value for value: the same
    /// op on the same operands.
    #[test]
    fn matches_burn_layer_norm() {
        let dev = Device::flex();
        let mut theirs = BurnLayerNormConfig::new(8).init(&dev);
        theirs.gamma = Param::from_tensor(normal([8], 3, 1.0, &dev));
        theirs.beta = Some(Param::from_tensor(normal([8], 4, 1.0, &dev)));
        let ours = LayerNormConfig::new(8).init_from(theirs.clone(), &ProcessGroups::single());
        let x = normal([3, 4, 8], 2, 1.0, &dev);
        let (a, b) = (ours.forward(x.clone()).unwrap(), theirs.forward(x));
        a.into_data().assert_eq(&b.into_data(), true);
        let fresh = LayerNormConfig::new(8).with_bias(false).init(
            &dev,
            &ProcessGroups::single(),
            &ParamInit::new(0, InitMode::Full),
        );
        assert!(fresh.beta.is_none());
    }
}
