//! Helpers shared by the test targets (not part of the supported API).
//!
//! - [`require_root`]: tests that need root say so loudly instead of passing silently.
//! - [`Sandbox`]: a unique temp dir that, when dropped, kills the children registered with
//!   it (and any process naming it), unmounts everything below it (deepest first, lazily as a
//!   last resort), detaches loop devices backed by files below it and removes it, pass or fail;
//!   then it FAILS the test if it had anything to clean (see [`leaks`]), naming each leaked
//!   thing, unless the test declared it with [`Sandbox::expect_cleanup_of`].
//! - [`PluginProcess`]: a `csi-test-plugin` child on a socket in a sandbox, ready (Probe
//!   answered) when returned; killed when dropped.
//! - [`raw_clients`]: the generated Identity/Controller/Node clients on a socket.
//! - [`engines`]: a private dockerd and Podman, and the guard for the host paths they make.
//! - [`swarm`]: Docker Swarm nodes on one machine: network namespaces, a veth pair, a dockerd
//!   per node in its own mount namespace with its own plugin dir.
//! - [`exposition`]: a strict reader of the Prometheus text format that `/metrics` answers.
//! - [`files`]: files found by name below a work dir, whether a path is mounted, a payload.
//!
//! Helpers panic with a clear message on failure: they are for tests.

pub mod crash;
pub mod engines;
pub mod exposition;
pub mod files;
pub mod leaks;
pub mod logs;
pub mod powerloss;
pub mod powerloss_runs;
pub mod props;
pub mod swarm;
pub mod unprivileged;

use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::Rng;
use tonic::transport::Channel;

use csi_isolator::csi::proto::controller_client::ControllerClient;
use csi_isolator::csi::proto::identity_client::IdentityClient;
use csi_isolator::csi::proto::node_client::NodeClient;
use csi_isolator::csi::proto::ProbeRequest;
use csi_isolator::csi::transport::{connect_unix, endpoint_for, TransportError};
use csi_isolator::mount::{self, MountInfo, MountTable, ProcMountTable};
use csi_isolator::provider::bundled::{bundled_plugin_path, BUNDLED_BINARY};

pub use leaks::Leftover;

/// Runs `f` to completion on a fresh current-thread runtime (for the synchronous tests that
/// start plugin processes or read their listings).
pub fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime")
        .block_on(f)
}

/// Panics unless the process runs as root.
pub fn require_root() {
    if !nix::unistd::geteuid().is_root() {
        panic!("this test needs root (mounts, loop devices, namespaces): run it as root; it does not skip");
    }
}

/// The bundled plugin's binary, `csi-test-plugin`, where cargo put it: found as `run` finds it
/// ([`bundled_plugin_path`]: beside the running executable, or one directory up from a test's
/// `deps/`). Its crate is another package of the workspace, so cargo gives tests no
/// `CARGO_BIN_EXE_` for it; the README's test command (`cargo nextest run --all-targets`)
/// builds it with every other target. Panics, saying how to build it, when it is missing.
pub fn plugin_bin() -> &'static str {
    static BIN: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    BIN.get_or_init(|| {
        let bin = bundled_plugin_path().unwrap_or_else(|| {
            panic!(
                "{BUNDLED_BINARY} was not found beside this test's executable: build it with \
                 `cargo build -p {BUNDLED_BINARY}` (the README's test command, \
                 `cargo nextest run --all-targets`, builds it)"
            )
        });
        bin.into_os_string()
            .into_string()
            .expect("the target directory's path is UTF-8")
    })
}

/// The mount points under `dir`, from this process's mount table.
pub fn mount_points_under(dir: &Path) -> Vec<PathBuf> {
    ProcMountTable::new()
        .mounts_under(dir)
        .expect("read the mount table")
        .into_iter()
        .map(|m| m.mount_point)
        .collect()
}

/// Pids a sandbox kills when dropped.
type Registry = Arc<Mutex<Vec<u32>>>;

fn lock(registry: &Registry) -> std::sync::MutexGuard<'_, Vec<u32>> {
    registry.lock().unwrap_or_else(|p| p.into_inner())
}

