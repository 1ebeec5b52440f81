//! Llama (`LlamaForCausalLM`): dense blocks, no biases.

use serde_json::{Map, Value};

use super::{Choices, Spec, no_attention_bias, no_rope_columns, put};
use crate::models::llama::hf::HfError;
use crate::models::llama::hf::config::{HfConfig, Raw};

pub(super) const SPEC: Spec = Spec {
    model_type: "llama",
    architecture: "LlamaForCausalLM",
    moe: None,
    block: &[],
    rope_columns: no_rope_columns,
    read,
    write,
};

fn read(raw: &Raw) -> Result<Choices, HfError> {
    no_attention_bias(raw)?;
    Ok(Choices::default())
}

fn write(_: &HfConfig, json: &mut Map<String, Value>) {
    put(json, "attention_bias", false);
    put(json, "mlp_bias", false);
}
