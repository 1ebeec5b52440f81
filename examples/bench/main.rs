//! Training throughput of a Llama preset on CUDA GPUs, as the RESULT line of
//! `docs/performance.md`, so it runs beside `peers/run.sh` in one device call.
//!
//!   bench [--preset llama-1b] [--tp N] [--sp] [--dp N] [--steps 10] [--warmup 3] [--profile]
//!   bench … --pure-bf16               bf16 parameters updated in bf16 (no master weights), labelled
//!   bench … --precision fp8-tensorwise[-promoted|-e4m3|-e4m3-promoted]|fp8-delayed|fp8-blockwise|mxfp8|nvfp4
//!                                     a low-precision recipe in the blocks' linear layers
//!   bench … --bf16-blocks FIRST,LAST  the first and last blocks the recipe leaves on bf16's product
//!   bench … --linear-gemm wgmma|burn  the linear layers' product (their config's `Gemm`; wgmma)
//!   bench --gemm [--kernels A,B]      matmul routines on the llama GEMM shapes (gemm.rs)
//!   bench --attention                 flash attention's forward and backward alone (attention.rs)
//!   bench --grouped                   the MoE grouped product on moe-4b's shapes (grouped.rs)
//!   bench --moe-breakdown             one moe-4b MoE layer phase by phase (moe.rs)
//!   bench --preset moe-4b [--ep N] [--etp N]   a MoE preset, its experts over ep (folded over dp,
//!                                    and the tp ranks outside an etp group)
//!   bench … --recompute none|selective|full:N|full-block:N [--batch B]
//!                                     activation recomputation, at the preset's batch or B a rank
//!   bench --preset llama-1b-32k [--cp N] [--context ring|all-to-all|all-gather]
//!                                     context parallelism: each sequence's chunks over cp ranks
//!   bench --preset llama-8b --pp 2 [--vpp V] [--microbatches M]
//!                                     pipeline stages (1F1B; interleaved over V chunks a rank), the
//!                                     batch in M microbatches (pipeline.rs); the bubble measured
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
use burn_megatron::layers::context::ContextLayout;
use burn_megatron::models::llama::preset;
use burn_megatron::plan::{ContextParallel, ParallelPlan, PipelineSchedule, TensorParallel};
use burn_megatron::precision::{KeptBlocks, PrecisionPolicy};
use burn_megatron::recompute::Recompute;
use burn_megatron_dist::{ParallelDims, launch};
use burn_megatron_kernels::Gemm;
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

