//! What `prepare` hands the containerizer: the container's configuration
//! in, the mounts to make out.
//!
//! Targets are never host paths: a [`VolumeMount`] names the root it lives
//! in (the container's sandbox, or its rootfs) and a path relative to that
//! root, which whoever applies it resolves *inside* the root by fd, so a
//! symlink planted in the container's filesystem cannot send the mount
//! elsewhere.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::resource::Resource;

/// Where a container's sandbox appears inside its rootfs (Mesos' path, so
/// tasks moving over find it where they expect).
pub const SANDBOX_IN_ROOTFS: &str = "/mnt/mesos/sandbox";

/// A container's configuration, as `prepare` receives it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ContainerConfig {
    /// The container's resources (Mesos Resource JSON).
    pub resources: Vec<Resource>,
    /// The sandbox directory on the host (the workload's working directory).
    pub sandbox: PathBuf,
    /// The root filesystem to pivot into, if any (host path).
    #[serde(default)]
    pub rootfs: Option<PathBuf>,
    /// The user the workload runs as (informational for now).
    #[serde(default)]
    pub user: Option<String>,
}

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
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeMount {
    /// The host source: the volume's mount point (or a directory in it, for
    /// persistent volumes on a PATH disk).
    pub source: PathBuf,
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
}

impl VolumeMount {
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

/// What `prepare` returns: the mounts the launcher applies, in order, in
/// the container's new mount namespace before exec.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LaunchInfo {
    /// The bind mounts, parents before children.
    pub mounts: Vec<VolumeMount>,
}
