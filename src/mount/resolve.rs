//! Path resolution inside an untrusted container root, by fd.
//!
//! Threat model: everything below `root` is controlled by the container (it may hold symlinks such as
//! `target -> /etc` or `a -> ../../..`, and may change them while we look). Mounting onto a path string that
//! goes through such a symlink would mount onto the host. So targets are opened as O_PATH fds whose
//! resolution never leaves `root`, and mounts go onto the fd (`move_mount`, or `/proc/self/fd/N`).
//!
//! Invariant: every fd returned here refers to an object inside `root` (checked once more at the end against
//! the kernel's own view of the fd's path; a mismatch is [`MountError::Escape`]).
//!
//! Two resolvers:
//! - `openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)`: the kernel treats `root` as `/` for this lookup.
//! - A userspace walk for kernels without openat2 (ENOSYS, or EPERM/E2BIG from seccomp filters): one
//!   component at a time with `O_PATH | O_NOFOLLOW`, keeping a stack of directory fds; symlinks are read
//!   with readlinkat and their targets spliced into the remaining path (absolute ones restart at `root`),
//!   `..` pops the stack and never goes above `root`, and at most [`MAX_SYMLINKS`] links are followed.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{open, openat, readlinkat, OFlag};
use nix::sys::stat::{fstat, mkdirat, Mode, SFlag};
use rustix::fs::{OFlags, ResolveFlags};

use super::fd::fd_path;
use super::MountError;

/// Symlinks followed in one resolution before giving up with ELOOP (the kernel's own limit).
pub const MAX_SYMLINKS: u32 = 40;

/// Which resolver to use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Strategy {
    /// openat2, falling back to the walk when the kernel lacks it.
    Auto,
    /// The userspace walk only.
    Walk,
}

/// Open `path` (relative to `root`, or absolute meaning "inside root") as an O_PATH fd, with
/// openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS); on ENOSYS/EPERM/E2BIG fall back to a component-by-component
/// walk with O_PATH|O_NOFOLLOW that resolves symlinks itself, scoped to root (".." never above root).
/// A symlink as the last component is followed (inside root).
pub fn open_in_root(root: &Path, path: &Path) -> Result<OwnedFd, MountError> {
    resolve(root, path, None, Strategy::Auto)
}

/// [`open_in_root`] through the userspace walk only (what runs on kernels without openat2).
pub fn open_in_root_fallback(root: &Path, path: &Path) -> Result<OwnedFd, MountError> {
    resolve(root, path, None, Strategy::Walk)
}

/// Like open_in_root, but creates missing components (directories; the last one a directory, or an empty file
/// when `last_is_file`) with mkdirat/openat relative to the parent fd, then returns the O_PATH fd of the target.
/// A dangling symlink is followed and its target created inside root.
pub fn create_in_root(root: &Path, path: &Path, last_is_file: bool) -> Result<OwnedFd, MountError> {
    resolve(root, path, Some(last_is_file), Strategy::Auto)
}

/// [`create_in_root`] through the userspace walk only.
pub fn create_in_root_fallback(
    root: &Path,
    path: &Path,
    last_is_file: bool,
) -> Result<OwnedFd, MountError> {
    resolve(root, path, Some(last_is_file), Strategy::Walk)
}

/// Opens the directory `path` (absolute, as the mount table names it: no symlink on it) as an O_PATH fd,
/// following no symlink at all: openat2(RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS), or, without openat2, a
/// component walk with O_NOFOLLOW that refuses any symlink. A symlink on the way is ELOOP: in a tree a
/// container can write, it means the path was swapped since the table was read.
pub fn open_dir_no_symlinks(path: &Path) -> Result<OwnedFd, MountError> {
    open_dir_no_symlinks_in(Path::new("/"), path)
}

