//! Qwen3 (`Qwen3ForCausalLM`): the Llama's blocks with each head's q and k RMS-normalized
//! before the rotation (`q_norm`, `k_norm`).

use serde_json::{Map, Value};

use super::{Choices, Spec, no_attention_bias, no_rope_columns, put, put_qwen_window, qwen_window};
use crate::models::llama::hf::HfError;
use crate::models::llama::hf::config::{HfConfig, Raw};

pub(super) const SPEC: Spec = Spec {
    model_type: "qwen3",
    architecture: "Qwen3ForCausalLM",
    moe: None,
    block: &[],
    rope_columns: no_rope_columns,
    read,
    write,
};

fn read(raw: &Raw) -> Result<Choices, HfError> {
    no_attention_bias(raw)?;
    Ok(Choices {
        qk_norm: true,
        sliding_window: qwen_window(raw)?,
        ..Choices::default()
    })
}

fn write(config: &HfConfig, json: &mut Map<String, Value>) {
    put(json, "attention_bias", false);
    put_qwen_window(json, config);
}
