//! A GPT-2-style language model written with Burn alone, as a Burn user writes one: token and
//! learned position embeddings, pre-LayerNorm blocks of causal multi-head attention and a GELU
//! MLP (every linear with a bias), a final LayerNorm, and the output layer tied to the token
//! embedding. `parallel.rs` is the same model made parallel.
//!
//! Legend: `b` batch, `s` sequence, `d` d_model, `h` heads, `k` head dim, `v` vocabulary.

use burn::config::Config;
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Embedding, EmbeddingConfig, Gelu, Initializer, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::tensor::activation::softmax;
use burn::tensor::module::linear;
use burn::tensor::{Bool, Device, Int, Tensor};

/// GPT-2's initialization: normal, standard deviation 0.02.
const INIT: Initializer = Initializer::Normal { mean: 0.0, std: 0.02 };

#[derive(Config, Debug)]
pub struct GptConfig {
    pub n_layers: usize,
    pub token: EmbeddingConfig,
    pub position: EmbeddingConfig,
    pub attention: AttentionConfig,
    pub mlp: MlpConfig,
    pub norm: LayerNormConfig,
}

#[derive(Module, Debug)]
pub struct Gpt {
    pub token: Embedding,
    pub position: Embedding,
    pub blocks: Vec<Block>,
    pub norm: LayerNorm,
}

#[derive(Module, Debug)]
pub struct Block {
    pub attention_norm: LayerNorm,
    pub attention: Attention,
    pub mlp_norm: LayerNorm,
    pub mlp: Mlp,
}

#[derive(Config, Debug)]
pub struct AttentionConfig {
    pub d_model: usize,
    pub n_heads: usize,
}

#[derive(Module, Debug)]
pub struct Attention {
    pub query: Linear,
    pub key: Linear,
    pub value: Linear,
    pub output: Linear,
    pub n_heads: usize,
}

#[derive(Config, Debug)]
pub struct MlpConfig {
    pub d_model: usize,
    pub d_ff: usize,
}

#[derive(Module, Debug)]
pub struct Mlp {
    pub up: Linear,
    pub down: Linear,
    pub gelu: Gelu,
}

impl GptConfig {
    /// GPT-2's shape: `n_layers` blocks of `n_heads` heads and a 4·d_model MLP.
    pub fn gpt(vocab_size: usize, max_seq_len: usize, d_model: usize, n_heads: usize, n_layers: usize) -> Self {
        Self::new(
            n_layers,
            EmbeddingConfig::new(vocab_size, d_model).with_initializer(INIT),
            EmbeddingConfig::new(max_seq_len, d_model).with_initializer(INIT),
            AttentionConfig::new(d_model, n_heads),
            MlpConfig::new(d_model, 4 * d_model),
            LayerNormConfig::new(d_model),
        )
    }

    pub fn init(&self, device: &Device) -> Gpt {
        let block = || Block {
            attention_norm: self.norm.init(device),
            attention: self.attention.init(device),
            mlp_norm: self.norm.init(device),
            mlp: self.mlp.init(device),
        };
        Gpt {
            token: self.token.init(device),
            position: self.position.init(device),
            blocks: (0..self.n_layers).map(|_| block()).collect(),
            norm: self.norm.init(device),
        }
    }
}

impl AttentionConfig {
    pub fn init(&self, device: &Device) -> Attention {
        let linear = || {
            LinearConfig::new(self.d_model, self.d_model)
                .with_initializer(INIT)
                .init(device)
        };
        Attention {
            query: linear(),
            key: linear(),
            value: linear(),
            output: linear(),
            n_heads: self.n_heads,
        }
    }
}

impl MlpConfig {
    pub fn init(&self, device: &Device) -> Mlp {
        Mlp {
            up: LinearConfig::new(self.d_model, self.d_ff)
                .with_initializer(INIT)
                .init(device),
            down: LinearConfig::new(self.d_ff, self.d_model)
                .with_initializer(INIT)
                .init(device),
            gelu: Gelu::new(),
        }
    }
}

impl Gpt {
    /// # Shapes
    /// `[b, s]` token ids → logits `[b, s, v]`
    pub fn forward(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        let [_, s] = ids.dims();
        let positions = Tensor::arange(0..s as i64, &ids.device()).unsqueeze(); // [1, s]
        let mut x = self.token.forward(ids) + self.position.forward(positions);
        for block in &self.blocks {
            x = block.forward(x);
        }
        // The output layer is the token embedding, transposed.
        linear(self.norm.forward(x), self.token.weight.val().transpose(), None)
    }

    /// The mean next-token loss.
    ///
    /// # Shapes
    /// `[b, s]`, `[b, s]` → `[1]`
    pub fn loss(&self, ids: Tensor<2, Int>, targets: Tensor<2, Int>) -> Tensor<1> {
        let logits = self.forward(ids);
        let [b, s, v] = logits.dims();
        let loss = CrossEntropyLossConfig::new().init(&logits.device());
        loss.forward(logits.reshape([b * s, v]), targets.reshape([b * s]))
    }
}

impl Block {
    /// # Shapes
    /// `[b, s, d]` → `[b, s, d]`
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let x = x.clone() + self.attention.forward(self.attention_norm.forward(x));
        x.clone() + self.mlp.forward(self.mlp_norm.forward(x))
    }
}

impl Attention {
    /// # Shapes
    /// `[b, s, d]` → `[b, s, d]`
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let (q, k, v) = (
            self.query.forward(x.clone()),
            self.key.forward(x.clone()),
            self.value.forward(x),
        );
        let [b, s, features] = q.dims();
        let head_dim = features / self.n_heads;
        let heads = |t: Tensor<3>| t.reshape([b, s, self.n_heads, head_dim]).swap_dims(1, 2); // [b, h, s, k]
        let (q, k, v) = (heads(q), heads(k), heads(v));
        let scores = q.matmul(k.swap_dims(2, 3)).div_scalar((head_dim as f64).sqrt()); // [b, h, s, s]
        let future = Tensor::<2, Bool>::tril_mask([s, s], 0, &scores.device()).unsqueeze::<4>();
        let weights = softmax(
            scores.mask_fill(future.expand([b, self.n_heads, s, s]), f32::NEG_INFINITY),
            3,
        );
        let context = weights.matmul(v).swap_dims(1, 2).reshape([b, s, features]);
        self.output.forward(context)
    }
}

impl Mlp {
    /// # Shapes
    /// `[b, s, d]` → `[b, s, d]`
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        self.down.forward(self.gelu.forward(self.up.forward(x)))
    }
}
