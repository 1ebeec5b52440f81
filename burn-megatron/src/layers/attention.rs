//! Causal self-attention with heads split over the tensor-parallel group, grouped-query
//! attention and rotary positions; optionally biases on q, k and v (Qwen2) and each head's q
//! and k RMS-normalized before the rotation (Qwen3, `QkNorm`).
//!
//! Legend: `b` batch, `s` sequence, `d` d_model, `h` heads on this rank (`n_heads/tp`),
//! `g` kv heads on this rank (`n_kv_heads/tp`), `k` head_dim.

use std::sync::Arc;

use burn::config::Config;
use burn::module::Module;
use burn::tensor::{Device, Tensor};
use burn_megatron_dist::mappings::{copy_to_tp, gather_from_sp};
use burn_megatron_dist::{ProcessGroup, ProcessGroups};
use burn_megatron_kernels::Gemm;
use burn_megatron_kernels::quant::notes::{AmaxNotes, NoteAmaxes};
use burn_megatron_kernels::quant::recipe::Pass;

use burn_megatron_kernels::rope::RotatedHeads;

use super::column::{ColumnInput, ColumnOutput, ColumnParallelLinear, ColumnParallelLinearConfig, SharedInput};
use super::context::{context_attention, context_document_attention};
use super::documents::Documents;
use super::rope::{Rope, RopeScaling};
use super::row::{RowInput, RowOutput, RowParallelLinear, RowParallelLinearConfig};
use super::sequence::SequenceLayout;
use crate::error::{ConfigError, LayerError, divisible};
use crate::init::ParamInit;
use crate::layers::context::ContextParallel;
use crate::layers::heads::repeat_heads;
use crate::layers::norm::{RmsNorm, RmsNormConfig};
use crate::layers::residual::{Residual, readers};
use crate::recompute::recompute;

/// Configuration of a [`ParallelAttention`].
#[derive(Config, Debug)]
pub struct ParallelAttentionConfig {
    pub d_model: usize,
    pub n_heads: usize,
    /// Key/value heads (grouped-query attention); `n_heads` for plain multi-head attention.
    pub n_kv_heads: usize,
    /// Each head's width; `None`: `d_model / n_heads`. Set where the heads together are not
    /// `d_model` wide (a model pruned along its embedding channels, Gemma, Mistral-Nemo).
    #[config(default = "None")]
    pub head_dim: Option<usize>,
    /// Longest sequence the rotary tables cover.
    pub max_seq_len: usize,
    /// RoPE's base θ.
    #[config(default = 10000.0)]
    pub rope_theta: f64,
    /// RoPE's frequency scaling (Hugging Face's `rope_type`); none by default.
    #[config(default = "RopeScaling::None")]
    pub rope_scaling: RopeScaling,
    /// Biases on the q, k and v projections (Qwen2's); none by default.
    #[config(default = false)]
    pub qkv_bias: bool,
    /// Each head's q and k RMS-normalized over the head before the rotation, with this ε
    /// (Qwen3's `q_norm` and `k_norm`); none by default.
    #[config(default = "None")]
    pub qk_norm: Option<f64>,
    /// Sliding-window attention's window (Mistral's `sliding_window`): sequences no longer than
    /// it attend exactly as causal attention does, and the plan refuses longer ones.
    #[config(default = "None")]
    pub sliding_window: Option<usize>,
    /// The input's and output's layout along the sequence (sequence parallelism: shards).
    #[config(default = "SequenceLayout::Whole")]
    pub sequence: SequenceLayout,
    /// The product of the q, k, v and output projections (set by a precision policy).
    #[config(default = "Gemm::Wgmma")]
    pub gemm: Gemm,
    /// How attention sees the whole sequence under context parallelism (set by the plan; no
    /// effect at cp = 1).
    #[config(default = "ContextParallel::Ring")]
    pub context: ContextParallel,
    #[config(default = 0.02)]
    pub init_std: f64,
}

