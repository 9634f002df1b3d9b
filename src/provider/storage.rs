//! The storage local resource provider: one CSI plugin instance (`type`,
//! `name`) and the volumes made through it. The driver may run as one plugin, or as a
//! controller plugin apart from this node's plugin ([`ProviderConfig::controller_endpoint`]):
//! then every Controller RPC goes to [`StorageProvider::controller`], every Node RPC to
//! [`StorageProvider::client`], and both must be the same driver.
//!
//! Invariants:
//! - Every operation is checkpointed: its intent (first step and goal) is
//!   durable before its first RPC is sent; the steady state is written once,
//!   when the operation reaches its goal (recovery re-issues or undoes the
//!   steps the intent covers).
//! - Operations on one volume run one at a time, in arrival order (a fair
//!   async mutex per volume, held for the whole operation); different
//!   volumes run in parallel. No provider-wide lock is held across an RPC.
//! - A volume with users (containers) is never unpublished.
//!
//! The lifecycle steps live in their own files: `create.rs` (create,
//! declare, destroy), `publish.rs` (publish, release, ensure-all) and
//! `recover.rs` (load and recovery on start).

use crate::error_chain::Chain;
use crate::io_step::IoStep;
use crate::offload::{blocking, start_blocking, Started};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::csi::proto;
use crate::csi::{Capabilities, Client, ClientOptions, Secrets, Services};
use crate::durable::journal::Commit;
use crate::mount::{LinuxSyscall, MountTable, ProcMountTable, Syscall};
use crate::provider::checkpoint;
use crate::provider::error::ProviderError;
use crate::provider::next_step::{next_step, node_dirs, resume_point, Next, NodeDirs, StepCaps};
use crate::provider::state::{AccessType, Step, VolumeRecord, VolumeState};
use crate::provider::supervisor::{PluginCommand, Supervisor};
use crate::provider::topology;
use crate::resource::Layout;
use crate::resource::{validate_path_component, Resource, SourceType};

/// When a volume that nobody uses any more is unpublished.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum UnpublishPolicy {
    /// Unpublish when the last container using it is cleaned up.
    #[default]
    LastUse,
    /// Stay published until the volume is destroyed (Mesos SLRP).
    Keep,
}

impl std::str::FromStr for UnpublishPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "last-use" => Ok(UnpublishPolicy::LastUse),
            "keep" => Ok(UnpublishPolicy::Keep),
            _ => Err(format!(
                "unknown unpublish policy '{s}' (expected last-use or keep)"
            )),
        }
    }
}

/// Where the provider's plugin comes from.
#[derive(Clone, Debug)]
pub enum PluginSource {
    /// A plugin already serving this endpoint (`unix:///path`).
    Endpoint(String),
    /// A plugin the provider starts and supervises itself.
    Managed(PluginCommand),
}

/// Configuration of one storage local resource provider.
#[derive(Clone, Debug)]
pub struct ProviderConfig {
    /// The provider id (`Resource.provider_id.value`) its resources carry.
    pub provider_id: String,
    /// The plugin type (e.g. its GetPluginInfo name); a path component.
    /// Empty with [`PluginSource::Endpoint`]: asked from GetPluginInfo.
    pub plugin_type: String,
    /// The plugin instance name; a path component.
    pub plugin_name: String,
    /// The agent work dir.
    pub work_dir: PathBuf,
    /// Where the plugin comes from.
    pub plugin: PluginSource,
    /// The driver's controller plugin, when it runs apart from the node plugin
    /// (`--controller-endpoint unix:///PATH`): every Controller RPC goes there, every Node RPC
    /// to [`plugin`](Self::plugin), which must then be an [`PluginSource::Endpoint`] too. Both
    /// must answer GetPluginInfo with the same name. `None` (the default): one plugin for both.
    pub controller_endpoint: Option<String>,
    /// The unpublish policy.
    pub policy: UnpublishPolicy,
    /// Under [`UnpublishPolicy::LastUse`], how long a volume whose last user left stays
    /// published before [`StorageProvider::settle_idle`] unpublishes it: a user coming back
    /// meanwhile (the next container of a restart loop, a `docker run` after another) finds it
    /// published and costs no CSI call. Zero (the default) unpublishes at the last release.
    /// The user's removal is durable at once; a process that stops during the delay leaves
    /// the volume to the next start's recovery, which unpublishes it.
    pub unpublish_delay: Duration,
    /// CSI client settings.
    pub client: ClientOptions,
    /// How long a managed plugin may take to answer Probe as ready.
    pub ready_timeout: Duration,
    /// The boot id to compare checkpoints against (default: the kernel's,
    /// `/proc/sys/kernel/random/boot_id`); tests simulate a reboot with it.
    pub boot_id: Option<String>,
    /// Where a managed plugin's socket goes when the one under the work dir
    /// would be too long for a socket address.
    pub socket_dir: PathBuf,
    /// The operator's disk profiles (`--disk-profiles`): what a disk
    /// resource's `disk.source.profile` means for CreateVolume.
    pub disk_profiles: Option<std::sync::Arc<crate::provider::profiles::Profiles>>,
}

impl ProviderConfig {
    /// A configuration with the defaults: last-use policy, default client
    /// options, 30 s readiness timeout, provider id `<type>.<name>`.
    pub fn new(
        plugin_type: impl Into<String>,
        plugin_name: impl Into<String>,
        work_dir: impl Into<PathBuf>,
        plugin: PluginSource,
    ) -> Self {
        let plugin_type = plugin_type.into();
        let plugin_name = plugin_name.into();
        ProviderConfig {
            provider_id: format!("{plugin_type}.{plugin_name}"),
            plugin_type,
            plugin_name,
            work_dir: work_dir.into(),
            plugin,
            controller_endpoint: None,
            policy: UnpublishPolicy::LastUse,
            unpublish_delay: Duration::ZERO,
            client: ClientOptions::default(),
            ready_timeout: Duration::from_secs(30),
            boot_id: None,
            socket_dir: PathBuf::from(crate::resource::SHORT_SOCKET_DIR),
            disk_profiles: None,
        }
    }
}

/// What recovery found and did, for `status` and the logs.
#[derive(Clone, Debug, Default)]
pub struct RecoveryReport {
    /// Volumes loaded from their checkpoints.
    pub loaded: usize,
    /// State files that could not be read, set aside (path, aside, reason).
    pub corrupt: Vec<(PathBuf, PathBuf, String)>,
    /// One line per action taken.
    pub actions: Vec<String>,
    /// Volumes recovery could not bring to their goal (id, error).
    pub failures: Vec<(String, String)>,
}

/// A volume's slot: its record, behind a fair (FIFO) async mutex that
/// serializes operations on it.
#[derive(Debug)]
pub(crate) struct Slot {
    pub(crate) record: tokio::sync::Mutex<VolumeRecord>,
    /// The CreateVolume name (never changes), readable without the lock.
    pub(crate) name: Option<String>,
    /// A copy of the record's users, readable without waiting for an
    /// operation in flight (updated whenever an operation ends): sorted, in a
    /// boxed slice (a set's node costs ~300 bytes per volume at 10,000 volumes).
    pub(crate) users: Mutex<Box<[Box<str>]>>,
    /// When its last user left, while the unpublish waits for
    /// [`ProviderConfig::unpublish_delay`] (in memory: a restart settles it at once).
    pub(crate) idle_since: Mutex<Option<std::time::Instant>>,
}

