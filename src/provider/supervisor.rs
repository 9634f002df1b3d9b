//! Supervision of a managed CSI plugin process.
//!
//! Contract: [`Supervisor::start`] removes a stale socket, starts the plugin
//! with `CSI_ENDPOINT` pointing at a socket under the provider's work dir,
//! and returns once Probe says ready (bounded). While it runs, a monitor task
//! restarts the plugin with exponential backoff whenever it exits, counting
//! the terminations. [`Supervisor::stop`] ends it (SIGTERM, then SIGKILL
//! after a grace period). The plugin is started with a parent-death signal,
//! so it never outlives a crashed agent.
//!
//! Its socket directory must be root's alone before the plugin is started
//! in it ([`crate::workdir::private_dir`]: root-owned, mode 0700, on a path
//! no other user can change), or a user who made it first could stand a
//! fake plugin there. Its stdout and stderr go through a pipe to a thread
//! that appends them to `plugin.log` (opened without following a symbolic
//! link, mode 0600) and rotates it to `plugin.log.1` past
//! [`PLUGIN_LOG_MAX_BYTES`]: a plugin that runs for months, or one that
//! writes without end, holds at most twice that on disk. The pipe rather
//! than the file as the plugin's stdout, because only the writer can tell
//! when to rotate, and a plugin appending to a file itself never would.

use crate::error_chain::Chain;
use crate::io_step::IoStep;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tokio::process::{Child, Command};
use tokio::sync::Notify;

use crate::csi::proto::identity_client::IdentityClient;
use crate::csi::proto::ProbeRequest;
use crate::csi::transport::{connect_unix, endpoint_for};
use crate::provider::error::{NotReadyCause, ProviderError};
use crate::workdir::{open_private_file, private_dir, PLUGIN_SOCKET_DIR};

/// The size past which `plugin.log` is rotated to `plugin.log.1` (the
/// previous `plugin.log.1` is dropped): a plugin's log takes at most twice
/// this on disk.
pub const PLUGIN_LOG_MAX_BYTES: u64 = 8 << 20;

/// How to start a plugin.
#[derive(Clone, Debug)]
pub struct PluginCommand {
    /// The executable.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<String>,
    /// Extra environment (`CSI_ENDPOINT` is always set).
    pub env: Vec<(String, String)>,
}

/// A running, supervised plugin process.
#[derive(Debug)]
pub struct Supervisor {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    plugin: String,
    command: PluginCommand,
    socket: PathBuf,
    log_path: PathBuf,
    /// The log, shared by the output threads of every start of the plugin.
    log: Arc<Mutex<Option<PluginLog>>>,
    ready_timeout: Duration,
    /// Whether the socket's directory passed the check: a refused one is
    /// someone else's, and nothing in it is removed.
    socket_dir_checked: AtomicBool,
    pid: Mutex<Option<u32>>,
    terminations: AtomicU64,
    stopping: AtomicBool,
    stopped: Notify,
    exited: Notify,
}

impl Supervisor {
    /// Starts the plugin and waits until it is ready. Its stdout and
    /// stderr are appended to `log_path`, rotated past
    /// [`PLUGIN_LOG_MAX_BYTES`]. The socket's directory is created if
    /// needed, and refused unless it is root's alone (see the module doc).
    pub async fn start(
        plugin: String,
        command: PluginCommand,
        socket: PathBuf,
        log_path: PathBuf,
        ready_timeout: Duration,
    ) -> Result<Self, ProviderError> {
        let inner = Arc::new(Inner {
            plugin,
            command,
            socket,
            log_path,
            log: Arc::new(Mutex::new(None)),
            ready_timeout,
            socket_dir_checked: AtomicBool::new(false),
            pid: Mutex::new(None),
            terminations: AtomicU64::new(0),
            stopping: AtomicBool::new(false),
            stopped: Notify::new(),
            exited: Notify::new(),
        });
        let child = match inner.spawn() {
            Ok(c) => c,
            Err(e) => {
                inner.remove_socket();
                return Err(e);
            }
        };
        if let Err(e) = inner.wait_ready().await {
            let mut child = child;
            let _ = child.start_kill();
            let _ = child.wait().await;
            inner.remove_socket();
            return Err(e);
        }
        tokio::spawn(monitor(inner.clone(), child));
        Ok(Supervisor { inner })
    }

