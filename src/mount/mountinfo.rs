//! Reads of kernel mount state: the [`MountTable`] trait, the `/proc/<pid>/mountinfo` parser and
//! [`ProcMountTable`], which reads the real file.
//!
//! Format (proc(5)): `id parent major:minor root mount_point options [optional fields...] - fstype source
//! super_options`. The kernel escapes space, tab, newline and backslash in root, mount point and source as
//! three-digit octal (`\040`, `\011`, `\012`, `\134`); the parser undoes that. Every other byte is
//! written as is, so a path need not be UTF-8: the table is parsed as bytes, and root and mount point
//! keep their exact bytes (a non-UTF-8 mount point anywhere in the table must not break readers).

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};

use nix::errno::Errno;

use super::MountError;

/// One line of a mountinfo file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountInfo {
    /// Unique id of the mount.
    pub mount_id: u32,
    /// Id of the parent mount (itself for the root of the namespace).
    pub parent_id: u32,
    /// Device major number.
    pub major: u32,
    /// Device minor number.
    pub minor: u32,
    /// The root of the mount inside its file system (e.g. the bound subdirectory).
    pub root: PathBuf,
    /// Where it is mounted, relative to the reading process's root.
    pub mount_point: PathBuf,
    /// Per-mount options (`rw`, `ro`, `nosuid`, ...).
    pub mount_options: Vec<String>,
    /// Optional fields such as `shared:1`, `master:2`, `propagate_from:3`, `unbindable`.
    pub optional_fields: Vec<String>,
    /// File system type (`ext4`, `tmpfs`, ...).
    pub fs_type: String,
    /// File system specific source (a device, or a name like `tmpfs`).
    pub source: String,
    /// Per-superblock options.
    pub super_options: Vec<String>,
}

impl MountInfo {
    /// Whether the mount itself is read-only (`ro` among its per-mount options).
    pub fn is_readonly(&self) -> bool {
        self.mount_options.iter().any(|o| o == "ro")
    }

    /// The peer group id if the mount is shared (`shared:N`).
    pub fn shared_peer_group(&self) -> Option<u32> {
        self.optional_field_value("shared")
    }

    /// The master peer group id if the mount is a slave (`master:N`).
    pub fn master_peer_group(&self) -> Option<u32> {
        self.optional_field_value("master")
    }

    /// Whether the mount is unbindable.
    pub fn is_unbindable(&self) -> bool {
        self.optional_fields.iter().any(|f| f == "unbindable")
    }

    fn optional_field_value(&self, tag: &str) -> Option<u32> {
        self.optional_fields.iter().find_map(|f| {
            let (t, v) = f.split_once(':')?;
            if t == tag {
                v.parse().ok()
            } else {
                None
            }
        })
    }
}

/// Reads of kernel mount state.
pub trait MountTable: Send + Sync + std::fmt::Debug {
    /// All mounts, in table order (parents before children, later mounts over earlier ones).
    fn mounts(&self) -> Result<Vec<MountInfo>, MountError>;

    /// Whether some mount has exactly `path` as its mount point.
    fn is_mount_point(&self, path: &Path) -> Result<bool, MountError> {
        Ok(self.mounts()?.iter().any(|m| m.mount_point == path))
    }

    /// Mounts whose mount point is `prefix` or lies below it (by path components), deepest first; mounts
    /// stacked at the same point come topmost first, so unmounting in this order always works.
    fn mounts_under(&self, prefix: &Path) -> Result<Vec<MountInfo>, MountError> {
        let mut found: Vec<(usize, MountInfo)> = self
            .mounts()?
            .into_iter()
            .filter(|m| m.mount_point.starts_with(prefix))
            .enumerate()
            .collect();
        found.sort_by(|(ia, a), (ib, b)| {
            let da = a.mount_point.components().count();
            let db = b.mount_point.components().count();
            db.cmp(&da).then(ib.cmp(ia))
        });
        Ok(found.into_iter().map(|(_, m)| m).collect())
    }

    /// Whether `path` is the root of a mount. Same answer as
    /// [`is_mount_point`](Self::is_mount_point); implementations may answer
    /// it without reading the whole table (it is on every publish's path).
    fn is_mount_root(&self, path: &Path) -> Result<bool, MountError> {
        self.is_mount_point(path)
    }

