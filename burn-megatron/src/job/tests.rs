use std::path::{Path, PathBuf};

use super::*;
use crate::train::LrSchedule;

fn scratch(name: &str, text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("burn-megatron-job-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("job.toml");
    std::fs::write(&path, text).unwrap();
    path
}

fn parse(file: Option<&Path>, overrides: &[(&str, &str)]) -> Result<JobConfig, JobError> {
    let overrides: Vec<Override> = overrides.iter().map(|(k, v)| Override::parse(k, v)).collect();
    JobConfig::parse(file, &overrides)
}

const FILE: &str = r#"
steps = 12
[model]
preset = "tiny-moe"
recompute = "full:1"
[parallel]
tp = 2
sp = true
dispatcher = "all-gather"
[precision]
dtype = "bf16"
recipe = "fp8-delayed:4:most-recent"
[optimizer]
lr = 1e-3
clip_grad = 1.0
[schedule]
kind = "warmup-cosine"
warmup = 3
min_lr = 1e-4
[batch]
global = 8
micro = 2
"#;

/// A job file parses, resolves (every default filled in), writes and parses back to the same
/// job, which resolves to the same model and batch split.
#[test]
fn a_job_round_trips() {
    let path = scratch("round-trip", FILE);
    let job = parse(Some(&path), &[]).unwrap();
    assert_eq!(job.parallel.dispatcher, crate::layers::moe::ExpertParallel::AllGather);
    assert_eq!(
        job.schedule,
        LrSchedule::WarmupCosine {
            warmup: 3,
            min_lr: 1e-4
        }
    );
    let resolved = job.resolve().unwrap();
    assert_eq!((resolved.seq, resolved.per_rank, resolved.microbatches), (256, 8, 4));
    assert_eq!(resolved.config.model.preset.as_deref(), Some("tiny-moe"));
    let written = resolved.config.to_toml();
    let again = scratch("round-trip-again", &written);
    let reread = parse(Some(&again), &[]).unwrap();
    assert_eq!(reread, resolved.config, "{written}");
    let twice = reread.resolve().unwrap();
    assert_eq!(twice.config, resolved.config);
    assert_eq!(format!("{:?}", twice.model), format!("{:?}", resolved.model));
}

/// The command line wins over the file, field by field, in order; a value reads as TOML
/// (numbers, booleans) or as the text itself (a recipe's name).
#[test]
fn overrides_win_over_the_file() {
    let path = scratch("overrides", FILE);
    let job = parse(
        Some(&path),
        &[
            ("optimizer.lr", "3e-4"),
            ("parallel.tp", "1"),
            ("parallel.sp", "false"),
            ("precision.recipe", "fp8-tensorwise"),
            ("schedule.warmup", "5"),
            ("parallel.tp", "4"),
        ],
    )
    .unwrap();
    assert_eq!(job.optimizer.lr, 3e-4);
    assert_eq!(job.parallel.tp, 4, "the last override of a field wins");
    assert!(!job.parallel.sp);
    assert_eq!(job.precision.recipe.map(|r| r.spec()), Some("fp8-tensorwise".into()));
    assert_eq!(
        job.optimizer.clip_grad,
        Some(1.0),
        "untouched fields keep the file's value"
    );
    assert!(matches!(job.schedule, LrSchedule::WarmupCosine { warmup: 5, .. }));
    let cleared = parse(Some(&path), &[("precision.recipe", "default")]).unwrap();
    assert_eq!(cleared.precision.recipe, None);
    // No file: the defaults (the tiny model), then the overrides.
    let tiny = parse(None, &[("steps", "3")]).unwrap().resolve().unwrap();
    assert_eq!((tiny.config.steps, tiny.seq), (3, 256));
    assert_eq!(tiny.config.model.preset.as_deref(), Some("tiny"));
}

/// Every bad file, field or override is an error that names it, before any tensor.
#[test]
fn bad_jobs_name_what_is_wrong() {
    let error = |file: Option<&str>, overrides: &[(&str, &str)]| -> String {
        let path = file.map(|text| scratch("bad", text));
        parse(path.as_deref(), overrides)
            .and_then(|job| job.resolve().map(|_| ()))
            .unwrap_err()
            .to_string()
    };
    // A file's text (if any), the overrides, what the error says.
    type Case<'a> = (Option<&'a str>, &'a [(&'a str, &'a str)], &'a str);
    let cases: &[Case] = &[
        (Some("[parallel]\ntpp = 2\n"), &[], "unknown field `tpp`"),
        (Some("steps = \"many\"\n"), &[], "invalid type"),
        (
            Some("[model]\nrecompute = \"twice\"\n"),
            &[],
            "expected none, selective",
        ),
        (None, &[("parallel.tpp", "2")], "--parallel.tpp: unknown field `tpp`"),
        (None, &[("optimizer.lr", "fast")], "--optimizer.lr: invalid type"),
        (None, &[("steps.count", "2")], "--steps.count: invalid type: map"),
        (
            None,
            &[("steps", "4"), ("steps.count", "2")],
            "steps is a field, not a section",
        ),
        (None, &[("optimizer..lr", "2")], "expected SECTION.FIELD"),
        (None, &[("precision.recipe", "fp4")], "unknown recipe \"fp4\""),
        (None, &[("steps", "0")], "steps: must be at least 1"),
        (
            None,
            &[("model.mtp_depth", "1"), ("model.mtp_loss_weight", "-1")],
            "model.mtp_loss_weight: -1 is no loss weight",
        ),
        (None, &[("model.preset", "llama-70b")], "unknown preset"),
        (
            None,
            &[("model.preset", "tiny"), ("model.hf", "/x")],
            "name one of preset, hf and gguf",
        ),
        (None, &[("model.hf", "/x")], "model: /x/config.json"),
        (None, &[("model.gguf", "/x.gguf")], "model: "),
        (None, &[("parallel.tp", "0")], "parallel.tp: must be at least 1"),
        (
            None,
            &[("batch.global", "3"), ("parallel.dp", "2")],
            "does not split evenly over dp = 2",
        ),
        (
            None,
            &[("batch.micro", "3")],
            "batch.micro: 3 sequences a microbatch do not split",
        ),
        (None, &[("optimizer.lr", "-1")], "learning rate -1 must be"),
        (
            None,
            &[("optimizer.clip_grad", "0.0")],
            "optimizer.clip_grad: 0 must be",
        ),
        (
            None,
            &[("schedule.kind", "warmup-cosine"), ("schedule.warmup", "500")],
            "do not fit a run of 200",
        ),
        (None, &[("schedule.kind", "linear")], "unknown variant `linear`"),
        (
            None,
            &[("precision.bf16_blocks", "[1, 1]")],
            "it needs precision.recipe",
        ),
        (None, &[("checkpoint.interval", "5")], "need checkpoint.dir"),
        (
            None,
            &[("checkpoint.dir", "/tmp/x"), ("checkpoint.keep_last", "0")],
            "keep_last: must be at least 1",
        ),
        (None, &[("eval.interval", "10")], "set data.held_out above 0"),
        (None, &[("data.held_out", "0.7")], "data.held_out: must be a share"),
        (
            None,
            &[("parallel.cp", "2"), ("logging.sample_every", "5")],
            "sample_every = 0",
        ),
        (None, &[("parallel.tp", "3")], "n_heads = 4 is not divisible by tp = 3"),
        (
            None,
            &[
                ("parallel.pp", "2"),
                ("parallel.vpp", "2"),
                ("model.layers", "4"),
                ("batch.global", "6"),
                ("batch.micro", "2"),
            ],
            "3 microbatches do not form whole rounds",
        ),
    ];
    for (file, overrides, expected) in cases {
        let outcome = std::panic::catch_unwind(|| error(*file, overrides));
        let message = outcome.unwrap_or_else(|_| panic!("{file:?} {overrides:?}: panicked instead of an error"));
        assert!(
            message.contains(expected),
            "{file:?} {overrides:?}: {message:?} does not say {expected:?}"
        );
    }
    let missing = parse(Some(Path::new("/nonexistent/job.toml")), &[])
        .unwrap_err()
        .to_string();
    assert!(missing.starts_with("/nonexistent/job.toml: "), "{missing}");
}

