//! The Node service: stage, publish, their reverses, volume stats and node info.
//!
//! Every "is it staged / published" question is answered by the backing from the kernel's
//! mount table, so repeated calls are idempotent and a restarted plugin picks up where the
//! previous one left off. The volume record keeps the capability each staging path and
//! target was mounted with, so a repeated call with another capability is refused
//! (ALREADY_EXISTS) instead of answered OK. Node calls about a volume the plugin does not
//! know fail with NOT_FOUND, unstage and unpublish included: the plugin never touches a
//! path for a volume it does not know.

use csi_isolator::io_step::IoStep;
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

use tonic::{Request, Response, Status};

use super::backing::{Backing, BackingKind, MountState};
use super::controller::{
    asked_fs_type, capability_record, check_capability, check_volume_access, check_volume_fs_type,
    is_block, volume_fs_type, wants_readonly, FS_TYPE_KEY,
};
use super::mount_options;
use super::multinode::publish_context;
use super::store::{CapabilityRecord, VolumeRecord, RECORD_VERSION};
use super::{require, LockKey, Plugin, PluginError, PluginMode, PluginService};
use csi_isolator::csi::proto;
use csi_isolator::csi::proto::node_service_capability::rpc::Type as Cap;
use csi_isolator::csi::proto::volume_capability::access_mode::Mode;

/// Checks the request's capability against the backing and returns its comparable form.
fn require_capability(
    rpc: &'static str,
    cap: Option<&proto::VolumeCapability>,
    kind: BackingKind,
) -> Result<CapabilityRecord, PluginError> {
    let cap = cap.ok_or(PluginError::MissingField {
        rpc,
        field: "volume_capability",
    })?;
    check_capability(rpc, "volume_capability", cap, kind)?;
    Ok(capability_record(cap))
}

/// A node call's capability against the volume: the same access type as the volume's, and not
/// read-only for a block volume (this plugin does not make a device read-only).
fn check_node_access(
    rpc: &'static str,
    cap: &proto::VolumeCapability,
    volume_id: &str,
    block: bool,
    readonly: bool,
) -> Result<(), PluginError> {
    check_volume_access(rpc, "volume_capability", cap, volume_id, block)?;
    if block && readonly {
        return Err(PluginError::InvalidField {
            rpc,
            field: "readonly",
            reason: "read-only block access is not supported by this plugin".into(),
        });
    }
    Ok(())
}

impl Plugin {
    fn backing_err(
        rpc: &'static str,
        volume_id: &str,
    ) -> impl FnOnce(super::BackingError) -> PluginError {
        let volume_id = volume_id.to_string();
        move |source| PluginError::Backing {
            rpc,
            volume_id,
            source,
        }
    }

    /// The `volume_mount_group` of a mount capability: `None` when empty (or a block volume);
    /// a gid otherwise. INVALID_ARGUMENT when it is not a decimal gid, or when the plugin does
    /// not offer VOLUME_MOUNT_GROUP (a CO must not send it then: refusing shows one that does).
    fn mount_group(
        &self,
        rpc: &'static str,
        cap: Option<&proto::VolumeCapability>,
    ) -> Result<Option<u32>, PluginError> {
        let text = match cap.and_then(|c| c.access_type.as_ref()) {
            Some(proto::volume_capability::AccessType::Mount(m)) => m.volume_mount_group.as_str(),
            _ => "",
        };
        if text.is_empty() {
            return Ok(None);
        }
        let invalid = |reason: String| PluginError::InvalidField {
            rpc,
            field: "volume_capability.mount.volume_mount_group",
            reason,
        };
        if !self.config.volume_mount_group {
            return Err(invalid(
                "given, but the plugin does not offer VOLUME_MOUNT_GROUP".into(),
            ));
        }
        parse_gid(text).map(Some).map_err(invalid)
    }

