//! Library-level tests of `csi_isolator::resource`: Mesos-shaped resource
//! JSON round trips, and the mount-point resolution rules against hostile
//! ids and roots. Resolution is lexical, so nothing here touches the disk.

use std::path::{Path, PathBuf};

use csi_isolator::resource::{
    decode_volume_id, parse_resources, resolve_host_path, ReservationInfo, Resource, ResourceError,
    SourceType, ValueType, VolumeMode, MAX_ENCODED_LEN,
};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

const WORK_DIR: &str = "/var/lib/csi-isolator";

/// Resources as Mesos' v1 operator API writes them (`GET_RESOURCE_PROVIDERS`,
/// `GET_AGENT`): snake_case, enums by name, doubles with `.0`, the deprecated
/// `role` defaulted to `"*"`, plus fields this crate does not model.
fn mesos_samples() -> Value {
    json!([
        {
            "name": "cpus", "type": "SCALAR", "scalar": {"value": 0.5}, "role": "*"
        },
        {
            "name": "mem", "type": "SCALAR", "scalar": {"value": 1024.0}, "role": "*",
            "allocation_info": {"role": "dev/team"}
        },
        {
            "name": "cpus", "type": "SCALAR", "scalar": {"value": 2}, "role": "*",
            "revocable": {}
        },
        {
            "name": "ports", "type": "RANGES", "role": "*",
            "ranges": {"range": [{"begin": 31000, "end": 32000}, {"begin": 33000, "end": 33010}]}
        },
        {
            "name": "gpus_models", "type": "SET", "role": "*", "set": {"item": ["a100", "h100"]}
        },
        {
            // A volume created by the storage local resource provider, reserved
            // for a refined role, made persistent and mounted read-only.
            "name": "disk", "type": "SCALAR", "scalar": {"value": 2048.0}, "role": "*",
            "reservations": [
                {"type": "DYNAMIC", "role": "dev", "principal": "ops"},
                {
                    "type": "DYNAMIC", "role": "dev/team", "principal": "ops",
                    "labels": {"labels": [{"key": "owner", "value": "alice"}, {"key": "flag"}]}
                }
            ],
            "provider_id": {"value": "b1a3f8f0-6c1e-4f8a-9d5e-0c3c2d1e9f10-0000"},
            "disk": {
                "persistence": {"id": "pg-data", "principal": "ops"},
                "volume": {"container_path": "/var/lib/postgresql", "mode": "RO"},
                "source": {
                    "type": "MOUNT",
                    "vendor": "org.apache.mesos.csi.test.local",
                    "id": "lvm/vg0/pg-data",
                    "metadata": {"labels": [{"key": "fsType", "value": "ext4"}]},
                    "profile": "fast",
                    "mount": {"root": "./csi/org.apache.mesos.csi.test/local/mounts"}
                }
            },
            "allocation_info": {"role": "dev/team"}
        },
        {
            // An operator-prepared PATH disk from the agent's --resources,
            // holding a shared persistent volume.
            "name": "disk", "type": "SCALAR", "scalar": {"value": 4096.0}, "role": "*",
            "reservations": [{"type": "STATIC", "role": "storage"}],
            "disk": {
                "persistence": {"id": "ledger", "principal": "fw"},
                "volume": {"container_path": "ledger", "mode": "RW"},
                "source": {"type": "PATH", "path": {"root": "/mnt/path-disk-1"}}
            },
            "shared": {}
        },
        {
            // A persistent volume on the agent's default disk, in the
            // pre-refinement format (`role` plus a singular `reservation`).
            "name": "disk", "type": "SCALAR", "scalar": {"value": 128.0}, "role": "web",
            "reservation": {"principal": "fw", "labels": {"labels": [{"key": "k", "value": "v"}]}},
            "disk": {
                "persistence": {"id": "cache"},
                "volume": {"container_path": "cache", "mode": "RW"}
            }
        },
        {
            // Fields from a newer Mesos at every level.
            "name": "disk", "type": "SCALAR", "scalar": {"value": 1.5}, "role": "*",
            "reservations": [{"type": "DYNAMIC", "role": "x", "future_r": 1}],
            "provider_id": {"value": "p", "future_p": [1, 2]},
            "disk": {
                "persistence": {"id": "i", "future_pe": true},
                "volume": {"container_path": "c", "mode": "RW",
                           "source": {"type": "SANDBOX_PATH"}},
                "source": {
                    "type": "MOUNT", "id": "v",
                    "mount": {"root": "/m", "future_m": "x"},
                    "metadata": {"labels": [{"key": "a", "value": "b", "future_l": null}],
                                 "future_ls": {}},
                    "future_s": {"nested": {"deep": [true]}}
                },
                "future_d": 7
            },
            "shared": {"future_sh": 0},
            "future_top": "yes"
        }
    ])
}