/// A unique temporary directory that cleans up everything under it when dropped, and fails the
/// test when there was something to clean (a leak) that the test did not declare.
#[derive(Debug)]
pub struct Sandbox {
    path: PathBuf,
    children: Registry,
    /// Pids of the [`PluginProcess`]es started in the sandbox: each is a guard that kills its
    /// plugin when dropped, which may be after the sandbox (a struct holding both drops the
    /// sandbox first when it is declared first), so a live one is swept but is no leak.
    guarded: Registry,
    expected: Mutex<Vec<(Leftover, &'static str)>>,
}

impl Sandbox {
    /// Creates `<tmp>/csi-isolator-<label>-<pid>-<random>` (canonical path).
    pub fn new(label: &str) -> Sandbox {
        let tmp = fs::canonicalize(std::env::temp_dir()).expect("canonicalize temp dir");
        for _ in 0..16 {
            let suffix: u64 = rand::rng().random();
            let path = tmp.join(format!(
                "csi-isolator-{label}-{}-{suffix:016x}",
                std::process::id()
            ));
            match fs::create_dir(&path) {
                Ok(()) => {
                    return Sandbox {
                        path,
                        children: Arc::default(),
                        guarded: Arc::default(),
                        expected: Mutex::default(),
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => panic!("create sandbox {}: {e}", path.display()),
            }
        }
        panic!(
            "could not create a unique sandbox dir under {}",
            tmp.display()
        );
    }

    /// The sandbox directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A path inside the sandbox.
    pub fn join(&self, rel: impl AsRef<Path>) -> PathBuf {
        self.path.join(rel)
    }

    /// Creates a directory (and parents) inside the sandbox and returns it.
    pub fn mkdir(&self, rel: impl AsRef<Path>) -> PathBuf {
        let dir = self.join(rel);
        fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
        dir
    }

    /// Spawns `cmd` and registers the child to be killed when the sandbox is dropped.
    pub fn spawn(&self, cmd: &mut Command) -> io::Result<Child> {
        let child = cmd.spawn()?;
        self.track(child.id());
        Ok(child)
    }

    /// Registers a pid to be killed (SIGKILL) when the sandbox is dropped.
    pub fn track(&self, pid: u32) {
        lock(&self.children).push(pid);
    }

    /// Forgets a pid (after the caller reaped it, so a recycled pid is never killed).
    pub fn untrack(&self, pid: u32) {
        lock(&self.children).retain(|p| *p != pid);
    }

    /// Declares that the test leaves `what` for the sandbox to clean on purpose, `why` saying
    /// why (it shows in the log): the drop still sweeps it but does not fail the test for it.
    /// Keep these rare: every other leftover fails the test.
    pub fn expect_cleanup_of(&self, what: Leftover, why: &'static str) {
        self.expected
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((what, why));
    }

    /// Mounts at or below the sandbox, deepest first.
    pub fn mounts_under(&self) -> Vec<MountInfo> {
        ProcMountTable::new()
            .mounts_under(&self.path)
            .unwrap_or_else(|e| panic!("read mount table: {e}"))
    }

    /// Loop devices whose backing file lies in the sandbox, as (device, backing file).
    pub fn loop_devices(&self) -> Vec<(PathBuf, PathBuf)> {
        mount::find_backed_under(&self.path).unwrap_or_else(|e| panic!("list loop devices: {e}"))
    }

    /// Panics if anything is mounted at or below the sandbox.
    pub fn assert_no_mounts_under(&self) {
        let mounts = self.mounts_under();
        assert!(
            mounts.is_empty(),
            "mounts left under {}: {:?}",
            self.path.display(),
            mounts
                .iter()
                .map(|m| m.mount_point.display().to_string())
                .collect::<Vec<_>>()
        );
    }

    /// Panics if a loop device is backed by a file in the sandbox once self-clearing ones have had
    /// up to 5 s to run down after their last unmount.
    pub fn assert_no_loop_devices(&self) {
        let devices = leaks::loop_devices_after_rundown(&self.path, Duration::from_secs(5))
            .unwrap_or_else(|e| panic!("list loop devices: {e}"));
        assert!(
            devices.is_empty(),
            "loop devices left under {}: {devices:?}",
            self.path.display()
        );
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        let tracked: Vec<u32> = lock(&self.children).drain(..).collect();
        let guarded: Vec<u32> = lock(&self.guarded).drain(..).collect();
        let found: Vec<leaks::Leak> = leaks::find(&self.path, &tracked)
            .into_iter()
            .filter(
                |leak| !matches!(leak, leaks::Leak::Process { pid, .. } if guarded.contains(pid)),
            )
            .collect();
        let mut pids = tracked;
        pids.extend(guarded);
        pids.extend(found.iter().filter_map(|leak| match leak {
            leaks::Leak::Process { pid, .. } => Some(*pid),
            _ => None,
        }));
        leaks::sweep(&self.path, &pids);
        // Never follow a path out of the sandbox: remove_dir_all does not follow symlinks, and
        // nothing is mounted below any more.
        if let Err(e) = fs::remove_dir_all(&self.path) {
            eprintln!("sandbox {}: remove: {e}", self.path.display());
        }
        let expected =
            std::mem::take(&mut *self.expected.lock().unwrap_or_else(|p| p.into_inner()));
        for (what, why) in &expected {
            eprintln!(
                "sandbox {}: cleaning {what:?} as expected: {why}",
                self.path.display()
            );
        }
        let leaked = leaks::unexpected(found, &expected);
        if leaked.is_empty() {
            return;
        }
        let message = leaks::message(&self.path, &leaked);
        // A second panic while unwinding aborts the whole test binary: the test failed anyway,
        // so log the leaks instead.
        if std::thread::panicking() {
            eprintln!("{message}");
        } else {
            panic!("{message}");
        }
    }
}

/// The generated CSI clients on one channel.
#[derive(Clone, Debug)]
pub struct RawClients {
    /// Identity service.
    pub identity: IdentityClient<Channel>,
    /// Controller service.
    pub controller: ControllerClient<Channel>,
    /// Node service.
    pub node: NodeClient<Channel>,
}

/// Connects the generated clients to the plugin socket at `socket`.
pub async fn raw_clients(socket: &Path) -> Result<RawClients, TransportError> {
    let channel = connect_unix(socket).await?;
    Ok(RawClients {
        identity: IdentityClient::new(channel.clone()),
        controller: ControllerClient::new(channel.clone()),
        node: NodeClient::new(channel),
    })
}

/// How long [`PluginProcess::start`] waits for the plugin to answer Probe.
pub const READY_TIMEOUT: Duration = Duration::from_secs(10);

/// A `csi-test-plugin` child process in a sandbox.
#[derive(Debug)]
pub struct PluginProcess {
    bin: PathBuf,
    dir: PathBuf,
    args: Vec<String>,
    child: Option<Child>,
    registry: Registry,
}

impl PluginProcess {
    /// What the plugin lists over CSI (ListVolumes, one page): its volumes and their status.
    pub async fn listed(&self) -> Vec<csi_isolator::csi::proto::list_volumes_response::Entry> {
        let mut raw = raw_clients(&self.socket())
            .await
            .expect("connect to the plugin");
        raw.controller
            .list_volumes(csi_isolator::csi::proto::ListVolumesRequest::default())
            .await
            .expect("ListVolumes")
            .into_inner()
            .entries
    }

    /// Starts the plugin binary `bin` (usually [`plugin_bin`])
    /// with its files in `<sandbox>/plugin` and `args` added to the command line, and waits
    /// until it answers Probe.
    pub async fn start(sandbox: &Sandbox, bin: impl AsRef<Path>, args: &[&str]) -> PluginProcess {
        Self::start_named(sandbox, "plugin", bin, args).await
    }

    /// `csi-test-plugin --backing loop` ([`plugin_bin`]) as [`PluginProcess::start`] makes it,
    /// from a blocking test (no runtime of its own): the separately started plugin of the
    /// engine tests' `--plugin-endpoint` variants.
    pub fn start_loop_blocking(sandbox: &Sandbox) -> PluginProcess {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime")
            .block_on(Self::start(sandbox, plugin_bin(), &["--backing", "loop"]))
    }

    /// Like [`PluginProcess::start`], with the plugin's files in `<sandbox>/<name>`, so that
    /// one sandbox can hold several plugins.
    pub async fn start_named(
        sandbox: &Sandbox,
        name: &str,
        bin: impl AsRef<Path>,
        args: &[&str],
    ) -> PluginProcess {
        let dir = sandbox.mkdir(name);
        let mut plugin = PluginProcess {
            bin: bin.as_ref().to_path_buf(),
            dir,
            args: args.iter().map(|a| a.to_string()).collect(),
            child: None,
            registry: sandbox.guarded.clone(),
        };
        plugin.spawn_and_wait().await;
        plugin
    }

    /// The plugin's endpoint (`unix:///...`).
    pub fn endpoint(&self) -> String {
        endpoint_for(&self.socket())
    }

    /// The plugin's socket.
    pub fn socket(&self) -> PathBuf {
        self.dir.join("csi.sock")
    }

    /// The plugin's work dir.
    pub fn work_dir(&self) -> PathBuf {
        self.dir.join("work")
    }

    /// The directory holding the plugin's socket, work dir and logs.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn calls_path(&self) -> PathBuf {
        self.dir.join("calls.log")
    }

    fn stderr_path(&self) -> PathBuf {
        self.dir.join("stderr.log")
    }

    /// The RPCs the plugin received so far, one "<RPC> <volume_id or ->" line each, across
    /// restarts. The readiness checks of start/restart appear as `Probe -` lines.
    pub fn calls(&self) -> Vec<String> {
        match fs::read_to_string(self.calls_path()) {
            Ok(text) => text.lines().map(str::to_string).collect(),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Vec::new(),
            Err(e) => panic!("read call log: {e}"),
        }
    }

    /// Everything the plugin wrote to stderr, across restarts.
    pub fn stderr(&self) -> String {
        fs::read_to_string(self.stderr_path()).unwrap_or_default()
    }

    /// The pid of the running plugin.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Kills the plugin with SIGKILL and reaps it (a no-op when it is not running).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
            lock(&self.registry).retain(|p| *p != child.id());
        }
    }

