//! What CubeCL reports only to a logger. A launch CubeCL could not run (a buffer it could not
//! allocate, or one that failed before) is skipped and logged at `warn`
//! (`cubecl-server`'s `stream/failures.rs`); a read fails only where the failure reached the
//! buffer read, and past the device's memory a llama step's loss came back 0 with no error
//! (`docs/perf/recompute.md`). The bench installs this logger and stops at the first step
//! after which CubeCL has logged a failure.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use log::{Level, Log, Metadata, Record};

/// The failures logged, and the first one's text.
static COUNT: AtomicUsize = AtomicUsize::new(0);
static FIRST: Mutex<Option<String>> = Mutex::new(None);

/// Lines of CubeCL's printed at most: a failure skips every launch after it that reads its
/// outputs, each logged.
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
        // An allocation that fails once is retried after a cleanup; only a launch that could
        // not run (logged by the stream's failures) or an error counts.
        let failure = record.level() == Level::Error || record.target().ends_with("stream::failures");
        let seen = match failure {
            true => COUNT.fetch_add(1, Ordering::Relaxed),
            false => 0,
        };
        if failure && seen == 0 {
            *FIRST.lock().expect("not poisoned") = Some(text.clone());
        }
        if seen < PRINTED {
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
