//! The one atomic, durable file write, shared by the provider's checkpoints
//! (`provider::checkpoint`) and the bundled plugin's records
//! (`plugin::store`).
//!
//! Contract: after [`write_atomic`] returns `Ok`, the file at `path` holds
//! the new bytes in full, with the caller's mode, across a crash or power
//! loss; after it returns an error, or if the process dies in it, `path`
//! holds its old content (or is still absent). The bytes go to a temporary
//! file in the same directory with a name no other writer uses at the same
//! time (`.<name>.tmp-<pid>-<seq>`), created exclusively with the caller's
//! mode (never wider: it is opened with that mode, so the umask can only
//! narrow it), written and fsynced, renamed over `path`, and the directory
//! is fsynced so the rename itself is durable. On every failure the
//! temporary file is removed; only a crash can leave one, and
//! [`remove_stale_temps`] removes those.
//!
//! The directory must exist: creating it (durably or not) is the caller's
//! business.
//!
//! The seam: every durable-metadata operation of the provider's checkpoints,
//! the isolator's checkpoints and the bundled plugin's records goes through
//! the functions of this module ([`write_atomic`], [`create_dir`],
//! [`rename`], [`remove_file`], [`remove_dir`], [`sync_dir`]), and
//! [`promise`] marks the point where one returns success to its caller. In
//! the power-loss tests, [`record`] logs each of them, in order, with what a
//! replay needs; off, that costs one relaxed atomic load per operation.

use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

pub mod journal;
pub mod record;

use record::{Op, Promise};

/// fsyncs, fdatasyncs and syncfs made through the seam in this process (journals included).
static SYNCS: AtomicU64 = AtomicU64::new(0);

/// How many fsync, fdatasync and syncfs calls this process has made through the seam (files,
/// directories, journal batches, write-backs), for the benchmarks; the bundled plugin reports
/// its own when asked (`--report-syncs`).
pub fn syncs() -> u64 {
    SYNCS.load(Ordering::SeqCst)
}

/// Counts one sync about to be issued.
fn counted() {
    SYNCS.fetch_add(1, Ordering::Relaxed);
}

/// What a temporary file's name holds after the target's name.
const TEMP_MARK: &str = ".tmp-";

/// How many names [`write_atomic`] tries when a stale temporary file (a
/// crashed process with the same pid) holds one.
const NAME_ATTEMPTS: u32 = 16;

/// The step of [`write_atomic`] that failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteStep {
    /// Creating the temporary file.
    CreateTemp,
    /// Writing the bytes into it.
    Write,
    /// fsyncing it.
    SyncFile,
    /// Renaming it over the target.
    Rename,
    /// fsyncing the directory after the rename.
    SyncDir,
}

impl WriteStep {
    /// The step as an error message names it.
    pub fn as_str(self) -> &'static str {
        match self {
            WriteStep::CreateTemp => "create temp file",
            WriteStep::Write => "write temp file",
            WriteStep::SyncFile => "fsync temp file",
            WriteStep::Rename => "rename",
            WriteStep::SyncDir => "fsync directory",
        }
    }
}

impl std::fmt::Display for WriteStep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A failed [`write_atomic`]: the file, the step, the cause.
#[derive(Debug, thiserror::Error)]
#[error("write {path} atomically ({step})")]
pub struct AtomicWriteError {
    /// The file being written (not its temporary file).
    pub path: PathBuf,
    /// Which step failed.
    pub step: WriteStep,
    /// The I/O error.
    #[source]
    pub source: io::Error,
}

/// Writes `bytes` to `path` atomically and durably, the file getting `mode`
/// (see the module doc). `path`'s directory must exist.
pub fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> Result<(), AtomicWriteError> {
    let fail = |step, source| AtomicWriteError {
        path: path.to_path_buf(),
        step,
        source,
    };
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    let (tmp, mut file) = create_temp(path, mode).map_err(|e| fail(WriteStep::CreateTemp, e))?;
    record::record(|| Op::Create {
        path: tmp.clone(),
        mode,
    });
    let written = file
        .write_all(bytes)
        .map_err(|e| (WriteStep::Write, e))
        .and_then(|()| {
            record::record(|| Op::Write {
                path: tmp.clone(),
                bytes: bytes.to_vec(),
            });
            counted();
            file.sync_all().map_err(|e| (WriteStep::SyncFile, e))
        })
        .map(|()| record::record(|| Op::Fsync { path: tmp.clone() }));
    drop(file);
    let renamed = written.and_then(|()| rename(&tmp, path).map_err(|e| (WriteStep::Rename, e)));
    if let Err((step, source)) = renamed {
        let _ = remove_file(&tmp);
        return Err(fail(step, source));
    }
    sync_dir(dir).map_err(|e| fail(WriteStep::SyncDir, e))?;
    promise(|| Promise::Written {
        path: path.to_path_buf(),
        bytes: bytes.to_vec(),
    });
    Ok(())
}

