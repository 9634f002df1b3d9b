//! From a container's disk resources to the mounts to make: the host source
//! (DESIGN.md's resolution rules) and the target (relative `container_path`
//! inside the sandbox, absolute inside the rootfs), checked lexically here
//! and resolved by fd when applied.

use std::collections::BTreeSet;
use std::path::{Component, Path, PathBuf};

use crate::isolator::error::IsolatorError;
use crate::isolator::launch_info::ContainerConfig;
use crate::mount::{Hardening, TargetRoot, VolumeMount, VolumePropagation};
use crate::resource::{PropagationMode, Resource, SourceType};

/// The mounts for a container's resources, in resource order: every disk
/// resource with a `disk.volume.container_path`.
pub fn volume_mounts(
    container: &str,
    config: &ContainerConfig,
    resources: &[Resource],
    work_dir: &Path,
) -> Result<Vec<VolumeMount>, IsolatorError> {
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for r in resources {
        let Some(container_path) = r.container_path() else {
            continue;
        };
        let volume = r
            .source_id()
            .map(str::to_string)
            .unwrap_or_else(|| r.describe());
        let bad = |reason: &str| IsolatorError::BadTarget {
            container: container.to_string(),
            volume: volume.clone(),
            container_path: container_path.to_string(),
            reason: reason.to_string(),
        };
        let resource_err = |source| IsolatorError::Resource {
            container: container.to_string(),
            volume: volume.clone(),
            source: Box::new(source),
        };
        // An unknown mode is refused, never mounted read-write (or read-only) by guess.
        r.check_volume_mode().map_err(resource_err)?;
        let block = r.disk_source().is_some_and(|s| s.kind == SourceType::Block);
        if block && r.read_only() {
            // Neither a read-only mount of a device file nor the container's copy stops writes to
            // the device; the bundled plugin makes no read-only devices either.
            return Err(bad(
                "a block volume cannot be mounted read-only (mode RO): give it read-write",
            ));
        }
        let propagation = propagation_of(r).map_err(resource_err)?;
        if propagation != VolumePropagation::Private && r.source_id().is_none() {
            return Err(bad(
                "rslave and rshared propagation need a CSI volume (disk.source.id): a disk without one has no mount point of its own to share",
            ));
        }
        let source = r.host_path(work_dir).map_err(resource_err)?;
        let source_root = source_root_of(r, &source);
        let (root, target) =
            target_of(container_path, config.rootfs.is_some()).map_err(|e| bad(&e))?;
        if !seen.insert((root, target.clone())) {
            return Err(bad(
                "another volume of the container is mounted at the same target",
            ));
        }
        out.push(VolumeMount {
            source,
            source_root,
            root,
            target,
            container_path: container_path.to_string(),
            readonly: r.read_only(),
            volume_id: r.source_id().map(str::to_string),
            provider_id: r.provider_id().map(str::to_string),
            block,
            propagation,
            // The volume's record says what it asks; the isolator fills it in.
            hardening: Hardening::default(),
        });
    }
    // Parents before children, so a volume nested in another lands on top.
    out.sort_by_key(|m| m.target.components().count());
    Ok(out)
}

/// A resource's `disk.volume.mount_propagation` as the mount applies it: Mesos' names onto the
/// kernel's (absent is private; an unknown mode is refused by the resource).
pub fn propagation_of(r: &Resource) -> Result<VolumePropagation, crate::resource::ResourceError> {
    Ok(match r.mount_propagation()? {
        None => VolumePropagation::Private,
        Some(PropagationMode::HostToContainer) => VolumePropagation::Rslave,
        Some(PropagationMode::Bidirectional) => VolumePropagation::Rshared,
        // `mount_propagation` lets only the two above through.
        Some(PropagationMode::Unknown | PropagationMode::Other(_)) => VolumePropagation::Private,
    })
}

/// What an agent disk's host path is: a directory, something else, or nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostPathKind {
    /// A directory: it can be mounted.
    Directory,
    /// A file, a device...
    Other,
    /// Nothing there.
    Missing,
}

