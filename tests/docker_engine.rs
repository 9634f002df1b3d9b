//! `csi-isolator docker-plugin` driven by a real, private `dockerd` (issue 12): each test
//! starts the plugin on `/run/docker/plugins/<unique driver>.sock` (the only place Docker finds
//! a socket plugin), a dockerd with every directory in its sandbox and no network changes
//! (docs/../ENGINES.md's flags), imports a busybox image offline, drives it with the `docker`
//! CLI, then stops both and checks that nothing is left: no mount, no loop device, no process,
//! no plugin socket, and none of `/run/docker/plugins`, `/run/containerd/s` and
//! `/etc/docker/key.json` unless they were there before.
//!
//! The tests run one at a time on the machine (`csi_isolator_testing::engines::HostPaths` holds
//! a lock; a test group in `.config/nextest.toml` keeps nextest from starting them together), so
//! that each knows which of those host paths it made. Every dockerd asks every plugin socket in
//! `/run/docker/plugins` (a plain `docker volume ls` lists the volumes of any other plugin there),
//! so each test still filters by its own driver and uses volume names no other test uses.
//!
//! Volume names given to `-v` have at least two characters: dockerd 20.10 takes `-v V:/data`
//! (a one-character name) for an anonymous volume at the container path `/V:/data`.
//!
//! Needs root and `dockerd` (Debian's docker.io, installed by `.ci/run`): without it the tests
//! fail, they never skip.

use std::path::{Path, PathBuf};

use csi_isolator_testing::engines::{
    require_engine, unique, Dockerd, HostPaths, DOCKER_HOST_PATHS, DOCKER_PLUGINS_DIR,
};
use csi_isolator_testing::{
    isolator_command, mount_points_under, processes_mentioning, require_root, DockerPluginProcess,
    Sandbox,
};
use nix::sys::signal::Signal;

const BIN: &str = env!("CARGO_BIN_EXE_csi-isolator");

/// The names of the volumes the work dir records (`volume list --json`).
fn recorded_volumes(work: &Path) -> Vec<String> {
    let out = isolator_command(BIN, work)
        .args(["volume", "list", "--json"])
        .output()
        .expect("run volume list");
    assert!(out.status.success(), "volume list: {out:?}");
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).expect("list --json");
    listed
        .as_array()
        .expect("an array")
        .iter()
        .map(|v| v["name"].as_str().unwrap_or("").to_string())
        .collect()
}

/// Everything a test starts: the host paths are returned apart, to be dropped last.
struct Setup {
    sb: Sandbox,
    driver: String,
    plugin: DockerPluginProcess,
    engine: Dockerd,
    image: String,
}

fn setup(label: &str) -> (HostPaths, Setup) {
    require_root();
    require_engine("dockerd", "docker.io");
    let driver = format!("csi-isolator-test-{}", unique());
    let mut host = HostPaths::claim(DOCKER_HOST_PATHS);
    let socket = Path::new(DOCKER_PLUGINS_DIR).join(format!("{driver}.sock"));
    host.remove_at_end(&socket);
    let sb = Sandbox::new(label);
    let plugin = DockerPluginProcess::start(&sb, BIN, &sb.join("work"), &socket, &[]);
    let engine = Dockerd::start(&sb);
    let image = engine.import_busybox(&sb);
    (
        host,
        Setup {
            sb,
            driver,
            plugin,
            engine,
            image,
        },
    )
}

/// Removes the image, stops dockerd then the plugin, and checks that nothing is left in the
/// sandbox: no mount, no loop device, no process naming it.
fn teardown(s: Setup) -> (Sandbox, PathBuf) {
    let Setup {
        sb,
        plugin,
        engine,
        image,
        ..
    } = s;
    engine.ok(&["rmi", &image]);
    engine.stop(&sb);
    let work = plugin.work.clone();
    let log = plugin.log();
    let status = plugin.stop(&sb, Signal::SIGTERM);
    assert!(status.success(), "docker-plugin: {status}\n{log}");
    sb.assert_no_mounts_under();
    sb.assert_no_loop_devices();
    let left = processes_mentioning(sb.path());
    assert!(left.is_empty(), "processes left: {left:?}");
    (sb, work)
}

