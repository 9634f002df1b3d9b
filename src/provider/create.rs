//! Creating, declaring and destroying volumes.
//!
//! create: the name is checked against CSI's rules for
//! `CreateVolumeRequest.name` first (see [`validate_volume_name`]), so a
//! name the spec forbids never reaches an intent or the plugin. Then a
//! durable intent (`creating/<enc name>.intent`) is written before
//! CreateVolume, so a crash between the RPC and the volume's first
//! checkpoint is finished by recovery (CreateVolume is idempotent by name).
//! import: the same intent, holding the existing volume's id, is written
//! before ValidateVolumeCapabilities; the record (pre-provisioned, so kept
//! in the plugin on destroy unless asked) comes next and the intent goes
//! last, so recovery finishes an interrupted import the same way.
//! destroy: marked durably, unpublished fully, then DeleteVolume; the
//! checkpoint goes last, so a crash anywhere is finished by recovery.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::csi::proto;
use crate::durable::journal::Commit;
use crate::offload::blocking;
use crate::provider::checkpoint;
use crate::provider::error::ProviderError;
use crate::provider::mount_spec::MountSpec;
use crate::provider::parameters;
use crate::provider::profiles;
use crate::provider::snapshot::{ContentSource, SourceName};
use crate::provider::state::{Capability, VolumeRecord, VolumeState, FORMAT_VERSION};
use crate::provider::storage::{remove_empty_dir, StorageProvider};
use crate::provider::topology;
use crate::resource::Resource;

/// What to create.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CreateSpec {
    /// The CreateVolume name (the same name is the same volume).
    pub name: String,
    /// Required capacity in bytes (0: the plugin's default).
    pub capacity_bytes: u64,
    /// The capability the volume will be published with.
    pub capability: Capability,
    /// CreateVolume parameters.
    #[serde(default)]
    pub parameters: BTreeMap<String, String>,
    /// Disk profile, echoed into the resource.
    #[serde(default)]
    pub profile: Option<String>,
    /// The volume's secrets file (an absolute path; [`crate::provider::secrets`]): recorded
    /// with the volume, read at each call that carries secrets. For an import, the one given
    /// to [`StorageProvider::import_volume_with_secrets`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secrets_file: Option<std::path::PathBuf>,
    /// Where the volume's content comes from (CreateVolume's `volume_content_source`),
    /// resolved from the name the user gave ([`StorageProvider::create_volume_from`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content_source: Option<ContentSource>,
}

impl CreateSpec {
    /// A single-node-writer mount volume of `capacity_bytes`.
    pub fn new(name: impl Into<String>, capacity_bytes: u64) -> Self {
        CreateSpec {
            name: name.into(),
            capacity_bytes,
            capability: Capability::default(),
            parameters: BTreeMap::new(),
            profile: None,
            secrets_file: None,
            content_source: None,
        }
    }
}

use crate::provider::rules::{is_ambiguous, validate_volume_name};

/// An existing CSI volume to record under a name (`volume import`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ImportSpec {
    /// The name it is known by from now on.
    pub name: String,
    /// The plugin's volume id.
    pub volume_id: String,
    /// Its capacity in bytes, if known (0: unknown).
    #[serde(default)]
    pub capacity_bytes: u64,
    /// The capability it will be published with.
    pub capability: Capability,
    /// The volume context the plugin's node service needs (what
    /// CreateVolume would have returned).
    #[serde(default)]
    pub volume_context: BTreeMap<String, String>,
}

#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct CreateIntent {
    pub(crate) format: u32,
    pub(crate) spec: CreateSpec,
    /// Set for an import: the volume exists, nothing is created.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) import: Option<ImportSpec>,
}

impl StorageProvider {
    /// The volume created under `name`, if any.
    pub async fn find_by_name(&self, name: &str) -> Option<VolumeRecord> {
        // Names never change: find the slot without waiting on other
        // volumes' operations, then wait for this one only.
        let slot = self
            .slots
            .lock()
            .unwrap()
            .values()
            .find(|s| s.name.as_deref() == Some(name))
            .cloned()?;
        let rec = slot.record.lock().await.clone();
        Some(rec)
    }

