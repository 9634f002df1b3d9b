//! Power-loss crash states, built from the durable-op log ([`csi_isolator::durable::record`]),
//! and the check that no durable operation that returned success is lost.
//!
//! The model of a power cut after operation `k` (conservative, after ALICE and CrashMonkey):
//! the operations `0..k` are replayed in order on the base tree (what was on disk, durable,
//! before the run), except that an operation not yet made durable may be lost:
//! - file data written but not fsynced (an [`Op::Fsync`] of the same file, by any name, later
//!   in the prefix) may survive, be lost (the file empty) or be cut short (its first half);
//! - data appended ([`Op::Append`]) and not yet synced (an [`Op::Fsync`] or [`Op::Fdatasync`]
//!   of the file) may survive, be lost, be cut short, or be zeros (the size reached the disk,
//!   the bytes did not); an earlier append lost under a later one kept leaves a hole of zeros;
//!   a cut ([`Op::Truncate`]) not yet synced may be undone;
//! - a directory entry change (create, mkdir, rename, unlink, rmdir) not yet made durable by
//!   an [`Op::FsyncDir`] of its directory (both directories of a rename) may be present or
//!   absent, independently of the others; a rename is atomic (both names or neither);
//! - an [`Op::SyncFs`] makes every change before it durable (the tests keep to one file
//!   system).
//!
//! A kept operation whose precondition a lost one broke (a rename of a name whose create was
//! lost) does nothing. Every subset of the lost operations is enumerated when there are few
//! ([`ALL_SUBSETS_UP_TO`] choices), else a deterministic sample of [`SAMPLE`] plus the two
//! extremes; equal states are counted once.
//!
//! Limits: no reordering inside a file's data beyond "a prefix"; fsync of a file does not
//! persist its directory entry (stricter than ext4, which commits its journal); directories
//! made outside the seam (the test passes them in the base tree) are taken as durable.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

pub use csi_isolator::durable::record::{read_log, Op, Promise};

/// A choice set up to this size is enumerated in full (2^10 states at most at one point).
pub const ALL_SUBSETS_UP_TO: usize = 10;

/// How many sampled choices a point with more gets, besides "all kept" and "all lost".
pub const SAMPLE: usize = 64;

/// One entry of a tree.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Node {
    /// A directory with its mode.
    Dir(u32),
    /// A regular file with its mode and bytes.
    File(u32, Vec<u8>),
}

/// A directory tree by absolute path (parents sort before children).
pub type Tree = BTreeMap<PathBuf, Node>;

/// Reads the tree under `root` (directories and regular files; the rest is skipped), `root`
/// excluded.
pub fn scan(root: &Path) -> Tree {
    fn walk(dir: &Path, out: &mut Tree) {
        let Ok(entries) = fs::read_dir(dir) else {
            return;
        };
        for e in entries.flatten() {
            let path = e.path();
            let Ok(meta) = fs::symlink_metadata(&path) else {
                continue;
            };
            let mode = meta.permissions().mode() & 0o7777;
            if meta.is_dir() {
                out.insert(path.clone(), Node::Dir(mode));
                walk(&path, out);
            } else if meta.is_file() {
                if let Ok(bytes) = fs::read(&path) {
                    out.insert(path, Node::File(mode, bytes));
                }
            }
        }
    }
    let mut out = Tree::new();
    walk(root, &mut out);
    out
}

/// Empties `root` and writes `tree`'s entries under it (entries outside `root` are skipped).
pub fn materialize(tree: &Tree, root: &Path) -> io::Result<()> {
    if root.exists() {
        fs::remove_dir_all(root)?;
    }
    fs::create_dir_all(root)?;
    for (path, node) in tree.range(root.to_path_buf()..) {
        if !path.starts_with(root) {
            break;
        }
        match node {
            Node::Dir(mode) => fs::DirBuilder::new().mode(*mode).create(path)?,
            Node::File(mode, bytes) => {
                fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(*mode)
                    .open(path)?;
                fs::write(path, bytes)?;
                fs::set_permissions(path, fs::Permissions::from_mode(*mode))?;
            }
        }
    }
    Ok(())
}