    /// The volume a node RPC works on. A node-only plugin (no controller service) has no
    /// CreateVolume, so it adopts any volume id it is handed, as a node plugin for
    /// pre-provisioned storage would.
    fn node_volume(
        &self,
        rpc: &'static str,
        volume_id: &str,
        cap: Option<&proto::VolumeCapability>,
        contexts: [&HashMap<String, String>; 2],
    ) -> Result<VolumeRecord, PluginError> {
        if self.config.mode == PluginMode::Node {
            let record = self.node_mode_volume(rpc, volume_id, contexts)?;
            if let Some(cap) = cap {
                check_volume_fs_type(rpc, "volume_capability", &record, cap, self.backing.kind())?;
            }
            return Ok(record);
        }
        if let Some(record) = self.store.get(volume_id) {
            if let Some(cap) = cap {
                check_volume_fs_type(rpc, "volume_capability", &record, cap, self.backing.kind())?;
            }
            return Ok(record);
        }
        if self.config.controller {
            return Err(PluginError::VolumeNotFound {
                rpc,
                volume_id: volume_id.to_string(),
            });
        }
        let mut record = VolumeRecord {
            version: RECORD_VERSION,
            id: volume_id.to_string(),
            name: volume_id.to_string(),
            capacity_bytes: self.backing.size_for(0),
            parameters: BTreeMap::new(),
            // The fs type its first node call asks for (the loop backing's default without).
            volume_context: match self.backing.kind() {
                BackingKind::Dir => BTreeMap::new(),
                // A block volume is a raw image: no filesystem.
                BackingKind::Loop if cap.is_some_and(is_block) => BTreeMap::new(),
                BackingKind::Loop => {
                    let asked = cap.map(asked_fs_type).unwrap_or_default();
                    let fs_type = if asked.is_empty() {
                        super::backing::DEFAULT_FS_TYPE
                    } else {
                        asked
                    };
                    BTreeMap::from([(FS_TYPE_KEY.to_string(), fs_type.to_string())])
                }
            },
            published_nodes: BTreeMap::new(),
            staged: BTreeMap::new(),
            published: BTreeMap::new(),
            content_source: None,
            mutable_parameters: BTreeMap::new(),
            location: None,
        };
        // As CreateVolume: at least the smallest filesystem of its type (xfs: 300 MiB).
        let min_fs = super::backing::min_fs_bytes(&volume_fs_type(&record, self.backing.kind()));
        record.capacity_bytes = record.capacity_bytes.max(min_fs);
        self.provision(rpc, &record, cap.is_some_and(is_block))?;
        tracing::info!(volume_id, "node-only plugin adopted volume");
        Ok(record)
    }

    /// A path already holds the volume: compatible with `cap` when the recorded capability
    /// (of `uses`, keyed by the path as requested) is the same, or, with none recorded (a
    /// mount made before its record was written), when the read-only state matches; then
    /// recorded.
    #[allow(clippy::too_many_arguments)]
    fn check_existing_use(
        &self,
        rpc: &'static str,
        record: &mut VolumeRecord,
        uses: fn(&mut VolumeRecord) -> &mut BTreeMap<String, CapabilityRecord>,
        key: &str,
        cap: CapabilityRecord,
        mounted_readonly: bool,
        wanted_readonly: bool,
    ) -> Result<(), PluginError> {
        let volume_id = record.id.clone();
        let conflict = |what: String| PluginError::PathConflict {
            rpc,
            volume_id,
            path: PathBuf::from(key),
            what,
        };
        if mounted_readonly != wanted_readonly {
            return Err(conflict(format!(
                "this volume with readonly={mounted_readonly}"
            )));
        }
        match uses(record).get(key) {
            Some(existing) if *existing != cap => Err(conflict(format!(
                "this volume with capability {existing:?}"
            ))),
            Some(_) => Ok(()),
            None => {
                uses(record).insert(key.to_string(), cap);
                self.save_use(rpc, record)
            }
        }
    }

    /// SINGLE_NODE_SINGLE_WRITER: one workload, so one target path. A publish at another
    /// target path while one published with that mode stands (or with that mode while another
    /// stands) is FAILED_PRECONDITION: the CO exceeded the volume's capability.
    fn check_single_workload(
        &self,
        rpc: &'static str,
        record: &VolumeRecord,
        target: &str,
        cap: &CapabilityRecord,
    ) -> Result<(), PluginError> {
        let single = |c: &CapabilityRecord| c.access_mode == Mode::SingleNodeSingleWriter as i32;
        let other = record
            .published
            .iter()
            .find(|(path, existing)| *path != target && (single(cap) || single(existing)));
        match other {
            Some((path, _)) => Err(PluginError::FailedPrecondition {
                rpc,
                volume_id: record.id.clone(),
                reason: format!(
                    "published at {path} already, and SINGLE_NODE_SINGLE_WRITER allows one target path"
                ),
            }),
            None => Ok(()),
        }
    }

