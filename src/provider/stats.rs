//! Volume stats and health (issue 15): NodeGetVolumeStats for published volumes, on demand.
//!
//! Contract:
//! - Collected only when someone asks (`status`, serve's `Status`, a `/metrics` scrape); nothing
//!   runs when nobody asks, and nothing is cached here (serve's `/metrics` body is already reused
//!   for a second, `service::http`): a cache would show figures older than what the caller asked
//!   for and would need a task to keep it fresh.
//! - The volumes asked about come from the status scan ([`super::status::scan`]: checkpoints read
//!   from disk), never from a provider's in-memory record, so no volume lock is taken at all:
//!   reading stats never waits for a publish nor holds one up. Only a volume recorded `PUBLISHED`
//!   whose mount point the mount table shows is asked about, at its mount point (the
//!   NodePublishVolume target, CSI's `volume_path`).
//! - A plugin is asked only when it offers the node capability `GET_VOLUME_STATS`; a volume
//!   condition is read only when it offers `VOLUME_CONDITION`. A plugin without them gives no
//!   stats and no error.
//! - Each call is bounded by one deadline (the whole call, the client's retries included): a
//!   plugin that hangs gives that volume "timed out" and the others their figures. At most
//!   [`CONCURRENCY`] calls run at once, and the whole collection ends within two deadlines
//!   (volumes not reached by then are "timed out" too).
//! - The plugin's answer is hostile: a negative figure, a used or available figure beyond the
//!   total, or two usages of one unit refuse the whole answer ("stats unavailable" with the
//!   reason); the condition message is cut to [`MESSAGE_MAX_BYTES`] (and escaped where shown to
//!   people, `crate::shown`).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use futures::stream::{self, StreamExt};

use crate::csi::proto;
use crate::csi::proto::volume_usage::Unit;
use crate::csi::transport::endpoint_for;
use crate::csi::{Client, ClientOptions, RetryPolicy};
use crate::error_chain::full_message;
use crate::provider::state::VolumeState;
use crate::provider::status::StatusReport;
pub use crate::provider::status::{VolumeCondition, VolumeStats};
use crate::resource::Layout;

/// The deadline of one volume's stats call unless the caller says otherwise: short, since a
/// person or a scraper (whose whole request serve bounds at 5 s) waits for it.
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(2);

/// Stats calls in flight at once, per collection.
pub const CONCURRENCY: usize = 8;

/// The longest plugin message (a condition's, or an error's) kept, in bytes.
pub const MESSAGE_MAX_BYTES: usize = 1024;

/// What one stats call taught of a volume.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Health {
    /// The plugin's figures, and its condition when it offers `VOLUME_CONDITION` and said one.
    Known {
        /// The usage.
        stats: VolumeStats,
        /// The condition.
        condition: Option<VolumeCondition>,
    },
    /// No figures: why (timed out, the call failed, the answer was refused).
    Unavailable(String),
}

