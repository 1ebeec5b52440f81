//! Tokenized datasets on disk: Megatron Core's files, packing, blends.

use burn_megatron_tests::{Harness, data_suite};

#[test]
fn megatron_files_both_ways() {
    data_suite::megatron_files_both_ways();
}

#[test]
fn broken_datasets_are_named() {
    data_suite::broken_datasets_are_named();
}

#[test]
fn packing_takes_every_token_once() {
    data_suite::packing_takes_every_token_once();
}

#[test]
fn packed_indexes_are_cached() {
    data_suite::packed_indexes_are_cached();
}

#[test]
fn blends_follow_their_weights() {
    data_suite::blends_follow_their_weights();
}

#[test]
fn sft_loss_counts_the_assistant_only() {
    data_suite::sft_loss_counts_the_assistant_only(&Harness::cpu(1));
    data_suite::sft_loss_counts_the_assistant_only(&Harness::cpu(2));
}

#[test]
fn chat_templates_render_as_transformers() {
    burn_megatron_tests::chat_suite::templates_render_as_transformers();
}

#[test]
fn packed_rows_train_as_their_documents() {
    burn_megatron_tests::packing_suite::packed_rows_train_as_their_documents(&Harness::cpu(1));
    burn_megatron_tests::packing_suite::packed_rows_train_as_their_documents(&Harness::cpu(2));
}

#[test]
fn chat_samples_pack_whole_conversations() {
    burn_megatron_tests::packing_suite::chat_samples_pack_whole_conversations();
}