    /// With PUBLISH_UNPUBLISH_VOLUME on, the volume must be controller-published to this
    /// node and the request must carry the publish_context that call returned.
    fn check_publish_context(
        &self,
        rpc: &'static str,
        record: &VolumeRecord,
        context: &HashMap<String, String>,
    ) -> Result<(), PluginError> {
        if !self.config.requires_controller_publish() {
            return Ok(());
        }
        let node = &self.config.node_id;
        let reason = if !self
            .controller_publications(rpc, record)?
            .contains_key(node)
        {
            format!("not controller-published to node {node}")
        } else if *context
            != publish_context(&record.id, node, self.context_location(record).as_deref())
        {
            "publish_context does not match the one ControllerPublishVolume returned".to_string()
        } else {
            return Ok(());
        };
        Err(PluginError::FailedPrecondition {
            rpc,
            volume_id: record.id.clone(),
            reason,
        })
    }

    /// Node mode: a target this node published the volume at (other than `except`) that still
    /// holds it.
    fn published_here(
        &self,
        dir: &std::path::Path,
        record: &VolumeRecord,
        except: &std::path::Path,
    ) -> Result<Option<PathBuf>, super::BackingError> {
        for target in record.published.keys().map(PathBuf::from) {
            let target = std::fs::canonicalize(&target).unwrap_or(target);
            if target != except
                && matches!(
                    self.backing.mount_state(dir, &target)?,
                    MountState::Volume { .. }
                )
            {
                return Ok(Some(target));
            }
        }
        Ok(None)
    }

    fn node_stage(
        &self,
        req: proto::NodeStageVolumeRequest,
    ) -> Result<proto::NodeStageVolumeResponse, PluginError> {
        const RPC: &str = "NodeStageVolume";
        if !self.config.stage {
            return Err(PluginError::Unimplemented { rpc: RPC });
        }
        require(RPC, "volume_id", &req.volume_id)?;
        require(RPC, "staging_target_path", &req.staging_target_path)?;
        let wire_cap = req.volume_capability.as_ref();
        let cap = require_capability(RPC, wire_cap, self.backing.kind())?;
        let group = self.mount_group(RPC, wire_cap)?;
        let mut record = self.node_volume(
            RPC,
            &req.volume_id,
            wire_cap,
            [&req.publish_context, &req.volume_context],
        )?;
        self.check_publish_context(RPC, &record, &req.publish_context)?;
        self.take_up(RPC, &record)?;
        let dir = self.storage_dir(&record);
        let staging = PathBuf::from(&req.staging_target_path);
        let readonly = wants_readonly(&cap);
        let block = Backing::is_block(&dir);
        check_node_access(RPC, wire_cap.expect("checked"), &record.id, block, readonly)?;
        let flags = mount_options::mount_flags(&cap.mount_flags);
        let fs_type = volume_fs_type(&record, self.backing.kind());
        let err = || Self::backing_err(RPC, &req.volume_id);
        let staged = Backing::staged_path(&dir, &staging);
        match self.backing.mount_state(&dir, &staged).map_err(err())? {
            MountState::Volume { readonly: mounted } => {
                self.check_existing_use(
                    RPC,
                    &mut record,
                    |r| &mut r.staged,
                    &req.staging_target_path,
                    cap,
                    mounted,
                    readonly,
                )?;
                // Again: a stage interrupted between its mount and its group is finished.
                give_group(RPC, &record.id, &staged, group, mounted)?;
                Ok(proto::NodeStageVolumeResponse {})
            }
            MountState::Other(what) => Err(PluginError::PathConflict {
                rpc: RPC,
                volume_id: record.id,
                path: staging,
                what,
            }),
            MountState::NotMounted => {
                self.faults.stall(RPC);
                self.grow_filesystem_before_stage(RPC, &record.id, &fs_type)?;
                self.backing
                    .stage(&dir, &staging, &fs_type, flags)
                    .map_err(err())?;
                give_group(RPC, &record.id, &staged, group, readonly)?;
                record.staged.insert(req.staging_target_path.clone(), cap);
                self.save_use(RPC, &record)?;
                tracing::info!(volume_id = %record.id, staging = %staging.display(), readonly, "volume staged");
                Ok(proto::NodeStageVolumeResponse {})
            }
        }
    }