/// [`open_dir_no_symlinks`] inside `root` (a trusted path, e.g. `/proc/<pid>/root`): `path` is absolute as
/// seen from `root` (a mount table path of the process whose root it is), resolved with RESOLVE_IN_ROOT
/// as well, and no symlink is followed on it.
pub fn open_dir_no_symlinks_in(root: &Path, path: &Path) -> Result<OwnedFd, MountError> {
    no_symlinks(root, path, Strategy::Auto)
}

/// [`open_dir_no_symlinks_in`] through the component walk only (what runs on kernels without openat2).
pub fn open_dir_no_symlinks_in_fallback(root: &Path, path: &Path) -> Result<OwnedFd, MountError> {
    no_symlinks(root, path, Strategy::Walk)
}

fn no_symlinks(root: &Path, path: &Path, strategy: Strategy) -> Result<OwnedFd, MountError> {
    let ctx = Ctx { root, path };
    if !path.is_absolute() || path.components().any(|c| matches!(c, Component::ParentDir)) {
        return Err(ctx.err("check path", Errno::EINVAL));
    }
    let (root_fd, relative) = open_root(&ctx)?;
    if strategy == Strategy::Walk {
        return walk_no_symlinks(&ctx, root_fd, path);
    }
    // No O_DIRECTORY: a last component that is a symlink opens as itself and is refused below as ELOOP,
    // like a symlink anywhere else on the path.
    let opened = openat2(
        &ctx,
        root_fd.as_fd(),
        &relative,
        OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        ResolveFlags::IN_ROOT | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
    );
    match opened {
        Ok(fd) => {
            let st = fstat(&fd).map_err(|e| ctx.err("fstat", e))?;
            return match SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT {
                SFlag::S_IFDIR => Ok(fd),
                SFlag::S_IFLNK => Err(ctx.err("openat2", Errno::ELOOP)),
                _ => Err(ctx.err("openat2", Errno::ENOTDIR)),
            };
        }
        Err(Errno::ENOSYS | Errno::EPERM | Errno::E2BIG) => {}
        Err(e) => return Err(ctx.err("openat2", e)),
    }
    walk_no_symlinks(&ctx, root_fd, path)
}

/// The walk of [`no_symlinks`]: every component opened with O_NOFOLLOW and checked to be a directory.
fn walk_no_symlinks(ctx: &Ctx<'_>, root_fd: OwnedFd, path: &Path) -> Result<OwnedFd, MountError> {
    let o_path = OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let mut cur = root_fd;
    for name in split(path) {
        let next = openat(&cur, name.as_os_str(), o_path, Mode::empty())
            .map_err(|e| ctx.err("openat", e))?;
        let st = fstat(&next).map_err(|e| ctx.err("fstat", e))?;
        match SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT {
            SFlag::S_IFDIR => cur = next,
            SFlag::S_IFLNK => return Err(ctx.err("openat", Errno::ELOOP)),
            _ => return Err(ctx.err("openat", Errno::ENOTDIR)),
        }
    }
    Ok(cur)
}

/// Opens `rest` beneath the trusted directory `anchor` (a volume's mount point, or the work dir) as an
/// O_PATH fd of a directory, following no symlink beneath `anchor`: a volume's sub-path
/// (`volumes/roles/<role>/<id>`) lies in a tree whatever uses the volume can write, and a symlink planted
/// there must not send a mount elsewhere. `anchor` itself is opened as given (it is ours); an empty `rest`
/// is the anchor. `rest` must be relative, of plain components only. A symlink on the way is
/// [`MountError::SymlinkBeneath`] naming the first such component; resolution is
/// openat2(RESOLVE_IN_ROOT | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS) from the anchor's fd, or the
/// O_NOFOLLOW component walk without openat2 ([`open_dir_no_symlinks_in`]).
pub fn open_beneath_no_symlinks(anchor: &Path, rest: &Path) -> Result<OwnedFd, MountError> {
    let ctx = Ctx {
        root: anchor,
        path: rest,
    };
    if rest.as_os_str().is_empty() {
        return open(anchor, OFlag::O_PATH | OFlag::O_CLOEXEC, Mode::empty())
            .map_err(|e| ctx.err("open", e));
    }
    if rest.is_absolute() || !rest.components().all(|c| matches!(c, Component::Normal(_))) {
        return Err(ctx.err("check path", Errno::EINVAL));
    }
    match open_dir_no_symlinks_in(anchor, &Path::new("/").join(rest)) {
        Err(e) if e.errno() == Some(Errno::ELOOP) => Err(first_symlink(anchor, rest).map_or(
            e,
            |component| MountError::SymlinkBeneath {
                root: anchor.to_path_buf(),
                path: rest.to_path_buf(),
                component,
            },
        )),
        Err(MountError::Resolve { step, errno, .. }) => Err(ctx.err(step, errno)),
        other => other,
    }
}

