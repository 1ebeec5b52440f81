//! The load-balanced split of a sequence over the context-parallel group: `2·cp` chunks of
//! `L = s / 2cp` tokens, rank `r` holding chunks `r` and `2cp − 1 − r`, so under the causal
//! mask every rank does the same work (the early chunk's few keys and the late chunk's many).
//!
//! Legend: `s` the whole sequence, `L` a chunk, `c` a chunk index.

use burn::tensor::kind::Basic;
use burn::tensor::{Int, Tensor, TensorData};
use burn_megatron_dist::ProcessGroup;

use crate::error::ConfigError;

/// Where this rank's tokens lie in the whole sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ContextLayout {
    pub cp: usize,
    pub rank: usize,
}

impl ContextLayout {
    pub fn new(cp: &ProcessGroup) -> Self {
        Self {
            cp: cp.size(),
            rank: cp.group_rank(),
        }
    }

    /// Checks that a sequence of `seq_len` tokens splits into `2·cp` equal chunks.
    pub fn check(cp: usize, seq_len: usize) -> Result<(), ConfigError> {
        match cp > 1 && !seq_len.is_multiple_of(2 * cp) {
            true => Err(ConfigError::ContextChunks { seq_len, cp }),
            false => Ok(()),
        }
    }

    /// The chunks of group rank `rank`, early then late.
    pub fn chunks_of(&self, rank: usize) -> [usize; 2] {
        [rank, 2 * self.cp - 1 - rank]
    }

    /// The global position of each of the `local` tokens this rank holds (`local = 2L`).
    pub fn positions(&self, local: usize) -> Vec<usize> {
        let l = local / 2;
        self.chunks_of(self.rank)
            .iter()
            .flat_map(|c| c * l..(c + 1) * l)
            .collect()
    }

    /// For the sequence of every rank's tokens in rank order (what an all-gather makes), the
    /// global position of each: `[s]`.
    pub fn gathered_positions(&self, seq_len: usize) -> Vec<usize> {
        let l = seq_len / (2 * self.cp);
        (0..self.cp)
            .flat_map(|r| self.chunks_of(r))
            .flat_map(|c| c * l..(c + 1) * l)
            .collect()
    }

    /// For each global position, where it lies in the gathered sequence: the inverse of
    /// [`gathered_positions`](Self::gathered_positions).
    pub fn global_order(&self, seq_len: usize) -> Vec<usize> {
        let mut inverse = vec![0; seq_len];
        for (at, p) in self.gathered_positions(seq_len).into_iter().enumerate() {
            inverse[p] = at;
        }
        inverse
    }

    /// This rank's tokens of a whole sequence along `dim`: its two chunks, early then late.
    ///
    /// # Shapes
    /// `[.., s, ..]` → `[.., s/cp, ..]`
    pub fn shard<const D: usize, K: Basic>(&self, x: Tensor<D, K>, dim: usize) -> Result<Tensor<D, K>, ConfigError> {
        let s = x.dims()[dim];
        Self::check(self.cp, s)?;
        if self.cp == 1 {
            return Ok(x);
        }
        let l = s / (2 * self.cp);
        let [a, b] = self.chunks_of(self.rank);
        Ok(Tensor::cat(
            vec![x.clone().narrow(dim, a * l, l), x.narrow(dim, b * l, l)],
            dim,
        ))
    }
}

/// `order` as an index tensor on `device`.
pub fn index(order: &[usize], device: &burn::tensor::Device) -> Tensor<1, Int> {
    let values: Vec<i64> = order.iter().map(|&i| i as i64).collect();
    Tensor::from_data(TensorData::new(values, [order.len()]), device)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(cp: usize, rank: usize) -> ContextLayout {
        ContextLayout { cp, rank }
    }

    /// cp = 2, s = 8: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2; every rank's
    /// causal work (the keys its queries see) is the same; the gathered order and its inverse
    /// compose to the identity.
    #[test]
    fn chunks_balance_and_invert() {
        assert_eq!(layout(2, 0).positions(4), vec![0, 1, 6, 7]);
        assert_eq!(layout(2, 1).positions(4), vec![2, 3, 4, 5]);
        assert_eq!(layout(2, 0).gathered_positions(8), vec![0, 1, 6, 7, 2, 3, 4, 5]);
        for cp in [1, 2, 3, 4] {
            let s = 4 * cp * 3;
            let work: Vec<usize> = (0..cp)
                .map(|r| layout(cp, r).positions(s / cp).iter().map(|p| p + 1).sum())
                .collect();
            assert!(work.iter().all(|w| *w == work[0]), "cp {cp}: {work:?}");
            let l = layout(cp, 0);
            let (gathered, order) = (l.gathered_positions(s), l.global_order(s));
            for p in 0..s {
                assert_eq!(gathered[order[p]], p);
            }
            let mut every: Vec<usize> = (0..cp).flat_map(|r| layout(cp, r).positions(s / cp)).collect();
            every.sort_unstable();
            assert_eq!(every, (0..s).collect::<Vec<_>>(), "each position once");
        }
    }

    #[test]
    fn shards_and_refuses_uneven_chunks() {
        let device = burn::tensor::Device::flex();
        let x = Tensor::<1, Int>::arange(0..16, &device).reshape([2, 8]);
        let shard = layout(2, 1).shard(x.clone(), 1).unwrap();
        let values: Vec<i64> = shard.into_data().convert::<i64>().try_into_vec().unwrap();
        assert_eq!(values, vec![2, 3, 4, 5, 10, 11, 12, 13]);
        assert_eq!(
            layout(3, 0).shard(x, 1).unwrap_err(),
            ConfigError::ContextChunks { seq_len: 8, cp: 3 }
        );
    }
}
