//! `csi-isolator serve`: the isolator as a service on a Unix socket (see
//! `csi_isolator::service`). Prints where it listens on stdout, one line
//! each, then `ready`; serves until SIGINT or SIGTERM.

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::Args;
use csi_isolator::service::{self, ServeOptions, Started};
use tokio::signal::unix::{signal, SignalKind};

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
A containerizer calls Recover with its live containers right after connecting.")]
pub struct ServeArgs {
    #[command(flatten)]
    plugin: PluginArgs,
    /// The service socket (default: WORK_DIR/isolator.sock, or a short path
    /// under /run/csi-isolator/serve when that is too long).
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Serve Prometheus metrics at http://ADDR/metrics (port 0: any free
    /// port, printed on start).
    #[arg(long, value_name = "ADDR")]
    metrics: Option<SocketAddr>,
}

/// Runs `serve` until SIGINT/SIGTERM.
pub async fn run(work_dir: &Path, args: ServeArgs) -> anyhow::Result<ExitCode> {
    let mut opts = ServeOptions::new(work_dir, args.plugin.config(work_dir)?);
    opts.socket = args.socket;
    opts.metrics = args.metrics;
    // Installed before the socket exists, so a signal right after `ready` is never lost.
    let mut sigint = signal(SignalKind::interrupt()).context("install SIGINT handler")?;
    let mut sigterm = signal(SignalKind::terminate()).context("install SIGTERM handler")?;
    let shutdown = async move {
        tokio::select! {
            _ = sigint.recv() => {}
            _ = sigterm.recv() => {}
        }
    };
    service::serve(opts, announce, shutdown).await?;
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
