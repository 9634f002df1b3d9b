//! The on-disk layout of a storage local resource provider under the agent
//! work dir, kept from Mesos byte for byte. This is the one place the names
//! are spelled; the provider, `status`, the hook and the resolver
//! ([`super::resolve_host_path`], for `<root>/<enc id>/target`) all use it.
//!
//! ```text
//! <work_dir>/csi/<type>/<name>/volumes/<enc id>/volume.state   checkpoint
//! <work_dir>/csi/<type>/<name>/mounts/<enc id>/staging         NodeStageVolume target (we create it)
//! <work_dir>/csi/<type>/<name>/mounts/<enc id>/target          NodePublishVolume target (the plugin creates it)
//! <work_dir>/csi/<type>/<name>/creating/<enc name>.intent      CreateVolume intent, until the volume is recorded
//! <work_dir>/csi/<type>/<name>/snapshots/<enc name>/snapshot.state   a snapshot's record, its intent included
//! <work_dir>/csi/<type>/<name>/plugin/csi.sock                 endpoint of a managed plugin
//!                                     (or /run/csi-isolator/sockets/<hash>/csi.sock if that is too long)
//! <work_dir>/csi/<type>/<name>/plugin/data                     work dir of a managed plugin
//! ```
//! `<enc id>` is [`encode_volume_id`] of the volume id; `<type>` and
//! `<name>` are used verbatim, so they must pass
//! [`super::validate_path_component`] first (the provider checks them
//! before it builds its layout).
//!
//! Everything here is lexical: no file system access.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::encode::encode_volume_id;

/// The work-dir subdirectory holding everything of the CSI plugins.
pub const CSI_DIR: &str = "csi";

/// File name of a volume's checkpoint.
pub const STATE_FILE: &str = "volume.state";

/// File name of a snapshot's record.
pub const SNAPSHOT_FILE: &str = "snapshot.state";

/// Where plugin sockets go when the work dir is too deep for a socket path.
pub const SHORT_SOCKET_DIR: &str = "/run/csi-isolator/sockets";

/// The longest socket path used as is (`sun_path` holds 108 bytes with the
/// terminating NUL; keep a margin).
pub const MAX_SOCKET_PATH: usize = 100;

/// A volume's NodePublishVolume target under its mount root.
const TARGET: &str = "target";
/// A volume's NodeStageVolume target under its mount root.
const STAGING: &str = "staging";

/// `<mounts_root>/<enc id>/target`: where a CSI volume is mounted, under
/// any mount root (the provider's own, or one a resource names).
pub(super) fn target_under(mounts_root: &Path, volume_id: &str) -> PathBuf {
    Layout::target_named(mounts_root, &encode_volume_id(volume_id))
}

/// Paths of one provider (one plugin `type`/`name`).
#[derive(Clone, Debug)]
pub struct Layout {
    base: PathBuf,
    mounts_rel: PathBuf,
}

impl Layout {
    /// The layout of plugin `plugin_type`/`plugin_name` under `work_dir`.
    /// Both names must already be validated path components (see the module doc).
    pub fn new(work_dir: &Path, plugin_type: &str, plugin_name: &str) -> Self {
        let rel = Path::new(CSI_DIR).join(plugin_type).join(plugin_name);
        Layout {
            base: work_dir.join(&rel),
            mounts_rel: Path::new(".").join(rel).join("mounts"),
        }
    }

    /// `csi/<type>/<name>`.
    pub fn base(&self) -> &Path {
        &self.base
    }

    /// `csi/<type>/<name>/volumes`.
    pub fn volumes_dir(&self) -> PathBuf {
        self.base.join("volumes")
    }

    /// `csi/<type>/<name>/mounts`.
    pub fn mounts_dir(&self) -> PathBuf {
        self.base.join("mounts")
    }

    /// The relative mount root written into created resources
    /// (`./csi/<type>/<name>/mounts`), which [`super::resolve_host_path`]
    /// joins to the resolving agent's work dir.
    pub fn relative_mount_root(&self) -> String {
        self.mounts_rel.to_string_lossy().into_owned()
    }

    /// `volumes/<enc id>`.
    pub fn volume_dir(&self, volume_id: &str) -> PathBuf {
        self.volumes_dir().join(encode_volume_id(volume_id))
    }

    /// `volumes/<enc id>/volume.state`.
    pub fn state_file(&self, volume_id: &str) -> PathBuf {
        self.volume_dir(volume_id).join(STATE_FILE)
    }

    /// `mounts/<enc id>`.
    pub fn mount_dir(&self, volume_id: &str) -> PathBuf {
        self.mounts_dir().join(encode_volume_id(volume_id))
    }

    /// `mounts/<enc id>/staging`.
    pub fn staging_path(&self, volume_id: &str) -> PathBuf {
        self.mount_dir(volume_id).join(STAGING)
    }

    /// `mounts/<enc id>/target`: the volume's mount point.
    pub fn target_path(&self, volume_id: &str) -> PathBuf {
        target_under(&self.mounts_dir(), volume_id)
    }

