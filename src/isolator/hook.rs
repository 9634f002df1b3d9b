//! An OCI runtime hook (`csi-isolator oci-hook create-runtime|poststop`): CSI volumes for containers that an
//! OCI runtime (runc) starts, named by annotations in the bundle's `config.json`.
//!
//! # Contract
//! - Input: the container state on stdin (runtime-spec `state`: `ociVersion`, `id`, `status`, `pid`,
//!   `bundle`, `annotations`) and the bundle's `config.json` (`root.path`, relative to the bundle or
//!   absolute, and `annotations`; where both carry an annotation, `config.json` wins).
//! - Annotations (either or both):
//!   - [`VOLUMES_ANNOTATION`] `io.csi-isolator.volumes`: comma-separated `NAME:SIZE:CONTAINER_PATH[:ro]`,
//!     the syntax of `run --volume` ([`VolumeArg`]): the volume is created on the provider if no volume
//!     of that name exists (the same name is the same volume next time).
//!   - [`RESOURCES_ANNOTATION`] `io.csi-isolator.resources`: a Mesos Resource JSON list, mounted as given.
//!
//!   `CONTAINER_PATH`s must be absolute: they land inside the container's rootfs. A container without
//!   either annotation is left alone (no lock, no provider).
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
//! came (the runtime was killed): a checkpointed container with a sandbox under `<work_dir>/oci-hook`
//! whose recorded init pid is gone (or that never got one: its hook died mid-way, as the lock says no
//! other hook is running) is cleaned up. A recycled pid only delays that (the volume stays published).
//!
//! A work dir may be shared with `csi-isolator run`: `run` only cleans up containers of earlier runs
//! (sandboxes under `<work_dir>/sandboxes`) and keeps the hook's, whose sandboxes are under `oci-hook/`.

use std::collections::BTreeMap;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

use crate::isolator::{
    ContainerConfig, ContainerRecord, IsolatorError, TargetRoot, VolumeIsolator, VolumeMount,
};
use crate::mount::{self, ns, LinuxSyscall, MountTable, ProcMountTable, Syscall};
use crate::provider::{CreateSpec, ProviderConfig, ProviderError, StorageProvider};
use crate::resource::{parse_resources, Resource, VolumeMode};
use crate::runner::VolumeArg;
use crate::workdir::WorkDirLock;

/// The annotation naming volumes by `NAME:SIZE:CONTAINER_PATH[:ro]`, comma-separated.
pub const VOLUMES_ANNOTATION: &str = "io.csi-isolator.volumes";
/// The annotation carrying a Mesos Resource JSON list of volumes.
pub const RESOURCES_ANNOTATION: &str = "io.csi-isolator.resources";
/// The directory under the work dir holding one directory per hook container.
pub const HOOK_DIR: &str = "oci-hook";
/// How long a hook waits for the work-dir lock by default.
pub const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the bundled plugin gets to stop after the hook's work.
const PLUGIN_STOP_GRACE: Duration = Duration::from_secs(5);

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
    #[error("container '{container}': volume '{volume}': create: {source}")]
    CreateVolume {
        /// The container id.
        container: String,
        /// The volume name.
        volume: String,
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
        Ok(out)
    }
}

/// The hook's own options (from its command line in `config.json`).
#[derive(Clone, Debug)]
pub struct HookOptions {
    /// The work dir (shared with other hook invocations, and possibly with `run`).
    pub work_dir: PathBuf,
    /// The provider: bundled plugin or endpoint.
    pub provider: ProviderConfig,
    /// How long to wait for the work-dir lock.
    pub lock_timeout: Duration,
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
    work_dir.join(HOOK_DIR).join(id)
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

    mkdir(&opts.work_dir)?;
    let lock = lock_work_dir(&opts.work_dir, opts.lock_timeout).await?;
    let provider = StorageProvider::start(opts.provider.clone())
        .await
        .map_err(|source| HookError::Provider {
            container: id.to_string(),
            source: Box::new(source),
        })?;
    let result = create_with_provider(opts, id, pid, &rootfs, &wanted, provider.clone()).await;
    provider.shutdown(PLUGIN_STOP_GRACE).await;
    drop(lock);
    result
}

