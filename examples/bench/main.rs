//! Training throughput of a Llama preset on CUDA GPUs, as the RESULT line of
//! `docs/performance.md`, so it runs beside `peers/run.sh` in one device call.
//!
//!   bench --help                      every flag; the usual runs are `scripts/gpu/rows.sh`'s
//!
//! The peers' recipe by default (`PrecisionPolicy::bf16`): bf16 compute, fp32 master weights and
//! fp32 AdamW moments (`DistributedAdamW`), lr 1e-4, uniformly random token ids from a seeded
//! generator, one batch a data-parallel rank (each rank its own, as PyTorch DDP's peer), its
//! gradients averaged in buckets during backward. At least 3 warm-up steps, then the mean over
//! at least 10 timed steps, the device synchronized before each clock reading.
//!
//! `--profile` adds a `PROFILE {…}` line: forward, backward, the wait for the data-parallel
//! reduction after backward and the optimizer, each synchronized; and the same reduction run
//! alone, so `hidden` is the share of it that backward hid.
//!
//! `MEMORY {…}` lines show rank 0's device: CubeCL's pools, what the tensors hold beside what the
//! pools reserve, pool by pool, and the driver's count (memory.rs). They come once the model is
//! built, after the first step, then at the start and after each piece of one more step (a
//! pipeline stage: after the timed steps). `peak_mem_gib` is the largest reservation of any
//! rank's pools; the CUDA context and what the driver keeps outside the pools are not in it,
//! and nvidia-smi sees those too.

#[path = "../common/cli.rs"]
mod cli;
#[path = "../common/logging.rs"]
mod logging;

mod attention;
mod gemm;
mod grouped;
mod memory;
mod moe;
mod pipeline;
mod routines;
mod timing;

use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_megatron::init::InitMode;
use burn_megatron::job::ParallelSection;
use burn_megatron::layers::context::ContextLayout;
use burn_megatron::models::llama::preset;
use burn_megatron::optim::DistributedAdamWConfig;
use burn_megatron::plan::ContextParallel;
use burn_megatron::precision::{KeptBlocks, PrecisionPolicy};
use burn_megatron::recompute::Recompute;
use burn_megatron_dist::launch;
use burn_megatron_kernels::Gemm;
use clap::{Parser, ValueEnum};
use cli::{Layout, at_least_one};
use routines::GemmKernel;

struct Args {
    preset: String,
    tp: usize,
    dp: usize,
    ep: usize,
    /// Expert tensor parallelism (`None`: all of tp).
    etp: Option<usize>,
    cp: usize,
    context: ContextParallel,
    pp: usize,
    vpp: usize,
    microbatches: Option<usize>,
    sp: bool,
    steps: usize,
    warmup: usize,
    profile: bool,
    /// Gradients checked for non-finite values before the update.
    finite_check: bool,
    gemm: bool,
    attention: bool,
    grouped: bool,
    moe_breakdown: bool,
    kernels: Vec<GemmKernel>,
    linear_gemm: Gemm,
    recipe: Recipe,
    /// The first and last blocks a quantized recipe leaves on bf16's product (the recipe's own
    /// choice when absent).
    kept_blocks: Option<(usize, usize)>,
    recompute: Recompute,
    /// Sequences a data-parallel rank, instead of the preset's.
    batch: Option<usize>,
}

/// The precision recipe a run trains with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Recipe {
    /// bf16 compute, fp32 master weights: the peers' recipe.
    Bf16,
    /// bf16 parameters updated in bf16, no master weights.
    PureBf16,
    /// A low-precision recipe in the blocks' linear layers, fp32 master weights.
    Quantized(burn_megatron_kernels::quant::recipe::Recipe),
}

