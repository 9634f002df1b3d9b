//! How a volume's bytes are stored and made visible at staging and target paths.
//!
//! - [`BackingKind::Dir`]: the volume is the directory `<volume dir>/data`; staging and
//!   publishing are bind mounts of it.
//! - [`BackingKind::Loop`]: the volume is the sparse ext4 image `<volume dir>/image.ext4`
//!   (made by `mkfs.ext4` at create). It is attached to a loop device and mounted where it
//!   is first needed (the staging path, or the target without STAGE_UNSTAGE_VOLUME); every
//!   further use mounts that same loop device again, which shares the one superblock (two
//!   ext4 instances of one image through two loop devices would corrupt it).
//!   The loop device is detached when the volume's last mount goes away.
//! - A block volume (created for CSI's block access type; loop backing only) is the sparse raw
//!   image `<volume dir>/image.raw`, without a filesystem. Staging attaches it to a loop device
//!   (kept attached after its last close: a bind of its node holds nothing open) and binds the
//!   device node onto the file `<staging>/device`; publishing makes the target a file and binds
//!   that (or, without staging, the device itself) onto it. The device is detached when no bind
//!   of it is left. A bind of a device node shows in the mount table as the filesystem holding the
//!   node (devtmpfs) with the node's path as its root, which is how such mounts are told apart.
//!
//! Whether a path holds "this volume" is read from the kernel's mount table: a dir volume's
//! mount is one of the filesystem holding the data directory (the device of the mount that
//! contains it) whose root (the mountinfo `root` field: the mounted directory, relative to
//! its filesystem) is the data directory. Device numbers from stat() are not used: on btrfs a
//! subvolume's st_dev differs from the device the mount table shows. A loop volume's mount is
//! one whose device is a loop device backed by the volume's image.
//!
//! Every mount made here (binds and the ext4 mount) carries nosuid,nodev: it is a host path to data a
//! container writes. The directories made here are 0700, except the data directory, which is the
//! volume's root as containers see it.
//!
//! Unmounting only ever removes this volume's mounts: it stops at a mount that is not the
//! volume's, and a mount that stays busy (open files, a working directory in it) after a few
//! retries is reported as [`BackingError::Busy`], never detached lazily (a lazily detached
//! volume would still be in use while the plugin reports it gone and lets it be deleted).

use csi_isolator::io_step::{io_step, IoStep};
use std::fs;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use nix::errno::Errno;

use csi_isolator::mount::{
    loopdev, proc_fd_path, LinuxSyscall, MountError, MountFlags, MountInfo, MountTable,
    ProcMountTable, Syscall,
};

mod copy;
mod grow;
pub(crate) mod made;

/// How volumes are backed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackingKind {
    /// A directory per volume.
    Dir,
    /// An ext4 image per volume, on a loop device.
    Loop,
}

impl BackingKind {
    /// The command-line spelling (`dir`, `loop`).
    pub fn as_str(self) -> &'static str {
        match self {
            BackingKind::Dir => "dir",
            BackingKind::Loop => "loop",
        }
    }
}

impl std::str::FromStr for BackingKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "dir" => Ok(BackingKind::Dir),
            "loop" => Ok(BackingKind::Loop),
            other => Err(format!("unknown backing '{other}' (expected dir or loop)")),
        }
    }
}

/// Smallest ext4 image the loop backing makes (room for the journal).
pub const MIN_LOOP_BYTES: u64 = 8 << 20;

/// Unmount attempts while a mount is busy, and the pause between them.
const UNMOUNT_ATTEMPTS: u32 = 5;
const UNMOUNT_PAUSE: Duration = Duration::from_millis(50);

/// Errors of the backing, one per step.
#[derive(Debug, thiserror::Error)]
pub enum BackingError {
    /// A filesystem operation on the volume's files failed.
    #[error(transparent)]
    Io(#[from] IoStep),
    /// mkfs could not run or failed.
    #[error("{program} {path}: {reason}")]
    Mkfs {
        /// The program (`mkfs.ext4`, `mkfs.xfs`, ...).
        program: String,
        /// The image.
        path: PathBuf,
        /// Its exit status and stderr, or why it did not start.
        reason: String,
    },
    /// A tool of snapshots and expansion (fsfreeze, losetup, e2fsck, resize2fs, xfs_growfs)
    /// could not run or failed.
    #[error("{program} {args}: {reason}")]
    Tool {
        /// The program.
        program: String,
        /// Its arguments.
        args: String,
        /// Its exit status and stderr, or why it did not start.
        reason: String,
    },
    /// The mount at a path stayed busy (in use) through every unmount attempt.
    #[error("unmount {path}: still busy after {attempts} attempts (the volume is in use)")]
    Busy {
        /// The mount point.
        path: PathBuf,
        /// Attempts made.
        attempts: u32,
    },
    /// The data directory is on no mount of the mount table.
    #[error("find the mount holding data directory {path}: none")]
    NoContainingMount {
        /// The data directory.
        path: PathBuf,
    },
    /// A mount that is not the volume's covers one of the volume's mounts at a path.
    #[error("{path}: a mount that is not this volume ({what}) covers a mount of the volume")]
    Covered {
        /// The mount point.
        path: PathBuf,
        /// What covers it.
        what: String,
    },
    /// A block volume asked of the dir backing, or read-only, which this plugin does not serve.
    #[error("{what} is not served by this backing")]
    BlockNotServed {
        /// What was asked.
        what: &'static str,
    },
    /// A mount-layer call failed.
    #[error("{step} {path}")]
    Mount {
        /// The step.
        step: &'static str,
        /// The path.
        path: PathBuf,
        /// The underlying error (boxed: mount errors are large).
        #[source]
        source: Box<MountError>,
    },
    /// The volume's storage (its data directory or image) is not what this plugin makes: a
    /// symbolic link, another kind of file, a file of several names. Never mounted.
    #[error("{path} is {what}, not the volume's {expected}: refused (remove it; only the plugin that created the volume writes there)")]
    UnsafeStorage {
        /// The data directory or image.
        path: PathBuf,
        /// What it is.
        what: String,
        /// What it must be.
        expected: &'static str,
    },
}

/// Opens a volume's image to attach it: without following a symbolic link or blocking on a
/// FIFO, and only a regular file of one name (not a device, not another file hard-linked in):
/// the loop device is attached to this very fd.
/// A filesystem volume's image in its directory (a block volume's is `image.raw`).
const FS_IMAGE: &str = "image.ext4";

fn open_image(image: &Path) -> Result<fs::File, BackingError> {
    let unsafe_image = |what: String| BackingError::UnsafeStorage {
        path: image.to_path_buf(),
        what,
        expected: "image (a regular file)",
    };
    let file = fs::File::options()
        .read(true)
        .write(true)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK | nix::libc::O_CLOEXEC)
        .open(image)
        .map_err(|e| match e.raw_os_error() {
            Some(nix::libc::ELOOP) => unsafe_image("a symbolic link".into()),
            _ => BackingError::Io(IoStep::new("open image", image, e)),
        })?;
    let meta = file.metadata().map_err(io_step("stat image", image))?;
    match storage_problem(&meta, false) {
        Some(what) => Err(unsafe_image(what)),
        None => Ok(file),
    }
}

