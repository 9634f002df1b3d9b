//! The bundled plugin as a small multi-node driver (`--mode controller|node`).
//!
//! Layout: one controller-mode plugin keeps every volume (a dir backing's `data/`, a loop
//! backing's image, and the volume's record) under its `--work-dir`, in `volumes/<enc id>/`, a
//! directory every node reaches (on one machine simply the same path; across machines a shared
//! filesystem mounted at the same path on each). Each node runs a node-mode plugin with its own
//! `--node-id`, its own `--work-dir` (its node-local records: where it staged and published
//! what) and `--shared-dir` set to the controller's work dir:
//!
//! ```text
//! csi-test-plugin --mode controller --work-dir /shared/csi  --endpoint unix:///run/csi/ctl.sock
//! csi-test-plugin --mode node --node-id X --work-dir /var/lib/csi-x --shared-dir /shared/csi ...
//! csi-test-plugin --mode node --node-id Y --work-dir /var/lib/csi-y --shared-dir /shared/csi ...
//! ```
//!
//! Who writes what: the controller alone writes under the shared dir (volume records included);
//! a node plugin only reads there (the record of the volume it is handed, to check that the
//! directory is that volume's and that the controller published it to this node) and writes
//! only under its own work dir. The work dir and the shared dir may not contain each other.
//!
//! Where a volume is: ControllerPublishVolume's publish_context carries the volume's directory
//! as [`VOLUME_DIR_KEY`] (a controller-mode CreateVolume puts it in the volume_context too, for
//! a controller without PUBLISH_UNPUBLISH_VOLUME). A node plugin takes it as hostile: it mounts
//! nothing unless the path is exactly `<shared dir>/volumes/<one name>`, spelled canonically,
//! reached without a symlink, and holding the record of the volume the request names
//! ([`resolve_location`]).
//!
//! What is inside the shared dir is not followed blindly either, though only root may write it
//! (checked at start, by the work dir's rule): the controller's record is read without following
//! a link or blocking on a FIFO, bounded in size ([`store::read_record`]); the data directory and
//! image must be a real directory and a regular file of one name, and are bound or attached
//! through fds opened without following a link (`backing::open_data_dir`, `open_image`). A node
//! keeps its record of a volume only once a request for it passed its checks (`Plugin::take_up`).
//!
//! Access modes: the controller records each node a volume is published to, and refuses
//! (FAILED_PRECONDITION naming the volume and the node that holds it) a second node for a
//! single-node mode, and a second writer for MULTI_NODE_SINGLE_WRITER ([`node_conflict`]);
//! ControllerUnpublishVolume for node X removes X alone.
//!
//! Two node plugins on one machine share one kernel: a loop volume both publish
//! (MULTI_NODE_MULTI_WRITER) is mounted through one loop device, one ext4 instance. Across
//! machines ext4 is not a cluster filesystem: a real deployment of the loop backing would offer
//! single-node modes only.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::path::{Component, Path, PathBuf};

use csi_isolator::csi::proto::volume_capability::access_mode::Mode as AccessMode;

use super::store::{self, ControllerPublication, VolumeRecord};
use super::{Plugin, PluginConfig, PluginError, PluginMode};

/// The publish_context (and controller-mode volume_context) key naming the volume's directory
/// under the shared dir.
pub const VOLUME_DIR_KEY: &str = "csi-test-plugin/volume-dir";

/// The longest node id ControllerPublish accepts (the CSI spec: NodeGetInfo's node_id "SHALL
/// NOT exceed 256 bytes").
pub const MAX_NODE_ID: usize = 256;

/// The longest location accepted (Linux `PATH_MAX`).
const MAX_LOCATION: usize = 4096;

