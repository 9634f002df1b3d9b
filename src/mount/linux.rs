//! [`LinuxSyscall`]: the [`Syscall`] seam implemented with real kernel calls.
//!
//! mount/umount2/setns/pivot_root go through nix; the new mount API (open_tree, move_mount, mount_setattr)
//! has no wrapper there, so it is called with `libc::syscall` and the uapi constants defined below.

use std::ffi::CString;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sched::{setns, CloneFlags};
use nix::sys::statvfs::{statvfs, FsFlags};

use super::fd::{fd_path, proc_fd_path};
use super::{MountError, MountFlags, Propagation, Syscall};

// include/uapi/linux/mount.h
/// open_tree(2): make a detached copy of the tree instead of opening the mounted one.
pub const OPEN_TREE_CLONE: libc::c_uint = 1;
/// open_tree(2): close-on-exec for the returned fd (same value as O_CLOEXEC).
pub const OPEN_TREE_CLOEXEC: libc::c_uint = libc::O_CLOEXEC as libc::c_uint;
/// move_mount(2): the source is the fd itself (empty path).
pub const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 0x0000_0004;
/// move_mount(2): the destination is the fd itself (empty path).
pub const MOVE_MOUNT_T_EMPTY_PATH: libc::c_uint = 0x0000_0040;
/// mount_setattr(2): mount read-only.
pub const MOUNT_ATTR_RDONLY: u64 = 0x0000_0001;
/// mount_setattr(2): ignore suid and sgid bits.
pub const MOUNT_ATTR_NOSUID: u64 = 0x0000_0002;
/// mount_setattr(2): disallow access to device special files.
pub const MOUNT_ATTR_NODEV: u64 = 0x0000_0004;
/// mount_setattr(2): disallow program execution.
pub const MOUNT_ATTR_NOEXEC: u64 = 0x0000_0008;
/// mount_setattr(2): do not update access times.
pub const MOUNT_ATTR_NOATIME: u64 = 0x0000_0010;
/// mount_setattr(2): the mask of the access-time setting (cleared whenever it is changed).
pub const MOUNT_ATTR_ATIME_MASK: u64 = 0x0000_0070;

/// The MOUNT_ATTR_* bits of `flags`.
fn mount_attr_bits(flags: MountFlags) -> u64 {
    [
        (flags.readonly, MOUNT_ATTR_RDONLY),
        (flags.nosuid, MOUNT_ATTR_NOSUID),
        (flags.nodev, MOUNT_ATTR_NODEV),
        (flags.noexec, MOUNT_ATTR_NOEXEC),
        (flags.noatime, MOUNT_ATTR_NOATIME),
    ]
    .into_iter()
    .filter(|(on, _)| *on)
    .fold(0, |acc, (_, bit)| acc | bit)
}

/// What a flag change is, for messages: `set nosuid,nodev`, `clear nosuid,nodev`, or both.
fn describe_change(set: MountFlags, clear: MountFlags) -> String {
    match (set.is_empty(), clear.is_empty()) {
        (false, true) => format!("set {set}"),
        (true, false) => format!("clear {clear}"),
        _ => format!("set {set}, clear {clear}"),
    }
}

/// mount_setattr(fd, "", AT_EMPTY_PATH | (AT_RECURSIVE if recursive), attr): the raw call, errno on failure.
fn mount_setattr(mount: BorrowedFd<'_>, attr: &MountAttr, recursive: bool) -> Result<(), Errno> {
    let mut flags = libc::AT_EMPTY_PATH as libc::c_uint;
    if recursive {
        flags |= libc::AT_RECURSIVE as libc::c_uint;
    }
    let empty = c"";
    // SAFETY: mount_setattr(int dfd, const char *path, unsigned flags, struct mount_attr *attr,
    // size_t size): the fd is borrowed for the call, the path is the static empty string, and `attr`
    // is a live repr(C) struct of exactly `size` bytes that the kernel only reads.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            mount.as_raw_fd(),
            empty.as_ptr(),
            flags,
            attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if ret < 0 {
        return Err(Errno::last());
    }
    Ok(())
}

/// `struct mount_attr` from include/uapi/linux/mount.h (MOUNT_ATTR_SIZE_VER0 = 32 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct MountAttr {
    /// Attributes to set.
    pub attr_set: u64,
    /// Attributes to clear.
    pub attr_clr: u64,
    /// New propagation type (MS_SHARED, ...), or 0.
    pub propagation: u64,
    /// User namespace fd for idmapped mounts.
    pub userns_fd: u64,
}