impl Slot {
    /// Refreshes the lock-free copy of the users.
    pub(crate) fn sync_users(&self, rec: &VolumeRecord) {
        *self.users.lock().unwrap() = users_copy(rec);
    }

    /// Whether `container` uses the volume (per the lock-free copy).
    pub(crate) fn has_user(&self, container: &str) -> bool {
        self.users
            .lock()
            .unwrap()
            .binary_search_by(|u| (**u).cmp(container))
            .is_ok()
    }
}

/// The record's users, sorted (a set's order), as [`Slot::users`] keeps them.
fn users_copy(rec: &VolumeRecord) -> Box<[Box<str>]> {
    rec.users.iter().map(|u| Box::from(u.as_str())).collect()
}

/// What NodeGetInfo said of this node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeInfo {
    /// The node id ControllerPublish names.
    pub node_id: String,
    /// The node's topology segments (empty: the plugin said none).
    pub topology: topology::Segments,
}

/// The storage local resource provider (see the module doc).
#[derive(Debug)]
pub struct StorageProvider {
    pub(crate) config: ProviderConfig,
    pub(crate) plugin: String,
    pub(crate) layout: Layout,
    /// The node plugin's client: every Node RPC (and, with one plugin for both, every RPC).
    pub(crate) client: Client,
    /// The controller plugin's client: every Controller RPC. A clone of `client` unless the
    /// configuration names a controller endpoint apart.
    pub(crate) controller: Client,
    pub(crate) supervisor: Option<Supervisor>,
    pub(crate) boot_id: String,
    pub(crate) node_info: tokio::sync::OnceCell<NodeInfo>,
    pub(crate) vendor: String,
    pub(crate) slots: Mutex<BTreeMap<String, Arc<Slot>>>,
    pub(crate) name_locks: super::name_locks::NameLocks,
    pub(crate) sys: Arc<dyn Syscall>,
    pub(crate) table: Arc<dyn MountTable>,
    pub(crate) report: Mutex<RecoveryReport>,
    pub(crate) sweeping: std::sync::atomic::AtomicBool,
    /// What tells ensure-all which volumes to check ([`crate::provider::attention::Watched`]).
    pub(crate) watched: crate::provider::attention::Watched,
    /// The journal every record change is appended to ([`checkpoint::VolumeJournal`]).
    pub(crate) journal: Arc<checkpoint::VolumeJournal>,
}

impl StorageProvider {
    /// Starts the provider: validates its names, starts (or connects to)
    /// the plugin, loads every checkpoint and runs recovery.
    pub async fn start(config: ProviderConfig) -> Result<Arc<Self>, ProviderError> {
        Self::start_watched(
            config,
            Arc::new(LinuxSyscall::new()),
            Arc::new(ProcMountTable::new()),
            crate::mount::kernel_watch(),
        )
        .await
    }

    /// [`start`](Self::start) with the mount seam injected, and no watch of the mount table (every
    /// launch checks every volume in use).
    pub async fn start_with(
        config: ProviderConfig,
        sys: Arc<dyn Syscall>,
        table: Arc<dyn MountTable>,
    ) -> Result<Arc<Self>, ProviderError> {
        Self::start_watched(config, sys, table, Box::new(crate::mount::NoWatch)).await
    }

    /// [`start_with`](Self::start_with), with `watch` telling ensure-all which volumes to check.
    pub async fn start_watched(
        mut config: ProviderConfig,
        sys: Arc<dyn Syscall>,
        table: Arc<dyn MountTable>,
        watch: Box<dyn crate::mount::MountWatch>,
    ) -> Result<Arc<Self>, ProviderError> {
        if let (Some(endpoint), PluginSource::Managed(_)) =
            (&config.controller_endpoint, &config.plugin)
        {
            return Err(ProviderError::ControllerPlugin {
                endpoint: endpoint.clone(),
                why: "the managed (bundled) plugin serves both the controller and the node: name the node plugin's socket with --plugin-endpoint beside --controller-endpoint, or leave --controller-endpoint out".into(),
            });
        }
        let services = node_services(&config);
        // A plugin reached by endpoint may leave its type to be asked.
        let early_client = match (&config.plugin, config.plugin_type.is_empty()) {
            (PluginSource::Endpoint(endpoint), true) => {
                let plugin = format!("{endpoint} ({})", config.plugin_name);
                let client = Client::connect_for(
                    endpoint,
                    config.client.clone(),
                    services,
                    crate::csi::Metrics::new(),
                )
                .await
                .map_err(|source| ProviderError::Plugin {
                    plugin: plugin.clone(),
                    source,
                })?;
                let info = client
                    .get_plugin_info(proto::GetPluginInfoRequest {})
                    .await
                    .map_err(|source| ProviderError::Plugin { plugin, source })?;
                if config.provider_id.is_empty() || config.provider_id.starts_with('.') {
                    config.provider_id = format!("{}.{}", info.name, config.plugin_name);
                }
                config.plugin_type = info.name;
                Some(client)
            }
            _ => None,
        };
        for (field, value) in [
            ("plugin type", &config.plugin_type),
            ("plugin name", &config.plugin_name),
        ] {
            validate_path_component(field, value)
                .map_err(|e| ProviderError::InvalidConfig(Box::new(e)))?;
        }
        let plugin = format!("{}/{}", config.plugin_type, config.plugin_name);
        let layout = Layout::new(&config.work_dir, &config.plugin_type, &config.plugin_name);
        let dirs = [layout.volumes_dir(), layout.mounts_dir()];
        blocking(move || {
            dirs.iter()
                .try_for_each(|dir| mkdir(dir, "create provider directory"))
        })
        .await?;
        let (journal, found, refused) = {
            let layout = layout.clone();
            blocking(move || checkpoint::VolumeJournal::open(&layout)).await
        }
        .map_err(|source| ProviderError::Checkpoint {
            volume: "(every volume: the provider's journal)".into(),
            source,
        })?;
        let journal = Arc::new(journal);
        let boot_id = config.boot_id.clone().unwrap_or_else(current_boot_id);
        // Recovery's first step needs no plugin: it reads the volumes while the plugin starts
        // (at 10,000 volumes each takes about half a second). Both finish before either's error
        // is returned, so a failed start cuts no step short.
        let loading = {
            let (layout, journal, table, boot_id) = (
                layout.clone(),
                journal.clone(),
                table.clone(),
                boot_id.clone(),
            );
            blocking(move || {
                Self::load_records(&layout, &journal, &*table, &boot_id, (found, refused))
            })
        };
        let (plugin_started, loaded) = tokio::join!(
            Self::reach_plugin(&config, &plugin, &layout, early_client),
            loading
        );
        // What the load did on disk is done either way: a start that fails from here on says
        // it in the log, since no recovery report will (the next start finds it done).
        let lost = |e: ProviderError| {
            log_report_of_failed_start(&plugin, &loaded.report);
            e
        };
        let (client, supervisor) = plugin_started.map_err(lost)?;
        let vendor = client
            .get_plugin_info(proto::GetPluginInfoRequest {})
            .await
            .map(|r| r.name)
            .map_err(|source| ProviderError::Plugin {
                plugin: plugin.clone(),
                source,
            })
            .map_err(lost)?;
        let controller = match &config.controller_endpoint {
            None => client.clone(),
            Some(endpoint) => connect_controller(endpoint, &config, &plugin, &client, &vendor)
                .await
                .map_err(lost)?,
        };
        let provider = Arc::new(StorageProvider {
            plugin,
            layout,
            client,
            controller,
            supervisor,
            boot_id,
            node_info: tokio::sync::OnceCell::new(),
            vendor,
            slots: Mutex::new(BTreeMap::new()),
            name_locks: Default::default(),
            sys,
            table,
            report: Mutex::new(loaded.report),
            sweeping: std::sync::atomic::AtomicBool::new(false),
            watched: crate::provider::attention::Watched::new(watch),
            journal,
            config,
        });
        for rec in loaded.records {
            provider.insert_slot(rec);
        }
        Self::recover(&provider).await?;
        Ok(provider)
    }

