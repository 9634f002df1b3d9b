//! Loading checkpoints and recovering on start.
//!
//! In order: stale temporary files are removed; every `volume.state` is
//! loaded (one that cannot be read is reported with its path and set aside,
//! never dropped or overwritten); after a reboot (boot id changed) node-side
//! states fall back to NODE_READY; interrupted creates are finished;
//! interrupted destroys are finished; volumes in use are republished (and
//! repaired if the mount table disagrees); interrupted steps of unused
//! volumes are settled per the policy; orphaned mount directories are
//! unmounted and removed. Each action is logged and kept in the report.

use std::collections::HashSet;

use futures::future::join_all;

use crate::provider::checkpoint;
use crate::provider::create::CreateIntent;
use crate::provider::error::ProviderError;
use crate::provider::state::{VolumeRecord, VolumeState};
use crate::provider::storage::StorageProvider;
use crate::resource::encode_volume_id;
use crate::resource::STATE_FILE;

impl StorageProvider {
    pub(crate) async fn recover(&self) -> Result<(), ProviderError> {
        self.load_records();
        self.finish_creates().await;
        let slots: Vec<_> = self.slots.lock().unwrap().values().cloned().collect();
        let outcomes = join_all(slots.into_iter().map(|slot| async move {
            let mut rec = slot.record.lock().await;
            let before = rec.state;
            let result = if rec.destroying {
                self.finish_destroy(&mut rec)
                    .await
                    .map(|_| "finished destroy")
            } else if !rec.users.is_empty() {
                self.ensure_published(&mut rec)
                    .await
                    .map(|_| "republished for its users")
            } else {
                self.settle_unused(&mut rec)
                    .await
                    .map(|_| "settled (no users)")
            };
            if result.is_ok() && !rec.destroying {
                self.harden_published(&rec.volume_id);
            }
            (rec.volume_id.clone(), before, rec.state, result)
        }))
        .await;
        let mut report = self.report.lock().unwrap();
        for (id, before, after, result) in outcomes {
            match result {
                Ok(what) if before != after => {
                    tracing::info!(volume_id = %id, %before, %after, "recovery: {what}");
                    report
                        .actions
                        .push(format!("{id}: {before} -> {after} ({what})"));
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::error!(volume_id = %id, error = %e, "recovery failed for volume");
                    report.failures.push((id, e.to_string()));
                }
            }
        }
        drop(report);
        self.remove_orphans();
        Ok(())
    }

    /// A volume published by an older version (before host-side mounts were made nosuid,nodev) is
    /// not published again when it needs nothing: its staging and target mounts, where they are
    /// mount roots, are hardened here so an upgrade closes them too. Idempotent; a failure is logged
    /// (the volume stays usable; the next publish tries again).
    fn harden_published(&self, volume_id: &str) {
        for (path, what) in [
            (self.layout.staging_path(volume_id), "staging"),
            (self.layout.target_path(volume_id), "target"),
        ] {
            if let Err(e) = self.harden(volume_id, &path, what) {
                tracing::warn!(volume_id, error = %e, "recovery: cannot set nosuid,nodev on a published volume's mount");
            }
        }
    }

