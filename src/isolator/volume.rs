//! The volume isolator (see the module doc of [`crate::isolator`]).
//!
//! Invariants:
//! - A container's checkpoint (`<work_dir>/isolators/volume/csi/<id>/state.json`)
//!   is durable before its volumes are published, so a crash in between
//!   leaves a record that `recover` cleans up; it is removed last at cleanup.
//! - A failed prepare or update leaves nothing behind: what was published
//!   for it is released, what was mounted is unmounted.
//! - Operations on one container run one at a time; different containers in
//!   parallel (no isolator-wide lock is held across a publish).
//! - A checkpoint read back (`recover`, `checkpointed`) or acted on
//!   (`cleanup`) names only paths that pass [`checkpoint_paths`]: absolute,
//!   normal, beneath their expected root and free of symlinks, checked by fd
//!   right before anything under them is unmounted. One that fails is set
//!   aside (recovery) or refused (cleanup); nothing it names is unmounted or
//!   removed.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::isolator::checkpoint_paths::{self, CheckpointPathError};
use crate::isolator::error::IsolatorError;
use crate::isolator::launch_info::{ContainerConfig, LaunchInfo};
use crate::isolator::oci::{self, OciPrepared};
use crate::isolator::process_check;
use crate::isolator::targets::volume_mounts;
use crate::mount::{unmount_all_under, MountTable, Syscall};
use crate::mount::{VolumeMount, SANDBOX_IN_ROOTFS};
use crate::provider::checkpoint;
use crate::provider::Manager;
use crate::resource::Resource;

pub use crate::isolator::record::{ContainerRecord, FORMAT_VERSION};

/// What `recover` found and did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IsolatorRecovery {
    /// Containers recovered (known and checkpointed).
    pub recovered: Vec<String>,
    /// Containers cleaned up because they no longer exist.
    pub cleaned: Vec<String>,
    /// (volume, container) uses released because the container is gone.
    pub released_uses: Vec<(String, String)>,
    /// Checkpoints that could not be read, or that name paths not safe to act
    /// on (see [`checkpoint_paths`]), set aside or left alone (path, reason):
    /// nothing they name is unmounted, removed or signalled.
    pub corrupt: Vec<(PathBuf, String)>,
    /// What could not be done, per container (id, error); retried at the
    /// next recovery or cleanup.
    pub failures: Vec<(String, String)>,
}

type Entry = Arc<tokio::sync::Mutex<Option<ContainerRecord>>>;

/// The volume isolator.
#[derive(Debug)]
pub struct VolumeIsolator {
    work_dir: PathBuf,
    manager: Arc<Manager>,
    sys: Arc<dyn Syscall>,
    table: Arc<dyn MountTable>,
    containers: Mutex<BTreeMap<String, Entry>>,
}

impl VolumeIsolator {
    /// An isolator for the agent work dir `work_dir`, publishing through `manager`.
    pub fn new(
        work_dir: impl Into<PathBuf>,
        manager: Arc<Manager>,
        sys: Arc<dyn Syscall>,
        table: Arc<dyn MountTable>,
    ) -> Self {
        VolumeIsolator {
            work_dir: work_dir.into(),
            manager,
            sys,
            table,
            containers: Mutex::new(BTreeMap::new()),
        }
    }

    /// The isolator of one provider on this host: real mount syscalls and this process's mount
    /// table (what `run`, `serve` and the OCI hook each use).
    pub fn on_host(
        work_dir: impl Into<PathBuf>,
        provider: Arc<crate::provider::StorageProvider>,
    ) -> Self {
        let mut manager = Manager::new();
        manager.add(provider);
        VolumeIsolator::new(
            work_dir,
            Arc::new(manager),
            Arc::new(crate::mount::LinuxSyscall::new()),
            Arc::new(crate::mount::ProcMountTable::new()),
        )
    }

    /// The mount table this isolator reads.
    pub fn mount_table(&self) -> Arc<dyn MountTable> {
        self.table.clone()
    }

    /// The provider manager.
    pub fn manager(&self) -> &Arc<Manager> {
        &self.manager
    }

    /// `<work_dir>/isolators/volume/csi`.
    pub fn checkpoint_root(&self) -> PathBuf {
        checkpoint_root(&self.work_dir)
    }