    /// The provider's plugin, started and ready (a managed one, with its supervisor) or
    /// connected to (`early`: the client already made to ask the plugin's type).
    async fn reach_plugin(
        config: &ProviderConfig,
        plugin: &str,
        layout: &Layout,
        early: Option<Client>,
    ) -> Result<(Client, Option<Supervisor>), ProviderError> {
        Ok(match (&config.plugin, early) {
            (_, Some(client)) => (client, None),
            (PluginSource::Endpoint(endpoint), None) => {
                (connect(endpoint, config, plugin).await?, None)
            }
            (PluginSource::Managed(cmd), None) => {
                let sup = Supervisor::start(
                    plugin.to_string(),
                    cmd.clone(),
                    layout.plugin_socket(&config.socket_dir),
                    layout.plugin_dir().join("plugin.log"),
                    config.ready_timeout,
                )
                .await?;
                (connect(&sup.endpoint(), config, plugin).await?, Some(sup))
            }
        })
    }

    /// The provider id its resources carry.
    pub fn id(&self) -> &str {
        &self.config.provider_id
    }

    /// `<type>/<name>` of its plugin.
    pub fn plugin(&self) -> &str {
        &self.plugin
    }

    /// Its on-disk layout.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Its node plugin's CSI client (node capabilities, metrics): with one plugin for both, the
    /// only one. Controller RPCs go through [`controller`](Self::controller); decide which RPCs
    /// to send with [`capabilities`](Self::capabilities).
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Its controller plugin's CSI client: the node plugin's own unless the controller runs
    /// apart ([`ProviderConfig::controller_endpoint`]). Its calls are counted in the same
    /// metrics as [`client`](Self::client)'s.
    pub fn controller(&self) -> &Client {
        &self.controller
    }

    /// What the driver offers now: the controller's RPCs from the controller plugin, the node's
    /// from the node plugin ([`Capabilities::joined`]); with one plugin for both, its own.
    pub fn capabilities(&self) -> Arc<Capabilities> {
        if self.config.controller_endpoint.is_none() {
            return self.client.current_capabilities();
        }
        Arc::new(Capabilities::joined(
            &self.controller.current_capabilities(),
            &self.client.current_capabilities(),
        ))
    }

    /// Its configuration.
    pub fn config(&self) -> &ProviderConfig {
        &self.config
    }

    /// How many times its managed plugin terminated unexpectedly.
    pub fn plugin_terminations(&self) -> u64 {
        self.supervisor.as_ref().map_or(0, |s| s.terminations())
    }

    /// The managed plugin's pid, if any.
    pub fn plugin_pid(&self) -> Option<u32> {
        self.supervisor.as_ref().and_then(|s| s.pid())
    }

    /// What recovery found and did.
    pub fn recovery_report(&self) -> RecoveryReport {
        self.report.lock().unwrap().clone()
    }

    /// A snapshot of every volume's record (waits for operations in flight).
    pub async fn volumes(&self) -> Vec<VolumeRecord> {
        let slots: Vec<Arc<Slot>> = self.slots.lock().unwrap().values().cloned().collect();
        let mut out = Vec::with_capacity(slots.len());
        for s in slots {
            out.push(s.record.lock().await.clone());
        }
        out
    }

    /// The record of one volume, if known.
    pub async fn volume(&self, volume_id: &str) -> Option<VolumeRecord> {
        let slot = self.slots.lock().unwrap().get(volume_id).cloned()?;
        let rec = slot.record.lock().await.clone();
        Some(rec)
    }

    /// The host mount point of a volume (where NodePublishVolume mounts it).
    pub fn mount_point(&self, volume_id: &str) -> PathBuf {
        self.layout.target_path(volume_id)
    }

    /// The resource that hands a volume out: `disk.source.id` = the volume
    /// id, `disk.source.mount.root` = `./csi/<type>/<name>/mounts`,
    /// metadata = its volume_context, with profile and vendor; of type
    /// `BLOCK` (Mesos' block disk) for a block volume, `MOUNT` otherwise.
    pub fn resource_for(&self, rec: &VolumeRecord) -> Resource {
        let mut resource = Resource::csi_volume(
            &self.config.provider_id,
            &rec.volume_id,
            &self.layout.relative_mount_root(),
            rec.capacity_bytes.div_ceil(1024 * 1024),
            rec.profile.as_deref(),
            rec.vendor.as_deref(),
            rec.volume_context.clone(),
        );
        if rec.capability.access_type == AccessType::Block {
            if let Some(source) = resource.disk.as_mut().and_then(|d| d.source.as_mut()) {
                source.kind = SourceType::Block;
            }
        }
        resource
    }

    /// Stops a managed plugin (SIGTERM, then SIGKILL after `grace`).
    pub async fn shutdown(&self, grace: Duration) {
        self.compact_journal().await;
        if let Some(s) = &self.supervisor {
            s.stop(grace).await;
        }
    }

    /// How many synced batches (one fdatasync each) the provider's journal has written since
    /// it was opened (for the benchmarks).
    pub fn journal_batches(&self) -> u64 {
        self.journal.batches()
    }

    /// Writes the journal back to the state files and empties it (clean shutdown, and after
    /// recovery). A failure is logged: the journal keeps its entries for the next start.
    pub async fn compact_journal(&self) {
        let journal = self.journal.clone();
        if let Err(e) = blocking(move || journal.compact()).await {
            tracing::error!(error = %crate::error_chain::Chain(&e), "cannot compact the provider's journal: its entries stay for the next start");
        }
    }

    pub(crate) fn slot(&self, volume_id: &str) -> Result<Arc<Slot>, ProviderError> {
        self.slots
            .lock()
            .unwrap()
            .get(volume_id)
            .cloned()
            .ok_or_else(|| ProviderError::UnknownVolume {
                volume: volume_id.to_string(),
                provider: self.config.provider_id.clone(),
            })
    }

    pub(crate) fn insert_slot(&self, rec: VolumeRecord) -> Arc<Slot> {
        let id = rec.volume_id.clone();
        let slot = Arc::new(Slot {
            name: rec.name.clone(),
            users: Mutex::new(users_copy(&rec)),
            idle_since: Mutex::new(None),
            record: tokio::sync::Mutex::new(rec),
        });
        self.slots.lock().unwrap().insert(id, slot.clone());
        slot
    }

    /// Records a volume's checkpoint in the journal, on the blocking pool (its batch's
    /// fdatasync waits for the disk); returns once it is durable. Its `volume.state` is
    /// written back at the next compaction.
    pub(crate) async fn persist(&self, rec: &VolumeRecord) -> Result<(), ProviderError> {
        self.persist_as(rec, Commit::Durable).await
    }

