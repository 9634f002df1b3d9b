//! Snapshots and clones: CreateSnapshot and DeleteSnapshot of a recorded volume, and the
//! content source ([`ContentSource`]) a new volume is made from (CreateVolume's
//! `volume_content_source`: a snapshot, or another volume, a clone).
//!
//! Contract:
//! - A snapshot is known by its name (CreateSnapshot's `name`, so the same name is the same
//!   snapshot, as CSI makes it) and recorded at `snapshots/<enc name>/snapshot.state`
//!   ([`crate::resource::Layout::snapshot_state`]), written atomically. The record is its own
//!   intent: `pending: create` is durable before CreateSnapshot (recovery re-issues it with the
//!   same name, then records the answer or, when the plugin refuses it for good, drops it);
//!   `pending: delete` is durable before DeleteSnapshot (recovery finishes it; the record goes
//!   last).
//! - What may be done is decided before any RPC by pure functions ([`plan_create`],
//!   [`plan_delete`], [`plan_source`]): a plugin without CREATE_DELETE_SNAPSHOT (snapshots, and
//!   volumes made from one) or CLONE_VOLUME (clones), an unknown snapshot or volume name, a
//!   name already taken by a snapshot of another volume, and a snapshot whose create or delete
//!   is still pending are refused, changing nothing.
//! - A snapshot of a volume in use is taken: whether that is consistent is the plugin's to say
//!   (the bundled plugin freezes the filesystem while it copies).
//! - Destroying a volume leaves its snapshots recorded and in the plugin: CSI snapshots outlive
//!   their source (the bundled plugin deletes the two independently); a plugin that refuses
//!   DeleteVolume while snapshots exist fails the destroy with its own error.
//! - The snapshot calls carry the `snapshot` operation's secrets (docs/secrets.md) from the
//!   source volume's secrets file, recorded with the snapshot.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::csi::proto;
use crate::offload::blocking;
use crate::provider::checkpoint;
use crate::provider::error::ProviderError;
use crate::provider::rules::{is_ambiguous, validate_name};
use crate::provider::state::{VolumeRecord, FORMAT_VERSION};
use crate::provider::storage::{remove_empty_dir, StorageProvider};

/// The step of a snapshot still to be done.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SnapshotStep {
    /// CreateSnapshot, not yet answered.
    Create,
    /// DeleteSnapshot, not yet answered.
    Delete,
}

/// A snapshot's record (and intent, see the module doc).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotRecord {
    /// Format version.
    pub format: u32,
    /// CreateSnapshot's name: what users call it.
    pub name: String,
    /// The plugin's id (empty until CreateSnapshot answered).
    #[serde(default)]
    pub snapshot_id: String,
    /// The volume it was taken of.
    pub source_volume_id: String,
    /// That volume's name, when it had one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_name: Option<String>,
    /// Its size as the plugin reported it (0: unknown).
    #[serde(default)]
    pub size_bytes: u64,
    /// Whether the plugin said it can be used as a content source yet.
    #[serde(default)]
    pub ready_to_use: bool,
    /// When the plugin took it, in seconds since the epoch (0: not said).
    #[serde(default)]
    pub creation_time: i64,
    /// The source volume's secrets file (an absolute path), for the snapshot calls.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secrets_file: Option<PathBuf>,
    /// The call still to make, durable before it is made.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending: Option<SnapshotStep>,
}

pub use crate::provider::state::ContentSource;

impl ContentSource {
    /// The CSI message.
    pub fn to_proto(&self) -> proto::VolumeContentSource {
        use proto::volume_content_source::{SnapshotSource, Type, VolumeSource};
        proto::VolumeContentSource {
            r#type: Some(match self {
                ContentSource::Snapshot { snapshot_id, .. } => Type::Snapshot(SnapshotSource {
                    snapshot_id: snapshot_id.clone(),
                }),
                ContentSource::Volume { volume_id, .. } => Type::Volume(VolumeSource {
                    volume_id: volume_id.clone(),
                }),
            }),
        }
    }

    /// The source as `serve`'s Status gives it: `snapshot:NAME` or `volume:NAME` (the name the
    /// user gave, the plugin's id when the source had no name).
    pub fn label(&self) -> String {
        match self {
            ContentSource::Snapshot { name, .. } => format!("snapshot:{name}"),
            ContentSource::Volume { name, .. } => format!("volume:{name}"),
        }
    }

    /// The kind and the name, for `status`'s line: `made from snapshot` or `cloned from volume`.
    pub fn described(&self) -> (&'static str, &str) {
        match self {
            ContentSource::Snapshot { name, .. } => ("made from snapshot", name),
            ContentSource::Volume { name, .. } => ("cloned from volume", name),
        }
    }
}

