//! A job's tokenized datasets, ready to train: each split into its training documents and a
//! held-out share, packed, and blended by weight.

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use super::blend::{Blend, data_path};
use super::packed::{PackedDataset, Packing};
use super::{DataError, IndexedDataset};

/// The training blend and, with a held-out share, the evaluation one.
pub struct Sources {
    pub train: Blend,
    pub held_out: Option<Blend>,
}

/// What [`Sources::open`] packs.
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

impl Sources {
    pub fn open(config: &SourcesConfig) -> Result<Self, DataError> {
        let items = data_path(config.items)?;
        if items.is_empty() {
            return Err(DataError::Config("no dataset named".into()));
        }
        let mut splits = Vec::with_capacity(items.len());
        for (weight, prefix) in &items {
            let data = Arc::new(IndexedDataset::open(prefix)?);
            let (train, held) = split(&data, config.held_out)?;
            let tokens: u64 = train.clone().map(|i| data.length(i) as u64).sum();
            let cache = config
                .cache
                .or_else(|| prefix.parent())
                .filter(|p| !p.as_os_str().is_empty());
            splits.push((
                weight.unwrap_or(tokens as f64),
                data,
                train,
                held,
                cache.unwrap_or(Path::new(".")),
            ));
        }
        let weights: Vec<f64> = splits.iter().map(|s| s.0).collect();
        let blend = |samples: u64, held: bool| -> Result<Blend, DataError> {
            let shares = Blend::shares(&weights, samples)?;
            let parts = splits
                .iter()
                .zip(shares)
                .map(|((_, data, train, held_out, cache), share)| {
                    let sequences = if held { held_out.clone() } else { train.clone() };
                    let packing = Packing {
                        seq: config.seq,
                        samples: share,
                        seed: config.seed,
                    };
                    PackedDataset::new(data.clone(), sequences, &packing, Some(cache))
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
