//! Mounting into, and unmounting from, a container that is already running (the isolator's `update`).
//!
//! Contract:
//! - [`mount_into`] makes the detached copy of the volume in the caller's (host) namespace: `open_tree`
//!   clone of the source opened by fd (no symlink followed inside a volume), nosuid,nodev of the host
//!   mount cleared on the copy, read-only via `mount_setattr` if asked. The target is resolved by fd through
//!   `/proc/<pid>/root`, i.e. inside the container's root as that process sees it, in its mount namespace
//!   (the sandbox first, then the target inside the sandbox for sandbox targets), creating missing
//!   directories there (never for host targets). Then a dedicated, short-lived thread does
//!   `unshare(CLONE_FS)` + `setns(/proc/<pid>/ns/mnt)` and `move_mount`s the tree onto the target fd: the
//!   kernel only attaches to mounts of the caller's own namespace. The thread ends right after, so no other
//!   thread of the process ever changes namespace. Processes already running in the container see the
//!   mount on their next path lookup.
//! - [`unmount_from`] unmounts, from such a thread, the path as the container sees it. After `setns` the
//!   thread's root is the container's root, so the path cannot lead out of the container. Busy mounts are
//!   retried, then detached lazily; a path with nothing mounted counts as done.
//! - Every call goes through the [`Syscall`] the caller passes (the isolator's, chosen where the real
//!   kernel is picked), the namespace thread's too ([`ns::in_namespace`]). Both functions block until that
//!   thread is joined: async callers run them with `tokio::task::spawn_blocking`.
//! - Resolution happens before `setns` on purpose: it reads `/proc/self/fd` of the host's proc, which the
//!   container may not have (or has for another pid namespace).

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use super::setup::{attach, clone_source, resolve_target, share_host, Resolve};
use super::{LaunchError, StillMounted, VolumeRef};
use crate::mount::{
    self, ns, MountError, MountTable, ProcMountTable, Syscall, TargetRoot, UnmountOutcome,
    VolumeMount, DEFAULT_ATTEMPTS, DEFAULT_DELAY,
};

/// Runs `work` inside the mount namespace `ns_fd` of process `pid`, on the short-lived thread of
/// [`ns::in_namespace`], through `sys`.
fn in_namespace<T: Send>(
    sys: &dyn Syscall,
    pid: u32,
    ns_fd: BorrowedFd<'_>,
    work: impl FnOnce(&dyn Syscall) -> Result<T, LaunchError> + Send,
) -> Result<T, LaunchError> {
    ns::in_namespace(sys, ns_fd, &format!("csi-inject-{pid}"), work)
        .map_err(|source| LaunchError::EnterNamespace { pid, source })?
}

fn open_namespace(pid: u32) -> Result<OwnedFd, LaunchError> {
    ns::open_mount_namespace(pid).map_err(|errno| LaunchError::OpenNamespace { pid, errno })
}

/// The container's sandbox, by fd inside its root: `/proc/self/fd/N` of it then names exactly that directory
/// while the fd is open.
fn open_sandbox(
    pid: u32,
    container_root: &Path,
    sandbox_in_container: &Path,
) -> Result<OwnedFd, LaunchError> {
    mount::open_in_root(container_root, sandbox_in_container).map_err(|source| {
        LaunchError::OpenSandbox {
            pid,
            sandbox: sandbox_in_container.to_path_buf(),
            source,
        }
    })
}

/// Mounts `mount` into the running container whose process is `pid` (a host pid), through `sys`. `sandbox_in_container`
/// is the sandbox as the container sees it (`SANDBOX_IN_ROOTFS` with a rootfs, the host sandbox path
/// without one); sandbox targets are resolved inside it, rootfs and host targets inside the container's
/// root.
#[tracing::instrument(skip(sys, mount), fields(volume_id = mount.volume_id.as_deref().unwrap_or("-"), container_path = %mount.container_path))]
pub fn mount_into(
    sys: &dyn Syscall,
    pid: u32,
    mount: &VolumeMount,
    sandbox_in_container: &Path,
) -> Result<(), LaunchError> {
    let ns_fd = open_namespace(pid)?;
    let container_root = PathBuf::from(format!("/proc/{pid}/root"));
    let at = VolumeRef::new(
        mount,
        match mount.root {
            TargetRoot::Sandbox => container_root.join(
                sandbox_in_container
                    .strip_prefix("/")
                    .unwrap_or(sandbox_in_container),
            ),
            TargetRoot::Rootfs | TargetRoot::Host => container_root.clone(),
        },
    );
    share_host(sys, mount, &at)?;
    let clone = clone_source(sys, mount, &at)?;
    let is_dir = clone.source_is_dir();

    let target = match mount.root {
        TargetRoot::Sandbox => {
            // The sandbox first, by fd inside the container's root; then the target by fd inside the sandbox.
            let sandbox = open_sandbox(pid, &container_root, sandbox_in_container)?;
            let root = mount::proc_fd_path(sandbox.as_fd());
            resolve_target(mount, is_dir, &root, Resolve::Create, &at)?
        }
        TargetRoot::Rootfs => resolve_target(mount, is_dir, &container_root, Resolve::Create, &at)?,
        TargetRoot::Host => resolve_target(mount, is_dir, &container_root, Resolve::Existing, &at)?,
    };

    let target_fd = target.as_fd();
    in_namespace(sys, pid, ns_fd.as_fd(), |sys| {
        attach(sys, clone, target_fd, &at)
    })?;
    tracing::info!(pid, "volume mounted into running container");
    Ok(())
}

