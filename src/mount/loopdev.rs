//! Loop devices: attach a file as a block device, detach it, and find devices by backing file.
//!
//! Real kernel only (ioctls on `/dev/loop-control` and `/dev/loopN`), not behind the [`super::Syscall`]
//! seam: there is nothing to fake about a block device a test wants to mount.
//!
//! Devices are attached with `LO_FLAGS_AUTOCLEAR`, so the kernel frees a device on the last close of it. A
//! [`LoopDevice`] therefore holds the device open: mount it (the mount keeps it open), then drop the
//! `LoopDevice`, and the device goes away by itself on unmount. Dropping it unmounted frees it at once.

use std::ffi::OsStr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{open, OFlag};
use nix::sys::stat::Mode;

use super::MountError;

// include/uapi/linux/loop.h
/// `/dev/loop-control`: return the number of a free device (allocating one if needed).
pub const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;
/// Bind a backing fd and set its status in one step (Linux 5.8+).
pub const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
/// Bind a backing fd (older kernels; followed by LOOP_SET_STATUS64).
pub const LOOP_SET_FD: libc::c_ulong = 0x4C00;
/// Set the status (`struct loop_info64`) of a bound device.
pub const LOOP_SET_STATUS64: libc::c_ulong = 0x4C04;
/// Unbind the backing file.
pub const LOOP_CLR_FD: libc::c_ulong = 0x4C01;
/// Free the device on last close.
pub const LO_FLAGS_AUTOCLEAR: u32 = 4;
/// Read-only device.
pub const LO_FLAGS_READ_ONLY: u32 = 1;
/// Size of `lo_file_name` (LO_NAME_SIZE).
const LO_NAME_SIZE: usize = 64;
/// Attempts at grabbing a free device before giving up (each lost race costs one).
const ATTACH_ATTEMPTS: u32 = 32;

/// `struct loop_info64` from include/uapi/linux/loop.h.
#[repr(C)]
#[derive(Clone, Copy)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; LO_NAME_SIZE],
    lo_crypt_name: [u8; LO_NAME_SIZE],
    lo_encrypt_key: [u8; 32],
    lo_init: [u64; 2],
}

/// `struct loop_config` from include/uapi/linux/loop.h.
#[repr(C)]
#[derive(Clone, Copy)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

impl LoopInfo64 {
    fn new(file: &Path, flags: u32) -> Self {
        let mut name = [0u8; LO_NAME_SIZE];
        let bytes = file.as_os_str().as_bytes();
        // Keep the final NUL: the kernel shows this name, truncated, when sysfs is not available.
        let n = bytes.len().min(LO_NAME_SIZE - 1);
        name[..n].copy_from_slice(&bytes[..n]);
        LoopInfo64 {
            lo_device: 0,
            lo_inode: 0,
            lo_rdevice: 0,
            lo_offset: 0,
            lo_sizelimit: 0,
            lo_number: 0,
            lo_encrypt_type: 0,
            lo_encrypt_key_size: 0,
            lo_flags: flags,
            lo_file_name: name,
            lo_crypt_name: [0; LO_NAME_SIZE],
            lo_encrypt_key: [0; 32],
            lo_init: [0; 2],
        }
    }
}

/// An attached loop device, held open (see the module doc).
#[derive(Debug)]
pub struct LoopDevice {
    /// `/dev/loopN`.
    pub path: PathBuf,
    /// N.
    pub number: u32,
    fd: OwnedFd,
}

impl LoopDevice {
    /// The open device.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Detaches now (LOOP_CLR_FD). A mounted device is freed when its last user goes.
    pub fn detach(self) -> Result<(), MountError> {
        clr_fd(self.fd.as_fd(), &self.path)
    }
}

fn loop_err<'a>(step: &'static str, path: &'a Path) -> impl Fn(Errno) -> MountError + 'a {
    move |errno| MountError::Loop {
        step,
        path: path.to_path_buf(),
        errno,
    }
}

fn ioctl(fd: BorrowedFd<'_>, request: libc::c_ulong, arg: libc::c_ulong) -> Result<i32, Errno> {
    // SAFETY: the loop ioctls used here take either an integer (a fd, or nothing) or a pointer to a repr(C)
    // struct that the caller keeps alive across this call; the fd is borrowed for the call.
    let ret = unsafe { libc::ioctl(fd.as_raw_fd(), request as _, arg) };
    if ret < 0 {
        Err(Errno::last())
    } else {
        Ok(ret)
    }
}

/// LOOP_CTL_GET_FREE, then LOOP_CONFIGURE (fallback LOOP_SET_FD + LOOP_SET_STATUS64) with LO_FLAGS_AUTOCLEAR,
/// retrying if another process grabbed the same free device (EBUSY).
pub fn attach(file: &Path, readonly: bool) -> Result<LoopDevice, MountError> {
    attach_with(file, readonly, LO_FLAGS_AUTOCLEAR)
}

