//! Durable per-volume metadata of the test plugin.
//!
//! Layout under the plugin's work dir:
//! `volumes/<enc id>/volume.json` (the record), next to the volume's backing (`data/` or
//! `image.ext4`). `<enc id>` is [`encode_volume_id`], the provider's encoding. A record is
//! written by [`csi_isolator::durable::write_atomic`] (mode 0600), and only after the backing exists,
//! so a crash mid-create leaves a directory without a record. Removal first renames the
//! volume's directory to a tombstone (`volumes/+deleted-<enc id>`: `+` is outside the
//! encoding's alphabet, so no volume's name), which drops the record atomically, then deletes
//! the tombstone. Opening the store deletes both kinds of leftovers (directories without a
//! record, tombstones), so no crash leaks a volume's storage. Lookups by name scan the
//! records: the records are the only source of truth, so there is no index to disagree with
//! them.
//!
//! Names of older builds: they encoded ids with an encoder of their own (a leading `.`
//! escaped as `%2E`, no hashing of long ids) and named tombstones `.deleted-<enc id>`. Their
//! volumes keep their directories: at open, a directory whose record's id encodes to another
//! name is that volume's, unless its name begins with `.` (the old encoder never began a name
//! with `.`, so that is an old tombstone, deleted). New volumes get the shared encoding.
//!
//! The use journal: the records' changes by the RPCs of a workload's use (ControllerPublish,
//! NodeStage, NodePublish and their reverses: six per launch) go to one append-only journal,
//! `volumes.journal` in the work dir ([`csi_isolator::durable::journal`]: concurrent appends
//! share one `fdatasync` per batch), instead of a `write_atomic` each (a file and a directory
//! fsync, paid alone). Each entry holds a volume directory's name and its whole record after the
//! change (or none: removed). The record files then lag the journal: [`Store::open`] reads the
//! journal first and takes a journaled directory's record from it (not from its file), and
//! compaction (when the journal is due, at an append or at open) writes every journaled record back to its
//! file (`write_atomic` each, several at a time: `durable::write_atomic_each`; a `syncfs` would
//! wait for the whole file system's dirty pages) before it empties the journal. Every other change (a create, an expansion, a modification) is written through
//! to the file as before, and to the journal too while the journal holds entries of that
//! directory (a later entry must win over an earlier one at replay); a removal while it does is
//! journaled before the tombstone, so an earlier entry never brings a removed volume's record
//! back onto a volume made again under its name. A controller of split mode writes everything
//! through (no journal): node plugins read its record files ([`read_record`]). A work dir of an
//! older build has no journal: it opens as before.
//!
//! Format history: version 1 kept only the readonly flag per controller-published node;
//! version 2 adds the volume capability of each controller publish, staging path and target
//! (a repeated call with another capability is refused). Version 1 records are read and
//! rewritten as version 2 on their next change.

use std::collections::{BTreeMap, HashMap};
use std::ffi::{OsStr, OsString};
use std::fs;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, RwLock};

use serde::{Deserialize, Serialize};

use crate::backing::BackingKind;
use csi_isolator::durable;
use csi_isolator::durable::journal::{self, Journal, JournalError, When};
use csi_isolator::io_step::IoStep;
use csi_isolator::resource::encode_volume_id;
use csi_isolator::workdir::PRIVATE_FILE_MODE;

/// Version of the on-disk record format.
pub const RECORD_VERSION: u32 = 2;

const RECORD_FILE: &str = "volume.json";

/// The use journal's file, in the work dir (beside `volumes/`, whose entries are volumes).
pub const JOURNAL_FILE: &str = "volumes.journal";

/// Version of a use journal entry's format.
pub const JOURNAL_ENTRY_VERSION: u32 = 1;

/// Entries after which the use journal is compacted (6 per launch: once in about 1,400
/// launches; a compaction writes every record file the journal changed back, and every change
/// waits for it).
const COMPACT_ENTRIES: u64 = 8192;

/// Bytes after which the use journal is compacted.
const COMPACT_BYTES: u64 = 8 << 20;

/// Prefix of a volume directory being removed: `+` is never in an encoded id.
const TOMBSTONE_PREFIX: &str = "+deleted-";

/// The longest volume id the plugin makes, in bytes (Linux `NAME_MAX`): over CSI's 128, so
/// tests can give it hostile prefixes, but bounded, so an over-long `--id-prefix` fails its
/// CreateVolume before any storage is made.
pub const MAX_ID_LEN: usize = 255;

