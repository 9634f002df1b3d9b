//! The steps that give a launcher thread its root, shared by the launcher thread
//! ([`super::setup`]) and the launch seed ([`super::seed`]): a trusted directory opened by fd, and
//! `pivot_root` into a directory with the old root detached.

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use nix::fcntl::OFlag;

use super::LaunchError;
use crate::mount::{MountError, Syscall};

/// An O_PATH, close-on-exec fd of a trusted host directory.
pub(super) fn open_dir(path: &Path) -> Result<OwnedFd, MountError> {
    open_path(path, OFlag::O_DIRECTORY)
}

/// An O_PATH, close-on-exec fd of a trusted host path, with the flags `extra` too.
pub(super) fn open_path(path: &Path, extra: OFlag) -> Result<OwnedFd, MountError> {
    nix::fcntl::open(
        path,
        OFlag::O_PATH | OFlag::O_CLOEXEC | extra,
        nix::sys::stat::Mode::empty(),
    )
    .map_err(|errno| MountError::Resolve {
        step: "open",
        root: path.to_path_buf(),
        path: PathBuf::new(),
        errno,
    })
}

/// pivot_root into the (self-bound) rootfs, the way pivot_root(2) suggests: change into it,
/// `pivot_root(".", ".")` stacks the old root on top of it, and a lazy unmount of "." drops the old root.
/// Only this thread's root and cwd change: nothing else lives in this mount namespace.
///
/// `rootfs` is a path in this namespace; errors name `shown` (the rootfs as the host names it).
pub(super) fn pivot_shown(
    sys: &dyn Syscall,
    rootfs: &Path,
    shown: &Path,
) -> Result<(), LaunchError> {
    nix::unistd::chdir(rootfs).map_err(|errno| LaunchError::Chdir {
        path: shown.to_path_buf(),
        errno,
    })?;
    sys.pivot_root(Path::new("."), Path::new("."))
        .map_err(|source| LaunchError::PivotRoot {
            rootfs: shown.to_path_buf(),
            source,
        })?;
    sys.unmount(Path::new("."), true)
        .map_err(|source| LaunchError::DetachOldRoot {
            rootfs: shown.to_path_buf(),
            source,
        })?;
    nix::unistd::chdir("/").map_err(|errno| LaunchError::Chdir {
        path: PathBuf::from("/"),
        errno,
    })
}
