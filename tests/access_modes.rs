//! CSI access modes enforced by the CO, and the fs type and mount flags of a volume's
//! capability, through the provider and its Manager against the real bundled plugin (real
//! gRPC, real mounts): each mode's refusals name the volume, the mode and the holder and leave
//! nothing behind; the uses and their access, the fs type and the flags survive a restart and a
//! reboot.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use csi_isolator::error_chain::FullMessage;
use csi_isolator::mount::{MountTable, ProcMountTable};
use csi_isolator::provider::bundled::bundled_config;
use csi_isolator::provider::{
    CreateSpec, Manager, ProviderConfig, ProviderError, StorageProvider, VolumeState,
};
use csi_isolator::resource::Resource;
use csi_isolator_testing::{plugin_bin, require_root, Sandbox};

const MIB: u64 = 1024 * 1024;

fn config(work: &Path, plugin_args: &[&str]) -> ProviderConfig {
    let args: Vec<String> = plugin_args.iter().map(|s| s.to_string()).collect();
    let mut c = bundled_config(Path::new(plugin_bin()), work, "default", &args);
    c.ready_timeout = Duration::from_secs(10);
    c.socket_dir = work.parent().unwrap().join("s");
    c
}

async fn start(c: ProviderConfig) -> Arc<StorageProvider> {
    StorageProvider::start(c).await.expect("start provider")
}

fn manager(p: &Arc<StorageProvider>) -> Manager {
    let mut m = Manager::new();
    m.add(p.clone());
    m
}

/// The volume's resource as a container binds it: read-only (`RO`) or read-write (`RW`).
fn bound(res: &Resource, mode: &str) -> Resource {
    let mut json = serde_json::to_value(res).unwrap();
    json["disk"]["volume"] = serde_json::json!({"container_path": "data", "mode": mode});
    serde_json::from_value(json).unwrap()
}

async fn create(p: &StorageProvider, name: &str, mode: &str) -> Resource {
    let mut spec = CreateSpec::new(name, 8 * MIB);
    spec.capability.set_access_mode(mode).unwrap();
    p.create_volume(spec).await.unwrap()
}

/// The users and readers the volume's checkpoint on disk holds.
fn on_disk(p: &StorageProvider, id: &str) -> (Vec<String>, Vec<String>) {
    let bytes = csi_isolator::provider::checkpoint::read_state(p.layout(), id)
        .unwrap()
        .expect("a checkpoint");
    let json: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    let list = |key: &str| -> Vec<String> {
        json[key]
            .as_array()
            .map(|a| a.iter().map(|v| v.as_str().unwrap().to_string()).collect())
            .unwrap_or_default()
    };
    (list("users"), list("readers"))
}

fn strings(names: &[&str]) -> Vec<String> {
    names.iter().map(|s| s.to_string()).collect()
}

/// Asserts `err` is the access-mode refusal of `container` naming the volume, the mode and
/// `words` (the holder, or the reason).
fn assert_refused(err: &ProviderError, id: &str, mode: &str, container: &str, words: &str) {
    assert!(
        matches!(err, ProviderError::AccessModeRefused { .. }),
        "{err:?}"
    );
    let text = err.full_message();
    for want in [
        format!("volume '{id}'"),
        format!("access mode {mode}"),
        format!("container '{container}'"),
        words.to_string(),
    ] {
        assert!(text.contains(&want), "{want:?} missing from: {text}");
    }
}

