//! Flash attention inside packed documents against Burn's attention with the same mask spelled
//! out.

use burn::tensor::module::attention as burn_attention;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{Bool, DType, Distribution, Int, Tensor, TensorData};
use burn_megatron_kernels::attention::document_attention;

use super::{assert_grads_close, f32_leaf, relative_error};
use crate::Harness;

/// `document_attention` in bf16 (the flash kernels, the layer's `[b, s, h, d]` storage seen as
/// `[b, h, s, d]`) against Burn's attention in f32 with the mask written out (a key is hidden
/// after its query or before the query's document), differentiated by autodiff: the output
/// and the gradients of q, k and v. Documents end inside tiles, on a tile's edge, after one
/// token, and one fills a row alone; a head dim of 64 runs zero-padded to 128.
pub fn flash_documents(h: &Harness) {
    let device = h.device(0).autodiff();
    let cases: [(usize, usize, &[&[usize]]); 3] = [
        (2, 128, &[&[100, 1, 156], &[257]]),
        (3, 128, &[&[128, 64, 64], &[5, 200, 3, 48], &[256]]),
        (2, 64, &[&[70, 30], &[1, 99]]),
    ];
    for (heads, d, lengths) in cases {
        let s: usize = lengths[0].iter().sum();
        let b = lengths.len();
        // Each position's document's first index, row by row.
        let starts: Vec<i64> = lengths
            .iter()
            .flat_map(|docs| {
                let mut start = 0;
                docs.iter().flat_map(move |&len| {
                    let first = start;
                    start += len;
                    std::iter::repeat_n(first as i64, len)
                })
            })
            .collect();
        let hidden: Vec<bool> = (0..b * s * s)
            .map(|at| {
                let (row, query, key) = (at / (s * s), at / s % s, at % s);
                key > query || (key as i64) < starts[row * s + query]
            })
            .collect();
        let mask =
            Tensor::<4, Bool>::from_data(TensorData::new(hidden, [b, 1, s, s]), &device).expand([b, heads, s, s]);
        let starts = Tensor::<2, Int>::from_data(TensorData::new(starts, [b, s]), &device);
        let input = || {
            Tensor::<4>::random([b, s, heads, d], Distribution::Normal(0.0, 1.0), (&device, DType::BF16))
                .swap_dims(1, 2)
                .detach()
                .require_grad()
        };
        let (q, k, v) = (input(), input(), input());
        let out = document_attention(q.clone(), k.clone(), v.clone(), starts);
        let (q32, k32, v32) = (f32_leaf(&q), f32_leaf(&k), f32_leaf(&v));
        let options = AttentionModuleOptions {
            scale: None,
            softcap: None,
            is_causal: false,
        };
        let expected = burn_attention(q32.clone(), k32.clone(), v32.clone(), Some(mask), None, options);
        let case = format!("heads {heads} d {d} documents {lengths:?}");
        // As `flash_attention`: bf16 probabilities and output, a few 1e-3 in norm; a key let
        // through or hidden wrongly is of order 1.
        let error = relative_error(out.clone(), expected.clone());
        assert!(error < 2e-2, "{case}: output relative error {error}");
        // dS and dP rounded to bf16 before their products too: 4e-2, as `flash_attention`.
        assert_grads_close(&case, out, expected, [(&q, &q32), (&k, &k32), (&v, &v32)], 4e-2);
    }
}
