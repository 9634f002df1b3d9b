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
//!
//! Whether a path holds "this volume" is read from the kernel: a mount of the volume is one
//! whose device is the data directory's filesystem and whose root is the data directory
//! (same device and inode), or, for loop volumes, one whose device is a loop device backed
//! by the volume's image.

use std::fs;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::mount::{
    loopdev, unmount_with_retry, LinuxSyscall, MountError, MountFlags, MountInfo, MountTable,
    ProcMountTable, Syscall,
};

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

/// Errors of the backing, one per step.
#[derive(Debug, thiserror::Error)]
pub enum BackingError {
    /// A filesystem operation on the volume's files failed.
    #[error("{step} {path}: {source}")]
    Io {
        /// The step.
        step: &'static str,
        /// The path.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// mkfs.ext4 could not run or failed.
    #[error("mkfs.ext4 {path}: {reason}")]
    Mkfs {
        /// The image.
        path: PathBuf,
        /// Its exit status and stderr, or why it did not start.
        reason: String,
    },
    /// A mount-layer call failed.
    #[error("{step} {path}: {source}")]
    Mount {
        /// The step.
        step: &'static str,
        /// The path.
        path: PathBuf,
        /// The underlying error (boxed: mount errors are large).
        #[source]
        source: Box<MountError>,
    },
}

fn io_err(step: &'static str, path: &Path) -> impl FnOnce(io::Error) -> BackingError {
    let path = path.to_path_buf();
    move |source| BackingError::Io { step, path, source }
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
    /// Device number and inode of the data directory.
    Dir { dev: u64, ino: u64 },
    /// (major, minor) of the loop devices backed by the image.
    Loop { devices: Vec<(u32, u32)> },
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

    fn data_dir(vol_dir: &Path) -> PathBuf {
        vol_dir.join("data")
    }

    fn image(vol_dir: &Path) -> PathBuf {
        vol_dir.join("image.ext4")
    }

    /// Creates the volume's storage in `vol_dir` (replacing leftovers of an interrupted
    /// create).
    pub fn provision(&self, vol_dir: &Path, capacity: u64) -> Result<(), BackingError> {
        fs::create_dir_all(vol_dir).map_err(io_err("create volume directory", vol_dir))?;
        match self.kind {
            BackingKind::Dir => {
                let data = Self::data_dir(vol_dir);
                fs::create_dir_all(&data).map_err(io_err("create data directory", &data))
            }
            BackingKind::Loop => {
                let image = Self::image(vol_dir);
                let file = fs::File::create(&image).map_err(io_err("create image", &image))?;
                file.set_len(capacity)
                    .map_err(io_err("size image", &image))?;
                drop(file);
                let out = Command::new("mkfs.ext4")
                    .args(["-q", "-F"])
                    .arg(&image)
                    .output()
                    .map_err(|e| BackingError::Mkfs {
                        path: image.clone(),
                        reason: format!("cannot run: {e}"),
                    })?;
                if !out.status.success() {
                    return Err(BackingError::Mkfs {
                        path: image,
                        reason: format!(
                            "{}: {}",
                            out.status,
                            String::from_utf8_lossy(&out.stderr).trim()
                        ),
                    });
                }
                Ok(())
            }
        }
    }

    fn identity(&self, vol_dir: &Path) -> Result<Identity, BackingError> {
        match self.kind {
            BackingKind::Dir => {
                let data = Self::data_dir(vol_dir);
                let meta = fs::metadata(&data).map_err(io_err("stat data directory", &data))?;
                Ok(Identity::Dir {
                    dev: meta.dev(),
                    ino: meta.ino(),
                })
            }
            BackingKind::Loop => {
                let mut devices = Vec::new();
                for dev in self.loop_devices(vol_dir)? {
                    match fs::metadata(&dev) {
                        Ok(meta) => devices.push(split_dev(meta.rdev())),
                        // Detached meanwhile.
                        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                        Err(e) => return Err(io_err("stat loop device", &dev)(e)),
                    }
                }
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
            Identity::Dir { dev, ino } => {
                (m.major, m.minor) == split_dev(*dev)
                    && fs::metadata(&m.mount_point)
                        .is_ok_and(|meta| meta.dev() == *dev && meta.ino() == *ino)
            }
            Identity::Loop { devices } => devices.contains(&(m.major, m.minor)),
        }
    }

    fn mounts(&self) -> Result<Vec<MountInfo>, BackingError> {
        self.table
            .mounts()
            .map_err(mount_err("read mount table", &self.table.path()))
    }

    /// Every mount of the volume, in table order.
    pub fn volume_mounts(&self, vol_dir: &Path) -> Result<Vec<MountInfo>, BackingError> {
        let identity = self.identity(vol_dir)?;
        Ok(self
            .mounts()?
            .into_iter()
            .filter(|m| Self::is_volume(&identity, m))
            .collect())
    }

    /// What is mounted at `path` (by its canonical form), relative to the volume.
    pub fn mount_state(&self, vol_dir: &Path, path: &Path) -> Result<MountState, BackingError> {
        if !path.is_absolute() {
            return Ok(MountState::NotMounted);
        }
        let Ok(path) = fs::canonicalize(path) else {
            return Ok(MountState::NotMounted);
        };
        let Some(top) = self
            .mounts()?
            .into_iter()
            .rev()
            .find(|m| m.mount_point == path)
        else {
            return Ok(MountState::NotMounted);
        };
        if Self::is_volume(&self.identity(vol_dir)?, &top) {
            Ok(MountState::Volume {
                readonly: top.is_readonly(),
            })
        } else {
            Ok(MountState::Other(format!(
                "{} {} from {}",
                top.fs_type,
                top.root.display(),
                top.source
            )))
        }
    }

    /// Makes the volume appear at `path` (an existing directory): a bind of the data
    /// directory, or of an existing mount of the image, or a fresh loop attach + ext4 mount.
    fn attach_at(&self, vol_dir: &Path, path: &Path) -> Result<(), BackingError> {
        match self.kind {
            BackingKind::Dir => {
                let data = Self::data_dir(vol_dir);
                self.sys
                    .bind_mount(&data, path, false)
                    .map_err(mount_err("bind data directory onto", path))
            }
            BackingKind::Loop => {
                if let Some(existing) = self.volume_mounts(vol_dir)?.into_iter().next() {
                    // Mounting the device that is already mounted shares its superblock (one
                    // filesystem instance), and unlike a bind of an existing mount it does not
                    // inherit that mount's per-mount flags such as read-only.
                    let device = PathBuf::from(&existing.source);
                    return self
                        .sys
                        .mount_filesystem(&device, path, "ext4", MountFlags::default(), "")
                        .map_err(mount_err("mount already attached ext4 onto", path));
                }
                let image = Self::image(vol_dir);
                let dev = loopdev::attach(&image, false)
                    .map_err(mount_err("attach loop device to", &image))?;
                if let Err(e) =
                    self.sys
                        .mount_filesystem(&dev.path, path, "ext4", MountFlags::default(), "")
                {
                    let _ = loopdev::detach(&dev.path);
                    return Err(mount_err("mount ext4 onto", path)(e));
                }
                Ok(())
            }
        }
    }

    /// NodeStage: the volume at `staging` (created if missing).
    pub fn stage(&self, vol_dir: &Path, staging: &Path) -> Result<(), BackingError> {
        fs::create_dir_all(staging).map_err(io_err("create staging directory", staging))?;
        self.attach_at(vol_dir, staging)
    }

    /// NodeUnstage: unmount `staging` (every mount stacked there); detach the loop
    /// device when nothing of the volume stays mounted.
    pub fn unstage(&self, vol_dir: &Path, staging: &Path) -> Result<(), BackingError> {
        self.unmount_all_at(staging)?;
        self.release_if_unused(vol_dir)
    }

    /// NodePublish: create `target` (a directory), then bind `staging` onto it (or, without
    /// staging, attach the volume itself); read-only as a read-only bind. On failure
    /// nothing stays mounted and a target directory this call created is removed.
    pub fn publish(
        &self,
        vol_dir: &Path,
        staging: Option<&Path>,
        target: &Path,
        readonly: bool,
    ) -> Result<(), BackingError> {
        let created = match fs::create_dir(target) {
            Ok(()) => true,
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => false,
            Err(e) => return Err(io_err("create target directory", target)(e)),
        };
        let result = (|| {
            match staging {
                Some(staging) => self
                    .sys
                    .bind_mount(staging, target, false)
                    .map_err(mount_err("bind staging path onto", target))?,
                None => self.attach_at(vol_dir, target)?,
            }
            if readonly {
                if let Err(e) = self.sys.remount_bind_readonly(target) {
                    let _ = unmount_with_retry(&self.sys, target, 3, Duration::from_millis(20));
                    return Err(mount_err("remount read-only", target)(e));
                }
            }
            Ok(())
        })();
        if result.is_err() {
            if created {
                let _ = fs::remove_dir(target);
            }
            let _ = self.release_if_unused(vol_dir);
        }
        result
    }

    /// NodeUnpublish: unmount `target` (every mount stacked there) and remove it; detach
    /// the loop device when nothing of the volume stays mounted.
    pub fn unpublish(&self, vol_dir: Option<&Path>, target: &Path) -> Result<(), BackingError> {
        self.unmount_all_at(target)?;
        match fs::remove_dir(target) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err("remove target directory", target)(e)),
        }
        match vol_dir {
            Some(vol_dir) => self.release_if_unused(vol_dir),
            None => Ok(()),
        }
    }

    fn unmount_all_at(&self, path: &Path) -> Result<(), BackingError> {
        let Ok(path) = fs::canonicalize(path) else {
            return Ok(());
        };
        // Bounded: a path can hold only so many stacked mounts of ours.
        for _ in 0..16 {
            let mounted = self
                .table
                .is_mount_point(&path)
                .map_err(mount_err("read mount table for", &path))?;
            if !mounted {
                return Ok(());
            }
            unmount_with_retry(&self.sys, &path, 5, Duration::from_millis(50))
                .map_err(mount_err("unmount", &path))?;
        }
        Err(BackingError::Io {
            step: "unmount (too many stacked mounts)",
            path,
            source: io::Error::from(io::ErrorKind::ResourceBusy),
        })
    }

    /// Detaches the volume's loop devices if none of its mounts is left (a no-op for dir).
    pub fn release_if_unused(&self, vol_dir: &Path) -> Result<(), BackingError> {
        if self.kind != BackingKind::Loop || !self.volume_mounts(vol_dir)?.is_empty() {
            return Ok(());
        }
        for dev in self.loop_devices(vol_dir)? {
            loopdev::detach(&dev).map_err(mount_err("detach loop device", &dev))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
