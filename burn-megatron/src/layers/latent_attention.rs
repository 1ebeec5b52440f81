//! Multi-head latent attention (DeepSeek-V2/V3's MLA; Megatron Core's
//! `multi_latent_attention.py`): keys and values come from one low-rank latent of each token,
//! queries from another (or from a full projection), and each head's query and key carry a
//! rotated part of their own width beside the unrotated one, the key's rotated part shared by
//! every head.
//!
//! Under tensor parallelism the heads are split (the up projections column-parallel, the output
//! projection row-parallel) and the down projections and their norms are whole on every rank, as
//! Megatron lays them out: each rank computes the latents of its tokens (of its sequence shard
//! under sequence parallelism), which are then gathered or copied into the tensor-parallel
//! region, whose backward sums their gradients over tp.
//!
//! Legend: `b` batch, `s` sequence, `d` d_model, `h` heads on this rank, `n` the unrotated
//! (`qk_nope_dim`) and `r` the rotated (`qk_rope_dim`) part of a query or key head, `v` a value
//! head, `cq`/`ckv` the q and kv latents (`q_rank`, `kv_rank`).

use burn::config::Config;
use burn::module::Module;
use burn::tensor::{Device, Tensor};
use burn_megatron_dist::mappings::{copy_to_tp, gather_from_sp};
use burn_megatron_dist::{ProcessGroup, ProcessGroups};
use burn_megatron_kernels::Gemm;
use burn_megatron_kernels::attention::document_attention;

use super::column::{ColumnInput, ColumnOutput, ColumnParallelLinear, ColumnParallelLinearConfig};
use super::context::{ContextParallel, context_attention, context_document_attention};
use super::documents::Documents;
use super::norm::{RmsNorm, RmsNormConfig};
use super::replicated::{ReplicatedLinear, ReplicatedLinearConfig};
use super::rope::{Rope, RopeScaling, yarn_mscale};
use super::row::{RowInput, RowOutput, RowParallelLinear, RowParallelLinearConfig};
use super::sequence::SequenceLayout;
use crate::error::{ConfigError, LayerError, divisible};
use crate::init::ParamInit;
use crate::precision::linear::LinearPrecision;
use crate::recompute::recompute;

/// Configuration of a [`LatentAttention`].
#[derive(Config, Debug)]
pub struct LatentAttentionConfig {
    pub d_model: usize,
    pub n_heads: usize,
    /// The query latent's width (`q_lora_rank`); `None`: queries from a full projection.
    #[config(default = "None")]
    pub q_rank: Option<usize>,
    /// The key/value latent's width (`kv_lora_rank`).
    pub kv_rank: usize,
    /// A query or key head's unrotated part (`qk_nope_head_dim`).
    pub qk_nope_dim: usize,
    /// A query or key head's rotated part (`qk_rope_head_dim`).
    pub qk_rope_dim: usize,
    /// A value head (`v_head_dim`).
    pub v_dim: usize,
    /// Longest sequence the rotary tables cover.
    pub max_seq_len: usize,
    #[config(default = 10000.0)]
    pub rope_theta: f64,
    #[config(default = "RopeScaling::None")]
    pub rope_scaling: RopeScaling,
    /// ε of the latents' RMSNorms (DeepSeek-V3's `q_a_layernorm` and `kv_a_layernorm`).
    #[config(default = 1e-6)]
    pub latent_epsilon: f64,
    #[config(default = "SequenceLayout::Whole")]
    pub sequence: SequenceLayout,
    #[config(default = "Gemm::Wgmma")]
    pub gemm: Gemm,
    #[config(default = "ContextParallel::Ring")]
    pub context: ContextParallel,
    #[config(default = 0.02)]
    pub init_std: f64,
}

impl LatentAttentionConfig {
    /// A query or key head's width.
    pub fn qk_dim(&self) -> usize {
        self.qk_nope_dim + self.qk_rope_dim
    }

    /// Checks the layout against a tensor-parallel group of `tp` ranks.
    pub fn validate(&self, tp: usize) -> Result<(), ConfigError> {
        if !self.qk_rope_dim.is_multiple_of(2) {
            return Err(ConfigError::OddHeadDim {
                head_dim: self.qk_rope_dim,
            });
        }
        for (what, size) in [
            ("n_heads", self.n_heads),
            ("kv_rank", self.kv_rank),
            ("qk_rope_dim", self.qk_rope_dim),
            ("v_dim", self.v_dim),
        ] {
            if size == 0 {
                return Err(ConfigError::Zero { what });
            }
        }
        divisible("n_heads", self.n_heads, tp)?;
        Ok(())
    }

