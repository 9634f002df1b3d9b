//! `csi-isolator status [--json]`: every volume with its state, its users,
//! its mount point and what the mount table says, disagreements flagged.
//! Read-only: starts no plugin and changes nothing; the work dir is
//! checked first (`csi_isolator::workdir::verify`).

use std::path::Path;
use std::process::ExitCode;

use clap::Args;
use csi_isolator::mount::ProcMountTable;
use csi_isolator::provider::status::{scan, StatusReport};

use super::{escaped, shown, shown_os};

/// `status` options.
#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  csi-isolator --work-dir /var/lib/csi-demo status
  csi-isolator status --json | jq '.volumes[] | select(.disagreement != null)'
Exit status: 0 when every volume agrees with the mount table, 1 otherwise.")]
pub struct StatusArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// Runs `status`; exits 1 when anything disagrees or cannot be read.
/// A work dir another user could have changed is refused before anything
/// in it is read; one that does not exist has no volumes.
pub fn run(work_dir: &Path, args: StatusArgs) -> anyhow::Result<ExitCode> {
    let report = match csi_isolator::workdir::verify(work_dir)? {
        Some(canonical) => scan(&canonical, &ProcMountTable::new())?,
        None => StatusReport::default(),
    };
    if args.json {
        outln!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        outln!(
            "{:<40} {:<24} {:<14} {:<20} {:<8} USERS",
            "PLUGIN",
            "VOLUME",
            "NAME",
            "STATE",
            "MOUNTED"
        );
        for v in &report.volumes {
            let users: Vec<_> = v.users.iter().map(|u| shown(u)).collect();
            outln!(
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
            );
            outln!("    mount point: {}", shown_os(v.mount_point.as_os_str()));
            if let Some(size) = size_line(v.capacity_bytes, v.capacity_enforced) {
                outln!("    size: {size}");
            }
            if !v.accessible_topology.is_empty() {
                outln!(
                    "    reachable from: {}",
                    csi_isolator::provider::topology::describe(&v.accessible_topology)
                );
            }
            if let Some(gid) = v.mount_group {
                outln!("    mount group: {gid} (volume_mount_group, the plugin's)");
            }
            if let Some(d) = &v.disagreement {
                outln!("    ! {}", escaped(d));
            }
        }
        for u in &report.unreadable {
            outln!(
                "! unreadable state {}: {}",
                shown_os(u.path.as_os_str()),
                escaped(&u.reason)
            );
        }
        if report.volumes.is_empty() && report.unreadable.is_empty() {
            outln!("(no volumes under {})", shown_os(work_dir.as_os_str()));
        }
    }
    let healthy =
        report.unreadable.is_empty() && report.volumes.iter().all(|v| v.disagreement.is_none());
    Ok(if healthy {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
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
