//! `bench --moe-breakdown`: one MoE layer of moe-4b (32 experts of ffn 1408, top 4, 8192
//! tokens, bf16) on one GPU, phase by phase: the router, the dispatch (decided on the device;
//! and on the host, for comparison), the permutation, the experts (three grouped products and SwiGLU), the
//! un-permutation, the whole layer's forward and its backward. Each phase is timed alone, the device synchronized
//! before and after: `host_ms` is the time to enqueue it, `total_ms` until the device is done.
//! One `MOE {…}` line a phase.

use std::time::Instant;

use burn::tensor::{DType, Device, Distribution, Tensor};
use burn_megatron::init::{InitMode, ParamInit};
use burn_megatron::layers::moe::dispatch::{dispatch, dispatch_host, permute, read_experts, unpermute};
use burn_megatron::models::llama::recipes;
use burn_megatron_dist::ProcessGroups;
use burn_megatron_kernels::grouped_gemm::row_alignment;

/// Mean host and total milliseconds of `iters` synchronized runs of `f`, after two untimed.
fn timed<T>(device: &Device, iters: usize, mut f: impl FnMut() -> T) -> (f64, f64) {
    let (mut host, mut total) = (0.0, 0.0);
    for i in 0..iters + 2 {
        device.sync().expect("sync");
        let start = Instant::now();
        let out = f();
        let enqueued = start.elapsed().as_secs_f64();
        device.sync().expect("sync");
        let done = start.elapsed().as_secs_f64();
        drop(out);
        if i >= 2 {
            host += enqueued;
            total += done;
        }
    }
    (host * 1e3 / iters as f64, total * 1e3 / iters as f64)
}

pub fn run(device: &Device, iters: usize) {
    let autodiff = device.clone().autodiff();
    let recipe = recipes::moe_4b();
    let layer = recipe.model.moe.expect("moe-4b has MoE blocks").layer;
    let e = layer.router.n_experts;
    let init = ParamInit::new(0, InitMode::PerShard).with_dtype(DType::BF16);
    let moe = layer
        .init(&autodiff, &ProcessGroups::single(), &init, "moe")
        .expect("init");
    let (b, s, d) = (recipe.batch_size, recipe.seq_len, layer.router.d_model);
    let x = Tensor::<3>::random([b, s, d], Distribution::Normal(0.0, 1.0), (&autodiff, DType::BF16)).require_grad();
    let tokens = x.clone().reshape([b * s, d]);
    let report = |phase: &str, (host, total): (f64, f64)| {
        println!("MOE {{\"phase\": \"{phase}\", \"host_ms\": {host:.2}, \"total_ms\": {total:.2}}}");
    };
    let routing = moe.router.forward(tokens.clone(), b).expect("route");
    report(
        "router",
        timed(device, iters, || moe.router.forward(tokens.clone(), b).expect("route")),
    );
    let align = row_alignment(&tokens);
    let plan = dispatch(routing.experts.clone(), e, align);
    report(
        "dispatch",
        timed(device, iters, || dispatch(routing.experts.clone(), e, align)),
    );
    // The same order decided on the host from the ids read (as before the order kernels, and as
    // capacity and the all-gather dispatcher still decide it).
    let k = routing.experts.dims()[1];
    report(
        "dispatch on the host",
        timed(device, iters, || {
            dispatch_host(read_experts(routing.experts.clone()), k, 0..e, align, device)
        }),
    );
    let rows = permute(tokens.clone(), &plan);
    report("permute", timed(device, iters, || permute(tokens.clone(), &plan)));
    let out = moe.experts.forward(rows.clone(), &plan.groups, None);
    report(
        "experts",
        timed(device, iters, || moe.experts.forward(rows.clone(), &plan.groups, None)),
    );
    report(
        "unpermute",
        timed(device, iters, || unpermute(out.clone(), routing.weights.clone(), &plan)),
    );
    report(
        "layer forward",
        timed(device, iters, || moe.forward(x.clone()).expect("forward")),
    );
    report(
        "layer forward + backward",
        timed(device, iters, || {
            let (y, routing, _) = moe.forward(x.clone()).expect("forward");
            let loss = y.cast(DType::F32).sum() + routing.losses.total().expect("aux loss");
            loss.backward()
        }),
    );
}
