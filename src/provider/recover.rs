//! Loading checkpoints and recovering on start.
//!
//! In order: stale temporary files are removed; the provider's journal is replayed over the
//! `volume.state` files (its last entry of a volume wins, a removal removes it:
//! [`checkpoint::replay`]; a state file the journal overrides is not read), then each volume is
//! loaded (one that cannot be read is reported with its path and set aside,
//! never dropped or overwritten); after a reboot (boot id changed) node-side
//! states fall back to NODE_READY. That much needs no plugin: `StorageProvider::load_records` runs while the
//! plugin starts (`StorageProvider::start`). Then interrupted creates are finished;
//! interrupted destroys are finished; volumes in use are republished (and
//! repaired if the mount table disagrees); interrupted steps of unused
//! volumes are settled per the policy; orphaned mount directories are
//! unmounted and removed; last, the journal is compacted (written back to the state files and
//! emptied). Each action is logged and kept in the report.
//!
//! The decisions are pure functions at the end of the file, table-tested:
//! [`sort_found`] (what a volume directory holds: load, reset after a
//! reboot, set aside, leave), [`recovery_action`] (finish a destroy,
//! republish, settle, leave) and [`sort_intent`] (finish a create, drop its
//! intent, set it aside). The I/O around them runs on the blocking pool.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;

use futures::future::join_all;

use crate::error_chain::Chain;
use crate::mount::MountTable;
use crate::offload::{blocking, blocking_each};
use crate::phases::PhaseTimes;
use crate::provider::checkpoint;
use crate::provider::create::CreateIntent;
use crate::provider::error::ProviderError;
use crate::provider::handoff::fence_to_take;
use crate::provider::state::{VolumeRecord, VolumeState};
use crate::provider::storage::{
    harden_at, persist_to, RecoveryReport, Slot, StorageProvider, UnpublishPolicy,
};
use crate::resource::encode_volume_id;
use crate::resource::{Layout, STATE_FILE};

