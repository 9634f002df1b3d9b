//! The one parser of a volume's options, for every front end: `run --mount KEY=VALUE,...`
//! (and the short `--volume NAME:SIZE:PATH[:ro]`), the OCI hook's mounts annotation and the
//! Docker plugin's `Opts` (`docker volume create -o KEY=VALUE`).
//!
//! Contract: [`MountSpec::parse`] reads one `--mount` entry; [`VolumeOptions::set`] reads one
//! volume option, the same keys and value rules wherever they come from; a key or a value that
//! is not understood is refused by name, never ignored. What a mount asks of the volume (its
//! access type, fs type, flags, mode) goes into the volume's [`Capability`] through
//! [`VolumeOptions::apply`], and a volume that exists already is checked against it
//! ([`VolumeOptions::differs_from`]) rather than used with other options than asked for. Pure: no
//! I/O here (a secrets file is named here and opened where it is used).

use std::path::PathBuf;

use super::state::{AccessType, Capability};
use crate::mount::VolumePropagation;
use crate::resource::{PropagationMode, Resource, VolumeMode};
use crate::shown::shown;

/// One option key, as users write it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Key {
    /// `source=NAME` (also `src`): the volume's name.
    Source,
    /// `target=PATH` (also `dst`, `destination`): where the workload sees it.
    Target,
    /// `size=SIZE`: its capacity, with a unit (`64M`, `1G`).
    Size,
    /// `readonly` (also `ro`; `readonly=true|false`): mounted read-only in the container.
    Readonly,
    /// `type=mount|block`: a filesystem or a raw block device.
    Type,
    /// `fs-type=T`: the filesystem the plugin makes and mounts.
    FsType,
    /// `mount-flags=a:b`: flags of the plugin's mount.
    MountFlags,
    /// `access-mode=MODE`: the CSI access mode (`SINGLE_NODE_WRITER`, ...).
    AccessMode,
    /// `propagation=private|rslave|rshared`: of the container's mount of the volume.
    Propagation,
    /// `secrets=FILE`: the volume's CSI secrets, read from an owner-only file when used.
    Secrets,
}

impl Key {
    /// Every key, in the order the docs give them.
    pub const ALL: [Key; 10] = [
        Key::Source,
        Key::Target,
        Key::Size,
        Key::Readonly,
        Key::Type,
        Key::FsType,
        Key::MountFlags,
        Key::AccessMode,
        Key::Propagation,
        Key::Secrets,
    ];

    /// The key's name.
    pub fn name(self) -> &'static str {
        match self {
            Key::Source => "source",
            Key::Target => "target",
            Key::Size => "size",
            Key::Readonly => "readonly",
            Key::Type => "type",
            Key::FsType => "fs-type",
            Key::MountFlags => "mount-flags",
            Key::AccessMode => "access-mode",
            Key::Propagation => "propagation",
            Key::Secrets => "secrets",
        }
    }

    /// The key of a name or one of its aliases (Docker's `src`, `dst`, `destination`, `ro`).
    pub fn from_name(name: &str) -> Option<Key> {
        match name {
            "src" => Some(Key::Source),
            "dst" | "destination" => Some(Key::Target),
            "ro" => Some(Key::Readonly),
            _ => Key::ALL.into_iter().find(|k| k.name() == name),
        }
    }

    /// The keys that are options of the volume itself (the rest are of one container's mount).
    pub fn is_volume_option(self) -> bool {
        matches!(
            self,
            Key::Size | Key::Type | Key::FsType | Key::MountFlags | Key::AccessMode | Key::Secrets
        )
    }
}

/// An option that cannot be used, named.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("option '{key}': {reason}")]
pub struct OptionError {
    /// The key as written, escaped and shortened.
    pub key: String,
    /// What is wrong and what to write instead.
    pub reason: String,
}

fn refuse(key: &str, reason: impl Into<String>) -> OptionError {
    OptionError {
        key: shown(key).into_owned(),
        reason: reason.into(),
    }
}

/// Longest secrets file path accepted.
const MAX_PATH_BYTES: usize = 4096;

/// The options of a volume a mount asks for; `None` where the user said nothing (a volume that
/// exists is used as it is then, and a new one gets the plugin's or the CSI default).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VolumeOptions {
    /// `size=`: capacity in bytes.
    pub size_bytes: Option<u64>,
    /// `type=`.
    pub access_type: Option<AccessType>,
    /// `fs-type=`.
    pub fs_type: Option<String>,
    /// `mount-flags=`.
    pub mount_flags: Option<Vec<String>>,
    /// `access-mode=`, a name the CSI spec defines (checked).
    pub access_mode: Option<String>,
    /// `secrets=`: an absolute path.
    pub secrets: Option<PathBuf>,
}

