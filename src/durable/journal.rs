//! An append-only intent journal with group commit, and the lazy write-back that lets it be
//! compacted.
//!
//! # Format (version [`VERSION`])
//! A header of [`HEADER_LEN`] bytes: the magic `CSIJRNL\n`, the format version (u32 LE), four
//! reserved zero bytes, and the sequence number of the file's first entry (u64 LE). Then
//! frames, each: the payload's length (u32 LE, at most [`MAX_ENTRY`]), a CRC-32C (u32 LE) of
//! the length, the sequence number and the payload, the sequence number (u64 LE: the first
//! entry's, then one more each), the payload. [`parse`] reads frames up to the first one that
//! is cut short, over the limit, fails its checksum or is out of sequence: that is where a
//! power cut stopped an append (or where the file was damaged), and everything from there is
//! a tail to cut. A header that is missing, foreign or of a newer version is refused whole.
//!
//! # Writing
//! One writer per journal (the work dir's `run.lock`). [`Journal::append`] returns once its
//! entries are durable. Concurrent appenders share one `write(2)` and one `fdatasync(2)` per
//! batch: the first to find no batch in flight leads, writes everything queued so far and
//! syncs it; the others queue their frames meanwhile and wait on a condition variable; when
//! the leader is done the next waiter whose frames are not yet written leads the next
//! batch. Entries are numbered when their batch is written.
//!
//! [`Journal::append_lazy`] is for an entry whose loss to a power cut costs nothing but
//! redone work (a step's result after an idempotent RPC, which recovery re-issues from the
//! durable intent before it): it queues its frames and returns without waiting for a sync.
//! They are written at once when no batch is in flight, else by the leader in flight as soon
//! as its batch is done (whenever no batch is in flight, nothing is left queued), and become
//! durable with the next batch's `fdatasync` (which covers the whole file) or the next
//! compaction. A lazy-only batch is a `write(2)` without a sync; it promises nothing. Order
//! is kept: an entry appended after a lazy one, once durable, makes the lazy one durable too.
//!
//! The file is opened for each batch and closed after it: no writable descriptor is held
//! between batches. A failed batch is cut back to where it started (durably) and its
//! appenders get the error; if the cut fails too the tail is uncertain: the journal is then
//! broken and every later append fails, until a restart recovers from its complete entries.
//!
//! # Compaction
//! [`Journal::compact`] holds the journal (no batch is written meanwhile; appends queue), runs
//! the caller's write-back (which must leave its files durable: [`write_back`] writes each
//! file through a temporary file and a rename, then makes all of them durable with one
//! `syncfs(2)`), and only then replaces the journal by a fresh, empty one of a later first
//! sequence number with [`super::write_atomic`] (the new file is durable before the rename
//! drops the old). A power cut before the replacement leaves the old journal, whose replay
//! over the written-back files gives the same state; after it, the files hold everything.
//!
//! # Reading
//! [`read`] opens without following a symlink, refuses what is not a regular file or is over
//! [`MAX_FILE`] bytes, and returns the complete entries: what a reader in another process
//! (`status`) overlays on the steady-state files. [`Journal::open`] does the same, then cuts
//! a torn tail (`ftruncate` and `fdatasync`) before appending after it.
//!
//! Every write, sync, rename and cut goes through the durable seam's recorder
//! ([`super::record`]): appends as [`Op::Append`], syncs as [`Op::Fdatasync`] and
//! [`Op::SyncFs`], cuts as [`Op::Truncate`], and each returned entry as
//! [`Promise::Journaled`].

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Condvar, Mutex, MutexGuard};

use super::record::{self, Op, Promise};
use super::{AtomicWriteError, WriteStep};

/// The magic that starts a journal.
pub const MAGIC: [u8; 8] = *b"CSIJRNL\n";
/// The format version this build writes, and the newest it reads.
pub const VERSION: u32 = 1;
/// The header's length.
pub const HEADER_LEN: usize = 24;
/// A frame's length before its payload.
pub const FRAME_HEAD: usize = 16;
/// The largest payload of one entry.
pub const MAX_ENTRY: usize = 1 << 20;
/// The largest journal read: a bigger file is refused, never read into memory.
pub const MAX_FILE: u64 = 256 << 20;

/// When an append returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Commit {
    /// Once its entry is durable ([`Journal::append`]: a promise).
    Durable,
    /// At once, its entry written or queued; durable with the next synced batch
    /// ([`Journal::append_lazy`]).
    Lazy,
}

/// One complete entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// Its sequence number.
    pub seq: u64,
    /// Its payload.
    pub payload: Vec<u8>,
}

/// What [`parse`] found in a journal's bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Parsed {
    /// The sequence number the file's first entry has (or would have).
    pub first_seq: u64,
    /// The complete entries, in order.
    pub entries: Vec<Entry>,
    /// How many bytes the header and the complete entries take: where the tail starts.
    pub valid_len: u64,
    /// Why the bytes after `valid_len` are not entries (`None`: there are none).
    pub cut: Option<String>,
}

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78) of the concatenated `parts`: the
/// journal's frames and the provider's volume summary (`provider::summary`, megabytes at a
/// node's thousands of volumes) are checked with it. The CPU's `crc32` instruction where it has
/// one (SSE4.2), else a table; both give the same value (tested).
pub fn crc32c(parts: &[&[u8]]) -> u32 {
    !parts.iter().fold(!0u32, |c, part| crc32c_update(c, part))
}

