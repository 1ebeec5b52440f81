//! Mistral (`MistralForCausalLM`): the Llama's blocks, attention within a sliding window.

use serde_json::{Map, Value};

use super::{Choices, Spec, no_rope_columns, put};
use crate::models::llama::hf::HfError;
use crate::models::llama::hf::config::{HfConfig, Raw};

pub(super) const SPEC: Spec = Spec {
    model_type: "mistral",
    architecture: "MistralForCausalLM",
    moe: None,
    block: &[],
    rope_columns: no_rope_columns,
    read,
    write,
};

fn read(raw: &Raw) -> Result<Choices, HfError> {
    Ok(Choices {
        sliding_window: raw.sliding_window,
        ..Choices::default()
    })
}

fn write(config: &HfConfig, json: &mut Map<String, Value>) {
    put(json, "sliding_window", config.choices.sliding_window);
}
