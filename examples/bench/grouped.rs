//! `bench --grouped`: the MoE grouped product on moe-4b's shapes (32 experts, d 2048, ffn 1408,
//! 8192 tokens × top 4 = 32768 rows over uneven groups), forward, dgrad and wgrad, bf16, one
//! `GROUPED {…}` line each; `peers/grouped_gemm.py` prints the same lines for `torch._grouped_mm`
//! on the same group sizes. Each result is checked against one Burn product a group in f32
//! first (`rel_error`). The kernel takes groups that start at whole 128-row tiles (as the MoE
//! dispatch lays them out); the uneven sizes run the forward through `grouped_matmul`, which
//! pads them into tiles with row gathers first.

use std::time::Instant;

use burn::backend::Cube;
use burn::tensor::{DType, Device, Distribution, Tensor};
use burn::tensor::{Int, TensorData};
use burn_megatron_kernels::grouped_gemm::{GroupedOps, Groups, grouped_matmul};

/// moe-4b's experts and rows.
const EXPERTS: usize = 32;
const ROWS: usize = 8192 * 4;

/// `(name, k, n)`: the gate and up projections `d → ffn`, the down projection `ffn → d`.
const SHAPES: [(&str, usize, usize); 2] = [("moe4b.w13", 2048, 1408), ("moe4b.w2", 1408, 2048)];

/// Uneven group sizes adding up to `ROWS`: weights `exp(z)`, `z` spread over ±1.5 by a fixed
/// hash, one expert empty (what a router's imbalance looks like early in training).
pub fn group_sizes() -> Vec<usize> {
    let weights: Vec<f64> = (0..EXPERTS as u64)
        .map(|g| match g {
            7 => 0.0,
            _ => {
                let h = (g.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40) as f64 / (1u64 << 24) as f64;
                (3.0 * h - 1.5).exp()
            }
        })
        .collect();
    let total: f64 = weights.iter().sum();
    let mut sizes: Vec<usize> = weights.iter().map(|w| (w / total * ROWS as f64) as usize).collect();
    let short = ROWS - sizes.iter().sum::<usize>();
    sizes[0] += short;
    sizes
}

fn relative_error(out: Tensor<2>, reference: Tensor<2>) -> f32 {
    let (out, reference) = (out.cast(DType::F32), reference.cast(DType::F32));
    let norm = |t: Tensor<2>| t.square().sum().sqrt().into_scalar::<f32>();
    norm(out - reference.clone()) / norm(reference)
}

/// Rows `start..start + n` of each group, one Burn f32 product a group.
fn per_group(x: &Tensor<2>, w: &Tensor<3>, counts: &[usize], transposed: bool) -> Tensor<2> {
    let [_, k, n] = w.dims();
    let mut start = 0;
    let mut parts = Vec::new();
    for (g, &c) in counts.iter().enumerate() {
        if c > 0 {
            let w_g = w.clone().narrow(0, g, 1).reshape([k, n]).cast(DType::F32);
            let w_g = if transposed { w_g.transpose() } else { w_g };
            parts.push(x.clone().narrow(0, start, c).cast(DType::F32).matmul(w_g));
        }
        start += c;
    }
    Tensor::cat(parts, 0)
}

/// [`group_sizes`] rounded to whole 128-row tiles (the kernel pads no rows), the same total.
fn aligned_sizes() -> Vec<usize> {
    let mut sizes: Vec<usize> = group_sizes().iter().map(|&n| n / 128 * 128).collect();
    let short = ROWS - sizes.iter().sum::<usize>();
    sizes[0] += short;
    sizes
}

pub fn run(device: &Device, iters: usize) {
    println!("GROUP_SIZES {:?}", group_sizes());
    for (label, counts) in [("uneven", group_sizes()), ("tile-aligned", aligned_sizes())] {
        run_sizes(device, iters, label, counts);
    }
    // The plain wgmma GEMM on the same products as one group: what the grouping costs.
    for (name, k, n) in SHAPES {
        let normal = Distribution::Normal(0.0, 1.0);
        let x = Tensor::<2>::random([ROWS, k], normal, (device, DType::BF16));
        let w = Tensor::<2>::random([k, n], normal, (device, DType::BF16));
        let product = || {
            burn_megatron_kernels::cuda::wgmma::matmul(
                x.clone(),
                w.clone(),
                burn_megatron_kernels::cuda::wgmma::Schedule::Persistent,
            )
            .unwrap()
        };
        product();
        device.sync().unwrap();
        let start = Instant::now();
        for _ in 0..iters {
            product();
        }
        device.sync().unwrap();
        let seconds = start.elapsed().as_secs_f64() / iters as f64;
        println!(
            "GROUPED {{\"shape\": \"{name}\", \"sizes\": \"one dense product\", \"pass\": \"fwd\", \"kernel\": \"wgmma\", \"us\": {:.1}, \"tflops\": {:.1}}}",
            seconds * 1e6,
            2.0 * (ROWS * k * n) as f64 / seconds / 1e12
        );
    }
}

