//! What the runtime hands the hook: the container state on stdin, the bundle's `config.json`, the
//! volumes its annotations name.

use super::*;

/// The runtime-spec container state a hook reads on stdin.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct State {
    /// The runtime-spec version.
    #[serde(rename = "ociVersion", default)]
    pub oci_version: String,
    /// The container id.
    pub id: String,
    /// `creating`, `created`, `running` or `stopped`.
    #[serde(default)]
    pub status: String,
    /// The container's init process (host pid), when it has one.
    #[serde(default)]
    pub pid: Option<i64>,
    /// The bundle directory (absolute).
    pub bundle: PathBuf,
    /// The container's annotations.
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
}

/// The most bytes of state read from stdin: the runtime's, but its annotations come from
/// whoever made the container; Kubernetes bounds them at 256 KiB in all.
pub const MAX_STATE_BYTES: u64 = 4 << 20;

impl State {
    /// Reads the state from `input` (stdin), at most [`MAX_STATE_BYTES`], and parses it.
    pub fn read_from(input: impl std::io::Read) -> Result<State, HookError> {
        use std::io::Read;
        let mut bytes = Vec::new();
        input
            .take(MAX_STATE_BYTES + 1)
            .read_to_end(&mut bytes)
            .map_err(|source| HookError::ReadState { source })?;
        if bytes.len() as u64 > MAX_STATE_BYTES {
            return Err(HookError::StateTooLarge {
                limit: MAX_STATE_BYTES,
            });
        }
        State::parse(&bytes)
    }

    /// Parses state JSON.
    pub fn parse(bytes: &[u8]) -> Result<State, HookError> {
        serde_json::from_slice(bytes).map_err(|source| HookError::ParseState { source })
    }
}

/// What the hook reads from the bundle's `config.json`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BundleConfig {
    /// `root.path`, joined to the bundle when relative (not canonical).
    pub rootfs: PathBuf,
    /// `annotations`.
    pub annotations: BTreeMap<String, String>,
    /// `process.user` as `UID:GID`, when it is not root: volumes the container mounts
    /// read-write and does not share are made writable for that group.
    pub user: Option<String>,
}

#[derive(Deserialize)]
struct RawConfig {
    root: RawRoot,
    #[serde(default)]
    annotations: BTreeMap<String, String>,
    #[serde(default)]
    process: Option<RawProcess>,
}

#[derive(Deserialize)]
struct RawProcess {
    #[serde(default)]
    user: Option<RawUser>,
}

#[derive(Deserialize)]
struct RawUser {
    #[serde(default)]
    uid: u32,
    #[serde(default)]
    gid: u32,
}

#[derive(Deserialize)]
struct RawRoot {
    path: PathBuf,
}

impl BundleConfig {
    /// Reads `<bundle>/config.json`.
    pub fn read(container: &str, bundle: &Path) -> Result<BundleConfig, HookError> {
        let path = bundle.join("config.json");
        let bytes = std::fs::read(&path).map_err(|source| HookError::ReadConfig {
            container: container.to_string(),
            path: path.clone(),
            source,
        })?;
        let raw: RawConfig =
            serde_json::from_slice(&bytes).map_err(|source| HookError::ParseConfig {
                container: container.to_string(),
                path,
                source,
            })?;
        let user = raw
            .process
            .and_then(|p| p.user)
            .filter(|u| u.uid != 0)
            .map(|u| format!("{}:{}", u.uid, u.gid));
        Ok(BundleConfig {
            rootfs: bundle.join(raw.root.path),
            annotations: raw.annotations,
            user,
        })
    }
}

/// The volumes a container's annotations name.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HookVolumes {
    /// From [`VOLUMES_ANNOTATION`] and [`MOUNTS_ANNOTATION`]: created by name if new.
    pub volumes: Vec<MountSpec>,
    /// From [`RESOURCES_ANNOTATION`]: mounted as given.
    pub resources: Vec<Resource>,
    /// From [`PARAMETERS_ANNOTATION`]: CreateVolume parameters by volume name (as written).
    pub parameters: BTreeMap<String, BTreeMap<String, String>>,
}

impl HookVolumes {
    /// Whether no volume is named.
    pub fn is_empty(&self) -> bool {
        self.volumes.is_empty() && self.resources.is_empty()
    }

