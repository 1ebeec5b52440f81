//! The attention of this rank's two query chunks over the whole sequence's keys and values,
//! `L × L` block by block on the flash kernels (`burn_megatron_kernels::attention`), the
//! blocks' results merged by their log-sum-exp; and its backward, each block's gradients from
//! the merged output and log-sum-exp (what flash attention's backward takes), so no `s × s`
//! matrix exists anywhere.
//!
//! Which blocks a rank computes, under the causal mask and the load-balanced layout (rank `r`
//! holds chunks `r` and `2cp − 1 − r`, so its early chunk precedes, and its late chunk follows,
//! every chunk of another rank `src` bar the mirror):
//!
//! | keys of | query chunk early | query chunk late |
//! |---|---|---|
//! | itself | its own, causal (one `2L × 2L` causal call) | |
//! | `src < r` | `src`'s early chunk | `src`'s early chunk |
//! | `src > r` | — | both of `src`'s chunks |
//!
//! How the keys and values of the other ranks arrive ([`Exchange`]):
//! - `Ring`: around the cp ring, one rank's K/V a step, each transfer posted before the block
//!   held is computed (the first before the rank's own block); in backward the K/V travel again
//!   with their gradient accumulator, block by block after each is computed, the accumulator
//!   coming home after the last step (Megatron's `p2p`).
//! - `AllGather`: all at once (Llama 3's), posted before the own block; gathered again in
//!   backward, whose K/V gradients are reduce-scattered to their owners.
//!
//! Legend: `b` batch, `h` query heads, `g` kv heads (`r = h/g` query heads read each), `L` a
//! chunk, `d` head_dim; local sequences are `2L` (early chunk, then late).

use burn::tensor::{DType, Tensor};
use burn_megatron_dist::{CommError, ProcessGroup, ReduceOp};
use burn_megatron_kernels::attention::{attention_grads, attention_parts};

use crate::layers::heads::repeat_heads;

/// How the other ranks' keys and values reach a rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exchange {
    Ring,
    AllGather,
}

/// One rank's block attention over its cp group.
#[derive(Clone, Debug)]
pub struct BlockAttention {
    pub cp: ProcessGroup,
    pub exchange: Exchange,
    /// The scores' scale, `1/√d`.
    pub scale: f32,
}

/// The (query chunk, key chunk) blocks of rank `rank` over another rank `src`'s keys.
fn blocks(rank: usize, src: usize) -> [(usize, usize); 2] {
    match src < rank {
        true => [(0, 0), (1, 0)],
        false => [(1, 0), (1, 1)],
    }
}

/// Chunk `c` of a local sequence (dim 2) of chunks of `l`.
fn chunk<const D: usize>(x: &Tensor<D>, c: usize, l: usize) -> Tensor<D> {
    x.clone().narrow(2, c * l, l)
}

/// A query chunk's merged output (f32, normalized) and lse₂ so far.
struct Running {
    out: Tensor<4>,
    lse: Tensor<3>,
}

impl Running {
    /// Merges a block's normalized output and lse₂ in: weights `2^(lse − max)` each.
    fn merge(self, out: Tensor<4>, lse: Tensor<3>) -> Self {
        let ln2 = std::f64::consts::LN_2;
        let max = self.lse.clone().max_pair(lse.clone());
        let weight = |l: Tensor<3>| (l - max.clone()).mul_scalar(ln2).exp();
        let (wa, wb) = (weight(self.lse), weight(lse));
        let total = wa.clone() + wb.clone();
        let w = |t: Tensor<3>| t.unsqueeze_dim::<4>(3);
        let out = (self.out * w(wa) + out.cast(DType::F32) * w(wb)) / w(total.clone());
        Self {
            out,
            lse: max.clone() + total.log().div_scalar(ln2),
        }
    }
}

impl BlockAttention {
    /// A gradient of the expanded keys summed back onto their kv heads: `[b, h, L, d]` →
    /// `[b, g, L, d]`, f32.
    fn fold(x: Tensor<4>, per_kv: usize) -> Tensor<4> {
        let x = x.cast(DType::F32);
        if per_kv == 1 {
            return x;
        }
        let [b, h, l, d] = x.dims();
        x.reshape([b, h / per_kv, per_kv, l, d])
            .sum_dim(2)
            .reshape([b, h / per_kv, l, d])
    }

