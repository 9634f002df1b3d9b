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
use std::time::Duration;

use csi_isolator::csi::proto;
use csi_isolator::csi::proto::volume_capability::access_mode::Mode as AccessMode;
use csi_isolator_testing::engines::{
    container_gone, require_engine, unique, volume_users, Dockerd, EngineCli, HostPaths,
    DOCKER_HOST_PATHS, DOCKER_PLUGINS_DIR,
};
use csi_isolator_testing::{
    isolator_command, mount_capability, mount_points_under, plugin_bin, processes_mentioning,
    raw_clients, recorded_volumes, require_root, status_volumes, DockerPluginProcess,
    PluginProcess, Sandbox,
};
use nix::sys::signal::Signal;

const BIN: &str = env!("CARGO_BIN_EXE_csi-isolator");

/// Everything a test starts: the host paths are returned apart, to be dropped last.
struct Setup {
    sb: Sandbox,
    driver: String,
    plugin: DockerPluginProcess,
    engine: Dockerd,
    image: String,
}

/// The engine lock and the test's sandbox.
fn claim(label: &str) -> (HostPaths, Sandbox) {
    require_root();
    require_engine("dockerd", "docker.io");
    let host = HostPaths::claim(DOCKER_HOST_PATHS);
    (host, Sandbox::new(label))
}

/// Starts a docker-plugin on `work` under a unique driver name in [`DOCKER_PLUGINS_DIR`] (its
/// socket removed at the end): the driver name and the process.
fn start_driver(
    host: &mut HostPaths,
    sb: &Sandbox,
    work: &Path,
    args: &[&str],
) -> (String, DockerPluginProcess) {
    let driver = format!("csi-isolator-test-{}", unique());
    let socket = Path::new(DOCKER_PLUGINS_DIR).join(format!("{driver}.sock"));
    host.remove_at_end(&socket);
    let plugin = DockerPluginProcess::start(sb, BIN, work, &socket, args);
    (driver, plugin)
}

/// dockerd and the image, beside a plugin already started.
fn with_engine(sb: Sandbox, driver: String, plugin: DockerPluginProcess) -> Setup {
    let engine = Dockerd::start(&sb);
    let image = engine.import_busybox(&sb);
    Setup {
        sb,
        driver,
        plugin,
        engine,
        image,
    }
}

fn setup(label: &str) -> (HostPaths, Setup) {
    let (mut host, sb) = claim(label);
    let (driver, plugin) = start_driver(&mut host, &sb, &sb.join("work"), &[]);
    (host, with_engine(sb, driver, plugin))
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

/// The end of a test over `--plugin-endpoint`: the separate plugin goes first (teardown checks
/// that no process names the sandbox), then [`teardown`]; the work dir records no volume, and
/// the host paths are restored.
fn finish_over_endpoint(s: Setup, mut csi: PluginProcess, host: HostPaths) {
    csi.kill();
    let log = s.plugin.log();
    let (sb, work) = teardown(s);
    assert_eq!(
        status_volumes(BIN, &work),
        Vec::<serde_json::Value>::new(),
        "{log}"
    );
    drop(sb);
    host.assert_restored();
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
    let status = e.volume_status("vol1");
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
    assert_eq!(recorded_volumes(BIN, &work), Vec::<String>::new(), "{log}");
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
    // `--mount` with the driver and its options: created with them (a 16 MiB ext4 volume).
    let mount =
        format!("type=volume,source=implicit2,target=/data,volume-driver={d},volume-opt=size=16M");
    let df = e.ok(&[
        "run",
        "--rm",
        "--network",
        "none",
        "--mount",
        &mount,
        &s.image,
        "sh",
        "-c",
        "df -k /data | tail -1",
    ]);
    let total_kib: u64 = df
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("df: {df}"));
    assert!(
        (8_000..=16_384).contains(&total_kib),
        "the container sees the 16 MiB volume: {df}"
    );
    let status = e.volume_status("implicit2");
    assert_eq!(status["capacity_bytes"], 16 << 20, "{status}");
    e.ok(&["volume", "rm", "implicit2"]);

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
    assert_eq!(recorded_volumes(BIN, &work), Vec::<String>::new(), "{log}");
    drop(sb);
    host.assert_restored();
}

