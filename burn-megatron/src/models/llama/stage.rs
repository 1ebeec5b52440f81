//! One pipeline rank's part of a Llama: the blocks of its model chunks, the embedding if it holds
//! the first virtual stage, the final norm, output layer and loss if it holds the last. Blocks
//! keep their place in `layers` (the others are `None`), so every parameter's path is the whole
//! model's: checkpoints and initialization (`InitMode::Full`) see the same model at any pp.
//! With tied word embeddings the last stage holds a copy of the embedding as its output layer,
//! under the embedding's path (`plan::pipeline::shared`: one parameter over its two stages).
//!
//! Legend: `b` batch, `s` sequence, `d` d_model, `v'` this rank's share of the vocabulary.

use std::ops::Range;

use burn::module::Module;
use burn::tensor::{Device, Int, Tensor};
use burn_megatron_dist::{ProcessGroup, ProcessGroups};

use super::model::{
    LlamaBlock, LlamaConfig, MoeReport, TiedOutput, forward_blocks, output_logits, update_expert_biases,
};
use super::sites::share_amax_notes;
use crate::error::{ConfigError, LayerError};
use crate::init::ParamInit;
use crate::layers::context::ContextLayout;
use crate::layers::moe::Load;
use crate::layers::{ColumnParallelLinear, Documents, RmsNorm, VocabParallelCrossEntropy, VocabParallelEmbedding};
use crate::plan::pipeline::schedule::StageSchedule;
use crate::plan::pipeline::stages::{rank_chunks, virtual_stages};
use crate::plan::{ParallelPlan, PipelineSchedule};
use crate::recompute::Recompute;

#[derive(Module, Debug)]
pub struct LlamaStage {
    /// On the rank holding the first virtual stage; with tied word embeddings also on the one
    /// holding the last, as its output layer.
    pub embedding: Option<VocabParallelEmbedding>,
    /// Block `i` at index `i` where this rank holds it.
    pub layers: Vec<Option<LlamaBlock>>,
    /// On the rank holding the last virtual stage, with `output` and `loss`.
    pub norm: Option<RmsNorm>,
    pub output: Option<ColumnParallelLinear>,
    /// The tied output layer (the embedding's weight), on the last stage.
    #[module(skip)]
    pub tied_output: Option<TiedOutput>,
    #[module(skip)]
    pub loss: Option<VocabParallelCrossEntropy>,
    /// The blocks of each of this rank's model chunks, chunk by chunk.
    #[module(skip)]
    pub chunks: Vec<Range<usize>>,
    /// Activations between stages: `[b, s / sequence_shards, width]` (sequence parallelism
    /// shards the sequence over tp).
    #[module(skip)]
    pub width: usize,
    #[module(skip)]
    pub sequence_shards: usize,
    /// Which blocks of each chunk run as recomputed regions (full recomputation).
    #[module(skip)]
    pub recompute: Recompute,
    /// Whether the whole model has MoE blocks (every rank knows, whichever stage holds them).
    #[module(skip)]
    pub experts: bool,
    /// This rank's part of a schedule, for steps the stage runs on its own
    /// ([`with_schedule`](Self::with_schedule)).
    #[module(skip)]
    pub schedule: Option<StageSchedule>,
}

