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
//!   - [`RESOURCES_ANNOTATION`] `io.csi-isolator.resources`: a Mesos Resource JSON list naming volumes
//!     the provider already has (see "Who may name what").
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
//! the hook's) and whose recorded init pid is gone (or that never got one: its
//! hook died mid-way, as the lock says no other hook is running) is cleaned up. A recycled pid only
//! delays that (the volume stays published). A checkpoint is data in the work dir, not an instruction:
//! the path it records is only compared, never used; the directory removed is
//! `<work_dir>/oci-hook/<id>`, opened by fd beneath the `oci-hook` directory without following a
//! symlink and without crossing into another file system ([`remove_container_dir`]).
//!
//! The work dir goes through [`crate::workdir::canonical`] (its safety checks) before anything in it
//! is opened, at `create-runtime` and at `poststop`.
//!
//! A work dir may be shared with `csi-isolator run`: `run` only cleans up containers of earlier runs
//! (sandboxes under `<work_dir>/sandboxes`) and keeps the hook's, whose sandboxes are under `oci-hook/`.

use std::collections::BTreeMap;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

use crate::isolator::{checkpoint_paths, ContainerConfig, IsolatorError, VolumeIsolator};
use crate::mount::{
    self, ns, LinuxSyscall, MountTable, ProcMountTable, Syscall, TargetRoot, VolumeMount,
};
use crate::provider::{CreateSpec, ProviderConfig, ProviderError, StorageProvider, MAX_NAME_BYTES};
use crate::resource::{parse_resources, Resource, VolumeArg, VolumeMode};
use crate::workdir::WorkDirLock;

/// The annotation naming volumes by `NAME:SIZE:CONTAINER_PATH[:ro]`, comma-separated.
pub const VOLUMES_ANNOTATION: &str = "io.csi-isolator.volumes";
/// The annotation carrying a Mesos Resource JSON list of volumes.
pub const RESOURCES_ANNOTATION: &str = "io.csi-isolator.resources";
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
    /// The state on stdin is not runtime-spec state JSON.
    #[error("parse the container state (stdin): {source}")]
    ParseState {
        /// The JSON error.
        #[source]
        source: serde_json::Error,
    },
    /// The container id cannot be used as a path component.
    #[error("invalid container id '{container}': {reason}")]
    InvalidContainerId {
        /// The id.
        container: String,
        /// Why.
        reason: String,
    },
    /// create-runtime needs the container's init pid.
    #[error("container '{container}': the state has no pid (create-runtime needs the container's init process)")]
    NoPid {
        /// The container id.
        container: String,
    },
    /// The bundle's config.json could not be read.
    #[error("container '{container}': read {path}: {source}")]
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
    #[error("container '{container}': parse {path}: {source}")]
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
    #[error("container '{container}': rootfs {path}: {source}")]
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
    #[error("container '{container}': configure the provider: {reason}")]
    ProviderConfig {
        /// The container id.
        container: String,
        /// Why.
        reason: String,
    },
    /// A directory of the hook could not be made or removed.
    #[error("{step} {path}: {source}")]
    Io {
        /// The step.
        step: &'static str,
        /// The path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The work dir's lock could not be taken.
    #[error(transparent)]
    WorkDir(#[from] crate::workdir::WorkDirError),
    /// The provider could not be started.
    #[error("container '{container}': start the provider: {source}")]
    Provider {
        /// The container id.
        container: String,
        /// The provider error.
        #[source]
        source: Box<ProviderError>,
    },
    /// A named volume could not be created (or found).
    #[error("container '{container}': volume '{volume}' of {tenant}: create: {source}")]
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
    #[error(
        "container '{container}': mount volume {volume} at {container_path}: {step}: {reason}"
    )]
    Mount {
        /// The container id.
        container: String,
        /// The volume id (or source).
        volume: String,
        /// The container path.
        container_path: String,
        /// The step that failed.
        step: &'static str,
        /// Why.
        reason: String,
    },
}

impl From<IsolatorError> for HookError {
    fn from(e: IsolatorError) -> Self {
        HookError::Isolator(Box::new(e))
    }
}

/// The runtime-spec container state a hook reads on stdin.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct State {
    /// The runtime-spec version.
    #[serde(rename = "ociVersion", default)]
    pub oci_version: String,
    /// The container id.
    pub id: String,
    /// `creating`, `created`, `running` or `stopped`.
    #[serde(default)]
    pub status: String,
    /// The container's init process (host pid), when it has one.
    #[serde(default)]
    pub pid: Option<i64>,
    /// The bundle directory (absolute).
    pub bundle: PathBuf,
    /// The container's annotations.
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
}

impl State {
    /// Parses state JSON.
    pub fn parse(bytes: &[u8]) -> Result<State, HookError> {
        serde_json::from_slice(bytes).map_err(|source| HookError::ParseState { source })
    }
}

/// What the hook reads from the bundle's `config.json`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BundleConfig {
    /// `root.path`, joined to the bundle when relative (not canonical).
    pub rootfs: PathBuf,
    /// `annotations`.
    pub annotations: BTreeMap<String, String>,
}

#[derive(Deserialize)]
struct RawConfig {
    root: RawRoot,
    #[serde(default)]
    annotations: BTreeMap<String, String>,
}

#[derive(Deserialize)]
struct RawRoot {
    path: PathBuf,
}

impl BundleConfig {
    /// Reads `<bundle>/config.json`.
    pub fn read(container: &str, bundle: &Path) -> Result<BundleConfig, HookError> {
        let path = bundle.join("config.json");
        let bytes = std::fs::read(&path).map_err(|source| HookError::ReadConfig {
            container: container.to_string(),
            path: path.clone(),
            source,
        })?;
        let raw: RawConfig =
            serde_json::from_slice(&bytes).map_err(|source| HookError::ParseConfig {
                container: container.to_string(),
                path,
                source,
            })?;
        Ok(BundleConfig {
            rootfs: bundle.join(raw.root.path),
            annotations: raw.annotations,
        })
    }
}

/// The volumes a container's annotations name.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HookVolumes {
    /// From [`VOLUMES_ANNOTATION`]: created by name if new.
    pub volumes: Vec<VolumeArg>,
    /// From [`RESOURCES_ANNOTATION`]: mounted as given.
    pub resources: Vec<Resource>,
}

impl HookVolumes {
    /// Whether no volume is named.
    pub fn is_empty(&self) -> bool {
        self.volumes.is_empty() && self.resources.is_empty()
    }

