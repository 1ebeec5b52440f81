//! One pipeline rank's part of a Llama: the blocks of its model chunks, the embedding if it holds
//! the first virtual stage, the final norm, output layer and loss if it holds the last. Blocks
//! keep their place in `layers` (the others are `None`), so every parameter's path is the whole
//! model's: checkpoints and initialization (`InitMode::Full`) see the same model at any pp.
//!
//! Legend: `b` batch, `s` sequence, `d` d_model, `v'` this rank's share of the vocabulary.

use std::ops::Range;

use burn::module::Module;
use burn::tensor::{Device, Int, Tensor};
use burn_megatron_dist::ProcessGroups;

use super::model::{LlamaBlock, LlamaConfig, MoeReport, WordEmbeddings, forward_blocks};
use crate::error::{ConfigError, LayerError};
use crate::init::ParamInit;
use crate::layers::{ColumnParallelLinear, RmsNorm, VocabParallelCrossEntropy, VocabParallelEmbedding};
use crate::recompute::Recompute;

#[derive(Module, Debug)]
pub struct LlamaStage {
    /// On the rank holding the first virtual stage.
    pub embedding: Option<VocabParallelEmbedding>,
    /// Block `i` at index `i` where this rank holds it.
    pub layers: Vec<Option<LlamaBlock>>,
    /// On the rank holding the last virtual stage, with `output` and `loss`.
    pub norm: Option<RmsNorm>,
    pub output: Option<ColumnParallelLinear>,
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
}

impl LlamaConfig {
    /// Pipeline rank `rank`'s stage, holding the block ranges `chunks` (its model chunks, from
    /// `plan::pipeline::stages`); the embedding when `first`, the head when `last`. Tied word
    /// embeddings would need the embedding on both ends, and the expert bias the whole model's
    /// load: both refused. MoE blocks may sit in any stage: each stage's router losses join the
    /// loss where they arise (`pipeline.rs`).
    pub fn init_stage(
        &self,
        chunks: Vec<Range<usize>>,
        (first, last): (bool, bool),
        device: &Device,
        groups: &ProcessGroups,
        init: &ParamInit,
    ) -> Result<LlamaStage, LayerError> {
        if self.word_embeddings == WordEmbeddings::Tied {
            return Err(ConfigError::AcrossStages {
                what: "tied word embeddings",
            }
            .into());
        }
        if self.moe.as_ref().is_some_and(|moe| moe.layer.router.expert_bias) {
            return Err(ConfigError::AcrossStages {
                what: "the expert bias (moved by the whole model's load after each step)",
            }
            .into());
        }
        self.check_recompute()?;
        let mut layers: Vec<Option<LlamaBlock>> = (0..self.n_layers).map(|_| None).collect();
        for i in chunks.iter().flat_map(|c| c.clone()) {
            layers[i] = Some(self.init_block(i, device, groups, init)?);
        }
        Ok(LlamaStage {
            embedding: first.then(|| self.embedding.init(device, groups, init, "embedding")),
            layers,
            norm: last.then(|| self.norm.init(device, groups, init)),
            output: match last {
                true => Some(self.output.init(device, groups, init, "output")?),
                false => None,
            },
            loss: last.then(|| self.loss.init(groups)),
            chunks,
            width: self.attention.d_model,
            sequence_shards: match self.attention.sequence {
                crate::layers::SequenceLayout::Sharded => groups.tp.size(),
                crate::layers::SequenceLayout::Whole => 1,
            },
            recompute: self.recompute,
            experts: self.moe.is_some(),
        })
    }
}

impl LlamaStage {
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

    /// Model chunk `chunk`'s blocks on `x`, and the router losses of its MoE blocks (their sum,
    /// `[1]` f32, differentiable), if it has any.
    ///
    /// # Shapes
    /// `[b, s, d]` → `[b, s, d]`
    pub fn forward_chunk(&self, chunk: usize, x: Tensor<3>) -> Result<(Tensor<3>, Option<Tensor<1>>), LayerError> {
        let blocks: Vec<LlamaBlock> = self.chunks[chunk]
            .clone()
            .map(|i| self.layers[i].clone().expect("the chunk's blocks are here"))
            .collect();
        let mut report = MoeReport::default();
        let y = forward_blocks(&blocks, x, self.recompute, &mut report)?;
        Ok((y, report.loss()))
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
        let logits = self
            .output
            .as_ref()
            .expect("the last stage holds the head")
            .forward(norm.forward(x)?)?;
        self.loss
            .as_ref()
            .expect("the last stage holds the loss")
            .forward(logits, targets)
    }
}
