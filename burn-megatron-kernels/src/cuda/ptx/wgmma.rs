//! The PTX text of `wgmma` chains, as plain Rust (no CubeCL), so its operand numbering is unit
//! tested on any machine. `hopper` binds the text to operands through `gpu_asm!`.

// Without `cuda` only the tests use this module.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use crate::quant::format::Minifloat;

/// How a `wgmma` reads one operand tile from shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Tile {
    /// K contiguous: each row holds 64 k (128 bytes); 8-row groups 1 KiB apart; further 64-wide
    /// k boxes follow `rows × 128` bytes apart. A 16-deep k-step is 32 bytes along the row.
    KMajor { rows: u32 },
    /// M or N contiguous: each 128-byte row holds 64 m (or n) at one k; 8-k groups 1 KiB apart;
    /// further 64-wide m (or n) boxes follow `box_bytes` apart. A k-step is 16 rows, 2 KiB.
    MnMajor { box_bytes: u32 },
}

impl Tile {
    /// Bytes from the tile's start to k-step `step`.
    pub(crate) const fn offset(self, step: u32) -> u32 {
        match self {
            Tile::KMajor { rows } => (step / 4) * rows * 128 + (step % 4) * 32,
            Tile::MnMajor { .. } => step * 2048,
        }
    }

    /// `wgmma`'s transpose flag for this operand.
    pub(crate) const fn transposed(self) -> u32 {
        match self {
            Tile::KMajor { .. } => 0,
            Tile::MnMajor { .. } => 1,
        }
    }

    /// The descriptor bits above the address: the 128-byte swizzle (bit 62), the leading (bits
    /// 16-29) and stride (bits 32-45) byte offsets, in 16-byte units.
    pub(crate) const fn descriptor_bits(self) -> u64 {
        let (lbo, sbo): (u64, u64) = match self {
            // The leading offset is unused by this layout.
            Tile::KMajor { .. } => (16, 1024),
            // Leading: from one 64-wide m/n box to the next; stride: from one 8-k group to the
            // next. (Measured: the other order gives wrong products.)
            Tile::MnMajor { box_bytes } => (box_bytes as u64, 1024),
        };
        (1 << 62) | ((sbo >> 4) << 32) | ((lbo >> 4) << 16)
    }
}

/// Where a chain's A operand comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum ASource {
    Smem(Tile),
    /// bf16 pairs in registers, 4 a k-step ([`Frags64`] for 4 steps).
    Registers,
}

/// What a chain multiplies: bf16 operands (k16 a step, either operand K- or MN-major), or FP8
/// operands of the two given formats (k32 a step, both K-major: FP8 `wgmma` takes no transpose).
/// A step reads 32 bytes of each K-major row either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Operands {
    Bf16,
    Fp8(Minifloat, Minifloat),
}

impl Operands {
    /// The instruction's shape and types after `m64n{n}`.
    fn suffix(self) -> String {
        let name = |f: Minifloat| match f {
            Minifloat::E4M3 => "e4m3",
            Minifloat::E5M2 => "e5m2",
            Minifloat::E2M1 => panic!("FP4 has no Hopper wgmma"),
        };
        match self {
            Operands::Bf16 => "k16.f32.bf16.bf16".to_string(),
            Operands::Fp8(a, b) => format!("k32.f32.{}.{}", name(a), name(b)),
        }
    }
}

/// A chain of `steps` `m64n{n}k16` products into one accumulator, as one asm statement that
/// ends by waiting for them. Its operands, in order: the new accumulator; the old one if
/// `accumulate` (else the first step starts from zero); the A registers or A descriptor; the B
/// descriptor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Chain {
    pub operands: Operands,
    pub n: u32,
    pub steps: u32,
    pub accumulate: bool,
    pub a: ASource,
    pub b: Tile,
}

impl Chain {
    /// The A operand's tile (a chain reading A from shared memory).
    pub(crate) const fn a_tile(self) -> Tile {
        match self.a {
            ASource::Smem(tile) => tile,
            ASource::Registers => panic!("A comes from registers"),
        }
    }

    /// The PTX. Without `inout` operands (`gpu_asm!` has none) the old accumulator is copied
    /// into the result registers first; ptxas folds the copies (no moves in the SASS).
    pub(crate) fn ptx(self) -> String {
        self.text() + "wgmma.wait_group.sync.aligned 0;\n}"
    }

    /// The chain issued as one commit group and not waited for: its accumulator (and A
    /// registers) stay in flight until a [`settle_ptx`] wait covers the group.
    pub(crate) fn issue_ptx(self) -> String {
        self.text() + "}"
    }

