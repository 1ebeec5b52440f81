//! Parity suites for burn-megatron, written once and run on every backend and communicator.
//!
//! Each suite function takes a [`Harness`] (the devices, the float dtype, how ranks are
//! launched) and panics on the first disagreement. Every rank checks its own results, so the
//! same function runs with ranks as threads (CI, on the CPU), as threads on GPUs, and as one
//! process a GPU under torchrun. `tests/` stamps them out for the CPU; the `gpu-suite` binary
//! runs them on GPUs.

pub mod comm_suite;
pub mod data;
pub mod harness;
pub mod mapping_suite;

pub use harness::Harness;

/// Stamps out one `#[test]` per suite function, for the harness `$harness`.
#[macro_export]
macro_rules! stamp {
    ($harness:expr; $suite:ident: $($test:ident),* $(,)?) => {
        $(
            #[test]
            fn $test() {
                $crate::$suite::$test(&$harness);
            }
        )*
    };
}