    /// The last components of [`Self::target_path`] and [`Self::staging_path`], in that order:
    /// the mount points of a volume's directory under [`Self::mounts_dir`].
    pub const MOUNT_POINTS: [&'static str; 2] = [TARGET, STAGING];

    /// [`Self::target_path`] of the volume whose directory name is `enc` (its id already
    /// encoded: a name `volumes/` lists), under `mounts`, the [`Self::mounts_dir`] a caller
    /// asking about thousands computed once.
    pub fn target_named(mounts: &Path, enc: &str) -> PathBuf {
        // Sized once: the two separators and the components.
        let len = mounts.as_os_str().len() + enc.len() + TARGET.len() + 2;
        let mut path = PathBuf::with_capacity(len);
        path.push(mounts);
        path.push(enc);
        path.push(TARGET);
        path
    }

    /// `creating/`.
    pub fn creating_dir(&self) -> PathBuf {
        self.base.join("creating")
    }

    /// `creating/<enc name>.intent`.
    pub fn create_intent(&self, name: &str) -> PathBuf {
        self.creating_dir()
            .join(format!("{}.intent", encode_volume_id(name)))
    }

    /// `snapshots/`.
    pub fn snapshots_dir(&self) -> PathBuf {
        self.base.join("snapshots")
    }

    /// `snapshots/<enc name>/snapshot.state`: keyed by the snapshot's name, which exists before
    /// its id (the record is the CreateSnapshot intent until the plugin answers).
    pub fn snapshot_state(&self, name: &str) -> PathBuf {
        self.snapshots_dir()
            .join(encode_volume_id(name))
            .join(SNAPSHOT_FILE)
    }

    /// `plugin/`: what a managed plugin gets.
    pub fn plugin_dir(&self) -> PathBuf {
        self.base.join("plugin")
    }

    /// `plugin/csi.sock`, or, when that path does not fit in a Unix
    /// socket address (108 bytes with the NUL), a short one under
    /// `short_dir` (by default [`SHORT_SOCKET_DIR`]) named after a hash of
    /// the long one (Mesos hit the same limit and keeps its sockets under a
    /// short temp dir too).
    pub fn plugin_socket(&self, short_dir: &Path) -> PathBuf {
        let long = self.plugin_dir().join("csi.sock");
        if long.as_os_str().len() <= MAX_SOCKET_PATH {
            return long;
        }
        let digest = Sha256::digest(long.as_os_str().as_encoded_bytes());
        let tag: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
        short_dir.join(tag).join("csi.sock")
    }

    /// `plugin/data`.
    pub fn plugin_data_dir(&self) -> PathBuf {
        self.plugin_dir().join("data")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Mesos' names, byte for byte.
    #[test]
    fn the_layout_is_mesos_own() {
        let l = Layout::new(Path::new("/w"), "org.test", "default");
        let base = "/w/csi/org.test/default";
        assert_eq!(l.base(), Path::new(base));
        assert_eq!(l.relative_mount_root(), "./csi/org.test/default/mounts");
        let cases = [
            (l.volumes_dir(), "volumes"),
            (l.mounts_dir(), "mounts"),
            (l.volume_dir("a/b"), "volumes/a%2Fb"),
            (l.state_file("a/b"), "volumes/a%2Fb/volume.state"),
            (l.mount_dir(".."), "mounts/%2E%2E"),
            (l.staging_path(".."), "mounts/%2E%2E/staging"),
            (l.target_path("a/b"), "mounts/a%2Fb/target"),
            (l.creating_dir(), "creating"),
            (l.create_intent("my vol"), "creating/my%20vol.intent"),
            (l.plugin_dir(), "plugin"),
            (l.plugin_socket(Path::new("/short")), "plugin/csi.sock"),
            (l.plugin_data_dir(), "plugin/data"),
        ];
        for (got, rel) in cases {
            assert_eq!(got, Path::new(base).join(rel));
        }
        // The same paths from an encoded directory name, as `status` builds them.
        for id in ["a/b", "..", "v1"] {
            let (mounts, enc) = (l.mounts_dir(), encode_volume_id(id));
            assert_eq!(
                Layout::target_named(&mounts, &enc),
                l.target_path(id),
                "{id}"
            );
            let [target, staging] = Layout::MOUNT_POINTS.map(|leaf| mounts.join(&enc).join(leaf));
            assert_eq!(
                [target, staging],
                [l.target_path(id), l.staging_path(id)],
                "{id}"
            );
        }
    }

    #[test]
    fn a_socket_path_too_long_moves_under_the_short_dir() {
        let deep = format!("/{}", "d".repeat(90));
        let l = Layout::new(Path::new(&deep), "t", "n");
        let socket = l.plugin_socket(Path::new("/short"));
        assert!(socket.starts_with("/short"), "{}", socket.display());
        assert_eq!(socket.components().count(), 4, "{}", socket.display());
        assert!(socket.as_os_str().len() <= MAX_SOCKET_PATH);
        // The same long path always gets the same short one.
        assert_eq!(socket, l.plugin_socket(Path::new("/short")));
    }
}