    /// Waits up to `timeout` for the plugin to exit by itself (e.g. an `--exit-in` fault)
    /// and returns its status; panics if it is still running then.
    pub async fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            let child = self.child.as_mut().expect("plugin is not running");
            if let Some(status) = child.try_wait().expect("wait for plugin") {
                let pid = child.id();
                self.child = None;
                lock(&self.registry).retain(|p| *p != pid);
                return status;
            }
            if Instant::now() > deadline {
                panic!("plugin still running after {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Kills the plugin if it runs, then starts it again with the same arguments and work
    /// dir, and waits until it answers Probe.
    pub async fn restart(&mut self) {
        self.kill();
        self.spawn_and_wait().await;
    }

    async fn spawn_and_wait(&mut self) {
        let stderr = File::options()
            .create(true)
            .append(true)
            .open(self.stderr_path())
            .expect("open plugin stderr log");
        let mut cmd = Command::new(&self.bin);
        cmd.arg("--endpoint")
            .arg(self.endpoint())
            .arg("--work-dir")
            .arg(self.work_dir())
            .arg("--log-calls")
            .arg(self.calls_path())
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr);
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", self.bin.display()));
        lock(&self.registry).push(child.id());
        self.child = Some(child);
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                self.child = None;
                panic!(
                    "plugin exited before it was ready ({status}); stderr:\n{}",
                    self.stderr()
                );
            }
            if self.probe().await {
                return;
            }
            if Instant::now() > deadline {
                self.kill();
                panic!(
                    "plugin not ready after {READY_TIMEOUT:?}; stderr:\n{}",
                    self.stderr()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn probe(&self) -> bool {
        let Ok(channel) = connect_unix(&self.socket()).await else {
            return false;
        };
        let mut identity = IdentityClient::new(channel);
        matches!(identity.probe(ProbeRequest {}).await, Ok(r) if r.get_ref().ready != Some(false))
    }
}

impl Drop for PluginProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// `csi-isolator --work-dir WORK` for a test: `bin` is the test's
/// `env!("CARGO_BIN_EXE_csi-isolator")`; `RUST_LOG` is removed, and managed plugin sockets go to
/// `<work>/../s`, inside the sandbox (a work dir's own socket path there is too long for a socket
/// address, so it would go to `/run` otherwise).
pub fn isolator_command(bin: &str, work: &Path) -> Command {
    let mut c = Command::new(bin);
    c.arg("--work-dir").arg(work).env_remove("RUST_LOG");
    let parent = work
        .parent()
        .expect("a work dir inside a sandbox has a parent");
    c.env("CSI_ISOLATOR_SOCKET_DIR", parent.join("s"));
    c
}

/// The names of the volumes a work dir records (`cli volume list --json`).
pub fn recorded_volumes(cli: &str, work: &Path) -> Vec<String> {
    let out = isolator_command(cli, work)
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

/// A work dir's volumes as `cli status --json` reports them (state, users, mounted).
pub fn status_volumes(cli: &str, work: &Path) -> Vec<serde_json::Value> {
    let out = isolator_command(cli, work)
        .args(["status", "--json"])
        .output()
        .expect("run status");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("status --json ({e}): {out:?}"));
    report["volumes"].as_array().expect("volumes").clone()
}

/// A tmpfs of its own for a test, so that its free space changes only with what the test does;
/// unmounted (lazily) on drop, also when the test fails.
pub struct Tmpfs {
    path: PathBuf,
}

impl Tmpfs {
    /// Mounts a tmpfs of `size` (mount-option syntax: `64M`, `2T`; a limit, nothing is reserved)
    /// at `<sandbox>/<rel>`, mode 0700.
    pub fn mount(sandbox: &Sandbox, rel: &str, size: &str) -> Tmpfs {
        let path = sandbox.mkdir(rel);
        nix::mount::mount(
            Some("tmpfs"),
            &path,
            Some("tmpfs"),
            nix::mount::MsFlags::empty(),
            Some(format!("size={size},mode=0700").as_str()),
        )
        .unwrap_or_else(|e| panic!("mount a tmpfs at {}: {e}", path.display()));
        Tmpfs { path }
    }

    /// Where it is mounted.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes free on it (statvfs).
    pub fn free(&self) -> u64 {
        let st = nix::sys::statvfs::statvfs(&self.path)
            .unwrap_or_else(|e| panic!("statvfs {}: {e}", self.path.display()));
        st.blocks_available() * st.fragment_size()
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        if let Err(e) = nix::mount::umount2(&self.path, nix::mount::MntFlags::MNT_DETACH) {
            eprintln!("unmount tmpfs {}: {e}", self.path.display());
        }
    }
}

/// A `mount` volume capability with access `mode` (no fs type, no flags).
pub fn mount_capability(
    mode: csi_isolator::csi::proto::volume_capability::access_mode::Mode,
) -> csi_isolator::csi::proto::VolumeCapability {
    use csi_isolator::csi::proto::volume_capability::{AccessMode, AccessType, MountVolume};
    csi_isolator::csi::proto::VolumeCapability {
        access_mode: Some(AccessMode { mode: mode as i32 }),
        access_type: Some(AccessType::Mount(MountVolume::default())),
    }
}

/// A `block` volume capability with access `mode`.
pub fn block_capability(
    mode: csi_isolator::csi::proto::volume_capability::access_mode::Mode,
) -> csi_isolator::csi::proto::VolumeCapability {
    use csi_isolator::csi::proto::volume_capability::{AccessMode, AccessType, BlockVolume};
    csi_isolator::csi::proto::VolumeCapability {
        access_mode: Some(AccessMode { mode: mode as i32 }),
        access_type: Some(AccessType::Block(BlockVolume::default())),
    }
}

/// Pids of the processes (other than this one) whose command line contains `needle`: what a test
/// checks is gone after the code under test stopped its children (plugins, workloads).
pub fn processes_mentioning(needle: impl AsRef<std::ffi::OsStr>) -> Vec<u32> {
    use std::os::unix::ffi::OsStrExt;
    let needle = needle.as_ref().as_bytes();
    let me = std::process::id();
    let mut out = Vec::new();
    for e in fs::read_dir("/proc").expect("read /proc").flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if pid == me {
            continue;
        }
        if let Ok(cmdline) = fs::read(e.path().join("cmdline")) {
            if !needle.is_empty() && cmdline.windows(needle.len()).any(|w| w == needle) {
                out.push(pid);
            }
        }
    }
    out
}

/// Whether `path` lies under the temp dir but outside `sb`: where tests of other targets, which
/// may run at the same time, keep their sandboxes (and engines their run roots) and mount.
pub fn in_other_tests_temp(sb: &Sandbox, path: &Path) -> bool {
    static TMP: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    let tmp =
        TMP.get_or_init(|| fs::canonicalize(std::env::temp_dir()).expect("canonicalize temp dir"));
    path.starts_with(tmp) && !path.starts_with(sb.path())
}

/// The host's mount points (this process's namespace), leaving out other tests' sandboxes under the
/// temp dir: tests of other targets may run at the same time and mount there. Everything else,
/// and `sb` itself, is kept, so a test can compare the table before and after.
pub fn host_mount_points(sb: &Sandbox) -> Vec<PathBuf> {
    let mut points: Vec<PathBuf> = ProcMountTable::new()
        .mounts()
        .expect("read host mount table")
        .into_iter()
        .map(|m| m.mount_point)
        .filter(|p| !in_other_tests_temp(sb, p))
        .collect();
    points.sort();
    points
}

/// Where the static busybox is (Debian package busybox-static).
pub const BUSYBOX: &str = "/bin/busybox";

/// A minimal rootfs at `<sandbox>/<rel>`: the static busybox and its applets as symlinks, plus
/// /proc and /tmp. Panics, naming the package, when busybox is missing (tests never skip).
pub fn busybox_rootfs(sb: &Sandbox, rel: &str) -> PathBuf {
    if !Path::new(BUSYBOX).is_file() {
        panic!("{BUSYBOX} is missing: install the Debian package busybox-static; this test does not skip");
    }
    let rootfs = sb.mkdir(rel);
    fs::create_dir_all(rootfs.join("bin")).expect("mkdir rootfs/bin");
    fs::copy(BUSYBOX, rootfs.join("bin/busybox")).expect("copy busybox");
    for applet in [
        "sh", "ls", "cat", "touch", "sleep", "mount", "echo", "pwd", "test", "[", "grep", "mkdir",
        "true",
    ] {
        std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(applet))
            .expect("applet symlink");
    }
    fs::create_dir_all(rootfs.join("proc")).expect("mkdir rootfs/proc");
    fs::create_dir_all(rootfs.join("tmp")).expect("mkdir rootfs/tmp");
    rootfs
}

/// Panics unless `runc` runs (`runc --version`), naming the Debian package (tests never skip).
pub fn require_runc() {
    let runc = Command::new("runc")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    if !matches!(runc, Ok(s) if s.success()) {
        panic!("`runc` is not on PATH: install the Debian package `runc` (apt-get install runc); this test does not skip");
    }
}

/// An OCI bundle for `runc` inside a sandbox: `<sandbox>/<name>` holds the busybox rootfs
/// (see [`busybox_rootfs`]) at `rootfs`, and `config` is the config.json generated by
/// `runc spec`, patched to run without a terminal on a writable rootfs given by the relative
/// root path `rootfs` (as runtime-spec allows). The process args are left to the caller (see
/// [`RuncBundle::config_for`]); [`runc_run`] writes the config and runs the container.
#[derive(Debug)]
pub struct RuncBundle {
    /// The bundle directory (config.json, rootfs/).
    pub dir: PathBuf,
    /// The container's root filesystem (`<dir>/rootfs`).
    pub rootfs: PathBuf,
    /// runc's state root (`runc --root`), `<sandbox>/<name>-runc-state`.
    pub state: PathBuf,
    /// The config generated by `runc spec`, patched; tests add their own parts.
    pub config: serde_json::Value,
}

impl RuncBundle {
    /// Builds the bundle at `<sandbox>/<name>`. Panics, naming the Debian package, when `runc`
    /// or busybox is missing.
    pub fn new(sb: &Sandbox, name: &str) -> RuncBundle {
        require_runc();
        let dir = sb.mkdir(name);
        let rootfs = busybox_rootfs(sb, &format!("{name}/rootfs"));
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
        config["root"]["path"] = "rootfs".into();
        config["root"]["readonly"] = false.into();
        RuncBundle {
            dir,
            rootfs,
            state: sb.join(format!("{name}-runc-state")),
            config,
        }
    }