/// Opens a volume's data directory as an O_PATH fd, following no symbolic link beneath the
/// volume's directory: what a bind of it through `/proc/self/fd/N` shows is this directory.
fn open_data_dir(vol_dir: &Path) -> Result<OwnedFd, BackingError> {
    let data = Backing::data_dir(vol_dir);
    let unsafe_data = |what: String| BackingError::UnsafeStorage {
        path: data.clone(),
        what,
        expected: "data directory",
    };
    if let Some(what) = fs::symlink_metadata(&data)
        .ok()
        .and_then(|m| storage_problem(&m, true))
    {
        return Err(unsafe_data(what));
    }
    csi_isolator::mount::open_beneath_no_symlinks(vol_dir, Path::new("data")).map_err(|e| match e {
        MountError::SymlinkBeneath { .. } => unsafe_data("a symbolic link".into()),
        e => mount_err("open data directory", &data)(e),
    })
}

/// Checks, without following a symbolic link, that whichever of a volume's storage entries
/// exist (the data directory, the filesystem image, the raw image) are what the plugin makes:
/// for a volume directory another plugin wrote (a node plugin's look at the shared dir).
pub(crate) fn check_storage(vol_dir: &Path) -> Result<(), BackingError> {
    let entries = [
        (Backing::data_dir(vol_dir), true),
        (vol_dir.join(FS_IMAGE), false),
        (Backing::raw_image(vol_dir), false),
    ];
    for (path, dir) in entries {
        let meta = match fs::symlink_metadata(&path) {
            Ok(meta) => meta,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(BackingError::Io(IoStep::new("stat", path, e))),
        };
        if let Some(what) = storage_problem(&meta, dir) {
            return Err(BackingError::UnsafeStorage {
                path,
                what,
                expected: if dir {
                    "data directory"
                } else {
                    "image (a regular file)"
                },
            });
        }
    }
    Ok(())
}

/// What is wrong with a volume's storage of metadata `meta` (not followed), a directory if
/// `dir`, else an image: `None` when it is what the plugin makes.
pub(crate) fn storage_problem(meta: &fs::Metadata, dir: bool) -> Option<String> {
    let kind = meta.file_type();
    let what = if kind.is_symlink() {
        "a symbolic link"
    } else if dir && !kind.is_dir() {
        "not a directory"
    } else if dir {
        return None;
    } else if !kind.is_file() {
        "not a regular file (a device, FIFO, socket or directory)"
    } else if meta.nlink() != 1 {
        return Some(format!("a file of {} hard links", meta.nlink()));
    } else {
        return None;
    };
    Some(what.into())
}

fn mount_err(step: &'static str, path: &Path) -> impl FnOnce(MountError) -> BackingError {
    let path = path.to_path_buf();
    move |source| BackingError::Mount {
        step,
        path,
        source: Box::new(source),
    }
}

/// What is mounted at a path, relative to one volume.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MountState {
    /// Nothing (or the path does not exist).
    NotMounted,
    /// The volume, read-only or not.
    Volume {
        /// Whether the topmost mount is read-only.
        readonly: bool,
    },
    /// Something else.
    Other(String),
}

/// How the kernel identifies a volume's mounts.
enum Identity {
    /// The device of the filesystem holding the data directory (as the mount table shows
    /// it) and the data directory's path inside that filesystem.
    Dir {
        major: u32,
        minor: u32,
        root: PathBuf,
    },
    /// (major, minor) of the mounted loop devices backed by the image.
    Loop { devices: Vec<(u32, u32)> },
    /// Binds of a block volume's loop device nodes: the mount holding each node (as the mount
    /// table shows it) and the node's path inside it.
    Block { nodes: Vec<(u32, u32, PathBuf)> },
}

/// The mount through which `path` (canonical) is reached: the deepest mount point above it, the
/// topmost mount (last in table order) there; with `path`'s place inside that filesystem.
fn containing(mounts: &[MountInfo], path: &Path) -> Option<(u32, u32, PathBuf)> {
    let (_, m) = mounts
        .iter()
        .enumerate()
        .filter(|(_, m)| path.starts_with(&m.mount_point))
        .max_by_key(|(i, m)| (m.mount_point.components().count(), *i))?;
    let inside = path.strip_prefix(&m.mount_point).unwrap_or(Path::new(""));
    Some((m.major, m.minor, m.root.join(inside)))
}

/// The file in a block volume's staging directory its device is bound onto.
pub const STAGED_DEVICE: &str = "device";

