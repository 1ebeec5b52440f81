//! A training step's arithmetic by Megatron's convention (no causal discount), which MFU
//! divides by: `6·P` a token for the products of `P` matmul parameters (forward and backward),
//! plus `12·layers·seq·hidden` for attention's scores and values. A mixture of experts counts
//! the experts a token visits and its router.

use super::LlamaConfig;

impl LlamaConfig {
    /// The parameters a token's products touch: each block's `4h²` attention and its MLP
    /// (`3h·ffn`; a MoE block's `3h·ffn·top_k`, its shared expert and router), and the output
    /// layer's `vocab·h`.
    pub fn matmul_params(&self) -> usize {
        let (h, f, v) = (self.attention.d_model, self.mlp.d_ff, self.embedding.vocab_size);
        let ffn = |i: usize| match self.moe.as_ref().filter(|m| m.holds(i)) {
            Some(moe) => {
                let router = &moe.layer.router;
                3 * h * moe.layer.d_ff * router.top_k
                    + 3 * h * moe.layer.shared_d_ff.unwrap_or(0)
                    + h * router.n_experts
            }
            None => 3 * h * f,
        };
        (0..self.n_layers).map(|i| 4 * h * h + ffn(i)).sum::<usize>() + v * h
    }

    /// Floating-point operations a training step spends on each token of sequences of `seq`.
    pub fn flops_per_token(&self, seq: usize) -> f64 {
        let (h, l) = (self.attention.d_model, self.n_layers);
        6.0 * self.matmul_params() as f64 + 12.0 * (l * seq * h) as f64
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
}
