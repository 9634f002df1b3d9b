//! The reaper: hook containers whose poststop never came, cleaned up by a later create-runtime.

use super::*;
use crate::error_chain::Chain;
use crate::isolator::process_check;

/// Cleans up hook containers other than `current` (see [`hook_sandbox_of`]) whose init process is gone
/// (or its pid now names another process: [`process_check::not_the_same_process`]) or was never
/// recorded. Failures are logged: they must not fail another container.
pub(super) async fn reap_stale(isolator: &VolumeIsolator, work_dir: &Path, current: &str) {
    // Only records whose every path passed the checkpoint checks; `run`'s containers (sandboxes
    // elsewhere) and anything else are left alone.
    for rec in isolator.checkpointed() {
        if rec.container_id == current || !checkpoint_paths::is_hook_container(&rec, work_dir) {
            continue;
        }
        // The one rule's identity half: the recorded init process, by pid and start time (a
        // recycled pid is not it). Its namespace is not asked: the hook recorded it before the
        // container's pivot_root, so the root it saw is not the one the process has now.
        let alive = rec.pid.is_some_and(|pid| {
            let start = crate::launcher::process::process_start_time(pid);
            process_check::not_the_same_process(pid, rec.pid_start, std::process::id(), start)
                .is_none()
        });
        if alive {
            continue;
        }
        tracing::warn!(container_id = %rec.container_id, pid = ?rec.pid, "hook container is gone without poststop; releasing its volumes");
        match isolator.cleanup(&rec.container_id).await {
            Ok(()) => remove_container_dir(work_dir, &rec.container_id),
            Err(err) => {
                tracing::error!(container_id = %rec.container_id, error = %Chain(&err), "cleanup of a stale hook container failed")
            }
        }
    }
}