fn describe(m: &MountInfo) -> String {
    format!("{} {} from {}", m.fs_type, m.root.display(), m.source)
}

fn split_dev(dev: u64) -> (u32, u32) {
    // glibc's encoding of dev_t (gnu_dev_major / gnu_dev_minor).
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    (major as u32, minor as u32)
}

/// The backing of every volume of one plugin.
#[derive(Debug)]
pub struct Backing {
    kind: BackingKind,
    sys: LinuxSyscall,
    table: ProcMountTable,
}

impl Backing {
    /// A backing of `kind` on the real kernel.
    pub fn new(kind: BackingKind) -> Backing {
        Backing {
            kind,
            sys: LinuxSyscall,
            table: ProcMountTable::new(),
        }
    }

    /// The kind of backing.
    pub fn kind(&self) -> BackingKind {
        self.kind
    }

    /// The size a volume gets for a request of `required` bytes (0: no minimum).
    pub fn size_for(&self, required: u64) -> u64 {
        const DEFAULT: u64 = 64 << 20;
        let wanted = if required == 0 { DEFAULT } else { required };
        match self.kind {
            BackingKind::Dir => wanted,
            BackingKind::Loop => wanted.max(MIN_LOOP_BYTES),
        }
    }

    /// Whether a volume of this backing holds at most its capacity: the loop backing's
    /// ext4 image does; a dir volume is a plain directory on the work dir's filesystem,
    /// which nothing holds to its size.
    pub fn enforces_capacity(kind: BackingKind) -> bool {
        match kind {
            BackingKind::Dir => false,
            BackingKind::Loop => true,
        }
    }

    /// Bytes of a `kind` volume in `vol_dir` of `capacity` bytes that its sparse image
    /// may still take from the work dir's filesystem: its capacity less what the image
    /// already occupies. 0 for dir volumes (they promise nothing). An image that cannot
    /// be looked at counts as not allocated at all.
    pub fn unallocated_bytes(kind: BackingKind, vol_dir: &Path, capacity: u64) -> u64 {
        match kind {
            BackingKind::Dir => 0,
            BackingKind::Loop => {
                let allocated = fs::symlink_metadata(Self::image(vol_dir))
                    .map(|m| m.blocks().saturating_mul(512))
                    .unwrap_or(0);
                capacity.saturating_sub(allocated)
            }
        }
    }

    fn data_dir(vol_dir: &Path) -> PathBuf {
        vol_dir.join("data")
    }

    fn raw_image(vol_dir: &Path) -> PathBuf {
        vol_dir.join("image.raw")
    }

    fn image(vol_dir: &Path) -> PathBuf {
        if Self::is_block(vol_dir) {
            return Self::raw_image(vol_dir);
        }
        vol_dir.join(FS_IMAGE)
    }

    /// What holds the volume's data: the data directory (dir backing) or the image (loop
    /// backing); the volume condition calls the volume abnormal when it is gone.
    pub fn storage_path(&self, vol_dir: &Path) -> PathBuf {
        match self.kind {
            BackingKind::Dir => Self::data_dir(vol_dir),
            BackingKind::Loop => Self::image(vol_dir),
        }
    }

    /// Whether the volume in `vol_dir` is a block volume (a raw image, no filesystem).
    pub fn is_block(vol_dir: &Path) -> bool {
        fs::symlink_metadata(Self::raw_image(vol_dir)).is_ok()
    }

    /// Where a volume staged at `staging` shows: the staging directory itself, or for a block
    /// volume the device file in it.
    pub fn staged_path(vol_dir: &Path, staging: &Path) -> PathBuf {
        if Self::is_block(vol_dir) {
            staging.join(STAGED_DEVICE)
        } else {
            staging.to_path_buf()
        }
    }

    /// Creates the volume's storage in `vol_dir` (replacing leftovers of an interrupted
    /// create): for a `block` volume a raw image (loop backing only, no filesystem), otherwise
    /// the backing's filesystem; a loop volume's image gets a filesystem of `fs_type` (checked
    /// by the caller against [`fs_types`]).
    pub fn provision(
        &self,
        vol_dir: &Path,
        capacity: u64,
        fs_type: &str,
        block: bool,
    ) -> Result<(), BackingError> {
        if block && self.kind != BackingKind::Loop {
            return Err(BackingError::BlockNotServed {
                what: "block access",
            });
        }
        // Durable before the record is written (see `made`): a CreateVolume that answered must
        // not leave, after a power cut, a record without its directory or its image.
        if let Some(parent) = vol_dir.parent() {
            private_dir(parent).map_err(io_step("create volumes directory", parent))?;
        }
        made::durable_dir(vol_dir).map_err(io_step("create volume directory", vol_dir))?;
        if block {
            let image = Self::raw_image(vol_dir);
            drop(made::create_image(&image, capacity).map_err(io_step("create image", &image))?);
            made::sync_image(&image).map_err(io_step("fsync image", &image))?;
            return Ok(());
        }
        match self.kind {
            BackingKind::Dir => {
                // The volume's root as containers see it: its mode stays the usual one (0755 under
                // the usual umask); the 0700 volume directory above it keeps host users out.
                let data = Self::data_dir(vol_dir);
                Ok(made::data_dir(&data).map_err(io_step("create data directory", &data))?)
            }
            BackingKind::Loop => {
                let image = Self::image(vol_dir);
                drop(
                    made::create_image(&image, capacity)
                        .map_err(io_step("create image", &image))?,
                );
                let program = mkfs_program(fs_type);
                let mut mkfs = Command::new(&program);
                if fs_type.starts_with("ext") {
                    // Lazy inode-table and journal init and no discard: the image is a new sparse
                    // file, so what they would zero already reads as zeros, and mkfs writes a few
                    // hundred KiB instead of the whole tables (about 20 ms against 125 ms for 64
                    // MiB). No reserved blocks: the workload gets the whole capacity.
                    mkfs.args([
                        "-q",
                        "-F",
                        "-m",
                        "0",
                        "-E",
                        "lazy_itable_init=1,lazy_journal_init=1,nodiscard",
                    ]);
                } else {
                    // xfs: quiet, over the empty image, no discard.
                    mkfs.args(["-q", "-f", "-K"]);
                }
                let out = mkfs.arg(&image).output().map_err(|e| BackingError::Mkfs {
                    program: program.clone(),
                    path: image.clone(),
                    reason: format!("cannot run: {e}"),
                })?;
                if !out.status.success() {
                    return Err(BackingError::Mkfs {
                        program,
                        path: image,
                        reason: format!(
                            "{}: {}",
                            out.status,
                            String::from_utf8_lossy(&out.stderr).trim()
                        ),
                    });
                }
                Ok(made::sync_image(&image).map_err(io_step("fsync image", &image))?)
            }
        }
    }

