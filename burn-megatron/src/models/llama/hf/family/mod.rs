//! The Hugging Face model families the decoder loads and exports. Each family's file says what
//! transformers calls it (`model_type`, its architecture class), what its `config.json` adds to
//! the Llama's (read into [`Choices`], written back), and where its MoE blocks keep their router
//! and experts. Everything else — the embedding, the norms, attention's and the dense MLP's
//! projections — has the Llama's names in every family.

mod deepseek_v3;
mod llama;
mod mistral;
mod mixtral;
mod qwen2;
mod qwen3;
mod qwen3_moe;

use serde_json::{Map, Value};

use super::HfError;
use super::config::{HfConfig, Raw};

/// A model family of transformers that this decoder builds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    Mixtral,
    Qwen3Moe,
    DeepseekV3,
}

/// What a family's `config.json` chooses beyond the Llama's sizes and rope.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Choices {
    /// Biases on the q, k and v projections (Qwen2).
    pub qkv_bias: bool,
    /// Each head's q and k RMS-normalized before the rotation (Qwen3).
    pub qk_norm: bool,
    /// The sliding attention window, where one applies (Mistral; Qwen with
    /// `use_sliding_window`).
    pub sliding_window: Option<usize>,
    /// The mixture of experts of the blocks (Mixtral, Qwen3-MoE, DeepSeek-V3).
    pub moe: Option<HfMoe>,
    /// Multi-head latent attention instead of grouped-query attention (DeepSeek-V3).
    pub latent: Option<HfLatent>,
    /// Multi-token prediction modules the file holds after its blocks, module `k` as block
    /// `num_hidden_layers + k` (DeepSeek-V3's `num_nextn_predict_layers`).
    pub mtp_layers: usize,
}

/// A family's mixture of experts: routing to the `top_k` best of `experts` SwiGLU experts of
/// hidden size `expert_size`, softmax-scored (Mixtral, Qwen3-MoE) or DeepSeek-V3's way.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HfMoe {
    pub experts: usize,
    pub top_k: usize,
    pub expert_size: usize,
    /// The chosen experts' weights renormalized to sum to 1 (Mixtral always; Qwen3-MoE's and
    /// DeepSeek-V3's `norm_topk_prob`).
    pub normalize: bool,
    /// DeepSeek-V3's routing: sigmoid scores, a selection bias, the best `topk_group` of
    /// `n_group` groups, the weights scaled, shared experts, the first blocks dense.
    pub deepseek: Option<DeepseekRouting>,
}

/// DeepSeek-V3's routing beyond the top k.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeepseekRouting {
    pub groups: usize,
    pub top_groups: usize,
    /// `routed_scaling_factor`.
    pub scaling: f64,
    /// The shared experts' hidden size together (`n_shared_experts · moe_intermediate_size`).
    pub shared_size: usize,
    /// `first_k_dense_replace`.
    pub first_dense: usize,
}

/// A family's multi-head latent attention (DeepSeek-V3's sizes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HfLatent {
    pub q_rank: Option<usize>,
    pub kv_rank: usize,
    pub qk_nope_dim: usize,
    pub qk_rope_dim: usize,
    pub v_dim: usize,
    /// The rotated dims stored as interleaved pairs (`rope_interleave`): each rotated
    /// projection's output features are reordered into halves on load and back on export.
    pub interleaved: bool,
}

/// Output features of a projection the file stores in interleaved pairs and the model in
/// halves: within each run of `period` features, the `width` from `offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RopeColumns {
    pub period: usize,
    pub offset: usize,
    pub width: usize,
}

impl RopeColumns {
    /// Where our feature `c` lies in the file: pair `p`'s first element (our `p`) at `2p`, its
    /// second (our `width/2 + p`) at `2p + 1`.
    pub fn file_index(&self, c: usize) -> usize {
        let (run, within) = (c / self.period, c % self.period);
        let Some(p) = within.checked_sub(self.offset).filter(|p| *p < self.width) else {
            return c;
        };
        let half = self.width / 2;
        let file = if p < half { 2 * p } else { 2 * (p - half) + 1 };
        run * self.period + self.offset + file
    }
}

