//! The model of `plain.rs`, tensor-, sequence- and data-parallel through burn-megatron: each
//! Burn layer swapped for its parallel twin, each layer's configuration carrying the style the
//! plan sets, and each rank taking its shard of a plain model's weights. Data parallelism needs
//! nothing here: the optimizer averages the gradients over the data-parallel ranks.
//!
//! | layer | style |
//! |---|---|
//! | `token` | vocabulary rows split over tp; summed, or reduce-scattered along the sequence under SP; the tied output layer column-parallel over the same rows |
//! | `position` | replicated; under SP each rank adds its own positions' rows |
//! | `blocks.*.attention` | heads split: query, key and value column-wise, output row-wise |
//! | `blocks.*.mlp` | hidden features split: up column-wise, down row-wise |
//! | `blocks.*.attention_norm`, `blocks.*.mlp_norm`, `norm` | replicated; under SP each rank normalizes its own tokens |
//!
//! Legend: `plain.rs`'s, and `tp` the tensor-parallel group's size. Between the layers the
//! activations are `[b, s, d]`, or `[b, s/tp, d]` under sequence parallelism.

use burn::config::Config;
use burn::module::Module;
use burn::nn::Gelu;
use burn::tensor::activation::softmax;
use burn::tensor::{Bool, Int, Tensor};
use burn_megatron::error::divisible;
use burn_megatron::layers::{
    ColumnOutput, ColumnParallelLinear, LayerNorm, LayerNormConfig, PositionEmbedding, PositionEmbeddingConfig,
    RowInput, RowParallelLinear, SequenceLayout, VocabParallelCrossEntropy, VocabParallelCrossEntropyConfig,
    VocabParallelEmbedding, VocabParallelEmbeddingConfig,
};
use burn_megatron::plan::{PlannedModel, TensorParallelLayer};
use burn_megatron::{ConfigError, LayerError};
use burn_megatron_dist::ProcessGroups;

use crate::plain;

#[derive(Config, Debug)]
pub struct GptConfig {
    pub n_layers: usize,
    pub token: VocabParallelEmbeddingConfig,
    pub position: PositionEmbeddingConfig,
    pub attention: AttentionConfig,
    pub mlp: MlpConfig,
    pub norm: LayerNormConfig,
    pub cross_entropy: VocabParallelCrossEntropyConfig,
}

#[derive(Module, Debug)]
pub struct Gpt {
    pub token: VocabParallelEmbedding,
    pub position: PositionEmbedding,
    pub blocks: Vec<Block>,
    pub norm: LayerNorm,
    #[module(skip)]
    pub cross_entropy: VocabParallelCrossEntropy,
}

#[derive(Module, Debug)]
pub struct Block {
    pub attention_norm: LayerNorm,
    pub attention: Attention,
    pub mlp_norm: LayerNorm,
    pub mlp: Mlp,
}

#[derive(Config, Debug)]
pub struct AttentionConfig {
    pub d_model: usize,
    pub n_heads: usize,
    /// The layout of the input and output along the sequence (the plan's).
    #[config(default = "SequenceLayout::Whole")]
    pub sequence: SequenceLayout,
}

#[derive(Module, Debug)]
pub struct Attention {
    pub query: ColumnParallelLinear,
    pub key: ColumnParallelLinear,
    pub value: ColumnParallelLinear,
    pub output: RowParallelLinear,
    /// This rank's heads.
    pub n_heads: usize,
}

#[derive(Config, Debug)]
pub struct MlpConfig {
    pub d_model: usize,
    pub d_ff: usize,
    /// The layout of the input and output along the sequence (the plan's).
    #[config(default = "SequenceLayout::Whole")]
    pub sequence: SequenceLayout,
}

#[derive(Module, Debug)]
pub struct Mlp {
    pub up: ColumnParallelLinear,
    pub down: RowParallelLinear,
    pub gelu: Gelu,
}

