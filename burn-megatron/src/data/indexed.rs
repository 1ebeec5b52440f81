//! Megatron Core's indexed dataset (`MMapIndexedDataset`, `indexed_dataset.py`): a `.bin` of
//! token ids, sequence after sequence, and a `.idx` that says where each lies. A dataset made by
//! Megatron's `preprocess_data.py` reads here unchanged, and one written here trains there.
//!
//! `.idx`, little-endian: the magic `MMIDIDX\0\0`, version `u64` 1, the token dtype's code
//! `u8` ([`TokenType`]), the sequence count `S` and the document count `D` (`u64` each), then
//! `i32[S]` sequence lengths, `i64[S]` byte offsets of the sequences in the `.bin`, and `i64[D]`
//! document boundaries: the index of the first sequence of each document, then `S` (so `D` is
//! one more than the documents). A multimodal index adds `i8[S]` modes, which text ignores.
//!
//! [`IndexedDataset::open`] memory-maps both files and checks every count, length and offset
//! against the files' sizes before anything is read: no allocation is sized by a field of the
//! file, and a sequence is read straight from the mapping.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::DataError;

/// The `.idx` file's first bytes.
const MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";
/// Magic, version, dtype code, sequence and document counts.
const HEADER: usize = 9 + 8 + 1 + 8 + 8;

/// The dtype of a dataset's token ids, by Megatron's codes (`DType`): the integer ones (its
/// float codes 6 and 7 hold no token ids).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenType {
    U8,
    I8,
    I16,
    I32,
    I64,
    U16,
}

impl TokenType {
    fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            1 => Self::U8,
            2 => Self::I8,
            3 => Self::I16,
            4 => Self::I32,
            5 => Self::I64,
            8 => Self::U16,
            _ => return None,
        })
    }

    fn code(self) -> u8 {
        match self {
            Self::U8 => 1,
            Self::I8 => 2,
            Self::I16 => 3,
            Self::I32 => 4,
            Self::I64 => 5,
            Self::U16 => 8,
        }
    }

    /// Bytes a token.
    pub fn size(self) -> usize {
        match self {
            Self::U8 | Self::I8 => 1,
            Self::I16 | Self::U16 => 2,
            Self::I32 => 4,
            Self::I64 => 8,
        }
    }

    /// What Megatron's `preprocess_data.py` picks for a vocabulary (`DType.optimal_dtype`):
    /// `uint16` below 65,500 ids, `int32` from there.
    pub fn for_vocab(vocab: usize) -> Self {
        if vocab < 65_500 { Self::U16 } else { Self::I32 }
    }

    /// The largest id a token of this type holds.
    fn max(self) -> u64 {
        match self {
            Self::U8 => u8::MAX as u64,
            Self::I8 => i8::MAX as u64,
            Self::I16 => i16::MAX as u64,
            Self::U16 => u16::MAX as u64,
            Self::I32 => i32::MAX as u64,
            Self::I64 => i64::MAX as u64,
        }
    }

    /// The id of the little-endian token `bytes` (`size` of them); a negative one as `None`.
    fn decode(self, b: &[u8]) -> Option<u64> {
        let signed = match self {
            Self::U8 => return Some(b[0] as u64),
            Self::U16 => return Some(u16::from_le_bytes([b[0], b[1]]) as u64),
            Self::I8 => b[0] as i8 as i64,
            Self::I16 => i16::from_le_bytes([b[0], b[1]]) as i64,
            Self::I32 => i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64,
            Self::I64 => i64::from_le_bytes(b[..8].try_into().expect("8 bytes")),
        };
        u64::try_from(signed).ok()
    }

    fn encode(self, id: u32, out: &mut Vec<u8>) {
        match self {
            Self::U8 | Self::I8 => out.push(id as u8),
            Self::I16 | Self::U16 => out.extend_from_slice(&(id as u16).to_le_bytes()),
            Self::I32 => out.extend_from_slice(&(id as i32).to_le_bytes()),
            Self::I64 => out.extend_from_slice(&(id as i64).to_le_bytes()),
        }
    }
}

/// The two files of the dataset at `prefix` (`prefix.bin`, `prefix.idx`), as Megatron names them.
pub fn paths(prefix: &Path) -> (PathBuf, PathBuf) {
    let with = |ext: &str| {
        let mut path = prefix.as_os_str().to_owned();
        path.push(ext);
        PathBuf::from(path)
    };
    (with(".bin"), with(".idx"))
}

/// A memory-mapped indexed dataset, checked whole on opening.
pub struct IndexedDataset {
    idx_path: PathBuf,
    bin_path: PathBuf,
    idx: Mmap,
    bin: Option<Mmap>,
    dtype: TokenType,
    sequences: usize,
    documents: usize,
}

