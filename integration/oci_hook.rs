//! `csi-isolator oci-hook` as runc's createRuntime and poststop hooks: a busybox bundle whose config.json
//! names CSI volumes by annotation, run to completion with `runc run` (which runs poststop when it
//! destroys the container). The volumes come from the bundled csi-test-plugin under the test's work dir.
//!
//! Needs root, `runc` on PATH and `/bin/busybox` (package busybox-static); nothing is installed at test
//! time (`.ci/run` installs them).

use csi_isolator_testing::plugin_bin;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use csi_isolator::isolator::hook::{HOOK_DIR, MOUNTS_ANNOTATION, VOLUMES_ANNOTATION};
use csi_isolator::mount::{MountTable, ProcMountTable};
use csi_isolator::provider::bundled::bundled_config;
use csi_isolator::provider::state::VolumeState;
use csi_isolator::provider::StorageProvider;
use csi_isolator_testing::{
    host_mount_points, require_root, require_runc, runc_run, set_oci_hooks, RuncBundle, RuncRun,
    Sandbox,
};

const BIN: &str = env!("CARGO_BIN_EXE_csi-isolator");
const RUN_TIMEOUT: Duration = Duration::from_secs(90);

/// Root and runc, or a panic saying what is missing (busybox is checked when the bundle is built).
fn require_tools() {
    require_root();
    require_runc();
}

/// A bundle (config.json from `runc spec`, busybox rootfs at the relative root path `rootfs`) whose hooks
/// run `csi-isolator --work-dir <work> oci-hook ...`.
struct Bundle {
    runc: RuncBundle,
    rootfs: PathBuf,
    work: PathBuf,
}

fn build_bundle(sb: &Sandbox) -> Bundle {
    // The root path stays relative to the bundle, as runtime-spec allows: the hook must resolve it the
    // same way.
    let mut runc = RuncBundle::new(sb, "bundle");
    assert_eq!(runc.config["root"]["path"], "rootfs");
    let work = sb.join("work");
    set_oci_hooks(&mut runc, Path::new(BIN), &work, &sb.join("s"), &[]);
    Bundle {
        rootfs: runc.rootfs.clone(),
        runc,
        work,
    }
}

/// Writes config.json with `script` as the process and `volumes` as the volume annotation, then runs the
/// container to completion (`runc run`, which destroys it and runs poststop at the end).
fn run(sb: &Sandbox, bundle: &Bundle, name: &str, volumes: &str, script: &str) -> RuncRun {
    let annotations = serde_json::json!({ VOLUMES_ANNOTATION: volumes });
    run_annotated(sb, bundle, name, annotations, script)
}

/// [`run`] with the annotations given.
fn run_annotated(
    sb: &Sandbox,
    bundle: &Bundle,
    name: &str,
    annotations: serde_json::Value,
    script: &str,
) -> RuncRun {
    let mut config = bundle.runc.config_for(script);
    config["annotations"] = annotations;
    let id = format!("csi-hook-{name}-{}", std::process::id());
    let r = runc_run(sb, &bundle.runc, &id, &config, RUN_TIMEOUT);
    // The forced delete runs right away, before the test looks at what is left (the guard's own
    // delete at drop then finds nothing).
    let _ = r.guard.delete();
    r
}

fn assert_ran(r: &RuncRun) {
    assert_eq!(
        r.code,
        Some(0),
        "container {} failed\nstdout:\n{}\nstderr:\n{}",
        r.id,
        r.stdout,
        r.stderr
    );
}

/// Nothing of the container is left: no mount under the sandbox, no isolator checkpoint, no hook dir.
fn assert_container_gone(sb: &Sandbox, bundle: &Bundle, r: &RuncRun) {
    sb.assert_no_mounts_under();
    let checkpoint = bundle.work.join("isolators/volume/csi").join(&r.id);
    assert!(!checkpoint.exists(), "{} left", checkpoint.display());
    let dir = bundle.work.join(HOOK_DIR).join(&r.id);
    assert!(!dir.exists(), "{} left", dir.display());
}

