//! `csi-isolator docker-plugin` driven by a real Podman (issue 12): Podman speaks the Docker
//! volume plugin protocol to the sockets its `containers.conf` names under
//! `[engine.volume_plugins]`. Everything Podman keeps goes under the test's sandbox (`--root`,
//! `--runroot`, `--tmpdir`, its own `containers.conf` with `--network none` and explicit
//! ulimits, which root without CAP_SYS_RESOURCE needs here); the few files Podman makes at fixed
//! host paths on its first run are removed when this test made them
//! (`csi_isolator_testing::engines::HostPaths`, which runs engine tests one at a time).
//!
//! Also `csi-isolator oci-hook from-state` as a Podman OCI hook: one entry of a `hooks.d` of the
//! test's (`podman --hooks-dir`) for createRuntime and poststop, matching the
//! `io.csi-isolator.volumes` annotation, with a work dir of its own.
//!
//! And `docker-plugin --engine` against Podman's Docker-compatible service
//! (`podman system service` on the same directories, [`Podman::service`]): running containers
//! keep their volume's use, and a use whose `Unmount` Podman lost (the plugin down when the last
//! container exited, so the cleanup conmon runs could not reach it) is released.

use std::path::Path;
use std::process::Output;
use std::time::{Duration, Instant};

use csi_isolator::mount::{MountTable, ProcMountTable};
use csi_isolator_testing::engines::{
    container_gone, require_engine, volume_users, wait_bounded, EngineCli, HostPaths, Podman,
    PODMAN_HOST_PATHS,
};
use csi_isolator_testing::{
    isolator_command, mount_points_under, processes_mentioning, require_root, status_volumes,
    DockerPluginProcess, PluginProcess, Sandbox,
};
use nix::sys::signal::Signal;

const BIN: &str = env!("CARGO_BIN_EXE_csi-isolator");
/// The driver name Podman knows the plugin by (a key of `[engine.volume_plugins]`).
const DRIVER: &str = "csitest";
/// How long a test waits for a container or the plugin to get somewhere.
const WAIT: Duration = Duration::from_secs(60);

#[test]
fn podman_creates_mounts_shares_and_removes_a_csi_volume_through_the_plugin() {
    creates_mounts_shares_and_removes(false);
}

/// The same over `--plugin-endpoint`: a separately started `csi-test-plugin --backing loop`.
#[test]
fn podman_creates_mounts_shares_and_removes_a_csi_volume_of_a_plugin_at_an_endpoint() {
    creates_mounts_shares_and_removes(true);
}

/// Podman creates a volume with its size, containers use it one after the other (the second
/// read-only), and removes it; the docker-plugin's CSI plugin the bundled one, or with
/// `endpoint` a separately started one over `--plugin-endpoint`.
fn creates_mounts_shares_and_removes(endpoint: bool) {
    require_root();
    require_engine("podman", "podman");
    let host_paths = HostPaths::claim(PODMAN_HOST_PATHS);
    let sb = Sandbox::new(if endpoint {
        "podman-engine-ep"
    } else {
        "podman-engine"
    });
    let work = sb.join("work");
    // The docker-plugin's socket: not in `plugin/`, the separate CSI plugin's directory.
    let socket = sb.join("docker/csi-isolator.sock");
    let csi = endpoint.then(|| PluginProcess::start_loop_blocking(&sb));
    let csi_endpoint = csi.as_ref().map(PluginProcess::endpoint);
    let args: Vec<&str> = match &csi_endpoint {
        Some(e) => vec!["--plugin-endpoint", e],
        None => Vec::new(),
    };
    let plugin = DockerPluginProcess::start(&sb, BIN, &work, &socket, &args);
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
    if let Some(mut csi) = csi {
        // Created and deleted in the separate plugin, once (the malformed size never reached it).
        let calls = csi.calls();
        let count = |rpc: &str| calls.iter().filter(|c| c.starts_with(rpc)).count();
        assert_eq!(count("CreateVolume "), 1, "{calls:?}");
        assert_eq!(count("DeleteVolume "), 1, "{calls:?}");
        assert!(count("NodePublishVolume ") >= 2, "{calls:?}");
        let staged = mount_points_under(csi.dir());
        assert!(staged.is_empty(), "left mounted by the plugin: {staged:?}");
        // It goes before the check that no process names the sandbox.
        csi.kill();
    }
    finish(podman, sb, host_paths, "conmon or container");
}