    /// This rank's heads over `groups.tp`; `name` is the layer's path, which seeds it.
    pub fn init(
        &self,
        device: &Device,
        groups: &ProcessGroups,
        init: &ParamInit,
        name: &str,
    ) -> Result<LatentAttention, LayerError> {
        let tp = &groups.tp;
        self.validate(tp.size())?;
        let h = self.n_heads;
        let down = |d_output, path: &str| {
            ReplicatedLinearConfig::new(self.d_model, d_output)
                .with_sequence(self.sequence)
                .with_gemm(self.gemm)
                .with_init_std(self.init_std)
                .init(device, groups, init, &format!("{name}.{path}"))
        };
        let up = |d_input, d_output, input, path: &str| {
            ColumnParallelLinearConfig::new(d_input, d_output)
                .with_input(input)
                .with_output(ColumnOutput::Sharded)
                .with_gemm(self.gemm)
                .with_init_std(self.init_std)
                .init(device, groups, init, &format!("{name}.{path}"))
        };
        let norm = |width| {
            RmsNormConfig::new(width)
                .with_epsilon(self.latent_epsilon)
                .with_sequence(self.sequence)
                .init(device, groups, init)
        };
        // Queries from a latent (down, norm, up) or from one full projection.
        let (wq, wq_a, q_norm, wq_b) = match self.q_rank {
            Some(rank) => (
                None,
                Some(down(rank, "wq_a")),
                Some(norm(rank)),
                Some(up(rank, h * self.qk_dim(), ColumnInput::InRegion, "wq_b")?),
            ),
            None => (
                Some(up(self.d_model, h * self.qk_dim(), self.sequence.into(), "wq")?),
                None,
                None,
                None,
            ),
        };
        let output = match self.sequence {
            SequenceLayout::Sharded => RowOutput::SequenceScattered,
            SequenceLayout::Whole => RowOutput::Reduced,
        };
        let wo = RowParallelLinearConfig::new(h * self.v_dim, self.d_model)
            .with_input(RowInput::Sharded)
            .with_output(output)
            .with_gemm(self.gemm)
            .with_init_std(self.init_std);
        // YaRN scales the rotated dims by its attention factor (in the tables) and, with
        // `mscale_all_dim`, every dim's scores by mscale² (DeepSeek's softmax scale).
        let score_scale = match self.rope_scaling {
            RopeScaling::Yarn {
                factor,
                mscale_all_dim: Some(all),
                ..
            } if all != 0.0 => yarn_mscale(factor, all).powi(2),
            _ => 1.0,
        };
        Ok(LatentAttention {
            wq,
            wq_a,
            q_norm,
            wq_b,
            wkv_a: down(self.kv_rank + self.qk_rope_dim, "wkv_a"),
            kv_norm: norm(self.kv_rank),
            wkv_b: up(
                self.kv_rank,
                h * (self.qk_nope_dim + self.v_dim),
                ColumnInput::InRegion,
                "wkv_b",
            )?,
            wo: wo.init(device, groups, init, &format!("{name}.wo"))?,
            n_heads: h / tp.size(),
            kv_rank: self.kv_rank,
            qk_nope_dim: self.qk_nope_dim,
            qk_rope_dim: self.qk_rope_dim,
            v_dim: self.v_dim,
            score_scale,
            sequence: self.sequence,
            rope: Rope::new(
                self.qk_rope_dim,
                self.max_seq_len,
                self.rope_theta,
                self.rope_scaling,
                device,
            ),
            context: self.context,
            cp: groups.cp.clone(),
            tp: tp.clone(),
        })
    }
}

/// Multi-head latent attention over this rank's heads.
#[derive(Module, Debug)]
pub struct LatentAttention {
    /// The full query projection, `d → h·(n + r)`, where queries have no latent.
    pub wq: Option<ColumnParallelLinear>,
    /// The query latent's down projection `d → cq`, its norm, and its up projection
    /// `cq → h·(n + r)`.
    pub wq_a: Option<ReplicatedLinear>,
    pub q_norm: Option<RmsNorm>,
    pub wq_b: Option<ColumnParallelLinear>,
    /// The key/value latent and the shared rotated key, `d → ckv + r`.
    pub wkv_a: ReplicatedLinear,
    pub kv_norm: RmsNorm,
    /// Each head's unrotated key and value from the latent, `ckv → h·(n + v)`.
    pub wkv_b: ColumnParallelLinear,
    pub wo: RowParallelLinear,
    pub n_heads: usize,
    pub kv_rank: usize,
    pub qk_nope_dim: usize,
    pub qk_rope_dim: usize,
    pub v_dim: usize,
    /// What every score is multiplied by beside `1/√(n + r)` (YaRN's mscale², else 1).
    #[module(skip)]
    pub score_scale: f64,
    #[module(skip)]
    pub sequence: SequenceLayout,
    #[module(skip)]
    pub rope: Rope,
    #[module(skip)]
    pub context: ContextParallel,
    #[module(skip)]
    pub cp: ProcessGroup,
    #[module(skip)]
    pub tp: ProcessGroup,
}

