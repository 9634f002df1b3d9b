//! The per-volume state machine and its checkpoint record.
//!
//! Steady states: `CREATED`, `NODE_READY`, `VOL_READY`, `PUBLISHED`.
//! Transient states (a step in flight): `CONTROLLER_PUBLISH`, `NODE_STAGE`,
//! `NODE_PUBLISH` (forward) and `NODE_UNPUBLISH`, `NODE_UNSTAGE`,
//! `CONTROLLER_UNPUBLISH` (backward). The checkpoint holds one durably
//! before an operation's first RPC, with the operation's goal in
//! [`VolumeRecord::towards`]: together they bound what the plugin may have
//! done if the operation is interrupted.
//!
//! ```text
//! CREATED ─ControllerPublish→ NODE_READY ─NodeStage→ VOL_READY ─NodePublish→ PUBLISHED
//!         ←ControllerUnpublish─          ←NodeUnstage─         ←NodeUnpublish─
//! ```
//! A step whose capability the plugin lacks is skipped (the state moves on
//! without an RPC).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::csi::proto;
use crate::sorted::{SortedMap, SortedSet};

/// The version of the `volume.state` format written by this build.
pub const FORMAT_VERSION: u32 = 1;

/// Where a volume is in its lifecycle (see the module doc).
///
/// Its name in the checkpoint is [`VolumeState::as_str`], the one list of
/// names: serde writes and reads it through `as_str` and [`FromStr`]. They
/// are Mesos' names for the same states and must not change.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum VolumeState {
    /// Created (or declared, for a pre-provisioned volume); nothing on this node.
    Created,
    /// ControllerPublishVolume is being (or was about to be) sent.
    ControllerPublish,
    /// Attached to this node by the controller (or no controller step needed).
    NodeReady,
    /// NodeStageVolume is being sent.
    NodeStage,
    /// Staged at the staging path.
    VolReady,
    /// NodePublishVolume is being sent.
    NodePublish,
    /// Mounted at the volume's target path: usable by containers.
    Published,
    /// NodeUnpublishVolume is being sent.
    NodeUnpublish,
    /// NodeUnstageVolume is being sent.
    NodeUnstage,
    /// ControllerUnpublishVolume is being sent.
    ControllerUnpublish,
}

/// One step of the machine: an RPC moving between two steady states.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// `CREATED → NODE_READY`.
    ControllerPublish,
    /// `NODE_READY → VOL_READY`.
    NodeStage,
    /// `VOL_READY → PUBLISHED`.
    NodePublish,
    /// `PUBLISHED → VOL_READY`.
    NodeUnpublish,
    /// `VOL_READY → NODE_READY`.
    NodeUnstage,
    /// `NODE_READY → CREATED`.
    ControllerUnpublish,
}

impl Step {
    /// The transient state recorded before the step's RPC.
    pub fn transient(self) -> VolumeState {
        match self {
            Step::ControllerPublish => VolumeState::ControllerPublish,
            Step::NodeStage => VolumeState::NodeStage,
            Step::NodePublish => VolumeState::NodePublish,
            Step::NodeUnpublish => VolumeState::NodeUnpublish,
            Step::NodeUnstage => VolumeState::NodeUnstage,
            Step::ControllerUnpublish => VolumeState::ControllerUnpublish,
        }
    }

    /// The steady state the step starts from.
    pub fn from(self) -> VolumeState {
        match self {
            Step::ControllerPublish => VolumeState::Created,
            Step::NodeStage => VolumeState::NodeReady,
            Step::NodePublish | Step::NodeUnstage => VolumeState::VolReady,
            Step::NodeUnpublish => VolumeState::Published,
            Step::ControllerUnpublish => VolumeState::NodeReady,
        }
    }

    /// The steady state recorded after the step's RPC succeeded.
    pub fn to(self) -> VolumeState {
        match self {
            Step::ControllerPublish => VolumeState::NodeReady,
            Step::NodeStage => VolumeState::VolReady,
            Step::NodePublish => VolumeState::Published,
            Step::NodeUnpublish => VolumeState::VolReady,
            Step::NodeUnstage => VolumeState::NodeReady,
            Step::ControllerUnpublish => VolumeState::Created,
        }
    }