    fn node_unstage(
        &self,
        req: proto::NodeUnstageVolumeRequest,
    ) -> Result<proto::NodeUnstageVolumeResponse, PluginError> {
        const RPC: &str = "NodeUnstageVolume";
        if !self.config.stage {
            return Err(PluginError::Unimplemented { rpc: RPC });
        }
        require(RPC, "volume_id", &req.volume_id)?;
        require(RPC, "staging_target_path", &req.staging_target_path)?;
        let mut record = self.known_volume(RPC, &req.volume_id)?;
        let dir = self.storage_dir(&record);
        let staging = PathBuf::from(&req.staging_target_path);
        let err = || Self::backing_err(RPC, &req.volume_id);
        let staged = Backing::staged_path(&dir, &staging);
        match self.backing.mount_state(&dir, &staged).map_err(err())? {
            MountState::NotMounted => {}
            MountState::Other(what) => {
                return Err(PluginError::FailedPrecondition {
                    rpc: RPC,
                    volume_id: record.id,
                    reason: format!(
                        "{} holds a mount that is not this volume ({what})",
                        staging.display()
                    ),
                })
            }
            MountState::Volume { .. } => {
                let canonical = std::fs::canonicalize(&staged).unwrap_or_else(|_| staged.clone());
                let targets = record.published.keys().map(PathBuf::from);
                let elsewhere = if self.config.mode == PluginMode::Node {
                    // Other nodes' mounts of the volume share this kernel's mount table on a
                    // one-machine cluster: only this node's own targets count.
                    self.published_here(&dir, &record, &canonical)
                } else {
                    self.backing.mounted_elsewhere(&dir, targets, &canonical)
                };
                if let Some(other) = elsewhere.map_err(err())? {
                    return Err(PluginError::FailedPrecondition {
                        rpc: RPC,
                        volume_id: record.id,
                        reason: format!("still published at {}", other.display()),
                    });
                }
                self.faults.stall(RPC);
                self.backing.unstage(&dir, &staging).map_err(err())?;
                tracing::info!(volume_id = %record.id, staging = %staging.display(), "volume unstaged");
            }
        }
        if record.staged.remove(&req.staging_target_path).is_some() {
            self.save_use(RPC, &record)?;
        }
        self.forget_if_unused(RPC, &record)?;
        Ok(proto::NodeUnstageVolumeResponse {})
    }

