//! A save killed with SIGKILL at any moment leaves the previous checkpoint loadable.
//!
//! The test runs itself again as a child process that saves checkpoints in a loop, kills it at
//! varying moments, and loads what is on disk.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use burn::tensor::Device;
use burn_megatron::checkpoint;
use burn_megatron::init::{InitMode, ParamInit};
use burn_megatron::models::llama::LlamaConfig;
use burn_megatron::optim::DistributedAdamWConfig;
use burn_megatron_dist::ProcessGroups;

const CHILD: &str = "BURN_MEGATRON_SAVE_LOOP_DIR";

fn model(groups: &ProcessGroups, seed: u64) -> burn_megatron::models::llama::Llama {
    LlamaConfig::llama(70, 64, 2, 4, 4, 128, 32)
        .init(&Device::flex(), groups, &ParamInit::new(seed, InitMode::Full))
        .unwrap()
}

#[test]
fn a_killed_save_leaves_the_previous_checkpoint() {
    if let Some(dir) = std::env::var_os(CHILD) {
        // The child: save step after step until killed.
        let groups = ProcessGroups::single();
        let m = model(&groups, 1);
        let optim = DistributedAdamWConfig::new().init(&groups);
        for step in 1.. {
            checkpoint::save(&PathBuf::from(&dir), step, &m, &optim, &groups).unwrap();
        }
        return;
    }
    let dir = std::env::temp_dir().join(format!("burn-megatron-kill-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let groups = ProcessGroups::single();
    for (round, delay_ms) in [0u64, 7, 23, 61].into_iter().enumerate() {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "a_killed_save_leaves_the_previous_checkpoint", "--nocapture"])
            .env(CHILD, &dir)
            .spawn()
            .unwrap();
        // Wait for at least one complete checkpoint, then kill at a varying point of a later save.
        let start = Instant::now();
        while !dir.join("latest").exists() || (round == 0 && start.elapsed() < Duration::from_millis(200)) {
            assert!(start.elapsed() < Duration::from_secs(120), "the child never saved");
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(delay_ms));
        child.kill().unwrap(); // SIGKILL on Unix
        child.wait().unwrap();
        let mut optim = DistributedAdamWConfig::new().init(&groups);
        let loaded = checkpoint::load(&dir, model(&groups, 99), &mut optim, &groups);
        let (_, step) = loaded.unwrap_or_else(|e| panic!("round {round}: the checkpoint on disk does not load: {e}"));
        assert!(step >= 1, "round {round}: step {step}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