    /// The CSI RPC the step sends.
    pub fn rpc(self) -> &'static str {
        match self {
            Step::ControllerPublish => "ControllerPublishVolume",
            Step::NodeStage => "NodeStageVolume",
            Step::NodePublish => "NodePublishVolume",
            Step::NodeUnpublish => "NodeUnpublishVolume",
            Step::NodeUnstage => "NodeUnstageVolume",
            Step::ControllerUnpublish => "ControllerUnpublishVolume",
        }
    }

    /// The forward step that ends in `state` (a steady state past CREATED).
    pub fn forward_into(state: VolumeState) -> Option<Step> {
        Some(match state {
            VolumeState::NodeReady => Step::ControllerPublish,
            VolumeState::VolReady => Step::NodeStage,
            VolumeState::Published => Step::NodePublish,
            _ => return None,
        })
    }

    /// The step that undoes this one.
    pub fn reverse(self) -> Step {
        match self {
            Step::ControllerPublish => Step::ControllerUnpublish,
            Step::NodeStage => Step::NodeUnstage,
            Step::NodePublish => Step::NodeUnpublish,
            Step::NodeUnpublish => Step::NodePublish,
            Step::NodeUnstage => Step::NodeStage,
            Step::ControllerUnpublish => Step::ControllerPublish,
        }
    }

    /// Whether the step moves towards `PUBLISHED`.
    pub fn is_forward(self) -> bool {
        matches!(
            self,
            Step::ControllerPublish | Step::NodeStage | Step::NodePublish
        )
    }
}

impl VolumeState {
    /// Whether this is a steady state (no RPC in flight).
    pub fn is_steady(self) -> bool {
        matches!(
            self,
            VolumeState::Created
                | VolumeState::NodeReady
                | VolumeState::VolReady
                | VolumeState::Published
        )
    }

    /// The step whose intent this transient state records.
    pub fn pending_step(self) -> Option<Step> {
        Some(match self {
            VolumeState::ControllerPublish => Step::ControllerPublish,
            VolumeState::NodeStage => Step::NodeStage,
            VolumeState::NodePublish => Step::NodePublish,
            VolumeState::NodeUnpublish => Step::NodeUnpublish,
            VolumeState::NodeUnstage => Step::NodeUnstage,
            VolumeState::ControllerUnpublish => Step::ControllerUnpublish,
            _ => return None,
        })
    }

    /// Rank of a steady state along the forward path (CREATED = 0 ...
    /// PUBLISHED = 3); transient states have none.
    pub fn rank(self) -> Option<u8> {
        Some(match self {
            VolumeState::Created => 0,
            VolumeState::NodeReady => 1,
            VolumeState::VolReady => 2,
            VolumeState::Published => 3,
            _ => return None,
        })
    }

    /// Whether the state involves this node's mounts (staging or target),
    /// which a reboot wipes out.
    pub fn is_node_side(self) -> bool {
        matches!(
            self,
            VolumeState::NodeStage
                | VolumeState::VolReady
                | VolumeState::NodePublish
                | VolumeState::Published
                | VolumeState::NodeUnpublish
                | VolumeState::NodeUnstage
        )
    }

    /// The next step from this steady state towards `goal` (a steady state),
    /// or `None` when there.
    pub fn next_step_towards(self, goal: VolumeState) -> Option<Step> {
        let (here, there) = (self.rank()?, goal.rank()?);
        use std::cmp::Ordering::*;
        match here.cmp(&there) {
            Equal => None,
            Less => Some(match self {
                VolumeState::Created => Step::ControllerPublish,
                VolumeState::NodeReady => Step::NodeStage,
                _ => Step::NodePublish,
            }),
            Greater => Some(match self {
                VolumeState::Published => Step::NodeUnpublish,
                VolumeState::VolReady => Step::NodeUnstage,
                _ => Step::ControllerUnpublish,
            }),
        }
    }

    /// Every state, in the order of the forward path (transient states
    /// before the steady state they lead to).
    pub const ALL: [VolumeState; 10] = [
        VolumeState::Created,
        VolumeState::ControllerPublish,
        VolumeState::NodeReady,
        VolumeState::NodeStage,
        VolumeState::VolReady,
        VolumeState::NodePublish,
        VolumeState::Published,
        VolumeState::NodeUnpublish,
        VolumeState::NodeUnstage,
        VolumeState::ControllerUnpublish,
    ];

    /// The CSI-style name, as written in the checkpoint (`NODE_READY`, ...):
    /// the only place the names are spelled.
    pub fn as_str(self) -> &'static str {
        match self {
            VolumeState::Created => "CREATED",
            VolumeState::ControllerPublish => "CONTROLLER_PUBLISH",
            VolumeState::NodeReady => "NODE_READY",
            VolumeState::NodeStage => "NODE_STAGE",
            VolumeState::VolReady => "VOL_READY",
            VolumeState::NodePublish => "NODE_PUBLISH",
            VolumeState::Published => "PUBLISHED",
            VolumeState::NodeUnpublish => "NODE_UNPUBLISH",
            VolumeState::NodeUnstage => "NODE_UNSTAGE",
            VolumeState::ControllerUnpublish => "CONTROLLER_UNPUBLISH",
        }
    }
}

impl fmt::Display for VolumeState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.as_str())
    }
}

/// A name that is no state's [`VolumeState::as_str`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown volume state '{0}'")]
pub struct UnknownState(pub String);