fn run_sizes(device: &Device, iters: usize, label: &str, counts: Vec<usize>) {
    let normal = Distribution::Normal(0.0, 1.0);
    for (name, k, n) in SHAPES {
        let x = Tensor::<2>::random([ROWS, k], normal, (device, DType::BF16));
        let dy = Tensor::<2>::random([ROWS, n], normal, (device, DType::BF16));
        let w = Tensor::<3>::random([EXPERTS, k, n], normal, (device, DType::BF16)).mul_scalar(0.05);
        let cube = |t: Tensor<2>| t.try_into_primitive::<Cube>().expect("a CUDA tensor");
        let (xp, dyp) = (cube(x.clone()), cube(dy.clone()));
        let wp = w.clone().try_into_primitive::<Cube>().expect("a CUDA tensor");
        let mut starts = vec![0i64];
        for &c in &counts {
            starts.push(starts[starts.len() - 1] + c as i64);
        }
        let starts = Tensor::<1, Int>::from_data(TensorData::new(starts, [EXPERTS + 1]), device);
        let sp = starts.try_into_primitive::<Cube>().expect("a CUDA tensor");
        let aligned = counts.iter().all(|c| c.is_multiple_of(128));
        let run_pass = |pass: &str| -> Tensor<2> {
            match pass {
                "fwd" if !aligned => grouped_matmul(x.clone(), w.clone(), &Groups::Counts(counts.clone())),
                "fwd" => Tensor::from_primitive::<Cube>(Cube::grouped_matmul(xp.clone(), wp.clone(), sp.clone())),
                "dgrad" => {
                    Tensor::from_primitive::<Cube>(Cube::grouped_matmul_dgrad(dyp.clone(), wp.clone(), sp.clone()))
                }
                _ => {
                    Tensor::<3>::from_primitive::<Cube>(Cube::grouped_matmul_wgrad(xp.clone(), dyp.clone(), sp.clone()))
                        .reshape([EXPERTS * k, n])
                }
            }
        };
        let passes: &[&str] = if aligned { &["fwd", "dgrad", "wgrad"] } else { &["fwd"] };
        for &pass in passes {
            let reference = match pass {
                "fwd" => per_group(&x, &w, &counts, false),
                "dgrad" => per_group(&dy, &w, &counts, true),
                _ => {
                    let mut start = 0;
                    let parts: Vec<Tensor<2>> = counts
                        .iter()
                        .map(|&c| {
                            let part = match c {
                                0 => Tensor::zeros([k, n], (device, DType::F32)),
                                _ => x
                                    .clone()
                                    .narrow(0, start, c)
                                    .cast(DType::F32)
                                    .transpose()
                                    .matmul(dy.clone().narrow(0, start, c).cast(DType::F32)),
                            };
                            start += c;
                            part
                        })
                        .collect();
                    Tensor::cat(parts, 0)
                }
            };
            let out = run_pass(pass);
            let error = relative_error(out, reference);
            device.sync().unwrap();
            let start = Instant::now();
            for _ in 0..iters {
                run_pass(pass);
            }
            device.sync().unwrap();
            let seconds = start.elapsed().as_secs_f64() / iters as f64;
            let flops = 2.0 * (ROWS * k * n) as f64;
            println!(
                "GROUPED {{\"shape\": \"{name}\", \"sizes\": \"{label}\", \"pass\": \"{pass}\", \"rows\": {ROWS}, \"k\": {k}, \"n\": {n}, \"experts\": {EXPERTS}, \"kernel\": \"ours\", \"us\": {:.1}, \"tflops\": {:.1}, \"rel_error\": {error:.3e}}}",
                seconds * 1e6,
                flops / seconds / 1e12
            );
        }
    }
}
