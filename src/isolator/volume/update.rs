//! Update: volumes mounted into, and unmounted from, a running container.

use super::*;
use crate::error_chain::Chain;
use crate::launcher::LaunchError;

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
        let rec = known(&mut slot, container_id)?;
        let pid = rec.pid.ok_or_else(|| IsolatorError::NoPid {
            container: container_id.to_string(),
        })?;
        let processes = self.processes.clone();
        let facts = blocking(move || processes.facts(pid)).await;
        still_the_container(container_id, rec, pid, &facts, self.processes.own_pid())?;
        let mut config = rec.config.clone();
        config.resources = resources.clone();
        let new_mounts = volume_mounts(container_id, &config, &resources, &self.work_dir)?;
        let UpdatePlan { mut added, removed } =
            plan_update(container_id, &rec.mounts, &new_mounts)?;
        self.fill_hardening(&mut added).await;
        self.check_writable(container_id, &added).await?;
        let sandbox_in = self.sandbox_in_container(&config);

        // 1. Publish what is new. Volumes the container uses already are only
        //    re-ensured; a failure undoes only the uses it added.
        let added_resources = resources_of(&resources, &added);
        let (id, work_dir, checked) = (
            container_id.to_string(),
            self.work_dir.clone(),
            added_resources.clone(),
        );
        blocking(move || check_agent_disks(&id, &checked, &work_dir, host_path_kind)).await?;
        let user = super::prepare::workload_user(container_id, rec.config.user.as_deref())?;
        let wanted = self.groups_to_grant(&resources, &added, user);
        let asked = ownership::groups_for_plugins(&wanted);
        let staged = self
            .publisher
            .publish(container_id, &added_resources, &asked)
            .await
            .map_err(|source| IsolatorError::Provider {
                container: container_id.to_string(),
                source: Box::new(source),
            })?;
        super::prepare::note_plugin_groups(container_id, &asked, &staged);
        let grants = ownership::left_to_isolator(wanted, &asked, &staged);
        if !grants.is_empty() {
            let id = container_id.to_string();
            if let Err(e) = blocking(move || super::prepare::grant_groups(&id, &grants)).await {
                // Nothing is mounted yet: end only the uses this update began.
                let kept: HashSet<_> = rec.mounts.iter().map(volume_key).collect();
                let began: Vec<Resource> = added_resources
                    .iter()
                    .filter(|r| {
                        let key = (
                            r.provider_id().map(str::to_string),
                            r.source_id().map(str::to_string),
                        );
                        !kept.contains(&key)
                    })
                    .cloned()
                    .collect();
                if let Err(undo) = self.publisher.unpublish(container_id, &began).await {
                    tracing::error!(container_id, error = %Chain(&undo), "cannot release the volumes of a failed update");
                }
                return Err(e);
            }
        }

        // 2. Unmount what goes first (a target that changes volume or mode is
        //    then free), then mount what comes. `current` tracks what is
        //    really mounted in the container, whatever fails.
        let mut current = rec.mounts.clone();
        let mut failure = None;
        for m in &removed {
            let elsewhere = current.iter().any(|c| c != m && c.source == m.source);
            let unmounted = self
                .in_container(pid, m, &sandbox_in, move |sys, pid, m, sandbox| {
                    crate::launcher::inject::unmount_from(sys, pid, m, sandbox, elsewhere)
                })
                .await;
            match unmounted {
                Ok(()) => current.retain(|c| c != m),
                Err(reason) => {
                    failure = Some(IsolatorError::Namespace {
                        container: container_id.to_string(),
                        step: "unmount",
                        volume: volume_name(m),
                        source: Box::new(reason),
                    });
                    break;
                }
            }
        }
        if failure.is_none() {
            for m in &added {
                let mounted = self
                    .in_container(pid, m, &sandbox_in, crate::launcher::inject::mount_into)
                    .await;
                match mounted {
                    Ok(()) => current.push(m.clone()),
                    Err(reason) => {
                        failure = Some(IsolatorError::Namespace {
                            container: container_id.to_string(),
                            step: "mount",
                            volume: volume_name(m),
                            source: Box::new(reason),
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
        self.persist(rec).await?;
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
        let released = self.publisher.unpublish(container_id, &release).await;
        if let Some(e) = failure {
            if let Err(r) = released {
                tracing::error!(container_id, error = %Chain(&r), "release after a failed update failed");
            }
            return Err(e);
        }
        released.map_err(|source| IsolatorError::Provider {
            container: container_id.to_string(),
            source: Box::new(source),
        })
    }

    /// Runs `step` (a mount into, or unmount from, the running container `pid`) through the
    /// isolator's seam on a blocking thread: the step joins a thread that enters the container's
    /// namespace, which must not hold up a runtime worker.
    async fn in_container(
        &self,
        pid: u32,
        m: &VolumeMount,
        sandbox_in: &Path,
        step: impl FnOnce(&dyn Syscall, u32, &VolumeMount, &Path) -> Result<(), LaunchError>
            + Send
            + 'static,
    ) -> Result<(), LaunchError> {
        let (sys, m, sandbox_in) = (self.sys.clone(), m.clone(), sandbox_in.to_path_buf());
        tokio::task::spawn_blocking(move || step(&*sys, pid, &m, &sandbox_in))
            .await
            .map_err(|e| {
                tracing::error!(error = %Chain(&e), "the namespace task failed");
                LaunchError::ThreadPanicked
            })?
    }

    fn sandbox_in_container(&self, config: &ContainerConfig) -> PathBuf {
        if config.rootfs.is_some() {
            PathBuf::from(SANDBOX_IN_ROOTFS)
        } else {
            config.sandbox.clone()
        }
    }
}

/// What an update changes, decided before anything is touched.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct UpdatePlan {
    /// Mounts the container gets, in the order asked for.
    pub(super) added: Vec<VolumeMount>,
    /// Mounts the container loses, deepest first (a volume nested in another goes before it).
    pub(super) removed: Vec<VolumeMount>,
}

/// The plan of an update from the mounts the container has (`current`) to the ones it asks for
/// (`wanted`). A mount is kept only if it is asked for unchanged: a change of volume, root or mode
/// (read-only or not) at a target is its removal and the addition of the new one. Taking a volume
/// away from under one that stays would take that one too (its mount hangs off the outer one):
/// refused ([`IsolatorError::BadTarget`], naming both), so the update changes nothing.
pub(super) fn plan_update(
    container: &str,
    current: &[VolumeMount],
    wanted: &[VolumeMount],
) -> Result<UpdatePlan, IsolatorError> {
    let added: Vec<VolumeMount> = wanted
        .iter()
        .filter(|m| !current.contains(m))
        .cloned()
        .collect();
    let mut removed: Vec<VolumeMount> = current
        .iter()
        .filter(|m| !wanted.contains(m))
        .cloned()
        .collect();
    removed.sort_by_key(|m| std::cmp::Reverse(m.target.components().count()));
    for m in &removed {
        let kept_inside = current.iter().find(|k| {
            wanted.contains(k)
                && k.root == m.root
                && k.target != m.target
                && k.target.starts_with(&m.target)
        });
        if let Some(kept) = kept_inside {
            return Err(IsolatorError::BadTarget {
                container: container.to_string(),
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
    Ok(UpdatePlan { added, removed })
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

/// Whether the recorded `pid` is still the container's, by the one rule
/// ([`process_check::not_still_the_container`]) over `facts`, what is known of it now.
fn still_the_container(
    container: &str,
    rec: &ContainerRecord,
    pid: u32,
    facts: &process_check::PidFacts,
    own_pid: u32,
) -> Result<(), IsolatorError> {
    match process_check::not_still_the_container(pid, rec.pid_start, rec.mount_view, own_pid, facts)
    {
        Some(why) => Err(IsolatorError::PidGone {
            container: container.to_string(),
            pid,
            why: why.to_string(),
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mount::TargetRoot;

    fn mount(volume: &str, root: TargetRoot, target: &str, readonly: bool) -> VolumeMount {
        VolumeMount {
            source: PathBuf::from("/work/volumes").join(volume),
            source_root: None,
            root,
            target: PathBuf::from(target),
            container_path: target.to_string(),
            readonly,
            volume_id: Some(volume.to_string()),
            provider_id: Some("p".to_string()),
            block: false,
            propagation: Default::default(),
            hardening: Default::default(),
        }
    }

    fn ids(ms: &[VolumeMount]) -> Vec<String> {
        ms.iter()
            .map(|m| format!("{}@{}", volume_name(m), m.target.display()))
            .collect()
    }

    #[test]
    fn update_plan_table() {
        use TargetRoot::{Rootfs, Sandbox};
        let a = mount("a", Sandbox, "data", false);
        let a_ro = mount("a", Sandbox, "data", true);
        let b = mount("b", Sandbox, "data/inner", false);
        let c = mount("c", Sandbox, "other", false);
        let d = mount("d", Sandbox, "data/inner/deeper", false);
        let a_rootfs = mount("a", Rootfs, "data", false);
        let b_rootfs = mount("b", Rootfs, "data/inner", false);
        let e = mount("e", Sandbox, "database", false);
        // (case, current, wanted, added, removed (in order), refused naming)
        type Case<'a> = (
            &'a str,
            Vec<&'a VolumeMount>,
            Vec<&'a VolumeMount>,
            Vec<&'a str>,
            Vec<&'a str>,
            Option<&'a str>,
        );
        let cases: Vec<Case> = vec![
            (
                "unchanged",
                vec![&a, &c],
                vec![&c, &a],
                vec![],
                vec![],
                None,
            ),
            (
                "one added",
                vec![&a],
                vec![&a, &c],
                vec!["c@other"],
                vec![],
                None,
            ),
            (
                "one removed",
                vec![&a, &c],
                vec![&a],
                vec![],
                vec!["c@other"],
                None,
            ),
            (
                "read-only change: out and in again",
                vec![&a],
                vec![&a_ro],
                vec!["a@data"],
                vec!["a@data"],
                None,
            ),
            (
                "nested ones removed deepest first",
                vec![&a, &b, &d, &c],
                vec![&c],
                vec![],
                vec!["d@data/inner/deeper", "b@data/inner", "a@data"],
                None,
            ),
            (
                "inner removed, outer kept",
                vec![&a, &b],
                vec![&a],
                vec![],
                vec!["b@data/inner"],
                None,
            ),
            (
                "outer removed, inner kept: refused",
                vec![&a, &b],
                vec![&b],
                vec![],
                vec![],
                Some("volume b stays mounted inside it at data/inner"),
            ),
            (
                "outer's mode changed, inner kept: refused",
                vec![&a, &b],
                vec![&a_ro, &b],
                vec![],
                vec![],
                Some("volume b stays mounted inside it"),
            ),
            (
                "same path in another root is not inside",
                vec![&a, &b_rootfs],
                vec![&b_rootfs],
                vec![],
                vec!["a@data"],
                None,
            ),
            (
                "a sibling whose name starts alike is not inside",
                vec![&a, &e],
                vec![&e],
                vec![],
                vec!["a@data"],
                None,
            ),
            (
                "moved to the rootfs",
                vec![&a],
                vec![&a_rootfs],
                vec!["a@data"],
                vec!["a@data"],
                None,
            ),
        ];
        for (case, current, wanted, added, removed, refused) in cases {
            let current: Vec<VolumeMount> = current.into_iter().cloned().collect();
            let wanted: Vec<VolumeMount> = wanted.into_iter().cloned().collect();
            match (plan_update("c1", &current, &wanted), refused) {
                (Ok(plan), None) => {
                    assert_eq!(ids(&plan.added), added, "{case}: added");
                    assert_eq!(ids(&plan.removed), removed, "{case}: removed");
                }
                (Err(e), Some(why)) => {
                    let e = e.to_string();
                    assert!(e.contains(why), "{case}: {e}");
                    assert!(e.contains("c1"), "{case}: {e}");
                }
                (got, _) => panic!("{case}: {got:?}"),
            }
        }
    }
}
