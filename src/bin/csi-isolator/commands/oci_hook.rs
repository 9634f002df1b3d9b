//! `csi-isolator oci-hook create-runtime|poststop`: an OCI runtime hook (see
//! `csi_isolator::isolator::hook`). The runtime writes the container state to stdin;
//! the hook's options come from its `args` in the bundle's config.json.

use std::io::Read;
use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, ValueEnum};
use csi_isolator::isolator::hook::{self, HookOptions, Stage, State};

use super::plugin_args::PluginArgs;

/// Which hook the runtime runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum StageArg {
    /// createRuntime (or prestart): publish the annotated volumes and mount them into the container.
    #[value(alias = "createRuntime", alias = "prestart")]
    CreateRuntime,
    /// poststop: release the container's volumes.
    Poststop,
}

/// `oci-hook` options.
#[derive(Debug, Args)]
#[command(after_help = "\
Examples (entries of an OCI bundle's config.json; runc passes the state on stdin):
  \"annotations\": {\"io.csi-isolator.volumes\": \"data:64M:/data,ref:1G:/ref:ro\"}
  \"hooks\": {
    \"createRuntime\": [{\"path\": \"/usr/bin/csi-isolator\",
      \"args\": [\"csi-isolator\", \"--work-dir\", \"/var/lib/csi-hooks\", \"oci-hook\", \"create-runtime\"]}],
    \"poststop\": [{\"path\": \"/usr/bin/csi-isolator\",
      \"args\": [\"csi-isolator\", \"--work-dir\", \"/var/lib/csi-hooks\", \"oci-hook\", \"poststop\"]}]}")]
pub struct OciHookArgs {
    #[command(flatten)]
    plugin: PluginArgs,
    /// Seconds to wait for the work-dir lock held by another csi-isolator.
    #[arg(long, default_value = "30", value_name = "SECS")]
    lock_timeout: u64,
    /// The hook: create-runtime or poststop.
    #[arg(value_enum)]
    stage: StageArg,
}

/// Runs the hook on the state read from stdin.
pub async fn run(work_dir: &Path, args: OciHookArgs) -> anyhow::Result<ExitCode> {
    let (stage, name) = match args.stage {
        StageArg::CreateRuntime => (Stage::CreateRuntime, "oci-hook create-runtime"),
        StageArg::Poststop => (Stage::Poststop, "oci-hook poststop"),
    };
    csi_isolator::workdir::require_utf8(work_dir).with_context(|| name.to_string())?;
    let mut input = Vec::new();
    std::io::stdin()
        .read_to_end(&mut input)
        .with_context(|| format!("{name}: read the container state from stdin"))?;
    let state = State::parse(&input).with_context(|| name.to_string())?;
    let opts = HookOptions {
        work_dir: work_dir.to_path_buf(),
        provider: args
            .plugin
            .config(work_dir)
            .with_context(|| name.to_string())?,
        lock_timeout: Duration::from_secs(args.lock_timeout),
    };
    hook::run(stage, &opts, &state)
        .await
        .with_context(|| name.to_string())?;
    Ok(ExitCode::SUCCESS)
}
