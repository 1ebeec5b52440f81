//! The parallel plan: how a model is split over the mesh, one choice per dimension, every
//! invariant checked before any tensor exists, applied to the model's configuration before
//! `init` (the model itself knows nothing about parallelism).
//!
//! One room a dimension:
//! - [`tensor`]: tensor parallelism, with or without sequence parallelism; the layer styles a
//!   model's layer table names.
//! - [`context`]: context parallelism: load-balanced chunks of each sequence, attention over
//!   the whole sequence by ring, all-to-all or all-gather.
//! - [`expert`]: expert parallelism: the layers of experts split over ep, their dispatcher.
//! - [`pipeline`]: pipeline parallelism: the model's blocks over pp stages, the schedule they
//!   run (a rank's stage is `LlamaConfig::init_planned_stage`'s).
//!
//! Data parallelism needs no rewrite of the model: the optimizer averages gradients over
//! [`ProcessGroups::grad_sync`](burn_megatron_dist::ProcessGroups::grad_sync).

pub mod context;
pub mod expert;
pub mod pipeline;
pub mod tensor;

use burn_megatron_dist::ParallelDims;

pub use context::{ContextParallel, ContextParallelLayer};
pub use expert::{ExpertParallel, ExpertParallelLayer};
pub use pipeline::PipelineSchedule;
pub use tensor::{TensorParallel, TensorParallelLayer};

use crate::error::ConfigError;

/// How a model is split: the mesh and one choice per dimension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParallelPlan {
    pub dims: ParallelDims,
    pub tensor: TensorParallel,
    pub context: ContextParallel,
    pub expert: ExpertParallel,
    pub pipeline: PipelineSchedule,
}

/// A model configuration a [`ParallelPlan`] can rewrite: it names its layers (torchtitan's
/// layer plan) and the longest sequence its positions cover.
pub trait PlannedModel {
    /// Each layer the tensor plan lays out, by its path in the model (`layers.*.mlp`).
    fn tensor_layers(&mut self) -> Vec<(&'static str, Box<dyn TensorParallelLayer + '_>)>;

    /// The longest sequence the model's positions cover.
    fn max_seq_len(&self) -> usize;
    /// Sliding-window attention's window, past which a sequence would not attend as causal
    /// attention does; `None`: no window.
    fn attention_window(&self) -> Option<usize> {
        None
    }

    /// The blocks pipeline stages split (none: the model cannot be split into stages).
    fn blocks(&self) -> Option<usize> {
        None
    }

    /// Each layer of experts the expert plan lays out, by its path (none for a dense model).
    fn expert_layers(&mut self) -> Vec<(&'static str, Box<dyn ExpertParallelLayer + '_>)> {
        Vec::new()
    }

    /// Each layer that sees the whole sequence under context parallelism (its attention).
    fn context_layers(&mut self) -> Vec<(&'static str, Box<dyn ContextParallelLayer + '_>)> {
        Vec::new()
    }
}

impl ParallelPlan {
    /// `dims` with every dimension's default choice: tensor parallelism without sequence
    /// parallelism.
    pub fn new(dims: ParallelDims) -> Self {
        Self {
            dims,
            tensor: TensorParallel::Plain,
            context: ContextParallel::default(),
            expert: ExpertParallel::AllToAll,
            pipeline: PipelineSchedule::default(),
        }
    }

    /// The same plan with `tensor` for the tensor dimension.
    pub fn with_tensor(self, tensor: TensorParallel) -> Self {
        Self { tensor, ..self }
    }

    /// The same plan with `expert` for the expert dimension.
    pub fn with_expert(self, expert: ExpertParallel) -> Self {
        Self { expert, ..self }
    }

    /// The same plan with `context` for the context dimension.
    pub fn with_context(self, context: ContextParallel) -> Self {
        Self { context, ..self }
    }

    /// The same plan with `pipeline` for the pipeline dimension.
    pub fn with_pipeline(self, pipeline: PipelineSchedule) -> Self {
        Self { pipeline, ..self }
    }

    /// Checks the mesh against a run of `world_size` ranks.
    pub fn validate(&self, world_size: usize) -> Result<(), ConfigError> {
        self.dims.validate(world_size)?;
        Ok(())
    }