fn parse() -> Result<Args, String> {
    let mut args = Args {
        preset: "llama-1b".into(),
        tp: 1,
        dp: 1,
        ep: 1,
        etp: None,
        cp: 1,
        context: ContextParallel::Ring,
        pp: 1,
        vpp: 1,
        microbatches: None,
        sp: false,
        steps: 10,
        warmup: 3,
        profile: false,
        gemm: false,
        attention: false,
        grouped: false,
        moe_breakdown: false,
        kernels: GemmKernel::ALL.to_vec(),
        linear_gemm: Gemm::Wgmma,
        recipe: Recipe::Bf16,
        kept_blocks: None,
        recompute: Recompute::None,
        batch: None,
    };
    let mut it = std::env::args().skip(1);
    let number = |flag: &str, v: String| v.parse::<usize>().map_err(|_| format!("{flag} {v}: not a number"));
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--preset" => args.preset = value()?,
            "--tp" => args.tp = number(&flag, value()?)?,
            "--dp" => args.dp = number(&flag, value()?)?,
            "--ep" => args.ep = number(&flag, value()?)?,
            "--etp" => args.etp = Some(number(&flag, value()?)?),
            "--cp" => args.cp = number(&flag, value()?)?,
            "--context" => args.context = value()?.parse()?,
            "--pp" => args.pp = number(&flag, value()?)?,
            "--vpp" => args.vpp = number(&flag, value()?)?,
            "--microbatches" => args.microbatches = Some(number(&flag, value()?)?),
            "--sp" => args.sp = true,
            "--profile" => args.profile = true,
            "--gemm" => args.gemm = true,
            "--attention" => args.attention = true,
            "--grouped" => args.grouped = true,
            "--moe-breakdown" => args.moe_breakdown = true,
            "--pure-bf16" => args.recipe = Recipe::PureBf16,
            "--precision" => {
                args.recipe = match value()?.as_str() {
                    "bf16" => Recipe::Bf16,
                    "pure-bf16" => Recipe::PureBf16,
                    other => Recipe::Quantized(
                        other
                            .parse()
                            .map_err(|e| format!("--precision: {e}, bf16 or pure-bf16"))?,
                    ),
                }
            }
            "--kernels" => args.kernels = value()?.split(',').map(str::parse).collect::<Result<_, _>>()?,
            "--linear-gemm" => {
                args.linear_gemm = match value()?.as_str() {
                    "wgmma" => Gemm::Wgmma,
                    "burn" => Gemm::Burn,
                    other => return Err(format!("--linear-gemm {other}: expected wgmma or burn")),
                }
            }
            "--bf16-blocks" => {
                let text = value()?;
                let (first, last) = text
                    .split_once(',')
                    .ok_or_else(|| format!("--bf16-blocks {text}: expected FIRST,LAST"))?;
                args.kept_blocks = Some((number(&flag, first.to_string())?, number(&flag, last.to_string())?));
            }
            "--recompute" => args.recompute = value()?.parse().map_err(|e| format!("--recompute {e}"))?,
            "--batch" => args.batch = Some(number(&flag, value()?)?),
            "--steps" => args.steps = number(&flag, value()?)?,
            "--warmup" => args.warmup = number(&flag, value()?)?,
            other => return Err(format!("unknown flag {other}")),
        }
    }
    if args.tp == 0
        || args.dp == 0
        || args.ep == 0
        || args.etp == Some(0)
        || args.cp == 0
        || args.pp == 0
        || args.vpp == 0
        || args.steps == 0
    {
        return Err("--tp, --dp, --ep, --etp, --cp, --pp, --vpp and --steps must be at least 1".into());
    }
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
    if let Err(e) = burn_megatron_kernels::failures::watch() {
        eprintln!("{e}");
    }
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
    let dims = ParallelDims {
        ep: args.ep,
        etp: args.etp,
        cp: args.cp,
        pp: args.pp,
        ..ParallelDims::tp_dp(args.tp, args.dp)
    };
    let schedule = match args.vpp {
        1 => PipelineSchedule::OneForwardOneBackward,
        v => PipelineSchedule::Interleaved { virtual_stages: v },
    };
    let microbatches = args.microbatches.unwrap_or(args.pp);
    let tensor = if args.sp {
        TensorParallel::SequenceParallel
    } else {
        TensorParallel::Plain
    };
    let plan = ParallelPlan::new(dims)
        .with_tensor(tensor)
        .with_context(args.context)
        .with_pipeline(schedule);
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
    let results = launch(dims, Device::cuda, |ctx| {
        let device = ctx.device.clone().autodiff();
        // Each data-parallel rank its own batch; the tensor-parallel ranks of one share it.
        let ids = random_ids(batch * (seq + 1), vocab, 1 + ctx.groups.dp.group_rank() as u64);
        let all = Tensor::<2, Int>::from_data(TensorData::new(ids, [batch, seq + 1]), &device);
        let whole = (all.clone().narrow(1, 0, seq), all.narrow(1, 1, seq));
        if args.pp > 1 {
            let run = pipeline::run(&ctx, &config, &plan, microbatches, policy, whole, args.warmup, args.steps);
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
        let run = timing::run(&ctx, model, batch, policy, args.warmup, args.steps, args.profile);
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
