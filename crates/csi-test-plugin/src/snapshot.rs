//! Snapshots and volumes made from a content source (a snapshot, or a volume to clone).
//!
//! A snapshot is an independent copy of its source volume's content, kept in the snapshot
//! store (`snapshots/<enc id>/`, see [`super::store::SnapshotStore`]), taken under the source
//! volume's lock as [`super::backing`]'s copy module says (a mounted loop filesystem is frozen
//! for the copy; a dir volume's copy is not point-in-time while it is written). It is
//! `ready_to_use` as soon as CreateSnapshot returns. Deleting the source volume leaves its
//! snapshots (they share nothing with it); deleting a snapshot leaves the volumes made from it.
//!
//! A volume made from a content source starts as a copy of it: the same access type (block or
//! mount) and fs type, at least the source's size (a bigger size grows the loop filesystem
//! offline; xfs cannot, and a bigger xfs volume is refused OUT_OF_RANGE), a smaller one
//! OUT_OF_RANGE.
//!
//! Lock order: CreateVolume's lock, then the source's (volume or snapshot) lock, taken only after
//! the name check has released the lock of a volume of that name (which may be the source: a
//! lock is never taken twice); CreateSnapshot's lock, then the source volume's lock. Nothing
//! takes them the other way round.

use std::path::PathBuf;

use rand::Rng;

use super::backing::{Backing, BackingKind};
use super::locks::KeyGuard;
use super::store::{volume_fs_type, FS_TYPE_KEY};
use super::store::{ContentSource, SnapshotRecord, SNAPSHOT_RECORD_VERSION};
use super::{require, snapshot_key, volume_key, Plugin, PluginError};
use csi_isolator::csi::proto;
use csi_isolator::csi::proto::volume_content_source::Type as SourceType;

/// Longest snapshot name accepted (the CSI spec asks plugins to support at least 128).
const MAX_NAME_LEN: usize = 128;

/// Prefix of the ListSnapshots tokens this plugin issues.
const TOKEN_PREFIX: &str = "after:";

/// Prefix of snapshot ids.
const SNAPSHOT_ID_PREFIX: &str = "snap-";

/// A content source looked up and locked for the copy.
pub(super) struct Source {
    /// The directory holding its content (a volume's or a snapshot's).
    pub dir: PathBuf,
    /// Its size: the least the new volume gets.
    pub size: u64,
    /// Whether it holds a block volume.
    pub block: bool,
    /// Its fs type (loop mount volumes only).
    pub fs_type: Option<String>,
    /// Held until the copy is done: the source is neither deleted nor grown meanwhile.
    _lock: KeyGuard,
}

fn to_snapshot(record: &SnapshotRecord) -> proto::Snapshot {
    proto::Snapshot {
        size_bytes: i64::try_from(record.size_bytes).unwrap_or(i64::MAX),
        snapshot_id: record.id.clone(),
        source_volume_id: record.source_volume_id.clone(),
        creation_time: Some(prost_types::Timestamp {
            seconds: record.creation_secs,
            nanos: record.creation_nanos,
        }),
        ready_to_use: true,
        group_snapshot_id: String::new(),
    }
}

/// The ListSnapshots page of `all` (sorted by id) after `starting_token`, at most
/// `max_entries` long (0: no bound), with the token of the next page.
pub(super) fn page<'a>(
    all: &'a [SnapshotRecord],
    starting_token: &str,
    max_entries: i32,
) -> Result<(&'a [SnapshotRecord], String), PluginError> {
    const RPC: &str = "ListSnapshots";
    let max = usize::try_from(max_entries).map_err(|_| PluginError::InvalidField {
        rpc: RPC,
        field: "max_entries",
        reason: "negative".into(),
    })?;
    let start = if starting_token.is_empty() {
        0
    } else {
        let after = starting_token
            .strip_prefix(TOKEN_PREFIX)
            .filter(|id| !id.is_empty())
            .ok_or(PluginError::InvalidToken {
                rpc: RPC,
                token: starting_token.to_string(),
            })?;
        all.partition_point(|r| r.id.as_str() <= after)
    };
    let rest = &all[start..];
    if max == 0 || rest.len() <= max {
        return Ok((rest, String::new()));
    }
    let page = &rest[..max];
    Ok((page, format!("{TOKEN_PREFIX}{}", page[max - 1].id)))
}

