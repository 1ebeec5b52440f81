//! Documents packed into training sequences, as Megatron's GPT dataset packs them
//! (`gpt_dataset.py`): the chosen sequences of an indexed dataset in a seeded shuffled order,
//! epoch after epoch, cut into samples of `seq + 1` tokens that run across document boundaries
//! (each sample's last token is the next one's first: inputs and targets of `seq` each), the
//! samples themselves in a seeded shuffled order. Sample `i` is a pure function of the dataset,
//! the seed and `i`: a run resumed at step `k` reads what the uninterrupted run read.
//!
//! The three indexes are built once and cached beside the data (`<prefix>-<hash>.packed`, the
//! hash of everything they depend on), as Megatron caches its `.npy` indexes; a cache that is
//! unreadable or describes another build is rebuilt.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::{DataError, IndexedDataset};

/// SplitMix64: a fixed generator, so an order never changes with a dependency's version.
pub(super) struct Rng(u64);

impl Rng {
    pub(super) fn new(seed: u64, stream: u64) -> Self {
        Self(seed ^ stream.wrapping_mul(0x9E37_79B9_7F4A_7C15))
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Fisher–Yates.
    pub(super) fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = (self.next() % (i as u64 + 1)) as usize;
            items.swap(i, j);
        }
    }
}

/// What a packed dataset is built from.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Packing {
    /// Tokens a sample feeds the model (each sample reads one more: its last target).
    pub seq: usize,
    /// Samples to provide at least (epochs are added until they fit).
    pub samples: u64,
    pub seed: u64,
}

/// One indexed dataset's sequences packed into samples.
pub struct PackedDataset {
    data: Arc<IndexedDataset>,
    seq: usize,
    /// The sequences of every epoch in their shuffled order (dataset indices).
    documents: Vec<u64>,
    /// Where sample `j` starts: (position in `documents`, token offset); one more entry for
    /// the end of the last.
    starts: Vec<(u64, u64)>,
    /// Sample `i` is packed sample `order[i]`.
    order: Vec<u64>,
}

impl PackedDataset {
    /// Packs the sequences `sequences` of `data`, reading the indexes from the cache in
    /// `cache` (a directory) where one was built for the same inputs, else building and
    /// caching them there (`None`: built, not cached).
    pub fn new(
        data: Arc<IndexedDataset>,
        sequences: Range<usize>,
        packing: &Packing,
        cache: Option<&Path>,
    ) -> Result<Self, DataError> {
        let description = format!(
            "burn-megatron packed v1\nindex {} ({} sequences)\nsequences {sequences:?}\nseq {}\nsamples {}\nseed {}",
            data.index_path().display(),
            data.len(),
            packing.seq,
            packing.samples,
            packing.seed
        );
        let cached = cache.map(|dir| cache_path(dir, data.index_path(), &description));
        if let Some(path) = &cached
            && let Some((documents, starts, order)) = read_cache(path, &description)
        {
            let dataset = Self {
                data,
                seq: packing.seq,
                documents,
                starts,
                order,
            };
            if dataset.consistent() {
                return Ok(dataset);
            }
            return Self::new(dataset.data, sequences, packing, None).and_then(|built| {
                built.write_cache(path, &description)?;
                Ok(built)
            });
        }
        let dataset = Self::build(data, sequences, packing)?;
        if let Some(path) = &cached {
            dataset.write_cache(path, &description)?;
        }
        Ok(dataset)
    }

    fn build(data: Arc<IndexedDataset>, sequences: Range<usize>, packing: &Packing) -> Result<Self, DataError> {
        let seq = packing.seq as u64;
        let tokens: u64 = sequences.clone().map(|i| data.length(i) as u64).sum();
        let needed = packing.samples.saturating_mul(seq).saturating_add(1);
        if seq == 0 || tokens < 2 {
            return Err(DataError::format(
                data.index_path(),
                0,
                format!("sequences {sequences:?} hold {tokens} tokens: nothing to pack into samples of {seq}"),
            ));
        }
        let epochs = needed.div_ceil(tokens);
        let mut documents = Vec::with_capacity((epochs as usize).saturating_mul(sequences.len()));
        for epoch in 0..epochs {
            let mut order: Vec<u64> = sequences.clone().map(|i| i as u64).collect();
            Rng::new(packing.seed, epoch).shuffle(&mut order);
            documents.extend(order);
        }
        // Megatron's `build_sample_idx`: each sample takes `seq + 1` tokens, the next starting
        // at its last.
        let total = (epochs * tokens - 1) / seq;
        let mut starts = Vec::with_capacity(total as usize + 1);
        let (mut at, mut offset) = (0usize, 0u64);
        starts.push((0, 0));
        for _ in 0..total {
            let mut remaining = seq + 1;
            loop {
                let left = data.length(documents[at] as usize) as u64 - offset;
                if left >= remaining {
                    offset += remaining - 1;
                    break;
                }
                remaining -= left;
                at += 1;
                offset = 0;
            }
            starts.push((at as u64, offset));
        }
        let mut order: Vec<u64> = (0..total).collect();
        Rng::new(packing.seed, u64::MAX).shuffle(&mut order);
        Ok(Self {
            data,
            seq: packing.seq,
            documents,
            starts,
            order,
        })
    }

