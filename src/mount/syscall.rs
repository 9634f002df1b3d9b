//! The seam for every privileged mount-related call: the [`Syscall`] trait, implemented by the real kernel
//! ([`super::LinuxSyscall`]) and by a recording double ([`super::FakeSyscall`]), and the typed [`Call`] record.

use std::fmt;
use std::os::fd::{BorrowedFd, RawFd};
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

/// Per-mount flags: for [`Syscall::mount_filesystem`], and the flags to set or clear in
/// [`Syscall::change_mount_flags`] and [`Syscall::remount_bind_with`].
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
    /// MS_NOATIME (access times not updated; a volume's `noatime` mount flag)
    pub noatime: bool,
}

impl MountFlags {
    /// What a host-side mount of volume data carries and a container's copy of it does not: nosuid
    /// (nothing planted in a volume runs with privilege through a host path) and nodev (no device node
    /// planted in a volume opens a host device through a host path).
    pub const HOST_ONLY: MountFlags = MountFlags {
        readonly: false,
        nosuid: true,
        nodev: true,
        noexec: false,
        noatime: false,
    };

    /// Read-only, nothing else.
    pub const READONLY: MountFlags = MountFlags {
        readonly: true,
        nosuid: false,
        nodev: false,
        noexec: false,
        noatime: false,
    };

    /// No flag at all.
    pub const NONE: MountFlags = MountFlags {
        readonly: false,
        nosuid: false,
        nodev: false,
        noexec: false,
        noatime: false,
    };

    /// Both sets of flags.
    pub fn union(self, other: MountFlags) -> MountFlags {
        MountFlags {
            readonly: self.readonly || other.readonly,
            nosuid: self.nosuid || other.nosuid,
            nodev: self.nodev || other.nodev,
            noexec: self.noexec || other.noexec,
            noatime: self.noatime || other.noatime,
        }
    }

    /// The flags of `self` that `other` does not have.
    pub fn without(self, other: MountFlags) -> MountFlags {
        MountFlags {
            readonly: self.readonly && !other.readonly,
            nosuid: self.nosuid && !other.nosuid,
            nodev: self.nodev && !other.nodev,
            noexec: self.noexec && !other.noexec,
            noatime: self.noatime && !other.noatime,
        }
    }

    /// Whether no flag is set.
    pub fn is_empty(self) -> bool {
        self == MountFlags::NONE
    }

    /// The flags as mount options (`ro,nosuid,nodev,noexec,noatime`), for records and messages.
    pub fn names(self) -> Vec<&'static str> {
        [
            (self.readonly, "ro"),
            (self.nosuid, "nosuid"),
            (self.nodev, "nodev"),
            (self.noexec, "noexec"),
            (self.noatime, "noatime"),
        ]
        .into_iter()
        .filter(|(on, _)| *on)
        .map(|(_, name)| name)
        .collect()
    }
}

