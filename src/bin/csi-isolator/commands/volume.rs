//! `csi-isolator volume ...`: the provider's volume operations, one process
//! per operation (the provider recovers on start, so an operation a crash
//! interrupted is finished by the next command).

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, Context};
use clap::{Args, Subcommand};
use csi_isolator::provider::mount_spec::{Key, OptionError};
use csi_isolator::provider::snapshot::SourceName;
use csi_isolator::provider::{
    parameters, Capability, ImportSpec, Listing, StorageProvider, VolumeOptions, MAX_LISTED,
};
use csi_isolator::resource::validate_container_id;

use super::plugin_args::PluginArgs;
use super::{shown, text};

/// `volume` options.
#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  csi-isolator --work-dir /var/lib/csi-demo volume create data 64M
  csi-isolator --work-dir /var/lib/csi-demo volume create db 10G --fs-type xfs --mount-flag noatime
  csi-isolator --work-dir /var/lib/csi-demo volume create raw 1G --type block   # published at a device file
  csi-isolator volume --plugin-endpoint unix:///run/csi/rbd.sock create pg 20G --secrets /etc/csi-isolator/ceph.json
  csi-isolator volume --plugin-endpoint unix:///run/csi/nfs.sock create share 10G \\
      --param server=nfs.example.com --param share=/export --access-mode MULTI_NODE_MULTI_WRITER
  csi-isolator volume --plugin-endpoint unix:///run/csi/nfs.sock list --plugin   # volumes it has that we do not know
  csi-isolator volume --plugin-endpoint unix:///run/csi/nfs.sock import old --volume-id 'nfs.example.com#export#old#' \\
      --context server=nfs.example.com --context share=/export
  csi-isolator --work-dir /var/lib/csi-demo volume publish data --container c1   # prints the mount point
  csi-isolator --work-dir /var/lib/csi-demo volume expand data 128M   # online when the plugin can
  csi-isolator --work-dir /var/lib/csi-demo volume modify data tier=fast iops=5000   # MODIFY_VOLUME
  csi-isolator --work-dir /var/lib/csi-demo volume list
  csi-isolator --work-dir /var/lib/csi-demo volume snapshot create data daily   # prints its id and size
  csi-isolator --work-dir /var/lib/csi-demo volume create restored 64M --from-snapshot daily
  csi-isolator --work-dir /var/lib/csi-demo volume create copy 64M --from-volume data
  csi-isolator --work-dir /var/lib/csi-demo volume snapshot delete daily
  csi-isolator --work-dir /var/lib/csi-demo volume release data --container c1
  csi-isolator --work-dir /var/lib/csi-demo volume destroy data
  csi-isolator volume --plugin-endpoint unix:///run/csi/plugin.sock list --json")]
pub struct VolumeArgs {
    #[command(flatten)]
    plugin: PluginArgs,
    #[command(subcommand)]
    action: Action,
}

