//! The checkpoint suite on the CPU, ranks as threads.

use burn_megatron_tests::{Harness, checkpoint_suite};

#[test]
fn resume_at_other_layouts() {
    checkpoint_suite::resume_at_other_layouts(&Harness::cpu(4));
}

#[test]
fn bad_checkpoints_are_errors() {
    checkpoint_suite::bad_checkpoints_are_errors(&Harness::cpu(1));
}

#[test]
fn hugging_face_round_trip() {
    checkpoint_suite::hugging_face_round_trip(&Harness::cpu(4));
}

#[test]
fn async_save_while_training() {
    checkpoint_suite::async_save_while_training(&Harness::cpu(4));
}

#[test]
fn tp2_dp2_matches_single_device_for_30_steps() {
    checkpoint_suite::tp2_dp2_matches_single_device_for_30_steps(&Harness::cpu(4));
}

#[test]
fn saver_keeps_the_newest() {
    checkpoint_suite::saver_keeps_the_newest(&Harness::cpu(4));
}

#[test]
fn failed_writes_leave_the_previous_checkpoint() {
    checkpoint_suite::failed_writes_leave_the_previous_checkpoint(&Harness::cpu(4));
}
