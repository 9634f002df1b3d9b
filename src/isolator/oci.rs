//! The Docker/OCI containerizer path: volumes are bound on the host into the
//! container's sandbox before the runtime starts, and the runtime is handed
//! the matching bind mounts.
//!
//! Contract:
//! - [`prepare`] binds each [`VolumeMount`]'s source at
//!   `<sandbox>/<container_path without its leading '/'>` (read-only when
//!   asked) and returns, for each, an OCI runtime-spec `mounts` entry and the
//!   `docker run --mount` arguments that give the runtime the same bind.
//! - The source is opened by fd beneath its trusted root, following no
//!   symlink inside a volume ([`VolumeMount::open_source`]), and the bind is
//!   cloned from that fd. The bind is a host path, so it carries nosuid,nodev
//!   whatever the source's mount has; a runtime given it (`rbind`) passes
//!   them on, so such a container sees its volume nosuid,nodev.
//! - The sandbox is written by the container, so the bind target is resolved
//!   *inside* the sandbox by fd ([`create_in_root`]): a symlink planted there
//!   (`data -> /etc`) is followed as if the sandbox were `/`, and the bind
//!   lands inside the sandbox. The host path handed to the runtime is the
//!   kernel's name for the resolved target, so it is where the bind really is.
//! - All or nothing: when a volume fails, the binds this call already made
//!   are taken down again and the error names the volume, the step and the
//!   path. Duplicate destinations (or two volumes landing on the same host
//!   path) are refused before anything is mounted.
//! - [`cleanup`] unmounts every mount at or below the sandbox, deepest first,
//!   with bounded EBUSY retries and a lazy detach as the last resort: the
//!   mount table, not our bookkeeping, says what is left.
//!
//! - A block volume is not bound: its device file (opened by fd, it must be
//!   a block device) is given to the runtime by number, as one runtime-spec
//!   `linux.devices` entry at its destination and one `linux.resources.devices`
//!   rule allowing exactly that device (`docker run --device`): the runtime
//!   makes the node in the container and its device cgroup lets the container
//!   open that device and no other. A host bind would carry nodev, which the
//!   runtime's bind passes on, and the device could not be opened.
//! - Propagation ([`VolumePropagation`]): the runtime-spec entry carries `rprivate`, `rslave` or
//!   `rshared` and the `docker run --mount` value `bind-propagation=` (left out for private, Docker's
//!   default). For rslave and rshared the volume's host mount point is made shared first and the host
//!   bind stays its peer. runc applies the option to its copy after making the container's `/`
//!   `rootfsPropagation` (default `rslave`): rslave works with that default (and with `shared`,
//!   `rshared` or `slave`, not with a private one: the copy would have no master); rshared needs
//!   `shared` or `rshared`, otherwise runc's copy is a slave and a mount made inside never reaches the
//!   host. [`OciPrepared::rootfs_propagation`] names what the volumes need (PrepareOci's
//!   `rootfs_propagation`) and [`OciPrepared::apply_to_config`] sets `linux.rootfsPropagation` when the
//!   config's value does not give it ([`rootfs_propagation_for`]); Docker does the same itself for a
//!   `bind-propagation` of its `--mount`.
//!
//! The runtime is not started here, so nothing in the container can race
//! the resolution; once it runs, its view of the binds is the runtime's.

use std::collections::HashMap;
use std::io;
use std::os::fd::AsFd;
use std::path::{Component, Path, PathBuf};
use std::time::Duration;

use nix::errno::Errno;
use serde::{Deserialize, Serialize};

use crate::error_chain::Chain;
use crate::isolator::launch_info::LaunchInfo;
use crate::mount::{
    create_in_root, fd_path, unmount_all_under, unmount_no_symlinks_with_retry, MountError,
    MountFlags, MountTable, Syscall,
};
use crate::mount::{VolumeMount, VolumePropagation, SANDBOX_IN_ROOTFS};

/// Every way the OCI path can fail; each names the step, the volume and the
/// path it failed on.
#[derive(Debug, thiserror::Error)]
pub enum OciError {
    /// The sandbox directory could not be resolved to its canonical path.
    #[error("resolve sandbox {path}")]
    Sandbox {
        /// The sandbox as given.
        path: PathBuf,
        /// The I/O error.
        source: io::Error,
    },
    /// A `container_path` is empty, `/`, holds `..` or a NUL byte.
    #[error("volume {volume}: container path {container_path:?} is invalid: {reason}")]
    InvalidContainerPath {
        /// The volume id (or `-` when it has none).
        volume: String,
        /// The container path as written.
        container_path: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A block volume's host path is not a block device.
    #[error("volume {volume}: {path} is not a block device, so it cannot be given as the block volume's device")]
    NotABlockDevice {
        /// The volume id (or `-`).
        volume: String,
        /// The host path.
        path: PathBuf,
    },
    /// Two volumes ask for the same place in the container.
    #[error("volume {volume}: destination {destination} is already used by volume {other}")]
    DuplicateDestination {
        /// The volume refused.
        volume: String,
        /// The destination inside the container.
        destination: String,
        /// The volume that claimed it first.
        other: String,
    },
    /// Two volumes would be bound at the same host path in the sandbox
    /// (e.g. `/data` and `data`), so one would hide the other.
    #[error("volume {volume}: host bind path {path} is already used by volume {other}")]
    DuplicateHostPath {
        /// The volume refused.
        volume: String,
        /// The host path in the sandbox.
        path: PathBuf,
        /// The volume that claimed it first.
        other: String,
    },
    /// The volume's source could not be opened (missing, or a symlink inside a volume) or examined.
    #[error("volume {volume}: stat source {path}")]
    StatSource {
        /// The volume id.
        volume: String,
        /// The source path.
        path: PathBuf,
        /// The I/O error.
        source: io::Error,
    },
    /// Resolving (and creating) the bind target inside the sandbox failed.
    #[error("volume {volume}: resolve bind target {path} inside sandbox {sandbox}")]
    ResolveTarget {
        /// The volume id.
        volume: String,
        /// The target, relative to the sandbox.
        path: PathBuf,
        /// The sandbox.
        sandbox: PathBuf,
        /// The mount module's error (boxed: it is large).
        source: Box<MountError>,
    },
    /// Making the volume's host mount point shared (for rslave or rshared propagation) failed.
    #[error("volume {volume}: share host mount point for {propagation} propagation")]
    ShareHostMountPoint {
        /// The volume id.
        volume: String,
        /// The propagation asked for.
        propagation: &'static str,
        /// The mount module's error (boxed: it is large).
        source: Box<MountError>,
    },
    /// Cloning the source tree (`open_tree`) or binding it by path failed.
    #[error("volume {volume}: bind source {path}")]
    BindSource {
        /// The volume id.
        volume: String,
        /// The source path.
        path: PathBuf,
        /// The mount module's error (boxed: it is large).
        source: Box<MountError>,
    },
    /// Setting the bind's flags (nosuid, nodev, read-only when asked) failed.
    #[error("volume {volume}: set flags of bind at {path}")]
    SetReadonly {
        /// The volume id.
        volume: String,
        /// The host bind path.
        path: PathBuf,
        /// The mount module's error (boxed: it is large).
        source: Box<MountError>,
    },
    /// Attaching the cloned tree at the target (`move_mount`) failed.
    #[error("volume {volume}: attach bind at {path}")]
    AttachBind {
        /// The volume id.
        volume: String,
        /// The host bind path.
        path: PathBuf,
        /// The mount module's error (boxed: it is large).
        source: Box<MountError>,
    },
    /// A path is not UTF-8 and cannot be written into config.json.
    #[error("volume {volume}: host bind path {path} is not valid UTF-8")]
    NonUtf8Path {
        /// The volume id.
        volume: String,
        /// The offending path.
        path: PathBuf,
    },
    /// Unmounting what is under the sandbox failed.
    #[error("unmount mounts under sandbox {path}")]
    Cleanup {
        /// The sandbox.
        path: PathBuf,
        /// The mount module's error (boxed: it is large).
        source: Box<MountError>,
    },
}

/// One OCI runtime-spec `mounts` entry (config.json), with the spec's field
/// names.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OciMount {
    /// The absolute path inside the container.
    pub destination: String,
    /// The mount type: always `bind` here.
    #[serde(rename = "type")]
    pub kind: String,
    /// The host path bound (the bind made in the sandbox).
    pub source: String,
    /// Mount options: `rbind`, the propagation (`rprivate`, `rslave` or `rshared`), `ro` or `rw`, then the
    /// hardening flags the volume asks for (`nosuid`, `nodev`, `noexec`).
    pub options: Vec<String>,
}