impl StorageProvider {
    /// Recovery on start (see the module doc). The scans of the work dir and
    /// the mount table, and the unmounts of orphans, run on the blocking pool.
    ///
    /// Every volume's record is held from the first step to the last (nothing else runs on
    /// the volumes before the provider is started), and each volume goes through the same
    /// steps in the same order: its fence, its action, the hardening of its mounts, its
    /// expansion and modification. Each step is taken for all volumes at once, and only the
    /// volumes that have something to do get a future: the mount checks of the volumes to
    /// republish and the hardenings are a few trips to the blocking pool for all of them
    /// ([`crate::offload::blocking_each`]), not three per volume.
    pub(crate) async fn recover(self: &Arc<Self>) -> Result<(), ProviderError> {
        let mut took = PhaseTimes::start();
        self.finish_creates().await;
        self.recover_snapshots().await;
        took.mark("intents");
        let slots: Vec<Arc<Slot>> = self.slots.lock().unwrap().values().cloned().collect();
        let mut held = Vec::with_capacity(slots.len());
        for slot in &slots {
            held.push(slot.record.lock().await);
        }
        let before: Vec<VolumeState> = held.iter().map(|rec| rec.state).collect();
        let mut results: Vec<Option<Result<&'static str, ProviderError>>> =
            held.iter().map(|_| None).collect();
        // Fences: asked only of the records that may have one (the others would answer none).
        let controller_apart = self.config.controller_endpoint.is_some();
        let fenced = join_all(
            held.iter_mut()
                .enumerate()
                .filter(|(_, rec)| fence_to_take(rec, controller_apart))
                .map(|(i, rec)| async move { (i, self.take_fence(rec).await) }),
        )
        .await;
        for (i, done) in fenced {
            results[i] = done;
        }
        // Actions: the volumes in use republished together, the few others one future each.
        let mut republish = Vec::new();
        let mut others = Vec::new();
        for (i, rec) in held.iter_mut().enumerate() {
            if results[i].is_some() {
                continue;
            }
            match recovery_action(rec, self.config.policy) {
                Action::Republish => republish.push((i, &mut **rec)),
                Action::Leave => results[i] = Some(Ok("settled (no users)")),
                action => others.push((i, action, &mut **rec)),
            }
        }
        let (indices, mut recs): (Vec<usize>, Vec<&mut VolumeRecord>) =
            republish.into_iter().unzip();
        if !recs.is_empty() {
            // This checks every volume in use: the first sweep is done, not owed to the first
            // launch after the start.
            self.watched.take_for_full_check();
        }
        took.mark("fences");
        let ensured = self.ensure_published_all(&mut recs).await;
        for (i, result) in indices.into_iter().zip(ensured) {
            results[i] = Some(result.map(|_| "republished for its users"));
        }
        let done = join_all(others.into_iter().map(|(i, action, rec)| async move {
            let result = match action {
                Action::FinishDestroy => self.finish_destroy(rec).await.map(|_| "finished destroy"),
                Action::Settle { goal } => {
                    self.drive(rec, goal).await.map(|_| "settled (no users)")
                }
                Action::Republish | Action::Leave => unreachable!("sorted above"),
            };
            (i, result)
        }))
        .await;
        for (i, result) in done {
            results[i] = Some(result);
        }
        // Then, for each volume recovered and not being destroyed: its mounts hardened, its
        // expansion and modification taken up.
        took.mark("republish");
        let carried_on: Vec<usize> = (0..held.len())
            .filter(|&i| matches!(results[i], Some(Ok(_))) && !held[i].destroying)
            .collect();
        self.harden_published(carried_on.iter().map(|&i| held[i].volume_id.clone()))
            .await;
        took.mark("harden");
        join_all(
            held.iter_mut()
                .enumerate()
                .filter(|(i, rec)| {
                    carried_on.binary_search(i).is_ok()
                        && (rec.expansion.is_some() || rec.modifying.is_some())
                })
                .map(|(_, rec)| async move {
                    if rec.expansion.is_some() {
                        self.finish_expansion(rec).await;
                    }
                    if rec.modifying.is_some() {
                        self.finish_modify(rec).await;
                    }
                }),
        )
        .await;
        {
            let mut report = self.report.lock().unwrap();
            for ((rec, before), result) in held.iter().zip(before).zip(results) {
                let (id, after) = (&rec.volume_id, rec.state);
                match result.expect("every volume has a result") {
                    Ok(what) if before != after => {
                        tracing::info!(volume_id = %id, %before, %after, "recovery: {what}");
                        report
                            .actions
                            .push(format!("{id}: {before} -> {after} ({what})"));
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::error!(volume_id = %id, error = %Chain(&e), "recovery failed for volume");
                        report
                            .failures
                            .push((id.clone(), crate::error_chain::full_message(&e)));
                    }
                }
            }
        }
        let volumes = held.len();
        drop(held);
        let this = self.clone();
        blocking(move || this.remove_orphans()).await;
        took.mark("orphans");
        // What recovery replayed and changed goes to the state files; the journal starts empty.
        self.compact_journal().await;
        took.mark("compact");
        tracing::info!(plugin = %self.plugin, volumes, took = %took, "provider recovered");
        Ok(())
    }

    /// A modification a crash interrupted is re-issued as asked (ControllerModifyVolume is
    /// idempotent); a failure is logged and the intent kept, for the next `modify`.
    async fn finish_modify(&self, rec: &mut VolumeRecord) {
        match self.continue_modify(rec).await {
            Ok(()) => {
                tracing::info!(volume_id = %rec.volume_id, mutable = ?rec.mutable_parameters, "recovery: modification taken up");
                self.report
                    .lock()
                    .unwrap()
                    .actions
                    .push(format!("{}: modification taken up", rec.volume_id));
            }
            Err(e) => {
                tracing::error!(volume_id = %rec.volume_id, error = %Chain(&e), "recovery: the interrupted modification failed again");
                self.report
                    .lock()
                    .unwrap()
                    .failures
                    .push((rec.volume_id.clone(), crate::error_chain::full_message(&e)));
            }
        }
    }

    /// An expansion a crash interrupted is taken up from the call its intent names (both calls are
    /// idempotent); a failure is logged and the intent kept, for the next `expand` or publish.
    async fn finish_expansion(&self, rec: &mut VolumeRecord) {
        let caps = crate::provider::expand::ExpandCaps::of(&self.capabilities());
        match self.continue_expansion(rec, caps).await {
            Ok(done) => {
                tracing::info!(volume_id = %rec.volume_id, capacity_bytes = done.capacity_bytes, node_pending = done.node_pending, "recovery: expansion taken up");
                self.report.lock().unwrap().actions.push(format!(
                    "{}: expansion taken up ({} bytes{})",
                    rec.volume_id,
                    done.capacity_bytes,
                    if done.node_pending {
                        ", node call at the next publish"
                    } else {
                        ""
                    }
                ));
            }
            Err(e) => {
                tracing::error!(volume_id = %rec.volume_id, error = %Chain(&e), "recovery: the interrupted expansion failed again");
                self.report
                    .lock()
                    .unwrap()
                    .failures
                    .push((rec.volume_id.clone(), crate::error_chain::full_message(&e)));
            }
        }
    }

