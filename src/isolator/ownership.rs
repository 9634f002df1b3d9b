//! Volumes a non-root workload can write: Mesos' rule for persistent volumes, applied to CSI
//! volumes. A volume the container does not share (its resource has no `shared` marker) and
//! mounts read-write is made writable for the workload's group: its root directory's group
//! becomes the workload's gid, with group read, write and search and the set-group-id bit (so
//! what the workload creates there keeps the group). Nothing else changes: the owner stays
//! root, other users' bits stay as they are, nothing beneath the root is touched. A shared
//! volume is left alone (its users would fight over it), as Mesos does.
//!
//! Who makes the root writable: a plugin with the node capability VOLUME_MOUNT_GROUP is given
//! the group (`volume_mount_group`, see [`crate::provider::mount_group`]) for each mount of a
//! whole mount volume ([`groups_for_plugins`]) and owns it from then on; the isolator grants
//! the rest itself ([`left_to_isolator`]): a plugin without the capability, a volume staged
//! before without a group, a persistent volume's directory inside a PATH disk.
//!
//! Contract: [`resolve_user`] reads `UID[:GID]` or `NAME[:GROUP]` (names from the host's
//! user and group databases, as Mesos resolves a task's user on the agent); [`group_to_grant`]
//! is the pure rule; [`grant_group`] applies it to one volume root by fd (never following a
//! symlink on the way, see [`VolumeMount::open_source`]) and does nothing when the root already
//! has that group and those bits, so a volume is changed once, not on every launch.

use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;

use crate::io_step::IoStep;
use crate::launcher::Credentials;
use crate::mount::VolumeMount;
use crate::provider::MountGroups;

/// The bits a granted volume root has: group read, write and search, and set-group-id.
pub const GRANTED_BITS: u32 = 0o2070;

/// The user and group `text` names: `UID[:GID]` (a uid without a gid gets the primary group the
/// host's user database gives it, or the gid equal to the uid when it has no entry) or
/// `NAME[:GROUP]` (looked up on the host).
pub fn resolve_user(text: &str) -> Result<Credentials, String> {
    let (user, group) = match text.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (text, None),
    };
    if user.is_empty() || group.is_some_and(str::is_empty) {
        return Err(format!(
            "user '{}': expected UID[:GID] or NAME[:GROUP]",
            crate::shown::shown(text)
        ));
    }
    let entry = |found: Result<Option<nix::unistd::User>, nix::Error>| {
        found.map_err(|errno| format!("user '{}': look it up: {errno}", crate::shown::shown(user)))
    };
    let (uid, primary) = match user.parse::<u32>() {
        // Both numbers given: nothing to look up.
        Ok(uid) if group.is_some_and(|g| g.parse::<u32>().is_ok()) => (uid, 0),
        Ok(uid) => {
            let known = entry(nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid)))?;
            (uid, known.map(|u| u.gid.as_raw()).unwrap_or(uid))
        }
        Err(_) => {
            let known = entry(nix::unistd::User::from_name(user))?.ok_or_else(|| {
                format!(
                    "user '{}' is not in the host's user database (give a numeric UID[:GID])",
                    crate::shown::shown(user)
                )
            })?;
            (known.uid.as_raw(), known.gid.as_raw())
        }
    };
    let gid = match group {
        None => primary,
        Some(g) => match g.parse::<u32>() {
            Ok(gid) => gid,
            Err(_) => nix::unistd::Group::from_name(g)
                .map_err(|errno| {
                    format!("group '{}': look it up: {errno}", crate::shown::shown(g))
                })?
                .ok_or_else(|| {
                    format!(
                        "group '{}' is not in the host's group database (give a numeric GID)",
                        crate::shown::shown(g)
                    )
                })?
                .gid
                .as_raw(),
        },
    };
    Ok(Credentials { uid, gid })
}

/// The group a volume root is to be made writable for: the workload's, when it is not root, the
/// volume is mounted read-write and the container does not share it.
pub fn group_to_grant(user: Option<Credentials>, readonly: bool, shared: bool) -> Option<u32> {
    match user {
        Some(u) if u.uid != 0 && !readonly && !shared => Some(u.gid),
        _ => None,
    }
}

/// The groups to ask the plugins for, out of the grants the rule gives ([`group_to_grant`]):
/// those of mounts of a whole CSI mount volume (its mount point itself: not a block volume, not
/// a persistent volume's directory inside a PATH disk), by (provider id, volume id).
pub fn groups_for_plugins(grants: &[(VolumeMount, u32)]) -> MountGroups {
    grants
        .iter()
        .filter(|(m, _)| !m.block && m.source_root.is_none())
        .filter_map(|(m, gid)| Some(((m.provider_id.clone()?, m.volume_id.clone()?), *gid)))
        .collect()
}

/// The grants the isolator still makes itself once the volumes are published: all but those
/// of the volumes it asked a group for (`asked`) that their plugin staged with a group
/// (`staged`, whichever: a volume staged for another group stays the plugin's, as it was
/// staged for its other users).
pub fn left_to_isolator(
    grants: Vec<(VolumeMount, u32)>,
    asked: &MountGroups,
    staged: &MountGroups,
) -> Vec<(VolumeMount, u32)> {
    grants
        .into_iter()
        .filter(|(m, _)| {
            let key = (
                m.provider_id.clone().unwrap_or_default(),
                m.volume_id.clone().unwrap_or_default(),
            );
            !(asked.contains_key(&key)
                && staged.contains_key(&key)
                && !m.block
                && m.source_root.is_none())
        })
        .collect()
}

