//! Power loss over the intent journal (`csi_isolator::durable::journal`): a run that opens a
//! journal, appends from several threads at once (group commit), compacts (write-back with one
//! syncfs, then the reset), appends again and recovers (replay, cut of a torn tail,
//! compaction) is recorded at the durable seam; `csi_isolator_testing::powerloss` builds every
//! state a power cut after each operation could leave (unsynced appends lost, cut short or
//! zeros, unsynced renames undone, a compaction cut at each step). Each state must keep every
//! promise of the seam, and the store the journal serves must recover every value whose
//! append had returned (or a later one). Some values are appended lazily
//! (`Journal::append_lazy`: no wait for a sync, no promise): such a value may be lost until an
//! append after it returns, and from then on must be recovered like the others (the order of
//! the journal makes it durable with the later one). A sample of the states is written to disk and
//! recovered for real, twice (a recovery is itself cut-safe: it only replays and compacts).
//! The planted bug (the journal reset before the write-back is durable: the syncfs dropped)
//! must be caught.
//!
//! Everything runs on a tmpfs of the test's own (its syncs are cheap, and the recorded
//! operations are the same on any file system).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use csi_isolator::durable::journal::{self, Entry, Journal, JournalError};
use csi_isolator::durable::record;
use csi_isolator_testing::powerloss::{
    check_promises, crash_states, materialize, read_log, scan, CrashState, Node, Op, Promise, Tree,
};
use csi_isolator_testing::{require_root, Sandbox, Tmpfs};

fn nothing() {}

/// The journal's crash point lingers, as a slow disk's sync would: appenders that come
/// meanwhile queue and share the next batch.
fn slow_disk() {
    std::thread::sleep(std::time::Duration::from_millis(10));
}

/// A key-value store on the journal: `files/<key>` hold the written-back values, the journal
/// the changes since (`k=v`, or `k` for a removal). A compaction writes back each key's last
/// entry in the journal's file, as the product's keyed journals do: never an in-memory copy,
/// whose order two threads setting one key could make differ from the journal's.
struct Store {
    root: PathBuf,
    journal: Journal,
}

fn payload(key: &str, value: Option<&str>) -> Vec<u8> {
    match value {
        Some(v) => format!("{key}={v}").into_bytes(),
        None => key.as_bytes().to_vec(),
    }
}

fn unpayload(p: &[u8]) -> (String, Option<String>) {
    let s = String::from_utf8_lossy(p);
    match s.split_once('=') {
        Some((k, v)) => (k.to_string(), Some(v.to_string())),
        None => (s.into_owned(), None),
    }
}

/// The store's state: the files, then the journal's entries over them, last one winning (a
/// file the journal covers is replaced whatever it holds: a write-back cut by the power may
/// have left it empty or torn). Pure.
fn replay(files: BTreeMap<String, Vec<u8>>, entries: &[Entry]) -> BTreeMap<String, String> {
    let mut state: BTreeMap<String, String> = files
        .into_iter()
        .map(|(k, v)| (k, String::from_utf8_lossy(&v).into_owned()))
        .collect();
    for e in entries {
        let (k, v) = unpayload(&e.payload);
        match v {
            Some(v) => state.insert(k, v),
            None => state.remove(&k),
        };
    }
    state
}

fn files_dir(root: &Path) -> PathBuf {
    root.join("files")
}

