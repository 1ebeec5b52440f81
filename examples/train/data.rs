//! The training text as a stream of tokens: bytes, or the ids of a Hugging Face
//! `tokenizer.json`, its last share held out for evaluation. The default corpus is arithmetic,
//! generated deterministically in-process.
//!
//! Lines such as `417+38=455` have structure a small model learns: digits, then the operator,
//! then a sum that follows from the operands. Its unigram entropy is about 2.6 nats a byte, so
//! a falling loss well below that shows learning.

use std::path::Path;

use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_megatron::job::DataSection;
use burn_megatron::train::TokenBatch;
use tokenizers::Tokenizer;

/// A stream of tokens, and how to turn tokens back into text.
pub struct Corpus {
    tokens: Vec<u32>,
    tokenizer: Option<Tokenizer>,
}

impl Corpus {
    /// The corpus a job's data section names (the arithmetic from `seed` when it names no
    /// files), and the share it holds out, if any.
    pub fn of(data: &DataSection, seed: u64) -> Result<(Self, Option<Self>), String> {
        let corpus = match &data.path {
            Some(path) => Corpus::from_path(path)?,
            None => Corpus::arithmetic(1 << 20, seed),
        };
        let corpus = match &data.tokenizer {
            Some(path) => corpus.tokenized(path)?,
            None => corpus,
        };
        if data.held_out == 0.0 {
            return Ok((corpus, None));
        }
        let cut = corpus.tokens.len() - (corpus.tokens.len() as f64 * data.held_out) as usize;
        let held = Corpus {
            tokens: corpus.tokens[cut..].to_vec(),
            tokenizer: corpus.tokenizer.clone(),
        };
        let train = Corpus {
            tokens: corpus.tokens[..cut].to_vec(),
            tokenizer: corpus.tokenizer,
        };
        Ok((train, Some(held)))
    }

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
        Self::bytes(text.into_bytes())
    }

    fn bytes(bytes: Vec<u8>) -> Self {
        Self {
            tokens: bytes.into_iter().map(u32::from).collect(),
            tokenizer: None,
        }
    }

    /// The corpus's text in the ids of `tokenizer.json` at `path`.
    pub fn tokenized(self, path: &Path) -> Result<Self, String> {
        let tokenizer = burn_megatron::models::llama::hf::tokenizer(path).map_err(|e| e.to_string())?;
        let text = String::from_utf8_lossy(&self.tokens.iter().map(|&t| t as u8).collect::<Vec<_>>()).into_owned();
        let encoding = tokenizer
            .encode(text, false)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(Self {
            tokens: encoding.get_ids().to_vec(),
            tokenizer: Some(tokenizer),
        })
    }

    /// How many token ids there are: 256 bytes, or the tokenizer's vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.tokenizer.as_ref().map_or(256, |t| t.get_vocab_size(true))
    }

    /// The tokens of `text`.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        match &self.tokenizer {
            Some(t) => t.encode(text, false).map(|e| e.get_ids().to_vec()).unwrap_or_default(),
            None => text.bytes().map(u32::from).collect(),
        }
    }

    /// The text of `tokens`.
    pub fn decode(&self, tokens: &[u32]) -> String {
        match &self.tokenizer {
            Some(t) => t.decode(tokens, false).unwrap_or_default(),
            None => String::from_utf8_lossy(&tokens.iter().map(|&t| t as u8).collect::<Vec<_>>()).into_owned(),
        }
    }

    /// [`decode`](Self::decode) as a function of its own, for another thread.
    pub fn decoder(&self) -> impl Fn(&[u32]) -> String + Send + 'static {
        let corpus = Corpus {
            tokens: Vec::new(),
            tokenizer: self.tokenizer.clone(),
        };
        move |tokens| corpus.decode(tokens)
    }

    /// The first `n` tokens (a prompt for samples of a corpus read from files).
    pub fn head(&self, n: usize) -> &[u32] {
        &self.tokens[..n.min(self.tokens.len())]
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
        Ok(Self::bytes(bytes))
    }

    /// Checks the corpus can fill a sequence of `seq + 1` tokens.
    pub fn check_len(&self, seq: usize) -> Result<(), String> {
        if self.tokens.len() <= seq + 1 {
            return Err(format!(
                "the data has {} tokens; a sequence needs more than {}",
                self.tokens.len(),
                seq + 1
            ));
        }
        Ok(())
    }

    /// Sequence `index` of step `step`: `seq + 1` tokens from a position drawn from the step,
    /// so every layout sees the same data in the same order.
    pub fn window(&self, step: usize, index: usize, seq: usize) -> &[u32] {
        let mut h =
            (step as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (index as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        h ^= h >> 29;
        let start = (h % (self.tokens.len() - seq - 1) as u64) as usize;
        &self.tokens[start..start + seq + 1]
    }

    /// Inputs and next-token targets for sequences `first..first + count` of `step`.
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
        let tokens: Vec<i64> = (first..first + count)
            .flat_map(|i| self.window(step, i, seq).iter().map(|&t| t as i64))
            .collect();
        let all = Tensor::<2, Int>::from_data(TensorData::new(tokens, [count, seq + 1]), device);
        (all.clone().narrow(1, 0, seq), all.narrow(1, 1, seq))
    }
}

