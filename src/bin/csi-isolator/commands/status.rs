//! `csi-isolator status [--json] [--stats]`: every volume with its state, its users,
//! its mount point and what the mount table says, disagreements flagged; with `--stats`
//! also the usage and condition of each published volume whose managed plugin is
//! running (NodeGetVolumeStats, `csi_isolator::provider::stats`).
//! Stats are opt-in: without `--stats` no plugin is called at all, so `status` costs the
//! scan of the work dir alone (asking every plugin for every volume's stats takes seconds on a
//! node with thousands of volumes). `--no-stats`, the opt-out of the releases that asked by
//! default, is still accepted and does nothing.
//! Read-only: starts no plugin and changes nothing; the work dir is
//! checked first (`csi_isolator::workdir::verify`).

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use csi_isolator::mount::ProcMountTable;
use csi_isolator::provider::status::{scan, StatusReport, VolumeStatus};
use csi_isolator::provider::{expand, stats};

use super::{escaped, shown, shown_os};

/// `status` options.
#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  csi-isolator --work-dir /var/lib/csi-demo status
  csi-isolator status --json | jq '.volumes[] | select(.disagreement != null)'
  csi-isolator status --stats --json | jq '.volumes[] | {name, stats, condition}'
With --stats, usage and condition come from the running managed plugin of each volume
(a plugin started by serve, docker-plugin or run); serve's Status and /metrics also ask
plugins reached by --plugin-endpoint. Without it no plugin is called.
Exit status: 0 when every volume agrees with the mount table, 1 otherwise.")]
pub struct StatusArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Also ask each published volume's running managed plugin for its usage and condition
    /// (NodeGetVolumeStats, one call per volume: seconds on a node with thousands of volumes).
    #[arg(long)]
    stats: bool,
    /// Accepted for scripts written when stats were asked by default; does nothing.
    #[arg(long, hide = true)]
    no_stats: bool,
    /// With --stats: seconds one volume's NodeGetVolumeStats may take (a plugin that takes
    /// longer shows "stats unavailable: timed out").
    #[arg(long, default_value = "2", value_name = "SECS")]
    stats_timeout: u64,
    /// Where a managed plugin's socket is when the path under the work dir is too long
    /// (as the plugin's starter was told).
    #[arg(
        long,
        env = "CSI_ISOLATOR_SOCKET_DIR",
        default_value = csi_isolator::resource::SHORT_SOCKET_DIR,
        value_name = "DIR"
    )]
    plugin_socket_dir: PathBuf,
}

