//! Llama's layer plan: each layer of the model by name, with the tensor-parallel style its
//! configuration carries (`plan/tensor.rs`), in the shape of torchtitan's layer plan; and its
//! linear layers by name, for precision policies (`precision/`).
//!
//! | layer | style |
//! |---|---|
//! | `embedding` | vocabulary rows split; output reduced, or reduce-scattered under SP |
//! | `layers.*.attention` | heads split: q, k, v column-wise, `wo` row-wise |
//! | `layers.*.latent` | heads split: the up projections column-wise, `wo` row-wise; the down projections and their norms replicated |
//! | `layers.*.mlp` | hidden features split: `w1`, `w3` column-wise, `w2` row-wise |
//! | `layers.*.attention_norm`, `layers.*.mlp_norm`, `norm` | replicated; per token shard under SP |
//! | `output` | column-wise over the padded vocabulary, logits left split for the loss |
//! | `layers.*.moe` | experts split over ep; each expert's hidden features split as the MLP's |
//!
//! Under context parallelism `layers.*.attention` sees the whole sequence through its exchange
//! (`plan/context.rs`); every other layer works on each rank's chunks as they are.

use super::model::LlamaConfig;
use crate::error::ConfigError;
use crate::layers::{ColumnOutput, ColumnParallelLinearConfig, SequenceLayout, padded_vocab};
use crate::plan::{ContextParallelLayer, ExpertParallelLayer, PlannedModel, TensorParallelLayer};
use crate::precision::{EdgeBlocks, PrecisionTarget};
use burn_megatron_kernels::Gemm;

impl PlannedModel for LlamaConfig {
    fn tensor_layers(&mut self) -> Vec<(&'static str, Box<dyn TensorParallelLayer + '_>)> {
        let output = VocabParallelOutput {
            vocab_size: self.embedding.vocab_size,
            pad_vocab_to_multiple_of: self.embedding.pad_vocab_to_multiple_of,
            output: &mut self.output,
        };
        let attention: (&'static str, Box<dyn TensorParallelLayer + '_>) = match &mut self.latent {
            Some(latent) => ("layers.*.latent", Box::new(latent)),
            None => ("layers.*.attention", Box::new(&mut self.attention)),
        };
        let mut layers: Vec<(&'static str, Box<dyn TensorParallelLayer + '_>)> = vec![
            ("embedding", Box::new(&mut self.embedding)),
            attention,
            ("layers.*.mlp", Box::new(&mut self.mlp)),
            (
                "layers.*.attention_norm, layers.*.mlp_norm, norm",
                Box::new(&mut self.norm),
            ),
            ("output", Box::new(output)),
        ];
        if let Some(moe) = &mut self.moe {
            layers.push(("layers.*.moe", Box::new(&mut moe.layer)));
        }
        layers
    }

    fn max_seq_len(&self) -> usize {
        self.attention.max_seq_len
    }

    fn attention_window(&self) -> Option<usize> {
        self.attention.sliding_window
    }

    fn blocks(&self) -> Option<usize> {
        Some(self.n_layers)
    }

    fn expert_layers(&mut self) -> Vec<(&'static str, Box<dyn ExpertParallelLayer + '_>)> {
        match &mut self.moe {
            Some(moe) => vec![("layers.*.moe", Box::new(&mut moe.layer))],
            None => Vec::new(),
        }
    }

    fn context_layers(&mut self) -> Vec<(&'static str, Box<dyn ContextParallelLayer + '_>)> {
        match &mut self.latent {
            Some(latent) => vec![("layers.*.latent", Box::new(latent))],
            None => vec![("layers.*.attention", Box::new(&mut self.attention))],
        }
    }
}

/// The linear layers a precision policy sets.
impl PrecisionTarget for LlamaConfig {
    fn linear_gemms(&mut self) -> Vec<(&'static str, &mut Gemm)> {
        vec![
            ("layers.*.attention", &mut self.attention.gemm),
            ("layers.*.mlp", &mut self.mlp.gemm),
            ("output", &mut self.output.gemm),
        ]
    }

    fn edge_blocks(&mut self) -> (usize, &mut Option<EdgeBlocks>) {
        (self.n_layers, &mut self.edge_blocks)
    }
}

/// The output layer: column-wise over the vocabulary padded as the embedding pads it, its
/// logits left split over tp for the vocabulary-parallel loss.
struct VocabParallelOutput<'a> {
    vocab_size: usize,
    pad_vocab_to_multiple_of: usize,
    output: &'a mut ColumnParallelLinearConfig,
}

impl TensorParallelLayer for VocabParallelOutput<'_> {
    fn plan_tensor(&mut self, tp: usize, sequence: SequenceLayout) -> Result<(), ConfigError> {
        self.output.d_output = padded_vocab(self.vocab_size, self.pad_vocab_to_multiple_of, tp);
        self.output.output = ColumnOutput::Sharded;
        self.output.plan_tensor(tp, sequence)
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::Device;
    use burn_megatron_dist::ProcessGroups;

    use super::*;
    use crate::init::{InitMode, ParamInit};
    use crate::models::llama::recipes;
    use crate::params::param_infos;

    /// Whether `pattern` (`layers.*.mlp`: `*` any one path segment) names the layer that owns
    /// the parameter at `path`.
    fn owns(pattern: &str, path: &str) -> bool {
        let (pattern, path): (Vec<_>, Vec<_>) = (pattern.split('.').collect(), path.split('.').collect());
        pattern.len() < path.len() && pattern.iter().zip(&path).all(|(p, s)| *p == "*" || p == s)
    }

    /// The layer table covers the model: every parameter of an initialized Llama belongs to a
    /// layer the table names, so a layer added to the model and not to its plan fails here.
    #[test]
    fn the_layer_table_names_every_parameter() {
        let mut config = recipes::tiny().model;
        let names: Vec<&str> = config
            .tensor_layers()
            .into_iter()
            .flat_map(|(name, _)| name.split(", "))
            .collect();
        let model = config
            .init(
                &Device::flex(),
                &ProcessGroups::single(),
                &ParamInit::new(0, InitMode::Full),
            )
            .unwrap();
        for info in param_infos(&model) {
            assert!(
                names.iter().any(|name| owns(name, &info.path)),
                "{} is in no layer of the plan: {names:?}",
                info.path
            );
        }
        assert!(!owns("layers.*.mlp", "layers.0.attention.wq.weight"));
    }
}
