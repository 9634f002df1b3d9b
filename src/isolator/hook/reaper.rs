//! The reaper: hook containers whose poststop never came, cleaned up by a later create-runtime.

use super::*;

/// Cleans up hook containers other than `current` (see [`hook_sandbox_of`]) whose init process is gone
/// or was never recorded. Failures are logged: they must not fail another container.
pub(super) async fn reap_stale(isolator: &VolumeIsolator, work_dir: &Path, current: &str) {
    // Only records whose every path passed the checkpoint checks; `run`'s containers (sandboxes
    // elsewhere) and anything else are left alone.
    for rec in isolator.checkpointed() {
        if rec.container_id == current || !checkpoint_paths::is_hook_container(&rec, work_dir) {
            continue;
        }
        let alive = rec
            .pid
            .is_some_and(|pid| Path::new(&format!("/proc/{pid}")).exists());
        if alive {
            continue;
        }
        tracing::warn!(container_id = %rec.container_id, pid = ?rec.pid, "hook container is gone without poststop; releasing its volumes");
        match isolator.cleanup(&rec.container_id).await {
            Ok(()) => remove_container_dir(work_dir, &rec.container_id),
            Err(err) => {
                tracing::error!(container_id = %rec.container_id, error = %err, "cleanup of a stale hook container failed")
            }
        }
    }
}