impl LatentAttention {
    /// # Shapes
    /// `[b, s, d]` → `[b, s, d]`; `[b, s/tp, d]` → `[b, s/tp, d]` with sequence parallelism.
    pub fn forward(&self, x: Tensor<3>) -> Result<Tensor<3>, LayerError> {
        self.forward_inside(x, None)
    }

    /// [`forward`](Self::forward) of rows packing `documents` where given: each query sees
    /// the keys of its own document, the rotated parts rotated at each token's position in its
    /// document.
    pub fn forward_inside(&self, x: Tensor<3>, documents: Option<&Documents>) -> Result<Tensor<3>, LayerError> {
        let (q, k, v) = self.project(x, documents)?;
        self.wo.forward(self.attend(q, k, v, documents)?)
    }

    /// [`forward_inside`](Self::forward_inside), the core attention and the output projection
    /// run again in backward (selective recomputation): q, k and v are kept, the attention's own
    /// state and its output are not.
    pub fn forward_recomputed(&self, x: Tensor<3>, documents: Option<&Documents>) -> Result<Tensor<3>, LayerError> {
        let (q, k, v) = self.project(x, documents)?;
        let documents = documents.cloned();
        recompute(self, vec![q, k, v], move |layer, mut qkv| {
            let (v, k) = (qkv.pop().expect("q, k, v"), qkv.pop().expect("q, k, v"));
            let q = qkv.pop().expect("q, k, v");
            layer.wo.forward(layer.attend(q, k, v, documents.as_ref())?)
        })
    }

    /// The latents of `x`'s tokens, mapped into the tensor-parallel region: the key/value latent
    /// (normed) `[b, s, ckv]` and the shared rotated key's input `[b, s, r]`, both whole along the
    /// sequence.
    ///
    /// # Shapes
    /// `[b, s, d]` or `[b, s/tp, d]` → `[b, s, ckv]`, `[b, s, r]`
    pub fn latents(&self, x: Tensor<3>) -> Result<(Tensor<3>, Tensor<3>), LayerError> {
        let kv_a = self.wkv_a.forward(x)?;
        let c_kv = self.kv_norm.forward(kv_a.clone().narrow(2, 0, self.kv_rank))?;
        let k_rope = kv_a.narrow(2, self.kv_rank, self.qk_rope_dim);
        Ok((self.to_region(c_kv)?, self.to_region(k_rope)?))
    }

    /// This rank's query heads `[b, h, s, n + r]`, unrotated.
    ///
    /// # Shapes
    /// `[b, s, d]` or `[b, s/tp, d]` → `[b, h, s, n + r]`
    pub fn queries(&self, x: Tensor<3>) -> Result<Tensor<4>, LayerError> {
        let q = match (&self.wq, &self.wq_a, &self.q_norm, &self.wq_b) {
            (Some(wq), ..) => wq.forward(x)?,
            (None, Some(down), Some(norm), Some(up)) => {
                let latent = norm.forward(down.forward(x)?)?;
                up.forward(self.to_region(latent)?)?
            }
            _ => unreachable!("queries come from a full projection or a latent"),
        };
        Ok(self.heads_of(q, self.qk_nope_dim + self.qk_rope_dim))
    }

    /// Each head's unrotated key and value from the key/value latent.
    ///
    /// # Shapes
    /// `[b, t, ckv]` → `[b, h, t, n]`, `[b, h, t, v]`
    pub fn keys_values(&self, c_kv: Tensor<3>) -> Result<(Tensor<4>, Tensor<4>), LayerError> {
        let kv = self.heads_of(self.wkv_b.forward(c_kv)?, self.qk_nope_dim + self.v_dim);
        let k_nope = kv.clone().narrow(3, 0, self.qk_nope_dim);
        Ok((k_nope, kv.narrow(3, self.qk_nope_dim, self.v_dim)))
    }

