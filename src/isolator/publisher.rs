//! What the isolator needs of the providers, and no more: the narrow [`Publisher`] seam.
//!
//! The isolator publishes a container's volumes (with the group each is to be made accessible
//! to, see [`crate::isolator::ownership`]), releases them, asks whether a volume may be
//! mounted read-write, and (at recovery) lists every volume's users to release uses no live
//! container has. The provider [`Manager`] implements it for `run`, `serve` and the hook; unit tests
//! of the isolator give it a double that records what it was asked, so prepare, update, cleanup and
//! recover run without a plugin, a mount or root.

use futures::future::BoxFuture;

use crate::mount::Hardening;
use crate::provider::{Manager, MountGroups, ProviderError, Republish, Republished};
use crate::resource::Resource;

/// One volume's users, as its provider records them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeUsers {
    /// The provider id.
    pub provider_id: String,
    /// The volume id.
    pub volume_id: String,
    /// The containers using it.
    pub users: Vec<String>,
}

/// What the isolator asks of the providers (see the module doc).
pub trait Publisher: Send + Sync + std::fmt::Debug {
    /// Publishes `resources` for `container` (ensure-all), asking each volume's plugin for the
    /// group `groups` gives it; on failure nothing published by this call stays in use by the
    /// container. Answers the groups the plugins staged the volumes with (those staged with
    /// none are left out).
    fn publish<'a>(
        &'a self,
        container: &'a str,
        resources: &'a [Resource],
        groups: &'a MountGroups,
    ) -> BoxFuture<'a, Result<MountGroups, ProviderError>>;
    /// Recovery's re-ensure of many containers: what [`publish`](Self::publish) does for each
    /// (the groups answered aside), the mount checks of the volumes already published made once
    /// for the whole batch. Answers each container's result, in the batch's order, and the
    /// volumes those checks could not re-ensure (provider id, volume id, error).
    fn republish<'a>(&'a self, batch: &'a [Republish]) -> BoxFuture<'a, Republished>;
    /// Ends `container`'s use of `resources` (unpublished on last use).
    fn unpublish<'a>(
        &'a self,
        container: &'a str,
        resources: &'a [Resource],
    ) -> BoxFuture<'a, Result<(), ProviderError>>;
    /// Ends `container`'s use of every volume.
    fn release_container<'a>(
        &'a self,
        container: &'a str,
    ) -> BoxFuture<'a, Result<(), ProviderError>>;
    /// Why the volume may only be mounted read-only, or `None` (also for a volume or provider it
    /// does not know: publishing then says what is wrong).
    fn read_only_reason<'a>(
        &'a self,
        provider_id: &'a str,
        volume_id: &'a str,
    ) -> BoxFuture<'a, Option<String>>;
    /// The hardening mount flags the volume's capability asks for, which a container's copy of it
    /// carries (none for a volume or provider it does not know: publishing then says what is wrong).
    fn hardening<'a>(
        &'a self,
        provider_id: &'a str,
        volume_id: &'a str,
    ) -> BoxFuture<'a, Hardening>;
    /// Every volume of every provider, with its users.
    fn users(&self) -> BoxFuture<'_, Vec<VolumeUsers>>;
    /// Ends `container`'s use of one volume.
    fn release<'a>(
        &'a self,
        provider_id: &'a str,
        volume_id: &'a str,
        container: &'a str,
    ) -> BoxFuture<'a, Result<(), ProviderError>>;
}

impl Publisher for Manager {
    fn publish<'a>(
        &'a self,
        container: &'a str,
        resources: &'a [Resource],
        groups: &'a MountGroups,
    ) -> BoxFuture<'a, Result<MountGroups, ProviderError>> {
        Box::pin(async move {
            let published = self
                .publish_with_groups(container, resources, groups)
                .await?;
            Ok(published
                .into_iter()
                .filter_map(|p| Some(((p.provider_id, p.volume_id), p.mount_group?)))
                .collect())
        })
    }

    fn republish<'a>(&'a self, batch: &'a [Republish]) -> BoxFuture<'a, Republished> {
        Box::pin(self.republish_all(batch))
    }

    fn unpublish<'a>(
        &'a self,
        container: &'a str,
        resources: &'a [Resource],
    ) -> BoxFuture<'a, Result<(), ProviderError>> {
        Box::pin(Manager::unpublish(self, container, resources))
    }

    fn release_container<'a>(
        &'a self,
        container: &'a str,
    ) -> BoxFuture<'a, Result<(), ProviderError>> {
        Box::pin(Manager::release_container(self, container))
    }

    fn read_only_reason<'a>(
        &'a self,
        provider_id: &'a str,
        volume_id: &'a str,
    ) -> BoxFuture<'a, Option<String>> {
        Box::pin(async move {
            let rec = self.get(provider_id)?.volume(volume_id).await?;
            if rec.capability.is_reader_only() {
                Some(format!(
                    "of reader-only access mode {}",
                    rec.capability.access_mode
                ))
            } else if rec.readonly {
                Some("published read-only".to_string())
            } else {
                None
            }
        })
    }

    fn hardening<'a>(
        &'a self,
        provider_id: &'a str,
        volume_id: &'a str,
    ) -> BoxFuture<'a, Hardening> {
        Box::pin(async move {
            match self.get(provider_id) {
                Some(provider) => provider
                    .volume(volume_id)
                    .await
                    .map(|rec| Hardening::of_mount_flags(&rec.capability.mount_flags))
                    .unwrap_or_default(),
                None => Hardening::default(),
            }
        })
    }

    fn users(&self) -> BoxFuture<'_, Vec<VolumeUsers>> {
        Box::pin(async move {
            let mut out = Vec::new();
            for provider in self.providers() {
                for vol in provider.volumes().await {
                    out.push(VolumeUsers {
                        provider_id: provider.id().to_string(),
                        volume_id: vol.volume_id,
                        users: vol.users.into_iter().collect(),
                    });
                }
            }
            out
        })
    }

    fn release<'a>(
        &'a self,
        provider_id: &'a str,
        volume_id: &'a str,
        container: &'a str,
    ) -> BoxFuture<'a, Result<(), ProviderError>> {
        Box::pin(async move {
            match self.get(provider_id) {
                Some(provider) => provider.release(volume_id, container).await,
                // Listed by `users`, so known: a provider gone since has nothing to release.
                None => Ok(()),
            }
        })
    }
}