    fn checkpoint_path(&self, container: &str) -> PathBuf {
        checkpoint_path(&self.work_dir, container)
    }

    fn entry(&self, container: &str) -> Entry {
        self.containers
            .lock()
            .unwrap()
            .entry(container.to_string())
            .or_default()
            .clone()
    }

    /// The records of the containers the isolator knows.
    pub async fn containers(&self) -> Vec<ContainerRecord> {
        let entries: Vec<Entry> = self.containers.lock().unwrap().values().cloned().collect();
        let mut out = Vec::new();
        for e in entries {
            if let Some(r) = e.lock().await.clone() {
                out.push(r);
            }
        }
        out
    }

    fn persist(&self, rec: &ContainerRecord) -> Result<(), IsolatorError> {
        let path = self.checkpoint_path(&rec.container_id);
        let bytes = serde_json::to_vec_pretty(rec).expect("a container record always serializes");
        checkpoint::write_atomic(&path, &bytes).map_err(|e| IsolatorError::Checkpoint {
            container: rec.container_id.clone(),
            path,
            reason: e.to_string(),
        })
    }

    fn forget(&self, container: &str) -> Result<(), IsolatorError> {
        let path = self.checkpoint_path(container);
        checkpoint::remove_durable(&path).map_err(|e| IsolatorError::Checkpoint {
            container: container.to_string(),
            path: path.clone(),
            reason: e.to_string(),
        })?;
        if let Some(dir) = path.parent() {
            let _ = std::fs::remove_dir(dir);
        }
        Ok(())
    }

    /// Prepare: publishes the container's volumes (ensure-all, per
    /// provider) and returns one bind mount per volume. On failure nothing
    /// stays published for it and the error names the volume.
    #[tracing::instrument(skip(self, config))]
    pub async fn prepare(
        &self,
        container_id: &str,
        config: ContainerConfig,
    ) -> Result<LaunchInfo, IsolatorError> {
        crate::resource::validate_container_id(container_id).map_err(|e| {
            IsolatorError::InvalidContainerId {
                container: container_id.to_string(),
                reason: e.to_string(),
            }
        })?;
        let entry = self.entry(container_id);
        let mut slot = entry.lock().await;
        if slot.is_some() {
            return Err(IsolatorError::AlreadyPrepared {
                container: container_id.to_string(),
            });
        }
        let mounts = volume_mounts(container_id, &config, &config.resources, &self.work_dir)?;
        self.check_writable(container_id, &mounts).await?;
        check_config(container_id, &config, &self.work_dir)?;
        let rec = ContainerRecord::new(container_id, config, mounts.clone());
        self.persist(&rec)?;
        if let Err(source) = self
            .manager
            .publish(container_id, &rec.config.resources)
            .await
        {
            let _ = self.forget(container_id);
            return Err(IsolatorError::Provider {
                container: container_id.to_string(),
                source: Box::new(source),
            });
        }
        *slot = Some(rec);
        Ok(LaunchInfo { mounts })
    }

    /// Prepare for the Docker/OCI path: [`prepare`](Self::prepare), then each
    /// volume bind-mounted on the host into `<sandbox>/<container_path>`
    /// (recorded, so cleanup unmounts it); returns the runtime's mounts.
    pub async fn prepare_oci(
        &self,
        container_id: &str,
        config: ContainerConfig,
    ) -> Result<(LaunchInfo, OciPrepared), IsolatorError> {
        let sandbox = config.sandbox.clone();
        let launch = self.prepare(container_id, config).await?;
        // Durably say that binds will be made in the sandbox before making
        // them, so cleanup after a crash in between still sweeps them.
        self.mark_host_binds(container_id).await?;
        match oci::prepare(&*self.sys, &sandbox, &launch) {
            Ok(prepared) => {
                self.record_host_binds(container_id, prepared.host_binds.clone())
                    .await?;
                Ok((launch, prepared))
            }
            Err(e) => {
                let _ = self.cleanup(container_id).await;
                Err(IsolatorError::Oci {
                    container: container_id.to_string(),
                    source: Box::new(e),
                })
            }
        }
    }