impl VolumeOptions {
    /// Reads one volume option (`key` must be one, see [`Key::is_volume_option`]). Mount flags
    /// are separated by `:` (and, where a `,` does not end the value, as in Docker's `-o`, by `,`).
    pub fn set(&mut self, key: Key, written: &str, value: &str) -> Result<(), OptionError> {
        if value.is_empty() {
            return Err(refuse(written, "empty value"));
        }
        match key {
            Key::Size => {
                let bytes = crate::resource::parse_size(value)
                    .filter(|b| *b > 0)
                    .ok_or_else(|| {
                        refuse(
                            written,
                            format!(
                                "invalid size '{}': give a size above 0 with a unit (examples: 64M, 1G)",
                                shown(value)
                            ),
                        )
                    })?;
                self.size_bytes = Some(bytes);
            }
            Key::Type => {
                // Spelled out here (not AccessType::parse): an empty value is refused above.
                self.access_type = Some(match value {
                    "mount" => AccessType::Mount,
                    "block" => AccessType::Block,
                    other => {
                        return Err(refuse(
                            written,
                            format!("unknown type '{}' (expected mount or block)", shown(other)),
                        ))
                    }
                });
            }
            // The form of both is Capability::set_mount's (the one copy of the rule, shared
            // with `serve`); whether the volume is a block one is checked with the whole entry.
            Key::FsType => {
                Capability::default()
                    .set_mount(value, &[])
                    .map_err(|e| refuse(written, e.to_string()))?;
                self.fs_type = Some(value.to_string());
            }
            Key::MountFlags => {
                let flags: Vec<String> = value.split([':', ',']).map(str::to_string).collect();
                Capability::default().set_mount("", &flags).map_err(|e| {
                    refuse(
                        written,
                        format!("{e} (separate flags with ':', e.g. noatime:nodev)"),
                    )
                })?;
                self.mount_flags = Some(flags);
            }
            Key::AccessMode => {
                Capability::default()
                    .set_access_mode(value)
                    .map_err(|e| refuse(written, e.to_string()))?;
                self.access_mode = Some(value.to_string());
            }
            Key::Secrets => {
                if !value.starts_with('/')
                    || value.len() > MAX_PATH_BYTES
                    || value.chars().any(char::is_control)
                {
                    return Err(refuse(
                        written,
                        format!(
                            "'{}' is not an absolute path of at most {MAX_PATH_BYTES} bytes (name the secrets file by its absolute path)",
                            shown(value)
                        ),
                    ));
                }
                self.secrets = Some(PathBuf::from(value));
            }
            Key::Source | Key::Target | Key::Readonly | Key::Propagation => {
                return Err(refuse(
                    written,
                    "is an option of a container's mount, not of the volume",
                ))
            }
        }
        Ok(())
    }

    /// A block volume has no fs type and no mount flags (CSI's block capability has none):
    /// `type=block` with `fs-type=` or `mount-flags=` is refused, naming the key.
    pub fn check_access_type(&self) -> Result<(), OptionError> {
        let mut capability = Capability {
            access_type: self.access_type.unwrap_or_default(),
            ..Capability::default()
        };
        capability
            .set_mount(self.fs_type.as_deref().unwrap_or_default(), &[])
            .map_err(|e| refuse(Key::FsType.name(), e.to_string()))?;
        capability
            .set_mount("", self.mount_flags.as_deref().unwrap_or_default())
            .map_err(|e| refuse(Key::MountFlags.name(), e.to_string()))?;
        Ok(())
    }

    /// Puts what was asked into a new volume's capability (what was not asked stays as it is).
    pub fn apply(&self, capability: &mut Capability) {
        if let Some(access_type) = self.access_type {
            capability.access_type = access_type;
        }
        if let Some(mode) = &self.access_mode {
            capability.access_mode = mode.clone();
        }
        if let Some(fs_type) = &self.fs_type {
            capability.fs_type = fs_type.clone();
        }
        if let Some(flags) = &self.mount_flags {
            capability.mount_flags = flags.clone();
        }
    }

    /// A new volume `name` with these options (`volume create`, and a mount's volume when none
    /// of that name exists yet).
    pub fn create_spec(&self, name: &str) -> super::CreateSpec {
        let mut spec = super::CreateSpec::new(name, self.size_bytes.unwrap_or(0));
        self.apply(&mut spec.capability);
        spec.secrets_file = self.secrets.clone();
        spec
    }

