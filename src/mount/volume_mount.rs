//! One bind mount of a volume into a container, described so that applying it cannot leave the container.
//!
//! This lives in `mount`, below both the isolator (which plans these mounts) and the launcher and hook
//! (which apply them), because it is a mount description; its only behaviour is opening its source by fd.
//! Cloning it for a container is one sequence, the launcher's (`launcher::clone_source`), which the
//! launcher, `update` and the OCI hook share.
//!
//! Targets are never host paths: a [`VolumeMount`] names the root it lives in (the container's sandbox, or
//! its rootfs) and a path relative to that root, which whoever applies it resolves *inside* the root by fd,
//! so a symlink planted in the container's filesystem cannot send the mount elsewhere.
//!
//! Sources are resolved by fd too: a [`VolumeMount`] names the trusted directory its source lies in
//! (`source_root`: a PATH disk's mount point, or the work dir for the default disk), and the rest of the
//! source (`volumes/roles/<role>/<id>`, in a tree the containers write) is opened beneath it without
//! following any symlink; the mount is cloned from that fd ([`VolumeMount::open_source`]).

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{open_beneath_no_symlinks, MountError, MountFlags, Propagation, Syscall};

/// Where a container's sandbox appears inside its rootfs (Mesos' path, so
/// tasks moving over find it where they expect).
pub const SANDBOX_IN_ROOTFS: &str = "/mnt/mesos/sandbox";

/// The root a mount target is resolved in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TargetRoot {
    /// The container's sandbox (relative `container_path`).
    Sandbox,
    /// The container's rootfs (absolute `container_path`, with a rootfs).
    Rootfs,
    /// The host's `/`, as seen in the container's own mount namespace
    /// (absolute `container_path` without a rootfs). The target must
    /// already exist: nothing is created on the host.
    Host,
}

/// How mount events flow between a volume's host mount point and a container's copy of it (the
/// per-use choice of Docker's `bind-propagation` and Kubernetes' `mountPropagation`).
///
/// Applying anything but [`Private`](Self::Private) needs the host mount point in a shared peer
/// group: whoever applies the mount first makes it shared ([`VolumeMount::share_host_mount_point`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VolumePropagation {
    /// No events in or out (the default; checkpoints written before this field load as it).
    #[default]
    Private,
    /// Mounts made later under the host mount point (a FUSE or nested mount of the driver) reach the
    /// container; none flow back (Mesos' `HOST_TO_CONTAINER`).
    Rslave,
    /// Both ways: mounts the container makes under its copy appear under the host mount point too
    /// (Mesos' `BIDIRECTIONAL`). They are swept at unpublish.
    Rshared,
}

impl VolumePropagation {
    /// The name used in options and messages (`private`, `rslave`, `rshared`).
    pub fn as_str(self) -> &'static str {
        match self {
            VolumePropagation::Private => "private",
            VolumePropagation::Rslave => "rslave",
            VolumePropagation::Rshared => "rshared",
        }
    }

    /// Parses [`as_str`](Self::as_str)'s names.
    pub fn parse(name: &str) -> Option<VolumePropagation> {
        [
            VolumePropagation::Private,
            VolumePropagation::Rslave,
            VolumePropagation::Rshared,
        ]
        .into_iter()
        .find(|p| p.as_str() == name)
    }

    /// The propagation type the container's copy is given, recursively, once attached.
    pub fn kernel(self) -> Propagation {
        match self {
            VolumePropagation::Private => Propagation::Private,
            VolumePropagation::Rslave => Propagation::Slave,
            VolumePropagation::Rshared => Propagation::Shared,
        }
    }

    /// Whether the host mount point must be in a shared peer group first.
    pub fn needs_shared_host(self) -> bool {
        self != VolumePropagation::Private
    }
}

impl std::fmt::Display for VolumePropagation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The hardening mount flags a volume's capability asks for (its `nosuid`, `nodev` and `noexec` mount
/// flags), which every copy of it in a container carries: set by whoever applies the mount, whatever the
/// plugin did with them. Without them a container's copy drops the host-only nosuid,nodev
/// ([`MountFlags::HOST_ONLY`]) the host mount point carries; with them it keeps what was asked.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Hardening {
    /// nosuid asked.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub nosuid: bool,
    /// nodev asked.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub nodev: bool,
    /// noexec asked.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub noexec: bool,
}

impl Hardening {
    /// The hardening flags among a capability's mount flags (other flags, and the names with a
    /// value such as `uid=0`, are the plugin's alone).
    pub fn of_mount_flags<S: AsRef<str>>(flags: &[S]) -> Hardening {
        let has = |name: &str| flags.iter().any(|f| f.as_ref() == name);
        Hardening {
            nosuid: has("nosuid"),
            nodev: has("nodev"),
            noexec: has("noexec"),
        }
    }

