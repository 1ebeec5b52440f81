//! Training throughput of a Llama preset on CUDA GPUs, as the RESULT line of
//! ../shared/BENCHMARKS.md, so it runs beside `../shared/peers/run_peers.sh` in one device call.
//!
//!   bench [--preset llama-1b] [--tp N] [--sp] [--steps 10] [--warmup 3] [--profile]
//!   bench --gemm [--kernels A,B]  matmul routines on the llama GEMM shapes (gemm.rs); all by default
//!   bench … --linear-gemm wgmma|burn  the linear layers' product (their config's `Gemm`; wgmma by default)
//!   bench … --burn-adamw          Burn's AdamW instead of the fused one (FusedAdamW)
//!
//! `--profile` adds a `PROFILE {…}` line: forward, backward and optimizer time per step, each
//! synchronized (so their sum exceeds the unsynchronized step time).
//!
//! bf16 parameters and activations (no fp32 master weights), f32 AdamW moments, lr 1e-4, random token
//! ids from a fixed seed. Each timed step is synchronized; the time is the mean over `--steps`.

mod gemm;
mod routines;

use std::time::Instant;

use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_megatron::init::InitMode;
use burn_megatron::models::llama::preset;
use burn_megatron::optim::FusedAdamWConfig;
use burn_megatron::plan::{ParallelPlan, TensorParallel};
use burn_megatron::precision::PrecisionPolicy;
use burn_megatron_dist::{ParallelDims, launch};
use burn_megatron_kernels::Gemm;
use routines::GemmKernel;

struct Args {
    preset: String,
    tp: usize,
    sp: bool,
    steps: usize,
    warmup: usize,
    profile: bool,
    gemm: bool,
    kernels: Vec<GemmKernel>,
    linear_gemm: Gemm,
    burn_adamw: bool,
}

fn parse() -> Args {
    let mut args = Args {
        preset: "llama-1b".into(),
        tp: 1,
        sp: false,
        steps: 10,
        warmup: 3,
        profile: false,
        gemm: false,
        kernels: GemmKernel::ALL.to_vec(),
        linear_gemm: Gemm::Wgmma,
        burn_adamw: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--preset" => args.preset = value(),
            "--tp" => args.tp = value().parse().expect("--tp N"),
            "--sp" => args.sp = true,
            "--profile" => args.profile = true,
            "--gemm" => args.gemm = true,
            "--burn-adamw" => args.burn_adamw = true,
            "--kernels" => {
                args.kernels = value()
                    .split(',')
                    .map(|k| k.parse().unwrap_or_else(|e| panic!("{e}")))
                    .collect()
            }
            "--linear-gemm" => {
                args.linear_gemm = match value().as_str() {
                    "wgmma" => Gemm::Wgmma,
                    "burn" => Gemm::Burn,
                    other => panic!("--linear-gemm {other}: expected wgmma or burn"),
                }
            }
            "--steps" => args.steps = value().parse().expect("--steps N"),
            "--warmup" => args.warmup = value().parse().expect("--warmup N"),
            other => panic!("unknown flag {other}"),
        }
    }
    args
}

