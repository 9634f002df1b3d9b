//! The Controller service: volume create/delete, controller publish, listing, capacity.
//!
//! Each handler only picks the RPC name, the volume and the lock, and hands the request to a
//! synchronous operation on [`Plugin`] through [`PluginService::call`].

use std::collections::BTreeMap;

use rand::Rng;
use tonic::{Request, Response, Status};

use super::backing::{Backing, BackingKind};
use super::faults::LieMode;
use super::mount_options;
use super::multinode::publish_context;
use super::store::{CapabilityRecord, ControllerPublication};
use super::{
    require, volume_key, LockKey, Plugin, PluginError, PluginMode, PluginService,
    PARAMETER_ECHO_PREFIX,
};
use csi_isolator::csi::proto;
use csi_isolator::csi::proto::controller_service_capability::rpc::Type as Cap;
use csi_isolator::csi::proto::volume_capability::access_mode::Mode;
use csi_isolator::csi::proto::volume_capability::AccessType;
use csi_isolator::csi::CAPACITY_ENFORCED_KEY;

/// Longest volume name accepted (the CSI spec asks plugins to support at least 128).
const MAX_NAME_LEN: usize = 128;

/// Prefix of the ListVolumes tokens this plugin issues.
const TOKEN_PREFIX: &str = "after:";

/// Checks one volume capability: an access mode is set and known, the access type is
/// `mount` or, on the loop backing, `block` ([`serves_block`]); for mount, the fs type is one
/// the backing `kind` can provide, and every mount flag is one the plugin applies (see
/// [`mount_options`]; others are refused, never ignored). CSI's block capability has neither.
pub(super) fn check_capability(
    rpc: &'static str,
    field: &'static str,
    cap: &proto::VolumeCapability,
    kind: BackingKind,
) -> Result<(), PluginError> {
    let invalid = |reason: &str| PluginError::InvalidField {
        rpc,
        field,
        reason: reason.to_string(),
    };
    let mode = cap
        .access_mode
        .as_ref()
        .ok_or_else(|| invalid("access_mode is required"))?;
    let reader_only = match Mode::try_from(mode.mode) {
        Ok(Mode::Unknown) | Err(_) => return Err(invalid("access_mode.mode is unknown")),
        Ok(mode) => matches!(mode, Mode::SingleNodeReaderOnly | Mode::MultiNodeReaderOnly),
    };
    match &cap.access_type {
        Some(AccessType::Mount(mount)) => {
            super::backing::check_fs_type(&mount.fs_type, kind).map_err(|r| invalid(&r))?;
            mount_options::check_flags(&mount.mount_flags, reader_only).map_err(|r| invalid(&r))
        }
        Some(AccessType::Block(_)) if serves_block(kind) => Ok(()),
        Some(AccessType::Block(_)) => Err(invalid(&format!(
            "block access is not served by the {} backing (only by loop)",
            kind.as_str()
        ))),
        None => Err(invalid("access_type is required")),
    }
}

/// Whether a backing serves CSI's block access type: the loop backing does (a raw image on a
/// loop device); a dir volume is a directory and has no device to give.
pub(super) fn serves_block(kind: BackingKind) -> bool {
    kind == BackingKind::Loop
}

/// Whether a capability asks for block access.
pub(super) fn is_block(cap: &proto::VolumeCapability) -> bool {
    matches!(cap.access_type, Some(AccessType::Block(_)))
}

/// The one access type a CreateVolume's capabilities agree on (`true`: block): a volume is
/// either a raw device or a filesystem, so capabilities mixing both are refused.
pub(super) fn created_as_block(
    rpc: &'static str,
    caps: &[proto::VolumeCapability],
) -> Result<bool, PluginError> {
    let block = caps.iter().any(is_block);
    if block && !caps.iter().all(is_block) {
        return Err(PluginError::InvalidField {
            rpc,
            field: "volume_capabilities",
            reason: "mixes block and mount access types (a volume is one or the other)".into(),
        });
    }
    Ok(block)
}

/// A capability's access type against the volume's (`block`: created for block access): a
/// block volume has no filesystem to mount, a mount volume no device to give.
pub(super) fn check_volume_access(
    rpc: &'static str,
    field: &'static str,
    cap: &proto::VolumeCapability,
    volume_id: &str,
    block: bool,
) -> Result<(), PluginError> {
    if is_block(cap) == block {
        return Ok(());
    }
    let (is, asked) = if block {
        ("block", "mount")
    } else {
        ("mount", "block")
    };
    Err(PluginError::InvalidField {
        rpc,
        field,
        reason: format!(
            "volume {volume_id} was created for {is} access; {asked} access is refused"
        ),
    })
}

/// The fs type a capability asks for (empty: none).
pub(super) fn asked_fs_type(cap: &proto::VolumeCapability) -> &str {
    match &cap.access_type {
        Some(AccessType::Mount(mount)) => &mount.fs_type,
        _ => "",
    }
}

pub use super::store::{volume_fs_type, FS_TYPE_KEY};

/// A capability's fs type, when it asks for one, must be the volume's.
pub(super) fn check_volume_fs_type(
    rpc: &'static str,
    field: &'static str,
    record: &super::store::VolumeRecord,
    cap: &proto::VolumeCapability,
    kind: BackingKind,
) -> Result<(), PluginError> {
    let asked = asked_fs_type(cap);
    let has = volume_fs_type(record, kind);
    if asked.is_empty() || asked == has {
        return Ok(());
    }
    Err(PluginError::InvalidField {
        rpc,
        field,
        reason: format!(
            "fs_type {asked:?} asked, but volume {} was made with {has:?}",
            record.id
        ),
    })
}

