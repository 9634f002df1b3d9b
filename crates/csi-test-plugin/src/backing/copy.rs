//! Copies of a volume's content: what a snapshot holds, and what a volume made from a snapshot
//! or cloned from another volume starts with.
//!
//! A volume directory and a snapshot directory have one layout (`data/`, `image.ext4` or
//! `image.raw`), so one copy serves snapshot, restore and clone.
//!
//! - Loop backing: the image file is copied sparse-aware (only its data extents, found with
//!   SEEK_DATA/SEEK_HOLE, through copy_file_range, which shares the extents on filesystems that
//!   can). When the source volume's filesystem is mounted (staged or published), it is frozen
//!   (FIFREEZE, by `fsfreeze`) for the copy, which makes the copy a consistent filesystem, and
//!   thawed after, whatever happened: an error or a panic thaws it (a guard), and a plugin
//!   killed meanwhile thaws it when it starts again ([`FREEZE_MARKER`],
//!   [`Backing::thaw_leftovers`]). A block volume has no filesystem to freeze: its copy is
//!   what the image held at each moment of the copy (stop writers for a consistent one).
//! - Dir backing: the tree is copied file by file while writers may go on (a plain directory
//!   cannot be frozen): a file written during the copy may be copied half-written, so a dir
//!   snapshot of a volume in use is not point-in-time. The tree is hostile (a container wrote
//!   it): it is walked by file descriptor, never following a symlink (symlinks are copied as
//!   symlinks), each opened file checked to be what was listed, to a bounded depth. Regular
//!   files, directories, symlinks, fifos and device nodes are copied with their owner, mode and
//!   modification time; sockets are skipped, hard links become separate files, extended
//!   attributes are not copied. Every copied file and directory is fsynced before the copy
//!   returns (a snapshot that was answered must keep its data after a power cut, not only its
//!   record); the image copy likewise.

use std::fs;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::Command;

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag};
use nix::sys::stat::{FileStat, Mode, SFlag};
use nix::unistd::{Gid, Uid, Whence};

use super::{io_step, Backing, BackingError, BackingKind, IoStep};

/// How deep a dir volume's tree may nest (each level holds two descriptors open).
pub const MAX_TREE_DEPTH: usize = 256;

/// The file in a volume's directory naming the mount point frozen for a copy: written (durably)
/// before the freeze, removed after the thaw, so a plugin killed in between thaws the volume
/// when it starts again.
pub const FREEZE_MARKER: &str = "frozen";

/// Thaws a frozen filesystem when dropped: an error or a panic in the copy never leaves it
/// frozen (a frozen filesystem blocks every writer of the volume).
struct Frozen {
    mount_point: PathBuf,
    marker: PathBuf,
}

impl Drop for Frozen {
    fn drop(&mut self) {
        match run("fsfreeze", &["-u".as_ref(), self.mount_point.as_os_str()]) {
            Ok(()) => {
                let _ = fs::remove_file(&self.marker);
            }
            // The marker stays: the next start tries again.
            Err(e) => {
                tracing::error!(mount_point = %self.mount_point.display(), error = %e, "thaw after a snapshot copy failed")
            }
        }
    }
}

/// Runs a tool of the backing (fsfreeze, losetup, e2fsck, resize2fs, xfs_growfs); its exit
/// status and stderr on failure.
pub(super) fn run(program: &str, args: &[&std::ffi::OsStr]) -> Result<(), BackingError> {
    let out = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| BackingError::Tool {
            program: program.to_string(),
            args: show_args(args),
            reason: format!("cannot run: {e}"),
        })?;
    if out.status.success() {
        return Ok(());
    }
    Err(BackingError::Tool {
        program: program.to_string(),
        args: show_args(args),
        reason: format!(
            "{}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ),
    })
}

