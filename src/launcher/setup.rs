//! The launcher thread: builds the container's mount namespace on a dedicated thread, then starts the
//! workload from that thread (see the module doc of [`super`] for why).

use std::ffi::OsString;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::unistd::Pid;

use super::exec::{self, ChildPlan, ExecPlan, REPORT_LEN};
use super::root::{open_dir, open_path, pivot_shown};
use super::{seed, LaunchError, LaunchSpec, Launched, VolumeRef};
use crate::mount::{
    self, ns, Hardening, MountError, MountFlags, Propagation, Syscall, TargetRoot, VolumeMount,
    VolumePropagation, SANDBOX_IN_ROOTFS,
};

/// How a volume's target is found inside its root.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Resolve {
    /// Create missing directories (or the final file) inside the root.
    Create,
    /// The target must exist (host targets: nothing is created on the host).
    Existing,
}

/// A detached copy of a volume's source tree, read-only already if asked and the kernel can do it early.
pub struct DetachedTree {
    tree: Option<OwnedFd>,
    /// The source, resolved by fd ([`VolumeMount::open_source`]): what the bind fallback mounts.
    source: OwnedFd,
    /// Whether the source is a directory (the target must then be one).
    source_is_dir: bool,
    readonly_pending: bool,
    /// The copy's flags are still to be changed on the attached mount: the host-only flags (nosuid,
    /// nodev) cleared but what the volume asks, its hardening flags set.
    clear_pending: bool,
    /// The hardening flags the volume asks for ([`VolumeMount::hardening`]).
    hardening: Hardening,
    /// The propagation the attached copy is given.
    propagation: VolumePropagation,
}

impl DetachedTree {
    /// Whether the source is a directory (the target must then be one).
    pub fn source_is_dir(&self) -> bool {
        self.source_is_dir
    }

    /// The propagation the attached copy is to be given ([`set_propagation`] does it).
    pub fn propagation(&self) -> VolumePropagation {
        self.propagation
    }

    /// The detached tree, complete (host-only flags cleared, read-only if asked), for a caller that
    /// attaches it with `move_mount` alone and keeps its fd (the OCI hook, which unmounts through it
    /// on rollback); `None` on a kernel that left work for [`attach`]'s fallbacks (no `open_tree` or
    /// no `mount_setattr`: before Linux 5.12).
    pub fn into_complete_tree(self) -> Option<OwnedFd> {
        match self.tree {
            Some(tree) if !self.readonly_pending && !self.clear_pending => Some(tree),
            _ => None,
        }
    }
}

/// Step 1 of a mount, in the namespace the source lives in (the one clone-for-container sequence: the
/// launcher, `update`'s mounts into a running container and the OCI hook all use it): the source opened by fd beneath its trusted root
/// (no symlink followed inside a volume), `open_tree(fd, OPEN_TREE_CLONE | AT_EMPTY_PATH | AT_RECURSIVE)`,
/// the host-only flags (nosuid, nodev) cleared on the copy but those the volume asks for, its hardening
/// flags ([`VolumeMount::hardening`]) set, and, for read-only mounts,
/// `mount_setattr(MOUNT_ATTR_RDONLY, AT_RECURSIVE)` on the detached tree. On kernels without the new mount
/// API (ENOSYS) the tree is left to the bind fallback of [`attach`], which binds the resolved fd.
pub fn clone_source(
    sys: &dyn Syscall,
    mount: &VolumeMount,
    at: &VolumeRef,
) -> Result<DetachedTree, LaunchError> {
    let clone_err = |source| LaunchError::CloneSource {
        at: Box::new(at.clone()),
        source_path: mount.source.clone(),
        source,
    };
    // The source first: a missing or symlinked one fails before anything is created.
    let source = mount.open_source().map_err(clone_err)?;
    let source_kind = nix::sys::stat::fstat(&source)
        .map(|st| {
            nix::sys::stat::SFlag::from_bits_truncate(st.st_mode) & nix::sys::stat::SFlag::S_IFMT
        })
        .unwrap_or(nix::sys::stat::SFlag::S_IFDIR);
    if let Some(what) = source_refusal(mount.block, source_kind) {
        return Err(LaunchError::SourceKindMismatch {
            at: Box::new(at.clone()),
            what,
        });
    }
    let source_is_dir = source_kind == nix::sys::stat::SFlag::S_IFDIR;
    let tree = match sys.open_tree_clone_fd(source.as_fd(), true) {
        Ok(tree) => tree,
        Err(e) if e.errno() == Some(Errno::ENOSYS) => {
            return Ok(DetachedTree {
                tree: None,
                source,
                source_is_dir,
                readonly_pending: mount.readonly,
                clear_pending: true,
                hardening: mount.hardening,
                propagation: mount.propagation,
            });
        }
        Err(e) => return Err(clone_err(e)),
    };
    // Only the copy's own mount: a mount below it keeps whatever flags it has. The host-only flags
    // go, but those the volume asks for, which are set whatever the plugin's mount has.
    let clear_pending = match sys.change_mount_flags(
        tree.as_fd(),
        mount.hardening.flags(),
        mount.hardening.cleared_on_copy(),
        false,
    ) {
        Ok(()) => false,
        // open_tree without mount_setattr (5.2 to 5.11): remount after attaching.
        Err(e) if e.errno() == Some(Errno::ENOSYS) => true,
        Err(e) => return Err(clone_err(e)),
    };
    let mut readonly_pending = false;
    if mount.readonly {
        match sys.set_readonly_by_fd(tree.as_fd(), true) {
            Ok(()) => {}
            Err(e) if e.errno() == Some(Errno::ENOSYS) => readonly_pending = true,
            Err(source) => {
                return Err(LaunchError::SetReadonly {
                    at: Box::new(at.clone()),
                    source,
                })
            }
        }
    }
    Ok(DetachedTree {
        tree: Some(tree),
        source,
        source_is_dir,
        readonly_pending,
        clear_pending,
        hardening: mount.hardening,
        propagation: mount.propagation,
    })
}