    /// The volume's identity, given the current mount table.
    fn identity(&self, vol_dir: &Path, mounts: &[MountInfo]) -> Result<Identity, BackingError> {
        match self.kind {
            BackingKind::Dir => {
                let data = Self::data_dir(vol_dir);
                let data =
                    fs::canonicalize(&data).map_err(io_step("resolve data directory", &data))?;
                let (major, minor, root) = containing(mounts, &data)
                    .ok_or_else(|| BackingError::NoContainingMount { path: data.clone() })?;
                Ok(Identity::Dir { major, minor, root })
            }
            BackingKind::Loop if Self::is_block(vol_dir) => {
                let mut nodes = Vec::new();
                for dev in self.loop_devices(vol_dir)? {
                    match fs::canonicalize(&dev) {
                        Ok(node) => nodes.extend(containing(mounts, &node)),
                        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                        Err(e) => return Err(io_step("resolve loop device", &dev)(e).into()),
                    }
                }
                Ok(Identity::Block { nodes })
            }
            BackingKind::Loop => {
                // The devices of the mounted filesystems, each asked of sysfs whether the image
                // backs it: one read per device mounted on the node, not a scan of every loop
                // device node the host has made (those are never removed, and grow with every
                // attach that finds none free).
                let image = Self::image(vol_dir);
                let wanted = [
                    fs::canonicalize(&image).unwrap_or_else(|_| image.clone()),
                    image,
                ];
                let mut seen = std::collections::BTreeSet::new();
                let devices = mounts
                    .iter()
                    .map(|m| (m.major, m.minor))
                    .filter(|dev| seen.insert(*dev))
                    .filter(|&(major, minor)| {
                        loopdev::backing_file_of(major, minor)
                            .is_some_and(|backing| wanted.contains(&backing))
                    })
                    .collect();
                Ok(Identity::Loop { devices })
            }
        }
    }

    fn loop_devices(&self, vol_dir: &Path) -> Result<Vec<PathBuf>, BackingError> {
        let image = Self::image(vol_dir);
        let image = fs::canonicalize(&image).unwrap_or(image);
        loopdev::find_by_backing_file(&image).map_err(mount_err("find loop devices of", &image))
    }

    fn is_volume(identity: &Identity, m: &MountInfo) -> bool {
        match identity {
            // Paths compare by components, so "/a/b/" and "/a/b" are equal.
            Identity::Dir { major, minor, root } => {
                (m.major, m.minor) == (*major, *minor) && m.root == *root
            }
            Identity::Loop { devices } => devices.contains(&(m.major, m.minor)),
            Identity::Block { nodes } => nodes.iter().any(|(major, minor, root)| {
                (m.major, m.minor) == (*major, *minor) && m.root == *root
            }),
        }
    }

    /// For the dir backing, when the mount root at `path` is a bind of the
    /// volume's data directory (the path shows the data directory's own
    /// inode), whether it is read-only; `None` otherwise (including the loop
    /// backing), and callers then read the mount table. This is what the
    /// table would say, without reading a table that grows with every mount
    /// on the node.
    fn shows_data_dir(&self, vol_dir: &Path, path: &Path) -> Option<bool> {
        if self.kind != BackingKind::Dir {
            return None;
        }
        let here = fs::symlink_metadata(path).ok()?;
        let data = fs::metadata(Self::data_dir(vol_dir)).ok()?;
        if (here.dev(), here.ino()) != (data.dev(), data.ino()) {
            return None;
        }
        let flags = nix::sys::statvfs::statvfs(path).ok()?.flags();
        Some(flags.contains(nix::sys::statvfs::FsFlags::ST_RDONLY))
    }

    /// For a mount volume of the loop backing, when the mount root at `path` is a filesystem on
    /// a loop device backed by the volume's image (the device `path` lives on, asked of sysfs:
    /// one read, not a scan of every loop device nor a read of the mount table), whether it is
    /// read-only; `None` otherwise, and callers then read the table. The table's answer is the
    /// same ([`Self::is_volume`] compares the mount's device with the image's loop devices).
    fn shows_loop_fs(&self, vol_dir: &Path, path: &Path) -> Option<bool> {
        if self.kind != BackingKind::Loop || Self::is_block(vol_dir) {
            return None;
        }
        let here = fs::symlink_metadata(path).ok()?;
        let (major, minor) = split_dev(here.dev());
        if !loopdev::is_backed_by(major, minor, &Self::image(vol_dir)) {
            return None;
        }
        let flags = nix::sys::statvfs::statvfs(path).ok()?.flags();
        Some(flags.contains(nix::sys::statvfs::FsFlags::ST_RDONLY))
    }

    fn is_mount_root(&self, path: &Path) -> Result<bool, BackingError> {
        self.table
            .is_mount_root(path)
            .map_err(mount_err("read mount table", &self.table.path()))
    }

    fn mounts(&self) -> Result<Vec<MountInfo>, BackingError> {
        self.table
            .mounts()
            .map_err(mount_err("read mount table", &self.table.path()))
    }

