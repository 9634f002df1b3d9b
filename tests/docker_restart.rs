//! `csi-isolator docker-plugin` and a real, private `dockerd` (issue 12) when one of them dies
//! under a running container:
//!
//! - the plugin SIGKILLed: the container keeps writing into its volume (the volume stays
//!   published: its Mount ID is a durable use), and the plugin started again on the same work
//!   dir and socket (now with `--engine`, which keeps the use of the running container) serves
//!   the `Unmount` of the later `docker stop`;
//! - dockerd SIGKILLed and started again on the same directories: what Docker does with the
//!   use (it restores its containers; whether it sends the `Unmount` is printed and checked),
//!   and `docker-plugin --engine <dockerd's socket>` leaves no use of a container that is gone,
//!   the volume unpublished.
//!
//! Same harness and rules as `tests/docker_engine.rs`: the machine-wide engine lock
//! ([`HostPaths`]), a unique driver on `/run/docker/plugins`, `--network none`, and a teardown
//! that stops everything and checks that no mount, loop device or process is left and that the
//! host paths are restored. Needs root and `dockerd`: without it the tests fail, never skip.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use csi_isolator_testing::engines::{
    container_gone, require_engine, unique, volume_users, Dockerd, EngineCli, HostPaths,
    DOCKER_HOST_PATHS, DOCKER_PLUGINS_DIR,
};
use csi_isolator_testing::{
    mount_points_under, processes_mentioning, require_root, DockerPluginProcess, PluginProcess,
    Sandbox,
};
use nix::sys::signal::Signal;

const BIN: &str = env!("CARGO_BIN_EXE_csi-isolator");
const WAIT: Duration = Duration::from_secs(60);
const WRITER: &str = "while true; do date >> /data/log; sleep 0.2; done";

struct Setup {
    sb: Sandbox,
    driver: String,
    socket: PathBuf,
    work: PathBuf,
    engine: Dockerd,
    image: String,
    /// The separately started CSI plugin, when the docker-plugin reaches it over
    /// `--plugin-endpoint`.
    csi: Option<PluginProcess>,
    /// The docker-plugin's arguments that name its CSI plugin (none for the bundled one).
    csi_args: Vec<String>,
}

/// How the docker-plugin gets its CSI plugin.
#[derive(Clone, Copy, Debug)]
enum Csi {
    /// The bundled plugin, managed under its work dir.
    Bundled,
    /// A separately started `csi-test-plugin --backing loop`, over `--plugin-endpoint`: it
    /// stays up while docker-plugins come and go.
    Endpoint,
}

/// Starts `csi-test-plugin --backing loop` in the sandbox (outside any runtime: the tests are
/// blocking).
fn start_csi(sb: &Sandbox) -> PluginProcess {
    PluginProcess::start_loop_blocking(sb)
}

/// The CSI plugin as `csi` says, the docker-plugin (with `args`), then dockerd, then a busybox
/// image. The docker-plugin is returned apart: the tests stop and start it.
fn setup(label: &str, csi: Csi, args: &[&str]) -> (HostPaths, Setup, DockerPluginProcess) {
    require_root();
    require_engine("dockerd", "docker.io");
    let driver = format!("csi-isolator-test-{}", unique());
    let mut host = HostPaths::claim(DOCKER_HOST_PATHS);
    let socket = Path::new(DOCKER_PLUGINS_DIR).join(format!("{driver}.sock"));
    host.remove_at_end(&socket);
    let sb = Sandbox::new(label);
    let work = sb.join("work");
    let (csi, csi_args) = match csi {
        Csi::Bundled => (None, Vec::new()),
        Csi::Endpoint => {
            let csi = start_csi(&sb);
            let args = vec!["--plugin-endpoint".to_string(), csi.endpoint()];
            (Some(csi), args)
        }
    };
    let all: Vec<&str> = csi_args
        .iter()
        .map(String::as_str)
        .chain(args.iter().copied())
        .collect();
    let plugin = DockerPluginProcess::start(&sb, BIN, &work, &socket, &all);
    let engine = Dockerd::start(&sb);
    let image = engine.import_busybox(&sb);
    (
        host,
        Setup {
            sb,
            driver,
            socket,
            work,
            engine,
            image,
            csi,
            csi_args,
        },
        plugin,
    )
}