impl fmt::Display for MountFlags {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names = self.names();
        if names.is_empty() {
            f.write_str("(none)")
        } else {
            f.write_str(&names.join(","))
        }
    }
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
    /// mount_setattr(fd, "", AT_EMPTY_PATH | (AT_RECURSIVE if recursive), { propagation }) on a mount fd
    /// (an attached tree's fd): [`set_propagation`](Self::set_propagation) without a path, so it works
    /// from a thread inside another mount namespace whose `/proc` is not this process's. ENOSYS before
    /// Linux 5.12 (callers then use `set_propagation` on `/proc/self/fd/N`).
    fn set_propagation_by_fd(
        &self,
        mount: BorrowedFd<'_>,
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
    /// open_tree(source, "", OPEN_TREE_CLONE | AT_EMPTY_PATH | OPEN_TREE_CLOEXEC | (AT_RECURSIVE if
    /// recursive)): a detached copy of the tree at the object `source` already holds (an O_PATH fd the
    /// caller resolved without following symlinks), so no path is looked up again.
    fn open_tree_clone_fd(
        &self,
        source: BorrowedFd<'_>,
        recursive: bool,
    ) -> Result<std::os::fd::OwnedFd, MountError>;
    /// mount_setattr(fd, "", AT_EMPTY_PATH | (AT_RECURSIVE if recursive), { attr_set: set, attr_clr: clear })
    /// on a mount fd: a detached tree from open_tree, or an O_PATH fd of a mount root. ENOSYS before Linux
    /// 5.12 (callers then use [`remount_bind_with`](Self::remount_bind_with) once the tree is attached).
    fn change_mount_flags(
        &self,
        mount: BorrowedFd<'_>,
        set: MountFlags,
        clear: MountFlags,
        recursive: bool,
    ) -> Result<(), MountError>;
    /// mount(NULL, target, NULL, MS_REMOUNT | MS_BIND | ((the flags the mount has, read from statvfs) + set -
    /// clear)): [`change_mount_flags`](Self::change_mount_flags) for kernels without mount_setattr, on the
    /// topmost mount at `target` only (an attached mount: `/proc/self/fd/N` of its root works).
    fn remount_bind_with(
        &self,
        target: &Path,
        set: MountFlags,
        clear: MountFlags,
    ) -> Result<(), MountError>;
    /// Sets nosuid,nodev ([`MountFlags::HOST_ONLY`]) on the mount rooted at `path`, and on the mounts below
    /// it, if `path` itself is a mount root: `path` is opened O_PATH | O_NOFOLLOW (a symlink there is not a
    /// mount root), asked with statx(STATX_ATTR_MOUNT_ROOT) on that fd, and only then changed through the
    /// same fd (mount_setattr AT_RECURSIVE; a non-recursive bind remount before Linux 5.12). A path that
    /// is not a mount root, or is missing, is `Ok(false)` and nothing is changed: the flags are never set on
    /// the mount that merely holds `path` (the parent file system).
    fn harden_mount_root(&self, path: &Path) -> Result<bool, MountError>;
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
    /// [`Syscall::set_propagation_by_fd`]
    SetPropagationByFd {
        /// the mount's fd number
        fd: RawFd,
        /// propagation type
        propagation: Propagation,
        /// AT_RECURSIVE
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
    /// [`Syscall::open_tree_clone_fd`]
    OpenTreeCloneFd {
        /// the kernel's path of the source fd
        source: PathBuf,
        /// AT_RECURSIVE
        recursive: bool,
    },
    /// [`Syscall::change_mount_flags`]
    ChangeMountFlags {
        /// the mount's fd number
        fd: RawFd,
        /// attr_set
        set: MountFlags,
        /// attr_clr
        clear: MountFlags,
        /// AT_RECURSIVE
        recursive: bool,
    },
    /// [`Syscall::remount_bind_with`]
    RemountBindWith {
        /// target
        target: PathBuf,
        /// flags added
        set: MountFlags,
        /// flags removed
        clear: MountFlags,
    },
    /// [`Syscall::harden_mount_root`]
    HardenMountRoot {
        /// the path asked about
        target: PathBuf,
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
    /// [`Call::SetPropagationByFd`]
    SetPropagationByFd,
    /// [`Call::Unmount`]
    Unmount,
    /// [`Call::EnterMountNamespace`]
    EnterMountNamespace,
    /// [`Call::OpenTreeClone`]
    OpenTreeClone,
    /// [`Call::OpenTreeCloneFd`]
    OpenTreeCloneFd,
    /// [`Call::ChangeMountFlags`]
    ChangeMountFlags,
    /// [`Call::RemountBindWith`]
    RemountBindWith,
    /// [`Call::HardenMountRoot`]
    HardenMountRoot,
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
            Call::SetPropagationByFd { .. } => CallKind::SetPropagationByFd,
            Call::Unmount { .. } => CallKind::Unmount,
            Call::EnterMountNamespace { .. } => CallKind::EnterMountNamespace,
            Call::OpenTreeClone { .. } => CallKind::OpenTreeClone,
            Call::OpenTreeCloneFd { .. } => CallKind::OpenTreeCloneFd,
            Call::ChangeMountFlags { .. } => CallKind::ChangeMountFlags,
            Call::RemountBindWith { .. } => CallKind::RemountBindWith,
            Call::HardenMountRoot { .. } => CallKind::HardenMountRoot,
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
            | Call::Unmount { target, .. }
            | Call::RemountBindWith { target, .. }
            | Call::HardenMountRoot { target } => Some(target),
            Call::OpenTreeClone { source, .. } | Call::OpenTreeCloneFd { source, .. } => {
                Some(source)
            }
            Call::PivotRoot { new_root, .. } => Some(new_root),
            Call::EnterMountNamespace { .. }
            | Call::MoveMountToFd { .. }
            | Call::SetReadonlyByFd { .. }
            | Call::SetPropagationByFd { .. }
            | Call::ChangeMountFlags { .. }
            | Call::BindMountToFd { .. } => None,
        }
    }
}