impl ParallelAttentionConfig {
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.d_model / self.n_heads.max(1))
    }

    /// Checks the head layout against a tensor-parallel group of `tp` ranks.
    pub fn validate(&self, tp: usize) -> Result<(), ConfigError> {
        if self.head_dim.is_none() && !self.d_model.is_multiple_of(self.n_heads) {
            return Err(ConfigError::ModelNotDivisibleByHeads {
                d_model: self.d_model,
                n_heads: self.n_heads,
            });
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err(ConfigError::HeadsNotMultipleOfKvHeads {
                n_heads: self.n_heads,
                n_kv_heads: self.n_kv_heads,
            });
        }
        if !self.head_dim().is_multiple_of(2) {
            return Err(ConfigError::OddHeadDim {
                head_dim: self.head_dim(),
            });
        }
        divisible("n_heads", self.n_heads, tp)?;
        divisible("n_kv_heads", self.n_kv_heads, tp)?;
        Ok(())
    }

    /// Checks the heads against a context-parallel group of `cp` ranks after `tp`: all-to-all
    /// scatters each tp rank's query and kv heads over cp (ring and all-gather take any).
    pub fn validate_context(&self, cp: usize, tp: usize) -> Result<(), ConfigError> {
        if cp > 1 && self.context == ContextParallel::AllToAll {
            for (what, heads) in [("n_heads", self.n_heads), ("n_kv_heads", self.n_kv_heads)] {
                let local = heads / tp.max(1);
                if !local.is_multiple_of(cp) {
                    return Err(ConfigError::ContextHeads { what, heads: local, cp });
                }
            }
        }
        Ok(())
    }

    /// This rank's heads over `groups.tp`, its sequence chunks over `groups.cp`; `name` is the
    /// layer's path, which seeds it.
    pub fn init(
        &self,
        device: &Device,
        groups: &ProcessGroups,
        init: &ParamInit,
        name: &str,
    ) -> Result<ParallelAttention, LayerError> {
        let tp = &groups.tp;
        self.validate(tp.size())?;
        self.validate_context(groups.cp.size(), tp.size())?;
        let k = self.head_dim();
        let column = |d_output| {
            ColumnParallelLinearConfig::new(self.d_model, d_output)
                .with_bias(self.qkv_bias)
                .with_input(ColumnInput::InRegion)
                .with_output(ColumnOutput::Sharded)
                .with_gemm(self.gemm)
                .with_init_std(self.init_std)
        };
        let output = match self.sequence {
            SequenceLayout::Sharded => RowOutput::SequenceScattered,
            SequenceLayout::Whole => RowOutput::Reduced,
        };
        let wo = RowParallelLinearConfig::new(self.n_heads * k, self.d_model)
            .with_input(RowInput::Sharded)
            .with_output(output)
            .with_gemm(self.gemm)
            .with_init_std(self.init_std);
        Ok(ParallelAttention {
            wq: column(self.n_heads * k).init(device, groups, init, &format!("{name}.wq"))?,
            wk: column(self.n_kv_heads * k).init(device, groups, init, &format!("{name}.wk"))?,
            wv: column(self.n_kv_heads * k).init(device, groups, init, &format!("{name}.wv"))?,
            wo: wo.init(device, groups, init, &format!("{name}.wo"))?,
            q_norm: self.qk_norm.map(|epsilon| head_norm(k, epsilon, device, groups, init)),
            k_norm: self.qk_norm.map(|epsilon| head_norm(k, epsilon, device, groups, init)),
            n_heads: self.n_heads / tp.size(),
            n_kv_heads: self.n_kv_heads / tp.size(),
            head_dim: k,
            sliding_window: self.sliding_window,
            sequence: self.sequence,
            rope: Rope::new(k, self.max_seq_len, self.rope_theta, self.rope_scaling, device),
            context: self.context,
            cp: groups.cp.clone(),
            tp: tp.clone(),
        })
    }
}

/// The RMSNorm of every head of q (or k), one `[k]` weight for all heads. Each tp rank
/// normalizes its own heads, so the weight's gradient on a rank is a partial sum: read as a
/// sequence-sharded norm's weight, it is summed over tp in the backward pass.
fn head_norm(head_dim: usize, epsilon: f64, device: &Device, groups: &ProcessGroups, init: &ParamInit) -> RmsNorm {
    RmsNormConfig::new(head_dim)
        .with_epsilon(epsilon)
        .with_sequence(SequenceLayout::Sharded)
        .init(device, groups, init)
}

