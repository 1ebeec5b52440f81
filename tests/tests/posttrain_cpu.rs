//! The post-training suite on the CPU, ranks as threads, in f32: GGUF files, their tokenizer,
//! decoding with the KV cache, and post-training quantization's export.

use burn_megatron_tests::{Harness, posttrain_suite, ptq_suite};

#[test]
fn gguf_matches_transformers() {
    posttrain_suite::gguf_matches_transformers(&Harness::cpu(2));
}

#[test]
fn gguf_dequantizes_every_block() {
    posttrain_suite::gguf_dequantizes_every_block(&Harness::cpu(2));
}

#[test]
fn bad_gguf_files() {
    posttrain_suite::bad_gguf_files(&Harness::cpu(1));
}

#[test]
fn gguf_tokenizer() {
    posttrain_suite::gguf_tokenizer(&Harness::cpu(1));
}

#[test]
fn cached_decoding_matches_full_forward() {
    posttrain_suite::cached_decoding_matches_full_forward(&Harness::cpu(2));
}

#[test]
fn compressed_export_loads_at_any_tp() {
    ptq_suite::compressed_export_loads_at_any_tp(&Harness::cpu(2));
}

#[test]
fn ptq_errors() {
    ptq_suite::ptq_errors(&Harness::cpu(2));
}
