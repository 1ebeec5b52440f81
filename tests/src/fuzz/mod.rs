//! Fuzzing the loaders of files a user points at, on stable Rust: each [`Target`] feeds bytes
//! to one loader (written where the loader reads them), which must answer with a value or a
//! typed error, never a panic; the test binary's allocator refuses any one allocation past
//! [`ALLOCATION_CAP`], so an allocation sized by an unchecked field aborts the run. [`fuzz`]
//! runs a target's corpus (`tests/fuzz/<target>/`: the seeds [`seeds`] wrote, and every crash
//! found, kept as a regression), then mutates corpus entries for a time budget
//! (`FUZZ_SECONDS`, default [`CI_SECONDS`]), saving any input that panics into the corpus.
//! `cargo fuzz` needs a nightly toolchain and libFuzzer, which this project's machines cannot
//! fetch; the mutations here are libFuzzer's classic ones (bits, bytes, interesting integers,
//! cuts, copies, splices), plus numbers swapped in text formats.

pub mod seeds;
pub mod targets;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub use targets::{TARGETS, Target};

/// The largest single allocation a loader may make on fuzzed input: far above what any seed's
/// loading needs, far below what a length read from a corrupt header asks for.
pub const ALLOCATION_CAP: usize = 1 << 30;

/// Seconds of mutation a target gets in CI, after its corpus.
pub const CI_SECONDS: u64 = 3;

/// The corpus directory of `target`.
pub fn corpus(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz").join(target)
}

/// What a run of [`fuzz`] did.
#[derive(Debug)]
pub struct Report {
    pub corpus: usize,
    pub runs: u64,
    /// Runs the loader accepted (the rest were typed errors).
    pub accepted: u64,
}

/// Runs `target`'s corpus, then mutations of it for `budget`; panics naming the saved input if
/// any input made the loader panic. `scratch` is the target's own directory.
pub fn fuzz(target: &Target, budget: Duration, scratch: &Path) -> Report {
    std::fs::create_dir_all(scratch).unwrap();
    let dir = corpus(target.name);
    let mut entries: Vec<(PathBuf, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_file())
        .map(|p| {
            let bytes = std::fs::read(&p).unwrap();
            (p, bytes)
        })
        .collect();
    entries.sort();
    assert!(!entries.is_empty(), "{}: no seeds", dir.display());
    let mut report = Report {
        corpus: entries.len(),
        runs: 0,
        accepted: 0,
    };
    // Where the input under test sits, for a run that aborts (an allocation past the cap).
    let current = scratch.join("current-input");
    let run = |input: &[u8], report: &mut Report| -> Result<(), String> {
        std::fs::write(&current, input).unwrap();
        report.runs += 1;
        match catch_unwind(AssertUnwindSafe(|| (target.run)(input, scratch))) {
            Ok(accepted) => {
                report.accepted += accepted as u64;
                Ok(())
            }
            Err(panic) => Err(panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default()),
        }
    };
    for (path, bytes) in &entries {
        if let Err(message) = run(bytes, &mut report) {
            panic!("{}: the corpus entry {} panics: {message}", target.name, path.display());
        }
    }
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ target.name.len() as u64);
    let began = Instant::now();
    while began.elapsed() < budget {
        let base = &entries[rng.below(entries.len())].1;
        let other = &entries[rng.below(entries.len())].1;
        let mut input = base.clone();
        for _ in 0..1 + rng.below(4) {
            mutate(&mut input, other, target.text, &mut rng);
        }
        if let Err(message) = run(&input, &mut report) {
            let name = format!("crash-{:016x}", fnv(&input));
            let saved = dir.join(&name);
            std::fs::write(&saved, &input).unwrap();
            panic!(
                "{}: an input panics the loader ({message}); kept as {}",
                target.name,
                saved.display()
            );
        }
    }
    let _ = std::fs::remove_file(&current);
    report
}

/// The seconds a target mutates: `FUZZ_SECONDS`, else [`CI_SECONDS`].
pub fn budget() -> Duration {
    let seconds = std::env::var("FUZZ_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(CI_SECONDS);
    Duration::from_secs(seconds)
}

/// xorshift64*: the mutations' choices, the same every run of a target.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Integers that break parsers: zero, one, the signed and unsigned edges.
const INTERESTING: [u64; 12] = [
    0,
    1,
    2,
    0x7f,
    0x80,
    0xff,
    0x7fff,
    0xffff,
    0x7fff_ffff,
    0xffff_ffff,
    0x7fff_ffff_ffff_ffff,
    u64::MAX,
];

/// Numbers a text format's field may be set to.
const NUMBERS: [&str; 10] = [
    "0",
    "-1",
    "1",
    "4294967296",
    "18446744073709551615",
    "1e308",
    "-1e308",
    "0.5",
    "NaN",
    "99999999999999999999999",
];

/// One mutation of `input`; `other` is another corpus entry, to splice from.
fn mutate(input: &mut Vec<u8>, other: &[u8], text: bool, rng: &mut Rng) {
    let n = input.len();
    let choices = if text { 9 } else { 8 };
    match rng.below(choices) {
        0 if n > 0 => {
            let at = rng.below(n);
            input[at] ^= 1 << rng.below(8);
        }
        1 if n > 0 => {
            let at = rng.below(n);
            input[at] = rng.next() as u8;
        }
        2 if n >= 8 => {
            // An interesting integer, 1, 2, 4 or 8 bytes little-endian.
            let width = 1 << rng.below(4);
            let at = rng.below(n - width + 1);
            let value = INTERESTING[rng.below(INTERESTING.len())].to_le_bytes();
            input[at..at + width].copy_from_slice(&value[..width]);
        }
        3 if n > 0 => input.truncate(rng.below(n)),
        4 if n > 1 => {
            let start = rng.below(n);
            let end = (start + 1 + rng.below(64)).min(n);
            input.drain(start..end);
        }
        5 if n > 1 => {
            let start = rng.below(n);
            let end = (start + 1 + rng.below(64)).min(n);
            let copy = input[start..end].to_vec();
            let at = rng.below(n);
            input.splice(at..at, copy);
        }
        6 => {
            let at = rng.below(n + 1);
            let bytes: Vec<u8> = (0..1 + rng.below(16)).map(|_| rng.next() as u8).collect();
            input.splice(at..at, bytes);
        }
        7 if !other.is_empty() => {
            let cut = rng.below(n + 1);
            let from = rng.below(other.len());
            input.truncate(cut);
            input.extend_from_slice(&other[from..]);
        }
        8 => replace_number(input, rng),
        _ => {}
    }
}

/// Replaces one run of digits in a text input with a number from [`NUMBERS`].
fn replace_number(input: &mut Vec<u8>, rng: &mut Rng) {
    let runs: Vec<(usize, usize)> = {
        let mut runs = Vec::new();
        let mut i = 0;
        while i < input.len() {
            if input[i].is_ascii_digit() {
                let start = i;
                while i < input.len() && (input[i].is_ascii_digit() || input[i] == b'.' || input[i] == b'e') {
                    i += 1;
                }
                runs.push((start, i));
            } else {
                i += 1;
            }
        }
        runs
    };
    if runs.is_empty() {
        return;
    }
    let (start, end) = runs[rng.below(runs.len())];
    let number = NUMBERS[rng.below(NUMBERS.len())].as_bytes().to_vec();
    input.splice(start..end, number);
}

/// FNV-1a: a crash's name.
fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}
