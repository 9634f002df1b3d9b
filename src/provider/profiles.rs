//! Disk profiles: what a Mesos disk resource's `disk.source.profile` means
//! for CreateVolume, read from the operator's profiles file in the format of
//! Mesos' URI disk profile adaptor:
//!
//! ```json
//! {"profile_matrix": {
//!    "fast": {"csi_plugin_type_selector": {"plugin_type": "org.example.csi"},
//!             "volume_capabilities": {"mount": {}, "access_mode": {"mode": "SINGLE_NODE_WRITER"}},
//!             "create_parameters": {"type": "ssd"}}}}
//! ```
//!
//! A profile gives a volume's capability (access mode; `mount` with its file
//! system and flags, checked by [`Capability::set_mount`] like every other
//! entry point's, or `block`) and its CreateVolume parameters;
//! `csi_plugin_type_selector`, when present, limits it to plugins of that
//! type (`resource_provider_selector` is accepted and not read). One key is
//! csi-isolator's: `secrets_file`, the absolute path of its volumes' secrets
//! file, checked as `--mount`'s `secrets=` ([`crate::provider::secrets`]
//! reads the file at each call). Unknown keys are refused, at every level
//! (Mesos ignores them): a misspelt key would silently drop what it names. The file is the operator's, but it is read by root and
//! turns into what a driver mounts: it must be a regular file, owned by root
//! and writable by nobody else, in a directory that passes the work dir's
//! rule, or it is refused ([`load`]). Its size, the number of profiles and
//! every parameter set are bounded as parameters are everywhere
//! ([`crate::provider::parameters`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::provider::mount_spec::{Key, VolumeOptions};
use crate::provider::parameters::{self, ParameterError};
use crate::provider::state::{AccessType, Capability};
use crate::resource::{Resource, SourceType};
use crate::workdir::{self, Problem, RootFileError};

/// The largest profiles file read, in bytes.
pub const MAX_FILE_BYTES: u64 = 1 << 20;
/// The most profiles one file may define.
pub const MAX_PROFILES: usize = 256;

/// What `--disk-profiles` chooses a profiles file's directory for.
pub const DISK_PROFILES_DIR: workdir::Purpose = workdir::Purpose {
    what: "disk profiles file's directory",
    flag: "--disk-profiles",
};

/// One profile.
#[derive(Clone, Debug, PartialEq)]
pub struct Profile {
    /// The capability its volumes are created and published with.
    pub capability: Capability,
    /// Its CreateVolume parameters.
    pub parameters: BTreeMap<String, String>,
    /// The plugin type it is limited to, if any.
    pub plugin_type: Option<String>,
    /// Its volumes' secrets file (the `secrets_file` extension key), an absolute path.
    pub secrets_file: Option<PathBuf>,
}

/// The profiles of one file.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Profiles {
    /// Where they were read from.
    pub file: PathBuf,
    /// By name.
    pub profiles: BTreeMap<String, Profile>,
}

/// A profiles file refused.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    /// The file or its directory could not be opened or read.
    #[error("disk profiles file {path}: {step}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The step (`open`, `read`).
        step: &'static str,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The directory the file is in fails the work dir's rule.
    #[error("disk profiles file {path}")]
    Directory {
        /// The file.
        path: PathBuf,
        /// Why its directory cannot be trusted.
        #[source]
        source: Box<workdir::WorkDirError>,
    },
    /// The file itself can be changed by someone else than root.
    #[error("disk profiles file {path} is {problem}: it decides what drivers mount as root, so only root may write it (chown root, chmod go-w, one name)")]
    Unsafe {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        problem: Problem,
    },
    /// Over [`MAX_FILE_BYTES`].
    #[error("disk profiles file {path} is over {MAX_FILE_BYTES} bytes")]
    TooLarge {
        /// The file.
        path: PathBuf,
    },
    /// Not the adaptor's JSON.
    #[error(
        "disk profiles file {path}: not a profile matrix (see docs/real-drivers.md): {reason}"
    )]
    Parse {
        /// The file.
        path: PathBuf,
        /// serde's message.
        reason: String,
    },
    /// A profile whose name, capability or parameters are refused.
    #[error("disk profiles file {path}: profile '{profile}': {reason}")]
    BadProfile {
        /// The file.
        path: PathBuf,
        /// The profile name, escaped and shortened.
        profile: String,
        /// What is wrong.
        reason: String,
    },
}

