//! Start-up, the accept loop, one HTTP/1 exchange per connection, and
//! shutdown of `csi-isolator docker-plugin` (the contract is in the module
//! doc of [`crate::docker_plugin`]).
//!
//! Reused from `serve`, not copied: the private socket
//! ([`crate::service::socket::bind`]), the accept gate with its admission by
//! peer credentials and its connection cap
//! ([`crate::service::admission::gate`]), the work-dir lock.

use std::convert::Infallible;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::UnixStream;
use tokio::task::JoinSet;

use crate::error_chain::Chain;
use crate::provider::{ProviderConfig, ProviderError, StorageProvider};
use crate::service::accept::Admitted;
use crate::service::admission::{self, Admission, PeerSocket};
use crate::service::metrics::{Refusal, ServiceMetrics};
use crate::service::notify;
use crate::service::socket::{self, SocketError};
use crate::shown::shown;

use super::error::DockerError;
use super::handlers::{Driver, Endpoint, Scope};
use super::reconciler::{self, EngineOptions};
use super::wire;

/// Where Docker looks for a plugin named `csi-isolator`.
pub const DEFAULT_SOCKET: &str = "/run/docker/plugins/csi-isolator.sock";

/// The largest request head read (hyper's buffer; its minimum is 8 KiB).
const MAX_HEAD: usize = 16 * 1024;

/// How long an unused volume stays published after its last `Unmount` under the last-use
/// policy, by default ([`crate::provider::ProviderConfig::unpublish_delay`]): long enough for
/// the next container of a restart loop or of a script's `docker run`s, short enough that an
/// idle volume is soon free for another node.
pub const DEFAULT_UNPUBLISH_DELAY: Duration = Duration::from_secs(10);

/// What `docker-plugin` does.
#[derive(Clone, Debug)]
pub struct PluginOptions {
    /// The agent work dir.
    pub work_dir: PathBuf,
    /// The provider (bundled plugin or an endpoint).
    pub provider: ProviderConfig,
    /// The socket the engine connects to.
    pub socket: PathBuf,
    /// What `Capabilities` answers.
    pub scope: Scope,
    /// Who may connect besides root (nobody by default).
    pub admission: Admission,
    /// The bounds of what a peer can make the plugin hold.
    pub limits: Limits,
    /// How long calls in flight get to finish after the shutdown signal.
    pub drain: Duration,
    /// How long a managed plugin gets to exit after SIGTERM before SIGKILL.
    pub plugin_grace: Duration,
    /// The engine whose containers say which uses are still held
    /// (`--engine`); none: uses end only with `Unmount` or by hand.
    pub engine: Option<EngineOptions>,
}

impl PluginOptions {
    /// Options with the default socket, local scope, root only, the default
    /// limits, 30 s to drain calls and 5 s for the plugin to stop, no engine.
    pub fn new(work_dir: impl Into<PathBuf>, provider: ProviderConfig) -> Self {
        PluginOptions {
            work_dir: work_dir.into(),
            provider,
            socket: PathBuf::from(DEFAULT_SOCKET),
            scope: Scope::Local,
            admission: Admission::default(),
            limits: Limits::default(),
            drain: Duration::from_secs(30),
            plugin_grace: Duration::from_secs(5),
            engine: None,
        }
    }
}

/// What one peer of the socket can make the plugin hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Connections open at once; more are closed as soon as accepted.
    pub max_connections: usize,
    /// The largest request body read; a larger one is answered 413.
    pub max_body: usize,
    /// How long reading a request's head, and then its body, may take.
    pub read_timeout: Duration,
    /// How long a caller waits for an answer. A call that takes longer is
    /// answered with an error but runs to its end, so no publish is torn.
    pub call_timeout: Duration,
}

impl Default for Limits {
    /// 64 connections, 64 KiB bodies, 10 s to read a request, 2 minutes per
    /// call (Docker gives Create and Mount 2 minutes, the rest 1).
    fn default() -> Self {
        Limits {
            max_connections: 64,
            max_body: 64 * 1024,
            read_timeout: Duration::from_secs(10),
            call_timeout: Duration::from_secs(120),
        }
    }
}

/// Where the plugin listens, once it does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Started {
    /// The socket.
    pub socket: PathBuf,
    /// The provider id of its volumes.
    pub provider_id: String,
}

