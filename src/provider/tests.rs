//! The provider's state machine driven end to end without root: a [`StorageProvider`] on
//! [`FakeSyscall`] (its mount seam and its mount table) talks real gRPC, over a Unix socket in a
//! temp dir, to [`Recorder`], an in-process CSI plugin that records each RPC and "mounts" by
//! adding to the same fake table. What these check is the provider's own sequence (which RPC
//! when, what is durable after each operation), not a plugin: `tests/provider.rs` runs the same
//! paths as root against the real bundled plugin and the kernel.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tonic::{Request, Response, Status};

use crate::csi::proto;
use crate::csi::proto::controller_service_capability::rpc::Type as ControllerCap;
use crate::csi::proto::node_service_capability::rpc::Type as NodeCap;
use crate::mount::{FakeSyscall, MountTable, Syscall};
use crate::provider::{
    CreateSpec, PluginSource, ProviderConfig, ProviderError, StorageProvider, UnpublishPolicy,
    VolumeState,
};

/// What the recorder was asked, in order (the RPC names of the CSI spec).
type Log = Arc<Mutex<Vec<&'static str>>>;

/// An in-process CSI plugin with controller and stage capabilities that records every call,
/// "mounts" its staging path and targets into the provider's fake table, and fails one RPC on
/// demand.
#[derive(Clone)]
struct Recorder {
    log: Log,
    sys: Arc<FakeSyscall>,
    /// An RPC to refuse (with UNAVAILABLE, a transient error the provider may retry) and how
    /// many times.
    fail: Arc<Mutex<Option<(&'static str, u32)>>>,
    volumes: Arc<Mutex<HashSet<String>>>,
}

impl Recorder {
    fn new(sys: Arc<FakeSyscall>) -> Recorder {
        Recorder {
            log: Arc::default(),
            sys,
            fail: Arc::default(),
            volumes: Arc::default(),
        }
    }

    fn called(&self, rpc: &'static str) -> Result<(), Status> {
        self.called_echoing(rpc, &Default::default())
    }

    /// [`called`](Self::called) for a request that carried `secrets`: a refusal echoes their
    /// values, as a careless (or hostile) driver's message may.
    fn called_echoing(
        &self,
        rpc: &'static str,
        secrets: &std::collections::HashMap<String, String>,
    ) -> Result<(), Status> {
        self.log.lock().unwrap().push(rpc);
        let mut fail = self.fail.lock().unwrap();
        if let Some((name, left)) = fail.as_mut() {
            if *name == rpc && *left > 0 {
                *left -= 1;
                let mut echoed: Vec<&str> = secrets.values().map(String::as_str).collect();
                echoed.sort();
                return Err(Status::internal(format!(
                    "{rpc} refused by the test (got {})",
                    echoed.join(", ")
                )));
            }
        }
        Ok(())
    }

    fn calls(&self) -> Vec<&'static str> {
        std::mem::take(&mut *self.log.lock().unwrap())
    }

    fn mount(&self, path: &str) {
        self.sys.add_mount("fake-volume", Path::new(path), "ext4");
    }

    fn unmount(&self, path: &str) {
        // Not mounted is success, as NodeUnpublish and NodeUnstage are idempotent.
        let _ = self.sys.unmount(Path::new(path), false);
    }
}

#[tonic::async_trait]
impl proto::identity_server::Identity for Recorder {
    async fn get_plugin_info(
        &self,
        _: Request<proto::GetPluginInfoRequest>,
    ) -> Result<Response<proto::GetPluginInfoResponse>, Status> {
        Ok(Response::new(proto::GetPluginInfoResponse {
            name: "recorder.csi-isolator.io".into(),
            vendor_version: "1".into(),
            ..Default::default()
        }))
    }

    async fn get_plugin_capabilities(
        &self,
        _: Request<proto::GetPluginCapabilitiesRequest>,
    ) -> Result<Response<proto::GetPluginCapabilitiesResponse>, Status> {
        use proto::plugin_capability::service::Type;
        let service = proto::PluginCapability {
            r#type: Some(proto::plugin_capability::Type::Service(
                proto::plugin_capability::Service {
                    r#type: Type::ControllerService as i32,
                },
            )),
        };
        Ok(Response::new(proto::GetPluginCapabilitiesResponse {
            capabilities: vec![service],
        }))
    }

    async fn probe(
        &self,
        _: Request<proto::ProbeRequest>,
    ) -> Result<Response<proto::ProbeResponse>, Status> {
        Ok(Response::new(proto::ProbeResponse { ready: Some(true) }))
    }
}

/// The answer to an RPC the provider must not call here.
fn not_here<T>(rpc: &str) -> Result<Response<T>, Status> {
    Err(Status::unimplemented(format!(
        "{rpc} is not part of these tests"
    )))
}

#[tonic::async_trait]
impl proto::controller_server::Controller for Recorder {
    async fn create_volume(
        &self,
        request: Request<proto::CreateVolumeRequest>,
    ) -> Result<Response<proto::CreateVolumeResponse>, Status> {
        self.called("CreateVolume")?;
        let req = request.into_inner();
        let id = format!("id-{}", req.name);
        self.volumes.lock().unwrap().insert(id.clone());
        Ok(Response::new(proto::CreateVolumeResponse {
            volume: Some(proto::Volume {
                volume_id: id,
                capacity_bytes: req.capacity_range.map_or(0, |r| r.required_bytes),
                ..Default::default()
            }),
        }))
    }

    async fn delete_volume(
        &self,
        request: Request<proto::DeleteVolumeRequest>,
    ) -> Result<Response<proto::DeleteVolumeResponse>, Status> {
        self.called("DeleteVolume")?;
        self.volumes
            .lock()
            .unwrap()
            .remove(&request.into_inner().volume_id);
        Ok(Response::new(proto::DeleteVolumeResponse {}))
    }