/// The first component of `rest` beneath `anchor` that is a symlink (as a path beneath `anchor`), for the
/// message; `None` when none is found (it was swapped back since).
fn first_symlink(anchor: &Path, rest: &Path) -> Option<PathBuf> {
    let o_path = OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let mut cur = open(anchor, o_path | OFlag::O_DIRECTORY, Mode::empty()).ok()?;
    let mut seen = PathBuf::new();
    for name in split(rest) {
        seen.push(&name);
        let next = openat(&cur, name.as_os_str(), o_path, Mode::empty()).ok()?;
        let st = fstat(&next).ok()?;
        if SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == SFlag::S_IFLNK {
            return Some(seen);
        }
        cur = next;
    }
    None
}

/// The directory holding the last component of `path` inside the container root `root`, as an O_PATH fd,
/// and that component's name. Everything up to the last component resolves like [`open_in_root`] (symlinks
/// followed, never out of `root`); a last component that is a symlink is followed the same way (the mount
/// was made on what it points to), so the name returned is never a symlink at the time of the call.
/// A target that resolves to the root itself, or through a last `..`, has no such entry: EINVAL.
pub fn open_parent_in_root(root: &Path, path: &Path) -> Result<(OwnedFd, OsString), MountError> {
    let mut cur: PathBuf = path
        .components()
        .filter(|c| {
            !matches!(
                c,
                Component::RootDir | Component::Prefix(_) | Component::CurDir
            )
        })
        .collect();
    for _ in 0..=MAX_SYMLINKS {
        let ctx = Ctx { root, path: &cur };
        let Some(Component::Normal(name)) = cur.components().next_back() else {
            return Err(ctx.err("split last component", Errno::EINVAL));
        };
        let name = name.to_os_string();
        let parent_path = cur.parent().unwrap_or(Path::new("")).to_path_buf();
        let parent = open_in_root(root, &parent_path)?;
        let st = match nix::sys::stat::fstatat(
            &parent,
            name.as_os_str(),
            nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
        ) {
            Ok(st) => st,
            // Nothing there: the caller finds nothing mounted on it.
            Err(Errno::ENOENT) => return Ok((parent, name)),
            Err(e) => return Err(ctx.err("fstatat", e)),
        };
        if SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT != SFlag::S_IFLNK {
            return Ok((parent, name));
        }
        let link = match readlinkat(&parent, name.as_os_str()) {
            Ok(link) => PathBuf::from(link),
            // Swapped for a non-symlink since the fstatat: look again (bounded by the loop).
            Err(Errno::EINVAL) => continue,
            Err(e) => return Err(ctx.err("readlinkat", e)),
        };
        cur = if link.is_absolute() {
            link.components()
                .filter(|c| !matches!(c, Component::RootDir | Component::CurDir))
                .collect()
        } else {
            parent_path.join(link)
        };
    }
    Err(MountError::Resolve {
        step: "follow symlinks",
        root: root.to_path_buf(),
        path: path.to_path_buf(),
        errno: Errno::ELOOP,
    })
}

