//! Qwen2 (`Qwen2ForCausalLM`): the Llama's blocks with biases on q, k and v (always: Qwen2 has
//! no field for them).

use serde_json::{Map, Value};

use super::{Choices, Spec, no_rope_columns, put_qwen_window, qwen_window};
use crate::models::llama::hf::HfError;
use crate::models::llama::hf::config::{HfConfig, Raw};

pub(super) const SPEC: Spec = Spec {
    model_type: "qwen2",
    architecture: "Qwen2ForCausalLM",
    moe: None,
    block: &[],
    rope_columns: no_rope_columns,
    read,
    write,
};

fn read(raw: &Raw) -> Result<Choices, HfError> {
    Ok(Choices {
        qkv_bias: true,
        sliding_window: qwen_window(raw)?,
        ..Choices::default()
    })
}

fn write(config: &HfConfig, json: &mut Map<String, Value>) {
    put_qwen_window(json, config);
}
