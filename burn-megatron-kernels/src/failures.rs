//! What CubeCL reports only to a logger, as a typed error.
//!
//! A launch CubeCL 0.11 could not run (a buffer it could not allocate, or one a failure reached
//! before) is skipped and logged at `warn` (`cubecl-server`'s `stream/failures.rs`). A read is
//! meant to fail wherever such a failure reached the buffer read, but past the device's memory a
//! llama step's loss read back 0 with no error, and a `sync` reports device faults only. An
//! allocation that fails is retried once after a cleanup, which CubeCL logs
//! (`command/base.rs`'s `reserve`), and a retry that fails again is not logged at all: on an
//! H200, llama-1b at batch 128 logged 473 retries and nothing else in its first step, and read
//! back loss 0. So a failure is a line CubeCL logs of a launch it could not run, or more than
//! one retried allocation between two checks (one retry a step may be a cleanup that made
//! room). The log lines are the one sign, so the watcher sits where CubeCL's lines pass, beside
//! whatever the program does with them: [`FailureLayer`] in a `tracing` subscriber (whose `log` bridge
//! carries CubeCL's lines), [`Watched`] around a `log` logger of the program's, or [`watch`]
//! alone in a program without one. [`check`] turns what they saw into a [`DeviceFailure`], for
//! a training loop to call after each step's loss is read: with the allocation that failed (an
//! allocation CubeCL retries logs its size first) and the device's memory then.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use burn::tensor::Device;
use log::{Level, Log, Metadata, Record};

use crate::memory::{DeviceMemory, device_memory};

/// CubeCL logged a launch it could not run (or an error) since [`watch`] began.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{}", self.describe())]
pub struct DeviceFailure {
    pub count: usize,
    pub first: String,
    /// The bytes of the last allocation CubeCL retried before the failure: the one that failed.
    pub asked: Option<u64>,
    /// The device's memory when the failure was read, where the device keeps pools.
    pub memory: Option<DeviceMemory>,
}

impl DeviceFailure {
    /// Whether the device ran out of memory: an allocation failed before the launch did.
    pub fn out_of_memory(&self) -> bool {
        self.asked.is_some()
    }

    fn describe(&self) -> String {
        let gib = |bytes: u64| format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64);
        let mut text = match self.asked {
            Some(asked) => format!("out of device memory: an allocation of {} failed", gib(asked)),
            None => "the device could not run a launch".to_string(),
        };
        if let Some(memory) = &self.memory {
            text += &match (memory.total, memory.free()) {
                (Some(total), Some(free)) => format!(
                    " with {} free of the device's {} (CubeCL's pools hold {}, {} of it in tensors)",
                    gib(free),
                    gib(total),
                    gib(memory.reserved),
                    gib(memory.in_use)
                ),
                _ => format!(" (CubeCL's pools hold {})", gib(memory.reserved)),
            };
        }
        format!(
            "{text}; CubeCL logged {} failures, the first: {}",
            self.count, self.first
        )
    }
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
/// The bytes of the last allocation CubeCL retried (0: none yet).
static ASKED: AtomicU64 = AtomicU64::new(0);
/// Allocations CubeCL retried since the last [`check`], and the last one's line.
static RETRIES: AtomicUsize = AtomicUsize::new(0);
static RETRIED: Mutex<Option<String>> = Mutex::new(None);

/// Retried allocations between two checks that make a failure: one may be a cleanup that made
/// room; a retry that failed again is not logged, and the allocations after it retry too.
pub const RETRIES_FAILING: usize = 2;

/// CubeCL's lines [`watch`] prints to stderr at most: an allocation retried is logged each time.
const PRINTED: usize = 8;

/// Whether a line of `level` from `target` is CubeCL's warning or error.
fn cubecl(level: Level, target: &str) -> bool {
    level <= Level::Warn && target.starts_with("cubecl")
}