#[derive(Debug, Subcommand)]
enum Action {
    /// Create a volume (the same name is the same volume) and print its resource JSON.
    Create {
        /// The volume name.
        #[arg(value_parser = text())]
        name: String,
        /// Capacity, e.g. 64M or 1G.
        #[arg(value_parser = text())]
        size: String,
        #[command(flatten)]
        options: VolumeFlags,
        /// A CreateVolume parameter for the plugin, KEY=VALUE (repeatable, as `docker volume
        /// create -o`). A second create of the same name must give the same set. Never a secret.
        #[arg(long = "param", value_name = "KEY=VALUE", value_parser = text())]
        params: Vec<String>,
        /// Make it from the snapshot of that name (CreateVolume's volume_content_source; the
        /// plugin needs CREATE_DELETE_SNAPSHOT): it holds the snapshot's data.
        #[arg(long, value_name = "SNAPSHOT", value_parser = text(), conflicts_with = "from_volume")]
        from_snapshot: Option<String>,
        /// Make it a clone of the volume of that name or id (the plugin needs CLONE_VOLUME): it
        /// holds that volume's data as it is now.
        #[arg(long, value_name = "VOLUME", value_parser = text())]
        from_volume: Option<String>,
    },
    /// Record a volume that exists in the plugin already under NAME (ValidateVolumeCapabilities
    /// first, when the plugin offers it) and print its resource JSON. `destroy` keeps it in the
    /// plugin unless given --delete.
    Import {
        /// The name it is known by from now on.
        #[arg(value_parser = text())]
        name: String,
        /// The plugin's volume id (`list --plugin` shows the ones it has).
        #[arg(long, value_parser = text())]
        volume_id: String,
        /// Its capacity, e.g. 10G (shown by `list`; not checked).
        #[arg(long, value_parser = text())]
        capacity: Option<String>,
        /// A volume context entry the plugin's node service needs, KEY=VALUE (repeatable):
        /// what CreateVolume would have returned (a Kubernetes PV's volumeAttributes).
        #[arg(long = "context", value_name = "KEY=VALUE", value_parser = text())]
        context: Vec<String>,
        #[command(flatten)]
        options: VolumeFlags,
    },
    /// Publish a volume (id or name) for a container and print its mount point.
    Publish {
        /// Volume id or name.
        #[arg(value_parser = text())]
        volume: String,
        /// The container that uses it.
        #[arg(long, value_parser = text())]
        container: String,
    },
    /// End a container's use of a volume (unpublished on last use).
    Release {
        /// Volume id or name.
        #[arg(value_parser = text())]
        volume: String,
        /// The container that used it (`docker-plugin/MOUNT_ID` for a use
        /// made by `docker-plugin`).
        #[arg(long, value_parser = text())]
        container: String,
    },
    /// Unpublish fully and delete a volume; refused while containers use it. An imported
    /// volume is only forgotten (it stays in the plugin) unless --delete is given.
    Destroy {
        /// Volume id or name.
        #[arg(value_parser = text())]
        volume: String,
        /// Delete an imported volume in the plugin too (DeleteVolume): its data is gone.
        #[arg(long)]
        delete: bool,
    },
    /// Grow a volume (id or name) to SIZE, online when the plugin can (ControllerExpandVolume,
    /// then NodeExpandVolume where it is published); prints its size. A volume cannot shrink.
    Expand {
        /// Volume id or name.
        #[arg(value_parser = text())]
        volume: String,
        /// The new size, e.g. 128M or 2G: larger than the volume's.
        #[arg(value_parser = text())]
        size: String,
    },
    /// Snapshots of volumes (the plugin needs CREATE_DELETE_SNAPSHOT).
    Snapshot {
        #[command(subcommand)]
        action: SnapshotAction,
    },
    /// Change a volume's mutable parameters (ControllerModifyVolume, when the plugin has
    /// MODIFY_VOLUME; the keys and values are the plugin's own); prints the volume's mutable
    /// parameters after, one KEY=VALUE a line. Keys not named keep their values.
    Modify {
        /// Volume id or name.
        #[arg(value_parser = text())]
        volume: String,
        /// KEY=VALUE, at least one (checked like CreateVolume parameters: no secrets).
        #[arg(value_parser = text(), required = true)]
        params: Vec<String>,
    },
    /// Take a volume from a node (ControllerUnpublishVolume for that node, through the
    /// controller plugin) so that another node can publish it: the fence for a dead node. Run it
    /// against that node's work dir (--work-dir) when its disk can be reached: its record is
    /// fenced, and the node tears its side down when it comes back. Refused while that record
    /// lists containers using the volume, or when there is no such record here, unless --force.
    /// Needs only the controller plugin (--controller-endpoint, or --plugin-endpoint of a plugin
    /// serving both).
    Detach {
        /// Volume id.
        #[arg(value_parser = text())]
        volume: String,
        /// The node id to take it from (the node plugin's NodeGetInfo id).
        #[arg(long, value_parser = text())]
        node: String,
        /// Take it even though the node's record lists containers using it, or without the
        /// node's record: whatever still uses it on that node loses it.
        #[arg(long)]
        force: bool,
    },
    /// List the provider's volumes.
    List {
        /// Print JSON records instead of a table.
        #[arg(long)]
        json: bool,
        /// List instead the plugin's volumes the provider does not know (ListVolumes), to
        /// `import` them.
        #[arg(long)]
        plugin: bool,
    },
}

