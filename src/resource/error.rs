//! Errors of the resource model: parsing resource JSON, validating ids that
//! become path components, and resolving a resource to its host mount point.
//!
//! Every variant that concerns a resource names it (see
//! [`Resource::describe`](super::Resource::describe)) and the field at fault,
//! written as its JSON path (`disk.source.mount.root`, `reservations[1].role`).
//! Untrusted values are printed with Rust's debug escaping, so a newline or a
//! NUL in an id cannot forge a log line.

use std::path::PathBuf;

/// Errors from the resource model and its mount-point rules.
#[derive(Debug, thiserror::Error)]
pub enum ResourceError {
    /// The resources JSON could not be parsed.
    #[error("parse resources json")]
    Parse {
        /// The JSON error, with line and column.
        #[source]
        source: serde_json::Error,
    },

    /// An id that becomes a path component is not a safe single component.
    #[error("invalid {field} {value:?}: {reason}")]
    InvalidPathComponent {
        /// What the value is (e.g. `container id`, `disk.persistence.id`).
        field: String,
        /// The offending value.
        value: String,
        /// Why it was refused.
        reason: &'static str,
    },

    /// The agent work directory given to the resolver is unusable.
    #[error("invalid work dir {path:?}: {reason}")]
    InvalidWorkDir {
        /// The work directory.
        path: PathBuf,
        /// Why it was refused.
        reason: &'static str,
    },

    /// The resource is not a disk, so it has no mount point.
    #[error("resource {resource}: field name: not a disk resource, no mount point")]
    NotADisk {
        /// The resource (name and ids).
        resource: String,
    },

    /// A field needed to resolve the mount point is absent (or empty).
    #[error("resource {resource}: missing field {field}")]
    MissingField {
        /// The resource (name and ids).
        resource: String,
        /// The JSON path of the missing field.
        field: &'static str,
    },

    /// A field holds a value that cannot be used safely.
    #[error("resource {resource}: invalid field {field} {value:?}: {reason}")]
    InvalidField {
        /// The resource (name and ids).
        resource: String,
        /// The JSON path of the field.
        field: String,
        /// The offending value.
        value: String,
        /// Why it was refused.
        reason: String,
    },

    /// `disk.source.type` is not one of the known types.
    #[error("resource {resource}: field disk.source.type: unknown source type {value:?}")]
    UnknownSourceType {
        /// The resource (name and ids).
        resource: String,
        /// The unknown type as written.
        value: String,
    },

    /// The disk source is a block device or raw disk, which has no directory
    /// to bind-mount.
    #[error(
        "resource {resource}: field disk.source.type: {source_type} disk is not mountable as a directory"
    )]
    NotMountable {
        /// The resource (name and ids).
        resource: String,
        /// `BLOCK` or `RAW`.
        source_type: String,
    },

    /// The resolved path is not beneath the root it was derived from.
    #[error(
        "resource {resource}: field {field}: resolved path {path:?} escapes its root {root:?}"
    )]
    EscapesRoot {
        /// The resource (name and ids).
        resource: String,
        /// The field whose value led outside the root.
        field: &'static str,
        /// The resolved path.
        path: PathBuf,
        /// The root it must stay beneath.
        root: PathBuf,
    },
}

impl ResourceError {
    /// The JSON path of the field at fault, if the error concerns one.
    ///
    /// [`ResourceError::NotADisk`] names `name`, the two source-type errors
    /// name `disk.source.type`, [`ResourceError::InvalidWorkDir`] names
    /// `work_dir` and [`ResourceError::Parse`] names none.
    pub fn field(&self) -> Option<&str> {
        match self {
            ResourceError::Parse { .. } => None,
            ResourceError::InvalidPathComponent { field, .. } => Some(field),
            ResourceError::InvalidWorkDir { .. } => Some("work_dir"),
            ResourceError::NotADisk { .. } => Some("name"),
            ResourceError::MissingField { field, .. } => Some(field),
            ResourceError::InvalidField { field, .. } => Some(field),
            ResourceError::UnknownSourceType { .. } | ResourceError::NotMountable { .. } => {
                Some("disk.source.type")
            }
            ResourceError::EscapesRoot { field, .. } => Some(field),
        }
    }
}
