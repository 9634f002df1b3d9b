//! Unmounting that always ends: bounded EBUSY retries, then a lazy detach (MNT_DETACH), so a mount held busy
//! by some process never blocks cleanup forever. A path that is not mounted counts as done.

use crate::error_chain::Chain;
use std::path::Path;
use std::time::Duration;

use nix::errno::Errno;

use super::{MountError, MountTable, Syscall};

/// How an unmount ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnmountOutcome {
    /// umount2 succeeded.
    Unmounted,
    /// Nothing was mounted at the path.
    NotMounted,
    /// The mount stayed busy through every retry and was detached lazily.
    Detached,
}

/// umount2 with up to `attempts` EBUSY retries `delay` apart, then MNT_DETACH.
///
/// With `attempts == 0` a busy mount is detached right after the first try. Errors other than EBUSY are
/// returned at once. The path is looked up as umount2 does (symlinks followed): for paths in trees nobody
/// else writes; [`unmount_no_symlinks_with_retry`] is for the others.
pub fn unmount_with_retry(
    sys: &dyn Syscall,
    target: &Path,
    attempts: u32,
    delay: Duration,
) -> Result<UnmountOutcome, MountError> {
    retry_unmount(target, attempts, delay, |detach| {
        sys.unmount(target, detach)
    })
}

/// [`unmount_with_retry`] through [`Syscall::unmount_no_symlinks`]: for mount-table paths in trees a
/// container can write (its sandbox), where a symlink swapped in must not send the unmount elsewhere.
pub fn unmount_no_symlinks_with_retry(
    sys: &dyn Syscall,
    target: &Path,
    attempts: u32,
    delay: Duration,
) -> Result<UnmountOutcome, MountError> {
    retry_unmount(target, attempts, delay, |detach| {
        sys.unmount_no_symlinks(target, detach)
    })
}

/// The retry loop shared by every unmount form: `unmount(detach)` is one attempt.
pub fn retry_unmount(
    target: &Path,
    attempts: u32,
    delay: Duration,
    unmount: impl Fn(bool) -> Result<(), MountError>,
) -> Result<UnmountOutcome, MountError> {
    let mut retries = 0;
    loop {
        match unmount(false) {
            Ok(()) => {
                tracing::trace!(target = %target.display(), retries, "unmounted");
                return Ok(UnmountOutcome::Unmounted);
            }
            Err(MountError::NotMounted { .. }) => return Ok(UnmountOutcome::NotMounted),
            Err(e) if e.errno() == Some(Errno::EBUSY) => {
                if retries >= attempts {
                    break;
                }
                retries += 1;
                tracing::debug!(target = %target.display(), retries, "mount busy, retrying unmount");
                std::thread::sleep(delay);
            }
            Err(e) => return Err(e),
        }
    }
    tracing::warn!(target = %target.display(), attempts, "mount still busy, detaching lazily");
    match unmount(true) {
        Ok(()) => Ok(UnmountOutcome::Detached),
        // Someone else unmounted it between our last try and the detach.
        Err(MountError::NotMounted { .. }) => Ok(UnmountOutcome::NotMounted),
        Err(e) => Err(e),
    }
}

/// EBUSY retries used by [`unmount_all_under`] for each mount.
pub const DEFAULT_ATTEMPTS: u32 = 5;
/// Delay between EBUSY retries used by [`unmount_all_under`].
pub const DEFAULT_DELAY: Duration = Duration::from_millis(50);

/// Unmounts every mount at or below `prefix`, deepest first, each with [`unmount_no_symlinks_with_retry`]:
/// the table's paths hold no symlink, so one found on the way was swapped in and is refused.
///
/// Returns how many mounts were unmounted or detached (those found already gone are not counted).
pub fn unmount_all_under(
    sys: &dyn Syscall,
    table: &dyn MountTable,
    prefix: &Path,
) -> Result<usize, MountError> {
    sweep(sys, table, prefix, true)
}

/// [`unmount_all_under`] of the mounts strictly beneath `prefix`, leaving the mount at `prefix` itself:
/// what was mounted under a volume's host mount point (a container's mounts, propagated back through
/// rshared propagation), before the plugin unmounts the volume itself.
pub fn unmount_all_beneath(
    sys: &dyn Syscall,
    table: &dyn MountTable,
    prefix: &Path,
) -> Result<usize, MountError> {
    // Nearly always nothing is: asked of the kernel without the table when it can say.
    if table.has_child_mounts(prefix)? == Some(false) {
        return Ok(0);
    }
    sweep(sys, table, prefix, false)
}

/// The mounts at (if `with_prefix`) or below `prefix`, from the table, deepest first.
fn found_under(
    table: &dyn MountTable,
    prefix: &Path,
    with_prefix: bool,
) -> Result<Vec<super::MountInfo>, MountError> {
    let mut mounts = table.mounts_under(prefix)?;
    if !with_prefix {
        mounts.retain(|m| m.mount_point != prefix);
    }
    Ok(mounts)
}

