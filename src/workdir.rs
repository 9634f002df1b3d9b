//! What every command that works on an agent work dir needs first: the dir
//! made absolute and canonical (mount-table checks compare canonical paths),
//! proved safe to trust, the privilege to mount, and the work dir's lock.
//!
//! # Trust
//! Everything in the work dir steers root: checkpoints name pids to signal
//! and paths to unmount, `run.lock` decides who may launch, `plugin.log` is
//! appended to. So the work dir is trusted only when no user but root can
//! have changed it, by the rule OpenSSH's StrictModes applies to `~/.ssh`:
//! every directory on its canonical path is owned by root (or our euid) and
//! not writable by group or others, unless it is sticky (as `/tmp`, where
//! others may add names but not rename or remove root's); the work dir
//! itself must not be writable by group or others, sticky or not. A symbolic
//! link on the way must be owned by root too (its owner chooses where it
//! leads); it is resolved component by component, so every directory reached
//! is checked. [`canonical`] (every command that changes the work dir) and
//! [`verify`] (read-only commands) walk the path this way and refuse, before
//! anything in the work dir is created or opened, naming the component, its
//! owner and mode, and what to do. [`private_dir`] applies the same walk to
//! other directories that must be root's alone (a managed plugin's socket
//! directory).
//!
//! Modes: a work dir we create is 0711: others may not list or change it,
//! but may search it, so a socket or file inside it that its own mode opens
//! to them (the service socket, for a group the operator configures) stays
//! reachable. Everything else lives in 0700 subdirectories
//! ([`PRIVATE_SUBDIRS`]): `csi/` holds the plugins' volumes and mount points
//! (no other user may reach volume data through a host path), `isolators/`
//! the containers' checkpoints, `oci-hook/` and `sandboxes/` the containers'
//! directories, which only root processes use through the host path (a
//! workload enters its sandbox by fd, before it could drop privileges). An
//! existing work dir or subdirectory that is wider (as older versions made
//! them, 0755) is narrowed, with an info log. Directories created on the way
//! to a missing work dir are 0755, as `mkdir -p` makes them.
//!
//! A work dir whose path is not UTF-8 is refused before anything is made:
//! CSI carries staging and target paths as (UTF-8) proto strings, so such a
//! path could only reach the plugin mangled.
//!
//! # Lock
//! One `run`, `serve`, `oci-hook` or `volume` process drives a work dir's
//! volumes at a time: they take `<work_dir>/run.lock` (an exclusive `flock`).
//! The file is never unlinked (a waiter holding the old inode and a newcomer
//! on a new file could both "hold" it); the lock itself goes with its
//! holder, even when the holder is killed. It is mode 0600, so no other user
//! can open it, let alone hold it ([`open_private_file`]).

use crate::io_step::{io_step, IoStep};
use std::collections::VecDeque;
use std::ffi::OsString;
use std::fs::{File, Metadata, Permissions};
use std::io::ErrorKind;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};

/// File name of the work-dir lock.
pub const LOCK_FILE: &str = "run.lock";

/// Mode of a work dir we create (see the module doc).
pub const WORK_DIR_MODE: u32 = 0o711;

/// Mode of the work dir's subdirectories and of a managed plugin's socket
/// directory: root's alone.
pub const PRIVATE_DIR_MODE: u32 = 0o700;

/// Mode of `run.lock` and `plugin.log`.
pub const PRIVATE_FILE_MODE: u32 = 0o600;

/// The work dir's directory of the isolators' container checkpoints.
pub const ISOLATORS_DIR: &str = "isolators";
/// The work dir's directory holding one directory per OCI hook container.
pub const HOOK_DIR: &str = "oci-hook";
/// The work dir's directory holding `run`'s sandboxes, one per container id.
pub const RUN_SANDBOXES: &str = "sandboxes";

/// The work dir's subdirectories, each [`PRIVATE_DIR_MODE`]: the plugins'
/// volumes, the containers' checkpoints, the hook's and `run`'s container
/// directories.
pub const PRIVATE_SUBDIRS: [&str; 4] = [
    crate::resource::CSI_DIR,
    ISOLATORS_DIR,
    HOOK_DIR,
    RUN_SANDBOXES,
];

/// Mode of the directories created on the way to a missing one.
const PARENT_MODE: u32 = 0o755;

/// Symbolic links followed while walking one path (the kernel's limit).
const MAX_SYMLINKS: u32 = 40;

/// What a directory is checked for, as an error names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Purpose {
    /// What the directory is (`work dir`).
    pub what: &'static str,
    /// The option that chooses another one (`--work-dir`).
    pub flag: &'static str,
}

/// The agent work dir.
pub const WORK_DIR: Purpose = Purpose {
    what: "work dir",
    flag: "--work-dir",
};

/// A managed plugin's socket directory.
pub const PLUGIN_SOCKET_DIR: Purpose = Purpose {
    what: "plugin socket dir",
    flag: "--plugin-socket-dir",
};

