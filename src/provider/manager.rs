//! Routes publish and unpublish requests to resource providers by
//! `Resource.provider_id`. Resources without one (the agent's own disks)
//! pass through untouched; an unknown provider id fails, naming it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;

use futures::future::join_all;

use crate::error_chain::Chain;
use crate::provider::access::Access;
use crate::provider::error::ProviderError;
use crate::provider::publish::{MountCheck, VolumeUse};
use crate::provider::storage::StorageProvider;
use crate::resource::Resource;

/// A resource the manager published: its index in the request and the
/// volume's host mount point.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PublishedVolume {
    /// Index of the resource in the request.
    pub index: usize,
    /// The provider id.
    pub provider_id: String,
    /// The volume id.
    pub volume_id: String,
    /// Where the volume is mounted on the host.
    pub mount_point: PathBuf,
    /// The group the plugin staged and published the volume with (`volume_mount_group`);
    /// `None` when it was given none (the plugin lacks VOLUME_MOUNT_GROUP, the volume is a
    /// block volume, or it was staged without one).
    pub mount_group: Option<u32>,
}

/// The group each volume of a publish is to be made accessible to, by (provider id, volume
/// id): the workload's, chosen by the isolator's ownership rule. Volumes not in it ask none.
pub type MountGroups = BTreeMap<(String, String), u32>;

/// How many containers [`Manager::republish_all`] publishes at a time: enough to overlap the
/// RPCs of volumes a crash left short of PUBLISHED, without a future per container of a node's
/// thousands at once.
pub const REPUBLISH_CONCURRENCY: usize = 64;

/// One container of a batch [`Manager::republish_all`] re-ensures.
#[derive(Clone, Debug, Default)]
pub struct Republish {
    /// The container.
    pub container_id: String,
    /// Its resources (provider ones are published, others pass).
    pub resources: Vec<Resource>,
    /// The group each volume is to be made accessible to ([`MountGroups`]).
    pub groups: MountGroups,
}

/// What [`Manager::republish_all`] did.
#[derive(Debug, Default)]
pub struct Republished {
    /// Each container's publish, in the batch's order.
    pub containers: Vec<Result<(), ProviderError>>,
    /// The volumes the batch's checks found not published and could not repair, as (provider
    /// id, volume id, error).
    pub unensured: Vec<(String, String, ProviderError)>,
}

/// Several providers side by side, keyed by provider id.
#[derive(Debug, Default)]
pub struct Manager {
    providers: BTreeMap<String, Arc<StorageProvider>>,
}

impl Manager {
    /// An empty manager.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a provider (replacing one with the same id).
    pub fn add(&mut self, provider: Arc<StorageProvider>) {
        self.providers.insert(provider.id().to_string(), provider);
    }

    /// The provider with this id.
    pub fn get(&self, provider_id: &str) -> Option<&Arc<StorageProvider>> {
        self.providers.get(provider_id)
    }

    /// Every provider.
    pub fn providers(&self) -> impl Iterator<Item = &Arc<StorageProvider>> {
        self.providers.values()
    }

    /// Groups the provider resources of a request by provider:
    /// provider id -> [(index, volume id)].
    fn route(
        &self,
        resources: &[Resource],
    ) -> Result<BTreeMap<String, Vec<(usize, String)>>, ProviderError> {
        let mut by_provider: BTreeMap<String, Vec<(usize, String)>> = BTreeMap::new();
        for (i, r) in resources.iter().enumerate() {
            let Some(pid) = r.provider_id() else { continue };
            if !self.providers.contains_key(pid) {
                return Err(ProviderError::UnknownProvider {
                    provider: pid.to_string(),
                    resource: r.describe(),
                });
            }
            if !r.is_disk() {
                continue;
            }
            let Some(id) = r.source_id() else {
                return Err(ProviderError::MissingVolumeId {
                    resource: r.describe(),
                    provider: pid.to_string(),
                });
            };
            by_provider
                .entry(pid.to_string())
                .or_default()
                .push((i, id.to_string()));
        }
        Ok(by_provider)
    }

    /// Publishes a container's provider resources (ensure-all per provider).
    /// On failure nothing published here stays in use by the container. A volume is used
    /// for writing when any of its resources binds it read-write (`disk.volume.mode`), for
    /// reading otherwise; its access mode decides whether that use is admitted.
    pub async fn publish(
        &self,
        container_id: &str,
        resources: &[Resource],
    ) -> Result<Vec<PublishedVolume>, ProviderError> {
        self.publish_with_groups(container_id, resources, &MountGroups::new())
            .await
    }

    /// [`publish`](Self::publish), a volume in `groups` asking its plugin for that group
    /// ([`VolumeUse::mount_group`]).
    pub async fn publish_with_groups(
        &self,
        container_id: &str,
        resources: &[Resource],
        groups: &MountGroups,
    ) -> Result<Vec<PublishedVolume>, ProviderError> {
        self.publish_checked(container_id, resources, groups, MountCheck::Now)
            .await
    }

