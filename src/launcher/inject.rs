//! Mounting into, and unmounting from, a container that is already running (the isolator's `update`).
//!
//! Contract:
//! - [`mount_into`] makes the detached copy of the volume in the caller's (host) namespace: `open_tree`
//!   clone of the source, read-only via `mount_setattr` if asked. The target is resolved by fd through
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
//! - Resolution happens before `setns` on purpose: it reads `/proc/self/fd` of the host's proc, which the
//!   container may not have (or has for another pid namespace).

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use super::setup::{attach, clone_source, resolve_target, Resolve};
use super::{LaunchError, VolumeRef};
use crate::isolator::launch_info::{TargetRoot, VolumeMount};
use crate::mount::{
    self, ns, unmount_with_retry, LinuxSyscall, MountError, Syscall, DEFAULT_ATTEMPTS,
    DEFAULT_DELAY,
};

/// Runs `work` on a fresh thread that first leaves the process's shared fs state and enters the mount
/// namespace `ns_fd` (of process `pid`). The thread ends when `work` returns.
fn in_namespace<T: Send>(
    pid: u32,
    ns_fd: BorrowedFd<'_>,
    work: impl FnOnce(&dyn Syscall) -> Result<T, LaunchError> + Send,
) -> Result<T, LaunchError> {
    std::thread::scope(|scope| {
        let handle = std::thread::Builder::new()
            .name(format!("csi-inject-{pid}"))
            .spawn_scoped(scope, move || {
                let sys = LinuxSyscall::new();
                ns::unshare_fs().map_err(|errno| LaunchError::Unshare {
                    namespace: "fs",
                    errno,
                })?;
                sys.enter_mount_namespace(ns_fd)
                    .map_err(|source| LaunchError::EnterNamespace { pid, source })?;
                work(&sys)
            })
            .map_err(|source| LaunchError::SpawnThread { source })?;
        handle.join().map_err(|_| LaunchError::ThreadPanicked)?
    })
}

fn open_namespace(pid: u32) -> Result<OwnedFd, LaunchError> {
    ns::open_mount_namespace(pid).map_err(|errno| LaunchError::OpenNamespace { pid, errno })
}

/// Mounts `mount` into the running container whose process is `pid` (a host pid). `sandbox_in_container`
/// is the sandbox as the container sees it (`SANDBOX_IN_ROOTFS` with a rootfs, the host sandbox path
/// without one); sandbox targets are resolved inside it, rootfs and host targets inside the container's
/// root.
#[tracing::instrument(skip(mount), fields(volume_id = mount.volume_id.as_deref().unwrap_or("-"), container_path = %mount.container_path))]
pub fn mount_into(
    pid: u32,
    mount: &VolumeMount,
    sandbox_in_container: &Path,
) -> Result<(), LaunchError> {
    let sys = LinuxSyscall::new();
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
    let clone = clone_source(&sys, mount, &at)?;

    let target = match mount.root {
        TargetRoot::Sandbox => {
            // The sandbox first, by fd inside the container's root; then the target by fd inside the sandbox
            // (through /proc/self/fd/N, which names exactly that directory while `sandbox` is open).
            let sandbox =
                mount::open_in_root(&container_root, sandbox_in_container).map_err(|source| {
                    LaunchError::OpenSandbox {
                        pid,
                        sandbox: sandbox_in_container.to_path_buf(),
                        source,
                    }
                })?;
            let root = super::setup::fd_link(sandbox.as_fd());
            resolve_target(mount, &root, Resolve::Create, &at)?
        }
        TargetRoot::Rootfs => resolve_target(mount, &container_root, Resolve::Create, &at)?,
        TargetRoot::Host => resolve_target(mount, &container_root, Resolve::Existing, &at)?,
    };

    let target_fd = target.as_fd();
    in_namespace(pid, ns_fd.as_fd(), |sys| {
        attach(sys, mount, clone, target_fd, &at)
    })?;
    tracing::info!(pid, "volume mounted into running container");
    Ok(())
}

/// Unmounts whatever is mounted at `target_in_container` (the path as the container sees it) in the mount
/// namespace of process `pid`. Nothing mounted there counts as success.
#[tracing::instrument]
pub fn unmount_from(pid: u32, target_in_container: &Path) -> Result<(), LaunchError> {
    let ns_fd = open_namespace(pid)?;
    let target = target_in_container.to_path_buf();
    let outcome = in_namespace(pid, ns_fd.as_fd(), |sys| {
        unmount_with_retry(sys, &target, DEFAULT_ATTEMPTS, DEFAULT_DELAY).map_err(
            |source: MountError| LaunchError::Unmount {
                pid,
                target: target.clone(),
                source,
            },
        )
    })?;
    tracing::info!(pid, ?outcome, "volume unmounted from running container");
    Ok(())
}
