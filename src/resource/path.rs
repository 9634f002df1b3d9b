//! Resolving a disk resource to its host mount point (Mesos' conventions);
//! the per-plugin layout under the work dir is [`super::Layout`].
//!
//! Rules ([`resolve_host_path`]):
//! - The root is `disk.source.mount.root` for `MOUNT` disks and
//!   `disk.source.path.root` for `PATH` disks. An absolute root is used as
//!   is; a relative one (`./csi/<type>/<name>/mounts`) is joined to the work
//!   dir of the agent that resolves it. `.` components are dropped; a root
//!   holding `..` or NUL is refused, since the result is checked lexically.
//! - With `disk.source.id` set, the volume's mount point is
//!   `<root>/<encoded id>/target` (the rule of [`super::Layout::target_path`],
//!   under any root); without it, the root itself (a disk the operator
//!   prepared).
//! - `MOUNT`: the mount point. `PATH`: the persistent volume inside it,
//!   `<mount point>/volumes/roles/<role>/<persistence id>`. No source:
//!   `<work dir>/volumes/roles/<role>/<persistence id>`. The role is written
//!   with `/` as ` ` (refined roles); it and the persistence id are validated,
//!   not encoded, so the paths stay the ones Mesos uses.
//! - `BLOCK` with `disk.source.id` (a CSI block volume): its device file,
//!   `<mount.root>/<encoded id>/target`, resolved like a `MOUNT` disk's.
//! - `BLOCK` without an id and `RAW` disks, unknown source types and non-disk
//!   resources have no mount point.
//! - The result is checked to lie beneath its root (or to be the root).
//!
//! Everything here is lexical: no file system access, so a symlink planted
//! under a root is the business of whoever opens the path (by fd).

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use super::encode::{validate_path_component, MAX_COMPONENT_LEN};
use super::error::ResourceError;
use super::layout::target_under;
use super::types::{Resource, SourceType};

/// Resolves a disk resource to the host path to bind-mount into the
/// container, following the module's rules. `work_dir` is the resolving
/// agent's work dir and must be absolute and free of `..`.
pub fn resolve_host_path(resource: &Resource, work_dir: &Path) -> Result<PathBuf, ResourceError> {
    let work_dir = check_work_dir(work_dir)?;
    if !resource.is_disk() {
        return Err(ResourceError::NotADisk {
            resource: resource.describe(),
        });
    }
    let Some(source) = resource.disk_source() else {
        // The agent's default disk: persistent volumes live in the work dir.
        let roles = work_dir.join("volumes").join("roles");
        let path = roles.join(persistent_volume_rel(resource)?);
        return beneath(resource, "disk.persistence.id", path, &roles);
    };

    let root_field = match source.kind {
        SourceType::Mount => "disk.source.mount.root",
        SourceType::Path => "disk.source.path.root",
        // A CSI block volume: its device file, published at `<mount.root>/<enc id>/target`.
        SourceType::Block if source.id.is_some() => "disk.source.mount.root",
        SourceType::Block | SourceType::Raw => {
            return Err(ResourceError::NotMountable {
                resource: resource.describe(),
                source_type: source.kind.to_string(),
            })
        }
        SourceType::Unknown | SourceType::Other(_) => {
            return Err(ResourceError::UnknownSourceType {
                resource: resource.describe(),
                value: source.kind.to_string(),
            })
        }
    };
    let root = match source.root() {
        Some(root) if !root.is_empty() => root,
        _ => {
            return Err(ResourceError::MissingField {
                resource: resource.describe(),
                field: root_field,
            })
        }
    };
    let root = resolve_root(resource, root_field, root, &work_dir)?;

    let mount_point = match source.id.as_deref() {
        Some("") => {
            return Err(invalid(resource, "disk.source.id", "", "is empty"));
        }
        Some(id) => target_under(&root, id),
        None => root.clone(),
    };
    let mount_point = beneath(resource, "disk.source.id", mount_point, &root)?;

    match source.kind {
        SourceType::Path => {
            let path = mount_point
                .join("volumes")
                .join("roles")
                .join(persistent_volume_rel(resource)?);
            beneath(resource, "disk.persistence.id", path, &root)
        }
        _ => Ok(mount_point),
    }
}

/// Checks a role the way Mesos does and writes it as one path component,
/// `/` replaced by ` `. `*` (unreserved) is refused: Mesos only keeps
/// persistent volumes of reserved resources.
fn role_path_component(role: &str) -> Result<String, &'static str> {
    if role == "*" {
        return Err("a persistent volume must be reserved for a role, not \"*\"");
    }
    if role.is_empty() {
        return Err("is empty");
    }
    if role.starts_with('/') || role.ends_with('/') || role.contains("//") {
        return Err("has an empty '/' separated component");
    }
    for component in role.split('/') {
        match component {
            "." | ".." => return Err("has a '.' or '..' component"),
            "*" => return Err("has a '*' component"),
            _ => {}
        }
        if component.starts_with('-') {
            return Err("has a component starting with '-'");
        }
        if component
            .chars()
            .any(|c| c.is_control() || c.is_whitespace())
        {
            return Err("contains whitespace or a control character");
        }
    }
    if role.len() > MAX_COMPONENT_LEN {
        return Err("is longer than 255 bytes");
    }
    Ok(role.replace('/', " "))
}