    fn load_records(&self) {
        let mounted = self.mounted_targets();
        let dir = self.layout.volumes_dir();
        let Ok(entries) = std::fs::read_dir(&dir) else {
            return;
        };
        let mut report = self.report.lock().unwrap();
        for entry in entries.flatten() {
            let vdir = entry.path();
            if !vdir.is_dir() {
                continue;
            }
            checkpoint::remove_stale_temps(&vdir);
            let path = vdir.join(STATE_FILE);
            let bytes = match checkpoint::read(&path) {
                Ok(Some(b)) => b,
                Ok(None) => {
                    // A directory without a state file: an interrupted destroy
                    // removed the file already, or nothing was ever written.
                    let _ = std::fs::remove_dir(&vdir);
                    continue;
                }
                Err(e) => {
                    tracing::error!(path = %path.display(), error = %e, "cannot read volume state");
                    report
                        .failures
                        .push((path.display().to_string(), e.to_string()));
                    continue;
                }
            };
            let parsed =
                VolumeRecord::from_state_file(&bytes, &entry.file_name().to_string_lossy());
            let mut rec = match parsed {
                Ok(r) => r,
                Err(reason) => {
                    match checkpoint::set_aside(&path) {
                        Ok(aside) => {
                            let e = ProviderError::CorruptState {
                                path: path.clone(),
                                aside: aside.clone(),
                                reason: reason.clone(),
                            };
                            tracing::error!(error = %e, "volume state set aside");
                            report.corrupt.push((path, aside, reason));
                        }
                        Err(e) => {
                            tracing::error!(path = %path.display(), error = %e, "cannot set aside corrupt state");
                            report.failures.push((path.display().to_string(), reason));
                        }
                    }
                    continue;
                }
            };
            // After a reboot the node-side mounts are gone. An unreadable boot
            // id proves nothing, and a mount still in the table wins over the
            // boot id (the mount table is the truth for "is it mounted").
            let rebooted =
                !self.boot_id.is_empty() && rec.boot_id.as_deref() != Some(self.boot_id.as_str());
            let still_mounted = mounted.as_ref().is_none_or(|m| {
                m.contains(&self.layout.target_path(&rec.volume_id))
                    || m.contains(&self.layout.staging_path(&rec.volume_id))
            });
            if rec.state.is_node_side() && rebooted && !still_mounted {
                tracing::warn!(volume_id = %rec.volume_id, state = %rec.state,
                    "node rebooted since the last transition: node-side state reset to NODE_READY");
                report.actions.push(format!(
                    "{}: {} -> NODE_READY (reboot)",
                    rec.volume_id, rec.state
                ));
                rec.state = VolumeState::NodeReady;
                rec.boot_id = None;
                if let Err(e) = self.persist(&rec) {
                    tracing::error!(volume_id = %rec.volume_id, error = %e, "cannot record reboot reset");
                }
            }
            report.loaded += 1;
            self.insert_slot(rec);
        }
    }

    async fn finish_creates(&self) {
        let dir = self.layout.creating_dir();
        let Ok(entries) = std::fs::read_dir(&dir) else {
            return;
        };
        checkpoint::remove_stale_temps(&dir);
        for entry in entries.flatten() {
            let path = entry.path();
            if path.extension().and_then(|e| e.to_str()) != Some("intent") {
                continue;
            }
            let intent = match std::fs::read(&path)
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice::<CreateIntent>(&b).map_err(|e| e.to_string()))
            {
                Ok(i) => i,
                Err(reason) => {
                    let aside = checkpoint::set_aside(&path).unwrap_or_default();
                    tracing::error!(path = %path.display(), %reason, "create intent set aside");
                    self.report
                        .lock()
                        .unwrap()
                        .corrupt
                        .push((path, aside, reason));
                    continue;
                }
            };
            let name = intent.spec.name.clone();
            if self.find_by_name(&name).await.is_some() {
                let _ = checkpoint::remove_durable(&path);
                continue;
            }
            match self.finish_create(&intent.spec).await {
                Ok(rec) => {
                    tracing::info!(name = %name, volume_id = %rec.volume_id, "recovery: finished interrupted create");
                    self.report.lock().unwrap().actions.push(format!(
                        "{}: created (interrupted create of '{name}')",
                        rec.volume_id
                    ));
                }
                Err(e) => {
                    tracing::error!(name = %name, error = %e, "recovery: cannot finish create");
                    self.report
                        .lock()
                        .unwrap()
                        .failures
                        .push((name, e.to_string()));
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
                    tracing::error!(path = %dir.display(), error = %e, "cannot unmount orphaned mount directory");
                    self.report
                        .lock()
                        .unwrap()
                        .failures
                        .push((dir.display().to_string(), e.to_string()));
                }
            }
        }
    }
}