    /// Everything up to and including the commit.
    fn text(self) -> String {
        let regs = self.n / 2;
        let mut placeholder = 1;
        let mut next = || {
            placeholder += 1;
            placeholder - 1
        };
        let old = self.accumulate.then(&mut next);
        let a = next();
        let b = next();
        let mut ptx = String::from(
            "{\n.reg .pred pt, pf;\n.reg .b32 one;\n.reg .b64 da, db;\nmov.b32 one, 1;\nsetp.ne.b32 pt, one, 0;\nsetp.eq.b32 pf, one, 0;\n",
        );
        if old.is_some() {
            for i in 0..regs {
                ptx += &format!("mov.f32 %{i}, %{};\n", regs + i);
            }
        }
        ptx += "wgmma.fence.sync.aligned;\n";
        let a_regs = if self.accumulate { 2 * regs } else { regs };
        for step in 0..self.steps {
            let scale_d = if step == 0 && !self.accumulate { "pf" } else { "pt" };
            ptx += &format!("add.s64 db, ${b}, {};\n", self.b.offset(step) / 16);
            let tb = self.b.transposed();
            let shape = format!(
                "wgmma.mma_async.sync.aligned.m64n{}{} $0",
                self.n,
                self.operands.suffix()
            );
            match (self.a, self.operands) {
                (ASource::Smem(tile), Operands::Fp8(..)) => {
                    assert!(
                        tile.transposed() == 0 && tb == 0,
                        "FP8 wgmma reads K-major operands only"
                    );
                    ptx += &format!("add.s64 da, ${a}, {};\n", tile.offset(step) / 16);
                    ptx += &format!("{shape}, da, db, {scale_d}, 1, 1;\n");
                }
                (ASource::Registers, Operands::Fp8(..)) => panic!("FP8 chains read A from shared memory"),
                (ASource::Smem(tile), Operands::Bf16) => {
                    ptx += &format!("add.s64 da, ${a}, {};\n", tile.offset(step) / 16);
                    ptx += &format!("{shape}, da, db, {scale_d}, 1, 1, {}, {tb};\n", tile.transposed());
                }
                (ASource::Registers, Operands::Bf16) => {
                    let r = a_regs + 4 * step;
                    ptx += &format!(
                        "{shape}, {{%{}, %{}, %{}, %{}}}, db, {scale_d}, 1, 1, {tb};\n",
                        r,
                        r + 1,
                        r + 2,
                        r + 3
                    );
                }
            }
        }
        ptx += "wgmma.commit_group.sync.aligned;\n";
        ptx
    }
}