impl Store {
    /// Recovery: the files, the journal replayed over them, and a compaction.
    fn open(root: &Path) -> (Store, BTreeMap<String, String>) {
        let mut files = BTreeMap::new();
        for e in std::fs::read_dir(files_dir(root)).unwrap().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') {
                // A temporary file of a write-back cut short.
                std::fs::remove_file(e.path()).unwrap();
                continue;
            }
            files.insert(name, std::fs::read(e.path()).unwrap());
        }
        let (journal, parsed) = Journal::open(&root.join("journal"), 0o600, slow_disk).unwrap();
        let state = replay(files, &parsed.entries);
        let store = Store {
            root: root.to_path_buf(),
            journal,
        };
        store.compact();
        (store, state)
    }

    fn set(&self, key: &str, value: Option<&str>) -> u64 {
        self.journal.append(&[&payload(key, value)]).unwrap()
    }

    /// [`set`](Self::set) without waiting for the entry to be durable.
    fn set_lazy(&self, key: &str, value: &str) {
        self.journal
            .append_lazy(&[&payload(key, Some(value))])
            .unwrap();
    }

    /// Writes back every value changed since the last compaction, then resets the journal.
    fn compact(&self) {
        self.compact_with(|files, root| {
            journal::write_back(files, 0o600, root, nothing).map_err(|e| JournalError::Read {
                path: e.path,
                source: e.source,
            })
        })
    }

    fn compact_with(
        &self,
        write_back: impl FnOnce(&[(PathBuf, Option<Vec<u8>>)], &Path) -> Result<(), JournalError>,
    ) {
        self.journal
            .compact(|| {
                // The journal is held: its file is steady, appends meanwhile wait.
                let entries = journal::read(self.journal.path())?
                    .map(|(parsed, _)| parsed.entries)
                    .unwrap_or_default();
                let mut last = BTreeMap::new();
                for e in &entries {
                    let (k, v) = unpayload(&e.payload);
                    last.insert(k, v);
                }
                let files: Vec<_> = last
                    .into_iter()
                    .map(|(k, v)| (files_dir(&self.root).join(k), v.map(String::into_bytes)))
                    .collect();
                write_back(&files, &self.root)
            })
            .unwrap();
    }
}

/// What a run appended: (seq, key, value, appended lazily).
type History = Vec<(u64, String, Option<String>, bool)>;

/// The lazy values a run set (each unique), by key.
const LAZY: [(&str, &str); 3] = [("b", "lazy-b"), ("e", "lazy-e"), ("d", "lazy-last")];

/// The sequence number of the entry holding `key=value` in the log's appends (each frame: the
/// payload's length u32, a CRC u32, the sequence number u64, the payload; see the module doc of
/// `csi_isolator::durable::journal`).
fn seq_in_log(ops: &[Op], key: &str, value: &str) -> u64 {
    let wanted = payload(key, Some(value));
    for op in ops {
        let Op::Append { bytes, .. } = op else {
            continue;
        };
        let mut at = 0;
        while at + journal::FRAME_HEAD <= bytes.len() {
            let len = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
            let seq = u64::from_le_bytes(bytes[at + 8..at + 16].try_into().unwrap());
            let body = &bytes[at + journal::FRAME_HEAD..at + journal::FRAME_HEAD + len];
            if body == wanted {
                return seq;
            }
            at += journal::FRAME_HEAD + len;
        }
    }
    panic!("{key}={value} is not in the log's appends")
}

