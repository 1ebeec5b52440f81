//! A Llama block's linear layers by path, and the four inputs they read: each input a site
//! shared by the layers that read the same tensor, made by a layer (or norm) a smoothing scale
//! folds into. Post-training quantization, pruning and delayed FP8 scaling walk them.

use burn::module::Param;
use burn::tensor::Tensor;

use super::LlamaBlock;
use crate::precision::delayed::AmaxRecorder;
use crate::precision::ptq::InputQuantizer;

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

/// A block's linear layer: its weight (`[in, out]`), input quantizer and delayed-scaling state.
pub struct LinearMut<'a> {
    pub weight: &'a mut Param<Tensor<2>>,
    pub quantizer: &'a mut InputQuantizer,
    pub amax_history: &'a mut Option<Param<Tensor<2>>>,
    pub amax_recorder: &'a AmaxRecorder,
}

/// The linear layer of `block` at `path` (one of [`Site::linears`]); `None` for the MLP's
/// layers of a MoE block, which has none.
pub fn linear_mut<'a>(block: &'a mut LlamaBlock, path: &str) -> Option<LinearMut<'a>> {
    macro_rules! linear {
        ($l:expr) => {{
            let l = $l;
            LinearMut {
                weight: &mut l.weight,
                quantizer: &mut l.input_quantizer,
                amax_history: &mut l.amax_history,
                amax_recorder: &l.amax_recorder,
            }
        }};
    }
    let attention = &mut block.attention;
    if let Some(name) = path.strip_prefix("attention.") {
        return Some(match name {
            "wq" => linear!(&mut attention.wq),
            "wk" => linear!(&mut attention.wk),
            "wv" => linear!(&mut attention.wv),
            "wo" => linear!(&mut attention.wo),
            _ => unreachable!("a site's linear"),
        });
    }
    let mlp = block.mlp.as_mut()?;
    Some(match path {
        "mlp.w1" => linear!(&mut mlp.w1),
        "mlp.w3" => linear!(&mut mlp.w3),
        "mlp.w2" => linear!(&mut mlp.w2),
        _ => unreachable!("a site's linear"),
    })
}
