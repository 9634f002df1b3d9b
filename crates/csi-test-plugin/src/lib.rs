//! `csi-test-plugin`: a real CSI v1 plugin (Identity, Controller and Node services on a
//! Unix socket) for mount volumes and (loop backing) block volumes, used by the tests and
//! embedded by `csi-isolator run`.
//!
//! Contract:
//! - Volumes are backed by a directory ([`BackingKind::Dir`]) or by an ext4 (or ext3, ext2,
//!   xfs: the capability's fs type) image on a loop device ([`BackingKind::Loop`]); a block
//!   volume (CSI's block access type) by a raw image on a loop device (loop backing only; the
//!   dir backing refuses block access INVALID_ARGUMENT, and ValidateVolumeCapabilities and
//!   GetCapacity say the same); their metadata lives under the work dir ([`store`]), written
//!   atomically, so a restarted plugin knows its volumes. Mount flags are applied or refused by
//!   name, never ignored ([`mount_options`]); SINGLE_NODE_MULTI_WRITER is offered (node and
//!   controller), and a SINGLE_NODE_SINGLE_WRITER volume is published at one target path at a
//!   time.
//! - Snapshots ([`snapshot`]): CreateSnapshot copies a volume's content into the snapshot store
//!   (a loop filesystem in use frozen for the copy; a dir volume copied as it is, not
//!   point-in-time while written), ListSnapshots pages and filters, GetSnapshot, DeleteSnapshot;
//!   CreateVolume makes a volume from a snapshot or clones a volume (at least the source's size,
//!   the filesystem grown to a bigger one). Snapshots are independent copies: a volume with
//!   snapshots can be deleted. `--no-snapshots`, `--no-clones` take the capabilities away.
//! - Expansion ([`expand`]): ControllerExpandVolume grows a dir volume's recorded capacity or a
//!   loop volume's image, NodeExpandVolume a loop volume's mounted filesystem, online
//!   (`--expansion online`, the default), or the controller part only while the volume is not in
//!   use (`offline`), or not at all (`none`).
//! - Mutable parameters ([`modify`]): CreateVolume's `mutable_parameters` and
//!   ControllerModifyVolume, for the keys `tier` (`standard` or `fast`) and `iops` (1 to
//!   1000000), recorded in the volume's record and echoed in its volume_context as
//!   `mutable.<key>`; `--no-modify` takes MODIFY_VOLUME away.
//! - Several nodes ([`multinode`]): `--mode controller` serves Identity and Controller (volumes
//!   under its work dir, which every node reaches; ControllerPublish to any node id, one node at
//!   a time for single-node access modes), `--mode node` Identity and Node (its own state under
//!   its work dir; a volume found under `--shared-dir` through the `csi-test-plugin/volume-dir`
//!   its contexts name, checked, never trusted). The default, `both`, is one node with its own
//!   controller.
//! - "Is it staged / published" is always answered from the kernel's mount table, never from
//!   memory, which makes every call idempotent and restarts harmless.
//! - Operations on one volume are serialized (a per-volume lock, `locks`); different volumes
//!   proceed in parallel. The lock is owned by the blocking task doing the work, so a call
//!   whose client gave up keeps it until its work really ends: a retry never overlaps it.
//! - Every RPC passes through one seam (`PluginService::call`): call log, fault injection
//!   ([`faults`]), the per-volume lock, the blocking work on a blocking thread, and the
//!   mapping of [`PluginError`] (a panic included) to a gRPC status ([`status`]).
//! - Lies (`--lie RPC[:MODE]`) are told at three places: without the work in that seam, in a
//!   handler's decoded reply (empty publish_context, empty volume id, short capacity), or on
//!   the wire by a tower layer that rewrites the encoded reply (`wire`: bytes that are not
//!   protobuf, strings that are not UTF-8).

pub mod backing;
mod controller;
mod expand;
pub mod faults;
mod identity;
mod locks;
mod modify;
pub mod mount_options;
pub mod multinode;
mod node;
mod snapshot;
pub mod stats;
pub mod status;
pub mod store;
mod wire;

use std::future::Future;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio::net::UnixListener;

use csi_isolator::io_step::{io_step, IoStep};
use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Response, Status};

