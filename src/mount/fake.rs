//! [`FakeSyscall`]: a recording double of the [`Syscall`] seam for unit tests.
//!
//! It records every call as a typed [`Call`] (read back with [`FakeSyscall::calls`]), simulates a mount table
//! (it also implements [`MountTable`]) with the kernel's rules that matter to callers, and can be told to fail
//! chosen calls with an errno a number of times:
//! - a bind or filesystem mount pushes an entry at the target (a recursive bind also copies the mounts below
//!   the source); a read-only remount flips the topmost entry's `rw` to `ro`;
//! - unmount removes the topmost entry at the path; no entry gives `NotMounted`; a non-lazy unmount of a
//!   mount with mounts below it is EBUSY, a lazy one takes them along;
//! - open_tree hands out a real fd (an O_PATH fd of `/`) standing for a detached tree, which move_mount
//!   attaches at the path the target fd resolves to (read from /proc/self/fd); `open_tree_clone_fd` clones
//!   the path its source fd resolves to;
//! - a bind (or clone) keeps the nosuid, nodev and noexec options of the mount holding its source, as the
//!   kernel does; flag changes on a detached tree apply when it is attached; `harden_mount_root` only
//!   changes a path that has an entry of its own (a mount root).
//!
//! No kernel state is touched: the paths need not exist.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use nix::errno::Errno;
use nix::fcntl::{open, OFlag};
use nix::sys::stat::Mode;

use super::{Call, CallKind, MountError, MountFlags, MountInfo, MountTable, Propagation, Syscall};

/// The raw number of a borrowed fd, for records and messages.
fn raw(fd: BorrowedFd<'_>) -> RawFd {
    fd.as_raw_fd()
}

type Matcher = Box<dyn Fn(&Call) -> bool + Send + Sync>;

struct FailRule {
    matcher: Matcher,
    errno: Errno,
    remaining: u32,
}

/// A detached tree handed out by `open_tree_clone`.
#[derive(Clone, Debug)]
struct Tree {
    source: PathBuf,
    recursive: bool,
    readonly: bool,
    set: MountFlags,
    clear: MountFlags,
}

impl Tree {
    fn new(source: PathBuf, recursive: bool) -> Tree {
        Tree {
            source,
            recursive,
            readonly: false,
            set: MountFlags::NONE,
            clear: MountFlags::NONE,
        }
    }
}

#[derive(Default)]
struct State {
    calls: Vec<Call>,
    table: Vec<MountInfo>,
    next_id: u32,
    next_group: u32,
    rules: Vec<FailRule>,
    trees: HashMap<RawFd, Tree>,
    /// Where each detached tree was attached (its fd then names that mount's root).
    attached: HashMap<RawFd, PathBuf>,
}

/// A recording double: see the module doc.
#[derive(Default)]
pub struct FakeSyscall {
    state: Mutex<State>,
}

impl std::fmt::Debug for FakeSyscall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.lock();
        f.debug_struct("FakeSyscall")
            .field("calls", &s.calls)
            .field("table", &s.table)
            .field("pending_failures", &s.rules.len())
            .finish()
    }
}

