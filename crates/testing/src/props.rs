//! Property oracles for hostile input: the fuzz targets in `fuzz/` and the
//! corpus replay in `tests/fuzz_corpus.rs` feed bytes to these functions,
//! which panic with a message naming the broken property and the input.
//!
//! Contract: each `check_*` function takes arbitrary bytes, never panics on
//! an input that the code under test handles correctly, and panics on the
//! first violation it sees. Everything is lexical: no file system access,
//! the work dirs are fixed strings that need not exist.
//!
//! The properties:
//! - [`check_resource_json`]: the resource parser never panics; whatever it
//!   accepts serializes and parses back to an equal value; every host path
//!   it resolves is absolute, normalized and exactly the one the rules
//!   give, beneath its root, and follows the resolving agent's work dir;
//!   every error message is lowercase and free of control characters.
//! - [`check_resolve`]: the same resolution properties on a disk resource
//!   built field by field from the input (see [`check_resolve`] for the
//!   layout), plus: whatever the fields hold, a path built under `root`
//!   stays under `root`, ids become one component each, and the provider's
//!   `resource::Layout` (the one production uses) puts every path where
//!   Mesos does and agrees with the resolver.
//! - [`check_container_path`]: `target_of` never yields an empty target, a
//!   `..`, `.` or root component, or a NUL, and agrees with a plain
//!   split-on-`/` model of the path.
//! - [`check_checkpoint_record`]: the checkpoint path validator never
//!   panics; every path it accepts is absolute and normal (agreeing with a
//!   byte-level model), a sandbox it accepts neither holds the work dir nor
//!   lies in it other than as `sandboxes/<id>` or `oci-hook/<id>`, and every
//!   host bind it accepts lies strictly beneath the sandbox.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use serde_json::Map;

use csi_isolator::isolator::checkpoint_paths::{check_normal, check_record, is_run_container};
use csi_isolator::isolator::targets::target_of;
use csi_isolator::isolator::{ContainerConfig, ContainerRecord};
use csi_isolator::mount::TargetRoot;
use csi_isolator::resource::{
    decode_volume_id, encode_volume_id, resolve_host_path, validate_path_component, DiskInfo,
    DiskSource, Layout, Persistence, ReservationInfo, Resource, ResourceError, SourceRoot,
    SourceType, CSI_DIR, MAX_COMPONENT_LEN, MAX_ENCODED_LEN, STATE_FILE,
};

/// The agent work dir the fuzz targets resolve against.
pub const FUZZ_WORK_DIR: &str = "/var/lib/csi-isolator";

/// The second work dir [`check_resolved`] resolves against: relative roots
/// must follow the resolving agent.
pub const OTHER_WORK_DIR: &str = "/srv/other-agent/work";

/// Where a relative container path is joined in the sandbox check.
const FAKE_SANDBOX: &str = "/var/lib/csi-isolator/sandboxes/c1";

/// What one input of [`check_resource_json`] exercised.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct JsonChecked {
    /// Resources parsed (one object, or every element of a list).
    pub resources: usize,
    /// Of those, how many resolved to a host path.
    pub resolved: usize,
    /// Container paths found in them that `target_of` accepted.
    pub targets: usize,
}

/// Oracle for the resource JSON parser (fuzz target `resource_json`).
///
/// Parses `bytes` as one `Resource` and as a list of them. Must not panic;
/// for every resource parsed: serializing it and parsing the text back
/// gives an equal value, and [`check_resolved`]'s properties hold for it
/// against [`FUZZ_WORK_DIR`]; its `disk.volume.container_path`, if any,
/// satisfies [`check_container_path`]. `parse_resources` and a plain
/// `serde_json` parse of a list agree.
pub fn check_resource_json(bytes: &[u8]) -> JsonChecked {
    let mut checked = JsonChecked::default();
    let single = serde_json::from_slice::<Resource>(bytes);
    let list = serde_json::from_slice::<Vec<Resource>>(bytes);
    if let Ok(text) = std::str::from_utf8(bytes) {
        match (csi_isolator::resource::parse_resources(text), &list) {
            (Ok(a), Ok(b)) => assert!(
                &a == b,
                "parse_resources and serde_json disagree on {:?}",
                lossy(bytes)
            ),
            (Err(err), Err(_)) => check_error(&err, bytes),
            (a, b) => panic!(
                "parse_resources gave {:?}, serde_json gave {:?}, on {:?}",
                a.map(|_| "ok"),
                b.as_ref().map(|_| "ok"),
                lossy(bytes)
            ),
        }
    }
    let resources = single
        .ok()
        .into_iter()
        .chain(list.ok().into_iter().flatten());
    for resource in resources {
        checked.resources += 1;
        check_round_trip(&resource, bytes);
        // Accessors are total.
        let _ = (
            resource.role(),
            resource.read_only(),
            resource.size_bytes(),
            resource.is_shared(),
            resource.is_revocable(),
            resource.provider_id(),
        );
        check_text(&resource.describe(), "describe()", bytes);
        if check_resolved(&resource, Path::new(FUZZ_WORK_DIR)).is_some() {
            checked.resolved += 1;
        }
        if let Some(id) = resource.source_id() {
            check_encoded(id);
        }
        if let Some(path) = resource.container_path() {
            if check_container_path(path.as_bytes()).is_some() {
                checked.targets += 1;
            }
        }
    }
    checked
}

