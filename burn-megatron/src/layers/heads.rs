//! Attention's heads shared by grouped-query attention: each kv head read by a group of query
//! heads.

use burn::tensor::Tensor;

/// Each of `x`'s kv heads `repeat` times in a row: query head `h` reads kv head `h / repeat`.
///
/// # Shapes
/// `[b, g, s, k]` → `[b, g·repeat, s, k]`
pub(crate) fn repeat_heads(x: Tensor<4>, repeat: usize) -> Tensor<4> {
    if repeat == 1 {
        return x;
    }
    let [b, g, s, k] = x.dims();
    x.unsqueeze_dim::<5>(2)
        .repeat_dim(2, repeat)
        .reshape([b, g * repeat, s, k])
}
