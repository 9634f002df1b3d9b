//! Which of `docker-plugin`'s uses no container holds any more: the pure
//! decision of the engine reconciliation (no I/O; the engine client is
//! [`super::engine`], the rounds [`super::reconciler`]).
//!
//! Docker's Mount ID is a fresh random id per mount, not the container's id,
//! and the Engine API does not show it; so the decision is per volume: a
//! volume that no container in a live state mounts has every one of our
//! uses released. Contract:
//!
//! - Only users [`users::mount_id_of`](super::users::mount_id_of) accepts
//!   (`docker-plugin/<ID>`) are ever released; a container's use (`run`,
//!   `serve`, the hook, `volume publish`) and a bare Mount ID of an earlier
//!   version never are.
//! - A volume is held when any container in a live state (anything but
//!   `exited`, `dead` and Podman's `stopped`; so `running`, `paused`,
//!   `restarting`, `created`, `removing` and any state this code does not
//!   know) lists a mount of `Type` `volume` with the volume's `Name`,
//!   whatever its `Driver` says (a Podman engine may name the driver
//!   otherwise; a same-named volume of another driver keeps ours, which
//!   errs on the side of keeping).
//! - A use is released only when it was seen unheld in two consecutive
//!   successful observations at least `interval` apart, and was already
//!   recorded before the first of them was asked for. Docker calls `Mount`
//!   while its container exists (state `created`), so a use recorded before
//!   a listing was asked for has a holder in that listing unless its
//!   container has ended; a use made between two listings is seen unheld at
//!   most by listings taken before its container existed, and is never
//!   released on them. The second observation, an interval later, covers
//!   the short Mounts an engine makes outside a container's start (copying
//!   an image's files into a new volume) and any listing taken at an
//!   unlucky moment.
//! - A round that failed (engine unreachable, answer refused) forgets every
//!   suspect: the next success starts the count again.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use serde::Deserialize;

use super::users;

/// One container as the engine lists it (`GET /containers/json?all=1`);
/// every other field is ignored.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct Container {
    /// The container id (for logs only).
    #[serde(rename = "Id", default)]
    pub id: String,
    /// `created`, `running`, `paused`, `restarting`, `removing`, `exited`,
    /// `dead` (Podman adds a few of its own).
    #[serde(rename = "State", default)]
    pub state: String,
    /// Its mounts.
    #[serde(rename = "Mounts", default, deserialize_with = "null_as_empty")]
    pub mounts: Vec<Mount>,
}

/// One mount of a container.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct Mount {
    /// `volume`, `bind`, `tmpfs`, ...
    #[serde(rename = "Type", default)]
    pub kind: String,
    /// The volume's name (empty for other types).
    #[serde(rename = "Name", default)]
    pub name: String,
    /// The volume's driver (not used in the decision: see the module doc).
    #[serde(rename = "Driver", default)]
    pub driver: String,
}

fn null_as_empty<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<Mount>, D::Error> {
    Ok(Option::<Vec<Mount>>::deserialize(d)?.unwrap_or_default())
}

/// The states in which a container holds nothing: it has ended.
const ENDED: [&str; 3] = ["exited", "dead", "stopped"];

/// Whether a container in `state` may hold its volumes. An unknown state
/// holds (a state this code does not know never causes a release).
pub fn is_live(state: &str) -> bool {
    !ENDED.contains(&state.to_ascii_lowercase().as_str())
}

/// The names of the volumes some live container mounts.
pub fn held_volumes(containers: &[Container]) -> BTreeSet<String> {
    containers
        .iter()
        .filter(|c| is_live(&c.state))
        .flat_map(|c| &c.mounts)
        .filter(|m| m.kind == "volume" && !m.name.is_empty())
        .map(|m| m.name.clone())
        .collect()
}

/// One use of a volume in the provider's records.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Use {
    /// The volume's name (Docker's volume name).
    pub name: String,
    /// The volume's CSI id (the provider's key).
    pub volume_id: String,
    /// The provider user (`docker-plugin/<Mount ID>` for ours).
    pub user: String,
}

/// Uses seen unheld by the last successful observation, each with the time
/// of the first observation in the run that saw it unheld.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Suspects(BTreeMap<(String, String), Duration>);

impl Suspects {
    /// How many uses are suspected.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// What one observation decides.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Decision {
    /// The uses to release now.
    pub release: Vec<Use>,
    /// The uses to check again at the next observation.
    pub suspects: Suspects,
}