impl FromStr for VolumeState {
    type Err = UnknownState;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        VolumeState::ALL
            .into_iter()
            .find(|state| state.as_str() == name)
            .ok_or_else(|| UnknownState(crate::shown::shown(name).to_string()))
    }
}

impl Serialize for VolumeState {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for VolumeState {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let name = String::deserialize(deserializer)?;
        name.parse().map_err(serde::de::Error::custom)
    }
}

/// The volume capability a volume is published with, in checkpoint form.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capability {
    /// CSI access mode name, e.g. `SINGLE_NODE_WRITER`.
    pub access_mode: String,
    /// Filesystem type for the mount access type (empty: plugin's default).
    #[serde(default)]
    pub fs_type: String,
    /// Mount flags for the mount access type.
    #[serde(default)]
    pub mount_flags: Vec<String>,
    /// CSI access type: a filesystem (`mount`, the default, also for checkpoints written
    /// before block volumes) or a raw block device (`block`).
    #[serde(default, skip_serializing_if = "AccessType::is_mount")]
    pub access_type: AccessType,
}

/// How a volume is presented: a mounted filesystem or a raw block device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AccessType {
    /// A filesystem, published at a directory.
    #[default]
    Mount,
    /// A block device, published at a device file.
    Block,
}

impl AccessType {
    /// The spelling used in checkpoints, `serve`'s messages and `--mount type=`.
    pub fn as_str(self) -> &'static str {
        match self {
            AccessType::Mount => "mount",
            AccessType::Block => "block",
        }
    }

    /// Reads a spelling of [`AccessType::as_str`]; the empty string is `mount` (the
    /// default of `serve`'s messages).
    pub fn parse(name: &str) -> Result<AccessType, UnknownAccessType> {
        match name {
            "" | "mount" => Ok(AccessType::Mount),
            "block" => Ok(AccessType::Block),
            other => Err(UnknownAccessType {
                name: crate::shown::shown(other).to_string(),
            }),
        }
    }

    /// Whether this is the default, `mount` (checkpoints leave it out).
    pub fn is_mount(&self) -> bool {
        *self == AccessType::Mount
    }
}

/// An access type name that is neither `mount` nor `block`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown access type '{name}' (expected mount or block)")]
pub struct UnknownAccessType {
    /// The name as given, escaped for showing.
    pub name: String,
}

impl Default for Capability {
    fn default() -> Self {
        Capability {
            access_mode: "SINGLE_NODE_WRITER".into(),
            fs_type: String::new(),
            mount_flags: Vec::new(),
            access_type: AccessType::Mount,
        }
    }
}

/// Whether a CSI access mode only allows reading (the one list of them).
pub fn is_reader_only_mode(mode: proto::volume_capability::access_mode::Mode) -> bool {
    use proto::volume_capability::access_mode::Mode;
    matches!(mode, Mode::SingleNodeReaderOnly | Mode::MultiNodeReaderOnly)
}

/// An access mode name the CSI spec does not define.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown CSI access mode '{name}' (expected one of {})", Capability::access_mode_names().join(", "))]
pub struct UnknownAccessMode {
    /// The name as given, escaped for showing.
    pub name: String,
}

/// An fs type or mount flags refused by [`Capability::set_mount`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{what}")]
pub struct InvalidMount {
    /// `fs_type` or `mount_flags`.
    pub field: &'static str,
    /// What is wrong, the value shown escaped.
    pub what: String,
}

/// Most mount flags a capability carries (the `--mount` parser's bound too).
pub const MAX_MOUNT_FLAGS: usize = 64;
/// Longest mount flag, in bytes.
pub const MAX_MOUNT_FLAG_BYTES: usize = 256;
/// Longest fs type, in bytes.
pub const MAX_FS_TYPE_BYTES: usize = 32;