/// The directory serve's socket is in.
pub const SERVE_SOCKET_DIR: Purpose = Purpose {
    what: "serve socket dir",
    flag: "--socket",
};

/// The directory of a container engine's API socket (docker-plugin's `--engine`): another
/// user able to change it could put a socket of their choosing in the engine's place.
pub const ENGINE_SOCKET_DIR: Purpose = Purpose {
    what: "engine socket dir",
    flag: "--engine",
};

/// What a path component is to the directory being checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// A directory above it: may be world-writable if sticky (as `/tmp`).
    Ancestor,
    /// The directory itself: nobody but root writes in it, sticky or not.
    Own,
    /// A symbolic link on the way: its owner chooses where it leads.
    Link,
}

/// Why a path component cannot be trusted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Problem {
    /// Owned by another user.
    #[error("not owned by root")]
    NotRootOwned,
    /// A symbolic link owned by another user.
    #[error("a symbolic link not owned by root")]
    LinkNotRootOwned,
    /// Writable by group or others (the directory itself).
    #[error("writable by group or others")]
    Writable,
    /// Writable by group or others and not sticky (a directory above).
    #[error("writable by group or others and not sticky")]
    WritableNotSticky,
    /// Not a directory.
    #[error("not a directory")]
    NotADirectory,
    /// A symbolic link where none is followed.
    #[error("a symbolic link (not followed)")]
    Symlink,
    /// Not a regular file.
    #[error("not a regular file")]
    NotARegularFile,
    /// A file with more than one name (a hard link may name anything).
    #[error("a file with several hard links")]
    HardLinked,
    /// Not exactly the mode the directory must have.
    #[error("not mode {0:04o}")]
    ModeNot(u32),
    /// Readable, writable or searchable by group or others (a file that must be root's alone).
    #[error("open to group or others")]
    NotPrivate,
}

/// OpenSSH StrictModes' rule for one path component owned by `owner` with
/// `mode` (`st_mode`), for a process of effective uid `euid`: owned by root
/// or `euid`, and, unless it is a symbolic link, not writable by group or
/// others, which a directory above (an [`Role::Ancestor`]) may be when it is
/// sticky.
pub fn strict_modes(role: Role, owner: u32, mode: u32, euid: u32) -> Result<(), Problem> {
    let writable = mode & 0o022 != 0;
    let sticky = mode & libc::S_ISVTX != 0;
    match role {
        Role::Link if !is_root(owner, euid) => Err(Problem::LinkNotRootOwned),
        _ if !is_root(owner, euid) => Err(Problem::NotRootOwned),
        Role::Link => Ok(()),
        Role::Ancestor if writable && !sticky => Err(Problem::WritableNotSticky),
        Role::Own if writable => Err(Problem::Writable),
        Role::Ancestor | Role::Own => Ok(()),
    }
}

/// Whether `owner` counts as root: uid 0, or the effective uid we run as.
fn is_root(owner: u32, euid: u32) -> bool {
    owner == 0 || owner == euid
}