pub use backing::{BackingError, BackingKind};
use csi_isolator::csi::proto;
use faults::{FaultSpec, Faults};
use store::{SnapshotStore, Store, StoreError, VolumeRecord};

/// Default `GetPluginInfo` name.
pub const DEFAULT_NAME: &str = "csi-test-plugin.csi-isolator.io";
/// Default `GetPluginInfo` vendor_version: the crate's version.
pub const DEFAULT_VENDOR_VERSION: &str = env!("CARGO_PKG_VERSION");
/// Default prefix of the volume ids CreateVolume makes (a random 16-hex-digit suffix follows).
pub const DEFAULT_ID_PREFIX: &str = "vol-";
/// Default total capacity: 1 TiB. Large on purpose: conformance suites create several
/// volumes of their default size (csi-sanity: 10 GiB each), and nothing is reserved up front
/// (dir volumes take what their files use; loop images are sparse files).
pub const DEFAULT_CAPACITY: u64 = 1 << 40;

/// Everything the plugin is configured with (the command line of `csi-test-plugin`).
#[derive(Clone, Debug)]
pub struct PluginConfig {
    /// The Unix socket to listen on.
    pub socket: PathBuf,
    /// Where volumes and their metadata live.
    pub work_dir: PathBuf,
    /// How volumes are backed.
    pub backing: BackingKind,
    /// The id NodeGetInfo returns and ControllerPublish accepts.
    pub node_id: String,
    /// The GetPluginInfo name.
    pub name: String,
    /// The GetPluginInfo vendor_version (tests tell a replaced plugin by it).
    pub vendor_version: String,
    /// Prefix of new volume ids. Any string CSI allows: a prefix full of path syntax
    /// (`../`, `/`, `%`) tests that the CO never uses an id as a path unencoded.
    pub id_prefix: String,
    /// Total capacity, reported by GetCapacity and enforced by CreateVolume.
    pub capacity: u64,
    /// Offer the CONTROLLER_SERVICE plugin capability.
    pub controller: bool,
    /// Offer the controller PUBLISH_UNPUBLISH_VOLUME capability.
    pub controller_publish: bool,
    /// Offer the node STAGE_UNSTAGE_VOLUME capability.
    pub stage: bool,
    /// Offer the node GET_VOLUME_STATS and VOLUME_CONDITION capabilities (NodeGetVolumeStats is
    /// UNIMPLEMENTED without).
    pub volume_stats: bool,
    /// Faults from the command line.
    pub faults: Vec<FaultSpec>,
    /// A faults file re-read when its mtime changes.
    pub faults_file: Option<PathBuf>,
    /// Append one line per RPC received to this file.
    pub log_calls: Option<PathBuf>,
    /// GetPluginInfo's manifest reports `durable_syncs`: the fsync, fdatasync and syncfs
    /// calls this process has made through csi-isolator's durable seam (its records, its
    /// volumes' directories, its images), for the benchmark, which counts its own apart.
    pub report_syncs: bool,
    /// CreateVolume parameters that must be present (with this value, when one is given):
    /// a create without them is refused with INVALID_ARGUMENT naming the key.
    pub required_parameters: Vec<RequiredParameter>,
    /// A secrets file (csi-isolator's format, `csi_isolator::csi::secrets`): every RPC that
    /// carries secrets must carry exactly those of its operation (none for an operation the
    /// file leaves out, and for ValidateVolumeCapabilities), or it is refused. Read again at
    /// each such RPC, so a test can rotate it.
    pub required_secrets: Option<PathBuf>,
    /// This node's topology segments (`--topology KEY=VALUE`): when set, the plugin offers
    /// VOLUME_ACCESSIBILITY_CONSTRAINTS, NodeGetInfo reports them and its volumes are
    /// reachable from them only.
    pub topology: std::collections::BTreeMap<String, String>,
    /// Offer VOLUME_MOUNT_GROUP (`--volume-mount-group`): NodeStage and NodePublish then make
    /// a mount volume's root group-writable (g+rwxs) for the `volume_mount_group` they carry.
    /// Without it a request carrying one is refused (the CO must not send it).
    pub volume_mount_group: bool,
    /// Offer CREATE_DELETE_SNAPSHOT, LIST_SNAPSHOTS and GET_SNAPSHOT (and volumes made from
    /// snapshots); off: those RPCs are UNIMPLEMENTED and a snapshot content source is refused.
    pub snapshots: bool,
    /// Offer CLONE_VOLUME (volumes made from volumes); off: a volume content source is
    /// refused.
    pub clones: bool,
    /// Which volume expansion the plugin offers.
    pub expansion: Expansion,
    /// Offer MODIFY_VOLUME (ControllerModifyVolume, CreateVolume's `mutable_parameters`);
    /// off (`--no-modify`): ControllerModifyVolume is UNIMPLEMENTED and a CreateVolume
    /// carrying mutable parameters is refused.
    pub modify: bool,
    /// Which services this instance serves (`--mode`): both (one node), or the controller or
    /// the node half of a multi-node deployment ([`multinode`]).
    pub mode: PluginMode,
    /// Node mode: the controller's work dir, as this node reaches it (`--shared-dir`). The
    /// node plugin mounts only volumes under `<shared dir>/volumes/`, and never writes there.
    pub shared_dir: Option<PathBuf>,
}

