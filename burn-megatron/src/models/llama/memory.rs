//! A first estimate of a training step's peak device memory on one rank, before any tensor
//! exists: what does not grow with the batch (the rank's parameters, their gradients, fp32
//! master weights and two moments, split over dp × cp under ZeRO-1, and the runtime's own),
//! and what each sequence of a microbatch adds (the activations its blocks keep for backward,
//! under the chosen recomputation, and the logits with their gradient). Counted for the
//! busiest pipeline stage (the most blocks, and both the embedding and the output layer).
//!
//! Per token a block keeps, in the activations' dtype: the two norms' inputs and outputs (`4h`,
//! over tp under sequence parallelism), q, k and v, the attention's output, the MLP's gate, up
//! and their product (each over tp), q and k before their heads' norms where the attention has
//! them; selective recomputation drops the attention's output and
//! the MLP's product, a block recomputed whole keeps its input alone. A MoE block keeps each of a
//! token's `top_k` copies' input, gate, up and product, and the router's logits. For llama-1b
//! (bf16, batch 4 × 2048) this gives 9.3 GiB of activations and 14.3 GiB of fixed state; one
//! H200 measured 8.7 and 12.5 GiB (`docs/performance.md`), so the estimate errs high.

use burn_megatron_dist::ParallelDims;

use super::{LlamaConfig, WordEmbeddings};
use crate::plan::TensorParallel;
use crate::recompute::{Recompute, RecomputeMethod};

/// A rank's estimated peak memory: see the module docs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MemoryEstimate {
    /// Parameters on the rank, their gradients and the optimizer state, in bytes.
    pub state: u64,
    /// Activations and logits a sequence of a microbatch keeps, in bytes.
    pub per_sequence: u64,
}

/// What the device's runtime takes beside the tensors (its context, libraries' workspaces).
pub const RUNTIME_BYTES: u64 = 1 << 30;

/// What CubeCL's pools reserve beyond the tensors they hold, as a share: llama-1b's pools
/// reserved 23.2 GiB for 21.2 GiB of tensors (`docs/performance.md`).
pub const POOL_OVERHEAD: f64 = 0.10;

impl MemoryEstimate {
    /// The peak with `micro` sequences a microbatch, `in_flight` microbatches' activations held
    /// at once (1; a pipeline's first stage holds as many as its schedule warms up); saturating
    /// at `u64::MAX`.
    pub fn peak(&self, micro: usize, in_flight: usize) -> u64 {
        let sequences = micro as f64 * in_flight.max(1) as f64;
        let tensors = self.state as f64 + self.per_sequence as f64 * sequences;
        // Float to integer casts saturate.
        (tensors * (1.0 + POOL_OVERHEAD) + RUNTIME_BYTES as f64) as u64
    }

    /// The most sequences a microbatch whose peak fits `capacity` bytes; 0 where not even the
    /// state does.
    pub fn largest_micro(&self, capacity: u64, in_flight: usize) -> usize {
        let room = capacity.saturating_sub(RUNTIME_BYTES) as f64 / (1.0 + POOL_OVERHEAD);
        let room = room - self.state as f64;
        let per = self.per_sequence as f64 * in_flight.max(1) as f64;
        match room > 0.0 && per > 0.0 {
            true => (room / per) as usize,
            false => 0,
        }
    }
}

