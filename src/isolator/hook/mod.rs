//! An OCI runtime hook (`csi-isolator oci-hook create-runtime|poststop`): CSI volumes for containers that an
//! OCI runtime (runc) starts, named by annotations in the bundle's `config.json`.
//!
//! # Contract
//! - Input: the container state on stdin (runtime-spec `state`: `ociVersion`, `id`, `status`, `pid`,
//!   `bundle`, `annotations`) and the bundle's `config.json` (`root.path`, relative to the bundle or
//!   absolute, and `annotations`; where both carry an annotation, `config.json` wins).
//! - Annotations (either or both; each at most [`MAX_ANNOTATION_BYTES`] long, together naming at most
//!   [`MAX_ANNOTATION_ENTRIES`] volumes):
//!   - [`VOLUMES_ANNOTATION`] `io.csi-isolator.volumes`: comma-separated `NAME:SIZE:CONTAINER_PATH[:ro]`,
//!     the syntax of `run --volume` ([`VolumeArg`]): the volume is created on the provider if the
//!     container's tenant has no volume of that name (the same name is the same volume next time).
//!   - [`MOUNTS_ANNOTATION`] `io.csi-isolator.mounts`: `;`-separated entries of the long form of
//!     `run --mount` ([`MountSpec`]: `source=NAME,target=/PATH,size=SIZE[,readonly][,fs-type=T]
//!     [,mount-flags=a:b][,access-mode=MODE]`), the same keys and checks; a volume that exists must
//!     have the options given. Mount flags from annotations are limited to those that only take
//!     rights away ([`ANNOTATION_MOUNT_FLAGS`]).
//!   - [`RESOURCES_ANNOTATION`] `io.csi-isolator.resources`: a Mesos Resource JSON list naming volumes
//!     the provider already has (see "Who may name what").
//!   - [`PARAMETERS_ANNOTATION`] `io.csi-isolator.parameters`: CreateVolume parameters for volumes of
//!     the volumes annotation, `{"NAME": {"KEY": "VALUE"}}`, bounded and checked as every parameter
//!     set is ([`crate::provider::parameters`]); a volume that exists must have been created with the
//!     same set. A volume it does not mention is created without parameters, or used as it is.
//!
//!   `CONTAINER_PATH`s must be absolute: they land inside the container's rootfs. A container without
//!   either annotation is left alone (no lock, no provider, the work dir untouched).
//! - `create-runtime` (runtime namespace, after the container's namespaces exist, before `pivot_root`):
//!   publishes the volumes through [`VolumeIsolator::prepare`] and mounts each into the container's mount
//!   namespace at `<rootfs>/<CONTAINER_PATH>`. On any failure what this call mounted is unmounted, what it
//!   published is released, and the error names the container and the volume; the hook then exits
//!   non-zero and the runtime fails the container's start.
//! - `poststop` (a separate process): [`VolumeIsolator::cleanup`] of the container id, which releases its
//!   use of every volume (unpublished on last use) and removes its checkpoint. Idempotent; a container
//!   the hook never saw is a no-op.
//! - The container id (the state's `id`) must be usable as a path component; it is the isolator's
//!   container id, so `poststop` finds what `create-runtime` recorded.
//!
//! # Who may name what
//! Whoever sets annotations is not trusted (a CRI-O pod's author sets them, and a `hooks.d` entry
//! matches on them); only the hook's own arguments in `config.json` (the operator's) are. So:
//! - Annotations name volumes, never host paths. Every entry of the resources annotation must be a disk
//!   of this hook's provider ([`admit_resource`]): its provider id, `disk.source.type` `MOUNT` or `PATH`,
//!   the root exactly the provider's relative `./csi/<type>/<name>/mounts`, and `disk.source.id` a volume
//!   the provider knows. Anything else (no source, an absolute or other root, an unknown volume) is
//!   refused before anything is mounted, unless the operator passes [`ALLOW_RAW_RESOURCES_FLAG`], which
//!   restores the old behaviour: the annotation's resources are mounted as given, host paths included.
//! - Volume names belong to a tenant ([`Tenant`]). With [`TENANT_ANNOTATION_FLAG`] `KEY` the tenant is
//!   the value of the annotation `KEY` (one the runtime sets itself and a user cannot override, such as
//!   CRI-O's `io.kubernetes.pod.namespace`), a DNS-1123-label-like string ([`validate_tenant`]); a
//!   container without it is refused. The provider is asked for `<tenant>.<name>`
//!   ([`Tenant::scoped_name`]): a tenant holds no `.`, so the mapping is one-to-one, and two tenants
//!   naming `data` get two volumes. A resources annotation may only name volumes whose recorded name is
//!   of its own tenant. Without the flag the host is single-tenant: names are passed as written, and
//!   every container on the host that can set annotations can name (and read and write) every volume
//!   the hook made.
//! - Parameters choose what a driver mounts (an NFS driver's `server` and `share` are a host path on
//!   another machine, mounted by root): annotations may set only the keys the operator names with
//!   [`ALLOW_PARAMETER_FLAG`] `KEY` ([`admit_parameters`]); none by default. [`ALLOW_RAW_RESOURCES_FLAG`],
//!   which trusts whoever sets annotations with host paths, allows every key.
//! - Per tenant (the single tenant when tenants are off), annotations may create at most
//!   [`MAX_VOLUMES_FLAG`] volumes of at most [`MAX_CAPACITY_FLAG`] bytes together, counted from the
//!   provider's records ([`check_caps`]); a creation over a cap is refused before CreateVolume. The
//!   count and the creation happen under the work-dir lock, so two hooks cannot both take the last slot.
//!
//! # Mounting before pivot_root
//! At `create-runtime` the container's init process (`state.pid`) lives in the container's new mount
//! namespace, whose root is still the runtime's; the runtime has bound the rootfs onto itself at its host
//! path there and pivots into it after the hook. [`crate::launcher::inject`] resolves targets inside
//! `/proc/<pid>/root`, which is right only after the pivot, so this module does the pre-pivot variant:
//! 1. the volume is cloned as a detached tree in the hook's (host) namespace (`open_tree(OPEN_TREE_CLONE |
//!    AT_RECURSIVE)`), made read-only on the detached tree (`mount_setattr`) if asked;
//! 2. the rootfs is opened by fd in the container's view (`/proc/<pid>/root` + the rootfs path), and checked
//!    to be the same directory as the host rootfs (device and inode);
//! 3. the target is resolved and created *inside that rootfs fd* ([`crate::mount::create_in_root`]): a
//!    symlink in the rootfs (e.g. `/data -> /etc`) resolves inside the rootfs, never to the host;
//! 4. a short-lived thread does `unshare(CLONE_FS)` + `setns(/proc/<pid>/ns/mnt)` and `move_mount`s the tree
//!    onto the target fd (the kernel attaches only to mounts of the caller's namespace). No other thread of
//!    the process ever changes namespace.
//!
//! The mount lives in the container's namespace only (runc makes `/` recursively slave there) and goes
//! away with it; nothing is mounted on the host for the container.
//!
//! # Work dir, lock, provider
//! The hook's own options (work dir, plugin endpoint or bundled plugin, plugin name and arguments) come
//! from its command line in `config.json`'s `hooks`. Each invocation takes the work dir's lock
//! (`<work_dir>/run.lock`, exclusive, the one `run` and `serve` take) but waits for it up to
//! [`HookOptions::lock_timeout`] instead of failing, since hooks of several containers may overlap. The
//! provider is the bundled plugin (started for the hook's duration and stopped after; published volumes
//! stay mounted on the host) or a plugin at `--plugin-endpoint`. The container's isolator checkpoint
//! (`<work_dir>/isolators/volume/csi/<id>/state.json`) and its per-container directory
//! (`<work_dir>/oci-hook/<id>`, the isolator's "sandbox", unused otherwise) carry the container from
//! `create-runtime` to `poststop`.
//!
//! `poststop` does not call [`VolumeIsolator::recover`]: `recover(&[id])` cleans up every container not
//! listed, i.e. every other live hook container. Cleanup needs no loaded record here (nothing is mounted
//! on the host for hook containers). Instead `create-runtime` reaps hook containers whose `poststop` never
//! came (the runtime was killed): a checkpointed container whose sandbox is exactly
//! `<work_dir>/oci-hook/<id>` (read back through [`VolumeIsolator::checkpointed`], which checks every
//! checkpointed path, then [`checkpoint_paths::is_hook_container`]: the id valid and the sandbox exactly
//! the hook's) and whose recorded init process is gone (or that never got one: its
//! hook died mid-way, as the lock says no other hook is running) is cleaned up. "Gone" is the one
//! rule's identity half ([`crate::isolator::process_check::not_the_same_process`]): the pid names no
//! process, or another one than the start time recorded at create-runtime says. A checkpoint is data in the work dir, not an instruction:
//! the path it records is only compared, never used; the directory removed is
//! `<work_dir>/oci-hook/<id>`, opened by fd beneath the `oci-hook` directory without following a
//! symlink and without crossing into another file system ([`remove_container_dir`]).
//!
//! The work dir goes through [`crate::workdir::canonical`] (its safety checks) before anything in it
//! is opened, at `create-runtime` and at `poststop`.
//!
//! A work dir may be shared with `csi-isolator run`: `run` only cleans up containers of earlier runs
//! (sandboxes under `<work_dir>/sandboxes`) and keeps the hook's, whose sandboxes are under `oci-hook/`.