/// As [`attach`], but without `LO_FLAGS_AUTOCLEAR`: the device stays attached after its last close,
/// until [`detach`]. For a device used as a raw block device (a bind of its node does not hold it
/// open, and every open and close by its user would otherwise free it).
pub fn attach_kept(file: &Path, readonly: bool) -> Result<LoopDevice, MountError> {
    attach_with(file, readonly, 0)
}

/// As [`attach`] ([`attach_kept`] if `kept`), of a backing file the caller has opened (with the
/// access `readonly` says) and checked on its fd: no path is looked up again, so a name swapped
/// for a symbolic link or a device after the check changes nothing. `file` is what the device
/// shows and errors name.
pub fn attach_opened(
    backing: BorrowedFd<'_>,
    file: &Path,
    readonly: bool,
    kept: bool,
) -> Result<LoopDevice, MountError> {
    // The kernel's name of the opened file, not the path's target now.
    let shown = super::fd_path(backing).unwrap_or_else(|_| file.to_path_buf());
    let autoclear = if kept { 0 } else { LO_FLAGS_AUTOCLEAR };
    configure_free(backing, file, &shown, readonly, autoclear)
}

fn attach_with(file: &Path, readonly: bool, autoclear: u32) -> Result<LoopDevice, MountError> {
    let backing = open(file, access(readonly) | OFlag::O_CLOEXEC, Mode::empty())
        .map_err(loop_err("open backing file", file))?;
    // Show the absolute path in sysfs-less listings.
    let shown = std::fs::canonicalize(file).unwrap_or_else(|_| file.to_path_buf());
    configure_free(backing.as_fd(), file, &shown, readonly, autoclear)
}

fn access(readonly: bool) -> OFlag {
    if readonly {
        OFlag::O_RDONLY
    } else {
        OFlag::O_RDWR
    }
}

fn configure_free(
    backing: BorrowedFd<'_>,
    file: &Path,
    shown: &Path,
    readonly: bool,
    autoclear: u32,
) -> Result<LoopDevice, MountError> {
    let access = access(readonly);
    let control_path = Path::new("/dev/loop-control");
    let control = open(
        control_path,
        OFlag::O_RDWR | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(loop_err("open", control_path))?;
    let mut flags = autoclear;
    if readonly {
        flags |= LO_FLAGS_READ_ONLY;
    }

    for attempt in 1..=ATTACH_ATTEMPTS {
        let number = ioctl(control.as_fd(), LOOP_CTL_GET_FREE, 0)
            .map_err(loop_err("LOOP_CTL_GET_FREE", control_path))?;
        let number = u32::try_from(number).expect("ioctl result is non-negative");
        let path = PathBuf::from(format!("/dev/loop{number}"));
        let device = match open(&path, access | OFlag::O_CLOEXEC, Mode::empty()) {
            Ok(fd) => fd,
            // The node may appear a moment after the device is allocated.
            Err(Errno::ENOENT) if attempt < ATTACH_ATTEMPTS => {
                std::thread::sleep(std::time::Duration::from_millis(10));
                continue;
            }
            Err(e) => return Err(loop_err("open", &path)(e)),
        };
        match configure(device.as_fd(), backing, shown, flags, &path) {
            Ok(()) => {
                tracing::debug!(device = %path.display(), file = %file.display(), "attached loop device");
                return Ok(LoopDevice {
                    path,
                    number,
                    fd: device,
                });
            }
            Err(e) if e.errno() == Some(Errno::EBUSY) => {
                tracing::debug!(device = %path.display(), attempt, "loop device taken meanwhile, retrying");
                continue;
            }
            Err(e) => return Err(e),
        }
    }
    Err(MountError::Loop {
        step: "find a free device",
        path: file.to_path_buf(),
        errno: Errno::EBUSY,
    })
}

fn configure(
    device: BorrowedFd<'_>,
    backing: BorrowedFd<'_>,
    file: &Path,
    flags: u32,
    path: &Path,
) -> Result<(), MountError> {
    let config = LoopConfig {
        fd: backing.as_raw_fd() as u32,
        block_size: 0,
        info: LoopInfo64::new(file, flags),
        reserved: [0; 8],
    };
    match ioctl(
        device,
        LOOP_CONFIGURE,
        &config as *const LoopConfig as libc::c_ulong,
    ) {
        Ok(_) => return Ok(()),
        // Kernels before 5.8 do not know LOOP_CONFIGURE.
        Err(Errno::EINVAL | Errno::ENOTTY) => {}
        Err(e) => return Err(loop_err("LOOP_CONFIGURE", path)(e)),
    }
    ioctl(device, LOOP_SET_FD, backing.as_raw_fd() as libc::c_ulong)
        .map_err(loop_err("LOOP_SET_FD", path))?;
    // LOOP_SET_STATUS64 cannot set READ_ONLY (it follows the backing fd's mode), only AUTOCLEAR.
    let info = LoopInfo64::new(file, flags & !LO_FLAGS_READ_ONLY);
    if let Err(e) = ioctl(
        device,
        LOOP_SET_STATUS64,
        &info as *const LoopInfo64 as libc::c_ulong,
    ) {
        // Do not leave a half-configured device behind.
        let _ = ioctl(device, LOOP_CLR_FD, 0);
        return Err(loop_err("LOOP_SET_STATUS64", path)(e));
    }
    Ok(())
}

fn clr_fd(fd: BorrowedFd<'_>, device: &Path) -> Result<(), MountError> {
    match ioctl(fd, LOOP_CLR_FD, 0) {
        Ok(_) | Err(Errno::ENXIO) => Ok(()),
        Err(e) => Err(loop_err("LOOP_CLR_FD", device)(e)),
    }
}

/// LOOP_CLR_FD on `device`; ENXIO (already free) is Ok. A device still in use (mounted) is freed when its
/// last user goes.
pub fn detach(device: &Path) -> Result<(), MountError> {
    let fd = open(device, OFlag::O_RDONLY | OFlag::O_CLOEXEC, Mode::empty())
        .map_err(loop_err("open", device))?;
    clr_fd(fd.as_fd(), device)
}

/// Every bound loop device with its backing file, from `/sys/block/loop*/loop/backing_file`. A backing file
/// that was deleted is reported under its old path (the kernel's " (deleted)" suffix is removed).
pub fn list() -> Result<Vec<(PathBuf, PathBuf)>, MountError> {
    let sys = Path::new("/sys/block");
    let entries = std::fs::read_dir(sys).map_err(|source| MountError::LoopSysfs {
        path: sys.to_path_buf(),
        source,
    })?;
    let mut found = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|source| MountError::LoopSysfs {
            path: sys.to_path_buf(),
            source,
        })?;
        let name = entry.file_name();
        if !name.as_bytes().starts_with(b"loop") {
            continue;
        }
        let file = entry.path().join("loop/backing_file");
        let text = match std::fs::read(&file) {
            Ok(text) => text,
            // Unbound devices have no loop/backing_file (or it vanished as we looked).
            Err(e) if matches!(e.kind(), std::io::ErrorKind::NotFound) => continue,
            // A device being detached (autoclear of another volume's last unmount) answers ENXIO or
            // ENODEV while its sysfs entry is torn down: it is not bound to anything any more.
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENXIO) | Some(libc::ENODEV)) => {
                continue
            }
            Err(source) => return Err(MountError::LoopSysfs { path: file, source }),
        };
        found.push((Path::new("/dev").join(&name), backing_path(&text)));
    }
    found.sort();
    Ok(found)
}

