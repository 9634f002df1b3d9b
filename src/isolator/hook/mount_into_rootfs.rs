//! The mount into a container's rootfs before its pivot_root, and its undo (see "Mounting before
//! pivot_root" in the module doc of [`super`]).

use super::*;

/// Runs `work` inside the mount namespace `ns_fd` of the container's init process, on the short-lived
/// thread of [`ns::in_namespace`], through `sys`.
fn in_namespace<T: Send>(
    sys: &dyn Syscall,
    ns_fd: BorrowedFd<'_>,
    work: impl FnOnce(&dyn Syscall) -> Result<T, (&'static str, String)> + Send,
) -> Result<T, (&'static str, String)> {
    ns::in_namespace(sys, ns_fd, "csi-oci-hook", work).map_err(|e| {
        (
            "enter the container's mount namespace",
            crate::error_chain::full_message(&e),
        )
    })?
}

/// Mounts `mount` (a rootfs target) into the mount namespace of the container whose init process is `pid`,
/// before its `pivot_root`: at `<rootfs>/<target>` as that namespace sees it, `rootfs` being the
/// canonical host path of the container's rootfs (see the module doc), through `sys`. Blocks until the
/// namespace thread is joined (async callers use `spawn_blocking`). Returns the attached tree's fd,
/// which names the new mount (for a rollback).
pub fn mount_into_rootfs(
    sys: &dyn Syscall,
    container: &str,
    pid: u32,
    rootfs: &Path,
    mount: &VolumeMount,
) -> Result<OwnedFd, HookError> {
    let fail = |step: &'static str, reason: String| HookError::Mount {
        container: container.to_string(),
        volume: volume_name(mount),
        container_path: mount.container_path.clone(),
        step,
        reason,
    };
    if mount.root != TargetRoot::Rootfs {
        return Err(fail(
            "check target",
            "only absolute container paths (inside the rootfs) are supported".to_string(),
        ));
    }
    let ns_fd = ns::open_mount_namespace(pid)
        .map_err(|e| fail("open mount namespace", format!("/proc/{pid}/ns/mnt: {e}")))?;
    // The source first: a missing volume fails before anything is created in the rootfs. The
    // launcher's clone sequence: opened beneath its trusted root by fd (no symlink inside a volume is
    // followed), cloned, host-only flags cleared on the container's copy, read-only if asked.
    let at = crate::launcher::VolumeRef::new(mount, rootfs);
    let clone = crate::launcher::clone_source(sys, mount, &at)
        .map_err(|e| fail("clone source", crate::error_chain::full_message(&e)))?;
    let tree = clone.into_complete_tree().ok_or_else(|| {
        fail(
            "clone source",
            "this kernel lacks open_tree or mount_setattr (Linux 5.12 is needed)".to_string(),
        )
    })?;
    let ns_root = PathBuf::from(format!("/proc/{pid}/root"));
    let rootfs_fd = mount::open_in_root(&ns_root, rootfs).map_err(|e| {
        fail(
            "open the rootfs in the container's mount namespace",
            crate::error_chain::full_message(&e),
        )
    })?;
    let host = std::fs::metadata(rootfs)
        .map_err(|e| fail("stat rootfs", format!("{}: {e}", rootfs.display())))?;
    let seen = nix::sys::stat::fstat(rootfs_fd.as_fd()).map_err(|e| {
        fail(
            "stat rootfs",
            format!("{} in the container: {e}", rootfs.display()),
        )
    })?;
    if seen.st_dev != host.dev() || seen.st_ino != host.ino() {
        return Err(fail(
            "open the rootfs in the container's mount namespace",
            format!(
                "{} there is not the bundle's rootfs (is the hook running before pivot_root?)",
                rootfs.display()
            ),
        ));
    }
    // The kind of what was cloned, from the clone itself: the path string may have changed since.
    let is_file = nix::sys::stat::fstat(tree.as_fd())
        .map(|st| st.st_mode & libc::S_IFMT != libc::S_IFDIR)
        .unwrap_or(false);
    let target = mount::create_in_root(
        &mount::proc_fd_path(rootfs_fd.as_fd()),
        &mount.target,
        is_file,
    )
    .map_err(|e| {
        fail(
            "resolve target in the rootfs",
            crate::error_chain::full_message(&e),
        )
    })?;
    in_namespace(sys, ns_fd.as_fd(), |sys| {
        sys.move_mount_to_fd(tree.as_fd(), target.as_fd())
            .map_err(|e| ("attach", crate::error_chain::full_message(&e)))
    })
    .map_err(|(step, reason)| fail(step, reason))?;
    tracing::debug!(
        volume_id = mount.volume_id.as_deref().unwrap_or("-"),
        container_path = %mount.container_path,
        readonly = mount.readonly,
        "volume mounted into the container's rootfs"
    );
    Ok(tree)
}

/// Detaches the mounts named by `trees` (attached tree fds from [`mount_into_rootfs`]) in the mount
/// namespace of `pid`, last first.
pub(super) fn unmount_in_namespace(
    sys: &dyn Syscall,
    pid: u32,
    trees: &[OwnedFd],
) -> Result<(), String> {
    if trees.is_empty() {
        return Ok(());
    }
    let ns_fd = ns::open_mount_namespace(pid).map_err(|e| format!("/proc/{pid}/ns/mnt: {e}"))?;
    in_namespace(sys, ns_fd.as_fd(), |sys| {
        for tree in trees.iter().rev() {
            sys.unmount(&mount::proc_fd_path(tree.as_fd()), true)
                .map_err(|e| ("unmount", crate::error_chain::full_message(&e)))?;
        }
        Ok(())
    })
    .map_err(|(step, reason)| format!("{step}: {reason}"))
}