    /// Parses the annotations (unknown keys are ignored). Every container path must be absolute.
    pub fn from_annotations(
        container: &str,
        annotations: &BTreeMap<String, String>,
    ) -> Result<HookVolumes, HookError> {
        let mut out = HookVolumes::default();
        let bad = |annotation, volume: &str, reason: String| HookError::Annotation {
            container: container.to_string(),
            annotation,
            volume: volume.to_string(),
            reason,
        };
        let refused =
            |annotation, volume: &str, source: AnnotationError| HookError::AnnotationRefused {
                container: container.to_string(),
                annotation,
                volume: volume.to_string(),
                source: Box::new(source),
            };
        let too_large = |annotation, reason: String| HookError::AnnotationTooLarge {
            container: container.to_string(),
            annotation,
            reason,
        };
        for key in [
            VOLUMES_ANNOTATION,
            MOUNTS_ANNOTATION,
            RESOURCES_ANNOTATION,
            PARAMETERS_ANNOTATION,
        ] {
            if let Some(value) = annotations
                .get(key)
                .filter(|v| v.len() > MAX_ANNOTATION_BYTES)
            {
                return Err(too_large(
                    key,
                    format!(
                        "{} bytes, over the hook's limit of {MAX_ANNOTATION_BYTES} bytes",
                        value.len()
                    ),
                ));
            }
        }
        let absolute = |annotation, entry: &str, m: &MountSpec| {
            if m.target.starts_with('/') {
                return Ok(());
            }
            Err(bad(
                annotation,
                entry,
                format!(
                    "container path '{}' must be absolute (it lands inside the rootfs)",
                    m.target
                ),
            ))
        };
        if let Some(value) = annotations.get(VOLUMES_ANNOTATION) {
            for entry in value.split(',').map(str::trim).filter(|e| !e.is_empty()) {
                let v: VolumeArg = entry.parse().map_err(|reason: String| {
                    // VolumeArg's messages start by quoting the flag; the entry is named already.
                    let prefix = format!("--volume '{entry}': ");
                    let reason = reason.strip_prefix(&prefix).unwrap_or(&reason).to_string();
                    bad(VOLUMES_ANNOTATION, entry, reason)
                })?;
                let m = MountSpec::from_volume_arg(&v);
                absolute(VOLUMES_ANNOTATION, entry, &m)?;
                out.volumes.push(m);
            }
        }
        if let Some(value) = annotations.get(MOUNTS_ANNOTATION) {
            for entry in value.split(';').map(str::trim).filter(|e| !e.is_empty()) {
                let m = MountSpec::parse(entry)
                    .map_err(|e| bad(MOUNTS_ANNOTATION, entry, e.to_string()))?;
                admit::check_annotation_mount(&m)
                    .map_err(|reason| bad(MOUNTS_ANNOTATION, entry, reason))?;
                absolute(MOUNTS_ANNOTATION, entry, &m)?;
                out.volumes.push(m);
            }
        }
        if let Some(value) = annotations.get(RESOURCES_ANNOTATION) {
            let resources = parse_resources(value)
                .map_err(|e| refused(RESOURCES_ANNOTATION, "(json)", e.into()))?;
            for r in &resources {
                if let Some(path) = r.container_path() {
                    if !path.starts_with('/') {
                        let volume = r
                            .source_id()
                            .map(str::to_string)
                            .unwrap_or_else(|| r.describe());
                        return Err(bad(
                            RESOURCES_ANNOTATION,
                            &volume,
                            format!("container path '{path}' must be absolute (it lands inside the rootfs)"),
                        ));
                    }
                }
            }
            out.resources = resources;
        }
        if let Some(value) = annotations.get(PARAMETERS_ANNOTATION) {
            let sets: BTreeMap<String, BTreeMap<String, String>> = serde_json::from_str(value)
                .map_err(|e| {
                    refused(
                        PARAMETERS_ANNOTATION,
                        "(json)",
                        AnnotationError::ParametersJson(e),
                    )
                })?;
            for (name, set) in &sets {
                if !out.volumes.iter().any(|v| &v.source == name) {
                    return Err(bad(
                        PARAMETERS_ANNOTATION,
                        &crate::shown::shown(name),
                        format!("names no volume of {VOLUMES_ANNOTATION} or {MOUNTS_ANNOTATION}"),
                    ));
                }
                crate::provider::parameters::check(set).map_err(|e| {
                    refused(PARAMETERS_ANNOTATION, &crate::shown::shown(name), e.into())
                })?;
            }
            out.parameters = sets;
        }
        let entries = out.volumes.len() + out.resources.len();
        if entries > MAX_ANNOTATION_ENTRIES {
            return Err(too_large(
                "io.csi-isolator.volumes, io.csi-isolator.mounts and io.csi-isolator.resources",
                format!(
                    "{entries} volumes named, over the hook's limit of {MAX_ANNOTATION_ENTRIES} per container"
                ),
            ));
        }
        Ok(out)
    }
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::error_chain::FullMessage;
    use crate::isolator::hook::annotations;