    /// The endpoint the plugin serves.
    pub fn endpoint(&self) -> String {
        endpoint_for(&self.inner.socket)
    }

    /// The plugin's current pid, if running.
    pub fn pid(&self) -> Option<u32> {
        *self.inner.pid.lock().unwrap()
    }

    /// How many times the plugin exited without being asked to.
    pub fn terminations(&self) -> u64 {
        self.inner.terminations.load(Ordering::SeqCst)
    }

    /// Stops the plugin: SIGTERM, then SIGKILL after `grace`.
    pub async fn stop(&self, grace: Duration) {
        self.inner.stopping.store(true, Ordering::SeqCst);
        // Arm the exit notification before signalling, so an exit that
        // happens right away is not missed.
        let exited = self.inner.exited.notified();
        tokio::pin!(exited);
        exited.as_mut().enable();
        if let Some(pid) = self.pid() {
            let _ = kill(Pid::from_raw(pid as i32), Signal::SIGTERM);
            if tokio::time::timeout(grace, exited.as_mut()).await.is_err() {
                if let Some(pid) = self.pid() {
                    tracing::warn!(plugin = %self.inner.plugin, pid, "plugin ignored SIGTERM: SIGKILL");
                    let _ = kill(Pid::from_raw(pid as i32), Signal::SIGKILL);
                    let _ = tokio::time::timeout(Duration::from_secs(5), exited.as_mut()).await;
                }
            }
        }
        self.inner.stopped.notify_waiters();
        self.inner.remove_socket();
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        // Without an orderly stop the plugin must still not outlive us.
        if !self.inner.stopping.swap(true, Ordering::SeqCst) {
            if let Some(pid) = self.pid() {
                let _ = kill(Pid::from_raw(pid as i32), Signal::SIGKILL);
            }
            self.inner.remove_socket();
        }
        self.inner.stopped.notify_waiters();
    }
}

impl Inner {
    /// Removes the socket, and its directory when that was made for it
    /// alone (the short-path fallback), so nothing is left behind.
    fn remove_socket(&self) {
        if !self.socket_dir_checked.load(Ordering::SeqCst) {
            return;
        }
        let _ = std::fs::remove_file(&self.socket);
        if let Some(dir) = self.socket.parent() {
            if dir != self.log_path.parent().unwrap_or(dir) {
                let _ = std::fs::remove_dir(dir);
            }
        }
    }

