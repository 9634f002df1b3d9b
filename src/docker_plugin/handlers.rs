//! One handler per endpoint, each a short mapping onto the provider:
//!
//! | endpoint | provider |
//! |---|---|
//! | `Create` | `create_volume` (same name and options: the same volume), or `import_volume` with `volume-id` |
//! | `Remove` | `destroy_volume_with(id, false)`: unpublish, DeleteVolume; an imported volume is only forgotten; refused while in use, naming the Mount IDs |
//! | `Mount` | `publish(id, docker-plugin/ID)`: the Mount ID becomes a durable user ([`super::users`]) |
//! | `Unmount` | `release(id, docker-plugin/ID)` (and the bare ID an earlier version recorded): unpublished after the last user |
//! | `Path`, `Get`, `List` | the provider's records |
//!
//! Volume names are the provider's CreateVolume names (checked by
//! [`validate_volume_name`](crate::provider::validate_volume_name) inside
//! `create_volume` and `import_volume`); a Mount ID must pass
//! [`validate_container_id`] before it is recorded, as a container id
//! from any other entry point does.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::Serialize;

use crate::error_chain::Chain;
use crate::provider::stats;
use crate::provider::{StorageProvider, VolumeRecord, VolumeState};
use crate::resource::validate_container_id;
use crate::shown::shown;

use super::error::DockerError;
use super::opts::{self, Plan};
use super::users;
use super::wire::{self, Request};

/// The endpoints of the protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `/Plugin.Activate`.
    Activate,
    /// `/VolumeDriver.Capabilities`.
    Capabilities,
    /// `/VolumeDriver.Create`.
    Create,
    /// `/VolumeDriver.Remove`.
    Remove,
    /// `/VolumeDriver.Mount`.
    Mount,
    /// `/VolumeDriver.Unmount`.
    Unmount,
    /// `/VolumeDriver.Path`.
    Path,
    /// `/VolumeDriver.Get`.
    Get,
    /// `/VolumeDriver.List`.
    List,
}

impl Endpoint {
    const ALL: [Endpoint; 9] = [
        Endpoint::Activate,
        Endpoint::Capabilities,
        Endpoint::Create,
        Endpoint::Remove,
        Endpoint::Mount,
        Endpoint::Unmount,
        Endpoint::Path,
        Endpoint::Get,
        Endpoint::List,
    ];

    /// The request path.
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Activate => "/Plugin.Activate",
            Endpoint::Capabilities => "/VolumeDriver.Capabilities",
            Endpoint::Create => "/VolumeDriver.Create",
            Endpoint::Remove => "/VolumeDriver.Remove",
            Endpoint::Mount => "/VolumeDriver.Mount",
            Endpoint::Unmount => "/VolumeDriver.Unmount",
            Endpoint::Path => "/VolumeDriver.Path",
            Endpoint::Get => "/VolumeDriver.Get",
            Endpoint::List => "/VolumeDriver.List",
        }
    }

    /// The endpoint of a request path, if it is one.
    pub fn from_path(path: &str) -> Option<Endpoint> {
        Endpoint::ALL.into_iter().find(|e| e.path() == path)
    }

    /// Its name in messages (`VolumeDriver.Mount`).
    pub fn name(self) -> &'static str {
        &self.path()[1..]
    }

    /// Whether its body is read (the others take none, or `{}`).
    fn takes_body(self) -> bool {
        !matches!(
            self,
            Endpoint::Activate | Endpoint::Capabilities | Endpoint::List
        )
    }
}

/// Whether volumes are seen by this host only or by the whole cluster.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Scope {
    /// This host's volumes (the default).
    #[default]
    Local,
    /// Cluster-wide volumes (Swarm): one create for every node.
    Global,
}

impl std::str::FromStr for Scope {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "local" => Ok(Scope::Local),
            "global" => Ok(Scope::Global),
            _ => Err(format!(
                "unknown scope '{}' (expected local or global)",
                shown(s)
            )),
        }
    }
}

/// The driver: the provider and how it answers.
pub struct Driver {
    provider: Arc<StorageProvider>,
    scope: Scope,
}

impl Driver {
    /// A driver on `provider`.
    pub fn new(provider: Arc<StorageProvider>, scope: Scope) -> Driver {
        Driver { provider, scope }
    }

