//! What a provider's volume directories hold, as `status` reads them, and the summary of it the
//! provider writes at each compaction, so that `status` need not read them one by one.
//!
//! # The full scan
//! [`volume_dirs`] without a summary: every directory of `volumes/` and every volume only the
//! journal knows, by directory name, each listed (its files set aside as corrupt by an earlier
//! recovery, whether it has a `volume.state`) and its state file read unless the journal's entry
//! covers it; a node's thousands are read by a few threads, each a contiguous run of the sorted
//! names.
//!
//! # The summary: `csi/<type>/<name>/volumes.summary`, format version [`VERSION`]
//! Written by the provider's compaction (`checkpoint::VolumeJournal::compact`) once its state
//! files are written and before the write-back's one `syncfs` ([`build`]): from the last summary
//! (when current), each entry checked by its state file's identity (those just written back are
//! read again), else by the full scan; renamed into place, made durable by that `syncfs` and only
//! then followed by the journal's reset. It records what the full scan finds once that
//! write-back is done (per directory, by name: its set-aside files, its state file's bytes and
//! identity, [`FileId`]), `read_at`: the coarse clock's time its reads began ([`unchanged`]), and
//! `covers`: the journal's sequence number it reaches (every entry before it is in it; the reset
//! journal starts there).
//!
//! A reader uses it only when it is current with the journal it read: the journal's complete
//! entries run from `first` to `first + n` and `first ≤ covers ≤ first + n` ([`current`]: the
//! journal was reset at it, or a crash came between the summary and the reset and the old
//! journal is whole). It then lays the journal's complete entries over it (those before `covers`
//! say again what it says; a crash before the reset may have left the directory of one of them
//! unmade, and the entry still names the volume, as for the full scan), lists `volumes/` once
//! and `statx`es each state file the summary holds: a directory the summary does not name, names
//! and the listing does not show, or whose state file is gone or not the one it recorded
//! (changed behind the provider's back: status reads the truth), is read as the full scan reads
//! it. A summary that is absent, stale, torn (a CRC-32C
//! covers the whole file), of another format version, over [`MAX_FILE`], not a regular file or a
//! symlink (never followed) is not used: the full scan is, the same answer byte for byte.
//!
//! Whoever changes a volume directory outside a compaction removes the summary first, durably:
//! `checkpoint::settle_journal` (commands that write state files themselves, `volume detach`)
//! and recovery's setting aside of a corrupt state file. A provider's next compaction writes a
//! new one (by the full scan, once).
//!
//! Layout: a header of [`HEADER_LEN`] bytes (the magic `CSIVSUM\n`, the version (u32 LE), four
//! zero bytes, `covers` (u64 LE), the number of directories (u64 LE), `read_at` (ns, i128 LE));
//! then per directory, in strictly increasing name order: its name (u32 LE length, bytes), the
//! number of its set-aside files (u32 LE) and each name (u32 LE length, bytes), 0 (no state
//! file) or 1, the state file's identity (dev, inode, size: u64 LE; mtime, ctime: ns, i128 LE)
//! and its bytes (u32 LE length, bytes); then the CRC-32C (u32 LE) of everything before it.
//! Everything in it is checked as hostile input: lengths within the file, names single path
//! components (set-aside ones `volume.state.corrupt-*`).

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::Path;

use bytes::Bytes;

use crate::durable::journal::crc32c;
use crate::resource::STATE_FILE;

/// The state files as a journal leaves them, by volume directory name: the volume id and the
/// bytes (`None`: removed). The provider's journal (`checkpoint`) builds it; the summary and
/// recovery read it.
pub type Journaled = BTreeMap<String, (String, Option<Vec<u8>>)>;

/// The summary's file name, beside `volumes/` and `journal` under `csi/<type>/<name>/`.
pub const SUMMARY_FILE: &str = "volumes.summary";
/// The magic that starts a summary.
pub const MAGIC: [u8; 8] = *b"CSIVSUM\n";
/// The format version this build writes and the only one it reads.
pub const VERSION: u32 = 2;
/// The header's length.
pub const HEADER_LEN: usize = 48;
/// The bytes of a state file's identity ([`FileId`]).
const ID_LEN: usize = 48;
/// The largest summary read: a bigger file is refused, never read into memory.
pub const MAX_FILE: u64 = 256 << 20;
/// The longest directory or file name (NAME_MAX).
const MAX_NAME: usize = 255;
/// Volume directories per thread below which one thread reads them all (at most
/// [`crate::offload::scoped_runs`]'s threads).
pub const DIRS_PER_THREAD: usize = 1024;

/// One directory of `volumes/` as `status` reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeDir {
    /// Its name (the encoded volume id).
    pub name: String,
    /// The names of its state files set aside by an earlier recovery, sorted.
    pub set_aside: Vec<OsString>,
    /// Its state: the journal's last entry, else its `volume.state`'s bytes, or why they cannot
    /// be read; `None`: neither (or the journal removed it).
    pub state: Option<Result<Bytes, String>>,
    /// The identity of the `volume.state` whose bytes `state` holds (taken from the open file
    /// before its read); `None` when they are the journal's, or there are none.
    pub state_file: Option<FileId>,
}

/// What tells a file's contents changed without reading them: its device and inode (a file
/// renamed over it), size, and modification and change times in ns (a write in place; the
/// change time cannot be set from user space). A write within the same tick of the file
/// system's clock as the recorded times keeps them: see [`unchanged`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct FileId {
    /// `st_dev`.
    pub dev: u64,
    /// `st_ino`.
    pub ino: u64,
    /// `st_size`.
    pub size: u64,
    /// `st_mtime` in ns since the epoch.
    pub mtime_ns: i128,
    /// `st_ctime` in ns since the epoch.
    pub ctime_ns: i128,
}

