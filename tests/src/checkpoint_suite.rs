//! The checkpoint suite: save at tp2 × dp2 (ZeRO-1) and resume at other layouts, the loss curve
//! unchanged; damaged, missing and incompatible checkpoints are errors that change nothing; a
//! save whose write fails at any point leaves the previous checkpoint whole.

use std::path::{Path, PathBuf};

use burn::optim::GradientsParams;
use burn::tensor::{Device, Int, Tensor, TensorData};
use std::sync::Arc;

use burn_megatron::checkpoint::storage::{Disk, Storage};
use burn_megatron::checkpoint::{self, CheckpointError, SaveOptions};
use burn_megatron::init::{InitMode, ParamInit};
use burn_megatron::models::llama::{Llama, LlamaConfig};
use burn_megatron::optim::{DistributedAdamW, DistributedAdamWConfig};
use burn_megatron::plan::{ParallelPlan, TensorParallel};
use burn_megatron_dist::{ParallelDims, ProcessGroups, ReduceOp};

use crate::Harness;

const SEQ: usize = 32;
const BATCH: usize = 2;

/// A small Llama: 2 layers, d 64, 4 heads, vocab 70 (padded at tp = 4).
fn config() -> LlamaConfig {
    LlamaConfig::llama(70, 64, 2, 4, 4, 128, SEQ)
}

fn model(groups: &ProcessGroups, device: &Device, seed: u64) -> Llama {
    let tp = groups.tp.size();
    let dims = ParallelDims::tp_dp(tp, groups.dp.size());
    let config = ParallelPlan::new(dims)
        .with_tensor(TensorParallel::SequenceParallel)
        .apply(config(), dims.world_size(), SEQ)
        .unwrap();
    config
        .init(device, groups, &ParamInit::new(seed, InitMode::Full))
        .unwrap()
}

fn batch(device: &Device, step: u64) -> (Tensor<2, Int>, Tensor<2, Int>) {
    let ids: Vec<i64> = (0..(BATCH * (SEQ + 1)) as u64)
        .map(|i| ((i * 31 + step * 7) % 70) as i64)
        .collect();
    let all = Tensor::<2, Int>::from_data(TensorData::new(ids, [BATCH, SEQ + 1]), device);
    (all.clone().narrow(1, 0, SEQ), all.narrow(1, 1, SEQ))
}

