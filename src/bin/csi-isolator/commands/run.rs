//! `csi-isolator run`: a workload with CSI volumes (see `csi_isolator::runner`).

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use csi_isolator::resource::parse_resources;
use csi_isolator::resource::VolumeArg;
use csi_isolator::runner::{self, RunOptions};

use super::plugin_args::PluginArgs;
use super::{text, Utf8};

/// `run` options.
#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  # A 64 MiB volume at ./data (in the sandbox, the working directory), created on first use
  csi-isolator --work-dir /var/lib/csi-demo run --volume data:64M:data -- sh -c 'date >> data/log; cat data/log'
  # Read-only, at an absolute path inside a root filesystem
  csi-isolator run --rootfs /srv/rootfs --volume ref:1G:/ref:ro -- /bin/ls /ref
  # ext4 volumes on loop devices from the bundled plugin
  csi-isolator run --plugin-arg=--backing=loop --volume db:256M:db -- ./server
  # Mesos Resource JSON, against a CSI plugin that is already running
  csi-isolator run --plugin-endpoint unix:///run/csi/plugin.sock --resources volumes.json -- ./task")]
pub struct RunArgs {
    #[command(flatten)]
    plugin: PluginArgs,
    /// A volume: NAME:SIZE:CONTAINER_PATH[:ro] (repeatable). Created if new; a relative
    /// CONTAINER_PATH is inside the sandbox (the workload's working directory).
    #[arg(
        long = "volume",
        value_name = "NAME:SIZE:CONTAINER_PATH[:ro]",
        value_parser = Utf8(|s: &str| s.parse::<VolumeArg>())
    )]
    volumes: Vec<VolumeArg>,
    /// Mesos Resource JSON (a list) of volumes to mount, instead of or besides --volume.
    #[arg(long, value_name = "FILE.json")]
    resources: Option<PathBuf>,
    /// A root filesystem to pivot into (absolute container paths land inside it).
    #[arg(long, value_name = "DIR")]
    rootfs: Option<PathBuf>,
    /// The container id (default: run-<random>).
    #[arg(long, value_parser = text())]
    container_id: Option<String>,
    /// Seconds the workload gets to exit after SIGTERM before SIGKILL.
    #[arg(long, default_value = "10")]
    stop_grace: u64,
    /// The command and its arguments.
    #[arg(last = true, required = true, value_name = "COMMAND")]
    command: Vec<OsString>,
}

/// Runs `run`; exits with the workload's status.
pub async fn run(work_dir: &Path, args: RunArgs) -> anyhow::Result<ExitCode> {
    let resources = match &args.resources {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("read --resources {}", path.display()))?;
            parse_resources(&text).with_context(|| format!("--resources {}", path.display()))?
        }
        None => Vec::new(),
    };
    if let Some(rootfs) = &args.rootfs {
        if !rootfs.is_dir() {
            anyhow::bail!("--rootfs {}: not a directory", rootfs.display());
        }
    }
    let opts = RunOptions {
        work_dir: work_dir.to_path_buf(),
        provider: args.plugin.config(work_dir)?,
        volumes: args.volumes,
        resources,
        rootfs: args.rootfs,
        container_id: args.container_id,
        argv: args.command,
        stop_grace: Duration::from_secs(args.stop_grace),
    };
    let code = runner::run(opts).await?;
    Ok(ExitCode::from(u8::try_from(code).unwrap_or(255)))
}
