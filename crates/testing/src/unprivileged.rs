//! Running a step of a test as a real unprivileged user: a forked child drops
//! its groups, gid and uid for good (`setgroups`, `setresgid`, `setresuid`),
//! runs the step, and reports how it went through its exit status.
//!
//! The security tests use it to act as another local user would, against the
//! real kernel: open a file, execute a program, connect to a socket. The step
//! runs in a child forked from a (possibly multi-threaded) test process, so it
//! should stay small: plain syscalls through `std`/`nix`, no locks another
//! thread might hold (no logging, no tokio). The child is bounded in time: it
//! is killed if it has not exited after [`STEP_TIMEOUT`].

use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::{fork, ForkResult, Gid, Uid};

/// `nobody` on Debian.
pub const NOBODY_UID: u32 = 65534;
/// `nogroup` on Debian.
pub const NOGROUP_GID: u32 = 65534;
/// How long a step may take before its child is killed.
pub const STEP_TIMEOUT: Duration = Duration::from_secs(20);

/// How a step went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The step returned `Ok(code)` (0..=127).
    Ok(u8),
    /// The step failed with this errno.
    Failed(Errno),
}

impl Outcome {
    /// The errno, if the step failed.
    pub fn errno(self) -> Option<Errno> {
        match self {
            Outcome::Failed(e) => Some(e),
            Outcome::Ok(_) => None,
        }
    }
}

/// Runs `step` in a forked child as `uid`/`gid` (no supplementary groups)
/// and returns how it went: `Ok(code)` when it returned `Ok(code)` (a code
/// of at most 127), `Failed(errno)` when it returned an error. Panics if the
/// caller is not root, if the child could not drop privileges, or if it did
/// not exit within [`STEP_TIMEOUT`] (it is killed first).
pub fn run_as(uid: u32, gid: u32, step: impl FnOnce() -> Result<u8, Errno>) -> Outcome {
    crate::require_root();
    // SAFETY: the child only makes syscalls and runs `step` (which the module doc asks to stay
    // small), then leaves with `_exit`, never returning into the test harness.
    match unsafe { fork() }.expect("fork") {
        ForkResult::Child => {
            let code = child(uid, gid, step);
            // SAFETY: `_exit` ends the child without running the parent's atexit handlers or
            // destructors, which belong to the parent.
            unsafe { libc::_exit(code) }
        }
        ForkResult::Parent { child } => {
            let start = Instant::now();
            loop {
                match waitpid(child, Some(WaitPidFlag::WNOHANG)) {
                    Ok(WaitStatus::Exited(_, code)) => return decode(code),
                    Ok(WaitStatus::Signaled(_, sig, _)) => {
                        panic!("the step as uid {uid} died of {sig:?}")
                    }
                    Ok(_) => {}
                    Err(Errno::EINTR) => {}
                    Err(e) => panic!("waitpid {child}: {e}"),
                }
                if start.elapsed() > STEP_TIMEOUT {
                    let _ = nix::sys::signal::kill(child, nix::sys::signal::Signal::SIGKILL);
                    let _ = waitpid(child, None);
                    panic!("the step as uid {uid} did not finish within {STEP_TIMEOUT:?}");
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    }
}

/// Runs `step` as `nobody:nogroup`.
pub fn as_nobody(step: impl FnOnce() -> Result<u8, Errno>) -> Outcome {
    run_as(NOBODY_UID, NOGROUP_GID, step)
}

/// Exit codes: 0..=127 the step's own code; 128 + errno (errno < 127) a failed step; 255 the
/// child could not drop privileges.
fn child(uid: u32, gid: u32, step: impl FnOnce() -> Result<u8, Errno>) -> i32 {
    let dropped = nix::unistd::setgroups(&[])
        .and_then(|()| nix::unistd::setresgid(Gid::from(gid), Gid::from(gid), Gid::from(gid)))
        .and_then(|()| nix::unistd::setresuid(Uid::from(uid), Uid::from(uid), Uid::from(uid)));
    if dropped.is_err() || nix::unistd::geteuid().as_raw() != uid {
        return 255;
    }
    match step() {
        Ok(code) => i32::from(code.min(127)),
        Err(e) => 128 + (e as i32).clamp(1, 126),
    }
}

fn decode(code: i32) -> Outcome {
    match code {
        255 => panic!("the child could not drop its privileges"),
        0..=127 => Outcome::Ok(code as u8),
        _ => Outcome::Failed(Errno::from_raw(code - 128)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_runs_as_nobody_and_reports_errno() {
        crate::require_root();
        assert_eq!(
            as_nobody(|| Ok(u8::from(nix::unistd::geteuid().as_raw() == NOBODY_UID))),
            Outcome::Ok(1)
        );
        let dir = tempfile::tempdir().unwrap();
        let secret = dir.path().join("secret");
        std::fs::write(&secret, "x").unwrap();
        std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .unwrap();
        let got = as_nobody(|| {
            std::fs::File::open(&secret)
                .map(|_| 0)
                .map_err(|e| Errno::from_raw(e.raw_os_error().unwrap_or(0)))
        });
        assert_eq!(got, Outcome::Failed(Errno::EACCES));
    }
}

/// What a socket served as `nobody` by [`serve_as_nobody`] saw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Served {
    /// Connections accepted (at most 63).
    pub accepted: u8,
    /// Whether any client sent a byte.
    pub received: bool,
}

/// Listens on `listener` (bound by the caller, as root) as `nobody` for `secs` seconds, so that
/// `SO_PEERCRED` names nobody to every client: each connection is read for up to 300 ms (noting
/// whether the client sent anything), then answered with `reply`. Blocks for `secs`: run it on a
/// thread of its own while the test connects.
pub fn serve_as_nobody(
    listener: std::os::unix::net::UnixListener,
    secs: u64,
    reply: &[u8],
) -> Served {
    use std::io::{Read, Write};
    use std::os::fd::AsRawFd;
    let outcome = as_nobody(move || {
        let errno = |e: std::io::Error| Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO));
        // SAFETY: listen(2) on a socket this process owns.
        if unsafe { libc::listen(listener.as_raw_fd(), 16) } != 0 {
            return Err(Errno::last());
        }
        listener.set_nonblocking(true).map_err(errno)?;
        let deadline = Instant::now() + Duration::from_secs(secs);
        let (mut accepted, mut received) = (0u8, false);
        while Instant::now() < deadline {
            match listener.accept() {
                Ok((mut s, _)) => {
                    accepted = accepted.saturating_add(1).min(63);
                    let _ = s.set_nonblocking(false);
                    let _ = s.set_read_timeout(Some(Duration::from_millis(300)));
                    let mut buf = [0u8; 64];
                    if matches!(s.read(&mut buf), Ok(n) if n > 0) {
                        received = true;
                    }
                    let _ = s.write_all(reply);
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
        Ok(accepted | (u8::from(received) << 6))
    });
    match outcome {
        Outcome::Ok(code) => Served {
            accepted: code & 63,
            received: code & 64 != 0,
        },
        other => panic!("serving as nobody failed: {other:?}"),
    }
}