impl FileId {
    /// The identity in `st` (from `fstat`, or `fstatat`/`lstat` without following a symlink).
    pub fn of_stat(st: &nix::sys::stat::FileStat) -> FileId {
        // Whatever width the C library gives the time fields.
        let ns = |s: i128, n: i128| s * 1_000_000_000 + n;
        FileId {
            dev: st.st_dev,
            ino: st.st_ino,
            size: st.st_size as u64,
            mtime_ns: ns(st.st_mtime.into(), st.st_mtime_nsec.into()),
            ctime_ns: ns(st.st_ctime.into(), st.st_ctime_nsec.into()),
        }
    }
}

/// Whether a state file whose identity is `now` still holds the bytes a summary recorded with
/// `recorded`, the summary's reads having started at `read_at` (the file system's coarse clock,
/// ns; pure). Identical identities prove it only when the recorded change time is before
/// `read_at`: a write after the summary's read then gets a later change time (file systems
/// stamp at least the coarse clock's time), while one in the same tick as a recent change
/// would keep every field (the "racy" case; such an entry is read again).
pub fn unchanged(recorded: &FileId, now: &FileId, read_at: i128) -> bool {
    recorded == now && recorded.ctime_ns < read_at
}

/// The coarse real-time clock the file systems stamp files from, in ns since the epoch.
pub fn coarse_now() -> i128 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for the call's duration; the clock id is a
    // constant the kernel knows (it fails only for an unknown id, checked below).
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_REALTIME_COARSE, &mut ts) };
    assert_eq!(rc, 0, "CLOCK_REALTIME_COARSE is always readable");
    i128::from(ts.tv_sec) * 1_000_000_000 + i128::from(ts.tv_nsec)
}

/// A summary read back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Summary {
    /// The journal's sequence number it reaches.
    pub covers: u64,
    /// When the reads it records started ([`coarse_now`]; see [`unchanged`]).
    pub read_at: i128,
    /// Its directories, by name.
    pub dirs: Vec<VolumeDir>,
}

/// Whether a summary covering up to `covers` is current with a journal whose complete entries
/// run from `first` for `entries` (see the module doc; pure).
pub fn current(covers: u64, first: u64, entries: u64) -> bool {
    first <= covers && covers <= first.saturating_add(entries)
}

/// The summary's bytes (see the module doc; pure): `Err` names a directory whose state could
/// not be read (a summary would not say the same as the full scan). Directories with neither
/// state nor set-aside files are left out (the full scan shows nothing for them).
pub fn encode(covers: u64, read_at: i128, dirs: &[VolumeDir]) -> Result<Vec<u8>, String> {
    let kept: Vec<&VolumeDir> = dirs
        .iter()
        .filter(|d| d.state.is_some() || !d.set_aside.is_empty())
        .collect();
    let mut out = Vec::with_capacity(
        HEADER_LEN
            + kept
                .iter()
                .map(|d| {
                    let state = d
                        .state
                        .as_ref()
                        .map_or(0, |s| s.as_ref().map_or(0, Bytes::len));
                    d.name.len() + state + ID_LEN + 16
                })
                .sum::<usize>()
            + 4,
    );
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&[0; 4]);
    out.extend_from_slice(&covers.to_le_bytes());
    out.extend_from_slice(&(kept.len() as u64).to_le_bytes());
    out.extend_from_slice(&read_at.to_le_bytes());
    let put = |out: &mut Vec<u8>, bytes: &[u8]| {
        out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
        out.extend_from_slice(bytes);
    };
    for d in kept {
        put(&mut out, d.name.as_bytes());
        out.extend_from_slice(&(d.set_aside.len() as u32).to_le_bytes());
        for name in &d.set_aside {
            put(&mut out, name.as_bytes());
        }
        match (&d.state, &d.state_file) {
            (None, _) => out.push(0),
            (Some(Ok(state)), Some(id)) => {
                out.push(1);
                for n in [id.dev, id.ino, id.size] {
                    out.extend_from_slice(&n.to_le_bytes());
                }
                out.extend_from_slice(&id.mtime_ns.to_le_bytes());
                out.extend_from_slice(&id.ctime_ns.to_le_bytes());
                put(&mut out, state);
            }
            (Some(Ok(_)), None) => {
                return Err(format!(
                    "volume directory {}: a state not read from its file",
                    d.name
                ))
            }
            (Some(Err(why)), _) => return Err(format!("volume directory {}: {why}", d.name)),
        }
    }
    let crc = crc32c(&[&out]);
    out.extend_from_slice(&crc.to_le_bytes());
    Ok(out)
}

