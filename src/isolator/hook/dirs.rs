//! The work dir's lock and the hook container's directory (made real, removed beneath the hook dir).

use super::*;
use crate::io_step::IoStep;

/// Takes the work dir's lock, waiting up to `timeout` (hooks are short, so
/// one waits for another instead of failing).
pub async fn lock_work_dir(work_dir: &Path, timeout: Duration) -> Result<WorkDirLock, HookError> {
    Ok(crate::workdir::lock(work_dir, Some(timeout)).await?)
}

/// Makes the directory `path` (0700; its parent must exist) or takes the one there, refusing a symlink
/// or anything else: a hook directory is never somewhere else than where it is named.
pub(super) fn make_real_dir(path: &Path) -> Result<(), HookError> {
    use std::os::unix::fs::DirBuilderExt;
    let fail = |step, source| HookError::Io(IoStep::new(step, path, source));
    match std::fs::DirBuilder::new().mode(0o700).create(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            let meta = std::fs::symlink_metadata(path).map_err(|e| fail("stat directory", e))?;
            if meta.file_type().is_dir() {
                Ok(())
            } else {
                Err(fail(
                    "check directory",
                    std::io::Error::other(
                        "a symlink or not a directory; remove it (the hook makes its own)",
                    ),
                ))
            }
        }
        Err(e) => Err(fail("create directory", e)),
    }
}

/// Why a hook container's directory was not removed: the variant names the step and the path.
#[derive(Debug, thiserror::Error)]
pub enum RemoveDirError {
    /// The id is not a container id (never reaches the file system).
    #[error(transparent)]
    InvalidId(Box<crate::resource::ResourceError>),
    /// The directory (or the hook directory) is a symlink or not a directory.
    #[error("{}: a symlink or not a directory; refused", path.display())]
    NotADirectory {
        /// The path.
        path: PathBuf,
    },
    /// Something is still mounted under the directory.
    #[error("{}: still mounted under it", path.display())]
    StillMounted {
        /// The container directory.
        path: PathBuf,
    },
    /// The mount table could not be read to check nothing is mounted under the directory.
    #[error("{}: read the mount table", path.display())]
    MountTable {
        /// The container directory.
        path: PathBuf,
        /// The mount table error.
        #[source]
        source: crate::mount::MountError,
    },
    /// An entry of the tree is on another file system (a mount).
    #[error("{}: on another file system (a mount)", path.display())]
    OtherFileSystem {
        /// The entry.
        path: PathBuf,
    },
    /// The tree is deeper than the removal goes.
    #[error("{}: nested over {MAX_REMOVE_DEPTH} levels", path.display())]
    TooDeep {
        /// The entry at the limit.
        path: PathBuf,
    },
    /// The tree has more entries than the removal deletes.
    #[error("{}: more than {MAX_REMOVE_ENTRIES} entries", path.display())]
    TooManyEntries {
        /// The container directory.
        path: PathBuf,
    },
    /// A step on an entry failed.
    #[error(transparent)]
    Io(#[from] IoStep),
}

/// The error of `step` on `path` for a `nix` call.
fn errno_step<'a>(
    step: &'static str,
    path: &'a Path,
) -> impl FnOnce(nix::errno::Errno) -> IoStep + 'a {
    move |errno| IoStep::new(step, path, std::io::Error::from(errno))
}

/// Removes the hook container directory `<work_dir>/oci-hook/<id>` (logged on failure; kept while
/// anything is mounted under it) on the blocking pool. See [`remove_beneath_hook_dir`].
pub(super) async fn remove_container_dir(work_dir: &Path, id: &str) {
    let (dir, id) = (work_dir.to_path_buf(), id.to_string());
    crate::offload::blocking(move || {
        if let Err(e) = remove_beneath_hook_dir(&dir, &id) {
            tracing::error!(dir = %container_dir(&dir, &id).display(), error = %crate::error_chain::Chain(&e), "hook container directory kept");
        }
    })
    .await
}

/// Removes `<work_dir>/oci-hook/<id>` without following a symlink: `oci-hook` is opened by fd (refused
/// if a symlink or not a directory), `<id>` beneath it must be a real directory, and its tree is removed
/// by fd, entry by entry, never leaving the file system it is on (a mount under it is refused, not
/// emptied) and bounded in depth and entries. A missing directory is done already.
pub fn remove_beneath_hook_dir(work_dir: &Path, id: &str) -> Result<(), RemoveDirError> {
    use nix::errno::Errno;
    use nix::fcntl::{open, OFlag};
    use nix::sys::stat::Mode;
    crate::resource::validate_container_id(id)
        .map_err(|e| RemoveDirError::InvalidId(Box::new(e)))?;
    let hook_dir = work_dir.join(HOOK_DIR);
    let dir_flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let parent = match open(&hook_dir, dir_flags, Mode::empty()) {
        Ok(fd) => fd,
        Err(Errno::ENOENT) => return Ok(()),
        Err(Errno::ELOOP | Errno::ENOTDIR) => {
            return Err(RemoveDirError::NotADirectory { path: hook_dir })
        }
        Err(e) => return Err(errno_step("open", &hook_dir)(e).into()),
    };
    let dir = container_dir(work_dir, id);
    let st = match nix::sys::stat::fstatat(&parent, id, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW) {
        Ok(st) => st,
        Err(Errno::ENOENT) => return Ok(()),
        Err(e) => return Err(errno_step("stat", &dir)(e).into()),
    };
    if st.st_mode & libc::S_IFMT != libc::S_IFDIR {
        return Err(RemoveDirError::NotADirectory { path: dir });
    }
    match ProcMountTable::new().mounts_under(&dir) {
        Ok(m) if m.is_empty() => {}
        Ok(_) => return Err(RemoveDirError::StillMounted { path: dir }),
        Err(source) => return Err(RemoveDirError::MountTable { path: dir, source }),
    }
    let mut budget = MAX_REMOVE_ENTRIES;
    remove_tree(
        parent.as_fd(),
        std::ffi::OsStr::new(id),
        &dir,
        st.st_dev,
        0,
        &mut budget,
    )
}

