//! The volume isolator (see the module doc of [`crate::isolator`]): the [`VolumeIsolator`] and what
//! its lifecycle steps share; one file per step (`prepare`, `prepare_oci`, `isolate`, `update`,
//! `cleanup`, `recover`).
//!
//! Invariants:
//! - A container's checkpoint (`<work_dir>/isolators/volume/csi/<id>/state.json`,
//!   changed through the isolator's journal: [`crate::isolator::journal`])
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

mod cleanup;
mod isolate;
mod prepare;
mod prepare_oci;
mod recover;
mod update;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::durable::journal::Commit;
use crate::isolator::checkpoint_paths::{self, CheckpointPathError};
use crate::isolator::error::IsolatorError;
pub(crate) use crate::isolator::journal::checkpoint_root;
use crate::isolator::journal::LazyJournal;
use crate::isolator::launch_info::{ContainerConfig, LaunchInfo};
use crate::isolator::oci::{self, OciPrepared};
use crate::isolator::ownership;
use crate::isolator::process_check::{self, ProcProcesses, Processes};
use crate::isolator::publisher::{Publisher, VolumeUsers};
use crate::isolator::targets::{check_agent_disks, host_path_kind, volume_mounts};
use crate::mount::{unmount_all_under, MountTable, Syscall};
use crate::mount::{VolumeMount, SANDBOX_IN_ROOTFS};
use crate::offload::blocking;
use crate::provider::checkpoint;
use crate::provider::Manager;
use crate::resource::Resource;

pub use crate::isolator::record::{ContainerRecord, FORMAT_VERSION};
pub use recover::IsolatorRecovery;
pub(crate) use recover::{checkpointed_ids, checkpointed_in};

type Entry = Arc<tokio::sync::Mutex<Option<ContainerRecord>>>;

/// The volume isolator.
#[derive(Debug)]
pub struct VolumeIsolator {
    work_dir: PathBuf,
    manager: Arc<Manager>,
    publisher: Arc<dyn Publisher>,
    sys: Arc<dyn Syscall>,
    table: Arc<dyn MountTable>,
    processes: Arc<dyn Processes>,
    containers: Mutex<BTreeMap<String, Entry>>,
    journal: Arc<LazyJournal>,
}

impl VolumeIsolator {
    /// An isolator for the agent work dir `work_dir`, publishing through `manager`.
    pub fn new(
        work_dir: impl Into<PathBuf>,
        manager: Arc<Manager>,
        sys: Arc<dyn Syscall>,
        table: Arc<dyn MountTable>,
    ) -> Self {
        let work_dir = work_dir.into();
        VolumeIsolator {
            journal: Arc::new(LazyJournal::new(&work_dir)),
            work_dir,
            publisher: manager.clone(),
            manager,
            sys,
            table,
            processes: Arc::new(ProcProcesses),
            containers: Mutex::new(BTreeMap::new()),
        }
    }

    /// The same isolator, learning about processes from `processes` instead of `/proc` (a test's
    /// double: the rule of [`process_check`] is then applied to what it says).
    pub fn with_processes(mut self, processes: Arc<dyn Processes>) -> Self {
        self.processes = processes;
        self
    }

    /// The isolator of one provider on this host: the mount syscalls `sys` (the caller chooses the
    /// real kernel's) and this process's mount table (what `run`, `serve` and the OCI hook each use).
    pub fn on_host(
        work_dir: impl Into<PathBuf>,
        provider: Arc<crate::provider::StorageProvider>,
        sys: Arc<dyn Syscall>,
    ) -> Self {
        let mut manager = Manager::new();
        manager.add(provider);
        VolumeIsolator::new(
            work_dir,
            Arc::new(manager),
            sys,
            Arc::new(crate::mount::ProcMountTable::new()),
        )
    }

    /// The mount syscalls this isolator (and whoever launches its containers) goes through.
    pub fn syscall(&self) -> Arc<dyn Syscall> {
        self.sys.clone()
    }

    /// The mount table this isolator reads.
    pub fn mount_table(&self) -> Arc<dyn MountTable> {
        self.table.clone()
    }