    /// Checks every invariant and rewrites `config` for this plan, for a run of `world_size`
    /// ranks on sequences of `seq_len` tokens.
    pub fn apply<M: PlannedModel>(&self, mut config: M, world_size: usize, seq_len: usize) -> Result<M, ConfigError> {
        self.validate(world_size)?;
        let max_seq_len = config.max_seq_len();
        if seq_len == 0 {
            return Err(ConfigError::Zero {
                what: "sequence length",
            });
        }
        if seq_len > max_seq_len {
            return Err(ConfigError::SequenceTooLong { seq_len, max_seq_len });
        }
        if let Some(window) = config.attention_window().filter(|w| seq_len > *w) {
            return Err(ConfigError::SequencePastWindow { seq_len, window });
        }
        // Each cp rank holds 2 of the sequence's 2·cp chunks; sequence parallelism splits those.
        let cp = self.dims.cp;
        crate::layers::context::ContextLayout::check(cp, seq_len)?;
        let layout = self.tensor.layout(self.dims.tp, seq_len / cp)?;
        for (_, mut layer) in config.tensor_layers() {
            layer.plan_tensor(self.dims.tp, layout)?;
        }
        for (_, mut layer) in config.context_layers() {
            layer.plan_context(cp, self.dims.tp, self.context)?;
        }
        for (_, mut layer) in config.expert_layers() {
            layer.plan_expert(&self.dims, self.expert)?;
        }
        if self.dims.pp > 1 {
            let blocks = config.blocks().ok_or(ConfigError::NoBlocks)?;
            pipeline::stages::virtual_stages(blocks, self.dims.pp, self.pipeline.chunks(), None)?;
        }
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::{ColumnInput, SequenceLayout};
    use crate::models::llama::recipes;
    use burn_megatron_dist::MeshError;

    fn plan(tp: usize, sp: bool) -> ParallelPlan {
        let tensor = if sp {
            TensorParallel::SequenceParallel
        } else {
            TensorParallel::Plain
        };
        ParallelPlan::new(ParallelDims::tp_dp(tp, 1)).with_tensor(tensor)
    }

    #[test]
    fn every_bad_layout_is_a_typed_error_before_init() {
        let tiny = || recipes::tiny().model; // 4 heads, ffn 688, head_dim 64, 256 positions
        assert!(plan(4, true).apply(tiny(), 4, 256).is_ok());
        assert_eq!(
            plan(3, false).apply(tiny(), 3, 256).unwrap_err(),
            ConfigError::NotDivisible {
                what: "n_heads",
                size: 4,
                tp: 3
            }
        );
        let mut gqa = tiny();
        gqa.attention.n_kv_heads = 2;
        assert_eq!(
            plan(4, false).apply(gqa, 4, 256).unwrap_err(),
            ConfigError::NotDivisible {
                what: "n_kv_heads",
                size: 2,
                tp: 4
            }
        );
        let mut ffn = tiny();
        ffn.mlp.d_ff = 690;
        assert_eq!(
            plan(4, false).apply(ffn, 4, 256).unwrap_err(),
            ConfigError::NotDivisible {
                what: "d_ff",
                size: 690,
                tp: 4
            }
        );
        assert_eq!(
            plan(4, true).apply(tiny(), 4, 254).unwrap_err(),
            ConfigError::SequenceNotDivisible { seq_len: 254, tp: 4 }
        );
        // Without SP the sequence need not split.
        assert!(plan(4, false).apply(tiny(), 4, 254).is_ok());
        assert_eq!(
            plan(1, false).apply(tiny(), 1, 300).unwrap_err(),
            ConfigError::SequenceTooLong {
                seq_len: 300,
                max_seq_len: 256
            }
        );
        assert_eq!(
            plan(1, false).apply(tiny(), 1, 0).unwrap_err(),
            ConfigError::Zero {
                what: "sequence length"
            }
        );
        assert!(matches!(
            plan(2, false).apply(tiny(), 4, 256).unwrap_err(),
            ConfigError::Mesh(MeshError::WorldSizeMismatch { .. })
        ));
        let mut odd = tiny();
        odd.attention.d_model = 4 * 63;
        assert_eq!(
            plan(1, false).apply(odd, 1, 256).unwrap_err(),
            ConfigError::OddHeadDim { head_dim: 63 }
        );
        let mut kv = tiny();
        kv.attention.n_kv_heads = 3;
        assert_eq!(
            plan(1, false).apply(kv, 1, 256).unwrap_err(),
            ConfigError::HeadsNotMultipleOfKvHeads {
                n_heads: 4,
                n_kv_heads: 3
            }
        );
    }

    /// Pipeline stages plan beside tp, cp and dp when the blocks split into `pp · v` chunks; a
    /// split that does not divide is an error naming it. Context parallelism plans, beside tp
    /// and dp.
    #[test]
    fn the_plan_splits_blocks_into_stages() {
        let dims = |tp, cp, ep, dp, pp| ParallelDims {
            tp,
            cp,
            ep,
            dp,
            pp,
            etp: None,
        };
        let apply = |dims: ParallelDims, schedule| {
            ParallelPlan::new(dims)
                .with_pipeline(schedule)
                .apply(recipes::tiny().model, dims.world_size(), 256)
        };
        let one_f_one_b = PipelineSchedule::OneForwardOneBackward;
        let interleaved = PipelineSchedule::Interleaved { virtual_stages: 2 };
        // The tiny preset has 2 blocks.
        assert!(apply(dims(1, 1, 1, 1, 2), one_f_one_b).is_ok());
        assert!(apply(dims(2, 1, 1, 2, 2), one_f_one_b).is_ok());
        let refused = apply(dims(1, 1, 1, 1, 2), interleaved).unwrap_err().to_string();
        assert!(refused.contains("2 blocks do not split into"), "{refused}");
        assert!(apply(dims(1, 1, 1, 1, 4), one_f_one_b).is_err());
        assert!(apply(dims(2, 2, 1, 1, 2), one_f_one_b).is_ok());
        assert!(apply(dims(1, 2, 1, 1, 1), one_f_one_b).is_ok() && apply(dims(2, 2, 1, 2, 1), one_f_one_b).is_ok());
    }

    #[test]
    fn the_plan_sets_each_layers_sequence_layout_and_the_output_layout() {
        let config = plan(2, true).apply(recipes::tiny().model, 2, 256).unwrap();
        assert_eq!(config.attention.sequence, SequenceLayout::Sharded);
        assert_eq!(config.mlp.sequence, SequenceLayout::Sharded);
        assert_eq!(config.norm.sequence, SequenceLayout::Sharded);
        assert_eq!(config.embedding.sequence, SequenceLayout::Sharded);
        assert_eq!(config.output.input, ColumnInput::SequenceSharded);
        // At tp = 1 SP means nothing and stays off.
        let single = plan(1, true).apply(recipes::tiny().model, 1, 256).unwrap();
        assert_eq!(single.attention.sequence, SequenceLayout::Whole);
        assert_eq!(single.output.input, ColumnInput::Replicated);
    }
}
