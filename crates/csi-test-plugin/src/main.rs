//! `csi-test-plugin`: the bundled CSI v1 plugin (see `csi_test_plugin`).
//!
//! Thin: parses the command line into a `PluginConfig`, logs to stderr, and serves until
//! SIGTERM or SIGINT, which shut down gracefully and remove the socket.

use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use csi_isolator::csi::transport::socket_path;
use csi_isolator::resource::parse_size;
use csi_test_plugin::{faults, BackingKind, PluginConfig};

const EXAMPLES: &str = "\
Examples:
  # Directory volumes on a socket
  csi-test-plugin --endpoint unix:///tmp/csi/csi.sock --work-dir /tmp/csi/data
  # ext4-on-loop volumes, node staging switched off
  csi-test-plugin --endpoint unix:///tmp/csi/csi.sock --work-dir /tmp/csi/data --backing loop --no-stage
  # Faults: NodePublishVolume fails twice with UNAVAILABLE, Probe answers after 200 ms
  csi-test-plugin --endpoint unix:///tmp/csi/csi.sock --work-dir /tmp/csi/data \\
      --fail NodePublishVolume=UNAVAILABLE:2 --delay Probe=200
  # A lying plugin: publishes, but answers ControllerPublishVolume with no publish_context
  csi-test-plugin --endpoint unix:///tmp/csi/csi.sock --work-dir /tmp/csi/data \\
      --lie ControllerPublishVolume:empty-context
  # Refuse a CreateVolume without parameters server and share=/export (echoed as parameter.KEY)
  csi-test-plugin --endpoint unix:///tmp/csi/csi.sock --work-dir /tmp/csi/data \\
      --require-parameters server,share=/export
  # Refuse calls whose secrets differ from those of FILE (root's alone, mode 0600)
  csi-test-plugin --endpoint unix:///tmp/csi/csi.sock --work-dir /tmp/csi/data \\
      --require-secrets /etc/csi-test/secrets.json
  # Volumes made writable for the workload's group (VOLUME_MOUNT_GROUP)
  csi-test-plugin --endpoint unix:///tmp/csi/csi.sock --work-dir /tmp/csi/data --volume-mount-group
  # No snapshots, clones, expansion or modification (a CO's refusals before any RPC)
  csi-test-plugin --endpoint unix:///tmp/csi/csi.sock --work-dir /tmp/csi/data \\
      --no-snapshots --no-clones --expansion none --no-modify
  # Two nodes, one controller: volumes under /shared/csi (reached by every node at that path),
  # each node plugin with its own id and its own state; publish_context tells a node where a
  # volume is, and a single-node volume is ControllerPublished to one node at a time
  csi-test-plugin --mode controller --endpoint unix:///run/csi/controller.sock --work-dir /shared/csi
  csi-test-plugin --mode node --node-id x --endpoint unix:///run/csi/x.sock \\
      --work-dir /var/lib/csi-x --shared-dir /shared/csi
  csi-test-plugin --mode node --node-id y --endpoint unix:///run/csi/y.sock \\
      --work-dir /var/lib/csi-y --shared-dir /shared/csi
  # Started by a CO that sets CSI_ENDPOINT
  CSI_ENDPOINT=unix:///run/csi.sock csi-test-plugin --work-dir /var/lib/csi-test";