mod admit;
mod create_runtime;
mod dirs;
mod mount_into_rootfs;
mod poststop;
mod reaper;
mod state;

use crate::io_step::IoStep;
pub use admit::*;
pub use create_runtime::*;
pub use dirs::*;
pub use mount_into_rootfs::*;
pub use poststop::*;
use reaper::*;
pub use state::*;

use std::collections::BTreeMap;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

use crate::isolator::{checkpoint_paths, ContainerConfig, IsolatorError, VolumeIsolator};
use crate::mount::{self, ns, MountTable, ProcMountTable, Syscall, TargetRoot, VolumeMount};
use crate::provider::{MountSpec, ProviderConfig, ProviderError, StorageProvider, MAX_NAME_BYTES};
use crate::resource::{parse_resources, Resource, VolumeArg, VolumeMode};
use crate::workdir::WorkDirLock;

/// The annotation naming volumes by `NAME:SIZE:CONTAINER_PATH[:ro]`, comma-separated.
pub const VOLUMES_ANNOTATION: &str = "io.csi-isolator.volumes";
/// The annotation naming volumes in the long form of `run --mount`
/// (`source=NAME,target=/PATH,size=SIZE[,KEY=VALUE...]`), `;`-separated.
pub const MOUNTS_ANNOTATION: &str = "io.csi-isolator.mounts";
/// The annotation carrying a Mesos Resource JSON list of volumes.
pub const RESOURCES_ANNOTATION: &str = "io.csi-isolator.resources";
/// The annotation carrying CreateVolume parameters per volume of [`VOLUMES_ANNOTATION`]: a JSON
/// object `{"NAME": {"KEY": "VALUE", ...}, ...}`; only keys the operator allows
/// ([`ALLOW_PARAMETER_FLAG`]).
pub const PARAMETERS_ANNOTATION: &str = "io.csi-isolator.parameters";
/// The hook argument allowing annotations to set one CreateVolume parameter key.
pub const ALLOW_PARAMETER_FLAG: &str = "--allow-parameter";
/// The directory under the work dir holding one directory per hook container.
pub use crate::workdir::HOOK_DIR;
/// How long a hook waits for the work-dir lock by default.
pub const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the bundled plugin gets to stop after the hook's work.
const PLUGIN_STOP_GRACE: Duration = Duration::from_secs(5);
/// The longest value of one volume annotation, in bytes.
pub const MAX_ANNOTATION_BYTES: usize = 64 * 1024;
/// The most volumes one container's annotations may name (both annotations together).
pub const MAX_ANNOTATION_ENTRIES: usize = 32;
/// The longest tenant, in bytes (a DNS-1123 label's bound).
pub const MAX_TENANT_BYTES: usize = 63;
/// Between the tenant and the volume name in the name the provider is asked for; never in a tenant.
pub const TENANT_SEPARATOR: char = '.';
/// The hook argument that lets resources annotations name anything (host paths included).
pub const ALLOW_RAW_RESOURCES_FLAG: &str = "--allow-raw-resources";
/// The hook argument naming the annotation that carries the tenant.
pub const TENANT_ANNOTATION_FLAG: &str = "--tenant-annotation";
/// The hook argument capping the number of volumes annotations may create per tenant.
pub const MAX_VOLUMES_FLAG: &str = "--max-volumes-per-tenant";
/// The hook argument capping the total capacity of the volumes annotations may create per tenant.
pub const MAX_CAPACITY_FLAG: &str = "--max-capacity-per-tenant";
/// The default of [`MAX_VOLUMES_FLAG`].
pub const DEFAULT_MAX_VOLUMES_PER_TENANT: u64 = 32;
/// The default of [`MAX_CAPACITY_FLAG`]: 64 GiB.
pub const DEFAULT_MAX_CAPACITY_PER_TENANT: u64 = 64 << 30;
/// How deep the removal of a hook container's directory goes (the directory is unused, so normally
/// empty; a deeper tree is kept and logged).
const MAX_REMOVE_DEPTH: usize = 16;
/// How many entries the removal of a hook container's directory deletes at most.
const MAX_REMOVE_ENTRIES: usize = 4096;