/// What may become of an operation not yet durable at the cut.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fate {
    Kept,
    Lost,
    /// File data cut to its first half.
    Torn,
    /// Appended data whose size reached the disk but not its bytes: zeros.
    Zeroed,
}

/// A file system in replay: names to entries, files by inode.
#[derive(Clone)]
struct Fs {
    names: BTreeMap<PathBuf, Ent>,
    /// Base files are inodes `0..base.len()`; the create at op `i` makes `base.len() + i`,
    /// whichever ops before it were lost.
    inodes: BTreeMap<usize, (u32, Vec<u8>)>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ent {
    Dir(u32),
    File(usize),
}

const MKDIR_MODE: u32 = 0o755;

impl Fs {
    fn new(base: &Tree) -> Fs {
        let mut fs = Fs {
            names: BTreeMap::new(),
            inodes: BTreeMap::new(),
        };
        for (n, (path, node)) in base.iter().enumerate() {
            let ent = match node {
                Node::Dir(mode) => Ent::Dir(*mode),
                Node::File(mode, bytes) => {
                    fs.inodes.insert(n, (*mode, bytes.clone()));
                    Ent::File(n)
                }
            };
            fs.names.insert(path.clone(), ent);
        }
        fs
    }

    /// Whether `path`'s parent exists here (a path outside every known tree has a parent
    /// the test did not model: taken as present).
    fn parent_ok(&self, path: &Path) -> bool {
        match path.parent() {
            Some(p) => matches!(self.names.get(p), Some(Ent::Dir(_))) || !self.knows_above(p),
            None => true,
        }
    }

    /// Whether some ancestor-or-self of `p` is an entry: then `p` is inside the modelled
    /// trees and must exist to be used.
    fn knows_above(&self, p: &Path) -> bool {
        p.ancestors().any(|a| self.names.contains_key(a))
    }

    /// Applies `op` (a create makes inode `ino`, a write acts on it), the write cut by
    /// `fate`. An op whose precondition fails does nothing.
    fn apply(&mut self, op: &Op, ino: Option<usize>, fate: Fate) {
        match op {
            Op::Create { path, mode } => {
                let Some(n) = ino else { return };
                if self.names.contains_key(path) || !self.parent_ok(path) {
                    return;
                }
                self.inodes.insert(n, (*mode, Vec::new()));
                self.names.insert(path.clone(), Ent::File(n));
            }
            Op::Write { bytes, .. } => {
                if let Some(data) = ino.and_then(|n| self.inodes.get_mut(&n)) {
                    data.1 = match fate {
                        Fate::Kept => bytes.clone(),
                        Fate::Lost => Vec::new(),
                        Fate::Torn => bytes[..bytes.len() / 2].to_vec(),
                        Fate::Zeroed => vec![0; bytes.len()],
                    };
                }
            }
            Op::Append { offset, bytes, .. } => {
                if let Some(data) = ino.and_then(|n| self.inodes.get_mut(&n)) {
                    // An earlier append lost leaves a hole, read as zeros.
                    let at = *offset as usize;
                    data.1.truncate(at);
                    data.1.resize(at, 0);
                    match fate {
                        Fate::Kept => data.1.extend_from_slice(bytes),
                        Fate::Lost => {}
                        Fate::Torn => data.1.extend_from_slice(&bytes[..bytes.len() / 2]),
                        Fate::Zeroed => data.1.resize(at + bytes.len(), 0),
                    }
                }
            }
            Op::Truncate { len, .. } => {
                if let Some(data) = ino.and_then(|n| self.inodes.get_mut(&n)) {
                    data.1.truncate(*len as usize);
                }
            }
            Op::Rename { from, to } => {
                if !self.names.contains_key(from)
                    || !self.parent_ok(to)
                    || matches!(self.names.get(to), Some(Ent::Dir(_)))
                {
                    return;
                }
                let moved: Vec<(PathBuf, Ent)> = self
                    .names
                    .range(from.clone()..)
                    .take_while(|(p, _)| p.starts_with(from))
                    .map(|(p, e)| (p.clone(), *e))
                    .collect();
                for (p, _) in &moved {
                    self.names.remove(p);
                }
                for (p, e) in moved {
                    let rel = p.strip_prefix(from).expect("under from");
                    let np = if rel.as_os_str().is_empty() {
                        to.clone()
                    } else {
                        to.join(rel)
                    };
                    self.names.insert(np, e);
                }
            }
            Op::Unlink { path } => {
                if matches!(self.names.get(path), Some(Ent::File(_))) {
                    self.names.remove(path);
                }
            }
            Op::Mkdir { path } => {
                if !self.names.contains_key(path) && self.parent_ok(path) {
                    self.names.insert(path.clone(), Ent::Dir(MKDIR_MODE));
                }
            }
            Op::Rmdir { path } => {
                let empty = !self
                    .names
                    .range(path.clone()..)
                    .nth(1)
                    .is_some_and(|(p, _)| p.starts_with(path));
                if matches!(self.names.get(path), Some(Ent::Dir(_))) && empty {
                    self.names.remove(path);
                }
            }
            Op::Fsync { .. }
            | Op::Fdatasync { .. }
            | Op::FsyncDir { .. }
            | Op::SyncFs { .. }
            | Op::Promised(_) => {}
        }
    }