    /// Whether `dir/<entry>/<leaf>` is a mount point ([`is_mount_point`](Self::is_mount_point)),
    /// for every entry of `entries` and every leaf of `leaves`, entry by entry (the answer for
    /// `entries[i]` and `leaves[j]` at `i * leaves.len() + j`): for a reader asking about
    /// thousands at once (`status`: each volume's target and staging path under its provider's
    /// `mounts/`). By default one read of the table and a set lookup each; an implementation that
    /// can tell whether a path is a mount root without the table (whose size grows with every
    /// mount on the node) answers each on its own.
    fn mount_points_beneath(
        &self,
        dir: &Path,
        entries: &[&str],
        leaves: &[&str],
    ) -> Result<Vec<bool>, MountError> {
        Ok(mount_points_in(self.mounts()?, dir, entries, leaves))
    }

    /// [`is_mount_root`](Self::is_mount_root), with the unique id of the mount rooted there where the
    /// implementation can tell it (statx `STATX_MNT_ID_UNIQUE`, Linux 6.8): the id fanotify mount
    /// events name ([`crate::mount::watch`]). The default knows no id.
    fn check_mount_root(&self, path: &Path) -> Result<RootCheck, MountError> {
        Ok(RootCheck {
            mounted: self.is_mount_root(path)?,
            unique_id: None,
        })
    }

    /// Whether anything is mounted beneath the mount rooted at `path` (its child mounts), when
    /// the implementation can tell without reading the table: `Some(false)` proves that nothing
    /// is (so a sweep beneath `path` has nothing to do). `None`: it cannot tell (`path` is not a
    /// mount root, the kernel cannot say, another process's table); the caller reads the table.
    /// The default cannot tell.
    fn has_child_mounts(&self, _path: &Path) -> Result<Option<bool>, MountError> {
        Ok(None)
    }

    /// The topmost mount at `path` (the last one in table order), if any.
    fn find(&self, path: &Path) -> Result<Option<MountInfo>, MountError> {
        Ok(self
            .mounts()?
            .into_iter()
            .rev()
            .find(|m| m.mount_point == path))
    }
}

/// [`MountTable::mount_points_beneath`] answered from `mounts`: one set, a lookup each.
fn mount_points_in(
    mounts: Vec<MountInfo>,
    dir: &Path,
    entries: &[&str],
    leaves: &[&str],
) -> Vec<bool> {
    let points: std::collections::HashSet<PathBuf> =
        mounts.into_iter().map(|m| m.mount_point).collect();
    entries
        .iter()
        .flat_map(|entry| leaves.iter().map(move |leaf| dir.join(entry).join(leaf)))
        .map(|path| points.contains(&path))
        .collect()
}

/// The real mount table of a process, read from `/proc/self/mountinfo` or `/proc/<pid>/mountinfo`.
#[derive(Clone, Debug, Default)]
pub struct ProcMountTable {
    pid: Option<u32>,
}

impl ProcMountTable {
    /// The calling process's table (`/proc/self/mountinfo`).
    pub fn new() -> Self {
        ProcMountTable { pid: None }
    }

    /// The table of process `pid` (`/proc/<pid>/mountinfo`), i.e. of its mount namespace.
    pub fn for_pid(pid: u32) -> Self {
        ProcMountTable { pid: Some(pid) }
    }

    /// The file this table reads.
    pub fn path(&self) -> PathBuf {
        match self.pid {
            Some(pid) => PathBuf::from(format!("/proc/{pid}/mountinfo")),
            None => PathBuf::from("/proc/self/mountinfo"),
        }
    }
}

impl MountTable for ProcMountTable {
    fn mounts(&self) -> Result<Vec<MountInfo>, MountError> {
        let path = self.path();
        let bytes =
            std::fs::read(&path).map_err(|source| MountError::ReadMountInfo { path, source })?;
        parse_mountinfo(bytes)
    }

    /// One `statx` (STATX_ATTR_MOUNT_ROOT) instead of parsing the table,
    /// whose cost grows with every mount on the node; falls back to the
    /// table where the kernel does not report the attribute.
    fn is_mount_root(&self, path: &Path) -> Result<bool, MountError> {
        if self.pid.is_some() {
            return self.is_mount_point(path);
        }
        match statx_mount_root(path) {
            Some(answer) => Ok(answer),
            None => self.is_mount_point(path),
        }
    }

