//! Where a checkpoint's bytes go: [`Storage`], the writes a save makes, each one call that may
//! fail (a full disk, an I/O error); [`Disk`] makes them on the file system. A save writes each
//! file whole or not at all ([`write_synced`]: a temporary name, fsynced, renamed into place,
//! the directory fsynced), so a failure at any call leaves the files before it and none after.
//! Tests hand a save a storage that fails on purpose (`SaveOptions::with_storage`).

use std::fmt;
use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// The writes of a save; see the module docs.
pub trait Storage: Send + Sync + fmt::Debug {
    /// Creates `dir` and its parents.
    fn create_dir(&self, dir: &Path) -> io::Result<()>;
    /// Writes `bytes` at `temporary`, fsynced; removes what it wrote if it fails.
    fn write_temporary(&self, temporary: &Path, bytes: &[u8]) -> io::Result<()>;
    /// Renames `from` to `to` (a file or a directory), then fsyncs `to`'s directory so the
    /// rename survives a crash.
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    fn remove_file(&self, path: &Path) -> io::Result<()>;
    fn remove_dir(&self, dir: &Path) -> io::Result<()>;
}

/// The file system.
#[derive(Clone, Copy, Debug, Default)]
pub struct Disk;

impl Storage for Disk {
    fn create_dir(&self, dir: &Path) -> io::Result<()> {
        fs::create_dir_all(dir)
    }

    fn write_temporary(&self, temporary: &Path, bytes: &[u8]) -> io::Result<()> {
        let written = File::create(temporary).and_then(|mut file| {
            file.write_all(bytes)?;
            file.sync_all()
        });
        if written.is_err() {
            let _ = fs::remove_file(temporary);
        }
        written
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        fs::rename(from, to)?;
        File::open(to.parent().unwrap_or(Path::new(".")))?.sync_all()
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        fs::remove_file(path)
    }

    fn remove_dir(&self, dir: &Path) -> io::Result<()> {
        fs::remove_dir_all(dir)
    }
}

/// Writes `bytes` at `path` whole or not at all through `storage`: a temporary name beside
/// it, fsynced, renamed into place.
pub fn write_synced(storage: &dyn Storage, path: &Path, bytes: &[u8]) -> io::Result<()> {
    let temporary = temporary_name(path);
    storage.write_temporary(&temporary, bytes)?;
    storage.rename(&temporary, path).inspect_err(|_| {
        let _ = storage.remove_file(&temporary);
    })
}

fn temporary_name(path: &Path) -> PathBuf {
    let mut name = path.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(format!(".tmp-{}", std::process::id()));
    path.with_file_name(name)
}

/// A file's checksum as an index keeps it: its length and CRC-32 (`len:crc`, hex).
pub fn checksum(bytes: &[u8]) -> String {
    format!("{}:{:08x}", bytes.len(), crc32fast::hash(bytes))
}
