//! The default corpus: arithmetic, generated deterministically in-process, as bytes.
//!
//! Lines such as `417+38=455` have structure a small model learns: digits, then the operator,
//! then a sum that follows from the operands. Its unigram entropy is about 2.6 nats a byte, so
//! a falling loss well below that shows learning.

use burn::tensor::{Device, Int, Tensor, TensorData};

/// A stream of byte tokens.
pub struct Corpus {
    bytes: Vec<u8>,
}

impl Corpus {
    /// About `len` bytes of `a+b=c` and `a-b=c` lines from `seed`.
    pub fn arithmetic(len: usize, seed: u64) -> Self {
        let mut rng = seed ^ 0x5DEE_CE66_D1CE_4E5B;
        let mut next = move |n: u64| {
            rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (rng >> 33) % n
        };
        let mut text = String::with_capacity(len + 16);
        while text.len() < len {
            let (a, b) = (next(1000), next(1000));
            if next(2) == 0 {
                text.push_str(&format!("{a}+{b}={}\n", a + b));
            } else {
                let (hi, lo) = (a.max(b), a.min(b));
                text.push_str(&format!("{hi}-{lo}={}\n", hi - lo));
            }
        }
        Self { bytes: text.into_bytes() }
    }

    /// The bytes of a text file, or of every file under a directory (sorted by path), each
    /// followed by a newline: byte-level tokens.
    pub fn from_path(path: &std::path::Path) -> Result<Self, String> {
        let mut files = Vec::new();
        collect_files(path, &mut files).map_err(|e| format!("{}: {e}", path.display()))?;
        files.sort();
        let mut bytes = Vec::new();
        for file in &files {
            bytes.extend(std::fs::read(file).map_err(|e| format!("{}: {e}", file.display()))?);
            bytes.push(b'\n');
        }
        Ok(Self { bytes })
    }

    /// Checks the corpus can fill a sequence of `seq + 1` tokens.
    pub fn check_len(&self, seq: usize) -> Result<(), String> {
        if self.bytes.len() <= seq + 1 {
            return Err(format!("the data has {} bytes; a sequence needs more than {}", self.bytes.len(), seq + 1));
        }
        Ok(())
    }

    /// Sequence `index` of step `step`: `seq + 1` tokens from a position drawn from the step,
    /// so every layout sees the same data in the same order.
    pub fn window(&self, step: usize, index: usize, seq: usize) -> &[u8] {
        let mut h = (step as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (index as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        h ^= h >> 29;
        let start = (h % (self.bytes.len() - seq - 1) as u64) as usize;
        &self.bytes[start..start + seq + 1]
    }

    /// Inputs and next-token targets for sequences `first..first + count` of `step`.
    ///
    /// # Shapes
    /// `[count, seq]`, `[count, seq]`
    pub fn batch(&self, step: usize, first: usize, count: usize, seq: usize, device: &Device) -> (Tensor<2, Int>, Tensor<2, Int>) {
        let tokens: Vec<i64> = (first..first + count)
            .flat_map(|i| self.window(step, i, seq).iter().map(|&b| b as i64))
            .collect();
        let all = Tensor::<2, Int>::from_data(TensorData::new(tokens, [count, seq + 1]), device);
        (all.clone().narrow(1, 0, seq), all.narrow(1, 1, seq))
    }
}

fn collect_files(path: &std::path::Path, out: &mut Vec<std::path::PathBuf>) -> std::io::Result<()> {
    if path.is_dir() {
        for entry in std::fs::read_dir(path)? {
            collect_files(&entry?.path(), out)?;
        }
    } else {
        out.push(path.to_path_buf());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arithmetic_is_deterministic_and_correct() {
        let a = Corpus::arithmetic(4096, 7);
        assert_eq!(a.bytes, Corpus::arithmetic(4096, 7).bytes);
        let text = String::from_utf8(a.bytes).unwrap();
        for line in text.lines() {
            let (lhs, rhs) = line.split_once('=').unwrap();
            let value: i64 = rhs.parse().unwrap();
            let expected = match lhs.split_once('+') {
                Some((x, y)) => x.parse::<i64>().unwrap() + y.parse::<i64>().unwrap(),
                None => {
                    let (x, y) = lhs.split_once('-').unwrap();
                    x.parse::<i64>().unwrap() - y.parse::<i64>().unwrap()
                }
            };
            assert_eq!(value, expected, "{line}");
        }
    }

    #[test]
    fn reads_a_directory_of_text() {
        let dir = std::env::temp_dir().join(format!("burn-megatron-data-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        std::fs::write(dir.join("b.txt"), "world").unwrap();
        std::fs::write(dir.join("sub").join("a.txt"), "hello").unwrap();
        let corpus = Corpus::from_path(&dir).unwrap();
        assert_eq!(corpus.bytes, b"world\nhello\n");
        assert!(corpus.check_len(20).is_err());
        assert!(Corpus::from_path(&dir.join("missing")).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