    /// Volumes published by an older version (before host-side mounts were made nosuid,nodev)
    /// are not published again when they need nothing: their staging and target mounts, where
    /// they are mount roots, are hardened here so an upgrade closes them too, in a few trips to
    /// the blocking pool for all of them. Idempotent; a failure is logged (the volume stays
    /// usable; the next publish tries again).
    async fn harden_published(&self, volume_ids: impl Iterator<Item = String>) {
        let mounts: Vec<(String, PathBuf, &'static str)> = volume_ids
            .flat_map(|id| {
                [
                    (self.layout.staging_path(&id), "staging"),
                    (self.layout.target_path(&id), "target"),
                ]
                .map(|(path, what)| (id.clone(), path, what))
            })
            .collect();
        let sys = self.sys.clone();
        let failed = blocking_each(mounts, move |(id, path, what)| {
            harden_at(&*sys, &id, &path, what).err().map(|e| (id, e))
        })
        .await;
        for (volume_id, e) in failed.into_iter().flatten() {
            tracing::warn!(%volume_id, error = %Chain(&e), "recovery: cannot set nosuid,nodev on a published volume's mount");
        }
    }

    /// Finishes a create or an import intent (also run by recovery).
    pub(crate) async fn finish_intent(
        &self,
        intent: &CreateIntent,
    ) -> Result<VolumeRecord, ProviderError> {
        match &intent.import {
            None => self.finish_create(&intent.spec).await,
            Some(import) => {
                self.finish_import(import, intent.spec.secrets_file.as_deref())
                    .await
            }
        }
    }

    async fn finish_creates(&self) {
        // The intents are few and small: read them all at once, off the workers.
        let dir = self.layout.creating_dir();
        let found = blocking(move || -> Vec<(PathBuf, Result<Vec<u8>, String>)> {
            let Ok(entries) = std::fs::read_dir(&dir) else {
                return Vec::new();
            };
            checkpoint::remove_stale_temps(&dir);
            entries
                .flatten()
                .map(|entry| entry.path())
                .filter(|path| path.extension().and_then(|e| e.to_str()) == Some("intent"))
                .map(|path| {
                    let read = std::fs::read(&path).map_err(|e| e.to_string());
                    (path, read)
                })
                .collect()
        })
        .await;
        // Intent files are named by their volume's name, so one name is finished at most once
        // in this loop: the names known before it are the ones to judge by.
        let known = self.names();
        for (path, read) in found {
            let intent = match sort_intent(read, &known) {
                IntentSorted::Corrupt(reason) => {
                    let at = path.clone();
                    let aside = blocking(move || checkpoint::set_aside(&at))
                        .await
                        .unwrap_or_default();
                    tracing::error!(path = %path.display(), %reason, "create intent set aside");
                    self.report
                        .lock()
                        .unwrap()
                        .corrupt
                        .push((path, aside, reason));
                    continue;
                }
                IntentSorted::Created => {
                    let _ = blocking(move || checkpoint::remove_durable(&path)).await;
                    continue;
                }
                IntentSorted::Finish(intent) => intent,
            };
            let name = intent.spec.name.clone();
            match self.finish_intent(&intent).await {
                Ok(rec) => {
                    tracing::info!(name = %name, volume_id = %rec.volume_id, "recovery: finished interrupted create");
                    self.report.lock().unwrap().actions.push(format!(
                        "{}: created (interrupted create of '{name}')",
                        rec.volume_id
                    ));
                }
                Err(e) => {
                    tracing::error!(name = %name, error = %Chain(&e), "recovery: cannot finish create");
                    self.report
                        .lock()
                        .unwrap()
                        .failures
                        .push((name, crate::error_chain::full_message(&e)));
                }
            }
        }
    }

    /// Mount directories no volume knows of (no record, no volume
    /// directory): unmount what is mounted there, then remove them. A directory that still has a mount is kept (its
    /// content would be a volume's data).
    fn remove_orphans(&self) {
        // A volume whose state file was set aside still has its directory:
        // its mounts are not orphans (a container may be using them).
        let mut known: HashSet<String> = self
            .slots
            .lock()
            .unwrap()
            .keys()
            .map(|id| encode_volume_id(id))
            .collect();
        if let Ok(entries) = std::fs::read_dir(self.layout.volumes_dir()) {
            known.extend(
                entries
                    .flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned()),
            );
        }
        let Ok(entries) = std::fs::read_dir(self.layout.mounts_dir()) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if known.contains(&name) {
                continue;
            }
            let dir = entry.path();
            match crate::mount::unmount_all_under(&*self.sys, &*self.table, &dir) {
                Ok(n) => {
                    let still = self.table.mounts_under(&dir).map(|m| m.len()).unwrap_or(1);
                    if still == 0 {
                        let _ = std::fs::remove_dir_all(&dir);
                        tracing::warn!(path = %dir.display(), unmounted = n, "recovery: removed orphaned mount directory");
                        self.report
                            .lock()
                            .unwrap()
                            .actions
                            .push(format!("orphan {}: {n} mount(s) removed", dir.display()));
                    } else {
                        tracing::error!(path = %dir.display(), "orphaned mount directory still mounted; kept");
                    }
                }
                Err(e) => {
                    tracing::error!(path = %dir.display(), error = %Chain(&e), "cannot unmount orphaned mount directory");
                    self.report.lock().unwrap().failures.push((
                        dir.display().to_string(),
                        crate::error_chain::full_message(&e),
                    ));
                }
            }
        }
    }
}

