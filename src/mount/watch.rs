//! Change notification for this process's mount table: what changed since the last look, without
//! reading the table or checking every mount.
//!
//! Contract:
//! - [`MountWatch::changes`] never blocks and costs O(changes since the last call), not O(mounts).
//! - [`MountChanges::Detached`] lists the 64-bit unique ids (statx `STATX_MNT_ID_UNIQUE`, never reused
//!   until reboot) of the mounts detached from this mount namespace since the last call; mounts attached
//!   are not reported (a caller learns the ids of its own mounts with [`MountTable::check_mount_root`]).
//! - [`MountChanges::Unknown`] means "anything may have changed": the caller checks everything. It is
//!   the answer to a lost event (queue overflow), a read error, a record that cannot be parsed, and
//!   the only answer of [`NoWatch`]; a watch never answers [`MountChanges::Nothing`] on a guess.
//! - Kernel ≥ 6.15: [`FanotifyWatch`], fanotify mount events on the namespace (`FAN_MARK_MNTNS`).
//!   The kernel queues a detach event while the unmounting process still holds the namespace lock,
//!   before umount(2) returns (fs/namespace.c: `umount_tree` adds each detached mount to the notify
//!   list, `namespace_unlock` sends it), so once an unmount has returned, the next call reports it.
//! - Older kernels: [`PollWatch`], `/proc/self/mountinfo` polled with POLLPRI, timeout 0: the kernel
//!   flags a change of the namespace since the last poll on that file (fs/proc_namespace.c
//!   `mounts_poll`); a change is [`MountChanges::Unknown`], no change is [`MountChanges::Nothing`].
//! - The watch reads only what the kernel writes about this namespace; no path, name or content of a
//!   mount is read, so nothing a container or another user puts in the table is parsed here beyond
//!   fixed-size binary records, each bounds-checked.
//!
//! [`MountTable::check_mount_root`]: crate::mount::MountTable::check_mount_root

use std::fmt;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};

use nix::errno::Errno;

use crate::mount::MountError;

// include/uapi/linux/fanotify.h (Linux 6.15); libc 0.2 does not have them yet.
const FAN_REPORT_MNT: libc::c_uint = 0x0000_4000;
const FAN_MARK_MNTNS: libc::c_uint = 0x0000_0110;
const FAN_MNT_ATTACH: u64 = 0x0100_0000;
const FAN_MNT_DETACH: u64 = 0x0200_0000;
const FAN_EVENT_INFO_TYPE_MNT: u8 = 7;
/// `struct fanotify_event_metadata` (event_len u32, vers u8, reserved u8, metadata_len u16, mask u64,
/// fd s32, pid s32).
const METADATA_LEN: usize = 24;
/// `struct fanotify_event_info_mnt`: a 4-byte info header, then the u64 id at its natural alignment.
const INFO_MNT_LEN: usize = 16;

/// What changed in the mount table since the last look.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MountChanges {
    /// Nothing.
    Nothing,
    /// These mounts (unique mount ids) were detached; nothing else that matters changed.
    Detached(Vec<u64>),
    /// The watch cannot say: anything may have changed.
    Unknown,
}

impl MountChanges {
    /// These changes, then `later` ones.
    pub fn then(self, later: MountChanges) -> MountChanges {
        match (self, later) {
            (MountChanges::Unknown, _) | (_, MountChanges::Unknown) => MountChanges::Unknown,
            (MountChanges::Nothing, l) => l,
            (s, MountChanges::Nothing) => s,
            (MountChanges::Detached(mut a), MountChanges::Detached(b)) => {
                a.extend(b);
                MountChanges::Detached(a)
            }
        }
    }
}

/// How a watch learns of changes (for the logs and `status`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WatchMode {
    /// fanotify mount events: which mounts were detached.
    Fanotify,
    /// POLLPRI on `/proc/self/mountinfo`: whether anything changed.
    Poll,
    /// No watch: every look is "anything may have changed".
    None,
}

impl fmt::Display for WatchMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            WatchMode::Fanotify => "fanotify mount events",
            WatchMode::Poll => "mountinfo poll",
            WatchMode::None => "none (every launch checks every volume in use)",
        })
    }
}