    fn tree(&self) -> Tree {
        self.names
            .iter()
            .map(|(p, e)| {
                let node = match e {
                    Ent::Dir(mode) => Node::Dir(*mode),
                    Ent::File(n) => {
                        let (mode, bytes) = &self.inodes[n];
                        Node::File(*mode, bytes.clone())
                    }
                };
                (p.clone(), node)
            })
            .collect()
    }
}

/// The log analysed once: each file op's inode, and where each op becomes durable.
struct Analysis {
    /// The inode a write or fsync acts on (in the replay with nothing lost).
    ino: Vec<Option<usize>>,
    /// The index of the op that makes op i durable (None: never, or nothing to make durable).
    durable_at: Vec<Option<usize>>,
    /// Whether op i can be lost at all (a content-changing op).
    changes: Vec<bool>,
}

fn analyse(base: &Tree, ops: &[Op]) -> Analysis {
    let mut fs = Fs::new(base);
    let mut ino = vec![None; ops.len()];
    for (i, op) in ops.iter().enumerate() {
        match op {
            Op::Write { path, .. }
            | Op::Fsync { path }
            | Op::Append { path, .. }
            | Op::Truncate { path, .. }
            | Op::Fdatasync { path } => {
                if let Some(Ent::File(n)) = fs.names.get(path) {
                    ino[i] = Some(*n);
                }
            }
            Op::Create { .. } => ino[i] = Some(base.len() + i),
            _ => {}
        }
        fs.apply(op, ino[i], Fate::Kept);
    }
    let parent = |p: &Path| p.parent().map(Path::to_path_buf);
    let mut durable_at = vec![None; ops.len()];
    let mut changes = vec![false; ops.len()];
    // A syncfs makes everything before it durable.
    let syncfs_after = |i: usize| (i + 1..ops.len()).find(|&j| matches!(ops[j], Op::SyncFs { .. }));
    let earliest = |a: Option<usize>, b: Option<usize>| match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    for (i, op) in ops.iter().enumerate() {
        // The directories whose fsync makes an entry change durable.
        let dirs: Vec<PathBuf> = match op {
            Op::Create { path, .. }
            | Op::Unlink { path }
            | Op::Mkdir { path }
            | Op::Rmdir { path } => parent(path).into_iter().collect(),
            Op::Rename { from, to } => parent(from).into_iter().chain(parent(to)).collect(),
            _ => Vec::new(),
        };
        if let Op::Write { .. } | Op::Append { .. } | Op::Truncate { .. } = op {
            changes[i] = true;
            let synced = (i + 1..ops.len()).find(|&j| {
                matches!(ops[j], Op::Fsync { .. } | Op::Fdatasync { .. })
                    && ino[j] == ino[i]
                    && ino[i].is_some()
            });
            durable_at[i] = earliest(synced, syncfs_after(i));
        } else if !dirs.is_empty() {
            changes[i] = true;
            // Every directory must be synced after the op; durable at the last of them.
            let mut at = Some(i);
            for d in &dirs {
                let j = (i + 1..ops.len())
                    .find(|&j| matches!(&ops[j], Op::FsyncDir { path } if path == d));
                at = match (at, j) {
                    (Some(a), Some(j)) => Some(a.max(j)),
                    _ => None,
                };
            }
            durable_at[i] = earliest(at, syncfs_after(i));
        }
    }
    Analysis {
        ino,
        durable_at,
        changes,
    }
}

/// A state the disk could hold after a power cut.
#[derive(Clone, Debug)]
pub struct CrashState {
    /// The cut came after this many operations.
    pub point: usize,
    /// What the disk holds.
    pub tree: Tree,
}

/// Every distinct crash state of a power cut after each prefix of `ops` (see the module
/// doc), from `base`, in order of the cut.
pub fn crash_states(base: &Tree, ops: &[Op]) -> Vec<CrashState> {
    let a = analyse(base, ops);
    let mut out = Vec::new();
    for k in 0..=ops.len() {
        // The cut after a promise or a sync changes nothing the cut before it did not.
        if k > 0 && !a.changes[k - 1] && k < ops.len() {
            continue;
        }
        let pending: Vec<usize> = (0..k)
            .filter(|&i| a.changes[i] && a.durable_at[i].is_none_or(|j| j >= k))
            .collect();
        let fates_of = |i: usize| -> &'static [Fate] {
            if matches!(ops[i], Op::Write { .. }) {
                &[Fate::Kept, Fate::Lost, Fate::Torn]
            } else if matches!(ops[i], Op::Append { .. }) {
                &[Fate::Kept, Fate::Lost, Fate::Torn, Fate::Zeroed]
            } else {
                &[Fate::Kept, Fate::Lost]
            }
        };
        let choices: Vec<Vec<Fate>> = if pending.len() <= ALL_SUBSETS_UP_TO {
            let mut all = vec![Vec::new()];
            for &i in &pending {
                all = all
                    .into_iter()
                    .flat_map(|c: Vec<Fate>| {
                        fates_of(i).iter().map(move |f| {
                            let mut c = c.clone();
                            c.push(*f);
                            c
                        })
                    })
                    .collect();
            }
            all
        } else {
            let mut rng = Lcg(k as u64 * 0x9e37_79b9 + 1);
            let mut sample = vec![
                vec![Fate::Kept; pending.len()],
                pending.iter().map(|_| Fate::Lost).collect(),
            ];
            for _ in 0..SAMPLE {
                sample.push(
                    pending
                        .iter()
                        .map(|&i| {
                            let f = fates_of(i);
                            f[rng.next() as usize % f.len()]
                        })
                        .collect(),
                );
            }
            sample
        };
        let mut seen = BTreeSet::new();
        for choice in choices {
            let fate: BTreeMap<usize, Fate> = pending.iter().copied().zip(choice).collect();
            let mut fs = Fs::new(base);
            for (i, op) in ops[..k].iter().enumerate() {
                let f = fate.get(&i).copied().unwrap_or(Fate::Kept);
                if f == Fate::Lost && !matches!(op, Op::Write { .. }) {
                    continue;
                }
                fs.apply(op, a.ino[i], f);
            }
            let tree = fs.tree();
            if seen.insert(tree.clone()) {
                out.push(CrashState { point: k, tree });
            }
        }
    }
    out
}