/// The volume `name` as the provider on the work dir sees it: (state, users, mount point mounted?).
async fn volume_status(sb: &Sandbox, work: &Path, name: &str) -> (VolumeState, Vec<String>, bool) {
    let mut config = bundled_config(Path::new(plugin_bin()), work, "default", &[]);
    config.socket_dir = sb.join("s");
    config.ready_timeout = Duration::from_secs(10);
    let provider = StorageProvider::start(config)
        .await
        .expect("start the provider on the hook's work dir");
    if let Some(pid) = provider.plugin_pid() {
        sb.track(pid);
    }
    let rec = provider
        .find_by_name(name)
        .await
        .unwrap_or_else(|| panic!("volume {name} not found"));
    let mounted = ProcMountTable::new()
        .is_mount_point(&provider.mount_point(&rec.volume_id))
        .unwrap();
    provider.shutdown(Duration::from_secs(5)).await;
    (rec.state, rec.users.into_iter().collect(), mounted)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volume_is_written_through_and_released_at_poststop() {
    require_tools();
    let sb = Sandbox::new("hook-rw");
    let bundle = build_bundle(&sb);
    let before = host_mount_points(&sb);

    let r = run(
        &sb,
        &bundle,
        "write",
        "data:16M:/data",
        "echo hi > /data/f && grep ' /data ' /proc/mounts",
    );
    assert_ran(&r);
    assert!(r.stdout.contains(" /data "), "mounted: {}", r.stdout);
    // The mount point was made in the rootfs; the data went to the volume, not there.
    assert!(bundle.rootfs.join("data").is_dir());
    assert!(!bundle.rootfs.join("data/f").exists());
    assert_container_gone(&sb, &bundle, &r);
    let (state, users, mounted) = volume_status(&sb, &bundle.work, "data").await;
    assert!(users.is_empty(), "users left: {users:?}");
    assert_ne!(state, VolumeState::Published, "unpublished at poststop");
    assert!(!mounted, "the volume's mount point is unmounted");

    // The same name is the same volume: a second container reads what the first wrote.
    let r2 = run(&sb, &bundle, "read", "data:16M:/data", "cat /data/f");
    assert_ran(&r2);
    assert_eq!(r2.stdout, "hi\n");
    assert_container_gone(&sb, &bundle, &r2);
    let (_, users, mounted) = volume_status(&sb, &bundle.work, "data").await;
    assert!(users.is_empty() && !mounted, "{users:?} {mounted}");
    assert_eq!(host_mount_points(&sb), before, "host mount table unchanged");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readonly_annotation_refuses_writes_inside() {
    require_tools();
    let sb = Sandbox::new("hook-ro");
    let bundle = build_bundle(&sb);
    let r = run(
        &sb,
        &bundle,
        "ro",
        "ref:16M:/ref:ro",
        "touch /ref/x 2>&1; echo rc=$?; grep ' /ref ' /proc/mounts",
    );
    assert_ran(&r);
    assert!(r.stdout.contains("rc=1"), "stdout: {}", r.stdout);
    assert!(
        r.stdout.contains("Read-only file system"),
        "stdout: {}",
        r.stdout
    );
    assert!(r.stdout.contains(" /ref "), "mounted: {}", r.stdout);
    assert!(
        r.stdout
            .lines()
            .any(|l| l.contains(" /ref ") && l.split(' ').nth(3).unwrap_or("").starts_with("ro")),
        "mounted read-only: {}",
        r.stdout
    );
    assert_container_gone(&sb, &bundle, &r);
    let (_, users, mounted) = volume_status(&sb, &bundle.work, "ref").await;
    assert!(users.is_empty() && !mounted, "{users:?} {mounted}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_annotation_fails_the_start_and_leaves_nothing() {
    require_tools();
    let sb = Sandbox::new("hook-bad");
    let bundle = build_bundle(&sb);
    let before = host_mount_points(&sb);
    let r = run(
        &sb,
        &bundle,
        "bad",
        "ok:16M:/ok,bad:lots:/data",
        "echo started",
    );
    assert_ne!(r.code, Some(0), "runc must fail: {}", r.stderr);
    assert!(!r.stdout.contains("started"), "the workload never ran");
    assert_eq!(
        r.stderr.matches("csi-isolator:").count(),
        1,
        "one line: {}",
        r.stderr
    );
    assert!(
        r.stderr
            .contains("stderr: csi-isolator: oci-hook create-runtime: container 'csi-hook-bad-")
            && r.stderr.contains(
                "annotation io.csi-isolator.volumes: volume 'bad:lots:/data': invalid SIZE 'lots'"
            ),
        "runc's stderr names the volume: {}",
        r.stderr
    );
    assert_container_gone(&sb, &bundle, &r);
    assert_eq!(host_mount_points(&sb), before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_after_publish_releases_what_was_published() {
    require_tools();
    let sb = Sandbox::new("hook-rollback");
    let bundle = build_bundle(&sb);
    // The second target is a file in the rootfs: the first volume is published and mounted, then the
    // second cannot be mounted (a directory tree onto a file), so everything is rolled back.
    fs::write(bundle.rootfs.join("afile"), "x").unwrap();
    let r = run(
        &sb,
        &bundle,
        "rollback",
        "first:16M:/first,second:16M:/afile",
        "echo started",
    );
    assert_ne!(r.code, Some(0), "runc must fail: {}", r.stderr);
    assert!(!r.stdout.contains("started"));
    assert_eq!(
        r.stderr.matches("csi-isolator:").count(),
        1,
        "one line: {}",
        r.stderr
    );
    assert!(
        r.stderr
            .contains("mount volume 'second' of the single tenant (vol-")
            && r.stderr.contains("at /afile: attach:"),
        "runc's stderr names the volume: {}",
        r.stderr
    );
    assert_container_gone(&sb, &bundle, &r);
    for name in ["first", "second"] {
        let (state, users, mounted) = volume_status(&sb, &bundle.work, name).await;
        assert!(users.is_empty(), "{name}: users left: {users:?}");
        assert_ne!(state, VolumeState::Published, "{name}");
        assert!(!mounted, "{name}: mount point still mounted");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn symlink_in_rootfs_keeps_the_mount_inside_it() {
    require_tools();
    let sb = Sandbox::new("hook-link");
    let bundle = build_bundle(&sb);
    // What an image could carry: /data pointing at the host's /etc (absolute, as seen before pivot_root).
    std::os::unix::fs::symlink("/etc", bundle.rootfs.join("data")).unwrap();
    let etc_mounts_before = host_mount_points(&sb)
        .iter()
        .filter(|p| p.starts_with("/etc"))
        .count();
    let marker = format!("csi-hook-marker-{}", std::process::id());
    let r = run(
        &sb,
        &bundle,
        "link",
        "link:16M:/data",
        &format!("echo mine > /data/{marker} && cat /etc/{marker}"),
    );
    assert_ran(&r);
    assert_eq!(r.stdout, "mine\n");
    assert!(
        !Path::new("/etc").join(&marker).exists(),
        "host /etc untouched"
    );
    // Resolved inside the rootfs: the mount point is the rootfs's own /etc.
    assert!(bundle.rootfs.join("etc").is_dir());
    assert!(!bundle.rootfs.join("etc").join(&marker).exists());
    assert_eq!(
        host_mount_points(&sb)
            .iter()
            .filter(|p| p.starts_with("/etc"))
            .count(),
        etc_mounts_before
    );
    assert_container_gone(&sb, &bundle, &r);
    // The write is in the volume.
    let r2 = run(
        &sb,
        &bundle,
        "link-read",
        "link:16M:/v",
        &format!("cat /v/{marker}"),
    );
    assert_ran(&r2);
    assert_eq!(r2.stdout, "mine\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mounts_annotation_takes_the_long_form_with_its_options() {
    require_tools();
    let sb = Sandbox::new("hook-mounts");
    let bundle = build_bundle(&sb);
    let annotations = serde_json::json!({
        MOUNTS_ANNOTATION: "source=data,target=/data,size=16M,fs-type=ext4; \
                            source=ref,target=/ref,size=8M,readonly",
    });
    let r = run_annotated(
        &sb,
        &bundle,
        "long",
        annotations,
        "echo hi > /data/f && cat /data/f && grep -E ' /(data|ref) ' /proc/mounts \
         && ! echo x > /ref/f",
    );
    assert_ran(&r);
    assert!(r.stdout.starts_with("hi\n"), "{}", r.stdout);
    let ref_line = r
        .stdout
        .lines()
        .find(|l| l.contains(" /ref "))
        .unwrap_or_else(|| panic!("/ref mounted: {}", r.stdout));
    assert!(
        ref_line.contains(" ro,") || ref_line.contains(" ro "),
        "{ref_line}"
    );
    assert_container_gone(&sb, &bundle, &r);
    let (_, users, mounted) = volume_status(&sb, &bundle.work, "data").await;
    assert!(users.is_empty() && !mounted, "{users:?} {mounted}");

    // The same volume asked with another capability: refused, naming both; nothing started.
    let other = run_annotated(
        &sb,
        &bundle,
        "remode",
        serde_json::json!({ MOUNTS_ANNOTATION: "source=data,target=/data,size=16M,fs-type=ext3" }),
        "echo started",
    );
    assert_ne!(other.code, Some(0));
    assert!(!other.stdout.contains("started"));
    assert!(
        other.stderr.contains("exists with capability SINGLE_NODE_WRITER fs_type=ext4, not SINGLE_NODE_WRITER fs_type=ext3"),
        "{}",
        other.stderr
    );
    assert_container_gone(&sb, &bundle, &other);

    // A flag only the operator may set, from an annotation: the container does not start.
    let refused = run_annotated(
        &sb,
        &bundle,
        "suid",
        serde_json::json!({ MOUNTS_ANNOTATION: "source=s,target=/s,size=8M,mount-flags=suid" }),
        "true",
    );
    assert_ne!(refused.code, Some(0));
    assert!(
        refused.stderr.contains("mount flag 'suid' refused"),
        "{}",
        refused.stderr
    );
    assert_container_gone(&sb, &bundle, &refused);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_root_process_user_writes_its_volume() {
    require_tools();
    let sb = Sandbox::new("hook-user");
    let bundle = build_bundle(&sb);
    let mut config = bundle
        .runc
        .config_for("id -u && id -g && echo mine > /data/f && stat -c '%u:%g' /data/f /data");
    config["annotations"] = serde_json::json!({ VOLUMES_ANNOTATION: "data:16M:/data" });
    config["process"]["user"] = serde_json::json!({"uid": 1234, "gid": 1235});
    let id = format!("csi-hook-user-{}", std::process::id());
    let r = runc_run(&sb, &bundle.runc, &id, &config, RUN_TIMEOUT);
    let _ = r.guard.delete();
    assert_ran(&r);
    assert_eq!(r.stdout, "1234\n1235\n1234:1235\n0:1235\n");
    assert_container_gone(&sb, &bundle, &r);
}

/// The same through a bundled plugin offering VOLUME_MOUNT_GROUP: the hook's publish gives the
/// process user's group to NodeStage and NodePublish, and the plugin (not the isolator) makes
/// the volume root the group's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_root_process_user_gets_its_volume_from_a_plugin_with_volume_mount_group() {
    require_tools();
    let sb = Sandbox::new("hook-mount-group");
    let mut runc = RuncBundle::new(&sb, "bundle");
    let work = sb.join("work");
    set_oci_hooks(
        &mut runc,
        Path::new(BIN),
        &work,
        &sb.join("s"),
        &["--plugin-arg=--volume-mount-group"],
    );
    let bundle = Bundle {
        rootfs: runc.rootfs.clone(),
        runc,
        work,
    };
    let mut config = bundle
        .runc
        .config_for("id -u && id -g && echo mine > /data/f && stat -c '%u:%g' /data/f /data");
    config["annotations"] = serde_json::json!({ VOLUMES_ANNOTATION: "data:16M:/data" });
    config["process"]["user"] = serde_json::json!({"uid": 1234, "gid": 1235});
    let id = format!("csi-hook-group-{}", std::process::id());
    let r = runc_run(&sb, &bundle.runc, &id, &config, RUN_TIMEOUT);
    let _ = r.guard.delete();
    assert_ran(&r);
    assert_eq!(r.stdout, "1234\n1235\n1234:1235\n0:1235\n");
    assert_container_gone(&sb, &bundle, &r);
    // The plugin's log under the work dir: the group reached both node calls.
    let mut logs = String::new();
    let mut dirs = vec![bundle.work.clone()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let kind = entry.file_type().unwrap();
            if kind.is_dir() {
                dirs.push(entry.path());
            } else if entry.file_name() == "plugin.log" {
                logs.push_str(&std::fs::read_to_string(entry.path()).unwrap_or_default());
            }
        }
    }
    let given: Vec<&str> = logs
        .lines()
        .filter(|l| l.contains("volume root given the volume_mount_group"))
        .collect();
    assert!(
        given.len() == 2 && given.iter().all(|l| l.contains("1235")),
        "{logs}"
    );
}

/// A block volume named by the hook's annotation is refused (the hook runs after runc set the
/// device cgroup, so it could not let the container open the device), naming the volume and
/// what to use instead; what was published for it is released and nothing is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_volume_is_refused_by_the_hook_and_released() {
    require_tools();
    let sb = Sandbox::new("hook-block");
    let bundle = build_bundle(&sb);
    {
        let mut config = bundled_config(Path::new(plugin_bin()), &bundle.work, "default", &[]);
        config.socket_dir = sb.join("s");
        config.ready_timeout = Duration::from_secs(10);
        let provider = StorageProvider::start(config)
            .await
            .expect("start provider");
        if let Some(pid) = provider.plugin_pid() {
            sb.track(pid);
        }
        let mut spec = csi_isolator::provider::CreateSpec::new("blk", 16 << 20);
        spec.capability.access_type = csi_isolator::provider::AccessType::Block;
        provider
            .create_volume(spec)
            .await
            .expect("create block volume");
        provider.shutdown(Duration::from_secs(5)).await;
    }
    let r = run(&sb, &bundle, "block", "blk:16M:/disk", "echo started");
    assert_ne!(r.code, Some(0), "runc must fail: {}", r.stderr);
    assert!(!r.stdout.contains("started"));
    assert!(
        r.stderr.contains("is a block volume") && r.stderr.contains("PrepareOci"),
        "{}",
        r.stderr
    );
    assert_container_gone(&sb, &bundle, &r);
    let (state, users, mounted) = volume_status(&sb, &bundle.work, "blk").await;
    assert!(users.is_empty(), "users left: {users:?}");
    assert_ne!(state, VolumeState::Published);
    assert!(!mounted);
    sb.assert_no_loop_devices();
}

/// rslave through the OCI hook: a raw resource (the operator allows them) names a CSI volume with
/// `mount_propagation` `HOST_TO_CONTAINER`; the hook shares its host mount point, attaches its copy in
/// the container's namespace and makes it a slave there; a tmpfs the host mounts under the volume
/// while the container runs is seen inside, and poststop's release leaves nothing mounted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_later_host_mount_reaches_an_rslave_volume_through_the_hook() {
    use csi_isolator::isolator::hook::RESOURCES_ANNOTATION;
    use csi_isolator::provider::CreateSpec;
    use csi_isolator::resource::{PropagationMode, VolumeMode};
    require_tools();
    let sb = Sandbox::new("hook-rslave");
    let mut runc = RuncBundle::new(&sb, "bundle");
    let work = sb.join("work");
    set_oci_hooks(
        &mut runc,
        Path::new(BIN),
        &work,
        &sb.join("s"),
        &["--allow-raw-resources"],
    );
    let before = host_mount_points(&sb);
    // The volume is made first, by a provider on the hook's work dir; the hook publishes it.
    let mut config = bundled_config(Path::new(plugin_bin()), &work, "default", &[]);
    config.socket_dir = sb.join("s");
    config.ready_timeout = Duration::from_secs(10);
    let provider = StorageProvider::start(config)
        .await
        .expect("start provider");
    if let Some(pid) = provider.plugin_pid() {
        sb.track(pid);
    }
    let res = provider
        .create_volume(CreateSpec::new("v", 16 << 20))
        .await
        .expect("create volume")
        .with_volume("/data", VolumeMode::Rw)
        .with_mount_propagation(PropagationMode::HostToContainer);
    let mount_point = provider.mount_point(res.source_id().unwrap());
    provider.shutdown(Duration::from_secs(5)).await;

    let mut config = runc.config_for(
        "touch /data/ready; while [ ! -e /data/go ]; do sleep 0.05; done; cat /data/sub/marker",
    );
    config["annotations"] =
        serde_json::json!({ RESOURCES_ANNOTATION: serde_json::to_string(&vec![res]).unwrap() });
    let id = format!("csi-hook-rslave-{}", std::process::id());
    let nested = mount_point.join("sub");
    let r = std::thread::scope(|scope| {
        let running = scope.spawn(|| runc_run(&sb, &runc, &id, &config, RUN_TIMEOUT));
        let deadline = std::time::Instant::now() + RUN_TIMEOUT;
        while !mount_point.join("ready").exists() {
            assert!(
                std::time::Instant::now() < deadline,
                "the container never started"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        fs::create_dir(&nested).unwrap();
        nix::mount::mount(
            Some("tmpfs"),
            &nested,
            Some("tmpfs"),
            nix::mount::MsFlags::empty(),
            Some("size=1M"),
        )
        .unwrap();
        fs::write(nested.join("marker"), "from-the-host").unwrap();
        fs::write(mount_point.join("go"), "").unwrap();
        running.join().unwrap()
    });
    let _ = r.guard.delete();
    assert_ran(&r);
    assert_eq!(r.stdout, "from-the-host");
    // poststop released the volume: its mount point, and the host's mount beneath it, are gone.
    assert!(!ProcMountTable::new().is_mount_point(&nested).unwrap());
    assert!(!ProcMountTable::new().is_mount_point(&mount_point).unwrap());
    assert_eq!(host_mount_points(&sb), before, "host mount table");
    sb.assert_no_mounts_under();
}