impl IndexedDataset {
    /// Opens the dataset at `prefix` (`prefix.bin`, `prefix.idx`).
    pub fn open(prefix: &Path) -> Result<Self, DataError> {
        let (bin_path, idx_path) = paths(prefix);
        let map = |path: &Path| -> Result<Option<Mmap>, DataError> {
            let file = File::open(path).map_err(|e| DataError::io(path, e))?;
            let len = file.metadata().map_err(|e| DataError::io(path, e))?.len();
            // An empty file has no mapping (mmap refuses length 0).
            if len == 0 {
                return Ok(None);
            }
            // SAFETY: the mapping is only read, and lives as long as the dataset. A dataset is
            // not rewritten while it trains; another process truncating it would fault reads.
            unsafe { Mmap::map(&file) }
                .map(Some)
                .map_err(|e| DataError::io(path, e))
        };
        let idx = map(&idx_path)?.ok_or_else(|| DataError::format(&idx_path, 0, "an empty index"))?;
        // An empty `.bin` holds only empty sequences.
        let bin = map(&bin_path)?;
        Self::check(idx_path, bin_path, idx, bin)
    }

    fn check(idx_path: PathBuf, bin_path: PathBuf, idx: Mmap, bin: Option<Mmap>) -> Result<Self, DataError> {
        let bin_len = bin.as_ref().map_or(0, |b| b.len() as u64);
        let bad = |offset: usize, detail: String| DataError::format(&idx_path, offset as u64, detail);
        if idx.len() < HEADER {
            return Err(bad(idx.len(), format!("{} bytes: shorter than the header", idx.len())));
        }
        if &idx[..9] != MAGIC {
            return Err(bad(0, "not a Megatron index (no MMIDIDX magic)".into()));
        }
        let version = u64::from_le_bytes(idx[9..17].try_into().expect("8 bytes"));
        if version != 1 {
            return Err(bad(9, format!("version {version}: only version 1 is written")));
        }
        let dtype = TokenType::from_code(idx[17])
            .ok_or_else(|| bad(17, format!("dtype code {}: no integer token type", idx[17])))?;
        let count = |at: usize| u64::from_le_bytes(idx[at..at + 8].try_into().expect("8 bytes"));
        let (sequences, documents) = (count(18), count(26));
        // The arrays must fit the file: counts checked before any use.
        let body = (idx.len() - HEADER) as u64;
        // The arrays, and a multimodal index's modes after them.
        let arrays = sequences
            .checked_mul(12)
            .and_then(|s| documents.checked_mul(8).and_then(|d| s.checked_add(d)));
        if !arrays.is_some_and(|n| n == body || sequences.checked_add(n) == Some(body)) {
            return Err(bad(
                18,
                format!("{sequences} sequences and {documents} document boundaries do not fill its {body} bytes"),
            ));
        }
        let (sequences, documents) = (sequences as usize, documents as usize);
        let dataset = Self {
            idx_path: idx_path.clone(),
            bin_path,
            idx,
            bin,
            dtype,
            sequences,
            documents,
        };
        let size = dtype.size() as u64;
        for i in 0..sequences {
            let (length, pointer) = (dataset.raw_length(i), dataset.raw_pointer(i));
            let end = u64::try_from(length)
                .ok()
                .zip(u64::try_from(pointer).ok())
                .filter(|(_, p)| p % size == 0)
                .and_then(|(l, p)| l.checked_mul(size)?.checked_add(p));
            match end {
                Some(end) if end <= bin_len => {}
                _ => {
                    return Err(bad(
                        HEADER + 4 * i,
                        format!(
                            "sequence {i}: {length} tokens from byte {pointer} do not lie in {} ({bin_len} bytes)",
                            dataset.bin_path.display()
                        ),
                    ));
                }
            }
        }
        let boundaries = HEADER + 12 * sequences;
        let mut previous = 0i64;
        for d in 0..documents {
            let at = boundaries + 8 * d;
            let first = i64::from_le_bytes(dataset.idx[at..at + 8].try_into().expect("8 bytes"));
            let fits = match d {
                0 => first == 0,
                _ if d + 1 == documents => first == sequences as i64 && first >= previous,
                _ => first >= previous && first <= sequences as i64,
            };
            if !fits {
                return Err(bad(
                    at,
                    format!("document boundary {d} is {first}: boundaries run from 0 up to {sequences}"),
                ));
            }
            previous = first;
        }
        if documents == 0 && sequences > 0 {
            return Err(bad(26, format!("{sequences} sequences but no document boundaries")));
        }
        Ok(dataset)
    }

    fn raw_length(&self, i: usize) -> i32 {
        let at = HEADER + 4 * i;
        i32::from_le_bytes(self.idx[at..at + 4].try_into().expect("4 bytes"))
    }