/// Errors of the metadata store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Creating a directory of the store failed.
    #[error("create store directory {path}")]
    CreateDir {
        /// The directory.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// Listing the volumes directory failed.
    #[error("list records in {path}")]
    List {
        /// The directory.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// Reading a record failed.
    #[error("read record {path}")]
    Read {
        /// The record file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A record could not be decoded.
    #[error("decode record {path}")]
    Decode {
        /// The record file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: serde_json::Error,
    },
    /// A record has a format version this build does not know.
    #[error("record {path} has unsupported version {version}")]
    Version {
        /// The record file.
        path: PathBuf,
        /// The version found.
        version: u32,
    },
    /// Writing a record (any step of the atomic write), or renaming a
    /// volume's directory to its tombstone, failed.
    #[error("write record")]
    Write(#[source] IoStep),
    /// A volume id longer than [`MAX_ID_LEN`] (an id the plugin was told to make with an
    /// over-long `--id-prefix`).
    #[error("volume id of {len} bytes is too long for the store (at most {MAX_ID_LEN})")]
    IdTooLong {
        /// The id's length in bytes.
        len: usize,
    },
    /// Another plugin's record (a node plugin reading the controller's) is not one root alone
    /// can have written, or is too large.
    #[error("refuse record {path}")]
    Refused {
        /// The record file.
        path: PathBuf,
        /// Why.
        #[source]
        source: Box<csi_isolator::workdir::RootFileError>,
    },
    /// Opening, appending to or compacting the use journal failed.
    #[error("record journal")]
    Journal(#[from] JournalError),
    /// A use journal entry could not be decoded, or has a version this build does not know.
    #[error("decode entry {seq} of record journal {path}: {reason}; move the journal aside to start without it (the record files then hold the last written-back state)")]
    JournalEntry {
        /// The journal.
        path: PathBuf,
        /// The entry's sequence number.
        seq: u64,
        /// Why.
        reason: String,
    },
    /// Removing a volume's directory failed.
    #[error("remove directory {path}")]
    Remove {
        /// The directory.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
}

/// The parts of a CSI volume capability that make two calls compatible or not.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CapabilityRecord {
    /// The access mode (`VolumeCapability.AccessMode.Mode` as its number).
    pub access_mode: i32,
    /// The file system type (`ext4` when the request left it empty: the plugin's default).
    pub fs_type: String,
    /// The mount flags, sorted and deduplicated.
    pub mount_flags: Vec<String>,
    /// Block access (the fs type and mount flags are then empty).
    #[serde(default)]
    pub block: bool,
}

/// A controller publish of the volume to one node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ControllerPublication {
    /// The readonly flag of the publish.
    pub readonly: bool,
    /// Its capability; `None` when recorded by a version 1 record (unknown, not compared).
    pub capability: Option<CapabilityRecord>,
}

/// The persisted state of one volume.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeRecord {
    /// Format version ([`RECORD_VERSION`]).
    pub version: u32,
    /// The plugin-generated volume id.
    pub id: String,
    /// The CO-chosen name from CreateVolume.
    pub name: String,
    /// The provisioned size.
    pub capacity_bytes: u64,
    /// CreateVolume parameters, kept to judge a repeated create.
    pub parameters: BTreeMap<String, String>,
    /// The volume_context returned by CreateVolume.
    pub volume_context: BTreeMap<String, String>,
    /// Nodes the volume is controller-published to, with that publish's flag and capability.
    pub published_nodes: BTreeMap<String, ControllerPublication>,
    /// Capability of each staging path (as the request spelled it) the volume was staged at.
    /// The mount table says whether it still is; this only says with what.
    #[serde(default)]
    pub staged: BTreeMap<String, CapabilityRecord>,
    /// Capability of each target path the volume was published at (same caveat).
    #[serde(default)]
    pub published: BTreeMap<String, CapabilityRecord>,
    /// What the volume was made from (CreateVolume's `volume_content_source`), to judge a
    /// repeated create; `None` for an empty volume (and for records older than this field).
    #[serde(default)]
    pub content_source: Option<ContentSource>,
    /// The volume's mutable parameters (CreateVolume's `mutable_parameters`, then each
    /// ControllerModifyVolume's merged in); empty for records older than this field.
    #[serde(default)]
    pub mutable_parameters: BTreeMap<String, String>,
    /// A node-mode plugin's record of a volume the controller keeps elsewhere: the volume's
    /// directory under the shared dir (validated, see `multinode`). `None`: the volume's
    /// storage is this store's own `volume_dir` (the controller's and a both-mode plugin's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub location: Option<PathBuf>,
}

/// A CreateVolume's `volume_content_source`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ContentSource {
    /// Restored from this snapshot.
    Snapshot(String),
    /// Cloned from this volume.
    Volume(String),
}

/// A version 1 record (controller publishes as a bare readonly flag).
#[derive(Deserialize)]
struct VolumeRecordV1 {
    id: String,
    name: String,
    capacity_bytes: u64,
    parameters: BTreeMap<String, String>,
    volume_context: BTreeMap<String, String>,
    published_nodes: BTreeMap<String, bool>,
}

impl From<VolumeRecordV1> for VolumeRecord {
    fn from(v1: VolumeRecordV1) -> VolumeRecord {
        VolumeRecord {
            version: RECORD_VERSION,
            id: v1.id,
            name: v1.name,
            capacity_bytes: v1.capacity_bytes,
            parameters: v1.parameters,
            volume_context: v1.volume_context,
            published_nodes: v1
                .published_nodes
                .into_iter()
                .map(|(node, readonly)| {
                    let publication = ControllerPublication {
                        readonly,
                        capability: None,
                    };
                    (node, publication)
                })
                .collect(),
            staged: BTreeMap::new(),
            published: BTreeMap::new(),
            content_source: None,
            mutable_parameters: BTreeMap::new(),
            location: None,
        }
    }
}

#[derive(Deserialize)]
struct VersionOnly {
    version: u32,
}

/// Decodes a record of any known version.
fn decode(path: &Path, bytes: &[u8]) -> Result<VolumeRecord, StoreError> {
    let decode_err = |source| StoreError::Decode {
        path: path.to_path_buf(),
        source,
    };
    let VersionOnly { version } = serde_json::from_slice(bytes).map_err(decode_err)?;
    match version {
        1 => Ok(serde_json::from_slice::<VolumeRecordV1>(bytes)
            .map_err(decode_err)?
            .into()),
        RECORD_VERSION => serde_json::from_slice(bytes).map_err(decode_err),
        version => Err(StoreError::Version {
            path: path.to_path_buf(),
            version,
        }),
    }
}

/// The largest record [`read_record`] reads: far above any record the plugin writes, and a
/// bound on what a planted one makes a node plugin hold.
pub const MAX_RECORD_BYTES: u64 = 1 << 20;

/// What [`read_record`] checks a record's directory for, as its errors name it.
pub const SHARED_DIR: csi_isolator::workdir::Purpose = csi_isolator::workdir::Purpose {
    what: "shared dir",
    flag: "--shared-dir",
};

/// The record in volume directory `dir` of another plugin's store (a node-mode plugin reads the
/// controller's, never writes it), read now from disk, as hostile: by the work dir's rule for a
/// file root wrote ([`csi_isolator::workdir::read_root_file`]: its directory and every one above
/// root's and not writable by others, the file opened without following a symbolic link or
/// blocking on a FIFO, a regular file of one name, at most [`MAX_RECORD_BYTES`]). A missing
/// record or directory is [`StoreError::Read`] of kind NotFound.
pub fn read_record(dir: &Path) -> Result<VolumeRecord, StoreError> {
    use csi_isolator::workdir::{read_root_file, FileRule, RootFileError, WorkDirError};
    let path = dir.join(RECORD_FILE);
    let bytes = read_root_file(&path, SHARED_DIR, FileRule::RootWritten, MAX_RECORD_BYTES)
        .map_err(|e| match e {
            RootFileError::Io { source, .. } if source.kind() == io::ErrorKind::NotFound => {
                StoreError::Read {
                    path: path.clone(),
                    source,
                }
            }
            RootFileError::Directory(d)
                if matches!(&*d, WorkDirError::Resolve { source, .. } if source.kind() == io::ErrorKind::NotFound) =>
            {
                StoreError::Read {
                    path: path.clone(),
                    source: io::ErrorKind::NotFound.into(),
                }
            }
            e => StoreError::Refused {
                path: path.clone(),
                source: Box::new(e),
            },
        })?;
    decode(&path, &bytes)
}

/// Fails unless the store takes volume `id` (see [`MAX_ID_LEN`]).
pub fn check_id(id: &str) -> Result<(), StoreError> {
    if id.len() > MAX_ID_LEN {
        return Err(StoreError::IdTooLong { len: id.len() });
    }
    Ok(())
}

/// Where a store's changes of a use go (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Writes {
    /// To the use journal (group commit), written back at compaction.
    Journaled,
    /// Each through to its record file: a controller whose files node plugins read.
    Through,
}

/// One entry of the use journal: a volume directory's record after a change, or its removal.
#[derive(Serialize, Deserialize)]
struct JournalEntry {
    /// [`JOURNAL_ENTRY_VERSION`].
    version: u32,
    /// The volume directory's name under `volumes/`.
    dir: String,
    /// The whole record after the change (any record version [`decode`] reads); `None`: the
    /// volume was removed.
    record: Option<serde_json::Value>,
}