/// Before a volume asked with rslave or rshared propagation is cloned for a container, in the host's
/// mount namespace: its host mount point is made shared ([`VolumeMount::share_host_mount_point`]), so
/// that a clone joins its peer group (and can stay a peer, or be made its slave). Nothing for private.
pub fn share_host(
    sys: &dyn Syscall,
    mount: &VolumeMount,
    at: &VolumeRef,
) -> Result<(), LaunchError> {
    mount
        .share_host_mount_point(sys)
        .map_err(|source| LaunchError::ShareHostMountPoint {
            at: Box::new(at.clone()),
            source,
        })
}

/// [`set_propagation`] through the attached tree's fd (`mount_setattr`, no path: from a thread in
/// another namespace, `/proc/self` may name nothing), by its `/proc/self/fd` path before Linux 5.12.
pub fn set_propagation_of(
    sys: &dyn Syscall,
    tree: BorrowedFd<'_>,
    propagation: VolumePropagation,
    at: &VolumeRef,
) -> Result<(), LaunchError> {
    propagate_by_fd(sys, tree, propagation.kernel()).map_err(|source| LaunchError::SetPropagation {
        at: Box::new(at.clone()),
        propagation: propagation.as_str(),
        source,
    })
}

/// The attached tree `tree` given `propagation`, recursively: through its fd (`mount_setattr`), by
/// its `/proc/self/fd` path before Linux 5.12.
fn propagate_by_fd(
    sys: &dyn Syscall,
    tree: BorrowedFd<'_>,
    propagation: Propagation,
) -> Result<(), MountError> {
    match sys.set_propagation_by_fd(tree, propagation, true) {
        Err(e) if e.errno() == Some(Errno::ENOSYS) => {
            sys.set_propagation(&mount::proc_fd_path(tree), propagation, true)
        }
        other => other,
    }
}

/// Gives the attached copy rooted at `top` (a path naming the new mount's root, `/proc/self/fd/N`) its
/// propagation, recursively, in the namespace it was attached in: private (no events either way, even
/// when the host mount point is shared), slave (events from the host's peer group only) or shared (left
/// in the host's peer group: both ways).
pub fn set_propagation(
    sys: &dyn Syscall,
    top: &Path,
    propagation: VolumePropagation,
    at: &VolumeRef,
) -> Result<(), LaunchError> {
    sys.set_propagation(top, propagation.kernel(), true)
        .map_err(|source| LaunchError::SetPropagation {
            at: Box::new(at.clone()),
            propagation: propagation.as_str(),
            source,
        })
}

/// The canonical rootfs: symlinks resolved once; the host's own root is refused (a container "rootfs" that
/// is `/` would put the workload, and its volume mounts, on the host's whole tree).
pub(super) fn resolve_rootfs(rootfs: &Path) -> Result<PathBuf, LaunchError> {
    let canonical = std::fs::canonicalize(rootfs).map_err(|e| LaunchError::BindRootfs {
        rootfs: rootfs.to_path_buf(),
        source: MountError::Resolve {
            step: "canonicalize rootfs",
            root: rootfs.to_path_buf(),
            path: PathBuf::new(),
            errno: Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO)),
        },
    })?;
    if !canonical.is_dir() || canonical == Path::new("/") {
        return Err(LaunchError::BadRootfs {
            rootfs: rootfs.to_path_buf(),
            resolved: canonical,
        });
    }
    Ok(canonical)
}

/// Step 2: the target, resolved by fd inside `root` (created there if asked). A directory volume needs a
/// directory there: a FIFO, device node, socket or file (a hard link to anything included) is refused by
/// name before anything is mounted.
pub(crate) fn resolve_target(
    mount: &VolumeMount,
    source_is_dir: bool,
    root: &Path,
    how: Resolve,
    at: &VolumeRef,
) -> Result<OwnedFd, LaunchError> {
    let err = |source| LaunchError::ResolveTarget {
        at: Box::new(at.clone()),
        source,
    };
    // The two a user causes by the container path get their own words.
    let fd = match how {
        Resolve::Create => mount::create_in_root(root, &mount.target, !source_is_dir),
        Resolve::Existing => mount::open_in_root(root, &mount.target),
    }
    .map_err(|source: MountError| match (source.errno(), how) {
        (Some(Errno::ENOENT), Resolve::Existing) => LaunchError::TargetMissingOnHost {
            at: Box::new(at.clone()),
        },
        (Some(Errno::EROFS), Resolve::Create) => LaunchError::TargetParentReadOnly {
            at: Box::new(at.clone()),
            source,
        },
        _ => err(source),
    })?;
    let st = nix::sys::stat::fstat(&fd).map_err(|errno| {
        err(MountError::Resolve {
            step: "fstat target",
            root: root.to_path_buf(),
            path: mount.target.clone(),
            errno,
        })
    })?;
    let kind =
        nix::sys::stat::SFlag::from_bits_truncate(st.st_mode) & nix::sys::stat::SFlag::S_IFMT;
    match target_refusal(source_is_dir, mount.block, kind) {
        Some(TargetRefusal::NotADirectory) => Err(LaunchError::TargetNotADirectory {
            at: Box::new(at.clone()),
            kind: file_kind(kind),
        }),
        Some(TargetRefusal::NotAFile) => Err(LaunchError::TargetNotAFile {
            at: Box::new(at.clone()),
            kind: file_kind(kind),
        }),
        None => Ok(fd),
    }
}

