//! The isolator's record of one container, as checkpointed in
//! `<work_dir>/isolators/volume/csi/<id>/state.json` (versioned JSON): what
//! `prepare` was given, the mounts made for it, its process once isolated,
//! and what was mounted on the host for it. Read back only through the
//! checks of [`crate::isolator::checkpoint_paths`].

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::isolator::launch_info::ContainerConfig;
use crate::mount::VolumeMount;

/// Format version of the isolator's container checkpoint.
pub const FORMAT_VERSION: u32 = 1;

/// What the isolator checkpoints per container.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ContainerRecord {
    /// Format version.
    pub format: u32,
    /// The container id.
    pub container_id: String,
    /// The container's configuration (with its current resources).
    pub config: ContainerConfig,
    /// The volume mounts made for it.
    pub mounts: Vec<VolumeMount>,
    /// Its pid, once isolated (for update).
    #[serde(default)]
    pub pid: Option<u32>,
    /// The start time of that pid (`/proc/<pid>/stat`), so a reused pid is
    /// never mistaken for the container.
    #[serde(default)]
    pub pid_start: Option<u64>,
    /// Its process's mount namespace and root when it was isolated: `update`
    /// refuses a process that has moved to another one since.
    #[serde(default)]
    pub mount_view: Option<crate::launcher::process::MountView>,
    /// Mounts made on the host for it (the Docker/OCI path), unmounted at cleanup.
    #[serde(default)]
    pub host_binds: Vec<PathBuf>,
    /// Host binds are (or were about to be) made in its sandbox: cleanup
    /// sweeps every mount under the sandbox, recorded or not.
    #[serde(default)]
    pub binds_in_sandbox: bool,
}

impl ContainerRecord {
    /// A new container's record: `config` and the `mounts` made for it, nothing isolated yet,
    /// nothing mounted on the host.
    pub fn new(container_id: &str, config: ContainerConfig, mounts: Vec<VolumeMount>) -> Self {
        ContainerRecord {
            format: FORMAT_VERSION,
            container_id: container_id.to_string(),
            config,
            mounts,
            pid: None,
            pid_start: None,
            mount_view: None,
            host_binds: Vec::new(),
            binds_in_sandbox: false,
        }
    }
}
