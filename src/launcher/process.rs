//! [`Launched`]: a running workload, waited for either by blocking ([`Launched::wait`], for
//! `spawn_blocking` or plain threads) or asynchronously on a pidfd ([`Launched::wait_async`], inside a tokio
//! runtime).
//!
//! Contract: the workload is our child and stays unreaped until one of the wait calls sees it exit, so its
//! pid cannot be recycled while a [`Launched`] may still signal it; after it is reaped, [`Launched::kill`]
//! refuses. Dropping a [`Launched`] neither kills nor reaps the workload (like `std::process::Child`).

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;

use nix::errno::Errno;
use nix::sys::signal::Signal;
use nix::unistd::Pid;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

use super::LaunchError;

/// `pidfd_open(pid, 0)`: an fd that polls readable once process `pid` has exited (Linux 5.3+).
fn pidfd_open(pid: Pid) -> Result<OwnedFd, Errno> {
    // No pid is 0 or negative: EINVAL, as the kernel answers.
    let pid = rustix::process::Pid::from_raw(pid.as_raw()).ok_or(Errno::EINVAL)?;
    rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty())
        .map_err(|e| Errno::from_raw(e.raw_os_error()))
}

/// A workload started by [`super::launch`].
#[derive(Debug)]
pub struct Launched {
    pid: Pid,
    pidfd: Option<OwnedFd>,
    status: Option<ExitStatus>,
}

impl Launched {
    /// Wraps our unreaped child `pid`.
    pub(crate) fn new(pid: Pid) -> Launched {
        // Without pidfd (old kernels) wait_async falls back to polling.
        let pidfd = pidfd_open(pid).ok();
        Launched {
            pid,
            pidfd,
            status: None,
        }
    }

    /// The workload's pid, in the launcher's pid namespace (with `pid_namespace` it is 1 inside).
    pub fn pid(&self) -> u32 {
        self.pid.as_raw() as u32
    }

    /// The exit status, if the workload was already reaped.
    pub fn status(&self) -> Option<ExitStatus> {
        self.status
    }

    fn waitpid(&mut self, options: libc::c_int) -> Result<Option<ExitStatus>, LaunchError> {
        if let Some(status) = self.status {
            return Ok(Some(status));
        }
        loop {
            let mut raw: libc::c_int = 0;
            // SAFETY: waitpid(pid, int *status, options): `raw` is a live, writable int.
            let ret = unsafe { libc::waitpid(self.pid.as_raw(), &mut raw, options) };
            if ret == self.pid.as_raw() {
                let status = ExitStatus::from_raw(raw);
                self.status = Some(status);
                return Ok(Some(status));
            }
            if ret == 0 {
                return Ok(None);
            }
            match Errno::last() {
                Errno::EINTR => continue,
                errno => {
                    return Err(LaunchError::Wait {
                        pid: self.pid(),
                        errno,
                    })
                }
            }
        }
    }

    /// Blocks until the workload exits and returns its status (`code()` for an exit, `signal()` for a
    /// kill). In async code call it through `tokio::task::spawn_blocking`, or use [`Launched::wait_async`].
    pub fn wait(&mut self) -> Result<ExitStatus, LaunchError> {
        Ok(self
            .waitpid(0)?
            .expect("waitpid without WNOHANG returns a status"))
    }

    /// The status if the workload has exited, without blocking.
    pub fn try_wait(&mut self) -> Result<Option<ExitStatus>, LaunchError> {
        self.waitpid(libc::WNOHANG)
    }

    /// Waits for the workload without blocking a runtime thread: the pidfd is registered with tokio's
    /// reactor (must be called inside a tokio runtime). Polls every 20 ms on kernels without pidfd.
    pub async fn wait_async(&mut self) -> Result<ExitStatus, LaunchError> {
        loop {
            if let Some(status) = self.try_wait()? {
                return Ok(status);
            }
            let registered = self
                .pidfd
                .as_ref()
                .and_then(|fd| fd.try_clone().ok())
                .and_then(|fd| {
                    // SAFETY: the AsyncFd owns this OwnedFd (a dup of our pidfd), so the fd stays open and
                    // names the same pidfd until the AsyncFd, and the registration with it, is dropped.
                    unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }.ok()
                });
            match registered {
                Some(pidfd) => {
                    let mut guard = pidfd.readable().await.map_err(|e| LaunchError::Wait {
                        pid: self.pid(),
                        errno: Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO)),
                    })?;
                    guard.retain_ready();
                    // The pidfd is readable once the process has exited: reap it now.
                    if let Some(status) = self.try_wait()? {
                        return Ok(status);
                    }
                    tracing::debug!(
                        pid = self.pid(),
                        fd = pidfd.get_ref().as_raw_fd(),
                        "pidfd readable before exit status"
                    );
                }
                None => tokio::time::sleep(std::time::Duration::from_millis(20)).await,
            }
        }
    }

    /// Sends `signal` to the workload. Refused once it has been reaped (its pid may be someone else's by
    /// then). Note that pid 1 of a pid namespace only receives, from here, SIGKILL, SIGSTOP and signals it
    /// installed a handler for.
    pub fn kill(&self, signal: Signal) -> Result<(), LaunchError> {
        if self.status.is_some() {
            return Err(LaunchError::Reaped { pid: self.pid() });
        }
        nix::sys::signal::kill(self.pid, signal).map_err(|errno| LaunchError::Kill {
            pid: self.pid(),
            signal,
            errno,
        })
    }
}