impl Capability {
    /// Sets the fs type (empty: the plugin's default) and mount flags a user named: the one
    /// check of their form, for `serve` (and whoever parses them): a type of at most
    /// [`MAX_FS_TYPE_BYTES`] letters, digits, `.` and `_`; at most [`MAX_MOUNT_FLAGS`] flags of at most [`MAX_MOUNT_FLAG_BYTES`] bytes,
    /// none empty or holding a control character. What a flag means is the plugin's to say (it
    /// must refuse what it does not apply). On refusal the capability is left as it was.
    ///
    /// A block capability (access type set before) has neither: CSI's block capability carries
    /// no fs type and no mount flags, so asking for them is refused, never dropped.
    pub fn set_mount(&mut self, fs_type: &str, mount_flags: &[String]) -> Result<(), InvalidMount> {
        use crate::shown::shown;
        if self.access_type == AccessType::Block {
            if !fs_type.is_empty() {
                return Err(InvalidMount {
                    field: "fs_type",
                    what: format!(
                        "'{}' asked for a block volume, which has no filesystem (CSI's block capability has no fs type)",
                        shown(fs_type)
                    ),
                });
            }
            if !mount_flags.is_empty() {
                return Err(InvalidMount {
                    field: "mount_flags",
                    what: "asked for a block volume, which is not mounted (CSI's block capability has no mount flags)".into(),
                });
            }
        }
        let fs_ok = fs_type.len() <= MAX_FS_TYPE_BYTES
            && fs_type
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '_');
        if !fs_ok {
            return Err(InvalidMount {
                field: "fs_type",
                what: format!(
                    "'{}' is not a filesystem type name (letters, digits, '.' and '_', at most {MAX_FS_TYPE_BYTES})",
                    shown(fs_type)
                ),
            });
        }
        if mount_flags.len() > MAX_MOUNT_FLAGS {
            return Err(InvalidMount {
                field: "mount_flags",
                what: format!(
                    "{} flags, over the limit of {MAX_MOUNT_FLAGS}",
                    mount_flags.len()
                ),
            });
        }
        if let Some(bad) = mount_flags.iter().find(|f| {
            f.is_empty() || f.len() > MAX_MOUNT_FLAG_BYTES || f.chars().any(char::is_control)
        }) {
            return Err(InvalidMount {
                field: "mount_flags",
                what: format!(
                    "flag '{}' is empty, over {MAX_MOUNT_FLAG_BYTES} bytes or holds a control character",
                    shown(bad)
                ),
            });
        }
        self.fs_type = fs_type.to_string();
        self.mount_flags = mount_flags.to_vec();
        Ok(())
    }

    /// Sets the access mode to one a user named (CSI's names, such as `SINGLE_NODE_WRITER`):
    /// the one check of a mode name, for the command line, `serve` and disk profiles alike.
    pub fn set_access_mode(&mut self, name: &str) -> Result<(), UnknownAccessMode> {
        let named = Capability {
            access_mode: name.to_string(),
            ..Capability::default()
        };
        if named.mode().is_none() {
            return Err(UnknownAccessMode {
                name: crate::shown::shown(name).to_string(),
            });
        }
        self.access_mode = named.access_mode;
        Ok(())
    }

    /// The capability for people: the access mode, then the fs type and mount flags when set
    /// (shown escaped: they come from users and profiles files).
    pub fn describe(&self) -> String {
        let mut text = crate::shown::shown(&self.access_mode).into_owned();
        if self.access_type == AccessType::Block {
            text.push_str(" access_type=block");
        }
        if !self.fs_type.is_empty() {
            text.push_str(&format!(" fs_type={}", crate::shown::shown(&self.fs_type)));
        }
        if !self.mount_flags.is_empty() {
            let flags: Vec<_> = self
                .mount_flags
                .iter()
                .map(|f| crate::shown::shown(f))
                .collect();
            text.push_str(&format!(" mount_flags={}", flags.join(",")));
        }
        text
    }

    /// The access mode names the CSI spec defines, in its order.
    pub fn access_mode_names() -> Vec<&'static str> {
        use proto::volume_capability::access_mode::Mode;
        (1..)
            .map_while(|n| Mode::try_from(n).ok())
            .map(|m| m.as_str_name())
            .collect()
    }

    /// The CSI access mode, if the name is one the spec defines.
    pub fn mode(&self) -> Option<proto::volume_capability::access_mode::Mode> {
        proto::volume_capability::access_mode::Mode::from_str_name(&self.access_mode)
            .filter(|m| *m != proto::volume_capability::access_mode::Mode::Unknown)
    }

    /// Whether the access mode only allows reading.
    pub fn is_reader_only(&self) -> bool {
        self.mode().is_some_and(is_reader_only_mode)
    }

    /// [`to_proto`](Self::to_proto) with `volume_mount_group` set to `group` (decimal), for a
    /// mount volume; a block volume never carries one.
    pub fn to_proto_with_group(&self, group: Option<u32>) -> proto::VolumeCapability {
        let mut cap = self.to_proto();
        if let (Some(gid), Some(proto::volume_capability::AccessType::Mount(mount))) =
            (group, cap.access_type.as_mut())
        {
            mount.volume_mount_group = crate::provider::mount_group::wire(gid);
        }
        cap
    }

    /// The capability as the CSI message (its access type: mount with the fs type and
    /// flags, or block), without `volume_mount_group`.
    pub fn to_proto(&self) -> proto::VolumeCapability {
        use proto::volume_capability::{AccessMode, BlockVolume, MountVolume};
        proto::VolumeCapability {
            access_mode: Some(AccessMode {
                mode: self.mode().map(|m| m as i32).unwrap_or_default(),
            }),
            access_type: Some(match self.access_type {
                AccessType::Mount => proto::volume_capability::AccessType::Mount(MountVolume {
                    fs_type: self.fs_type.clone(),
                    mount_flags: self.mount_flags.clone(),
                    ..Default::default()
                }),
                AccessType::Block => proto::volume_capability::AccessType::Block(BlockVolume {}),
            }),
        }
    }
}