    /// Creates a volume (or returns the one already created under this
    /// name) and returns the resource that hands it out. A name CSI
    /// forbids ([`validate_volume_name`]) is refused before anything is
    /// written or sent.
    #[tracing::instrument(skip(self, spec), fields(name = %spec.name.escape_debug()))]
    /// An existing volume of that name is handed out only when it was
    /// created with the same parameters; another set is refused, naming
    /// the first key that differs.
    pub async fn create_volume(&self, spec: CreateSpec) -> Result<Resource, ProviderError> {
        validate_volume_name(&spec.name)?;
        parameters::check(&spec.parameters).map_err(|source| ProviderError::Parameters {
            volume: spec.name.clone(),
            source,
        })?;
        // A bad secrets file is refused before anything is written or sent.
        self.read_secrets(spec.secrets_file.as_deref(), &spec.name, "CreateVolume")
            .await?;
        let lock = self.name_lock(&spec.name);
        let _guard = lock.lock().await;
        if let Some(rec) = self.find_by_name(&spec.name).await {
            if let Some(key) =
                parameters::first_difference(&rec.parameters.to_btree(), &spec.parameters)
            {
                return Err(ProviderError::ParametersDiffer {
                    volume: spec.name.clone(),
                    key: crate::shown::shown(key).into_owned(),
                });
            }
            crate::provider::secrets::same_file(
                &spec.name,
                rec.secrets_file.as_deref(),
                spec.secrets_file.as_deref(),
            )?;
            if rec.capability != spec.capability {
                return Err(ProviderError::CapabilityDiffers {
                    volume: spec.name.clone(),
                    recorded: rec.capability.describe(),
                    asked: spec.capability.describe(),
                });
            }
            return Ok(self.resource_for(&rec));
        }
        self.check_mode_offered(&spec.name, &spec.capability)?;
        let intent = CreateIntent {
            format: FORMAT_VERSION,
            spec,
            import: None,
        };
        self.begin_intent(&intent).await?;
        let rec = self.finish_create(&intent.spec).await?;
        Ok(self.resource_for(&rec))
    }

    /// [`create_volume`](Self::create_volume) of a volume whose content comes from `from` (a
    /// snapshot or another volume, by name), resolved before anything is written or sent: a
    /// plugin without CREATE_DELETE_SNAPSHOT or CLONE_VOLUME, and an unknown name, are refused.
    /// A volume already created under the name is handed out only when it came from the same.
    pub async fn create_volume_from(
        &self,
        mut spec: CreateSpec,
        from: Option<SourceName>,
    ) -> Result<Resource, ProviderError> {
        if let Some(from) = &from {
            validate_volume_name(&spec.name)?;
            if let Some(rec) = self.find_by_name(&spec.name).await {
                let same = match (&rec.content_source, from) {
                    (Some(ContentSource::Snapshot { name, .. }), SourceName::Snapshot(asked))
                    | (Some(ContentSource::Volume { name, .. }), SourceName::Volume(asked)) => {
                        name == asked
                    }
                    _ => false,
                };
                if !same {
                    return Err(ProviderError::ParametersDiffer {
                        volume: spec.name.clone(),
                        key: "(its content source: --from-snapshot / --from-volume)".into(),
                    });
                }
            } else {
                spec.content_source = Some(self.content_source(from, &spec.name).await?);
            }
        }
        self.create_volume(spec).await
    }