/// Causal self-attention over this rank's heads.
#[derive(Module, Debug)]
pub struct ParallelAttention {
    pub wq: ColumnParallelLinear,
    pub wk: ColumnParallelLinear,
    pub wv: ColumnParallelLinear,
    pub wo: RowParallelLinear,
    /// Each query head's RMSNorm before the rotation (Qwen3); `None` without.
    pub q_norm: Option<RmsNorm>,
    /// Each key head's RMSNorm before the rotation (Qwen3); `None` without.
    pub k_norm: Option<RmsNorm>,
    /// Heads on this rank.
    pub n_heads: usize,
    /// Key/value heads on this rank.
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Sliding-window attention's window, which no sequence it attends over may pass.
    #[module(skip)]
    pub sliding_window: Option<usize>,
    #[module(skip)]
    pub sequence: SequenceLayout,
    #[module(skip)]
    pub rope: Rope,
    /// How the queries see the whole sequence when it is split over `cp`.
    #[module(skip)]
    pub context: ContextParallel,
    #[module(skip)]
    pub cp: ProcessGroup,
    #[module(skip)]
    pub tp: ProcessGroup,
}

impl ParallelAttention {
    /// # Shapes
    /// `[b, s, d]` → `[b, s, d]`; `[b, s/tp, d]` → `[b, s/tp, d]` with sequence parallelism.
    pub fn forward(&self, x: Tensor<3>) -> Result<Tensor<3>, LayerError> {
        self.wo.forward(self.core(x, None, None)?)
    }

    /// `stream + self.forward(x)`, `x` the output of the norm that read `stream`
    /// ([`RmsNorm::pre_norm`](super::RmsNorm::pre_norm)): q, k and v's gradients and the
    /// stream's added by that norm's backward; on one rank with a plain output projection, the
    /// stream added in its kernel ([`RowParallelLinear::forward_onto`]).
    ///
    /// With `documents`, rows packing several documents attend inside each one, RoPE at each
    /// token's position in its document.
    ///
    /// # Shapes
    /// [`forward`](Self::forward)'s, `stream` of the output's
    pub fn forward_onto(
        &self,
        x: Tensor<3>,
        stream: Residual,
        documents: Option<&Documents>,
    ) -> Result<Tensor<3>, LayerError> {
        let core = self.core(x, Some(&stream), documents)?;
        self.wo.forward_onto(core, stream)
    }

    /// The core attention's heads side by side, before the output projection: q and k rotated
    /// in their products' epilogue where the products are plain and the attention op would
    /// rotate them ([`ColumnParallelLinear::forward_rotated`]).
    ///
    /// # Shapes
    /// `[b, s, d]` (or its sequence shard) → `[b, s, h·k]`
    fn core(
        &self,
        x: Tensor<3>,
        stream: Option<&Residual>,
        documents: Option<&Documents>,
    ) -> Result<Tensor<3>, LayerError> {
        if let Some(documents) = documents {
            let (q, k, v) = self.project_documents(x, stream, documents)?;
            return attend_documents(self.heads(), q, k, v, documents);
        }
        let products = [&self.wq, &self.wk].map(|w| w.plain_product().is_some());
        // The heads' norms come between the product and the rotation.
        let norms = self.q_norm.is_some() || self.k_norm.is_some();
        if norms || !(self.rotates_in_attention() && products == [true, true]) {
            let (q, k, v) = self.project(x, stream)?;
            return attend(&self.wo, self.heads(), q, k, v);
        }
        let [xq, xk, xv] = self.inputs(x, stream)?;
        let rotated = |w: &ColumnParallelLinear, x| w.forward_rotated(x, &self.rope).expect("a plain product");
        let (q, k) = (rotated(&self.wq, xq), rotated(&self.wk, xk));
        let v = self.heads_of(self.wv.forward(xv)?, self.n_kv_heads);
        attend_rotated(&self.wo, self.heads(), q, k, v, &self.rope)
    }