/// What a new volume is asked to be made from, by name (`--from-snapshot`, `--from-volume`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SourceName {
    /// A snapshot's name.
    Snapshot(String),
    /// A volume's name or id.
    Volume(String),
}

/// What the plugin offers for snapshots and clones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SnapshotCaps {
    /// The controller has CREATE_DELETE_SNAPSHOT.
    pub snapshots: bool,
    /// The controller has CLONE_VOLUME.
    pub clones: bool,
}

impl SnapshotCaps {
    /// The capabilities as the CSI client learnt them.
    pub fn of(caps: &crate::csi::Capabilities) -> Self {
        use crate::csi::caps::ControllerRpc;
        let controller = caps.plugin.controller_service();
        SnapshotCaps {
            snapshots: controller && caps.controller.has(ControllerRpc::CreateDeleteSnapshot),
            clones: controller && caps.controller.has(ControllerRpc::CloneVolume),
        }
    }
}

pub use crate::provider::error::SnapshotRefusal;

/// What a snapshot create does next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CreatePlan {
    /// The snapshot exists already: hand it out.
    Done(SnapshotRecord),
    /// Write the intent (or keep the one there) and call CreateSnapshot.
    Issue,
}

/// Decides a snapshot `name` of volume `source` (see the module doc): `existing` is the record
/// under that name, if any.
pub fn plan_create(
    existing: Option<&SnapshotRecord>,
    name: &str,
    source: &VolumeRecord,
    caps: SnapshotCaps,
) -> Result<CreatePlan, SnapshotRefusal> {
    if !caps.snapshots {
        return Err(SnapshotRefusal::NoSnapshots);
    }
    if source.destroying {
        return Err(SnapshotRefusal::SourceDestroying(shown_volume(source)));
    }
    match existing {
        None => Ok(CreatePlan::Issue),
        Some(rec) if rec.source_volume_id != source.volume_id => Err(SnapshotRefusal::NameTaken {
            name: name.to_string(),
            volume: rec
                .source_name
                .clone()
                .unwrap_or_else(|| rec.source_volume_id.clone()),
        }),
        Some(rec) => match rec.pending {
            None => Ok(CreatePlan::Done(rec.clone())),
            Some(SnapshotStep::Create) => Ok(CreatePlan::Issue),
            Some(SnapshotStep::Delete) => Err(SnapshotRefusal::Pending {
                name: name.to_string(),
                doing: "deleted",
            }),
        },
    }
}

/// Decides a delete of snapshot `name`, whose record is `existing`: the record to mark.
pub fn plan_delete(
    existing: Option<SnapshotRecord>,
    name: &str,
    caps: SnapshotCaps,
) -> Result<SnapshotRecord, SnapshotRefusal> {
    if !caps.snapshots {
        return Err(SnapshotRefusal::NoSnapshots);
    }
    existing.ok_or_else(|| SnapshotRefusal::UnknownSnapshot(name.to_string()))
}

/// Decides the content source of a new volume: the snapshot record or the volume record the
/// user named (`None`: there is none by that name).
pub fn plan_source(
    asked: &SourceName,
    snapshot: Option<&SnapshotRecord>,
    volume: Option<&VolumeRecord>,
    caps: SnapshotCaps,
) -> Result<ContentSource, SnapshotRefusal> {
    match asked {
        SourceName::Snapshot(name) => {
            if !caps.snapshots {
                return Err(SnapshotRefusal::NoSnapshots);
            }
            let rec = snapshot.ok_or_else(|| SnapshotRefusal::UnknownSnapshot(name.clone()))?;
            if let Some(step) = rec.pending {
                return Err(SnapshotRefusal::Pending {
                    name: name.clone(),
                    doing: match step {
                        SnapshotStep::Create => "created",
                        SnapshotStep::Delete => "deleted",
                    },
                });
            }
            Ok(ContentSource::Snapshot {
                name: name.clone(),
                snapshot_id: rec.snapshot_id.clone(),
            })
        }
        SourceName::Volume(name) => {
            if !caps.clones {
                return Err(SnapshotRefusal::NoClones);
            }
            let rec = volume.ok_or_else(|| SnapshotRefusal::UnknownVolume(name.clone()))?;
            if rec.destroying {
                return Err(SnapshotRefusal::SourceDestroying(name.clone()));
            }
            Ok(ContentSource::Volume {
                name: name.clone(),
                volume_id: rec.volume_id.clone(),
            })
        }
    }
}

