//! Mount propagation per volume (`disk.volume.mount_propagation`), as root against the real kernel: CSI
//! volumes of the bundled plugin, published by the provider, mounted into containers by the namespace
//! launcher, with real mounts made later under the host mount point (rslave), by the container under its
//! copy (rshared), and none either way with the private default. Every test checks that the host mount
//! table afterwards equals the one before.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use csi_isolator::mount::{MountTable, ProcMountTable, VolumePropagation};
use csi_isolator::provider::VolumeState;
use csi_isolator::resource::{PropagationMode, VolumeMode};
use csi_isolator_testing::{busybox_rootfs, host_mount_points, require_root, Sandbox};

mod common;
use common::*;

/// Waits (bounded) for `path` to exist.
fn wait_for(path: &Path) {
    let deadline = Instant::now() + TIMEOUT;
    while !path.exists() {
        assert!(
            Instant::now() < deadline,
            "{} did not appear within {TIMEOUT:?}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn is_mount_point(path: &Path) -> bool {
    ProcMountTable::new().is_mount_point(path).unwrap()
}

/// A tmpfs mounted by the test on the host (a driver's nested mount), unmounted on drop if still there.
struct NestedMount(PathBuf);

impl NestedMount {
    fn new(at: &Path, marker: &str) -> NestedMount {
        fs::create_dir_all(at).unwrap();
        nix::mount::mount(
            Some("tmpfs"),
            at,
            Some("tmpfs"),
            nix::mount::MsFlags::empty(),
            Some("size=1M"),
        )
        .unwrap_or_else(|e| panic!("mount a tmpfs at {}: {e}", at.display()));
        fs::write(at.join("marker"), marker).unwrap();
        NestedMount(at.to_path_buf())
    }

    fn unmount(&self) {
        nix::mount::umount2(&self.0, nix::mount::MntFlags::MNT_DETACH).unwrap();
    }
}

impl Drop for NestedMount {
    fn drop(&mut self) {
        if is_mount_point(&self.0) {
            let _ = nix::mount::umount2(&self.0, nix::mount::MntFlags::MNT_DETACH);
        }
    }
}

#[tokio::test]
async fn a_host_mount_made_later_under_the_volume_reaches_an_rslave_container_and_not_a_private_one(
) {
    require_root();
    let sb = Sandbox::new("prop-rslave");
    let before = host_mount_points(&sb);
    let agent = Agent::start(&sb, "work", &[]).await;
    let slave = agent
        .volume("slave", "slave", VolumeMode::Rw)
        .await
        .with_mount_propagation(PropagationMode::HostToContainer);
    let private = agent.volume("private", "private", VolumeMode::Rw).await;
    let (slave_id, private_id) = (
        slave.source_id().unwrap().to_string(),
        private.source_id().unwrap().to_string(),
    );
    let rootfs = busybox_rootfs(&sb, "rootfs");
    // One container without a rootfs, one pivoted into a busybox rootfs: both see the same host events.
    let plain = config(&sb, "plain", vec![slave.clone(), private.clone()], None);
    let pivoted = config(
        &sb,
        "pivoted",
        vec![slave.clone(), private.clone()],
        Some(rootfs),
    );
    let plain_info = agent
        .isolator
        .prepare("plain", plain.clone())
        .await
        .unwrap();
    assert_eq!(
        plain_info
            .mounts
            .iter()
            .map(|m| m.propagation)
            .collect::<Vec<_>>(),
        [VolumePropagation::Rslave, VolumePropagation::Private]
    );
    let pivoted_info = agent
        .isolator
        .prepare("pivoted", pivoted.clone())
        .await
        .unwrap();
    let slave_mp = agent.provider.mount_point(&slave_id);
    let private_mp = agent.provider.mount_point(&private_id);
    fs::create_dir(slave_mp.join("sub")).unwrap();
    fs::create_dir(private_mp.join("sub")).unwrap();

    // Each container waits for the go file, then reports what it sees under each volume's sub.
    let script = "while [ ! -e slave/go ]; do sleep 0.05; done; \
                  cat slave/sub/marker > seen-slave; \
                  cat private/sub/marker > seen-private; \
                  cat /proc/self/mountinfo > mountinfo; touch seen";
    let mut c1 = start(&sb, spec(&plain, &plain_info, script)).await;
    let mut pivoted_spec = spec(&pivoted, &pivoted_info, script);
    pivoted_spec.pid_namespace = true;
    let mut c2 = start(&sb, pivoted_spec).await;
    // The containers run: mounts made now under the host mount points are "later" ones.
    let nested_slave = NestedMount::new(&slave_mp.join("sub"), "from-the-host");
    let nested_private = NestedMount::new(&private_mp.join("sub"), "from-the-host");
    fs::write(slave_mp.join("go"), "").unwrap();
    assert!(finish(&sb, &mut c1).await.success());
    assert!(finish(&sb, &mut c2).await.success());
    for c in [&plain, &pivoted] {
        wait_for(&c.sandbox.join("seen"));
        assert_eq!(
            read(&c.sandbox.join("seen-slave")),
            "from-the-host",
            "rslave: the host's later mount reached {}; host: {}; container: {}",
            c.sandbox.display(),
            fs::read_to_string("/proc/self/mountinfo")
                .unwrap()
                .lines()
                .filter(|l| l.contains(sb.path().to_str().unwrap()))
                .collect::<Vec<_>>()
                .join("\n"),
            read(&c.sandbox.join("mountinfo"))
        );
        assert_eq!(
            read(&c.sandbox.join("seen-private")),
            "",
            "private: the host's later mount must not reach {}",
            c.sandbox.display()
        );
    }
    // The host's own nested mounts are the driver's: the containers' ends left them alone.
    assert!(is_mount_point(&slave_mp.join("sub")));
    nested_slave.unmount();
    nested_private.unmount();
    agent.isolator.cleanup("plain").await.unwrap();
    agent.isolator.cleanup("pivoted").await.unwrap();
    for id in [&slave_id, &private_id] {
        assert_eq!(
            agent.provider.volume(id).await.unwrap().state,
            VolumeState::Created
        );
        agent.provider.destroy_volume(id).await.unwrap();
    }
    agent.stop().await;
    assert_clean(&sb, &before);
}

/// rshared through the launcher, pivoted into a rootfs (the order that matters: the copy is cloned
/// while still a peer of the host mount point, and kept out of the old root the pivot detaches), and
/// without one.
#[tokio::test]
async fn a_mount_an_rshared_container_makes_under_its_volume_reaches_the_host_and_is_swept_at_release(
) {
    rshared_round_trip("prop-rshared").await;
}

/// The same with the launch seed switched off (`CSI_ISOLATOR_LAUNCH_SEED=off`): the pivoted
/// container's namespace is copied from the test's, the other path's order (rshared sandbox
/// volumes attached after the sandbox's bind into the rootfs).
#[tokio::test]
async fn the_same_rshared_round_trip_without_the_launch_seed() {
    // Before any launch of this process (each test runs in its own).
    std::env::set_var(csi_isolator::launcher::SEED_ENV, "off");
    rshared_round_trip("prop-rshared-noseed").await;
}

async fn rshared_round_trip(label: &str) {
    require_root();
    let sb = Sandbox::new(label);
    let before = host_mount_points(&sb);
    let agent = Agent::start(&sb, "work", &[]).await;
    let rootfs = busybox_rootfs(&sb, "rootfs");
    for (name, rootfs) in [("pivoted", Some(rootfs)), ("plain", None)] {
        let shared = agent
            .volume(name, "data", VolumeMode::Rw)
            .await
            .with_mount_propagation(PropagationMode::Bidirectional);
        let id = shared.source_id().unwrap().to_string();
        let mp = agent.provider.mount_point(&id);
        let c = config(&sb, name, vec![shared.clone()], rootfs.clone());
        let info = agent.isolator.prepare(name, c.clone()).await.unwrap();
        // A driver's own nested mount, there before the container starts: the launcher's pivot
        // (which detaches the old root with umount propagation) must not take it from the host.
        let driver = NestedMount::new(&mp.join("driver"), "driver");
        fs::create_dir(mp.join("inner")).unwrap();
        let host_before: Vec<PathBuf> = mount_table();
        let mount = if rootfs.is_some() {
            "mount"
        } else {
            "/bin/mount"
        };
        let script = format!(
            "{mount} -t tmpfs tmpfs data/inner && echo from-the-container > data/inner/m && \
             mkdir -p elsewhere && {mount} -t tmpfs tmpfs elsewhere && \
             cat data/driver/marker > seen-driver && touch data/ready && \
             while [ ! -e data/done ]; do sleep 0.05; done"
        );
        let mut running = start(&sb, spec(&c, &info, &script)).await;
        wait_for(&mp.join("ready"));
        // Both ways: the container saw the driver's mount, and its own mount is on the host, under
        // the volume's mount point.
        assert_eq!(read(&c.sandbox.join("seen-driver")), "driver");
        assert_eq!(read(&mp.join("inner/m")), "from-the-container\n");
        assert!(
            is_mount_point(&mp.join("driver")),
            "the pivot took the driver's mount"
        );
        // Nothing the container mounted landed anywhere but beneath the volume's mount point (its
        // tmpfs beside the volume, in its sandbox, stayed in its namespace).
        // (Other tests' mounts come and go meanwhile: only this sandbox's are compared.)
        let added: Vec<PathBuf> = mount_table()
            .into_iter()
            .filter(|m| m.starts_with(sb.path()) && !host_before.contains(m))
            .collect();
        assert_eq!(added, [mp.join("inner")], "{name}: new host mounts");
        fs::write(mp.join("done"), "").unwrap();
        assert!(finish(&sb, &mut running).await.success());
        // The container's namespace is gone, its mount on the host is not (until release).
        assert!(is_mount_point(&mp.join("inner")));
        driver.unmount();
        agent.isolator.cleanup(name).await.unwrap();
        assert_eq!(
            agent.provider.volume(&id).await.unwrap().state,
            VolumeState::Created,
            "{name}: released and unpublished despite the propagated mount"
        );
        assert!(!is_mount_point(&mp.join("inner")));
        agent.provider.destroy_volume(&id).await.unwrap();
    }
    agent.stop().await;
    assert_clean(&sb, &before);
}

fn mount_table() -> Vec<PathBuf> {
    ProcMountTable::new()
        .mounts()
        .unwrap()
        .into_iter()
        .map(|m| m.mount_point)
        .collect()
}

/// The update path: a running container (pivoted into a rootfs, in its own pid namespace) gains an
/// rslave volume by `update`, and a tmpfs mounted on the host under that volume's mount point
/// afterwards reaches it; a private volume gained by the same update sees nothing of the same kind of
/// mount. Removing them again by update and cleanup leaves the host table as it was.
#[tokio::test]
async fn a_volume_gained_by_update_with_rslave_sees_a_later_host_mount_and_a_private_one_does_not()
{
    require_root();
    let sb = Sandbox::new("prop-update");
    let before = host_mount_points(&sb);
    let agent = Agent::start(&sb, "work", &[]).await;
    let base = agent.volume("base", "base", VolumeMode::Rw).await;
    let slave = agent
        .volume("slave", "slave", VolumeMode::Rw)
        .await
        .with_mount_propagation(PropagationMode::HostToContainer);
    let private = agent.volume("private", "private", VolumeMode::Rw).await;
    let ids: Vec<String> = [&base, &slave, &private]
        .iter()
        .map(|r| r.source_id().unwrap().to_string())
        .collect();
    let rootfs = busybox_rootfs(&sb, "rootfs");
    let c = config(&sb, "c1", vec![base.clone()], Some(rootfs));
    let info = agent.isolator.prepare("c1", c.clone()).await.unwrap();
    let base_mp = agent.provider.mount_point(&ids[0]);
    let script = format!(
        "while [ ! -e {sandbox}/slave/go ]; do sleep 0.05; done; \
         cat {sandbox}/slave/sub/marker > {sandbox}/base/seen-slave; \
         cat {sandbox}/private/sub/marker > {sandbox}/base/seen-private; \
         touch {sandbox}/base/seen; while [ ! -e {sandbox}/base/done ]; do sleep 0.05; done",
        sandbox = csi_isolator::mount::SANDBOX_IN_ROOTFS
    );
    let mut launch = spec(&c, &info, &script);
    launch.pid_namespace = true;
    let mut running = start(&sb, launch).await;
    agent.isolator.isolate("c1", running.pid()).await.unwrap();
    agent
        .isolator
        .update("c1", vec![base.clone(), slave.clone(), private.clone()])
        .await
        .unwrap();
    let slave_mp = agent.provider.mount_point(&ids[1]);
    let private_mp = agent.provider.mount_point(&ids[2]);
    // The container runs with the volumes: mounts made now are "later" ones.
    let nested_slave = NestedMount::new(&slave_mp.join("sub"), "from-the-host");
    let nested_private = NestedMount::new(&private_mp.join("sub"), "from-the-host");
    fs::write(slave_mp.join("go"), "").unwrap();
    wait_for(&base_mp.join("seen"));
    assert_eq!(
        read(&base_mp.join("seen-slave")),
        "from-the-host",
        "rslave by update: the host's later mount reaches the container"
    );
    assert_eq!(
        read(&base_mp.join("seen-private")),
        "",
        "private by update: the host's later mount must not reach the container"
    );
    // Taken away again while the host's nested mounts are still there: the update unmounts the
    // container's copies and releases the volumes, whose unpublish sweeps what is under them.
    agent
        .isolator
        .update("c1", vec![base.clone()])
        .await
        .unwrap();
    for nested in [&nested_slave, &nested_private] {
        assert!(!is_mount_point(&nested.0), "{} left", nested.0.display());
    }
    for id in &ids[1..] {
        assert_eq!(
            agent.provider.volume(id).await.unwrap().state,
            VolumeState::Created,
            "released by the update"
        );
    }
    fs::write(base_mp.join("done"), "").unwrap();
    assert!(finish(&sb, &mut running).await.success());
    agent.isolator.cleanup("c1").await.unwrap();
    for id in &ids {
        agent.provider.destroy_volume(id).await.unwrap();
    }
    agent.stop().await;
    assert_clean(&sb, &before);
}
