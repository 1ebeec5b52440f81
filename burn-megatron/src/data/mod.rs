//! Tokenized datasets on disk: Megatron Core's indexed format ([`indexed`]), read through
//! memory maps and checked whole before any token is read; its documents packed into training
//! sequences ([`packed`]) and several datasets blended by weight ([`blend`]), as Megatron's GPT
//! and blended datasets do; chat conversations rendered by their tokenizer's template ([`chat`]) with their loss
//! masks ([`sft`]).

pub mod blend;
pub mod chat;
pub mod indexed;
pub mod packed;
pub mod sft;
pub mod sources;

pub use blend::{Blend, Samples};
pub use chat::{ChatTemplate, Rendered, TokenizerConfig, Turn};
pub use indexed::{IndexedDataset, IndexedWriter, TokenType};
pub use packed::{PackedDataset, Packing};
pub use sft::{SftDataset, SftSample, SftShape};
pub use sources::{Sources, SourcesConfig};

use std::path::Path;

/// What went wrong with a dataset's files, naming the file (and the byte, where one is at fault).
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum DataError {
    #[error("{path}: {detail}")]
    Io { path: String, detail: String },
    /// A file that is not what its format says, at `offset`.
    #[error("{path}, byte {offset}: {detail}")]
    Format { path: String, offset: u64, detail: String },
    /// A token id that is negative or past the vocabulary.
    #[error("{path}, byte {offset}: a token id that is negative or not below the vocabulary's {vocab}")]
    Token { path: String, offset: u64, vocab: usize },
    /// What a writer cannot write.
    #[error("{path}: {detail}")]
    Write { path: String, detail: String },
    /// A chat template that does not parse or render, or cannot mark a conversation's turns.
    #[error("chat template {template}: {detail}")]
    Template { template: String, detail: String },
    /// A dataset's setup that cannot work (weights, splits, sizes).
    #[error("data: {0}")]
    Config(String),
}

impl DataError {
    pub(crate) fn io(path: &Path, e: std::io::Error) -> Self {
        Self::Io {
            path: path.display().to_string(),
            detail: e.to_string(),
        }
    }

    pub(crate) fn format(path: &Path, offset: u64, detail: impl Into<String>) -> Self {
        Self::Format {
            path: path.display().to_string(),
            offset,
            detail: detail.into(),
        }
    }
}
