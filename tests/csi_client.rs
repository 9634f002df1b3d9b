//! `csi::Client` against the real `csi-test-plugin` binary over a real Unix
//! socket: every RPC of a volume's lifecycle, capability discovery, retries
//! (UNAVAILABLE retried, DEADLINE_EXCEEDED exhausting the budget, final codes
//! not retried), waiting for a late socket, surviving a plugin restart, and
//! the call metrics.

use csi_isolator_testing::plugin_bin;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use csi_isolator::csi::proto::{self, volume_capability};
use csi_isolator::csi::{
    Client, ClientOptions, ControllerRpc, NodeRpc, PluginService, RetryPolicy, RpcStats,
};
use tonic::Code;

use csi_isolator_testing::{require_root, PluginProcess, Sandbox};

fn fast_retries() -> ClientOptions {
    ClientOptions {
        deadline: Duration::from_secs(10),
        connect_timeout: Duration::from_secs(10),
        retry: RetryPolicy {
            max_attempts: 5,
            initial_backoff: Duration::from_millis(20),
            max_backoff: Duration::from_millis(200),
            max_total: Duration::from_secs(20),
            multiplier: 2.0,
        },
    }
}

fn mount_capability() -> proto::VolumeCapability {
    csi_isolator_testing::mount_capability(volume_capability::access_mode::Mode::SingleNodeWriter)
}

/// Starts the plugin (node id `node-1`, calls logged) and waits until it is ready.
async fn start_plugin(sandbox: &Sandbox, args: &[&str]) -> PluginProcess {
    let mut all = vec!["--node-id", "node-1"];
    all.extend_from_slice(args);
    PluginProcess::start(sandbox, plugin_bin(), &all).await
}

fn stats(client: &Client) -> BTreeMap<&'static str, RpcStats> {
    client.metrics().snapshot()
}

/// (finished, failed, cancelled, retries, pending) of one RPC.
fn outcome(client: &Client, rpc: &str) -> (u64, u64, u64, u64, u64) {
    let s = &stats(client)[rpc];
    (s.finished, s.failed, s.cancelled, s.retries, s.pending)
}

fn is_mountpoint(sandbox: &Sandbox, path: &Path) -> bool {
    sandbox.mounts_under().iter().any(|m| m.mount_point == path)
}

/// Paths the CO owns for one volume: the staging dir (created by the CO) and
/// the publish target (its parent created by the CO, itself by the plugin).
struct VolumePaths {
    staging: PathBuf,
    target: PathBuf,
}

impl VolumePaths {
    fn new(sandbox: &Sandbox, name: &str) -> Self {
        let base = sandbox.mkdir(Path::new("mounts").join(name));
        Self {
            staging: sandbox.mkdir(base.join("staging")),
            target: base.join("target"),
        }
    }
}