    /// Parses the annotations (unknown keys are ignored). Every container path must be absolute.
    pub fn from_annotations(
        container: &str,
        annotations: &BTreeMap<String, String>,
    ) -> Result<HookVolumes, HookError> {
        let mut out = HookVolumes::default();
        let bad = |annotation, volume: &str, reason: String| HookError::Annotation {
            container: container.to_string(),
            annotation,
            volume: volume.to_string(),
            reason,
        };
        let too_large = |annotation, reason: String| HookError::AnnotationTooLarge {
            container: container.to_string(),
            annotation,
            reason,
        };
        for key in [VOLUMES_ANNOTATION, RESOURCES_ANNOTATION] {
            if let Some(value) = annotations
                .get(key)
                .filter(|v| v.len() > MAX_ANNOTATION_BYTES)
            {
                return Err(too_large(
                    key,
                    format!(
                        "{} bytes, over the hook's limit of {MAX_ANNOTATION_BYTES} bytes",
                        value.len()
                    ),
                ));
            }
        }
        if let Some(value) = annotations.get(VOLUMES_ANNOTATION) {
            for entry in value.split(',').map(str::trim).filter(|e| !e.is_empty()) {
                let v: VolumeArg = entry.parse().map_err(|reason: String| {
                    // VolumeArg's messages start by quoting the flag; the entry is named already.
                    let prefix = format!("--volume '{entry}': ");
                    let reason = reason.strip_prefix(&prefix).unwrap_or(&reason).to_string();
                    bad(VOLUMES_ANNOTATION, entry, reason)
                })?;
                if !v.container_path.starts_with('/') {
                    return Err(bad(
                        VOLUMES_ANNOTATION,
                        entry,
                        format!(
                            "container path '{}' must be absolute (it lands inside the rootfs)",
                            v.container_path
                        ),
                    ));
                }
                out.volumes.push(v);
            }
        }
        if let Some(value) = annotations.get(RESOURCES_ANNOTATION) {
            let resources = parse_resources(value)
                .map_err(|e| bad(RESOURCES_ANNOTATION, "(json)", e.to_string()))?;
            for r in &resources {
                if let Some(path) = r.container_path() {
                    if !path.starts_with('/') {
                        let volume = r
                            .source_id()
                            .map(str::to_string)
                            .unwrap_or_else(|| r.describe());
                        return Err(bad(
                            RESOURCES_ANNOTATION,
                            &volume,
                            format!("container path '{path}' must be absolute (it lands inside the rootfs)"),
                        ));
                    }
                }
            }
            out.resources = resources;
        }
        let entries = out.volumes.len() + out.resources.len();
        if entries > MAX_ANNOTATION_ENTRIES {
            return Err(too_large(
                "io.csi-isolator.volumes and io.csi-isolator.resources",
                format!(
                    "{entries} volumes named, over the hook's limit of {MAX_ANNOTATION_ENTRIES} per container"
                ),
            ));
        }
        Ok(out)
    }
}

/// Whose volume names a container's annotations use (see "Who may name what" in the module doc).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Tenant {
    /// Tenants are off: the host is one tenant, names are passed as written.
    Single,
    /// The value of the operator's tenant annotation ([`validate_tenant`]).
    Named(String),
}

impl std::fmt::Display for Tenant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Tenant::Single => f.write_str("the single tenant"),
            Tenant::Named(t) => write!(f, "tenant '{t}'"),
        }
    }
}

impl Tenant {
    /// The name the provider is asked for when an annotation says `name`: `<tenant>.<name>`, or `name`
    /// for the single tenant. Fails (saying why) when that is over CSI's 128 bytes.
    pub fn scoped_name(&self, name: &str) -> Result<String, String> {
        let scoped = match self {
            Tenant::Single => name.to_string(),
            Tenant::Named(t) => format!("{t}{TENANT_SEPARATOR}{name}"),
        };
        if scoped.len() > MAX_NAME_BYTES {
            let counted = match self {
                Tenant::Single => "",
                Tenant::Named(_) => ", the tenant and the '.' included",
            };
            return Err(format!(
                "the volume name the provider is asked for is {} bytes{counted}, over CSI's limit of \
                 {MAX_NAME_BYTES} bytes; choose a shorter name",
                scoped.len()
            ));
        }
        Ok(scoped)
    }

    /// Whether a volume recorded under `recorded` (`None`: a volume declared by id, without a name) is
    /// this tenant's: any volume for the single tenant; for a named tenant, a name `<tenant>.<...>`.
    pub fn owns(&self, recorded: Option<&str>) -> bool {
        match self {
            Tenant::Single => true,
            Tenant::Named(t) => recorded
                .and_then(|n| n.split_once(TENANT_SEPARATOR))
                .is_some_and(|(owner, _)| owner == t),
        }
    }
}

/// Checks a tenant: 1 to [`MAX_TENANT_BYTES`] bytes of `a-z`, `0-9` and `-`, starting and ending with
/// a letter or digit (a DNS-1123 label, which a Kubernetes namespace is). So it never holds
/// [`TENANT_SEPARATOR`], nor anything that needs escaping in a message.
pub fn validate_tenant(value: &str) -> Result<(), String> {
    let allowed = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-';
    if value.is_empty() {
        Err("is empty".to_string())
    } else if value.len() > MAX_TENANT_BYTES {
        Err(format!(
            "is {} bytes, over the limit of {MAX_TENANT_BYTES}",
            value.len()
        ))
    } else if let Some(c) = value.chars().find(|c| !allowed(*c)) {
        Err(format!(
            "'{}' holds {c:?}: a tenant is a DNS-1123 label (a-z, 0-9, '-')",
            crate::shown::shown(value)
        ))
    } else if value.starts_with('-') || value.ends_with('-') {
        Err(format!(
            "'{value}' starts or ends with '-': a tenant is a DNS-1123 label"
        ))
    } else {
        Ok(())
    }
}

/// What a resources annotation's disks must match to be volumes of this hook's provider. Before the
/// provider is started only what its configuration tells is known (a plugin at an endpoint names its
/// type, hence the provider id and root, only once asked); the same rule runs again, complete, after.
#[derive(Clone, Copy, Debug)]
pub struct OwnVolumes<'a> {
    /// The provider id, once known.
    pub provider_id: Option<&'a str>,
    /// The provider's relative mounts root `./csi/<type>/<name>/mounts`, once known.
    pub mounts_root: Option<&'a str>,
    /// The provider's volumes (volume id -> recorded name), once it is started.
    pub volumes: Option<&'a BTreeMap<String, Option<String>>>,
    /// The container's tenant.
    pub tenant: &'a Tenant,
}

/// Whether `resource` (an entry of a resources annotation) is a volume of this hook's provider, of the
/// container's tenant: a disk with this provider's id, `disk.source.type` `MOUNT` or `PATH`, the root
/// of that type exactly the provider's relative mounts root, and `disk.source.id` a volume the provider
/// knows whose recorded name is the tenant's. The reason names the field and the value.
pub fn admit_resource(resource: &Resource, own: &OwnVolumes<'_>) -> Result<(), String> {
    use crate::resource::SourceType;
    use crate::shown::shown;
    if !resource.is_disk() {
        return Err("it is not a disk (the annotation names volumes)".to_string());
    }
    match (resource.provider_id(), own.provider_id) {
        (None, _) => {
            return Err("it has no provider_id (a disk of the host, not a volume)".to_string())
        }
        (Some(theirs), Some(ours)) if theirs != ours => {
            return Err(format!(
                "provider_id '{}' is not this hook's provider",
                shown(theirs)
            ))
        }
        _ => {}
    }
    let Some(source) = resource.disk_source() else {
        return Err(
            "it has no disk.source (the agent's default disk, a host directory)".to_string(),
        );
    };
    let field = match source.kind {
        SourceType::Mount => "disk.source.mount.root",
        SourceType::Path => "disk.source.path.root",
        ref other => {
            return Err(format!(
                "disk.source.type {} is not MOUNT or PATH",
                shown(other.as_str())
            ))
        }
    };
    let root = match source.root() {
        None => return Err(format!("it has no {field}")),
        Some(root) if root.starts_with('/') => {
            return Err(format!(
                "{field} '{}' is a host path, not the provider's relative mounts root",
                shown(root)
            ))
        }
        Some(root) => root,
    };
    if let Some(ours) = own.mounts_root.filter(|ours| root != *ours) {
        return Err(format!(
            "{field} '{}' is not the provider's mounts root '{ours}'",
            shown(root)
        ));
    }
    let id = match source.id.as_deref() {
        None | Some("") => return Err("it names no volume (disk.source.id)".to_string()),
        Some(id) => id,
    };
    if let Some(volumes) = own.volumes {
        match volumes.get(id) {
            None => {
                return Err(format!(
                    "disk.source.id '{}' is not a volume the provider knows",
                    shown(id)
                ))
            }
            Some(name) if !own.tenant.owns(name.as_deref()) => {
                return Err(format!(
                    "volume '{}' is not a volume of {}",
                    shown(id),
                    own.tenant
                ))
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// What a tenant's volumes take: how many, and their capacity in bytes (as the provider recorded it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Volumes.
    pub volumes: u64,
    /// Bytes.
    pub bytes: u64,
}

impl Usage {
    /// What the volumes of `tenant` among `records` take: the named volumes (created ones; a volume
    /// declared by id was not made by an annotation) that the tenant owns.
    pub fn of_tenant<'a>(
        tenant: &Tenant,
        records: impl IntoIterator<Item = &'a crate::provider::state::VolumeRecord>,
    ) -> Usage {
        records
            .into_iter()
            .filter(|r| r.name.is_some() && tenant.owns(r.name.as_deref()))
            .fold(Usage::default(), |u, r| Usage {
                volumes: u.volumes + 1,
                bytes: u.bytes.saturating_add(r.capacity_bytes),
            })
    }
}

/// A cap a creation would exceed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CapExceeded {
    /// [`MAX_VOLUMES_FLAG`].
    Volumes {
        /// The cap.
        cap: u64,
        /// The tenant's volumes before this one.
        used: u64,
    },
    /// [`MAX_CAPACITY_FLAG`].
    Capacity {
        /// The cap, in bytes.
        cap: u64,
        /// The tenant's bytes before this volume.
        used: u64,
        /// This volume's bytes.
        asked: u64,
    },
}

impl std::fmt::Display for CapExceeded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CapExceeded::Volumes { cap, used } => write!(
                f,
                "the tenant has {used} volumes and the cap is {cap} (the operator sets it with \
                 {MAX_VOLUMES_FLAG})"
            ),
            CapExceeded::Capacity { cap, used, asked } => write!(
                f,
                "{asked} more bytes would take the tenant from {used} bytes over the cap of {cap} \
                 bytes (the operator sets it with {MAX_CAPACITY_FLAG})"
            ),
        }
    }
}