impl StorageProvider {
    /// The CreateVolume names of the volumes known (without waiting for any record's lock: names
    /// never change).
    fn names(&self) -> HashSet<String> {
        self.slots
            .lock()
            .unwrap()
            .values()
            .filter_map(|s| s.name.clone())
            .collect()
    }
}

/// Mount points of a provider's targets (under `layout`'s mounts) per `table` (`None` if it
/// cannot be read: then nothing is "repaired" on a guess).
fn mounted_targets(table: &dyn MountTable, layout: &Layout) -> Option<HashSet<PathBuf>> {
    match table.mounts_under(&layout.mounts_dir()) {
        Ok(m) => Some(m.into_iter().map(|m| m.mount_point).collect()),
        Err(e) => {
            tracing::warn!(error = %Chain(&e), "cannot read the mount table");
            None
        }
    }
}

/// What `StorageProvider::load_records` found: the records the provider holds, and the report so far.
pub(crate) struct Loaded {
    /// Every volume's record, in directory-name order.
    pub(crate) records: Vec<VolumeRecord>,
    /// The journal entries skipped, the state files unreadable or set aside, the reboot resets.
    pub(crate) report: RecoveryReport,
}

impl StorageProvider {
    /// Recovery's first step, on a blocking thread, before the provider exists (it runs while
    /// the plugin starts: none of it needs the plugin): every volume directory of `layout` and
    /// every volume the journal names (`replayed`, the journal as the provider opened it), sorted
    /// by what this boot (`boot_id`) and the mount table say ([`sort_found`]). A reboot's reset is
    /// recorded in `journal`; a corrupt state file's setting aside drops the volume summary.
    pub(crate) fn load_records(
        layout: &Layout,
        journal: &checkpoint::VolumeJournal,
        table: &dyn MountTable,
        boot_id: &str,
        replayed: checkpoint::Replayed,
    ) -> Loaded {
        let mounted = mounted_targets(table, layout);
        let dir = layout.volumes_dir();
        let (mut journaled, refused) = replayed;
        let mut report = RecoveryReport::default();
        let mut records = Vec::new();
        for why in refused {
            tracing::error!(error = %why, "journal entry skipped");
            report.failures.push(("journal".into(), why));
        }
        // Every volume directory and every volume the journal names, in order: the journal's
        // last entry wins over the state file, which is then not read; otherwise the state
        // file, read and sorted one at a time (10,000 files' bytes are never all held at once).
        let mut on_disk = std::collections::BTreeSet::new();
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            if entry.path().is_dir() {
                on_disk.insert(entry.file_name().to_string_lossy().into_owned());
            }
        }
        let names: std::collections::BTreeSet<String> =
            on_disk.iter().chain(journaled.keys()).cloned().collect();
        for dir_name in names {
            let vdir = dir.join(&dir_name);
            let path = vdir.join(STATE_FILE);
            if on_disk.contains(&dir_name) {
                checkpoint::remove_stale_temps(&vdir);
            }
            let found = match journaled.remove(&dir_name) {
                Some((_, Some(bytes))) => Found::StateFile(bytes),
                Some((_, None)) => Found::NoStateFile,
                None => match checkpoint::read(&path) {
                    Ok(Some(bytes)) => Found::StateFile(bytes),
                    Ok(None) => Found::NoStateFile,
                    Err(e) => Found::Unreadable(crate::error_chain::full_message(&e)),
                },
            };
            let facts = Facts {
                boot_id,
                mounted: mounted.as_ref(),
                layout,
            };
            let (rec, reset) = match sort_found(&dir_name, found, &facts) {
                Sorted::RemoveDir => {
                    let _ = std::fs::remove_dir(&vdir);
                    continue;
                }
                Sorted::Unreadable(reason) => {
                    tracing::error!(path = %path.display(), error = %reason, "cannot read volume state");
                    report.failures.push((path.display().to_string(), reason));
                    continue;
                }
                Sorted::Corrupt(reason) => {
                    match journal
                        .drop_summary()
                        .and_then(|()| checkpoint::set_aside(&path))
                    {
                        Ok(aside) => {
                            let e = ProviderError::CorruptState {
                                path: path.clone(),
                                aside: aside.clone(),
                                reason: reason.clone(),
                            };
                            tracing::error!(error = %Chain(&e), "volume state set aside");
                            report.corrupt.push((path, aside, reason));
                        }
                        Err(e) => {
                            tracing::error!(path = %path.display(), error = %Chain(&e), "cannot set aside corrupt state");
                            report.failures.push((path.display().to_string(), reason));
                        }
                    }
                    continue;
                }
                Sorted::Load {
                    record,
                    reset_by_reboot,
                } => (*record, reset_by_reboot),
            };
            if let Some(was) = reset {
                tracing::warn!(volume_id = %rec.volume_id, state = %was,
                    "node rebooted since the last transition: node-side state reset to NODE_READY");
                report
                    .actions
                    .push(format!("{}: {was} -> NODE_READY (reboot)", rec.volume_id));
                if let Err(e) = persist_to(journal, &rec) {
                    tracing::error!(volume_id = %rec.volume_id, error = %Chain(&e), "cannot record reboot reset");
                }
            }
            report.loaded += 1;
            records.push(rec);
        }
        Loaded { records, report }
    }
}