    /// [`persist`](Self::persist), returning at once for [`Commit::Lazy`]: for a record whose
    /// loss to a power cut only makes recovery redo idempotent work from an intent already
    /// durable (see [`drive`](Self::drive)).
    pub(crate) async fn persist_as(
        &self,
        rec: &VolumeRecord,
        commit: Commit,
    ) -> Result<(), ProviderError> {
        let bytes = serde_json::to_vec_pretty(rec).expect("a volume record always serializes");
        let journal = self.journal.clone();
        let id = rec.volume_id.clone();
        blocking(move || journal.record(&id, Some(bytes), commit))
            .await
            .map_err(|source| ProviderError::Checkpoint {
                volume: rec.volume_id.clone(),
                source,
            })
    }

    /// The node id from NodeGetInfo, asked once.
    pub(crate) async fn node_id(&self) -> Result<String, ProviderError> {
        self.node_info().await.map(|n| n.node_id.clone())
    }

    /// NodeGetInfo's answer, asked once: the node id, and the node's topology (checked, see
    /// [`topology::check_answer`]).
    pub(crate) async fn node_info(&self) -> Result<&NodeInfo, ProviderError> {
        self.node_info
            .get_or_try_init(|| async {
                let answer = self
                    .client
                    .node_get_info(proto::NodeGetInfoRequest {})
                    .await
                    .map_err(|source| ProviderError::Plugin {
                        plugin: self.plugin.clone(),
                        source,
                    })?;
                let segments: topology::Segments = answer
                    .accessible_topology
                    .map(|t| t.segments.into_iter().collect())
                    .unwrap_or_default();
                topology::check_answer(std::slice::from_ref(&segments)).map_err(|what| {
                    ProviderError::PluginMisbehaved {
                        volume: "-".into(),
                        rpc: "NodeGetInfo",
                        what: format!("answered accessible_topology with {what}"),
                    }
                })?;
                Ok(NodeInfo {
                    node_id: answer.node_id,
                    topology: segments,
                })
            })
            .await
    }

    /// What the plugin serving now offers for choosing steps (rediscovered
    /// when it is replaced, see [`crate::csi::Client`]).
    pub(crate) fn step_caps(&self) -> StepCaps {
        StepCaps::of(&self.capabilities())
    }

    /// Its clients, each once: the node plugin's, and the controller plugin's when apart.
    fn clients(&self) -> impl Iterator<Item = &Client> {
        std::iter::once(&self.client).chain(
            self.config
                .controller_endpoint
                .is_some()
                .then_some(&self.controller),
        )
    }

    /// Drives a volume to the steady state `goal`.
    ///
    /// One durable intent covers the whole operation: before the first RPC
    /// the record says which step starts and where the operation is going
    /// (`towards`); the final state is written once the goal is reached.
    /// After a crash anywhere in between, the intent bounds what the plugin
    /// may have done: going on re-issues the steps from the first one, going
    /// back undoes every step up to `towards` (CSI calls are idempotent, so
    /// both are safe whether or not the plugin had done them).
    ///
    /// The loop: decide ([`resume_point`] once, then [`next_step`] from the
    /// state, the goal and the plugin's capabilities), make the intent
    /// durable (first RPC only), send the RPC, move the record on; the final
    /// state is written after the loop, without waiting for it to be durable
    /// when the intent was (see [`Commit::Lazy`]): the intent already
    /// promises the goal.
    ///
    /// Returns whether it wrote the checkpoint (callers with other changes
    /// to the record, such as its users, persist them otherwise).
    pub(crate) async fn drive(
        &self,
        rec: &mut VolumeRecord,
        goal: VolumeState,
    ) -> Result<bool, ProviderError> {
        // If the intent cannot be written nothing is sent, and the record in
        // memory goes back to what it was (it must match the disk).
        if rec.rests_at(goal) {
            return Ok(false);
        }
        // Steps are chosen by the plugin's capabilities: if the plugin was
        // replaced since the last call, check it and learn them first. Only a
        // different driver stops here; a plugin that cannot be asked yet is
        // checked again, with retries, by the first call.
        for client in self.clients() {
            match client.ensure_current().await {
                Ok(()) => {}
                Err(source @ crate::csi::CsiError::PluginReplaced { .. }) => {
                    return Err(ProviderError::Csi {
                        volume: rec.volume_id.clone(),
                        source,
                    })
                }
                Err(e) => {
                    tracing::debug!(volume_id = %rec.volume_id, endpoint = client.endpoint(), error = %Chain(&e), "cannot re-check the plugin yet")
                }
            }
        }
        let before = rec.clone();
        rec.state = resume_point(rec.state, rec.towards, goal);
        let mut dirs = DirWork::default();
        let driven = self.drive_steps(rec, goal, before, &mut dirs).await;
        // None of the operation's work goes on after it: directories made for a step it did
        // not reach (it failed first, or the plugin replaced meanwhile has no such step).
        if let Err(e) = dirs.finish().await {
            tracing::debug!(volume_id = %rec.volume_id, error = %Chain(&e), "directories not made, and not needed");
        }
        if driven.is_err() && goal == VolumeState::Published {
            // A NodeStage of this operation left its mount's nosuid,nodev to NodePublish's trip,
            // which a failure may have skipped: set now (nothing when nothing is mounted there).
            let staging = self.layout.staging_path(&rec.volume_id);
            if let Err(e) = self.harden(&rec.volume_id, &staging, "staging").await {
                tracing::warn!(volume_id = %rec.volume_id, error = %Chain(&e), "after a failed publish, cannot set nosuid,nodev on the staging mount");
            }
        }
        driven
    }

    /// [`drive`](Self::drive)'s loop, from the resume point: `before`, the record as it was;
    /// `dirs`, the making of the node's directories the steps need, started with the intent
    /// (`drive` waits for what is left of it).
    async fn drive_steps(
        &self,
        rec: &mut VolumeRecord,
        goal: VolumeState,
        before: VolumeRecord,
        dirs: &mut DirWork,
    ) -> Result<bool, ProviderError> {
        let mut wrote = false;
        let mut dirty = false;
        let mut intent = false;
        loop {
            let caps = self.step_caps();
            let mut next = next_step(rec.state, goal, caps, false);
            // The mount table is asked only when its answer can change the step.
            if next == Next::Skip(Step::NodeUnstage) && self.still_staged(rec).await {
                next = next_step(rec.state, goal, caps, true);
            }
            let step = match next {
                Next::Done => break,
                Next::Skip(step) => {
                    if step == Step::ControllerUnpublish
                        && rec.node_id.is_some()
                        && !self
                            .controller
                            .current_capabilities()
                            .plugin
                            .controller_service()
                    {
                        // Published to a node through a controller that is not here (a
                        // command without the `--controller-endpoint` it was published with, or
                        // a controller plugin that lost its service): skipping would leave the
                        // controller holding the volume for this node for good.
                        let error = ProviderError::NoControllerToUnpublish {
                            volume: rec.volume_id.clone(),
                            node: rec.node_id.clone().unwrap_or_default(),
                            endpoint: self.controller.endpoint().to_string(),
                        };
                        if dirty {
                            // Steps before it were done: keep them.
                            self.persist(rec).await?;
                        } else {
                            *rec = before;
                        }
                        return Err(error);
                    }
                    dirty = true;
                    if step == Step::ControllerUnpublish && rec.node_id.is_some() {
                        // Published by a plugin that offered the capability; the one
                        // serving now has no RPC to undo it with.
                        tracing::warn!(volume_id = %rec.volume_id, "the plugin no longer offers PUBLISH_UNPUBLISH_VOLUME: ControllerUnpublishVolume skipped");
                    }
                    advance(rec, step);
                    continue;
                }
                Next::Call(step) => step,
            };
            dirty = true;
            rec.state = step.transient();
            if !intent {
                rec.towards = Some(goal);
                if goal.rank() >= VolumeState::VolReady.rank() {
                    rec.boot_id = Some(self.boot_id.clone());
                }
                // The directories the steps ahead need (a volume's live as long as it does,
                // see `make_volume_dirs`: this only finds them, unless an older version or a
                // failure left them unmade) are made while the intent is written and the
                // first RPC sent, and waited for by the step that needs them. Empty private
                // directories of a volume already recorded: nothing depends on their order.
                *dirs =
                    self.start_node_dirs(&rec.volume_id, node_dirs(step, goal, caps.stage_unstage));
                if let Err(e) = self.persist(rec).await {
                    *rec = before;
                    return Err(e);
                }
                intent = true;
                wrote = true;
            }
            if let Err(e) = dirs.ready_for(step).await {
                return Err(self.after_failed_step(rec, &before, step, e).await);
            }
            tracing::debug!(volume_id = %rec.volume_id, rpc = step.rpc(), "sending");
            if let Err(e) = self.call(rec, step, goal, dirs.asked).await {
                return Err(self.after_failed_step(rec, &before, step, e).await);
            }
            // The RPC is done but not yet recorded: a crash here is the
            // window recovery must close by re-issuing (the crash tests stop
            // here too).
            checkpoint::crash_point();
            advance(rec, step);
            tracing::info!(volume_id = %rec.volume_id, rpc = step.rpc(), state = %rec.state, "transition done");
        }
        if dirty || rec.towards.is_some() {
            rec.towards = None;
            // When this call made its intent durable, the result need not be: lost to a power
            // cut, recovery finds the intent (the goal, the users) and re-issues the steps,
            // all idempotent, to the same state. It is appended at once (a crash of the
            // process loses nothing) and durable with the journal's next synced batch.
            let commit = if intent {
                Commit::Lazy
            } else {
                Commit::Durable
            };
            self.persist_as(rec, commit).await?;
            wrote = true;
        }
        if goal == VolumeState::Published && rec.expansion.is_some() {
            // An expansion's node call that waited for this publish (it persists what it does).
            self.node_expand_after_publish(rec).await;
        }
        Ok(wrote)
    }

