//! The Hugging Face model families the decoder loads and exports. Each family's file says what
//! transformers calls it (`model_type`, its architecture class), what its `config.json` adds to
//! the Llama's (read into [`Choices`], written back), and where its MoE blocks keep their router
//! and experts. Everything else — the embedding, the norms, attention's and the dense MLP's
//! projections — has the Llama's names in every family.

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
    /// The mixture of experts of every block (Mixtral, Qwen3-MoE).
    pub moe: Option<HfMoe>,
}

/// A family's mixture of experts: softmax routing to the `top_k` best of `experts` SwiGLU
/// experts of hidden size `expert_size`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HfMoe {
    pub experts: usize,
    pub top_k: usize,
    pub expert_size: usize,
    /// The chosen experts' weights renormalized to sum to 1 (Mixtral always; Qwen3-MoE's
    /// `norm_topk_prob`).
    pub normalize: bool,
}

/// Where a MoE block keeps its router and experts in the file, under `model.layers.{i}.`.
pub(super) struct MoeNames {
    /// The router's `[experts, d]` weight.
    pub router: &'static str,
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
    /// The family's fields of `config.json`, each value it cannot build refused by name.
    pub read: fn(&Raw) -> Result<Choices, HfError>,
    /// Those fields as transformers reads them.
    pub write: fn(&HfConfig, &mut Map<String, Value>),
}

impl Family {
    pub const ALL: [Family; 6] = [
        Self::Llama,
        Self::Mistral,
        Self::Qwen2,
        Self::Qwen3,
        Self::Mixtral,
        Self::Qwen3Moe,
    ];

    pub(super) fn spec(self) -> &'static Spec {
        match self {
            Self::Llama => &llama::SPEC,
            Self::Mistral => &mistral::SPEC,
            Self::Qwen2 => &qwen2::SPEC,
            Self::Qwen3 => &qwen3::SPEC,
            Self::Mixtral => &mixtral::SPEC,
            Self::Qwen3Moe => &qwen3_moe::SPEC,
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

    /// The family that writes `choices` (what an export is opened as): a mixture of experts is
    /// Qwen3-MoE with q/k norms and Mixtral without, dense heads with norms Qwen3, q/k/v biases
    /// Qwen2, a sliding window alone Mistral, and anything else a Llama.
    pub fn of_choices(choices: &Choices) -> Result<Self, HfError> {
        let family = match (&choices.moe, choices.qk_norm, choices.qkv_bias) {
            (Some(_), true, _) => Self::Qwen3Moe,
            (Some(_), false, _) => Self::Mixtral,
            (None, true, _) => Self::Qwen3,
            (None, false, true) => Self::Qwen2,
            (None, false, false) if choices.sliding_window.is_some() => Self::Mistral,
            (None, false, false) => Self::Llama,
        };
        // What the family's fields cannot say: Qwen3's `attention_bias` biases the output
        // projection too, and Mixtral always renormalizes.
        let expressible = match family {
            Self::Qwen3 | Self::Qwen3Moe => !choices.qkv_bias,
            Self::Mixtral => !choices.qkv_bias && choices.moe.is_some_and(|m| m.normalize),
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
    })
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
