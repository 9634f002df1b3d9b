//! Snapshots through `serve`, killed (SIGKILL, by the crash-point hook
//! `CSI_ISOLATOR_CRASH_AFTER_WRITE=N`) at every crash point of CreateSnapshot (the record written
//! as its intent, CreateSnapshot answered, the answer recorded) and of DeleteSnapshot (the record
//! marked, DeleteSnapshot answered, the record removed). For each N, a fresh serve recovers and
//! then: the operation is finished (a create re-issued by name, a delete re-issued), no record
//! is pending, and the snapshots the plugin lists (its own ListSnapshots, on its socket) are
//! exactly the recorded ones: nothing leaked, nothing lost. After a create, volumes made through
//! serve from the snapshot (CreateVolume from_snapshot) and as a clone of the source
//! (from_volume) hold the data they should. And CreateVolume from a snapshot, killed at each of
//! its points: recovery finishes it from its intent, which holds the content source, so the
//! volume holds the snapshot's data and the plugin has no volume more than the records. The
//! loop over N ends when the call completes without crashing.

use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};

use csi_isolator::csi::proto as csi;
use csi_isolator::service::proto::isolator_client::IsolatorClient;
use csi_isolator::service::proto::{
    CleanupRequest, ContainerConfig, CreateSnapshotRequest, CreateVolumeRequest,
    DeleteSnapshotRequest, DestroyVolumeRequest, ListSnapshotsRequest, PrepareRequest,
    StatusRequest,
};
use csi_isolator_testing::crash::ServeRuns;
use csi_isolator_testing::files::files_named;
use csi_isolator_testing::{require_root, Sandbox};
use tonic::transport::Channel;

const BIN: &str = env!("CARGO_BIN_EXE_csi-isolator");
const MAX_POINTS: u32 = 30;
const MIB: u64 = 1 << 20;

/// The plugin's socket: the one `csi.sock` under the sandbox (the work dir, or the short
/// socket dir when that path is too long).
fn plugin_socket(root: &Path) -> PathBuf {
    files_named(root, "csi.sock")
        .into_iter()
        .find(|p| std::fs::metadata(p).is_ok_and(|m| m.file_type().is_socket()))
        .unwrap_or_else(|| panic!("no plugin socket under {}", root.display()))
}

/// Every id of a paged CSI listing: `page(token)` answers one page's ids and its next token.
async fn every_page<F, Fut>(mut page: F) -> Vec<String>
where
    F: FnMut(String) -> Fut,
    Fut: std::future::Future<Output = (Vec<String>, String)>,
{
    let mut ids = Vec::new();
    let mut token = String::new();
    loop {
        let (more, next) = page(token).await;
        ids.extend(more);
        if next.is_empty() {
            break;
        }
        token = next;
    }
    ids.sort();
    ids
}

/// A controller client of the plugin serve manages.
async fn plugin_controller(w: &ServeRuns) -> csi::controller_client::ControllerClient<Channel> {
    let channel = csi_isolator::csi::transport::connect_unix(&plugin_socket(&w.path("")))
        .await
        .unwrap();
    csi::controller_client::ControllerClient::new(channel)
}

/// The snapshot ids the plugin has (ListSnapshots, every page).
async fn plugin_snapshots(w: &ServeRuns) -> Vec<String> {
    let controller = plugin_controller(w).await;
    every_page(|token| {
        let mut controller = controller.clone();
        async move {
            let page = controller
                .list_snapshots(csi::ListSnapshotsRequest {
                    starting_token: token,
                    ..Default::default()
                })
                .await
                .expect("the plugin's ListSnapshots")
                .into_inner();
            let ids = page
                .entries
                .into_iter()
                .filter_map(|e| e.snapshot.map(|s| s.snapshot_id))
                .collect();
            (ids, page.next_token)
        }
    })
    .await
}

/// The volume ids the plugin has (ListVolumes, every page).
async fn plugin_volumes(w: &ServeRuns) -> Vec<String> {
    let controller = plugin_controller(w).await;
    every_page(|token| {
        let mut controller = controller.clone();
        async move {
            let page = controller
                .list_volumes(csi::ListVolumesRequest {
                    starting_token: token,
                    ..Default::default()
                })
                .await
                .expect("the plugin's ListVolumes")
                .into_inner();
            let ids = page
                .entries
                .into_iter()
                .filter_map(|e| e.volume.map(|v| v.volume_id))
                .collect();
            (ids, page.next_token)
        }
    })
    .await
}

/// The recorded snapshots' ids, after checking that none is pending.
async fn recorded(c: &mut IsolatorClient<Channel>, n: u32) -> Vec<String> {
    let listed = c
        .list_snapshots(ListSnapshotsRequest::default())
        .await
        .expect("ListSnapshots")
        .into_inner();
    let mut ids = Vec::new();
    for s in listed.snapshots {
        assert_eq!(s.pending, "", "point {n}: {s:?}");
        assert!(!s.snapshot_id.is_empty(), "point {n}: {s:?}");
        ids.push(s.snapshot_id);
    }
    ids.sort();
    ids
}