/// Counts `message`, a line CubeCL logged at `level` from `target`, if it tells of a failure.
/// An allocation that fails once is retried after a cleanup, and says so: not a failure yet.
/// Anything else CubeCL warns of is (the launch that could not run past the device's memory:
/// "An IO error happened … Memory location was never initialized"; a llama step logs nothing
/// else).
pub fn record(level: Level, target: &str, message: &str) {
    if !cubecl(level, target) {
        return;
    }
    if message.contains("reclaiming and retrying") {
        // "device allocation of {page} B failed (out of device memory allocating {size} bytes
        // …); reclaiming and retrying": the tensor's size where the error names it, else the
        // page's.
        let number = |after: &str| {
            message
                .split(after)
                .nth(1)
                .and_then(|rest| rest.split(' ').next())
                .and_then(|n| n.parse().ok())
        };
        if let Some(size) = number("allocating ").or_else(|| number("allocation of ")) {
            ASKED.store(size, Ordering::Relaxed);
        }
        RETRIES.fetch_add(1, Ordering::Relaxed);
        *RETRIED.lock().expect("not poisoned") = Some(format!("{target}: {message}"));
        return;
    }
    if COUNT.fetch_add(1, Ordering::Relaxed) == 0 {
        *FIRST.lock().expect("not poisoned") = Some(format!("{target}: {message}"));
    }
}

/// A `log` logger of the program's with CubeCL's failures recorded on the way: every record
/// reaches `inner` as before.
pub struct Watched<L>(pub L);

impl<L: Log> Log for Watched<L> {
    fn enabled(&self, metadata: &Metadata) -> bool {
        cubecl(metadata.level(), metadata.target()) || self.0.enabled(metadata)
    }

    fn log(&self, line: &Record) {
        record(line.level(), line.target(), &line.args().to_string());
        self.0.log(line);
    }

    fn flush(&self) {
        self.0.flush();
    }
}

/// The watcher as a layer of a `tracing` subscriber: it records CubeCL's lines (which reach
/// `tracing` through its `log` bridge, as `tracing_subscriber`'s `init` installs it) and leaves
/// every event to the subscriber's other layers.
#[derive(Clone, Copy, Debug, Default)]
pub struct FailureLayer;

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for FailureLayer {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        let metadata = event.metadata();
        let level = match *metadata.level() {
            tracing::Level::ERROR => Level::Error,
            tracing::Level::WARN => Level::Warn,
            _ => return,
        };
        // The `log` bridge keeps the record's own target in a field.
        let mut message = Message::default();
        event.record(&mut message);
        let target = message.target.as_deref().unwrap_or(metadata.target());
        record(level, target, &message.text);
    }
}

/// An event's message and, for a bridged `log` record, its target.
#[derive(Default)]
struct Message {
    text: String,
    target: Option<String>,
}

impl tracing::field::Visit for Message {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        match field.name() {
            "message" => self.text = value.to_string(),
            "log.target" => self.target = Some(value.to_string()),
            _ => {}
        }
    }

    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        match field.name() {
            "message" => self.text = format!("{value:?}"),
            "log.target" => self.target = Some(format!("{value:?}").trim_matches('"').to_string()),
            _ => {}
        }
    }
}

/// CubeCL's first lines on stderr, for [`watch`].
struct Stderr;

impl Log for Stderr {
    fn enabled(&self, metadata: &Metadata) -> bool {
        cubecl(metadata.level(), metadata.target())
    }

    fn log(&self, record: &Record) {
        if self.enabled(record.metadata()) && LINES.fetch_add(1, Ordering::Relaxed) < PRINTED {
            eprintln!("cubecl {}: {}: {}", record.level(), record.target(), record.args());
        }
    }

    fn flush(&self) {}
}

/// For a program with no logger of its own: installs one that records CubeCL's failures and
/// prints CubeCL's first lines to stderr. A program with a logger wraps it in [`Watched`]; one
/// with a `tracing` subscriber adds [`FailureLayer`].
///
/// # Errors
/// [`AnotherLogger`] where the process has a logger already: it is left in place.
pub fn watch() -> Result<(), AnotherLogger> {
    static WATCH: Watched<Stderr> = Watched(Stderr);
    log::set_logger(&WATCH).map_err(|_| AnotherLogger)?;
    log::set_max_level(log::LevelFilter::Warn);
    Ok(())
}