/// The comparable form of a checked capability.
pub(super) fn capability_record(cap: &proto::VolumeCapability) -> CapabilityRecord {
    let block = is_block(cap);
    let (fs_type, mut mount_flags) = match &cap.access_type {
        Some(AccessType::Mount(mount)) => (mount.fs_type.clone(), mount.mount_flags.clone()),
        _ => (String::new(), Vec::new()),
    };
    mount_flags.sort();
    mount_flags.dedup();
    CapabilityRecord {
        access_mode: cap.access_mode.as_ref().map_or(0, |m| m.mode),
        fs_type: if fs_type.is_empty() && !block {
            "ext4".to_string()
        } else {
            fs_type
        },
        mount_flags,
        block,
    }
}

/// Whether a capability asks for a read-only mount (the `ro` mount flag).
pub(super) fn wants_readonly(cap: &CapabilityRecord) -> bool {
    cap.mount_flags.iter().any(|f| f == "ro")
}

/// The (required, limit) bytes of a capacity range (0: none), refused INVALID_ARGUMENT when
/// negative or when the limit is below what is required.
pub(super) fn capacity_range(
    rpc: &'static str,
    range: &proto::CapacityRange,
) -> Result<(u64, u64), PluginError> {
    let bad = |reason: &str| PluginError::InvalidField {
        rpc,
        field: "capacity_range",
        reason: reason.to_string(),
    };
    let required =
        u64::try_from(range.required_bytes).map_err(|_| bad("required_bytes is negative"))?;
    let limit = u64::try_from(range.limit_bytes).map_err(|_| bad("limit_bytes is negative"))?;
    if limit != 0 && limit < required {
        return Err(bad("limit_bytes is smaller than required_bytes"));
    }
    Ok((required, limit))
}

fn new_volume_id(prefix: &str) -> String {
    let bits: u64 = rand::rng().random();
    format!("{prefix}{bits:016x}")
}

/// Which bound decides what CreateVolume may still give.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Bound {
    /// The plugin's configured total (`--capacity`) less what was promised.
    Total,
    /// The work dir's free space less what the images may still fill.
    Filesystem,
}

/// What CreateVolume may still give, and which bound decides it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Room {
    pub bytes: u64,
    pub bound: Bound,
}

/// The smaller of `total - promised` and `fs_free - unallocated` (the filesystem bound is
/// skipped when statvfs failed), saturating at 0; a tie is the total's.
pub(super) fn room(total: u64, promised: u64, fs_free: Option<u64>, unallocated: u64) -> Room {
    let by_total = Room {
        bytes: total.saturating_sub(promised),
        bound: Bound::Total,
    };
    match fs_free {
        Some(free) if free.saturating_sub(unallocated) < by_total.bytes => Room {
            bytes: free.saturating_sub(unallocated),
            bound: Bound::Filesystem,
        },
        _ => by_total,
    }
}

/// Refuses a CreateVolume that lacks a parameter `--require-parameters` asks for, or gives
/// it another value, naming the key.
fn check_required_parameters(
    required: &[super::RequiredParameter],
    got: &BTreeMap<String, String>,
) -> Result<(), PluginError> {
    for r in required {
        let reason = match (got.get(&r.key), &r.value) {
            (None, _) => {
                "is required by this plugin (--require-parameters) and missing".to_string()
            }
            (Some(v), Some(want)) if v != want => format!(
                "must be '{}' (--require-parameters), got '{}'",
                want.escape_debug(),
                csi_isolator::shown::shown(v)
            ),
            _ => continue,
        };
        return Err(PluginError::InvalidField {
            rpc: "CreateVolume",
            field: "parameters",
            reason: format!("parameter '{}' {reason}", r.key.escape_debug()),
        });
    }
    Ok(())
}

fn to_volume(record: &super::store::VolumeRecord) -> proto::Volume {
    use super::store::ContentSource;
    use proto::volume_content_source::{SnapshotSource, Type, VolumeSource};
    let content_source = record
        .content_source
        .as_ref()
        .map(|s| proto::VolumeContentSource {
            r#type: Some(match s {
                ContentSource::Snapshot(id) => Type::Snapshot(SnapshotSource {
                    snapshot_id: id.clone(),
                }),
                ContentSource::Volume(id) => Type::Volume(VolumeSource {
                    volume_id: id.clone(),
                }),
            }),
        });
    proto::Volume {
        capacity_bytes: i64::try_from(record.capacity_bytes).unwrap_or(i64::MAX),
        volume_id: record.id.clone(),
        volume_context: record
            .volume_context
            .clone()
            .into_iter()
            .chain(super::modify::echo(&record.mutable_parameters))
            .collect(),
        content_source,
        ..Default::default()
    }
}

impl Plugin {
    fn controller_enabled(&self, rpc: &'static str) -> Result<(), PluginError> {
        if !self.config.controller {
            return Err(PluginError::Unimplemented { rpc });
        }
        Ok(())
    }

