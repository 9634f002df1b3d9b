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
        crate::resource::validate_container_id(container_id)
            .map_err(|e| IsolatorError::InvalidContainerId(Box::new(e)))?;
        let entry = self.entry(container_id);
        let mut slot = entry.lock().await;
        if slot.is_some() {
            return Err(IsolatorError::AlreadyPrepared {
                container: container_id.to_string(),
            });
        }
        let mut mounts = volume_mounts(container_id, &config, &config.resources, &self.work_dir)?;
        self.fill_hardening(&mut mounts).await;
        let user = workload_user(container_id, config.user.as_deref())?;
        // The checks that look at the host's files (a stat per agent disk; the config's paths
        // made canonical), each step one trip to the blocking pool.
        let (id, work_dir, resources) = (
            container_id.to_string(),
            self.work_dir.clone(),
            config.resources.clone(),
        );
        blocking(move || check_agent_disks(&id, &resources, &work_dir, host_path_kind)).await?;
        self.check_writable(container_id, &mounts).await?;
        let (id, work_dir, checked) = (
            container_id.to_string(),
            self.work_dir.clone(),
            config.clone(),
        );
        blocking(move || check_config(&id, &checked, &work_dir)).await?;
        let rec = ContainerRecord::new(container_id, config, mounts.clone());
        self.persist(&rec).await?;
        let wanted = self.groups_to_grant(&rec.config.resources, &rec.mounts, user);
        let asked = ownership::groups_for_plugins(&wanted);
        let staged = match self
            .publisher
            .publish(container_id, &rec.config.resources, &asked)
            .await
        {
            Ok(staged) => staged,
            Err(source) => {
                let _ = self.forget(container_id).await;
                return Err(IsolatorError::Provider {
                    container: container_id.to_string(),
                    source: Box::new(source),
                });
            }
        };
        note_plugin_groups(container_id, &asked, &staged);
        let grants = ownership::left_to_isolator(wanted, &asked, &staged);
        *slot = Some(rec);
        drop(slot);
        if !grants.is_empty() {
            let id = container_id.to_string();
            if let Err(e) = blocking(move || grant_groups(&id, &grants)).await {
                let _ = self.cleanup(container_id).await;
                return Err(e);
            }
        }
        Ok(LaunchInfo { mounts })
    }

    /// The volume roots among `mounts` (of `resources`) to make writable for the user's group
    /// ([`ownership::group_to_grant`]), with that group: by the plugin or by the isolator
    /// ([`ownership::groups_for_plugins`], [`ownership::left_to_isolator`]).
    pub(super) fn groups_to_grant(
        &self,
        resources: &[Resource],
        mounts: &[VolumeMount],
        user: Option<crate::launcher::Credentials>,
    ) -> Vec<(VolumeMount, u32)> {
        let shared: HashSet<PathBuf> = resources
            .iter()
            .filter(|r| r.is_shared())
            .filter_map(|r| r.host_path(&self.work_dir).ok())
            .collect();
        mounts
            .iter()
            .filter_map(|m| {
                ownership::group_to_grant(user, m.readonly, shared.contains(&m.source))
                    .map(|gid| (m.clone(), gid))
            })
            .collect()
    }
}

/// Logs the volumes whose plugin owns their group (VOLUME_MOUNT_GROUP): the isolator leaves
/// their roots alone.
pub(super) fn note_plugin_groups(
    container: &str,
    asked: &crate::provider::MountGroups,
    staged: &crate::provider::MountGroups,
) {
    for (key, gid) in asked {
        if let Some(staged_with) = staged.get(key) {
            tracing::info!(container, volume = %crate::shown::shown(&key.1), gid, staged_with,
                "volume root left to the plugin: staged with volume_mount_group");
        }
    }
}

/// The workload's user and group from its configuration's `user` (none: root's, nothing to
/// grant), refused naming the container when it cannot be resolved.
pub(super) fn workload_user(
    container: &str,
    user: Option<&str>,
) -> Result<Option<crate::launcher::Credentials>, IsolatorError> {
    user.map(ownership::resolve_user)
        .transpose()
        .map_err(|reason| IsolatorError::BadUser {
            container: container.to_string(),
            reason,
        })
}

/// Applies [`ownership::grant_group`] to each volume root, naming the volume that failed.
pub(super) fn grant_groups(
    container: &str,
    grants: &[(VolumeMount, u32)],
) -> Result<(), IsolatorError> {
    for (mount, gid) in grants {
        let changed =
            ownership::grant_group(mount, *gid).map_err(|source| IsolatorError::Ownership {
                container: container.to_string(),
                volume: mount
                    .volume_id
                    .clone()
                    .unwrap_or_else(|| mount.source.display().to_string()),
                gid: *gid,
                source,
            })?;
        if changed {
            tracing::info!(container, volume = ?mount.volume_id, gid, "volume root made writable for the workload's group");
        }
    }
    Ok(())
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