    /// A copy of the bundle's config whose process is `sh -c <script>`.
    pub fn config_for(&self, script: &str) -> serde_json::Value {
        let mut config = self.config.clone();
        config["process"]["args"] = serde_json::json!(["sh", "-c", script]);
        config
    }
}

/// Deletes a runc container (`runc delete --force`) when dropped, pass or fail.
#[derive(Debug)]
pub struct ContainerGuard {
    state: PathBuf,
    id: String,
}

impl ContainerGuard {
    /// Guards the container `id` in the runc state root `state`.
    pub fn new(state: &Path, id: &str) -> ContainerGuard {
        ContainerGuard {
            state: state.to_path_buf(),
            id: id.to_string(),
        }
    }

    /// The container id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Runs `runc delete --force <id>` now and returns its output (success also when the
    /// container is already gone).
    pub fn delete(&self) -> std::process::Output {
        self.try_delete().expect("run `runc delete`")
    }

    fn try_delete(&self) -> io::Result<std::process::Output> {
        Command::new("runc")
            .arg("--root")
            .arg(&self.state)
            .args(["delete", "--force", &self.id])
            .stdin(Stdio::null())
            .output()
    }
}

impl Drop for ContainerGuard {
    fn drop(&mut self) {
        let _ = self.try_delete();
    }
}

/// The result of one [`runc_run`].
#[derive(Debug)]
pub struct RuncRun {
    /// The container id.
    pub id: String,
    /// `runc run`'s exit code (`None` when killed by a signal).
    pub code: Option<i32>,
    /// What the container (and runc) wrote to stdout.
    pub stdout: String,
    /// What the container, runc and its hooks wrote to stderr.
    pub stderr: String,
    /// Deletes the container when dropped.
    pub guard: ContainerGuard,
}

/// Writes `config` as the bundle's config.json, then runs the container `id` to completion with
/// `runc --root <state> run --bundle <dir> <id>` (no terminal, stdout/stderr captured). Panics
/// when it does not finish within `timeout` (runc is killed first).
pub fn runc_run(
    sb: &Sandbox,
    bundle: &RuncBundle,
    id: &str,
    config: &serde_json::Value,
    timeout: Duration,
) -> RuncRun {
    use std::io::Read;

    fs::write(
        bundle.dir.join("config.json"),
        serde_json::to_vec_pretty(config).expect("serialize config.json"),
    )
    .expect("write config.json");
    let guard = ContainerGuard::new(&bundle.state, id);
    let mut child = sb
        .spawn(
            Command::new("runc")
                .arg("--root")
                .arg(&bundle.state)
                .args(["run", "--bundle"])
                .arg(&bundle.dir)
                .arg(id)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped()),
        )
        .expect("spawn `runc run`");
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for runc") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            sb.untrack(child.id());
            panic!("runc run {id} did not finish within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    sb.untrack(child.id());
    let mut stdout = String::new();
    let mut stderr = String::new();
    child
        .stdout
        .take()
        .expect("runc stdout piped")
        .read_to_string(&mut stdout)
        .expect("read runc stdout");
    child
        .stderr
        .take()
        .expect("runc stderr piped")
        .read_to_string(&mut stderr)
        .expect("read runc stderr");
    RuncRun {
        id: id.to_string(),
        code: status.code(),
        stdout,
        stderr,
        guard,
    }
}

/// Makes `bundle`'s createRuntime and poststop hooks run
/// `csi-isolator --work-dir <work> oci-hook --plugin-socket-dir <socket_dir> <extra>... <stage>`
/// (`bin` is the csi-isolator binary; the bundled plugin is found next to it).
pub fn set_oci_hooks(
    bundle: &mut RuncBundle,
    bin: &Path,
    work: &Path,
    socket_dir: &Path,
    extra: &[&str],
) {
    let hook = |stage: &str| {
        let mut args = vec![
            "csi-isolator".to_string(),
            "--work-dir".to_string(),
            work.to_str().expect("UTF-8 work dir").to_string(),
            "oci-hook".to_string(),
            "--plugin-socket-dir".to_string(),
            socket_dir.to_str().expect("UTF-8 socket dir").to_string(),
        ];
        args.extend(extra.iter().map(|a| a.to_string()));
        args.push(stage.to_string());
        serde_json::json!([{ "path": bin, "args": args }])
    };
    bundle.config["hooks"] = serde_json::json!({
        "createRuntime": hook("create-runtime"),
        "poststop": hook("poststop"),
    });
}

/// Starts the provider of the bundled plugin `plugin` (instance `default`) on the work dir `work`,
/// its socket under `socket_dir`, as the hook does; the plugin is tracked by `sb` (killed at its
/// drop if the caller never calls `shutdown`).
pub async fn start_bundled_provider(
    sb: &Sandbox,
    plugin: &Path,
    work: &Path,
    socket_dir: &Path,
) -> Arc<csi_isolator::provider::StorageProvider> {
    let mut config = csi_isolator::provider::bundled::bundled_config(plugin, work, "default", &[]);
    config.socket_dir = socket_dir.to_path_buf();
    config.ready_timeout = Duration::from_secs(10);
    let provider = csi_isolator::provider::StorageProvider::start(config)
        .await
        .unwrap_or_else(|e| panic!("start the provider on {}: {e}", work.display()));
    if let Some(pid) = provider.plugin_pid() {
        sb.track(pid);
    }
    provider
}

/// The line `csi-isolator serve` prints on stdout once it accepts calls.
pub const SERVE_READY: &str = "csi-isolator serve: ready";

/// Reads the stdout of a `csi-isolator serve` child (spawned with a piped stdout) until its
/// [`SERVE_READY`] line, within `timeout`, and returns the lines before it (the metrics address is
/// among them). Panics, saying what was read and how the child exited, when it does not get ready.
pub fn wait_for_serve_ready(child: &mut Child, timeout: Duration) -> Vec<String> {
    use std::io::BufRead;
    let stdout = child.stdout.take().expect("serve's stdout is piped");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + timeout;
    let mut lines = Vec::new();
    loop {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(line) if line == SERVE_READY => return lines,
            Ok(line) => lines.push(line),
            Err(e) => {
                let status = child.try_wait().ok().flatten();
                panic!("serve did not get ready ({e}); exit {status:?}; stdout {lines:?}");
            }
        }
    }
}