/// Reads a summary's bytes back, trusting nothing in them (see the module doc; pure). The
/// states it holds are slices of `bytes`, not copies (megabytes at 10,000 volumes).
pub fn decode(bytes: &Bytes) -> Result<Summary, String> {
    if bytes.len() < HEADER_LEN + 4 {
        return Err(format!(
            "{} bytes: shorter than a summary's header and checksum",
            bytes.len()
        ));
    }
    if bytes[..8] != MAGIC {
        return Err("no summary magic at its start: not a volume summary".into());
    }
    let (body, crc) = bytes.split_at(bytes.len() - 4);
    let mut r = Reader { bytes: body, at: 8 };
    let version = r.u32()?;
    if version != VERSION {
        return Err(format!(
            "format version {version}, this build reads {VERSION}"
        ));
    }
    if crc32c(&[body]) != u32::from_le_bytes(crc.try_into().expect("4 bytes")) {
        return Err("its checksum does not match: torn or damaged".into());
    }
    if r.u32()? != 0 {
        return Err("reserved header bytes are not zero".into());
    }
    let covers = r.u64()?;
    let count = r.u64()?;
    let read_at = r.i128()?;
    // Each directory takes at least 9 bytes: never trust the count for an allocation.
    if count > (body.len() - HEADER_LEN) as u64 / 9 {
        return Err(format!("{count} directories in {} bytes", bytes.len()));
    }
    let mut dirs: Vec<VolumeDir> = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let name = std::str::from_utf8(r.name()?)
            .map_err(|_| "a directory name that is not UTF-8".to_string())?
            .to_string();
        if let Some(last) = dirs.last() {
            if last.name >= name {
                return Err(format!(
                    "directory {name:?} after {:?}: not in increasing order",
                    last.name
                ));
            }
        }
        let asides = r.u32()?;
        let mut set_aside = Vec::new();
        for _ in 0..asides {
            let aside = r.name()?;
            if !aside.starts_with(format!("{STATE_FILE}.corrupt-").as_bytes()) {
                return Err(format!(
                    "a set-aside file {:?} in {name:?} not named {STATE_FILE}.corrupt-*",
                    String::from_utf8_lossy(aside)
                ));
            }
            set_aside.push(OsString::from_vec(aside.to_vec()));
        }
        let (state, state_file) = match r.take(1)?[0] {
            0 => (None, None),
            1 => {
                let id = FileId {
                    dev: r.u64()?,
                    ino: r.u64()?,
                    size: r.u64()?,
                    mtime_ns: r.i128()?,
                    ctime_ns: r.i128()?,
                };
                let len = r.u32()? as usize;
                (Some(Ok(bytes.slice_ref(r.take(len)?))), Some(id))
            }
            f => return Err(format!("a state flag of {f} in {name:?}")),
        };
        dirs.push(VolumeDir {
            name,
            set_aside,
            state,
            state_file,
        });
    }
    if r.at != body.len() {
        return Err(format!(
            "{} bytes after its last directory",
            body.len() - r.at
        ));
    }
    Ok(Summary {
        covers,
        read_at,
        dirs,
    })
}

/// A cursor over a summary's bytes.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&end| end <= self.bytes.len())
            .ok_or_else(|| format!("{n} bytes wanted at byte {}, past its end", self.at))?;
        let out = &self.bytes[self.at..end];
        self.at = end;
        Ok(out)
    }

    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }

    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }

    fn i128(&mut self) -> Result<i128, String> {
        Ok(i128::from_le_bytes(self.take(16)?.try_into().expect("16")))
    }

    /// A name: one path component, not empty, `.` or `..`, without `/` or NUL.
    fn name(&mut self) -> Result<&'a [u8], String> {
        let len = self.u32()? as usize;
        if len > MAX_NAME {
            return Err(format!("a name of {len} bytes, over {MAX_NAME}"));
        }
        let name = self.take(len)?;
        if name.is_empty()
            || name == b"."
            || name == b".."
            || name.contains(&b'/')
            || name.contains(&0)
        {
            return Err(format!(
                "a name {:?} that is not one path component",
                String::from_utf8_lossy(name)
            ));
        }
        Ok(name)
    }
}

/// Reads the summary at `path` (never following a symlink, refusing what is not a regular file
/// or is over [`MAX_FILE`]): `Ok(None)` when there is none, `Err` why it is refused.
pub fn read(path: &Path) -> Result<Option<Summary>, String> {
    match crate::durable::read_capped(path, MAX_FILE) {
        Ok(None) => Ok(None),
        Ok(Some(bytes)) => decode(&Bytes::from(bytes)).map(Some),
        Err(e) => Err(e.to_string()),
    }
}

/// The summary at `path` if it is current with a journal whose complete entries run from
/// `first` for `entries` ([`current`]); `None` otherwise, a refused one logged with a warning
/// (the caller then reads the directories one by one).
pub fn read_current(path: &Path, first: u64, entries: u64) -> Option<Summary> {
    keep_current(path, read(path), first, entries)
}

/// [`read_current`] of what [`read`] answered for `path` (read before the journal, or beside it).
pub fn keep_current(
    path: &Path,
    read: Result<Option<Summary>, String>,
    first: u64,
    entries: u64,
) -> Option<Summary> {
    match read {
        Ok(Some(s)) if current(s.covers, first, entries) => Some(s),
        Ok(Some(s)) => {
            tracing::debug!(summary = %path.display(), covers = s.covers, first, entries,
                "volume summary not current with the journal: reading every volume directory");
            None
        }
        Ok(None) => None,
        Err(why) => {
            tracing::warn!(summary = %path.display(), %why,
                "volume summary refused: reading every volume directory instead");
            None
        }
    }
}

