//! The seed: a mount namespace that holds next to nothing, made once per process, that a
//! container with a rootfs is launched from.
//!
//! # Why
//! `unshare(CLONE_NEWNS)` copies every mount of the namespace it is called in, and the workload's
//! exit tears the copy down again. From the daemon's namespace, which holds two mounts (staging
//! and target) per volume published on the node, a launch therefore costs time in proportion to
//! the node's volumes: about 5 ms at 1,000 volumes and 50 ms at 10,000 on the benchmark machine
//! (docs/benchmarks.md), and under a burst every launch also waits on the kernel's namespace lock
//! while the others copy. A container with a rootfs needs none of those mounts: after its
//! `pivot_root` it sees only its rootfs, its sandbox and its volumes. So it is launched from the
//! seed instead: the rootfs, the sandbox and each volume are cloned as detached trees in the
//! daemon's namespace (`open_tree`), the launcher thread enters the seed and unshares a namespace
//! of its own from it (a copy of two mounts), and attaches the trees there.
//!
//! # What it holds
//! Its root is a small tmpfs of its own (nosuid, nodev, noexec, mode 0755, made read-only once
//! its two directories exist: every launch's copy shares it), holding [`PROC`], a bind of this process's `/proc` (the launcher names
//! attached trees by `/proc/self/fd/N`, and `/proc/thread-self/ns/mnt` names the seed), and
//! [`ROOTFS`], the empty directory a launch attaches its rootfs on. Every mount in it is private
//! (made so after the pivot: the `/proc` clone is a peer of the host's `/proc` when that is
//! shared): no mount event reaches it from the host or leaves it, and what a launch does in its
//! own copy never reaches the seed. It is made from a copy of the daemon's namespace: `/` made
//! recursively private, the tmpfs mounted over `/proc` there (a directory every namespace has),
//! the `/proc` clone taken before attached inside it, then `pivot_root` into the tmpfs and a lazy
//! unmount of the old root (one copy of the daemon's mounts, once per process).
//!
//! # Contract
//! - [`seed`] answers the seed's namespace fd (close-on-exec: no child ever inherits it), made on
//!   the first call; `None` when there is none, and the launcher then unshares from the daemon's
//!   namespace as before (both give the workload the same mounts): switched off
//!   (`CSI_ISOLATOR_LAUNCH_SEED=off`), or refused for good (a kernel without `open_tree`, before
//!   Linux 5.2, a missing privilege: logged once, not tried again), or a transient shortage
//!   (memory, fds, a thread: logged, tried again at the next launch).
//! - Only a thread of this process's launcher enters the seed, and only to unshare a namespace
//!   of its own from it at once; the workload starts after `pivot_root` has detached the seed's
//!   copy (its tmpfs and `/proc`) from its namespace.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};

use nix::errno::Errno;
use nix::fcntl::OFlag;

use super::root::{open_dir, pivot_shown};
use super::LaunchError;
use crate::mount::{ns, MountError, MountFlags, Propagation, Syscall};

/// The directory of the seed's root a launch attaches its rootfs on.
pub(super) const ROOTFS: &str = "/rootfs";
/// Where the seed holds this process's `/proc`.
pub(super) const PROC: &str = "/proc";

/// The seed's tmpfs: room for its two directories, nothing else.
const TMPFS_OPTIONS: &str = "mode=0755,size=16k,nr_inodes=8";
/// The tmpfs's source name, as the seed's mount table shows it.
const TMPFS_SOURCE: &str = "csi-isolator-seed";

