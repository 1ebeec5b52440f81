//! Tokenized datasets on disk against Megatron Core's files.

use burn_megatron_tests::data_suite;

#[test]
fn megatron_files_both_ways() {
    data_suite::megatron_files_both_ways();
}

#[test]
fn broken_datasets_are_named() {
    data_suite::broken_datasets_are_named();
}
