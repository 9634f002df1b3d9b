//! Errors of the volume isolator, naming the container, the volume and the
//! step.

use std::path::PathBuf;

use crate::isolator::checkpoint_paths::CheckpointPathError;
use crate::launcher::LaunchError;
use crate::mount::MountError;
use crate::provider::checkpoint::CheckpointError;
use crate::provider::ProviderError;
use crate::resource::ResourceError;

/// An isolator operation failed.
#[derive(Debug, thiserror::Error)]
pub enum IsolatorError {
    /// The container id cannot be used as a path component (the error names the id and why).
    #[error(transparent)]
    InvalidContainerId(Box<ResourceError>),
    /// The container is already prepared (prepare is not idempotent across configs).
    #[error("container '{container}' is already prepared")]
    AlreadyPrepared {
        /// The container id.
        container: String,
    },
    /// The container is not known to the isolator.
    #[error("unknown container '{container}'")]
    UnknownContainer {
        /// The container id.
        container: String,
    },
    /// A resource's mount point or target could not be worked out.
    #[error("container '{container}': volume {volume}")]
    Resource {
        /// The container id.
        container: String,
        /// The volume (id, or resource description).
        volume: String,
        /// The resource error.
        #[source]
        source: Box<ResourceError>,
    },
    /// A disk without `provider_id` (an agent disk: a mount the operator
    /// prepares) whose host path is missing or not a directory.
    #[error("container '{container}': resource {resource} has no provider_id, so it is an agent disk the operator prepares, but its host path {} {problem}: create that directory (or mount the disk there), or give the resource the provider_id and disk.source.id of a CSI volume (`csi-isolator volume create` or `volume import`)", path.display())]
    MissingAgentDisk {
        /// The container id.
        container: String,
        /// The resource, described.
        resource: String,
        /// Its host path.
        path: PathBuf,
        /// What is wrong there (`does not exist`, `is not a directory`).
        problem: &'static str,
    },
    /// A volume target is refused (escapes its root, duplicate, needs a rootfs...).
    #[error(
        "container '{container}': volume {volume}: container_path '{container_path}': {reason}"
    )]
    BadTarget {
        /// The container id.
        container: String,
        /// The volume.
        volume: String,
        /// The container path as given.
        container_path: String,
        /// Why it is refused.
        reason: String,
    },
    /// A read-write mount of a volume that may only be read.
    #[error("container '{container}': volume {volume} is {why}: it can only be mounted read-only (set disk.volume.mode to RO)")]
    ReadOnlyVolume {
        /// The container id.
        container: String,
        /// The volume id.
        volume: String,
        /// Published read-only, or a reader-only access mode.
        why: String,
    },
    /// Publishing or unpublishing through the provider failed.
    #[error("container '{container}'")]
    Provider {
        /// The container id.
        container: String,
        /// The provider error (names the volume, RPC, code and message).
        #[source]
        source: Box<ProviderError>,
    },
    /// The container's user cannot be resolved.
    #[error("container '{container}': {reason}")]
    BadUser {
        /// The container id.
        container: String,
        /// What is wrong with the user (names it).
        reason: String,
    },
    /// A volume root could not be made writable for the workload's group.
    #[error("container '{container}': volume {volume}: make it writable for group {gid}")]
    Ownership {
        /// The container id.
        container: String,
        /// The volume (its id or path).
        volume: String,
        /// The workload's group.
        gid: u32,
        /// The step that failed.
        #[source]
        source: crate::io_step::IoStep,
    },
    /// The isolator's checkpoint could not be written or removed.
    #[error("container '{container}': checkpoint {path}")]
    Checkpoint {
        /// The container id.
        container: String,
        /// The checkpoint path.
        path: PathBuf,
        /// What failed.
        #[source]
        source: Box<CheckpointError>,
    },
    /// The isolator's journal could not be opened or compacted (recovery stops: without it the
    /// checkpoints on disk are not the whole truth).
    #[error("isolator journal {path}: cannot fold it into the container checkpoints")]
    Journal {
        /// The journal.
        path: PathBuf,
        /// What failed (a refused journal says how to set it aside).
        #[source]
        source: Box<CheckpointError>,
    },
    /// A path of the container's config would fail the checks recovery makes on the checkpoint:
    /// it is not recorded (nor anything published).
    #[error("container '{container}': checkpoint {path}: refused to record a path of the config (give the canonical absolute path of a directory of the container's own)")]
    UnsafeConfigPath {
        /// The container id.
        container: String,
        /// The checkpoint path.
        path: PathBuf,
        /// The path and the check it fails.
        #[source]
        source: Box<CheckpointPathError>,
    },
    /// The container's checkpoint names a path that fails the checks: nothing it names is
    /// unmounted or removed.
    #[error("container '{container}': checkpoint {path}: not trusted; nothing it names is unmounted or removed (check who can write the work dir)")]
    UntrustedCheckpoint {
        /// The container id.
        container: String,
        /// The checkpoint path.
        path: PathBuf,
        /// The path and the check it fails.
        #[source]
        source: Box<CheckpointPathError>,
    },
    /// Mounting into or unmounting from the running container failed.
    #[error("container '{container}': {step} volume {volume}")]
    Namespace {
        /// The container id.
        container: String,
        /// `mount` or `unmount`.
        step: &'static str,
        /// The volume.
        volume: String,
        /// The launcher's error (names the target, the root and the step).
        #[source]
        source: Box<LaunchError>,
    },
    /// The running container's pid is unknown (isolate was never called).
    #[error("container '{container}' has no known pid: call isolate first")]
    NoPid {
        /// The container id.
        container: String,
    },
    /// The Docker/OCI host binds could not be made.
    #[error("container '{container}'")]
    Oci {
        /// The container id.
        container: String,
        /// The OCI error (names the volume and the step).
        #[source]
        source: Box<crate::isolator::oci::OciError>,
    },
    /// A process offered at isolate is not the container's (see `process_check`).
    #[error("isolate container '{container}': pid {pid} is not the container's process: {why}")]
    NotTheContainer {
        /// The container id.
        container: String,
        /// The pid offered.
        pid: u32,
        /// Why it is not (what was seen).
        why: String,
    },
    /// The container's recorded process is gone or is not the container.
    #[error("container '{container}': process {pid} cannot be used: {why}")]
    PidGone {
        /// The container id.
        container: String,
        /// The recorded pid.
        pid: u32,
        /// Why.
        why: String,
    },
    /// Unmounting a host-side mount of the container failed.
    #[error("container '{container}': unmount {path}")]
    Unmount {
        /// The container id.
        container: String,
        /// The mount point.
        path: PathBuf,
        /// What failed.
        #[source]
        source: Box<MountError>,
    },
}