    /// As per-mount flags.
    pub fn flags(self) -> MountFlags {
        MountFlags {
            nosuid: self.nosuid,
            nodev: self.nodev,
            noexec: self.noexec,
            ..MountFlags::NONE
        }
    }

    /// Whether nothing is asked.
    pub fn is_empty(&self) -> bool {
        *self == Hardening::default()
    }

    /// The host-only flags a container's copy drops: [`MountFlags::HOST_ONLY`] but what is asked.
    pub fn cleared_on_copy(self) -> MountFlags {
        MountFlags::HOST_ONLY.without(self.flags())
    }
}

/// One bind mount of a volume into a container.
///
/// Equality ignores `source_root`: it says how to open `source` safely, not
/// which source it is (and mounts checkpointed before it existed have none);
/// and `hardening`: it comes from the volume's record, whose mount flags do
/// not change while the volume is in use.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct VolumeMount {
    /// The host source: the volume's mount point (or a directory in it, for
    /// persistent volumes on a PATH disk).
    pub source: PathBuf,
    /// The trusted directory `source` lies in, when part of `source` lies
    /// in a tree others write (a PATH disk's mount point, or the work dir
    /// for the default disk): the rest is opened beneath it without
    /// following symlinks. `None`: `source` itself is trusted (a MOUNT
    /// disk's mount point, or a mount checkpointed by an older version).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_root: Option<PathBuf>,
    /// The root the target lives in.
    pub root: TargetRoot,
    /// The target, relative to its root (no `..`, no leading `/`).
    pub target: PathBuf,
    /// The `container_path` as written in the resource.
    pub container_path: String,
    /// Bind read-only.
    pub readonly: bool,
    /// The volume id (`disk.source.id`), if any.
    #[serde(default)]
    pub volume_id: Option<String>,
    /// The resource provider id, if any.
    #[serde(default)]
    pub provider_id: Option<String>,
    /// A block volume (`disk.source.type` `BLOCK`): `source` is its device file, bound onto a
    /// regular file at the target.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub block: bool,
    /// How mount events flow between the host mount point and the container's copy.
    #[serde(default, skip_serializing_if = "is_private")]
    pub propagation: VolumePropagation,
    /// The hardening flags the volume's capability asks for, which the container's copy carries
    /// (filled in from the volume's record before the mount is applied).
    #[serde(default, skip_serializing_if = "Hardening::is_empty")]
    pub hardening: Hardening,
}

fn is_private(p: &VolumePropagation) -> bool {
    *p == VolumePropagation::Private
}

impl PartialEq for VolumeMount {
    fn eq(&self, other: &Self) -> bool {
        // Every field but `source_root` and `hardening` (see the type's doc).
        self.source == other.source
            && self.root == other.root
            && self.target == other.target
            && self.container_path == other.container_path
            && self.readonly == other.readonly
            && self.volume_id == other.volume_id
            && self.provider_id == other.provider_id
            && self.block == other.block
            && self.propagation == other.propagation
    }
}

impl Eq for VolumeMount {}

impl VolumeMount {
    /// `source` split into its trusted directory and the part beneath it
    /// (empty when `source` itself is trusted). A `source_root` that
    /// `source` does not lie beneath is [`MountError::Escape`].
    pub fn source_parts(&self) -> Result<(&Path, &Path), MountError> {
        match &self.source_root {
            None => Ok((&self.source, Path::new(""))),
            Some(root) => self
                .source
                .strip_prefix(root)
                .map(|rest| (root.as_path(), rest))
                .map_err(|_| MountError::Escape {
                    root: root.clone(),
                    path: self.source.clone(),
                }),
        }
    }

    /// The source as an O_PATH fd: `source_root` opened as given, the rest
    /// beneath it without following any symlink (a symlink there is
    /// [`MountError::SymlinkBeneath`], naming it).
    pub fn open_source(&self) -> Result<OwnedFd, MountError> {
        let (anchor, rest) = self.source_parts()?;
        open_beneath_no_symlinks(anchor, rest)
    }

    /// The host mount point whose peer group the container's copy joins (rshared) or follows (rslave):
    /// the trusted directory `source` lies in, or `source` itself.
    pub fn host_mount_point(&self) -> &Path {
        self.source_root.as_deref().unwrap_or(&self.source)
    }