impl Plugin {
    fn snapshots_enabled(&self, rpc: &'static str) -> Result<(), PluginError> {
        if !self.config.controller || !self.config.snapshots {
            return Err(PluginError::Unimplemented { rpc });
        }
        Ok(())
    }

    pub(super) fn create_snapshot(
        &self,
        req: proto::CreateSnapshotRequest,
    ) -> Result<proto::CreateSnapshotResponse, PluginError> {
        const RPC: &str = "CreateSnapshot";
        self.snapshots_enabled(RPC)?;
        require(RPC, "name", &req.name)?;
        require(RPC, "source_volume_id", &req.source_volume_id)?;
        if req.name.len() > MAX_NAME_LEN {
            return Err(PluginError::InvalidField {
                rpc: RPC,
                field: "name",
                reason: format!("longer than {MAX_NAME_LEN} bytes"),
            });
        }
        if let Some(existing) = self.snapshots.find_by_name(&req.name) {
            if existing.source_volume_id != req.source_volume_id {
                return Err(PluginError::SnapshotNameConflict {
                    name: req.name,
                    snapshot_id: existing.id,
                    source_volume_id: existing.source_volume_id,
                });
            }
            return Ok(proto::CreateSnapshotResponse {
                snapshot: Some(to_snapshot(&existing)),
            });
        }
        // Held through the copy: the volume is neither deleted, grown nor staged meanwhile.
        let _volume = self.locks.blocking_lock(&volume_key(&req.source_volume_id));
        let volume = self.known_volume(RPC, &req.source_volume_id)?;
        let vol_dir = self.store.volume_dir(&volume.id);
        let bits: u64 = rand::rng().random();
        let id = format!("{SNAPSHOT_ID_PREFIX}{bits:016x}");
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let record = SnapshotRecord {
            version: SNAPSHOT_RECORD_VERSION,
            id: id.clone(),
            name: req.name,
            source_volume_id: volume.id.clone(),
            size_bytes: volume.capacity_bytes,
            creation_secs: i64::try_from(now.as_secs()).unwrap_or(i64::MAX),
            creation_nanos: i32::try_from(now.subsec_nanos()).unwrap_or(0),
            block: Backing::is_block(&vol_dir),
            volume_context: volume.volume_context.clone(),
        };
        let snap_dir = self.snapshots.snapshot_dir(&id);
        // The copy first, the record after: a crash between leaves a directory without a
        // record, which the store deletes when it opens.
        self.backing
            .copy_content(&vol_dir, &snap_dir, || self.faults.stall(RPC))
            .map_err(|source| {
                discard(&snap_dir);
                PluginError::Backing {
                    rpc: RPC,
                    volume_id: volume.id.clone(),
                    source,
                }
            })?;
        self.snapshots
            .save(&record)
            .map_err(|source| PluginError::SnapshotStore {
                rpc: RPC,
                snapshot_id: id.clone(),
                source,
            })?;
        tracing::info!(snapshot_id = %id, volume_id = %volume.id, name = %record.name, "snapshot cut");
        Ok(proto::CreateSnapshotResponse {
            snapshot: Some(to_snapshot(&record)),
        })
    }

    pub(super) fn delete_snapshot(
        &self,
        req: proto::DeleteSnapshotRequest,
    ) -> Result<proto::DeleteSnapshotResponse, PluginError> {
        const RPC: &str = "DeleteSnapshot";
        self.snapshots_enabled(RPC)?;
        require(RPC, "snapshot_id", &req.snapshot_id)?;
        if self.snapshots.get(&req.snapshot_id).is_none() {
            return Ok(proto::DeleteSnapshotResponse {});
        }
        self.faults.stall(RPC);
        self.snapshots
            .remove(&req.snapshot_id)
            .map_err(|source| PluginError::SnapshotStore {
                rpc: RPC,
                snapshot_id: req.snapshot_id.clone(),
                source,
            })?;
        tracing::info!(snapshot_id = %req.snapshot_id, "snapshot deleted");
        Ok(proto::DeleteSnapshotResponse {})
    }