/// Which services a plugin instance serves (`--mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PluginMode {
    /// Identity, Controller and Node: one node, its own controller (the default).
    Both,
    /// Identity and Controller: volumes under the work dir, shared with the nodes;
    /// ControllerPublish to any node id. The Node service is not served (UNIMPLEMENTED).
    Controller,
    /// Identity and Node: volumes found under `--shared-dir` through the publish_context (or
    /// volume_context) the controller gave; node-local state under the work dir. The
    /// Controller service is not served (UNIMPLEMENTED), CONTROLLER_SERVICE not offered.
    Node,
}

impl std::str::FromStr for PluginMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "both" => Ok(PluginMode::Both),
            "controller" => Ok(PluginMode::Controller),
            "node" => Ok(PluginMode::Node),
            other => Err(format!(
                "unknown mode '{}' (expected controller, node or both)",
                other.escape_debug()
            )),
        }
    }
}

/// Which volume expansion the plugin offers (`--expansion`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expansion {
    /// None: no EXPAND_VOLUME capability, the expand RPCs are UNIMPLEMENTED.
    None,
    /// VolumeExpansion.ONLINE: a volume grows while published (the default).
    Online,
    /// VolumeExpansion.OFFLINE: ControllerExpandVolume refuses a volume that is published or
    /// mounted on the node (FAILED_PRECONDITION); NodeExpandVolume grows it once staged again.
    Offline,
}

impl std::str::FromStr for Expansion {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "none" => Ok(Expansion::None),
            "online" => Ok(Expansion::Online),
            "offline" => Ok(Expansion::Offline),
            other => Err(format!(
                "unknown expansion '{}' (expected online, offline or none)",
                other.escape_debug()
            )),
        }
    }
}

/// One `--require-parameters` entry: a key, and the value it must have if one is given.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequiredParameter {
    /// The parameter key.
    pub key: String,
    /// The value it must have (any value when `None`).
    pub value: Option<String>,
}

/// Prefix of the volume_context keys that echo the CreateVolume parameters the plugin got
/// (`parameter.<key>` = value), so a test sees exactly what reached CreateVolume.
pub const PARAMETER_ECHO_PREFIX: &str = "parameter.";

/// What `--require-secrets` chooses a file's directory for.
pub const REQUIRE_SECRETS_DIR: csi_isolator::workdir::Purpose = csi_isolator::workdir::Purpose {
    what: "--require-secrets file's directory",
    flag: "--require-secrets",
};

/// Reads a `--require-secrets` file under the rule csi-isolator applies to secrets files
/// (root's alone, checked by fd, bounded) and parses it; the message names the file and never
/// its content.
pub fn load_required_secrets(path: &Path) -> Result<csi_isolator::csi::SecretsFile, String> {
    use csi_isolator::workdir::{read_root_file, FileRule};
    let bytes = read_root_file(
        path,
        REQUIRE_SECRETS_DIR,
        FileRule::RootOnly,
        csi_isolator::csi::secrets::MAX_FILE_BYTES,
    )
    .map_err(|e| {
        format!(
            "--require-secrets {}: {}",
            path.display(),
            csi_isolator::error_chain::full_message(&e)
        )
    })?;
    csi_isolator::csi::SecretsFile::parse(&bytes)
        .map_err(|e| format!("--require-secrets {}: {e}", path.display()))
}