/// A small deterministic generator for the samples.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 33
    }
}

/// A promise a crash state breaks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lost {
    /// The cut.
    pub point: usize,
    /// The operation that returned success.
    pub promise: Promise,
    /// What the state holds at its path instead.
    pub found: Option<Node>,
}

impl std::fmt::Display for Lost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let found = match &self.found {
            None => "nothing".to_string(),
            Some(Node::Dir(_)) => "a directory".to_string(),
            Some(Node::File(_, b)) => format!("{:?}", String::from_utf8_lossy(b)),
        };
        write!(
            f,
            "power cut after op {}: returned success, not durable: {:?}; found {found}",
            self.point, self.promise
        )
    }
}

/// The promises of `ops[..state.point]` that `state` breaks: for each path, its last promise
/// must hold, unless a later operation of the prefix changed that path again (then what the
/// later operation would leave is allowed too).
pub fn check_promises(ops: &[Op], state: &CrashState) -> Vec<Lost> {
    let prefix = &ops[..state.point];
    let mut lost = Vec::new();
    for (i, op) in prefix.iter().enumerate() {
        let Op::Promised(promise) = op else {
            continue;
        };
        let path = op.paths()[0];
        let superseded = prefix[i + 1..].iter().any(|later| match later {
            Op::Promised(p) => Op::Promised(p.clone()).paths()[0] == path,
            _ => false,
        });
        if superseded {
            continue;
        }
        let found = state.tree.get(path).cloned();
        let mut allowed: Vec<Option<Node>> = Vec::new();
        match promise {
            Promise::Written { bytes, .. } => {
                if let Some(Node::File(mode, _)) = &found {
                    allowed.push(Some(Node::File(*mode, bytes.clone())));
                }
            }
            Promise::Removed { .. } => allowed.push(None),
            Promise::DirMade { .. } => {
                if let Some(Node::Dir(m)) = &found {
                    allowed.push(Some(Node::Dir(*m)));
                }
            }
            Promise::Journaled { seq, .. } => {
                // The file's complete entries hold the entry (and, by their sequence, every
                // earlier one of this file).
                if let Some(Node::File(_, bytes)) = &found {
                    let holds = csi_isolator::durable::journal::parse(bytes)
                        .is_ok_and(|p| p.entries.iter().any(|e| e.seq == *seq));
                    if holds {
                        allowed.push(found.clone());
                    }
                }
            }
        }
        // What the later, unfinished operations on the path may leave there.
        let mut written: BTreeMap<&Path, &Vec<u8>> = BTreeMap::new();
        for later in &prefix[i + 1..] {
            match later {
                Op::Write { path: p, bytes } => {
                    written.insert(p, bytes);
                }
                Op::Rename { from, to } if to == path => {
                    if let (Some(bytes), Some(Node::File(mode, _))) =
                        (written.get(from.as_path()), &found)
                    {
                        allowed.push(Some(Node::File(*mode, (*bytes).clone())));
                    }
                }
                Op::Rename { from, .. } if from == path => allowed.push(None),
                Op::Unlink { path: p } | Op::Rmdir { path: p } if p == path => allowed.push(None),
                Op::Mkdir { path: p } if p == path => {
                    if let Some(Node::Dir(m)) = &found {
                        allowed.push(Some(Node::Dir(*m)));
                    }
                }
                // Appends (a journal's) keep what was written before them as a prefix.
                Op::Append { path: p, .. } | Op::Truncate { path: p, .. } if p == path => {
                    if let (Promise::Written { bytes, .. }, Some(Node::File(_, b))) =
                        (promise, &found)
                    {
                        if b.starts_with(bytes) {
                            allowed.push(found.clone());
                        }
                    }
                }
                _ => {}
            }
        }
        if !allowed.contains(&found) {
            lost.push(Lost {
                point: state.point,
                promise: promise.clone(),
                found,
            });
        }
    }
    lost
}