fn main() {
    let args = parse();
    if args.gemm {
        gemm::run(&Device::cuda(0), 10, &args.kernels);
        return;
    }
    let recipe = preset(&args.preset).unwrap_or_else(|e| panic!("{e}"));
    let (seq, batch) = (recipe.seq_len, recipe.batch_size);
    let dims = ParallelDims::tp_dp(args.tp, 1);
    let shape = recipe.model.clone();
    let tensor = if args.sp {
        TensorParallel::SequenceParallel
    } else {
        TensorParallel::Plain
    };
    let plan = ParallelPlan::new(dims).with_tensor(tensor);
    // bf16 parameters updated in bf16 by the fused AdamW (no fp32 master weights).
    let policy = PrecisionPolicy::pure_bf16().with_gemm(args.linear_gemm);
    let config = policy.apply(plan.apply(recipe.model, args.tp, seq).unwrap_or_else(|e| panic!("{e}")));
    let init = policy.init(0, InitMode::PerShard);
    let results = launch(dims, Device::cuda, |ctx| {
        let device = ctx.device.clone().autodiff();
        let mut model = config.init(&device, &ctx.groups, &init).expect("init");
        // PyTorch's AdamW settings either way; `--burn-adamw` measures Burn's own kernels.
        let mut optim = match args.burn_adamw {
            true => AdamWConfig::new().with_epsilon(1e-8).with_weight_decay(0.01).init(),
            false => FusedAdamWConfig::new().init(),
        };
        let n = batch * (seq + 1);
        let ids: Vec<i64> = (0..n as u64).map(|i| (i.wrapping_mul(2654435761) % shape.embedding.vocab_size as u64) as i64).collect();
        let all = Tensor::<2, Int>::from_data(TensorData::new(ids, [batch, seq + 1]), &device);
        let (inputs, targets) = (all.clone().narrow(1, 0, seq), all.narrow(1, 1, seq));
        let mut step = |model: burn_megatron::models::llama::Llama| {
            let loss = model.forward_loss(inputs.clone(), targets.clone()).expect("forward");
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            (optim.step(1e-4, model, grads), loss)
        };
        for i in 0..args.warmup {
            let start = Instant::now();
            let (next, loss) = step(model);
            model = next;
            let loss = loss.into_scalar::<f32>();
            if ctx.global_rank == 0 {
                eprintln!("warmup {i}: {:.1} s, loss {loss}", start.elapsed().as_secs_f64());
            }
        }
        ctx.device.sync().expect("sync");
        let start = Instant::now();
        let mut last = 0.0;
        for _ in 0..args.steps {
            let (next, loss) = step(model);
            model = next;
            last = loss.into_scalar::<f32>();
        }
        ctx.device.sync().expect("sync");
        let step_s = start.elapsed().as_secs_f64() / args.steps as f64;
        if args.profile {
            let (mut forward, mut backward, mut optimizer) = (0.0, 0.0, 0.0);
            let sync = || ctx.device.sync().expect("sync");
            for _ in 0..args.steps {
                let t = Instant::now();
                let loss = model.forward_loss(inputs.clone(), targets.clone()).expect("forward");
                sync();
                forward += t.elapsed().as_secs_f64();
                let t = Instant::now();
                let grads = GradientsParams::from_grads(loss.backward(), &model);
                sync();
                backward += t.elapsed().as_secs_f64();
                let t = Instant::now();
                model = optim.step(1e-4, model, grads);
                sync();
                optimizer += t.elapsed().as_secs_f64();
            }
            let ms = |s: f64| s * 1e3 / args.steps as f64;
            if ctx.global_rank == 0 {
                println!(
                    "PROFILE {{\"preset\": \"{}\", \"tp\": {}, \"forward_ms\": {:.1}, \"backward_ms\": {:.1}, \"optimizer_ms\": {:.1}}}",
                    args.preset, args.tp, ms(forward), ms(backward), ms(optimizer)
                );
            }
        }
        (step_s, last)
    })
    .unwrap_or_else(|e| panic!("{e}"));
    let (step_s, loss) = results[0];
    let (h, l, f, v) = (
        shape.attention.d_model,
        shape.n_layers,
        shape.mlp.d_ff,
        shape.embedding.vocab_size,
    );
    let params = (l * (4 * h * h + 3 * h * f) + v * h) as f64;
    let flops = (batch * seq) as f64 * (6.0 * params + 12.0 * (l * seq * h) as f64);
    let tflops_per_gpu = flops / step_s / args.tp as f64 / 1e12;
    println!(
        "RESULT {{\"peer\": \"burn-megatron\", \"preset\": \"{}\", \"batch\": {batch}, \"seq\": {seq}, \"tp\": {}, \"gpus\": {}, \"step_ms\": {:.1}, \"tokens_per_s\": {:.0}, \"tflops_per_gpu\": {:.1}, \"mfu\": {:.3}, \"peak_mem_gib\": null, \"loss\": {loss:.4}}}",
        args.preset,
        args.tp,
        args.tp,
        step_s * 1e3,
        (batch * seq) as f64 / step_s,
        tflops_per_gpu,
        tflops_per_gpu / 989.4,
    );
}