#[test]
fn two_containers_share_a_volume_until_the_last_leaves_and_a_failing_publish_fails_the_run() {
    let (mut host, sb) = claim("dkr-share");
    let (driver, plugin) = start_driver(&mut host, &sb, &sb.join("work"), &[]);
    // A second driver on the same dockerd whose bundled plugin fails every NodePublishVolume.
    let fail_work = sb.join("failing/work");
    let (failing, failing_plugin) = start_driver(
        &mut host,
        &sb,
        &fail_work,
        &["--plugin-arg=--fail=NodePublishVolume=INTERNAL"],
    );
    let s = with_engine(sb, driver, plugin);
    two_containers_share_a_volume(&s);
    let e = &s.engine;

    // A failing NodePublishVolume fails `docker run` with the CSI error.
    e.ok(&[
        "volume", "create", "-d", &failing, "-o", "size=16M", "broken",
    ]);
    let refused = e.fails(&[
        "run",
        "--rm",
        "--network",
        "none",
        "-v",
        "broken:/data",
        &s.image,
        "true",
    ]);
    assert!(
        refused.contains("VolumeDriver.Mount volume 'broken'")
            && refused.contains("NodePublishVolume")
            && refused.contains("INTERNAL")
            && refused.contains("injected fault"),
        "{refused}"
    );
    eprintln!("docker run with a failing publish: {refused}");
    let left = mount_points_under(&fail_work);
    assert!(left.is_empty(), "mounted after a failed publish: {left:?}");
    let log = failing_plugin.log();
    assert!(
        failing_plugin.stop(&s.sb, Signal::SIGTERM).success(),
        "{log}"
    );
    // What the failing driver's work dir records: the volume, with no use and not published.
    let volumes = status_volumes(BIN, &fail_work);
    assert_eq!(volumes.len(), 1, "{volumes:?}");
    assert_eq!(volumes[0]["name"], "broken", "{volumes:?}");
    assert_eq!(volumes[0]["users"], serde_json::json!([]), "{volumes:?}");
    assert_eq!(volumes[0]["mounted"], false, "{volumes:?}");
    assert_ne!(volumes[0]["state"], "PUBLISHED", "{volumes:?}");
    let out = isolator_command(BIN, &fail_work)
        .args(["volume", "destroy", "broken"])
        .output()
        .expect("run volume destroy");
    assert!(out.status.success(), "volume destroy: {out:?}");
    assert_eq!(recorded_volumes(BIN, &fail_work), Vec::<String>::new());

    let log = s.plugin.log();
    let (sb, work) = teardown(s);
    assert_eq!(recorded_volumes(BIN, &work), Vec::<String>::new(), "{log}");
    drop(sb);
    host.assert_restored();
}

