//! Precision policies: the dtype a model computes in, the matrix product each of its linear
//! layers runs, and what the optimizer keeps beside the parameters. A policy rewrites the
//! model's configuration before `init` (torchtitan's converters; no process state), so FP8 and
//! FP4 recipes land here as further policies.

use burn::tensor::DType;
use burn_megatron_kernels::Gemm;

use crate::init::{InitMode, ParamInit};

/// What the optimizer keeps beside the parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MasterWeights {
    /// fp32 copies of the parameters and fp32 moments (`DistributedAdamW`): the update is
    /// computed and accumulated in fp32, and rounded once to the parameters' dtype.
    F32,
    /// The parameters alone, updated in their own dtype (fp32 moments; `FusedAdamW`).
    None,
}

/// How a model computes and keeps its weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrecisionPolicy {
    /// The dtype of the parameters and activations.
    pub compute: DType,
    /// The linear layers' matrix product, forward and backward.
    pub gemm: Gemm,
    /// The product of the layers a low-precision `gemm` leaves in the compute dtype: the output
    /// layer (Transformer Engine and NVIDIA's FP8/FP4 recipes keep it in bf16).
    pub kept: Gemm,
    pub master: MasterWeights,
}

/// A model configuration whose linear layers a policy sets, each by its path in the model.
pub trait PrecisionTarget {
    fn linear_gemms(&mut self) -> Vec<(&'static str, &mut Gemm)>;
}

impl PrecisionPolicy {
    /// f32 parameters and compute on Burn's matmul (the parity suites' policy).
    pub fn f32() -> Self {
        Self {
            compute: DType::F32,
            gemm: Gemm::Burn,
            kept: Gemm::Burn,
            master: MasterWeights::F32,
        }
    }

    /// bf16 parameters and compute on our wgmma GEMM, fp32 master weights and moments in the
    /// optimizer: the recipe of Megatron and of PyTorch's mixed precision.
    pub fn bf16() -> Self {
        Self {
            compute: DType::BF16,
            gemm: Gemm::Wgmma,
            kept: Gemm::Wgmma,
            master: MasterWeights::F32,
        }
    }

    /// bf16 parameters updated in bf16 (no master weights): cheaper, and not the peers' recipe.
    pub fn pure_bf16() -> Self {
        Self {
            master: MasterWeights::None,
            ..Self::bf16()
        }
    }

    /// FP8 with per-tensor current scaling (E4M3 forward, E5M2 gradients) in every block's
    /// linear layers, the output layer in bf16 on our wgmma GEMM; bf16 compute, fp32 master
    /// weights.
    pub fn fp8_tensorwise() -> Self {
        Self {
            gemm: Gemm::Fp8Tensorwise,
            ..Self::bf16()
        }
    }

    /// The same policy with every linear layer on `gemm` (the output layer too, unless `gemm`
    /// is low precision: it keeps [`kept`](Self::kept)).
    pub fn with_gemm(self, gemm: Gemm) -> Self {
        let kept = match gemm {
            Gemm::Fp8Tensorwise => self.kept,
            other => other,
        };
        Self { gemm, kept, ..self }
    }

    /// `config` with its linear layers set to this policy's product, the output layer to
    /// [`kept`](Self::kept).
    pub fn apply<M: PrecisionTarget>(&self, mut config: M) -> M {
        for (path, gemm) in config.linear_gemms() {
            *gemm = match path {
                "output" => self.kept,
                _ => self.gemm,
            };
        }
        config
    }

    /// Whether this policy runs at the layout `dims`: FP8 scales each tensor by its amax, which
    /// under tensor parallelism must be reduced over the group holding the tensor's pieces (not
    /// built yet), so FP8 runs at tp = 1 only.
    pub fn check(&self, dims: burn_megatron_dist::ParallelDims) -> Result<(), crate::error::ConfigError> {
        match (self.gemm, dims.tp) {
            (Gemm::Fp8Tensorwise, tp) if tp > 1 => Err(crate::error::ConfigError::Fp8AtTensorParallel { tp }),
            _ => Ok(()),
        }
    }

    /// Parameters initialized from `seed` in this policy's dtype.
    pub fn init(&self, seed: u64, mode: InitMode) -> ParamInit {
        ParamInit::new(seed, mode).with_dtype(self.compute)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::llama::recipes;

    #[test]
    fn a_policy_sets_every_linear_layers_product() {
        let config = PrecisionPolicy::f32().apply(recipes::tiny().model);
        assert_eq!(
            (config.attention.gemm, config.mlp.gemm, config.output.gemm),
            (Gemm::Burn, Gemm::Burn, Gemm::Burn)
        );
        let config = PrecisionPolicy::bf16().apply(config);
        assert_eq!(
            (config.attention.gemm, config.mlp.gemm, config.output.gemm),
            (Gemm::Wgmma, Gemm::Wgmma, Gemm::Wgmma)
        );
        assert_eq!(PrecisionPolicy::bf16().init(1, InitMode::Full).dtype, DType::BF16);
    }

    /// FP8 runs in the blocks' linear layers; the output layer stays on the bf16 GEMM, also when
    /// FP8 is chosen with `with_gemm`.
    #[test]
    fn fp8_keeps_the_output_layer_in_bf16() {
        for policy in [
            PrecisionPolicy::fp8_tensorwise(),
            PrecisionPolicy::bf16().with_gemm(Gemm::Fp8Tensorwise),
        ] {
            let config = policy.apply(recipes::tiny().model);
            assert_eq!(
                (config.attention.gemm, config.mlp.gemm, config.output.gemm),
                (Gemm::Fp8Tensorwise, Gemm::Fp8Tensorwise, Gemm::Wgmma)
            );
        }
        let config = PrecisionPolicy::fp8_tensorwise()
            .with_gemm(Gemm::Burn)
            .apply(recipes::tiny().model);
        assert_eq!(config.output.gemm, Gemm::Burn);
    }

    /// FP8 runs at tp = 1 (any dp) and is refused by name at tp > 1, where each amax would need
    /// a reduction over tp.
    #[test]
    fn fp8_is_refused_under_tensor_parallelism() {
        use burn_megatron_dist::ParallelDims;
        let fp8 = PrecisionPolicy::fp8_tensorwise();
        assert_eq!(fp8.check(ParallelDims::tp_dp(1, 4)), Ok(()));
        assert_eq!(
            fp8.check(ParallelDims::tp_dp(2, 1)),
            Err(crate::error::ConfigError::Fp8AtTensorParallel { tp: 2 })
        );
        assert_eq!(PrecisionPolicy::bf16().check(ParallelDims::tp_dp(2, 1)), Ok(()));
    }
}