/// Why a target is refused: the target's kind must match the volume's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TargetRefusal {
    /// A directory volume's target is not a directory.
    NotADirectory,
    /// A block volume's target is not a regular file.
    NotAFile,
}

/// The rule "the target's kind must match the volume's": a directory volume goes on a directory, a
/// block volume's device file on a regular file (never on a FIFO, a socket, a device node or a
/// directory); another file source (a file in a persistent volume) on anything but a directory, as
/// a bind allows.
fn target_refusal(
    source_is_dir: bool,
    block: bool,
    target: nix::sys::stat::SFlag,
) -> Option<TargetRefusal> {
    use nix::sys::stat::SFlag;
    if block {
        return (target != SFlag::S_IFREG).then_some(TargetRefusal::NotAFile);
    }
    (source_is_dir && target != SFlag::S_IFDIR).then_some(TargetRefusal::NotADirectory)
}

/// The source's kind against the volume's: a block volume's host path must be a block device, and
/// no other volume's may be a device of either kind (the container's copy has nodev cleared, so a
/// device node in a volume would otherwise reach a host device).
fn source_refusal(block: bool, source: nix::sys::stat::SFlag) -> Option<&'static str> {
    use nix::sys::stat::SFlag;
    match (block, source) {
        (true, SFlag::S_IFBLK) => None,
        (true, _) => Some("the block volume's published path is not a block device"),
        (false, SFlag::S_IFBLK | SFlag::S_IFCHR) => {
            Some("the volume's path is a device, but the volume is not a block volume")
        }
        (false, _) => None,
    }
}

/// What a non-directory is, for error messages.
fn file_kind(kind: nix::sys::stat::SFlag) -> &'static str {
    use nix::sys::stat::SFlag;
    match kind {
        SFlag::S_IFREG => "a regular file",
        SFlag::S_IFIFO => "a FIFO",
        SFlag::S_IFCHR => "a character device",
        SFlag::S_IFBLK => "a block device",
        SFlag::S_IFSOCK => "a socket",
        SFlag::S_IFLNK => "a symlink",
        _ => "not a directory",
    }
}

/// Step 3, in the namespace the target lives in: `move_mount` of the detached tree onto the target fd; or,
/// without the new mount API, a recursive bind of `/proc/self/fd/<source>` (the source resolved by fd,
/// never its path again) onto `/proc/self/fd/<target>`, then a bind remount for what is pending (read-only,
/// the host-only flags cleared).
pub(crate) fn attach(
    sys: &dyn Syscall,
    clone: DetachedTree,
    target: BorrowedFd<'_>,
    at: &VolumeRef,
) -> Result<(), LaunchError> {
    let attach_err = |source| LaunchError::Attach {
        at: Box::new(at.clone()),
        source,
    };
    let ro_err = |source| LaunchError::SetReadonly {
        at: Box::new(at.clone()),
        source,
    };
    let mut set = if clone.readonly_pending {
        MountFlags::READONLY
    } else {
        MountFlags::NONE
    };
    let clear = if clone.clear_pending {
        set = set.union(clone.hardening.flags());
        clone.hardening.cleared_on_copy()
    } else {
        MountFlags::NONE
    };
    match clone.tree {
        Some(tree) => {
            sys.move_mount_to_fd(tree.as_fd(), target)
                .map_err(attach_err)?;
            // The tree fd now names the attached mount's root.
            let top = mount::proc_fd_path(tree.as_fd());
            if !set.is_empty() || !clear.is_empty() {
                sys.remount_bind_with(&top, set, clear).map_err(ro_err)?;
            }
            set_propagation_of(sys, tree.as_fd(), clone.propagation, at)?;
        }
        None => {
            sys.bind_mount_to_fd(&mount::proc_fd_path(clone.source.as_fd()), target, true)
                .map_err(attach_err)?;
            // The target fd still names the covered directory; its path now leads to the new mount.
            let path = mount::fd_path(target).map_err(ro_err)?;
            // Named only through /proc/self/fd: a directory or a file alike.
            let top_fd = open_path(&path, OFlag::empty()).map_err(ro_err)?;
            let top = mount::proc_fd_path(top_fd.as_fd());
            if !set.is_empty() || !clear.is_empty() {
                sys.remount_bind_with(&top, set, clear).map_err(ro_err)?;
            }
            set_propagation(sys, &top, clone.propagation, at)?;
        }
    }
    Ok(())
}

/// One volume mount, all three steps in the calling thread's namespace.
fn apply(
    sys: &dyn Syscall,
    mount: &VolumeMount,
    root: &Path,
    how: Resolve,
    cloned: Option<DetachedTree>,
) -> Result<(), LaunchError> {
    apply_shown(sys, mount, root, root, how, cloned)
}

