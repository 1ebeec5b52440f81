use std::path::PathBuf;

use clap::Parser;

use super::*;

/// The job a command line names (the program's name first, as the shell gives it).
fn job(flags: &str) -> Result<Job, String> {
    let argv = std::iter::once("train").chain(flags.split_whitespace()).map(Into::into);
    let (rest, dotted) = cli::split(argv)?;
    let args = cli::Args::try_parse_from(rest).map_err(|e| e.to_string())?;
    args.job(&dotted).and_then(|j| j.resolve()).map_err(|e| e.to_string())
}

/// Trains as `flags` say through the plain loop unless they name a driver; returns the losses
/// the reporting rank read.
fn run(flags: &str) -> Result<Vec<f64>, String> {
    let driver = match flags.contains("--learner") {
        true => "",
        false => " --plain",
    };
    train(job(&format!("{flags}{driver}"))?)
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("burn-megatron-train-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// `a` and `b` step by step within `relative` of `b`.
fn close(a: &[f64], b: &[f64], relative: f64, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: {a:?} vs {b:?}");
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() <= relative * y.abs(), "{what}: {a:?} vs {b:?}");
    }
}

/// Burn's Learner and the plain loop print the same losses for the same seed and layout: both
/// step through the library's `Trainer`, read by the same `Routine` (tp 2 × dp 2 with SP and
/// ZeRO-1, cp 2, pp 2 × vpp 2, a MoE over ep 2 with delayed FP8). The same operations in the
/// same order: equal.
#[cfg(feature = "learner")]
#[test]
fn the_learner_prints_the_losses_of_the_plain_loop() {
    for layout in [
        "--tp 2 --dp 2 --sp --zero1",
        "--cp 2 --dp 2 --sample-every 0",
        "--pp 2 --vpp 2 --dp 2 --layers 4 --tied",
        "--precision fp8-delayed --preset tiny-moe --dp 2 --ep 2 --sample-every 0",
    ] {
        let common = format!("{layout} --steps 3 --seq 32 --batch 4");
        let plain = run(&common).unwrap();
        let learner = run(&format!("{common} --learner")).unwrap();
        assert_eq!(plain.len(), 3, "{layout}");
        assert_eq!(learner, plain, "{layout}");
    }
}

