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
//! Its root is a small tmpfs of its own (nosuid, nodev, noexec, mode 0755, nothing written in it
//! but two directories), holding [`PROC`], a bind of this process's `/proc` (the launcher names
//! attached trees by `/proc/self/fd/N`, and `/proc/thread-self/ns/mnt` names the seed), and
//! [`ROOTFS`], the empty directory a launch attaches its rootfs on. Every mount in it is private:
//! no mount event reaches it from the host or leaves it, and what a launch does in its own copy
//! never reaches the seed. It is made from a copy of the daemon's namespace: `/` made recursively
//! private, the tmpfs mounted over `/proc` there (a directory every namespace has), the `/proc`
//! clone taken before attached inside it, then `pivot_root` into the tmpfs and a lazy unmount of
//! the old root (one copy of the daemon's mounts, once per process).
//!
//! # Contract
//! - [`seed`] answers the seed's namespace fd (close-on-exec: no child ever inherits it), made on
//!   the first call; `None` when it could not be made (a kernel without `open_tree`, before Linux
//!   5.2, or any step refused: logged once), and the launcher then unshares from the daemon's
//!   namespace as before. Both give the workload the same mounts.
//! - Only a thread of this process's launcher enters the seed, and only to unshare a namespace
//!   of its own from it at once; the workload starts after `pivot_root` has detached the seed's
//!   copy (its tmpfs and `/proc`) from its namespace.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::sync::OnceLock;

use nix::errno::Errno;
use nix::fcntl::OFlag;

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
            SeedError::Thread => None,
        }
    }
}

static SEED: OnceLock<Option<OwnedFd>> = OnceLock::new();

/// The seed's namespace, made on the first call through `sys` (see the module doc); `None` when it
/// cannot be made (logged once).
pub(super) fn seed(sys: &dyn Syscall) -> Option<BorrowedFd<'static>> {
    SEED.get_or_init(|| match make(sys) {
        Ok(fd) => Some(fd),
        Err(e) if e.errno() == Some(Errno::ENOSYS) => {
            tracing::info!(error = %crate::error_chain::full_message(&e), "no launch seed on this kernel: containers with a rootfs are launched from the daemon's mount namespace");
            None
        }
        Err(e) => {
            tracing::warn!(error = %crate::error_chain::full_message(&e), "the launch seed could not be made: containers with a rootfs are launched from the daemon's mount namespace (slower with many volumes)");
            None
        }
    })
    .as_ref()
    .map(|fd| fd.as_fd())
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
    sys.mount_filesystem(
        Path::new(TMPFS_SOURCE),
        Path::new("/proc"),
        "tmpfs",
        flags,
        TMPFS_OPTIONS,
    )
    .map_err(step("mount the seed's tmpfs"))?;
    let root = open_path(Path::new("/proc")).map_err(call("open the seed's tmpfs"))?;
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
    nix::unistd::fchdir(&root).map_err(call("change into the seed's tmpfs"))?;
    sys.pivot_root(Path::new("."), Path::new("."))
        .map_err(step("pivot_root into the seed's tmpfs"))?;
    sys.unmount(Path::new("."), true)
        .map_err(step("detach the old root"))?;
    nix::unistd::chdir("/").map_err(call("change into /"))?;
    let fd = nix::fcntl::open(
        "/proc/thread-self/ns/mnt",
        OFlag::O_RDONLY | OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .map_err(call("open the seed's namespace"))?;
    tracing::debug!("launch seed made");
    Ok(fd)
}

/// An O_PATH, close-on-exec fd of a directory.
fn open_path(path: &Path) -> Result<OwnedFd, Errno> {
    nix::fcntl::open(
        path,
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
}