    /// The output (`q`'s dtype) and lse₂ (f32) of this rank's queries. Keys and values travel
    /// side by side along their last dim (`[b, g, 2L, d + dv]`), so values may be narrower than
    /// queries and keys (latent attention's).
    ///
    /// # Shapes
    /// q and k `[b, h|g, 2L, d]`, v `[b, g, 2L, dv]` → `[b, h, 2L, dv]`, `[b, h, 2L]`
    pub fn forward(&self, q: Tensor<4>, k: Tensor<4>, v: Tensor<4>) -> Result<(Tensor<4>, Tensor<3>), CommError> {
        let [_, h, s2, _] = q.dims();
        let (l, per_kv) = (s2 / 2, h / k.dims()[1]);
        let (rank, cp) = (self.cp.group_rank(), self.cp.size());
        let (dk, dv) = (k.dims()[3], v.dims()[3]);
        let x = |t: Tensor<4>| repeat_heads(t, per_kv);
        let kv = Tensor::cat(vec![k.clone(), v.clone()], 3); // [b, g, 2L, d + dv]
        let (next, prev) = ((rank + 1) % cp, (rank + cp - 1) % cp);
        // The other ranks' K/V on their way before this rank's own block is computed: the ring's
        // first transfer, or the whole gather.
        let mut incoming = match (self.exchange, cp > 1) {
            (Exchange::Ring, true) => {
                self.cp.send(kv.clone(), next)?;
                Some(self.cp.recv(kv.clone(), prev)?)
            }
            _ => None,
        };
        let gathered = match self.exchange {
            Exchange::AllGather => Some(self.cp.all_gather(kv, 2)?), // [b, g, cp·2L, d + dv], rank by rank
            Exchange::Ring => None,
        };
        let (out, lse) = attention_parts(q.clone(), x(k), x(v), true, self.scale);
        let out = out.cast(DType::F32);
        let mut running: Vec<Option<Running>> = (0..2)
            .map(|c| {
                Some(Running {
                    out: chunk(&out, c, l),
                    lse: chunk(&lse, c, l),
                })
            })
            .collect();
        let mut visit = |src: usize, kv: &Tensor<4>| {
            let (k, v) = (kv.clone().narrow(3, 0, dk), kv.clone().narrow(3, dk, dv));
            for (qc, kc) in blocks(rank, src) {
                let (o, s) = attention_parts(
                    chunk(&q, qc, l),
                    x(chunk(&k, kc, l)),
                    x(chunk(&v, kc, l)),
                    false,
                    self.scale,
                );
                running[qc] = running[qc].take().map(|r| r.merge(o, s));
            }
        };
        match gathered {
            Some(all) => {
                for src in (0..cp).filter(|s| *s != rank) {
                    visit(src, &all.clone().narrow(2, src * s2, s2));
                }
            }
            None => {
                for step in 1..cp {
                    let held = incoming.take().expect("a block received for every step");
                    // The next block's transfer posted before this one's attention.
                    if step + 1 < cp {
                        self.cp.send(held.clone(), next)?;
                        incoming = Some(self.cp.recv(held.clone(), prev)?);
                    }
                    visit((rank + cp - step) % cp, &held);
                }
            }
        }
        let [a, c] = [running[0].take(), running[1].take()].map(|r| r.expect("every chunk merged"));
        let out = Tensor::cat(vec![a.out, c.out], 2).cast(q.dtype());
        Ok((out, Tensor::cat(vec![a.lse, c.lse], 2)))
    }