/// A `loop/backing_file` attribute's text as a path: the newline and the kernel's " (deleted)"
/// suffix removed.
fn backing_path(text: &[u8]) -> PathBuf {
    let text = text.strip_suffix(b"\n").unwrap_or(text);
    let text = text.strip_suffix(b" (deleted)").unwrap_or(text);
    PathBuf::from(OsStr::from_bytes(text))
}

/// Whether the block device `major:minor` is a loop device backed by `file`: one read of its
/// `/sys/dev/block/MAJOR:MINOR/loop/backing_file`, whatever the number of loop devices (a
/// device that is no loop device, or not bound, is not). Compared as
/// [`find_by_backing_file`] does.
pub fn is_backed_by(major: u32, minor: u32, file: &Path) -> bool {
    backing_file_of(major, minor)
        .is_some_and(|backing| backing == canonical(file) || backing == file)
}

/// The backing file of the block device `major:minor` when it is a bound loop device: one read
/// of `/sys/dev/block/MAJOR:MINOR/loop/backing_file`, whatever the number of loop devices;
/// `None` for any other device, an unbound one, or one being torn down.
pub fn backing_file_of(major: u32, minor: u32) -> Option<PathBuf> {
    let attr = PathBuf::from(format!("/sys/dev/block/{major}:{minor}/loop/backing_file"));
    std::fs::read(attr).ok().map(|text| backing_path(&text))
}

/// The absolute, symlink-free form of `path` when it exists, else `path` as given.
fn canonical(path: &Path) -> PathBuf {
    std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf())
}

/// Loop devices whose backing file is `file` (from /sys/block/loop*/loop/backing_file).
pub fn find_by_backing_file(file: &Path) -> Result<Vec<PathBuf>, MountError> {
    let want = canonical(file);
    Ok(list()?
        .into_iter()
        .filter(|(_, backing)| *backing == want || backing == file)
        .map(|(device, _)| device)
        .collect())
}

/// Loop devices whose backing file lies under `dir` (used by test cleanup).
pub fn find_backed_under(dir: &Path) -> Result<Vec<(PathBuf, PathBuf)>, MountError> {
    let want = canonical(dir);
    Ok(list()?
        .into_iter()
        .filter(|(_, backing)| backing.starts_with(&want) || backing.starts_with(dir))
        .collect())
}
