//! The GPU suite: every suite test that runs on CUDA, each with its name and its tags (the
//! numerics it runs under, and whether its ranks may be processes). The `gpu-suite` binary runs
//! what [`gpu_tests`] lists, selected by name and tag, never by position: a test added to one of
//! these lists (or to a suite's `for_each_…_test!` list) runs on the GPU without a change to the
//! runner.

use crate::Harness;

/// The harness a test runs under.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Numerics {
    /// f32 with no tolerance: the communicator tests check exact answers.
    Exact,
    /// f32 with the CPU's tolerances.
    F32,
    /// bf16 with tolerances for a few roundings of 8-bit mantissas.
    Bf16,
}

impl Numerics {
    /// Its tag in the runner's lines: `f32 `, `bf16 `, or none.
    pub fn tag(self) -> &'static str {
        match self {
            Numerics::Exact => "",
            Numerics::F32 => "f32 ",
            Numerics::Bf16 => "bf16 ",
        }
    }
}

/// Where a test's ranks may run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ranks {
    /// Threads, or one process a GPU under torchrun.
    Any,
    /// Threads only: the test launches layouts of its own (torchrun's world has one size).
    Threads,
}

/// One GPU test: its name (`suite::test`), its function and its tags.
#[derive(Clone, Copy, Debug)]
pub struct GpuTest {
    pub name: &'static str,
    pub run: fn(&Harness),
    pub numerics: &'static [Numerics],
    pub ranks: Ranks,
}

/// `GpuTest`s of one suite, all with the same tags: the callback of the suites'
/// `for_each_…_test!` lists, and the form of the lists below.
#[macro_export]
macro_rules! tagged {
    ([$($numerics:ident),+] $ranks:ident; $suite:ident: $($test:ident),* $(,)?) => {{
        const NUMERICS: &[$crate::gpu::Numerics] = &[$($crate::gpu::Numerics::$numerics),+];
        [$($crate::gpu::GpuTest {
            name: concat!(stringify!($suite), "::", stringify!($test)),
            run: $crate::$suite::$test,
            numerics: NUMERICS,
            ranks: $crate::gpu::Ranks::$ranks,
        }),*]
    }};
}

/// Every GPU test, in the order the runner takes them.
pub fn gpu_tests() -> Vec<GpuTest> {
    let mut all = Vec::new();
    all.extend(crate::for_each_comm_test!(tagged!([Exact] Any)));
    #[cfg(feature = "cuda")]
    all.extend(crate::for_each_kernel_test!(tagged!([Bf16] Any)));
    all.extend(crate::for_each_mapping_test!(tagged!([F32, Bf16] Any)));
    all.extend(crate::for_each_layer_test!(tagged!([F32, Bf16] Any)));
    // One model step in bf16 too; 20 AdamW steps in bf16 drift apart by more than a
    // meaningful tolerance: f32 only.
    all.extend(tagged!([F32, Bf16] Any; model_suite: tiny_loss_and_gradients));
    all.extend(tagged!([F32] Any; model_suite: adamw_steps_match, fp8_steps_match, fp8_delayed_steps_match));
    // Each launches a one-rank twin of its own beside the parallel world.
    all.extend(tagged!([F32] Threads; model_suite:
        zero1_matches_unsharded, grad_norm_counts_each_parameter_once, delayed_scaling_histories,
        delayed_histories_land_on_their_layers));
    #[cfg(feature = "cuda")]
    all.extend(tagged!([F32] Threads; model_suite: optimizer_keeps_weight_amaxes));
    // The layer in bf16 too; a model's 20 steps drift as the dense model's do: f32 only.
    all.extend(crate::for_each_moe_layer_test!(tagged!([F32, Bf16] Threads)));
    all.extend(crate::for_each_moe_model_test!(tagged!([F32] Threads)));
    all.extend(tagged!([F32] Threads; pipeline_suite:
        stages_match_one_rank, moe_stages_match_one_rank, tied_stages_match_one_rank));
    // Accumulation's sums grouped otherwise carried 3 Adam steps: f32 only.
    all.extend(tagged!([F32] Threads; train_suite: accumulation_matches_the_whole_batch, nonfinite_gradient_updates_nothing, one_rank_reports));
    all.extend(tagged!([F32, Bf16] Threads; train_suite: two_runs_are_bitwise_identical));
    // Flash attention and the fused kernels run inside recomputed regions: bf16 too.
    all.extend(tagged!([F32, Bf16] Threads; recompute_suite: recomputation_matches_keeping));
    // The attention in bf16 with heads of 128 too: the flash kernels, block by block.
    all.extend(tagged!([F32, Bf16] Threads; context_suite: attention_matches_one_rank));
    all.extend(tagged!([F32] Threads; context_suite: model_matches_one_rank));
    all.extend(tagged!([F32] Threads; context_suite: packed_documents_match_one_rank));
    all.extend(tagged!([F32, Bf16] Threads; posttrain_suite:
        cached_decoding_matches_full_forward, graph_decoding_matches_eager));
    // Packed rows against their documents alone: the attention's document mask and positions.
    all.extend(tagged!([F32] Threads; packing_suite: packed_rows_train_as_their_documents));
    // Against transformers' f32 numbers: f32 only.
    all.extend(tagged!([F32] Threads; hf_suite:
        llama2_matches_transformers, llama3_matches_transformers, tied_checkpoint_resumes_at_other_tp,
        export_round_trip));
    all
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    /// Every test is listed once, by a name that says its suite.
    #[test]
    fn names_are_unique_and_qualified() {
        let tests = gpu_tests();
        let names: HashSet<&str> = tests.iter().map(|t| t.name).collect();
        assert_eq!(names.len(), tests.len(), "a test listed twice");
        assert!(
            tests
                .iter()
                .all(|t| t.name.contains("_suite::") && !t.numerics.is_empty())
        );
    }
}
