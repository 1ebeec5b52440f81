//! Runs the communicator and mapping suites on CUDA devices, outside `cargo test` (the device
//! machine has no Rust).
//!
//!   gpu-suite [--world N]                        ranks as threads, one GPU each (CubeCL transport)
//!   torchrun --nproc-per-node N gpu-suite        one process a GPU (NCCL transport)
//!
//! Prints one line per test and closes with `N passed, M failed`; exits non-zero on a failure.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::Instant;

use burn::tensor::DType;
use burn_megatron_tests::{COMM_TESTS, Harness, MAPPING_TESTS};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let world = match args.iter().position(|a| a == "--world") {
        Some(i) => args[i + 1].parse().expect("--world N"),
        None => std::env::var("WORLD_SIZE").ok().and_then(|w| w.parse().ok()).unwrap_or(2),
    };
    let rank = std::env::var("RANK").ok();
    let mode = match &rank {
        Some(r) => format!("processes(rank {r})"),
        None => "threads".to_string(),
    };
    // The comm suite chooses its own dtypes and checks exact answers.
    let comm = Harness::cuda(world, DType::F32, 0.0);
    // Element-wise products and sums of a few terms in another order than the twin: f32 rounds
    // within a few ulps (no matrix products, so no TF32).
    let f32 = Harness::cuda(world, DType::F32, 1e-5);
    // bf16 keeps 8 bits of mantissa: a sum of ≤ 8 terms rounded in another order is off by a
    // few units of 2⁻⁸ relative to the largest value.
    let bf16 = Harness::cuda(world, DType::BF16, 3e-2);
    let runs: Vec<(&str, &Harness, &(&str, fn(&Harness)))> = COMM_TESTS
        .iter()
        .map(|t| ("", &comm, t))
        .chain(MAPPING_TESTS.iter().map(|t| ("f32 ", &f32, t)))
        .chain(MAPPING_TESTS.iter().map(|t| ("bf16 ", &bf16, t)))
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