/// Runs `status`; exits 1 when anything disagrees or cannot be read.
/// A work dir another user could have changed is refused before anything
/// in it is read; one that does not exist has no volumes.
pub async fn run(work_dir: &Path, args: StatusArgs) -> anyhow::Result<ExitCode> {
    let report = match csi_isolator::workdir::verify(work_dir)? {
        Some(canonical) => {
            let mut report = scan(&canonical, &ProcMountTable::new())?;
            if args.stats {
                let deadline = Duration::from_secs(args.stats_timeout.max(1));
                let clients = stats::managed_clients(
                    &canonical,
                    &args.plugin_socket_dir,
                    &mut report,
                    deadline,
                )
                .await;
                stats::attach(&mut report, &clients, deadline).await;
            }
            report
        }
        None => StatusReport::default(),
    };
    // Buffered: a node's thousands of volumes (megabytes of JSON) are a few large writes, not a
    // write per line.
    let mut out = std::io::BufWriter::with_capacity(256 << 10, std::io::stdout().lock());
    if args.json {
        report.write_pretty_json(&mut out)?;
        writeln!(out)?;
    } else {
        writeln!(
            out,
            "{:<40} {:<24} {:<14} {:<20} {:<8} USERS",
            "PLUGIN", "VOLUME", "NAME", "STATE", "MOUNTED"
        )?;
        for v in &report.volumes {
            let users: Vec<_> = v.users.iter().map(|u| shown(u)).collect();
            writeln!(
                out,
                "{:<40} {:<24} {:<14} {:<20} {:<8} {}",
                shown(&v.plugin),
                shown(&v.volume_id),
                shown(v.name.as_deref().unwrap_or("-")),
                v.state,
                if v.mounted { "yes" } else { "no" },
                if users.is_empty() {
                    "-".to_string()
                } else {
                    users.join(",")
                }
            )?;
            writeln!(
                out,
                "    mount point: {}",
                shown_os(v.mount_point.as_os_str())
            )?;
            if let Some(size) = size_line(v.capacity_bytes, v.capacity_enforced) {
                writeln!(out, "    size: {size}")?;
            }
            if let Some(usage) = usage_line(v) {
                writeln!(out, "    usage: {usage}")?;
            }
            if !v.accessible_topology.is_empty() {
                writeln!(
                    out,
                    "    reachable from: {}",
                    csi_isolator::provider::topology::describe(&v.accessible_topology)
                )?;
            }
            if let Some(gid) = v.mount_group {
                writeln!(
                    out,
                    "    mount group: {gid} (volume_mount_group, the plugin's)"
                )?;
            }
            if !v.mutable_parameters.is_empty() {
                let pairs: Vec<String> = v
                    .mutable_parameters
                    .iter()
                    .map(|(k, val)| format!("{}={}", escaped(k), escaped(val)))
                    .collect();
                writeln!(out, "    mutable parameters: {}", pairs.join(" "))?;
            }
            if let Some(source) = &v.content_source {
                let (how, name) = source.described();
                writeln!(out, "    {how} '{}'", escaped(name))?;
            }
            if let Some(f) = &v.fenced {
                let lost: Vec<_> = f.lost_users.iter().map(|u| shown(u)).collect();
                writeln!(
                    out,
                    "    fenced from node {} ({}); lost uses: {}",
                    shown(&f.node),
                    escaped(&f.why),
                    if lost.is_empty() {
                        "none".to_string()
                    } else {
                        lost.join(",")
                    }
                )?;
            }
            if let Some(e) = &v.expansion {
                writeln!(out, "    expansion pending: {}", expand::pending_line(e))?;
            }
            if let Some(d) = &v.disagreement {
                writeln!(out, "    ! {}", escaped(d))?;
            }
        }
        for u in &report.unreadable {
            writeln!(
                out,
                "! unreadable state {}: {}",
                shown_os(u.path.as_os_str()),
                escaped(&u.reason)
            )?;
        }
        if report.volumes.is_empty() && report.unreadable.is_empty() {
            writeln!(out, "(no volumes under {})", shown_os(work_dir.as_os_str()))?;
        }
    }
    out.flush()?;
    let healthy =
        report.unreadable.is_empty() && report.volumes.iter().all(|v| v.disagreement.is_none());
    // Left to the process's exit: freeing a node's thousands of records one by one costs more
    // than the exit does.
    std::mem::forget(report);
    Ok(if healthy {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// The `usage:` line of a volume whose stats were asked for: used/capacity (and inodes), "abnormal:
/// MESSAGE" when its plugin says so, or why the stats are missing. Plugin text is escaped and
/// bounded (`shown`).
fn usage_line(v: &VolumeStatus) -> Option<String> {
    let mut parts = Vec::new();
    if let Some(s) = &v.stats {
        let bytes = match (s.bytes_used, s.bytes_total) {
            (Some(used), Some(total)) => format!("{} / {}", mib(used), mib(total)),
            (None, Some(total)) => format!("capacity {}", mib(total)),
            (Some(used), None) => format!("{} used", mib(used)),
            (None, None) => String::new(),
        };
        if !bytes.is_empty() {
            parts.push(bytes);
        }
        if let (Some(used), Some(total)) = (s.inodes_used, s.inodes_total) {
            parts.push(format!("inodes {used} / {total}"));
        }
    }
    if let Some(c) = &v.condition {
        parts.push(if c.abnormal {
            format!("abnormal: {}", shown(&c.message))
        } else {
            "healthy".to_string()
        });
    }
    if let Some(why) = &v.stats_unavailable {
        parts.push(format!("stats unavailable: {}", shown(why)));
    }
    (!parts.is_empty()).then(|| parts.join(", "))
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / f64::from(1 << 20))
}

/// The `size:` line of a volume: its capacity, and whether anything holds the volume to it.
fn size_line(capacity: u64, enforced: Option<bool>) -> Option<String> {
    if capacity == 0 {
        return None;
    }
    let mib = capacity as f64 / f64::from(1 << 20);
    Some(match enforced {
        Some(true) => format!("{mib:.1} MiB (enforced)"),
        Some(false) => format!(
            "{mib:.1} MiB, not enforced: the volume is a plain directory and can fill its \
             filesystem (use a backing that enforces capacity, e.g. the bundled plugin's default loop)"
        ),
        None => format!("{mib:.1} MiB"),
    })
}
