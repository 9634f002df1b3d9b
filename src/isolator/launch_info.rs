//! What `prepare` hands the containerizer: the container's configuration
//! in, the mounts to make out.
//!
//! The mounts themselves ([`VolumeMount`]) are described in [`crate::mount::volume_mount`], below both
//! the isolator that plans them and the launcher and hook that apply them.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::mount::VolumeMount;
use crate::resource::Resource;

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
    /// The user the workload runs as (`UID[:GID]` or `NAME[:GROUP]`; `None`: root): volumes it
    /// mounts read-write and does not share are made writable for its group
    /// ([`crate::isolator::ownership`]).
    #[serde(default)]
    pub user: Option<String>,
}

/// What `prepare` returns: the mounts the launcher applies, in order, in
/// the container's new mount namespace before exec.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LaunchInfo {
    /// The bind mounts, parents before children.
    pub mounts: Vec<VolumeMount>,
}
