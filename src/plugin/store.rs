//! Durable per-volume metadata of the test plugin.
//!
//! Layout under the plugin's work dir:
//! `volumes/<enc id>/volume.json` (the record), next to the volume's backing (`data/` or
//! `image.ext4`). A record is written atomically (temp file, fsync, rename, fsync of the
//! directory), and only after the backing exists, so a crash mid-create leaves a directory
//! without a record. Removal first renames the volume's directory to a tombstone
//! (`volumes/.deleted-<enc id>`, a name no encoded id can take), which drops the record
//! atomically, then deletes the tombstone. Opening the store deletes both kinds of leftovers
//! (directories without a record, tombstones), so no crash leaks a volume's storage.
//! Lookups by name scan the records: the records are the only source of truth, so there is
//! no index to disagree with them.
//!
//! Format history: version 1 kept only the readonly flag per controller-published node;
//! version 2 adds the volume capability of each controller publish, staging path and target
//! (a repeated call with another capability is refused). Version 1 records are read and
//! rewritten as version 2 on their next change.

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

/// Version of the on-disk record format.
pub const RECORD_VERSION: u32 = 2;

const RECORD_FILE: &str = "volume.json";

/// Prefix of a volume directory being removed.
const TOMBSTONE_PREFIX: &str = ".deleted-";

/// The longest encoded id the store can hold: its tombstone name
/// (`.deleted-<enc id>`) must still fit a file name (NAME_MAX, 255 bytes).
pub const MAX_ENCODED_ID: usize = 255 - TOMBSTONE_PREFIX.len();