/// [`apply`] with the target resolved inside `root` (a path in this namespace), errors naming `shown`
/// (the root as the host names it).
fn apply_shown(
    sys: &dyn Syscall,
    mount: &VolumeMount,
    root: &Path,
    shown: &Path,
    how: Resolve,
    cloned: Option<DetachedTree>,
) -> Result<(), LaunchError> {
    let at = VolumeRef::new(mount, shown);
    let clone = match cloned {
        Some(clone) => clone,
        None => clone_source(sys, mount, &at)?,
    };
    let target = resolve_target(mount, clone.source_is_dir(), root, how, &at)?;
    attach(sys, clone, target.as_fd(), &at)?;
    tracing::debug!(
        volume_id = mount.volume_id.as_deref().unwrap_or("-"),
        container_path = %mount.container_path,
        root = %shown.display(),
        readonly = mount.readonly,
        "volume mounted"
    );
    Ok(())
}

/// `open_tree` + `move_mount` of `source` onto the fd `target`; returns the attached tree's fd (it names
/// the new mount's root).
fn bind_tree(
    sys: &dyn Syscall,
    source: &Path,
    target: BorrowedFd<'_>,
) -> Result<OwnedFd, MountError> {
    let tree = sys.open_tree_clone(source, true)?;
    sys.move_mount_to_fd(tree.as_fd(), target)?;
    Ok(tree)
}

/// The root `m`'s target is resolved in, for messages before it is (check_roots has refused a
/// mismatch).
fn target_root<'a>(spec: &'a LaunchSpec, m: &VolumeMount) -> &'a Path {
    match (m.root, &spec.rootfs) {
        (TargetRoot::Sandbox, _) => &spec.sandbox,
        (_, Some(rootfs)) => rootfs,
        (_, None) => Path::new("/"),
    }
}

/// Checks that every mount's root fits the container before anything is touched.
pub(super) fn check_roots(spec: &LaunchSpec) -> Result<(), LaunchError> {
    for m in &spec.mounts {
        let reason = match (m.root, spec.rootfs.is_some()) {
            (TargetRoot::Host, true) => "a host target cannot be used with a rootfs",
            (TargetRoot::Rootfs, false) => "a rootfs target needs a rootfs",
            _ => continue,
        };
        let root = spec.rootfs.clone().unwrap_or_else(|| PathBuf::from("/"));
        return Err(LaunchError::RootMismatch {
            at: Box::new(VolumeRef::new(m, root)),
            reason,
        });
    }
    Ok(())
}

/// The body of the launcher thread: builds the workload's mount namespace, of this thread only (unshared
/// from the daemon's; for a container with a rootfs, from the launch seed when there is one:
/// [`from_seed`]), and starts the workload in it. Everything here may allocate, except the child (see
/// [`exec::run_child`]).
pub(super) fn build_and_start(
    sys: &dyn Syscall,
    spec: &LaunchSpec,
    plan: &ExecPlan,
) -> Result<Launched, LaunchError> {
    if let Some(rootfs) = &spec.rootfs {
        if let Some(seed) = seed::seed(sys) {
            return from_seed(sys, spec, plan, rootfs, seed);
        }
    }
    // Still in the host's namespace: a volume asked with rslave or rshared needs its host mount point
    // shared, so that the new namespace's copy of it is a peer (see the module doc of `super`).
    share_hosts(sys, spec)?;
    ns::unshare_mount_namespace().map_err(|errno| LaunchError::Unshare {
        namespace: "mount namespace",
        errno,
    })?;
    // rshared copies must stay peers of the host mount point: they are cloned now, while this
    // namespace's copy of it is still a peer; once `/` is slave, a clone would only be a slave.
    let mut early: Vec<Option<DetachedTree>> = Vec::with_capacity(spec.mounts.len());
    for m in &spec.mounts {
        early.push(if m.propagation == VolumePropagation::Rshared {
            let root = target_root(spec, m);
            Some(clone_source(sys, m, &VolumeRef::new(m, root))?)
        } else {
            None
        });
    }
    // From here on nothing we mount propagates back to the host; host mounts still propagate in.
    sys.set_propagation(Path::new("/"), Propagation::Slave, true)
        .map_err(|source| LaunchError::MakeRootSlave { source })?;

    // Sandbox volumes go onto the host sandbox first, so that the recursive bind of the sandbox into the
    // rootfs below carries them along (a slave's copy is a slave of the same master). With a rootfs,
    // from the first rshared one on they are attached after that bind, under the rootfs's sandbox: the
    // old root, detached at the pivot with umount propagation, must hold no peer of a host mount point
    // (its unmount would reach the host's mounts under the volume).
    let sandbox_mounts: Vec<usize> = (0..spec.mounts.len())
        .filter(|&i| spec.mounts[i].root == TargetRoot::Sandbox)
        .collect();
    let late_from = match &spec.rootfs {
        Some(_) => sandbox_mounts
            .iter()
            .position(|&i| spec.mounts[i].propagation == VolumePropagation::Rshared)
            .unwrap_or(sandbox_mounts.len()),
        None => sandbox_mounts.len(),
    };
    for &i in &sandbox_mounts[..late_from] {
        apply(
            sys,
            &spec.mounts[i],
            &spec.sandbox,
            Resolve::Create,
            early[i].take(),
        )?;
    }

    let mut cwd: Option<OwnedFd> = None;
    if let Some(rootfs) = &spec.rootfs {
        // pivot_root needs the new root to be a mount point.
        open_dir(rootfs)
            .and_then(|rootfs_fd| bind_tree(sys, rootfs, rootfs_fd.as_fd()))
            .map_err(|source| bind_rootfs_error(rootfs, source))?;
        // Resolved by fd in the (now bound) rootfs: a symlinked /mnt cannot send the sandbox elsewhere.
        let sandbox_tree = mount::create_in_root(rootfs, Path::new(SANDBOX_IN_ROOTFS), false)
            .and_then(|target| bind_tree(sys, &spec.sandbox, target.as_fd()))
            .map_err(|source| bind_sandbox_error(spec, rootfs, source))?;
        // The rest of the sandbox volumes, resolved inside the sandbox as bound in the rootfs.
        let in_rootfs = mount::proc_fd_path(sandbox_tree.as_fd());
        for &i in &sandbox_mounts[late_from..] {
            apply(
                sys,
                &spec.mounts[i],
                &in_rootfs,
                Resolve::Create,
                early[i].take(),
            )?;
        }
        cwd = Some(sandbox_tree);
    }
    for (i, m) in spec.mounts.iter().enumerate() {
        match (m.root, &spec.rootfs) {
            (TargetRoot::Sandbox, _) => {}
            (TargetRoot::Rootfs, Some(rootfs)) => {
                apply(sys, m, rootfs, Resolve::Create, early[i].take())?
            }
            (TargetRoot::Host, None) => {
                apply(sys, m, Path::new("/"), Resolve::Existing, early[i].take())?
            }
            // Refused up front by check_roots; refuse again rather than guess.
            _ => check_roots(spec)?,
        }
    }

    // The new proc must show the new pid namespace, so the child mounts it; its mount point is resolved
    // here, by fd (inside the rootfs, or the namespace's own /proc without one).
    let proc_dir = proc_mount_point(spec, spec.rootfs.as_deref().map(|r| (r, r)))?;
    let (cwd, cwd_shown) = match cwd {
        Some(fd) => (fd, PathBuf::from(SANDBOX_IN_ROOTFS)),
        None => (
            open_dir(&spec.sandbox).map_err(|source| LaunchError::OpenDir {
                what: "sandbox",
                path: spec.sandbox.clone(),
                source,
            })?,
            spec.sandbox.clone(),
        ),
    };

    if let Some(rootfs) = &spec.rootfs {
        pivot_shown(sys, rootfs, rootfs)?;
    }
    unshare_pid(spec)?;
    start_and_wait(plan, proc_dir, cwd, cwd_shown)
}