/// Unmounts the volume `mount` from the running container whose process is `pid` (`sandbox_in_container` as
/// for [`mount_into`]). Nothing mounted at the target counts as success.
///
/// The target is found the way [`mount_into`] found it (by fd, inside the container's root, symlinks
/// followed there), down to the directory holding it and the entry's name. The unmount then goes through
/// that directory fd with `UMOUNT_NOFOLLOW` (no path is looked up again, so no symlink swapped in meanwhile
/// can redirect it), and only if the entry is the root of a mount of the volume itself (same device and
/// inode as its source): a mount of something else there is [`LaunchError::NotTheVolume`].
#[tracing::instrument(skip(sys, mount), fields(volume_id = mount.volume_id.as_deref().unwrap_or("-"), container_path = %mount.container_path))]
///
/// A mount point renamed away (from another namespace, where it is not a mount point and so can be
/// renamed) is no longer at the target. So, unless `also_mounted_elsewhere` (the container keeps another
/// mount of the same volume), the container's mount table is searched afterwards for mounts of the
/// volume's source (same device and root); each is unmounted by its table path, resolved inside the
/// container's root without following any symlink. One that keeps moving is
/// [`LaunchError::VolumeStillMounted`].
pub fn unmount_from(
    sys: &dyn Syscall,
    pid: u32,
    mount: &VolumeMount,
    sandbox_in_container: &Path,
    also_mounted_elsewhere: bool,
) -> Result<(), LaunchError> {
    let ns_fd = open_namespace(pid)?;
    let container_root = PathBuf::from(format!("/proc/{pid}/root"));
    // As the workload sees it (`sandbox_in_container` is already the in-container sandbox).
    let shown = mount.container_target(sandbox_in_container, false);
    let unmount_err = |source: MountError| LaunchError::Unmount {
        pid,
        target: shown.clone(),
        source,
    };
    let sandbox;
    let root = match mount.root {
        TargetRoot::Sandbox => {
            sandbox = open_sandbox(pid, &container_root, sandbox_in_container)?;
            mount::proc_fd_path(sandbox.as_fd())
        }
        TargetRoot::Rootfs | TargetRoot::Host => container_root.clone(),
    };
    // The volume's identity, its source opened the way the mount opened it (no symlink followed inside a
    // volume); a source already gone (or refused) leaves only the mount-root check.
    let source_id = mount
        .open_source()
        .ok()
        .and_then(|fd| nix::sys::stat::fstat(&fd).ok())
        .map(|st| (st.st_dev, st.st_ino));
    let (dir, name) = match mount::open_parent_in_root(&root, &mount.target) {
        Ok(found) => found,
        // No directory there: nothing can be mounted on it.
        Err(e) if e.errno() == Some(nix::errno::Errno::ENOENT) => {
            tracing::info!(pid, "volume target gone: nothing to unmount there");
            if !also_mounted_elsewhere {
                sweep_moved(sys, pid, mount, source_id, &container_root, &ns_fd)?;
            }
            return Ok(());
        }
        Err(e) => return Err(unmount_err(e)),
    };

    let outcome = in_namespace(sys, pid, ns_fd.as_fd(), |sys| {
        let found = mount::entry_identity(dir.as_fd(), &name).map_err(|errno| {
            unmount_err(MountError::Unmount {
                target: shown.clone(),
                errno,
            })
        })?;
        let Some(found) = found else {
            return Ok(UnmountOutcome::NotMounted);
        };
        if found.mount_root == Some(false) {
            return Ok(UnmountOutcome::NotMounted);
        }
        if let Some(source) = source_id {
            if (found.dev, found.ino) != source {
                return Err(LaunchError::NotTheVolume {
                    pid,
                    target: shown.clone(),
                    source_path: mount.source.clone(),
                });
            }
        }
        mount::retry_unmount(&shown, DEFAULT_ATTEMPTS, DEFAULT_DELAY, |detach| {
            sys.unmount_at(dir.as_fd(), &name, detach)
        })
        .map_err(unmount_err)
    })?;
    tracing::info!(pid, ?outcome, "volume unmounted from running container");
    if !also_mounted_elsewhere {
        sweep_moved(sys, pid, mount, source_id, &container_root, &ns_fd)?;
    }
    Ok(())
}

