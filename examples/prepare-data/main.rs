//! Tokenizes text into a dataset `train --data.prefixes` reads: Megatron Core's indexed format
//! (`.bin` + `.idx`, `burn_megatron::data::indexed`), which Megatron's own training reads too.
//!
//!   prepare-data --input FILE|DIR... --tokenizer tokenizer.json|model.gguf --output PREFIX
//!
//! Inputs: JSON lines (`.jsonl`, `.json`: a document a line, its text under `--json-key`,
//! `text` by default), Parquet files (`.parquet`, as Hugging Face's datasets ship: a document a
//! row, the same column) and text files (any other file: a document a file); a directory is read
//! whole, its files in path order. Documents are tokenized in batches on every core
//! (`encode_batch`), each followed by the end-of-document token (`--eod`; by default the
//! tokenizer's `<|endoftext|>`, `</s>`, `<|end_of_text|>` or `<eos>`), and written as uint16
//! ids below a vocabulary of 65,500, int32 from there (Megatron's choice). The output appears
//! only when whole: a failure leaves nothing at `PREFIX`.
//!
//! A JSON line or Parquet row with `messages` (`[{"role": …, "content": …}, …]`) instead is a chat: rendered by
//! the chat template (`--chat-template`; by default the tokenizer's: its `tokenizer_config.json`'s,
//! the GGUF file's, else ChatML), one conversation a document with no end-of-document token
//! after it, and its loss mask written beside it (`PREFIX-mask`: a 1 for each token of the
//! assistant's turns).
//!
//! What a line or file cannot give is an error naming it: an empty input, bytes that are not
//! UTF-8 (with the byte), a JSON line that does not parse or lacks the key (with the line), a
//! template that cannot render a chat (with the message).

use std::path::{Path, PathBuf};
use std::time::Instant;

use burn_megatron::data::{ChatTemplate, IndexedWriter, TokenType, TokenizerConfig};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};

mod inputs;
#[cfg(test)]
mod tests;

use inputs::{Document, collect, documents_of};