    /// Runs one call and hands its answer to `answer`. A `Mount` that made a new use but whose
    /// answer nobody takes any more (the engine gave up, or the call timeout answered for it)
    /// is undone: the engine took it for a failure and will send no `Unmount`, so the use
    /// would hold the volume published for good.
    pub async fn call_and_answer(
        &self,
        endpoint: Endpoint,
        body: &[u8],
        answer: tokio::sync::oneshot::Sender<Result<Vec<u8>, DockerError>>,
    ) {
        let result = self.answer(endpoint, body).await;
        let new_use = matches!(result, Ok((_, true)));
        if answer.send(result.map(|(json, _)| json)).is_err() && new_use {
            match self.call(Endpoint::Unmount, body).await {
                Ok(_) => tracing::warn!(
                    body = %String::from_utf8_lossy(body),
                    "a Mount finished after its caller gave up (or the call timeout answered): undone, since the engine took it for a failure"
                ),
                Err(e) => tracing::error!(
                    error = %Chain(&e),
                    "a Mount finished after its caller gave up, and undoing it failed: release the use by hand (volume release --container docker-plugin/ID)"
                ),
            }
        }
    }

    /// Answers one call: the JSON body of a 200, or the error.
    pub async fn call(&self, endpoint: Endpoint, body: &[u8]) -> Result<Vec<u8>, DockerError> {
        self.answer(endpoint, body).await.map(|(json, _)| json)
    }

    /// [`Driver::call`], and whether it added a use (a `Mount` of an ID that was no user).
    async fn answer(
        &self,
        endpoint: Endpoint,
        body: &[u8],
    ) -> Result<(Vec<u8>, bool), DockerError> {
        let call = endpoint.name();
        let req: Request = if endpoint.takes_body() {
            serde_json::from_slice(body).map_err(|source| DockerError::BadBody { call, source })?
        } else {
            Request::default()
        };
        let answered = match endpoint {
            Endpoint::Activate => json(&wire::Activated {
                implements: vec!["VolumeDriver"],
            }),
            Endpoint::Capabilities => json(&wire::Capabilities {
                capabilities: wire::Scope {
                    scope: match self.scope {
                        Scope::Local => "local",
                        Scope::Global => "global",
                    },
                },
            }),
            Endpoint::Create => {
                self.create(&req).await?;
                json(&wire::Done::default())
            }
            Endpoint::Remove => {
                let rec = self.find(call, &req.name).await?;
                self.provider
                    .destroy_volume_with(&rec.volume_id, false)
                    .await
                    .map_err(|source| provider_error(call, &req.name, source))?;
                json(&wire::Done::default())
            }
            Endpoint::Mount => {
                let (rec, id) = self.user(call, &req).await?;
                let (mountpoint, new_use) = self
                    .provider
                    .publish_use(&rec.volume_id, &users::user_of(&id))
                    .await
                    .map_err(|source| provider_error(call, &req.name, source))?;
                return json(&wire::MountPoint {
                    mountpoint: mountpoint.display().to_string(),
                    err: String::new(),
                })
                .map(|json| (json, new_use));
            }
            Endpoint::Unmount => {
                let (rec, id) = self.user(call, &req).await?;
                // A use recorded by an earlier version is the bare Mount ID.
                if rec.users.contains(&id) {
                    self.provider
                        .release(&rec.volume_id, &id)
                        .await
                        .map_err(|source| provider_error(call, &req.name, source))?;
                }
                self.provider
                    .release(&rec.volume_id, &users::user_of(&id))
                    .await
                    .map_err(|source| provider_error(call, &req.name, source))?;
                json(&wire::Done::default())
            }
            Endpoint::Path => {
                let rec = self.find(call, &req.name).await?;
                json(&wire::MountPoint {
                    mountpoint: self.mountpoint(&rec),
                    err: String::new(),
                })
            }
            Endpoint::Get => {
                let rec = self.find(call, &req.name).await?;
                let mut volume = self.volume(&req.name, &rec, true);
                if let Some(status) = volume.status.as_mut() {
                    self.add_stats(&rec, status).await;
                }
                json(&wire::Got {
                    volume,
                    err: String::new(),
                })
            }
            Endpoint::List => {
                let volumes = self
                    .provider
                    .volumes()
                    .await
                    .into_iter()
                    .filter_map(|rec| {
                        let name = rec.name.clone()?;
                        Some(self.volume(&name, &rec, false))
                    })
                    .collect();
                json(&wire::Listed {
                    volumes,
                    err: String::new(),
                })
            }
        };
        answered.map(|json| (json, false))
    }