/// `<role>/<persistence id>`, both validated.
fn persistent_volume_rel(resource: &Resource) -> Result<PathBuf, ResourceError> {
    let (role, role_field) = resource.role_with_field();
    let role = role_path_component(role).map_err(|reason| ResourceError::InvalidField {
        resource: resource.describe(),
        field: role_field.unwrap_or_else(|| "role".to_owned()),
        value: role.to_owned(),
        reason: reason.to_owned(),
    })?;
    let Some(id) = resource.persistence_id() else {
        return Err(ResourceError::MissingField {
            resource: resource.describe(),
            field: "disk.persistence.id",
        });
    };
    validate_path_component("disk.persistence.id", id).map_err(|err| match err {
        ResourceError::InvalidPathComponent { reason, .. } => {
            invalid(resource, "disk.persistence.id", id, reason)
        }
        other => other,
    })?;
    Ok(Path::new(&role).join(id))
}

fn invalid(resource: &Resource, field: &str, value: &str, reason: &str) -> ResourceError {
    ResourceError::InvalidField {
        resource: resource.describe(),
        field: field.to_owned(),
        value: value.to_owned(),
        reason: reason.to_owned(),
    }
}

fn check_work_dir(work_dir: &Path) -> Result<PathBuf, ResourceError> {
    let reason = if !work_dir.is_absolute() {
        Some("is not absolute")
    } else if work_dir.as_os_str().as_bytes().contains(&0) {
        Some("contains NUL")
    } else if work_dir.components().any(|c| c == Component::ParentDir) {
        Some("contains a '..' component")
    } else {
        None
    };
    match reason {
        Some(reason) => Err(ResourceError::InvalidWorkDir {
            path: work_dir.to_owned(),
            reason,
        }),
        None => Ok(work_dir.components().collect()),
    }
}

/// An absolute root as is, a relative one joined to the work dir; `.`
/// components and doubled slashes dropped.
fn resolve_root(
    resource: &Resource,
    field: &'static str,
    root: &str,
    work_dir: &Path,
) -> Result<PathBuf, ResourceError> {
    if root.contains('\0') {
        return Err(invalid(resource, field, root, "contains NUL"));
    }
    let root_path = Path::new(root);
    if root_path.components().any(|c| c == Component::ParentDir) {
        return Err(invalid(resource, field, root, "contains a '..' component"));
    }
    let mut out = if root_path.is_absolute() {
        PathBuf::new()
    } else {
        work_dir.to_owned()
    };
    for component in root_path.components() {
        if component != Component::CurDir {
            out.push(component.as_os_str());
        }
    }
    Ok(out)
}

/// Lexical normalization: drops `.`, resolves `..` against what precedes it.
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for component in path.components() {
        match component {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other.as_os_str()),
        }
    }
    out
}