#[derive(Debug, Parser)]
#[command(
    name = "csi-test-plugin",
    version,
    about = "A CSI v1 plugin for mount volumes, for tests and `csi-isolator run`",
    after_help = EXAMPLES
)]
struct Args {
    /// The socket to serve on, as unix:///PATH (default: $CSI_ENDPOINT, as a CO sets it).
    #[arg(long, env = "CSI_ENDPOINT")]
    endpoint: String,
    /// Where volumes and their metadata live.
    #[arg(long)]
    work_dir: PathBuf,
    /// Volume backing: loop (an ext4 image on a loop device: the volume holds exactly its
    /// capacity) or dir (a plain directory: its capacity is not enforced).
    #[arg(long, default_value = "loop")]
    backing: BackingKind,
    /// Which services to serve: both (one node with its own controller), controller (Identity
    /// and Controller: volumes under --work-dir, which every node must reach, published to any
    /// node id) or node (Identity and Node: volumes found under --shared-dir through the
    /// publish_context; node-local state under --work-dir). See the multi-node layout below.
    #[arg(long, default_value = "both", value_name = "controller|node|both")]
    mode: csi_test_plugin::PluginMode,
    /// --mode node: the controller's --work-dir as this node reaches it. The node plugin
    /// mounts volumes only from there and never writes there; its --work-dir must lie outside.
    #[arg(long, value_name = "DIR", required_if_eq("mode", "node"))]
    shared_dir: Option<PathBuf>,
    /// Node id: what NodeGetInfo answers (default: the host name). A --mode controller plugin
    /// publishes to any node id and has none of its own.
    #[arg(long)]
    node_id: Option<String>,
    /// GetPluginInfo name.
    #[arg(long, default_value = csi_test_plugin::DEFAULT_NAME)]
    name: String,
    /// GetPluginInfo vendor_version.
    #[arg(long, default_value = csi_test_plugin::DEFAULT_VENDOR_VERSION)]
    vendor_version: String,
    /// Prefix of the volume ids CreateVolume makes (16 random hex digits follow). Any string
    /// CSI allows, path syntax included (`../x/`), to test that a CO encodes ids.
    #[arg(long, default_value = csi_test_plugin::DEFAULT_ID_PREFIX)]
    id_prefix: String,
    /// Total capacity in bytes (suffixes K, M, G, T). Large by default: nothing is reserved
    /// up front (loop images are sparse), and conformance suites create several volumes of
    /// 10 GiB each.
    #[arg(long, default_value_t = csi_test_plugin::DEFAULT_CAPACITY, value_parser = parse_capacity)]
    capacity: u64,
    /// Drop the controller PUBLISH_UNPUBLISH_VOLUME capability.
    #[arg(long)]
    no_controller_publish: bool,
    /// Drop the node STAGE_UNSTAGE_VOLUME capability.
    #[arg(long)]
    no_stage: bool,
    /// Drop the CONTROLLER_SERVICE plugin capability (node-only plugin).
    #[arg(long)]
    no_controller: bool,
    /// Drop the CREATE_DELETE_SNAPSHOT, LIST_SNAPSHOTS and GET_SNAPSHOT capabilities (and
    /// refuse volumes made from snapshots).
    #[arg(long)]
    no_snapshots: bool,
    /// Drop the CLONE_VOLUME capability (refuse volumes made from volumes).
    #[arg(long)]
    no_clones: bool,
    /// Drop the MODIFY_VOLUME capability (ControllerModifyVolume answers UNIMPLEMENTED and
    /// CreateVolume refuses mutable parameters).
    #[arg(long)]
    no_modify: bool,
    /// Volume expansion offered: online (VolumeExpansion.ONLINE, controller and node
    /// EXPAND_VOLUME), offline (VolumeExpansion.OFFLINE: ControllerExpandVolume refuses a
    /// volume in use) or none (no EXPAND_VOLUME; the expand RPCs are UNIMPLEMENTED). A
    /// node-only plugin (--no-controller) offers none.
    #[arg(long, default_value = "online", value_name = "online|offline|none")]
    expansion: csi_test_plugin::Expansion,
    /// Drop the node GET_VOLUME_STATS and VOLUME_CONDITION capabilities (NodeGetVolumeStats
    /// then answers UNIMPLEMENTED).
    #[arg(long)]
    no_volume_stats: bool,
    /// Fail RPC with a gRPC code COUNT times (default: always): `RPC=CODE[:COUNT]`.
    #[arg(long, value_name = "RPC=CODE[:COUNT]")]
    fail: Vec<String>,
    /// Sleep before handling RPC: RPC=MILLIS.
    #[arg(long, value_name = "RPC=MILLIS")]
    delay: Vec<String>,
    /// Sleep inside RPC's work, right before its side effect, holding the volume's lock:
    /// RPC=MILLIS.
    #[arg(long, value_name = "RPC=MILLIS")]
    stall: Vec<String>,
    /// Lie in RPC's answer: `RPC[:MODE]`. Modes: no-work (the default: success without the
    /// work; any RPC); the rest do the work, then lie: empty-context (ControllerPublishVolume:
    /// empty publish_context), empty-id (CreateVolume: empty volume_id), small-capacity
    /// (CreateVolume: capacity_bytes one short of required_bytes), reused-id (CreateVolume: the
    /// volume_id of another volume the plugin has), garbage (any RPC: reply bytes
    /// that are not protobuf), bad-utf8 (CreateVolume, ControllerPublishVolume, GetPluginInfo,
    /// NodeGetInfo: a string field that is not UTF-8).
    #[arg(long, value_name = "RPC[:MODE]")]
    lie: Vec<String>,
    /// Exit (code 137, no reply) during the first call of RPC: RPC[:before|after].
    #[arg(long, value_name = "RPC[:before|after]")]
    exit_in: Vec<String>,
    /// Fault specs, one per line, re-read when the file's mtime changes.
    #[arg(long)]
    faults_file: Option<PathBuf>,
    /// Append `<RPC> <volume_id or ->` per RPC received to this file.
    #[arg(long)]
    log_calls: Option<PathBuf>,
    /// Report in GetPluginInfo's manifest (`durable_syncs`) how many fsync, fdatasync and
    /// syncfs calls this process has made through the durable seam (for the benchmark).
    #[arg(long)]
    report_syncs: bool,
    /// Refuse a CreateVolume without these parameters (INVALID_ARGUMENT naming the key):
    /// `KEY[=VALUE],...`, a value when given must match. Every plugin echoes the parameters
    /// it got in the volume context as `parameter.<KEY>`.
    #[arg(long, value_name = "KEY[=VALUE],...")]
    require_parameters: Option<String>,
    /// Refuse every RPC that carries secrets unless it carries exactly those FILE gives its
    /// operation (csi-isolator's secrets file format: create feeds CreateVolume and
    /// DeleteVolume, controller_publish ControllerPublishVolume and ControllerUnpublishVolume,
    /// node_stage NodeStageVolume, node_publish NodePublishVolume; ValidateVolumeCapabilities
    /// must carry none): wrong values are UNAUTHENTICATED, missing or unexpected keys
    /// INVALID_ARGUMENT, naming the key, never a value. FILE must be root's alone (mode 0600);
    /// it is read again at each such RPC.
    #[arg(long, value_name = "FILE")]
    require_secrets: Option<PathBuf>,
    /// A topology segment of this node (repeatable): the plugin then offers
    /// VOLUME_ACCESSIBILITY_CONSTRAINTS, NodeGetInfo reports the segments, and CreateVolume
    /// refuses requisite topologies that do not cover them (RESOURCE_EXHAUSTED).
    #[arg(long, value_name = "KEY=VALUE")]
    topology: Vec<String>,
    /// Offer VOLUME_MOUNT_GROUP: NodeStageVolume and NodePublishVolume with a
    /// `volume_mount_group` (a decimal gid) give the volume's root that group, group read,
    /// write and search and set-group-id. Without it a request carrying one is refused.
    #[arg(long)]
    volume_mount_group: bool,
}

