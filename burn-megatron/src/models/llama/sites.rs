//! A Llama block's linear layers by path, and the four inputs they read: each input a site
//! shared by the layers that read the same tensor, made by a layer (or norm) a smoothing scale
//! folds into. Post-training quantization, pruning, delayed FP8 scaling and the weights' kept
//! FP8 codes walk them.

use std::sync::Arc;

use burn::module::Param;
use burn::tensor::Tensor;

use super::LlamaBlock;
use burn_megatron_kernels::quant::notes::AmaxNotes;

use crate::precision::linear::LinearPrecision;

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

/// A block's linear layer: its weight (`[in, out]`) and how it multiplies.
pub struct LinearMut<'a> {
    pub weight: &'a mut Param<Tensor<2>>,
    pub precision: &'a mut LinearPrecision,
}

/// The linear layer of `block` at `path` (one of [`Site::linears`]); `None` for the MLP's
/// layers of a MoE block, which has none.
pub fn linear_mut<'a>(block: &'a mut LlamaBlock, path: &str) -> Option<LinearMut<'a>> {
    macro_rules! linear {
        ($l:expr) => {{
            let l = $l;
            LinearMut {
                weight: &mut l.weight,
                precision: &mut l.precision,
            }
        }};
    }
    if let Some(name) = path.strip_prefix("attention.") {
        let attention = block.attention.as_mut()?;
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

impl LlamaBlock {
    /// How the block's first linear layer multiplies (where the model's amax notes are).
    pub(crate) fn first_precision(&self) -> &LinearPrecision {
        match (&self.attention, &self.latent) {
            (Some(a), _) => &a.wq.precision,
            (None, Some(latent)) => latent.first_precision(),
            (None, None) => unreachable!("a block has grouped-query or latent attention"),
        }
    }

    /// How each of the block's linear layers multiplies (the attention's four, or latent
    /// attention's own; the dense MLP's three; a MoE block's experts multiply on their own), in
    /// [`Site::linears`]' order.
    pub fn linear_precisions(&mut self) -> Vec<&mut LinearPrecision> {
        let mut all = match (&mut self.attention, &mut self.latent) {
            (Some(a), _) => vec![
                &mut a.wq.precision,
                &mut a.wk.precision,
                &mut a.wv.precision,
                &mut a.wo.precision,
            ],
            (None, Some(latent)) => latent.linear_precisions(),
            (None, None) => Vec::new(),
        };
        if let Some(mlp) = &mut self.mlp {
            all.extend([&mut mlp.w1.precision, &mut mlp.w3.precision, &mut mlp.w2.precision]);
        }
        all
    }
}

/// Gives every linear layer of `blocks` and of `output` one [`AmaxNotes`] (a new one): the
/// kernels that write one layer's input or output gradient and the optimizer that writes its
/// weight note amaxes there for the layer's FP8 tensorwise casts, and a block's stream
/// gradient crosses into the previous block's, so the whole model shares one. Returns it.
pub(crate) fn share_amax_notes<'a>(
    blocks: impl Iterator<Item = &'a mut LlamaBlock>,
    output: Option<&mut LinearPrecision>,
) -> AmaxNotes {
    let notes = AmaxNotes::default();
    for block in blocks {
        for precision in block.linear_precisions() {
            precision.notes = notes.clone();
        }
        if let Some(mlp) = block.moe.as_mut().and_then(|moe| moe.shared.as_mut()) {
            for precision in [&mut mlp.w1.precision, &mut mlp.w3.precision, &mut mlp.w2.precision] {
                precision.notes = notes.clone();
            }
        }
    }
    if let Some(output) = output {
        output.notes = notes.clone();
    }
    notes
}

/// Gives each of `block`'s linear layers a slot for its weight's FP8 codes
/// ([`WeightCodes`]): under a current-scaling FP8 recipe or blockwise, the step's first
/// microbatch quantizes each weight and the others reuse its codes, as gradient accumulation
/// over microbatches (a pipeline's) wants. The codes stay held between steps (one byte a
/// value for each layout the products read, and the weight they came from until the next
/// forward pass replaces them), so a step of one microbatch gains nothing from it.
pub fn keep_weight_codes(block: &mut LlamaBlock) {
    for site in Site::ALL {
        for path in site.linears() {
            if let Some(linear) = linear_mut(block, path) {
                linear.precision.weight_codes = Some(Arc::default());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::Device;
    use burn_megatron_dist::ProcessGroups;

    use burn_megatron_kernels::quant::product::WeightCodes;

    use super::*;
    use crate::init::{InitMode, ParamInit};
    use crate::models::llama::LlamaConfig;

    /// Every linear layer of a block gets its own slot; none has one before.
    #[test]
    fn every_linear_keeps_its_weight_codes() {
        let config = LlamaConfig::llama(40, 32, 2, 4, 2, 48, 12);
        let init = ParamInit::new(3, InitMode::Full);
        let mut model = config.init(&Device::flex(), &ProcessGroups::single(), &init).unwrap();
        let block = &mut model.layers[0];
        let paths = Site::ALL.iter().flat_map(|site| site.linears()).copied();
        let slots = |block: &mut LlamaBlock| -> Vec<Option<Arc<WeightCodes>>> {
            paths
                .clone()
                .map(|path| linear_mut(block, path).unwrap().precision.weight_codes.clone())
                .collect()
        };
        assert!(slots(block).iter().all(Option::is_none));
        keep_weight_codes(block);
        let kept: Vec<Arc<WeightCodes>> = slots(block).into_iter().map(|slot| slot.expect("a slot")).collect();
        assert_eq!(kept.len(), 7);
        for (i, a) in kept.iter().enumerate() {
            assert!(
                kept[i + 1..].iter().all(|b| !Arc::ptr_eq(a, b)),
                "layer {i} shares its slot"
            );
        }
    }
}
