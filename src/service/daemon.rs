//! Start-up, serving and shutdown of `csi-isolator serve` (see the module
//! doc of [`crate::service`] for the contract).

use crate::io_step::IoStep;
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::isolator::VolumeIsolator;
use crate::provider::{ProviderConfig, ProviderError, StorageProvider};
use crate::service::admission::{self, Admission};
use crate::service::http;
use crate::service::metrics::ServiceMetrics;
use crate::service::proto::isolator_server::IsolatorServer;
use crate::service::server::IsolatorService;
use crate::service::socket::{self, SocketError, SocketGuard};

pub use crate::service::socket::default_socket_path;

/// The lock file `run` and `serve` hold exclusively in the work dir.
pub use crate::workdir::LOCK_FILE;

/// What `serve` does.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    /// The agent work dir.
    pub work_dir: PathBuf,
    /// The provider (bundled plugin or an endpoint).
    pub provider: ProviderConfig,
    /// The service socket (default: [`default_socket_path`] of the work dir).
    pub socket: Option<PathBuf>,
    /// Where to serve `/metrics` over HTTP (port 0: any free port); none: no metrics server.
    pub metrics: Option<SocketAddr>,
    /// The bounds of the metrics server.
    pub metrics_limits: http::Limits,
    /// Who may call the service besides root.
    pub admission: Admission,
    /// The bounds of the gRPC service.
    pub limits: ServiceLimits,
    /// How long calls in flight get to finish after the shutdown signal.
    pub drain: Duration,
    /// How long a managed plugin gets to exit after SIGTERM before SIGKILL.
    pub plugin_grace: Duration,
}

/// What one peer of the service socket can make serve hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServiceLimits {
    /// Admitted connections open at once; more are closed as soon as accepted.
    pub max_connections: usize,
    /// Calls in progress per connection; more wait for one to finish.
    pub concurrent_calls: usize,
    /// How long a caller waits for an answer. A call that takes longer is
    /// answered `CANCELLED` but runs to its end, so no operation is cut
    /// short halfway (see [`crate::service::server`]).
    pub request_timeout: Duration,
    /// How often an idle connection is pinged (HTTP/2 PING); a peer that
    /// does not answer within `keepalive_timeout` is disconnected, freeing
    /// its slot.
    pub keepalive_interval: Duration,
    /// How long a ping may go unanswered.
    pub keepalive_timeout: Duration,
}

impl Default for ServiceLimits {
    /// 64 connections, 32 calls in progress per connection, a 10 minute
    /// request timeout (a Prepare publishes every volume through the
    /// plugin: a few CSI calls each, each with up to a minute per attempt
    /// and two minutes of retries), a ping every 30 s answered within 20 s.
    fn default() -> Self {
        ServiceLimits {
            max_connections: 64,
            concurrent_calls: 32,
            request_timeout: Duration::from_secs(600),
            keepalive_interval: Duration::from_secs(30),
            keepalive_timeout: Duration::from_secs(20),
        }
    }
}

impl ServeOptions {
    /// Options with the default socket (root only), no metrics server, the
    /// default limits, 10 s to drain calls and 5 s for the plugin to stop.
    pub fn new(work_dir: impl Into<PathBuf>, provider: ProviderConfig) -> Self {
        ServeOptions {
            work_dir: work_dir.into(),
            provider,
            socket: None,
            metrics: None,
            metrics_limits: http::Limits::default(),
            admission: Admission::default(),
            limits: ServiceLimits::default(),
            drain: Duration::from_secs(10),
            plugin_grace: Duration::from_secs(5),
        }
    }
}

/// Where the service listens, once it does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Started {
    /// The service socket.
    pub socket: PathBuf,
    /// The metrics server's bound address, if any.
    pub metrics: Option<SocketAddr>,
    /// The provider id the service's volumes carry.
    pub provider_id: String,
}