/// A container with a rootfs, built in a namespace unshared from the launch seed (see the module doc of
/// [`seed`]): in the daemon's namespace, each volume's host mount point shared if its propagation asks
/// it, then every volume's source, the rootfs and the sandbox cloned as detached trees (all sources before
/// anything is attached: a missing one fails first); then the seed entered and a namespace of this thread's
/// own unshared from it (a copy of the seed's two mounts, not of the daemon's); the rootfs attached on the
/// seed's [`seed::ROOTFS`] and the sandbox at [`SANDBOX_IN_ROOTFS`] resolved by fd inside it, both made
/// recursively slave (host mount events under them flow in, none flow out: as `/` made rslave does in the
/// daemon's copy), then the volumes, each with its own propagation, the proc mount point, and the pivot.
/// The workload sees the same mounts either way.
fn from_seed(
    sys: &dyn Syscall,
    spec: &LaunchSpec,
    plan: &ExecPlan,
    rootfs: &Path,
    seed: BorrowedFd<'_>,
) -> Result<Launched, LaunchError> {
    // Every host mount point shared before any clone: a volume's source may lie under another's.
    share_hosts(sys, spec)?;
    let mut clones: Vec<Option<DetachedTree>> = Vec::with_capacity(spec.mounts.len());
    for m in &spec.mounts {
        clones.push(Some(clone_source(
            sys,
            m,
            &VolumeRef::new(m, target_root(spec, m)),
        )?));
    }
    let rootfs_tree = sys
        .open_tree_clone(rootfs, true)
        .map_err(|source| bind_rootfs_error(rootfs, source))?;
    let sandbox_tree = sys
        .open_tree_clone(&spec.sandbox, true)
        .map_err(|source| bind_sandbox_error(spec, rootfs, source))?;

    ns::enter(sys, seed, "csi-launcher").map_err(|source| LaunchError::EnterSeed { source })?;
    ns::unshare_mount_namespace().map_err(|errno| LaunchError::Unshare {
        namespace: "mount namespace",
        errno,
    })?;

    // Both trees recursively slave before any volume is attached under them (as `/` in the other
    // path): host mount events under them flow in, none flow out; each volume then gets its own.
    let in_seed = Path::new(seed::ROOTFS);
    let attach_slave = |tree: BorrowedFd<'_>, target: BorrowedFd<'_>| -> Result<(), MountError> {
        sys.move_mount_to_fd(tree, target)?;
        propagate_by_fd(sys, tree, Propagation::Slave)
    };
    open_dir(in_seed)
        .and_then(|mount_point| attach_slave(rootfs_tree.as_fd(), mount_point.as_fd()))
        .map_err(|source| bind_rootfs_error(rootfs, source))?;
    // Resolved by fd in the attached rootfs: a symlinked /mnt cannot send the sandbox elsewhere.
    mount::create_in_root(in_seed, Path::new(SANDBOX_IN_ROOTFS), false)
        .and_then(|at| attach_slave(sandbox_tree.as_fd(), at.as_fd()))
        .map_err(|source| bind_sandbox_error(spec, rootfs, source))?;
    // The sandbox as bound in the rootfs, named through its attached tree's fd.
    let in_sandbox = mount::proc_fd_path(sandbox_tree.as_fd());
    // Sandbox volumes first, then the rootfs's, as the other path attaches them (a host target
    // with a rootfs was refused up front by check_roots).
    let roots = [
        (
            TargetRoot::Sandbox,
            in_sandbox.as_path(),
            spec.sandbox.as_path(),
        ),
        (TargetRoot::Rootfs, in_seed, rootfs),
    ];
    for (wanted, root, shown) in roots {
        for (i, m) in spec.mounts.iter().enumerate() {
            if m.root == wanted {
                apply_shown(sys, m, root, shown, Resolve::Create, clones[i].take())?;
            }
        }
    }

    let proc_dir = proc_mount_point(spec, Some((in_seed, rootfs)))?;
    pivot_shown(sys, in_seed, rootfs)?;
    unshare_pid(spec)?;
    start_and_wait(
        plan,
        proc_dir,
        sandbox_tree,
        PathBuf::from(SANDBOX_IN_ROOTFS),
    )
}