    pub(super) fn list_snapshots(
        &self,
        req: proto::ListSnapshotsRequest,
    ) -> Result<proto::ListSnapshotsResponse, PluginError> {
        const RPC: &str = "ListSnapshots";
        self.snapshots_enabled(RPC)?;
        let all: Vec<SnapshotRecord> = self
            .snapshots
            .list()
            .into_iter()
            .filter(|r| req.snapshot_id.is_empty() || r.id == req.snapshot_id)
            .filter(|r| {
                req.source_volume_id.is_empty() || r.source_volume_id == req.source_volume_id
            })
            .collect();
        let (entries, next_token) = page(&all, &req.starting_token, req.max_entries)?;
        Ok(proto::ListSnapshotsResponse {
            entries: entries
                .iter()
                .map(|r| proto::list_snapshots_response::Entry {
                    snapshot: Some(to_snapshot(r)),
                })
                .collect(),
            next_token,
        })
    }

    pub(super) fn get_snapshot(
        &self,
        req: proto::GetSnapshotRequest,
    ) -> Result<proto::GetSnapshotResponse, PluginError> {
        const RPC: &str = "GetSnapshot";
        self.snapshots_enabled(RPC)?;
        require(RPC, "snapshot_id", &req.snapshot_id)?;
        let record =
            self.snapshots
                .get(&req.snapshot_id)
                .ok_or_else(|| PluginError::SnapshotNotFound {
                    rpc: RPC,
                    snapshot_id: req.snapshot_id.clone(),
                })?;
        Ok(proto::GetSnapshotResponse {
            snapshot: Some(to_snapshot(&record)),
        })
    }

    /// CreateVolume's content source as the request names it: a snapshot (when snapshots are
    /// offered) or a volume (when clones are), its id not empty; not looked up yet.
    pub(super) fn requested_source(
        &self,
        source: Option<&proto::VolumeContentSource>,
    ) -> Result<Option<ContentSource>, PluginError> {
        const RPC: &str = "CreateVolume";
        let Some(source) = source else {
            return Ok(None);
        };
        let refused = |reason: &str| PluginError::InvalidField {
            rpc: RPC,
            field: "volume_content_source",
            reason: reason.to_string(),
        };
        match &source.r#type {
            None => Err(refused("names neither a snapshot nor a volume")),
            Some(SourceType::Snapshot(_)) if !self.config.snapshots => Err(refused(
                "snapshots are not offered by this plugin (--no-snapshots)",
            )),
            Some(SourceType::Volume(_)) if !self.config.clones => Err(refused(
                "volume clones are not offered by this plugin (--no-clones)",
            )),
            Some(SourceType::Snapshot(s)) => {
                require(
                    RPC,
                    "volume_content_source.snapshot.snapshot_id",
                    &s.snapshot_id,
                )?;
                Ok(Some(ContentSource::Snapshot(s.snapshot_id.clone())))
            }
            Some(SourceType::Volume(v)) => {
                require(RPC, "volume_content_source.volume.volume_id", &v.volume_id)?;
                Ok(Some(ContentSource::Volume(v.volume_id.clone())))
            }
        }
    }

    /// Looks up and locks a content source; NOT_FOUND when it does not exist.
    pub(super) fn lock_source(&self, requested: &ContentSource) -> Result<Source, PluginError> {
        const RPC: &str = "CreateVolume";
        match requested {
            ContentSource::Snapshot(id) => {
                let lock = self.locks.blocking_lock(&snapshot_key(id));
                let record =
                    self.snapshots
                        .get(id)
                        .ok_or_else(|| PluginError::SnapshotNotFound {
                            rpc: RPC,
                            snapshot_id: id.clone(),
                        })?;
                let fs_type =
                    (self.backing.kind() == BackingKind::Loop && !record.block).then(|| {
                        record
                            .volume_context
                            .get(FS_TYPE_KEY)
                            .cloned()
                            .unwrap_or_else(|| super::backing::DEFAULT_FS_TYPE.to_string())
                    });
                Ok(Source {
                    dir: self.snapshots.snapshot_dir(&record.id),
                    size: record.size_bytes,
                    block: record.block,
                    fs_type,
                    _lock: lock,
                })
            }
            ContentSource::Volume(id) => {
                let lock = self.locks.blocking_lock(&volume_key(id));
                let record = self.known_volume(RPC, id)?;
                let dir = self.store.volume_dir(&record.id);
                let block = Backing::is_block(&dir);
                let fs_type = (self.backing.kind() == BackingKind::Loop && !block)
                    .then(|| volume_fs_type(&record, self.backing.kind()));
                Ok(Source {
                    dir,
                    size: record.capacity_bytes,
                    block,
                    fs_type,
                    _lock: lock,
                })
            }
        }
    }

    /// Makes a new volume's storage a copy of `source`, lengthened to its capacity (its
    /// filesystem grown offline), then durably records it: a record always has its data.
    pub(super) fn populate(
        &self,
        rpc: &'static str,
        record: &super::store::VolumeRecord,
        source: &Source,
    ) -> Result<(), PluginError> {
        let dir = self.store.volume_dir(&record.id);
        let backing_err = |source| {
            discard(&dir);
            PluginError::Backing {
                rpc,
                volume_id: record.id.clone(),
                source,
            }
        };
        // CreateVolume's stall point is before this (at the side effect of every create).
        self.backing
            .copy_content(&source.dir, &dir, || {})
            .map_err(backing_err)?;
        if record.capacity_bytes > source.size {
            self.backing
                .grow_image(&dir, record.capacity_bytes)
                .map_err(backing_err)?;
            if let Some(fs_type) = &source.fs_type {
                self.backing
                    .grow_filesystem_offline(&dir, fs_type)
                    .map_err(backing_err)?;
            }
        }
        self.save(rpc, record)
    }
}

