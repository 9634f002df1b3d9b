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
//! A profile gives a volume's capability (access mode, mount flags, file
//! system) and its CreateVolume parameters; `csi_plugin_type_selector`, when
//! present, limits it to plugins of that type (`resource_provider_selector`
//! is not read). The file is the operator's, but it is read by root and
//! turns into what a driver mounts: it must be a regular file, owned by root
//! and writable by nobody else, in a directory that passes the work dir's
//! rule, or it is refused ([`load`]). Its size, the number of profiles and
//! every parameter set are bounded as parameters are everywhere
//! ([`crate::provider::parameters`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::provider::parameters::{self, ParameterError};
use crate::provider::state::Capability;
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

#[derive(Deserialize)]
struct Matrix {
    profile_matrix: BTreeMap<String, Entry>,
}

#[derive(Deserialize)]
struct Entry {
    #[serde(default)]
    csi_plugin_type_selector: Option<TypeSelector>,
    #[serde(default)]
    volume_capabilities: Option<Capabilities>,
    #[serde(default)]
    create_parameters: BTreeMap<String, String>,
}

#[derive(Deserialize)]
struct TypeSelector {
    plugin_type: String,
}

#[derive(Deserialize)]
struct Capabilities {
    #[serde(default)]
    mount: Option<MountCapability>,
    #[serde(default)]
    block: Option<serde_json::Value>,
    #[serde(default)]
    access_mode: Option<AccessMode>,
}

#[derive(Deserialize, Default)]
struct MountCapability {
    #[serde(default)]
    fs_type: String,
    #[serde(default)]
    mount_flags: Vec<String>,
}

#[derive(Deserialize)]
struct AccessMode {
    mode: String,
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
            let mut capability = Capability::default();
            if let Some(caps) = entry.volume_capabilities {
                if caps.block.is_some() {
                    return Err(bad(
                        "block volumes are not supported (volumes are mounted on directories)"
                            .into(),
                    ));
                }
                let mount = caps.mount.unwrap_or_default();
                capability.fs_type = mount.fs_type;
                capability.mount_flags = mount.mount_flags;
                if let Some(mode) = caps.access_mode {
                    capability
                        .set_access_mode(&mode.mode)
                        .map_err(|e| bad(e.to_string()))?;
                }
            }
            profiles.insert(
                name,
                Profile {
                    capability,
                    parameters: entry.create_parameters,
                    plugin_type: entry.csi_plugin_type_selector.map(|s| s.plugin_type),
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
    if !matches!(source.kind, SourceType::Mount | SourceType::Raw) {
        return ProfileDisk::Refuse(
            "a profile disk becomes a MOUNT volume: give disk.source.type MOUNT (or RAW)",
        );
    }
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
        },
        _ => ProfileDisk::Refuse("a profile disk needs a scalar size above 0 (MB)"),
    }
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
                bytes: 16 << 20
            }
        );
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
                r#"{"profile_matrix": {"p": {"volume_capabilities": {"block": {}}}}}"#,
                "block volumes are not supported",
            ),
            (&many, "over the limit of 256"),
        ] {
            let err = parse(json).unwrap_err();
            assert!(err.contains(says) && err.contains("/etc/p.json"), "{err}");
        }
    }
}