/// Every directory of `volumes` and every volume only `journaled` knows, by name, with
/// `journaled` over the state files (see the module doc): from `summary` (current with the
/// journal `journaled` replays), one listing of `volumes` and one `statx` per state file the
/// summary holds, reading only the directories it does not cover or whose state file is not the
/// one it recorded ([`unchanged`]); without one, by the full scan. Either way the same answer.
/// `per_thread`: directories per reading thread ([`DIRS_PER_THREAD`]). Also returns how many
/// directories were read one by one. [`plan`] then [`resolve`] on each run of its names.
pub fn volume_dirs(
    volumes: &Path,
    summary: Option<Summary>,
    journaled: &Journaled,
    per_thread: usize,
) -> (Vec<VolumeDir>, usize) {
    let plan = plan(list(volumes), summary, journaled);
    let found = crate::offload::scoped_runs(plan.names, per_thread, |run| {
        resolve(volumes, journaled, plan.read_at, run)
    });
    let read = found.iter().filter(|(_, read)| *read).count();
    (found.into_iter().map(|(dir, _)| dir).collect(), read)
}

/// The directories [`volume_dirs`] answers, by name, before any is checked or read.
#[derive(Debug)]
pub struct Plan {
    /// Each name, in order, with the summary's entry for it.
    pub names: Vec<Named>,
    /// When the summary's reads began ([`Summary::read_at`]; `i128::MIN` without one).
    pub read_at: i128,
}

/// A volume directory's name and the summary's entry for it, if any: what [`resolve`] answers.
#[derive(Debug)]
pub struct Named {
    name: String,
    known: Option<VolumeDir>,
}

/// The names `volumes` lists, sorted (none when it cannot be listed: the journal may still name
/// volumes).
pub fn list(volumes: &Path) -> Vec<String> {
    let mut listed: Vec<String> = std::fs::read_dir(volumes)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    listed.sort_unstable();
    listed.dedup();
    listed
}

/// Every name `listed` (by [`list`]) or journaled, in order, each listed one with the summary's
/// entry for it if any (a named one that is gone is not used: the full scan does not see it,
/// unless the journal names it: read). Three sorted sequences merged.
pub fn plan(listed: Vec<String>, summary: Option<Summary>, journaled: &Journaled) -> Plan {
    let read_at = summary.as_ref().map_or(i128::MIN, |s| s.read_at);
    let mut known = summary.into_iter().flat_map(|s| s.dirs).peekable();
    let mut listed = listed.into_iter().peekable();
    let mut journal = journaled.keys().peekable();
    let mut names = Vec::with_capacity(listed.len() + journaled.len());
    loop {
        let name = match (listed.peek(), journal.peek()) {
            (None, None) => break,
            (Some(l), Some(j)) if l <= *j => {
                journal.next_if(|j| *j == l);
                listed.next()
            }
            (Some(_), None) => listed.next(),
            (_, Some(_)) => {
                names.extend(journal.next().map(|j| Named {
                    name: j.clone(),
                    known: None,
                }));
                continue;
            }
        };
        let Some(name) = name else { break };
        while known.next_if(|d| d.name < name).is_some() {}
        let known = known.next_if(|d| d.name == name);
        names.push(Named { name, known });
    }
    Plan { names, read_at }
}

/// A run of a [`Plan`]'s names answered (see [`volume_dirs`]), each with whether it was read
/// one by one. The state files' statx relative to `volumes/`, opened once: a walk of two
/// components each.
pub fn resolve(
    volumes: &Path,
    journaled: &Journaled,
    read_at: i128,
    run: Vec<Named>,
) -> Vec<(VolumeDir, bool)> {
    let volumes_fd = std::fs::File::open(volumes).ok();
    run.into_iter()
        .map(|Named { name, known }| {
            let journal = journaled.get(&name).map(|(_, s)| s);
            match (known, journal) {
                // The journal's entry over the summary's set-aside files: only a recovery (which
                // removes the summary first) sets files aside.
                (Some(mut dir), Some(state)) => {
                    dir.state = state.clone().map(|b| Ok(b.into()));
                    dir.state_file = None;
                    (dir, false)
                }
                (Some(dir), None)
                    if still_recorded(volumes_fd.as_ref(), volumes, &dir, read_at) =>
                {
                    (dir, false)
                }
                (_, journal) => (read_volume_dir(volumes, &name, journal), true),
            }
        })
        .collect()
}

/// Whether the summary's entry `dir` is still what its directory holds: it names a state file
/// whose identity is unchanged since the summary's reads (one `statx`, no link followed). An
/// entry without a state file (set-aside files only: rare) is always read again.
fn still_recorded(
    volumes_fd: Option<&std::fs::File>,
    volumes: &Path,
    dir: &VolumeDir,
    read_at: i128,
) -> bool {
    let Some(recorded) = &dir.state_file else {
        return false;
    };
    let relative = Path::new(&dir.name).join(STATE_FILE);
    let now = match volumes_fd {
        Some(fd) => nix::sys::stat::fstatat(
            fd,
            relative.as_path(),
            nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
        )
        .ok()
        .map(|st| FileId::of_stat(&st)),
        None => nix::sys::stat::lstat(&volumes.join(&relative))
            .ok()
            .map(|st| FileId::of_stat(&st)),
    };
    now.is_some_and(|now| unchanged(recorded, &now, read_at))
}

