//! The training step on the CPU, ranks as threads: gradient accumulation against one batch,
//! a gradient that is not finite updating nothing, one reporting rank; Burn's Learner with `MegatronStrategy`, tp2 × dp2 against tp1 × dp1.

#[cfg(feature = "learner")]
use burn_megatron_tests::learner_suite;
use burn_megatron_tests::{Harness, train_suite};

#[test]
fn accumulation_matches_the_whole_batch() {
    train_suite::accumulation_matches_the_whole_batch(&Harness::cpu(4));
}

#[test]
fn nonfinite_gradient_updates_nothing() {
    train_suite::nonfinite_gradient_updates_nothing(&Harness::cpu(4));
}

#[test]
fn two_runs_are_bitwise_identical() {
    train_suite::two_runs_are_bitwise_identical(&Harness::cpu(2));
}

#[test]
fn one_rank_reports() {
    train_suite::one_rank_reports(&Harness::cpu(8));
}

#[cfg(feature = "learner")]
#[test]
fn learner_optimizer_overlapped() {
    learner_suite::learner_optimizer_overlapped(&Harness::cpu(4));
}

#[cfg(feature = "learner")]
#[test]
fn learner_optimizer_after_backward() {
    learner_suite::learner_optimizer_after_backward(&Harness::cpu(4));
}

#[cfg(feature = "learner")]
#[test]
fn distributed_optimizer_zero1() {
    learner_suite::distributed_optimizer_zero1(&Harness::cpu(4));
}

#[cfg(feature = "learner")]
#[test]
fn burn_checkpointers_resume() {
    learner_suite::burn_checkpointers_resume(&Harness::cpu(4));
}

#[cfg(feature = "learner")]
#[test]
fn pipeline_stages_match_one_rank() {
    learner_suite::pipeline_stages_match_one_rank(&Harness::cpu(4));
}

#[cfg(feature = "learner")]
#[test]
fn after_step_moves_biases_and_histories() {
    learner_suite::after_step_moves_biases_and_histories(&Harness::cpu(2));
}