/// The operations of one `write_atomic` of `bytes` to `path` through the temp file `tmp`, in
/// the order the seam records them.
pub fn write_atomic_ops(tmp: &Path, path: &Path, bytes: &[u8]) -> Vec<Op> {
    vec![
        Op::Create {
            path: tmp.to_path_buf(),
            mode: 0o600,
        },
        Op::Write {
            path: tmp.to_path_buf(),
            bytes: bytes.to_vec(),
        },
        Op::Fsync {
            path: tmp.to_path_buf(),
        },
        Op::Rename {
            from: tmp.to_path_buf(),
            to: path.to_path_buf(),
        },
        Op::FsyncDir {
            path: path.parent().expect("a parent").to_path_buf(),
        },
        Op::Promised(Promise::Written {
            path: path.to_path_buf(),
            bytes: bytes.to_vec(),
        }),
    ]
}

/// Every promise broken in any crash state of `ops`, and the number of states.
pub fn lost_promises(base: &Tree, ops: &[Op]) -> (Vec<Lost>, usize) {
    let states = crash_states(base, ops);
    let lost = states.iter().flat_map(|s| check_promises(ops, s)).collect();
    (lost, states.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> PathBuf {
        PathBuf::from(s)
    }

    fn base() -> Tree {
        [(p("/w"), Node::Dir(0o700))].into_iter().collect()
    }

    fn file(bytes: &[u8]) -> Option<Node> {
        Some(Node::File(0o600, bytes.to_vec()))
    }

    #[test]
    fn the_real_write_atomic_sequence_keeps_its_promise_in_every_state() {
        let ops = write_atomic_ops(&p("/w/.f.tmp-1-0"), &p("/w/f"), b"new");
        let (lost, n) = lost_promises(&base(), &ops);
        assert!(lost.is_empty(), "{lost:?}");
        // Before the promise the temp may or may not be there, with any cut of its data;
        // f is absent or whole: never torn (the data was synced before the rename).
        let states = crash_states(&base(), &ops);
        assert_eq!(states.len(), n);
        for s in &states {
            match s.tree.get(&p("/w/f")) {
                None => {}
                Some(node) => assert_eq!(Some(node.clone()), file(b"new"), "{s:?}"),
            }
        }
        assert!(states.iter().any(|s| !s.tree.contains_key(&p("/w/f"))));
        assert!(states
            .iter()
            .any(|s| s.tree.get(&p("/w/.f.tmp-1-0")) == file(b"n").as_ref()));
        // After the directory fsync, one state only: f whole, no temp.
        let last: Vec<_> = states.iter().filter(|s| s.point == ops.len()).collect();
        assert_eq!(last.len(), 1);
        assert_eq!(last[0].tree.get(&p("/w/f")), file(b"new").as_ref());
        assert!(!last[0].tree.contains_key(&p("/w/.f.tmp-1-0")));
    }

    /// The planted bug: `write_atomic` without its directory fsync. The rename may be lost
    /// after success was returned.
    #[test]
    fn a_rename_without_the_directory_fsync_is_reported() {
        let mut ops = write_atomic_ops(&p("/w/.f.tmp-1-0"), &p("/w/f"), b"new");
        ops.retain(|op| !matches!(op, Op::FsyncDir { .. }));
        let (lost, _) = lost_promises(&base(), &ops);
        assert!(!lost.is_empty());
        assert!(lost.iter().all(|l| l.found.is_none()), "{lost:?}");
        assert!(lost[0]
            .to_string()
            .contains("returned success, not durable"));
    }

    /// The planted bug: a write without its fsync. The file may be in place, empty or
    /// cut short, after success was returned.
    #[test]
    fn a_write_without_its_fsync_is_reported() {
        let mut ops = write_atomic_ops(&p("/w/.f.tmp-1-0"), &p("/w/f"), b"new");
        ops.retain(|op| !matches!(op, Op::Fsync { .. }));
        let (lost, _) = lost_promises(&base(), &ops);
        let found: BTreeSet<_> = lost.iter().map(|l| l.found.clone()).collect();
        assert_eq!(
            found,
            [file(b""), file(b"n")].into_iter().collect(),
            "{lost:?}"
        );
    }

    /// A replace is atomic: the old content or the new, never neither, never torn.
    #[test]
    fn a_replace_leaves_the_old_or_the_new_content() {
        let mut base = base();
        base.insert(p("/w/f"), Node::File(0o600, b"old".to_vec()));
        let ops = write_atomic_ops(&p("/w/.f.tmp-1-0"), &p("/w/f"), b"new");
        for s in crash_states(&base, &ops) {
            let f = s.tree.get(&p("/w/f")).cloned();
            assert!(f == file(b"old") || f == file(b"new"), "{s:?}");
        }
        let (lost, _) = lost_promises(&base, &ops);
        assert!(lost.is_empty(), "{lost:?}");
    }

    /// A mkdir made durable by its parent's fsync is always there; one not yet synced may be
    /// absent, and so may what was made inside it, even when that was synced.
    #[test]
    fn an_unsynced_mkdir_takes_its_synced_children_with_it() {
        let ops = vec![
            Op::Mkdir { path: p("/w/a") },
            Op::Mkdir { path: p("/w/a/b") },
            Op::FsyncDir { path: p("/w/a") },
            Op::Promised(Promise::DirMade { path: p("/w/a/b") }),
        ];
        let (lost, _) = lost_promises(&base(), &ops);
        assert_eq!(lost.len(), 1, "{lost:?}");
        assert_eq!(lost[0].found, None);

        let mut fixed = ops.clone();
        fixed.insert(1, Op::FsyncDir { path: p("/w") });
        let (lost, _) = lost_promises(&base(), &fixed);
        assert!(lost.is_empty(), "{lost:?}");
        for s in crash_states(&base(), &fixed)
            .iter()
            .filter(|s| s.point >= 2)
        {
            assert!(s.tree.contains_key(&p("/w/a")), "{s:?}");
        }
    }

    /// An unlink not yet synced may be undone; a durable removal stays removed.
    #[test]
    fn removals_are_durable_only_after_the_directory_fsync() {
        let mut base = base();
        base.insert(p("/w/f"), Node::File(0o600, b"x".to_vec()));
        let ops = vec![
            Op::Unlink { path: p("/w/f") },
            Op::FsyncDir { path: p("/w") },
            Op::Promised(Promise::Removed { path: p("/w/f") }),
        ];
        let states = crash_states(&base, &ops);
        let at1: Vec<_> = states.iter().filter(|s| s.point == 1).collect();
        assert_eq!(at1.len(), 2, "present or absent");
        assert!(states
            .iter()
            .filter(|s| s.point >= 2)
            .all(|s| !s.tree.contains_key(&p("/w/f"))));
        assert!(lost_promises(&base, &ops).0.is_empty());
    }

    /// Many pending operations: a bounded, deterministic sample, the extremes included.
    #[test]
    fn many_pending_operations_are_sampled_deterministically() {
        let ops: Vec<Op> = (0..20)
            .map(|i| Op::Mkdir {
                path: p(&format!("/w/d{i}")),
            })
            .collect();
        let states = crash_states(&base(), &ops);
        let last: Vec<_> = states.iter().filter(|s| s.point == 20).collect();
        assert!(last.len() <= SAMPLE + 2 && last.len() > 2, "{}", last.len());
        assert!(last.iter().any(|s| s.tree.len() == 21), "all kept");
        assert!(last.iter().any(|s| s.tree.len() == 1), "all lost");
        let again = crash_states(&base(), &ops);
        assert_eq!(
            states.iter().map(|s| &s.tree).collect::<Vec<_>>(),
            again.iter().map(|s| &s.tree).collect::<Vec<_>>()
        );
        // At 10 pending ops, every subset.
        let at10 = states.iter().filter(|s| s.point == 10).count();
        assert_eq!(at10, 1 << 10);
    }

    fn journal_ops(sync: bool) -> (Tree, Vec<Op>) {
        use csi_isolator::durable::journal::{encode, header};
        let mut base = base();
        base.insert(p("/w/j"), Node::File(0o600, header(1)));
        let mut frame = Vec::new();
        encode(1, b"entry", &mut frame);
        let mut ops = vec![Op::Append {
            path: p("/w/j"),
            offset: header(1).len() as u64,
            bytes: frame,
        }];
        if sync {
            ops.push(Op::Fdatasync { path: p("/w/j") });
        }
        ops.push(Op::Promised(Promise::Journaled {
            path: p("/w/j"),
            seq: 1,
        }));
        (base, ops)
    }

    /// An append synced before its promise keeps it; before the sync the frame may be
    /// whole, absent, cut short or zeros, and the parser takes only a whole one.
    #[test]
    fn a_synced_append_keeps_its_promise_and_an_unsynced_one_may_be_torn_or_zeroed() {
        let (base, ops) = journal_ops(true);
        assert!(lost_promises(&base, &ops).0.is_empty());
        let at1: Vec<_> = crash_states(&base, &ops)
            .into_iter()
            .filter(|s| s.point == 1)
            .collect();
        assert_eq!(at1.len(), 4, "kept, lost, torn, zeroed");
        let whole = at1
            .iter()
            .filter(|s| match s.tree.get(&p("/w/j")) {
                Some(Node::File(_, b)) => {
                    csi_isolator::durable::journal::parse(b)
                        .unwrap()
                        .entries
                        .len()
                        == 1
                }
                _ => false,
            })
            .count();
        assert_eq!(whole, 1);
    }

    /// The planted bug: an append returned before its fdatasync.
    #[test]
    fn an_append_without_its_fdatasync_is_reported() {
        let (base, ops) = journal_ops(false);
        let (lost, _) = lost_promises(&base, &ops);
        assert_eq!(lost.len(), 3, "lost, torn, zeroed: {lost:?}");
    }

    /// A syncfs makes every earlier change durable: renames and unsynced data alike.
    #[test]
    fn a_syncfs_makes_everything_before_it_durable() {
        let mut ops = write_atomic_ops(&p("/w/.f.tmp-1-0"), &p("/w/f"), b"new");
        ops.retain(|op| !matches!(op, Op::Fsync { .. } | Op::FsyncDir { .. }));
        let promise = ops.pop().unwrap();
        ops.push(Op::SyncFs { path: p("/w") });
        ops.push(promise);
        let (lost, n) = lost_promises(&base(), &ops);
        assert!(lost.is_empty(), "{lost:?}");
        assert!(n > 3);
        // Before the syncfs, the renamed file may be empty: the write was not synced.
        assert!(crash_states(&base(), &ops)
            .iter()
            .any(|s| s.tree.get(&p("/w/f")) == file(b"").as_ref()));
    }

    #[test]
    fn a_tree_round_trips_through_the_disk() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("r");
        let tree: Tree = [
            (root.join("a"), Node::Dir(0o700)),
            (root.join("a/f"), Node::File(0o600, b"x".to_vec())),
            (root.join("g"), Node::File(0o644, Vec::new())),
        ]
        .into_iter()
        .collect();
        fs::create_dir_all(root.join("stale")).unwrap();
        materialize(&tree, &root).unwrap();
        assert_eq!(scan(&root), tree);
    }
}
