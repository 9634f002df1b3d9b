//! The one error type of the `mount` module: one variant per failing step, each naming the path it failed on.

use std::io;
use std::path::PathBuf;

use nix::errno::Errno;

/// Every way a mount-related step can fail.
#[derive(Debug, thiserror::Error)]
pub enum MountError {
    /// `mount(MS_BIND)` failed.
    #[error("bind mount {source_path} onto {target}: {errno}")]
    Bind {
        /// The directory or file being bound (named `source_path`: thiserror reserves `source`).
        source_path: PathBuf,
        /// Where it was to be mounted.
        target: PathBuf,
        /// The kernel's answer.
        errno: Errno,
    },
    /// Making a watch of the mount table failed (see [`crate::mount::watch`]); the caller falls back to
    /// a lesser one.
    #[error("watch the mount table: {step}: {errno}")]
    Watch {
        /// The step (fanotify_init, fanotify_mark, open or poll of mountinfo).
        step: &'static str,
        /// The kernel's answer.
        errno: Errno,
    },
    /// `mount(MS_REMOUNT|MS_BIND|MS_RDONLY)` failed.
    #[error("remount {target} read-only: {errno}")]
    RemountReadonly {
        /// The mount point.
        target: PathBuf,
        /// The kernel's answer.
        errno: Errno,
    },
    /// `statvfs` of a mount point (to keep its flags on remount) failed.
    #[error("statvfs {target}: {errno}")]
    Statvfs {
        /// The mount point.
        target: PathBuf,
        /// The kernel's answer.
        errno: Errno,
    },
    /// `mount(device, target, fstype, ...)` failed.
    #[error("mount {fstype} from {device} onto {target}: {errno}")]
    MountFilesystem {
        /// The block device (or pseudo source).
        device: PathBuf,
        /// The mount point.
        target: PathBuf,
        /// The file system type.
        fstype: String,
        /// The kernel's answer.
        errno: Errno,
    },
    /// Changing the propagation type of a mount failed.
    #[error("set propagation {propagation} on {target}: {errno}")]
    Propagation {
        /// The mount point.
        target: PathBuf,
        /// The requested propagation, as text.
        propagation: &'static str,
        /// The kernel's answer.
        errno: Errno,
    },
    /// A volume asked with rslave or rshared propagation whose host mount point is not a mount (not
    /// published, or a directory that is no volume): its events could not reach the container.
    #[error("share host mount point {path}: it is not a mount point; rslave and rshared propagation need a published CSI volume")]
    NotAMountPoint {
        /// The host path that should have been the volume's mount point.
        path: PathBuf,
    },
    /// `umount2` failed.
    #[error("unmount {target}: {errno}")]
    Unmount {
        /// The mount point.
        target: PathBuf,
        /// The kernel's answer.
        errno: Errno,
    },
    /// `umount2` found no mount at the path (EINVAL): callers treat this as done.
    #[error("unmount {target}: not mounted")]
    NotMounted {
        /// The path that is not a mount point.
        target: PathBuf,
    },
    /// `setns(CLONE_NEWNS)` failed.
    #[error("enter mount namespace (fd {fd}): {errno}")]
    Setns {
        /// The namespace fd.
        fd: i32,
        /// The kernel's answer.
        errno: Errno,
    },
    /// `unshare(CLONE_FS)` on the thread about to enter another mount namespace failed.
    #[error("unshare the fs state of the namespace thread {thread}: {errno}")]
    UnshareFs {
        /// The thread's name.
        thread: String,
        /// The kernel's answer.
        errno: Errno,
    },
    /// The thread that enters another mount namespace could not be started.
    #[error("spawn the namespace thread {thread}")]
    SpawnNamespaceThread {
        /// The thread's name.
        thread: String,
        /// The I/O error.
        source: io::Error,
    },
    /// The thread that entered another mount namespace panicked.
    #[error("the namespace thread {thread} panicked")]
    NamespaceThreadPanicked {
        /// The thread's name.
        thread: String,
    },
    /// `open_tree(OPEN_TREE_CLONE)` failed.
    #[error("open_tree clone of {source_path}: {errno}")]
    OpenTree {
        /// The tree to clone.
        source_path: PathBuf,
        /// The kernel's answer.
        errno: Errno,
    },
    /// `move_mount` failed.
    #[error("move_mount fd {from} onto fd {to}: {errno}")]
    MoveMount {
        /// The detached mount's fd.
        from: i32,
        /// The target's fd.
        to: i32,
        /// The kernel's answer.
        errno: Errno,
    },
    /// `mount_setattr` failed.
    #[error("mount_setattr read-only on fd {fd}: {errno}")]
    MountSetattr {
        /// The mount's fd.
        fd: i32,
        /// The kernel's answer.
        errno: Errno,
    },
    /// Changing a mount's flags (`mount_setattr` attr_set / attr_clr, or its bind-remount fallback) failed.
    #[error("change mount flags of {mount} ({change}): {errno}")]
    ChangeFlags {
        /// The mount: its path, or the fd it was reached through.
        mount: PathBuf,
        /// What was asked: `set nosuid,nodev`, `clear nosuid,nodev`, ...
        change: String,
        /// The kernel's answer.
        errno: Errno,
    },
    /// Hardening a host-side mount (nosuid,nodev) could not look at it.
    #[error("harden mount {path} (nosuid,nodev): {step}: {errno}")]
    Harden {
        /// The mount point.
        path: PathBuf,
        /// The step (open, statx).
        step: &'static str,
        /// The kernel's answer.
        errno: Errno,
    },
    /// A path beneath a trusted directory goes through a symlink: inside a volume (a persistent volume's
    /// `volumes/roles/<role>/<id>`) whoever writes the volume (a container) could send the mount anywhere;
    /// on a checkpointed sandbox or host bind, whoever planted it could send an unmount or a removal
    /// anywhere. So it is refused.
    #[error(
        "open {path} beneath {root}: {component} is a symlink; paths beneath a volume's mount point or \
         the work dir never follow symbolic links (ELOOP): whatever wrote there planted it, remove it"
    )]
    SymlinkBeneath {
        /// The trusted directory the path is resolved beneath (the volume's mount point, or the work dir).
        root: PathBuf,
        /// The path beneath it.
        path: PathBuf,
        /// The first component that is a symlink, as a path beneath `root` (`volumes/roles/r1/pv1`).
        component: PathBuf,
    },
    /// `pivot_root` failed.
    #[error("pivot_root to {new_root} (old root at {put_old}): {errno}")]
    PivotRoot {
        /// The new root.
        new_root: PathBuf,
        /// Where the old root goes.
        put_old: PathBuf,
        /// The kernel's answer.
        errno: Errno,
    },
    /// Reading a mountinfo file failed.
    #[error("read mountinfo {path}")]
    ReadMountInfo {
        /// The mountinfo file.
        path: PathBuf,
        /// The I/O error.
        source: io::Error,
    },
    /// A mountinfo line is malformed.
    #[error("parse mountinfo line {line:?}: {reason}")]
    ParseMountInfo {
        /// The whole offending line.
        line: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Resolving `path` inside `root` would leave `root`.
    #[error("resolve {path} inside {root}: escapes the root")]
    Escape {
        /// The container root.
        root: PathBuf,
        /// The path being resolved.
        path: PathBuf,
    },
    /// A resolution step (open, openat2, mkdirat, readlinkat, ...) failed.
    #[error("resolve {path} inside {root}: {step}: {errno}")]
    Resolve {
        /// The syscall step.
        step: &'static str,
        /// The container root.
        root: PathBuf,
        /// The path being resolved.
        path: PathBuf,
        /// The kernel's answer.
        errno: Errno,
    },
    /// Reading the path of an fd from /proc/self/fd failed.
    #[error("read path of fd {fd}: {errno}")]
    FdPath {
        /// The fd.
        fd: i32,
        /// The kernel's answer.
        errno: Errno,
    },
    /// A loop device step failed.
    #[error("loop device {step} on {path}: {errno}")]
    Loop {
        /// The step (open, LOOP_CTL_GET_FREE, LOOP_CONFIGURE, ...).
        step: &'static str,
        /// The device or backing file.
        path: PathBuf,
        /// The kernel's answer.
        errno: Errno,
    },
    /// Reading loop device state from sysfs failed.
    #[error("read loop device state {path}")]
    LoopSysfs {
        /// The sysfs file or directory.
        path: PathBuf,
        /// The I/O error.
        source: io::Error,
    },
    /// A path contains an interior NUL byte and cannot be passed to the kernel.
    #[error("path {path} contains a NUL byte")]
    NulInPath {
        /// The offending path.
        path: PathBuf,
    },
}