/// Checks the creations `new` (name as written, bytes; in order) against the caps, starting from the
/// tenant's `used`: the first that would take the tenant over a cap is returned with the cap.
pub fn check_caps<'a>(
    policy: &HookPolicy,
    used: Usage,
    new: &[(&'a str, u64)],
) -> Result<(), (&'a str, CapExceeded)> {
    let mut now = used;
    for &(name, bytes) in new {
        if now.volumes >= policy.max_volumes_per_tenant {
            return Err((
                name,
                CapExceeded::Volumes {
                    cap: policy.max_volumes_per_tenant,
                    used: now.volumes,
                },
            ));
        }
        let total = now.bytes.checked_add(bytes);
        if total.is_none_or(|t| t > policy.max_capacity_per_tenant) {
            return Err((
                name,
                CapExceeded::Capacity {
                    cap: policy.max_capacity_per_tenant,
                    used: now.bytes,
                    asked: bytes,
                },
            ));
        }
        now = Usage {
            volumes: now.volumes + 1,
            bytes: total.unwrap_or(u64::MAX),
        };
    }
    Ok(())
}

/// What the operator allows annotations (the hook's own arguments; never from an annotation).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HookPolicy {
    /// [`ALLOW_RAW_RESOURCES_FLAG`]: resources annotations are mounted as given, host paths included.
    pub allow_raw_resources: bool,
    /// [`TENANT_ANNOTATION_FLAG`]: the annotation whose value is the tenant; `None`: single tenant.
    pub tenant_annotation: Option<String>,
    /// [`MAX_VOLUMES_FLAG`].
    pub max_volumes_per_tenant: u64,
    /// [`MAX_CAPACITY_FLAG`], in bytes.
    pub max_capacity_per_tenant: u64,
}

impl Default for HookPolicy {
    fn default() -> Self {
        HookPolicy {
            allow_raw_resources: false,
            tenant_annotation: None,
            max_volumes_per_tenant: DEFAULT_MAX_VOLUMES_PER_TENANT,
            max_capacity_per_tenant: DEFAULT_MAX_CAPACITY_PER_TENANT,
        }
    }
}

impl HookPolicy {
    /// The tenant of a container with `annotations`: [`Tenant::Single`] without a tenant annotation;
    /// else its value, refused when missing or not valid ([`validate_tenant`]).
    pub fn tenant(
        &self,
        container: &str,
        annotations: &BTreeMap<String, String>,
    ) -> Result<Tenant, HookError> {
        let Some(key) = &self.tenant_annotation else {
            return Ok(Tenant::Single);
        };
        let refused = |reason: String| HookError::Tenant {
            container: container.to_string(),
            annotation: key.clone(),
            reason,
        };
        let value = annotations
            .get(key)
            .ok_or_else(|| refused("is missing".to_string()))?;
        validate_tenant(value).map_err(refused)?;
        Ok(Tenant::Named(value.clone()))
    }
}

/// Builds the provider's configuration for the work dir (canonical by then).
pub type ProviderFactory =
    Arc<dyn Fn(&Path) -> Result<ProviderConfig, String> + Send + Sync + 'static>;

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
        (self.provider)(work_dir).map_err(|reason| HookError::ProviderConfig {
            container: container.to_string(),
            reason,
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

/// Runs the hook `stage` for the container `state` describes.
pub async fn run(stage: Stage, opts: &HookOptions, state: &State) -> Result<(), HookError> {
    match stage {
        Stage::CreateRuntime => create_runtime(opts, state).await.map(|_| ()),
        Stage::Poststop => poststop(opts, state).await,
    }
}

fn validate_id(id: &str) -> Result<(), HookError> {
    crate::resource::validate_container_id(id).map_err(|e| HookError::InvalidContainerId {
        container: id.to_string(),
        reason: e.to_string(),
    })
}

/// `<work_dir>/oci-hook/<id>`.
pub fn container_dir(work_dir: &Path, id: &str) -> PathBuf {
    checkpoint_paths::hook_sandbox(work_dir, id)
}

/// A volume of the volumes annotation, with the name the provider is asked for.
struct Wanted<'a> {
    arg: &'a VolumeArg,
    scoped: String,
}

/// Refuses the resources annotation's entries that are not the provider's own (see
/// [`admit_resource`]), unless the operator allows raw resources.
fn admit_resources(
    container: &str,
    policy: &HookPolicy,
    resources: &[Resource],
    own: &OwnVolumes<'_>,
) -> Result<(), HookError> {
    if policy.allow_raw_resources {
        return Ok(());
    }
    for r in resources {
        admit_resource(r, own).map_err(|reason| HookError::ResourceRefused {
            container: container.to_string(),
            resource: r.describe(),
            provider: own.provider_id.unwrap_or("(not yet known)").to_string(),
            reason,
        })?;
    }
    Ok(())
}

/// create-runtime: publishes the annotated volumes and mounts them into the container (see the module
/// doc). Returns the mounts made (empty for a container without volume annotations).
#[tracing::instrument(skip_all, fields(container_id = %state.id))]
pub async fn create_runtime(
    opts: &HookOptions,
    state: &State,
) -> Result<Vec<VolumeMount>, HookError> {
    let id = state.id.as_str();
    validate_id(id)?;
    let bundle = BundleConfig::read(id, &state.bundle)?;
    let mut annotations = state.annotations.clone();
    annotations.extend(bundle.annotations.clone());
    let wanted = HookVolumes::from_annotations(id, &annotations)?;
    if wanted.is_empty() {
        return Ok(Vec::new());
    }
    // Everything that needs no provider is judged before the work dir is touched.
    let tenant = opts.policy.tenant(id, &annotations)?;
    let named = wanted
        .volumes
        .iter()
        .map(|arg| {
            let scoped = tenant
                .scoped_name(&arg.name)
                .map_err(|reason| HookError::VolumeName {
                    container: id.to_string(),
                    volume: arg.name.clone(),
                    tenant: tenant.clone(),
                    reason,
                })?;
            Ok(Wanted { arg, scoped })
        })
        .collect::<Result<Vec<_>, HookError>>()?;
    let pid = state
        .pid
        .filter(|p| *p > 0)
        .and_then(|p| u32::try_from(p).ok())
        .ok_or_else(|| HookError::NoPid {
            container: id.to_string(),
        })?;
    let rootfs = std::fs::canonicalize(&bundle.rootfs).map_err(|source| HookError::Rootfs {
        container: id.to_string(),
        path: bundle.rootfs.clone(),
        source,
    })?;

    let work_dir = crate::workdir::canonical(&opts.work_dir)?;
    let config = opts.provider_config(id, &work_dir)?;
    // What the configuration tells about the provider, checked before the lock and the plugin.
    let configured_root = (!config.plugin_type.is_empty()).then(|| {
        crate::resource::Layout::new(&work_dir, &config.plugin_type, &config.plugin_name)
            .relative_mount_root()
    });
    admit_resources(
        id,
        &opts.policy,
        &wanted.resources,
        &OwnVolumes {
            provider_id: Some(config.provider_id.as_str()).filter(|p| !p.is_empty()),
            mounts_root: configured_root.as_deref(),
            volumes: None,
            tenant: &tenant,
        },
    )?;
    let lock = lock_work_dir(&work_dir, opts.lock_timeout).await?;
    let provider = StorageProvider::start(config)
        .await
        .map_err(|source| HookError::Provider {
            container: id.to_string(),
            source: Box::new(source),
        })?;
    let request = Request {
        work_dir: &work_dir,
        policy: &opts.policy,
        id,
        pid,
        rootfs: &rootfs,
        tenant: &tenant,
    };
    let result = create_with_provider(&request, &named, &wanted.resources, provider.clone()).await;
    provider.shutdown(PLUGIN_STOP_GRACE).await;
    drop(lock);
    result
}

/// One create-runtime, once the work dir is canonical and the container's tenant known.
struct Request<'a> {
    work_dir: &'a Path,
    policy: &'a HookPolicy,
    id: &'a str,
    pid: u32,
    rootfs: &'a Path,
    tenant: &'a Tenant,
}

