//! The context-parallel suite on the CPU, ranks as threads, in f32.

use burn_megatron_tests::{Harness, context_suite};

#[test]
fn attention_matches_one_rank() {
    context_suite::attention_matches_one_rank(&Harness::cpu(4));
}

#[test]
fn model_matches_one_rank() {
    context_suite::model_matches_one_rank(&Harness::cpu(4));
}

#[test]
fn packed_documents_match_one_rank() {
    context_suite::packed_documents_match_one_rank(&Harness::cpu(4));
}

#[test]
fn bad_context_layouts() {
    context_suite::bad_context_layouts(&Harness::cpu(1));
}
