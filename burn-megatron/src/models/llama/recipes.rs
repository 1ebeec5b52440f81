//! Runs are recipes: functions that return a complete configuration (`docs/performance.md` names the workloads).

use burn_megatron_dist::ParallelDims;

use super::model::{LlamaConfig, MoeBlocks, WordEmbeddings};
use crate::error::ConfigError;
use crate::layers::LatentAttentionConfig;
use crate::layers::moe::{GroupLimit, MoeConfig, RouterConfig, Scoring};
use crate::plan::{ParallelPlan, TensorParallel};

/// A model with the batch it trains on.
#[derive(Clone, Debug)]
pub struct LlamaRecipe {
    pub name: &'static str,
    pub model: LlamaConfig,
    pub seq_len: usize,
    /// Sequences per global batch.
    pub batch_size: usize,
}

impl LlamaRecipe {
    /// The sequences each of `dp` data-parallel ranks trains on a step: the global batch must
    /// split evenly.
    pub fn per_rank_batch(&self, dp: usize) -> Result<usize, ConfigError> {
        let batch = self.batch_size;
        match batch {
            0 => Err(ConfigError::Zero { what: "batch size" }),
            _ if batch.is_multiple_of(dp) => Ok(batch / dp),
            _ => Err(ConfigError::BatchNotDivisible { batch, dp }),
        }
    }
}

/// hidden 256, 2 layers, 4 heads, ffn 688, vocab 1024, seq 256, batch 2.
pub fn tiny() -> LlamaRecipe {
    LlamaRecipe {
        name: "tiny",
        model: LlamaConfig::llama(1024, 256, 2, 4, 4, 688, 256),
        seq_len: 256,
        batch_size: 2,
    }
}

/// SmolLM2-135M's shape (its GGUF file's `llama.*` metadata): hidden 576, 30 layers, 9 heads
/// over 3 kv heads, ffn 1536, vocab 49152, RoPE θ 1e5, tied embeddings, 8192 positions;
/// trained at seq 2048, batch 8.
pub fn smollm2_135m() -> LlamaRecipe {
    let mut model = LlamaConfig::llama(49152, 576, 30, 9, 3, 1536, 8192).with_word_embeddings(WordEmbeddings::Tied);
    model.attention.rope_theta = 1e5;
    LlamaRecipe {
        name: "smollm2-135m",
        model,
        seq_len: 2048,
        batch_size: 8,
    }
}

/// hidden 2048, 16 layers, 16 heads, ffn 5632, vocab 32768, seq 2048, batch 4.
pub fn llama_1b() -> LlamaRecipe {
    LlamaRecipe {
        name: "llama-1b",
        model: LlamaConfig::llama(32768, 2048, 16, 16, 16, 5632, 2048),
        seq_len: 2048,
        batch_size: 4,
    }
}

/// llama-1b at sequences of 32768 tokens, batch 1 (`examples/bench/peers/common.py`'s
/// `llama-1b-32k`): context parallelism's workload.
pub fn llama_1b_32k() -> LlamaRecipe {
    LlamaRecipe {
        name: "llama-1b-32k",
        model: LlamaConfig::llama(32768, 2048, 16, 16, 16, 5632, 32768),
        seq_len: 32768,
        batch_size: 1,
    }
}

/// hidden 4096, 32 layers, 32 heads, ffn 14336, vocab 32768, seq 4096, batch 1.
pub fn llama_8b() -> LlamaRecipe {
    LlamaRecipe {
        name: "llama-8b",
        model: LlamaConfig::llama(32768, 4096, 32, 32, 32, 14336, 4096),
        seq_len: 4096,
        batch_size: 1,
    }
}

/// Qwen3-1.7B's shape (`examples/bench/peers/hf_families.py`'s `qwen3-1.7b`): hidden 2048, 28 layers,
/// 16 heads of 128 over 8 kv heads with each head's q/k RMSNorm, ffn 6144, vocab 151936, tied
/// embeddings, RoPE θ 1e6, RMSNorm ε 1e-6, 4096 positions; seq 2048, batch 4.
pub fn qwen3_1_7b() -> LlamaRecipe {
    let mut model = LlamaConfig::llama(151936, 2048, 28, 16, 8, 6144, 4096).with_word_embeddings(WordEmbeddings::Tied);
    qwen3_attention(&mut model);
    LlamaRecipe {
        name: "qwen3-1.7b",
        model,
        seq_len: 2048,
        batch_size: 4,
    }
}

/// `hf_families.py`'s `qwen3-moe-2b`: hidden 1536, 16 layers, 16 heads of 128 over 4 kv heads with
/// q/k RMSNorm, every block 64 experts of hidden size 512, top 8 renormalized, no
/// load-balancing loss (the peer's `router_aux_loss_coef` 0), vocab 32768, untied, RoPE θ 1e6,
/// ε 1e-6, 4096 positions; seq 2048, batch 4.
pub fn qwen3_moe_2b() -> LlamaRecipe {
    let mut model = LlamaConfig::llama(32768, 1536, 16, 16, 4, 4096, 4096);
    model.attention.head_dim = Some(128);
    qwen3_attention(&mut model);
    let router = RouterConfig::new(1536, 64, 8).with_normalize(true);
    model.moe = Some(MoeBlocks::new(MoeConfig::new(router, 512)));
    LlamaRecipe {
        name: "qwen3-moe-2b",
        model,
        seq_len: 2048,
        batch_size: 4,
    }
}

