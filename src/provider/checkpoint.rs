//! Durable, atomic checkpoint files.
//!
//! Contract: after [`write_atomic`] returns, the file at `path` holds either
//! its old content or the new content in full, across a crash or power loss,
//! with mode 0600: it is [`crate::durable::write_atomic`] (temporary file,
//! fsync, rename, fsync of the directory), after the directory is created
//! durably. Readers never see a torn file.
//!
//! Every durable write passes through [`crash_point`], which lets the crash
//! tests kill the process (SIGKILL, not an early return) right after the Nth
//! durable write: `CSI_ISOLATOR_CRASH_AFTER_WRITE=N`. The provider also
//! calls it right after each RPC returns and before its result is recorded,
//! so that window is crashed at too.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::durable::record::Promise;
pub use crate::durable::remove_stale_temps;
use crate::durable::{self, WriteStep};
use crate::workdir::PRIVATE_FILE_MODE;

/// The environment variable that arms the crash point (tests only).
pub const CRASH_AFTER_WRITE_ENV: &str = "CSI_ISOLATOR_CRASH_AFTER_WRITE";

/// Errors from writing or reading a checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// Creating the directory that holds the checkpoint failed.
    #[error("create checkpoint directory {path}")]
    CreateDir {
        /// The directory.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// Writing or syncing the temporary file failed.
    #[error("write checkpoint {path}")]
    Write {
        /// The file being written.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// Renaming the temporary file over the checkpoint failed.
    #[error("rename checkpoint into place at {path}")]
    Rename {
        /// The checkpoint path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// Syncing the directory after the rename failed.
    #[error("sync checkpoint directory {path}")]
    SyncDir {
        /// The directory.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// Reading the checkpoint failed.
    #[error("read checkpoint {path}")]
    Read {
        /// The checkpoint path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// Removing the checkpoint failed.
    #[error("remove checkpoint {path}")]
    Remove {
        /// The checkpoint path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// Setting a corrupt checkpoint aside failed.
    #[error("set aside corrupt checkpoint {path}")]
    SetAside {
        /// The checkpoint path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
}

static POINTS: AtomicU64 = AtomicU64::new(0);
static WRITES: AtomicU64 = AtomicU64::new(0);
static FSYNCS: AtomicU64 = AtomicU64::new(0);

/// How many fsync/fdatasync calls the checkpoint code has made in this
/// process (files and directories), for the benchmarks.
pub fn fsyncs() -> u64 {
    FSYNCS.load(Ordering::SeqCst)
}

/// Counts crash points (durable writes, and RPCs returned before their
/// result is recorded) and, when the crash point is armed and this is the
/// Nth one, kills the process on the spot.
pub fn crash_point() {
    static ARMED: OnceLock<Option<u64>> = OnceLock::new();
    let n = POINTS.fetch_add(1, Ordering::SeqCst) + 1;
    let armed = ARMED.get_or_init(|| {
        std::env::var(CRASH_AFTER_WRITE_ENV)
            .ok()
            .and_then(|v| v.parse().ok())
    });
    if *armed == Some(n) {
        tracing::warn!(write = n, "crash point reached: killing the process");
        let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
    }
}

/// How many durable writes (atomic writes and durable removals) this
/// process has made, for the benchmarks.
pub fn durable_writes() -> u64 {
    WRITES.load(Ordering::SeqCst)
}

/// Writes `bytes` to `path` atomically and durably (see the module doc).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    create_dir_durable(dir)?;
    durable::write_atomic(path, bytes, PRIVATE_FILE_MODE).map_err(|e| match e.step {
        WriteStep::CreateTemp | WriteStep::Write | WriteStep::SyncFile => CheckpointError::Write {
            path: e.path,
            source: e.source,
        },
        WriteStep::Rename => CheckpointError::Rename {
            path: e.path,
            source: e.source,
        },
        WriteStep::SyncDir => CheckpointError::SyncDir {
            path: dir.to_path_buf(),
            source: e.source,
        },
    })?;
    // The file's fsync and the directory's.
    FSYNCS.fetch_add(2, Ordering::Relaxed);
    WRITES.fetch_add(1, Ordering::Relaxed);
    crash_point();
    Ok(())
}

/// Creates `dir` and any missing parents, fsyncing the parent of each
/// directory it creates, so a new checkpoint's directory survives a power
/// loss as surely as the checkpoint does.
pub fn create_dir_durable(dir: &Path) -> Result<(), CheckpointError> {
    if dir.is_dir() {
        return Ok(());
    }
    if let Some(parent) = dir.parent() {
        if !parent.as_os_str().is_empty() {
            create_dir_durable(parent)?;
        }
    }
    match durable::create_dir(dir) {
        Ok(()) => {
            if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
                sync_dir(parent)?;
            }
            durable::promise(|| Promise::DirMade {
                path: dir.to_path_buf(),
            });
            Ok(())
        }
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        Err(source) => Err(CheckpointError::CreateDir {
            path: dir.to_path_buf(),
            source,
        }),
    }
}

/// Removes `path` durably (the directory entry removal is fsynced). A file
/// that is already gone is not an error.
pub fn remove_durable(path: &Path) -> Result<(), CheckpointError> {
    match durable::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(source) => {
            return Err(CheckpointError::Remove {
                path: path.to_path_buf(),
                source,
            })
        }
    }
    if let Some(dir) = path.parent() {
        sync_dir(dir)?;
    }
    durable::promise(|| Promise::Removed {
        path: path.to_path_buf(),
    });
    WRITES.fetch_add(1, Ordering::Relaxed);
    crash_point();
    Ok(())
}

/// Reads a checkpoint; `Ok(None)` when it does not exist.
pub fn read(path: &Path) -> Result<Option<Vec<u8>>, CheckpointError> {
    match fs::read(path) {
        Ok(b) => Ok(Some(b)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(CheckpointError::Read {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// Moves a checkpoint that cannot be trusted out of the way, next to where it
/// was (`<name>.corrupt-<unix seconds>`), and returns the new path. It is never
/// deleted: an operator may want to read it.
pub fn set_aside(path: &Path) -> Result<PathBuf, CheckpointError> {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".corrupt-{secs}"));
    let aside = path.with_file_name(name);
    durable::rename(path, &aside).map_err(|source| CheckpointError::SetAside {
        path: path.to_path_buf(),
        source,
    })?;
    if let Some(dir) = path.parent() {
        sync_dir(dir)?;
    }
    Ok(aside)
}

/// fsyncs a directory so that entries created, renamed or removed in it are durable.
pub fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    FSYNCS.fetch_add(1, Ordering::Relaxed);
    durable::sync_dir(dir).map_err(|source| CheckpointError::SyncDir {
        path: dir.to_path_buf(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_read_replace_and_remove() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("sub/volume.state");
        assert!(read(&p).unwrap().is_none());
        write_atomic(&p, b"one").unwrap();
        write_atomic(&p, b"two").unwrap();
        assert_eq!(read(&p).unwrap().unwrap(), b"two");
        // No temporary file is left next to it.
        let names: Vec<_> = fs::read_dir(p.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("volume.state")]);
        remove_durable(&p).unwrap();
        remove_durable(&p).unwrap();
        assert!(read(&p).unwrap().is_none());
    }

    #[test]
    fn set_aside_keeps_the_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("volume.state");
        fs::write(&p, b"{garbage").unwrap();
        let aside = set_aside(&p).unwrap();
        assert!(!p.exists());
        assert_eq!(fs::read(&aside).unwrap(), b"{garbage");
        assert!(aside
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("volume.state.corrupt-"));
    }

    #[test]
    fn stale_temps_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join(".volume.state.tmp-1-0"), b"x").unwrap();
        fs::write(dir.path().join("volume.state"), b"y").unwrap();
        remove_stale_temps(dir.path());
        assert!(!dir.path().join(".volume.state.tmp-1-0").exists());
        assert!(dir.path().join("volume.state").exists());
    }

    #[test]
    fn a_failed_write_leaves_the_old_content() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("volume.state");
        write_atomic(&p, b"old").unwrap();
        // A directory squatting on the temp name's parent makes the write fail:
        // use a path whose parent is a file instead.
        let bad = p.join("child");
        assert!(write_atomic(&bad, b"new").is_err());
        assert_eq!(read(&p).unwrap().unwrap(), b"old");
    }
}