/// Errors of the metadata store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Creating a directory of the store failed.
    #[error("create store directory {path}: {source}")]
    CreateDir {
        /// The directory.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// Listing the volumes directory failed.
    #[error("list volume records in {path}: {source}")]
    List {
        /// The directory.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// Reading a record failed.
    #[error("read volume record {path}: {source}")]
    Read {
        /// The record file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A record could not be decoded.
    #[error("decode volume record {path}: {source}")]
    Decode {
        /// The record file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: serde_json::Error,
    },
    /// A record has a format version this build does not know.
    #[error("volume record {path} has unsupported version {version}")]
    Version {
        /// The record file.
        path: PathBuf,
        /// The version found.
        version: u32,
    },
    /// Writing a record (any step of the atomic write) failed.
    #[error("write volume record {path} ({step}): {source}")]
    Write {
        /// The record file.
        path: PathBuf,
        /// Which step of the atomic write failed.
        step: &'static str,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A volume id whose encoding does not fit a file name (an id the
    /// plugin was told to make with an over-long `--id-prefix`).
    #[error("volume id of {len} bytes is too long for the store: its directory name would take {encoded} bytes (at most {MAX_ENCODED_ID})")]
    IdTooLong {
        /// The id's length in bytes.
        len: usize,
        /// The length of its encoding.
        encoded: usize,
    },
    /// Removing a volume's directory failed.
    #[error("remove volume directory {path}: {source}")]
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

/// Percent-encodes an id so that it is a single safe path component: bytes outside
/// `[A-Za-z0-9_-]` (and `.`, except in the first position, so no `.`/`..`) become `%XX`.
pub fn encode_id(id: &str) -> String {
    let mut out = String::with_capacity(id.len());
    for (i, b) in id.bytes().enumerate() {
        let keep = b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || (b == b'.' && i > 0);
        if keep {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Fails unless the store can hold volume `id` (see [`MAX_ENCODED_ID`]).
pub fn check_id(id: &str) -> Result<(), StoreError> {
    let encoded = encode_id(id).len();
    if encoded > MAX_ENCODED_ID {
        return Err(StoreError::IdTooLong {
            len: id.len(),
            encoded,
        });
    }
    Ok(())
}

/// The durable volume store, with an in-memory copy of every record.
#[derive(Debug)]
pub struct Store {
    root: PathBuf,
    records: Mutex<HashMap<String, VolumeRecord>>,
}

impl Store {
    /// Opens (creating if needed) the store under `work_dir`, deletes the leftovers of
    /// interrupted creates and removals, and loads every record.
    pub fn open(work_dir: &Path) -> Result<Store, StoreError> {
        let root = work_dir.join("volumes");
        super::backing::private_dir(&root)
            .and_then(|()| super::backing::close_dir(&root))
            .map_err(|source| StoreError::CreateDir {
                path: root.clone(),
                source,
            })?;
        let mut records = HashMap::new();
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
            if entry
                .file_name()
                .to_string_lossy()
                .starts_with(TOMBSTONE_PREFIX)
            {
                tracing::info!(path = %dir.display(), "deleting the rest of an interrupted volume removal");
                remove_dir(&dir)?;
                continue;
            }
            let path = dir.join(RECORD_FILE);
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
            let record = decode(&path, &text)?;
            records.insert(record.id.clone(), record);
        }
        Ok(Store {
            root,
            records: Mutex::new(records),
        })
    }

    /// The directory holding everything of volume `id`.
    pub fn volume_dir(&self, id: &str) -> PathBuf {
        self.root.join(encode_id(id))
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

    /// Sum of the capacity of every volume.
    pub fn used_bytes(&self) -> u64 {
        self.lock().values().map(|r| r.capacity_bytes).sum()
    }

    /// Durably writes `record` (atomically replacing any previous version), then updates
    /// the in-memory copy.
    pub fn save(&self, record: &VolumeRecord) -> Result<(), StoreError> {
        let dir = self.volume_dir(&record.id);
        super::backing::private_dir(&dir).map_err(|source| StoreError::CreateDir {
            path: dir.clone(),
            source,
        })?;
        let path = dir.join(RECORD_FILE);
        let bytes = serde_json::to_vec_pretty(record).expect("a volume record always serializes");
        write_atomically(&path, &bytes)?;
        self.lock().insert(record.id.clone(), record.clone());
        Ok(())
    }

    /// Removes volume `id`: renames its directory (record included) to a tombstone and
    /// syncs that, so the record and the data go away together, then deletes the tombstone
    /// (which [`Store::open`] finishes after a crash).
    pub fn remove(&self, id: &str) -> Result<(), StoreError> {
        let dir = self.volume_dir(id);
        let tombstone = self
            .root
            .join(format!("{TOMBSTONE_PREFIX}{}", encode_id(id)));
        // A tombstone left by an earlier, interrupted removal of the same id.
        remove_dir(&tombstone)?;
        match fs::rename(&dir, &tombstone) {
            Ok(()) => sync_dir(&self.root, &dir)?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(source) => {
                return Err(StoreError::Write {
                    path: dir,
                    step: "rename to tombstone",
                    source,
                })
            }
        }
        self.lock().remove(id);
        remove_dir(&tombstone)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, VolumeRecord>> {
        // A panic while holding this lock cannot leave a half-updated map (every
        // mutation is a single insert/remove), so a poisoned lock is still consistent.
        self.records.lock().unwrap_or_else(|p| p.into_inner())
    }
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

/// Writes `bytes` to `path` atomically: temp file in the same directory, fsync, rename,
/// fsync of the directory.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), StoreError> {
    let err = |step: &'static str| {
        let path = path.to_path_buf();
        move |source| StoreError::Write { path, step, source }
    };
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    let mut file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(&tmp)
        .map_err(err("create temp file"))?;
    file.write_all(bytes).map_err(err("write temp file"))?;
    file.sync_all().map_err(err("fsync temp file"))?;
    drop(file);
    fs::rename(&tmp, path).map_err(err("rename"))?;
    sync_dir(dir, path)
}

fn sync_dir(dir: &Path, path: &Path) -> Result<(), StoreError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|source| StoreError::Write {
            path: path.to_path_buf(),
            step: "fsync directory",
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

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
        }
    }

    fn capability() -> CapabilityRecord {
        CapabilityRecord {
            access_mode: 1,
            fs_type: "ext4".into(),
            mount_flags: vec!["ro".into()],
        }
    }

    #[test]
    fn ids_too_long_for_a_file_name_are_refused() {
        check_id(&"a".repeat(MAX_ENCODED_ID)).unwrap();
        check_id(&format!("{}{:016x}", "a".repeat(200), 7u64)).unwrap();
        let err = check_id(&"/".repeat(4096)).unwrap_err().to_string();
        assert!(
            err.contains("4096 bytes") && err.contains("12288 bytes"),
            "{err}"
        );
        assert!(check_id(&"a".repeat(MAX_ENCODED_ID + 1)).is_err());
    }

    #[test]
    fn encodes_ids_into_safe_components() {
        assert_eq!(encode_id("vol-0123abcd"), "vol-0123abcd");
        assert_eq!(encode_id("../x"), "%2E.%2Fx");
        assert_eq!(encode_id(".."), "%2E.");
        assert_eq!(encode_id("a/b"), "a%2Fb");
        assert_eq!(encode_id(".hidden"), "%2Ehidden");
        assert_eq!(encode_id("a.b"), "a.b");
    }

    #[test]
    fn records_survive_reopen_and_removal_is_durable() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        store.save(&record("vol-1", "one")).unwrap();
        store.save(&record("vol-2", "two")).unwrap();
        // An interrupted create: a directory without a record.
        fs::create_dir_all(store.volume_dir("vol-3").join("data")).unwrap();
        fs::write(store.volume_dir("vol-3").join("data/f"), b"x").unwrap();
        // An interrupted removal: the tombstone was made, its deletion did not finish.
        fs::create_dir_all(dir.path().join("volumes/.deleted-vol-4/data")).unwrap();
        let reopened = Store::open(dir.path()).unwrap();
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
        assert_eq!(reopened.used_bytes(), 2048);
        reopened.remove("vol-1").unwrap();
        reopened.remove("vol-1").unwrap();
        assert!(!reopened.volume_dir("vol-1").exists());
        assert_eq!(
            Store::open(dir.path()).unwrap().list(),
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
        let store = Store::open(dir.path()).unwrap();
        store.save(&record("vol-1", "one")).unwrap();
        let locked = store.volume_dir("vol-1").join("data/locked");
        fs::create_dir_all(locked.join("inner")).unwrap();
        let tombstone = dir.path().join("volumes/.deleted-vol-1");
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
            Store::open(dir.path()).is_err(),
            "the tombstone is still undeletable"
        );
        guard.clear();
        assert!(Store::open(dir.path()).unwrap().list().is_empty());
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
        let store = Store::open(dir.path()).unwrap();
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
        assert_eq!(Store::open(dir.path()).unwrap().get("vol-1").unwrap(), r);
    }

    #[test]
    fn refuses_unknown_versions() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let mut r = record("vol-1", "one");
        r.version = 99;
        store.save(&r).unwrap();
        assert!(matches!(
            Store::open(dir.path()),
            Err(StoreError::Version { version: 99, .. })
        ));
    }
}
