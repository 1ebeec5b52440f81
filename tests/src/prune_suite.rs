//! The pruning suite, on the `llama3` Hugging Face fixture (64 wide, 2 blocks of 8 query heads
//! over 4 kv heads of 8, FFN 128, tied): a target of the model's own sizes keeps its function;
//! a smaller one keeps exactly the most important rows and columns, saves, and loads at tp 2
//! with the same logits (heads no longer `d_model / n_heads` wide); a block that passes its
//! input through ranks last; bad targets are typed errors.

use std::path::PathBuf;

use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_megatron::models::llama::Llama;
use burn_megatron::models::llama::hf::{self, ExportOptions};
use burn_megatron::posttrain::prune::{self, PruneError, PruneTarget};
use burn_megatron_dist::{ParallelDims, ProcessGroups};

use crate::Harness;
use crate::hf_suite::{fixture, loaded};

const SEQ: usize = 16;

fn scratch(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("burn-megatron-prune-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Four windows of `[2, 17]` ids of the fixture's vocabulary: inputs and next tokens.
pub(crate) fn windows(device: &Device) -> Vec<Tensor<2, Int>> {
    (0..4)
        .map(|b| {
            let ids: Vec<i64> = (0..2 * (SEQ as i64 + 1)).map(|i| (i * 29 + b * 13 + 7) % 99).collect();
            Tensor::from_data(TensorData::new(ids, [2, SEQ + 1]), device)
        })
        .collect()
}

/// The logits of `model` on the first window's inputs, gathered over the vocabulary.
fn logits(model: &Llama, groups: &ProcessGroups, device: &Device) -> Vec<f32> {
    let ids = windows(device).remove(0).narrow(1, 0, SEQ);
    let shard = model.forward(ids).unwrap();
    groups
        .tp
        .all_gather(shard, 2)
        .unwrap()
        .narrow(2, 0, 99)
        .into_data()
        .try_to_vec()
        .unwrap()
}

fn worst(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// The model's own sizes keep every row and column in order: the same logits.
pub fn pruning_to_its_own_size_keeps_the_function(h: &Harness) {
    h.run(ParallelDims::single(), |ctx| {
        let device = ctx.device.clone();
        let (model, config) = loaded(&fixture("llama3"), &ctx.groups, &device, false);
        let importance = prune::importance(&model, &windows(&device)).unwrap();
        let (_, same) = prune::prune(&model, &config, &importance, PruneTarget::of(&config)).unwrap();
        let (a, b) = (
            logits(&model, &ctx.groups, &device),
            logits(&same, &ctx.groups, &device),
        );
        // The same values in the same products: exact.
        assert_eq!(worst(&a, &b), 0.0);
    });
}

/// Pruned to 1 block, 48 channels, FFN 64 and 1 query head a kv head: the parameters are the
/// original's kept rows and columns, chosen by importance; saved and loaded at tp 2 the model
/// gives the in-memory logits.
pub fn pruned_rows_and_columns_save_and_load(h: &Harness) {
    let dir = scratch("pruned");
    let target = PruneTarget {
        n_layers: 1,
        d_model: 48,
        d_ff: 64,
        heads_per_kv: 1,
    };
    let in_memory = h
        .run(ParallelDims::single(), |ctx| {
            let device = ctx.device.clone();
            let (model, config) = loaded(&fixture("llama3"), &ctx.groups, &device, false);
            let importance = prune::importance(&model, &windows(&device)).unwrap();
            let (pruned_config, pruned) = prune::prune(&model, &config, &importance, target).unwrap();
            assert_eq!(pruned.layers.len(), 1);
            assert_eq!(
                pruned_config.attention.head_dim,
                Some(8),
                "4 heads of 8 in a model of 48"
            );
            let block = prune::top(&importance.blocks.iter().map(|b| *b as f32).collect::<Vec<_>>(), 1)[0];
            let emb = prune::top(&importance.embedding, 48);
            let ffn = prune::top(&importance.ffn[block], 64);
            let values = |t: Tensor<2>| -> Vec<f32> { t.into_data().try_to_vec().unwrap() };
            // w1 is [d, f]: row r of the pruned weight is original row emb[r], column c is ffn[c].
            let (old, new) = (
                values(model.layers[block].mlp.as_ref().unwrap().w1.weight.val()),
                values(pruned.layers[0].mlp.as_ref().unwrap().w1.weight.val()),
            );
            for (r, &er) in emb.iter().enumerate() {
                for (c, &fc) in ffn.iter().enumerate() {
                    assert_eq!(new[r * 64 + c], old[er * 128 + fc], "w1[{r}, {c}]");
                }
            }
            // Query heads: the more important of each pair sharing a kv head.
            let scores = &importance.heads[block];
            let wq_old = values(model.layers[block].attention.as_ref().unwrap().wq.weight.val()); // [64, 64]
            let wq_new = values(pruned.layers[0].attention.as_ref().unwrap().wq.weight.val()); // [48, 32]
            for g in 0..4 {
                let head = if scores[2 * g + 1] > scores[2 * g] {
                    2 * g + 1
                } else {
                    2 * g
                };
                for (r, &er) in emb.iter().enumerate() {
                    for j in 0..8 {
                        assert_eq!(wq_new[r * 32 + g * 8 + j], wq_old[er * 64 + head * 8 + j]);
                    }
                }
            }
            hf::save(&dir, &pruned, &pruned_config, &ctx.groups, &ExportOptions::new()).unwrap();
            logits(&pruned, &ctx.groups, &device)
        })
        .remove(0);
    for got in h.run(ParallelDims::tp_dp(2, 1), |ctx| {
        let device = ctx.device.clone();
        let (model, _) = loaded(&dir, &ctx.groups, &device, false);
        logits(&model, &ctx.groups, &device)
    }) {
        let largest = in_memory.iter().fold(0.0f32, |m, v| m.max(v.abs())) as f64;
        // Split products sum in another order: the harness's split tolerance.
        assert!((worst(&got, &in_memory) as f64) <= h.matmul_tolerance * largest);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A block whose attention and MLP add nothing (their output projections zeroed) changes no
/// loss when left out: it ranks last and is the one a depth target drops.
pub fn a_pass_through_block_ranks_last(h: &Harness) {
    h.run(ParallelDims::single(), |ctx| {
        let device = ctx.device.clone();
        let (mut model, config) = loaded(&fixture("llama3"), &ctx.groups, &device, false);
        let block = &mut model.layers[0];
        let attention = block.attention.as_mut().unwrap();
        attention.wo.weight = attention.wo.weight.clone().map(|w| w.zeros_like());
        let mlp = block.mlp.as_mut().unwrap();
        mlp.w2.weight = mlp.w2.weight.clone().map(|w| w.zeros_like());
        let importance = prune::importance(&model, &windows(&device)).unwrap();
        assert_eq!(importance.blocks[0], 0.0, "the same model without it");
        assert!(importance.blocks[1] > 0.0, "{:?}", importance.blocks);
        let target = PruneTarget {
            n_layers: 1,
            ..PruneTarget::of(&config)
        };
        let (_, pruned) = prune::prune(&model, &config, &importance, target).unwrap();
        let kept = pruned.layers[0].attention.as_ref().unwrap().wq.weight.val().into_data();
        kept.assert_eq(
            &model.layers[1].attention.as_ref().unwrap().wq.weight.val().into_data(),
            true,
        );
    });
}

/// Targets larger than the model or of zero, a model split over tp, and importance of
/// another model are typed errors.
pub fn bad_prune_targets(h: &Harness) {
    h.run(ParallelDims::single(), |ctx| {
        let device = ctx.device.clone();
        let (model, config) = loaded(&fixture("llama3"), &ctx.groups, &device, false);
        let importance = prune::importance(&model, &windows(&device)).unwrap();
        let own = PruneTarget::of(&config);
        for (target, what) in [
            (PruneTarget { d_ff: 129, ..own }, "d_ff"),
            (PruneTarget { n_layers: 0, ..own }, "n_layers"),
            (PruneTarget { heads_per_kv: 3, ..own }, "heads_per_kv"),
        ] {
            match prune::prune(&model, &config, &importance, target) {
                Err(PruneError::Target { what: w, .. }) if w == what => {}
                other => panic!("{what}: {:?}", other.map(|_| ())),
            }
        }
        let mut shorter = importance.clone();
        shorter.blocks.pop();
        assert!(matches!(
            prune::prune(&model, &config, &shorter, own),
            Err(PruneError::Importance { .. })
        ));
    });
    h.run(ParallelDims::tp_dp(2, 1), |ctx| {
        let device = ctx.device.clone();
        let (model, _) = loaded(&fixture("llama3"), &ctx.groups, &device, false);
        assert_eq!(
            prune::importance(&model, &windows(&device)).unwrap_err(),
            PruneError::TensorParallel { tp: 2 }
        );
    });
}
