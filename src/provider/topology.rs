//! Topology: where a volume can be reached from, as the plugin says (CSI's
//! VOLUME_ACCESSIBILITY_CONSTRAINTS). A node's segments come from NodeGetInfo
//! (`accessible_topology`); CreateVolume is asked for a volume reachable from this node
//! (`accessibility_requirements`, requisite and preferred); the volume's `accessible_topology`
//! from the answer is checkpointed with it, and a publish on a node none of those topologies
//! covers is refused before any RPC.
//!
//! Contract: pure. [`accessible_from`] is the one rule; [`check_answer`] bounds what a plugin
//! says (its answers are not trusted: CSI's own limits on segments, and counts).

use std::collections::BTreeMap;

use crate::shown::shown;

/// Segments of one topology: `{"topology.example.com/zone": "a"}`.
pub type Segments = BTreeMap<String, String>;

/// Most topologies a volume may name, and segments a topology may hold.
pub const MAX_TOPOLOGIES: usize = 64;
/// Most segments in one topology.
pub const MAX_SEGMENTS: usize = 16;
/// Longest segment key (CSI: an optional prefix of at most 63 characters, `/`, a name of at
/// most 63).
pub const MAX_KEY_BYTES: usize = 127;
/// Longest segment value (CSI: 1 to 63 characters).
pub const MAX_VALUE_BYTES: usize = 63;

/// Whether a volume reachable from `volume` can be published on a node at `node`: a volume
/// without topology, or a node that says none, is reachable; otherwise one of the volume's
/// topologies must have all its segments on the node.
pub fn accessible_from(volume: &[Segments], node: &Segments) -> bool {
    volume.is_empty()
        || node.is_empty()
        || volume
            .iter()
            .any(|t| t.iter().all(|(k, v)| node.get(k) == Some(v)))
}

/// Refuses topologies outside CSI's limits (or ours on their number), naming what is wrong.
pub fn check_answer(topologies: &[Segments]) -> Result<(), String> {
    if topologies.len() > MAX_TOPOLOGIES {
        return Err(format!(
            "{} topologies, more than {MAX_TOPOLOGIES}",
            topologies.len()
        ));
    }
    for t in topologies {
        if t.len() > MAX_SEGMENTS {
            return Err(format!(
                "a topology of {} segments, more than {MAX_SEGMENTS}",
                t.len()
            ));
        }
        for (k, v) in t {
            let bad = |c: char| c.is_control() || c.is_whitespace();
            if k.is_empty() || k.len() > MAX_KEY_BYTES || k.chars().any(bad) {
                return Err(format!(
                    "topology key '{}' is not a CSI segment key",
                    shown(k)
                ));
            }
            if v.is_empty() || v.len() > MAX_VALUE_BYTES || v.chars().any(bad) {
                return Err(format!(
                    "topology value '{}' of key '{}' is not a CSI segment value",
                    shown(v),
                    shown(k)
                ));
            }
        }
    }
    Ok(())
}

/// Topologies for people: `zone=a,rack=1 | zone=b`.
pub fn describe(topologies: &[Segments]) -> String {
    topologies
        .iter()
        .map(|t| {
            t.iter()
                .map(|(k, v)| format!("{}={}", shown(k), shown(v)))
                .collect::<Vec<_>>()
                .join(",")
        })
        .collect::<Vec<_>>()
        .join(" | ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg(pairs: &[(&str, &str)]) -> Segments {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn a_volume_is_reachable_from_the_nodes_its_topologies_cover() {
        let node = seg(&[("zone", "a"), ("rack", "1")]);
        assert!(accessible_from(&[], &node), "no topology: anywhere");
        assert!(
            accessible_from(&[seg(&[("zone", "b")])], &Segments::new()),
            "node says none"
        );
        assert!(accessible_from(&[seg(&[("zone", "a")])], &node));
        assert!(accessible_from(
            &[seg(&[("zone", "b")]), seg(&[("zone", "a"), ("rack", "1")])],
            &node
        ));
        assert!(!accessible_from(&[seg(&[("zone", "b")])], &node));
        assert!(!accessible_from(
            &[seg(&[("zone", "a"), ("rack", "2")])],
            &node
        ));
        assert!(
            !accessible_from(&[seg(&[("region", "x")])], &node),
            "a key the node lacks"
        );
    }

    #[test]
    fn answers_outside_csis_limits_are_refused_by_name() {
        assert!(check_answer(&[seg(&[("topology.example.com/zone", "a")])]).is_ok());
        let long = "v".repeat(64);
        for (t, says) in [
            (vec![seg(&[("", "a")])], "key ''"),
            (vec![seg(&[("zone", "")])], "value ''"),
            (
                vec![seg(&[("zone", long.as_str())])],
                "is not a CSI segment value",
            ),
            (vec![seg(&[("zo ne", "a")])], "key 'zo ne'"),
            (vec![Segments::new(); 65], "65 topologies"),
        ] {
            let err = check_answer(&t).unwrap_err();
            assert!(err.contains(says), "{err}");
        }
        assert_eq!(
            describe(&[seg(&[("rack", "1"), ("zone", "a")]), seg(&[("zone", "b")])]),
            "rack=1,zone=a | zone=b"
        );
    }
}