/// Removes the directory `name` beneath `parent` (and everything in it) by fd; `path` is what it is
/// called in errors. See [`remove_beneath_hook_dir`].
fn remove_tree(
    parent: BorrowedFd<'_>,
    name: &std::ffi::OsStr,
    path: &Path,
    dev: libc::dev_t,
    depth: usize,
    budget: &mut usize,
) -> Result<(), RemoveDirError> {
    use nix::fcntl::{openat, AtFlags, OFlag};
    use nix::sys::stat::{fstat, fstatat, Mode};
    use nix::unistd::{unlinkat, UnlinkatFlags};
    if depth >= MAX_REMOVE_DEPTH {
        return Err(RemoveDirError::TooDeep {
            path: path.to_path_buf(),
        });
    }
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let fd = openat(parent, name, flags, Mode::empty()).map_err(errno_step("open", path))?;
    let st = fstat(&fd).map_err(errno_step("stat", path))?;
    if st.st_dev != dev {
        return Err(RemoveDirError::OtherFileSystem {
            path: path.to_path_buf(),
        });
    }
    // The listing gets its own descriptor (Dir owns it); the removals go through `fd`.
    let listing = fd.try_clone().map_err(|e| IoStep::new("dup", path, e))?;
    let mut entries = Vec::new();
    for entry in nix::dir::Dir::from_fd(listing)
        .map_err(errno_step("list", path))?
        .iter()
    {
        let entry = entry.map_err(errno_step("list", path))?;
        let child = std::ffi::OsStr::from_bytes(entry.file_name().to_bytes());
        if child == "." || child == ".." {
            continue;
        }
        if *budget == 0 {
            return Err(RemoveDirError::TooManyEntries {
                path: path.to_path_buf(),
            });
        }
        *budget -= 1;
        entries.push(child.to_os_string());
    }
    for child in &entries {
        let child_path = path.join(child);
        let st = fstatat(&fd, child.as_os_str(), AtFlags::AT_SYMLINK_NOFOLLOW)
            .map_err(errno_step("stat", &child_path))?;
        if st.st_mode & libc::S_IFMT == libc::S_IFDIR {
            remove_tree(fd.as_fd(), child, &child_path, dev, depth + 1, budget)?;
        } else {
            // A symlink is removed itself, never followed.
            unlinkat(&fd, child.as_os_str(), UnlinkatFlags::NoRemoveDir)
                .map_err(errno_step("remove", &child_path))?;
        }
    }
    unlinkat(parent, name, UnlinkatFlags::RemoveDir).map_err(errno_step("remove", path))?;
    Ok(())
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removal_stays_beneath_the_hook_dir_and_follows_no_symlink() {
        let dir = tempfile::tempdir().unwrap();
        let work = dir.path().join("work");
        let decoy = dir.path().join("decoy");
        std::fs::create_dir_all(decoy.join("sub")).unwrap();
        std::fs::write(decoy.join("sub/keep"), "x").unwrap();
        let hook = work.join(HOOK_DIR);
        // A real container directory with a tree, a symlink to the decoy inside: removed, the link
        // itself and not what it names.
        std::fs::create_dir_all(hook.join("c1/a/b")).unwrap();
        std::fs::write(hook.join("c1/a/b/f"), "x").unwrap();
        std::os::unix::fs::symlink(&decoy, hook.join("c1/a/link")).unwrap();
        remove_beneath_hook_dir(&work, "c1").unwrap();
        assert!(!hook.join("c1").exists());
        assert!(decoy.join("sub/keep").exists());
        // Missing: nothing to do.
        remove_beneath_hook_dir(&work, "c1").unwrap();
        // The container directory a symlink: refused, the decoy kept.
        std::os::unix::fs::symlink(&decoy, hook.join("c2")).unwrap();
        let err = remove_beneath_hook_dir(&work, "c2").unwrap_err();
        assert!(
            matches!(&err, RemoveDirError::NotADirectory { path } if *path == hook.join("c2")),
            "{err}"
        );
        assert!(decoy.join("sub/keep").exists());
        // The oci-hook directory a symlink: refused.
        std::fs::remove_dir_all(&hook).unwrap();
        std::fs::create_dir_all(decoy.join("c3")).unwrap();
        std::os::unix::fs::symlink(&decoy, &hook).unwrap();
        let err = remove_beneath_hook_dir(&work, "c3").unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("{}: a symlink or not a directory; refused", hook.display())
        );
        assert!(decoy.join("c3").is_dir());
        // An id that is not a path component never reaches the file system.
        assert!(matches!(
            remove_beneath_hook_dir(&work, ".."),
            Err(RemoveDirError::InvalidId(_))
        ));
    }
}
