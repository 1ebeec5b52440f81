//! Chat SFT data: conversations (an indexed dataset of their tokens, a conversation a sequence)
//! and their loss masks (a second one beside it, `PREFIX-mask`: a 1 for each token the loss
//! counts, the assistant's). A sample is one conversation, cut to `seq + 1` tokens or padded,
//! the padding never counted; or, packed ([`SftShape::pack`]), as many whole conversations
//! (each cut to `seq + 1`) as fit in turn, with their lengths, so the model attends inside
//! each one (`layers::Documents`).

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

/// One sample: `seq + 1` tokens, whether the loss counts each (as a target), and the lengths
/// of the conversations it holds in order (the padding after them not among them).
pub struct SftSample {
    pub tokens: Vec<u32>,
    pub counted: Vec<bool>,
    pub documents: Vec<usize>,
}

/// The samples an [`SftDataset`] makes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SftShape {
    /// Tokens a sample, less one (its inputs).
    pub seq: usize,
    /// Samples to make.
    pub samples: u64,
    /// The shuffle's seed.
    pub seed: u64,
    /// The token after a sample's conversations.
    pub pad: u32,
    /// Several conversations a sample (else one).
    pub pack: bool,
}

/// Conversations in a seeded shuffled order, epoch after epoch, one or several a sample.
pub struct SftDataset {
    tokens: Arc<IndexedDataset>,
    mask: Arc<IndexedDataset>,
    seq: usize,
    pad: u32,
    order: Vec<u64>,
    /// Sample `i` holds conversations `order[samples[i]]`.
    samples: Vec<Range<usize>>,
}

impl SftDataset {
    /// `shape.samples` samples of the conversations `sequences` of `tokens` with the loss mask
    /// `mask` (which must have their lengths).
    pub fn new(
        tokens: Arc<IndexedDataset>,
        mask: Arc<IndexedDataset>,
        sequences: Range<usize>,
        shape: SftShape,
    ) -> Result<Self, DataError> {
        let SftShape {
            seq,
            samples,
            seed,
            pad,
            pack,
        } = shape;
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
        if sequences.clone().all(|i| tokens.length(i) == 0) {
            return Err(DataError::Config(format!(
                "the conversations {sequences:?} are all empty"
            )));
        }
        let row = seq + 1;
        let length = |c: u64| tokens.length(c as usize).min(row);
        let (mut order, mut spans) = (Vec::new(), Vec::with_capacity(samples as usize));
        let (mut epoch, mut open) = (0, 0..0);
        let mut used = 0;
        while (spans.len() as u64) < samples {
            let mut this: Vec<u64> = sequences.clone().map(|i| i as u64).collect();
            Rng::new(seed, epoch).shuffle(&mut this);
            epoch += 1;
            for conversation in this.into_iter().filter(|&c| length(c) > 0) {
                let n = length(conversation);
                // A sample closes when the next conversation does not fit it (or at once, unpacked).
                if !open.is_empty() && (!pack || used + n > row) {
                    spans.push(std::mem::replace(&mut open, order.len()..order.len()));
                    used = 0;
                }
                order.push(conversation);
                open.end = order.len();
                used += n;
            }
        }
        spans.truncate(samples as usize);
        Ok(Self {
            tokens,
            mask,
            seq,
            pad,
            order,
            samples: spans,
        })
    }

    pub fn len(&self) -> u64 {
        self.samples.len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    /// Sample `i`: its conversations' first `seq + 1` tokens each, in order, then padding.
    pub fn sample(&self, i: u64, vocab: usize) -> Result<SftSample, DataError> {
        let row = self.seq + 1;
        let mut tokens = vec![self.pad; row];
        let mut mask = vec![0u32; row];
        let mut documents = Vec::new();
        let mut at = 0;
        for &conversation in &self.order[self.samples[i as usize].clone()] {
            let conversation = conversation as usize;
            let n = self.tokens.length(conversation).min(row - at);
            self.tokens.read(conversation, 0, &mut tokens[at..at + n], vocab)?;
            self.mask.read(conversation, 0, &mut mask[at..at + n], 2)?;
            documents.push(n);
            at += n;
        }
        Ok(SftSample {
            tokens,
            counted: mask.into_iter().map(|m| m == 1).collect(),
            documents,
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
