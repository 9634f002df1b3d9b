//! The group a volume is staged and published with: CSI's `volume_mount_group`.
//!
//! Contract: a plugin with the node capability VOLUME_MOUNT_GROUP makes a mount volume
//! accessible to the group the CO names in NodeStageVolume and NodePublishVolume
//! (`VolumeCapability.MountVolume.volume_mount_group`, a decimal gid here, as on Linux). The CO
//! must not send it to a plugin without the capability, and never for a block volume.
//! CSI stages a volume once per node, so the group is chosen when a publish brings the volume
//! onto the node and kept while it stays there: a second container asking another group gets
//! the volume as it is (logged; the volume is not unpublished under its other users).
//! [`group_after`] is that rule, pure; [`VolumeRecord::mount_group`] records its answer with
//! the publish's intent, before any RPC, so recovery and a re-publish send the same group.
//!
//! [`VolumeRecord::mount_group`]: crate::provider::VolumeRecord::mount_group

/// The group the volume is to be staged and published with after a container asked for
/// `asked` (`None`: no group, e.g. a root workload or a publish without a user), given the
/// group `recorded` for it, whether it is on the node now (staged or published, or on the way),
/// whether other containers use it, and whether the plugin takes a group for it (it offers
/// VOLUME_MOUNT_GROUP and the volume is a mount volume).
pub fn group_after(
    recorded: Option<u32>,
    on_node: bool,
    others_use_it: bool,
    offered: bool,
    asked: Option<u32>,
) -> Option<u32> {
    if on_node || others_use_it {
        // Staged once: what it was staged with stands (and is what a repair sends again).
        recorded
    } else if offered {
        asked
    } else {
        None
    }
}

/// The gid as `volume_mount_group` carries it: decimal.
pub fn wire(gid: u32) -> String {
    gid.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_group_is_chosen_when_the_volume_comes_onto_the_node_and_kept_while_it_stays() {
        // (recorded, on node, others use it, offered, asked) -> group
        let cases = [
            // Brought onto the node by this publish: the asked group, if the plugin takes one.
            ((None, false, false, true, Some(5678)), Some(5678)),
            ((Some(1), false, false, true, Some(5678)), Some(5678)),
            ((Some(1), false, false, true, None), None),
            ((None, false, false, false, Some(5678)), None),
            ((Some(1), false, false, false, Some(5678)), None),
            // Already on the node: staged once, kept, whatever is asked.
            ((Some(1), true, false, true, Some(5678)), Some(1)),
            ((None, true, true, true, Some(5678)), None),
            ((Some(1), true, true, false, None), Some(1)),
            // Off the node but used (after a reboot, before its users are back): their group.
            ((Some(1), false, true, true, Some(5678)), Some(1)),
            ((Some(1), false, true, true, None), Some(1)),
        ];
        for ((recorded, on_node, others, offered, asked), want) in cases {
            assert_eq!(
                group_after(recorded, on_node, others, offered, asked),
                want,
                "{recorded:?} {on_node} {others} {offered} {asked:?}"
            );
        }
    }

    #[test]
    fn only_a_mount_capability_carries_the_group() {
        use crate::csi::proto::volume_capability::AccessType as Wire;
        use crate::provider::{AccessType, Capability};
        let mount = Capability::default();
        let carried = |cap: &Capability, group| match cap.to_proto_with_group(group).access_type {
            Some(Wire::Mount(m)) => Some(m.volume_mount_group),
            Some(Wire::Block(_)) => None,
            None => panic!("no access type"),
        };
        assert_eq!(carried(&mount, Some(5678)), Some("5678".to_string()));
        assert_eq!(carried(&mount, None), Some(String::new()));
        assert_eq!(mount.to_proto_with_group(None), mount.to_proto());
        let block = Capability {
            access_type: AccessType::Block,
            ..Capability::default()
        };
        assert_eq!(carried(&block, Some(5678)), None);
        assert_eq!(block.to_proto_with_group(Some(5678)), block.to_proto());
    }

    #[test]
    fn the_wire_form_is_decimal() {
        assert_eq!(wire(0), "0");
        assert_eq!(wire(5678), "5678");
        assert_eq!(wire(u32::MAX), "4294967295");
    }
}