/// What a volume directory held when recovery looked: the I/O's answer,
/// sorted by [`sort_found`].
#[derive(Debug)]
pub(crate) enum Found {
    /// No state file.
    NoStateFile,
    /// The state file could not be read (the error).
    Unreadable(String),
    /// The state file's bytes.
    StateFile(Vec<u8>),
}

/// What recovery does with a volume directory found at start.
#[derive(Debug, PartialEq)]
pub(crate) enum Sorted {
    /// No state file: an interrupted destroy removed it already, or nothing
    /// was ever written. The (empty) directory is removed.
    RemoveDir,
    /// The file could not be read: reported, left in place (it is not known
    /// to be bad, and the volume's mounts are not orphans).
    Unreadable(String),
    /// The file is not to be trusted (it does not parse, its format is newer
    /// than this build's, its id does not match its directory): set aside,
    /// with the reason.
    Corrupt(String),
    /// A volume to load: its record (reset to NODE_READY when the node
    /// rebooted under it) and, after a reset, the state it had.
    Load {
        /// The record to load.
        record: Box<VolumeRecord>,
        /// The node-side state the reboot reset, if any (to be made durable).
        reset_by_reboot: Option<VolumeState>,
    },
}

/// The facts about this boot that sorting a checkpoint needs.
pub(crate) struct Facts<'a> {
    /// This boot's id (empty when unreadable: then nothing counts as a reboot).
    pub(crate) boot_id: &'a str,
    /// The provider's mount points per the mount table (`None` when it could
    /// not be read: then every volume counts as still mounted).
    pub(crate) mounted: Option<&'a HashSet<PathBuf>>,
    /// Where the volumes' staging and target paths are.
    pub(crate) layout: &'a Layout,
}