    /// The capability asked for, when it differs from that of the volume that exists (a volume
    /// is used as it is only when nothing asked differs; what was not asked is the volume's).
    pub fn differs_from(&self, existing: &Capability) -> Option<Capability> {
        let mut asked = existing.clone();
        self.apply(&mut asked);
        (asked != *existing).then_some(asked)
    }
}

/// One `--mount` entry: a volume, where the workload sees it, and how.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountSpec {
    /// The volume's name (the same name is the same volume).
    pub source: String,
    /// Where the workload sees it (relative: in its sandbox).
    pub target: String,
    /// Mounted read-only in the container.
    pub readonly: bool,
    /// Propagation of the container's mount.
    pub propagation: VolumePropagation,
    /// What the mount asks of the volume.
    pub volume: VolumeOptions,
}

/// The form [`MountSpec::parse`] reads, for error messages.
pub const MOUNT_FORM: &str = "source=NAME,target=PATH,size=SIZE[,readonly][,type=mount|block]\
[,fs-type=T][,mount-flags=a:b][,access-mode=MODE][,propagation=private|rslave|rshared][,secrets=FILE]";

impl MountSpec {
    /// Parses one `--mount` entry: `,`-separated `KEY=VALUE` (or a bare `readonly`); `source`,
    /// `target` and `size` are required, a key given twice is refused.
    pub fn parse(entry: &str) -> Result<MountSpec, OptionError> {
        let mut source = None;
        let mut target = None;
        let mut readonly = None;
        let mut propagation = None;
        let mut volume = VolumeOptions::default();
        let mut seen = Vec::new();
        for part in entry.split(',') {
            let (written, value) = match part.split_once('=') {
                Some((k, v)) => (k.trim(), Some(v)),
                None => (part.trim(), None),
            };
            if written.is_empty() {
                return Err(refuse(
                    part,
                    format!("an empty key (expected {MOUNT_FORM})"),
                ));
            }
            let key = Key::from_name(written).ok_or_else(|| {
                let names: Vec<_> = Key::ALL.iter().map(|k| k.name()).collect();
                refuse(
                    written,
                    format!("unknown key (expected one of {})", names.join(", ")),
                )
            })?;
            if seen.contains(&key) {
                return Err(refuse(written, "given twice"));
            }
            seen.push(key);
            let text = |v: Option<&str>| -> Result<String, OptionError> {
                match v {
                    Some(v) if !v.is_empty() => Ok(v.to_string()),
                    _ => Err(refuse(written, "needs a value (KEY=VALUE)")),
                }
            };
            match key {
                Key::Source => source = Some(text(value)?),
                Key::Target => target = Some(text(value)?),
                Key::Readonly => {
                    readonly = Some(match value {
                        None | Some("true") | Some("1") => true,
                        Some("false") | Some("0") => false,
                        Some(other) => {
                            return Err(refuse(
                                written,
                                format!(
                                    "'{}' is not true or false (or write readonly alone)",
                                    shown(other)
                                ),
                            ))
                        }
                    })
                }
                Key::Propagation => {
                    propagation = Some(match text(value)?.as_str() {
                        "private" | "rprivate" => VolumePropagation::Private,
                        "rslave" => VolumePropagation::Rslave,
                        "rshared" => VolumePropagation::Rshared,
                        other => {
                            return Err(refuse(
                                written,
                                format!(
                                "unknown propagation '{}' (expected private, rslave or rshared)",
                                shown(other)
                            ),
                            ))
                        }
                    })
                }
                // Within a `--mount` entry a `,` ends the value: mount flags are `:`-separated.
                _ => volume.set(key, written, &text(value)?)?,
            }
        }
        let missing = |key: Key| refuse(key.name(), format!("is required ({MOUNT_FORM})"));
        let spec = MountSpec {
            source: source.ok_or_else(|| missing(Key::Source))?,
            target: target.ok_or_else(|| missing(Key::Target))?,
            readonly: readonly.unwrap_or(false),
            propagation: propagation.unwrap_or_default(),
            volume,
        };
        if spec.volume.size_bytes.is_none() {
            return Err(missing(Key::Size));
        }
        spec.volume.check_access_type()?;
        Ok(spec)
    }