impl FakeSyscall {
    /// An empty fake: no calls, no mounts.
    pub fn new() -> Self {
        FakeSyscall::default()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panicking test thread must not hide the recorded calls from the others.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Every call so far, in order (failed ones included).
    pub fn calls(&self) -> Vec<Call> {
        self.lock().calls.clone()
    }

    /// Forgets the recorded calls (the mount table stays).
    pub fn clear_calls(&self) {
        self.lock().calls.clear();
    }

    /// Fails the next `times` calls of `kind` with `errno` (any path).
    pub fn fail(&self, kind: CallKind, errno: Errno, times: u32) {
        self.fail_when(move |c| c.kind() == kind, errno, times);
    }

    /// Fails the next `times` calls of `kind` on `target` (see [`Call::target`]) with `errno`.
    pub fn fail_at(&self, kind: CallKind, target: &Path, errno: Errno, times: u32) {
        let target = target.to_path_buf();
        self.fail_when(
            move |c| c.kind() == kind && c.target() == Some(target.as_path()),
            errno,
            times,
        );
    }

    /// Fails the next `times` non-lazy unmounts of `target` with EBUSY, as a kernel does while the mount is in
    /// use (lazy detaches still succeed, as they do in the kernel).
    pub fn busy(&self, target: &Path, times: u32) {
        let target = target.to_path_buf();
        self.fail_when(
            move |c| matches!(c, Call::Unmount { target: t, detach: false } if *t == target),
            Errno::EBUSY,
            times,
        );
    }

    /// Fails the next `times` calls for which `matcher` returns true with `errno`. Rules are checked in the
    /// order they were added; the first matching one with failures left is used.
    pub fn fail_when(
        &self,
        matcher: impl Fn(&Call) -> bool + Send + Sync + 'static,
        errno: Errno,
        times: u32,
    ) {
        self.lock().rules.push(FailRule {
            matcher: Box::new(matcher),
            errno,
            remaining: times,
        });
    }

    /// Puts a mount into the table directly (as if it had been there before the test), returning its id.
    pub fn add_mount(&self, source: &str, mount_point: &Path, fs_type: &str) -> u32 {
        let mut s = self.lock();
        let info = s.entry(PathBuf::from("/"), mount_point, fs_type, source, false);
        let id = info.mount_id;
        s.table.push(info);
        id
    }

    /// Records `call`, then returns the injected errno if a rule matches it.
    fn record(&self, s: &mut State, call: Call) -> Option<Errno> {
        let hit = s
            .rules
            .iter_mut()
            .find(|r| r.remaining > 0 && (r.matcher)(&call))
            .map(|r| {
                r.remaining -= 1;
                r.errno
            });
        s.rules.retain(|r| r.remaining > 0);
        s.calls.push(call);
        hit
    }
}

impl State {
    fn entry(
        &mut self,
        root: PathBuf,
        mount_point: &Path,
        fs_type: &str,
        source: &str,
        readonly: bool,
    ) -> MountInfo {
        self.next_id += 1;
        let parent_id = self
            .table
            .iter()
            .rev()
            .filter(|m| mount_point.starts_with(&m.mount_point))
            .max_by_key(|m| m.mount_point.components().count())
            .map_or(1, |m| m.mount_id);
        MountInfo {
            mount_id: 100 + self.next_id,
            parent_id,
            major: 0,
            minor: 0,
            root,
            mount_point: mount_point.to_path_buf(),
            mount_options: vec![if readonly { "ro" } else { "rw" }.to_string()],
            optional_fields: Vec::new(),
            fs_type: fs_type.to_string(),
            source: source.to_string(),
            super_options: vec!["rw".to_string()],
        }
    }

    fn topmost(&mut self, path: &Path) -> Option<&mut MountInfo> {
        self.table.iter_mut().rev().find(|m| m.mount_point == path)
    }

    /// The mounts that lie strictly below `path` (what MS_REC / AT_RECURSIVE take along).
    fn below(&self, path: &Path) -> Vec<MountInfo> {
        self.table
            .iter()
            .filter(|m| m.mount_point != path && m.mount_point.starts_with(path))
            .cloned()
            .collect()
    }