    async fn controller_publish_volume(
        &self,
        _: Request<proto::ControllerPublishVolumeRequest>,
    ) -> Result<Response<proto::ControllerPublishVolumeResponse>, Status> {
        self.called("ControllerPublishVolume")?;
        Ok(Response::new(
            proto::ControllerPublishVolumeResponse::default(),
        ))
    }

    async fn controller_unpublish_volume(
        &self,
        _: Request<proto::ControllerUnpublishVolumeRequest>,
    ) -> Result<Response<proto::ControllerUnpublishVolumeResponse>, Status> {
        self.called("ControllerUnpublishVolume")?;
        Ok(Response::new(proto::ControllerUnpublishVolumeResponse {}))
    }

    async fn controller_get_capabilities(
        &self,
        _: Request<proto::ControllerGetCapabilitiesRequest>,
    ) -> Result<Response<proto::ControllerGetCapabilitiesResponse>, Status> {
        let capabilities = [
            ControllerCap::CreateDeleteVolume,
            ControllerCap::PublishUnpublishVolume,
        ]
        .into_iter()
        .map(|c| proto::ControllerServiceCapability {
            r#type: Some(proto::controller_service_capability::Type::Rpc(
                proto::controller_service_capability::Rpc { r#type: c as i32 },
            )),
        })
        .collect();
        Ok(Response::new(proto::ControllerGetCapabilitiesResponse {
            capabilities,
        }))
    }

    async fn validate_volume_capabilities(
        &self,
        _: Request<proto::ValidateVolumeCapabilitiesRequest>,
    ) -> Result<Response<proto::ValidateVolumeCapabilitiesResponse>, Status> {
        not_here("ValidateVolumeCapabilities")
    }

    async fn list_volumes(
        &self,
        _: Request<proto::ListVolumesRequest>,
    ) -> Result<Response<proto::ListVolumesResponse>, Status> {
        not_here("ListVolumes")
    }

    async fn get_capacity(
        &self,
        _: Request<proto::GetCapacityRequest>,
    ) -> Result<Response<proto::GetCapacityResponse>, Status> {
        not_here("GetCapacity")
    }

    async fn create_snapshot(
        &self,
        _: Request<proto::CreateSnapshotRequest>,
    ) -> Result<Response<proto::CreateSnapshotResponse>, Status> {
        not_here("CreateSnapshot")
    }

    async fn delete_snapshot(
        &self,
        _: Request<proto::DeleteSnapshotRequest>,
    ) -> Result<Response<proto::DeleteSnapshotResponse>, Status> {
        not_here("DeleteSnapshot")
    }

    async fn list_snapshots(
        &self,
        _: Request<proto::ListSnapshotsRequest>,
    ) -> Result<Response<proto::ListSnapshotsResponse>, Status> {
        not_here("ListSnapshots")
    }

    async fn get_snapshot(
        &self,
        _: Request<proto::GetSnapshotRequest>,
    ) -> Result<Response<proto::GetSnapshotResponse>, Status> {
        not_here("GetSnapshot")
    }

    async fn controller_expand_volume(
        &self,
        _: Request<proto::ControllerExpandVolumeRequest>,
    ) -> Result<Response<proto::ControllerExpandVolumeResponse>, Status> {
        not_here("ControllerExpandVolume")
    }

    async fn controller_get_volume(
        &self,
        _: Request<proto::ControllerGetVolumeRequest>,
    ) -> Result<Response<proto::ControllerGetVolumeResponse>, Status> {
        not_here("ControllerGetVolume")
    }

    async fn controller_modify_volume(
        &self,
        _: Request<proto::ControllerModifyVolumeRequest>,
    ) -> Result<Response<proto::ControllerModifyVolumeResponse>, Status> {
        not_here("ControllerModifyVolume")
    }
}

#[tonic::async_trait]
impl proto::node_server::Node for Recorder {
    async fn node_stage_volume(
        &self,
        request: Request<proto::NodeStageVolumeRequest>,
    ) -> Result<Response<proto::NodeStageVolumeResponse>, Status> {
        let request = request.into_inner();
        self.called_echoing("NodeStageVolume", &request.secrets)?;
        self.mount(&request.staging_target_path);
        Ok(Response::new(proto::NodeStageVolumeResponse {}))
    }

    async fn node_unstage_volume(
        &self,
        request: Request<proto::NodeUnstageVolumeRequest>,
    ) -> Result<Response<proto::NodeUnstageVolumeResponse>, Status> {
        self.called("NodeUnstageVolume")?;
        self.unmount(&request.into_inner().staging_target_path);
        Ok(Response::new(proto::NodeUnstageVolumeResponse {}))
    }

    async fn node_publish_volume(
        &self,
        request: Request<proto::NodePublishVolumeRequest>,
    ) -> Result<Response<proto::NodePublishVolumeResponse>, Status> {
        self.called("NodePublishVolume")?;
        // The plugin makes the target (CSI); the provider checks that it did.
        let target = request.into_inner().target_path;
        std::fs::create_dir_all(&target).map_err(|e| Status::internal(e.to_string()))?;
        self.mount(&target);
        Ok(Response::new(proto::NodePublishVolumeResponse {}))
    }

    async fn node_unpublish_volume(
        &self,
        request: Request<proto::NodeUnpublishVolumeRequest>,
    ) -> Result<Response<proto::NodeUnpublishVolumeResponse>, Status> {
        self.called("NodeUnpublishVolume")?;
        self.unmount(&request.into_inner().target_path);
        Ok(Response::new(proto::NodeUnpublishVolumeResponse {}))
    }