// Unknown keys are refused at every level (`deny_unknown_fields`), unlike Mesos' adaptor, which
// parses with protobuf's `ignore_unknown_fields`: a misspelt `mount_flags` or `secrets_file`
// ignored would make volumes without them, in a file that decides what root mounts. The names
// protobuf's JSON also accepts (lowerCamelCase) are read as the same keys, so a file Mesos reads
// is read the same way here, or refused naming the key.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Matrix {
    #[serde(alias = "profileMatrix")]
    profile_matrix: BTreeMap<String, Entry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    #[serde(default, alias = "csiPluginTypeSelector")]
    csi_plugin_type_selector: Option<TypeSelector>,
    /// Mesos' other selector: accepted and not read (see the module doc).
    #[serde(default, alias = "resourceProviderSelector")]
    #[allow(dead_code)]
    resource_provider_selector: Option<serde::de::IgnoredAny>,
    #[serde(default, alias = "volumeCapabilities")]
    volume_capabilities: Option<Capabilities>,
    #[serde(default, alias = "createParameters")]
    create_parameters: BTreeMap<String, String>,
    /// csi-isolator's extension: the volume's secrets file.
    #[serde(default)]
    secrets_file: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TypeSelector {
    #[serde(alias = "pluginType")]
    plugin_type: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Capabilities {
    #[serde(default)]
    mount: Option<MountCapability>,
    #[serde(default)]
    block: Option<BlockCapability>,
    #[serde(default, alias = "accessMode")]
    access_mode: Option<AccessMode>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct MountCapability {
    #[serde(default, alias = "fsType")]
    fs_type: String,
    #[serde(default, alias = "mountFlags")]
    mount_flags: Vec<String>,
}

/// CSI's `BlockVolume`, which has no fields.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BlockCapability {}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AccessMode {
    mode: String,
}

/// A profile's capability: block or mount (CSI's `access_type` is one of them), the mount's fs
/// type and flags through [`Capability::set_mount`], the mode through
/// [`Capability::set_access_mode`] (the checks every other entry point uses).
fn capability_of(caps: Option<Capabilities>) -> Result<Capability, String> {
    let mut capability = Capability::default();
    let Some(caps) = caps else {
        return Ok(capability);
    };
    match (caps.mount, caps.block) {
        (Some(_), Some(_)) => {
            return Err(
                "volume_capabilities has both mount and block: a volume is one or the other".into(),
            )
        }
        (None, Some(BlockCapability {})) => capability.access_type = AccessType::Block,
        (mount, None) => {
            let mount = mount.unwrap_or_default();
            capability
                .set_mount(&mount.fs_type, &mount.mount_flags)
                .map_err(|e| format!("volume_capabilities.mount.{}: {e}", e.field))?;
        }
    }
    if let Some(mode) = caps.access_mode {
        capability
            .set_access_mode(&mode.mode)
            .map_err(|e| e.to_string())?;
    }
    Ok(capability)
}

/// A profile's `secrets_file`, by the rule of `--mount`'s `secrets=` (an absolute path; the
/// file itself is checked when a call reads it, [`crate::provider::secrets`]).
fn secrets_file_of(written: Option<String>) -> Result<Option<PathBuf>, String> {
    let Some(path) = written else {
        return Ok(None);
    };
    let mut options = VolumeOptions::default();
    options
        .set(Key::Secrets, "secrets_file", &path)
        .map_err(|e| e.to_string())?;
    Ok(options.secrets)
}

impl Profiles {
    /// Parses a profiles file's bytes (see the module doc); `file` names it in errors.
    pub fn parse(bytes: &[u8], file: &Path) -> Result<Profiles, ProfileError> {
        let matrix: Matrix = serde_json::from_slice(bytes).map_err(|e| ProfileError::Parse {
            path: file.to_path_buf(),
            reason: e.to_string(),
        })?;
        if matrix.profile_matrix.len() > MAX_PROFILES {
            return Err(ProfileError::Parse {
                path: file.to_path_buf(),
                reason: format!(
                    "{} profiles, over the limit of {MAX_PROFILES}",
                    matrix.profile_matrix.len()
                ),
            });
        }
        let mut profiles = BTreeMap::new();
        for (name, entry) in matrix.profile_matrix {
            let bad = |reason: String| ProfileError::BadProfile {
                path: file.to_path_buf(),
                profile: crate::shown::shown(&name).into_owned(),
                reason,
            };
            parameters::check_key(&name).map_err(|e| bad(profile_name_reason(e)))?;
            parameters::check(&entry.create_parameters).map_err(|e| bad(e.to_string()))?;
            let capability = capability_of(entry.volume_capabilities).map_err(bad)?;
            let secrets_file = secrets_file_of(entry.secrets_file).map_err(bad)?;
            profiles.insert(
                name,
                Profile {
                    capability,
                    parameters: entry.create_parameters,
                    plugin_type: entry.csi_plugin_type_selector.map(|s| s.plugin_type),
                    secrets_file,
                },
            );
        }
        Ok(Profiles {
            file: file.to_path_buf(),
            profiles,
        })
    }

    /// The profile `name` for a plugin of `plugin_type`: none when the file
    /// lacks it or limits it to another type.
    pub fn get(&self, name: &str, plugin_type: &str) -> Option<&Profile> {
        self.profiles
            .get(name)
            .filter(|p| p.plugin_type.as_deref().is_none_or(|t| t == plugin_type))
    }
}

fn profile_name_reason(e: ParameterError) -> String {
    match e {
        ParameterError::BadKey { reason, .. } => format!("its name {reason}"),
        other => other.to_string(),
    }
}

/// Reads the profiles file at `path` after checking that only root can
/// have written it (see the module doc): its directory by the work dir's
/// rule, the file itself opened without following a symbolic link and
/// judged by [`workdir::strict_modes`] on the open descriptor.
pub fn load(path: &Path) -> Result<Profiles, ProfileError> {
    let path_buf = || path.to_path_buf();
    let bytes = workdir::read_root_file(
        path,
        DISK_PROFILES_DIR,
        workdir::FileRule::RootWritten,
        MAX_FILE_BYTES,
    )
    .map_err(|e| match e {
        RootFileError::Directory(source) => ProfileError::Directory {
            path: path_buf(),
            source,
        },
        RootFileError::Unsafe { problem, .. } => ProfileError::Unsafe {
            path: path_buf(),
            problem,
        },
        RootFileError::TooLarge { .. } => ProfileError::TooLarge { path: path_buf() },
        RootFileError::Io { step, source } => ProfileError::Io {
            path: path_buf(),
            step,
            source,
        },
    })?;
    Profiles::parse(&bytes, path)
}

/// What to do with one disk resource when profile disks are made.
#[derive(Debug, PartialEq)]
pub enum ProfileDisk<'a> {
    /// Not a profile disk of this provider: left as it is.
    Keep,
    /// Create (or find) the volume `name` with `profile`, `bytes` large.
    Create {
        /// The profile name.
        profile: &'a str,
        /// The CreateVolume name: the resource's `disk.persistence.id`.
        name: &'a str,
        /// The resource's size.
        bytes: u64,
        /// The kind of volume its `disk.source.type` asks for: `MOUNT` a filesystem, `BLOCK` a
        /// block device, `RAW` (`None`) the kind its profile makes (Mesos' CREATE_DISK turns a
        /// RAW disk into either); see [`kind_mismatch`].
        asks: Option<AccessType>,
    },
    /// A profile disk that cannot be made: why.
    Refuse(&'static str),
}

/// Decides what a resource is: a disk of provider `provider_id` with
/// `disk.source.profile` and no `disk.source.id` is a volume to create (as
/// Mesos' CREATE_DISK does), named by its `disk.persistence.id` so the same
/// resource is the same volume next time.
pub fn profile_disk<'a>(r: &'a Resource, provider_id: &str) -> ProfileDisk<'a> {
    let Some(source) = r.disk_source() else {
        return ProfileDisk::Keep;
    };
    let Some(profile) = source.profile.as_deref() else {
        return ProfileDisk::Keep;
    };
    if r.provider_id() != Some(provider_id) || source.id.is_some() {
        return ProfileDisk::Keep;
    }
    let asks = match source.kind {
        SourceType::Raw => None,
        SourceType::Mount => Some(AccessType::Mount),
        SourceType::Block => Some(AccessType::Block),
        _ => {
            return ProfileDisk::Refuse(
                "a profile disk becomes a MOUNT or BLOCK volume: give disk.source.type MOUNT, BLOCK or RAW (the profile's kind)",
            )
        }
    };
    let Some(name) = r.persistence_id() else {
        return ProfileDisk::Refuse(
            "a profile disk needs disk.persistence.id, the name of the volume it creates",
        );
    };
    match r.size_bytes() {
        Some(bytes) if bytes > 0 => ProfileDisk::Create {
            profile,
            name,
            bytes,
            asks,
        },
        _ => ProfileDisk::Refuse("a profile disk needs a scalar size above 0 (MB)"),
    }
}