    /// Whether the volume's staging path still holds a mount although the
    /// plugin no longer offers STAGE_UNSTAGE_VOLUME (it was replaced by one
    /// without it): then NodeUnstage is not skipped (see [`next_step`]), and
    /// fails in [`call`](Self::call) rather than leave a mount behind unseen.
    async fn still_staged(&self, rec: &VolumeRecord) -> bool {
        let staging = self.layout.staging_path(&rec.volume_id);
        let table = self.table.clone();
        match blocking(move || table.is_mount_root(&staging)).await {
            Ok(mounted) => mounted,
            Err(e) => {
                tracing::warn!(volume_id = %rec.volume_id, error = %Chain(&e), "cannot check the staging path");
                false
            }
        }
    }

    /// A volume recorded with a group, staged or published again by a plugin that no longer
    /// offers VOLUME_MOUNT_GROUP (it was replaced): the group is not sent (the spec forbids
    /// it) and no longer recorded, so the isolator's own rule applies to its users again.
    fn check_mount_group(&self, rec: &mut VolumeRecord) {
        if rec.mount_group.is_some() && !self.capabilities().node.volume_mount_group() {
            tracing::warn!(volume_id = %rec.volume_id, gid = ?rec.mount_group,
                "the plugin no longer offers VOLUME_MOUNT_GROUP: the volume's group is not sent");
            rec.mount_group = None;
        }
    }

    /// Starts making the directories `asked` of a volume's (see [`node_dirs`]) in one trip off
    /// the async workers: the mount directory (closed to other users when an earlier version
    /// left it open) and the staging path, each found when it exists.
    fn start_node_dirs(&self, volume_id: &str, asked: NodeDirs) -> DirWork {
        if asked == NodeDirs::default() {
            return DirWork::default();
        }
        let staging = self.layout.staging_path(volume_id);
        let mount_dir = self.layout.mount_dir(volume_id);
        DirWork {
            asked,
            task: Some(start_blocking(move || {
                // The staging path's making makes (or finds) its parent, the mount directory.
                if asked.staging {
                    mkdir(&staging, "create staging directory")?;
                } else if asked.mount {
                    mkdir(&mount_dir, "create mount directory")?;
                }
                if asked.mount {
                    close_dir(&mount_dir)?;
                }
                Ok(())
            })),
        }
    }

    /// The directories `asked` of a volume's, made (or found) now; the first failure.
    async fn make_node_dirs(&self, volume_id: &str, asked: NodeDirs) -> Result<(), ProviderError> {
        self.start_node_dirs(volume_id, asked).finish().await
    }

    /// Makes a new volume's directories on this node (see [`NodeDirs`]), which live as long as
    /// the volume, so that its publishes do not (a stage or a publish makes one found missing).
    /// A failure is logged, not returned: the volume is recorded already, and its first publish
    /// makes them or says why it cannot.
    pub(crate) async fn make_volume_dirs(&self, volume_id: &str) {
        let asked = NodeDirs {
            staging: self.step_caps().stage_unstage,
            mount: true,
        };
        if let Err(e) = self.make_node_dirs(volume_id, asked).await {
            tracing::warn!(volume_id, error = %Chain(&e), "cannot make the new volume's directories yet: its first publish will");
        }
    }