    /// The volume a mount names, or a new one made from the mount's options: `run --mount`
    /// (and `--volume NAME:SIZE:PATH`) uses a volume made earlier by `volume create` with its
    /// parameters, and with its capability unless the mount asked for another one (refused then:
    /// a volume is never used with other options than asked for).
    pub async fn volume_for_mount(&self, mount: &MountSpec) -> Result<Resource, ProviderError> {
        if let Some(rec) = self.find_by_name(&mount.source).await {
            mount.check_against(&rec)?;
            return Ok(self.resource_for(&rec));
        }
        self.create_volume(mount.create_spec(&mount.source)).await
    }

    /// Refuses an access mode the CSI spec lets a CO use only when the plugin offers a
    /// capability it does not: SINGLE_NODE_SINGLE_WRITER and SINGLE_NODE_MULTI_WRITER need the
    /// node's SINGLE_NODE_MULTI_WRITER. Checked before anything is written or sent.
    pub(crate) fn check_mode_offered(
        &self,
        volume: &str,
        capability: &Capability,
    ) -> Result<(), ProviderError> {
        use crate::csi::caps::NodeRpc;
        use proto::volume_capability::access_mode::Mode;
        let needs = matches!(
            capability.mode(),
            Some(Mode::SingleNodeSingleWriter | Mode::SingleNodeMultiWriter)
        );
        if needs && !self.capabilities().node.has(NodeRpc::SingleNodeMultiWriter) {
            return Err(ProviderError::AccessModeUnsupported {
                volume: crate::shown::shown(volume).into_owned(),
                mode: crate::shown::shown(&capability.access_mode).into_owned(),
                plugin: self.plugin().to_string(),
            });
        }
        Ok(())
    }

    /// Writes a create (or import) intent durably, before its first RPC.
    pub(crate) async fn begin_intent(&self, intent: &CreateIntent) -> Result<(), ProviderError> {
        let intent_path = self.layout.create_intent(&intent.spec.name);
        let bytes = serde_json::to_vec(intent).expect("an intent always serializes");
        let name = intent.spec.name.clone();
        blocking(move || checkpoint::write_atomic(&intent_path, &bytes))
            .await
            .map_err(|source| ProviderError::Checkpoint {
                volume: name,
                source,
            })
    }

    /// CreateVolume, the volume's first checkpoint, then the intent removed.
    pub(crate) async fn finish_create(
        &self,
        spec: &CreateSpec,
    ) -> Result<VolumeRecord, ProviderError> {
        let secrets = self
            .secrets(spec.secrets_file.as_deref(), &spec.name, "CreateVolume")
            .await?;
        let accessibility_requirements = self.accessibility_requirements().await?;
        let answer = self
            .controller
            .create_volume(proto::CreateVolumeRequest {
                accessibility_requirements,
                name: spec.name.clone(),
                capacity_range: (spec.capacity_bytes > 0).then_some(proto::CapacityRange {
                    required_bytes: i64::try_from(spec.capacity_bytes).unwrap_or(i64::MAX),
                    limit_bytes: 0,
                }),
                volume_capabilities: vec![spec.capability.to_proto()],
                parameters: spec.parameters.clone().into_iter().collect(),
                secrets: secrets.to_request(),
                volume_content_source: spec.content_source.as_ref().map(ContentSource::to_proto),
                ..Default::default()
            })
            .await;
        let resp = match answer {
            Ok(resp) => resp,
            Err(source) => {
                // A definite failure created nothing: drop the intent so that
                // recovery does not create a volume nobody asks for any more.
                // An ambiguous one (the plugin may have created it) keeps it.
                if !is_ambiguous(&source) {
                    self.drop_intent(&spec.name).await;
                }
                return Err(ProviderError::Csi {
                    volume: spec.name.clone(),
                    source,
                });
            }
        };
        checkpoint::crash_point();
        let volume = resp
            .volume
            .ok_or_else(|| ProviderError::BadCreateResponse {
                name: spec.name.clone(),
                what: "no volume",
            })?;
        if volume.volume_id.is_empty() {
            return Err(ProviderError::BadCreateResponse {
                name: spec.name.clone(),
                what: "an empty volume_id",
            });
        }
        // An id already recorded for another volume would overwrite that volume's state (and
        // hand its data out under this name): the plugin is wrong, nothing is recorded.
        if let Some(other) = self.volume(&volume.volume_id).await {
            if other.name.as_deref() != Some(spec.name.as_str()) {
                tracing::error!(volume_id = %volume.volume_id, name = %spec.name.escape_debug(),
                    other = ?other.name, "CreateVolume answered the id of another volume");
                return Err(ProviderError::BadCreateResponse {
                    name: spec.name.clone(),
                    what: "the volume_id of another volume already recorded",
                });
            }
        }
        let accessible_topology: Vec<topology::Segments> = volume
            .accessible_topology
            .into_iter()
            .map(|t| t.segments.into_iter().collect())
            .collect();
        topology::check_answer(&accessible_topology).map_err(|what| {
            ProviderError::PluginMisbehaved {
                volume: volume.volume_id.clone(),
                rpc: "CreateVolume",
                what: format!("answered accessible_topology with {what}"),
            }
        })?;
        let mut rec = VolumeRecord::new(volume.volume_id, spec.capability.clone());
        rec.accessible_topology = accessible_topology;
        rec.name = Some(spec.name.clone());
        rec.capacity_bytes = u64::try_from(volume.capacity_bytes).unwrap_or(0);
        rec.parameters = spec.parameters.clone().into();
        rec.volume_context = volume.volume_context.into_iter().collect();
        rec.readonly = rec.capability.is_reader_only();
        rec.profile = spec.profile.clone();
        rec.vendor = Some(self.vendor.clone());
        rec.secrets_file = spec.secrets_file.clone();
        rec.content_source = spec.content_source.clone();
        let rec = self.record_new(rec, &spec.name).await?;
        tracing::info!(volume_id = %rec.volume_id, name = %spec.name, "volume created");
        Ok(rec)
    }

