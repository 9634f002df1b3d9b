//! Real container engines for tests: a private `dockerd` ([`Dockerd`]), a private Podman
//! ([`Podman`]), and [`HostPaths`], the guard for what they make at fixed host paths.
//!
//! Both engines keep their state in the test's sandbox, change no network (no bridge, no
//! firewall rule, no forwarding: `../shared/ENGINES.md`), and are stopped by the test. A few
//! files and directories they make at fixed host paths whatever their flags say are removed
//! after the test when they were not there before it. To know that, engine tests run one at a
//! time on the whole machine: [`HostPaths::claim`] holds a lock (an abstract Unix socket, so
//! no file is left, released when the process dies) until the paths are restored. That covers
//! tests of several worktrees run at once as well as nextest's processes.

use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use crate::{busybox_rootfs, processes_mentioning, Sandbox};

/// How long a daemon gets to become ready or to exit, and an engine command to finish.
pub const ENGINE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a test waits for another engine test to finish.
const LOCK_TIMEOUT: Duration = Duration::from_secs(20 * 60);
/// The abstract socket name that serialises engine tests on the machine.
const LOCK_NAME: &[u8] = b"csi-isolator-engine-tests";

/// Where dockerd looks for socket plugins.
pub const DOCKER_PLUGINS_DIR: &str = "/run/docker/plugins";

/// What a private dockerd makes outside its data and exec roots, deepest first.
pub const DOCKER_HOST_PATHS: &[(&str, Removal)] = &[
    ("/run/docker/plugins", Removal::IfEmpty),
    ("/run/docker", Removal::IfEmpty),
    // Its containerd's shim sockets, even with a private exec root.
    ("/run/containerd/s", Removal::IfEmpty),
    ("/run/containerd", Removal::IfEmpty),
    ("/etc/docker/key.json", Removal::File),
    ("/etc/docker", Removal::IfEmpty),
];

/// What Podman 4 makes on its first run whatever `--root` says.
pub const PODMAN_HOST_PATHS: &[(&str, Removal)] = &[
    ("/dev/shm/libpod_lock", Removal::File),
    ("/etc/containers/networks", Removal::Tree),
    ("/run/containers", Removal::Tree),
    ("/var/lib/containers", Removal::Tree),
];

/// How a host path the test made is removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Removal {
    /// A file.
    File,
    /// A directory, only when empty: another user's content keeps it.
    IfEmpty,
    /// A directory and everything in it.
    Tree,
}

/// A unique suffix for names outside the sandbox (driver names, images).
pub fn unique() -> String {
    format!("{}-{:08x}", std::process::id(), rand::random::<u32>())
}

