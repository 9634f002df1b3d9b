//! Who may name what: tenants, the admission of a resources annotation's entries, the per-tenant caps.

use super::*;

/// Whose volume names a container's annotations use (see "Who may name what" in the module doc).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Tenant {
    /// Tenants are off: the host is one tenant, names are passed as written.
    Single,
    /// The value of the operator's tenant annotation ([`validate_tenant`]).
    Named(String),
}

impl std::fmt::Display for Tenant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Tenant::Single => f.write_str("the single tenant"),
            Tenant::Named(t) => write!(f, "tenant '{t}'"),
        }
    }
}

impl Tenant {
    /// The name the provider is asked for when an annotation says `name`: `<tenant>.<name>`, or `name`
    /// for the single tenant. Fails (saying why) when that is over CSI's 128 bytes.
    pub fn scoped_name(&self, name: &str) -> Result<String, String> {
        let scoped = match self {
            Tenant::Single => name.to_string(),
            Tenant::Named(t) => format!("{t}{TENANT_SEPARATOR}{name}"),
        };
        if scoped.len() > MAX_NAME_BYTES {
            let counted = match self {
                Tenant::Single => "",
                Tenant::Named(_) => ", the tenant and the '.' included",
            };
            return Err(format!(
                "the volume name the provider is asked for is {} bytes{counted}, over CSI's limit of \
                 {MAX_NAME_BYTES} bytes; choose a shorter name",
                scoped.len()
            ));
        }
        Ok(scoped)
    }

    /// Whether a volume recorded under `recorded` (`None`: a volume declared by id, without a name) is
    /// this tenant's: any volume for the single tenant; for a named tenant, a name `<tenant>.<...>`.
    pub fn owns(&self, recorded: Option<&str>) -> bool {
        match self {
            Tenant::Single => true,
            Tenant::Named(t) => recorded
                .and_then(|n| n.split_once(TENANT_SEPARATOR))
                .is_some_and(|(owner, _)| owner == t),
        }
    }
}

/// Checks a tenant: 1 to [`MAX_TENANT_BYTES`] bytes of `a-z`, `0-9` and `-`, starting and ending with
/// a letter or digit (a DNS-1123 label, which a Kubernetes namespace is). So it never holds
/// [`TENANT_SEPARATOR`], nor anything that needs escaping in a message.
pub fn validate_tenant(value: &str) -> Result<(), String> {
    let allowed = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-';
    if value.is_empty() {
        Err("is empty".to_string())
    } else if value.len() > MAX_TENANT_BYTES {
        Err(format!(
            "is {} bytes, over the limit of {MAX_TENANT_BYTES}",
            value.len()
        ))
    } else if let Some(c) = value.chars().find(|c| !allowed(*c)) {
        Err(format!(
            "'{}' holds {c:?}: a tenant is a DNS-1123 label (a-z, 0-9, '-')",
            crate::shown::shown(value)
        ))
    } else if value.starts_with('-') || value.ends_with('-') {
        Err(format!(
            "'{value}' starts or ends with '-': a tenant is a DNS-1123 label"
        ))
    } else {
        Ok(())
    }
}

/// What a resources annotation's disks must match to be volumes of this hook's provider. Before the
/// provider is started only what its configuration tells is known (a plugin at an endpoint names its
/// type, hence the provider id and root, only once asked); the same rule runs again, complete, after.
#[derive(Clone, Copy, Debug)]
pub struct OwnVolumes<'a> {
    /// The provider id, once known.
    pub provider_id: Option<&'a str>,
    /// The provider's relative mounts root `./csi/<type>/<name>/mounts`, once known.
    pub mounts_root: Option<&'a str>,
    /// The provider's volumes (volume id -> recorded name), once it is started.
    pub volumes: Option<&'a BTreeMap<String, Option<String>>>,
    /// The container's tenant.
    pub tenant: &'a Tenant,
}

