//! `bench --attention`: our flash attention's forward and backward alone on the llama presets'
//! shapes (causal, bf16, head dim 128, q/k/v as the layer passes them: `[b, h, s, d]` views of
//! `[b, s, h, d]` memory), one `ATTENTION {…}` line each; `peers/attention.py` prints the same
//! lines for PyTorch's scaled-dot-product attention backends.

use std::time::Instant;

use burn::tensor::{DType, Device, Distribution, Tensor};
use burn_megatron_kernels::attention::{attention_grads, attention_parts};

/// `(name, batch, heads, seq)`: llama-1b, llama-8b's heads at tp = 2, and llama-1b-32k's.
pub const SHAPES: [(&str, usize, usize, usize); 3] =
    [("1b", 4, 16, 2048), ("8b.tp2", 1, 16, 4096), ("1b.32k", 1, 16, 32768)];
const HEAD_DIM: usize = 128;

pub fn run(device: &Device, iters: usize) {
    for (name, b, h, s) in SHAPES {
        let input = || {
            Tensor::<4>::random(
                [b, s, h, HEAD_DIM],
                Distribution::Normal(0.0, 1.0),
                (device, DType::BF16),
            )
            .swap_dims(1, 2)
        };
        let (q, k, v, grad) = (input(), input(), input(), input());
        let scale = (HEAD_DIM as f32).sqrt().recip();
        let forward = || attention_parts(q.clone(), k.clone(), v.clone(), true, scale);
        let (out, lse) = forward();
        let backward = || {
            attention_grads(
                q.clone(),
                k.clone(),
                v.clone(),
                out.clone(),
                lse.clone(),
                grad.clone(),
                true,
                scale,
            )
        };
        let time = |f: &dyn Fn()| {
            f();
            device.sync().expect("sync");
            let start = Instant::now();
            for _ in 0..iters {
                f();
            }
            device.sync().expect("sync");
            start.elapsed().as_secs_f64() / iters as f64
        };
        let forward_s = time(&|| drop(forward()));
        let backward_s = time(&|| drop(backward()));
        // Causal: half of the 4·b·h·s²·d of the two forward products; the backward's five are 2.5×.
        let flops = 2.0 * (b * h * s * s * HEAD_DIM) as f64;
        println!(
            "ATTENTION {{\"shape\": \"{name}\", \"b\": {b}, \"h\": {h}, \"s\": {s}, \"kernel\": \"ours\", \"forward_us\": {:.1}, \"forward_tflops\": {:.1}, \"backward_us\": {:.1}, \"backward_tflops\": {:.1}}}",
            forward_s * 1e6,
            flops / forward_s / 1e12,
            backward_s * 1e6,
            2.5 * flops / backward_s / 1e12
        );
    }
}