    fn create_volume(
        &self,
        req: proto::CreateVolumeRequest,
    ) -> Result<proto::CreateVolumeResponse, PluginError> {
        const RPC: &str = "CreateVolume";
        self.controller_enabled(RPC)?;
        require(RPC, "name", &req.name)?;
        if req.name.len() > MAX_NAME_LEN {
            return Err(PluginError::InvalidField {
                rpc: RPC,
                field: "name",
                reason: format!("longer than {MAX_NAME_LEN} bytes"),
            });
        }
        if req.volume_capabilities.is_empty() {
            return Err(PluginError::MissingField {
                rpc: RPC,
                field: "volume_capabilities",
            });
        }
        for cap in &req.volume_capabilities {
            check_capability(RPC, "volume_capabilities", cap, self.backing.kind())?;
        }
        let block = created_as_block(RPC, &req.volume_capabilities)?;
        // One filesystem per volume: the capabilities that name one must agree.
        let mut asked: Vec<&str> = req
            .volume_capabilities
            .iter()
            .map(asked_fs_type)
            .filter(|t| !t.is_empty())
            .collect();
        asked.dedup();
        if asked.len() > 1 {
            return Err(PluginError::InvalidField {
                rpc: RPC,
                field: "volume_capabilities",
                reason: format!("fs types {asked:?} differ: a volume has one filesystem"),
            });
        }
        // Only named here: it is looked up (and locked) after the name check, which may lock a
        // volume of that name, and a volume's lock is not taken twice.
        let content_source = self.requested_source(req.volume_content_source.as_ref())?;
        let mut fs_type = match self.backing.kind() {
            BackingKind::Dir => None,
            // A block volume is a raw image: no filesystem.
            BackingKind::Loop if block => None,
            BackingKind::Loop => Some(
                asked
                    .first()
                    .copied()
                    .unwrap_or(super::backing::DEFAULT_FS_TYPE)
                    .to_string(),
            ),
        };
        let (required, limit) = capacity_range(RPC, &req.capacity_range.unwrap_or_default())?;
        let parameters: BTreeMap<String, String> = req.parameters.into_iter().collect();
        check_required_parameters(&self.config.required_parameters, &parameters)?;
        let mutable_parameters = self.create_mutable(&req.mutable_parameters)?;
        self.check_requisite(req.accessibility_requirements.as_ref())?;

        if let Some(found) = self.store.find_by_name(&req.name) {
            // A DeleteVolume of it may be running (it holds only the volume's lock): wait for
            // it, then answer from what is left. Lock order: create, then volume.
            let _volume = self.locks.blocking_lock(&volume_key(&found.id));
            if let Some(existing) = self.store.get(&found.id) {
                let fits = existing.capacity_bytes >= required
                    && (limit == 0 || existing.capacity_bytes <= limit);
                let same_access = Backing::is_block(&self.store.volume_dir(&existing.id)) == block;
                let has = volume_fs_type(&existing, self.backing.kind());
                let same_fs = match &content_source {
                    // The source decided it: only an fs type asked for is compared.
                    Some(_) => asked.first().is_none_or(|t| *t == has),
                    None => fs_type.as_ref().is_none_or(|t| *t == has),
                };
                let same_source = existing.content_source == content_source;
                if !fits
                    || !same_fs
                    || existing.parameters != parameters
                    || !same_access
                    || !same_source
                {
                    return Err(PluginError::NameConflict {
                        name: req.name,
                        volume_id: existing.id,
                        capacity: existing.capacity_bytes,
                    });
                }
                return Ok(proto::CreateVolumeResponse {
                    volume: Some(self.with_topology(to_volume(&existing))),
                });
            }
        }

        let source = match &content_source {
            Some(requested) => Some(self.lock_source(requested)?),
            None => None,
        };
        // A volume made from a content source: its fs type and at least its size.
        let sized = match &source {
            Some(source) => Some(super::snapshot::sized_from_source(
                source,
                &req.name,
                block,
                asked.first().copied(),
                required,
                self.backing.size_for(1),
            )?),
            None => None,
        };
        if let Some((source_fs_type, _)) = &sized {
            fs_type.clone_from(source_fs_type);
        }
        // The filesystem's own minimum (xfs: 300 MiB) raises the size like the backing's does.
        let min_fs = fs_type.as_deref().map_or(0, super::backing::min_fs_bytes);
        if limit != 0 && limit < min_fs {
            return Err(PluginError::BelowFsMinimum {
                fs_type: fs_type.unwrap_or_default(),
                limit,
                minimum: min_fs,
            });
        }
        let size = match &sized {
            Some((_, size)) => *size,
            None => self.backing.size_for(required),
        }
        .max(min_fs);
        if limit != 0 && size > limit {
            return Err(PluginError::CapacityOutOfRange {
                requested: size,
                total: limit,
            });
        }
        let total = self.config.capacity;
        if size > total {
            return Err(PluginError::CapacityOutOfRange {
                requested: size,
                total,
            });
        }
        let room = self.room(Some(size));
        if size > room.bytes {
            return Err(match room.bound {
                Bound::Total => PluginError::CapacityExhausted {
                    requested: size,
                    available: room.bytes,
                },
                Bound::Filesystem => PluginError::FilesystemFull {
                    requested: size,
                    available: room.bytes,
                    filesystem: self.config.work_dir.clone(),
                },
            });
        }

        let id = new_volume_id(&self.config.id_prefix);
        // An id from an over-long --id-prefix: refused before any storage is made.
        super::store::check_id(&id).map_err(|source| PluginError::Store {
            rpc: RPC,
            volume_id: id.clone(),
            source,
        })?;
        let mut volume_context = BTreeMap::from([
            (
                "backing".to_string(),
                self.backing.kind().as_str().to_string(),
            ),
            (
                CAPACITY_ENFORCED_KEY.to_string(),
                Backing::enforces_capacity(self.backing.kind()).to_string(),
            ),
        ]);
        volume_context.extend(
            parameters
                .iter()
                .map(|(k, v)| (format!("{PARAMETER_ECHO_PREFIX}{k}"), v.clone())),
        );
        if let Some(fs_type) = fs_type {
            volume_context.insert(FS_TYPE_KEY.to_string(), fs_type);
        }
        let mut record = super::store::VolumeRecord {
            version: super::store::RECORD_VERSION,
            id: id.clone(),
            name: req.name,
            capacity_bytes: size,
            parameters,
            volume_context,
            published_nodes: BTreeMap::new(),
            staged: BTreeMap::new(),
            published: BTreeMap::new(),
            content_source,
            mutable_parameters,
            location: None,
        };
        if self.config.mode == PluginMode::Controller {
            // For node plugins of a controller without PUBLISH_UNPUBLISH_VOLUME.
            let location = self.location(&record).to_string_lossy().into_owned();
            record
                .volume_context
                .insert(super::multinode::VOLUME_DIR_KEY.to_string(), location);
        }
        self.faults.stall(RPC);
        match &source {
            Some(source) => self.populate(RPC, &record, source)?,
            None => self.provision(RPC, &record, block)?,
        }
        tracing::info!(volume_id = %id, name = %record.name, size, block, source = ?record.content_source, "volume created");
        Ok(proto::CreateVolumeResponse {
            volume: Some(self.with_topology(to_volume(&record))),
        })
    }

