//! The volume isolator end to end, as root against the real kernel: CSI
//! volumes from the bundled plugin, published through the provider,
//! bind-mounted into containers started by the namespace launcher. Every
//! test checks that the host mount table afterwards equals the one before.

use csi_isolator::error_chain::FullMessage;
use std::fs;
use std::os::unix::fs::symlink;
use std::path::Path;
use std::time::{Duration, Instant};

use csi_isolator::isolator::IsolatorError;
use csi_isolator::mount::{MountTable, ProcMountTable};
use csi_isolator::provider::{Capability, CreateSpec, PluginSource, ProviderConfig, VolumeState};
use csi_isolator::resource::{Resource, VolumeMode};
use csi_isolator_testing::{
    busybox_rootfs, host_mount_points, require_root, PluginProcess, Sandbox,
};

mod common;
use common::*;

#[tokio::test]
async fn a_container_writes_into_its_volume_and_a_second_one_reads_it() {
    require_root();
    let sb = Sandbox::new("iso-rw");
    let before = host_mount_points(&sb);
    let agent = Agent::start(&sb, "work", &[]).await;
    let res = agent.volume("v", "data", VolumeMode::Rw).await;

    let c1 = config(&sb, "c1", vec![res.clone()], None);
    let info = agent.isolator.prepare("c1", c1.clone()).await.unwrap();
    assert_eq!(info.mounts.len(), 1);
    assert_eq!(info.mounts[0].source, res.host_path(&agent.work).unwrap());
    let status = run(&sb, spec(&c1, &info, "echo written-by-c1 > data/f")).await;
    assert!(status.success());
    agent.isolator.cleanup("c1").await.unwrap();
    let id = res.source_id().unwrap();
    assert_eq!(
        agent.provider.volume(id).await.unwrap().state,
        VolumeState::Created
    );

    let c2 = config(&sb, "c2", vec![res.clone()], None);
    let info = agent.isolator.prepare("c2", c2.clone()).await.unwrap();
    let status = run(&sb, spec(&c2, &info, "cat data/f > seen")).await;
    assert!(status.success());
    assert_eq!(read(&c2.sandbox.join("seen")), "written-by-c1\n");
    // The sandbox itself holds no trace of the volume: the mount was private.
    assert!(!c1.sandbox.join("data/f").exists());
    agent.isolator.cleanup("c2").await.unwrap();
    agent.provider.destroy_volume(id).await.unwrap();
    agent.stop().await;
    assert_clean(&sb, &before);
}

#[tokio::test]
async fn a_read_only_volume_refuses_writes() {
    require_root();
    let sb = Sandbox::new("iso-ro");
    let before = host_mount_points(&sb);
    let agent = Agent::start(&sb, "work", &[]).await;
    let res = agent.volume("v", "data", VolumeMode::Ro).await;
    let c1 = config(&sb, "c1", vec![res.clone()], None);
    let info = agent.isolator.prepare("c1", c1.clone()).await.unwrap();
    assert!(info.mounts[0].readonly);
    let status = run(&sb, spec(&c1, &info, "touch data/f 2> err; echo $? > rc")).await;
    assert!(status.success());
    assert_ne!(read(&c1.sandbox.join("rc")).trim(), "0");
    assert!(read(&c1.sandbox.join("err")).contains("Read-only file system"));
    // The host side is unchanged.
    let mp = agent.provider.mount_point(res.source_id().unwrap());
    assert!(!mp.join("f").exists());
    agent.isolator.cleanup("c1").await.unwrap();
    agent.destroy_and_stop(&sb, &before, &[&res]).await;
}

