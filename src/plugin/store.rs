//! Durable per-volume metadata of the test plugin.
//!
//! Layout under the plugin's work dir:
//! `volumes/<enc id>/volume.json` (the record), next to the volume's backing (`data/` or
//! `image.ext4`). A record is written atomically (temp file, fsync, rename, fsync of the
//! directory), and only after the backing exists, so a crash mid-create leaves a directory
//! without a record, which loading ignores and the next create of that id replaces.
//! The name -> id index is rebuilt from the records on load: the records are the only
//! source of truth, so the two can never disagree.

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

/// Version of the on-disk record format.
pub const RECORD_VERSION: u32 = 1;

const RECORD_FILE: &str = "volume.json";

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
    /// Nodes the volume is controller-published to, with the readonly flag of that publish.
    pub published_nodes: BTreeMap<String, bool>,
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

/// The durable volume store, with an in-memory copy of every record.
#[derive(Debug)]
pub struct Store {
    root: PathBuf,
    records: Mutex<HashMap<String, VolumeRecord>>,
}

impl Store {
    /// Opens (creating if needed) the store under `work_dir` and loads every record.
    pub fn open(work_dir: &Path) -> Result<Store, StoreError> {
        let root = work_dir.join("volumes");
        fs::create_dir_all(&root).map_err(|source| StoreError::CreateDir {
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
            let path = entry.path().join(RECORD_FILE);
            let text = match fs::read(&path) {
                Ok(text) => text,
                // A directory without a record is an interrupted create: not a volume.
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(source) => return Err(StoreError::Read { path, source }),
            };
            let record: VolumeRecord =
                serde_json::from_slice(&text).map_err(|source| StoreError::Decode {
                    path: path.clone(),
                    source,
                })?;
            if record.version != RECORD_VERSION {
                return Err(StoreError::Version {
                    path,
                    version: record.version,
                });
            }
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
        fs::create_dir_all(&dir).map_err(|source| StoreError::CreateDir {
            path: dir.clone(),
            source,
        })?;
        let path = dir.join(RECORD_FILE);
        let bytes = serde_json::to_vec_pretty(record).expect("a volume record always serializes");
        write_atomically(&path, &bytes)?;
        self.lock().insert(record.id.clone(), record.clone());
        Ok(())
    }

    /// Removes volume `id`: first its record (so a crash never leaves a record without
    /// data), then its directory.
    pub fn remove(&self, id: &str) -> Result<(), StoreError> {
        let dir = self.volume_dir(id);
        let path = dir.join(RECORD_FILE);
        match fs::remove_file(&path) {
            Ok(()) => sync_dir(&dir, &path)?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(source) => {
                return Err(StoreError::Write {
                    path,
                    step: "unlink",
                    source,
                })
            }
        }
        self.lock().remove(id);
        match fs::remove_dir_all(&dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(StoreError::Remove { path: dir, source }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, VolumeRecord>> {
        // A panic while holding this lock cannot leave a half-updated map (every
        // mutation is a single insert/remove), so a poisoned lock is still consistent.
        self.records.lock().unwrap_or_else(|p| p.into_inner())
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
            published_nodes: BTreeMap::from([("n1".to_string(), true)]),
        }
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
        let reopened = Store::open(dir.path()).unwrap();
        assert_eq!(
            reopened.list(),
            vec![record("vol-1", "one"), record("vol-2", "two")]
        );
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