/// Oracle for the mount-point resolver on a disk resource built from
/// `input` (fuzz target `resolve_path`), resolved with `root` as the agent
/// work dir. Returns the resolved host path, if the resolver accepted it.
///
/// Layout of `input`: byte 0 holds flags, the rest is split at `0xFF`
/// bytes into the fields `id`, `root`, `persistence id`, `role`, `plugin
/// type`, `plugin name` (missing fields are empty, bytes that are not UTF-8
/// become U+FFFD). Flags, from bit 0:
/// - bits 0-1: the source: `MOUNT`, `PATH`, none (the default disk), or
///   the type named by the `plugin type` field (`BLOCK`, which resolves like
///   `MOUNT` when it has an id, `RAW`, unknown);
/// - bit 2: the disk root is `<root>/<root field>` (absolute) instead of
///   `./<root field>` (relative, so joined to the work dir `root`);
/// - bit 3: the disk root is the root field verbatim (anything goes);
/// - bit 4: no `disk.source.id`;
/// - bit 5: the role is the deprecated `role`, not a reservation;
/// - bit 6: no `disk.persistence`.
///
/// Properties: those of [`check_resolved`]; unless bit 3 is set, an
/// accepted path lies beneath `root`; two different ids never encode alike;
/// the provider's [`Layout`] puts each id's paths exactly where Mesos does
/// ([`check_layout_paths`]); the plugin names pass the check the provider
/// makes before building a layout only if each is one safe component, and
/// then [`check_plugin_layout`] holds for them.
pub fn check_resolve(root: &str, input: &[u8]) -> Option<PathBuf> {
    let (flags, rest) = input.split_first().map_or((0, &[][..]), |(f, r)| (*f, r));
    let mut fields = rest
        .split(|&b| b == 0xFF)
        .map(|f| String::from_utf8_lossy(f).into_owned());
    let mut next = || fields.next().unwrap_or_default();
    let (id, root_field, persistence_id, role, plugin_type, plugin_name) =
        (next(), next(), next(), next(), next(), next());

    let disk_root = if flags & 0b1000 != 0 {
        root_field.clone()
    } else if flags & 0b100 != 0 {
        format!("{root}/{root_field}")
    } else {
        format!("./{root_field}")
    };
    let kind = match flags & 0b11 {
        0 => Some(SourceType::Mount),
        1 => Some(SourceType::Path),
        2 => None,
        _ => Some(SourceType::from(plugin_type.as_str())),
    };
    let source = kind.map(|kind| DiskSource {
        kind,
        path: Some(source_root(&disk_root)),
        mount: Some(source_root(&disk_root)),
        vendor: None,
        id: (flags & 0b1_0000 == 0).then(|| id.clone()),
        metadata: None,
        profile: None,
        extra: Map::new(),
    });
    let mut resource = Resource::scalar("disk", 1.0);
    if flags & 0b10_0000 != 0 {
        resource.role = Some(role.clone());
    } else {
        resource = resource.with_reservation(ReservationInfo::dynamic(role.clone(), None));
    }
    resource.disk = Some(DiskInfo {
        persistence: (flags & 0b100_0000 == 0).then(|| Persistence {
            id: persistence_id.clone(),
            principal: None,
            extra: Map::new(),
        }),
        volume: None,
        source,
        extra: Map::new(),
    });

    let resolved = check_resolved(&resource, Path::new(root));
    if let Some(path) = &resolved {
        if flags & 0b1000 == 0 {
            let base = lexical(Path::new(root));
            assert!(
                path.starts_with(&base),
                "{} is outside the work dir {root:?}, for {}",
                path.display(),
                describe_input(&resource)
            );
        }
    }

    check_encoded(&id);
    if id != persistence_id {
        assert_ne!(
            encode_volume_id(&id),
            encode_volume_id(&persistence_id),
            "ids {id:?} and {persistence_id:?} encode alike"
        );
    }
    let fixed = Layout::new(Path::new(FUZZ_WORK_DIR), "t", "n");
    check_layout_paths(&fixed, &id);
    for value in [&persistence_id, &plugin_type, &plugin_name] {
        if validate_path_component("field", value).is_ok() {
            assert_one_component(value, "validated component");
        }
    }
    // What the provider checks before it builds its layout.
    let names_ok = is_one_component(&plugin_type) && is_one_component(&plugin_name);
    let validated = validate_path_component("plugin type", &plugin_type)
        .and_then(|()| validate_path_component("plugin name", &plugin_name));
    match validated {
        Ok(()) => {
            assert!(
                names_ok,
                "plugin names {plugin_type:?} {plugin_name:?} accepted"
            );
            let layout = Layout::new(Path::new(FUZZ_WORK_DIR), &plugin_type, &plugin_name);
            check_plugin_layout(&layout, &plugin_type, &plugin_name, &id);
        }
        Err(err) => {
            assert!(
                !names_ok,
                "plugin names {plugin_type:?} {plugin_name:?} refused"
            );
            check_error(&err, input);
        }
    }
    resolved
}

