//! Namespace helpers for the launcher and the isolator: per-thread `unshare`, opening another process's mount
//! namespace, the one way to work inside it ([`in_namespace`]), and the one mount a freshly forked child makes
//! (a new `/proc`).
//!
//! Contract:
//! - [`in_namespace`] is the only place a thread enters another process's mount namespace: a
//!   fresh, short-lived thread does `unshare(CLONE_FS)` and `setns` *through the injected
//!   [`Syscall`]* ([`enter`], the one way any thread enters a namespace: the launcher's own thread
//!   also uses it for the process's launch seed, to unshare from it at once), runs the work with
//!   that same seam and ends, so no thread but such dedicated ones ever changes namespace. The seam
//!   keeps no per-thread state ([`super::LinuxSyscall`] is a unit struct; each call acts on the thread that
//!   makes it), so the one shared object serves the namespace thread too. The caller blocks until the thread
//!   is joined: async code calls it from `tokio::task::spawn_blocking`, never on a runtime worker.
//! - The `unshare_*` calls act on the calling *thread* only (mount namespaces and `fs_struct` are per task),
//!   so a dedicated thread can change its namespace while the process's other threads (tokio workers) keep
//!   theirs. [`unshare_mount_namespace`] implies `CLONE_FS` in the kernel, so the thread's root and cwd are
//!   its own from then on.
//! - The `*_raw` functions are async-signal-safe: they take only fds and static strings, allocate nothing,
//!   take no locks and return a bare [`Errno`]. They are what a child may call between `fork` and `exec` in a
//!   multi-threaded parent.

use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};

use super::{MountError, Syscall};

use nix::errno::Errno;
use nix::sched::{unshare, CloneFlags};

/// `unshare(CLONE_NEWNS)` on the calling thread: it gets a private copy of its mount namespace (and its own
/// root/cwd, since the kernel adds `CLONE_FS`).
pub fn unshare_mount_namespace() -> Result<(), Errno> {
    unshare(CloneFlags::CLONE_NEWNS)
}

/// `unshare(CLONE_FS)` on the calling thread: its root and cwd stop being shared with the process's other
/// threads, which `setns(CLONE_NEWNS)` requires.
pub fn unshare_fs() -> Result<(), Errno> {
    unshare(CloneFlags::CLONE_FS)
}

/// `unshare(CLONE_NEWPID)` on the calling thread: the next child it forks is pid 1 of a new pid namespace
/// (the thread itself stays in its own).
pub fn unshare_pid_namespace() -> Result<(), Errno> {
    unshare(CloneFlags::CLONE_NEWPID)
}

/// Runs `work` on a fresh thread named `thread` that first leaves the process's shared fs state
/// (`unshare(CLONE_FS)`, which `setns(CLONE_NEWNS)` requires) and enters the mount namespace `ns_fd`
/// through `sys`; `work` gets the same `sys`. The thread ends when `work` returns; this call blocks until
/// then (see the module doc for async callers). A failure to start, unshare, enter or finish the thread is
/// a [`MountError`] naming the thread; `work`'s own result is returned as it is.
pub fn in_namespace<T: Send>(
    sys: &dyn Syscall,
    ns_fd: BorrowedFd<'_>,
    thread: &str,
    work: impl FnOnce(&dyn Syscall) -> T + Send,
) -> Result<T, MountError> {
    std::thread::scope(|scope| {
        let handle = std::thread::Builder::new()
            .name(thread.to_string())
            .spawn_scoped(scope, move || {
                enter(sys, ns_fd, thread)?;
                Ok(work(sys))
            })
            .map_err(|source| MountError::SpawnNamespaceThread {
                thread: thread.to_string(),
                source,
            })?;
        handle
            .join()
            .map_err(|_| MountError::NamespaceThreadPanicked {
                thread: thread.to_string(),
            })?
    })
}

/// Moves the calling thread (named `thread` in errors) into the mount namespace `ns_fd`:
/// `unshare(CLONE_FS)`, which `setns(CLONE_NEWNS)` requires, then `setns` through `sys`. Only a
/// thread of its own, which ends without going back, may call it ([`in_namespace`], the launcher).
pub fn enter(sys: &dyn Syscall, ns_fd: BorrowedFd<'_>, thread: &str) -> Result<(), MountError> {
    unshare_fs().map_err(|errno| MountError::UnshareFs {
        thread: thread.to_string(),
        errno,
    })?;
    sys.enter_mount_namespace(ns_fd)
}

/// Opens `/proc/<pid>/ns/mnt`, the mount namespace of process `pid` (close-on-exec).
pub fn open_mount_namespace(pid: u32) -> Result<OwnedFd, Errno> {
    let path = format!("/proc/{pid}/ns/mnt");
    nix::fcntl::open(
        path.as_str(),
        nix::fcntl::OFlag::O_RDONLY | nix::fcntl::OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
}

/// `fchdir(dir)`. Async-signal-safe.
pub fn fchdir_raw(dir: BorrowedFd<'_>) -> Result<(), Errno> {
    // SAFETY: fchdir(int fd) only reads the borrowed, open fd.
    let ret = unsafe { libc::fchdir(dir.as_raw_fd()) };
    if ret < 0 {
        Err(Errno::last())
    } else {
        Ok(())
    }
}

/// Mounts a new `proc` instance (nosuid, nodev, noexec) on the directory `dir` refers to, by changing into
/// it and mounting on `"."`, so the target is exactly the object the fd holds. The instance shows the pid
/// namespace the caller lives in. Leaves the caller's cwd at `dir`. Async-signal-safe.
pub fn mount_proc_at_raw(dir: BorrowedFd<'_>) -> Result<(), Errno> {
    fchdir_raw(dir)?;
    let flags = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    // SAFETY: mount(const char *source, const char *target, const char *fstype, unsigned long flags,
    // const void *data): all three strings are static NUL-terminated literals, data is NULL; the kernel keeps
    // none of the pointers.
    let ret = unsafe {
        libc::mount(
            c"proc".as_ptr(),
            c".".as_ptr(),
            c"proc".as_ptr(),
            flags,
            std::ptr::null(),
        )
    };
    if ret < 0 {
        Err(Errno::last())
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_mount_namespace_of_self() {
        let fd = open_mount_namespace(std::process::id()).expect("open own mount namespace");
        let link = crate::mount::fd_path(std::os::fd::AsFd::as_fd(&fd)).expect("fd path");
        assert!(
            link.to_string_lossy().starts_with("mnt:["),
            "unexpected namespace link {}",
            link.display()
        );
    }

    #[test]
    fn open_mount_namespace_of_missing_process() {
        // pid_max is at most 2^22, so this pid never exists.
        assert_eq!(
            open_mount_namespace(u32::MAX - 1).unwrap_err(),
            Errno::ENOENT
        );
    }
}
