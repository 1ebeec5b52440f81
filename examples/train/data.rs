//! The training text: a stream of tokens (bytes, or the ids of a Hugging Face
//! `tokenizer.json`, its last share held out for evaluation), or tokenized datasets on disk
//! packed into sequences (`data.prefixes`: Megatron's indexed format, `burn_megatron::data`).
//! The default corpus is arithmetic, generated deterministically in-process.
//!
//! Lines such as `417+38=455` have structure a small model learns: digits, then the operator,
//! then a sum that follows from the operands. Its unigram entropy is about 2.6 nats a byte, so
//! a falling loss well below that shows learning.

use std::borrow::Cow;
use std::path::Path;

use burn::tensor::Device;
use burn_megatron::data::{Blend, PackedDataset, SftDataset, Sources, SourcesConfig};
use burn_megatron::job::Job;
use burn_megatron::train::{Targeted, TokenBatch};
use tokenizers::Tokenizer;

/// The tokens a run reads, and how to turn tokens back into text.
pub struct Corpus {
    source: Source,
    tokenizer: Option<Tokenizer>,
}

enum Source {
    /// One stream of tokens, read in windows drawn from each step.
    Stream(Vec<u32>),
    /// Packed samples: step `s`'s sequence `i` is sample `(s - first) · global + i`.
    Packed {
        blend: Blend<PackedDataset>,
        first: usize,
        global: usize,
        vocab: usize,
    },
    /// Chat conversations with their loss masks, a conversation a sample, numbered as packed
    /// samples are.
    Chats {
        blend: Blend<SftDataset>,
        first: usize,
        global: usize,
        vocab: usize,
    },
}

/// A sequence's tokens and which of them the loss counts as targets (`None`: every one).
/// A sample's tokens, which of them the loss counts (`None`: every one), and the lengths of
/// the documents it packs (empty: one).
type Counted<'a> = (Cow<'a, [u32]>, Option<Vec<bool>>, Vec<usize>);

/// The target the loss leaves out (the model's `loss.ignore_index` under `data.sft`).
pub const IGNORED: i64 = -100;

impl Corpus {
    /// The corpus a job's data section names (the arithmetic from the seed when it names no
    /// files), and the share it holds out, if any.
    pub fn of(job: &Job) -> Result<(Self, Option<Self>), String> {
        let data = &job.config.data;
        let tokenizer = match &data.tokenizer {
            Some(path) => Some(burn_megatron::models::llama::hf::tokenizer(path).map_err(|e| e.to_string())?),
            None => None,
        };
        if !data.prefixes.is_empty() {
            return Self::packed(job, tokenizer);
        }
        let corpus = match &data.path {
            Some(path) => Corpus::from_path(path)?,
            None => Corpus::arithmetic(1 << 20, job.config.seed),
        };
        let corpus = match (&data.tokenizer, tokenizer) {
            (Some(path), Some(tokenizer)) => corpus.tokenized(tokenizer, path)?,
            _ => corpus,
        };
        if data.held_out == 0.0 {
            return Ok((corpus, None));
        }
        let tokens = corpus.stream();
        let cut = tokens.len() - (tokens.len() as f64 * data.held_out) as usize;
        let held = Corpus {
            source: Source::Stream(tokens[cut..].to_vec()),
            tokenizer: corpus.tokenizer.clone(),
        };
        let train = Corpus {
            source: Source::Stream(tokens[..cut].to_vec()),
            tokenizer: corpus.tokenizer,
        };
        Ok((train, Some(held)))
    }

    /// The job's tokenized datasets (`data.sft`: chat datasets, a conversation a sample),
    /// blended: as many samples as its steps read, and its evaluation batches.
    fn packed(job: &Job, tokenizer: Option<Tokenizer>) -> Result<(Self, Option<Self>), String> {
        let c = &job.config;
        let global = job.global_batch;
        let config = SourcesConfig {
            items: &c.data.prefixes,
            held_out: c.data.held_out,
            seq: job.seq,
            samples: ((c.steps * global) as u64, (c.eval.batches.max(1) * global) as u64),
            seed: c.seed,
            cache: c.data.cache.as_deref(),
        };
        let vocab = job.model.embedding.vocab_size;
        let corpus = |source| Corpus {
            source,
            tokenizer: tokenizer.clone(),
        };
        let (train, held) = match c.data.sft {
            false => {
                let sources = Sources::packed(&config).map_err(|e| e.to_string())?;
                let source = |blend, first| Source::Packed {
                    blend,
                    first,
                    global,
                    vocab,
                };
                (
                    source(sources.train, 1),
                    sources.held_out.map(|b| source(b, EVAL_FIRST)),
                )
            }
            true => {
                // Padding past a conversation's end: ChatML's end of turn where the tokenizer has
                // it (its targets are never counted either way).
                let pad = tokenizer
                    .as_ref()
                    .and_then(|t| t.token_to_id("<|im_end|>"))
                    .unwrap_or(0);
                let sources = Sources::chats(&config, pad, c.data.pack_conversations).map_err(|e| e.to_string())?;
                let source = |blend, first| Source::Chats {
                    blend,
                    first,
                    global,
                    vocab,
                };
                (
                    source(sources.train, 1),
                    sources.held_out.map(|b| source(b, EVAL_FIRST)),
                )
            }
        };
        Ok((corpus(train), held.map(corpus)))
    }

