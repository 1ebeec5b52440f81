//! The tensor-op twin: the CPU path and the kernel's oracle.

use burn::tensor::{IndexingUpdateOp, Int, Tensor};

pub fn top_k(scores: Tensor<2>, k: usize) -> Tensor<2, Int> {
    let mut scores = scores;
    let mut picks = Vec::with_capacity(k);
    for _ in 0..k {
        let best = scores.clone().argmax(1); // [t, 1], the first of equal maxima
        scores = scores.scatter(
            1,
            best.clone(),
            Tensor::full(best.dims(), f32::NEG_INFINITY, &best.device()),
            IndexingUpdateOp::Assign,
        );
        picks.push(best);
    }
    Tensor::cat(picks, 1)
}