/// What a volume's `volume.state` checkpoint holds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VolumeRecord {
    /// Format version ([`FORMAT_VERSION`]).
    pub format: u32,
    /// The plugin's volume id.
    pub volume_id: String,
    /// The CreateVolume name, for volumes this provider created.
    #[serde(default)]
    pub name: Option<String>,
    /// Where the volume is in its lifecycle.
    pub state: VolumeState,
    /// The capability it is published with.
    pub capability: Capability,
    /// Capacity reported by CreateVolume (0: unknown).
    #[serde(default)]
    pub capacity_bytes: u64,
    /// CreateVolume parameters.
    #[serde(default)]
    pub parameters: SortedMap,
    /// `volume_context` from CreateVolume, passed to every later call.
    #[serde(default)]
    pub volume_context: SortedMap,
    /// `publish_context` from ControllerPublishVolume, passed to the node calls.
    #[serde(default)]
    pub publish_context: SortedMap,
    /// The node id the volume was controller-published to.
    #[serde(default)]
    pub node_id: Option<String>,
    /// Where the volume can be reached from, as CreateVolume answered (empty: anywhere, or
    /// the plugin has no VOLUME_ACCESSIBILITY_CONSTRAINTS); a node none of these covers is
    /// refused at publish.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub accessible_topology: Vec<crate::provider::topology::Segments>,
    /// The boot id at the last node-side transition (a changed boot id means
    /// the node-side mounts are gone).
    #[serde(default)]
    pub boot_id: Option<String>,
    /// Whether NodePublish was sent with `readonly` (reader-only access modes).
    #[serde(default)]
    pub readonly: bool,
    /// Containers using the volume; it is never unpublished while non-empty.
    #[serde(default)]
    pub users: SortedSet,
    /// The users that only read it (a subset of `users`); every other user writes. Empty in
    /// checkpoints of earlier versions, whose users therefore all count as writing. The
    /// access-mode rule (`provider::access`) reads it.
    #[serde(default, skip_serializing_if = "SortedSet::is_empty")]
    pub readers: SortedSet,
    /// A volume that existed in the plugin before and was declared by id:
    /// published and unpublished, never created or deleted by us.
    #[serde(default)]
    pub pre_provisioned: bool,
    /// A destroy was asked for: unpublish fully, then DeleteVolume.
    #[serde(default)]
    pub destroying: bool,
    /// The destroy of a pre-provisioned (imported) volume deletes it in the
    /// plugin too (`volume destroy --delete`); without it, it is only forgotten.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub delete_imported: bool,
    /// While an operation is in flight: the steady state it is going to.
    /// With the transient `state` (its first step) it bounds what the plugin
    /// may have done if the operation was interrupted.
    #[serde(default)]
    pub towards: Option<VolumeState>,
    /// Disk profile of the volume, echoed into its resource.
    #[serde(default)]
    pub profile: Option<String>,
    /// Vendor (the plugin's name), echoed into its resource.
    #[serde(default)]
    pub vendor: Option<String>,
    /// The volume's secrets file (an absolute path), read at each call that carries secrets
    /// ([`crate::provider::secrets`]); the reference is recorded, never the content.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secrets_file: Option<std::path::PathBuf>,
    /// The group the volume is staged and published with (`volume_mount_group`, sent only to a
    /// plugin with VOLUME_MOUNT_GROUP, for mount volumes): made durable with the intent of the
    /// publish that brings the volume onto the node, so recovery and a re-publish after a
    /// restart send the same group. Chosen by [`crate::provider::mount_group::group_after`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mount_group: Option<u32>,
    /// Where the volume's content came from when it was created (a snapshot or a volume,
    /// [`crate::provider::snapshot`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content_source: Option<ContentSource>,
    /// An expansion not finished: its intent, durable before its first RPC
    /// ([`crate::provider::expand`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expansion: Option<Expansion>,
    /// The volume's mutable parameters as the plugin last accepted them
    /// ([`crate::provider::modify`]).
    #[serde(default, skip_serializing_if = "SortedMap::is_empty")]
    pub mutable_parameters: SortedMap,
    /// A ControllerModifyVolume not known to be done: the parameters asked, durable before the
    /// RPC ([`crate::provider::modify`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub modifying: Option<SortedMap>,
    /// The volume was taken from this node while it was away (`volume detach`, or the
    /// controller refused to publish it here again): recovery tears its node side down and
    /// never publishes it to the controller again for the uses it lost
    /// ([`crate::provider::handoff`]). Cleared when this node publishes it anew.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fenced: Option<Fence>,
}