/// Why the seed could not be made: the step and the kernel's answer.
#[derive(Debug, thiserror::Error)]
pub enum SeedError {
    /// A call of the seam refused.
    #[error("launch seed: {step}")]
    Mount {
        /// The step.
        step: &'static str,
        /// The mount error.
        source: MountError,
    },
    /// A direct call refused.
    #[error("launch seed: {step}: {errno}")]
    Call {
        /// The step.
        step: &'static str,
        /// The kernel's answer.
        errno: Errno,
    },
    /// The pivot into the seed's tmpfs failed.
    #[error("launch seed: pivot_root into its tmpfs")]
    Pivot {
        /// The launch error.
        source: Box<LaunchError>,
    },
    /// The thread that makes it could not start or panicked.
    #[error("launch seed: the thread that makes it could not start or panicked")]
    Thread,
}

impl SeedError {
    /// The kernel errno behind this error, if there is one.
    pub fn errno(&self) -> Option<Errno> {
        match self {
            SeedError::Mount { source, .. } => source.errno(),
            SeedError::Call { errno, .. } => Some(*errno),
            SeedError::Pivot { source } => source.errno(),
            SeedError::Thread => None,
        }
    }
}

/// The seed, once made (for the process's life: the fds [`seed`] lends are never closed).
static MADE: OnceLock<OwnedFd> = OnceLock::new();
/// The seed will not be made in this process: switched off, or the kernel refused it for good.
static OFF: AtomicBool = AtomicBool::new(false);
/// One attempt at a time.
static MAKING: Mutex<()> = Mutex::new(());

/// The environment variable that switches the seed off (`off`): every container is then launched
/// from the daemon's namespace, as before the seed (for a kernel or a security module that
/// misbehaves with it, and for the tests of that path).
pub const SEED_ENV: &str = "CSI_ISOLATOR_LAUNCH_SEED";

/// Whether an error means the seed can never be made in this process (an old kernel, a missing
/// privilege, a refusal by policy), rather than a transient shortage worth another try at the
/// next launch (memory, fds, threads).
fn for_good(e: &SeedError) -> bool {
    !matches!(
        e.errno(),
        Some(Errno::ENOMEM | Errno::EMFILE | Errno::ENFILE | Errno::EAGAIN | Errno::EINTR)
    ) && !matches!(e, SeedError::Thread)
}

/// The seed's namespace, made on the first call through `sys` (see the module doc); `None` when
/// there is none (switched off by [`SEED_ENV`], refused for good: logged once; or a transient
/// failure, logged, tried again at the next call).
pub(super) fn seed(sys: &dyn Syscall) -> Option<BorrowedFd<'static>> {
    if let Some(fd) = MADE.get() {
        return Some(fd.as_fd());
    }
    if OFF.load(Ordering::Relaxed) {
        return None;
    }
    let _one = MAKING.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(fd) = MADE.get() {
        return Some(fd.as_fd());
    }
    if OFF.load(Ordering::Relaxed) {
        return None;
    }
    if std::env::var_os(SEED_ENV).is_some_and(|v| v == "off") {
        tracing::info!("{SEED_ENV}=off: containers with a rootfs are launched from the daemon's mount namespace");
        OFF.store(true, Ordering::Relaxed);
        return None;
    }
    match make(sys) {
        Ok(fd) => Some(MADE.get_or_init(|| fd).as_fd()),
        Err(e) if for_good(&e) => {
            tracing::warn!(error = %crate::error_chain::full_message(&e), "no launch seed: containers with a rootfs are launched from the daemon's mount namespace (each launch copies all of its mounts)");
            OFF.store(true, Ordering::Relaxed);
            None
        }
        Err(e) => {
            tracing::warn!(error = %crate::error_chain::full_message(&e), "the launch seed could not be made now: this launch copies the daemon's mount namespace; tried again at the next");
            None
        }
    }
}

/// Makes the seed on a thread of its own (its namespace changes; the thread ends with it) and
/// returns its namespace fd.
fn make(sys: &dyn Syscall) -> Result<OwnedFd, SeedError> {
    std::thread::scope(|scope| {
        std::thread::Builder::new()
            .name("csi-launch-seed".to_string())
            .spawn_scoped(scope, || build(sys))
            .map_err(|_| SeedError::Thread)?
            .join()
            .map_err(|_| SeedError::Thread)?
    })
}