async fn create_with_provider(
    opts: &HookOptions,
    id: &str,
    pid: u32,
    rootfs: &Path,
    wanted: &HookVolumes,
    provider: Arc<StorageProvider>,
) -> Result<Vec<VolumeMount>, HookError> {
    let isolator = VolumeIsolator::on_host(&opts.work_dir, provider.clone());
    reap_stale(&isolator, &opts.work_dir, id).await;

    let mut resources = wanted.resources.clone();
    // Volume id -> the name in the annotation, so errors name the volume as the user wrote it.
    let mut names: BTreeMap<String, String> = BTreeMap::new();
    for v in &wanted.volumes {
        let mut spec = CreateSpec::new(&v.name, v.size_bytes);
        if let Some(existing) = provider.find_by_name(&v.name).await {
            spec.capability = existing.capability;
        }
        let res = provider
            .create_volume(spec)
            .await
            .map_err(|source| HookError::CreateVolume {
                container: id.to_string(),
                volume: v.name.clone(),
                source: Box::new(source),
            })?;
        let mode = if v.readonly {
            VolumeMode::Ro
        } else {
            VolumeMode::Rw
        };
        if let Some(vid) = res.source_id() {
            names.insert(vid.to_string(), v.name.clone());
        }
        resources.push(res.with_volume(&v.container_path, mode));
    }

    let sandbox = container_dir(&opts.work_dir, id);
    mkdir(&sandbox)?;
    let config = ContainerConfig {
        resources,
        sandbox: sandbox.clone(),
        rootfs: Some(rootfs.to_path_buf()),
        user: None,
    };
    let launch = match isolator.prepare(id, config).await {
        Ok(launch) => launch,
        Err(e) => {
            remove_container_dir(&sandbox);
            return Err(e.into());
        }
    };
    let mut attached: Vec<OwnedFd> = Vec::new();
    let mut failure = None;
    for m in &launch.mounts {
        match mount_into_rootfs(id, pid, rootfs, m) {
            Ok(tree) => attached.push(tree),
            Err(mut e) => {
                if let HookError::Mount { volume, .. } = &mut e {
                    if let Some(name) = names.get(volume.as_str()) {
                        *volume = format!("'{name}' ({volume})");
                    }
                }
                failure = Some(e);
                break;
            }
        }
    }
    if failure.is_none() {
        if let Err(e) = isolator.isolate(id, pid).await {
            failure = Some(e.into());
        }
    }
    if let Some(e) = failure {
        if let Err(undo) = unmount_in_namespace(pid, &attached) {
            tracing::error!(container_id = id, error = %undo, "unmount from the container failed");
        }
        if let Err(undo) = isolator.cleanup(id).await {
            tracing::error!(container_id = id, error = %undo, "release after a failed create-runtime failed");
        }
        remove_container_dir(&sandbox);
        return Err(e);
    }
    tracing::info!(
        container_id = id,
        pid,
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
    let checkpoint = opts
        .work_dir
        .join("isolators")
        .join("volume")
        .join("csi")
        .join(id);
    let sandbox = container_dir(&opts.work_dir, id);
    if !checkpoint.exists() && !sandbox.exists() {
        // Never prepared by create-runtime (or already cleaned up): nothing is in use.
        return Ok(());
    }
    let lock = lock_work_dir(&opts.work_dir, opts.lock_timeout).await?;
    let provider = StorageProvider::start(opts.provider.clone())
        .await
        .map_err(|source| HookError::Provider {
            container: id.to_string(),
            source: Box::new(source),
        })?;
    let isolator = VolumeIsolator::on_host(&opts.work_dir, provider.clone());
    let result = isolator.cleanup(id).await.map_err(HookError::from);
    if result.is_ok() {
        remove_container_dir(&sandbox);
    }
    provider.shutdown(PLUGIN_STOP_GRACE).await;
    drop(lock);
    result
}

/// Cleans up hook containers (sandbox under `<work_dir>/oci-hook`) other than `current` whose init
/// process is gone or was never recorded. Failures are logged: they must not fail another container.
async fn reap_stale(isolator: &VolumeIsolator, work_dir: &Path, current: &str) {
    let hook_root = work_dir.join(HOOK_DIR);
    let Ok(entries) = std::fs::read_dir(isolator.checkpoint_root()) else {
        return;
    };
    for e in entries.flatten() {
        let Ok(bytes) = std::fs::read(e.path().join("state.json")) else {
            continue;
        };
        let Ok(rec) = serde_json::from_slice::<ContainerRecord>(&bytes) else {
            continue;
        };
        if rec.container_id == current || !rec.config.sandbox.starts_with(&hook_root) {
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
            Ok(()) => remove_container_dir(&rec.config.sandbox),
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

fn mkdir(path: &Path) -> Result<(), HookError> {
    std::fs::create_dir_all(path).map_err(|source| HookError::Io {
        step: "create directory",
        path: path.to_path_buf(),
        source,
    })
}

/// Removes a hook container's directory unless something is mounted under it.
fn remove_container_dir(dir: &Path) {
    match ProcMountTable::new().mounts_under(dir) {
        Ok(m) if m.is_empty() => {
            if let Err(e) = std::fs::remove_dir_all(dir) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!(dir = %dir.display(), error = %e, "cannot remove the hook container directory");
                }
            }
        }
        _ => {
            tracing::error!(dir = %dir.display(), "still mounted under the hook container directory; kept")
        }
    }
}

/// `/proc/self/fd/N`: a path naming exactly the object `fd` holds.
fn fd_link(fd: BorrowedFd<'_>) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()))
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
    let tree = sys
        .open_tree_clone(&mount.source, true)
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
    let is_file = std::fs::metadata(&mount.source)
        .map(|m| !m.is_dir())
        .unwrap_or(false);
    let target = mount::create_in_root(&fd_link(rootfs_fd.as_fd()), &mount.target, is_file)
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
            sys.unmount(&fd_link(tree.as_fd()), true)
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
    fn container_ids_must_be_path_components() {
        for bad in ["", "..", "a/b"] {
            assert!(validate_id(bad).is_err(), "{bad:?}");
        }
        validate_id("my-container_1").unwrap();
    }
}