/// Whether CubeCL has logged a failure the watcher saw: a launch it could not run, or
/// [`RETRIES_FAILING`] retried allocations since the last check. CubeCL logs a launch as its
/// stream takes it, so call this after a read (a step's loss) that waited for the launches to
/// check, once a step.
///
/// # Errors
/// [`DeviceFailure`] with their count, the first one's line, the allocation that failed and
/// `device`'s memory.
pub fn check(device: &Device) -> Result<(), DeviceFailure> {
    let retries = RETRIES.swap(0, Ordering::Relaxed);
    if retries >= RETRIES_FAILING && COUNT.fetch_add(retries, Ordering::Relaxed) == 0 {
        *FIRST.lock().expect("not poisoned") = RETRIED.lock().expect("not poisoned").clone();
    }
    match COUNT.load(Ordering::Relaxed) {
        0 => Ok(()),
        count => Err(DeviceFailure {
            count,
            first: FIRST.lock().expect("not poisoned").clone().unwrap_or_default(),
            asked: match ASKED.load(Ordering::Relaxed) {
                0 => None,
                bytes => Some(bytes),
            },
            memory: device_memory(device),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The one test of the process-wide count (through each way in, in turn): one retried
    /// allocation between two checks is no failure (but its size is what a failure names), a
    /// launch CubeCL could not run is, another crate's warning is not counted; a `tracing`
    /// subscriber's layer sees CubeCL's lines as its other layers do, and a second watch is
    /// refused, leaving the first logger in place; then repeated retries between two checks
    /// (the H200's lines) count as failures too, naming the tensor's size.
    #[test]
    fn counts_what_cubecl_logs_as_failed() {
        use tracing_subscriber::layer::SubscriberExt;
        let retry = "device allocation of 469762048 B failed (out of device memory); reclaiming and retrying";
        let device = Device::flex();
        record(Level::Warn, "cubecl_server::command::base", retry);
        record(Level::Warn, "burn_train", "not CubeCL's");
        record(Level::Info, "cubecl_runtime", "not a warning");
        assert_eq!(check(&device), Ok(()));
        // One retry a step, step after step: cleanups that made room.
        record(Level::Warn, "cubecl_server::command::base", retry);
        assert_eq!(check(&device), Ok(()));
        let subscriber = tracing_subscriber::registry().with(FailureLayer);
        tracing::subscriber::with_default(subscriber, || {
            tracing::warn!(target: "cubecl_runtime::logging::server", "An IO error happened");
            tracing::warn!(target: "burn_train", "not CubeCL's");
        });
        let failure = check(&device).expect_err("a failed launch");
        assert_eq!(failure.count, 1);
        assert_eq!(failure.first, "cubecl_runtime::logging::server: An IO error happened");
        // The retried allocation is the one that failed; the CPU keeps no pools.
        assert!(failure.out_of_memory());
        assert_eq!(failure.asked, Some(469762048));
        assert_eq!(failure.memory, None);
        let text = failure.to_string();
        assert!(
            text.starts_with("out of device memory: an allocation of 0.44 GiB failed;"),
            "{text}"
        );
        watch().expect("the first logger");
        assert_eq!(watch(), Err(AnotherLogger));
        log::warn!(target: "cubecl_runtime::logging::server", "a second");
        assert_eq!(check(&device).expect_err("two").count, 2);
        // The H200's line: the tensor's size is named inside the page's.
        let h200 = "device allocation of 1073741824 B failed (out of device memory allocating \
                    2953838592 bytes\nNo backtrace available); reclaiming and retrying";
        for _ in 0..3 {
            record(Level::Warn, "cubecl_server::command::base", h200);
        }
        let failure = check(&device).expect_err("repeated retries");
        assert_eq!((failure.count, failure.asked), (5, Some(2953838592)));
    }
}
