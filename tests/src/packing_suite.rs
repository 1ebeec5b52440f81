//! Packed SFT: rows that pack several conversations train as the conversations would one by one
//! (attention kept inside each, positions restarting with each), and the chat dataset packs
//! whole conversations in turn.

use std::sync::Arc;

use burn::tensor::{Int, Tensor, TensorData};
use burn_megatron::data::{IndexedDataset, IndexedWriter, SftDataset, SftShape, TokenType, sft};
use burn_megatron::init::{InitMode, ParamInit};
use burn_megatron::layers::{Documents, LatentAttentionConfig};
use burn_megatron::models::llama::{LlamaConfig, MtpConfig};
use burn_megatron::plan::{ParallelPlan, TensorParallel};
use burn_megatron::recompute::Recompute;
use burn_megatron_dist::ParallelDims;

use crate::Harness;
use crate::model_suite::gradients;

const IGNORED: i64 = -100;

/// Two rows of 8 tokens packing documents of 5 and 3, and 2 and 6, tokens: the packed loss
/// (the targets that cross into the next document ignored) and every parameter's gradient are
/// those of the four documents run alone, as batches of their own, weighted by their counted
/// targets; at the harness's tp, plain and with SP, without and with selective recomputation,
/// with grouped-query and with multi-head latent attention; with a multi-token prediction module,
/// whose loss (its own mean over the targets two ahead in the same document) weighs the
/// documents by those targets.
pub fn packed_rows_train_as_their_documents(h: &Harness) {
    let (vocab, seq) = (64, 8);
    let lengths = [vec![5, 3], vec![2, 6]];
    let ids: Vec<i64> = (0..2 * seq as i64).map(|i| (i * 7 + 3) % vocab as i64).collect();
    let mut targets: Vec<i64> = (0..2 * seq as i64).map(|i| (i * 5 + 1) % vocab as i64).collect();
    // The last token of each document but a row's last predicts nothing of its own document.
    targets[4] = IGNORED;
    targets[seq + 1] = IGNORED;
    // Every document alone: (row, first token, length).
    let alone = [(0, 0, 5), (0, 5, 3), (1, 0, 2), (1, 2, 6)];
    let counted = |row: usize, from: usize, len: usize| {
        (from..from + len)
            .filter(|&t| targets[row * seq + t] != IGNORED)
            .count() as f64
    };
    let total: f64 = alone.iter().map(|&(r, f, l)| counted(r, f, l)).sum();
    // A document's targets two ahead, what the module predicts.
    let ahead = |row: usize, from: usize, len: usize| {
        (from..from + len - 1)
            .filter(|&t| targets[row * seq + t + 1] != IGNORED)
            .count() as f64
    };
    let total_ahead: f64 = alone.iter().map(|&(r, f, l)| ahead(r, f, l)).sum();
    for (sp, recompute, latent, mtp) in [
        (false, Recompute::None, false, false),
        (true, Recompute::None, false, false),
        (false, Recompute::Selective, false, false),
        (false, Recompute::None, true, false),
        (true, Recompute::Selective, true, false),
        (true, Recompute::None, false, true),
    ] {
        let mut config = LlamaConfig::llama(vocab, 32, 2, 4, 2, 64, seq);
        config.loss.ignore_index = Some(IGNORED);
        config.recompute = recompute;
        // 2 heads of 8 + 4 rotated, values of 8, from a kv latent of 16.
        config.latent = latent.then(|| LatentAttentionConfig::new(32, 2, 16, 8, 4, 8, seq));
        config.mtp = mtp.then(|| MtpConfig::new(1));
        let tensor = match sp {
            true => TensorParallel::SequenceParallel,
            false => TensorParallel::Plain,
        };
        let dims = ParallelDims::tp_dp(h.world, 1);
        let planned = ParallelPlan::new(dims)
            .with_tensor(tensor)
            .apply(config, dims.world_size(), seq)
            .unwrap();
        h.run(dims, |ctx| {
            let device = ctx.device.clone().autodiff();
            let model = planned
                .init(
                    &device,
                    &ctx.groups,
                    &ParamInit::new(5, InitMode::Full).with_dtype(h.float),
                )
                .unwrap();
            let rows = |v: &[i64], n: usize| Tensor::<2, Int>::from_data(TensorData::new(v.to_vec(), [1, n]), &device);
            let documents = Documents::from_lengths(&lengths, seq, &device).unwrap();
            let all = |v: &Vec<i64>| Tensor::<2, Int>::from_data(TensorData::new(v.clone(), [2, seq]), &device);
            let (packed, _) = model
                .forward_loss_documents(all(&ids), all(&targets), Some(&documents))
                .unwrap();
            let packed_grads = gradients(&model, &packed.clone().backward());
            // Under SP a document's length must split over tp: pad each to the row's length
            // with ignored targets after it (causal attention: the padding changes nothing
            // before it).
            let mut weighted: Option<Tensor<1>> = None;
            for &(row, from, len) in &alone {
                let at = row * seq + from;
                let mut doc_ids = ids[at..at + len].to_vec();
                let mut doc_targets = targets[at..at + len].to_vec();
                doc_ids.resize(seq, 0);
                doc_targets.resize(seq, IGNORED);
                let (loss, report) = model
                    .forward_loss_documents(rows(&doc_ids, seq), rows(&doc_targets, seq), None)
                    .unwrap();
                let main = counted(row, from, len) / total;
                let share = match report.mtp {
                    Some(module) => {
                        (loss - module.clone()).mul_scalar(main)
                            + module.mul_scalar(ahead(row, from, len) / total_ahead)
                    }
                    None => loss.mul_scalar(main),
                };
                weighted = Some(match weighted {
                    Some(sum) => sum + share,
                    None => share,
                });
            }
            let weighted = weighted.unwrap();
            let alone_grads = gradients(&model, &weighted.clone().backward());
            let (ours, theirs) = (packed.into_scalar::<f64>(), weighted.into_scalar::<f64>());
            // Sums over other groupings of the same terms: a tenth of the split-product
            // tolerance, as the model's own parity test (f32 on the CPU: 1e-5).
            assert!(
                (ours - theirs).abs() <= 0.1 * h.matmul_tolerance * theirs,
                "sp={sp} {recompute:?} latent={latent} mtp={mtp}: loss {ours} vs {theirs}"
            );
            for (i, ((dims, a), (_, e))) in packed_grads.iter().zip(&alone_grads).enumerate() {
                let scale = e.iter().fold(1e-12f64, |m, v| m.max(v.abs()));
                let worst = a.iter().zip(e).fold(0f64, |m, (a, e)| m.max((a - e).abs()));
                // The same products summed over other rows and orders: the split-product
                // tolerance of the largest.
                assert!(
                    worst <= h.matmul_tolerance * scale,
                    "sp={sp} {recompute:?} latent={latent} mtp={mtp} parameter #{i} {dims:?}: {worst:e} vs {scale:e}"
                );
            }
        });
    }
}

