//! Where a Llama block's linear layers read their inputs: four sites, each shared by the
//! layers that read the same tensor, and the layer (or norm) whose output it is, into which a
//! smoothing scale folds.

use burn::module::Param;
use burn::tensor::Tensor;

use super::InputQuantizer;
use super::PtqError;
use crate::models::llama::LlamaBlock;

/// An input of a block's linear layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Site {
    /// The attention norm's output, read by `wq`, `wk` and `wv`.
    AttentionInput,
    /// The heads' outputs, read by `wo` (the values' projection `wv` made them).
    AttentionOutput,
    /// The MLP norm's output, read by `w1` and `w3`.
    MlpInput,
    /// The SwiGLU's output, read by `w2` (linear in the up projection `w3`).
    MlpHidden,
}

impl Site {
    pub const ALL: [Site; 4] = [
        Site::AttentionInput,
        Site::AttentionOutput,
        Site::MlpInput,
        Site::MlpHidden,
    ];

    /// The linear layers reading it, by their path in the block.
    pub fn linears(self) -> &'static [&'static str] {
        match self {
            Site::AttentionInput => &["attention.wq", "attention.wk", "attention.wv"],
            Site::AttentionOutput => &["attention.wo"],
            Site::MlpInput => &["mlp.w1", "mlp.w3"],
            Site::MlpHidden => &["mlp.w2"],
        }
    }
}

/// A block's linear layer: its input quantizer and weight (`[in, out]`).
pub struct LinearMut<'a> {
    pub quantizer: &'a mut InputQuantizer,
    pub weight: &'a mut Param<Tensor<2>>,
}

/// The linear layer of `block` at `path` (one of [`Site::linears`]); a MoE block has no MLP
/// to quantize.
pub fn linear_mut<'a>(block: &'a mut LlamaBlock, path: &str) -> Result<LinearMut<'a>, PtqError> {
    let column = |l: &'a mut crate::layers::ColumnParallelLinear| LinearMut {
        quantizer: &mut l.input_quantizer,
        weight: &mut l.weight,
    };
    let attention = &mut block.attention;
    if let Some(name) = path.strip_prefix("attention.") {
        return Ok(match name {
            "wq" => column(&mut attention.wq),
            "wk" => column(&mut attention.wk),
            "wv" => column(&mut attention.wv),
            "wo" => LinearMut {
                quantizer: &mut attention.wo.input_quantizer,
                weight: &mut attention.wo.weight,
            },
            _ => unreachable!("a site's linear"),
        });
    }
    let mlp = block.mlp.as_mut().ok_or(PtqError::MixtureOfExperts)?;
    Ok(match path {
        "mlp.w1" => column(&mut mlp.w1),
        "mlp.w3" => column(&mut mlp.w3),
        "mlp.w2" => LinearMut {
            quantizer: &mut mlp.w2.input_quantizer,
            weight: &mut mlp.w2.weight,
        },
        _ => unreachable!("a site's linear"),
    })
}