/// The real kernel.
#[derive(Clone, Copy, Debug, Default)]
pub struct LinuxSyscall;

impl LinuxSyscall {
    /// A handle to the real kernel.
    pub fn new() -> Self {
        LinuxSyscall
    }
}

fn cstring(path: &Path) -> Result<CString, MountError> {
    use std::os::unix::ffi::OsStrExt;
    CString::new(path.as_os_str().as_bytes()).map_err(|_| MountError::NulInPath {
        path: path.to_path_buf(),
    })
}

/// Per-mount flags a read-only bind remount must keep: the kernel refuses (EPERM) to clear locked flags,
/// and MS_REMOUNT replaces the whole set.
fn kept_flags(target: &Path) -> Result<MsFlags, MountError> {
    kept_flags_of(target, false)
}

/// [`kept_flags`], with MS_RDONLY too when `with_readonly` and the mount is read-only (a remount that is
/// not about read-only must not make a read-only mount writable).
fn kept_flags_of(target: &Path, with_readonly: bool) -> Result<MsFlags, MountError> {
    let st = statvfs(target).map_err(|errno| MountError::Statvfs {
        target: target.to_path_buf(),
        errno,
    })?;
    let have = st.flags();
    let mut kept = MsFlags::empty();
    if with_readonly && have.contains(FsFlags::ST_RDONLY) {
        kept |= MsFlags::MS_RDONLY;
    }
    let map = [
        (FsFlags::ST_NOSUID, MsFlags::MS_NOSUID),
        (FsFlags::ST_NODEV, MsFlags::MS_NODEV),
        (FsFlags::ST_NOEXEC, MsFlags::MS_NOEXEC),
        (FsFlags::ST_NOATIME, MsFlags::MS_NOATIME),
        (FsFlags::ST_NODIRATIME, MsFlags::MS_NODIRATIME),
        (FsFlags::ST_RELATIME, MsFlags::MS_RELATIME),
        (FsFlags::ST_SYNCHRONOUS, MsFlags::MS_SYNCHRONOUS),
    ];
    Ok(map
        .iter()
        .filter(|(st, _)| have.contains(*st))
        .fold(kept, |acc, (_, ms)| acc | *ms))
}

fn bind(source: &Path, target: &Path, shown: &Path, recursive: bool) -> Result<(), MountError> {
    let mut flags = MsFlags::MS_BIND;
    if recursive {
        flags |= MsFlags::MS_REC;
    }
    mount(Some(source), target, None::<&str>, flags, None::<&str>).map_err(|errno| {
        MountError::Bind {
            source_path: source.to_path_buf(),
            target: shown.to_path_buf(),
            errno,
        }
    })
}

impl Syscall for LinuxSyscall {
    fn bind_mount(&self, source: &Path, target: &Path, recursive: bool) -> Result<(), MountError> {
        bind(source, target, target, recursive)
    }

    fn remount_bind_readonly(&self, target: &Path) -> Result<(), MountError> {
        let flags =
            MsFlags::MS_REMOUNT | MsFlags::MS_BIND | MsFlags::MS_RDONLY | kept_flags(target)?;
        mount(None::<&str>, target, None::<&str>, flags, None::<&str>).map_err(|errno| {
            MountError::RemountReadonly {
                target: target.to_path_buf(),
                errno,
            }
        })
    }

    fn mount_filesystem(
        &self,
        device: &Path,
        target: &Path,
        fstype: &str,
        flags: MountFlags,
        data: &str,
    ) -> Result<(), MountError> {
        let mut ms = MsFlags::empty();
        ms.set(MsFlags::MS_RDONLY, flags.readonly);
        ms.set(MsFlags::MS_NOSUID, flags.nosuid);
        ms.set(MsFlags::MS_NODEV, flags.nodev);
        ms.set(MsFlags::MS_NOEXEC, flags.noexec);
        ms.set(MsFlags::MS_NOATIME, flags.noatime);
        let data = if data.is_empty() { None } else { Some(data) };
        mount(Some(device), target, Some(fstype), ms, data).map_err(|errno| {
            MountError::MountFilesystem {
                device: device.to_path_buf(),
                target: target.to_path_buf(),
                fstype: fstype.to_string(),
                errno,
            }
        })
    }