/// Whether `resource` (an entry of a resources annotation) is a volume of this hook's provider, of the
/// container's tenant: a disk with this provider's id, `disk.source.type` `MOUNT` or `PATH`, the root
/// of that type exactly the provider's relative mounts root, and `disk.source.id` a volume the provider
/// knows whose recorded name is the tenant's. The reason names the field and the value.
pub fn admit_resource(resource: &Resource, own: &OwnVolumes<'_>) -> Result<(), String> {
    use crate::resource::SourceType;
    use crate::shown::shown;
    if !resource.is_disk() {
        return Err("it is not a disk (the annotation names volumes)".to_string());
    }
    match (resource.provider_id(), own.provider_id) {
        (None, _) => {
            return Err("it has no provider_id (a disk of the host, not a volume)".to_string())
        }
        (Some(theirs), Some(ours)) if theirs != ours => {
            return Err(format!(
                "provider_id '{}' is not this hook's provider",
                shown(theirs)
            ))
        }
        _ => {}
    }
    let Some(source) = resource.disk_source() else {
        return Err(
            "it has no disk.source (the agent's default disk, a host directory)".to_string(),
        );
    };
    let field = match source.kind {
        SourceType::Mount => "disk.source.mount.root",
        SourceType::Path => "disk.source.path.root",
        ref other => {
            return Err(format!(
                "disk.source.type {} is not MOUNT or PATH",
                shown(other.as_str())
            ))
        }
    };
    let root = match source.root() {
        None => return Err(format!("it has no {field}")),
        Some(root) if root.starts_with('/') => {
            return Err(format!(
                "{field} '{}' is a host path, not the provider's relative mounts root",
                shown(root)
            ))
        }
        Some(root) => root,
    };
    if let Some(ours) = own.mounts_root.filter(|ours| root != *ours) {
        return Err(format!(
            "{field} '{}' is not the provider's mounts root '{ours}'",
            shown(root)
        ));
    }
    let id = match source.id.as_deref() {
        None | Some("") => return Err("it names no volume (disk.source.id)".to_string()),
        Some(id) => id,
    };
    if let Some(volumes) = own.volumes {
        match volumes.get(id) {
            None => {
                return Err(format!(
                    "disk.source.id '{}' is not a volume the provider knows",
                    shown(id)
                ))
            }
            Some(name) if !own.tenant.owns(name.as_deref()) => {
                return Err(format!(
                    "volume '{}' is not a volume of {}",
                    shown(id),
                    own.tenant
                ))
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// What a tenant's volumes take: how many, and their capacity in bytes (as the provider recorded it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Volumes.
    pub volumes: u64,
    /// Bytes.
    pub bytes: u64,
}

impl Usage {
    /// What the volumes of `tenant` among `records` take: the named volumes (created ones; a volume
    /// declared by id was not made by an annotation) that the tenant owns.
    pub fn of_tenant<'a>(
        tenant: &Tenant,
        records: impl IntoIterator<Item = &'a crate::provider::state::VolumeRecord>,
    ) -> Usage {
        records
            .into_iter()
            .filter(|r| r.name.is_some() && tenant.owns(r.name.as_deref()))
            .fold(Usage::default(), |u, r| Usage {
                volumes: u.volumes + 1,
                bytes: u.bytes.saturating_add(r.capacity_bytes),
            })
    }
}

/// A cap a creation would exceed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CapExceeded {
    /// [`MAX_VOLUMES_FLAG`].
    Volumes {
        /// The cap.
        cap: u64,
        /// The tenant's volumes before this one.
        used: u64,
    },
    /// [`MAX_CAPACITY_FLAG`].
    Capacity {
        /// The cap, in bytes.
        cap: u64,
        /// The tenant's bytes before this volume.
        used: u64,
        /// This volume's bytes.
        asked: u64,
    },
}

impl std::fmt::Display for CapExceeded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CapExceeded::Volumes { cap, used } => write!(
                f,
                "the tenant has {used} volumes and the cap is {cap} (the operator sets it with \
                 {MAX_VOLUMES_FLAG})"
            ),
            CapExceeded::Capacity { cap, used, asked } => write!(
                f,
                "{asked} more bytes would take the tenant from {used} bytes over the cap of {cap} \
                 bytes (the operator sets it with {MAX_CAPACITY_FLAG})"
            ),
        }
    }
}

