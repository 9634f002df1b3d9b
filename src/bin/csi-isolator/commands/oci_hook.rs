//! `csi-isolator oci-hook create-runtime|poststop`: an OCI runtime hook (see
//! `csi_isolator::isolator::hook`). The runtime writes the container state to stdin;
//! the hook's options come from its `args` in the bundle's config.json.

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, ValueEnum};
use csi_isolator::isolator::hook::{self, HookOptions, HookPolicy, ProviderFactory, Stage, State};

use super::plugin_args::PluginArgs;
use super::text;

/// A `--max-capacity-per-tenant` SIZE: bytes with an optional K, M, G or T suffix.
fn parse_capacity(text: &str) -> Result<u64, String> {
    csi_isolator::resource::parse_size(text).ok_or_else(|| {
        format!("invalid SIZE '{text}' (bytes with an optional K, M, G or T suffix)")
    })
}

/// Which hook the runtime runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum StageArg {
    /// createRuntime (or prestart): publish the annotated volumes and mount them into the container.
    #[value(alias = "createRuntime", alias = "prestart")]
    CreateRuntime,
    /// poststop: release the container's volumes.
    Poststop,
    /// The stage the state's status names (creating: create-runtime, stopped: poststop), for one
    /// hooks.d entry registered for both stages (Podman, CRI-O).
    FromState,
}

/// `oci-hook` options.
#[derive(Debug, Args)]
#[command(after_help = "\
Examples (entries of an OCI bundle's config.json; runc passes the state on stdin):
  \"annotations\": {\"io.csi-isolator.volumes\": \"data:64M:/data,ref:1G:/ref:ro\"}
  \"hooks\": {
    \"createRuntime\": [{\"path\": \"/usr/bin/csi-isolator\",
      \"args\": [\"csi-isolator\", \"--work-dir\", \"/var/lib/csi-hooks\", \"oci-hook\",
               \"--tenant-annotation\", \"io.kubernetes.pod.namespace\", \"create-runtime\"]}],
    \"poststop\": [{\"path\": \"/usr/bin/csi-isolator\",
      \"args\": [\"csi-isolator\", \"--work-dir\", \"/var/lib/csi-hooks\", \"oci-hook\", \"poststop\"]}]}
A Podman hooks.d entry (one for both stages; the state's status says which):
  {\"version\": \"1.0.0\",
   \"hook\": {\"path\": \"/usr/bin/csi-isolator\",
     \"args\": [\"csi-isolator\", \"--work-dir\", \"/var/lib/csi-hooks\", \"oci-hook\", \"from-state\"]},
   \"when\": {\"annotations\": {\"^io\\\\.csi-isolator\\\\.volumes$\": \".*\"}},
   \"stages\": [\"createRuntime\", \"poststop\"]}")]
pub struct OciHookArgs {
    #[command(flatten)]
    plugin: PluginArgs,
    /// Seconds to wait for the work-dir lock held by another csi-isolator.
    #[arg(long, default_value = "30", value_name = "SECS")]
    lock_timeout: u64,
    /// Let io.csi-isolator.resources name any disk, host paths (and /) included, as given: only for a
    /// host where whoever sets annotations may read and write every host path. Without it, the
    /// annotation may only name volumes this hook's provider has.
    #[arg(long)]
    allow_raw_resources: bool,
    /// The annotation whose value is the container's tenant (e.g. io.kubernetes.pod.namespace, which
    /// CRI-O sets itself; choose one users cannot set): volume names are scoped to it, and a container
    /// without a valid one is refused. Without it the host is one tenant: every container that can
    /// set annotations can name every volume the hook made.
    #[arg(long, value_name = "KEY", value_parser = text())]
    tenant_annotation: Option<String>,
    /// The most volumes annotations may create per tenant (counted from the provider's volumes).
    #[arg(long, value_name = "N", default_value_t = hook::DEFAULT_MAX_VOLUMES_PER_TENANT)]
    max_volumes_per_tenant: u64,
    /// The most capacity the volumes of a tenant may take together (e.g. 10G; counted from the
    /// provider's volumes); a creation over it is refused.
    #[arg(long, value_name = "SIZE", default_value = "64G", value_parser = parse_capacity)]
    max_capacity_per_tenant: u64,
    /// Let the io.csi-isolator.parameters annotation set this CreateVolume parameter key
    /// (repeatable). None by default: parameters choose what a driver mounts as root (an NFS
    /// driver's server and share), so allow only keys whoever sets annotations may choose.
    #[arg(long = "allow-parameter", value_name = "KEY", value_parser = text())]
    allowed_parameters: Vec<String>,
    /// The hook: create-runtime, poststop, or from-state (the state's status says which).
    #[arg(value_enum)]
    stage: StageArg,
}

/// Runs the hook on the state read from stdin.
pub async fn run(work_dir: &Path, args: OciHookArgs) -> anyhow::Result<ExitCode> {
    let given = match args.stage {
        StageArg::CreateRuntime => Some(Stage::CreateRuntime),
        StageArg::Poststop => Some(Stage::Poststop),
        StageArg::FromState => None,
    };
    let name = |stage: Option<Stage>| match stage {
        Some(Stage::CreateRuntime) => "oci-hook create-runtime",
        Some(Stage::Poststop) => "oci-hook poststop",
        None => "oci-hook from-state",
    };
    csi_isolator::workdir::require_utf8(work_dir).with_context(|| name(given))?;
    let state = State::read_from(std::io::stdin().lock()).with_context(|| name(given))?;
    let stage = match given {
        Some(stage) => stage,
        None => Stage::from_state(&state).with_context(|| name(given))?,
    };
    let name = name(Some(stage));
    // A plugin or controller endpoint that is there but is no socket is refused at once, not
    // waited for until --plugin-timeout while runc holds the container's creation.
    super::run::check_plugin_endpoint(&args.plugin).with_context(|| name)?;
    let plugin = args.plugin;
    // The anyhow error becomes the boxed error as it is: its context and causes stay its chain.
    let provider: ProviderFactory =
        Arc::new(move |work_dir: &Path| plugin.config(work_dir).map_err(Into::into));
    let opts = HookOptions {
        work_dir: work_dir.to_path_buf(),
        provider,
        lock_timeout: Duration::from_secs(args.lock_timeout),
        policy: HookPolicy {
            allow_raw_resources: args.allow_raw_resources,
            tenant_annotation: args.tenant_annotation,
            max_volumes_per_tenant: args.max_volumes_per_tenant,
            max_capacity_per_tenant: args.max_capacity_per_tenant,
            allowed_parameters: args.allowed_parameters.into_iter().collect(),
        },
        sys: Arc::new(csi_isolator::mount::LinuxSyscall::new()),
    };
    hook::run(stage, &opts, &state)
        .await
        .with_context(|| name.to_string())?;
    Ok(ExitCode::SUCCESS)
}
