//! The PTX text of a warp's `mma.sync` chunk (bf16 `m16n8k16`, f32 accumulation), as plain Rust
//! (no CubeCL), so its operand numbering is unit tested on any machine. `skinny` binds it to
//! operands through `gpu_asm!`.

// Without `cuda` only the tests use this module.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

/// One warp's products over a `16 · steps`-deep chunk of `k`: `m_tiles` 16-row tiles of A times
/// `n_tiles` 8-column tiles of B, into `m_tiles · n_tiles` accumulators of 4 f32 a thread.
///
/// Operands, flattened to registers in order: the new accumulators, the old ones (copied into
/// the new first), A's fragments (4 a tile and step), B's fragments (2 a tile and step).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct MmaChunk {
    pub m_tiles: u32,
    pub n_tiles: u32,
    pub steps: u32,
}

impl MmaChunk {
    /// f32 accumulator registers a thread: `(n_tile · m_tiles + m_tile) · 4 + e`.
    pub(crate) const fn accumulators(self) -> u32 {
        self.m_tiles * self.n_tiles * 4
    }

    /// A's registers a thread: `(step · m_tiles + m_tile) · 4 + e`.
    pub(crate) const fn a_registers(self) -> u32 {
        self.steps * self.m_tiles * 4
    }

    /// The PTX (B's registers, 2 a tile and step, follow A's: `(step · n_tiles + n_tile) · 2 +
    /// e`). Without `inout` operands (`gpu_asm!` has none) the old accumulators are copied
    /// into the result registers first; each product then accumulates in place.
    pub(crate) fn ptx(self) -> String {
        let acc = self.accumulators();
        let a0 = 2 * acc;
        let b0 = a0 + self.a_registers();
        let mut ptx = String::new();
        for i in 0..acc {
            ptx += &format!("mov.f32 %{i}, %{};\n", acc + i);
        }
        for step in 0..self.steps {
            for n in 0..self.n_tiles {
                for m in 0..self.m_tiles {
                    let d = (n * self.m_tiles + m) * 4;
                    let a = a0 + (step * self.m_tiles + m) * 4;
                    let b = b0 + (step * self.n_tiles + n) * 2;
                    ptx += &format!(
                        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{%{d}, %{}, %{}, %{}}}, {{%{a}, %{}, %{}, %{}}}, {{%{b}, %{}}}, {{%{d}, %{}, %{}, %{}}};\n",
                        d + 1,
                        d + 2,
                        d + 3,
                        a + 1,
                        a + 2,
                        a + 3,
                        b + 1,
                        d + 1,
                        d + 2,
                        d + 3
                    );
                }
            }
        }
        ptx
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `%i` register numbers of each line that holds one.
    fn lines(ptx: &str) -> Vec<Vec<u32>> {
        ptx.lines()
            .map(|line| {
                line.split('%')
                    .skip(1)
                    .map(|s| {
                        s.chars()
                            .take_while(char::is_ascii_digit)
                            .collect::<String>()
                            .parse()
                            .unwrap()
                    })
                    .collect()
            })
            .collect()
    }

    /// Two row tiles, eight column tiles, two steps (the few-row product's 32 × 64 × 32 chunk):
    /// 64 copies of the old accumulators, then 32 products, each reading its own accumulator,
    /// the A fragment of its step and row tile, and the B fragment of its step and column tile.
    #[test]
    fn chunk_numbers_its_operands() {
        let chunk = MmaChunk {
            m_tiles: 2,
            n_tiles: 8,
            steps: 2,
        };
        let lines = lines(&chunk.ptx());
        assert_eq!(lines.len(), 64 + 32);
        for (i, line) in lines[..64].iter().enumerate() {
            assert_eq!(line, &[i as u32, 64 + i as u32]);
        }
        let (a0, b0) = (128, 128 + 16);
        let mut seen = std::collections::HashSet::new();
        for (i, line) in lines[64..].iter().enumerate() {
            let i = i as u32;
            let (step, n, m) = (i / 16, (i / 2) % 8, i % 2);
            let d = (n * 2 + m) * 4;
            let a = a0 + (step * 2 + m) * 4;
            let b = b0 + (step * 8 + n) * 2;
            let expected: Vec<u32> = [
                d,
                d + 1,
                d + 2,
                d + 3,
                a,
                a + 1,
                a + 2,
                a + 3,
                b,
                b + 1,
                d,
                d + 1,
                d + 2,
                d + 3,
            ]
            .into();
            assert_eq!(line, &expected, "product {i}");
            seen.insert((d, step));
        }
        // Every accumulator gets every step once.
        assert_eq!(seen.len(), 16 * 2);
    }
}
