//! The isolator's intent journal, `<work_dir>/isolators/volume/journal`, beside the container
//! checkpoints (`isolators/volume/csi/<id>/state.json`), on the same footing as the provider's
//! (see [`crate::durable::journal`] and [`crate::provider::checkpoint::VolumeJournal`]).
//!
//! - Every change of a container's checkpoint (prepare, isolate, update) and its removal
//!   (cleanup) is one journal entry, durable when [`ContainerJournal::record`] returns;
//!   concurrent containers share a batch's one `fdatasync`. The entry is the provider's
//!   ([`VolumeEntry`]: an id and the file's bytes, or a removal), keyed by container id.
//! - A removal is appended lazily ([`Commit::Lazy`]: written at once, durable with the next
//!   synced batch): one lost to a power cut brings back the checkpoint of a container whose
//!   volumes were already released, and recovery cleans it up again (cleanup is idempotent;
//!   after a reboot no container of the last boot survives). What must be durable first is the
//!   provider's release, which the cleanup waits for before it: a use the provider records
//!   always has its container's checkpoint.
//! - The `state.json` files are the steady state as of the last compaction, each with its
//!   format version as before. A compaction ([`ContainerJournal::compact`]: after recovery's
//!   load, and when the journal passes the provider's limits) writes every container changed
//!   since back to its file (removals unlinked), makes it durable with one `syncfs`, then
//!   empties the journal.
//! - A removal also unlinks the file and its directory at once (not durably: until the next
//!   compaction's `syncfs` the journal's removal covers a file a power cut brings back), so a
//!   cleaned-up container leaves no directory behind.
//! - Readers replay the journal's complete entries over the files ([`read_journaled`]): the
//!   last entry of a container wins, a removal removes it. A journal entry is data found in the
//!   work dir: one whose id is not a valid container id is refused (never a path component),
//!   and one whose directory is not a real directory is never written back through it.
//! - A work dir of the release before this journal has none: its files are the whole truth,
//!   and the journal is made empty at the first write.

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::durable::journal::{self, Commit, Entry, When};
use crate::provider::checkpoint::{self, journal_error, CheckpointError, KeyedJournal};

/// The journal's file name, in `<work_dir>/isolators/volume/`.
pub const JOURNAL_FILE: &str = "journal";

/// A container checkpoint's file name, in `<work_dir>/isolators/volume/csi/<id>/`.
pub const STATE_FILE: &str = "state.json";

/// `<work_dir>/isolators/volume`: the checkpoint root's parent, holding the journal.
fn volume_dir(work_dir: &Path) -> PathBuf {
    work_dir.join(crate::workdir::ISOLATORS_DIR).join("volume")
}

/// `<work_dir>/isolators/volume/journal`.
pub fn journal_path(work_dir: &Path) -> PathBuf {
    volume_dir(work_dir).join(JOURNAL_FILE)
}

/// What a journal says of each container it names (`None`: removed), by container id.
pub type Journaled = BTreeMap<String, Option<Vec<u8>>>;

/// The journal's entries replayed (pure): the last entry of a container wins. Returns the
/// containers as the journal leaves them and the entries refused (why): unreadable, or an id
/// that is not a valid container id.
pub fn replay(entries: &[Entry]) -> (Journaled, Vec<String>) {
    let (found, mut refused) = checkpoint::replay(entries, str::to_string);
    let mut out = BTreeMap::new();
    for (id, (_, state)) in found {
        match crate::resource::validate_container_id(&id) {
            Ok(()) => {
                out.insert(id, state);
            }
            Err(e) => refused.push(format!(
                "an entry for '{}': {}",
                crate::shown::shown(&id),
                crate::error_chain::full_message(&e)
            )),
        }
    }
    (out, refused)
}

/// What a reader sees of the journal of `work_dir`, without the lock and changing nothing: its
/// complete entries replayed (a torn tail is skipped, not cut); nothing when there is none.
pub fn read_journaled(work_dir: &Path) -> Result<Journaled, CheckpointError> {
    let path = journal_path(work_dir);
    match journal::read(&path).map_err(|e| journal_error(&path, e))? {
        None => Ok(BTreeMap::new()),
        Some((parsed, _)) => Ok(replay(&parsed.entries).0),
    }
}

/// A container's checkpoint as a recovery would find it now, without the lock: the journal's
/// last entry for it, else its `state.json` (`None`: neither, or removed). Not checked: see
/// [`crate::isolator::VolumeIsolator::checkpointed`] for what may be acted on.
pub fn read_checkpoint(
    work_dir: &Path,
    container: &str,
) -> Result<Option<Vec<u8>>, CheckpointError> {
    if let Some(state) = read_journaled(work_dir)?.remove(container) {
        return Ok(state);
    }
    checkpoint::read(&checkpoint_root(work_dir).join(container).join(STATE_FILE))
}

/// The isolator's journal, open for appending (one writer: the work dir's lock).
#[derive(Debug)]
pub struct ContainerJournal {
    keyed: KeyedJournal,
    work_dir: PathBuf,
}