/// Checks and completes a configuration's multi-node part: node mode needs `--shared-dir` (an
/// existing directory that, with every directory above it, is root's and writable by no other
/// user, as the work dir's rule says: [`csi_isolator::workdir::safe_dir`]; made canonical) apart
/// from its work dir; the other modes take none.
pub(crate) fn check_config(config: &mut PluginConfig) -> Result<(), PluginError> {
    let bad = |reason: String| Err(PluginError::Config(reason));
    match config.mode {
        PluginMode::Node => {}
        PluginMode::Controller if !config.controller => {
            return bad("--mode controller with --no-controller serves nothing: drop one".into())
        }
        _ if config.shared_dir.is_some() => return bad(
            "--shared-dir is for --mode node (a controller's volumes are under its own --work-dir)"
                .into(),
        ),
        _ => return Ok(()),
    }
    config.controller = false;
    let Some(shared) = &config.shared_dir else {
        return bad(
            "--mode node needs --shared-dir: the controller's --work-dir, as this node reaches it"
                .into(),
        );
    };
    // Root mounts what the shared dir names: it must be root's alone, by the work dir's rule.
    let shared = match csi_isolator::workdir::safe_dir(shared, store::SHARED_DIR) {
        Ok(shared) => shared,
        Err(csi_isolator::workdir::WorkDirError::Resolve { source, .. }) => {
            return bad(format!(
                "--shared-dir {}: {source} (give the controller's --work-dir; start the controller first)",
                shared.display()
            ))
        }
        Err(e) => return bad(csi_isolator::error_chain::full_message(&e)),
    };
    super::backing::private_dir(&config.work_dir).map_err(|e| {
        PluginError::Config(format!(
            "--work-dir {}: create: {e}",
            config.work_dir.display()
        ))
    })?;
    let work = std::fs::canonicalize(&config.work_dir).map_err(|e| {
        PluginError::Config(format!("--work-dir {}: {e}", config.work_dir.display()))
    })?;
    if work.starts_with(&shared) || shared.starts_with(&work) {
        return bad(format!(
            "--work-dir {} and --shared-dir {} overlap: a node plugin's own state must lie outside the controller's directory (and not contain it)",
            work.display(),
            shared.display()
        ));
    }
    config.shared_dir = Some(shared);
    Ok(())
}

/// Checks `text`, a location a publish_context or volume_context claims, lexically: exactly
/// `<volumes>/<name>` (absolute, canonically spelled: no `.`, `..`, doubled or trailing `/`),
/// `name` not a hidden or tombstone entry. Returns the path.
pub fn location_in(volumes: &Path, text: &str) -> Result<PathBuf, String> {
    let shown = || csi_isolator::shown::shown(text);
    if text.is_empty() {
        return Err("is empty".into());
    }
    if text.len() > MAX_LOCATION || text.contains('\0') {
        return Err(format!("'{}' is not a path", shown()));
    }
    let path = PathBuf::from(text);
    let canonical_spelling = path.is_absolute()
        && path
            .components()
            .all(|c| matches!(c, Component::RootDir | Component::Normal(_)))
        && path.components().collect::<PathBuf>().as_os_str() == path.as_os_str();
    if !canonical_spelling {
        return Err(format!(
            "'{}' is not an absolute, canonically spelled path",
            shown()
        ));
    }
    let name = path.file_name().map(|n| n.to_string_lossy());
    if path.parent() != Some(volumes) || name.is_none_or(|n| n.starts_with(['.', '+'])) {
        return Err(format!(
            "'{}' is not a volume directory under {} (the --shared-dir of this node plugin)",
            shown(),
            volumes.display()
        ));
    }
    Ok(path)
}

/// Resolves a claimed location of volume `volume_id` under the shared dir `shared`: lexically
/// checked ([`location_in`]), then a real directory reached without a symlink, holding the
/// record of that very volume (read, never written, as hostile: [`store::read_record`]), whose
/// data directory or image, where present, is a real directory or a regular file of one name
/// (`backing::check_storage`; the backing opens them again without following a link
/// when it mounts). `Ok(None)`: no such directory (the volume is gone).
pub fn resolve_location(
    shared: &Path,
    text: &str,
    volume_id: &str,
) -> Result<Option<(PathBuf, VolumeRecord)>, String> {
    let path = location_in(&shared.join("volumes"), text)?;
    match std::fs::canonicalize(&path) {
        Ok(real) if real == path => {}
        Ok(real) => {
            return Err(format!(
                "{} leads elsewhere ({}): refused",
                path.display(),
                real.display()
            ))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("{}: {e}", path.display())),
    }
    if !std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir()) {
        return Err(format!("{} is not a directory", path.display()));
    }
    let record = match store::read_record(&path) {
        Ok(record) => record,
        Err(store::StoreError::Read { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
            return Ok(None)
        }
        Err(e) => return Err(csi_isolator::error_chain::full_message(&e)),
    };
    if record.id != volume_id {
        return Err(format!(
            "{} holds volume {}, not {}",
            path.display(),
            csi_isolator::shown::shown(&record.id),
            csi_isolator::shown::shown(volume_id)
        ));
    }
    super::backing::check_storage(&path)
        .map_err(|e| csi_isolator::error_chain::full_message(&e))?;
    Ok(Some((path, record)))
}

/// Whether an access mode lets a volume be published to one node only.
pub fn single_node(mode: i32) -> bool {
    matches!(
        AccessMode::try_from(mode),
        Ok(AccessMode::SingleNodeWriter
            | AccessMode::SingleNodeReaderOnly
            | AccessMode::SingleNodeSingleWriter
            | AccessMode::SingleNodeMultiWriter)
    )
}