/// An expansion of a volume to `to_bytes`, and the call it waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Expansion {
    /// The size asked.
    pub to_bytes: u64,
    /// The call still to make.
    pub step: ExpandStep,
}

/// The calls of an expansion, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExpandStep {
    /// ControllerExpandVolume is being (or is to be) sent.
    Controller,
    /// NodeExpandVolume is being sent, or waits for the volume's next publish on this node (the
    /// plugin said `node_expansion_required`).
    Node,
}

impl VolumeRecord {
    /// Every user and whether it writes, in name order.
    pub fn uses(&self) -> impl Iterator<Item = (&str, bool)> {
        self.users
            .iter()
            .map(|u| (u.as_str(), !self.readers.contains(u)))
    }

    /// Ends `container`'s use; whether it was a user.
    pub fn remove_user(&mut self, container: &str) -> bool {
        self.readers.remove(container);
        self.users.remove(container)
    }

    /// Whether the volume rests at `goal`: there, with no operation under way. Driving it to
    /// `goal` then does nothing (no RPC, no write).
    pub fn rests_at(&self, goal: VolumeState) -> bool {
        self.state == goal && self.towards.is_none()
    }

    /// Parses the state file of the volume directory named `dir_name`, checking what a reader must
    /// not trust: a format newer than this build's, or a volume id that does not encode to its own
    /// directory. Recovery and `status` read the same way, so `status` never shows as healthy a
    /// record the next start would set aside.
    pub fn from_state_file(bytes: &[u8], dir_name: &str) -> Result<VolumeRecord, String> {
        let rec: VolumeRecord = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
        if rec.format > FORMAT_VERSION {
            return Err(format!(
                "format {} is newer than this build's {FORMAT_VERSION}",
                rec.format
            ));
        }
        if crate::resource::encode_volume_id(&rec.volume_id) != dir_name {
            return Err(format!(
                "volume id '{}' does not match its directory",
                rec.volume_id
            ));
        }
        Ok(rec)
    }

    /// A new record in `CREATED`.
    pub fn new(volume_id: impl Into<String>, capability: Capability) -> Self {
        VolumeRecord {
            format: FORMAT_VERSION,
            volume_id: volume_id.into(),
            name: None,
            state: VolumeState::Created,
            capability,
            capacity_bytes: 0,
            parameters: SortedMap::new(),
            volume_context: SortedMap::new(),
            publish_context: SortedMap::new(),
            node_id: None,
            accessible_topology: Vec::new(),
            boot_id: None,
            readonly: false,
            users: SortedSet::new(),
            readers: SortedSet::new(),
            pre_provisioned: false,
            destroying: false,
            delete_imported: false,
            towards: None,
            profile: None,
            vendor: None,
            secrets_file: None,
            expansion: None,
            mount_group: None,
            content_source: None,
            mutable_parameters: SortedMap::new(),
            modifying: None,
            fenced: None,
        }
    }
}

/// Where a new volume's content comes from (CreateVolume's `volume_content_source`), as the
/// user named it and as the plugin knows it; recorded in the volume's record.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ContentSource {
    /// A snapshot.
    Snapshot {
        /// Its name.
        name: String,
        /// Its id in the plugin.
        snapshot_id: String,
    },
    /// Another volume (a clone).
    Volume {
        /// Its name (or id, when it has no name).
        name: String,
        /// Its id in the plugin.
        volume_id: String,
    },
}

