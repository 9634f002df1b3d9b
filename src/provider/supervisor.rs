//! Supervision of a managed CSI plugin process.
//!
//! Contract: [`Supervisor::start`] removes a stale socket, starts the plugin
//! with `CSI_ENDPOINT` pointing at a socket under the provider's work dir,
//! and returns once Probe says ready (bounded). While it runs, a monitor task
//! restarts the plugin with exponential backoff whenever it exits, counting
//! the terminations. [`Supervisor::stop`] ends it (SIGTERM, then SIGKILL
//! after a grace period). The plugin is started with a parent-death signal,
//! so it never outlives a crashed agent.

use std::os::unix::fs::DirBuilderExt;
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
use crate::provider::error::ProviderError;

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
    ready_timeout: Duration,
    pid: Mutex<Option<u32>>,
    terminations: AtomicU64,
    stopping: AtomicBool,
    stopped: Notify,
    exited: Notify,
}

impl Supervisor {
    /// Starts the plugin and waits until it is ready. Its stdout and
    /// stderr are appended to `log_path`.
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
            ready_timeout,
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
        let _ = std::fs::remove_file(&self.socket);
        if let Some(dir) = self.socket.parent() {
            if dir != self.log_path.parent().unwrap_or(dir) {
                let _ = std::fs::remove_dir(dir);
            }
        }
    }

    fn spawn(&self) -> Result<Child, ProviderError> {
        for dir in [self.socket.parent(), self.log_path.parent()]
            .into_iter()
            .flatten()
        {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|source| ProviderError::Io {
                    step: "create plugin socket directory",
                    path: dir.to_path_buf(),
                    source,
                })?;
        }
        remove_stale_socket(&self.socket);
        // The plugin's output goes to a log file next to its socket, as
        // Mesos keeps a plugin container's stdout/stderr.
        let log_path = self.log_path.clone();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|source| ProviderError::Io {
                step: "open plugin log",
                path: log_path.clone(),
                source,
            })?;
        let log_err = log.try_clone().map_err(|source| ProviderError::Io {
            step: "open plugin log",
            path: log_path.clone(),
            source,
        })?;
        let mut cmd = Command::new(&self.command.program);
        cmd.args(&self.command.args)
            .env("CSI_ENDPOINT", endpoint_for(&self.socket))
            .envs(self.command.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            // Its own process group: a terminal's Ctrl-C reaches us, not the
            // plugin, which must keep serving our cleanup calls.
            .process_group(0)
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log_err))
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
        *self.pid.lock().unwrap() = child.id();
        tracing::info!(plugin = %self.plugin, pid = ?child.id(), "started plugin");
        Ok(child)
    }

    async fn wait_ready(&self) -> Result<(), ProviderError> {
        let start = Instant::now();
        let mut delay = Duration::from_millis(5);
        let mut last = String::from("socket not created");
        while start.elapsed() < self.ready_timeout {
            if self.socket.exists() {
                match probe(&self.socket).await {
                    Ok(true) => return Ok(()),
                    Ok(false) => last = "Probe answered ready=false".into(),
                    Err(e) => last = e,
                }
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_millis(200));
        }
        Err(ProviderError::NotReady {
            plugin: self.plugin.clone(),
            endpoint: endpoint_for(&self.socket),
            waited_ms: start.elapsed().as_millis(),
            reason: last,
        })
    }
}

async fn probe(socket: &Path) -> Result<bool, String> {
    let channel = connect_unix(socket).await.map_err(|e| e.to_string())?;
    let mut client = IdentityClient::new(channel);
    let resp = tokio::time::timeout(Duration::from_secs(5), client.probe(ProbeRequest {}))
        .await
        .map_err(|_| "Probe timed out".to_string())?
        .map_err(|s| format!("Probe failed: {}: {}", s.code(), s.message()))?;
    Ok(resp.into_inner().ready.unwrap_or(true))
}

fn remove_stale_socket(socket: &Path) {
    match std::fs::remove_file(socket) {
        Ok(()) => tracing::info!(socket = %socket.display(), "removed stale plugin socket"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            tracing::warn!(socket = %socket.display(), error = %e, "cannot remove stale plugin socket")
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
                Err(e) => tracing::error!(plugin = %inner.plugin, error = %e, "restart failed"),
            }
        }
        if let Err(e) = inner.wait_ready().await {
            tracing::warn!(plugin = %inner.plugin, error = %e, "restarted plugin not ready yet");
        }
    }
}