/// The use journal of a store and what it holds.
#[derive(Debug)]
struct UseJournal {
    journal: Journal,
    /// Held shared by each change (its append, the in-memory copy's update and `dirty`'s),
    /// exclusively by compaction: what compaction writes back is all the journal holds.
    gate: RwLock<()>,
    /// The directories the journal holds entries of, with their volume's id.
    dirty: Mutex<HashMap<String, String>>,
}

/// The durable volume store, with an in-memory copy of every record.
#[derive(Debug)]
pub struct Store {
    root: PathBuf,
    records: Mutex<HashMap<String, VolumeRecord>>,
    /// Volumes an older build made, by id: their directory's name under an older encoding.
    older_names: Mutex<HashMap<String, OsString>>,
    /// `None`: every change is written through ([`Writes::Through`]).
    journal: Option<UseJournal>,
}

/// The latest entry of each directory in the journal's complete entries: its record, or `None`
/// when removed.
fn replay(
    path: &Path,
    entries: &[journal::Entry],
) -> Result<HashMap<OsString, Option<VolumeRecord>>, StoreError> {
    let mut latest = HashMap::new();
    for entry in entries {
        let bad = |reason: String| StoreError::JournalEntry {
            path: path.to_path_buf(),
            seq: entry.seq,
            reason,
        };
        let decoded: JournalEntry =
            serde_json::from_slice(&entry.payload).map_err(|e| bad(e.to_string()))?;
        if decoded.version != JOURNAL_ENTRY_VERSION {
            return Err(bad(format!("unsupported version {}", decoded.version)));
        }
        if matches!(decoded.dir.as_str(), "" | "." | "..") || decoded.dir.contains('/') {
            return Err(bad(format!(
                "{:?} is not a volume directory's name",
                decoded.dir
            )));
        }
        let record = match decoded.record {
            Some(value) => {
                let bytes = serde_json::to_vec(&value).expect("a JSON value serializes");
                let record = decode(path, &bytes).map_err(|e| bad(e.to_string()))?;
                if record.id.len() > MAX_ID_LEN {
                    return Err(bad(format!("volume id of {} bytes", record.id.len())));
                }
                Some(record)
            }
            None => None,
        };
        latest.insert(OsString::from(decoded.dir), record);
    }
    Ok(latest)
}

impl Store {
    /// Opens (creating if needed) the store under `work_dir`, deletes the leftovers of
    /// interrupted creates and removals, and loads every record: the journal's (see the module
    /// doc) over the files, written back (compaction) only when the journal is due, or with
    /// `writes` through (the journal then goes).
    pub fn open(work_dir: &Path, writes: Writes) -> Result<Store, StoreError> {
        let root = work_dir.join("volumes");
        super::backing::private_dir(&root)
            .and_then(|()| super::backing::close_dir(&root))
            .map_err(|source| StoreError::CreateDir {
                path: root.clone(),
                source,
            })?;
        // A controller writing through after a journaled run (the same work dir in another
        // mode) still replays, then empties, what that run journaled.
        let journal_path = work_dir.join(JOURNAL_FILE);
        let opened = match writes {
            Writes::Journaled => Some(Journal::open(&journal_path, PRIVATE_FILE_MODE, || {})?),
            Writes::Through if journal_path.exists() => {
                Some(Journal::open(&journal_path, PRIVATE_FILE_MODE, || {})?)
            }
            Writes::Through => None,
        };
        let mut journaled = match &opened {
            Some((_, parsed)) => replay(&journal_path, &parsed.entries)?,
            None => HashMap::new(),
        };
        let mut records = HashMap::new();
        let mut older_names = HashMap::new();
        let entries = fs::read_dir(&root).map_err(|source| StoreError::List {
            path: root.clone(),
            source,
        })?;
        for entry in entries {
            let entry = entry.map_err(|source| StoreError::List {
                path: root.clone(),
                source,
            })?;
            let dir = entry.path();
            let name = entry.file_name();
            if name.as_bytes().starts_with(TOMBSTONE_PREFIX.as_bytes()) {
                tracing::info!(path = %dir.display(), "deleting the rest of an interrupted volume removal");
                remove_dir(&dir)?;
                continue;
            }
            let path = dir.join(RECORD_FILE);
            let record = match journaled.remove(&name) {
                Some(Some(record)) => record,
                Some(None) => {
                    tracing::info!(path = %dir.display(), "deleting the rest of an interrupted volume removal (journaled)");
                    remove_dir(&dir)?;
                    continue;
                }
                None => {
                    let text = match fs::read(&path) {
                        Ok(text) => text,
                        Err(e) if e.kind() == io::ErrorKind::NotFound => {
                            // An interrupted create: storage nobody will ever reference.
                            tracing::info!(path = %dir.display(), "deleting the rest of an interrupted volume create");
                            remove_dir(&dir)?;
                            continue;
                        }
                        Err(source) => return Err(StoreError::Read { path, source }),
                    };
                    decode(&path, &text)?
                }
            };
            if name != OsStr::new(&encode_volume_id(&record.id)) {
                if name.as_bytes().starts_with(b".") {
                    tracing::info!(path = %dir.display(), "deleting the rest of an interrupted volume removal (older build)");
                    remove_dir(&dir)?;
                    continue;
                }
                older_names.insert(record.id.clone(), name);
            }
            records.insert(record.id.clone(), record);
        }
        // What is left of the journal names no directory: volumes removed since (a removal
        // renames the directory away after its entry).
        let journal = opened.map(|(journal, parsed)| {
            let mut dirty = HashMap::new();
            for entry in &parsed.entries {
                if let Ok(e) = serde_json::from_slice::<JournalEntry>(&entry.payload) {
                    let id = e.record.as_ref().and_then(|r| r.get("id")?.as_str());
                    dirty.insert(e.dir, id.unwrap_or_default().to_string());
                }
            }
            UseJournal {
                journal,
                gate: RwLock::new(()),
                dirty: Mutex::new(dirty),
            }
        });
        let store = Store {
            root,
            records: Mutex::new(records),
            older_names: Mutex::new(older_names),
            journal,
        };
        // Written back at open only when due (as after any append) or when the journal is to
        // go: a plugin restarted after thousands of launches would otherwise write back and sync
        // every record its journal holds before it answers (1.3 s at 10,000 volumes,
        // docs/benchmarks.md); the journal's entries stay the records' truth until then.
        let due = store
            .journal
            .as_ref()
            .is_some_and(|j| journal::due(j.journal.size(), COMPACT_ENTRIES, COMPACT_BYTES));
        if due || writes == Writes::Through {
            store.compact()?;
        }
        if writes == Writes::Through && store.journal.is_some() {
            // Emptied: gone, so that the files are the whole truth for node plugins again.
            durable::remove_file(&journal_path)
                .and_then(|()| durable::sync_dir(work_dir))
                .map_err(|e| StoreError::Write(IoStep::new("remove journal", &journal_path, e)))?;
            return Ok(Store {
                journal: None,
                ..store
            });
        }
        Ok(store)
    }