impl ContainerJournal {
    /// Opens the journal of `work_dir` (made when absent), cutting a torn tail. Its entries
    /// are written back at the next [`compact`](Self::compact). Blocking.
    pub fn open(work_dir: &Path) -> Result<ContainerJournal, CheckpointError> {
        let path = journal_path(work_dir);
        checkpoint::create_dir_durable(&checkpoint_root(work_dir))?;
        let (journal, entries) = KeyedJournal::open(&path)?;
        let (_, refused) = replay(&entries);
        for why in refused {
            tracing::error!(journal = %path.display(), %why, "isolator journal: entry refused, not replayed");
        }
        Ok(ContainerJournal {
            keyed: KeyedJournal::new(journal),
            work_dir: work_dir.to_path_buf(),
        })
    }

    /// The journal's path.
    pub fn path(&self) -> &Path {
        self.keyed.path()
    }

    /// Appends the container's checkpoint (`None`: its removal); returns once it is durable,
    /// or at once for [`Commit::Lazy`]. A removal then unlinks the file and its directory (see
    /// the module doc). Compacts afterwards when the journal is over its limits. Blocking.
    pub fn record(
        &self,
        container: &str,
        state: Option<Vec<u8>>,
        commit: Commit,
    ) -> Result<(), CheckpointError> {
        let removal = state.is_none();
        self.keyed.append(container, state, commit)?;
        if removal {
            let file = self.state_file(container);
            let dir = file.parent().expect("a checkpoint has a parent");
            // Never through a directory that is not a real one (a symlink planted in its place).
            let real = std::fs::symlink_metadata(dir).is_ok_and(|m| m.is_dir());
            let removed = if real {
                crate::durable::remove_file(&file)
            } else {
                Err(io::ErrorKind::NotFound.into())
            };
            match removed {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!(path = %file.display(), error = %e, "isolator journal: a removed container's checkpoint stays until the next compaction")
                }
            }
            if real {
                let _ = crate::durable::remove_dir(dir);
            }
        }
        if self.keyed.due() {
            self.compact_when(When::Due)?;
        }
        Ok(())
    }

    /// How many synced batches (one fdatasync each) it has written since it was opened.
    pub fn batches(&self) -> u64 {
        self.keyed.batches()
    }

    fn state_file(&self, container: &str) -> PathBuf {
        checkpoint_root(&self.work_dir)
            .join(container)
            .join(STATE_FILE)
    }

    /// Writes every container the journal holds back to its `state.json`
    /// (removals unlink it and its directory), makes that durable with one `syncfs`, then
    /// empties the journal. A container whose directory is not a real directory (a symlink
    /// planted in its place) is not written through it: it is dropped, and the scan reports
    /// the directory. Blocking.
    pub fn compact(&self) -> Result<(), CheckpointError> {
        self.compact_when(When::Always)
    }

    /// [`compact`](Self::compact) `when` it is wanted, judged once the journal is held.
    fn compact_when(&self, when: When) -> Result<(), CheckpointError> {
        self.keyed
            .compact_when(when, &volume_dir(&self.work_dir), |id, state| {
                // The states come back from the journal's file: an id its replay at open
                // refused is never made a path.
                if let Err(e) = crate::resource::validate_container_id(id) {
                    tracing::error!(id = %crate::shown::shown(id), error = %crate::error_chain::full_message(&e), "isolator journal: an entry with an invalid container id is not written back");
                    return Ok(None);
                }
                let file = self.state_file(id);
                let dir = file.parent().expect("a checkpoint has a parent");
                match std::fs::symlink_metadata(dir) {
                    Ok(m) if m.is_dir() => {}
                    Ok(_) => {
                        tracing::error!(path = %dir.display(), "isolator journal: a container's checkpoint directory is not a directory (a symlink?): not written back through it");
                        return Ok(None);
                    }
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {
                        if state.is_none() {
                            return Ok(None);
                        }
                        crate::durable::create_dir(dir).map_err(|source| {
                            CheckpointError::CreateDir {
                                path: dir.to_path_buf(),
                                source,
                            }
                        })?;
                    }
                    Err(source) => {
                        return Err(CheckpointError::Read {
                            path: dir.to_path_buf(),
                            source,
                        })
                    }
                }
                Ok(Some(file))
            }, |_, _| Vec::new())
    }
}

/// The isolator's journal, opened at its first use (a command that never writes a container
/// checkpoint never makes one).
#[derive(Debug)]
pub struct LazyJournal {
    work_dir: PathBuf,
    slot: Mutex<Option<Arc<ContainerJournal>>>,
}

impl LazyJournal {
    /// The journal of `work_dir`, not yet opened.
    pub fn new(work_dir: &Path) -> LazyJournal {
        LazyJournal {
            work_dir: work_dir.to_path_buf(),
            slot: Mutex::new(None),
        }
    }

    /// The journal's path.
    pub fn path(&self) -> PathBuf {
        journal_path(&self.work_dir)
    }