fn crc32c_update(c: u32, bytes: &[u8]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("sse4.2") {
        // SAFETY: the CPU has SSE4.2, checked just above.
        return unsafe { crc32c_sse42(c, bytes) };
    }
    crc32c_table(c, bytes)
}

/// The `crc32` instruction, 8 bytes at a time. Unsafe: the CPU must have SSE4.2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse4.2")]
unsafe fn crc32c_sse42(c: u32, bytes: &[u8]) -> u32 {
    use std::arch::x86_64::{_mm_crc32_u64, _mm_crc32_u8};
    let mut words = bytes.chunks_exact(8);
    let mut c64 = u64::from(c);
    for w in &mut words {
        c64 = _mm_crc32_u64(c64, u64::from_le_bytes(w.try_into().expect("8 bytes")));
    }
    words
        .remainder()
        .iter()
        .fold(c64 as u32, |c, &b| _mm_crc32_u8(c, b))
}

fn crc32c_table(mut c: u32, bytes: &[u8]) -> u32 {
    const TABLE: [u32; 256] = {
        let mut t = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut k = 0;
            while k < 8 {
                c = if c & 1 != 0 {
                    (c >> 1) ^ 0x82F6_3B78
                } else {
                    c >> 1
                };
                k += 1;
            }
            t[i] = c;
            i += 1;
        }
        t
    };
    for &b in bytes {
        c = TABLE[((c ^ b as u32) & 0xff) as usize] ^ (c >> 8);
    }
    c
}

/// A journal's header with `first_seq`.
pub fn header(first_seq: u64) -> Vec<u8> {
    let mut h = Vec::with_capacity(HEADER_LEN);
    h.extend_from_slice(&MAGIC);
    h.extend_from_slice(&VERSION.to_le_bytes());
    h.extend_from_slice(&[0; 4]);
    h.extend_from_slice(&first_seq.to_le_bytes());
    h
}

