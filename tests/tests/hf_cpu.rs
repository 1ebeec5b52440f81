//! The Hugging Face suite on the CPU, ranks as threads, in f32: transformers' fixtures at tp = 1,
//! 2 and 4; refusals, the tied checkpoint and the export once each.

use burn_megatron_tests::{Harness, for_each_hf_test, hf_suite};

mod tp1 {
    use super::*;
    for_each_hf_test!(stamp!(Harness::cpu(1)));
}

mod tp2 {
    use super::*;
    for_each_hf_test!(stamp!(Harness::cpu(2)));
}

mod tp4 {
    use super::*;
    for_each_hf_test!(stamp!(Harness::cpu(4)));
}

#[test]
fn tied_checkpoint_resumes_at_other_tp() {
    hf_suite::tied_checkpoint_resumes_at_other_tp(&Harness::cpu(4));
}

#[test]
fn export_round_trip() {
    hf_suite::export_round_trip(&Harness::cpu(4));
}

#[test]
fn refused_config_fields() {
    hf_suite::refused_config_fields(&Harness::cpu(1));
}

#[test]
fn left_over_tensor_is_refused() {
    hf_suite::left_over_tensor_is_refused(&Harness::cpu(1));
}

#[test]
fn config_mismatching_the_model_is_refused() {
    hf_suite::config_mismatching_the_model_is_refused(&Harness::cpu(1));
}

/// Writes an export of the llama3 fixture for `tests/fixtures/hf/check_export.py`:
/// `HF_EXPORT_DIR=/tmp/export [HF_EXPORT_DTYPE=bf16] cargo test -p burn-megatron-tests --test hf_cpu
/// -- --ignored write_export_for_transformers`, then
/// `python3 tests/fixtures/hf/check_export.py /tmp/export tests/fixtures/hf/llama3/expected.json`.
#[test]
#[ignore = "writes an export to $HF_EXPORT_DIR for check_export.py"]
fn write_export_for_transformers() {
    let out = std::env::var("HF_EXPORT_DIR").expect("HF_EXPORT_DIR names the directory to write");
    let dtype = match std::env::var("HF_EXPORT_DTYPE").as_deref() {
        Ok("bf16") => burn_megatron::models::llama::hf::ExportDType::BF16,
        _ => burn_megatron::models::llama::hf::ExportDType::F32,
    };
    hf_suite::write_export(std::path::Path::new(&out), dtype);
    println!("wrote {out}");
}
