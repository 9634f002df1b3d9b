//! `csi-isolator docker-plugin` driven by a real, private `dockerd` (issue 12): each test
//! starts the plugin on `/run/docker/plugins/<unique driver>.sock` (the only place Docker finds
//! a socket plugin), a dockerd with every directory in its sandbox and no network changes
//! (docs/../ENGINES.md's flags), imports a busybox image offline, drives it with the `docker`
//! CLI, then stops both and checks that nothing is left: no mount, no loop device, no process,
//! no plugin socket, and none of `/run/docker/plugins`, `/run/containerd/s` and
//! `/etc/docker/key.json` unless they were there before.
//!
//! The tests run one at a time (a lock here, a test group in `.config/nextest.toml`), so that
//! each knows which of those host paths it made. Every dockerd asks every plugin socket in
//! `/run/docker/plugins` (a plain `docker volume ls` lists the volumes of any other plugin there),
//! so each test still filters by its own driver and uses volume names no other test uses.
//!
//! Volume names given to `-v` have at least two characters: dockerd 20.10 takes `-v V:/data`
//! (a one-character name) for an anonymous volume at the container path `/V:/data`.
//!
//! Needs root and `dockerd` (Debian's docker.io, installed by `.ci/run`): without it the tests
//! fail, they never skip.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use csi_isolator_testing::{
    busybox_rootfs, isolator_command, mount_points_under, processes_mentioning, require_root,
    DockerPluginProcess, Sandbox,
};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

const BIN: &str = env!("CARGO_BIN_EXE_csi-isolator");
/// How long a daemon gets to become ready or to exit.
const TIMEOUT: Duration = Duration::from_secs(30);
/// Where dockerd looks for socket plugins.
const PLUGINS_DIR: &str = "/run/docker/plugins";
/// What dockerd creates even with a private exec root.
const KEY_JSON: &str = "/etc/docker/key.json";

/// Panics, saying how to install it, unless `dockerd` runs.
fn require_dockerd() {
    let ok = Command::new("dockerd")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok,
        "`dockerd` is not installed: run .ci/run (it installs Debian's docker.io); this test does not skip"
    );
}

fn unique() -> String {
    format!("{}-{:08x}", std::process::id(), rand::random::<u32>())
}

/// What the test changes outside its sandbox, undone however the test ends: the plugin's socket
/// in `/run/docker/plugins`, that directory (and `/run/docker`) if they did not exist before and
/// are empty, as `/run/containerd/s` (where dockerd's containerd puts its shims' sockets, even
/// with a private exec root), and `/etc/docker/key.json` if dockerd made it during the test.
struct HostGuard {
    /// One test at a time in this process (nextest runs them one at a time across processes:
    /// `.config/nextest.toml`), so "did not exist before" is true of this test alone. Dropped
    /// after the clean-up (fields drop after `drop`).
    _serial: std::sync::MutexGuard<'static, ()>,
    socket: PathBuf,
    /// Directories that did not exist before, deepest first: removed if empty.
    new_dirs: Vec<PathBuf>,
    key_existed: bool,
}

impl HostGuard {
    fn new(driver: &str) -> HostGuard {
        static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        let new_dirs = [
            "/run/docker/plugins",
            "/run/docker",
            "/run/containerd/s",
            "/run/containerd",
            "/etc/docker",
        ]
        .into_iter()
        .map(PathBuf::from)
        .filter(|d| !d.exists())
        .collect();
        HostGuard {
            _serial: serial,
            socket: Path::new(PLUGINS_DIR).join(format!("{driver}.sock")),
            new_dirs,
            key_existed: Path::new(KEY_JSON).exists(),
        }
    }
}