    /// This plugin's segments as a CSI topology, when it has any.
    pub(super) fn topology(&self) -> Option<proto::Topology> {
        (!self.config.topology.is_empty()).then(|| proto::Topology {
            segments: self.config.topology.clone().into_iter().collect(),
        })
    }

    /// A volume as CreateVolume answers it: reachable from this plugin's segments.
    fn with_topology(&self, mut volume: proto::Volume) -> proto::Volume {
        volume.accessible_topology = self.topology().into_iter().collect();
        volume
    }

    /// Refuses a CreateVolume whose requisite topologies all lie elsewhere (a requisite
    /// topology covers this plugin when each of its segments is one of ours).
    fn check_requisite(
        &self,
        requirements: Option<&proto::TopologyRequirement>,
    ) -> Result<(), PluginError> {
        let Some(requisite) = requirements.map(|r| &r.requisite).filter(|r| !r.is_empty()) else {
            return Ok(());
        };
        let ours = &self.config.topology;
        if requisite_covered(requisite, ours) {
            return Ok(());
        }
        let show = |m: &std::collections::HashMap<String, String>| {
            let mut pairs: Vec<_> = m.iter().map(|(k, v)| format!("{k}={v}")).collect();
            pairs.sort();
            pairs.join(",")
        };
        Err(PluginError::TopologyUnreachable {
            requisite: requisite
                .iter()
                .map(|t| show(&t.segments))
                .collect::<Vec<_>>()
                .join(" | ")
                .escape_debug()
                .to_string(),
            ours: show(&ours.clone().into_iter().collect()),
        })
    }

    /// Creates the backing, then durably records the volume (in that order: a record
    /// always has its data).
    pub(super) fn provision(
        &self,
        rpc: &'static str,
        record: &super::store::VolumeRecord,
        block: bool,
    ) -> Result<(), PluginError> {
        let dir = self.store.volume_dir(&record.id);
        let fs_type = volume_fs_type(record, self.backing.kind());
        self.backing
            .provision(&dir, record.capacity_bytes, &fs_type, block)
            .map_err(|source| PluginError::Backing {
                rpc,
                volume_id: record.id.clone(),
                source,
            })?;
        self.store
            .save(record)
            .map_err(|source| PluginError::Store {
                rpc,
                volume_id: record.id.clone(),
                source,
            })
    }

    fn delete_volume(
        &self,
        req: proto::DeleteVolumeRequest,
    ) -> Result<proto::DeleteVolumeResponse, PluginError> {
        const RPC: &str = "DeleteVolume";
        self.controller_enabled(RPC)?;
        require(RPC, "volume_id", &req.volume_id)?;
        let Some(record) = self.store.get(&req.volume_id) else {
            return Ok(proto::DeleteVolumeResponse {});
        };
        let precondition = |reason: String| PluginError::FailedPrecondition {
            rpc: RPC,
            volume_id: record.id.clone(),
            reason,
        };
        if let Some(node) = record.published_nodes.keys().next() {
            return Err(precondition(format!(
                "still controller-published to node {node}"
            )));
        }
        let dir = self.store.volume_dir(&record.id);
        let backing_err = |source| PluginError::Backing {
            rpc: RPC,
            volume_id: record.id.clone(),
            source,
        };
        let mounts = self.backing.volume_mounts(&dir).map_err(backing_err)?;
        if let Some(m) = mounts.first() {
            return Err(precondition(format!(
                "still staged or published at {}",
                m.mount_point.display()
            )));
        }
        self.faults.stall(RPC);
        self.backing.release_all(&dir).map_err(backing_err)?;
        self.backing.wait_loop_rundown(&dir).map_err(backing_err)?;
        self.store
            .remove(&record.id)
            .map_err(|source| PluginError::Store {
                rpc: RPC,
                volume_id: record.id.clone(),
                source,
            })?;
        tracing::info!(volume_id = %record.id, "volume deleted");
        Ok(proto::DeleteVolumeResponse {})
    }

    fn controller_publish(
        &self,
        req: proto::ControllerPublishVolumeRequest,
    ) -> Result<proto::ControllerPublishVolumeResponse, PluginError> {
        const RPC: &str = "ControllerPublishVolume";
        self.controller_enabled(RPC)?;
        if !self.config.controller_publish {
            return Err(PluginError::Unimplemented { rpc: RPC });
        }
        require(RPC, "volume_id", &req.volume_id)?;
        require(RPC, "node_id", &req.node_id)?;
        let cap = req
            .volume_capability
            .as_ref()
            .ok_or(PluginError::MissingField {
                rpc: RPC,
                field: "volume_capability",
            })?;
        check_capability(RPC, "volume_capability", cap, self.backing.kind())?;
        let mut record = self.known_volume(RPC, &req.volume_id)?;
        let block = Backing::is_block(&self.store.volume_dir(&record.id));
        check_volume_access(RPC, "volume_capability", cap, &record.id, block)?;
        check_volume_fs_type(RPC, "volume_capability", &record, cap, self.backing.kind())?;
        // Any node id reaches a controller-mode plugin's records: bounded as CSI bounds it.
        if req.node_id.len() > super::multinode::MAX_NODE_ID {
            return Err(PluginError::InvalidField {
                rpc: RPC,
                field: "node_id",
                reason: format!(
                    "longer than {} bytes (CSI's limit for node ids)",
                    super::multinode::MAX_NODE_ID
                ),
            });
        }
        // A both-mode plugin serves its own node; a controller-mode one any node that reaches
        // the shared dir.
        if self.config.mode == PluginMode::Both && req.node_id != self.config.node_id {
            return Err(PluginError::NodeNotFound {
                rpc: RPC,
                node_id: req.node_id,
                known: self.config.node_id.clone(),
            });
        }
        let capability = capability_record(cap);
        if let Some((holder, why)) = super::multinode::node_conflict(
            &record.published_nodes,
            &req.node_id,
            capability.access_mode,
            req.readonly,
        ) {
            return Err(PluginError::FailedPrecondition {
                rpc: RPC,
                volume_id: record.id,
                reason: format!(
                    "published to node {holder}, and {why}: node {} must wait until it is ControllerUnpublished from {holder}",
                    req.node_id
                ),
            });
        }
        match record.published_nodes.get(&req.node_id) {
            Some(existing)
                if existing.readonly != req.readonly
                    || existing
                        .capability
                        .as_ref()
                        .is_some_and(|c| *c != capability) =>
            {
                return Err(PluginError::PublishConflict {
                    volume_id: record.id,
                    node_id: req.node_id,
                    readonly: existing.readonly,
                    capability: existing.capability.clone(),
                })
            }
            Some(_) => {}
            None => {
                self.faults.stall(RPC);
                let publication = ControllerPublication {
                    readonly: req.readonly,
                    capability: Some(capability),
                };
                record
                    .published_nodes
                    .insert(req.node_id.clone(), publication);
                self.save_use(RPC, &record)?;
            }
        }
        Ok(proto::ControllerPublishVolumeResponse {
            publish_context: publish_context(
                &record.id,
                &req.node_id,
                self.context_location(&record).as_deref(),
            ),
        })
    }

