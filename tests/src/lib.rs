//! Parity suites for burn-megatron, written once and run on every backend and communicator.
//!
//! Each suite function takes a [`Harness`] (the devices, the float dtype, how ranks are
//! launched) and panics on the first disagreement. Every rank checks its own results, so the
//! same function runs with ranks as threads (CI, on the CPU), as threads on GPUs, and as one
//! process a GPU under torchrun. `tests/` stamps them out for the CPU; the `gpu-suite` binary
//! runs them on GPUs.

pub mod checkpoint_suite;
pub mod comm_suite;
pub mod context_suite;
pub mod data;
pub mod distill_suite;
pub mod gguf_writer;
pub mod harness;
pub mod hf_suite;
#[cfg(feature = "cuda")]
pub mod kernel_suite;
pub mod layer_suite;
#[cfg(feature = "learner")]
pub mod learner_suite;
pub mod mapping_suite;
pub mod model_suite;
pub mod moe_suite;
pub mod pipeline_suite;
pub mod posttrain_suite;
pub mod prune_suite;
pub mod ptq_suite;
pub mod recompute_suite;

pub use harness::Harness;

/// Calls `$callback!($args; comm_suite: <every communicator test>)`.
#[macro_export]
macro_rules! for_each_comm_test {
    ($callback:ident!($($args:tt)*)) => {
        $crate::$callback! { $($args)*; comm_suite:
            all_reduce_floats, all_reduce_ints, all_gather_every_dim, reduce_scatter_every_dim, deferred_collectives,
            all_to_all_even_and_uneven, broadcast_send_recv_barrier,
            mismatches_are_errors_on_every_rank, a_missing_rank_times_out_with_its_name }
    };
}

/// Calls `$callback!($args; mapping_suite: <every mapping test>)`.
#[macro_export]
macro_rules! for_each_mapping_test {
    ($callback:ident!($($args:tt)*)) => {
        $crate::$callback! { $($args)*; mapping_suite:
            copy_to_tp_grads, reduce_from_tp_grads, scatter_to_sp_grads, gather_from_sp_grads,
            gather_from_tp_grads, reduce_scatter_to_sp_grads, all_to_all_grads,
            all_to_all_uneven_grads, mapping_errors_are_typed }
    };
}

/// Calls `$callback!($args; layer_suite: <every layer test>)`.
#[macro_export]
macro_rules! for_each_layer_test {
    ($callback:ident!($($args:tt)*)) => {
        $crate::$callback! { $($args)*; layer_suite:
            column_linear, row_linear, rms_norm, mlp, attention, embedding, cross_entropy,
            linear_round_trip, gemm_per_layer }
    };
}

/// Calls `$callback!($args; moe_suite: <every MoE test>)`.
#[macro_export]
macro_rules! for_each_moe_test {
    ($callback:ident!($($args:tt)*)) => {
        $crate::$callback! { $($args)*; moe_suite:
            ep2_all_to_all, ep2_all_gather, ep4_both_dispatchers, tp2_ep2, etp_below_tp, starved_rank,
            padded_expert_rows,
            capacity_over_ep,
            moe_steps_match, experts_reshard_in_checkpoints, expert_bias_balances, bad_expert_layouts }
    };
}

/// Calls `$callback!($args; hf_suite: <every Hugging Face test run at the harness's tp>)`.
#[macro_export]
macro_rules! for_each_hf_test {
    ($callback:ident!($($args:tt)*)) => {
        $crate::$callback! { $($args)*; hf_suite:
            llama2_matches_transformers, llama3_matches_transformers }
    };
}

/// One `#[test]` per suite function, for the harness `$harness`.
#[macro_export]
macro_rules! stamp {
    ($harness:expr; $suite:ident: $($test:ident),* $(,)?) => {
        $(
            #[test]
            fn $test() {
                $crate::$suite::$test(&$harness);
            }
        )*
    };
}

