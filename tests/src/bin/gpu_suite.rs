//! Runs the parity and kernel suites on CUDA devices, outside `cargo test` (a GPU host needs no
//! Rust): every test `burn_megatron_tests::gpu::gpu_tests` lists, under each of its numerics.
//!
//!   gpu-suite [--world N] [--filter TEXT] [--skip TEXT]   ranks as threads, one GPU each (NCCL among threads)
//!   gpu-suite --one-gpu [--world N] …            ranks as threads all on GPU 0, data between them
//!                                                through host memory: the numerics on a one-GPU machine
//!   torchrun --no-python --nproc-per-node N gpu-suite   one process a GPU (the tests that allow it)
//!
//! Prints one line per test and closes with `N passed, M failed`; exits non-zero on a failure.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::Instant;

use burn::tensor::DType;
use burn_megatron_tests::Harness;
use burn_megatron_tests::gpu::{Numerics, Ranks, gpu_tests};
use clap::Parser;

/// The parity and kernel suites on CUDA devices.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// Ranks as threads (one GPU each, or all on GPU 0 with `--one-gpu`); torchrun's
    /// `WORLD_SIZE` when it sets one.
    #[arg(long, env = "WORLD_SIZE", default_value_t = 2)]
    world: usize,
    /// Every rank on GPU 0, data between ranks through host memory: the numerics on a one-GPU
    /// machine.
    #[arg(long)]
    one_gpu: bool,
    /// Only the tests whose name (`suite::test`) contains this.
    #[arg(long)]
    filter: Option<String>,
    /// None of the tests whose name contains this.
    #[arg(long)]
    skip: Option<String>,
    /// Only the tests under these numerics (several allowed).
    #[arg(long, value_enum)]
    numerics: Vec<NumericsArg>,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum NumericsArg {
    Exact,
    F32,
    Bf16,
}

impl NumericsArg {
    fn of(self) -> Numerics {
        match self {
            NumericsArg::Exact => Numerics::Exact,
            NumericsArg::F32 => Numerics::F32,
            NumericsArg::Bf16 => Numerics::Bf16,
        }
    }
}

fn main() {
    let args = Args::parse();
    let world = args.world;
    let rank = std::env::var("RANK").ok();
    let mode = match (&rank, args.one_gpu) {
        (Some(r), _) => format!("processes(rank {r})"),
        (None, true) => "threads-one-gpu".to_string(),
        (None, false) => "threads".to_string(),
    };
    let place = |h: Harness| if args.one_gpu { h.on_one_gpu() } else { h };
    let harness = |numerics: Numerics| match numerics {
        // The comm suite chooses its own dtypes and checks exact answers.
        Numerics::Exact => place(Harness::cuda(world, DType::F32, 0.0, 0.0)),
        // f32, the CPU's tolerances: element-wise sums of a few terms in another order round
        // within a few ulps; products split over ranks sum their ≤ 688 terms in another order,
        // well under 1e-4. Products stay f32 (no TF32: `kernel_suite::f32_matmul` checks it).
        Numerics::F32 => place(Harness::cuda(world, DType::F32, 1e-5, 1e-4)),
        // bf16 keeps 8 bits of mantissa: each rounding costs up to 2⁻⁹ ≈ 2e-3 relative, and
        // the parallel and single-device paths round at different points (partial sums are
        // rounded before they are reduced), a few roundings deep.
        Numerics::Bf16 => place(Harness::cuda(world, DType::BF16, 3e-2, 6e-2)),
    };
    let harnesses: Vec<(Numerics, Harness)> = [Numerics::Exact, Numerics::F32, Numerics::Bf16]
        .map(|n| (n, harness(n)))
        .into();
    let wanted = |n: Numerics| args.numerics.is_empty() || args.numerics.iter().any(|a| a.of() == n);
    let selected = gpu_tests().into_iter().filter(|t| {
        let named = args.filter.as_ref().is_none_or(|f| t.name.contains(f.as_str()));
        let kept = args.skip.as_ref().is_none_or(|s| !t.name.contains(s.as_str()));
        // Under torchrun the world has one size: tests launching their own layouts stay out.
        named && kept && (rank.is_none() || t.ranks == Ranks::Any)
    });
    let (mut passed, mut failed) = (0, 0);
    for test in selected {
        for &numerics in test.numerics.iter().filter(|&&n| wanted(n)) {
            let h = &harnesses
                .iter()
                .find(|(n, _)| *n == numerics)
                .expect("a harness each")
                .1;
            let (tag, name) = (numerics.tag(), test.name);
            let start = Instant::now();
            let outcome = catch_unwind(AssertUnwindSafe(|| (test.run)(h)));
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
    }
    println!("{passed} passed, {failed} failed");
    std::process::exit(if failed == 0 { 0 } else { 1 });
}