    /// Every mount of the volume, in table order.
    pub fn volume_mounts(&self, vol_dir: &Path) -> Result<Vec<MountInfo>, BackingError> {
        let mounts = self.mounts()?;
        let identity = self.identity(vol_dir, &mounts)?;
        Ok(mounts
            .into_iter()
            .filter(|m| Self::is_volume(&identity, m))
            .collect())
    }

    /// A mount of the volume other than at `except`: for the dir backing,
    /// checked at the volume's known targets (a statx and a stat each); for
    /// the loop backing, in the mount table.
    pub fn mounted_elsewhere(
        &self,
        vol_dir: &Path,
        targets: impl Iterator<Item = PathBuf>,
        except: &Path,
    ) -> Result<Option<PathBuf>, BackingError> {
        if self.kind == BackingKind::Dir {
            for t in targets {
                let t = fs::canonicalize(&t).unwrap_or(t);
                if t != except
                    && self.is_mount_root(&t)?
                    && self.shows_data_dir(vol_dir, &t).is_some()
                {
                    return Ok(Some(t));
                }
            }
            return Ok(None);
        }
        Ok(self
            .volume_mounts(vol_dir)?
            .into_iter()
            .map(|m| m.mount_point)
            .find(|p| p != except))
    }

    /// What is mounted at `path` (by its canonical form), relative to the volume.
    pub fn mount_state(&self, vol_dir: &Path, path: &Path) -> Result<MountState, BackingError> {
        if !path.is_absolute() {
            return Ok(MountState::NotMounted);
        }
        let Ok(path) = fs::canonicalize(path) else {
            return Ok(MountState::NotMounted);
        };
        // One statx answers "nothing mounted here" without parsing a table
        // that grows with every mount on the node.
        if !self.is_mount_root(&path)? {
            return Ok(MountState::NotMounted);
        }
        if let Some(readonly) = self
            .shows_data_dir(vol_dir, &path)
            .or_else(|| self.shows_loop_fs(vol_dir, &path))
        {
            return Ok(MountState::Volume { readonly });
        }
        let mounts = self.mounts()?;
        let Some(top) = mounts.iter().rev().find(|m| m.mount_point == path) else {
            return Ok(MountState::NotMounted);
        };
        if Self::is_volume(&self.identity(vol_dir, &mounts)?, top) {
            Ok(MountState::Volume {
                readonly: top.is_readonly(),
            })
        } else {
            Ok(MountState::Other(describe(top)))
        }
    }

    /// Makes a block volume's device appear at `file` (an existing file): a bind of the node of
    /// its loop device, attached first if it is not yet. On failure nothing stays attached
    /// that no bind uses.
    fn attach_device_at(&self, vol_dir: &Path, file: &Path) -> Result<(), BackingError> {
        let device = match self.loop_devices(vol_dir)?.into_iter().next() {
            Some(device) => device,
            None => {
                let image = Self::raw_image(vol_dir);
                let file = open_image(&image)?;
                // Dropped at once: kept attached without an opener.
                loopdev::attach_opened(file.as_fd(), &image, false, true)
                    .map_err(mount_err("attach loop device to", &image))?
                    .path
            }
        };
        let bound = self
            .sys
            .bind_mount(&device, file, false)
            .map_err(mount_err("bind loop device onto", file))
            .and_then(|()| self.harden_or_unmount(file));
        if bound.is_err() {
            let _ = self.release_if_unused(vol_dir);
        }
        bound
    }

    /// Makes the volume appear at `path` (an existing directory): a bind of the data
    /// directory, or of an existing mount of the image, or a fresh loop attach + mount of its
    /// `fs_type`; with the per-mount flags of `flags` (noexec, noatime; read-only is the
    /// caller's, after).
    fn attach_at(
        &self,
        vol_dir: &Path,
        path: &Path,
        fs_type: &str,
        flags: MountFlags,
    ) -> Result<(), BackingError> {
        let flags = MountFlags {
            readonly: false,
            ..flags.union(MountFlags::HOST_ONLY)
        };
        match self.kind {
            BackingKind::Dir => {
                // Bound through an fd opened without following a symbolic link: a `data` that
                // is (or became) a link to `/` is refused, never bound.
                let data = open_data_dir(vol_dir)?;
                self.sys
                    .bind_mount(&proc_fd_path(data.as_fd()), path, false)
                    .map_err(mount_err("bind data directory onto", path))?;
                self.harden_or_unmount(path)?;
                self.apply_or_unmount(path, flags)
            }
            BackingKind::Loop => {
                if let Some(existing) = self.volume_mounts(vol_dir)?.into_iter().next() {
                    // Mounting the device that is already mounted shares its superblock (one
                    // filesystem instance), and unlike a bind of an existing mount it does not
                    // inherit that mount's per-mount flags such as read-only.
                    let device = PathBuf::from(&existing.source);
                    return self
                        .sys
                        .mount_filesystem(&device, path, &existing.fs_type, flags, "")
                        .map_err(mount_err("mount already attached filesystem onto", path));
                }
                let image = Self::image(vol_dir);
                let file = open_image(&image)?;
                let dev = loopdev::attach_opened(file.as_fd(), &image, false, false)
                    .map_err(mount_err("attach loop device to", &image))?;
                // xfs refuses a filesystem whose UUID a mounted one has, and every snapshot and
                // clone of a mounted volume is such a copy: nouuid, as CSI drivers for xfs do.
                let data = if fs_type == "xfs" { "nouuid" } else { "" };
                if let Err(e) = self
                    .sys
                    .mount_filesystem(&dev.path, path, fs_type, flags, data)
                {
                    let _ = loopdev::detach(&dev.path);
                    return Err(mount_err("mount filesystem onto", path)(e));
                }
                Ok(())
            }
        }
    }

