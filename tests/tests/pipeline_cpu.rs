//! The pipeline and recomputation suites on the CPU, ranks as threads, in f32.

use burn_megatron_tests::{Harness, pipeline_suite, recompute_suite};

#[test]
fn stages_match_one_rank() {
    pipeline_suite::stages_match_one_rank(&Harness::cpu(4));
}

#[test]
fn moe_stages_match_one_rank() {
    pipeline_suite::moe_stages_match_one_rank(&Harness::cpu(4));
}

#[test]
fn steps_match_one_rank() {
    pipeline_suite::steps_match_one_rank(&Harness::cpu(4));
}

#[test]
fn recomputation_matches_keeping() {
    recompute_suite::recomputation_matches_keeping(&Harness::cpu(2));
}

#[test]
fn bad_recomputation() {
    recompute_suite::bad_recomputation(&Harness::cpu(1));
}

#[test]
fn tied_stages_match_one_rank() {
    pipeline_suite::tied_stages_match_one_rank(&Harness::cpu(4));
}

#[test]
fn bad_stages_are_errors() {
    pipeline_suite::bad_stages_are_errors(&Harness::cpu(1));
}
