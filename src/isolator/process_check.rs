//! Whether a pid is a container's process: the rules, as pure decisions over what was read of the
//! process, used everywhere the question is asked.
//!
//! [`not_still_the_container`]: is a *recorded* pid still the container's process? The one rule for
//! `update` (before mounting into it), for `run` (before signalling a workload an earlier run left)
//! and, its identity half [`not_the_same_process`], for the OCI hook's reaper (is the init process
//! the checkpoint names gone?). The pid is never 0, 1 or our own; its start time was recorded and is
//! the process's now (else the pid was reused); it is not in our own mount namespace (a container's
//! process never is: mounting "into" it would mount on the host); and, when its mount namespace and
//! root were recorded, it is still in them (`unshare -m` or `chroot` since would make a mount miss
//! the container).
//!
//! [`not_the_container`]: is a pid *offered* as a container's that container's? The rule
//! `isolate_verified` applies before it records the pid that later updates mount into:
//!
//! - It must be readable (its root and mount namespace), and not in the
//!   isolator's own mount namespace: an update would mount on the host.
//! - A container with a rootfs: the process's root is that directory
//!   (device and inode), as the OCI hook checks for the rootfs it mounts in.
//! - Without a rootfs nothing more ties a namespace to one container: the
//!   caller (the containerizer on serve's socket, or `run`) is trusted there.

use crate::launcher::process::MountView;

/// What is known of a pid, read from `/proc` (see [`PidFacts::read`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PidFacts {
    /// Its start time (None: gone).
    pub start: Option<u64>,
    /// Whether it is in our own mount namespace (None: unreadable).
    pub in_our_mount_namespace: Option<bool>,
    /// Its mount namespace and root (None: unreadable).
    pub view: Option<MountView>,
}

impl PidFacts {
    /// Reads what `/proc` says of `pid` now.
    pub fn read(pid: u32) -> Self {
        use crate::launcher::process::{mount_view, process_start_time, shares_mount_namespace};
        PidFacts {
            start: process_start_time(pid),
            in_our_mount_namespace: shares_mount_namespace(pid),
            view: mount_view(pid),
        }
    }
}

/// Where the isolator learns about processes: `/proc` ([`ProcProcesses`]), or a test's double.
pub trait Processes: Send + Sync + std::fmt::Debug {
    /// What is known of `pid` now.
    fn facts(&self, pid: u32) -> PidFacts;
    /// This process's pid.
    fn own_pid(&self) -> u32;
}

/// The processes of this host, read from `/proc`.
#[derive(Clone, Copy, Debug, Default)]
pub struct ProcProcesses;

impl Processes for ProcProcesses {
    fn facts(&self, pid: u32) -> PidFacts {
        PidFacts::read(pid)
    }

    fn own_pid(&self) -> u32 {
        std::process::id()
    }
}

/// Why `pid` is not (or no longer) the process recorded with start time `recorded_start`, or `None`
/// when it still is: never pid 0 or 1, nor our own; a start time was recorded and `start`, the
/// process's now, is that one.
pub fn not_the_same_process(
    pid: u32,
    recorded_start: Option<u64>,
    own_pid: u32,
    start: Option<u64>,
) -> Option<&'static str> {
    if pid <= 1 {
        return Some("pid 0 and 1 are never a container's");
    }
    if pid == own_pid {
        return Some("it is in the agent's own mount namespace: it is this process");
    }
    if i32::try_from(pid).is_err() {
        return Some("it is not a pid");
    }
    let Some(recorded_start) = recorded_start else {
        return Some("no start time was recorded for it");
    };
    match start {
        None => Some("no such process"),
        Some(t) if t != recorded_start => {
            Some("its start time differs: the pid belongs to another process now")
        }
        Some(_) => None,
    }
}

/// Why the recorded `pid` is no longer the container's process (see the module doc), or `None` when
/// it still is: [`not_the_same_process`], then not in our own mount namespace and, when
/// `recorded_view` is known, still in that mount namespace and root.
pub fn not_still_the_container(
    pid: u32,
    recorded_start: Option<u64>,
    recorded_view: Option<MountView>,
    own_pid: u32,
    facts: &PidFacts,
) -> Option<&'static str> {
    if let Some(why) = not_the_same_process(pid, recorded_start, own_pid, facts.start) {
        return Some(why);
    }
    match facts.in_our_mount_namespace {
        Some(false) => {}
        Some(true) => return Some("it is in the agent's own mount namespace: not a container's"),
        None => return Some("its mount namespace cannot be read"),
    }
    if recorded_view.is_some() && facts.view != recorded_view {
        return Some("it has moved to another mount namespace or root since it was isolated");
    }
    None
}

/// What the isolator sees of a process offered to [`VolumeIsolator::isolate_verified`](super::VolumeIsolator::isolate_verified).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Seen {
    /// Its mount namespace and root, if they could be read.
    pub(crate) view: Option<MountView>,
    /// Whether it is in the isolator's own mount namespace, if that could be read.
    pub(crate) shares_our_mount_namespace: Option<bool>,
}