/// A resumed job keeps what its checkpoint fixed (the error names the first field that moved)
/// and may change the rest.
#[test]
fn a_resume_keeps_what_the_checkpoint_fixed() {
    let saved = parse(None, &[("model.layers", "4")]).unwrap().resolve().unwrap().config;
    let resumed = |overrides: &[(&str, &str)]| {
        let mut all = vec![("model.layers", "4")];
        all.extend_from_slice(overrides);
        parse(None, &all)
            .unwrap()
            .resolve()
            .unwrap()
            .config
            .check_resume(&saved)
    };
    for (changed, field) in [
        (("model.layers", "2"), "model.layers"),
        (("precision.dtype", "bf16"), "precision.dtype"),
        (("batch.global", "4"), "batch.global"),
        (("data.seq", "128"), "data.seq"),
        (("seed", "8"), "seed"),
    ] {
        let message = resumed(&[changed]).unwrap_err().to_string();
        assert!(message.contains(&format!("with {field} = ")), "{changed:?}: {message}");
    }
    for fine in [
        ("optimizer.lr", "1e-3"),
        ("steps", "400"),
        ("parallel.tp", "2"),
        ("schedule.kind", "warmup-cosine"),
        ("batch.micro", "1"),
    ] {
        resumed(&[fine]).unwrap_or_else(|e| panic!("{fine:?}: {e}"));
    }
}

