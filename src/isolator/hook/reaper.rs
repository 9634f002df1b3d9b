//! The reaper: hook containers whose poststop never came, cleaned up by a later create-runtime.

use super::*;
use crate::error_chain::Chain;
use crate::isolator::process_check;

/// Cleans up hook containers other than `current` (see [`hook_sandbox_of`]) whose init process is gone
/// (or its pid now names another process: [`process_check::not_the_same_process`]) or was never
/// recorded. Failures are logged: they must not fail another container.
pub(super) async fn reap_stale(isolator: &VolumeIsolator, work_dir: &Path, current: &str) {
    // The scan of the checkpoints and the reads of /proc in one trip to the blocking pool.
    let (dir, current_id) = (work_dir.to_path_buf(), current.to_string());
    let stale = crate::offload::blocking(move || stale_hook_containers(&dir, &current_id)).await;
    for rec in stale {
        tracing::warn!(container_id = %rec.container_id, pid = ?rec.pid, "hook container is gone without poststop; releasing its volumes");
        match isolator.cleanup(&rec.container_id).await {
            Ok(()) => remove_container_dir(work_dir, &rec.container_id).await,
            Err(err) => {
                tracing::error!(container_id = %rec.container_id, error = %Chain(&err), "cleanup of a stale hook container failed")
            }
        }
    }
}

/// The checkpointed hook containers of `work_dir` other than `current` whose init process is gone
/// or was never recorded. Blocks on the file system and `/proc`.
fn stale_hook_containers(work_dir: &Path, current: &str) -> Vec<crate::isolator::ContainerRecord> {
    // Only records whose every path passed the checkpoint checks; `run`'s containers (sandboxes
    // elsewhere) and anything else are left alone.
    crate::isolator::volume::checkpointed_in(work_dir)
        .into_iter()
        .filter(|rec| {
            rec.container_id != current && checkpoint_paths::is_hook_container(rec, work_dir)
        })
        .filter(|rec| {
            // The one rule's identity half: the recorded init process, by pid and start time (a
            // recycled pid is not it). Its namespace is not asked: the hook recorded it before the
            // container's pivot_root, so the root it saw is not the one the process has now.
            let alive = rec.pid.is_some_and(|pid| {
                let start = crate::launcher::process::process_start_time(pid);
                process_check::not_the_same_process(pid, rec.pid_start, std::process::id(), start)
                    .is_none()
            });
            !alive
        })
        .collect()
}