/// `docker-plugin` failed to start.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    /// The work dir, its lock or the privilege check failed.
    #[error(transparent)]
    WorkDir(#[from] crate::workdir::WorkDirError),
    /// The socket could not be set up.
    #[error(transparent)]
    Socket(#[from] SocketError),
    /// The provider could not start.
    #[error(transparent)]
    Provider(Box<ProviderError>),
}

/// The plugin's socket, for the accept gate.
struct DockerSocket;

impl PeerSocket for DockerSocket {
    const NAME: &'static str = "docker plugin socket";
    const REFUSED_PEER: Refusal = Refusal::DockerPeer;
    const OVER_CAPACITY: Refusal = Refusal::DockerCapacity;
}

/// Runs the plugin until `shutdown` resolves; `on_ready` is called once it
/// accepts calls.
pub async fn run(
    opts: PluginOptions,
    on_ready: impl FnOnce(&Started),
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), PluginError> {
    crate::workdir::require_mount_privilege("csi-isolator docker-plugin")?;
    let mut opts = opts;
    // The engine's answer releases uses: its socket must sit where only root can put one (the
    // work dir's rule for its directory); each listing also checks that root serves it.
    if let Some(engine) = &opts.engine {
        let dir = engine.endpoint.path().parent().unwrap_or(Path::new("/"));
        crate::workdir::safe_dir(dir, crate::workdir::ENGINE_SOCKET_DIR)?;
    }
    opts.work_dir = crate::workdir::canonical(&opts.work_dir)?;
    opts.provider.work_dir = opts.work_dir.clone();
    let lock = crate::workdir::lock(&opts.work_dir, None).await?;
    // Bound before the provider starts, so a busy socket fails fast; calls
    // that arrive meanwhile wait in the backlog.
    let (listener, socket_guard) = socket::bind(&opts.socket, opts.admission.group)?;
    let result = match StorageProvider::start(opts.provider.clone()).await {
        Ok(provider) => {
            let report = provider.recovery_report();
            if !report.actions.is_empty() || !report.failures.is_empty() {
                tracing::warn!(actions = ?report.actions, failures = ?report.failures, "provider recovery");
            }
            let started = Started {
                socket: opts.socket.clone(),
                provider_id: provider.id().to_string(),
            };
            let metrics = Arc::new(ServiceMetrics::default());
            let gate = admission::gate::<DockerSocket>(
                listener,
                opts.admission,
                opts.limits.max_connections,
                metrics,
            );
            let driver = Arc::new(Driver::new(provider.clone(), opts.scope));
            let (stop_rounds, stopped) = tokio::sync::watch::channel(false);
            let rounds = opts
                .engine
                .clone()
                .map(|engine| tokio::spawn(reconciler::run(provider.clone(), engine, stopped)));
            on_ready(&started);
            tell_systemd(&format!(
                "{}\nSTATUS=serving on {}",
                notify::READY,
                opts.socket.display()
            ));
            tracing::info!(socket = %opts.socket.display(), "csi-isolator docker-plugin ready");
            let settler = settle_idle_volumes(
                provider.clone(),
                opts.provider.unpublish_delay,
                stop_rounds.subscribe(),
            );
            accept_until(gate, driver, &opts, shutdown).await;
            // A round's releases and a settle run to their end; a listing in flight is dropped.
            let _ = stop_rounds.send(true);
            for task in [rounds, settler].into_iter().flatten() {
                let _ = task.await;
            }
            provider.shutdown(opts.plugin_grace).await;
            Ok(())
        }
        Err(e) => Err(PluginError::Provider(Box::new(e))),
    };
    drop(socket_guard);
    drop(lock);
    result
}

/// The unpublish delay's clock: settles the provider's idle volumes every quarter of the
/// delay (0.1 to 1 s) until `stop`; none without a delay. A settle under way finishes.
fn settle_idle_volumes(
    provider: Arc<StorageProvider>,
    delay: Duration,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Option<tokio::task::JoinHandle<()>> {
    if delay.is_zero() {
        return None;
    }
    let period = (delay / 4).clamp(Duration::from_millis(100), Duration::from_secs(1));
    Some(tokio::spawn(async move {
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => provider.settle_idle().await,
                _ = stop.changed() => break,
            }
        }
    }))
}

/// Serves connections until `shutdown`, then stops accepting and waits (up
/// to the drain time) for the calls in flight.
async fn accept_until(
    mut gate: crate::service::accept::Gate<admission::PeerChecked<DockerSocket>>,
    driver: Arc<Driver>,
    opts: &PluginOptions,
    shutdown: impl Future<Output = ()> + Send,
) {
    let mut connections = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            conn = gate.next() => {
                connections.spawn(connection(conn, driver.clone(), opts.limits));
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            () = &mut shutdown => break,
        }
    }
    drop(gate);
    tell_systemd(notify::STOPPING);
    tracing::info!(
        in_flight = connections.len(),
        "shutting down: no new calls; waiting for calls in flight"
    );
    let drained = tokio::time::timeout(opts.drain, async {
        while connections.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            "calls still in flight after {:?}; stopping anyway (their operations are recorded: the next start finishes them)",
            opts.drain
        );
    }
}