    /// What CreateVolume asks about topology: a volume reachable from this node (requisite and
    /// preferred: this node's segments), when the plugin has VOLUME_ACCESSIBILITY_CONSTRAINTS
    /// and its node says where it is.
    async fn accessibility_requirements(
        &self,
    ) -> Result<Option<proto::TopologyRequirement>, ProviderError> {
        use crate::csi::caps::PluginService;
        let constrained = self
            .capabilities()
            .plugin
            .has(PluginService::VolumeAccessibilityConstraints);
        if !constrained {
            return Ok(None);
        }
        let node = self.node_info().await?;
        if node.topology.is_empty() {
            return Ok(None);
        }
        let here = proto::Topology {
            segments: node.topology.clone().into_iter().collect(),
        };
        Ok(Some(proto::TopologyRequirement {
            requisite: vec![here.clone()],
            preferred: vec![here],
        }))
    }

    /// The end of a create or an import: the volume's first checkpoint, then
    /// its intent (under `name`) removed, then the volume known.
    pub(crate) async fn record_new(
        &self,
        rec: VolumeRecord,
        name: &str,
    ) -> Result<VolumeRecord, ProviderError> {
        self.persist(&rec).await?;
        self.remove_intent(name).await?;
        self.make_volume_dirs(&rec.volume_id).await;
        self.insert_slot(rec.clone());
        Ok(rec)
    }

    /// Removes the create (or import) intent under `name`, durably.
    async fn remove_intent(&self, name: &str) -> Result<(), ProviderError> {
        let intent = self.layout.create_intent(name);
        blocking(move || checkpoint::remove_durable(&intent))
            .await
            .map_err(|source| ProviderError::Checkpoint {
                volume: name.to_string(),
                source,
            })
    }

    /// Drops the intent under `name` after a definite failure (the plugin made nothing), so
    /// that recovery does not make a volume nobody asks for any more. Best effort: the caller
    /// is already failing; when the removal fails too, it is logged, and the next recovery
    /// retries the create or import the intent names (and drops it when refused again).
    pub(crate) async fn drop_intent(&self, name: &str) {
        if let Err(e) = self.remove_intent(name).await {
            tracing::warn!(name = %name.escape_debug(), error = %crate::error_chain::full_message(&e),
                "cannot drop the intent of a refused create or import; recovery will finish it");
        }
    }

