//! The tokenizer a GGUF file carries: `tokenizer.ggml.model = "gpt2"` (byte-level BPE) with its
//! vocabulary, merges and token types, built as a `tokenizers::Tokenizer`. The pre-tokenizer
//! follows `tokenizer.ggml.pre` as llama.cpp reads it: `smollm` splits every digit off before
//! GPT-2's byte-level split; `gpt2` and `default` are GPT-2's alone. Control and user-defined
//! tokens (`<|im_start|>`, …) are special: matched whole in the text, never split.

use std::path::Path;

use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, PreTokenizerWrapper, Tokenizer};

use super::{GgufError, GgufFile, Value};

/// GGUF's token types: 3 control, 4 user-defined.
const SPECIAL_TYPES: [usize; 2] = [3, 4];

/// The tokenizer of the GGUF file at `path`.
pub fn tokenizer(path: &Path) -> Result<Tokenizer, GgufError> {
    let file = GgufFile::open(path)?;
    let unsupported = |what: String| GgufError::Unsupported { what };
    let model = file.get("tokenizer.ggml.model")?.as_str().unwrap_or_default();
    if model != "gpt2" {
        return Err(unsupported(format!(
            "tokenizer model {model:?} (byte-level BPE, gpt2, is built)"
        )));
    }
    let texts = |key: &str| -> Result<Vec<String>, GgufError> {
        let list = file.get(key)?.as_list().unwrap_or_default();
        Ok(list
            .iter()
            .map(|v| v.as_str().unwrap_or_default().to_string())
            .collect())
    };
    let tokens = texts("tokenizer.ggml.tokens")?;
    let merges: Vec<(String, String)> = texts("tokenizer.ggml.merges")?
        .into_iter()
        .map(|m| match m.split_once(' ') {
            Some((a, b)) => Ok((a.to_string(), b.to_string())),
            None => Err(unsupported(format!("merge {m:?} (two tokens and a space)"))),
        })
        .collect::<Result<_, _>>()?;
    let vocab: Vocab = tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(|e| unsupported(format!("its BPE ({e})")))?;
    let mut tokenizer = Tokenizer::new(bpe);
    let byte_level = ByteLevel::new(false, true, true);
    let pre = file
        .metadata
        .get("tokenizer.ggml.pre")
        .and_then(Value::as_str)
        .unwrap_or("default");
    let pre_tokenizer: PreTokenizerWrapper = match pre {
        "smollm" => Sequence::new(vec![Digits::new(true).into(), byte_level.into()]).into(),
        "gpt2" | "gpt-2" | "default" => byte_level.into(),
        other => return Err(unsupported(format!("pre-tokenizer {other:?} (smollm, gpt2 are built)"))),
    };
    tokenizer.with_pre_tokenizer(Some(pre_tokenizer));
    tokenizer.with_decoder(Some(ByteLevel::default()));
    let types = file
        .metadata
        .get("tokenizer.ggml.token_type")
        .and_then(Value::as_list)
        .unwrap_or_default();
    let special: Vec<AddedToken> = tokens
        .iter()
        .zip(types)
        .filter(|(_, kind)| kind.as_usize().is_some_and(|k| SPECIAL_TYPES.contains(&k)))
        .map(|(token, _)| AddedToken::from(token.clone(), true))
        .collect();
    tokenizer.add_special_tokens(&special);
    Ok(tokenizer)
}

/// A GGUF file's chat template (`tokenizer.chat_template`, Jinja) and the special tokens it may
/// name (`bos_token`, `eos_token`: the texts of `tokenizer.ggml.bos_token_id` and `eos_token_id`).
#[derive(Clone, Debug, PartialEq)]
pub struct ChatTemplateText {
    pub template: String,
    pub tokens: Vec<(String, String)>,
}

/// The chat template the GGUF file at `path` carries; `None` where it carries none.
pub fn chat_template(path: &Path) -> Result<Option<ChatTemplateText>, GgufError> {
    let file = GgufFile::open(path)?;
    let Some(template) = file.metadata.get("tokenizer.chat_template").and_then(Value::as_str) else {
        return Ok(None);
    };
    let tokens = file
        .metadata
        .get("tokenizer.ggml.tokens")
        .and_then(Value::as_list)
        .unwrap_or_default();
    let named = ["bos", "eos"].into_iter().filter_map(|name| {
        let id = file
            .metadata
            .get(&format!("tokenizer.ggml.{name}_token_id"))?
            .as_usize()?;
        Some((format!("{name}_token"), tokens.get(id)?.as_str()?.to_string()))
    });
    Ok(Some(ChatTemplateText {
        template: template.to_string(),
        tokens: named.collect(),
    }))
}