/// Runs steps `from..to` and returns the losses (averaged over dp).
fn train(
    model: &mut Llama,
    optim: &mut DistributedAdamW,
    groups: &ProcessGroups,
    device: &Device,
    steps: std::ops::Range<u64>,
) -> Vec<f64> {
    let per = BATCH / groups.dp.size();
    let first = groups.dp.group_rank() * per;
    steps
        .map(|step| {
            let (ids, targets) = batch(device, step);
            let loss = model
                .clone()
                .forward_loss(ids.narrow(0, first, per), targets.narrow(0, first, per))
                .unwrap();
            let value = groups
                .dp
                .all_reduce(loss.clone().detach(), ReduceOp::Avg)
                .unwrap()
                .into_scalar::<f64>();
            let grads = GradientsParams::from_grads(loss.backward(), &*model);
            *model = optim.step(3e-3, model.clone(), grads).unwrap().0;
            value
        })
        .collect()
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("burn-megatron-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Saves at tp2 × dp2 after 3 steps; resuming at tp1 × dp1, tp2 × dp1 and tp1 × dp2 gives the
/// same next 2 losses as going on without stopping.
pub fn resume_at_other_layouts(h: &Harness) {
    let dir = scratch("resume");
    let reference = h.run(ParallelDims::tp_dp(2, 2), |ctx| {
        let dev = ctx.device.clone().autodiff();
        let mut m = model(&ctx.groups, &dev, 5);
        let mut optim = DistributedAdamWConfig::new().with_zero1(true).init(&ctx.groups);
        train(&mut m, &mut optim, &ctx.groups, &dev, 0..3);
        checkpoint::save(&dir, 3, &m, &optim, &ctx.groups).unwrap();
        train(&mut m, &mut optim, &ctx.groups, &dev, 3..5)
    });
    for (tp, dp) in [(1, 1), (2, 1), (1, 2)] {
        let resumed = h.run(ParallelDims::tp_dp(tp, dp), |ctx| {
            let dev = ctx.device.clone().autodiff();
            // Another seed: every value must come from the checkpoint.
            let fresh = model(&ctx.groups, &dev, 99);
            let mut optim = DistributedAdamWConfig::new().with_zero1(true).init(&ctx.groups);
            let (mut m, step) = checkpoint::load(&dir, fresh, &mut optim, &ctx.groups).unwrap();
            assert_eq!(step, 3);
            train(&mut m, &mut optim, &ctx.groups, &dev, 3..5)
        });
        for losses in resumed {
            for (a, b) in losses.iter().zip(&reference[0]) {
                // Another layout sums its products and gradients in another order (see the
                // model suite): two Adam steps from identical state stay within this.
                assert!(
                    (a - b).abs() <= 10.0 * h.matmul_tolerance * b.abs(),
                    "tp{tp}×dp{dp}: {losses:?} vs {:?}",
                    reference[0]
                );
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// An asynchronous save at tp2 × dp2 while training goes on: the same checkpoint as a
/// synchronous one (resumed at tp1 × dp1, the same next losses), and the training steps taken
/// while it was written are unchanged.
pub fn async_save_while_training(h: &Harness) {
    let dir = scratch("async");
    let (reference, during) = {
        let runs = h.run(ParallelDims::tp_dp(2, 2), |ctx| {
            let dev = ctx.device.clone().autodiff();
            let mut m = model(&ctx.groups, &dev, 5);
            let mut optim = DistributedAdamWConfig::new().with_zero1(true).init(&ctx.groups);
            train(&mut m, &mut optim, &ctx.groups, &dev, 0..3);
            let mut saver = checkpoint::AsyncSaver::new();
            saver.save(&dir, 3, &m, &optim, &ctx.groups).unwrap();
            let during = train(&mut m, &mut optim, &ctx.groups, &dev, 3..5);
            saver.finish(&ctx.groups).unwrap();
            during
        });
        (runs[0].clone(), runs)
    };
    for losses in &during {
        assert_eq!(losses, &reference, "every rank reports the dp-averaged loss");
    }
    let resumed = h.run(ParallelDims::tp_dp(1, 1), |ctx| {
        let dev = ctx.device.clone().autodiff();
        let mut optim = DistributedAdamWConfig::new().with_zero1(true).init(&ctx.groups);
        let (mut m, step) = checkpoint::load(&dir, model(&ctx.groups, &dev, 99), &mut optim, &ctx.groups).unwrap();
        assert_eq!(step, 3);
        train(&mut m, &mut optim, &ctx.groups, &dev, 3..5)
    });
    for (a, b) in resumed[0].iter().zip(&reference) {
        // As in `resume_at_other_layouts`: another layout, another summation order.
        assert!(
            (a - b).abs() <= 10.0 * h.matmul_tolerance * b.abs(),
            "{:?} vs {reference:?}",
            resumed[0]
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A run's [`checkpoint::Saver`] at tp 2 × dp 2, saving every step with the newest 2 kept and the
/// job attached, in the foreground and on its own thread: 2 checkpoints are left, `latest` names
/// the last step's, its attachment reads back, and it resumes at tp 1 with the step it was
/// saved at.
pub fn saver_keeps_the_newest(h: &Harness) {
    for background in [false, true] {
        let dir = scratch(&format!("saver-{background}"));
        h.run(ParallelDims::tp_dp(2, 2), |ctx| {
            let dev = ctx.device.clone().autodiff();
            let mut m = model(&ctx.groups, &dev, 5);
            let mut optim = DistributedAdamWConfig::new().with_zero1(true).init(&ctx.groups);
            let mut saver = checkpoint::Saver::new(&dir)
                .with_interval(Some(1))
                .with_keep_last(Some(2))
                .in_background(background)
                .with_attachment("job.toml", b"steps = 4\n".to_vec());
            for step in 1..=4 {
                train(&mut m, &mut optim, &ctx.groups, &dev, step - 1..step);
                let saved = saver.step(step as usize, step == 4, &m, &optim, &ctx.groups).unwrap();
                assert!(saved);
            }
            saver.finish(&ctx.groups).unwrap();
        });
        let mut kept: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("step-"))
            .collect();
        kept.sort();
        assert_eq!(kept.len(), 2, "background {background}: {kept:?}");
        assert!(
            kept[0].starts_with("step-00000003-") && kept[1].starts_with("step-00000004-"),
            "{kept:?}"
        );
        let job = checkpoint::attachment(&dir, "job.toml").unwrap();
        assert_eq!(job.as_deref(), Some(&b"steps = 4\n"[..]));
        assert_eq!(checkpoint::attachment(&dir, "other").unwrap(), None);
        let steps = h.run(ParallelDims::tp_dp(1, 1), |ctx| {
            let dev = ctx.device.clone().autodiff();
            let mut optim = DistributedAdamWConfig::new().init(&ctx.groups);
            checkpoint::load(&dir, model(&ctx.groups, &dev, 99), &mut optim, &ctx.groups)
                .unwrap()
                .1
        });
        assert_eq!(steps, vec![4]);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// 30 steps at tp2 × dp2 (sequence parallel, ZeRO-1) against tp1 × dp1: the same losses.
pub fn tp2_dp2_matches_single_device_for_30_steps(h: &Harness) {
    let run = |tp: usize, dp: usize| {
        h.run(ParallelDims::tp_dp(tp, dp), |ctx| {
            let dev = ctx.device.clone().autodiff();
            let mut m = model(&ctx.groups, &dev, 5);
            let mut optim = DistributedAdamWConfig::new().with_zero1(true).init(&ctx.groups);
            train(&mut m, &mut optim, &ctx.groups, &dev, 0..30)
        })
    };
    let single = run(1, 1).remove(0);
    assert!(
        single[29] < 0.8 * single[0],
        "the model learns: {} → {}",
        single[0],
        single[29]
    );
    for losses in run(2, 2) {
        for (step, (a, b)) in losses.iter().zip(&single).enumerate() {
            // Split products and dp-averaged half batches reorder f32 sums; Adam carries the
            // rounding from step to step. Over 30 steps it stays within 20× the split-product
            // tolerance (2e-3 relative on the CPU).
            assert!(
                (a - b).abs() <= 20.0 * h.matmul_tolerance * b.abs(),
                "step {step}: tp2×dp2 loss {a} vs tp1×dp1 {b}"
            );
        }
    }
}

/// A storage that fails its `fail_at`-th write (counting from 1; 0: none), as a full disk
/// would, and counts them.
#[derive(Debug, Default)]
struct Failing {
    fail_at: usize,
    calls: std::sync::atomic::AtomicUsize,
}

impl Failing {
    fn call(&self, what: &str, path: &Path) -> std::io::Result<()> {
        let n = self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        match n == self.fail_at {
            true => Err(std::io::Error::other(format!(
                "injected failure of write {n} ({what} {})",
                path.display()
            ))),
            false => Ok(()),
        }
    }
}

impl Storage for Failing {
    fn create_dir(&self, dir: &Path) -> std::io::Result<()> {
        self.call("create_dir", dir)?;
        Disk.create_dir(dir)
    }

    fn write_temporary(&self, temporary: &Path, bytes: &[u8]) -> std::io::Result<()> {
        self.call("write_temporary", temporary)?;
        Disk.write_temporary(temporary, bytes)
    }

    fn rename(&self, from: &Path, to: &Path) -> std::io::Result<()> {
        self.call("rename", to)?;
        Disk.rename(from, to)
    }

    fn remove_file(&self, path: &Path) -> std::io::Result<()> {
        self.call("remove_file", path)?;
        Disk.remove_file(path)
    }

    fn remove_dir(&self, dir: &Path) -> std::io::Result<()> {
        self.call("remove_dir", dir)?;
        Disk.remove_dir(dir)
    }
}

/// Every parameter's bits on this rank.
fn bits(model: &Llama) -> Vec<Vec<u32>> {
    burn_megatron::params::param_values(model)
        .into_iter()
        .map(|p| {
            let values = p.value.into_data().convert::<f32>().try_to_vec::<f32>().unwrap();
            values.into_iter().map(f32::to_bits).collect()
        })
        .collect()
}

/// At tp 2 × dp 2 with ZeRO-1, a save of step 2 whose k-th write fails on one rank, for every
/// rank and every k, written in the foreground and on its own thread: an error on every rank
/// (the failing one's naming the write), `latest` still the step-1 checkpoint, which loads
/// bit for bit as it was saved, and nothing of the failed save left in the directory.
pub fn failed_writes_leave_the_previous_checkpoint(h: &Harness) {
    let dims = ParallelDims::tp_dp(2, 2);
    // One rank's model after `steps` steps, and its optimizer.
    let trained = |ctx: &burn_megatron_dist::RankContext, steps: u64| {
        let dev = ctx.device.clone().autodiff();
        let mut m = model(&ctx.groups, &dev, 5);
        let mut optim = DistributedAdamWConfig::new().with_zero1(true).init(&ctx.groups);
        train(&mut m, &mut optim, &ctx.groups, &dev, 0..steps);
        (m, optim)
    };
    let loaded = |dir: &Path| {
        h.run(ParallelDims::tp_dp(1, 1), |ctx| {
            let dev = ctx.device.clone().autodiff();
            let mut optim = DistributedAdamWConfig::new().init(&ctx.groups);
            let (m, step) = checkpoint::load(dir, model(&ctx.groups, &dev, 99), &mut optim, &ctx.groups).unwrap();
            (step, bits(&m))
        })
        .remove(0)
    };
    for background in [false, true] {
        let dir = scratch(&format!("failing-{background}"));
        let counting = scratch(&format!("counting-{background}"));
        // The step-1 checkpoint, and each rank's writes in a save of step 2.
        let calls = h.run(dims, |ctx| {
            let (m, optim) = trained(&ctx, 1);
            checkpoint::save(&dir, 1, &m, &optim, &ctx.groups).unwrap();
            let (m, optim) = trained(&ctx, 2);
            let counter = Arc::new(Failing::default());
            let options = SaveOptions::default().with_storage(counter.clone());
            checkpoint::save_with(&counting, 2, &m, &optim, &ctx.groups, &options).unwrap();
            counter.calls.load(std::sync::atomic::Ordering::SeqCst)
        });
        let saved = loaded(&dir);
        assert_eq!(saved.0, 1);
        for (rank, &writes) in calls.iter().enumerate() {
            for k in 1..=writes {
                // Every write syncs to disk: beside the suite's other tests on a busy 2-core
                // machine a rank can wait for its peers' syncs past the harness's 45 s.
                let errors = h.run_with_timeout(dims, std::time::Duration::from_secs(300), |ctx| {
                    let (m, optim) = trained(&ctx, 2);
                    let storage: Arc<dyn Storage> = match ctx.global_rank == rank {
                        true => Arc::new(Failing {
                            fail_at: k,
                            ..Failing::default()
                        }),
                        false => Arc::new(Disk),
                    };
                    let options = SaveOptions::default().with_storage(storage);
                    let result = match background {
                        false => checkpoint::save_with(&dir, 2, &m, &optim, &ctx.groups, &options),
                        true => {
                            let mut saver = checkpoint::AsyncSaver::new();
                            saver.save_with(&dir, 2, &m, &optim, &ctx.groups, &options).unwrap();
                            saver.finish(&ctx.groups)
                        }
                    };
                    result.err().map(|e| e.to_string())
                });
                let case = format!("background {background}, rank {rank}'s write {k} of {writes}");
                assert!(errors.iter().all(Option::is_some), "{case}: {errors:?}");
                let own = errors[rank].as_deref().unwrap_or_default();
                assert!(own.contains("injected failure"), "{case}: {own}");
                assert_eq!(loaded(&dir), saved, "{case}: the step-1 checkpoint changed");
                let left: Vec<String> = std::fs::read_dir(&dir)
                    .unwrap()
                    .flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| !n.starts_with("step-00000001-") && n != "latest")
                    .collect();
                assert!(left.is_empty(), "{case}: {left:?} left behind");
            }
        }
        assert!(calls.iter().sum::<usize>() >= 10, "{calls:?}");
        let _ = std::fs::remove_dir_all(&dir);
        let _ = std::fs::remove_dir_all(&counting);
    }
}

/// Damaged (truncated, a flipped bit in the header or among the values), missing and
/// incompatible checkpoints are typed errors, and a save that died half way (its staging directory left behind) does not hide the previous checkpoint.
pub fn bad_checkpoints_are_errors(h: &Harness) {
    let dir = scratch("bad");
    h.run(ParallelDims::tp_dp(1, 1), |ctx| {
        let dev = ctx.device.clone().autodiff();
        let load = |dir: &Path| {
            let mut optim = DistributedAdamWConfig::new().init(&ctx.groups);
            checkpoint::load(dir, model(&ctx.groups, &dev, 1), &mut optim, &ctx.groups).map(|(_, step)| step)
        };
        assert!(matches!(load(&dir), Err(CheckpointError::NotFound { .. })));
        let mut m = model(&ctx.groups, &dev, 1);
        let mut optim = DistributedAdamWConfig::new().init(&ctx.groups);
        train(&mut m, &mut optim, &ctx.groups, &dev, 0..1);
        checkpoint::save(&dir, 1, &m, &optim, &ctx.groups).unwrap();
        // A save killed half way leaves its staging directory and partial files.
        let staging = dir.join(".step-00000002.partial");
        std::fs::create_dir_all(&staging).unwrap();
        std::fs::write(staging.join("tp-000-of-001-ep-000-of-001.safetensors"), b"partial").unwrap();
        assert_eq!(load(&dir), Ok(1));

        let latest = std::fs::read_to_string(dir.join("latest")).unwrap();
        let file = dir.join(latest.trim()).join("tp-000-of-001-ep-000-of-001.safetensors");
        let good = std::fs::read(&file).unwrap();
        std::fs::write(&file, &good[..good.len() / 2]).unwrap();
        assert!(matches!(load(&dir), Err(CheckpointError::Format { .. })), "truncated");
        let mut flipped = good.clone();
        flipped[10] ^= 0xff;
        std::fs::write(&file, &flipped).unwrap();
        assert!(
            matches!(load(&dir), Err(CheckpointError::Format { .. })),
            "corrupted header"
        );
        // A flipped bit among the values parses, and its checksum refuses it, naming the file.
        let mut flipped = good.clone();
        *flipped.last_mut().unwrap() ^= 0x01;
        std::fs::write(&file, &flipped).unwrap();
        let error = load(&dir).unwrap_err();
        assert!(matches!(error, CheckpointError::Format { .. }), "{error}");
        assert!(
            error.to_string().contains("tp-000-of-001-ep-000-of-001.safetensors"),
            "{error}"
        );
        std::fs::write(&file, &good).unwrap();
        assert_eq!(load(&dir), Ok(1));

        // Another model shape: refused, naming the tensor.
        let other = LlamaConfig::llama(70, 32, 2, 4, 4, 128, SEQ)
            .init(&dev, &ctx.groups, &ParamInit::new(1, InitMode::Full))
            .unwrap();
        let mut optim = DistributedAdamWConfig::new().init(&ctx.groups);
        let err = checkpoint::load(&dir, other, &mut optim, &ctx.groups).unwrap_err();
        assert!(matches!(err, CheckpointError::Incompatible { .. }), "{err}");
    });
    let _ = std::fs::remove_dir_all(&dir);
}

/// A model saved in Hugging Face's layout at tp = 2 loads back at tp = 1 and tp = 4 (a padded
/// vocabulary there) with the same loss; the file has Hugging Face's names and `[out, in]`
/// layout, and the vocabulary unpadded.
pub fn hugging_face_round_trip(h: &Harness) {
    use burn_megatron::models::llama::hf;
    let dir = scratch("hf");
    let loss_of = |m: &Llama, groups: &ProcessGroups, dev: &Device| {
        let (ids, targets) = batch(dev, 0);
        let per = BATCH / groups.dp.size();
        let first = groups.dp.group_rank() * per;
        let loss = m
            .forward_loss(ids.narrow(0, first, per), targets.narrow(0, first, per))
            .unwrap();
        groups.dp.all_reduce(loss, ReduceOp::Avg).unwrap().into_scalar::<f64>()
    };
    let saved = h.run(ParallelDims::tp_dp(2, 1), |ctx| {
        let dev = ctx.device.clone();
        let m = model(&ctx.groups, &dev, 5);
        hf::save(&dir, &m, &config(), &ctx.groups, &hf::ExportOptions::new()).unwrap();
        loss_of(&m, &ctx.groups, &dev)
    })[0];
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(
        file.tensor("model.layers.0.mlp.gate_proj.weight").unwrap().shape(),
        &[128, 64]
    );
    assert_eq!(file.tensor("model.embed_tokens.weight").unwrap().shape(), &[70, 64]);
    assert_eq!(file.tensor("lm_head.weight").unwrap().shape(), &[70, 64]);
    let config = hf::read_config(&dir).unwrap();
    assert_eq!(config.to_llama().mlp.d_ff, 128);
    for tp in [1, 4] {
        let losses = h.run(ParallelDims::tp_dp(tp, 1), |ctx| {
            let dev = ctx.device.clone();
            let m = hf::load(&dir, model(&ctx.groups, &dev, 99), &ctx.groups).unwrap();
            loss_of(&m, &ctx.groups, &dev)
        });
        for loss in losses {
            // The same weights at another tp: products split differently (see the model suite).
            assert!(
                (loss - saved).abs() <= 0.1 * h.matmul_tolerance * saved,
                "tp={tp}: {loss} vs {saved}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