    fn bind(&mut self, source: &Path, target: &Path, recursive: bool, readonly: bool) {
        // The bound tree keeps the file system of the mount that holds the source.
        let (fs_type, dev, kept) = self
            .table
            .iter()
            .rev()
            .filter(|m| source.starts_with(&m.mount_point))
            .max_by_key(|m| m.mount_point.components().count())
            .map_or(
                ("none".to_string(), source.display().to_string(), Vec::new()),
                |m| {
                    let kept = m
                        .mount_options
                        .iter()
                        .filter(|o| PER_MOUNT.contains(&o.as_str()))
                        .cloned()
                        .collect();
                    (m.fs_type.clone(), m.source.clone(), kept)
                },
            );
        let below = if recursive {
            self.below(source)
        } else {
            Vec::new()
        };
        let mut info = self.entry(source.to_path_buf(), target, &fs_type, &dev, readonly);
        info.mount_options.extend(kept);
        self.table.push(info);
        for m in below {
            let rel = m.mount_point.strip_prefix(source).unwrap_or(Path::new(""));
            let at = target.join(rel);
            let mut copy = self.entry(m.root.clone(), &at, &m.fs_type, &m.source, readonly);
            copy.mount_options = m.mount_options.clone();
            if readonly {
                set_ro(&mut copy);
            }
            self.table.push(copy);
        }
    }
}

/// The per-mount options a bind keeps from the mount holding its source.
const PER_MOUNT: [&str; 3] = ["nosuid", "nodev", "noexec"];

/// Applies `set` then `clear` to an entry's per-mount options.
fn apply_flags(m: &mut MountInfo, set: MountFlags, clear: MountFlags) {
    if set.readonly {
        set_ro(m);
    }
    if clear.readonly {
        m.mount_options.retain(|o| o != "rw" && o != "ro");
        m.mount_options.insert(0, "rw".to_string());
    }
    for (on, off, name) in [
        (set.nosuid, clear.nosuid, "nosuid"),
        (set.nodev, clear.nodev, "nodev"),
        (set.noexec, clear.noexec, "noexec"),
    ] {
        if on && !m.mount_options.iter().any(|o| o == name) {
            m.mount_options.push(name.to_string());
        }
        if off {
            m.mount_options.retain(|o| o != name);
        }
    }
}

fn set_ro(m: &mut MountInfo) {
    m.mount_options.retain(|o| o != "rw" && o != "ro");
    m.mount_options.insert(0, "ro".to_string());
}

fn set_propagation_fields(m: &mut MountInfo, propagation: Propagation, group: u32) {
    let shared = m.shared_peer_group();
    m.optional_fields.clear();
    match propagation {
        Propagation::Private => {}
        Propagation::Shared => m
            .optional_fields
            .push(format!("shared:{}", shared.unwrap_or(group))),
        // A shared mount turned slave keeps its old peer group as master.
        Propagation::Slave => {
            if let Some(g) = shared {
                m.optional_fields.push(format!("master:{g}"));
            }
        }
        Propagation::Unbindable => m.optional_fields.push("unbindable".to_string()),
    }
}

/// A real, harmless fd (an `O_PATH` fd of `/`) standing for a detached tree of `source`, so callers
/// can borrow and close it as usual; the fake remembers what it stands for.
fn detached_tree(s: &mut State, source: &Path, recursive: bool) -> Result<OwnedFd, Errno> {
    let fd = open("/", OFlag::O_PATH | OFlag::O_CLOEXEC, Mode::empty())?;
    s.trees
        .insert(fd.as_raw_fd(), Tree::new(source.to_path_buf(), recursive));
    Ok(fd)
}

impl Syscall for FakeSyscall {
    fn bind_mount(&self, source: &Path, target: &Path, recursive: bool) -> Result<(), MountError> {
        let mut s = self.lock();
        let call = Call::BindMount {
            source: source.to_path_buf(),
            target: target.to_path_buf(),
            recursive,
        };
        let err = |errno| MountError::Bind {
            source_path: source.to_path_buf(),
            target: target.to_path_buf(),
            errno,
        };
        if let Some(errno) = self.record(&mut s, call) {
            return Err(err(errno));
        }
        s.bind(source, target, recursive, false);
        Ok(())
    }

    fn remount_bind_readonly(&self, target: &Path) -> Result<(), MountError> {
        let mut s = self.lock();
        let call = Call::RemountBindReadonly {
            target: target.to_path_buf(),
        };
        let err = |errno| MountError::RemountReadonly {
            target: target.to_path_buf(),
            errno,
        };
        if let Some(errno) = self.record(&mut s, call) {
            return Err(err(errno));
        }
        let m = s.topmost(target).ok_or_else(|| err(Errno::EINVAL))?;
        set_ro(m);
        Ok(())
    }

    fn mount_filesystem(
        &self,
        device: &Path,
        target: &Path,
        fstype: &str,
        flags: MountFlags,
        data: &str,
    ) -> Result<(), MountError> {
        let mut s = self.lock();
        let call = Call::MountFilesystem {
            device: device.to_path_buf(),
            target: target.to_path_buf(),
            fstype: fstype.to_string(),
            flags,
            data: data.to_string(),
        };
        if let Some(errno) = self.record(&mut s, call) {
            return Err(MountError::MountFilesystem {
                device: device.to_path_buf(),
                target: target.to_path_buf(),
                fstype: fstype.to_string(),
                errno,
            });
        }
        let mut info = s.entry(
            PathBuf::from("/"),
            target,
            fstype,
            &device.display().to_string(),
            flags.readonly,
        );
        for (on, name) in [
            (flags.nosuid, "nosuid"),
            (flags.nodev, "nodev"),
            (flags.noexec, "noexec"),
        ] {
            if on {
                info.mount_options.push(name.to_string());
            }
        }
        if !data.is_empty() {
            info.super_options
                .extend(data.split(',').map(str::to_string));
        }
        s.table.push(info);
        Ok(())
    }