    /// Refuses read-write mounts of volumes published read-only or with a
    /// reader-only access mode.
    async fn check_writable(
        &self,
        container: &str,
        mounts: &[VolumeMount],
    ) -> Result<(), IsolatorError> {
        for m in mounts.iter().filter(|m| !m.readonly) {
            let (Some(pid), Some(vid)) = (&m.provider_id, &m.volume_id) else {
                continue;
            };
            let Some(provider) = self.manager.get(pid) else {
                continue;
            };
            if let Some(rec) = provider.volume(vid).await {
                let why = if rec.capability.is_reader_only() {
                    Some(format!(
                        "of reader-only access mode {}",
                        rec.capability.access_mode
                    ))
                } else if rec.readonly {
                    Some("published read-only".to_string())
                } else {
                    None
                };
                if let Some(why) = why {
                    return Err(IsolatorError::ReadOnlyVolume {
                        container: container.to_string(),
                        volume: vid.clone(),
                        why,
                    });
                }
            }
        }
        Ok(())
    }

    /// Isolate: records the container's pid (needed to mount into its
    /// namespace on update).
    pub async fn isolate(&self, container_id: &str, pid: u32) -> Result<(), IsolatorError> {
        let start = crate::launcher::process::process_start_time(pid);
        let view = crate::launcher::process::mount_view(pid);
        self.modify(container_id, |rec| {
            rec.pid = Some(pid);
            rec.pid_start = start;
            rec.mount_view = view;
        })
        .await
    }

    /// Isolate for a caller that may name any pid (serve's containerizer): the pid is recorded only
    /// if it is the container's process ([`process_check::not_the_container`]: not in the isolator's
    /// own mount namespace; with a rootfs, rooted in it by device and inode), checked and recorded
    /// under the container's lock from one reading of the process, its start time read before and
    /// after, so what is recorded is what was checked. A refusal records nothing.
    pub async fn isolate_verified(
        &self,
        container_id: &str,
        pid: u32,
    ) -> Result<(), IsolatorError> {
        use crate::launcher::process::{mount_view, process_start_time, shares_mount_namespace};
        use std::os::unix::fs::MetadataExt;
        let refuse = |why: String| IsolatorError::NotTheContainer {
            container: container_id.to_string(),
            pid,
            why,
        };
        self.try_modify(container_id, |rec| {
            let rootfs = match &rec.config.rootfs {
                Some(path) => {
                    let m = std::fs::metadata(path).map_err(|e| {
                        refuse(format!(
                            "its rootfs {} cannot be read: {e}",
                            crate::shown::shown_os(path.as_os_str())
                        ))
                    })?;
                    Some((m.dev(), m.ino()))
                }
                None => None,
            };
            let start =
                process_start_time(pid).ok_or_else(|| refuse("no such process".into()))?;
            let seen = process_check::Seen {
                view: mount_view(pid),
                shares_our_mount_namespace: shares_mount_namespace(pid),
            };
            if let Some(why) = process_check::not_the_container(rootfs, &seen) {
                return Err(refuse(why));
            }
            if process_start_time(pid) != Some(start) {
                return Err(refuse(
                    "it exited while it was being checked (its pid now names another process or none)"
                        .into(),
                ));
            }
            rec.pid = Some(pid);
            rec.pid_start = Some(start);
            rec.mount_view = seen.view;
            Ok(())
        })
        .await
    }

    /// Changes a known container's record and persists it.
    async fn modify(
        &self,
        container_id: &str,
        change: impl FnOnce(&mut ContainerRecord),
    ) -> Result<(), IsolatorError> {
        self.try_modify(container_id, |rec| {
            change(rec);
            Ok(())
        })
        .await
    }

    /// Changes a known container's record under its lock and persists it, unless `change` refuses
    /// (then nothing is persisted; `change` must leave the record as it was when it refuses).
    async fn try_modify(
        &self,
        container_id: &str,
        change: impl FnOnce(&mut ContainerRecord) -> Result<(), IsolatorError>,
    ) -> Result<(), IsolatorError> {
        let entry = self.entry(container_id);
        let mut slot = entry.lock().await;
        let rec = slot
            .as_mut()
            .ok_or_else(|| IsolatorError::UnknownContainer {
                container: container_id.to_string(),
            })?;
        change(rec)?;
        self.persist(rec)
    }