    /// Whether the indexes point only where they may (a cache read back is checked).
    fn consistent(&self) -> bool {
        let samples = self.order.len() as u64;
        self.starts.len() as u64 == samples + 1
            && self.order.iter().all(|&j| j < samples)
            && self.documents.iter().all(|&d| (d as usize) < self.data.len())
            && self.starts.windows(2).all(|w| {
                let ((a, x), (b, y)) = (w[0], w[1]);
                (a, x) <= (b, y)
                    && (b as usize) < self.documents.len()
                    && (y as usize) < self.data.length(self.documents[b as usize] as usize).max(1)
            })
    }

    /// Samples it holds (at least those asked for).
    pub fn len(&self) -> u64 {
        self.order.len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// Sample `i`'s `seq + 1` tokens, checked against `vocab`.
    pub fn sample(&self, i: u64, vocab: usize) -> Result<Vec<u32>, DataError> {
        let j = self.order[i as usize] as usize;
        let ((mut at, mut offset), end) = (self.starts[j], self.starts[j + 1]);
        let mut out = vec![0u32; self.seq + 1];
        let mut filled = 0;
        while filled < out.len() {
            let sequence = self.documents[at as usize] as usize;
            let stop = match at == end.0 {
                true => end.1 as usize + 1,
                false => self.data.length(sequence),
            };
            let take = stop - offset as usize;
            self.data
                .read(sequence, offset as usize, &mut out[filled..filled + take], vocab)?;
            filled += take;
            at += 1;
            offset = 0;
        }
        Ok(out)
    }

    fn write_cache(&self, path: &Path, description: &str) -> Result<(), DataError> {
        let mut out = Vec::with_capacity(64 + description.len() + 8 * (self.documents.len() + 3 * self.starts.len()));
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&(description.len() as u64).to_le_bytes());
        out.extend_from_slice(description.as_bytes());
        for n in [self.documents.len(), self.starts.len(), self.order.len()] {
            out.extend_from_slice(&(n as u64).to_le_bytes());
        }
        self.documents
            .iter()
            .for_each(|v| out.extend_from_slice(&v.to_le_bytes()));
        for (a, b) in &self.starts {
            out.extend_from_slice(&a.to_le_bytes());
            out.extend_from_slice(&b.to_le_bytes());
        }
        self.order.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes()));
        // Whole or not at all: another rank or process may be reading it.
        let partial = path.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&partial, &out).map_err(|e| DataError::io(&partial, e))?;
        std::fs::rename(&partial, path).map_err(|e| DataError::io(path, e))
    }
}

const MAGIC: &[u8; 8] = b"BMPACK1\0";

/// The cache file of the indexes `description` names, beside the dataset's index in `dir`.
fn cache_path(dir: &Path, index: &Path, description: &str) -> PathBuf {
    // FNV-1a: a fixed hash (std's may change between Rust versions).
    let hash = description.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    });
    let stem = index
        .file_stem()
        .map_or("data".into(), |s| s.to_string_lossy().into_owned());
    dir.join(format!("{stem}-{hash:016x}.packed"))
}

type Indexes = (Vec<u64>, Vec<(u64, u64)>, Vec<u64>);

/// The cached indexes if the file holds those of `description`, whole.
fn read_cache(path: &Path, description: &str) -> Option<Indexes> {
    let bytes = std::fs::read(path).ok()?;
    let mut at = 0usize;
    let mut take = |n: usize| -> Option<&[u8]> {
        let slice = bytes.get(at..at.checked_add(n)?)?;
        at += n;
        Some(slice)
    };
    if take(8)? != MAGIC {
        return None;
    }
    let word = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
    let len = word(take(8)?) as usize;
    if take(len)? != description.as_bytes() {
        return None;
    }
    let (documents, starts, order) = (word(take(8)?), word(take(8)?), word(take(8)?));
    let body = documents.checked_add(starts.checked_mul(2)?)?.checked_add(order)?;
    let rest = take(usize::try_from(body).ok()?.checked_mul(8)?)?;
    let mut words = rest.chunks_exact(8).map(word);
    let documents: Vec<u64> = words.by_ref().take(documents as usize).collect();
    let starts: Vec<(u64, u64)> = (0..starts)
        .map(|_| (words.next().unwrap(), words.next().unwrap()))
        .collect();
    let order: Vec<u64> = words.collect();
    Some((documents, starts, order))
}

impl super::blend::Samples for PackedDataset {
    type Sample = Vec<u32>;

    fn count(&self) -> u64 {
        self.len()
    }

    fn get(&self, i: u64, vocab: usize) -> Result<Vec<u32>, DataError> {
        self.sample(i, vocab)
    }
}
