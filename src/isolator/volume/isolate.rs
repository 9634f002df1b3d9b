//! Isolate: the container's process pinned (pid, start time, mount namespace and root).

use super::*;

impl VolumeIsolator {
    /// Isolate: records the container's pid (needed to mount into its
    /// namespace on update).
    pub async fn isolate(&self, container_id: &str, pid: u32) -> Result<(), IsolatorError> {
        let processes = self.processes.clone();
        let facts = blocking(move || processes.facts(pid)).await;
        self.modify(container_id, |rec| {
            rec.pid = Some(pid);
            rec.pid_start = facts.start;
            rec.mount_view = facts.view;
        })
        .await
    }

    /// Isolate for a caller that may name any pid (serve's containerizer): the pid is recorded only
    /// if it is the container's process ([`process_check::not_the_container`]: not in the isolator's
    /// own mount namespace; with a rootfs, rooted in it by device and inode), checked and recorded
    /// under the container's lock from one reading of the process, its start time read before and
    /// after, so what is recorded is what was checked. A refusal records nothing.
    pub async fn isolate_verified(
        &self,
        container_id: &str,
        pid: u32,
    ) -> Result<(), IsolatorError> {
        use crate::launcher::process::{mount_view, process_start_time, shares_mount_namespace};
        use std::os::unix::fs::MetadataExt;
        let refuse = |why: String| IsolatorError::NotTheContainer {
            container: container_id.to_string(),
            pid,
            why,
        };
        let entry = self.entry(container_id);
        let mut slot = entry.lock().await;
        let rec = known(&mut slot, container_id)?;
        // The reads of /proc and of the rootfs in one trip to the blocking pool, under the
        // container's lock; the record is changed only after, from what was checked.
        let rootfs_path = rec.config.rootfs.clone();
        let checked = blocking(move || {
            let rootfs = match &rootfs_path {
                Some(path) => {
                    let m = std::fs::metadata(path).map_err(|e| {
                        format!(
                            "its rootfs {} cannot be read: {e}",
                            crate::shown::shown_os(path.as_os_str())
                        )
                    })?;
                    Some((m.dev(), m.ino()))
                }
                None => None,
            };
            let start = process_start_time(pid).ok_or_else(|| "no such process".to_string())?;
            let seen = process_check::Seen {
                view: mount_view(pid),
                shares_our_mount_namespace: shares_mount_namespace(pid),
            };
            if let Some(why) = process_check::not_the_container(rootfs, &seen) {
                return Err(why);
            }
            if process_start_time(pid) != Some(start) {
                return Err(
                    "it exited while it was being checked (its pid now names another process or none)"
                        .to_string(),
                );
            }
            Ok((start, seen.view))
        })
        .await;
        let (start, view) = checked.map_err(refuse)?;
        rec.pid = Some(pid);
        rec.pid_start = Some(start);
        rec.mount_view = view;
        self.persist(rec).await
    }
}