/// How many times [`sweep_moved`] reads the container's mount table again. Someone renaming the mount
/// point in a tight loop wins a race now and then (the name read from the table no longer holds the
/// mount when it is looked at); each round is a fresh try, and a round costs one table read.
const SWEEP_ROUNDS: u32 = 50;

/// Unmounts every mount of `mount`'s source left in the container's namespace (see [`unmount_from`]).
/// `source` is the source's (device, inode): an entry is only unmounted when the mount on top of it is
/// the volume's, so a moved mount covered by another one is never mistaken for it. The container's
/// copies of the host's own mounts of the volume (a container without a rootfs starts with a copy of
/// the host's table, at the same paths) are not the container's mounts and are left alone.
fn sweep_moved(
    sys: &dyn Syscall,
    pid: u32,
    mount: &VolumeMount,
    source: Option<(u64, u64)>,
    container_root: &Path,
    ns_fd: &OwnedFd,
) -> Result<(), LaunchError> {
    let read = |table: ProcMountTable| {
        table.mounts().map_err(|source| LaunchError::Unmount {
            pid,
            target: mount.source.clone(),
            source,
        })
    };
    // The volume's own mount on the host: what its copies in the container share (the kernel's name for
    // the source, opened without following a symlink inside a volume).
    let canonical = mount
        .open_source()
        .ok()
        .and_then(|fd| mount::fd_path(fd.as_fd()).ok())
        .unwrap_or_else(|| mount.source.clone());
    let host_table = read(ProcMountTable::new())?;
    let Some(host) = host_table.iter().rev().find(|m| m.mount_point == canonical) else {
        return Ok(());
    };
    let same = |m: &crate::mount::MountInfo| {
        (m.major, m.minor, &m.root) == (host.major, host.minor, &host.root)
    };
    let host_copies: Vec<&Path> = host_table
        .iter()
        .filter(|m| same(m))
        .map(|m| m.mount_point.as_path())
        .collect();
    let mut last_problem = StillMounted::MovedAgain;
    for _round in 0..SWEEP_ROUNDS {
        let left: Vec<PathBuf> = read(ProcMountTable::for_pid(pid))?
            .into_iter()
            .filter(|m| same(m) && !host_copies.contains(&m.mount_point.as_path()))
            .map(|m| m.mount_point)
            .collect();
        if left.is_empty() {
            return Ok(());
        }
        tracing::warn!(
            pid,
            ?left,
            "volume mount moved away inside the container: unmounting it there"
        );
        for path in &left {
            let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
                continue;
            };
            let dir = match mount::open_dir_no_symlinks_in(container_root, parent) {
                Ok(dir) => dir,
                // Moved again, or swapped for a symlink: the next round reads the table again.
                Err(e) => {
                    last_problem = StillMounted::OpenParent {
                        path: path.clone(),
                        source: e,
                    };
                    continue;
                }
            };
            let name = name.to_os_string();
            in_namespace(sys, pid, ns_fd.as_fd(), |sys| {
                let found = mount::entry_identity(dir.as_fd(), &name).ok().flatten();
                let ours = found.is_some_and(|f| {
                    f.mount_root != Some(false) && source.is_none_or(|id| (f.dev, f.ino) == id)
                });
                if !ours {
                    last_problem = StillMounted::NotTheVolume { path: path.clone() };
                    return Ok(());
                }
                mount::retry_unmount(path, DEFAULT_ATTEMPTS, DEFAULT_DELAY, |detach| {
                    sys.unmount_at(dir.as_fd(), &name, detach)
                })
                .map(drop)
                .map_err(|source| LaunchError::Unmount {
                    pid,
                    target: path.clone(),
                    source,
                })
            })?;
        }
    }
    Err(LaunchError::VolumeStillMounted {
        pid,
        source_path: mount.source.clone(),
        last: Box::new(last_problem),
    })
}