/// The layer plan: each layer by its path, its configuration's style set by
/// [`ParallelPlan::apply`](burn_megatron::plan::ParallelPlan::apply).
impl PlannedModel for GptConfig {
    fn tensor_layers(&mut self) -> Vec<(&'static str, Box<dyn TensorParallelLayer + '_>)> {
        vec![
            ("token", Box::new(&mut self.token)),
            ("position", Box::new(&mut self.position)),
            ("blocks.*.attention", Box::new(&mut self.attention)),
            ("blocks.*.mlp", Box::new(&mut self.mlp)),
            (
                "blocks.*.attention_norm, blocks.*.mlp_norm, norm",
                Box::new(&mut self.norm),
            ),
        ]
    }

    fn max_seq_len(&self) -> usize {
        self.position.max_seq_len
    }
}

/// Heads split: query, key and value column-wise, the output projection row-wise.
impl TensorParallelLayer for AttentionConfig {
    fn plan_tensor(&mut self, tp: usize, sequence: SequenceLayout) -> Result<(), ConfigError> {
        divisible("n_heads", self.n_heads, tp)?;
        self.sequence = sequence;
        Ok(())
    }
}

/// Hidden features split: up column-wise, down row-wise.
impl TensorParallelLayer for MlpConfig {
    fn plan_tensor(&mut self, tp: usize, sequence: SequenceLayout) -> Result<(), ConfigError> {
        divisible("d_ff", self.d_ff, tp)?;
        self.sequence = sequence;
        Ok(())
    }
}

impl GptConfig {
    /// The parallel configuration of `plain`'s model, laid out for one device until a plan
    /// applies to it.
    pub fn of(plain: &plain::GptConfig) -> Self {
        let (vocab_size, d_model) = (plain.token.n_embedding, plain.token.d_model);
        Self::new(
            plain.n_layers,
            VocabParallelEmbeddingConfig::new(vocab_size, d_model),
            PositionEmbeddingConfig::new(plain.position.n_embedding, d_model),
            AttentionConfig::new(d_model, plain.attention.n_heads),
            MlpConfig::new(d_model, plain.mlp.d_ff),
            LayerNormConfig::new(d_model).with_epsilon(plain.norm.epsilon),
            VocabParallelCrossEntropyConfig::new(vocab_size),
        )
    }

    /// This rank's shard of `plain`, a whole model the same on every rank.
    pub fn shard(&self, plain: plain::Gpt, groups: &ProcessGroups) -> Result<Gpt, LayerError> {
        let (pad, sequence) = (self.token.pad_vocab_to_multiple_of, self.token.sequence);
        let shard_block = |block: plain::Block| -> Result<Block, LayerError> {
            Ok(Block {
                attention_norm: self.norm.init_from(block.attention_norm, groups),
                attention: self.attention.shard(block.attention, groups)?,
                mlp_norm: self.norm.init_from(block.mlp_norm, groups),
                mlp: self.mlp.shard(block.mlp, groups)?,
            })
        };
        Ok(Gpt {
            token: VocabParallelEmbedding::from_embedding(plain.token, pad, sequence, groups),
            position: PositionEmbedding::from_embedding(plain.position, self.position.sequence, groups),
            blocks: plain.blocks.into_iter().map(shard_block).collect::<Result<_, _>>()?,
            norm: self.norm.init_from(plain.norm, groups),
            cross_entropy: self.cross_entropy.init(groups),
        })
    }
}

impl AttentionConfig {
    /// This rank's heads of `plain`.
    pub fn shard(&self, plain: plain::Attention, groups: &ProcessGroups) -> Result<Attention, LayerError> {
        let column =
            |linear| ColumnParallelLinear::from_linear(linear, self.sequence.into(), ColumnOutput::Sharded, groups);
        Ok(Attention {
            query: column(plain.query)?,
            key: column(plain.key)?,
            value: column(plain.value)?,
            output: RowParallelLinear::from_linear(plain.output, RowInput::Sharded, self.sequence.into(), groups)?,
            n_heads: divisible("n_heads", self.n_heads, groups.tp.size())?,
        })
    }
}