    /// The gradients of q, k and v (in their dtypes) from the forward's output and lse₂ and
    /// the output's gradient.
    ///
    /// # Shapes
    /// as [`forward`](Self::forward); `out`, `grad` `[b, h, 2L, d]`, `lse` `[b, h, 2L]`
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        out: Tensor<4>,
        lse: Tensor<3>,
        grad: Tensor<4>,
    ) -> Result<(Tensor<4>, Tensor<4>, Tensor<4>), CommError> {
        let [b, h, s2, _] = q.dims();
        let (l, per_kv) = (s2 / 2, h / k.dims()[1]);
        let (rank, cp) = (self.cp.group_rank(), self.cp.size());
        let (kv_dtype, q_dtype) = (k.dtype(), q.dtype());
        let widths = [k.dims()[3], v.dims()[3]];
        let x = |t: Tensor<4>| repeat_heads(t, per_kv);
        let (dq, dk, dv) = attention_grads(
            q.clone(),
            x(k.clone()),
            x(v.clone()),
            out.clone(),
            lse.clone(),
            grad.clone(),
            true,
            self.scale,
        );
        let dq = dq.cast(DType::F32);
        let mut dq: Vec<Tensor<4>> = (0..2).map(|c| chunk(&dq, c, l)).collect();
        let own = Tensor::cat(vec![Self::fold(dk, per_kv), Self::fold(dv, per_kv)], 3); // [b, g, 2L, d + dv]
        // This rank's blocks over `src`'s keys: its query gradients added to `dq`, and the
        // keys' and values' gradients returned (`[b, g, 2L, d + dv]`, f32).
        let mut visit = |src: usize, kv: &Tensor<4>| -> Tensor<4> {
            let (k, v) = (
                kv.clone().narrow(3, 0, widths[0]),
                kv.clone().narrow(3, widths[0], widths[1]),
            );
            let mut dkv = [0, 1].map(|_| [None, None]); // [k or v][chunk]
            for (qc, kc) in blocks(rank, src) {
                let (dqc, dkc, dvc) = attention_grads(
                    chunk(&q, qc, l),
                    x(chunk(&k, kc, l)),
                    x(chunk(&v, kc, l)),
                    chunk(&out, qc, l),
                    chunk(&lse, qc, l),
                    chunk(&grad, qc, l),
                    false,
                    self.scale,
                );
                dq[qc] = dq[qc].clone() + dqc.cast(DType::F32);
                for (which, g) in [(0, dkc), (1, dvc)] {
                    let g = Self::fold(g, per_kv);
                    dkv[which][kc] = Some(match dkv[which][kc].take() {
                        Some(sum) => sum + g,
                        None => g,
                    });
                }
            }
            let g = k.dims()[1];
            let zeros = |d: usize| Tensor::<4>::zeros([b, g, l, d], (&k.device(), DType::F32));
            let halves = |[early, late]: [Option<Tensor<4>>; 2], d: usize| {
                Tensor::cat(
                    vec![early.unwrap_or_else(|| zeros(d)), late.unwrap_or_else(|| zeros(d))],
                    2,
                )
            };
            let [dk, dv] = dkv;
            Tensor::cat(vec![halves(dk, widths[0]), halves(dv, widths[1])], 3)
        };
        let kv = Tensor::cat(vec![k, v], 3);
        let dkv = match self.exchange {
            Exchange::Ring => {
                let (next, prev) = ((rank + 1) % cp, (rank + cp - 1) % cp);
                let (mut held, mut accumulated) = (kv, own);
                for step in 1..cp {
                    self.cp.send(held.clone(), next)?;
                    held = self.cp.recv(held, prev)?;
                    self.cp.send(accumulated.clone(), next)?;
                    accumulated = self.cp.recv(accumulated, prev)?;
                    accumulated = accumulated + visit((rank + cp - step) % cp, &held);
                }
                // The accumulator of the keys held last belongs to the next rank: send it home.
                if cp > 1 {
                    self.cp.send(accumulated.clone(), next)?;
                    accumulated = self.cp.recv(accumulated, prev)?;
                }
                accumulated
            }
            Exchange::AllGather => {
                let all = self.cp.all_gather(kv, 2)?;
                let parts: Vec<Tensor<4>> = (0..cp)
                    .map(|src| match src == rank {
                        true => own.clone(),
                        false => visit(src, &all.clone().narrow(2, src * s2, s2)),
                    })
                    .collect();
                self.cp.reduce_scatter(Tensor::cat(parts, 2), 2, ReduceOp::Sum)?
            }
        };
        let dq = Tensor::cat(dq, 2).cast(q_dtype);
        let (dk, dv) = (dkv.clone().narrow(3, 0, widths[0]), dkv.narrow(3, widths[0], widths[1]));
        Ok((dq, dk.cast(kv_dtype), dv.cast(kv_dtype)))
    }
}