    fn set_propagation(
        &self,
        target: &Path,
        propagation: Propagation,
        recursive: bool,
    ) -> Result<(), MountError> {
        let mut s = self.lock();
        let call = Call::SetPropagation {
            target: target.to_path_buf(),
            propagation,
            recursive,
        };
        let err = |errno| MountError::Propagation {
            target: target.to_path_buf(),
            propagation: propagation.as_str(),
            errno,
        };
        if let Some(errno) = self.record(&mut s, call) {
            return Err(err(errno));
        }
        // A /proc/self/fd path names what its fd holds: an attached tree's mount, or the fd's path.
        let resolved;
        let target = match target
            .strip_prefix("/proc/self/fd")
            .ok()
            .and_then(|n| n.to_str()?.parse::<RawFd>().ok())
        {
            Some(fd) => {
                resolved = match s.attached.get(&fd) {
                    Some(at) => at.clone(),
                    None => std::fs::read_link(target).unwrap_or_else(|_| target.to_path_buf()),
                };
                resolved.as_path()
            }
            None => target,
        };
        if s.topmost(target).is_none() {
            return Err(err(Errno::EINVAL));
        }
        s.next_group += 1;
        let group = s.next_group;
        let top_id = s.topmost(target).map(|m| m.mount_id);
        for m in s.table.iter_mut() {
            let hit = if recursive {
                m.mount_point.starts_with(target)
            } else {
                Some(m.mount_id) == top_id
            };
            if hit {
                set_propagation_fields(m, propagation, group);
            }
        }
        Ok(())
    }

    /// Recorded as [`Call::Unmount`] of the directory's path joined with `name`.
    fn unmount_at(
        &self,
        dir: BorrowedFd<'_>,
        name: &std::ffi::OsStr,
        detach: bool,
    ) -> Result<(), MountError> {
        let target = super::fd::fd_path(dir)?.join(name);
        self.unmount(&target, detach)
    }

    /// Recorded as [`Call::Unmount`] (the fake has no symlinks).
    fn unmount_no_symlinks(&self, target: &Path, detach: bool) -> Result<(), MountError> {
        self.unmount(target, detach)
    }

    fn unmount(&self, target: &Path, detach: bool) -> Result<(), MountError> {
        let mut s = self.lock();
        let call = Call::Unmount {
            target: target.to_path_buf(),
            detach,
        };
        if let Some(errno) = self.record(&mut s, call) {
            return Err(match errno {
                Errno::EINVAL => MountError::NotMounted {
                    target: target.to_path_buf(),
                },
                errno => MountError::Unmount {
                    target: target.to_path_buf(),
                    errno,
                },
            });
        }
        let Some(index) = s.table.iter().rposition(|m| m.mount_point == target) else {
            return Err(MountError::NotMounted {
                target: target.to_path_buf(),
            });
        };
        let id = s.table[index].mount_id;
        // Mounts stacked later below this one are its children.
        let has_children = s.table[index + 1..]
            .iter()
            .any(|m| m.mount_point != target && m.mount_point.starts_with(target));
        if has_children && !detach {
            return Err(MountError::Unmount {
                target: target.to_path_buf(),
                errno: Errno::EBUSY,
            });
        }
        let mut position = 0;
        s.table.retain(|m| {
            let keep = position < index
                || (m.mount_id != id
                    && !(m.mount_point != target && m.mount_point.starts_with(target)));
            position += 1;
            keep
        });
        Ok(())
    }

    fn enter_mount_namespace(&self, ns: BorrowedFd<'_>) -> Result<(), MountError> {
        let mut s = self.lock();
        let fd = raw(ns);
        match self.record(&mut s, Call::EnterMountNamespace { fd }) {
            Some(errno) => Err(MountError::Setns { fd, errno }),
            None => Ok(()),
        }
    }

    fn open_tree_clone(&self, source: &Path, recursive: bool) -> Result<OwnedFd, MountError> {
        let mut s = self.lock();
        let call = Call::OpenTreeClone {
            source: source.to_path_buf(),
            recursive,
        };
        let err = |errno| MountError::OpenTree {
            source_path: source.to_path_buf(),
            errno,
        };
        if let Some(errno) = self.record(&mut s, call) {
            return Err(err(errno));
        }
        detached_tree(&mut s, source, recursive).map_err(err)
    }

    /// Recorded with the path the kernel gives `source`; the tree stands for that path.
    fn open_tree_clone_fd(
        &self,
        source: BorrowedFd<'_>,
        recursive: bool,
    ) -> Result<OwnedFd, MountError> {
        let path = super::fd::fd_path(source)?;
        let mut s = self.lock();
        let call = Call::OpenTreeCloneFd {
            source: path.clone(),
            recursive,
        };
        let err = |errno| MountError::OpenTree {
            source_path: path.clone(),
            errno,
        };
        if let Some(errno) = self.record(&mut s, call) {
            return Err(err(errno));
        }
        detached_tree(&mut s, &path, recursive).map_err(err)
    }