/// `hf_families.py`'s `dsv3-2b` (DeepSeek-V3's layout at one GPU's size): hidden 1536, 16 layers
/// of multi-head latent attention (16 heads; q latent 768, kv latent 512; heads of 128 + 64
/// rotated, values of 128), block 0 dense (ffn 6144), then 32 routed experts of 768 scored by
/// sigmoid with a selection bias, top 4 within the best 2 of 4 groups, renormalized and scaled
/// by 2.5, and one shared expert; vocab 32768, untied, RoPE θ 1e4, ε 1e-6, 4096 positions; seq
/// 2048, batch 4.
pub fn dsv3_2b() -> LlamaRecipe {
    let mut model = LlamaConfig::llama(32768, 1536, 16, 16, 16, 6144, 4096);
    model.norm.epsilon = 1e-6;
    model.latent = Some(LatentAttentionConfig::new(1536, 16, 512, 128, 64, 128, 4096).with_q_rank(Some(768)));
    let router = RouterConfig::new(1536, 32, 4)
        .with_scoring(Scoring::Sigmoid)
        .with_normalize(true)
        .with_expert_bias(true)
        .with_group_limit(Some(GroupLimit::new(4, 2)))
        .with_scaling(2.5);
    let layer = MoeConfig::new(router, 768).with_shared_d_ff(Some(768));
    model.moe = Some(MoeBlocks::new(layer).with_first_dense(1));
    LlamaRecipe {
        name: "dsv3-2b",
        model,
        seq_len: 2048,
        batch_size: 4,
    }
}

/// Qwen3's attention and norms on `model`: RoPE θ 1e6, RMSNorm ε 1e-6, each head's q and k
/// RMS-normalized with it.
fn qwen3_attention(model: &mut LlamaConfig) {
    model.attention.rope_theta = 1e6;
    model.norm.epsilon = 1e-6;
    model.attention.qk_norm = Some(1e-6);
}

/// `model` with every block's feed-forward a mixture of `experts` SwiGLU experts of hidden
/// size `d_ff`, top `k`: softmax scores in f32, the k weights renormalized, the Switch
/// load-balancing loss at 1e-2, dropless (the peers' MoE, `examples/bench/peers/torch_moe.py`).
fn with_experts(mut model: LlamaConfig, experts: usize, k: usize, d_ff: usize) -> LlamaConfig {
    let d = model.attention.d_model;
    let router = RouterConfig::new(d, experts, k)
        .with_normalize(true)
        .with_aux_loss(1e-2);
    model.moe = Some(MoeBlocks::new(MoeConfig::new(router, d_ff)));
    model
}

/// tiny with 8 experts of ffn 128 a block, top 2.
pub fn tiny_moe() -> LlamaRecipe {
    LlamaRecipe {
        name: "tiny-moe",
        model: with_experts(tiny().model, 8, 2, 128),
        ..tiny()
    }
}

/// llama-1b's attention with 32 experts of ffn 1408 a block, top 4 (`moe-4b` of
/// `examples/bench/peers/common.py`: about 4.6 B parameters, 1 B active).
pub fn moe_4b() -> LlamaRecipe {
    LlamaRecipe {
        name: "moe-4b",
        model: with_experts(llama_1b().model, 32, 4, 1408),
        ..llama_1b()
    }
}

/// A preset by name: `tiny`, `tiny-moe`, `llama-1b`, `llama-1b-32k`, `moe-4b`, `llama-8b`,
/// `smollm2-135m`, `qwen3-1.7b`, `qwen3-moe-2b` or `dsv3-2b`.
pub fn preset(name: &str) -> Result<LlamaRecipe, ConfigError> {
    match name {
        "tiny" => Ok(tiny()),
        "tiny-moe" => Ok(tiny_moe()),
        "llama-1b" => Ok(llama_1b()),
        "llama-1b-32k" => Ok(llama_1b_32k()),
        "moe-4b" => Ok(moe_4b()),
        "llama-8b" => Ok(llama_8b()),
        "smollm2-135m" => Ok(smollm2_135m()),
        "qwen3-1.7b" => Ok(qwen3_1_7b()),
        "qwen3-moe-2b" => Ok(qwen3_moe_2b()),
        "dsv3-2b" => Ok(dsv3_2b()),
        other => Err(ConfigError::UnknownPreset(other.to_string())),
    }
}

/// llama-1b with tensor and sequence parallelism over 2 GPUs.
pub fn llama_1b_tp2() -> Result<LlamaRecipe, ConfigError> {
    with_plan(
        llama_1b(),
        ParallelPlan::new(ParallelDims::tp_dp(2, 1)).with_tensor(TensorParallel::SequenceParallel),
    )
}

/// llama-8b with tensor and sequence parallelism over 2 GPUs.
pub fn llama_8b_tp2() -> Result<LlamaRecipe, ConfigError> {
    with_plan(
        llama_8b(),
        ParallelPlan::new(ParallelDims::tp_dp(2, 1)).with_tensor(TensorParallel::SequenceParallel),
    )
}

/// `recipe` with `plan` applied.
pub fn with_plan(mut recipe: LlamaRecipe, plan: ParallelPlan) -> Result<LlamaRecipe, ConfigError> {
    recipe.model = plan.apply(recipe.model, plan.dims.world_size(), recipe.seq_len)?;
    Ok(recipe)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_must_split_over_dp() {
        let batch = |n| LlamaRecipe {
            batch_size: n,
            ..tiny()
        };
        assert_eq!(batch(8).per_rank_batch(4), Ok(2));
        assert_eq!(
            batch(6).per_rank_batch(4),
            Err(ConfigError::BatchNotDivisible { batch: 6, dp: 4 })
        );
        assert_eq!(
            batch(0).per_rank_batch(1),
            Err(ConfigError::Zero { what: "batch size" })
        );
        assert_eq!(
            preset("llama-3b").unwrap_err(),
            ConfigError::UnknownPreset("llama-3b".into())
        );
    }
}