    async fn mark_host_binds(&self, container_id: &str) -> Result<(), IsolatorError> {
        self.modify(container_id, |rec| rec.binds_in_sandbox = true)
            .await
    }

    /// Records mounts made on the host for the container (Docker/OCI path),
    /// so cleanup unmounts them.
    pub async fn record_host_binds(
        &self,
        container_id: &str,
        binds: Vec<PathBuf>,
    ) -> Result<(), IsolatorError> {
        self.modify(container_id, |rec| rec.host_binds.extend(binds))
            .await
    }

    /// Update: new volumes are published first; then removed ones are
    /// unmounted from the running container's mount namespace and new ones
    /// mounted into it. Whatever fails, the checkpoint records what is
    /// really mounted and only the volumes the container no longer mounts
    /// are released; the error names the step and the volume.
    #[tracing::instrument(skip(self, resources))]
    pub async fn update(
        &self,
        container_id: &str,
        resources: Vec<Resource>,
    ) -> Result<(), IsolatorError> {
        let entry = self.entry(container_id);
        let mut slot = entry.lock().await;
        let rec = slot
            .as_mut()
            .ok_or_else(|| IsolatorError::UnknownContainer {
                container: container_id.to_string(),
            })?;
        let pid = live_pid(container_id, rec)?;
        let mut config = rec.config.clone();
        config.resources = resources.clone();
        let new_mounts = volume_mounts(container_id, &config, &resources, &self.work_dir)?;
        let added: Vec<VolumeMount> = new_mounts
            .iter()
            .filter(|m| !rec.mounts.contains(m))
            .cloned()
            .collect();
        let mut removed: Vec<VolumeMount> = rec
            .mounts
            .iter()
            .filter(|m| !new_mounts.contains(m))
            .cloned()
            .collect();
        // Deepest first: a volume nested in another goes before it.
        removed.sort_by_key(|m| std::cmp::Reverse(m.target.components().count()));
        // Taking a volume away from under one that stays would take that one too (its mount
        // hangs off the outer one): refused before anything changes.
        for m in &removed {
            let kept_inside = rec.mounts.iter().find(|k| {
                new_mounts.contains(k)
                    && k.root == m.root
                    && k.target != m.target
                    && k.target.starts_with(&m.target)
            });
            if let Some(kept) = kept_inside {
                return Err(IsolatorError::BadTarget {
                    container: container_id.to_string(),
                    volume: volume_name(m),
                    container_path: m.container_path.clone(),
                    reason: format!(
                        "volume {} stays mounted inside it at {}: remove both, or neither",
                        volume_name(kept),
                        kept.container_path
                    ),
                });
            }
        }
        self.check_writable(container_id, &added).await?;
        let sandbox_in = self.sandbox_in_container(&config);

        // 1. Publish what is new. Volumes the container uses already are only
        //    re-ensured; a failure undoes only the uses it added.
        let added_resources = resources_of(&resources, &added);
        self.manager
            .publish(container_id, &added_resources)
            .await
            .map_err(|source| IsolatorError::Provider {
                container: container_id.to_string(),
                source: Box::new(source),
            })?;

        // 2. Unmount what goes first (a target that changes volume or mode is
        //    then free), then mount what comes. `current` tracks what is
        //    really mounted in the container, whatever fails.
        let mut current = rec.mounts.clone();
        let mut failure = None;
        for m in &removed {
            let elsewhere = current.iter().any(|c| c != m && c.source == m.source);
            match crate::launcher::inject::unmount_from(pid, m, &sandbox_in, elsewhere) {
                Ok(()) => current.retain(|c| c != m),
                Err(reason) => {
                    failure = Some(IsolatorError::Namespace {
                        container: container_id.to_string(),
                        step: "unmount",
                        volume: volume_name(m),
                        reason: reason.to_string(),
                    });
                    break;
                }
            }
        }
        if failure.is_none() {
            for m in &added {
                match crate::launcher::inject::mount_into(pid, m, &sandbox_in) {
                    Ok(()) => current.push(m.clone()),
                    Err(reason) => {
                        failure = Some(IsolatorError::Namespace {
                            container: container_id.to_string(),
                            step: "mount",
                            volume: volume_name(m),
                            reason: reason.to_string(),
                        });
                        break;
                    }
                }
            }
        }

        // 3. Record what is mounted, then end the uses of volumes the
        //    container no longer mounts (and of new ones that did not make it).
        let mut all_resources = rec.config.resources.clone();
        all_resources.extend(resources.iter().cloned());
        if failure.is_none() {
            rec.config = config;
            rec.mounts = new_mounts;
        } else {
            rec.config.resources = resources_of(&all_resources, &current);
            rec.mounts = current;
        }
        self.persist(rec)?;
        let kept: HashSet<(Option<String>, Option<String>)> =
            rec.mounts.iter().map(volume_key).collect();
        let mut seen = HashSet::new();
        let release: Vec<Resource> = all_resources
            .into_iter()
            .filter(|r| r.container_path().is_some())
            .filter(|r| {
                let key = (
                    r.provider_id().map(str::to_string),
                    r.source_id().map(str::to_string),
                );
                !kept.contains(&key) && seen.insert(key)
            })
            .collect();
        let released = self.manager.unpublish(container_id, &release).await;
        if let Some(e) = failure {
            if let Err(r) = released {
                tracing::error!(container_id, error = %r, "release after a failed update failed");
            }
            return Err(e);
        }
        released.map_err(|source| IsolatorError::Provider {
            container: container_id.to_string(),
            source: Box::new(source),
        })
    }