    async fn node_get_volume_stats(
        &self,
        _: Request<proto::NodeGetVolumeStatsRequest>,
    ) -> Result<Response<proto::NodeGetVolumeStatsResponse>, Status> {
        not_here("NodeGetVolumeStats")
    }

    async fn node_expand_volume(
        &self,
        _: Request<proto::NodeExpandVolumeRequest>,
    ) -> Result<Response<proto::NodeExpandVolumeResponse>, Status> {
        not_here("NodeExpandVolume")
    }

    async fn node_get_capabilities(
        &self,
        _: Request<proto::NodeGetCapabilitiesRequest>,
    ) -> Result<Response<proto::NodeGetCapabilitiesResponse>, Status> {
        let stage = proto::NodeServiceCapability {
            r#type: Some(proto::node_service_capability::Type::Rpc(
                proto::node_service_capability::Rpc {
                    r#type: NodeCap::StageUnstageVolume as i32,
                },
            )),
        };
        Ok(Response::new(proto::NodeGetCapabilitiesResponse {
            capabilities: vec![stage],
        }))
    }

    async fn node_get_info(
        &self,
        _: Request<proto::NodeGetInfoRequest>,
    ) -> Result<Response<proto::NodeGetInfoResponse>, Status> {
        self.called("NodeGetInfo")?;
        Ok(Response::new(proto::NodeGetInfoResponse {
            node_id: "node-1".into(),
            ..Default::default()
        }))
    }
}

/// A provider on the fake seam and its recorder, in a temp dir that goes with it.
struct Bench {
    _dir: tempfile::TempDir,
    work: PathBuf,
    endpoint: String,
    sys: Arc<FakeSyscall>,
    plugin: Recorder,
    server: tokio::task::JoinHandle<()>,
}

impl Bench {
    async fn new() -> Bench {
        let dir = tempfile::tempdir().unwrap();
        let work = dir.path().join("work");
        std::fs::create_dir(&work).unwrap();
        let socket = dir.path().join("csi.sock");
        let listener = tokio::net::UnixListener::bind(&socket).unwrap();
        let sys = Arc::new(FakeSyscall::new());
        let plugin = Recorder::new(sys.clone());
        let incoming = futures::stream::unfold(listener, |listener| async move {
            let next = listener.accept().await.map(|(stream, _)| stream);
            Some((next, listener))
        });
        let server = tokio::spawn({
            let plugin = plugin.clone();
            async move {
                let _ = tonic::transport::Server::builder()
                    .add_service(proto::identity_server::IdentityServer::new(plugin.clone()))
                    .add_service(proto::controller_server::ControllerServer::new(
                        plugin.clone(),
                    ))
                    .add_service(proto::node_server::NodeServer::new(plugin))
                    .serve_with_incoming(incoming)
                    .await;
            }
        });
        Bench {
            _dir: dir,
            work,
            endpoint: format!("unix://{}", socket.display()),
            sys,
            plugin,
            server,
        }
    }

    /// A provider (a fresh one each call: a restart) under `policy`.
    async fn provider(&self, policy: UnpublishPolicy) -> Arc<StorageProvider> {
        self.provider_with(policy, Duration::ZERO).await
    }

    /// A provider under `policy` with an unpublish delay.
    async fn provider_with(
        &self,
        policy: UnpublishPolicy,
        unpublish_delay: Duration,
    ) -> Arc<StorageProvider> {
        let mut config = ProviderConfig::new(
            "recorder.csi-isolator.io",
            "unit",
            &self.work,
            PluginSource::Endpoint(self.endpoint.clone()),
        );
        config.policy = policy;
        config.unpublish_delay = unpublish_delay;
        config.boot_id = Some("boot-1".into());
        let table: Arc<dyn MountTable> = self.sys.clone();
        StorageProvider::start_with(config, self.sys.clone(), table)
            .await
            .expect("start the provider on the fake seam")
    }
}

impl Bench {
    /// A provider whose node plugin is this bench's recorder and whose controller plugin is
    /// `controller`'s, another process as far as the provider can tell.
    async fn provider_split(&self, controller: &Bench) -> Arc<StorageProvider> {
        let mut config = ProviderConfig::new(
            "recorder.csi-isolator.io",
            "unit",
            &self.work,
            PluginSource::Endpoint(self.endpoint.clone()),
        );
        config.controller_endpoint = Some(controller.endpoint.clone());
        config.boot_id = Some("boot-1".into());
        let table: Arc<dyn MountTable> = self.sys.clone();
        StorageProvider::start_with(config, self.sys.clone(), table)
            .await
            .expect("start the provider with its controller apart")
    }
}