fn shown_volume(rec: &VolumeRecord) -> String {
    crate::shown::shown(rec.name.as_deref().unwrap_or(&rec.volume_id)).into_owned()
}

/// The lock all snapshot operations of a provider take (a name no volume can have: CSI bans
/// NUL in names), so that records and calls of one snapshot never interleave.
const SNAPSHOT_LOCK: &str = "\0snapshots";

impl StorageProvider {
    fn snapshot_caps(&self) -> SnapshotCaps {
        SnapshotCaps::of(&self.capabilities())
    }

    fn refused(&self, what: String, why: SnapshotRefusal) -> ProviderError {
        ProviderError::SnapshotRefused { what, why }
    }

    /// The snapshot recorded under `name`, if any.
    pub async fn snapshot(&self, name: &str) -> Result<Option<SnapshotRecord>, ProviderError> {
        let path = self.layout().snapshot_state(name);
        let shown = crate::shown::shown(name).into_owned();
        let bytes = blocking(move || checkpoint::read(&path))
            .await
            .map_err(|source| ProviderError::Checkpoint {
                volume: format!("snapshot {shown}"),
                source,
            })?;
        bytes
            .map(|b| parse_record(&b, name))
            .transpose()
            .map_err(|reason| ProviderError::CorruptSnapshot {
                path: self.layout().snapshot_state(name),
                reason,
            })
    }

    /// Every snapshot recorded, by name. An unreadable record is skipped and logged.
    pub async fn snapshots(&self) -> Vec<SnapshotRecord> {
        let dir = self.layout().snapshots_dir();
        blocking(move || {
            let mut found = Vec::new();
            let Ok(entries) = std::fs::read_dir(&dir) else {
                return found;
            };
            for entry in entries.flatten() {
                let path = entry.path().join(crate::resource::SNAPSHOT_FILE);
                match checkpoint::read(&path) {
                    Ok(Some(bytes)) => match serde_json::from_slice::<SnapshotRecord>(&bytes) {
                        // A record filed under another name's directory is not that snapshot.
                        Ok(rec)
                            if *crate::resource::encode_volume_id(&rec.name)
                                == *entry.file_name().to_string_lossy() =>
                        {
                            found.push(rec)
                        }
                        Ok(_) => {
                            tracing::error!(path = %path.display(), "snapshot record filed under another name skipped")
                        }
                        Err(e) => {
                            tracing::error!(path = %path.display(), error = %e, "unreadable snapshot record skipped")
                        }
                    },
                    Ok(None) => {}
                    Err(e) => {
                        tracing::error!(path = %path.display(), error = %crate::error_chain::Chain(&e), "unreadable snapshot record skipped")
                    }
                }
            }
            found.sort_by(|a, b| a.name.cmp(&b.name));
            found
        })
        .await
    }

    /// Takes snapshot `name` of volume `volume_id` (or hands out the one taken under that name).
    /// Refusals come before any RPC and change nothing.
    pub async fn create_snapshot(
        &self,
        volume_id: &str,
        name: &str,
    ) -> Result<SnapshotRecord, ProviderError> {
        let what = format!("snapshot '{}'", crate::shown::shown(name));
        validate_name("snapshot", name)?;
        let lock = self.name_lock(SNAPSHOT_LOCK);
        let _guard = lock.lock().await;
        let source = self.volume(volume_id).await.ok_or_else(|| {
            self.refused(
                what.clone(),
                SnapshotRefusal::UnknownVolume(crate::shown::shown(volume_id).into_owned()),
            )
        })?;
        let existing = self.snapshot(name).await?;
        let plan = plan_create(existing.as_ref(), name, &source, self.snapshot_caps())
            .map_err(|why| self.refused(what.clone(), why))?;
        if let CreatePlan::Done(rec) = plan {
            return Ok(rec);
        }
        // A bad secrets file stops here, before the intent.
        self.secrets(source.secrets_file.as_deref(), name, "CreateSnapshot")
            .await?;
        let mut rec = existing.unwrap_or_else(|| SnapshotRecord {
            format: FORMAT_VERSION,
            name: name.to_string(),
            snapshot_id: String::new(),
            source_volume_id: source.volume_id.clone(),
            source_name: source.name.clone(),
            size_bytes: 0,
            ready_to_use: false,
            creation_time: 0,
            secrets_file: source.secrets_file.clone(),
            pending: Some(SnapshotStep::Create),
        });
        self.write_snapshot(&rec).await?;
        self.finish_snapshot_create(&mut rec).await?;
        Ok(rec)
    }