    /// One statx per path (no sync with a remote file system, no automount), never the table:
    /// at 20,000 mounts the kernel takes longer to print the table than the statx take. `dir` is
    /// opened once and each `<entry>/<leaf>` asked relative to it (a walk of two components, the
    /// name built in one reused buffer: no path allocated per question). On the caller's thread
    /// (`status` spreads its volumes over a few, each asking for its own run). A `dir` that does
    /// not exist has nothing mounted beneath it. Falls back to the table, once per call, when
    /// `dir` cannot be opened for another reason, when an entry or leaf is not one component,
    /// when the kernel cannot say (before Linux 5.8), or for another process's table.
    fn mount_points_beneath(
        &self,
        dir: &Path,
        entries: &[&str],
        leaves: &[&str],
    ) -> Result<Vec<bool>, MountError> {
        let from_table = || Ok(mount_points_in(self.mounts()?, dir, entries, leaves));
        if entries.is_empty() || leaves.is_empty() {
            return Ok(Vec::new());
        }
        // One component each (not empty, no separator, no NUL): anything else would not
        // resolve beneath `dir` as the table's answer assumes.
        let one = |c: &&str| !c.is_empty() && !c.contains(['/', '\0']);
        if self.pid.is_some() || !entries.iter().all(one) || !leaves.iter().all(one) {
            return from_table();
        }
        let opened = match std::fs::File::open(dir) {
            Ok(opened) => opened,
            // Nothing beneath a directory that is not there: nothing mounted.
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ENOTDIR)) => {
                return Ok(vec![false; entries.len() * leaves.len()]);
            }
            Err(_) => return from_table(),
        };
        let mut name = Vec::with_capacity(128);
        let mut answers = Vec::with_capacity(entries.len() * leaves.len());
        for entry in entries {
            for leaf in leaves {
                name.clear();
                name.extend_from_slice(entry.as_bytes());
                name.push(b'/');
                name.extend_from_slice(leaf.as_bytes());
                name.push(0);
                let c_name = std::ffi::CStr::from_bytes_with_nul(&name)
                    .expect("components checked for NUL above");
                match statx_mount_root_nosync(&opened, c_name) {
                    Some(answer) => answers.push(answer),
                    None => return from_table(),
                }
            }
        }
        Ok(answers)
    }

    /// Two statx (the unique ids of the mount at `path` and of the one its parent directory is
    /// on), one `statmount` (the former's parent) and one `listmount` asking for one child id
    /// (Linux 6.8), not the table, which grows with every mount on the node: a volume's unpublish
    /// asks it, so a burst of launches would otherwise read the table once per container. Only
    /// for a mount attached directly on its directory: with another mount stacked on it, what is
    /// beneath the lower one is not the top one's children, and the table is read.
    fn has_child_mounts(&self, path: &Path) -> Result<Option<bool>, MountError> {
        if self.pid.is_some() {
            return Ok(None);
        }
        Ok(unstacked_mount_id(path).and_then(has_child_mount_ids))
    }

    /// The same one statx, also asking for the mount's unique id.
    fn check_mount_root(&self, path: &Path) -> Result<RootCheck, MountError> {
        let fallback = || {
            Ok(RootCheck {
                mounted: self.is_mount_point(path)?,
                unique_id: None,
            })
        };
        if self.pid.is_some() {
            return fallback();
        }
        match statx_root_check(path) {
            Some(check) => Ok(check),
            None => fallback(),
        }
    }
}

/// What [`MountTable::check_mount_root`] found at a path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RootCheck {
    /// Whether a mount is rooted there.
    pub mounted: bool,
    /// That mount's unique id (`None`: not mounted, or the implementation cannot tell).
    pub unique_id: Option<u64>,
}

/// [`RootCheck`] from one statx asking for the unique mount id, `None` when the kernel cannot say
/// whether the path is a mount root.
fn statx_root_check(path: &Path) -> Option<RootCheck> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    match statx_mask(
        libc::AT_FDCWD,
        &c_path,
        0,
        libc::STATX_BASIC_STATS | STATX_MNT_ID_UNIQUE,
    ) {
        Ok(st) => {
            let mounted = mount_root_attr(&st)?;
            let unique = st.stx_mask & STATX_MNT_ID_UNIQUE != 0;
            Some(RootCheck {
                mounted,
                unique_id: (mounted && unique).then_some(st.stx_mnt_id),
            })
        }
        Err(Errno::ENOENT | Errno::ENOTDIR) => Some(RootCheck {
            mounted: false,
            unique_id: None,
        }),
        Err(_) => None,
    }
}