/// dockerd's API endpoint in the sandbox (the one [`Dockerd::start`] serves).
fn engine_endpoint(sb: &Sandbox) -> String {
    format!("unix://{}", sb.join("docker.sock").display())
}

/// Removes the image, stops dockerd then the plugin (and the separate CSI plugin, after it
/// deleted every volume), and checks that nothing is left.
fn teardown(s: Setup, plugin: DockerPluginProcess) -> Sandbox {
    let Setup {
        sb,
        engine,
        image,
        csi,
        ..
    } = s;
    assert_eq!(engine.ok(&["ps", "-aq"]), "", "containers left");
    engine.ok(&["rmi", &image]);
    engine.stop(&sb);
    // Only after a dockerd was killed is there anything to unmount.
    Dockerd::unmount_killed_data_root(&sb);
    let log = plugin.log();
    let status = plugin.stop(&sb, Signal::SIGTERM);
    assert!(status.success(), "docker-plugin: {status}\n{log}");
    if let Some(mut csi) = csi {
        let calls = csi.calls();
        let created = calls
            .iter()
            .filter(|c| c.starts_with("CreateVolume"))
            .count();
        let deleted = calls
            .iter()
            .filter(|c| c.starts_with("DeleteVolume"))
            .count();
        assert!(
            created > 0 && created == deleted,
            "volumes left in the CSI plugin: {calls:?}"
        );
        // It goes before the check that no process names the sandbox.
        csi.kill();
    }
    sb.assert_no_mounts_under();
    sb.assert_no_loop_devices();
    let left = processes_mentioning(sb.path());
    assert!(left.is_empty(), "processes left: {left:?}");
    sb
}

/// The size of the file the container writes, read on the host through the volume.
fn log_size(mountpoint: &Path) -> u64 {
    std::fs::metadata(mountpoint.join("log"))
        .map(|m| m.len())
        .unwrap_or(0)
}

