//! Runs the communicator and mapping suites on CUDA devices, outside `cargo test` (the device
//! machine has no Rust).
//!
//!   gpu-suite [--world N] [--filter TEXT] [--skip TEXT]   ranks as threads, one GPU each (NCCL among threads)
//!   gpu-suite --one-gpu [--world N] …            ranks as threads all on GPU 0, data between them
//!                                                through host memory: the numerics on a one-GPU machine
//!   torchrun --nproc-per-node N gpu-suite        one process a GPU (NCCL transport; no DP model tests)
//!
//! Prints one line per test and closes with `N passed, M failed`; exits non-zero on a failure.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::Instant;

use burn::tensor::DType;
use burn_megatron_tests::{
    COMM_TESTS, CONTEXT_TESTS, CUDA_DP_MODEL_TESTS, DECODE_TESTS, DP_MODEL_TESTS, HF_TESTS, Harness, KERNEL_TESTS,
    LAYER_TESTS, MAPPING_TESTS, MODEL_TESTS, MOE_LAYER_TESTS, MOE_TESTS, NamedTest, PIPELINE_TESTS,
};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let world = match args.iter().position(|a| a == "--world") {
        Some(i) => args[i + 1].parse().expect("--world N"),
        None => std::env::var("WORLD_SIZE")
            .ok()
            .and_then(|w| w.parse().ok())
            .unwrap_or(2),
    };
    // `--filter TEXT` runs only the tests whose name contains TEXT, `--skip TEXT` all others.
    let option = |flag: &str| args.iter().position(|a| a == flag).map(|i| args[i + 1].clone());
    let (filter, skip) = (option("--filter"), option("--skip"));
    let rank = std::env::var("RANK").ok();
    let one_gpu = args.iter().any(|a| a == "--one-gpu");
    let mode = match (&rank, one_gpu) {
        (Some(r), _) => format!("processes(rank {r})"),
        (None, true) => "threads-one-gpu".to_string(),
        (None, false) => "threads".to_string(),
    };
    let place = |h: Harness| if one_gpu { h.on_one_gpu() } else { h };
    // The comm suite chooses its own dtypes and checks exact answers.
    let comm = place(Harness::cuda(world, DType::F32, 0.0, 0.0));
    // f32, the CPU's tolerances: element-wise sums of a few terms in another order round within
    // a few ulps; products split over ranks sum their ≤ 688 terms in another order, well under
    // 1e-4. Products stay f32 (no TF32: `kernel_suite::f32_matmul` checks it).
    let f32 = place(Harness::cuda(world, DType::F32, 1e-5, 1e-4));
    // bf16 keeps 8 bits of mantissa: each rounding costs up to 2⁻⁹ ≈ 2e-3 relative, and the
    // parallel and single-device paths round at different points (partial sums are rounded
    // before they are reduced), a few roundings deep.
    let bf16 = place(Harness::cuda(world, DType::BF16, 3e-2, 6e-2));
    let model_f32: &[NamedTest] = MODEL_TESTS;
    let model_bf16: &[NamedTest] = &MODEL_TESTS[..1];
    let dp_model: &[NamedTest] = if rank.is_none() { DP_MODEL_TESTS } else { &[] };
    let cuda_dp_model: &[NamedTest] = if rank.is_none() { CUDA_DP_MODEL_TESTS } else { &[] };
    let moe_f32: &[NamedTest] = if rank.is_none() { MOE_TESTS } else { &[] };
    let moe_bf16: &[NamedTest] = if rank.is_none() {
        &MOE_TESTS[..MOE_LAYER_TESTS]
    } else {
        &[]
    };
    let pipeline: &[NamedTest] = if rank.is_none() { PIPELINE_TESTS } else { &[] };
    let context: &[NamedTest] = if rank.is_none() { CONTEXT_TESTS } else { &[] };
    let decode: &[NamedTest] = if rank.is_none() { DECODE_TESTS } else { &[] };
    let hf: &[NamedTest] = if rank.is_none() { HF_TESTS } else { &[] };
    // The attention test in bf16 with heads of 128: the flash kernels, block by block.
    let context_bf16: &[NamedTest] = &context[..context.len().min(1)];
    // Recomputation in bf16 too: flash attention and the fused kernels run inside its regions.
    let recompute_bf16: &[NamedTest] = &pipeline[pipeline.len().saturating_sub(1)..];
    let runs: Vec<(&str, &Harness, &NamedTest)> = COMM_TESTS
        .iter()
        .map(|t| ("", &comm, t))
        .chain(KERNEL_TESTS.iter().map(|t| ("", &bf16, t)))
        .chain(MAPPING_TESTS.iter().map(|t| ("f32 ", &f32, t)))
        .chain(MAPPING_TESTS.iter().map(|t| ("bf16 ", &bf16, t)))
        .chain(LAYER_TESTS.iter().map(|t| ("f32 ", &f32, t)))
        .chain(LAYER_TESTS.iter().map(|t| ("bf16 ", &bf16, t)))
        .chain(model_f32.iter().map(|t| ("f32 ", &f32, t)))
        // 20 AdamW steps in bf16 drift apart by more than a meaningful tolerance: f32 only.
        .chain(model_bf16.iter().map(|t| ("bf16 ", &bf16, t)))
        .chain(dp_model.iter().map(|t| ("f32 ", &f32, t)))
        .chain(cuda_dp_model.iter().map(|t| ("f32 ", &f32, t)))
        .chain(moe_f32.iter().map(|t| ("f32 ", &f32, t)))
        // The layer in bf16; 20 steps drift as the dense model's do: f32 only.
        .chain(moe_bf16.iter().map(|t| ("bf16 ", &bf16, t)))
        .chain(pipeline.iter().map(|t| ("f32 ", &f32, t)))
        .chain(recompute_bf16.iter().map(|t| ("bf16 ", &bf16, t)))
        .chain(context.iter().map(|t| ("f32 ", &f32, t)))
        .chain(context_bf16.iter().map(|t| ("bf16 ", &bf16, t)))
        .chain(decode.iter().map(|t| ("f32 ", &f32, t)))
        .chain(decode.iter().map(|t| ("bf16 ", &bf16, t)))
        // Against transformers' f32 numbers: f32 only.
        .chain(hf.iter().map(|t| ("f32 ", &f32, t)))
        .filter(|(_, _, (name, _))| filter.as_ref().is_none_or(|f| name.contains(f.as_str())))
        .filter(|(_, _, (name, _))| skip.as_ref().is_none_or(|s| !name.contains(s.as_str())))
        .collect();
    let (mut passed, mut failed) = (0, 0);
    for (tag, harness, (name, test)) in runs {
        let start = Instant::now();
        let outcome = catch_unwind(AssertUnwindSafe(|| test(harness)));
        let ms = start.elapsed().as_millis();
        match outcome {
            Ok(()) => {
                passed += 1;
                println!("test {mode} {tag}{name} ... ok ({ms} ms)");
            }
            Err(panic) => {
                failed += 1;
                let message = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                println!("test {mode} {tag}{name} ... FAILED ({ms} ms): {message}");
            }
        }
    }
    println!("{passed} passed, {failed} failed");
    std::process::exit(if failed == 0 { 0 } else { 1 });
}