fn sweep(
    sys: &dyn Syscall,
    table: &dyn MountTable,
    prefix: &Path,
    with_prefix: bool,
) -> Result<usize, MountError> {
    let mut count = 0;
    let mut first_error = None;
    // A mount that is not where the table said (renamed away, or swapped for a symlink by whoever
    // can write the tree) is looked for again in a fresh table; what is still there after the last
    // round is an error, never a silent success.
    for _round in 0..SWEEP_ROUNDS {
        let mounts = found_under(table, prefix, with_prefix)?;
        if mounts.is_empty() {
            return Ok(count);
        }
        for mount in mounts {
            match unmount_no_symlinks_with_retry(
                sys,
                &mount.mount_point,
                DEFAULT_ATTEMPTS,
                DEFAULT_DELAY,
            ) {
                Ok(UnmountOutcome::Unmounted | UnmountOutcome::Detached) => count += 1,
                Ok(UnmountOutcome::NotMounted) => {}
                // Go on with the others; the next round reads the table again.
                Err(e) => {
                    tracing::warn!(mount_point = %mount.mount_point.display(), error = %Chain(&e), "unmount failed");
                    first_error.get_or_insert(e);
                }
            }
        }
    }
    let left = found_under(table, prefix, with_prefix)?;
    if left.is_empty() {
        return Ok(count);
    }
    Err(first_error.unwrap_or_else(|| MountError::Unmount {
        target: left[0].mount_point.clone(),
        errno: Errno::EBUSY,
    }))
}

