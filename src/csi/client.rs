//! [`Client`]: a CSI v1 client for a plugin on a Unix domain socket.
//!
//! Contract:
//! - `connect` waits for the socket to appear and accept a connection, then
//!   probes the plugin until it reports ready and discovers its capabilities
//!   once, all of it within `connect_timeout`.
//! - Every call takes the generated request and returns the generated
//!   response or a [`CsiError`] naming the RPC, the volume, the gRPC code and
//!   the plugin's message. Each attempt carries the deadline as
//!   `grpc-timeout` and is also cut off locally; `UNAVAILABLE` and
//!   `DEADLINE_EXCEEDED` are retried per the [`RetryPolicy`], every other
//!   code is returned at once. An attempt's deadline is cut to what is left
//!   of the policy's `max_total`, so no call outlives that budget.
//! - The channel reconnects lazily: when the plugin restarts on the same
//!   socket, the next attempt dials it again, so retries carry calls across
//!   a restart.
//! - A plugin is never trusted to be the one it was: before every attempt
//!   the socket file is compared (device, inode, change time) with the one
//!   last checked. A new file means a new process (restarted, upgraded or
//!   swapped): the channel is dialed afresh, the plugin must answer
//!   GetPluginInfo with the name it gave before (else the call is refused
//!   with [`CsiError::PluginReplaced`], naming both names: volume calls are
//!   never sent to a different driver), and its capabilities are discovered
//!   again ([`Client::current_capabilities`]), since a new version may offer
//!   others. The name to hold the plugin to is the one in the first
//!   GetPluginInfo answer this client receives.
//! - Answers that break the spec are refused with
//!   [`CsiError::InvalidResponse`], never passed on: a reply that does not
//!   decode (not protobuf, a string that is not UTF-8), a CreateVolume
//!   answer without a volume id or with a capacity outside the range asked
//!   for, an empty GetPluginInfo name or NodeGetInfo node id. They are not
//!   retried: the plugin answered, wrongly.
//! - Cloning is cheap (one `Arc`); clones share the channel and the
//!   [`Metrics`]. Calls on clones run in parallel.
//! - A client may drive only some of a plugin's services ([`Client::connect_for`],
//!   [`Services`]): a driver's controller plugin and node plugin deployed apart get one client
//!   each, each pinned and re-checked on its own socket as above, sharing one [`Metrics`].
//! - Requests are never logged: they may carry secrets. A plugin's message about a
//!   call that carried secrets has their values replaced (`<redacted>`) before it is
//!   logged or returned.

use crate::error_chain::Chain;
use std::future::Future;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};
use tracing::Instrument;

use super::caps::{
    Capabilities, ControllerCapabilities, NodeCapabilities, PluginCapabilities, Services,
};
use super::error::{code_name, fmt_duration, CsiError, Replacement, VolumeRef};
use super::metrics::{Metrics, Rpc};
use super::options::ClientOptions;
use super::proto::{
    self, controller_client::ControllerClient, identity_client::IdentityClient,
    node_client::NodeClient,
};
use super::retry::RetryPolicy;
use super::secrets::Secrets;
use super::transport::socket_path;

/// Backoff between dials while waiting for the socket: short, because a
/// plugin that is starting up usually takes milliseconds.
const DIAL_BACKOFF: RetryPolicy = RetryPolicy {
    max_attempts: u32::MAX,
    initial_backoff: Duration::from_millis(10),
    max_backoff: Duration::from_millis(500),
    max_total: Duration::MAX,
    multiplier: 2.0,
};

/// A connected CSI plugin. Cheap to clone; see the module docs.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

struct Inner {
    endpoint: String,
    path: PathBuf,
    options: ClientOptions,
    /// Which of the plugin's services this client drives (which capabilities it discovers).
    services: Services,
    /// Replaced by a fresh one when the plugin is (see [`Client::recheck`]).
    channel: Mutex<Channel>,
    metrics: Arc<Metrics>,
    /// The capabilities of the plugin now behind the socket.
    caps: RwLock<Arc<Capabilities>>,
    /// The socket file last checked, and the name the plugin must keep.
    identity: Mutex<Identity>,
    /// One re-check at a time: concurrent calls that notice a replacement
    /// wait for the first to check it.
    recheck: tokio::sync::Mutex<()>,
}

/// Who the client believes it talks to.
#[derive(Debug, Default)]
struct Identity {
    socket: Option<SocketId>,
    name: Option<String>,
}

/// Identifies one socket file: a plugin that binds its socket anew (a
/// restart, an upgrade, another plugin) makes a new file. Inode numbers can
/// be reused at once after an unlink, so the change time (set when the file
/// is created, nanosecond resolution) is compared too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SocketId {
    dev: u64,
    ino: u64,
    ctime: i64,
    ctime_nsec: i64,
}

fn socket_id(path: &Path) -> Option<SocketId> {
    let meta = std::fs::metadata(path).ok()?;
    Some(SocketId {
        dev: meta.dev(),
        ino: meta.ino(),
        ctime: meta.ctime(),
        ctime_nsec: meta.ctime_nsec(),
    })
}

/// Why a re-check of a replaced plugin did not pass.
enum Recheck {
    /// The new plugin has another name.
    Replaced(Box<Replacement>),
    /// A call of the re-check failed (the RPC and its status).
    Failed(&'static str, Status),
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("endpoint", &self.inner.endpoint)
            .field("capabilities", &self.current_capabilities())
            .finish_non_exhaustive()
    }
}

impl Client {
    /// Connects to the plugin at `endpoint` (`unix:///path`): waits for the
    /// socket to accept connections, probes the plugin until it is ready and
    /// discovers its capabilities, all within `options.connect_timeout`
    /// (the probe and discovery calls follow the per-call deadline and retry
    /// policy, and are cut off when the connect timeout runs out).
    pub async fn connect(endpoint: &str, options: ClientOptions) -> Result<Self, CsiError> {
        Self::connect_for(endpoint, options, Services::Both, Metrics::new()).await
    }