    fn set_propagation(
        &self,
        target: &Path,
        propagation: Propagation,
        recursive: bool,
    ) -> Result<(), MountError> {
        let mut flags = match propagation {
            Propagation::Private => MsFlags::MS_PRIVATE,
            Propagation::Slave => MsFlags::MS_SLAVE,
            Propagation::Shared => MsFlags::MS_SHARED,
            Propagation::Unbindable => MsFlags::MS_UNBINDABLE,
        };
        if recursive {
            flags |= MsFlags::MS_REC;
        }
        mount(None::<&str>, target, None::<&str>, flags, None::<&str>).map_err(|errno| {
            MountError::Propagation {
                target: target.to_path_buf(),
                propagation: propagation.as_str(),
                errno,
            }
        })
    }

    fn unmount(&self, target: &Path, detach: bool) -> Result<(), MountError> {
        let flags = if detach {
            MntFlags::MNT_DETACH
        } else {
            MntFlags::empty()
        };
        umount2(target, flags).map_err(|errno| match errno {
            Errno::EINVAL => MountError::NotMounted {
                target: target.to_path_buf(),
            },
            errno => MountError::Unmount {
                target: target.to_path_buf(),
                errno,
            },
        })
    }

    fn unmount_at(
        &self,
        dir: BorrowedFd<'_>,
        name: &std::ffi::OsStr,
        detach: bool,
    ) -> Result<(), MountError> {
        let target = PathBuf::from(name);
        // One plain component: no `/` (a trailing one would make umount2 follow a symlink),
        // not empty, not `.` or `..`.
        let bytes = std::os::unix::ffi::OsStrExt::as_bytes(name);
        if bytes.is_empty() || bytes.contains(&b'/') || bytes == b"." || bytes == b".." {
            return Err(MountError::Unmount {
                target,
                errno: Errno::EINVAL,
            });
        }
        let mut flags = MntFlags::UMOUNT_NOFOLLOW;
        if detach {
            flags |= MntFlags::MNT_DETACH;
        }
        // The cwd is per fs_struct: a thread of its own (sharing this thread's namespaces) takes `dir` as
        // its cwd without touching anyone else's, and the name is then looked up from it alone.
        // Errors name the entry only: the caller knows the full path (reading it back through
        // /proc here could ask a container's /proc, after a setns).
        let shown = target.clone();
        let result = std::thread::scope(|scope| {
            std::thread::Builder::new()
                .name("csi-unmount".into())
                .spawn_scoped(scope, || -> Result<(), Errno> {
                    super::ns::unshare_fs()?;
                    nix::unistd::fchdir(dir)?;
                    umount2(target.as_path(), flags)
                })
                .map(|h| h.join().unwrap_or(Err(Errno::EIO)))
                .unwrap_or(Err(Errno::EAGAIN))
        });
        result.map_err(|errno| match errno {
            Errno::EINVAL => MountError::NotMounted { target: shown },
            errno => MountError::Unmount {
                target: shown,
                errno,
            },
        })
    }

    fn unmount_no_symlinks(&self, target: &Path, detach: bool) -> Result<(), MountError> {
        let (Some(parent), Some(name)) = (target.parent(), target.file_name()) else {
            return Err(MountError::Unmount {
                target: target.to_path_buf(),
                errno: Errno::EINVAL,
            });
        };
        let dir = match super::open_dir_no_symlinks(parent) {
            Ok(dir) => dir,
            Err(MountError::Resolve {
                errno: Errno::ENOENT,
                ..
            }) => {
                return Err(MountError::NotMounted {
                    target: target.to_path_buf(),
                })
            }
            Err(e) => return Err(e),
        };
        self.unmount_at(dir.as_fd(), name, detach)
            .map_err(|e| match e {
                MountError::NotMounted { .. } => MountError::NotMounted {
                    target: target.to_path_buf(),
                },
                MountError::Unmount { errno, .. } => MountError::Unmount {
                    target: target.to_path_buf(),
                    errno,
                },
                e => e,
            })
    }

    fn enter_mount_namespace(&self, ns: BorrowedFd<'_>) -> Result<(), MountError> {
        setns(ns, CloneFlags::CLONE_NEWNS).map_err(|errno| MountError::Setns {
            fd: ns.as_raw_fd(),
            errno,
        })
    }