/// The seed's steps, on the calling thread (see the module doc).
fn build(sys: &dyn Syscall) -> Result<OwnedFd, SeedError> {
    let step = |step| move |source| SeedError::Mount { step, source };
    let call = |step| move |errno| SeedError::Call { step, errno };
    // Taken in the daemon's namespace, where this process's /proc is.
    let proc_tree = sys
        .open_tree_clone(Path::new("/proc"), false)
        .map_err(step("clone /proc"))?;
    ns::unshare_mount_namespace().map_err(call("unshare the mount namespace"))?;
    sys.set_propagation(Path::new("/"), Propagation::Private, true)
        .map_err(step("make / recursively private"))?;
    let flags = MountFlags {
        nosuid: true,
        nodev: true,
        noexec: true,
        ..MountFlags::NONE
    };
    let at = Path::new("/proc");
    sys.mount_filesystem(Path::new(TMPFS_SOURCE), at, "tmpfs", flags, TMPFS_OPTIONS)
        .map_err(step("mount the seed's tmpfs"))?;
    let root = open_dir(at).map_err(step("open the seed's tmpfs"))?;
    for dir in [PROC, ROOTFS] {
        nix::sys::stat::mkdirat(
            &root,
            dir.trim_start_matches('/'),
            nix::sys::stat::Mode::from_bits_truncate(0o755),
        )
        .map_err(call("make a directory in the seed's tmpfs"))?;
    }
    let proc_dir = nix::fcntl::openat(
        &root,
        PROC.trim_start_matches('/'),
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .map_err(call("open the seed's /proc"))?;
    sys.move_mount_to_fd(proc_tree.as_fd(), proc_dir.as_fd())
        .map_err(step("attach /proc in the seed"))?;
    // Nothing is written in the tmpfs again: every launch's copy shares it.
    match sys.change_mount_flags(root.as_fd(), MountFlags::READONLY, MountFlags::NONE, false) {
        Err(e) if e.errno() == Some(Errno::ENOSYS) => {
            sys.remount_bind_with(at, MountFlags::READONLY, MountFlags::NONE)
        }
        other => other,
    }
    .map_err(step("make the seed's tmpfs read-only"))?;
    pivot_shown(sys, at, at).map_err(|source| SeedError::Pivot {
        source: Box::new(source),
    })?;
    // The /proc clone joined the host's /proc's peer group if that is shared (a clone of a shared
    // mount is a peer): now every mount of the seed is private.
    sys.set_propagation(Path::new("/"), Propagation::Private, true)
        .map_err(step("make the seed recursively private"))?;
    let fd = nix::fcntl::open(
        "/proc/thread-self/ns/mnt",
        OFlag::O_RDONLY | OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .map_err(call("open the seed's namespace"))?;
    tracing::debug!("launch seed made");
    Ok(fd)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A shortage (memory, fds, threads, a signal) is tried again at the next launch; anything
    /// else the kernel answers (no such call, no privilege, a refusal) turns the seed off for
    /// the process's life.
    #[test]
    fn only_a_shortage_is_tried_again() {
        let call = |errno| SeedError::Call {
            step: "unshare",
            errno,
        };
        #[rustfmt::skip]
        let cases = [
            (call(Errno::ENOMEM), false),
            (call(Errno::EMFILE), false),
            (call(Errno::ENFILE), false),
            (call(Errno::EAGAIN), false),
            (call(Errno::EINTR), false),
            (SeedError::Thread, false),
            (call(Errno::ENOSYS), true),
            (call(Errno::EPERM), true),
            (call(Errno::EINVAL), true),
            (call(Errno::EACCES), true),
        ];
        for (error, permanent) in cases {
            assert_eq!(for_good(&error), permanent, "{error}");
        }
    }
}