/// The end of every test: no loop device and no process naming the sandbox (`what` says which
/// could be left), then Podman's run root and the sandbox go and the host paths Podman made
/// are restored.
fn finish(podman: Podman, sb: Sandbox, host_paths: HostPaths, what: &str) {
    sb.assert_no_loop_devices();
    let left = processes_mentioning(sb.path());
    assert!(left.is_empty(), "no {what} left: {left:?}");
    drop(podman);
    drop(sb);
    host_paths.assert_restored();
}

#[test]
fn podman_containers_share_a_volume_until_the_last_leaves_and_a_failing_publish_fails_the_run() {
    require_root();
    require_engine("podman", "podman");
    let host_paths = HostPaths::claim(PODMAN_HOST_PATHS);
    let sb = Sandbox::new("podman-share");
    let work = sb.join("work");
    let socket = sb.join("plugin/csi-isolator.sock");
    let plugin = DockerPluginProcess::start(&sb, BIN, &work, &socket, &[]);
    // A second driver whose bundled plugin fails every NodePublishVolume.
    let fail_work = sb.join("failing/work");
    let fail_socket = sb.join("failing/plugin/csi-isolator.sock");
    let failing = DockerPluginProcess::start(
        &sb,
        BIN,
        &fail_work,
        &fail_socket,
        &["--plugin-arg=--fail=NodePublishVolume=INTERNAL"],
    );
    let podman = Podman::new(&sb, &[(DRIVER, &socket), ("csifail", &fail_socket)]);
    let image = podman.import_busybox(&sb);

    two_containers_share(&podman, &sb, &image, &work);

    // A failing NodePublishVolume fails `podman run` with the CSI error (the plugin answers
    // non-200: Podman would take a 200 with an Err for a success).
    podman.ok(&[
        "volume", "create", "--driver", "csifail", "-o", "size=16M", "broken",
    ]);
    let refused = podman.fails(&["run", "--rm", "-v", "broken:/data", &image, "true"]);
    eprintln!("podman run with a failing publish: {refused}");
    assert!(
        refused.contains("VolumeDriver.Mount volume 'broken'")
            && refused.contains("NodePublishVolume")
            && refused.contains("INTERNAL")
            && refused.contains("injected fault"),
        "{refused}"
    );
    let left = mount_points_under(&fail_work);
    assert!(left.is_empty(), "mounted after a failed publish: {left:?}");
    // The failed run left no use: Remove, which a use would refuse, deletes it.
    podman.ok(&["volume", "rm", "broken"]);
    podman.ok(&["rmi", &image]);

    let log = failing.log();
    assert!(failing.stop(&sb, Signal::SIGTERM).success(), "{log}");
    assert_eq!(
        status_volumes(BIN, &fail_work),
        Vec::<serde_json::Value>::new(),
        "deleted after the failed run left no use"
    );
    let log = plugin.log();
    assert!(plugin.stop(&sb, Signal::SIGTERM).success(), "{log}");
    assert_eq!(status_volumes(BIN, &work), Vec::<serde_json::Value>::new());
    sb.assert_no_mounts_under();
    finish(podman, sb, host_paths, "conmon or container");
}