/// One block volume's device for the runtime: a runtime-spec `linux.devices` entry, and the
/// `linux.resources.devices` rule allowing it, made from the same numbers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OciDevice {
    /// The absolute path of the device node inside the container.
    pub path: String,
    /// The device's major number.
    pub major: u64,
    /// The device's minor number.
    pub minor: u64,
    /// The device cgroup access: `rw` (a block volume is read-write).
    pub access: String,
}

impl OciDevice {
    /// The `linux.devices` entry (a block device, mode 0660, owned by root).
    pub fn device_entry(&self) -> serde_json::Value {
        serde_json::json!({
            "path": self.path, "type": "b", "major": self.major, "minor": self.minor,
            "fileMode": 0o660, "uid": 0, "gid": 0,
        })
    }

    /// The `linux.resources.devices` rule allowing exactly this device.
    pub fn cgroup_rule(&self) -> serde_json::Value {
        serde_json::json!({
            "allow": true, "type": "b", "major": self.major, "minor": self.minor,
            "access": self.access,
        })
    }
}

/// What [`prepare`] made and what the runtime must be given.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OciPrepared {
    /// The binds made on the host, in the order they were made.
    pub host_binds: Vec<PathBuf>,
    /// The runtime-spec `mounts` entries, one per (non-block) volume, in order.
    pub mounts: Vec<OciMount>,
    /// `docker run` arguments: a `--mount` flag and its value per volume (`--device` for a
    /// block volume).
    pub docker_args: Vec<String>,
    /// The block volumes' devices, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<OciDevice>,
}

impl OciPrepared {
    /// Appends the entries to an OCI bundle config's `mounts` array, first
    /// dropping entries already there with the same destination (compared as
    /// paths, so `/data/` and `/data` match). A missing or non-array
    /// `mounts` becomes an array; a config that is not a JSON object at all
    /// is not a config.json and is replaced by `{"mounts": [...]}`.
    ///
    /// When the volumes' propagation needs it ([`rootfs_propagation_for`]), `linux.rootfsPropagation`
    /// is set too.
    pub fn apply_to_config(&self, config: &mut serde_json::Value) {
        if !config.is_object() {
            *config = serde_json::Value::Object(serde_json::Map::new());
        }
        let object = config
            .as_object_mut()
            .expect("config was just made an object");
        let current = object
            .get("linux")
            .and_then(|l| l.get("rootfsPropagation"))
            .and_then(|p| p.as_str());
        if let Some(value) = rootfs_propagation_for(current, self.rootfs_propagation()) {
            let linux = array_in(object, "linux", None);
            linux
                .as_object_mut()
                .expect("linux was just made an object")
                .insert("rootfsPropagation".to_string(), value.into());
        }
        let mounts = object
            .entry("mounts")
            .or_insert_with(|| serde_json::Value::Array(Vec::new()));
        if !mounts.is_array() {
            *mounts = serde_json::Value::Array(Vec::new());
        }
        let list = mounts
            .as_array_mut()
            .expect("mounts was just made an array");
        list.retain(|entry| {
            let Some(existing) = entry.get("destination").and_then(|d| d.as_str()) else {
                return true;
            };
            !self
                .mounts
                .iter()
                .any(|m| Path::new(&m.destination) == Path::new(existing))
        });
        for m in &self.mounts {
            list.push(serde_json::to_value(m).expect("an OciMount of strings serializes"));
        }
        if self.devices.is_empty() {
            return;
        }
        let linux = array_in(object, "linux", None);
        let linux = linux
            .as_object_mut()
            .expect("linux was just made an object");
        let devices = array_in(linux, "devices", Some(Vec::new()));
        let devices = devices
            .as_array_mut()
            .expect("devices was just made an array");
        devices.retain(|entry| {
            let path = entry.get("path").and_then(|p| p.as_str()).map(Path::new);
            !self
                .devices
                .iter()
                .any(|d| Some(Path::new(&d.path)) == path)
        });
        devices.extend(self.devices.iter().map(OciDevice::device_entry));
        let resources = array_in(linux, "resources", None);
        let resources = resources
            .as_object_mut()
            .expect("resources was just made an object");
        let rules = array_in(resources, "devices", Some(Vec::new()));
        let rules = rules.as_array_mut().expect("rules were just made an array");
        // After the runtime's own rules (a default deny first): the last match decides.
        rules.extend(self.devices.iter().map(OciDevice::cgroup_rule));
    }
}

impl OciPrepared {
    /// The strongest propagation the volumes' entries ask for (`rshared` over `rslave` over
    /// private), which the runtime's `rootfsPropagation` must allow ([`rootfs_propagation_for`]).
    /// Read from the entries' options, so entries rebuilt from PrepareOci's answer give it too.
    pub fn rootfs_propagation(&self) -> VolumePropagation {
        let asks = |option: &str| {
            self.mounts
                .iter()
                .any(|m| m.options.iter().any(|o| o == option))
        };
        if asks(propagation_option(VolumePropagation::Rshared)) {
            VolumePropagation::Rshared
        } else if asks(propagation_option(VolumePropagation::Rslave)) {
            VolumePropagation::Rslave
        } else {
            VolumePropagation::Private
        }
    }
}

