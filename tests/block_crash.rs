//! A block volume's publish and unpublish through `serve`, killed (SIGKILL, by the crash-point
//! hook `CSI_ISOLATOR_CRASH_AFTER_WRITE=N`) at every crash point: Prepare of a container using
//! the volume (ControllerPublish, NodeStage: the loop device attached and bound onto the staged
//! device file, NodePublish: the target file made and the device bound onto it), then its
//! Cleanup (the reverse). For each N, a fresh serve recovers (the container is not known any
//! more) and then: Status shows the volume CREATED, unused, its target not mounted, with no
//! disagreement; the plugin agrees over CSI that the volume is not published anywhere; nothing is
//! left mounted under the sandbox and no loop device is attached to its image. The loop over N
//! ends when Prepare and Cleanup complete without crashing.

use csi_isolator::service::proto::{
    CleanupRequest, ContainerConfig, CreateVolumeRequest, PrepareRequest, StatusRequest,
};
use csi_isolator_testing::crash::ServeRuns;
use csi_isolator_testing::{require_root, Sandbox};

const BIN: &str = env!("CARGO_BIN_EXE_csi-isolator");
const MAX_POINTS: u32 = 60;

fn prepare(resource: &str, sandbox: &str) -> PrepareRequest {
    PrepareRequest {
        container_id: "c1".into(),
        config: Some(ContainerConfig {
            resources_json: format!("[{resource}]"),
            sandbox: sandbox.into(),
            ..Default::default()
        }),
    }
}

/// One run crashing at point `n`; whether it crashed.
async fn crash_once(n: u32) -> bool {
    let sb = Sandbox::new("block-crash");
    let sandbox = sb.mkdir("sandboxes/c1");
    let mut w = ServeRuns::new(sb, BIN);
    w.start(None);
    let mut c = w.client().await;
    let v = c
        .create_volume(CreateVolumeRequest {
            name: "blk".into(),
            capacity_bytes: 16 << 20,
            container_path: "disk".into(),
            access_type: "block".into(),
            ..Default::default()
        })
        .await
        .expect("CreateVolume")
        .into_inner();
    drop(c);
    assert!(w.end(true).success());

    let sandbox = sandbox.to_str().unwrap().to_string();
    let (resource, at) = (v.resource_json.as_str(), sandbox.as_str());
    let crashed = w
        .armed(n, |mut c| async move {
            let info = c.prepare(prepare(resource, at)).await?.into_inner();
            assert!(info.mounts.len() == 1 && info.mounts[0].block, "{info:?}");
            c.cleanup(CleanupRequest {
                container_id: "c1".into(),
            })
            .await
        })
        .await;

    let mut c = w.recovered(n, &[]).await;
    let st = c
        .status(StatusRequest {})
        .await
        .expect("Status")
        .into_inner();
    assert_eq!(st.volumes.len(), 1, "point {n}: {st:?}");
    let vol = &st.volumes[0];
    assert_eq!(vol.access_type, "block");
    assert_eq!(vol.state, "CREATED", "point {n}: {vol:?}");
    assert!(vol.users.is_empty() && !vol.mounted, "point {n}: {vol:?}");
    assert!(vol.disagreement.is_empty(), "point {n}: {vol:?}");
    assert!(st.containers.is_empty(), "point {n}: {st:?}");
    let left: Vec<_> =
        w.sb.mounts_under()
            .into_iter()
            .map(|m| m.mount_point)
            .collect();
    assert!(left.is_empty(), "point {n}: mounts left: {left:?}");
    w.sb.assert_no_loop_devices();
    // And it still serves: a Prepare after recovery publishes it again.
    c.prepare(prepare(&v.resource_json, &sandbox))
        .await
        .expect("Prepare after recovery");
    c.cleanup(CleanupRequest {
        container_id: "c1".into(),
    })
    .await
    .expect("Cleanup after recovery");
    w.finish(c, &[&v.volume_id]).await;
    crashed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_volumes_publish_and_unpublish_survive_a_crash_at_every_point() {
    require_root();
    let mut n = 1;
    while crash_once(n).await {
        n += 1;
        assert!(n < MAX_POINTS, "the operation never completed");
    }
    eprintln!("block_crash: crash points survived: {}", n - 1);
    // Prepare's container record and publish intent, the steps' RPCs and results, and
    // Cleanup's: well above a handful.
    let survived = n - 1;
    assert!(survived >= 6, "only {survived} crash points");
}