/// Parses `--require-parameters KEY[=VALUE],...`.
pub fn parse_required_parameters(text: &str) -> Result<Vec<RequiredParameter>, String> {
    text.split(',')
        .map(|entry| {
            let (key, value) = match entry.split_once('=') {
                Some((k, v)) => (k, Some(v.to_string())),
                None => (entry, None),
            };
            if key.is_empty() {
                return Err(format!(
                    "invalid --require-parameters entry '{}': give KEY or KEY=VALUE",
                    entry.escape_debug()
                ));
            }
            Ok(RequiredParameter {
                key: key.to_string(),
                value,
            })
        })
        .collect()
}

impl PluginConfig {
    /// A configuration with every default: loop backing, the host name as node id, all
    /// capabilities, no faults.
    pub fn new(socket: PathBuf, work_dir: PathBuf) -> PluginConfig {
        PluginConfig {
            socket,
            work_dir,
            backing: BackingKind::Loop,
            node_id: default_node_id(),
            name: DEFAULT_NAME.to_string(),
            vendor_version: DEFAULT_VENDOR_VERSION.to_string(),
            id_prefix: DEFAULT_ID_PREFIX.to_string(),
            capacity: DEFAULT_CAPACITY,
            controller: true,
            controller_publish: true,
            stage: true,
            volume_stats: true,
            faults: Vec::new(),
            faults_file: None,
            log_calls: None,
            report_syncs: false,
            required_parameters: Vec::new(),
            required_secrets: None,
            topology: std::collections::BTreeMap::new(),
            volume_mount_group: false,
            snapshots: true,
            clones: true,
            modify: true,
            expansion: Expansion::Online,
            mode: PluginMode::Both,
            shared_dir: None,
        }
    }

    /// Whether NodeStage/NodePublish must be preceded by ControllerPublish: a node-mode
    /// plugin assumes its controller publishes unless told otherwise
    /// (`--no-controller-publish`).
    fn requires_controller_publish(&self) -> bool {
        (self.controller || self.mode == PluginMode::Node) && self.controller_publish
    }
}

/// The host name, or "localhost" when it cannot be read.
pub fn default_node_id() -> String {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".to_string())
}