    fn spawn(&self) -> Result<Child, ProviderError> {
        let mut dirs: Vec<&Path> = [self.socket.parent(), self.log_path.parent()]
            .into_iter()
            .flatten()
            .collect();
        // In the usual layout both are `plugin/`: walked once.
        dirs.dedup();
        for dir in dirs {
            private_dir(dir, PLUGIN_SOCKET_DIR).map_err(|e| {
                ProviderError::Io(IoStep::new(
                    "check plugin socket directory",
                    dir,
                    std::io::Error::other(e),
                ))
            })?;
        }
        self.socket_dir_checked.store(true, Ordering::SeqCst);
        remove_stale_socket(&self.socket);
        // The plugin's output goes to a log file next to its socket, as
        // Mesos keeps a plugin container's stdout/stderr, through a pipe so
        // that the log can be rotated (see the module doc).
        let log_error = |source| {
            ProviderError::Io(IoStep::new(
                "open plugin log",
                self.log_path.clone(),
                source,
            ))
        };
        {
            let mut log = self.log.lock().unwrap();
            if log.is_none() {
                *log = Some(
                    PluginLog::open(self.log_path.clone(), PLUGIN_LOG_MAX_BYTES)
                        .map_err(|e| log_error(std::io::Error::other(e)))?,
                );
            }
        }
        let (reader, writer) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
            .map_err(|errno| log_error(std::io::Error::from(errno)))?;
        let writer_err = writer.try_clone().map_err(log_error)?;
        let mut cmd = Command::new(&self.command.program);
        cmd.args(&self.command.args)
            .env("CSI_ENDPOINT", endpoint_for(&self.socket))
            // systemd's readiness socket is ours (docker-plugin under Type=notify): a plugin
            // that speaks sd_notify must not report for us.
            .env_remove("NOTIFY_SOCKET")
            .envs(self.command.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            // Its own process group: a terminal's Ctrl-C reaches us, not the
            // plugin, which must keep serving our cleanup calls.
            .process_group(0)
            .stdout(Stdio::from(writer))
            .stderr(Stdio::from(writer_err))
            .kill_on_drop(true);
        // SAFETY: the closure runs in the forked child before exec and only
        // calls prctl, which is async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().map_err(|source| ProviderError::Spawn {
            plugin: self.plugin.clone(),
            command: self.command.program.display().to_string(),
            source,
        })?;
        // Our copies of the pipe's write end go with `cmd`, so the thread
        // sees the end of the output when the plugin (and whatever it left
        // holding its stdout) is gone.
        drop(cmd);
        copy_output(&self.plugin, reader, self.log.clone());
        *self.pid.lock().unwrap() = child.id();
        tracing::info!(plugin = %self.plugin, pid = ?child.id(), "started plugin");
        Ok(child)
    }

    async fn wait_ready(&self) -> Result<(), ProviderError> {
        let start = Instant::now();
        let mut delay = Duration::from_millis(5);
        let mut last = NotReadyCause::NoSocket;
        while start.elapsed() < self.ready_timeout {
            if self.socket.exists() {
                match probe(&self.socket).await {
                    Ok(true) => {
                        tracing::info!(plugin = %self.plugin, waited_ms = start.elapsed().as_millis(), "plugin ready");
                        return Ok(());
                    }
                    Ok(false) => last = NotReadyCause::NotReadyYet,
                    Err(e) => last = e,
                }
            }
            tokio::time::sleep(delay).await;
            // A probe is a connect and one small RPC: asked every 50 ms at most, a plugin that
            // takes half a second to start (10,000 volumes) is seen ready within 50 ms of it,
            // not up to 200 ms later.
            delay = (delay * 2).min(Duration::from_millis(50));
        }
        Err(ProviderError::NotReady {
            plugin: self.plugin.clone(),
            endpoint: endpoint_for(&self.socket),
            waited_ms: start.elapsed().as_millis(),
            last,
        })
    }
}

async fn probe(socket: &Path) -> Result<bool, NotReadyCause> {
    const PROBE_TIMEOUT: Duration = Duration::from_secs(5);
    let channel = connect_unix(socket).await.map_err(NotReadyCause::Connect)?;
    let mut client = IdentityClient::new(channel);
    let resp = tokio::time::timeout(PROBE_TIMEOUT, client.probe(ProbeRequest {}))
        .await
        .map_err(|_| NotReadyCause::ProbeTimedOut(PROBE_TIMEOUT))?
        .map_err(|s| NotReadyCause::ProbeFailed {
            code: s.code(),
            message: crate::shown::shown(s.message()).into_owned(),
        })?;
    Ok(resp.into_inner().ready.unwrap_or(true))
}