    /// This rank's tokens' positions: `0..s`, or its chunks' under context parallelism. On one
    /// cp rank the backward notes the input gradient's amax where `w`'s FP8 tensorwise gradient
    /// products scale by it.
    fn rope(&self, x: Tensor<4>, w: &ColumnParallelLinear) -> Tensor<4> {
        match self.cp.size() {
            1 => {
                let worth = w.precision.gemm.scales_by_tensor_amax(Pass::Dgrad);
                let notes = NoteAmaxes {
                    output: None,
                    input_grads: worth.then(|| w.precision.notes.clone()),
                };
                self.rope.apply_noting(x, notes)
            }
            _ => self.rope.apply_chunks(x, &self.cp),
        }
    }

    /// Whether its input's amax is worth noting where it is written (q, k and v's products
    /// scale it by its tensor's amax: FP8 tensorwise), and the input reaches them as it is
    /// (whole sequences: a sequence-parallel input is gathered first).
    pub fn notes_input(&self) -> Option<AmaxNotes> {
        let worth =
            self.sequence == SequenceLayout::Whole && self.wq.precision.gemm.scales_by_tensor_amax(Pass::Forward);
        worth.then(|| self.wq.precision.notes.clone())
    }

    /// Whether its output's gradient is worth noting where it is written: the output
    /// projection's gradient products scale it by its tensor's amax, and it reaches them as it
    /// is (whole sequences: a sequence-parallel output's gradient is gathered first).
    pub fn notes_output_grad(&self) -> Option<AmaxNotes> {
        let worth = self.sequence == SequenceLayout::Whole && self.wo.precision.gemm.scales_by_tensor_amax(Pass::Dgrad);
        worth.then(|| self.wo.precision.notes.clone())
    }

    /// [`forward`](Self::forward), the core attention and the output projection run again in
    /// backward (selective recomputation, `crate::recompute`): q, k and v are kept, the
    /// attention's own state and its output are not.
    pub fn forward_recomputed(&self, x: Tensor<3>) -> Result<Tensor<3>, LayerError> {
        self.recomputed(x, None, None)
    }

    /// [`forward_recomputed`](Self::forward_recomputed) added onto `stream`, as
    /// [`forward_onto`](Self::forward_onto) adds it, inside `documents` where given.
    pub fn forward_recomputed_onto(
        &self,
        x: Tensor<3>,
        stream: Residual,
        documents: Option<&Documents>,
    ) -> Result<Tensor<3>, LayerError> {
        Ok(stream.clone().add_branch(self.recomputed(x, Some(&stream), documents)?))
    }

    fn recomputed(
        &self,
        x: Tensor<3>,
        stream: Option<&Residual>,
        documents: Option<&Documents>,
    ) -> Result<Tensor<3>, LayerError> {
        let heads = self.heads();
        let (q, k, v) = match documents {
            Some(documents) => self.project_documents(x, stream, documents)?,
            None => self.project(x, stream)?,
        };
        let documents = documents.cloned();
        recompute(&self.wo, vec![q, k, v], move |wo, mut qkv| {
            let (v, k, q) = (
                qkv.pop().expect("q, k, v"),
                qkv.pop().expect("q, k, v"),
                qkv.pop().expect("q, k, v"),
            );
            let out = match &documents {
                Some(documents) => attend_documents(heads.clone(), q, k, v, documents)?,
                None => attend(wo, heads.clone(), q, k, v)?,
            };
            wo.forward(out)
        })
    }

    /// [`project`](Self::project) for rows packing `documents`: q and k rotated at each token's
    /// position in its document (this rank's chunks' under context parallelism).
    fn project_documents(
        &self,
        x: Tensor<3>,
        stream: Option<&Residual>,
        documents: &Documents,
    ) -> Result<(Tensor<4>, Tensor<4>, Tensor<4>), LayerError> {
        let [xq, xk, xv] = self.inputs(x, stream)?;
        let shared = Some(Arc::new(SharedInput::default()));
        let project = |w: &ColumnParallelLinear, x| w.forward_sharing(x, shared.as_ref());
        let q = self.norm_queries(self.heads_of(project(&self.wq, xq)?, self.n_heads))?;
        let k = self.norm_keys(self.heads_of(project(&self.wk, xk)?, self.n_kv_heads))?;
        let v = self.heads_of(project(&self.wv, xv)?, self.n_kv_heads);
        let at = |t| self.rope.apply_at(t, documents.positions.clone());
        Ok((at(q), at(k), v))
    }

