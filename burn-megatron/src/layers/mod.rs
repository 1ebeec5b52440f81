//! Parallel layers. Each behaves exactly like its Burn twin when its group has one member.
//!
//! A Burn model's own layers swap for them one by one (`docs/own-model.md`): `Linear` for
//! [`ColumnParallelLinear`] or [`RowParallelLinear`], `Embedding` for
//! [`VocabParallelEmbedding`] (tokens) or [`PositionEmbedding`] (learned positions),
//! `LayerNorm` and `RmsNorm` for [`LayerNorm`] and [`RmsNorm`], the loss for
//! [`VocabParallelCrossEntropy`].

pub mod attention;
pub mod column;
pub mod context;
pub mod cross_entropy;
pub mod documents;
pub mod embedding;
pub(crate) mod heads;
pub mod latent_attention;
pub mod layer_norm;
pub mod mlp;
pub mod moe;
pub mod norm;
pub mod position;
pub mod replicated;
pub mod residual;
pub mod rope;
pub mod row;
pub mod sequence;

pub use attention::{ParallelAttention, ParallelAttentionConfig};
pub use column::{ColumnInput, ColumnOutput, ColumnParallelLinear, ColumnParallelLinearConfig, column_parallel};
pub use cross_entropy::{VocabParallelCrossEntropy, VocabParallelCrossEntropyConfig};
pub use documents::Documents;
pub use embedding::{VocabParallelEmbedding, VocabParallelEmbeddingConfig, padded_vocab};
pub use latent_attention::{LatentAttention, LatentAttentionConfig};
pub use layer_norm::{LayerNorm, LayerNormConfig};
pub use mlp::{ParallelMlp, ParallelMlpConfig};
pub use norm::{RmsNorm, RmsNormConfig};
pub use position::{PositionEmbedding, PositionEmbeddingConfig};
pub use replicated::{ReplicatedLinear, ReplicatedLinearConfig};
pub use residual::Residual;
pub use rope::{Rope, RopeScaling};
pub use row::{RowInput, RowOutput, RowParallelLinear, RowParallelLinearConfig};
pub use sequence::SequenceLayout;