/// `text` cut to at most [`MESSAGE_MAX_BYTES`] bytes on a character boundary, `…` marking a cut.
pub fn bounded(text: &str) -> String {
    if text.len() <= MESSAGE_MAX_BYTES {
        return text.to_string();
    }
    let mut end = MESSAGE_MAX_BYTES - '…'.len_utf8();
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

/// One unit's figures, checked: none negative, used and available within a non-zero total.
/// Zero used and zero available together mean "not reported" (CSI's block usage gives its total
/// only; a real filesystem with nothing available has used blocks).
fn figures(u: &proto::VolumeUsage, unit: &str) -> Result<[Option<u64>; 3], String> {
    let (total, used, available) = (u.total, u.used, u.available);
    if total < 0 || used < 0 || available < 0 {
        return Err(format!(
            "a negative {unit} figure (total {total}, used {used}, available {available})"
        ));
    }
    if total > 0 && (used > total || available > total) {
        return Err(format!(
            "{unit} used {used} or available {available} beyond the total {total}"
        ));
    }
    let some = |v: i64| (v > 0).then_some(v as u64);
    Ok(if used == 0 && available == 0 {
        [some(total), None, None]
    } else {
        [some(total), Some(used as u64), Some(available as u64)]
    })
}

/// The plugin's answer read into figures and a condition (pure). `condition_capable`: whether the
/// plugin offers `VOLUME_CONDITION` (a condition from one that does not is ignored, as CSI says).
pub fn interpret(
    resp: &proto::NodeGetVolumeStatsResponse,
    condition_capable: bool,
) -> Result<(VolumeStats, Option<VolumeCondition>), String> {
    let mut stats = VolumeStats::default();
    let (mut bytes, mut inodes) = (false, false);
    for u in &resp.usage {
        match Unit::try_from(u.unit) {
            Ok(Unit::Bytes) => {
                if std::mem::replace(&mut bytes, true) {
                    return Err("two BYTES usages".into());
                }
                [stats.bytes_total, stats.bytes_used, stats.bytes_available] = figures(u, "BYTES")?;
            }
            Ok(Unit::Inodes) => {
                if std::mem::replace(&mut inodes, true) {
                    return Err("two INODES usages".into());
                }
                [stats.inodes_total, stats.inodes_used, stats.inodes_free] = figures(u, "INODES")?;
            }
            // UNKNOWN or a unit newer than this client: nothing to show.
            _ => {}
        }
    }
    let condition = resp
        .volume_condition
        .as_ref()
        .filter(|_| condition_capable)
        .map(|c| VolumeCondition {
            abnormal: c.abnormal,
            message: bounded(&c.message),
        });
    Ok((stats, condition))
}

/// Asks `client` for one volume's stats at `path`, within `deadline`. `None` when the plugin does
/// not offer `GET_VOLUME_STATS`.
pub async fn fetch(
    client: &Client,
    volume_id: &str,
    path: &Path,
    deadline: Duration,
) -> Option<Health> {
    let caps = client.current_capabilities();
    if !caps.node.get_volume_stats() {
        return None;
    }
    let req = proto::NodeGetVolumeStatsRequest {
        volume_id: volume_id.to_string(),
        volume_path: path.to_string_lossy().into_owned(),
        staging_target_path: String::new(),
    };
    let health = match tokio::time::timeout(deadline, client.node_get_volume_stats(req)).await {
        Err(_) => Health::Unavailable(format!("timed out after {} ms", deadline.as_millis())),
        Ok(Err(e)) => Health::Unavailable(bounded(&full_message(&e))),
        Ok(Ok(resp)) => match interpret(&resp, caps.node.volume_condition()) {
            Ok((stats, condition)) => Health::Known { stats, condition },
            Err(why) => Health::Unavailable(format!("the plugin's answer was refused: {why}")),
        },
    };
    Some(health)
}

/// Fills in the stats, condition or "stats unavailable" of every volume of `report` recorded
/// `PUBLISHED` and mounted whose plugin (`<type>/<name>`) has a client in `clients`; each call
/// bounded by `deadline`, at most [`CONCURRENCY`] at once.
pub async fn attach(
    report: &mut StatusReport,
    clients: &BTreeMap<String, Client>,
    deadline: Duration,
) {
    let jobs: Vec<_> = report
        .volumes
        .iter()
        .enumerate()
        .filter(|(_, v)| v.state == VolumeState::Published && v.mounted)
        .filter_map(|(i, v)| {
            let client = clients.get(&v.plugin)?.clone();
            Some((i, client, v.volume_id.clone(), v.mount_point.clone()))
        })
        .collect();
    let asked: Vec<usize> = jobs.iter().map(|(i, ..)| *i).collect();
    // However many volumes hang, the whole collection ends within two deadlines: a volume not
    // reached by then is "timed out" like one that was.
    let whole = deadline.saturating_mul(2);
    let mut results: Vec<(usize, Option<Health>)> = stream::iter(jobs)
        .map(|(i, client, id, path)| async move { (i, fetch(&client, &id, &path, deadline).await) })
        .buffer_unordered(CONCURRENCY)
        .take_until(tokio::time::sleep(whole))
        .collect()
        .await;
    let answered: std::collections::HashSet<usize> = results.iter().map(|(i, _)| *i).collect();
    for i in asked {
        if !answered.contains(&i) {
            let why = format!("timed out: not reached within {} ms", whole.as_millis());
            results.push((i, Some(Health::Unavailable(why))));
        }
    }
    for (i, health) in results {
        let v = &mut report.volumes[i];
        match health {
            None => {}
            Some(Health::Known { stats, condition }) => {
                v.stats = Some(stats);
                v.condition = condition;
            }
            Some(Health::Unavailable(why)) => {
                tracing::warn!(volume_id = %v.volume_id, plugin = %v.plugin, reason = %why, "volume stats unavailable");
                v.stats_unavailable = Some(why);
            }
        }
    }
}

/// Each provider's CSI client by its plugin (`<type>/<name>`), for the stats of its volumes.
pub fn provider_clients(manager: &crate::provider::Manager) -> BTreeMap<String, Client> {
    manager
        .providers()
        .map(|p| (p.plugin().to_string(), p.client().clone()))
        .collect()
}

/// Clients of the managed plugins (`csi/<type>/<name>/plugin/csi.sock`, or its short path under
/// `socket_dir`) of the plugins `report` names, for a process that runs none itself (`status`):
/// a plugin whose socket is missing is left out (not running here, or reached by an endpoint
/// this process does not know); one whose socket does not answer within `deadline` marks its
/// mounted volumes "stats unavailable".
pub async fn managed_clients(
    work_dir: &Path,
    socket_dir: &Path,
    report: &mut StatusReport,
    deadline: Duration,
) -> BTreeMap<String, Client> {
    let mut plugins: Vec<String> = report.volumes.iter().map(|v| v.plugin.clone()).collect();
    plugins.sort();
    plugins.dedup();
    let options = ClientOptions {
        deadline,
        connect_timeout: deadline,
        retry: RetryPolicy::no_retry(),
    };
    let mut clients = BTreeMap::new();
    for plugin in plugins {
        let Some((kind, name)) = plugin.split_once('/') else {
            continue;
        };
        let socket = Layout::new(work_dir, kind, name).plugin_socket(socket_dir);
        if !socket.exists() || !(socket.starts_with(work_dir) || private_to_root(&socket)) {
            // Missing, or in a directory someone else could have made first (where a fake plugin
            // could stand): not asked. The starter of the plugin refuses such a directory too.
            continue;
        }
        let endpoint = endpoint_for(&socket);
        match tokio::time::timeout(deadline, Client::connect(&endpoint, options.clone())).await {
            Ok(Ok(client)) => {
                clients.insert(plugin, client);
            }
            failed => {
                let why = match failed {
                    Ok(Err(e)) => bounded(&full_message(&e)),
                    _ => format!("no answer within {} ms", deadline.as_millis()),
                };
                for v in report.volumes.iter_mut().filter(|v| {
                    v.plugin == plugin && v.state == VolumeState::Published && v.mounted
                }) {
                    v.stats_unavailable = Some(format!("plugin not reachable: {why}"));
                }
            }
        }
    }
    clients
}

/// Whether `socket` (outside the verified work dir: under `--plugin-socket-dir`) and its
/// directory are root's, the directory closed to others.
fn private_to_root(socket: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let ok = |p: &Path, closed: bool| {
        std::fs::symlink_metadata(p)
            .is_ok_and(|m| m.uid() == 0 && (!closed || m.mode() & 0o077 == 0))
    };
    ok(socket, false) && socket.parent().is_some_and(|dir| ok(dir, true))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage(unit: Unit, total: i64, used: i64, available: i64) -> proto::VolumeUsage {
        proto::VolumeUsage {
            total,
            used,
            available,
            unit: unit as i32,
        }
    }

    fn answer(usage: Vec<proto::VolumeUsage>) -> proto::NodeGetVolumeStatsResponse {
        proto::NodeGetVolumeStatsResponse {
            usage,
            volume_condition: Some(proto::VolumeCondition {
                abnormal: true,
                message: "gone".into(),
            }),
        }
    }

    #[test]
    fn answers_read_into_figures_or_refused() {
        let fs = answer(vec![
            usage(Unit::Bytes, 100, 40, 60),
            usage(Unit::Inodes, 10, 1, 9),
        ]);
        let (stats, condition) = interpret(&fs, true).unwrap();
        assert_eq!(
            stats,
            VolumeStats {
                bytes_total: Some(100),
                bytes_used: Some(40),
                bytes_available: Some(60),
                inodes_total: Some(10),
                inodes_used: Some(1),
                inodes_free: Some(9),
            }
        );
        assert_eq!(
            condition,
            Some(VolumeCondition {
                abnormal: true,
                message: "gone".into()
            })
        );
        // Without VOLUME_CONDITION the condition is ignored.
        assert_eq!(interpret(&fs, false).unwrap().1, None);
        // A block volume: its total only.
        let block = interpret(&answer(vec![usage(Unit::Bytes, 1 << 20, 0, 0)]), false).unwrap();
        assert_eq!(
            block.0,
            VolumeStats {
                bytes_total: Some(1 << 20),
                ..Default::default()
            }
        );
        // Unknown units say nothing.
        assert_eq!(
            interpret(&answer(vec![usage(Unit::Unknown, 5, 1, 1)]), false)
                .unwrap()
                .0,
            VolumeStats::default()
        );
        for (bad, why) in [
            (vec![usage(Unit::Bytes, -1, 0, 0)], "negative"),
            (vec![usage(Unit::Inodes, 10, -2, 0)], "negative"),
            (vec![usage(Unit::Bytes, 10, 11, 0)], "beyond the total"),
            (
                vec![usage(Unit::Bytes, 10, 1, i64::MAX)],
                "beyond the total",
            ),
            (
                vec![usage(Unit::Bytes, 10, 1, 1), usage(Unit::Bytes, 10, 1, 1)],
                "two BYTES",
            ),
        ] {
            let err = interpret(&answer(bad.clone()), true).unwrap_err();
            assert!(err.contains(why), "{bad:?}: {err}");
        }
    }

    #[test]
    fn messages_are_bounded_on_a_character_boundary() {
        assert_eq!(bounded("short"), "short");
        let long = "é".repeat(MESSAGE_MAX_BYTES);
        let cut = bounded(&long);
        assert!(cut.len() <= MESSAGE_MAX_BYTES, "{}", cut.len());
        assert!(cut.ends_with('…'));
        let resp = proto::NodeGetVolumeStatsResponse {
            usage: vec![],
            volume_condition: Some(proto::VolumeCondition {
                abnormal: true,
                message: "x".repeat(1 << 20),
            }),
        };
        let (_, condition) = interpret(&resp, true).unwrap();
        assert!(condition.unwrap().message.len() <= MESSAGE_MAX_BYTES);
    }
}