/// Packed chat samples hold whole conversations in the shuffled order, as many as fit in
/// turn (a longer one cut to the row alone), their masks beside them and the padding after
/// them uncounted; each conversation appears once an epoch; unpacked, a conversation a sample.
pub fn chat_samples_pack_whole_conversations() {
    let dir = std::env::temp_dir().join(format!("burn-megatron-packing-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let prefix = dir.join("chats");
    let lengths = [3usize, 7, 2, 5, 12, 4];
    let mut tokens = IndexedWriter::create(&prefix, TokenType::U16).unwrap();
    let mut masks = IndexedWriter::create(&sft::mask_prefix(&prefix), TokenType::U8).unwrap();
    for (c, &len) in lengths.iter().enumerate() {
        // Conversation c's tokens are 10·(c + 1) + t; its second half is counted.
        let ids: Vec<u32> = (0..len).map(|t| (10 * (c + 1) + t) as u32).collect();
        tokens.add_document(&ids).unwrap();
        masks
            .add_document(&(0..len).map(|t| u32::from(t >= len / 2)).collect::<Vec<_>>())
            .unwrap();
    }
    tokens.finish().unwrap();
    masks.finish().unwrap();
    let open = |p: &std::path::Path| Arc::new(IndexedDataset::open(p).unwrap());
    let (data, mask) = (open(&prefix), open(&sft::mask_prefix(&prefix)));
    let seq = 9; // rows of 10 tokens
    let shape = SftShape {
        seq,
        samples: 12,
        seed: 3,
        pad: 0,
        pack: true,
    };
    let packed = SftDataset::new(data.clone(), mask.clone(), 0..lengths.len(), shape).unwrap();
    let mut seen = Vec::new();
    for i in 0..packed.len() {
        let sample = packed.sample(i, 1000).unwrap();
        assert_eq!(sample.tokens.len(), seq + 1);
        let used: usize = sample.documents.iter().sum();
        assert!(used <= seq + 1, "sample {i}: {:?}", sample.documents);
        let mut at = 0;
        for &n in &sample.documents {
            let c = sample.tokens[at] as usize / 10 - 1;
            assert_eq!(
                n,
                lengths[c].min(seq + 1),
                "sample {i}: conversation {c} whole or cut to the row"
            );
            for t in 0..n {
                assert_eq!(sample.tokens[at + t] as usize, 10 * (c + 1) + t);
                assert_eq!(sample.counted[at + t], t >= lengths[c] / 2);
            }
            seen.push(c);
            at += n;
        }
        assert!(sample.counted[used..].iter().all(|c| !c) && sample.tokens[used..].iter().all(|&t| t == 0));
    }
    // Each epoch's conversations, once each, in the packed order.
    for epoch in seen.chunks(lengths.len()).filter(|e| e.len() == lengths.len()) {
        let mut sorted = epoch.to_vec();
        sorted.sort();
        assert_eq!(sorted, (0..lengths.len()).collect::<Vec<_>>());
    }
    // Unpacked: the same order, a conversation a sample.
    let single = SftDataset::new(data, mask, 0..lengths.len(), SftShape { pack: false, ..shape }).unwrap();
    let firsts: Vec<usize> = (0..single.len())
        .map(|i| {
            let sample = single.sample(i, 1000).unwrap();
            assert_eq!(sample.documents.len(), 1);
            sample.tokens[0] as usize / 10 - 1
        })
        .collect();
    assert_eq!(firsts, seen[..firsts.len()]);
    let _ = std::fs::remove_dir_all(&dir);
}