/// Why a ControllerPublish of a volume to `node` with access `mode` (and `readonly`) cannot
/// be granted beside the volume's other publications: the node holding it and the reason;
/// `None` when it can. A publication of unknown capability (a version 1 record) counts as
/// single-node.
pub fn node_conflict(
    published: &BTreeMap<String, ControllerPublication>,
    node: &str,
    mode: i32,
    readonly: bool,
) -> Option<(String, String)> {
    let name = |m: i32| {
        AccessMode::try_from(m).map_or_else(|_| format!("mode {m}"), |m| m.as_str_name().into())
    };
    let single_writer = AccessMode::MultiNodeSingleWriter as i32;
    published
        .iter()
        .filter(|(holder, _)| holder.as_str() != node)
        .find_map(|(holder, publication)| {
            let theirs = publication.capability.as_ref().map(|c| c.access_mode);
            let why = if single_node(mode) {
                format!("{} allows one node", name(mode))
            } else if let Some(theirs) = theirs
                .filter(|m| single_node(*m))
                .or(theirs.is_none().then_some(0))
            {
                match theirs {
                    0 => "it was published with an access mode this plugin no longer knows".into(),
                    m => format!("it was published with {}, which allows one node", name(m)),
                }
            } else if mode == single_writer && !readonly && !publication.readonly {
                format!("{} allows one writer and it writes there", name(mode))
            } else {
                return None;
            };
            Some((holder.clone(), why))
        })
}

/// The publish_context ControllerPublish returns for (volume, node), naming the volume's
/// `location` for the node plugins of a controller-mode plugin (a both-mode plugin's context
/// is what it always was, so the contexts CO checkpoints hold stay valid); NodeStage and
/// NodePublish require exactly it.
pub(crate) fn publish_context(
    volume_id: &str,
    node_id: &str,
    location: Option<&Path>,
) -> HashMap<String, String> {
    let mut context = HashMap::from([(
        "csi-test-plugin/attachment".to_string(),
        format!("{volume_id}@{node_id}"),
    )]);
    if let Some(location) = location {
        context.insert(
            VOLUME_DIR_KEY.to_string(),
            location.to_string_lossy().into_owned(),
        );
    }
    context
}

impl Plugin {
    /// Where a volume's storage is: a node-mode record's location, else this store's directory.
    pub(crate) fn storage_dir(&self, record: &VolumeRecord) -> PathBuf {
        record
            .location
            .clone()
            .unwrap_or_else(|| self.store.volume_dir(&record.id))
    }

    /// A volume's directory as the contexts name it: canonical, so that a node plugin, which
    /// accepts only canonical paths, finds it; computable before the directory exists.
    pub(crate) fn location(&self, record: &VolumeRecord) -> PathBuf {
        let dir = self.storage_dir(record);
        if record.location.is_some() {
            return dir;
        }
        match (dir.parent().map(std::fs::canonicalize), dir.file_name()) {
            (Some(Ok(parent)), Some(name)) => parent.join(name),
            _ => dir,
        }
    }

    /// The location the publish_context of this plugin's mode carries (none in both mode).
    pub(crate) fn context_location(&self, record: &VolumeRecord) -> Option<PathBuf> {
        (self.config.mode != PluginMode::Both).then(|| self.location(record))
    }

    /// The controller's publications of a volume: a node-mode plugin reads them now from the
    /// controller's record (read only); the others have them in their own.
    pub(crate) fn controller_publications(
        &self,
        rpc: &'static str,
        record: &VolumeRecord,
    ) -> Result<BTreeMap<String, ControllerPublication>, PluginError> {
        let Some(location) = &record.location else {
            return Ok(record.published_nodes.clone());
        };
        store::read_record(location)
            .map(|r| r.published_nodes)
            .map_err(|source| PluginError::Store {
                rpc,
                volume_id: record.id.clone(),
                source,
            })
    }