/// How many times [`unmount_all_under`] reads the table again for mounts still there.
const SWEEP_ROUNDS: u32 = 3;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mount::{Call, CallKind, FakeSyscall};
    use std::path::PathBuf;

    fn unmount_call(target: &str, detach: bool) -> Call {
        Call::Unmount {
            target: PathBuf::from(target),
            detach,
        }
    }

    #[test]
    fn busy_mount_is_retried_then_detached() {
        let fake = FakeSyscall::new();
        fake.add_mount("tmpfs", Path::new("/w/busy"), "tmpfs");
        fake.busy(Path::new("/w/busy"), 100);
        let outcome = unmount_with_retry(&fake, Path::new("/w/busy"), 3, Duration::ZERO).unwrap();
        assert_eq!(outcome, UnmountOutcome::Detached);
        assert_eq!(
            fake.calls(),
            vec![
                unmount_call("/w/busy", false),
                unmount_call("/w/busy", false),
                unmount_call("/w/busy", false),
                unmount_call("/w/busy", false),
                unmount_call("/w/busy", true),
            ]
        );
        assert!(!fake.is_mount_point(Path::new("/w/busy")).unwrap());
    }

    #[test]
    fn busy_mount_that_frees_up_is_unmounted_without_detach() {
        let fake = FakeSyscall::new();
        fake.add_mount("tmpfs", Path::new("/w/m"), "tmpfs");
        fake.fail(CallKind::Unmount, Errno::EBUSY, 2);
        let outcome = unmount_with_retry(&fake, Path::new("/w/m"), 5, Duration::ZERO).unwrap();
        assert_eq!(outcome, UnmountOutcome::Unmounted);
        assert_eq!(fake.calls(), vec![unmount_call("/w/m", false); 3]);
        assert!(fake.mounts().unwrap().is_empty());
    }

    #[test]
    fn zero_attempts_detaches_after_first_busy() {
        let fake = FakeSyscall::new();
        fake.add_mount("tmpfs", Path::new("/w/m"), "tmpfs");
        fake.busy(Path::new("/w/m"), 1);
        let outcome = unmount_with_retry(&fake, Path::new("/w/m"), 0, Duration::ZERO).unwrap();
        assert_eq!(outcome, UnmountOutcome::Detached);
        assert_eq!(
            fake.calls(),
            vec![unmount_call("/w/m", false), unmount_call("/w/m", true)]
        );
    }

    #[test]
    fn not_mounted_is_done() {
        let fake = FakeSyscall::new();
        let outcome = unmount_with_retry(&fake, Path::new("/w/none"), 3, Duration::ZERO).unwrap();
        assert_eq!(outcome, UnmountOutcome::NotMounted);
        assert_eq!(fake.calls(), vec![unmount_call("/w/none", false)]);
        // EINVAL injected as the kernel would answer it also means "not mounted".
        fake.add_mount("tmpfs", Path::new("/w/x"), "tmpfs");
        fake.fail(CallKind::Unmount, Errno::EINVAL, 1);
        assert_eq!(
            unmount_with_retry(&fake, Path::new("/w/x"), 3, Duration::ZERO).unwrap(),
            UnmountOutcome::NotMounted
        );
    }

    #[test]
    fn other_errors_are_not_retried() {
        let fake = FakeSyscall::new();
        fake.add_mount("tmpfs", Path::new("/w/m"), "tmpfs");
        fake.fail(CallKind::Unmount, Errno::EPERM, 1);
        let err = unmount_with_retry(&fake, Path::new("/w/m"), 3, Duration::ZERO).unwrap_err();
        assert_eq!(err.errno(), Some(Errno::EPERM));
        assert!(
            matches!(err, MountError::Unmount { ref target, .. } if target == Path::new("/w/m"))
        );
        assert_eq!(
            err.to_string(),
            "unmount /w/m: EPERM: Operation not permitted"
        );
        assert_eq!(fake.calls().len(), 1);
        assert!(fake.is_mount_point(Path::new("/w/m")).unwrap());
    }

    #[test]
    fn failed_detach_is_reported() {
        let fake = FakeSyscall::new();
        fake.add_mount("tmpfs", Path::new("/w/m"), "tmpfs");
        fake.busy(Path::new("/w/m"), 2);
        fake.fail_when(
            |c| matches!(c, Call::Unmount { detach: true, .. }),
            Errno::EPERM,
            1,
        );
        let err = unmount_with_retry(&fake, Path::new("/w/m"), 1, Duration::ZERO).unwrap_err();
        assert_eq!(err.errno(), Some(Errno::EPERM));
        assert_eq!(fake.calls().last(), Some(&unmount_call("/w/m", true)));
    }

    fn layout(fake: &FakeSyscall) {
        for (source, at) in [
            ("a", "/w/a"),
            ("b1", "/w/a/b"),
            ("c", "/w/a/b/c"),
            ("b2", "/w/a/b"),
            ("x", "/w/a/x"),
            ("ab", "/w/ab"),
            ("other", "/other"),
        ] {
            fake.add_mount(source, Path::new(at), "tmpfs");
        }
    }

    #[test]
    fn mounts_under_is_deepest_first_and_topmost_first() {
        let fake = FakeSyscall::new();
        layout(&fake);
        let under: Vec<(String, PathBuf)> = fake
            .mounts_under(Path::new("/w/a"))
            .unwrap()
            .into_iter()
            .map(|m| (m.source, m.mount_point))
            .collect();
        assert_eq!(
            under,
            vec![
                ("c".to_string(), PathBuf::from("/w/a/b/c")),
                ("x".to_string(), PathBuf::from("/w/a/x")),
                ("b2".to_string(), PathBuf::from("/w/a/b")),
                ("b1".to_string(), PathBuf::from("/w/a/b")),
                ("a".to_string(), PathBuf::from("/w/a")),
            ]
        );
        assert_eq!(
            fake.find(Path::new("/w/a/b")).unwrap().unwrap().source,
            "b2"
        );
        assert!(fake.find(Path::new("/w/a/b/c/d")).unwrap().is_none());
        assert!(fake.is_mount_point(Path::new("/w/ab")).unwrap());
        assert!(!fake.is_mount_point(Path::new("/w")).unwrap());
    }

    #[test]
    fn unmount_all_under_unmounts_in_order_and_spares_siblings() {
        let fake = FakeSyscall::new();
        layout(&fake);
        fake.busy(Path::new("/w/a/x"), 1);
        let n = unmount_all_under(&fake, &fake, Path::new("/w/a")).unwrap();
        assert_eq!(n, 5);
        assert_eq!(
            fake.calls(),
            vec![
                unmount_call("/w/a/b/c", false),
                unmount_call("/w/a/x", false),
                unmount_call("/w/a/x", false),
                unmount_call("/w/a/b", false),
                unmount_call("/w/a/b", false),
                unmount_call("/w/a", false),
            ]
        );
        let left: Vec<PathBuf> = fake
            .mounts()
            .unwrap()
            .into_iter()
            .map(|m| m.mount_point)
            .collect();
        assert_eq!(left, vec![PathBuf::from("/w/ab"), PathBuf::from("/other")]);
        // Nothing left: a second pass does nothing.
        fake.clear_calls();
        assert_eq!(
            unmount_all_under(&fake, &fake, Path::new("/w/a")).unwrap(),
            0
        );
        assert!(fake.calls().is_empty());
    }

    /// A sweep beneath a mount point that has no child mount asks the table nothing and
    /// unmounts nothing; one with children sweeps them and leaves the mount point itself.
    #[test]
    fn a_sweep_beneath_a_mount_without_children_is_skipped() {
        let fake = FakeSyscall::new();
        layout(&fake);
        assert_eq!(
            fake.has_child_mounts(Path::new("/w/ab")).unwrap(),
            Some(false)
        );
        assert_eq!(
            fake.has_child_mounts(Path::new("/w/a")).unwrap(),
            Some(true)
        );
        // Not a mount root: cannot tell.
        assert_eq!(fake.has_child_mounts(Path::new("/w")).unwrap(), None);
        fake.clear_calls();
        assert_eq!(
            unmount_all_beneath(&fake, &fake, Path::new("/w/ab")).unwrap(),
            0
        );
        assert!(fake.calls().is_empty());
        // b twice (stacked), c, x.
        assert_eq!(
            unmount_all_beneath(&fake, &fake, Path::new("/w/a")).unwrap(),
            4
        );
        assert!(fake.is_mount_point(Path::new("/w/a")).unwrap());
        assert_eq!(
            fake.has_child_mounts(Path::new("/w/a")).unwrap(),
            Some(false)
        );
    }
}