/// Why a process is not the container's , or `None`
/// when it may be: `rootfs` is the (device, inode) of the container's
/// rootfs, if it has one.
pub(crate) fn not_the_container(rootfs: Option<(u64, u64)>, seen: &Seen) -> Option<String> {
    let Some(view) = seen.view else {
        return Some("its root and mount namespace cannot be read (has it exited?)".into());
    };
    match seen.shares_our_mount_namespace {
        Some(true) => {
            return Some(
                "it is in the isolator's own mount namespace, so an update would mount on the host: give the pid of the container's first process".into(),
            )
        }
        None => return Some("its mount namespace cannot be read".into()),
        Some(false) => {}
    }
    match rootfs {
        Some(want) if view.root != want => Some(format!(
            "its root directory (device {}, inode {}) is not the container's rootfs (device {}, inode {}): give the pid of a process running in the container",
            view.root.0, view.root.1, want.0, want.1
        )),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OTHER_NS: (u64, u64) = (4, 4026532000);
    const ROOTFS: (u64, u64) = (2049, 1234);

    fn seen(root: (u64, u64), shares: Option<bool>) -> Seen {
        Seen {
            view: Some(MountView {
                namespace: OTHER_NS,
                root,
            }),
            shares_our_mount_namespace: shares,
        }
    }

    #[test]
    fn isolate_admits_only_the_containers_process() {
        let host_root = (2049, 2);
        let gone = Seen {
            view: None,
            shares_our_mount_namespace: None,
        };
        for (rootfs, seen, refused_for) in [
            // No rootfs: any process outside serve's mount namespace.
            (None, seen(host_root, Some(false)), None),
            (
                None,
                seen(host_root, Some(true)),
                Some("own mount namespace"),
            ),
            (None, seen(host_root, None), Some("cannot be read")),
            (None, gone, Some("cannot be read")),
            // A rootfs: the process's root is that directory.
            (Some(ROOTFS), seen(ROOTFS, Some(false)), None),
            (
                Some(ROOTFS),
                seen(host_root, Some(false)),
                Some("is not the container's rootfs"),
            ),
            (
                Some(ROOTFS),
                seen((2050, 1234), Some(false)),
                Some("is not the container's rootfs"),
            ),
            (
                Some(ROOTFS),
                seen((2049, 1235), Some(false)),
                Some("is not the container's rootfs"),
            ),
            // Chrooted into the rootfs but in serve's namespace: update would mount on the host.
            (
                Some(ROOTFS),
                seen(ROOTFS, Some(true)),
                Some("own mount namespace"),
            ),
            (Some(ROOTFS), gone, Some("cannot be read")),
        ] {
            let got = not_the_container(rootfs, &seen);
            match refused_for {
                None => assert_eq!(got, None, "{rootfs:?} {seen:?}"),
                Some(why) => {
                    let got = got.unwrap_or_else(|| panic!("admitted {rootfs:?} {seen:?}"));
                    assert!(got.contains(why), "{got:?} for {rootfs:?} {seen:?}");
                }
            }
        }
    }

    #[test]
    fn recorded_pid_refusals() {
        let view = MountView {
            namespace: (4, 4026531841),
            root: (2049, 2),
        };
        let other_view = MountView {
            namespace: (4, 4026532000),
            root: (2049, 2),
        };
        let live = PidFacts {
            start: Some(500),
            in_our_mount_namespace: Some(false),
            view: Some(view),
        };
        let with = |f: &dyn Fn(&mut PidFacts)| {
            let mut facts = live;
            f(&mut facts);
            facts
        };
        let own = 4242;
        // (pid, recorded start, recorded view, facts, refused because)
        type Case = (
            u32,
            Option<u64>,
            Option<MountView>,
            PidFacts,
            Option<&'static str>,
        );
        let cases: Vec<Case> = vec![
            (77, Some(500), Some(view), live, None),
            (77, Some(500), None, live, None),
            (77, Some(500), None, with(&|f| f.view = None), None),
            (0, Some(500), Some(view), live, Some("pid 0 and 1")),
            (1, Some(500), Some(view), live, Some("pid 0 and 1")),
            (own, Some(500), Some(view), live, Some("this process")),
            (u32::MAX, Some(500), Some(view), live, Some("not a pid")),
            (77, None, Some(view), live, Some("no start time")),
            (
                77,
                Some(500),
                Some(view),
                with(&|f| f.start = None),
                Some("no such process"),
            ),
            (77, Some(499), Some(view), live, Some("start time differs")),
            (
                77,
                Some(500),
                Some(view),
                with(&|f| f.in_our_mount_namespace = Some(true)),
                Some("own mount namespace"),
            ),
            (
                77,
                Some(500),
                Some(view),
                with(&|f| f.in_our_mount_namespace = None),
                Some("cannot be read"),
            ),
            (
                77,
                Some(500),
                Some(view),
                with(&|f| f.view = Some(other_view)),
                Some("moved to another mount namespace or root"),
            ),
            (
                77,
                Some(500),
                Some(view),
                with(&|f| f.view = None),
                Some("moved to another mount namespace or root"),
            ),
        ];
        for (pid, start, rec_view, facts, refused) in cases {
            let got = not_still_the_container(pid, start, rec_view, own, &facts);
            match (refused, got) {
                (None, None) => {}
                (Some(says), Some(why)) => {
                    assert!(why.contains(says), "pid {pid}: {why:?} vs {says:?}")
                }
                (want, got) => panic!("pid {pid} {facts:?}: expected {want:?}, got {got:?}"),
            }
        }
    }
}
