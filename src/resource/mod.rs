//! The Mesos `Resource` model and its mount-point rules.
//!
//! Contract:
//! - [`Resource`] and its parts deserialize `mesos.Resource` as Mesos' HTTP
//!   API writes it (snake_case JSON) and serialize back to an equal JSON
//!   value: fields and enum names this crate does not model are kept.
//! - [`encode_volume_id`] turns a plugin's volume id into one path component
//!   that cannot traverse (`/`, `..`, NUL are encoded), bounded in length and
//!   unique; [`validate_path_component`] refuses ids the CO puts in paths
//!   verbatim unless they are one safe component.
//! - [`resolve_host_path`] maps a disk resource to the host directory to
//!   bind-mount, by the rules of Mesos (relative roots joined to the
//!   resolving agent's work dir, `<root>/<enc id>/target` for CSI volumes,
//!   `volumes/roles/<role>/<persistence id>` for PATH and default disks). The
//!   result always lies beneath its root; anything else is a
//!   [`ResourceError`] naming the resource and the field.
//! - [`Layout`] is the provider's layout under the work dir
//!   (`csi/<type>/<name>/{volumes,mounts,creating,plugin}`), Mesos' names,
//!   spelled in one place; the resolver uses its `<enc id>/target` rule.
//! - [`VolumeArg`] is the `NAME:SIZE:CONTAINER_PATH[:ro]` volume syntax of `run` and the OCI hook, and
//!   [`parse_size`] the byte sizes it and the CLI take (`64M`, `1G`).
//!
//! Nothing here touches the file system.

mod encode;
mod error;
mod layout;
mod path;
mod types;
mod volume_arg;

pub use encode::{
    decode_volume_id, encode_volume_id, validate_container_id, validate_path_component,
    MAX_COMPONENT_LEN, MAX_ENCODED_LEN,
};
pub use error::ResourceError;
pub use layout::{Layout, CSI_DIR, MAX_SOCKET_PATH, SHORT_SOCKET_DIR, SNAPSHOT_FILE, STATE_FILE};
pub use path::resolve_host_path;
pub use types::{
    parse_resources, DiskInfo, DiskSource, Label, Labels, Marker, MountPropagation, Persistence,
    PropagationMode, Range, Ranges, ReservationInfo, ReservationType, Resource, ResourceProviderId,
    Scalar, Set, SourceRoot, SourceType, ValueType, Volume, VolumeMode, BYTES_PER_MB,
};
pub use volume_arg::{parse_size, VolumeArg};

impl Resource {
    /// The host path to bind-mount for this disk resource; see
    /// [`resolve_host_path`].
    pub fn host_path(
        &self,
        work_dir: &std::path::Path,
    ) -> Result<std::path::PathBuf, ResourceError> {
        resolve_host_path(self, work_dir)
    }
}