    fn raw_pointer(&self, i: usize) -> i64 {
        let at = HEADER + 4 * self.sequences + 8 * i;
        i64::from_le_bytes(self.idx[at..at + 8].try_into().expect("8 bytes"))
    }

    pub fn dtype(&self) -> TokenType {
        self.dtype
    }

    /// The sequences (Megatron's unit of packing: one a document, unless the data was split
    /// into sentences).
    pub fn len(&self) -> usize {
        self.sequences
    }

    pub fn is_empty(&self) -> bool {
        self.sequences == 0
    }

    /// The documents.
    pub fn documents(&self) -> usize {
        self.documents.saturating_sub(1)
    }

    /// The sequences of document `d`.
    pub fn document(&self, d: usize) -> Range<usize> {
        let at = |k: usize| {
            let at = HEADER + 12 * self.sequences + 8 * k;
            i64::from_le_bytes(self.idx[at..at + 8].try_into().expect("8 bytes")) as usize
        };
        at(d)..at(d + 1)
    }

    /// Tokens in sequence `i` (checked on opening: never negative).
    pub fn length(&self, i: usize) -> usize {
        self.raw_length(i) as usize
    }

    /// Tokens `offset..offset + out.len()` of sequence `i` into `out`; a token id that is
    /// negative or past `vocab` is an error naming the `.bin` and its byte.
    pub fn read(&self, i: usize, offset: usize, out: &mut [u32], vocab: usize) -> Result<(), DataError> {
        assert!(
            i < self.sequences && offset + out.len() <= self.length(i),
            "tokens {offset}..{} of sequence {i} of {} ({} sequences)",
            offset + out.len(),
            self.bin_path.display(),
            self.sequences
        );
        let size = self.dtype.size();
        let start = self.raw_pointer(i) as usize + offset * size;
        let bin = self.bin.as_deref().unwrap_or_default();
        let bytes = &bin[start..start + out.len() * size];
        for (k, (token, out)) in bytes.chunks_exact(size).zip(out.iter_mut()).enumerate() {
            match self.dtype.decode(token).filter(|&id| id < vocab as u64) {
                Some(id) => *out = id as u32,
                None => {
                    return Err(DataError::Token {
                        path: self.bin_path.display().to_string(),
                        offset: (start + k * size) as u64,
                        vocab,
                    });
                }
            }
        }
        Ok(())
    }

    /// Every token of sequence `i`.
    pub fn sequence(&self, i: usize, vocab: usize) -> Result<Vec<u32>, DataError> {
        let mut out = vec![0; self.length(i)];
        self.read(i, 0, &mut out, vocab)?;
        Ok(out)
    }

    /// The `.idx` file.
    pub fn index_path(&self) -> &Path {
        &self.idx_path
    }
}

/// Writes an indexed dataset a document at a time: `prefix.bin` and `prefix.idx` appear only
/// when [`finish`](Self::finish) succeeds (written beside them under `.tmp` names first, which a
/// failure or a drop removes).
pub struct IndexedWriter {
    prefix: PathBuf,
    dtype: TokenType,
    bin: BufWriter<File>,
    lengths: Vec<i32>,
    boundaries: Vec<i64>,
    buffer: Vec<u8>,
    done: bool,
}

