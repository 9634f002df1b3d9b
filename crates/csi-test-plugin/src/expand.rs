//! Volume expansion: ControllerExpandVolume grows what the controller owns (a dir volume's
//! recorded capacity, a loop volume's image), NodeExpandVolume what the node sees (a loop
//! volume's mounted filesystem, online), as [`super::backing`]'s grow module does it.
//!
//! Rules (CSI v1.12): a volume already at least as large as asked is answered OK with its
//! capacity (both RPCs); a size over `limit_bytes`, over the plugin's total or over what the
//! work dir can still give is OUT_OF_RANGE; `--expansion offline` refuses a ControllerExpand of
//! a volume published to a node or mounted on it (FAILED_PRECONDITION); NodeExpandVolume needs
//! the volume staged or published at `volume_path` (NOT_FOUND otherwise). ControllerExpand's
//! `node_expansion_required` is true for a loop mount volume only (a dir volume and a block
//! volume have no filesystem of the plugin's to grow). NodeExpandVolume of a size the
//! controller did not give grows the image itself first. A node-only plugin (`--no-controller`)
//! offers no expansion.
//!
//! An ext-family filesystem grown mounted needs CAP_SYS_RESOURCE (EXT4_IOC_RESIZE_FS); without
//! it NodeExpandVolume is FAILED_PRECONDITION, saying why and what to do. Growing the image marks
//! the volume (a file in its directory), and the next NodeStage that finds nothing of the volume
//! mounted on the node grows the filesystem offline first, which needs no such capability.

use super::backing::Backing;
use super::controller::{capacity_range as range, check_volume_access, volume_fs_type, Bound};
use super::{require, volume_key, Expansion, Plugin, PluginError};
use csi_isolator::csi::proto;

impl Plugin {
    /// The expansion the plugin offers: `--expansion`, and none without the controller service
    /// (its volumes are not the plugin's to grow: a node-only plugin serves pre-provisioned
    /// storage).
    pub(super) fn expansion(&self) -> Expansion {
        if self.config.controller {
            self.config.expansion
        } else {
            Expansion::None
        }
    }

    fn expansion_enabled(&self, rpc: &'static str) -> Result<(), PluginError> {
        if self.expansion() == Expansion::None {
            return Err(PluginError::Unimplemented { rpc });
        }
        Ok(())
    }

    /// Grows volume `record` to `size` bytes (more than it has), within `limit` (0: none) and
    /// the plugin's room, and records it: the image first, the record after (a crash between
    /// leaves a longer image, which a repeated call finds as long as it wants).
    fn grow(
        &self,
        rpc: &'static str,
        record: &mut super::store::VolumeRecord,
        size: u64,
        limit: u64,
    ) -> Result<(), PluginError> {
        let out_of_range = |reason: String| PluginError::OutOfRange {
            rpc,
            volume_id: record.id.clone(),
            reason,
        };
        if limit != 0 && size > limit {
            return Err(out_of_range(format!(
                "{size} bytes exceed limit_bytes {limit}"
            )));
        }
        let more = size - record.capacity_bytes;
        let room = self.room(Some(more));
        if more > room.bytes {
            let bound = match room.bound {
                Bound::Total => "the plugin's total capacity (--capacity)",
                Bound::Filesystem => "the free space of the plugin's work dir",
            };
            return Err(out_of_range(format!(
                "growing from {} to {size} bytes needs {more} more, but {bound} leaves {}",
                record.capacity_bytes, room.bytes
            )));
        }
        self.faults.stall(rpc);
        let dir = self.store.volume_dir(&record.id);
        let fs_type = volume_fs_type(record, self.backing.kind());
        if !Backing::is_block(&dir) && Backing::grows_offline(&fs_type) {
            // Before the image: a crash between leaves a marker for a filesystem that needs no
            // growing, which costs the next stage one e2fsck and a resize2fs with nothing to do.
            mark_filesystem_smaller(&dir).map_err(|source| PluginError::Backing {
                rpc,
                volume_id: record.id.clone(),
                source,
            })?;
        }
        self.backing
            .grow_image(&dir, size)
            .map_err(|source| PluginError::Backing {
                rpc,
                volume_id: record.id.clone(),
                source,
            })?;
        record.capacity_bytes = size;
        self.save(rpc, record)?;
        tracing::info!(volume_id = %record.id, size, "volume grown");
        Ok(())
    }

