//! The pipeline suite on the CPU, ranks as threads, in f32.

use burn_megatron_tests::{Harness, pipeline_suite};

#[test]
fn stages_match_one_rank() {
    pipeline_suite::stages_match_one_rank(&Harness::cpu(4));
}

#[test]
fn steps_match_one_rank() {
    pipeline_suite::steps_match_one_rank(&Harness::cpu(4));
}
