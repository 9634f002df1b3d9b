//! `csi-isolator docker-plugin`: the Docker (and Podman) volume plugin
//! protocol on a Unix socket (see `csi_isolator::docker_plugin`). Prints
//! where it listens on stdout, then `ready` (and tells systemd `READY=1` when
//! `$NOTIFY_SOCKET` is set); serves until SIGINT or SIGTERM.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use csi_isolator::docker_plugin::{
    self, EngineEndpoint, EngineLimits, EngineOptions, Limits, PluginOptions, Scope, Started,
    DEFAULT_SOCKET, DEFAULT_UNPUBLISH_DELAY,
};

use super::plugin_args::PluginArgs;

/// `docker-plugin` options.
#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  # The driver `csi-isolator` for Docker, on the bundled plugin
  csi-isolator --work-dir /var/lib/csi-isolator docker-plugin
  docker volume create --driver csi-isolator -o size=1G data
  docker run --rm -v data:/data busybox sh -c 'date > /data/x'
  # Any CSI driver already serving a socket
  csi-isolator docker-plugin --plugin-endpoint unix:///run/csi/nfs.sock
  # Release uses whose container is gone without an Unmount (Docker may skip
  # it after its own restart), asking dockerd every 30 s
  csi-isolator docker-plugin --engine unix:///var/run/docker.sock

Create options (-o KEY=VALUE): size (64M, 1G), access-mode (a CSI access mode),
fs-type, mount-flags (comma-separated), volume-id (import the plugin's volume of
that id instead of creating one); any other key is a CreateVolume parameter (a
volume context entry for an import). See docs/docker.md.

Who may call: the socket is 0600 root; each connection is checked by the peer's
credentials (SO_PEERCRED) and only root is served. Each Mount ID is a durable
user of its volume: a plugin killed and restarted keeps the volume published
and serves the later Unmount. On SIGTERM calls in flight finish and volumes in
use stay published. Under systemd (Type=notify) it sends READY=1 once its socket
serves and STOPPING=1 at SIGTERM: contrib/systemd/csi-isolator-docker-plugin.service.

With --engine, the engine (its socket must be served by root) is asked which
containers exist (GET /containers/json?all=1); every docker-plugin use of a
volume that no live container mounts in two listings --engine-interval apart
is released. Without it, a use lasts until Docker's Unmount or `csi-isolator
volume release NAME --container docker-plugin/MOUNT_ID`.")]
pub struct DockerPluginArgs {
    #[command(flatten)]
    plugin: PluginArgs,
    /// The socket the engine connects to (the file name without `.sock` is
    /// the driver's name).
    #[arg(long, value_name = "PATH", default_value = DEFAULT_SOCKET)]
    socket: PathBuf,
    /// What Capabilities answers: local (this host's volumes) or global.
    #[arg(long, default_value = "local", value_name = "local|global")]
    scope: Scope,
    /// Seconds the engine waits for an answer (the call itself runs to its end).
    #[arg(long, value_name = "SECS", default_value_t = Limits::default().call_timeout.as_secs(), value_parser = clap::value_parser!(u64).range(1..))]
    call_timeout: u64,
    /// Under the last-use policy, seconds a volume stays published after its last container
    /// left, so the next container (a restart, the next `docker run`) finds it published and
    /// starts as fast as with Docker's local driver; then it is unpublished. 0: at once.
    #[arg(long, value_name = "SECS", default_value_t = DEFAULT_UNPUBLISH_DELAY.as_secs())]
    unpublish_delay: u64,
    /// Connections open at once on the socket; more are closed at once.
    #[arg(long, value_name = "N", default_value_t = Limits::default().max_connections as u32, value_parser = clap::value_parser!(u32).range(1..))]
    max_connections: u32,
    /// The container engine's API socket (unix:///var/run/docker.sock, or
    /// Podman's `podman system service` socket): uses of volumes that no
    /// live container holds are released.
    #[arg(long, value_name = "unix:///PATH")]
    engine: Option<EngineEndpoint>,
    /// Seconds between two listings of the engine's containers (a use is
    /// released after two listings this far apart found its volume unheld).
    #[arg(long, value_name = "SECS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=86400), requires = "engine")]
    engine_interval: u64,
    /// Seconds one listing may take (connect, ask, read the answer).
    #[arg(long, value_name = "SECS", default_value_t = EngineLimits::default().timeout.as_secs(), value_parser = clap::value_parser!(u64).range(1..=600), requires = "engine")]
    engine_timeout: u64,
}

/// Runs `docker-plugin` until SIGINT/SIGTERM.
pub async fn run(work_dir: &Path, args: DockerPluginArgs) -> anyhow::Result<ExitCode> {
    super::run::check_plugin_endpoint(&args.plugin)?;
    let mut config = args.plugin.config(work_dir)?;
    config.unpublish_delay = Duration::from_secs(args.unpublish_delay);
    let mut opts = PluginOptions::new(work_dir, config);
    opts.socket = args.socket;
    opts.scope = args.scope;
    opts.limits = Limits {
        call_timeout: Duration::from_secs(args.call_timeout),
        max_connections: args.max_connections as usize,
        ..Limits::default()
    };
    opts.engine = args.engine.map(|endpoint| EngineOptions {
        interval: Duration::from_secs(args.engine_interval),
        limits: EngineLimits {
            timeout: Duration::from_secs(args.engine_timeout),
            ..EngineLimits::default()
        },
        ..EngineOptions::new(endpoint)
    });
    let shutdown = super::stop_signal()?;
    // What bursts of work free goes back to the kernel while the daemon runs (ends with it).
    let give_back = tokio::spawn(csi_isolator::memory::give_back_while_running());
    docker_plugin::run(opts, announce, shutdown).await?;
    give_back.abort();
    Ok(ExitCode::SUCCESS)
}

fn announce(started: &Started) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(
        out,
        "csi-isolator docker-plugin: volume plugin on unix://{}",
        started.socket.display()
    );
    let _ = writeln!(
        out,
        "csi-isolator docker-plugin: provider {}",
        started.provider_id
    );
    let _ = writeln!(out, "csi-isolator docker-plugin: ready");
    let _ = out.flush();
}
