//! Mixtral (`MixtralForCausalLM`): every block a mixture of `num_local_experts` SwiGLU experts
//! of `intermediate_size`, softmax routing to the top `num_experts_per_tok`, renormalized.

use serde_json::{Map, Value};

use super::{Choices, MoeNames, Spec, moe, no_rope_columns, put, put_moe, unsupported};
use crate::models::llama::hf::HfError;
use crate::models::llama::hf::config::{HfConfig, Raw};

pub(super) const SPEC: Spec = Spec {
    model_type: "mixtral",
    architecture: "MixtralForCausalLM",
    moe: Some(MoeNames {
        bias: None,
        shared: None,
        router: "block_sparse_moe.gate.weight",
        gate: "block_sparse_moe.experts.{j}.w1.weight",
        down: "block_sparse_moe.experts.{j}.w2.weight",
        up: "block_sparse_moe.experts.{j}.w3.weight",
    }),
    block: &[],
    rope_columns: no_rope_columns,
    read,
    write,
};

fn read(raw: &Raw) -> Result<Choices, HfError> {
    if let Some(noise) = raw.router_jitter_noise.filter(|n| *n != 0.0) {
        return Err(unsupported("router_jitter_noise", noise, "the router adds no noise"));
    }
    Ok(Choices {
        sliding_window: raw.sliding_window,
        moe: Some(moe(raw.num_local_experts, Some(raw.intermediate_size), true, raw)?),
        ..Choices::default()
    })
}

fn write(config: &HfConfig, json: &mut Map<String, Value>) {
    let moe = put_moe(json, config);
    put(json, "num_local_experts", moe.experts);
    put(json, "router_jitter_noise", 0.0);
    put(json, "sliding_window", config.choices.sliding_window);
}