impl MountError {
    /// The kernel errno behind this error, if there is one.
    pub fn errno(&self) -> Option<Errno> {
        match self {
            MountError::Bind { errno, .. }
            | MountError::RemountReadonly { errno, .. }
            | MountError::Statvfs { errno, .. }
            | MountError::MountFilesystem { errno, .. }
            | MountError::Propagation { errno, .. }
            | MountError::Unmount { errno, .. }
            | MountError::Setns { errno, .. }
            | MountError::UnshareFs { errno, .. }
            | MountError::OpenTree { errno, .. }
            | MountError::MoveMount { errno, .. }
            | MountError::MountSetattr { errno, .. }
            | MountError::ChangeFlags { errno, .. }
            | MountError::Harden { errno, .. }
            | MountError::PivotRoot { errno, .. }
            | MountError::Resolve { errno, .. }
            | MountError::FdPath { errno, .. }
            | MountError::Loop { errno, .. }
            | MountError::Watch { errno, .. } => Some(*errno),
            MountError::NotMounted { .. } => Some(Errno::EINVAL),
            MountError::Escape { .. } => Some(Errno::EXDEV),
            MountError::NotAMountPoint { .. } => Some(Errno::EINVAL),
            MountError::SymlinkBeneath { .. } => Some(Errno::ELOOP),
            MountError::ReadMountInfo { source, .. } | MountError::LoopSysfs { source, .. } => {
                source.raw_os_error().map(Errno::from_raw)
            }
            MountError::SpawnNamespaceThread { source, .. } => {
                source.raw_os_error().map(Errno::from_raw)
            }
            MountError::ParseMountInfo { .. } | MountError::NamespaceThreadPanicked { .. } => None,
            MountError::NulInPath { .. } => Some(Errno::EINVAL),
        }
    }
}