/// Why a profile disk cannot be made with `profile`, when its `disk.source.type` asks for
/// another kind of volume (`asks`, see [`ProfileDisk::Create`]) than the profile makes: a MOUNT
/// disk with a block profile, or a BLOCK disk with a mount one. Names both.
pub fn kind_mismatch(asks: Option<AccessType>, profile: &str, made: AccessType) -> Option<String> {
    let asks = asks?;
    if asks == made {
        return None;
    }
    let source_type = |t: AccessType| match t {
        AccessType::Mount => "MOUNT",
        AccessType::Block => "BLOCK",
    };
    Some(format!(
        "disk.source.type {} asks for a {} volume, but disk profile '{}' makes {} volumes (volume_capabilities.{}): give disk.source.type {} or RAW, or a profile of {} volumes",
        source_type(asks),
        asks.as_str(),
        crate::shown::shown(profile),
        made.as_str(),
        made.as_str(),
        source_type(made),
        asks.as_str(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<Profiles, String> {
        Profiles::parse(json.as_bytes(), Path::new("/etc/p.json")).map_err(|e| e.to_string())
    }

    #[test]
    fn profile_disks_are_told_apart() {
        let disk = |source: serde_json::Value, persistence: bool, provider: &str| -> Resource {
            let mut r = serde_json::json!({"name": "disk", "type": "SCALAR", "scalar": {"value": 16},
                "provider_id": {"value": provider}, "disk": {"source": source}});
            if persistence {
                r["disk"]["persistence"] = serde_json::json!({"id": "vol-a"});
            }
            serde_json::from_value(r).unwrap()
        };
        let raw = serde_json::json!({"type": "RAW", "profile": "fast"});
        assert_eq!(
            profile_disk(&disk(raw.clone(), true, "p"), "p"),
            ProfileDisk::Create {
                profile: "fast",
                name: "vol-a",
                bytes: 16 << 20,
                asks: None,
            }
        );
        for (kind, asks) in [("MOUNT", AccessType::Mount), ("BLOCK", AccessType::Block)] {
            let typed = serde_json::json!({"type": kind, "profile": "fast"});
            assert!(
                matches!(profile_disk(&disk(typed, true, "p"), "p"),
                    ProfileDisk::Create { asks: Some(a), .. } if a == asks),
                "{kind}"
            );
        }
        assert_eq!(
            profile_disk(&disk(raw.clone(), true, "q"), "p"),
            ProfileDisk::Keep
        );
        let with_id = serde_json::json!({"type": "MOUNT", "profile": "fast", "id": "v"});
        assert_eq!(
            profile_disk(&disk(with_id, true, "p"), "p"),
            ProfileDisk::Keep
        );
        let plain = serde_json::json!({"type": "MOUNT", "id": "v"});
        assert_eq!(
            profile_disk(&disk(plain, true, "p"), "p"),
            ProfileDisk::Keep
        );
        assert!(matches!(
            profile_disk(&disk(raw, false, "p"), "p"),
            ProfileDisk::Refuse(why) if why.contains("disk.persistence.id")
        ));
        let path = serde_json::json!({"type": "PATH", "profile": "fast"});
        assert!(matches!(
            profile_disk(&disk(path, true, "p"), "p"),
            ProfileDisk::Refuse(why) if why.contains("MOUNT")
        ));
    }

    #[test]
    fn the_adaptors_matrix_becomes_capability_and_parameters() {
        let p = parse(
            r#"{"profile_matrix": {
                "fast": {"csi_plugin_type_selector": {"plugin_type": "org.example"},
                         "volume_capabilities": {"mount": {"fs_type": "xfs"},
                                                 "access_mode": {"mode": "MULTI_NODE_MULTI_WRITER"}},
                         "create_parameters": {"type": "ssd"}},
                "plain": {}}}"#,
        )
        .unwrap();
        let fast = p.get("fast", "org.example").unwrap();
        assert_eq!(fast.capability.access_mode, "MULTI_NODE_MULTI_WRITER");
        assert_eq!(fast.capability.fs_type, "xfs");
        assert_eq!(fast.parameters["type"], "ssd");
        assert!(p.get("fast", "org.other").is_none(), "another plugin type");
        let plain = p.get("plain", "anything").unwrap();
        assert_eq!(plain.capability, Capability::default());
        assert!(plain.parameters.is_empty());
        assert!(p.get("missing", "org.example").is_none());
    }

    #[test]
    fn block_profiles_and_secrets_files_are_read() {
        let p = parse(
            r#"{"profile_matrix": {
                "raw": {"volume_capabilities": {"block": {}, "access_mode": {"mode": "SINGLE_NODE_WRITER"}},
                        "secrets_file": "/etc/csi-isolator/ceph.json"},
                "fs": {"volume_capabilities": {"mount": {"fs_type": "ext4", "mount_flags": ["noatime", "nodev"]}}},
                "mesos": {"resourceProviderSelector": {"resource_providers": [{"type": "t", "name": "n"}]},
                          "volumeCapabilities": {"mount": {"fsType": "xfs", "mountFlags": ["ro"]},
                                                 "accessMode": {"mode": "MULTI_NODE_READER_ONLY"}},
                          "createParameters": {"k": "v"}}}}"#,
        )
        .unwrap();
        let raw = p.get("raw", "any").unwrap();
        assert_eq!(raw.capability.access_type, AccessType::Block);
        assert_eq!(
            raw.secrets_file.as_deref(),
            Some(Path::new("/etc/csi-isolator/ceph.json"))
        );
        let fs = p.get("fs", "any").unwrap();
        assert_eq!(fs.capability.access_type, AccessType::Mount);
        assert_eq!(fs.capability.fs_type, "ext4");
        assert_eq!(fs.capability.mount_flags, ["noatime", "nodev"]);
        assert_eq!(fs.secrets_file, None);
        let mesos = p.get("mesos", "any").unwrap();
        assert_eq!(
            mesos.capability.describe(),
            "MULTI_NODE_READER_ONLY fs_type=xfs mount_flags=ro",
            "protobuf's JSON names are the same keys"
        );
        assert_eq!(mesos.parameters["k"], "v");
    }

    #[test]
    fn a_disk_type_must_fit_its_profiles_kind() {
        use AccessType::{Block, Mount};
        for (asks, made, fits) in [
            (None, Mount, true),
            (None, Block, true),
            (Some(Mount), Mount, true),
            (Some(Block), Block, true),
            (Some(Mount), Block, false),
            (Some(Block), Mount, false),
        ] {
            let why = kind_mismatch(asks, "fast", made);
            assert_eq!(why.is_none(), fits, "{asks:?} {made:?}: {why:?}");
        }
        let why = kind_mismatch(Some(Mount), "fast", Block).unwrap();
        assert_eq!(
            why,
            "disk.source.type MOUNT asks for a mount volume, but disk profile 'fast' makes block volumes (volume_capabilities.block): give disk.source.type BLOCK or RAW, or a profile of mount volumes"
        );
        let why = kind_mismatch(Some(Block), "a\nb", Mount).unwrap();
        assert!(why.starts_with("disk.source.type BLOCK asks for a block volume, but disk profile 'a\\nb' makes mount volumes"), "{why}");
    }

    #[test]
    fn hostile_profiles_are_refused() {
        let many: String = (0..=MAX_PROFILES)
            .map(|i| format!(r#""p{i}": {{}}"#))
            .collect::<Vec<_>>()
            .join(",");
        let many = format!(r#"{{"profile_matrix": {{{many}}}}}"#);
        for (json, says) in [
            ("[]", "not a profile matrix"),
            (
                r#"{"profile_matrix": {"a b": {}}}"#,
                "its name holds a character",
            ),
            (
                r#"{"profile_matrix": {"p": {"create_parameters": {"k\n": "v"}}}}"#,
                "other than letters",
            ),
            (
                r#"{"profile_matrix": {"p": {"create_parameters": {"adminSecret": "v"}}}}"#,
                "secrets never travel",
            ),
            (
                r#"{"profile_matrix": {"p": {"volume_capabilities": {"access_mode": {"mode": "ANY"}}}}}"#,
                "unknown CSI access mode 'ANY' (expected one of SINGLE_NODE_WRITER",
            ),
            (
                r#"{"profile_matrix": {"p": {"volume_capabilities": {"block": {}, "mount": {}}}}}"#,
                "has both mount and block",
            ),
            (
                r#"{"profile_matrix": {"p": {"volume_capabilities": {"block": {"fs_type": "ext4"}}}}}"#,
                "unknown field `fs_type`, there are no fields",
            ),
            (
                r#"{"profile_matrix": {"p": {"volume_capabilities": {"mount": {"fs_type": "ext4;rm"}}}}}"#,
                "volume_capabilities.mount.fs_type: 'ext4;rm' is not a filesystem type name",
            ),
            (
                r#"{"profile_matrix": {"p": {"volume_capabilities": {"mount": {"mount_flags": ["noatime", ""]}}}}}"#,
                "volume_capabilities.mount.mount_flags: flag '' is empty",
            ),
            (
                &format!(
                    r#"{{"profile_matrix": {{"p": {{"volume_capabilities": {{"mount": {{"mount_flags": [{}]}}}}}}}}}}"#,
                    vec![r#""ro""#; 65].join(",")
                ),
                "65 flags, over the limit of 64",
            ),
            (
                r#"{"profile_matrix": {"p": {"volume_capabilities": {"mount": {"mount_flag": ["nosuid"]}}}}}"#,
                "unknown field `mount_flag`, expected",
            ),
            (
                r#"{"profile_matrix": {"p": {"secret_file": "/etc/s.json"}}}"#,
                "unknown field `secret_file`, expected",
            ),
            (
                r#"{"profile_matrix": {}, "version": 2}"#,
                "unknown field `version`",
            ),
            (
                r#"{"profile_matrix": {"p": {"volume_capabilities": {"access_mode": {"mode": "SINGLE_NODE_WRITER", "x": 1}}}}}"#,
                "unknown field `x`",
            ),
            (
                r#"{"profile_matrix": {"p": {"secrets_file": "etc/s.json"}}}"#,
                "option 'secrets_file': 'etc/s.json' is not an absolute path",
            ),
            (
                r#"{"profile_matrix": {"p": {"secrets_file": "/etc/s\n.json"}}}"#,
                "is not an absolute path",
            ),
            (
                r#"{"profile_matrix": {"p": {"secrets_file": ""}}}"#,
                "empty value",
            ),
            (&many, "over the limit of 256"),
        ] {
            let err = parse(json).unwrap_err();
            assert!(err.contains(says) && err.contains("/etc/p.json"), "{err}");
        }
    }
}