    /// Sets the per-mount flags of `flags` beyond nosuid,nodev (noexec, noatime) on the bind just
    /// made at `path`; on failure takes the bind down again. Read-only is not set here.
    fn apply_or_unmount(&self, path: &Path, flags: MountFlags) -> Result<(), BackingError> {
        let extra = MountFlags {
            noexec: flags.noexec,
            noatime: flags.noatime,
            ..MountFlags::NONE
        };
        if extra.is_empty() {
            return Ok(());
        }
        if let Err(e) = self.sys.remount_bind_with(path, extra, MountFlags::NONE) {
            let _ = self.unmount_bounded(path);
            return Err(mount_err("apply mount flags on", path)(e));
        }
        Ok(())
    }

    /// NodeStage: the volume at `staging` (created if missing), of its `fs_type`, with `flags`
    /// (read-only as a read-only remount of that mount). On failure nothing stays mounted.
    pub fn stage(
        &self,
        vol_dir: &Path,
        staging: &Path,
        fs_type: &str,
        flags: MountFlags,
    ) -> Result<(), BackingError> {
        private_dir(staging).map_err(io_step("create staging directory", staging))?;
        if Self::is_block(vol_dir) {
            if flags.readonly {
                return Err(BackingError::BlockNotServed {
                    what: "read-only block access",
                });
            }
            let file = staging.join(STAGED_DEVICE);
            let created =
                create_file(&file).map_err(io_step("create staged device file", &file))?;
            let attached = self.attach_device_at(vol_dir, &file);
            if attached.is_err() && created {
                let _ = fs::remove_file(&file);
            }
            return attached;
        }
        self.attach_at(vol_dir, staging, fs_type, flags)?;
        if flags.readonly {
            if let Err(e) = self.sys.remount_bind_readonly(staging) {
                let _ = self.unmount_bounded(staging);
                let _ = self.release_if_unused(vol_dir);
                return Err(mount_err("remount read-only", staging)(e));
            }
        }
        Ok(())
    }

    /// Sets nosuid,nodev on the bind just made at `path`; on failure takes the bind down again.
    fn harden_or_unmount(&self, path: &Path) -> Result<(), BackingError> {
        if let Err(e) = self.sys.harden_mount_root(path) {
            let _ = self.unmount_bounded(path);
            return Err(mount_err("set nosuid,nodev on", path)(e));
        }
        Ok(())
    }

    /// NodeUnstage: unmount the volume's mounts stacked at `staging`; detach the loop device
    /// when nothing of the volume stays mounted.
    pub fn unstage(&self, vol_dir: &Path, staging: &Path) -> Result<(), BackingError> {
        let staged = Self::staged_path(vol_dir, staging);
        if self.unmount_volume_at(vol_dir, &staged)? && staged != staging {
            remove_entry(&staged, "remove staged device file")?;
        }
        self.release_if_unused(vol_dir)
    }

    /// NodePublish: create `target` (a directory; a file for a block volume), then bind
    /// `staging` onto it (or, without staging, attach the volume itself), with `flags`;
    /// read-only as a read-only bind. On failure nothing stays mounted and a target this call
    /// created is removed.
    pub fn publish(
        &self,
        vol_dir: &Path,
        staging: Option<&Path>,
        target: &Path,
        fs_type: &str,
        flags: MountFlags,
    ) -> Result<(), BackingError> {
        let readonly = flags.readonly;
        let block = Self::is_block(vol_dir);
        if block && readonly {
            return Err(BackingError::BlockNotServed {
                what: "read-only block access",
            });
        }
        let created = if block {
            create_file(target).map_err(io_step("create target file", target))?
        } else {
            match fs::DirBuilder::new().mode(PRIVATE_DIR_MODE).create(target) {
                Ok(()) => true,
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => false,
                Err(e) => return Err(io_step("create target directory", target)(e).into()),
            }
        };
        let result = (|| {
            match staging {
                Some(staging) => {
                    let staging = Self::staged_path(vol_dir, staging);
                    self.sys
                        .bind_mount(&staging, target, false)
                        .map_err(mount_err("bind staging path onto", target))?;
                    // A bind keeps the staging mount's flags; set them anyway, for a staging mount
                    // made before they were, and this publish's own.
                    self.harden_or_unmount(target)?;
                    self.apply_or_unmount(target, flags)?;
                }
                None if block => self.attach_device_at(vol_dir, target)?,
                None => self.attach_at(vol_dir, target, fs_type, flags)?,
            }
            if readonly {
                if let Err(e) = self.sys.remount_bind_readonly(target) {
                    let _ = self.unmount_bounded(target);
                    return Err(mount_err("remount read-only", target)(e));
                }
            }
            Ok(())
        })();
        if result.is_err() {
            if created {
                let _ = remove_entry(target, "remove target");
            }
            let _ = self.release_if_unused(vol_dir);
        }
        result
    }

    /// NodeUnpublish: unmount the volume's mounts stacked at `target` and remove it (unless
    /// a mount that is not the volume's stays there); detach the loop device when nothing of
    /// the volume stays mounted.
    pub fn unpublish(&self, vol_dir: &Path, target: &Path) -> Result<(), BackingError> {
        if self.unmount_volume_at(vol_dir, target)? {
            remove_entry(target, "remove target")?;
        }
        self.release_if_unused(vol_dir)
    }