async fn create_with_provider(
    req: &Request<'_>,
    named: &[Wanted<'_>],
    raw_resources: &[Resource],
    provider: Arc<StorageProvider>,
) -> Result<Vec<VolumeMount>, HookError> {
    let id = req.id;
    let isolator = VolumeIsolator::on_host(req.work_dir, provider.clone());
    reap_stale(&isolator, req.work_dir, id).await;

    let records = provider.volumes().await;
    let known: BTreeMap<String, Option<String>> = records
        .iter()
        .map(|r| (r.volume_id.clone(), r.name.clone()))
        .collect();
    let root = provider.layout().relative_mount_root();
    admit_resources(
        id,
        req.policy,
        raw_resources,
        &OwnVolumes {
            provider_id: Some(provider.id()),
            mounts_root: Some(&root),
            volumes: Some(&known),
            tenant: req.tenant,
        },
    )?;
    // The caps, before any CreateVolume: the volumes this container would add to its tenant's.
    let mut new: Vec<(&str, u64)> = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for w in named {
        let exists = records
            .iter()
            .any(|r| r.name.as_deref() == Some(w.scoped.as_str()));
        if !exists && seen.insert(w.scoped.as_str()) {
            new.push((w.arg.name.as_str(), w.arg.size_bytes));
        }
    }
    let used = Usage::of_tenant(req.tenant, &records);
    if let Err((volume, exceeded)) = check_caps(req.policy, used, &new) {
        return Err(HookError::CapExceeded {
            container: id.to_string(),
            volume: volume.to_string(),
            tenant: req.tenant.clone(),
            exceeded,
        });
    }

    let mut resources = raw_resources.to_vec();
    // Volume id -> the name in the annotation and its tenant, so errors name the volume as the user
    // wrote it.
    let mut names: BTreeMap<String, String> = BTreeMap::new();
    for w in named {
        let v = w.arg;
        let mut spec = CreateSpec::new(&w.scoped, v.size_bytes);
        if let Some(existing) = records
            .iter()
            .find(|r| r.name.as_deref() == Some(w.scoped.as_str()))
        {
            spec.capability = existing.capability.clone();
        }
        let res = provider
            .create_volume(spec)
            .await
            .map_err(|source| HookError::CreateVolume {
                container: id.to_string(),
                volume: v.name.clone(),
                tenant: req.tenant.clone(),
                source: Box::new(source),
            })?;
        tracing::info!(volume = %v.name, tenant = %req.tenant, volume_id = res.source_id().unwrap_or("-"), "volume for the container");
        let mode = if v.readonly {
            VolumeMode::Ro
        } else {
            VolumeMode::Rw
        };
        if let Some(vid) = res.source_id() {
            names.insert(vid.to_string(), format!("'{}' of {}", v.name, req.tenant));
        }
        resources.push(res.with_volume(&v.container_path, mode));
    }

    let sandbox = container_dir(req.work_dir, id);
    make_real_dir(&req.work_dir.join(HOOK_DIR))?;
    make_real_dir(&sandbox)?;
    let config = ContainerConfig {
        resources,
        sandbox: sandbox.clone(),
        rootfs: Some(req.rootfs.to_path_buf()),
        user: None,
    };
    let launch = match isolator.prepare(id, config).await {
        Ok(launch) => launch,
        Err(e) => {
            remove_container_dir(req.work_dir, id);
            return Err(e.into());
        }
    };
    let mut attached: Vec<OwnedFd> = Vec::new();
    let mut failure = None;
    for m in &launch.mounts {
        match mount_into_rootfs(id, req.pid, req.rootfs, m) {
            Ok(tree) => attached.push(tree),
            Err(mut e) => {
                if let HookError::Mount { volume, .. } = &mut e {
                    if let Some(name) = names.get(volume.as_str()) {
                        *volume = format!("{name} ({volume})");
                    }
                }
                failure = Some(e);
                break;
            }
        }
    }
    if failure.is_none() {
        if let Err(e) = isolator.isolate(id, req.pid).await {
            failure = Some(e.into());
        }
    }
    if let Some(e) = failure {
        if let Err(undo) = unmount_in_namespace(req.pid, &attached) {
            tracing::error!(container_id = id, error = %undo, "unmount from the container failed");
        }
        if let Err(undo) = isolator.cleanup(id).await {
            tracing::error!(container_id = id, error = %undo, "release after a failed create-runtime failed");
        }
        remove_container_dir(req.work_dir, id);
        return Err(e);
    }
    tracing::info!(
        container_id = id,
        pid = req.pid,
        tenant = %req.tenant,
        mounts = launch.mounts.len(),
        "volumes mounted into the container"
    );
    Ok(launch.mounts)
}

/// poststop: releases the container's use of its volumes (see the module doc). Idempotent.
#[tracing::instrument(skip_all, fields(container_id = %state.id))]
pub async fn poststop(opts: &HookOptions, state: &State) -> Result<(), HookError> {
    let id = state.id.as_str();
    validate_id(id)?;
    let work_dir = crate::workdir::canonical(&opts.work_dir)?;
    let checkpoint = crate::isolator::volume::checkpoint_root(&work_dir).join(id);
    let sandbox = container_dir(&work_dir, id);
    if std::fs::symlink_metadata(&checkpoint).is_err()
        && std::fs::symlink_metadata(&sandbox).is_err()
    {
        // Never prepared by create-runtime (or already cleaned up): nothing is in use.
        return Ok(());
    }
    let config = opts.provider_config(id, &work_dir)?;
    let lock = lock_work_dir(&work_dir, opts.lock_timeout).await?;
    let provider = StorageProvider::start(config)
        .await
        .map_err(|source| HookError::Provider {
            container: id.to_string(),
            source: Box::new(source),
        })?;
    let isolator = VolumeIsolator::on_host(&work_dir, provider.clone());
    let result = isolator.cleanup(id).await.map_err(HookError::from);
    if result.is_ok() {
        remove_container_dir(&work_dir, id);
    }
    provider.shutdown(PLUGIN_STOP_GRACE).await;
    drop(lock);
    result
}

/// Cleans up hook containers other than `current` (see [`hook_sandbox_of`]) whose init process is gone
/// or was never recorded. Failures are logged: they must not fail another container.
async fn reap_stale(isolator: &VolumeIsolator, work_dir: &Path, current: &str) {
    // Only records whose every path passed the checkpoint checks; `run`'s containers (sandboxes
    // elsewhere) and anything else are left alone.
    for rec in isolator.checkpointed() {
        if rec.container_id == current || !checkpoint_paths::is_hook_container(&rec, work_dir) {
            continue;
        }
        let alive = rec
            .pid
            .is_some_and(|pid| Path::new(&format!("/proc/{pid}")).exists());
        if alive {
            continue;
        }
        tracing::warn!(container_id = %rec.container_id, pid = ?rec.pid, "hook container is gone without poststop; releasing its volumes");
        match isolator.cleanup(&rec.container_id).await {
            Ok(()) => remove_container_dir(work_dir, &rec.container_id),
            Err(err) => {
                tracing::error!(container_id = %rec.container_id, error = %err, "cleanup of a stale hook container failed")
            }
        }
    }
}

/// Takes the work dir's lock, waiting up to `timeout` (hooks are short, so
/// one waits for another instead of failing).
pub async fn lock_work_dir(work_dir: &Path, timeout: Duration) -> Result<WorkDirLock, HookError> {
    Ok(crate::workdir::lock(work_dir, Some(timeout)).await?)
}

/// Makes the directory `path` (0700; its parent must exist) or takes the one there, refusing a symlink
/// or anything else: a hook directory is never somewhere else than where it is named.
fn make_real_dir(path: &Path) -> Result<(), HookError> {
    use std::os::unix::fs::DirBuilderExt;
    let fail = |step, source| HookError::Io {
        step,
        path: path.to_path_buf(),
        source,
    };
    match std::fs::DirBuilder::new().mode(0o700).create(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            let meta = std::fs::symlink_metadata(path).map_err(|e| fail("stat directory", e))?;
            if meta.file_type().is_dir() {
                Ok(())
            } else {
                Err(fail(
                    "check directory",
                    std::io::Error::other(
                        "a symlink or not a directory; remove it (the hook makes its own)",
                    ),
                ))
            }
        }
        Err(e) => Err(fail("create directory", e)),
    }
}