/// `struct mnt_id_req` of `listmount(2)` (include/uapi/linux/mount.h), its first version.
#[repr(C)]
struct MntIdReq {
    size: u32,
    spare: u32,
    mnt_id: u64,
    param: u64,
}

impl MntIdReq {
    /// A request about the mount with unique id `mnt_id` (`param`: statmount's mask; listmount's
    /// last id answered, 0 to start).
    fn new(mnt_id: u64, param: u64) -> MntIdReq {
        MntIdReq {
            size: std::mem::size_of::<MntIdReq>() as u32,
            spare: 0,
            mnt_id,
            param,
        }
    }

    /// `statmount` or `listmount` (`call`) of this request into `out`, whose length the call is
    /// told in bytes (statmount's `bufsize`) or, `in_ids`, in ids (listmount's `nr_mnt_ids`):
    /// either way taken from `out` itself. The syscall's answer (-1: see errno).
    fn ask(&self, call: libc::c_long, out: &mut [u64], in_ids: bool) -> libc::c_long {
        let len = if in_ids {
            out.len()
        } else {
            std::mem::size_of_val(out)
        };
        // SAFETY: statmount(const struct mnt_id_req *req, struct statmount *buf, size_t bufsize,
        // unsigned int flags) and listmount(const struct mnt_id_req *req, u64 *mnt_ids, size_t
        // nr_mnt_ids, unsigned int flags): `self` is a live, initialised request of the size it
        // states; `out` is a writable, 8-byte aligned buffer whose length is given in the unit
        // the call counts in.
        unsafe { libc::syscall(call, self as *const MntIdReq, out.as_mut_ptr(), len, 0u32) }
    }
}

/// `listmount`'s number: the same on every architecture of the unified syscall table (Linux 6.8).
const SYS_LISTMOUNT: libc::c_long = 458;
/// `statmount`'s number, as above.
const SYS_STATMOUNT: libc::c_long = 457;
/// `STATMOUNT_MNT_BASIC`: the mount's ids and its parent's.
const STATMOUNT_MNT_BASIC: u64 = 0x2;
/// `STATX_MNT_ID_UNIQUE` (include/uapi/linux/stat.h, Linux 6.8).
const STATX_MNT_ID_UNIQUE: u32 = 0x4000;

/// The unique id of the mount at `path` (no symlink followed, no sync with a remote server), or
/// of the mount `path` lies on when `root` is false; `None` when `root` is asked and `path` is
/// not a mount root, or when the kernel cannot say.
fn statx_unique_id(path: &Path, root: bool) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    let st = statx_mask(
        libc::AT_FDCWD,
        &c_path,
        libc::AT_SYMLINK_NOFOLLOW | libc::AT_STATX_DONT_SYNC,
        STATX_MNT_ID_UNIQUE,
    )
    .ok()?;
    if st.stx_mask & STATX_MNT_ID_UNIQUE == 0 || (root && mount_root_attr(&st) != Some(true)) {
        return None;
    }
    Some(st.stx_mnt_id)
}

/// The parent's unique id of the mount with unique id `unique_id` (`statmount`, Linux 6.8).
fn parent_mount_id(unique_id: u64) -> Option<u64> {
    let req = MntIdReq::new(unique_id, STATMOUNT_MNT_BASIC);
    // struct statmount: size (u32), spare (u32), mask (u64), sb_dev_major, sb_dev_minor (u32),
    // sb_magic (u64), sb_flags, fs_type (u32), mnt_id (u64, word 5), mnt_parent_id (u64, word
    // 6), ...; room for all of it and its strings.
    let mut buf = [0u64; 128];
    let rc = req.ask(SYS_STATMOUNT, &mut buf, false);
    let asked = buf[1] & STATMOUNT_MNT_BASIC != 0;
    (rc == 0 && asked && buf[5] == unique_id).then_some(buf[6])
}

