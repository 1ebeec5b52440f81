#!/usr/bin/env bash
# Session 6 (carry .hfexport and .hfexport-bf16, written here by
#   HF_EXPORT_DIR=.hfexport [HF_EXPORT_DTYPE=bf16] cargo test -p burn-megatron-tests --test hf_cpu -- --ignored write_export_for_transformers):
# the llama3 fixture loaded at tp 2 and exported, opened by transformers' AutoModelForCausalLM,
# its loss on the fixture's batch against the loss transformers computed for the original.
set -u
cd "$(dirname "$0")/../.."
python3 tests/fixtures/hf/check_export.py .hfexport tests/fixtures/hf/llama3/expected.json
python3 tests/fixtures/hf/check_export.py .hfexport-bf16 tests/fixtures/hf/llama3/expected.json --tolerance 1e-2