    /// Runs under CreateVolume's lock (the capacity it promises), then takes the volume's.
    pub(super) fn controller_expand(
        &self,
        req: proto::ControllerExpandVolumeRequest,
    ) -> Result<proto::ControllerExpandVolumeResponse, PluginError> {
        const RPC: &str = "ControllerExpandVolume";
        if !self.config.controller {
            return Err(PluginError::Unimplemented { rpc: RPC });
        }
        self.expansion_enabled(RPC)?;
        require(RPC, "volume_id", &req.volume_id)?;
        let asked = req
            .capacity_range
            .as_ref()
            .ok_or(PluginError::MissingField {
                rpc: RPC,
                field: "capacity_range",
            })?;
        let (required, limit) = range(RPC, asked)?;
        let _volume = self.locks.blocking_lock(&volume_key(&req.volume_id));
        let mut record = self.known_volume(RPC, &req.volume_id)?;
        let dir = self.store.volume_dir(&record.id);
        let block = Backing::is_block(&dir);
        if let Some(cap) = &req.volume_capability {
            check_volume_access(RPC, "volume_capability", cap, &record.id, block)?;
        }
        if required > record.capacity_bytes {
            if self.expansion() == Expansion::Offline {
                self.check_offline(RPC, &record)?;
            }
            self.grow(RPC, &mut record, required, limit)?;
        }
        Ok(proto::ControllerExpandVolumeResponse {
            capacity_bytes: i64::try_from(record.capacity_bytes).unwrap_or(i64::MAX),
            node_expansion_required: !block
                && !volume_fs_type(&record, self.backing.kind()).is_empty(),
        })
    }

    /// `--expansion offline`: a volume published to a node or mounted on it is in use.
    fn check_offline(
        &self,
        rpc: &'static str,
        record: &super::store::VolumeRecord,
    ) -> Result<(), PluginError> {
        let in_use = |reason: String| PluginError::FailedPrecondition {
            rpc,
            volume_id: record.id.clone(),
            reason: format!(
                "{reason}, and this plugin expands volumes offline only (unpublish it first)"
            ),
        };
        if let Some(node) = record.published_nodes.keys().next() {
            return Err(in_use(format!("controller-published to node {node}")));
        }
        let dir = self.store.volume_dir(&record.id);
        let mounts = self
            .backing
            .volume_mounts(&dir)
            .map_err(|source| PluginError::Backing {
                rpc,
                volume_id: record.id.clone(),
                source,
            })?;
        if let Some(m) = mounts.first() {
            return Err(in_use(format!("mounted at {}", m.mount_point.display())));
        }
        Ok(())
    }

    /// NodeStage, before it mounts the volume: a filesystem of the ext family left smaller
    /// than its image by an expansion done while the volume was not in use is grown offline
    /// (`e2fsck -f`, `resize2fs` on the unmounted image), which needs no capability beyond
    /// root's files, unlike the online grow (EXT4_IOC_RESIZE_FS needs CAP_SYS_RESOURCE). Done
    /// only while nothing of the volume is mounted on this node; otherwise NodeExpandVolume
    /// grows it online. Runs under the volume's lock.
    pub(super) fn grow_filesystem_before_stage(
        &self,
        rpc: &'static str,
        volume_id: &str,
        fs_type: &str,
    ) -> Result<(), PluginError> {
        let dir = self.store.volume_dir(volume_id);
        let err = |source| PluginError::Backing {
            rpc,
            volume_id: volume_id.to_string(),
            source,
        };
        if !dir.join(FS_SMALLER_MARKER).exists()
            || !self.backing.volume_mounts(&dir).map_err(err)?.is_empty()
        {
            return Ok(());
        }
        self.backing
            .grow_filesystem_offline(&dir, fs_type)
            .map_err(err)?;
        clear_filesystem_smaller(&dir).map_err(err)?;
        tracing::info!(
            volume_id,
            fs_type,
            "filesystem grown offline to its image before staging"
        );
        Ok(())
    }

