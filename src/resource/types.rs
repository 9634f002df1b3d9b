//! serde types for `mesos.Resource` in the JSON mapping Mesos' HTTP API
//! writes: snake_case field names, enums as their names, unset optional and
//! empty repeated fields omitted, `shared` / `revocable` as empty objects.
//!
//! Round trip: every struct keeps the fields it does not model in a flattened
//! `extra` map, enums keep names they do not know, and scalar values keep
//! their JSON number as written (`1024` stays `1024`, `1024.0` stays
//! `1024.0`), so a resource Mesos wrote serializes back to an equal JSON
//! value.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Map, Number, Value};

use super::error::ResourceError;

/// Declares a protobuf enum as it appears in JSON: its name as a string.
/// Names this crate does not know are kept verbatim in `Other`, so they
/// survive a round trip and are refused only where they matter.
macro_rules! string_enum {
    (
        $(#[$meta:meta])*
        $name:ident { $( $(#[$vmeta:meta])* $variant:ident => $text:literal ),+ $(,)? }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash)]
        pub enum $name {
            $( $(#[$vmeta])* $variant, )+
            /// A name this crate does not know, kept as written.
            Other(String),
        }

        impl $name {
            /// The name as Mesos writes it.
            pub fn as_str(&self) -> &str {
                match self {
                    $( $name::$variant => $text, )+
                    $name::Other(s) => s,
                }
            }
        }

        impl From<&str> for $name {
            fn from(s: &str) -> Self {
                match s {
                    $( $text => $name::$variant, )+
                    other => $name::Other(other.to_owned()),
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.serialize_str(self.as_str())
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                let s = String::deserialize(deserializer)?;
                Ok($name::from(s.as_str()))
            }
        }
    };
}

string_enum! {
    /// `mesos.Value.Type`: the kind of value a resource carries.
    ValueType {
        /// A number (`scalar.value`).
        Scalar => "SCALAR",
        /// Integer ranges (`ranges.range[]`).
        Ranges => "RANGES",
        /// A set of strings (`set.item[]`).
        Set => "SET",
        /// Text (not used by resources in practice).
        Text => "TEXT",
    }
}

string_enum! {
    /// `mesos.Resource.ReservationInfo.Type`.
    ReservationType {
        /// Unset (`UNKNOWN = 0` in the protobuf).
        Unknown => "UNKNOWN",
        /// Made by the agent's `--resources` flag.
        Static => "STATIC",
        /// Made through the operator or framework API.
        Dynamic => "DYNAMIC",
    }
}

string_enum! {
    /// `mesos.Volume.Mode`.
    VolumeMode {
        /// Read-write.
        Rw => "RW",
        /// Read-only.
        Ro => "RO",
    }
}

string_enum! {
    /// `mesos.MountPropagation.Mode`.
    PropagationMode {
        /// Unset (`UNKNOWN = 0` in the protobuf): refused where used, never guessed.
        Unknown => "UNKNOWN",
        /// Host mounts under the volume reach the container (rslave).
        HostToContainer => "HOST_TO_CONTAINER",
        /// Both ways (rshared).
        Bidirectional => "BIDIRECTIONAL",
    }
}

string_enum! {
    /// `mesos.Resource.DiskInfo.Source.Type`.
    SourceType {
        /// Unset (`UNKNOWN = 0` in the protobuf); not resolvable.
        Unknown => "UNKNOWN",
        /// A directory on a shared filesystem; persistent volumes live inside it.
        Path => "PATH",
        /// A dedicated filesystem; the whole disk is one volume.
        Mount => "MOUNT",
        /// A block device; not mountable as a directory.
        Block => "BLOCK",
        /// Raw disk space; not mountable as a directory.
        Raw => "RAW",
    }
}

/// `mesos.Value.Scalar`: `{"value": 1.5}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Scalar {
    /// The value, kept as the JSON number it was written as.
    pub value: Number,
    /// Fields this crate does not model.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl Scalar {
    /// A scalar holding `value`; integral values are written as integers.
    /// A non-finite `value` (which Mesos refuses too) becomes 0.
    pub fn new(value: f64) -> Scalar {
        let number = if value.fract() == 0.0 && value >= 0.0 && value < u64::MAX as f64 {
            Number::from(value as u64)
        } else {
            Number::from_f64(value).unwrap_or_else(|| Number::from(0u64))
        };
        Scalar {
            value: number,
            extra: Map::new(),
        }
    }

    /// The value as a float.
    pub fn as_f64(&self) -> f64 {
        self.value.as_f64().unwrap_or(0.0)
    }
}

/// `mesos.Value.Range`: an inclusive integer range.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Range {
    /// First value.
    pub begin: u64,
    /// Last value (inclusive).
    pub end: u64,
    /// Fields this crate does not model.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// `mesos.Value.Ranges`: `{"range": [{"begin": 31000, "end": 32000}]}`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Ranges {
    /// The ranges.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub range: Vec<Range>,
    /// Fields this crate does not model.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// `mesos.Value.Set`: `{"item": ["a", "b"]}`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Set {
    /// The items.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub item: Vec<String>,
    /// Fields this crate does not model.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// `mesos.Label`: a key with an optional value.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Label {
    /// The key.
    pub key: String,
    /// The value, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    /// Fields this crate does not model.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl Label {
    /// A label `key=value`.
    pub fn new(key: impl Into<String>, value: impl Into<String>) -> Label {
        Label {
            key: key.into(),
            value: Some(value.into()),
            extra: Map::new(),
        }
    }
}

/// `mesos.Labels`: `{"labels": [{"key": "k", "value": "v"}]}`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Labels {
    /// The labels, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub labels: Vec<Label>,
    /// Fields this crate does not model.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl Labels {
    /// The value of the first label with `key`.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|l| l.key == key)
            .and_then(|l| l.value.as_deref())
    }
}

/// `mesos.Resource.ReservationInfo`: one step of a (possibly refined)
/// reservation; the last one is the resource's current role.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReservationInfo {
    /// `STATIC` or `DYNAMIC`.
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<ReservationType>,
    /// The role reserved for (`dev`, refined as `dev/team`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    /// The principal that made a dynamic reservation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub principal: Option<String>,
    /// Labels attached to the reservation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<Labels>,
    /// Fields this crate does not model (e.g. `resource_provider_id`).
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl ReservationInfo {
    /// A dynamic reservation for `role`, made by `principal` if given.
    pub fn dynamic(role: impl Into<String>, principal: Option<&str>) -> ReservationInfo {
        ReservationInfo {
            kind: Some(ReservationType::Dynamic),
            role: Some(role.into()),
            principal: principal.map(str::to_owned),
            labels: None,
            extra: Map::new(),
        }
    }

    /// A static reservation for `role`.
    pub fn static_for(role: impl Into<String>) -> ReservationInfo {
        ReservationInfo {
            kind: Some(ReservationType::Static),
            role: Some(role.into()),
            principal: None,
            labels: None,
            extra: Map::new(),
        }
    }
}

/// `mesos.ResourceProviderID`: `{"value": "..."}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResourceProviderId {
    /// The provider's id.
    pub value: String,
    /// Fields this crate does not model.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// `mesos.Resource.DiskInfo.Persistence`: makes a disk a persistent volume.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Persistence {
    /// The persistent volume's id, unique per role; a path component.
    pub id: String,
    /// The principal that created it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub principal: Option<String>,
    /// Fields this crate does not model.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// `mesos.Volume` as used in `DiskInfo`: where the volume appears in the
/// container and how.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Volume {
    /// The path inside the container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container_path: Option<String>,
    /// `RW` or `RO`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<VolumeMode>,
    /// How mount events flow between the host and the container (`mesos.MountPropagation`,
    /// placed here, beside the mode: absent means private).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mount_propagation: Option<MountPropagation>,
    /// Fields this crate does not model (`host_path`, `image`, `source`).
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// `mesos.MountPropagation`: `{"mode": "HOST_TO_CONTAINER"}`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct MountPropagation {
    /// The mode; absent means private.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<PropagationMode>,
    /// Fields this crate does not model.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// `mesos.Resource.DiskInfo.Source.Path` / `.Mount`: `{"root": "..."}`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct SourceRoot {
    /// The root directory; relative roots are relative to the agent work dir.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub root: Option<String>,
    /// Fields this crate does not model.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// `mesos.Resource.DiskInfo.Source`: where a disk's space comes from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DiskSource {
    /// `PATH`, `MOUNT`, `BLOCK` or `RAW`.
    #[serde(rename = "type")]
    pub kind: SourceType,
    /// The root of a `PATH` disk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<SourceRoot>,
    /// The root of a `MOUNT` disk, and of a `BLOCK` disk published by a CSI plugin (the
    /// directory holding each volume's `<enc id>/target`, a device file for a block volume).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mount: Option<SourceRoot>,
    /// The vendor of the CSI plugin that owns the volume.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vendor: Option<String>,
    /// The CSI volume id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// The CSI volume context, as labels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Labels>,
    /// The storage profile the volume was created with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<String>,
    /// Fields this crate does not model.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl DiskSource {
    /// The root field for this source's type: `mount` for `MOUNT` and `BLOCK`,
    /// `path` otherwise.
    pub fn root(&self) -> Option<&str> {
        let root = match self.kind {
            SourceType::Mount | SourceType::Block => self.mount.as_ref(),
            _ => self.path.as_ref(),
        };
        root.and_then(|r| r.root.as_deref())
    }
}

/// `mesos.Resource.DiskInfo`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct DiskInfo {
    /// Set on persistent volumes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persistence: Option<Persistence>,
    /// Where the volume appears in the container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume: Option<Volume>,
    /// Where the space comes from; absent for the agent's default disk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<DiskSource>,
    /// Fields this crate does not model.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// An empty message kept as an object (`shared: {}`, `revocable: {}`); its
/// presence is the information.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Marker {
    /// Fields this crate does not model.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// `mesos.Resource` in Mesos' JSON mapping.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Resource {
    /// The resource name: `cpus`, `mem`, `disk`, `ports`, ...
    pub name: String,
    /// The value type.
    #[serde(rename = "type")]
    pub kind: ValueType,
    /// The value of a `SCALAR` resource (MB for `disk` and `mem`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scalar: Option<Scalar>,
    /// The value of a `RANGES` resource.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ranges: Option<Ranges>,
    /// The value of a `SET` resource.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub set: Option<Set>,
    /// Deprecated pre-refinement role; Mesos writes `"*"` when unreserved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    /// The reservation stack, outermost first; the last is the current role.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reservations: Vec<ReservationInfo>,
    /// Disk details (only on `disk` resources).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk: Option<DiskInfo>,
    /// Present if the resource is revocable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revocable: Option<Marker>,
    /// Present (`{}`) if the resource is shared.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shared: Option<Marker>,
    /// The resource provider that owns the resource.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider_id: Option<ResourceProviderId>,
    /// Fields this crate does not model (`allocation_info`, `reservation`, ...).
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// Bytes in a Mesos megabyte (Mesos' `Bytes::MEGABYTES`, a mebibyte).
pub const BYTES_PER_MB: u64 = 1024 * 1024;

/// Parses a JSON list of resources, as `run --resources FILE` takes and as
/// Mesos writes them.
/// The list has no spare capacity: a container's resources live as long as the container (in
/// the isolator's record), and a `Resource` is large (the growth of a parsed list left room for
/// three more, about 2.5 KiB per container at 10,000 containers).
pub fn parse_resources(json: &str) -> Result<Vec<Resource>, ResourceError> {
    let mut resources: Vec<Resource> =
        serde_json::from_str(json).map_err(|source| ResourceError::Parse { source })?;
    resources.shrink_to_fit();
    Ok(resources)
}

impl Resource {
    /// A scalar resource (`cpus`, `mem`, `disk`) with no reservation.
    pub fn scalar(name: impl Into<String>, value: f64) -> Resource {
        Resource {
            name: name.into(),
            kind: ValueType::Scalar,
            scalar: Some(Scalar::new(value)),
            ranges: None,
            set: None,
            role: None,
            reservations: Vec::new(),
            disk: None,
            revocable: None,
            shared: None,
            provider_id: None,
            extra: Map::new(),
        }
    }

    /// The resource of a volume created through a CSI plugin: a `disk` of
    /// `size_mb` MB owned by `provider_id`, with `disk.source` of type
    /// `MOUNT`, `id` = `volume_id`, `mount.root` = `root` (normally the
    /// relative `./csi/<type>/<name>/mounts`), and the CSI volume context as
    /// `metadata` labels, sorted by key so the JSON is deterministic.
    pub fn csi_volume<K, V>(
        provider_id: &str,
        volume_id: &str,
        root: &str,
        size_mb: u64,
        profile: Option<&str>,
        vendor: Option<&str>,
        metadata: impl IntoIterator<Item = (K, V)>,
    ) -> Resource
    where
        K: Into<String>,
        V: Into<String>,
    {
        let mut labels: Vec<Label> = metadata
            .into_iter()
            .map(|(k, v)| Label::new(k, v))
            .collect();
        labels.sort_by(|a, b| a.key.cmp(&b.key).then_with(|| a.value.cmp(&b.value)));
        let source = DiskSource {
            kind: SourceType::Mount,
            path: None,
            mount: Some(SourceRoot {
                root: Some(root.to_owned()),
                extra: Map::new(),
            }),
            vendor: vendor.map(str::to_owned),
            id: Some(volume_id.to_owned()),
            metadata: (!labels.is_empty()).then_some(Labels {
                labels,
                extra: Map::new(),
            }),
            profile: profile.map(str::to_owned),
            extra: Map::new(),
        };
        let mut resource = Resource::scalar("disk", size_mb as f64);
        resource.provider_id = Some(ResourceProviderId {
            value: provider_id.to_owned(),
            extra: Map::new(),
        });
        resource.disk = Some(DiskInfo {
            source: Some(source),
            ..DiskInfo::default()
        });
        resource
    }

    /// Adds `reservation` on top of the reservation stack (a refinement if
    /// there already is one).
    pub fn with_reservation(mut self, reservation: ReservationInfo) -> Resource {
        self.reservations.push(reservation);
        self
    }

    /// Makes the disk a persistent volume with `id`, created by `principal`.
    pub fn with_persistence(mut self, id: &str, principal: Option<&str>) -> Resource {
        self.disk.get_or_insert_with(DiskInfo::default).persistence = Some(Persistence {
            id: id.to_owned(),
            principal: principal.map(str::to_owned),
            extra: Map::new(),
        });
        self
    }

    /// Sets where the volume appears in the container and in which mode.
    pub fn with_volume(mut self, container_path: &str, mode: VolumeMode) -> Resource {
        self.disk.get_or_insert_with(DiskInfo::default).volume = Some(Volume {
            container_path: Some(container_path.to_owned()),
            mode: Some(mode),
            mount_propagation: None,
            extra: Map::new(),
        });
        self
    }

    /// Sets `disk.volume.mount_propagation.mode` (the volume must have been given with
    /// [`with_volume`](Self::with_volume) first; otherwise it gets an empty `disk.volume`).
    pub fn with_mount_propagation(mut self, mode: PropagationMode) -> Resource {
        let disk = self.disk.get_or_insert_with(DiskInfo::default);
        let volume = disk.volume.get_or_insert_with(|| Volume {
            container_path: None,
            mode: None,
            mount_propagation: None,
            extra: Map::new(),
        });
        volume.mount_propagation = Some(MountPropagation {
            mode: Some(mode),
            extra: Map::new(),
        });
        self
    }

    /// `disk.volume.mount_propagation.mode`: `None` when absent (private). A mode this crate does
    /// not know, or `UNKNOWN`, is refused naming the resource, never taken for one it knows.
    pub fn mount_propagation(&self) -> Result<Option<PropagationMode>, ResourceError> {
        let mode = self
            .disk
            .as_ref()
            .and_then(|d| d.volume.as_ref())
            .and_then(|v| v.mount_propagation.as_ref())
            .and_then(|p| p.mode.as_ref());
        match mode {
            None => Ok(None),
            Some(m @ (PropagationMode::HostToContainer | PropagationMode::Bidirectional)) => {
                Ok(Some(m.clone()))
            }
            Some(other) => Err(ResourceError::InvalidField {
                resource: self.describe(),
                field: "disk.volume.mount_propagation.mode".to_owned(),
                value: other.as_str().to_owned(),
                reason: "unknown mount propagation (expected HOST_TO_CONTAINER or BIDIRECTIONAL; leave it out for private)".to_owned(),
            }),
        }
    }

    /// Marks the resource shared (`shared: {}`).
    pub fn with_shared(mut self) -> Resource {
        self.shared = Some(Marker::default());
        self
    }

    /// Whether this is a `disk` resource.
    pub fn is_disk(&self) -> bool {
        self.name == "disk"
    }

    /// Whether the resource is shared.
    pub fn is_shared(&self) -> bool {
        self.shared.is_some()
    }

    /// Whether the resource is revocable.
    pub fn is_revocable(&self) -> bool {
        self.revocable.is_some()
    }

    /// The current role: the last reservation's role, else the deprecated
    /// `role`, else `*` (unreserved).
    pub fn role(&self) -> &str {
        self.role_with_field().0
    }

    /// The current role and the JSON path of the field it came from
    /// (`reservations[N].role`, `role`, or none for the default `*`).
    pub(crate) fn role_with_field(&self) -> (&str, Option<String>) {
        if let Some((i, role)) = self
            .reservations
            .iter()
            .enumerate()
            .rev()
            .find_map(|(i, r)| r.role.as_deref().map(|role| (i, role)))
        {
            return (role, Some(format!("reservations[{i}].role")));
        }
        match self.role.as_deref() {
            Some(role) => (role, Some("role".to_owned())),
            None => ("*", None),
        }
    }

    /// Whether the volume is mounted read-only: `disk.volume.mode` is `RO`,
    /// or a mode this crate does not know (never taken for read-write; see
    /// [`Resource::check_volume_mode`], which refuses it). No mode is `RW`.
    pub fn read_only(&self) -> bool {
        matches!(
            self.disk
                .as_ref()
                .and_then(|d| d.volume.as_ref())
                .and_then(|v| v.mode.as_ref()),
            Some(VolumeMode::Ro | VolumeMode::Other(_))
        )
    }

    /// Fails on a `disk.volume.mode` other than `RW` or `RO` (kept by
    /// parsing so the JSON round-trips, but not usable for a mount).
    pub fn check_volume_mode(&self) -> Result<(), ResourceError> {
        let mode = self
            .disk
            .as_ref()
            .and_then(|d| d.volume.as_ref())
            .and_then(|v| v.mode.as_ref());
        match mode {
            Some(VolumeMode::Other(other)) => Err(ResourceError::InvalidField {
                resource: self.describe(),
                field: "disk.volume.mode".to_owned(),
                value: other.clone(),
                reason: "unknown volume mode (expected RW or RO)".to_owned(),
            }),
            _ => Ok(()),
        }
    }

    /// The id of the resource provider that owns the resource.
    pub fn provider_id(&self) -> Option<&str> {
        self.provider_id.as_ref().map(|p| p.value.as_str())
    }

    /// The disk source, if any.
    pub fn disk_source(&self) -> Option<&DiskSource> {
        self.disk.as_ref().and_then(|d| d.source.as_ref())
    }

    /// The CSI volume id (`disk.source.id`).
    pub fn source_id(&self) -> Option<&str> {
        self.disk_source().and_then(|s| s.id.as_deref())
    }

    /// The persistent volume id (`disk.persistence.id`).
    pub fn persistence_id(&self) -> Option<&str> {
        self.disk
            .as_ref()
            .and_then(|d| d.persistence.as_ref())
            .map(|p| p.id.as_str())
    }

    /// The path inside the container (`disk.volume.container_path`).
    pub fn container_path(&self) -> Option<&str> {
        self.disk
            .as_ref()
            .and_then(|d| d.volume.as_ref())
            .and_then(|v| v.container_path.as_deref())
    }

    /// The size of a disk in bytes: the scalar is in MB (MiB) in Mesos.
    /// `None` for non-disk resources, a missing scalar, or a negative or
    /// non-finite value.
    pub fn size_bytes(&self) -> Option<u64> {
        if !self.is_disk() {
            return None;
        }
        let mb = self.scalar.as_ref()?.as_f64();
        if !mb.is_finite() || mb < 0.0 {
            return None;
        }
        // Mesos scalars carry three decimal digits, so round rather than
        // truncate the product.
        Some((mb * BYTES_PER_MB as f64).round() as u64)
    }

    /// A short description for messages: the name, then the source id and
    /// the persistence id where set, debug-escaped. The name is written bare
    /// when escaping would not change it (`disk`), else escaped and quoted,
    /// so a newline in it cannot forge a log line.
    pub fn describe(&self) -> String {
        let quoted = format!("{:?}", self.name);
        let mut out = if quoted[1..quoted.len() - 1] == self.name {
            self.name.clone()
        } else {
            quoted
        };
        if let Some(id) = self.source_id() {
            out.push_str(&format!(" (id {id:?})"));
        }
        if let Some(id) = self.persistence_id() {
            out.push_str(&format!(" (persistence id {id:?})"));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error_chain::FullMessage;
    use serde_json::json;

    #[test]
    fn parsed_resources_keep_no_spare_capacity() {
        let one = r#"[{"name": "disk", "type": "SCALAR", "scalar": {"value": 1}}]"#;
        let three = r#"[{"name": "cpus", "type": "SCALAR", "scalar": {"value": 1}},
            {"name": "mem", "type": "SCALAR", "scalar": {"value": 2}},
            {"name": "disk", "type": "SCALAR", "scalar": {"value": 3}}]"#;
        for (json, len) in [(one, 1), ("[]", 0), (three, 3)] {
            let parsed = parse_resources(json).unwrap();
            assert_eq!(parsed.len(), len, "{json}");
            assert_eq!(parsed.capacity(), len, "{json}");
        }
    }

    #[test]
    fn role_precedence() {
        let cases: &[(Value, &str)] = &[
            (json!({"name": "cpus", "type": "SCALAR"}), "*"),
            (
                json!({"name": "cpus", "type": "SCALAR", "role": "web"}),
                "web",
            ),
            (
                json!({"name": "cpus", "type": "SCALAR", "role": "*",
                       "reservations": [{"type": "STATIC", "role": "dev"},
                                        {"type": "DYNAMIC", "role": "dev/team"}]}),
                "dev/team",
            ),
            (
                json!({"name": "cpus", "type": "SCALAR", "role": "web",
                       "reservations": [{"type": "DYNAMIC", "role": "dev"}, {"type": "DYNAMIC"}]}),
                "dev",
            ),
        ];
        for (json, want) in cases {
            let r: Resource = serde_json::from_value(json.clone()).unwrap();
            assert_eq!(r.role(), *want, "{json}");
        }
    }

    #[test]
    fn size_bytes_cases() {
        let cases: &[(Value, Option<u64>)] = &[
            (
                json!({"name": "disk", "type": "SCALAR", "scalar": {"value": 1}}),
                Some(1 << 20),
            ),
            (
                json!({"name": "disk", "type": "SCALAR", "scalar": {"value": 1024.0}}),
                Some(1 << 30),
            ),
            (
                json!({"name": "disk", "type": "SCALAR", "scalar": {"value": 0.5}}),
                Some(1 << 19),
            ),
            (
                json!({"name": "disk", "type": "SCALAR", "scalar": {"value": -1}}),
                None,
            ),
            (json!({"name": "disk", "type": "SCALAR"}), None),
            (
                json!({"name": "mem", "type": "SCALAR", "scalar": {"value": 1}}),
                None,
            ),
        ];
        for (json, want) in cases {
            let r: Resource = serde_json::from_value(json.clone()).unwrap();
            assert_eq!(r.size_bytes(), *want, "{json}");
        }
    }

    #[test]
    fn unknown_enum_names_survive() {
        let json = json!({"name": "disk", "type": "FANCY",
                          "disk": {"source": {"type": "TAPE"}, "volume": {"mode": "WO"}}});
        let r: Resource = serde_json::from_value(json.clone()).unwrap();
        assert_eq!(r.kind, ValueType::Other("FANCY".into()));
        assert_eq!(
            r.disk_source().unwrap().kind,
            SourceType::Other("TAPE".into())
        );
        // An unknown mode is never read-write, and refused where used.
        assert!(r.read_only());
        let err = r.check_volume_mode().unwrap_err().full_message();
        assert!(
            err.contains("disk.volume.mode") && err.contains("\"WO\""),
            "{err}"
        );
        assert_eq!(serde_json::to_value(&r).unwrap(), json);
    }

    #[test]
    fn scalar_new_keeps_integers_integral() {
        assert_eq!(
            serde_json::to_value(Scalar::new(2.0)).unwrap(),
            json!({"value": 2})
        );
        assert_eq!(
            serde_json::to_value(Scalar::new(0.25)).unwrap(),
            json!({"value": 0.25})
        );
        assert_eq!(
            serde_json::to_value(Scalar::new(f64::NAN)).unwrap(),
            json!({"value": 0})
        );
    }

    #[test]
    fn csi_volume_builder_shape() {
        let mut ctx = std::collections::HashMap::new();
        ctx.insert("zone".to_owned(), "b".to_owned());
        ctx.insert("fs".to_owned(), "ext4".to_owned());
        let r = Resource::csi_volume(
            "prov-1",
            "vol/1",
            "./csi/org.test/default/mounts",
            64,
            Some("fast"),
            Some("org.test"),
            &ctx,
        )
        .with_reservation(ReservationInfo::dynamic("dev", Some("ops")))
        .with_persistence("pv1", None)
        .with_volume("data", VolumeMode::Ro);
        let want = json!({
            "name": "disk", "type": "SCALAR", "scalar": {"value": 64},
            "reservations": [{"type": "DYNAMIC", "role": "dev", "principal": "ops"}],
            "provider_id": {"value": "prov-1"},
            "disk": {
                "persistence": {"id": "pv1"},
                "volume": {"container_path": "data", "mode": "RO"},
                "source": {
                    "type": "MOUNT", "id": "vol/1", "profile": "fast", "vendor": "org.test",
                    "mount": {"root": "./csi/org.test/default/mounts"},
                    "metadata": {"labels": [{"key": "fs", "value": "ext4"},
                                            {"key": "zone", "value": "b"}]}
                }
            }
        });
        assert_eq!(serde_json::to_value(&r).unwrap(), want);
        assert_eq!(r.size_bytes(), Some(64 << 20));
        assert!(r.read_only());
        assert_eq!(r.role(), "dev");
        assert_eq!(r.provider_id(), Some("prov-1"));
        assert_eq!(r.source_id(), Some("vol/1"));
        assert_eq!(r.container_path(), Some("data"));
        assert_eq!(r.describe(), r#"disk (id "vol/1") (persistence id "pv1")"#);
    }

    #[test]
    fn describe_escapes_hostile_names() {
        let mut r = Resource::scalar("cpus\nERROR forged", 1.0);
        assert_eq!(r.describe(), r#""cpus\nERROR forged""#);
        r.name = "a\"b".into();
        assert_eq!(r.describe(), r#""a\"b""#);
        r.name = "disk".into();
        assert_eq!(r.describe(), "disk");
    }

    #[test]
    fn parse_error_is_reported() {
        let err = parse_resources(r#"[{"name": "disk"}]"#).unwrap_err();
        assert!(matches!(err, ResourceError::Parse { .. }));
        assert!(
            err.full_message()
                .starts_with("parse resources json: missing field `type`"),
            "{err}"
        );
    }
}