/// Every access mode of CSI v1.12, three containers each: c1 first (writing, or reading for a
/// reader-only mode), then c2 writing and c3 reading. What each mode admits and refuses, with
/// the refused use recorded nowhere (in memory and on disk) and the admitted ones recorded with
/// their access.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_access_mode_admits_and_refuses_containers_as_its_rule_says() {
    require_root();
    let sb = Sandbox::new("access-modes");
    let work = sb.mkdir("work");
    let p = start(config(&work, &["--backing=dir"])).await;
    let m = manager(&p);
    // (mode, c2 writing refused because of, c3 reading refused because of)
    let cases: [(&str, Option<&str>, Option<&str>); 7] = [
        ("SINGLE_NODE_WRITER", None, None),
        ("SINGLE_NODE_READER_ONLY", Some("only allows reading"), None),
        ("MULTI_NODE_READER_ONLY", Some("only allows reading"), None),
        (
            "MULTI_NODE_SINGLE_WRITER",
            Some("container 'c1' writes to it already"),
            None,
        ),
        (
            "SINGLE_NODE_SINGLE_WRITER",
            Some("container 'c1' uses it already"),
            Some("container 'c1' uses it already"),
        ),
        ("SINGLE_NODE_MULTI_WRITER", None, None),
        ("MULTI_NODE_MULTI_WRITER", None, None),
    ];
    for (mode, c2_refused, c3_refused) in cases {
        let res = create(&p, &format!("v-{mode}"), mode).await;
        let id = res.source_id().unwrap().to_string();
        let reader_only = mode.contains("READER_ONLY");
        let (rw, ro) = (bound(&res, "RW"), bound(&res, "RO"));
        if reader_only {
            // Mesos' rule: a reader-only volume is never bound read-write.
            let err = m
                .publish("c1", std::slice::from_ref(&rw))
                .await
                .unwrap_err();
            assert_refused(&err, &id, mode, "c1", "only allows reading");
            assert_eq!(p.volume(&id).await.unwrap().state, VolumeState::Created);
        }
        let first = if reader_only { &ro } else { &rw };
        let published = m.publish("c1", std::slice::from_ref(first)).await.unwrap();
        let mount = ProcMountTable::new()
            .find(&published[0].mount_point)
            .unwrap()
            .unwrap();
        assert_eq!(
            mount.is_readonly(),
            reader_only,
            "{mode}: published read-only"
        );
        let mut users = vec!["c1"];
        let mut readers = if reader_only { vec!["c1"] } else { vec![] };
        for (container, resource, refused) in [("c2", &rw, c2_refused), ("c3", &ro, c3_refused)] {
            let result = m.publish(container, std::slice::from_ref(resource)).await;
            match refused {
                Some(words) => assert_refused(&result.unwrap_err(), &id, mode, container, words),
                None => {
                    result.unwrap_or_else(|e| panic!("{mode} {container}: {}", e.full_message()));
                    users.push(container);
                    if container == "c3" {
                        readers.push(container);
                    }
                }
            }
        }
        let rec = p.volume(&id).await.unwrap();
        assert_eq!(rec.users.iter().collect::<Vec<_>>(), users, "{mode}");
        assert_eq!(rec.readers.iter().collect::<Vec<_>>(), readers, "{mode}");
        assert_eq!(
            on_disk(&p, &id),
            (strings(&users), strings(&readers)),
            "{mode}"
        );
        for user in &users {
            m.unpublish(user, std::slice::from_ref(&rw)).await.unwrap();
        }
        let rec = p.volume(&id).await.unwrap();
        assert!(rec.users.is_empty() && rec.readers.is_empty(), "{rec:?}");
        assert_eq!(rec.state, VolumeState::Created);
        p.destroy_volume(&id).await.unwrap();
    }
    p.shutdown(Duration::from_secs(5)).await;
    sb.assert_no_mounts_under();
}

/// A launch whose second volume is refused by its access mode leaves nothing of the first: no
/// use, no mount. A reading use that comes back writing is checked again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_use_fails_the_whole_publish_and_leaves_nothing_half_done() {
    require_root();
    let sb = Sandbox::new("access-rollback");
    let work = sb.mkdir("work");
    let p = start(config(&work, &["--backing=dir"])).await;
    let m = manager(&p);
    let held = create(&p, "held", "MULTI_NODE_SINGLE_WRITER").await;
    let free = create(&p, "free", "SINGLE_NODE_WRITER").await;
    let (held_id, free_id) = (
        held.source_id().unwrap().to_string(),
        free.source_id().unwrap().to_string(),
    );
    m.publish("c1", &[bound(&held, "RW")]).await.unwrap();
    let err = m
        .publish("c2", &[bound(&free, "RW"), bound(&held, "RW")])
        .await
        .unwrap_err();
    assert_refused(
        &err,
        &held_id,
        "MULTI_NODE_SINGLE_WRITER",
        "c2",
        "'c1' writes",
    );
    let free_rec = p.volume(&free_id).await.unwrap();
    assert!(free_rec.users.is_empty(), "{free_rec:?}");
    assert_eq!(free_rec.state, VolumeState::Created, "unpublished again");
    assert!(!ProcMountTable::new()
        .is_mount_point(&p.mount_point(&free_id))
        .unwrap());
    // c2 may read it; its use then asking to write is refused, and it stays a reader.
    m.publish("c2", &[bound(&held, "RO")]).await.unwrap();
    let err = m.publish("c2", &[bound(&held, "RW")]).await.unwrap_err();
    assert_refused(
        &err,
        &held_id,
        "MULTI_NODE_SINGLE_WRITER",
        "c2",
        "'c1' writes",
    );
    let rec = p.volume(&held_id).await.unwrap();
    assert_eq!(rec.readers.iter().collect::<Vec<_>>(), ["c2"]);
    assert_eq!(rec.users.len(), 2);
    // Once c1 is gone, c2 may write.
    m.unpublish("c1", std::slice::from_ref(&held))
        .await
        .unwrap();
    m.publish("c2", &[bound(&held, "RW")]).await.unwrap();
    assert!(p.volume(&held_id).await.unwrap().readers.is_empty());
    m.unpublish("c2", std::slice::from_ref(&held))
        .await
        .unwrap();
    for id in [&held_id, &free_id] {
        p.destroy_volume(id).await.unwrap();
    }
    p.shutdown(Duration::from_secs(5)).await;
    sb.assert_no_mounts_under();
}

