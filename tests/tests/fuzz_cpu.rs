//! The loaders fuzzed (`burn_megatron_tests::fuzz`): each target's corpus, then
//! `FUZZ_SECONDS` (3 by default) of mutations; an allocation past the cap aborts the run, the
//! input under test left in the target's scratch directory as `current-input`.
//! A long run: `FUZZ_SECONDS=600 cargo test --release -p burn-megatron-tests --test fuzz_cpu`.

use std::alloc::{GlobalAlloc, Layout, System};

use burn_megatron_tests::fuzz::{self, ALLOCATION_CAP, TARGETS};

/// The system allocator, refusing any one allocation past [`ALLOCATION_CAP`] (the process then
/// aborts, naming the size): a length from a corrupt header must be checked before it sizes
/// anything.
struct Capped;

unsafe impl GlobalAlloc for Capped {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        match layout.size() > ALLOCATION_CAP {
            true => std::ptr::null_mut(),
            // SAFETY: the caller's contract, passed on.
            false => unsafe { System.alloc(layout) },
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System` with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        match layout.size() > ALLOCATION_CAP {
            true => std::ptr::null_mut(),
            // SAFETY: the caller's contract, passed on.
            false => unsafe { System.alloc_zeroed(layout) },
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        match new_size > ALLOCATION_CAP {
            true => std::ptr::null_mut(),
            // SAFETY: the caller's contract, passed on.
            false => unsafe { System.realloc(ptr, layout, new_size) },
        }
    }
}

#[global_allocator]
static ALLOCATOR: Capped = Capped;

fn run(name: &str) {
    let target = TARGETS.iter().find(|t| t.name == name).expect("a target");
    let scratch = std::env::temp_dir().join(format!("burn-megatron-fuzz-{name}-{}", std::process::id()));
    eprintln!(
        "{name}: the input under test is {}",
        scratch.join("current-input").display()
    );
    let report = fuzz::fuzz(target, fuzz::budget(), &scratch);
    eprintln!("{name}: {report:?}");
    let _ = std::fs::remove_dir_all(&scratch);
}

#[test]
fn gguf() {
    run("gguf");
}

#[test]
fn hf_config() {
    run("hf-config");
}

#[test]
fn hf_weights() {
    run("hf-weights");
}

#[test]
fn hf_index() {
    run("hf-index");
}

#[test]
fn hf_tokenizer() {
    run("hf-tokenizer");
}

#[test]
fn checkpoint_index() {
    run("checkpoint-index");
}

#[test]
fn checkpoint_shard() {
    run("checkpoint-shard");
}

#[test]
fn job() {
    run("job");
}

#[test]
fn data_index() {
    run("data-index");
}

/// Writes the seeds and fixed files (`fuzz::seeds`).
#[test]
#[ignore]
fn write_seeds() {
    fuzz::seeds::write_all();
}