    /// [`connect`](Self::connect) for a plugin that serves only some of a driver's services
    /// (a controller plugin, or a node plugin, deployed apart): only their capabilities are
    /// discovered, at connect and at every re-check. Its calls are counted in `metrics`, which
    /// the two clients of one split driver share (one set of counters per driver; the
    /// Identity calls of both add up).
    #[tracing::instrument(skip_all, fields(endpoint = %endpoint, services = ?services))]
    pub async fn connect_for(
        endpoint: &str,
        options: ClientOptions,
        services: Services,
        metrics: Arc<Metrics>,
    ) -> Result<Self, CsiError> {
        let path = socket_path(endpoint).map_err(|source| CsiError::BadEndpoint {
            endpoint: endpoint.to_string(),
            source,
        })?;
        let started = Instant::now();
        wait_for_socket(endpoint, &path, options.connect_timeout).await?;
        // Refused at once, not retried until the connect timeout: a socket served by another
        // user stays that user's (every later dial checks it again).
        if let Ok(stream) = UnixStream::connect(&path).await {
            let server = stream.peer_cred().map(|c| c.uid());
            if let Ok(uid) = server {
                check_server(&path, uid, nix::unistd::geteuid().as_raw()).map_err(|source| {
                    CsiError::UntrustedServer {
                        endpoint: endpoint.to_string(),
                        source,
                    }
                })?;
            }
        }
        let socket = socket_id(&path);
        let channel = lazy_channel(&path, socket);
        let identity = Identity { socket, name: None };
        let client = Self {
            inner: Arc::new(Inner {
                endpoint: endpoint.to_string(),
                path,
                options,
                services,
                channel: Mutex::new(channel),
                metrics,
                caps: RwLock::default(),
                identity: Mutex::new(identity),
                recheck: tokio::sync::Mutex::new(()),
            }),
        };
        let timeout = client.inner.options.connect_timeout;
        let left = timeout.saturating_sub(started.elapsed());
        let handshake = async {
            client.wait_until_ready(started).await?;
            client
                .refresh_capabilities()
                .await
                .map(|_| ())
                .map_err(|e| client.connect_error(e))
        };
        match tokio::time::timeout(left, handshake).await {
            Ok(result) => result?,
            Err(_elapsed) => {
                return Err(CsiError::ConnectTimeout {
                    endpoint: endpoint.to_string(),
                    what: "plugin did not answer Probe and capability discovery",
                    timeout,
                    last_error: None,
                })
            }
        }
        tracing::debug!(capabilities = ?client.current_capabilities(), "connected to csi plugin");
        Ok(client)
    }

    /// The endpoint this client talks to.
    pub fn endpoint(&self) -> &str {
        &self.inner.endpoint
    }

    /// The options this client was connected with.
    pub fn options(&self) -> &ClientOptions {
        &self.inner.options
    }

    /// Which of the plugin's services this client drives.
    pub fn services(&self) -> Services {
        self.inner.services
    }

    /// The call metrics, shared by all clones of this client.
    pub fn metrics(&self) -> Arc<Metrics> {
        Arc::clone(&self.inner.metrics)
    }

