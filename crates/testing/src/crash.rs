//! `csi-isolator serve` in a crash test: started (armed with `CSI_ISOLATOR_CRASH_AFTER_WRITE=N`,
//! the provider's crash-point hook, or not), driven over its socket, and ended by SIGTERM or
//! found dead of the crash; each run's log kept and printed if the test fails. The plugin it
//! manages must be gone with it.

use std::fs::File;
use std::future::Future;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use csi_isolator::csi::transport::connect_unix;
use csi_isolator::provider::checkpoint::CRASH_AFTER_WRITE_ENV;
use csi_isolator::service::proto::isolator_client::IsolatorClient;
use csi_isolator::service::proto::{DestroyVolumeRequest, RecoverRequest};
use tonic::transport::Channel;

use crate::{plugin_bin, processes_mentioning, wait_for_serve_ready, PluginProcess, Sandbox};

/// How long serve has to become ready, and to exit.
pub const SERVE_TIMEOUT: Duration = Duration::from_secs(30);

/// One work dir and the serve runs on it, one at a time.
pub struct ServeRuns {
    /// The test's sandbox (the work dir, sockets and logs are in it).
    pub sb: Sandbox,
    /// The work dir.
    pub work: PathBuf,
    bin: PathBuf,
    serve: Option<Child>,
    serves: u32,
}

impl ServeRuns {
    /// Runs of `bin` (the `csi-isolator` binary) on `<sandbox>/work`.
    pub fn new(sb: Sandbox, bin: &str) -> ServeRuns {
        let work = sb.join("work");
        ServeRuns {
            sb,
            work,
            bin: PathBuf::from(bin),
            serve: None,
            serves: 0,
        }
    }

    /// Starts serve, armed to crash after `crash_after` durable writes if given, and waits until
    /// it is ready.
    pub fn start(&mut self, crash_after: Option<u32>) {
        self.serves += 1;
        let log = File::create(self.log(self.serves)).unwrap();
        let mut cmd = Command::new(&self.bin);
        cmd.env("CSI_ISOLATOR_SOCKET_DIR", self.sb.join("s"))
            .env_remove(CRASH_AFTER_WRITE_ENV)
            .arg("--work-dir")
            .arg(&self.work)
            .arg("serve")
            .arg("--socket")
            .arg(self.socket())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log);
        if let Some(n) = crash_after {
            cmd.env(CRASH_AFTER_WRITE_ENV, n.to_string());
        }
        let mut child = self.sb.spawn(&mut cmd).expect("spawn serve");
        wait_for_serve_ready(&mut child, SERVE_TIMEOUT);
        self.serve = Some(child);
    }

    /// A client of the running serve.
    pub async fn client(&self) -> IsolatorClient<Channel> {
        IsolatorClient::new(connect_unix(&self.socket()).await.unwrap())
    }

    /// Waits for serve's exit (SIGTERM first if `stop`) and for its plugin to be gone.
    pub fn end(&mut self, stop: bool) -> ExitStatus {
        let mut child = self.serve.take().expect("serve runs");
        if stop {
            nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(child.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            )
            .unwrap();
        }
        let deadline = Instant::now() + SERVE_TIMEOUT;
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            assert!(Instant::now() < deadline, "serve did not exit");
            std::thread::sleep(Duration::from_millis(10));
        };
        self.sb.untrack(child.id());
        while !processes_mentioning(&self.work).is_empty() {
            assert!(Instant::now() < deadline, "the plugin outlived serve");
            std::thread::sleep(Duration::from_millis(10));
        }
        status
    }

    fn socket(&self) -> PathBuf {
        self.sb.join("isolator.sock")
    }

    fn log(&self, run: u32) -> PathBuf {
        self.sb.join(format!("serve-{run}.log"))
    }

    /// The sandbox path of `rel`.
    pub fn path(&self, rel: impl AsRef<Path>) -> PathBuf {
        self.sb.join(rel)
    }

    /// Runs `call` on a client of a serve armed to crash after `n` durable writes: whether it
    /// crashed. A call that completes is followed by a clean stop; one that fails must be the
    /// crash (serve killed by SIGKILL), or the test fails at point `n`.
    pub async fn armed<F, Fut, T>(&mut self, n: u32, call: F) -> bool
    where
        F: FnOnce(IsolatorClient<Channel>) -> Fut,
        Fut: Future<Output = Result<T, tonic::Status>>,
    {
        self.start(Some(n));
        let outcome = call(self.client().await).await;
        match outcome {
            Ok(_) => {
                let stop = self.end(true);
                // The clean stop compacts the provider's journal: its crash points are
                // crashed at too, and the next start must recover from them.
                if stop.signal() == Some(9) {
                    return true;
                }
                assert!(stop.success(), "point {n}: serve's clean stop: {stop:?}");
                false
            }
            Err(status) => {
                let exit = self.end(false);
                assert_eq!(
                    exit.signal(),
                    Some(9),
                    "point {n}: {status} without the crash"
                );
                true
            }
        }
    }

    /// Starts a serve without the hook and has it recover with `known` containers still
    /// running; its client, once Recover found no corrupt checkpoint (at point `n`).
    pub async fn recovered(&mut self, n: u32, known: &[&str]) -> IsolatorClient<Channel> {
        self.start(None);
        let mut c = self.client().await;
        let r = c
            .recover(RecoverRequest {
                known_container_ids: known.iter().map(|id| id.to_string()).collect(),
            })
            .await
            .expect("Recover")
            .into_inner();
        assert!(r.corrupt.is_empty(), "point {n}: {r:?}");
        c
    }

    /// The end of a run: destroys `volumes` through `c`, stops serve cleanly and checks that
    /// nothing is left mounted in the sandbox and no loop device is attached to its files.
    pub async fn finish(&mut self, mut c: IsolatorClient<Channel>, volumes: &[&str]) {
        for id in volumes {
            c.destroy_volume(DestroyVolumeRequest {
                volume_id: id.to_string(),
                ..Default::default()
            })
            .await
            .unwrap_or_else(|e| panic!("DestroyVolume {id}: {e}"));
        }
        drop(c);
        assert!(self.end(true).success(), "serve's clean stop");
        self.sb.assert_no_mounts_under();
        self.sb.assert_no_loop_devices();
    }
}