/// Training throughput of a Llama preset on CUDA GPUs beside its peers (`docs/performance.md`),
/// and the kernels alone (`--gemm`, `--attention`, `--grouped`, `--moe-breakdown`).
#[derive(Parser, Debug)]
#[command(name = "bench", args_override_self = true)]
struct Cli {
    /// llama-1b, llama-1b-32k, llama-8b, moe-4b, tiny, …
    #[arg(long, value_name = "NAME", default_value = "llama-1b")]
    preset: String,
    #[command(flatten)]
    layout: Layout,
    /// Pipeline microbatches a step (pp by default).
    #[arg(long, value_name = "M", value_parser = at_least_one)]
    microbatches: Option<usize>,
    /// Timed steps.
    #[arg(long, value_name = "N", default_value_t = 10, value_parser = at_least_one)]
    steps: usize,
    /// Warm-up steps before them.
    #[arg(long, value_name = "N", default_value_t = 3)]
    warmup: usize,
    /// A PROFILE line: forward, backward, the reduction's wait and the optimizer, synchronized.
    #[arg(long)]
    profile: bool,
    /// No check of the gradients for a NaN or an infinity before the update (what it costs).
    #[arg(long)]
    no_finite_check: bool,
    /// Matmul routines on the llama GEMM shapes.
    #[arg(long)]
    gemm: bool,
    /// Flash attention's forward and backward alone.
    #[arg(long)]
    attention: bool,
    /// The MoE grouped product on moe-4b's shapes.
    #[arg(long)]
    grouped: bool,
    /// One moe-4b MoE layer phase by phase.
    #[arg(long)]
    moe_breakdown: bool,
    /// The routines --gemm times (comma-separated; all by default).
    #[arg(long, value_name = "A,B", value_delimiter = ',')]
    kernels: Vec<GemmKernel>,
    /// The linear layers' product.
    #[arg(long, value_enum, default_value_t = LinearGemm::Wgmma)]
    linear_gemm: LinearGemm,
    /// bf16 (fp32 master weights), pure-bf16 (no master weights), or a low-precision recipe in
    /// the blocks' linear layers (fp8-tensorwise[-promoted|-e4m3|-e4m3-promoted],
    /// fp8-delayed[:LEN[:max|most-recent]], fp8-blockwise, mxfp8, nvfp4).
    #[arg(long, value_name = "RECIPE", default_value = "bf16")]
    precision: String,
    /// bf16 parameters updated in bf16, no master weights (as --precision pure-bf16).
    #[arg(long)]
    pure_bf16: bool,
    /// The first and last blocks the recipe leaves on bf16's product.
    #[arg(long, value_name = "FIRST,LAST", value_delimiter = ',', num_args = 2)]
    bf16_blocks: Option<Vec<usize>>,
    /// What the blocks run again in backward: none, selective, full:N or full-block:N.
    #[arg(long, value_name = "SPEC", default_value = "none")]
    recompute: Recompute,
    /// Sequences a data-parallel rank, instead of the preset's.
    #[arg(long, value_name = "B", value_parser = at_least_one)]
    batch: Option<usize>,
}

/// The linear layers' product.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum LinearGemm {
    /// Our Hopper GEMM.
    Wgmma,
    /// Burn's matmul.
    Burn,
}

fn parse() -> Result<Args, String> {
    checked(Cli::parse())
}

/// The command line's values checked against each other.
fn checked(cli: Cli) -> Result<Args, String> {
    let recipe = match (cli.pure_bf16, cli.precision.as_str()) {
        (true, _) | (_, "pure-bf16") => Recipe::PureBf16,
        (_, "bf16") => Recipe::Bf16,
        (_, other) => Recipe::Quantized(
            other
                .parse()
                .map_err(|e| format!("--precision: {e}, bf16 or pure-bf16"))?,
        ),
    };
    let l = &cli.layout;
    let one = |n: Option<usize>| n.unwrap_or(1);
    if [l.tp, l.dp, l.ep, l.etp, l.cp, l.pp, l.vpp].contains(&Some(0)) {
        return Err("--tp, --dp, --ep, --etp, --cp, --pp and --vpp must be at least 1".into());
    }
    let args = Args {
        preset: cli.preset,
        tp: one(l.tp),
        dp: one(l.dp),
        ep: one(l.ep),
        etp: l.etp,
        cp: one(l.cp),
        context: l.context.map_or(ContextParallel::Ring, Into::into),
        pp: one(l.pp),
        vpp: one(l.vpp),
        microbatches: cli.microbatches,
        sp: l.sp,
        steps: cli.steps,
        warmup: cli.warmup,
        profile: cli.profile,
        finite_check: !cli.no_finite_check,
        gemm: cli.gemm,
        attention: cli.attention,
        grouped: cli.grouped,
        moe_breakdown: cli.moe_breakdown,
        kernels: match cli.kernels.is_empty() {
            true => GemmKernel::ALL.to_vec(),
            false => cli.kernels,
        },
        linear_gemm: match cli.linear_gemm {
            LinearGemm::Wgmma => Gemm::Wgmma,
            LinearGemm::Burn => Gemm::Burn,
        },
        recipe,
        kept_blocks: cli.bf16_blocks.map(|b| (b[0], b[1])),
        recompute: cli.recompute,
        batch: cli.batch,
    };
    if args.pp > 1 && (args.recipe == Recipe::PureBf16 || args.profile) {
        return Err("--pp steps with the distributed optimizer and times the bubble, not the pieces: leave out --pure-bf16 and --profile".into());
    }
    if args.kept_blocks.is_some() && !matches!(args.recipe, Recipe::Quantized(_)) {
        return Err("--bf16-blocks names the blocks a --precision recipe leaves in bf16: it needs one".into());
    }
    if args.recipe == Recipe::PureBf16 && args.dp > 1 {
        return Err("--pure-bf16 updates the parameters with Burn's optimizer interface, which averages no gradients: use --dp 1".into());
    }
    Ok(args)
}