    /// An isolator for the agent work dir `work_dir` that publishes through `publisher` instead of
    /// a provider manager (a test's double; [`manager`](Self::manager) is then empty).
    pub fn with_publisher(
        work_dir: impl Into<PathBuf>,
        publisher: Arc<dyn Publisher>,
        sys: Arc<dyn Syscall>,
        table: Arc<dyn MountTable>,
    ) -> Self {
        VolumeIsolator {
            publisher,
            ..VolumeIsolator::new(work_dir, Arc::new(Manager::new()), sys, table)
        }
    }

    /// The provider manager.
    pub fn manager(&self) -> &Arc<Manager> {
        &self.manager
    }

    /// The ids of the containers checkpointed here, readable or not (the checkpoint
    /// directories and the isolator's journal). Reads the file system in the caller's thread.
    pub fn checkpointed_ids(&self) -> HashSet<String> {
        checkpointed_ids(&self.work_dir)
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

    /// Appends the container's checkpoint to the isolator's journal on the blocking pool: the
    /// caller resumes once it is durable (one fdatasync shared with concurrent containers).
    async fn persist(&self, rec: &ContainerRecord) -> Result<(), IsolatorError> {
        let bytes = serde_json::to_vec_pretty(rec).expect("a container record always serializes");
        self.journal_record(&rec.container_id, Some(bytes), Commit::Durable)
            .await
    }

    /// Appends the container's removal to the isolator's journal (its file and directory go
    /// too), on the blocking pool, without waiting for it to be durable (see
    /// [`crate::isolator::journal`]: one lost to a power cut is a container cleaned up again).
    async fn forget(&self, container: &str) -> Result<(), IsolatorError> {
        self.journal_record(container, None, Commit::Lazy).await
    }

    async fn journal_record(
        &self,
        container: &str,
        state: Option<Vec<u8>>,
        commit: Commit,
    ) -> Result<(), IsolatorError> {
        let journal = self.journal.clone();
        let id = container.to_string();
        blocking(move || journal.get()?.record(&id, state, commit))
            .await
            .map_err(|e| IsolatorError::Checkpoint {
                container: container.to_string(),
                path: self.journal.path(),
                source: Box::new(e),
            })
    }

    /// How many synced batches (one fdatasync each) the isolator's journal has written since
    /// it was opened (for the benchmarks; 0 when it is not open).
    pub fn journal_batches(&self) -> u64 {
        self.journal.opened().map_or(0, |j| j.batches())
    }

    /// Folds the isolator's journal into the container checkpoint files (write-back, one
    /// syncfs, journal emptied): at recovery and at a clean shutdown. Blocking.
    pub fn compact_journal(&self) -> Result<(), IsolatorError> {
        self.journal
            .get()
            .and_then(|j| j.compact())
            .map_err(|source| IsolatorError::Journal {
                path: self.journal.path(),
                source: Box::new(source),
            })
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
            if let Some(why) = self.publisher.read_only_reason(pid, vid).await {
                return Err(IsolatorError::ReadOnlyVolume {
                    container: container.to_string(),
                    volume: vid.clone(),
                    why,
                });
            }
        }
        Ok(())
    }

    /// Fills in each CSI volume mount's hardening flags from its volume's record
    /// ([`Publisher::hardening`]), so the container's copy carries what the volume asks.
    async fn fill_hardening(&self, mounts: &mut [VolumeMount]) {
        for m in mounts.iter_mut() {
            if let (Some(pid), Some(vid)) = (&m.provider_id, &m.volume_id) {
                m.hardening = self.publisher.hardening(pid, vid).await;
            }
        }
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
        let rec = known(&mut slot, container_id)?;
        change(rec)?;
        self.persist(rec).await
    }
}

/// A container's checkpoint file.
fn checkpoint_path(work_dir: &Path, container: &str) -> PathBuf {
    checkpoint_root(work_dir).join(container).join("state.json")
}

fn volume_name(m: &VolumeMount) -> String {
    m.volume_id
        .clone()
        .unwrap_or_else(|| m.source.display().to_string())
}

#[cfg(test)]
mod tests;

/// The record in a container's slot, or the error that names the unknown container.
fn known<'a>(
    slot: &'a mut Option<ContainerRecord>,
    container_id: &str,
) -> Result<&'a mut ContainerRecord, IsolatorError> {
    slot.as_mut()
        .ok_or_else(|| IsolatorError::UnknownContainer {
            container: container_id.to_string(),
        })
}
