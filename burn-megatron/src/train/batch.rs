//! [`TokenBatch`]: what a training step reads, and its split into microbatches.

use burn::tensor::{Device, Int, Tensor, TensorData};

use crate::error::ConfigError;
use crate::layers::Documents;
use crate::layers::context::ContextLayout;

/// Token ids and the ids that follow them: a rank's whole sequences (under context
/// parallelism, each cp rank takes its chunks inside the step); where rows pack several
/// documents, where each one lies.
///
/// # Shapes
/// `ids`, `targets`: `[b, s]`
#[derive(Clone, Debug)]
pub struct TokenBatch {
    pub ids: Tensor<2, Int>,
    pub targets: Tensor<2, Int>,
    /// The documents packed in each row, attended inside each one; `None`: a row is one.
    pub documents: Option<Documents>,
}

/// One sequence's inputs and targets (`s` each), where the targets are not simply the next
/// tokens: a chat's, whose targets outside the assistant's turns are the loss's ignored id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Targeted {
    pub ids: Vec<i64>,
    pub targets: Vec<i64>,
    /// The lengths of the documents the inputs pack, in order (the rest of the row one more);
    /// empty: the row is one document.
    pub documents: Vec<usize>,
}

impl TokenBatch {
    /// Rows of one document each.
    ///
    /// # Shapes
    /// `[b, s]`, `[b, s]`
    pub fn new(ids: Tensor<2, Int>, targets: Tensor<2, Int>) -> Self {
        Self {
            ids,
            targets,
            documents: None,
        }
    }

    /// The batch of `items`, all of one length; with their documents where any packs several.
    ///
    /// # Shapes
    /// `[items, s]`, `[items, s]`
    pub fn targeted(items: Vec<Targeted>, device: &Device) -> Result<Self, ConfigError> {
        let (b, s) = (items.len(), items.first().map_or(0, |x| x.ids.len()));
        let mut ids = Vec::with_capacity(b * s);
        let mut targets = Vec::with_capacity(b * s);
        let packed = items.iter().any(|item| item.documents.len() > 1);
        let mut lengths = Vec::with_capacity(b);
        for item in items {
            assert!(
                item.ids.len() == s && item.targets.len() == s,
                "every sequence of a batch has the same length"
            );
            ids.extend(item.ids);
            targets.extend(item.targets);
            lengths.push(item.documents);
        }
        let documents = match packed {
            true => Some(Documents::from_lengths(&lengths, s, device)?),
            false => None,
        };
        Ok(Self {
            ids: Tensor::from_data(TensorData::new(ids, [b, s]), device),
            targets: Tensor::from_data(TensorData::new(targets, [b, s]), device),
            documents,
        })
    }

    /// Sequences in the batch.
    pub fn sequences(&self) -> usize {
        self.ids.dims()[0]
    }

    /// Tokens in the batch.
    pub fn tokens(&self) -> usize {
        let [b, s] = self.ids.dims();
        b * s
    }

    /// This context-parallel rank's chunks of the sequences (the batch itself at cp = 1), their
    /// packed documents' positions with them.
    ///
    /// # Shapes
    /// `[b, s]` → `[b, s/cp]`
    pub fn context_shard(self, layout: &ContextLayout) -> Result<Self, ConfigError> {
        if layout.cp == 1 {
            return Ok(self);
        }
        Ok(Self {
            ids: layout.shard(self.ids, 1)?,
            targets: layout.shard(self.targets, 1)?,
            documents: self.documents.map(|d| d.context_shard(layout)).transpose()?,
        })
    }

    /// The batch cut into `parts` microbatches of equal sequences, in order.
    ///
    /// # Shapes
    /// `[b, s]` → `parts ×` `[b / parts, s]`
    pub fn split(self, parts: usize) -> Result<Vec<TokenBatch>, ConfigError> {
        let b = self.sequences();
        if parts == 0 || b < parts || !b.is_multiple_of(parts) {
            return Err(ConfigError::MicrobatchSplit {
                sequences: b,
                microbatches: parts,
            });
        }
        if parts == 1 {
            return Ok(vec![self]);
        }
        let per = b / parts;
        Ok((0..parts)
            .map(|i| {
                let rows = |t: &Tensor<2, Int>| t.clone().narrow(0, i * per, per);
                TokenBatch {
                    ids: rows(&self.ids),
                    targets: rows(&self.targets),
                    documents: self.documents.as_ref().map(|d| Documents {
                        positions: rows(&d.positions),
                        starts: rows(&d.starts),
                    }),
                }
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, TensorData};

    use super::*;

    fn batch(b: usize) -> TokenBatch {
        let device = Device::flex();
        let ids: Vec<i64> = (0..b as i64 * 3).collect();
        let ids = Tensor::<2, Int>::from_data(TensorData::new(ids, [b, 3]), &device);
        TokenBatch::new(ids.clone(), ids.add_scalar(1))
    }

    /// Microbatches are consecutive rows; a split that leaves rows over is a typed error.
    #[test]
    fn splits_rows_in_order() {
        let parts = batch(4).split(2).unwrap();
        let rows = |t: &Tensor<2, Int>| t.clone().into_data().convert::<i64>().try_to_vec::<i64>().unwrap();
        assert_eq!(rows(&parts[0].ids), vec![0, 1, 2, 3, 4, 5]);
        assert_eq!(rows(&parts[1].targets), vec![7, 8, 9, 10, 11, 12]);
        for (b, parts) in [(4, 3), (2, 4), (2, 0)] {
            assert_eq!(
                batch(b).split(parts).unwrap_err(),
                ConfigError::MicrobatchSplit {
                    sequences: b,
                    microbatches: parts
                }
            );
        }
    }
}