    fn open_tree_clone(&self, source: &Path, recursive: bool) -> Result<OwnedFd, MountError> {
        let c = cstring(source)?;
        let mut flags = OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC;
        if recursive {
            flags |= libc::AT_RECURSIVE as libc::c_uint;
        }
        // SAFETY: open_tree(int dfd, const char *path, unsigned flags): `c` is a valid NUL-terminated string
        // that outlives the call; the kernel does not keep the pointer.
        let ret = unsafe { libc::syscall(libc::SYS_open_tree, libc::AT_FDCWD, c.as_ptr(), flags) };
        if ret < 0 {
            return Err(MountError::OpenTree {
                source_path: source.to_path_buf(),
                errno: Errno::last(),
            });
        }
        // SAFETY: on success open_tree returns a new fd that nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(ret as libc::c_int) })
    }

    fn move_mount_to_fd(&self, from: BorrowedFd<'_>, to: BorrowedFd<'_>) -> Result<(), MountError> {
        let empty = c"";
        // SAFETY: move_mount(int from_dfd, const char *from_path, int to_dfd, const char *to_path,
        // unsigned flags): both fds are borrowed and open for the call, both paths are the static empty
        // C string.
        let ret = unsafe {
            libc::syscall(
                libc::SYS_move_mount,
                from.as_raw_fd(),
                empty.as_ptr(),
                to.as_raw_fd(),
                empty.as_ptr(),
                MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH,
            )
        };
        if ret < 0 {
            return Err(MountError::MoveMount {
                from: from.as_raw_fd(),
                to: to.as_raw_fd(),
                errno: Errno::last(),
            });
        }
        Ok(())
    }

    fn set_readonly_by_fd(&self, mount: BorrowedFd<'_>, recursive: bool) -> Result<(), MountError> {
        let attr = MountAttr {
            attr_set: MOUNT_ATTR_RDONLY,
            ..MountAttr::default()
        };
        mount_setattr(mount, &attr, recursive).map_err(|errno| MountError::MountSetattr {
            fd: mount.as_raw_fd(),
            errno,
        })
    }

    fn open_tree_clone_fd(
        &self,
        source: BorrowedFd<'_>,
        recursive: bool,
    ) -> Result<OwnedFd, MountError> {
        let mut flags = OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | libc::AT_EMPTY_PATH as libc::c_uint;
        if recursive {
            flags |= libc::AT_RECURSIVE as libc::c_uint;
        }
        let empty = c"";
        // SAFETY: open_tree(int dfd, const char *path, unsigned flags): the fd is borrowed for the call and
        // the path is the static empty string (AT_EMPTY_PATH: the fd's own object); the kernel keeps neither.
        let ret = unsafe {
            libc::syscall(
                libc::SYS_open_tree,
                source.as_raw_fd(),
                empty.as_ptr(),
                flags,
            )
        };
        if ret < 0 {
            let errno = Errno::last();
            return Err(MountError::OpenTree {
                source_path: fd_path(source).unwrap_or_else(|_| proc_fd_path(source)),
                errno,
            });
        }
        // SAFETY: on success open_tree returns a new fd that nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(ret as libc::c_int) })
    }

    fn change_mount_flags(
        &self,
        mount: BorrowedFd<'_>,
        set: MountFlags,
        clear: MountFlags,
        recursive: bool,
    ) -> Result<(), MountError> {
        // The access-time setting is one field: changing it clears the whole mask (a cleared
        // noatime goes back to relatime, the kernel's default).
        let atime = if set.noatime || clear.noatime {
            MOUNT_ATTR_ATIME_MASK
        } else {
            0
        };
        let attr = MountAttr {
            attr_set: mount_attr_bits(set),
            attr_clr: (mount_attr_bits(clear) & !MOUNT_ATTR_NOATIME) | atime,
            ..MountAttr::default()
        };
        mount_setattr(mount, &attr, recursive).map_err(|errno| MountError::ChangeFlags {
            mount: fd_path(mount).unwrap_or_else(|_| proc_fd_path(mount)),
            change: describe_change(set, clear),
            errno,
        })
    }