    /// Declares a pre-provisioned volume (one that exists in the plugin
    /// already) by id, so it can be published and unpublished; it is never
    /// created or deleted by us. Checked with ValidateVolumeCapabilities
    /// when the plugin has a controller service.
    #[tracing::instrument(skip(self, capability, volume_context))]
    pub async fn declare_volume(
        &self,
        volume_id: &str,
        capability: Capability,
        volume_context: BTreeMap<String, String>,
    ) -> Result<Resource, ProviderError> {
        if let Some(rec) = self.volume(volume_id).await {
            return Ok(self.resource_for(&rec));
        }
        self.check_mode_offered(volume_id, &capability)?;
        if self.capabilities().plugin.controller_service() {
            self.controller
                .validate_volume_capabilities(proto::ValidateVolumeCapabilitiesRequest {
                    volume_id: volume_id.to_string(),
                    volume_context: volume_context.clone().into_iter().collect(),
                    volume_capabilities: vec![capability.to_proto()],
                    ..Default::default()
                })
                .await
                .map_err(|source| ProviderError::Csi {
                    volume: volume_id.to_string(),
                    source,
                })?;
        }
        let mut rec = VolumeRecord::new(volume_id, capability);
        rec.pre_provisioned = true;
        rec.readonly = rec.capability.is_reader_only();
        rec.volume_context = volume_context.into();
        rec.vendor = Some(self.vendor.clone());
        self.persist(&rec).await?;
        self.make_volume_dirs(&rec.volume_id).await;
        self.insert_slot(rec.clone());
        Ok(self.resource_for(&rec))
    }

    /// Destroys a volume: unpublishes it fully, then DeleteVolume (not for
    /// pre-provisioned volumes, which are only forgotten). Refused while
    /// containers use it. The data is gone afterwards.
    pub async fn destroy_volume(&self, volume_id: &str) -> Result<(), ProviderError> {
        self.destroy_volume_with(volume_id, false).await
    }

    /// [`destroy_volume`](Self::destroy_volume); with `delete_imported` a
    /// pre-provisioned (imported) volume is deleted in the plugin too
    /// (`volume destroy --delete`). The choice is recorded with the mark,
    /// so recovery finishes the same destroy.
    #[tracing::instrument(skip(self))]
    pub async fn destroy_volume_with(
        &self,
        volume_id: &str,
        delete_imported: bool,
    ) -> Result<(), ProviderError> {
        let slot = self.slot(volume_id)?;
        let mut rec = slot.record.lock().await;
        if !rec.users.is_empty() {
            return Err(ProviderError::InUse {
                volume: volume_id.to_string(),
                users: rec.users.iter().cloned().collect(),
            });
        }
        // `--delete` changes the record only for an imported volume: a created one is deleted
        // from the plugin anyway, so asking again is no change to persist.
        let delete_imported = delete_imported && rec.pre_provisioned;
        // A delete no DeleteVolume can finish is refused before it is recorded: recorded, it
        // would fail every later destroy and every recovery, and the volume could not even be
        // forgotten any more.
        let caps = self.capabilities();
        if delete_imported
            && !rec.delete_imported
            && !(caps.plugin.controller_service() && caps.controller.create_delete_volume())
        {
            return Err(ProviderError::NoDeleteVolume {
                plugin: self.id().to_string(),
                volume: volume_id.to_string(),
            });
        }
        if !rec.destroying || (delete_imported && !rec.delete_imported) {
            rec.destroying = true;
            rec.delete_imported |= delete_imported;
            self.persist(&rec).await?;
        }
        self.finish_destroy(&mut rec).await
    }