    /// Recovery's re-ensure of many containers: each container's resources published as
    /// [`publish_with_groups`](Self::publish_with_groups) publishes them (its uses recorded, a
    /// volume short of PUBLISHED driven there, a failure undoing only the uses it added), up to
    /// [`REPUBLISH_CONCURRENCY`] containers at a time, but the mount checks of the volumes at
    /// rest at PUBLISHED, and ensure-all, made once for the whole batch, per provider
    /// ([`StorageProvider::ensure_listed`]): a few trips to the blocking pool, not one per
    /// container.
    pub async fn republish_all(&self, batch: &[Republish]) -> Republished {
        let mut containers: Vec<Result<(), ProviderError>> = Vec::with_capacity(batch.len());
        for wave in batch.chunks(REPUBLISH_CONCURRENCY) {
            let published = join_all(wave.iter().map(|c| {
                self.publish_checked(
                    &c.container_id,
                    &c.resources,
                    &c.groups,
                    MountCheck::Batched,
                )
            }))
            .await;
            containers.extend(published.into_iter().map(|r| r.map(|_| ())));
        }
        // What each provider is to check: every volume a container of the batch now uses.
        let mut listed: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (c, result) in batch.iter().zip(&containers) {
            // Its publish routed them already: routing cannot fail now.
            let routes = match result {
                Ok(()) => self.route(&c.resources).unwrap_or_default(),
                Err(_) => continue,
            };
            for (pid, vols) in routes {
                listed
                    .entry(pid)
                    .or_default()
                    .extend(vols.into_iter().map(|(_, id)| id));
            }
        }
        let checked = join_all(listed.iter().map(|(pid, ids)| async move {
            let failures = self.providers[pid].ensure_listed(ids).await;
            failures
                .into_iter()
                .map(|(volume, e)| (pid.to_string(), volume, e))
                .collect::<Vec<_>>()
        }))
        .await;
        Republished {
            containers,
            unensured: checked.into_iter().flatten().collect(),
        }
    }

    /// [`publish_with_groups`](Self::publish_with_groups), the volumes at rest at PUBLISHED
    /// checked as `check` says.
    async fn publish_checked(
        &self,
        container_id: &str,
        resources: &[Resource],
        groups: &MountGroups,
        check: MountCheck,
    ) -> Result<Vec<PublishedVolume>, ProviderError> {
        let routes = self.route(resources)?;
        let results = join_all(routes.iter().map(|(pid, vols)| async move {
            let provider = &self.providers[pid];
            // A volume the container binds read-write anywhere is a writing use.
            let mut access: BTreeMap<&str, Access> = BTreeMap::new();
            for (i, id) in vols {
                let this = Access::from_readonly(resources[*i].read_only());
                let seen = access.entry(id.as_str()).or_insert(this);
                if this.writes() {
                    *seen = Access::Write;
                }
            }
            let uses: Vec<VolumeUse> = access
                .iter()
                .map(|(id, a)| VolumeUse {
                    volume_id: id.to_string(),
                    access: Some(*a),
                    mount_group: groups.get(&(pid.clone(), id.to_string())).copied(),
                })
                .collect();
            provider
                .publish_uses_checked(container_id, &uses, check)
                .await
                .map(|published| {
                    let added: Vec<String> = uses
                        .iter()
                        .zip(&published)
                        .filter(|(_, o)| o.added)
                        .map(|(u, _)| u.volume_id.clone())
                        .collect();
                    let group_of: BTreeMap<String, Option<u32>> = uses
                        .iter()
                        .zip(&published)
                        .map(|(u, o)| (u.volume_id.clone(), o.mount_group))
                        .collect();
                    (pid, vols, added, group_of)
                })
        }))
        .await;
        if results.iter().any(|r| r.is_err()) {
            // Undo only the uses this call added: the container may have used
            // some of these volumes before (an update).
            for (pid, _, added, _) in results.iter().flatten() {
                let provider = &self.providers[*pid];
                for id in added {
                    if let Err(e) = provider.release(id, container_id).await {
                        tracing::error!(volume_id = %id, error = %Chain(&e), "rollback release failed");
                    }
                }
            }
            return Err(results.into_iter().find_map(Result::err).unwrap());
        }
        let mut out = Vec::new();
        for (pid, vols, _, group_of) in results.into_iter().flatten() {
            let provider = &self.providers[pid];
            for (index, id) in vols {
                out.push(PublishedVolume {
                    index: *index,
                    provider_id: pid.clone(),
                    volume_id: id.clone(),
                    mount_point: provider.mount_point(id),
                    mount_group: group_of.get(id).copied().flatten(),
                });
            }
        }
        out.sort_by_key(|p| p.index);
        Ok(out)
    }

    /// Ends a container's use of the given provider resources.
    pub async fn unpublish(
        &self,
        container_id: &str,
        resources: &[Resource],
    ) -> Result<(), ProviderError> {
        let routes = self.route(resources)?;
        let mut first_err = None;
        for (pid, vols) in &routes {
            let provider = &self.providers[pid];
            for (_, id) in vols {
                if let Err(e) = provider.release(id, container_id).await {
                    first_err.get_or_insert(e);
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Ends a container's use of every volume of every provider.
    pub async fn release_container(&self, container_id: &str) -> Result<(), ProviderError> {
        let results = join_all(
            self.providers
                .values()
                .map(|p| p.release_container(container_id)),
        )
        .await;
        results
            .into_iter()
            .collect::<Result<Vec<()>, _>>()
            .map(|_| ())
    }
}