/// One volume directory: one listing (its set-aside files, whether it has a state file), then
/// the state file's read unless the journal covers it (`journaled`: the journal's last entry),
/// with its identity from the open file, taken before the read (a write during the read then
/// changes it later).
fn read_volume_dir(volumes: &Path, name: &str, journaled: Option<&Option<Vec<u8>>>) -> VolumeDir {
    let dir = volumes.join(name);
    let corrupt_prefix = format!("{STATE_FILE}.corrupt-");
    let mut set_aside = Vec::new();
    let mut has_state = None;
    if let Ok(entries) = std::fs::read_dir(&dir) {
        let mut found = false;
        for e in entries.flatten() {
            let file = e.file_name();
            if file == STATE_FILE {
                found = true;
            } else if file.to_string_lossy().starts_with(&corrupt_prefix) {
                set_aside.push(file);
            }
        }
        has_state = Some(found);
    }
    set_aside.sort();
    let (state, state_file) = match (journaled, has_state) {
        (Some(entry), _) => (entry.clone().map(|b| Ok(b.into())), None),
        // Listed without a state file: nothing to read.
        (None, Some(false)) => (None, None),
        // Listed with one, or not listable (the read says why).
        (None, _) => match read_with_id(&dir.join(STATE_FILE)) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => (None, None),
            Err(e) => (Some(Err(e.to_string())), None),
            Ok((bytes, id)) => (Some(Ok(bytes.into())), Some(id)),
        },
    };
    VolumeDir {
        name: name.to_string(),
        set_aside,
        state,
        state_file,
    }
}

/// A file's bytes and its identity, taken from the open file before the read.
fn read_with_id(path: &Path) -> std::io::Result<(Vec<u8>, FileId)> {
    use std::io::Read;
    let mut file = std::fs::File::open(path)?;
    let id = FileId::of_stat(&nix::sys::stat::fstat(&file)?);
    let mut bytes = Vec::with_capacity(id.size as usize);
    file.read_to_end(&mut bytes)?;
    Ok((bytes, id))
}

