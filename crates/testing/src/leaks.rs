//! What a [`Sandbox`](super::Sandbox) finds left behind when it is dropped, and how it sweeps it.
//!
//! A leak is anything the test (or the code under test) should have undone by itself: a mount at
//! or below the sandbox, a loop device backed by a file in it, or a process still alive that the
//! test registered with the sandbox or whose command line names the sandbox (a plugin, a `serve`,
//! a `runc` on a bundle in it). The sandbox sweeps every leak, so one leak does not poison later
//! tests, and then fails the test naming each one, unless the test declared it beforehand with
//! [`Sandbox::expect_cleanup_of`](super::Sandbox::expect_cleanup_of).

use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use csi_isolator::mount::{self, LinuxSyscall, MountTable, ProcMountTable};

/// Something a test leaves for the sandbox to clean on purpose (see
/// [`Sandbox::expect_cleanup_of`](super::Sandbox::expect_cleanup_of)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Leftover {
    /// Mounts at or below this path.
    MountsUnder(PathBuf),
    /// Loop devices whose backing file lies at or below this path.
    LoopDevicesUnder(PathBuf),
    /// The process with this pid.
    Process(u32),
}

/// One thing found left behind.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Leak {
    /// A mount point at or below the sandbox, with its file system type and source.
    Mount {
        point: PathBuf,
        fs_type: String,
        source: String,
    },
    /// A loop device and its backing file in the sandbox.
    LoopDevice { device: PathBuf, backing: PathBuf },
    /// A live process and its command line.
    Process { pid: u32, cmdline: String },
}

impl Leak {
    fn excused_by(&self, leftover: &Leftover) -> bool {
        match (self, leftover) {
            (Leak::Mount { point, .. }, Leftover::MountsUnder(dir)) => point.starts_with(dir),
            (Leak::LoopDevice { backing, .. }, Leftover::LoopDevicesUnder(dir)) => {
                backing.starts_with(dir)
            }
            (Leak::Process { pid, .. }, Leftover::Process(p)) => pid == p,
            _ => false,
        }
    }
}

impl fmt::Display for Leak {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Leak::Mount {
                point,
                fs_type,
                source,
            } => write!(f, "mount {} ({fs_type} {source})", point.display()),
            Leak::LoopDevice { device, backing } => write!(
                f,
                "loop device {} backed by {}",
                device.display(),
                backing.display()
            ),
            Leak::Process { pid, cmdline } => write!(f, "process {pid} ({cmdline})"),
        }
    }
}

/// How long processes found alive get to finish exiting by themselves before they count as
/// leaked: a test that signalled its daemon to stop may return while the kernel is still tearing
/// the daemon down, which is not a leak.
const EXIT_GRACE: Duration = Duration::from_millis(500);

/// Loop devices backed by files under `root` once those still attached have had up to `grace`
/// to go: a device that clears itself (`LO_FLAGS_AUTOCLEAR`) is released by the kernel after its
/// last unmount, not always before `umount` returns, and more slowly under load.
pub(crate) fn loop_devices_after_rundown(
    root: &Path,
    grace: Duration,
) -> Result<Vec<(PathBuf, PathBuf)>, csi_isolator::mount::MountError> {
    let deadline = Instant::now() + grace;
    let mut devices = mount::find_backed_under(root);
    while devices.as_ref().is_ok_and(|d| !d.is_empty()) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        devices = mount::find_backed_under(root);
    }
    devices
}

/// Everything left behind under `root`: mounts, loop devices still attached after [`EXIT_GRACE`]
/// (an autoclear device runs down after its last unmount), then processes (`tracked` pids and
/// those whose command line names `root`) still alive after [`EXIT_GRACE`]. Read errors are logged
/// and read as "nothing found" (the sweep still runs).
pub(crate) fn find(root: &Path, tracked: &[u32]) -> Vec<Leak> {
    let mut leaks = Vec::new();
    match ProcMountTable::new().mounts_under(root) {
        Ok(mounts) => leaks.extend(mounts.into_iter().map(|m| Leak::Mount {
            point: m.mount_point,
            fs_type: m.fs_type,
            source: m.source,
        })),
        Err(e) => eprintln!("sandbox {}: read mount table: {e}", root.display()),
    }
    match loop_devices_after_rundown(root, EXIT_GRACE) {
        Ok(devices) => leaks.extend(
            devices
                .into_iter()
                .map(|(device, backing)| Leak::LoopDevice { device, backing }),
        ),
        Err(e) => eprintln!("sandbox {}: list loop devices: {e}", root.display()),
    }
    let deadline = Instant::now() + EXIT_GRACE;
    let mut alive = live_processes(root, tracked);
    while !alive.is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        alive = live_processes(root, tracked);
    }
    leaks.extend(alive);
    leaks
}