/// Two containers of `podman run -d` share a volume of [`DRIVER`] (the docker-plugin on
/// `work`): the first leaving keeps it published for the second, the last unpublishes it; then
/// it is removed.
fn two_containers_share(podman: &Podman, sb: &Sandbox, image: &str, work: &Path) {
    podman.ok(&[
        "volume", "create", "--driver", DRIVER, "-o", "size=16M", "shared",
    ]);
    let start = |name: &str, script: &str| {
        podman.ok(&[
            "run",
            "-d",
            "--name",
            name,
            "-v",
            "shared:/data",
            image,
            "/bin/sh",
            "-c",
            script,
        ])
    };
    start("first", "echo one > /data/one && exec sleep 600");
    start("second", "exec sleep 600");
    let first = podman.track_container(sb, "first");
    let second = podman.track_container(sb, "second");
    let published = mount_points_under(work);
    assert!(!published.is_empty(), "published while in use");

    // The first one leaves: the second keeps the volume mounted, writable and readable.
    podman.ok(&["stop", "-t", "0", "first"]);
    podman.ok(&["rm", "first"]);
    container_gone(sb, first, "after podman stop and rm");
    assert_eq!(mount_points_under(work), published);
    assert_eq!(
        podman.ok(&[
            "exec",
            "second",
            "/bin/sh",
            "-c",
            "echo two > /data/two && cat /data/one /data/two",
        ]),
        "one\ntwo",
        "the second container still writes and reads"
    );

    // The last one leaves: unpublished.
    podman.ok(&["stop", "-t", "0", "second"]);
    podman.ok(&["rm", "second"]);
    container_gone(sb, second, "after podman stop and rm");
    let left = mount_points_under(work);
    assert!(left.is_empty(), "still mounted: {left:?}");
    podman.ok(&["volume", "rm", "shared"]);
}

/// The sharing half of the test above over `--plugin-endpoint`: a separately started
/// `csi-test-plugin --backing loop`.
#[test]
fn podman_containers_share_a_volume_of_a_plugin_at_an_endpoint_until_the_last_leaves() {
    require_root();
    require_engine("podman", "podman");
    let host_paths = HostPaths::claim(PODMAN_HOST_PATHS);
    let sb = Sandbox::new("podman-share-ep");
    let work = sb.join("work");
    // Not in `plugin/`, the separate CSI plugin's directory.
    let socket = sb.join("docker/csi-isolator.sock");
    let mut csi = PluginProcess::start_loop_blocking(&sb);
    let endpoint = csi.endpoint();
    let plugin =
        DockerPluginProcess::start(&sb, BIN, &work, &socket, &["--plugin-endpoint", &endpoint]);
    let podman = Podman::new(&sb, &[(DRIVER, &socket)]);
    let image = podman.import_busybox(&sb);
    two_containers_share(&podman, &sb, &image, &work);
    podman.ok(&["rmi", &image]);
    // Published once in the plugin for both, deleted there by `podman volume rm`.
    let calls = csi.calls();
    let count = |rpc: &str| calls.iter().filter(|c| c.starts_with(rpc)).count();
    assert_eq!(count("NodePublishVolume "), 1, "{calls:?}");
    assert_eq!(count("NodeUnpublishVolume "), 1, "{calls:?}");
    assert_eq!(count("CreateVolume "), 1, "{calls:?}");
    assert_eq!(count("DeleteVolume "), 1, "{calls:?}");

    let log = plugin.log();
    assert!(plugin.stop(&sb, Signal::SIGTERM).success(), "{log}");
    assert_eq!(status_volumes(BIN, &work), Vec::<serde_json::Value>::new());
    // It goes before the check that no process names the sandbox.
    csi.kill();
    sb.assert_no_mounts_under();
    finish(podman, sb, host_paths, "conmon or container");
}

/// Writes `<dir>/csi-isolator.json`, one Podman hooks.d entry for both stages running
/// `csi-isolator --work-dir <work> oci-hook --plugin-socket-dir <sockets> from-state` for
/// containers carrying the volumes annotation (the state's status names the stage).
fn write_hook(dir: &Path, work: &Path, sockets: &Path) {
    let hook = serde_json::json!({
        "version": "1.0.0",
        "hook": {
            "path": BIN,
            "args": [
                "csi-isolator", "--work-dir", work, "oci-hook",
                "--plugin-socket-dir", sockets, "from-state",
            ],
        },
        "when": {"annotations": {"^io\\.csi-isolator\\.volumes$": ".*"}},
        "stages": ["createRuntime", "poststop"],
    });
    std::fs::write(
        dir.join("csi-isolator.json"),
        serde_json::to_vec_pretty(&hook).expect("hook JSON"),
    )
    .expect("write the hook");
}

