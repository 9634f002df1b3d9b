//! `csi-isolator serve` killed (SIGKILL, by `CSI_ISOLATOR_CRASH_AFTER_WRITE=N`) at every crash
//! point of a non-root container's life (CreateVolume, Prepare with a user, Cleanup,
//! DestroyVolume) against a plugin offering VOLUME_MOUNT_GROUP. At each crash the volume's
//! checkpoint must already hold the group of a publish under way (its intent is written
//! before its first RPC, with the group); a fresh serve recovers and the life is run
//! again: the volume comes back owned by the container's group, through the plugin, the
//! plugin never refuses a call, and nothing is left. The loop ends when the life completes
//! without a crash.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use csi_isolator::provider::VolumeRecord;
use csi_isolator::service::proto::{
    CleanupRequest, ContainerConfig, CreateVolumeRequest, DestroyVolumeRequest, PrepareRequest,
    StatusRequest,
};
use csi_isolator_testing::crash::EndpointServeRuns;
use csi_isolator_testing::{require_root, Sandbox};

const CLI: &str = env!("CARGO_BIN_EXE_csi-isolator");
const MIB: u64 = 1024 * 1024;
const MAX_POINTS: u32 = 40;
const GID: u32 = 5678;

/// The volume's life for a container of user 1234:[`GID`]: create, prepare (then, when
/// `check` says so, the volume is looked at while published), cleanup, destroy. Stops at the
/// first failed call (a crash).
async fn life(
    env: &EndpointServeRuns,
    name: &str,
    container: &str,
    check: bool,
) -> Result<(), tonic::Status> {
    let mut c = env.client().await;
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

/// Every volume checkpoint under the work dir (state files and the journal over them).
fn records(work: &Path) -> Vec<VolumeRecord> {
    csi_isolator_testing::crash::volume_states(work)
        .into_iter()
        .map(|bytes| serde_json::from_slice(&bytes).unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_crash_point_of_a_non_root_containers_volume_keeps_its_group() {
    require_root();
    let (plugin, env) = EndpointServeRuns::on_bundled_plugin(
        Sandbox::new("mount-group-crash"),
        CLI,
        &["--backing", "dir", "--volume-mount-group"],
    )
    .await;
    let mut crashed = 0;
    let mut publish_intents = 0;
    for n in 1..=MAX_POINTS {
        let (name, container) = (format!("v{n}"), format!("c{n}"));
        let completed = env.armed(n, || life(&env, &name, &container, true)).await;
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
        let (child, _) = env.recovered(n).await;
        life(&env, &name, &container, true)
            .await
            .unwrap_or_else(|e| panic!("crash point {n}: finishing the life: {e}"));
        env.stop(child);
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