/// Deletes the unrecorded copy a failed snapshot or create left (nothing is mounted in it; the
/// store deletes it at its next open if this fails too).
fn discard(dir: &std::path::Path) {
    if let Err(e) = std::fs::remove_dir_all(dir) {
        tracing::warn!(path = %dir.display(), error = %e, "removing a failed copy");
    }
}

/// The parts of a CreateVolume a content source decides: the fs type, checked against the one
/// asked for, and the size, at least the source's.
pub(super) fn sized_from_source(
    source: &Source,
    name: &str,
    block: bool,
    asked_fs_type: Option<&str>,
    required: u64,
    min_size: u64,
) -> Result<(Option<String>, u64), PluginError> {
    const RPC: &str = "CreateVolume";
    let invalid = |reason: String| PluginError::InvalidField {
        rpc: RPC,
        field: "volume_content_source",
        reason,
    };
    let kind = |b: bool| if b { "block" } else { "mount" };
    if source.block != block {
        return Err(invalid(format!(
            "the source holds a {} volume; a {} volume cannot be made from it",
            kind(source.block),
            kind(block)
        )));
    }
    if let (Some(asked), Some(has)) = (asked_fs_type, &source.fs_type) {
        if asked != has {
            return Err(invalid(format!(
                "fs_type {asked:?} asked, but the source holds {has:?}"
            )));
        }
    }
    let out_of_range = |reason: String| PluginError::OutOfRange {
        rpc: RPC,
        volume_id: name.to_string(),
        reason,
    };
    if required != 0 && required < source.size {
        return Err(out_of_range(format!(
            "required_bytes {required} is less than the {} bytes of its content source",
            source.size
        )));
    }
    let size = required.max(source.size).max(min_size);
    if size > source.size
        && source
            .fs_type
            .as_deref()
            .is_some_and(|t| !Backing::grows_offline(t))
    {
        return Err(out_of_range(format!(
            "a {} volume made from a content source keeps its {} bytes ({size} asked): grow it after with ControllerExpandVolume and NodeExpandVolume",
            source.fs_type.as_deref().unwrap_or_default(),
            source.size
        )));
    }
    Ok((source.fs_type.clone(), size))
}

