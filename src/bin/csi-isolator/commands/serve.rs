//! `csi-isolator serve`: the isolator as a service on a Unix socket (see
//! `csi_isolator::service`). Prints where it listens on stdout, one line
//! each, then `ready`; serves until SIGINT or SIGTERM.

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use csi_isolator::service::admission::resolve_group;
use csi_isolator::service::http::parse_addr;
use csi_isolator::service::{self, Admission, ServeOptions, ServiceLimits, Started};

use super::plugin_args::PluginArgs;

/// `serve` options.
#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  # The isolator service on the default socket, metrics on port 9464, the bundled plugin
  csi-isolator --work-dir /var/lib/csi-isolator serve --metrics 127.0.0.1:9464
  # Against a CSI plugin that is already running, on a chosen socket
  csi-isolator serve --plugin-endpoint unix:///run/csi/plugin.sock --socket /run/csi-isolator.sock
  curl -s http://127.0.0.1:9464/metrics | grep csi_isolator_volumes
  # A driver whose controller plugin runs apart from this node's plugin
  csi-isolator serve --plugin-endpoint unix:///run/csi/node.sock --controller-endpoint unix:///run/csi/controller.sock
  # A containerizer running as a member of group csi (its gid), not as root
  csi-isolator serve --allow-group csi --metrics 9464
A containerizer calls Recover with its live containers right after connecting.

Who may call: the socket is 0600 root (0660 root:GROUP with --allow-group), in
directories serve creates 0700 (0710 root:GROUP). Each connection is checked by
the peer's credentials (SO_PEERCRED): uid 0, or gid GROUP; any other is closed at
once, counted in csi_isolator_connections_refused_total and logged (rate-limited).
Isolate accepts only the container's process: not in serve's mount namespace, and
with a rootfs, its root is that rootfs (same device and inode).

Metrics: loopback by default (a bare PORT means 127.0.0.1:PORT); on any other
address serve warns, since the metrics name the plugins and count the volumes per
state for anyone who can reach it. At most 32 scrapes at once (more are closed at
once), each done within 5 s, the body reused for 1 s.")]
pub struct ServeArgs {
    #[command(flatten)]
    plugin: PluginArgs,
    /// The service socket (default: WORK_DIR/isolator.sock, or a short path
    /// under /run/csi-isolator/serve when that is too long).
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Serve Prometheus metrics at http://ADDR:PORT/metrics; a bare PORT
    /// means 127.0.0.1:PORT (port 0: any free port, printed on start).
    #[arg(long, value_name = "ADDR:PORT|PORT", value_parser = parse_addr)]
    metrics: Option<SocketAddr>,
    /// Also admit peers whose gid is this group (a name or a number); the
    /// socket is then 0660 and owned by the group.
    #[arg(long, value_name = "GID|NAME")]
    allow_group: Option<String>,
    /// Connections open at once on the socket; more are closed at once.
    #[arg(long, value_name = "N", default_value_t = ServiceLimits::default().max_connections as u32, value_parser = clap::value_parser!(u32).range(1..))]
    max_connections: u32,
    /// Calls in progress at once per connection; more wait.
    #[arg(long, value_name = "N", default_value_t = ServiceLimits::default().concurrent_calls as u32, value_parser = clap::value_parser!(u32).range(1..))]
    max_concurrent_calls: u32,
    /// Seconds a caller waits for an answer (then CANCELLED; the operation
    /// still runs to its end).
    #[arg(long, value_name = "SECS", default_value_t = ServiceLimits::default().request_timeout.as_secs(), value_parser = clap::value_parser!(u64).range(1..))]
    request_timeout: u64,
}

/// Runs `serve` until SIGINT/SIGTERM.
pub async fn run(work_dir: &Path, args: ServeArgs) -> anyhow::Result<ExitCode> {
    super::run::check_plugin_endpoint(&args.plugin)?;
    let mut opts = ServeOptions::new(work_dir, args.plugin.config(work_dir)?);
    opts.socket = args.socket;
    opts.metrics = args.metrics;
    if let Some(group) = &args.allow_group {
        opts.admission = Admission {
            group: Some(resolve_group(group)?),
        };
    }
    opts.limits = ServiceLimits {
        max_connections: args.max_connections as usize,
        concurrent_calls: args.max_concurrent_calls as usize,
        request_timeout: Duration::from_secs(args.request_timeout),
        ..ServiceLimits::default()
    };
    let shutdown = super::stop_signal()?;
    // What bursts of work free goes back to the kernel while the daemon runs (ends with it).
    let give_back = tokio::spawn(csi_isolator::memory::give_back_while_running());
    service::serve(opts, announce, shutdown).await?;
    give_back.abort();
    Ok(ExitCode::SUCCESS)
}

fn announce(started: &Started) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(
        out,
        "csi-isolator serve: isolator on unix://{}",
        started.socket.display()
    );
    let _ = writeln!(out, "csi-isolator serve: provider {}", started.provider_id);
    if let Some(addr) = started.metrics {
        let _ = writeln!(out, "csi-isolator serve: metrics on http://{addr}/metrics");
    }
    let _ = writeln!(out, "csi-isolator serve: ready");
    let _ = out.flush();
}
