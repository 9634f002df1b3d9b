//! An expansion through `serve`, killed (SIGKILL, by the crash-point hook
//! `CSI_ISOLATOR_CRASH_AFTER_WRITE=N`) at every crash point: ExpandVolume of a published xfs volume
//! (the intent written, ControllerExpandVolume answered, its answer recorded, NodeExpandVolume
//! answered, the intent gone). For each N, a fresh serve recovers with the container still known
//! and then: the expansion is finished (the intent is durable before the first RPC, and both
//! calls are idempotent), Status shows the new capacity and the volume published without
//! disagreement, the filesystem at its mount point has grown (the plugin and the record agree),
//! no intent is left in its checkpoint, and the same ExpandVolume again is no change. The loop
//! over N ends when ExpandVolume completes without crashing.

use csi_isolator::service::proto::{
    CleanupRequest, ContainerConfig, CreateVolumeRequest, ExpandVolumeRequest, PrepareRequest,
    StatusRequest,
};
use csi_isolator_testing::crash::ServeRuns;
use csi_isolator_testing::files::files_named;
use csi_isolator_testing::{require_root, Sandbox};

const BIN: &str = env!("CARGO_BIN_EXE_csi-isolator");
const MAX_POINTS: u32 = 30;
const MIB: u64 = 1 << 20;
const FROM: u64 = 300 * MIB;
const TO: u64 = 400 * MIB;

fn expand(volume_id: &str) -> ExpandVolumeRequest {
    ExpandVolumeRequest {
        volume_id: volume_id.into(),
        capacity_bytes: TO,
        ..Default::default()
    }
}

/// One run crashing at point `n`; whether it crashed.
async fn crash_once(n: u32) -> bool {
    let sb = Sandbox::new("expand-crash");
    let sandbox = sb.mkdir("sandboxes/c1");
    let mut w = ServeRuns::new(sb, BIN);
    w.start(None);
    let mut c = w.client().await;
    let v = c
        .create_volume(CreateVolumeRequest {
            name: "grows".into(),
            capacity_bytes: FROM,
            container_path: "data".into(),
            fs_type: "xfs".into(),
            ..Default::default()
        })
        .await
        .expect("CreateVolume")
        .into_inner();
    c.prepare(PrepareRequest {
        container_id: "c1".into(),
        config: Some(ContainerConfig {
            resources_json: format!("[{}]", v.resource_json),
            sandbox: sandbox.to_str().unwrap().into(),
            ..Default::default()
        }),
    })
    .await
    .expect("Prepare");
    drop(c);
    assert!(w.end(true).success());

    let id = v.volume_id.as_str();
    let crashed = w
        .armed(n, |mut c| async move { c.expand_volume(expand(id)).await })
        .await;

    let mut c = w.recovered(n, &["c1"]).await;
    let st = c
        .status(StatusRequest {})
        .await
        .expect("Status")
        .into_inner();
    let vol = &st.volumes[0];
    assert_eq!(vol.state, "PUBLISHED", "point {n}: {vol:?}");
    assert!(vol.disagreement.is_empty(), "point {n}: {vol:?}");
    assert!(vol.capacity_bytes >= TO, "point {n}: {vol:?}");
    let fs = nix::sys::statvfs::statvfs(vol.mount_point.as_str()).unwrap();
    assert!(
        fs.blocks() * fs.fragment_size() > FROM,
        "point {n}: the filesystem at {} did not grow",
        vol.mount_point
    );
    let records = files_named(&w.work, "volume.state");
    assert_eq!(records.len(), 1, "point {n}: {records:?}");
    let record = std::fs::read_to_string(&records[0]).unwrap();
    assert!(!record.contains("expansion"), "point {n}: {record}");
    let again = c
        .expand_volume(expand(&v.volume_id))
        .await
        .expect("ExpandVolume after recovery")
        .into_inner();
    assert_eq!(again.capacity_bytes, vol.capacity_bytes, "point {n}");
    c.cleanup(CleanupRequest {
        container_id: "c1".into(),
    })
    .await
    .expect("Cleanup");
    w.finish(c, &[&v.volume_id]).await;
    crashed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expansion_survives_a_crash_at_every_point() {
    require_root();
    let mut n = 1;
    while crash_once(n).await {
        n += 1;
        assert!(n < MAX_POINTS, "the expansion never completed");
    }
    let survived = n - 1;
    eprintln!("expand_crash: crash points survived: {survived}");
    // The intent, ControllerExpandVolume's answer and its record, NodeExpandVolume's answer and
    // the intent's removal.
    assert!(survived >= 5, "only {survived} crash points");
}