    fn stream(&self) -> &[u32] {
        match &self.source {
            Source::Stream(tokens) => tokens,
            Source::Packed { .. } | Source::Chats { .. } => &[],
        }
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
            source: Source::Stream(bytes.into_iter().map(u32::from).collect()),
            tokenizer: None,
        }
    }

    /// The corpus's text in the ids of `tokenizer` (read from `path`).
    pub fn tokenized(self, tokenizer: Tokenizer, path: &Path) -> Result<Self, String> {
        let text = String::from_utf8_lossy(&self.stream().iter().map(|&t| t as u8).collect::<Vec<_>>()).into_owned();
        let encoding = tokenizer
            .encode(text, false)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(Self {
            source: Source::Stream(encoding.get_ids().to_vec()),
            tokenizer: Some(tokenizer),
        })
    }

    /// How many token ids there are: 256 bytes, or the tokenizer's vocabulary; packed datasets
    /// without a tokenizer check each token against the model's as they read it (0).
    pub fn vocab_size(&self) -> usize {
        match (&self.tokenizer, &self.source) {
            (Some(t), _) => t.get_vocab_size(true),
            (None, Source::Stream(_)) => 256,
            (None, Source::Packed { .. } | Source::Chats { .. }) => 0,
        }
    }

    /// The tokens of `text`.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        match &self.tokenizer {
            Some(t) => t.encode(text, false).map(|e| e.get_ids().to_vec()).unwrap_or_default(),
            None => text.bytes().map(u32::from).collect(),
        }
    }

    /// The text of `tokens` (the ids themselves for packed datasets without a tokenizer).
    pub fn decode(&self, tokens: &[u32]) -> String {
        match (&self.tokenizer, &self.source) {
            (Some(t), _) => t.decode(tokens, false).unwrap_or_default(),
            (None, Source::Stream(_)) => {
                String::from_utf8_lossy(&tokens.iter().map(|&t| t as u8).collect::<Vec<_>>()).into_owned()
            }
            (None, Source::Packed { .. } | Source::Chats { .. }) => format!("{tokens:?}"),
        }
    }

    /// [`decode`](Self::decode) as a function of its own, for another thread.
    pub fn decoder(&self) -> impl Fn(&[u32]) -> String + Send + 'static {
        let ids = matches!(self.source, Source::Packed { .. } | Source::Chats { .. });
        let corpus = Corpus {
            source: Source::Stream(Vec::new()),
            tokenizer: self.tokenizer.clone(),
        };
        move |tokens| match ids && corpus.tokenizer.is_none() {
            true => format!("{tokens:?}"),
            false => corpus.decode(tokens),
        }
    }

    /// The first `n` tokens (a prompt for samples of a corpus read from files): of the stream,
    /// or of the first sample.
    pub fn head(&self, n: usize) -> Result<Vec<u32>, String> {
        let tokens = match &self.source {
            Source::Stream(tokens) => Cow::Borrowed(tokens.as_slice()),
            Source::Packed { .. } | Source::Chats { .. } => self.sequence(1, 0, n)?,
        };
        Ok(tokens[..n.min(tokens.len())].to_vec())
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

    /// Checks the corpus can fill a sequence of `seq + 1` tokens (packed datasets were checked
    /// packing).
    pub fn check_len(&self, seq: usize) -> Result<(), String> {
        let tokens = self.stream().len();
        if matches!(self.source, Source::Stream(_)) && tokens <= seq + 1 {
            return Err(format!(
                "the data has {tokens} tokens; a sequence needs more than {}",
                seq + 1
            ));
        }
        Ok(())
    }

    /// Sequence `index` of step `step` of a stream: `seq + 1` tokens from a position drawn from
    /// the step, so every layout sees the same data in the same order.
    pub fn window(&self, step: usize, index: usize, seq: usize) -> &[u32] {
        let tokens = self.stream();
        let mut h =
            (step as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (index as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        h ^= h >> 29;
        let start = (h % (tokens.len() - seq - 1) as u64) as usize;
        &tokens[start..start + seq + 1]
    }

    /// Sequence `index` of step `step`: a stream's window, or the packed sample the step's
    /// place in the run gives (every layout, and a resumed run, reads the same).
    pub fn sequence(&self, step: usize, index: usize, seq: usize) -> Result<Cow<'_, [u32]>, String> {
        Ok(self.counted_sequence(step, index, seq)?.0)
    }

    /// [`sequence`](Self::sequence), and which of its tokens the loss counts as targets (a
    /// chat's assistant turns; `None`: every one).
    fn counted_sequence(&self, step: usize, index: usize, seq: usize) -> Result<Counted<'_>, String> {
        let tokens = match &self.source {
            Source::Chats {
                blend,
                first,
                global,
                vocab,
            } => {
                let (_, sample) = blend
                    .sample(((step - first) * global + index) as u64, *vocab)
                    .map_err(|e| e.to_string())?;
                return Ok((Cow::Owned(sample.tokens), Some(sample.counted), sample.documents));
            }
            _ => self.uncounted_sequence(step, index, seq)?,
        };
        Ok((tokens, None, Vec::new()))
    }

    fn uncounted_sequence(&self, step: usize, index: usize, seq: usize) -> Result<Cow<'_, [u32]>, String> {
        match &self.source {
            Source::Chats { .. } => unreachable!("chats are read with their masks"),
            Source::Stream(_) => Ok(Cow::Borrowed(self.window(step, index, seq))),
            Source::Packed {
                blend,
                first,
                global,
                vocab,
            } => {
                let sample = ((step - first) * global + index) as u64;
                let (_, tokens) = blend.sample(sample, *vocab).map_err(|e| e.to_string())?;
                Ok(Cow::Owned(tokens))
            }
        }
    }

    /// Sequence `index` of `step`'s inputs and targets (`seq` each: the next tokens,
    /// [`IGNORED`] where the loss does not count one, or where the next token starts another
    /// packed document), with the documents its inputs pack.
    pub fn targeted(&self, step: usize, index: usize, seq: usize) -> Result<Targeted, String> {
        let (tokens, counted, documents) = self.counted_sequence(step, index, seq)?;
        let starts: Vec<usize> = documents
            .iter()
            .scan(0, |at, len| {
                *at += len;
                Some(*at)
            })
            .collect();
        Ok(Targeted {
            ids: tokens[..seq].iter().map(|&t| t as i64).collect(),
            targets: (1..=seq)
                .map(
                    |t| match counted.as_ref().is_none_or(|c| c[t]) && !starts.contains(&t) {
                        true => tokens[t] as i64,
                        false => IGNORED,
                    },
                )
                .collect(),
            documents: input_documents(&documents, seq),
        })
    }

    /// Sequences `first..first + count` of `step`: their inputs and targets.
    pub fn tokens(&self, step: usize, first: usize, count: usize, seq: usize) -> Result<Tokens, String> {
        (first..first + count).map(|i| self.targeted(step, i, seq)).collect()
    }

    /// [`tokens`](Self::tokens) as the training step takes them.
    pub fn token_batch(
        &self,
        step: usize,
        first: usize,
        count: usize,
        seq: usize,
        device: &Device,
    ) -> Result<TokenBatch, String> {
        token_batch(self.tokens(step, first, count, seq)?, device)
    }
}