    /// Unmounts the volume's mounts at `path`, topmost first, while the topmost mount there
    /// is the volume's. Returns whether nothing is left mounted at `path`; a foreign mount
    /// is never unmounted, and one covering a mount of the volume is an error.
    fn unmount_volume_at(&self, vol_dir: &Path, path: &Path) -> Result<bool, BackingError> {
        let Ok(path) = fs::canonicalize(path) else {
            return Ok(true);
        };
        // Bounded: a path can hold only so many stacked mounts of ours.
        for _ in 0..16 {
            if !self.is_mount_root(&path)? {
                return Ok(true);
            }
            if self.shows_data_dir(vol_dir, &path).is_some()
                || self.shows_loop_fs(vol_dir, &path).is_some()
            {
                self.unmount_bounded(&path)?;
                continue;
            }
            let mounts = self.mounts()?;
            let identity = self.identity(vol_dir, &mounts)?;
            let mut here = mounts.iter().filter(|m| m.mount_point == path).rev();
            let Some(top) = here.next() else {
                return Ok(true);
            };
            if !Self::is_volume(&identity, top) {
                if here.any(|m| Self::is_volume(&identity, m)) {
                    return Err(BackingError::Covered {
                        path,
                        what: describe(top),
                    });
                }
                return Ok(false);
            }
            self.unmount_bounded(&path)?;
        }
        Err(BackingError::Io(IoStep::new(
            "unmount (too many stacked mounts)",
            path,
            io::Error::from(io::ErrorKind::ResourceBusy),
        )))
    }

    /// Unmounts the topmost mount at `path`, retrying a few times while it is busy; never
    /// detaches lazily.
    fn unmount_bounded(&self, path: &Path) -> Result<(), BackingError> {
        for attempt in 1..=UNMOUNT_ATTEMPTS {
            match self.sys.unmount(path, false) {
                Ok(()) | Err(MountError::NotMounted { .. }) => return Ok(()),
                Err(e) if e.errno() == Some(Errno::EBUSY) => {
                    if attempt < UNMOUNT_ATTEMPTS {
                        std::thread::sleep(UNMOUNT_PAUSE);
                    }
                }
                Err(e) => return Err(mount_err("unmount", path)(e)),
            }
        }
        Err(BackingError::Busy {
            path: path.to_path_buf(),
            attempts: UNMOUNT_ATTEMPTS,
        })
    }

    /// Detaches a block volume's loop devices if none of its binds is left. A no-op for dir and
    /// for a loop volume mounted as a filesystem: its device is attached with autoclear and
    /// the kernel frees it at its last unmount, so there is nothing to look for (looking means
    /// reading every loop device node of the host: [`Self::release_all`] does, for DeleteVolume).
    pub fn release_if_unused(&self, vol_dir: &Path) -> Result<(), BackingError> {
        if !Self::is_block(vol_dir) {
            return Ok(());
        }
        self.release_all(vol_dir)
    }

    /// Detaches every loop device of the volume if none of its mounts is left (a no-op for dir),
    /// whatever its kind: DeleteVolume's, before it waits for them to run down.
    pub fn release_all(&self, vol_dir: &Path) -> Result<(), BackingError> {
        if self.kind != BackingKind::Loop || !self.volume_mounts(vol_dir)?.is_empty() {
            return Ok(());
        }
        for dev in self.loop_devices(vol_dir)? {
            loopdev::detach(&dev).map_err(mount_err("detach loop device", &dev))?;
        }
        Ok(())
    }

    /// Waits (bounded by [`LOOP_RUNDOWN_WAIT`]) until no loop device is backed by the volume's
    /// image: the kernel runs a detached device down after its last opener is gone, which can
    /// trail the unmount that closed it. DeleteVolume waits so that the image it deletes is free.
    pub fn wait_loop_rundown(&self, vol_dir: &Path) -> Result<(), BackingError> {
        if self.kind != BackingKind::Loop {
            return Ok(());
        }
        let deadline = std::time::Instant::now() + LOOP_RUNDOWN_WAIT;
        loop {
            let left = self.loop_devices(vol_dir)?;
            if left.is_empty() {
                return Ok(());
            }
            if std::time::Instant::now() >= deadline {
                tracing::warn!(volume = %vol_dir.display(), devices = ?left, "loop devices still attached after their detach");
                return Ok(());
            }
            std::thread::sleep(UNMOUNT_PAUSE);
        }
    }
}

/// Creates `path` as an empty 0600 file unless something is there; whether this call made it.
fn create_file(path: &Path) -> io::Result<bool> {
    use std::os::unix::fs::OpenOptionsExt;
    match fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_CLOEXEC)
        .open(path)
    {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(e),
    }
}

/// Removes a target or staged device file left with nothing mounted on it: a directory, or (a
/// block volume's) a file; gone already is fine.
fn remove_entry(path: &Path, step: &'static str) -> Result<(), BackingError> {
    let removed = match fs::symlink_metadata(path) {
        Ok(meta) if meta.is_dir() => fs::remove_dir(path),
        Ok(_) => fs::remove_file(path),
        Err(e) => Err(e),
    };
    match removed {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_step(step, path)(e).into()),
    }
}

/// The plugin's own directories (its store, volume directories, staging and target directories) are
/// made and closed by the work dir's rules.
pub use csi_isolator::workdir::{
    close_private_dir as close_dir, create_private_dirs as private_dir, PRIVATE_DIR_MODE,
};

/// How long [`Backing::wait_loop_rundown`] waits for detached loop devices to run down.
const LOOP_RUNDOWN_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// The fs type a loop volume gets when none is asked for.
pub const DEFAULT_FS_TYPE: &str = "ext4";

/// The fs types the loop backing can make: the ext family (mke2fs, which e2fsprogs installs
/// with mkfs.ext4) and xfs when `mkfs.xfs` is installed. The dir backing makes none (its
/// volumes are directories): it accepts an empty fs type only.
pub fn fs_types(kind: BackingKind) -> Vec<&'static str> {
    match kind {
        BackingKind::Dir => Vec::new(),
        BackingKind::Loop => {
            let mut types = vec!["ext4", "ext3", "ext2"];
            // Looked up once: CreateVolume and every node call check the type.
            static XFS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
            if *XFS.get_or_init(|| mkfs_found("xfs")) {
                types.push("xfs");
            }
            types
        }
    }
}

