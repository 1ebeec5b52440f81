//! Parameters that several pipeline stages hold under one path: tied word embeddings, the
//! embedding on the first stage and its copy as the output layer on the last (Megatron's
//! embedding group). They are one parameter of the model: their gradients, once reduced over
//! dp × cp, are summed over the stages holding them (each stage's copy then takes the same update
//! and stays equal to the bit), the norm counts them once and a checkpoint writes them once, both
//! on the first stage holding them.
//!
//! Found by path, so any model whose stages share a path is served, not only the Llama: every
//! pp rank hashes its parameters' paths and the ranks gather each other's hashes.

use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_megatron_dist::{CommError, ProcessGroup, ReduceOp};

use crate::params::ParamInfo;

/// Which pp ranks hold each of this rank's parameters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StageCopies {
    /// For each parameter in traversal order, the pp ranks holding it, ascending (this rank
    /// among them).
    holders: Vec<Vec<usize>>,
    /// The parameters held elsewhere too, in path order (the order every holder agrees on).
    shared: Vec<usize>,
    rank: usize,
}

impl StageCopies {
    /// The holders of each of `infos`' parameters over `pp`. Every rank of `pp` calls it.
    pub fn find(infos: &[ParamInfo], pp: &ProcessGroup, device: &Device) -> Result<Self, CommError> {
        let rank = pp.group_rank();
        if pp.size() == 1 {
            return Ok(Self::alone(infos));
        }
        let mine: Vec<u64> = infos.iter().map(|info| path_hash(&info.path)).collect();
        let count = Tensor::<1, Int>::from_data(TensorData::new(vec![mine.len() as i64], [1]), device);
        let longest = pp.all_reduce(count, ReduceOp::Max)?.into_scalar::<i64>() as usize;
        // Two 31-bit halves a hash (an Int tensor may be i32); -1 pads the shorter lists.
        let mut halves: Vec<i64> = mine
            .iter()
            .flat_map(|h| [(h >> 33) as i64, ((h >> 2) & 0x7fff_ffff) as i64])
            .collect();
        halves.resize(2 * longest.max(1), -1);
        let local = Tensor::<1, Int>::from_data(TensorData::new(halves, [2 * longest.max(1)]), device);
        let all: Vec<i64> = pp.all_gather(local, 0)?.into_data().iter::<i64>().collect();
        let per_rank = 2 * longest.max(1);
        let holders: Vec<Vec<usize>> = mine
            .iter()
            .map(|h| {
                let key = [(h >> 33) as i64, ((h >> 2) & 0x7fff_ffff) as i64];
                (0..pp.size())
                    .filter(|&r| all[r * per_rank..(r + 1) * per_rank].chunks(2).any(|pair| pair == key))
                    .collect()
            })
            .collect();
        let mut shared: Vec<usize> = (0..infos.len()).filter(|&i| holders[i].len() > 1).collect();
        shared.sort_by(|&a, &b| infos[a].path.cmp(&infos[b].path));
        Ok(Self { holders, shared, rank })
    }

    /// One stage: every parameter its own.
    pub fn alone(infos: &[ParamInfo]) -> Self {
        Self {
            holders: vec![vec![0]; infos.len()],
            shared: Vec::new(),
            rank: 0,
        }
    }

    /// Whether parameter `index` is counted (in the norm, in a checkpoint) on this rank: it is
    /// the first stage holding it.
    pub fn counted_here(&self, index: usize) -> bool {
        self.holders.get(index).is_none_or(|h| h.first() == Some(&self.rank))
    }

    /// Whether any of this rank's parameters is held by another stage too.
    pub fn any(&self) -> bool {
        !self.shared.is_empty()
    }

