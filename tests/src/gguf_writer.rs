//! A GGUF writer for the tests, written from llama.cpp's format description independently of
//! the loader it checks: metadata, tensors in F32, Q8_0 or Q4_1 (quantized here, with the
//! values they dequantize to), and llama.cpp's converter's permutation of q and k.

use std::collections::BTreeMap;
use std::path::Path;

/// One metadata value.
pub enum Meta {
    U32(u32),
    F32(f32),
    Text(String),
    Texts(Vec<String>),
    I32s(Vec<i32>),
}

/// The metadata llama.cpp writes for a Llama of `layers` blocks, width `d`, MLP width `ffn`,
/// `heads` heads of `head_dim` (as many kv heads), `context` positions and `vocab` tokens, θ 1e4.
pub fn llama_metadata(
    layers: u32,
    d: u32,
    ffn: u32,
    (heads, head_dim): (u32, u32),
    context: u32,
    vocab: u32,
) -> BTreeMap<String, Meta> {
    [
        ("general.architecture", Meta::Text("llama".into())),
        ("llama.block_count", Meta::U32(layers)),
        ("llama.context_length", Meta::U32(context)),
        ("llama.embedding_length", Meta::U32(d)),
        ("llama.feed_forward_length", Meta::U32(ffn)),
        ("llama.attention.head_count", Meta::U32(heads)),
        ("llama.attention.head_count_kv", Meta::U32(heads)),
        ("llama.rope.freq_base", Meta::F32(10000.0)),
        ("llama.rope.dimension_count", Meta::U32(head_dim)),
        ("llama.attention.layer_norm_rms_epsilon", Meta::F32(1e-5)),
        ("llama.vocab_size", Meta::U32(vocab)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// How a tensor is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Store {
    F32,
    Q8_0,
    Q4_1,
}

/// A tensor to write: its row-major shape (PyTorch's) and values.
pub struct Entry {
    pub shape: Vec<usize>,
    pub values: Vec<f32>,
    pub store: Store,
}

fn f16(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}

/// The bytes of `values` in `store`, and the values they dequantize to.
pub fn encode(values: &[f32], store: Store) -> (Vec<u8>, Vec<f32>) {
    let mut bytes = Vec::new();
    let mut back = Vec::with_capacity(values.len());
    match store {
        Store::F32 => {
            values.iter().for_each(|v| bytes.extend(v.to_le_bytes()));
            back.extend_from_slice(values);
        }
        Store::Q8_0 => {
            for block in values.chunks(32) {
                let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let d = f16(amax / 127.0);
                bytes.extend(half::f16::from_f32(d).to_le_bytes());
                for v in block {
                    let q = if d == 0.0 {
                        0
                    } else {
                        (v / d).round().clamp(-127.0, 127.0) as i8
                    };
                    bytes.push(q as u8);
                    back.push(d * q as f32);
                }
            }
        }
        Store::Q4_1 => {
            for block in values.chunks(32) {
                let lo = block.iter().fold(f32::INFINITY, |m, v| m.min(*v));
                let hi = block.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v));
                let (d, m) = (f16((hi - lo) / 15.0), f16(lo));
                bytes.extend(half::f16::from_f32(d).to_le_bytes());
                bytes.extend(half::f16::from_f32(m).to_le_bytes());
                let q: Vec<u8> = block
                    .iter()
                    .map(|v| {
                        if d == 0.0 {
                            0
                        } else {
                            ((v - m) / d).round().clamp(0.0, 15.0) as u8
                        }
                    })
                    .collect();
                for j in 0..16 {
                    bytes.push(q[j] | (q[j + 16] << 4));
                }
                back.extend(q.iter().map(|&q| d * q as f32 + m));
            }
        }
    }
    (bytes, back)
}

/// llama.cpp's converter's q/k permutation: within each head of `head_dim` rows, row `j·k/2 +
/// i` (Hugging Face's halves) goes to row `2i + j` (pairs).
pub fn permute(values: &[f32], rows: usize, head_dim: usize) -> Vec<f32> {
    let cols = values.len() / rows;
    let mut out = vec![0.0; values.len()];
    for row in 0..rows {
        let (head, within) = (row / head_dim, row % head_dim);
        let (j, i) = (within / (head_dim / 2), within % (head_dim / 2));
        let to = head * head_dim + 2 * i + j;
        out[to * cols..(to + 1) * cols].copy_from_slice(&values[row * cols..(row + 1) * cols]);
    }
    out
}

fn text(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

/// Writes `metadata` and `tensors` as a GGUF v3 file (alignment 32); returns each tensor's
/// dequantized values.
pub fn write(
    path: &Path,
    metadata: &BTreeMap<String, Meta>,
    tensors: &BTreeMap<String, Entry>,
) -> BTreeMap<String, Vec<f32>> {
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend((metadata.len() as u64).to_le_bytes());
    for (key, value) in metadata {
        text(&mut out, key);
        match value {
            Meta::U32(v) => {
                out.extend(4u32.to_le_bytes());
                out.extend(v.to_le_bytes());
            }
            Meta::F32(v) => {
                out.extend(6u32.to_le_bytes());
                out.extend(v.to_le_bytes());
            }
            Meta::Text(v) => {
                out.extend(8u32.to_le_bytes());
                text(&mut out, v);
            }
            Meta::Texts(v) => {
                out.extend(9u32.to_le_bytes());
                out.extend(8u32.to_le_bytes());
                out.extend((v.len() as u64).to_le_bytes());
                v.iter().for_each(|s| text(&mut out, s));
            }
            Meta::I32s(v) => {
                out.extend(9u32.to_le_bytes());
                out.extend(5u32.to_le_bytes());
                out.extend((v.len() as u64).to_le_bytes());
                v.iter().for_each(|x| out.extend(x.to_le_bytes()));
            }
        }
    }
    let align = |n: usize| n.div_ceil(32) * 32;
    let mut data = Vec::new();
    let mut back = BTreeMap::new();
    for (name, entry) in tensors {
        let (bytes, values) = encode(&entry.values, entry.store);
        text(&mut out, name);
        out.extend((entry.shape.len() as u32).to_le_bytes());
        entry
            .shape
            .iter()
            .rev()
            .for_each(|d| out.extend((*d as u64).to_le_bytes()));
        let kind: u32 = match entry.store {
            Store::F32 => 0,
            Store::Q4_1 => 3,
            Store::Q8_0 => 8,
        };
        out.extend(kind.to_le_bytes());
        out.extend((data.len() as u64).to_le_bytes());
        data.extend(bytes);
        data.resize(align(data.len()), 0);
        back.insert(name.clone(), values);
    }
    out.resize(align(out.len()), 0);
    out.extend(data);
    std::fs::write(path, out).expect("the test writes its GGUF file");
    back
}
