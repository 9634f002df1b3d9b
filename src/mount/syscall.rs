//! The seam for every privileged mount-related call: the [`Syscall`] trait, implemented by the real kernel
//! ([`super::LinuxSyscall`]) and by a recording double ([`super::FakeSyscall`]), and the typed [`Call`] record.

use std::fmt;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::path::{Path, PathBuf};

use super::MountError;

/// Mount propagation type (see mount_namespaces(7)).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Propagation {
    /// MS_PRIVATE: no events in or out.
    Private,
    /// MS_SLAVE: events flow in from the master only.
    Slave,
    /// MS_SHARED: events flow both ways within the peer group.
    Shared,
    /// MS_UNBINDABLE: private and cannot be bind mounted.
    Unbindable,
}

impl Propagation {
    /// The lowercase name used in messages.
    pub fn as_str(self) -> &'static str {
        match self {
            Propagation::Private => "private",
            Propagation::Slave => "slave",
            Propagation::Shared => "shared",
            Propagation::Unbindable => "unbindable",
        }
    }
}

impl fmt::Display for Propagation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Per-mount flags for [`Syscall::mount_filesystem`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MountFlags {
    /// MS_RDONLY
    pub readonly: bool,
    /// MS_NOSUID
    pub nosuid: bool,
    /// MS_NODEV
    pub nodev: bool,
    /// MS_NOEXEC
    pub noexec: bool,
}

/// Every privileged mount-related call goes through this trait.
pub trait Syscall: Send + Sync + fmt::Debug {
    /// mount(source, target, NULL, MS_BIND | (MS_REC if recursive))
    fn bind_mount(&self, source: &Path, target: &Path, recursive: bool) -> Result<(), MountError>;
    /// mount(NULL, target, NULL, MS_REMOUNT|MS_BIND|MS_RDONLY | flags the mount already has (nosuid, nodev,
    /// noexec, ...) read from statvfs so the kernel does not refuse with EPERM in user namespaces)
    fn remount_bind_readonly(&self, target: &Path) -> Result<(), MountError>;
    /// mount(device, target, fstype, flags, data)
    fn mount_filesystem(
        &self,
        device: &Path,
        target: &Path,
        fstype: &str,
        flags: MountFlags,
        data: &str,
    ) -> Result<(), MountError>;
    /// mount(NULL, target, NULL, MS_PRIVATE|MS_SLAVE|MS_SHARED|MS_UNBINDABLE | (MS_REC if recursive))
    fn set_propagation(
        &self,
        target: &Path,
        propagation: Propagation,
        recursive: bool,
    ) -> Result<(), MountError>;
    /// umount2(target, MNT_DETACH if detach). EINVAL on a path that is not a mount point maps to
    /// MountError::NotMounted so callers can treat it as done.
    fn unmount(&self, target: &Path, detach: bool) -> Result<(), MountError>;
    /// umount2(name, UMOUNT_NOFOLLOW | MNT_DETACH if detach) relative to the directory `dir`, from a
    /// short-lived thread whose own cwd is `dir` (unshare(CLONE_FS) + fchdir): no symlink is followed at all,
    /// so whatever a container swaps into the tree, only the mount on the entry `name` of `dir` can go.
    /// `name` is one path component. A `name` that is not a mount root (or a symlink) is NotMounted.
    fn unmount_at(
        &self,
        dir: BorrowedFd<'_>,
        name: &std::ffi::OsStr,
        detach: bool,
    ) -> Result<(), MountError>;
    /// [`unmount_at`](Self::unmount_at) on `target`, an absolute path as the mount table gives it, whose
    /// parent is opened without following any symlink (openat2 RESOLVE_NO_SYMLINKS). A symlink anywhere on
    /// the way means the tree changed under us: MountError::Resolve with ELOOP, nothing unmounted. A missing
    /// parent is NotMounted.
    fn unmount_no_symlinks(&self, target: &Path, detach: bool) -> Result<(), MountError>;
    /// setns(fd, CLONE_NEWNS) on the calling thread
    fn enter_mount_namespace(&self, ns: BorrowedFd<'_>) -> Result<(), MountError>;
    /// open_tree(AT_FDCWD, source, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | (AT_RECURSIVE if recursive))
    fn open_tree_clone(
        &self,
        source: &Path,
        recursive: bool,
    ) -> Result<std::os::fd::OwnedFd, MountError>;
    /// move_mount(from, "", to, "", MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH)
    fn move_mount_to_fd(&self, from: BorrowedFd<'_>, to: BorrowedFd<'_>) -> Result<(), MountError>;
    /// mount_setattr(fd, "", AT_EMPTY_PATH | (AT_RECURSIVE if recursive), { attr_set: MOUNT_ATTR_RDONLY })
    fn set_readonly_by_fd(&self, mount: BorrowedFd<'_>, recursive: bool) -> Result<(), MountError>;
    /// mount(/proc/self/fd/N of `target`, ...) fallback: bind `source` onto an O_PATH fd
    fn bind_mount_to_fd(
        &self,
        source: &Path,
        target: BorrowedFd<'_>,
        recursive: bool,
    ) -> Result<(), MountError>;
    /// pivot_root(new_root, put_old)
    fn pivot_root(&self, new_root: &Path, put_old: &Path) -> Result<(), MountError>;
}

/// One recorded [`Syscall`] call, as [`super::FakeSyscall`] saw it. Fds are recorded by number.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Call {
    /// [`Syscall::bind_mount`]
    BindMount {
        /// source
        source: PathBuf,
        /// target
        target: PathBuf,
        /// MS_REC
        recursive: bool,
    },
    /// [`Syscall::remount_bind_readonly`]
    RemountBindReadonly {
        /// target
        target: PathBuf,
    },
    /// [`Syscall::mount_filesystem`]
    MountFilesystem {
        /// device
        device: PathBuf,
        /// target
        target: PathBuf,
        /// file system type
        fstype: String,
        /// flags
        flags: MountFlags,
        /// data string
        data: String,
    },
    /// [`Syscall::set_propagation`]
    SetPropagation {
        /// target
        target: PathBuf,
        /// propagation type
        propagation: Propagation,
        /// MS_REC
        recursive: bool,
    },
    /// [`Syscall::unmount`]
    Unmount {
        /// target
        target: PathBuf,
        /// MNT_DETACH
        detach: bool,
    },
    /// [`Syscall::enter_mount_namespace`]
    EnterMountNamespace {
        /// the namespace fd number
        fd: RawFd,
    },
    /// [`Syscall::open_tree_clone`]
    OpenTreeClone {
        /// source
        source: PathBuf,
        /// AT_RECURSIVE
        recursive: bool,
    },
    /// [`Syscall::move_mount_to_fd`]
    MoveMountToFd {
        /// the detached mount's fd number
        from: RawFd,
        /// the target's fd number
        to: RawFd,
    },
    /// [`Syscall::set_readonly_by_fd`]
    SetReadonlyByFd {
        /// the mount's fd number
        fd: RawFd,
        /// AT_RECURSIVE
        recursive: bool,
    },
    /// [`Syscall::bind_mount_to_fd`]
    BindMountToFd {
        /// source
        source: PathBuf,
        /// the target's fd number
        target: RawFd,
        /// MS_REC
        recursive: bool,
    },
    /// [`Syscall::pivot_root`]
    PivotRoot {
        /// new root
        new_root: PathBuf,
        /// where the old root goes
        put_old: PathBuf,
    },
}

/// The kind of a [`Call`], used to select calls to fail in [`super::FakeSyscall`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CallKind {
    /// [`Call::BindMount`]
    BindMount,
    /// [`Call::RemountBindReadonly`]
    RemountBindReadonly,
    /// [`Call::MountFilesystem`]
    MountFilesystem,
    /// [`Call::SetPropagation`]
    SetPropagation,
    /// [`Call::Unmount`]
    Unmount,
    /// [`Call::EnterMountNamespace`]
    EnterMountNamespace,
    /// [`Call::OpenTreeClone`]
    OpenTreeClone,
    /// [`Call::MoveMountToFd`]
    MoveMountToFd,
    /// [`Call::SetReadonlyByFd`]
    SetReadonlyByFd,
    /// [`Call::BindMountToFd`]
    BindMountToFd,
    /// [`Call::PivotRoot`]
    PivotRoot,
}

impl Call {
    /// The kind of this call.
    pub fn kind(&self) -> CallKind {
        match self {
            Call::BindMount { .. } => CallKind::BindMount,
            Call::RemountBindReadonly { .. } => CallKind::RemountBindReadonly,
            Call::MountFilesystem { .. } => CallKind::MountFilesystem,
            Call::SetPropagation { .. } => CallKind::SetPropagation,
            Call::Unmount { .. } => CallKind::Unmount,
            Call::EnterMountNamespace { .. } => CallKind::EnterMountNamespace,
            Call::OpenTreeClone { .. } => CallKind::OpenTreeClone,
            Call::MoveMountToFd { .. } => CallKind::MoveMountToFd,
            Call::SetReadonlyByFd { .. } => CallKind::SetReadonlyByFd,
            Call::BindMountToFd { .. } => CallKind::BindMountToFd,
            Call::PivotRoot { .. } => CallKind::PivotRoot,
        }
    }

    /// The main path this call acts on (its target), if it has one.
    pub fn target(&self) -> Option<&Path> {
        match self {
            Call::BindMount { target, .. }
            | Call::RemountBindReadonly { target }
            | Call::MountFilesystem { target, .. }
            | Call::SetPropagation { target, .. }
            | Call::Unmount { target, .. } => Some(target),
            Call::OpenTreeClone { source, .. } => Some(source),
            Call::PivotRoot { new_root, .. } => Some(new_root),
            Call::EnterMountNamespace { .. }
            | Call::MoveMountToFd { .. }
            | Call::SetReadonlyByFd { .. }
            | Call::BindMountToFd { .. } => None,
        }
    }
}

/// The raw number of a borrowed fd, for records and messages.
pub(crate) fn raw(fd: BorrowedFd<'_>) -> RawFd {
    fd.as_raw_fd()
}
