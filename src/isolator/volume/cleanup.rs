//! Cleanup: what was mounted on the host for the container unmounted, its uses released, its
//! checkpoint removed.

use super::*;
use crate::error_chain::Chain;

impl VolumeIsolator {
    /// Cleanup: unmounts what the isolator mounted on the host for the
    /// container (bounded EBUSY retries, then a lazy detach) and releases its
    /// use of every volume (the provider unpublishes on last use).
    /// Idempotent.
    #[tracing::instrument(skip(self))]
    pub async fn cleanup(&self, container_id: &str) -> Result<(), IsolatorError> {
        let entry = self.entry(container_id);
        let mut slot = entry.lock().await;
        if let Some(rec) = slot.as_ref() {
            // The checks by fd and the unmounts (with their EBUSY retries' sleeps) in one trip to
            // the blocking pool.
            let host = HostSide {
                sys: self.sys.clone(),
                table: self.table.clone(),
                work_dir: self.work_dir.clone(),
                checkpoint: self.checkpoint_path(container_id),
            };
            let rec = rec.clone();
            blocking(move || host.unmount(&rec)).await?;
        }
        self.publisher
            .release_container(container_id)
            .await
            .map_err(|source| IsolatorError::Provider {
                container: container_id.to_string(),
                source: Box::new(source),
            })?;
        self.forget(container_id).await?;
        *slot = None;
        drop(slot);
        self.containers.lock().unwrap().remove(container_id);
        Ok(())
    }
}

/// What unmounting a container's host-side mounts needs, owned, to run on the blocking pool.
struct HostSide {
    sys: Arc<dyn Syscall>,
    table: Arc<dyn MountTable>,
    work_dir: PathBuf,
    /// The container's checkpoint (named when it is not trusted).
    checkpoint: PathBuf,
}

impl HostSide {
    /// Unmounts what the isolator made on the host for `rec` (the sweep of
    /// its sandbox, its host binds), after checking every path by fd: the
    /// record's paths must pass [`checkpoint_paths::check_record`], the
    /// sandbox must open beneath its root with no symlink on the way, and so
    /// must each host bind beneath the sandbox's fd. The unmounts then go by
    /// the kernel's names for what was opened, through the mount table.
    fn unmount(&self, rec: &ContainerRecord) -> Result<(), IsolatorError> {
        let container = &rec.container_id;
        let refuse = |source: CheckpointPathError| {
            tracing::error!(container_id = %container, error = %Chain(&source), "checkpoint names an unsafe path: nothing it names is unmounted");
            IsolatorError::UntrustedCheckpoint {
                container: container.clone(),
                path: self.checkpoint.clone(),
                source: Box::new(source),
            }
        };
        checkpoint_paths::check_record(rec, &self.work_dir).map_err(refuse)?;
        if !rec.binds_in_sandbox && rec.host_binds.is_empty() {
            return Ok(());
        }
        let Some((sandbox_fd, sandbox)) =
            checkpoint_paths::open_sandbox(rec, &self.work_dir).map_err(refuse)?
        else {
            // Nothing can be mounted under a directory that is not there.
            return Ok(());
        };
        let unmount = |path: &Path| {
            unmount_all_under(&*self.sys, &*self.table, path).map_err(|e| IsolatorError::Unmount {
                container: container.clone(),
                path: path.to_path_buf(),
                source: Box::new(e),
            })
        };
        if rec.binds_in_sandbox {
            unmount(&sandbox)?;
        }
        let mut binds = rec.host_binds.clone();
        binds.sort_by_key(|b| std::cmp::Reverse(b.components().count()));
        for b in binds {
            let checked = checkpoint_paths::check_host_bind(rec, &sandbox_fd, &sandbox, &b)
                .map_err(refuse)?;
            if let Some(b) = checked {
                unmount(&b)?;
            }
        }
        Ok(())
    }
}
