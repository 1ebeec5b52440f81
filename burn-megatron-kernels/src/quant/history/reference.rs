//! The ops in tensor ops, on any backend.

use super::*;

pub fn push(history: Tensor<2>, rows: [Tensor<1>; 3]) -> Tensor<2> {
    let len = history.dims()[1];
    let front = Tensor::cat(rows.map(|r| r.reshape([1, 1]).cast(history.dtype())).to_vec(), 0);
    match len {
        1 => front,
        _ => Tensor::cat(vec![front, history.narrow(1, 0, len - 1)], 1),
    }
}

pub fn kept(history: Tensor<2>, most_recent: bool) -> Tensor<1> {
    match most_recent {
        true => history.narrow(1, 0, 1).reshape([-1]),
        false => history.max_dim(1).reshape([-1]),
    }
}