    fn sandbox_in_container(&self, config: &ContainerConfig) -> PathBuf {
        if config.rootfs.is_some() {
            PathBuf::from(SANDBOX_IN_ROOTFS)
        } else {
            config.sandbox.clone()
        }
    }

    /// Cleanup: unmounts what the isolator mounted on the host for the
    /// container (bounded EBUSY retries, then a lazy detach) and releases its
    /// use of every volume (the provider unpublishes on last use).
    /// Idempotent.
    #[tracing::instrument(skip(self))]
    pub async fn cleanup(&self, container_id: &str) -> Result<(), IsolatorError> {
        let entry = self.entry(container_id);
        let mut slot = entry.lock().await;
        if let Some(rec) = slot.as_ref() {
            self.unmount_host_side(rec)?;
        }
        self.manager
            .release_container(container_id)
            .await
            .map_err(|source| IsolatorError::Provider {
                container: container_id.to_string(),
                source: Box::new(source),
            })?;
        self.forget(container_id)?;
        *slot = None;
        drop(slot);
        self.containers.lock().unwrap().remove(container_id);
        Ok(())
    }

    /// Unmounts what the isolator made on the host for `rec` (the sweep of
    /// its sandbox, its host binds), after checking every path by fd: the
    /// record's paths must pass [`checkpoint_paths::check_record`], the
    /// sandbox must open beneath its root with no symlink on the way, and so
    /// must each host bind beneath the sandbox's fd. The unmounts then go by
    /// the kernel's names for what was opened, through the mount table.
    fn unmount_host_side(&self, rec: &ContainerRecord) -> Result<(), IsolatorError> {
        let container = &rec.container_id;
        let refuse = |source: CheckpointPathError| {
            tracing::error!(container_id = %container, error = %source, "checkpoint names an unsafe path: nothing it names is unmounted");
            IsolatorError::Checkpoint {
                container: container.clone(),
                path: self.checkpoint_path(container),
                reason: format!("not trusted: {source}; nothing it names is unmounted or removed (check who can write the work dir)"),
            }
        };
        checkpoint_paths::check_record(rec, &self.work_dir).map_err(refuse)?;
        if !rec.binds_in_sandbox && rec.host_binds.is_empty() {
            return Ok(());
        }
        let Some((sandbox_fd, sandbox)) =
            checkpoint_paths::open_sandbox(rec, &self.work_dir).map_err(refuse)?
        else {
            // Nothing can be mounted under a directory that is not there.
            return Ok(());
        };
        let unmount = |path: &Path| {
            unmount_all_under(&*self.sys, &*self.table, path).map_err(|e| IsolatorError::Unmount {
                container: container.clone(),
                path: path.to_path_buf(),
                reason: e.to_string(),
            })
        };
        if rec.binds_in_sandbox {
            unmount(&sandbox)?;
        }
        let mut binds = rec.host_binds.clone();
        binds.sort_by_key(|b| std::cmp::Reverse(b.components().count()));
        for b in binds {
            let checked = checkpoint_paths::check_host_bind(rec, &sandbox_fd, &sandbox, &b)
                .map_err(refuse)?;
            if let Some(b) = checked {
                unmount(&b)?;
            }
        }
        Ok(())
    }