    fn change_mount_flags(
        &self,
        mount: BorrowedFd<'_>,
        set: MountFlags,
        clear: MountFlags,
        recursive: bool,
    ) -> Result<(), MountError> {
        let mut s = self.lock();
        let fd = raw(mount);
        let err = |errno| MountError::ChangeFlags {
            mount: PathBuf::from(format!("/proc/self/fd/{fd}")),
            change: format!("set {set}, clear {clear}"),
            errno,
        };
        let call = Call::ChangeMountFlags {
            fd,
            set,
            clear,
            recursive,
        };
        if let Some(errno) = self.record(&mut s, call) {
            return Err(err(errno));
        }
        if let Some(tree) = s.trees.get_mut(&fd) {
            tree.set = tree.set.union(set);
            tree.clear = tree.clear.union(clear);
            tree.readonly = (tree.readonly || set.readonly) && !clear.readonly;
            return Ok(());
        }
        let path = super::fd::fd_path(mount).map_err(|_| err(Errno::EBADF))?;
        let top_id = s
            .topmost(&path)
            .map(|m| m.mount_id)
            .ok_or_else(|| err(Errno::EINVAL))?;
        for m in s.table.iter_mut() {
            if m.mount_id == top_id || (recursive && m.mount_point.starts_with(&path)) {
                apply_flags(m, set, clear);
            }
        }
        Ok(())
    }

    fn remount_bind_with(
        &self,
        target: &Path,
        set: MountFlags,
        clear: MountFlags,
    ) -> Result<(), MountError> {
        let mut s = self.lock();
        let call = Call::RemountBindWith {
            target: target.to_path_buf(),
            set,
            clear,
        };
        let err = |errno| MountError::ChangeFlags {
            mount: target.to_path_buf(),
            change: format!("set {set}, clear {clear}"),
            errno,
        };
        if let Some(errno) = self.record(&mut s, call) {
            return Err(err(errno));
        }
        // A /proc/self/fd path names whatever its fd holds.
        let at = if target.starts_with("/proc/self/fd") {
            std::fs::read_link(target).unwrap_or_else(|_| target.to_path_buf())
        } else {
            target.to_path_buf()
        };
        let m = s.topmost(&at).ok_or_else(|| err(Errno::EINVAL))?;
        apply_flags(m, set, clear);
        Ok(())
    }

    fn harden_mount_root(&self, path: &Path) -> Result<bool, MountError> {
        let mut s = self.lock();
        let call = Call::HardenMountRoot {
            target: path.to_path_buf(),
        };
        if let Some(errno) = self.record(&mut s, call) {
            return Err(MountError::ChangeFlags {
                mount: path.to_path_buf(),
                change: format!("set {}", MountFlags::HOST_ONLY),
                errno,
            });
        }
        if s.topmost(path).is_none() {
            return Ok(false);
        }
        for m in s.table.iter_mut() {
            if m.mount_point.starts_with(path) {
                apply_flags(m, MountFlags::HOST_ONLY, MountFlags::NONE);
            }
        }
        Ok(true)
    }

    fn move_mount_to_fd(&self, from: BorrowedFd<'_>, to: BorrowedFd<'_>) -> Result<(), MountError> {
        let mut s = self.lock();
        let (from_raw, to_raw) = (raw(from), raw(to));
        let err = |errno| MountError::MoveMount {
            from: from_raw,
            to: to_raw,
            errno,
        };
        if let Some(errno) = self.record(
            &mut s,
            Call::MoveMountToFd {
                from: from_raw,
                to: to_raw,
            },
        ) {
            return Err(err(errno));
        }
        let tree = s
            .trees
            .remove(&from_raw)
            .ok_or_else(|| err(Errno::EINVAL))?;
        let target = super::fd::fd_path(to).map_err(|_| err(Errno::EBADF))?;
        s.attached.insert(from_raw, target.clone());
        s.bind(&tree.source, &target, tree.recursive, tree.readonly);
        if let Some(m) = s.topmost(&target) {
            apply_flags(m, tree.set, tree.clear);
        }
        Ok(())
    }

    fn set_propagation_by_fd(
        &self,
        mount: BorrowedFd<'_>,
        propagation: Propagation,
        recursive: bool,
    ) -> Result<(), MountError> {
        let fd = raw(mount);
        let target = {
            let mut s = self.lock();
            let call = Call::SetPropagationByFd {
                fd,
                propagation,
                recursive,
            };
            if let Some(errno) = self.record(&mut s, call) {
                return Err(MountError::Propagation {
                    target: PathBuf::from(format!("fd {fd}")),
                    propagation: propagation.as_str(),
                    errno,
                });
            }
            s.attached.get(&fd).cloned()
        };
        // The table change of set_propagation, on the mount the fd names (not recorded twice).
        let target = match target {
            Some(t) => t,
            None => super::fd::fd_path(mount).map_err(|_| MountError::Propagation {
                target: PathBuf::from(format!("fd {fd}")),
                propagation: propagation.as_str(),
                errno: Errno::EBADF,
            })?,
        };
        let mut s = self.lock();
        if s.topmost(&target).is_none() {
            return Err(MountError::Propagation {
                target,
                propagation: propagation.as_str(),
                errno: Errno::EINVAL,
            });
        }
        s.next_group += 1;
        let group = s.next_group;
        let top_id = s.topmost(&target).map(|m| m.mount_id);
        for m in s.table.iter_mut() {
            let hit = if recursive {
                m.mount_point.starts_with(&target)
            } else {
                Some(m.mount_id) == top_id
            };
            if hit {
                set_propagation_fields(m, propagation, group);
            }
        }
        Ok(())
    }

