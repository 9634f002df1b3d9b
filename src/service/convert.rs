//! Wire messages to and from library types. Request fields are checked
//! here, once: a malformed one is an [`ServiceError::InvalidArgument`]
//! naming the field. Paths travel as UTF-8 strings (non-UTF-8 bytes in a
//! host path are replaced when reported).

use std::path::{Path, PathBuf};

use crate::isolator::oci::OciPrepared;
use crate::isolator::{ContainerConfig, ContainerRecord, IsolatorRecovery, LaunchInfo};
use crate::mount::{Hardening, TargetRoot, VolumeMount, VolumePropagation};
use crate::provider::status::StatusReport;
use crate::resource::{parse_resources, Resource};
use crate::service::error::ServiceError;
use crate::service::proto;

/// Parses a `resources_json` field: a JSON list of Mesos `Resource`
/// objects (an empty string is an empty list).
pub fn resources(field: &'static str, json: &str) -> Result<Vec<Resource>, ServiceError> {
    if json.trim().is_empty() {
        return Ok(Vec::new());
    }
    parse_resources(json).map_err(|e| ServiceError::InvalidArgument {
        field,
        reason: crate::error_chain::full_message(&e),
    })
}

/// An absolute path from a request field.
fn absolute(field: &'static str, value: &str) -> Result<PathBuf, ServiceError> {
    let path = Path::new(value);
    if !path.is_absolute() {
        return Err(ServiceError::InvalidArgument {
            field,
            reason: format!("{value:?} is not an absolute path"),
        });
    }
    Ok(path.to_path_buf())
}

/// The library's container configuration from the wire one.
pub fn container_config(
    config: Option<proto::ContainerConfig>,
) -> Result<ContainerConfig, ServiceError> {
    let config = config.ok_or(ServiceError::InvalidArgument {
        field: "config",
        reason: "missing".into(),
    })?;
    Ok(ContainerConfig {
        resources: resources("config.resources_json", &config.resources_json)?,
        sandbox: absolute("config.sandbox", &config.sandbox)?,
        rootfs: match config.rootfs.as_str() {
            "" => None,
            r => Some(absolute("config.rootfs", r)?),
        },
        user: Some(config.user).filter(|u| !u.is_empty()),
    })
}

