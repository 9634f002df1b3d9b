//! `/proc/self/fd/N`, the one place that names an fd by path.
//!
//! Contract: [`proc_fd_path`] is the magic link path-based calls (mount(2), umount2, the path given to
//! `create_in_root`) use to act on exactly the object an fd holds, whatever happened to its name since;
//! [`fd_path`] reads that link, the kernel's own view of where the object lies, which the resolvers check
//! against their root and the errors show. Every other module takes these from here.

use std::os::fd::{AsRawFd, BorrowedFd};
use std::path::PathBuf;

use super::MountError;

/// `/proc/self/fd/N`: lets path-based calls (mount(2)) act on exactly the object an fd holds.
pub fn proc_fd_path(fd: BorrowedFd<'_>) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()))
}

/// The path the kernel reports for an fd (readlink /proc/self/fd/N), used to check where a mount would land.
pub fn fd_path(fd: BorrowedFd<'_>) -> Result<PathBuf, MountError> {
    nix::fcntl::readlink(&proc_fd_path(fd))
        .map(PathBuf::from)
        .map_err(|errno| MountError::FdPath {
            fd: fd.as_raw_fd(),
            errno,
        })
}
