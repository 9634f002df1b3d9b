//! `csi-isolator docker-plugin` driven by a real Podman (issue 12): Podman speaks the Docker
//! volume plugin protocol to the sockets its `containers.conf` names under
//! `[engine.volume_plugins]`. Everything Podman keeps goes under the test's sandbox (`--root`,
//! `--runroot`, `--tmpdir`, its own `containers.conf` with `--network none` and explicit
//! ulimits, which root without CAP_SYS_RESOURCE needs here); the few files Podman makes at fixed
//! host paths on its first run are removed when this test made them. One test function, so
//! no two Podman runs share those paths at once.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use csi_isolator::mount::{MountTable, ProcMountTable};
use csi_isolator_testing::{
    isolator_command, processes_mentioning, require_root, DockerPluginProcess, Sandbox,
};
use nix::sys::signal::Signal;

const BIN: &str = env!("CARGO_BIN_EXE_csi-isolator");
const TIMEOUT: Duration = Duration::from_secs(60);
/// The driver name Podman knows the plugin by (a key of `[engine.volume_plugins]`).
const DRIVER: &str = "csitest";

/// Host paths Podman 4 makes on its first run whatever `--root` says; removed after the test
/// when they were not there before it.
const PODMAN_HOST_PATHS: &[&str] = &[
    "/dev/shm/libpod_lock",
    "/etc/containers/networks",
    "/run/containers",
    "/var/lib/containers",
];

/// Removes, however the test ends, the host paths Podman made during it.
struct HostPaths(Vec<&'static str>);

impl HostPaths {
    fn absent_now() -> HostPaths {
        HostPaths(
            PODMAN_HOST_PATHS
                .iter()
                .copied()
                .filter(|p| !Path::new(p).exists())
                .collect(),
        )
    }
}

impl Drop for HostPaths {
    fn drop(&mut self) {
        for p in &self.0 {
            let p = Path::new(p);
            if p.is_dir() {
                let _ = std::fs::remove_dir_all(p);
            } else {
                let _ = std::fs::remove_file(p);
            }
        }
    }
}

/// A private Podman: its command with every state directory under the sandbox, but for its run
/// root, which Podman wants within 50 characters: a short temp dir of its own, removed with it.
struct Podman {
    root: PathBuf,
    conf: PathBuf,
    runroot: tempfile::TempDir,
}

impl Podman {
    fn new(sb: &Sandbox, plugin_socket: &Path) -> Podman {
        let root = sb.mkdir("podman");
        // Root without CAP_SYS_RESOURCE cannot raise a limit: ask for what is allowed.
        let conf = root.join("containers.conf");
        std::fs::write(
            &conf,
            format!(
                "[containers]\nnetns = \"none\"\ndefault_ulimits = [\"nofile=1024:1024\", \"nproc=1024:1024\"]\n\n\
                 [engine]\ncgroup_manager = \"cgroupfs\"\nevents_logger = \"file\"\nruntime = \"runc\"\n\n\
                 [engine.volume_plugins]\n{DRIVER} = \"{}\"\n",
                plugin_socket.display()
            ),
        )
        .unwrap();
        let runroot = tempfile::Builder::new()
            .prefix("csi-pm-")
            .tempdir_in("/tmp")
            .unwrap();
        Podman {
            root,
            conf,
            runroot,
        }
    }

    fn command(&self, args: &[&str]) -> Output {
        let mut cmd = Command::new("podman");
        cmd.env("CONTAINERS_CONF", &self.conf)
            .arg("--root")
            .arg(self.root.join("root"))
            .arg("--runroot")
            .arg(self.runroot.path())
            .arg("--tmpdir")
            .arg(self.root.join("tmp"))
            .args(["--storage-driver", "vfs", "--events-backend", "file"])
            .args(args)
            .stdin(Stdio::null());
        let started = Instant::now();
        let out = cmd.output().expect("run podman");
        assert!(started.elapsed() < TIMEOUT, "podman {args:?} took too long");
        out
    }

    /// `podman args`, which must succeed: its stdout.
    fn ok(&self, args: &[&str]) -> String {
        let out = self.command(args);
        assert!(
            out.status.success(),
            "podman {args:?}: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `podman args`, which must fail: its stderr.
    fn fails(&self, args: &[&str]) -> String {
        let out = self.command(args);
        assert!(!out.status.success(), "podman {args:?} succeeded");
        String::from_utf8_lossy(&out.stderr).into_owned()
    }
}

/// A busybox root filesystem imported as `image` (no registry is reachable).
fn import_busybox(sb: &Sandbox, podman: &Podman, image: &str) {
    let rootfs = sb.mkdir("rootfs/bin");
    std::fs::copy("/bin/busybox", rootfs.join("busybox")).expect("/bin/busybox (busybox-static)");
    std::os::unix::fs::symlink("busybox", rootfs.join("sh")).unwrap();
    let tar = sb.join("rootfs.tar");
    let status = Command::new("tar")
        .arg("-C")
        .arg(sb.join("rootfs"))
        .arg("-cf")
        .arg(&tar)
        .arg(".")
        .status()
        .unwrap();
    assert!(status.success(), "tar the rootfs");
    podman.ok(&["import", tar.to_str().unwrap(), image]);
}

#[test]
fn podman_creates_mounts_shares_and_removes_a_csi_volume_through_the_plugin() {
    require_root();
    assert!(
        Command::new("podman")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success()),
        "podman is not installed: this test needs it (`.ci/run` installs it, after runc); it does not skip"
    );
    let _host_paths = HostPaths::absent_now();
    let sb = Sandbox::new("podman-engine");
    let work = sb.join("work");
    let socket = sb.join("plugin/csi-isolator.sock");
    let plugin = DockerPluginProcess::start(&sb, BIN, &work, &socket, &[]);
    let podman = Podman::new(&sb, &socket);
    let image = format!("localhost/csi-isolator-busybox-{}", std::process::id());
    import_busybox(&sb, &podman, &image);
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
}
