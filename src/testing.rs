//! Helpers shared by the test targets (not part of the supported API).
//!
//! - [`require_root`]: tests that need root say so loudly instead of passing silently.
//! - [`Sandbox`]: a unique temp dir that, when dropped, kills the children registered with
//!   it, unmounts everything below it (deepest first, lazily as a last resort), detaches
//!   loop devices backed by files below it and removes it, pass or fail. Tests call
//!   [`Sandbox::assert_no_mounts_under`] / [`Sandbox::assert_no_loop_devices`] at the end to
//!   prove that the code under test cleaned up by itself.
//! - [`PluginProcess`]: a `csi-test-plugin` child on a socket in a sandbox, ready (Probe
//!   answered) when returned; killed when dropped.
//! - [`raw_clients`]: the generated Identity/Controller/Node clients on a socket.
//!
//! Helpers panic with a clear message on failure: they are for tests.

use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use rand::Rng;
use tonic::transport::Channel;

use crate::csi::proto::controller_client::ControllerClient;
use crate::csi::proto::identity_client::IdentityClient;
use crate::csi::proto::node_client::NodeClient;
use crate::csi::proto::ProbeRequest;
use crate::csi::transport::{connect_unix, endpoint_for, TransportError};
use crate::mount::{self, LinuxSyscall, MountInfo, MountTable, ProcMountTable};

/// Panics unless the process runs as root.
pub fn require_root() {
    if !nix::unistd::geteuid().is_root() {
        panic!("this test needs root (mounts, loop devices, namespaces): run it as root; it does not skip");
    }
}

/// Pids a sandbox kills when dropped.
type Registry = Arc<Mutex<Vec<u32>>>;

fn lock(registry: &Registry) -> std::sync::MutexGuard<'_, Vec<u32>> {
    registry.lock().unwrap_or_else(|p| p.into_inner())
}

/// A unique temporary directory that cleans up everything under it when dropped.
#[derive(Debug)]
pub struct Sandbox {
    path: PathBuf,
    children: Registry,
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

    /// Panics if a loop device is backed by a file in the sandbox.
    pub fn assert_no_loop_devices(&self) {
        let devices = self.loop_devices();
        assert!(
            devices.is_empty(),
            "loop devices left under {}: {devices:?}",
            self.path.display()
        );
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        for pid in lock(&self.children).drain(..) {
            if let Ok(pid) = i32::try_from(pid) {
                let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
            }
        }
        // Killed children release their mounts asynchronously; unmount_all_under retries EBUSY
        // and detaches lazily as a last resort, so this always ends.
        if let Err(e) = mount::unmount_all_under(&LinuxSyscall, &ProcMountTable::new(), &self.path)
        {
            eprintln!("sandbox {}: unmount: {e}", self.path.display());
        }
        match mount::find_backed_under(&self.path) {
            Ok(devices) => {
                for (device, _) in devices {
                    if let Err(e) = mount::detach(&device) {
                        eprintln!(
                            "sandbox {}: detach {}: {e}",
                            self.path.display(),
                            device.display()
                        );
                    }
                }
            }
            Err(e) => eprintln!("sandbox {}: list loop devices: {e}", self.path.display()),
        }
        // Never follow a path out of the sandbox: remove_dir_all does not follow symlinks, and
        // nothing is mounted below any more.
        if let Err(e) = fs::remove_dir_all(&self.path) {
            eprintln!("sandbox {}: remove: {e}", self.path.display());
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
    /// Starts the plugin binary `bin` (from the test: `env!("CARGO_BIN_EXE_csi-test-plugin")`)
    /// with its files in `<sandbox>/plugin` and `args` added to the command line, and waits
    /// until it answers Probe.
    pub async fn start(sandbox: &Sandbox, bin: impl AsRef<Path>, args: &[&str]) -> PluginProcess {
        Self::start_named(sandbox, "plugin", bin, args).await
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
            registry: sandbox.children.clone(),
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

/// A `mount` volume capability with access `mode` (no fs type, no flags).
pub fn mount_capability(
    mode: crate::csi::proto::volume_capability::access_mode::Mode,
) -> crate::csi::proto::VolumeCapability {
    use crate::csi::proto::volume_capability::{AccessMode, AccessType, MountVolume};
    crate::csi::proto::VolumeCapability {
        access_mode: Some(AccessMode { mode: mode as i32 }),
        access_type: Some(AccessType::Mount(MountVolume::default())),
    }
}

/// A `block` volume capability with access `mode`.
pub fn block_capability(
    mode: crate::csi::proto::volume_capability::access_mode::Mode,
) -> crate::csi::proto::VolumeCapability {
    use crate::csi::proto::volume_capability::{AccessMode, AccessType, BlockVolume};
    crate::csi::proto::VolumeCapability {
        access_mode: Some(AccessMode { mode: mode as i32 }),
        access_type: Some(AccessType::Block(BlockVolume::default())),
    }
}

/// The host's mount points (this process's namespace), leaving out other tests' sandboxes under the
/// temp dir: tests of other targets may run at the same time and mount there. Everything else,
/// and `sb` itself, is kept, so a test can compare the table before and after.
pub fn host_mount_points(sb: &Sandbox) -> Vec<PathBuf> {
    let tmp = fs::canonicalize(std::env::temp_dir()).expect("canonicalize temp dir");
    let mut points: Vec<PathBuf> = ProcMountTable::new()
        .mounts()
        .expect("read host mount table")
        .into_iter()
        .map(|m| m.mount_point)
        .filter(|p| !p.starts_with(&tmp) || p.starts_with(sb.path()))
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
    ] {
        std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(applet))
            .expect("applet symlink");
    }
    fs::create_dir_all(rootfs.join("proc")).expect("mkdir rootfs/proc");
    fs::create_dir_all(rootfs.join("tmp")).expect("mkdir rootfs/tmp");
    rootfs
}