/// Each of `id`'s paths in `layout` is its directory plus exactly the
/// components of Mesos' layout, the id encoded into one of them.
fn check_layout_paths(layout: &Layout, id: &str) {
    let enc = encode_volume_id(id);
    let intent = format!("{enc}.intent");
    let cases = [
        (
            "target",
            layout.target_path(id),
            layout.mounts_dir(),
            vec![enc.as_str(), "target"],
        ),
        (
            "staging",
            layout.staging_path(id),
            layout.mounts_dir(),
            vec![enc.as_str(), "staging"],
        ),
        (
            "state file",
            layout.state_file(id),
            layout.volumes_dir(),
            vec![enc.as_str(), STATE_FILE],
        ),
        (
            "intent",
            layout.create_intent(id),
            layout.creating_dir(),
            vec![intent.as_str()],
        ),
    ];
    for (what, path, dir, want) in cases {
        let tail: Vec<_> = path
            .strip_prefix(&dir)
            .unwrap_or_else(|_| panic!("{what} path of id {id:?} left {}", dir.display()))
            .components()
            .collect();
        let want: Vec<_> = want
            .into_iter()
            .map(|c| Component::Normal(OsStr::new(c)))
            .collect();
        assert_eq!(tail, want, "{what} path of id {id:?} is {}", path.display());
    }
}

/// The layout of validated plugin names lies at `csi/<type>/<name>` beneath
/// the work dir, writes that relative root into resources, and the resolver
/// maps a resource with that root and `id` to the layout's own target path.
fn check_plugin_layout(layout: &Layout, plugin_type: &str, plugin_name: &str, id: &str) {
    let tail: Vec<_> = layout
        .base()
        .strip_prefix(FUZZ_WORK_DIR)
        .expect("plugin dir beneath the work dir")
        .components()
        .collect();
    assert_eq!(
        tail,
        [CSI_DIR, plugin_type, plugin_name].map(|c| Component::Normal(OsStr::new(c))),
        "plugin dir {}",
        layout.base().display()
    );
    let root = layout.relative_mount_root();
    assert_eq!(
        root,
        format!("./{CSI_DIR}/{plugin_type}/{plugin_name}/mounts")
    );
    check_layout_paths(layout, id);
    if id.is_empty() {
        return;
    }
    let mut resource = Resource::scalar("disk", 1.0);
    resource.disk = Some(DiskInfo {
        persistence: None,
        volume: None,
        source: Some(DiskSource {
            kind: SourceType::Mount,
            path: None,
            mount: Some(source_root(&root)),
            vendor: None,
            id: Some(id.to_owned()),
            metadata: None,
            profile: None,
            extra: Map::new(),
        }),
        extra: Map::new(),
    });
    let resolved = resolve_host_path(&resource, Path::new(FUZZ_WORK_DIR));
    assert_eq!(
        resolved.as_ref().map_err(ToString::to_string),
        Ok(&layout.target_path(id)),
        "the resolver and the layout disagree on id {id:?} under {root:?}"
    );
}