    /// The directory holding everything of volume `id`: `volumes/<enc id>`, or the name an
    /// older build gave it (see the module doc).
    pub fn volume_dir(&self, id: &str) -> PathBuf {
        let older = self.older_names.lock().unwrap_or_else(|p| p.into_inner());
        match older.get(id) {
            Some(name) => self.root.join(name),
            None => self.root.join(encode_volume_id(id)),
        }
    }

    /// The record of volume `id`, if it exists.
    pub fn get(&self, id: &str) -> Option<VolumeRecord> {
        self.lock().get(id).cloned()
    }

    /// The record of the volume named `name`, if one exists.
    pub fn find_by_name(&self, name: &str) -> Option<VolumeRecord> {
        self.lock().values().find(|r| r.name == name).cloned()
    }

    /// Every record, sorted by volume id.
    pub fn list(&self) -> Vec<VolumeRecord> {
        let mut all: Vec<VolumeRecord> = self.lock().values().cloned().collect();
        all.sort_by(|a, b| a.id.cmp(&b.id));
        all
    }

    /// `f` over every record, under the store's lock and without copying them (what a
    /// CreateVolume adds up over a thousand volumes must not clone them all).
    pub fn fold<T>(&self, init: T, f: impl FnMut(T, &VolumeRecord) -> T) -> T {
        self.lock().values().fold(init, f)
    }

    /// Durably writes `record` through to its file (atomically replacing any previous
    /// version; journaled first while the journal holds its directory), then updates the
    /// in-memory copy.
    pub fn save(&self, record: &VolumeRecord) -> Result<(), StoreError> {
        let _gate = self.shared();
        let dir = self.volume_dir(&record.id);
        super::backing::private_dir(&dir).map_err(|source| StoreError::CreateDir {
            path: dir.clone(),
            source,
        })?;
        if let Some(name) = self.journaled_name(&dir) {
            self.append(&name, &record.id, Some(record))?;
        }
        let path = dir.join(RECORD_FILE);
        let bytes = serde_json::to_vec_pretty(record).expect("a volume record always serializes");
        durable::write_atomic(&path, &bytes, PRIVATE_FILE_MODE)
            .map_err(|e| StoreError::Write(IoStep::new(e.step.as_str(), e.path, e.source)))?;
        self.lock().insert(record.id.clone(), record.clone());
        Ok(())
    }

    /// Durably records `record`, a known volume's change of use (a publish or stage, or its
    /// reverse), in the use journal, then updates the in-memory copy; its file is written at
    /// the next compaction. Written through ([`Store::save`]) without a journal, for a volume
    /// not known yet, or a directory name the journal cannot hold.
    pub fn save_use(&self, record: &VolumeRecord) -> Result<(), StoreError> {
        let Some(use_journal) = &self.journal else {
            return self.save(record);
        };
        let dir = self.volume_dir(&record.id);
        let name = dir.file_name().and_then(OsStr::to_str).map(str::to_string);
        let (Some(name), true) = (name, self.lock().contains_key(&record.id)) else {
            return self.save(record);
        };
        {
            let _gate = self.shared();
            self.append(&name, &record.id, Some(record))?;
            self.lock().insert(record.id.clone(), record.clone());
        }
        if journal::due(use_journal.journal.size(), COMPACT_ENTRIES, COMPACT_BYTES) {
            // The change is durable in the journal: a failed compaction leaves it there.
            if let Err(e) = self.compact_when(When::Due) {
                let e = csi_isolator::error_chain::full_message(&e);
                tracing::warn!(error = %e, "record journal: compaction failed, retried when due again");
            }
        }
        Ok(())
    }

    /// Removes volume `id`: journals the removal while the journal holds its directory, renames
    /// its directory (record included) to a tombstone and syncs that, so the record and the
    /// data go away together, then deletes the tombstone (which [`Store::open`] finishes after
    /// a crash).
    pub fn remove(&self, id: &str) -> Result<(), StoreError> {
        let _gate = self.shared();
        let dir = self.volume_dir(id);
        if let Some(name) = self.journaled_name(&dir) {
            self.append(&name, id, None)?;
        }
        let tombstone = rename_to_tombstone(&self.root, &dir, id)?;
        self.lock().remove(id);
        self.older_names
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
        remove_dir(&tombstone)
    }

