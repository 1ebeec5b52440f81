//! A job's tokenized datasets, ready to train: each split into its training documents and a
//! held-out share, packed, and blended by weight.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::blend::{Blend, Samples, data_path, shares};
use super::packed::{PackedDataset, Packing};
use super::sft::{SftDataset, SftShape, mask_prefix};
use super::{DataError, IndexedDataset};

/// The training blend and, with a held-out share, the evaluation one.
pub struct Sources<D: Samples> {
    pub train: Blend<D>,
    pub held_out: Option<Blend<D>>,
}

/// What [`Sources`] reads.
#[derive(Clone, Debug)]
pub struct SourcesConfig<'a> {
    /// Megatron's `--data-path` list (`blend::data_path`).
    pub items: &'a [String],
    /// The share of each dataset's documents held out (its last ones).
    pub held_out: f64,
    /// Tokens a sample feeds the model.
    pub seq: usize,
    /// Samples training draws, and evaluation.
    pub samples: (u64, u64),
    pub seed: u64,
    /// Where the packed indexes are cached (beside each dataset when `None`).
    pub cache: Option<&'a Path>,
}

/// One dataset of the list: its prefix and files, its training and held-out sequences, its
/// weight (its training tokens where the list gives none).
struct Split {
    weight: f64,
    prefix: PathBuf,
    data: Arc<IndexedDataset>,
    train: Range<usize>,
    held: Range<usize>,
}

impl Sources<PackedDataset> {
    /// The datasets' documents packed (`packed.rs`) and blended.
    pub fn packed(config: &SourcesConfig) -> Result<Self, DataError> {
        Self::blended(config, |split, sequences, samples| {
            let cache = config
                .cache
                .or_else(|| split.prefix.parent())
                .filter(|p| !p.as_os_str().is_empty())
                .unwrap_or(Path::new("."));
            let packing = Packing {
                seq: config.seq,
                samples,
                seed: config.seed,
            };
            PackedDataset::new(split.data.clone(), sequences, &packing, Some(cache))
        })
    }
}

impl Sources<SftDataset> {
    /// Chat datasets (each with its loss mask beside it, `sft.rs`), a conversation a sample or
    /// (`pack`) several, blended; `pad` fills the samples past their conversations.
    pub fn chats(config: &SourcesConfig, pad: u32, pack: bool) -> Result<Self, DataError> {
        Self::blended(config, |split, sequences, samples| {
            let mask = Arc::new(IndexedDataset::open(&mask_prefix(&split.prefix))?);
            let shape = SftShape {
                seq: config.seq,
                samples,
                seed: config.seed,
                pad,
                pack,
            };
            SftDataset::new(split.data.clone(), mask, sequences, shape)
        })
    }
}

impl<D: Samples> Sources<D> {
    /// Each dataset's training and held-out sequences made into `D`s of their shares of the
    /// samples by `make`, and blended by the weights.
    fn blended(
        config: &SourcesConfig,
        make: impl Fn(&Split, Range<usize>, u64) -> Result<D, DataError>,
    ) -> Result<Self, DataError> {
        let items = data_path(config.items)?;
        if items.is_empty() {
            return Err(DataError::Config("no dataset named".into()));
        }
        let mut splits = Vec::with_capacity(items.len());
        for (weight, prefix) in items {
            let data = Arc::new(IndexedDataset::open(&prefix)?);
            let (train, held) = split(&data, config.held_out)?;
            let tokens: u64 = train.clone().map(|i| data.length(i) as u64).sum();
            splits.push(Split {
                weight: weight.unwrap_or(tokens as f64),
                prefix,
                data,
                train,
                held,
            });
        }
        let weights: Vec<f64> = splits.iter().map(|s| s.weight).collect();
        let blend = |samples: u64, held: bool| -> Result<Blend<D>, DataError> {
            let parts = splits
                .iter()
                .zip(shares(&weights, samples)?)
                .map(|(split, share)| {
                    let sequences = if held { split.held.clone() } else { split.train.clone() };
                    make(split, sequences, share)
                })
                .collect::<Result<Vec<_>, _>>()?;
            Blend::new(parts, &weights, samples)
        };
        Ok(Self {
            train: blend(config.samples.0, false)?,
            held_out: match config.held_out > 0.0 {
                true => Some(blend(config.samples.1, true)?),
                false => None,
            },
        })
    }
}

/// The sequences of `data`'s training documents and of its last `share` of documents.
fn split(data: &IndexedDataset, share: f64) -> Result<(Range<usize>, Range<usize>), DataError> {
    let documents = data.documents();
    if share == 0.0 {
        return Ok((0..data.len(), data.len()..data.len()));
    }
    let held = ((documents as f64 * share).round() as usize).max(1);
    if documents <= held {
        return Err(DataError::Config(format!(
            "{}: {documents} documents leave none to train on after holding out {held}",
            data.index_path().display()
        )));
    }
    let cut = data.document(documents - held).start;
    Ok((0..cut, cut..data.len()))
}
