//! Growing a volume: its image (ControllerExpandVolume), its filesystem online
//! (NodeExpandVolume), or a new volume's filesystem to a bigger image (a clone or a restore
//! bigger than its source).
//!
//! A dir volume has nothing to grow (its capacity is a recorded figure, not enforced). A loop
//! volume's image is lengthened (never shortened), and every loop device attached to it told
//! of its new size (LOOP_SET_CAPACITY, by `losetup -c`); its filesystem is grown while mounted
//! (ext2/3/4: `resize2fs` on the loop device, online; xfs: `xfs_growfs` on a mount point), or,
//! for a new volume nobody mounts yet, offline (ext: `e2fsck -f` then `resize2fs` on the image;
//! xfs cannot grow unmounted, so a new xfs volume keeps its source's size: see
//! [`Backing::grows_offline`]).

use std::ffi::OsStr;
use std::fs;
use std::path::Path;

use super::copy::run;
use super::{io_step, Backing, BackingError, BackingKind};

impl Backing {
    /// Lengthens a loop volume's image to `size` bytes (never shortens it) and tells its
    /// attached loop devices; a no-op for the dir backing.
    pub fn grow_image(&self, vol_dir: &Path, size: u64) -> Result<(), BackingError> {
        if self.kind == BackingKind::Dir {
            return Ok(());
        }
        let image = Self::image(vol_dir);
        let file = fs::OpenOptions::new()
            .write(true)
            .open(&image)
            .map_err(io_step("open image", &image))?;
        let len = file
            .metadata()
            .map_err(io_step("stat image", &image))?
            .len();
        if len < size {
            file.set_len(size)
                .map_err(io_step("lengthen image", &image))?;
            file.sync_all().map_err(io_step("fsync image", &image))?;
        }
        self.refresh_loop_capacity(vol_dir)
    }

    /// Tells every loop device attached to the volume's image the image's current size.
    fn refresh_loop_capacity(&self, vol_dir: &Path) -> Result<(), BackingError> {
        for dev in self.loop_devices(vol_dir)? {
            run("losetup", &["-c".as_ref(), dev.as_os_str()])?;
        }
        Ok(())
    }

    /// Grows the filesystem of a mounted loop volume of `fs_type` to its image, online; a no-op
    /// for a dir volume and for a block volume (the loop device's new size is all there is).
    /// The volume must be mounted (staged or published): `Ok(false)` when it is not.
    pub fn grow_filesystem(&self, vol_dir: &Path, fs_type: &str) -> Result<bool, BackingError> {
        if self.kind == BackingKind::Dir {
            return Ok(true);
        }
        self.refresh_loop_capacity(vol_dir)?;
        if Self::is_block(vol_dir) {
            return Ok(!self.loop_devices(vol_dir)?.is_empty());
        }
        let Some(mount) = self.volume_mounts(vol_dir)?.into_iter().next() else {
            return Ok(false);
        };
        if fs_type == "xfs" {
            run("xfs_growfs", &[mount.mount_point.as_os_str()])?;
        } else {
            run("resize2fs", &[OsStr::new(&mount.source)])?;
        }
        Ok(true)
    }

    /// Whether a new, unmounted volume of `fs_type` can have its filesystem grown to a bigger
    /// image: the ext family can (offline resize2fs), xfs cannot (it grows mounted only).
    pub fn grows_offline(fs_type: &str) -> bool {
        fs_type != "xfs"
    }

    /// Grows the filesystem in a new volume's image (copied from a smaller source, then
    /// lengthened) to the image's size: `e2fsck -f` (which also replays the journal of a copy
    /// taken from a frozen, mounted filesystem), then `resize2fs`. Nothing is mounted.
    pub fn grow_filesystem_offline(
        &self,
        vol_dir: &Path,
        fs_type: &str,
    ) -> Result<(), BackingError> {
        if self.kind == BackingKind::Dir || Self::is_block(vol_dir) {
            return Ok(());
        }
        if !Self::grows_offline(fs_type) {
            return Err(BackingError::Tool {
                program: "xfs_growfs".into(),
                args: String::new(),
                reason: "xfs grows mounted only".into(),
            });
        }
        let image = Self::image(vol_dir);
        // Exit 1 and 2: errors found and corrected; 4 and above: left uncorrected or failed.
        let fsck = std::process::Command::new("e2fsck")
            .args(["-f", "-p"])
            .arg(&image)
            .output()
            .map_err(|e| BackingError::Tool {
                program: "e2fsck".into(),
                args: image.display().to_string(),
                reason: format!("cannot run: {e}"),
            })?;
        if fsck.status.code().is_none_or(|c| c >= 4) {
            return Err(BackingError::Tool {
                program: "e2fsck".into(),
                args: format!("-f -p {}", image.display()),
                reason: format!(
                    "{}: {}",
                    fsck.status,
                    String::from_utf8_lossy(&fsck.stderr).trim()
                ),
            });
        }
        run("resize2fs", &[image.as_os_str()])
    }
}
