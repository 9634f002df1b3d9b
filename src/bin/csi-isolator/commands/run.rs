//! `csi-isolator run`: a workload with CSI volumes (see `csi_isolator::runner`).

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use csi_isolator::provider::MountSpec;
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
  # The long form: options of the volume and of its mount
  csi-isolator run --mount source=db,target=db,size=256M,mount-flags=noatime:nodev -- ./server
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
    /// A volume, in the long form Docker users know (repeatable):
    /// source=NAME,target=PATH,size=SIZE[,readonly][,type=mount|block][,fs-type=T]
    /// [,mount-flags=a:b][,access-mode=MODE][,propagation=private|rslave|rshared][,secrets=FILE].
    /// Created if new, with these options; a volume that exists must have them.
    #[arg(
        long = "mount",
        value_name = "source=NAME,target=PATH,size=SIZE[,KEY=VALUE...]",
        value_parser = Utf8(|s: &str| s.parse::<MountSpec>())
    )]
    mounts: Vec<MountSpec>,
    /// Mesos Resource JSON (a list) of volumes to mount, instead of or besides --volume.
    #[arg(long, value_name = "FILE.json")]
    resources: Option<PathBuf>,
    /// A root filesystem to pivot into (absolute container paths land inside it).
    #[arg(long, value_name = "DIR")]
    rootfs: Option<PathBuf>,
    /// Run the workload as this user: UID[:GID] or NAME[:GROUP] (names from the host's
    /// databases; default: root). Volumes it mounts read-write and does not share are made
    /// writable for its group.
    #[arg(long, value_name = "UID[:GID]", value_parser = text())]
    user: Option<String>,
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

/// Refuses at once a `--plugin-endpoint` (or `--controller-endpoint`) whose
/// path is there but is not a socket (connecting would be retried until the
/// plugin timeout); a path that is not there yet is waited for, as a plugin
/// may still be starting.
pub(super) fn check_plugin_endpoint(plugin: &super::plugin_args::PluginArgs) -> anyhow::Result<()> {
    use std::os::unix::fs::FileTypeExt;
    for (flag, endpoint, otherwise) in [
        (
            "--plugin-endpoint",
            &plugin.plugin_endpoint,
            "leave --plugin-endpoint out to use the bundled plugin",
        ),
        (
            "--controller-endpoint",
            &plugin.controller_endpoint,
            "leave --controller-endpoint out to use one plugin for both",
        ),
    ] {
        let Some(path) = endpoint.as_deref().and_then(|e| e.strip_prefix("unix://")) else {
            continue;
        };
        match std::fs::metadata(path) {
            Ok(m) if !m.file_type().is_socket() => anyhow::bail!(
                "{flag} unix://{path}: {path} is not a socket (give the Unix socket the CSI plugin listens on, or {otherwise})"
            ),
            _ => {}
        }
    }
    Ok(())
}

/// Runs `run`; exits with the workload's status.
pub async fn run(work_dir: &Path, args: RunArgs) -> anyhow::Result<ExitCode> {
    let resources = match &args.resources {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|e| {
                let what = match e.kind() {
                    std::io::ErrorKind::NotFound => "no such file".to_string(),
                    _ if path.is_dir() => "a directory, not a file".to_string(),
                    _ => e.to_string(),
                };
                anyhow::anyhow!(
                    "--resources {}: {what} (give a JSON file holding a list of Mesos Resource objects)",
                    path.display()
                )
            })?;
            parse_resources(&text).map_err(|e| {
                anyhow::anyhow!(
                    "--resources {}: not a JSON list of Mesos Resource objects ({})",
                    path.display(),
                    csi_isolator::error_chain::full_message(&e)
                )
            })?
        }
        None => Vec::new(),
    };
    if let Some(rootfs) = &args.rootfs {
        match std::fs::metadata(rootfs) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => anyhow::bail!(
                "--rootfs {}: a file, not a directory (give the directory of an unpacked root filesystem)",
                rootfs.display()
            ),
            Err(_) => anyhow::bail!(
                "--rootfs {}: no such directory (give the directory of an unpacked root filesystem, or leave --rootfs out to run on the host's root)",
                rootfs.display()
            ),
        }
    }
    check_plugin_endpoint(&args.plugin)?;
    let opts = RunOptions {
        work_dir: work_dir.to_path_buf(),
        provider: args.plugin.config(work_dir)?,
        volumes: args
            .volumes
            .iter()
            .map(MountSpec::from_volume_arg)
            .chain(args.mounts)
            .collect(),
        resources,
        rootfs: args.rootfs,
        container_id: args.container_id,
        argv: args.command,
        stop_grace: Duration::from_secs(args.stop_grace),
        user: args.user,
    };
    let code = runner::run(opts).await?;
    Ok(ExitCode::from(u8::try_from(code).unwrap_or(255)))
}