/// Snapshot records as the store keeps them, for tests of [`page`].
#[cfg(test)]
fn records(ids: &[&str]) -> Vec<SnapshotRecord> {
    ids.iter()
        .map(|id| SnapshotRecord {
            version: SNAPSHOT_RECORD_VERSION,
            id: id.to_string(),
            name: format!("name-{id}"),
            source_volume_id: "vol".into(),
            size_bytes: 1,
            creation_secs: 0,
            creation_nanos: 0,
            block: false,
            volume_context: std::collections::BTreeMap::new(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_follow_their_tokens_to_the_end() {
        let all = records(&["a", "b", "c", "d", "e"]);
        let ids = |p: &[SnapshotRecord]| p.iter().map(|r| r.id.clone()).collect::<Vec<_>>();
        let (first, token) = page(&all, "", 2).unwrap();
        assert_eq!(
            (ids(first), token.as_str()),
            (vec!["a".into(), "b".into()], "after:b")
        );
        let (second, token) = page(&all, &token, 2).unwrap();
        assert_eq!(ids(second), ["c", "d"]);
        let (last, token) = page(&all, &token, 2).unwrap();
        assert_eq!((ids(last), token.as_str()), (vec!["e".to_string()], ""));
        // No bound: the rest at once; a token past a deleted id still resumes after it.
        assert_eq!(ids(page(&all, "after:bb", 0).unwrap().0), ["c", "d", "e"]);
        assert_eq!(
            page(&all, "", 5).unwrap().1,
            "",
            "exactly max: no next page"
        );
    }

    fn source(size: u64, block: bool, fs_type: Option<&str>) -> Source {
        let locks = std::sync::Arc::new(crate::locks::LockMap::default());
        Source {
            dir: PathBuf::from("/nowhere"),
            size,
            block,
            fs_type: fs_type.map(str::to_string),
            _lock: locks.blocking_lock("snapshot/snap-1"),
        }
    }

    #[test]
    fn a_volume_from_a_source_is_of_its_kind_and_at_least_its_size() {
        let ext4 = source(100, false, Some("ext4"));
        // (block, asked fs type, required, min) -> fs type and size, or the error's field.
        assert_eq!(
            sized_from_source(&ext4, "n", false, None, 0, 8).unwrap(),
            (Some("ext4".into()), 100),
            "no size asked: the source's"
        );
        assert_eq!(
            sized_from_source(&ext4, "n", false, Some("ext4"), 300, 8).unwrap(),
            (Some("ext4".into()), 300)
        );
        assert_eq!(
            sized_from_source(&source(4, false, None), "n", false, None, 0, 8).unwrap(),
            (None, 8),
            "never below the backing's minimum"
        );
        let err = |r: Result<_, PluginError>| match r.unwrap_err() {
            PluginError::OutOfRange { .. } => "out of range",
            PluginError::InvalidField { .. } => "invalid",
            other => panic!("{other}"),
        };
        assert_eq!(
            err(sized_from_source(&ext4, "n", false, None, 99, 8)),
            "out of range"
        );
        assert_eq!(
            err(sized_from_source(&ext4, "n", true, None, 0, 8)),
            "invalid"
        );
        assert_eq!(
            err(sized_from_source(&ext4, "n", false, Some("xfs"), 0, 8)),
            "invalid"
        );
        let xfs = source(100, false, Some("xfs"));
        assert_eq!(
            sized_from_source(&xfs, "n", false, None, 100, 8).unwrap().1,
            100
        );
        assert_eq!(
            err(sized_from_source(&xfs, "n", false, None, 101, 8)),
            "out of range",
            "xfs cannot grow unmounted"
        );
        let block = source(100, true, None);
        assert_eq!(
            sized_from_source(&block, "n", true, None, 200, 8).unwrap(),
            (None, 200)
        );
    }

    #[test]
    fn tokens_it_did_not_issue_are_aborted() {
        let all = records(&["a"]);
        for bad in ["x", "after:", "before:a"] {
            let err = page(&all, bad, 0).unwrap_err();
            assert!(
                matches!(
                    err,
                    PluginError::InvalidToken {
                        rpc: "ListSnapshots",
                        ..
                    }
                ),
                "{bad}: {err}"
            );
        }
        assert!(matches!(
            page(&all, "", -1).unwrap_err(),
            PluginError::InvalidField {
                field: "max_entries",
                ..
            }
        ));
    }
}