    /// q, k (each `[b, h, s, n + r]`, the rotated parts rotated for this rank's positions, or
    /// their positions in their `documents`, and the queries scaled by
    /// [`score_scale`](LatentAttention::score_scale)) and v `[b, h, s, v]`.
    fn project(
        &self,
        x: Tensor<3>,
        documents: Option<&Documents>,
    ) -> Result<(Tensor<4>, Tensor<4>, Tensor<4>), LayerError> {
        let q = self.queries(x.clone())?;
        let (c_kv, k_rope) = self.latents(x)?;
        let (k_nope, v) = self.keys_values(c_kv)?;
        let [b, h, s, _] = k_nope.dims();
        let q_nope = q.clone().narrow(3, 0, self.qk_nope_dim);
        let q_rope = self.rotate(q.narrow(3, self.qk_nope_dim, self.qk_rope_dim), documents);
        let k_rope = self
            .rotate(k_rope.unsqueeze_dim::<4>(1), documents)
            .expand([b, h, s, self.qk_rope_dim]);
        let mut q = Tensor::cat(vec![q_nope, q_rope], 3);
        if self.score_scale != 1.0 {
            q = q.mul_scalar(self.score_scale);
        }
        Ok((q, Tensor::cat(vec![k_nope, k_rope], 3), v))
    }

    /// The core attention of this rank's heads, side by side for the output projection.
    ///
    /// # Shapes
    /// q and k `[b, h, s, n + r]`, v `[b, h, s, v]` → `[b, s, h·v]`
    fn attend(
        &self,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        documents: Option<&Documents>,
    ) -> Result<Tensor<3>, LayerError> {
        let out = match (self.cp.size(), documents) {
            (1, None) => burn_megatron_kernels::attention::attention(q, k, v, true),
            (1, Some(documents)) => document_attention(q, k, v, documents.starts.clone()),
            (_, None) => context_attention(q, k, v, self.context, &self.cp)?,
            (_, Some(documents)) => {
                context_document_attention(q, k, v, documents.starts.clone(), self.context, &self.cp)?
            }
        };
        let [b, h, s, _] = out.dims();
        Ok(out.swap_dims(1, 2).reshape([b, s, h * self.v_dim]))
    }

    /// `x` rotated for this rank's positions: `0..s`, its chunks' under context parallelism,
    /// or each token's in its document.
    ///
    /// # Shapes
    /// `[b, heads, s, r]` → the same
    fn rotate(&self, x: Tensor<4>, documents: Option<&Documents>) -> Tensor<4> {
        match (self.cp.size(), documents) {
            (_, Some(documents)) => self.rope.apply_at(x, documents.positions.clone()),
            (1, None) => self.rope.apply(x),
            (_, None) => self.rope.apply_chunks(x, &self.cp),
        }
    }

    /// How each of its linear layers multiplies: the query's (full, or down and up), the
    /// key/value latent's down and up projections, the output projection.
    pub fn linear_precisions(&mut self) -> Vec<&mut LinearPrecision> {
        let mut all = Vec::with_capacity(5);
        if let Some(wq) = &mut self.wq {
            all.push(&mut wq.precision);
        }
        if let Some(down) = &mut self.wq_a {
            all.push(&mut down.precision);
        }
        if let Some(up) = &mut self.wq_b {
            all.push(&mut up.precision);
        }
        all.extend([
            &mut self.wkv_a.precision,
            &mut self.wkv_b.precision,
            &mut self.wo.precision,
        ]);
        all
    }

    /// How its first linear layer multiplies (the key/value latent's down projection).
    pub fn first_precision(&self) -> &LinearPrecision {
        &self.wkv_a.precision
    }

    /// A latent of this rank's tokens into the tensor-parallel region: gathered along the
    /// sequence under sequence parallelism, else copied; the backward sums its gradient over tp
    /// (every rank's heads read it).
    fn to_region(&self, latent: Tensor<3>) -> Result<Tensor<3>, LayerError> {
        Ok(match self.sequence {
            SequenceLayout::Sharded => gather_from_sp(latent, &self.tp, 1)?,
            SequenceLayout::Whole => copy_to_tp(latent, &self.tp)?,
        })
    }