/// Sorts what the directory `dir_name` of `volumes/` held (see [`Sorted`]).
///
/// After a reboot the node-side mounts are gone: a node-side state falls back
/// to NODE_READY. An unreadable boot id proves nothing, and a mount still in
/// the table wins over the boot id (the mount table is the truth for "is it
/// mounted").
pub(crate) fn sort_found(dir_name: &str, found: Found, facts: &Facts<'_>) -> Sorted {
    let bytes = match found {
        Found::NoStateFile => return Sorted::RemoveDir,
        Found::Unreadable(reason) => return Sorted::Unreadable(reason),
        Found::StateFile(bytes) => bytes,
    };
    let mut record = match VolumeRecord::from_state_file(&bytes, dir_name) {
        Ok(r) => r,
        Err(reason) => return Sorted::Corrupt(reason),
    };
    let rebooted = !facts.boot_id.is_empty() && record.boot_id.as_deref() != Some(facts.boot_id);
    let still_mounted = facts.mounted.is_none_or(|m| {
        m.contains(&facts.layout.target_path(&record.volume_id))
            || m.contains(&facts.layout.staging_path(&record.volume_id))
    });
    let mut reset_by_reboot = None;
    if record.state.is_node_side() && rebooted && !still_mounted {
        reset_by_reboot = Some(record.state);
        record.state = VolumeState::NodeReady;
        record.boot_id = None;
    }
    Sorted::Load {
        record: Box::new(record),
        reset_by_reboot,
    }
}

/// What recovery does with a loaded volume.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Action {
    /// A destroy was asked for: unpublish fully, then DeleteVolume.
    FinishDestroy,
    /// Containers use it: drive it to PUBLISHED, repairing a lost mount.
    Republish,
    /// Unused and not where the policy wants it: drive it to `goal`.
    Settle {
        /// The steady state it goes to.
        goal: VolumeState,
    },
    /// Unused and where the policy wants it: nothing to do.
    Leave,
}

/// The partition of loaded volumes: what to finish (a destroy), what to
/// bring up again (volumes in use), what to take down or settle (unused
/// volumes, per the policy, [`settle_goal`]) and what to leave. Also the
/// ensure-all rule: a volume is re-ensured exactly when it is to be
/// republished.
pub(crate) fn recovery_action(rec: &VolumeRecord, policy: UnpublishPolicy) -> Action {
    if rec.destroying {
        Action::FinishDestroy
    } else if !rec.users.is_empty() {
        Action::Republish
    } else {
        match settle_goal(rec.state, rec.towards, policy) {
            Some(goal) => Action::Settle { goal },
            None => Action::Leave,
        }
    }
}

/// Where an unused volume goes: under last-use, CREATED; under keep, it
/// stays, but an interrupted step is never left behind (a forward one is
/// undone, a backward one finished). `None` when it is there already.
pub(crate) fn settle_goal(
    state: VolumeState,
    towards: Option<VolumeState>,
    policy: UnpublishPolicy,
) -> Option<VolumeState> {
    let goal = match policy {
        UnpublishPolicy::LastUse => VolumeState::Created,
        UnpublishPolicy::Keep => match state.pending_step() {
            Some(step) if step.is_forward() => step.from(),
            Some(step) => step.to(),
            None => return None,
        },
    };
    (state != goal || towards.is_some()).then_some(goal)
}

/// What recovery does with a CreateVolume intent found at start.
#[derive(Debug)]
pub(crate) enum IntentSorted {
    /// It cannot be read or parsed: set aside, with the reason.
    Corrupt(String),
    /// A volume of that name is known: the create finished, the intent goes.
    Created,
    /// The create was interrupted: finish it (CreateVolume is idempotent by name).
    Finish(Box<CreateIntent>),
}