#[test]
fn mesos_json_round_trips_to_equal_values() {
    let samples = mesos_samples();
    let text = serde_json::to_string_pretty(&samples).unwrap();
    let resources = parse_resources(&text).unwrap();
    assert_eq!(resources.len(), samples.as_array().unwrap().len());
    for (resource, sample) in resources.iter().zip(samples.as_array().unwrap()) {
        assert_eq!(&serde_json::to_value(resource).unwrap(), sample);
        // And through text once more: the model is stable.
        let again: Resource =
            serde_json::from_str(&serde_json::to_string(resource).unwrap()).unwrap();
        assert_eq!(&again, resource);
    }
    assert_eq!(serde_json::to_value(&resources).unwrap(), samples);
}

#[test]
fn accessors_read_mesos_samples() {
    let resources = parse_resources(&mesos_samples().to_string()).unwrap();
    let [cpus, mem, revocable, ports, set, csi, path, plain, newer] = resources.as_slice() else {
        panic!("expected 9 samples");
    };

    assert!(!cpus.is_disk());
    assert_eq!(cpus.role(), "*");
    assert_eq!(cpus.scalar.as_ref().unwrap().as_f64(), 0.5);
    assert_eq!(mem.size_bytes(), None, "only disks have a size in bytes");
    assert!(revocable.is_revocable() && !cpus.is_revocable());
    assert_eq!(ports.kind, ValueType::Ranges);
    assert_eq!(ports.ranges.as_ref().unwrap().range[1].end, 33010);
    assert_eq!(set.set.as_ref().unwrap().item, ["a100", "h100"]);

    assert!(csi.is_disk());
    assert_eq!(csi.role(), "dev/team");
    assert!(csi.read_only());
    assert_eq!(
        csi.provider_id(),
        Some("b1a3f8f0-6c1e-4f8a-9d5e-0c3c2d1e9f10-0000")
    );
    assert_eq!(csi.source_id(), Some("lvm/vg0/pg-data"));
    assert_eq!(csi.persistence_id(), Some("pg-data"));
    assert_eq!(csi.container_path(), Some("/var/lib/postgresql"));
    assert_eq!(csi.size_bytes(), Some(2048 * 1024 * 1024));
    let source = csi.disk_source().unwrap();
    assert_eq!(source.kind, SourceType::Mount);
    assert_eq!(source.profile.as_deref(), Some("fast"));
    assert_eq!(
        source.vendor.as_deref(),
        Some("org.apache.mesos.csi.test.local")
    );
    assert_eq!(
        source.metadata.as_ref().unwrap().get("fsType"),
        Some("ext4")
    );
    let refined = &csi.reservations[1];
    assert_eq!(refined.labels.as_ref().unwrap().get("owner"), Some("alice"));
    assert_eq!(refined.labels.as_ref().unwrap().get("flag"), None);

    assert!(path.is_shared() && !csi.is_shared());
    assert!(!path.read_only());
    assert_eq!(path.role(), "storage");
    assert_eq!(path.source_id(), None);
    assert_eq!(plain.role(), "web");
    assert_eq!(plain.disk_source(), None);
    assert_eq!(newer.size_bytes(), Some(1024 * 1024 * 3 / 2));
    assert_eq!(newer.extra.get("future_top"), Some(&json!("yes")));
}

#[test]
fn mesos_samples_resolve_to_mesos_paths() {
    let resources = parse_resources(&mesos_samples().to_string()).unwrap();
    let wd = Path::new(WORK_DIR);
    let want: [Result<&str, &str>; 9] = [
        Err("name"),
        Err("name"),
        Err("name"),
        Err("name"),
        Err("name"),
        Ok("/var/lib/csi-isolator/csi/org.apache.mesos.csi.test/local/mounts/lvm%2Fvg0%2Fpg-data/target"),
        Ok("/mnt/path-disk-1/volumes/roles/storage/ledger"),
        Ok("/var/lib/csi-isolator/volumes/roles/web/cache"),
        Ok("/m/v/target"),
    ];
    for (resource, want) in resources.iter().zip(want) {
        check(resource, wd, want);
    }
}

