//! The post-training suite on the CPU, ranks as threads, in f32: GGUF files, their tokenizer,
//! decoding with the KV cache, post-training quantization's export, pruning and distillation.

use burn_megatron_tests::{Harness, distill_suite, posttrain_suite, prune_suite, ptq_suite};

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
fn gptq_lowers_the_error() {
    ptq_suite::gptq_lowers_the_error(&Harness::cpu(1));
}

#[test]
fn ptq_errors() {
    ptq_suite::ptq_errors(&Harness::cpu(2));
}

#[test]
fn pruning_to_its_own_size_keeps_the_function() {
    prune_suite::pruning_to_its_own_size_keeps_the_function(&Harness::cpu(1));
}

#[test]
fn pruned_rows_and_columns_save_and_load() {
    prune_suite::pruned_rows_and_columns_save_and_load(&Harness::cpu(2));
}

#[test]
fn a_pass_through_block_ranks_last() {
    prune_suite::a_pass_through_block_ranks_last(&Harness::cpu(1));
}

#[test]
fn bad_prune_targets() {
    prune_suite::bad_prune_targets(&Harness::cpu(2));
}

#[test]
fn kl_is_the_same_at_tp_2() {
    distill_suite::kl_is_the_same_at_tp_2(&Harness::cpu(2));
}

#[test]
fn distillation_smoke() {
    distill_suite::distillation_smoke(&Harness::cpu(2));
}

#[test]
fn graph_decoding_matches_eager() {
    posttrain_suite::graph_decoding_matches_eager(&Harness::cpu(1));
}

#[test]
fn cache_serves_its_own_model() {
    posttrain_suite::cache_serves_its_own_model(&Harness::cpu(1));
}
