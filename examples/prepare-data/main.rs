//! Tokenizes text into a dataset `train --data.prefixes` reads: Megatron Core's indexed format
//! (`.bin` + `.idx`, `burn_megatron::data::indexed`), which Megatron's own training reads too.
//!
//!   prepare-data --input FILE|DIR... --tokenizer tokenizer.json --output PREFIX
//!
//! Inputs: JSON lines (`.jsonl`, `.json`: a document a line, its text under `--json-key`,
//! `text` by default) and text files (any other file: a document a file); a directory is read
//! whole, its files in path order. Documents are tokenized in batches on every core
//! (`encode_batch`), each followed by the end-of-document token (`--eod`; by default the
//! tokenizer's `<|endoftext|>`, `</s>`, `<|end_of_text|>` or `<eos>`), and written as uint16
//! ids below a vocabulary of 65,500, int32 from there (Megatron's choice). The output appears
//! only when whole: a failure leaves nothing at `PREFIX`.
//!
//! What a line or file cannot give is an error naming it: an empty input, bytes that are not
//! UTF-8 (with the byte), a JSON line that does not parse or lacks the key (with the line), a
//! chat (`messages`) line (chat SFT datasets are not built here).

use std::path::{Path, PathBuf};
use std::time::Instant;

use burn_megatron::data::{IndexedWriter, TokenType};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};

#[cfg(test)]
mod tests;

/// Tokenizes text (JSON lines or text files) into Megatron's indexed format.
#[derive(Parser, Debug)]
#[command(name = "prepare-data", args_override_self = true)]
struct Args {
    /// Files or directories of them (repeatable).
    #[arg(long, value_name = "PATH", required = true, num_args = 1..)]
    input: Vec<PathBuf>,
    /// A Hugging Face `tokenizer.json`.
    #[arg(long, value_name = "FILE")]
    tokenizer: PathBuf,
    /// The dataset's prefix: writes PREFIX.bin and PREFIX.idx.
    #[arg(long, value_name = "PREFIX")]
    output: PathBuf,
    /// The key of a JSON line's text.
    #[arg(long, value_name = "KEY", default_value = "text")]
    json_key: String,
    /// The end-of-document token (by default the tokenizer's first of `<|endoftext|>`, `</s>`,
    /// `<|end_of_text|>`, `<eos>`).
    #[arg(long, value_name = "TOKEN")]
    eod: Option<String>,
    /// Documents tokenized together.
    #[arg(long, value_name = "N", default_value_t = 1024)]
    batch: usize,
}

fn main() {
    let args = Args::parse();
    match prepare(&args, std::io::IsTerminal::is_terminal(&std::io::stderr())) {
        Ok(summary) => println!("{summary}"),
        Err(e) => {
            eprintln!("prepare-data: {e}");
            std::process::exit(1);
        }
    }
}

/// End-of-document tokens tried in order when `--eod` names none.
const EOD_CANDIDATES: [&str; 4] = ["<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>"];

/// Tokenizes every input into the dataset at `args.output`; returns the line it prints.
fn prepare(args: &Args, bar: bool) -> Result<String, String> {
    let start = Instant::now();
    let tokenizer = burn_megatron::models::llama::hf::tokenizer(&args.tokenizer).map_err(|e| e.to_string())?;
    let eod = match &args.eod {
        Some(token) => tokenizer
            .token_to_id(token)
            .ok_or_else(|| format!("{}: no token {token:?} (--eod)", args.tokenizer.display()))?,
        None => EOD_CANDIDATES
            .iter()
            .find_map(|t| tokenizer.token_to_id(t))
            .ok_or_else(|| {
                format!(
                    "{}: none of {EOD_CANDIDATES:?}: name the end-of-document token with --eod",
                    args.tokenizer.display()
                )
            })?,
    };
    let mut files = Vec::new();
    for input in &args.input {
        collect(input, &mut files).map_err(|e| format!("{}: {e}", input.display()))?;
    }
    files.sort();
    let bytes: u64 = files.iter().filter_map(|f| f.metadata().ok()).map(|m| m.len()).sum();
    let progress = match bar {
        true => ProgressBar::new(bytes).with_style(
            ProgressStyle::with_template("{bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")
                .expect("a valid template"),
        ),
        false => ProgressBar::hidden(),
    };
    let vocab = tokenizer.get_vocab_size(true);
    let mut writer = IndexedWriter::create(&args.output, TokenType::for_vocab(vocab)).map_err(|e| e.to_string())?;
    let (mut documents, mut tokens) = (0usize, 0usize);
    for file in &files {
        let texts = documents_of(file, &args.json_key)?;
        for chunk in texts.chunks(args.batch.max(1)) {
            let encodings = tokenizer
                .encode_batch(chunk.to_vec(), false)
                .map_err(|e| format!("{}: {e}", file.display()))?;
            for encoding in encodings {
                let mut ids = encoding.get_ids().to_vec();
                ids.push(eod);
                tokens += ids.len();
                writer.add_document(&ids).map_err(|e| e.to_string())?;
                documents += 1;
            }
        }
        progress.inc(file.metadata().map_or(0, |m| m.len()));
    }
    progress.finish_and_clear();
    if documents == 0 {
        return Err(format!("{:?}: no documents", args.input));
    }
    writer.finish().map_err(|e| e.to_string())?;
    Ok(format!(
        "{}: {documents} documents, {tokens} tokens (vocabulary {vocab}, end of document {eod}) in {:.1} s",
        args.output.display(),
        start.elapsed().as_secs_f64()
    ))
}

/// The files under `path` (itself, if it is one).
fn collect(path: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
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

/// The documents of one file: a JSON line each (its `key`), or the whole text.
fn documents_of(file: &Path, key: &str) -> Result<Vec<String>, String> {
    let bytes = std::fs::read(file).map_err(|e| format!("{}: {e}", file.display()))?;
    if bytes.is_empty() {
        return Err(format!("{}: an empty file", file.display()));
    }
    let text = String::from_utf8(bytes)
        .map_err(|e| format!("{}: not UTF-8 at byte {}", file.display(), e.utf8_error().valid_up_to()))?;
    let json = file.extension().is_some_and(|e| e == "jsonl" || e == "json");
    if !json {
        return Ok(vec![text]);
    }
    let mut documents = Vec::new();
    for (n, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let at = || format!("{}:{}", file.display(), n + 1);
        let value: serde_json::Value = serde_json::from_str(line).map_err(|e| format!("{}: {e}", at()))?;
        match value.get(key).and_then(|v| v.as_str()) {
            Some(text) => documents.push(text.to_string()),
            None if value.get("messages").is_some() => {
                return Err(format!(
                    "{}: a chat (`messages`) line: chat SFT datasets are not built; give a `{key}` field",
                    at()
                ));
            }
            None => return Err(format!("{}: no string under {key:?} (--json-key)", at())),
        }
    }
    Ok(documents)
}
