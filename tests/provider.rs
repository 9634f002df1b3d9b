//! The storage local resource provider against the real `csi-test-plugin`
//! (managed by the provider, or external), real mounts, real restarts.

use csi_isolator::error_chain::FullMessage;
use csi_isolator_testing::plugin_bin;
use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use csi_isolator::csi::proto;
use csi_isolator::mount::{MountTable, ProcMountTable};
use csi_isolator::provider::bundled::bundled_config;
use csi_isolator::provider::{
    CreateSpec, Manager, PluginSource, ProviderConfig, ProviderError, Republish, StorageProvider,
    UnpublishPolicy, VolumeState,
};
use csi_isolator::resource::Resource;
use csi_isolator_testing::files::is_mounted;
use csi_isolator_testing::{raw_clients, require_root, PluginProcess, Sandbox};

const MIB: u64 = 1024 * 1024;

fn config(work: &Path, name: &str, plugin_args: &[&str]) -> ProviderConfig {
    let args: Vec<String> = plugin_args.iter().map(|s| s.to_string()).collect();
    let mut c = bundled_config(Path::new(plugin_bin()), work, name, &args);
    c.ready_timeout = Duration::from_secs(10);
    // Socket paths under the sandbox are too long for sun_path: keep the
    // short-path fallback inside the sandbox too.
    c.socket_dir = work.parent().unwrap().join("s");
    c
}

async fn start(c: ProviderConfig) -> Arc<StorageProvider> {
    StorageProvider::start(c).await.expect("start provider")
}

/// Creates a volume of the default capability; its resource.
async fn create(p: &StorageProvider, name: &str, bytes: u64) -> Resource {
    p.create_volume(CreateSpec::new(name, bytes))
        .await
        .unwrap_or_else(|e| panic!("create {name}: {e}"))
}

/// As root: a sandbox named `name`, a provider on the bundled plugin's loop backing in it, and
/// one 32 MiB volume created: its id.
async fn with_a_loop_volume(name: &str) -> (Sandbox, Arc<StorageProvider>, String) {
    require_root();
    let sb = Sandbox::new(name);
    let work = sb.mkdir("work");
    let p = start(config(&work, "default", &["--backing=loop"])).await;
    let res = create(&p, "v", 32 * MIB).await;
    let id = res.source_id().unwrap().to_string();
    (sb, p, id)
}

fn lifecycle_calls(log: &Path) -> Vec<String> {
    const LIFECYCLE: [&str; 8] = [
        "CreateVolume",
        "DeleteVolume",
        "ControllerPublishVolume",
        "ControllerUnpublishVolume",
        "NodeStageVolume",
        "NodeUnstageVolume",
        "NodePublishVolume",
        "NodeUnpublishVolume",
    ];
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|rpc| LIFECYCLE.contains(rpc))
        .map(str::to_string)
        .collect()
}

