//! The training text: lines such as `417+38=455`, generated from a seed, over a vocabulary of
//! 14 symbols. The symbols' own frequencies give 2.61 nats a token; a model that learns the
//! lines' structure goes below that (the last digits of a sum follow from the operands).

use burn::tensor::{Device, Int, Tensor, TensorData};

/// The symbols, in the order of their token ids.
const SYMBOLS: &[u8; 14] = b"0123456789+-=\n";

/// A stream of token ids.
pub struct Corpus {
    tokens: Vec<i64>,
}

impl Corpus {
    /// About `len` tokens of `a+b=c` and `a-b=c` lines from `seed`.
    pub fn arithmetic(len: usize, seed: u64) -> Self {
        let mut rng = seed ^ 0x5DEE_CE66_D1CE_4E5B;
        let mut next = move |n: u64| {
            rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (rng >> 33) % n
        };
        let mut text = String::with_capacity(len + 16);
        while text.len() < len {
            let (a, b) = (next(1000), next(1000));
            match next(2) {
                0 => text.push_str(&format!("{a}+{b}={}\n", a + b)),
                _ => text.push_str(&format!("{}-{}={}\n", a.max(b), a.min(b), a.abs_diff(b))),
            }
        }
        let id = |byte| {
            SYMBOLS
                .iter()
                .position(|&s| s == byte)
                .expect("a symbol of the vocabulary") as i64
        };
        Self {
            tokens: text.bytes().map(id).collect(),
        }
    }

    /// How many token ids there are.
    pub fn vocab_size() -> usize {
        SYMBOLS.len()
    }

    /// Inputs and next-token targets for sequences `first..first + count` of `step`: each
    /// `seq + 1` tokens from a position drawn from the step and the sequence's index, so every
    /// layout reads the same data in the same order.
    ///
    /// # Shapes
    /// `[count, seq]`, `[count, seq]`
    pub fn batch(
        &self,
        step: usize,
        first: usize,
        count: usize,
        seq: usize,
        device: &Device,
    ) -> (Tensor<2, Int>, Tensor<2, Int>) {
        let window = |index: usize| {
            let mut h =
                (step as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (index as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            h ^= h >> 29;
            let start = (h % (self.tokens.len() - seq - 1) as u64) as usize;
            &self.tokens[start..start + seq + 1]
        };
        let tokens: Vec<i64> = (first..first + count).flat_map(window).copied().collect();
        let all = Tensor::<2, Int>::from_data(TensorData::new(tokens, [count, seq + 1]), device);
        (all.clone().narrow(1, 0, seq), all.narrow(1, 1, seq))
    }
}