/// A hook failed.
#[derive(Debug, thiserror::Error)]
pub enum HookError {
    /// The state on stdin could not be read.
    #[error("read the container state (stdin)")]
    ReadState {
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The state on stdin is larger than any runtime sends.
    #[error("the container state on stdin is over {limit} bytes: refused unread (a runtime's state is a few KiB, annotations included)")]
    StateTooLarge {
        /// The limit, bytes.
        limit: u64,
    },
    /// The state on stdin is not runtime-spec state JSON.
    #[error("parse the container state (stdin)")]
    ParseState {
        /// The JSON error.
        #[source]
        source: serde_json::Error,
    },
    /// The container id cannot be used as a path component (the error names the id and why).
    #[error(transparent)]
    InvalidContainerId(Box<crate::resource::ResourceError>),
    /// The stage was to come from the state's status, which names none of the hook's stages.
    #[error("container '{container}': the state's status '{status}' names no stage of the hook (creating: create-runtime, stopped: poststop): give the stage as the hook's last argument")]
    UnknownStatus {
        /// The container id.
        container: String,
        /// The state's `status`.
        status: String,
    },
    /// create-runtime needs the container's init pid.
    #[error("container '{container}': the state has no pid (create-runtime needs the container's init process)")]
    NoPid {
        /// The container id.
        container: String,
    },
    /// The bundle's config.json could not be read.
    #[error("container '{container}': read {path}")]
    ReadConfig {
        /// The container id.
        container: String,
        /// config.json.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The bundle's config.json is not an OCI config with a root.
    #[error("container '{container}': parse {path}")]
    ParseConfig {
        /// The container id.
        container: String,
        /// config.json.
        path: PathBuf,
        /// The JSON error.
        #[source]
        source: serde_json::Error,
    },
    /// The rootfs does not exist (or cannot be made canonical).
    #[error("container '{container}': rootfs {path}")]
    Rootfs {
        /// The container id.
        container: String,
        /// The rootfs as configured (joined to the bundle).
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// An annotation entry is malformed.
    #[error("container '{container}': annotation {annotation}: volume '{volume}': {reason}")]
    Annotation {
        /// The container id.
        container: String,
        /// The annotation key.
        annotation: &'static str,
        /// The entry (or the whole value for the JSON annotation).
        volume: String,
        /// Why.
        reason: String,
    },
    /// An annotation's value fails the check it goes through (its JSON, or a parameter set).
    #[error("container '{container}': annotation {annotation}: volume '{volume}'")]
    AnnotationRefused {
        /// The container id.
        container: String,
        /// The annotation key.
        annotation: &'static str,
        /// The volume name (shown), or `(json)` for the whole value.
        volume: String,
        /// The check's error.
        #[source]
        source: Box<AnnotationError>,
    },
    /// An annotation is longer, or names more volumes, than the hook takes.
    #[error("container '{container}': annotation {annotation}: {reason}")]
    AnnotationTooLarge {
        /// The container id.
        container: String,
        /// The annotation key (or both).
        annotation: &'static str,
        /// What is over which bound.
        reason: String,
    },
    /// A parameters annotation sets a key the operator does not allow.
    #[error(
        "container '{container}': annotation {PARAMETERS_ANNOTATION}: volume '{volume}': parameter \
         '{key}' refused: the hook's operator allows annotations to set {allowed} (add \
         {ALLOW_PARAMETER_FLAG} {key} to the hook's arguments to allow it)"
    )]
    ParameterRefused {
        /// The container id.
        container: String,
        /// The volume name as written.
        volume: String,
        /// The key, escaped and shortened.
        key: String,
        /// The keys allowed, as words.
        allowed: String,
    },
    /// A resources annotation names something that is not a volume of this hook's provider.
    #[error(
        "container '{container}': annotation {RESOURCES_ANNOTATION}: resource {resource} refused: {reason}; \
         annotations may only name volumes of provider '{provider}' (an operator who trusts whoever \
         sets annotations with host paths may pass {ALLOW_RAW_RESOURCES_FLAG} in the hook's arguments)"
    )]
    ResourceRefused {
        /// The container id.
        container: String,
        /// The resource ([`Resource::describe`]).
        resource: String,
        /// This hook's provider (as far as known).
        provider: String,
        /// Why.
        reason: String,
    },
    /// The container's tenant cannot be told.
    #[error(
        "container '{container}': tenant annotation '{annotation}' {reason} (the hook runs with \
         {TENANT_ANNOTATION_FLAG} {annotation}: every container it serves needs a valid tenant there)"
    )]
    Tenant {
        /// The container id.
        container: String,
        /// The annotation key the operator chose.
        annotation: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A volume name of an annotation cannot be scoped to its tenant.
    #[error("container '{container}': volume '{volume}' of {tenant}: {reason}")]
    VolumeName {
        /// The container id.
        container: String,
        /// The name as written in the annotation.
        volume: String,
        /// The tenant.
        tenant: Tenant,
        /// Why.
        reason: String,
    },
    /// Creating a volume would take its tenant over a cap.
    #[error("container '{container}': volume '{volume}' of {tenant}: create: refused: {exceeded}")]
    CapExceeded {
        /// The container id.
        container: String,
        /// The name as written in the annotation.
        volume: String,
        /// The tenant.
        tenant: Tenant,
        /// Which cap, its value and the use.
        exceeded: CapExceeded,
    },
    /// The provider's configuration could not be built.
    #[error("container '{container}': configure the provider")]
    ProviderConfig {
        /// The container id.
        container: String,
        /// What the provider factory failed with.
        #[source]
        source: ProviderConfigError,
    },
    /// A directory of the hook could not be made or removed.
    #[error(transparent)]
    Io(#[from] IoStep),
    /// The work dir's lock could not be taken.
    #[error(transparent)]
    WorkDir(#[from] crate::workdir::WorkDirError),
    /// The provider could not be started.
    #[error("container '{container}': start the provider")]
    Provider {
        /// The container id.
        container: String,
        /// The provider error.
        #[source]
        source: Box<ProviderError>,
    },
    /// A named volume could not be created (or found).
    #[error("container '{container}': volume '{volume}' of {tenant}: create")]
    CreateVolume {
        /// The container id.
        container: String,
        /// The volume name as written in the annotation.
        volume: String,
        /// The tenant.
        tenant: Tenant,
        /// The provider error.
        #[source]
        source: Box<ProviderError>,
    },
    /// The isolator failed (publish, targets, checkpoint, cleanup); its message names container and volume.
    #[error(transparent)]
    Isolator(Box<IsolatorError>),
    /// A volume could not be mounted into the container.
    #[error("container '{container}': mount volume {volume} at {container_path}")]
    Mount {
        /// The container id.
        container: String,
        /// The volume id (or source).
        volume: String,
        /// The container path.
        container_path: String,
        /// The step that failed (its text names it) and its cause.
        #[source]
        source: Box<RootfsMountError>,
    },
}

/// Why an annotation's value was refused by the check it goes through.
#[derive(Debug, thiserror::Error)]
pub enum AnnotationError {
    /// The resources annotation is not a Mesos Resource JSON list.
    #[error(transparent)]
    Resources(#[from] crate::resource::ResourceError),
    /// The parameters annotation is not a JSON object of volume names to string maps.
    #[error("not a JSON object of volume names to string maps")]
    ParametersJson(#[source] serde_json::Error),
    /// A parameter set is refused (too many, too large, a bad key or value).
    #[error(transparent)]
    Parameters(#[from] crate::provider::parameters::ParameterError),
}

impl From<IsolatorError> for HookError {
    fn from(e: IsolatorError) -> Self {
        HookError::Isolator(Box::new(e))
    }
}

/// What a [`ProviderFactory`] fails with: the binary's error (its command-line options), whose
/// causes the chain shows.
pub type ProviderConfigError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Builds the provider's configuration for the work dir (canonical by then).
pub type ProviderFactory =
    Arc<dyn Fn(&Path) -> Result<ProviderConfig, ProviderConfigError> + Send + Sync + 'static>;

/// The hook's own options (from its command line in `config.json`).
#[derive(Clone)]
pub struct HookOptions {
    /// The work dir as given (shared with other hook invocations, and possibly with `run`); made
    /// canonical, with its safety checks, before anything in it is opened.
    pub work_dir: PathBuf,
    /// The provider (bundled plugin or endpoint) for the canonical work dir.
    pub provider: ProviderFactory,
    /// How long to wait for the work-dir lock.
    pub lock_timeout: Duration,
    /// What annotations may do.
    pub policy: HookPolicy,
    /// The mount syscalls (the real kernel's, chosen by the command).
    pub sys: Arc<dyn Syscall>,
}

impl std::fmt::Debug for HookOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HookOptions")
            .field("work_dir", &self.work_dir)
            .field("lock_timeout", &self.lock_timeout)
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

impl HookOptions {
    fn provider_config(
        &self,
        container: &str,
        work_dir: &Path,
    ) -> Result<ProviderConfig, HookError> {
        (self.provider)(work_dir).map_err(|source| HookError::ProviderConfig {
            container: container.to_string(),
            source,
        })
    }
}

/// Which hook the runtime runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// `createRuntime`: publish and mount.
    CreateRuntime,
    /// `poststop`: release.
    Poststop,
}

impl Stage {
    /// The stage a runtime is in when it hands a hook `state`, for a hook registered for both
    /// stages with the same arguments (a Podman or CRI-O `hooks.d` entry listing
    /// `createRuntime` and `poststop`): `creating` is createRuntime (runc passes it to
    /// prestart and createRuntime hooks), `stopped` is poststop (runc's own and the one
    /// Podman runs itself after the container is deleted). Any other status is refused: a
    /// hook guessing would publish for a stopped container or release a starting one.
    pub fn from_state(state: &State) -> Result<Stage, HookError> {
        match state.status.as_str() {
            "creating" => Ok(Stage::CreateRuntime),
            "stopped" => Ok(Stage::Poststop),
            other => Err(HookError::UnknownStatus {
                container: crate::shown::shown(&state.id).into_owned(),
                status: crate::shown::shown(other).into_owned(),
            }),
        }
    }
}

/// Runs the hook `stage` for the container `state` describes.
pub async fn run(stage: Stage, opts: &HookOptions, state: &State) -> Result<(), HookError> {
    match stage {
        Stage::CreateRuntime => create_runtime(opts, state).await.map(|_| ()),
        Stage::Poststop => poststop(opts, state).await,
    }
}

fn validate_id(id: &str) -> Result<(), HookError> {
    crate::resource::validate_container_id(id)
        .map_err(|e| HookError::InvalidContainerId(Box::new(e)))
}

/// `<work_dir>/oci-hook/<id>`.
pub fn container_dir(work_dir: &Path, id: &str) -> PathBuf {
    checkpoint_paths::hook_sandbox(work_dir, id)
}

fn volume_name(m: &VolumeMount) -> String {
    m.volume_id
        .clone()
        .unwrap_or_else(|| m.source.display().to_string())
}

#[cfg(test)]
fn annotations(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stage_comes_from_the_state_status() {
        let state = |status: &str| State {
            oci_version: "1.0.2".into(),
            id: "c1".into(),
            status: status.into(),
            pid: None,
            bundle: PathBuf::from("/b"),
            annotations: BTreeMap::new(),
        };
        let table: &[(&str, Option<Stage>)] = &[
            ("creating", Some(Stage::CreateRuntime)),
            ("stopped", Some(Stage::Poststop)),
            ("created", None),
            ("running", None),
            ("", None),
            ("Creating", None),
        ];
        for (status, want) in table {
            match (Stage::from_state(&state(status)), want) {
                (Ok(got), Some(want)) => assert_eq!(got, *want, "{status:?}"),
                (Err(e), None) => assert_eq!(
                    e.to_string(),
                    format!(
                        "container 'c1': the state's status '{status}' names no stage of the hook \
                         (creating: create-runtime, stopped: poststop): give the stage as the \
                         hook's last argument"
                    )
                ),
                (got, want) => panic!("{status:?}: {got:?}, want {want:?}"),
            }
        }
    }

    #[test]
    fn container_ids_must_be_path_components() {
        for bad in ["", "..", "a/b"] {
            assert!(validate_id(bad).is_err(), "{bad:?}");
        }
        validate_id("my-container_1").unwrap();
        // The id's error is the resource check's own, named once.
        assert_eq!(
            crate::error_chain::full_message(&validate_id("..").unwrap_err()),
            "invalid container id \"..\": is a relative path component"
        );
    }

    /// What the provider factory fails with is the cause of the hook's error, its own causes
    /// after it: the hook says only which container and which step.
    #[test]
    fn a_provider_factory_failure_is_the_cause_with_its_own_causes() {
        let opts = HookOptions {
            work_dir: PathBuf::from("/w"),
            provider: Arc::new(|work_dir: &Path| {
                Err(IoStep::new(
                    "read disk profiles",
                    work_dir.join("profiles.json"),
                    std::io::Error::from_raw_os_error(libc::ENOENT),
                )
                .into())
            }),
            lock_timeout: DEFAULT_LOCK_TIMEOUT,
            policy: HookPolicy::default(),
            sys: Arc::new(crate::mount::FakeSyscall::new()),
        };
        let e = opts.provider_config("c1", Path::new("/w")).unwrap_err();
        let message = crate::error_chain::full_message(&e);
        assert!(
            message.starts_with(
                "container 'c1': configure the provider: read disk profiles /w/profiles.json: "
            ),
            "{message}"
        );
        assert_eq!(message.matches("configure the provider").count(), 1);
        assert!(message.contains("No such file"), "{message}");
    }
}