#[tokio::test]
async fn two_containers_share_a_volume_at_the_same_time() {
    require_root();
    let sb = Sandbox::new("iso-share");
    let before = host_mount_points(&sb);
    let agent = Agent::start(&sb, "work", &[]).await;
    let res = agent.volume("shared", "data", VolumeMode::Rw).await;
    let id = res.source_id().unwrap().to_string();
    let c1 = config(&sb, "c1", vec![res.clone()], None);
    let c2 = config(&sb, "c2", vec![res.clone()], None);
    let i1 = agent.isolator.prepare("c1", c1.clone()).await.unwrap();
    let i2 = agent.isolator.prepare("c2", c2.clone()).await.unwrap();
    // c1 waits for c2's message in the shared volume, then answers.
    let mut waiter = start(
        &sb,
        spec(
            &c1,
            &i1,
            "while [ ! -e data/ping ]; do sleep 0.05; done; echo pong > data/pong",
        ),
    )
    .await;
    let status = run(
        &sb,
        spec(
            &c2,
            &i2,
            "echo ping > data/ping; while [ ! -e data/pong ]; do sleep 0.05; done",
        ),
    )
    .await;
    assert!(status.success());
    assert!(finish(&sb, &mut waiter).await.success());
    assert_eq!(agent.provider.volume(&id).await.unwrap().users.len(), 2);
    agent.isolator.cleanup("c1").await.unwrap();
    assert!(
        ProcMountTable::new()
            .is_mount_point(&agent.provider.mount_point(&id))
            .unwrap(),
        "still used by c2"
    );
    agent.isolator.cleanup("c2").await.unwrap();
    assert_eq!(
        agent.provider.volume(&id).await.unwrap().state,
        VolumeState::Created
    );
    agent.provider.destroy_volume(&id).await.unwrap();
    agent.stop().await;
    assert_clean(&sb, &before);
}