    /// Node mode: the node-local record of the volume a NodeStage or NodePublish names, made
    /// from the controller's when this node first sees it (kept only by [`take_up`](Self::take_up)). Its location comes from the
    /// publish_context, else the volume_context, else this node's record; a location the
    /// request claims must resolve under the shared dir ([`resolve_location`]) and agree with
    /// the one this node recorded.
    pub(crate) fn node_mode_volume(
        &self,
        rpc: &'static str,
        volume_id: &str,
        contexts: [&HashMap<String, String>; 2],
    ) -> Result<VolumeRecord, PluginError> {
        let shared = self
            .config
            .shared_dir
            .as_deref()
            .expect("node mode has a shared dir (checked at start)");
        let known = self.store.get(volume_id);
        let claimed = contexts
            .iter()
            .zip(["publish_context", "volume_context"])
            .find_map(|(c, field)| c.get(VOLUME_DIR_KEY).map(|t| (t, field)));
        let Some((text, field)) = claimed else {
            return known.ok_or_else(|| PluginError::FailedPrecondition {
                rpc,
                volume_id: volume_id.to_string(),
                reason: format!(
                    "neither publish_context nor volume_context names {VOLUME_DIR_KEY}: this node plugin cannot find the volume (ControllerPublishVolume it through a --mode controller csi-test-plugin first)"
                ),
            });
        };
        let invalid = |reason: String| PluginError::InvalidField {
            rpc,
            field,
            reason: format!("{VOLUME_DIR_KEY}: {reason}"),
        };
        let (path, controllers) = resolve_location(shared, text, volume_id)
            .map_err(invalid)?
            .ok_or_else(|| PluginError::VolumeNotFound {
                rpc,
                volume_id: volume_id.to_string(),
            })?;
        if let Some(known) = known {
            if known.location.as_ref() != Some(&path) {
                return Err(invalid(format!(
                    "{} differs from {}, where this node has the volume",
                    path.display(),
                    known.location.unwrap_or_default().display()
                )));
            }
            return Ok(known);
        }
        Ok(VolumeRecord {
            published_nodes: BTreeMap::new(),
            staged: BTreeMap::new(),
            published: BTreeMap::new(),
            location: Some(path),
            ..controllers
        })
    }

    /// Node mode: keeps the node-local record [`node_mode_volume`](Self::node_mode_volume) made
    /// for a volume this node did not know, once the request passed its checks (controller
    /// published to this node among them), before anything is mounted: a refused request
    /// leaves no record behind, a mount interrupted by a crash leaves the record that finds it.
    pub(crate) fn take_up(
        &self,
        rpc: &'static str,
        record: &VolumeRecord,
    ) -> Result<(), PluginError> {
        if self.config.mode != PluginMode::Node || self.store.get(&record.id).is_some() {
            return Ok(());
        }
        self.save(rpc, record)?;
        tracing::info!(volume_id = %record.id, location = %self.storage_dir(record).display(), "node plugin took up a volume of the shared dir");
        Ok(())
    }