/// A volume taken from this node while it was away, as its record keeps it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fence {
    /// The node it was taken from (this node's id, as ControllerPublish named it).
    pub node: String,
    /// Who fenced it, and why.
    pub why: String,
    /// Whether the controller no longer publishes it to this node (the detach's
    /// ControllerUnpublish is done, or the controller refused to publish it here).
    #[serde(default)]
    pub unpublished: bool,
    /// The containers that used it here when it was fenced: their use is lost.
    #[serde(default)]
    pub lost_users: std::collections::BTreeSet<String>,
    /// Whether this node has torn its side down since (its recovery did).
    #[serde(default)]
    pub torn_down: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use VolumeState::*;

    #[test]
    fn steps_chain_forward_and_backward() {
        let mut s = Created;
        let mut seen = vec![];
        while let Some(step) = s.next_step_towards(Published) {
            assert!(step.is_forward());
            assert_eq!(step.from(), s);
            seen.push(step.transient());
            s = step.to();
        }
        assert_eq!(seen, vec![ControllerPublish, NodeStage, NodePublish]);
        seen.clear();
        while let Some(step) = s.next_step_towards(Created) {
            assert!(!step.is_forward());
            assert_eq!(step.from(), s);
            seen.push(step.transient());
            s = step.to();
        }
        assert_eq!(seen, vec![NodeUnpublish, NodeUnstage, ControllerUnpublish]);
        assert_eq!(s, Created);
    }

    #[test]
    fn transient_states_name_their_step() {
        for st in [
            ControllerPublish,
            NodeStage,
            NodePublish,
            NodeUnpublish,
            NodeUnstage,
            ControllerUnpublish,
        ] {
            assert!(!st.is_steady());
            assert_eq!(st.pending_step().unwrap().transient(), st);
            assert!(st.next_step_towards(Published).is_none());
        }
        for st in [Created, NodeReady, VolReady, Published] {
            assert!(st.is_steady());
            assert!(st.pending_step().is_none());
        }
    }

    #[test]
    fn record_round_trips_with_screaming_states() {
        let mut r = VolumeRecord::new("vol-1", Capability::default());
        r.state = NodeStage;
        r.users.insert("c1".into());
        let json = serde_json::to_string(&r).unwrap();
        assert!(json.contains("\"NODE_STAGE\""), "{json}");
        let back: VolumeRecord = serde_json::from_str(&json).unwrap();
        assert_eq!(back, r);
    }

    /// The names on disk, spelled out once more on purpose: a change to
    /// [`VolumeState::as_str`] must fail here, since older checkpoints (and
    /// Mesos) use these.
    #[test]
    fn every_state_round_trips_under_its_unchanged_name() {
        let on_disk = [
            (Created, "CREATED"),
            (ControllerPublish, "CONTROLLER_PUBLISH"),
            (NodeReady, "NODE_READY"),
            (NodeStage, "NODE_STAGE"),
            (VolReady, "VOL_READY"),
            (NodePublish, "NODE_PUBLISH"),
            (Published, "PUBLISHED"),
            (NodeUnpublish, "NODE_UNPUBLISH"),
            (NodeUnstage, "NODE_UNSTAGE"),
            (ControllerUnpublish, "CONTROLLER_UNPUBLISH"),
        ];
        assert_eq!(VolumeState::ALL, on_disk.map(|(s, _)| s));
        for (state, name) in on_disk {
            // Exhaustive on purpose: a new state fails to compile here until it is listed above.
            match state {
                Created | ControllerPublish | NodeReady | NodeStage | VolReady | NodePublish
                | Published | NodeUnpublish | NodeUnstage | ControllerUnpublish => {}
            }
            assert_eq!(state.as_str(), name);
            assert_eq!(state.to_string(), name);
            assert_eq!(name.parse::<VolumeState>(), Ok(state));
            let json = serde_json::to_string(&state).unwrap();
            assert_eq!(json, format!("\"{name}\""));
            assert_eq!(serde_json::from_str::<VolumeState>(&json).unwrap(), state);
            let mut rec = VolumeRecord::new("v", Capability::default());
            rec.state = state;
            let value = serde_json::to_value(&rec).unwrap();
            assert_eq!(value["state"], name, "the record's state field");
        }
        for bad in ["node_ready", "NodeReady", "", "NODE_READY "] {
            assert!(bad.parse::<VolumeState>().is_err(), "{bad:?}");
            let err = serde_json::from_str::<VolumeState>(&format!("{bad:?}")).unwrap_err();
            assert!(err.to_string().contains("unknown volume state"), "{err}");
        }
    }

    #[test]
    fn reader_only_modes() {
        let mut c = Capability::default();
        assert!(!c.is_reader_only());
        c.access_mode = "MULTI_NODE_READER_ONLY".into();
        assert!(c.is_reader_only());
        c.access_mode = "BOGUS".into();
        assert!(c.mode().is_none());
    }

    #[test]
    fn access_mode_names_are_checked_in_one_place() {
        let names = Capability::access_mode_names();
        assert_eq!(names.first(), Some(&"SINGLE_NODE_WRITER"));
        assert!(names.contains(&"SINGLE_NODE_MULTI_WRITER"), "{names:?}");
        assert!(!names.contains(&"UNKNOWN"), "{names:?}");
        for name in &names {
            let mut c = Capability::default();
            c.set_access_mode(name).expect(name);
            assert_eq!(c.access_mode, *name);
        }
        // Refused, and the capability left as it was: not a CSI name, the spec's placeholder,
        // the proto's number, a lower-case name, empty, and a name with a control character.
        for bad in [
            "ANY",
            "UNKNOWN",
            "1",
            "single_node_writer",
            "",
            "X\u{1b}[2J",
        ] {
            let mut c = Capability::default();
            let err = c.set_access_mode(bad).expect_err(bad);
            assert_eq!(c, Capability::default(), "{bad:?}");
            let text = err.to_string();
            assert!(text.starts_with("unknown CSI access mode '"), "{text}");
            assert!(
                text.contains("expected one of SINGLE_NODE_WRITER, "),
                "{text}"
            );
            assert!(!text.contains('\u{1b}'), "shown escaped: {text}");
        }
    }

    #[test]
    fn fs_type_and_mount_flags_are_checked_in_one_place() {
        let flags = |names: &[&str]| names.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let mut c = Capability::default();
        c.set_mount("ext4", &flags(&["noatime", "vers=4.2"]))
            .unwrap();
        assert_eq!(c.fs_type, "ext4");
        assert_eq!(c.mount_flags, ["noatime", "vers=4.2"]);
        c.set_mount("", &[]).unwrap();
        assert_eq!(c, Capability::default());
        let too_many = vec!["noatime".to_string(); MAX_MOUNT_FLAGS + 1];
        let long = "x".repeat(MAX_MOUNT_FLAG_BYTES + 1);
        let long_type = "x".repeat(MAX_FS_TYPE_BYTES + 1);
        for (fs_type, bad, field, words) in [
            (
                long_type.as_str(),
                flags(&[]),
                "fs_type",
                "is not a filesystem type name",
            ),
            (
                "ext4 -o x",
                flags(&[]),
                "fs_type",
                "'ext4 -o x' is not a filesystem type name",
            ),
            (
                "../x",
                flags(&[]),
                "fs_type",
                "is not a filesystem type name",
            ),
            ("ext4", flags(&[""]), "mount_flags", "flag '' is empty"),
            ("ext4", flags(&["a\nb"]), "mount_flags", "flag 'a\\nb'"),
            ("ext4", vec![long], "mount_flags", "over 256 bytes"),
            (
                "ext4",
                too_many,
                "mount_flags",
                "65 flags, over the limit of 64",
            ),
        ] {
            let mut c = Capability::default();
            let err = c.set_mount(fs_type, &bad).unwrap_err();
            assert_eq!(err.field, field, "{err}");
            assert!(err.to_string().contains(words), "{err}");
            assert_eq!(c, Capability::default(), "left as it was");
        }
    }

    #[test]
    fn a_block_capability_has_no_fs_type_and_no_mount_flags() {
        let block = Capability {
            access_type: AccessType::Block,
            ..Capability::default()
        };
        let mut c = block.clone();
        c.set_mount("", &[]).unwrap();
        assert_eq!(c, block);
        let err = c.set_mount("ext4", &[]).unwrap_err();
        assert_eq!(err.field, "fs_type", "{err}");
        assert!(err.to_string().contains("has no filesystem"), "{err}");
        let err = c.set_mount("", &["noatime".to_string()]).unwrap_err();
        assert_eq!(err.field, "mount_flags", "{err}");
        assert!(err.to_string().contains("no mount flags"), "{err}");
        assert_eq!(c, block, "left as it was");
    }

    #[test]
    fn a_capability_is_described_for_people_escaped() {
        let mut c = Capability::default();
        assert_eq!(c.describe(), "SINGLE_NODE_WRITER");
        c.fs_type = "xfs".into();
        c.mount_flags = vec!["noatime".into(), "a\u{1b}b".into()];
        assert_eq!(
            c.describe(),
            "SINGLE_NODE_WRITER fs_type=xfs mount_flags=noatime,a\\u{1b}b"
        );
    }

    #[test]
    fn the_access_type_defaults_to_mount_and_block_is_checkpointed_and_sent() {
        use proto::volume_capability::AccessType as Wire;
        // A capability checkpointed before block volumes existed loads as mount.
        let old: Capability = serde_json::from_str(r#"{"access_mode":"SINGLE_NODE_WRITER"}"#)
            .expect("old capability");
        assert_eq!(old.access_type, AccessType::Mount);
        assert!(matches!(old.to_proto().access_type, Some(Wire::Mount(_))));
        let json = serde_json::to_string(&old).unwrap();
        assert!(!json.contains("access_type"), "mount is left out: {json}");

        let block = Capability {
            access_type: AccessType::Block,
            ..Capability::default()
        };
        let json = serde_json::to_string(&block).unwrap();
        assert!(json.contains(r#""access_type":"block""#), "{json}");
        assert_eq!(serde_json::from_str::<Capability>(&json).unwrap(), block);
        assert!(matches!(block.to_proto().access_type, Some(Wire::Block(_))));
        assert_eq!(block.describe(), "SINGLE_NODE_WRITER access_type=block");
        assert_ne!(block, old, "a create with another access type differs");
    }

    #[test]
    fn access_type_names() {
        for (name, want) in [
            ("", Some(AccessType::Mount)),
            ("mount", Some(AccessType::Mount)),
            ("block", Some(AccessType::Block)),
            ("Block", None),
            ("raw", None),
            ("\u{1b}", None),
        ] {
            let got = AccessType::parse(name);
            assert_eq!(got.as_ref().ok().copied(), want, "{name:?}");
            if let Err(e) = got {
                assert!(!e.to_string().contains('\u{1b}'), "{e}");
            }
        }
        assert_eq!(AccessType::Block.as_str(), "block");
    }
}