    /// CreateSnapshot for a record whose intent is durable, then the answer recorded. A definite
    /// refusal drops the intent (nothing was made); an ambiguous failure keeps it for recovery.
    async fn finish_snapshot_create(&self, rec: &mut SnapshotRecord) -> Result<(), ProviderError> {
        let secrets = self
            .secrets(rec.secrets_file.as_deref(), &rec.name, "CreateSnapshot")
            .await?;
        let answer = self
            .controller()
            .create_snapshot(proto::CreateSnapshotRequest {
                source_volume_id: rec.source_volume_id.clone(),
                name: rec.name.clone(),
                secrets: secrets.to_request(),
                parameters: Default::default(),
            })
            .await;
        let resp = match answer {
            Ok(resp) => resp,
            Err(source) => {
                if !is_ambiguous(&source) {
                    self.remove_snapshot_record(&rec.name).await?;
                }
                return Err(ProviderError::Csi {
                    volume: rec.source_volume_id.clone(),
                    source,
                });
            }
        };
        checkpoint::crash_point();
        let snap = resp
            .snapshot
            .filter(|s| !s.snapshot_id.is_empty())
            .ok_or_else(|| ProviderError::PluginMisbehaved {
                volume: rec.source_volume_id.clone(),
                rpc: "CreateSnapshot",
                what: "answered without a snapshot id".to_string(),
            })?;
        rec.snapshot_id = snap.snapshot_id;
        rec.size_bytes = u64::try_from(snap.size_bytes).unwrap_or(0);
        rec.ready_to_use = snap.ready_to_use;
        rec.creation_time = snap.creation_time.map_or(0, |t| t.seconds);
        rec.pending = None;
        self.write_snapshot(rec).await?;
        tracing::info!(snapshot = %rec.name.escape_debug(), snapshot_id = %rec.snapshot_id, volume_id = %rec.source_volume_id, "snapshot taken");
        Ok(())
    }

    /// Deletes snapshot `name` (DeleteSnapshot, then its record). Refusals come before any RPC.
    pub async fn delete_snapshot(&self, name: &str) -> Result<(), ProviderError> {
        let what = format!("delete snapshot '{}'", crate::shown::shown(name));
        let lock = self.name_lock(SNAPSHOT_LOCK);
        let _guard = lock.lock().await;
        let existing = self.snapshot(name).await?;
        let mut rec = plan_delete(existing, name, self.snapshot_caps())
            .map_err(|why| self.refused(what, why))?;
        self.secrets(rec.secrets_file.as_deref(), name, "DeleteSnapshot")
            .await?;
        if rec.pending != Some(SnapshotStep::Delete) {
            rec.pending = Some(SnapshotStep::Delete);
            self.write_snapshot(&rec).await?;
        }
        self.finish_snapshot_delete(&rec).await
    }

    /// DeleteSnapshot (idempotent in CSI) and the record removed. A record whose create was never
    /// answered has no id: the create is re-issued first (by name, so it finds what the plugin
    /// made, if anything), so that nothing is left behind.
    async fn finish_snapshot_delete(&self, rec: &SnapshotRecord) -> Result<(), ProviderError> {
        let mut rec = rec.clone();
        if rec.snapshot_id.is_empty() {
            if let Err(e) = self.finish_snapshot_create(&mut rec).await {
                // A definite refusal dropped the record: the plugin made nothing, nothing is
                // left to delete.
                return match self.snapshot(&rec.name).await? {
                    None => Ok(()),
                    Some(_) => Err(e),
                };
            }
            rec.pending = Some(SnapshotStep::Delete);
            self.write_snapshot(&rec).await?;
        }
        let secrets = self
            .secrets(rec.secrets_file.as_deref(), &rec.name, "DeleteSnapshot")
            .await?;
        self.controller()
            .delete_snapshot(proto::DeleteSnapshotRequest {
                snapshot_id: rec.snapshot_id.clone(),
                secrets: secrets.to_request(),
            })
            .await
            .map_err(|source| ProviderError::Csi {
                volume: rec.source_volume_id.clone(),
                source,
            })?;
        checkpoint::crash_point();
        self.remove_snapshot_record(&rec.name).await?;
        tracing::info!(snapshot = %rec.name.escape_debug(), snapshot_id = %rec.snapshot_id, "snapshot deleted");
        Ok(())
    }