/// Decides one successful observation made at `now` (any monotonic clock):
/// `uses` are the provider's uses as recorded *before* the listing was asked
/// for, `held` the names of the volumes a live container mounts in it,
/// `before` the previous observation's suspects (empty after a failed
/// round).
pub fn decide(
    before: &Suspects,
    uses: &[Use],
    held: &BTreeSet<String>,
    now: Duration,
    interval: Duration,
) -> Decision {
    let mut decision = Decision::default();
    for u in uses {
        if users::mount_id_of(&u.user).is_none() || u.name.is_empty() || held.contains(&u.name) {
            continue;
        }
        let key = (u.volume_id.clone(), u.user.clone());
        match before.0.get(&key) {
            Some(&since) if now.saturating_sub(since) >= interval => {
                decision.release.push(u.clone());
            }
            Some(&since) => {
                decision.suspects.0.insert(key, since);
            }
            None => {
                decision.suspects.0.insert(key, now);
            }
        }
    }
    decision
}

#[cfg(test)]
mod tests {
    use super::*;

    const M1: &str = "1111111111111111111111111111111111111111111111111111111111111111";
    const M2: &str = "2222222222222222222222222222222222222222222222222222222222222222";

    fn ours(name: &str, mount_id: &str) -> Use {
        Use {
            name: name.into(),
            volume_id: format!("id-{name}"),
            user: users::user_of(mount_id),
        }
    }

    fn theirs(name: &str, user: &str) -> Use {
        Use {
            name: name.into(),
            volume_id: format!("id-{name}"),
            user: user.into(),
        }
    }

    fn container(state: &str, volumes: &[&str]) -> Container {
        Container {
            id: format!("c-{state}"),
            state: state.into(),
            mounts: volumes
                .iter()
                .map(|v| Mount {
                    kind: "volume".into(),
                    name: (*v).into(),
                    driver: "csi-isolator".into(),
                })
                .collect(),
        }
    }

    #[test]
    fn live_states_hold_and_ended_ones_do_not() {
        for (state, live) in [
            ("running", true),
            ("paused", true),
            ("restarting", true),
            ("created", true),
            ("removing", true),
            ("configured", true),
            // Podman's while a `podman stop` waits for its container's exit.
            ("stopping", true),
            ("", true),
            ("something-new", true),
            ("exited", false),
            ("dead", false),
            ("stopped", false),
            ("Exited", false),
        ] {
            assert_eq!(is_live(state), live, "{state}");
        }
    }

    #[test]
    fn held_volumes_come_from_live_containers_volume_mounts() {
        let mut bind = container("running", &[]);
        bind.mounts.push(Mount {
            kind: "bind".into(),
            name: "bound".into(),
            driver: String::new(),
        });
        let containers = [
            container("running", &["a", "b"]),
            container("exited", &["c"]),
            container("created", &["d"]),
            container("dead", &["a", "e"]),
            bind,
        ];
        let held: Vec<String> = held_volumes(&containers).into_iter().collect();
        assert_eq!(held, ["a", "b", "d"]);
    }

