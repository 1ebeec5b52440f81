//! A training step's arithmetic by Megatron's convention (no causal discount), which MFU
//! divides by: `6·P` a token for the products of `P` matmul parameters (forward and backward),
//! plus `6·layers·seq·heads·(qk + v)` for attention's scores and values over each head's q/k and
//! v widths (`12·layers·seq·hidden` where the heads are the model's width). A mixture of experts counts the experts a token visits
//! and its router. The count is `examples/bench/peers/hf_families.py`'s for every family built.

use super::LlamaConfig;

impl LlamaConfig {
    /// The parameters a token's products touch: each block's attention (`2h·heads·k` for q and
    /// the output, `2h·kv_heads·k` for k and v: `4h²` for multi-head attention as wide as the
    /// model; latent attention's down and up projections) and its MLP (`3h·ffn`; a MoE block's `3h·ffn·top_k`, its shared expert and router),
    /// and the output layer's `vocab·h`.
    pub fn matmul_params(&self) -> usize {
        let (h, f, v) = (self.attention.d_model, self.mlp.d_ff, self.embedding.vocab_size);
        let a = &self.attention;
        let attention = match &self.latent {
            // The query's projection (down and up, or whole), the key/value latent's down (with
            // the shared rotated key) and up, the output.
            Some(l) => {
                let (heads, qk, v) = (l.n_heads, l.qk_dim(), l.v_dim);
                let query = match l.q_rank {
                    Some(cq) => h * cq + cq * heads * qk,
                    None => h * heads * qk,
                };
                query + h * (l.kv_rank + l.qk_rope_dim) + l.kv_rank * heads * (l.qk_nope_dim + v) + heads * v * h
            }
            None => 2 * h * a.n_heads * a.head_dim() + 2 * h * a.n_kv_heads * a.head_dim(),
        };
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
        // Each head's scores over its q/k width and its values over v's.
        let (heads, qk, v) = match &self.latent {
            Some(l) => (l.n_heads, l.qk_dim(), l.v_dim),
            None => (
                self.attention.n_heads,
                self.attention.head_dim(),
                self.attention.head_dim(),
            ),
        };
        6.0 * self.matmul_params() as f64 + 6.0 * (self.n_layers * seq * heads * (qk + v)) as f64
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

    /// dsv3-2b by `hf_families.py`'s count: latent attention's `1536·768 + 768·16·192` (q),
    /// `1536·(512 + 64) + 512·16·(128 + 128)` (kv), `16·128·1536` (output); block 0's dense MLP
    /// `3·1536·6144`, the others' 4 routed and 1 shared experts of `3·1536·768` and the router;
    /// attention `6·16·seq·16·(192 + 128)`.
    #[test]
    fn dsv3_2b_as_the_peer_counts() {
        let model = preset("dsv3-2b").unwrap().model;
        let attention = 1536 * 768 + 768 * 16 * 192 + 1536 * (512 + 64) + 512 * 16 * 256 + 16 * 128 * 1536;
        let moe = 3 * 1536 * 768 * 5 + 1536 * 32;
        let mlp = 3 * 1536 * 6144 + 15 * moe;
        assert_eq!(model.matmul_params(), 16 * attention + mlp + 32_768 * 1536);
        let flops = 6.0 * model.matmul_params() as f64 + 6.0 * (16 * 2048 * 16 * (192 + 128)) as f64;
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
