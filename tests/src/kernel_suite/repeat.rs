//! What the flash kernels repeat bit for bit, and what they cannot.

use burn::tensor::{DType, Distribution, Tensor};
use burn_megatron_kernels::attention::attention;

use super::relative_error;
use crate::Harness;

/// The tensor's values as f32 bits (bf16 widens exactly).
fn bits(t: Tensor<4>) -> Vec<u32> {
    t.cast(DType::F32)
        .into_data()
        .try_to_vec::<f32>()
        .expect("f32 values")
        .into_iter()
        .map(f32::to_bits)
        .collect()
}

/// Flash attention's forward, dK and dV twice on the same inputs are equal bit for bit (each is
/// one block's own sums); dQ is the sum of every key block's share, which the blocks add into its
/// f32 sums in the order they finish: the two may differ by that order's rounding only.
pub fn flash_repeats(h: &Harness) {
    let device = h.device(0).autodiff();
    // Sixteen key blocks add into each late query row's dQ.
    let (b, heads, s, d) = (2, 4, 2048, 128);
    let input = || Tensor::<4>::random([b, heads, s, d], Distribution::Normal(0.0, 1.0), (&device, DType::BF16));
    let (q, k, v) = (input(), input(), input());
    let weights = Tensor::<4>::random([b, heads, s, d], Distribution::Normal(0.0, 1.0), (&device, DType::F32));
    let run = || {
        let leaf = |t: &Tensor<4>| t.clone().detach().require_grad();
        let (q, k, v) = (leaf(&q), leaf(&k), leaf(&v));
        let out = attention(q.clone(), k.clone(), v.clone(), true);
        let grads = (out.clone().cast(DType::F32) * weights.clone()).sum().backward();
        let grad = |t: &Tensor<4>| t.grad(&grads).expect("a gradient");
        (out.inner(), grad(&q), grad(&k), grad(&v))
    };
    let (first, second) = (run(), run());
    assert!(bits(first.0.clone()) == bits(second.0.clone()), "the outputs differ");
    assert!(bits(first.2.clone()) == bits(second.2.clone()), "dK differs");
    assert!(bits(first.3.clone()) == bits(second.3.clone()), "dV differs");
    let (a, b) = (bits(first.1.clone()), bits(second.1.clone()));
    let differing = a.iter().zip(&b).filter(|(x, y)| x != y).count();
    let error = relative_error(first.1, second.1);
    println!(
        "flash_repeats: dQ differs in {differing} of {} values (relative {error:e})",
        a.len()
    );
    // f32 sums added in another order, rounded to bf16: an element moves by at most a bf16 step
    // (2⁻⁸ relative) where its sum crosses a rounding boundary; a lost or doubled share is of
    // order 1.
    assert!(error < 4e-3, "dQ relative difference {error}");
}
