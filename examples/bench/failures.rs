//! What CubeCL reports only to a logger. A launch CubeCL could not run (a buffer it could not
//! allocate, or one that failed before) is skipped and logged at `warn`
//! (`cubecl-server`'s `stream/failures.rs`); a read fails only where the failure reached the
//! buffer read, and past the device's memory a llama step's loss came back 0 with no error
//! (`docs/perf/recompute.md`). The bench installs this logger and stops after the first step
//! by which CubeCL has logged a failure.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use log::{Level, Log, Metadata, Record};

/// The failures logged, and the first one's text; the lines printed.
static COUNT: AtomicUsize = AtomicUsize::new(0);
static LINES: AtomicUsize = AtomicUsize::new(0);
static FIRST: Mutex<Option<String>> = Mutex::new(None);

/// Lines of CubeCL's printed at most: an allocation retried is logged each time.
const PRINTED: usize = 8;

struct Failures;

impl Log for Failures {
    fn enabled(&self, metadata: &Metadata) -> bool {
        metadata.level() <= Level::Warn && metadata.target().starts_with("cubecl")
    }

    fn log(&self, record: &Record) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let text = format!("{}: {}", record.target(), record.args());
        // An allocation that fails once is retried after a cleanup, and says so: not a failure
        // yet. Everything else CubeCL warns of is (a launch that could not run: "An IO error
        // happened … Memory location was never initialized"; the bench's steps log nothing
        // else, logs/s35).
        let failure = !text.contains("reclaiming and retrying");
        if failure && COUNT.fetch_add(1, Ordering::Relaxed) == 0 {
            *FIRST.lock().expect("not poisoned") = Some(text.clone());
        }
        if LINES.fetch_add(1, Ordering::Relaxed) < PRINTED {
            eprintln!("cubecl {}: {text}", record.level());
        }
    }

    fn flush(&self) {}
}

/// Installs the logger; another one installed first keeps its place.
pub fn install() {
    if log::set_logger(&Failures).is_ok() {
        log::set_max_level(log::LevelFilter::Warn);
    }
}

/// Panics, naming `when`, if CubeCL has logged a failure.
pub fn check(when: &str) {
    let count = COUNT.load(Ordering::Relaxed);
    if count > 0 {
        let first = FIRST.lock().expect("not poisoned").clone().unwrap_or_default();
        panic!("CubeCL logged {count} failed launches by {when}, the first: {first}");
    }
}
