//! `csi-isolator serve` killed (SIGKILL, by `CSI_ISOLATOR_CRASH_AFTER_WRITE=N`) at every crash
//! point of a non-root container's life (CreateVolume, Prepare with a user, Cleanup,
//! DestroyVolume) against a plugin offering VOLUME_MOUNT_GROUP. At each crash the volume's
//! checkpoint must already hold the group of a publish under way (its intent is written
//! before its first RPC, with the group); a fresh serve recovers and the life is run
//! again: the volume comes back owned by the container's group, through the plugin, the
//! plugin never refuses a call, and nothing is left. The loop ends when the life completes
//! without a crash.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Child;

use csi_isolator::csi::transport::connect_unix;
use csi_isolator::provider::VolumeRecord;
use csi_isolator::service::proto::isolator_client::IsolatorClient;
use csi_isolator::service::proto::{
    CleanupRequest, ContainerConfig, CreateVolumeRequest, DestroyVolumeRequest, PrepareRequest,
    RecoverRequest, StatusRequest,
};
use csi_isolator_testing::crash;
use csi_isolator_testing::{plugin_bin, require_root, PluginProcess, Sandbox};
use tonic::transport::Channel;

const CLI: &str = env!("CARGO_BIN_EXE_csi-isolator");
const MIB: u64 = 1024 * 1024;
const MAX_POINTS: u32 = 40;
const GID: u32 = 5678;

struct Env {
    sb: Sandbox,
    work: PathBuf,
    socket: PathBuf,
    endpoint: String,
}

/// Starts serve on the test's plugin (armed with `crash`, if any); `None` when it died before it
/// was ready.
fn start_serve(env: &Env, crash: Option<u32>) -> Option<Child> {
    crash::start_serve(
        &env.sb,
        CLI,
        &env.work,
        &env.socket,
        &["--plugin-endpoint", &env.endpoint],
        crash,
    )
}

async fn client(env: &Env) -> IsolatorClient<Channel> {
    IsolatorClient::new(connect_unix(&env.socket).await.expect("connect to serve"))
}

fn stop(env: &Env, child: Child) {
    crash::stop_serve(&env.sb, child);
}

/// The volume's life for a container of user 1234:[`GID`]: create, prepare (then, when
/// `check` says so, the volume is looked at while published), cleanup, destroy. Stops at the
/// first failed call (a crash).
async fn life(env: &Env, name: &str, container: &str, check: bool) -> Result<(), tonic::Status> {
    let mut c = client(env).await;
    let created = c
        .create_volume(CreateVolumeRequest {
            name: name.into(),
            capacity_bytes: 4 * MIB,
            container_path: "data".into(),
            ..Default::default()
        })
        .await?
        .into_inner();
    let sandbox = env.sb.mkdir(format!("sandboxes/{container}"));
    c.prepare(PrepareRequest {
        container_id: container.into(),
        config: Some(ContainerConfig {
            resources_json: format!("[{}]", created.resource_json),
            sandbox: sandbox.to_string_lossy().into(),
            user: format!("1234:{GID}"),
            ..Default::default()
        }),
    })
    .await?;
    if check {
        let status = c.status(StatusRequest::default()).await?.into_inner();
        let vol = status
            .volumes
            .iter()
            .find(|v| v.volume_id == created.volume_id)
            .expect("the volume in status");
        assert_eq!(vol.mount_group, GID, "{vol:?}");
        let meta = std::fs::metadata(&vol.mount_point).unwrap();
        assert_eq!(meta.gid(), GID, "{}", vol.mount_point);
        assert_eq!(meta.mode() & 0o2070, 0o2070, "{:o}", meta.mode());
    }
    c.cleanup(CleanupRequest {
        container_id: container.into(),
    })
    .await?;
    c.destroy_volume(DestroyVolumeRequest {
        volume_id: created.volume_id,
        ..Default::default()
    })
    .await?;
    Ok(())
}

/// Every volume checkpoint under the work dir.
fn records(work: &Path) -> Vec<VolumeRecord> {
    let mut out = Vec::new();
    let mut dirs = vec![work.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let kind = entry.file_type().unwrap();
            if kind.is_dir() {
                dirs.push(entry.path());
            } else if entry.file_name() == "volume.state" {
                let bytes = std::fs::read(entry.path()).unwrap();
                out.push(serde_json::from_slice(&bytes).unwrap());
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_crash_point_of_a_non_root_containers_volume_keeps_its_group() {
    require_root();
    let sb = Sandbox::new("mount-group-crash");
    let plugin = PluginProcess::start(
        &sb,
        plugin_bin(),
        &["--backing", "dir", "--volume-mount-group"],
    )
    .await;
    let env = Env {
        work: sb.join("work"),
        socket: sb.join("isolator.sock"),
        endpoint: plugin.endpoint(),
        sb,
    };
    let mut crashed = 0;
    let mut publish_intents = 0;
    for n in 1..=MAX_POINTS {
        let (name, container) = (format!("v{n}"), format!("c{n}"));
        let completed = match start_serve(&env, Some(n)) {
            Some(mut child) => {
                let done = life(&env, &name, &container, true).await.is_ok();
                if done {
                    stop(&env, child);
                } else {
                    let status = child.wait().unwrap();
                    env.sb.untrack(child.id());
                    assert_eq!(
                        std::os::unix::process::ExitStatusExt::signal(&status),
                        Some(9),
                        "crash point {n}: serve failed without crashing"
                    );
                }
                done
            }
            None => false,
        };
        if completed {
            println!("{crashed} crash points survived, {publish_intents} inside a publish");
            break;
        }
        crashed += 1;
        // What the crash left: a publish under way (its one intent, written before its first
        // RPC, covers NodeStage and NodePublish) holds its group already.
        for rec in records(&env.work) {
            if rec.towards == Some(csi_isolator::provider::VolumeState::Published) {
                publish_intents += 1;
                assert_eq!(rec.mount_group, Some(GID), "crash point {n}: {rec:?}");
            }
        }
        let child = start_serve(&env, None).expect("a serve without the hook starts");
        let mut c = client(&env).await;
        c.recover(RecoverRequest::default())
            .await
            .unwrap_or_else(|e| panic!("crash point {n}: Recover: {e}"));
        life(&env, &name, &container, true)
            .await
            .unwrap_or_else(|e| panic!("crash point {n}: finishing the life: {e}"));
        stop(&env, child);
        assert!(
            !plugin
                .stderr()
                .contains("volume_capability.mount.volume_mount_group"),
            "crash point {n}: the plugin refused a group:\n{}",
            plugin.stderr()
        );
        assert!(
            plugin.listed().await.is_empty(),
            "crash point {n}: a volume left"
        );
        env.sb.assert_no_mounts_under();
        assert!(n < MAX_POINTS, "the life never completed");
    }
    assert!(crashed > 3, "only {crashed} crash points");
    assert!(publish_intents > 0, "no crash inside a publish");
}
