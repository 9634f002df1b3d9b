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

use super::{open_beneath_no_symlinks, MountError};

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

/// One bind mount of a volume into a container.
///
/// Equality ignores `source_root`: it says how to open `source` safely, not
/// which source it is (and mounts checkpointed before it existed have none).
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
}

impl PartialEq for VolumeMount {
    fn eq(&self, other: &Self) -> bool {
        // Every field but `source_root` (see the type's doc).
        self.source == other.source
            && self.root == other.root
            && self.target == other.target
            && self.container_path == other.container_path
            && self.readonly == other.readonly
            && self.volume_id == other.volume_id
            && self.provider_id == other.provider_id
            && self.block == other.block
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