impl Drop for Bench {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// A provider under `policy` with one volume created, the recorder's log emptied: its id.
async fn with_a_volume(bench: &Bench, policy: UnpublishPolicy) -> (Arc<StorageProvider>, String) {
    let provider = bench.provider(policy).await;
    let resource = provider
        .create_volume(CreateSpec::new("data", 1 << 20))
        .await
        .unwrap();
    let id = resource.disk.unwrap().source.unwrap().id.unwrap();
    bench.plugin.calls();
    (provider, id)
}

/// The state written on disk for `volume_id`, as a restarted provider would read it.
async fn state_on_disk(bench: &Bench, volume_id: &str) -> VolumeState {
    let provider = bench.provider(UnpublishPolicy::Keep).await;
    let state = provider.volume(volume_id).await.expect("recorded").state;
    bench.plugin.calls();
    state
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_walks_controller_stage_and_node_and_the_last_release_walks_back() {
    let bench = Bench::new().await;
    let provider = bench.provider(UnpublishPolicy::LastUse).await;
    let resource = provider
        .create_volume(CreateSpec::new("data", 1 << 20))
        .await
        .unwrap();
    let id = resource.disk.unwrap().source.unwrap().id.unwrap();
    assert_eq!(bench.plugin.calls(), ["CreateVolume"]);

    let target = provider.publish(&id, "c1").await.unwrap();
    assert_eq!(
        bench.plugin.calls(),
        [
            "NodeGetInfo",
            "ControllerPublishVolume",
            "NodeStageVolume",
            "NodePublishVolume"
        ]
    );
    assert!(bench.sys.is_mount_root(&target).unwrap(), "published");
    // A second user is recorded without a call; the first one's release keeps it published.
    provider.publish(&id, "c2").await.unwrap();
    provider.release(&id, "c1").await.unwrap();
    assert!(bench.plugin.calls().is_empty());
    let rec = provider.volume(&id).await.unwrap();
    assert_eq!(rec.state, VolumeState::Published);
    assert_eq!(rec.users.iter().collect::<Vec<_>>(), ["c2"]);

    provider.release(&id, "c2").await.unwrap();
    assert_eq!(
        bench.plugin.calls(),
        [
            "NodeUnpublishVolume",
            "NodeUnstageVolume",
            "ControllerUnpublishVolume"
        ]
    );
    assert!(!bench.sys.is_mount_root(&target).unwrap(), "unpublished");
    drop(provider);
    assert_eq!(state_on_disk(&bench, &id).await, VolumeState::Created);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_an_unpublish_delay_the_last_release_keeps_the_volume_published_until_it_passes() {
    let bench = Bench::new().await;
    let delay = Duration::from_millis(400);
    let provider = bench.provider_with(UnpublishPolicy::LastUse, delay).await;
    let resource = provider
        .create_volume(CreateSpec::new("data", 1 << 20))
        .await
        .unwrap();
    let id = resource.disk.unwrap().source.unwrap().id.unwrap();
    let target = provider.publish(&id, "c1").await.unwrap();
    bench.plugin.calls();

    // The last user leaves: durable at once, but no call, and the volume stays published.
    provider.release(&id, "c1").await.unwrap();
    assert!(bench.plugin.calls().is_empty());
    let rec = provider.volume(&id).await.unwrap();
    assert_eq!(rec.state, VolumeState::Published);
    assert!(rec.users.is_empty());
    // A user within the delay finds it published: no call either.
    assert_eq!(provider.publish(&id, "c2").await.unwrap(), target);
    assert!(bench.plugin.calls().is_empty());
    provider.release(&id, "c2").await.unwrap();
    // The delay counts from the last release: a settle before it passes does nothing.
    provider.settle_idle().await;
    assert!(bench.plugin.calls().is_empty());
    assert!(bench.sys.is_mount_root(&target).unwrap(), "still published");

    tokio::time::sleep(delay + Duration::from_millis(100)).await;
    provider.settle_idle().await;
    assert_eq!(
        bench.plugin.calls(),
        [
            "NodeUnpublishVolume",
            "NodeUnstageVolume",
            "ControllerUnpublishVolume"
        ]
    );
    assert!(!bench.sys.is_mount_root(&target).unwrap(), "unpublished");
    drop(provider);
    assert_eq!(state_on_disk(&bench, &id).await, VolumeState::Created);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_waiting_out_its_unpublish_delay_is_unpublished_by_the_next_start() {
    let bench = Bench::new().await;
    let provider = bench
        .provider_with(UnpublishPolicy::LastUse, Duration::from_secs(3600))
        .await;
    let resource = provider
        .create_volume(CreateSpec::new("data", 1 << 20))
        .await
        .unwrap();
    let id = resource.disk.unwrap().source.unwrap().id.unwrap();
    let target = provider.publish(&id, "c1").await.unwrap();
    provider.release(&id, "c1").await.unwrap();
    bench.plugin.calls();
    // The process stops during the delay; the next one does not wait for it.
    drop(provider);
    let restarted = bench
        .provider_with(UnpublishPolicy::LastUse, Duration::from_secs(3600))
        .await;
    let calls = bench.plugin.calls();
    assert!(
        calls.ends_with(&[
            "NodeUnpublishVolume",
            "NodeUnstageVolume",
            "ControllerUnpublishVolume"
        ]),
        "{calls:?}"
    );
    assert!(!bench.sys.is_mount_root(&target).unwrap(), "unpublished");
    assert_eq!(
        restarted.volume(&id).await.unwrap().state,
        VolumeState::Created
    );
}

/// An operation that goes on to publish leaves the staging mount's nosuid,nodev to NodePublish's
/// trip; when NodePublish fails and the policy keeps the volume staged, the staging mount is
/// hardened all the same before the publish answers its error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_node_publish_leaves_the_staging_mount_hardened() {
    let bench = Bench::new().await;
    let (provider, id) = with_a_volume(&bench, UnpublishPolicy::Keep).await;
    let staging = provider.layout().staging_path(&id);
    *bench.plugin.fail.lock().unwrap() = Some(("NodePublishVolume", 1));
    provider.publish(&id, "c1").await.unwrap_err();
    let rec = provider.volume(&id).await.unwrap();
    assert_eq!(rec.state, VolumeState::VolReady, "kept staged: {rec:?}");
    let mount = bench
        .sys
        .find(&staging)
        .unwrap()
        .expect("the staging mount is kept");
    for flag in ["nosuid", "nodev"] {
        assert!(
            mount.mount_options.iter().any(|o| o == flag),
            "{flag} on the kept staging mount: {:?}",
            mount.mount_options
        );
    }
}

/// A volume's directories live as long as it does (made at its create); a staging path that
/// cannot be made (a file stands there) fails the stage before NodeStageVolume is sent, naming
/// the step and the path, and nothing of the use is kept; once it is gone, the next publish
/// makes the directory and goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_staging_directory_that_cannot_be_made_fails_the_stage_before_its_rpc() {
    let bench = Bench::new().await;
    let (provider, id) = with_a_volume(&bench, UnpublishPolicy::LastUse).await;
    let staging = provider.layout().staging_path(&id);
    assert!(staging.is_dir(), "made with the volume");

    std::fs::remove_dir(&staging).unwrap();
    std::fs::write(&staging, b"in the way").unwrap();
    let err = provider.publish(&id, "c1").await.unwrap_err();
    let text = crate::error_chain::full_message(&err);
    assert!(text.contains("create staging directory"), "{text}");
    assert!(text.contains(&staging.display().to_string()), "{text}");
    let calls = bench.plugin.calls();
    assert!(
        !calls.contains(&"NodeStageVolume") && !calls.contains(&"NodePublishVolume"),
        "no node RPC without its staging directory: {calls:?}"
    );
    let rec = provider.volume(&id).await.unwrap();
    assert!(rec.users.is_empty(), "a failed publish adds no user");
    assert_eq!(rec.state, VolumeState::Created, "undone: {rec:?}");

    std::fs::remove_file(&staging).unwrap();
    let target = provider.publish(&id, "c1").await.unwrap();
    assert!(bench.sys.is_mount_root(&target).unwrap(), "published");
    assert!(staging.is_dir(), "made again by the publish");
    assert!(bench.plugin.calls().contains(&"NodeStageVolume"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_stage_is_undone_to_where_the_policy_keeps_the_volume() {
    for (policy, undone) in [
        (UnpublishPolicy::LastUse, true),
        (UnpublishPolicy::Keep, false),
    ] {
        let bench = Bench::new().await;
        let (provider, id) = with_a_volume(&bench, policy).await;
        // INTERNAL is final: not retried, and the error names what the plugin said.
        *bench.plugin.fail.lock().unwrap() = Some(("NodeStageVolume", 1));
        let err = provider.publish(&id, "c1").await.unwrap_err();
        let text = crate::error_chain::full_message(&err);
        assert!(
            text.contains("NodeStageVolume refused by the test"),
            "{text}"
        );
        let rec = provider.volume(&id).await.unwrap();
        assert!(rec.users.is_empty(), "a failed publish adds no user");
        // The interrupted step is never left behind: the undo starts from as far as the
        // operation could have gone (its one intent names only its goal), so an idempotent
        // NodeUnpublish comes first; unused under last-use, the volume goes back the whole way.
        let mut walked = vec![
            "NodeGetInfo",
            "ControllerPublishVolume",
            "NodeStageVolume",
            "NodeUnpublishVolume",
            "NodeUnstageVolume",
        ];
        if undone {
            walked.push("ControllerUnpublishVolume");
            assert_eq!(rec.state, VolumeState::Created, "{policy:?}");
        } else {
            assert_eq!(rec.state, VolumeState::NodeReady, "{policy:?}");
        }
        assert_eq!(bench.plugin.calls(), walked, "{policy:?}");

        // The next publish goes on from where the volume stands.
        provider.publish(&id, "c1").await.unwrap();
        let from_there: &[&str] = if undone {
            &[
                "ControllerPublishVolume",
                "NodeStageVolume",
                "NodePublishVolume",
            ]
        } else {
            &["NodeStageVolume", "NodePublishVolume"]
        };
        assert_eq!(bench.plugin.calls(), from_there, "{policy:?}");
        drop(provider);
        assert_eq!(state_on_disk(&bench, &id).await, VolumeState::Published);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ensure_all_republishes_only_a_volume_unmounted_behind_the_providers_back() {
    let bench = Bench::new().await;
    let provider = bench.provider(UnpublishPolicy::LastUse).await;
    let mut ids = Vec::new();
    for name in ["a", "b", "c"] {
        let r = provider
            .create_volume(CreateSpec::new(name, 1 << 20))
            .await
            .unwrap();
        let id = r.disk.unwrap().source.unwrap().id.unwrap();
        provider
            .publish(&id, &format!("user-{name}"))
            .await
            .unwrap();
        ids.push(id);
    }
    bench.plugin.calls();
    // Someone unmounts b's target: the next launch finds and repairs it, and only it.
    bench
        .sys
        .unmount(&provider.mount_point(&ids[1]), false)
        .unwrap();
    let failures = provider.ensure_in_use(&HashSet::new()).await;
    assert!(failures.is_empty(), "{failures:?}");
    // Re-staged (idempotent: the staging mount may have gone too) and re-published.
    assert_eq!(
        bench.plugin.calls(),
        ["NodeStageVolume", "NodePublishVolume"]
    );
    for id in &ids {
        assert!(bench.sys.is_mount_root(&provider.mount_point(id)).unwrap());
    }
    // With everything mounted, a sweep calls nothing.
    provider.ensure_in_use(&HashSet::new()).await;
    assert!(bench.plugin.calls().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_keeps_published_volumes_and_their_users_without_a_call() {
    let bench = Bench::new().await;
    let provider = bench.provider(UnpublishPolicy::LastUse).await;
    let r = provider
        .create_volume(CreateSpec::new("data", 1 << 20))
        .await
        .unwrap();
    let id = r.disk.unwrap().source.unwrap().id.unwrap();
    provider.publish(&id, "c1").await.unwrap();
    drop(provider);
    bench.plugin.calls();

    let restarted = bench.provider(UnpublishPolicy::LastUse).await;
    let rec = restarted.volume(&id).await.unwrap();
    assert_eq!(rec.state, VolumeState::Published);
    assert_eq!(rec.users.iter().collect::<Vec<_>>(), ["c1"]);
    assert!(
        !bench.plugin.calls().contains(&"NodePublishVolume"),
        "nothing to repair"
    );
    // Destroy of a volume in use is refused; after its release it is deleted in the plugin.
    assert!(restarted.destroy_volume(&id).await.is_err());
    restarted.release(&id, "c1").await.unwrap();
    restarted.destroy_volume(&id).await.unwrap();
    assert!(bench.plugin.calls().ends_with(&["DeleteVolume"]));
    assert!(bench.plugin.volumes.lock().unwrap().is_empty());
    assert!(restarted.volume(&id).await.is_none());
}

/// A plugin whose refusal echoes the secrets it got: the error the provider returns (and logs)
/// has their values redacted, and still says what the plugin said otherwise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_that_echoes_secrets_is_shown_redacted() {
    let bench = Bench::new().await;
    let file = bench.work.parent().unwrap().join("secrets.json");
    std::fs::write(
        &file,
        r#"{"node_stage": {"password": "hunter2-echoed", "user": "svc"}}"#,
    )
    .unwrap();
    std::fs::set_permissions(&file, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let provider = bench.provider(UnpublishPolicy::LastUse).await;
    let mut spec = CreateSpec::new("data", 1 << 20);
    spec.secrets_file = Some(file);
    let resource = provider.create_volume(spec).await.unwrap();
    let id = resource.disk.unwrap().source.unwrap().id.unwrap();
    *bench.plugin.fail.lock().unwrap() = Some(("NodeStageVolume", 1));
    let err = provider.publish(&id, "c1").await.unwrap_err();
    let text = crate::error_chain::full_message(&err);
    assert!(
        text.contains("NodeStageVolume refused by the test (got <redacted>, <redacted>)"),
        "{text}"
    );
    assert!(!text.contains("hunter2") && !text.contains("svc"), "{text}");
}

/// SINGLE_NODE_SINGLE_WRITER and SINGLE_NODE_MULTI_WRITER need the node's SINGLE_NODE_MULTI_WRITER,
/// which this plugin does not offer: refused naming the mode and the plugin, before any intent is
/// written or CreateVolume sent; the other modes are sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_node_multi_writer_modes_need_the_plugins_capability() {
    let bench = Bench::new().await;
    let provider = bench.provider(UnpublishPolicy::LastUse).await;
    for mode in ["SINGLE_NODE_SINGLE_WRITER", "SINGLE_NODE_MULTI_WRITER"] {
        let mut spec = CreateSpec::new("data", 1 << 20);
        spec.capability.set_access_mode(mode).unwrap();
        let err = provider.create_volume(spec).await.unwrap_err();
        assert!(
            matches!(err, ProviderError::AccessModeUnsupported { .. }),
            "{err:?}"
        );
        let text = err.to_string();
        assert!(
            text.contains(mode) && text.contains("recorder.csi-isolator.io/unit"),
            "{text}"
        );
        assert!(bench.plugin.calls().is_empty(), "nothing sent for {mode}");
        assert!(provider.find_by_name("data").await.is_none());
    }
    let mut spec = CreateSpec::new("data", 1 << 20);
    spec.capability
        .set_access_mode("MULTI_NODE_SINGLE_WRITER")
        .unwrap();
    provider.create_volume(spec).await.unwrap();
    assert_eq!(bench.plugin.calls(), ["CreateVolume"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_controller_apart_controller_rpcs_go_to_it_and_node_rpcs_to_the_node_plugin() {
    let node = Bench::new().await;
    let controller = Bench::new().await;
    let provider = node.provider_split(&controller).await;
    assert_eq!(provider.controller().endpoint(), controller.endpoint);
    assert_eq!(provider.client().endpoint(), node.endpoint);
    // Each plugin was asked only for its own service's capabilities, and the driver's are joined.
    let caps = provider.capabilities();
    assert!(caps.controller.publish_unpublish_volume());
    assert!(caps.node.stage_unstage_volume());
    assert!(provider
        .controller()
        .current_capabilities()
        .node
        .iter()
        .next()
        .is_none());
    assert!(provider
        .client()
        .current_capabilities()
        .controller
        .iter()
        .next()
        .is_none());

    let resource = provider
        .create_volume(CreateSpec::new("data", 1 << 20))
        .await
        .unwrap();
    let id = resource.disk.unwrap().source.unwrap().id.unwrap();
    assert_eq!(controller.plugin.calls(), ["CreateVolume"]);
    assert!(node.plugin.calls().is_empty());

    provider.publish(&id, "c1").await.unwrap();
    assert_eq!(controller.plugin.calls(), ["ControllerPublishVolume"]);
    assert_eq!(
        node.plugin.calls(),
        ["NodeGetInfo", "NodeStageVolume", "NodePublishVolume"],
        "the node id comes from the node plugin"
    );

    provider.release(&id, "c1").await.unwrap();
    assert_eq!(controller.plugin.calls(), ["ControllerUnpublishVolume"]);
    assert_eq!(
        node.plugin.calls(),
        ["NodeUnpublishVolume", "NodeUnstageVolume"]
    );

    provider.destroy_volume(&id).await.unwrap();
    assert_eq!(controller.plugin.calls(), ["DeleteVolume"]);
    assert!(node.plugin.calls().is_empty());

    // Both clients count into one set of metrics.
    assert!(Arc::ptr_eq(
        &provider.client().metrics(),
        &provider.controller().metrics()
    ));
    let counted = provider.client().metrics().snapshot();
    for rpc in ["CreateVolume", "ControllerPublishVolume", "NodeStageVolume"] {
        assert_eq!(counted[rpc].finished, 1, "{rpc}: {counted:?}");
    }
}

/// A mount watch the test scripts: each look returns the next queued answer, then "nothing".
#[derive(Debug, Default)]
struct ScriptedWatch(Mutex<std::collections::VecDeque<crate::mount::MountChanges>>);

impl ScriptedWatch {
    fn then(&self, changes: crate::mount::MountChanges) {
        self.0.lock().unwrap().push_back(changes);
    }
}

impl crate::mount::MountWatch for Arc<ScriptedWatch> {
    fn mode(&self) -> crate::mount::WatchMode {
        crate::mount::WatchMode::Fanotify
    }
    fn changes(&self) -> crate::mount::MountChanges {
        self.0
            .lock()
            .unwrap()
            .pop_front()
            .unwrap_or(crate::mount::MountChanges::Nothing)
    }
}

/// The fake table, counting the mount checks (statx, on the real one) asked of it.
#[derive(Debug)]
struct CountingTable {
    inner: Arc<FakeSyscall>,
    checks: std::sync::atomic::AtomicUsize,
}

impl CountingTable {
    fn taken(&self) -> usize {
        self.checks.swap(0, std::sync::atomic::Ordering::SeqCst)
    }
}

impl MountTable for CountingTable {
    fn mounts(&self) -> Result<Vec<crate::mount::MountInfo>, crate::mount::MountError> {
        self.inner.mounts()
    }
    fn is_mount_root(&self, path: &Path) -> Result<bool, crate::mount::MountError> {
        self.checks
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.inner.is_mount_root(path)
    }
    fn check_mount_root(
        &self,
        path: &Path,
    ) -> Result<crate::mount::RootCheck, crate::mount::MountError> {
        self.checks
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.inner.check_mount_root(path)
    }
}

impl Bench {
    /// A provider under last-use whose mount watch and mount checks the test holds.
    /// Unmounts `target` as someone else would, returning the unique id of the mount it was
    /// (what the kernel's watch would report detached).
    fn unmount_behind_the_back(&self, target: &std::path::Path) -> u64 {
        let id = self
            .sys
            .check_mount_root(target)
            .unwrap()
            .unique_id
            .unwrap();
        self.sys.unmount(target, false).unwrap();
        id
    }

    async fn watched_provider(
        &self,
    ) -> (Arc<StorageProvider>, Arc<ScriptedWatch>, Arc<CountingTable>) {
        let mut config = ProviderConfig::new(
            "recorder.csi-isolator.io",
            "unit",
            &self.work,
            PluginSource::Endpoint(self.endpoint.clone()),
        );
        config.boot_id = Some("boot-1".into());
        let watch = Arc::new(ScriptedWatch::default());
        let table = Arc::new(CountingTable {
            inner: self.sys.clone(),
            checks: Default::default(),
        });
        let provider = StorageProvider::start_watched(
            config,
            self.sys.clone(),
            table.clone(),
            Box::new(watch.clone()),
        )
        .await
        .expect("start the provider with a scripted watch");
        (provider, watch, table)
    }
}

/// `n` volumes, each published for its own user; their ids.
async fn volumes_in_use(provider: &StorageProvider, n: usize) -> Vec<String> {
    let mut ids = Vec::new();
    for i in 0..n {
        let r = provider
            .create_volume(CreateSpec::new(format!("v{i}"), 1 << 20))
            .await
            .unwrap();
        let id = r.disk.unwrap().source.unwrap().id.unwrap();
        provider.publish(&id, &format!("user-{i}")).await.unwrap();
        ids.push(id);
    }
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_watch_ensure_all_checks_only_the_volumes_whose_mount_was_detached() {
    let bench = Bench::new().await;
    let (provider, watch, table) = bench.watched_provider().await;
    let ids = volumes_in_use(&provider, 4).await;
    // Each publish learnt its mount.
    assert_eq!(table.taken(), 4);
    // The first sweep after a start knows nothing yet: it checks every volume in use.
    provider.ensure_in_use(&HashSet::new()).await;
    assert_eq!(table.taken(), 4);
    bench.plugin.calls();
    // Nothing changed: no check at all.
    assert!(provider.ensure_in_use(&HashSet::new()).await.is_empty());
    assert_eq!(table.taken(), 0);
    // A foreign mount goes (an id none of ours has): still nothing.
    watch.then(crate::mount::MountChanges::Detached(vec![999_999]));
    provider.ensure_in_use(&HashSet::new()).await;
    assert_eq!(table.taken(), 0);
    // Someone unmounts volume 2's target: the watch names its mount, the sweep checks it alone
    // and repairs it.
    let target = provider.mount_point(&ids[2]);
    let id = bench.unmount_behind_the_back(&target);
    watch.then(crate::mount::MountChanges::Detached(vec![999_998, id]));
    assert!(provider.ensure_in_use(&HashSet::new()).await.is_empty());
    assert_eq!(
        bench.plugin.calls(),
        ["NodeStageVolume", "NodePublishVolume"]
    );
    // One check of volume 2, one more to learn its new mount.
    assert_eq!(table.taken(), 2);
    for id in &ids {
        assert!(bench.sys.is_mount_root(&provider.mount_point(id)).unwrap());
    }
    // Its new mount is known: unmounted again, it is found again.
    let again = bench.unmount_behind_the_back(&target);
    assert_ne!(again, id);
    watch.then(crate::mount::MountChanges::Detached(vec![again]));
    provider.ensure_in_use(&HashSet::new()).await;
    assert_eq!(
        bench.plugin.calls(),
        ["NodeStageVolume", "NodePublishVolume"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_that_cannot_say_what_changed_makes_the_sweep_check_everything() {
    let bench = Bench::new().await;
    let (provider, watch, table) = bench.watched_provider().await;
    let ids = volumes_in_use(&provider, 3).await;
    provider.ensure_in_use(&HashSet::new()).await;
    table.taken();
    bench.plugin.calls();
    // An unmount the watch lost (an overflow): "unknown" checks all three and repairs the one.
    bench
        .sys
        .unmount(&provider.mount_point(&ids[0]), false)
        .unwrap();
    watch.then(crate::mount::MountChanges::Unknown);
    assert!(provider.ensure_in_use(&HashSet::new()).await.is_empty());
    assert_eq!(
        bench.plugin.calls(),
        ["NodeStageVolume", "NodePublishVolume"]
    );
    assert!(table.taken() >= 3);
    assert!(bench
        .sys
        .is_mount_root(&provider.mount_point(&ids[0]))
        .unwrap());
    // And the sweep after it knows every mount again: nothing to check.
    provider.ensure_in_use(&HashSet::new()).await;
    assert_eq!(table.taken(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_busy_or_skipped_during_a_sweep_stays_marked_for_the_next() {
    let bench = Bench::new().await;
    let (provider, watch, table) = bench.watched_provider().await;
    let ids = volumes_in_use(&provider, 2).await;
    provider.ensure_in_use(&HashSet::new()).await;
    table.taken();
    bench.plugin.calls();
    let target = provider.mount_point(&ids[1]);
    let id = bench.unmount_behind_the_back(&target);
    watch.then(crate::mount::MountChanges::Detached(vec![id]));
    // The launch that reads the detach is the one publishing volume 1 itself (skipped)...
    let skip: HashSet<&str> = [ids[1].as_str()].into();
    provider.ensure_in_use(&skip).await;
    assert!(bench.plugin.calls().is_empty());
    // ...then an operation holds it during the next sweep...
    {
        let slot = provider.slot(&ids[1]).unwrap();
        let _busy = slot.record.lock().await;
        provider.ensure_in_use(&HashSet::new()).await;
        assert!(bench.plugin.calls().is_empty());
    }
    // ...and the one after repairs it.
    assert!(provider.ensure_in_use(&HashSet::new()).await.is_empty());
    assert_eq!(
        bench.plugin.calls(),
        ["NodeStageVolume", "NodePublishVolume"]
    );
    assert!(bench.sys.is_mount_root(&target).unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_repair_is_retried_by_the_next_launch_without_a_new_event() {
    let bench = Bench::new().await;
    let (provider, watch, table) = bench.watched_provider().await;
    let ids = volumes_in_use(&provider, 2).await;
    provider.ensure_in_use(&HashSet::new()).await;
    table.taken();
    bench.plugin.calls();
    let target = provider.mount_point(&ids[0]);
    let id = bench.unmount_behind_the_back(&target);
    watch.then(crate::mount::MountChanges::Detached(vec![id]));
    *bench.plugin.fail.lock().unwrap() = Some(("NodePublishVolume", 1));
    let failures = provider.ensure_in_use(&HashSet::new()).await;
    assert_eq!(failures.len(), 1, "{failures:?}");
    bench.plugin.calls();
    // No event this time: the provider's own mark brings it back.
    assert!(provider.ensure_in_use(&HashSet::new()).await.is_empty());
    assert!(bench.plugin.calls().contains(&"NodePublishVolume"));
    assert!(bench.sys.is_mount_root(&target).unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_launchs_own_volume_stays_watched_across_the_full_sweep_after_a_start() {
    let bench = Bench::new().await;
    let (provider, watch, _table) = bench.watched_provider().await;
    let mut ids = Vec::new();
    for name in ["a", "b"] {
        let r = provider
            .create_volume(CreateSpec::new(name, 1 << 20))
            .await
            .unwrap();
        ids.push(r.disk.unwrap().source.unwrap().id.unwrap());
    }
    // The first launch publishes a; its sweep is the full one after the start, which skips a.
    provider
        .publish_for_container("c1", std::slice::from_ref(&ids[0]))
        .await
        .unwrap();
    bench.plugin.calls();
    let target = provider.mount_point(&ids[0]);
    let id = bench.unmount_behind_the_back(&target);
    watch.then(crate::mount::MountChanges::Detached(vec![id]));
    provider
        .publish_for_container("c2", std::slice::from_ref(&ids[1]))
        .await
        .unwrap();
    assert!(bench.sys.is_mount_root(&target).unwrap(), "a repaired");
}

/// What the release's and the destroy's removals leave: an empty directory goes (so does a
/// missing one), content and anything but a directory stay; the answer says whether the path is
/// free for the directory to be made again.
#[test]
fn remove_empty_dir_removes_only_an_empty_directory() {
    use super::storage::remove_empty_dir;
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    assert!(remove_empty_dir(&empty));
    assert!(!empty.exists());
    assert!(remove_empty_dir(&empty), "already gone");

    let full = dir.path().join("full");
    std::fs::create_dir(&full).unwrap();
    std::fs::write(full.join("data"), b"kept").unwrap();
    assert!(!remove_empty_dir(&full));
    assert_eq!(std::fs::read(full.join("data")).unwrap(), b"kept");

    let file = dir.path().join("file");
    std::fs::write(&file, b"left by a plugin").unwrap();
    assert!(!remove_empty_dir(&file));
    assert_eq!(std::fs::read(&file).unwrap(), b"left by a plugin");
}
