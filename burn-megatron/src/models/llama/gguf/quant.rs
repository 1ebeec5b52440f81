//! GGUF's block types: how llama.cpp stores a tensor's values, and their dequantization to
//! f32. A block holds `block()` values in `block_bytes()` bytes; the legacy quantized types
//! keep an f16 scale (and an f16 minimum for `Q4_1`) before their packed integers.

/// The block types read here (ggml's type ids); others are `GgufError::Unsupported`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockType {
    F32,
    F16,
    BF16,
    /// 32 values: f16 scale `d`, 16 bytes of 4-bit `q`; `x = d · (q − 8)`.
    Q4_0,
    /// 32 values: f16 scale `d`, f16 minimum `m`, 16 bytes of 4-bit `q`; `x = d · q + m`.
    Q4_1,
    /// 32 values: f16 scale `d`, 32 signed bytes `q`; `x = d · q`.
    Q8_0,
}

impl BlockType {
    pub fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            8 => Self::Q8_0,
            30 => Self::BF16,
            _ => return None,
        })
    }

    pub fn id(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q4_0 => 2,
            Self::Q4_1 => 3,
            Self::Q8_0 => 8,
            Self::BF16 => 30,
        }
    }

    /// Values a block.
    pub fn block(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::BF16 => 1,
            Self::Q4_0 | Self::Q4_1 | Self::Q8_0 => 32,
        }
    }

    /// Bytes a block.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q8_0 => 34,
        }
    }

    /// Dequantizes `bytes` (whole blocks) into `out` (`block()` values a block).
    pub fn decode(self, bytes: &[u8], out: &mut [f32]) {
        let f16 = |b: &[u8]| half::f16::from_le_bytes([b[0], b[1]]).to_f32();
        let blocks = bytes
            .chunks_exact(self.block_bytes())
            .zip(out.chunks_exact_mut(self.block()));
        match self {
            Self::F32 => blocks.for_each(|(b, o)| o[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            Self::F16 => blocks.for_each(|(b, o)| o[0] = f16(b)),
            Self::BF16 => blocks.for_each(|(b, o)| o[0] = half::bf16::from_le_bytes([b[0], b[1]]).to_f32()),
            Self::Q4_0 | Self::Q4_1 => blocks.for_each(|(b, o)| {
                let d = f16(b);
                let (min, packed) = match self {
                    Self::Q4_1 => (f16(&b[2..]), &b[4..20]),
                    _ => (-8.0 * d, &b[2..18]),
                };
                // Byte j holds value j in its low nibble and value j + 16 in its high one.
                for (j, q) in packed.iter().enumerate() {
                    o[j] = d * (q & 0x0f) as f32 + min;
                    o[j + 16] = d * (q >> 4) as f32 + min;
                }
            }),
            Self::Q8_0 => blocks.for_each(|(b, o)| {
                let d = f16(b);
                for (o, q) in o.iter_mut().zip(&b[2..34]) {
                    *o = d * (*q as i8) as f32;
                }
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::BlockType;

    /// Blocks laid out by hand as llama.cpp's `dequantize_row_*` read them.
    #[test]
    fn blocks_decode_as_llama_cpp_reads_them() {
        let f16 = |x: f32| half::f16::from_f32(x).to_le_bytes();
        // Q4_1: d 0.5, m −1; byte j = (j % 16) | (15 − j % 16) << 4.
        let mut q41 = [f16(0.5), f16(-1.0)].concat();
        q41.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let mut out = [0.0f32; 32];
        BlockType::Q4_1.decode(&q41, &mut out);
        for j in 0..16 {
            assert_eq!(out[j], 0.5 * j as f32 - 1.0);
            assert_eq!(out[j + 16], 0.5 * (15 - j) as f32 - 1.0);
        }
        // Q4_0: d 2, the same nibbles: x = 2 · (q − 8).
        let mut q40 = f16(2.0).to_vec();
        q40.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        BlockType::Q4_0.decode(&q40, &mut out);
        assert_eq!((out[0], out[15], out[16]), (-16.0, 14.0, 14.0));
        // Q8_0: d 0.25, q = −16..16.
        let mut q80 = f16(0.25).to_vec();
        q80.extend((-16i8..16).map(|q| q as u8));
        BlockType::Q8_0.decode(&q80, &mut out);
        assert!(out.iter().enumerate().all(|(j, &x)| x == 0.25 * (j as f32 - 16.0)));
    }
}