/// Every bad flag or value is an error before any tensor exists, naming what is wrong, never a
/// panic and never a silent run.
#[test]
fn bad_flags_and_values_are_errors_before_training() {
    let table = [
        ("--seq 300", "longer than the model's 256 positions"),
        ("--seq 0", "sequence length must be at least 1"),
        ("--seq -5", "unexpected argument '-5'"),
        ("--batch 0", "batch size must be at least 1"),
        ("--batch 3 --dp 2", "does not split evenly over dp = 2"),
        ("--lr -1", "learning rate -1 must be"),
        ("--lr 0", "learning rate 0 must be"),
        ("--lr nan", "learning rate NaN must be"),
        ("--lr inf", "learning rate inf must be"),
        ("--lr fast", "invalid value 'fast' for '--lr <LR>'"),
        ("--tp 0", "parallel.tp: must be at least 1"),
        ("--ep 0", "parallel.ep: must be at least 1"),
        ("--etp 0", "parallel.etp: must be at least 1"),
        (
            "--preset tiny-moe --tp 2 --ep 2 --etp 1",
            "etp = 1 below tp = 2 needs sequence parallelism",
        ),
        ("--preset tiny-moe --tp 2 --sp --etp 3", "etp = 3 must divide tp = 2"),
        ("--preset tiny-moe --ep 2", "ep = 2 must divide (tp/etp)·dp·cp = 1"),
        (
            "--preset tiny-moe --ep 3 --dp 3 --batch 3",
            "8 experts do not split evenly over ep = 3",
        ),
        ("--dispatcher ring", "invalid value 'ring' for '--dispatcher"),
        ("--pp 0", "parallel.pp: must be at least 1"),
        ("--pp 3", "2 blocks do not split into 3 pipeline stages"),
        ("--layers 0", "invalid value '0' for '--layers <N>': must be at least 1"),
        (
            "--pp 2 --vpp 2 --layers 4 --batch 6 --micro-batch 2",
            "3 microbatches do not form whole rounds of pp = 2",
        ),
        (
            "--pp 2 --micro-batch 3",
            "batch.micro: 3 sequences a microbatch do not split a rank's 2",
        ),
        ("--micro-batch 0", "invalid value '0' for '--micro-batch <N>'"),
        ("--dp 0", "parallel.dp: must be at least 1"),
        ("--cp 0", "parallel.cp: must be at least 1"),
        ("--cp 2 --seq 30", "does not split into 2·cp = 4 equal chunks"),
        (
            "--cp 8 --context all-to-all --seq 64",
            "4 n_heads on each tp rank do not scatter over cp = 8",
        ),
        ("--cp 2 --sample-every 5", "sample_every = 0"),
        ("--context sideways", "invalid value 'sideways' for '--context"),
        ("--tp 3", "n_heads = 4 is not divisible by tp = 3"),
        ("--tp 2 --sp --seq 255", "not divisible by tp = 2"),
        ("--steps 0", "invalid value '0' for '--steps <N>'"),
        ("--steps 1.5", "invalid value '1.5' for '--steps <N>'"),
        ("--preset llama-70b", "unknown preset"),
        ("--device tpu", "invalid value 'tpu' for '--device"),
        ("--dtype f16", "invalid value 'f16' for '--dtype"),
        ("--precision fp4", "unknown recipe \"fp4\""),
        ("--precision fp8-delayed:0", "a length of at least 1"),
        ("--bf16-blocks 1,1", "it needs precision.recipe"),
        ("--precision fp8-tensorwise --bf16-blocks 1", "expected FIRST,LAST"),
        (
            "--precision fp8-tensorwise --bf16-blocks one,1",
            "\"one\" is not a whole number",
        ),
        ("--init sparse", "invalid value 'sparse' for '--init"),
        (
            "--save-interval 0 --save /tmp/x",
            "checkpoint.interval: must be at least 1",
        ),
        ("--save-interval 5", "need checkpoint.dir"),
        ("--schedule warmup-stable-decay", "missing field `decay`"),
        ("--schedule warmup-cosine --warmup 500", "do not fit a run of 200"),
        ("--clip-grad -1", "optimizer.clip_grad: -1 must be"),
        ("--eval-interval 5", "set data.held_out above 0"),
        ("--frobnicate", "unexpected argument '--frobnicate'"),
        ("--tp", "a value is required for '--tp <N>'"),
        ("--optimizer.lrr 1", "--optimizer.lrr: unknown field `lrr`"),
        ("--optimizer.lr", "--optimizer.lr needs a value"),
        ("--plain --learner", "cannot be used with"),
        ("--load /nonexistent/ckpt", "no checkpoint in /nonexistent/ckpt"),
    ];
    for (flags, expected) in table {
        let outcome = std::panic::catch_unwind(|| job(flags).and_then(|j| prepare(j).map(|_| ())));
        let error = outcome
            .unwrap_or_else(|_| panic!("{flags}: panicked instead of an error"))
            .expect_err(flags);
        assert!(error.contains(expected), "{flags}: {error:?} does not say {expected:?}");
    }
}

/// `--help` is clap's: it goes to standard output and exits with 0.
#[test]
fn help_is_on_stdout_with_exit_0() {
    let help = cli::Args::try_parse_from(["train", "--help"]).unwrap_err();
    assert_eq!(help.kind(), clap::error::ErrorKind::DisplayHelp);
    assert!(!help.use_stderr() && help.exit_code() == 0);
    let text = help.to_string();
    for flag in [
        "--config",
        "--tensor-model-parallel-size",
        "--micro-batch-size",
        "--lr-warmup-iters",
        "--optimizer.lr",
    ] {
        assert!(
            text.contains(flag) || text.contains(flag.trim_start_matches("--")),
            "{flag} in\n{text}"
        );
    }
}