/// How many [`write_atomic_each`] writes at a time (the calling thread among them): its syncs
/// wait on the disk, not the CPU, and a disk serves several at once.
const WRITERS: usize = 8;

/// [`write_atomic`] of each `(path, bytes)` of `files`, up to [`WRITERS`] at a time (each file
/// on its own, with its own syncs: a file's contract is [`write_atomic`]'s; nothing is said of
/// their order). The calling thread is one of the writers; a helper thread the system refuses
/// is no error (fewer write at once). After an error each writer takes no further file once it
/// sees it (one it started finishes), and the first error recorded is returned; every file
/// written stays written. For a caller that needs many files durable before its next step (a
/// journal's write-back) and must not wait for their syncs one by one.
pub fn write_atomic_each(files: &[(PathBuf, Vec<u8>)], mode: u32) -> Result<(), AtomicWriteError> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let failed = std::sync::atomic::AtomicBool::new(false);
    let first_error = std::sync::Mutex::new(None);
    let write = || {
        while !failed.load(Ordering::Relaxed) {
            let Some((path, bytes)) = files.get(next.fetch_add(1, Ordering::Relaxed)) else {
                return;
            };
            if let Err(e) = write_atomic(path, bytes, mode) {
                failed.store(true, Ordering::Relaxed);
                first_error
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get_or_insert(e);
                return;
            }
        }
    };
    std::thread::scope(|scope| {
        let write = &write;
        for _ in 1..WRITERS.min(files.len()) {
            let spawned = std::thread::Builder::new()
                .name("write-back".into())
                .spawn_scoped(scope, write);
            // No thread to be had (a pids limit): the ones started and this one do it all.
            if spawned.is_err() {
                break;
            }
        }
        write();
    });
    match first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Why [`read_capped`] refused a file.
#[derive(Debug, thiserror::Error)]
pub enum CappedReadError {
    /// A symlink stands at the path: never followed.
    #[error("a symlink: never followed")]
    Symlink,
    /// Not a regular file (a directory, a fifo, a device).
    #[error("not a regular file")]
    NotRegular,
    /// Over the caller's limit: never read into memory.
    #[error("{len} bytes, over the limit of {max}")]
    TooLarge {
        /// Its length (at least).
        len: u64,
        /// The limit.
        max: u64,
    },
    /// Opening or reading it failed.
    #[error(transparent)]
    Io(#[from] io::Error),
}

/// Reads the file at `path` for a reader that trusts nothing in it: opened without following a
/// symlink (and without blocking on a fifo), refused unless it is a regular file of at most
/// `max` bytes (checked before the read and again by the read itself, should it grow).
/// `Ok(None)`: there is none.
pub fn read_capped(path: &Path, max: u64) -> Result<Option<Vec<u8>>, CappedReadError> {
    use std::io::Read;
    let mut file = match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => return Err(CappedReadError::Symlink),
        Err(e) => return Err(e.into()),
    };
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(CappedReadError::NotRegular);
    }
    if meta.len() > max {
        return Err(CappedReadError::TooLarge {
            len: meta.len(),
            max,
        });
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    (&mut file).take(max + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max {
        return Err(CappedReadError::TooLarge {
            len: bytes.len() as u64,
            max,
        });
    }
    Ok(Some(bytes))
}

/// fsyncs a directory so that entries created, renamed or removed in it are durable.
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    let dir_file = File::open(dir)?;
    counted();
    dir_file.sync_all()?;
    record::record(|| Op::FsyncDir {
        path: dir.to_path_buf(),
    });
    Ok(())
}

/// Makes the directory `path` (its parent must exist). Not durable until its parent is
/// synced ([`sync_dir`]).
pub fn create_dir(path: &Path) -> io::Result<()> {
    create_dir_with_mode(path, 0o777)
}