impl Drop for ServeRuns {
    fn drop(&mut self) {
        if let Some(mut child) = self.serve.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if std::thread::panicking() {
            for k in 1..=self.serves {
                let log = self.log(k);
                eprintln!(
                    "--- {}\n{}",
                    log.display(),
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            }
        }
    }
}

/// Starts `bin serve` on `work` at `socket` with `serve_args` (e.g. `--plugin-endpoint URL`),
/// armed to crash after `crash` crash points if given, its output discarded; `None` when it died
/// before it was ready (the crash point fell in its start). For tests that keep their own plugin
/// and drive serve runs themselves; [`ServeRuns`] does the rest.
pub fn start_serve(
    sb: &Sandbox,
    bin: &str,
    work: &Path,
    socket: &Path,
    serve_args: &[&str],
    crash: Option<u32>,
) -> Option<Child> {
    use std::io::BufRead;
    let mut cmd = Command::new(bin);
    cmd.env_remove("RUST_LOG")
        .env_remove(CRASH_AFTER_WRITE_ENV)
        .arg("--work-dir")
        .arg(work)
        .arg("serve")
        .args(serve_args)
        .arg("--socket")
        .arg(socket)
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    if let Some(n) = crash {
        cmd.env(CRASH_AFTER_WRITE_ENV, n.to_string());
    }
    let mut child = sb.spawn(&mut cmd).expect("spawn serve");
    let stdout = child.stdout.take().unwrap();
    let ready = std::io::BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .any(|l| l == crate::SERVE_READY);
    if ready {
        Some(child)
    } else {
        let _ = child.wait();
        sb.untrack(child.id());
        None
    }
}

/// SIGTERM to an armed serve [`start_serve`] started: whether it exited cleanly; else it must
/// have been killed at a crash point of its clean stop (the journal's compaction).
pub fn stop_or_crash(sb: &Sandbox, mut child: Child) -> bool {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let status = child.wait().unwrap();
    sb.untrack(child.id());
    if status.signal() == Some(9) {
        return false;
    }
    assert!(
        status.success(),
        "serve exits cleanly on SIGTERM: {status:?}"
    );
    true
}

/// SIGTERM to a serve [`start_serve`] started, and a clean exit.
pub fn stop_serve(sb: &Sandbox, mut child: Child) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    assert!(
        child.wait().unwrap().success(),
        "serve exits cleanly on SIGTERM"
    );
    sb.untrack(child.id());
}

/// One work dir and the serve runs on it, on a plugin the test started itself and keeps across
/// serve's crashes (`--plugin-endpoint`); serve's output is discarded ([`start_serve`]).
pub struct EndpointServeRuns {
    /// The test's sandbox (the work dir and serve's socket are in it).
    pub sb: Sandbox,
    /// The work dir.
    pub work: PathBuf,
    bin: String,
    socket: PathBuf,
    endpoint: String,
}

