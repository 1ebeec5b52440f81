//! Burn's Learner with `MegatronStrategy` on the CPU, ranks as threads: tp2 × dp2 against
//! tp1 × dp1.

use burn_megatron_tests::{Harness, learner_suite};

#[test]
fn learner_optimizer_overlapped() {
    learner_suite::learner_optimizer_overlapped(&Harness::cpu(4));
}

#[test]
fn learner_optimizer_after_backward() {
    learner_suite::learner_optimizer_after_backward(&Harness::cpu(4));
}

#[test]
fn distributed_optimizer_zero1() {
    learner_suite::distributed_optimizer_zero1(&Harness::cpu(4));
}

#[test]
fn burn_checkpointers_resume() {
    learner_suite::burn_checkpointers_resume(&Harness::cpu(4));
}

#[test]
fn pipeline_stages_match_one_rank() {
    learner_suite::pipeline_stages_match_one_rank(&Harness::cpu(4));
}

#[test]
fn after_step_moves_biases_and_histories() {
    learner_suite::after_step_moves_biases_and_histories(&Harness::cpu(2));
}
