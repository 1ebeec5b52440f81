//! Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's attention, every block a mixture of experts of
//! `moe_intermediate_size`, softmax routing to the top `num_experts_per_tok`, renormalized
//! where `norm_topk_prob` says.

use serde_json::{Map, Value};

use super::{
    Choices, MoeNames, Spec, moe, no_attention_bias, no_rope_columns, put, put_moe, put_qwen_window, qwen_window,
    unsupported,
};
use crate::models::llama::hf::HfError;
use crate::models::llama::hf::config::{HfConfig, Raw};

pub(super) const SPEC: Spec = Spec {
    model_type: "qwen3_moe",
    architecture: "Qwen3MoeForCausalLM",
    moe: Some(MoeNames {
        bias: None,
        shared: None,
        router: "mlp.gate.weight",
        gate: "mlp.experts.{j}.gate_proj.weight",
        down: "mlp.experts.{j}.down_proj.weight",
        up: "mlp.experts.{j}.up_proj.weight",
    }),
    block: &[],
    rope_columns: no_rope_columns,
    read,
    write,
};

fn read(raw: &Raw) -> Result<Choices, HfError> {
    no_attention_bias(raw)?;
    // Blocks `i` with `(i + 1) % step == 0` are sparse, the rest and `mlp_only_layers` dense.
    if let Some(step) = raw.decoder_sparse_step.filter(|s| *s != 1) {
        return Err(unsupported(
            "decoder_sparse_step",
            step,
            "every block is a mixture of experts",
        ));
    }
    if let Some(layers) = raw.mlp_only_layers.as_ref().filter(|l| !l.is_empty()) {
        return Err(unsupported(
            "mlp_only_layers",
            format!("{layers:?}"),
            "every block is a mixture of experts",
        ));
    }
    // transformers 4.x calls the count `num_experts`, 5.x `num_local_experts`.
    let experts = raw.num_local_experts.or(raw.num_experts);
    let normalize = raw.norm_topk_prob.unwrap_or(false);
    Ok(Choices {
        qk_norm: true,
        sliding_window: qwen_window(raw)?,
        moe: Some(moe(experts, raw.moe_intermediate_size, normalize, raw)?),
        ..Choices::default()
    })
}

fn write(config: &HfConfig, json: &mut Map<String, Value>) {
    let moe = put_moe(json, config);
    put(json, "num_local_experts", moe.experts);
    put(json, "num_experts", moe.experts);
    put(json, "moe_intermediate_size", moe.expert_size);
    put(json, "norm_topk_prob", moe.normalize);
    put(json, "decoder_sparse_step", 1);
    put(json, "mlp_only_layers", Vec::<usize>::new());
    put(json, "attention_bias", false);
    put_qwen_window(json, config);
}