    /// q `[b, h, s, k]`, k and v `[b, g, s, k]`, with RoPE on q and k unless the attention op
    /// rotates them ([`rotates_in_attention`](Self::rotates_in_attention)).
    fn project(
        &self,
        x: Tensor<3>,
        stream: Option<&Residual>,
    ) -> Result<(Tensor<4>, Tensor<4>, Tensor<4>), LayerError> {
        let [xq, xk, xv] = self.inputs(x, stream)?;
        // Quantized once where their products quantize it alike.
        let shared = Some(Arc::new(SharedInput::default()));
        let project = |w: &ColumnParallelLinear, x| w.forward_sharing(x, shared.as_ref());
        let (q, k) = (
            self.norm_queries(self.heads_of(project(&self.wq, xq)?, self.n_heads))?,
            self.norm_keys(self.heads_of(project(&self.wk, xk)?, self.n_kv_heads))?,
        );
        let v = self.heads_of(project(&self.wv, xv)?, self.n_kv_heads);
        match self.rotates_in_attention() {
            true => Ok((q, k, v)),
            false => Ok((self.rope(q, &self.wq), self.rope(k, &self.wk), v)),
        }
    }

    /// Each query head RMS-normalized where the layer has q's norm, before the rotation.
    ///
    /// # Shapes
    /// `[.., k]` → the same (heads as `[b, h, s, k]` or decoding's `[b, h, k]`)
    pub fn norm_queries<const D: usize>(&self, q: Tensor<D>) -> Result<Tensor<D>, LayerError> {
        match &self.q_norm {
            Some(norm) => norm.forward(q),
            None => Ok(q),
        }
    }

    /// Each key head RMS-normalized where the layer has k's norm, before the rotation.
    ///
    /// # Shapes
    /// as [`norm_queries`](Self::norm_queries)
    pub fn norm_keys<const D: usize>(&self, k: Tensor<D>) -> Result<Tensor<D>, LayerError> {
        match &self.k_norm {
            Some(norm) => norm.forward(k),
            None => Ok(k),
        }
    }

    /// The input of q's, k's and v's products, mapped once over tp (gathered from its sequence
    /// shards, or copied into the region) and fanned out: its three readers' gradients summed by
    /// `stream`'s norm where it wrote it.
    ///
    /// # Shapes
    /// `[b, s, d]` or `[b, s/tp, d]` → `[b, s, d]` × 3
    fn inputs(&self, x: Tensor<3>, stream: Option<&Residual>) -> Result<[Tensor<3>; 3], LayerError> {
        let x = match self.sequence {
            SequenceLayout::Sharded => gather_from_sp(x, &self.tp, 1)?,
            SequenceLayout::Whole => copy_to_tp(x, &self.tp)?,
        };
        Ok(readers(x, stream))
    }

    /// A product's output as `n` heads.
    ///
    /// # Shapes
    /// `[b, s, n·k]` → `[b, n, s, k]`
    fn heads_of(&self, y: Tensor<3>, n: usize) -> Tensor<4> {
        let [b, s, _] = y.dims();
        y.reshape([b, s, n, self.head_dim]).swap_dims(1, 2)
    }

    /// Whether the attention op rotates q and k itself (`rotary_attention`, whose backward
    /// writes their gradients through RoPE's inverse as they leave the flash kernels): whole
    /// sequences on this rank (context parallelism rotates each chunk at its own positions) and
    /// no FP8 tensorwise product of q or k noting its input gradient's amax as RoPE's backward
    /// writes it.
    fn rotates_in_attention(&self) -> bool {
        self.cp.size() == 1
            && ![&self.wq, &self.wk]
                .iter()
                .any(|w| w.precision.gemm.scales_by_tensor_amax(Pass::Dgrad))
    }

    fn heads(&self) -> Heads {
        Heads {
            n_heads: self.n_heads,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
            context: (self.cp.size() > 1).then(|| (self.context, self.cp.clone())),
            rope: self.rotates_in_attention().then(|| self.rope.clone()),
        }
    }
}