impl Corpus {
    /// [`batch`](Self::batch) as the training step takes it.
    pub fn token_batch(&self, step: usize, first: usize, count: usize, seq: usize, device: &Device) -> TokenBatch {
        let (ids, targets) = self.batch(step, first, count, seq, device);
        TokenBatch { ids, targets }
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
        assert_eq!(a.tokens, Corpus::arithmetic(4096, 7).tokens);
        let text = a.decode(&a.tokens);
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

    /// The windows' starts for the plays' length (`scripts/fetch-shakespeare.sh`'s file and
    /// its newline), as `examples/bench/peers/fp8_curves.py` computes them in Python to train
    /// PyTorch on the same windows: a change here must change it too.
    #[test]
    fn window_starts_match_the_peer_script() {
        let corpus = Corpus::bytes(vec![0; 5_057_199]);
        let start = |step, index| {
            let window = corpus.window(step, index, 2048);
            (window.as_ptr() as usize - corpus.tokens.as_ptr() as usize) / std::mem::size_of::<u32>()
        };
        let starts: Vec<usize> = [(1, 0), (2, 0), (3, 0), (300, 0), (1, 1), (1, 2)]
            .into_iter()
            .map(|(step, index)| start(step, index))
            .collect();
        assert_eq!(starts, [5_042_190, 3_865_897, 266_110, 2_458_737, 1_977_699, 1_320_467]);
    }

    #[test]
    fn reads_a_directory_of_text() {
        let dir = std::env::temp_dir().join(format!("burn-megatron-data-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        std::fs::write(dir.join("b.txt"), "world").unwrap();
        std::fs::write(dir.join("sub").join("a.txt"), "hello").unwrap();
        let corpus = Corpus::from_path(&dir).unwrap();
        assert_eq!(corpus.decode(&corpus.tokens), "world\nhello\n");
        assert!(corpus.check_len(20).is_err());
        assert!(Corpus::from_path(&dir.join("missing")).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn reads_a_tokenizer_json() {
        let dir = std::env::temp_dir().join(format!("burn-megatron-tokenizer-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tokenizer.json");
        std::fs::write(
            &path,
            r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"normalizer":null,
               "pre_tokenizer":{"type":"Whitespace"},"post_processor":null,"decoder":null,
               "model":{"type":"WordLevel","vocab":{"[UNK]":0,"hello":1,"world":2},"unk_token":"[UNK]"}}"#,
        )
        .unwrap();
        let corpus = Corpus::bytes(b"hello world hello there".to_vec())
            .tokenized(&path)
            .unwrap();
        assert_eq!(corpus.tokens, vec![1, 2, 1, 0]);
        assert_eq!(corpus.vocab_size(), 3);
        assert_eq!(corpus.encode("world"), vec![2]);
        assert!(Corpus::arithmetic(64, 1).tokenized(&dir.join("missing.json")).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