fn parse_capacity(text: &str) -> Result<u64, String> {
    parse_size(text).ok_or_else(|| format!("invalid size '{text}'"))
}

fn config(args: Args) -> anyhow::Result<PluginConfig> {
    let socket = socket_path(&args.endpoint)?;
    let mut config = PluginConfig::new(socket, args.work_dir);
    config.backing = args.backing;
    if let Some(node_id) = args.node_id {
        config.node_id = node_id;
    }
    config.name = args.name;
    config.vendor_version = args.vendor_version;
    config.id_prefix = args.id_prefix;
    config.capacity = args.capacity;
    config.controller = !args.no_controller;
    config.controller_publish = !args.no_controller_publish;
    config.stage = !args.no_stage;
    config.volume_mount_group = args.volume_mount_group;
    config.snapshots = !args.no_snapshots;
    config.clones = !args.no_clones;
    config.modify = !args.no_modify;
    config.expansion = args.expansion;
    config.volume_stats = !args.no_volume_stats;
    config.mode = args.mode;
    config.shared_dir = args.shared_dir;
    for segment in &args.topology {
        let (key, value) = segment
            .split_once('=')
            .filter(|(k, v)| !k.is_empty() && !v.is_empty())
            .ok_or_else(|| {
                anyhow::anyhow!(
                    "invalid --topology '{}': give KEY=VALUE",
                    segment.escape_debug()
                )
            })?;
        config.topology.insert(key.to_string(), value.to_string());
    }
    for spec in &args.fail {
        config.faults.push(faults::parse_fail(spec)?);
    }
    for spec in &args.delay {
        config.faults.push(faults::parse_delay(spec)?);
    }
    for spec in &args.lie {
        config.faults.push(faults::parse_lie(spec)?);
    }
    for spec in &args.stall {
        config.faults.push(faults::parse_stall(spec)?);
    }
    for spec in &args.exit_in {
        config.faults.push(faults::parse_exit_in(spec)?);
    }
    config.faults_file = args.faults_file;
    config.log_calls = args.log_calls;
    config.report_syncs = args.report_syncs;
    if let Some(text) = &args.require_parameters {
        config.required_parameters =
            csi_test_plugin::parse_required_parameters(text).map_err(anyhow::Error::msg)?;
    }
    if let Some(path) = args.require_secrets {
        // Checked now, so a bad file fails the start rather than every call.
        csi_test_plugin::load_required_secrets(&path).map_err(anyhow::Error::msg)?;
        config.required_secrets = Some(path);
    }
    Ok(config)
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::error!("cannot install signal handlers; serving until killed");
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
        _ = int.recv() => tracing::info!("SIGINT: shutting down"),
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let config = config(Args::parse())?;
    csi_test_plugin::serve(config, shutdown_signal())
        .await
        .context("csi-test-plugin")
}
