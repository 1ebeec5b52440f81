//! The Hugging Face suite on the CPU, ranks as threads, in f32: transformers' fixtures of every
//! family at tp = 1, 2 and 4 (and ep = tp for the MoE families); refusals, the tied checkpoint
//! and the exports once each.

use burn_megatron_tests::{Harness, family_suite, for_each_hf_test, hf_suite};

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
fn families_export_round_trip() {
    family_suite::families_export_round_trip(&Harness::cpu(2));
}

#[test]
fn families_train_as_on_one_rank() {
    family_suite::families_train_as_on_one_rank(&Harness::cpu(4));
}

#[test]
fn families_load_at_pp() {
    family_suite::families_load_at_pp(&Harness::cpu(4));
}

#[test]
fn families_train_under_fp8() {
    family_suite::families_train_under_fp8(&Harness::cpu(2));
}

#[test]
fn families_refuse_what_they_cannot_build() {
    family_suite::families_refuse_what_they_cannot_build(&Harness::cpu(1));
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

/// Writes an export of a fixture (`HF_EXPORT_FIXTURE`, llama3 by default) for
/// `tests/fixtures/hf/check_export.py`: `HF_EXPORT_DIR=/tmp/export [HF_EXPORT_FIXTURE=qwen3_moe]
/// [HF_EXPORT_DTYPE=bf16] cargo test -p burn-megatron-tests --test hf_cpu -- --ignored
/// write_export_for_transformers`, then `python3 tests/fixtures/hf/check_export.py /tmp/export
/// tests/fixtures/hf/qwen3_moe/expected.json`.
#[test]
#[ignore = "writes an export to $HF_EXPORT_DIR for check_export.py"]
fn write_export_for_transformers() {
    let out = std::env::var("HF_EXPORT_DIR").expect("HF_EXPORT_DIR names the directory to write");
    let fixture = std::env::var("HF_EXPORT_FIXTURE").unwrap_or_else(|_| "llama3".into());
    let dtype = match std::env::var("HF_EXPORT_DTYPE").as_deref() {
        Ok("bf16") => burn_megatron::models::llama::hf::ExportDType::BF16,
        _ => burn_megatron::models::llama::hf::ExportDType::F32,
    };
    family_suite::write_export(std::path::Path::new(&out), &fixture, dtype);
    println!("wrote {out}");
}