/// Makes the volume root of `mount` writable for `gid` (see the module doc); whether it changed
/// anything.
pub fn grant_group(mount: &VolumeMount, gid: u32) -> Result<bool, IoStep> {
    let root = &mount.source;
    let fd = mount
        .open_source()
        .map_err(|e| IoStep::new("open volume root", root, std::io::Error::other(e)))?;
    // The O_PATH fd's inode, through its /proc link (fstat, fchown and chmod all act on it, and
    // none of them follows anything else).
    let link = format!("/proc/self/fd/{}", fd.as_raw_fd());
    let meta = std::fs::metadata(&link).map_err(|e| IoStep::new("stat volume root", root, e))?;
    if !meta.is_dir() {
        // A block volume's device file: its access is the device rule's, not a group's.
        return Ok(false);
    }
    let mode = meta.mode() & 0o7777;
    if meta.gid() == gid && mode & GRANTED_BITS == GRANTED_BITS {
        return Ok(false);
    }
    std::os::unix::fs::chown(&link, None, Some(gid))
        .map_err(|e| IoStep::new("change the group of volume root", root, e))?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&link, std::fs::Permissions::from_mode(mode | GRANTED_BITS))
        .map_err(|e| IoStep::new("make group-writable volume root", root, e))?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn users_are_read_by_number_or_name() {
        assert_eq!(
            resolve_user("1000:2000").unwrap(),
            Credentials {
                uid: 1000,
                gid: 2000
            }
        );
        assert_eq!(resolve_user("0").unwrap(), Credentials { uid: 0, gid: 0 });
        assert_eq!(
            resolve_user("root:0").unwrap(),
            Credentials { uid: 0, gid: 0 }
        );
        let no_entry = resolve_user("4000000").unwrap();
        assert_eq!(
            no_entry,
            Credentials {
                uid: 4000000,
                gid: 4000000
            },
            "no entry: gid = uid"
        );
        for (bad, says) in [
            ("", "expected UID[:GID]"),
            ("1000:", "expected UID[:GID]"),
            ("no-such-user-here", "not in the host's user database"),
            ("0:no-such-group-here", "not in the host's group database"),
        ] {
            let err = resolve_user(bad).unwrap_err();
            assert!(err.contains(says), "{bad}: {err}");
        }
    }

    /// A mount as a checkpoint holds it (so fields added later keep their defaults).
    fn mount(
        provider: Option<&str>,
        volume: Option<&str>,
        whole: bool,
        block: bool,
    ) -> VolumeMount {
        serde_json::from_value(serde_json::json!({
            "source": "/w/mp",
            "source_root": if whole { None } else { Some("/w") },
            "root": "host",
            "target": "data",
            "container_path": "/data",
            "readonly": false,
            "volume_id": volume,
            "provider_id": provider,
            "block": block,
        }))
        .unwrap()
    }

    #[test]
    fn plugins_are_asked_for_whole_mount_volumes_and_the_isolator_grants_the_rest() {
        let key = |v: &str| ("p".to_string(), v.to_string());
        let grants = vec![
            (mount(Some("p"), Some("whole"), true, false), 50),
            (mount(Some("p"), Some("path-disk"), false, false), 50),
            (mount(Some("p"), Some("block"), true, true), 50),
            (mount(None, None, false, false), 50),
            (
                mount(Some("p"), Some("not-staged-with-one"), true, false),
                50,
            ),
        ];
        let asked = groups_for_plugins(&grants);
        assert_eq!(
            asked,
            MountGroups::from([(key("whole"), 50), (key("not-staged-with-one"), 50)])
        );
        // The plugin staged "whole" with a group (another container's, even): it is the
        // plugin's. "not-staged-with-one" came back without one (no capability, or staged
        // before): the isolator grants it, as every mount the plugins were not asked about.
        let staged = MountGroups::from([(key("whole"), 7)]);
        let left: Vec<Option<String>> = left_to_isolator(grants, &asked, &staged)
            .into_iter()
            .map(|(m, _)| m.volume_id)
            .collect();
        assert_eq!(
            left,
            vec![
                Some("path-disk".to_string()),
                Some("block".to_string()),
                None,
                Some("not-staged-with-one".to_string())
            ]
        );
    }

    #[test]
    fn only_a_non_root_writer_of_a_volume_it_does_not_share_gets_its_group() {
        let user = Some(Credentials { uid: 1000, gid: 50 });
        let root = Some(Credentials { uid: 0, gid: 50 });
        assert_eq!(group_to_grant(user, false, false), Some(50));
        assert_eq!(group_to_grant(user, true, false), None, "read-only");
        assert_eq!(group_to_grant(user, false, true), None, "shared");
        assert_eq!(
            group_to_grant(root, false, false),
            None,
            "root writes anyway"
        );
        assert_eq!(group_to_grant(None, false, false), None, "no user given");
    }
}