    /// The containers checkpointed on disk, without loading or changing
    /// anything: lets a caller that shares the work dir with other
    /// containerizers work out which containers are not its own. Only
    /// records that [`read_record`](Self::read_record) accepts (readable,
    /// their own directory's, paths safe to act on) are listed; the others
    /// are left to [`recover`](Self::recover), which sets them aside.
    pub fn checkpointed(&self) -> Vec<ContainerRecord> {
        let Ok(entries) = std::fs::read_dir(self.checkpoint_root()) else {
            return Vec::new();
        };
        entries
            .flatten()
            .filter_map(|e| self.read_record(&e).ok())
            .collect()
    }

    /// Reads one container's checkpoint from its directory entry under
    /// [`checkpoint_root`](Self::checkpoint_root) and checks it: a real
    /// directory (not a symlink), a record that parses, of a format this
    /// build knows, for the container its directory names, whose paths pass
    /// [`checkpoint_paths::check_record`] and whose sandbox and host binds
    /// open by fd without a symlink. The error says why (for the report).
    fn read_record(&self, e: &std::fs::DirEntry) -> Result<ContainerRecord, RecordRefusal> {
        let id = e.file_name().to_string_lossy().into_owned();
        if !e.file_type().is_ok_and(|t| t.is_dir()) {
            return Err(RecordRefusal::NotADirectory);
        }
        let path = e.path().join("state.json");
        let bytes = read_checkpoint_file(&path).map_err(RecordRefusal::Unreadable)?;
        let rec = serde_json::from_slice::<ContainerRecord>(&bytes)
            .map_err(|e| RecordRefusal::Bad(e.to_string()))?;
        if rec.container_id != id {
            return Err(RecordRefusal::Bad(format!(
                "container id '{}' does not match its directory",
                crate::shown::shown(&rec.container_id)
            )));
        }
        if rec.format > FORMAT_VERSION {
            return Err(RecordRefusal::Bad(format!(
                "format {} is newer than this build's {FORMAT_VERSION}",
                rec.format
            )));
        }
        let unsafe_path = |e: CheckpointPathError| RecordRefusal::Bad(e.to_string());
        checkpoint_paths::check_record(&rec, &self.work_dir).map_err(unsafe_path)?;
        if let Some((fd, name)) =
            checkpoint_paths::open_sandbox(&rec, &self.work_dir).map_err(unsafe_path)?
        {
            for b in &rec.host_binds {
                checkpoint_paths::check_host_bind(&rec, &fd, &name, b).map_err(unsafe_path)?;
            }
        }
        Ok(rec)
    }