    /// Runs under the volume's lock.
    pub(super) fn node_expand(
        &self,
        req: proto::NodeExpandVolumeRequest,
    ) -> Result<proto::NodeExpandVolumeResponse, PluginError> {
        const RPC: &str = "NodeExpandVolume";
        self.expansion_enabled(RPC)?;
        require(RPC, "volume_id", &req.volume_id)?;
        require(RPC, "volume_path", &req.volume_path)?;
        let (required, limit) = match &req.capacity_range {
            Some(asked) => range(RPC, asked)?,
            None => (0, 0),
        };
        let mut record = self.known_volume(RPC, &req.volume_id)?;
        let dir = self.storage_dir(&record);
        let block = Backing::is_block(&dir);
        if let Some(cap) = &req.volume_capability {
            check_volume_access(RPC, "volume_capability", cap, &record.id, block)?;
        }
        let backing_err = |source| PluginError::Backing {
            rpc: RPC,
            volume_id: record.id.clone(),
            source,
        };
        let path = std::path::PathBuf::from(&req.volume_path);
        let at_path = self.backing.mount_state(&dir, &path).map_err(backing_err)?;
        if !matches!(at_path, super::backing::MountState::Volume { .. }) {
            return Err(PluginError::VolumeNotAtPath {
                rpc: RPC,
                volume_id: record.id.clone(),
                path,
            });
        }
        if required > record.capacity_bytes {
            self.grow(RPC, &mut record, required, limit)?;
        }
        let fs_type = volume_fs_type(&record, self.backing.kind());
        self.faults.stall(RPC);
        self.backing.grow_filesystem(&dir, &fs_type).map_err(
            |source| match online_grow_refused(&fs_type, &source) {
                Some(reason) => PluginError::FailedPrecondition {
                    rpc: RPC,
                    volume_id: record.id.clone(),
                    reason,
                },
                None => PluginError::Backing {
                    rpc: RPC,
                    volume_id: record.id.clone(),
                    source,
                },
            },
        )?;
        // Grown to its image: nothing left for the next stage to do offline.
        clear_filesystem_smaller(&dir).map_err(|source| PluginError::Backing {
            rpc: RPC,
            volume_id: record.id.clone(),
            source,
        })?;
        Ok(proto::NodeExpandVolumeResponse {
            capacity_bytes: i64::try_from(record.capacity_bytes).unwrap_or(i64::MAX),
        })
    }
}

/// In a loop volume's directory: its image was grown and its filesystem (of the ext family) may
/// not be yet; the next stage grows it offline ([`Plugin::grow_filesystem_before_stage`]).
const FS_SMALLER_MARKER: &str = "filesystem-smaller-than-image";

/// Durable (written atomically, the directory synced) before the image grows: a power cut that
/// keeps the grown image and the record's new capacity but loses the marker would leave the
/// filesystem smaller than the capacity ControllerExpandVolume answered, with no stage ever
/// growing it.
fn mark_filesystem_smaller(dir: &std::path::Path) -> Result<(), super::backing::BackingError> {
    let marker = dir.join(FS_SMALLER_MARKER);
    csi_isolator::durable::write_atomic(&marker, b"", csi_isolator::workdir::PRIVATE_FILE_MODE)
        .map_err(|e| csi_isolator::io_step::IoStep::new(e.step.as_str(), e.path, e.source))?;
    Ok(())
}

fn clear_filesystem_smaller(dir: &std::path::Path) -> Result<(), super::backing::BackingError> {
    let marker = dir.join(FS_SMALLER_MARKER);
    // Not synced: a marker a power cut brings back costs the next stage one e2fsck and a
    // resize2fs with nothing to do.
    match csi_isolator::durable::remove_file(&marker) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(csi_isolator::io_step::io_step("remove marker", &marker)(e).into())
        }
        _ => Ok(()),
    }
}

/// When growing a mounted filesystem failed because the kernel refused the plugin (resize2fs's
/// EXT4_IOC_RESIZE_FS needs CAP_SYS_RESOURCE): why, and what to do instead.
fn online_grow_refused(fs_type: &str, err: &super::backing::BackingError) -> Option<String> {
    let super::backing::BackingError::Tool {
        program, reason, ..
    } = err
    else {
        return None;
    };
    (program == "resize2fs" && reason.contains("Permission denied")).then(|| {
        format!(
            "growing the mounted {fs_type} filesystem online needs CAP_SYS_RESOURCE \
             (EXT4_IOC_RESIZE_FS), which this plugin's process lacks ({}); the image is grown, \
             the filesystem is not: release the volume from every container so that it is \
             unstaged, and its next stage grows it offline, or run the plugin with \
             CAP_SYS_RESOURCE",
            reason.trim()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backing::BackingError;

    #[test]
    fn an_online_grow_refused_by_the_kernel_says_why_and_what_to_do() {
        let refused = BackingError::Tool {
            program: "resize2fs".into(),
            args: "/dev/loop3".into(),
            reason: "exit status: 1: resize2fs 1.47.0 (5-Feb-2023)\nresize2fs: Permission denied to resize filesystem".into(),
        };
        let said = online_grow_refused("ext4", &refused).expect("recognised");
        for words in [
            "mounted ext4 filesystem online needs CAP_SYS_RESOURCE",
            "release the volume from every container",
            "next stage grows it offline",
            "Permission denied to resize filesystem",
        ] {
            assert!(said.contains(words), "{words:?} in {said}");
        }
        let other = BackingError::Tool {
            program: "resize2fs".into(),
            args: String::new(),
            reason: "exit status: 1: bad superblock".into(),
        };
        assert_eq!(online_grow_refused("ext4", &other), None);
        let xfs = BackingError::Tool {
            program: "xfs_growfs".into(),
            args: String::new(),
            reason: "Permission denied".into(),
        };
        assert_eq!(online_grow_refused("xfs", &xfs), None);
    }
}
