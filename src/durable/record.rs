//! The recorder of durable-metadata operations, for the power-loss tests.
//!
//! Every operation of the durable seam ([`super`]) is reported here after it succeeded. When
//! recording is off (production: the environment variable [`LOG_ENV`] unset and
//! [`record_to`] never called) that costs one relaxed atomic load. When it is on, each
//! operation is appended to the log file as one JSON line, written with a single `write(2)`
//! on a file opened with `O_APPEND`, so several processes (the provider and its plugin) can
//! append to one log and their operations keep the order in which they happened.
//!
//! A record holds what a replay needs: the path(s), the bytes of a write, the mode of a
//! create. [`Op::Promised`] marks the moment a durable operation returned success to its
//! caller: what the power-loss checker holds the file system to.

use std::fs::{File, OpenOptions};
use std::io::{self, BufRead, BufReader, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

/// The environment variable naming the log file: set, every process that inherits it records
/// (tests only).
pub const LOG_ENV: &str = "CSI_ISOLATOR_DURABLE_LOG";

/// One durable-metadata operation, as it was issued.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Op {
    /// A new, empty file was created (`O_CREAT|O_EXCL`) with `mode`.
    Create {
        /// The file.
        path: PathBuf,
        /// Its mode.
        mode: u32,
    },
    /// `bytes` were written at offset 0 of a file just created (its whole content).
    Write {
        /// The file.
        path: PathBuf,
        /// Its content.
        bytes: Vec<u8>,
    },
    /// A file's data and metadata were fsynced.
    Fsync {
        /// The file.
        path: PathBuf,
    },
    /// `from` was renamed over `to`.
    Rename {
        /// The old name.
        from: PathBuf,
        /// The new name.
        to: PathBuf,
    },
    /// A file was unlinked.
    Unlink {
        /// The file.
        path: PathBuf,
    },
    /// A directory was made.
    Mkdir {
        /// The directory.
        path: PathBuf,
    },
    /// An empty directory was removed.
    Rmdir {
        /// The directory.
        path: PathBuf,
    },
    /// A directory was fsynced: the entries made, renamed or removed in it are durable.
    FsyncDir {
        /// The directory.
        path: PathBuf,
    },
    /// `bytes` were appended to an existing file at `offset` (its length before: a journal's
    /// batch, [`super::journal`]).
    Append {
        /// The file.
        path: PathBuf,
        /// Where the bytes went (the file's length before).
        offset: u64,
        /// The bytes.
        bytes: Vec<u8>,
    },
    /// A file was cut to `len` bytes (a journal's torn tail, [`super::journal`]).
    Truncate {
        /// The file.
        path: PathBuf,
        /// Its new length.
        len: u64,
    },
    /// A file's data (and its size) were fdatasynced: for the model, what [`Op::Fsync`] does.
    Fdatasync {
        /// The file.
        path: PathBuf,
    },
    /// The file system holding `path` was synced (`syncfs(2)`): every change made on it
    /// before, data and directory entries, is durable (a journal's write-back).
    SyncFs {
        /// A path on the file system.
        path: PathBuf,
    },
    /// A durable operation returned success to its caller: from here on a power cut must
    /// not undo it.
    Promised(Promise),
}

/// What a durable operation promised its caller when it returned success.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Promise {
    /// The file holds exactly these bytes ([`super::write_atomic`]).
    Written {
        /// The file.
        path: PathBuf,
        /// Its content.
        bytes: Vec<u8>,
    },
    /// Nothing is at `path` (a durable removal).
    Removed {
        /// The removed name.
        path: PathBuf,
    },
    /// The directory exists (a durable mkdir).
    DirMade {
        /// The directory.
        path: PathBuf,
    },
    /// The journal at `path` holds the complete entry numbered `seq` (an append returned,
    /// [`super::journal`]), until a later reset of the journal supersedes it.
    Journaled {
        /// The journal.
        path: PathBuf,
        /// The entry's sequence number.
        seq: u64,
    },
}

impl Op {
    /// The paths the operation names (for a promise, the promised path).
    pub fn paths(&self) -> Vec<&Path> {
        match self {
            Op::Create { path, .. }
            | Op::Write { path, .. }
            | Op::Fsync { path }
            | Op::Unlink { path }
            | Op::Mkdir { path }
            | Op::Rmdir { path }
            | Op::FsyncDir { path }
            | Op::Append { path, .. }
            | Op::Truncate { path, .. }
            | Op::Fdatasync { path }
            | Op::SyncFs { path } => vec![path],
            Op::Rename { from, to } => vec![from, to],
            Op::Promised(
                Promise::Written { path, .. }
                | Promise::Removed { path }
                | Promise::DirMade { path }
                | Promise::Journaled { path, .. },
            ) => vec![path],
        }
    }
}

const UNKNOWN: u8 = 0;
const OFF: u8 = 1;
const ON: u8 = 2;

static STATE: AtomicU8 = AtomicU8::new(UNKNOWN);
static LOG: Mutex<Option<File>> = Mutex::new(None);

/// Appends `op` to the log when recording is on; `op` is only built then.
#[inline]
pub fn record(op: impl FnOnce() -> Op) {
    match STATE.load(Ordering::Relaxed) {
        OFF => {}
        UNKNOWN => {
            start_from_env();
            record(op)
        }
        _ => append(&op()),
    }
}