/// Kills `pids` (SIGKILL), unmounts everything under `root` (deepest first, lazily as a last
/// resort) and detaches the loop devices backed by files under it. Errors are logged: a sweep
/// never panics, it runs in `Drop`.
pub(crate) fn sweep(root: &Path, pids: &[u32]) {
    for &pid in pids {
        if let Ok(pid) = i32::try_from(pid) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
    }
    // Killed children release their mounts asynchronously; unmount_all_under retries EBUSY and
    // detaches lazily as a last resort, so this always ends.
    if let Err(e) = mount::unmount_all_under(&LinuxSyscall, &ProcMountTable::new(), root) {
        eprintln!("sandbox {}: unmount: {e}", root.display());
    }
    match mount::find_backed_under(root) {
        Ok(devices) => {
            for (device, _) in devices {
                if let Err(e) = mount::detach(&device) {
                    eprintln!(
                        "sandbox {}: detach {}: {e}",
                        root.display(),
                        device.display()
                    );
                }
            }
        }
        Err(e) => eprintln!("sandbox {}: list loop devices: {e}", root.display()),
    }
}

/// The leaks no entry of `expected` excuses.
pub(crate) fn unexpected(leaks: Vec<Leak>, expected: &[(Leftover, &str)]) -> Vec<Leak> {
    leaks
        .into_iter()
        .filter(|leak| !expected.iter().any(|(l, _)| leak.excused_by(l)))
        .collect()
}

/// The message a test fails with: the sandbox and one line per leak.
pub(crate) fn message(root: &Path, leaks: &[Leak]) -> String {
    let mut text = format!(
        "sandbox {} leaked {} thing(s); it cleaned them up, but the test (or the code under test) \
         must, or declare them with Sandbox::expect_cleanup_of:",
        root.display(),
        leaks.len()
    );
    for leak in leaks {
        text.push_str("\n  ");
        text.push_str(&leak.to_string());
    }
    text
}

/// The processes, among `tracked` and those whose command line names `root`, that are alive (not
/// gone and not a zombie: a zombie holds no mount, file or socket any more).
fn live_processes(root: &Path, tracked: &[u32]) -> Vec<Leak> {
    let mut pids: Vec<u32> = tracked.to_vec();
    // A zombie's command line is empty, so it never matches here.
    pids.extend(super::processes_mentioning(root.as_os_str()));
    pids.sort_unstable();
    pids.dedup();
    pids.into_iter()
        .filter(|&pid| is_alive(pid))
        .map(|pid| Leak::Process {
            pid,
            cmdline: cmdline(pid),
        })
        .collect()
}

fn is_alive(pid: u32) -> bool {
    let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // The state follows the command name, which is in parentheses and may itself hold ") ".
    let state = stat
        .rfind(')')
        .and_then(|i| stat[i + 1..].trim_start().chars().next());
    !matches!(state, None | Some('Z') | Some('X'))
}