/// Where a MoE block keeps its router and experts in the file, under `model.layers.{i}.`.
pub(super) struct MoeNames {
    /// The router's `[experts, d]` weight.
    pub router: &'static str,
    /// Its selection bias, where it has one (DeepSeek-V3's `e_score_correction_bias`).
    pub bias: Option<&'static str>,
    /// The shared expert's gate, down and up projections, where there is one.
    pub shared: Option<[&'static str; 3]>,
    /// Expert `{j}`'s gate, down and up projections (`[f, d]`, `[d, f]`, `[f, d]`).
    pub gate: &'static str,
    pub down: &'static str,
    pub up: &'static str,
}

/// One family: its names and its own `config.json` fields.
pub(super) struct Spec {
    pub model_type: &'static str,
    pub architecture: &'static str,
    pub moe: Option<MoeNames>,
    /// A block's tensors beyond the Llama's (ours, theirs, transposed): latent attention's.
    pub block: &'static [(&'static str, &'static str, bool)],
    /// Which of our block's weights (by their field under `layers.{i}.`) the file stores with
    /// rotated features in interleaved pairs.
    pub rope_columns: fn(&HfConfig, &str) -> Option<RopeColumns>,
    /// The family's fields of `config.json`, each value it cannot build refused by name.
    pub read: fn(&Raw) -> Result<Choices, HfError>,
    /// Those fields as transformers reads them.
    pub write: fn(&HfConfig, &mut Map<String, Value>),
}

impl Family {
    pub const ALL: [Family; 7] = [
        Self::Llama,
        Self::Mistral,
        Self::Qwen2,
        Self::Qwen3,
        Self::Mixtral,
        Self::Qwen3Moe,
        Self::DeepseekV3,
    ];

    pub(super) fn spec(self) -> &'static Spec {
        match self {
            Self::Llama => &llama::SPEC,
            Self::Mistral => &mistral::SPEC,
            Self::Qwen2 => &qwen2::SPEC,
            Self::Qwen3 => &qwen3::SPEC,
            Self::Mixtral => &mixtral::SPEC,
            Self::Qwen3Moe => &qwen3_moe::SPEC,
            Self::DeepseekV3 => &deepseek_v3::SPEC,
        }
    }

    /// The family of `config.json`'s `model_type`.
    pub fn of_model_type(model_type: &str) -> Result<Self, HfError> {
        Self::ALL
            .into_iter()
            .find(|f| f.model_type() == model_type)
            .ok_or_else(|| HfError::Unsupported {
                field: "model_type",
                value: model_type.to_string(),
                detail: format!(
                    "the families built are {}",
                    Self::ALL.map(Family::model_type).join(", ")
                ),
            })
    }

    /// The family that writes `choices` (what an export is opened as): latent attention is
    /// DeepSeek-V3, a mixture of experts Qwen3-MoE with q/k norms and Mixtral without, dense
    /// heads with norms Qwen3, q/k/v biases Qwen2, a sliding window alone Mistral, and anything
    /// else a Llama.
    pub fn of_choices(choices: &Choices) -> Result<Self, HfError> {
        let family = match (&choices.latent, &choices.moe, choices.qk_norm, choices.qkv_bias) {
            (Some(_), ..) => Self::DeepseekV3,
            (None, Some(_), true, _) => Self::Qwen3Moe,
            (None, Some(_), false, _) => Self::Mixtral,
            (None, None, true, _) => Self::Qwen3,
            (None, None, false, true) => Self::Qwen2,
            (None, None, false, false) if choices.sliding_window.is_some() => Self::Mistral,
            (None, None, false, false) => Self::Llama,
        };
        // What the family's fields cannot say: Qwen3's `attention_bias` biases the output
        // projection too, Mixtral always renormalizes, only DeepSeek-V3 routes its way, and
        // DeepSeek-V3 has no sliding window, q/k norms or biases; only DeepSeek-V3 holds
        // multi-token prediction modules.
        let deepseek = choices.moe.is_some_and(|m| m.deepseek.is_some());
        let expressible = (choices.mtp_layers == 0 || family == Self::DeepseekV3)
            && match family {
                Self::Qwen3 => !choices.qkv_bias,
                Self::Qwen3Moe => !choices.qkv_bias && !deepseek,
                Self::Mixtral => !choices.qkv_bias && !deepseek && choices.moe.is_some_and(|m| m.normalize),
                Self::DeepseekV3 => {
                    !choices.qkv_bias
                        && !choices.qk_norm
                        && choices.sliding_window.is_none()
                        && choices.moe.is_none_or(|m| m.deepseek.is_some())
                }
                _ => true,
            };
        match expressible {
            true => Ok(family),
            false => Err(HfError::Unsupported {
                field: "model_type",
                value: family.model_type().to_string(),
                detail: format!("no family built has these layer choices: {choices:?}"),
            }),
        }
    }