/// Errors of the plugin: one variant per way an RPC (or serving) can fail. [`status`]
/// maps each to its gRPC code.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    /// A required request field is empty.
    #[error("{rpc}: missing required field {field}")]
    MissingField {
        /// The RPC.
        rpc: &'static str,
        /// The field.
        field: &'static str,
    },
    /// A request field has an invalid value.
    #[error("{rpc}: invalid {field}: {reason}")]
    InvalidField {
        /// The RPC.
        rpc: &'static str,
        /// The field.
        field: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// The volume does not exist.
    #[error("{rpc}: volume {volume_id} not found")]
    VolumeNotFound {
        /// The RPC.
        rpc: &'static str,
        /// The volume.
        volume_id: String,
    },
    /// The node does not exist.
    #[error("{rpc}: node {node_id} not found (this plugin serves node {known})")]
    NodeNotFound {
        /// The RPC.
        rpc: &'static str,
        /// The node asked for.
        node_id: String,
        /// The only node this plugin knows.
        known: String,
    },
    /// The volume is not mounted at the given path.
    #[error("{rpc}: volume {volume_id} is not published or staged at {path}")]
    VolumeNotAtPath {
        /// The RPC.
        rpc: &'static str,
        /// The volume.
        volume_id: String,
        /// The path asked about.
        path: PathBuf,
    },
    /// CreateVolume with the name of an existing, incompatible volume.
    #[error("CreateVolume: volume {volume_id} named {name:?} exists with {capacity} bytes and other parameters or capacity")]
    NameConflict {
        /// The name.
        name: String,
        /// The existing volume.
        volume_id: String,
        /// Its capacity.
        capacity: u64,
    },
    /// ControllerPublish of a volume already published to the node with another readonly
    /// flag or volume capability.
    #[error("ControllerPublishVolume: volume {volume_id} is already published to node {node_id} with readonly={readonly} and capability {capability:?}")]
    PublishConflict {
        /// The volume.
        volume_id: String,
        /// The node.
        node_id: String,
        /// The readonly flag of the existing publish.
        readonly: bool,
        /// The capability of the existing publish (unknown for old records).
        capability: Option<store::CapabilityRecord>,
    },
    /// Something incompatible is already mounted at a target or staging path.
    #[error("{rpc}: {path} already holds an incompatible mount ({what}) for volume {volume_id}")]
    PathConflict {
        /// The RPC.
        rpc: &'static str,
        /// The volume.
        volume_id: String,
        /// The path.
        path: PathBuf,
        /// What is mounted there.
        what: String,
    },
    /// A single volume larger than the plugin's total capacity.
    #[error("CreateVolume: {requested} bytes exceed the plugin's total capacity of {total} bytes")]
    CapacityOutOfRange {
        /// Bytes asked for.
        requested: u64,
        /// Total capacity.
        total: u64,
    },
    /// CreateVolume's `limit_bytes` is under the smallest filesystem of the asked fs type mkfs makes.
    #[error("CreateVolume: limit_bytes {limit} is under the {minimum} bytes mkfs makes a {fs_type} filesystem of at least: allow {minimum} bytes or ask another fs_type")]
    BelowFsMinimum {
        /// The fs type asked.
        fs_type: String,
        /// The limit asked.
        limit: u64,
        /// The fs type's minimum.
        minimum: u64,
    },
    /// CreateVolume's requisite topologies do not include where this plugin's volumes are.
    #[error("CreateVolume: no requisite topology ({requisite}) covers this plugin's volumes, which are at {ours}")]
    TopologyUnreachable {
        /// The requisite topologies, shown.
        requisite: String,
        /// This plugin's segments, shown.
        ours: String,
    },
    /// Not enough capacity left.
    #[error("CreateVolume: {requested} bytes requested, only {available} bytes left")]
    CapacityExhausted {
        /// Bytes asked for.
        requested: u64,
        /// Bytes left.
        available: u64,
    },
    /// The work dir's filesystem cannot hold another volume of this size beside what the
    /// existing volumes may still fill.
    #[error("CreateVolume: {requested} bytes requested, but the filesystem of {filesystem} has only {available} bytes free beyond what existing volumes may still fill")]
    FilesystemFull {
        /// Bytes asked for.
        requested: u64,
        /// Bytes the filesystem can still give.
        available: u64,
        /// The plugin's work dir.
        filesystem: PathBuf,
    },
    /// An out-of-order call.
    #[error("{rpc}: volume {volume_id}: {reason}")]
    FailedPrecondition {
        /// The RPC.
        rpc: &'static str,
        /// The volume.
        volume_id: String,
        /// Which precondition failed.
        reason: String,
    },
    /// The request's secrets are not those `--require-secrets` expects for its RPC (keys
    /// named, never values).
    #[error("{rpc}: {mismatch} (--require-secrets expects those of operation '{operation}')")]
    Secrets {
        /// The RPC.
        rpc: &'static str,
        /// The operation whose secrets the RPC carries (`none`: an RPC that carries none).
        operation: &'static str,
        /// How they differ.
        mismatch: csi_isolator::csi::secrets::Mismatch,
    },
    /// The `--require-secrets` file cannot be used any more.
    #[error("{rpc}: {reason}")]
    RequiredSecretsFile {
        /// The RPC.
        rpc: &'static str,
        /// What is wrong (naming the file).
        reason: String,
    },
    /// A ListVolumes or ListSnapshots starting_token this plugin did not issue.
    #[error("{rpc}: invalid starting_token {token:?} (start the listing again without one)")]
    InvalidToken {
        /// The RPC.
        rpc: &'static str,
        /// The token.
        token: String,
    },
    /// The snapshot does not exist.
    #[error("{rpc}: snapshot {snapshot_id} not found")]
    SnapshotNotFound {
        /// The RPC.
        rpc: &'static str,
        /// The snapshot.
        snapshot_id: String,
    },
    /// CreateSnapshot with the name of an existing snapshot of another volume.
    #[error("CreateSnapshot: snapshot {snapshot_id} named {name:?} exists, cut from volume {source_volume_id} (choose another name or that volume)")]
    SnapshotNameConflict {
        /// The name.
        name: String,
        /// The existing snapshot.
        snapshot_id: String,
        /// Its source volume.
        source_volume_id: String,
    },
    /// A capacity the plugin cannot give this volume (an expansion over the plugin's room, a
    /// volume made smaller than its content source).
    #[error("{rpc}: volume {volume_id}: {reason}")]
    OutOfRange {
        /// The RPC.
        rpc: &'static str,
        /// The volume (or the name asked for, before it has an id).
        volume_id: String,
        /// What is out of range.
        reason: String,
    },
    /// The snapshot store failed.
    #[error("{rpc}: snapshot {snapshot_id}")]
    SnapshotStore {
        /// The RPC.
        rpc: &'static str,
        /// The snapshot.
        snapshot_id: String,
        /// The underlying error.
        #[source]
        source: StoreError,
    },
    /// The RPC belongs to a capability that is switched off.
    #[error("{rpc}: not supported by this plugin configuration")]
    Unimplemented {
        /// The RPC.
        rpc: &'static str,
    },
    /// The metadata store failed.
    #[error("{rpc}: volume {volume_id}")]
    Store {
        /// The RPC.
        rpc: &'static str,
        /// The volume.
        volume_id: String,
        /// The underlying error.
        #[source]
        source: StoreError,
    },
    /// The backing (mounts, loop devices, images) failed.
    #[error("{rpc}: volume {volume_id}")]
    Backing {
        /// The RPC.
        rpc: &'static str,
        /// The volume.
        volume_id: String,
        /// The underlying error.
        #[source]
        source: BackingError,
    },
    /// Opening the store at startup failed.
    #[error("open volume store under {path}")]
    OpenStore {
        /// The work dir.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: StoreError,
    },
    /// The configuration cannot be served (names the flag and what to do).
    #[error("invalid configuration: {0}")]
    Config(String),
    /// Preparing or binding the socket failed.
    #[error("listen on socket")]
    Listen(#[source] IoStep),
    /// The handler of an RPC panicked.
    #[error("{rpc}: volume {volume_id}: handler panicked: {message}")]
    Panicked {
        /// The RPC.
        rpc: &'static str,
        /// The volume (empty for RPCs without one).
        volume_id: String,
        /// The panic message.
        message: String,
    },
    /// The gRPC server failed.
    #[error("serve gRPC on socket {path}")]
    Serve {
        /// The socket path.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: tonic::transport::Error,
    },
}

/// The state shared by the three services.
#[derive(Debug)]
pub(crate) struct Plugin {
    config: PluginConfig,
    store: Store,
    snapshots: SnapshotStore,
    backing: backing::Backing,
    faults: Faults,
    locks: Arc<locks::LockMap>,
}

/// A REQUIRED request field must not be empty.
fn require(rpc: &'static str, field: &'static str, value: &str) -> Result<(), PluginError> {
    if value.is_empty() {
        return Err(PluginError::MissingField { rpc, field });
    }
    Ok(())
}

impl Plugin {
    /// Refuses `got`, the secrets of an `rpc` request, unless they are exactly those the
    /// `--require-secrets` file (read now) gives its operation; without the flag, anything goes.
    pub(crate) fn check_secrets(
        &self,
        rpc: &'static str,
        got: &std::collections::HashMap<String, String>,
    ) -> Result<(), PluginError> {
        let Some(path) = &self.config.required_secrets else {
            return Ok(());
        };
        let expected = load_required_secrets(path)
            .map_err(|reason| PluginError::RequiredSecretsFile { rpc, reason })?;
        match expected.for_rpc(rpc).mismatch(got) {
            None => Ok(()),
            Some(mismatch) => Err(PluginError::Secrets {
                rpc,
                operation: csi_isolator::csi::Operation::of_rpc(rpc).map_or("none", |op| op.key()),
                mismatch,
            }),
        }
    }

    /// The record of a volume the request names, or NOT_FOUND.
    pub(crate) fn known_volume(
        &self,
        rpc: &'static str,
        volume_id: &str,
    ) -> Result<VolumeRecord, PluginError> {
        self.store
            .get(volume_id)
            .ok_or_else(|| PluginError::VolumeNotFound {
                rpc,
                volume_id: volume_id.to_string(),
            })
    }

    pub(crate) fn save(&self, rpc: &'static str, record: &VolumeRecord) -> Result<(), PluginError> {
        Self::stored(rpc, record, self.store.save(record))
    }

    /// Durably records a known volume's change of use (ControllerPublish, NodeStage,
    /// NodePublish and their reverses) in the store's use journal, whose appends share their
    /// syncs ([`store::Store::save_use`]).
    pub(crate) fn save_use(
        &self,
        rpc: &'static str,
        record: &VolumeRecord,
    ) -> Result<(), PluginError> {
        Self::stored(rpc, record, self.store.save_use(record))
    }

    fn stored(
        rpc: &'static str,
        record: &VolumeRecord,
        saved: Result<(), StoreError>,
    ) -> Result<(), PluginError> {
        saved.map_err(|source| PluginError::Store {
            rpc,
            volume_id: record.id.clone(),
            source,
        })
    }
}

/// The lock key of a volume.
fn volume_key(volume_id: &str) -> String {
    format!("volume/{volume_id}")
}

/// The lock key serializing CreateVolume.
const CREATE_KEY: &str = "create";

/// The lock key of a snapshot.
fn snapshot_key(snapshot_id: &str) -> String {
    format!("snapshot/{snapshot_id}")
}

/// The lock key serializing CreateSnapshot (names).
const CREATE_SNAPSHOT_KEY: &str = "create-snapshot";

/// The Identity, Controller and Node services of one plugin instance.
#[derive(Clone, Debug)]
pub struct PluginService {
    inner: Arc<Plugin>,
}

/// Which per-key lock an RPC runs under.
enum LockKey {
    /// No lock (read-only or global RPCs).
    None,
    /// The volume's lock.
    Volume(String),
    /// The lock serializing CreateVolume (names and capacity).
    Create,
    /// The snapshot's lock.
    Snapshot(String),
    /// The lock serializing CreateSnapshot (names).
    CreateSnapshot,
}

impl PluginService {
    /// Opens the plugin's store under the configured work dir.
    pub fn new(mut config: PluginConfig) -> Result<PluginService, PluginError> {
        multinode::check_config(&mut config)?;
        // A controller's record files are read by node plugins: written through.
        let writes = match config.mode {
            PluginMode::Controller => store::Writes::Through,
            PluginMode::Both | PluginMode::Node => store::Writes::Journaled,
        };
        let store =
            Store::open(&config.work_dir, writes).map_err(|source| PluginError::OpenStore {
                path: config.work_dir.clone(),
                source,
            })?;
        let faults = Faults::new(
            config.faults.clone(),
            config.faults_file.clone(),
            config.log_calls.clone(),
        );
        let snapshots =
            SnapshotStore::open(&config.work_dir).map_err(|source| PluginError::OpenStore {
                path: config.work_dir.clone(),
                source,
            })?;
        let backing = backing::Backing::new(config.backing);
        backing.thaw_leftovers(store.list().iter().map(|r| {
            r.location
                .clone()
                .unwrap_or_else(|| store.volume_dir(&r.id))
        }));
        Ok(PluginService {
            inner: Arc::new(Plugin {
                config,
                store,
                snapshots,
                backing,
                faults,
                locks: Arc::default(),
            }),
        })
    }

    /// The one seam every RPC passes: call log and faults, the lock, the blocking work,
    /// the `exit-in after` point, and the error -> status mapping.
    async fn call<Req, T, F>(
        &self,
        rpc: &'static str,
        volume_id: &str,
        key: LockKey,
        req: Req,
        op: F,
    ) -> Result<Response<T>, Status>
    where
        Req: Send + 'static,
        T: Default + Send + 'static,
        F: FnOnce(&Plugin, Req) -> Result<T, PluginError> + Send + 'static,
    {
        let entered = self.inner.faults.enter(rpc, volume_id).await?;
        if self.inner.faults.lie(rpc) {
            self.inner.faults.leave(rpc, entered);
            return Ok(Response::new(T::default()));
        }
        let guard = match key {
            LockKey::None => None,
            LockKey::Volume(id) if id.is_empty() => None,
            LockKey::Volume(id) => Some(self.inner.locks.lock(&volume_key(&id)).await),
            LockKey::Create => Some(self.inner.locks.lock(CREATE_KEY).await),
            LockKey::Snapshot(id) => Some(self.inner.locks.lock(&snapshot_key(&id)).await),
            LockKey::CreateSnapshot => Some(self.inner.locks.lock(CREATE_SNAPSHOT_KEY).await),
        };
        let inner = self.inner.clone();
        // The blocking task owns the guard: if this handler is dropped (the client gave up),
        // the work still runs to its end under the lock.
        let work = tokio::task::spawn_blocking(move || {
            let _guard = guard;
            op(&inner, req)
        });
        let result = work.await.unwrap_or_else(|e| {
            Err(PluginError::Panicked {
                rpc,
                volume_id: volume_id.to_string(),
                message: join_error_message(e),
            })
        });
        self.inner.faults.leave(rpc, entered);
        result
            .map(Response::new)
            .map_err(|e| status::to_status(rpc, volume_id, e))
    }
}

/// The panic message of a failed blocking task (or why it did not finish).
fn join_error_message(err: tokio::task::JoinError) -> String {
    if !err.is_panic() {
        return err.to_string();
    }
    let payload = err.into_panic();
    if let Some(s) = payload.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}

/// Serves the plugin on its socket until `shutdown` resolves, then removes the socket.
///
/// A stale socket file at the path is removed first; the new socket is made mode 0600.
pub async fn serve(
    config: PluginConfig,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), PluginError> {
    let socket = config.socket.clone();
    let service = PluginService::new(config)?;
    let listener = listen(&socket)?;
    tracing::info!(socket = %socket.display(), "csi-test-plugin serving");
    let mode = service.inner.config.mode;
    // A service left out answers every one of its RPCs UNIMPLEMENTED, as the controller or
    // node half of a real deployment does.
    let controller = (mode != PluginMode::Node)
        .then(|| proto::controller_server::ControllerServer::new(service.clone()));
    let node = (mode != PluginMode::Controller)
        .then(|| proto::node_server::NodeServer::new(service.clone()));
    let result = tonic::transport::Server::builder()
        .layer(wire::WireLiesLayer::new(service.inner.clone()))
        .add_service(proto::identity_server::IdentityServer::new(service.clone()))
        .add_optional_service(controller)
        .add_optional_service(node)
        .serve_with_incoming_shutdown(UnixListenerStream::new(listener), shutdown)
        .await
        .map_err(|source| PluginError::Serve {
            path: socket.clone(),
            source,
        });
    let _ = std::fs::remove_file(&socket);
    result
}

fn listen(socket: &Path) -> Result<UnixListener, PluginError> {
    let err = |step| move |e| PluginError::Listen(io_step(step, socket)(e));
    match std::fs::remove_file(socket) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(err("remove stale socket")(e)),
    }
    if let Some(parent) = socket.parent() {
        std::fs::create_dir_all(parent).map_err(err("create socket directory"))?;
    }
    let listener = UnixListener::bind(socket).map_err(err("bind"))?;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600))
        .map_err(err("chmod 0600"))?;
    Ok(listener)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_panicking_handler_becomes_internal_naming_rpc_and_volume() {
        let dir = tempfile::tempdir().unwrap();
        let config = PluginConfig::new(dir.path().join("csi.sock"), dir.path().join("work"));
        let service = PluginService::new(config).unwrap();
        let result: Result<Response<()>, Status> = service
            .call(
                "NodeStageVolume",
                "vol-1",
                LockKey::Volume("vol-1".into()),
                (),
                |_, ()| panic!("boom"),
            )
            .await;
        let status = result.unwrap_err();
        assert_eq!(status.code(), tonic::Code::Internal);
        assert_eq!(
            status.message(),
            "NodeStageVolume: volume vol-1: handler panicked: boom"
        );
        assert_eq!(service.inner.locks.len(), 0, "the lock was released");
        // The volume is usable again.
        let ok: Result<Response<u8>, Status> = service
            .call(
                "NodeStageVolume",
                "vol-1",
                LockKey::Volume("vol-1".into()),
                (),
                |_, ()| Ok(7),
            )
            .await;
        assert_eq!(ok.unwrap().into_inner(), 7);
    }
}
