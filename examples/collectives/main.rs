//! Collective bandwidth, one `RESULT {…}` line per operation and size, with the keys of
//! `examples/bench/peers/collectives.py` (`time_us`, `busbw_gbps`) so the two run side by side.
//!
//!   cargo run --release --example collectives --features cuda               ranks as threads
//!   cargo run --release --example collectives --features cuda -- --processes  one process a GPU
//!   cargo run --release --example collectives -- --cpu [--gpus N]            ranks as threads on
//!                                                                            the CPU
//!
//! `--processes` starts one copy of this program per GPU with torchrun's variables; a copy
//! started by torchrun itself (RANK set) runs as that rank. `--gpus N` picks how many GPUs
//! (default: 2). Sizes are 1 MiB, 16 MiB, 256 MiB and 1 GiB of bf16; `time_us` is the median of
//! 20 runs after 5 warm-ups, with the device synchronized around each run, and `pipelined_us`
//! the mean of 20 calls queued back to back between two synchronizations. The peer times one
//! call by CUDA events on its stream, which leave out the host's synchronization; CubeCL has no
//! events on its streams, so the second figure is the one that leaves out the same.
//!
//! `--cpu` runs the ranks as threads on the CPU through the in-process transport, at 8 bytes, 64
//! KiB and 1 MiB: the smallest size is what every call costs the host whatever it moves (the
//! call-record check and the data's rendezvous), the part of a GPU call's fixed cost that ranks
//! as threads pay on the host.

use std::process::Command;
use std::time::Instant;

use burn::tensor::{DType, Device, Distribution, Tensor};
use burn_megatron_dist::{ParallelDims, ProcessGroup, RankContext, ReduceOp, launch};
use clap::Parser;

/// The GPU sizes, in bytes: 1 MiB, 16 MiB, 256 MiB and 1 GiB.
const SIZES: [usize; 4] = [1 << 20, 16 << 20, 256 << 20, 1 << 30];
/// The CPU sizes: the fixed cost of a call, then 64 KiB and 1 MiB.
const CPU_SIZES: [usize; 3] = [8, 64 << 10, 1 << 20];
const WARMUP: usize = 5;
const RUNS: usize = 20;

/// Collective bandwidth over GPUs (ranks as threads, or one process a GPU), or the host's cost
/// of a call with ranks as threads on the CPU.
#[derive(Parser, Debug)]
#[command(name = "collectives")]
struct Args {
    /// Ranks (GPUs; threads with --cpu): torchrun's WORLD_SIZE when set, else 2.
    #[arg(long, value_name = "N", env = "WORLD_SIZE", default_value_t = 2, value_parser = at_least_one)]
    gpus: usize,
    /// One process a GPU, started here with torchrun's variables.
    #[arg(long, conflicts_with = "cpu")]
    processes: bool,
    /// Ranks as threads on the CPU through the in-process transport.
    #[arg(long)]
    cpu: bool,
}

/// A number of at least 1.
fn at_least_one(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("{text:?} is not a whole number of at least 1")),
    }
}

fn main() {
    let args = Args::parse();
    let gpus = args.gpus;
    if args.processes && std::env::var_os("RANK").is_none() {
        spawn_processes(gpus);
        return;
    }
    let dims = ParallelDims::tp_dp(gpus, 1);
    let run = match args.cpu {
        true => launch(dims, |_| Device::flex(), |ctx| bench(&ctx, "in-process", &CPU_SIZES)),
        false => launch(dims, gpu, |ctx| {
            let transport = match std::env::var_os("RANK") {
                Some(_) => "nccl",
                None => "cubecl",
            };
            bench(&ctx, transport, &SIZES)
        }),
    };
    run.unwrap_or_else(|e| panic!("{e}"));
}

/// Rank `i`'s GPU.
#[cfg(feature = "cuda")]
fn gpu(i: usize) -> Device {
    Device::cuda(i)
}

#[cfg(not(feature = "cuda"))]
fn gpu(_: usize) -> Device {
    eprintln!("a build without the `cuda` feature runs the collectives with --cpu only");
    std::process::exit(2);
}

/// Starts one copy of this program per GPU, as torchrun would, and waits for them.
fn spawn_processes(gpus: usize) {
    let exe = std::env::current_exe().expect("own path");
    let port = 29500 + std::process::id() % 1000;
    let children: Vec<_> = (0..gpus)
        .map(|rank| {
            Command::new(&exe)
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", gpus.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .spawn()
                .expect("start a rank")
        })
        .collect();
    for mut child in children {
        let status = child.wait().expect("wait for a rank");
        assert!(status.success(), "a rank failed: {status}");
    }
}

