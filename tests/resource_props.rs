//! Property tests (proptest) of the Mesos resource parser, the volume-id
//! encoding and the mount-point resolver: hostile input never panics, never
//! yields an unsafe path component, and never resolves outside its root.
//! Failing cases proptest finds are kept in `proptest-regressions/` and
//! replayed first on every run.

use std::path::{Component, Path};

use csi_isolator::resource::{
    decode_volume_id, encode_volume_id, parse_resources, resolve_host_path, Resource,
    MAX_ENCODED_LEN,
};
use proptest::prelude::*;

/// Strings biased towards what breaks paths: separators, dots, NUL,
/// newlines, octal escapes, percent signs, non-ASCII.
fn hostile() -> impl Strategy<Value = String> {
    let atoms = prop::sample::select(vec![
        "/", "..", ".", "\0", "\n", "\\040", "%", "%2F", "%2e", " ", "~", "a", "é", "日", "\u{7f}",
        "//", "../", "./",
    ]);
    prop_oneof![
        prop::collection::vec(atoms, 0..12).prop_map(|v| v.concat()),
        ".{0,64}",
        "[a-z]{4000,4200}",
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn encoded_ids_are_one_safe_component(id in hostile()) {
        let enc = encode_volume_id(&id);
        prop_assert!(!enc.is_empty());
        prop_assert!(enc != "." && enc != "..");
        prop_assert!(!enc.contains('/') && !enc.contains('\0'));
        prop_assert!(enc.len() <= MAX_ENCODED_LEN.max(255));
        let mut comps = Path::new(&enc).components();
        prop_assert!(matches!(comps.next(), Some(Component::Normal(_))));
        prop_assert!(comps.next().is_none());
        if let Some(back) = decode_volume_id(&enc) {
            prop_assert_eq!(back, id);
        }
    }

    #[test]
    fn distinct_ids_never_share_a_name(a in hostile(), b in hostile()) {
        prop_assume!(a != b);
        prop_assert_ne!(encode_volume_id(&a), encode_volume_id(&b));
    }

    #[test]
    fn the_parser_never_panics(text in ".{0,400}") {
        let _ = parse_resources(&text);
    }

    #[test]
    fn mangled_resource_json_never_panics(id in hostile(), root in hostile(), path in hostile(), role in hostile()) {
        let json = serde_json::json!([{
            "name": "disk", "type": "SCALAR", "scalar": {"value": 1},
            "reservations": [{"type": "DYNAMIC", "role": role}],
            "disk": {
                "source": {"type": "MOUNT", "id": id, "mount": {"root": root}},
                "persistence": {"id": path.clone()},
                "volume": {"container_path": path, "mode": "RW"}
            }
        }]);
        let _ = parse_resources(&json.to_string());
    }

    #[test]
    fn resolution_stays_beneath_its_root(
        id in hostile(),
        root in hostile(),
        persistence in hostile(),
        role in hostile(),
        kind in prop::sample::select(vec!["MOUNT", "PATH"]),
        absolute in any::<bool>(),
    ) {
        let work = Path::new("/var/lib/agent");
        let root_text = if absolute { format!("/srv/{root}") } else { format!("./{root}") };
        let resource: Resource = match serde_json::from_value(serde_json::json!({
            "name": "disk", "type": "SCALAR", "scalar": {"value": 1},
            "reservations": [{"type": "DYNAMIC", "role": role}],
            "disk": {
                "source": {"type": kind, "id": id, "mount": {"root": root_text}, "path": {"root": root_text}},
                "persistence": {"id": persistence}
            }
        })) {
            Ok(r) => r,
            Err(_) => return Ok(()),
        };
        if let Ok(resolved) = resolve_host_path(&resource, work) {
            prop_assert!(resolved.is_absolute());
            let base = if absolute { Path::new("/srv") } else { work };
            prop_assert!(resolved.starts_with(base), "{} outside {}", resolved.display(), base.display());
            prop_assert!(
                !resolved.components().any(|c| matches!(c, Component::ParentDir | Component::CurDir)),
                "{} is not normalized", resolved.display()
            );
        }
    }
}

/// The resolution property is not vacuous: the same JSON shape with plain
/// values resolves, for both kinds and both root forms.
#[test]
fn the_property_shape_resolves_for_plain_values() {
    for (kind, root, expected) in [
        (
            "MOUNT",
            "./csi/t/n/mounts",
            "/var/lib/agent/csi/t/n/mounts/vol-1/target",
        ),
        ("MOUNT", "/srv/mounts", "/srv/mounts/vol-1/target"),
        (
            "PATH",
            "/srv/mounts",
            "/srv/mounts/vol-1/target/volumes/roles/dev team/p1",
        ),
    ] {
        let resource: Resource = serde_json::from_value(serde_json::json!({
            "name": "disk", "type": "SCALAR", "scalar": {"value": 1},
            "reservations": [{"type": "DYNAMIC", "role": "dev/team"}],
            "disk": {
                "source": {"type": kind, "id": "vol-1", "mount": {"root": root}, "path": {"root": root}},
                "persistence": {"id": "p1"}
            }
        }))
        .unwrap();
        let resolved = resolve_host_path(&resource, Path::new("/var/lib/agent")).unwrap();
        assert_eq!(resolved, Path::new(expected), "{kind} {root}");
    }
}