    #[test]
    fn containers_parse_as_engines_send_them() {
        let body = r#"[
            {"Id":"x","State":"running","Status":"Up","Mounts":[
                {"Type":"volume","Name":"v","Driver":"csi-isolator","Source":"/m","RW":true},
                {"Type":"bind","Source":"/etc","Destination":"/e"}]},
            {"Id":"y","State":"exited","Mounts":null},
            {"Id":"z"}
        ]"#;
        let cs: Vec<Container> = serde_json::from_str(body).unwrap();
        assert_eq!(cs.len(), 3);
        assert_eq!(cs[0].mounts[0].name, "v");
        assert_eq!(cs[0].mounts[1].kind, "bind");
        assert!(cs[1].mounts.is_empty());
        assert_eq!(cs[2].state, "");
        for bad in [r#"{"Id":"x"}"#, r#"[{"State":1}]"#, "[", ""] {
            assert!(
                serde_json::from_str::<Vec<Container>>(bad).is_err(),
                "{bad}"
            );
        }
    }

    /// Podman 4.3's `GET /containers/json?all=1` (`podman system service`), trimmed to two
    /// containers of one volume: Docker's shape, Docker's state names (a created container is
    /// `created`, not libpod's `configured`), the driver under its `containers.conf` key.
    const PODMAN_LISTING: &str = r#"[
        {"AdjustCPUShares":false,"Command":"sh -c while true; do date >> /data/log; sleep 0.2; done",
         "Config":null,"Created":1796339839,"Id":"6be8114f2f02","Image":"localhost/busybox:latest",
         "ImageID":"sha256:754e9030e181","Labels":{},
         "Mounts":[{"Destination":"/data","Driver":"csitest","Mode":"","Name":"held","Propagation":"rprivate",
                    "RW":true,"Source":"/var/lib/csi-isolator/csi/p/default/mounts/vol-71a79b2e05db0708/target",
                    "Type":"volume"}],
         "Name":"","Names":["/a"],"NetworkSettings":{"Networks":null},"NetworkingConfig":null,"Platform":null,
         "Ports":[],"State":"exited","Status":"Exited (0) 3 seconds ago"},
        {"AdjustCPUShares":false,"Command":"sh","Config":null,"Created":1796339839,"Id":"763ae4adce5a",
         "Image":"localhost/busybox:latest","ImageID":"sha256:754e9030e181","Labels":{},
         "Mounts":[{"Destination":"/data","Driver":"csitest","Mode":"","Name":"held","Propagation":"rprivate",
                    "RW":true,"Source":"/var/lib/csi-isolator/csi/p/default/mounts/vol-71a79b2e05db0708/target",
                    "Type":"volume"}],
         "Name":"","Names":["/b"],"NetworkSettings":{"Networks":null},"NetworkingConfig":null,"Platform":null,
         "Ports":[],"State":"running","Status":"Up 2 seconds"}
    ]"#;

    #[test]
    fn podmans_listing_holds_a_volume_while_one_of_its_containers_runs() {
        let mut cs: Vec<Container> = serde_json::from_str(PODMAN_LISTING).unwrap();
        assert_eq!(cs.len(), 2);
        assert_eq!(cs[0].mounts[0].kind, "volume");
        assert_eq!(cs[0].mounts[0].driver, "csitest");
        let held: Vec<String> = held_volumes(&cs).into_iter().collect();
        assert_eq!(
            held,
            ["held"],
            "the running one holds what the exited one mounted"
        );
        cs[1].state = "exited".into();
        assert!(held_volumes(&cs).is_empty(), "both exited");
    }

    /// One observation in a run of them: the containers listed at second
    /// `at`, the uses recorded before, and the uses that must be released.
    struct Step {
        at: u64,
        uses: Vec<Use>,
        listed: Vec<Container>,
        release: Vec<Use>,
    }

    #[test]
    fn decide_table() {
        let interval = Duration::from_secs(30);
        let cases: Vec<(&str, Vec<Step>)> = vec![
            (
                "a held volume is kept",
                vec![
                    Step { at: 0, uses: vec![ours("v", M1)], listed: vec![container("running", &["v"])], release: vec![] },
                    Step { at: 30, uses: vec![ours("v", M1)], listed: vec![container("running", &["v"])], release: vec![] },
                    Step { at: 60, uses: vec![ours("v", M1)], listed: vec![container("paused", &["v"])], release: vec![] },
                ],
            ),
            (
                "unheld twice, an interval apart: every use of the volume released",
                vec![
                    Step { at: 0, uses: vec![ours("v", M1), ours("v", M2)], listed: vec![container("exited", &["v"])], release: vec![] },
                    Step { at: 30, uses: vec![ours("v", M1), ours("v", M2)], listed: vec![container("exited", &["v"])], release: vec![ours("v", M1), ours("v", M2)] },
                ],
            ),
            (
                "a volume the engine does not list at all",
                vec![
                    Step { at: 0, uses: vec![ours("v", M1)], listed: vec![], release: vec![] },
                    Step { at: 30, uses: vec![ours("v", M1)], listed: vec![container("running", &["w"])], release: vec![ours("v", M1)] },
                ],
            ),
            (
                "held in between: the count starts again",
                vec![
                    Step { at: 0, uses: vec![ours("v", M1)], listed: vec![], release: vec![] },
                    Step { at: 30, uses: vec![ours("v", M1)], listed: vec![container("restarting", &["v"])], release: vec![] },
                    Step { at: 60, uses: vec![ours("v", M1)], listed: vec![], release: vec![] },
                    Step { at: 90, uses: vec![ours("v", M1)], listed: vec![], release: vec![ours("v", M1)] },
                ],
            ),
            (
                "a second observation too soon releases nothing yet",
                vec![
                    Step { at: 0, uses: vec![ours("v", M1)], listed: vec![], release: vec![] },
                    Step { at: 29, uses: vec![ours("v", M1)], listed: vec![], release: vec![] },
                    Step { at: 30, uses: vec![ours("v", M1)], listed: vec![], release: vec![ours("v", M1)] },
                ],
            ),
            (
                "a use made between two listings survives the second",
                vec![
                    Step { at: 0, uses: vec![], listed: vec![], release: vec![] },
                    // Mounted after the first listing; the second was taken before its container
                    // showed (or after it ended): seen unheld once.
                    Step { at: 30, uses: vec![ours("v", M1)], listed: vec![], release: vec![] },
                    Step { at: 60, uses: vec![ours("v", M1)], listed: vec![container("created", &["v"])], release: vec![] },
                    Step { at: 90, uses: vec![ours("v", M1)], listed: vec![container("running", &["v"])], release: vec![] },
                ],
            ),
            (
                "a new use of a suspect volume waits its own two observations",
                vec![
                    Step { at: 0, uses: vec![ours("v", M1)], listed: vec![], release: vec![] },
                    Step { at: 30, uses: vec![ours("v", M1), ours("v", M2)], listed: vec![], release: vec![ours("v", M1)] },
                    Step { at: 60, uses: vec![ours("v", M2)], listed: vec![], release: vec![ours("v", M2)] },
                ],
            ),
            (
                "a use released meanwhile (Unmount) is forgotten",
                vec![
                    Step { at: 0, uses: vec![ours("v", M1)], listed: vec![], release: vec![] },
                    Step { at: 30, uses: vec![], listed: vec![], release: vec![] },
                    Step { at: 60, uses: vec![ours("v", M1)], listed: vec![], release: vec![] },
                ],
            ),
            (
                "only docker-plugin's uses: containers' and bare earlier Mount IDs are never released",
                vec![
                    Step { at: 0, uses: vec![theirs("v", "c1"), theirs("v", M1), ours("v", M2)], listed: vec![], release: vec![] },
                    Step { at: 30, uses: vec![theirs("v", "c1"), theirs("v", M1), ours("v", M2)], listed: vec![], release: vec![ours("v", M2)] },
                    Step { at: 60, uses: vec![theirs("v", "c1"), theirs("v", M1)], listed: vec![], release: vec![] },
                ],
            ),
            (
                "a volume without a name is not Docker's",
                vec![
                    Step { at: 0, uses: vec![ours("", M1)], listed: vec![], release: vec![] },
                    Step { at: 30, uses: vec![ours("", M1)], listed: vec![], release: vec![] },
                ],
            ),
            (
                "per volume: one held, one not",
                vec![
                    Step { at: 0, uses: vec![ours("v", M1), ours("w", M2)], listed: vec![container("running", &["w"]), container("exited", &["v"])], release: vec![] },
                    Step { at: 30, uses: vec![ours("v", M1), ours("w", M2)], listed: vec![container("running", &["w"]), container("exited", &["v"])], release: vec![ours("v", M1)] },
                ],
            ),
        ];
        for (name, steps) in cases {
            let mut suspects = Suspects::default();
            for (i, step) in steps.into_iter().enumerate() {
                let held = held_volumes(&step.listed);
                let d = decide(
                    &suspects,
                    &step.uses,
                    &held,
                    Duration::from_secs(step.at),
                    interval,
                );
                assert_eq!(d.release, step.release, "{name}: observation {i}");
                suspects = d.suspects;
            }
        }
    }

    #[test]
    fn a_failed_round_starts_the_count_again() {
        let interval = Duration::from_secs(30);
        let uses = [ours("v", M1)];
        let none = BTreeSet::new();
        let first = decide(&Suspects::default(), &uses, &none, Duration::ZERO, interval);
        assert_eq!(first.suspects.len(), 1);
        // The round at 30 s failed: the reconciler passes empty suspects.
        let after_failure = decide(
            &Suspects::default(),
            &uses,
            &none,
            Duration::from_secs(60),
            interval,
        );
        assert!(after_failure.release.is_empty());
        let next = decide(
            &after_failure.suspects,
            &uses,
            &none,
            Duration::from_secs(90),
            interval,
        );
        assert_eq!(next.release, uses);
        assert!(next.suspects.is_empty());
    }
}