fn path_string(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

impl From<TargetRoot> for proto::TargetRoot {
    fn from(r: TargetRoot) -> Self {
        match r {
            TargetRoot::Sandbox => proto::TargetRoot::Sandbox,
            TargetRoot::Rootfs => proto::TargetRoot::Rootfs,
            TargetRoot::Host => proto::TargetRoot::Host,
        }
    }
}

impl From<&VolumeMount> for proto::VolumeMount {
    fn from(m: &VolumeMount) -> Self {
        proto::VolumeMount {
            source: path_string(&m.source),
            root: proto::TargetRoot::from(m.root).into(),
            target: path_string(&m.target),
            container_path: m.container_path.clone(),
            readonly: m.readonly,
            volume_id: m.volume_id.clone().unwrap_or_default(),
            provider_id: m.provider_id.clone().unwrap_or_default(),
            source_root: m
                .source_root
                .as_deref()
                .map(path_string)
                .unwrap_or_default(),
            block: m.block,
            propagation: m.propagation.as_str().to_string(),
            hardening: m
                .hardening
                .flags()
                .names()
                .into_iter()
                .map(str::to_string)
                .collect(),
        }
    }
}

/// For clients written in Rust: a mount from the wire back into the type
/// the launcher applies.
impl TryFrom<proto::VolumeMount> for VolumeMount {
    type Error = String;

    fn try_from(m: proto::VolumeMount) -> Result<Self, String> {
        let root = match proto::TargetRoot::try_from(m.root) {
            Ok(proto::TargetRoot::Sandbox) => TargetRoot::Sandbox,
            Ok(proto::TargetRoot::Rootfs) => TargetRoot::Rootfs,
            Ok(proto::TargetRoot::Host) => TargetRoot::Host,
            Ok(proto::TargetRoot::Unspecified) | Err(_) => {
                return Err(format!(
                    "mount of {:?}: unknown target root {}",
                    m.container_path, m.root
                ))
            }
        };
        let propagation = if m.propagation.is_empty() {
            VolumePropagation::Private
        } else {
            VolumePropagation::parse(&m.propagation).ok_or_else(|| {
                format!(
                    "mount of {:?}: unknown propagation {:?} (expected private, rslave or rshared)",
                    m.container_path, m.propagation
                )
            })?
        };
        if let Some(bad) = m
            .hardening
            .iter()
            .find(|f| !matches!(f.as_str(), "nosuid" | "nodev" | "noexec"))
        {
            return Err(format!(
                "mount of {:?}: unknown hardening flag {:?} (expected nosuid, nodev or noexec)",
                m.container_path, bad
            ));
        }
        let hardening = Hardening::of_mount_flags(&m.hardening);
        Ok(VolumeMount {
            source: PathBuf::from(m.source),
            source_root: Some(m.source_root)
                .filter(|s| !s.is_empty())
                .map(PathBuf::from),
            root,
            target: PathBuf::from(m.target),
            container_path: m.container_path,
            readonly: m.readonly,
            volume_id: Some(m.volume_id).filter(|s| !s.is_empty()),
            provider_id: Some(m.provider_id).filter(|s| !s.is_empty()),
            block: m.block,
            propagation,
            hardening,
        })
    }
}

/// The wire form of a list of mounts.
pub fn mounts(mounts: &[VolumeMount]) -> Vec<proto::VolumeMount> {
    mounts.iter().map(proto::VolumeMount::from).collect()
}

impl From<LaunchInfo> for proto::LaunchInfo {
    fn from(info: LaunchInfo) -> Self {
        proto::LaunchInfo {
            mounts: mounts(&info.mounts),
        }
    }
}

impl From<OciPrepared> for proto::OciLaunchInfo {
    fn from(prepared: OciPrepared) -> Self {
        let rootfs_propagation = match prepared.rootfs_propagation() {
            VolumePropagation::Private => String::new(),
            need => need.as_str().to_string(),
        };
        proto::OciLaunchInfo {
            rootfs_propagation,
            mounts: prepared
                .mounts
                .into_iter()
                .map(|m| proto::OciMount {
                    destination: m.destination,
                    r#type: m.kind,
                    source: m.source,
                    options: m.options,
                })
                .collect(),
            docker_args: prepared.docker_args,
            devices: prepared
                .devices
                .into_iter()
                .map(|d| proto::OciDevice {
                    path: d.path,
                    major: d.major,
                    minor: d.minor,
                    access: d.access,
                })
                .collect(),
        }
    }
}

impl From<IsolatorRecovery> for proto::RecoverResponse {
    fn from(r: IsolatorRecovery) -> Self {
        proto::RecoverResponse {
            recovered: r.recovered,
            cleaned: r.cleaned,
            released_uses: r
                .released_uses
                .into_iter()
                .map(|(volume_id, container_id)| proto::ReleasedUse {
                    volume_id,
                    container_id,
                })
                .collect(),
            corrupt: r
                .corrupt
                .into_iter()
                .map(|(path, reason)| proto::CorruptCheckpoint {
                    path: path_string(&path),
                    reason,
                })
                .collect(),
        }
    }
}

impl From<&ContainerRecord> for proto::ContainerStatus {
    fn from(r: &ContainerRecord) -> Self {
        proto::ContainerStatus {
            container_id: r.container_id.clone(),
            sandbox: path_string(&r.config.sandbox),
            rootfs: r
                .config
                .rootfs
                .as_deref()
                .map(path_string)
                .unwrap_or_default(),
            pid: r.pid.unwrap_or(0),
            mounts: mounts(&r.mounts),
        }
    }
}

/// The wire status report from the volume scan and the isolator's containers.
pub fn status(report: StatusReport, containers: &[ContainerRecord]) -> proto::StatusResponse {
    proto::StatusResponse {
        volumes: report
            .volumes
            .into_iter()
            .map(|v| proto::VolumeStatus {
                plugin: v.plugin,
                volume_id: v.volume_id,
                name: v.name.unwrap_or_default(),
                state: v.state.to_string(),
                users: v.users.into_iter().collect(),
                mount_point: path_string(&v.mount_point),
                mounted: v.mounted,
                disagreement: v.disagreement.unwrap_or_default(),
                capacity_bytes: v.capacity_bytes,
                capacity_enforced: v.capacity_enforced,
                parameters: v.parameters.into_iter().collect(),
                imported: v.imported,
                access_type: v.capability.access_type.as_str().to_string(),
                access_mode: v.capability.access_mode,
                fs_type: v.capability.fs_type,
                mount_flags: v.capability.mount_flags,
                mount_group: v.mount_group.unwrap_or(0),
                mutable_parameters: v.mutable_parameters.into_iter().collect(),
                content_source: v
                    .content_source
                    .as_ref()
                    .map(|c| c.label())
                    .unwrap_or_default(),
                accessible_topology: v
                    .accessible_topology
                    .into_iter()
                    .map(|t| proto::TopologySegments {
                        segments: t.into_iter().collect(),
                    })
                    .collect(),
                stats: match (v.stats, v.stats_unavailable) {
                    (Some(s), _) => Some(proto::VolumeStats {
                        bytes_total: s.bytes_total,
                        bytes_used: s.bytes_used,
                        bytes_available: s.bytes_available,
                        inodes_total: s.inodes_total,
                        inodes_used: s.inodes_used,
                        inodes_free: s.inodes_free,
                        unavailable: String::new(),
                    }),
                    (None, Some(why)) => Some(proto::VolumeStats {
                        unavailable: why,
                        ..Default::default()
                    }),
                    (None, None) => None,
                },
                condition: v.condition.map(|c| proto::VolumeCondition {
                    abnormal: c.abnormal,
                    message: c.message,
                }),
            })
            .collect(),
        containers: containers
            .iter()
            .map(proto::ContainerStatus::from)
            .collect(),
        unreadable: report
            .unreadable
            .into_iter()
            .map(|u| proto::UnreadableState {
                path: path_string(&u.path),
                reason: u.reason,
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_volumes_topology_reaches_status() {
        use crate::provider::status::VolumeStatus;
        let zone: crate::provider::topology::Segments =
            [("topology.example.com/zone".to_string(), "a".to_string())].into();
        let v = VolumeStatus {
            plugin: "csi/default".into(),
            volume_id: "v".into(),
            name: Some("data".into()),
            state: crate::provider::VolumeState::Created,
            users: Default::default(),
            capacity_bytes: 0,
            capacity_enforced: None,
            parameters: Default::default(),
            imported: false,
            accessible_topology: vec![zone.clone()],
            capability: Default::default(),
            mount_group: Some(5678),
            mount_point: PathBuf::from("/w/m"),
            mounted: false,
            staged: false,
            disagreement: None,
            stats: None,
            condition: None,
            stats_unavailable: None,
            mutable_parameters: Default::default(),
            content_source: Some(crate::provider::state::ContentSource::Snapshot {
                name: "nightly".into(),
                snapshot_id: "snap-1".into(),
            }),
            expansion: None,
            fenced: None,
        };
        let report = StatusReport {
            volumes: vec![v],
            ..Default::default()
        };
        let answer = status(report, &[]);
        assert_eq!(answer.volumes[0].mount_group, 5678);
        assert_eq!(answer.volumes[0].content_source, "snapshot:nightly");
        let topology = &answer.volumes[0].accessible_topology;
        assert_eq!(topology.len(), 1);
        assert_eq!(topology[0].segments, zone.into_iter().collect());
    }

    #[test]
    fn mounts_round_trip() {
        let m = VolumeMount {
            source: PathBuf::from("/w/csi/t/n/mounts/v/target"),
            source_root: None,
            root: TargetRoot::Rootfs,
            target: PathBuf::from("data/x"),
            container_path: "/data/x".into(),
            readonly: true,
            volume_id: Some("v".into()),
            provider_id: None,
            block: false,
            propagation: Default::default(),
            hardening: Default::default(),
        };
        let wire = proto::VolumeMount::from(&m);
        assert_eq!(wire.provider_id, "");
        assert_eq!(wire.source_root, "");
        assert_eq!(VolumeMount::try_from(wire).unwrap(), m);
        // A source inside a volume carries its trusted root across the wire (`==` ignores it).
        let inner = VolumeMount {
            source: PathBuf::from("/w/csi/t/n/mounts/v/target/volumes/roles/r/pv"),
            source_root: Some(PathBuf::from("/w/csi/t/n/mounts/v/target")),
            ..m.clone()
        };
        let back = VolumeMount::try_from(proto::VolumeMount::from(&inner)).unwrap();
        assert_eq!(back.source_root, inner.source_root);
        let bad = proto::VolumeMount {
            root: 0,
            ..Default::default()
        };
        assert!(VolumeMount::try_from(bad).is_err());
        // Propagation crosses the wire by name; empty is private; anything else is refused.
        for p in [VolumePropagation::Rslave, VolumePropagation::Rshared] {
            let with = VolumeMount {
                propagation: p,
                ..m.clone()
            };
            let wire = proto::VolumeMount::from(&with);
            assert_eq!(wire.propagation, p.as_str());
            assert_eq!(VolumeMount::try_from(wire).unwrap(), with);
        }
        let empty = proto::VolumeMount {
            propagation: String::new(),
            ..proto::VolumeMount::from(&m)
        };
        assert_eq!(
            VolumeMount::try_from(empty).unwrap().propagation,
            VolumePropagation::Private
        );
        let unknown = proto::VolumeMount {
            propagation: "slave".into(),
            ..proto::VolumeMount::from(&m)
        };
        assert!(VolumeMount::try_from(unknown)
            .unwrap_err()
            .contains("unknown propagation"));
        // Hardening flags cross by name (`==` ignores them: compare the field); others are refused.
        let hardened = VolumeMount {
            hardening: crate::mount::Hardening::of_mount_flags(&["nosuid", "noexec"]),
            ..m.clone()
        };
        let wire = proto::VolumeMount::from(&hardened);
        assert_eq!(wire.hardening, ["nosuid", "noexec"]);
        assert_eq!(
            VolumeMount::try_from(wire).unwrap().hardening,
            hardened.hardening
        );
        let suid = proto::VolumeMount {
            hardening: vec!["suid".into()],
            ..proto::VolumeMount::from(&m)
        };
        assert!(VolumeMount::try_from(suid)
            .unwrap_err()
            .contains("unknown hardening flag \"suid\""));
    }

    #[test]
    fn config_fields_are_checked() {
        let ok = proto::ContainerConfig {
            resources_json: String::new(),
            sandbox: "/s".into(),
            rootfs: String::new(),
            user: String::new(),
        };
        let c = container_config(Some(ok.clone())).unwrap();
        assert!(c.resources.is_empty() && c.rootfs.is_none() && c.user.is_none());
        for (bad, field) in [
            (
                proto::ContainerConfig {
                    sandbox: "rel".into(),
                    ..ok.clone()
                },
                "config.sandbox",
            ),
            (
                proto::ContainerConfig {
                    rootfs: "r".into(),
                    ..ok.clone()
                },
                "config.rootfs",
            ),
            (
                proto::ContainerConfig {
                    resources_json: "{not json".into(),
                    ..ok.clone()
                },
                "config.resources_json",
            ),
        ] {
            match container_config(Some(bad)) {
                Err(ServiceError::InvalidArgument { field: f, .. }) => assert_eq!(f, field),
                other => panic!("{field}: {other:?}"),
            }
        }
        assert!(container_config(None).is_err());
    }
}