/// Removes the hook container directory `<work_dir>/oci-hook/<id>` (logged on failure; kept while
/// anything is mounted under it). See [`remove_beneath_hook_dir`].
fn remove_container_dir(work_dir: &Path, id: &str) {
    if let Err(reason) = remove_beneath_hook_dir(work_dir, id) {
        tracing::error!(dir = %container_dir(work_dir, id).display(), %reason, "hook container directory kept");
    }
}

/// Removes `<work_dir>/oci-hook/<id>` without following a symlink: `oci-hook` is opened by fd (refused
/// if a symlink or not a directory), `<id>` beneath it must be a real directory, and its tree is removed
/// by fd, entry by entry, never leaving the file system it is on (a mount under it is refused, not
/// emptied) and bounded in depth and entries. A missing directory is done already.
pub fn remove_beneath_hook_dir(work_dir: &Path, id: &str) -> Result<(), String> {
    use nix::fcntl::{open, OFlag};
    use nix::sys::stat::Mode;
    crate::resource::validate_container_id(id).map_err(|e| e.to_string())?;
    let hook_dir = work_dir.join(HOOK_DIR);
    let dir_flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let parent = match open(&hook_dir, dir_flags, Mode::empty()) {
        Ok(fd) => fd,
        Err(nix::errno::Errno::ENOENT) => return Ok(()),
        Err(e @ (nix::errno::Errno::ELOOP | nix::errno::Errno::ENOTDIR)) => {
            return Err(format!(
                "{}: a symlink or not a directory ({e}); refused",
                hook_dir.display()
            ))
        }
        Err(e) => return Err(format!("open {}: {e}", hook_dir.display())),
    };
    let st = match nix::sys::stat::fstatat(&parent, id, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW) {
        Ok(st) => st,
        Err(nix::errno::Errno::ENOENT) => return Ok(()),
        Err(e) => return Err(format!("stat {id} in {}: {e}", hook_dir.display())),
    };
    if st.st_mode & libc::S_IFMT != libc::S_IFDIR {
        return Err(format!(
            "{id} in {} is not a directory (a symlink?); refused",
            hook_dir.display()
        ));
    }
    let dir = container_dir(work_dir, id);
    match ProcMountTable::new().mounts_under(&dir) {
        Ok(m) if m.is_empty() => {}
        Ok(_) => return Err("still mounted under it".to_string()),
        Err(e) => return Err(format!("read the mount table: {e}")),
    }
    let mut budget = MAX_REMOVE_ENTRIES;
    remove_tree(
        parent.as_fd(),
        std::ffi::OsStr::new(id),
        st.st_dev,
        0,
        &mut budget,
    )
}

/// Removes the directory `name` beneath `parent` (and everything in it) by fd; see
/// [`remove_beneath_hook_dir`].
fn remove_tree(
    parent: BorrowedFd<'_>,
    name: &std::ffi::OsStr,
    dev: libc::dev_t,
    depth: usize,
    budget: &mut usize,
) -> Result<(), String> {
    use nix::fcntl::{openat, AtFlags, OFlag};
    use nix::sys::stat::{fstat, fstatat, Mode};
    use nix::unistd::{unlinkat, UnlinkatFlags};
    let shown = || crate::shown::shown_os(name).into_owned();
    if depth >= MAX_REMOVE_DEPTH {
        return Err(format!(
            "{} is nested over {MAX_REMOVE_DEPTH} levels",
            shown()
        ));
    }
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let fd =
        openat(parent, name, flags, Mode::empty()).map_err(|e| format!("open {}: {e}", shown()))?;
    let st = fstat(&fd).map_err(|e| format!("stat {}: {e}", shown()))?;
    if st.st_dev != dev {
        return Err(format!("{} is on another file system (a mount)", shown()));
    }
    // The listing gets its own descriptor (Dir owns it); the removals go through `fd`.
    let listing = fd
        .try_clone()
        .map_err(|e| format!("dup {}: {e}", shown()))?;
    let mut entries = Vec::new();
    for entry in nix::dir::Dir::from_fd(listing)
        .map_err(|e| format!("list {}: {e}", shown()))?
        .iter()
    {
        let entry = entry.map_err(|e| format!("list {}: {e}", shown()))?;
        let child = std::ffi::OsStr::from_bytes(entry.file_name().to_bytes());
        if child == "." || child == ".." {
            continue;
        }
        if *budget == 0 {
            return Err(format!("more than {MAX_REMOVE_ENTRIES} entries"));
        }
        *budget -= 1;
        entries.push(child.to_os_string());
    }
    for child in &entries {
        let st = fstatat(&fd, child.as_os_str(), AtFlags::AT_SYMLINK_NOFOLLOW)
            .map_err(|e| format!("stat {}: {e}", crate::shown::shown_os(child)))?;
        if st.st_mode & libc::S_IFMT == libc::S_IFDIR {
            remove_tree(fd.as_fd(), child, dev, depth + 1, budget)?;
        } else {
            // A symlink is removed itself, never followed.
            unlinkat(&fd, child.as_os_str(), UnlinkatFlags::NoRemoveDir)
                .map_err(|e| format!("remove {}: {e}", crate::shown::shown_os(child)))?;
        }
    }
    unlinkat(parent, name, UnlinkatFlags::RemoveDir).map_err(|e| format!("remove {}: {e}", shown()))
}

