//! Greedy samples from the model while it trains: every rank of a tensor-parallel group runs
//! the forward pass (its layers are collectives), rank 0 prints.

use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_megatron::models::llama::Llama;
use burn_megatron_dist::ProcessGroups;

/// Continues `prompt` greedily for `new` tokens.
///
/// The model reads a window of `seq` tokens ending at the last one, padded on the left with
/// `pad` (the corpus's line separator), so the length always suits sequence parallelism.
pub fn greedy(
    model: &Llama,
    groups: &ProcessGroups,
    prompt: &[u32],
    pad: u32,
    new: usize,
    seq: usize,
    device: &Device,
) -> Result<Vec<u32>, String> {
    let vocab = model.embedding.vocab_size;
    let mut tokens = prompt.to_vec();
    for _ in 0..new {
        let start = tokens.len().saturating_sub(seq);
        let mut window = vec![pad as i64; seq - (tokens.len() - start)];
        window.extend(tokens[start..].iter().map(|&t| t as i64));
        let ids = Tensor::<2, Int>::from_data(TensorData::new(window, [1, seq]), device);
        let logits = model.forward(ids).map_err(|e| e.to_string())?; // [1, seq, v/tp]
        let [_, _, columns] = logits.dims();
        let last = logits.narrow(1, seq - 1, 1).reshape([1, columns]).detach();
        let all = groups.tp.all_gather(last, 1).map_err(|e| e.to_string())?; // [1, v], padded
        let next = all.narrow(1, 0, vocab).argmax(1).into_scalar::<i64>();
        tokens.push(next as u32);
    }
    Ok(tokens[prompt.len()..].to_vec())
}