    /// Sends `step`'s RPC for the volume, on its way to `goal`, and records what it answers;
    /// `dirs`: the directories already made for it with the operation's intent (any other is
    /// made here).
    async fn call(
        &self,
        rec: &mut VolumeRecord,
        step: Step,
        goal: VolumeState,
        dirs: NodeDirs,
    ) -> Result<(), ProviderError> {
        let id = rec.volume_id.clone();
        let secrets = self
            .secrets(rec.secrets_file.as_deref(), &id, step.rpc())
            .await?;
        let csi = |source| ProviderError::Csi {
            volume: id.clone(),
            source,
        };
        let volume_context: HashMap<String, String> =
            rec.volume_context.clone().into_iter().collect();
        let publish_context: HashMap<String, String> =
            rec.publish_context.clone().into_iter().collect();
        let staging = self.layout.staging_path(&rec.volume_id);
        let target = self.layout.target_path(&rec.volume_id);
        let stage = self.step_caps().stage_unstage;
        if matches!(step, Step::NodeStage | Step::NodePublish) {
            self.check_mount_group(rec);
        }
        match step {
            Step::ControllerPublish => {
                let node_id = self.node_id().await?;
                let resp = self
                    .controller
                    .controller_publish_volume(proto::ControllerPublishVolumeRequest {
                        volume_id: rec.volume_id.clone(),
                        node_id: node_id.clone(),
                        volume_capability: Some(rec.capability.to_proto()),
                        readonly: rec.readonly,
                        volume_context,
                        secrets: secrets.to_request(),
                    })
                    .await
                    .map_err(csi)?;
                rec.publish_context = resp.publish_context.into_iter().collect();
                rec.node_id = Some(node_id);
                // This node holds the volume again: a fence from before is over.
                rec.fenced = None;
            }
            Step::NodeStage => {
                if !dirs.staging {
                    self.make_node_dirs(&rec.volume_id, NodeDirs::STAGING)
                        .await?;
                }
                self.client
                    .node_stage_volume(proto::NodeStageVolumeRequest {
                        volume_id: rec.volume_id.clone(),
                        publish_context,
                        staging_target_path: staging.to_string_lossy().into_owned(),
                        volume_capability: Some(
                            rec.capability.to_proto_with_group(rec.mount_group),
                        ),
                        volume_context,
                        secrets: secrets.to_request(),
                    })
                    .await
                    .map_err(csi)?;
                // An operation that goes on to publish hardens the staging mount in
                // NodePublish's one trip, before the target (`drive` does it when the operation
                // fails before that trip); one that stops here hardens it now.
                if goal != VolumeState::Published {
                    self.harden(&rec.volume_id, &staging, "staging").await?;
                }
            }
            Step::NodePublish => {
                // The CO creates only the parent; the plugin creates the target.
                if !dirs.mount {
                    self.make_node_dirs(&rec.volume_id, NodeDirs::MOUNT).await?;
                }
                // The watch's reads before the mount is made: see `Watched::learn`.
                let seen = self.watched.looks();
                self.client
                    .node_publish_volume(proto::NodePublishVolumeRequest {
                        volume_id: rec.volume_id.clone(),
                        publish_context,
                        staging_target_path: if stage {
                            staging.to_string_lossy().into_owned()
                        } else {
                            String::new()
                        },
                        target_path: target.to_string_lossy().into_owned(),
                        volume_capability: Some(
                            rec.capability.to_proto_with_group(rec.mount_group),
                        ),
                        readonly: rec.readonly,
                        volume_context,
                        secrets: secrets.to_request(),
                    })
                    .await
                    .map_err(csi)?;
                // The plugin creates the target (the CO only its parent): an
                // answer of success with no target, or with a target of
                // another kind than the volume's, is not to be trusted.
                // One trip: the target checked, the staging mount hardened (again, when an
                // earlier operation did), then the target, and the target's mount id asked for
                // the watch (when it names mounts by id), so that it can name the mount when it
                // goes.
                let (sys, table) = (self.sys.clone(), self.table.clone());
                let (volume, at, staged) = (rec.volume_id.clone(), target.clone(), staging.clone());
                let (access, rpc) = (rec.capability.access_type, step.rpc());
                let wants_ids = self.watched.wants_ids();
                let learned = blocking(move || {
                    let found = std::fs::symlink_metadata(&at).ok();
                    if let Some(wrong) = target_mismatch(access, found.as_ref()) {
                        return Err(ProviderError::PluginMisbehaved {
                            volume,
                            rpc,
                            what: format!("reported success but {wrong} at {}", at.display()),
                        });
                    }
                    // Whatever the plugin offers now (one that staged may have been replaced by
                    // one without staging): nothing is changed unless a mount is rooted there.
                    harden_at(&*sys, &volume, &staged, "staging")?;
                    harden_at(&*sys, &volume, &at, "target")?;
                    Ok(wants_ids.then(|| table.check_mount_root(&at)))
                })
                .await?;
                match learned {
                    Some(Ok(check)) => self.watched.learn(&rec.volume_id, check, seen),
                    // Its id cannot be told: the next sweep checks it.
                    Some(Err(_)) => self.watched.mark(&rec.volume_id),
                    None => {}
                }
            }
            Step::NodeUnpublish => {
                self.sweep_beneath(&rec.volume_id, &target).await?;
                let result = self
                    .client
                    .node_unpublish_volume(proto::NodeUnpublishVolumeRequest {
                        volume_id: rec.volume_id.clone(),
                        target_path: target.to_string_lossy().into_owned(),
                    })
                    .await;
                gone_is_done(result, &rec.volume_id, step).map_err(csi)?;
            }
            Step::NodeUnstage if !stage => {
                // Only reached with a mount left at the staging path (see
                // `still_staged`): a plugin without the capability must not be
                // sent the RPC, and the mount is the plugin's to undo.
                return Err(ProviderError::PluginMisbehaved {
                    volume: rec.volume_id.clone(),
                    rpc: step.rpc(),
                    what: format!(
                        "cannot be sent: the plugin no longer offers STAGE_UNSTAGE_VOLUME, yet the volume is still staged at {}",
                        staging.display()
                    ),
                });
            }
            Step::NodeUnstage => {
                let result = self
                    .client
                    .node_unstage_volume(proto::NodeUnstageVolumeRequest {
                        volume_id: rec.volume_id.clone(),
                        staging_target_path: staging.to_string_lossy().into_owned(),
                    })
                    .await;
                gone_is_done(result, &rec.volume_id, step).map_err(csi)?;
                if rec.destroying {
                    // Removed (which detaches the copies), not made again: the delete follows.
                    blocking(move || {
                        remove_empty_dir(&staging);
                    })
                    .await;
                } else {
                    let volume = rec.volume_id.clone();
                    blocking(move || renew_staging_dir(&volume, &staging)).await;
                }
            }
            Step::ControllerUnpublish => {
                let node_id = match &rec.node_id {
                    Some(n) => n.clone(),
                    None => self.node_id().await?,
                };
                self.controller
                    .controller_unpublish_volume(proto::ControllerUnpublishVolumeRequest {
                        volume_id: rec.volume_id.clone(),
                        node_id,
                        secrets: secrets.to_request(),
                    })
                    .await
                    .map_err(csi)?;
            }
        }
        Ok(())
    }

    /// Sets nosuid,nodev on the mount a plugin (any plugin) made at `path` on the host, the staging or the
    /// target path: nothing planted in a volume runs with privilege, or opens a device, through a host path.
    /// Only a path that is itself a mount root is changed (never the file system holding it); a plugin
    /// that mounted nothing there is left alone. The containers' copies clear the flags again.
    pub(super) async fn harden(
        &self,
        volume: &str,
        path: &Path,
        what: &'static str,
    ) -> Result<(), ProviderError> {
        let (sys, volume, at) = (self.sys.clone(), volume.to_string(), path.to_path_buf());
        blocking(move || harden_at(&*sys, &volume, &at, what)).await
    }

    /// The secrets the RPC `rpc` carries for a volume whose secrets file is `file` (none
    /// without one), read now ([`crate::provider::secrets::load`]): a rotated file is used from
    /// the next call on. A file that cannot be used fails the call, naming it and the RPC; an
    /// RPC that carries no secrets (NodeUnpublish, NodeUnstage) never reads it, so a file gone
    /// bad does not stop those.
    pub(crate) async fn secrets(
        &self,
        file: Option<&Path>,
        volume: &str,
        rpc: &'static str,
    ) -> Result<Secrets, ProviderError> {
        if crate::csi::Operation::of_rpc(rpc).is_none() {
            return Ok(Secrets::default());
        }
        Ok(self
            .read_secrets(file, volume, rpc)
            .await?
            .map(|f| f.for_rpc(rpc))
            .unwrap_or_default())
    }

    /// Reads and checks the secrets file `file` (none: `None`) for `what` (the RPC, or the
    /// create or import it is checked for up front), naming it when it cannot be used.
    pub(crate) async fn read_secrets(
        &self,
        file: Option<&Path>,
        volume: &str,
        what: &'static str,
    ) -> Result<Option<crate::csi::SecretsFile>, ProviderError> {
        let Some(path) = file.map(Path::to_path_buf) else {
            return Ok(None);
        };
        blocking(move || crate::provider::secrets::load(&path))
            .await
            .map(Some)
            .map_err(|source| ProviderError::Secrets {
                volume: volume.to_string(),
                rpc: what,
                source,
            })
    }