#[test]
fn a_relative_root_follows_the_resolving_agent() {
    let volume = Resource::csi_volume(
        "rp",
        "vol-1",
        "./csi/t/n/mounts",
        1,
        None,
        None,
        Vec::<(String, String)>::new(),
    );
    for wd in ["/agent-x", "/srv/agent-y/work"] {
        assert_eq!(
            resolve_host_path(&volume, Path::new(wd)).unwrap(),
            Path::new(wd).join("csi/t/n/mounts/vol-1/target")
        );
    }
}

/// Asserts `resource` resolves under `wd` to `want`: `Ok(path)` or `Err(field)`.
#[track_caller]
fn check(resource: &Resource, wd: &Path, want: Result<&str, &str>) {
    match (resolve_host_path(resource, wd), want) {
        (Ok(got), Ok(path)) => assert_eq!(got, PathBuf::from(path), "{}", resource.describe()),
        (Err(err), Err(field)) => {
            assert_eq!(err.field(), Some(field), "{}: {err}", resource.describe());
            // The message names the resource and the field.
            let msg = err.to_string();
            assert!(msg.contains(&resource.describe()), "{msg}");
            assert!(msg.contains(field), "{msg}");
        }
        (got, want) => panic!("{}: got {got:?}, want {want:?}", resource.describe()),
    }
}

fn mount_volume(id: &str) -> Resource {
    Resource::csi_volume(
        "rp",
        id,
        "./csi/t/n/mounts",
        64,
        Some("p"),
        Some("v"),
        [("k", "v")],
    )
    .with_reservation(ReservationInfo::dynamic("dev", Some("ops")))
    .with_reservation(ReservationInfo::dynamic("dev/team", Some("ops")))
    .with_volume("data", VolumeMode::Rw)
}

fn path_volume(root: &str, persistence_id: &str, role: &str) -> Resource {
    let mut r = Resource::scalar("disk", 16.0)
        .with_reservation(ReservationInfo::static_for(role))
        .with_persistence(persistence_id, Some("fw"))
        .with_volume("data", VolumeMode::Ro);
    r.disk.as_mut().unwrap().source =
        Some(serde_json::from_value(json!({"type": "PATH", "path": {"root": root}})).unwrap());
    r
}