    /// Recovery: every snapshot operation a crash interrupted is finished (a create re-issued by
    /// name, a delete re-issued); failures are logged and the intent kept for the next start or
    /// the next command on that snapshot.
    pub(crate) async fn recover_snapshots(&self) {
        let lock = self.name_lock(SNAPSHOT_LOCK);
        let _guard = lock.lock().await;
        for mut rec in self.snapshots().await {
            let result = match rec.pending {
                None => continue,
                Some(SnapshotStep::Create) => self.finish_snapshot_create(&mut rec).await,
                Some(SnapshotStep::Delete) => self.finish_snapshot_delete(&rec).await,
            };
            let step = rec.pending;
            match result {
                Ok(()) => {
                    tracing::info!(snapshot = %rec.name.escape_debug(), ?step, "recovery: snapshot operation finished");
                    self.report.lock().unwrap().actions.push(format!(
                        "snapshot {}: interrupted {step:?} finished",
                        crate::shown::shown(&rec.name)
                    ));
                }
                Err(e) => {
                    tracing::error!(snapshot = %rec.name.escape_debug(), error = %crate::error_chain::Chain(&e), "recovery: the interrupted snapshot operation failed again");
                    self.report.lock().unwrap().failures.push((
                        format!("snapshot {}", crate::shown::shown(&rec.name)),
                        crate::error_chain::full_message(&e),
                    ));
                }
            }
        }
    }

    /// The content source a new volume is made from (see [`plan_source`]).
    pub(crate) async fn content_source(
        &self,
        asked: &SourceName,
        volume: &str,
    ) -> Result<ContentSource, ProviderError> {
        let (snapshot, source) = match asked {
            SourceName::Snapshot(name) => (self.snapshot(name).await?, None),
            SourceName::Volume(name) => {
                let rec = match self.volume(name).await {
                    Some(rec) => Some(rec),
                    None => self.find_by_name(name).await,
                };
                (None, rec)
            }
        };
        plan_source(
            asked,
            snapshot.as_ref(),
            source.as_ref(),
            self.snapshot_caps(),
        )
        .map_err(|why| {
            self.refused(
                format!("create volume '{}'", crate::shown::shown(volume)),
                why,
            )
        })
    }

    async fn write_snapshot(&self, rec: &SnapshotRecord) -> Result<(), ProviderError> {
        let bytes = serde_json::to_vec_pretty(rec).expect("a snapshot record always serializes");
        let path = self.layout().snapshot_state(&rec.name);
        let shown = format!("snapshot {}", crate::shown::shown(&rec.name));
        blocking(move || checkpoint::write_atomic(&path, &bytes))
            .await
            .map_err(|source| ProviderError::Checkpoint {
                volume: shown,
                source,
            })
    }

    async fn remove_snapshot_record(&self, name: &str) -> Result<(), ProviderError> {
        let path = self.layout().snapshot_state(name);
        let shown = format!("snapshot {}", crate::shown::shown(name));
        blocking(move || {
            checkpoint::remove_durable(&path)?;
            if let Some(dir) = path.parent() {
                remove_empty_dir(dir);
            }
            Ok(())
        })
        .await
        .map_err(|source| ProviderError::Checkpoint {
            volume: shown,
            source,
        })
    }
}