    /// The journal if it is open (never opens it).
    pub fn opened(&self) -> Option<Arc<ContainerJournal>> {
        self.slot.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The journal, opened now if it is not yet. Blocking.
    pub fn get(&self) -> Result<Arc<ContainerJournal>, CheckpointError> {
        let mut slot = self.slot.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(j) = &*slot {
            return Ok(j.clone());
        }
        let j = Arc::new(ContainerJournal::open(&self.work_dir)?);
        *slot = Some(j.clone());
        Ok(j)
    }
}

/// `<work_dir>/isolators/volume/csi`: one directory per container.
pub(crate) fn checkpoint_root(work_dir: &Path) -> PathBuf {
    work_dir
        .join(crate::workdir::ISOLATORS_DIR)
        .join("volume")
        .join("csi")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::checkpoint::VolumeEntry;

    fn entry(seq: u64, id: &str, state: Option<&[u8]>) -> Entry {
        Entry {
            seq,
            payload: VolumeEntry {
                volume_id: id.to_string(),
                state: state.map(<[u8]>::to_vec),
            }
            .encode(),
        }
    }

    #[test]
    fn replay_keeps_the_last_entry_and_refuses_bad_ids() {
        let entries = vec![
            entry(1, "c1", Some(b"one")),
            entry(2, "c2", Some(b"two")),
            entry(3, "c1", Some(b"three")),
            entry(4, "c2", None),
            entry(5, "../etc", Some(b"x")),
            Entry {
                seq: 6,
                payload: vec![9, 9],
            },
        ];
        let (found, refused) = replay(&entries);
        assert_eq!(
            found,
            BTreeMap::from([
                ("c1".to_string(), Some(b"three".to_vec())),
                ("c2".to_string(), None),
            ])
        );
        assert_eq!(refused.len(), 2, "{refused:?}");
        assert!(refused.iter().any(|r| r.contains("journal entry 6")));
        assert!(refused.iter().any(|r| r.contains("../etc")));
    }

    #[test]
    fn records_go_to_the_journal_until_a_compaction_writes_them_back() {
        let dir = tempfile::tempdir().unwrap();
        let work = dir.path();
        let j = ContainerJournal::open(work).unwrap();
        j.record("c1", Some(b"{\"a\":1}".to_vec()), Commit::Durable)
            .unwrap();
        j.record("c2", Some(b"{\"b\":2}".to_vec()), Commit::Durable)
            .unwrap();
        let file = |id: &str| checkpoint_root(work).join(id).join(STATE_FILE);
        assert!(!file("c1").exists(), "written back only at compaction");
        assert_eq!(
            read_journaled(work).unwrap()["c1"].as_deref(),
            Some(&b"{\"a\":1}"[..])
        );
        j.compact().unwrap();
        assert_eq!(std::fs::read(file("c1")).unwrap(), b"{\"a\":1}");
        assert!(read_journaled(work).unwrap().is_empty());
        // A removal is journaled and the file and its directory go at once.
        j.record("c1", None, Commit::Lazy).unwrap();
        assert!(!file("c1").parent().unwrap().exists());
        assert_eq!(read_journaled(work).unwrap()["c1"], None);
        // Reopened (a restart): the entries are dirty again and a compaction settles them.
        drop(j);
        let j = ContainerJournal::open(work).unwrap();
        j.compact().unwrap();
        assert!(!file("c1").parent().unwrap().exists());
        assert_eq!(std::fs::read(file("c2")).unwrap(), b"{\"b\":2}");
    }

    #[test]
    fn an_entry_with_an_invalid_container_id_is_never_made_a_path_at_compaction() {
        let dir = tempfile::tempdir().unwrap();
        let work = dir.path();
        let j = ContainerJournal::open(work).unwrap();
        // Appended below the id check, as a damaged or planted journal would hold it.
        j.keyed
            .append("../escaped", Some(b"{}".to_vec()), Commit::Durable)
            .unwrap();
        j.record("c1", Some(b"{}".to_vec()), Commit::Durable)
            .unwrap();
        j.compact().unwrap();
        let root = checkpoint_root(work);
        assert!(!root.join("../escaped").exists());
        assert!(!root.parent().unwrap().join("escaped").exists());
        assert_eq!(
            std::fs::read(root.join("c1").join(STATE_FILE)).unwrap(),
            b"{}"
        );
        assert!(read_journaled(work).unwrap().is_empty());
    }

    #[test]
    fn a_symlinked_directory_is_never_written_through() {
        let dir = tempfile::tempdir().unwrap();
        let work = dir.path().join("work");
        std::fs::create_dir(&work).unwrap();
        let outside = dir.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        let j = ContainerJournal::open(&work).unwrap();
        let root = checkpoint_root(&work);
        std::os::unix::fs::symlink(&outside, root.join("c1")).unwrap();
        j.record("c1", Some(b"planted".to_vec()), Commit::Durable)
            .unwrap();
        j.compact().unwrap();
        assert!(!outside.join(STATE_FILE).exists());
        assert!(read_journaled(&work).unwrap().is_empty());
    }
}