fn cmdline(pid: u32) -> String {
    let raw = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let text = String::from_utf8_lossy(&raw);
    text.trim_end_matches('\0').replace('\0', " ")
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::CommandExt;
    use std::panic::{catch_unwind, AssertUnwindSafe};
    use std::process::Command;

    use nix::mount::MsFlags;

    use super::super::{require_root, Sandbox};
    use super::*;

    fn mount_tmpfs(dir: &Path) {
        nix::mount::mount(
            Some("tmpfs"),
            dir,
            Some("tmpfs"),
            MsFlags::empty(),
            None::<&str>,
        )
        .unwrap_or_else(|e| panic!("mount tmpfs on {}: {e}", dir.display()));
    }

    /// The panic message of dropping `sb`, or None when the drop did not panic.
    fn drop_message(sb: Sandbox) -> Option<String> {
        let payload = catch_unwind(AssertUnwindSafe(|| drop(sb))).err()?;
        Some(match payload.downcast::<String>() {
            Ok(text) => *text,
            Err(payload) => payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .unwrap_or_default(),
        })
    }

    fn mounted_under(dir: &Path) -> bool {
        !ProcMountTable::new().mounts_under(dir).unwrap().is_empty()
    }

    #[test]
    fn a_leaked_mount_fails_the_test_naming_it_and_is_unmounted() {
        require_root();
        let sb = Sandbox::new("leak-mount");
        let root = sb.path().to_path_buf();
        let dir = sb.mkdir("data");
        mount_tmpfs(&dir);
        let message = drop_message(sb).expect("a leaked mount must fail the test");
        assert!(
            message.contains(&format!("mount {} (tmpfs", dir.display())),
            "{message}"
        );
        assert!(!mounted_under(&root), "the sandbox must still unmount");
        assert!(!root.exists(), "the sandbox must still be removed");
    }

    #[test]
    fn a_leaked_process_fails_the_test_naming_it_and_is_killed() {
        require_root();
        let sb = Sandbox::new("leak-process");
        let mut child = sb
            .spawn(Command::new("sleep").arg("1000"))
            .expect("spawn sleep");
        let message = drop_message(sb).expect("a leaked process must fail the test");
        assert!(
            message.contains(&format!("process {} (sleep 1000)", child.id())),
            "{message}"
        );
        let status = child.wait().expect("reap sleep");
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(
            status.signal(),
            Some(libc::SIGKILL),
            "the sandbox must kill it"
        );
    }

    #[test]
    fn a_process_naming_the_sandbox_is_a_leak_even_untracked() {
        require_root();
        let sb = Sandbox::new("leak-named");
        // The sandbox in its command line, as a plugin or `serve` on a socket in it would have.
        let argv0 = sb.join("sleep");
        let mut child = Command::new("sleep")
            .arg0(&argv0)
            .arg("1000")
            .spawn()
            .expect("spawn sleep");
        // Seen in the process table under its new command line before the sandbox goes (under
        // load, /proc may show the exec a moment late): bounded.
        let seen = (0..500).any(|_| {
            let found = super::super::processes_mentioning(sb.path()).contains(&child.id());
            if !found {
                std::thread::sleep(Duration::from_millis(10));
            }
            found
        });
        if !seen {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the child never showed the sandbox in its command line");
        }
        let message = drop_message(sb).expect("a process naming the sandbox must fail the test");
        assert!(
            message.contains(&format!(
                "process {} ({} 1000)",
                child.id(),
                argv0.display()
            )),
            "{message}"
        );
        let _ = child.wait();
    }

    #[test]
    fn a_declared_leftover_is_cleaned_without_failing() {
        require_root();
        let sb = Sandbox::new("leak-expected");
        let root = sb.path().to_path_buf();
        let dir = sb.mkdir("data");
        mount_tmpfs(&dir);
        sb.expect_cleanup_of(
            Leftover::MountsUnder(dir.clone()),
            "this test checks the sweep",
        );
        assert_eq!(drop_message(sb), None);
        assert!(!mounted_under(&root));
    }

    #[test]
    fn a_clean_sandbox_passes() {
        require_root();
        let sb = Sandbox::new("leak-none");
        let mut child = sb.spawn(&mut Command::new("true")).expect("spawn true");
        child.wait().expect("reap true");
        assert_eq!(drop_message(sb), None, "a reaped child is not a leak");
    }

    #[test]
    fn a_failing_test_keeps_its_own_panic_and_is_still_swept() {
        require_root();
        let sb = Sandbox::new("leak-panicking");
        let root = sb.path().to_path_buf();
        let dir = sb.mkdir("data");
        mount_tmpfs(&dir);
        // A second panic in the drop would abort this process instead of unwinding.
        let payload = catch_unwind(AssertUnwindSafe(move || {
            let _sb = sb;
            panic!("the test failed");
        }))
        .expect_err("the test panics");
        assert_eq!(payload.downcast_ref::<&str>(), Some(&"the test failed"));
        assert!(!mounted_under(&root));
        assert!(!root.exists());
    }
}