/// The summary a compaction writes for `layout` once its state files are written back (see the
/// module doc): what the directories hold, from the last summary when it is current with the
/// journal being compacted (its complete entries from `first` up to `covers`; each entry
/// checked by its state file's identity, those written back read again), else by the full
/// scan. `None`: a directory could not be read, so no summary is written (and the last one is
/// removed with the write-back).
pub fn build(layout: &crate::resource::Layout, first: u64, covers: u64) -> Option<Vec<u8>> {
    // Before any read: a write after it gets a later change time.
    let read_at = coarse_now();
    let path = layout.base().join(SUMMARY_FILE);
    let last = read_current(&path, first, covers.saturating_sub(first));
    let (dirs, _) = volume_dirs(
        &layout.volumes_dir(),
        last,
        &Journaled::new(),
        DIRS_PER_THREAD,
    );
    match encode(covers, read_at, &dirs) {
        Ok(bytes) => Some(bytes),
        Err(why) => {
            tracing::warn!(summary = %path.display(), %why,
                "no volume summary written: status reads every volume directory until the next compaction");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn decoded(bytes: &[u8]) -> Result<Summary, String> {
        decode(&Bytes::copy_from_slice(bytes))
    }
    use crate::durable::journal::Commit;
    use crate::mount::FakeSyscall;
    use crate::provider::checkpoint::{self, VolumeJournal};
    use crate::provider::state::{Capability, VolumeRecord, VolumeState};
    use crate::provider::status::{scan_with, ScanOptions, StatusReport};
    use crate::resource::Layout;

    fn rec(id: &str, state: VolumeState, user: Option<&str>) -> Vec<u8> {
        let mut r = VolumeRecord::new(id, Capability::default());
        r.state = state;
        r.users = user.iter().map(|u| u.to_string()).collect();
        serde_json::to_vec_pretty(&r).unwrap()
    }

    fn record_created(j: &VolumeJournal, id: &str) {
        j.record(
            id,
            Some(rec(id, VolumeState::Created, None)),
            Commit::Durable,
        )
        .unwrap();
    }

    /// Both scans of `work`, as `status --json` prints them; the summary's scan must say the
    /// same as the full one. Returns whether the summary was current (used).
    fn same_answer(work: &Path, layout: &Layout, table: &FakeSyscall, what: &str) -> bool {
        let json = |r: StatusReport| serde_json::to_string_pretty(&r).unwrap();
        let how = |use_summary| ScanOptions {
            use_summary,
            dirs_per_thread: 4,
        };
        let full = json(scan_with(work, table, how(false)).unwrap());
        let fast = json(scan_with(work, table, how(true)).unwrap());
        assert_eq!(
            fast, full,
            "{what}: the summary's answer differs from the full scan's"
        );
        match checkpoint::read_journal_entries(layout) {
            Ok(Some(p)) => read_current(
                &layout.base().join(SUMMARY_FILE),
                p.first_seq,
                p.entries.len() as u64,
            )
            .is_some(),
            _ => false,
        }
    }

    /// A small deterministic generator (xorshift): the same run every time.
    struct Rng(u64);
    impl Rng {
        fn below(&mut self, n: u64) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0 % n
        }
    }

    /// Generated work dirs: records, removals, journal tails (durable and lazy), compactions,
    /// reopens (replay), creates in progress (a volume directory without its state file), files
    /// set aside by a recovery, `volume detach`'s direct writes, directories made and removed
    /// behind the provider's back, and a summary that is stale, torn, of another version,
    /// older than the journal's first entry or newer than the journal: after every step the
    /// summary's scan says what the full scan says, and the summary was current (used) in most
    /// of them.
    #[test]
    fn the_summary_answers_as_the_full_scan_over_generated_work_dirs() {
        let dir = tempfile::tempdir().unwrap();
        let work = dir.path();
        let layout = Layout::new(work, "t", "n");
        std::fs::create_dir_all(layout.volumes_dir()).unwrap();
        let table = FakeSyscall::new();
        let summary = layout.base().join(SUMMARY_FILE);
        let jpath = layout.base().join(checkpoint::JOURNAL_FILE);
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let mut journal = Some(VolumeJournal::open(&layout).unwrap().0);
        let states = [
            VolumeState::Created,
            VolumeState::NodeReady,
            VolumeState::Published,
            VolumeState::NodeStage,
        ];
        let (mut used, mut steps) = (0, 0);
        let mut saved: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
        for step in 0..400 {
            let id = format!("v{}", rng.below(24));
            let j = journal.as_ref().unwrap();
            let what = match rng.below(20) {
                0..=6 => {
                    let s = states[rng.below(4) as usize];
                    if s == VolumeState::Published {
                        table.add_mount("x", &layout.target_path(&id), "ext4");
                    }
                    let user = (rng.below(2) == 0).then_some("c1");
                    let commit = if rng.below(3) == 0 {
                        Commit::Lazy
                    } else {
                        Commit::Durable
                    };
                    j.record(&id, Some(rec(&id, s, user)), commit).unwrap();
                    format!("record {id} {s}")
                }
                7 | 8 => {
                    j.record(&id, None, Commit::Durable).unwrap();
                    format!("remove {id}")
                }
                9..=11 => {
                    if rng.below(3) == 0 {
                        saved.push((
                            std::fs::read(&summary).unwrap_or_default(),
                            std::fs::read(&jpath).unwrap(),
                        ));
                    }
                    j.compact().unwrap();
                    "compact".into()
                }
                12 => {
                    drop(journal.take());
                    journal = Some(VolumeJournal::open(&layout).unwrap().0);
                    "reopen".into()
                }
                13 => {
                    // A create in progress: its directory made, no state file yet.
                    std::fs::create_dir_all(layout.volume_dir(&format!("new{step}"))).unwrap();
                    "an empty volume directory".into()
                }
                14 => {
                    // Recovery sets a corrupt state file aside (dropping the summary first).
                    let p = layout.state_file(&id);
                    if p.exists() {
                        std::fs::write(&p, b"{torn").unwrap();
                        j.drop_summary().unwrap();
                        checkpoint::set_aside(&p).unwrap();
                        std::fs::rename(
                            layout.volume_dir(&id).join(
                                std::fs::read_dir(layout.volume_dir(&id))
                                    .unwrap()
                                    .next()
                                    .unwrap()
                                    .unwrap()
                                    .file_name(),
                            ),
                            layout
                                .volume_dir(&id)
                                .join(format!("{STATE_FILE}.corrupt-{step}")),
                        )
                        .unwrap();
                    }
                    format!("set aside {id}")
                }
                15 => {
                    // `volume detach`: the journal settled, a state file written directly.
                    drop(journal.take());
                    checkpoint::settle_journal(&layout).unwrap();
                    let p = layout.state_file(&id);
                    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
                    checkpoint::write_atomic(&p, &rec(&id, VolumeState::Created, None)).unwrap();
                    journal = Some(VolumeJournal::open(&layout).unwrap().0);
                    format!("detach writes {id}")
                }
                16 => {
                    // Behind the provider's back: a directory made (an older release's volume)
                    // or removed whole.
                    let other = format!("w{}", rng.below(4));
                    if rng.below(2) == 0 {
                        let p = layout.state_file(&other);
                        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
                        std::fs::write(p, rec(&other, VolumeState::Created, None)).unwrap();
                    } else {
                        let _ = std::fs::remove_dir_all(layout.volume_dir(&other));
                    }
                    format!("made or removed {other} behind its back")
                }
                17 => {
                    // A stale summary: an older one (with, or without, its own journal back).
                    if let Some((s, jr)) = saved.get(rng.below(saved.len().max(1) as u64) as usize)
                    {
                        std::fs::write(&summary, s).unwrap();
                        if rng.below(2) == 0 {
                            drop(journal.take());
                            std::fs::write(&jpath, jr).unwrap();
                            journal = Some(VolumeJournal::open(&layout).unwrap().0);
                        }
                    }
                    "an older summary".into()
                }
                18 => {
                    // Torn or of another version.
                    if let Some(mut b) = std::fs::read(&summary).ok().filter(|b| b.len() > 9) {
                        let at = rng.below(b.len() as u64) as usize;
                        if rng.below(2) == 0 {
                            b[at] ^= 0x20;
                        } else {
                            b[8] = 1;
                        }
                        std::fs::write(&summary, b).unwrap();
                    }
                    "a damaged summary".into()
                }
                _ => {
                    let _ = std::fs::remove_file(&summary);
                    "no summary".into()
                }
            };
            steps += 1;
            if same_answer(work, &layout, &table, &format!("step {step}: {what}")) {
                used += 1;
            }
        }
        eprintln!("{steps} steps, the summary current (and used) after {used}");
        // Destructive steps leave it stale until the next compaction: a third of the steps
        // read it, the rest checked the fallback.
        assert!(
            used * 4 > steps,
            "the summary was current in only {used} of {steps} steps"
        );
    }

    /// Status reads the truth: a state file corrupted, truncated, replaced (renamed over, same
    /// size), rewritten in place with the same size, or removed behind the provider's back
    /// after a summary was written is read again (the summary's scan says what the full scan
    /// says: the unreadable ones unreadable), while the unchanged ones are taken from the
    /// summary with one statx each.
    #[test]
    fn state_files_changed_behind_the_summary_are_read_again() {
        let dir = tempfile::tempdir().unwrap();
        let work = dir.path();
        let layout = Layout::new(work, "t", "n");
        std::fs::create_dir_all(layout.volumes_dir()).unwrap();
        let (j, _, _) = VolumeJournal::open(&layout).unwrap();
        let ids = ["a", "b", "c", "d", "e", "f", "g", "h"];
        for id in ids {
            record_created(&j, id);
        }
        j.compact().unwrap();
        // Past the first summary's clock tick, a second compaction checks every entry again:
        // none written since its reads began, all are trusted now.
        std::thread::sleep(std::time::Duration::from_millis(30));
        record_created(&j, "z");
        j.compact().unwrap();
        let table = FakeSyscall::new();
        let read_one_by_one = || {
            let s = read(&layout.base().join(SUMMARY_FILE)).unwrap().unwrap();
            volume_dirs(&layout.volumes_dir(), Some(s), &Journaled::new(), 4).1
        };
        assert!(same_answer(work, &layout, &table, "unchanged"));
        assert!(
            read_one_by_one() <= 1,
            "only z (written in the last tick) is read again"
        );

        let state = |id: &str| layout.state_file(id);
        std::fs::write(state("a"), b"{not json").unwrap();
        let full = std::fs::read(state("b")).unwrap();
        std::fs::write(state("b"), &full[..full.len() / 2]).unwrap();
        let newer = String::from_utf8(full.clone())
            .unwrap()
            .replace("\"format\": 1", "\"format\": 9");
        assert_eq!(newer.len(), full.len());
        let planted = layout.volume_dir("c").join("planted");
        std::fs::write(&planted, &newer).unwrap();
        std::fs::rename(&planted, state("c")).unwrap();
        // In place, the same size, at once: the same inode and size, only the times differ.
        std::fs::write(state("d"), rec("d", VolumeState::NodeReady, None)).unwrap();
        std::fs::remove_file(state("e")).unwrap();
        std::fs::write(state("f"), &newer).unwrap();
        assert!(same_answer(
            work,
            &layout,
            &table,
            "changed behind its back"
        ));
        assert!(
            read_one_by_one() >= 6,
            "the six changed ones are read again"
        );
        let report = scan_with(work, &table, ScanOptions::default()).unwrap();
        let unreadable: BTreeSet<String> = report
            .unreadable
            .iter()
            .map(|u| {
                u.path
                    .parent()
                    .unwrap()
                    .file_name()
                    .unwrap()
                    .to_string_lossy()
                    .into()
            })
            .collect();
        let names = |ids: &[&str]| -> BTreeSet<String> {
            ids.iter()
                .map(|id| crate::resource::encode_volume_id(id))
                .collect()
        };
        assert_eq!(unreadable, names(&["a", "b", "c", "f"]), "{report:?}");
        let d = report.volumes.iter().find(|v| v.volume_id == "d").unwrap();
        assert_eq!(d.state, VolumeState::NodeReady);
        assert!(report.volumes.iter().all(|v| v.volume_id != "e"));
    }

    /// `status` answers from a current summary, not from the state files alone: a summary entry
    /// whose recorded identity matches its (unchanged) state file is what the report shows,
    /// even where it says something else than the file (planted here; a real summary never
    /// does). Without the summary, the file.
    #[test]
    fn status_answers_from_a_current_summary() {
        let dir = tempfile::tempdir().unwrap();
        let work = dir.path();
        let layout = Layout::new(work, "t", "n");
        std::fs::create_dir_all(layout.volumes_dir()).unwrap();
        let (j, _, _) = VolumeJournal::open(&layout).unwrap();
        for id in ["a", "b"] {
            record_created(&j, id);
        }
        j.compact().unwrap();
        // Past the summary's clock tick, so that its identities are trusted.
        std::thread::sleep(std::time::Duration::from_millis(30));
        record_created(&j, "z");
        j.compact().unwrap();
        let path = layout.base().join(SUMMARY_FILE);
        let mut summary = read(&path).unwrap().unwrap();
        let a = crate::resource::encode_volume_id("a");
        let entry = summary.dirs.iter_mut().find(|d| d.name == a).unwrap();
        assert!(
            entry.state_file.is_some(),
            "the summary records a's identity"
        );
        entry.state = Some(Ok(rec("a", VolumeState::NodeReady, None).into()));
        let planted = encode(summary.covers, summary.read_at, &summary.dirs).unwrap();
        std::fs::write(&path, planted).unwrap();
        let table = FakeSyscall::new();
        let state_of = |use_summary| {
            let how = ScanOptions {
                use_summary,
                ..ScanOptions::default()
            };
            let report = scan_with(work, &table, how).unwrap();
            let a = report.volumes.iter().find(|v| v.volume_id == "a").unwrap();
            a.state
        };
        assert_eq!(state_of(true), VolumeState::NodeReady, "from the summary");
        assert_eq!(state_of(false), VolumeState::Created, "from the state file");
    }

    #[test]
    fn an_identity_proves_nothing_changed_only_when_recorded_before_the_reads() {
        let id = FileId {
            dev: 1,
            ino: 2,
            size: 3,
            mtime_ns: 100,
            ctime_ns: 100,
        };
        let other = |f: &dyn Fn(&mut FileId)| {
            let mut o = id;
            f(&mut o);
            o
        };
        assert!(unchanged(&id, &id, 101));
        // Changed in the same tick as the reads began (or later): a write after the read could
        // have kept every field.
        assert!(!unchanged(&id, &id, 100));
        assert!(!unchanged(&id, &id, 99));
        for changed in [
            other(&|o| o.dev = 9),
            other(&|o| o.ino = 9),
            other(&|o| o.size = 9),
            other(&|o| o.mtime_ns = 9),
            other(&|o| o.ctime_ns = 101),
        ] {
            assert!(!unchanged(&id, &changed, 1000), "{changed:?}");
        }
    }

    #[test]
    fn a_summary_round_trips_and_hostile_bytes_are_refused() {
        let dirs = vec![
            VolumeDir {
                name: "a".into(),
                set_aside: vec![],
                state: Some(Ok(Bytes::from_static(b"{}"))),
                state_file: Some(FileId {
                    dev: 1,
                    ino: 2,
                    size: 2,
                    mtime_ns: -3,
                    ctime_ns: 1 << 70,
                }),
            },
            VolumeDir {
                name: "b".into(),
                set_aside: vec!["volume.state.corrupt-1".into()],
                state: None,
                state_file: None,
            },
            VolumeDir {
                name: "c".into(),
                set_aside: vec![],
                state: None,
                state_file: None,
            },
        ];
        let bytes = encode(7, 5, &dirs).unwrap();
        let back = decoded(&bytes).unwrap();
        assert_eq!((back.covers, back.read_at), (7, 5));
        assert_eq!(back.dirs, dirs[..2], "an empty directory is left out");
        let mut unreadable = dirs.clone();
        unreadable[0].state = Some(Err("EIO".into()));
        assert!(encode(7, 5, &unreadable).unwrap_err().contains("EIO"));
        let mut journaled = dirs.clone();
        journaled[0].state_file = None;
        assert!(encode(7, 5, &journaled)
            .unwrap_err()
            .contains("not read from its file"));
        // Every cut and every flipped byte is refused.
        for n in 0..bytes.len() {
            assert!(decoded(&bytes[..n]).is_err(), "cut at {n}");
            let mut b = bytes.clone();
            b[n] ^= 1;
            assert!(decoded(&b).is_err(), "flip at {n}");
        }
        // Well-formed (checksummed) but hostile: a path in a name, names out of order, a
        // set-aside name of another file, another version, a count no file could hold.
        let with = |f: &dyn Fn(&mut Vec<VolumeDir>)| {
            let mut d = dirs.clone();
            f(&mut d);
            decoded(&encode(7, 5, &d).unwrap()).unwrap_err()
        };
        assert!(with(&|d| d[0].name = "../x".into()).contains("path component"));
        assert!(with(&|d| d[0].name = "..".into()).contains("path component"));
        assert!(with(&|d| d.swap(0, 1)).contains("increasing order"));
        assert!(with(&|d| d[1].set_aside = vec!["journal".into()]).contains("corrupt-*"));
        let reseal = |mut b: Vec<u8>| {
            let n = b.len() - 4;
            let crc = crc32c(&[&b[..n]]);
            b[n..].copy_from_slice(&crc.to_le_bytes());
            b
        };
        for version in [1, 3] {
            let mut other = bytes.clone();
            other[8] = version;
            assert!(decoded(&reseal(other))
                .unwrap_err()
                .contains(&format!("format version {version}")));
        }
        let mut many = bytes.clone();
        many[24..32].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(decoded(&reseal(many))
            .unwrap_err()
            .contains("directories in"));
    }

    /// The summary is a file the root daemon's `status` reads (docs/SECURITY.md): a symlink in
    /// its place is never followed, a file over the limit never read, garbage refused; each is
    /// ignored with a warning and the full scan answers.
    #[test]
    fn a_symlinked_oversized_or_garbage_summary_is_refused_and_the_full_scan_used() {
        let dir = tempfile::tempdir().unwrap();
        let layout = Layout::new(dir.path(), "t", "n");
        std::fs::create_dir_all(layout.volumes_dir()).unwrap();
        let (j, _, _) = VolumeJournal::open(&layout).unwrap();
        record_created(&j, "real");
        j.compact().unwrap();
        let path = layout.base().join(SUMMARY_FILE);
        let current = std::fs::read(&path).unwrap();
        // A current summary naming a volume that is not there, planted elsewhere and linked.
        let lie = decoded(&current).unwrap();
        let mut dirs = lie.dirs.clone();
        dirs.push(VolumeDir {
            name: "zzz".into(),
            set_aside: vec![],
            state: Some(Ok(rec("zzz", VolumeState::Published, Some("c")).into())),
            state_file: dirs[0].state_file,
        });
        let planted = dir.path().join("planted");
        std::fs::write(&planted, encode(lie.covers, lie.read_at, &dirs).unwrap()).unwrap();
        std::fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink(&planted, &path).unwrap();
        let table = FakeSyscall::new();
        let ids = || -> Vec<String> {
            crate::provider::status::scan(dir.path(), &table)
                .unwrap()
                .volumes
                .into_iter()
                .map(|v| v.volume_id)
                .collect()
        };
        assert!(read(&path).unwrap_err().contains("symlink"));
        assert_eq!(ids(), ["real"], "a symlinked summary was followed");
        // Over the limit (sparse: never read).
        std::fs::remove_file(&path).unwrap();
        let f = std::fs::File::create(&path).unwrap();
        f.set_len(MAX_FILE + 1).unwrap();
        assert!(read(&path).unwrap_err().contains("over the limit"));
        assert_eq!(ids(), ["real"]);
        // Garbage, and a directory in its place.
        std::fs::write(&path, b"CSIVSUM\n garbage, not a summary").unwrap();
        assert!(read(&path).is_err());
        assert_eq!(ids(), ["real"]);
        std::fs::remove_file(&path).unwrap();
        std::fs::create_dir(&path).unwrap();
        assert!(read(&path).unwrap_err().contains("regular file"));
        assert_eq!(ids(), ["real"]);
    }
}