    /// Makes the volume's host mount point ([`host_mount_point`](Self::host_mount_point)) a shared
    /// mount (its own peer group, unless it already is in one; not recursive), so that a container's
    /// copy can be its peer or its slave. A no-op for [`VolumePropagation::Private`]. The path is
    /// opened without following a symlink and must be the root of a mount, or this is
    /// [`MountError::NotAMountPoint`]: the mount that merely holds it (the work dir's file system) is
    /// never changed.
    pub fn share_host_mount_point(&self, sys: &dyn Syscall) -> Result<(), MountError> {
        if !self.propagation.needs_shared_host() {
            return Ok(());
        }
        let path = self.host_mount_point();
        let not_a_mount = || MountError::NotAMountPoint {
            path: path.to_path_buf(),
        };
        let fd = nix::fcntl::open(
            path,
            nix::fcntl::OFlag::O_PATH
                | nix::fcntl::OFlag::O_NOFOLLOW
                | nix::fcntl::OFlag::O_CLOEXEC,
            nix::sys::stat::Mode::empty(),
        )
        .map_err(|_| not_a_mount())?;
        let is_root = match super::mountinfo::fd_mount_root(std::os::fd::AsFd::as_fd(&fd)) {
            Ok(Some(answer)) => answer,
            Ok(None) => super::MountTable::is_mount_point(&super::ProcMountTable::new(), path)?,
            Err(_) => false,
        };
        if !is_root {
            return Err(not_a_mount());
        }
        sys.set_propagation(
            &super::proc_fd_path(std::os::fd::AsFd::as_fd(&fd)),
            Propagation::Shared,
            false,
        )
    }

    /// The target as the workload sees it, inside the container: with a
    /// rootfs the sandbox is at [`SANDBOX_IN_ROOTFS`], without one it is
    /// the host sandbox path.
    pub fn container_target(&self, sandbox: &Path, has_rootfs: bool) -> PathBuf {
        match self.root {
            TargetRoot::Sandbox if has_rootfs => Path::new(SANDBOX_IN_ROOTFS).join(&self.target),
            TargetRoot::Sandbox => sandbox.join(&self.target),
            TargetRoot::Rootfs | TargetRoot::Host => Path::new("/").join(&self.target),
        }
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn hardening_is_the_nosuid_nodev_noexec_among_a_volumes_mount_flags() {
        let h = Hardening::of_mount_flags(&["noatime", "nodev", "uid=0", "noexec"]);
        assert_eq!(
            h,
            Hardening {
                nosuid: false,
                nodev: true,
                noexec: true
            }
        );
        assert_eq!(h.flags().names(), ["nodev", "noexec"]);
        // The copy drops the host-only nosuid, keeps the asked nodev.
        assert_eq!(h.cleared_on_copy().names(), ["nosuid"]);
        assert_eq!(
            Hardening::default().cleared_on_copy(),
            MountFlags::HOST_ONLY
        );
        assert!(Hardening::of_mount_flags::<&str>(&[]).is_empty());
        // Absent from older checkpoints: none asked.
        let old = r#"{"source":"/s","root":"sandbox","target":"t","container_path":"t","readonly":false}"#;
        let m: VolumeMount = serde_json::from_str(old).unwrap();
        assert!(m.hardening.is_empty());
    }

    use super::*;

    #[test]
    fn a_mount_checkpointed_before_propagation_existed_loads_private_and_private_is_not_written() {
        let old = r#"{"source":"/w/t","root":"sandbox","target":"data","container_path":"data","readonly":false}"#;
        let m: VolumeMount = serde_json::from_str(old).unwrap();
        assert_eq!(m.propagation, VolumePropagation::Private);
        assert!(!serde_json::to_string(&m).unwrap().contains("propagation"));
        let shared = VolumeMount {
            propagation: VolumePropagation::Rshared,
            ..m
        };
        let text = serde_json::to_string(&shared).unwrap();
        assert!(text.contains(r#""propagation":"rshared""#), "{text}");
        assert_eq!(serde_json::from_str::<VolumeMount>(&text).unwrap(), shared);
        for p in [
            VolumePropagation::Private,
            VolumePropagation::Rslave,
            VolumePropagation::Rshared,
        ] {
            assert_eq!(VolumePropagation::parse(p.as_str()), Some(p));
        }
        assert_eq!(VolumePropagation::parse("slave"), None);
    }

    #[test]
    fn only_a_mount_root_is_shared_and_private_asks_nothing() {
        let fake = crate::mount::FakeSyscall::new();
        let dir = tempfile::tempdir().unwrap();
        let m = VolumeMount {
            source: dir.path().to_path_buf(),
            source_root: None,
            root: TargetRoot::Sandbox,
            target: PathBuf::from("data"),
            container_path: "data".into(),
            readonly: false,
            volume_id: Some("v".into()),
            provider_id: None,
            block: false,
            propagation: VolumePropagation::Private,
            hardening: Default::default(),
        };
        m.share_host_mount_point(&fake).unwrap();
        assert!(fake.calls().is_empty());
        // A plain directory (not a mount root) is refused by name, and nothing is changed.
        let slave = VolumeMount {
            propagation: VolumePropagation::Rslave,
            ..m
        };
        let err = slave.share_host_mount_point(&fake).unwrap_err();
        assert!(matches!(err, MountError::NotAMountPoint { .. }), "{err}");
        assert!(err.to_string().contains("not a mount point"), "{err}");
        assert!(fake.calls().is_empty());
    }
}