/// A source of mount table changes (see the module doc).
pub trait MountWatch: Send + Sync + fmt::Debug {
    /// How it learns of changes.
    fn mode(&self) -> WatchMode;
    /// What changed since the last call (the first call: since the watch was made). Never blocks.
    fn changes(&self) -> MountChanges;
}

/// The best watch the kernel offers: fanotify mount events, else the mountinfo poll, else none.
/// Says once, in the log, which one it is and why a better one could not be made.
pub fn kernel_watch() -> Box<dyn MountWatch> {
    match FanotifyWatch::open() {
        Ok(w) => {
            tracing::info!(mode = %w.mode(), "watching the mount table");
            return Box::new(w);
        }
        Err(e) => {
            tracing::info!(error = %e, "no fanotify mount events (Linux 6.15 or later, CAP_SYS_ADMIN); trying the mountinfo poll")
        }
    }
    match PollWatch::open() {
        Ok(w) => {
            tracing::info!(mode = %w.mode(), "watching the mount table");
            Box::new(w)
        }
        Err(e) => {
            tracing::warn!(error = %e, mode = %WatchMode::None, "cannot watch the mount table: every launch checks every volume in use");
            Box::new(NoWatch)
        }
    }
}

/// No watch: every look says anything may have changed.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoWatch;

impl MountWatch for NoWatch {
    fn mode(&self) -> WatchMode {
        WatchMode::None
    }
    fn changes(&self) -> MountChanges {
        MountChanges::Unknown
    }
}

/// fanotify mount events on this process's mount namespace (Linux ≥ 6.15).
#[derive(Debug)]
pub struct FanotifyWatch {
    fd: OwnedFd,
}

impl FanotifyWatch {
    /// A non-blocking fanotify group reporting mounts attached to and detached from the calling
    /// thread's mount namespace.
    pub fn open() -> Result<FanotifyWatch, MountError> {
        let watch_err = |step: &'static str, errno: Errno| MountError::Watch { step, errno };
        // SAFETY: plain syscall with integer flags; the result is checked before use.
        let raw = unsafe {
            libc::fanotify_init(FAN_REPORT_MNT | libc::FAN_CLOEXEC | libc::FAN_NONBLOCK, 0)
        };
        if raw < 0 {
            return Err(watch_err("fanotify_init(FAN_REPORT_MNT)", Errno::last()));
        }
        // SAFETY: fanotify_init returned a new fd that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: fd is a live fanotify fd, the path is a NUL-terminated literal, AT_FDCWD is valid.
        let rc = unsafe {
            libc::fanotify_mark(
                fd.as_raw_fd(),
                libc::FAN_MARK_ADD | FAN_MARK_MNTNS,
                FAN_MNT_ATTACH | FAN_MNT_DETACH,
                libc::AT_FDCWD,
                c"/proc/self/ns/mnt".as_ptr(),
            )
        };
        if rc != 0 {
            return Err(watch_err(
                "fanotify_mark(FAN_MARK_MNTNS, /proc/self/ns/mnt)",
                Errno::last(),
            ));
        }
        Ok(FanotifyWatch { fd })
    }
}

impl MountWatch for FanotifyWatch {
    fn mode(&self) -> WatchMode {
        WatchMode::Fanotify
    }

    fn changes(&self) -> MountChanges {
        let mut buf = vec![0u8; 64 * 1024];
        let mut detached = Vec::new();
        loop {
            match nix::unistd::read(self.fd.as_fd(), &mut buf) {
                Ok(0) => return MountChanges::Detached(detached),
                Ok(n) => {
                    if let Err(e) = parse_events(&buf[..n], &mut detached) {
                        tracing::warn!(error = %e, "mount events lost: checking every volume in use");
                        // Drain the rest so the next look starts clean.
                        while matches!(nix::unistd::read(self.fd.as_fd(), &mut buf), Ok(n) if n > 0)
                        {
                        }
                        return MountChanges::Unknown;
                    }
                }
                Err(Errno::EAGAIN) => {
                    return if detached.is_empty() {
                        MountChanges::Nothing
                    } else {
                        MountChanges::Detached(detached)
                    }
                }
                Err(Errno::EINTR) => continue,
                Err(errno) => {
                    tracing::warn!(%errno, "cannot read mount events: checking every volume in use");
                    return MountChanges::Unknown;
                }
            }
        }
    }
}