/// The machine-wide engine-test lock, held while it lives.
#[derive(Debug)]
struct EngineLock(#[allow(dead_code)] UnixListener);

impl EngineLock {
    fn acquire() -> EngineLock {
        let addr = SocketAddr::from_abstract_name(LOCK_NAME).expect("abstract socket name");
        let started = Instant::now();
        loop {
            match UnixListener::bind_addr(&addr) {
                Ok(listener) => return EngineLock(listener),
                Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
                    assert!(
                        started.elapsed() < LOCK_TIMEOUT,
                        "another engine test held the machine's engine lock for {LOCK_TIMEOUT:?}"
                    );
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(e) => panic!("bind the engine-test lock: {e}"),
            }
        }
    }
}

/// The host paths a test's engines may make, restored however the test ends: each one absent
/// when the test began is removed at drop, as are the extra files named with
/// [`HostPaths::remove_at_end`] (a plugin socket in [`DOCKER_PLUGINS_DIR`]). Holds the
/// machine-wide engine-test lock until then.
#[derive(Debug)]
pub struct HostPaths {
    made: Vec<(PathBuf, Removal)>,
    extra: Vec<PathBuf>,
    // Dropped after `drop` has restored the paths (fields drop after it).
    _lock: EngineLock,
}

impl HostPaths {
    /// Waits for the engine-test lock, then records which of `paths` are absent.
    pub fn claim(paths: &[(&str, Removal)]) -> HostPaths {
        let lock = EngineLock::acquire();
        let made = paths
            .iter()
            .filter(|(p, _)| !Path::new(p).exists())
            .map(|(p, how)| (PathBuf::from(p), *how))
            .collect();
        HostPaths {
            made,
            extra: Vec::new(),
            _lock: lock,
        }
    }

    /// Also removes `file` at the end, whether or not it existed before.
    pub fn remove_at_end(&mut self, file: impl Into<PathBuf>) {
        self.extra.push(file.into());
    }

    /// Restores the paths, then fails the test if any it made is still there.
    pub fn assert_restored(self) {
        let expect_gone: Vec<PathBuf> = self
            .made
            .iter()
            .map(|(p, _)| p.clone())
            .chain(self.extra.iter().cloned())
            .collect();
        drop(self);
        let left: Vec<_> = expect_gone.iter().filter(|p| p.exists()).collect();
        assert!(left.is_empty(), "host paths left behind: {left:?}");
    }
}

impl Drop for HostPaths {
    fn drop(&mut self) {
        for file in &self.extra {
            match std::fs::remove_file(file) {
                Ok(()) => eprintln!("removed {}", file.display()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => eprintln!("remove {}: {e}", file.display()),
            }
        }
        for (path, how) in &self.made {
            let _ = match how {
                Removal::File => std::fs::remove_file(path),
                Removal::IfEmpty => std::fs::remove_dir(path),
                Removal::Tree => std::fs::remove_dir_all(path),
            };
        }
    }
}

/// Waits (bounded by [`ENGINE_TIMEOUT`]) for `child` to exit.
pub fn wait_bounded(child: &mut Child, what: &str) -> ExitStatus {
    let deadline = Instant::now() + ENGINE_TIMEOUT;
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            return status;
        }
        assert!(
            Instant::now() < deadline,
            "{what} did not exit within {ENGINE_TIMEOUT:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Panics, naming the package, unless `program --version` runs (engine tests never skip).
pub fn require_engine(program: &str, package: &str) {
    let ok = Command::new(program)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok,
        "`{program}` is not installed: run .ci/run (it installs Debian's {package}); this test does not skip"
    );
}

/// Asserts that `out` succeeded, naming the command: its stdout, trimmed.
fn succeeded(what: &str, args: &[&str], out: &Output) -> String {
    assert!(
        out.status.success(),
        "{what} {args:?}: {}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// Asserts that `out` failed, naming the command: its stderr.
fn failed(what: &str, args: &[&str], out: &Output) -> String {
    assert!(
        !out.status.success(),
        "{what} {args:?} succeeded: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A busybox rootfs (see [`busybox_rootfs`]) as a tar archive in the sandbox, for an
/// engine's `import` (no registry is reachable).
pub fn busybox_tar(sb: &Sandbox) -> PathBuf {
    let rootfs = busybox_rootfs(sb, "image-rootfs");
    let tar = sb.join("image-rootfs.tar");
    let status = Command::new("tar")
        .arg("-C")
        .arg(&rootfs)
        .arg("-cf")
        .arg(&tar)
        .arg(".")
        .status()
        .expect("run tar");
    assert!(status.success(), "tar the busybox rootfs");
    tar
}

/// Registers a container's pid (an engine's `inspect --format {{.State.Pid}}`) with the sandbox.
fn track_pid(sb: &Sandbox, container: &str, inspected: &str) -> u32 {
    let pid: u32 = inspected
        .parse()
        .unwrap_or_else(|_| panic!("container {container}: no pid in {inspected:?}"));
    assert!(pid > 0, "container {container} is not running");
    sb.track(pid);
    pid
}

/// Waits (bounded) until a container's process `pid` is gone, then forgets it (see
/// [`EngineCli::track_container`]).
pub fn container_gone(sb: &Sandbox, pid: u32, what: &str) {
    let started = Instant::now();
    while Path::new(&format!("/proc/{pid}")).exists() {
        assert!(
            started.elapsed() < ENGINE_TIMEOUT,
            "{what}: the container's process {pid} still runs"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    sb.untrack(pid);
}

/// A volume's `Status` (what the plugin's `Get` answered) from an engine's
/// `volume inspect --format {{json .Status}}` output.
fn parse_status(volume: &str, inspected: &str) -> serde_json::Value {
    serde_json::from_str(inspected)
        .unwrap_or_else(|e| panic!("volume {volume}: Status is not JSON ({e}): {inspected}"))
}

/// The Mount IDs in a volume's `Status` (its `users`).
pub fn volume_users(status: &serde_json::Value) -> Vec<String> {
    status["users"]
        .as_array()
        .unwrap_or_else(|| panic!("no users in {status}"))
        .iter()
        .map(|u| u.as_str().unwrap_or_default().to_string())
        .collect()
}

/// What tests do with an engine's CLI, the same for [`Dockerd`] and [`Podman`]: commands that
/// must succeed or fail, a volume's `Status`, an offline busybox image, a container's pid.
pub trait EngineCli {
    /// The CLI's name, for messages.
    const PROGRAM: &'static str;
    /// The name imported images get, before a unique tag.
    const IMAGE: &'static str;

    /// Runs the CLI with `args` against this engine.
    fn run(&self, args: &[&str]) -> Output;

    /// A command that must succeed: its stdout, trimmed.
    fn ok(&self, args: &[&str]) -> String {
        succeeded(Self::PROGRAM, args, &self.run(args))
    }

    /// A command that must fail: its stderr.
    fn fails(&self, args: &[&str]) -> String {
        failed(Self::PROGRAM, args, &self.run(args))
    }

    /// `volume inspect`'s `Status` of `volume`: what the plugin's `Get` answered.
    fn volume_status(&self, volume: &str) -> serde_json::Value {
        parse_status(
            volume,
            &self.ok(&["volume", "inspect", "--format", "{{json .Status}}", volume]),
        )
    }

    /// Imports a busybox image under a unique name (`ENV PATH=/bin`: an imported image has
    /// no PATH otherwise) and returns the name.
    fn import_busybox(&self, sb: &Sandbox) -> String {
        let tar = busybox_tar(sb);
        let image = format!("{}:{}", Self::IMAGE, unique());
        self.ok(&[
            "import",
            "--change",
            "ENV PATH=/bin",
            tar.to_str().expect("UTF-8 sandbox path"),
            &image,
        ]);
        image
    }

    /// The host pid of a running container's first process, registered with the sandbox: a
    /// container's processes do not name the sandbox, so without this a test that fails (or a
    /// daemon that loses track of its container) would leave it running, holding its volume's
    /// mount in its own namespace. [`container_gone`] forgets it once it has exited.
    fn track_container(&self, sb: &Sandbox, container: &str) -> u32 {
        track_pid(
            sb,
            container,
            &self.ok(&["inspect", "--format", "{{.State.Pid}}", container]),
        )
    }
}

impl EngineCli for Dockerd {
    const PROGRAM: &'static str = "docker";
    const IMAGE: &'static str = "csi-isolator-test/busybox";

    fn run(&self, args: &[&str]) -> Output {
        self.docker(args)
    }
}

impl EngineCli for Podman {
    const PROGRAM: &'static str = "podman";
    const IMAGE: &'static str = "localhost/csi-isolator-busybox";

    fn run(&self, args: &[&str]) -> Output {
        self.command(args)
    }
}

/// A private dockerd: data root, exec root, API socket and pid file in the sandbox, no bridge,
/// no firewall rules, no forwarding. Start it under a [`HostPaths`] claimed with
/// [`DOCKER_HOST_PATHS`].
#[derive(Debug)]
pub struct Dockerd {
    child: Child,
    /// The API endpoint, `unix://<sandbox>/docker.sock`.
    pub host: String,
    log: PathBuf,
    config: PathBuf,
}

impl Dockerd {
    /// Starts dockerd on the sandbox's directories (the same ones again after a stop or a
    /// kill, so a restarted daemon finds its containers and volumes) and waits until
    /// `docker info` answers.
    pub fn start(sb: &Sandbox) -> Dockerd {
        Dockerd::launch(sb, Command::new("dockerd"))
    }

    /// Starts `cmd` (dockerd, or a program that execs it in its own process: `nsenter`) with
    /// the private flags and directories, and waits until `docker info` answers.
    fn launch(sb: &Sandbox, mut cmd: Command) -> Dockerd {
        let log = sb.join("dockerd.log");
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .expect("open dockerd.log");
        let err = out.try_clone().expect("dup dockerd.log");
        let host = format!("unix://{}", sb.join("docker.sock").display());
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
        let config = sb.join("docker-cli");
        std::fs::create_dir_all(&config).expect("mkdir docker-cli");
        let mut engine = Dockerd {
            child,
            host,
            log,
            config,
        };
        let started = Instant::now();
        loop {
            if engine.docker(&["info"]).status.success() {
                break;
            }
            if let Some(status) = engine.child.try_wait().expect("wait for dockerd") {
                panic!("dockerd exited: {status}\n{}", engine.log());
            }
            assert!(
                started.elapsed() < ENGINE_TIMEOUT,
                "dockerd did not answer `docker info` within {ENGINE_TIMEOUT:?}\n{}",
                engine.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        eprintln!("dockerd ready in {:?}", started.elapsed());
        engine
    }

    /// What dockerd logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// dockerd's pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// A `docker` command against this daemon, with a private CLI config.
    pub fn command(&self) -> Command {
        let mut c = Command::new("docker");
        c.arg("-H")
            .arg(&self.host)
            .env("DOCKER_CONFIG", &self.config)
            .stdin(Stdio::null());
        c
    }

    /// Runs `docker args`.
    pub fn docker(&self, args: &[&str]) -> Output {
        self.command().args(args).output().expect("run docker")
    }

    /// Sends `signal` to dockerd and waits (bounded) for it to exit: its exit status. Its
    /// containerd and shims may outlive a SIGKILL; [`Dockerd::stop`] of a restarted daemon,
    /// or the sandbox, ends them.
    pub fn signal_and_wait(&mut self, sb: &Sandbox, signal: Signal) -> ExitStatus {
        kill(Pid::from_raw(self.child.id() as i32), signal).expect("signal dockerd");
        let status = wait_bounded(&mut self.child, "dockerd");
        sb.untrack(self.child.id());
        status
    }

    /// SIGTERM, then waits (bounded) for dockerd and its containerd to exit.
    pub fn stop(mut self, sb: &Sandbox) {
        let started = Instant::now();
        let status = self.signal_and_wait(sb, Signal::SIGTERM);
        assert!(status.success(), "dockerd: {status}\n{}", self.log());
        // Its containerd names the exec root on its command line.
        let exec = sb.join("exec");
        while !processes_mentioning(&exec).is_empty() {
            assert!(
                started.elapsed() < ENGINE_TIMEOUT,
                "dockerd's containerd did not exit"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        eprintln!("dockerd stopped in {:?}", started.elapsed());
    }

    /// After a SIGKILL of dockerd ([`Dockerd::signal_and_wait`]): waits (bounded) for its
    /// containerd to die (it gets SIGKILL with its parent) and removes containerd's pid file
    /// when that pid is gone or a zombie. A dead containerd whose parent no one reaps (this
    /// machine's pid 1 does not) stays a zombie, which a restarted dockerd takes for a live
    /// containerd and waits for until it fails ("timeout waiting for containerd to start").
    /// The container shims live on; the next [`Dockerd::start`] on the same sandbox starts a
    /// new containerd, which finds them.
    pub fn forget_killed_containerd(sb: &Sandbox) {
        let pid_file = sb.join("exec/containerd/containerd.pid");
        let Ok(text) = std::fs::read_to_string(&pid_file) else {
            return;
        };
        let Ok(pid) = text.trim().parse::<u32>() else {
            return;
        };
        let dead = || match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            // The state follows the command name, which is in parentheses.
            Ok(stat) => stat
                .rsplit_once(')')
                .is_some_and(|(_, rest)| rest.trim_start().starts_with(['Z', 'X'])),
            Err(_) => true,
        };
        let started = Instant::now();
        while !dead() {
            assert!(
                started.elapsed() < ENGINE_TIMEOUT,
                "dockerd's containerd (pid {pid}) outlived dockerd's SIGKILL"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        std::fs::remove_file(&pid_file).expect("remove containerd's pid file");
    }

    /// After a dockerd that was SIGKILLed has been started again and stopped: unmounts what
    /// only the killed one had mounted and no one unmounted, its bind of the data root onto
    /// itself (each dockerd makes one at start and removes its own at a clean stop).
    pub fn unmount_killed_data_root(sb: &Sandbox) {
        let data = sb.join("data");
        while crate::mount_points_under(&data).contains(&data) {
            nix::mount::umount(&data).expect("unmount the killed dockerd's data root bind");
        }
    }

    /// [`Dockerd::start`] inside the network namespace pinned at `netns` (a file a namespace
    /// is bind-mounted on, as `ip netns add` or `unshare --net=FILE` make), where Swarm may make
    /// its bridges (`../shared/ENGINES.md`). `nsenter` enters only the network namespace and
    /// execs dockerd, so [`Dockerd::pid`] is dockerd's and the daemon still sees the host's
    /// mounts, cgroups and `/run/docker/plugins`; `ip netns exec` would remount `/sys` and hide
    /// the cgroup mounts dockerd needs.
    pub fn start_in_netns(sb: &Sandbox, netns: &Path) -> Dockerd {
        let mut cmd = Command::new("nsenter");
        let mut net = std::ffi::OsString::from("--net=");
        net.push(netns);
        cmd.arg(net).arg("dockerd");
        Dockerd::launch(sb, cmd)
    }

    /// [`Dockerd::start_in_netns`] for one node of several on this machine: dockerd also gets a
    /// mount namespace of its own (`unshare --mount --propagation slave`) in which `plugins` is
    /// bound over [`DOCKER_PLUGINS_DIR`] and `etc` over `/etc/docker`, so each node finds its
    /// own volume plugin socket under the same driver name, and its own `key.json` (engine ID).
    /// The host's root is private here: only mounts under `keep` (a directory bound onto itself
    /// and made shared by the caller, the node's plugin's work dir under it) reach the node's
    /// namespace as the plugin makes them. Every other mount under the temp dir that the copy
    /// took (other tests' sandboxes, the other node's, the network namespaces' pins) is
    /// unmounted in the copy before dockerd starts, so it pins no other test's file system or
    /// loop device while dockerd runs. The namespace dies with dockerd and its containers; the
    /// host's table never sees its mounts. [`DOCKER_PLUGINS_DIR`] and `/etc/docker` are made on
    /// the host when absent (mount points): start it under [`HostPaths`] claimed with
    /// [`DOCKER_HOST_PATHS`].
    pub fn start_on_node(
        sb: &Sandbox,
        netns: &Path,
        plugins: &Path,
        etc: &Path,
        keep: &Path,
    ) -> Dockerd {
        let tmp = std::fs::canonicalize(std::env::temp_dir()).expect("canonicalize temp dir");
        // $1 keep, $2 temp dir, $3 plugins, $4 etc; dockerd's flags follow. The mount points
        // are read whole before any is unmounted; a lazy unmount of a parent takes its
        // children, whose own unmount then fails harmlessly.
        const SCRIPT: &str = r#"set -e
keep="$1"; tmp="$2"; plugins="$3"; etc="$4"; shift 4
points=$(while read -r _ _ _ _ point _; do
  case "$point" in "$keep"|"$keep"/*) ;; "$tmp"/*) echo "$point" ;; esac
done < /proc/self/mountinfo | sort -r)
for point in $points; do umount -l "$point" 2>/dev/null || true; done
mkdir -p /run/docker/plugins /etc/docker
mount --bind "$plugins" /run/docker/plugins
mount --bind "$etc" /etc/docker
exec dockerd "$@""#;
        let mut cmd = Command::new("nsenter");
        let mut net = std::ffi::OsString::from("--net=");
        net.push(netns);
        cmd.arg(net)
            .args(["unshare", "--mount", "--propagation", "slave", "sh", "-c"])
            .arg(SCRIPT)
            .arg("sh")
            .arg(keep)
            .arg(tmp)
            .arg(plugins)
            .arg(etc);
        Dockerd::launch(sb, cmd)
    }
}

/// A private Podman: its command with every state directory under the sandbox, but for its run
/// root, which Podman wants within 50 characters: a short temp dir of its own, removed with it.
/// Its `containers.conf` (named by `CONTAINERS_CONF`) sets `netns = "none"`, the ulimits root
/// may set here (no CAP_SYS_RESOURCE), runc, and the volume plugins given. Use it under a
/// [`HostPaths`] claimed with [`PODMAN_HOST_PATHS`].
#[derive(Debug)]
pub struct Podman {
    root: PathBuf,
    conf: PathBuf,
    runroot: tempfile::TempDir,
    hooks_dir: Option<PathBuf>,
}

impl Podman {
    /// A Podman whose `[engine.volume_plugins]` maps each driver name to its socket.
    pub fn new(sb: &Sandbox, volume_plugins: &[(&str, &Path)]) -> Podman {
        let root = sb.mkdir("podman");
        let plugins: String = volume_plugins
            .iter()
            .map(|(name, socket)| format!("{name} = \"{}\"\n", socket.display()))
            .collect();
        let conf = root.join("containers.conf");
        std::fs::write(
            &conf,
            format!(
                "[containers]\nnetns = \"none\"\ndefault_ulimits = [\"nofile=1024:1024\", \"nproc=1024:1024\"]\n\n\
                 [engine]\ncgroup_manager = \"cgroupfs\"\nevents_logger = \"file\"\nruntime = \"runc\"\n\n\
                 [engine.volume_plugins]\n{plugins}"
            ),
        )
        .expect("write containers.conf");
        let runroot = tempfile::Builder::new()
            .prefix("csi-pm-")
            .tempdir_in("/tmp")
            .expect("make Podman's run root");
        Podman {
            root,
            conf,
            runroot,
            hooks_dir: None,
        }
    }

    /// Makes every later command read OCI hooks from `dir` (`--hooks-dir`).
    pub fn with_hooks_dir(mut self, dir: &Path) -> Podman {
        self.hooks_dir = Some(dir.to_path_buf());
        self
    }

    /// Runs `podman args` (bounded by [`ENGINE_TIMEOUT`]: it fails the test after).
    pub fn command(&self, args: &[&str]) -> Output {
        let mut cmd = self.podman();
        cmd.args(args).stdin(Stdio::null());
        let started = Instant::now();
        let out = cmd.output().expect("run podman");
        assert!(
            started.elapsed() < ENGINE_TIMEOUT,
            "podman {args:?} took too long"
        );
        out
    }

    /// `podman` with the global flags every command of this Podman gets (its state directories,
    /// storage driver, events backend, `containers.conf`, hooks dir).
    fn podman(&self) -> Command {
        let mut cmd = Command::new("podman");
        cmd.env("CONTAINERS_CONF", &self.conf)
            .arg("--root")
            .arg(self.root.join("root"))
            .arg("--runroot")
            .arg(self.runroot.path())
            .arg("--tmpdir")
            .arg(self.root.join("tmp"))
            .args(["--storage-driver", "vfs", "--events-backend", "file"]);
        if let Some(dir) = &self.hooks_dir {
            cmd.arg("--hooks-dir").arg(dir);
        }
        cmd
    }

    /// Starts `podman system service --time=0 unix://<socket>` (the Docker-compatible API and
    /// Podman's own) on this Podman's directories, so it sees the containers the commands make;
    /// its log is `podman-service.log` in the sandbox. Returns once the socket accepts a
    /// connection; the sandbox kills the service unless the test stops it (SIGTERM, then
    /// [`wait_bounded`] and [`Sandbox::untrack`]).
    pub fn service(&self, sb: &Sandbox, socket: &Path) -> Child {
        let log = sb.join("podman-service.log");
        let out = std::fs::File::create(&log).expect("create podman-service.log");
        let err = out.try_clone().expect("dup podman-service.log");
        let mut cmd = self.podman();
        cmd.args(["system", "service", "--time=0"])
            .arg(format!("unix://{}", socket.display()))
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        let mut child = sb.spawn(&mut cmd).expect("spawn podman system service");
        let started = Instant::now();
        while std::os::unix::net::UnixStream::connect(socket).is_err() {
            if let Some(status) = child.try_wait().expect("wait for podman system service") {
                panic!(
                    "podman system service exited: {status}\n{}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            }
            assert!(
                started.elapsed() < ENGINE_TIMEOUT,
                "podman system service did not listen on {} within {ENGINE_TIMEOUT:?}",
                socket.display()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        eprintln!("podman system service ready in {:?}", started.elapsed());
        child
    }
}