async fn create(client: &Client, name: &str) -> proto::Volume {
    client
        .create_volume(proto::CreateVolumeRequest {
            name: name.to_string(),
            capacity_range: Some(proto::CapacityRange {
                required_bytes: 1 << 20,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![mount_capability()],
            ..Default::default()
        })
        .await
        .expect("CreateVolume")
        .volume
        .expect("CreateVolume returns a volume")
}

async fn stage(
    client: &Client,
    volume: &proto::Volume,
    paths: &VolumePaths,
    publish_context: BTreeMap<String, String>,
) {
    client
        .node_stage_volume(proto::NodeStageVolumeRequest {
            volume_id: volume.volume_id.clone(),
            publish_context: publish_context.into_iter().collect(),
            staging_target_path: paths.staging.display().to_string(),
            volume_capability: Some(mount_capability()),
            volume_context: volume.volume_context.clone(),
            ..Default::default()
        })
        .await
        .expect("NodeStageVolume");
}

fn publish_request(
    volume: &proto::Volume,
    paths: &VolumePaths,
    staged: bool,
) -> proto::NodePublishVolumeRequest {
    proto::NodePublishVolumeRequest {
        volume_id: volume.volume_id.clone(),
        staging_target_path: if staged {
            paths.staging.display().to_string()
        } else {
            String::new()
        },
        target_path: paths.target.display().to_string(),
        volume_capability: Some(mount_capability()),
        volume_context: volume.volume_context.clone(),
        ..Default::default()
    }
}

#[tokio::test]
async fn full_lifecycle_exercises_every_rpc() {
    require_root();
    let sandbox = Sandbox::new("csi-client-lifecycle");
    let plugin = start_plugin(
        &sandbox,
        &["--name", "lifecycle.csi.test", "--capacity", "1G"],
    )
    .await;
    let client = Client::connect(&plugin.endpoint(), fast_retries())
        .await
        .unwrap();

    // Identity.
    let info = client
        .get_plugin_info(proto::GetPluginInfoRequest {})
        .await
        .unwrap();
    assert_eq!(info.name, "lifecycle.csi.test");
    let probe = client.probe(proto::ProbeRequest {}).await.unwrap();
    assert_ne!(probe.ready, Some(false));
    let caps = client.current_capabilities();
    assert!(caps.plugin.controller_service());
    assert!(caps.plugin.has(PluginService::ControllerService));
    assert!(caps.controller.create_delete_volume());
    assert!(caps.controller.publish_unpublish_volume());
    assert!(caps.controller.has(ControllerRpc::PublishUnpublishVolume));
    assert!(caps.node.stage_unstage_volume());
    assert!(caps.node.contains(NodeRpc::StageUnstageVolume));

    // Capacity before and after creating.
    let capacity = |c: &Client| {
        let c = c.clone();
        async move {
            c.get_capacity(proto::GetCapacityRequest {
                volume_capabilities: vec![mount_capability()],
                ..Default::default()
            })
            .await
            .unwrap()
            .available_capacity
        }
    };
    assert_eq!(capacity(&client).await, 1 << 30);

    let volume = create(&client, "lifecycle").await;
    assert!(!volume.volume_id.is_empty());
    assert!(volume.capacity_bytes >= 1 << 20);
    assert_eq!(capacity(&client).await, (1 << 30) - volume.capacity_bytes);

    let validated = client
        .validate_volume_capabilities(proto::ValidateVolumeCapabilitiesRequest {
            volume_id: volume.volume_id.clone(),
            volume_context: volume.volume_context.clone(),
            volume_capabilities: vec![mount_capability()],
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(
        validated.confirmed.is_some(),
        "mount capability not confirmed: {}",
        validated.message
    );

    let listed = client
        .list_volumes(proto::ListVolumesRequest::default())
        .await
        .unwrap();
    let ids: Vec<_> = listed
        .entries
        .iter()
        .filter_map(|e| e.volume.as_ref())
        .map(|v| v.volume_id.clone())
        .collect();
    assert_eq!(ids, vec![volume.volume_id.clone()]);

    // Publish, all the way to a mounted target.
    let node = client
        .node_get_info(proto::NodeGetInfoRequest {})
        .await
        .unwrap();
    assert_eq!(node.node_id, "node-1");
    let published = client
        .controller_publish_volume(proto::ControllerPublishVolumeRequest {
            volume_id: volume.volume_id.clone(),
            node_id: node.node_id.clone(),
            volume_capability: Some(mount_capability()),
            volume_context: volume.volume_context.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    let paths = VolumePaths::new(&sandbox, "lifecycle");
    stage(
        &client,
        &volume,
        &paths,
        published.publish_context.clone().into_iter().collect(),
    )
    .await;
    assert!(
        is_mountpoint(&sandbox, &paths.staging),
        "staging path not mounted"
    );
    let mut publish = publish_request(&volume, &paths, true);
    publish.publish_context = published.publish_context.clone();
    client.node_publish_volume(publish).await.unwrap();
    assert!(
        is_mountpoint(&sandbox, &paths.target),
        "target path not mounted"
    );
    std::fs::write(paths.target.join("hello"), b"world").unwrap();
    assert_eq!(
        std::fs::read(paths.staging.join("hello")).unwrap(),
        b"world"
    );

    let volume_stats = client
        .node_get_volume_stats(proto::NodeGetVolumeStatsRequest {
            volume_id: volume.volume_id.clone(),
            volume_path: paths.target.display().to_string(),
            staging_target_path: paths.staging.display().to_string(),
        })
        .await
        .unwrap();
    assert!(
        volume_stats
            .usage
            .iter()
            .any(|u| u.unit == proto::volume_usage::Unit::Bytes as i32 && u.total > 0),
        "no byte usage reported"
    );

    // And back down.
    client
        .node_unpublish_volume(proto::NodeUnpublishVolumeRequest {
            volume_id: volume.volume_id.clone(),
            target_path: paths.target.display().to_string(),
        })
        .await
        .unwrap();
    assert!(!is_mountpoint(&sandbox, &paths.target));
    client
        .node_unstage_volume(proto::NodeUnstageVolumeRequest {
            volume_id: volume.volume_id.clone(),
            staging_target_path: paths.staging.display().to_string(),
        })
        .await
        .unwrap();
    assert!(!is_mountpoint(&sandbox, &paths.staging));
    client
        .controller_unpublish_volume(proto::ControllerUnpublishVolumeRequest {
            volume_id: volume.volume_id.clone(),
            node_id: node.node_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    client
        .delete_volume(proto::DeleteVolumeRequest {
            volume_id: volume.volume_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    let listed = client
        .list_volumes(proto::ListVolumesRequest::default())
        .await
        .unwrap();
    assert!(
        listed.entries.is_empty(),
        "volume still listed after DeleteVolume"
    );
    assert_eq!(capacity(&client).await, 1 << 30);
    sandbox.assert_no_mounts_under();

    // The plugin saw the lifecycle in order.
    let id = &volume.volume_id;
    let seen: Vec<String> = plugin
        .calls()
        .into_iter()
        .filter(|l| l.ends_with(&format!(" {id}")))
        .collect();
    let want: Vec<String> = [
        "ValidateVolumeCapabilities",
        "ControllerPublishVolume",
        "NodeStageVolume",
        "NodePublishVolume",
        "NodeGetVolumeStats",
        "NodeUnpublishVolume",
        "NodeUnstageVolume",
        "ControllerUnpublishVolume",
        "DeleteVolume",
    ]
    .iter()
    .map(|rpc| format!("{rpc} {id}"))
    .collect();
    assert_eq!(seen, want);

    // Metrics: every call counted once, none failed, retried or in flight.
    let snap = stats(&client);
    for (rpc, n) in [
        ("GetPluginInfo", 1),
        ("GetPluginCapabilities", 1),
        ("ControllerGetCapabilities", 1),
        ("NodeGetCapabilities", 1),
        ("Probe", 2),
        ("GetCapacity", 3),
        ("CreateVolume", 1),
        ("ValidateVolumeCapabilities", 1),
        ("ListVolumes", 2),
        ("NodeGetInfo", 1),
        ("ControllerPublishVolume", 1),
        ("NodeStageVolume", 1),
        ("NodePublishVolume", 1),
        ("NodeGetVolumeStats", 1),
        ("NodeUnpublishVolume", 1),
        ("NodeUnstageVolume", 1),
        ("ControllerUnpublishVolume", 1),
        ("DeleteVolume", 1),
    ] {
        assert_eq!(snap[rpc].finished, n, "{rpc} finished");
        assert_eq!(snap[rpc].latency.count, n, "{rpc} latency observations");
    }
    // What the client counted is what the plugin received.
    let received = plugin
        .calls()
        .iter()
        .filter(|l| *l == "GetCapacity -")
        .count();
    assert_eq!(received, 3, "GetCapacity calls received by the plugin");
    for (rpc, s) in &snap {
        assert_eq!(
            (s.failed, s.cancelled, s.retries, s.pending),
            (0, 0, 0, 0),
            "{rpc}"
        );
    }
}

#[tokio::test]
async fn capability_switches_are_reflected() {
    let cases: [(&[&str], bool, bool, bool); 4] = [
        // flags, controller service, controller publish, node stage
        (&[], true, true, true),
        (&["--no-stage"], true, true, false),
        (&["--no-controller-publish"], true, false, true),
        (&["--no-controller"], false, false, true),
    ];
    for (flags, controller, publish, stage) in cases {
        let sandbox = Sandbox::new("csi-client-caps");
        let plugin = start_plugin(&sandbox, flags).await;
        let client = Client::connect(&plugin.endpoint(), fast_retries())
            .await
            .unwrap();
        let caps = client.current_capabilities();
        assert_eq!(caps.plugin.controller_service(), controller, "{flags:?}");
        assert_eq!(
            caps.controller.publish_unpublish_volume(),
            publish,
            "{flags:?}"
        );
        assert_eq!(caps.node.stage_unstage_volume(), stage, "{flags:?}");
        assert_eq!(
            caps.controller.create_delete_volume(),
            controller,
            "{flags:?}"
        );
        // Without the controller service, ControllerGetCapabilities is never asked.
        let asked = u64::from(controller);
        assert_eq!(
            stats(&client)["ControllerGetCapabilities"].finished,
            asked,
            "{flags:?}"
        );
        let controller_calls = plugin
            .calls()
            .iter()
            .filter(|l| l.starts_with("ControllerGetCapabilities"))
            .count();
        assert_eq!(controller_calls as u64, asked, "{flags:?}");

        // A dropped capability really is gone, and the error says so.
        if !stage {
            let err = client
                .node_stage_volume(proto::NodeStageVolumeRequest {
                    volume_id: "vol-x".into(),
                    staging_target_path: sandbox.mkdir("s").display().to_string(),
                    volume_capability: Some(mount_capability()),
                    ..Default::default()
                })
                .await
                .unwrap_err();
            assert_eq!(err.code(), Some(Code::Unimplemented), "{err}");
            assert_eq!(err.attempts(), 1);
            assert!(
                err.to_string()
                    .starts_with("NodeStageVolume of volume 'vol-x' failed: UNIMPLEMENTED"),
                "{err}"
            );
        }
        if !publish {
            let err = client
                .controller_publish_volume(proto::ControllerPublishVolumeRequest {
                    volume_id: "vol-y".into(),
                    node_id: "node-1".into(),
                    volume_capability: Some(mount_capability()),
                    ..Default::default()
                })
                .await
                .unwrap_err();
            assert_eq!(err.code(), Some(Code::Unimplemented), "{err}");
        }

        // refresh_capabilities asks again, through a clone, and finds the same; every clone
        // sees what it found.
        let again = client.clone().refresh_capabilities().await.unwrap();
        assert_eq!(again, caps, "{flags:?}");
        assert!(Arc::ptr_eq(&again, &client.current_capabilities()));
        assert_eq!(stats(&client)["GetPluginCapabilities"].finished, 2);
        assert_eq!(
            stats(&client)["ControllerGetCapabilities"].finished,
            2 * asked,
            "{flags:?}"
        );
    }
}

#[tokio::test]
async fn unavailable_is_retried_until_it_succeeds() {
    require_root();
    let sandbox = Sandbox::new("csi-client-retried");
    let plugin = start_plugin(
        &sandbox,
        &[
            "--fail",
            "NodePublishVolume=UNAVAILABLE:2",
            "--no-controller-publish",
        ],
    )
    .await;
    let client = Client::connect(&plugin.endpoint(), fast_retries())
        .await
        .unwrap();
    let volume = create(&client, "retried").await;
    let paths = VolumePaths::new(&sandbox, "retried");
    stage(&client, &volume, &paths, BTreeMap::new()).await;

    client
        .node_publish_volume(publish_request(&volume, &paths, true))
        .await
        .unwrap();
    assert!(is_mountpoint(&sandbox, &paths.target));

    // One call, finished, after three attempts (two retries).
    assert_eq!(outcome(&client, "NodePublishVolume"), (1, 0, 0, 2, 0));
    let publishes = plugin
        .calls()
        .iter()
        .filter(|l| l.starts_with("NodePublishVolume "))
        .count();
    assert_eq!(publishes, 3);

    client
        .node_unpublish_volume(proto::NodeUnpublishVolumeRequest {
            volume_id: volume.volume_id.clone(),
            target_path: paths.target.display().to_string(),
        })
        .await
        .unwrap();
    client
        .node_unstage_volume(proto::NodeUnstageVolumeRequest {
            volume_id: volume.volume_id.clone(),
            staging_target_path: paths.staging.display().to_string(),
        })
        .await
        .unwrap();
    sandbox.assert_no_mounts_under();
}

#[tokio::test]
async fn unavailable_that_persists_exhausts_the_attempts() {
    let sandbox = Sandbox::new("csi-client-exhausted");
    let plugin = start_plugin(&sandbox, &["--fail", "NodeGetInfo=UNAVAILABLE"]).await;
    let client = Client::connect(&plugin.endpoint(), fast_retries())
        .await
        .unwrap();
    let err = client
        .node_get_info(proto::NodeGetInfoRequest {})
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(Code::Unavailable));
    assert_eq!(err.attempts(), 5);
    assert_eq!(err.rpc(), Some("NodeGetInfo"));
    let msg = err.to_string();
    assert!(
        msg.starts_with("NodeGetInfo failed: UNAVAILABLE: "),
        "{msg}"
    );
    assert!(msg.ends_with(" (after 5 attempts)"), "{msg}");
    assert_eq!(outcome(&client, "NodeGetInfo"), (0, 1, 0, 4, 0));
    assert_eq!(
        plugin
            .calls()
            .iter()
            .filter(|l| l.starts_with("NodeGetInfo "))
            .count(),
        5
    );
}

#[tokio::test]
async fn deadline_exceeded_exhausts_the_retries() {
    let sandbox = Sandbox::new("csi-client-deadline");
    let plugin = start_plugin(&sandbox, &["--delay", "GetCapacity=3000"]).await;
    let options = ClientOptions {
        deadline: Duration::from_millis(200),
        retry: RetryPolicy {
            max_attempts: 3,
            ..fast_retries().retry
        },
        ..fast_retries()
    };
    let client = Client::connect(&plugin.endpoint(), options).await.unwrap();
    let started = Instant::now();
    let err = client
        .get_capacity(proto::GetCapacityRequest::default())
        .await
        .unwrap_err();
    let elapsed = started.elapsed();
    assert_eq!(err.code(), Some(Code::DeadlineExceeded), "{err}");
    assert_eq!(err.attempts(), 3);
    assert!(
        err.to_string()
            .starts_with("GetCapacity failed: DEADLINE_EXCEEDED: "),
        "{err}"
    );
    assert!(err.to_string().ends_with(" (after 3 attempts)"), "{err}");
    // Three cut-off attempts, not three full plugin delays.
    assert!(elapsed >= Duration::from_millis(600), "{elapsed:?}");
    assert!(elapsed < Duration::from_millis(2500), "{elapsed:?}");
    assert_eq!(outcome(&client, "GetCapacity"), (0, 1, 0, 2, 0));
    // The plugin saw every attempt.
    let received = plugin
        .calls()
        .iter()
        .filter(|l| l.starts_with("GetCapacity "))
        .count();
    assert_eq!(received, 3);
}

#[tokio::test]
async fn no_call_outlives_the_retry_budget() {
    let sandbox = Sandbox::new("csi-client-budget");
    let plugin = start_plugin(&sandbox, &["--delay", "GetCapacity=5000"]).await;
    let options = ClientOptions {
        deadline: Duration::from_secs(3),
        retry: RetryPolicy {
            max_total: Duration::from_millis(700),
            ..fast_retries().retry
        },
        ..fast_retries()
    };
    let client = Client::connect(&plugin.endpoint(), options).await.unwrap();
    let started = Instant::now();
    let err = client
        .get_capacity(proto::GetCapacityRequest::default())
        .await
        .unwrap_err();
    let elapsed = started.elapsed();
    assert_eq!(err.code(), Some(Code::DeadlineExceeded), "{err}");
    // Cut at the 700ms budget, not after a full 3s deadline.
    assert!(elapsed >= Duration::from_millis(650), "{elapsed:?}");
    assert!(elapsed < Duration::from_millis(1500), "{elapsed:?}");
    // The attempt's deadline was cut to what was left of the budget (just under 700ms).
    let msg = err.to_string();
    assert!(
        msg.contains("no reply within 69") || msg.contains("no reply within 700ms"),
        "{msg}"
    );
}

#[tokio::test]
async fn final_codes_are_not_retried() {
    let sandbox = Sandbox::new("csi-client-final");
    let plugin = start_plugin(&sandbox, &["--fail", "DeleteVolume=INVALID_ARGUMENT"]).await;
    let client = Client::connect(&plugin.endpoint(), fast_retries())
        .await
        .unwrap();
    let err = client
        .delete_volume(proto::DeleteVolumeRequest {
            volume_id: "vol-1".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(Code::InvalidArgument));
    assert_eq!(err.attempts(), 1);
    assert_eq!(err.volume_id(), Some("vol-1"));
    assert_eq!(err.rpc(), Some("DeleteVolume"));
    let msg = err.to_string();
    assert!(
        msg.starts_with("DeleteVolume of volume 'vol-1' failed: INVALID_ARGUMENT"),
        "{msg}"
    );
    assert!(!msg.contains("attempts"), "{msg}");
    let deletes: Vec<_> = plugin
        .calls()
        .into_iter()
        .filter(|l| l.starts_with("DeleteVolume"))
        .collect();
    assert_eq!(deletes, vec!["DeleteVolume vol-1".to_string()]);
    assert_eq!(outcome(&client, "DeleteVolume"), (0, 1, 0, 0, 0));
}

#[tokio::test]
async fn connect_waits_for_a_socket_that_appears_late() {
    let sandbox = Sandbox::new("csi-client-late");
    let endpoint = format!("unix://{}", sandbox.join("plugin/csi.sock").display());
    let started = Instant::now();
    let connecting = tokio::spawn(async move { Client::connect(&endpoint, fast_retries()).await });
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        !connecting.is_finished(),
        "connect returned before the plugin existed"
    );
    let plugin = start_plugin(&sandbox, &[]).await;
    let client = connecting.await.unwrap().expect("connect to a late plugin");
    assert_eq!(client.endpoint(), plugin.endpoint());
    assert!(started.elapsed() >= Duration::from_secs(1));
    assert!(client.current_capabilities().plugin.controller_service());
    client.probe(proto::ProbeRequest {}).await.unwrap();
}

#[tokio::test]
async fn connect_gives_up_naming_the_endpoint() {
    let sandbox = Sandbox::new("csi-client-never");
    let endpoint = format!("unix://{}", sandbox.join("csi.sock").display());
    let options = ClientOptions {
        connect_timeout: Duration::from_millis(500),
        ..fast_retries()
    };
    let err = Client::connect(&endpoint, options).await.unwrap_err();
    assert_eq!(
        err.to_string(),
        format!("connect to {endpoint}: socket did not appear within 500ms")
    );
}

#[tokio::test]
async fn connect_timeout_covers_probe_and_discovery() {
    let sandbox = Sandbox::new("csi-client-slow-probe");
    let faults = sandbox.join("faults");
    std::fs::write(&faults, "").unwrap();
    let faults_arg = faults.display().to_string();
    let plugin = start_plugin(&sandbox, &["--faults-file", &faults_arg]).await;
    // The socket accepts at once, but the plugin takes 5s per Probe.
    std::fs::write(&faults, "delay Probe=5000\n").unwrap();
    let options = ClientOptions {
        connect_timeout: Duration::from_millis(500),
        ..fast_retries()
    };
    let started = Instant::now();
    let err = Client::connect(&plugin.endpoint(), options)
        .await
        .unwrap_err();
    let elapsed = started.elapsed();
    assert!(elapsed >= Duration::from_millis(450), "{elapsed:?}");
    assert!(elapsed < Duration::from_millis(1500), "{elapsed:?}");
    assert_eq!(
        err.to_string(),
        format!(
            "connect to {}: plugin did not answer Probe and capability discovery within 500ms",
            plugin.endpoint()
        )
    );
}

fn patient() -> ClientOptions {
    ClientOptions {
        retry: RetryPolicy {
            max_attempts: 30,
            initial_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_millis(200),
            max_total: Duration::from_secs(30),
            multiplier: 2.0,
        },
        ..fast_retries()
    }
}

#[tokio::test]
async fn survives_a_plugin_restart_on_the_same_socket() {
    let sandbox = Sandbox::new("csi-client-restart");
    let mut plugin = start_plugin(&sandbox, &[]).await;
    let client = Client::connect(&plugin.endpoint(), patient())
        .await
        .unwrap();
    let volume = create(&client, "survivor").await;

    // Killed and restarted between two calls: the old connection is dead.
    plugin.restart().await;
    let listed = client
        .list_volumes(proto::ListVolumesRequest::default())
        .await
        .unwrap();
    assert_eq!(listed.entries.len(), 1);
    assert_eq!(
        listed.entries[0].volume.as_ref().unwrap().volume_id,
        volume.volume_id
    );

    // Killed, called while down, restarted while the call is retrying.
    plugin.kill();
    let calling = {
        let client = client.clone();
        tokio::spawn(async move { client.get_plugin_info(proto::GetPluginInfoRequest {}).await })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !calling.is_finished(),
        "call finished while no plugin was running"
    );
    plugin.restart().await;
    calling
        .await
        .unwrap()
        .expect("GetPluginInfo across a restart");
    let (finished, failed, _, retries, pending) = outcome(&client, "GetPluginInfo");
    assert_eq!((finished, failed, pending), (1, 0, 0));
    assert!(
        retries >= 1,
        "the call was retried while the plugin was down"
    );

    client
        .delete_volume(proto::DeleteVolumeRequest {
            volume_id: volume.volume_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
}

#[tokio::test]
async fn survives_a_plugin_that_dies_during_a_call() {
    let sandbox = Sandbox::new("csi-client-dies");
    let faults = sandbox.join("faults");
    std::fs::write(&faults, "exit-in NodeGetInfo:before\n").unwrap();
    let faults_arg = faults.display().to_string();
    let mut plugin = start_plugin(&sandbox, &["--faults-file", &faults_arg]).await;
    let client = Client::connect(&plugin.endpoint(), patient())
        .await
        .unwrap();

    // The plugin exits with the call in flight; the connection is torn down
    // under it. The call keeps retrying until the plugin is back.
    let calling = {
        let client = client.clone();
        tokio::spawn(async move { client.node_get_info(proto::NodeGetInfoRequest {}).await })
    };
    let status = plugin.wait_exit(Duration::from_secs(10)).await;
    assert_eq!(status.code(), Some(137), "plugin exit: {status}");
    std::fs::write(&faults, "").unwrap();
    plugin.restart().await;
    let info = calling
        .await
        .unwrap()
        .expect("NodeGetInfo across a plugin crash");
    assert_eq!(info.node_id, "node-1");
    let (finished, failed, _, retries, _) = outcome(&client, "NodeGetInfo");
    assert_eq!((finished, failed), (1, 0));
    assert!(retries >= 1);
    // The plugin saw the call twice: once in the process that died, once after.
    assert_eq!(
        plugin
            .calls()
            .iter()
            .filter(|l| l.starts_with("NodeGetInfo "))
            .count(),
        2
    );
}

#[tokio::test]
async fn dropped_calls_count_as_cancelled_and_clones_share_metrics() {
    let sandbox = Sandbox::new("csi-client-metrics");
    let plugin = start_plugin(&sandbox, &["--delay", "NodeGetInfo=2000"]).await;
    let client = Client::connect(&plugin.endpoint(), fast_retries())
        .await
        .unwrap();
    let clone = client.clone();
    let timed_out = tokio::time::timeout(
        Duration::from_millis(100),
        clone.node_get_info(proto::NodeGetInfoRequest {}),
    )
    .await;
    assert!(timed_out.is_err(), "the delayed call returned early");
    assert_eq!(outcome(&client, "NodeGetInfo"), (0, 0, 1, 0, 0));
    assert_eq!(stats(&client)["NodeGetInfo"].latency.count, 0);

    // Many calls in parallel on clones of one client.
    let calls: Vec<_> = (0..32)
        .map(|_| {
            let c = client.clone();
            tokio::spawn(async move { c.probe(proto::ProbeRequest {}).await })
        })
        .collect();
    for call in calls {
        call.await.unwrap().unwrap();
    }
    // 1 probe at connect + 32.
    assert_eq!(outcome(&client, "Probe"), (33, 0, 0, 0, 0));
    let text = client.metrics().encode_prometheus("csi_client");
    assert!(
        text.contains("csi_client_finished_total{rpc=\"Probe\"} 33\n"),
        "{text}"
    );
    assert!(
        text.contains("csi_client_cancelled_total{rpc=\"NodeGetInfo\"} 1\n"),
        "{text}"
    );
}

/// ControllerModifyVolume through the client: MODIFY_VOLUME learnt from the plugin (and not
/// with `--no-modify`), the call made, its outcomes counted under its own RPC name.
#[tokio::test]
async fn controller_modify_volume_is_called_and_counted() {
    let sandbox = Sandbox::new("csi-client-modify");
    let plugin = start_plugin(&sandbox, &[]).await;
    let client = Client::connect(&plugin.endpoint(), fast_retries())
        .await
        .unwrap();
    assert!(client.current_capabilities().controller.modify_volume());
    let vol = create(&client, "modify-me").await;
    let request = |id: &str, value: &str| proto::ControllerModifyVolumeRequest {
        volume_id: id.to_string(),
        mutable_parameters: [("tier".to_string(), value.to_string())].into(),
        ..Default::default()
    };
    client
        .controller_modify_volume(request(&vol.volume_id, "fast"))
        .await
        .expect("ControllerModifyVolume");
    let listed = client
        .list_volumes(proto::ListVolumesRequest::default())
        .await
        .unwrap();
    let context = &listed.entries[0].volume.as_ref().unwrap().volume_context;
    assert_eq!(
        context.get("mutable.tier").map(String::as_str),
        Some("fast")
    );
    let err = client
        .controller_modify_volume(request("no-such-volume", "fast"))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("ControllerModifyVolume"), "{err}");
    assert_eq!(outcome(&client, "ControllerModifyVolume"), (1, 1, 0, 0, 0));
    let text = client.metrics().encode_prometheus("csi_client");
    assert!(
        text.contains("csi_client_finished_total{rpc=\"ControllerModifyVolume\"} 1\n"),
        "{text}"
    );
    client
        .delete_volume(proto::DeleteVolumeRequest {
            volume_id: vol.volume_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap();

    let sandbox = Sandbox::new("csi-client-no-modify");
    let plugin = start_plugin(&sandbox, &["--no-modify"]).await;
    let client = Client::connect(&plugin.endpoint(), fast_retries())
        .await
        .unwrap();
    assert!(!client.current_capabilities().controller.modify_volume());
}

/// A plugin socket served by another user (here `nobody`, who listened on it) is refused at
/// connect, before a byte is sent: not retried until the connect timeout, and the error names
/// the socket and the uid. A plugin gets secrets and decides what is mounted, so csi-isolator
/// talks only to root (or its own user), for the node and the controller endpoint alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_socket_served_by_another_user_is_refused_before_a_byte_is_sent() {
    require_root();
    let sandbox = Sandbox::new("csi-untrusted-server");
    let socket = sandbox.join("plugin.sock");
    let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    let server = std::thread::spawn(move || {
        csi_isolator_testing::unprivileged::serve_as_nobody(listener, 3, b"")
    });
    // Give the child time to listen (a connect before listen(2) is refused, and retried).
    std::thread::sleep(Duration::from_millis(300));
    let endpoint = format!("unix://{}", socket.display());
    let err = match Client::connect(&endpoint, fast_retries()).await {
        Ok(_) => panic!("a socket served by nobody was talked to"),
        Err(e) => e,
    };
    assert!(
        matches!(err, csi_isolator::csi::CsiError::UntrustedServer { .. }),
        "{err:?}"
    );
    let text = csi_isolator::error_chain::full_message(&err);
    assert!(
        text.contains("served by uid 65534") && text.contains(&socket.display().to_string()),
        "{text}"
    );
    let served = server.join().unwrap();
    assert!(served.accepted >= 1, "{served:?}");
    assert!(!served.received, "a byte reached the untrusted server");
}