/// Whether operations are being recorded.
pub fn recording() -> bool {
    if STATE.load(Ordering::Relaxed) == UNKNOWN {
        start_from_env();
    }
    STATE.load(Ordering::Relaxed) == ON
}

/// Starts recording this process's operations into `log` (appended to, created if absent).
/// Children started afterwards record too only if given [`LOG_ENV`].
pub fn record_to(log: &Path) -> io::Result<()> {
    let file = open_log(log)?;
    let mut guard = lock();
    *guard = Some(file);
    STATE.store(ON, Ordering::Relaxed);
    Ok(())
}

/// Stops recording (the log file is closed).
pub fn stop_recording() {
    let mut guard = lock();
    STATE.store(OFF, Ordering::Relaxed);
    *guard = None;
}

/// Reads a log back, in the order the operations were appended.
pub fn read_log(log: &Path) -> io::Result<Vec<Op>> {
    let mut ops = Vec::new();
    for (n, line) in BufReader::new(File::open(log)?).lines().enumerate() {
        let line = line?;
        let op = serde_json::from_str(&line).map_err(|e| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("durable-op log {} line {}: {e}", log.display(), n + 1),
            )
        })?;
        ops.push(op);
    }
    Ok(ops)
}

fn lock() -> std::sync::MutexGuard<'static, Option<File>> {
    // The file handle cannot be left half-updated by a panic.
    LOG.lock().unwrap_or_else(|p| p.into_inner())
}

/// The log holds the bytes of checkpoints: private to root when it creates it.
fn open_log(log: &Path) -> io::Result<File> {
    OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(log)
}

fn start_from_env() {
    let mut guard = lock();
    if STATE.load(Ordering::Relaxed) != UNKNOWN {
        return;
    }
    let file = std::env::var_os(LOG_ENV).and_then(|p| match open_log(Path::new(&p)) {
        Ok(f) => Some(f),
        Err(e) => {
            tracing::error!(log = ?p, error = %e, "cannot open the durable-op log: not recording");
            None
        }
    });
    STATE.store(if file.is_some() { ON } else { OFF }, Ordering::Relaxed);
    *guard = file;
}

fn append(op: &Op) {
    let mut line = serde_json::to_vec(op).expect("a durable op always serializes");
    line.push(b'\n');
    let mut guard = lock();
    if let Some(file) = guard.as_mut() {
        // One write(2) per record: O_APPEND keeps records of several processes whole.
        if let Err(e) = file.write_all(&line) {
            tracing::error!(error = %e, "cannot append to the durable-op log");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The recorder is process-global: one test drives it through its states.
    #[test]
    fn records_in_order_appends_and_stops() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("ops.jsonl");
        std::fs::write(&log, b"").unwrap();
        record_to(&log).unwrap();
        assert!(recording());
        let f = dir.path().join("f");
        super::super::write_atomic(&f, b"hello", 0o600).unwrap();
        super::super::remove_file(&f).unwrap();
        stop_recording();
        assert!(!recording());
        // Nothing after the stop.
        super::super::write_atomic(&f, b"later", 0o600).unwrap();
        // Other tests of this binary may write while this one records: keep ours.
        let ops: Vec<Op> = read_log(&log)
            .unwrap()
            .into_iter()
            .filter(|op| op.paths().iter().all(|p| p.starts_with(dir.path())))
            .collect();
        let shape: Vec<&str> = ops
            .iter()
            .map(|op| match op {
                Op::Create { .. } => "create",
                Op::Write { .. } => "write",
                Op::Fsync { .. } => "fsync",
                Op::Rename { .. } => "rename",
                Op::Unlink { .. } => "unlink",
                Op::Mkdir { .. } => "mkdir",
                Op::Rmdir { .. } => "rmdir",
                Op::FsyncDir { .. } => "fsync_dir",
                Op::Append { .. } => "append",
                Op::Truncate { .. } => "truncate",
                Op::Fdatasync { .. } => "fdatasync",
                Op::SyncFs { .. } => "syncfs",
                Op::Promised(_) => "promised",
            })
            .collect();
        assert_eq!(
            shape,
            [
                "create",
                "write",
                "fsync",
                "rename",
                "fsync_dir",
                "promised",
                "unlink"
            ]
        );
        match (&ops[0], &ops[1], &ops[3], &ops[5]) {
            (
                Op::Create { path: tmp, mode },
                Op::Write { path: w, bytes },
                Op::Rename { from, to },
                Op::Promised(Promise::Written {
                    path,
                    bytes: promised,
                }),
            ) => {
                assert_eq!(*mode, 0o600);
                assert_eq!(w, tmp);
                assert_eq!(bytes, b"hello");
                assert_eq!(from, tmp);
                assert_eq!(to, &f);
                assert_eq!(path, &f);
                assert_eq!(promised, b"hello");
            }
            other => panic!("unexpected records {other:?}"),
        }
        // A record survives a round trip through the log format, bytes included.
        let line = serde_json::to_string(&ops[1]).unwrap();
        assert_eq!(serde_json::from_str::<Op>(&line).unwrap(), ops[1]);
    }

    #[test]
    fn a_corrupt_log_line_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("ops.jsonl");
        std::fs::write(&log, b"{\"op\":\"mkdir\",\"path\":\"/x\"}\nnot json\n").unwrap();
        let err = read_log(&log).unwrap_err();
        assert!(err.to_string().contains("line 2"), "{err}");
    }
}
