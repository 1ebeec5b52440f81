//! One decoding step's attention against a KV cache as a backend extension, [`DecodeOps`]: the
//! new token's key and value written into the cache at a position read from the device, and
//! the query's attention over the cache up to it. On CUDA two kernels (one append a cache, one
//! attention for all heads) replace the thirty-odd tensor ops of the general cached forward;
//! elsewhere the tensor-op twin, [`reference`]. No shape and no launch argument depends on the
//! position, so a decoding step can be captured into a CUDA graph once and replayed with only
//! the position tensor rewritten (`crate::cuda::graph`).
//!
//! Legend: `b` batch, `h`/`g` query/kv heads, `c` cache capacity, `k` head_dim. `position` is a
//! `[1]` f32 tensor (the slot the new token takes, the same in every row), `first` a `[b]` f32
//! tensor (each row's first key that is not padding). Positions are whole numbers below 2²⁴,
//! exact in f32, as the project's index tensors are (`crate::cross_entropy`'s targets).

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, AutodiffBackend, Backend, Flex};
use burn::tensor::Tensor;

#[cfg(feature = "cuda")]
pub(crate) mod kernel;
pub mod reference;

extension! {
    /// The backend extension behind [`cache_append`] and [`decode_attention`].
    pub trait DecodeOps, cuda: kernel;

    /// `cache` `[b, g, c, k]` with `new` `[b, g·k]` (one token's heads side by side, as a
    /// projection leaves them) written at `position`, each head rotated by the `[≥ c, k/2]` f32
    /// RoPE tables first when `rotate`. In place where the cache's buffer is not shared.
    fn cache_append(
        cache: FloatTensor<Self>,
        new: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        position: FloatTensor<Self>,
        rotate: bool,
    ) -> FloatTensor<Self> {
        reference::cache_append(flex(cache), flex(new), flex(cos), flex(sin), flex(position), rotate)
            .try_into_primitive::<Self>()
            .expect("flex")
    }

    /// Each row's query `q` `[b, h·k]`, rotated for `position`, attending to the cached
    /// `keys`/`values` `[b, g, c, k]` at positions `first[row]..=position` (query head `i` reads
    /// kv head `i / (h/g)`, Hugging Face's order), scores scaled by `1/√k`, softmax in f32:
    /// `[b, h·k]` in `q`'s dtype.
    fn decode_attention(
        q: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        position: FloatTensor<Self>,
        first: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        reference::decode_attention(
            flex(q),
            flex(keys),
            flex(values),
            flex(cos),
            flex(sin),
            flex(position),
            flex(first),
        )
        .try_into_primitive::<Self>()
        .expect("flex")
    }

    /// Each row's greedy choice among the first `vocab` columns of `logits` `[b, ≥ vocab]`:
    /// the first of equal maxima, as `[b, 1]` f32 ids.
    fn greedy(logits: FloatTensor<Self>, vocab: usize) -> FloatTensor<Self> {
        reference::greedy(flex(logits), vocab)
            .try_into_primitive::<Self>()
            .expect("flex")
    }
}

fn flex<const D: usize>(t: FloatTensor<Flex>) -> Tensor<D> {
    Tensor::from_primitive::<Flex>(t)
}

/// Decoding is inference: on an autodiff device the ops run on the inner backend and their
/// outputs are constants.
impl<B: Backend + DecodeOps, C: CheckpointStrategy> DecodeOps for Autodiff<B, C> {
    fn cache_append(
        cache: FloatTensor<Self>,
        new: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        position: FloatTensor<Self>,
        rotate: bool,
    ) -> FloatTensor<Self> {
        let inner = |t: FloatTensor<Self>| t.into_parts().0;
        let out = B::cache_append(
            inner(cache),
            inner(new),
            inner(cos),
            inner(sin),
            inner(position),
            rotate,
        );
        <Self as AutodiffBackend>::from_inner(out)
    }

    fn decode_attention(
        q: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        position: FloatTensor<Self>,
        first: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let inner = |t: FloatTensor<Self>| t.into_parts().0;
        let out = B::decode_attention(
            inner(q),
            inner(keys),
            inner(values),
            inner(cos),
            inner(sin),
            inner(position),
            inner(first),
        );
        <Self as AutodiffBackend>::from_inner(out)
    }

    fn greedy(logits: FloatTensor<Self>, vocab: usize) -> FloatTensor<Self> {
        <Self as AutodiffBackend>::from_inner(B::greedy(logits.into_parts().0, vocab))
    }
}

/// `values` as the `[n]` f32 tensor the ops take for positions.
pub fn positions(values: &[usize], device: &burn::tensor::Device) -> Tensor<1> {
    let values: Vec<f32> = values.iter().map(|&v| v as f32).collect();
    let n = values.len();
    Tensor::from_data(burn::tensor::TensorData::new(values, [n]), device)
}

/// `cache` with one token's heads `new` written at `position` through [`DecodeOps`], rotated
/// by the RoPE tables `(cos, sin)` first when `rotate` (keys are, values are not).
///
/// # Shapes
/// `[b, g, c, k]`, `[b, g·k]`, `[≥ c, k/2]` × 2, `[1]` → `[b, g, c, k]`
pub fn cache_append(
    cache: Tensor<4>,
    new: Tensor<2>,
    (cos, sin): (Tensor<2>, Tensor<2>),
    position: Tensor<1>,
    rotate: bool,
) -> Tensor<4> {
    Tensor::from_dispatch(<burn::backend::Dispatch as DecodeOps>::cache_append(
        cache.into_dispatch(),
        new.into_dispatch(),
        cos.into_dispatch(),
        sin.into_dispatch(),
        position.into_dispatch(),
        rotate,
    ))
}

/// One query a row attending to the cache through [`DecodeOps`] (see
/// [`DecodeOps::decode_attention`]).
///
/// # Shapes
/// `[b, h·k]`, `[b, g, c, k]` × 2, `[≥ c, k/2]` × 2, `[1]`, `[b]` → `[b, h·k]`
pub fn decode_attention(
    q: Tensor<2>,
    keys: Tensor<4>,
    values: Tensor<4>,
    (cos, sin): (Tensor<2>, Tensor<2>),
    position: Tensor<1>,
    first: Tensor<1>,
) -> Tensor<2> {
    Tensor::from_dispatch(<burn::backend::Dispatch as DecodeOps>::decode_attention(
        q.into_dispatch(),
        keys.into_dispatch(),
        values.into_dispatch(),
        cos.into_dispatch(),
        sin.into_dispatch(),
        position.into_dispatch(),
        first.into_dispatch(),
    ))
}

/// Each row's greedy token among the first `vocab` columns through [`DecodeOps`]: the first of
/// equal maxima.
///
/// # Shapes
/// `[b, ≥ vocab]` → `[b, 1]` f32 ids
pub fn greedy(logits: Tensor<2>, vocab: usize) -> Tensor<2> {
    Tensor::from_dispatch(<burn::backend::Dispatch as DecodeOps>::greedy(
        logits.into_dispatch(),
        vocab,
    ))
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, Tensor, TensorData};

    /// The greedy choice is the first of equal maxima among the first `vocab` columns.
    #[test]
    fn greedy_takes_the_first_of_equals() {
        let device = Device::flex();
        let logits = Tensor::<2>::from_data(
            TensorData::new(vec![1.0f32, 3.0, 3.0, 9.0, 0.0, 0.0, 0.0, 0.0], [2, 4]),
            &device,
        );
        let ids: Vec<f32> = super::greedy(logits, 3).into_data().try_to_vec().expect("f32");
        assert_eq!(ids, vec![1.0, 0.0]);
    }
}
