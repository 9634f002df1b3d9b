//! Update: volumes mounted into, and unmounted from, a running container.

use super::*;

impl VolumeIsolator {
    /// Update: new volumes are published first; then removed ones are
    /// unmounted from the running container's mount namespace and new ones
    /// mounted into it. Whatever fails, the checkpoint records what is
    /// really mounted and only the volumes the container no longer mounts
    /// are released; the error names the step and the volume.
    #[tracing::instrument(skip(self, resources))]
    pub async fn update(
        &self,
        container_id: &str,
        resources: Vec<Resource>,
    ) -> Result<(), IsolatorError> {
        let entry = self.entry(container_id);
        let mut slot = entry.lock().await;
        let rec = slot
            .as_mut()
            .ok_or_else(|| IsolatorError::UnknownContainer {
                container: container_id.to_string(),
            })?;
        let pid = live_pid(container_id, rec)?;
        let mut config = rec.config.clone();
        config.resources = resources.clone();
        let new_mounts = volume_mounts(container_id, &config, &resources, &self.work_dir)?;
        let added: Vec<VolumeMount> = new_mounts
            .iter()
            .filter(|m| !rec.mounts.contains(m))
            .cloned()
            .collect();
        let mut removed: Vec<VolumeMount> = rec
            .mounts
            .iter()
            .filter(|m| !new_mounts.contains(m))
            .cloned()
            .collect();
        // Deepest first: a volume nested in another goes before it.
        removed.sort_by_key(|m| std::cmp::Reverse(m.target.components().count()));
        // Taking a volume away from under one that stays would take that one too (its mount
        // hangs off the outer one): refused before anything changes.
        for m in &removed {
            let kept_inside = rec.mounts.iter().find(|k| {
                new_mounts.contains(k)
                    && k.root == m.root
                    && k.target != m.target
                    && k.target.starts_with(&m.target)
            });
            if let Some(kept) = kept_inside {
                return Err(IsolatorError::BadTarget {
                    container: container_id.to_string(),
                    volume: volume_name(m),
                    container_path: m.container_path.clone(),
                    reason: format!(
                        "volume {} stays mounted inside it at {}: remove both, or neither",
                        volume_name(kept),
                        kept.container_path
                    ),
                });
            }
        }
        self.check_writable(container_id, &added).await?;
        let sandbox_in = self.sandbox_in_container(&config);

        // 1. Publish what is new. Volumes the container uses already are only
        //    re-ensured; a failure undoes only the uses it added.
        let added_resources = resources_of(&resources, &added);
        self.manager
            .publish(container_id, &added_resources)
            .await
            .map_err(|source| IsolatorError::Provider {
                container: container_id.to_string(),
                source: Box::new(source),
            })?;

        // 2. Unmount what goes first (a target that changes volume or mode is
        //    then free), then mount what comes. `current` tracks what is
        //    really mounted in the container, whatever fails.
        let mut current = rec.mounts.clone();
        let mut failure = None;
        for m in &removed {
            let elsewhere = current.iter().any(|c| c != m && c.source == m.source);
            match crate::launcher::inject::unmount_from(pid, m, &sandbox_in, elsewhere) {
                Ok(()) => current.retain(|c| c != m),
                Err(reason) => {
                    failure = Some(IsolatorError::Namespace {
                        container: container_id.to_string(),
                        step: "unmount",
                        volume: volume_name(m),
                        reason: reason.to_string(),
                    });
                    break;
                }
            }
        }
        if failure.is_none() {
            for m in &added {
                match crate::launcher::inject::mount_into(pid, m, &sandbox_in) {
                    Ok(()) => current.push(m.clone()),
                    Err(reason) => {
                        failure = Some(IsolatorError::Namespace {
                            container: container_id.to_string(),
                            step: "mount",
                            volume: volume_name(m),
                            reason: reason.to_string(),
                        });
                        break;
                    }
                }
            }
        }

        // 3. Record what is mounted, then end the uses of volumes the
        //    container no longer mounts (and of new ones that did not make it).
        let mut all_resources = rec.config.resources.clone();
        all_resources.extend(resources.iter().cloned());
        if failure.is_none() {
            rec.config = config;
            rec.mounts = new_mounts;
        } else {
            rec.config.resources = resources_of(&all_resources, &current);
            rec.mounts = current;
        }
        self.persist(rec)?;
        let kept: HashSet<(Option<String>, Option<String>)> =
            rec.mounts.iter().map(volume_key).collect();
        let mut seen = HashSet::new();
        let release: Vec<Resource> = all_resources
            .into_iter()
            .filter(|r| r.container_path().is_some())
            .filter(|r| {
                let key = (
                    r.provider_id().map(str::to_string),
                    r.source_id().map(str::to_string),
                );
                !kept.contains(&key) && seen.insert(key)
            })
            .collect();
        let released = self.manager.unpublish(container_id, &release).await;
        if let Some(e) = failure {
            if let Err(r) = released {
                tracing::error!(container_id, error = %r, "release after a failed update failed");
            }
            return Err(e);
        }
        released.map_err(|source| IsolatorError::Provider {
            container: container_id.to_string(),
            source: Box::new(source),
        })
    }

    fn sandbox_in_container(&self, config: &ContainerConfig) -> PathBuf {
        if config.rootfs.is_some() {
            PathBuf::from(SANDBOX_IN_ROOTFS)
        } else {
            config.sandbox.clone()
        }
    }
}

/// The resources among `all` whose mounts are in `mounts` (same volume,
/// same container path).
fn resources_of(all: &[Resource], mounts: &[VolumeMount]) -> Vec<Resource> {
    all.iter()
        .filter(|r| {
            mounts.iter().any(|m| {
                r.container_path() == Some(m.container_path.as_str())
                    && r.source_id().map(str::to_string) == m.volume_id
            })
        })
        .cloned()
        .collect()
}

/// The volume a mount belongs to: (provider id, volume id).
fn volume_key(m: &VolumeMount) -> (Option<String>, Option<String>) {
    (m.provider_id.clone(), m.volume_id.clone())
}

/// The container's pid, checked to still be the container's: same start
/// time as at `isolate`, and not in the agent's own mount namespace (then it
/// is not a container, and mounting "into" it would mount on the host).
fn live_pid(container: &str, rec: &ContainerRecord) -> Result<u32, IsolatorError> {
    use crate::launcher::process::{process_start_time, shares_mount_namespace};
    let pid = rec.pid.ok_or_else(|| IsolatorError::NoPid {
        container: container.to_string(),
    })?;
    let gone = |why: &str| IsolatorError::PidGone {
        container: container.to_string(),
        pid,
        why: why.to_string(),
    };
    match process_start_time(pid) {
        None => return Err(gone("no such process")),
        Some(t) if rec.pid_start.is_some_and(|s| s != t) => {
            return Err(gone("the pid now belongs to another process"))
        }
        Some(_) => {}
    }
    if shares_mount_namespace(pid) == Some(true) {
        return Err(gone("it is in the agent's own mount namespace"));
    }
    if let Some(then) = rec.mount_view {
        if crate::launcher::process::mount_view(pid) != Some(then) {
            return Err(gone(
                "it has moved to another mount namespace or root since it was isolated",
            ));
        }
    }
    Ok(pid)
}