/// Appends the frame of entry `seq` to `out`.
pub fn encode(seq: u64, payload: &[u8], out: &mut Vec<u8>) {
    let len = (payload.len() as u32).to_le_bytes();
    let seq = seq.to_le_bytes();
    out.extend_from_slice(&len);
    out.extend_from_slice(&crc32c(&[&len, &seq, payload]).to_le_bytes());
    out.extend_from_slice(&seq);
    out.extend_from_slice(payload);
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Reads a journal's bytes (see the module doc): `Err` when the header is refused (why),
/// else the complete entries and where the tail starts.
pub fn parse(bytes: &[u8]) -> Result<Parsed, String> {
    if bytes.len() < HEADER_LEN {
        return Err(format!(
            "{} bytes: shorter than a journal header ({HEADER_LEN})",
            bytes.len()
        ));
    }
    if bytes[..8] != MAGIC {
        return Err("no journal magic at its start: not a journal".into());
    }
    let version = u32_at(bytes, 8);
    if version == 0 || version > VERSION {
        return Err(format!(
            "format version {version}, this build reads up to {VERSION}: run the release that wrote it"
        ));
    }
    let first_seq = u64_at(bytes, 16);
    let mut entries = Vec::new();
    let mut at = HEADER_LEN;
    let mut cut = None;
    while at < bytes.len() {
        let rest = &bytes[at..];
        if rest.len() < FRAME_HEAD {
            cut = Some(format!("a frame head cut short at byte {at}"));
            break;
        }
        let len = u32_at(rest, 0) as usize;
        let crc = u32_at(rest, 4);
        let seq = u64_at(rest, 8);
        if len > MAX_ENTRY {
            cut = Some(format!(
                "a frame of {len} bytes at byte {at}, over the limit of {MAX_ENTRY}"
            ));
            break;
        }
        if rest.len() < FRAME_HEAD + len {
            cut = Some(format!("a frame cut short at byte {at}"));
            break;
        }
        let payload = &rest[FRAME_HEAD..FRAME_HEAD + len];
        if crc32c(&[&rest[0..4], &rest[8..16], payload]) != crc {
            cut = Some(format!("a frame failing its checksum at byte {at}"));
            break;
        }
        let expected = first_seq + entries.len() as u64;
        if seq != expected {
            cut = Some(format!(
                "entry {seq} at byte {at} where {expected} was due: out of sequence"
            ));
            break;
        }
        entries.push(Entry {
            seq,
            payload: payload.to_vec(),
        });
        at += FRAME_HEAD + len;
    }
    Ok(Parsed {
        first_seq,
        entries,
        valid_len: at as u64,
        cut,
    })
}

/// Errors of a journal, each naming the file.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    /// Opening or reading the file failed.
    #[error("read journal {path}")]
    Read {
        /// The journal.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// The file is not a journal this build can use.
    #[error("journal {path} refused: {reason}; move it aside to start without it (the volume.state files then hold the last written-back state)")]
    Refused {
        /// The journal.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// Writing a batch failed.
    #[error("append to journal {path} (write)")]
    Write {
        /// The journal.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// Syncing a batch failed.
    #[error("append to journal {path} (fdatasync)")]
    Sync {
        /// The journal.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// Cutting a torn tail failed.
    #[error("cut the torn tail of journal {path} at byte {len}")]
    Cut {
        /// The journal.
        path: PathBuf,
        /// Where.
        len: u64,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// An entry is bigger than [`MAX_ENTRY`].
    #[error("an entry of {len} bytes for journal {path} is over the limit of {MAX_ENTRY} bytes")]
    TooLarge {
        /// The journal.
        path: PathBuf,
        /// The entry's length.
        len: usize,
    },
    /// An earlier append failed: the file's tail is uncertain.
    #[error("journal {path} is broken since an earlier append failed ({reason}): restart the service, recovery keeps its complete entries")]
    Broken {
        /// The journal.
        path: PathBuf,
        /// The first failure.
        reason: String,
    },
    /// Replacing the journal by an empty one (compaction) failed.
    #[error("reset journal {path}")]
    Reset {
        /// The journal.
        path: PathBuf,
        /// The write's error.
        #[source]
        source: AtomicWriteError,
    },
}

/// Reads the journal at `path` without following a symlink and within [`MAX_FILE`]
/// ([`super::read_capped`]): `Ok(None)` when there is none.
pub fn read(path: &Path) -> Result<Option<(Parsed, u64)>, JournalError> {
    let refused = |reason: String| JournalError::Refused {
        path: path.to_path_buf(),
        reason,
    };
    let bytes = match super::read_capped(path, MAX_FILE) {
        Ok(None) => return Ok(None),
        Ok(Some(bytes)) => bytes,
        Err(super::CappedReadError::Io(source)) => {
            return Err(JournalError::Read {
                path: path.to_path_buf(),
                source,
            })
        }
        Err(e) => return Err(refused(e.to_string())),
    };
    let len = bytes.len() as u64;
    parse(&bytes).map(|p| Some((p, len))).map_err(refused)
}

/// The queue and the file, under the journal's lock.
struct Queue {
    /// The file's length.
    len: u64,
    /// The next entry's sequence number.
    next_seq: u64,
    /// Payloads queued, not yet written (numbered when their batch is written, so that a
    /// failed batch leaves no gap in the sequence).
    pending: Vec<Vec<u8>>,
    /// The batch queued frames join.
    open_batch: u64,
    /// A leader is writing a batch, or a compaction holds the journal.
    busy: bool,
    /// Why the journal is broken.
    broken: Option<String>,
    /// Entries written since the file was made.
    entries: u64,
    /// Batches written since the journal was opened.
    batches: u64,
    /// Appenders whose payloads are in `pending` and who wait for them to be durable (lazy
    /// appenders do not wait: a batch with none is written without a sync).
    waiters: usize,
    /// Batches written or failed (cut back, not broken): their first sequence number or why
    /// they failed, and how many of their appenders have yet to learn it.
    outcomes: std::collections::BTreeMap<u64, (Result<u64, String>, usize)>,
}

/// A journal open for appending (see the module doc).
pub struct Journal {
    path: PathBuf,
    mode: u32,
    queue: Mutex<Queue>,
    done: Condvar,
    crash_point: fn(),
}

impl std::fmt::Debug for Journal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Journal").field("path", &self.path).finish()
    }
}

/// How big a journal is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Size {
    /// Entries written since it was made.
    pub entries: u64,
    /// Its length in bytes.
    pub bytes: u64,
}

/// When a compaction runs, judged once the journal is held ([`Journal::compact_when`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum When {
    /// Whenever the journal holds an entry (a clean shutdown, after recovery).
    Always,
    /// Only while it is over its limits: the appenders that each saw it due after their
    /// append compact it once, not once each.
    Due,
}

impl When {
    /// Whether a journal of `size` is to be compacted, under the limits for [`When::Due`] (pure).
    pub fn holds(self, size: Size, max_entries: u64, max_bytes: u64) -> bool {
        match self {
            When::Always => size.entries > 0,
            When::Due => due(size, max_entries, max_bytes),
        }
    }
}

/// Whether a journal of `size` is due for compaction under the limits (pure).
pub fn due(size: Size, max_entries: u64, max_bytes: u64) -> bool {
    size.entries >= max_entries || size.bytes >= max_bytes
}

fn open_append(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .append(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
}

impl Journal {
    /// Opens the journal at `path` for appending (made empty, durably, with `mode`, when
    /// absent; its directory must exist and be durable), cutting a torn tail, and returns
    /// it with its complete entries. `crash_point` is called after each durable step that
    /// changes what a recovery would find (the crash tests kill the process there): a
    /// batch's sync, a cut, a reset.
    pub fn open(
        path: &Path,
        mode: u32,
        crash_point: fn(),
    ) -> Result<(Journal, Parsed), JournalError> {
        let parsed = match read(path)? {
            Some((parsed, len)) => {
                if parsed.valid_len < len {
                    tracing::warn!(journal = %path.display(), at = parsed.valid_len,
                        why = parsed.cut.as_deref().unwrap_or(""), "journal: cutting its torn tail");
                    cut(path, parsed.valid_len)?;
                    crash_point();
                }
                parsed
            }
            None => {
                super::write_atomic(path, &header(1), mode).map_err(|source| {
                    JournalError::Reset {
                        path: path.to_path_buf(),
                        source,
                    }
                })?;
                // No crash point: a crash here or just before leaves the same (empty) state.
                parse(&header(1)).expect("a fresh header parses")
            }
        };
        // Checked openable for appending now; opened again for each batch.
        let _ = open_append(path).map_err(|source| JournalError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let journal = Journal {
            path: path.to_path_buf(),
            mode,
            queue: Mutex::new(Queue {
                len: parsed.valid_len,
                next_seq: parsed.first_seq + parsed.entries.len() as u64,
                pending: Vec::new(),
                open_batch: 1,
                busy: false,
                broken: None,
                entries: parsed.entries.len() as u64,
                batches: 0,
                waiters: 0,
                outcomes: Default::default(),
            }),
            done: Condvar::new(),
            crash_point,
        };
        Ok((journal, parsed))
    }

    /// The journal's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Its size now.
    pub fn size(&self) -> Size {
        let q = self.lock();
        Size {
            entries: q.entries,
            bytes: q.len,
        }
    }

    /// The sequence number of the file's first entry: every entry before it was compacted
    /// away. Steady while a [`compact`](Self::compact) holds the journal.
    pub fn first_seq(&self) -> u64 {
        let q = self.lock();
        q.next_seq - q.entries
    }

    /// How many batches (one write and one fdatasync each) it has written since it was
    /// opened.
    pub fn batches(&self) -> u64 {
        self.lock().batches
    }

    fn lock(&self) -> MutexGuard<'_, Queue> {
        // A panic in a leader leaves `busy` set: the journal is then broken, not half-updated.
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn broken(&self, reason: &str) -> JournalError {
        JournalError::Broken {
            path: self.path.clone(),
            reason: reason.to_string(),
        }
    }

    /// Queues `payloads` for the next batch (refusing an entry over [`MAX_ENTRY`] and a broken
    /// journal before anything is queued); returns the queue, still locked, and where in the
    /// pending batch they start.
    fn queue_up(&self, payloads: &[&[u8]]) -> Result<(MutexGuard<'_, Queue>, u64), JournalError> {
        if let Some(p) = payloads.iter().find(|p| p.len() > MAX_ENTRY) {
            return Err(JournalError::TooLarge {
                path: self.path.clone(),
                len: p.len(),
            });
        }
        let mut q = self.lock();
        if let Some(reason) = &q.broken {
            return Err(self.broken(reason));
        }
        let at = q.pending.len() as u64;
        q.pending.extend(payloads.iter().map(|p| p.to_vec()));
        Ok((q, at))
    }

    /// Appends `payloads` as consecutive entries and returns once they are durable (see the
    /// module doc), with the last one's sequence number. Blocking: call it from the blocking
    /// pool.
    pub fn append(&self, payloads: &[&[u8]]) -> Result<u64, JournalError> {
        let (mut q, at) = self.queue_up(payloads)?;
        let mine = q.open_batch;
        q.waiters += 1;
        loop {
            if let Some((outcome, left)) = q.outcomes.get_mut(&mine) {
                let outcome = outcome.clone();
                *left -= 1;
                if *left == 0 {
                    q.outcomes.remove(&mine);
                }
                drop(q);
                let first = match outcome {
                    Ok(batch_first) => batch_first + at,
                    Err(reason) => {
                        return Err(JournalError::Write {
                            path: self.path.clone(),
                            source: io::Error::other(reason),
                        })
                    }
                };
                let last = first + payloads.len() as u64 - 1;
                for seq in first..=last {
                    super::promise(|| Promise::Journaled {
                        path: self.path.clone(),
                        seq,
                    });
                }
                return Ok(last);
            }
            if let Some(reason) = &q.broken {
                return Err(self.broken(reason));
            }
            if !q.busy {
                q = self.lead(q);
                continue;
            }
            q = self.done.wait(q).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Appends `payloads` as consecutive entries without waiting for them to be durable (see
    /// the module doc): written now when no batch is in flight, else right after it; durable
    /// with the next batch's sync. Promises nothing. An error says they were not queued; a
    /// failed write of a lazy-only batch is logged (the entries are lost, as to a power cut).
    /// Blocking (it may write): call it from the blocking pool.
    pub fn append_lazy(&self, payloads: &[&[u8]]) -> Result<(), JournalError> {
        let (q, _) = self.queue_up(payloads)?;
        if !q.busy {
            drop(self.lead(q));
        }
        Ok(())
    }

    /// Writes what is queued as one batch (synced when an appender waits for it), the lock
    /// released meanwhile; then, while only lazy frames are queued and no appender would lead
    /// them, writes those too, so that nothing stays queued with no batch in flight.
    fn lead<'a>(&'a self, q: MutexGuard<'a, Queue>) -> MutexGuard<'a, Queue> {
        let mut q = self.write_batch(q);
        while !q.busy && q.broken.is_none() && q.waiters == 0 && !q.pending.is_empty() {
            q = self.write_batch(q);
        }
        q
    }

    /// Writes everything queued as one batch, and syncs it when an appender waits for it, the
    /// lock released meanwhile.
    fn write_batch<'a>(&'a self, mut q: MutexGuard<'a, Queue>) -> MutexGuard<'a, Queue> {
        q.busy = true;
        let batch = q.open_batch;
        q.open_batch += 1;
        let pending = std::mem::take(&mut q.pending);
        let n = pending.len() as u64;
        let waiters = std::mem::take(&mut q.waiters);
        // Lazy frames alone are written, not synced: the next synced batch covers them.
        let sync = waiters > 0;
        let first = q.next_seq;
        let mut buf = Vec::with_capacity(pending.iter().map(|p| p.len() + FRAME_HEAD).sum());
        for (i, p) in pending.iter().enumerate() {
            encode(first + i as u64, p, &mut buf);
        }
        let offset = q.len;
        // Opened for each batch and closed after: no writable descriptor is held between
        // batches (an operator can remount the file system read-only while nothing is
        // written).
        let mut file = match open_append(&self.path) {
            Ok(f) => f,
            Err(e) => {
                q.busy = false;
                let reason = format!("open: {e}");
                if sync {
                    q.outcomes.insert(batch, (Err(reason), waiters));
                } else {
                    tracing::error!(journal = %self.path.display(), error = %reason, "journal: lazy entries not written (recovery redoes what they recorded)");
                }
                self.done.notify_all();
                return q;
            }
        };
        drop(q);
        let result = file
            .write_all(&buf)
            .map_err(|e| format!("write: {e}"))
            .and_then(|()| {
                record::record(|| Op::Append {
                    path: self.path.clone(),
                    offset,
                    bytes: buf.clone(),
                });
                if !sync {
                    return Ok(());
                }
                super::counted();
                file.sync_data()
                    .map_err(|e| format!("fdatasync: {e}"))
                    .map(|()| {
                        record::record(|| Op::Fdatasync {
                            path: self.path.clone(),
                        })
                    })
            });
        if result.is_ok() && sync {
            (self.crash_point)();
        }
        let mut q = self.lock();
        q.busy = false;
        match result {
            Ok(()) => {
                q.len += buf.len() as u64;
                q.entries += n;
                q.next_seq += n;
                if sync {
                    q.outcomes.insert(batch, (Ok(first), waiters));
                    q.batches += 1;
                }
            }
            Err(reason) => {
                // The batch's appenders get the error. The tail is cut back to where the batch
                // started, durably; if that fails too the tail is uncertain: broken.
                let cut = Some(&file).map(|f| {
                    f.set_len(offset).and_then(|()| {
                        record::record(|| Op::Truncate {
                            path: self.path.clone(),
                            len: offset,
                        });
                        super::counted();
                        f.sync_data()
                    })
                });
                match cut {
                    Some(Ok(())) => {
                        record::record(|| Op::Fdatasync {
                            path: self.path.clone(),
                        });
                        tracing::error!(journal = %self.path.display(), error = %reason, "journal append failed; its tail was cut back");
                        if sync {
                            q.outcomes.insert(batch, (Err(reason), waiters));
                        }
                    }
                    _ => {
                        tracing::error!(journal = %self.path.display(), error = %reason, "journal append failed and its tail could not be cut: the journal is broken until a restart");
                        q.broken = Some(reason);
                    }
                }
            }
        }
        self.done.notify_all();
        q
    }

    /// Compacts the journal: holds it, runs `write_back` (which must leave the entries'
    /// effect durable elsewhere), then replaces it by an empty one (see the module doc).
    /// Appends made meanwhile wait and go to the new file. On an error of `write_back` the
    /// journal is left as it was.
    pub fn compact<E: From<JournalError>>(
        &self,
        write_back: impl FnOnce() -> Result<(), E>,
    ) -> Result<(), E> {
        self.compact_when(|_| true, write_back).map(|_| ())
    }

    /// [`compact`](Self::compact) only if `due` holds of the journal's size once it is held
    /// (no other compaction running); returns whether it compacted. Callers that each saw the
    /// journal due after their append (a burst of them, returning from one batch) compact it
    /// once: the others find it reset.
    pub fn compact_when<E: From<JournalError>>(
        &self,
        due: impl FnOnce(Size) -> bool,
        write_back: impl FnOnce() -> Result<(), E>,
    ) -> Result<bool, E> {
        let mut q = self.lock();
        while q.busy {
            q = self.done.wait(q).unwrap_or_else(|p| p.into_inner());
        }
        if let Some(reason) = &q.broken {
            return Err(self.broken(reason).into());
        }
        let size = Size {
            entries: q.entries,
            bytes: q.len,
        };
        if !due(size) {
            return Ok(false);
        }
        q.busy = true;
        // Frames queued now are written after the reset: the new file starts with them.
        let first_seq = q.next_seq;
        drop(q);
        let result = write_back().and_then(|()| self.reset(first_seq).map_err(E::from));
        let mut q = self.lock();
        q.busy = false;
        let result = match result {
            Ok(file) => {
                drop(file);
                q.len = HEADER_LEN as u64;
                q.entries = 0;
                Ok(true)
            }
            Err(e) => Err(e),
        };
        self.done.notify_all();
        // Lazy frames queued meanwhile, with no appender to lead them.
        if q.waiters == 0 && !q.pending.is_empty() && q.broken.is_none() {
            drop(self.lead(q));
        }
        result
    }

    /// Replaces the file by an empty journal starting at `first_seq`, durably, and opens it.
    fn reset(&self, first_seq: u64) -> Result<File, JournalError> {
        let written = super::write_atomic(&self.path, &header(first_seq), self.mode);
        if let Err(source) = written {
            if matches!(source.step, WriteStep::Rename | WriteStep::SyncDir) {
                self.lock().broken = Some(format!("reset: {source}"));
            }
            return Err(JournalError::Reset {
                path: self.path.clone(),
                source,
            });
        }
        (self.crash_point)();
        open_append(&self.path).map_err(|source| {
            self.lock().broken = Some(format!("reopen after reset: {source}"));
            JournalError::Read {
                path: self.path.clone(),
                source,
            }
        })
    }
}

/// Cuts the file at `path` to `len` bytes durably (a torn tail).
fn cut(path: &Path, len: u64) -> Result<(), JournalError> {
    let fail = |source| JournalError::Cut {
        path: path.to_path_buf(),
        len,
        source,
    };
    let file = OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(fail)?;
    file.set_len(len).map_err(fail)?;
    record::record(|| Op::Truncate {
        path: path.to_path_buf(),
        len,
    });
    super::counted();
    file.sync_data().map_err(fail)?;
    record::record(|| Op::Fdatasync {
        path: path.to_path_buf(),
    });
    Ok(())
}

/// A failed [`write_back`]: the file and the step.
#[derive(Debug, thiserror::Error)]
#[error("write back {path} ({step})")]
pub struct WriteBackError {
    /// The file (or, for the sync, a path on the file system).
    pub path: PathBuf,
    /// The step.
    pub step: &'static str,
    /// The I/O error.
    #[source]
    pub source: io::Error,
}

/// Writes each file of `files` (`Some`: these bytes, with `mode`, through a temporary file
/// and a rename; `None`: removed) and then makes all of it durable with one `syncfs(2)` of
/// the file system holding `on` (every file must be on it). Their directories must exist;
/// `crash_point` is called after each rename and removal and after the sync.
pub fn write_back(
    files: &[(PathBuf, Option<Vec<u8>>)],
    mode: u32,
    on: &Path,
    crash_point: fn(),
) -> Result<(), WriteBackError> {
    write_files(files, mode, crash_point)?;
    sync_written(on, crash_point)
}

/// [`write_back`]'s writes without its sync: nothing is durable until [`sync_written`] (for a
/// caller that writes more files made of these, before the one sync).
pub fn write_files(
    files: &[(PathBuf, Option<Vec<u8>>)],
    mode: u32,
    crash_point: fn(),
) -> Result<(), WriteBackError> {
    for (path, bytes) in files {
        let fail = |step, source| WriteBackError {
            path: path.clone(),
            step,
            source,
        };
        match bytes {
            Some(bytes) => {
                let (tmp, mut file) =
                    super::create_temp(path, mode).map_err(|e| fail("create temp file", e))?;
                record::record(|| Op::Create {
                    path: tmp.clone(),
                    mode,
                });
                if let Err(e) = file.write_all(bytes) {
                    let _ = super::remove_file(&tmp);
                    return Err(fail("write temp file", e));
                }
                record::record(|| Op::Write {
                    path: tmp.clone(),
                    bytes: bytes.clone(),
                });
                drop(file);
                if let Err(e) = super::rename(&tmp, path) {
                    let _ = super::remove_file(&tmp);
                    return Err(fail("rename", e));
                }
            }
            None => match super::remove_file(path) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(fail("remove", e)),
            },
        }
        crash_point();
    }
    Ok(())
}

/// [`write_back`]'s one `syncfs(2)` of the file system holding `on`, then a crash point.
pub fn sync_written(on: &Path, crash_point: fn()) -> Result<(), WriteBackError> {
    sync_fs(on).map_err(|source| WriteBackError {
        path: on.to_path_buf(),
        step: "syncfs",
        source,
    })?;
    // No promise per file: a file written back is not what its caller relies on alone (the
    // next write-back may tear it before its own syncfs; the journal then still covers it).
    // What the caller relies on is the journal's entries replayed over the files, which the
    // journal's reset (a promise) and the store's own checks hold.
    crash_point();
    Ok(())
}

/// `syncfs(2)` of the file system holding `on`.
pub fn sync_fs(on: &Path) -> io::Result<()> {
    let dir = File::open(on)?;
    super::counted();
    rustix::fs::syncfs(&dir)?;
    record::record(|| Op::SyncFs {
        path: on.to_path_buf(),
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn nothing() {}

    fn frames(entries: &[(u64, &[u8])]) -> Vec<u8> {
        let mut b = header(entries.first().map_or(1, |e| e.0));
        for (seq, p) in entries {
            encode(*seq, p, &mut b);
        }
        b
    }

    #[test]
    fn crc32c_matches_the_standard_check_value() {
        assert_eq!(crc32c(&[b"123456789"]), 0xE306_9283);
        assert_eq!(crc32c(&[b"1234", b"56789"]), 0xE306_9283);
    }

    #[test]
    fn crc32c_by_instruction_and_by_table_agree_at_every_length_and_split() {
        let bytes: Vec<u8> = (0..300u32).map(|i| (i * 7 + i / 5) as u8).collect();
        for len in 0..bytes.len() {
            let b = &bytes[..len];
            assert_eq!(crc32c(&[b]), !crc32c_table(!0, b), "length {len}");
            let (x, y) = b.split_at(len / 3);
            assert_eq!(crc32c(&[x, y]), crc32c(&[b]), "split at {}", len / 3);
        }
    }

    #[test]
    fn complete_entries_parse_and_a_torn_tail_is_cut_at_every_length() {
        let full = frames(&[(7, b"one"), (8, b""), (9, b"three")]);
        let p = parse(&full).unwrap();
        assert_eq!(p.first_seq, 7);
        assert_eq!(p.entries.len(), 3);
        assert_eq!(p.entries[2].payload, b"three");
        assert_eq!(p.valid_len, full.len() as u64);
        assert_eq!(p.cut, None);
        let two = frames(&[(7, b"one"), (8, b"")]).len();
        for len in two + 1..full.len() {
            let p = parse(&full[..len]).unwrap();
            assert_eq!(p.entries.len(), 2, "cut at {len}");
            assert_eq!(p.valid_len, two as u64);
            assert!(p.cut.is_some());
        }
    }

    #[test]
    fn a_bad_checksum_a_zeroed_tail_a_gap_and_an_oversized_frame_stop_the_read() {
        let good = frames(&[(1, b"a"), (2, b"bb")]);
        let one = frames(&[(1, b"a")]).len();
        // A flipped payload byte.
        let mut b = good.clone();
        *b.last_mut().unwrap() ^= 1;
        let p = parse(&b).unwrap();
        assert_eq!(p.entries.len(), 1);
        assert!(p.cut.as_deref().unwrap().contains("checksum"), "{p:?}");
        // A zero-filled tail (size extended, data not written).
        let mut b = good[..one].to_vec();
        b.extend_from_slice(&[0; 40]);
        assert_eq!(parse(&b).unwrap().entries.len(), 1);
        // Entry 3 where 2 was due.
        let mut b = good[..one].to_vec();
        encode(3, b"c", &mut b);
        let p = parse(&b).unwrap();
        assert_eq!(p.entries.len(), 1);
        assert!(p.cut.as_deref().unwrap().contains("out of sequence"));
        // A length over the limit is never trusted, whatever follows.
        let mut b = good[..one].to_vec();
        b.extend_from_slice(&u32::MAX.to_le_bytes());
        b.extend_from_slice(&[0; 12]);
        let p = parse(&b).unwrap();
        assert!(p.cut.as_deref().unwrap().contains("over the limit"));
    }

    #[test]
    fn a_foreign_or_newer_header_is_refused() {
        assert!(parse(b"short").unwrap_err().contains("shorter"));
        assert!(parse(&[b'x'; 40]).unwrap_err().contains("not a journal"));
        let mut h = header(1);
        h[8..12].copy_from_slice(&2u32.to_le_bytes());
        assert!(parse(&h).unwrap_err().contains("version 2"));
    }

    #[test]
    fn always_wants_any_entry_and_due_only_a_journal_over_its_limits() {
        let size = |entries, bytes| Size { entries, bytes };
        assert!(!When::Always.holds(size(0, 64), 4, 100));
        assert!(When::Always.holds(size(1, 64), 4, 100));
        assert!(!When::Due.holds(size(3, 99), 4, 100));
        assert!(When::Due.holds(size(4, 64), 4, 100));
        assert!(When::Due.holds(size(1, 100), 4, 100));
    }

    #[test]
    fn callers_that_all_saw_the_journal_due_compact_it_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal");
        let (j, _) = Journal::open(&path, 0o600, nothing).unwrap();
        j.append(&[b"a", b"b", b"c", b"d"]).unwrap();
        let due = |s: Size| due(s, 4, 1 << 20);
        assert!(due(j.size()));
        let write_backs = std::sync::atomic::AtomicUsize::new(0);
        let compacted: Vec<bool> = std::thread::scope(|scope| {
            let runs: Vec<_> = (0..8)
                .map(|_| {
                    scope.spawn(|| {
                        j.compact_when(due, || {
                            write_backs.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            Ok::<(), JournalError>(())
                        })
                        .unwrap()
                    })
                })
                .collect();
            runs.into_iter().map(|r| r.join().unwrap()).collect()
        });
        assert_eq!(compacted.iter().filter(|c| **c).count(), 1, "{compacted:?}");
        assert_eq!(write_backs.load(std::sync::atomic::Ordering::Relaxed), 1);
        assert_eq!(j.size().entries, 0);
        // Not due: nothing written back, the entry stays.
        j.append(&[b"e"]).unwrap();
        assert!(!j
            .compact_when(due, || -> Result<(), JournalError> { panic!("ran") })
            .unwrap());
        assert_eq!(j.size().entries, 1);
    }

    #[test]
    fn appends_survive_a_reopen_and_a_torn_tail_is_cut_before_the_next_append() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal");
        let (j, p) = Journal::open(&path, 0o600, nothing).unwrap();
        assert!(p.entries.is_empty());
        assert_eq!(j.append(&[b"a", b"b"]).unwrap(), 2);
        assert_eq!(j.append(&[b"c"]).unwrap(), 3);
        assert_eq!(j.size().entries, 3);
        drop(j);
        // A power cut mid-append: half a frame at the end.
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        let mut torn = Vec::new();
        encode(4, b"dddddd", &mut torn);
        f.write_all(&torn[..10]).unwrap();
        drop(f);
        let (j, p) = Journal::open(&path, 0o600, nothing).unwrap();
        let got: Vec<_> = p.entries.iter().map(|e| e.payload.clone()).collect();
        assert_eq!(got, [b"a".to_vec(), b"b".to_vec(), b"c".to_vec()]);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), p.valid_len);
        assert_eq!(j.append(&[b"d"]).unwrap(), 4);
        let (p, _) = read(&path).unwrap().unwrap();
        assert_eq!(p.entries.len(), 4);
        assert_eq!(p.cut, None);
    }

    #[test]
    fn concurrent_appends_share_batches_and_every_entry_is_there_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal");
        // The leader lingers after its sync, as a slow disk would: the others queue meanwhile.
        fn slow_disk() {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let (j, _) = Journal::open(&path, 0o600, slow_disk).unwrap();
        let j = Arc::new(j);
        let threads: Vec<_> = (0..16)
            .map(|t| {
                let j = j.clone();
                std::thread::spawn(move || {
                    for i in 0..8 {
                        j.append(&[format!("{t}-{i}").as_bytes()]).unwrap();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let (p, _) = read(&path).unwrap().unwrap();
        assert_eq!(p.entries.len(), 128);
        let mut seen: Vec<_> = p.entries.iter().map(|e| e.payload.clone()).collect();
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), 128);
        // 128 appends by 16 threads: each batch after the first carries every thread that
        // queued while the one before was written, so about 8 batches, far from 128.
        let batches = j.batches();
        assert!((8..=32).contains(&batches), "{batches} batches");
    }

    /// A lazy append is written at once and not synced; appends after it keep the sequence;
    /// under concurrency every lazy entry is written, once, by the time the appends return.
    #[test]
    fn lazy_appends_are_written_in_order_without_a_sync_of_their_own() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal");
        let (j, _) = Journal::open(&path, 0o600, nothing).unwrap();
        j.append_lazy(&[b"x"]).unwrap();
        assert_eq!(j.batches(), 0, "a lazy-only batch is not synced");
        let (p, _) = read(&path).unwrap().unwrap();
        assert_eq!(p.entries.len(), 1, "written at once");
        assert_eq!(j.append(&[b"y"]).unwrap(), 2);
        assert_eq!(j.batches(), 1);
        assert!(matches!(
            j.append_lazy(&[&vec![0u8; MAX_ENTRY + 1]]),
            Err(JournalError::TooLarge { .. })
        ));

        fn slow_disk() {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let path = dir.path().join("j2");
        let (j, _) = Journal::open(&path, 0o600, slow_disk).unwrap();
        let j = Arc::new(j);
        let threads: Vec<_> = (0..8)
            .map(|t| {
                let j = j.clone();
                std::thread::spawn(move || {
                    for i in 0..6 {
                        let p = format!("{t}-{i}");
                        if (t + i) % 2 == 0 {
                            j.append_lazy(&[p.as_bytes()]).unwrap();
                        } else {
                            j.append(&[p.as_bytes()]).unwrap();
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let (p, _) = read(&path).unwrap().unwrap();
        let mut seen: Vec<_> = p.entries.iter().map(|e| e.payload.clone()).collect();
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), 48, "every entry written once");
        assert_eq!(p.entries.len(), 48);
        assert!(j.batches() <= 24, "{} synced batches", j.batches());
    }

    #[test]
    fn compaction_writes_back_then_resets_and_appends_continue_in_sequence() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal");
        let (j, _) = Journal::open(&path, 0o600, nothing).unwrap();
        j.append(&[b"x=1", b"y=2"]).unwrap();
        let files = vec![
            (dir.path().join("x"), Some(b"1".to_vec())),
            (dir.path().join("y"), None),
        ];
        std::fs::write(dir.path().join("y"), b"old").unwrap();
        j.compact(|| {
            write_back(&files, 0o600, dir.path(), nothing).map_err(|e| JournalError::Read {
                path: e.path,
                source: e.source,
            })
        })
        .unwrap();
        assert_eq!(std::fs::read(dir.path().join("x")).unwrap(), b"1");
        assert!(!dir.path().join("y").exists());
        assert_eq!(
            j.size(),
            Size {
                entries: 0,
                bytes: HEADER_LEN as u64
            }
        );
        assert_eq!(j.append(&[b"z=3"]).unwrap(), 3);
        let (p, _) = read(&path).unwrap().unwrap();
        assert_eq!(p.first_seq, 3);
        assert_eq!(p.entries.len(), 1);
        // A failed write-back leaves the journal as it was.
        let err = j.compact(|| -> Result<(), JournalError> {
            Err(JournalError::Refused {
                path: path.clone(),
                reason: "planted".into(),
            })
        });
        assert!(err.is_err());
        assert_eq!(read(&path).unwrap().unwrap().0.entries.len(), 1);
        assert_eq!(j.append(&[b"w"]).unwrap(), 4);
    }

    #[test]
    fn a_symlink_a_directory_a_fifo_and_an_oversized_entry_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("elsewhere");
        std::fs::write(&target, header(1)).unwrap();
        let link = dir.path().join("journal");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let err = read(&link).unwrap_err();
        assert!(err.to_string().contains("symlink"), "{err}");
        assert!(Journal::open(&link, 0o600, nothing).is_err());
        let d = dir.path().join("d");
        std::fs::create_dir(&d).unwrap();
        assert!(read(&d).unwrap_err().to_string().contains("regular file"));
        let fifo = dir.path().join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        assert!(read(&fifo)
            .unwrap_err()
            .to_string()
            .contains("regular file"));
        let path = dir.path().join("j2");
        let (j, _) = Journal::open(&path, 0o600, nothing).unwrap();
        let big = vec![0u8; MAX_ENTRY + 1];
        assert!(matches!(
            j.append(&[&big]),
            Err(JournalError::TooLarge { .. })
        ));
        assert!(read(&path).unwrap().unwrap().0.entries.is_empty());
    }

    #[test]
    fn compaction_is_due_over_either_limit() {
        let s = |entries, bytes| Size { entries, bytes };
        assert!(!due(s(9, 99), 10, 100));
        assert!(due(s(10, 0), 10, 100));
        assert!(due(s(0, 100), 10, 100));
    }
}
