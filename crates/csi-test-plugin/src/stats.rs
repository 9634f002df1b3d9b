//! NodeGetVolumeStats' figures and the volume condition (CSI v1.12 `NodeGetVolumeStats`).
//!
//! Figures: statvfs of the path asked about (a publish target or a staging path), as kubelet's
//! own volume stats read it. For the loop backing that is the volume's own ext4 (its total is
//! the image's size less what the filesystem keeps for itself). The dir backing does not enforce
//! a capacity: a directory volume can fill the work dir's filesystem, so it reports that
//! filesystem's figures (what the workload can really write), not the recorded capacity, which
//! nothing holds it to. A block volume has no filesystem to ask: BYTES total only, the recorded
//! size of its image.
//!
//! Condition (`VOLUME_CONDITION`): abnormal when what holds the volume's data is gone (the
//! data directory, or the image file) or, for a filesystem on a block device, when ext4 counts
//! errors on it (`/sys/fs/ext4/<device>/errors_count`); normal otherwise.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use csi_isolator::csi::proto;
use csi_isolator::csi::proto::volume_usage::Unit;

/// The figures of the filesystem at `path`: BYTES (total, used, available) and INODES.
pub fn usage_of(path: &Path) -> nix::Result<Vec<proto::VolumeUsage>> {
    let st = nix::sys::statvfs::statvfs(path)?;
    let frsize = st.fragment_size() as i64;
    let as_i64 = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
    let bytes = proto::VolumeUsage {
        total: as_i64(st.blocks() as u64).saturating_mul(frsize),
        available: as_i64(st.blocks_available() as u64).saturating_mul(frsize),
        used: as_i64((st.blocks() as u64).saturating_sub(st.blocks_free() as u64))
            .saturating_mul(frsize),
        unit: Unit::Bytes as i32,
    };
    let inodes = proto::VolumeUsage {
        total: as_i64(st.files() as u64),
        available: as_i64(st.files_available() as u64),
        used: as_i64((st.files() as u64).saturating_sub(st.files_free() as u64)),
        unit: Unit::Inodes as i32,
    };
    Ok(vec![bytes, inodes])
}

/// A block volume's usage: its size as BYTES total, nothing else known.
pub fn block_usage(capacity_bytes: u64) -> Vec<proto::VolumeUsage> {
    vec![proto::VolumeUsage {
        total: i64::try_from(capacity_bytes).unwrap_or(i64::MAX),
        unit: Unit::Bytes as i32,
        ..Default::default()
    }]
}

/// The volume's condition: `storage` is what holds its data, `path` where it is mounted (for
/// the filesystem's error count).
pub fn condition(storage: &Path, path: &Path) -> proto::VolumeCondition {
    let abnormal = |message: String| proto::VolumeCondition {
        abnormal: true,
        message,
    };
    if std::fs::symlink_metadata(storage).is_err() {
        return abnormal(format!(
            "the volume's storage {} is gone",
            storage.display()
        ));
    }
    if let Some(errors) = ext4_errors(path) {
        if errors > 0 {
            return abnormal(format!("its ext4 filesystem counts {errors} errors"));
        }
    }
    proto::VolumeCondition {
        abnormal: false,
        message: "volume is healthy".into(),
    }
}

/// ext4's error count of the filesystem mounted at `path`, when it is an ext4 on a block device
/// (`/sys/fs/ext4/<device name>/errors_count`, the device named through `/sys/dev/block`).
fn ext4_errors(path: &Path) -> Option<u64> {
    let dev = std::fs::metadata(path).ok()?.dev();
    let (major, minor) = (nix::sys::stat::major(dev), nix::sys::stat::minor(dev));
    let link = std::fs::read_link(format!("/sys/dev/block/{major}:{minor}")).ok()?;
    let name = link.file_name()?.to_str()?.to_string();
    let text = std::fs::read_to_string(format!("/sys/fs/ext4/{name}/errors_count")).ok()?;
    text.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gone_storage_is_abnormal_and_present_storage_healthy() {
        let dir = tempfile::tempdir().unwrap();
        let storage = dir.path().join("data");
        std::fs::create_dir(&storage).unwrap();
        let ok = condition(&storage, dir.path());
        assert!(!ok.abnormal, "{ok:?}");
        std::fs::remove_dir(&storage).unwrap();
        let gone = condition(&storage, dir.path());
        assert!(gone.abnormal);
        assert!(gone.message.contains("is gone"), "{gone:?}");
    }

    #[test]
    fn figures_are_consistent() {
        let dir = tempfile::tempdir().unwrap();
        let usage = usage_of(dir.path()).unwrap();
        let bytes = &usage[0];
        assert_eq!(bytes.unit, Unit::Bytes as i32);
        assert!(bytes.total > 0 && bytes.used <= bytes.total && bytes.available <= bytes.total);
        assert_eq!(block_usage(7)[0].total, 7);
    }
}