/// Checks the creations `new` (name as written, bytes; in order) against the caps, starting from the
/// tenant's `used`: the first that would take the tenant over a cap is returned with the cap.
pub fn check_caps<'a>(
    policy: &HookPolicy,
    used: Usage,
    new: &[(&'a str, u64)],
) -> Result<(), (&'a str, CapExceeded)> {
    let mut now = used;
    for &(name, bytes) in new {
        if now.volumes >= policy.max_volumes_per_tenant {
            return Err((
                name,
                CapExceeded::Volumes {
                    cap: policy.max_volumes_per_tenant,
                    used: now.volumes,
                },
            ));
        }
        let total = now.bytes.checked_add(bytes);
        if total.is_none_or(|t| t > policy.max_capacity_per_tenant) {
            return Err((
                name,
                CapExceeded::Capacity {
                    cap: policy.max_capacity_per_tenant,
                    used: now.bytes,
                    asked: bytes,
                },
            ));
        }
        now = Usage {
            volumes: now.volumes + 1,
            bytes: total.unwrap_or(u64::MAX),
        };
    }
    Ok(())
}

/// What the operator allows annotations (the hook's own arguments; never from an annotation).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HookPolicy {
    /// [`ALLOW_RAW_RESOURCES_FLAG`]: resources annotations are mounted as given, host paths included.
    pub allow_raw_resources: bool,
    /// [`TENANT_ANNOTATION_FLAG`]: the annotation whose value is the tenant; `None`: single tenant.
    pub tenant_annotation: Option<String>,
    /// [`MAX_VOLUMES_FLAG`].
    pub max_volumes_per_tenant: u64,
    /// [`MAX_CAPACITY_FLAG`], in bytes.
    pub max_capacity_per_tenant: u64,
    /// [`ALLOW_PARAMETER_FLAG`]: the CreateVolume parameter keys annotations may set.
    pub allowed_parameters: std::collections::BTreeSet<String>,
}

impl Default for HookPolicy {
    fn default() -> Self {
        HookPolicy {
            allow_raw_resources: false,
            tenant_annotation: None,
            max_volumes_per_tenant: DEFAULT_MAX_VOLUMES_PER_TENANT,
            max_capacity_per_tenant: DEFAULT_MAX_CAPACITY_PER_TENANT,
            allowed_parameters: std::collections::BTreeSet::new(),
        }
    }
}

/// The mount flags an annotation may ask of a plugin: those that only take rights away from the
/// container (a flag such as `suid`, `dev` or one a plugin passes to its filesystem is the
/// operator's to set, in a profile or with `volume create`).
pub const ANNOTATION_MOUNT_FLAGS: [&str; 9] = [
    "ro",
    "noatime",
    "nodiratime",
    "relatime",
    "nodev",
    "nosuid",
    "noexec",
    "sync",
    "dirsync",
];

/// What a mounts annotation entry may not ask, though `run --mount` may: any mount flag that is
/// not one of [`ANNOTATION_MOUNT_FLAGS`].
pub fn check_annotation_mount(m: &MountSpec) -> Result<(), String> {
    for flag in m.volume.mount_flags.iter().flatten() {
        if !ANNOTATION_MOUNT_FLAGS.contains(&flag.as_str()) {
            return Err(format!(
                "mount flag '{}' refused: annotations may ask only for {} (other flags are the operator's: a disk profile or `csi-isolator volume create`)",
                crate::shown::shown(flag),
                ANNOTATION_MOUNT_FLAGS.join(", ")
            ));
        }
    }
    Ok(())
}

/// Refuses a parameters annotation that sets a key the operator does not allow
/// ([`ALLOW_PARAMETER_FLAG`]; every key with [`ALLOW_RAW_RESOURCES_FLAG`]).
pub fn admit_parameters(
    container: &str,
    policy: &HookPolicy,
    parameters: &BTreeMap<String, BTreeMap<String, String>>,
) -> Result<(), HookError> {
    if policy.allow_raw_resources {
        return Ok(());
    }
    for (volume, set) in parameters {
        if let Some(key) = set.keys().find(|k| !policy.allowed_parameters.contains(*k)) {
            let allowed = if policy.allowed_parameters.is_empty() {
                "no parameter".to_string()
            } else {
                let keys: Vec<_> = policy.allowed_parameters.iter().cloned().collect();
                format!("only {}", keys.join(", "))
            };
            return Err(HookError::ParameterRefused {
                container: container.to_string(),
                volume: crate::shown::shown(volume).into_owned(),
                key: crate::shown::shown(key).into_owned(),
                allowed,
            });
        }
    }
    Ok(())
}