/// [`create_dir`] with `mode` (before the umask) instead of 0777.
pub fn create_dir_with_mode(path: &Path, mode: u32) -> io::Result<()> {
    fs::DirBuilder::new().mode(mode).create(path)?;
    record::record(|| Op::Mkdir {
        path: path.to_path_buf(),
    });
    Ok(())
}

/// Creates the file `path`, which must not exist, with `mode`, open for writing. Neither its
/// data nor its name is durable until [`sync_file`] and [`sync_dir`] of its directory.
pub fn create_new_file(path: &Path, mode: u32) -> io::Result<File> {
    let file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)?;
    record::record(|| Op::Create {
        path: path.to_path_buf(),
        mode,
    });
    Ok(file)
}

/// fsyncs the file `path`: its data and size are durable (its name is its directory's,
/// [`sync_dir`]).
pub fn sync_file(path: &Path) -> io::Result<()> {
    let file = File::open(path)?;
    counted();
    file.sync_all()?;
    record::record(|| Op::Fsync {
        path: path.to_path_buf(),
    });
    Ok(())
}

/// Renames `from` over `to`. Not durable until their directory is synced ([`sync_dir`]).
pub fn rename(from: &Path, to: &Path) -> io::Result<()> {
    fs::rename(from, to)?;
    record::record(|| Op::Rename {
        from: from.to_path_buf(),
        to: to.to_path_buf(),
    });
    Ok(())
}

/// Unlinks the file `path`. Not durable until its directory is synced ([`sync_dir`]).
pub fn remove_file(path: &Path) -> io::Result<()> {
    fs::remove_file(path)?;
    record::record(|| Op::Unlink {
        path: path.to_path_buf(),
    });
    Ok(())
}

/// Removes the empty directory `path`. Not durable until its parent is synced
/// ([`sync_dir`]).
pub fn remove_dir(path: &Path) -> io::Result<()> {
    fs::remove_dir(path)?;
    record::record(|| Op::Rmdir {
        path: path.to_path_buf(),
    });
    Ok(())
}

/// Marks that a durable operation is returning success to its caller (recorded for the
/// power-loss checker, which holds every later crash state to it).
pub fn promise(what: impl FnOnce() -> Promise) {
    record::record(|| Op::Promised(what()));
}

/// Removes the temporary files [`write_atomic`] left in `dir` when a crash
/// interrupted it (they were never renamed into place, so nothing refers
/// to them). Best effort: what cannot be listed or removed stays.
pub fn remove_stale_temps(dir: &Path) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        if name.starts_with('.') && name.contains(TEMP_MARK) {
            let _ = remove_file(&e.path());
        }
    }
}

/// The next temporary file's sequence number in this process.
static SEQ: AtomicU64 = AtomicU64::new(0);