    /// The rest of a destroy, from any state (also run by recovery).
    pub(crate) async fn finish_destroy(&self, rec: &mut VolumeRecord) -> Result<(), ProviderError> {
        self.drive(rec, VolumeState::Created).await?;
        if !rec.pre_provisioned || rec.delete_imported {
            let secrets = self
                .secrets(rec.secrets_file.as_deref(), &rec.volume_id, "DeleteVolume")
                .await?;
            self.controller
                .delete_volume(proto::DeleteVolumeRequest {
                    volume_id: rec.volume_id.clone(),
                    secrets: secrets.to_request(),
                })
                .await
                .map_err(|source| ProviderError::Csi {
                    volume: rec.volume_id.clone(),
                    source,
                })?;
            checkpoint::crash_point();
        }
        let layout = self.layout.clone();
        let id = rec.volume_id.clone();
        let journal = self.journal.clone();
        blocking(move || {
            remove_empty_dir(&layout.staging_path(&id));
            remove_empty_dir(&layout.mount_dir(&id));
            // The removal is journaled; the state file and its directory go at the next
            // compaction.
            journal.record(&id, None, Commit::Durable)
        })
        .await
        .map_err(|source| ProviderError::Checkpoint {
            volume: rec.volume_id.clone(),
            source,
        })?;
        self.slots.lock().unwrap().remove(&rec.volume_id);
        if rec.pre_provisioned && !rec.delete_imported {
            tracing::info!(volume_id = %rec.volume_id, "imported volume forgotten (kept in the plugin)");
        } else {
            tracing::info!(volume_id = %rec.volume_id, "volume destroyed");
        }
        Ok(())
    }
}

impl StorageProvider {
    /// Creates (or finds, with the same parameters) the volume of every
    /// profile disk of this provider among `resources` ([`profiles::profile_disk`])
    /// with its profile's capability, parameters and secrets file, and puts
    /// its source (id, relative mount root, metadata; of type `BLOCK` for a
    /// block profile) in the resource, keeping everything else. A profile
    /// the profiles file lacks, a profile disk without what names it, or one
    /// whose type asks for another kind of volume than its profile makes
    /// ([`profiles::kind_mismatch`]), is refused naming the resource.
    pub async fn create_profile_disks(
        &self,
        resources: &mut [Resource],
    ) -> Result<(), ProviderError> {
        for r in resources.iter_mut() {
            let (profile, name, bytes, asks) = match profiles::profile_disk(r, self.id()) {
                profiles::ProfileDisk::Keep => continue,
                profiles::ProfileDisk::Refuse(why) => {
                    return Err(ProviderError::BadProfileDisk {
                        resource: r.describe(),
                        why: why.to_string(),
                    })
                }
                profiles::ProfileDisk::Create {
                    profile,
                    name,
                    bytes,
                    asks,
                } => (profile.to_string(), name.to_string(), bytes, asks),
            };
            let profiles = self.config().disk_profiles.as_deref();
            let found = profiles.and_then(|p| p.get(&profile, &self.config().plugin_type));
            let Some(found) = found else {
                return Err(ProviderError::UnknownProfile {
                    resource: r.describe(),
                    profile: crate::shown::shown(&profile).into_owned(),
                    file: profiles.map(|p| p.file.clone()),
                });
            };
            let made = found.capability.access_type;
            if let Some(why) = profiles::kind_mismatch(asks, &profile, made) {
                return Err(ProviderError::BadProfileDisk {
                    resource: r.describe(),
                    why,
                });
            }
            let mut spec = CreateSpec::new(name, bytes);
            spec.capability = found.capability.clone();
            spec.parameters = found.parameters.clone();
            spec.secrets_file = found.secrets_file.clone();
            spec.profile = Some(profile);
            let created = self.create_volume(spec).await?;
            let disk = r.disk.get_or_insert_with(Default::default);
            disk.source = created.disk.and_then(|d| d.source);
        }
        Ok(())
    }
}
