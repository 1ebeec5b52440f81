//! Chat SFT data: conversations (an indexed dataset of their tokens, a conversation a sequence)
//! and their loss masks (a second one beside it, `PREFIX-mask`: a 1 for each token the loss
//! counts, the assistant's), one conversation a sample: cut to `seq + 1` tokens or padded, the
//! padding never counted. Conversations are not packed together: with causal attention and
//! padding only at the end, no token attends to another conversation's.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::{DataError, IndexedDataset, packed::Rng};

/// Where the chat dataset at `prefix` keeps its loss mask.
pub fn mask_prefix(prefix: &Path) -> PathBuf {
    let mut path = prefix.as_os_str().to_owned();
    path.push("-mask");
    PathBuf::from(path)
}

/// One sample: `seq + 1` tokens and whether the loss counts each (as a target).
pub struct SftSample {
    pub tokens: Vec<u32>,
    pub counted: Vec<bool>,
}

/// Conversations in a seeded shuffled order, epoch after epoch.
pub struct SftDataset {
    tokens: Arc<IndexedDataset>,
    mask: Arc<IndexedDataset>,
    seq: usize,
    pad: u32,
    order: Vec<u64>,
}

impl SftDataset {
    /// `samples` samples of the conversations `sequences` of `tokens` with the loss mask
    /// `mask` (which must have their lengths), padded with `pad`.
    pub fn new(
        tokens: Arc<IndexedDataset>,
        mask: Arc<IndexedDataset>,
        sequences: Range<usize>,
        (seq, samples, seed, pad): (usize, u64, u64, u32),
    ) -> Result<Self, DataError> {
        if mask.len() != tokens.len() {
            return Err(DataError::format(
                mask.index_path(),
                18,
                format!("{} masks for {} conversations", mask.len(), tokens.len()),
            ));
        }
        if let Some(i) = (0..tokens.len()).find(|&i| mask.length(i) != tokens.length(i)) {
            return Err(DataError::format(
                mask.index_path(),
                0,
                format!(
                    "conversation {i}: {} mask values for {} tokens",
                    mask.length(i),
                    tokens.length(i)
                ),
            ));
        }
        if sequences.is_empty() || seq == 0 {
            return Err(DataError::Config(format!(
                "no conversations in {sequences:?} to train on"
            )));
        }
        let mut order = Vec::with_capacity(samples as usize);
        let mut epoch = 0;
        while (order.len() as u64) < samples {
            let mut this: Vec<u64> = sequences.clone().map(|i| i as u64).collect();
            Rng::new(seed, epoch).shuffle(&mut this);
            order.extend(this);
            epoch += 1;
        }
        Ok(Self {
            tokens,
            mask,
            seq,
            pad,
            order,
        })
    }

    pub fn len(&self) -> u64 {
        self.order.len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// Sample `i`: its conversation's first `seq + 1` tokens, padded.
    pub fn sample(&self, i: u64, vocab: usize) -> Result<SftSample, DataError> {
        let conversation = self.order[i as usize] as usize;
        let n = self.tokens.length(conversation).min(self.seq + 1);
        let mut tokens = vec![self.pad; self.seq + 1];
        self.tokens.read(conversation, 0, &mut tokens[..n], vocab)?;
        let mut mask = vec![0u32; self.seq + 1];
        self.mask.read(conversation, 0, &mut mask[..n], 2)?;
        Ok(SftSample {
            tokens,
            counted: mask.into_iter().map(|m| m == 1).collect(),
        })
    }
}

impl super::blend::Samples for SftDataset {
    type Sample = SftSample;

    fn count(&self) -> u64 {
        self.len()
    }

    fn get(&self, i: u64, vocab: usize) -> Result<SftSample, DataError> {
        self.sample(i, vocab)
    }
}