    fn set_readonly_by_fd(&self, mount: BorrowedFd<'_>, recursive: bool) -> Result<(), MountError> {
        let mut s = self.lock();
        let fd = raw(mount);
        let err = |errno| MountError::MountSetattr { fd, errno };
        if let Some(errno) = self.record(&mut s, Call::SetReadonlyByFd { fd, recursive }) {
            return Err(err(errno));
        }
        if let Some(tree) = s.trees.get_mut(&fd) {
            tree.readonly = true;
            return Ok(());
        }
        let path = super::fd::fd_path(mount).map_err(|_| err(Errno::EBADF))?;
        let top_id = s
            .topmost(&path)
            .map(|m| m.mount_id)
            .ok_or_else(|| err(Errno::EINVAL))?;
        for m in s.table.iter_mut() {
            if m.mount_id == top_id || (recursive && m.mount_point.starts_with(&path)) {
                set_ro(m);
            }
        }
        Ok(())
    }

    fn bind_mount_to_fd(
        &self,
        source: &Path,
        target: BorrowedFd<'_>,
        recursive: bool,
    ) -> Result<(), MountError> {
        let mut s = self.lock();
        let fd = raw(target);
        let call = Call::BindMountToFd {
            source: source.to_path_buf(),
            target: fd,
            recursive,
        };
        let shown = super::fd::fd_path(target)
            .unwrap_or_else(|_| PathBuf::from(format!("/proc/self/fd/{fd}")));
        if let Some(errno) = self.record(&mut s, call) {
            return Err(MountError::Bind {
                source_path: source.to_path_buf(),
                target: shown,
                errno,
            });
        }
        s.bind(source, &shown, recursive, false);
        Ok(())
    }

    fn pivot_root(&self, new_root: &Path, put_old: &Path) -> Result<(), MountError> {
        let mut s = self.lock();
        let call = Call::PivotRoot {
            new_root: new_root.to_path_buf(),
            put_old: put_old.to_path_buf(),
        };
        match self.record(&mut s, call) {
            Some(errno) => Err(MountError::PivotRoot {
                new_root: new_root.to_path_buf(),
                put_old: put_old.to_path_buf(),
                errno,
            }),
            None => Ok(()),
        }
    }
}

impl MountTable for FakeSyscall {
    fn mounts(&self) -> Result<Vec<MountInfo>, MountError> {
        Ok(self.lock().table.clone())
    }

    /// As the kernel's `listmount` answers: for a mount root, whether any mount lies strictly
    /// beneath it; for any other path, cannot tell.
    fn has_child_mounts(&self, path: &Path) -> Result<Option<bool>, MountError> {
        if self.find(path)?.is_none() {
            return Ok(None);
        }
        let state = self.lock();
        Ok(Some(state.table.iter().any(|m| {
            m.mount_point != path && m.mount_point.starts_with(path)
        })))
    }