/// A volume, published for container `container` (its mount point returned).
async fn volume_for(
    c: &mut IsolatorClient<Channel>,
    w: &ServeRuns,
    req: CreateVolumeRequest,
    container: &str,
) -> (String, PathBuf) {
    let name = req.name.clone();
    let v = c
        .create_volume(CreateVolumeRequest {
            container_path: "data".into(),
            ..req
        })
        .await
        .unwrap_or_else(|e| panic!("CreateVolume {name}: {e}"))
        .into_inner();
    let sandbox = w.sb.mkdir(format!("sandboxes/{container}"));
    c.prepare(PrepareRequest {
        container_id: container.into(),
        config: Some(ContainerConfig {
            resources_json: format!("[{}]", v.resource_json),
            sandbox: sandbox.to_str().unwrap().into(),
            ..Default::default()
        }),
    })
    .await
    .expect("Prepare");
    let st = c.status(StatusRequest {}).await.unwrap().into_inner();
    let at = st
        .volumes
        .iter()
        .find(|s| s.volume_id == v.volume_id)
        .unwrap()
        .mount_point
        .clone();
    (v.volume_id, PathBuf::from(at))
}

async fn cleanup(c: &mut IsolatorClient<Channel>, containers: &[&str], volumes: &[String]) {
    for id in containers {
        c.cleanup(CleanupRequest {
            container_id: (*id).into(),
        })
        .await
        .expect("Cleanup");
    }
    for v in volumes {
        c.destroy_volume(DestroyVolumeRequest {
            volume_id: v.clone(),
            ..Default::default()
        })
        .await
        .expect("DestroyVolume");
    }
}

fn source() -> CreateVolumeRequest {
    CreateVolumeRequest {
        name: "src".into(),
        capacity_bytes: 32 * MIB,
        ..Default::default()
    }
}

/// A create crashing at point `n`; whether it crashed.
async fn create_crash_once(n: u32) -> bool {
    let mut w = ServeRuns::new(Sandbox::new("snapshot-create-crash"), BIN);
    w.start(None);
    let mut c = w.client().await;
    let (src, at) = volume_for(&mut c, &w, source(), "c1").await;
    std::fs::write(at.join("file"), "taken").unwrap();
    drop(c);
    assert!(w.end(true).success());

    let id = src.clone();
    let crashed = w
        .armed(n, |mut c| async move {
            c.create_snapshot(CreateSnapshotRequest {
                volume_id: id,
                name: "snap".into(),
                ..Default::default()
            })
            .await
        })
        .await;

    let mut c = w.recovered(n, &["c1"]).await;
    let ids = recorded(&mut c, n).await;
    assert_eq!(ids.len(), 1, "point {n}: {ids:?}");
    assert_eq!(plugin_snapshots(&w).await, ids, "point {n}");
    // The same create again is the same snapshot.
    let again = c
        .create_snapshot(CreateSnapshotRequest {
            volume_id: src.clone(),
            name: "snap".into(),
            ..Default::default()
        })
        .await
        .expect("CreateSnapshot after recovery")
        .into_inner();
    assert_eq!(vec![again.snapshot_id], ids, "point {n}");
    let at = c
        .status(StatusRequest {})
        .await
        .unwrap()
        .into_inner()
        .volumes[0]
        .mount_point
        .clone();
    std::fs::write(Path::new(&at).join("file"), "later").unwrap();
    let (restored, r_at) = volume_for(
        &mut c,
        &w,
        CreateVolumeRequest {
            name: "restored".into(),
            capacity_bytes: 32 * MIB,
            from_snapshot: "snap".into(),
            ..Default::default()
        },
        "c2",
    )
    .await;
    assert_eq!(
        std::fs::read_to_string(r_at.join("file")).unwrap(),
        "taken",
        "point {n}"
    );
    let (copy, c_at) = volume_for(
        &mut c,
        &w,
        CreateVolumeRequest {
            name: "copy".into(),
            capacity_bytes: 32 * MIB,
            from_volume: "src".into(),
            ..Default::default()
        },
        "c3",
    )
    .await;
    assert_eq!(
        std::fs::read_to_string(c_at.join("file")).unwrap(),
        "later",
        "point {n}"
    );
    cleanup(&mut c, &["c1", "c2", "c3"], &[src, restored, copy]).await;
    c.delete_snapshot(DeleteSnapshotRequest {
        name: "snap".into(),
        ..Default::default()
    })
    .await
    .expect("DeleteSnapshot");
    assert!(plugin_snapshots(&w).await.is_empty(), "point {n}");
    w.finish(c, &[]).await;
    crashed
}