    /// Recover: rebuilds from the checkpoints; containers not in `known`
    /// are cleaned up, and volume uses by containers that exist nowhere, or
    /// by recovered containers whose checkpoint does not have the volume
    /// (an update interrupted by a crash), are released.
    pub async fn recover(&self, known: &[String]) -> Result<IsolatorRecovery, IsolatorError> {
        let known: HashSet<&str> = known.iter().map(String::as_str).collect();
        let mut report = IsolatorRecovery::default();
        let root = self.checkpoint_root();
        let mut gone = Vec::new();
        if let Ok(entries) = std::fs::read_dir(&root) {
            for e in entries.flatten() {
                let id = e.file_name().to_string_lossy().into_owned();
                let path = e.path().join("state.json");
                match self.read_record(&e) {
                    Ok(rec) => {
                        checkpoint::remove_stale_temps(&e.path());
                        *self.entry(&id).lock().await = Some(rec);
                        if known.contains(id.as_str()) {
                            report.recovered.push(id);
                        } else {
                            gone.push(id);
                        }
                    }
                    // Nothing is done through a symlink: not even setting it aside.
                    Err(RecordRefusal::NotADirectory) => {
                        let reason = "the container's checkpoint directory is not a directory (a symlink?): left alone".to_string();
                        tracing::error!(path = %e.path().display(), %reason, "container checkpoint refused");
                        report.corrupt.push((e.path(), reason));
                    }
                    Err(RecordRefusal::Bad(reason)) => {
                        checkpoint::remove_stale_temps(&e.path());
                        tracing::error!(path = %path.display(), %reason, "container checkpoint set aside");
                        let _ = checkpoint::set_aside(&path);
                        report.corrupt.push((path, reason));
                    }
                    Err(RecordRefusal::Unreadable(reason)) if path.exists() => {
                        checkpoint::remove_stale_temps(&e.path());
                        tracing::error!(path = %path.display(), %reason, "container checkpoint set aside");
                        let _ = checkpoint::set_aside(&path);
                        report.corrupt.push((path, reason));
                    }
                    Err(RecordRefusal::Unreadable(_)) => {
                        checkpoint::remove_stale_temps(&e.path());
                        let _ = std::fs::remove_dir(e.path());
                    }
                }
            }
        }
        // One container's trouble does not stop the others' recovery.
        for id in gone {
            tracing::info!(container_id = %id, "recovery: container is gone; cleaning up");
            match self.cleanup(&id).await {
                Ok(()) => report.cleaned.push(id),
                Err(e) => {
                    tracing::error!(container_id = %id, error = %e, "recovery: cleanup failed");
                    report.failures.push((id, e.to_string()));
                }
            }
        }
        // Containers that live on keep their uses: put back any the
        // providers lost (publish is idempotent and repairs unpublished ones).
        // What each one's checkpoint uses, (provider, volume), is kept for
        // the sweep below.
        let mut recorded: HashMap<String, HashSet<(String, String)>> = HashMap::new();
        for id in report.recovered.clone() {
            let resources = self
                .entry(&id)
                .lock()
                .await
                .as_ref()
                .map(|r| r.config.resources.clone())
                .unwrap_or_default();
            let uses = resources
                .iter()
                .filter(|r| r.is_disk())
                .filter_map(|r| Some((r.provider_id()?.to_string(), r.source_id()?.to_string())))
                .collect();
            recorded.insert(id.clone(), uses);
            if let Err(e) = self.manager.publish(&id, &resources).await {
                tracing::error!(container_id = %id, error = %e, "recovery: cannot re-ensure the container's volumes");
                report.failures.push((id, e.to_string()));
            }
        }
        let live: HashSet<String> = known
            .iter()
            .map(|s| s.to_string())
            .chain(report.recovered.iter().cloned())
            .collect();
        // A use is released when its container is gone, and also when its
        // container lives on but its checkpoint does not have the volume: a
        // crash in an update after the new volume's use became durable and
        // before the checkpoint recorded it (the update failed: the
        // container keeps its old set), or after the checkpoint dropped a
        // removed volume and before its use was released.
        for provider in self.manager.providers() {
            for vol in provider.volumes().await {
                let stale = |user: &String| match recorded.get(user) {
                    Some(uses) => {
                        !uses.contains(&(provider.id().to_string(), vol.volume_id.clone()))
                    }
                    None => !live.contains(user),
                };
                for user in vol.users.iter().filter(|u| stale(u)) {
                    tracing::info!(volume_id = %vol.volume_id, container_id = %user, "recovery: releasing a use no live container's checkpoint has");
                    match provider.release(&vol.volume_id, user).await {
                        Ok(()) => report
                            .released_uses
                            .push((vol.volume_id.clone(), user.clone())),
                        Err(e) => report.failures.push((user.clone(), e.to_string())),
                    }
                }
            }
        }
        Ok(report)
    }
}

/// `<work_dir>/isolators/volume/csi`: one directory per container.
pub(crate) fn checkpoint_root(work_dir: &Path) -> PathBuf {
    work_dir
        .join(crate::workdir::ISOLATORS_DIR)
        .join("volume")
        .join("csi")
}

/// A container's checkpoint file.
fn checkpoint_path(work_dir: &Path, container: &str) -> PathBuf {
    checkpoint_root(work_dir).join(container).join("state.json")
}