fn main() {
    logging::init();
    let args = parse().unwrap_or_else(|message| {
        eprintln!("{message}");
        std::process::exit(2);
    });
    if args.gemm {
        gemm::run(&Device::cuda(0), 30, &args.kernels);
        return;
    }
    if args.attention {
        attention::run(&Device::cuda(0), 20);
        return;
    }
    if args.grouped {
        grouped::run(&Device::cuda(0), 20);
        return;
    }
    if args.moe_breakdown {
        moe::run(&Device::cuda(0), 10);
        return;
    }
    let recipe = preset(&args.preset).unwrap_or_else(|e| panic!("{e}"));
    let (seq, batch) = (recipe.seq_len, args.batch.unwrap_or(recipe.batch_size));
    let layout = ParallelSection {
        tp: args.tp,
        dp: args.dp,
        cp: args.cp,
        ep: args.ep,
        etp: args.etp,
        pp: args.pp,
        vpp: args.vpp,
        sp: args.sp,
        context: args.context,
        ..ParallelSection::default()
    };
    let plan = layout.plan();
    let dims = plan.dims;
    let microbatches = args.microbatches.unwrap_or(args.pp);
    let policy = match args.recipe {
        Recipe::Bf16 => PrecisionPolicy::bf16().with_gemm(args.linear_gemm),
        Recipe::PureBf16 => PrecisionPolicy::pure_bf16().with_gemm(args.linear_gemm),
        Recipe::Quantized(recipe) => PrecisionPolicy::quantized(recipe),
    };
    let policy = match args.kept_blocks {
        Some((first, last)) => policy.with_kept_blocks(KeptBlocks::Count { first, last }),
        None => policy,
    };
    let shape = recipe.model.clone();
    let config = policy.apply(
        plan.apply(recipe.model.with_recompute(args.recompute), dims.world_size(), seq)
            .unwrap_or_else(|e| panic!("{e}")),
    );
    let vocab = shape.embedding.vocab_size;
    if args.pp > 1 && (batch < microbatches || !batch.is_multiple_of(microbatches)) {
        panic!("{batch} sequences a rank do not split into {microbatches} equal microbatches");
    }
    let optim = DistributedAdamWConfig::new().with_check_finite(args.finite_check);
    let results = launch(dims, Device::cuda, |ctx| {
        let device = ctx.device.clone().autodiff();
        // Each data-parallel rank its own batch; the tensor-parallel ranks of one share it.
        let ids = random_ids(batch * (seq + 1), vocab, 1 + ctx.groups.dp.group_rank() as u64);
        let all = Tensor::<2, Int>::from_data(TensorData::new(ids, [batch, seq + 1]), &device);
        let whole = (all.clone().narrow(1, 0, seq), all.narrow(1, 1, seq));
        if args.pp > 1 {
            let run = pipeline::run(&ctx, &config, &plan, microbatches, policy, &optim, whole, (args.warmup, args.steps));
            let bubble = format!(
                ", \"pp\": {}, \"vpp\": {}, \"microbatches\": {microbatches}, \"bubble_predicted\": {:.3}, \"bubble_measured\": {:.3}",
                args.pp, args.vpp, run.bubble_predicted, run.bubble_measured
            );
            return (run.step_s, run.loss, None, bubble, run.memory);
        }
        let model = config
            .init(&device, &ctx.groups, &policy.init(0, InitMode::PerShard))
            .expect("init");
        // Each cp rank its two chunks of every sequence.
        let layout = ContextLayout::new(&ctx.groups.cp);
        let shard = |x| layout.shard(x, 1).unwrap_or_else(|e| panic!("{e}"));
        let batch = (shard(whole.0), shard(whole.1));
        let run = timing::run(&ctx, model, batch, policy, &optim, (args.warmup, args.steps), args.profile);
        (run.step_s, run.loss, run.profile, String::new(), run.memory)
    })
    .unwrap_or_else(|e| panic!("{e}"));
    let (step_s, loss, profile, pipeline, marks) = &results[0];
    let (step_s, loss) = (*step_s, *loss);
    let gpus = args.tp * args.dp * args.cp * args.pp;
    let tokens = (batch * args.dp * seq) as f64;
    let flops = tokens * shape.flops_per_token(seq);
    let tflops_per_gpu = flops / step_s / gpus as f64 / 1e12;
    let recipe = match args.recipe {
        Recipe::Bf16 => "bf16-fp32-master".to_string(),
        Recipe::PureBf16 => "pure-bf16".to_string(),
        Recipe::Quantized(recipe) => format!("{}-fp32-master", recipe.name()),
    };
    let recipe = match args.kept_blocks {
        Some((first, last)) => format!("{recipe}-bf16-blocks-{first}-{last}"),
        None => recipe,
    };
    let recipe = match args.recompute {
        Recompute::None => recipe,
        Recompute::Selective => format!("{recipe}-recompute-selective"),
        Recompute::Full { method, layers } => format!("{recipe}-recompute-full-{method:?}-{layers}").to_lowercase(),
    };
    if let Some(profile) = profile {
        println!(
            "PROFILE {{\"preset\": \"{}\", \"tp\": {}, \"dp\": {}, {profile}}}",
            args.preset, args.tp, args.dp
        );
    }
    for mark in marks {
        println!("{}", mark.line());
    }
    // The most any rank's pools reserved: stages and ranks differ (the last stage holds the
    // logits).
    let peak = match marks.is_empty() {
        true => "null".to_string(),
        false => format!(
            "{:.2}",
            results.iter().map(|r| memory::peak_gib(&r.4)).fold(0.0, f64::max)
        ),
    };
    println!(
        "RESULT {{\"peer\": \"burn-megatron\", \"recipe\": \"{recipe}\", \"preset\": \"{}\", \"batch\": {}, \"seq\": {seq}, \"tp\": {}, \"cp\": {}, \"dp\": {}, \"ep\": {}, \"gpus\": {gpus}, \"step_ms\": {:.1}, \"tokens_per_s\": {:.0}, \"tflops_per_gpu\": {:.1}, \"mfu\": {:.3}, \"peak_mem_gib\": {peak}, \"loss\": {:.4}{pipeline}}}",
        args.preset,
        batch * args.dp,
        args.tp,
        args.cp,
        args.dp,
        args.ep,
        step_s * 1e3,
        tokens / step_s,
        tflops_per_gpu,
        tflops_per_gpu / 989.4,
        loss,
    );
}

/// `n` token ids drawn uniformly from `0..vocab` by a seeded SplitMix64 stream.
fn random_ids(n: usize, vocab: usize, seed: u64) -> Vec<i64> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (0..n)
        .map(|_| {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            ((z ^ (z >> 31)) % vocab as u64) as i64
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use cli::testing::{errors_say_what, help_is_on_stdout};

    #[test]
    fn help_and_bad_values() {
        help_is_on_stdout::<Cli>("bench");
        errors_say_what::<Cli, _>(
            "bench",
            checked,
            &[
                ("--tp 0", "at least 1"),
                ("--precision fp4", "unknown recipe \"fp4\""),
                ("--pp 2 --profile", "leave out --pure-bf16 and --profile"),
                ("--bf16-blocks 1,1", "it needs one"),
                ("--pure-bf16 --dp 2", "use --dp 1"),
                ("--recompute twice", "expected none, selective"),
                ("--kernels nothing", "nothing"),
                ("--frobnicate", "unexpected argument '--frobnicate'"),
            ],
        );
    }
}