    fn controller_unpublish(
        &self,
        req: proto::ControllerUnpublishVolumeRequest,
    ) -> Result<proto::ControllerUnpublishVolumeResponse, PluginError> {
        const RPC: &str = "ControllerUnpublishVolume";
        self.controller_enabled(RPC)?;
        if !self.config.controller_publish {
            return Err(PluginError::Unimplemented { rpc: RPC });
        }
        require(RPC, "volume_id", &req.volume_id)?;
        // Unknown volume or node: nothing is published there, which is what was asked.
        let Some(mut record) = self.store.get(&req.volume_id) else {
            return Ok(proto::ControllerUnpublishVolumeResponse {});
        };
        let before = record.published_nodes.len();
        if req.node_id.is_empty() {
            record.published_nodes.clear();
        } else {
            record.published_nodes.remove(&req.node_id);
        }
        if record.published_nodes.len() != before {
            self.save_use(RPC, &record)?;
        }
        Ok(proto::ControllerUnpublishVolumeResponse {})
    }

    fn validate_capabilities(
        &self,
        req: proto::ValidateVolumeCapabilitiesRequest,
    ) -> Result<proto::ValidateVolumeCapabilitiesResponse, PluginError> {
        const RPC: &str = "ValidateVolumeCapabilities";
        self.controller_enabled(RPC)?;
        require(RPC, "volume_id", &req.volume_id)?;
        if req.volume_capabilities.is_empty() {
            return Err(PluginError::MissingField {
                rpc: RPC,
                field: "volume_capabilities",
            });
        }
        let record = self.known_volume(RPC, &req.volume_id)?;
        let block = Backing::is_block(&self.store.volume_dir(&record.id));
        let unsupported = req.volume_capabilities.iter().find_map(|cap| {
            check_capability(RPC, "volume_capabilities", cap, self.backing.kind())
                .and_then(|()| {
                    check_volume_access(RPC, "volume_capabilities", cap, &record.id, block)
                })
                .and_then(|()| {
                    check_volume_fs_type(
                        RPC,
                        "volume_capabilities",
                        &record,
                        cap,
                        self.backing.kind(),
                    )
                })
                .err()
        });
        if let Some(reason) = unsupported {
            return Ok(proto::ValidateVolumeCapabilitiesResponse {
                confirmed: None,
                message: reason.to_string(),
            });
        }
        Ok(proto::ValidateVolumeCapabilitiesResponse {
            confirmed: Some(proto::validate_volume_capabilities_response::Confirmed {
                volume_context: record.volume_context.into_iter().collect(),
                volume_capabilities: req.volume_capabilities,
                parameters: req.parameters,
                ..Default::default()
            }),
            message: String::new(),
        })
    }

    fn list_volumes(
        &self,
        req: proto::ListVolumesRequest,
    ) -> Result<proto::ListVolumesResponse, PluginError> {
        const RPC: &str = "ListVolumes";
        self.controller_enabled(RPC)?;
        if req.max_entries < 0 {
            return Err(PluginError::InvalidField {
                rpc: RPC,
                field: "max_entries",
                reason: "negative".into(),
            });
        }
        let after = if req.starting_token.is_empty() {
            None
        } else {
            let id = req
                .starting_token
                .strip_prefix(TOKEN_PREFIX)
                .filter(|id| !id.is_empty());
            Some(id.ok_or(PluginError::InvalidToken {
                rpc: RPC,
                token: req.starting_token.clone(),
            })?)
        };
        let mut remaining: Vec<_> = self
            .store
            .list()
            .into_iter()
            .filter(|r| after.is_none_or(|after| r.id.as_str() > after))
            .collect();
        let mut next_token = String::new();
        let max = usize::try_from(req.max_entries).unwrap_or(usize::MAX);
        if max > 0 && remaining.len() > max {
            remaining.truncate(max);
            next_token = format!("{TOKEN_PREFIX}{}", remaining[max - 1].id);
        }
        let entries = remaining
            .iter()
            .map(|r| proto::list_volumes_response::Entry {
                volume: Some(to_volume(r)),
                status: Some(proto::list_volumes_response::VolumeStatus {
                    published_node_ids: r.published_nodes.keys().cloned().collect(),
                    ..Default::default()
                }),
            })
            .collect();
        Ok(proto::ListVolumesResponse {
            entries,
            next_token,
        })
    }