/// Sorts a CreateVolume intent (its bytes, or why they could not be read)
/// against the names of the volumes known.
pub(crate) fn sort_intent(read: Result<Vec<u8>, String>, known: &HashSet<String>) -> IntentSorted {
    let intent = match read
        .and_then(|b| serde_json::from_slice::<CreateIntent>(&b).map_err(|e| e.to_string()))
    {
        Ok(i) => i,
        Err(reason) => return IntentSorted::Corrupt(reason),
    };
    if known.contains(&intent.spec.name) {
        IntentSorted::Created
    } else {
        IntentSorted::Finish(Box::new(intent))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::create::CreateSpec;
    use crate::provider::state::{Capability, FORMAT_VERSION};
    use crate::resource::encode_volume_id;
    use std::path::Path;
    use VolumeState::*;

    const BOOT: &str = "boot-now";

    /// Loaded (the state after, the state a reboot reset) or what else.
    type Expected = Result<(VolumeState, Option<VolumeState>), &'static str>;

    fn record(id: &str, state: VolumeState, boot: Option<&str>) -> VolumeRecord {
        let mut r = VolumeRecord::new(id, Capability::default());
        r.state = state;
        r.boot_id = boot.map(str::to_string);
        r
    }

    fn bytes(r: &VolumeRecord) -> Found {
        Found::StateFile(serde_json::to_vec(r).unwrap())
    }

    #[test]
    fn checkpoints_found_at_start_are_sorted() {
        let layout = Layout::new(Path::new("/w"), "t", "n");
        let mounted: HashSet<PathBuf> = [
            layout.target_path("still-published"),
            layout.staging_path("still-staged"),
        ]
        .into();
        let facts = Facts {
            boot_id: BOOT,
            mounted: Some(&mounted),
            layout: &layout,
        };
        let mut newer = record("newer", Created, None);
        newer.format = FORMAT_VERSION + 1;
        // (directory, what it held, expected: None = not loaded, Some(state after, reset from))
        let table: Vec<(&str, Found, Expected)> = vec![
            ("gone", Found::NoStateFile, Err("remove dir")),
            ("eio", Found::Unreadable("EIO".into()), Err("unreadable")),
            (
                "junk",
                Found::StateFile(b"{not json".to_vec()),
                Err("corrupt"),
            ),
            ("newer", bytes(&newer), Err("corrupt")),
            // A record under another volume's directory.
            (
                "elsewhere",
                bytes(&record("other", Created, None)),
                Err("corrupt"),
            ),
            // This boot: trusted as written, transient states included.
            (
                "a",
                bytes(&record("a", Published, Some(BOOT))),
                Ok((Published, None)),
            ),
            (
                "b",
                bytes(&record("b", NodeStage, Some(BOOT))),
                Ok((NodeStage, None)),
            ),
            (
                "c",
                bytes(&record("c", NodeUnpublish, Some(BOOT))),
                Ok((NodeUnpublish, None)),
            ),
            // Another boot: node-side states fall back to NODE_READY...
            (
                "d",
                bytes(&record("d", Published, Some("boot-before"))),
                Ok((NodeReady, Some(Published))),
            ),
            (
                "e",
                bytes(&record("e", VolReady, None)),
                Ok((NodeReady, Some(VolReady))),
            ),
            (
                "f",
                bytes(&record("f", NodePublish, Some("boot-before"))),
                Ok((NodeReady, Some(NodePublish))),
            ),
            (
                "g",
                bytes(&record("g", NodeUnstage, Some("boot-before"))),
                Ok((NodeReady, Some(NodeUnstage))),
            ),
            // ... controller-side ones stand...
            (
                "h",
                bytes(&record("h", NodeReady, None)),
                Ok((NodeReady, None)),
            ),
            (
                "i",
                bytes(&record("i", ControllerPublish, None)),
                Ok((ControllerPublish, None)),
            ),
            (
                "j",
                bytes(&record("j", ControllerUnpublish, None)),
                Ok((ControllerUnpublish, None)),
            ),
            ("k", bytes(&record("k", Created, None)), Ok((Created, None))),
            // ... and a mount still in the table wins over the boot id.
            (
                "still-published",
                bytes(&record("still-published", Published, Some("boot-before"))),
                Ok((Published, None)),
            ),
            (
                "still-staged",
                bytes(&record("still-staged", VolReady, Some("boot-before"))),
                Ok((VolReady, None)),
            ),
        ];
        for (dir, found, expected) in table {
            let got = sort_found(&encode_volume_id(dir), found, &facts);
            match (expected, got) {
                (Err("remove dir"), Sorted::RemoveDir) => {}
                (Err("unreadable"), Sorted::Unreadable(reason)) => assert_eq!(reason, "EIO"),
                (Err("corrupt"), Sorted::Corrupt(reason)) => assert!(!reason.is_empty()),
                (
                    Ok((state, reset)),
                    Sorted::Load {
                        record,
                        reset_by_reboot,
                    },
                ) => {
                    assert_eq!((record.state, reset_by_reboot), (state, reset), "{dir}");
                    if reset.is_some() {
                        assert_eq!(record.boot_id, None, "{dir}");
                    }
                }
                (expected, got) => panic!("{dir}: expected {expected:?}, got {got:?}"),
            }
        }
    }

    #[test]
    fn an_unknown_boot_or_mount_table_resets_nothing() {
        let layout = Layout::new(Path::new("/w"), "t", "n");
        let published = record("v", Published, Some("boot-before"));
        let empty = HashSet::new();
        for (boot_id, mounted) in [("", Some(&empty)), (BOOT, None)] {
            let facts = Facts {
                boot_id,
                mounted,
                layout: &layout,
            };
            match sort_found(&encode_volume_id("v"), bytes(&published), &facts) {
                Sorted::Load {
                    record,
                    reset_by_reboot: None,
                } => assert_eq!(record.state, Published),
                other => panic!("boot {boot_id:?}, table {mounted:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn loaded_volumes_are_partitioned_by_use_destroy_and_policy() {
        use Action::*;
        use UnpublishPolicy::{Keep, LastUse};
        let mk = |state, towards, users: bool, destroying: bool| {
            let mut r = record("v", state, None);
            r.towards = towards;
            r.destroying = destroying;
            if users {
                r.users.insert("c1".into());
            }
            r
        };
        let settle = |goal| Settle { goal };
        #[rustfmt::skip]
        let table = [
            // (state, towards, users, destroying, last-use, keep)
            // A destroy is finished whatever else holds.
            (Published, None, false, true, FinishDestroy, FinishDestroy),
            (NodeStage, Some(Created), false, true, FinishDestroy, FinishDestroy),
            (Created, None, false, true, FinishDestroy, FinishDestroy),
            // In use: brought up again, from anywhere.
            (Published, None, true, false, Republish, Republish),
            (Created, None, true, false, Republish, Republish),
            (NodeUnpublish, Some(Created), true, false, Republish, Republish),
            (NodeReady, Some(Published), true, false, Republish, Republish),
            // Unused, steady.
            (Created, None, false, false, Leave, Leave),
            (NodeReady, None, false, false, settle(Created), Leave),
            (VolReady, None, false, false, settle(Created), Leave),
            (Published, None, false, false, settle(Created), Leave),
            // Unused, a step in flight: forward ones undone, backward ones finished under keep.
            (ControllerPublish, Some(Published), false, false, settle(Created), settle(Created)),
            (NodeStage, Some(Published), false, false, settle(Created), settle(NodeReady)),
            (NodePublish, Some(Published), false, false, settle(Created), settle(VolReady)),
            (NodeUnpublish, Some(Created), false, false, settle(Created), settle(VolReady)),
            (NodeUnstage, Some(Created), false, false, settle(Created), settle(NodeReady)),
            (ControllerUnpublish, Some(Created), false, false, settle(Created), settle(Created)),
            // A goal left behind (a reboot reset an operation in flight) is cleared under last-use.
            (Created, Some(Published), false, false, settle(Created), Leave),
            (NodeReady, Some(Published), false, false, settle(Created), Leave),
        ];
        for (state, towards, users, destroying, last_use, keep) in table {
            let rec = mk(state, towards, users, destroying);
            for (policy, expected) in [(LastUse, last_use), (Keep, keep)] {
                assert_eq!(
                    recovery_action(&rec, policy),
                    expected,
                    "{state} towards {towards:?}, users {users}, destroying {destroying}, {policy:?}"
                );
            }
        }
    }

    #[test]
    fn create_intents_are_finished_dropped_or_set_aside() {
        let intent = |name: &str| {
            serde_json::to_vec(&CreateIntent {
                format: FORMAT_VERSION,
                spec: CreateSpec::new(name, 1 << 20),
                import: None,
            })
            .unwrap()
        };
        let known: HashSet<String> = ["done".to_string()].into();
        assert!(matches!(
            sort_intent(Ok(intent("done")), &known),
            IntentSorted::Created
        ));
        match sort_intent(Ok(intent("half")), &known) {
            IntentSorted::Finish(i) => assert_eq!(i.spec, CreateSpec::new("half", 1 << 20)),
            other => panic!("{other:?}"),
        }
        for read in [
            Ok(b"{\"format\":1}".to_vec()),
            Ok(vec![0xff]),
            Err("EIO".into()),
        ] {
            assert!(matches!(
                sort_intent(read, &known),
                IntentSorted::Corrupt(reason) if !reason.is_empty()
            ));
        }
    }
}
