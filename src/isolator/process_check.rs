//! Whether a process offered as a container's is that container's: the rule
//! `isolate_verified` applies before it records the pid that later updates
//! mount into. A pure decision over what was read of the process.
//!
//! - It must be readable (its root and mount namespace), and not in the
//!   isolator's own mount namespace: an update would mount on the host.
//! - A container with a rootfs: the process's root is that directory
//!   (device and inode), as the OCI hook checks for the rootfs it mounts in.
//! - Without a rootfs nothing more ties a namespace to one container: the
//!   caller (the containerizer on serve's socket, or `run`) is trusted there.

use crate::launcher::process::MountView;

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
}