    /// ControllerGetVolume (GET_VOLUME): the volume and the nodes it is published to.
    fn controller_get_volume(
        &self,
        req: proto::ControllerGetVolumeRequest,
    ) -> Result<proto::ControllerGetVolumeResponse, PluginError> {
        const RPC: &str = "ControllerGetVolume";
        self.controller_enabled(RPC)?;
        require(RPC, "volume_id", &req.volume_id)?;
        let record = self.known_volume(RPC, &req.volume_id)?;
        Ok(proto::ControllerGetVolumeResponse {
            volume: Some(to_volume(&record)),
            status: Some(proto::controller_get_volume_response::VolumeStatus {
                published_node_ids: record.published_nodes.keys().cloned().collect(),
                volume_condition: None,
            }),
        })
    }

    /// What CreateVolume may still give: the plugin's configured total less what its
    /// volumes were promised, and no more than the work dir's filesystem has free beyond
    /// what the sparse images of existing volumes may still fill. Stats each loop image
    /// only when the cheap bound (free space less every loop volume's whole capacity)
    /// does not already admit `wanted` (CreateVolume's size; `None`: the exact figure).
    pub(super) fn room(&self, wanted: Option<u64>) -> Room {
        let kind_of = |r: &super::store::VolumeRecord| {
            r.volume_context
                .get("backing")
                .and_then(|k| k.parse().ok())
                .unwrap_or(self.backing.kind())
        };
        // What was promised, and what the images of volumes that hold their size promise.
        let (promised, whole) = self.store.fold((0u64, 0u64), |(p, w), r| {
            let enforced = Backing::enforces_capacity(kind_of(r));
            (
                p.saturating_add(r.capacity_bytes),
                w.saturating_add(if enforced { r.capacity_bytes } else { 0 }),
            )
        });
        let fs_free = match nix::sys::statvfs::statvfs(&self.config.work_dir) {
            Ok(st) => Some(st.blocks_available().saturating_mul(st.fragment_size())),
            Err(errno) => {
                tracing::warn!(work_dir = %self.config.work_dir.display(), %errno,
                    "statvfs of the work dir failed: capacity bounded by --capacity only");
                None
            }
        };
        let cheap = room(self.config.capacity, promised, fs_free, whole);
        if wanted.is_some_and(|w| w <= cheap.bytes) {
            return cheap;
        }
        // The exact figure: each image's allocated blocks (a stat each, outside the lock).
        let images: Vec<(String, u64, BackingKind)> = self.store.fold(Vec::new(), |mut v, r| {
            if Backing::enforces_capacity(kind_of(r)) {
                v.push((r.id.clone(), r.capacity_bytes, kind_of(r)));
            }
            v
        });
        let unallocated: u64 = images
            .iter()
            .map(|(id, capacity, kind)| {
                Backing::unallocated_bytes(*kind, &self.store.volume_dir(id), *capacity)
            })
            .sum();
        room(self.config.capacity, promised, fs_free, unallocated)
    }

    fn get_capacity(
        &self,
        req: proto::GetCapacityRequest,
    ) -> Result<proto::GetCapacityResponse, PluginError> {
        const RPC: &str = "GetCapacity";
        self.controller_enabled(RPC)?;
        let supported = req.volume_capabilities.iter().all(|cap| {
            check_capability(RPC, "volume_capabilities", cap, self.backing.kind()).is_ok()
        });
        let available = if supported { self.room(None).bytes } else { 0 };
        let available = i64::try_from(available).unwrap_or(i64::MAX);
        Ok(proto::GetCapacityResponse {
            available_capacity: available,
            maximum_volume_size: Some(available),
            ..Default::default()
        })
    }

    fn controller_capabilities(
        &self,
        _req: proto::ControllerGetCapabilitiesRequest,
    ) -> Result<proto::ControllerGetCapabilitiesResponse, PluginError> {
        let mut caps = Vec::new();
        if self.config.controller {
            caps.push(Cap::CreateDeleteVolume);
            if self.config.controller_publish {
                caps.push(Cap::PublishUnpublishVolume);
            }
            caps.extend([
                Cap::ListVolumes,
                Cap::GetCapacity,
                Cap::ListVolumesPublishedNodes,
                Cap::GetVolume,
                // Access modes SINGLE_NODE_SINGLE_WRITER and SINGLE_NODE_MULTI_WRITER.
                Cap::SingleNodeMultiWriter,
            ]);
            if self.config.snapshots {
                caps.extend([
                    Cap::CreateDeleteSnapshot,
                    Cap::ListSnapshots,
                    Cap::GetSnapshot,
                ]);
            }
            if self.config.clones {
                caps.push(Cap::CloneVolume);
            }
            if self.expansion() != super::Expansion::None {
                caps.push(Cap::ExpandVolume);
            }
            if self.modify_enabled() {
                caps.push(Cap::ModifyVolume);
            }
        }
        Ok(proto::ControllerGetCapabilitiesResponse {
            capabilities: caps
                .into_iter()
                .map(|c| proto::ControllerServiceCapability {
                    r#type: Some(proto::controller_service_capability::Type::Rpc(
                        proto::controller_service_capability::Rpc { r#type: c as i32 },
                    )),
                })
                .collect(),
        })
    }
}

impl Plugin {
    /// Tells a `lie CreateVolume:empty-id|small-capacity|reused-id` in a successful reply (the volume
    /// was created all the same).
    fn lie_in_create(
        &self,
        mut response: Response<proto::CreateVolumeResponse>,
        required_bytes: i64,
    ) -> Response<proto::CreateVolumeResponse> {
        let mode = self.faults.reply_lie("CreateVolume");
        if let Some(volume) = response.get_mut().volume.as_mut() {
            match mode {
                Some(LieMode::EmptyId) => {
                    tracing::warn!(volume_id = %volume.volume_id, "lie fault: answering an empty volume_id");
                    volume.volume_id.clear();
                }
                Some(LieMode::SmallCapacity) if required_bytes > 0 => {
                    tracing::warn!(volume_id = %volume.volume_id, "lie fault: answering a capacity short of required_bytes");
                    volume.capacity_bytes = required_bytes - 1;
                }
                Some(LieMode::ReusedId) => {
                    let other = self
                        .store
                        .list()
                        .into_iter()
                        .map(|r| r.id)
                        .find(|id| *id != volume.volume_id);
                    if let Some(other) = other {
                        tracing::warn!(volume_id = %volume.volume_id, other = %other, "lie fault: answering another volume's id");
                        volume.volume_id = other;
                    }
                }
                _ => {}
            }
        }
        response
    }

