//! How much each prunable piece of a Llama matters, from activations on calibration text
//! (Minitron's activation-based importance, aggregated as mean magnitudes) and, for whole
//! blocks, from the change in the loss when the block is left out.
//!
//! - a query head: the summed mean magnitudes of its output channels (what `wo` reads);
//! - an FFN channel: the mean magnitude of the SwiGLU's output there (what `w2` reads);
//! - an embedding channel: its mean magnitude at the output of every norm of every block (what
//!   the attention and the MLP read), summed;
//! - a block: the mean calibration loss with the block skipped, less the whole model's.

use burn::tensor::{DType, Int, Tensor};

use super::PruneError;
use crate::models::llama::Llama;
use crate::models::llama::Site;
use crate::posttrain::ptq::calibrate;
use crate::precision::ptq::Collect;

/// The importance of every prunable piece of a model.
#[derive(Clone, Debug, PartialEq)]
pub struct Importance {
    /// `[block][query head]`.
    pub heads: Vec<Vec<f32>>,
    /// `[block][FFN channel]`.
    pub ffn: Vec<Vec<f32>>,
    /// `[embedding channel]`.
    pub embedding: Vec<f32>,
    /// `[block]`: the rise of the calibration loss without it.
    pub blocks: Vec<f64>,
}

/// The importance of `model`'s pieces on `batches` (`[b, s + 1]` windows of token ids: the
/// first `s` are inputs, the last `s` targets).
pub fn importance(model: &Llama, batches: &[Tensor<2, Int>]) -> Result<Importance, PruneError> {
    let inputs: Vec<Tensor<2, Int>> = batches
        .iter()
        .map(|w| {
            let s = w.dims()[1] - 1;
            w.clone().narrow(1, 0, s)
        })
        .collect();
    let calibration = calibrate(model, &inputs, Collect::default())?;
    let mut heads = Vec::new();
    let mut ffn = Vec::new();
    let d = model.embedding.weight.dims()[1];
    let mut embedding = vec![0.0f32; d];
    for (i, block) in model.layers.iter().enumerate() {
        let k = block.attention.as_ref().ok_or(PruneError::LatentAttention)?.head_dim;
        let outputs = calibration.site(i, Site::AttentionOutput).abs_mean();
        heads.push(outputs.chunks(k).map(|head| head.iter().sum()).collect());
        ffn.push(calibration.site(i, Site::MlpHidden).abs_mean());
        for site in [Site::AttentionInput, Site::MlpInput] {
            for (e, m) in embedding.iter_mut().zip(calibration.site(i, site).abs_mean()) {
                *e += m;
            }
        }
    }
    let loss = |model: &Llama| -> Result<f64, PruneError> {
        let mut total = 0.0;
        for w in batches {
            let s = w.dims()[1] - 1;
            let loss = model.forward_loss(w.clone().narrow(1, 0, s), w.clone().narrow(1, 1, s))?;
            total += loss.cast(DType::F32).into_scalar::<f64>();
        }
        Ok(total / batches.len() as f64)
    };
    let whole = loss(model)?;
    let mut blocks = Vec::with_capacity(model.layers.len());
    for i in 0..model.layers.len() {
        let mut without = model.clone();
        without.layers.remove(i);
        blocks.push(loss(&without)? - whole);
    }
    Ok(Importance {
        heads,
        ffn,
        embedding,
        blocks,
    })
}

/// The indices of the `keep` largest of `scores` (ties to the lower index), in ascending order.
pub fn top(scores: &[f32], keep: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    let mut kept: Vec<usize> = order.into_iter().take(keep).collect();
    kept.sort_unstable();
    kept
}

#[cfg(test)]
mod tests {
    use super::top;

    #[test]
    fn top_keeps_the_largest_in_order() {
        assert_eq!(top(&[0.1, 3.0, 2.0, 3.0, -1.0], 3), vec![1, 2, 3]);
        assert_eq!(top(&[1.0, 1.0, 1.0], 2), vec![0, 1], "ties to the lower index");
        assert_eq!(top(&[5.0], 0), Vec::<usize>::new());
    }
}