/// The smallest xfs filesystem `mkfs.xfs` makes: xfsprogs 5.19 and later refuse anything under
/// 300 MiB ("Filesystem must be larger than 300MB"; 300 MiB itself is accepted).
pub const XFS_MIN_BYTES: u64 = 300 << 20;

/// The smallest image mkfs makes a filesystem of `fs_type` on (0: no minimum beyond the backing's
/// own, [`MIN_LOOP_BYTES`]). CreateVolume raises a smaller request to it, as it raises one to
/// [`MIN_LOOP_BYTES`], and refuses a `limit_bytes` under it.
pub fn min_fs_bytes(fs_type: &str) -> u64 {
    match fs_type {
        "xfs" => XFS_MIN_BYTES,
        _ => 0,
    }
}

/// The mkfs program for `fs_type`.
pub fn mkfs_program(fs_type: &str) -> String {
    format!("mkfs.{fs_type}")
}

fn mkfs_found(fs_type: &str) -> bool {
    let program = mkfs_program(fs_type);
    std::env::var_os("PATH")
        .map(|path| {
            std::env::split_paths(&path)
                .chain(["/usr/sbin".into(), "/sbin".into()])
                .any(|dir| Path::new(&dir).join(&program).is_file())
        })
        .unwrap_or(false)
}

/// Checks an fs type against what the backing `kind` makes; the reason names the type.
pub fn check_fs_type(fs_type: &str, kind: BackingKind) -> Result<(), String> {
    if fs_type.is_empty() {
        return Ok(());
    }
    let types = fs_types(kind);
    if types.contains(&fs_type) {
        return Ok(());
    }
    Err(match kind {
        BackingKind::Dir => format!(
            "fs_type {fs_type:?} is not supported by the dir backing (its volumes are directories: leave fs_type empty, or use --backing=loop)"
        ),
        BackingKind::Loop => format!(
            "fs_type {fs_type:?} is not supported (supported here: {})",
            types.join(", ")
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The mount-time defence behind the node plugin's look at a volume directory: a `data` or
    /// image swapped for a link, a device or a second name after that look is still refused,
    /// on the fd that would be bound or attached.
    #[test]
    fn storage_is_opened_without_following_links() {
        let vol = tempfile::tempdir().unwrap();
        let vol = vol.path();
        let unsafe_what = |e: BackingError| match e {
            BackingError::UnsafeStorage { what, .. } => what,
            e => panic!("{e}"),
        };
        // Data: a real directory opens; a link to `/` (or to a real directory) does not.
        fs::create_dir(vol.join("real")).unwrap();
        assert!(open_data_dir(vol).is_err(), "missing");
        fs::create_dir(vol.join("data")).unwrap();
        open_data_dir(vol).unwrap();
        fs::remove_dir(vol.join("data")).unwrap();
        for target in ["/", "real"] {
            std::os::unix::fs::symlink(target, vol.join("data")).unwrap();
            let what = unsafe_what(open_data_dir(vol).unwrap_err());
            assert_eq!(what, "a symbolic link");
            assert!(check_storage(vol).is_err());
            fs::remove_file(vol.join("data")).unwrap();
        }
        fs::write(vol.join("data"), "").unwrap();
        assert_eq!(
            unsafe_what(open_data_dir(vol).unwrap_err()),
            "not a directory"
        );
        fs::remove_file(vol.join("data")).unwrap();
        // Image: a regular file of one name opens; a link, a device or a second name does not.
        let image = vol.join(FS_IMAGE);
        fs::write(vol.join("other"), "x").unwrap();
        fs::write(&image, "x").unwrap();
        open_image(&image).unwrap();
        check_storage(vol).unwrap();
        fs::remove_file(&image).unwrap();
        std::os::unix::fs::symlink(vol.join("other"), &image).unwrap();
        assert_eq!(
            unsafe_what(open_image(&image).unwrap_err()),
            "a symbolic link"
        );
        fs::remove_file(&image).unwrap();
        fs::hard_link(vol.join("other"), &image).unwrap();
        assert!(unsafe_what(open_image(&image).unwrap_err()).contains("2 hard links"));
        assert!(check_storage(vol).is_err());
        fs::remove_file(&image).unwrap();
        nix::unistd::mkfifo(&image, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        // O_NONBLOCK: a FIFO is refused at once rather than waited on.
        assert!(unsafe_what(open_image(&image).unwrap_err()).contains("not a regular file"));
    }

    #[test]
    fn fs_types_follow_the_backing() {
        assert_eq!(check_fs_type("", BackingKind::Dir), Ok(()));
        let err = check_fs_type("ext4", BackingKind::Dir).unwrap_err();
        assert!(
            err.contains("\"ext4\"") && err.contains("dir backing"),
            "{err}"
        );
        for ok in ["", "ext4", "ext3", "ext2"] {
            assert_eq!(check_fs_type(ok, BackingKind::Loop), Ok(()), "{ok}");
        }
        let err = check_fs_type("ntfs", BackingKind::Loop).unwrap_err();
        assert!(
            err.contains("\"ntfs\"") && err.contains("supported here: ext4, ext3, ext2"),
            "{err}"
        );
        assert_eq!(
            fs_types(BackingKind::Loop).contains(&"xfs"),
            mkfs_found("xfs")
        );
    }

    #[test]
    fn splits_device_numbers() {
        assert_eq!(split_dev(0x0801), (8, 1));
        assert_eq!(split_dev(0x0700), (7, 0));
        // Minor numbers above 255 use the high bits.
        assert_eq!(split_dev((7 << 8) | (0x123 << 20) | 0x45), (7, 0x12345));
    }

    #[test]
    fn sizes_respect_the_backing_minimum() {
        assert_eq!(Backing::new(BackingKind::Dir).size_for(4096), 4096);
        assert_eq!(
            Backing::new(BackingKind::Loop).size_for(4096),
            MIN_LOOP_BYTES
        );
        assert_eq!(Backing::new(BackingKind::Loop).size_for(0), 64 << 20);
    }
}