    /// Unmounts whatever is mounted beneath the volume's host mount point `target` (not `target`
    /// itself), deepest first, before NodeUnpublishVolume: mounts a container made under its copy of a
    /// volume used with rshared propagation land there too, outlive the container (a namespace's end
    /// does not propagate its unmounts), and would make the plugin's unmount fail busy. At unpublish no
    /// container uses the volume any more.
    async fn sweep_beneath(&self, volume: &str, target: &Path) -> Result<(), ProviderError> {
        let (sys, table, at) = (self.sys.clone(), self.table.clone(), target.to_path_buf());
        match blocking(move || crate::mount::unmount_all_beneath(&*sys, &*table, &at)).await {
            Ok(0) => Ok(()),
            Ok(count) => {
                tracing::info!(volume_id = volume, target = %target.display(), count, "unmounted mounts left beneath the volume's mount point");
                Ok(())
            }
            Err(e) => Err(ProviderError::Io(IoStep::new(
                "unmount what is mounted beneath the volume's mount point",
                target,
                std::io::Error::other(e),
            ))),
        }
    }

    pub(crate) fn name_lock(&self, name: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.name_locks.get(name)
    }
}

/// Moves the record to the steady state after `step` (in memory).
/// [`StorageProvider::harden`] in the caller's thread: `what` is "staging" or "target".
pub(crate) fn harden_at(
    sys: &dyn Syscall,
    volume: &str,
    path: &Path,
    what: &'static str,
) -> Result<(), ProviderError> {
    match sys.harden_mount_root(path) {
        Ok(true) => Ok(()),
        Ok(false) => {
            tracing::debug!(volume_id = volume, path = %path.display(), what, "not a mount root: nothing to harden");
            Ok(())
        }
        Err(e) => Err(ProviderError::Io(IoStep::new(
            if what == "staging" {
                "set nosuid,nodev on the staging mount"
            } else {
                "set nosuid,nodev on the target mount"
            },
            path,
            std::io::Error::other(e),
        ))),
    }
}

fn advance(rec: &mut VolumeRecord, step: Step) {
    rec.state = step.to();
    if rec.state == VolumeState::Created {
        rec.publish_context.clear();
        rec.node_id = None;
        rec.boot_id = None;
    }
}