    fn node_publish(
        &self,
        req: proto::NodePublishVolumeRequest,
    ) -> Result<proto::NodePublishVolumeResponse, PluginError> {
        const RPC: &str = "NodePublishVolume";
        require(RPC, "volume_id", &req.volume_id)?;
        require(RPC, "target_path", &req.target_path)?;
        let wire_cap = req.volume_capability.as_ref();
        let cap = require_capability(RPC, wire_cap, self.backing.kind())?;
        if self.config.stage {
            require(RPC, "staging_target_path", &req.staging_target_path)?;
        }
        let group = self.mount_group(RPC, wire_cap)?;
        let mut record = self.node_volume(
            RPC,
            &req.volume_id,
            wire_cap,
            [&req.publish_context, &req.volume_context],
        )?;
        self.check_publish_context(RPC, &record, &req.publish_context)?;
        self.take_up(RPC, &record)?;
        if req.readonly && cap.mount_flags.iter().any(|f| f == "rw") {
            return Err(PluginError::InvalidField {
                rpc: RPC,
                field: "volume_capability",
                reason: "mount flag \"rw\" contradicts readonly=true".into(),
            });
        }
        self.check_single_workload(RPC, &record, &req.target_path, &cap)?;
        let dir = self.storage_dir(&record);
        let err = || Self::backing_err(RPC, &req.volume_id);
        // Read-only when asked by the flag or the `ro` mount flag; a bind of a read-only
        // staging mount is read-only too.
        let mut readonly = req.readonly || wants_readonly(&cap);
        let block = Backing::is_block(&dir);
        check_node_access(RPC, wire_cap.expect("checked"), &record.id, block, readonly)?;
        let fs_type = volume_fs_type(&record, self.backing.kind());
        let staging = self
            .config
            .stage
            .then(|| PathBuf::from(&req.staging_target_path));
        if let Some(staging) = &staging {
            let staged = Backing::staged_path(&dir, staging);
            match self.backing.mount_state(&dir, &staged).map_err(err())? {
                MountState::Volume {
                    readonly: staged_ro,
                } => readonly |= staged_ro,
                _ => {
                    return Err(PluginError::FailedPrecondition {
                        rpc: RPC,
                        volume_id: record.id,
                        reason: format!("not staged at {}", staging.display()),
                    })
                }
            }
        }
        let target = PathBuf::from(&req.target_path);
        match self.backing.mount_state(&dir, &target).map_err(err())? {
            MountState::Volume { readonly: mounted } => {
                self.check_existing_use(
                    RPC,
                    &mut record,
                    |r| &mut r.published,
                    &req.target_path,
                    cap,
                    mounted,
                    readonly,
                )?;
                give_group(RPC, &record.id, &target, group, mounted)?;
                Ok(proto::NodePublishVolumeResponse {})
            }
            MountState::Other(what) => Err(PluginError::PathConflict {
                rpc: RPC,
                volume_id: record.id,
                path: target,
                what,
            }),
            MountState::NotMounted => {
                self.faults.stall(RPC);
                let flags = csi_isolator::mount::MountFlags {
                    readonly,
                    ..mount_options::mount_flags(&cap.mount_flags)
                };
                self.backing
                    .publish(&dir, staging.as_deref(), &target, &fs_type, flags)
                    .map_err(err())?;
                give_group(RPC, &record.id, &target, group, readonly)?;
                record.published.insert(req.target_path.clone(), cap);
                self.save_use(RPC, &record)?;
                tracing::info!(volume_id = %record.id, target = %target.display(), readonly, "volume published");
                Ok(proto::NodePublishVolumeResponse {})
            }
        }
    }

    fn node_unpublish(
        &self,
        req: proto::NodeUnpublishVolumeRequest,
    ) -> Result<proto::NodeUnpublishVolumeResponse, PluginError> {
        const RPC: &str = "NodeUnpublishVolume";
        require(RPC, "volume_id", &req.volume_id)?;
        require(RPC, "target_path", &req.target_path)?;
        let mut record = self.known_volume(RPC, &req.volume_id)?;
        let dir = self.storage_dir(&record);
        let target = PathBuf::from(&req.target_path);
        let err = || Self::backing_err(RPC, &req.volume_id);
        match self.backing.mount_state(&dir, &target).map_err(err())? {
            MountState::Other(what) => {
                return Err(PluginError::FailedPrecondition {
                    rpc: RPC,
                    volume_id: record.id,
                    reason: format!(
                        "{} holds a mount that is not this volume ({what})",
                        target.display()
                    ),
                })
            }
            MountState::Volume { .. } => self.faults.stall(RPC),
            MountState::NotMounted => {}
        }
        self.backing.unpublish(&dir, &target).map_err(err())?;
        if record.published.remove(&req.target_path).is_some() {
            self.save_use(RPC, &record)?;
        }
        self.forget_if_unused(RPC, &record)?;
        Ok(proto::NodeUnpublishVolumeResponse {})
    }

    fn node_stats(
        &self,
        req: proto::NodeGetVolumeStatsRequest,
    ) -> Result<proto::NodeGetVolumeStatsResponse, PluginError> {
        const RPC: &str = "NodeGetVolumeStats";
        if !self.config.volume_stats {
            return Err(PluginError::Unimplemented { rpc: RPC });
        }
        require(RPC, "volume_id", &req.volume_id)?;
        require(RPC, "volume_path", &req.volume_path)?;
        let record = self.known_volume(RPC, &req.volume_id)?;
        let dir = self.storage_dir(&record);
        let path = PathBuf::from(&req.volume_path);
        let storage = self.backing.storage_path(&dir);
        let condition = super::stats::condition(&storage, &path);
        // With its storage gone the mount cannot be told to be the volume's: the record
        // (the paths it was staged and published at) says whether the path is.
        let recorded = record.published.contains_key(&req.volume_path)
            || record.staged.contains_key(&req.volume_path);
        let here = if condition.abnormal && recorded {
            true
        } else {
            let state = self
                .backing
                .mount_state(&dir, &path)
                .map_err(Self::backing_err(RPC, &record.id))?;
            matches!(state, MountState::Volume { .. })
        };
        if !here {
            return Err(PluginError::VolumeNotAtPath {
                rpc: RPC,
                volume_id: record.id,
                path,
            });
        }
        let usage = if Backing::is_block(&dir) {
            super::stats::block_usage(record.capacity_bytes)
        } else {
            super::stats::usage_of(&path).map_err(|errno| PluginError::Backing {
                rpc: RPC,
                volume_id: record.id.clone(),
                source: super::BackingError::Io(IoStep::new(
                    "statvfs",
                    path.clone(),
                    std::io::Error::from(errno),
                )),
            })?
        };
        Ok(proto::NodeGetVolumeStatsResponse {
            usage,
            volume_condition: Some(condition),
        })
    }