impl LlamaConfig {
    /// The peak memory of a training step on one rank of `dims` (sequence parallelism per
    /// `tensor`), sequences of `seq` tokens, parameters and activations of `dtype_bytes`, the
    /// optimizer state split over dp × cp with `zero1`: see the module docs. Counted in f64 (a
    /// configuration's sizes multiply past u64 before [`check_sizes`](Self::check_sizes) bounds
    /// them), saturating at `u64::MAX`.
    pub fn memory(
        &self,
        dims: ParallelDims,
        tensor: TensorParallel,
        seq: usize,
        dtype_bytes: u64,
        zero1: bool,
    ) -> MemoryEstimate {
        let n = |x: usize| x as f64;
        let (tp, ep, etp) = (n(dims.tp.max(1)), n(dims.ep.max(1)), n(dims.etp.unwrap_or(1).max(1)));
        let a = &self.attention;
        let (h, hd) = (n(a.d_model), n(a.head_dim()));
        let (q, kv) = (n(a.n_heads) * hd, n(a.n_kv_heads) * hd);
        let v = n(self.embedding.vocab_size);
        let blocks = self.n_layers.div_ceil(dims.pp.max(1));
        // The busiest stage: the first `blocks` (MoE blocks sit at multiples of `every`).
        let moe = |i: usize| self.moe.as_ref().filter(|m| m.holds(i));
        let mut params = (2.0 * v * h / tp).ceil() + h;
        if self.word_embeddings == WordEmbeddings::Tied {
            params -= (v * h / tp).floor();
        }
        let sp = match tensor {
            TensorParallel::SequenceParallel => tp,
            TensorParallel::Plain => 1.0,
        };
        // Elements a token keeps in block `i`, whole.
        let block_kept = |i: usize| -> f64 {
            let mut attention = (4.0 * h / sp).floor() + ((2.0 * q + 2.0 * kv) / tp).floor();
            // The heads' norms keep q and k before them too.
            if a.qk_norm.is_some() {
                attention += ((q + kv) / tp).floor();
            }
            // Latent attention keeps its latents whole (and normed), q and k of every head,
            // v and the heads' output.
            if let Some(l) = &self.latent {
                let (heads, qk, vd) = (n(l.n_heads), n(l.qk_dim()), n(l.v_dim));
                let latents = 2.0 * (n(l.q_rank.unwrap_or(0)) + n(l.kv_rank)) + n(l.qk_rope_dim);
                attention = (4.0 * h / sp).floor() + latents + (heads * (2.0 * qk + 2.0 * vd) / tp).floor();
            }
            let mlp = match moe(i) {
                Some(m) => {
                    let k = n(m.layer.router.top_k);
                    let shared = (3.0 * n(m.layer.shared_d_ff.unwrap_or(0)) / tp).floor();
                    k * (h + 3.0 * n(m.layer.d_ff)) + 2.0 * n(m.layer.router.n_experts) + shared
                }
                None => (3.0 * n(self.mlp.d_ff) / tp).floor(),
            };
            attention + mlp
        };
        // What selective recomputation does not keep of block `i`.
        let selective_drop = |i: usize| -> f64 {
            let product = match moe(i) {
                Some(m) => n(m.layer.router.top_k) * n(m.layer.d_ff),
                None => (n(self.mlp.d_ff) / tp).floor(),
            };
            let output = match &self.latent {
                Some(l) => n(l.n_heads) * n(l.v_dim),
                None => q,
            };
            (output / tp).floor() + product
        };
        for i in 0..blocks {
            params += match &self.latent {
                Some(l) => {
                    let (heads, qk, vd) = (n(l.n_heads), n(l.qk_dim()), n(l.v_dim));
                    let (cq, ckv, r) = (l.q_rank.map(n), n(l.kv_rank), n(l.qk_rope_dim));
                    let query = match cq {
                        Some(cq) => h * cq + cq + (cq * heads * qk / tp).floor(),
                        None => (h * heads * qk / tp).floor(),
                    };
                    let up = (ckv * heads * (n(l.qk_nope_dim) + vd) / tp).floor();
                    query + h * (ckv + r) + ckv + up + (heads * vd * h / tp).floor()
                }
                None => ((2.0 * h * q + 2.0 * h * kv) / tp).floor(),
            } + 2.0 * h;
            params += match moe(i) {
                Some(m) => {
                    let experts = n(m.layer.router.n_experts) * 3.0 * h * n(m.layer.d_ff);
                    (experts / (ep * etp)).floor()
                        + (3.0 * h * n(m.layer.shared_d_ff.unwrap_or(0)) / tp).floor()
                        + h * n(m.layer.router.n_experts)
                }
                None => (3.0 * h * n(self.mlp.d_ff) / tp).floor(),
            };
        }
        let whole: Vec<f64> = (0..blocks).map(block_kept).collect();
        let mut kept = match self.recompute {
            Recompute::None => whole.iter().sum(),
            Recompute::Selective => (0..blocks).map(|i| whole[i] - selective_drop(i)).sum(),
            Recompute::Full { method, layers } => {
                let input = (h / sp).floor();
                match method {
                    // A group's input kept; one group's blocks live again during its backward.
                    RecomputeMethod::Uniform => {
                        let groups = whole.chunks(layers.max(1));
                        let largest = groups.map(|g| g.iter().sum::<f64>()).fold(0.0, f64::max);
                        n(blocks.div_ceil(layers.max(1))) * input + largest
                    }
                    RecomputeMethod::Block => {
                        let first = layers.min(blocks);
                        let rest: f64 = whole[first..].iter().sum();
                        n(first) * input + rest + whole.first().copied().unwrap_or(0.0)
                    }
                }
            }
        };
        // The logits and their gradient, over tp's vocabulary shards; the embedding's output.
        kept += (2.0 * v / tp).floor() + (h / sp).floor();
        // A rank holds its share of the sequence under cp.
        let tokens = n(seq / dims.cp.max(1));
        let optimizer = match zero1 {
            true => (12.0 * params / n((dims.dp * dims.cp).max(1))).floor(),
            false => 12.0 * params,
        };
        let bytes = dtype_bytes as f64;
        // Float to integer casts saturate.
        MemoryEstimate {
            state: (params * bytes * 2.0 + optimizer) as u64,
            per_sequence: (kept * bytes * tokens) as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use burn_megatron_dist::ParallelDims;

    use super::*;
    use crate::models::llama::preset;

    const GIB: f64 = (1u64 << 30) as f64;

    /// llama-1b by hand: 956M parameters (16 blocks of 4·2048² + 3·2048·5632, an embedding and
    /// an output of 32768·2048, 33 norms), 16 bytes each in bf16 with fp32 master weights and
    /// moments; a token keeps 16 · (4·2048 + 4·2048 + 3·5632) + 2·32768 + 2048 elements.
    #[test]
    fn llama_1b_by_hand() {
        let model = preset("llama-1b").unwrap().model;
        let one = ParallelDims::single();
        let estimate = model.memory(one, TensorParallel::Plain, 2048, 2, false);
        let params = 16 * (4 * 2048 * 2048 + 3 * 2048 * 5632 + 2 * 2048) + 2 * 32768 * 2048 + 2048;
        assert_eq!(estimate.state, params * 16);
        let token = 16 * (4 * 2048 + 4 * 2048 + 3 * 5632) + 2 * 32768 + 2048;
        assert_eq!(estimate.per_sequence, token * 2 * 2048);
        // Above what one H200 measured (12.5 GiB of state, 8.7 GiB of activations at batch 4).
        assert!(estimate.state as f64 / GIB > 12.5);
        assert!(4.0 * estimate.per_sequence as f64 / GIB > 8.7);
    }

    /// Each split shrinks its share: tp and SP the blocks' and the logits', ZeRO-1 the
    /// optimizer's, pp the blocks', recomputation the activations'; a larger capacity fits a
    /// larger microbatch, and the largest one's peak fits.
    #[test]
    fn splits_shrink_their_share() {
        let model = preset("llama-1b").unwrap().model;
        let at = |dims: ParallelDims, tensor, zero1| model.memory(dims, tensor, 2048, 2, zero1);
        let one = at(ParallelDims::single(), TensorParallel::Plain, false);
        let tp = at(ParallelDims::tp_dp(2, 1), TensorParallel::Plain, false);
        let sp = at(ParallelDims::tp_dp(2, 1), TensorParallel::SequenceParallel, false);
        assert!(tp.state < one.state && tp.per_sequence < one.per_sequence);
        assert!(sp.per_sequence < tp.per_sequence && sp.state == tp.state);
        let zero1 = at(ParallelDims::tp_dp(1, 4), TensorParallel::Plain, true);
        assert!(zero1.state < one.state && zero1.per_sequence == one.per_sequence);
        let mut recomputed = model.clone();
        for (recompute, smaller) in [
            (Recompute::Selective, true),
            (
                Recompute::Full {
                    method: RecomputeMethod::Uniform,
                    layers: 1,
                },
                true,
            ),
        ] {
            recomputed.recompute = recompute;
            let r = recomputed.memory(ParallelDims::single(), TensorParallel::Plain, 2048, 2, false);
            assert_eq!(r.per_sequence < one.per_sequence, smaller, "{recompute:?}");
        }
        let h100 = 80 * (1u64 << 30);
        let micro = one.largest_micro(h100, 1);
        assert!(
            micro > 4 && one.peak(micro, 1) <= h100 && one.peak(micro + 1, 1) > h100,
            "{micro}"
        );
        assert!(one.largest_micro(2 * h100, 1) > micro);
        assert_eq!(one.largest_micro(one.state, 1), 0);
    }
}