/// The `linux.rootfsPropagation` a runtime config must be given so that its binds can carry `need`,
/// or `None` when its value (`current`; `None` is runc's default, `rslave`) does already. runc makes
/// the new namespace's mounts `rootfsPropagation` before binding the volumes: an rshared bind stays a
/// peer of the host mount point only under `shared` or `rshared` (under a slave root it becomes a
/// slave, its mounts never reaching the host); an rslave bind keeps a master under anything but a
/// private or unbindable root.
pub fn rootfs_propagation_for(
    current: Option<&str>,
    need: VolumePropagation,
) -> Option<&'static str> {
    let shared = matches!(current, Some("shared" | "rshared"));
    let slave = current.is_none() || matches!(current, Some("slave" | "rslave"));
    match need {
        VolumePropagation::Private => None,
        VolumePropagation::Rslave if shared || slave => None,
        VolumePropagation::Rslave => Some("rslave"),
        VolumePropagation::Rshared if shared => None,
        VolumePropagation::Rshared => Some("rshared"),
    }
}

/// `object[key]`, made an array (`Some`) or an object (`None`) when missing or of another type.
fn array_in<'a>(
    object: &'a mut serde_json::Map<String, serde_json::Value>,
    key: &str,
    array: Option<Vec<serde_json::Value>>,
) -> &'a mut serde_json::Value {
    let fresh = || match &array {
        Some(a) => serde_json::Value::Array(a.clone()),
        None => serde_json::Value::Object(serde_json::Map::new()),
    };
    let value = object.entry(key).or_insert_with(fresh);
    let right = if array.is_some() {
        value.is_array()
    } else {
        value.is_object()
    };
    if !right {
        *value = fresh();
    }
    value
}

/// A volume's checked placement: where it lands on the host and in the
/// container.
#[derive(Debug)]
struct Placement {
    /// The label used in errors (volume id, or `-`).
    volume: String,
    /// The target relative to the sandbox (normalized, no `..`).
    relative: PathBuf,
    /// The absolute destination in the container.
    destination: String,
}

fn volume_label(m: &VolumeMount) -> String {
    m.volume_id.clone().unwrap_or_else(|| "-".to_string())
}

/// Normalizes a `container_path` into its sandbox-relative target and its
/// container destination.
fn place(m: &VolumeMount) -> Result<Placement, OciError> {
    let volume = volume_label(m);
    let invalid = |reason| OciError::InvalidContainerPath {
        volume: volume.clone(),
        container_path: m.container_path.clone(),
        reason,
    };
    if m.container_path.contains('\0') {
        return Err(invalid("it contains a NUL byte"));
    }
    let path = Path::new(&m.container_path);
    let mut relative = PathBuf::new();
    for component in path.components() {
        match component {
            Component::Normal(c) => relative.push(c),
            Component::RootDir | Component::CurDir => {}
            Component::ParentDir => return Err(invalid("it holds a '..' component")),
            Component::Prefix(_) => return Err(invalid("it holds a path prefix")),
        }
    }
    if relative.as_os_str().is_empty() {
        return Err(invalid("it names no directory below the root"));
    }
    let rel = relative
        .to_str()
        .expect("built from the components of a String");
    let destination = if path.is_absolute() {
        format!("/{rel}")
    } else {
        format!("{SANDBOX_IN_ROOTFS}/{rel}")
    };
    Ok(Placement {
        volume,
        relative,
        destination,
    })
}

/// Quotes one field of a `docker run --mount` value: Docker reads the value
/// as a CSV record, so a field holding `,`, `"` or a line break is wrapped in
/// double quotes with inner quotes doubled.
fn csv_field(field: &str) -> String {
    if field.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", field.replace('"', "\"\""))
    } else {
        field.to_string()
    }
}

/// The `--mount` value for one bind (Docker's `bind-propagation` is `rprivate` unless told).
///
/// Docker's `--mount` cannot name nosuid, nodev or noexec, and its `readonly` makes runc remount the bind
/// with only the flags its options name, which would drop a volume's hardening flags. So a read-only
/// volume with hardening flags is given without `readonly`: the host bind is read-only already, and
/// runc's plain recursive bind copies it with every flag it has (read-only included).
fn docker_mount_value(
    source: &str,
    destination: &str,
    readonly: bool,
    hardened: bool,
    propagation: VolumePropagation,
) -> String {
    let mut fields = vec![
        "type=bind".to_string(),
        csv_field(&format!("source={source}")),
        csv_field(&format!("target={destination}")),
    ];
    if readonly && !hardened {
        fields.push("readonly".to_string());
    }
    if propagation != VolumePropagation::Private {
        fields.push(format!("bind-propagation={propagation}"));
    }
    fields.join(",")
}

/// The runtime-spec option for a bind's propagation: `rprivate`, `rslave` or `rshared` (runc applies it
/// to the container's copy after its bind; see the module doc for what rshared asks of the rootfs).
fn propagation_option(propagation: VolumePropagation) -> &'static str {
    match propagation {
        VolumePropagation::Private => "rprivate",
        VolumePropagation::Rslave => "rslave",
        VolumePropagation::Rshared => "rshared",
    }
}

