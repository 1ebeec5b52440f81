//! What CubeCL reports only to a logger, as a typed error.
//!
//! A launch CubeCL 0.11 could not run (a buffer it could not allocate, or one a failure reached
//! before) is skipped and logged at `warn` (`cubecl-server`'s `stream/failures.rs`). A read is
//! meant to fail wherever such a failure reached the buffer read, but past the device's memory a
//! llama step's loss read back 0 with no error, and a `sync` reports device faults only.
//! The log line is the one sign: [`watch`] installs a logger that
//! counts CubeCL's warnings and errors, and [`check`] turns them into a [`DeviceFailure`], for a
//! training loop to call after each step's loss is read.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use log::{Level, Log, Metadata, Record};

/// CubeCL logged a launch it could not run (or an error) since [`watch`] began.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("CubeCL logged {count} failures (past the device's memory?), the first: {first}")]
pub struct DeviceFailure {
    pub count: usize,
    pub first: String,
}

/// [`watch`] found another logger installed, which CubeCL's lines reach instead.
#[derive(Clone, Copy, Debug, PartialEq, thiserror::Error)]
#[error("another logger is installed: CubeCL's failures reach it, not burn-megatron's watch")]
pub struct AnotherLogger;

/// The failures logged, and the first one's text; the lines printed. Process state because the
/// `log` facade is: it holds one logger a process, and CubeCL reports a launch it could not run
/// through that logger alone, from whichever thread ran it.
static COUNT: AtomicUsize = AtomicUsize::new(0);
static FIRST: Mutex<Option<String>> = Mutex::new(None);
static LINES: AtomicUsize = AtomicUsize::new(0);

/// CubeCL's lines printed to stderr at most: an allocation retried is logged each time.
const PRINTED: usize = 8;

struct Watch;

impl Log for Watch {
    fn enabled(&self, metadata: &Metadata) -> bool {
        metadata.level() <= Level::Warn && metadata.target().starts_with("cubecl")
    }

    fn log(&self, record: &Record) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let text = format!("{}: {}", record.target(), record.args());
        // An allocation that fails once is retried after a cleanup, and says so: not a failure
        // yet. Anything else CubeCL warns of is (the launch that could not run past the device's
        // memory: "An IO error happened … Memory location was never initialized"; a llama
        // step logs nothing else).
        if !text.contains("reclaiming and retrying") && COUNT.fetch_add(1, Ordering::Relaxed) == 0 {
            *FIRST.lock().expect("not poisoned") = Some(text.clone());
        }
        if LINES.fetch_add(1, Ordering::Relaxed) < PRINTED {
            eprintln!("cubecl {}: {text}", record.level());
        }
    }

    fn flush(&self) {}
}

/// Installs the logger that counts CubeCL's failures (and prints its first lines to stderr).
///
/// # Errors
/// [`AnotherLogger`] where the process has a logger already (Burn's `Learner` installs one that
/// writes CubeCL's lines to its application log).
pub fn watch() -> Result<(), AnotherLogger> {
    log::set_logger(&Watch).map_err(|_| AnotherLogger)?;
    log::set_max_level(log::LevelFilter::Warn);
    Ok(())
}

/// Whether CubeCL has logged a failure since [`watch`]. CubeCL logs a launch as its stream
/// takes it, so call this after a read (a step's loss) that waited for the launches to check.
///
/// # Errors
/// [`DeviceFailure`] with their count and the first one's line.
pub fn check() -> Result<(), DeviceFailure> {
    match COUNT.load(Ordering::Relaxed) {
        0 => Ok(()),
        count => Err(DeviceFailure {
            count,
            first: FIRST.lock().expect("not poisoned").clone().unwrap_or_default(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The one test of the process-wide logger: a retried allocation is no failure, a launch
    /// CubeCL could not run is, another crate's warning is not counted, and a second watch is
    /// refused.
    #[test]
    fn counts_what_cubecl_logs_as_failed() {
        watch().expect("the first logger");
        assert_eq!(watch(), Err(AnotherLogger));
        let retry = "device allocation of 469762048 B failed (out of device memory); reclaiming and retrying";
        log::warn!(target: "cubecl_server::command::base", "{retry}");
        log::warn!(target: "burn_train", "not CubeCL's");
        assert_eq!(check(), Ok(()));
        log::warn!(target: "cubecl_runtime::logging::server", "An IO error happened");
        log::warn!(target: "cubecl_runtime::logging::server", "a second");
        let failure = check().expect_err("a failed launch");
        assert_eq!(failure.count, 2);
        assert_eq!(failure.first, "cubecl_runtime::logging::server: An IO error happened");
    }
}