impl IndexedWriter {
    pub fn create(prefix: &Path, dtype: TokenType) -> Result<Self, DataError> {
        let (bin, _) = temporary(prefix);
        if let Some(dir) = bin.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| DataError::io(dir, e))?;
        }
        let file = File::create(&bin).map_err(|e| DataError::io(&bin, e))?;
        Ok(Self {
            prefix: prefix.to_path_buf(),
            dtype,
            bin: BufWriter::new(file),
            lengths: Vec::new(),
            boundaries: vec![0],
            buffer: Vec::new(),
            done: false,
        })
    }

    /// Appends `tokens` as one sequence, closing a document with it (Megatron's `add_item`
    /// then `end_document`).
    pub fn add_document(&mut self, tokens: &[u32]) -> Result<(), DataError> {
        self.add_sequence(tokens)?;
        self.boundaries.push(self.lengths.len() as i64);
        Ok(())
    }

    /// Appends `tokens` as a sequence of the open document (a sentence, where documents are
    /// split).
    pub fn add_sequence(&mut self, tokens: &[u32]) -> Result<(), DataError> {
        let (bin, _) = temporary(&self.prefix);
        let length = i32::try_from(tokens.len()).map_err(|_| DataError::Write {
            path: bin.display().to_string(),
            detail: format!(
                "a sequence of {} tokens: an index holds at most {}",
                tokens.len(),
                i32::MAX
            ),
        })?;
        if let Some(&id) = tokens.iter().find(|&&id| id as u64 > self.dtype.max()) {
            return Err(DataError::Write {
                path: bin.display().to_string(),
                detail: format!("token {id} does not fit the dataset's {:?} ids", self.dtype),
            });
        }
        self.buffer.clear();
        tokens.iter().for_each(|&id| self.dtype.encode(id, &mut self.buffer));
        self.bin.write_all(&self.buffer).map_err(|e| DataError::io(&bin, e))?;
        self.lengths.push(length);
        Ok(())
    }

    /// Writes the index and moves both files into place; returns the sequences written.
    pub fn finish(mut self) -> Result<usize, DataError> {
        let (bin, idx) = temporary(&self.prefix);
        self.bin.flush().map_err(|e| DataError::io(&bin, e))?;
        if *self.boundaries.last().expect("the first boundary") != self.lengths.len() as i64 {
            // Sequences after the last document's end close one more document.
            self.boundaries.push(self.lengths.len() as i64);
        }
        let mut out = Vec::with_capacity(HEADER + 12 * self.lengths.len() + 8 * self.boundaries.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&1u64.to_le_bytes());
        out.push(self.dtype.code());
        out.extend_from_slice(&(self.lengths.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.boundaries.len() as u64).to_le_bytes());
        self.lengths
            .iter()
            .for_each(|l| out.extend_from_slice(&l.to_le_bytes()));
        let mut pointer = 0i64;
        for &length in &self.lengths {
            out.extend_from_slice(&pointer.to_le_bytes());
            pointer += length as i64 * self.dtype.size() as i64;
        }
        self.boundaries
            .iter()
            .for_each(|b| out.extend_from_slice(&b.to_le_bytes()));
        std::fs::write(&idx, &out).map_err(|e| DataError::io(&idx, e))?;
        let (final_bin, final_idx) = paths(&self.prefix);
        std::fs::rename(&bin, &final_bin).map_err(|e| DataError::io(&final_bin, e))?;
        std::fs::rename(&idx, &final_idx).map_err(|e| DataError::io(&final_idx, e))?;
        self.done = true;
        Ok(self.lengths.len())
    }
}

impl Drop for IndexedWriter {
    fn drop(&mut self) {
        if !self.done {
            let (bin, idx) = temporary(&self.prefix);
            let _ = std::fs::remove_file(bin);
            let _ = std::fs::remove_file(idx);
        }
    }
}

/// Where a writer keeps its files until they are whole.
fn temporary(prefix: &Path) -> (PathBuf, PathBuf) {
    let (bin, idx) = paths(prefix);
    let tmp = |p: PathBuf| {
        let mut s = p.into_os_string();
        s.push(".tmp");
        PathBuf::from(s)
    };
    (tmp(bin), tmp(idx))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("burn-megatron-indexed-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir.join("data")
    }

    /// Written and read back: every document's tokens, in every token type that holds them.
    #[test]
    fn round_trip() {
        let docs: Vec<Vec<u32>> = vec![vec![1, 2, 3], vec![], vec![7; 5], vec![120, 0, 4]];
        for dtype in [TokenType::U8, TokenType::U16, TokenType::I32, TokenType::I64] {
            let prefix = scratch(&format!("{dtype:?}"));
            let mut writer = IndexedWriter::create(&prefix, dtype).unwrap();
            docs.iter().for_each(|d| writer.add_document(d).unwrap());
            assert_eq!(writer.finish().unwrap(), 4);
            let data = IndexedDataset::open(&prefix).unwrap();
            assert_eq!((data.len(), data.documents(), data.dtype()), (4, 4, dtype));
            for (i, doc) in docs.iter().enumerate() {
                assert_eq!(data.document(i), i..i + 1);
                assert_eq!(&data.sequence(i, 128).unwrap(), doc);
            }
            let err = data.sequence(3, 100).unwrap_err();
            assert!(matches!(err, DataError::Token { vocab: 100, .. }), "{err}");
            let _ = std::fs::remove_dir_all(prefix.parent().unwrap());
        }
    }

    /// A token too large for the type is refused, and a writer dropped before `finish` leaves
    /// nothing behind.
    #[test]
    fn failed_writes_leave_nothing() {
        let prefix = scratch("failed");
        let mut writer = IndexedWriter::create(&prefix, TokenType::U8).unwrap();
        writer.add_document(&[1, 2]).unwrap();
        assert!(matches!(writer.add_document(&[300]), Err(DataError::Write { .. })));
        drop(writer);
        let dir = prefix.parent().unwrap();
        assert_eq!(
            std::fs::read_dir(dir).unwrap().count(),
            0,
            "files left in {}",
            dir.display()
        );
        let _ = std::fs::remove_dir_all(dir);
    }
}