    #[test]
    fn a_state_over_the_bound_is_refused_unread_and_one_within_it_is_parsed() {
        let within = br#"{"ociVersion":"1.0.2","id":"c1","status":"creating","bundle":"/b"}"#;
        assert_eq!(State::read_from(&within[..]).unwrap().id, "c1");
        // An endless stream stops at the bound plus one byte.
        let endless = std::io::repeat(b' ');
        let err = State::read_from(endless).unwrap_err();
        assert!(
            matches!(err, HookError::StateTooLarge { limit } if limit == MAX_STATE_BYTES),
            "{err}"
        );
        assert!(err.to_string().contains("refused unread"), "{err}");
    }

    #[test]
    fn state_parses_runtime_spec_json() {
        let s = State::parse(
            br#"{"ociVersion":"1.0.2","id":"c1","status":"creating","pid":4242,
                 "bundle":"/b","annotations":{"io.csi-isolator.volumes":"d:1M:/d"}}"#,
        )
        .unwrap();
        assert_eq!(s.id, "c1");
        assert_eq!(s.pid, Some(4242));
        assert_eq!(s.bundle, PathBuf::from("/b"));
        assert_eq!(s.annotations[VOLUMES_ANNOTATION], "d:1M:/d");
        // poststop: stopped, no pid, no annotations.
        let s =
            State::parse(br#"{"ociVersion":"1.0.2","id":"c1","status":"stopped","bundle":"/b"}"#)
                .unwrap();
        assert_eq!(s.pid, None);
        assert!(s.annotations.is_empty());
        let err = State::parse(b"{\"id\":1}").unwrap_err().full_message();
        assert!(
            err.starts_with("parse the container state (stdin): "),
            "{err}"
        );
    }