/// Tokenizes text (JSON lines, Parquet or text files) into Megatron's indexed format.
#[derive(Parser, Debug)]
#[command(name = "prepare-data", args_override_self = true)]
struct Args {
    /// Files or directories of them (repeatable).
    #[arg(long, value_name = "PATH", required = true, num_args = 1..)]
    input: Vec<PathBuf>,
    /// A Hugging Face `tokenizer.json`, or a GGUF file (its vocabulary and merges).
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
    /// The chats' template: `chatml`, a `tokenizer_config.json` (its `chat_template` and special
    /// tokens) or a Jinja file (with the special tokens of the `tokenizer_config.json` beside the
    /// tokenizer, if any). By default the tokenizer's own, else ChatML.
    #[arg(long, value_name = "FILE|chatml")]
    chat_template: Option<PathBuf>,
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

/// Where a chat dataset at `prefix` keeps its loss mask (`burn_megatron::data::sft`).
fn mask_prefix(prefix: &Path) -> PathBuf {
    burn_megatron::data::sft::mask_prefix(prefix)
}

/// End-of-document tokens tried in order when `--eod` names none.
const EOD_CANDIDATES: [&str; 4] = ["<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>"];

/// Tokenizes every input into the dataset at `args.output`; returns the line it prints.
fn prepare(args: &Args, bar: bool) -> Result<String, String> {
    let start = Instant::now();
    let tokenizer = match args.tokenizer.extension().is_some_and(|e| e == "gguf") {
        true => burn_megatron::models::llama::gguf::tokenizer(&args.tokenizer).map_err(|e| e.to_string())?,
        false => burn_megatron::models::llama::hf::tokenizer(&args.tokenizer).map_err(|e| e.to_string())?,
    };
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
    let template = chat_template(args)?;
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
    // A chat dataset's loss mask: one more dataset, `PREFIX-mask`, a 0 or 1 a token.
    let mut masks: Option<IndexedWriter> = None;
    let (mut documents, mut tokens) = (0usize, 0usize);
    for file in &files {
        for chunk in documents_of(file, &args.json_key)?.chunks(args.batch.max(1)) {
            let chats = chunk.iter().filter(|d| matches!(d, Document::Chat(_))).count();
            let first_chats = documents == 0 && chats > 0;
            if first_chats {
                masks =
                    Some(IndexedWriter::create(&mask_prefix(&args.output), TokenType::U8).map_err(|e| e.to_string())?);
            }
            if (chats > 0 && chats < chunk.len()) || (chats > 0) != masks.is_some() {
                return Err(format!(
                    "{}: text and chats in one dataset: prepare them apart",
                    file.display()
                ));
            }
            let rendered = chunk
                .iter()
                .map(|d| match d {
                    Document::Text(text) => Ok((text.clone(), Vec::new())),
                    Document::Chat(turns) => template
                        .render(turns)
                        .map(|r| (r.text, r.learned))
                        .map_err(|e| format!("{}: {e}", file.display())),
                })
                .collect::<Result<Vec<_>, String>>()?;
            let texts: Vec<String> = rendered.iter().map(|(text, _)| text.clone()).collect();
            let encodings = tokenizer
                .encode_batch(texts, false)
                .map_err(|e| format!("{}: {e}", file.display()))?;
            for (encoding, (_, learned)) in encodings.iter().zip(&rendered) {
                let mut ids = encoding.get_ids().to_vec();
                match masks.as_mut() {
                    // A chat ends with its template's end of turn; the loss counts the assistant's.
                    Some(masks) => {
                        let mask: Vec<u32> = encoding
                            .get_offsets()
                            .iter()
                            .map(|&(start, _)| u32::from(learned.iter().any(|span| span.contains(&start))))
                            .collect();
                        masks.add_document(&mask).map_err(|e| e.to_string())?;
                    }
                    None => ids.push(eod),
                }
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
    let masks_written = masks.is_some();
    if let Some(masks) = masks {
        masks.finish().map_err(|e| e.to_string())?;
    }
    writer.finish().map_err(|e| e.to_string())?;
    let chats = match masks_written {
        true => format!(", chats rendered by {}", template.source()),
        false => String::new(),
    };
    Ok(format!(
        "{}: {documents} documents, {tokens} tokens (vocabulary {vocab}, end of document {eod}{chats}) in {:.1} s",
        args.output.display(),
        start.elapsed().as_secs_f64()
    ))
}

/// The template chats are rendered by: `--chat-template`'s, else the tokenizer's, else ChatML.
fn chat_template(args: &Args) -> Result<ChatTemplate, String> {
    let gguf = args.tokenizer.extension().is_some_and(|e| e == "gguf");
    let beside = args.tokenizer.with_file_name("tokenizer_config.json");
    let tokens_beside = || match !gguf && beside.exists() {
        true => TokenizerConfig::read(&beside).map(|c| c.tokens),
        false => Ok(Vec::new()),
    };
    let template = match &args.chat_template {
        Some(name) if name.as_os_str() == "chatml" => Ok(ChatTemplate::chatml()),
        Some(path) if path.extension().is_some_and(|e| e == "json") => ChatTemplate::from_tokenizer_config(path)
            .and_then(|t| {
                t.ok_or_else(|| {
                    burn_megatron::data::DataError::Config(format!("{}: no `chat_template`", path.display()))
                })
            }),
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
            tokens_beside().and_then(|tokens| ChatTemplate::with_tokens(&text, &tokens, &path.display().to_string()))
        }
        None if gguf => {
            let carried =
                burn_megatron::models::llama::gguf::chat_template(&args.tokenizer).map_err(|e| e.to_string())?;
            match carried {
                Some(carried) => ChatTemplate::with_tokens(
                    &carried.template,
                    &carried.tokens,
                    &args.tokenizer.display().to_string(),
                ),
                None => Ok(ChatTemplate::chatml()),
            }
        }
        None => ChatTemplate::beside(&args.tokenizer),
    };
    template.map_err(|e| e.to_string())
}