fn volume_name(m: &VolumeMount) -> String {
    m.volume_id
        .clone()
        .unwrap_or_else(|| m.source.display().to_string())
}

/// Runs `work` on a fresh thread that leaves the process's shared fs state and enters the mount namespace
/// of `pid` (`ns_fd`); the thread ends when `work` returns.
fn in_namespace<T: Send>(
    ns_fd: BorrowedFd<'_>,
    work: impl FnOnce(&dyn Syscall) -> Result<T, (&'static str, String)> + Send,
) -> Result<T, (&'static str, String)> {
    std::thread::scope(|scope| {
        let handle = std::thread::Builder::new()
            .name("csi-oci-hook".to_string())
            .spawn_scoped(scope, move || {
                let sys = LinuxSyscall::new();
                ns::unshare_fs().map_err(|e| ("unshare(CLONE_FS)", e.to_string()))?;
                sys.enter_mount_namespace(ns_fd)
                    .map_err(|e| ("enter the container's mount namespace", e.to_string()))?;
                work(&sys)
            })
            .map_err(|e| ("spawn the namespace thread", e.to_string()))?;
        handle
            .join()
            .map_err(|_| ("namespace thread", "panicked".to_string()))?
    })
}

/// Mounts `mount` (a rootfs target) into the mount namespace of the container whose init process is `pid`,
/// before its `pivot_root`: at `<rootfs>/<target>` as that namespace sees it, `rootfs` being the
/// canonical host path of the container's rootfs (see the module doc). Returns the attached tree's fd,
/// which names the new mount (for a rollback).
pub fn mount_into_rootfs(
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
    let sys = LinuxSyscall::new();
    let ns_fd = ns::open_mount_namespace(pid)
        .map_err(|e| fail("open mount namespace", format!("/proc/{pid}/ns/mnt: {e}")))?;
    // The source first: a missing volume fails before anything is created in the rootfs.
    // Opened beneath its trusted root by fd (no symlink inside a volume is followed), host-only flags
    // cleared on the container's copy.
    let tree = mount
        .clone_for_container(&sys)
        .map_err(|e| fail("clone source", e.to_string()))?;
    if mount.readonly {
        sys.set_readonly_by_fd(tree.as_fd(), true)
            .map_err(|e| fail("make read-only", e.to_string()))?;
    }
    let ns_root = PathBuf::from(format!("/proc/{pid}/root"));
    let rootfs_fd = mount::open_in_root(&ns_root, rootfs).map_err(|e| {
        fail(
            "open the rootfs in the container's mount namespace",
            e.to_string(),
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
    .map_err(|e| fail("resolve target in the rootfs", e.to_string()))?;
    in_namespace(ns_fd.as_fd(), |sys| {
        sys.move_mount_to_fd(tree.as_fd(), target.as_fd())
            .map_err(|e| ("attach", e.to_string()))
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
fn unmount_in_namespace(pid: u32, trees: &[OwnedFd]) -> Result<(), String> {
    if trees.is_empty() {
        return Ok(());
    }
    let ns_fd = ns::open_mount_namespace(pid).map_err(|e| format!("/proc/{pid}/ns/mnt: {e}"))?;
    in_namespace(ns_fd.as_fd(), |sys| {
        for tree in trees.iter().rev() {
            sys.unmount(&mount::proc_fd_path(tree.as_fd()), true)
                .map_err(|e| ("unmount", e.to_string()))?;
        }
        Ok(())
    })
    .map_err(|(step, reason)| format!("{step}: {reason}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn annotations(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn state_parses_runtime_spec_json() {
        let s = State::parse(
            br#"{"ociVersion":"1.0.2","id":"c1","status":"creating","pid":4242,
                 "bundle":"/b","annotations":{"io.csi-isolator.volumes":"d:1M:/d"}}"#,
        )
        .unwrap();
        assert_eq!(s.id, "c1");
        assert_eq!(s.pid, Some(4242));
        assert_eq!(s.bundle, PathBuf::from("/b"));
        assert_eq!(s.annotations[VOLUMES_ANNOTATION], "d:1M:/d");
        // poststop: stopped, no pid, no annotations.
        let s =
            State::parse(br#"{"ociVersion":"1.0.2","id":"c1","status":"stopped","bundle":"/b"}"#)
                .unwrap();
        assert_eq!(s.pid, None);
        assert!(s.annotations.is_empty());
        let err = State::parse(b"{\"id\":1}").unwrap_err().to_string();
        assert!(
            err.starts_with("parse the container state (stdin): "),
            "{err}"
        );
    }

    #[test]
    fn annotations_table() {
        let ok = HookVolumes::from_annotations(
            "c",
            &annotations(&[(VOLUMES_ANNOTATION, "data:64M:/data, ref:1G:/ref:ro,")]),
        )
        .unwrap();
        assert_eq!(ok.volumes.len(), 2);
        assert_eq!(ok.volumes[0].container_path, "/data");
        assert!(ok.volumes[1].readonly);
        assert!(ok.resources.is_empty());
        assert!(
            HookVolumes::from_annotations("c", &annotations(&[("other", "x")]))
                .unwrap()
                .is_empty()
        );

        for (key, value, says) in [
            (
                VOLUMES_ANNOTATION,
                "data:lots:/data",
                "annotation io.csi-isolator.volumes: volume 'data:lots:/data': invalid SIZE 'lots'",
            ),
            (
                VOLUMES_ANNOTATION,
                "a:1M:/a,data:1M:rel",
                "volume 'data:1M:rel': container path 'rel' must be absolute",
            ),
            (VOLUMES_ANNOTATION, "data:1M:/x:rx", "unknown mode 'rx'"),
            (
                RESOURCES_ANNOTATION,
                "{not json",
                "annotation io.csi-isolator.resources: volume '(json)'",
            ),
        ] {
            let err = HookVolumes::from_annotations("c", &annotations(&[(key, value)]))
                .unwrap_err()
                .to_string();
            assert!(err.starts_with("container 'c': "), "{err}");
            assert!(err.contains(says), "{value}: {err}");
        }
    }

    #[test]
    fn bundle_config_joins_a_relative_root() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("config.json"),
            r#"{"ociVersion":"1.0.2","root":{"path":"rootfs"},"annotations":{"k":"v"}}"#,
        )
        .unwrap();
        let c = BundleConfig::read("c", dir.path()).unwrap();
        assert_eq!(c.rootfs, dir.path().join("rootfs"));
        assert_eq!(c.annotations["k"], "v");
        std::fs::write(dir.path().join("config.json"), r#"{"root":{}}"#).unwrap();
        let err = BundleConfig::read("c", dir.path()).unwrap_err().to_string();
        assert!(err.starts_with("container 'c': parse "), "{err}");
    }

    #[test]
    fn tenants_are_dns_1123_labels() {
        for good in ["a", "ns-a", "team1", "0", &"a".repeat(MAX_TENANT_BYTES)] {
            validate_tenant(good).unwrap_or_else(|e| panic!("{good:?}: {e}"));
        }
        for (bad, says) in [
            ("", "is empty"),
            (
                &*"a".repeat(MAX_TENANT_BYTES + 1),
                "64 bytes, over the limit of 63",
            ),
            ("ns.a", "holds '.'"),
            ("NS", "holds 'N'"),
            ("a/b", "holds '/'"),
            ("a b", "holds ' '"),
            ("a\nb", "holds '\\n'"),
            ("ns_a", "holds '_'"),
            ("-a", "starts or ends with '-'"),
            ("a-", "starts or ends with '-'"),
        ] {
            let err = validate_tenant(bad).unwrap_err();
            assert!(err.contains(says), "{bad:?}: {err}");
        }
    }

    #[test]
    fn scoped_names_map_one_to_one() {
        let a = Tenant::Named("a".to_string());
        let ab = Tenant::Named("a-b".to_string());
        for (tenant, name, scoped) in [
            (&Tenant::Single, "data", "data"),
            (&Tenant::Single, "a.data", "a.data"),
            (&a, "data", "a.data"),
            (&a, "b.data", "a.b.data"),
            (&ab, "data", "a-b.data"),
        ] {
            assert_eq!(tenant.scoped_name(name).unwrap(), scoped, "{tenant} {name}");
            assert!(tenant.owns(Some(scoped)), "{tenant} owns {scoped}");
        }
        // The tenant is everything before the first '.', which a tenant never holds: no two
        // (tenant, name) pairs meet, and no tenant owns another's volume.
        assert_ne!(a.scoped_name("b.data"), ab.scoped_name("data"));
        for (tenant, recorded, owns) in [
            (&a, Some("a.data"), true),
            (&a, Some("a-b.data"), false),
            (&ab, Some("a.data"), false),
            (&a, Some("ab.data"), false),
            (&a, Some("a"), false),
            (&a, Some("data"), false),
            (&a, None, false),
            (&Tenant::Single, None, true),
            (&Tenant::Single, Some("b.data"), true),
        ] {
            assert_eq!(tenant.owns(recorded), owns, "{tenant} {recorded:?}");
        }
        // CSI's 128 bytes count the tenant and the separator.
        let name = "n".repeat(MAX_NAME_BYTES - 2);
        assert_eq!(a.scoped_name(&name).unwrap().len(), MAX_NAME_BYTES);
        let err = a.scoped_name(&format!("{name}n")).unwrap_err();
        assert!(
            err.contains("129 bytes, the tenant and the '.' included, over CSI's limit of 128"),
            "{err}"
        );
        Tenant::Single
            .scoped_name(&"n".repeat(MAX_NAME_BYTES))
            .unwrap();
        let err = Tenant::Single
            .scoped_name(&"n".repeat(MAX_NAME_BYTES + 1))
            .unwrap_err();
        assert!(err.contains("129 bytes, over CSI's limit"), "{err}");
    }

    #[test]
    fn tenant_comes_from_the_operators_annotation() {
        let on = HookPolicy {
            tenant_annotation: Some("io.kubernetes.pod.namespace".to_string()),
            ..HookPolicy::default()
        };
        let key = "io.kubernetes.pod.namespace";
        assert_eq!(
            HookPolicy::default()
                .tenant("c", &annotations(&[(key, "ns-a")]))
                .unwrap(),
            Tenant::Single
        );
        assert_eq!(
            on.tenant("c", &annotations(&[(key, "ns-a")])).unwrap(),
            Tenant::Named("ns-a".to_string())
        );
        for (pairs, says) in [
            (
                vec![],
                "tenant annotation 'io.kubernetes.pod.namespace' is missing",
            ),
            (vec![(key, "")], "is empty"),
            (vec![(key, "a.b")], "holds '.'"),
            (vec![("other", "ns-a")], "is missing"),
        ] {
            let err = on
                .tenant("c", &annotations(&pairs))
                .unwrap_err()
                .to_string();
            assert!(err.starts_with("container 'c': "), "{err}");
            assert!(err.contains(says), "{pairs:?}: {err}");
            assert!(
                err.contains("--tenant-annotation io.kubernetes.pod.namespace"),
                "{err}"
            );
        }
    }

    #[test]
    fn resources_admission_table() {
        use serde_json::json;
        const ROOT: &str = "./csi/t/n/mounts";
        let a = Tenant::Named("a".to_string());
        let known: BTreeMap<String, Option<String>> = [
            ("vol-a".to_string(), Some("a.data".to_string())),
            ("vol-b".to_string(), Some("b.data".to_string())),
            ("vol-pre".to_string(), None),
        ]
        .into_iter()
        .collect();
        let own = |tenant| OwnVolumes {
            provider_id: Some("t.n"),
            mounts_root: Some(ROOT),
            volumes: Some(&known),
            tenant,
        };
        let before_start = OwnVolumes {
            provider_id: None,
            mounts_root: None,
            volumes: None,
            tenant: &a,
        };
        let disk = |provider: Option<&str>, source: serde_json::Value| {
            let mut r = json!({"name": "disk", "type": "SCALAR", "scalar": {"value": 16},
                "disk": {"source": source, "volume": {"container_path": "/d", "mode": "RW"}}});
            if let Some(p) = provider {
                r["provider_id"] = json!({"value": p});
            }
            if r["disk"]["source"].is_null() {
                r["disk"].as_object_mut().unwrap().remove("source");
            }
            serde_json::from_value::<Resource>(r).unwrap()
        };
        let mount =
            |root: &str, id: &str| json!({"type": "MOUNT", "mount": {"root": root}, "id": id});
        let ok = disk(Some("t.n"), mount(ROOT, "vol-a"));
        admit_resource(&ok, &own(&a)).unwrap();
        admit_resource(&ok, &own(&Tenant::Single)).unwrap();
        admit_resource(&ok, &before_start).unwrap();
        let path = disk(
            Some("t.n"),
            json!({"type": "PATH", "path": {"root": ROOT}, "id": "vol-a"}),
        );
        admit_resource(&path, &own(&a)).unwrap();
        // A volume declared by id (no name) is the single tenant's, no named tenant's.
        let pre = disk(Some("t.n"), mount(ROOT, "vol-pre"));
        admit_resource(&pre, &own(&Tenant::Single)).unwrap();

        for (r, own, says) in [
            (disk(None, mount("/", "x")), own(&a), "no provider_id"),
            (disk(None, mount("/", "x")), before_start, "no provider_id"),
            (
                disk(Some("other.n"), mount(ROOT, "vol-a")),
                own(&a),
                "provider_id 'other.n' is not this hook's provider",
            ),
            (
                disk(Some("t.n"), serde_json::Value::Null),
                own(&a),
                "no disk.source",
            ),
            (
                disk(Some("t.n"), mount("/", "vol-a")),
                before_start,
                "disk.source.mount.root '/' is a host path",
            ),
            (
                disk(Some("t.n"), mount("/root/secret", "vol-a")),
                own(&a),
                "disk.source.mount.root '/root/secret' is a host path",
            ),
            (
                disk(
                    Some("t.n"),
                    json!({"type": "PATH", "path": {"root": "/srv"}, "id": "vol-a"}),
                ),
                own(&a),
                "disk.source.path.root '/srv' is a host path",
            ),
            (
                disk(Some("t.n"), mount("./csi/t/n/mounts/../../../..", "vol-a")),
                own(&a),
                "is not the provider's mounts root './csi/t/n/mounts'",
            ),
            (
                disk(Some("t.n"), mount("csi/t/n/mounts", "vol-a")),
                own(&a),
                "is not the provider's mounts root",
            ),
            (
                disk(Some("t.n"), json!({"type": "MOUNT", "id": "vol-a"})),
                own(&a),
                "no disk.source.mount.root",
            ),
            (
                disk(Some("t.n"), json!({"type": "BLOCK", "id": "vol-a"})),
                own(&a),
                "disk.source.type BLOCK is not MOUNT or PATH",
            ),
            (
                disk(
                    Some("t.n"),
                    json!({"type": "MOUNT", "mount": {"root": ROOT}}),
                ),
                own(&a),
                "names no volume",
            ),
            (
                disk(Some("t.n"), mount(ROOT, "vol-nope")),
                own(&a),
                "disk.source.id 'vol-nope' is not a volume the provider knows",
            ),
            (
                disk(Some("t.n"), mount(ROOT, "vol-b")),
                own(&a),
                "volume 'vol-b' is not a volume of tenant 'a'",
            ),
            (
                pre.clone(),
                own(&a),
                "volume 'vol-pre' is not a volume of tenant 'a'",
            ),
            (Resource::scalar("cpus", 1.0), own(&a), "not a disk"),
        ] {
            let err = admit_resource(&r, &own).unwrap_err();
            assert!(err.contains(says), "{}: {err}", r.describe());
        }

        // The hook's error names the resource, the reason and the operator's way out.
        let policy = HookPolicy::default();
        let err = admit_resources("c", &policy, &[disk(None, mount("/", "x"))], &own(&a))
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with(
                "container 'c': annotation io.csi-isolator.resources: resource disk (id \"x\") refused: "
            ) && err.contains("provider 't.n'")
                && err.contains("--allow-raw-resources in the hook's arguments"),
            "{err}"
        );
        let raw = HookPolicy {
            allow_raw_resources: true,
            ..HookPolicy::default()
        };
        admit_resources("c", &raw, &[disk(None, mount("/", "x"))], &own(&a)).unwrap();
    }

    #[test]
    fn caps_table() {
        let policy = HookPolicy {
            max_volumes_per_tenant: 2,
            max_capacity_per_tenant: 100,
            ..HookPolicy::default()
        };
        let used = |volumes, bytes| Usage { volumes, bytes };
        for (from, new, expect) in [
            (used(0, 0), vec![], Ok(())),
            (used(0, 0), vec![("a", 50), ("b", 50)], Ok(())),
            (used(1, 0), vec![("a", 100)], Ok(())),
            (
                used(2, 0),
                vec![("a", 1)],
                Err(("a", CapExceeded::Volumes { cap: 2, used: 2 })),
            ),
            (
                used(0, 0),
                vec![("a", 1), ("b", 1), ("c", 1)],
                Err(("c", CapExceeded::Volumes { cap: 2, used: 2 })),
            ),
            (
                used(1, 60),
                vec![("a", 41)],
                Err((
                    "a",
                    CapExceeded::Capacity {
                        cap: 100,
                        used: 60,
                        asked: 41,
                    },
                )),
            ),
            (
                used(0, 0),
                vec![("a", 60), ("b", 60)],
                Err((
                    "b",
                    CapExceeded::Capacity {
                        cap: 100,
                        used: 60,
                        asked: 60,
                    },
                )),
            ),
            (
                used(0, u64::MAX),
                vec![("a", 1)],
                Err((
                    "a",
                    CapExceeded::Capacity {
                        cap: 100,
                        used: u64::MAX,
                        asked: 1,
                    },
                )),
            ),
        ] {
            assert_eq!(check_caps(&policy, from, &new), expect, "{from:?} {new:?}");
        }
        let zero = HookPolicy {
            max_volumes_per_tenant: 0,
            ..HookPolicy::default()
        };
        assert!(check_caps(&zero, used(0, 0), &[("a", 1)]).is_err());
        let says = CapExceeded::Volumes { cap: 2, used: 2 }.to_string();
        assert!(
            says.contains("has 2 volumes and the cap is 2")
                && says.contains("--max-volumes-per-tenant"),
            "{says}"
        );
        let says = CapExceeded::Capacity {
            cap: 100,
            used: 60,
            asked: 41,
        }
        .to_string();
        assert!(
            says.contains("41 more bytes would take the tenant from 60 bytes over the cap of 100")
                && says.contains("--max-capacity-per-tenant"),
            "{says}"
        );
    }

    #[test]
    fn usage_counts_the_tenants_named_volumes() {
        use crate::provider::state::VolumeRecord;
        let rec = |name: Option<&str>, bytes| {
            let mut r = VolumeRecord::new(format!("vol-{name:?}"), Default::default());
            r.name = name.map(str::to_string);
            r.capacity_bytes = bytes;
            r
        };
        let records = [
            rec(Some("a.x"), 10),
            rec(Some("a.y"), 20),
            rec(Some("b.x"), 40),
            rec(Some("ab.x"), 80),
            rec(None, 160),
        ];
        let a = Tenant::Named("a".to_string());
        assert_eq!(
            Usage::of_tenant(&a, &records),
            Usage {
                volumes: 2,
                bytes: 30
            }
        );
        assert_eq!(
            Usage::of_tenant(&Tenant::Single, &records),
            Usage {
                volumes: 4,
                bytes: 150
            }
        );
    }

    #[test]
    fn annotations_are_bounded() {
        let many = (0..=MAX_ANNOTATION_ENTRIES)
            .map(|i| format!("v{i}:1M:/v{i}"))
            .collect::<Vec<_>>()
            .join(",");
        let err = HookVolumes::from_annotations("c", &annotations(&[(VOLUMES_ANNOTATION, &many)]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("33 volumes named, over the hook's limit of 32 per container"),
            "{err}"
        );
        let long = format!("v:1M:/{}", "x".repeat(MAX_ANNOTATION_BYTES));
        let err = HookVolumes::from_annotations("c", &annotations(&[(VOLUMES_ANNOTATION, &long)]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("annotation io.csi-isolator.volumes: 65542 bytes, over the hook's limit"),
            "{err}"
        );
        let err =
            HookVolumes::from_annotations("c", &annotations(&[(RESOURCES_ANNOTATION, &long)]))
                .unwrap_err()
                .to_string();
        assert!(
            err.contains("annotation io.csi-isolator.resources: ")
                && err.contains("bytes, over the hook's limit"),
            "{err}"
        );
    }

    #[test]
    fn removal_stays_beneath_the_hook_dir_and_follows_no_symlink() {
        let dir = tempfile::tempdir().unwrap();
        let work = dir.path().join("work");
        let decoy = dir.path().join("decoy");
        std::fs::create_dir_all(decoy.join("sub")).unwrap();
        std::fs::write(decoy.join("sub/keep"), "x").unwrap();
        let hook = work.join(HOOK_DIR);
        // A real container directory with a tree, a symlink to the decoy inside: removed, the link
        // itself and not what it names.
        std::fs::create_dir_all(hook.join("c1/a/b")).unwrap();
        std::fs::write(hook.join("c1/a/b/f"), "x").unwrap();
        std::os::unix::fs::symlink(&decoy, hook.join("c1/a/link")).unwrap();
        remove_beneath_hook_dir(&work, "c1").unwrap();
        assert!(!hook.join("c1").exists());
        assert!(decoy.join("sub/keep").exists());
        // Missing: nothing to do.
        remove_beneath_hook_dir(&work, "c1").unwrap();
        // The container directory a symlink: refused, the decoy kept.
        std::os::unix::fs::symlink(&decoy, hook.join("c2")).unwrap();
        let err = remove_beneath_hook_dir(&work, "c2").unwrap_err();
        assert!(err.contains("not a directory"), "{err}");
        assert!(decoy.join("sub/keep").exists());
        // The oci-hook directory a symlink: refused.
        std::fs::remove_dir_all(&hook).unwrap();
        std::fs::create_dir_all(decoy.join("c3")).unwrap();
        std::os::unix::fs::symlink(&decoy, &hook).unwrap();
        let err = remove_beneath_hook_dir(&work, "c3").unwrap_err();
        assert!(err.contains("a symlink or not a directory"), "{err}");
        assert!(decoy.join("c3").is_dir());
        // An id that is not a path component never reaches the file system.
        assert!(remove_beneath_hook_dir(&work, "..").is_err());
    }

    #[test]
    fn container_ids_must_be_path_components() {
        for bad in ["", "..", "a/b"] {
            assert!(validate_id(bad).is_err(), "{bad:?}");
        }
        validate_id("my-container_1").unwrap();
    }
}