#[tokio::test]
async fn update_mounts_into_a_running_container_and_removes_again() {
    require_root();
    let sb = Sandbox::new("iso-update");
    let before = host_mount_points(&sb);
    let agent = Agent::start(&sb, "work", &[]).await;
    let base = agent.volume("base", "data", VolumeMode::Rw).await;
    let extra = agent.volume("extra", "extra", VolumeMode::Rw).await;
    // Seed the extra volume with a marker while nobody uses it.
    let extra_id = extra.source_id().unwrap().to_string();
    let mp = agent.provider.publish(&extra_id, "seed").await.unwrap();
    fs::write(mp.join("ready"), b"1").unwrap();
    agent.provider.release(&extra_id, "seed").await.unwrap();

    let c1 = config(&sb, "c1", vec![base.clone()], None);
    let info = agent.isolator.prepare("c1", c1.clone()).await.unwrap();
    let mut running = start(
        &sb,
        spec(
            &c1,
            &info,
            "while [ ! -e extra/ready ]; do sleep 0.05; done; echo seen > out; \
             while [ -e extra/ready ]; do sleep 0.05; done; echo gone >> out",
        ),
    )
    .await;
    agent.isolator.isolate("c1", running.pid()).await.unwrap();
    agent
        .isolator
        .update("c1", vec![base.clone(), extra.clone()])
        .await
        .unwrap();
    let deadline = Instant::now() + TIMEOUT;
    while !c1.sandbox.join("out").exists() {
        assert!(
            Instant::now() < deadline,
            "the running process never saw the new volume"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        agent.provider.volume(&extra_id).await.unwrap().state,
        VolumeState::Published
    );
    agent
        .isolator
        .update("c1", vec![base.clone()])
        .await
        .unwrap();
    assert!(finish(&sb, &mut running).await.success());
    assert_eq!(read(&c1.sandbox.join("out")), "seen\ngone\n");
    assert_eq!(
        agent.provider.volume(&extra_id).await.unwrap().state,
        VolumeState::Created
    );
    agent.isolator.cleanup("c1").await.unwrap();
    for id in [base.source_id().unwrap(), &extra_id] {
        agent.provider.destroy_volume(id).await.unwrap();
    }
    agent.stop().await;
    assert_clean(&sb, &before);
}

#[tokio::test]
async fn symlinks_in_the_rootfs_cannot_send_mounts_outside() {
    require_root();
    let sb = Sandbox::new("iso-symlink");
    let before = host_mount_points(&sb);
    let agent = Agent::start(&sb, "work", &[]).await;
    let rootfs = busybox_rootfs(&sb, "rootfs");
    // The one escape the host could see: a target directory created outside the rootfs (the mounts
    // themselves live in the container's own namespace).
    let host_x = Path::new("/x");
    let host_x_before = host_x.exists();
    symlink("/etc", rootfs.join("data")).unwrap();
    symlink("../../..", rootfs.join("up")).unwrap();
    let a = agent.volume("a", "/data", VolumeMode::Rw).await;
    let b = agent.volume("b", "/up/x", VolumeMode::Rw).await;
    let c1 = config(&sb, "c1", vec![a.clone(), b.clone()], Some(rootfs.clone()));
    let info = agent.isolator.prepare("c1", c1.clone()).await.unwrap();
    let status = run(
        &sb,
        spec(
            &c1,
            &info,
            "echo a > /data/marker-a && echo b > /up/x/marker-b",
        ),
    )
    .await;
    assert!(status.success());
    assert!(
        rootfs.join("x").is_dir() && rootfs.join("etc").is_dir(),
        "the targets were made inside the rootfs"
    );
    assert_eq!(
        host_x.exists(),
        host_x_before,
        "nothing made at the host's /x"
    );
    // The writes landed in the volumes.
    for (res, file) in [(&a, "marker-a"), (&b, "marker-b")] {
        let id = res.source_id().unwrap();
        let mp = agent.provider.publish(id, "check").await.unwrap();
        assert!(mp.join(file).exists(), "{file} in its volume");
        agent.provider.release(id, "check").await.unwrap();
    }
    agent.isolator.cleanup("c1").await.unwrap();
    agent.destroy_and_stop(&sb, &before, &[&a, &b]).await;
}

#[tokio::test]
async fn a_relative_root_created_on_one_agent_is_mounted_on_another() {
    require_root();
    let sb = Sandbox::new("iso-agents");
    let before = host_mount_points(&sb);
    let plugin = PluginProcess::start(&sb, plugin_bin(), &[]).await;
    let agent_x = {
        let mut c = ProviderConfig::new(
            "",
            "default",
            sb.mkdir("x"),
            PluginSource::Endpoint(plugin.endpoint()),
        );
        c.provider_id.clear();
        Agent::with_config(c).await
    };
    let agent_y = {
        let mut c = ProviderConfig::new(
            "",
            "default",
            sb.mkdir("y"),
            PluginSource::Endpoint(plugin.endpoint()),
        );
        c.provider_id.clear();
        Agent::with_config(c).await
    };
    let res = agent_x.volume("v", "data", VolumeMode::Rw).await;
    let root = res
        .disk
        .as_ref()
        .unwrap()
        .source
        .as_ref()
        .unwrap()
        .root()
        .unwrap()
        .to_string();
    assert!(root.starts_with("./csi/"), "{root}");
    let id = res.source_id().unwrap().to_string();
    // Agent Y learns of the volume by id (it exists in the plugin already).
    let rec = agent_x.provider.volume(&id).await.unwrap();
    agent_y
        .provider
        .declare_volume(&id, Capability::default(), rec.volume_context.to_btree())
        .await
        .unwrap();
    let c1 = config(&sb, "c1", vec![res.clone()], None);
    let info = agent_y.isolator.prepare("c1", c1.clone()).await.unwrap();
    assert!(
        info.mounts[0].source.starts_with(&agent_y.work),
        "resolved under Y's work dir"
    );
    assert_eq!(info.mounts[0].source, agent_y.provider.mount_point(&id));
    let status = run(&sb, spec(&c1, &info, "echo from-y > data/f")).await;
    assert!(status.success());
    agent_y.isolator.cleanup("c1").await.unwrap();
    // X sees the data Y's container wrote.
    let mp = agent_x.provider.publish(&id, "reader").await.unwrap();
    assert_eq!(read(&mp.join("f")), "from-y\n");
    agent_x.provider.release(&id, "reader").await.unwrap();
    agent_y.provider.destroy_volume(&id).await.unwrap();
    agent_x.provider.destroy_volume(&id).await.unwrap();
    agent_x.stop().await;
    agent_y.stop().await;
    drop(plugin);
    assert_clean(&sb, &before);
}

#[tokio::test]
async fn a_failed_node_publish_fails_the_launch_before_exec() {
    require_root();
    let sb = Sandbox::new("iso-fail");
    let before = host_mount_points(&sb);
    let agent = Agent::start(&sb, "work", &["--fail=NodePublishVolume=INTERNAL"]).await;
    let ok = agent.volume("ok", "ok", VolumeMode::Rw).await;
    let bad = agent.volume("bad", "bad", VolumeMode::Rw).await;
    let c1 = config(&sb, "c1", vec![ok.clone(), bad.clone()], None);
    let err = agent.isolator.prepare("c1", c1).await.unwrap_err();
    let text = err.full_message();
    assert!(matches!(err, IsolatorError::Provider { .. }), "{text}");
    assert!(text.contains("NodePublishVolume"), "{text}");
    assert!(text.contains("INTERNAL"), "{text}");
    assert!(
        text.contains(ok.source_id().unwrap()) || text.contains(bad.source_id().unwrap()),
        "names the volume: {text}"
    );
    for res in [&ok, &bad] {
        let rec = agent
            .provider
            .volume(res.source_id().unwrap())
            .await
            .unwrap();
        assert!(rec.users.is_empty());
        assert_eq!(rec.state, VolumeState::Created);
    }
    assert!(agent.isolator.containers().await.is_empty());
    assert!(!agent.isolator.checkpoint_root().join("c1").exists());
    agent.destroy_and_stop(&sb, &before, &[&ok, &bad]).await;
}

#[tokio::test]
async fn refused_targets_publish_nothing() {
    require_root();
    let sb = Sandbox::new("iso-refuse");
    let before = host_mount_points(&sb);
    let agent = Agent::start(&sb, "work", &[]).await;
    let a = agent.volume("a", "same", VolumeMode::Rw).await;
    let b = agent.volume("b", "./x/../same", VolumeMode::Rw).await;
    let err = agent
        .isolator
        .prepare("c1", config(&sb, "c1", vec![a.clone(), b.clone()], None))
        .await
        .unwrap_err();
    assert!(matches!(err, IsolatorError::BadTarget { .. }), "{err}");
    // A container id the USERS columns could not tell apart is refused by the isolator itself,
    // whoever calls it.
    let err = agent
        .isolator
        .prepare("a,b", config(&sb, "ab", vec![a.clone()], None))
        .await
        .unwrap_err();
    assert!(err.full_message().contains("contains ','"), "{err}");
    let escape = a.clone().with_volume("../../outside", VolumeMode::Rw);
    let err = agent
        .isolator
        .prepare("c2", config(&sb, "c2", vec![escape], None))
        .await
        .unwrap_err();
    assert!(
        err.full_message().contains("outside the container's root"),
        "{err}"
    );
    // A reader-only volume cannot be mounted read-write, only read-only.
    let mut spec_ro = CreateSpec::new("ro", 16 * MIB);
    spec_ro.capability.access_mode = "MULTI_NODE_READER_ONLY".into();
    let ro = agent.provider.create_volume(spec_ro).await.unwrap();
    let err = agent
        .isolator
        .prepare(
            "c3",
            config(
                &sb,
                "c3",
                vec![ro.clone().with_volume("r", VolumeMode::Rw)],
                None,
            ),
        )
        .await
        .unwrap_err();
    assert!(matches!(err, IsolatorError::ReadOnlyVolume { .. }), "{err}");
    let c4 = config(
        &sb,
        "c4",
        vec![ro.clone().with_volume("r", VolumeMode::Ro)],
        None,
    );
    let info = agent.isolator.prepare("c4", c4.clone()).await.unwrap();
    assert!(run(&sb, spec(&c4, &info, "test -d r")).await.success());
    agent.isolator.cleanup("c4").await.unwrap();
    for r in [&a, &b, &ro] {
        let rec = agent.provider.volume(r.source_id().unwrap()).await.unwrap();
        assert!(rec.users.is_empty(), "{:?}", rec.users);
        agent
            .provider
            .destroy_volume(r.source_id().unwrap())
            .await
            .unwrap();
    }
    agent.stop().await;
    assert_clean(&sb, &before);
}

#[tokio::test]
async fn recover_cleans_up_after_containers_that_are_gone() {
    require_root();
    let sb = Sandbox::new("iso-recover");
    let before = host_mount_points(&sb);
    let agent = Agent::start(&sb, "work", &[]).await;
    let a = agent.volume("a", "a", VolumeMode::Rw).await;
    let b = agent.volume("b", "b", VolumeMode::Rw).await;
    agent
        .isolator
        .prepare("gone", config(&sb, "gone", vec![a.clone()], None))
        .await
        .unwrap();
    agent
        .isolator
        .prepare("alive", config(&sb, "alive", vec![b.clone()], None))
        .await
        .unwrap();
    // A use recorded by the provider for a container the isolator never checkpointed.
    agent
        .provider
        .publish(a.source_id().unwrap(), "phantom")
        .await
        .unwrap();
    agent.stop().await;

    // The agent restarts; only "alive" still exists.
    let agent = Agent::start(&sb, "work", &[]).await;
    let report = agent
        .isolator
        .recover(&["alive".to_string()])
        .await
        .unwrap();
    assert_eq!(report.recovered, vec!["alive".to_string()]);
    assert_eq!(report.cleaned, vec!["gone".to_string()]);
    assert!(
        report.released_uses.iter().any(|(_, c)| c == "phantom"),
        "{report:?}"
    );
    let ra = agent.provider.volume(a.source_id().unwrap()).await.unwrap();
    assert!(ra.users.is_empty());
    assert_eq!(ra.state, VolumeState::Created);
    let rb = agent.provider.volume(b.source_id().unwrap()).await.unwrap();
    assert_eq!(rb.state, VolumeState::Published, "alive keeps its volume");
    agent.isolator.cleanup("alive").await.unwrap();
    agent.destroy_and_stop(&sb, &before, &[&a, &b]).await;
}

#[tokio::test]
async fn update_moving_a_volume_or_changing_its_mode_keeps_it_published() {
    require_root();
    let sb = Sandbox::new("iso-move");
    let before = host_mount_points(&sb);
    let agent = Agent::start(&sb, "work", &[]).await;
    let v = agent.volume("v", "data", VolumeMode::Rw).await;
    let id = v.source_id().unwrap().to_string();
    let c1 = config(&sb, "c1", vec![v.clone()], None);
    let info = agent.isolator.prepare("c1", c1.clone()).await.unwrap();
    // The workload reports what it sees at each stage, driven by files the
    // test drops into the sandbox.
    let mut running = start(
        &sb,
        spec(
            &c1,
            &info,
            "echo one > data/f; \
             while [ ! -e go1 ]; do sleep 0.05; done; cat moved/f > seen1 2>&1; \
             while [ ! -e go2 ]; do sleep 0.05; done; (echo two > moved/g) 2> seen2; echo rc=$? >> seen2",
        ),
    )
    .await;
    agent.isolator.isolate("c1", running.pid()).await.unwrap();
    // Wait for the first write, then move the volume to another path.
    let deadline = Instant::now() + TIMEOUT;
    let mp = agent.provider.mount_point(&id);
    while !mp.join("f").exists() {
        assert!(Instant::now() < deadline, "the workload never wrote");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let moved = v.clone().with_volume("moved", VolumeMode::Rw);
    agent
        .isolator
        .update("c1", vec![moved.clone()])
        .await
        .unwrap();
    let rec = agent.provider.volume(&id).await.unwrap();
    assert_eq!(
        rec.state,
        VolumeState::Published,
        "still published after the move"
    );
    assert_eq!(rec.users.iter().collect::<Vec<_>>(), vec!["c1"]);
    fs::write(c1.sandbox.join("go1"), b"").unwrap();
    while !c1.sandbox.join("seen1").exists() {
        assert!(Instant::now() < deadline, "no answer after the move");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Now the same path, read-only: the old read-write mount must be gone.
    let ro = v.clone().with_volume("moved", VolumeMode::Ro);
    agent.isolator.update("c1", vec![ro]).await.unwrap();
    assert_eq!(
        agent.provider.volume(&id).await.unwrap().state,
        VolumeState::Published
    );
    fs::write(c1.sandbox.join("go2"), b"").unwrap();
    assert!(finish(&sb, &mut running).await.success());
    assert!(
        read(&c1.sandbox.join("seen1")).starts_with("one"),
        "{}",
        read(&c1.sandbox.join("seen1"))
    );
    let seen2 = read(&c1.sandbox.join("seen2"));
    assert!(
        seen2.contains("Read-only file system") && !seen2.contains("rc=0"),
        "{seen2}"
    );
    assert!(!mp.join("g").exists());
    agent.isolator.cleanup("c1").await.unwrap();
    assert_eq!(
        agent.provider.volume(&id).await.unwrap().state,
        VolumeState::Created
    );
    agent.provider.destroy_volume(&id).await.unwrap();
    agent.stop().await;
    assert_clean(&sb, &before);
}

#[tokio::test]
async fn a_failed_update_keeps_what_is_mounted_and_releases_what_is_not() {
    require_root();
    let sb = Sandbox::new("iso-update-fail");
    let before = host_mount_points(&sb);
    let agent = Agent::start(&sb, "work", &[]).await;
    let base = agent.volume("base", "data", VolumeMode::Rw).await;
    // No rootfs: an absolute path is the host's own, which must exist (nothing
    // is ever created on the host), so this mount into the container fails.
    let missing = format!("/csi-isolator-missing-{}", std::process::id());
    assert!(!Path::new(&missing).exists());
    let extra = agent.volume("extra", &missing, VolumeMode::Rw).await;
    let c1 = config(&sb, "c1", vec![base.clone()], None);
    let info = agent.isolator.prepare("c1", c1.clone()).await.unwrap();
    let mut running = start(
        &sb,
        spec(
            &c1,
            &info,
            "while [ ! -e stop ]; do sleep 0.05; done; echo ok > data/after",
        ),
    )
    .await;
    agent.isolator.isolate("c1", running.pid()).await.unwrap();
    let err = agent
        .isolator
        .update("c1", vec![base.clone(), extra.clone()])
        .await
        .unwrap_err();
    assert!(
        matches!(err, IsolatorError::Namespace { step: "mount", .. }),
        "{err}"
    );
    assert!(
        err.full_message().contains(extra.source_id().unwrap()),
        "names the volume: {err}"
    );
    // The new volume is released; the old one stays mounted, published and in use.
    let ex = agent
        .provider
        .volume(extra.source_id().unwrap())
        .await
        .unwrap();
    assert!(ex.users.is_empty());
    assert_eq!(ex.state, VolumeState::Created);
    let b = agent
        .provider
        .volume(base.source_id().unwrap())
        .await
        .unwrap();
    assert_eq!(b.users.iter().collect::<Vec<_>>(), vec!["c1"]);
    let recs = agent.isolator.containers().await;
    assert_eq!(
        recs[0].mounts, info.mounts,
        "the record says what is mounted"
    );
    assert!(!Path::new(&missing).exists(), "nothing created on the host");
    fs::write(c1.sandbox.join("stop"), b"").unwrap();
    assert!(
        finish(&sb, &mut running).await.success(),
        "the workload still writes its volume"
    );
    let mp = agent.provider.mount_point(base.source_id().unwrap());
    assert_eq!(read(&mp.join("after")), "ok\n");
    agent.isolator.cleanup("c1").await.unwrap();
    agent.destroy_and_stop(&sb, &before, &[&base, &extra]).await;
}

#[tokio::test]
async fn update_never_takes_a_volume_from_under_one_that_stays() {
    require_root();
    let unmount_log = capture_unmount_log();
    let sb = Sandbox::new("iso-nested");
    let before = host_mount_points(&sb);
    let agent = Agent::start(&sb, "work", &[]).await;
    let outer = agent.volume("outer", "a", VolumeMode::Rw).await;
    let inner = agent.volume("inner", "a/b", VolumeMode::Rw).await;
    let c1 = config(&sb, "c1", vec![outer.clone(), inner.clone()], None);
    let info = agent.isolator.prepare("c1", c1.clone()).await.unwrap();
    let mut running = start(
        &sb,
        spec(
            &c1,
            &info,
            "while [ ! -e stop ]; do sleep 0.05; done; echo in > a/b/mark && echo out > a/mark",
        ),
    )
    .await;
    agent.isolator.isolate("c1", running.pid()).await.unwrap();

    // Only the outer one away: refused, nothing changes.
    let err = agent
        .isolator
        .update("c1", vec![inner.clone()])
        .await
        .unwrap_err();
    let text = err.full_message();
    assert!(
        text.contains("stays mounted inside it at a/b: remove both, or neither"),
        "{text}"
    );
    let rec = agent.isolator.containers().await;
    assert_eq!(rec[0].mounts.len(), 2, "{rec:?}");

    // Both away (deepest first: no unmount ever finds a mount busy), then both back.
    agent.isolator.update("c1", vec![]).await.unwrap();
    let log = unmount_log.text();
    assert!(
        log.matches(" unmounted").count() >= 2 && !log.contains("busy"),
        "an unmount found its mount busy (the outer volume went first):\n{log}"
    );
    for v in [&outer, &inner] {
        let state = agent.provider.volume(v.source_id().unwrap()).await.unwrap();
        assert_eq!(state.state, VolumeState::Created);
    }
    agent
        .isolator
        .update("c1", vec![outer.clone(), inner.clone()])
        .await
        .unwrap();
    fs::write(c1.sandbox.join("stop"), "").unwrap();
    assert!(finish(&sb, &mut running).await.success());
    agent.isolator.cleanup("c1").await.unwrap();
    for (v, mark, text) in [(&outer, "mark", "out\n"), (&inner, "mark", "in\n")] {
        let id = v.source_id().unwrap();
        let mp = agent.provider.publish(id, "check").await.unwrap();
        assert_eq!(read(&mp.join(mark)), text);
        agent.provider.release(id, "check").await.unwrap();
        agent.provider.destroy_volume(id).await.unwrap();
    }
    agent.stop().await;
    assert_clean(&sb, &before);
}

/// What the mount layer logs (at debug), captured for the whole process: the unmounts of
/// `update` run on threads of their own in the container's namespace. nextest runs each test
/// in its own process; under `cargo test` the first test to ask installs it.
#[derive(Clone, Default)]
struct CapturedLog(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl CapturedLog {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

impl std::io::Write for CapturedLog {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for CapturedLog {
    type Writer = CapturedLog;
    fn make_writer(&'a self) -> CapturedLog {
        self.clone()
    }
}

fn capture_unmount_log() -> CapturedLog {
    let log = CapturedLog::default();
    tracing_subscriber::fmt()
        .with_env_filter("csi_isolator::mount=trace")
        .with_writer(log.clone())
        .with_ansi(false)
        .try_init()
        .expect("this test installs the process's log subscriber");
    log
}

/// A block volume of the bundled plugin (loop backing), end to end on the namespace launcher: its
/// resource is a `BLOCK` disk whose host path is the published device file; a container opens the
/// device file at its path, writes and reads it; a second container reads what the first wrote.
#[tokio::test]
async fn a_block_volume_is_a_device_file_a_container_writes_and_a_second_reads() {
    require_root();
    let sb = Sandbox::new("iso-block");
    let before = host_mount_points(&sb);
    let agent = Agent::start(&sb, "work", &[]).await;
    let res = block_volume(&agent, "b")
        .await
        .with_volume("disk", VolumeMode::Rw);
    let source = res.disk_source().unwrap();
    assert_eq!(source.kind, csi_isolator::resource::SourceType::Block);
    let host = res.host_path(&agent.work).unwrap();
    assert_eq!(host, agent.provider.mount_point(res.source_id().unwrap()));

    let c1 = config(&sb, "c1", vec![res.clone()], None);
    let info = agent.isolator.prepare("c1", c1.clone()).await.unwrap();
    assert!(info.mounts[0].block, "{:?}", info.mounts[0]);
    {
        use std::os::unix::fs::FileTypeExt;
        let published = fs::symlink_metadata(&host).unwrap();
        assert!(published.file_type().is_block_device(), "{published:?}");
    }
    let write = "test -b disk && printf written-by-c1 | dd of=disk bs=512 seek=8 conv=notrunc,fsync 2>/dev/null \
                 && dd if=disk bs=512 skip=8 count=1 2>/dev/null | head -c 13 > seen-by-c1";
    assert!(run(&sb, spec(&c1, &info, write)).await.success());
    assert_eq!(read(&c1.sandbox.join("seen-by-c1")), "written-by-c1");
    // The sandbox's own file stays empty: the device was bound over it, privately.
    assert_eq!(fs::metadata(c1.sandbox.join("disk")).unwrap().len(), 0);
    agent.isolator.cleanup("c1").await.unwrap();

    let c2 = config(&sb, "c2", vec![res.clone()], None);
    let info = agent.isolator.prepare("c2", c2.clone()).await.unwrap();
    let check = "dd if=disk bs=512 skip=8 count=1 2>/dev/null | head -c 13 > seen";
    assert!(run(&sb, spec(&c2, &info, check)).await.success());
    assert_eq!(read(&c2.sandbox.join("seen")), "written-by-c1");
    agent.isolator.cleanup("c2").await.unwrap();
    agent.destroy_and_stop(&sb, &before, &[&res]).await;
    sb.assert_no_loop_devices();
}

/// The target's kind must match the volume's: a block volume's device file is not bound onto a
/// directory, a FIFO or a device node in the container, nor a mount volume onto a file; each is
/// refused by name before anything is mounted, and the volume is released at cleanup.
#[tokio::test]
async fn a_target_of_another_kind_than_the_volume_is_refused() {
    require_root();
    let sb = Sandbox::new("iso-block-kind");
    let before = host_mount_points(&sb);
    let agent = Agent::start(&sb, "work", &[]).await;
    let block = block_volume(&agent, "b")
        .await
        .with_volume("disk", VolumeMode::Rw);
    let dir = agent.volume("d", "data", VolumeMode::Rw).await;
    type Plant<'a> = &'a dyn Fn(&Path);
    let cases: [(&str, &Resource, Plant, &str); 4] = [
        (
            "c-dir",
            &block,
            &|p| fs::create_dir(p.join("disk")).unwrap(),
            "not a regular file",
        ),
        (
            "c-fifo",
            &block,
            &|p| {
                nix::unistd::mkfifo(
                    &p.join("disk"),
                    nix::sys::stat::Mode::from_bits_truncate(0o600),
                )
                .unwrap()
            },
            "not a regular file",
        ),
        (
            "c-null",
            &block,
            &|p| {
                nix::sys::stat::mknod(
                    &p.join("disk"),
                    nix::sys::stat::SFlag::S_IFCHR,
                    nix::sys::stat::Mode::from_bits_truncate(0o600),
                    nix::sys::stat::makedev(1, 3),
                )
                .unwrap()
            },
            "not a regular file",
        ),
        (
            "c-file",
            &dir,
            &|p| fs::write(p.join("data"), b"").unwrap(),
            "not a directory",
        ),
    ];
    for (container, res, plant, words) in cases {
        let cfg = config(&sb, container, vec![(*res).clone()], None);
        plant(&cfg.sandbox);
        let info = agent
            .isolator
            .prepare(container, cfg.clone())
            .await
            .unwrap();
        let launch = spec(&cfg, &info, "true");
        let err = tokio::task::spawn_blocking(move || {
            csi_isolator::launcher::launch(&csi_isolator::mount::LinuxSyscall::new(), &launch)
        })
        .await
        .unwrap()
        .err()
        .unwrap_or_else(|| panic!("{container}: launched"));
        assert!(
            err.full_message().contains(words),
            "{container}: {}",
            err.full_message()
        );
        agent.isolator.cleanup(container).await.unwrap();
    }
    agent.destroy_and_stop(&sb, &before, &[&block, &dir]).await;
    sb.assert_no_loop_devices();
}

async fn block_volume(agent: &Agent, name: &str) -> csi_isolator::resource::Resource {
    let mut spec = CreateSpec::new(name, 16 * MIB);
    spec.capability.access_type = csi_isolator::provider::AccessType::Block;
    agent
        .provider
        .create_volume(spec)
        .await
        .expect("create block volume")
}
