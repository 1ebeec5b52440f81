//! Precision policies: the dtype a model computes in, the matrix product each of its linear
//! layers runs, and what the optimizer keeps beside the parameters. A policy rewrites the
//! model's configuration before `init` (torchtitan's converters; no process state). The FP8 and
//! FP4 recipes (`burn_megatron_kernels::quant::recipe`) are policies whose blocks' linear layers
//! run [`Gemm::Quantized`], with the output layer and the edge blocks the recipe names
//! ([`KeptBlocks`]) left on the compute dtype's product.

pub mod amax;
mod blocks;
pub mod delayed;
pub mod linear;
pub mod ptq;

use burn::tensor::DType;
use burn_megatron_kernels::Gemm;
use burn_megatron_kernels::quant::recipe::Recipe;

pub use blocks::{EdgeBlocks, KeptBlocks};

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
    /// The blocks whose linear layers also keep [`kept`](Self::kept) under a low-precision
    /// `gemm`.
    pub kept_blocks: KeptBlocks,
    pub master: MasterWeights,
}

/// A model configuration whose linear layers a policy sets, each by its path in the model.
pub trait PrecisionTarget {
    fn linear_gemms(&mut self) -> Vec<(&'static str, &mut Gemm)>;
    /// The model's number of blocks, and where it keeps the product of its edge blocks.
    fn edge_blocks(&mut self) -> (usize, &mut Option<EdgeBlocks>);
}

impl PrecisionPolicy {
    /// f32 parameters and compute on Burn's matmul (the parity suites' policy).
    pub fn f32() -> Self {
        Self {
            compute: DType::F32,
            gemm: Gemm::Burn,
            kept: Gemm::Burn,
            kept_blocks: KeptBlocks::NONE,
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
            kept_blocks: KeptBlocks::NONE,
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

    /// `recipe` in every block's linear layers (bar the edge blocks the recipe keeps: NVFP4's
    /// last 15%, as NVIDIA's recipe), the output layer in bf16 on our wgmma GEMM; bf16 compute,
    /// fp32 master weights.
    pub fn quantized(recipe: Recipe) -> Self {
        Self::bf16().with_gemm(Gemm::Quantized(recipe))
    }

    /// FP8 with per-tensor current scaling as Transformer Engine and torchao train it: E4M3
    /// forward, E5M2 gradients, the gradient products promoted (`Recipe::Fp8TensorwisePromoted`;
    /// the fast-accumulating `Recipe::Fp8Tensorwise` ended 1.3% above bf16, `docs/precision.md`).
    pub fn fp8_tensorwise() -> Self {
        Self::quantized(Recipe::Fp8TensorwisePromoted)
    }

    /// The same policy with every linear layer on `gemm`. A low-precision `gemm` leaves the
    /// output layer on [`kept`](Self::kept) and keeps its recipe's edge blocks there too.
    pub fn with_gemm(self, gemm: Gemm) -> Self {
        let (kept, kept_blocks) = match gemm {
            Gemm::Quantized(recipe) => (self.kept, KeptBlocks::of(recipe)),
            other => (other, KeptBlocks::NONE),
        };
        Self {
            gemm,
            kept,
            kept_blocks,
            ..self
        }
    }

    /// The same policy keeping `blocks` on [`kept`](Self::kept).
    pub fn with_kept_blocks(self, kept_blocks: KeptBlocks) -> Self {
        Self { kept_blocks, ..self }
    }

    /// `config` with its linear layers set to this policy's product, the output layer and the
    /// kept blocks to [`kept`](Self::kept).
    pub fn apply<M: PrecisionTarget>(&self, mut config: M) -> M {
        for (path, gemm) in config.linear_gemms() {
            *gemm = match path {
                "output" => self.kept,
                _ => self.gemm,
            };
        }
        let (n_blocks, edges) = config.edge_blocks();
        *edges = self.kept_blocks.edges(n_blocks, self.kept);
        config
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
        assert_eq!(config.edge_blocks, None);
        assert_eq!(PrecisionPolicy::bf16().init(1, InitMode::Full).dtype, DType::BF16);
    }

    /// A recipe runs in the blocks' linear layers; the output layer stays on the bf16 GEMM, also
    /// when the recipe is chosen with `with_gemm`; NVFP4 keeps its last 15% of blocks there.
    #[test]
    fn recipes_keep_the_output_layer_in_bf16() {
        let fp8 = Gemm::Quantized(Recipe::Fp8TensorwisePromoted);
        for policy in [
            PrecisionPolicy::fp8_tensorwise(),
            PrecisionPolicy::bf16().with_gemm(fp8),
        ] {
            let config = policy.apply(recipes::tiny().model);
            assert_eq!(
                (config.attention.gemm, config.mlp.gemm, config.output.gemm),
                (fp8, fp8, Gemm::Wgmma)
            );
            assert_eq!(config.edge_blocks, None);
        }
        let config = PrecisionPolicy::quantized(Recipe::Nvfp4).apply(recipes::llama_1b().model);
        let edges = EdgeBlocks {
            first: 0,
            last: 3,
            gemm: Gemm::Wgmma,
        };
        assert_eq!(config.edge_blocks, Some(edges), "⌈15% of 16⌉ = 3 blocks");
        // The tiny model's last block of two runs bf16, its first NVFP4, every layer of each.
        let model = PrecisionPolicy::quantized(Recipe::Nvfp4)
            .apply(recipes::tiny().model)
            .init(
                &burn::tensor::Device::flex(),
                &burn_megatron_dist::ProcessGroups::single(),
                &ParamInit::new(0, InitMode::Full),
            )
            .unwrap();
        let gemms = |b: &crate::models::llama::LlamaBlock| {
            let (a, m) = (b.attention.as_ref().unwrap(), b.mlp.as_ref().unwrap());
            [
                a.wq.precision.gemm,
                a.wk.precision.gemm,
                a.wv.precision.gemm,
                a.wo.precision.gemm,
                m.w1.precision.gemm,
                m.w2.precision.gemm,
                m.w3.precision.gemm,
            ]
        };
        assert_eq!(gemms(&model.layers[0]), [Gemm::Quantized(Recipe::Nvfp4); 7]);
        assert_eq!(gemms(&model.layers[1]), [Gemm::Wgmma; 7]);
        let config = PrecisionPolicy::fp8_tensorwise()
            .with_gemm(Gemm::Burn)
            .apply(recipes::tiny().model);
        assert_eq!(config.output.gemm, Gemm::Burn);
    }
}
