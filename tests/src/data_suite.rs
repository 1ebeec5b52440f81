//! Tokenized datasets on disk (`burn_megatron::data`) against Megatron Core's own code: the
//! indexed files its builder wrote (`tests/fixtures/data`, `make_indexed.py`) read back token for
//! token, and the same documents written by ours byte for byte as its builder wrote them; what a
//! broken dataset gets.

use std::path::{Path, PathBuf};

use burn_megatron::data::{DataError, IndexedDataset, IndexedWriter, TokenType, indexed};
use serde_json::Value;

/// The directory of `make_indexed.py`'s files (see `hf_suite::fixture` for the lookup).
pub fn fixtures() -> PathBuf {
    let running = std::env::var_os("CARGO_MANIFEST_DIR").map(|dir| Path::new(&dir).join("fixtures/data"));
    running
        .into_iter()
        .chain([Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/data")])
        .find(|dir| dir.exists())
        .unwrap_or_else(|| PathBuf::from("tests/fixtures/data"))
}

fn scratch(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("burn-megatron-data-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Each dataset's documents, each a list of its sequences' tokens, as Megatron's reader gave them.
fn documents(entry: &Value) -> Vec<Vec<Vec<u32>>> {
    serde_json::from_value(entry["documents"].clone()).unwrap()
}

/// Megatron's files read by ours: every document's sequences token for token, the dtype its
/// code names; ours writing the same documents: Megatron's bytes.
pub fn megatron_files_both_ways() {
    let dir = fixtures();
    let fixture: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("indexed.json")).unwrap()).unwrap();
    for (name, dtype) in [("megatron_u16", TokenType::U16), ("megatron_i32", TokenType::I32)] {
        let docs = documents(&fixture[name]);
        let data = IndexedDataset::open(&dir.join(name)).unwrap();
        assert_eq!(data.dtype(), dtype, "{name}");
        assert_eq!(data.documents(), docs.len(), "{name}");
        for (d, doc) in docs.iter().enumerate() {
            let read: Vec<Vec<u32>> = data.document(d).map(|i| data.sequence(i, 1 << 20).unwrap()).collect();
            assert_eq!(&read, doc, "{name} document {d}");
        }
        let out = scratch(name).join(name);
        let mut writer = IndexedWriter::create(&out, dtype).unwrap();
        for doc in &docs {
            let (last, rest) = doc.split_last().unwrap();
            rest.iter().for_each(|s| writer.add_sequence(s).unwrap());
            writer.add_document(last).unwrap();
        }
        writer.finish().unwrap();
        let (ours, theirs) = (indexed::paths(&out), indexed::paths(&dir.join(name)));
        for (a, b) in [(ours.0, theirs.0), (ours.1, theirs.1)] {
            assert!(
                std::fs::read(&a).unwrap() == std::fs::read(&b).unwrap(),
                "{} differs from {}",
                a.display(),
                b.display()
            );
        }
        let _ = std::fs::remove_dir_all(out.parent().unwrap());
    }
}

/// A broken dataset is a typed error naming the file and the byte: an empty index, a foreign
/// file, a count past the file, a sequence past its `.bin`, a boundary out of order, a token past
/// the vocabulary; a missing `.bin` names it.
pub fn broken_datasets_are_named() {
    let dir = fixtures();
    let idx = std::fs::read(dir.join("megatron_u16.idx")).unwrap();
    let bin = std::fs::read(dir.join("megatron_u16.bin")).unwrap();
    let out = scratch("broken");
    let open = |idx: &[u8], bin: Option<&[u8]>| {
        let prefix = out.join("d");
        let (b, i) = indexed::paths(&prefix);
        std::fs::write(&i, idx).unwrap();
        let _ = std::fs::remove_file(&b);
        if let Some(bin) = bin {
            std::fs::write(&b, bin).unwrap();
        }
        IndexedDataset::open(&prefix).map(|_| ())
    };
    let format_at = |result: Result<(), DataError>, at: u64, what: &str| match result {
        Err(DataError::Format { offset, path, .. }) => {
            assert_eq!(offset, at, "{what}");
            assert!(path.ends_with("d.idx"), "{what}: {path}");
        }
        other => panic!("{what}: {other:?}"),
    };
    format_at(open(&[], Some(&bin)), 0, "empty index");
    format_at(
        open(b"not an index at all, longer than a header", Some(&bin)),
        0,
        "foreign file",
    );
    let mut more = idx.clone();
    more[18] = 0xff; // the sequence count
    format_at(open(&more, Some(&bin)), 18, "sequence count past the file");
    // Seven sequences: the last one's length at byte 34 + 4 · 6.
    format_at(
        open(&idx, Some(&bin[..bin.len() - 2])),
        34 + 4 * 6,
        "the last sequence past a cut .bin",
    );
    let mut disorder = idx.clone();
    let boundaries = 34 + 12 * 7;
    disorder[boundaries + 16..boundaries + 24].copy_from_slice(&9i64.to_le_bytes());
    format_at(
        open(&disorder, Some(&bin)),
        (boundaries + 16) as u64,
        "a boundary past the sequences",
    );
    match open(&idx, None) {
        Err(DataError::Io { path, .. }) => assert!(path.ends_with("d.bin"), "{path}"),
        other => panic!("missing .bin: {other:?}"),
    }
    let data = IndexedDataset::open(&dir.join("megatron_u16")).unwrap();
    match data.sequence(6, 1000) {
        Err(DataError::Token { offset, vocab, path }) => {
            assert_eq!(
                (offset, vocab),
                (24, 1000),
                "40000, the last sequence's first token, after 12 tokens of 2 bytes"
            );
            assert!(path.ends_with("megatron_u16.bin"), "{path}");
        }
        other => panic!("token past the vocabulary: {other:?}"),
    }
    let _ = std::fs::remove_dir_all(&out);
}