    /// A product's output as this rank's heads of `width`.
    ///
    /// # Shapes
    /// `[b, s, h·width]` → `[b, h, s, width]`
    fn heads_of(&self, y: Tensor<3>, width: usize) -> Tensor<4> {
        let [b, s, _] = y.dims();
        y.reshape([b, s, self.n_heads, width]).swap_dims(1, 2)
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::activation::softmax;
    use burn::tensor::{Bool, Device, Tensor};

    use super::*;
    use crate::init::{InitMode, ParamInit};

    /// At tp = 1 the layer is DeepSeek-V3's attention written out here by hand: q from its
    /// normed latent, k and v from theirs, the rotated parts (the key's one for all heads)
    /// concatenated after the unrotated ones, scores `q·kᵀ/√(n + r)`, causal softmax, `·v`, `wo`.
    /// The same output and the same gradients of the input and of every weight.
    #[test]
    fn matches_latent_attention_written_out() {
        let dev = Device::flex().autodiff();
        let (b, s, d, h) = (2, 5, 16, 4);
        let (cq, ckv, n, r, v) = (12, 8, 6, 4, 5);
        let config = LatentAttentionConfig::new(d, h, ckv, n, r, v, s).with_q_rank(Some(cq));
        let layer = config
            .init(&dev, &ProcessGroups::single(), &ParamInit::new(1, InitMode::Full), "a")
            .unwrap();
        let x = crate::init::normal([b, s, d], 9, 1.0, &dev).require_grad();
        let out = layer.forward(x.clone()).unwrap();

        let rms = |t: Tensor<3>, w: Tensor<1>| {
            let mean = t.clone().powi_scalar(2).mean_dim(2);
            t / (mean + 1e-6).sqrt() * w.unsqueeze::<3>()
        };
        let linear = |t: Tensor<3>, w: Tensor<2>| t.matmul(w.unsqueeze());
        let heads = |t: Tensor<3>, width: usize| t.reshape([b, s, h, width]).swap_dims(1, 2);
        let q_latent = rms(
            linear(x.clone(), layer.wq_a.as_ref().unwrap().weight.val()),
            layer.q_norm.as_ref().unwrap().weight.val(),
        );
        let q = heads(linear(q_latent, layer.wq_b.as_ref().unwrap().weight.val()), n + r);
        let kv_a = linear(x.clone(), layer.wkv_a.weight.val());
        let c_kv = rms(kv_a.clone().narrow(2, 0, ckv), layer.kv_norm.weight.val());
        let kv = heads(linear(c_kv, layer.wkv_b.weight.val()), n + v);
        let k_rope = layer.rope.apply(kv_a.narrow(2, ckv, r).unsqueeze_dim::<4>(1));
        let q = Tensor::cat(vec![q.clone().narrow(3, 0, n), layer.rope.apply(q.narrow(3, n, r))], 3);
        let k = Tensor::cat(vec![kv.clone().narrow(3, 0, n), k_rope.expand([b, h, s, r])], 3);
        let values = kv.narrow(3, n, v);
        let scores = q.matmul(k.swap_dims(2, 3)).div_scalar(((n + r) as f64).sqrt());
        let future = Tensor::<2, Bool>::tril_mask([s, s], 0, &dev)
            .unsqueeze::<4>()
            .expand([b, h, s, s]);
        let weights = softmax(scores.mask_fill(future, f32::NEG_INFINITY), 3);
        let context = weights.matmul(values).swap_dims(1, 2).reshape([b, s, h * v]);
        let expected = linear(context, layer.wo.weight.val());
        // The same f32 arithmetic in another order (fused attention against matmuls): ~1e-6.
        let tolerance = 1e-5;
        assert_close(out.clone(), expected.clone(), tolerance, "output");
        let probe = crate::init::normal([b, s, d], 10, 1.0, &dev);
        let (ours, theirs) = (
            (out * probe.clone()).sum().backward(),
            (expected * probe).sum().backward(),
        );
        assert_close(x.grad(&ours).unwrap(), x.grad(&theirs).unwrap(), tolerance, "dx");
        let weights = [
            ("wq_a", layer.wq_a.as_ref().unwrap().weight.val()),
            ("wq_b", layer.wq_b.as_ref().unwrap().weight.val()),
            ("wkv_a", layer.wkv_a.weight.val()),
            ("wkv_b", layer.wkv_b.weight.val()),
            ("wo", layer.wo.weight.val()),
        ];
        for (name, w) in weights {
            assert_close(w.grad(&ours).unwrap(), w.grad(&theirs).unwrap(), tolerance, name);
        }
        for (name, w) in [
            ("q_norm", layer.q_norm.as_ref().unwrap().weight.val()),
            ("kv_norm", layer.kv_norm.weight.val()),
        ] {
            assert_close(w.grad(&ours).unwrap(), w.grad(&theirs).unwrap(), tolerance, name);
        }
    }

    fn assert_close<const D: usize>(a: Tensor<D>, e: Tensor<D>, tolerance: f32, what: &str) {
        let (a, e) = (
            a.into_data().try_to_vec::<f32>().unwrap(),
            e.into_data().try_to_vec::<f32>().unwrap(),
        );
        let worst = a.iter().zip(&e).map(|(a, e)| (a - e).abs()).fold(0.0, f32::max);
        assert!(worst < tolerance, "{what}: max |difference| {worst}");
    }
}