/// Binds every volume of `launch` into `sandbox` and returns what the runtime
/// must be given; see the module doc. On error, nothing this call mounted is
/// left mounted (directories it created for targets stay: they are harmless
/// and the sandbox is removed with the container).
#[tracing::instrument(skip(sys, launch), fields(sandbox = %sandbox.display(), volumes = launch.mounts.len()))]
pub fn prepare(
    sys: &dyn Syscall,
    sandbox: &Path,
    launch: &LaunchInfo,
) -> Result<OciPrepared, OciError> {
    let sandbox = std::fs::canonicalize(sandbox).map_err(|source| OciError::Sandbox {
        path: sandbox.to_path_buf(),
        source,
    })?;

    // Check every volume before mounting anything, so a bad or duplicate
    // entry late in the list costs no mount/unmount round trip.
    let mut placements = Vec::with_capacity(launch.mounts.len());
    let mut by_destination: HashMap<String, String> = HashMap::new();
    let mut by_relative: HashMap<PathBuf, String> = HashMap::new();
    for m in &launch.mounts {
        let p = place(m)?;
        if let Some(other) = by_destination.get(&p.destination) {
            return Err(OciError::DuplicateDestination {
                volume: p.volume,
                destination: p.destination,
                other: other.clone(),
            });
        }
        if let Some(other) = by_relative.get(&p.relative) {
            return Err(OciError::DuplicateHostPath {
                volume: p.volume,
                path: sandbox.join(&p.relative),
                other: other.clone(),
            });
        }
        by_destination.insert(p.destination.clone(), p.volume.clone());
        by_relative.insert(p.relative.clone(), p.volume.clone());
        placements.push(p);
    }

    let mut prepared = OciPrepared::default();
    for (m, p) in launch.mounts.iter().zip(&placements) {
        if m.block {
            match block_device(m, p) {
                Ok(device) => {
                    prepared.docker_args.push("--device".to_string());
                    prepared.docker_args.push(format!(
                        "{}:{}:{}",
                        m.source.display(),
                        p.destination,
                        device.access
                    ));
                    prepared.devices.push(device);
                    continue;
                }
                Err(e) => {
                    rollback(sys, &prepared.host_binds);
                    return Err(e);
                }
            }
        }
        match bind_one(sys, &sandbox, m, p) {
            Ok(host) => {
                prepared.host_binds.push(host.clone());
                let Some(source) = host.to_str() else {
                    rollback(sys, &prepared.host_binds);
                    return Err(OciError::NonUtf8Path {
                        volume: p.volume.clone(),
                        path: host,
                    });
                };
                prepared.mounts.push(OciMount {
                    destination: p.destination.clone(),
                    kind: "bind".to_string(),
                    source: source.to_string(),
                    options: [
                        "rbind",
                        propagation_option(m.propagation),
                        if m.readonly { "ro" } else { "rw" },
                    ]
                    .into_iter()
                    // The runtime's remount of the bind keeps only what the options name.
                    .chain(m.hardening.flags().names())
                    .map(str::to_string)
                    .collect(),
                });
                prepared.docker_args.push("--mount".to_string());
                prepared.docker_args.push(docker_mount_value(
                    source,
                    &p.destination,
                    m.readonly,
                    !m.hardening.is_empty(),
                    m.propagation,
                ));
                tracing::debug!(volume_id = %p.volume, host = %host.display(), destination = %p.destination, "volume bound into sandbox");
            }
            Err(e) => {
                tracing::error!(volume_id = %p.volume, error = %Chain(&e), "binding volume into sandbox failed");
                rollback(sys, &prepared.host_binds);
                return Err(e);
            }
        }
    }
    Ok(prepared)
}

/// A block volume's device, by number: its source opened by fd (no symlink followed) must be a
/// block device. (A read-only block volume never gets here: `targets::volume_mounts` refuses it.)
fn block_device(m: &VolumeMount, p: &Placement) -> Result<OciDevice, OciError> {
    let stat_err = |source: io::Error| OciError::StatSource {
        volume: p.volume.clone(),
        path: m.source.clone(),
        source,
    };
    let source = m.open_source().map_err(|e| stat_err(io::Error::other(e)))?;
    let st = nix::sys::stat::fstat(&source)
        .map_err(|errno| stat_err(io::Error::from_raw_os_error(errno as i32)))?;
    let kind =
        nix::sys::stat::SFlag::from_bits_truncate(st.st_mode) & nix::sys::stat::SFlag::S_IFMT;
    if kind != nix::sys::stat::SFlag::S_IFBLK {
        return Err(OciError::NotABlockDevice {
            volume: p.volume.clone(),
            path: m.source.clone(),
        });
    }
    Ok(OciDevice {
        path: p.destination.clone(),
        major: nix::sys::stat::major(st.st_rdev),
        minor: nix::sys::stat::minor(st.st_rdev),
        access: "rw".to_string(),
    })
}

/// Binds one volume at its target inside the sandbox; returns the host path
/// the bind landed on.
fn bind_one(
    sys: &dyn Syscall,
    sandbox: &Path,
    m: &VolumeMount,
    p: &Placement,
) -> Result<PathBuf, OciError> {
    // The source by fd (no symlink followed inside a volume), before anything is created in the sandbox.
    let bind_err = |source: MountError| OciError::BindSource {
        volume: p.volume.clone(),
        path: m.source.clone(),
        source: Box::new(source),
    };
    let stat_err = |source: io::Error| OciError::StatSource {
        volume: p.volume.clone(),
        path: m.source.clone(),
        source,
    };
    // rslave and rshared: the host bind must be a peer of the volume's host mount point, so the
    // runtime's copy of it can follow (or join) that peer group.
    m.share_host_mount_point(sys)
        .map_err(|source| OciError::ShareHostMountPoint {
            volume: p.volume.clone(),
            propagation: m.propagation.as_str(),
            source: Box::new(source),
        })?;
    let source = m.open_source().map_err(|e| stat_err(io::Error::other(e)))?;
    let is_dir = nix::sys::stat::fstat(&source)
        .map_err(|errno| stat_err(io::Error::from_raw_os_error(errno as i32)))
        .map(|st| {
            nix::sys::stat::SFlag::from_bits_truncate(st.st_mode) & nix::sys::stat::SFlag::S_IFMT
                == nix::sys::stat::SFlag::S_IFDIR
        })?;
    let resolve_err = |source: MountError| OciError::ResolveTarget {
        volume: p.volume.clone(),
        path: p.relative.clone(),
        sandbox: sandbox.to_path_buf(),
        source: Box::new(source),
    };
    let target = create_in_root(sandbox, &p.relative, !is_dir).map_err(resolve_err)?;
    let host = fd_path(target.as_fd()).map_err(resolve_err)?;
    // The bind is a host path: it carries nosuid,nodev whatever the source's mount has (and read-only when
    // asked); a runtime given it binds those along.
    // And the hardening flags the volume asks for (noexec among them), whatever the plugin's mount has.
    let flags = if m.readonly {
        MountFlags::HOST_ONLY.union(MountFlags::READONLY)
    } else {
        MountFlags::HOST_ONLY
    }
    .union(m.hardening.flags());
    let flags_err = |source: MountError| OciError::SetReadonly {
        volume: p.volume.clone(),
        path: host.clone(),
        source: Box::new(source),
    };

    match sys.open_tree_clone_fd(source.as_fd(), true) {
        Ok(tree) => {
            let pending = match sys.change_mount_flags(tree.as_fd(), flags, MountFlags::NONE, true)
            {
                Ok(()) => false,
                // open_tree without mount_setattr (5.2 to 5.11): remount once attached.
                Err(e) if e.errno() == Some(Errno::ENOSYS) => true,
                Err(e) => return Err(flags_err(e)),
            };
            sys.move_mount_to_fd(tree.as_fd(), target.as_fd())
                .map_err(|source| OciError::AttachBind {
                    volume: p.volume.clone(),
                    path: host.clone(),
                    source: Box::new(source),
                })?;
            if pending {
                if let Err(e) = sys.remount_bind_with(&host, flags, MountFlags::NONE) {
                    rollback(sys, std::slice::from_ref(&host));
                    return Err(flags_err(e));
                }
            }
        }
        // Kernels before 5.2 lack open_tree: bind the resolved source fd onto the resolved target fd with
        // mount(2) instead, then remount with the flags.
        Err(e) if e.errno() == Some(Errno::ENOSYS) => {
            let via = crate::mount::proc_fd_path(source.as_fd());
            sys.bind_mount_to_fd(&via, target.as_fd(), true)
                .map_err(bind_err)?;
            if let Err(e) = sys.remount_bind_with(&host, flags, MountFlags::NONE) {
                rollback(sys, std::slice::from_ref(&host));
                return Err(flags_err(e));
            }
        }
        Err(e) => return Err(bind_err(e)),
    }
    Ok(host)
}