/// Why a buffer of fanotify events does not say which mounts were detached.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EventsLost {
    /// The kernel's queue overflowed (FAN_Q_OVERFLOW): events were dropped.
    #[error("the kernel's fanotify queue overflowed")]
    Overflow,
    /// A record does not fit what the kernel promises.
    #[error("malformed fanotify record at byte {at}: {why}")]
    Malformed {
        /// Its offset in the buffer.
        at: usize,
        /// What is wrong with it.
        why: &'static str,
    },
}

/// Appends to `detached` the unique mount id of every FAN_MNT_DETACH event in `buf` (what one read of
/// a FAN_REPORT_MNT group returned); attach events are skipped. Pure: the decision apart from the read.
pub fn parse_events(buf: &[u8], detached: &mut Vec<u64>) -> Result<(), EventsLost> {
    let mut at = 0;
    while at < buf.len() {
        let rest = &buf[at..];
        if rest.len() < METADATA_LEN {
            return Err(EventsLost::Malformed {
                at,
                why: "shorter than the event metadata",
            });
        }
        let event_len = u32::from_ne_bytes(rest[0..4].try_into().unwrap()) as usize;
        let metadata_len = u16::from_ne_bytes(rest[6..8].try_into().unwrap()) as usize;
        let mask = u64::from_ne_bytes(rest[8..16].try_into().unwrap());
        if rest[4] != libc::FANOTIFY_METADATA_VERSION {
            return Err(EventsLost::Malformed {
                at,
                why: "unknown metadata version",
            });
        }
        if event_len < METADATA_LEN
            || metadata_len < METADATA_LEN
            || metadata_len > event_len
            || event_len > rest.len()
        {
            return Err(EventsLost::Malformed {
                at,
                why: "lengths out of bounds",
            });
        }
        if mask & libc::FAN_Q_OVERFLOW != 0 {
            return Err(EventsLost::Overflow);
        }
        if mask & FAN_MNT_DETACH != 0 {
            detached.push(mount_id_of(&rest[metadata_len..event_len]).ok_or(
                EventsLost::Malformed {
                    at,
                    why: "detach event without a mount id record",
                },
            )?);
        }
        at += event_len;
    }
    Ok(())
}

/// The mount id in an event's info records (`None` if it has none).
fn mount_id_of(mut info: &[u8]) -> Option<u64> {
    while info.len() >= 4 {
        let (kind, len) = (info[0], u16::from_ne_bytes([info[2], info[3]]) as usize);
        if len < 4 || len > info.len() {
            return None;
        }
        if kind == FAN_EVENT_INFO_TYPE_MNT && len >= INFO_MNT_LEN {
            return Some(u64::from_ne_bytes(info[8..16].try_into().unwrap()));
        }
        info = &info[len..];
    }
    None
}

/// POLLPRI on `/proc/self/mountinfo`: whether this namespace's table changed since the last look.
#[derive(Debug)]
pub struct PollWatch {
    file: std::fs::File,
}

impl PollWatch {
    /// Opens `/proc/self/mountinfo` and takes its current state as seen.
    pub fn open() -> Result<PollWatch, MountError> {
        let file = std::fs::File::open("/proc/self/mountinfo").map_err(|e| MountError::Watch {
            step: "open /proc/self/mountinfo",
            errno: Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO)),
        })?;
        let watch = PollWatch { file };
        watch.poll().map_err(|errno| MountError::Watch {
            step: "poll /proc/self/mountinfo",
            errno,
        })?;
        Ok(watch)
    }

    /// Whether the table changed since the last poll (the kernel resets the flag with this answer).
    fn poll(&self) -> Result<bool, Errno> {
        let mut fds = [libc::pollfd {
            fd: self.file.as_raw_fd(),
            events: libc::POLLPRI,
            revents: 0,
        }];
        loop {
            // SAFETY: fds is one valid pollfd for an fd this watch owns; timeout 0 never blocks.
            let rc = unsafe { libc::poll(fds.as_mut_ptr(), 1, 0) };
            if rc >= 0 {
                return Ok(fds[0].revents & (libc::POLLPRI | libc::POLLERR) != 0);
            }
            match Errno::last() {
                Errno::EINTR => continue,
                errno => return Err(errno),
            }
        }
    }
}