    fn node_capabilities(
        &self,
        _req: proto::NodeGetCapabilitiesRequest,
    ) -> Result<proto::NodeGetCapabilitiesResponse, PluginError> {
        let mut caps = Vec::new();
        if self.config.stage {
            caps.push(Cap::StageUnstageVolume);
        }
        if self.config.volume_stats {
            caps.push(Cap::GetVolumeStats);
            caps.push(Cap::VolumeCondition);
        }
        // Access modes SINGLE_NODE_SINGLE_WRITER and SINGLE_NODE_MULTI_WRITER.
        caps.push(Cap::SingleNodeMultiWriter);
        if self.config.volume_mount_group {
            caps.push(Cap::VolumeMountGroup);
        }
        if self.expansion() != super::Expansion::None {
            caps.push(Cap::ExpandVolume);
        }
        Ok(proto::NodeGetCapabilitiesResponse {
            capabilities: caps
                .into_iter()
                .map(|c| proto::NodeServiceCapability {
                    r#type: Some(proto::node_service_capability::Type::Rpc(
                        proto::node_service_capability::Rpc { r#type: c as i32 },
                    )),
                })
                .collect(),
        })
    }

    fn node_info(
        &self,
        _req: proto::NodeGetInfoRequest,
    ) -> Result<proto::NodeGetInfoResponse, PluginError> {
        Ok(proto::NodeGetInfoResponse {
            node_id: self.config.node_id.clone(),
            accessible_topology: self.topology(),
            ..Default::default()
        })
    }
}

#[tonic::async_trait]
impl proto::node_server::Node for PluginService {
    async fn node_stage_volume(
        &self,
        request: Request<proto::NodeStageVolumeRequest>,
    ) -> Result<Response<proto::NodeStageVolumeResponse>, Status> {
        let req = request.into_inner();
        let id = req.volume_id.clone();
        self.call(
            "NodeStageVolume",
            &id,
            LockKey::Volume(id.clone()),
            req,
            |p: &Plugin, req: proto::NodeStageVolumeRequest| {
                p.check_secrets("NodeStageVolume", &req.secrets)?;
                Plugin::node_stage(p, req)
            },
        )
        .await
    }

    async fn node_unstage_volume(
        &self,
        request: Request<proto::NodeUnstageVolumeRequest>,
    ) -> Result<Response<proto::NodeUnstageVolumeResponse>, Status> {
        let req = request.into_inner();
        let id = req.volume_id.clone();
        self.call(
            "NodeUnstageVolume",
            &id,
            LockKey::Volume(id.clone()),
            req,
            Plugin::node_unstage,
        )
        .await
    }

    async fn node_publish_volume(
        &self,
        request: Request<proto::NodePublishVolumeRequest>,
    ) -> Result<Response<proto::NodePublishVolumeResponse>, Status> {
        let req = request.into_inner();
        let id = req.volume_id.clone();
        self.call(
            "NodePublishVolume",
            &id,
            LockKey::Volume(id.clone()),
            req,
            |p: &Plugin, req: proto::NodePublishVolumeRequest| {
                p.check_secrets("NodePublishVolume", &req.secrets)?;
                Plugin::node_publish(p, req)
            },
        )
        .await
    }

    async fn node_unpublish_volume(
        &self,
        request: Request<proto::NodeUnpublishVolumeRequest>,
    ) -> Result<Response<proto::NodeUnpublishVolumeResponse>, Status> {
        let req = request.into_inner();
        let id = req.volume_id.clone();
        self.call(
            "NodeUnpublishVolume",
            &id,
            LockKey::Volume(id.clone()),
            req,
            Plugin::node_unpublish,
        )
        .await
    }

