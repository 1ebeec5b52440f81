//! Causal attention inside documents, for sequences that pack several documents end to end
//! (packed SFT): each query sees the keys of its own document up to itself. Through
//! [`AttentionOps`]' document ops, whose backward keeps q, k, v, the output and `lse₂` only (as
//! the causal op's does). On CUDA the flash kernels take the mask (bf16, head dim ≤ 128: each
//! query's document's first key beside the causal diagonal); elsewhere the f32 reference
//! ([`super::reference::Mask::Documents`]), whose `[b, h, s, s]` scores live one layer at a
//! time, in its forward and again in its backward.
//!
//! Legend: `b` batch, `h` heads, `s` sequence, `d` head dim.

use burn::tensor::{Int, Tensor};

use super::AttentionOps;

/// Causal attention inside documents, `softmax(q·kᵀ / √d, masked) · v`, through
/// [`AttentionOps`]: query `i` of row `b` sees keys `starts[b, i] ..= i`. Differentiable.
///
/// # Shapes
/// `[b, h, s, d]` × 3, `[b, s]` → `[b, h, s, d]`
pub fn document_attention(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, starts: Tensor<2, Int>) -> Tensor<4> {
    let scale = (q.dims()[3] as f32).sqrt().recip();
    let (out, _) = <burn::backend::Dispatch as AttentionOps>::document_attention_forward(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        starts.into_dispatch(),
        scale,
    );
    Tensor::from_dispatch(out)
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, Distribution, Int, Tensor, TensorData, Tolerance};

    use super::document_attention;
    use crate::attention::attention;

    /// Two documents packed in one row (5 and 3 tokens) give each document's own causal
    /// attention, run alone; the gradients of q, k and v too. A row holding one document is
    /// plain causal attention.
    #[test]
    fn packed_documents_attend_as_if_alone() {
        let device = Device::flex().autodiff();
        let input = || Tensor::<4>::random([2, 3, 8, 16], Distribution::Normal(0.0, 1.0), &device).require_grad();
        let (q, k, v) = (input(), input(), input());
        let starts = Tensor::<2, Int>::from_data(
            TensorData::new(vec![0i64, 0, 0, 0, 0, 5, 5, 5, 0, 0, 0, 0, 0, 0, 0, 0], [2, 8]),
            &device,
        );
        let packed = document_attention(q.clone(), k.clone(), v.clone(), starts);
        let part =
            |t: &Tensor<4>, row: usize, from: usize, len: usize| t.clone().narrow(0, row, 1).narrow(2, from, len);
        let alone = |row, from, len| {
            attention(
                part(&q, row, from, len),
                part(&k, row, from, len),
                part(&v, row, from, len),
                true,
            )
        };
        let expected = Tensor::cat(
            vec![Tensor::cat(vec![alone(0, 0, 5), alone(0, 5, 3)], 2), alone(1, 0, 8)],
            0,
        );
        // The same f32 arithmetic over the same keys (masked keys add exp(-inf) = 0): ulps.
        let tolerance = Tolerance::absolute(1e-5);
        packed.to_data().assert_approx_eq::<f32>(&expected.to_data(), tolerance);
        let weights = Tensor::<4>::random([2, 3, 8, 16], Distribution::Normal(0.0, 1.0), &device);
        let (ours, theirs) = (
            (packed * weights.clone()).sum().backward(),
            (expected * weights).sum().backward(),
        );
        for x in [&q, &k, &v] {
            let (a, e) = (x.grad(&ours).unwrap(), x.grad(&theirs).unwrap());
            a.to_data().assert_approx_eq::<f32>(&e.to_data(), tolerance);
        }
    }
}