    #[test]
    fn parameters_annotation_is_parsed_bounded_and_tied_to_a_volume() {
        let vols = (VOLUMES_ANNOTATION, "data:64M:/data");
        let ok = HookVolumes::from_annotations(
            "c",
            &annotations(&[
                vols,
                (PARAMETERS_ANNOTATION, r#"{"data": {"share": "/export"}}"#),
            ]),
        )
        .unwrap();
        assert_eq!(ok.parameters["data"]["share"], "/export");
        let long = format!(r#"{{"data": {{"share": "{}"}}}}"#, "x".repeat(5000));
        let huge = format!(
            r#"{{"data": {{"k": "{}"}}}}"#,
            "x".repeat(MAX_ANNOTATION_BYTES)
        );
        for (value, says) in [
            ("[1]", "not a JSON object"),
            (r#"{"data": {"k": 1}}"#, "not a JSON object"),
            (
                r#"{"other": {"k": "v"}}"#,
                "names no volume of io.csi-isolator.volumes",
            ),
            (r#"{"data": {"a\nb": "v"}}"#, "other than letters"),
            (
                r#"{"data": {"k": "v\u001b[2J"}}"#,
                "its value holds a control character",
            ),
            (
                r#"{"data": {"csi.storage.k8s.io/node-publish-secret-name": "s"}}"#,
                "secrets never travel",
            ),
            (&long, "over CSI's limit of 4096 bytes"),
            (&huge, "over the hook's limit of 65536 bytes"),
        ] {
            let err = HookVolumes::from_annotations(
                "c",
                &annotations(&[vols, (PARAMETERS_ANNOTATION, value)]),
            )
            .unwrap_err()
            .full_message();
            assert!(
                err.contains(says) && err.contains(PARAMETERS_ANNOTATION),
                "{}: {err}",
                crate::shown::shown(value)
            );
        }
    }

    #[test]
    fn annotations_table() {
        let ok = HookVolumes::from_annotations(
            "c",
            &annotations(&[(VOLUMES_ANNOTATION, "data:64M:/data, ref:1G:/ref:ro,")]),
        )
        .unwrap();
        assert_eq!(ok.volumes.len(), 2);
        assert_eq!(ok.volumes[0].target, "/data");
        assert!(ok.volumes[1].readonly);
        let long = HookVolumes::from_annotations(
            "c",
            &annotations(&[
                (VOLUMES_ANNOTATION, "data:64M:/data"),
                (
                    MOUNTS_ANNOTATION,
                    "source=db,target=/db,size=1G,mount-flags=noatime:nodev:nosuid; \
                     source=ref,target=/ref,size=1M,readonly,access-mode=SINGLE_NODE_READER_ONLY;",
                ),
            ]),
        )
        .unwrap();
        let named: Vec<_> = long.volumes.iter().map(|v| v.source.as_str()).collect();
        assert_eq!(named, ["data", "db", "ref"], "both forms, in order");
        assert_eq!(
            long.volumes[1].create_spec("db").capability.mount_flags,
            ["noatime", "nodev", "nosuid"]
        );
        assert!(long.volumes[2].readonly);
        assert!(ok.resources.is_empty());
        assert!(
            HookVolumes::from_annotations("c", &annotations(&[("other", "x")]))
                .unwrap()
                .is_empty()
        );

        for (key, value, says) in [
            (
                VOLUMES_ANNOTATION,
                "data:lots:/data",
                "annotation io.csi-isolator.volumes: volume 'data:lots:/data': invalid SIZE 'lots'",
            ),
            (
                VOLUMES_ANNOTATION,
                "a:1M:/a,data:1M:rel",
                "volume 'data:1M:rel': container path 'rel' must be absolute",
            ),
            (VOLUMES_ANNOTATION, "data:1M:/x:rx", "unknown mode 'rx'"),
            (
                MOUNTS_ANNOTATION,
                "source=a,target=/a,size=1M;source=b,target=rel,size=1M",
                "annotation io.csi-isolator.mounts: volume 'source=b,target=rel,size=1M': \
                 container path 'rel' must be absolute",
            ),
            (
                MOUNTS_ANNOTATION,
                "source=a,target=/a,size=1M,colour=red",
                "option 'colour': unknown key",
            ),
            (
                MOUNTS_ANNOTATION,
                "source=a,target=/a,size=1M,mount-flags=nosuid:suid",
                "mount flag 'suid' refused: annotations may ask only for ro, noatime",
            ),
            (
                MOUNTS_ANNOTATION,
                "source=a,target=/a,size=1M,mount-flags=context=system_u",
                "mount flag 'context=system_u' refused",
            ),
            (
                RESOURCES_ANNOTATION,
                "{not json",
                // The JSON error's place is kept (it was lost when the cause was flattened).
                "annotation io.csi-isolator.resources: volume '(json)': parse resources json: \
                 invalid type: map, expected a sequence at line 1 column",
            ),
            (
                PARAMETERS_ANNOTATION,
                "[]",
                "annotation io.csi-isolator.parameters: volume '(json)': not a JSON object of \
                 volume names to string maps: invalid type: sequence, expected a map at line 1 \
                 column",
            ),
        ] {
            let err = HookVolumes::from_annotations("c", &annotations(&[(key, value)]))
                .unwrap_err()
                .full_message();
            assert!(err.starts_with("container 'c': "), "{err}");
            assert!(err.contains(says), "{value}: {err}");
        }
    }

    #[test]
    fn bundle_config_joins_a_relative_root() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("config.json"),
            r#"{"ociVersion":"1.0.2","root":{"path":"rootfs"},"annotations":{"k":"v"}}"#,
        )
        .unwrap();
        let c = BundleConfig::read("c", dir.path()).unwrap();
        assert_eq!(c.rootfs, dir.path().join("rootfs"));
        assert_eq!(c.annotations["k"], "v");
        assert_eq!(c.user, None);
        std::fs::write(
            dir.path().join("config.json"),
            r#"{"root":{"path":"/r"},"process":{"user":{"uid":1000,"gid":50}}}"#,
        )
        .unwrap();
        let c = BundleConfig::read("c", dir.path()).unwrap();
        assert_eq!(c.user.as_deref(), Some("1000:50"));
        std::fs::write(dir.path().join("config.json"), r#"{"root":{}}"#).unwrap();
        let err = BundleConfig::read("c", dir.path())
            .unwrap_err()
            .full_message();
        assert!(err.starts_with("container 'c': parse "), "{err}");
    }

    #[test]
    fn annotations_are_bounded() {
        let many = (0..=MAX_ANNOTATION_ENTRIES)
            .map(|i| format!("v{i}:1M:/v{i}"))
            .collect::<Vec<_>>()
            .join(",");
        let err = HookVolumes::from_annotations("c", &annotations(&[(VOLUMES_ANNOTATION, &many)]))
            .unwrap_err()
            .full_message();
        assert!(
            err.contains("33 volumes named, over the hook's limit of 32 per container"),
            "{err}"
        );
        let long = format!("v:1M:/{}", "x".repeat(MAX_ANNOTATION_BYTES));
        let err = HookVolumes::from_annotations("c", &annotations(&[(VOLUMES_ANNOTATION, &long)]))
            .unwrap_err()
            .full_message();
        assert!(
            err.contains("annotation io.csi-isolator.volumes: 65542 bytes, over the hook's limit"),
            "{err}"
        );
        let err =
            HookVolumes::from_annotations("c", &annotations(&[(RESOURCES_ANNOTATION, &long)]))
                .unwrap_err()
                .full_message();
        assert!(
            err.contains("annotation io.csi-isolator.resources: ")
                && err.contains("bytes, over the hook's limit"),
            "{err}"
        );
    }
}