    async fn node_get_volume_stats(
        &self,
        request: Request<proto::NodeGetVolumeStatsRequest>,
    ) -> Result<Response<proto::NodeGetVolumeStatsResponse>, Status> {
        let req = request.into_inner();
        let id = req.volume_id.clone();
        self.call(
            "NodeGetVolumeStats",
            &id,
            LockKey::Volume(id.clone()),
            req,
            Plugin::node_stats,
        )
        .await
    }

    async fn node_expand_volume(
        &self,
        request: Request<proto::NodeExpandVolumeRequest>,
    ) -> Result<Response<proto::NodeExpandVolumeResponse>, Status> {
        let req = request.into_inner();
        let id = req.volume_id.clone();
        self.call(
            "NodeExpandVolume",
            &id,
            LockKey::Volume(id.clone()),
            req,
            |p: &Plugin, req| {
                p.check_secrets("NodeExpandVolume", &req.secrets)?;
                Plugin::node_expand(p, req)
            },
        )
        .await
    }

    async fn node_get_capabilities(
        &self,
        request: Request<proto::NodeGetCapabilitiesRequest>,
    ) -> Result<Response<proto::NodeGetCapabilitiesResponse>, Status> {
        let req = request.into_inner();
        self.call(
            "NodeGetCapabilities",
            "",
            LockKey::None,
            req,
            Plugin::node_capabilities,
        )
        .await
    }

    async fn node_get_info(
        &self,
        request: Request<proto::NodeGetInfoRequest>,
    ) -> Result<Response<proto::NodeGetInfoResponse>, Status> {
        self.call(
            "NodeGetInfo",
            "",
            LockKey::None,
            request.into_inner(),
            Plugin::node_info,
        )
        .await
    }
}

/// A `volume_mount_group` as a gid: decimal digits only, within a gid's range (not the
/// (uid_t)-1 that chown reads as "leave unchanged").
fn parse_gid(text: &str) -> Result<u32, String> {
    let shown = text.escape_debug().to_string();
    let shown: String = shown.chars().take(40).collect();
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("'{shown}' is not a decimal group id"));
    }
    match text.parse::<u32>() {
        Ok(gid) if gid != u32::MAX => Ok(gid),
        _ => Err(format!("'{shown}' is out of the range of group ids")),
    }
}

/// Gives the volume root mounted at `root` the group `gid` with group read, write and search
/// and set-group-id (what the workload creates there keeps the group), through an fd opened
/// without following a symlink; nothing beneath the root is touched. A read-only mount is left
/// as it is (nothing can be written to it, its root included).
fn give_group(
    rpc: &'static str,
    volume_id: &str,
    root: &std::path::Path,
    gid: Option<u32>,
    readonly: bool,
) -> Result<(), PluginError> {
    let Some(gid) = gid else { return Ok(()) };
    if readonly {
        tracing::info!(volume_id, root = %root.display(), gid, "read-only: volume_mount_group not applied");
        return Ok(());
    }
    let io = |step: &'static str| {
        let path = root.to_path_buf();
        move |errno: nix::Error| PluginError::Backing {
            rpc,
            volume_id: volume_id.to_string(),
            source: super::BackingError::Io(IoStep::new(step, path, std::io::Error::from(errno))),
        }
    };
    use nix::fcntl::{open, OFlag};
    use nix::sys::stat::{fchmod, fstat, Mode as FileMode};
    let fd = open(
        root,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        FileMode::empty(),
    )
    .map_err(io("open volume root"))?;
    let st = fstat(&fd).map_err(io("stat volume root"))?;
    nix::unistd::fchown(&fd, None, Some(nix::unistd::Gid::from_raw(gid)))
        .map_err(io("change the group of volume root"))?;
    // chown clears set-group-id on some filesystems: the mode is set after it.
    let mode = (st.st_mode & 0o7777) | 0o2070;
    fchmod(&fd, FileMode::from_bits_truncate(mode))
        .map_err(io("make group-writable volume root"))?;
    tracing::info!(volume_id, root = %root.display(), gid, "volume root given the volume_mount_group");
    Ok(())
}