/// llama-1b in bf16 at a microbatch of 48 does not fit 80 GiB: refused naming the largest
/// microbatch that does, which then passes; the `[guard]` section's bad values are refused.
#[test]
fn a_job_past_the_device_is_refused() {
    let capacity = 80 * (1u64 << 30);
    let job = |batch: &str| {
        let overrides = [
            ("model.preset", "llama-1b"),
            ("precision.dtype", "bf16"),
            ("batch.global", batch),
        ];
        parse(None, &overrides).unwrap().resolve().unwrap()
    };
    let error = job("48").check_memory(capacity).unwrap_err();
    let JobError::Memory { largest, micro, .. } = error else {
        panic!("{error}");
    };
    assert_eq!(micro, 48);
    assert!((5..48).contains(&largest), "{largest}");
    let peak = job(&largest.to_string())
        .check_memory(capacity)
        .expect("the largest fits");
    assert!(peak <= capacity);
    job(&(largest + 1).to_string()).check_memory(capacity).unwrap_err();
    for (key, value) in [("guard.window", "0"), ("guard.spike_factor", "0.5")] {
        let message = parse(None, &[(key, value)]).unwrap().resolve().unwrap_err().to_string();
        assert!(message.starts_with("guard: "), "{key}: {message}");
    }
}

/// `model.mtp_depth` adds multi-token prediction's modules to any model, with its weight.
#[test]
fn multi_token_prediction_is_a_model_option() {
    let job = parse(None, &[("model.mtp_depth", "2"), ("model.mtp_loss_weight", "0.3")]).unwrap();
    let mtp = job.resolve().unwrap().model.mtp.unwrap();
    assert_eq!((mtp.depth, mtp.loss_weight), (2, 0.3));
    let plain = parse(None, &[]).unwrap().resolve().unwrap();
    assert!(plain.model.mtp.is_none());
}

/// A preset takes the tokenizer's vocabulary (or `model.vocab`): embedding, output layer and
/// loss; a Hugging Face or GGUF model keeps its own, and a vocabulary of 0 is refused.
#[test]
fn a_preset_takes_the_tokenizers_vocabulary() {
    let dir = scratch("vocab", "");
    let tokenizer = dir.parent().unwrap().join("tokenizer.json");
    std::fs::write(
        &tokenizer,
        r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"normalizer":null,
           "pre_tokenizer":{"type":"Whitespace"},"post_processor":null,"decoder":null,
           "model":{"type":"WordLevel","vocab":{"[UNK]":0,"a":1,"b":2,"c":3,"d":4},"unk_token":"[UNK]"}}"#,
    )
    .unwrap();
    let vocab = |overrides: &[(&str, &str)]| {
        let model = parse(None, overrides).unwrap().resolve().unwrap().model;
        (model.embedding.vocab_size, model.output.d_output, model.loss.vocab_size)
    };
    let path = tokenizer.display().to_string();
    assert_eq!(vocab(&[("data.tokenizer", &format!("{path:?}"))]), (5, 5, 5));
    assert_eq!(vocab(&[("model.vocab", "1000")]), (1000, 1000, 1000));
    assert_eq!(vocab(&[]).0, 1024, "the tiny preset's own");
    let refused = |overrides: &[(&str, &str)]| parse(None, overrides).unwrap().resolve().unwrap_err().to_string();
    assert!(refused(&[("model.vocab", "0")]).contains("model.vocab"));
    let hf = refused(&[("model.vocab", "10"), ("model.hf", "\"somewhere\"")]);
    assert!(hf.contains("its own"), "{hf}");
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
}

/// Tokenized datasets are named in Megatron's `--data-path` form: prefixes alone or weight and
/// prefix pairs; text and datasets together, unpaired or negative weights, and chat SFT without
/// a dataset are refused by field.
#[test]
fn data_prefixes_take_megatrons_form() {
    let resolve = |overrides: &[(&str, &str)]| parse(None, overrides).unwrap().resolve().map(|_| ());
    assert!(resolve(&[("data.prefixes", r#"["a", "b"]"#)]).is_ok());
    assert!(resolve(&[("data.prefixes", r#"["0.7", "a", "0.3", "b"]"#)]).is_ok());
    for (overrides, field) in [
        (&[("data.prefixes", r#"["0.7", "a", "0.3"]"#)][..], "data.prefixes"),
        (&[("data.prefixes", r#"["0.7", "a", "-1", "b"]"#)][..], "data.prefixes"),
        (
            &[("data.prefixes", r#"["a"]"#), ("data.path", r#""text.txt""#)][..],
            "data.prefixes",
        ),
        (&[("data.sft", "true")][..], "data.sft"),
        (&[("data.pack_conversations", "true")][..], "data.pack_conversations"),
    ] {
        let error = resolve(overrides).unwrap_err().to_string();
        assert!(error.contains(field), "{overrides:?}: {error}");
    }
}

/// Every job file in `examples/jobs` parses and writes back to the same job (the fields they
/// name exist; a preset's resolves too, a model file's needs its file).
#[test]
fn the_example_jobs_parse() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/jobs");
    let mut read = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let job = parse(Some(&path), &[]).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert_eq!(JobConfig::from_toml(&job.to_toml()).unwrap(), job, "{}", path.display());
        if job.model.gguf.is_none() && job.model.hf.is_none() {
            job.resolve().unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        }
        read += 1;
    }
    assert!(read >= 9, "{read} job files");
}