/// The unique id of the mount rooted at `path` when it is attached directly on that directory:
/// its parent is the mount `path`'s parent directory lies on. `None` when `path` is not a mount
/// root, when another mount is stacked on the one attached there (the top one's parent is then
/// the lower one), or when the kernel cannot say.
fn unstacked_mount_id(path: &Path) -> Option<u64> {
    let top = statx_unique_id(path, true)?;
    let on = statx_unique_id(path.parent()?, false)?;
    (parent_mount_id(top)? == on).then_some(top)
}

/// Whether the mount with unique id `unique_id` has a child mount in this thread's mount
/// namespace: `listmount` asked for at most one child id. `None` when the kernel cannot say
/// (before Linux 6.8: ENOSYS; the mount gone meanwhile: ENOENT).
fn has_child_mount_ids(unique_id: u64) -> Option<bool> {
    let req = MntIdReq::new(unique_id, 0);
    let mut ids = [0u64; 1];
    let n = req.ask(SYS_LISTMOUNT, &mut ids, true);
    (n >= 0).then_some(n > 0)
}

/// `Some(is a mount root)` from statx, `None` when the kernel cannot say.
fn statx_mount_root(path: &Path) -> Option<bool> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    match statx_nofollow(libc::AT_FDCWD, &c_path) {
        Ok(st) => mount_root_attr(&st),
        Err(Errno::ENOENT | Errno::ENOTDIR) => Some(false),
        Err(_) => None,
    }
}

/// [`statx_mount_root`] of `name`, relative to `dir`, for a reader that must not block on a file
/// system: no attributes asked, none synced with a remote server (`AT_STATX_DONT_SYNC`).
/// `Some(false)` when there is no such entry.
fn statx_mount_root_nosync(dir: &std::fs::File, name: &std::ffi::CStr) -> Option<bool> {
    use std::os::fd::AsRawFd;
    match statx_mask(dir.as_raw_fd(), name, libc::AT_STATX_DONT_SYNC, 0) {
        Ok(st) => mount_root_attr(&st),
        Err(Errno::ENOENT | Errno::ENOTDIR) => Some(false),
        Err(_) => None,
    }
}

/// What [`entry_identity`] finds at an entry: its device and inode, and whether it is the root of a mount
/// (`None` when the kernel cannot say: before Linux 5.8).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EntryIdentity {
    /// st_dev
    pub dev: u64,
    /// st_ino
    pub ino: u64,
    /// STATX_ATTR_MOUNT_ROOT, where reported.
    pub mount_root: Option<bool>,
}