/// Tells systemd (a `Type=notify` unit) how the service is doing; a failure is only logged: the
/// calls are served all the same, and systemd times out a start it was not told of.
fn tell_systemd(state: &str) {
    if let Err(e) = notify::notify(state) {
        tracing::warn!(error = %Chain(&e), "could not notify systemd");
    }
}

/// One connection: one request, answered, then closed.
async fn connection(conn: Admitted<UnixStream>, driver: Arc<Driver>, limits: Limits) {
    let service = hyper::service::service_fn(move |req| {
        let driver = driver.clone();
        async move { Ok::<_, Infallible>(respond(req, driver, limits).await) }
    });
    let http = hyper::server::conn::http1::Builder::new()
        .keep_alive(false)
        .max_buf_size(MAX_HEAD)
        .timer(TokioTimer::new())
        .header_read_timeout(limits.read_timeout)
        .serve_connection(TokioIo::new(conn), service);
    // The answer comes within the call timeout (or says it did not); this
    // only frees the slot of a peer that reads nothing back.
    let whole = limits.read_timeout * 2 + limits.call_timeout + Duration::from_secs(5);
    match tokio::time::timeout(whole, http).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::debug!(error = %Chain(&e), "docker plugin: connection failed"),
        Err(_) => tracing::debug!("docker plugin: connection not done in time; closed"),
    }
}

/// The answer to one request.
async fn respond(
    req: Request<Incoming>,
    driver: Arc<Driver>,
    limits: Limits,
) -> Response<Full<Bytes>> {
    let answer = match read(req, limits).await {
        Ok((endpoint, body)) => call(endpoint, body, driver, limits).await,
        Err(e) => Err(e),
    };
    let (status, body) = match answer {
        Ok(body) => (StatusCode::OK, body),
        Err(e) => {
            let message = e.message();
            tracing::warn!(error = %message, "docker plugin: call refused or failed");
            let status =
                StatusCode::from_u16(e.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            let body = serde_json::to_vec(&wire::Done { err: message })
                .expect("an error answer serializes");
            (status, body)
        }
    };
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(wire::CONTENT_TYPE));
    r
}

/// The endpoint and the body, bounded in size and time.
async fn read(req: Request<Incoming>, limits: Limits) -> Result<(Endpoint, Bytes), DockerError> {
    let path = req.uri().path().to_string();
    if req.method() != Method::POST {
        return Err(DockerError::Method {
            method: shown(req.method().as_str()).into_owned(),
            path: shown(&path).into_owned(),
        });
    }
    let endpoint = Endpoint::from_path(&path).ok_or_else(|| DockerError::NotFound {
        path: shown(&path).into_owned(),
    })?;
    let call = endpoint.name().to_string();
    let body = Limited::new(req.into_body(), limits.max_body);
    match tokio::time::timeout(limits.read_timeout, body.collect()).await {
        Ok(Ok(collected)) => Ok((endpoint, collected.to_bytes())),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => Err(DockerError::TooLarge {
            call,
            limit: limits.max_body,
        }),
        Ok(Err(_)) | Err(_) => Err(DockerError::BodyRead { call }),
    }
}

/// Runs the call in a task of its own, so that a caller that gives up (or
/// the call timeout) never cuts a provider operation short. The answer comes
/// back over a oneshot: when this future is dropped (the caller went) or the
/// timeout answers, the task finds nobody to take it, and undoes a Mount
/// ([`Driver::call_and_answer`]). An answer sent just as the timeout fires
/// is still taken.
async fn call(
    endpoint: Endpoint,
    body: Bytes,
    driver: Arc<Driver>,
    limits: Limits,
) -> Result<Vec<u8>, DockerError> {
    let (answer, mut answered) = tokio::sync::oneshot::channel();
    tokio::spawn(async move { driver.call_and_answer(endpoint, &body, answer).await });
    match tokio::time::timeout(limits.call_timeout, &mut answered).await {
        Ok(Ok(answer)) => answer,
        Ok(Err(_)) => Err(DockerError::Aborted {
            call: endpoint.name(),
        }),
        Err(_) => {
            answered.close();
            answered.try_recv().unwrap_or(Err(DockerError::TimedOut {
                call: endpoint.name(),
                secs: limits.call_timeout.as_secs(),
            }))
        }
    }
}