/// Refuses a disk without `provider_id` (an agent disk, which no provider
/// publishes: the operator prepares it) whose host path is not a directory,
/// naming the resource and the path, before anything is published or
/// mounted. `kind` reads the host (injected, so the rule is tested alone).
pub fn check_agent_disks(
    container: &str,
    resources: &[Resource],
    work_dir: &Path,
    kind: impl Fn(&Path) -> HostPathKind,
) -> Result<(), IsolatorError> {
    for r in resources {
        if !r.is_disk() || r.provider_id().is_some() || r.container_path().is_none() {
            continue;
        }
        // A path that cannot be worked out is refused by `volume_mounts`, naming why.
        let Ok(path) = r.host_path(work_dir) else {
            continue;
        };
        let problem = match kind(&path) {
            HostPathKind::Directory => continue,
            HostPathKind::Other => "is not a directory",
            HostPathKind::Missing => "does not exist",
        };
        return Err(IsolatorError::MissingAgentDisk {
            container: container.to_string(),
            resource: r.describe(),
            path,
            problem,
        });
    }
    Ok(())
}

/// What is at a host path (following symlinks: the mount itself resolves it by fd later).
pub fn host_path_kind(path: &Path) -> HostPathKind {
    match std::fs::metadata(path) {
        Ok(m) if m.is_dir() => HostPathKind::Directory,
        Ok(_) => HostPathKind::Other,
        Err(_) => HostPathKind::Missing,
    }
}

/// The part of a source per DESIGN.md's rules that nobody but us writes:
/// for a persistent volume (a PATH disk's, or the default disk's in the work
/// dir) the directory above `volumes/roles/<role>/<id>`, which lies in a
/// tree containers write; `None` for a MOUNT disk's mount point, trusted as
/// a whole. `source` is what `resolve_host_path` made of `r` (the role and
/// id are single checked components there).
fn source_root_of(r: &Resource, source: &Path) -> Option<PathBuf> {
    let persistent = match r.disk_source() {
        None => true,
        Some(s) => s.kind == SourceType::Path,
    };
    if !persistent {
        return None;
    }
    let root = source.ancestors().nth(PERSISTENT_DEPTH)?;
    let tail: Vec<_> = source.strip_prefix(root).ok()?.components().collect();
    match tail.as_slice() {
        [Component::Normal(v), Component::Normal(r), _, _] if *v == "volumes" && *r == "roles" => {
            Some(root.to_path_buf())
        }
        // Not the layout this module knows: trust none of it beyond the
        // source's parent (never more than the source itself).
        _ => source.parent().map(Path::to_path_buf),
    }
}

/// Components of `volumes/roles/<role>/<id>`.
const PERSISTENT_DEPTH: usize = 4;