    /// A short `--volume NAME:SIZE:CONTAINER_PATH[:ro]` as a mount.
    pub fn from_volume_arg(arg: &crate::resource::VolumeArg) -> MountSpec {
        MountSpec {
            source: arg.name.clone(),
            target: arg.container_path.clone(),
            readonly: arg.readonly,
            propagation: VolumePropagation::Private,
            volume: VolumeOptions {
                size_bytes: Some(arg.size_bytes),
                ..VolumeOptions::default()
            },
        }
    }

    /// The volume's resource as this mount uses it: at its target, read-only or not, with its
    /// propagation (Mesos' `disk.volume.mount_propagation`; left out for private).
    pub fn use_of(&self, resource: Resource) -> Resource {
        let mode = if self.readonly {
            VolumeMode::Ro
        } else {
            VolumeMode::Rw
        };
        let resource = resource.with_volume(&self.target, mode);
        match self.propagation {
            VolumePropagation::Private => resource,
            VolumePropagation::Rslave => {
                resource.with_mount_propagation(PropagationMode::HostToContainer)
            }
            VolumePropagation::Rshared => {
                resource.with_mount_propagation(PropagationMode::Bidirectional)
            }
        }
    }

    /// Refuses this mount of the recorded volume `rec` when it asks for another capability or
    /// another secrets file than the volume has (what it leaves out is the volume's): the one
    /// check of `run --mount` and the hook's mounts annotation against a volume that exists.
    pub fn check_against(&self, rec: &super::VolumeRecord) -> Result<(), super::ProviderError> {
        if let Some(asked) = self.volume.differs_from(&rec.capability) {
            return Err(super::ProviderError::CapabilityDiffers {
                volume: self.source.clone(),
                recorded: rec.capability.describe(),
                asked: asked.describe(),
            });
        }
        if let Some(asked) = &self.volume.secrets {
            super::secrets::same_file(&self.source, rec.secrets_file.as_deref(), Some(asked))?;
        }
        Ok(())
    }

    /// What to create when no volume of this name exists yet.
    pub fn create_spec(&self, name: &str) -> super::CreateSpec {
        self.volume.create_spec(name)
    }
}