impl MlpConfig {
    /// This rank's hidden features of `plain`.
    pub fn shard(&self, plain: plain::Mlp, groups: &ProcessGroups) -> Result<Mlp, LayerError> {
        Ok(Mlp {
            up: ColumnParallelLinear::from_linear(plain.up, self.sequence.into(), ColumnOutput::Sharded, groups)?,
            down: RowParallelLinear::from_linear(plain.down, RowInput::Sharded, self.sequence.into(), groups)?,
            gelu: plain.gelu,
        })
    }
}

impl Gpt {
    /// # Shapes
    /// `[b, s]` token ids → logits `[b, s, v/tp]`, this rank's share of the vocabulary (padded
    /// to a multiple of tp)
    pub fn forward(&self, ids: Tensor<2, Int>) -> Result<Tensor<3>, LayerError> {
        let [_, s] = ids.dims();
        let mut x = self.token.forward(ids)? + self.position.forward(s)?;
        for block in &self.blocks {
            x = block.forward(x)?;
        }
        // The output layer is the token embedding, transposed.
        self.token.tied_logits(self.norm.forward(x)?)
    }

    /// This rank's share of the mean next-token loss: the mean over the data-parallel ranks is
    /// the batch's mean ([`VocabParallelCrossEntropy::forward`]).
    ///
    /// # Shapes
    /// `[b, s]`, `[b, s]` → `[1]`
    pub fn loss(&self, ids: Tensor<2, Int>, targets: Tensor<2, Int>) -> Result<Tensor<1>, LayerError> {
        self.cross_entropy.forward(self.forward(ids)?, targets)
    }
}

impl Block {
    /// # Shapes
    /// `[b, s, d]` → `[b, s, d]`
    pub fn forward(&self, x: Tensor<3>) -> Result<Tensor<3>, LayerError> {
        let x = x.clone() + self.attention.forward(self.attention_norm.forward(x)?)?;
        Ok(x.clone() + self.mlp.forward(self.mlp_norm.forward(x)?)?)
    }
}

impl Attention {
    /// # Shapes
    /// `[b, s, d]` → `[b, s, d]`; inside, this rank's heads `[b, h/tp, s, k]` over the whole
    /// sequence (the column layers gather it under SP, the row layer scatters it back)
    pub fn forward(&self, x: Tensor<3>) -> Result<Tensor<3>, LayerError> {
        let (q, k, v) = (
            self.query.forward(x.clone())?,
            self.key.forward(x.clone())?,
            self.value.forward(x)?,
        );
        let [b, s, features] = q.dims();
        let head_dim = features / self.n_heads;
        let heads = |t: Tensor<3>| t.reshape([b, s, self.n_heads, head_dim]).swap_dims(1, 2); // [b, h/tp, s, k]
        let (q, k, v) = (heads(q), heads(k), heads(v));
        let scores = q.matmul(k.swap_dims(2, 3)).div_scalar((head_dim as f64).sqrt()); // [b, h/tp, s, s]
        let future = Tensor::<2, Bool>::tril_mask([s, s], 0, &scores.device()).unsqueeze::<4>();
        let weights = softmax(
            scores.mask_fill(future.expand([b, self.n_heads, s, s]), f32::NEG_INFINITY),
            3,
        );
        let context = weights.matmul(v).swap_dims(1, 2).reshape([b, s, features]);
        self.output.forward(context)
    }
}

impl Mlp {
    /// # Shapes
    /// `[b, s, d]` → `[b, s, d]`; inside, this rank's features `[b, s, d_ff/tp]`
    pub fn forward(&self, x: Tensor<3>) -> Result<Tensor<3>, LayerError> {
        self.down.forward(self.gelu.forward(self.up.forward(x)?))
    }
}
