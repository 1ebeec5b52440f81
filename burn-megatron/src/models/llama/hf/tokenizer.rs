//! A Hugging Face `tokenizer.json`, read through the `tokenizers` crate, whose parser panics on
//! some malformed files (0.22.2: a decoder's `type` field, `decoders/mod.rs:90`, found by
//! fuzzing): such a panic is caught and becomes an error naming the file.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;

use tokenizers::Tokenizer;

use super::HfError;

/// The tokenizer in the `tokenizer.json` at `path`.
pub fn tokenizer(path: &Path) -> Result<Tokenizer, HfError> {
    let fail = |detail: String| HfError::Tokenizer {
        path: path.display().to_string(),
        detail,
    };
    let bytes = std::fs::read(path).map_err(|e| fail(e.to_string()))?;
    match catch_unwind(AssertUnwindSafe(|| Tokenizer::from_bytes(&bytes))) {
        Ok(parsed) => parsed.map_err(|e| fail(e.to_string())),
        Err(_) => Err(fail(
            "the tokenizers crate's parser panicked on it (a malformed file)".into(),
        )),
    }
}
