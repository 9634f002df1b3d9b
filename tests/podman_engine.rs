//! `csi-isolator docker-plugin` driven by a real Podman (issue 12): Podman speaks the Docker
//! volume plugin protocol to the sockets its `containers.conf` names under
//! `[engine.volume_plugins]`. Everything Podman keeps goes under the test's sandbox (`--root`,
//! `--runroot`, `--tmpdir`, its own `containers.conf` with `--network none` and explicit
//! ulimits, which root without CAP_SYS_RESOURCE needs here); the few files Podman makes at fixed
//! host paths on its first run are removed when this test made them
//! (`csi_isolator_testing::engines::HostPaths`, which runs engine tests one at a time).

use std::process::Output;

use csi_isolator::mount::{MountTable, ProcMountTable};
use csi_isolator_testing::engines::{require_engine, HostPaths, Podman, PODMAN_HOST_PATHS};
use csi_isolator_testing::{
    isolator_command, processes_mentioning, require_root, DockerPluginProcess, Sandbox,
};
use nix::sys::signal::Signal;

const BIN: &str = env!("CARGO_BIN_EXE_csi-isolator");
/// The driver name Podman knows the plugin by (a key of `[engine.volume_plugins]`).
const DRIVER: &str = "csitest";

#[test]
fn podman_creates_mounts_shares_and_removes_a_csi_volume_through_the_plugin() {
    require_root();
    require_engine("podman", "podman");
    let host_paths = HostPaths::claim(PODMAN_HOST_PATHS);
    let sb = Sandbox::new("podman-engine");
    let work = sb.join("work");
    let socket = sb.join("plugin/csi-isolator.sock");
    let plugin = DockerPluginProcess::start(&sb, BIN, &work, &socket, &[]);
    let podman = Podman::new(&sb, &[(DRIVER, &socket)]);
    let image = podman.import_busybox(&sb);
    let table = ProcMountTable::new();
    let mounted_under_work = || {
        table
            .mounts()
            .unwrap()
            .into_iter()
            .filter(|m| m.mount_point.starts_with(&work))
            .count()
    };

    // Created through the plugin with its options, a 16 MiB ext4 volume (the default backing).
    podman.ok(&[
        "volume", "create", "--driver", DRIVER, "-o", "size=16M", "v1",
    ]);
    let inspect = podman.ok(&["volume", "inspect", "v1"]);
    assert!(
        inspect.contains(&format!("\"Driver\": \"{DRIVER}\"")),
        "{inspect}"
    );
    let run = |volume: &str, script: &str| -> Output {
        podman.command(&["run", "--rm", "-v", volume, &image, "/bin/sh", "-c", script])
    };
    let out = run("v1:/data", "echo hello > /data/f && df -k /data | tail -1");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let df = String::from_utf8_lossy(&out.stdout).into_owned();
    let total_kib: u64 = df
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("df: {df}"));
    assert!(
        (8_000..=16_384).contains(&total_kib),
        "the container sees the 16 MiB volume, not the host's disk: {df}"
    );
    // A second container reads it; read-only refuses writes.
    let out = run("v1:/data:ro", "cat /data/f; echo x > /data/g");
    assert!(
        !out.status.success(),
        "a write to a read-only volume succeeded"
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), "hello\n");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("Read-only file system"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Between runs the volume is not left mounted.
    assert_eq!(
        mounted_under_work(),
        0,
        "published after the containers left"
    );

    // A malformed option reaches the user through Podman, naming it; nothing is created.
    let err = podman.fails(&[
        "volume",
        "create",
        "--driver",
        DRIVER,
        "-o",
        "size=lots",
        "v2",
    ]);
    assert!(err.contains("size") && err.contains("lots"), "{err}");
    let listed = podman.ok(&["volume", "ls", "--format", "{{.Name}}"]);
    assert!(!listed.contains("v2"), "{listed}");

    // Removed through the plugin: DeleteVolume, and nothing of it is left.
    podman.ok(&["volume", "rm", "v1"]);
    let listed = podman.ok(&["volume", "ls", "--format", "{{.Name}}"]);
    assert!(!listed.contains("v1"), "{listed}");
    podman.ok(&["rmi", &image]);

    assert!(plugin.stop(&sb, Signal::SIGTERM).success());
    let status = isolator_command(BIN, &work)
        .args(["status", "--json"])
        .output()
        .unwrap();
    let report: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(
        report["volumes"],
        serde_json::json!([]),
        "deleted: {report}"
    );
    assert_eq!(mounted_under_work(), 0);
    sb.assert_no_loop_devices();
    assert!(
        processes_mentioning(sb.path()).is_empty(),
        "no conmon or container left"
    );
    drop(podman);
    drop(sb);
    host_paths.assert_restored();
}