    fn set_propagation_by_fd(
        &self,
        mount: BorrowedFd<'_>,
        propagation: Propagation,
        recursive: bool,
    ) -> Result<(), MountError> {
        let bits = match propagation {
            Propagation::Private => MsFlags::MS_PRIVATE,
            Propagation::Slave => MsFlags::MS_SLAVE,
            Propagation::Shared => MsFlags::MS_SHARED,
            Propagation::Unbindable => MsFlags::MS_UNBINDABLE,
        };
        let attr = MountAttr {
            propagation: bits.bits(),
            ..MountAttr::default()
        };
        mount_setattr(mount, &attr, recursive).map_err(|errno| MountError::Propagation {
            target: fd_path(mount).unwrap_or_else(|_| proc_fd_path(mount)),
            propagation: propagation.as_str(),
            errno,
        })
    }

    fn remount_bind_with(
        &self,
        target: &Path,
        set: MountFlags,
        clear: MountFlags,
    ) -> Result<(), MountError> {
        let to_ms = |f: MountFlags| {
            let mut ms = MsFlags::empty();
            ms.set(MsFlags::MS_RDONLY, f.readonly);
            ms.set(MsFlags::MS_NOSUID, f.nosuid);
            ms.set(MsFlags::MS_NODEV, f.nodev);
            ms.set(MsFlags::MS_NOEXEC, f.noexec);
            ms.set(MsFlags::MS_NOATIME, f.noatime);
            ms
        };
        let mut flags = (kept_flags_of(target, true)? | to_ms(set)) - to_ms(clear);
        if set.noatime {
            // One access-time setting at a time: noatime replaces relatime.
            flags -= MsFlags::MS_RELATIME;
        }
        mount(
            None::<&str>,
            target,
            None::<&str>,
            MsFlags::MS_REMOUNT | MsFlags::MS_BIND | flags,
            None::<&str>,
        )
        .map_err(|errno| MountError::ChangeFlags {
            mount: target.to_path_buf(),
            change: describe_change(set, clear),
            errno,
        })
    }

    fn harden_mount_root(&self, path: &Path) -> Result<bool, MountError> {
        let err = |step, errno| MountError::Harden {
            path: path.to_path_buf(),
            step,
            errno,
        };
        // O_NOFOLLOW: a symlink at `path` is opened as itself, which is no mount root.
        let fd = match nix::fcntl::open(
            path,
            nix::fcntl::OFlag::O_PATH
                | nix::fcntl::OFlag::O_NOFOLLOW
                | nix::fcntl::OFlag::O_CLOEXEC,
            nix::sys::stat::Mode::empty(),
        ) {
            Ok(fd) => fd,
            Err(Errno::ENOENT) => return Ok(false),
            Err(errno) => return Err(err("open", errno)),
        };
        let is_root = match super::mountinfo::fd_mount_root(fd.as_fd()) {
            Ok(Some(answer)) => answer,
            // Before Linux 5.8: the mount table, at the path the kernel gives the fd.
            Ok(None) => {
                let at = fd_path(fd.as_fd())?;
                super::MountTable::is_mount_point(&super::ProcMountTable::new(), &at)?
            }
            Err(errno) => return Err(err("statx", errno)),
        };
        if !is_root {
            return Ok(false);
        }
        match self.change_mount_flags(fd.as_fd(), MountFlags::HOST_ONLY, MountFlags::NONE, true) {
            Ok(()) => {}
            // Before Linux 5.12: the same mount through its fd, by a bind remount (not recursive).
            Err(e) if e.errno() == Some(Errno::ENOSYS) => self.remount_bind_with(
                &proc_fd_path(fd.as_fd()),
                MountFlags::HOST_ONLY,
                MountFlags::NONE,
            )?,
            Err(e) => return Err(e),
        }
        Ok(true)
    }

    fn bind_mount_to_fd(
        &self,
        source: &Path,
        target: BorrowedFd<'_>,
        recursive: bool,
    ) -> Result<(), MountError> {
        let via = proc_fd_path(target);
        let shown = fd_path(target).unwrap_or_else(|_| via.clone());
        bind(source, &via, &shown, recursive)
    }

    fn pivot_root(&self, new_root: &Path, put_old: &Path) -> Result<(), MountError> {
        nix::unistd::pivot_root(new_root, put_old).map_err(|errno| MountError::PivotRoot {
            new_root: new_root.to_path_buf(),
            put_old: put_old.to_path_buf(),
            errno,
        })
    }
}
