//! The examples' logs: `tracing` to stderr, filtered by `RUST_LOG` (warnings by default), the
//! `log` records of CubeCL and Burn among them through `tracing`'s bridge, and CubeCL's failure
//! watcher beside them (`burn_megatron_kernels::failures::FailureLayer`), never in their place.

use burn_megatron_kernels::failures::FailureLayer;
use tracing_subscriber::filter::{EnvFilter, LevelFilter};
use tracing_subscriber::prelude::*;

/// Installs the subscriber, unless the process has one already.
pub fn init() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn"));
    let _ = tracing_subscriber::registry()
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_filter(filter),
        )
        .with(FailureLayer.with_filter(LevelFilter::WARN))
        .try_init();
}
