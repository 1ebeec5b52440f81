//! What `prepare-data` reads: the files of its inputs, and the documents of each (JSON lines,
//! Parquet rows, or a text file whole).

use std::path::{Path, PathBuf};

use burn_megatron::data::Turn;
use parquet::file::reader::SerializedFileReader;

/// The files under `path` (itself, if it is one).
pub fn collect(path: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    match path.is_dir() {
        true => {
            for entry in std::fs::read_dir(path)? {
                collect(&entry?.path(), out)?;
            }
        }
        false => {
            std::fs::metadata(path)?;
            out.push(path.to_path_buf());
        }
    }
    Ok(())
}

/// One document: text, or a chat's turns (role, content).
#[derive(Clone, Debug, PartialEq)]
pub enum Document {
    Text(String),
    Chat(Vec<Turn>),
}

/// The documents of one file: a JSON line or a Parquet row each (its `key`, or a chat's
/// `messages`), or the whole text.
pub fn documents_of(file: &Path, key: &str) -> Result<Vec<Document>, String> {
    if file.extension().is_some_and(|e| e == "parquet") {
        let rows = parquet_documents(file)?;
        return rows
            .iter()
            .enumerate()
            .map(|(n, row)| document(row, key).map_err(|e| format!("{}: row {n}: {e}", file.display())))
            .collect();
    }
    let bytes = std::fs::read(file).map_err(|e| format!("{}: {e}", file.display()))?;
    if bytes.is_empty() {
        return Err(format!("{}: an empty file", file.display()));
    }
    let text = String::from_utf8(bytes)
        .map_err(|e| format!("{}: not UTF-8 at byte {}", file.display(), e.utf8_error().valid_up_to()))?;
    let json = file.extension().is_some_and(|e| e == "jsonl" || e == "json");
    if !json {
        return Ok(vec![Document::Text(text)]);
    }
    let mut documents = Vec::new();
    for (n, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let at = |e| format!("{}:{}: {e}", file.display(), n + 1);
        let value: serde_json::Value = serde_json::from_str(line).map_err(|e| at(e.to_string()))?;
        documents.push(document(&value, key).map_err(at)?);
    }
    Ok(documents)
}

/// The documents of a Parquet file, a row each (as [`document`] reads a JSON line: a string
/// column `key`, or a `messages` column of {role, content} structs).
fn parquet_documents(file: &Path) -> Result<Vec<serde_json::Value>, String> {
    let fail = |e: String| format!("{}: {e}", file.display());
    let opened = std::fs::File::open(file).map_err(|e| fail(e.to_string()))?;
    let reader = SerializedFileReader::new(opened).map_err(|e| fail(format!("not a Parquet file ({e})")))?;
    reader
        .into_iter()
        .enumerate()
        .map(|(n, row)| {
            row.map(|r| r.to_json_value())
                .map_err(|e| fail(format!("row {n}: {e}")))
        })
        .collect()
}

/// One record's document: the string under `key`, or a chat's `messages`.
fn document(value: &serde_json::Value, key: &str) -> Result<Document, String> {
    match (value.get(key).and_then(|v| v.as_str()), value.get("messages")) {
        (Some(text), _) => Ok(Document::Text(text.to_string())),
        (None, Some(messages)) => Ok(Document::Chat(chat(messages)?)),
        (None, None) => Err(format!("no string under {key:?} (--json-key), no `messages`")),
    }
}

/// A chat's turns: `[{"role": …, "content": …}, …]`, at least one of them the assistant's.
fn chat(messages: &serde_json::Value) -> Result<Vec<Turn>, String> {
    let turns = messages.as_array().ok_or("`messages` is not a list")?;
    let turns = turns
        .iter()
        .enumerate()
        .map(|(i, turn)| {
            let field = |name: &str| {
                turn.get(name)
                    .and_then(|v| v.as_str())
                    .map(str::to_string)
                    .ok_or_else(|| format!("message {i} has no string `{name}`"))
            };
            Ok(Turn::new(&field("role")?, &field("content")?))
        })
        .collect::<Result<Vec<_>, String>>()?;
    if !turns.iter().any(|turn| turn.role == "assistant") {
        return Err("a chat without an assistant turn has nothing to learn".into());
    }
    Ok(turns)
}
