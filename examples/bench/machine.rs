//! What the benchmark runs on: CPUs, kernel, CPU model, the file system of
//! the work dir, and the process's own memory as the kernel reports it.

use std::path::Path;

use csi_isolator::mount::{MountTable, ProcMountTable};

/// The machine line at the top of the report.
pub fn describe(work_dir: &Path) -> String {
    let nproc = std::thread::available_parallelism().map_or(0, |n| n.get());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into());
    let cpu = cpu_model().unwrap_or_else(|| "unknown".into());
    let mounts = mount_count();
    let fs = file_system_of(work_dir).unwrap_or_else(|| "unknown".into());
    let load = std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default();
    format!(
        "machine: nproc {nproc} | kernel {kernel} | CPU {cpu} | load average at start {load}\n\
         work dir: {} ({fs}) | mounts in this namespace at start: {mounts}",
        work_dir.display()
    )
}

/// `model name` of the first CPU in /proc/cpuinfo.
pub fn cpu_model() -> Option<String> {
    let text = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    text.lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_string())
}

/// Lines of /proc/self/mountinfo.
pub fn mount_count() -> usize {
    ProcMountTable::new().mounts().map_or(0, |m| m.len())
}

/// `<fs type> on <source>` of the mount holding `path`.
pub fn file_system_of(path: &Path) -> Option<String> {
    let mounts = ProcMountTable::new().mounts().ok()?;
    mounts
        .iter()
        .filter(|m| path.starts_with(&m.mount_point))
        .max_by_key(|m| m.mount_point.components().count())
        .map(|m| format!("{} on {}", m.fs_type, m.source))
}

pub use csi_isolator::memory::status_kib;