    async fn create(&self, req: &Request) -> Result<(), DockerError> {
        let call = Endpoint::Create.name();
        let empty = BTreeMap::new();
        let plan =
            opts::plan(&req.name, req.opts.as_ref().unwrap_or(&empty)).map_err(|source| {
                DockerError::Opts {
                    call,
                    volume: shown(&req.name).into_owned(),
                    source,
                }
            })?;
        let created = match plan {
            Plan::Create(spec) => self.provider.create_volume(spec).await,
            Plan::Import(spec, secrets) => match self.provider.find_by_name(&spec.name).await {
                // The same import again is the same volume (an engine may repeat a Create).
                Some(rec) if rec.volume_id == spec.volume_id && rec.pre_provisioned => {
                    return Ok(())
                }
                _ => {
                    self.provider
                        .import_volume_with_secrets(spec, secrets)
                        .await
                }
            },
        };
        created
            .map(drop)
            .map_err(|source| provider_error(call, &req.name, source))
    }

    /// The named volume's record.
    async fn find(&self, call: &'static str, name: &str) -> Result<VolumeRecord, DockerError> {
        if name.is_empty() {
            return Err(DockerError::Missing {
                call,
                field: "Name",
            });
        }
        self.provider
            .find_by_name(name)
            .await
            .ok_or_else(|| DockerError::NoSuchVolume {
                call,
                volume: shown(name).into_owned(),
            })
    }

    /// The named volume and the request's Mount ID, checked as a container id.
    async fn user(
        &self,
        call: &'static str,
        req: &Request,
    ) -> Result<(VolumeRecord, String), DockerError> {
        let id = req
            .id
            .clone()
            .filter(|id| !id.is_empty())
            .ok_or(DockerError::Missing { call, field: "ID" })?;
        validate_container_id(&id).map_err(|source| DockerError::BadId {
            call,
            volume: shown(&req.name).into_owned(),
            source: Box::new(source),
        })?;
        Ok((self.find(call, &req.name).await?, id))
    }

    /// The host path while the volume is published for someone, else empty.
    fn mountpoint(&self, rec: &VolumeRecord) -> String {
        if rec.state == VolumeState::Published && !rec.users.is_empty() {
            self.provider
                .mount_point(&rec.volume_id)
                .display()
                .to_string()
        } else {
            String::new()
        }
    }

    /// A published volume's usage and condition, asked of the plugin (when it offers
    /// GET_VOLUME_STATS) within the stats deadline, after the record was read (no lock held).
    async fn add_stats(&self, rec: &VolumeRecord, status: &mut wire::Status) {
        if rec.state != VolumeState::Published {
            return;
        }
        let at = self.provider.mount_point(&rec.volume_id);
        let client = self.provider.client();
        match stats::fetch(client, &rec.volume_id, &at, stats::DEFAULT_DEADLINE).await {
            None => {}
            Some(stats::Health::Known { stats, condition }) => {
                status.stats = Some(stats);
                status.condition = condition;
            }
            Some(stats::Health::Unavailable(why)) => status.stats_unavailable = Some(why),
        }
    }

    fn volume(&self, name: &str, rec: &VolumeRecord, status: bool) -> wire::Volume {
        wire::Volume {
            name: name.to_string(),
            mountpoint: self.mountpoint(rec),
            status: status.then(|| wire::Status {
                volume_id: rec.volume_id.clone(),
                plugin: self.provider.id().to_string(),
                state: rec.state.as_str().to_string(),
                capacity_bytes: rec.capacity_bytes,
                users: rec
                    .users
                    .iter()
                    .map(|u| users::shown_user(u).to_string())
                    .collect(),
                imported: rec.pre_provisioned,
                stats: None,
                condition: None,
                stats_unavailable: None,
            }),
        }
    }
}

fn provider_error(
    call: &'static str,
    name: &str,
    source: crate::provider::ProviderError,
) -> DockerError {
    DockerError::Provider {
        call,
        volume: shown(name).into_owned(),
        source: Box::new(source),
    }
}

fn json<T: Serialize>(value: &T) -> Result<Vec<u8>, DockerError> {
    Ok(serde_json::to_vec(value).expect("the protocol's answers serialize"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_route_by_exact_path() {
        for e in Endpoint::ALL {
            assert_eq!(Endpoint::from_path(e.path()), Some(e));
        }
        for other in [
            "/",
            "/VolumeDriver.mount",
            "/VolumeDriver.Mount/",
            "/Plugin.Activate?x",
        ] {
            assert_eq!(Endpoint::from_path(other), None, "{other}");
        }
        assert_eq!(Endpoint::Mount.name(), "VolumeDriver.Mount");
    }
}