/// `serve` failed to start or to serve.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The work dir, its lock or the privilege check failed.
    #[error(transparent)]
    WorkDir(#[from] crate::workdir::WorkDirError),
    /// A file or directory could not be made.
    #[error(transparent)]
    Io(#[from] IoStep),
    /// The provider could not start.
    #[error(transparent)]
    Provider(Box<ProviderError>),
    /// The service socket could not be set up.
    #[error(transparent)]
    Socket(#[from] SocketError),
    /// The metrics address could not be bound.
    #[error("bind metrics address {addr}")]
    MetricsBind {
        /// The address.
        addr: SocketAddr,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The gRPC server failed.
    #[error("serve on {socket}")]
    Serve {
        /// The socket.
        socket: PathBuf,
        /// The transport error.
        #[source]
        source: tonic::transport::Error,
    },
}

impl From<ProviderError> for ServeError {
    fn from(e: ProviderError) -> Self {
        ServeError::Provider(Box::new(e))
    }
}

/// Runs the service until `shutdown` resolves (see the module doc of
/// [`crate::service`]); `on_ready` is called once it accepts calls.
pub async fn serve(
    opts: ServeOptions,
    on_ready: impl FnOnce(&Started),
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    crate::workdir::require_mount_privilege("csi-isolator serve")?;
    let mut opts = opts;
    opts.work_dir = crate::workdir::canonical(&opts.work_dir)?;
    opts.provider.work_dir = opts.work_dir.clone();
    let lock = crate::workdir::lock(&opts.work_dir, None).await?;
    let result = match listen(&opts).await {
        Ok(listeners) => match StorageProvider::start(opts.provider.clone()).await {
            Ok(provider) => {
                let result =
                    serve_with_provider(&opts, listeners, provider.clone(), on_ready, shutdown)
                        .await;
                provider.shutdown(opts.plugin_grace).await;
                result
            }
            Err(e) => Err(e.into()),
        },
        Err(e) => Err(e),
    };
    drop(lock);
    result
}

/// The service socket and the metrics listener, bound before the provider
/// starts so a busy socket or port fails fast (calls that arrive meanwhile
/// wait in the backlog).
struct Listeners {
    socket_path: PathBuf,
    socket: tokio::net::UnixListener,
    socket_guard: SocketGuard,
    metrics: Option<(tokio::net::TcpListener, SocketAddr)>,
}

async fn listen(opts: &ServeOptions) -> Result<Listeners, ServeError> {
    let metrics = match opts.metrics {
        Some(addr) => {
            let bound = async {
                let l = tokio::net::TcpListener::bind(addr).await?;
                let local = l.local_addr()?;
                if let Some(warning) = http::exposure_warning(local) {
                    tracing::warn!("{warning}");
                }
                Ok((l, local))
            };
            Some(
                bound
                    .await
                    .map_err(|source| ServeError::MetricsBind { addr, source })?,
            )
        }
        None => None,
    };
    let socket_path = opts
        .socket
        .clone()
        .unwrap_or_else(|| default_socket_path(&opts.work_dir));
    let (socket, socket_guard) = socket::bind(&socket_path, opts.admission.group)?;
    Ok(Listeners {
        socket_path,
        socket,
        socket_guard,
        metrics,
    })
}

async fn serve_with_provider(
    opts: &ServeOptions,
    listeners: Listeners,
    provider: Arc<StorageProvider>,
    on_ready: impl FnOnce(&Started),
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let report = provider.recovery_report();
    if !report.actions.is_empty() || !report.failures.is_empty() {
        // Counts: each action and failure was logged with its volume when it happened.
        tracing::warn!(
            actions = report.actions.len(),
            failures = report.failures.len(),
            "provider recovery"
        );
    }
    let provider_id = provider.id().to_string();
    let isolator = Arc::new(VolumeIsolator::on_host(
        &opts.work_dir,
        provider,
        Arc::new(crate::mount::LinuxSyscall::new()),
    ));
    let table = isolator.mount_table();
    let metrics = Arc::new(ServiceMetrics::default());
    let service = IsolatorService::new(
        isolator.clone(),
        &opts.work_dir,
        table.clone(),
        metrics.clone(),
        opts.limits.max_connections * opts.limits.concurrent_calls,
    );
    let Listeners {
        socket_path,
        socket,
        socket_guard,
        metrics: metrics_listener,
    } = listeners;
    let metrics_addr = metrics_listener.as_ref().map(|(_, addr)| *addr);
    let incoming = admission::incoming(
        socket,
        opts.admission,
        opts.limits.max_connections,
        metrics.clone(),
    );
    let metrics_task = metrics_listener.map(|(l, _)| {
        let work_dir = opts.work_dir.clone();
        let counted = metrics.clone();
        let render: http::Render =
            Arc::new(move || metrics.render(isolator.manager(), &work_dir, &*table));
        let limits = opts.metrics_limits;
        tokio::spawn(http::serve(l, render, limits, counted))
    });

    on_ready(&Started {
        socket: socket_path.clone(),
        metrics: metrics_addr,
        provider_id,
    });
    tracing::info!(socket = %socket_path.display(), metrics = ?metrics_addr, "csi-isolator serve ready");

    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let limits = opts.limits;
    let server = tonic::transport::Server::builder()
        .concurrency_limit_per_connection(limits.concurrent_calls)
        .timeout(limits.request_timeout)
        .http2_keepalive_interval(Some(limits.keepalive_interval))
        .http2_keepalive_timeout(Some(limits.keepalive_timeout))
        .add_service(IsolatorServer::new(service))
        .serve_with_incoming_shutdown(incoming, async {
            let _ = stop_rx.await;
        });
    tokio::pin!(server);
    let served = tokio::select! {
        r = &mut server => r,
        () = shutdown => {
            tracing::info!("shutting down: no new calls; waiting for calls in flight");
            let _ = stop_tx.send(());
            match tokio::time::timeout(opts.drain, &mut server).await {
                Ok(r) => r,
                Err(_) => {
                    tracing::warn!("calls still in flight after {:?}; stopping anyway", opts.drain);
                    Ok(())
                }
            }
        }
    };
    if let Some(task) = metrics_task {
        task.abort();
    }
    drop(socket_guard);
    served.map_err(|source| ServeError::Serve {
        socket: socket_path,
        source,
    })
}