impl std::str::FromStr for MountSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        MountSpec::parse(s).map_err(|e| format!("--mount '{}': {e}", shown(s)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_entry_is_read_key_by_key() {
        let m = MountSpec::parse(
            "source=db,target=/var/lib/db,size=1G,readonly,fs-type=ext4,mount-flags=noatime:nodev,access-mode=SINGLE_NODE_MULTI_WRITER",
        )
        .unwrap();
        assert_eq!(m.source, "db");
        assert_eq!(m.target, "/var/lib/db");
        assert!(m.readonly);
        assert_eq!(m.propagation, VolumePropagation::Private);
        assert_eq!(m.volume.size_bytes, Some(1 << 30));
        assert_eq!(m.volume.fs_type.as_deref(), Some("ext4"));
        assert_eq!(
            m.volume.mount_flags.as_deref(),
            Some(&["noatime".to_string(), "nodev".to_string()][..])
        );
        let spec = m.create_spec("db");
        assert_eq!(spec.capacity_bytes, 1 << 30);
        assert_eq!(spec.capability.access_mode, "SINGLE_NODE_MULTI_WRITER");
        assert_eq!(spec.capability.fs_type, "ext4");
        assert_eq!(spec.capability.mount_flags, ["noatime", "nodev"]);

        let m = MountSpec::parse("src=d,dst=data,size=64M,ro=false,type=mount").unwrap();
        assert_eq!((m.source.as_str(), m.target.as_str()), ("d", "data"));
        assert!(!m.readonly);
        assert_eq!(m.volume.access_type, Some(AccessType::Mount));
        assert_eq!(
            m.create_spec("d").capability,
            Capability::default(),
            "nothing asked: CSI's defaults"
        );
    }

    #[test]
    fn bad_keys_and_values_are_refused_by_name() {
        for (entry, says) in [
            ("target=/d,size=1M", "option 'source': is required"),
            ("source=d,size=1M", "option 'target': is required"),
            ("source=d,target=/d", "option 'size': is required"),
            (
                "source=d,target=/d,size=1M,colour=red",
                "option 'colour': unknown key",
            ),
            (
                "source=d,target=/d,size=1M,size=2M",
                "option 'size': given twice",
            ),
            (
                "source=d,target=/d,size=lots",
                "option 'size': invalid size 'lots'",
            ),
            ("source=d,target=/d,size=0", "above 0"),
            (
                "source=,target=/d,size=1M",
                "option 'source': needs a value",
            ),
            (
                "source=d,target=/d,size=1M,readonly=maybe",
                "'maybe' is not true or false",
            ),
            (
                "source=d,target=/d,size=1M,type=tape",
                "unknown type 'tape'",
            ),
            (
                "source=d,target=/d,size=1M,fs-type=ext4;rm",
                "not a filesystem type name",
            ),
            (
                "source=d,target=/d,size=1M,mount-flags=a::b",
                "flag '' is empty",
            ),
            (
                "source=d,target=/d,size=1M,access-mode=ANY",
                "unknown CSI access mode 'ANY'",
            ),
            (
                "source=d,target=/d,size=1M,type=block,fs-type=ext4",
                "option 'fs-type': 'ext4' asked for a block volume, which has no filesystem",
            ),
            (
                "source=d,target=/d,size=1M,mount-flags=noatime,type=block",
                "option 'mount-flags': asked for a block volume",
            ),
            (
                "source=d,target=/d,size=1M,mount-flags=a::b",
                "(separate flags with ':', e.g. noatime:nodev)",
            ),
            (
                "source=d,target=/d,size=1M,propagation=up",
                "unknown propagation 'up'",
            ),
            (
                "source=d,target=/d,size=1M,secrets=rel/path",
                "not an absolute path",
            ),
            ("source=d,target=/d,size=1M,,readonly", "an empty key"),
        ] {
            let err = MountSpec::parse(entry).unwrap_err().to_string();
            assert!(err.contains(says), "{entry}: {err}");
        }
        let err = "x".parse::<MountSpec>().unwrap_err();
        assert!(
            err.starts_with("--mount 'x': option 'x': unknown key"),
            "{err}"
        );
    }

    #[test]
    fn propagation_goes_into_the_resource_as_mesos_writes_it() {
        let res = |entry: &str| {
            let m = MountSpec::parse(entry).unwrap();
            let r = m.use_of(Resource::scalar("disk", 1.0));
            serde_json::to_value(&r).unwrap()["disk"]["volume"].clone()
        };
        let private = res("source=d,target=/d,size=1M,propagation=private");
        assert_eq!(private["container_path"], "/d");
        assert_eq!(private["mode"], "RW");
        assert!(private.get("mount_propagation").is_none(), "{private}");
        let slave = res("source=d,target=/d,size=1M,propagation=rslave,readonly");
        assert_eq!(slave["mode"], "RO");
        assert_eq!(slave["mount_propagation"]["mode"], "HOST_TO_CONTAINER");
        let shared = res("source=d,target=/d,size=1M,propagation=rshared");
        assert_eq!(shared["mount_propagation"]["mode"], "BIDIRECTIONAL");
    }

    #[test]
    fn volume_options_are_the_same_wherever_they_come_from() {
        let mut o = VolumeOptions::default();
        o.set(Key::MountFlags, "mount-flags", "noatime,nodev")
            .unwrap();
        assert_eq!(
            o.mount_flags.clone().unwrap(),
            ["noatime", "nodev"],
            "Docker's -o keeps ','"
        );
        let err = o.set(Key::Readonly, "ro", "true").unwrap_err().to_string();
        assert!(err.contains("option of a container's mount"), "{err}");
        let err = o.set(Key::Size, "size", "").unwrap_err().to_string();
        assert!(err.contains("empty value"), "{err}");
    }

    #[test]
    fn an_existing_volume_is_checked_against_what_was_asked() {
        let existing = Capability {
            fs_type: "ext4".into(),
            ..Capability::default()
        };
        let same = MountSpec::parse("source=d,target=/d,size=1M,fs-type=ext4").unwrap();
        assert_eq!(same.volume.differs_from(&existing), None);
        let silent = MountSpec::parse("source=d,target=/d,size=1M").unwrap();
        assert_eq!(silent.volume.differs_from(&existing), None, "nothing asked");
        let other =
            MountSpec::parse("source=d,target=/d,size=1M,access-mode=MULTI_NODE_READER_ONLY")
                .unwrap();
        let asked = other.volume.differs_from(&existing).unwrap();
        assert_eq!(asked.describe(), "MULTI_NODE_READER_ONLY fs_type=ext4");
    }

    #[test]
    fn the_short_form_is_a_mount_too() {
        let arg: crate::resource::VolumeArg = "logs:1G:/var/log:ro".parse().unwrap();
        let m = MountSpec::from_volume_arg(&arg);
        assert_eq!(m.source, "logs");
        assert_eq!(m.target, "/var/log");
        assert!(m.readonly);
        assert_eq!(m.volume.size_bytes, Some(1 << 30));
        assert_eq!(m.create_spec("logs").capability, Capability::default());
    }
}