    /// Tells a `lie ControllerPublishVolume:empty-context` in a successful reply (the
    /// volume was published all the same).
    fn lie_in_publish(
        &self,
        mut response: Response<proto::ControllerPublishVolumeResponse>,
    ) -> Response<proto::ControllerPublishVolumeResponse> {
        if self.faults.reply_lie("ControllerPublishVolume") == Some(LieMode::EmptyContext) {
            tracing::warn!("lie fault: answering an empty publish_context");
            response.get_mut().publish_context.clear();
        }
        response
    }
}

#[tonic::async_trait]
impl proto::controller_server::Controller for PluginService {
    async fn create_volume(
        &self,
        request: Request<proto::CreateVolumeRequest>,
    ) -> Result<Response<proto::CreateVolumeResponse>, Status> {
        let req = request.into_inner();
        let name = req.name.clone();
        let required = req.capacity_range.as_ref().map_or(0, |r| r.required_bytes);
        let response = self
            .call(
                "CreateVolume",
                &name,
                LockKey::Create,
                req,
                |p: &Plugin, req| {
                    p.check_secrets("CreateVolume", &req.secrets)?;
                    Plugin::create_volume(p, req)
                },
            )
            .await?;
        Ok(self.inner.lie_in_create(response, required))
    }

    async fn delete_volume(
        &self,
        request: Request<proto::DeleteVolumeRequest>,
    ) -> Result<Response<proto::DeleteVolumeResponse>, Status> {
        let req = request.into_inner();
        let id = req.volume_id.clone();
        self.call(
            "DeleteVolume",
            &id,
            LockKey::Volume(id.clone()),
            req,
            |p: &Plugin, req| {
                p.check_secrets("DeleteVolume", &req.secrets)?;
                Plugin::delete_volume(p, req)
            },
        )
        .await
    }

    async fn controller_publish_volume(
        &self,
        request: Request<proto::ControllerPublishVolumeRequest>,
    ) -> Result<Response<proto::ControllerPublishVolumeResponse>, Status> {
        let req = request.into_inner();
        let id = req.volume_id.clone();
        let response = self
            .call(
                "ControllerPublishVolume",
                &id,
                LockKey::Volume(id.clone()),
                req,
                |p: &Plugin, req| {
                    p.check_secrets("ControllerPublishVolume", &req.secrets)?;
                    Plugin::controller_publish(p, req)
                },
            )
            .await?;
        Ok(self.inner.lie_in_publish(response))
    }

    async fn controller_unpublish_volume(
        &self,
        request: Request<proto::ControllerUnpublishVolumeRequest>,
    ) -> Result<Response<proto::ControllerUnpublishVolumeResponse>, Status> {
        let req = request.into_inner();
        let id = req.volume_id.clone();
        self.call(
            "ControllerUnpublishVolume",
            &id,
            LockKey::Volume(id.clone()),
            req,
            |p: &Plugin, req| {
                p.check_secrets("ControllerUnpublishVolume", &req.secrets)?;
                Plugin::controller_unpublish(p, req)
            },
        )
        .await
    }

    async fn validate_volume_capabilities(
        &self,
        request: Request<proto::ValidateVolumeCapabilitiesRequest>,
    ) -> Result<Response<proto::ValidateVolumeCapabilitiesResponse>, Status> {
        let req = request.into_inner();
        let id = req.volume_id.clone();
        self.call(
            "ValidateVolumeCapabilities",
            &id,
            LockKey::None,
            req,
            |p: &Plugin, req| {
                p.check_secrets("ValidateVolumeCapabilities", &req.secrets)?;
                Plugin::validate_capabilities(p, req)
            },
        )
        .await
    }

    async fn list_volumes(
        &self,
        request: Request<proto::ListVolumesRequest>,
    ) -> Result<Response<proto::ListVolumesResponse>, Status> {
        self.call(
            "ListVolumes",
            "",
            LockKey::None,
            request.into_inner(),
            Plugin::list_volumes,
        )
        .await
    }

    async fn get_capacity(
        &self,
        request: Request<proto::GetCapacityRequest>,
    ) -> Result<Response<proto::GetCapacityResponse>, Status> {
        self.call(
            "GetCapacity",
            "",
            LockKey::None,
            request.into_inner(),
            Plugin::get_capacity,
        )
        .await
    }

    async fn controller_get_capabilities(
        &self,
        request: Request<proto::ControllerGetCapabilitiesRequest>,
    ) -> Result<Response<proto::ControllerGetCapabilitiesResponse>, Status> {
        let req = request.into_inner();
        self.call(
            "ControllerGetCapabilities",
            "",
            LockKey::None,
            req,
            Plugin::controller_capabilities,
        )
        .await
    }

    async fn create_snapshot(
        &self,
        request: Request<proto::CreateSnapshotRequest>,
    ) -> Result<Response<proto::CreateSnapshotResponse>, Status> {
        let req = request.into_inner();
        let source = req.source_volume_id.clone();
        self.call(
            "CreateSnapshot",
            &source,
            LockKey::CreateSnapshot,
            req,
            |p: &Plugin, req| {
                p.check_secrets("CreateSnapshot", &req.secrets)?;
                Plugin::create_snapshot(p, req)
            },
        )
        .await
    }

    async fn delete_snapshot(
        &self,
        request: Request<proto::DeleteSnapshotRequest>,
    ) -> Result<Response<proto::DeleteSnapshotResponse>, Status> {
        let req = request.into_inner();
        let id = req.snapshot_id.clone();
        let key = if id.is_empty() {
            LockKey::None
        } else {
            LockKey::Snapshot(id.clone())
        };
        self.call("DeleteSnapshot", &id, key, req, |p: &Plugin, req| {
            p.check_secrets("DeleteSnapshot", &req.secrets)?;
            Plugin::delete_snapshot(p, req)
        })
        .await
    }