/// Oracle for `isolator::targets::target_of` (fuzz target
/// `container_path`): `input`, read as UTF-8 (invalid bytes become
/// U+FFFD), is a `container_path`. Returns the target if accepted.
///
/// For both `has_rootfs` values: an accepted target is non-empty, relative
/// and made of normal components only (no `..`, `.`, root, NUL), its root
/// follows the path's form, and it equals the model: split at `/`, drop
/// empty and `.` parts, let `..` remove the previous part (refused when
/// there is none); empty paths, NUL and an empty result are refused.
pub fn check_container_path(input: &[u8]) -> Option<PathBuf> {
    let text = String::from_utf8_lossy(input);
    let model = container_path_model(&text);
    let mut accepted = None;
    for has_rootfs in [false, true] {
        match target_of(&text, has_rootfs) {
            Ok((root, target)) => {
                let want_root = match (text.starts_with('/'), has_rootfs) {
                    (false, _) => TargetRoot::Sandbox,
                    (true, true) => TargetRoot::Rootfs,
                    (true, false) => TargetRoot::Host,
                };
                assert_eq!(root, want_root, "root of container path {text:?}");
                assert!(
                    !target.as_os_str().is_empty(),
                    "empty target for container path {text:?}"
                );
                assert!(
                    !target.as_os_str().as_bytes().contains(&0),
                    "NUL in target {target:?} of container path {text:?}"
                );
                for c in target.components() {
                    assert!(
                        matches!(c, Component::Normal(n) if n != ".." && n != "."),
                        "component {c:?} in target {target:?} of container path {text:?}"
                    );
                }
                let parts: Vec<&OsStr> = target.iter().collect();
                match &model {
                    Ok(want) => assert!(
                        parts.iter().copied().eq(want.iter().map(OsStr::new)),
                        "target {target:?} of container path {text:?}, model says {want:?}"
                    ),
                    Err(why) => panic!(
                        "target_of accepted container path {text:?} as {target:?}; model: {why}"
                    ),
                }
                let sandbox = Path::new(FAKE_SANDBOX);
                let joined = sandbox.join(&target);
                assert!(
                    joined.starts_with(sandbox) && lexical(&joined) == joined,
                    "target {target:?} joined to the sandbox is {}",
                    joined.display()
                );
                accepted = Some(target);
            }
            Err(reason) => {
                if let Ok(want) = &model {
                    panic!(
                        "target_of refused container path {text:?} ({reason}); model says {want:?}"
                    );
                }
                check_text(&reason, "target_of error", input);
            }
        }
    }
    accepted
}

