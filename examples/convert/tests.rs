use burn_megatron::checkpoint::Saver;
use burn_megatron::optim::DistributedAdamWConfig;
use burn_megatron::train::Trainer;
use burn_megatron_dist::{ParallelDims, launch};

use super::*;

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("burn-megatron-convert-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// The default job's model saved by 2 tensor-parallel ranks with its job (as `train` saves),
/// converted: the same files as the whole model exported on one rank, and a model loaded from
/// them holds the same weights; a directory without a job is an error naming it.
#[test]
fn a_tensor_parallel_checkpoint_converts_to_the_whole_model() {
    let dir = scratch("tp2");
    let mut config = JobConfig::default();
    config.parallel.tp = 2;
    let job = config.resolve().unwrap();
    let (ckpt, converted, whole) = (dir.join("ckpt"), dir.join("converted"), dir.join("whole"));
    launch(
        ParallelDims::tp_dp(2, 1),
        |_| Device::flex(),
        |ctx| {
            let model = job.model.init(&ctx.device, &ctx.groups, &job.init()).unwrap();
            let trainer = Trainer::new(model, &DistributedAdamWConfig::new(), &ctx.groups, &ctx.device);
            let mut saver = Saver::new(&ckpt).with_attachment("job.toml", job.config.to_toml().into_bytes());
            saver
                .step(3, true, trainer.model(), trainer.optimizer(), &ctx.groups)
                .unwrap();
            saver.finish(&ctx.groups).unwrap();
        },
    )
    .unwrap();
    let line = convert(&ckpt, &converted, Dtype::F32).unwrap();
    assert!(line.contains("step 3"), "{line}");
    // The same model whole on one rank (`InitMode::Full`: every layout draws the same weights).
    let mut single = job.config.clone();
    single.parallel = ParallelSection::default();
    let single = single.resolve().unwrap();
    let groups = ProcessGroups::single();
    let model = single.model.init(&Device::flex(), &groups, &single.init()).unwrap();
    hf::save(&whole, &model, &single.model, &groups, &ExportOptions::new()).unwrap();
    for file in ["model.safetensors", "config.json"] {
        let (a, b) = (
            std::fs::read(converted.join(file)).unwrap(),
            std::fs::read(whole.join(file)).unwrap(),
        );
        assert!(a == b, "{file} differs");
    }
    let missing = convert(&dir.join("nowhere"), &dir.join("out"), Dtype::F32).unwrap_err();
    assert!(missing.contains("nowhere"), "{missing}");
    let _ = std::fs::remove_dir_all(&dir);
}