impl LlamaConfig {
    /// Pipeline rank `rank`'s stage, holding the block ranges `chunks` (its model chunks, from
    /// `plan::pipeline::stages`); the embedding when `first`, the head when `last` (and a copy
    /// of the embedding with tied word embeddings). MoE blocks may sit in any stage: each
    /// stage's router losses join the loss where they arise, and its blocks' expert biases
    /// move by their own loads (`pipeline.rs`).
    pub fn init_stage(
        &self,
        chunks: Vec<Range<usize>>,
        (first, last): (bool, bool),
        device: &Device,
        groups: &ProcessGroups,
        init: &ParamInit,
    ) -> Result<LlamaStage, LayerError> {
        self.check_recompute()?;
        if self.mtp.is_some() {
            return Err(ConfigError::NotBuilt {
                dimension: "multi-token prediction under pipeline parallelism",
                size: groups.pp.size(),
            }
            .into());
        }
        if chunks.is_empty() || chunks.iter().any(|c| c.is_empty()) {
            return Err(ConfigError::Zero {
                what: "the blocks of each of a stage's model chunks",
            }
            .into());
        }
        if let Some(end) = chunks.iter().map(|c| c.end).max().filter(|&end| end > self.n_layers) {
            return Err(ConfigError::StageBlocks {
                end,
                blocks: self.n_layers,
            }
            .into());
        }
        let mut layers: Vec<Option<LlamaBlock>> = (0..self.n_layers).map(|_| None).collect();
        for i in chunks.iter().flat_map(|c| c.clone()) {
            layers[i] = Some(self.init_block(i, device, groups, init)?);
        }
        let (mut output, tied_output) = match last {
            true => self.init_output(device, groups, init)?,
            false => (None, None),
        };
        share_amax_notes(
            layers.iter_mut().flatten(),
            output.as_mut().map(|o: &mut ColumnParallelLinear| &mut o.precision),
        );
        let embeds = first || tied_output.is_some();
        Ok(LlamaStage {
            // Initialized by its path: the copy equals the first stage's.
            embedding: embeds.then(|| self.embedding.init(device, groups, init, "embedding")),
            layers,
            norm: last.then(|| self.norm.init(device, groups, init)),
            output,
            tied_output,
            loss: last.then(|| self.loss.init(groups)),
            chunks,
            // The residual stream's: the embedding's width, the norms' layout (a latent-attention
            // model's grouped-query attention config is unused).
            width: self.embedding.d_model,
            sequence_shards: match self.norm.sequence {
                crate::layers::SequenceLayout::Sharded => groups.tp.size(),
                crate::layers::SequenceLayout::Whole => 1,
            },
            recompute: self.recompute,
            experts: self.moe.is_some(),
            schedule: None,
        })
    }
}

impl LlamaConfig {
    /// This rank's stage of `plan`'s pipeline (the config planned by it): its model chunks of
    /// the blocks split evenly over `pp · v` virtual stages, the embedding on the first pp
    /// rank, the head on the last, and its part of `plan.pipeline` over `microbatches`.
    pub fn init_planned_stage(
        &self,
        plan: &ParallelPlan,
        microbatches: usize,
        device: &Device,
        groups: &ProcessGroups,
        init: &ParamInit,
    ) -> Result<LlamaStage, LayerError> {
        let pp = groups.pp.size();
        let stages = virtual_stages(self.n_layers, pp, plan.pipeline.chunks(), None)?;
        let rank = groups.pp.group_rank();
        let stage = self.init_stage(
            rank_chunks(&stages, pp, rank),
            (rank == 0, rank + 1 == pp),
            device,
            groups,
            init,
        )?;
        Ok(stage.with_schedule(plan.pipeline, microbatches, &groups.pp)?)
    }
}

impl LlamaStage {
    /// Where this stage's kernels and its optimizer note the amaxes its FP8 tensorwise casts
    /// take ([`Llama::amax_notes`](super::Llama::amax_notes)).
    pub fn amax_notes(&self) -> burn_megatron_kernels::quant::notes::AmaxNotes {
        let first = self.layers.iter().flatten().next().map(|b| b.first_precision());
        first
            .or(self.output.as_ref().map(|o| &o.precision))
            .map(|p| p.notes.clone())
            .unwrap_or_default()
    }

    /// How this stage's attention splits sequences over cp (every stage holds a block).
    pub fn context_layout(&self) -> ContextLayout {
        let block = self.layers.iter().flatten().next().expect("a stage holds a block");
        ContextLayout::new(block.context_group())
    }

    /// The stage with its rank's actions of `schedule` over `microbatches` on `pp`: the
    /// microbatches must suit the schedule and its model chunks the stage's.
    pub fn with_schedule(
        mut self,
        schedule: PipelineSchedule,
        microbatches: usize,
        pp: &ProcessGroup,
    ) -> Result<Self, ConfigError> {
        if schedule.chunks() != self.chunks.len() {
            return Err(ConfigError::StageChunks {
                schedule: schedule.chunks(),
                stage: self.chunks.len(),
            });
        }
        let mut actions = schedule.actions(pp.size(), microbatches)?;
        self.schedule = Some(StageSchedule {
            actions: actions.ranks.swap_remove(pp.group_rank()),
            microbatches,
            pp: pp.clone(),
        });
        Ok(self)
    }