/// Takes down binds this call made, newest first. Nothing has used them yet,
/// so a busy one (one carrying submounts of a recursive bind) is detached at
/// once rather than retried.
fn rollback(sys: &dyn Syscall, binds: &[PathBuf]) {
    for host in binds.iter().rev() {
        if let Err(e) = unmount_no_symlinks_with_retry(sys, host, 0, Duration::ZERO) {
            tracing::error!(path = %host.display(), error = %Chain(&e), "rollback: unmount of bind failed");
        }
    }
}

/// Unmounts every mount at or below `sandbox`, deepest first, with bounded
/// EBUSY retries and then a lazy detach; returns how many it took down.
#[tracing::instrument(skip(sys, table), fields(sandbox = %sandbox.display()))]
pub fn cleanup(
    sys: &dyn Syscall,
    table: &dyn MountTable,
    sandbox: &Path,
) -> Result<usize, OciError> {
    // The mount table holds canonical paths; a sandbox already removed has
    // nothing mounted under its (former) name that canonicalizing could find.
    let path = std::fs::canonicalize(sandbox).unwrap_or_else(|_| sandbox.to_path_buf());
    let count = unmount_all_under(sys, table, &path).map_err(|source| OciError::Cleanup {
        path: path.clone(),
        source: Box::new(source),
    })?;
    tracing::debug!(count, "unmounted sandbox mounts");
    Ok(count)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error_chain::FullMessage;
    use crate::mount::TargetRoot;
    use crate::mount::{Call, CallKind, FakeSyscall};

    fn vm(id: &str, source: &Path, container_path: &str, readonly: bool) -> VolumeMount {
        let root = if container_path.starts_with('/') {
            TargetRoot::Rootfs
        } else {
            TargetRoot::Sandbox
        };
        VolumeMount {
            source: source.to_path_buf(),
            source_root: None,
            root,
            target: PathBuf::from(container_path.trim_start_matches('/')),
            container_path: container_path.to_string(),
            readonly,
            volume_id: Some(id.to_string()),
            provider_id: None,
            block: false,
            propagation: Default::default(),
            hardening: Default::default(),
        }
    }

    struct Dirs {
        _tmp: tempfile::TempDir,
        sandbox: PathBuf,
        vol: PathBuf,
        vol2: PathBuf,
    }

    fn dirs() -> Dirs {
        let tmp = tempfile::tempdir().unwrap();
        let base = std::fs::canonicalize(tmp.path()).unwrap();
        let sandbox = base.join("sandbox");
        let vol = base.join("vol");
        let vol2 = base.join("vol2");
        for d in [&sandbox, &vol, &vol2] {
            std::fs::create_dir(d).unwrap();
        }
        Dirs {
            _tmp: tmp,
            sandbox,
            vol,
            vol2,
        }
    }

    fn launch(mounts: Vec<VolumeMount>) -> LaunchInfo {
        LaunchInfo { mounts }
    }

    #[test]
    fn entries_for_absolute_and_relative_paths_ro_and_rw() {
        let d = dirs();
        let fake = FakeSyscall::new();
        let prepared = prepare(
            &fake,
            &d.sandbox,
            &launch(vec![
                vm("v1", &d.vol, "/data", false),
                vm("v2", &d.vol2, "cache/./x/", true),
            ]),
        )
        .unwrap();
        let data = d.sandbox.join("data");
        let cache = d.sandbox.join("cache/x");
        assert_eq!(prepared.host_binds, vec![data.clone(), cache.clone()]);
        assert!(data.is_dir() && cache.is_dir(), "targets created");
        let s = |p: &Path| p.to_str().unwrap().to_string();
        assert_eq!(
            prepared.mounts,
            vec![
                OciMount {
                    destination: "/data".into(),
                    kind: "bind".into(),
                    source: s(&data),
                    options: vec!["rbind".into(), "rprivate".into(), "rw".into()],
                },
                OciMount {
                    destination: "/mnt/mesos/sandbox/cache/x".into(),
                    kind: "bind".into(),
                    source: s(&cache),
                    options: vec!["rbind".into(), "rprivate".into(), "ro".into()],
                },
            ]
        );
        assert_eq!(
            prepared.docker_args,
            vec![
                "--mount".to_string(),
                format!("type=bind,source={},target=/data", data.display()),
                "--mount".to_string(),
                format!(
                    "type=bind,source={},target=/mnt/mesos/sandbox/cache/x,readonly",
                    cache.display()
                ),
            ]
        );
        // Runtime-spec field names on the wire.
        let json = serde_json::to_value(&prepared.mounts[0]).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "destination": "/data",
                "type": "bind",
                "source": s(&data),
                "options": ["rbind", "rprivate", "rw"],
            })
        );
        // The binds: recursive clones of the source fd, nosuid,nodev (and read-only when asked) set on
        // the clone, recursively, before it is attached.
        let kinds: Vec<CallKind> = fake.calls().iter().map(Call::kind).collect();
        assert_eq!(
            kinds,
            vec![
                CallKind::OpenTreeCloneFd,
                CallKind::ChangeMountFlags,
                CallKind::MoveMountToFd,
                CallKind::OpenTreeCloneFd,
                CallKind::ChangeMountFlags,
                CallKind::MoveMountToFd,
            ]
        );
        let changes: Vec<(MountFlags, MountFlags, bool)> = fake
            .calls()
            .into_iter()
            .filter_map(|c| match c {
                Call::OpenTreeCloneFd { recursive, .. } => {
                    assert!(recursive);
                    None
                }
                Call::ChangeMountFlags {
                    set,
                    clear,
                    recursive,
                    ..
                } => Some((set, clear, recursive)),
                _ => None,
            })
            .collect();
        assert_eq!(
            changes,
            vec![
                (MountFlags::HOST_ONLY, MountFlags::NONE, true),
                (
                    MountFlags::HOST_ONLY.union(MountFlags::READONLY),
                    MountFlags::NONE,
                    true
                ),
            ]
        );
        let m1 = fake.find(&data).unwrap().unwrap();
        assert_eq!(m1.root, d.vol);
        assert!(!m1.is_readonly());
        let m2 = fake.find(&cache).unwrap().unwrap();
        assert_eq!(m2.root, d.vol2);
        assert!(m2.is_readonly());
        for m in [&m1, &m2] {
            for flag in ["nosuid", "nodev"] {
                assert!(m.mount_options.iter().any(|o| o == flag), "{m:?}");
            }
        }

        // Cleanup takes both down, deepest first.
        assert_eq!(cleanup(&fake, &fake, &d.sandbox).unwrap(), 2);
        assert!(fake.mounts().unwrap().is_empty());
        assert_eq!(cleanup(&fake, &fake, &d.sandbox).unwrap(), 0);
    }

    #[test]
    fn docker_values_with_commas_and_quotes_are_csv_quoted() {
        assert_eq!(csv_field("source=/a/b"), "source=/a/b");
        assert_eq!(csv_field("source=/a,b"), "\"source=/a,b\"");
        assert_eq!(csv_field("target=/x\"y"), "\"target=/x\"\"y\"");
        assert_eq!(csv_field("target=/l1\nl2"), "\"target=/l1\nl2\"");

        let d = dirs();
        let fake = FakeSyscall::new();
        let prepared = prepare(
            &fake,
            &d.sandbox,
            &launch(vec![vm("v", &d.vol, "/we,ird \"dir\"", true)]),
        )
        .unwrap();
        let host = d.sandbox.join("we,ird \"dir\"");
        assert_eq!(prepared.host_binds, vec![host.clone()]);
        assert_eq!(
            prepared.docker_args[1],
            format!(
                "type=bind,\"source={}\",\"target=/we,ird \"\"dir\"\"\",readonly",
                host.display().to_string().replace('"', "\"\"")
            )
        );
        // The OCI entry carries the raw strings (JSON does its own escaping).
        assert_eq!(prepared.mounts[0].destination, "/we,ird \"dir\"");
        assert_eq!(prepared.mounts[0].source, host.to_str().unwrap());
        cleanup(&fake, &fake, &d.sandbox).unwrap();
    }

    #[test]
    fn duplicates_and_invalid_paths_are_refused_before_mounting() {
        let d = dirs();
        let cases: Vec<(Vec<VolumeMount>, &str)> = vec![
            (
                vec![
                    vm("a", &d.vol, "/data", false),
                    vm("b", &d.vol2, "/data/", true),
                ],
                "volume b: destination /data is already used by volume a",
            ),
            (
                vec![
                    vm("a", &d.vol, "x/y", false),
                    vm("b", &d.vol2, "x//y", false),
                ],
                "volume b: destination /mnt/mesos/sandbox/x/y is already used by volume a",
            ),
            (
                vec![
                    vm("a", &d.vol, "/data", false),
                    vm("b", &d.vol2, "data", false),
                ],
                "is already used by volume a",
            ),
            (
                vec![vm("a", &d.vol, "/x/../../etc", false)],
                "volume a: container path \"/x/../../etc\" is invalid: it holds a '..' component",
            ),
            (
                vec![vm("a", &d.vol, "/", false)],
                "volume a: container path \"/\" is invalid: it names no directory below the root",
            ),
            (
                vec![vm("a", &d.vol, "", false)],
                "is invalid: it names no directory below the root",
            ),
            (vec![vm("a", &d.vol, "/a\0b", false)], "NUL byte"),
        ];
        for (mounts, want) in cases {
            let fake = FakeSyscall::new();
            let err = prepare(&fake, &d.sandbox, &launch(mounts.clone())).unwrap_err();
            assert!(
                err.full_message().contains(want),
                "{mounts:?}: got {err}, want {want}"
            );
            assert!(fake.calls().is_empty(), "nothing mounted for {mounts:?}");
        }
        // Same host path from an absolute and a relative container path.
        let fake = FakeSyscall::new();
        let err = prepare(
            &fake,
            &d.sandbox,
            &launch(vec![
                vm("a", &d.vol, "/data", false),
                vm("b", &d.vol2, "data", false),
            ]),
        )
        .unwrap_err();
        assert!(
            matches!(err, OciError::DuplicateHostPath { ref volume, ref path, .. }
                if volume == "b" && *path == d.sandbox.join("data")),
            "{err}"
        );
    }

    #[test]
    fn failing_second_mount_rolls_back_the_first() {
        let d = dirs();
        let fake = FakeSyscall::new();
        // The first move_mount succeeds, the second fails.
        fake.fail_when(
            {
                let seen = std::sync::atomic::AtomicU32::new(0);
                move |c| {
                    matches!(c, Call::MoveMountToFd { .. })
                        && seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 1
                }
            },
            Errno::EPERM,
            1,
        );
        let err = prepare(
            &fake,
            &d.sandbox,
            &launch(vec![
                vm("first", &d.vol, "/one", false),
                vm("second", &d.vol2, "/two", true),
            ]),
        )
        .unwrap_err();
        let two = d.sandbox.join("two");
        assert!(
            matches!(err, OciError::AttachBind { ref volume, ref path, .. }
                if volume == "second" && *path == two),
            "{err:?}"
        );
        let msg = err.full_message();
        assert!(
            msg.starts_with(&format!(
                "volume second: attach bind at {}: ",
                two.display()
            )),
            "{msg}"
        );
        assert!(msg.contains("EPERM"), "{msg}");
        assert!(fake.mounts().unwrap().is_empty(), "first bind rolled back");
        assert_eq!(
            fake.calls().last(),
            Some(&Call::Unmount {
                target: d.sandbox.join("one"),
                detach: false
            })
        );
    }

    #[test]
    fn failing_open_tree_and_readonly_name_the_volume_and_leave_nothing() {
        let d = dirs();
        let fake = FakeSyscall::new();
        fake.fail_at(CallKind::OpenTreeCloneFd, &d.vol2, Errno::EACCES, 1);
        let err = prepare(
            &fake,
            &d.sandbox,
            &launch(vec![
                vm("a", &d.vol, "/a", false),
                vm("b", &d.vol2, "/b", false),
            ]),
        )
        .unwrap_err();
        assert_eq!(
            err.full_message(),
            format!(
                "volume b: bind source {}: open_tree clone of {}: EACCES: Permission denied",
                d.vol2.display(),
                d.vol2.display()
            )
        );
        assert!(fake.mounts().unwrap().is_empty());

        let fake = FakeSyscall::new();
        fake.fail(CallKind::ChangeMountFlags, Errno::EINVAL, 1);
        let err = prepare(
            &fake,
            &d.sandbox,
            &launch(vec![vm("ro", &d.vol, "/r", true)]),
        )
        .unwrap_err();
        assert!(matches!(err, OciError::SetReadonly { ref volume, .. } if volume == "ro"));
        assert!(fake.mounts().unwrap().is_empty());

        // A missing source is caught before any mount call.
        let fake = FakeSyscall::new();
        let missing = d.sandbox.join("nope");
        let err = prepare(
            &fake,
            &d.sandbox,
            &launch(vec![vm("m", &missing, "/m", false)]),
        )
        .unwrap_err();
        assert!(
            matches!(err, OciError::StatSource { ref path, ref source, .. }
                if *path == missing && source.to_string().contains("ENOENT")),
            "{err}"
        );
        assert!(fake.calls().is_empty());
    }

    #[test]
    fn without_open_tree_binds_by_fd_and_remounts_readonly() {
        let d = dirs();
        let fake = FakeSyscall::new();
        fake.fail(CallKind::OpenTreeCloneFd, Errno::ENOSYS, 2);
        let prepared = prepare(
            &fake,
            &d.sandbox,
            &launch(vec![
                vm("a", &d.vol, "/a", false),
                vm("b", &d.vol2, "/b", true),
            ]),
        )
        .unwrap();
        let b = d.sandbox.join("b");
        let kinds: Vec<CallKind> = fake.calls().iter().map(Call::kind).collect();
        assert_eq!(
            kinds,
            vec![
                CallKind::OpenTreeCloneFd,
                CallKind::BindMountToFd,
                CallKind::RemountBindWith,
                CallKind::OpenTreeCloneFd,
                CallKind::BindMountToFd,
                CallKind::RemountBindWith,
            ]
        );
        // The fallback binds the resolved source fd, never the source's path string.
        for c in fake.calls() {
            if let Call::BindMountToFd { source, .. } = c {
                assert!(source.starts_with("/proc/self/fd"), "{source:?}");
            }
        }
        let bm = fake.find(&b).unwrap().unwrap();
        assert!(bm.is_readonly());
        let am = fake.find(&d.sandbox.join("a")).unwrap().unwrap();
        assert!(!am.is_readonly());
        for m in [&am, &bm] {
            for flag in ["nosuid", "nodev"] {
                assert!(m.mount_options.iter().any(|o| o == flag), "{m:?}");
            }
        }
        assert_eq!(prepared.mounts[1].options[2], "ro");
    }

    #[test]
    fn a_symlink_inside_a_volume_is_refused_by_name_before_anything_is_mounted() {
        let d = dirs();
        // A PATH disk: the volume's mount point is trusted, `volumes/roles/r1/pv1` in it is not.
        let decoy = d.vol2.clone();
        let roles = d.vol.join("volumes/roles/r1");
        std::fs::create_dir_all(&roles).unwrap();
        std::os::unix::fs::symlink(&decoy, roles.join("pv1")).unwrap();
        let mut m = vm("pv1", &roles.join("pv1"), "/data", false);
        m.source_root = Some(d.vol.clone());
        let fake = FakeSyscall::new();
        let err = prepare(&fake, &d.sandbox, &launch(vec![m])).unwrap_err();
        let text = err.full_message();
        assert!(text.contains("volumes/roles/r1/pv1 is a symlink"), "{text}");
        assert!(fake.calls().is_empty(), "{:?}", fake.calls());
        assert!(!d.sandbox.join("data").exists(), "no target created");
    }

    #[test]
    fn symlink_in_sandbox_keeps_the_bind_inside() {
        let d = dirs();
        std::os::unix::fs::symlink("/etc", d.sandbox.join("data")).unwrap();
        std::os::unix::fs::symlink("../../..", d.sandbox.join("up")).unwrap();
        let fake = FakeSyscall::new();
        let prepared = prepare(
            &fake,
            &d.sandbox,
            &launch(vec![
                vm("a", &d.vol, "/data", false),
                vm("b", &d.vol2, "up/escape", false),
            ]),
        )
        .unwrap();
        assert_eq!(
            prepared.host_binds,
            vec![d.sandbox.join("etc"), d.sandbox.join("escape")]
        );
        assert_eq!(
            prepared.mounts[0].source,
            d.sandbox.join("etc").to_str().unwrap()
        );
        assert_eq!(prepared.mounts[0].destination, "/data");
        for m in fake.mounts().unwrap() {
            assert!(m.mount_point.starts_with(&d.sandbox), "{m:?}");
        }
    }

    #[test]
    fn file_sources_get_file_targets() {
        let d = dirs();
        let file = d.vol.join("config");
        std::fs::write(&file, b"x").unwrap();
        let fake = FakeSyscall::new();
        let prepared = prepare(
            &fake,
            &d.sandbox,
            &launch(vec![vm("f", &file, "etc/app.conf", true)]),
        )
        .unwrap();
        assert!(prepared.host_binds[0].is_file());
        assert_eq!(
            prepared.mounts[0].destination,
            "/mnt/mesos/sandbox/etc/app.conf"
        );
    }

    #[test]
    fn apply_to_config_gives_a_block_volume_its_device_and_one_rule() {
        let prepared = OciPrepared {
            devices: vec![OciDevice {
                path: "/dev/vol".into(),
                major: 7,
                minor: 3,
                access: "rw".into(),
            }],
            ..OciPrepared::default()
        };
        let mut config = serde_json::json!({
            "linux": {
                "devices": [{"path": "/dev/vol/", "type": "c", "major": 1, "minor": 3},
                            {"path": "/dev/other", "type": "c", "major": 1, "minor": 5}],
                "resources": {"devices": [{"allow": false, "access": "rwm"}]},
            },
        });
        prepared.apply_to_config(&mut config);
        let devices = config["linux"]["devices"].as_array().unwrap();
        assert_eq!(devices.len(), 2, "{devices:?}");
        assert_eq!(devices[0]["path"], "/dev/other");
        assert_eq!(
            devices[1],
            serde_json::json!({"path": "/dev/vol", "type": "b", "major": 7, "minor": 3,
                               "fileMode": 0o660, "uid": 0, "gid": 0})
        );
        let rules = config["linux"]["resources"]["devices"].as_array().unwrap();
        assert_eq!(
            rules,
            &[
                serde_json::json!({"allow": false, "access": "rwm"}),
                serde_json::json!({"allow": true, "type": "b", "major": 7, "minor": 3, "access": "rw"}),
            ]
        );
        // A config without a linux object gets one.
        let mut bare = serde_json::json!({"linux": "junk"});
        prepared.apply_to_config(&mut bare);
        assert_eq!(bare["linux"]["devices"].as_array().unwrap().len(), 1);
        assert_eq!(
            bare["linux"]["resources"]["devices"]
                .as_array()
                .unwrap()
                .len(),
            1
        );
    }

    #[test]
    fn apply_to_config_replaces_same_destination_and_appends() {
        let prepared = OciPrepared {
            host_binds: vec![PathBuf::from("/s/data"), PathBuf::from("/s/b")],
            mounts: vec![
                OciMount {
                    destination: "/data".into(),
                    kind: "bind".into(),
                    source: "/s/data".into(),
                    options: vec!["rbind".into(), "rprivate".into(), "rw".into()],
                },
                OciMount {
                    destination: "/b".into(),
                    kind: "bind".into(),
                    source: "/s/b".into(),
                    options: vec!["rbind".into(), "rprivate".into(), "ro".into()],
                },
            ],
            docker_args: Vec::new(),
            devices: Vec::new(),
        };
        let mut config = serde_json::json!({
            "ociVersion": "1.0.2",
            "mounts": [
                {"destination": "/proc", "type": "proc", "source": "proc"},
                {"destination": "/data/", "type": "tmpfs", "source": "tmpfs"},
                {"type": "weird"},
            ],
        });
        prepared.apply_to_config(&mut config);
        let destinations: Vec<&str> = config["mounts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["destination"].as_str().unwrap_or("?"))
            .collect();
        assert_eq!(destinations, vec!["/proc", "?", "/data", "/b"]);
        assert_eq!(config["mounts"][2]["source"], "/s/data");
        assert_eq!(config["mounts"][3]["options"][2], "ro");
        assert_eq!(config["ociVersion"], "1.0.2");
        // Applying twice does not duplicate.
        prepared.apply_to_config(&mut config);
        assert_eq!(config["mounts"].as_array().unwrap().len(), 4);

        let mut empty = serde_json::json!({"process": {}});
        prepared.apply_to_config(&mut empty);
        assert_eq!(empty["mounts"].as_array().unwrap().len(), 2);
        assert!(empty["process"].is_object());
    }

    #[test]
    fn rootfs_propagation_for_table() {
        use VolumePropagation::{Private, Rshared, Rslave};
        let cases: &[(Option<&str>, VolumePropagation, Option<&str>)] = &[
            (None, Private, None),
            (Some("rprivate"), Private, None),
            // runc's default (absent) is rslave: enough for rslave, not for rshared.
            (None, Rslave, None),
            (None, Rshared, Some("rshared")),
            (Some("rslave"), Rslave, None),
            (Some("slave"), Rslave, None),
            (Some("shared"), Rslave, None),
            (Some("rshared"), Rslave, None),
            (Some("private"), Rslave, Some("rslave")),
            (Some("rprivate"), Rslave, Some("rslave")),
            (Some("runbindable"), Rslave, Some("rslave")),
            (Some("shared"), Rshared, None),
            (Some("rshared"), Rshared, None),
            (Some("rslave"), Rshared, Some("rshared")),
            (Some("rprivate"), Rshared, Some("rshared")),
            (Some(""), Rshared, Some("rshared")),
        ];
        for (current, need, want) in cases {
            assert_eq!(
                rootfs_propagation_for(*current, *need),
                *want,
                "{current:?} for {need}"
            );
        }
    }

    #[test]
    fn apply_to_config_sets_the_rootfs_propagation_the_binds_need() {
        let entry = |destination: &str, propagation: VolumePropagation| OciMount {
            destination: destination.into(),
            kind: "bind".into(),
            source: format!("/s{destination}"),
            options: vec![
                "rbind".into(),
                propagation_option(propagation).into(),
                "rw".into(),
            ],
        };
        let with = |mounts: Vec<OciMount>| OciPrepared {
            mounts,
            ..OciPrepared::default()
        };
        let private = with(vec![entry("/a", VolumePropagation::Private)]);
        let slave = with(vec![
            entry("/a", VolumePropagation::Private),
            entry("/b", VolumePropagation::Rslave),
        ]);
        let shared = with(vec![
            entry("/b", VolumePropagation::Rslave),
            entry("/c", VolumePropagation::Rshared),
        ]);
        assert_eq!(private.rootfs_propagation(), VolumePropagation::Private);
        assert_eq!(slave.rootfs_propagation(), VolumePropagation::Rslave);
        assert_eq!(shared.rootfs_propagation(), VolumePropagation::Rshared);

        // Nothing added where nothing is needed, or the runtime's default serves.
        for p in [&private, &slave] {
            let mut config = serde_json::json!({"process": {}});
            p.apply_to_config(&mut config);
            assert!(config.get("linux").is_none(), "{config}");
        }
        let mut config = serde_json::json!({"linux": {"namespaces": []}});
        shared.apply_to_config(&mut config);
        assert_eq!(config["linux"]["rootfsPropagation"], "rshared");
        assert!(config["linux"]["namespaces"].is_array());
        // A private root is raised for rslave; a shared one is kept.
        let mut config = serde_json::json!({"linux": {"rootfsPropagation": "rprivate"}});
        slave.apply_to_config(&mut config);
        assert_eq!(config["linux"]["rootfsPropagation"], "rslave");
        let mut config = serde_json::json!({"linux": {"rootfsPropagation": "shared"}});
        shared.apply_to_config(&mut config);
        assert_eq!(config["linux"]["rootfsPropagation"], "shared");
    }

    #[test]
    fn cleanup_unmounts_only_under_the_sandbox_with_busy_retries() {
        let fake = FakeSyscall::new();
        fake.add_mount("v", Path::new("/nonexistent/sb/data"), "ext4");
        fake.add_mount("w", Path::new("/nonexistent/sb/data/sub"), "tmpfs");
        fake.add_mount("o", Path::new("/nonexistent/sb2"), "tmpfs");
        fake.busy(Path::new("/nonexistent/sb/data/sub"), 100);
        let n = cleanup(&fake, &fake, Path::new("/nonexistent/sb")).unwrap();
        assert_eq!(n, 2);
        let left: Vec<PathBuf> = fake
            .mounts()
            .unwrap()
            .into_iter()
            .map(|m| m.mount_point)
            .collect();
        assert_eq!(left, vec![PathBuf::from("/nonexistent/sb2")]);
        // The busy one was retried, then detached lazily.
        assert!(fake.calls().contains(&Call::Unmount {
            target: PathBuf::from("/nonexistent/sb/data/sub"),
            detach: true
        }));

        // A failure is tried again with a fresh table; one that lasts is reported, never
        // counted as done.
        let fake = FakeSyscall::new();
        fake.add_mount("v", Path::new("/nonexistent/sb/x"), "ext4");
        fake.fail(CallKind::Unmount, Errno::EPERM, 1);
        assert_eq!(
            cleanup(&fake, &fake, Path::new("/nonexistent/sb")).unwrap(),
            1
        );
        let fake = FakeSyscall::new();
        fake.add_mount("v", Path::new("/nonexistent/sb/x"), "ext4");
        fake.fail(CallKind::Unmount, Errno::EPERM, 100);
        let err = cleanup(&fake, &fake, Path::new("/nonexistent/sb")).unwrap_err();
        assert_eq!(
            err.full_message(),
            "unmount mounts under sandbox /nonexistent/sb: unmount /nonexistent/sb/x: EPERM: Operation not permitted"
        );
    }
}
