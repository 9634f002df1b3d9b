//! Errors of the resource providers: one variant per failing step, naming
//! the volume, the container or the plugin it failed on.

use crate::io_step::IoStep;
use std::path::PathBuf;

use crate::csi::CsiError;
use crate::provider::checkpoint::CheckpointError;

/// A provider operation failed.
#[derive(Debug, thiserror::Error)]
pub enum ProviderError {
    /// A CSI call failed (the CSI error names the RPC, code and message).
    #[error("volume '{volume}'")]
    Csi {
        /// The volume id (or name, before it has an id).
        volume: String,
        /// The failed call.
        #[source]
        source: CsiError,
    },
    /// ControllerPublishVolume was refused because another node holds the volume (a single-node
    /// access mode): nothing was done on this node.
    #[error("volume '{volume}' is published to another node (the controller's answer below names it) and its access mode allows one node at a time, so node '{node}' cannot publish it now; nothing was done here: wait until that node releases it (its last user ends) and retry, or, if that node is dead, fence it first with `csi-isolator volume detach {volume} --node NODE`, run against that node's work dir when it is reachable")]
    HeldByAnotherNode {
        /// The volume id.
        volume: String,
        /// This node's id (NodeGetInfo).
        node: String,
        /// The refused ControllerPublishVolume, naming the node that holds the volume.
        #[source]
        source: Box<CsiError>,
    },
    /// `volume detach` refused ([`crate::provider::handoff::detach_plan`]).
    #[error("volume detach refused")]
    DetachRefused {
        /// Why, and what to do.
        #[source]
        why: DetachRefused,
    },
    /// Connecting to, or talking to, the plugin failed outside of a volume call.
    #[error("plugin {plugin}")]
    Plugin {
        /// `<type>/<name>` of the plugin.
        plugin: String,
        /// The failed call.
        #[source]
        source: CsiError,
    },
    /// The controller plugin named apart from the node plugin (`--controller-endpoint`) cannot
    /// be used with it (another driver, no controller service, or no node plugin apart).
    #[error("controller plugin at {endpoint}: {why}")]
    ControllerPlugin {
        /// The controller endpoint.
        endpoint: String,
        /// Why, and what to do.
        why: String,
    },
    /// A volume was ControllerPublished to a node through a controller plugin, and the plugin
    /// this command drives as its controller has no Controller service to undo it with.
    #[error("volume '{volume}' is ControllerPublished to node '{node}' through a controller plugin, and the plugin at {endpoint} serves no Controller service: it is not unpublished here, or the controller would hold it for that node for good; give the command the --controller-endpoint it was published with")]
    NoControllerToUnpublish {
        /// The volume id.
        volume: String,
        /// The node it is published to.
        node: String,
        /// The endpoint driven as the controller.
        endpoint: String,
    },
    /// Starting the managed plugin process failed.
    #[error("start plugin {plugin} ({command})")]
    Spawn {
        /// `<type>/<name>` of the plugin.
        plugin: String,
        /// The command that was run.
        command: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The managed plugin did not become ready in time.
    #[error("plugin {plugin} not ready at {endpoint} after {waited_ms} ms")]
    NotReady {
        /// `<type>/<name>` of the plugin.
        plugin: String,
        /// The endpoint it should serve.
        endpoint: String,
        /// How long we waited.
        waited_ms: u128,
        /// What went wrong last.
        #[source]
        last: NotReadyCause,
    },
    /// A checkpoint could not be written or read.
    #[error("volume '{volume}'")]
    Checkpoint {
        /// The volume id (or name).
        volume: String,
        /// The checkpoint error.
        #[source]
        source: CheckpointError,
    },
    /// A checkpoint exists but cannot be parsed; it was set aside.
    #[error("corrupt state file {path} (set aside as {aside}): {reason}")]
    CorruptState {
        /// Where the file was.
        path: PathBuf,
        /// Where it is now.
        aside: PathBuf,
        /// Why it was rejected.
        reason: String,
    },
    /// No such volume is known to the provider.
    #[error("unknown volume '{volume}' in provider {provider}: csi-isolator did not create or import it; if the plugin has it, record it first with `csi-isolator volume import NAME --volume-id '{volume}'` (serve: ImportVolume), or give a volume this provider knows (`volume list`)")]
    UnknownVolume {
        /// The volume id.
        volume: String,
        /// The provider id.
        provider: String,
    },
    /// No provider has this id.
    #[error("unknown resource provider '{provider}' (resource {resource})")]
    UnknownProvider {
        /// The provider id.
        provider: String,
        /// The resource that named it.
        resource: String,
    },
    /// A disk resource of a provider lacks `disk.source.id`.
    #[error("resource {resource} of provider {provider} has no disk.source.id: name a volume the provider has (`volume list`; `volume import` records one it does not know), or give disk.source.profile (with --disk-profiles) and disk.persistence.id to create one")]
    MissingVolumeId {
        /// The resource.
        resource: String,
        /// The provider id.
        provider: String,
    },
    /// The volume is in use and the operation needs it unused.
    #[error("volume '{volume}' is in use by container(s) {}", users.join(", "))]
    InUse {
        /// The volume id.
        volume: String,
        /// The containers using it.
        users: Vec<String>,
    },
    /// The volume's access mode refuses the use (see `provider::access`): nothing was recorded
    /// or sent.
    #[error(
        "volume '{volume}' (access mode {mode}) cannot be used by container '{container}': {why}"
    )]
    AccessModeRefused {
        /// The volume id.
        volume: String,
        /// Its access mode.
        mode: String,
        /// The container asking, shown.
        container: String,
        /// Why, naming the holder and what to do.
        why: String,
    },
    /// An access mode CSI lets a CO use only with a plugin capability the plugin lacks
    /// (SINGLE_NODE_SINGLE_WRITER and SINGLE_NODE_MULTI_WRITER need the node's
    /// SINGLE_NODE_MULTI_WRITER): refused before anything is written or sent.
    #[error("volume '{volume}': access mode {mode} needs the SINGLE_NODE_MULTI_WRITER capability, which plugin {plugin} does not offer: use SINGLE_NODE_WRITER, or a plugin that offers it")]
    AccessModeUnsupported {
        /// The volume name (or id).
        volume: String,
        /// The access mode asked for.
        mode: String,
        /// `<type>/<name>` of the plugin.
        plugin: String,
    },
    /// The volume is being destroyed; it cannot be published.
    #[error("volume '{volume}' is being destroyed")]
    Destroying {
        /// The volume id.
        volume: String,
    },
    /// A directory of the layout could not be created or removed.
    #[error(transparent)]
    Io(#[from] IoStep),
    /// A configured name of the plugin that becomes a path component (its type or name) is not
    /// safe (the error names the field, the value and why).
    #[error("configure the provider")]
    InvalidConfig(#[source] Box<crate::resource::ResourceError>),
    /// A name that becomes a path component is not safe.
    #[error("invalid {field} '{value}': {reason}")]
    InvalidName {
        /// Which name (`plugin type`, `plugin name`, `container id`).
        field: &'static str,
        /// The value.
        value: String,
        /// Why it was refused.
        reason: String,
    },
    /// The plugin answered success but the effect the spec requires is not
    /// there, or it no longer offers a capability that state it made needs
    /// (a volume still staged by a plugin replaced by one without
    /// STAGE_UNSTAGE_VOLUME).
    #[error("volume '{volume}': {rpc} {what}")]
    PluginMisbehaved {
        /// The volume id.
        volume: String,
        /// The RPC.
        rpc: &'static str,
        /// What is wrong.
        what: String,
    },
    /// An expansion refused before any RPC ([`ExpandRefusal`]).
    #[error("expand volume '{volume}' to {bytes} bytes: {why}")]
    ExpandRefused {
        /// The volume id.
        volume: String,
        /// The size asked.
        bytes: u64,
        /// Why, and what to do.
        why: ExpandRefusal,
    },
    /// A snapshot operation, or a volume made from a snapshot or a volume, refused before any
    /// RPC ([`SnapshotRefusal`]).
    #[error("{what}: {why}")]
    SnapshotRefused {
        /// The operation and its object, e.g. `snapshot 'daily'`.
        what: String,
        /// Why, and what to do.
        why: SnapshotRefusal,
    },
    /// A snapshot record that cannot be read.
    #[error("corrupt snapshot record {path}: {reason}: move it aside and delete the snapshot in the plugin if it is there")]
    CorruptSnapshot {
        /// The record.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A modification refused before any RPC ([`ModifyRefusal`]).
    #[error("modify volume '{volume}': {why}")]
    ModifyRefused {
        /// The volume id.
        volume: String,
        /// Why, and what to do.
        why: ModifyRefusal,
    },
    /// A publish on a node the volume's topology does not cover.
    #[error("volume '{volume}' can be reached only from {accessible} (its CreateVolume answer), and this node is at {node}: publish it on a node there, or recreate it here")]
    NotAccessible {
        /// The volume id.
        volume: String,
        /// The volume's topologies, shown.
        accessible: String,
        /// This node's segments, shown.
        node: String,
    },
    /// CreateVolume parameters that are refused before anything is sent.
    #[error("volume '{volume}'")]
    Parameters {
        /// The volume name.
        volume: String,
        /// What is wrong with them.
        #[source]
        source: crate::provider::parameters::ParameterError,
    },
    /// A volume's secrets file refused (the error names the file and what to fix, never the
    /// content).
    #[error("volume '{volume}': {rpc}")]
    Secrets {
        /// The volume id (or name, before it has an id).
        volume: String,
        /// The RPC the secrets were read for (`import` when an import checks the file up front).
        rpc: &'static str,
        /// What is wrong with the file.
        #[source]
        source: crate::provider::secrets::SecretsError,
    },
    /// A create of an existing name with another secrets file.
    #[error("volume '{volume}' exists with secrets file {recorded}, not {asked}: give the file it has (rotate secrets by changing the file's content), or destroy it first, or use another name")]
    SecretsFileDiffers {
        /// The volume name.
        volume: String,
        /// The recorded file (`none` when it has none).
        recorded: String,
        /// The file asked for.
        asked: String,
    },
    /// A create of an existing name with another parameter set.
    #[error("volume '{volume}' exists with other CreateVolume parameters (first difference: key '{key}'): create it with the parameters it has (`volume list --json` shows them), or destroy it first, or use another name")]
    ParametersDiffer {
        /// The volume name.
        volume: String,
        /// The first key on which they differ.
        key: String,
    },
    /// A create of an existing name with another volume capability (access mode, fs type or
    /// mount flags): CSI answers ALREADY_EXISTS to a CreateVolume whose capabilities the
    /// volume of that name does not have.
    #[error("volume '{volume}' exists with capability {recorded}, not {asked}: ask for the capability it has (`volume list --json` shows it), or destroy it first, or use another name")]
    CapabilityDiffers {
        /// The volume name.
        volume: String,
        /// The recorded capability, shown.
        recorded: String,
        /// The capability asked for, shown.
        asked: String,
    },
    /// An import refused: it clashes with a volume already recorded, or
    /// the plugin did not confirm the capability.
    #[error("import of '{name}' (volume id '{volume_id}'): {clash}")]
    ImportRefused {
        /// The name asked for.
        name: String,
        /// The volume id asked for.
        volume_id: String,
        /// What is wrong.
        clash: String,
    },
    /// `volume list --plugin` on a plugin without LIST_VOLUMES.
    #[error("plugin {plugin} does not offer LIST_VOLUMES: it cannot say which volumes it has; import a volume you know by id (`volume import NAME --volume-id ID`)")]
    NoListVolumes {
        /// The provider id.
        plugin: String,
    },
    /// `volume destroy --delete` (serve: `delete_imported`) of an imported
    /// volume on a plugin without CREATE_DELETE_VOLUME: refused before the
    /// destroy is recorded, since no DeleteVolume could ever finish it.
    #[error("plugin {plugin} does not offer CREATE_DELETE_VOLUME: it cannot delete volume '{volume}'; destroy it without --delete to forget it and leave it in the plugin")]
    NoDeleteVolume {
        /// The provider id.
        plugin: String,
        /// The volume id.
        volume: String,
    },
    /// A disk resource with a profile and no volume that cannot be made into one.
    #[error("resource {resource}: {why}")]
    BadProfileDisk {
        /// The resource.
        resource: String,
        /// What is missing or does not fit.
        why: String,
    },
    /// A disk resource with a profile the profiles file does not define.
    #[error("resource {resource}: disk profile '{profile}' is not in the profiles file{}", file.as_ref().map(|f| format!(" {}", f.display())).unwrap_or_else(|| " (none given: pass --disk-profiles FILE)".to_string()))]
    UnknownProfile {
        /// The resource.
        resource: String,
        /// The profile it names.
        profile: String,
        /// The profiles file, if any.
        file: Option<PathBuf>,
    },
    /// The CreateVolume response lacked something the spec requires.
    #[error("CreateVolume of '{name}' returned {what}")]
    BadCreateResponse {
        /// The volume name.
        name: String,
        /// What was wrong.
        what: &'static str,
    },
}

impl ProviderError {
    /// The gRPC code of the underlying CSI error, if any.
    pub fn csi_code(&self) -> Option<tonic::Code> {
        match self {
            ProviderError::Csi { source, .. } | ProviderError::Plugin { source, .. } => {
                source.code()
            }
            ProviderError::HeldByAnotherNode { source, .. } => source.code(),
            _ => None,
        }
    }
}

/// Why a managed plugin was not ready, the last time it was asked.
#[derive(Debug, thiserror::Error)]
pub enum NotReadyCause {
    /// Its socket never appeared.
    #[error("its socket was not created")]
    NoSocket,
    /// The socket is there, but a connection failed.
    #[error("cannot connect")]
    Connect(#[source] crate::csi::transport::TransportError),
    /// Probe had no answer in time.
    #[error("Probe had no answer within {0:?}")]
    ProbeTimedOut(std::time::Duration),
    /// Probe answered an error.
    #[error("Probe failed: {code}: {message}")]
    ProbeFailed {
        /// The gRPC code.
        code: tonic::Code,
        /// The plugin's message, shown escaped.
        message: String,
    },
    /// Probe answered `ready: false`.
    #[error("Probe answered ready=false")]
    NotReadyYet,
}

/// Why an expansion is refused before any RPC.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExpandRefusal {
    /// A size of 0.
    ZeroSize,
    /// Smaller than the volume is.
    Shrink {
        /// The volume's size.
        capacity: u64,
    },
    /// The plugin cannot expand volumes.
    NoCapability,
    /// The plugin expands only volumes not in use, and this one is.
    OfflineOnly {
        /// Its users.
        users: Vec<String>,
    },
}

impl std::fmt::Display for ExpandRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ExpandRefusal::ZeroSize => f.write_str("a size of 0 is no size: give the new size, larger than the volume's"),
            ExpandRefusal::Shrink { capacity } => write!(
                f,
                "it holds {capacity} bytes already and CSI volumes cannot shrink: give a larger size"
            ),
            ExpandRefusal::NoCapability => f.write_str(
                "the plugin cannot expand volumes (neither its controller nor its node service has EXPAND_VOLUME)",
            ),
            ExpandRefusal::OfflineOnly { users } => write!(
                f,
                "the plugin expands only volumes not in use (its VolumeExpansion capability is not ONLINE), and it is used by {}: stop them and retry",
                users.join(", ")
            ),
        }
    }
}