/// A record read back: its name must be the one it is filed under.
fn parse_record(bytes: &[u8], name: &str) -> Result<SnapshotRecord, String> {
    let rec: SnapshotRecord = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
    if rec.name != name {
        return Err("its name does not match its directory".to_string());
    }
    Ok(rec)
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: SnapshotCaps = SnapshotCaps {
        snapshots: true,
        clones: true,
    };
    const NONE: SnapshotCaps = SnapshotCaps {
        snapshots: false,
        clones: false,
    };

    fn vol(id: &str) -> VolumeRecord {
        let mut r = VolumeRecord::new(id, crate::provider::Capability::default());
        r.name = Some(format!("{id}-name"));
        r
    }

    fn snap(name: &str, source: &str, pending: Option<SnapshotStep>) -> SnapshotRecord {
        SnapshotRecord {
            format: FORMAT_VERSION,
            name: name.into(),
            snapshot_id: if pending == Some(SnapshotStep::Create) {
                String::new()
            } else {
                format!("id-{name}")
            },
            source_volume_id: source.into(),
            source_name: None,
            size_bytes: 0,
            ready_to_use: true,
            creation_time: 0,
            secrets_file: None,
            pending,
        }
    }

    #[test]
    fn creates_are_refused_issued_or_handed_out() {
        let v = vol("v1");
        assert_eq!(
            plan_create(None, "s", &v, NONE),
            Err(SnapshotRefusal::NoSnapshots)
        );
        assert_eq!(plan_create(None, "s", &v, ALL), Ok(CreatePlan::Issue));
        let done = snap("s", "v1", None);
        assert_eq!(
            plan_create(Some(&done), "s", &v, ALL),
            Ok(CreatePlan::Done(done.clone()))
        );
        let creating = snap("s", "v1", Some(SnapshotStep::Create));
        assert_eq!(
            plan_create(Some(&creating), "s", &v, ALL),
            Ok(CreatePlan::Issue)
        );
        let deleting = snap("s", "v1", Some(SnapshotStep::Delete));
        assert!(matches!(
            plan_create(Some(&deleting), "s", &v, ALL),
            Err(SnapshotRefusal::Pending {
                doing: "deleted",
                ..
            })
        ));
        let other = snap("s", "v2", None);
        assert!(matches!(
            plan_create(Some(&other), "s", &v, ALL),
            Err(SnapshotRefusal::NameTaken { .. })
        ));
        let mut gone = vol("v1");
        gone.destroying = true;
        assert!(matches!(
            plan_create(None, "s", &gone, ALL),
            Err(SnapshotRefusal::SourceDestroying(_))
        ));
    }

    #[test]
    fn deletes_need_the_capability_and_a_record() {
        assert_eq!(
            plan_delete(None, "s", ALL),
            Err(SnapshotRefusal::UnknownSnapshot("s".into()))
        );
        assert_eq!(
            plan_delete(Some(snap("s", "v", None)), "s", NONE),
            Err(SnapshotRefusal::NoSnapshots)
        );
        assert!(plan_delete(Some(snap("s", "v", None)), "s", ALL).is_ok());
    }

    #[test]
    fn sources_need_their_capability_and_a_finished_record() {
        let s = SourceName::Snapshot("s".into());
        let c = SourceName::Volume("v1".into());
        let done = snap("s", "v1", None);
        let v = vol("v1");
        assert_eq!(
            plan_source(&s, Some(&done), None, ALL),
            Ok(ContentSource::Snapshot {
                name: "s".into(),
                snapshot_id: "id-s".into()
            })
        );
        assert_eq!(
            plan_source(&s, Some(&done), None, NONE),
            Err(SnapshotRefusal::NoSnapshots)
        );
        assert_eq!(
            plan_source(&s, None, None, ALL),
            Err(SnapshotRefusal::UnknownSnapshot("s".into()))
        );
        let creating = snap("s", "v1", Some(SnapshotStep::Create));
        assert!(matches!(
            plan_source(&s, Some(&creating), None, ALL),
            Err(SnapshotRefusal::Pending {
                doing: "created",
                ..
            })
        ));
        assert_eq!(
            plan_source(&c, None, Some(&v), ALL),
            Ok(ContentSource::Volume {
                name: "v1".into(),
                volume_id: "v1".into()
            })
        );
        let snapshots_only = SnapshotCaps {
            snapshots: true,
            clones: false,
        };
        assert_eq!(
            plan_source(&c, None, Some(&v), snapshots_only),
            Err(SnapshotRefusal::NoClones)
        );
        assert_eq!(
            plan_source(&c, None, None, ALL),
            Err(SnapshotRefusal::UnknownVolume("v1".into()))
        );
    }

    #[test]
    fn records_round_trip_and_are_checked_against_their_place() {
        let rec = snap("s", "v", Some(SnapshotStep::Delete));
        let bytes = serde_json::to_vec(&rec).unwrap();
        assert_eq!(parse_record(&bytes, "s").unwrap(), rec);
        assert!(parse_record(&bytes, "t").is_err());
        assert!(String::from_utf8(bytes)
            .unwrap()
            .contains("\"pending\":\"delete\""));
        let source = ContentSource::Snapshot {
            name: "s".into(),
            snapshot_id: "id".into(),
        };
        assert!(matches!(
            source.to_proto().r#type,
            Some(proto::volume_content_source::Type::Snapshot(ref s)) if s.snapshot_id == "id"
        ));
    }
}