/// Before any clone, in the daemon's namespace: the host mount point of every volume asked with
/// rslave or rshared propagation made shared, so that its clones are peers (see the module doc of
/// `super`).
fn share_hosts(sys: &dyn Syscall, spec: &LaunchSpec) -> Result<(), LaunchError> {
    for m in spec.mounts.iter() {
        share_host(sys, m, &VolumeRef::new(m, target_root(spec, m)))?;
    }
    Ok(())
}

/// The rootfs could not be bound (or attached) as the container's root.
fn bind_rootfs_error(rootfs: &Path, source: MountError) -> LaunchError {
    LaunchError::BindRootfs {
        rootfs: rootfs.to_path_buf(),
        source,
    }
}

/// The sandbox could not be bound into the rootfs.
fn bind_sandbox_error(spec: &LaunchSpec, rootfs: &Path, source: MountError) -> LaunchError {
    LaunchError::BindSandbox {
        sandbox: spec.sandbox.clone(),
        rootfs: rootfs.to_path_buf(),
        source: Box::new(source),
    }
}

/// The mount point of the pid namespace's new proc, when there is one: opened by fd inside the
/// rootfs (`rootfs`: its path in this namespace, and as the host names it), or the namespace's own
/// `/proc` without one.
fn proc_mount_point(
    spec: &LaunchSpec,
    rootfs: Option<(&Path, &Path)>,
) -> Result<Option<OwnedFd>, LaunchError> {
    if !spec.pid_namespace {
        return Ok(None);
    }
    let fd = match rootfs {
        Some((root, _)) => mount::create_in_root(root, Path::new("proc"), false),
        None => open_dir(Path::new("/proc")),
    };
    fd.map(Some).map_err(|source| LaunchError::OpenDir {
        what: "proc mount point",
        path: match rootfs {
            Some((_, shown)) => shown.join("proc"),
            None => PathBuf::from("/proc"),
        },
        source,
    })
}

/// With a pid namespace, `unshare(CLONE_NEWPID)`: the next child of this thread is its pid 1.
fn unshare_pid(spec: &LaunchSpec) -> Result<(), LaunchError> {
    if !spec.pid_namespace {
        return Ok(());
    }
    ns::unshare_pid_namespace().map_err(|errno| LaunchError::Unshare {
        namespace: "pid namespace",
        errno,
    })
}