/// Why a modification (ControllerModifyVolume) is refused before any RPC.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModifyRefusal {
    /// No parameters asked.
    Nothing,
    /// The parameters break the one rule for parameters.
    Parameters(crate::provider::parameters::ParameterError),
    /// The plugin's controller has no MODIFY_VOLUME.
    NoCapability,
}

impl std::fmt::Display for ModifyRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ModifyRefusal::Nothing => {
                f.write_str("no parameters given: give at least one KEY=VALUE")
            }
            ModifyRefusal::Parameters(e) => write!(f, "{e}"),
            ModifyRefusal::NoCapability => f.write_str(
                "the plugin cannot modify volumes (its controller service has no MODIFY_VOLUME)",
            ),
        }
    }
}

/// Why a snapshot operation, or a volume made from a snapshot or a volume, is refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SnapshotRefusal {
    /// No CREATE_DELETE_SNAPSHOT.
    #[error("the plugin cannot take snapshots (its controller has no CREATE_DELETE_SNAPSHOT): use a plugin that can")]
    NoSnapshots,
    /// No CLONE_VOLUME.
    #[error("the plugin cannot clone volumes (its controller has no CLONE_VOLUME): take a snapshot and create the volume --from-snapshot, if the plugin can take snapshots")]
    NoClones,
    /// No snapshot of that name.
    #[error("there is no snapshot '{0}': `volume snapshot list` shows the ones there are")]
    UnknownSnapshot(String),
    /// No volume of that name or id.
    #[error("there is no volume '{0}': `volume list` shows the ones there are")]
    UnknownVolume(String),
    /// The name is a snapshot of another volume.
    #[error("the name '{name}' is taken by a snapshot of volume '{volume}': use another name")]
    NameTaken {
        /// The snapshot name.
        name: String,
        /// The volume it is a snapshot of.
        volume: String,
    },
    /// The snapshot's create or delete is not finished.
    #[error("snapshot '{name}' is still being {doing}: retry the {doing} (or restart, recovery finishes it) first")]
    Pending {
        /// The snapshot name.
        name: String,
        /// `created` or `deleted`.
        doing: &'static str,
    },
    /// The source volume is being destroyed.
    #[error("volume '{0}' is being destroyed")]
    SourceDestroying(String),
}

/// Why `volume detach` refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DetachRefused {
    /// The node's record lists containers using the volume.
    #[error("node '{node}''s record says containers use volume '{volume}' there: {users}; if they are gone (the node is dead), give --force: they lose the volume, and node '{node}' reports it when it comes back")]
    InUse {
        /// The volume id.
        volume: String,
        /// The node.
        node: String,
        /// The users, comma-separated.
        users: String,
    },
    /// The work dir has no record of the volume published to that node.
    #[error("the work dir {work_dir} has no record of volume '{volume}' published to node '{node}': run this against node '{node}''s own work dir (--work-dir), or, when that disk cannot be reached, give --force (whatever still uses the volume there loses it; node '{node}' finds out when the controller refuses it the volume)")]
    NoRecord {
        /// The volume id.
        volume: String,
        /// The node.
        node: String,
        /// The work dir searched.
        work_dir: String,
    },
}
