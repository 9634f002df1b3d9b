//! The mount into a container's rootfs before its pivot_root, and its undo (see "Mounting before
//! pivot_root" in the module doc of [`super`]).

use super::*;

/// A step of the mount into a container's rootfs before its pivot_root (or of its undo) failed: the
/// variant is the step and names its object; the cause, where there is one, is its source.
#[derive(Debug, thiserror::Error)]
pub enum RootfsMountError {
    /// The target is not inside the rootfs (a relative or host path).
    #[error("check target: only absolute container paths (inside the rootfs) are supported")]
    NotInRootfs,
    /// `/proc/<pid>/ns/mnt` could not be opened.
    #[error("open mount namespace /proc/{pid}/ns/mnt")]
    OpenNamespace {
        /// The container's init process.
        pid: u32,
        /// The kernel's answer.
        #[source]
        errno: nix::errno::Errno,
    },
    /// The volume could not be cloned as a detached tree.
    #[error("clone source")]
    CloneSource(#[source] Box<crate::launcher::LaunchError>),
    /// The kernel cannot complete a detached tree (no `open_tree` or `mount_setattr`).
    #[error("clone source: this kernel lacks open_tree or mount_setattr (Linux 5.12 is needed)")]
    NoMountApi,
    /// The rootfs could not be opened in the container's view.
    #[error("open the rootfs in the container's mount namespace")]
    OpenRootfs(#[source] crate::mount::MountError),
    /// The rootfs opened in the container's view is not the bundle's.
    #[error("open the rootfs in the container's mount namespace: {} there is not the bundle's rootfs (is the hook running before pivot_root?)", rootfs.display())]
    NotTheRootfs {
        /// The rootfs's host path.
        rootfs: PathBuf,
    },
    /// The rootfs could not be looked at on the host.
    #[error("stat rootfs {}", rootfs.display())]
    StatRootfs {
        /// The rootfs's host path.
        rootfs: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The rootfs could not be looked at in the container's view.
    #[error("stat rootfs {} in the container", rootfs.display())]
    StatRootfsInContainer {
        /// The rootfs's host path.
        rootfs: PathBuf,
        /// The kernel's answer.
        #[source]
        errno: nix::errno::Errno,
    },
    /// The target could not be resolved (or created) inside the rootfs.
    #[error("resolve target in the rootfs")]
    ResolveTarget(#[source] crate::mount::MountError),
    /// The thread could not enter the container's mount namespace.
    #[error("enter the container's mount namespace")]
    EnterNamespace(#[source] crate::mount::MountError),
    /// `move_mount` of the tree onto the target failed.
    #[error("attach")]
    Attach(#[source] crate::mount::MountError),
    /// The attached copy could not be given its propagation.
    #[error("set propagation")]
    Propagation(#[source] Box<crate::launcher::LaunchError>),
    /// Detaching an attached tree failed.
    #[error("unmount")]
    Unmount(#[source] crate::mount::MountError),
    /// The blocking task doing the step failed (panicked, or the runtime is shutting down).
    #[error("{step}: the blocking task failed")]
    Task {
        /// The step it was doing.
        step: &'static str,
        /// The join error.
        #[source]
        source: tokio::task::JoinError,
    },
}

/// Runs `work` inside the mount namespace `ns_fd` of the container's init process, on the short-lived
/// thread of [`ns::in_namespace`], through `sys`.
fn in_namespace<T: Send>(
    sys: &dyn Syscall,
    ns_fd: BorrowedFd<'_>,
    work: impl FnOnce(&dyn Syscall) -> Result<T, RootfsMountError> + Send,
) -> Result<T, RootfsMountError> {
    ns::in_namespace(sys, ns_fd, "csi-oci-hook", work).map_err(RootfsMountError::EnterNamespace)?
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
    attach_in_rootfs(sys, pid, rootfs, mount).map_err(|e| mount_error(container, mount, e))
}

/// The hook's error for a step of the mount of `mount` into `container` that failed.
pub(super) fn mount_error(
    container: &str,
    mount: &VolumeMount,
    source: RootfsMountError,
) -> HookError {
    HookError::Mount {
        container: container.to_string(),
        volume: volume_name(mount),
        container_path: mount.container_path.clone(),
        source: Box::new(source),
    }
}

/// [`mount_into_rootfs`], failing with the step.
fn attach_in_rootfs(
    sys: &dyn Syscall,
    pid: u32,
    rootfs: &Path,
    mount: &VolumeMount,
) -> Result<OwnedFd, RootfsMountError> {
    if mount.root != TargetRoot::Rootfs {
        return Err(RootfsMountError::NotInRootfs);
    }
    let ns_fd = ns::open_mount_namespace(pid)
        .map_err(|errno| RootfsMountError::OpenNamespace { pid, errno })?;
    // The source first: a missing volume fails before anything is created in the rootfs. The
    // launcher's clone sequence: opened beneath its trusted root by fd (no symlink inside a volume is
    // followed), cloned, host-only flags cleared on the container's copy, read-only if asked.
    let at = crate::launcher::VolumeRef::new(mount, rootfs);
    crate::launcher::share_host(sys, mount, &at)
        .map_err(|e| RootfsMountError::CloneSource(Box::new(e)))?;
    let clone = crate::launcher::clone_source(sys, mount, &at)
        .map_err(|e| RootfsMountError::CloneSource(Box::new(e)))?;
    let propagation = clone.propagation();
    let tree = clone
        .into_complete_tree()
        .ok_or(RootfsMountError::NoMountApi)?;
    let ns_root = PathBuf::from(format!("/proc/{pid}/root"));
    let rootfs_fd = mount::open_in_root(&ns_root, rootfs).map_err(RootfsMountError::OpenRootfs)?;
    let host = std::fs::metadata(rootfs).map_err(|source| RootfsMountError::StatRootfs {
        rootfs: rootfs.to_path_buf(),
        source,
    })?;
    let seen = nix::sys::stat::fstat(rootfs_fd.as_fd()).map_err(|errno| {
        RootfsMountError::StatRootfsInContainer {
            rootfs: rootfs.to_path_buf(),
            errno,
        }
    })?;
    if seen.st_dev != host.dev() || seen.st_ino != host.ino() {
        return Err(RootfsMountError::NotTheRootfs {
            rootfs: rootfs.to_path_buf(),
        });
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
    .map_err(RootfsMountError::ResolveTarget)?;
    in_namespace(sys, ns_fd.as_fd(), |sys| {
        sys.move_mount_to_fd(tree.as_fd(), target.as_fd())
            .map_err(RootfsMountError::Attach)?;
        // In the container's namespace, where the copy now lives (see VolumePropagation).
        crate::launcher::set_propagation_of(sys, tree.as_fd(), propagation, &at)
            .map_err(|e| RootfsMountError::Propagation(Box::new(e)))
    })?;
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
) -> Result<(), RootfsMountError> {
    if trees.is_empty() {
        return Ok(());
    }
    let ns_fd = ns::open_mount_namespace(pid)
        .map_err(|errno| RootfsMountError::OpenNamespace { pid, errno })?;
    in_namespace(sys, ns_fd.as_fd(), |sys| {
        for tree in trees.iter().rev() {
            sys.unmount(&mount::proc_fd_path(tree.as_fd()), true)
                .map_err(RootfsMountError::Unmount)?;
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error_chain::full_message;
    use nix::errno::Errno;

    fn volume(root: TargetRoot) -> VolumeMount {
        VolumeMount {
            source: PathBuf::from("/w/mounts/vol-1"),
            source_root: None,
            root,
            target: PathBuf::from("data"),
            container_path: "/data".to_string(),
            readonly: false,
            volume_id: Some("vol-1".to_string()),
            provider_id: None,
            block: false,
            propagation: Default::default(),
            hardening: Default::default(),
        }
    }

    /// The hook's error names the container, the volume and the target; the step's own text follows
    /// once, then its cause once (the chain walker's part).
    #[test]
    fn a_failed_step_is_named_once_and_its_cause_follows() {
        let m = volume(TargetRoot::Rootfs);
        let head = "container 'c1': mount volume vol-1 at /data";
        let cases = [
            (
                RootfsMountError::OpenNamespace {
                    pid: 42,
                    errno: Errno::ESRCH,
                },
                format!("open mount namespace /proc/42/ns/mnt: {}", Errno::ESRCH),
            ),
            (
                RootfsMountError::Attach(crate::mount::MountError::MoveMount {
                    from: 3,
                    to: 4,
                    errno: Errno::EINVAL,
                }),
                format!("attach: move_mount fd 3 onto fd 4: {}", Errno::EINVAL),
            ),
            (
                RootfsMountError::StatRootfsInContainer {
                    rootfs: PathBuf::from("/b/rootfs"),
                    errno: Errno::EACCES,
                },
                format!("stat rootfs /b/rootfs in the container: {}", Errno::EACCES),
            ),
            (
                RootfsMountError::NotTheRootfs {
                    rootfs: PathBuf::from("/b/rootfs"),
                },
                "open the rootfs in the container's mount namespace: /b/rootfs there is not the \
                 bundle's rootfs (is the hook running before pivot_root?)"
                    .to_string(),
            ),
        ];
        for (step, want) in cases {
            let e = mount_error("c1", &m, step);
            assert_eq!(full_message(&e), format!("{head}: {want}"));
        }
    }

    /// A target outside the rootfs is refused before any syscall, as the hook's mount error.
    #[test]
    fn a_target_outside_the_rootfs_is_refused_before_any_syscall() {
        let sys = crate::mount::FakeSyscall::new();
        let e = mount_into_rootfs(
            &sys,
            "c1",
            1,
            Path::new("/b/rootfs"),
            &volume(TargetRoot::Sandbox),
        )
        .unwrap_err();
        assert!(
            matches!(&e, HookError::Mount { source, .. } if matches!(**source, RootfsMountError::NotInRootfs)),
            "{e:?}"
        );
        assert_eq!(
            full_message(&e),
            "container 'c1': mount volume vol-1 at /data: check target: only absolute container \
             paths (inside the rootfs) are supported"
        );
        assert!(sys.calls().is_empty());
    }
}