/// A delete crashing at point `n`; whether it crashed.
async fn delete_crash_once(n: u32) -> bool {
    let mut w = ServeRuns::new(Sandbox::new("snapshot-delete-crash"), BIN);
    w.start(None);
    let mut c = w.client().await;
    let (src, _) = volume_for(&mut c, &w, source(), "c1").await;
    for name in ["snap", "kept"] {
        c.create_snapshot(CreateSnapshotRequest {
            volume_id: src.clone(),
            name: name.into(),
            ..Default::default()
        })
        .await
        .expect("CreateSnapshot");
    }
    drop(c);
    assert!(w.end(true).success());

    let crashed = w
        .armed(n, |mut c| async move {
            c.delete_snapshot(DeleteSnapshotRequest {
                name: "snap".into(),
                ..Default::default()
            })
            .await
        })
        .await;

    let mut c = w.recovered(n, &["c1"]).await;
    let ids = recorded(&mut c, n).await;
    assert_eq!(ids.len(), 1, "point {n}: only 'kept' is left: {ids:?}");
    assert_eq!(plugin_snapshots(&w).await, ids, "point {n}");
    let listed = c
        .list_snapshots(ListSnapshotsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.snapshots[0].name, "kept", "point {n}");
    let gone = c
        .delete_snapshot(DeleteSnapshotRequest {
            name: "snap".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(gone.code(), tonic::Code::NotFound, "point {n}: {gone}");
    cleanup(&mut c, &["c1"], &[src]).await;
    c.delete_snapshot(DeleteSnapshotRequest {
        name: "kept".into(),
        ..Default::default()
    })
    .await
    .expect("DeleteSnapshot");
    assert!(plugin_snapshots(&w).await.is_empty(), "point {n}");
    w.finish(c, &[]).await;
    crashed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_create_survives_a_crash_at_every_point() {
    require_root();
    let mut n = 1;
    while create_crash_once(n).await {
        n += 1;
        assert!(n < MAX_POINTS, "the create never completed");
    }
    let survived = n - 1;
    eprintln!("snapshot_crash: create crash points survived: {survived}");
    // The intent, CreateSnapshot's answer, the answer recorded.
    assert!(survived >= 3, "only {survived} crash points");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_delete_survives_a_crash_at_every_point() {
    require_root();
    let mut n = 1;
    while delete_crash_once(n).await {
        n += 1;
        assert!(n < MAX_POINTS, "the delete never completed");
    }
    let survived = n - 1;
    eprintln!("snapshot_crash: delete crash points survived: {survived}");
    // The record marked, DeleteSnapshot's answer, the record removed.
    assert!(survived >= 3, "only {survived} crash points");
}

/// CreateVolume from a snapshot crashing at point `n`; whether it crashed.
async fn restore_crash_once(n: u32) -> bool {
    let mut w = ServeRuns::new(Sandbox::new("snapshot-restore-crash"), BIN);
    w.start(None);
    let mut c = w.client().await;
    let (src, at) = volume_for(&mut c, &w, source(), "c1").await;
    std::fs::write(at.join("file"), "taken").unwrap();
    c.create_snapshot(CreateSnapshotRequest {
        volume_id: src.clone(),
        name: "snap".into(),
        ..Default::default()
    })
    .await
    .expect("CreateSnapshot");
    std::fs::write(at.join("file"), "later").unwrap();
    drop(c);
    assert!(w.end(true).success());

    let restored = || CreateVolumeRequest {
        name: "restored".into(),
        capacity_bytes: 32 * MIB,
        from_snapshot: "snap".into(),
        ..Default::default()
    };
    let crashed = w
        .armed(n, |mut c| async move { c.create_volume(restored()).await })
        .await;

    let mut c = w.recovered(n, &["c1"]).await;
    let st = c.status(StatusRequest {}).await.unwrap().into_inner();
    let mut recorded: Vec<String> = st.volumes.iter().map(|v| v.volume_id.clone()).collect();
    recorded.sort();
    assert_eq!(recorded.len(), 2, "point {n}: {st:?}");
    assert_eq!(plugin_volumes(&w).await, recorded, "point {n}");
    let (id, r_at) = volume_for(&mut c, &w, restored(), "c2").await;
    assert_eq!(
        std::fs::read_to_string(r_at.join("file")).unwrap(),
        "taken",
        "point {n}"
    );
    cleanup(&mut c, &["c1", "c2"], &[src, id]).await;
    c.delete_snapshot(DeleteSnapshotRequest {
        name: "snap".into(),
        ..Default::default()
    })
    .await
    .expect("DeleteSnapshot");
    assert!(plugin_volumes(&w).await.is_empty(), "point {n}");
    assert!(plugin_snapshots(&w).await.is_empty(), "point {n}");
    w.finish(c, &[]).await;
    crashed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_from_a_snapshot_survives_a_crash_at_every_point() {
    require_root();
    let mut n = 1;
    while restore_crash_once(n).await {
        n += 1;
        assert!(n < MAX_POINTS, "the create never completed");
    }
    let survived = n - 1;
    eprintln!("snapshot_crash: restore crash points survived: {survived}");
    // The create intent, CreateVolume's answer, the volume's checkpoint, the intent's removal.
    assert!(survived >= 4, "only {survived} crash points");
}