impl HookPolicy {
    /// The tenant of a container with `annotations`: [`Tenant::Single`] without a tenant annotation;
    /// else its value, refused when missing or not valid ([`validate_tenant`]).
    pub fn tenant(
        &self,
        container: &str,
        annotations: &BTreeMap<String, String>,
    ) -> Result<Tenant, HookError> {
        let Some(key) = &self.tenant_annotation else {
            return Ok(Tenant::Single);
        };
        let refused = |reason: String| HookError::Tenant {
            container: container.to_string(),
            annotation: key.clone(),
            reason,
        };
        let value = annotations
            .get(key)
            .ok_or_else(|| refused("is missing".to_string()))?;
        validate_tenant(value).map_err(refused)?;
        Ok(Tenant::Named(value.clone()))
    }
}

/// A volume of the volumes annotation, with the name the provider is asked for.
pub(super) struct Wanted<'a> {
    pub(super) arg: &'a MountSpec,
    pub(super) scoped: String,
}

/// Refuses the resources annotation's entries that are not the provider's own (see
/// [`admit_resource`]), unless the operator allows raw resources.
pub(super) fn admit_resources(
    container: &str,
    policy: &HookPolicy,
    resources: &[Resource],
    own: &OwnVolumes<'_>,
) -> Result<(), HookError> {
    if policy.allow_raw_resources {
        return Ok(());
    }
    for r in resources {
        admit_resource(r, own).map_err(|reason| HookError::ResourceRefused {
            container: container.to_string(),
            resource: r.describe(),
            provider: own.provider_id.unwrap_or("(not yet known)").to_string(),
            reason,
        })?;
    }
    Ok(())
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_keys_need_the_operators_leave() {
        let sets: BTreeMap<String, BTreeMap<String, String>> = [(
            "data".to_string(),
            [("share".to_string(), "/export".to_string())].into(),
        )]
        .into();
        let err = admit_parameters("c", &HookPolicy::default(), &sets)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("parameter 'share' refused")
                && err.contains("allows annotations to set no parameter")
                && err.contains("--allow-parameter share"),
            "{err}"
        );
        let other = HookPolicy {
            allowed_parameters: ["server".to_string()].into(),
            ..HookPolicy::default()
        };
        let err = admit_parameters("c", &other, &sets)
            .unwrap_err()
            .to_string();
        assert!(err.contains("only server"), "{err}");
        let allowed = HookPolicy {
            allowed_parameters: ["share".to_string()].into(),
            ..HookPolicy::default()
        };
        admit_parameters("c", &allowed, &sets).unwrap();
        let raw = HookPolicy {
            allow_raw_resources: true,
            ..HookPolicy::default()
        };
        admit_parameters("c", &raw, &sets).unwrap();
        admit_parameters("c", &HookPolicy::default(), &BTreeMap::new()).unwrap();
    }
    use crate::isolator::hook::annotations;

    #[test]
    fn tenants_are_dns_1123_labels() {
        for good in ["a", "ns-a", "team1", "0", &"a".repeat(MAX_TENANT_BYTES)] {
            validate_tenant(good).unwrap_or_else(|e| panic!("{good:?}: {e}"));
        }
        for (bad, says) in [
            ("", "is empty"),
            (
                &*"a".repeat(MAX_TENANT_BYTES + 1),
                "64 bytes, over the limit of 63",
            ),
            ("ns.a", "holds '.'"),
            ("NS", "holds 'N'"),
            ("a/b", "holds '/'"),
            ("a b", "holds ' '"),
            ("a\nb", "holds '\\n'"),
            ("ns_a", "holds '_'"),
            ("-a", "starts or ends with '-'"),
            ("a-", "starts or ends with '-'"),
        ] {
            let err = validate_tenant(bad).unwrap_err();
            assert!(err.contains(says), "{bad:?}: {err}");
        }
    }

    #[test]
    fn scoped_names_map_one_to_one() {
        let a = Tenant::Named("a".to_string());
        let ab = Tenant::Named("a-b".to_string());
        for (tenant, name, scoped) in [
            (&Tenant::Single, "data", "data"),
            (&Tenant::Single, "a.data", "a.data"),
            (&a, "data", "a.data"),
            (&a, "b.data", "a.b.data"),
            (&ab, "data", "a-b.data"),
        ] {
            assert_eq!(tenant.scoped_name(name).unwrap(), scoped, "{tenant} {name}");
            assert!(tenant.owns(Some(scoped)), "{tenant} owns {scoped}");
        }
        // The tenant is everything before the first '.', which a tenant never holds: no two
        // (tenant, name) pairs meet, and no tenant owns another's volume.
        assert_ne!(a.scoped_name("b.data"), ab.scoped_name("data"));
        for (tenant, recorded, owns) in [
            (&a, Some("a.data"), true),
            (&a, Some("a-b.data"), false),
            (&ab, Some("a.data"), false),
            (&a, Some("ab.data"), false),
            (&a, Some("a"), false),
            (&a, Some("data"), false),
            (&a, None, false),
            (&Tenant::Single, None, true),
            (&Tenant::Single, Some("b.data"), true),
        ] {
            assert_eq!(tenant.owns(recorded), owns, "{tenant} {recorded:?}");
        }
        // CSI's 128 bytes count the tenant and the separator.
        let name = "n".repeat(MAX_NAME_BYTES - 2);
        assert_eq!(a.scoped_name(&name).unwrap().len(), MAX_NAME_BYTES);
        let err = a.scoped_name(&format!("{name}n")).unwrap_err();
        assert!(
            err.contains("129 bytes, the tenant and the '.' included, over CSI's limit of 128"),
            "{err}"
        );
        Tenant::Single
            .scoped_name(&"n".repeat(MAX_NAME_BYTES))
            .unwrap();
        let err = Tenant::Single
            .scoped_name(&"n".repeat(MAX_NAME_BYTES + 1))
            .unwrap_err();
        assert!(err.contains("129 bytes, over CSI's limit"), "{err}");
    }

    #[test]
    fn tenant_comes_from_the_operators_annotation() {
        let on = HookPolicy {
            tenant_annotation: Some("io.kubernetes.pod.namespace".to_string()),
            ..HookPolicy::default()
        };
        let key = "io.kubernetes.pod.namespace";
        assert_eq!(
            HookPolicy::default()
                .tenant("c", &annotations(&[(key, "ns-a")]))
                .unwrap(),
            Tenant::Single
        );
        assert_eq!(
            on.tenant("c", &annotations(&[(key, "ns-a")])).unwrap(),
            Tenant::Named("ns-a".to_string())
        );
        for (pairs, says) in [
            (
                vec![],
                "tenant annotation 'io.kubernetes.pod.namespace' is missing",
            ),
            (vec![(key, "")], "is empty"),
            (vec![(key, "a.b")], "holds '.'"),
            (vec![("other", "ns-a")], "is missing"),
        ] {
            let err = on
                .tenant("c", &annotations(&pairs))
                .unwrap_err()
                .to_string();
            assert!(err.starts_with("container 'c': "), "{err}");
            assert!(err.contains(says), "{pairs:?}: {err}");
            assert!(
                err.contains("--tenant-annotation io.kubernetes.pod.namespace"),
                "{err}"
            );
        }
    }

    #[test]
    fn resources_admission_table() {
        use serde_json::json;
        const ROOT: &str = "./csi/t/n/mounts";
        let a = Tenant::Named("a".to_string());
        let known: BTreeMap<String, Option<String>> = [
            ("vol-a".to_string(), Some("a.data".to_string())),
            ("vol-b".to_string(), Some("b.data".to_string())),
            ("vol-pre".to_string(), None),
        ]
        .into_iter()
        .collect();
        let own = |tenant| OwnVolumes {
            provider_id: Some("t.n"),
            mounts_root: Some(ROOT),
            volumes: Some(&known),
            tenant,
        };
        let before_start = OwnVolumes {
            provider_id: None,
            mounts_root: None,
            volumes: None,
            tenant: &a,
        };
        let disk = |provider: Option<&str>, source: serde_json::Value| {
            let mut r = json!({"name": "disk", "type": "SCALAR", "scalar": {"value": 16},
                "disk": {"source": source, "volume": {"container_path": "/d", "mode": "RW"}}});
            if let Some(p) = provider {
                r["provider_id"] = json!({"value": p});
            }
            if r["disk"]["source"].is_null() {
                r["disk"].as_object_mut().unwrap().remove("source");
            }
            serde_json::from_value::<Resource>(r).unwrap()
        };
        let mount =
            |root: &str, id: &str| json!({"type": "MOUNT", "mount": {"root": root}, "id": id});
        let ok = disk(Some("t.n"), mount(ROOT, "vol-a"));
        admit_resource(&ok, &own(&a)).unwrap();
        admit_resource(&ok, &own(&Tenant::Single)).unwrap();
        admit_resource(&ok, &before_start).unwrap();
        let path = disk(
            Some("t.n"),
            json!({"type": "PATH", "path": {"root": ROOT}, "id": "vol-a"}),
        );
        admit_resource(&path, &own(&a)).unwrap();
        // A volume declared by id (no name) is the single tenant's, no named tenant's.
        let pre = disk(Some("t.n"), mount(ROOT, "vol-pre"));
        admit_resource(&pre, &own(&Tenant::Single)).unwrap();

        for (r, own, says) in [
            (disk(None, mount("/", "x")), own(&a), "no provider_id"),
            (disk(None, mount("/", "x")), before_start, "no provider_id"),
            (
                disk(Some("other.n"), mount(ROOT, "vol-a")),
                own(&a),
                "provider_id 'other.n' is not this hook's provider",
            ),
            (
                disk(Some("t.n"), serde_json::Value::Null),
                own(&a),
                "no disk.source",
            ),
            (
                disk(Some("t.n"), mount("/", "vol-a")),
                before_start,
                "disk.source.mount.root '/' is a host path",
            ),
            (
                disk(Some("t.n"), mount("/root/secret", "vol-a")),
                own(&a),
                "disk.source.mount.root '/root/secret' is a host path",
            ),
            (
                disk(
                    Some("t.n"),
                    json!({"type": "PATH", "path": {"root": "/srv"}, "id": "vol-a"}),
                ),
                own(&a),
                "disk.source.path.root '/srv' is a host path",
            ),
            (
                disk(Some("t.n"), mount("./csi/t/n/mounts/../../../..", "vol-a")),
                own(&a),
                "is not the provider's mounts root './csi/t/n/mounts'",
            ),
            (
                disk(Some("t.n"), mount("csi/t/n/mounts", "vol-a")),
                own(&a),
                "is not the provider's mounts root",
            ),
            (
                disk(Some("t.n"), json!({"type": "MOUNT", "id": "vol-a"})),
                own(&a),
                "no disk.source.mount.root",
            ),
            (
                disk(Some("t.n"), json!({"type": "BLOCK", "id": "vol-a"})),
                own(&a),
                "disk.source.type BLOCK is not MOUNT or PATH",
            ),
            (
                disk(
                    Some("t.n"),
                    json!({"type": "MOUNT", "mount": {"root": ROOT}}),
                ),
                own(&a),
                "names no volume",
            ),
            (
                disk(Some("t.n"), mount(ROOT, "vol-nope")),
                own(&a),
                "disk.source.id 'vol-nope' is not a volume the provider knows",
            ),
            (
                disk(Some("t.n"), mount(ROOT, "vol-b")),
                own(&a),
                "volume 'vol-b' is not a volume of tenant 'a'",
            ),
            (
                pre.clone(),
                own(&a),
                "volume 'vol-pre' is not a volume of tenant 'a'",
            ),
            (Resource::scalar("cpus", 1.0), own(&a), "not a disk"),
        ] {
            let err = admit_resource(&r, &own).unwrap_err();
            assert!(err.contains(says), "{}: {err}", r.describe());
        }

        // The hook's error names the resource, the reason and the operator's way out.
        let policy = HookPolicy::default();
        let err = admit_resources("c", &policy, &[disk(None, mount("/", "x"))], &own(&a))
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with(
                "container 'c': annotation io.csi-isolator.resources: resource disk (id \"x\") refused: "
            ) && err.contains("provider 't.n'")
                && err.contains("--allow-raw-resources in the hook's arguments"),
            "{err}"
        );
        let raw = HookPolicy {
            allow_raw_resources: true,
            ..HookPolicy::default()
        };
        admit_resources("c", &raw, &[disk(None, mount("/", "x"))], &own(&a)).unwrap();
    }

    #[test]
    fn caps_table() {
        let policy = HookPolicy {
            max_volumes_per_tenant: 2,
            max_capacity_per_tenant: 100,
            ..HookPolicy::default()
        };
        let used = |volumes, bytes| Usage { volumes, bytes };
        for (from, new, expect) in [
            (used(0, 0), vec![], Ok(())),
            (used(0, 0), vec![("a", 50), ("b", 50)], Ok(())),
            (used(1, 0), vec![("a", 100)], Ok(())),
            (
                used(2, 0),
                vec![("a", 1)],
                Err(("a", CapExceeded::Volumes { cap: 2, used: 2 })),
            ),
            (
                used(0, 0),
                vec![("a", 1), ("b", 1), ("c", 1)],
                Err(("c", CapExceeded::Volumes { cap: 2, used: 2 })),
            ),
            (
                used(1, 60),
                vec![("a", 41)],
                Err((
                    "a",
                    CapExceeded::Capacity {
                        cap: 100,
                        used: 60,
                        asked: 41,
                    },
                )),
            ),
            (
                used(0, 0),
                vec![("a", 60), ("b", 60)],
                Err((
                    "b",
                    CapExceeded::Capacity {
                        cap: 100,
                        used: 60,
                        asked: 60,
                    },
                )),
            ),
            (
                used(0, u64::MAX),
                vec![("a", 1)],
                Err((
                    "a",
                    CapExceeded::Capacity {
                        cap: 100,
                        used: u64::MAX,
                        asked: 1,
                    },
                )),
            ),
        ] {
            assert_eq!(check_caps(&policy, from, &new), expect, "{from:?} {new:?}");
        }
        let zero = HookPolicy {
            max_volumes_per_tenant: 0,
            ..HookPolicy::default()
        };
        assert!(check_caps(&zero, used(0, 0), &[("a", 1)]).is_err());
        let says = CapExceeded::Volumes { cap: 2, used: 2 }.to_string();
        assert!(
            says.contains("has 2 volumes and the cap is 2")
                && says.contains("--max-volumes-per-tenant"),
            "{says}"
        );
        let says = CapExceeded::Capacity {
            cap: 100,
            used: 60,
            asked: 41,
        }
        .to_string();
        assert!(
            says.contains("41 more bytes would take the tenant from 60 bytes over the cap of 100")
                && says.contains("--max-capacity-per-tenant"),
            "{says}"
        );
    }

    #[test]
    fn usage_counts_the_tenants_named_volumes() {
        use crate::provider::state::VolumeRecord;
        let rec = |name: Option<&str>, bytes| {
            let mut r = VolumeRecord::new(format!("vol-{name:?}"), Default::default());
            r.name = name.map(str::to_string);
            r.capacity_bytes = bytes;
            r
        };
        let records = [
            rec(Some("a.x"), 10),
            rec(Some("a.y"), 20),
            rec(Some("b.x"), 40),
            rec(Some("ab.x"), 80),
            rec(None, 160),
        ];
        let a = Tenant::Named("a".to_string());
        assert_eq!(
            Usage::of_tenant(&a, &records),
            Usage {
                volumes: 2,
                bytes: 30
            }
        );
        assert_eq!(
            Usage::of_tenant(&Tenant::Single, &records),
            Usage {
                volumes: 4,
                bytes: 150
            }
        );
    }
}
