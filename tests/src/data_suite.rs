//! Tokenized datasets on disk (`burn_megatron::data`) against Megatron Core's own code: the
//! indexed files its builder wrote (`tests/fixtures/data`, `make_indexed.py`) read back token for
//! token, and the same documents written by ours byte for byte as its builder wrote them; what a
//! broken dataset gets.

use std::path::{Path, PathBuf};

use std::sync::Arc;

use burn::tensor::activation::log_softmax;
use burn::tensor::{Int, Tensor, TensorData};
use burn_megatron::data::{
    Blend, DataError, IndexedDataset, IndexedWriter, PackedDataset, Packing, TokenType, blend, indexed,
};
use burn_megatron::init::{InitMode, ParamInit};
use burn_megatron::models::llama::LlamaConfig;
use burn_megatron::plan::{ParallelPlan, TensorParallel};
use burn_megatron_dist::ParallelDims;
use serde_json::Value;

use crate::Harness;

/// The directory of `make_indexed.py`'s files (see `hf_suite::fixture` for the lookup).
pub fn fixtures() -> PathBuf {
    let running = std::env::var_os("CARGO_MANIFEST_DIR").map(|dir| Path::new(&dir).join("fixtures/data"));
    running
        .into_iter()
        .chain([Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/data")])
        .find(|dir| dir.exists())
        .unwrap_or_else(|| PathBuf::from("tests/fixtures/data"))
}

fn scratch(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("burn-megatron-data-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Each dataset's documents, each a list of its sequences' tokens, as Megatron's reader gave them.
fn documents(entry: &Value) -> Vec<Vec<Vec<u32>>> {
    serde_json::from_value(entry["documents"].clone()).unwrap()
}

/// Megatron's files read by ours: every document's sequences token for token, the dtype its
/// code names; ours writing the same documents: Megatron's bytes.
pub fn megatron_files_both_ways() {
    let dir = fixtures();
    let fixture: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("indexed.json")).unwrap()).unwrap();
    for (name, dtype) in [("megatron_u16", TokenType::U16), ("megatron_i32", TokenType::I32)] {
        let docs = documents(&fixture[name]);
        let data = IndexedDataset::open(&dir.join(name)).unwrap();
        assert_eq!(data.dtype(), dtype, "{name}");
        assert_eq!(data.documents(), docs.len(), "{name}");
        for (d, doc) in docs.iter().enumerate() {
            let read: Vec<Vec<u32>> = data.document(d).map(|i| data.sequence(i, 1 << 20).unwrap()).collect();
            assert_eq!(&read, doc, "{name} document {d}");
        }
        let out = scratch(name).join(name);
        let mut writer = IndexedWriter::create(&out, dtype).unwrap();
        for doc in &docs {
            let (last, rest) = doc.split_last().unwrap();
            rest.iter().for_each(|s| writer.add_sequence(s).unwrap());
            writer.add_document(last).unwrap();
        }
        writer.finish().unwrap();
        let (ours, theirs) = (indexed::paths(&out), indexed::paths(&dir.join(name)));
        for (a, b) in [(ours.0, theirs.0), (ours.1, theirs.1)] {
            assert!(
                std::fs::read(&a).unwrap() == std::fs::read(&b).unwrap(),
                "{} differs from {}",
                a.display(),
                b.display()
            );
        }
        let _ = std::fs::remove_dir_all(out.parent().unwrap());
    }
}

/// A broken dataset is a typed error naming the file and the byte: an empty index, a foreign
/// file, a count past the file, a sequence past its `.bin`, a boundary out of order, a token past
/// the vocabulary; a missing `.bin` names it.
pub fn broken_datasets_are_named() {
    let dir = fixtures();
    let idx = std::fs::read(dir.join("megatron_u16.idx")).unwrap();
    let bin = std::fs::read(dir.join("megatron_u16.bin")).unwrap();
    let out = scratch("broken");
    let open = |idx: &[u8], bin: Option<&[u8]>| {
        let prefix = out.join("d");
        let (b, i) = indexed::paths(&prefix);
        std::fs::write(&i, idx).unwrap();
        let _ = std::fs::remove_file(&b);
        if let Some(bin) = bin {
            std::fs::write(&b, bin).unwrap();
        }
        IndexedDataset::open(&prefix).map(|_| ())
    };
    let format_at = |result: Result<(), DataError>, at: u64, what: &str| match result {
        Err(DataError::Format { offset, path, .. }) => {
            assert_eq!(offset, at, "{what}");
            assert!(path.ends_with("d.idx"), "{what}: {path}");
        }
        other => panic!("{what}: {other:?}"),
    };
    format_at(open(&[], Some(&bin)), 0, "empty index");
    format_at(
        open(b"not an index at all, longer than a header", Some(&bin)),
        0,
        "foreign file",
    );
    let mut more = idx.clone();
    more[18] = 0xff; // the sequence count
    format_at(open(&more, Some(&bin)), 18, "sequence count past the file");
    // Seven sequences: the last one's length at byte 34 + 4 · 6.
    format_at(
        open(&idx, Some(&bin[..bin.len() - 2])),
        34 + 4 * 6,
        "the last sequence past a cut .bin",
    );
    let mut disorder = idx.clone();
    let boundaries = 34 + 12 * 7;
    disorder[boundaries + 16..boundaries + 24].copy_from_slice(&9i64.to_le_bytes());
    format_at(
        open(&disorder, Some(&bin)),
        (boundaries + 16) as u64,
        "a boundary past the sequences",
    );
    match open(&idx, None) {
        Err(DataError::Io { path, .. }) => assert!(path.ends_with("d.bin"), "{path}"),
        other => panic!("missing .bin: {other:?}"),
    }
    let data = IndexedDataset::open(&dir.join("megatron_u16")).unwrap();
    match data.sequence(6, 1000) {
        Err(DataError::Token { offset, vocab, path }) => {
            assert_eq!(
                (offset, vocab),
                (24, 1000),
                "40000, the last sequence's first token, after 12 tokens of 2 bytes"
            );
            assert!(path.ends_with("megatron_u16.bin"), "{path}");
        }
        other => panic!("token past the vocabulary: {other:?}"),
    }
    let _ = std::fs::remove_dir_all(&out);
}

/// A dataset of `lengths.len()` documents, document `k` the tokens `100k, 100k + 1, …`: a
/// token says its document and place.
fn numbered(dir: &Path, name: &str, lengths: &[usize]) -> Arc<IndexedDataset> {
    let prefix = dir.join(name);
    let mut writer = IndexedWriter::create(&prefix, TokenType::U16).unwrap();
    for (k, &n) in lengths.iter().enumerate() {
        let tokens: Vec<u32> = (0..n as u32).map(|t| 100 * k as u32 + t).collect();
        writer.add_document(&tokens).unwrap();
    }
    writer.finish().unwrap();
    Arc::new(IndexedDataset::open(&prefix).unwrap())
}

const LENGTHS: [usize; 9] = [7, 3, 0, 12, 1, 5, 9, 2, 30];

/// Packed for one epoch: the samples' inputs hold every token of the documents at most once,
/// all but fewer than a sample's worth at the epoch's end; inside a sample a token follows its
/// predecessor in its document or starts another document; each sample's last token is another
/// sample's first. The same seed packs the same samples, another seed another order.
pub fn packing_takes_every_token_once() {
    let dir = scratch("packing");
    let data = numbered(&dir, "d", &LENGTHS);
    let tokens: usize = LENGTHS.iter().sum();
    let seq = 5;
    let packing = Packing {
        seq,
        samples: ((tokens - 1) / seq) as u64,
        seed: 3,
    };
    let packed = PackedDataset::new(data.clone(), 0..data.len(), &packing, None).unwrap();
    assert_eq!(packed.len(), packing.samples, "one epoch holds exactly these");
    let samples: Vec<Vec<u32>> = (0..packed.len()).map(|i| packed.sample(i, 4096).unwrap()).collect();
    let mut inputs: Vec<u32> = samples.iter().flat_map(|s| s[..seq].to_vec()).collect();
    inputs.sort();
    let before = inputs.len();
    inputs.dedup();
    assert_eq!(inputs.len(), before, "a token twice in one epoch");
    assert!(
        tokens - inputs.len() < seq + 1,
        "{} of {tokens} tokens read",
        inputs.len()
    );
    for sample in &samples {
        assert_eq!(sample.len(), seq + 1);
        for pair in sample.windows(2) {
            assert!(pair[1] == pair[0] + 1 || pair[1] % 100 == 0, "{sample:?}");
        }
        assert!(
            samples.iter().filter(|t| t[0] == sample[seq]).count() <= 1,
            "{sample:?}"
        );
    }
    let firsts: std::collections::BTreeSet<u32> = samples.iter().map(|s| s[0]).collect();
    let lasts = samples.iter().filter(|s| firsts.contains(&s[seq])).count();
    assert_eq!(
        lasts,
        samples.len() - 1,
        "every sample but the epoch's last ends where one starts"
    );
    let again = PackedDataset::new(data.clone(), 0..data.len(), &packing, None).unwrap();
    assert_eq!(again.sample(4, 4096).unwrap(), samples[4]);
    let other = Packing {
        seed: 4,
        ..packing.clone()
    };
    let other = PackedDataset::new(data.clone(), 0..data.len(), &other, None).unwrap();
    let reordered = (0..other.len()).any(|i| other.sample(i, 4096).unwrap() != samples[i as usize]);
    assert!(reordered, "seed 4 packs seed 3's order");
    // More samples than an epoch holds: more epochs, each document's tokens again.
    let three = Packing {
        samples: 3 * packing.samples,
        ..packing
    };
    let three = PackedDataset::new(data, 0..9, &three, None).unwrap();
    assert!(three.len() >= 3 * packing.samples);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The indexes are cached beside the data: built once, read back with the same samples, and a
/// damaged cache is built again; a token past the vocabulary names its file.
pub fn packed_indexes_are_cached() {
    let dir = scratch("cache");
    let data = numbered(&dir, "d", &LENGTHS);
    let packing = Packing {
        seq: 4,
        samples: 40,
        seed: 9,
    };
    let first = PackedDataset::new(data.clone(), 2..8, &packing, Some(&dir)).unwrap();
    let caches: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "packed"))
        .collect();
    assert_eq!(caches.len(), 1, "{caches:?}");
    let want: Vec<Vec<u32>> = (0..first.len()).map(|i| first.sample(i, 4096).unwrap()).collect();
    let read = PackedDataset::new(data.clone(), 2..8, &packing, Some(&dir)).unwrap();
    assert!((0..read.len()).all(|i| read.sample(i, 4096).unwrap() == want[i as usize]));
    let bytes = std::fs::read(&caches[0]).unwrap();
    std::fs::write(&caches[0], &bytes[..bytes.len() / 2]).unwrap();
    let rebuilt = PackedDataset::new(data.clone(), 2..8, &packing, Some(&dir)).unwrap();
    assert!((0..rebuilt.len()).all(|i| rebuilt.sample(i, 4096).unwrap() == want[i as usize]));
    assert_eq!(
        std::fs::read(&caches[0]).unwrap(),
        bytes,
        "the damaged cache is written again"
    );
    assert!(matches!(first.sample(0, 50), Err(DataError::Token { .. })));
    let empty = PackedDataset::new(data, 2..3, &packing, None);
    assert!(
        matches!(empty, Err(DataError::Format { .. })),
        "a document of no tokens packs nothing"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Two datasets blended 0.7 / 0.3: every prefix of the stream within one sample of its
/// weights; each part's samples in their own order; bad weights refused.
pub fn blends_follow_their_weights() {
    let dir = scratch("blend");
    let (a, b) = (numbered(&dir, "a", &LENGTHS), numbered(&dir, "b", &[50, 40, 30]));
    let samples = 200;
    let weights = [7.0, 3.0];
    let shares = blend::shares(&weights, samples).unwrap();
    let pack = |data: &Arc<IndexedDataset>, samples| {
        let packing = Packing {
            seq: 4,
            samples,
            seed: 1,
        };
        PackedDataset::new(data.clone(), 0..data.len(), &packing, None).unwrap()
    };
    let blend = Blend::new(vec![pack(&a, shares[0]), pack(&b, shares[1])], &weights, samples).unwrap();
    let mut counts = [0f64; 2];
    for i in 0..blend.len() {
        let (d, tokens) = blend.sample(i, 4096).unwrap();
        assert_eq!(tokens.len(), 5);
        counts[d] += 1.0;
        let n = (i + 1) as f64;
        assert!((counts[0] - 0.7 * n).abs() <= 1.0, "after {n}: {counts:?}");
    }
    assert!(blend::shares(&[1.0, -1.0], 10).is_err());
    assert!(blend::shares(&[0.0, 0.0], 10).is_err());
    let short = Blend::new(vec![pack(&a, 2), pack(&b, 2)], &weights, samples);
    assert!(matches!(short, Err(DataError::Config(_))));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Chat SFT's loss (targets outside the assistant's turns set to the ignored id): at tp over
/// every rank, the mean of `−log p(target)` over the counted targets only, written out here from
/// the whole logits, and no gradient reaches the logits of a position whose target is ignored.
pub fn sft_loss_counts_the_assistant_only(h: &Harness) {
    const IGNORED: i64 = -100;
    let (vocab, seq) = (64, 8);
    let mut config = LlamaConfig::llama(vocab, 32, 1, 4, 4, 64, seq);
    config.loss.ignore_index = Some(IGNORED);
    let dims = ParallelDims::tp_dp(h.world, 1);
    let planned = ParallelPlan::new(dims)
        .with_tensor(TensorParallel::Plain)
        .apply(config, dims.world_size(), seq)
        .unwrap();
    let ids: Vec<i64> = (0..2 * seq as i64).map(|i| (i * 7 + 3) % vocab as i64).collect();
    // The first row's first five targets and the second row's last two are not counted.
    let targets: Vec<i64> = (0..2 * seq)
        .map(|i| match (i / seq, i % seq) {
            (0, t) if t < 5 => IGNORED,
            (1, t) if t >= 6 => IGNORED,
            _ => ((i * 5 + 1) % vocab) as i64,
        })
        .collect();
    h.run(dims, |ctx| {
        let device = ctx.device.clone().autodiff();
        let model = planned
            .init(&device, &ctx.groups, &ParamInit::new(5, InitMode::Full))
            .unwrap();
        let tensor = |v: &Vec<i64>| Tensor::<2, Int>::from_data(TensorData::new(v.clone(), [2, seq]), &device);
        let logits = model.forward(tensor(&ids)).unwrap().detach().require_grad(); // [b, s, v']
        let loss = model.loss.forward(logits.clone(), tensor(&targets)).unwrap();
        let grads = loss.backward();
        let whole = ctx
            .groups
            .tp
            .all_gather(logits.clone().detach(), 2)
            .unwrap()
            .narrow(2, 0, vocab);
        let logp = log_softmax(whole, 2).into_data().try_to_vec::<f32>().unwrap();
        let counted: Vec<(usize, usize)> = (0..2 * seq)
            .filter(|&i| targets[i] != IGNORED)
            .map(|i| (i, targets[i] as usize))
            .collect();
        let want = -counted.iter().map(|&(i, t)| logp[i * vocab + t] as f64).sum::<f64>() / counted.len() as f64;
        let ours = loss.into_scalar::<f64>();
        // f32 log-softmax in another order over 64 logits: a few ulps.
        assert!((ours - want).abs() <= 1e-5 * want, "loss {ours} vs {want}");
        let grad = logits.grad(&grads).unwrap().into_data().try_to_vec::<f32>().unwrap();
        let width = grad.len() / (2 * seq);
        for i in (0..2 * seq).filter(|&i| targets[i] == IGNORED) {
            assert!(
                grad[i * width..(i + 1) * width].iter().all(|g| *g == 0.0),
                "position {i}"
            );
        }
        assert!(grad.iter().any(|g| *g != 0.0));
    });
}