    pub fn model_type(self) -> &'static str {
        self.spec().model_type
    }

    pub fn architecture(self) -> &'static str {
        self.spec().architecture
    }
}

/// A refusal of `field = value`.
fn unsupported(field: &'static str, value: impl ToString, detail: &str) -> HfError {
    HfError::Unsupported {
        field,
        value: value.to_string(),
        detail: detail.to_string(),
    }
}

/// Llama's and Qwen3's `attention_bias`, which biases the output projection too: refused.
fn no_attention_bias(raw: &Raw) -> Result<(), HfError> {
    match raw.attention_bias {
        true => Err(unsupported(
            "attention_bias",
            true,
            "this family's attention_bias biases the output projection, which is built without one",
        )),
        false => Ok(()),
    }
}

/// Qwen's window: `sliding_window` where `use_sliding_window` says so, for the layers
/// `layer_types` names (the window then bounds every sequence, which is exact for all layers).
fn qwen_window(raw: &Raw) -> Result<Option<usize>, HfError> {
    if let Some(kind) = raw
        .layer_types
        .iter()
        .flatten()
        .find(|t| !matches!(t.as_str(), "full_attention" | "sliding_attention"))
    {
        return Err(unsupported(
            "layer_types",
            kind,
            "the layers built are full and sliding attention",
        ));
    }
    Ok(raw.sliding_window.filter(|_| raw.use_sliding_window.unwrap_or(false)))
}

/// The experts of a MoE family, `experts` of them (the field read), routing to
/// `num_experts_per_tok` (2 by default).
fn moe(experts: Option<usize>, expert_size: Option<usize>, normalize: bool, raw: &Raw) -> Result<HfMoe, HfError> {
    let experts = experts.ok_or_else(|| {
        unsupported(
            "num_local_experts",
            "null",
            "a mixture of experts needs its expert count",
        )
    })?;
    let expert_size = expert_size
        .ok_or_else(|| unsupported("moe_intermediate_size", "null", "the experts need their hidden size"))?;
    Ok(HfMoe {
        experts,
        top_k: raw.num_experts_per_tok.unwrap_or(2),
        expert_size,
        normalize,
        deepseek: None,
    })
}

/// No family but DeepSeek-V3 stores rotated features interleaved.
fn no_rope_columns(_: &HfConfig, _: &str) -> Option<RopeColumns> {
    None
}

/// Writes `field: value` into `json`.
fn put(json: &mut Map<String, Value>, field: &str, value: impl Into<Value>) {
    json.insert(field.to_string(), value.into());
}

/// Qwen's sliding-window fields: with a window, every layer slides (`max_window_layers` 0).
fn put_qwen_window(json: &mut Map<String, Value>, config: &HfConfig) {
    let window = config.choices.sliding_window;
    put(json, "use_sliding_window", window.is_some());
    put(json, "sliding_window", window);
    put(json, "max_window_layers", 0);
    let kind = if window.is_some() {
        "sliding_attention"
    } else {
        "full_attention"
    };
    put(json, "layer_types", vec![kind; config.num_hidden_layers]);
}

/// A MoE family's expert fields, under `experts_field` and `size_field`.
fn put_moe(json: &mut Map<String, Value>, config: &HfConfig) -> HfMoe {
    let moe = config.choices.moe.expect("a MoE family's choices have experts");
    put(json, "num_experts_per_tok", moe.top_k);
    put(json, "output_router_logits", false);
    moe
}