    /// This stage with each block's weights' FP8 codes kept across the microbatches of a step
    /// ([`keep_weight_codes`](super::sites::keep_weight_codes)).
    pub fn keeping_weight_codes(mut self) -> Self {
        self.layers
            .iter_mut()
            .flatten()
            .for_each(super::sites::keep_weight_codes);
        self
    }

    /// The shape of the activations a microbatch of `b` sequences of `s` tokens sends between
    /// stages.
    pub fn activation_shape(&self, b: usize, s: usize) -> [usize; 3] {
        [b, s / self.sequence_shards, self.width]
    }

    /// The embedding of `ids` (the first virtual stage's input).
    ///
    /// # Shapes
    /// `[b, s]` → `[b, s, d]`
    pub fn embed(&self, ids: Tensor<2, Int>) -> Result<Tensor<3>, LayerError> {
        self.embedding
            .as_ref()
            .expect("the first stage holds the embedding")
            .forward(ids)
    }

    /// Model chunk `chunk`'s blocks on `x` (rows packing `documents` where given), and what its
    /// MoE blocks report (their router losses and loads, in block order).
    ///
    /// # Shapes
    /// `[b, s, d]` → `[b, s, d]`
    pub fn forward_chunk(
        &self,
        chunk: usize,
        x: Tensor<3>,
        documents: Option<&Documents>,
    ) -> Result<(Tensor<3>, MoeReport), LayerError> {
        let blocks: Vec<LlamaBlock> = self.chunks[chunk]
            .clone()
            .map(|i| self.layers[i].clone().expect("the chunk's blocks are here"))
            .collect();
        let mut report = MoeReport::default();
        let y = forward_blocks(&blocks, x, self.recompute, &mut report, documents)?;
        Ok((y, report))
    }

    /// The indices of chunk `chunk`'s MoE blocks, in order (what its report's loads belong to).
    pub fn moe_blocks(&self, chunk: usize) -> Vec<usize> {
        self.chunks[chunk]
            .clone()
            .filter(|&i| self.layers[i].as_ref().is_some_and(|b| b.moe.is_some()))
            .collect()
    }

    /// DeepSeek-V3's auxiliary-loss-free balancing after a step, as
    /// [`Llama::update_expert_bias`](super::Llama::update_expert_bias): each of this stage's
    /// MoE blocks moves its bias by its own load over the step (`loads`, one a MoE block of
    /// this stage in block order, summed over the microbatches: what the whole batch routed,
    /// since the bias is fixed during the step). Every rank calls it.
    pub fn update_expert_bias(mut self, loads: &[Load], groups: &ProcessGroups) -> Result<Self, LayerError> {
        update_expert_biases(self.layers.iter_mut().flatten(), loads, groups)?;
        Ok(self)
    }

    /// Whether the model has MoE blocks (in whichever stage): its router losses then travel to
    /// the reported loss.
    pub fn has_experts(&self) -> bool {
        self.experts
    }

    /// The head on the last block's output: the next-token loss of `targets`, as
    /// [`Llama::forward_loss`](super::Llama::forward_loss) computes it.
    ///
    /// # Shapes
    /// `[b, s, d]`, `[b, s]` → `[1]`
    pub fn loss(&self, x: Tensor<3>, targets: Tensor<2, Int>) -> Result<Tensor<1>, LayerError> {
        let norm = self.norm.as_ref().expect("the last stage holds the head");
        let tied = self.tied_output.as_ref().map(|t| {
            let embedding = self.embedding.as_ref().expect("the last stage holds the tied copy");
            (t, embedding)
        });
        let logits = output_logits(norm.forward(x)?, self.output.as_ref(), tied)?;
        self.loss
            .as_ref()
            .expect("the last stage holds the loss")
            .forward(logits, targets)
    }
}
