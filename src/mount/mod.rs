//! Every mount-related syscall, behind one seam.
//!
//! Contract:
//! - Privileged calls (mount, umount2, setns, open_tree, move_mount, mount_setattr, pivot_root) go through
//!   the [`Syscall`] trait only. [`LinuxSyscall`] talks to the kernel; [`FakeSyscall`] records each call as a
//!   typed [`Call`] and simulates a mount table, for unit tests.
//! - Reads of kernel mount state go through [`MountTable`] ([`ProcMountTable`] parses
//!   `/proc/<pid>/mountinfo`); the mount table, not our own bookkeeping, is the truth for "is it mounted".
//! - Paths inside an untrusted container root are resolved by fd ([`open_in_root`], [`create_in_root`]):
//!   whatever symlinks the root holds, the returned fd lies inside the root. Paths inside a volume
//!   ([`open_beneath_no_symlinks`]) follow no symlink at all, and mounts are cloned from that fd.
//! - Host-side mounts of volume data carry nosuid,nodev ([`MountFlags::HOST_ONLY`],
//!   [`Syscall::harden_mount_root`]); the copies made for containers clear them again.
//! - Unmounting is bounded: EBUSY is retried a few times, then the mount is detached lazily
//!   ([`unmount_with_retry`]); "not mounted" is success.
//! - Loop devices ([`loopdev`]) are attached with autoclear, so they go away with their last user.
//! - A volume's bind into a container is described by a [`VolumeMount`] (target relative to a
//!   [`TargetRoot`], source opened beneath a trusted root): the isolator plans them, the launcher and the
//!   hook apply them, so the type lives here, below both.
//! - Changes of the mount table are learnt from the kernel's notifications ([`watch`]): fanotify mount
//!   events where the kernel has them, a POLLPRI poll of mountinfo otherwise; a lost event means
//!   "anything may have changed", never "nothing did".
//! - `/proc/self/fd/N` is named in one place ([`proc_fd_path`], [`fd_path`]).

mod error;
#[cfg(any(test, feature = "fake-syscall"))]
mod fake;
mod fd;
mod linux;
pub mod loopdev;
mod mountinfo;
pub mod ns;
pub mod resolve;
mod syscall;
mod unmount;
pub mod volume_mount;
pub mod watch;

pub use error::MountError;
#[cfg(any(test, feature = "fake-syscall"))]
pub use fake::FakeSyscall;
pub use fd::{fd_path, proc_fd_path};
pub use linux::LinuxSyscall;
pub use loopdev::{
    attach, backing_file_of, detach, find_backed_under, find_by_backing_file, is_backed_by,
    LoopDevice,
};
pub use mountinfo::{
    entry_identity, parse_mountinfo, EntryIdentity, MountInfo, MountTable, ProcMountTable,
    RootCheck,
};
pub use resolve::{
    create_in_root, open_beneath_no_symlinks, open_dir_no_symlinks, open_dir_no_symlinks_in,
    open_in_root, open_parent_in_root,
};
pub use syscall::{Call, CallKind, MountFlags, Propagation, Syscall};
pub use unmount::{
    retry_unmount, unmount_all_beneath, unmount_all_under, unmount_no_symlinks_with_retry,
    unmount_with_retry, UnmountOutcome, DEFAULT_ATTEMPTS, DEFAULT_DELAY,
};
pub use volume_mount::{Hardening, TargetRoot, VolumeMount, VolumePropagation, SANDBOX_IN_ROOTFS};
pub use watch::{
    kernel_watch, FanotifyWatch, MountChanges, MountWatch, NoWatch, PollWatch, WatchMode,
};