async fn publish_unpublish_in_combination(controller_publish: bool, stage: bool) {
    require_root();
    let sb = Sandbox::new("prov-caps");
    let work = sb.mkdir("work");
    let log = sb.join("calls.log");
    let log_arg = format!("--log-calls={}", log.display());
    let mut args = vec![log_arg.as_str()];
    if !controller_publish {
        args.push("--no-controller-publish");
    }
    if !stage {
        args.push("--no-stage");
    }
    let p = start(config(&work, "default", &args)).await;
    let caps = p.client().current_capabilities();
    assert_eq!(
        caps.controller.publish_unpublish_volume(),
        controller_publish
    );
    assert_eq!(caps.node.stage_unstage_volume(), stage);

    let res = create(&p, "v", 16 * MIB).await;
    let id = res.source_id().unwrap().to_string();
    // The volume's directories live as long as it does: made with it (the staging directory
    // only for a plugin that stages), kept between stages, so that a publish makes none.
    let (dir, staging) = (p.layout().mount_dir(&id), p.layout().staging_path(&id));
    let private_dir = |path: &Path| {
        use std::os::unix::fs::PermissionsExt;
        let meta = std::fs::symlink_metadata(path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
        assert!(meta.is_dir(), "{path:?} is a directory");
        assert_eq!(meta.permissions().mode() & 0o7777, 0o700, "{path:?}");
    };
    private_dir(&dir);
    assert_eq!(
        staging.exists(),
        stage,
        "staging directory made with the volume: {stage}"
    );
    let mp = p.publish(&id, "c1").await.unwrap();
    assert_eq!(mp, p.layout().target_path(&id));
    assert!(is_mounted(&mp), "target mounted");
    std::fs::write(mp.join("hello"), b"world").unwrap();
    assert_eq!(p.volume(&id).await.unwrap().state, VolumeState::Published);
    p.release(&id, "c1").await.unwrap();
    assert!(!is_mounted(&mp));
    assert_eq!(p.volume(&id).await.unwrap().state, VolumeState::Created);
    if stage {
        private_dir(&staging);
        assert!(!is_mounted(&staging), "nothing left mounted at {staging:?}");
        assert_eq!(
            std::fs::read_dir(&staging).unwrap().count(),
            0,
            "{staging:?} empty"
        );
    }
    // Gone (a volume of an older version, or removed by hand): the next publish makes them.
    if stage {
        std::fs::remove_dir(&staging).unwrap();
    }
    std::fs::remove_dir(&dir).unwrap();
    let mp = p.publish(&id, "c2").await.unwrap();
    assert!(is_mounted(&mp), "target mounted again");
    assert_eq!(std::fs::read(mp.join("hello")).unwrap(), b"world");
    private_dir(&dir);
    p.release(&id, "c2").await.unwrap();
    if stage {
        // Made by the publish, renewed by the unstage (while staged it shows the volume's root).
        private_dir(&staging);
    }
    p.destroy_volume(&id).await.unwrap();
    assert!(p.volume(&id).await.is_none());
    assert!(!p.layout().state_file(&id).exists());
    assert!(!p.layout().mount_dir(&id).exists());
    p.shutdown(Duration::from_secs(5)).await;

    let mut cycle = Vec::new();
    if controller_publish {
        cycle.push("ControllerPublishVolume");
    }
    if stage {
        cycle.push("NodeStageVolume");
    }
    cycle.push("NodePublishVolume");
    cycle.push("NodeUnpublishVolume");
    if stage {
        cycle.push("NodeUnstageVolume");
    }
    if controller_publish {
        cycle.push("ControllerUnpublishVolume");
    }
    let mut expected = vec!["CreateVolume"];
    expected.extend(cycle.iter().chain(&cycle));
    expected.push("DeleteVolume");
    assert_eq!(lifecycle_calls(&log), expected);
    sb.assert_no_mounts_under();
}

#[tokio::test]
async fn rpc_order_with_controller_publish_and_stage() {
    publish_unpublish_in_combination(true, true).await;
}

#[tokio::test]
async fn rpc_order_with_controller_publish_without_stage() {
    publish_unpublish_in_combination(true, false).await;
}

#[tokio::test]
async fn rpc_order_without_controller_publish_with_stage() {
    publish_unpublish_in_combination(false, true).await;
}

#[tokio::test]
async fn rpc_order_without_controller_publish_or_stage() {
    publish_unpublish_in_combination(false, false).await;
}

#[tokio::test]
async fn loop_backed_volume_keeps_data_across_publishes() {
    let (sb, p, id) = with_a_loop_volume("prov-loop").await;
    let mp = p.publish(&id, "c1").await.unwrap();
    let fs = ProcMountTable::new().find(&mp).unwrap().unwrap().fs_type;
    assert_eq!(fs, "ext4");
    std::fs::write(mp.join("data"), b"kept").unwrap();
    p.release(&id, "c1").await.unwrap();
    let mp = p.publish(&id, "c2").await.unwrap();
    assert_eq!(std::fs::read(mp.join("data")).unwrap(), b"kept");
    p.release(&id, "c2").await.unwrap();
    p.destroy_volume(&id).await.unwrap();
    p.shutdown(Duration::from_secs(5)).await;
    sb.assert_no_mounts_under();
    sb.assert_no_loop_devices();
}

#[tokio::test]
async fn create_is_idempotent_by_name_and_destroy_removes_data() {
    require_root();
    let sb = Sandbox::new("prov-create");
    let work = sb.mkdir("work");
    let p = start(config(&work, "default", &[])).await;
    let a = create(&p, "same", 8 * MIB).await;
    let b = create(&p, "same", 8 * MIB).await;
    assert_eq!(a, b);
    let id = a.source_id().unwrap().to_string();
    // The resource hands out a relative root, as Mesos' SLRP does.
    let root = a
        .disk
        .as_ref()
        .unwrap()
        .source
        .as_ref()
        .unwrap()
        .root()
        .unwrap()
        .to_string();
    assert_eq!(
        root,
        format!(
            "./csi/{}/default/mounts",
            csi_isolator::provider::bundled::BUNDLED_TYPE
        )
    );
    assert_eq!(a.host_path(&work).unwrap(), p.layout().target_path(&id));

    let mp = p.publish(&id, "c1").await.unwrap();
    std::fs::write(mp.join("secret"), b"x").unwrap();
    match p.destroy_volume(&id).await {
        Err(ProviderError::InUse { users, .. }) => assert_eq!(users, vec!["c1".to_string()]),
        other => panic!("destroy of a volume in use: {other:?}"),
    }
    p.release(&id, "c1").await.unwrap();
    p.destroy_volume(&id).await.unwrap();
    // Same name again: a new, empty volume.
    let c = create(&p, "same", 8 * MIB).await;
    let id2 = c.source_id().unwrap().to_string();
    assert_ne!(id, id2);
    let mp = p.publish(&id2, "c1").await.unwrap();
    assert!(!mp.join("secret").exists(), "destroyed data must be gone");
    p.release(&id2, "c1").await.unwrap();
    p.destroy_volume(&id2).await.unwrap();
    p.shutdown(Duration::from_secs(5)).await;
    sb.assert_no_mounts_under();
}

#[tokio::test]
async fn plugin_killed_during_publish_is_restarted() {
    require_root();
    let sb = Sandbox::new("prov-kill");
    let work = sb.mkdir("work");
    let p = start(config(
        &work,
        "default",
        &["--delay=NodePublishVolume=1500"],
    ))
    .await;
    let res = create(&p, "v", 8 * MIB).await;
    let id = res.source_id().unwrap().to_string();
    let first_pid = p.plugin_pid().unwrap();
    let publishing = {
        let p = p.clone();
        let id = id.clone();
        tokio::spawn(async move { p.publish(&id, "c1").await })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(first_pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let result = publishing.await.unwrap();
    assert_eq!(p.plugin_terminations(), 1);
    assert_ne!(p.plugin_pid(), Some(first_pid), "a new plugin process runs");
    let rec = p.volume(&id).await.unwrap();
    match result {
        Ok(mp) => {
            assert_eq!(rec.state, VolumeState::Published);
            assert!(is_mounted(&mp));
            p.release(&id, "c1").await.unwrap();
        }
        Err(e) => {
            // Failed cleanly: not in use, back down, nothing mounted.
            assert!(rec.users.is_empty(), "{e}");
            assert_eq!(rec.state, VolumeState::Created, "{e}");
        }
    }
    assert!(!is_mounted(&p.layout().target_path(&id)));
    p.destroy_volume(&id).await.unwrap();
    p.shutdown(Duration::from_secs(5)).await;
    sb.assert_no_mounts_under();
}

#[tokio::test]
async fn shared_volume_stays_until_last_use_across_restart() {
    require_root();
    let sb = Sandbox::new("prov-users");
    let work = sb.mkdir("work");
    let p = start(config(&work, "default", &[])).await;
    let id = create(&p, "shared", 8 * MIB)
        .await
        .source_id()
        .unwrap()
        .to_string();
    let mp = p.publish(&id, "c1").await.unwrap();
    p.publish(&id, "c2").await.unwrap();
    p.release(&id, "c1").await.unwrap();
    assert!(is_mounted(&mp), "still used by c2");
    p.shutdown(Duration::from_secs(5)).await;
    drop(p);

    // A restart in between: still mounted, still used by c2.
    let p = start(config(&work, "default", &[])).await;
    let rec = p.volume(&id).await.unwrap();
    assert_eq!(rec.users.iter().collect::<Vec<_>>(), vec!["c2"]);
    assert_eq!(rec.state, VolumeState::Published);
    assert!(is_mounted(&mp));
    p.release(&id, "c2").await.unwrap();
    assert!(!is_mounted(&mp), "unpublished at last use");
    assert_eq!(p.volume(&id).await.unwrap().state, VolumeState::Created);
    p.destroy_volume(&id).await.unwrap();
    p.shutdown(Duration::from_secs(5)).await;
    sb.assert_no_mounts_under();
}

#[tokio::test]
async fn keep_policy_stays_published_until_destroyed() {
    require_root();
    let sb = Sandbox::new("prov-keep");
    let work = sb.mkdir("work");
    let mut c = config(&work, "default", &[]);
    c.policy = UnpublishPolicy::Keep;
    let p = start(c).await;
    let id = create(&p, "k", 8 * MIB)
        .await
        .source_id()
        .unwrap()
        .to_string();
    let mp = p.publish(&id, "c1").await.unwrap();
    p.release(&id, "c1").await.unwrap();
    assert!(is_mounted(&mp), "keep: stays published");
    let dir = p.layout().mount_dir(&id);
    p.destroy_volume(&id).await.unwrap();
    assert!(!is_mounted(&mp));
    // Destroyed while staged: its staging directory removed at the unstage, not made again,
    // and its mount directory with it.
    assert!(!dir.exists(), "{} left after the destroy", dir.display());
    p.shutdown(Duration::from_secs(5)).await;
    sb.assert_no_mounts_under();
}

#[tokio::test]
async fn reboot_republishes_volumes_in_use() {
    require_root();
    let sb = Sandbox::new("prov-reboot");
    let work = sb.mkdir("work");
    let mut c = config(&work, "default", &[]);
    c.boot_id = Some("boot-1".into());
    let p = start(c.clone()).await;
    let id = create(&p, "r", 8 * MIB)
        .await
        .source_id()
        .unwrap()
        .to_string();
    let mp = p.publish(&id, "c1").await.unwrap();
    std::fs::write(mp.join("before-reboot"), b"1").unwrap();
    p.shutdown(Duration::from_secs(5)).await;
    drop(p);
    // The reboot: every node-side mount is gone.
    for m in ProcMountTable::new().mounts_under(&work).unwrap() {
        nix::mount::umount2(&m.mount_point, nix::mount::MntFlags::MNT_DETACH).unwrap();
    }
    assert!(!is_mounted(&mp));

    c.boot_id = Some("boot-2".into());
    let p = start(c).await;
    let report = p.recovery_report();
    assert!(
        report.actions.iter().any(|a| a.contains("reboot")),
        "{report:?}"
    );
    assert!(is_mounted(&mp), "republished for its user");
    assert_eq!(std::fs::read(mp.join("before-reboot")).unwrap(), b"1");
    let rec = p.volume(&id).await.unwrap();
    assert_eq!(rec.state, VolumeState::Published);
    assert_eq!(rec.boot_id.as_deref(), Some("boot-2"));
    p.release(&id, "c1").await.unwrap();
    p.destroy_volume(&id).await.unwrap();
    p.shutdown(Duration::from_secs(5)).await;
    sb.assert_no_mounts_under();
}

#[tokio::test]
async fn corrupt_and_truncated_state_files_are_set_aside() {
    require_root();
    let sb = Sandbox::new("prov-corrupt");
    let work = sb.mkdir("work");
    let p = start(config(&work, "default", &[])).await;
    let mut ids = Vec::new();
    for name in ["a", "b", "c", "d"] {
        let r = create(&p, name, 4 * MIB).await;
        ids.push(r.source_id().unwrap().to_string());
    }
    // d is in use: its mounts must survive b's corruption untouched.
    let mp_d = p.publish(&ids[3], "c1").await.unwrap();
    p.shutdown(Duration::from_secs(5)).await;
    let layout = p.layout().clone();
    drop(p);
    std::fs::write(layout.state_file(&ids[0]), b"{not json").unwrap();
    let full = std::fs::read(layout.state_file(&ids[1])).unwrap();
    std::fs::write(layout.state_file(&ids[1]), &full[..full.len() / 2]).unwrap();
    let text = String::from_utf8(std::fs::read(layout.state_file(&ids[2])).unwrap()).unwrap();
    std::fs::write(
        layout.state_file(&ids[2]),
        text.replace("\"format\": 1", "\"format\": 99"),
    )
    .unwrap();

    // `status` reads them as recovery will: all three unreadable, the healthy one listed.
    let status = csi_isolator::provider::status::scan(&work, &ProcMountTable::new()).unwrap();
    assert_eq!(status.unreadable.len(), 3, "{status:?}");
    assert!(
        status.unreadable.iter().any(|u| u.reason.contains("newer")),
        "{status:?}"
    );
    assert_eq!(status.volumes.len(), 1, "{status:?}");

    let p = start(config(&work, "default", &[])).await;
    let report = p.recovery_report();
    assert_eq!(report.corrupt.len(), 3, "{report:?}");
    for (path, aside, reason) in &report.corrupt {
        assert!(!path.exists(), "{} set aside", path.display());
        assert!(aside.exists(), "{} kept", aside.display());
        assert!(!reason.is_empty());
    }
    assert!(report.corrupt.iter().any(|(_, _, r)| r.contains("newer")));
    let known: HashSet<String> = p.volumes().await.into_iter().map(|r| r.volume_id).collect();
    assert_eq!(known, HashSet::from([ids[3].clone()]));
    assert!(is_mounted(&mp_d), "the healthy volume in use is untouched");
    p.release(&ids[3], "c1").await.unwrap();
    p.destroy_volume(&ids[3]).await.unwrap();
    p.shutdown(Duration::from_secs(5)).await;
    sb.assert_no_mounts_under();
}

#[tokio::test]
async fn ensure_all_repairs_a_volume_found_unpublished() {
    require_root();
    let sb = Sandbox::new("prov-ensure");
    let work = sb.mkdir("work");
    let p = start(config(&work, "default", &[])).await;
    let v1 = create(&p, "v1", 4 * MIB).await;
    let v2 = create(&p, "v2", 4 * MIB).await;
    let (v1, v2) = (
        v1.source_id().unwrap().to_string(),
        v2.source_id().unwrap().to_string(),
    );
    let mp1 = p
        .publish_for_container("c1", std::slice::from_ref(&v1))
        .await
        .unwrap()[0]
        .0
        .clone();
    nix::mount::umount2(&mp1, nix::mount::MntFlags::empty()).unwrap();
    assert!(!is_mounted(&mp1));
    p.publish_for_container("c2", std::slice::from_ref(&v2))
        .await
        .unwrap();
    assert!(is_mounted(&mp1), "ensure-all repaired c1's volume");
    p.release_container("c1").await.unwrap();
    p.release_container("c2").await.unwrap();
    for id in [&v1, &v2] {
        assert!(!is_mounted(&p.layout().target_path(id)));
        p.destroy_volume(id).await.unwrap();
    }
    p.shutdown(Duration::from_secs(5)).await;
    sb.assert_no_mounts_under();
}

#[tokio::test]
async fn concurrent_publishes_of_one_volume_are_serialized() {
    require_root();
    let sb = Sandbox::new("prov-conc");
    let work = sb.mkdir("work");
    let log = sb.join("calls.log");
    let log_arg = format!("--log-calls={}", log.display());
    let p = start(config(&work, "default", &[&log_arg])).await;
    let shared = create(&p, "s", 4 * MIB).await;
    let shared = shared.source_id().unwrap().to_string();
    let mut own = Vec::new();
    for i in 0..8 {
        let r = create(&p, &format!("o{i}"), 4 * MIB).await;
        own.push(r.source_id().unwrap().to_string());
    }
    let tasks: Vec<_> = (0..8)
        .map(|i| {
            let p = p.clone();
            let ids = vec![shared.clone(), own[i].clone()];
            tokio::spawn(async move { p.publish_for_container(&format!("c{i}"), &ids).await })
        })
        .collect();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    let rec = p.volume(&shared).await.unwrap();
    assert_eq!(rec.users.len(), 8);
    let publishes = lifecycle_calls(&log)
        .iter()
        .filter(|c| *c == "NodePublishVolume")
        .count();
    assert_eq!(publishes, 9, "one NodePublish per volume");
    for i in 0..8 {
        p.release_container(&format!("c{i}")).await.unwrap();
    }
    for id in own.iter().chain([&shared]) {
        assert_eq!(p.volume(id).await.unwrap().state, VolumeState::Created);
        p.destroy_volume(id).await.unwrap();
    }
    p.shutdown(Duration::from_secs(5)).await;
    sb.assert_no_mounts_under();
}

#[tokio::test]
async fn failed_publish_leaves_nothing_behind() {
    require_root();
    let sb = Sandbox::new("prov-fail");
    let work = sb.mkdir("work");
    let p = start(config(
        &work,
        "default",
        &["--fail=NodePublishVolume=FAILED_PRECONDITION:1"],
    ))
    .await;
    let ok = create(&p, "ok", 4 * MIB).await;
    let bad = create(&p, "bad", 4 * MIB).await;
    let (ok, bad) = (
        ok.source_id().unwrap().to_string(),
        bad.source_id().unwrap().to_string(),
    );
    let err = p
        .publish_for_container("c1", &[ok.clone(), bad.clone()])
        .await
        .unwrap_err();
    let text = err.full_message();
    assert!(text.contains("NodePublishVolume"), "{text}");
    assert!(text.contains("FAILED_PRECONDITION"), "{text}");
    assert_eq!(err.csi_code(), Some(tonic::Code::FailedPrecondition));
    for id in [&ok, &bad] {
        let rec = p.volume(id).await.unwrap();
        assert!(rec.users.is_empty(), "{id}: {:?}", rec.users);
        assert_eq!(rec.state, VolumeState::Created, "{id}");
    }
    sb.assert_no_mounts_under();
    for id in [&ok, &bad] {
        p.destroy_volume(id).await.unwrap();
    }
    p.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test]
async fn manager_routes_by_provider_id() {
    require_root();
    let sb = Sandbox::new("prov-mgr");
    let work = sb.mkdir("work");
    let a = start(config(&work, "a", &[])).await;
    let b = start(config(&work, "b", &["--no-stage"])).await;
    let ra = create(&a, "va", 4 * MIB).await;
    let rb = create(&b, "vb", 4 * MIB).await;
    let mut m = Manager::new();
    m.add(a.clone());
    m.add(b.clone());
    let agent_disk: Resource = serde_json::from_value(serde_json::json!({
        "name": "disk", "type": "SCALAR", "scalar": {"value": 10}
    }))
    .unwrap();
    let cpus = Resource::scalar("cpus", 1.0);
    let published = m
        .publish(
            "c1",
            &[cpus.clone(), ra.clone(), agent_disk.clone(), rb.clone()],
        )
        .await
        .unwrap();
    assert_eq!(published.len(), 2);
    assert_eq!(published[0].index, 1);
    assert_eq!(published[1].index, 3);
    for pv in &published {
        assert!(is_mounted(&pv.mount_point));
        assert_eq!(
            Some(pv.mount_point.clone()),
            [&ra, &rb][(pv.index - 1) / 2].host_path(&work).ok()
        );
    }
    let mut stranger = ra.clone();
    stranger.provider_id.as_mut().unwrap().value = "nobody".into();
    let err = m.publish("c2", &[stranger]).await.unwrap_err();
    assert!(err.full_message().contains("nobody"), "{err}");

    m.unpublish("c1", &[cpus, ra.clone(), agent_disk, rb.clone()])
        .await
        .unwrap();
    for pv in &published {
        assert!(!is_mounted(&pv.mount_point));
    }
    a.destroy_volume(ra.source_id().unwrap()).await.unwrap();
    b.destroy_volume(rb.source_id().unwrap()).await.unwrap();
    a.shutdown(Duration::from_secs(5)).await;
    b.shutdown(Duration::from_secs(5)).await;
    sb.assert_no_mounts_under();
}

#[tokio::test]
async fn pre_provisioned_volume_is_published_but_never_deleted() {
    require_root();
    let sb = Sandbox::new("prov-pre");
    let plugin = PluginProcess::start(&sb, plugin_bin(), &[]).await;
    let mut raw = raw_clients(&plugin.socket()).await.unwrap();
    let created = raw
        .controller
        .create_volume(proto::CreateVolumeRequest {
            name: "made-elsewhere".into(),
            volume_capabilities: vec![csi_isolator_testing::mount_capability(
                proto::volume_capability::access_mode::Mode::SingleNodeWriter,
            )],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    let work = sb.mkdir("work");
    let c = ProviderConfig::new("", "ext", &work, PluginSource::Endpoint(plugin.endpoint()));
    let mut c = c;
    c.provider_id.clear();
    let p = start(c).await;
    assert_eq!(
        p.id(),
        format!("{}.ext", csi_isolator::provider::bundled::BUNDLED_TYPE)
    );
    let unknown = p
        .declare_volume("no-such-volume", Default::default(), Default::default())
        .await
        .unwrap_err();
    assert_eq!(unknown.csi_code(), Some(tonic::Code::NotFound), "{unknown}");
    p.declare_volume(
        &created.volume_id,
        Default::default(),
        created.volume_context.clone().into_iter().collect(),
    )
    .await
    .unwrap();
    let mp = p.publish(&created.volume_id, "c1").await.unwrap();
    assert!(is_mounted(&mp));
    p.release(&created.volume_id, "c1").await.unwrap();
    p.destroy_volume(&created.volume_id).await.unwrap();
    assert!(!plugin.calls().iter().any(|c| c.starts_with("DeleteVolume")));
    let listed = raw
        .controller
        .list_volumes(proto::ListVolumesRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.entries.len(), 1, "still in the plugin");
    sb.assert_no_mounts_under();
}

#[tokio::test]
async fn recovery_unmounts_and_removes_orphaned_mount_directories() {
    require_root();
    let sb = Sandbox::new("prov-orphan");
    let work = sb.mkdir("work");
    let p = start(config(&work, "default", &[])).await;
    let layout = p.layout().clone();
    let id = create(&p, "kept", 4 * MIB)
        .await
        .source_id()
        .unwrap()
        .to_string();
    let mp = p.publish(&id, "c1").await.unwrap();
    p.shutdown(Duration::from_secs(5)).await;
    drop(p);
    // A mount directory no volume knows of, with a mount on it (what a
    // crash of some older process could leave), and data of its own.
    let orphan = layout.mounts_dir().join("vol-unknown");
    let target = orphan.join("target");
    std::fs::create_dir_all(&target).unwrap();
    let src = sb.mkdir("orphan-src");
    std::fs::write(src.join("precious"), b"data").unwrap();
    nix::mount::mount(
        Some(&src),
        &target,
        None::<&str>,
        nix::mount::MsFlags::MS_BIND,
        None::<&str>,
    )
    .unwrap();

    let p = start(config(&work, "default", &[])).await;
    assert!(!orphan.exists(), "orphaned directory removed");
    assert!(!is_mounted(&target));
    assert_eq!(
        std::fs::read(src.join("precious")).unwrap(),
        b"data",
        "unmounted before removal: the data behind it is untouched"
    );
    let report = p.recovery_report();
    assert!(
        report.actions.iter().any(|a| a.contains("orphan")),
        "{report:?}"
    );
    assert!(is_mounted(&mp), "the known volume in use stays published");
    p.release(&id, "c1").await.unwrap();
    p.destroy_volume(&id).await.unwrap();
    p.shutdown(Duration::from_secs(5)).await;
    sb.assert_no_mounts_under();
}

#[tokio::test]
async fn a_plugin_that_lies_about_node_publish_fails_the_publish_cleanly() {
    require_root();
    let sb = Sandbox::new("prov-lie");
    let work = sb.mkdir("work");
    let p = start(config(&work, "default", &["--lie=NodePublishVolume"])).await;
    let id = create(&p, "v", 4 * MIB)
        .await
        .source_id()
        .unwrap()
        .to_string();
    let err = p.publish(&id, "c1").await.unwrap_err();
    assert!(
        matches!(err, ProviderError::PluginMisbehaved { .. }),
        "{err}"
    );
    let text = err.full_message();
    assert!(
        text.contains("NodePublishVolume") && text.contains(&id),
        "{text}"
    );
    let rec = p.volume(&id).await.unwrap();
    assert!(rec.users.is_empty());
    assert_eq!(rec.state, VolumeState::Created, "rolled back");
    p.destroy_volume(&id).await.unwrap();
    p.shutdown(Duration::from_secs(5)).await;
    sb.assert_no_mounts_under();
}

#[tokio::test]
async fn a_managed_plugin_that_cannot_start_or_never_gets_ready_fails_the_start_cleanly() {
    require_root();
    let sb = Sandbox::new("prov-start-fail");
    let work = sb.mkdir("work");

    // The program does not exist: the error names the plugin and the command.
    let mut c = config(&work, "default", &[]);
    let missing = sb.join("no-such-plugin");
    if let PluginSource::Managed(cmd) = &mut c.plugin {
        cmd.program = missing.clone();
    } else {
        panic!("the bundled config is a managed plugin");
    }
    let err = StorageProvider::start(c).await.unwrap_err().full_message();
    assert!(
        err.starts_with("start plugin") && err.contains(&missing.display().to_string()),
        "{err}"
    );

    // It runs but never serves its socket: refused after the ready timeout, and the process
    // is killed (nothing of it is left running). Recovery's load, which runs while the plugin
    // starts, has still finished: a corrupt state file is set aside, not left half-handled.
    let volumes: Vec<_> = std::fs::read_dir(work.join("csi"))
        .unwrap()
        .map(|t| t.unwrap().path().join("default").join("volumes"))
        .filter(|v| v.is_dir())
        .collect();
    assert_eq!(
        volumes.len(),
        1,
        "the failed start made its provider's directories"
    );
    let bad = volumes[0].join("bad");
    std::fs::create_dir(&bad).unwrap();
    std::fs::write(bad.join("volume.state"), b"{").unwrap();
    let mut c = config(&work, "default", &[]);
    c.ready_timeout = Duration::from_millis(300);
    // A copy of sleep under the sandbox, so its command line names the sandbox.
    let never_ready = sb.join("never-ready-plugin");
    std::fs::copy("/bin/sleep", &never_ready).unwrap();
    if let PluginSource::Managed(cmd) = &mut c.plugin {
        cmd.program = never_ready.clone();
        cmd.args = vec!["1000".into()];
    }
    let started = std::time::Instant::now();
    let err = StorageProvider::start(c).await.unwrap_err().full_message();
    assert!(
        err.contains("not ready at") && err.contains("after"),
        "{err}"
    );
    // The last cause, typed and shown once by the chain.
    assert!(err.ends_with(": its socket was not created"), "{err}");
    let left: Vec<String> = std::fs::read_dir(&bad)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        left.len() == 1 && left[0].starts_with("volume.state.corrupt-"),
        "{left:?}"
    );
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "it did wait"
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !csi_isolator_testing::processes_mentioning(&never_ready).is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "the plugin process was left running"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    sb.assert_no_mounts_under();
}

#[tokio::test]
async fn a_batched_republish_repairs_unmounted_volumes_and_restores_lost_uses() {
    require_root();
    let sb = Sandbox::new("prov-republish");
    let work = sb.mkdir("work");
    let p = start(config(&work, "default", &[])).await;
    let ra = create(&p, "va", 4 * MIB).await;
    let rb = create(&p, "vb", 4 * MIB).await;
    let (va, vb) = (
        ra.source_id().unwrap().to_string(),
        rb.source_id().unwrap().to_string(),
    );
    let mut m = Manager::new();
    m.add(p.clone());
    m.publish("c1", std::slice::from_ref(&ra)).await.unwrap();
    m.publish("c2", std::slice::from_ref(&rb)).await.unwrap();
    // va unmounted behind the provider's back; c2's use of vb lost (under last-use, vb goes down).
    let (ta, tb) = (p.layout().target_path(&va), p.layout().target_path(&vb));
    nix::mount::umount2(&ta, nix::mount::MntFlags::empty()).unwrap();
    p.release(&vb, "c2").await.unwrap();
    assert!(!is_mounted(&ta) && !is_mounted(&tb));
    let mut stranger = ra.clone();
    stranger.provider_id.as_mut().unwrap().value = "nobody".into();
    let batch: Vec<Republish> = [("c1", ra.clone()), ("c2", rb.clone()), ("c3", stranger)]
        .into_iter()
        .map(|(c, r)| Republish {
            container_id: c.to_string(),
            resources: vec![r],
            groups: Default::default(),
        })
        .collect();
    let done = m.republish_all(&batch).await;
    assert!(done.unensured.is_empty(), "{:?}", done.unensured);
    assert!(done.containers[0].is_ok() && done.containers[1].is_ok());
    let refused = done.containers[2].as_ref().unwrap_err();
    assert!(refused.full_message().contains("nobody"), "{refused}");
    // The batch's checks found va unmounted and repaired it; c2 is vb's user again.
    assert!(is_mounted(&ta), "va repaired by the batch's mount checks");
    assert!(is_mounted(&tb), "vb published again for c2");
    let users = p.volume(&vb).await.unwrap().users;
    assert!(users.contains("c2"), "{users:?}");
    m.unpublish("c1", std::slice::from_ref(&ra)).await.unwrap();
    m.unpublish("c2", std::slice::from_ref(&rb)).await.unwrap();
    for id in [&va, &vb] {
        p.destroy_volume(id).await.unwrap();
    }
    p.shutdown(Duration::from_secs(5)).await;
    sb.assert_no_mounts_under();
}

/// A copy of a volume's mounts that another mount namespace took while the volume was in use
/// (any process that unshares one on the host: a runtime, a service with a private `/tmp`) is
/// detached when the volume is released: the plugin removes the target (CSI), and the provider
/// renews the staging directory, whose removal is what detaches the staging mount's copies.
/// Without that, the copy kept the volume's file system mounted after NodeUnstage, the loop
/// device stayed busy, and the next stage mounted the same image a second time.
#[tokio::test]
async fn a_copy_of_the_volumes_mounts_in_another_namespace_is_detached_at_release() {
    let (sb, p, id) = with_a_loop_volume("prov-copy").await;
    let target = p.publish(&id, "c1").await.unwrap();
    std::fs::write(target.join("data"), b"kept").unwrap();
    let staging = p.layout().staging_path(&id);

    // A process in a copy of this namespace, its mounts private: no unmount here reaches it.
    let mut holder = sb
        .spawn(std::process::Command::new("unshare").args([
            "--mount",
            "--propagation",
            "private",
            "sleep",
            "60",
        ]))
        .expect("spawn unshare");
    // Its mounts are private once `unshare` has made them so and executed `sleep`.
    let comm = format!("/proc/{}/comm", holder.id());
    let started = std::time::Instant::now();
    while std::fs::read_to_string(&comm).unwrap_or_default().trim() != "sleep" {
        assert!(
            holder.try_wait().unwrap().is_none(),
            "unshare --mount exited before its workload started"
        );
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "unshare --mount did not start its workload within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let ns = |pid: &str| std::fs::read_link(format!("/proc/{pid}/ns/mnt")).unwrap();
    assert_ne!(
        ns(&holder.id().to_string()),
        ns("self"),
        "the holder has its own namespace"
    );
    let copy = ProcMountTable::for_pid(holder.id());
    for (what, path) in [("staging", &staging), ("target", &target)] {
        assert!(
            copy.find(path).unwrap().is_some(),
            "the copy holds the {what} mount at {}",
            path.display()
        );
    }

    p.release(&id, "c1").await.unwrap();
    for (what, path) in [("staging", &staging), ("target", &target)] {
        assert!(
            copy.find(path).unwrap().is_none(),
            "the {what} mount at {} is still mounted in the other namespace after the release",
            path.display()
        );
    }
    // Nothing holds the volume's file system any more: its loop device is gone with it.
    sb.assert_no_loop_devices();
    // Staged and published again: what was written is there.
    let target = p.publish(&id, "c2").await.unwrap();
    assert_eq!(std::fs::read(target.join("data")).unwrap(), b"kept");
    p.release(&id, "c2").await.unwrap();

    holder.kill().unwrap();
    holder.wait().unwrap();
    sb.untrack(holder.id());
    p.destroy_volume(&id).await.unwrap();
    p.shutdown(Duration::from_secs(5)).await;
    sb.assert_no_mounts_under();
    sb.assert_no_loop_devices();
}