/// Two containers of `docker run -d` share a volume of `s`'s driver: one Mount ID each, the
/// first leaving keeps it published for the second, the last unpublishes it; then it is removed.
fn two_containers_share_a_volume(s: &Setup) {
    let (d, e) = (&s.driver, &s.engine);

    e.ok(&["volume", "create", "-d", d, "-o", "size=16M", "shared"]);
    let start = |name: &str, script: &str| {
        e.ok(&[
            "run",
            "-d",
            "--name",
            name,
            "--network",
            "none",
            "-v",
            "shared:/data",
            &s.image,
            "sh",
            "-c",
            script,
        ])
    };
    start("first", "echo one > /data/one && exec sleep 600");
    start("second", "exec sleep 600");
    let first = e.track_container(&s.sb, "first");
    let second = e.track_container(&s.sb, "second");
    let users = |e: &Dockerd| volume_users(&e.volume_status("shared"));
    assert_eq!(users(e).len(), 2, "one Mount ID per container");
    let published = mount_points_under(&s.plugin.work);
    assert!(!published.is_empty(), "published while in use");

    // The first one leaves: Docker unmounts its use, the second keeps the volume mounted.
    e.ok(&["stop", "-t", "0", "first"]);
    e.ok(&["rm", "first"]);
    container_gone(&s.sb, first, "after docker stop and rm");
    assert_eq!(users(e).len(), 1, "the first container's use ended");
    assert_eq!(mount_points_under(&s.plugin.work), published);
    assert_eq!(
        e.ok(&[
            "exec",
            "second",
            "sh",
            "-c",
            "echo two > /data/two && cat /data/one /data/two"
        ]),
        "one\ntwo",
        "the second container still writes and reads"
    );

    // The last one leaves: unpublished.
    e.ok(&["stop", "-t", "0", "second"]);
    e.ok(&["rm", "second"]);
    container_gone(&s.sb, second, "after docker stop and rm");
    assert_eq!(users(e).len(), 0);
    let left = mount_points_under(&s.plugin.work);
    assert!(left.is_empty(), "still mounted: {left:?}");
    e.ok(&["volume", "rm", "shared"]);
}