impl MountWatch for PollWatch {
    fn mode(&self) -> WatchMode {
        WatchMode::Poll
    }

    fn changes(&self) -> MountChanges {
        match self.poll() {
            Ok(false) => MountChanges::Nothing,
            Ok(true) => MountChanges::Unknown,
            Err(errno) => {
                tracing::warn!(%errno, "cannot poll /proc/self/mountinfo: checking every volume in use");
                MountChanges::Unknown
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(mask: u64, info: &[u8]) -> Vec<u8> {
        let len = (METADATA_LEN + info.len()) as u32;
        let mut e = Vec::new();
        e.extend(len.to_ne_bytes());
        e.push(libc::FANOTIFY_METADATA_VERSION);
        e.push(0);
        e.extend((METADATA_LEN as u16).to_ne_bytes());
        e.extend(mask.to_ne_bytes());
        e.extend((-1i32).to_ne_bytes());
        e.extend(0i32.to_ne_bytes());
        e.extend(info);
        e
    }

    fn mnt_info(id: u64) -> Vec<u8> {
        let mut i = vec![FAN_EVENT_INFO_TYPE_MNT, 0];
        i.extend((INFO_MNT_LEN as u16).to_ne_bytes());
        i.extend([0; 4]);
        i.extend(id.to_ne_bytes());
        i
    }

    #[test]
    fn detach_events_give_their_mount_ids_and_attach_events_nothing() {
        let mut buf = event(FAN_MNT_ATTACH, &mnt_info(7));
        buf.extend(event(FAN_MNT_DETACH, &mnt_info(0x1_0000_0042)));
        buf.extend(event(FAN_MNT_DETACH, &mnt_info(9)));
        let mut ids = Vec::new();
        parse_events(&buf, &mut ids).unwrap();
        assert_eq!(ids, [0x1_0000_0042, 9]);
    }

    #[test]
    fn an_overflow_or_a_malformed_record_says_events_were_lost() {
        let mut ids = Vec::new();
        let overflow = event(libc::FAN_Q_OVERFLOW, &[]);
        assert_eq!(parse_events(&overflow, &mut ids), Err(EventsLost::Overflow));
        let good = event(FAN_MNT_DETACH, &mnt_info(3));
        // (buffer, what is wrong)
        let mut too_long = good.clone();
        too_long[0..4].copy_from_slice(&1000u32.to_ne_bytes());
        let mut too_short = good.clone();
        too_short[0..4].copy_from_slice(&8u32.to_ne_bytes());
        let mut meta_past_end = good.clone();
        meta_past_end[6..8].copy_from_slice(&200u16.to_ne_bytes());
        let mut bad_version = good.clone();
        bad_version[4] = 99;
        let mut info_len_zero = good.clone();
        info_len_zero[METADATA_LEN + 2..METADATA_LEN + 4].copy_from_slice(&0u16.to_ne_bytes());
        let no_info = event(FAN_MNT_DETACH, &[]);
        let cases = [
            (good[..10].to_vec(), "truncated metadata"),
            (too_long, "event longer than the buffer"),
            (too_short, "event shorter than its metadata"),
            (meta_past_end, "metadata past the event"),
            (bad_version, "unknown version"),
            (info_len_zero, "info record of length 0"),
            (no_info, "detach without a mount id"),
        ];
        for (buf, what) in cases {
            assert!(
                matches!(
                    parse_events(&buf, &mut ids),
                    Err(EventsLost::Malformed { .. })
                ),
                "{what}"
            );
        }
    }

    #[test]
    fn changes_combine_unknown_first() {
        use MountChanges::*;
        let cases = [
            (Nothing, Nothing, Nothing),
            (Nothing, Detached(vec![1]), Detached(vec![1])),
            (Detached(vec![1]), Nothing, Detached(vec![1])),
            (Detached(vec![1]), Detached(vec![2]), Detached(vec![1, 2])),
            (Detached(vec![1]), Unknown, Unknown),
            (Unknown, Nothing, Unknown),
        ];
        for (a, b, want) in cases {
            assert_eq!(a.clone().then(b.clone()), want, "{a:?} then {b:?}");
        }
    }
}
