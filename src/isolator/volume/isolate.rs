//! Isolate: the container's process pinned (pid, start time, mount namespace and root).

use super::*;

impl VolumeIsolator {
    /// Isolate: records the container's pid (needed to mount into its
    /// namespace on update).
    pub async fn isolate(&self, container_id: &str, pid: u32) -> Result<(), IsolatorError> {
        let facts = self.processes.facts(pid);
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
        self.try_modify(container_id, |rec| {
            let rootfs = match &rec.config.rootfs {
                Some(path) => {
                    let m = std::fs::metadata(path).map_err(|e| {
                        refuse(format!(
                            "its rootfs {} cannot be read: {e}",
                            crate::shown::shown_os(path.as_os_str())
                        ))
                    })?;
                    Some((m.dev(), m.ino()))
                }
                None => None,
            };
            let start =
                process_start_time(pid).ok_or_else(|| refuse("no such process".into()))?;
            let seen = process_check::Seen {
                view: mount_view(pid),
                shares_our_mount_namespace: shares_mount_namespace(pid),
            };
            if let Some(why) = process_check::not_the_container(rootfs, &seen) {
                return Err(refuse(why));
            }
            if process_start_time(pid) != Some(start) {
                return Err(refuse(
                    "it exited while it was being checked (its pid now names another process or none)"
                        .into(),
                ));
            }
            rec.pid = Some(pid);
            rec.pid_start = Some(start);
            rec.mount_view = seen.view;
            Ok(())
        })
        .await
    }
}