/// Starts the thread that copies the plugin's output from `reader` into
/// `log` until the pipe's end. A failed write is reported once and the
/// output dropped, so the plugin never blocks on a full pipe.
fn copy_output(plugin: &str, reader: OwnedFd, log: Arc<Mutex<Option<PluginLog>>>) {
    let plugin = plugin.to_string();
    let spawned = std::thread::Builder::new()
        .name("plugin-log".into())
        .spawn(move || {
            let mut reader = File::from(reader);
            let mut buf = vec![0u8; 64 * 1024];
            let mut failing = false;
            loop {
                let n = match reader.read(&mut buf) {
                    Ok(0) => return,
                    Ok(n) => n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        tracing::warn!(plugin = %plugin, error = %Chain(&e), "cannot read the plugin's output");
                        return;
                    }
                };
                let mut guard = log.lock().unwrap_or_else(|p| p.into_inner());
                let Some(log) = guard.as_mut() else { continue };
                match log.write(&buf[..n]) {
                    Ok(()) => failing = false,
                    Err(e) if !failing => {
                        failing = true;
                        tracing::warn!(plugin = %plugin, path = %log.path.display(), error = %Chain(&e), "cannot write the plugin log; its output is dropped");
                    }
                    Err(_) => {}
                }
            }
        });
    if let Err(e) = spawned {
        // Without a reader the plugin would get EPIPE on its first write:
        // better to say why now.
        tracing::error!(error = %Chain(&e), "cannot start the plugin log thread");
    }
}

/// Opens `plugin.log` for appending: [`open_private_file`], or a stand-in in tests.
type OpenLog = fn(&Path) -> Result<File, crate::workdir::WorkDirError>;

fn open_log(path: &Path) -> Result<File, crate::workdir::WorkDirError> {
    open_private_file(path, true)
}

/// `plugin.log`, rotated to `plugin.log.1` past its cap.
#[derive(Debug)]
struct PluginLog {
    path: PathBuf,
    /// None after a rotation whose new file could not be opened: the next write tries again
    /// (never writing on into the rotated file).
    file: Option<File>,
    size: u64,
    cap: u64,
    open: OpenLog,
}

impl PluginLog {
    /// Opens (or creates) the log without following a symbolic link.
    fn open(path: PathBuf, cap: u64) -> Result<Self, crate::workdir::WorkDirError> {
        Self::open_with(path, cap, open_log)
    }

    fn open_with(
        path: PathBuf,
        cap: u64,
        open: OpenLog,
    ) -> Result<Self, crate::workdir::WorkDirError> {
        let file = open(&path)?;
        let size = file.metadata().map(|m| m.len()).unwrap_or(0);
        Ok(PluginLog {
            path,
            file: Some(file),
            size,
            cap,
            open,
        })
    }

    /// Appends `chunk`, rotating first when it would take the file past
    /// its cap (a chunk larger than the cap is cut to it). On an error the
    /// chunk is dropped.
    fn write(&mut self, chunk: &[u8]) -> std::io::Result<()> {
        let chunk = &chunk[..chunk
            .len()
            .min(usize::try_from(self.cap).unwrap_or(usize::MAX))];
        if self.file.is_some() && self.size > 0 && self.size + chunk.len() as u64 > self.cap {
            self.rotate()?;
        }
        let file = match &mut self.file {
            Some(file) => file,
            None => {
                let file = (self.open)(&self.path).map_err(std::io::Error::other)?;
                self.size = file.metadata().map(|m| m.len()).unwrap_or(0);
                self.file.insert(file)
            }
        };
        file.write_all(chunk)?;
        self.size += chunk.len() as u64;
        Ok(())
    }

    /// `plugin.log` becomes `plugin.log.1` (replacing it; a rename never
    /// follows a symbolic link) and a new `plugin.log` is started.
    fn rotate(&mut self) -> std::io::Result<()> {
        let mut old = self.path.clone().into_os_string();
        old.push(".1");
        if let Err(e) = std::fs::rename(&self.path, &old) {
            // The log must stay bounded even then: start it over in place.
            tracing::warn!(path = %self.path.display(), error = %Chain(&e), "cannot rotate the plugin log; truncating it");
            if let Some(file) = &self.file {
                file.set_len(0)?;
            }
            self.size = 0;
            return Ok(());
        }
        // The handle now writes to plugin.log.1: let it go before anything else can fail.
        self.file = None;
        self.size = 0;
        let file = (self.open)(&self.path).map_err(std::io::Error::other)?;
        self.file = Some(file);
        Ok(())
    }
}