/// Oracle for the checkpoint path validator (fuzz target
/// `checkpoint_record`), against the work dir [`FUZZ_WORK_DIR`]. Returns
/// whether the record was accepted.
///
/// `input` is a container checkpoint (`state.json`) if it parses as one;
/// otherwise its fields, split at `0xFF` bytes, are the sandbox, the
/// container id and then host binds, taken as raw bytes (not necessarily
/// UTF-8).
///
/// Properties: `check_normal` agrees with a byte-level model on every
/// path of the record (starts with `/`, is not `/`, no NUL, no empty, `.`
/// or `..` component between the slashes); if `check_record` accepts the
/// record, then the sandbox, the rootfs and every host bind are normal;
/// the sandbox is neither the work dir nor one of its ancestors; a
/// sandbox inside the work dir is exactly `<work_dir>/sandboxes/<id>` or
/// `<work_dir>/oci-hook/<id>`; every host bind starts with the sandbox
/// followed by `/` and more; a record `is_run_container` calls `run`'s lies
/// in `<work_dir>/sandboxes/`. A refusal message holds no control
/// character.
pub fn check_checkpoint_record(input: &[u8]) -> bool {
    let rec = serde_json::from_slice::<ContainerRecord>(input)
        .unwrap_or_else(|_| record_from_fields(input));
    let work = Path::new(FUZZ_WORK_DIR);
    let mut paths: Vec<(&'static str, &Path)> = vec![("sandbox", &rec.config.sandbox)];
    if let Some(rootfs) = &rec.config.rootfs {
        paths.push(("rootfs", rootfs));
    }
    for b in &rec.host_binds {
        paths.push(("host bind", b));
    }
    for (field, path) in &paths {
        let bytes = path.as_os_str().as_bytes();
        let got = check_normal(field, path);
        assert_eq!(
            got.is_ok(),
            normal_model(bytes),
            "check_normal({field} {:?}) = {got:?}, model disagrees",
            bytes.escape_ascii().to_string()
        );
    }
    let verdict = check_record(&rec, work);
    let Ok(()) = verdict else {
        let msg = verdict.unwrap_err().to_string();
        check_text(&msg, "refusal", input);
        return false;
    };
    let shown = |p: &Path| p.as_os_str().as_bytes().escape_ascii().to_string();
    for (field, path) in &paths {
        assert!(
            normal_model(path.as_os_str().as_bytes()),
            "accepted {field} {} is not normal",
            shown(path)
        );
    }
    let slashed = |p: &Path| {
        let mut b = p.as_os_str().as_bytes().to_vec();
        b.push(b'/');
        b
    };
    let sandbox = &rec.config.sandbox;
    let (work_s, sandbox_s) = (slashed(work), slashed(sandbox));
    assert!(
        !work_s.starts_with(&sandbox_s),
        "accepted sandbox {} holds the work dir",
        shown(sandbox)
    );
    if sandbox_s.starts_with(&work_s) {
        let own = [
            csi_isolator::workdir::RUN_SANDBOXES,
            csi_isolator::workdir::HOOK_DIR,
        ]
        .iter()
        .any(|area| *sandbox == work.join(area).join(&rec.container_id));
        assert!(
            own && !rec.container_id.contains('/'),
            "accepted sandbox {} lies in the work dir but is not container {:?}'s",
            shown(sandbox),
            rec.container_id
        );
    }
    for b in &rec.host_binds {
        let bytes = b.as_os_str().as_bytes();
        assert!(
            bytes.starts_with(&sandbox_s) && bytes.len() > sandbox_s.len(),
            "accepted host bind {} is not beneath the sandbox {}",
            shown(b),
            shown(sandbox)
        );
    }
    if is_run_container(&rec, work) {
        assert!(
            sandbox_s.starts_with(&slashed(&work.join("sandboxes"))),
            "run container {} outside sandboxes/",
            shown(sandbox)
        );
    }
    true
}

/// The record [`check_checkpoint_record`] builds from raw fields.
fn record_from_fields(input: &[u8]) -> ContainerRecord {
    let mut fields = input.split(|b| *b == 0xFF);
    let mut path = || PathBuf::from(OsStr::from_bytes(fields.next().unwrap_or_default()));
    let sandbox = path();
    let container_id = path().to_string_lossy().into_owned();
    let host_binds = fields
        .map(|f| PathBuf::from(OsStr::from_bytes(f)))
        .collect();
    let config = ContainerConfig {
        sandbox,
        ..ContainerConfig::default()
    };
    ContainerRecord {
        host_binds,
        binds_in_sandbox: true,
        ..ContainerRecord::new(&container_id, config, Vec::new())
    }
}

/// The byte-level model of a normal absolute path.
fn normal_model(bytes: &[u8]) -> bool {
    bytes.len() > 1
        && bytes[0] == b'/'
        && !bytes.contains(&0)
        && bytes[1..]
            .split(|b| *b == b'/')
            .all(|c| !c.is_empty() && c != b"." && c != b"..")
}

/// The resolution properties of one resource against `work_dir`; returns
/// the path if the resolver accepted the resource.
///
/// - Resolving twice gives the same answer; an error message is one
///   lowercase line without control characters and names a field.
/// - An accepted path is absolute and normalized (only normal components,
///   no NUL), the work dir was valid, and the path is exactly its base
///   (`<root>` or `<work dir>/volumes/roles`) followed by one component
///   per step of the rules: the encoded id and `target`, `volumes`,
///   `roles`, the role (`/` as ` `), the persistence id. An id or role that
///   would not be one component, a root with `..` or NUL, an empty id, or
///   a non-mountable source must have been refused.
/// - With [`OTHER_WORK_DIR`] the verdict is the same; an absolute root
///   gives the same path, a relative root (or the default disk) the same
///   path beneath the other work dir.
pub fn check_resolved(resource: &Resource, work_dir: &Path) -> Option<PathBuf> {
    let got = resolve_host_path(resource, work_dir);
    let again = resolve_host_path(resource, work_dir);
    assert_eq!(
        got.as_ref().map_err(ToString::to_string),
        again.as_ref().map_err(ToString::to_string),
        "resolution is not deterministic for {}",
        describe_input(resource)
    );
    let path = match got {
        Ok(path) => path,
        Err(err) => {
            check_error(&err, describe_input(resource).as_bytes());
            return None;
        }
    };
    let input = || describe_input(resource);
    let wd_bytes = work_dir.as_os_str().as_bytes();
    assert!(
        work_dir.is_absolute()
            && !wd_bytes.contains(&0)
            && !work_dir.components().any(|c| c == Component::ParentDir),
        "work dir {work_dir:?} accepted for {}",
        input()
    );
    assert_normal_absolute(&path, resource);
    assert!(resource.is_disk(), "non-disk resolved: {}", input());
    let wd = lexical(work_dir);

    let role_part = || resource.role().replace('/', " ");
    let persistence = || {
        resource
            .persistence_id()
            .unwrap_or_else(|| panic!("resolved without a persistence id: {}", input()))
            .to_owned()
    };
    let (base, tail, relative): (PathBuf, Vec<String>, bool) = match resource.disk_source() {
        None => (
            wd.join("volumes").join("roles"),
            vec![role_part(), persistence()],
            true,
        ),
        Some(source) => {
            // A BLOCK disk resolves only as a CSI block volume: with its id, like MOUNT.
            assert!(
                matches!(source.kind, SourceType::Mount | SourceType::Path)
                    || (source.kind == SourceType::Block && source.id.is_some()),
                "source type {} resolved: {}",
                source.kind,
                input()
            );
            let root = source
                .root()
                .filter(|r| !r.is_empty())
                .unwrap_or_else(|| panic!("resolved without a root: {}", input()));
            assert!(
                !root.contains('\0')
                    && !Path::new(root)
                        .components()
                        .any(|c| c == Component::ParentDir),
                "root {root:?} with NUL or '..' accepted: {}",
                input()
            );
            let relative = !Path::new(root).is_absolute();
            let base = if relative {
                lexical(&wd.join(root))
            } else {
                lexical(Path::new(root))
            };
            let mut tail = Vec::new();
            match source.id.as_deref() {
                Some("") => panic!("empty disk.source.id accepted: {}", input()),
                Some(id) => tail.extend([encode_volume_id(id), "target".to_owned()]),
                None => {}
            }
            if source.kind == SourceType::Path {
                tail.extend([
                    "volumes".to_owned(),
                    "roles".to_owned(),
                    role_part(),
                    persistence(),
                ]);
            }
            (base, tail, relative)
        }
    };
    let rest = path.strip_prefix(&base).unwrap_or_else(|_| {
        panic!(
            "{} is not beneath its root {}: {}",
            path.display(),
            base.display(),
            input()
        )
    });
    assert!(
        rest.iter().eq(tail.iter().map(OsStr::new)),
        "{} is {} + {:?}, the rules give {:?}: {}",
        path.display(),
        base.display(),
        rest,
        tail,
        input()
    );

    if work_dir != Path::new(OTHER_WORK_DIR) {
        let other = resolve_host_path(resource, Path::new(OTHER_WORK_DIR));
        let other = other.unwrap_or_else(|err| {
            panic!(
                "resolves under {} but not under {OTHER_WORK_DIR} ({err}): {}",
                work_dir.display(),
                input()
            )
        });
        let want =
            if relative {
                Path::new(OTHER_WORK_DIR).join(path.strip_prefix(&wd).unwrap_or_else(|_| {
                    panic!("{} is not beneath {}", path.display(), wd.display())
                }))
            } else {
                path.clone()
            };
        assert_eq!(other, want, "under another work dir: {}", input());
    }
    Some(path)
}

/// An error message is one lowercase line with no control characters, so
/// hostile values in it cannot forge log lines; resolver errors name a
/// field.
fn check_error(err: &ResourceError, input: &[u8]) {
    let msg = err.to_string();
    check_text(&msg, "error message", input);
    assert!(
        msg.starts_with(|c: char| c.is_ascii_lowercase()),
        "error message {msg:?} does not start lowercase, on {:?}",
        lossy(input)
    );
    if !matches!(err, ResourceError::Parse { .. }) {
        assert!(err.field().is_some(), "error {msg:?} names no field");
    }
}

fn check_text(text: &str, what: &str, input: &[u8]) {
    assert!(
        !text.chars().any(char::is_control),
        "{what} {text:?} holds a control character, on {:?}",
        lossy(input)
    );
}

/// Serialize and parse back: equal value, and a stable JSON value.
fn check_round_trip(resource: &Resource, input: &[u8]) {
    let text = serde_json::to_string(resource)
        .unwrap_or_else(|err| panic!("serialize a parsed resource: {err}, on {:?}", lossy(input)));
    let back: Resource = serde_json::from_str(&text)
        .unwrap_or_else(|err| panic!("parse back {text:?}: {err}, from input {:?}", lossy(input)));
    assert!(
        &back == resource,
        "round trip changed the resource:\n  parsed {resource:?}\n  back   {back:?}\n  text   {text}\n  input  {:?}",
        lossy(input)
    );
    let value = serde_json::to_value(resource).expect("to_value of a parsed resource");
    let from_value: Resource = serde_json::from_value(value.clone())
        .unwrap_or_else(|err| panic!("from_value of {value}: {err}"));
    assert!(
        &from_value == resource,
        "round trip through a Value changed the resource: {value}"
    );
}

/// `encode_volume_id` gives one safe, bounded component that decodes back.
fn check_encoded(id: &str) {
    let enc = encode_volume_id(id);
    assert!(
        !enc.is_empty() && enc.len() <= MAX_ENCODED_LEN,
        "encoding of {id:?} is {} bytes",
        enc.len()
    );
    assert!(
        enc.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-%~".contains(&b)),
        "encoding {enc:?} of {id:?} leaves its alphabet"
    );
    assert_one_component(&enc, "encoded id");
    if let Some(back) = decode_volume_id(&enc) {
        assert_eq!(back, id, "decode(encode({id:?}))");
    } else {
        assert!(
            enc.contains('~'),
            "unhashed encoding {enc:?} of {id:?} does not decode"
        );
    }
}

fn is_one_component(value: &str) -> bool {
    !value.is_empty()
        && value != "."
        && value != ".."
        && !value.contains('/')
        && !value.contains('\0')
        && value.len() <= MAX_COMPONENT_LEN
}

fn assert_one_component(value: &str, what: &str) {
    let mut comps = Path::new(value).components();
    assert!(
        matches!(comps.next(), Some(Component::Normal(n)) if n == OsStr::new(value))
            && comps.next().is_none()
            && !value.contains('\0'),
        "{what} {value:?} is not one path component"
    );
}

fn assert_normal_absolute(path: &Path, resource: &Resource) {
    let mut comps = path.components();
    assert_eq!(
        comps.next(),
        Some(Component::RootDir),
        "{} is not absolute: {}",
        path.display(),
        describe_input(resource)
    );
    for c in comps {
        assert!(
            matches!(c, Component::Normal(n) if !n.as_bytes().contains(&0)),
            "{} holds {c:?}: {}",
            path.display(),
            describe_input(resource)
        );
    }
}

/// `.` components dropped; `..` kept (callers refuse it first).
fn lexical(path: &Path) -> PathBuf {
    path.components()
        .filter(|c| *c != Component::CurDir)
        .collect()
}

/// The plain model of `target_of`.
fn container_path_model(text: &str) -> Result<Vec<&str>, &'static str> {
    if text.is_empty() {
        return Err("empty");
    }
    if text.contains('\0') {
        return Err("NUL");
    }
    let mut parts = Vec::new();
    for part in text.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                if parts.pop().is_none() {
                    return Err("'..' above the root");
                }
            }
            other => parts.push(other),
        }
    }
    if parts.is_empty() {
        return Err("the root itself");
    }
    Ok(parts)
}

fn source_root(root: &str) -> SourceRoot {
    SourceRoot {
        root: Some(root.to_owned()),
        extra: Map::new(),
    }
}

fn describe_input(resource: &Resource) -> String {
    serde_json::to_string(resource).unwrap_or_else(|_| format!("{resource:?}"))
}

fn lossy(bytes: &[u8]) -> std::borrow::Cow<'_, str> {
    String::from_utf8_lossy(bytes)
}