    async fn list_snapshots(
        &self,
        request: Request<proto::ListSnapshotsRequest>,
    ) -> Result<Response<proto::ListSnapshotsResponse>, Status> {
        self.call(
            "ListSnapshots",
            "",
            LockKey::None,
            request.into_inner(),
            |p: &Plugin, req| {
                p.check_secrets("ListSnapshots", &req.secrets)?;
                Plugin::list_snapshots(p, req)
            },
        )
        .await
    }

    async fn get_snapshot(
        &self,
        request: Request<proto::GetSnapshotRequest>,
    ) -> Result<Response<proto::GetSnapshotResponse>, Status> {
        let req = request.into_inner();
        let id = req.snapshot_id.clone();
        self.call("GetSnapshot", &id, LockKey::None, req, |p: &Plugin, req| {
            p.check_secrets("GetSnapshot", &req.secrets)?;
            Plugin::get_snapshot(p, req)
        })
        .await
    }

    async fn controller_expand_volume(
        &self,
        request: Request<proto::ControllerExpandVolumeRequest>,
    ) -> Result<Response<proto::ControllerExpandVolumeResponse>, Status> {
        let req = request.into_inner();
        let id = req.volume_id.clone();
        // CreateVolume's lock: the capacity it promises grows (the volume's lock is taken
        // inside, in that order).
        self.call(
            "ControllerExpandVolume",
            &id,
            LockKey::Create,
            req,
            |p: &Plugin, req| {
                p.check_secrets("ControllerExpandVolume", &req.secrets)?;
                Plugin::controller_expand(p, req)
            },
        )
        .await
    }

    async fn controller_get_volume(
        &self,
        request: Request<proto::ControllerGetVolumeRequest>,
    ) -> Result<Response<proto::ControllerGetVolumeResponse>, Status> {
        let req = request.into_inner();
        let id = req.volume_id.clone();
        self.call(
            "ControllerGetVolume",
            &id,
            LockKey::None,
            req,
            Plugin::controller_get_volume,
        )
        .await
    }

    async fn controller_modify_volume(
        &self,
        request: Request<proto::ControllerModifyVolumeRequest>,
    ) -> Result<Response<proto::ControllerModifyVolumeResponse>, Status> {
        let req = request.into_inner();
        let id = req.volume_id.clone();
        self.call(
            "ControllerModifyVolume",
            &id,
            LockKey::Volume(id.clone()),
            req,
            |p: &Plugin, req| {
                p.check_secrets("ControllerModifyVolume", &req.secrets)?;
                Plugin::controller_modify(p, req)
            },
        )
        .await
    }
}

/// Whether one of the requisite topologies has only segments this plugin has.
fn requisite_covered(requisite: &[proto::Topology], ours: &BTreeMap<String, String>) -> bool {
    requisite
        .iter()
        .any(|t| t.segments.iter().all(|(k, v)| ours.get(k) == Some(v)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_requisite_topology_is_covered_when_all_its_segments_are_ours() {
        let topo = |pairs: &[(&str, &str)]| proto::Topology {
            segments: pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        };
        let ours: BTreeMap<String, String> = [
            ("zone".to_string(), "a".to_string()),
            ("rack".to_string(), "1".to_string()),
        ]
        .into();
        assert!(requisite_covered(&[topo(&[("zone", "a")])], &ours));
        assert!(requisite_covered(
            &[
                topo(&[("zone", "b")]),
                topo(&[("zone", "a"), ("rack", "1")])
            ],
            &ours
        ));
        assert!(!requisite_covered(&[topo(&[("zone", "b")])], &ours));
        assert!(!requisite_covered(
            &[topo(&[("zone", "a"), ("rack", "2")])],
            &ours
        ));
        assert!(
            !requisite_covered(&[], &ours),
            "no requisite: nothing covered (the caller skips)"
        );
    }

    #[test]
    fn required_parameters_are_checked_by_key_and_value() {
        let required = crate::parse_required_parameters("server,share=/export").unwrap();
        let got = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        check_required_parameters(&required, &got(&[("server", "s"), ("share", "/export")]))
            .unwrap();
        let err = |pairs: &[(&str, &str)]| {
            check_required_parameters(&required, &got(pairs))
                .unwrap_err()
                .to_string()
        };
        assert!(err(&[("share", "/export")]).contains("parameter 'server' is required"));
        assert!(err(&[("server", "s"), ("share", "/x")])
            .contains("parameter 'share' must be '/export'"));
        assert!(crate::parse_required_parameters("a,,b").is_err());
    }

    #[test]
    fn room_is_the_tighter_of_the_total_and_the_filesystem() {
        let total = |bytes| Room {
            bytes,
            bound: Bound::Total,
        };
        let fs = |bytes| Room {
            bytes,
            bound: Bound::Filesystem,
        };
        // (total, promised, fs_free, unallocated) -> room
        let cases = [
            ((100, 0, Some(1000), 0), total(100)),
            ((100, 40, Some(1000), 40), total(60)),
            // The images may still fill 900 of the 1000 free: 100 left, less than the total.
            ((1000, 0, Some(1000), 900), fs(100)),
            ((1000, 950, Some(1000), 0), total(50)),
            // More promised than the filesystem has: nothing left, not an underflow.
            ((1000, 0, Some(100), 900), fs(0)),
            ((100, 200, Some(1000), 0), total(0)),
            // statvfs failed: the total alone decides.
            ((100, 0, None, 1 << 40), total(100)),
            // A tie goes to the total.
            ((100, 0, Some(100), 0), total(100)),
        ];
        for ((t, p, f, u), want) in cases {
            assert_eq!(
                room(t, p, f, u),
                want,
                "total {t} promised {p} free {f:?} unallocated {u}"
            );
        }
    }
}