/// A job file with overrides: the file's fields, the dotted override and the flag each win in
/// turn, and the run trains.
#[test]
fn a_job_file_with_overrides_trains() {
    let dir = scratch("job-file");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("job.toml");
    std::fs::write(&file, "steps = 9\n[optimizer]\nlr = 1e-2\n[parallel]\ntp = 2\n").unwrap();
    let flags = format!("--config {} --optimizer.lr=2e-3 --steps 2 --seq 32", file.display());
    let job = job(&flags).unwrap();
    assert_eq!(
        (job.config.steps, job.config.optimizer.lr, job.config.parallel.tp),
        (2, 2e-3, 2)
    );
    assert_eq!(run(&flags).unwrap().len(), 2);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every preset's job file resolves (the models too large for the CPU included: nothing is
/// built), and the tiny one trains as the defaults do.
#[test]
fn the_job_files_resolve() {
    let jobs = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("jobs");
    for name in ["tiny", "tiny-moe", "llama-1b", "llama-8b", "moe-4b"] {
        let file = jobs.join(format!("{name}.toml"));
        job(&format!("--config {}", file.display())).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
    let tiny = format!("--config {} --steps 3 --seq 32", jobs.join("tiny.toml").display());
    close(
        &run(&tiny).unwrap(),
        &run("--steps 3 --seq 32").unwrap(),
        0.0,
        "tiny.toml",
    );
}

/// Gradient accumulation: a rank's 4 sequences as 2 microbatches of 2 (and 4 of 1) give the
/// losses of one batch of 4, at tp 2 × dp 2 with ZeRO-1 and at pp 2 (whose microbatches the
/// schedule runs). The same sums in another grouping, carried over 5 AdamW steps: 1e-4.
#[test]
fn accumulation_gives_the_losses_of_the_whole_batch() {
    for layout in ["--tp 2 --dp 2 --sp --zero1", "--pp 2 --layers 4"] {
        let common = format!("{layout} --steps 5 --seq 32 --batch 8 --sample-every 0");
        let per_rank = if layout.contains("--dp 2") { 4 } else { 8 };
        let whole = run(&format!("{common} --micro-batch {per_rank}")).unwrap();
        for micro in [per_rank / 2, per_rank / 4] {
            let accumulated = run(&format!("{common} --micro-batch {micro}")).unwrap();
            close(&accumulated, &whole, 1e-4, &format!("{layout} --micro-batch {micro}"));
        }
    }
}

/// Every low-precision recipe in the blocks' linear layers (emulated on the CPU), FP8
/// tensorwise data-parallel and the others tensor-parallel with SP (amaxes reduced over tp):
/// each trains and ends without an error.
#[test]
fn trains_with_every_recipe() {
    for recipe in burn_megatron_kernels::quant::recipe::Recipe::ALL {
        let layout = match recipe {
            burn_megatron_kernels::quant::recipe::Recipe::Fp8Tensorwise => "--dp 2",
            _ => "--tp 2 --sp",
        };
        let flags = format!(
            "--precision {} {layout} --steps 2 --seq 32 --batch 4 --sample-every 0",
            recipe.spec()
        );
        run(&flags).unwrap_or_else(|e| panic!("{flags}: {e}"));
    }
}

/// The MoE preset trains with its experts over ep = 2 (both dispatchers, ZeRO-1 with one,
/// tp = 2 with SP beside the other): each ends without an error.
#[test]
fn trains_a_mixture_of_experts_over_ep() {
    for flags in [
        "--preset tiny-moe --dp 2 --ep 2 --zero1",
        "--preset tiny-moe --tp 2 --sp --dp 2 --ep 2 --dispatcher all-gather",
        "--preset tiny-moe --tp 2 --sp --ep 2 --etp 1",
    ] {
        let flags = format!("{flags} --steps 2 --seq 32 --batch 4 --sample-every 0");
        run(&flags).unwrap_or_else(|e| panic!("{flags}: {e}"));
    }
}

/// A pipeline of 2 stages (1F1B; beside dp 2, over tp 2 with SP, and tp 2 × pp 2 × dp 2:
/// world 8), and of 2 stages × 2 chunks (interleaved), over 4 blocks prints pp = 1's losses:
/// the same data, the same model (`init = "full"` names every parameter by its path), the
/// mean over microbatches the batch's mean. f32 sums in another order, carried 5 AdamW steps:
/// 1e-4 relative.
#[test]
fn a_pipeline_prints_the_losses_of_one_stage() {
    let common = "--layers 4 --steps 5 --seq 32 --batch 4 --sample-every 0";
    let reference = run(common).unwrap();
    assert_eq!(reference.len(), 5);
    for (flags, one_stage) in [
        ("--pp 2", None),
        ("--pp 2 --vpp 2", None),
        ("--pp 2 --vpp 2 --recompute selective", None),
        ("--pp 2 --recompute full:1", None),
        ("--pp 2 --dp 2", Some("--dp 2")),
        ("--pp 2 --tp 2 --sp", Some("--tp 2 --sp")),
        ("--pp 2 --tp 2 --sp --dp 2", Some("--tp 2 --sp --dp 2")),
        ("--pp 2 --tied", Some("--tied")),
        ("--pp 2 --cp 2", Some("--cp 2")),
        ("--pp 2 --vpp 2 --cp 2 --tp 2 --sp", Some("--cp 2 --tp 2 --sp")),
        ("--pp 2 --vpp 2 --tied --tp 2 --sp", Some("--tied --tp 2 --sp")),
    ] {
        let losses = run(&format!("{common} {flags}")).unwrap_or_else(|e| panic!("{flags}: {e}"));
        let reference = match one_stage {
            Some(layout) => run(&format!("{common} {layout}")).unwrap(),
            None => reference.clone(),
        };
        close(&losses, &reference, 1e-4, flags);
    }
}

/// A checkpoint saved by 2 pipeline stages after 3 steps (on the saver's thread) resumes at pp
/// 1 and at pp 4 with the losses of the pp 2 run that went on (f32 sums in another order over 2
/// AdamW steps: 1e-4 relative). With tied embeddings the two stages' copies are written once
/// and read by both ends at pp 4. The schedule may change on resume; the model may not.
#[test]
fn checkpoints_resume_at_other_layouts_and_keep_their_model() {
    for tied in ["", "--tied"] {
        let dir = scratch(&format!("pp-ckpt{tied}"));
        let common = format!("--layers 4 --seq 32 --batch 4 --sample-every 0 {tied}");
        let reference = run(&format!("{common} --pp 2 --steps 5")).unwrap();
        run(&format!(
            "{common} --pp 2 --steps 3 --save {} --async-save",
            dir.display()
        ))
        .unwrap();
        for pp in [1, 4] {
            let flags = format!("{common} --pp {pp} --steps 5 --load {}", dir.display());
            let losses = run(&flags).unwrap_or_else(|e| panic!("{flags}: {e}"));
            close(&losses, &reference[3..], 1e-4, &flags);
        }
        let changed = run(&format!("{common} --layers 2 --steps 5 --load {}", dir.display())).unwrap_err();
        assert!(changed.contains("with model.layers = 4, this job has 2"), "{changed}");
        let lr = run(&format!(
            "{common} --steps 5 --lr 1e-3 --schedule warmup-cosine --load {}",
            dir.display()
        ));
        assert_eq!(lr.unwrap().len(), 2, "a new schedule continues");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// Context parallelism prints cp = 1's losses over 20 steps: cp 2 with each exchange, tp 2
/// × cp 2 with SP, and cp 2 × dp 2 (world 4, against dp 2): the same data and model, each
/// sequence's chunks over the cp ranks, the loss counting every rank's tokens. f32 sums in
/// another order carried 20 AdamW steps: 1e-4 relative.
#[test]
fn context_parallelism_prints_the_losses_of_one_rank() {
    let common = "--steps 20 --seq 32 --batch 4 --sample-every 0";
    let reference = run(common).unwrap();
    let data_parallel = run(&format!("{common} --dp 2")).unwrap();
    for (flags, against) in [
        ("--cp 2", &reference),
        ("--cp 2 --context all-to-all", &reference),
        ("--cp 2 --context all-gather", &reference),
        ("--cp 2 --tp 2 --sp", &reference),
        ("--cp 2 --dp 2 --zero1", &data_parallel),
    ] {
        let losses = run(&format!("{common} {flags}")).unwrap_or_else(|e| panic!("{flags}: {e}"));
        close(&losses, against, 1e-4, flags);
    }
}

/// A run writes its metrics file beside its checkpoints (a line a step with the loss it
/// printed, and its evaluations on the held-out share), keeps the newest checkpoints only, and
/// a resumed run appends to the file.
#[test]
fn metrics_and_checkpoints_beside_each_other() {
    let dir = scratch("metrics");
    let flags = format!(
        "--steps 4 --seq 32 --held-out 0.1 --eval-interval 2 --save {} --save-interval 1 --keep-last 2",
        dir.display()
    );
    let losses = run(&flags).unwrap();
    let lines = burn_megatron::train::read_metrics(&dir.join("metrics.jsonl")).unwrap();
    let steps: Vec<f64> = lines
        .iter()
        .filter_map(|l| l.get("loss"))
        .map(|v| v.as_f64().unwrap())
        .collect();
    assert_eq!(steps, losses);
    let evals = lines.iter().filter(|l| l.contains_key("eval_loss")).count();
    assert_eq!(evals, 2, "steps 2 and 4");
    assert!(
        lines
            .iter()
            .all(|l| !l.contains_key("lr") || l["lr"].as_f64() == Some(3e-3))
    );
    let kept = std::fs::read_dir(&dir).unwrap().flatten();
    assert_eq!(
        kept.filter(|e| e.file_name().to_string_lossy().starts_with("step-"))
            .count(),
        2
    );
    run(&format!(
        "--steps 6 --seq 32 --held-out 0.1 --load {0} --save {0}",
        dir.display()
    ))
    .unwrap();
    let lines = burn_megatron::train::read_metrics(&dir.join("metrics.jsonl")).unwrap();
    assert_eq!(lines.iter().filter(|l| l.contains_key("loss")).count(), 6);
    let _ = std::fs::remove_dir_all(&dir);
}

/// An absurd learning rate overflows the weights: the next step's gradients are not finite, and
/// the run stops there naming the step and the parameter, the step updating nothing; under
/// `skip`, steps are skipped until more than `max_skips` in a row stop it; with the check off,
/// the loss that is not finite stops it. On every stage of a pipeline too.
#[test]
fn a_step_that_goes_bad_stops_training() {
    for layout in ["", "--pp 2 --layers 4"] {
        let bad = format!("--steps 8 --seq 32 --lr 1e30 --sample-every 0 {layout}");
        let error = run(&bad).unwrap_err();
        assert!(
            error.contains("step ") && error.contains("is not finite") && error.contains("the step updated nothing"),
            "{layout}: {error}"
        );
        let error = run(&format!("{bad} --guard.nonfinite skip --guard.max_skips 2")).unwrap_err();
        assert!(error.contains("3 steps in a row skipped"), "{layout}: {error}");
        let error = run(&format!("{bad} --guard.nonfinite off")).unwrap_err();
        assert!(
            error.contains("the loss is") && error.contains("training stops"),
            "{layout}: {error}"
        );
    }
}

/// A tokenized dataset of `docs` documents of random lengths and tokens below 256 at
/// `dir/name`, in Megatron's indexed format.
fn indexed_dataset(dir: &std::path::Path, name: &str, docs: usize) -> String {
    let prefix = dir.join(name);
    let mut writer = burn_megatron::data::IndexedWriter::create(&prefix, burn_megatron::data::TokenType::U16).unwrap();
    let mut h = 0x2545_F491_4F6C_DD1Du64;
    let mut next = |n: u64| {
        h ^= h << 13;
        h ^= h >> 7;
        h ^= h << 17;
        h % n
    };
    for _ in 0..docs {
        let len = 5 + next(60) as usize;
        let tokens: Vec<u32> = (0..len).map(|_| 1 + next(255) as u32).collect();
        writer.add_document(&tokens).unwrap();
    }
    writer.finish().unwrap();
    prefix.display().to_string()
}

/// Tokenized datasets blended 2:1, packed into sequences, trained at tp 2 × dp 2: the losses of
/// one rank on the same samples (each step's global batch is the same samples at any layout),
/// and a run stopped at step 3 and resumed prints the uninterrupted run's losses (it reads
/// the samples the uninterrupted run read). A token past the model's vocabulary is an error
/// naming the file and the byte; evaluation reads the held-out documents.
#[test]
fn tokenized_datasets_train_and_resume_at_the_same_samples() {
    let dir = scratch("indexed");
    std::fs::create_dir_all(&dir).unwrap();
    let (a, b) = (indexed_dataset(&dir, "a", 80), indexed_dataset(&dir, "b", 40));
    let data = format!(r#"--data.prefixes ["2","{a}","1","{b}"] --data.held_out 0.1"#);
    let common = format!("--steps 6 --seq 32 --batch 8 --sample-every 0 --eval.interval 3 --eval.batches 1 {data}");
    let reference = run(&common).unwrap();
    let parallel = run(&format!("{common} --tp 2 --sp --dp 2 --zero1")).unwrap();
    // f32 sums in another order over 6 AdamW steps, as the other layouts' tests: 1e-4.
    close(&parallel, &reference, 1e-4, "tp 2 x dp 2");
    let ckpt = dir.join("ckpt");
    let flags = format!("{common} --tp 2 --sp --dp 2 --zero1");
    run(&format!(
        "{} --save {}",
        flags.replace("--steps 6", "--steps 3"),
        ckpt.display()
    ))
    .unwrap();
    let resumed = run(&format!("{flags} --load {}", ckpt.display())).unwrap();
    close(&resumed, &parallel[3..], 1e-6, "resumed at step 3");
    let wide = dir.join("wide");
    let mut writer = burn_megatron::data::IndexedWriter::create(&wide, burn_megatron::data::TokenType::U16).unwrap();
    (0..40).for_each(|d| writer.add_document(&[1, 2, 3, 60_000 + d, 4, 5, 6, 7]).unwrap());
    writer.finish().unwrap();
    let past = run(&common.replace(
        &data,
        &format!(r#"--data.prefixes ["{}"] --data.held_out 0.1"#, wide.display()),
    ))
    .unwrap_err();
    assert!(past.contains("wide.bin, byte") && past.contains("vocabulary"), "{past}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `checkpoint.export` writes the trained model as a Hugging Face directory: trained 3 steps at
/// tp 2 with SP, it holds the weights of the checkpoint saved at the same step, bit for bit; a
/// pipeline's export is refused before training.
#[test]
fn a_run_ends_in_a_hugging_face_export() {
    use burn_megatron::models::llama::hf;
    use burn_megatron::params::param_values;
    let dir = scratch("export");
    let (ckpt, export) = (dir.join("ckpt"), dir.join("hf"));
    let flags = format!(
        "--steps 3 --seq 32 --batch 4 --sample-every 0 --tp 2 --sp --save {} --checkpoint.export {}",
        ckpt.display(),
        export.display()
    );
    run(&flags).unwrap();
    let one = job("--seq 32 --batch 4").unwrap();
    let groups = burn_megatron_dist::ProcessGroups::single();
    let init = || {
        one.model
            .init(&burn::tensor::Device::flex(), &groups, &one.init())
            .unwrap()
    };
    let exported = hf::load(&export, init(), &groups).unwrap();
    let (saved, step) = burn_megatron::checkpoint::load_model(&ckpt, init(), &groups).unwrap();
    assert_eq!(step, 3);
    for (a, b) in param_values(&exported).into_iter().zip(param_values(&saved)) {
        let (a, b) = (a.value.into_data(), b.value.into_data());
        assert!(a == b, "the export differs from the checkpoint");
    }
    let pipeline = run(&format!("--pp 2 --layers 4 --checkpoint.export {}", export.display())).unwrap_err();
    assert!(pipeline.contains("checkpoint.export"), "{pipeline}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A chat dataset (`data.sft`: conversations and their loss masks, as `prepare-data` writes them)
/// trains at tp 2 × dp 2 with one rank's losses, over the assistant's tokens only: a dataset whose
/// masks count nothing gives no loss to learn from (0), blended with the first it trains on the
/// first's tokens, and Burn's Learner prints the plain loop's losses. Packed several a sample,
/// the same at every layout.
#[test]
fn chat_datasets_train_on_the_assistant_tokens() {
    use burn_megatron::data::{IndexedWriter, TokenType, sft};
    let dir = scratch("sft");
    std::fs::create_dir_all(&dir).unwrap();
    let write = |name: &str, counted: bool| {
        let prefix = dir.join(name);
        let mut tokens = IndexedWriter::create(&prefix, TokenType::U16).unwrap();
        let mut masks = IndexedWriter::create(&sft::mask_prefix(&prefix), TokenType::U8).unwrap();
        for c in 0..60u32 {
            let len = 10 + (c * 7) % 30;
            let conversation: Vec<u32> = (0..len).map(|t| 1 + (c * 13 + t * 5) % 200).collect();
            // The second half is the assistant's.
            let mask: Vec<u32> = (0..len).map(|t| u32::from(counted && t >= len / 2)).collect();
            tokens.add_document(&conversation).unwrap();
            masks.add_document(&mask).unwrap();
        }
        masks.finish().unwrap();
        tokens.finish().unwrap();
        prefix.display().to_string()
    };
    let (chats, silent) = (write("chats", true), write("silent", false));
    let common = |prefix: &str| {
        format!(r#"--steps 4 --seq 32 --batch 8 --sample-every 0 --data.sft true --data.prefixes ["{prefix}"]"#)
    };
    let reference = run(&common(&chats)).unwrap();
    let parallel = run(&format!("{} --tp 2 --sp --dp 2", common(&chats))).unwrap();
    // f32 sums in another order over 4 AdamW steps: 1e-4, as the other layouts' tests.
    close(&parallel, &reference, 1e-4, "sft tp 2 x dp 2");
    assert!(reference.iter().all(|l| l.is_finite() && *l > 0.0), "{reference:?}");
    assert_eq!(
        run(&common(&silent)).unwrap(),
        vec![0.0; 4],
        "nothing counted, nothing learned"
    );
    // Blended with the silent one, a step counts the chats' assistant tokens alone.
    let blended = common(&chats).replace(
        &format!(r#"["{chats}"]"#),
        &format!(r#"["1","{chats}","1","{silent}"]"#),
    );
    let losses = run(&blended).unwrap();
    assert!(losses.iter().all(|l| *l > 0.0) && losses != reference, "{losses:?}");
    // Burn's Learner reads the same targets: the plain loop's losses, equal.
    #[cfg(feature = "learner")]
    assert_eq!(run(&format!("{} --learner", common(&chats))).unwrap(), reference);
    // Packed, several conversations a sample (attended each inside itself): tp 2 × dp 2 as one
    // rank, other losses than a conversation a sample, and the Learner's the same.
    let packed = format!("{} --data.pack_conversations true", common(&chats));
    let one = run(&packed).unwrap();
    close(
        &run(&format!("{packed} --tp 2 --sp --dp 2")).unwrap(),
        &one,
        1e-4,
        "packed sft tp 2 x dp 2",
    );
    assert!(
        one.iter().all(|l| l.is_finite() && *l > 0.0) && one != reference,
        "{one:?}"
    );
    #[cfg(feature = "learner")]
    assert_eq!(run(&format!("{packed} --learner")).unwrap(), one);
    // Split over cp (all-to-all: the whole sequence on each rank to attend over) and over pp
    // (each stage its blocks, every microbatch its documents): one rank's losses, with the same
    // microbatches (each microbatch's mean weighs alike, as in Megatron).
    let accumulated = run(&format!("{packed} --micro-batch 2")).unwrap();
    for (layout, alone) in [
        ("--cp 2 --context all-to-all", &one),
        ("--pp 2 --micro-batch 2", &accumulated),
    ] {
        close(&run(&format!("{packed} {layout}")).unwrap(), alone, 1e-4, layout);
    }
    let refused = run(&format!("{packed} --cp 2 --context ring")).unwrap_err();
    assert!(refused.contains("data.pack_conversations"), "{refused}");
    let _ = std::fs::remove_dir_all(&dir);
}
