//! A new volume's storage made durable before CreateVolume answers, through the durable seam
//! (`csi_isolator::durable`, recorded for the power-loss tests).
//!
//! Contract: once [`durable_dir`] returns, the volume's (or snapshot's) directory survives a power cut (its
//! parent is synced); once [`image`] returns, the image file holds `capacity` bytes with what
//! mkfs wrote in them, fsynced, and its name in the volume directory is durable (the directory is
//! synced); once [`data_dir`] returns, the dir backing's data directory is durable. The record
//! the store writes afterwards therefore never names storage a power cut could take away.
//!
//! The image's create and fsync go through the seam like the rest; its bytes are not recorded
//! (megabytes of mkfs output): the power-loss tests check that the fsync comes after the create
//! and before the record's promise, and stand a formatted image in for it in every crash state
//! where its name survives.

use std::fs::{self, File};
use std::io;
use std::path::Path;

use csi_isolator::durable;

/// The mode of a new image: the owner's only (the 0700 volume directory already keeps others
/// out; the file does not widen that).
const IMAGE_MODE: u32 = 0o600;

/// Makes `dir` (mode 0700; an existing one, left by an interrupted create, is kept) and makes its
/// entry durable by syncing its parent, which must exist.
pub fn durable_dir(dir: &Path) -> io::Result<()> {
    made_dir(dir, super::PRIVATE_DIR_MODE)
}

/// Makes the dir backing's data directory `data` (the usual mode under the umask) in the
/// (durable) volume directory and syncs that, so the data directory's entry is durable.
pub fn data_dir(data: &Path) -> io::Result<()> {
    made_dir(data, 0o777)
}

/// Makes `dir` with `mode`, keeping an existing real directory (never a symlink), then syncs its
/// parent.
fn made_dir(dir: &Path, mode: u32) -> io::Result<()> {
    match durable::create_dir_with_mode(dir, mode) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists && is_real_dir(dir) => {}
        Err(e) => return Err(e),
    }
    match dir.parent() {
        Some(parent) => durable::sync_dir(parent),
        None => Ok(()),
    }
}

/// Creates the image `path` afresh (a leftover of an interrupted create is removed first), a
/// sparse file of `capacity` bytes, and returns it open for [`sync_image`].
pub fn create_image(path: &Path, capacity: u64) -> io::Result<File> {
    match durable::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let file = durable::create_new_file(path, IMAGE_MODE)?;
    file.set_len(capacity)?;
    Ok(file)
}

/// fsyncs the image `path` (its size and whatever mkfs wrote, whether or not mkfs synced it
/// itself), then its directory, so the image and its name are durable.
pub fn sync_image(path: &Path) -> io::Result<()> {
    durable::sync_file(path)?;
    match path.parent() {
        Some(dir) => durable::sync_dir(dir),
        None => Ok(()),
    }
}

/// Whether `path` is a directory itself (a symlink to one is not: nothing of a volume is reached
/// through a link).
fn is_real_dir(path: &Path) -> bool {
    fs::symlink_metadata(path).is_ok_and(|m| m.is_dir())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_volume_directory_is_private_kept_when_there_and_never_a_symlink() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("vol-1");
        durable_dir(&dir).unwrap();
        let mode = fs::metadata(&dir).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode, super::super::PRIVATE_DIR_MODE);
        fs::write(dir.join("keep"), b"x").unwrap();
        durable_dir(&dir).unwrap();
        assert!(dir.join("keep").exists(), "an existing directory is kept");
        let elsewhere = tmp.path().join("elsewhere");
        fs::create_dir(&elsewhere).unwrap();
        let link = tmp.path().join("vol-2");
        std::os::unix::fs::symlink(&elsewhere, &link).unwrap();
        assert!(
            durable_dir(&link).is_err(),
            "a symlink is not a volume directory"
        );
        // (`provision` makes the data directory only inside a directory `durable_dir` accepted.)
        data_dir(&dir.join("data")).unwrap();
        data_dir(&dir.join("data")).unwrap();
        assert!(dir.join("data").is_dir());
    }

    #[test]
    fn an_image_is_made_afresh_at_its_capacity_and_synced() {
        let tmp = tempfile::tempdir().unwrap();
        let image = tmp.path().join("image.ext4");
        fs::write(&image, b"leftover of an interrupted create").unwrap();
        drop(create_image(&image, 1 << 20).unwrap());
        let meta = fs::metadata(&image).unwrap();
        assert_eq!(meta.len(), 1 << 20);
        assert_eq!(meta.permissions().mode() & 0o7777, IMAGE_MODE);
        assert_eq!(
            fs::read(&image)
                .unwrap()
                .iter()
                .filter(|b| **b != 0)
                .count(),
            0,
            "nothing of the leftover remains"
        );
        sync_image(&image).unwrap();
        assert!(sync_image(&tmp.path().join("missing")).is_err());
    }
}