/// The uses and their access survive a restart (the rule still holds against them), and the fs
/// type and mount flags survive a reboot: recovery stages and publishes the volume again with
/// its checkpointed capability (an ext3 filesystem with noexec and noatime).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uses_fs_type_and_flags_survive_a_restart_and_a_reboot() {
    require_root();
    let sb = Sandbox::new("access-restart");
    let work = sb.mkdir("work");
    let mut c = config(&work, &[]);
    c.boot_id = Some("boot-1".into());
    let p = start(c.clone()).await;
    let mut spec = CreateSpec::new("e3", 16 * MIB);
    spec.capability
        .set_access_mode("MULTI_NODE_SINGLE_WRITER")
        .unwrap();
    spec.capability.fs_type = "ext3".into();
    spec.capability.mount_flags = strings(&["noexec", "noatime"]);
    let res = p.create_volume(spec).await.unwrap();
    let id = res.source_id().unwrap().to_string();
    let m = manager(&p);
    m.publish("c1", &[bound(&res, "RW")]).await.unwrap();
    m.publish("c2", &[bound(&res, "RO")]).await.unwrap();
    let target = p.mount_point(&id);
    let check_mount = |when: &str| {
        let mount = ProcMountTable::new().find(&target).unwrap().unwrap();
        assert_eq!(mount.fs_type, "ext3", "{when}");
        for flag in ["noexec", "noatime", "nosuid", "nodev"] {
            assert!(
                mount.mount_options.iter().any(|o| o == flag),
                "{when}: {flag} missing from {:?}",
                mount.mount_options
            );
        }
    };
    check_mount("first publish");
    std::fs::write(target.join("kept"), b"1").unwrap();
    p.shutdown(Duration::from_secs(5)).await;
    drop((m, p));

    let p = start(c.clone()).await;
    let m = manager(&p);
    let err = m.publish("c3", &[bound(&res, "RW")]).await.unwrap_err();
    assert_refused(&err, &id, "MULTI_NODE_SINGLE_WRITER", "c3", "'c1' writes");
    let rec = p.volume(&id).await.unwrap();
    assert_eq!(rec.readers.iter().collect::<Vec<_>>(), ["c2"]);
    assert_eq!(rec.capability.fs_type, "ext3");
    p.shutdown(Duration::from_secs(5)).await;
    drop((m, p));

    // The reboot: every node-side mount is gone.
    for mount in ProcMountTable::new().mounts_under(&work).unwrap() {
        nix::mount::umount2(&mount.mount_point, nix::mount::MntFlags::MNT_DETACH).unwrap();
    }
    c.boot_id = Some("boot-2".into());
    let p = start(c).await;
    check_mount("republished after the reboot");
    assert_eq!(std::fs::read(target.join("kept")).unwrap(), b"1");
    p.release(&id, "c1").await.unwrap();
    p.release(&id, "c2").await.unwrap();
    p.destroy_volume(&id).await.unwrap();
    p.shutdown(Duration::from_secs(5)).await;
    sb.assert_no_mounts_under();
    sb.assert_no_loop_devices();
}