#[derive(Debug, Subcommand)]
enum SnapshotAction {
    /// Take a snapshot of a volume (id or name), in use or not (the plugin makes it
    /// consistent), under a name (the same name is the same snapshot); prints its id and size.
    Create {
        /// Volume id or name.
        #[arg(value_parser = text())]
        volume: String,
        /// The snapshot's name.
        #[arg(value_parser = text())]
        snapshot: String,
    },
    /// List the snapshots taken.
    List {
        /// Print JSON records instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Delete a snapshot (DeleteSnapshot): volumes made from it keep their data.
    Delete {
        /// The snapshot's name.
        #[arg(value_parser = text())]
        snapshot: String,
    },
}

/// A volume's options, the volume keys of `run --mount` read by the same parser
/// ([`VolumeOptions::set`]): the same values are accepted and refused with the same words.
#[derive(Debug, Args)]
struct VolumeFlags {
    /// CSI access type: mount (a filesystem, published at a directory) or block (a raw block
    /// device, published at a device file).
    #[arg(long = "type", value_name = "mount|block", value_parser = text())]
    access_type: Option<String>,
    /// The filesystem the plugin makes and mounts (a mount volume), e.g. ext4 or xfs.
    #[arg(long, value_name = "T", value_parser = text())]
    fs_type: Option<String>,
    /// A flag of the plugin's mount of the volume, e.g. noatime (repeatable; `a:b` is two flags,
    /// as in --mount's mount-flags=).
    #[arg(long = "mount-flag", value_name = "F", value_parser = text())]
    mount_flags: Vec<String>,
    /// CSI access mode.
    #[arg(long, default_value = "SINGLE_NODE_WRITER", value_parser = text())]
    access_mode: String,
    /// The volume's CSI secrets file, by absolute path: root's alone, read at each call that
    /// carries secrets, never recorded (docs/secrets.md). A second create or import of the same
    /// name must name the same file.
    #[arg(long, value_name = "FILE", value_parser = text())]
    secrets: Option<String>,
}

impl VolumeFlags {
    /// The options, each read as `run --mount` reads its key, the flag named in a refusal.
    fn options(&self) -> Result<VolumeOptions, OptionError> {
        let mut options = VolumeOptions::default();
        if let Some(access_type) = &self.access_type {
            options.set(Key::Type, "--type", access_type)?;
        }
        if let Some(fs_type) = &self.fs_type {
            options.set(Key::FsType, "--fs-type", fs_type)?;
        }
        let mut flags = Vec::new();
        for flag in &self.mount_flags {
            options.set(Key::MountFlags, "--mount-flag", flag)?;
            flags.extend(options.mount_flags.take().unwrap_or_default());
        }
        options.mount_flags = (!flags.is_empty()).then_some(flags);
        options.set(Key::AccessMode, "--access-mode", &self.access_mode)?;
        if let Some(secrets) = &self.secrets {
            options.set(Key::Secrets, "--secrets", secrets)?;
        }
        options.check_access_type()?;
        Ok(options)
    }
}

/// Runs a `volume` command.
pub async fn run(work_dir: &Path, args: VolumeArgs) -> anyhow::Result<ExitCode> {
    // A container id is checked before anything starts, as `run` checks its own.
    // A release may also name a use `docker-plugin` made (its Mount ID, prefixed).
    match &args.action {
        Action::Release { container, .. }
            if csi_isolator::docker_plugin::users::mount_id_of(container).is_some() => {}
        Action::Publish { container, .. } | Action::Release { container, .. } => {
            validate_container_id(container)?;
        }
        _ => {}
    }
    // One process drives a work dir's volumes at a time (run, serve, hooks):
    // wait for them briefly rather than racing their checkpoints.
    let work_dir = csi_isolator::workdir::canonical(work_dir)?;
    let _lock = csi_isolator::workdir::lock(&work_dir, Some(Duration::from_secs(30))).await?;
    super::run::check_plugin_endpoint(&args.plugin)?;
    if let Action::Detach {
        volume,
        node,
        force,
    } = &args.action
    {
        return detach(&work_dir, &args.plugin, volume, node, *force).await;
    }
    let config = args.plugin.config(&work_dir)?;
    let provider = StorageProvider::start(config)
        .await
        .context("start the resource provider")?;
    let result = act(&provider, args.action).await;
    provider.shutdown(Duration::from_secs(5)).await;
    result.map(|()| ExitCode::SUCCESS)
}

async fn act(provider: &Arc<StorageProvider>, action: Action) -> anyhow::Result<()> {
    match action {
        Action::Create {
            name,
            size,
            options,
            params,
            from_snapshot,
            from_volume,
        } => {
            // A size of 0 would leave the plugin to pick one: say so instead.
            let bytes = csi_isolator::resource::parse_size(&size)
                .filter(|b| *b > 0)
                .ok_or_else(|| {
                    anyhow!(
                        "volume create: invalid SIZE '{}': give a size above 0 with a unit (examples: 64M, 1G)",
                        shown(&size)
                    )
                })?;
            let parameters = parameters::parse(params.iter().map(String::as_str))
                .with_context(|| format!("volume create {}: --param", shown(&name)))?;
            let mut options = options
                .options()
                .with_context(|| format!("volume create {}", shown(&name)))?;
            options.size_bytes = Some(bytes);
            let mut spec = options.create_spec(&name);
            spec.parameters = parameters;
            let from = match (from_snapshot, from_volume) {
                (Some(snapshot), _) => Some(SourceName::Snapshot(snapshot)),
                (None, Some(volume)) => Some(SourceName::Volume(volume)),
                (None, None) => None,
            };
            let resource = provider.create_volume_from(spec, from).await?;
            outln!("{}", serde_json::to_string_pretty(&resource)?);
        }
        Action::Import {
            name,
            volume_id,
            capacity,
            context,
            options,
        } => {
            let capacity_bytes = match capacity {
                None => 0,
                Some(text) => csi_isolator::resource::parse_size(&text).ok_or_else(|| {
                    anyhow!(
                        "volume import: invalid --capacity '{}': give a size with a unit (examples: 64M, 1G)",
                        shown(&text)
                    )
                })?,
            };
            let volume_context = parameters::parse(context.iter().map(String::as_str))
                .with_context(|| format!("volume import {}: --context", shown(&name)))?;
            let options = options
                .options()
                .with_context(|| format!("volume import {}", shown(&name)))?;
            let mut capability = Capability::default();
            options.apply(&mut capability);
            let spec = ImportSpec {
                name,
                volume_id,
                capacity_bytes,
                capability,
                volume_context,
            };
            let resource = provider
                .import_volume_with_secrets(spec, options.secrets)
                .await?;
            outln!("{}", serde_json::to_string_pretty(&resource)?);
        }
        Action::Publish { volume, container } => {
            let id = resolve(provider, &volume).await?;
            let mount_point = provider.publish(&id, &container).await?;
            outln!("{}", mount_point.display());
        }
        Action::Release { volume, container } => {
            let id = resolve(provider, &volume).await?;
            provider.release(&id, &container).await?;
        }
        Action::Modify { volume, params } => {
            let asked =
                csi_isolator::provider::parameters::parse(params.iter().map(String::as_str))
                    .map_err(|e| anyhow!("volume modify: {e}"))?;
            let id = resolve(provider, &volume).await?;
            let now = provider.modify_volume(&id, &asked).await?;
            for (key, value) in &now {
                outln!("{}={}", shown(key), shown(value));
            }
        }
        Action::Expand { volume, size } => {
            let bytes = csi_isolator::resource::parse_size(&size)
                .filter(|b| *b > 0)
                .ok_or_else(|| {
                    anyhow!(
                        "volume expand: invalid SIZE '{}': give the new size with a unit (examples: 128M, 2G)",
                        shown(&size)
                    )
                })?;
            let id = resolve(provider, &volume).await?;
            let done = provider.expand_volume(&id, bytes).await?;
            if done.node_pending {
                outln!(
                    "{} bytes (the node grows it at its next publish on this node)",
                    done.capacity_bytes
                );
            } else {
                outln!("{} bytes", done.capacity_bytes);
            }
        }
        Action::Destroy { volume, delete } => {
            let id = resolve(provider, &volume).await?;
            provider.destroy_volume_with(&id, delete).await?;
            let kept: Vec<_> = provider
                .snapshots()
                .await
                .into_iter()
                .filter(|s| s.source_volume_id == id)
                .map(|s| shown(&s.name).into_owned())
                .collect();
            if !kept.is_empty() {
                eprintln!(
                    "csi-isolator: volume destroy {}: its snapshots {} stay (a snapshot outlives its volume); `volume snapshot delete NAME` deletes one",
                    shown(&volume),
                    kept.join(", ")
                );
            }
        }
        Action::Snapshot { action } => snapshot(provider, action).await?,
        // Answered by `detach` before a provider starts (it needs no node plugin).
        Action::Detach { .. } => anyhow::bail!("volume detach: not run through a started provider"),
        Action::List { json, plugin: true } => {
            let (volumes, listing) = provider.plugin_volumes().await?;
            match listing {
                Listing::Complete => {}
                Listing::Capped => eprintln!(
                    "csi-isolator: volume list --plugin: stopped after {MAX_LISTED} of the plugin's volumes (it has more): \
                     the volumes below are the unknown ones among those; import by id with `volume import NAME --volume-id ID`"
                ),
                Listing::TokenRepeated => eprintln!(
                    "csi-isolator: volume list --plugin: the plugin answered ListVolumes with the next_token it was given, \
                     so the list stops there and may be incomplete (a plugin bug)"
                ),
            }
            if json {
                outln!("{}", serde_json::to_string_pretty(&volumes)?);
            } else {
                outln!("{:<40} {:>14} CONTEXT", "PLUGIN VOLUME", "CAPACITY");
                for v in volumes {
                    let context: Vec<_> = v
                        .volume_context
                        .iter()
                        .map(|(k, v)| format!("{}={}", shown(k), shown(v)))
                        .collect();
                    outln!(
                        "{:<40} {:>14} {}",
                        shown(&v.volume_id),
                        v.capacity_bytes,
                        context.join(",")
                    );
                }
            }
        }
        Action::List {
            json,
            plugin: false,
        } => {
            let volumes = provider.volumes().await;
            if json {
                outln!("{}", serde_json::to_string_pretty(&volumes)?);
            } else {
                outln!("{:<24} {:<16} {:<20} USERS", "VOLUME", "NAME", "STATE");
                for v in volumes {
                    let users: Vec<_> = v.users.iter().map(|u| shown(u)).collect();
                    outln!(
                        "{:<24} {:<16} {:<20} {}",
                        shown(&v.volume_id),
                        shown(v.name.as_deref().unwrap_or("-")),
                        v.state,
                        users.join(",")
                    );
                }
            }
        }
    }
    Ok(())
}

async fn snapshot(provider: &StorageProvider, action: SnapshotAction) -> anyhow::Result<()> {
    match action {
        SnapshotAction::Create { volume, snapshot } => {
            let id = resolve(provider, &volume).await?;
            let taken = provider.create_snapshot(&id, &snapshot).await?;
            outln!("{} {} bytes", shown(&taken.snapshot_id), taken.size_bytes);
        }
        SnapshotAction::List { json } => {
            let snapshots = provider.snapshots().await;
            if json {
                outln!("{}", serde_json::to_string_pretty(&snapshots)?);
            } else {
                outln!(
                    "{:<20} {:<20} {:>14} {:<6} SNAPSHOT ID",
                    "SNAPSHOT",
                    "VOLUME",
                    "SIZE",
                    "READY"
                );
                for s in snapshots {
                    let ready = match s.pending {
                        Some(step) => format!("{step:?}…").to_lowercase(),
                        None => (if s.ready_to_use { "yes" } else { "no" }).to_string(),
                    };
                    outln!(
                        "{:<20} {:<20} {:>14} {:<6} {}",
                        shown(&s.name),
                        shown(s.source_name.as_deref().unwrap_or(&s.source_volume_id)),
                        s.size_bytes,
                        ready,
                        shown(&s.snapshot_id)
                    );
                }
            }
        }
        SnapshotAction::Delete { snapshot } => provider.delete_snapshot(&snapshot).await?,
    }
    Ok(())
}

/// `volume detach`: needs only the controller plugin (the node's own may be dead with it), and
/// the node's records in `work_dir` (locked).
async fn detach(
    work_dir: &Path,
    plugin: &super::plugin_args::PluginArgs,
    volume: &str,
    node: &str,
    force: bool,
) -> anyhow::Result<ExitCode> {
    let endpoint = plugin
        .controller_endpoint
        .as_ref()
        .or(plugin.plugin_endpoint.as_ref())
        .ok_or_else(|| {
            anyhow!(
                "volume detach {}: give the driver's controller plugin with --controller-endpoint (or --plugin-endpoint, for a plugin serving both services)",
                shown(volume)
            )
        })?;
    let options = csi_isolator::csi::ClientOptions {
        connect_timeout: Duration::from_secs(plugin.plugin_timeout),
        ..Default::default()
    };
    let controller = csi_isolator::csi::Client::connect_for(
        endpoint,
        options,
        csi_isolator::csi::Services::Controller,
        csi_isolator::csi::Metrics::new(),
    )
    .await
    .with_context(|| {
        format!(
            "volume detach {}: connect to the controller plugin at {endpoint}",
            shown(volume)
        )
    })?;
    let info = controller
        .get_plugin_info(csi_isolator::csi::proto::GetPluginInfoRequest {})
        .await
        .with_context(|| {
            format!(
                "volume detach {}: GetPluginInfo of the controller plugin at {endpoint}",
                shown(volume)
            )
        })?;
    let layout = csi_isolator::resource::Layout::new(work_dir, &info.name, &plugin.plugin_name);
    let done = csi_isolator::provider::handoff::detach(&controller, &layout, volume, node, force)
        .await
        .with_context(|| format!("volume detach {} --node {}", shown(volume), shown(node)))?;
    let lost: Vec<_> = done.lost_users.iter().map(|u| shown(u)).collect();
    outln!(
        "volume {} detached from node {}{}",
        shown(volume),
        shown(node),
        match (done.fenced, lost.is_empty()) {
            (false, _) => " (no record of it here: the node finds out from the controller when it comes back)".to_string(),
            (true, true) => " (its record is fenced: the node tears its side down when it comes back)".to_string(),
            (true, false) => format!(
                " (its record is fenced: the node tears its side down when it comes back; lost uses: {})",
                lost.join(", ")
            ),
        }
    );
    Ok(ExitCode::SUCCESS)
}

/// A volume named by id or by CreateVolume name.
async fn resolve(provider: &StorageProvider, volume: &str) -> anyhow::Result<String> {
    if provider.volume(volume).await.is_some() {
        return Ok(volume.to_string());
    }
    provider
        .find_by_name(volume)
        .await
        .map(|r| r.volume_id)
        .ok_or_else(|| {
            anyhow!(
                "no volume with id or name '{}' in provider {}",
                shown(volume),
                shown(provider.id())
            )
        })
}