struct Ctx<'a> {
    root: &'a Path,
    path: &'a Path,
}

impl Ctx<'_> {
    fn err(&self, step: &'static str, errno: Errno) -> MountError {
        MountError::Resolve {
            step,
            root: self.root.to_path_buf(),
            path: self.path.to_path_buf(),
            errno,
        }
    }
}

/// The root (a trusted host path) as an O_PATH fd, and `path` made relative to it.
fn open_root(ctx: &Ctx<'_>) -> Result<(OwnedFd, PathBuf), MountError> {
    let root_fd = open(
        ctx.root,
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| ctx.err("open root", e))?;
    let relative = ctx
        .path
        .components()
        .filter(|c| !matches!(c, Component::RootDir | Component::Prefix(_)))
        .collect();
    Ok((root_fd, relative))
}

fn resolve(
    root: &Path,
    path: &Path,
    create: Option<bool>,
    strategy: Strategy,
) -> Result<OwnedFd, MountError> {
    let ctx = Ctx { root, path };
    let (root_fd, relative) = open_root(&ctx)?;

    let fd = match strategy {
        Strategy::Auto => match openat2_in_root(&ctx, root_fd.as_fd(), &relative) {
            Ok(fd) => fd,
            Err(Errno::ENOSYS | Errno::EPERM | Errno::E2BIG) => {
                tracing::debug!(root = %root.display(), "openat2 unavailable, walking the path instead");
                walk(&ctx, &root_fd, &relative, create)?
            }
            // Something is missing: the walk creates it, still scoped to root.
            Err(Errno::ENOENT) if create.is_some() => walk(&ctx, &root_fd, &relative, create)?,
            Err(e) => return Err(ctx.err("openat2", e)),
        },
        Strategy::Walk => walk(&ctx, &root_fd, &relative, create)?,
    };
    check_inside(&ctx, root_fd.as_fd(), fd.as_fd())?;
    Ok(fd)
}

/// Defence in depth: the kernel's name for the result must lie under the kernel's name for the root.
fn check_inside(ctx: &Ctx<'_>, root: BorrowedFd<'_>, fd: BorrowedFd<'_>) -> Result<(), MountError> {
    let root_path = fd_path(root)?;
    let got = fd_path(fd)?;
    if got.starts_with(&root_path) {
        Ok(())
    } else {
        Err(MountError::Escape {
            root: ctx.root.to_path_buf(),
            path: ctx.path.to_path_buf(),
        })
    }
}

fn openat2_in_root(ctx: &Ctx<'_>, root: BorrowedFd<'_>, relative: &Path) -> Result<OwnedFd, Errno> {
    openat2(
        ctx,
        root,
        relative,
        OFlags::PATH | OFlags::CLOEXEC,
        ResolveFlags::IN_ROOT | ResolveFlags::NO_MAGICLINKS,
    )
}

/// The one openat2(2) call: `relative` (empty: the directory itself) from `dir` with `flags` and
/// `resolve`. EINTR, and the EAGAIN that RESOLVE_IN_ROOT / RESOLVE_BENEATH return when a rename raced
/// with the lookup, are retried a bounded number of times; every other error is the caller's to judge
/// (ENOSYS, or EPERM/E2BIG from a seccomp filter, mean no openat2: take the walk).
fn openat2(
    ctx: &Ctx<'_>,
    dir: BorrowedFd<'_>,
    relative: &Path,
    flags: OFlags,
    resolve: ResolveFlags,
) -> Result<OwnedFd, Errno> {
    let target = if relative.as_os_str().is_empty() {
        Path::new(".")
    } else {
        relative
    };
    for _ in 0..16 {
        match rustix::fs::openat2(dir, target, flags, rustix::fs::Mode::empty(), resolve) {
            Ok(fd) => return Ok(fd),
            Err(e) if e == rustix::io::Errno::AGAIN || e == rustix::io::Errno::INTR => continue,
            Err(e) => return Err(Errno::from_raw(e.raw_os_error())),
        }
    }
    tracing::warn!(root = %ctx.root.display(), path = %ctx.path.display(), "openat2 kept racing");
    Err(Errno::EAGAIN)
}