impl Drop for HostGuard {
    fn drop(&mut self) {
        match std::fs::remove_file(&self.socket) {
            Ok(()) => eprintln!("removed the plugin socket {}", self.socket.display()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => eprintln!("remove {}: {e}", self.socket.display()),
        }
        if !self.key_existed {
            let _ = std::fs::remove_file(KEY_JSON);
        }
        for dir in &self.new_dirs {
            // remove_dir removes only an empty directory: another test's socket keeps it.
            let _ = std::fs::remove_dir(dir);
        }
    }
}

fn wait_bounded(child: &mut Child, what: &str) -> std::process::ExitStatus {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        assert!(
            Instant::now() < deadline,
            "{what} did not exit within {TIMEOUT:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A private dockerd: data root, exec root, API socket and pid file in the sandbox, no bridge,
/// no firewall rules, no forwarding.
struct Engine {
    child: Child,
    host: String,
    log: PathBuf,
    config: PathBuf,
}

impl Engine {
    fn start(sb: &Sandbox) -> Engine {
        let log = sb.join("dockerd.log");
        let out = std::fs::File::create(&log).unwrap();
        let err = out.try_clone().unwrap();
        let host = format!("unix://{}", sb.join("docker.sock").display());
        let mut cmd = Command::new("dockerd");
        cmd.args([
            "--iptables=false",
            "--ip6tables=false",
            "--bridge=none",
            "--ip-forward=false",
            "--ip-masq=false",
            "--userland-proxy=false",
        ])
        .arg("--data-root")
        .arg(sb.join("data"))
        .arg("--exec-root")
        .arg(sb.join("exec"))
        .arg("--host")
        .arg(&host)
        .arg("--pidfile")
        .arg(sb.join("docker.pid"))
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err);
        let child = sb.spawn(&mut cmd).expect("spawn dockerd");
        let mut engine = Engine {
            child,
            host,
            log,
            config: sb.mkdir("docker-cli"),
        };
        let started = Instant::now();
        loop {
            if engine.docker(&["info"]).status.success() {
                break;
            }
            if let Some(status) = engine.child.try_wait().unwrap() {
                panic!("dockerd exited: {status}\n{}", engine.log());
            }
            assert!(
                started.elapsed() < TIMEOUT,
                "dockerd did not answer `docker info` within {TIMEOUT:?}\n{}",
                engine.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        eprintln!("dockerd ready in {:?}", started.elapsed());
        engine
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn command(&self) -> Command {
        let mut c = Command::new("docker");
        c.arg("-H")
            .arg(&self.host)
            .env("DOCKER_CONFIG", &self.config)
            .stdin(Stdio::null());
        c
    }

    fn docker(&self, args: &[&str]) -> Output {
        self.command().args(args).output().expect("run docker")
    }

    /// A `docker` command that must succeed: its stdout, trimmed.
    fn ok(&self, args: &[&str]) -> String {
        let out = self.docker(args);
        assert!(
            out.status.success(),
            "docker {args:?}: {}\nstdout: {}\nstderr: {}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// A `docker` command that must fail: its stderr.
    fn fails(&self, args: &[&str]) -> String {
        let out = self.docker(args);
        assert!(
            !out.status.success(),
            "docker {args:?} succeeded: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        String::from_utf8_lossy(&out.stderr).into_owned()
    }

    /// Imports a busybox image (no registry is reachable): a rootfs holding the static busybox
    /// and a few applets, as `tar | docker import`, under a unique name.
    fn import_busybox(&self, sb: &Sandbox) -> String {
        let rootfs = busybox_rootfs(sb, "rootfs");
        let image = format!("csi-isolator-test/busybox:{}", unique());
        let tar = Command::new("tar")
            .arg("-C")
            .arg(&rootfs)
            .args(["-c", "."])
            .output()
            .expect("run tar");
        assert!(tar.status.success(), "tar: {tar:?}");
        let mut import = self
            .command()
            .args(["import", "--change", "ENV PATH=/bin", "-", &image])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run docker import");
        import.stdin.take().unwrap().write_all(&tar.stdout).unwrap();
        let out = import.wait_with_output().unwrap();
        assert!(out.status.success(), "docker import: {out:?}");
        image
    }

    /// SIGTERM, then waits (bounded) for dockerd and its containerd to exit.
    fn stop(mut self, sb: &Sandbox) {
        let started = Instant::now();
        kill(Pid::from_raw(self.child.id() as i32), Signal::SIGTERM).unwrap();
        let status = wait_bounded(&mut self.child, "dockerd");
        sb.untrack(self.child.id());
        assert!(status.success(), "dockerd: {status}\n{}", self.log());
        // Its containerd names the exec root on its command line.
        let exec = sb.join("exec");
        while !processes_mentioning(&exec).is_empty() {
            assert!(
                started.elapsed() < TIMEOUT,
                "dockerd's containerd did not exit"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        eprintln!("dockerd stopped in {:?}", started.elapsed());
    }
}

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

/// Everything a test starts: the host guard first dropped last.
struct Setup {
    sb: Sandbox,
    driver: String,
    plugin: DockerPluginProcess,
    engine: Engine,
    image: String,
}

fn setup(label: &str) -> (HostGuard, Setup) {
    require_root();
    require_dockerd();
    let driver = format!("csi-isolator-test-{}", unique());
    let host = HostGuard::new(&driver);
    let sb = Sandbox::new(label);
    let plugin = DockerPluginProcess::start(&sb, BIN, &sb.join("work"), &host.socket, &[]);
    let engine = Engine::start(&sb);
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

/// After the host guard is gone: no plugin socket, and the host's directories as they were.
fn assert_host_clean(host: HostGuard) {
    let socket = host.socket.clone();
    let key_existed = host.key_existed;
    let new_dirs = host.new_dirs.clone();
    drop(host);
    assert!(!socket.exists(), "{} is left", socket.display());
    if !key_existed {
        assert!(!Path::new(KEY_JSON).exists(), "{KEY_JSON} is left");
    }
    for dir in new_dirs {
        assert!(!dir.exists(), "{} is left", dir.display());
    }
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
    assert_host_clean(host);
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
    assert_host_clean(host);
}