/// Why [`VolumeIsolator::read_record`] refused a checkpoint.
#[derive(Debug)]
enum RecordRefusal {
    /// The container's directory is not a real directory: nothing is done through it.
    NotADirectory,
    /// `state.json` could not be read (missing: an empty directory).
    Unreadable(String),
    /// It was read but cannot be trusted (parse, id, format, paths): set aside.
    Bad(String),
}

/// Refuses a configuration whose sandbox or rootfs a checkpoint could not
/// be trusted with later (see [`checkpoint_paths`]): what prepare records
/// must pass every check recovery makes.
fn check_config(
    container: &str,
    config: &ContainerConfig,
    work_dir: &Path,
) -> Result<(), IsolatorError> {
    let probe = ContainerRecord::new(container, config.clone(), Vec::new());
    checkpoint_paths::check_record(&probe, work_dir)
        .and_then(|()| checkpoint_paths::check_canonical("sandbox", &config.sandbox))
        .map_err(|source| IsolatorError::Checkpoint {
            container: container.to_string(),
            path: checkpoint_path(work_dir, container),
            reason: format!("refused to record {source}: give the canonical absolute path of a directory of the container's own"),
        })
}

/// The resources among `all` whose mounts are in `mounts` (same volume,
/// same container path).
fn resources_of(all: &[Resource], mounts: &[VolumeMount]) -> Vec<Resource> {
    all.iter()
        .filter(|r| {
            mounts.iter().any(|m| {
                r.container_path() == Some(m.container_path.as_str())
                    && r.source_id().map(str::to_string) == m.volume_id
            })
        })
        .cloned()
        .collect()
}

/// The volume a mount belongs to: (provider id, volume id).
fn volume_key(m: &VolumeMount) -> (Option<String>, Option<String>) {
    (m.provider_id.clone(), m.volume_id.clone())
}

/// The container's pid, checked to still be the container's: same start
/// time as at `isolate`, and not in the agent's own mount namespace (then it
/// is not a container, and mounting "into" it would mount on the host).
fn live_pid(container: &str, rec: &ContainerRecord) -> Result<u32, IsolatorError> {
    use crate::launcher::process::{process_start_time, shares_mount_namespace};
    let pid = rec.pid.ok_or_else(|| IsolatorError::NoPid {
        container: container.to_string(),
    })?;
    let gone = |why: &str| IsolatorError::PidGone {
        container: container.to_string(),
        pid,
        why: why.to_string(),
    };
    match process_start_time(pid) {
        None => return Err(gone("no such process")),
        Some(t) if rec.pid_start.is_some_and(|s| s != t) => {
            return Err(gone("the pid now belongs to another process"))
        }
        Some(_) => {}
    }
    if shares_mount_namespace(pid) == Some(true) {
        return Err(gone("it is in the agent's own mount namespace"));
    }
    if let Some(then) = rec.mount_view {
        if crate::launcher::process::mount_view(pid) != Some(then) {
            return Err(gone(
                "it has moved to another mount namespace or root since it was isolated",
            ));
        }
    }
    Ok(pid)
}

fn volume_name(m: &VolumeMount) -> String {
    m.volume_id
        .clone()
        .unwrap_or_else(|| m.source.display().to_string())
}

/// The largest container checkpoint read back (a record is a few KiB).
const MAX_CHECKPOINT_BYTES: u64 = 1 << 20;

/// A container checkpoint's bytes: a regular file, not reached through a symlink, never blocking on
/// a FIFO planted in its place, at most [`MAX_CHECKPOINT_BYTES`]. A checkpoint is data found in the
/// work dir, read like anything else found there.
fn read_checkpoint_file(path: &std::path::Path) -> Result<Vec<u8>, String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::File::options()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| e.to_string())?;
    let meta = file.metadata().map_err(|e| e.to_string())?;
    if !meta.is_file() {
        return Err("not a regular file".to_string());
    }
    let mut bytes = Vec::new();
    file.take(MAX_CHECKPOINT_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| e.to_string())?;
    if bytes.len() as u64 > MAX_CHECKPOINT_BYTES {
        return Err(format!("larger than {MAX_CHECKPOINT_BYTES} bytes"));
    }
    Ok(bytes)
}