fn split(path: &Path) -> impl Iterator<Item = OsString> + '_ {
    path.as_os_str()
        .as_bytes()
        .split(|b| *b == b'/')
        .filter(|c| !c.is_empty() && *c != b".")
        .map(|c| OsString::from(std::ffi::OsStr::from_bytes(c)))
}

/// The userspace resolver (see the module doc). `create`: None = open only, Some(last_is_file) = create
/// what is missing.
fn walk(
    ctx: &Ctx<'_>,
    root: &OwnedFd,
    relative: &Path,
    create: Option<bool>,
) -> Result<OwnedFd, MountError> {
    let o_path = OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    // stack[0] is the root; ".." pops, never below it.
    let mut stack: Vec<OwnedFd> = vec![root.try_clone().map_err(|e| {
        ctx.err(
            "dup root",
            Errno::from_raw(e.raw_os_error().unwrap_or(libc::EBADF)),
        )
    })?];
    let mut todo: VecDeque<OsString> = split(relative).collect();
    let mut links = 0u32;

    while let Some(name) = todo.pop_front() {
        if name.as_bytes() == b".." {
            if stack.len() > 1 {
                stack.pop();
            }
            continue;
        }
        let is_last = todo.is_empty();
        let cur = stack.last().expect("stack holds the root").as_fd();
        let fd = match openat(cur, name.as_os_str(), o_path, Mode::empty()) {
            Ok(fd) => fd,
            Err(Errno::ENOENT) if create.is_some() => {
                let as_file = is_last && create == Some(true);
                create_entry(ctx, cur, &name, as_file)?;
                openat(cur, name.as_os_str(), o_path, Mode::empty())
                    .map_err(|e| ctx.err("openat after create", e))?
            }
            Err(e) => return Err(ctx.err("openat", e)),
        };
        let st = fstat(&fd).map_err(|e| ctx.err("fstat", e))?;
        let kind = SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT;
        if kind == SFlag::S_IFLNK {
            links += 1;
            if links > MAX_SYMLINKS {
                return Err(ctx.err("follow symlinks", Errno::ELOOP));
            }
            // Read through the fd: the link opened above, even if the name was swapped since.
            let target = readlinkat(&fd, "").map_err(|e| ctx.err("readlinkat", e))?;
            let target = PathBuf::from(target);
            if target.is_absolute() {
                // Absolute targets mean "from the container's root".
                stack.truncate(1);
            }
            for component in split(&target).collect::<Vec<_>>().into_iter().rev() {
                todo.push_front(component);
            }
            continue;
        }
        if !is_last && kind != SFlag::S_IFDIR {
            return Err(ctx.err("openat", Errno::ENOTDIR));
        }
        stack.push(fd);
    }
    let top = stack.pop().expect("stack holds the root");
    Ok(top)
}

fn create_entry(
    ctx: &Ctx<'_>,
    parent: BorrowedFd<'_>,
    name: &OsString,
    as_file: bool,
) -> Result<(), MountError> {
    let result = if as_file {
        openat(
            parent,
            name.as_os_str(),
            OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_WRONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::from_bits_truncate(0o644),
        )
        .map(drop)
    } else {
        mkdirat(parent, name.as_os_str(), Mode::from_bits_truncate(0o755))
    };
    match result {
        // Someone created it between our open and now: use theirs (it is opened with O_NOFOLLOW again).
        Ok(()) | Err(Errno::EEXIST) => Ok(()),
        Err(e) => Err(ctx.err(if as_file { "create file" } else { "mkdirat" }, e)),
    }
}