/// Returns `path` normalized if it lies beneath `root` (or is `root`).
fn beneath(
    resource: &Resource,
    field: &'static str,
    path: PathBuf,
    root: &Path,
) -> Result<PathBuf, ResourceError> {
    let normalized = normalize(&path);
    let root = normalize(root);
    let has_nul = normalized.as_os_str().as_bytes().contains(&0);
    if has_nul || !normalized.starts_with(&root) || normalized.as_os_str() == OsStr::new("") {
        return Err(ResourceError::EscapesRoot {
            resource: resource.describe(),
            field,
            path,
            root,
        });
    }
    Ok(normalized)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn disk(source: Value) -> Resource {
        serde_json::from_value(json!({
            "name": "disk", "type": "SCALAR", "scalar": {"value": 10},
            "reservations": [{"type": "DYNAMIC", "role": "dev/team"}],
            "disk": {"persistence": {"id": "pv"}, "source": source}
        }))
        .unwrap()
    }

    #[test]
    fn resolution_table() {
        let wd = Path::new("/var/lib/agent");
        let cases: &[(Value, Result<&str, &str>)] = &[
            (
                json!({"type": "MOUNT", "mount": {"root": "/mnt/d1"}}),
                Ok("/mnt/d1"),
            ),
            (
                json!({"type": "MOUNT", "mount": {"root": "/mnt//d1/./"}}),
                Ok("/mnt/d1"),
            ),
            (
                json!({"type": "MOUNT", "id": "v", "mount": {"root": "./csi/t/n/mounts"}}),
                Ok("/var/lib/agent/csi/t/n/mounts/v/target"),
            ),
            (
                json!({"type": "MOUNT", "id": "v", "mount": {"root": "csi/t/n/mounts"}}),
                Ok("/var/lib/agent/csi/t/n/mounts/v/target"),
            ),
            (
                json!({"type": "PATH", "path": {"root": "/srv/p"}}),
                Ok("/srv/p/volumes/roles/dev team/pv"),
            ),
            (
                json!({"type": "PATH", "id": "..", "path": {"root": "/srv/p"}}),
                Ok("/srv/p/%2E%2E/target/volumes/roles/dev team/pv"),
            ),
            (json!({"type": "MOUNT"}), Err("disk.source.mount.root")),
            (
                json!({"type": "MOUNT", "mount": {"root": ""}}),
                Err("disk.source.mount.root"),
            ),
            (
                json!({"type": "MOUNT", "path": {"root": "/x"}}),
                Err("disk.source.mount.root"),
            ),
            (
                json!({"type": "PATH", "mount": {"root": "/x"}}),
                Err("disk.source.path.root"),
            ),
            (
                json!({"type": "MOUNT", "mount": {"root": "/a/../b"}}),
                Err("disk.source.mount.root"),
            ),
            (
                json!({"type": "MOUNT", "id": "", "mount": {"root": "/a"}}),
                Err("disk.source.id"),
            ),
            (
                json!({"type": "BLOCK", "id": "v"}),
                Err("disk.source.mount.root"),
            ),
            (
                json!({"type": "BLOCK", "mount": {"root": "/a"}}),
                Err("disk.source.type"),
            ),
            (
                json!({"type": "BLOCK", "id": "v", "mount": {"root": "./csi/t/n/mounts"}}),
                Ok("/var/lib/agent/csi/t/n/mounts/v/target"),
            ),
            (
                json!({"type": "BLOCK", "id": "v", "path": {"root": "/a"}}),
                Err("disk.source.mount.root"),
            ),
            (json!({"type": "RAW"}), Err("disk.source.type")),
            (json!({"type": "UNKNOWN"}), Err("disk.source.type")),
            (json!({"type": "TAPE"}), Err("disk.source.type")),
        ];
        for (source, want) in cases {
            let got = resolve_host_path(&disk(source.clone()), wd);
            match (got, want) {
                (Ok(path), Ok(want)) => assert_eq!(path, Path::new(want), "{source}"),
                (Err(err), Err(field)) => assert_eq!(err.field(), Some(*field), "{source}: {err}"),
                (got, want) => panic!("{source}: got {got:?}, want {want:?}"),
            }
        }
    }

    #[test]
    fn work_dir_must_be_absolute_and_plain() {
        let r = disk(json!({"type": "MOUNT", "mount": {"root": "/m"}}));
        for wd in ["rel/dir", "/a/../b", ""] {
            let err = resolve_host_path(&r, Path::new(wd)).unwrap_err();
            assert!(
                matches!(err, ResourceError::InvalidWorkDir { .. }),
                "{wd}: {err}"
            );
            assert_eq!(err.field(), Some("work_dir"));
        }
        assert_eq!(
            resolve_host_path(&r, Path::new("/a/./b/")).unwrap(),
            Path::new("/m")
        );
    }

    #[test]
    fn role_table() {
        let cases: &[(&str, Option<&str>)] = &[
            ("dev", Some("dev")),
            ("dev/team", Some("dev team")),
            ("a.b/c-d/e_f", Some("a.b c-d e_f")),
            ("*", None),
            ("", None),
            ("/dev", None),
            ("dev/", None),
            ("dev//team", None),
            ("dev/..", None),
            ("./dev", None),
            ("dev/*", None),
            ("-dev", None),
            ("dev/-t", None),
            ("de v", None),
            ("dev\n", None),
            ("dev\0", None),
            ("dev\t", None),
        ];
        for (role, want) in cases {
            assert_eq!(
                role_path_component(role).ok().as_deref(),
                *want,
                "role {role:?}"
            );
        }
        assert!(role_path_component(&"r".repeat(256)).is_err());
    }

    #[test]
    fn beneath_refuses_escapes() {
        let r = disk(json!({"type": "MOUNT"}));
        let root = Path::new("/r");
        for path in ["/r/../x", "/other", "/", "/rx"] {
            let err = beneath(&r, "disk.source.id", PathBuf::from(path), root).unwrap_err();
            assert!(
                matches!(err, ResourceError::EscapesRoot { .. }),
                "{path}: {err}"
            );
        }
        assert_eq!(
            beneath(&r, "f", PathBuf::from("/r/./a"), root).unwrap(),
            Path::new("/r/a")
        );
        assert_eq!(
            beneath(&r, "f", PathBuf::from("/r"), root).unwrap(),
            Path::new("/r")
        );
    }
}