/// Waits (bounded) until the container's file grows past `than`: its new size.
fn grows(mountpoint: &Path, than: u64, what: &str) -> u64 {
    let started = Instant::now();
    loop {
        let now = log_size(mountpoint);
        if now > than {
            return now;
        }
        assert!(
            started.elapsed() < WAIT,
            "{what}: {} did not grow past {than} bytes",
            mountpoint.join("log").display()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The Mount IDs the plugin records for `volume` (through `docker volume inspect`).
fn users(engine: &Dockerd, volume: &str) -> Vec<String> {
    volume_users(&engine.volume_status(volume))
}

/// Creates a 16 MiB `volume` of the driver and starts the writer container on it, tracked by
/// the sandbox; once it writes, with one use of the volume: its id, its pid, the volume's
/// mount point on the host and the log's size.
fn start_writing(s: &Setup, volume: &str) -> (String, u32, PathBuf, u64) {
    let e = &s.engine;
    e.ok(&[
        "volume", "create", "-d", &s.driver, "-o", "size=16M", volume,
    ]);
    let container = e.ok(&[
        "run",
        "-d",
        "--network",
        "none",
        "-v",
        &format!("{volume}:/data"),
        &s.image,
        "sh",
        "-c",
        WRITER,
    ]);
    let writer = e.track_container(&s.sb, &container);
    let mountpoint =
        PathBuf::from(e.ok(&["volume", "inspect", "--format", "{{.Mountpoint}}", volume]));
    let first = grows(&mountpoint, 0, "the container writes");
    assert_eq!(users(e, volume).len(), 1);
    (container, writer, mountpoint, first)
}

#[test]
fn a_killed_plugin_leaves_the_container_writing_and_the_next_one_serves_its_unmount() {
    killed_plugin(Csi::Bundled);
}

/// The same over `--plugin-endpoint`: the CSI plugin stays up through the docker-plugin's
/// SIGKILL, and the next docker-plugin, on the same endpoint, serves the `Unmount`.
#[test]
fn a_killed_plugin_over_an_endpoint_leaves_the_container_writing_and_the_next_one_serves_its_unmount(
) {
    killed_plugin(Csi::Endpoint);
}

fn killed_plugin(csi: Csi) {
    let label = match csi {
        Csi::Bundled => "dkr-plugin-kill",
        Csi::Endpoint => "dkr-plugin-kill-ep",
    };
    let (host, s, plugin) = setup(label, csi, &[]);
    let csi_pid = s.csi.as_ref().and_then(PluginProcess::pid);
    let (container, writer, mountpoint, first) = start_writing(&s, "killvol");

    // SIGKILL: nothing of the plugin runs, the container goes on writing into its volume.
    let status = plugin.stop(&s.sb, Signal::SIGKILL);
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(9)
    );
    let second = grows(&mountpoint, first, "after the plugin's SIGKILL");
    // The next plugin, on the same work dir and socket path (the killed one's socket is stale),
    // asking dockerd every second: the running container holds the volume, so through several
    // listings its use is kept.
    // Its rounds are logged at debug: the test counts them.
    let engine = engine_endpoint(&s.sb);
    let args: Vec<&str> = s
        .csi_args
        .iter()
        .map(String::as_str)
        .chain(["--engine", &engine, "--engine-interval", "1"])
        .collect();
    let plugin = DockerPluginProcess::try_start(
        &s.sb,
        BIN,
        &s.work,
        &s.socket,
        &args,
        &[(
            "RUST_LOG",
            "info,csi_isolator::docker_plugin::reconciler=debug",
        )],
    )
    .unwrap_or_else(|(status, log)| panic!("docker-plugin: {status}\n{log}"));
    let third = grows(&mountpoint, second, "with the next plugin");
    // Three rounds that listed the running container as holding the volume (more than the two
    // that would release an unheld use).
    let rounds_holding = |log: &str| {
        log.lines()
            .map(without_ansi)
            .filter(|l| l.contains("engine reconciliation round") && l.contains("held=1"))
            .count()
    };
    let started = std::time::Instant::now();
    while rounds_holding(&plugin.log()) < 3 {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "three rounds did not run within 60 s\n{}",
            plugin.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    grows(&mountpoint, third, "through the engine's listings");
    assert_eq!(users(&s.engine, "killvol").len(), 1, "{}", plugin.log());
    let log = plugin.log();
    assert!(
        !log.contains("no listing this round") && !log.contains("releasing a use"),
        "{log}"
    );

    // The later stop's Unmount reaches the new plugin: the volume is unpublished.
    let e = &s.engine;
    e.ok(&["stop", "-t", "1", &container]);
    e.ok(&["rm", &container]);
    container_gone(&s.sb, writer, "after docker stop and rm");
    assert_eq!(users(e, "killvol"), Vec::<String>::new());
    let published = mount_points_under(&s.work);
    assert!(published.is_empty(), "still mounted: {published:?}");
    if let Some(csi) = &s.csi {
        // The same CSI plugin throughout, still running: it was asked to unpublish.
        assert_eq!(csi.pid(), csi_pid, "the CSI plugin was restarted");
        let pid = csi_pid.expect("the CSI plugin runs");
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        assert!(
            stat.rsplit(')').next().is_some_and(|s| s.trim_start().starts_with('S')
                || s.trim_start().starts_with('R')),
            "the CSI plugin is not running: {stat:?}"
        );
        let calls = csi.calls();
        assert!(
            calls.iter().any(|c| c.starts_with("NodeUnpublishVolume")),
            "{calls:?}"
        );
    }
    e.ok(&["volume", "rm", "killvol"]);
    let sb = teardown(s, plugin);
    drop(sb);
    host.assert_restored();
}

/// Waits (bounded) until `container`'s state is `state`.
fn wait_state(engine: &Dockerd, container: &str, state: &str) {
    let started = Instant::now();
    loop {
        let now = engine.ok(&["inspect", "--format", "{{.State.Status}}", container]);
        if now == state {
            return;
        }
        assert!(
            started.elapsed() < WAIT,
            "container {container} is {now}, not {state}\n{}",
            engine.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn after_dockerd_is_killed_and_restarted_the_engine_reconciliation_leaves_no_use_of_a_gone_container(
) {
    let (host, mut s, plugin) = setup("dkr-dockerd-kill", Csi::Bundled, &[]);
    let (container, writer, mountpoint, first) = start_writing(&s, "restartvol");

    // SIGKILL dockerd: its containerd and the container's shim live on, and so does the writer.
    let status = s.engine.signal_and_wait(&s.sb, Signal::SIGKILL);
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(9)
    );
    let second = grows(&mountpoint, first, "with dockerd killed");
    Dockerd::forget_killed_containerd(&s.sb);

    // dockerd again, on the same directories: it restores its containers (without
    // live-restore, a running one is stopped).
    s.engine = Dockerd::start(&s.sb);
    let e = &s.engine;
    wait_state(e, &container, "exited");
    let stopped_at = log_size(&mountpoint);
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(log_size(&mountpoint), stopped_at, "the writer is stopped");
    assert!(stopped_at >= second);
    let left = users(e, "restartvol");
    eprintln!(
        "after dockerd's SIGKILL and restart, Docker {} the container's Unmount (uses left: {left:?})",
        if left.is_empty() { "sent" } else { "did not send" }
    );
    assert_eq!(
        left.len(),
        1,
        "Docker 20.10 sends no Unmount for a container it restores as exited (docker/for-linux#404); \
         if a newer engine does, this test no longer shows the reconciliation"
    );
    assert!(
        !mount_points_under(&s.work).is_empty(),
        "without --engine the use keeps the volume published"
    );

    // The plugin again, now asking dockerd every second: the exited container holds nothing,
    // so its use is released after two listings and the volume unpublished.
    let log = plugin.log();
    assert!(plugin.stop(&s.sb, Signal::SIGTERM).success(), "{log}");
    let plugin = DockerPluginProcess::start(
        &s.sb,
        BIN,
        &s.work,
        &s.socket,
        &[
            "--engine",
            &engine_endpoint(&s.sb),
            "--engine-interval",
            "1",
        ],
    );
    let started = Instant::now();
    while !users(e, "restartvol").is_empty() {
        assert!(started.elapsed() < WAIT, "{}", plugin.log());
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!("released by the reconciliation in {:?}", started.elapsed());
    let published = mount_points_under(&s.work);
    assert!(published.is_empty(), "still mounted: {published:?}");
    let log = plugin.log();
    assert!(
        log.contains("engine reconciliation: releasing a use") && log.contains(&left[0]),
        "{log}"
    );
    assert_eq!(
        std::fs::read_to_string(mountpoint.join("log")).ok(),
        None,
        "the volume is no longer mounted at {}",
        mountpoint.display()
    );

    // The container's rm now has nothing to release; the volume is free to go.
    e.ok(&["rm", &container]);
    container_gone(
        &s.sb,
        writer,
        "after dockerd restored the container as exited",
    );
    e.ok(&["volume", "rm", "restartvol"]);
    let sb = teardown(s, plugin);
    drop(sb);
    host.assert_restored();
}

/// A log line without its terminal colours (the fields' names are styled: `held=1` is not one
/// run of text otherwise).
fn without_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // CSI: ESC [ parameters, ended by a letter.
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}