/// A running `csi-isolator docker-plugin` on a socket of the test's, ready (it printed its
/// `ready` line) when returned; killed by the sandbox if the test does not stop it.
#[derive(Debug)]
pub struct DockerPluginProcess {
    /// The service process.
    pub child: Child,
    /// Its Unix socket.
    pub socket: PathBuf,
    /// Its work dir.
    pub work: PathBuf,
    log: PathBuf,
}

impl DockerPluginProcess {
    /// The line it prints once it serves.
    pub const READY: &'static str = "csi-isolator docker-plugin: ready";

    /// Starts `cli docker-plugin --socket socket args…` on `work`, its log (stderr, at info)
    /// in the sandbox, and waits for its `ready` line (30 s at most). Unless `args` set
    /// `--unpublish-delay`, it is 0: a test sees a volume unpublished at its last `Unmount`
    /// (the product's default keeps it published a few seconds longer).
    pub fn start(
        sb: &Sandbox,
        cli: &str,
        work: &Path,
        socket: &Path,
        args: &[&str],
    ) -> DockerPluginProcess {
        Self::try_start(sb, cli, work, socket, args, &[]).unwrap_or_else(|(status, log)| {
            panic!("docker-plugin exited before it was ready: {status}; log:\n{log}")
        })
    }

    /// [`DockerPluginProcess::start`] with `envs` set (`RUST_LOG` among them overrides `info`;
    /// the crash-point hook `CSI_ISOLATOR_CRASH_AFTER_WRITE` only when `envs` sets it): the exit
    /// status and the log when the process exits before it is ready (a crash point of its
    /// start-up).
    pub fn try_start(
        sb: &Sandbox,
        cli: &str,
        work: &Path,
        socket: &Path,
        args: &[&str],
        envs: &[(&str, &str)],
    ) -> Result<DockerPluginProcess, (ExitStatus, String)> {
        static STARTED: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = STARTED.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let log = sb.join(format!("docker-plugin-{n}.log"));
        let mut cmd = isolator_command(cli, work);
        cmd.arg("docker-plugin").arg("--socket").arg(socket);
        if !args.iter().any(|a| a.starts_with("--unpublish-delay")) {
            cmd.arg("--unpublish-delay=0");
        }
        cmd.args(args)
            .env_remove(csi_isolator::provider::checkpoint::CRASH_AFTER_WRITE_ENV)
            .env("RUST_LOG", "info")
            .envs(envs.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(File::create(&log).expect("create the docker-plugin log"));
        let mut child = sb.spawn(&mut cmd).expect("spawn docker-plugin");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        // Reads stdout to its end, so that the plugin never writes to a closed pipe; the
        // sender goes with the end of stdout.
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in io::BufReader::new(stdout).lines().map_while(Result::ok) {
                if line == Self::READY {
                    let _ = tx.send(());
                }
            }
        });
        let ready = match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(()) => true,
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => false,
            Err(e) => panic!(
                "docker-plugin did not get ready ({e}); log:\n{}",
                fs::read_to_string(&log).unwrap_or_default()
            ),
        };
        let mut plugin = DockerPluginProcess {
            child,
            socket: socket.to_path_buf(),
            work: work.to_path_buf(),
            log,
        };
        if ready {
            return Ok(plugin);
        }
        let status = plugin.wait(sb);
        Err((status, plugin.log()))
    }

    /// What it logged so far.
    pub fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Sends `signal`, waits (30 s at most) for its exit and for its managed plugin to go.
    pub fn stop(mut self, sb: &Sandbox, signal: nix::sys::signal::Signal) -> ExitStatus {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        nix::sys::signal::kill(pid, signal).expect("signal docker-plugin");
        self.wait(sb)
    }

    /// Waits (30 s at most) for its exit and for its managed plugin to go: its exit status.
    pub fn wait(&mut self, sb: &Sandbox) -> ExitStatus {
        let deadline = Instant::now() + Duration::from_secs(30);
        let status = loop {
            if let Some(status) = self.child.try_wait().expect("wait for docker-plugin") {
                break status;
            }
            assert!(Instant::now() < deadline, "docker-plugin did not exit");
            std::thread::sleep(Duration::from_millis(10));
        };
        sb.untrack(self.child.id());
        while !processes_mentioning(&self.work).is_empty() {
            assert!(Instant::now() < deadline, "the managed plugin did not exit");
            std::thread::sleep(Duration::from_millis(10));
        }
        status
    }
}