/// The sharing half of the test above over `--plugin-endpoint`: a separately started
/// `csi-test-plugin --backing loop` (its failing publish is in the endpoint test below).
#[test]
fn two_containers_share_a_volume_of_a_csi_plugin_at_an_endpoint_until_the_last_leaves() {
    let (mut host, sb) = claim("dkr-share-ep");
    let csi = PluginProcess::start_loop_blocking(&sb);
    let endpoint = csi.endpoint();
    let (driver, plugin) = start_driver(
        &mut host,
        &sb,
        &sb.join("work"),
        &["--plugin-endpoint", &endpoint],
    );
    let s = with_engine(sb, driver, plugin);
    two_containers_share_a_volume(&s);
    // Published once in the plugin for both, deleted there by `docker volume rm`.
    let calls = csi.calls();
    let count = |rpc: &str| calls.iter().filter(|c| c.starts_with(rpc)).count();
    assert_eq!(count("NodePublishVolume "), 1, "{calls:?}");
    assert_eq!(count("NodeUnpublishVolume "), 1, "{calls:?}");
    assert_eq!(count("CreateVolume "), 1, "{calls:?}");
    assert_eq!(count("DeleteVolume "), 1, "{calls:?}");

    finish_over_endpoint(s, csi, host);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_csi_plugin_at_an_endpoint_serves_docker_and_its_volume_is_deleted_with_docker_volume_rm()
{
    let (mut host, sb) = claim("dkr-endpoint");
    // Its first NodePublishVolume fails.
    let csi = PluginProcess::start(
        &sb,
        plugin_bin(),
        &[
            "--backing",
            "loop",
            "--fail",
            "NodePublishVolume=INTERNAL:1",
        ],
    )
    .await;
    let endpoint = csi.endpoint();
    // An unpublish delay as the product's default has (shorter, for the test's time).
    let (driver, plugin) = start_driver(
        &mut host,
        &sb,
        &sb.join("work"),
        &["--plugin-endpoint", &endpoint, "--unpublish-delay=5"],
    );
    let s = with_engine(sb, driver, plugin);
    let (d, e) = (&s.driver, &s.engine);

    e.ok(&["volume", "create", "-d", d, "-o", "size=16M", "remote"]);
    let listed = csi.listed().await;
    assert_eq!(listed.len(), 1, "created in the plugin: {listed:?}");
    assert_eq!(
        listed[0].volume.as_ref().map(|v| v.capacity_bytes),
        Some(16 << 20)
    );
    let run = |script: &str| {
        e.ok(&[
            "run",
            "--rm",
            "--network",
            "none",
            "-v",
            "remote:/data",
            &s.image,
            "sh",
            "-c",
            script,
        ])
    };
    let published = |calls: &[String]| {
        calls
            .iter()
            .filter(|c| c.starts_with("NodeStageVolume") || c.starts_with("NodePublishVolume"))
            .count()
    };

    // The plugin's failure fails `docker run` with its text; nothing stays published or used.
    let failed = e.fails(&[
        "run",
        "--rm",
        "--network",
        "none",
        "-v",
        "remote:/data",
        &s.image,
        "true",
    ]);
    assert!(
        failed.contains("NodePublishVolume") && failed.contains("INTERNAL"),
        "{failed}"
    );
    let left = mount_points_under(&s.plugin.work);
    assert!(left.is_empty(), "mounted after a failed publish: {left:?}");
    let status = e.ok(&[
        "volume",
        "inspect",
        "--format",
        "{{json .Status.users}}",
        "remote",
    ]);
    assert_eq!(status, "[]", "a use left by the failed Mount");

    // Published for the first run; the next run within the delay finds it published.
    let before = published(&csi.calls());
    run("echo far > /data/f");
    let after_first = published(&csi.calls());
    assert!(
        after_first > before,
        "the first run published: {:?}",
        csi.calls()
    );
    assert_eq!(run("cat /data/f"), "far");
    assert_eq!(
        published(&csi.calls()),
        after_first,
        "the run within the delay staged or published again: {:?}",
        csi.calls()
    );
    // Then, with no container, it is unpublished.
    let idle = std::time::Instant::now();
    while !mount_points_under(&s.plugin.work).is_empty() {
        assert!(
            idle.elapsed() < Duration::from_secs(30),
            "still published 30 s after the last container (delay 5 s)"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        csi.calls()
            .iter()
            .any(|c| c.starts_with("NodeUnpublishVolume")),
        "{:?}",
        csi.calls()
    );

    e.ok(&["volume", "rm", "remote"]);
    let listed = csi.listed().await;
    assert!(listed.is_empty(), "deleted in the plugin: {listed:?}");

    // A volume the driver has already (made by its own tools) adopted with `volume-id`: used,
    // then only forgotten by `docker volume rm`.
    let mut raw = raw_clients(&csi.socket())
        .await
        .expect("connect to the plugin");
    let made = raw
        .controller
        .create_volume(proto::CreateVolumeRequest {
            name: "made-by-the-driver".into(),
            capacity_range: Some(proto::CapacityRange {
                required_bytes: 16 << 20,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![mount_capability(AccessMode::SingleNodeWriter)],
            ..Default::default()
        })
        .await
        .expect("CreateVolume in the plugin")
        .into_inner()
        .volume
        .expect("a volume");
    let adopt = format!("volume-id={}", made.volume_id);
    e.ok(&["volume", "create", "-d", d, "-o", &adopt, "adopted"]);
    e.ok(&[
        "run",
        "--rm",
        "--network",
        "none",
        "-v",
        "adopted:/data",
        &s.image,
        "sh",
        "-c",
        "echo mine > /data/f && cat /data/f",
    ]);
    e.ok(&["volume", "rm", "adopted"]);
    let listed = csi.listed().await;
    assert_eq!(
        listed.len(),
        1,
        "docker volume rm only forgets an import: {listed:?}"
    );
    raw.controller
        .delete_volume(proto::DeleteVolumeRequest {
            volume_id: made.volume_id.clone(),
            ..Default::default()
        })
        .await
        .expect("DeleteVolume in the plugin");

    finish_over_endpoint(s, csi, host);
}

/// docs/docker.md's way for a block volume (the driver refuses `-o type=block`): `serve`'s
/// CreateVolume with `access_type` "block", then for each container `PrepareOci`, whose
/// `docker_args` (`--device HOST:/blockdev:rw`) are given as they are to `docker run --network
/// none` of the imported busybox: the first container writes the device, a second one reads what
/// the first wrote; each Cleanup releases the volume, DestroyVolume deletes it; nothing is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_volume_reaches_docker_run_through_prepare_ocis_device_arguments() {
    use csi_isolator::service::proto as iso;
    let (host, sb) = claim("dkr-block");
    let socket = sb.join("isolator.sock");
    let mut cmd = isolator_command(BIN, &sb.join("work"));
    cmd.arg("serve")
        .arg("--socket")
        .arg(&socket)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit());
    let mut serve = sb.spawn(&mut cmd).expect("start csi-isolator serve");
    csi_isolator_testing::wait_for_serve_ready(&mut serve, Duration::from_secs(60));
    let mut c = iso::isolator_client::IsolatorClient::new(
        csi_isolator::csi::transport::connect_unix(&socket)
            .await
            .expect("connect to serve"),
    );
    let v = c
        .create_volume(iso::CreateVolumeRequest {
            name: "blk".into(),
            capacity_bytes: 16 << 20,
            container_path: "/blockdev".into(),
            access_type: "block".into(),
            ..Default::default()
        })
        .await
        .expect("CreateVolume")
        .into_inner();
    let engine = Dockerd::start(&sb);
    let image = engine.import_busybox(&sb);
    let read = "dd if=/blockdev bs=512 skip=8 count=1 2>/dev/null | head -c 15";
    let write = format!(
        "test -b /blockdev && printf written-by-dkr1 | dd of=/blockdev bs=512 seek=8 conv=notrunc,fsync 2>/dev/null && {read}"
    );
    for (container, script) in [("c1", write.as_str()), ("c2", read)] {
        let info = c
            .prepare_oci(iso::PrepareRequest {
                container_id: container.into(),
                config: Some(iso::ContainerConfig {
                    resources_json: format!("[{}]", v.resource_json),
                    sandbox: sb
                        .mkdir(format!("sandboxes/{container}"))
                        .display()
                        .to_string(),
                    ..Default::default()
                }),
            })
            .await
            .expect("PrepareOci")
            .into_inner();
        assert!(info.mounts.is_empty(), "{:?}", info.mounts);
        assert_eq!(info.docker_args.len(), 2, "{:?}", info.docker_args);
        assert_eq!(info.docker_args[0], "--device");
        assert!(
            info.docker_args[1].ends_with(":/blockdev:rw"),
            "{:?}",
            info.docker_args
        );
        let name = format!("{container}-{}", unique());
        let mut args = vec!["run", "--rm", "--name", &name, "--network", "none"];
        args.extend(info.docker_args.iter().map(String::as_str));
        args.extend([image.as_str(), "sh", "-c", script]);
        assert_eq!(engine.ok(&args), "written-by-dkr1", "{container}");
        c.cleanup(iso::CleanupRequest {
            container_id: container.into(),
        })
        .await
        .expect("Cleanup");
    }
    let st = c
        .status(iso::StatusRequest {})
        .await
        .expect("Status")
        .into_inner();
    assert_eq!(st.volumes.len(), 1);
    assert_eq!(st.volumes[0].access_type, "block");
    assert_eq!(st.volumes[0].state, "CREATED", "released: {:?}", st.volumes);
    c.destroy_volume(iso::DestroyVolumeRequest {
        volume_id: v.volume_id.clone(),
        ..Default::default()
    })
    .await
    .expect("DestroyVolume");
    drop(c);
    engine.ok(&["rmi", &image]);
    engine.stop(&sb);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(serve.id() as i32),
        Signal::SIGTERM,
    )
    .expect("SIGTERM serve");
    let status = serve.wait().expect("wait for serve");
    sb.untrack(serve.id());
    assert!(status.success(), "serve exited with {status:?}");
    sb.assert_no_mounts_under();
    sb.assert_no_loop_devices();
    let left = processes_mentioning(sb.path());
    assert!(left.is_empty(), "processes left: {left:?}");
    drop(sb);
    host.assert_restored();
}
