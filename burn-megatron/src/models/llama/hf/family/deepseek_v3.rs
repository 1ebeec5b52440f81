//! DeepSeek-V3 (`DeepseekV3ForCausalLM`): multi-head latent attention (its rotated dims stored
//! as interleaved pairs where `rope_interleave` says, reordered into halves here), the first
//! `first_k_dense_replace` blocks dense, the rest `n_routed_experts` experts scored by sigmoid
//! with a selection bias (`e_score_correction_bias`), routed to the top `num_experts_per_tok`
//! within the best `topk_group` of `n_group` groups, renormalized (`norm_topk_prob`) and scaled
//! (`routed_scaling_factor`), beside `n_shared_experts` shared ones. Multi-token prediction's
//! modules (`num_nextn_predict_layers`) follow the blocks as blocks of their own with DeepSeek's
//! names (`hf/mod.rs`); transformers leaves them out.

use serde_json::{Map, Value};

use super::{Choices, DeepseekRouting, HfLatent, HfMoe, MoeNames, RopeColumns, Spec, put, put_moe, unsupported};
use crate::models::llama::hf::HfError;
use crate::models::llama::hf::config::{HfConfig, Raw};

pub(super) const SPEC: Spec = Spec {
    model_type: "deepseek_v3",
    architecture: "DeepseekV3ForCausalLM",
    moe: Some(MoeNames {
        router: "mlp.gate.weight",
        bias: Some("mlp.gate.e_score_correction_bias"),
        shared: Some([
            "mlp.shared_experts.gate_proj.weight",
            "mlp.shared_experts.down_proj.weight",
            "mlp.shared_experts.up_proj.weight",
        ]),
        gate: "mlp.experts.{j}.gate_proj.weight",
        down: "mlp.experts.{j}.down_proj.weight",
        up: "mlp.experts.{j}.up_proj.weight",
    }),
    block: &[
        ("latent.wq.weight", "self_attn.q_proj.weight", true),
        ("latent.wq_a.weight", "self_attn.q_a_proj.weight", true),
        ("latent.q_norm.weight", "self_attn.q_a_layernorm.weight", false),
        ("latent.wq_b.weight", "self_attn.q_b_proj.weight", true),
        ("latent.wkv_a.weight", "self_attn.kv_a_proj_with_mqa.weight", true),
        ("latent.kv_norm.weight", "self_attn.kv_a_layernorm.weight", false),
        ("latent.wkv_b.weight", "self_attn.kv_b_proj.weight", true),
        ("latent.wo.weight", "self_attn.o_proj.weight", true),
    ],
    rope_columns,
    read,
    write,
};

/// The query projections' rotated part of each head and the key/value latent's shared rotated
/// key, where the file interleaves them.
fn rope_columns(config: &HfConfig, field: &str) -> Option<RopeColumns> {
    let latent = config.choices.latent.filter(|l| l.interleaved)?;
    let (n, r) = (latent.qk_nope_dim, latent.qk_rope_dim);
    match field {
        "latent.wq.weight" | "latent.wq_b.weight" => Some(RopeColumns {
            period: n + r,
            offset: n,
            width: r,
        }),
        "latent.wkv_a.weight" => Some(RopeColumns {
            period: latent.kv_rank + r,
            offset: latent.kv_rank,
            width: r,
        }),
        _ => None,
    }
}

fn read(raw: &Raw) -> Result<Choices, HfError> {
    if raw.attention_bias {
        return Err(unsupported(
            "attention_bias",
            true,
            "latent attention's projections have no bias",
        ));
    }
    if let Some(scoring) = raw.scoring_func.as_deref().filter(|s| *s != "sigmoid") {
        return Err(unsupported(
            "scoring_func",
            scoring,
            "DeepSeek-V3's experts are scored by sigmoid",
        ));
    }
    if let Some(method) = raw.topk_method.as_deref().filter(|m| *m != "noaux_tc") {
        return Err(unsupported("topk_method", method, "DeepSeek-V3 routes by noaux_tc"));
    }
    if let Some(freq) = raw.moe_layer_freq.filter(|f| *f != 1) {
        return Err(unsupported(
            "moe_layer_freq",
            freq,
            "every block after the dense ones is a mixture of experts",
        ));
    }
    let size = |field: &'static str, value: Option<usize>| {
        value.ok_or_else(|| unsupported(field, "null", "latent attention needs it"))
    };
    let latent = HfLatent {
        q_rank: raw.q_lora_rank,
        kv_rank: size("kv_lora_rank", raw.kv_lora_rank)?,
        qk_nope_dim: size("qk_nope_head_dim", raw.qk_nope_head_dim)?,
        qk_rope_dim: size("qk_rope_head_dim", raw.qk_rope_head_dim)?,
        v_dim: size("v_head_dim", raw.v_head_dim)?,
        interleaved: raw.rope_interleave.unwrap_or(true),
    };
    let experts = size("n_routed_experts", raw.n_routed_experts)?;
    let expert_size = size("moe_intermediate_size", raw.moe_intermediate_size)?;
    let routing = DeepseekRouting {
        groups: raw.n_group.unwrap_or(1),
        top_groups: raw.topk_group.unwrap_or(1),
        scaling: raw.routed_scaling_factor.unwrap_or(1.0),
        shared_size: raw
            .n_shared_experts
            .unwrap_or(0)
            .checked_mul(expert_size)
            .ok_or_else(|| unsupported("n_shared_experts", "too many", "the shared experts' size overflows"))?,
        first_dense: raw.first_k_dense_replace.unwrap_or(0),
    };
    Ok(Choices {
        latent: Some(latent),
        moe: Some(HfMoe {
            experts,
            top_k: raw.num_experts_per_tok.unwrap_or(8),
            expert_size,
            normalize: raw.norm_topk_prob.unwrap_or(true),
            deepseek: Some(routing),
        }),
        mtp_layers: raw.num_nextn_predict_layers.unwrap_or(0),
        ..Choices::default()
    })
}

fn write(config: &HfConfig, json: &mut Map<String, Value>) {
    let latent = config
        .choices
        .latent
        .expect("DeepSeek-V3's choices have latent attention");
    put(json, "attention_bias", false);
    put(json, "q_lora_rank", latent.q_rank);
    put(json, "kv_lora_rank", latent.kv_rank);
    put(json, "qk_nope_head_dim", latent.qk_nope_dim);
    put(json, "qk_rope_head_dim", latent.qk_rope_dim);
    put(json, "v_head_dim", latent.v_dim);
    put(json, "rope_interleave", latent.interleaved);
    let moe = put_moe(json, config);
    let routing = moe.deepseek.expect("DeepSeek-V3's experts route its way");
    put(json, "n_routed_experts", moe.experts);
    put(json, "moe_intermediate_size", moe.expert_size);
    put(json, "norm_topk_prob", moe.normalize);
    put(json, "n_group", routing.groups);
    put(json, "topk_group", routing.top_groups);
    put(json, "routed_scaling_factor", routing.scaling);
    // The shared experts are written as whole experts of the routed ones' size.
    put(json, "n_shared_experts", routing.shared_size / moe.expert_size.max(1));
    put(json, "first_k_dense_replace", routing.first_dense);
    put(json, "moe_layer_freq", 1);
    put(json, "num_nextn_predict_layers", config.choices.mtp_layers);
}