/// A backward node step answered NOT_FOUND ("volume does not exist"):
/// there is nothing left to undo on the plugin's side, so the step is done.
fn gone_is_done<T>(
    result: Result<T, crate::csi::CsiError>,
    volume_id: &str,
    step: Step,
) -> Result<(), crate::csi::CsiError> {
    match result {
        Ok(_) => Ok(()),
        Err(e) if e.code() == Some(tonic::Code::NotFound) => {
            tracing::warn!(volume_id, rpc = step.rpc(), error = %Chain(&e), "the plugin does not know the volume; treating the step as done");
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// Which services the node plugin's client drives: both, unless the controller runs apart.
fn node_services(config: &ProviderConfig) -> Services {
    match config.controller_endpoint {
        Some(_) => Services::Node,
        None => Services::Both,
    }
}

async fn connect(
    endpoint: &str,
    config: &ProviderConfig,
    plugin: &str,
) -> Result<Client, ProviderError> {
    Client::connect_for(
        endpoint,
        config.client.clone(),
        node_services(config),
        crate::csi::Metrics::new(),
    )
    .await
    .map_err(|source| ProviderError::Plugin {
        plugin: plugin.to_string(),
        source,
    })
}

/// Connects to the controller plugin at `endpoint` and checks that it is the node plugin's
/// driver ([`check_controller`]); its calls are counted in the node client's metrics.
async fn connect_controller(
    endpoint: &str,
    config: &ProviderConfig,
    plugin: &str,
    node: &Client,
    node_name: &str,
) -> Result<Client, ProviderError> {
    let plugin = format!("{plugin} controller at {endpoint}");
    let controller = Client::connect_for(
        endpoint,
        config.client.clone(),
        Services::Controller,
        node.metrics(),
    )
    .await
    .map_err(|source| ProviderError::Plugin {
        plugin: plugin.clone(),
        source,
    })?;
    let info = controller
        .get_plugin_info(proto::GetPluginInfoRequest {})
        .await
        .map_err(|source| ProviderError::Plugin { plugin, source })?;
    check_controller(
        &info.name,
        &controller.current_capabilities(),
        node.endpoint(),
        node_name,
    )
    .map_err(|why| ProviderError::ControllerPlugin {
        endpoint: endpoint.to_string(),
        why,
    })?;
    Ok(controller)
}

/// Whether the plugin at the controller endpoint, driver `name` with capabilities `caps`, may
/// serve as the controller of the node plugin at `node_endpoint`, driver `node_name`: the same
/// driver (a wrong socket must not receive volume calls), with the controller service.
fn check_controller(
    name: &str,
    caps: &Capabilities,
    node_endpoint: &str,
    node_name: &str,
) -> Result<(), String> {
    if name != node_name {
        return Err(format!(
            "it is driver '{}' and the node plugin at {} is driver '{}' (their GetPluginInfo names): the two must be one driver's controller and node plugins; check that --controller-endpoint and --plugin-endpoint name the right sockets",
            crate::shown::shown(name),
            node_endpoint,
            crate::shown::shown(node_name),
        ));
    }
    if !caps.plugin.controller_service() {
        return Err(format!(
            "driver '{}' does not offer CONTROLLER_SERVICE (GetPluginCapabilities) there: it is not a controller plugin (a node plugin's socket?); name the driver's controller plugin, or leave --controller-endpoint out to use one plugin for both",
            crate::shown::shown(name),
        ));
    }
    Ok(())
}

/// Creates `path` and its missing parents 0700: under the work dir, a volume's host paths are root's alone.
/// Existing directories are left as they are (one may be a volume's mount root, whose mode is the
/// volume's).
pub(crate) fn mkdir(path: &Path, step: &'static str) -> Result<(), ProviderError> {
    crate::workdir::create_private_dirs(path)
        .map_err(|source| ProviderError::Io(IoStep::new(step, path, source)))
}

/// Closes a volume's `mounts/<id>` directory (never itself a mount) to everyone but root, when an earlier
/// version created it open: it is the way to the volume's staging and target paths on the host.
fn close_dir(dir: &Path) -> Result<(), ProviderError> {
    crate::workdir::close_private_dir(dir).map_err(|source| {
        ProviderError::Io(IoStep::new(
            "close mount directory to other users",
            dir,
            source,
        ))
    })
}

/// The making of a volume's node directories for one operation ([`node_dirs`]): started with
/// its intent ([`StorageProvider::start_node_dirs`]), waited for by the first step that needs
/// them ([`ready_for`](Self::ready_for)), and by [`StorageProvider::drive`] before it returns
/// ([`finish`](Self::finish)), so that none of it outlives the operation.
#[derive(Default)]
struct DirWork {
    /// The directories asked for (a step makes any other it needs itself).
    asked: NodeDirs,
    task: Option<Started<Result<(), ProviderError>>>,
}

impl DirWork {
    /// Waits for the directories when `step` needs one of them: their failure fails the first
    /// node step, before its RPC (nothing is sent that a later step would fail for).
    async fn ready_for(&mut self, step: Step) -> Result<(), ProviderError> {
        let needs = match step {
            Step::NodeStage => self.asked.staging,
            Step::NodePublish => self.asked.mount,
            _ => false,
        };
        match self.task.take() {
            Some(task) if needs => task.wait().await,
            still => {
                self.task = still;
                Ok(())
            }
        }
    }

    /// Waits for whatever is still under way: its failure, when no step took it.
    async fn finish(self) -> Result<(), ProviderError> {
        match self.task {
            Some(task) => task.wait().await,
            None => Ok(()),
        }
    }
}

/// After NodeUnstage (of a volume not being destroyed, whose staging directory is only
/// removed): the staging directory removed, then made again, empty, for the volume's next
/// stage (so that a publish makes none). The removal is what detaches a copy of the old
/// staging mount that another mount namespace kept (a container's, copied while the volume
/// was staged): the kernel detaches every mount on a removed directory in every namespace,
/// and such a copy would keep the volume's filesystem mounted after its unstage. A directory
/// the plugin left something in is kept as it is; one that cannot be made again is made by the
/// next stage (logged).
fn renew_staging_dir(volume: &str, staging: &Path) {
    if !remove_empty_dir(staging) {
        return;
    }
    if let Err(e) = mkdir(staging, "make the staging directory again") {
        tracing::debug!(volume_id = volume, error = %Chain(&e), "the next stage makes it");
    }
}

/// Removes a directory we created if it is empty; whether nothing is left at `dir` (removed, or
/// already gone). `rmdir` never removes content and fails with EBUSY on a mount point, so a
/// volume's data can never go with it; anything but a directory is left as it is (warned: the
/// plugin left it?).
pub(crate) fn remove_empty_dir(dir: &std::path::Path) -> bool {
    match std::fs::remove_dir(dir) {
        Ok(()) => true,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => true,
        Err(e) if e.raw_os_error() == Some(libc::ENOTDIR) => {
            tracing::warn!(path = %dir.display(), "not a directory (the plugin left it?): left as it is");
            false
        }
        // Not empty (or still a mount point): kept, and there to be found.
        Err(e) => {
            tracing::debug!(path = %dir.display(), error = %Chain(&e), "directory kept");
            false
        }
    }
}

/// This boot's id (`/proc/sys/kernel/random/boot_id`); a changed id means
/// the node rebooted and every node-side mount is gone.
pub fn current_boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// What is wrong with what NodePublishVolume left at the target, if anything: the
/// target must exist and be of the volume's kind, a directory for a mount volume, a
/// block device for a block volume (CSI: the plugin places the mounted directory, or
/// the block device, at the target). Symlinks are not followed.
pub(crate) fn target_mismatch(
    access: AccessType,
    found: Option<&std::fs::Metadata>,
) -> Option<&'static str> {
    use std::os::unix::fs::FileTypeExt;
    let Some(found) = found else {
        return Some("created no target");
    };
    let kind = found.file_type();
    match access {
        AccessType::Mount if !kind.is_dir() => Some("the target is not a directory"),
        AccessType::Block if !kind.is_block_device() => Some("the target is not a block device"),
        _ => None,
    }
}

/// Logs what recovery's load changed on disk (`report`) when the provider's start then failed
/// (its plugin could not be reached): the report is not kept, and the next start finds those
/// changes already made.
fn log_report_of_failed_start(plugin: &str, report: &RecoveryReport) {
    for (path, aside, reason) in &report.corrupt {
        tracing::warn!(%plugin, path = %path.display(), aside = %aside.display(), %reason,
            "start failed after recovery set this corrupt volume state aside");
    }
    for action in &report.actions {
        tracing::warn!(%plugin, %action, "start failed after recovery made this change");
    }
}

/// Records a volume's checkpoint in `journal`, durably, in the caller's thread: what
/// [`StorageProvider::persist`] does from code already off the async workers (recovery's load).
pub(crate) fn persist_to(
    journal: &checkpoint::VolumeJournal,
    rec: &VolumeRecord,
) -> Result<(), ProviderError> {
    let bytes = serde_json::to_vec_pretty(rec).expect("a volume record always serializes");
    journal
        .record(&rec.volume_id, Some(bytes), Commit::Durable)
        .map_err(|source| ProviderError::Checkpoint {
            volume: rec.volume_id.clone(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caps_with_controller_service(yes: bool) -> Capabilities {
        use crate::csi::proto::{plugin_capability, PluginCapability};
        let services: &[crate::csi::PluginService] = if yes {
            &[crate::csi::PluginService::ControllerService]
        } else {
            &[]
        };
        let proto: Vec<PluginCapability> = services
            .iter()
            .map(|t| PluginCapability {
                r#type: Some(plugin_capability::Type::Service(
                    plugin_capability::Service { r#type: *t as i32 },
                )),
            })
            .collect();
        Capabilities {
            plugin: crate::csi::PluginCapabilities::from_proto(&proto),
            ..Capabilities::default()
        }
    }

    #[test]
    fn a_controller_apart_must_be_the_node_plugins_driver_with_the_controller_service() {
        let node = "unix:///run/node.sock";
        let with = caps_with_controller_service(true);
        let without = caps_with_controller_service(false);
        assert_eq!(
            check_controller("d.example", &with, node, "d.example"),
            Ok(())
        );

        let other = check_controller("other.example", &with, node, "d.example").unwrap_err();
        for part in [
            "'other.example'",
            "'d.example'",
            node,
            "--controller-endpoint",
        ] {
            assert!(other.contains(part), "{other}");
        }

        let no_service = check_controller("d.example", &without, node, "d.example").unwrap_err();
        assert!(no_service.contains("CONTROLLER_SERVICE"), "{no_service}");
        assert!(no_service.contains("'d.example'"), "{no_service}");

        // A hostile name is shown inert.
        let hostile = check_controller("evil\n\x1b[2J", &with, node, "d.example").unwrap_err();
        assert!(
            !hostile.contains('\n') && !hostile.contains('\x1b'),
            "{hostile}"
        );
    }

    #[test]
    fn the_node_client_drives_only_the_node_service_when_the_controller_is_apart() {
        let mut config = ProviderConfig::new(
            "t",
            "n",
            "/w",
            PluginSource::Endpoint("unix:///n.sock".into()),
        );
        assert_eq!(node_services(&config), Services::Both);
        config.controller_endpoint = Some("unix:///c.sock".into());
        assert_eq!(node_services(&config), Services::Node);
    }

    #[test]
    fn a_published_target_must_be_of_the_volumes_kind() {
        use std::os::unix::fs::FileTypeExt;
        let dir = std::fs::symlink_metadata("/").unwrap();
        let file = std::fs::symlink_metadata("/proc/self/status").unwrap();
        let chr = std::fs::symlink_metadata("/dev/null").unwrap();
        let blk = std::fs::read_dir("/dev")
            .unwrap()
            .filter_map(|e| e.ok()?.path().symlink_metadata().ok())
            .find(|m| m.file_type().is_block_device());
        let link = std::fs::symlink_metadata("/proc/self/exe").unwrap();
        use AccessType::{Block, Mount};
        let cases: Vec<(AccessType, Option<&std::fs::Metadata>, bool)> = vec![
            (Mount, Some(&dir), true),
            (Mount, Some(&file), false),
            (Mount, Some(&chr), false),
            (Mount, Some(&link), false),
            (Mount, None, false),
            (Block, Some(&dir), false),
            (Block, Some(&file), false),
            (Block, Some(&chr), false),
            (Block, Some(&link), false),
            (Block, None, false),
        ];
        for (access, found, fine) in cases {
            assert_eq!(
                target_mismatch(access, found).is_none(),
                fine,
                "{access:?} {found:?}"
            );
        }
        if let Some(blk) = blk {
            assert_eq!(target_mismatch(Block, Some(&blk)), None);
            assert!(target_mismatch(Mount, Some(&blk)).is_some());
        }
    }
}