/// Starts the workload from this thread ([`exec::spawn`]) and waits until it has exec'd (the status pipe closes) or reported
/// why it could not.
fn start_and_wait(
    plan: &ExecPlan,
    proc_dir: Option<OwnedFd>,
    cwd: OwnedFd,
    cwd_shown: PathBuf,
) -> Result<Launched, LaunchError> {
    let (read_end, write_end) =
        nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(|errno| LaunchError::Pipe { errno })?;
    let child_plan = ChildPlan::new(plan, proc_dir, cwd, write_end);

    // The child only runs exec::run_child, which makes raw, async-signal-safe syscalls on data
    // prepared above (no allocation, no locks) and ends in execve or _exit; spawn returns once it
    // has.
    let pid = exec::spawn(&child_plan).map_err(|errno| LaunchError::Fork {
        program: OsString::from(plan.program()),
        errno,
    })?;
    let pid = Pid::from_raw(pid);
    drop(child_plan);

    let mut record = [0u8; REPORT_LEN];
    let mut got = 0;
    while got < REPORT_LEN {
        match nix::unistd::read(&read_end, &mut record[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(Errno::EINTR) => continue,
            Err(errno) => {
                // Do not leave a half-started workload behind.
                let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
                let _ = nix::sys::wait::waitpid(pid, None);
                return Err(LaunchError::ReadStatus {
                    pid: pid.as_raw() as u32,
                    errno,
                });
            }
        }
    }
    if got == 0 {
        return Ok(Launched::new(pid));
    }
    // The child failed before exec and is exiting: reap it, then report why.
    let _ = nix::sys::wait::waitpid(pid, None);
    if got < REPORT_LEN {
        return Err(LaunchError::ReadStatus {
            pid: pid.as_raw() as u32,
            errno: Errno::EIO,
        });
    }
    Err(exec::decode_report(
        &record,
        plan,
        PathBuf::from("/proc"),
        cwd_shown,
    ))
}

#[cfg(test)]
mod tests {

    #[test]
    fn the_target_kind_must_match_the_volume_kind() {
        use nix::sys::stat::SFlag;
        let kinds = [
            SFlag::S_IFDIR,
            SFlag::S_IFREG,
            SFlag::S_IFBLK,
            SFlag::S_IFCHR,
            SFlag::S_IFIFO,
            SFlag::S_IFSOCK,
        ];
        for kind in kinds {
            // A block volume goes on a regular file only.
            let block = target_refusal(false, true, kind);
            assert_eq!(block.is_none(), kind == SFlag::S_IFREG, "{kind:?}");
            if kind != SFlag::S_IFREG {
                assert_eq!(block, Some(TargetRefusal::NotAFile));
            }
            // A directory volume on a directory only.
            let dir = target_refusal(true, false, kind);
            assert_eq!(dir.is_none(), kind == SFlag::S_IFDIR, "{kind:?}");
            // Another file source: as a bind allows.
            assert_eq!(target_refusal(false, false, kind), None);
        }
    }

    #[test]
    fn only_a_block_volume_hands_a_device_to_a_container() {
        use nix::sys::stat::SFlag;
        assert_eq!(source_refusal(true, SFlag::S_IFBLK), None);
        for other in [
            SFlag::S_IFDIR,
            SFlag::S_IFREG,
            SFlag::S_IFCHR,
            SFlag::S_IFIFO,
        ] {
            assert!(source_refusal(true, other).is_some(), "{other:?}");
        }
        for device in [SFlag::S_IFBLK, SFlag::S_IFCHR] {
            assert!(source_refusal(false, device).is_some(), "{device:?}");
        }
        for fine in [SFlag::S_IFDIR, SFlag::S_IFREG] {
            assert_eq!(source_refusal(false, fine), None);
        }
    }
    use super::*;
    use crate::error_chain::FullMessage;

    fn spec(root: TargetRoot, rootfs: Option<&str>) -> LaunchSpec {
        LaunchSpec {
            argv: vec!["true".into()],
            sandbox: PathBuf::from("/sandbox"),
            rootfs: rootfs.map(PathBuf::from),
            mounts: vec![VolumeMount {
                source: PathBuf::from("/src"),
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
            }],
            ..LaunchSpec::default()
        }
    }

    #[test]
    fn roots_must_fit_the_container() {
        let cases = [
            (TargetRoot::Sandbox, None, true),
            (TargetRoot::Sandbox, Some("/r"), true),
            (TargetRoot::Host, None, true),
            (TargetRoot::Host, Some("/r"), false),
            (TargetRoot::Rootfs, Some("/r"), true),
            (TargetRoot::Rootfs, None, false),
        ];
        for (root, rootfs, ok) in cases {
            let got = check_roots(&spec(root, rootfs));
            assert_eq!(got.is_ok(), ok, "{root:?} with rootfs {rootfs:?}: {got:?}");
            if let Err(e) = got {
                assert!(
                    e.full_message()
                        .starts_with("mount volume 'vol-1' at /data"),
                    "{e}"
                );
            }
        }
    }

    /// A PATH disk's source in a temp dir: `<mount point>/volumes/roles/r1/<id>`.
    fn path_disk(base: &Path, id: &str, readonly: bool) -> VolumeMount {
        let anchor = base.join("mp");
        let source = anchor.join("volumes/roles/r1").join(id);
        VolumeMount {
            source,
            source_root: Some(anchor),
            root: TargetRoot::Sandbox,
            target: PathBuf::from("data"),
            container_path: "data".into(),
            readonly,
            volume_id: Some(id.to_string()),
            provider_id: None,
            block: false,
            propagation: Default::default(),
            hardening: Default::default(),
        }
    }

    /// A temp dir with a PATH disk's persistent volume `pv1` and an empty sandbox: (the dir, its
    /// canonical path, the sandbox).
    fn pv1_sandbox() -> (tempfile::TempDir, PathBuf, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let base = std::fs::canonicalize(dir.path()).unwrap();
        let sandbox = base.join("sandbox");
        std::fs::create_dir_all(base.join("mp/volumes/roles/r1/pv1")).unwrap();
        std::fs::create_dir(&sandbox).unwrap();
        (dir, base, sandbox)
    }

    #[test]
    fn clones_for_a_container_come_from_the_resolved_fd_with_the_host_flags_cleared() {
        use crate::mount::{Call, CallKind, FakeSyscall};
        let (_dir, base, sandbox) = pv1_sandbox();
        let m = path_disk(&base, "pv1", true);
        let at = VolumeRef::new(&m, &sandbox);

        // The new mount API: clone of the fd, nosuid,nodev cleared on the copy's own mount, read-only.
        let fake = FakeSyscall::new();
        let clone = clone_source(&fake, &m, &at).unwrap();
        assert!(clone.source_is_dir());
        let target = resolve_target(&m, true, &sandbox, Resolve::Create, &at).unwrap();
        attach(&fake, clone, target.as_fd(), &at).unwrap();
        let calls = fake.calls();
        assert_eq!(
            calls[0],
            Call::OpenTreeCloneFd {
                source: m.source.clone(),
                recursive: true
            }
        );
        assert!(matches!(
            calls[1],
            Call::ChangeMountFlags { set, clear, recursive: false, .. }
                if set == MountFlags::NONE && clear == MountFlags::HOST_ONLY
        ));
        let kinds: Vec<CallKind> = calls.iter().map(Call::kind).collect();
        assert_eq!(
            kinds[2..],
            [
                CallKind::SetReadonlyByFd,
                CallKind::MoveMountToFd,
                CallKind::SetPropagationByFd
            ]
        );
        // Private by default, on the copy and its submounts: no host event reaches it, even from a
        // shared host mount point.
        assert!(matches!(
            &calls[4],
            Call::SetPropagationByFd {
                propagation: crate::mount::Propagation::Private,
                recursive: true,
                ..
            }
        ));

        // Without open_tree: the resolved fd is bound (never the path string), then one remount sets
        // read-only and clears nosuid,nodev.
        let fake = FakeSyscall::new();
        fake.fail(CallKind::OpenTreeCloneFd, Errno::ENOSYS, 1);
        let clone = clone_source(&fake, &m, &at).unwrap();
        attach(&fake, clone, target.as_fd(), &at).unwrap();
        let calls = fake.calls();
        assert!(
            matches!(&calls[1], Call::BindMountToFd { source, recursive: true, .. }
                if source.starts_with("/proc/self/fd")),
            "{calls:?}"
        );
        assert!(matches!(
            calls[2],
            Call::RemountBindWith { set, clear, .. }
                if set == MountFlags::READONLY && clear == MountFlags::HOST_ONLY
        ));
        assert_eq!(calls[3].kind(), CallKind::SetPropagation);
        assert_eq!(calls.len(), 4);

        // rslave: the copy is made a slave (recursively) once attached, on either path.
        let slave = VolumeMount {
            propagation: VolumePropagation::Rslave,
            ..m.clone()
        };
        let fake = FakeSyscall::new();
        let clone = clone_source(&fake, &slave, &at).unwrap();
        attach(&fake, clone, target.as_fd(), &at).unwrap();
        assert!(
            matches!(
                fake.calls().last(),
                Some(Call::SetPropagationByFd {
                    propagation: crate::mount::Propagation::Slave,
                    recursive: true,
                    ..
                })
            ),
            "{:?}",
            fake.calls()
        );
    }

    #[test]
    fn the_copy_keeps_the_hardening_flags_the_volume_asks_on_both_paths() {
        use crate::mount::{Call, CallKind, FakeSyscall};
        let (_dir, base, sandbox) = pv1_sandbox();
        // The volume asks nosuid and noexec: the copy keeps nosuid (only nodev is cleared) and gets
        // noexec, whatever the plugin's mount had.
        let m = VolumeMount {
            hardening: Hardening::of_mount_flags(&["nosuid", "noexec", "noatime"]),
            ..path_disk(&base, "pv1", false)
        };
        let at = VolumeRef::new(&m, &sandbox);
        let asked = MountFlags {
            nosuid: true,
            noexec: true,
            ..MountFlags::NONE
        };
        let nodev = MountFlags {
            nodev: true,
            ..MountFlags::NONE
        };
        let target = resolve_target(&m, true, &sandbox, Resolve::Create, &at).unwrap();

        let fake = FakeSyscall::new();
        let clone = clone_source(&fake, &m, &at).unwrap();
        attach(&fake, clone, target.as_fd(), &at).unwrap();
        let calls = fake.calls();
        assert!(
            matches!(calls[1], Call::ChangeMountFlags { set, clear, recursive: false, .. }
                if set == asked && clear == nodev),
            "{calls:?}"
        );
        assert!(!calls.iter().any(|c| c.kind() == CallKind::RemountBindWith));

        // Without open_tree: the one remount after the bind does the same.
        let fake = FakeSyscall::new();
        fake.fail(CallKind::OpenTreeCloneFd, Errno::ENOSYS, 1);
        let clone = clone_source(&fake, &m, &at).unwrap();
        attach(&fake, clone, target.as_fd(), &at).unwrap();
        let calls = fake.calls();
        assert!(
            calls
                .iter()
                .any(|c| matches!(c, Call::RemountBindWith { set, clear, .. }
                if *set == asked && *clear == nodev)),
            "{calls:?}"
        );
    }

    #[test]
    fn a_symlink_inside_the_volume_is_refused_by_name_before_any_mount_call() {
        use crate::mount::FakeSyscall;
        let dir = tempfile::tempdir().unwrap();
        let base = std::fs::canonicalize(dir.path()).unwrap();
        let decoy = base.join("decoy");
        std::fs::create_dir_all(&decoy).unwrap();
        std::fs::create_dir_all(base.join("mp/volumes/roles/r1")).unwrap();
        std::os::unix::fs::symlink(&decoy, base.join("mp/volumes/roles/r1/pv1")).unwrap();
        let m = path_disk(&base, "pv1", false);
        let at = VolumeRef::new(&m, &base);
        let fake = FakeSyscall::new();
        let err = match clone_source(&fake, &m, &at) {
            Err(e) => e,
            Ok(_) => panic!("a symlinked sub-path was cloned"),
        };
        let text = err.full_message();
        assert!(text.contains("volumes/roles/r1/pv1 is a symlink"), "{text}");
        assert!(text.starts_with("mount volume 'pv1' at data"), "{text}");
        assert!(fake.calls().is_empty());
    }
}
