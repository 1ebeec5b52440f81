//! Parity suites for burn-megatron, written once and run on every backend and communicator.
//!
//! Each suite function takes a [`Harness`] (the devices, the float dtype, how ranks are
//! launched) and panics on the first disagreement. Every rank checks its own results, so the
//! same function runs with ranks as threads (CI, on the CPU), as threads on GPUs, and as one
//! process a GPU under torchrun. `tests/` stamps them out for the CPU; the `gpu-suite` binary
//! runs them on GPUs, each selected by its name and tags ([`gpu`]).

pub mod chat_suite;
pub mod checkpoint_suite;
pub mod comm_suite;
pub mod context_suite;
pub mod data;
pub mod data_suite;
pub mod distill_suite;
pub mod family_suite;
pub mod fuzz;
pub mod gguf_writer;
pub mod gpu;
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
pub mod packing_suite;
pub mod pipeline_suite;
pub mod posttrain_suite;
pub mod prune_suite;
pub mod ptq_suite;
pub mod recompute_suite;
pub mod train_suite;

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
            linear_round_trip, gemm_per_layer, layer_norm, position_embedding, tied_output }
    };
}

/// Calls `$callback!($args; moe_suite: <every MoE layer test>)`.
#[macro_export]
macro_rules! for_each_moe_layer_test {
    ($callback:ident!($($args:tt)*)) => {
        $crate::$callback! { $($args)*; moe_suite:
            ep2_all_to_all, ep2_all_gather, ep4_both_dispatchers, tp2_ep2, etp_below_tp, starved_rank,
            padded_expert_rows, capacity_over_ep }
    };
}

/// Calls `$callback!($args; moe_suite: <every MoE model test>)`.
#[macro_export]
macro_rules! for_each_moe_model_test {
    ($callback:ident!($($args:tt)*)) => {
        $crate::$callback! { $($args)*; moe_suite:
            moe_steps_match, experts_reshard_in_checkpoints, expert_bias_balances, bad_expert_layouts }
    };
}

/// Calls `$callback!($args; kernel_suite: <every kernel test>)` (CUDA only: the kernels' CPU
/// twins are tested in their crate).
#[macro_export]
macro_rules! for_each_kernel_test {
    ($callback:ident!($($args:tt)*)) => {
        $crate::$callback! { $($args)*; kernel_suite:
            wgmma_gemm, gated_gemm, residual_gemm, rotated_gemm, flash_attention, flash_repeats, flash_documents, swiglu, rms_norm, rope,
            adamw, adamw_master, sum_of_squares, f32_matmul, grouped_gemm, row_kernels, embedding_kernels,
            router_top_k, expert_order, router_product, fp8_tiles, fp8_gemm, fp8_amax, amax_notes, fp8_blocks,
            fp8_blockwise_gemm, quantized_linear, shared_input, weight_codes, emulated_blocks, cross_entropy,
            decode_step, graph_replay, greedy_choice, skinny_gemm }
    };
}

/// Calls `$callback!($args; hf_suite: <every Hugging Face test run at the harness's tp>)`.
#[macro_export]
macro_rules! for_each_hf_test {
    ($callback:ident!($($args:tt)*)) => {
        $crate::$callback! { $($args)*; hf_suite:
            llama2_matches_transformers, llama3_matches_transformers }
        $crate::$callback! { $($args)*; family_suite:
            mistral_matches_transformers, qwen2_matches_transformers, qwen3_matches_transformers,
            mixtral_matches_transformers, qwen3_moe_matches_transformers,
            deepseek_v3_matches_transformers, deepseek_v3_mtp_matches_its_definition,
            families_generate_as_transformers }
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