#[test]
fn podman_runs_oci_hook_from_hooks_dir_publishing_the_annotated_volume_and_releasing_it() {
    require_root();
    require_engine("podman", "podman");
    let host_paths = HostPaths::claim(PODMAN_HOST_PATHS);
    let sb = Sandbox::new("podman-hook");
    let work = sb.join("hook/work");
    let sockets = sb.join("hook/s");
    let hooks = sb.mkdir("hooks.d");
    write_hook(&hooks, &work, &sockets);
    let podman = Podman::new(&sb, &[]).with_hooks_dir(&hooks);
    let image = podman.import_busybox(&sb);
    let run = |volumes: &str, script: &str| -> Output {
        podman.command(&[
            "run",
            "--rm",
            "--annotation",
            &format!("io.csi-isolator.volumes={volumes}"),
            &image,
            "/bin/sh",
            "-c",
            script,
        ])
    };
    let volume = || -> serde_json::Value {
        let volumes = status_volumes(BIN, &work);
        assert_eq!(volumes.len(), 1, "{volumes:?}");
        volumes[0].clone()
    };

    // createRuntime publishes the volume and mounts it at /data; poststop releases it.
    let out = run(
        "data:16M:/data",
        "echo hi > /data/f && grep ' /data ' /proc/mounts",
    );
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(stdout.contains(" /data ext4 "), "{stdout}\n{stderr}");
    let v = volume();
    assert_eq!(v["name"], "data", "{v}");
    assert_eq!(v["capacity_bytes"], 16 << 20, "{v}");
    assert_eq!(
        v["users"],
        serde_json::json!([]),
        "released at poststop: {v}"
    );
    assert_eq!(v["mounted"], false, "unpublished at poststop: {v}");
    let left = mount_points_under(&work);
    assert!(left.is_empty(), "still mounted: {left:?}");

    // The same name is the same volume.
    let out = run("data:16M:/data", "cat /data/f");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), "hi\n");

    // A hook that fails fails the run, saying why; nothing is published or kept for it.
    let out = run("data:16M:relative", "true");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    eprintln!("podman run with a bad annotation: {stderr}");
    assert!(!out.status.success(), "a bad annotation was accepted");
    assert!(
        stderr.contains("io.csi-isolator.volumes") && stderr.contains("relative"),
        "{stderr}"
    );
    let v = volume();
    assert_eq!(v["users"], serde_json::json!([]), "{v}");
    assert_eq!(v["mounted"], false, "{v}");
    let containers = podman.ok(&["ps", "-a", "-q"]);
    assert_eq!(containers, "", "the failed container was removed");

    podman.ok(&["rmi", &image]);
    let out = isolator_command(BIN, &work)
        .args(["volume", "destroy", "data"])
        .output()
        .expect("run volume destroy");
    assert!(out.status.success(), "volume destroy: {out:?}");
    assert_eq!(status_volumes(BIN, &work), Vec::<serde_json::Value>::new());
    sb.assert_no_mounts_under();
    finish(podman, sb, host_paths, "hook, plugin, conmon or container");
}

/// Asks the Podman service on `socket` for `GET /containers/json?all=1` (HTTP/1.0: the
/// connection closes after the answer): the answer's body, parsed.
fn podman_listing(socket: &Path) -> serde_json::Value {
    use std::io::{Read, Write};
    let mut stream = std::os::unix::net::UnixStream::connect(socket).expect("connect the service");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("read timeout");
    stream
        .write_all(b"GET /containers/json?all=1 HTTP/1.0\r\nHost: d\r\n\r\n")
        .expect("send the listing request");
    let mut answer = String::new();
    stream
        .read_to_string(&mut answer)
        .expect("read the listing");
    let (head, body) = answer.split_once("\r\n\r\n").expect("an HTTP answer");
    assert!(
        head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200"),
        "{head}"
    );
    serde_json::from_str(body).unwrap_or_else(|e| panic!("listing ({e}): {body}"))
}