    /// `grads` (flat, in traversal order, each already reduced over dp × cp: this rank's shard
    /// under ZeRO-1, which lines up with its pp peers', which hold the same dp rank) with each
    /// shared parameter's summed over its holders, in holder order, so that every holder gets
    /// the same bits. Summing after the reduction keeps that true whatever the dp size: the
    /// holders reduce over different communicators, whose sums of three or more terms need not
    /// agree to the bit. Every rank of `pp` holding a shared parameter calls it.
    pub fn sum_over_holders(&self, mut grads: Vec<Tensor<1>>, pp: &ProcessGroup) -> Result<Vec<Tensor<1>>, CommError> {
        for &i in &self.shared {
            let holders = &self.holders[i];
            let me = holders.iter().position(|&r| r == self.rank).expect("a holder");
            let own = grads[i].clone();
            let mut parts: Vec<Option<Tensor<1>>> = vec![None; holders.len()];
            parts[me] = Some(own.clone());
            // The pairs (a, b), a < b, in the same order on every holder, each a send then a
            // receive on both sides (one NCCL group a pair): no two holders wait on each other.
            for a in 0..holders.len() {
                for b in a + 1..holders.len() {
                    let peer = match (a == me, b == me) {
                        (true, _) => b,
                        (_, true) => a,
                        _ => continue,
                    };
                    pp.send(own.clone(), holders[peer])?;
                    parts[peer] = Some(pp.recv(own.zeros_like(), holders[peer])?);
                }
            }
            grads[i] = parts
                .into_iter()
                .map(|p| p.expect("every holder's part"))
                .reduce(|a, b| a + b)
                .expect("a holder");
        }
        Ok(grads)
    }
}

/// FNV-1a over the path's bytes.
fn path_hash(path: &str) -> u64 {
    path.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn_megatron_dist::comm::in_process::InProcessWorld;

    fn info(path: &str) -> ParamInfo {
        ParamInfo {
            path: path.to_string(),
            tp_split: false,
            split_dim: None,
            expert: false,
            trainable: true,
        }
    }

    /// Three stages: `embedding.weight` on the first and the last, `shared.w` on all three,
    /// blocks on each; the holders, the rank counting each parameter, and the summed gradients
    /// (the same on every holder, the blocks' untouched).
    #[test]
    fn shared_paths_are_found_and_summed() {
        let world = InProcessWorld::new(3);
        let paths: [&[&str]; 3] = [
            &["embedding.weight", "layers.0.w", "shared.w"],
            &["shared.w", "layers.1.w"],
            &["layers.2.w", "norm.weight", "embedding.weight", "shared.w"],
        ];
        let results: Vec<_> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..3)
                .map(|rank| {
                    let group = world.group("pp", vec![0, 1, 2], rank);
                    let infos: Vec<ParamInfo> = paths[rank].iter().map(|p| info(p)).collect();
                    scope.spawn(move || {
                        let device = Device::flex();
                        let copies = StageCopies::find(&infos, &group, &device).expect("find");
                        let grads: Vec<Tensor<1>> = infos
                            .iter()
                            .map(|_| Tensor::<1>::from_floats([rank as f32 + 1.0, 2.0], &device))
                            .collect();
                        let summed = copies.sum_over_holders(grads, &group).expect("sum");
                        let values: Vec<Vec<f32>> = summed
                            .into_iter()
                            .map(|g| g.into_data().try_to_vec::<f32>().expect("f32"))
                            .collect();
                        let counted: Vec<bool> = (0..infos.len()).map(|i| copies.counted_here(i)).collect();
                        (copies.any(), counted, values)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("rank")).collect()
        });
        assert!(results.iter().all(|r| r.0));
        assert_eq!(results[0].1, vec![true, true, true]);
        assert_eq!(results[1].1, vec![false, true]);
        assert_eq!(results[2].1, vec![true, true, false, false]);
        // The embedding 1 + 3 on both its holders, `shared.w` 1 + 2 + 3 on all three; every
        // other gradient its own.
        assert_eq!(results[0].2, vec![vec![4.0, 4.0], vec![1.0, 2.0], vec![6.0, 6.0]]);
        assert_eq!(results[1].2, vec![vec![6.0, 6.0], vec![2.0, 2.0]]);
        assert_eq!(
            results[2].2,
            vec![vec![3.0, 2.0], vec![3.0, 2.0], vec![4.0, 4.0], vec![6.0, 6.0]]
        );
    }
}