    /// The simulated table's mount id stands for the unique id (the fake never reuses one).
    fn check_mount_root(&self, path: &Path) -> Result<crate::mount::RootCheck, MountError> {
        let top = self.find(path)?;
        Ok(crate::mount::RootCheck {
            mounted: top.is_some(),
            unique_id: top.map(|m| u64::from(m.mount_id)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn records_calls_and_simulates_table() {
        let fake = FakeSyscall::new();
        let src = Path::new("/host/vol");
        let dst = Path::new("/c/rootfs/data");
        fake.bind_mount(src, dst, true).unwrap();
        fake.remount_bind_readonly(dst).unwrap();
        fake.set_propagation(dst, Propagation::Slave, false)
            .unwrap();
        fake.mount_filesystem(
            Path::new("/dev/loop3"),
            Path::new("/c/disk"),
            "ext4",
            MountFlags {
                nosuid: true,
                ..MountFlags::default()
            },
            "errors=remount-ro",
        )
        .unwrap();
        fake.unmount(Path::new("/c/disk"), false).unwrap();
        assert_eq!(
            fake.calls(),
            vec![
                Call::BindMount {
                    source: src.into(),
                    target: dst.into(),
                    recursive: true
                },
                Call::RemountBindReadonly { target: dst.into() },
                Call::SetPropagation {
                    target: dst.into(),
                    propagation: Propagation::Slave,
                    recursive: false
                },
                Call::MountFilesystem {
                    device: "/dev/loop3".into(),
                    target: "/c/disk".into(),
                    fstype: "ext4".into(),
                    flags: MountFlags {
                        nosuid: true,
                        ..MountFlags::default()
                    },
                    data: "errors=remount-ro".into(),
                },
                Call::Unmount {
                    target: "/c/disk".into(),
                    detach: false
                },
            ]
        );
        let m = fake.find(dst).unwrap().unwrap();
        assert!(m.is_readonly());
        assert_eq!(m.root, src);
        assert_eq!(fake.mounts().unwrap().len(), 1);
    }

    #[test]
    fn unmount_of_nothing_is_not_mounted_and_busy_parent_needs_detach() {
        let fake = FakeSyscall::new();
        assert!(matches!(
            fake.unmount(Path::new("/nope"), false),
            Err(MountError::NotMounted { .. })
        ));
        fake.add_mount("a", Path::new("/a"), "tmpfs");
        fake.add_mount("b", Path::new("/a/b"), "tmpfs");
        let err = fake.unmount(Path::new("/a"), false).unwrap_err();
        assert_eq!(err.errno(), Some(Errno::EBUSY));
        fake.unmount(Path::new("/a"), true).unwrap();
        assert!(fake.mounts().unwrap().is_empty());
    }

    #[test]
    fn recursive_bind_copies_submounts_and_propagation_is_tracked() {
        let fake = FakeSyscall::new();
        fake.add_mount("vol", Path::new("/src"), "ext4");
        fake.add_mount("sub", Path::new("/src/sub"), "tmpfs");
        fake.bind_mount(Path::new("/src"), Path::new("/dst"), true)
            .unwrap();
        let sub = fake.find(Path::new("/dst/sub")).unwrap().unwrap();
        assert_eq!(sub.fs_type, "tmpfs");
        assert_eq!(
            fake.find(Path::new("/dst")).unwrap().unwrap().fs_type,
            "ext4"
        );
        fake.set_propagation(Path::new("/dst"), Propagation::Shared, true)
            .unwrap();
        let group = fake
            .find(Path::new("/dst"))
            .unwrap()
            .unwrap()
            .shared_peer_group();
        assert!(group.is_some());
        assert!(fake
            .find(Path::new("/dst/sub"))
            .unwrap()
            .unwrap()
            .shared_peer_group()
            .is_some());
        fake.set_propagation(Path::new("/dst"), Propagation::Slave, false)
            .unwrap();
        let dst = fake.find(Path::new("/dst")).unwrap().unwrap();
        assert_eq!(dst.master_peer_group(), group);
        assert_eq!(dst.shared_peer_group(), None);
        fake.set_propagation(Path::new("/dst"), Propagation::Unbindable, false)
            .unwrap();
        assert!(fake
            .find(Path::new("/dst"))
            .unwrap()
            .unwrap()
            .is_unbindable());
        let err = fake
            .set_propagation(Path::new("/nothing"), Propagation::Private, false)
            .unwrap_err();
        assert_eq!(err.errno(), Some(Errno::EINVAL));
    }

    #[test]
    fn injected_failures_are_counted_and_scoped() {
        let fake = FakeSyscall::new();
        fake.fail_at(CallKind::BindMount, Path::new("/t1"), Errno::EACCES, 2);
        for _ in 0..2 {
            let err = fake
                .bind_mount(Path::new("/s"), Path::new("/t1"), false)
                .unwrap_err();
            assert!(matches!(
                err,
                MountError::Bind {
                    errno: Errno::EACCES,
                    ..
                }
            ));
            assert_eq!(
                err.to_string(),
                "bind mount /s onto /t1: EACCES: Permission denied"
            );
        }
        fake.bind_mount(Path::new("/s"), Path::new("/t2"), false)
            .unwrap();
        fake.bind_mount(Path::new("/s"), Path::new("/t1"), false)
            .unwrap();
        assert_eq!(fake.calls().len(), 4);
        assert_eq!(fake.mounts().unwrap().len(), 2);
    }

    #[test]
    fn open_tree_and_move_mount_land_at_the_target_fd() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("t");
        std::fs::create_dir(&target).unwrap();
        let target_fd = open(&target, OFlag::O_PATH | OFlag::O_CLOEXEC, Mode::empty()).unwrap();
        let fake = FakeSyscall::new();
        let tree = fake.open_tree_clone(Path::new("/vol"), false).unwrap();
        fake.set_readonly_by_fd(tree.as_fd(), false).unwrap();
        fake.move_mount_to_fd(tree.as_fd(), target_fd.as_fd())
            .unwrap();
        let real_target = std::fs::canonicalize(&target).unwrap();
        let m = fake.find(&real_target).unwrap().unwrap();
        assert!(m.is_readonly());
        assert_eq!(m.root, Path::new("/vol"));
        // The tree was consumed: moving it again fails like the kernel would.
        let err = fake
            .move_mount_to_fd(tree.as_fd(), target_fd.as_fd())
            .unwrap_err();
        assert_eq!(err.errno(), Some(Errno::EINVAL));
        let kinds: Vec<CallKind> = fake.calls().iter().map(Call::kind).collect();
        assert_eq!(
            kinds,
            vec![
                CallKind::OpenTreeClone,
                CallKind::SetReadonlyByFd,
                CallKind::MoveMountToFd,
                CallKind::MoveMountToFd
            ]
        );
        // Read-only by fd on an attached mount, and a bind onto an fd.
        fake.bind_mount_to_fd(Path::new("/vol2"), target_fd.as_fd(), false)
            .unwrap();
        assert!(!fake.find(&real_target).unwrap().unwrap().is_readonly());
        fake.set_readonly_by_fd(target_fd.as_fd(), false).unwrap();
        assert!(fake.find(&real_target).unwrap().unwrap().is_readonly());
    }

    #[test]
    fn clones_by_fd_keep_the_source_flags_until_changed_and_harden_needs_a_mount_root() {
        let dir = tempfile::tempdir().unwrap();
        let base = std::fs::canonicalize(dir.path()).unwrap();
        let (src, dst) = (base.join("src"), base.join("dst"));
        std::fs::create_dir(&src).unwrap();
        std::fs::create_dir(&dst).unwrap();
        let fake = FakeSyscall::new();
        // Not a mount root: nothing changes.
        assert!(!fake.harden_mount_root(&src).unwrap());
        assert!(fake.mounts().unwrap().is_empty());
        fake.add_mount("vol", &src, "ext4");
        assert!(fake.harden_mount_root(&src).unwrap());
        let host = fake.find(&src).unwrap().unwrap();
        assert!(host.mount_options.iter().any(|o| o == "nosuid"));

        let src_fd = open(&src, OFlag::O_PATH | OFlag::O_CLOEXEC, Mode::empty()).unwrap();
        let dst_fd = open(&dst, OFlag::O_PATH | OFlag::O_CLOEXEC, Mode::empty()).unwrap();
        let tree = fake.open_tree_clone_fd(src_fd.as_fd(), true).unwrap();
        fake.change_mount_flags(tree.as_fd(), MountFlags::NONE, MountFlags::HOST_ONLY, false)
            .unwrap();
        fake.move_mount_to_fd(tree.as_fd(), dst_fd.as_fd()).unwrap();
        let copy = fake.find(&dst).unwrap().unwrap();
        assert!(
            !copy
                .mount_options
                .iter()
                .any(|o| o == "nosuid" || o == "nodev"),
            "{copy:?}"
        );
        // A clone left alone keeps what its source's mount has, as the kernel's does.
        let second = base.join("second");
        std::fs::create_dir(&second).unwrap();
        let second_fd = open(&second, OFlag::O_PATH | OFlag::O_CLOEXEC, Mode::empty()).unwrap();
        let tree2 = fake.open_tree_clone_fd(src_fd.as_fd(), false).unwrap();
        fake.move_mount_to_fd(tree2.as_fd(), second_fd.as_fd())
            .unwrap();
        let kept = fake.find(&second).unwrap().unwrap();
        assert!(kept.mount_options.iter().any(|o| o == "nodev"), "{kept:?}");
        // The remount fallback sets and clears on an attached mount.
        fake.remount_bind_with(&second, MountFlags::READONLY, MountFlags::HOST_ONLY)
            .unwrap();
        let changed = fake.find(&second).unwrap().unwrap();
        assert!(changed.is_readonly());
        assert!(!changed.mount_options.iter().any(|o| o == "nodev"));
        assert_eq!(
            fake.calls()[..3],
            [
                Call::HardenMountRoot {
                    target: src.clone()
                },
                Call::HardenMountRoot {
                    target: src.clone()
                },
                Call::OpenTreeCloneFd {
                    source: src.clone(),
                    recursive: true
                },
            ]
        );
    }
}
