//! Sequences that pack several documents end to end (packed SFT): each token's position in its
//! own document, where RoPE rotates it, and its document's first index in the row, before which
//! attention hides every key (`burn_megatron_kernels::attention::document_attention`). So a
//! packed row trains as its documents would one by one.

use burn::tensor::{Device, Int, Tensor, TensorData};

use super::context::ContextLayout;
use crate::error::ConfigError;

/// The documents of a batch of packed rows.
///
/// # Shapes
/// `positions` and `starts`: `[b, s]`
#[derive(Clone, Debug)]
pub struct Documents {
    /// Each token's position in its document (0 at its first token): this rank's chunks'
    /// under context parallelism ([`context_shard`](Self::context_shard)).
    pub positions: Tensor<2, Int>,
    /// Each token's document's first index in its row, over the whole row (under context
    /// parallelism too: the attention reads it over the whole sequence).
    pub starts: Tensor<2, Int>,
}

impl Documents {
    /// Rows of `s` tokens, row `r` holding documents of `lengths[r]` tokens in order (none
    /// empty); the tokens after them, if any, one more document (padding).
    pub fn from_lengths(lengths: &[Vec<usize>], s: usize, device: &Device) -> Result<Self, ConfigError> {
        let mut positions = Vec::with_capacity(lengths.len() * s);
        let mut starts = Vec::with_capacity(lengths.len() * s);
        for (row, docs) in lengths.iter().enumerate() {
            let total: usize = docs.iter().sum();
            if total > s || docs.contains(&0) {
                return Err(ConfigError::Documents(format!(
                    "row {row}: documents of {docs:?} tokens in a row of {s} (each at least one token, \
                     together at most the row)"
                )));
            }
            let mut start = 0;
            for len in docs.iter().copied().chain((total < s).then_some(s - total)) {
                positions.extend((0..len).map(|p| p as i64));
                starts.extend(std::iter::repeat_n(start as i64, len));
                start += len;
            }
        }
        let tensor = |v: Vec<i64>| Tensor::from_data(TensorData::new(v, [lengths.len(), s]), device);
        Ok(Self {
            positions: tensor(positions),
            starts: tensor(starts),
        })
    }

    /// `[b, s]`, this rank's tokens.
    pub fn dims(&self) -> [usize; 2] {
        self.positions.dims()
    }

    /// This context-parallel rank's part: its chunks' positions, the whole rows' starts.
    pub fn context_shard(self, layout: &ContextLayout) -> Result<Self, ConfigError> {
        Ok(Self {
            positions: layout.shard(self.positions, 1)?,
            starts: self.starts,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_restart_with_each_document() {
        let device = Device::flex();
        let docs = Documents::from_lengths(&[vec![3, 2], vec![4]], 6, &device).unwrap();
        let ints = |t: Tensor<2, Int>| t.into_data().convert::<i64>().try_to_vec::<i64>().unwrap();
        assert_eq!(ints(docs.positions), [0, 1, 2, 0, 1, 0, 0, 1, 2, 3, 0, 1]);
        assert_eq!(ints(docs.starts), [0, 0, 0, 3, 3, 5, 0, 0, 0, 0, 4, 4]);
        assert!(Documents::from_lengths(&[vec![4, 3]], 6, &device).is_err());
        assert!(Documents::from_lengths(&[vec![0, 3]], 6, &device).is_err());
    }
}