/// A `(name, function)` list of suite functions, for runners outside `cargo test`.
#[macro_export]
macro_rules! list {
    (; $suite:ident: $($test:ident),* $(,)?) => {
        &[$((concat!(stringify!($suite), "::", stringify!($test)), $crate::$suite::$test as fn(&$crate::Harness))),*]
    };
}

/// A suite test and its name, for the GPU binary's list.
pub type NamedTest = (&'static str, fn(&Harness));

/// Every communicator test, by name.
pub const COMM_TESTS: &[NamedTest] = for_each_comm_test!(list!());
/// Every layer test, by name.
pub const LAYER_TESTS: &[NamedTest] = for_each_layer_test!(list!());
/// Every kernel test, by name (CUDA only: the kernels' CPU twins are tested in their crate).
#[cfg(feature = "cuda")]
pub const KERNEL_TESTS: &[NamedTest] = &[
    ("kernel_suite::wgmma_gemm", kernel_suite::wgmma_gemm),
    ("kernel_suite::gated_gemm", kernel_suite::gated_gemm),
    ("kernel_suite::residual_gemm", kernel_suite::residual_gemm),
    ("kernel_suite::rotated_gemm", kernel_suite::rotated_gemm),
    ("kernel_suite::flash_attention", kernel_suite::flash_attention),
    ("kernel_suite::swiglu", kernel_suite::swiglu),
    ("kernel_suite::rms_norm", kernel_suite::rms_norm),
    ("kernel_suite::rope", kernel_suite::rope),
    ("kernel_suite::adamw", kernel_suite::adamw),
    ("kernel_suite::adamw_master", kernel_suite::adamw_master),
    ("kernel_suite::sum_of_squares", kernel_suite::sum_of_squares),
    ("kernel_suite::f32_matmul", kernel_suite::f32_matmul),
    ("kernel_suite::grouped_gemm", kernel_suite::grouped_gemm),
    ("kernel_suite::row_kernels", kernel_suite::row_kernels),
    ("kernel_suite::embedding_kernels", kernel_suite::embedding_kernels),
    ("kernel_suite::router_top_k", kernel_suite::router_top_k),
    ("kernel_suite::expert_order", kernel_suite::expert_order),
    ("kernel_suite::router_product", kernel_suite::router_product),
    ("kernel_suite::fp8_tiles", kernel_suite::fp8_tiles),
    ("kernel_suite::fp8_gemm", kernel_suite::fp8_gemm),
    ("kernel_suite::fp8_amax", kernel_suite::fp8_amax),
    ("kernel_suite::amax_notes", kernel_suite::amax_notes),
    ("kernel_suite::fp8_blocks", kernel_suite::fp8_blocks),
    ("kernel_suite::fp8_blockwise_gemm", kernel_suite::fp8_blockwise_gemm),
    ("kernel_suite::quantized_linear", kernel_suite::quantized_linear),
    ("kernel_suite::shared_input", kernel_suite::shared_input),
    ("kernel_suite::weight_codes", kernel_suite::weight_codes),
    ("kernel_suite::emulated_blocks", kernel_suite::emulated_blocks),
    ("kernel_suite::cross_entropy", kernel_suite::cross_entropy),
    ("kernel_suite::decode_step", kernel_suite::decode_step),
    ("kernel_suite::graph_replay", kernel_suite::graph_replay),
    ("kernel_suite::greedy_choice", kernel_suite::greedy_choice),
    ("kernel_suite::skinny_gemm", kernel_suite::skinny_gemm),
];
/// Every model test, by name.
pub const MODEL_TESTS: &[NamedTest] = &[
    (
        "model_suite::tiny_loss_and_gradients",
        model_suite::tiny_loss_and_gradients,
    ),
    ("model_suite::adamw_steps_match", model_suite::adamw_steps_match),
    ("model_suite::fp8_steps_match", model_suite::fp8_steps_match),
    (
        "model_suite::fp8_delayed_steps_match",
        model_suite::fp8_delayed_steps_match,
    ),
];
/// The data-parallel model tests. Each launches a one-rank twin of its own beside the parallel
/// world, so they run with ranks as threads only (torchrun's world has one size).
pub const DP_MODEL_TESTS: &[NamedTest] = &[
    (
        "model_suite::zero1_matches_unsharded",
        model_suite::zero1_matches_unsharded,
    ),
    (
        "model_suite::grad_norm_counts_each_parameter_once",
        model_suite::grad_norm_counts_each_parameter_once,
    ),
    (
        "model_suite::delayed_scaling_histories",
        model_suite::delayed_scaling_histories,
    ),
    (
        "model_suite::delayed_histories_land_on_their_layers",
        model_suite::delayed_histories_land_on_their_layers,
    ),
];
/// The data-parallel model tests of what only CUDA does (ranks as threads only, as
/// [`DP_MODEL_TESTS`]).
#[cfg(feature = "cuda")]
pub const CUDA_DP_MODEL_TESTS: &[NamedTest] = &[(
    "model_suite::optimizer_keeps_weight_amaxes",
    model_suite::optimizer_keeps_weight_amaxes,
)];
/// The decoding tests on a model, by name: cached decoding against the full forward pass (at
/// tp 1 and the harness's tp), and the CUDA graph's steps against the eager ones. They launch
/// their own layouts, so they run with ranks as threads only.
pub const DECODE_TESTS: &[NamedTest] = &[
    (
        "posttrain_suite::cached_decoding_matches_full_forward",
        posttrain_suite::cached_decoding_matches_full_forward,
    ),
    (
        "posttrain_suite::graph_decoding_matches_eager",
        posttrain_suite::graph_decoding_matches_eager,
    ),
];
/// The context-parallel tests, by name: attention first, then the model. Each launches its
/// own layouts (worlds of 1 to 4), so they run with ranks as threads only.
pub const CONTEXT_TESTS: &[NamedTest] = &[
    (
        "context_suite::attention_matches_one_rank",
        context_suite::attention_matches_one_rank,
    ),
    (
        "context_suite::model_matches_one_rank",
        context_suite::model_matches_one_rank,
    ),
];
/// Every mapping test, by name.
pub const MAPPING_TESTS: &[NamedTest] = for_each_mapping_test!(list!());
/// Every MoE test, by name: the layer's first, then the model's. Each launches its own layouts
/// (worlds of 1 to 4), so they run with ranks as threads only.
pub const MOE_TESTS: &[NamedTest] = for_each_moe_test!(list!());
/// How many of [`MOE_TESTS`] test the layer alone.
pub const MOE_LAYER_TESTS: usize = 8;
/// The Hugging Face tests that run on the harness's device, by name: transformers' fixtures
/// (the tied llama3 among them) at the harness's tp, the tied model trained, saved and resumed at
/// tp 1 and 4, and the export read back. The tied and export tests launch their own layouts, so
/// they run with ranks as threads only.
pub const HF_TESTS: &[NamedTest] = &[
    (
        "hf_suite::llama2_matches_transformers",
        hf_suite::llama2_matches_transformers,
    ),
    (
        "hf_suite::llama3_matches_transformers",
        hf_suite::llama3_matches_transformers,
    ),
    (
        "hf_suite::tied_checkpoint_resumes_at_other_tp",
        hf_suite::tied_checkpoint_resumes_at_other_tp,
    ),
    ("hf_suite::export_round_trip", hf_suite::export_round_trip),
];
/// The pipeline and recomputation tests, by name: recomputation last. Each launches its own
/// layouts (worlds of 1 to 4), so they run with ranks as threads only.
pub const PIPELINE_TESTS: &[NamedTest] = &[
    (
        "pipeline_suite::stages_match_one_rank",
        pipeline_suite::stages_match_one_rank,
    ),
    (
        "pipeline_suite::moe_stages_match_one_rank",
        pipeline_suite::moe_stages_match_one_rank,
    ),
    (
        "pipeline_suite::tied_stages_match_one_rank",
        pipeline_suite::tied_stages_match_one_rank,
    ),
    (
        "recompute_suite::recomputation_matches_keeping",
        recompute_suite::recomputation_matches_keeping,
    ),
];