/// This rank's head counts, and the context-parallel group its sequence is split over.
#[derive(Clone, Debug)]
struct Heads {
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    context: Option<(ContextParallel, ProcessGroup)>,
    /// RoPE's tables where the attention op rotates q and k itself.
    rope: Option<Rope>,
}

/// The core attention (RoPE on q and k first where `heads.rope` says), its heads side by side
/// for the output projection `wo` (whose product decides whether the attention notes its
/// output's amax).
///
/// # Shapes
/// q `[b, h, s, k]`, k and v `[b, g, s, k]` → `[b, s, h·k]`
fn attend(
    wo: &RowParallelLinear,
    heads: Heads,
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
) -> Result<Tensor<3>, LayerError> {
    let out = match &heads.context {
        // Each rank's chunks over the whole sequence; kv heads travel unrepeated.
        Some((context, cp)) => context_attention(q, k, v, *context, cp)?,
        None => {
            let (k, v) = (repeat_kv(k, &heads), repeat_kv(v, &heads)); // [b, h, s, k]
            // Flash attention on CUDA (bf16, head dim ≤ 128); the f32 reference elsewhere. It
            // takes its output's amax where the output projection's cast scales by it.
            let note = output_notes(wo);
            match &heads.rope {
                Some(rope) => {
                    let (cos, sin) = rope.tables();
                    burn_megatron_kernels::attention::rotary_attention(q, k, v, cos, sin, true, note)
                }
                None => burn_megatron_kernels::attention::attention_noting(q, k, v, true, note),
            } // [b, h, s, k]
        }
    };
    Ok(side_by_side(out, &heads))
}

/// [`attend`] inside each packed document: the f32 reference's masked attention
/// (`document_attention`) on every backend, over the whole sequence under context parallelism
/// (`context_document_attention`).
///
/// # Shapes
/// q `[b, h, s, k]`, k and v `[b, g, s, k]` → `[b, s, h·k]`
fn attend_documents(
    heads: Heads,
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    documents: &Documents,
) -> Result<Tensor<3>, LayerError> {
    let starts = documents.starts.clone();
    let out = match &heads.context {
        // The whole sequence on each rank (all-to-all); kv heads travel unrepeated.
        Some((context, cp)) => context_document_attention(q, k, v, starts, *context, cp)?,
        None => {
            let (k, v) = (repeat_kv(k, &heads), repeat_kv(v, &heads));
            burn_megatron_kernels::attention::document_attention(q, k, v, starts)
        }
    };
    Ok(side_by_side(out, &heads))
}

/// Where the attention notes its output's amax: where the output projection's FP8 tensorwise
/// cast scales by it.
fn output_notes(wo: &RowParallelLinear) -> Option<AmaxNotes> {
    wo.precision
        .gemm
        .scales_by_tensor_amax(Pass::Forward)
        .then(|| wo.precision.notes.clone())
}

/// [`attend`] for q and k rotated in their products, which the attention op reads as they are
/// (its backward hands back the unrotated heads' gradients, as for heads it rotates itself).
///
/// # Shapes
/// q `[b, h, s, k]`, k and v `[b, g, s, k]` → `[b, s, h·k]`
fn attend_rotated(
    wo: &RowParallelLinear,
    heads: Heads,
    q: RotatedHeads,
    k: RotatedHeads,
    v: Tensor<4>,
    rope: &Rope,
) -> Result<Tensor<3>, LayerError> {
    let k = k.map_layout(|k| repeat_kv(k, &heads));
    let v = repeat_kv(v, &heads);
    let note = output_notes(wo);
    let (cos, sin) = rope.tables();
    let out = burn_megatron_kernels::attention::rotary_attention_rotated(q, k, v, cos, sin, true, note);
    Ok(side_by_side(out, &heads))
}

/// The attention's output heads side by side for the output projection.
///
/// # Shapes
/// `[b, h, s, k]` → `[b, s, h·k]`
fn side_by_side(out: Tensor<4>, heads: &Heads) -> Tensor<3> {
    let [b, _, s, _] = out.dims();
    out.swap_dims(1, 2).reshape([b, s, heads.n_heads * heads.head_dim])
}

