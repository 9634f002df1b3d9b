//! Prepare: the container's checkpoint made durable, its volumes published, its mounts planned.

use super::*;

impl VolumeIsolator {
    /// Prepare: publishes the container's volumes (ensure-all, per
    /// provider) and returns one bind mount per volume. On failure nothing
    /// stays published for it and the error names the volume.
    #[tracing::instrument(skip(self, config))]
    pub async fn prepare(
        &self,
        container_id: &str,
        config: ContainerConfig,
    ) -> Result<LaunchInfo, IsolatorError> {
        crate::resource::validate_container_id(container_id).map_err(|e| {
            IsolatorError::InvalidContainerId {
                container: container_id.to_string(),
                source: Box::new(e),
            }
        })?;
        let entry = self.entry(container_id);
        let mut slot = entry.lock().await;
        if slot.is_some() {
            return Err(IsolatorError::AlreadyPrepared {
                container: container_id.to_string(),
            });
        }
        let mounts = volume_mounts(container_id, &config, &config.resources, &self.work_dir)?;
        check_agent_disks(
            container_id,
            &config.resources,
            &self.work_dir,
            host_path_kind,
        )?;
        self.check_writable(container_id, &mounts).await?;
        check_config(container_id, &config, &self.work_dir)?;
        let rec = ContainerRecord::new(container_id, config, mounts.clone());
        self.persist(&rec)?;
        if let Err(source) = self
            .publisher
            .publish(container_id, &rec.config.resources)
            .await
        {
            let _ = self.forget(container_id);
            return Err(IsolatorError::Provider {
                container: container_id.to_string(),
                source: Box::new(source),
            });
        }
        *slot = Some(rec);
        Ok(LaunchInfo { mounts })
    }
}

/// Refuses a configuration whose sandbox or rootfs a checkpoint could not
/// be trusted with later (see [`checkpoint_paths`]): what prepare records
/// must pass every check recovery makes.
fn check_config(
    container: &str,
    config: &ContainerConfig,
    work_dir: &Path,
) -> Result<(), IsolatorError> {
    let probe = ContainerRecord::new(container, config.clone(), Vec::new());
    checkpoint_paths::check_record(&probe, work_dir)
        .and_then(|()| checkpoint_paths::check_canonical("sandbox", &config.sandbox))
        .map_err(|source| IsolatorError::UnsafeConfigPath {
            container: container.to_string(),
            path: checkpoint_path(work_dir, container),
            source: Box::new(source),
        })
}