/// One collective to time: a call on the bench's tensors.
type Collective<'a> = Box<dyn Fn() -> Tensor<1> + 'a>;

fn bench(ctx: &RankContext, transport: &str, sizes: &[usize]) {
    let group = &ctx.groups.tp;
    let n = group.size();
    for &bytes in sizes {
        // At least one bf16 value a rank.
        let numel = (bytes / 2).max(n);
        let numel = numel - numel % n;
        let x = Tensor::<1>::random([numel], Distribution::Default, (&ctx.device, DType::BF16));
        let shard = x.clone().narrow(0, 0, numel / n);
        let ops: [(&str, f64, Collective<'_>); 4] = [
            (
                "all_reduce",
                2.0,
                Box::new(|| group.all_reduce(x.clone(), ReduceOp::Sum).unwrap()),
            ),
            (
                "all_gather",
                1.0,
                Box::new(|| group.all_gather(shard.clone(), 0).unwrap()),
            ),
            (
                "reduce_scatter",
                1.0,
                Box::new(|| group.reduce_scatter(x.clone(), 0, ReduceOp::Sum).unwrap()),
            ),
            (
                "all_to_all",
                1.0,
                Box::new(|| group.all_to_all(x.clone(), 0, 0).unwrap()),
            ),
        ];
        for (name, factor, op) in &ops {
            let seconds = median_seconds(&ctx.device, group, op);
            let pipelined = pipelined_seconds(&ctx.device, group, op);
            let bytes = numel * 2;
            let busbw = |t: f64| factor * (n - 1) as f64 / n as f64 * bytes as f64 / t / 1e9;
            if ctx.global_rank == 0 {
                println!(
                    "RESULT {{\"peer\": \"burn-megatron\", \"transport\": \"{transport}\", \"op\": \"{name}\", \"bytes\": {bytes}, \"gpus\": {n}, \"time_us\": {:.1}, \"busbw_gbps\": {:.1}, \"pipelined_us\": {:.1}, \"pipelined_busbw_gbps\": {:.1}}}",
                    seconds * 1e6,
                    busbw(seconds),
                    pipelined * 1e6,
                    busbw(pipelined)
                );
            }
        }
    }
}

fn median_seconds(device: &Device, group: &ProcessGroup, op: &dyn Fn() -> Tensor<1>) -> f64 {
    for _ in 0..WARMUP {
        drop(op());
    }
    device.sync().expect("sync");
    let mut times: Vec<f64> = (0..RUNS)
        .map(|_| {
            group.barrier().expect("barrier");
            device.sync().expect("sync");
            let start = Instant::now();
            let out = op();
            device.sync().expect("sync");
            drop(out);
            start.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[RUNS / 2]
}

/// The mean time of a call among `RUNS` queued back to back, the device synchronized only
/// before the first and after the last.
fn pipelined_seconds(device: &Device, group: &ProcessGroup, op: &dyn Fn() -> Tensor<1>) -> f64 {
    group.barrier().expect("barrier");
    device.sync().expect("sync");
    let start = Instant::now();
    for _ in 0..RUNS {
        drop(op());
    }
    device.sync().expect("sync");
    start.elapsed().as_secs_f64() / RUNS as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;
    use clap::error::ErrorKind;

    /// `--help` on standard output with exit 0 (it starts no benchmark); bad values are errors.
    #[test]
    fn help_and_bad_values() {
        Args::command().debug_assert();
        let help = Args::try_parse_from(["collectives", "--help"]).unwrap_err();
        assert_eq!(help.kind(), ErrorKind::DisplayHelp);
        assert!(!help.use_stderr() && help.exit_code() == 0);
        for (flags, expected) in [
            (&["--gpus", "0"][..], "invalid value '0' for '--gpus <N>'"),
            (&["--cpu", "--processes"][..], "cannot be used with"),
            (&["--frobnicate"][..], "unexpected argument '--frobnicate'"),
        ] {
            let argv = std::iter::once("collectives").chain(flags.iter().copied());
            let error = Args::try_parse_from(argv).unwrap_err().to_string();
            assert!(error.contains(expected), "{flags:?}: {error}");
        }
    }
}