/// statx of the entry `name` of the directory `dir`, not following a symlink: who it is (device, inode)
/// and whether a mount is rooted there. `Ok(None)` when there is no such entry.
pub fn entry_identity(
    dir: std::os::fd::BorrowedFd<'_>,
    name: &std::ffi::OsStr,
) -> Result<Option<EntryIdentity>, Errno> {
    use std::os::fd::AsRawFd;
    use std::os::unix::ffi::OsStrExt;
    let c_name = std::ffi::CString::new(name.as_bytes()).map_err(|_| Errno::EINVAL)?;
    match statx_nofollow(dir.as_raw_fd(), &c_name) {
        Ok(st) => Ok(Some(EntryIdentity {
            dev: libc::makedev(st.stx_dev_major, st.stx_dev_minor),
            ino: st.stx_ino,
            mount_root: mount_root_attr(&st),
        })),
        Err(Errno::ENOENT) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Whether the object `fd` holds (an O_PATH fd, a symlink included) is the root of a mount, from one statx
/// on the fd itself; `Ok(None)` when the kernel cannot say (before Linux 5.8).
pub(crate) fn fd_mount_root(fd: std::os::fd::BorrowedFd<'_>) -> Result<Option<bool>, Errno> {
    use std::os::fd::AsRawFd;
    statx_flags(fd.as_raw_fd(), c"", libc::AT_EMPTY_PATH).map(|st| mount_root_attr(&st))
}

fn mount_root_attr(st: &libc::statx) -> Option<bool> {
    const STATX_ATTR_MOUNT_ROOT: u64 = 0x2000; // include/uapi/linux/stat.h
    (st.stx_attributes_mask & STATX_ATTR_MOUNT_ROOT != 0)
        .then_some(st.stx_attributes & STATX_ATTR_MOUNT_ROOT != 0)
}

fn statx_nofollow(dirfd: libc::c_int, name: &std::ffi::CStr) -> Result<libc::statx, Errno> {
    statx_flags(dirfd, name, 0)
}

/// statx without following a symlink or triggering an automount, plus `extra` flags (AT_EMPTY_PATH).
fn statx_flags(
    dirfd: libc::c_int,
    name: &std::ffi::CStr,
    extra: libc::c_int,
) -> Result<libc::statx, Errno> {
    statx_mask(dirfd, name, extra, libc::STATX_BASIC_STATS)
}

/// [`statx_flags`] asking for the fields in `mask`.
fn statx_mask(
    dirfd: libc::c_int,
    name: &std::ffi::CStr,
    extra: libc::c_int,
    mask: libc::c_uint,
) -> Result<libc::statx, Errno> {
    let mut buf = std::mem::MaybeUninit::<libc::statx>::zeroed();
    // SAFETY: `name` is a valid NUL-terminated string, `dirfd` is AT_FDCWD or an fd the caller keeps open
    // for the call, and buf points to a writable statx struct that outlives the call.
    let rc = unsafe {
        libc::statx(
            dirfd,
            name.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW | libc::AT_NO_AUTOMOUNT | extra,
            mask,
            buf.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return Err(Errno::last());
    }
    // SAFETY: statx returned 0, so it filled the struct.
    Ok(unsafe { buf.assume_init() })
}

#[cfg(test)]
mod statx_tests {
    use super::*;

    #[test]
    fn statx_agrees_with_the_table() {
        let t = ProcMountTable::new();
        for p in ["/", "/proc", "/proc/self", "/nonexistent/x"] {
            let p = Path::new(p);
            assert_eq!(
                t.is_mount_root(p).unwrap(),
                t.is_mount_point(p).unwrap(),
                "{}",
                p.display()
            );
        }
    }
}

/// Parses the contents of a mountinfo file (bytes: paths need not be UTF-8). Empty lines are skipped; any
/// malformed line fails the whole parse with [`MountError::ParseMountInfo`] naming that line.
pub fn parse_mountinfo(text: impl AsRef<[u8]>) -> Result<Vec<MountInfo>, MountError> {
    text.as_ref()
        .split(|b| *b == b'\n')
        .filter(|l| !l.trim_ascii().is_empty())
        .map(parse_line)
        .collect()
}

fn parse_line(line: &[u8]) -> Result<MountInfo, MountError> {
    let bad = |reason: String| MountError::ParseMountInfo {
        line: String::from_utf8_lossy(line).into_owned(),
        reason,
    };
    let fields: Vec<&[u8]> = line.split(|b| *b == b' ').collect();
    if fields.iter().any(|f| f.is_empty()) {
        return Err(bad("empty field (doubled or trailing space)".into()));
    }
    // Numbers, options and types are ASCII; only root, mount point and source are kept as bytes.
    let text = |f: &[u8]| String::from_utf8_lossy(f).into_owned();
    let sep = fields
        .iter()
        .position(|f| *f == b"-")
        .ok_or_else(|| bad("no \"-\" separator".into()))?;
    if sep < 6 {
        return Err(bad(format!(
            "{sep} fields before the separator, need at least 6"
        )));
    }
    if fields.len() - sep - 1 != 3 {
        return Err(bad(format!(
            "{} fields after the separator, need 3",
            fields.len() - sep - 1
        )));
    }
    let number = |name: &str, s: &[u8]| -> Result<u32, MountError> {
        let s = text(s);
        s.parse::<u32>()
            .map_err(|e| bad(format!("{name} {s:?}: {e}")))
    };
    let mount_id = number("mount id", fields[0])?;
    let parent_id = number("parent id", fields[1])?;
    let device = text(fields[2]);
    let (major, minor) = device
        .split_once(':')
        .ok_or_else(|| bad(format!("device {device:?} is not major:minor")))?;
    let major = number("major", major.as_bytes())?;
    let minor = number("minor", minor.as_bytes())?;
    let path = |f: &[u8]| unescape(f).map(|b| PathBuf::from(OsString::from_vec(b)));
    let root = path(fields[3]).map_err(|r| bad(format!("root: {r}")))?;
    let mount_point = path(fields[4]).map_err(|r| bad(format!("mount point: {r}")))?;
    let source = unescape(fields[sep + 2]).map_err(|r| bad(format!("source: {r}")))?;
    let list = |s: &[u8]| text(s).split(',').map(str::to_string).collect::<Vec<_>>();
    Ok(MountInfo {
        mount_id,
        parent_id,
        major,
        minor,
        root,
        mount_point,
        mount_options: list(fields[5]),
        optional_fields: fields[6..sep].iter().map(|s| text(s)).collect(),
        fs_type: text(fields[sep + 1]),
        // Sources are device paths or names; a non-UTF-8 one is kept visible, lossily.
        source: String::from_utf8_lossy(&source).into_owned(),
        super_options: list(fields[sep + 3]),
    })
}

/// Undoes the kernel's `\ooo` octal escapes (show_mountinfo uses them for " \t\n\\"), giving the raw
/// bytes.
fn unescape(bytes: &[u8]) -> Result<Vec<u8>, String> {
    let s = || String::from_utf8_lossy(bytes);
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' {
            let digits = bytes
                .get(i + 1..i + 4)
                .filter(|d| d.iter().all(|b| (b'0'..=b'7').contains(b)))
                .ok_or_else(|| format!("bad escape at byte {i} of {:?}", s()))?;
            let value = digits
                .iter()
                .fold(0u32, |acc, d| acc * 8 + u32::from(d - b'0'));
            let byte =
                u8::try_from(value).map_err(|_| format!("escape out of range in {:?}", s()))?;
            out.push(byte);
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::ffi::OsStrExt;

    #[test]
    fn the_default_answers_entry_by_entry_from_the_table() {
        let mounts = parse_mountinfo(
            b"40 1 8:1 / /w/mounts/b/staging rw - ext4 /dev/vda rw\n\
              41 1 8:1 / /w/mounts/a/target rw - ext4 /dev/vda rw\n",
        )
        .unwrap();
        let answers = mount_points_in(
            mounts,
            Path::new("/w/mounts"),
            &["a", "b", "c"],
            &["target", "staging"],
        );
        assert_eq!(answers, [true, false, false, true, false, false]);
    }

    #[test]
    fn parses_table() {
        struct Case {
            line: &'static [u8],
            mount_point: &'static [u8],
            root: &'static [u8],
            source: &'static str,
            optional: &'static [&'static str],
            readonly: bool,
        }
        let cases = [
            Case {
                line: b"36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue",
                mount_point: b"/mnt2",
                root: b"/mnt1",
                source: "/dev/root",
                optional: &["master:1"],
                readonly: false,
            },
            Case {
                line: b"22 1 0:21 / /proc rw,nosuid,nodev,noexec,relatime shared:12 - proc proc rw",
                mount_point: b"/proc",
                root: b"/",
                source: "proc",
                optional: &["shared:12"],
                readonly: false,
            },
            Case {
                line: b"99 22 8:1 /a\\040b /mnt/with\\040space\\011tab\\012nl\\134bs ro,relatime - ext4 /dev/sd\\040a ro",
                mount_point: b"/mnt/with space\ttab\nnl\\bs",
                root: b"/a b",
                source: "/dev/sd a",
                optional: &[],
                readonly: true,
            },
            Case {
                line: b"100 99 0:50 / /x ro shared:3 master:2 propagate_from:1 unbindable - tmpfs tmpfs rw,size=10k",
                mount_point: b"/x",
                root: b"/",
                source: "tmpfs",
                optional: &["shared:3", "master:2", "propagate_from:1", "unbindable"],
                readonly: true,
            },
            // The kernel writes bytes other than " \t\n\\" as they are: not UTF-8 here.
            Case {
                line: b"101 22 8:1 /d\xff\xfe /mnt/caf\xe9\\040x rw - ext4 /dev/sda1 rw",
                mount_point: b"/mnt/caf\xe9 x",
                root: b"/d\xff\xfe",
                source: "/dev/sda1",
                optional: &[],
                readonly: false,
            },
        ];
        for c in &cases {
            let shown = String::from_utf8_lossy(c.line);
            let parsed = parse_mountinfo(c.line).unwrap_or_else(|e| panic!("{shown}: {e}"));
            assert_eq!(parsed.len(), 1);
            let m = &parsed[0];
            assert_eq!(
                m.mount_point.as_os_str().as_bytes(),
                c.mount_point,
                "{shown}"
            );
            assert_eq!(m.root.as_os_str().as_bytes(), c.root, "{shown}");
            assert_eq!(m.source, c.source, "{shown}");
            assert_eq!(m.optional_fields, c.optional, "{shown}");
            assert_eq!(m.is_readonly(), c.readonly, "{shown}");
        }
    }

    #[test]
    fn a_non_utf8_line_does_not_break_the_rest_of_the_table() {
        let mut table = b"22 1 0:21 / /proc rw - proc proc rw\n".to_vec();
        table.extend_from_slice(b"23 1 8:1 / /mnt/\xff rw - ext4 /dev/sda1 rw\n");
        table.extend_from_slice(b"24 1 0:22 / /sys rw - sysfs sysfs rw\n");
        let parsed = parse_mountinfo(&table).unwrap();
        let points: Vec<&[u8]> = parsed
            .iter()
            .map(|m| m.mount_point.as_os_str().as_bytes())
            .collect();
        assert_eq!(points, [&b"/proc"[..], b"/mnt/\xff", b"/sys"]);
    }

    #[test]
    fn parses_all_fields() {
        let m = &parse_mountinfo(
            "36 35 98:7 /mnt1 /mnt2 rw,noatime shared:4 master:1 - ext3 /dev/root rw,errors=continue\n",
        )
        .unwrap()[0];
        assert_eq!(
            *m,
            MountInfo {
                mount_id: 36,
                parent_id: 35,
                major: 98,
                minor: 7,
                root: "/mnt1".into(),
                mount_point: "/mnt2".into(),
                mount_options: vec!["rw".into(), "noatime".into()],
                optional_fields: vec!["shared:4".into(), "master:1".into()],
                fs_type: "ext3".into(),
                source: "/dev/root".into(),
                super_options: vec!["rw".into(), "errors=continue".into()],
            }
        );
        assert_eq!(m.shared_peer_group(), Some(4));
        assert_eq!(m.master_peer_group(), Some(1));
        assert!(!m.is_unbindable());
    }

    #[test]
    fn rejects_malformed_lines() {
        let good = "22 1 0:21 / /proc rw - proc proc rw";
        let cases: &[(&str, &str)] = &[
            ("22 1 0:21 / /proc rw proc proc rw", "separator"),
            ("x 1 0:21 / /proc rw - proc proc rw", "mount id"),
            ("22 y 0:21 / /proc rw - proc proc rw", "parent id"),
            ("22 1 021 / /proc rw - proc proc rw", "major:minor"),
            ("22 1 0:z / /proc rw - proc proc rw", "minor"),
            ("22 1 0:21 / rw - proc proc rw", "before the separator"),
            ("22 1 0:21 / /proc rw - proc proc", "after the separator"),
            (
                "22 1 0:21 / /proc rw - proc proc rw extra",
                "after the separator",
            ),
            ("22 1 0:21 / /pr\\04 rw - proc proc rw", "mount point"),
            ("22 1 0:21 /\\999 /proc rw - proc proc rw", "root"),
            ("22 1 0:21 / /proc rw - proc proc\\400 rw", "source"),
            ("22 1 0:21 /  /proc rw - proc proc rw", "empty field"),
        ];
        for (line, reason) in cases {
            let text = format!("{good}\n{line}\n{good}\n");
            match parse_mountinfo(&text) {
                Err(MountError::ParseMountInfo { line: l, reason: r }) => {
                    assert_eq!(l, *line);
                    assert!(r.contains(reason), "{line}: reason {r:?} lacks {reason:?}");
                    let msg = MountError::ParseMountInfo { line: l, reason: r }.to_string();
                    assert!(msg.contains(&format!("{line:?}")), "{msg}");
                }
                other => panic!("{line}: expected ParseMountInfo, got {other:?}"),
            }
        }
    }

    #[test]
    fn skips_blank_lines_and_reads_real_table() {
        assert!(parse_mountinfo("\n\n").unwrap().is_empty());
        let real = ProcMountTable::new().mounts().unwrap();
        assert!(real.iter().any(|m| m.mount_point == Path::new("/")));
        assert!(ProcMountTable::new()
            .is_mount_point(Path::new("/"))
            .unwrap());
        let pid = std::process::id();
        let by_pid = ProcMountTable::for_pid(pid).mounts().unwrap();
        assert_eq!(by_pid.len(), real.len());
    }
}