/// Each kv head serves `h/g` query heads, in Hugging Face's order.
///
/// # Shapes
/// `[b, g, s, k]` → `[b, h, s, k]`
fn repeat_kv(x: Tensor<4>, heads: &Heads) -> Tensor<4> {
    repeat_heads(x, heads.n_heads / heads.n_kv_heads)
}

#[cfg(test)]
mod tests {
    use burn::tensor::activation::softmax;
    use burn::tensor::{Bool, Device, Tensor};

    use super::*;
    use crate::init::{InitMode, ParamInit};

    /// At tp = 1 the layer is plain causal attention with GQA and half-split RoPE, written out
    /// here by hand: scores `q·kᵀ/√k`, positions after the query masked, softmax, `·v`, `wo`.
    /// The same output and the same gradients of the input and of every weight; and added onto a
    /// residual stream (`forward_onto`: the output projection adds it), the stream's gradient too.
    #[test]
    fn matches_causal_attention_written_out() {
        for onto in [false, true] {
            check_written_out(onto);
        }
    }

    fn check_written_out(onto: bool) {
        let dev = Device::flex().autodiff();
        let (b, s, d, heads, kv) = (2, 5, 16, 4, 2);
        let config = ParallelAttentionConfig::new(d, heads, kv, s);
        let layer = config
            .init(&dev, &ProcessGroups::single(), &ParamInit::new(1, InitMode::Full), "a")
            .unwrap();
        let x = crate::init::normal([b, s, d], 9, 1.0, &dev).require_grad();
        let stream = crate::init::normal([b, s, d], 11, 1.0, &dev).require_grad();
        let out = match onto {
            true => layer
                .forward_onto(x.clone(), Residual::unlinked(stream.clone()), None)
                .unwrap(),
            false => layer.forward(x.clone()).unwrap(),
        };

        let k_dim = d / heads;
        let project = |w: &ColumnParallelLinear, n: usize| {
            x.clone()
                .matmul(w.weight.val().unsqueeze())
                .reshape([b, s, n, k_dim])
                .swap_dims(1, 2)
        };
        let q = layer.rope.apply(project(&layer.wq, heads));
        let k = layer.rope.apply(project(&layer.wk, kv));
        let v = project(&layer.wv, kv);
        // Query head h reads kv head h / (heads / kv).
        let expand = |t: Tensor<4>| {
            Tensor::cat(
                (0..heads).map(|h| t.clone().narrow(1, h / (heads / kv), 1)).collect(),
                1,
            )
        };
        let (k, v) = (expand(k), expand(v));
        let scores = q.matmul(k.swap_dims(2, 3)).div_scalar((k_dim as f64).sqrt());
        let future = Tensor::<2, Bool>::tril_mask([s, s], 0, &dev)
            .unsqueeze::<4>()
            .expand([b, heads, s, s]);
        let weights = softmax(scores.mask_fill(future, f32::NEG_INFINITY), 3);
        let context = weights.matmul(v).swap_dims(1, 2).reshape([b, s, d]);
        let mut expected = context.matmul(layer.wo.weight.val().unsqueeze());
        if onto {
            expected = stream.clone() + expected;
        }
        // The same f32 arithmetic in another order (fused attention against matmuls): ~1e-6.
        let tolerance = 1e-5;
        assert_close(out.clone(), expected.clone(), tolerance, "output");
        let probe = crate::init::normal([b, s, d], 10, 1.0, &dev);
        let (ours, theirs) = (
            (out * probe.clone()).sum().backward(),
            (expected * probe).sum().backward(),
        );
        assert_close(x.grad(&ours).unwrap(), x.grad(&theirs).unwrap(), tolerance, "dx");
        for (name, w) in [
            ("wq", &layer.wq.weight),
            ("wk", &layer.wk.weight),
            ("wv", &layer.wv.weight),
        ] {
            let (a, e) = (w.val().grad(&ours).unwrap(), w.val().grad(&theirs).unwrap());
            assert_close(a, e, tolerance, name);
        }
        let wo = layer.wo.weight.val();
        assert_close(wo.grad(&ours).unwrap(), wo.grad(&theirs).unwrap(), tolerance, "wo");
        if onto {
            let (a, e) = (stream.grad(&ours).unwrap(), stream.grad(&theirs).unwrap());
            assert_close(a, e, tolerance, "d stream");
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
