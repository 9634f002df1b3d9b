//! The mount flags of a `mount` volume capability, and what the plugin makes of them (its fs
//! types are the backing's: [`crate::backing::check_fs_type`]). Nothing asked is ignored: a
//! flag is applied on every mount of the volume the plugin makes (staging and target), or the
//! request is refused naming it.
//!
//! Flags applied: `ro` (read-only), `rw` (the default, stated), `noatime`, `nodev`, `nosuid`,
//! `noexec`. Every mount of volume data here carries nosuid,nodev anyway (a host path to data a
//! container writes); asking for them is accepted, and tells the CO to keep them in the
//! container too. A flag that would weaken the host (`suid`, `dev`, `exec`, ...), `rw` beside a
//! read-only request or a reader-only access mode, and anything else unknown (including
//! comma-joined lists such as `nolock,vers=4.2`) are refused.

use csi_isolator::mount::MountFlags;

/// The mount flags the plugin applies.
pub const APPLIED_FLAGS: [&str; 6] = ["ro", "rw", "noatime", "nodev", "nosuid", "noexec"];

/// Flags refused because they would undo a protection of the host or of a read-only request.
const WEAKENING_FLAGS: [&str; 8] = [
    "suid", "dev", "exec", "remount", "bind", "rbind", "move", "defaults",
];

/// Checks mount flags; the reason names the first flag refused. `reader_only`: the access mode
/// only allows reading, so `rw` contradicts it.
pub fn check_flags(flags: &[String], reader_only: bool) -> Result<(), String> {
    for flag in flags {
        if WEAKENING_FLAGS.contains(&flag.as_str()) {
            return Err(format!(
                "mount flag {flag:?} would weaken the host's protection of volume data and is refused (applied: {})",
                APPLIED_FLAGS.join(", ")
            ));
        }
        if !APPLIED_FLAGS.contains(&flag.as_str()) {
            return Err(format!(
                "mount flag {flag:?} is not supported (supported: {})",
                APPLIED_FLAGS.join(", ")
            ));
        }
    }
    let has = |f: &str| flags.iter().any(|g| g == f);
    if has("ro") && has("rw") {
        return Err("mount flags \"ro\" and \"rw\" contradict each other".to_string());
    }
    if reader_only && has("rw") {
        return Err("mount flag \"rw\" contradicts the reader-only access mode".to_string());
    }
    Ok(())
}

/// The kernel flags of checked mount flags (`ro` as `readonly`). nosuid and nodev are set on
/// every mount anyway ([`MountFlags::HOST_ONLY`]).
pub fn mount_flags(flags: &[String]) -> MountFlags {
    let has = |f: &str| flags.iter().any(|g| g == f);
    MountFlags {
        readonly: has("ro"),
        noexec: has("noexec"),
        noatime: has("noatime"),
        ..MountFlags::HOST_ONLY
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn applied_flags_pass_and_others_are_refused_by_name() {
        for ok in [
            &[][..],
            &["ro"],
            &["rw"],
            &["noatime", "nodev", "nosuid", "noexec"],
            &["ro", "noexec"],
        ] {
            assert_eq!(check_flags(&flags(ok), false), Ok(()), "{ok:?}");
        }
        // (flags, reader-only mode, words the reason holds)
        let refused: [(&[&str], bool, &str); 9] = [
            (&["suid"], false, "\"suid\" would weaken"),
            (&["dev"], false, "\"dev\" would weaken"),
            (&["exec"], false, "\"exec\" would weaken"),
            (&["remount"], false, "\"remount\" would weaken"),
            (&["nodiratime"], false, "\"nodiratime\" is not supported"),
            (
                &["nolock,vers=4.2"],
                false,
                "\"nolock,vers=4.2\" is not supported",
            ),
            (&["ro", "rw"], false, "contradict each other"),
            (&["rw"], true, "contradicts the reader-only access mode"),
            (&["noatime", "RO"], false, "\"RO\" is not supported"),
        ];
        for (names, reader_only, words) in refused {
            let reason = check_flags(&flags(names), reader_only).unwrap_err();
            assert!(reason.contains(words), "{names:?}: {reason}");
        }
        assert_eq!(check_flags(&flags(&["ro"]), true), Ok(()));
    }

    #[test]
    fn flags_become_kernel_flags_over_the_hosts_own() {
        let f = mount_flags(&flags(&["ro", "noatime", "noexec"]));
        assert!(f.readonly && f.noatime && f.noexec && f.nosuid && f.nodev);
        assert_eq!(mount_flags(&[]), MountFlags::HOST_ONLY);
    }
}
