//! The largest sizes a model's configuration may give, checked before anything is sized or
//! looped by them: a corrupt or hostile file's numbers become an error naming the field, never
//! an allocation or a loop of that size. Far past any model trained (the largest have a few
//! hundred blocks and dims of tens of thousands).

use super::LlamaConfig;
use crate::error::ConfigError;

/// The most blocks a model may have.
pub const MAX_LAYERS: usize = 1 << 16;
/// The largest width, vocabulary, head count or context a model may have.
pub const MAX_DIM: usize = 1 << 31;

impl LlamaConfig {
    /// Checks every size against [`MAX_LAYERS`] and [`MAX_DIM`].
    pub fn check_sizes(&self) -> Result<(), ConfigError> {
        let a = &self.attention;
        let mut sizes = vec![
            ("d_model", a.d_model),
            ("n_heads", a.n_heads),
            ("n_kv_heads", a.n_kv_heads),
            ("head_dim", a.head_dim.unwrap_or(0)),
            ("max_seq_len", a.max_seq_len),
            ("d_ff", self.mlp.d_ff),
            ("vocab_size", self.embedding.vocab_size),
        ];
        if let Some(moe) = &self.moe {
            let router = &moe.layer.router;
            sizes.extend([
                ("n_experts", router.n_experts),
                ("top_k", router.top_k),
                ("expert d_ff", moe.layer.d_ff),
                ("shared d_ff", moe.layer.shared_d_ff.unwrap_or(0)),
            ]);
        }
        if let Some(latent) = &self.latent {
            sizes.extend([
                ("q_lora_rank", latent.q_rank.unwrap_or(0)),
                ("kv_lora_rank", latent.kv_rank),
                ("qk_nope_head_dim", latent.qk_nope_dim),
                ("qk_rope_head_dim", latent.qk_rope_dim),
                ("v_head_dim", latent.v_dim),
            ]);
        }
        if self.n_layers > MAX_LAYERS {
            return Err(ConfigError::TooLarge {
                what: "n_layers",
                size: self.n_layers,
                max: MAX_LAYERS,
            });
        }
        match sizes.into_iter().find(|(_, size)| *size > MAX_DIM) {
            Some((what, size)) => Err(ConfigError::TooLarge {
                what,
                size,
                max: MAX_DIM,
            }),
            None => Ok(()),
        }
    }
}