/// The recorded run; returns the log, the base tree and the history.
fn run(root: &Path, log: &Path) -> (Tree, Vec<Op>, History) {
    std::fs::create_dir(files_dir(root)).unwrap();
    let base = scan(root);
    record::record_to(log).unwrap();
    let history = Arc::new(Mutex::new(History::new()));
    {
        let (store, _) = Store::open(root);
        let store = Arc::new(store);
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let store = store.clone();
                let history = history.clone();
                std::thread::spawn(move || {
                    for i in 0..2 {
                        let key = ["a", "b", "c", "a"][t];
                        let value = (t != 2 || i == 0).then(|| format!("{t}.{i}"));
                        let seq = store.set(key, value.as_deref());
                        history
                            .lock()
                            .unwrap()
                            .push((seq, key.into(), value, false));
                    }
                    if t == 1 {
                        // Among the others' appends: queued behind a batch in flight, or
                        // written alone.
                        let (key, value) = LAZY[0];
                        store.set_lazy(key, value);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        store.compact();
        let (key, value) = LAZY[1];
        store.set_lazy(key, value);
        for (key, value) in [("b", Some("late")), ("d", Some("new")), ("a", None)] {
            let seq = store.set(key, value);
            history
                .lock()
                .unwrap()
                .push((seq, key.into(), value.map(str::to_string), false));
        }
        // Last, with no append after it: it may be lost until the restart's compaction.
        let (key, value) = LAZY[2];
        store.set_lazy(key, value);
    }
    // A restart: replay and compaction.
    let (_store, state) = Store::open(root);
    record::stop_recording();
    assert_eq!(state.get("a"), None);
    assert_eq!(state.get("b").map(String::as_str), Some("late"));
    assert_eq!(state.get("d").map(String::as_str), Some("lazy-last"));
    assert_eq!(state.get("e").map(String::as_str), Some("lazy-e"));
    let ops: Vec<Op> = read_log(log)
        .unwrap()
        .into_iter()
        .filter(|op| op.paths().iter().all(|p| p.starts_with(root)))
        .collect();
    let mut history = history.lock().unwrap().clone();
    for (key, value) in LAZY {
        history.push((
            seq_in_log(&ops, key, value),
            key.into(),
            Some(value.into()),
            true,
        ));
    }
    (base, ops, history)
}

/// The store's state in a crash state's tree, as recovery computes it (pure).
fn recovered_from(tree: &Tree, root: &Path) -> BTreeMap<String, String> {
    let files: BTreeMap<String, Vec<u8>> = tree
        .iter()
        .filter_map(|(p, n)| match n {
            Node::File(_, b) if p.parent() == Some(&files_dir(root)) => {
                let name = p.file_name()?.to_string_lossy().into_owned();
                (!name.starts_with('.')).then_some((name, b.clone()))
            }
            _ => None,
        })
        .collect();
    let entries = match tree.get(&root.join("journal")) {
        Some(Node::File(_, b)) => journal::parse(b).expect("a journal header").entries,
        _ => Vec::new(),
    };
    replay(files, &entries)
}

/// The values a state loses: for each key, the value of its last append that had returned
/// before the cut (a lazy append: that an append after it had returned), or of a later
/// append, must be what recovery finds.
fn lost_values(ops: &[Op], history: &History, state: &CrashState, root: &Path) -> Vec<String> {
    let journal = root.join("journal");
    let promised: BTreeSet<u64> = ops[..state.point]
        .iter()
        .filter_map(|op| match op {
            Op::Promised(Promise::Journaled { path, seq }) if *path == journal => Some(*seq),
            _ => None,
        })
        .collect();
    let kept = |seq: u64, lazy: bool| {
        if lazy {
            promised.range(seq + 1..).next().is_some()
        } else {
            promised.contains(&seq)
        }
    };
    let got = recovered_from(&state.tree, root);
    let keys: BTreeSet<&String> = history.iter().map(|(_, k, _, _)| k).collect();
    let mut lost = Vec::new();
    for key in keys {
        let of_key: Vec<_> = history.iter().filter(|(_, k, _, _)| k == key).collect();
        let last = of_key
            .iter()
            .filter(|(s, _, _, lazy)| kept(*s, *lazy))
            .map(|(s, _, _, _)| *s)
            .max();
        let mut allowed: Vec<Option<&String>> = of_key
            .iter()
            .filter(|(s, _, _, _)| last.is_none_or(|l| *s >= l))
            .map(|(_, _, v, _)| v.as_ref())
            .collect();
        if last.is_none() {
            allowed.push(None);
        }
        let found = got.get(key);
        if !allowed.contains(&found) {
            lost.push(format!(
                "power cut after op {}: key {key} recovered as {found:?}, allowed {allowed:?}",
                state.point
            ));
        }
    }
    lost
}

#[test]
fn every_power_cut_of_appends_compaction_and_recovery_keeps_every_returned_value() {
    require_root();
    let sb = Sandbox::new("journal-power-loss");
    let tmpfs = Tmpfs::mount(&sb, "fs", "64M");
    let root = tmpfs.path().join("store");
    std::fs::create_dir(&root).unwrap();
    let log = sb.join("ops.jsonl");
    let (base, ops, history) = run(&root, &log);
    let count = |f: fn(&Op) -> bool| ops.iter().filter(|op| f(op)).count();
    let appends = count(|op| matches!(op, Op::Append { .. }));
    let synced = count(|op| matches!(op, Op::Fdatasync { .. }));
    let syncfs = count(|op| matches!(op, Op::SyncFs { .. }));
    assert!(synced >= 2, "{synced} synced batches");
    assert!(
        synced < 11,
        "11 appends waiting for a sync in {synced} synced batches: none shared"
    );
    assert!(
        appends > synced,
        "the lazy appends were written in no batch of their own: {ops:#?}"
    );
    assert_eq!(
        syncfs, 3,
        "two compactions at open and one in the run: {ops:#?}"
    );

    let states = crash_states(&base, &ops);
    let mut broken = Vec::new();
    for s in &states {
        broken.extend(check_promises(&ops, s).iter().map(ToString::to_string));
        broken.extend(lost_values(&ops, &history, s, &root));
    }
    assert!(
        broken.is_empty(),
        "{} broken:\n{}",
        broken.len(),
        broken.join("\n")
    );
    eprintln!(
        "journal: {} ops ({appends} batches), {} crash states checked, no promise or value lost",
        ops.len(),
        states.len()
    );

    // A sample recovered for real: every state with a journal tail to cut, and every 7th.
    let mut recovered = 0;
    for (i, s) in states.iter().enumerate() {
        let torn = match s.tree.get(&root.join("journal")) {
            Some(Node::File(_, b)) => journal::parse(b).unwrap().cut.is_some(),
            _ => false,
        };
        if !torn && i % 7 != 0 {
            continue;
        }
        let want = recovered_from(&s.tree, &root);
        materialize(&s.tree, &root).unwrap();
        std::fs::create_dir_all(files_dir(&root)).unwrap();
        let (store, got) = Store::open(&root);
        assert_eq!(got, want, "state {i} at op {}", s.point);
        drop(store);
        // After the recovery's compaction the journal is empty and the files hold it all.
        let (_, again) = Store::open(&root);
        assert_eq!(again, want, "state {i} recovered twice");
        let (parsed, _) = journal::read(&root.join("journal")).unwrap().unwrap();
        assert!(parsed.entries.is_empty() && parsed.cut.is_none());
        recovered += 1;
    }
    eprintln!("journal: {recovered} crash states recovered on disk");
}

/// The planted bug: the journal reset before its write-back is durable (the syncfs dropped).
/// A power cut after the reset may undo the write-back's renames or leave their files empty,
/// and the entries that held those values are gone: the checker must say so.
#[test]
fn a_journal_reset_before_the_write_back_is_durable_is_caught() {
    require_root();
    let sb = Sandbox::new("journal-planted");
    let tmpfs = Tmpfs::mount(&sb, "fs", "64M");
    let root = tmpfs.path().join("store");
    std::fs::create_dir(&root).unwrap();
    let log = sb.join("ops.jsonl");
    let (base, mut ops, history) = run(&root, &log);
    // The bug: no syncfs in any write-back (the reset still follows it).
    ops.retain(|op| !matches!(op, Op::SyncFs { .. }));
    let states = crash_states(&base, &ops);
    let lost: Vec<String> = states
        .iter()
        .flat_map(|s| lost_values(&ops, &history, s, &root))
        .collect();
    assert!(
        !lost.is_empty(),
        "a reset before a durable write-back passed {} states",
        states.len()
    );
    eprintln!(
        "planted bug, reset before the write-back is durable: {}",
        lost[0]
    );

    // The second planted bug: appends returned before their fdatasync.
    let (base, mut ops, _) = {
        let root = tmpfs.path().join("store2");
        std::fs::create_dir(&root).unwrap();
        run(&root, &sb.join("ops2.jsonl"))
    };
    ops.retain(|op| !matches!(op, Op::Fdatasync { .. }));
    let broken: Vec<_> = crash_states(&base, &ops)
        .iter()
        .flat_map(|s| check_promises(&ops, s))
        .filter(|l| matches!(l.promise, Promise::Journaled { .. }))
        .collect();
    assert!(!broken.is_empty(), "appends without their fdatasync passed");
    eprintln!("planted bug, append without its fdatasync: {}", broken[0]);
}
