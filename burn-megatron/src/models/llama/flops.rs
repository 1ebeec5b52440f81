//! A training step's arithmetic by Megatron's convention (no causal discount), which MFU
//! divides by: `6·P` a token for the products of `P` matmul parameters (forward and backward),
//! plus `12·layers·seq·heads·head_dim` for attention's scores and values (`12·layers·seq·hidden`
//! where the heads are the model's width). A mixture of experts counts the experts a token visits
//! and its router. The count is `examples/bench/peers/hf_families.py`'s for every family built.

use super::LlamaConfig;

impl LlamaConfig {
    /// The parameters a token's products touch: each block's attention (`2h·heads·k` for q and
    /// the output, `2h·kv_heads·k` for k and v: `4h²` for multi-head attention as wide as the
    /// model) and its MLP (`3h·ffn`; a MoE block's `3h·ffn·top_k`, its shared expert and router),
    /// and the output layer's `vocab·h`.
    pub fn matmul_params(&self) -> usize {
        let (h, f, v) = (self.attention.d_model, self.mlp.d_ff, self.embedding.vocab_size);
        let a = &self.attention;
        let attention = 2 * h * a.n_heads * a.head_dim() + 2 * h * a.n_kv_heads * a.head_dim();
        let ffn = |i: usize| match self.moe.as_ref().filter(|m| m.holds(i)) {
            Some(moe) => {
                let router = &moe.layer.router;
                3 * h * moe.layer.d_ff * router.top_k
                    + 3 * h * moe.layer.shared_d_ff.unwrap_or(0)
                    + h * router.n_experts
            }
            None => 3 * h * f,
        };
        (0..self.n_layers).map(|i| attention + ffn(i)).sum::<usize>() + v * h
    }

    /// Floating-point operations a training step spends on each token of sequences of `seq`.
    pub fn flops_per_token(&self, seq: usize) -> f64 {
        let (width, l) = (self.attention.n_heads * self.attention.head_dim(), self.n_layers);
        6.0 * self.matmul_params() as f64 + 12.0 * (l * seq * width) as f64
    }
}

#[cfg(test)]
mod tests {
    use crate::models::llama::preset;

    /// llama-1b's count by hand: 16 blocks of 4·2048² + 3·2048·5632, the output's 32768·2048.
    #[test]
    fn llama_1b_by_hand() {
        let model = preset("llama-1b").unwrap().model;
        let per_block = 4 * 2048 * 2048 + 3 * 2048 * 5632;
        assert_eq!(model.matmul_params(), 16 * per_block + 32_768 * 2048);
        let flops = 6.0 * model.matmul_params() as f64 + 12.0 * (16 * 2048 * 2048) as f64;
        assert_eq!(model.flops_per_token(2048), flops);
    }

    /// qwen3-moe-2b by `hf_families.py`'s count: 16 blocks of q/o `2·1536·16·128` and k/v
    /// `2·1536·4·128`, 8 experts of `3·1536·512` and the router `1536·64`; the output
    /// `32768·1536`; attention `12·16·seq·16·128`.
    #[test]
    fn qwen3_moe_2b_as_the_peer_counts() {
        let model = preset("qwen3-moe-2b").unwrap().model;
        let attention = 2 * 1536 * 16 * 128 + 2 * 1536 * 4 * 128;
        let ffn = 3 * 1536 * 512 * 8 + 1536 * 64;
        assert_eq!(model.matmul_params(), 16 * (attention + ffn) + 32_768 * 1536);
        let flops = 6.0 * model.matmul_params() as f64 + 12.0 * (16 * 2048 * 16 * 128) as f64;
        assert_eq!(model.flops_per_token(2048), flops);
    }
}
