//! `csi-isolator oci-hook` as runc's createRuntime and poststop hooks: a busybox bundle whose config.json
//! names CSI volumes by annotation, run to completion with `runc run` (which runs poststop when it
//! destroys the container). The volumes come from the bundled csi-test-plugin under the test's work dir.
//!
//! Needs root, `runc` on PATH and `/bin/busybox` (package busybox-static); nothing is installed at test
//! time (`.ci/run` installs them).

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use csi_isolator::isolator::hook::{HOOK_DIR, VOLUMES_ANNOTATION};
use csi_isolator::mount::{MountTable, ProcMountTable};
use csi_isolator::provider::bundled::bundled_config;
use csi_isolator::provider::state::VolumeState;
use csi_isolator::provider::StorageProvider;
use csi_isolator::testing::{busybox_rootfs, host_mount_points, require_root, Sandbox};

const BIN: &str = env!("CARGO_BIN_EXE_csi-isolator");
const PLUGIN: &str = env!("CARGO_BIN_EXE_csi-test-plugin");
const RUN_TIMEOUT: Duration = Duration::from_secs(90);

/// Root, runc and busybox, or a panic saying what is missing.
fn require_tools() {
    require_root();
    let runc = Command::new("runc")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    if !matches!(runc, Ok(s) if s.success()) {
        panic!("`runc` is not on PATH: install the Debian package `runc` (apt-get install runc); this test does not skip");
    }
}

/// A bundle (config.json from `runc spec`, busybox rootfs at the relative root path `rootfs`) whose hooks
/// run `csi-isolator --work-dir <work> oci-hook ...`.
struct Bundle {
    dir: PathBuf,
    rootfs: PathBuf,
    work: PathBuf,
    state: PathBuf,
    config: serde_json::Value,
}

fn build_bundle(sb: &Sandbox) -> Bundle {
    let dir = sb.mkdir("bundle");
    let rootfs = busybox_rootfs(sb, "bundle/rootfs");
    let work = sb.join("work");
    let out = Command::new("runc")
        .arg("spec")
        .arg("--bundle")
        .arg(&dir)
        .output()
        .expect("run `runc spec`");
    assert!(
        out.status.success(),
        "runc spec failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = fs::read_to_string(dir.join("config.json")).expect("read generated config.json");
    let mut config: serde_json::Value = serde_json::from_str(&text).expect("parse config.json");
    config["process"]["terminal"] = false.into();
    // Relative to the bundle, as runtime-spec allows: the hook must resolve it the same way.
    config["root"]["path"] = "rootfs".into();
    config["root"]["readonly"] = false.into();
    let hook = |stage: &str| {
        serde_json::json!([{
            "path": BIN,
            "args": ["csi-isolator", "--work-dir", work.to_str().unwrap(), "oci-hook",
                     "--plugin-socket-dir", work.parent().unwrap().join("s").to_str().unwrap(), stage],
        }])
    };
    config["hooks"] = serde_json::json!({
        "createRuntime": hook("create-runtime"),
        "poststop": hook("poststop"),
    });
    Bundle {
        dir,
        rootfs,
        work,
        state: sb.join("runc-state"),
        config,
    }
}

/// Deletes the container (forcibly) when dropped, pass or fail.
struct ContainerGuard {
    state: PathBuf,
    id: String,
}

impl Drop for ContainerGuard {
    fn drop(&mut self) {
        let _ = Command::new("runc")
            .arg("--root")
            .arg(&self.state)
            .args(["delete", "--force", &self.id])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// The result of one `runc run`.
struct Run {
    id: String,
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

/// Writes config.json with `script` as the process and `volumes` as the volume annotation, then runs the
/// container to completion (`runc run`, which destroys it and runs poststop at the end).
fn run(sb: &Sandbox, bundle: &Bundle, name: &str, volumes: &str, script: &str) -> Run {
    let mut config = bundle.config.clone();
    config["process"]["args"] = serde_json::json!(["sh", "-c", script]);
    config["annotations"] = serde_json::json!({ VOLUMES_ANNOTATION: volumes });
    fs::write(
        bundle.dir.join("config.json"),
        serde_json::to_vec_pretty(&config).unwrap(),
    )
    .expect("write config.json");

    let id = format!("csi-hook-{name}-{}", std::process::id());
    let _guard = ContainerGuard {
        state: bundle.state.clone(),
        id: id.clone(),
    };
    let mut child = sb
        .spawn(
            Command::new("runc")
                .arg("--root")
                .arg(&bundle.state)
                .args(["run", "--bundle"])
                .arg(&bundle.dir)
                .arg(&id)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped()),
        )
        .expect("spawn `runc run`");
    let deadline = Instant::now() + RUN_TIMEOUT;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for runc") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            sb.untrack(child.id());
            panic!("runc run {id} did not finish within {RUN_TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    sb.untrack(child.id());
    let mut stdout = String::new();
    let mut stderr = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut stdout)
        .unwrap();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    Run {
        id,
        code: status.code(),
        stdout,
        stderr,
    }
}

fn assert_ran(r: &Run) {
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
fn assert_container_gone(sb: &Sandbox, bundle: &Bundle, r: &Run) {
    sb.assert_no_mounts_under();
    let checkpoint = bundle.work.join("isolators/volume/csi").join(&r.id);
    assert!(!checkpoint.exists(), "{} left", checkpoint.display());
    let dir = bundle.work.join(HOOK_DIR).join(&r.id);
    assert!(!dir.exists(), "{} left", dir.display());
}

/// The volume `name` as the provider on the work dir sees it: (state, users, mount point mounted?).
async fn volume_status(sb: &Sandbox, work: &Path, name: &str) -> (VolumeState, Vec<String>, bool) {
    let mut config = bundled_config(Path::new(PLUGIN), work, "default", &[]);
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
        r.stderr.contains("mount volume 'second' (vol-") && r.stderr.contains("at /afile: attach:"),
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