    /// Node mode: forgets a volume nothing on this node uses any more (its node-local record;
    /// the controller's is not touched).
    pub(crate) fn forget_if_unused(
        &self,
        rpc: &'static str,
        record: &VolumeRecord,
    ) -> Result<(), PluginError> {
        if self.config.mode != PluginMode::Node
            || !record.staged.is_empty()
            || !record.published.is_empty()
        {
            return Ok(());
        }
        self.store
            .remove(&record.id)
            .map_err(|source| PluginError::Store {
                rpc,
                volume_id: record.id.clone(),
                source,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::CapabilityRecord;

    #[test]
    fn a_location_must_be_one_canonical_name_under_the_volumes_dir() {
        let volumes = Path::new("/shared/csi/volumes");
        assert_eq!(
            location_in(volumes, "/shared/csi/volumes/vol-1").unwrap(),
            PathBuf::from("/shared/csi/volumes/vol-1")
        );
        for bad in [
            "",
            "vol-1",
            "/etc",
            "/shared/csi/volumes",
            "/shared/csi/volumes/",
            "/shared/csi/volumes/vol-1/",
            "/shared/csi/volumes/vol-1/data",
            "/shared/csi/volumes/../../../etc",
            "/shared/csi/volumes/./vol-1",
            "/shared/csi//volumes/vol-1",
            "/shared/csi/volumes/.hidden",
            "/shared/csi/volumes/+deleted-vol-1",
            "/shared/csi/volumes/vol\0-1",
            "/other/csi/volumes/vol-1",
        ] {
            let err = location_in(volumes, bad).unwrap_err();
            assert!(!err.is_empty(), "{bad:?}");
        }
        let long = format!("/shared/csi/volumes/{}", "a".repeat(5000));
        assert!(location_in(volumes, &long).is_err());
    }

    #[test]
    fn a_symlinked_or_foreign_location_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let shared = std::fs::canonicalize(dir.path()).unwrap();
        let volumes = shared.join("volumes");
        std::fs::create_dir_all(volumes.join("vol-1")).unwrap();
        let outside = shared.join("outside");
        std::fs::create_dir_all(&outside).unwrap();
        std::os::unix::fs::symlink(&outside, volumes.join("vol-2")).unwrap();
        let text = |n: &str| volumes.join(n).display().to_string();
        // No record: not a volume (yet, or any more).
        assert!(resolve_location(&shared, &text("vol-1"), "vol-1")
            .unwrap()
            .is_none());
        assert!(resolve_location(&shared, &text("vol-3"), "vol-3")
            .unwrap()
            .is_none());
        let err = resolve_location(&shared, &text("vol-2"), "vol-2").unwrap_err();
        assert!(err.contains("leads elsewhere"), "{err}");
        // Another volume's directory for this volume.
        let record = VolumeRecord {
            version: store::RECORD_VERSION,
            id: "vol-1".into(),
            name: "n".into(),
            capacity_bytes: 1,
            parameters: BTreeMap::new(),
            volume_context: BTreeMap::new(),
            published_nodes: BTreeMap::new(),
            staged: BTreeMap::new(),
            published: BTreeMap::new(),
            content_source: None,
            mutable_parameters: BTreeMap::new(),
            location: None,
        };
        std::fs::write(
            volumes.join("vol-1/volume.json"),
            serde_json::to_vec(&record).unwrap(),
        )
        .unwrap();
        let err = resolve_location(&shared, &text("vol-1"), "vol-9").unwrap_err();
        assert!(err.contains("holds volume vol-1, not vol-9"), "{err}");
        let (path, got) = resolve_location(&shared, &text("vol-1"), "vol-1")
            .unwrap()
            .unwrap();
        assert_eq!(path, volumes.join("vol-1"));
        assert_eq!(got, record);
    }

    #[test]
    fn only_a_split_deployments_publish_context_names_the_location() {
        // Both mode: the context it always gave (CO checkpoints hold it).
        let both = publish_context("vol-1", "n", None);
        assert_eq!(
            both,
            HashMap::from([("csi-test-plugin/attachment".into(), "vol-1@n".into())])
        );
        let split = publish_context("vol-1", "n", Some(Path::new("/s/volumes/vol-1")));
        assert_eq!(split[VOLUME_DIR_KEY], "/s/volumes/vol-1");
        assert_eq!(split.len(), 2);
    }

    fn publication(mode: AccessMode, readonly: bool) -> ControllerPublication {
        ControllerPublication {
            readonly,
            capability: Some(CapabilityRecord {
                access_mode: mode as i32,
                fs_type: "ext4".into(),
                mount_flags: Vec::new(),
                block: false,
            }),
        }
    }

    #[test]
    fn single_node_modes_hold_a_volume_to_one_node() {
        use AccessMode::*;
        let held =
            |mode, readonly| BTreeMap::from([("x".to_string(), publication(mode, readonly))]);
        let single = [
            SingleNodeWriter,
            SingleNodeReaderOnly,
            SingleNodeSingleWriter,
            SingleNodeMultiWriter,
        ];
        for mode in single {
            let (holder, why) = node_conflict(&held(mode, false), "y", mode as i32, false).unwrap();
            assert_eq!(holder, "x");
            assert!(why.contains(mode.as_str_name()), "{why}");
            // The holder itself may publish again (idempotence is judged elsewhere).
            assert!(node_conflict(&held(mode, false), "x", mode as i32, false).is_none());
            // A multi-node publish beside a single-node one is refused too, naming the holder.
            let (holder, why) =
                node_conflict(&held(mode, false), "y", MultiNodeMultiWriter as i32, false).unwrap();
            assert_eq!(holder, "x");
            assert!(why.contains("allows one node"), "{why}");
        }
        for mode in [MultiNodeMultiWriter, MultiNodeReaderOnly] {
            assert!(node_conflict(&held(mode, false), "y", mode as i32, false).is_none());
        }
        // One writer among readers.
        let w = MultiNodeSingleWriter;
        assert!(node_conflict(&held(w, true), "y", w as i32, false).is_none());
        assert!(node_conflict(&held(w, false), "y", w as i32, true).is_none());
        let (holder, why) = node_conflict(&held(w, false), "y", w as i32, false).unwrap();
        assert_eq!(holder, "x");
        assert!(why.contains("one writer"), "{why}");
        // Unknown capability (version 1 record): held.
        let old = BTreeMap::from([(
            "x".to_string(),
            ControllerPublication {
                readonly: false,
                capability: None,
            },
        )]);
        assert!(node_conflict(&old, "y", MultiNodeMultiWriter as i32, false).is_some());
        assert!(node_conflict(&BTreeMap::new(), "y", SingleNodeWriter as i32, false).is_none());
    }
}