/// The start time of process `pid` (field 22 of `/proc/<pid>/stat`, in clock
/// ticks since boot), which with the pid identifies a process across pid
/// reuse. `None` when the process does not exist.
pub fn process_start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may contain spaces:
    // count fields after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Whether process `pid` is in the caller's own mount namespace.
pub fn shares_mount_namespace(pid: u32) -> Option<bool> {
    use std::os::unix::fs::MetadataExt;
    let theirs = std::fs::metadata(format!("/proc/{pid}/ns/mnt")).ok()?;
    let ours = std::fs::metadata("/proc/self/ns/mnt").ok()?;
    Some(theirs.ino() == ours.ino() && theirs.dev() == ours.dev())
}

#[cfg(test)]
mod identity_tests {
    use super::*;

    #[test]
    fn start_time_of_self_is_stable_and_of_a_missing_pid_is_none() {
        let me = std::process::id();
        let t = process_start_time(me).unwrap();
        assert_eq!(process_start_time(me), Some(t));
        assert_eq!(process_start_time(u32::MAX - 1), None);
        assert_eq!(shares_mount_namespace(me), Some(true));
    }
}

/// Who process `pid`'s mount namespace and root are: (device, inode) of `/proc/<pid>/ns/mnt` and of
/// `/proc/<pid>/root`. Recorded when a container is isolated, so that a later `update` can tell that
/// its process has since moved to another mount namespace or root (`unshare -m`, `chroot`), where
/// mounting or unmounting would not reach the container's processes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MountView {
    /// (st_dev, st_ino) of the mount namespace.
    pub namespace: (u64, u64),
    /// (st_dev, st_ino) of the root directory.
    pub root: (u64, u64),
}

/// The [`MountView`] of `pid`, if its /proc entries can be read.
pub fn mount_view(pid: u32) -> Option<MountView> {
    use std::os::unix::fs::MetadataExt;
    let ns = std::fs::metadata(format!("/proc/{pid}/ns/mnt")).ok()?;
    let root = std::fs::metadata(format!("/proc/{pid}/root")).ok()?;
    Some(MountView {
        namespace: (ns.dev(), ns.ino()),
        root: (root.dev(), root.ino()),
    })
}

/// A pidfd for any process `pid` (not only our child): whatever is later done through it reaches that
/// process, or fails with ESRCH once it has exited, never a process that reused the pid. Open it
/// *before* checking who `pid` is (start time, namespaces), so the checks and the signal concern the
/// same process.
pub fn open_pidfd(pid: u32) -> Result<OwnedFd, Errno> {
    let raw = i32::try_from(pid).map_err(|_| Errno::ESRCH)?;
    pidfd_open(Pid::from_raw(raw))
}

/// `pidfd_send_signal(pidfd, signal, NULL, 0)`: signals the process the pidfd names (ESRCH once it
/// has exited).
pub fn pidfd_send_signal(pidfd: std::os::fd::BorrowedFd<'_>, signal: Signal) -> Result<(), Errno> {
    // SAFETY: pidfd_send_signal(int pidfd, int sig, siginfo_t *info, unsigned flags): the fd is
    // borrowed for the call, a NULL info means "as kill(2) would", and no flags are defined; the
    // kernel reads nothing else.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            signal as libc::c_int,
            std::ptr::null::<libc::siginfo_t>(),
            0u32,
        )
    };
    if ret < 0 {
        return Err(Errno::last());
    }
    Ok(())
}

/// Whether the process a pidfd names has exited (the pidfd polls readable then), waiting at most
/// `timeout_ms` milliseconds.
pub fn pidfd_exited(pidfd: std::os::fd::BorrowedFd<'_>, timeout_ms: u16) -> bool {
    let mut fd = libc::pollfd {
        fd: pidfd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: poll(struct pollfd *fds, nfds_t nfds, int timeout): `fd` is one live, writable pollfd
    // for the duration of the call, and the fd in it is borrowed, so open.
    let ret = unsafe { libc::poll(&mut fd, 1, libc::c_int::from(timeout_ms)) };
    ret > 0
}