    /// The capabilities of the plugin serving the endpoint now: discovered
    /// at connect, and again whenever a call finds the plugin replaced (or
    /// [`refresh_capabilities`](Self::refresh_capabilities) runs). Shared by
    /// all clones. Decide which RPCs to send with these.
    pub fn current_capabilities(&self) -> Arc<Capabilities> {
        self.inner
            .caps
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Checks now, rather than at the next call, whether the plugin was
    /// replaced, and if so that it is the same driver, and rediscovers its
    /// capabilities (one attempt of each RPC). Callers run it before
    /// choosing RPCs by [`current_capabilities`](Self::current_capabilities).
    /// Fails with [`CsiError::PluginReplaced`] for a different driver, and
    /// with the failed call when the plugin could not be asked (the next
    /// call checks again, with retries).
    pub async fn ensure_current(&self) -> Result<(), CsiError> {
        match self.recheck(self.inner.options.deadline).await {
            Ok(()) => Ok(()),
            Err(Recheck::Replaced(replacement)) => Err(CsiError::PluginReplaced {
                rpc: None,
                volume: None,
                replacement,
            }),
            Err(Recheck::Failed(rpc, status)) => Err(CsiError::Rpc {
                rpc,
                volume: None,
                code: status.code(),
                message: status.message().to_string(),
                attempts: 1,
            }),
        }
    }

    /// Asks the plugin for its capabilities again ([`discover`], each RPC
    /// with the client's deadline and retries) and makes them the
    /// [`current_capabilities`](Self::current_capabilities) of all clones.
    pub async fn refresh_capabilities(&self) -> Result<Arc<Capabilities>, CsiError> {
        let caps = Arc::new(discover(&Retried(self), self.inner.services).await?);
        *self.inner.caps.write().unwrap_or_else(|p| p.into_inner()) = Arc::clone(&caps);
        Ok(caps)
    }

    // ---- Identity ----

    /// `GetPluginInfo`. The first answer's name is the one a replaced
    /// plugin must have (see the module docs); an empty name is refused.
    pub async fn get_plugin_info(
        &self,
        request: proto::GetPluginInfoRequest,
    ) -> Result<proto::GetPluginInfoResponse, CsiError> {
        let info = self
            .call(Rpc::GetPluginInfo, None, request, |ch, r| async move {
                IdentityClient::new(ch).get_plugin_info(r).await
            })
            .await?;
        if info.name.is_empty() {
            return Err(CsiError::InvalidResponse {
                rpc: Rpc::GetPluginInfo.name(),
                volume: None,
                problem: "an empty name (the field is REQUIRED)".to_string(),
            });
        }
        self.identity()
            .name
            .get_or_insert_with(|| info.name.clone());
        self.inner.metrics.set_driver_name(&info.name);
        Ok(info)
    }

    /// `GetPluginCapabilities`.
    pub async fn get_plugin_capabilities(
        &self,
        request: proto::GetPluginCapabilitiesRequest,
    ) -> Result<proto::GetPluginCapabilitiesResponse, CsiError> {
        self.call(
            Rpc::GetPluginCapabilities,
            None,
            request,
            |ch, r| async move { IdentityClient::new(ch).get_plugin_capabilities(r).await },
        )
        .await
    }

    /// `Probe`.
    pub async fn probe(
        &self,
        request: proto::ProbeRequest,
    ) -> Result<proto::ProbeResponse, CsiError> {
        self.call(Rpc::Probe, None, request, |ch, r| async move {
            IdentityClient::new(ch).probe(r).await
        })
        .await
    }

    // ---- Controller ----

    /// `ControllerGetCapabilities`.
    pub async fn controller_get_capabilities(
        &self,
        request: proto::ControllerGetCapabilitiesRequest,
    ) -> Result<proto::ControllerGetCapabilitiesResponse, CsiError> {
        self.call(
            Rpc::ControllerGetCapabilities,
            None,
            request,
            |ch, r| async move {
                ControllerClient::new(ch)
                    .controller_get_capabilities(r)
                    .await
            },
        )
        .await
    }

    /// `CreateVolume`; errors name the volume by its requested name. An
    /// answer without a volume id, or with a capacity outside the range
    /// asked for, is refused (the volume may exist all the same: CreateVolume
    /// of the same name finds it again).
    pub async fn create_volume(
        &self,
        request: proto::CreateVolumeRequest,
    ) -> Result<proto::CreateVolumeResponse, CsiError> {
        let secrets = Secrets::of_request(&request.secrets);
        let volume = (!request.name.is_empty()).then(|| VolumeRef::Name(request.name.clone()));
        let range = request.capacity_range.unwrap_or_default();
        let response = self
            .call_with(
                Rpc::CreateVolume,
                volume.clone(),
                request,
                &secrets,
                |ch, r| async move { ControllerClient::new(ch).create_volume(r).await },
            )
            .await?;
        check_created(&response, &range).map_err(|problem| CsiError::InvalidResponse {
            rpc: Rpc::CreateVolume.name(),
            volume,
            problem,
        })?;
        Ok(response)
    }

    /// `DeleteVolume`.
    pub async fn delete_volume(
        &self,
        request: proto::DeleteVolumeRequest,
    ) -> Result<proto::DeleteVolumeResponse, CsiError> {
        let secrets = Secrets::of_request(&request.secrets);
        let volume = volume_id(&request.volume_id);
        self.call_with(
            Rpc::DeleteVolume,
            volume,
            request,
            &secrets,
            |ch, r| async move { ControllerClient::new(ch).delete_volume(r).await },
        )
        .await
    }

    /// `ControllerPublishVolume`.
    pub async fn controller_publish_volume(
        &self,
        request: proto::ControllerPublishVolumeRequest,
    ) -> Result<proto::ControllerPublishVolumeResponse, CsiError> {
        let secrets = Secrets::of_request(&request.secrets);
        let volume = volume_id(&request.volume_id);
        self.call_with(
            Rpc::ControllerPublishVolume,
            volume,
            request,
            &secrets,
            |ch, r| async move { ControllerClient::new(ch).controller_publish_volume(r).await },
        )
        .await
    }

    /// `ControllerUnpublishVolume`.
    pub async fn controller_unpublish_volume(
        &self,
        request: proto::ControllerUnpublishVolumeRequest,
    ) -> Result<proto::ControllerUnpublishVolumeResponse, CsiError> {
        let secrets = Secrets::of_request(&request.secrets);
        let volume = volume_id(&request.volume_id);
        self.call_with(
            Rpc::ControllerUnpublishVolume,
            volume,
            request,
            &secrets,
            |ch, r| async move {
                ControllerClient::new(ch)
                    .controller_unpublish_volume(r)
                    .await
            },
        )
        .await
    }

    /// `ValidateVolumeCapabilities`.
    pub async fn validate_volume_capabilities(
        &self,
        request: proto::ValidateVolumeCapabilitiesRequest,
    ) -> Result<proto::ValidateVolumeCapabilitiesResponse, CsiError> {
        let secrets = Secrets::of_request(&request.secrets);
        let volume = volume_id(&request.volume_id);
        self.call_with(
            Rpc::ValidateVolumeCapabilities,
            volume,
            request,
            &secrets,
            |ch, r| async move {
                ControllerClient::new(ch)
                    .validate_volume_capabilities(r)
                    .await
            },
        )
        .await
    }

    /// `ListVolumes` (one page; follow `next_token` for more).
    pub async fn list_volumes(
        &self,
        request: proto::ListVolumesRequest,
    ) -> Result<proto::ListVolumesResponse, CsiError> {
        self.call(Rpc::ListVolumes, None, request, |ch, r| async move {
            ControllerClient::new(ch).list_volumes(r).await
        })
        .await
    }

    /// `GetCapacity`.
    pub async fn get_capacity(
        &self,
        request: proto::GetCapacityRequest,
    ) -> Result<proto::GetCapacityResponse, CsiError> {
        self.call(Rpc::GetCapacity, None, request, |ch, r| async move {
            ControllerClient::new(ch).get_capacity(r).await
        })
        .await
    }

    // ---- Node ----

    /// `NodeGetCapabilities`.
    pub async fn node_get_capabilities(
        &self,
        request: proto::NodeGetCapabilitiesRequest,
    ) -> Result<proto::NodeGetCapabilitiesResponse, CsiError> {
        self.call(
            Rpc::NodeGetCapabilities,
            None,
            request,
            |ch, r| async move { NodeClient::new(ch).node_get_capabilities(r).await },
        )
        .await
    }

    /// `NodeGetInfo`; an empty node id is refused.
    pub async fn node_get_info(
        &self,
        request: proto::NodeGetInfoRequest,
    ) -> Result<proto::NodeGetInfoResponse, CsiError> {
        let info = self
            .call(Rpc::NodeGetInfo, None, request, |ch, r| async move {
                NodeClient::new(ch).node_get_info(r).await
            })
            .await?;
        if info.node_id.is_empty() {
            return Err(CsiError::InvalidResponse {
                rpc: Rpc::NodeGetInfo.name(),
                volume: None,
                problem: "an empty node_id (the field is REQUIRED)".to_string(),
            });
        }
        Ok(info)
    }

    /// `NodeStageVolume`.
    pub async fn node_stage_volume(
        &self,
        request: proto::NodeStageVolumeRequest,
    ) -> Result<proto::NodeStageVolumeResponse, CsiError> {
        let secrets = Secrets::of_request(&request.secrets);
        let volume = volume_id(&request.volume_id);
        self.call_with(
            Rpc::NodeStageVolume,
            volume,
            request,
            &secrets,
            |ch, r| async move { NodeClient::new(ch).node_stage_volume(r).await },
        )
        .await
    }

    /// `NodeUnstageVolume`.
    pub async fn node_unstage_volume(
        &self,
        request: proto::NodeUnstageVolumeRequest,
    ) -> Result<proto::NodeUnstageVolumeResponse, CsiError> {
        let volume = volume_id(&request.volume_id);
        self.call(
            Rpc::NodeUnstageVolume,
            volume,
            request,
            |ch, r| async move { NodeClient::new(ch).node_unstage_volume(r).await },
        )
        .await
    }

    /// `NodePublishVolume`.
    pub async fn node_publish_volume(
        &self,
        request: proto::NodePublishVolumeRequest,
    ) -> Result<proto::NodePublishVolumeResponse, CsiError> {
        let secrets = Secrets::of_request(&request.secrets);
        let volume = volume_id(&request.volume_id);
        self.call_with(
            Rpc::NodePublishVolume,
            volume,
            request,
            &secrets,
            |ch, r| async move { NodeClient::new(ch).node_publish_volume(r).await },
        )
        .await
    }

    /// `NodeUnpublishVolume`.
    pub async fn node_unpublish_volume(
        &self,
        request: proto::NodeUnpublishVolumeRequest,
    ) -> Result<proto::NodeUnpublishVolumeResponse, CsiError> {
        let volume = volume_id(&request.volume_id);
        self.call(
            Rpc::NodeUnpublishVolume,
            volume,
            request,
            |ch, r| async move { NodeClient::new(ch).node_unpublish_volume(r).await },
        )
        .await
    }

    /// `NodeGetVolumeStats`.
    pub async fn node_get_volume_stats(
        &self,
        request: proto::NodeGetVolumeStatsRequest,
    ) -> Result<proto::NodeGetVolumeStatsResponse, CsiError> {
        let volume = volume_id(&request.volume_id);
        self.call(
            Rpc::NodeGetVolumeStats,
            volume,
            request,
            |ch, r| async move { NodeClient::new(ch).node_get_volume_stats(r).await },
        )
        .await
    }

    /// `ControllerExpandVolume`.
    pub async fn controller_expand_volume(
        &self,
        request: proto::ControllerExpandVolumeRequest,
    ) -> Result<proto::ControllerExpandVolumeResponse, CsiError> {
        let secrets = Secrets::of_request(&request.secrets);
        let volume = volume_id(&request.volume_id);
        self.call_with(
            Rpc::ControllerExpandVolume,
            volume,
            request,
            &secrets,
            |ch, r| async move { ControllerClient::new(ch).controller_expand_volume(r).await },
        )
        .await
    }

    /// `NodeExpandVolume`.
    pub async fn node_expand_volume(
        &self,
        request: proto::NodeExpandVolumeRequest,
    ) -> Result<proto::NodeExpandVolumeResponse, CsiError> {
        let secrets = Secrets::of_request(&request.secrets);
        let volume = volume_id(&request.volume_id);
        self.call_with(
            Rpc::NodeExpandVolume,
            volume,
            request,
            &secrets,
            |ch, r| async move { NodeClient::new(ch).node_expand_volume(r).await },
        )
        .await
    }

    // ---- snapshots ----

    /// `CreateSnapshot` (idempotent by name). Its volume label is the source volume.
    pub async fn create_snapshot(
        &self,
        request: proto::CreateSnapshotRequest,
    ) -> Result<proto::CreateSnapshotResponse, CsiError> {
        let secrets = Secrets::of_request(&request.secrets);
        let volume = volume_id(&request.source_volume_id);
        self.call_with(
            Rpc::CreateSnapshot,
            volume,
            request,
            &secrets,
            |ch, r| async move { ControllerClient::new(ch).create_snapshot(r).await },
        )
        .await
    }

    /// `DeleteSnapshot` (idempotent: an unknown snapshot id is deleted).
    pub async fn delete_snapshot(
        &self,
        request: proto::DeleteSnapshotRequest,
    ) -> Result<proto::DeleteSnapshotResponse, CsiError> {
        let secrets = Secrets::of_request(&request.secrets);
        self.call_with(
            Rpc::DeleteSnapshot,
            None,
            request,
            &secrets,
            |ch, r| async move { ControllerClient::new(ch).delete_snapshot(r).await },
        )
        .await
    }

    /// `ListSnapshots` (one page).
    pub async fn list_snapshots(
        &self,
        request: proto::ListSnapshotsRequest,
    ) -> Result<proto::ListSnapshotsResponse, CsiError> {
        let secrets = Secrets::of_request(&request.secrets);
        self.call_with(
            Rpc::ListSnapshots,
            None,
            request,
            &secrets,
            |ch, r| async move { ControllerClient::new(ch).list_snapshots(r).await },
        )
        .await
    }

    /// `ControllerModifyVolume` (MODIFY_VOLUME). No secrets file operation names it: the
    /// request carries what its caller put in it.
    pub async fn controller_modify_volume(
        &self,
        request: proto::ControllerModifyVolumeRequest,
    ) -> Result<proto::ControllerModifyVolumeResponse, CsiError> {
        let volume = volume_id(&request.volume_id);
        self.call(
            Rpc::ControllerModifyVolume,
            volume,
            request,
            |ch, r| async move { ControllerClient::new(ch).controller_modify_volume(r).await },
        )
        .await
    }

    // ---- machinery ----

    /// Sends one call with deadline, retries and metrics. `send` makes one
    /// attempt on a (cheaply cloned) channel.
    async fn call<Req, Resp, F, Fut>(
        &self,
        rpc: Rpc,
        volume: Option<VolumeRef>,
        request: Req,
        send: F,
    ) -> Result<Resp, CsiError>
    where
        Req: Clone,
        F: Fn(Channel, tonic::Request<Req>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<Resp>, Status>>,
    {
        self.call_with(rpc, volume, request, &Secrets::default(), send)
            .await
    }

    /// [`call`](Self::call) of a request carrying `secrets` (its `secrets` field): every value
    /// of them is taken out of the plugin's messages before they are logged or returned, since
    /// a plugin may echo what it got.
    async fn call_with<Req, Resp, F, Fut>(
        &self,
        rpc: Rpc,
        volume: Option<VolumeRef>,
        request: Req,
        secrets: &Secrets,
        send: F,
    ) -> Result<Resp, CsiError>
    where
        Req: Clone,
        F: Fn(Channel, tonic::Request<Req>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<Resp>, Status>>,
    {
        let redacted = |status: Status| {
            if secrets.is_empty() {
                status
            } else {
                Status::new(status.code(), secrets.redact(status.message()))
            }
        };
        let span = match &volume {
            Some(VolumeRef::Id(id)) => {
                tracing::debug_span!("csi_call", rpc = rpc.name(), volume_id = %id)
            }
            Some(VolumeRef::Name(name)) => {
                tracing::debug_span!("csi_call", rpc = rpc.name(), volume_name = %name)
            }
            None => tracing::debug_span!("csi_call", rpc = rpc.name()),
        };
        let options = &self.inner.options;
        let guard = self.inner.metrics.start(rpc);
        async move {
            let started = Instant::now();
            let mut attempts = 0u32;
            loop {
                // Cut to what is left of the call's total budget; the retry policy
                // only sleeps when some of it is left, so this is rarely `None`.
                let Some(deadline) = options
                    .retry
                    .attempt_deadline(options.deadline, started.elapsed())
                else {
                    guard.finish(Some(Code::DeadlineExceeded));
                    return Err(CsiError::Rpc {
                        rpc: rpc.name(),
                        volume,
                        code: Code::DeadlineExceeded,
                        message: format!(
                            "call budget of {} used up",
                            fmt_duration(options.retry.max_total)
                        ),
                        attempts,
                    });
                };
                attempts += 1;
                let status = match self.recheck(deadline).await {
                    Ok(()) => {
                        let mut req = tonic::Request::new(request.clone());
                        req.set_timeout(deadline);
                        let attempt_started = Instant::now();
                        let result =
                            tokio::time::timeout(deadline, send(self.channel(), req)).await;
                        match result.map(|r| r.map_err(redacted)) {
                            Ok(Ok(response)) => {
                                tracing::debug!(attempts, elapsed = ?started.elapsed(), "csi call succeeded");
                                guard.finish(Some(Code::Ok));
                                return Ok(response.into_inner());
                            }
                            Ok(Err(status)) if is_decode_failure(&status) => {
                                tracing::warn!(message = status.message(), "csi reply does not decode");
                                guard.finish(Some(status.code()));
                                return Err(CsiError::InvalidResponse {
                                    rpc: rpc.name(),
                                    volume,
                                    problem: format!(
                                        "the plugin's reply does not decode ({})",
                                        status.message()
                                    ),
                                });
                            }
                            Ok(Err(status)) => {
                                normalize(status, attempt_started.elapsed(), deadline)
                            }
                            Err(_elapsed) => Status::deadline_exceeded(format!(
                                "no reply within {} (deadline enforced by the client)",
                                fmt_duration(deadline)
                            )),
                        }
                    }
                    Err(Recheck::Replaced(replacement)) => {
                        guard.finish(None);
                        return Err(CsiError::PluginReplaced {
                            rpc: Some(rpc.name()),
                            volume,
                            replacement,
                        });
                    }
                    Err(Recheck::Failed(check, status)) => Status::new(
                        status.code(),
                        format!(
                            "the plugin was replaced and re-checking it failed: {check}: {}",
                            status.message()
                        ),
                    ),
                };
                let next = options
                    .retry
                    .next_backoff(status.code(), attempts, started.elapsed(), &mut rand::rng());
                match next {
                    Some(sleep) => {
                        tracing::info!(
                            attempt = attempts,
                            code = code_name(status.code()),
                            message = status.message(),
                            backoff = ?sleep,
                            "csi call failed, retrying"
                        );
                        guard.retry();
                        tokio::time::sleep(sleep).await;
                    }
                    None => {
                        tracing::debug!(
                            attempts,
                            code = code_name(status.code()),
                            message = status.message(),
                            "csi call failed"
                        );
                        guard.finish(Some(status.code()));
                        return Err(CsiError::Rpc {
                            rpc: rpc.name(),
                            volume,
                            code: status.code(),
                            message: status.message().to_string(),
                            attempts,
                        });
                    }
                }
            }
        }
        .instrument(span)
        .await
    }

    /// Probes until the plugin reports ready (an absent `ready` means
    /// ready, per the spec), until the connect timeout runs out.
    async fn wait_until_ready(&self, started: Instant) -> Result<(), CsiError> {
        let timeout = self.inner.options.connect_timeout;
        let mut not_ready = 0;
        loop {
            let resp = self
                .probe(proto::ProbeRequest {})
                .await
                .map_err(|e| self.connect_error(e))?;
            if resp.ready.is_none_or(|r| r) {
                return Ok(());
            }
            not_ready += 1;
            let sleep = DIAL_BACKOFF.backoff(not_ready, &mut rand::rng());
            if started.elapsed() + sleep >= timeout {
                return Err(CsiError::NotReady {
                    endpoint: self.inner.endpoint.clone(),
                    timeout,
                });
            }
            tracing::debug!(backoff = ?sleep, "plugin not ready yet");
            tokio::time::sleep(sleep).await;
        }
    }

    fn channel(&self) -> Channel {
        self.inner
            .channel
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn identity(&self) -> std::sync::MutexGuard<'_, Identity> {
        self.inner
            .identity
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Before an attempt: if the socket is a new file since the last check,
    /// the plugin behind it is a new process. Dials it afresh, holds it to
    /// the known name, and rediscovers its capabilities; only then is the
    /// new file taken as checked. A missing socket is left to the attempt
    /// (it fails UNAVAILABLE and is retried).
    async fn recheck(&self, deadline: Duration) -> Result<(), Recheck> {
        let Some(now) = socket_id(&self.inner.path) else {
            return Ok(());
        };
        if self.identity().socket == Some(now) {
            return Ok(());
        }
        let _one = self.inner.recheck.lock().await;
        // Another call may have checked it meanwhile, or it changed again.
        let Some(now) = socket_id(&self.inner.path) else {
            return Ok(());
        };
        let expected = {
            let identity = self.identity();
            if identity.socket == Some(now) {
                return Ok(());
            }
            identity.name.clone()
        };
        tracing::info!(endpoint = %self.inner.endpoint, "the plugin's socket is a new file: re-checking the plugin");
        // Connections made before may still reach the old process; this
        // channel reaches only the new file, and becomes the client's channel
        // once the plugin behind it passed the check.
        let channel = lazy_channel(&self.inner.path, Some(now));
        if let Some(expected) = expected {
            let info = self
                .once(
                    Rpc::GetPluginInfo,
                    &channel,
                    deadline,
                    proto::GetPluginInfoRequest {},
                    |ch, r| async move { IdentityClient::new(ch).get_plugin_info(r).await },
                )
                .await?;
            if info.name != expected {
                tracing::error!(expected, found = %info.name, vendor_version = %info.vendor_version,
                    "the plugin behind the socket is another driver");
                return Err(Recheck::Replaced(Box::new(Replacement {
                    endpoint: self.inner.endpoint.clone(),
                    expected,
                    found: info.name,
                    vendor_version: info.vendor_version,
                })));
            }
            tracing::info!(name = %info.name, vendor_version = %info.vendor_version, "the replaced plugin is the same driver");
        }
        let caps = discover(
            &Once {
                client: self,
                channel: &channel,
                deadline,
            },
            self.inner.services,
        )
        .await?;
        tracing::info!(capabilities = ?caps, "capabilities of the replaced plugin");
        *self.inner.caps.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(caps);
        *self.inner.channel.lock().unwrap_or_else(|p| p.into_inner()) = channel;
        self.identity().socket = Some(now);
        Ok(())
    }

    /// One attempt of a re-check call, counted in the metrics.
    async fn once<Req, Resp, F, Fut>(
        &self,
        rpc: Rpc,
        channel: &Channel,
        deadline: Duration,
        request: Req,
        send: F,
    ) -> Result<Resp, Recheck>
    where
        F: FnOnce(Channel, tonic::Request<Req>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<Resp>, Status>>,
    {
        let guard = self.inner.metrics.start(rpc);
        let mut req = tonic::Request::new(request);
        req.set_timeout(deadline);
        let started = Instant::now();
        let result = match tokio::time::timeout(deadline, send(channel.clone(), req)).await {
            Ok(Ok(response)) => Ok(response.into_inner()),
            Ok(Err(status)) => Err(normalize(status, started.elapsed(), deadline)),
            Err(_elapsed) => Err(Status::deadline_exceeded(format!(
                "no reply within {}",
                fmt_duration(deadline)
            ))),
        };
        guard.finish(Some(
            result.as_ref().map_or_else(Status::code, |_| Code::Ok),
        ));
        result.map_err(|status| Recheck::Failed(rpc.name(), status))
    }

    fn connect_error(&self, source: CsiError) -> CsiError {
        CsiError::Connect {
            endpoint: self.inner.endpoint.clone(),
            source: Box::new(source),
        }
    }
}

/// How [`discover`] sends its calls: the two ways differ only in retries
/// and in how a failure is reported.
trait Ask {
    type Error;

    /// Sends `request` as `rpc` (capability calls carry no volume).
    async fn ask<Req, Resp, F, Fut>(
        &self,
        rpc: Rpc,
        request: Req,
        send: F,
    ) -> Result<Resp, Self::Error>
    where
        Req: Clone,
        F: Fn(Channel, tonic::Request<Req>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<Resp>, Status>>;
}

/// Ordinary calls on the client's channel, with its deadline and retries
/// (connect and [`Client::refresh_capabilities`]).
struct Retried<'a>(&'a Client);

impl Ask for Retried<'_> {
    type Error = CsiError;

    async fn ask<Req, Resp, F, Fut>(
        &self,
        rpc: Rpc,
        request: Req,
        send: F,
    ) -> Result<Resp, CsiError>
    where
        Req: Clone,
        F: Fn(Channel, tonic::Request<Req>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<Resp>, Status>>,
    {
        self.0.call(rpc, None, request, send).await
    }
}

/// One attempt each on the channel pinned to a socket file being re-checked
/// ([`Client::recheck`]), which must not become the client's channel before
/// the check passed.
struct Once<'a> {
    client: &'a Client,
    channel: &'a Channel,
    deadline: Duration,
}

impl Ask for Once<'_> {
    type Error = Recheck;

    async fn ask<Req, Resp, F, Fut>(&self, rpc: Rpc, request: Req, send: F) -> Result<Resp, Recheck>
    where
        Req: Clone,
        F: Fn(Channel, tonic::Request<Req>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<Resp>, Status>>,
    {
        self.client
            .once(rpc, self.channel, self.deadline, request, send)
            .await
    }
}

/// Capability discovery, the one place it is written: GetPluginCapabilities,
/// ControllerGetCapabilities only when the plugin has the controller
/// service and the client drives it, NodeGetCapabilities only when the client
/// drives the node service ([`Services`]).
async fn discover<A: Ask>(via: &A, services: Services) -> Result<Capabilities, A::Error> {
    let plugin = via
        .ask(
            Rpc::GetPluginCapabilities,
            proto::GetPluginCapabilitiesRequest {},
            |ch, r| async move { IdentityClient::new(ch).get_plugin_capabilities(r).await },
        )
        .await?;
    let plugin = PluginCapabilities::from_proto(&plugin.capabilities);
    let controller = if services.controller() && plugin.controller_service() {
        let resp = via
            .ask(
                Rpc::ControllerGetCapabilities,
                proto::ControllerGetCapabilitiesRequest {},
                |ch, r| async move {
                    ControllerClient::new(ch)
                        .controller_get_capabilities(r)
                        .await
                },
            )
            .await?;
        ControllerCapabilities::from_proto(&resp.capabilities)
    } else {
        ControllerCapabilities::default()
    };
    let node = if services.node() {
        let resp = via
            .ask(
                Rpc::NodeGetCapabilities,
                proto::NodeGetCapabilitiesRequest {},
                |ch, r| async move { NodeClient::new(ch).node_get_capabilities(r).await },
            )
            .await?;
        NodeCapabilities::from_proto(&resp.capabilities)
    } else {
        NodeCapabilities::default()
    };
    Ok(Capabilities {
        plugin,
        controller,
        node,
    })
}

fn volume_id(id: &str) -> Option<VolumeRef> {
    (!id.is_empty()).then(|| VolumeRef::Id(id.to_string()))
}

/// Whether tonic failed to decode the reply (it reports that as INTERNAL
/// with the decoder's message): the plugin answered, with bytes that are
/// not the response message.
fn is_decode_failure(status: &Status) -> bool {
    status.code() == Code::Internal
        && status
            .message()
            .starts_with("failed to decode Protobuf message")
}

/// Checks a CreateVolume answer against the spec and the range asked for:
/// a volume with an id, a capacity that is unknown (0) or within the range.
fn check_created(
    response: &proto::CreateVolumeResponse,
    range: &proto::CapacityRange,
) -> Result<(), String> {
    let volume = response
        .volume
        .as_ref()
        .ok_or("no volume (the field is REQUIRED)")?;
    if volume.volume_id.is_empty() {
        return Err("a volume with an empty volume_id (the field is REQUIRED)".to_string());
    }
    let id = &volume.volume_id;
    let capacity = volume.capacity_bytes;
    if capacity < 0 {
        return Err(format!(
            "volume '{id}' has a negative capacity_bytes ({capacity})"
        ));
    }
    if capacity > 0 && capacity < range.required_bytes {
        return Err(format!(
            "volume '{id}' has capacity_bytes {capacity}, less than the required_bytes {} asked for",
            range.required_bytes
        ));
    }
    if capacity > 0 && range.limit_bytes > 0 && capacity > range.limit_bytes {
        return Err(format!(
            "volume '{id}' has capacity_bytes {capacity}, more than the limit_bytes {} asked for",
            range.limit_bytes
        ));
    }
    Ok(())
}

/// Turns tonic's local failures into the codes they mean:
/// - its own expiry of `grpc-timeout` (client or server side) arrives as
///   `CANCELLED: Timeout expired`; nobody cancelled, the deadline ran out;
/// - a connection that died under the request (the plugin was killed or
///   restarted) arrives as `UNKNOWN: transport error` with the I/O error as
///   its source. The plugin never answered, so it is `UNAVAILABLE` (and
///   retried: CSI calls are idempotent). A plugin's own `UNKNOWN` comes off
///   the wire and has no source, so it stays final.
fn normalize(status: Status, attempt: Duration, deadline: Duration) -> Status {
    if status.code() == Code::Cancelled && attempt >= deadline {
        return Status::deadline_exceeded(format!(
            "no reply within {} ({})",
            fmt_duration(deadline),
            status.message()
        ));
    }
    if status.code() == Code::Unknown {
        if let Some(source) = std::error::Error::source(&status) {
            let chain =
                crate::error_chain::with_sources(status.message().to_string(), Some(source));
            return Status::unavailable(format!("connection to the plugin lost: {chain}"));
        }
    }
    status
}

/// Dials until the socket accepts a connection or `timeout` runs out.
async fn wait_for_socket(endpoint: &str, path: &Path, timeout: Duration) -> Result<(), CsiError> {
    let started = Instant::now();
    let mut failures = 0;
    loop {
        let err = match UnixStream::connect(path).await {
            Ok(_) => return Ok(()),
            Err(e) => e,
        };
        failures += 1;
        let elapsed = started.elapsed();
        if elapsed >= timeout {
            let appeared = err.kind() != std::io::ErrorKind::NotFound;
            return Err(CsiError::ConnectTimeout {
                endpoint: endpoint.to_string(),
                what: if appeared {
                    "socket did not accept connections"
                } else {
                    "socket did not appear"
                },
                timeout,
                last_error: appeared.then(|| crate::error_chain::full_message(&err)),
            });
        }
        let sleep = DIAL_BACKOFF
            .backoff(failures, &mut rand::rng())
            .min(timeout - elapsed);
        tracing::debug!(error = %Chain(&err), backoff = ?sleep, "waiting for the plugin socket");
        tokio::time::sleep(sleep).await;
    }
}

/// A channel that dials `path` on first use and again after every lost
/// connection. Every dial must reach the socket file `pinned`, the one whose
/// plugin was checked: when the file was replaced since (a restarted plugin
/// binds a new one), or is replaced while the dial runs, the dial fails as
/// UNAVAILABLE, the call is retried, and its next attempt re-checks the new
/// plugin before anything is sent to it. Without the pin, a call that found
/// the old file could connect to the new process unchecked.
fn lazy_channel(path: &Path, pinned: Option<SocketId>) -> Channel {
    let path = path.to_path_buf();
    Endpoint::from_static("http://csi.local").connect_with_connector_lazy(tower::service_fn(
        move |_| {
            let path = path.clone();
            async move { dial_pinned(&path, pinned).await.map(TokioIo::new) }
        },
    ))
}

async fn dial_pinned(path: &Path, pinned: Option<SocketId>) -> std::io::Result<UnixStream> {
    let replaced = || {
        std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            format!(
                "socket {} is a new file since the plugin behind it was checked",
                path.display()
            ),
        )
    };
    let before = socket_id(path);
    if pinned.is_some() && before != pinned {
        return Err(replaced());
    }
    let stream = UnixStream::connect(path).await?;
    if socket_id(path) != before {
        return Err(replaced());
    }
    check_server(
        path,
        stream.peer_cred()?.uid(),
        nix::unistd::geteuid().as_raw(),
    )?;
    Ok(stream)
}

/// A plugin gets the volumes' secrets and decides what is mounted where, so csi-isolator talks
/// only to a socket served by root or by its own user: whoever else could put a socket at the
/// endpoint's path (a plugin's socket directory left writable) gets nothing, not a byte of the
/// first call. `server` is the uid of the process that listened on the socket (`SO_PEERCRED`).
fn check_server(path: &Path, server: u32, me: u32) -> std::io::Result<()> {
    if server == 0 || server == me {
        return Ok(());
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::PermissionDenied,
        format!(
            "socket {} is served by uid {server}, not by root: csi-isolator sends a CSI plugin secrets and mounts what it answers, so it talks only to a plugin running as root (or as its own user); run the plugin as root, or make its socket directory writable by root alone",
            path.display()
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error_chain::FullMessage;

    #[test]
    fn only_a_socket_served_by_root_or_by_this_user_is_talked_to() {
        let p = Path::new("/run/csi/x.sock");
        assert!(check_server(p, 0, 0).is_ok());
        assert!(check_server(p, 0, 1000).is_ok());
        assert!(check_server(p, 1000, 1000).is_ok());
        let refused = check_server(p, 65534, 0).unwrap_err();
        assert_eq!(refused.kind(), std::io::ErrorKind::PermissionDenied);
        let text = refused.to_string();
        assert!(
            text.contains("/run/csi/x.sock") && text.contains("uid 65534"),
            "{text}"
        );
        assert!(check_server(p, 65534, 1000).is_err());
    }

    #[test]
    fn create_answers_outside_the_spec_or_the_range_are_refused() {
        let answer = |id: &str, capacity: i64| proto::CreateVolumeResponse {
            volume: Some(proto::Volume {
                volume_id: id.into(),
                capacity_bytes: capacity,
                ..Default::default()
            }),
        };
        let range = |required: i64, limit: i64| proto::CapacityRange {
            required_bytes: required,
            limit_bytes: limit,
        };
        let ok = [
            (answer("v", 100), range(100, 0)),
            (answer("v", 0), range(100, 200)),
            (answer("v", 150), range(100, 200)),
            (answer("v", 1), range(0, 0)),
        ];
        for (resp, r) in ok {
            assert_eq!(check_created(&resp, &r), Ok(()), "{resp:?} {r:?}");
        }
        let bad = [
            (
                proto::CreateVolumeResponse { volume: None },
                range(0, 0),
                "no volume (the field is REQUIRED)",
            ),
            (
                answer("", 100),
                range(0, 0),
                "a volume with an empty volume_id (the field is REQUIRED)",
            ),
            (
                answer("v", -1),
                range(0, 0),
                "volume 'v' has a negative capacity_bytes (-1)",
            ),
            (
                answer("v", 99),
                range(100, 0),
                "volume 'v' has capacity_bytes 99, less than the required_bytes 100 asked for",
            ),
            (
                answer("v", 201),
                range(100, 200),
                "volume 'v' has capacity_bytes 201, more than the limit_bytes 200 asked for",
            ),
        ];
        for (resp, r, want) in bad {
            assert_eq!(check_created(&resp, &r), Err(want.to_string()), "{resp:?}");
        }
    }

    #[test]
    fn only_tonic_decode_failures_count_as_undecodable_replies() {
        assert!(is_decode_failure(&Status::internal(
            "failed to decode Protobuf message: invalid wire type value: 7"
        )));
        assert!(!is_decode_failure(&Status::internal("disk on fire")));
        assert!(!is_decode_failure(&Status::unknown(
            "failed to decode Protobuf message: x"
        )));
    }

    #[test]
    fn tonic_timeouts_become_deadline_exceeded() {
        let d = Duration::from_millis(200);
        let s = normalize(
            Status::cancelled("Timeout expired"),
            Duration::from_millis(201),
            d,
        );
        assert_eq!(s.code(), Code::DeadlineExceeded);
        assert_eq!(s.message(), "no reply within 200ms (Timeout expired)");
        // A cancel before the deadline is the plugin's answer and stays.
        let s = normalize(Status::cancelled("stop"), Duration::from_millis(5), d);
        assert_eq!(s.code(), Code::Cancelled);
        let s = normalize(Status::unavailable("x"), Duration::from_secs(1), d);
        assert_eq!(s.code(), Code::Unavailable);
    }

    #[test]
    fn lost_connections_become_unavailable_but_plugin_unknown_stays() {
        let d = Duration::from_secs(60);
        let io = std::io::Error::new(std::io::ErrorKind::BrokenPipe, "broken pipe");
        let lost = Status::from_error(Box::new(io));
        assert_eq!(lost.code(), Code::Unknown);
        let s = normalize(lost, Duration::ZERO, d);
        assert_eq!(s.code(), Code::Unavailable);
        assert!(
            s.message().starts_with("connection to the plugin lost: "),
            "{}",
            s.message()
        );
        assert!(s.message().contains("broken pipe"), "{}", s.message());
        let from_plugin = Status::unknown("plugin bug");
        assert_eq!(
            normalize(from_plugin, Duration::ZERO, d).code(),
            Code::Unknown
        );
    }

    #[tokio::test]
    async fn connect_names_endpoint_when_socket_never_appears() {
        let dir = tempfile::tempdir().unwrap();
        let endpoint = format!("unix://{}/csi.sock", dir.path().display());
        let options = ClientOptions {
            connect_timeout: Duration::from_millis(300),
            ..ClientOptions::default()
        };
        let started = Instant::now();
        let err = Client::connect(&endpoint, options).await.unwrap_err();
        assert!(started.elapsed() >= Duration::from_millis(300));
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(
            err.full_message(),
            format!("connect to {endpoint}: socket did not appear within 300ms")
        );
    }

    #[tokio::test]
    async fn connect_names_endpoint_when_socket_refuses() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("csi.sock");
        // A socket file whose listener is gone: connect() is refused.
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        let endpoint = format!("unix://{}", path.display());
        let options = ClientOptions {
            connect_timeout: Duration::from_millis(200),
            ..ClientOptions::default()
        };
        let err = Client::connect(&endpoint, options).await.unwrap_err();
        let msg = err.full_message();
        assert!(
            msg.starts_with(&format!("connect to {endpoint}: socket did not accept connections within 200ms (last error: ")),
            "{msg}"
        );
    }

    #[tokio::test]
    async fn bad_endpoint_is_refused() {
        let err = Client::connect("tcp://1.2.3.4:5", ClientOptions::default())
            .await
            .unwrap_err();
        assert!(matches!(err, CsiError::BadEndpoint { .. }));
        assert!(
            err.full_message()
                .starts_with("connect to tcp://1.2.3.4:5: "),
            "{err}"
        );
    }

    /// A dial reaches only the socket file its channel was pinned to: after
    /// the file is replaced (a restarted plugin), the old channel's calls
    /// fail UNAVAILABLE (retried, then re-checked) and the new listener never
    /// sees a connection; a channel pinned to the new file reaches it.
    #[tokio::test]
    async fn a_pinned_channel_never_reaches_a_replaced_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("csi.sock");
        let first = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let pinned = socket_id(&path);
        drop(first);
        std::fs::remove_file(&path).unwrap();
        let second = std::os::unix::net::UnixListener::bind(&path).unwrap();
        second.set_nonblocking(true).unwrap();
        assert_ne!(socket_id(&path), pinned);

        let probe = |channel: Channel| async move {
            let mut req = tonic::Request::new(proto::ProbeRequest {});
            req.set_timeout(Duration::from_millis(300));
            tokio::time::timeout(
                Duration::from_millis(500),
                IdentityClient::new(channel).probe(req),
            )
            .await
        };
        let old = probe(lazy_channel(&path, pinned)).await;
        let status = old.expect("a refused dial answers at once").unwrap_err();
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
        assert_eq!(
            second.accept().map_err(|e| e.kind()).unwrap_err(),
            std::io::ErrorKind::WouldBlock,
            "the replaced socket's listener was reached"
        );

        // Positive control: pinned to the file there now, the dial connects.
        let _ = probe(lazy_channel(&path, socket_id(&path))).await;
        assert!(
            second.accept().is_ok(),
            "the current socket was not reached"
        );
    }
}