/// The lengths of the documents of a sample of `seq + 1` tokens as its `seq` inputs hold them
/// (the last cut at the row's end; empty where it holds one).
fn input_documents(documents: &[usize], seq: usize) -> Vec<usize> {
    let mut used = 0;
    let inputs: Vec<usize> = documents
        .iter()
        .map_while(|&len| {
            let len = len.min(seq - used);
            used += len;
            (len > 0).then_some(len)
        })
        .collect();
    match inputs.len() {
        0 | 1 => Vec::new(),
        _ => inputs,
    }
}

/// `count` sequences' inputs and targets, `seq` each.
pub type Tokens = Vec<Targeted>;

/// [`Tokens`] as the training step takes them.
///
/// # Shapes
/// `[count, seq]`, `[count, seq]`
pub fn token_batch(tokens: Tokens, device: &Device) -> Result<TokenBatch, String> {
    TokenBatch::targeted(tokens, device).map_err(|e| e.to_string())
}

/// Evaluation's first "step": its windows of a stream lie apart from any run's steps.
pub const EVAL_FIRST: usize = 1_000_000;

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
        assert_eq!(a.stream(), Corpus::arithmetic(4096, 7).stream());
        let text = a.decode(a.stream());
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
            (window.as_ptr() as usize - corpus.stream().as_ptr() as usize) / std::mem::size_of::<u32>()
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
        assert_eq!(corpus.decode(corpus.stream()), "world\nhello\n");
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
        let tokenizer = burn_megatron::models::llama::hf::tokenizer(&path).unwrap();
        let corpus = Corpus::bytes(b"hello world hello there".to_vec())
            .tokenized(tokenizer, &path)
            .unwrap();
        assert_eq!(corpus.stream(), [1, 2, 1, 0]);
        assert_eq!(corpus.vocab_size(), 3);
        assert_eq!(corpus.encode("world"), vec![2]);
        assert!(burn_megatron::models::llama::hf::tokenizer(&dir.join("missing.json")).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
