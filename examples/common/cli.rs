//! The command-line groups the examples share: where the ranks run, the layout over them, and a
//! pretrained model's files; the choices as clap value enums. Megatron's long names are
//! aliases where it has one.

#![allow(dead_code)] // each example uses its own part

use std::path::PathBuf;

use clap::{Args, ValueEnum};

/// Where the ranks run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum DeviceArg {
    /// The CPU, every rank a thread.
    #[default]
    Cpu,
    /// One CUDA GPU a local rank (a build with `--features cuda`).
    Cuda,
}

impl DeviceArg {
    pub fn cuda(self) -> bool {
        self == DeviceArg::Cuda
    }
}

impl From<DeviceArg> for burn_megatron::job::DeviceKind {
    fn from(device: DeviceArg) -> Self {
        match device {
            DeviceArg::Cpu => Self::Cpu,
            DeviceArg::Cuda => Self::Cuda,
        }
    }
}

/// The mesh's sizes, each left to the job (or 1) when not given.
#[derive(Args, Clone, Debug, Default)]
pub struct Layout {
    /// Tensor-parallel ranks.
    #[arg(long, value_name = "N", visible_alias = "tensor-model-parallel-size")]
    pub tp: Option<usize>,
    /// Data-parallel ranks (ZeRO-1 with --zero1).
    #[arg(long, value_name = "N")]
    pub dp: Option<usize>,
    /// Context-parallel ranks: each sequence split over them.
    #[arg(long, value_name = "N", visible_alias = "context-parallel-size")]
    pub cp: Option<usize>,
    /// Expert-parallel ranks, folded over dp × cp.
    #[arg(long, value_name = "N", visible_alias = "expert-model-parallel-size")]
    pub ep: Option<usize>,
    /// Expert tensor-parallel ranks (all of tp when not given).
    #[arg(long, value_name = "N", visible_alias = "expert-tensor-parallel-size")]
    pub etp: Option<usize>,
    /// Pipeline stages.
    #[arg(long, value_name = "N", visible_alias = "pipeline-model-parallel-size")]
    pub pp: Option<usize>,
    /// Model chunks a pipeline stage (interleaved 1F1B above 1).
    #[arg(long, value_name = "V", visible_alias = "virtual-pipeline-model-parallel-size")]
    pub vpp: Option<usize>,
    /// Sequence parallelism beside tp.
    #[arg(long, visible_alias = "sequence-parallel")]
    pub sp: bool,
    /// How attention sees the whole sequence under cp.
    #[arg(long, value_enum, value_name = "EXCHANGE")]
    pub context: Option<ContextArg>,
    /// How token copies reach other ep ranks' experts.
    #[arg(
        long,
        value_enum,
        value_name = "DISPATCHER",
        visible_alias = "moe-token-dispatcher-type"
    )]
    pub dispatcher: Option<DispatcherArg>,
}

/// Context parallelism's exchange.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ContextArg {
    /// K/V blocks passed around the cp ring (Megatron's p2p).
    Ring,
    /// Heads scattered, the sequence gathered (Ulysses, Megatron's a2a).
    AllToAll,
    /// K/V gathered whole on every cp rank.
    AllGather,
}

impl From<ContextArg> for burn_megatron::plan::ContextParallel {
    fn from(choice: ContextArg) -> Self {
        match choice {
            ContextArg::Ring => Self::Ring,
            ContextArg::AllToAll => Self::AllToAll,
            ContextArg::AllGather => Self::AllGather,
        }
    }
}

/// The experts' token dispatcher.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DispatcherArg {
    /// Uneven all-to-all over the ep group.
    AllToAll,
    /// Every ep rank gathers all tokens (a small ep).
    AllGather,
}

impl From<DispatcherArg> for burn_megatron::plan::ExpertParallel {
    fn from(choice: DispatcherArg) -> Self {
        match choice {
            DispatcherArg::AllToAll => Self::AllToAll,
            DispatcherArg::AllGather => Self::AllGather,
        }
    }
}

/// The compute dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DtypeArg {
    F32,
    Bf16,
}

impl From<DtypeArg> for burn_megatron::job::Dtype {
    fn from(dtype: DtypeArg) -> Self {
        match dtype {
            DtypeArg::F32 => Self::F32,
            DtypeArg::Bf16 => Self::Bf16,
        }
    }
}

/// A pretrained model's files: a GGUF file or a Hugging Face directory.
#[derive(Args, Clone, Debug, Default)]
pub struct ModelFiles {
    /// A GGUF file (SmolLM2-135M-Instruct's by default: scripts/fetch-smollm2.sh).
    #[arg(long = "model", value_name = "GGUF", conflicts_with = "hf")]
    pub gguf: Option<PathBuf>,
    /// A Hugging Face model directory (config.json, safetensors, tokenizer.json).
    #[arg(long, value_name = "DIR")]
    pub hf: Option<PathBuf>,
}

/// A number of at least 1 (clap's `value_parser`).
pub fn at_least_one(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("{text:?} is not a whole number")),
    }
}

/// A finite number of at least 0.
pub fn non_negative(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(x) if x.is_finite() && x >= 0.0 => Ok(x),
        _ => Err(format!("{text:?} is not a finite number ≥ 0")),
    }
}

/// What every example's tests check of its command line.
#[cfg(test)]
pub mod testing {
    use clap::Parser;
    use clap::error::ErrorKind;

    /// `--help` is clap's: on standard output, exit code 0, the command's definition sound.
    pub fn help_is_on_stdout<P: Parser>(name: &str) {
        P::command().debug_assert();
        let help = P::try_parse_from([name, "--help"]).map(|_| ()).unwrap_err();
        assert_eq!(help.kind(), ErrorKind::DisplayHelp, "{name}");
        assert!(
            !help.use_stderr() && help.exit_code() == 0,
            "{name}: help on stdout, exit 0"
        );
    }

    /// Each command line (after the program's `name`) is an error whose text says what its
    /// case expects, never a panic; `check` is what the example checks after clap.
    pub fn errors_say_what<P: Parser, A>(name: &str, check: impl Fn(P) -> Result<A, String>, cases: &[(&str, &str)]) {
        for (flags, expected) in cases {
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let argv = std::iter::once(name).chain(flags.split_whitespace());
                P::try_parse_from(argv)
                    .map_err(|e| e.to_string())
                    .and_then(&check)
                    .map(|_| ())
            }));
            let error = outcome
                .unwrap_or_else(|_| panic!("{name} {flags}: panicked instead of an error"))
                .expect_err(flags);
            assert!(
                error.contains(expected),
                "{name} {flags}: {error:?} does not say {expected:?}"
            );
        }
    }
}