/// Errors of the work-dir checks.
#[derive(Debug, thiserror::Error)]
pub enum WorkDirError {
    /// The work dir could not be created or resolved.
    #[error("work dir {path}")]
    Resolve {
        /// The work dir as given.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A directory on the path, or the directory itself, could be changed
    /// by another user.
    #[error(
        "{what} {dir}: {component} is {problem} (owner uid {owner}, mode {mode:04o}): {remedy}"
    )]
    Unsafe {
        /// What the directory is (`work dir`, `plugin socket dir`).
        what: &'static str,
        /// The directory as given.
        dir: PathBuf,
        /// The component that failed the check.
        component: PathBuf,
        /// Why.
        problem: Problem,
        /// Its owner.
        owner: u32,
        /// Its permission bits.
        mode: u32,
        /// What to do.
        remedy: String,
    },
    /// A file root keeps in a trusted directory is not what root made.
    #[error("{path} is {problem} (owner uid {owner}, mode {mode:04o}): remove it (csi-isolator creates it, root-owned, mode 0600)")]
    UnsafeFile {
        /// The file.
        path: PathBuf,
        /// Why.
        problem: Problem,
        /// Its owner.
        owner: u32,
        /// Its permission bits.
        mode: u32,
    },
    /// A file or directory in a trusted directory could not be created,
    /// opened or narrowed.
    #[error(transparent)]
    Io(#[from] IoStep),
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
    /// Locking the lock file failed.
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

/// Makes the work dir safe to use and returns its canonical absolute path:
/// refuses a path that is not UTF-8 (as given, or once symlinks are
/// resolved) or that another user could have changed (see the module doc),
/// before anything in the work dir is created; creates what is missing
/// (the work dir 0711, its [`PRIVATE_SUBDIRS`] 0700) and narrows what an
/// older version made wider.
pub fn canonical(work_dir: &Path) -> Result<PathBuf, WorkDirError> {
    require_utf8(work_dir)?;
    let (dir, meta) =
        walk(work_dir, WORK_DIR, Some(WORK_DIR_MODE))?.ok_or_else(|| not_found(work_dir))?;
    require_utf8(&dir)?;
    // Others keep search (x) at most: no listing, no writing.
    narrow(&dir, &meta, meta.mode() & 0o7777 & !0o066)?;
    for sub in PRIVATE_SUBDIRS {
        let path = dir.join(sub);
        match std::fs::DirBuilder::new()
            .mode(PRIVATE_DIR_MODE)
            .create(&path)
        {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
            Err(source) => return Err(WorkDirError::Io(IoStep::new("create", path, source))),
        }
        let meta = check_subdir(work_dir, &path)?;
        narrow(&path, &meta, PRIVATE_DIR_MODE)?;
    }
    Ok(dir)
}

/// The checks of [`canonical`] without creating or changing anything, for
/// read-only commands (`status`): the work dir's canonical path, or None
/// when it does not exist.
pub fn verify(work_dir: &Path) -> Result<Option<PathBuf>, WorkDirError> {
    require_utf8(work_dir)?;
    let Some((dir, _)) = walk(work_dir, WORK_DIR, None)? else {
        return Ok(None);
    };
    require_utf8(&dir)?;
    for sub in PRIVATE_SUBDIRS {
        let path = dir.join(sub);
        if std::fs::symlink_metadata(&path).is_ok() {
            check_subdir(work_dir, &path)?;
        }
    }
    Ok(Some(dir))
}

/// Checks an existing directory by the work dir's rule ([`strict_modes`]: it and every directory on
/// its path owned by root, none writable by group or others but a sticky ancestor), creating and
/// changing nothing: for a directory where something private is put (a socket) whose own mode may
/// be wider than 0700 for a reason (a group that must reach it). Returns its canonical path.
pub fn safe_dir(dir: &Path, purpose: Purpose) -> Result<PathBuf, WorkDirError> {
    let (canonical, _) = walk(dir, purpose, None)?.ok_or_else(|| not_found(dir))?;
    Ok(canonical)
}

/// [`safe_dir`] for a directory created if missing: each missing component
/// is made only after the path above it passed the rule (so nothing is made
/// through another user's directory or symbolic link), the last with `mode`,
/// the others 0755. Returns its canonical path and the directories it made, outermost first.
pub fn create_safe_dir(
    dir: &Path,
    purpose: Purpose,
    mode: u32,
) -> Result<(PathBuf, Vec<PathBuf>), WorkDirError> {
    let mut made = Vec::new();
    let (canonical, _) =
        walk_made(dir, purpose, Some(mode), &mut made)?.ok_or_else(|| not_found(dir))?;
    Ok((canonical, made))
}

/// A directory that only root may use, created (with its missing parents)
/// if needed: its path passes the work dir's rule, and it is a directory
/// owned by root of mode exactly 0700, or it is refused. Returns its
/// canonical path.
pub fn private_dir(dir: &Path, purpose: Purpose) -> Result<PathBuf, WorkDirError> {
    let (canonical, meta) =
        walk(dir, purpose, Some(PRIVATE_DIR_MODE))?.ok_or_else(|| not_found(dir))?;
    let mode = meta.mode() & 0o7777;
    if mode != PRIVATE_DIR_MODE {
        return Err(WorkDirError::Unsafe {
            what: purpose.what,
            dir: dir.to_path_buf(),
            component: canonical.clone(),
            problem: Problem::ModeNot(PRIVATE_DIR_MODE),
            owner: meta.uid(),
            mode,
            remedy: format!(
                "remove {} (csi-isolator creates it, root-owned, mode 0700), or choose another {}",
                canonical.display(),
                purpose.flag
            ),
        });
    }
    Ok(canonical)
}

/// Opens `path` for writing (appending if `append`), creating it 0600 if
/// missing, without following a symbolic link; refuses anything but a
/// regular file of one name owned by root, and narrows a wider mode to
/// 0600 (an older version made `run.lock` 0644, which let any user hold
/// the lock). Its directory must already be trusted.
pub fn open_private_file(path: &Path, append: bool) -> Result<File, WorkDirError> {
    let opened = File::options()
        .write(true)
        .append(append)
        .create(true)
        .mode(PRIVATE_FILE_MODE)
        // O_NONBLOCK: a FIFO planted there fails the check below instead of
        // blocking the open until someone reads it.
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path);
    let file = match opened {
        Ok(f) => f,
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            let (owner, mode) = std::fs::symlink_metadata(path)
                .map(|m| (m.uid(), m.mode() & 0o7777))
                .unwrap_or((0, 0o777));
            return Err(WorkDirError::UnsafeFile {
                path: path.to_path_buf(),
                problem: Problem::Symlink,
                owner,
                mode,
            });
        }
        Err(source) => {
            // A FIFO without a reader fails with ENXIO, a socket with
            // ENXIO too: say what is there rather than the errno.
            if let Ok(m) = lstat(path) {
                if !m.file_type().is_file() {
                    return Err(WorkDirError::UnsafeFile {
                        path: path.to_path_buf(),
                        problem: Problem::NotARegularFile,
                        owner: m.uid(),
                        mode: m.mode() & 0o7777,
                    });
                }
            }
            return Err(WorkDirError::Io(IoStep::new("open", path, source)));
        }
    };
    let meta = file
        .metadata()
        .map_err(|source| WorkDirError::Io(IoStep::new("stat", path, source)))?;
    let problem = if !meta.file_type().is_file() {
        Some(Problem::NotARegularFile)
    } else if meta.nlink() != 1 {
        Some(Problem::HardLinked)
    } else if !is_root(meta.uid(), euid()) {
        Some(Problem::NotRootOwned)
    } else {
        None
    };
    if let Some(problem) = problem {
        return Err(WorkDirError::UnsafeFile {
            path: path.to_path_buf(),
            problem,
            owner: meta.uid(),
            mode: meta.mode() & 0o7777,
        });
    }
    let mode = meta.mode() & 0o7777;
    if mode != PRIVATE_FILE_MODE {
        file.set_permissions(Permissions::from_mode(PRIVATE_FILE_MODE))
            .map_err(|source| WorkDirError::Io(IoStep::new("narrow the mode of", path, source)))?;
        tracing::info!(path = %path.display(), from = format!("{mode:04o}"), to = "0600", "narrowed the mode of a file made by an older version");
    }
    Ok(file)
}