fn show_args(args: &[&std::ffi::OsStr]) -> String {
    args.iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

impl Backing {
    /// Copies the content of the volume or snapshot in `src` into `dst` (made here, 0700),
    /// consistently as the module doc says; `quiesced` runs once the source is frozen (when it
    /// is), right before the copy (the fault injection's stall point). `dst` is left incomplete
    /// on error: the caller writes no record for it, and the store deletes such a directory.
    pub fn copy_content(
        &self,
        src: &Path,
        dst: &Path,
        quiesced: impl FnOnce(),
    ) -> Result<(), BackingError> {
        // Durable before the record written into it (see `made`): a snapshot or a volume made
        // from one that was answered must not vanish with its directory after a power cut.
        if let Some(parent) = dst.parent() {
            super::private_dir(parent).map_err(io_step("create directory", parent))?;
        }
        super::made::durable_dir(dst).map_err(io_step("create directory", dst))?;
        match self.kind {
            BackingKind::Dir => {
                quiesced();
                copy_tree(&Self::data_dir(src), &Self::data_dir(dst))
            }
            BackingKind::Loop => {
                let image = Self::image(src);
                let name = image.file_name().expect("an image path has a file name");
                let _frozen = self.freeze_if_mounted(src)?;
                quiesced();
                copy_image(&image, &dst.join(name))
            }
        }
    }

    /// Thaws what a killed plugin left frozen: the mount point each volume directory of
    /// `vol_dirs` names in its [`FREEZE_MARKER`] (a mount point that is not frozen, or gone,
    /// is fine).
    pub fn thaw_leftovers(&self, vol_dirs: impl Iterator<Item = PathBuf>) {
        for dir in vol_dirs {
            let marker = dir.join(FREEZE_MARKER);
            let Ok(bytes) = fs::read(&marker) else {
                continue;
            };
            let mount_point = PathBuf::from(std::ffi::OsStr::from_bytes(&bytes));
            match run("fsfreeze", &["-u".as_ref(), mount_point.as_os_str()]) {
                Ok(()) => {
                    tracing::info!(mount_point = %mount_point.display(), "thawed a volume a killed plugin left frozen")
                }
                Err(e) => {
                    tracing::info!(mount_point = %mount_point.display(), error = %e, "nothing to thaw after a killed snapshot copy")
                }
            }
            let _ = fs::remove_file(&marker);
        }
    }

    /// Freezes the filesystem of a loop volume (`vol_dir`) mounted somewhere, until the guard
    /// is dropped; `None` for a volume not mounted, and for a block volume (no filesystem).
    fn freeze_if_mounted(&self, vol_dir: &Path) -> Result<Option<Frozen>, BackingError> {
        if Self::is_block(vol_dir) {
            return Ok(None);
        }
        // Any mount of the volume: they all share one superblock, which is what freezes.
        let Some(mount) = self.volume_mounts(vol_dir)?.into_iter().next() else {
            return Ok(None);
        };
        let marker = vol_dir.join(FREEZE_MARKER);
        csi_isolator::durable::write_atomic(
            &marker,
            mount.mount_point.as_os_str().as_bytes(),
            csi_isolator::workdir::PRIVATE_FILE_MODE,
        )
        .map_err(|e| IoStep::new(e.step.as_str(), e.path, e.source))?;
        if let Err(e) = run("fsfreeze", &["-f".as_ref(), mount.mount_point.as_os_str()]) {
            let _ = fs::remove_file(&marker);
            return Err(e);
        }
        Ok(Some(Frozen {
            mount_point: mount.mount_point,
            marker,
        }))
    }
}

/// Copies an image file sparse-aware to a new file `dst` (0600) of the same length.
fn copy_image(src: &Path, dst: &Path) -> Result<(), BackingError> {
    let from = fs::File::open(src).map_err(io_step("open image", src))?;
    let len = from.metadata().map_err(io_step("stat image", src))?.len();
    let to = create_new(dst)?;
    copy_sparse(&from, &to, len).map_err(io_step("copy image to", dst))?;
    to.sync_all().map_err(io_step("fsync image copy", dst))?;
    Ok(())
}

fn create_new(path: &Path) -> Result<fs::File, BackingError> {
    use std::os::unix::fs::OpenOptionsExt;
    fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| io_step("create file", path)(e).into())
}

/// Copies the `len` bytes of `from` into `to` (empty): each data extent of `from`, holes left
/// holes; `to` ends `len` long.
fn copy_sparse(from: &fs::File, to: &fs::File, len: u64) -> io::Result<()> {
    let end = i64::try_from(len).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let mut pos = 0i64;
    while pos < end {
        let data = match nix::unistd::lseek(from, pos, Whence::SeekData) {
            Ok(data) => data,
            // No data after pos: the rest is a hole.
            Err(Errno::ENXIO) => break,
            Err(e) => return Err(e.into()),
        };
        let hole = nix::unistd::lseek(from, data, Whence::SeekHole)?.min(end);
        copy_range(from, to, data, hole)?;
        pos = hole;
    }
    to.set_len(len)
}