/// The name of an over-long id: the given prefix of its encoding, `~`, and
/// the hex SHA-256 of the whole id.
fn hashed_name(prefix: &str, id: &str) -> String {
    let hex: String = Sha256::digest(id.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("{prefix}~{hex}")
}

#[test]
fn hostile_volume_ids_are_encoded_into_one_component() {
    let wd = Path::new(WORK_DIR);
    let mounts = "/var/lib/csi-isolator/csi/t/n/mounts";
    let long_id = "x".repeat(4096);
    let long_slashes = "/".repeat(4096);
    let cases: Vec<(&str, Result<String, &str>)> = vec![
        ("../../etc", Ok(format!("{mounts}/..%2F..%2Fetc/target"))),
        ("a/b", Ok(format!("{mounts}/a%2Fb/target"))),
        ("..", Ok(format!("{mounts}/%2E%2E/target"))),
        (".", Ok(format!("{mounts}/%2E/target"))),
        ("...", Ok(format!("{mounts}/.../target"))),
        ("a\0b", Ok(format!("{mounts}/a%00b/target"))),
        ("a\nb", Ok(format!("{mounts}/a%0Ab/target"))),
        ("\\040", Ok(format!("{mounts}/%5C040/target"))),
        ("sp ace", Ok(format!("{mounts}/sp%20ace/target"))),
        ("/", Ok(format!("{mounts}/%2F/target"))),
        (
            "données/é",
            Ok(format!("{mounts}/donn%C3%A9es%2F%C3%A9/target")),
        ),
        ("卷-1", Ok(format!("{mounts}/%E5%8D%B7-1/target"))),
        (
            &long_id,
            Ok(format!(
                "{mounts}/{}/target",
                hashed_name(&"x".repeat(135), &long_id)
            )),
        ),
        // 45 whole `%2F` escapes fit the 135-byte prefix.
        (
            &long_slashes,
            Ok(format!(
                "{mounts}/{}/target",
                hashed_name(&"%2F".repeat(45), &long_slashes)
            )),
        ),
        ("", Err("disk.source.id")),
    ];
    for (id, want) in &cases {
        let resource = mount_volume(id);
        check(&resource, wd, want.as_deref().map_err(|e| *e));
        if let Ok(path) = resolve_host_path(&resource, wd) {
            // Exactly two components below the root, the first one decodable
            // unless it was hashed.
            let rel = path.strip_prefix(mounts).unwrap();
            assert_eq!(rel.components().count(), 2, "{id:?}");
            let name = rel
                .components()
                .next()
                .unwrap()
                .as_os_str()
                .to_str()
                .unwrap();
            assert!(name.len() <= MAX_ENCODED_LEN);
            if id.len() < 100 {
                assert_eq!(decode_volume_id(name).as_deref(), Some(*id));
            } else {
                assert_eq!(decode_volume_id(name), None);
            }
        }
    }
}

#[test]
fn hostile_persistence_ids_and_roles_are_refused() {
    let wd = Path::new(WORK_DIR);
    let long_id = "p".repeat(4096);
    let cases: Vec<(&str, &str, Result<&str, &str>)> = vec![
        ("pv", "dev/team", Ok("/srv/p/volumes/roles/dev team/pv")),
        ("é-1", "dev", Ok("/srv/p/volumes/roles/dev/é-1")),
        ("a\nb", "dev", Ok("/srv/p/volumes/roles/dev/a\nb")),
        ("\\040", "dev", Ok("/srv/p/volumes/roles/dev/\\040")),
        ("...", "dev", Ok("/srv/p/volumes/roles/dev/...")),
        ("../../etc", "dev", Err("disk.persistence.id")),
        ("a/b", "dev", Err("disk.persistence.id")),
        ("..", "dev", Err("disk.persistence.id")),
        (".", "dev", Err("disk.persistence.id")),
        ("", "dev", Err("disk.persistence.id")),
        ("a\0b", "dev", Err("disk.persistence.id")),
        (&long_id, "dev", Err("disk.persistence.id")),
        ("pv", "../x", Err("reservations[0].role")),
        ("pv", "dev/..", Err("reservations[0].role")),
        ("pv", "..", Err("reservations[0].role")),
        ("pv", "/etc", Err("reservations[0].role")),
        ("pv", "dev//team", Err("reservations[0].role")),
        ("pv", "dev\n", Err("reservations[0].role")),
        ("pv", "d\0", Err("reservations[0].role")),
        ("pv", "*", Err("reservations[0].role")),
    ];
    for (id, role, want) in cases {
        check(&path_volume("/srv/p", id, role), wd, want);
    }

    // Without reservations the deprecated `role` field is the one at fault.
    let mut unreserved = path_volume("/srv/p", "pv", "dev");
    unreserved.reservations.clear();
    check(&unreserved, wd, Err("role"));
    unreserved.role = Some("../up".into());
    check(&unreserved, wd, Err("role"));
    unreserved.role = Some("ops".into());
    check(&unreserved, wd, Ok("/srv/p/volumes/roles/ops/pv"));

    // A PATH disk or a default disk without persistence has no volume path.
    let mut bare = path_volume("/srv/p", "pv", "dev");
    bare.disk.as_mut().unwrap().persistence = None;
    check(&bare, wd, Err("disk.persistence.id"));
    bare.disk.as_mut().unwrap().source = None;
    check(&bare, wd, Err("disk.persistence.id"));
}

#[test]
fn hostile_roots_are_refused() {
    let wd = Path::new(WORK_DIR);
    let cases: &[(&str, Result<&str, &str>)] = &[
        (
            "./csi/t/n/mounts",
            Ok("/var/lib/csi-isolator/csi/t/n/mounts/v/target"),
        ),
        ("csi//t/./n/", Ok("/var/lib/csi-isolator/csi/t/n/v/target")),
        (".", Ok("/var/lib/csi-isolator/v/target")),
        ("/srv/./d//e/", Ok("/srv/d/e/v/target")),
        ("/", Ok("/v/target")),
        ("../x", Err("disk.source.mount.root")),
        ("./a/../../b", Err("disk.source.mount.root")),
        ("a/..", Err("disk.source.mount.root")),
        ("..", Err("disk.source.mount.root")),
        ("/srv/../etc", Err("disk.source.mount.root")),
        ("/srv/d/..", Err("disk.source.mount.root")),
        ("/srv/\0/d", Err("disk.source.mount.root")),
        ("\0", Err("disk.source.mount.root")),
        ("", Err("disk.source.mount.root")),
    ];
    for (root, want) in cases {
        let mut r = mount_volume("v");
        let source = r.disk.as_mut().unwrap().source.as_mut().unwrap();
        source.mount.as_mut().unwrap().root = Some((*root).to_owned());
        check(&r, wd, *want);

        // The same root on a PATH disk is judged by the same rules.
        let want_path = match want {
            Ok(_) => None,
            Err(_) => Some(Err("disk.source.path.root")),
        };
        if let Some(want_path) = want_path {
            check(&path_volume(root, "pv", "dev"), wd, want_path);
        }
    }
}

#[test]
fn disks_without_an_id_map_onto_their_root() {
    let wd = Path::new(WORK_DIR);
    let mut mount = mount_volume("v");
    mount.disk.as_mut().unwrap().source.as_mut().unwrap().id = None;
    check(&mount, wd, Ok("/var/lib/csi-isolator/csi/t/n/mounts"));

    let mut path = path_volume("/srv/p", "pv", "a/b/c");
    check(&path, wd, Ok("/srv/p/volumes/roles/a b c/pv"));
    path.disk.as_mut().unwrap().source.as_mut().unwrap().id = Some("a/b".into());
    check(&path, wd, Ok("/srv/p/a%2Fb/target/volumes/roles/a b c/pv"));
}

#[test]
fn unmountable_and_unknown_sources_are_refused() {
    let wd = Path::new(WORK_DIR);
    // BLOCK with an id is a CSI block volume (its device file, like a MOUNT disk's mount point);
    // without one it has no path.
    let block: Resource = serde_json::from_value(json!({
        "name": "disk", "type": "SCALAR", "scalar": {"value": 1},
        "disk": {"source": {"type": "BLOCK", "id": "v", "mount": {"root": "/m"}}}
    }))
    .unwrap();
    assert_eq!(
        resolve_host_path(&block, wd).unwrap(),
        Path::new("/m/v/target")
    );
    for (kind, variant) in [("RAW", true), ("UNKNOWN", false), ("NFS", false)] {
        let resource: Resource = serde_json::from_value(json!({
            "name": "disk", "type": "SCALAR", "scalar": {"value": 1},
            "disk": {"source": {"type": kind, "id": "v", "mount": {"root": "/m"}}}
        }))
        .unwrap();
        let err = resolve_host_path(&resource, wd).unwrap_err();
        assert_eq!(err.field(), Some("disk.source.type"), "{kind}: {err}");
        assert!(err.to_string().contains(kind), "{err}");
        assert_eq!(
            matches!(err, ResourceError::NotMountable { .. }),
            variant,
            "{kind}"
        );
    }
}

#[test]
fn error_messages_name_resource_and_field() {
    let r = path_volume("/srv/p", "../../etc", "dev");
    let err = resolve_host_path(&r, Path::new(WORK_DIR)).unwrap_err();
    assert_eq!(
        err.to_string(),
        r#"resource disk (persistence id "../../etc"): invalid field disk.persistence.id "../../etc": contains '/'"#
    );

    let mut r = mount_volume("vol\n1");
    r.disk.as_mut().unwrap().source.as_mut().unwrap().mount = None;
    let err = resolve_host_path(&r, Path::new(WORK_DIR)).unwrap_err();
    assert_eq!(
        err.to_string(),
        r#"resource disk (id "vol\n1"): missing field disk.source.mount.root"#
    );

    let err = resolve_host_path(&Resource::scalar("cpus", 1.0), Path::new(WORK_DIR)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "resource cpus: field name: not a disk resource, no mount point"
    );
}

#[test]
fn malformed_resource_lists_are_refused() {
    for text in [
        "",
        "{}",
        r#"[{"type": "SCALAR"}]"#,
        r#"[{"name": "disk", "type": "SCALAR", "scalar": {"value": "big"}}]"#,
        r#"[{"name": "disk", "type": "SCALAR", "disk": {"source": {"id": "v"}}}]"#,
    ] {
        let err = parse_resources(text).unwrap_err();
        assert!(matches!(err, ResourceError::Parse { .. }), "{text}: {err}");
        assert_eq!(err.field(), None);
    }
    assert!(parse_resources("[]").unwrap().is_empty());
}

#[test]
fn an_unknown_disk_source_type_is_refused_by_name() {
    let json = r#"{"name":"disk","type":"SCALAR","scalar":{"value":8},
        "disk":{"source":{"type":"BOGUS","id":"vol-1","mount":{"root":"./x"}}}}"#;
    let resource: Resource = serde_json::from_str(json).unwrap();
    let err = resolve_host_path(&resource, Path::new("/var/lib/agent")).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("disk.source.type") && msg.contains("\"BOGUS\""),
        "{msg}"
    );
}