fn remove_stale_socket(socket: &Path) {
    match std::fs::remove_file(socket) {
        Ok(()) => tracing::info!(socket = %socket.display(), "removed stale plugin socket"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            tracing::warn!(socket = %socket.display(), error = %Chain(&e), "cannot remove stale plugin socket")
        }
    }
}

async fn monitor(inner: Arc<Inner>, mut child: Child) {
    let mut backoff = Duration::from_millis(100);
    loop {
        let started = Instant::now();
        let status = tokio::select! {
            s = child.wait() => s,
            _ = inner.stopped.notified() => {
                let _ = child.start_kill();
                child.wait().await
            }
        };
        *inner.pid.lock().unwrap() = None;
        inner.exited.notify_waiters();
        if inner.stopping.load(Ordering::SeqCst) {
            tracing::info!(plugin = %inner.plugin, ?status, "plugin stopped");
            return;
        }
        let n = inner.terminations.fetch_add(1, Ordering::SeqCst) + 1;
        tracing::warn!(plugin = %inner.plugin, ?status, terminations = n, "plugin exited; restarting");
        if started.elapsed() > Duration::from_secs(30) {
            backoff = Duration::from_millis(100);
        }
        loop {
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = inner.stopped.notified() => return,
            }
            backoff = (backoff * 2).min(Duration::from_secs(5));
            if inner.stopping.load(Ordering::SeqCst) {
                return;
            }
            match inner.spawn() {
                Ok(c) => {
                    child = c;
                    break;
                }
                Err(e) => {
                    tracing::error!(plugin = %inner.plugin, error = %Chain(&e), "restart failed")
                }
            }
        }
        if let Err(e) = inner.wait_ready().await {
            tracing::warn!(plugin = %inner.plugin, error = %Chain(&e), "restarted plugin not ready yet");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    thread_local! {
        static OPEN_FAILS: Cell<bool> = const { Cell::new(false) };
    }

    fn flaky_open(path: &Path) -> Result<File, crate::workdir::WorkDirError> {
        if OPEN_FAILS.with(Cell::get) {
            return Err(crate::io_step::IoStep::new(
                "open",
                path,
                std::io::Error::from_raw_os_error(libc::EMFILE),
            )
            .into());
        }
        File::options()
            .append(true)
            .create(true)
            .open(path)
            .map_err(|source| crate::io_step::IoStep::new("open", path, source).into())
    }

    #[test]
    fn a_log_that_cannot_be_reopened_after_rotation_drops_output_and_spares_the_rotated_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("plugin.log");
        let rotated = dir.path().join("plugin.log.1");
        let mut log = PluginLog::open_with(path.clone(), 10, flaky_open).unwrap();
        log.write(b"0123456789").unwrap();

        OPEN_FAILS.with(|f| f.set(true));
        // Rotates, then cannot open a new plugin.log: the chunk is dropped.
        assert!(log.write(b"abc").is_err());
        assert!(log.write(b"def").is_err());
        assert_eq!(std::fs::read(&rotated).unwrap(), b"0123456789");
        assert!(!path.exists());

        OPEN_FAILS.with(|f| f.set(false));
        log.write(b"ghi").unwrap();
        log.write(b"jk").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"ghijk");
        assert_eq!(
            std::fs::read(&rotated).unwrap(),
            b"0123456789",
            "the rotated log was written or truncated"
        );
        // And it rotates again from there.
        log.write(b"lmnopq").unwrap();
        assert_eq!(std::fs::read(&rotated).unwrap(), b"ghijk");
        assert_eq!(std::fs::read(&path).unwrap(), b"lmnopq");
    }
}