/// Creates `path`'s temporary file exclusively, with `mode`, under the
/// first free name.
fn create_temp(path: &Path, mode: u32) -> io::Result<(PathBuf, File)> {
    let mut attempt = 0;
    loop {
        let mut name = OsString::from(".");
        name.push(path.file_name().unwrap_or_default());
        name.push(format!(
            "{TEMP_MARK}{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let tmp = path.with_file_name(name);
        match OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&tmp)
        {
            Ok(file) => return Ok((tmp, file)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && attempt < NAME_ATTEMPTS => {
                attempt += 1;
            }
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<_> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn replaces_the_file_with_the_callers_mode_and_leaves_no_temp() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("volume.json");
        write_atomic(&p, b"one", 0o600).unwrap();
        write_atomic(&p, b"two", 0o640).unwrap();
        assert_eq!(fs::read(&p).unwrap(), b"two");
        let mode = fs::metadata(&p).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode & !0o640, 0, "mode {mode:o}");
        assert_eq!(names(dir.path()), ["volume.json"]);
    }

    #[test]
    fn a_private_file_is_private_whatever_the_umask() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("state");
        write_atomic(&p, b"x", 0o600).unwrap();
        assert_eq!(
            fs::metadata(&p).unwrap().permissions().mode() & 0o7777,
            0o600
        );
    }

    /// A stale temporary file of a crashed process with our pid does not
    /// stop the write, and is not what ends up in place.
    #[test]
    fn a_stale_temp_name_is_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        let next = SEQ.load(Ordering::Relaxed);
        for seq in next..next + 4 {
            let stale = dir
                .path()
                .join(format!(".f{TEMP_MARK}{}-{seq}", std::process::id()));
            fs::write(stale, b"stale").unwrap();
        }
        write_atomic(&p, b"fresh", 0o600).unwrap();
        assert_eq!(fs::read(&p).unwrap(), b"fresh");
        remove_stale_temps(dir.path());
        assert_eq!(names(dir.path()), ["f"]);
    }

    /// Every failing step removes the temporary file and leaves the old
    /// content; the error names the file and the step.
    #[test]
    fn a_failed_write_leaves_the_old_content_and_no_temp() {
        let dir = tempfile::tempdir().unwrap();
        // The rename fails: the target is a non-empty directory.
        let target = dir.path().join("busy");
        fs::create_dir(&target).unwrap();
        fs::write(target.join("inside"), b"keep").unwrap();
        let err = write_atomic(&target, b"new", 0o600).unwrap_err();
        assert_eq!(err.step, WriteStep::Rename, "{err}");
        assert!(err.to_string().contains("busy") && err.to_string().contains("rename"));
        assert_eq!(names(dir.path()), ["busy"]);
        assert_eq!(fs::read(target.join("inside")).unwrap(), b"keep");

        // The create fails: the directory does not exist.
        let missing = dir.path().join("no-such-dir").join("f");
        let err = write_atomic(&missing, b"new", 0o600).unwrap_err();
        assert_eq!(err.step, WriteStep::CreateTemp, "{err}");
        assert_eq!(names(dir.path()), ["busy"]);
    }

    /// Many files, several writers: each file whole with its mode, no temporary file left.
    #[test]
    fn each_file_of_a_write_back_is_written_whole() {
        let dir = tempfile::tempdir().unwrap();
        let files: Vec<(PathBuf, Vec<u8>)> = (0..3 * WRITERS + 1)
            .map(|i| {
                let sub = dir.path().join(format!("v{i}"));
                fs::create_dir(&sub).unwrap();
                fs::write(sub.join("volume.json"), b"old").unwrap();
                (sub.join("volume.json"), format!("record {i}").into_bytes())
            })
            .collect();
        write_atomic_each(&files, 0o600).unwrap();
        for (path, bytes) in &files {
            assert_eq!(&fs::read(path).unwrap(), bytes, "{}", path.display());
            let mode = fs::metadata(path).unwrap().permissions().mode() & 0o7777;
            assert_eq!(mode, 0o600, "{}", path.display());
            assert_eq!(names(path.parent().unwrap()), ["volume.json"]);
        }
        write_atomic_each(&[], 0o600).unwrap();
    }

    /// A file that cannot be written fails the write-back with its own error (path and step);
    /// the others are whole or untouched, never torn, and no temporary file is left.
    #[test]
    fn a_failed_file_fails_the_write_back_and_names_itself() {
        let dir = tempfile::tempdir().unwrap();
        let mut files: Vec<(PathBuf, Vec<u8>)> = (0..2 * WRITERS)
            .map(|i| {
                let sub = dir.path().join(format!("v{i}"));
                fs::create_dir(&sub).unwrap();
                fs::write(sub.join("volume.json"), b"old").unwrap();
                (sub.join("volume.json"), b"new".to_vec())
            })
            .collect();
        let missing = dir.path().join("gone").join("volume.json");
        files.insert(WRITERS / 2, (missing, b"new".to_vec()));
        let err = write_atomic_each(&files, 0o600).unwrap_err();
        assert_eq!(err.step, WriteStep::CreateTemp, "{err}");
        assert!(err.to_string().contains("gone"), "{err}");
        for (path, _) in files.iter().filter(|(p, _)| p.exists()) {
            let now = fs::read(path).unwrap();
            assert!(
                now == b"old" || now == b"new",
                "{}: {now:?}",
                path.display()
            );
            assert_eq!(names(path.parent().unwrap()), ["volume.json"]);
        }
    }

    #[test]
    fn stale_temps_are_removed_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join(".volume.state.tmp-1-0"), b"x").unwrap();
        fs::write(dir.path().join("volume.state"), b"y").unwrap();
        fs::write(dir.path().join(".hidden"), b"z").unwrap();
        remove_stale_temps(dir.path());
        assert_eq!(names(dir.path()), [".hidden", "volume.state"]);
    }
}