/// Waits until at most `pending` issued chains are in flight, then copies operand 1's `regs`
/// registers into the result: the chain's accumulator, read after the wait. Operands past the
/// first input (an in-flight chain's A registers) are only held live until here, so nothing
/// reuses their registers while the chain still reads them.
pub(crate) fn settle_ptx(pending: u32, regs: u32) -> String {
    let mut ptx = format!("wgmma.wait_group.sync.aligned {pending};\n");
    for i in 0..regs {
        ptx += &format!("mov.f32 %{i}, %{};\n", regs + i);
    }
    ptx
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The PTX register numbers `%i` the text names.
    fn registers(ptx: &str) -> Vec<u32> {
        let mut out = Vec::new();
        let mut rest = ptx;
        while let Some(at) = rest.find('%') {
            let digits: String = rest[at + 1..].chars().take_while(char::is_ascii_digit).collect();
            if let Ok(n) = digits.parse() {
                out.push(n);
            }
            rest = &rest[at + 1..];
        }
        out
    }

    /// The GEMM's k-slice: 128 copies of the old accumulator into the result, four
    /// `m64n256k16` steps 32 bytes apart on both K-major operands, one wait.
    #[test]
    fn gemm_slice_copies_then_four_steps() {
        let chain = Chain {
            operands: Operands::Bf16,
            n: 256,
            steps: 4,
            accumulate: true,
            a: ASource::Smem(Tile::KMajor { rows: 128 }),
            b: Tile::KMajor { rows: 256 },
        };
        let ptx = chain.ptx();
        assert_eq!(ptx.matches("mov.f32").count(), 128);
        assert_eq!(ptx.matches("wgmma.mma_async.sync.aligned.m64n256k16").count(), 4);
        assert!(ptx.contains("mov.f32 %0, %128;") && ptx.contains("mov.f32 %127, %255;"));
        // Descriptor steps in 16-byte units: 32 bytes is +2.
        assert!(ptx.contains("add.s64 da, $2, 6;") && ptx.contains("add.s64 db, $3, 6;"));
        // Result $0, old accumulator $1, descriptors $2 and $3; 256 registers named.
        assert!(registers(&ptx).iter().all(|&r| r < 256));
        assert!(ptx.ends_with("wgmma.wait_group.sync.aligned 0;\n}"));
    }

    /// A fresh chain starts from zero (the first step's scale-d is false) and copies nothing.
    #[test]
    fn a_fresh_chain_zeroes_its_first_step() {
        let chain = Chain {
            operands: Operands::Bf16,
            n: 64,
            steps: 8,
            accumulate: false,
            a: ASource::Smem(Tile::KMajor { rows: 128 }),
            b: Tile::KMajor { rows: 64 },
        };
        let ptx = chain.ptx();
        assert_eq!(ptx.matches("mov.f32").count(), 0);
        assert_eq!(ptx.matches(", pf, ").count(), 1);
        assert_eq!(ptx.matches(", pt, ").count(), 7);
        // Step 4 crosses into the second 64-wide k box: 128 rows × 128 bytes = 16 KiB further.
        assert!(ptx.contains(&format!("add.s64 da, $1, {};", 16384 / 16)));
        assert!(registers(&ptx).iter().all(|&r| r < 32));
    }

    /// A from registers: 4 fragment registers a step after the two accumulators, B MN-major
    /// (transposed flag 1, 2 KiB a step).
    #[test]
    fn mn_major_operands_are_read_transposed() {
        // Attention's dQ: dS stored keys × queries is A (queries × keys) read MN-major, the k
        // tile stored keys × head dim is B read MN-major.
        let chain = Chain {
            operands: Operands::Bf16,
            n: 64,
            steps: 8,
            accumulate: false,
            a: ASource::Smem(Tile::MnMajor { box_bytes: 16384 }),
            b: Tile::MnMajor { box_bytes: 16384 },
        };
        let ptx = chain.ptx();
        // Both transpose flags set on every step: scale-d, scale-a, scale-b, then tnspA, tnspB.
        assert_eq!(ptx.matches(", 1, 1, 1, 1;").count(), 8);
        // A k-step is 16 rows of 128 bytes, 2 KiB, on both operands.
        assert!(ptx.contains(&format!("add.s64 da, $1, {};", 7 * 2048 / 16)));
        assert!(ptx.contains(&format!("add.s64 db, $2, {};", 7 * 2048 / 16)));
        assert!(registers(&ptx).iter().all(|&r| r < 32));
    }

    #[test]
    fn register_operands_follow_the_accumulators() {
        let chain = Chain {
            operands: Operands::Bf16,
            n: 128,
            steps: 4,
            accumulate: true,
            a: ASource::Registers,
            b: Tile::MnMajor { box_bytes: 8192 },
        };
        let ptx = chain.ptx();
        assert!(ptx.contains("{%128, %129, %130, %131}, db, pt, 1, 1, 1;"));
        assert!(ptx.contains("{%140, %141, %142, %143}, db, pt, 1, 1, 1;"));
        assert!(ptx.contains(&format!("add.s64 db, $3, {};", 3 * 2048 / 16)));
        assert!(registers(&ptx).iter().all(|&r| r < 64 + 64 + 16));
    }

    /// An issued chain commits its group and does not wait; the settle waits for the groups
    /// past `pending`, then copies the accumulator (result `%0..`, input after it).
    #[test]
    fn issue_commits_and_settle_waits() {
        let chain = Chain {
            operands: Operands::Bf16,
            n: 64,
            steps: 8,
            accumulate: false,
            a: ASource::Smem(Tile::KMajor { rows: 128 }),
            b: Tile::KMajor { rows: 64 },
        };
        let issued = chain.issue_ptx();
        assert!(issued.ends_with("wgmma.commit_group.sync.aligned;\n}"));
        assert!(!issued.contains("wait_group"));
        assert_eq!(
            chain.ptx(),
            issued.trim_end_matches('}').to_string() + "wgmma.wait_group.sync.aligned 0;\n}"
        );
        let settle = settle_ptx(1, 32);
        assert!(settle.starts_with("wgmma.wait_group.sync.aligned 1;\n"));
        assert_eq!(settle.matches("mov.f32").count(), 32);
        assert!(settle.contains("mov.f32 %0, %32;") && settle.contains("mov.f32 %31, %63;"));
    }

    /// An FP8 slice: the k32 instruction of the formats, no transpose immediates, the same
    /// 32-byte steps along K-major rows as bf16's k16.
    #[test]
    fn fp8_slice_is_k32_without_transposes() {
        let chain = Chain {
            operands: Operands::Fp8(Minifloat::E4M3, Minifloat::E5M2),
            n: 256,
            steps: 4,
            accumulate: true,
            a: ASource::Smem(Tile::KMajor { rows: 128 }),
            b: Tile::KMajor { rows: 256 },
        };
        let ptx = chain.ptx();
        assert_eq!(
            ptx.matches("wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e5m2 $0, da, db, pt, 1, 1;")
                .count(),
            4
        );
        assert!(ptx.contains("add.s64 da, $2, 6;") && ptx.contains("add.s64 db, $3, 6;"));
    }

    /// The descriptor fields: 128-byte swizzle at bit 62, stride 1 KiB, leading 16 bytes
    /// (K-major) or the MN box stride.
    #[test]
    fn descriptor_bits() {
        assert_eq!(
            Tile::KMajor { rows: 64 }.descriptor_bits(),
            (1 << 62) | (64 << 32) | (1 << 16)
        );
        assert_eq!(
            Tile::MnMajor { box_bytes: 8192 }.descriptor_bits(),
            (1 << 62) | (64 << 32) | (512 << 16)
        );
    }
}