    /// The gate, shared (see [`UseJournal::gate`]); `None` without a journal.
    fn shared(&self) -> Option<std::sync::RwLockReadGuard<'_, ()>> {
        let journal = self.journal.as_ref()?;
        // The gate guards no data: a panic while holding it leaves nothing half-done.
        Some(journal.gate.read().unwrap_or_else(|p| p.into_inner()))
    }

    /// The name of volume directory `dir` when the journal holds entries of it (the caller
    /// holds the gate).
    fn journaled_name(&self, dir: &Path) -> Option<String> {
        let use_journal = self.journal.as_ref()?;
        let name = dir.file_name()?.to_str()?;
        let dirty = use_journal.dirty.lock().unwrap_or_else(|p| p.into_inner());
        dirty.contains_key(name).then(|| name.to_string())
    }

    /// Appends directory `name`'s record of volume `id` (`None`: removed) to the journal and
    /// waits until it is durable (the caller holds the gate).
    fn append(
        &self,
        name: &str,
        id: &str,
        record: Option<&VolumeRecord>,
    ) -> Result<(), StoreError> {
        let use_journal = self.journal.as_ref().expect("called with a journal");
        let entry = JournalEntry {
            version: JOURNAL_ENTRY_VERSION,
            dir: name.to_string(),
            record: record
                .map(|r| serde_json::to_value(r).expect("a volume record always serializes")),
        };
        let payload = serde_json::to_vec(&entry).expect("an entry always serializes");
        use_journal.journal.append(&[&payload])?;
        use_journal
            .dirty
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(name.to_string(), id.to_string());
        Ok(())
    }

    /// Writes every record the journal holds back to its file, then empties the journal;
    /// nothing changes meanwhile (the gate). Without a journal, nothing to do.
    fn compact(&self) -> Result<(), StoreError> {
        self.compact_when(When::Always)
    }

    /// [`compact`](Self::compact) `when` it is wanted, judged once the gate is held: the changes
    /// that each saw the journal due after their append (a burst of them, returning from one
    /// batch) compact it once ([`When::Due`]), not once each.
    fn compact_when(&self, when: When) -> Result<(), StoreError> {
        let Some(use_journal) = &self.journal else {
            return Ok(());
        };
        let _gate = use_journal.gate.write().unwrap_or_else(|p| p.into_inner());
        let size = use_journal.journal.size();
        if !when.holds(size, COMPACT_ENTRIES, COMPACT_BYTES) {
            return Ok(());
        }
        let mut dirty = use_journal.dirty.lock().unwrap_or_else(|p| p.into_inner());
        let files: Vec<(PathBuf, Vec<u8>)> = {
            let records = self.lock();
            dirty
                .iter()
                .filter_map(|(name, id)| {
                    let record = records.get(id)?;
                    // A directory renamed since (not this volume's any more) is not written.
                    (self.volume_dir(id).file_name() == Some(OsStr::new(name))).then(|| {
                        let bytes = serde_json::to_vec_pretty(record)
                            .expect("a volume record always serializes");
                        (self.root.join(name).join(RECORD_FILE), bytes)
                    })
                })
                .collect()
        };
        // Each file written atomically (its own fsyncs, a few hundred at most once in thousands
        // of changes), not written back under one `syncfs`: that would wait for every dirty
        // page of the file system (container data, images), and a record file, which a create
        // promised whole, is never torn. Several at a time: every change waits for the gate
        // meanwhile, and one by one a few hundred files' syncs stalled a burst of launches for
        // a few hundred milliseconds.
        use_journal.journal.compact(|| {
            durable::write_atomic_each(&files, PRIVATE_FILE_MODE)
                .map_err(|e| StoreError::Write(IoStep::new(e.step.as_str(), e.path, e.source)))
        })?;
        dirty.clear();
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, VolumeRecord>> {
        // A panic while holding this lock cannot leave a half-updated map (every
        // mutation is a single insert/remove), so a poisoned lock is still consistent.
        self.records.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Version of the on-disk snapshot record format.
pub const SNAPSHOT_RECORD_VERSION: u32 = 1;

const SNAPSHOT_RECORD_FILE: &str = "snapshot.json";

/// The persisted state of one snapshot: a copy of its source volume's content, independent of
/// it (the volume may be deleted, the snapshot stays).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotRecord {
    /// Format version ([`SNAPSHOT_RECORD_VERSION`]).
    pub version: u32,
    /// The plugin-generated snapshot id.
    pub id: String,
    /// The CO-chosen name from CreateSnapshot.
    pub name: String,
    /// The volume it was cut from.
    pub source_volume_id: String,
    /// The source volume's capacity when it was cut: the least a volume made from it gets.
    pub size_bytes: u64,
    /// When it was cut: seconds and nanoseconds since the Unix epoch.
    pub creation_secs: i64,
    /// See `creation_secs`.
    pub creation_nanos: i32,
    /// A copy of a block volume (a raw image).
    pub block: bool,
    /// The source volume's `volume_context` (its backing and fs type), given to the volumes
    /// made from it.
    pub volume_context: BTreeMap<String, String>,
}

/// The durable snapshot store: `snapshots/<enc id>/snapshot.json` beside the copy (`data/`,
/// `image.ext4` or `image.raw`, the layout of a volume's directory), written like volume
/// records: the copy first, then the record atomically; removal through a tombstone. Opening
/// it deletes the leftovers of interrupted creates and removals.
#[derive(Debug)]
pub struct SnapshotStore {
    root: PathBuf,
    records: Mutex<HashMap<String, SnapshotRecord>>,
}

impl SnapshotStore {
    /// Opens (creating if needed) the store under `work_dir` and loads every record.
    pub fn open(work_dir: &Path) -> Result<SnapshotStore, StoreError> {
        let root = work_dir.join("snapshots");
        super::backing::private_dir(&root)
            .and_then(|()| super::backing::close_dir(&root))
            .map_err(|source| StoreError::CreateDir {
                path: root.clone(),
                source,
            })?;
        let list_err = |source| StoreError::List {
            path: root.clone(),
            source,
        };
        let mut records = HashMap::new();
        for entry in fs::read_dir(&root).map_err(list_err)? {
            let dir = entry.map_err(list_err)?.path();
            let path = dir.join(SNAPSHOT_RECORD_FILE);
            let is_tombstone = dir
                .file_name()
                .is_some_and(|n| n.as_bytes().starts_with(TOMBSTONE_PREFIX.as_bytes()));
            let text = match fs::read(&path) {
                Ok(text) if !is_tombstone => text,
                Ok(_) => {
                    tracing::info!(path = %dir.display(), "deleting the rest of an interrupted snapshot removal");
                    remove_dir(&dir)?;
                    continue;
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    tracing::info!(path = %dir.display(), "deleting the rest of an interrupted snapshot create or removal");
                    remove_dir(&dir)?;
                    continue;
                }
                Err(source) => return Err(StoreError::Read { path, source }),
            };
            let record: SnapshotRecord =
                serde_json::from_slice(&text).map_err(|source| StoreError::Decode {
                    path: path.clone(),
                    source,
                })?;
            if record.version != SNAPSHOT_RECORD_VERSION {
                return Err(StoreError::Version {
                    path,
                    version: record.version,
                });
            }
            records.insert(record.id.clone(), record);
        }
        Ok(SnapshotStore {
            root,
            records: Mutex::new(records),
        })
    }

    /// The directory holding snapshot `id`'s record and copy.
    pub fn snapshot_dir(&self, id: &str) -> PathBuf {
        self.root.join(encode_volume_id(id))
    }

    /// The record of snapshot `id`, if it exists.
    pub fn get(&self, id: &str) -> Option<SnapshotRecord> {
        self.lock().get(id).cloned()
    }

    /// The record of the snapshot named `name`, if one exists.
    pub fn find_by_name(&self, name: &str) -> Option<SnapshotRecord> {
        self.lock().values().find(|r| r.name == name).cloned()
    }

    /// Every record, sorted by snapshot id.
    pub fn list(&self) -> Vec<SnapshotRecord> {
        let mut all: Vec<SnapshotRecord> = self.lock().values().cloned().collect();
        all.sort_by(|a, b| a.id.cmp(&b.id));
        all
    }

    /// Durably writes `record` beside its copy, then updates the in-memory copy.
    pub fn save(&self, record: &SnapshotRecord) -> Result<(), StoreError> {
        let path = self.snapshot_dir(&record.id).join(SNAPSHOT_RECORD_FILE);
        let bytes = serde_json::to_vec_pretty(record).expect("a snapshot record always serializes");
        durable::write_atomic(&path, &bytes, PRIVATE_FILE_MODE)
            .map_err(|e| StoreError::Write(IoStep::new(e.step.as_str(), e.path, e.source)))?;
        self.lock().insert(record.id.clone(), record.clone());
        Ok(())
    }

    /// Removes snapshot `id` (record and copy together, through a tombstone).
    pub fn remove(&self, id: &str) -> Result<(), StoreError> {
        let tombstone = rename_to_tombstone(&self.root, &self.snapshot_dir(id), id)?;
        self.lock().remove(id);
        remove_dir(&tombstone)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, SnapshotRecord>> {
        // Every mutation is a single insert/remove: a poisoned map is still consistent.
        self.records.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Renames `dir` (an entry of `root`, holding the record of `id` and its data) to its
/// tombstone and syncs `root`, which drops the record and the data at once; returns the
/// tombstone, for the caller to delete. A missing `dir` is fine.
fn rename_to_tombstone(root: &Path, dir: &Path, id: &str) -> Result<PathBuf, StoreError> {
    let tombstone = root.join(format!("{TOMBSTONE_PREFIX}{}", encode_volume_id(id)));
    // A tombstone left by an earlier, interrupted removal of the same id.
    remove_dir(&tombstone)?;
    match durable::rename(dir, &tombstone) {
        Ok(()) => durable::sync_dir(root)
            .map_err(|e| StoreError::Write(IoStep::new("fsync directory", root, e)))?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(source) => {
            return Err(StoreError::Write(IoStep::new(
                "rename to tombstone",
                dir,
                source,
            )))
        }
    }
    Ok(tombstone)
}

/// Deletes a directory tree; a missing one is fine.
fn remove_dir(dir: &Path) -> Result<(), StoreError> {
    match fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(StoreError::Remove {
            path: dir.to_path_buf(),
            source,
        }),
    }
}

/// The `volume_context` key recording a loop volume's fs type (made at CreateVolume).
pub const FS_TYPE_KEY: &str = "fs_type";

/// The fs type of a volume: recorded at CreateVolume for the loop backing (ext4 for volumes
/// made before it was recorded); none for the dir backing.
pub fn volume_fs_type(record: &VolumeRecord, kind: BackingKind) -> String {
    match kind {
        BackingKind::Dir => String::new(),
        BackingKind::Loop => record
            .volume_context
            .get(FS_TYPE_KEY)
            .cloned()
            .unwrap_or_else(|| super::backing::DEFAULT_FS_TYPE.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn record(id: &str, name: &str) -> VolumeRecord {
        VolumeRecord {
            version: RECORD_VERSION,
            id: id.into(),
            name: name.into(),
            capacity_bytes: 1024,
            parameters: BTreeMap::new(),
            volume_context: BTreeMap::new(),
            published_nodes: BTreeMap::from([(
                "n1".to_string(),
                ControllerPublication {
                    readonly: true,
                    capability: Some(capability()),
                },
            )]),
            staged: BTreeMap::from([("/staging".to_string(), capability())]),
            published: BTreeMap::new(),
            content_source: None,
            mutable_parameters: BTreeMap::new(),
            location: None,
        }
    }

    fn capability() -> CapabilityRecord {
        CapabilityRecord {
            access_mode: 1,
            fs_type: "ext4".into(),
            mount_flags: vec!["ro".into()],
            block: false,
        }
    }

    /// A store an older build wrote (its own encoder: `%2E` for a leading dot, tombstones
    /// `.deleted-<enc id>`) is read after an upgrade: each volume keeps its directory and
    /// data, an old tombstone is finished, and volumes made now get the provider's encoding,
    /// even those whose name begins with `.deleted-`.
    #[test]
    fn an_older_builds_names_are_still_read() {
        let dir = tempfile::tempdir().unwrap();
        let volumes = dir.path().join("volumes");
        let old = |name: &str, id: &str| {
            let vol = volumes.join(name);
            fs::create_dir_all(vol.join("data")).unwrap();
            fs::write(vol.join("data/f"), id.as_bytes()).unwrap();
            let text = serde_json::to_vec(&record(id, &format!("name of {id}"))).unwrap();
            fs::write(vol.join(RECORD_FILE), text).unwrap();
        };
        // The names the older encoder gave; "a%2Fb" is also today's.
        old("%2Ehidden", ".hidden");
        old("%2E.", "..");
        old("a%2Fb", "a/b");
        old(".deleted-vol-9", "vol-9");
        let long = "/".repeat(300);
        {
            let store = Store::open(dir.path(), Writes::Journaled).unwrap();
            store.save(&record(".deleted-x", "new")).unwrap();
            store.save(&record(&long, "long")).unwrap();
        }
        let store = Store::open(dir.path(), Writes::Journaled).unwrap();
        let ids: Vec<String> = store.list().into_iter().map(|r| r.id).collect();
        assert_eq!(ids, ["..", ".deleted-x", ".hidden", long.as_str(), "a/b"]);
        for (id, name) in [(".hidden", "%2Ehidden"), ("..", "%2E."), ("a/b", "a%2Fb")] {
            let vol = store.volume_dir(id);
            assert_eq!(vol, volumes.join(name), "{id}");
            assert_eq!(fs::read(vol.join("data/f")).unwrap(), id.as_bytes());
        }
        assert_eq!(store.volume_dir(".deleted-x"), volumes.join(".deleted-x"));
        assert_eq!(
            store.volume_dir(&long),
            volumes.join(encode_volume_id(&long))
        );
        let mut names: Vec<String> = fs::read_dir(&volumes)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        let mut want = vec![
            ".deleted-x".to_string(),
            "%2E.".into(),
            "%2Ehidden".into(),
            "a%2Fb".into(),
            encode_volume_id(&long),
        ];
        want.sort();
        assert_eq!(names, want, "the older tombstone is deleted, nothing else");

        // A change is written where the volume is; a removal takes that directory.
        let mut changed = store.get(".hidden").unwrap();
        changed.capacity_bytes = 4096;
        store.save(&changed).unwrap();
        let record_file = volumes.join("%2Ehidden").join(RECORD_FILE);
        assert_eq!(
            fs::metadata(&record_file).unwrap().permissions().mode() & 0o7777,
            0o600
        );
        assert_eq!(
            Store::open(dir.path(), Writes::Journaled)
                .unwrap()
                .get(".hidden")
                .unwrap(),
            changed
        );
        store.remove(".hidden").unwrap();
        assert!(!volumes.join("%2Ehidden").exists());
        assert!(!volumes.join(".hidden").exists());
        assert!(Store::open(dir.path(), Writes::Journaled)
            .unwrap()
            .get(".hidden")
            .is_none());
        // No encoded id can be taken for a tombstone.
        assert_eq!(encode_volume_id("+deleted-x"), "%2Bdeleted-x");
    }

    #[test]
    fn ids_over_the_limit_are_refused() {
        check_id(&"/".repeat(MAX_ID_LEN)).unwrap();
        check_id(&format!("{}{:016x}", "a".repeat(200), 7u64)).unwrap();
        let err = check_id(&"/".repeat(4096)).unwrap_err().to_string();
        assert!(err.contains("4096 bytes") && err.contains("255"), "{err}");
        assert!(check_id(&"a".repeat(MAX_ID_LEN + 1)).is_err());
    }

    #[test]
    fn records_survive_reopen_and_removal_is_durable() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), Writes::Journaled).unwrap();
        store.save(&record("vol-1", "one")).unwrap();
        store.save(&record("vol-2", "two")).unwrap();
        // An interrupted create: a directory without a record.
        fs::create_dir_all(store.volume_dir("vol-3").join("data")).unwrap();
        fs::write(store.volume_dir("vol-3").join("data/f"), b"x").unwrap();
        // An interrupted removal: the tombstone was made, its deletion did not finish.
        fs::create_dir_all(dir.path().join("volumes/.deleted-vol-4/data")).unwrap();
        let reopened = Store::open(dir.path(), Writes::Journaled).unwrap();
        assert_eq!(
            reopened.list(),
            vec![record("vol-1", "one"), record("vol-2", "two")]
        );
        let mut left: Vec<String> = fs::read_dir(dir.path().join("volumes"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, ["vol-1", "vol-2"], "leftovers are deleted at open");
        assert_eq!(reopened.find_by_name("two").unwrap().id, "vol-2");
        assert_eq!(reopened.fold(0, |sum, r| sum + r.capacity_bytes), 2048);
        reopened.remove("vol-1").unwrap();
        reopened.remove("vol-1").unwrap();
        assert!(!reopened.volume_dir("vol-1").exists());
        assert_eq!(
            Store::open(dir.path(), Writes::Journaled).unwrap().list(),
            vec![record("vol-2", "two")]
        );
    }

    /// Sets the immutable attribute on a directory (so even root cannot delete its entries)
    /// and clears it again when dropped, pass or fail, wherever the directory was moved to
    /// among the given paths.
    struct Immutable(Vec<PathBuf>);

    impl Immutable {
        fn set(path: PathBuf, moved_to: PathBuf) -> Immutable {
            let status = std::process::Command::new("chattr")
                .arg("+i")
                .arg(&path)
                .status()
                .expect("run chattr");
            assert!(status.success(), "chattr +i {}", path.display());
            Immutable(vec![path, moved_to])
        }

        fn clear(&self) {
            for path in self.0.iter().filter(|p| p.exists()) {
                let _ = std::process::Command::new("chattr")
                    .arg("-i")
                    .arg(path)
                    .status();
            }
        }
    }

    impl Drop for Immutable {
        fn drop(&mut self) {
            self.clear();
        }
    }

    #[test]
    fn removal_renames_the_directory_away_before_dropping_the_record() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), Writes::Journaled).unwrap();
        store.save(&record("vol-1", "one")).unwrap();
        let locked = store.volume_dir("vol-1").join("data/locked");
        fs::create_dir_all(locked.join("inner")).unwrap();
        let tombstone = dir.path().join(format!("volumes/{TOMBSTONE_PREFIX}vol-1"));
        // The final deletion fails halfway (an immutable subdirectory): by then the record
        // is gone and the directory is a tombstone, never a record without its data.
        let guard = Immutable::set(locked, tombstone.join("data/locked"));
        let result = store.remove("vol-1");
        assert!(
            matches!(result, Err(StoreError::Remove { .. })),
            "{result:?}"
        );
        assert!(!store.volume_dir("vol-1").exists(), "renamed away first");
        assert!(store.get("vol-1").is_none());
        assert!(tombstone.exists());
        assert!(
            Store::open(dir.path(), Writes::Journaled).is_err(),
            "the tombstone is still undeletable"
        );
        guard.clear();
        assert!(Store::open(dir.path(), Writes::Journaled)
            .unwrap()
            .list()
            .is_empty());
        assert!(!tombstone.exists(), "open finishes the removal");
    }

    #[test]
    fn reads_version_1_records() {
        let dir = tempfile::tempdir().unwrap();
        let vol = dir.path().join("volumes/vol-1");
        fs::create_dir_all(&vol).unwrap();
        fs::write(
            vol.join(RECORD_FILE),
            r#"{"version":1,"id":"vol-1","name":"one","capacity_bytes":1024,
               "parameters":{},"volume_context":{},"published_nodes":{"n1":true}}"#,
        )
        .unwrap();
        let store = Store::open(dir.path(), Writes::Journaled).unwrap();
        let r = store.get("vol-1").unwrap();
        assert_eq!(r.version, RECORD_VERSION);
        assert_eq!(
            r.published_nodes["n1"],
            ControllerPublication {
                readonly: true,
                capability: None
            }
        );
        store.save(&r).unwrap();
        assert_eq!(
            Store::open(dir.path(), Writes::Journaled)
                .unwrap()
                .get("vol-1")
                .unwrap(),
            r
        );
    }

    /// The changes of a use go to the journal, not the record file, and are read back from
    /// it at open (then written back: the journal is emptied); a removal journaled among them
    /// keeps an earlier entry off a volume made again under the same name; a record file torn
    /// by a write-back is not read while the journal holds its directory.
    #[test]
    fn uses_are_journaled_and_replayed_over_the_files() {
        let dir = tempfile::tempdir().unwrap();
        let file = |id: &str| dir.path().join("volumes").join(id).join(RECORD_FILE);
        let journal_entries = || {
            journal::read(&dir.path().join(JOURNAL_FILE))
                .unwrap()
                .map_or(0, |(parsed, _)| parsed.entries.len())
        };
        let mut used = record("vol-1", "one");
        {
            let store = Store::open(dir.path(), Writes::Journaled).unwrap();
            store.save(&record("vol-1", "one")).unwrap();
            store.save(&record("vol-2", "two")).unwrap();
            assert_eq!(journal_entries(), 0, "creates are written through");
            used.published.insert("/target".into(), capability());
            store.save_use(&used).unwrap();
            store.save_use(&record("vol-2", "two again")).unwrap();
            assert_eq!(journal_entries(), 2);
            assert_eq!(
                serde_json::from_slice::<VolumeRecord>(&fs::read(file("vol-1")).unwrap()).unwrap(),
                record("vol-1", "one"),
                "the file lags the journal"
            );
            // vol-2 removed and made again: the entry before the removal must not win.
            store.remove("vol-2").unwrap();
            store.save(&record("vol-2", "new two")).unwrap();
            assert_eq!(
                journal_entries(),
                4,
                "the removal and the new create are journaled"
            );
        }
        // The journal's record wins over the file's, even one that does not decode; a journal
        // that is not due is not written back at open (a restart after thousands of launches
        // answers at once), and the next open finds the same.
        fs::write(file("vol-1"), b"{\"vers").unwrap();
        for _ in 0..2 {
            let store = Store::open(dir.path(), Writes::Journaled).unwrap();
            assert_eq!(store.get("vol-1").unwrap(), used);
            assert_eq!(store.get("vol-2").unwrap(), record("vol-2", "new two"));
            assert_eq!(journal_entries(), 4, "not written back at open: not due");
            assert_eq!(fs::read(file("vol-1")).unwrap(), b"{\"vers");
        }
        // Until a compaction, which writes the journal's records back.
        let store = Store::open(dir.path(), Writes::Journaled).unwrap();
        store.compact().unwrap();
        assert_eq!(journal_entries(), 0);
        assert_eq!(
            serde_json::from_slice::<VolumeRecord>(&fs::read(file("vol-1")).unwrap()).unwrap(),
            used,
            "written back"
        );
        // A controller writes through: it replays what a journaled run left, then drops the
        // journal, and its files are current after each change.
        used.published.clear();
        store.save_use(&used).unwrap();
        drop(store);
        let store = Store::open(dir.path(), Writes::Through).unwrap();
        assert!(!dir.path().join(JOURNAL_FILE).exists());
        assert_eq!(store.get("vol-1").unwrap(), used);
        used.capacity_bytes = 4096;
        store.save_use(&used).unwrap();
        assert_eq!(
            serde_json::from_slice::<VolumeRecord>(&fs::read(file("vol-1")).unwrap()).unwrap(),
            used
        );
    }

    /// An entry this build cannot read is refused with what to do, not skipped.
    #[test]
    fn a_journal_entry_of_an_unknown_version_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        {
            let store = Store::open(dir.path(), Writes::Journaled).unwrap();
            store.save(&record("vol-1", "one")).unwrap();
            let (journal, _) = Journal::open(&dir.path().join(JOURNAL_FILE), 0o600, || {}).unwrap();
            journal
                .append(&[br#"{"version":9,"dir":"vol-1","record":null}"#])
                .unwrap();
        }
        let err = Store::open(dir.path(), Writes::Journaled).unwrap_err();
        let text = csi_isolator::error_chain::full_message(&err);
        assert!(
            text.contains("unsupported version 9") && text.contains("move the journal aside"),
            "{text}"
        );
    }

    /// Power loss (the method of `tests/power_loss.rs`): a run of the store recorded at the
    /// durable seam (uses journaled, a removal and a create again under the same name, a
    /// compaction, changes written through while the journal holds their directory); every
    /// state a power cut after each operation could leave keeps the seam's promises, opens,
    /// and holds for each volume the last change that returned (or the one in flight).
    #[test]
    fn a_power_cut_loses_no_change_that_returned() {
        use csi_isolator::durable::record;
        use csi_isolator_testing::powerloss::{
            check_promises, crash_states, materialize, read_log, scan, Op,
        };

        let dir = tempfile::tempdir().unwrap();
        let work = dir.path().join("w");
        fs::create_dir(&work).unwrap();
        let log = dir.path().join("ops.jsonl");
        let store = Store::open(&work, Writes::Journaled).unwrap();
        let mut a = record("a", "a");
        let mut b = record("b", "b");
        store.save(&a).unwrap();
        store.save(&b).unwrap();
        // More volumes, so that the compaction writes several record files at a time
        // (`durable::write_atomic_each`: a thread each, up to its limit).
        let others: Vec<String> = (0..3).map(|i| format!("c{i}")).collect();
        for id in &others {
            store.save(&record(id, id)).unwrap();
        }
        let base = scan(&work);
        let ours = |op: &Op| op.paths().iter().all(|p| p.starts_with(&work));
        record::record_to(&log).unwrap();
        let point = || {
            read_log(&log)
                .unwrap()
                .into_iter()
                .filter(|op| ours(op))
                .count()
        };
        // (the point at which the change returned, the volume, its record after it)
        let mut history: Vec<(usize, &str, Option<VolumeRecord>)> = Vec::new();
        a.staged.insert("/s".into(), capability());
        store.save_use(&a).unwrap();
        history.push((point(), "a", Some(a.clone())));
        b.published.insert("/t".into(), capability());
        store.save_use(&b).unwrap();
        history.push((point(), "b", Some(b.clone())));
        store.remove("b").unwrap();
        history.push((point(), "b", None));
        // Made again as CreateVolume does: its directory durable first.
        let b_dir = store.volume_dir("b");
        durable::create_dir(&b_dir).unwrap();
        durable::sync_dir(&store.root).unwrap();
        let b2 = record("b", "b made again");
        store.save(&b2).unwrap();
        history.push((point(), "b", Some(b2.clone())));
        a.published.insert("/t".into(), capability());
        store.save_use(&a).unwrap();
        history.push((point(), "a", Some(a.clone())));
        for id in &others {
            let mut c = record(id, id);
            c.staged.insert("/s".into(), capability());
            store.save_use(&c).unwrap();
            history.push((point(), id, Some(c)));
        }
        store.compact().unwrap();
        a.staged.clear();
        store.save_use(&a).unwrap();
        history.push((point(), "a", Some(a.clone())));
        a.capacity_bytes = 8192;
        store.save(&a).unwrap();
        history.push((point(), "a", Some(a.clone())));
        drop(store);
        record::stop_recording();
        let ops: Vec<Op> = read_log(&log)
            .unwrap()
            .into_iter()
            .filter(|op| ours(op))
            .collect();
        assert_eq!(point(), ops.len());

        let states = crash_states(&base, &ops);
        let initial: Vec<(&str, VolumeRecord)> = [("a", record("a", "a")), ("b", record("b", "b"))]
            .into_iter()
            .chain(others.iter().map(|id| (id.as_str(), record(id, id))))
            .collect();
        for state in &states {
            let lost = check_promises(&ops, state);
            assert!(lost.is_empty(), "{}", lost[0]);
            materialize(&state.tree, &work).unwrap();
            let store = Store::open(&work, Writes::Journaled)
                .unwrap_or_else(|e| panic!("cut after op {}: {e:?}", state.point));
            // The changes run one after another: the first not returned at the cut is in flight.
            let in_flight = history.iter().find(|(at, _, _)| *at > state.point);
            for (id, first) in &initial {
                let returned = history
                    .iter()
                    .rfind(|(at, v, _)| *at <= state.point && v == id)
                    .map_or(Some(first.clone()), |(_, _, r)| r.clone());
                let got = store.get(id);
                let flying = in_flight
                    .filter(|(_, v, _)| v == id)
                    .map(|(_, _, r)| r.clone());
                assert!(
                    got == returned || Some(&got) == flying.as_ref(),
                    "cut after op {} of {}: volume {id} is {got:?}, the last change returned left {returned:?}",
                    state.point,
                    ops.len()
                );
            }
        }
        eprintln!(
            "plugin store: {} crash states checked, each opened, no returned change lost",
            states.len()
        );
    }

    #[test]
    fn refuses_unknown_versions() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), Writes::Journaled).unwrap();
        let mut r = record("vol-1", "one");
        r.version = 99;
        store.save(&r).unwrap();
        assert!(matches!(
            Store::open(dir.path(), Writes::Journaled),
            Err(StoreError::Version { version: 99, .. })
        ));
    }
}