/// How closed a file read by [`read_root_file`] must be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileRule {
    /// Owned by root, not writable by group or others (what it says steers root).
    RootWritten,
    /// Owned by root, no permission at all for group or others (it holds secrets).
    RootOnly,
}

/// Why [`read_root_file`] refused a file.
#[derive(Debug, thiserror::Error)]
pub enum RootFileError {
    /// The directory the file is in fails the work dir's rule.
    #[error(transparent)]
    Directory(Box<WorkDirError>),
    /// The file is not what root alone made.
    #[error("{problem} (owner uid {owner}, mode {mode:04o})")]
    Unsafe {
        /// Why.
        problem: Problem,
        /// Its owner (a symbolic link's own, never followed).
        owner: u32,
        /// Its permission bits.
        mode: u32,
    },
    /// Over the size the caller allows.
    #[error("over {max} bytes")]
    TooLarge {
        /// The limit.
        max: u64,
    },
    /// Opening, checking or reading failed.
    #[error("{step}")]
    Io {
        /// The step (`open`, `stat`, `read`).
        step: &'static str,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

impl RootFileError {
    /// The problem, when the file itself was refused (not its directory, size or an I/O step).
    pub fn problem(&self) -> Option<Problem> {
        match self {
            RootFileError::Unsafe { problem, .. } => Some(*problem),
            _ => None,
        }
    }
}

/// The permission rule of [`read_root_file`] for a file of `owner` and `mode` (`st_mode`), for
/// a process of effective uid `euid`: [`strict_modes`] for a file root wrote, and with
/// [`FileRule::RootOnly`] no bit at all for group or others.
pub fn root_file_modes(rule: FileRule, owner: u32, mode: u32, euid: u32) -> Result<(), Problem> {
    strict_modes(Role::Own, owner, mode, euid)?;
    if rule == FileRule::RootOnly && mode & 0o077 != 0 {
        return Err(Problem::NotPrivate);
    }
    Ok(())
}

/// Reads a file only root can have written (and, with [`FileRule::RootOnly`], only root can
/// read), of at most `max` bytes: its directory must pass the work dir's rule ([`safe_dir`],
/// for `purpose`); the file is opened without following a symbolic link (and without blocking
/// on a FIFO), and judged on the open descriptor: a regular file of one name, by
/// [`root_file_modes`]. Errors never hold the file's content.
pub fn read_root_file(
    path: &Path,
    purpose: Purpose,
    rule: FileRule,
    max: u64,
) -> Result<Vec<u8>, RootFileError> {
    use std::io::Read;
    let io = |step, source| RootFileError::Io { step, source };
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
    let dir = safe_dir(dir.unwrap_or(Path::new(".")), purpose)
        .map_err(|e| RootFileError::Directory(Box::new(e)))?;
    let name = path.file_name().ok_or_else(|| {
        io(
            "open",
            std::io::Error::new(ErrorKind::InvalidInput, "no file name"),
        )
    })?;
    let file = File::options()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(dir.join(name))
        .map_err(|e| {
            if e.raw_os_error() == Some(libc::ELOOP) {
                let (owner, mode) = std::fs::symlink_metadata(dir.join(name))
                    .map(|m| (m.uid(), m.mode() & 0o7777))
                    .unwrap_or((0, 0o777));
                RootFileError::Unsafe {
                    problem: Problem::Symlink,
                    owner,
                    mode,
                }
            } else {
                io("open", e)
            }
        })?;
    let meta = file.metadata().map_err(|e| io("stat", e))?;
    let refuse = |problem| RootFileError::Unsafe {
        problem,
        owner: meta.uid(),
        mode: meta.mode() & 0o7777,
    };
    if !meta.is_file() {
        return Err(refuse(Problem::NotARegularFile));
    }
    if meta.nlink() > 1 {
        return Err(refuse(Problem::HardLinked));
    }
    root_file_modes(rule, meta.uid(), meta.mode(), euid()).map_err(refuse)?;
    let mut bytes = Vec::new();
    file.take(max.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(|e| io("read", e))?;
    if bytes.len() as u64 > max {
        return Err(RootFileError::TooLarge { max });
    }
    Ok(bytes)
}

fn euid() -> u32 {
    nix::unistd::geteuid().as_raw()
}

fn not_found(dir: &Path) -> WorkDirError {
    WorkDirError::Resolve {
        path: dir.to_path_buf(),
        source: std::io::Error::from(ErrorKind::NotFound),
    }
}

/// The components of `path` still to walk: names and `..` (`.` dropped).
fn components(path: &Path) -> impl DoubleEndedIterator<Item = OsString> + '_ {
    path.components().filter_map(|c| match c {
        Component::Normal(name) => Some(name.to_os_string()),
        Component::ParentDir => Some(OsString::from("..")),
        Component::RootDir | Component::CurDir | Component::Prefix(_) => None,
    })
}

/// Walks `dir` from `/`, one component at a time: each directory reached
/// must pass [`strict_modes`] as an ancestor, each symbolic link as a link
/// (then its target is walked the same way), and the directory reached last
/// as [`Role::Own`]. A missing component is created if `create` gives the
/// mode of the last one (those before it get [`PARENT_MODE`]), and checked
/// again once made; without `create`, a missing component gives None.
/// Returns the canonical path and the directory's metadata.
fn walk(
    dir: &Path,
    purpose: Purpose,
    create: Option<u32>,
) -> Result<Option<(PathBuf, Metadata)>, WorkDirError> {
    walk_made(dir, purpose, create, &mut Vec::new())
}

/// [`walk`], noting in `made` each directory it created.
fn walk_made(
    dir: &Path,
    purpose: Purpose,
    create: Option<u32>,
    made: &mut Vec<PathBuf>,
) -> Result<Option<(PathBuf, Metadata)>, WorkDirError> {
    let resolve = |source| WorkDirError::Resolve {
        path: dir.to_path_buf(),
        source,
    };
    let absolute = if dir.is_absolute() {
        dir.to_path_buf()
    } else {
        std::env::current_dir().map_err(resolve)?.join(dir)
    };
    let mut pending: VecDeque<OsString> = components(&absolute).collect();
    let mut current = PathBuf::from("/");
    let mut meta = lstat(&current).map_err(resolve)?;
    judge(dir, purpose, Role::Ancestor, &current, &meta)?;
    let mut links = 0;
    while let Some(name) = pending.pop_front() {
        if name == ".." {
            // `current` is free of symbolic links, so its parent is `..`.
            current.pop();
            meta = lstat(&current).map_err(resolve)?;
            continue;
        }
        let next = current.join(&name);
        match lstat(&next) {
            Ok(m) if m.file_type().is_symlink() => {
                judge(dir, purpose, Role::Link, &next, &m)?;
                links += 1;
                if links > MAX_SYMLINKS {
                    return Err(resolve(std::io::Error::from_raw_os_error(libc::ELOOP)));
                }
                let target = std::fs::read_link(&next).map_err(resolve)?;
                if target.is_absolute() {
                    current = PathBuf::from("/");
                }
                for c in components(&target).rev() {
                    pending.push_front(c);
                }
            }
            Ok(m) if m.is_dir() => {
                judge(dir, purpose, Role::Ancestor, &next, &m)?;
                current = next;
                meta = m;
            }
            Ok(m) => return Err(unsafe_dir(dir, purpose, &next, Problem::NotADirectory, &m)),
            Err(e) if e.kind() == ErrorKind::NotFound => {
                let Some(last_mode) = create else {
                    return Ok(None);
                };
                let mode = if pending.is_empty() {
                    last_mode
                } else {
                    PARENT_MODE
                };
                match std::fs::DirBuilder::new().mode(mode).create(&next) {
                    Ok(()) => {
                        // The umask may have taken bits the mode asks for.
                        std::fs::set_permissions(&next, Permissions::from_mode(mode))
                            .map_err(resolve)?;
                        made.push(next.clone());
                    }
                    Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
                    Err(e) => return Err(resolve(e)),
                }
                // Look at it again, made by us or by a racer: counted as a
                // link hop so that a name that keeps changing ends the walk.
                links += 1;
                if links > MAX_SYMLINKS {
                    return Err(resolve(std::io::Error::from_raw_os_error(libc::ELOOP)));
                }
                pending.push_front(name);
            }
            Err(e) => return Err(resolve(e)),
        }
    }
    judge(dir, purpose, Role::Own, &current, &meta)?;
    Ok(Some((current, meta)))
}

fn lstat(path: &Path) -> std::io::Result<Metadata> {
    std::fs::symlink_metadata(path)
}

/// Applies [`strict_modes`] to one component.
fn judge(
    dir: &Path,
    purpose: Purpose,
    role: Role,
    component: &Path,
    meta: &Metadata,
) -> Result<(), WorkDirError> {
    strict_modes(role, meta.uid(), meta.mode(), euid())
        .map_err(|problem| unsafe_dir(dir, purpose, component, problem, meta))
}

fn unsafe_dir(
    dir: &Path,
    purpose: Purpose,
    component: &Path,
    problem: Problem,
    meta: &Metadata,
) -> WorkDirError {
    let c = component.display();
    let remedy = match problem {
        Problem::NotADirectory | Problem::Symlink | Problem::LinkNotRootOwned => {
            format!("remove {c}, or choose another {}", purpose.flag)
        }
        _ => format!(
            "chown root {c} and chmod go-w {c} (after checking what is in it), or choose another {}",
            purpose.flag
        ),
    };
    WorkDirError::Unsafe {
        what: purpose.what,
        dir: dir.to_path_buf(),
        component: component.to_path_buf(),
        problem,
        owner: meta.uid(),
        mode: meta.mode() & 0o7777,
        remedy,
    }
}

/// A subdirectory of a checked work dir: a real directory (not a symbolic
/// link) that passes the rule as [`Role::Own`].
fn check_subdir(work_dir: &Path, path: &Path) -> Result<Metadata, WorkDirError> {
    let meta = lstat(path).map_err(|source| WorkDirError::Io(IoStep::new("stat", path, source)))?;
    if meta.file_type().is_symlink() {
        return Err(unsafe_dir(
            work_dir,
            WORK_DIR,
            path,
            Problem::Symlink,
            &meta,
        ));
    }
    if !meta.is_dir() {
        return Err(unsafe_dir(
            work_dir,
            WORK_DIR,
            path,
            Problem::NotADirectory,
            &meta,
        ));
    }
    judge(work_dir, WORK_DIR, Role::Own, path, &meta)?;
    Ok(meta)
}

/// Sets a checked directory's mode to `mode` when it is wider.
/// Creates `dir` and its missing parents [`PRIVATE_DIR_MODE`] (existing ones are left as they are: one
/// may be a volume's mount root, whose mode is the volume's): for directories under the work dir that
/// lead to volume data (the provider's `mounts/<id>`, the bundled plugin's store).
pub fn create_private_dirs(dir: &Path) -> std::io::Result<()> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(PRIVATE_DIR_MODE)
        .create(dir)
}

/// Closes `dir` (a directory of our own, never a mount) to everyone but its owner when an earlier
/// version left it open. A missing `dir` is an error; anything but a directory is left alone.
pub fn close_private_dir(dir: &Path) -> std::io::Result<()> {
    let meta = std::fs::symlink_metadata(dir)?;
    if meta.is_dir() && meta.mode() & 0o077 != 0 {
        std::fs::set_permissions(dir, Permissions::from_mode(PRIVATE_DIR_MODE))?;
    }
    Ok(())
}

fn narrow(path: &Path, meta: &Metadata, mode: u32) -> Result<(), WorkDirError> {
    let was = meta.mode() & 0o7777;
    if was & !mode == 0 {
        return Ok(());
    }
    std::fs::set_permissions(path, Permissions::from_mode(mode))
        .map_err(|source| WorkDirError::Io(IoStep::new("narrow the mode of", path, source)))?;
    tracing::info!(path = %path.display(), from = format!("{was:04o}"), to = format!("{mode:04o}"), "narrowed the mode of a directory made by an older version");
    Ok(())
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

/// Takes the lock of a work dir [`canonical`] returned: at once (`wait` =
/// None, else `Busy`) or waiting up to `wait` (polling).
pub async fn lock(work_dir: &Path, wait: Option<Duration>) -> Result<WorkDirLock, WorkDirError> {
    let path = work_dir.join(LOCK_FILE);
    let start = Instant::now();
    // Who holds it is asked once: a root holder (another csi-isolator) is then waited for, and no
    // other user can open the 0600 file afterwards.
    let mut holders_asked = false;
    loop {
        let file = open_private_file(&path, false)?;
        match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(locked) => {
                // Only the file at the path counts (an older tool may have
                // unlinked and re-created it).
                let same = match (locked.metadata(), lstat(&path)) {
                    (Ok(held), Ok(now)) => held.dev() == now.dev() && held.ino() == now.ino(),
                    _ => false,
                };
                if same {
                    return Ok(WorkDirLock { _lock: locked });
                }
            }
            Err((file, Errno::EWOULDBLOCK)) => {
                // Held by a user who could only have opened it while an older version left it
                // 0644: that holder keeps the old inode and the lock moves to a fresh file.
                let foreign = if holders_asked {
                    None
                } else {
                    holders_asked = true;
                    foreign_holders(&file)
                };
                if let Some(holders) = foreign {
                    replace_lock_file(&path)?;
                    tracing::warn!(lock = %path.display(), ?holders, "run.lock was held by a process not running as root (opened while an older version left it readable); replaced it with a fresh root-only lock file");
                    continue;
                }
            }
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

/// The pids holding a `flock` on the inode `(major, minor, ino)`, from the
/// text of `/proc/locks` (`1: FLOCK  ADVISORY  WRITE 1234 fe:00:5832770 0 EOF`:
/// the device in hex).
fn flock_holders(locks: &str, major: u32, minor: u32, ino: u64) -> Vec<i32> {
    locks
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace().skip(1);
            if fields.next()? != "FLOCK" {
                return None;
            }
            let pid: i32 = fields.nth(2)?.parse().ok()?;
            let mut id = fields.next()?.split(':');
            let (maj, min, i) = (id.next()?, id.next()?, id.next()?);
            let same = u32::from_str_radix(maj, 16).ok()? == major
                && u32::from_str_radix(min, 16).ok()? == minor
                && i.parse::<u64>().ok()? == ino;
            same.then_some(pid)
        })
        .collect()
}

/// The effective uid of `pid` (the `Uid:` line of its status), if it still runs.
fn effective_uid(pid: i32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// The holders of the lock on `file` when every one is a process not running as root;
/// None when a holder is root (another csi-isolator: wait for it) or cannot be told.
fn foreign_holders(file: &File) -> Option<Vec<i32>> {
    let meta = file.metadata().ok()?;
    let locks = std::fs::read_to_string("/proc/locks").ok()?;
    let (major, minor) = (
        nix::sys::stat::major(meta.dev()) as u32,
        nix::sys::stat::minor(meta.dev()) as u32,
    );
    let holders = flock_holders(&locks, major, minor, meta.ino());
    let foreign = !holders.is_empty()
        && holders
            .iter()
            .all(|pid| effective_uid(*pid).is_some_and(|uid| !is_root(uid, euid())));
    foreign.then_some(holders)
}

/// Puts a fresh, empty, root-only file at `path` (a rename: whoever holds the
/// old one keeps a lock on a file that is no longer the lock).
fn replace_lock_file(path: &Path) -> Result<(), WorkDirError> {
    let fresh = path.with_file_name(format!(".{LOCK_FILE}.{}", std::process::id()));
    // A leftover of a process with this pid that died here: root's own.
    let _ = std::fs::remove_file(&fresh);
    // create_new (O_EXCL) follows no link. Not made durable (no directory fsync): after a power
    // loss either file is a valid lock, and an old wide one is narrowed or replaced again.
    File::options()
        .write(true)
        .create_new(true)
        .mode(PRIVATE_FILE_MODE)
        .open(&fresh)
        .map_err(io_step("create a fresh lock file", &fresh))?;
    Ok(std::fs::rename(&fresh, path).map_err(io_step("replace the lock file", path))?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_file_rules() {
        use FileRule::*;
        let file = libc::S_IFREG;
        let cases = [
            (RootOnly, 0, 0o600, Ok(())),
            (RootOnly, 0, 0o400, Ok(())),
            (RootOnly, 1000, 0o600, Err(Problem::NotRootOwned)),
            (RootOnly, 0, 0o640, Err(Problem::NotPrivate)),
            (RootOnly, 0, 0o604, Err(Problem::NotPrivate)),
            (RootOnly, 0, 0o601, Err(Problem::NotPrivate)),
            (RootOnly, 0, 0o620, Err(Problem::Writable)),
            (RootWritten, 0, 0o644, Ok(())),
            (RootWritten, 0, 0o664, Err(Problem::Writable)),
            (RootWritten, 1000, 0o644, Err(Problem::NotRootOwned)),
        ];
        for (rule, owner, mode, want) in cases {
            assert_eq!(
                root_file_modes(rule, owner, file | mode, 0),
                want,
                "{rule:?} {owner} {mode:o}"
            );
        }
        // Our own euid counts as root (an unprivileged plugin reads its own file).
        assert_eq!(root_file_modes(RootOnly, 1000, file | 0o600, 1000), Ok(()));
    }

    #[test]
    fn flock_holders_of_one_inode() {
        let locks = "1: FLOCK  ADVISORY  WRITE 30189 fe:00:5832770 0 EOF\n\
                     2: POSIX  ADVISORY  WRITE 777 fe:00:5832770 0 EOF\n\
                     3: FLOCK  ADVISORY  WRITE 4242 fe:00:5832771 0 EOF\n\
                     4: FLOCK  ADVISORY  READ 17 fe:01:5832770 0 EOF\n\
                     5: FLOCK  ADVISORY  WRITE 99 fe:00:5832770 0 EOF\n\
                     6: OFDLCK ADVISORY  WRITE -1 fe:00:5832770 0 EOF\n\
                     garbage\n";
        assert_eq!(flock_holders(locks, 0xfe, 0, 5832770), vec![30189, 99]);
        assert_eq!(flock_holders(locks, 0xfe, 1, 5832770), vec![17]);
        assert_eq!(flock_holders(locks, 8, 1, 1), Vec::<i32>::new());
    }

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

    /// StrictModes, component by component: (role, owner, mode, euid) and
    /// the verdict.
    #[test]
    fn strict_modes_decides_by_owner_mode_and_role() {
        use Problem::*;
        use Role::*;
        let dir = libc::S_IFDIR;
        let link = libc::S_IFLNK;
        type Case = (Role, u32, u32, u32, Result<(), Problem>);
        let cases: &[Case] = &[
            // root's directories as a distribution ships them
            (Ancestor, 0, dir | 0o755, 0, Ok(())),
            (Own, 0, dir | 0o711, 0, Ok(())),
            (Own, 0, dir | 0o700, 0, Ok(())),
            (Own, 0, dir | 0o755, 0, Ok(())),
            // /tmp: world-writable but sticky, fine above us, never as us
            (Ancestor, 0, dir | 0o1777, 0, Ok(())),
            (Own, 0, dir | 0o1777, 0, Err(Writable)),
            (Ancestor, 0, dir | 0o1770, 0, Ok(())),
            // writable by group or others, not sticky
            (Ancestor, 0, dir | 0o777, 0, Err(WritableNotSticky)),
            (Ancestor, 0, dir | 0o775, 0, Err(WritableNotSticky)),
            (Ancestor, 0, dir | 0o757, 0, Err(WritableNotSticky)),
            (Own, 0, dir | 0o775, 0, Err(Writable)),
            (Own, 0, dir | 0o757, 0, Err(Writable)),
            // setgid is not sticky
            (Ancestor, 0, dir | 0o2777, 0, Err(WritableNotSticky)),
            // another user's, whatever the mode
            (Ancestor, 65534, dir | 0o755, 0, Err(NotRootOwned)),
            (Own, 65534, dir | 0o700, 0, Err(NotRootOwned)),
            (Ancestor, 1000, dir | 0o1777, 0, Err(NotRootOwned)),
            // our own euid counts as root's
            (Own, 1000, dir | 0o700, 1000, Ok(())),
            (Own, 1001, dir | 0o700, 1000, Err(NotRootOwned)),
            // a symbolic link: only its owner counts (its mode is always 0777)
            (Link, 0, link | 0o777, 0, Ok(())),
            (Link, 65534, link | 0o777, 0, Err(LinkNotRootOwned)),
        ];
        for &(role, owner, mode, euid, want) in cases {
            assert_eq!(
                strict_modes(role, owner, mode, euid),
                want,
                "{role:?} owner {owner} mode {mode:o} euid {euid}"
            );
        }
    }

    #[test]
    fn a_symlink_on_the_way_is_followed_only_when_root_owns_it() {
        csi_isolator_testing::require_root();
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("real");
        std::fs::create_dir(&real).unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink("sub/../real", &link).unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        let got = canonical(&link.join("w")).unwrap();
        assert_eq!(got, std::fs::canonicalize(&real).unwrap().join("w"));
        std::os::unix::fs::lchown(&link, Some(65534), None).unwrap();
        let err = canonical(&link.join("w2")).unwrap_err();
        assert!(
            matches!(
                err,
                WorkDirError::Unsafe {
                    problem: Problem::LinkNotRootOwned,
                    owner: 65534,
                    ..
                }
            ),
            "{err}"
        );
        assert!(!real.join("w2").exists());
        assert!(matches!(
            verify(&link.join("w")),
            Err(WorkDirError::Unsafe { .. })
        ));
        assert!(verify(&real.join("absent")).unwrap().is_none());
    }

    #[test]
    fn a_private_file_is_root_s_regular_file_of_one_name() {
        csi_isolator_testing::require_root();
        let dir = tempfile::tempdir().unwrap();
        let at = |name: &str| dir.path().join(name);
        nix::unistd::mkfifo(&at("fifo"), nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        std::fs::write(at("linked"), "").unwrap();
        std::fs::hard_link(at("linked"), at("other-name")).unwrap();
        std::fs::write(at("theirs"), "").unwrap();
        std::os::unix::fs::lchown(at("theirs"), Some(65534), None).unwrap();
        std::os::unix::fs::symlink(at("linked"), at("link")).unwrap();
        for (name, want) in [
            ("fifo", Problem::NotARegularFile),
            ("linked", Problem::HardLinked),
            ("theirs", Problem::NotRootOwned),
            ("link", Problem::Symlink),
        ] {
            match open_private_file(&at(name), true) {
                Err(WorkDirError::UnsafeFile { problem, .. }) => {
                    assert_eq!(problem, want, "{name}")
                }
                other => panic!("{name}: {other:?}"),
            }
        }
        std::fs::write(at("wide"), "").unwrap();
        std::fs::set_permissions(at("wide"), Permissions::from_mode(0o644)).unwrap();
        open_private_file(&at("wide"), false).unwrap();
        open_private_file(&at("new"), true).unwrap();
        for name in ["wide", "new"] {
            let mode = std::fs::metadata(at(name)).unwrap().mode() & 0o7777;
            assert_eq!(mode, 0o600, "{name}");
        }
    }
}
