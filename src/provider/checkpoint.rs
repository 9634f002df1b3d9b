//! Durable, atomic checkpoint files.
//!
//! Contract: after [`write_atomic`] returns, the file at `path` holds either
//! its old content or the new content in full, across a crash or power loss,
//! with mode 0600: it is [`crate::durable::write_atomic`] (temporary file,
//! fsync, rename, fsync of the directory), after the directory is created
//! durably. Readers never see a torn file.
//!
//! Every durable write passes through [`crash_point`], which lets the crash
//! tests kill the process (SIGKILL, not an early return) right after the Nth
//! durable write: `CSI_ISOLATOR_CRASH_AFTER_WRITE=N`. The provider also
//! calls it right after each RPC returns and before its result is recorded,
//! so that window is crashed at too.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::durable::journal::{Commit, Journal, JournalError, When};
use crate::durable::record::Promise;
pub use crate::durable::remove_stale_temps;
use crate::durable::{self, WriteStep};
use crate::resource::Layout;
use crate::workdir::PRIVATE_FILE_MODE;

/// The environment variable that arms the crash point (tests only).
pub const CRASH_AFTER_WRITE_ENV: &str = "CSI_ISOLATOR_CRASH_AFTER_WRITE";

/// Errors from writing or reading a checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// Creating the directory that holds the checkpoint failed.
    #[error("create checkpoint directory {path}")]
    CreateDir {
        /// The directory.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// Writing or syncing the temporary file failed.
    #[error("write checkpoint {path}")]
    Write {
        /// The file being written.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// Renaming the temporary file over the checkpoint failed.
    #[error("rename checkpoint into place at {path}")]
    Rename {
        /// The checkpoint path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// Syncing the directory after the rename failed.
    #[error("sync checkpoint directory {path}")]
    SyncDir {
        /// The directory.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// Reading the checkpoint failed.
    #[error("read checkpoint {path}")]
    Read {
        /// The checkpoint path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// Removing the checkpoint failed.
    #[error("remove checkpoint {path}")]
    Remove {
        /// The checkpoint path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// The journal failed or was refused.
    #[error("journal {path}: {reason}")]
    Journal {
        /// The journal.
        path: PathBuf,
        /// What failed, and what to do.
        reason: String,
    },
    /// Setting a corrupt checkpoint aside failed.
    #[error("set aside corrupt checkpoint {path}")]
    SetAside {
        /// The checkpoint path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
}

static POINTS: AtomicU64 = AtomicU64::new(0);
static WRITES: AtomicU64 = AtomicU64::new(0);
/// Counts crash points (durable writes, and RPCs returned before their
/// result is recorded) and, when the crash point is armed and this is the
/// Nth one, kills the process on the spot.
pub fn crash_point() {
    static ARMED: OnceLock<Option<u64>> = OnceLock::new();
    let n = POINTS.fetch_add(1, Ordering::SeqCst) + 1;
    let armed = ARMED.get_or_init(|| {
        std::env::var(CRASH_AFTER_WRITE_ENV)
            .ok()
            .and_then(|v| v.parse().ok())
    });
    if *armed == Some(n) {
        tracing::warn!(write = n, "crash point reached: killing the process");
        let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
    }
}

/// How many durable writes (atomic writes and durable removals) this
/// process has made, for the benchmarks.
pub fn durable_writes() -> u64 {
    WRITES.load(Ordering::SeqCst)
}

/// Writes `bytes` to `path` atomically and durably (see the module doc).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    create_dir_durable(dir)?;
    durable::write_atomic(path, bytes, PRIVATE_FILE_MODE).map_err(|e| match e.step {
        WriteStep::CreateTemp | WriteStep::Write | WriteStep::SyncFile => CheckpointError::Write {
            path: e.path,
            source: e.source,
        },
        WriteStep::Rename => CheckpointError::Rename {
            path: e.path,
            source: e.source,
        },
        WriteStep::SyncDir => CheckpointError::SyncDir {
            path: dir.to_path_buf(),
            source: e.source,
        },
    })?;
    WRITES.fetch_add(1, Ordering::Relaxed);
    crash_point();
    Ok(())
}

/// Creates `dir` and any missing parents, fsyncing the parent of each
/// directory it creates, so a new checkpoint's directory survives a power
/// loss as surely as the checkpoint does.
pub fn create_dir_durable(dir: &Path) -> Result<(), CheckpointError> {
    if dir.is_dir() {
        return Ok(());
    }
    if let Some(parent) = dir.parent() {
        if !parent.as_os_str().is_empty() {
            create_dir_durable(parent)?;
        }
    }
    match durable::create_dir(dir) {
        Ok(()) => {
            if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
                sync_dir(parent)?;
            }
            durable::promise(|| Promise::DirMade {
                path: dir.to_path_buf(),
            });
            Ok(())
        }
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        Err(source) => Err(CheckpointError::CreateDir {
            path: dir.to_path_buf(),
            source,
        }),
    }
}

/// Removes `path` durably (the directory entry removal is fsynced). A file
/// that is already gone is not an error.
pub fn remove_durable(path: &Path) -> Result<(), CheckpointError> {
    match durable::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(source) => {
            return Err(CheckpointError::Remove {
                path: path.to_path_buf(),
                source,
            })
        }
    }
    if let Some(dir) = path.parent() {
        sync_dir(dir)?;
    }
    durable::promise(|| Promise::Removed {
        path: path.to_path_buf(),
    });
    WRITES.fetch_add(1, Ordering::Relaxed);
    crash_point();
    Ok(())
}

/// Reads a checkpoint; `Ok(None)` when it does not exist.
pub fn read(path: &Path) -> Result<Option<Vec<u8>>, CheckpointError> {
    match fs::read(path) {
        Ok(b) => Ok(Some(b)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(CheckpointError::Read {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// Moves a checkpoint that cannot be trusted out of the way, next to where it
/// was (`<name>.corrupt-<unix seconds>`), and returns the new path. It is never
/// deleted: an operator may want to read it.
pub fn set_aside(path: &Path) -> Result<PathBuf, CheckpointError> {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".corrupt-{secs}"));
    let aside = path.with_file_name(name);
    durable::rename(path, &aside).map_err(|source| CheckpointError::SetAside {
        path: path.to_path_buf(),
        source,
    })?;
    if let Some(dir) = path.parent() {
        sync_dir(dir)?;
    }
    Ok(aside)
}

/// fsyncs a directory so that entries created, renamed or removed in it are durable.
pub fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    durable::sync_dir(dir).map_err(|source| CheckpointError::SyncDir {
        path: dir.to_path_buf(),
        source,
    })
}

/// The provider's journal file, beside `volumes/` under `csi/<type>/<name>/`.
pub const JOURNAL_FILE: &str = "journal";

/// Compaction is due once the journal holds this many entries...
pub const COMPACT_ENTRIES: u64 = 4096;
/// ...or this many bytes.
pub const COMPACT_BYTES: u64 = 16 << 20;

/// The format of a journal entry's payload this build writes (its first byte).
const ENTRY_FORMAT: u8 = 1;

/// A journal entry of the provider: a volume's state file as it is now, or its removal.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeEntry {
    /// The volume id.
    pub volume_id: String,
    /// The state file's bytes; `None`: the volume was destroyed.
    pub state: Option<Vec<u8>>,
}

impl VolumeEntry {
    /// The payload: the format byte, 1 (a record) or 0 (a removal), the id's length (u32 LE),
    /// the id, the state file's bytes.
    pub fn encode(&self) -> Vec<u8> {
        let id = self.volume_id.as_bytes();
        let mut out = Vec::with_capacity(6 + id.len() + self.state.as_ref().map_or(0, Vec::len));
        out.push(ENTRY_FORMAT);
        out.push(u8::from(self.state.is_some()));
        out.extend_from_slice(&(id.len() as u32).to_le_bytes());
        out.extend_from_slice(id);
        if let Some(state) = &self.state {
            out.extend_from_slice(state);
        }
        out
    }

    /// Reads a payload back; `Err`: why it is not one this build reads (pure).
    pub fn decode(payload: &[u8]) -> Result<VolumeEntry, String> {
        let (&format, rest) = payload.split_first().ok_or("an empty entry")?;
        if format != ENTRY_FORMAT {
            return Err(format!(
                "entry format {format}, this build reads {ENTRY_FORMAT}"
            ));
        }
        let (&kind, rest) = rest.split_first().ok_or("an entry cut after its format")?;
        if rest.len() < 4 {
            return Err("an entry cut in its id length".into());
        }
        let len = u32::from_le_bytes(rest[..4].try_into().expect("4 bytes")) as usize;
        let rest = &rest[4..];
        if len == 0 || len > rest.len() {
            return Err(format!(
                "an id length of {len} in an entry of {} bytes",
                payload.len()
            ));
        }
        let volume_id = std::str::from_utf8(&rest[..len])
            .map_err(|_| "an id that is not UTF-8")?
            .to_string();
        let state = match kind {
            1 => Some(rest[len..].to_vec()),
            0 if rest.len() == len => None,
            0 => return Err("a removal with a body".into()),
            k => return Err(format!("an entry of kind {k}")),
        };
        Ok(VolumeEntry { volume_id, state })
    }
}

/// The state files as a journal leaves them (defined beside the summary, which reads them).
pub use crate::provider::summary::Journaled;

/// The journal's entries replayed over the state files found (pure): the last entry of a
/// volume wins, a removal removes it, whatever its file held (a write-back cut by a power
/// loss may have left it torn: the journal still covers it). Returns the state files as
/// they now stand by volume directory name (`None`: removed), the volumes the journal
/// touched, and the entries it could not read (reason). `dir_name` maps a volume id to its
/// directory name.
pub fn replay<'a>(
    entries: impl IntoIterator<Item = &'a crate::durable::journal::Entry>,
    dir_name: impl Fn(&str) -> String,
) -> Replayed {
    let mut last = BTreeMap::new();
    let mut refused = Vec::new();
    for e in entries {
        match VolumeEntry::decode(&e.payload) {
            Ok(v) => {
                last.insert(dir_name(&v.volume_id), (v.volume_id, v.state));
            }
            Err(why) => refused.push(format!("journal entry {}: {why}", e.seq)),
        }
    }
    (last, refused)
}

/// A journal replayed: the state files as it leaves them by volume directory name (volume id
/// and bytes; `None`: removed), and the entries it could not read.
pub type Replayed = (Journaled, Vec<String>);

/// A journal of keyed states (`VolumeEntry`s: a key and its bytes, or its removal), written back
/// lazily to one file per key: what the provider's journal ([`VolumeJournal`]) and the
/// isolator's (`isolator::journal::ContainerJournal`) share. Each says where a key's file is.
///
/// It keeps no copy of the states it was given: the journal's file holds them, and a
/// compaction reads it back (the last entry of each key wins) to write them out. Memory then
/// does not grow with the entries between compactions (at 10,000 volumes the copies were up to
/// 4,096 states per journal: docs/benchmarks.md, "10,000 volumes").
pub(crate) struct KeyedJournal {
    journal: Journal,
}

impl std::fmt::Debug for KeyedJournal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyedJournal")
            .field("journal", &self.journal)
            .finish()
    }
}

/// A journal error as a checkpoint error naming the journal.
pub(crate) fn journal_error(path: &Path, e: JournalError) -> CheckpointError {
    CheckpointError::Journal {
        path: path.to_path_buf(),
        reason: crate::error_chain::full_message(&e),
    }
}

impl KeyedJournal {
    /// Opens the journal at `path` (made when absent), cutting a torn tail; returns it and its
    /// entries. Blocking.
    pub(crate) fn open(
        path: &Path,
    ) -> Result<(Journal, Vec<crate::durable::journal::Entry>), CheckpointError> {
        let (journal, parsed) = Journal::open(path, PRIVATE_FILE_MODE, crash_point)
            .map_err(|e| journal_error(path, e))?;
        Ok((journal, parsed.entries))
    }

    /// The opened journal: the states its entries hold are written back at the next
    /// [`compact`](Self::compact).
    pub(crate) fn new(journal: Journal) -> KeyedJournal {
        KeyedJournal { journal }
    }

    /// The journal's path.
    pub(crate) fn path(&self) -> &Path {
        self.journal.path()
    }

    /// Appends `key`'s state (`None`: its removal); returns once it is durable, or at once for
    /// [`Commit::Lazy`] (see [`Journal::append_lazy`]). A crash point either way. Blocking.
    pub(crate) fn append(
        &self,
        key: &str,
        state: Option<Vec<u8>>,
        commit: Commit,
    ) -> Result<(), CheckpointError> {
        let entry = VolumeEntry {
            volume_id: key.to_string(),
            state,
        };
        let payload = entry.encode();
        match commit {
            Commit::Durable => {
                self.journal.append(&[&payload]).map(|_| ())?;
                WRITES.fetch_add(1, Ordering::Relaxed);
            }
            Commit::Lazy => self.journal.append_lazy(&[&payload])?,
        }
        crash_point();
        Ok(())
    }

    /// How many synced batches the journal has written since it was opened.
    pub(crate) fn batches(&self) -> u64 {
        self.journal.batches()
    }

    /// Whether the journal is over its limits (time to [`compact`](Self::compact)).
    pub(crate) fn due(&self) -> bool {
        crate::durable::journal::due(self.journal.size(), COMPACT_ENTRIES, COMPACT_BYTES)
    }

    /// Writes back every key the journal holds (its last entry) to the file `file_of` names
    /// (`None`: not written back, dropped), removals unlinking it and then its directory when
    /// empty, then the files `also` makes once those are written (given the journal's span: the
    /// sequence number of its first entry, and the one after its last, the reset journal's
    /// first); makes all of it durable with one syncfs of `base`'s filesystem, then empties the
    /// journal (see [`crate::durable::journal`]). The states are read back from the journal's
    /// file while it is held (appends meanwhile wait and go to the new file); an entry this
    /// build cannot read is logged and skipped, as at open. On a failure the journal stays as
    /// it was, for the next compaction. Blocking. Runs `when` it is wanted, judged once the
    /// journal is held: a caller that saw it [`due`](Self::due) compacts only if no other did
    /// meanwhile ([`When::Due`]).
    pub(crate) fn compact_when(
        &self,
        when: When,
        base: &Path,
        mut file_of: impl FnMut(&str, &Option<Vec<u8>>) -> Result<Option<PathBuf>, CheckpointError>,
        also: impl FnOnce(u64, u64) -> Vec<WrittenBack>,
    ) -> Result<(), CheckpointError> {
        let wanted = |size| when.holds(size, COMPACT_ENTRIES, COMPACT_BYTES);
        self.journal
            .compact_when(wanted, || -> Result<(), CheckpointError> {
                let mut files = Vec::new();
                for (key, state) in self.last_states()? {
                    if let Some(file) = file_of(&key, &state)? {
                        files.push((file, state));
                    }
                }
                let failed = |e: crate::durable::journal::WriteBackError| CheckpointError::Write {
                    path: e.path.clone(),
                    source: io::Error::new(e.source.kind(), e.to_string()),
                };
                use crate::durable::journal::{sync_written, write_files};
                write_files(&files, PRIVATE_FILE_MODE, crash_point).map_err(failed)?;
                // Steady while the compaction holds the journal; `also` reads the files just
                // written (before the one sync: made durable with them).
                let first = self.journal.first_seq();
                let more = also(first, first + self.journal.size().entries);
                write_files(&more, PRIVATE_FILE_MODE, crash_point).map_err(failed)?;
                sync_written(base, crash_point).map_err(failed)?;
                for (file, state) in &files {
                    if let (None, Some(dir)) = (state, file.parent()) {
                        // Best effort: an empty directory is harmless.
                        let _ = durable::remove_dir(dir);
                    }
                }
                Ok(())
            })?;
        Ok(())
    }

    /// The last state of each key in the journal's file (read as [`read_journal`] does: no
    /// link followed, size-capped); unreadable entries logged and skipped.
    fn last_states(&self) -> Result<BTreeMap<String, Option<Vec<u8>>>, CheckpointError> {
        let path = self.journal.path();
        let Some((parsed, _)) =
            crate::durable::journal::read(path).map_err(|e| journal_error(path, e))?
        else {
            return Ok(BTreeMap::new());
        };
        let mut last = BTreeMap::new();
        for e in parsed.entries {
            match VolumeEntry::decode(&e.payload) {
                Ok(v) => {
                    last.insert(v.volume_id, v.state);
                }
                Err(why) => {
                    tracing::error!(journal = %path.display(), seq = e.seq, %why, "journal entry refused at compaction, not written back")
                }
            }
        }
        Ok(last)
    }
}

/// A file a compaction writes back: its bytes, or `None` to remove it.
pub(crate) type WrittenBack = (PathBuf, Option<Vec<u8>>);

/// The provider's journal: every change of a volume's record is appended to it (durable at
/// return, shared batches) and written back to the volume's `volume.state` lazily, with the
/// volume summary `status` reads ([`crate::provider::summary`]).
#[derive(Debug)]
pub struct VolumeJournal {
    keyed: KeyedJournal,
    layout: Layout,
}

impl VolumeJournal {
    /// Opens `layout`'s journal (made when absent: a work dir of the release before the
    /// journal has none), cutting a torn tail, and returns it with its replay over nothing
    /// (see [`replay`]). Its entries are written back at the next [`compact`](Self::compact).
    pub fn open(
        layout: &Layout,
    ) -> Result<(VolumeJournal, Journaled, Vec<String>), CheckpointError> {
        let path = layout.base().join(JOURNAL_FILE);
        create_dir_durable(layout.base())?;
        let (journal, entries) = KeyedJournal::open(&path)?;
        let (found, refused) = replay(&entries, crate::resource::encode_volume_id);
        Ok((
            VolumeJournal {
                keyed: KeyedJournal::new(journal),
                layout: layout.clone(),
            },
            found,
            refused,
        ))
    }

    /// Appends the volume's state (`None`: its removal); returns once it is durable, or at once
    /// for [`Commit::Lazy`]. Compacts afterwards when the journal is over its limits. Blocking.
    pub fn record(
        &self,
        volume_id: &str,
        state: Option<Vec<u8>>,
        commit: Commit,
    ) -> Result<(), CheckpointError> {
        self.keyed.append(volume_id, state, commit)?;
        if self.keyed.due() {
            self.compact_as(true, When::Due)?;
        }
        Ok(())
    }

    /// How many synced batches (one fdatasync each) it has written since it was opened.
    pub fn batches(&self) -> u64 {
        self.keyed.batches()
    }

    /// Writes back every volume changed since the last compaction to its `volume.state`
    /// (removals remove it and its directory when empty) and the volume summary, makes that
    /// durable with one syncfs, then empties the journal (see [`crate::durable::journal`]).
    /// Blocking.
    pub fn compact(&self) -> Result<(), CheckpointError> {
        self.compact_as(true, When::Always)
    }

    /// [`compact`](Self::compact), writing the summary or (`summary` false) removing it, `when`
    /// it is wanted.
    fn compact_as(&self, summary: bool, when: When) -> Result<(), CheckpointError> {
        let layout = &self.layout;
        let file_of = |id: &str, state: &Option<Vec<u8>>| {
            let dir = layout.volume_dir(id);
            if state.is_some() && !dir.is_dir() {
                durable::create_dir(&dir).map_err(|source| CheckpointError::CreateDir {
                    path: dir.clone(),
                    source,
                })?;
            }
            Ok(Some(layout.state_file(id)))
        };
        self.keyed
            .compact_when(when, layout.base(), file_of, |first, covers| {
                let bytes = summary
                    .then(|| crate::provider::summary::build(layout, first, covers))
                    .flatten();
                vec![(summary_path(layout), bytes)]
            })
    }

    /// Removes the volume summary, durably: for whoever changes a volume directory outside a
    /// compaction (recovery setting a corrupt state file aside), before that change.
    pub fn drop_summary(&self) -> Result<(), CheckpointError> {
        remove_durable(&summary_path(&self.layout))
    }
}

impl From<JournalError> for CheckpointError {
    fn from(e: JournalError) -> Self {
        let path = match &e {
            JournalError::Read { path, .. }
            | JournalError::Refused { path, .. }
            | JournalError::Write { path, .. }
            | JournalError::Sync { path, .. }
            | JournalError::Cut { path, .. }
            | JournalError::TooLarge { path, .. }
            | JournalError::Broken { path, .. }
            | JournalError::Reset { path, .. } => path.clone(),
        };
        journal_error(&path, e)
    }
}

/// `layout`'s volume summary (see [`crate::provider::summary`]).
fn summary_path(layout: &Layout) -> PathBuf {
    layout.base().join(crate::provider::summary::SUMMARY_FILE)
}

/// What a reader without the lock (`status`, in another process) sees of `layout`'s
/// journal: its complete entries; `None` when there is none. It changes nothing: a torn tail
/// is skipped, not cut.
pub fn read_journal_entries(
    layout: &Layout,
) -> Result<Option<crate::durable::journal::Parsed>, CheckpointError> {
    let path = layout.base().join(JOURNAL_FILE);
    let read = crate::durable::journal::read(&path).map_err(|e| journal_error(&path, e))?;
    Ok(read.map(|(parsed, _)| parsed))
}

/// [`read_journal_entries`] replayed (see [`replay`]); nothing when there is none.
pub fn read_journal(layout: &Layout) -> Result<Journaled, CheckpointError> {
    Ok(match read_journal_entries(layout)? {
        None => BTreeMap::new(),
        Some(parsed) => replay(&parsed.entries, crate::resource::encode_volume_id).0,
    })
}

/// A volume's checkpoint as a recovery would find it now: its journal's last complete entry,
/// else its `volume.state`; `None`: neither (or removed).
pub fn read_state(layout: &Layout, volume_id: &str) -> Result<Option<Vec<u8>>, CheckpointError> {
    let dir = crate::resource::encode_volume_id(volume_id);
    if let Some((_, state)) = read_journal(layout)?.remove(&dir) {
        return Ok(state);
    }
    read(&layout.state_file(volume_id))
}

/// Folds `layout`'s journal into its state files (open, write back, reset) and removes the
/// volume summary, for a command that reads and writes state files directly with the work dir
/// locked (`volume detach`): the summary would no longer say what they hold.
pub fn settle_journal(layout: &Layout) -> Result<(), CheckpointError> {
    remove_durable(&summary_path(layout))?;
    if !layout.base().join(JOURNAL_FILE).exists() {
        return Ok(());
    }
    let (journal, _, _) = VolumeJournal::open(layout)?;
    journal.compact_as(false, When::Always)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_read_replace_and_remove() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("sub/volume.state");
        assert!(read(&p).unwrap().is_none());
        write_atomic(&p, b"one").unwrap();
        write_atomic(&p, b"two").unwrap();
        assert_eq!(read(&p).unwrap().unwrap(), b"two");
        // No temporary file is left next to it.
        let names: Vec<_> = fs::read_dir(p.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("volume.state")]);
        remove_durable(&p).unwrap();
        remove_durable(&p).unwrap();
        assert!(read(&p).unwrap().is_none());
    }

    #[test]
    fn a_volume_entry_round_trips_and_a_hostile_one_is_refused() {
        for e in [
            VolumeEntry {
                volume_id: "vol/1".into(),
                state: Some(b"{}".to_vec()),
            },
            VolumeEntry {
                volume_id: "x".into(),
                state: Some(Vec::new()),
            },
            VolumeEntry {
                volume_id: "gone".into(),
                state: None,
            },
        ] {
            assert_eq!(VolumeEntry::decode(&e.encode()).unwrap(), e);
        }
        let good = VolumeEntry {
            volume_id: "v".into(),
            state: None,
        }
        .encode();
        assert!(VolumeEntry::decode(&[]).is_err());
        assert!(VolumeEntry::decode(&[9]).unwrap_err().contains("format 9"));
        let mut huge = good.clone();
        huge[2..6].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(VolumeEntry::decode(&huge)
            .unwrap_err()
            .contains("id length"));
        let mut body = good.clone();
        body.push(b'x');
        assert!(VolumeEntry::decode(&body).unwrap_err().contains("removal"));
        let mut kind = good;
        kind[1] = 5;
        assert!(VolumeEntry::decode(&kind).is_err());
    }

    #[test]
    fn the_last_entry_of_a_volume_wins_and_unreadable_entries_are_reported() {
        use crate::durable::journal::Entry;
        let e = |seq, id: &str, state: Option<&[u8]>| Entry {
            seq,
            payload: VolumeEntry {
                volume_id: id.into(),
                state: state.map(<[u8]>::to_vec),
            }
            .encode(),
        };
        let entries = vec![
            e(1, "a", Some(b"1")),
            e(2, "b", Some(b"1")),
            e(3, "a", Some(b"2")),
            e(4, "b", None),
            Entry {
                seq: 5,
                payload: vec![42],
            },
        ];
        let (found, refused) = replay(&entries, |id| format!("d-{id}"));
        assert_eq!(found["d-a"], ("a".to_string(), Some(b"2".to_vec())));
        assert_eq!(found["d-b"], ("b".to_string(), None));
        assert_eq!(found.len(), 2);
        assert_eq!(refused.len(), 1);
        assert!(refused[0].contains("entry 5"));
    }

    /// Records go to the journal, not the state files, until a compaction writes them back;
    /// a reopen replays what was not written back.
    #[test]
    fn records_are_written_back_at_compaction_and_replayed_at_open() {
        let dir = tempfile::tempdir().unwrap();
        let layout = Layout::new(dir.path(), "t", "n");
        fs::create_dir_all(layout.volumes_dir()).unwrap();
        let (j, found, _) = VolumeJournal::open(&layout).unwrap();
        assert!(found.is_empty());
        j.record("a", Some(b"one".to_vec()), Commit::Durable)
            .unwrap();
        j.record("b", Some(b"x".to_vec()), Commit::Durable).unwrap();
        j.record("a", Some(b"two".to_vec()), Commit::Lazy).unwrap();
        assert!(!layout.state_file("a").exists());
        drop(j);
        let (j, found, _) = VolumeJournal::open(&layout).unwrap();
        assert_eq!(found.len(), 2);
        j.compact().unwrap();
        assert_eq!(fs::read(layout.state_file("a")).unwrap(), b"two");
        j.record("b", None, Commit::Durable).unwrap();
        assert!(layout.state_file("b").exists());
        j.compact().unwrap();
        assert!(!layout.volume_dir("b").exists());
        assert!(read_journal(&layout).unwrap().is_empty());
    }

    #[test]
    fn set_aside_keeps_the_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("volume.state");
        fs::write(&p, b"{garbage").unwrap();
        let aside = set_aside(&p).unwrap();
        assert!(!p.exists());
        assert_eq!(fs::read(&aside).unwrap(), b"{garbage");
        assert!(aside
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("volume.state.corrupt-"));
    }

    #[test]
    fn compaction_writes_back_the_last_states_its_file_holds() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal");
        let file_of = |key: &str, _: &Option<Vec<u8>>| Ok(Some(dir.path().join(key)));
        let (journal, entries) = KeyedJournal::open(&path).unwrap();
        assert!(entries.is_empty());
        let keyed = KeyedJournal::new(journal);
        keyed
            .append("v1", Some(b"first".to_vec()), Commit::Durable)
            .unwrap();
        keyed
            .append("v2", Some(b"kept".to_vec()), Commit::Durable)
            .unwrap();
        keyed
            .append("v1", Some(b"last".to_vec()), Commit::Lazy)
            .unwrap();
        fs::write(dir.path().join("v3"), b"old").unwrap();
        keyed.append("v3", None, Commit::Durable).unwrap();
        keyed
            .compact_when(When::Always, dir.path(), file_of, |_, _| Vec::new())
            .unwrap();
        assert_eq!(fs::read(dir.path().join("v1")).unwrap(), b"last");
        assert_eq!(fs::read(dir.path().join("v2")).unwrap(), b"kept");
        assert!(
            !dir.path().join("v3").exists(),
            "a removal unlinks the file"
        );
        assert!(crate::durable::journal::read(&path)
            .unwrap()
            .unwrap()
            .0
            .entries
            .is_empty());
        // Entries a previous process appended are written back by the next one's compaction.
        keyed
            .append("v4", Some(b"from before".to_vec()), Commit::Durable)
            .unwrap();
        drop(keyed);
        let (journal, entries) = KeyedJournal::open(&path).unwrap();
        assert_eq!(entries.len(), 1);
        let keyed = KeyedJournal::new(journal);
        keyed
            .compact_when(When::Always, dir.path(), file_of, |_, _| Vec::new())
            .unwrap();
        assert_eq!(fs::read(dir.path().join("v4")).unwrap(), b"from before");
        assert_eq!(fs::read(dir.path().join("v1")).unwrap(), b"last");
    }

    #[test]
    fn an_entry_that_does_not_decode_is_skipped_at_compaction_and_the_rest_written_back() {
        let dir = tempfile::tempdir().unwrap();
        let (journal, _) = KeyedJournal::open(&dir.path().join("journal")).unwrap();
        let keyed = KeyedJournal::new(journal);
        keyed
            .append("v1", Some(b"one".to_vec()), Commit::Durable)
            .unwrap();
        // A framed entry that is no volume entry (a foreign format byte).
        keyed.journal.append(&[&[0xff, 1, 2, 3]]).unwrap();
        keyed
            .append("v2", Some(b"two".to_vec()), Commit::Durable)
            .unwrap();
        let file_of = |key: &str, _: &Option<Vec<u8>>| Ok(Some(dir.path().join(key)));
        keyed
            .compact_when(When::Always, dir.path(), file_of, |_, _| Vec::new())
            .unwrap();
        assert_eq!(fs::read(dir.path().join("v1")).unwrap(), b"one");
        assert_eq!(fs::read(dir.path().join("v2")).unwrap(), b"two");
        assert_eq!(keyed.journal.size().entries, 0, "the journal was emptied");
    }

    /// A burst of appenders that each saw the journal due after their append: one compaction,
    /// not one each (the 256-container burst compacted 227 times in a row before).
    #[test]
    fn appenders_that_all_saw_the_journal_due_compact_it_once() {
        let dir = tempfile::tempdir().unwrap();
        let (journal, _) = KeyedJournal::open(&dir.path().join("journal")).unwrap();
        let keyed = KeyedJournal::new(journal);
        let payloads: Vec<Vec<u8>> = (0..COMPACT_ENTRIES)
            .map(|i| {
                VolumeEntry {
                    volume_id: format!("v{}", i % 4),
                    state: Some(i.to_string().into_bytes()),
                }
                .encode()
            })
            .collect();
        let refs: Vec<&[u8]> = payloads.iter().map(Vec::as_slice).collect();
        keyed.journal.append(&refs).unwrap();
        assert!(keyed.due());
        let compactions = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|scope| {
            for _ in 0..8 {
                scope.spawn(|| {
                    let file_of = |key: &str, _: &Option<Vec<u8>>| Ok(Some(dir.path().join(key)));
                    keyed
                        .compact_when(When::Due, dir.path(), file_of, |_, _| {
                            compactions.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            Vec::new()
                        })
                        .unwrap();
                });
            }
        });
        assert_eq!(compactions.load(std::sync::atomic::Ordering::Relaxed), 1);
        assert_eq!(keyed.journal.size().entries, 0);
        let last = (COMPACT_ENTRIES - 1).to_string().into_bytes();
        assert_eq!(fs::read(dir.path().join("v3")).unwrap(), last);
        // Below the limits, a compaction asked when due writes nothing back.
        keyed
            .append("v0", Some(b"new".to_vec()), Commit::Durable)
            .unwrap();
        keyed
            .compact_when(
                When::Due,
                dir.path(),
                |_: &str, _: &Option<Vec<u8>>| panic!("written back"),
                |_, _| Vec::new(),
            )
            .unwrap();
        assert_eq!(keyed.journal.size().entries, 1);
    }

    #[test]
    fn stale_temps_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join(".volume.state.tmp-1-0"), b"x").unwrap();
        fs::write(dir.path().join("volume.state"), b"y").unwrap();
        remove_stale_temps(dir.path());
        assert!(!dir.path().join(".volume.state.tmp-1-0").exists());
        assert!(dir.path().join("volume.state").exists());
    }

    #[test]
    fn a_failed_write_leaves_the_old_content() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("volume.state");
        write_atomic(&p, b"old").unwrap();
        // A directory squatting on the temp name's parent makes the write fail:
        // use a path whose parent is a file instead.
        let bad = p.join("child");
        assert!(write_atomic(&bad, b"new").is_err());
        assert_eq!(read(&p).unwrap().unwrap(), b"old");
    }
}
