//! The GGUF container (llama.cpp's format, versions 2 and 3): a header, typed key-value
//! metadata, tensor descriptions, then the tensors' bytes, aligned. Read from a memory map; a
//! tensor's bytes are decoded by `quant.rs`.
//!
//! Written here rather than taken from a crate: the format is a page of little-endian fields,
//! the crates that read it (gguf-rs, gguf) are young, single-author and decode no block type,
//! and what this project needs on top (the block types' dequantization, Llama's names and
//! layouts) is ours either way.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::Path;

use memmap2::Mmap;

use super::GgufError;
use super::quant::BlockType;

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    Int(i64),
    Float(f64),
    Bool(bool),
    Text(String),
    List(Vec<Value>),
}

impl Value {
    pub fn as_usize(&self) -> Option<usize> {
        match self {
            Value::Int(v) => usize::try_from(*v).ok(),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Value::Float(v) => Some(*v),
            Value::Int(v) => Some(*v as f64),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Text(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_list(&self) -> Option<&[Value]> {
        match self {
            Value::List(v) => Some(v),
            _ => None,
        }
    }
}

/// A tensor's description: its block type, its dims in GGUF's order (the first varies
/// fastest: a matrix of `rows × cols` is `[cols, rows]`) and its bytes in the map.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub kind: BlockType,
    pub dims: Vec<usize>,
    pub bytes: std::ops::Range<usize>,
}

impl TensorInfo {
    /// Its shape row-major, as PyTorch and safetensors give it.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().copied().collect()
    }

    pub fn numel(&self) -> usize {
        self.dims.iter().product()
    }
}

/// An open GGUF file.
pub struct GgufFile {
    map: Mmap,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: BTreeMap<String, TensorInfo>,
}

/// A cursor over the map's bytes that reports where the file ends too early.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
    path: &'a Path,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], GgufError> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len());
        let end = end.ok_or_else(|| self.error(format!("ends inside a field at byte {}", self.at)))?;
        let out = &self.bytes[self.at..end];
        self.at = end;
        Ok(out)
    }

    fn error(&self, detail: String) -> GgufError {
        GgufError::Format {
            path: self.path.display().to_string(),
            detail,
        }
    }

    fn u32(&mut self) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }

    fn u64(&mut self) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }

    /// A count or length, bounded by what is left of the file (a corrupt length is an error,
    /// not an allocation).
    fn len(&mut self) -> Result<usize, GgufError> {
        let n = self.u64()?;
        match usize::try_from(n).ok().filter(|&n| n <= self.bytes.len() - self.at) {
            Some(n) => Ok(n),
            None => Err(self.error(format!("a length of {n} at byte {} runs past the file", self.at - 8))),
        }
    }

    fn text(&mut self) -> Result<String, GgufError> {
        let n = self.len()?;
        let bytes = self.take(n)?.to_vec();
        String::from_utf8(bytes).map_err(|e| self.error(format!("a string is not UTF-8: {e}")))
    }

    fn value(&mut self, kind: u32) -> Result<Value, GgufError> {
        let int = |b: &[u8]| -> i64 {
            match b.len() {
                1 => b[0] as i64,
                2 => u16::from_le_bytes([b[0], b[1]]) as i64,
                4 => u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64,
                _ => i64::from_le_bytes(b.try_into().expect("8 bytes")),
            }
        };
        Ok(match kind {
            0 => Value::Int(int(self.take(1)?)),
            1 => Value::Int(self.take(1)?[0] as i8 as i64),
            2 => Value::Int(int(self.take(2)?)),
            3 => Value::Int(i16::from_le_bytes(self.take(2)?.try_into().expect("2 bytes")) as i64),
            4 => Value::Int(int(self.take(4)?)),
            5 => Value::Int(i32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")) as i64),
            6 => Value::Float(f32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")) as f64),
            7 => Value::Bool(self.take(1)?[0] != 0),
            8 => Value::Text(self.text()?),
            9 => {
                let inner = self.u32()?;
                let n = self.len()?;
                Value::List((0..n).map(|_| self.value(inner)).collect::<Result<_, _>>()?)
            }
            10 => Value::Int(self.u64()? as i64),
            11 => Value::Int(self.u64()? as i64),
            12 => Value::Float(f64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes"))),
            other => return Err(self.error(format!("unknown metadata type {other}"))),
        })
    }
}

impl GgufFile {
    /// Maps `path` and reads its header, metadata and tensor descriptions (no tensor data).
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        let io = |e: std::io::Error| GgufError::Io {
            path: path.display().to_string(),
            detail: e.to_string(),
        };
        let file = File::open(path).map_err(io)?;
        // SAFETY: the mapping is only read and lives as long as `GgufFile`; a model file is not
        // rewritten while it is loaded (another process truncating it would fault the reads).
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        let mut r = Reader {
            bytes: &map,
            at: 0,
            path,
        };
        if r.take(4)? != b"GGUF" {
            return Err(r.error("no GGUF magic".into()));
        }
        let version = r.u32()?;
        if !(2..=3).contains(&version) {
            return Err(r.error(format!("version {version}; versions 2 and 3 are read")));
        }
        let (n_tensors, n_metadata) = (r.len()?, r.len()?);
        let mut metadata = BTreeMap::new();
        for _ in 0..n_metadata {
            let key = r.text()?;
            let kind = r.u32()?;
            metadata.insert(key, r.value(kind)?);
        }
        let mut described = Vec::with_capacity(n_tensors);
        for _ in 0..n_tensors {
            let name = r.text()?;
            let n_dims = r.u32()? as usize;
            if n_dims > 4 {
                return Err(r.error(format!("tensor {name} has {n_dims} dims")));
            }
            let dims = (0..n_dims).map(|_| r.len()).collect::<Result<Vec<_>, _>>()?;
            let kind = r.u32()?;
            let offset = r.u64()? as usize;
            described.push((name, dims, kind, offset));
        }
        let alignment = metadata
            .get("general.alignment")
            .and_then(Value::as_usize)
            .unwrap_or(32)
            .max(1);
        let data = r.at.div_ceil(alignment) * alignment;
        let mut tensors = BTreeMap::new();
        for (name, dims, kind, offset) in described {
            let kind = BlockType::from_id(kind).ok_or_else(|| GgufError::Unsupported {
                what: format!("tensor {name}'s block type {kind}"),
            })?;
            let numel: usize = dims.iter().product();
            if !numel.is_multiple_of(kind.block()) || dims.first().is_some_and(|d| !d.is_multiple_of(kind.block())) {
                return Err(r.error(format!("tensor {name} of dims {dims:?} is not whole {kind:?} blocks")));
            }
            let start = data.checked_add(offset);
            let end = start.and_then(|s| s.checked_add(numel / kind.block() * kind.block_bytes()));
            match (start, end) {
                (Some(start), Some(end)) if end <= map.len() => {
                    tensors.insert(
                        name,
                        TensorInfo {
                            kind,
                            dims,
                            bytes: start..end,
                        },
                    );
                }
                _ => return Err(r.error(format!("tensor {name}'s data runs past the file"))),
            }
        }
        Ok(Self { map, metadata, tensors })
    }

    /// A tensor's values, dequantized to f32, row-major.
    pub fn values(&self, name: &str) -> Option<Vec<f32>> {
        let info = self.tensors.get(name)?;
        let mut out = vec![0.0; info.numel()];
        info.kind.decode(&self.map[info.bytes.clone()], &mut out);
        Some(out)
    }

    /// A metadata value, or an error naming the missing key.
    pub fn get(&self, key: &str) -> Result<&Value, GgufError> {
        self.metadata
            .get(key)
            .ok_or_else(|| GgufError::Missing { key: key.to_string() })
    }
}
