//! What every command that works on an agent work dir needs first: the dir
//! made absolute and canonical (mount-table checks compare canonical paths),
//! the privilege to mount, and the work dir's lock.
//!
//! A work dir whose path is not UTF-8 is refused before anything is made:
//! CSI carries staging and target paths as (UTF-8) proto strings, so such a
//! path could only reach the plugin mangled.
//!
//! One `run`, `serve`, `oci-hook` or `volume` process drives a work dir's
//! volumes at a time: they take `<work_dir>/run.lock` (an exclusive `flock`).
//! The file is never unlinked (a waiter holding the old inode and a newcomer
//! on a new file could both "hold" it); the lock itself goes with its
//! holder, even when the holder is killed.

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};

/// File name of the work-dir lock.
pub const LOCK_FILE: &str = "run.lock";

/// Errors of the work-dir checks.
#[derive(Debug, thiserror::Error)]
pub enum WorkDirError {
    /// The work dir could not be created or resolved.
    #[error("work dir {path}: {source}")]
    Resolve {
        /// The work dir as given.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The work dir's path is not UTF-8 (shown escaped).
    #[error("work dir {path:?}: not valid UTF-8 (CSI passes paths as UTF-8 strings); choose another work dir")]
    NotUtf8 {
        /// The work dir as given.
        path: PathBuf,
    },
    /// Missing privilege.
    #[error("{command} needs {capability} (it creates mount namespaces and bind mounts): run it as root")]
    NotPrivileged {
        /// The command.
        command: &'static str,
        /// The missing capability.
        capability: &'static str,
    },
    /// Opening or locking the lock file failed.
    #[error("lock {path}: {errno}")]
    Lock {
        /// The lock file.
        path: PathBuf,
        /// The error.
        errno: Errno,
    },
    /// Another process holds the work dir.
    #[error("work dir {work_dir} is in use by another csi-isolator process (lock {lock})")]
    Busy {
        /// The work dir.
        work_dir: PathBuf,
        /// The lock file.
        lock: PathBuf,
    },
    /// Waiting for the lock timed out.
    #[error("work dir {work_dir} stayed in use by another csi-isolator process for {waited:?} (lock {lock})")]
    Timeout {
        /// The work dir.
        work_dir: PathBuf,
        /// The lock file.
        lock: PathBuf,
        /// How long we waited.
        waited: Duration,
    },
}

/// Fails unless the work dir's path is UTF-8.
pub fn require_utf8(work_dir: &Path) -> Result<(), WorkDirError> {
    match work_dir.to_str() {
        Some(_) => Ok(()),
        None => Err(WorkDirError::NotUtf8 {
            path: work_dir.to_path_buf(),
        }),
    }
}

/// Creates the work dir if needed and returns its canonical absolute path;
/// a path that is not UTF-8 (as given, or once symlinks are resolved) is
/// refused, as given before anything is created.
pub fn canonical(work_dir: &Path) -> Result<PathBuf, WorkDirError> {
    require_utf8(work_dir)?;
    let canonical = std::fs::create_dir_all(work_dir)
        .and_then(|()| std::fs::canonicalize(work_dir))
        .map_err(|source| WorkDirError::Resolve {
            path: work_dir.to_path_buf(),
            source,
        })?;
    require_utf8(&canonical)?;
    Ok(canonical)
}

/// Fails unless the process may mount (CAP_SYS_ADMIN in its effective set).
pub fn require_mount_privilege(command: &'static str) -> Result<(), WorkDirError> {
    use caps::{CapSet, Capability};
    match caps::has_cap(None, CapSet::Effective, Capability::CAP_SYS_ADMIN) {
        Ok(true) => Ok(()),
        _ => Err(WorkDirError::NotPrivileged {
            command,
            capability: "CAP_SYS_ADMIN",
        }),
    }
}

/// The held work-dir lock (released on drop or when the process dies).
#[derive(Debug)]
pub struct WorkDirLock {
    _lock: Flock<File>,
}

/// Takes the work dir's lock: at once (`wait` = None, else `Busy`) or
/// waiting up to `wait` (polling).
pub async fn lock(work_dir: &Path, wait: Option<Duration>) -> Result<WorkDirLock, WorkDirError> {
    let path = work_dir.join(LOCK_FILE);
    let start = Instant::now();
    loop {
        let file = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| WorkDirError::Lock {
                path: path.clone(),
                errno: Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO)),
            })?;
        match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(locked) => {
                // Only the file at the path counts (an older tool may have
                // unlinked and re-created it).
                let same = match (locked.metadata(), std::fs::metadata(&path)) {
                    (Ok(held), Ok(now)) => held.dev() == now.dev() && held.ino() == now.ino(),
                    _ => false,
                };
                if same {
                    return Ok(WorkDirLock { _lock: locked });
                }
            }
            Err((_, Errno::EWOULDBLOCK)) => {}
            Err((_, errno)) => return Err(WorkDirError::Lock { path, errno }),
        }
        match wait {
            None => {
                return Err(WorkDirError::Busy {
                    work_dir: work_dir.to_path_buf(),
                    lock: path,
                })
            }
            Some(max) if start.elapsed() >= max => {
                return Err(WorkDirError::Timeout {
                    work_dir: work_dir.to_path_buf(),
                    lock: path,
                    waited: start.elapsed(),
                })
            }
            Some(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn one_holder_at_a_time_and_the_file_stays() {
        let dir = tempfile::tempdir().unwrap();
        let work = canonical(&dir.path().join("w")).unwrap();
        let held = lock(&work, None).await.unwrap();
        assert!(matches!(
            lock(&work, None).await,
            Err(WorkDirError::Busy { .. })
        ));
        assert!(matches!(
            lock(&work, Some(Duration::from_millis(120))).await,
            Err(WorkDirError::Timeout { .. })
        ));
        drop(held);
        let again = lock(&work, Some(Duration::from_secs(1))).await.unwrap();
        assert!(work.join(LOCK_FILE).exists());
        drop(again);
    }

    #[test]
    fn a_non_utf8_work_dir_is_refused_before_it_is_made() {
        use std::os::unix::ffi::OsStrExt;
        let dir = tempfile::tempdir().unwrap();
        let bad = dir.path().join(std::ffi::OsStr::from_bytes(b"w\xff"));
        let err = canonical(&bad).unwrap_err();
        assert!(matches!(err, WorkDirError::NotUtf8 { .. }));
        let text = err.to_string();
        assert!(text.contains("w\\xFF") && text.contains("UTF-8"), "{text}");
        assert!(!bad.exists());
    }
}