/// The root and the normalized relative target of a `container_path`.
pub fn target_of(container_path: &str, has_rootfs: bool) -> Result<(TargetRoot, PathBuf), String> {
    if container_path.is_empty() {
        return Err("is empty".into());
    }
    if container_path.contains('\0') {
        return Err("contains a NUL byte".into());
    }
    let path = Path::new(container_path);
    let root = if path.is_absolute() {
        if has_rootfs {
            TargetRoot::Rootfs
        } else {
            TargetRoot::Host
        }
    } else {
        TargetRoot::Sandbox
    };
    let mut target = PathBuf::new();
    for c in path.components() {
        match c {
            Component::RootDir | Component::CurDir => {}
            Component::Normal(n) => target.push(n),
            Component::ParentDir => {
                if !target.pop() {
                    return Err("resolves outside the container's root".into());
                }
            }
            Component::Prefix(_) => return Err("is not a Unix path".into()),
        }
    }
    if target.as_os_str().is_empty() {
        return Err("is the root itself".into());
    }
    Ok((root, target))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error_chain::FullMessage;

    #[test]
    fn agent_disks_must_be_directories_provider_disks_are_not_asked() {
        let disk = |json: serde_json::Value| -> Resource { serde_json::from_value(json).unwrap() };
        let agent = disk(serde_json::json!({
            "name": "disk", "type": "SCALAR", "scalar": {"value": 1},
            "disk": {"source": {"type": "MOUNT", "mount": {"root": "/srv/disk"}},
                     "volume": {"container_path": "d", "mode": "RW"}}}));
        let provider = disk(serde_json::json!({
            "name": "disk", "type": "SCALAR", "scalar": {"value": 1},
            "provider_id": {"value": "p"},
            "disk": {"source": {"type": "MOUNT", "id": "v", "mount": {"root": "./csi/t/n/mounts"}},
                     "volume": {"container_path": "d", "mode": "RW"}}}));
        let work = Path::new("/work");
        let cases = [
            (HostPathKind::Directory, None),
            (HostPathKind::Missing, Some("/srv/disk does not exist")),
            (HostPathKind::Other, Some("/srv/disk is not a directory")),
        ];
        for (kind, want) in cases {
            let got = check_agent_disks("c", std::slice::from_ref(&agent), work, |_| kind);
            match want {
                None => got.unwrap(),
                Some(want) => {
                    let err = got.unwrap_err().to_string();
                    assert!(
                        err.contains(want) && err.contains("has no provider_id"),
                        "{err}"
                    );
                }
            }
            // A provider's disk is the provider's business: never looked at here.
            check_agent_disks("c", std::slice::from_ref(&provider), work, |_| kind).unwrap();
        }
    }

    #[test]
    fn targets_table() {
        let ok = |p: &str, rootfs: bool| target_of(p, rootfs).unwrap();
        assert_eq!(
            ok("data", false),
            (TargetRoot::Sandbox, PathBuf::from("data"))
        );
        assert_eq!(
            ok("./a/b/../c", false),
            (TargetRoot::Sandbox, PathBuf::from("a/c"))
        );
        assert_eq!(
            ok("/data", true),
            (TargetRoot::Rootfs, PathBuf::from("data"))
        );
        assert_eq!(
            ok("/data", false),
            (TargetRoot::Host, PathBuf::from("data"))
        );
        assert_eq!(
            ok("//x//y/", true),
            (TargetRoot::Rootfs, PathBuf::from("x/y"))
        );
        for bad in [
            "",
            "..",
            "../x",
            "a/../../x",
            "/..",
            "/",
            ".",
            "/a/../..",
            "a\0b",
        ] {
            assert!(target_of(bad, true).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn mount_propagation_maps_mesos_names_and_refuses_the_rest() {
        use crate::resource::VolumeMode;
        let config = ContainerConfig {
            resources: vec![],
            sandbox: PathBuf::from("/sandbox"),
            rootfs: None,
            user: None,
        };
        let csi = || {
            Resource::csi_volume(
                "p1",
                "vol-1",
                "./csi/t/n/mounts",
                8,
                None,
                None,
                [("k", "v")],
            )
            .with_volume("data", VolumeMode::Rw)
        };
        let cases = [
            (None, Ok(VolumePropagation::Private)),
            (
                Some(PropagationMode::HostToContainer),
                Ok(VolumePropagation::Rslave),
            ),
            (
                Some(PropagationMode::Bidirectional),
                Ok(VolumePropagation::Rshared),
            ),
            (Some(PropagationMode::Unknown), Err("UNKNOWN")),
            (Some(PropagationMode::Other("rslave".into())), Err("rslave")),
        ];
        for (mode, want) in cases {
            let r = match &mode {
                Some(m) => csi().with_mount_propagation(m.clone()),
                None => csi(),
            };
            let got = volume_mounts("c1", &config, &[r], Path::new("/work"));
            match (got, want) {
                (Ok(m), Ok(p)) => assert_eq!(m[0].propagation, p, "{mode:?}"),
                (Err(e), Err(value)) => {
                    let text = e.full_message();
                    assert!(
                        text.contains("disk.volume.mount_propagation.mode") && text.contains(value),
                        "{text}"
                    );
                }
                (got, want) => panic!("{mode:?}: {got:?}, want {want:?}"),
            }
        }
        // A disk with no CSI volume of its own (the agent's default disk) has no mount point to share.
        let plain = Resource::scalar("disk", 8.0)
            .with_persistence("pv1", None)
            .with_volume("data", VolumeMode::Rw)
            .with_mount_propagation(PropagationMode::HostToContainer);
        let err = volume_mounts("c1", &config, &[plain], Path::new("/work")).unwrap_err();
        assert!(
            err.full_message().contains("need a CSI volume"),
            "{}",
            err.full_message()
        );
    }

    #[test]
    fn an_unknown_volume_mode_is_refused_not_guessed() {
        use crate::resource::VolumeMode;
        let volume = |mode: &str| {
            let mode = match mode {
                "RW" => VolumeMode::Rw,
                "RO" => VolumeMode::Ro,
                other => VolumeMode::Other(other.to_string()),
            };
            Resource::csi_volume(
                "p1",
                "vol-1",
                "./csi/t/n/mounts",
                8,
                None,
                None,
                [("k", "v")],
            )
            .with_volume("data", mode)
        };
        let config = ContainerConfig {
            resources: vec![],
            sandbox: PathBuf::from("/sandbox"),
            rootfs: None,
            user: None,
        };
        for (mode, ok) in [
            ("RW", true),
            ("RO", true),
            ("ro", false),
            ("READ_ONLY", false),
        ] {
            let got = volume_mounts("c1", &config, &[volume(mode)], Path::new("/work"));
            assert_eq!(got.is_ok(), ok, "{mode}: {got:?}");
            if let Err(e) = got {
                let text = e.full_message();
                assert!(
                    text.contains("disk.volume.mode") && text.contains(mode),
                    "{text}"
                );
            }
        }
    }

    #[test]
    fn persistent_volumes_name_their_trusted_root() {
        let config = ContainerConfig {
            resources: vec![],
            sandbox: PathBuf::from("/sandbox"),
            rootfs: None,
            user: None,
        };
        let work = Path::new("/work");
        let csi = || {
            Resource::csi_volume(
                "p1",
                "vol-1",
                "./csi/t/n/mounts",
                8,
                None,
                None,
                [("k", "v")],
            )
        };
        let as_path_disk = |mut r: serde_json::Value| {
            let source = r["disk"]["source"].as_object_mut().unwrap();
            let root = source.remove("mount").unwrap();
            source.insert("type".into(), "PATH".into());
            source.insert("path".into(), root);
            r["disk"]["persistence"] = serde_json::json!({"id": "pv1"});
            r["reservations"] = serde_json::json!([{"type": "DYNAMIC", "role": "r1"}]);
            r
        };
        let mount_disk = serde_json::to_value(csi()).unwrap();
        let path_disk = as_path_disk(mount_disk.clone());
        let default_disk = serde_json::json!({
            "name": "disk", "type": "SCALAR", "scalar": {"value": 8},
            "reservations": [{"type": "DYNAMIC", "role": "r1"}],
            "disk": {"persistence": {"id": "pv1"}},
        });
        let target = "/work/csi/t/n/mounts/vol-1/target";
        let cases = [
            (mount_disk, target.to_string(), None),
            (
                path_disk,
                format!("{target}/volumes/roles/r1/pv1"),
                Some(target.to_string()),
            ),
            (
                default_disk,
                "/work/volumes/roles/r1/pv1".to_string(),
                Some("/work".to_string()),
            ),
        ];
        for (json, source, root) in cases {
            let mut r: Resource = serde_json::from_value(json).unwrap();
            r = r.with_volume("data", crate::resource::VolumeMode::Rw);
            let got = volume_mounts("c1", &config, &[r], work).unwrap();
            assert_eq!(got[0].source, Path::new(&source));
            assert_eq!(got[0].source_root, root.map(PathBuf::from), "{source}");
            let (anchor, rest) = got[0].source_parts().unwrap();
            assert_eq!(anchor.join(rest), got[0].source);
        }
    }

    #[test]
    fn source_root_is_optional_in_checkpoints_and_ignored_by_equality() {
        let old = serde_json::json!({
            "source": "/w/mp/volumes/roles/r1/pv1", "root": "sandbox", "target": "data",
            "container_path": "data", "readonly": false,
        });
        let old: VolumeMount = serde_json::from_value(old).unwrap();
        assert_eq!(old.source_root, None);
        let mut new = old.clone();
        new.source_root = Some(PathBuf::from("/w/mp"));
        assert_eq!(old, new, "update must not see a changed mount");
        let back: VolumeMount =
            serde_json::from_value(serde_json::to_value(&new).unwrap()).unwrap();
        assert_eq!(back.source_root, new.source_root);
        assert!(!serde_json::to_string(&old).unwrap().contains("source_root"));
        // A root the source does not lie beneath is refused, not trusted.
        new.source_root = Some(PathBuf::from("/elsewhere"));
        assert!(new.source_parts().is_err());
    }
}