impl EndpointServeRuns {
    /// Runs of `bin` (the `csi-isolator` binary) on `<sandbox>/work` against the plugin at
    /// `endpoint`.
    pub fn new(sb: Sandbox, bin: &str, endpoint: String) -> EndpointServeRuns {
        EndpointServeRuns {
            work: sb.join("work"),
            socket: sb.join("isolator.sock"),
            bin: bin.to_string(),
            endpoint,
            sb,
        }
    }

    /// The bundled plugin started in `sb` with `plugin_args`, and runs of `bin` on it.
    pub async fn on_bundled_plugin(
        sb: Sandbox,
        bin: &str,
        plugin_args: &[&str],
    ) -> (PluginProcess, EndpointServeRuns) {
        let plugin = PluginProcess::start(&sb, plugin_bin(), plugin_args).await;
        let runs = EndpointServeRuns::new(sb, bin, plugin.endpoint());
        (plugin, runs)
    }

    /// Starts serve (armed with `crash`, if any); `None` when it died before it was ready.
    pub fn start(&self, crash: Option<u32>) -> Option<Child> {
        start_serve(
            &self.sb,
            &self.bin,
            &self.work,
            &self.socket,
            &["--plugin-endpoint", &self.endpoint],
            crash,
        )
    }

    /// A client of the running serve.
    pub async fn client(&self) -> IsolatorClient<Channel> {
        IsolatorClient::new(connect_unix(&self.socket).await.expect("connect to serve"))
    }

    /// SIGTERM to a serve [`EndpointServeRuns::start`] started, and a clean exit.
    pub fn stop(&self, child: Child) {
        stop_serve(&self.sb, child);
    }

    /// Runs `life` against a serve armed to crash at point `n`: whether it completed (then serve
    /// is stopped cleanly). A failed call must be the crash (serve killed by SIGKILL); a crash in
    /// serve's start counts as not completed.
    pub async fn armed<F, Fut>(&self, n: u32, life: F) -> bool
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<(), tonic::Status>>,
    {
        let Some(mut child) = self.start(Some(n)) else {
            return false;
        };
        let done = life().await.is_ok();
        if done {
            // The clean stop compacts the provider's journal: a crash at one of its points is
            // not a completed life (the next start recovers and the life is finished again).
            if !stop_or_crash(&self.sb, child) {
                return false;
            }
        } else {
            let status = child.wait().unwrap();
            self.sb.untrack(child.id());
            assert_eq!(
                status.signal(),
                Some(9),
                "crash point {n}: serve failed without crashing"
            );
        }
        done
    }

    /// After the crash at point `n`: a serve without the hook, which has recovered (its own
    /// start, then Recover); stop it with [`EndpointServeRuns::stop`].
    pub async fn recovered(&self, n: u32) -> (Child, IsolatorClient<Channel>) {
        let child = self.start(None).expect("a serve without the hook starts");
        let mut c = self.client().await;
        c.recover(RecoverRequest::default())
            .await
            .unwrap_or_else(|e| panic!("crash point {n}: Recover: {e}"));
        (child, c)
    }
}

/// The bytes of every volume's checkpoint under `work` as a recovery would find them: each
/// provider's `volume.state` files with its journal's complete entries replayed over them
/// (a running or crashed provider writes its state files back lazily).
pub fn volume_states(work: &Path) -> Vec<Vec<u8>> {
    use csi_isolator::provider::checkpoint::{replay, JOURNAL_FILE};
    let mut out = Vec::new();
    let csi = work.join("csi");
    for plugin in std::fs::read_dir(&csi).into_iter().flatten().flatten() {
        for instance in std::fs::read_dir(plugin.path())
            .into_iter()
            .flatten()
            .flatten()
        {
            let base = instance.path();
            let mut by_dir: std::collections::BTreeMap<String, Option<Vec<u8>>> =
                Default::default();
            for v in std::fs::read_dir(base.join("volumes"))
                .into_iter()
                .flatten()
                .flatten()
            {
                if let Ok(bytes) = std::fs::read(v.path().join("volume.state")) {
                    by_dir.insert(v.file_name().to_string_lossy().into_owned(), Some(bytes));
                }
            }
            if let Ok(Some((parsed, _))) =
                csi_isolator::durable::journal::read(&base.join(JOURNAL_FILE))
            {
                let (found, _) = replay(&parsed.entries, csi_isolator::resource::encode_volume_id);
                for (dir, (_, state)) in found {
                    by_dir.insert(dir, state);
                }
            }
            out.extend(by_dir.into_values().flatten());
        }
    }
    out
}