/// Copies bytes [start, end) of `from` to the same offsets of `to`: copy_file_range, or reads
/// and writes where the kernel cannot.
fn copy_range(from: &fs::File, to: &fs::File, start: i64, end: i64) -> io::Result<()> {
    use std::os::unix::fs::FileExt;
    let (mut off_in, mut off_out) = (start, start);
    while off_in < end {
        let want = usize::try_from(end - off_in).unwrap_or(usize::MAX);
        match nix::fcntl::copy_file_range(from, Some(&mut off_in), to, Some(&mut off_out), want) {
            // The file shrank under the copy: what is left reads as a hole.
            Ok(0) => return Ok(()),
            Ok(_) => {}
            Err(Errno::EXDEV | Errno::ENOSYS | Errno::EOPNOTSUPP | Errno::EINVAL) => {
                let mut buf = vec![0u8; 1 << 20];
                while off_in < end {
                    let want = buf
                        .len()
                        .min(usize::try_from(end - off_in).unwrap_or(buf.len()));
                    let n = from.read_at(&mut buf[..want], off_in as u64)?;
                    if n == 0 {
                        return Ok(());
                    }
                    to.write_all_at(&buf[..n], off_in as u64)?;
                    off_in += n as i64;
                }
                return Ok(());
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Copies the tree at `src` (a dir volume's data directory) to `dst` (made here), as the
/// module doc says.
fn copy_tree(src: &Path, dst: &Path) -> Result<(), BackingError> {
    let dir_flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let from = nix::fcntl::open(src, dir_flags, Mode::empty())
        .map_err(|e| io_step("open data directory", src)(e.into()))?;
    let stat = nix::sys::stat::fstat(&from).map_err(|e| io_step("stat", src)(e.into()))?;
    fs::create_dir(dst).map_err(io_step("create data directory", dst))?;
    let to = nix::fcntl::open(dst, dir_flags, Mode::empty())
        .map_err(|e| io_step("open data directory", dst)(e.into()))?;
    copy_dir(&from, &to, src, 0)?;
    set_attributes(&to, &stat, dst)?;
    sync_copy(&to, dst)
}

/// Makes a copied file or directory (its data, attributes and, for a directory, its entries)
/// durable: a snapshot or clone that CreateSnapshot/CreateVolume answered must hold its data
/// after a power cut, not only its record. The caller makes the top directory's own entry
/// durable.
fn sync_copy(fd: &OwnedFd, path: &Path) -> Result<(), BackingError> {
    nix::unistd::fsync(fd).map_err(|e| BackingError::from(io_step("fsync copy", path)(e.into())))
}

/// Copies the entries of directory `from` into the empty directory `to`; `shown` names
/// `from` in errors.
fn copy_dir(from: &OwnedFd, to: &OwnedFd, shown: &Path, depth: usize) -> Result<(), BackingError> {
    if depth >= MAX_TREE_DEPTH {
        return Err(IoStep::new(
            "copy directory (deeper than the copy allows)",
            shown,
            io::Error::other(format!("more than {MAX_TREE_DEPTH} levels")),
        )
        .into());
    }
    let listed = from
        .try_clone()
        .map_err(io_step("duplicate descriptor of", shown))?;
    let mut dir =
        nix::dir::Dir::from_fd(listed).map_err(|e| io_step("list directory", shown)(e.into()))?;
    let names: Vec<std::ffi::CString> = dir
        .iter()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_owned())
        .filter(|n| n.as_bytes() != b"." && n.as_bytes() != b"..")
        .collect();
    for name in names {
        let path = shown.join(std::ffi::OsStr::from_bytes(name.as_bytes()));
        copy_entry(from, to, &name, &path, depth)?;
    }
    Ok(())
}

use std::os::unix::ffi::OsStrExt;

fn copy_entry(
    from: &OwnedFd,
    to: &OwnedFd,
    name: &std::ffi::CStr,
    path: &Path,
    depth: usize,
) -> Result<(), BackingError> {
    let err =
        |step: &'static str| move |e: Errno| BackingError::from(io_step(step, path)(e.into()));
    let stat = match nix::sys::stat::fstatat(from, name, AtFlags::AT_SYMLINK_NOFOLLOW) {
        Ok(stat) => stat,
        // Removed since it was listed.
        Err(Errno::ENOENT) => return Ok(()),
        Err(e) => return Err(err("stat")(e)),
    };
    let kind = SFlag::from_bits_truncate(stat.st_mode & SFlag::S_IFMT.bits());
    let perm = Mode::from_bits_truncate(stat.st_mode & 0o7777);
    match kind {
        SFlag::S_IFDIR => {
            let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
            let sub = nix::fcntl::openat(from, name, flags, Mode::empty())
                .map_err(err("open directory"))?;
            same_object(&sub, &stat, path)?;
            nix::sys::stat::mkdirat(to, name, Mode::S_IRWXU)
                .map_err(err("create directory copy of"))?;
            let sub_to = nix::fcntl::openat(to, name, flags, Mode::empty())
                .map_err(err("open directory copy of"))?;
            copy_dir(&sub, &sub_to, path, depth + 1)?;
            set_attributes(&sub_to, &stat, path)?;
            sync_copy(&sub_to, path)
        }
        SFlag::S_IFREG => {
            // O_NONBLOCK: an entry swapped for a fifo since the stat must not hang the copy.
            let flags = OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC;
            let file =
                nix::fcntl::openat(from, name, flags, Mode::empty()).map_err(err("open file"))?;
            same_object(&file, &stat, path)?;
            let copy = nix::fcntl::openat(
                to,
                name,
                OFlag::O_WRONLY
                    | OFlag::O_CREAT
                    | OFlag::O_EXCL
                    | OFlag::O_NOFOLLOW
                    | OFlag::O_CLOEXEC,
                Mode::S_IRUSR | Mode::S_IWUSR,
            )
            .map_err(err("create file copy of"))?;
            let (file, copy) = (fs::File::from(file), fs::File::from(copy));
            copy_sparse(&file, &copy, stat.st_size as u64).map_err(io_step("copy file", path))?;
            let copy = OwnedFd::from(copy);
            set_attributes(&copy, &stat, path)?;
            sync_copy(&copy, path)
        }
        SFlag::S_IFLNK => {
            let target = nix::fcntl::readlinkat(from, name).map_err(err("read symlink"))?;
            nix::unistd::symlinkat(target.as_os_str(), to, name)
                .map_err(err("create symlink copy of"))?;
            nix::unistd::fchownat(
                to,
                name,
                Some(Uid::from_raw(stat.st_uid)),
                Some(Gid::from_raw(stat.st_gid)),
                AtFlags::AT_SYMLINK_NOFOLLOW,
            )
            .map_err(err("set owner of symlink copy of"))
        }
        SFlag::S_IFIFO | SFlag::S_IFCHR | SFlag::S_IFBLK => {
            nix::sys::stat::mknodat(to, name, kind, perm, stat.st_rdev)
                .map_err(err("create node copy of"))?;
            nix::unistd::fchownat(
                to,
                name,
                Some(Uid::from_raw(stat.st_uid)),
                Some(Gid::from_raw(stat.st_gid)),
                AtFlags::AT_SYMLINK_NOFOLLOW,
            )
            .map_err(err("set owner of node copy of"))?;
            nix::sys::stat::fchmodat(to, name, perm, nix::sys::stat::FchmodatFlags::FollowSymlink)
                .map_err(err("set mode of node copy of"))
        }
        _ => {
            tracing::info!(path = %path.display(), "snapshot copy skips a socket");
            Ok(())
        }
    }
}

/// The opened `fd` must be the object `stat` described (not one swapped in since).
fn same_object(fd: &OwnedFd, stat: &FileStat, path: &Path) -> Result<(), BackingError> {
    let now = nix::sys::stat::fstat(fd).map_err(|e| io_step("stat", path)(e.into()))?;
    if (now.st_dev, now.st_ino) != (stat.st_dev, stat.st_ino) {
        return Err(IoStep::new(
            "copy (entry replaced during the copy)",
            path,
            io::Error::from(io::ErrorKind::Interrupted),
        )
        .into());
    }
    Ok(())
}

/// Gives a copy (open as `fd`) the owner, mode and times of `stat` (owner first: a chown
/// clears set-id bits).
fn set_attributes(fd: &OwnedFd, stat: &FileStat, path: &Path) -> Result<(), BackingError> {
    let err =
        |step: &'static str| move |e: Errno| BackingError::from(io_step(step, path)(e.into()));
    nix::unistd::fchown(
        fd.as_fd(),
        Some(Uid::from_raw(stat.st_uid)),
        Some(Gid::from_raw(stat.st_gid)),
    )
    .map_err(err("set owner of the copy of"))?;
    nix::sys::stat::fchmod(fd.as_fd(), Mode::from_bits_truncate(stat.st_mode & 0o7777))
        .map_err(err("set mode of the copy of"))?;
    let atime = nix::sys::time::TimeSpec::new(stat.st_atime, stat.st_atime_nsec);
    let mtime = nix::sys::time::TimeSpec::new(stat.st_mtime, stat.st_mtime_nsec);
    nix::sys::stat::futimens(fd.as_fd(), &atime, &mtime).map_err(err("set times of the copy of"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    #[test]
    fn a_sparse_copy_keeps_data_and_holes() {
        let dir = tempfile::tempdir().unwrap();
        let (src, dst) = (dir.path().join("src"), dir.path().join("dst"));
        let file = fs::File::create(&src).unwrap();
        file.set_len(64 << 20).unwrap();
        use std::os::unix::fs::FileExt;
        file.write_all_at(b"head", 0).unwrap();
        file.write_all_at(b"middle", 32 << 20).unwrap();
        drop(file);
        copy_image(&src, &dst).unwrap();
        assert_eq!(fs::read(&src).unwrap(), fs::read(&dst).unwrap());
        let meta = fs::metadata(&dst).unwrap();
        assert_eq!(meta.len(), 64 << 20);
        assert!(
            meta.blocks() * 512 < 4 << 20,
            "holes stay holes: {} blocks",
            meta.blocks()
        );
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        assert!(copy_image(&src, &dst).is_err(), "never overwrites");
    }

    #[test]
    fn a_tree_copy_keeps_symlinks_as_symlinks_and_files_modes() {
        let dir = tempfile::tempdir().unwrap();
        let (src, dst) = (dir.path().join("src"), dir.path().join("dst"));
        fs::create_dir_all(src.join("a/b")).unwrap();
        fs::write(src.join("a/b/f"), b"data").unwrap();
        fs::set_permissions(src.join("a/b/f"), fs::Permissions::from_mode(0o640)).unwrap();
        // A link out of the tree: copied as a link, never followed.
        std::os::unix::fs::symlink("/etc/passwd", src.join("a/out")).unwrap();
        std::os::unix::fs::symlink("/etc", src.join("etc")).unwrap();
        nix::unistd::mkfifo(&src.join("fifo"), Mode::from_bits_truncate(0o600)).unwrap();
        copy_tree(&src, &dst).unwrap();
        assert_eq!(fs::read(dst.join("a/b/f")).unwrap(), b"data");
        assert_eq!(
            fs::metadata(dst.join("a/b/f"))
                .unwrap()
                .permissions()
                .mode()
                & 0o777,
            0o640
        );
        assert_eq!(
            fs::read_link(dst.join("a/out")).unwrap(),
            Path::new("/etc/passwd")
        );
        assert!(fs::symlink_metadata(dst.join("etc")).unwrap().is_symlink());
        use std::os::unix::fs::FileTypeExt;
        assert!(fs::symlink_metadata(dst.join("fifo"))
            .unwrap()
            .file_type()
            .is_fifo());
    }

    #[test]
    fn a_tree_deeper_than_the_bound_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (src, dst) = (dir.path().join("src"), dir.path().join("dst"));
        let mut deep = src.clone();
        for _ in 0..=MAX_TREE_DEPTH {
            deep.push("d");
        }
        fs::create_dir_all(&deep).unwrap();
        let err = copy_tree(&src, &dst).unwrap_err().to_string();
        assert!(err.contains("deeper than the copy allows"), "{err}");
    }
}