#[test]
fn docker_creates_writes_reads_inspects_and_removes_a_volume() {
    let (host, s) = setup("dkr-life");
    let d = &s.driver;
    let e = &s.engine;

    assert_eq!(
        e.ok(&["volume", "create", "-d", d, "-o", "size=16M", "vol1"]),
        "vol1"
    );
    assert_eq!(
        e.ok(&["volume", "inspect", "--format", "{{.Driver}}", "vol1"]),
        *d
    );
    let status: serde_json::Value =
        serde_json::from_str(&e.ok(&["volume", "inspect", "--format", "{{json .Status}}", "vol1"]))
            .expect("Status is JSON");
    assert_eq!(status["capacity_bytes"], 16 << 20, "{status}");

    e.ok(&[
        "run",
        "--rm",
        "--network",
        "none",
        "-v",
        "vol1:/data",
        &s.image,
        "sh",
        "-c",
        "echo hi > /data/f",
    ]);
    assert_eq!(
        e.ok(&[
            "run",
            "--rm",
            "--network",
            "none",
            "-v",
            "vol1:/data",
            &s.image,
            "cat",
            "/data/f",
        ]),
        "hi"
    );
    // Both containers are gone: Docker sent their Unmounts, the volume is unpublished.
    let published = mount_points_under(&s.plugin.work);
    assert!(published.is_empty(), "still mounted: {published:?}");
    assert_eq!(
        e.ok(&["volume", "ls", "-q", "--filter", &format!("driver={d}")]),
        "vol1"
    );

    e.ok(&["volume", "rm", "vol1"]);
    assert_eq!(
        e.ok(&["volume", "ls", "-q", "--filter", &format!("driver={d}")]),
        ""
    );
    let log = s.plugin.log();
    let (sb, work) = teardown(s);
    // DeleteVolume ran: the work dir records no volume any more.
    assert_eq!(recorded_volumes(&work), Vec::<String>::new(), "{log}");
    sb.assert_no_mounts_under();
    drop(sb);
    host.assert_restored();
}

#[test]
fn docker_run_creates_a_volume_through_the_driver_and_a_readonly_mount_refuses_writes() {
    let (host, s) = setup("dkr-implicit");
    let d = &s.driver;
    let e = &s.engine;

    // No `volume create`: `--volume-driver` makes Docker ask the plugin to Create it.
    e.ok(&[
        "run",
        "--rm",
        "--network",
        "none",
        "--volume-driver",
        d,
        "-v",
        "implicit:/data",
        &s.image,
        "sh",
        "-c",
        "echo first > /data/f",
    ]);
    assert_eq!(
        e.ok(&["volume", "inspect", "--format", "{{.Driver}}", "implicit"]),
        *d
    );

    // Readonly: Docker does not tell the plugin; its bind into the container is read-only.
    let refused = e.fails(&[
        "run",
        "--rm",
        "--network",
        "none",
        "-v",
        "implicit:/data:ro",
        &s.image,
        "sh",
        "-c",
        "echo second > /data/f",
    ]);
    assert!(refused.contains("Read-only file system"), "{refused}");
    assert_eq!(
        e.ok(&[
            "run",
            "--rm",
            "--network",
            "none",
            "-v",
            "implicit:/data:ro",
            &s.image,
            "cat",
            "/data/f",
        ]),
        "first",
        "the refused write changed nothing"
    );
    let published = mount_points_under(&s.plugin.work);
    assert!(published.is_empty(), "still mounted: {published:?}");

    e.ok(&["volume", "rm", "implicit"]);
    let log = s.plugin.log();
    let (sb, work) = teardown(s);
    assert_eq!(recorded_volumes(&work), Vec::<String>::new(), "{log}");
    drop(sb);
    host.assert_restored();
}