/// The Mount IDs the plugin records for `volume` (through `podman volume inspect`, which asks
/// the plugin's `Get`).
fn podman_users(podman: &Podman, volume: &str) -> Vec<String> {
    volume_users(&podman.volume_status(volume))
}

/// Waits (bounded) until `what()` holds.
fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let started = Instant::now();
    while !done() {
        assert!(started.elapsed() < WAIT, "{what}: not within {WAIT:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The size of `file`, 0 when absent.
fn size_of(file: &Path) -> u64 {
    std::fs::metadata(file).map(|m| m.len()).unwrap_or(0)
}

/// Waits (bounded) until `file` grows past `than` bytes: its new size.
fn grows(file: &Path, than: u64) -> u64 {
    let mut now = 0;
    eventually(
        &format!("{} grows past {than} bytes", file.display()),
        || {
            now = size_of(file);
            now > than
        },
    );
    now
}

#[test]
fn docker_plugin_engine_reconciliation_against_podmans_service_keeps_held_uses_and_releases_lost_ones(
) {
    require_root();
    require_engine("podman", "podman");
    let started = Instant::now();
    let host_paths = HostPaths::claim(PODMAN_HOST_PATHS);
    let sb = Sandbox::new("podman-reconcile");
    let work = sb.join("work");
    let socket = sb.join("plugin/csi-isolator.sock");
    let podman = Podman::new(&sb, &[(DRIVER, &socket)]);
    let api = sb.join("podman.sock");
    let mut service = podman.service(&sb, &api);
    let engine = format!("unix://{}", api.display());
    let engine_args = ["--engine", &engine, "--engine-interval", "1"];
    let plugin = DockerPluginProcess::start(&sb, BIN, &work, &socket, &engine_args);
    let image = podman.import_busybox(&sb);
    podman.ok(&[
        "volume", "create", "--driver", DRIVER, "-o", "size=16M", "held",
    ]);
    // Two writers on one volume, each ending when its stop file appears in the volume.
    let start = |name: &str| {
        podman.ok(&[
            "run",
            "-d",
            "--name",
            name,
            "-v",
            "held:/data",
            &image,
            "sh",
            "-c",
            &format!(
                "while [ ! -e /data/stop-{name} ]; do date >> /data/log-{name}; sleep 0.2; done"
            ),
        ])
    };
    start("a");
    start("b");
    let pids = [
        podman.track_container(&sb, "a"),
        podman.track_container(&sb, "b"),
    ];
    let mountpoint = std::path::PathBuf::from(podman.ok(&[
        "volume",
        "inspect",
        "--format",
        "{{.Mountpoint}}",
        "held",
    ]));
    let log_a = mountpoint.join("log-a");
    let log_b = mountpoint.join("log-b");
    grows(&log_a, 0);
    grows(&log_b, 0);
    // Podman mounts a plugin's volume once, under one fixed pseudo Mount ID, and counts its
    // containers itself.
    let users = podman_users(&podman, "held");
    assert_eq!(users.len(), 1, "{users:?}");

    // Podman's answer has Docker's shape: the state names and the volume mounts the plugin
    // reads.
    let listing = podman_listing(&api);
    eprintln!("podman's GET /containers/json?all=1: {listing}");
    let containers = listing.as_array().expect("a list");
    assert_eq!(containers.len(), 2, "{listing}");
    for c in containers {
        assert_eq!(c["State"], "running", "{c}");
        let mounts = c["Mounts"].as_array().expect("Mounts");
        assert!(
            mounts
                .iter()
                .any(|m| m["Type"] == "volume" && m["Name"] == "held"),
            "{c}"
        );
    }

    // (a) Held: running containers keep the use through several listings.
    let size = size_of(&log_a);
    std::thread::sleep(Duration::from_millis(3500));
    grows(&log_a, size);
    assert_eq!(podman_users(&podman, "held"), users, "{}", plugin.log());
    assert!(
        !mount_points_under(&work).is_empty(),
        "published while held"
    );

    // (c) One container exits: Podman counts it off without an Unmount, and the other, still
    // running, keeps the use (the decision is per volume).
    std::fs::write(mountpoint.join("stop-a"), "").expect("stop a");
    let state = |name: &str| podman.ok(&["inspect", "--format", "{{.State.Status}}", name]);
    eventually("a exits", || state("a") == "exited");
    let size = size_of(&log_b);
    std::thread::sleep(Duration::from_millis(3500));
    grows(&log_b, size);
    assert_eq!(podman_users(&podman, "held"), users, "{}", plugin.log());
    assert!(
        !mount_points_under(&work).is_empty(),
        "published while b runs"
    );
    let log = plugin.log();
    assert!(
        !log.contains("no listing this round") && !log.contains("releasing a use"),
        "{log}"
    );

    // (b) The Unmount is lost: the plugin dies, then the last container exits; the cleanup
    // conmon runs (`podman container cleanup`) cannot reach the plugin.
    let status = plugin.stop(&sb, Signal::SIGKILL);
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(9)
    );
    std::fs::write(mountpoint.join("stop-b"), "").expect("stop b");
    eventually("b exits", || state("b") == "exited");
    let listing = podman_listing(&api);
    eprintln!("podman's listing with both exited: {listing}");
    // The plugin again, on the same work dir and socket: the use is durable, and Podman lists
    // no live container with the volume, so after two listings the use is released and the
    // volume unpublished.
    let plugin = DockerPluginProcess::start(&sb, BIN, &work, &socket, &engine_args);
    let released = Instant::now();
    eventually("the use is released", || {
        podman_users(&podman, "held").is_empty()
    });
    eprintln!("released by the reconciliation in {:?}", released.elapsed());
    let left = mount_points_under(&work);
    assert!(left.is_empty(), "still mounted: {left:?}");
    let log = plugin.log();
    assert!(
        log.contains("engine reconciliation: releasing a use") && log.contains(&users[0]),
        "{log}"
    );

    // Podman still counts the volume as mounted (its cleanup failed), so the next container
    // gets no Mount and finds the mount point gone; `podman volume unmount` resets Podman's
    // count (its Unmount now has nothing to release), and the next run mounts it again.
    let refused = podman.fails(&["run", "--rm", "-v", "held:/data", &image, "true"]);
    assert!(refused.contains("no such file or directory"), "{refused}");
    podman.ok(&["volume", "unmount", "held"]);
    let out = podman.ok(&[
        "run",
        "--rm",
        "-v",
        "held:/data",
        &image,
        "sh",
        "-c",
        "test -s /data/log-b && echo ok",
    ]);
    assert_eq!(out, "ok");
    assert_eq!(podman_users(&podman, "held"), Vec::<String>::new());

    podman.ok(&["rm", "a", "b"]);
    for pid in pids {
        container_gone(&sb, pid, "after the writers exited");
    }
    podman.ok(&["volume", "rm", "held"]);
    podman.ok(&["rmi", &image]);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(service.id() as i32),
        Signal::SIGTERM,
    )
    .expect("signal the podman service");
    let status = wait_bounded(&mut service, "podman system service");
    sb.untrack(service.id());
    eprintln!("podman system service stopped: {status}");
    let log = plugin.log();
    assert!(plugin.stop(&sb, Signal::SIGTERM).success(), "{log}");
    assert_eq!(status_volumes(BIN, &work), Vec::<serde_json::Value>::new());
    sb.assert_no_mounts_under();
    assert!(!api.exists(), "the service removed its socket");
    finish(podman, sb, host_paths, "service, conmon or container");
    eprintln!("took {:?}", started.elapsed());
}
