//! The floor: the CSI RPCs a publish needs, issued back to back by the
//! generated tonic clients (no retries, no metrics, no checkpoints) straight
//! to a `csi-test-plugin` started with the same arguments the provider gives
//! its managed plugin, plus one fsync of a small file on the work dir's file
//! system: the least a crash-safe publish can spend.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use csi_isolator::csi::proto;
use csi_isolator::csi::transport::endpoint_for;
use csi_isolator::provider::Capability;
use csi_isolator_testing::{raw_clients, RawClients, Sandbox};

/// A volume of the floor plugin, with its own staging and target paths.
#[derive(Clone, Debug)]
pub struct FloorVolume {
    id: String,
    context: HashMap<String, String>,
    staging: PathBuf,
    target: PathBuf,
    publish_context: HashMap<String, String>,
}

/// The floor plugin process and the raw clients on its socket.
#[derive(Debug)]
pub struct Floor {
    child: Child,
    dir: PathBuf,
    clients: RawClients,
    node_id: String,
    capability: proto::VolumeCapability,
    sync_file: File,
    created: usize,
}

impl Floor {
    /// Starts `bin` under `dir` (socket `dir/csi.sock`, data `dir/data`,
    /// log `dir/plugin.log`) and waits until it answers Probe.
    pub async fn start(bin: &Path, dir: &Path, sandbox: &Sandbox) -> Result<Floor> {
        std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
        let socket = dir.join("csi.sock");
        let log = File::create(dir.join("plugin.log")).context("create floor plugin log")?;
        let mut cmd = Command::new(bin);
        cmd.arg("--endpoint")
            .arg(endpoint_for(&socket))
            .arg("--work-dir")
            .arg(dir.join("data"))
            .arg(format!("--backing={}", crate::BACKING))
            .stdin(Stdio::null())
            .stdout(log.try_clone().context("dup floor plugin log")?)
            .stderr(log);
        // SAFETY: the closure runs in the forked child before exec and only calls prctl(2),
        // which is async-signal-safe; it allocates nothing and takes no lock.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd
            .spawn()
            .with_context(|| format!("spawn floor plugin {}", bin.display()))?;
        sandbox.track(child.id());
        let deadline = Instant::now() + Duration::from_secs(15);
        let clients = loop {
            if let Some(status) = child.try_wait().context("wait for floor plugin")? {
                bail!(
                    "floor plugin exited before it was ready ({status}); see {}",
                    dir.join("plugin.log").display()
                );
            }
            if let Ok(mut c) = raw_clients(&socket).await {
                if let Ok(r) = c.identity.probe(proto::ProbeRequest {}).await {
                    if r.get_ref().ready != Some(false) {
                        break c;
                    }
                }
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                bail!("floor plugin not ready after 15 s");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let node_id = clients
            .node
            .clone()
            .node_get_info(proto::NodeGetInfoRequest {})
            .await
            .context("NodeGetInfo (floor)")?
            .into_inner()
            .node_id;
        let sync_path = dir.join("fsync-probe");
        let sync_file = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&sync_path)
            .with_context(|| format!("create {}", sync_path.display()))?;
        Ok(Floor {
            child,
            dir: dir.to_path_buf(),
            clients,
            node_id,
            capability: Capability::default().to_proto(),
            sync_file,
            created: 0,
        })
    }

    /// The plugin's pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// CreateVolume (not timed) and the directories a CO makes before
    /// staging and publishing (the staging dir and the target's parent).
    pub async fn create(&mut self, name: &str, capacity: u64) -> Result<FloorVolume> {
        let resp = self
            .clients
            .controller
            .clone()
            .create_volume(proto::CreateVolumeRequest {
                name: name.to_string(),
                capacity_range: Some(proto::CapacityRange {
                    required_bytes: capacity as i64,
                    limit_bytes: 0,
                }),
                volume_capabilities: vec![self.capability.clone()],
                ..Default::default()
            })
            .await
            .with_context(|| format!("CreateVolume {name} (floor)"))?
            .into_inner();
        let volume = resp.volume.context("CreateVolume answered no volume")?;
        self.created += 1;
        let base = self.dir.join("mounts").join(self.created.to_string());
        let staging = base.join("staging");
        std::fs::create_dir_all(&staging)
            .with_context(|| format!("create {}", staging.display()))?;
        Ok(FloorVolume {
            id: volume.volume_id,
            context: volume.volume_context,
            staging,
            target: base.join("target"),
            publish_context: HashMap::new(),
        })
    }

    /// One write of 200 bytes and its fsync.
    fn sync_once(&self) -> Result<()> {
        self.sync_file
            .write_all_at(&[0x5a; 200], 0)
            .context("write fsync probe")?;
        self.sync_file.sync_all().context("fsync probe")
    }

    async fn controller_publish(&self, vol: &mut FloorVolume) -> Result<()> {
        let resp = self
            .clients
            .controller
            .clone()
            .controller_publish_volume(proto::ControllerPublishVolumeRequest {
                volume_id: vol.id.clone(),
                node_id: self.node_id.clone(),
                volume_capability: Some(self.capability.clone()),
                readonly: false,
                volume_context: vol.context.clone(),
                ..Default::default()
            })
            .await
            .context("ControllerPublishVolume (floor)")?;
        vol.publish_context = resp.into_inner().publish_context;
        Ok(())
    }

    async fn node_stage(&self, vol: &FloorVolume) -> Result<()> {
        self.clients
            .node
            .clone()
            .node_stage_volume(proto::NodeStageVolumeRequest {
                volume_id: vol.id.clone(),
                publish_context: vol.publish_context.clone(),
                staging_target_path: vol.staging.to_string_lossy().into_owned(),
                volume_capability: Some(self.capability.clone()),
                volume_context: vol.context.clone(),
                ..Default::default()
            })
            .await
            .context("NodeStageVolume (floor)")?;
        Ok(())
    }

    async fn node_publish(&self, vol: &FloorVolume) -> Result<()> {
        self.clients
            .node
            .clone()
            .node_publish_volume(proto::NodePublishVolumeRequest {
                volume_id: vol.id.clone(),
                publish_context: vol.publish_context.clone(),
                staging_target_path: vol.staging.to_string_lossy().into_owned(),
                target_path: vol.target.to_string_lossy().into_owned(),
                volume_capability: Some(self.capability.clone()),
                readonly: false,
                volume_context: vol.context.clone(),
                ..Default::default()
            })
            .await
            .context("NodePublishVolume (floor)")?;
        Ok(())
    }

    async fn node_unpublish(&self, vol: &FloorVolume) -> Result<()> {
        self.clients
            .node
            .clone()
            .node_unpublish_volume(proto::NodeUnpublishVolumeRequest {
                volume_id: vol.id.clone(),
                target_path: vol.target.to_string_lossy().into_owned(),
            })
            .await
            .context("NodeUnpublishVolume (floor)")?;
        Ok(())
    }

    async fn node_unstage(&self, vol: &FloorVolume) -> Result<()> {
        self.clients
            .node
            .clone()
            .node_unstage_volume(proto::NodeUnstageVolumeRequest {
                volume_id: vol.id.clone(),
                staging_target_path: vol.staging.to_string_lossy().into_owned(),
            })
            .await
            .context("NodeUnstageVolume (floor)")?;
        Ok(())
    }

    async fn controller_unpublish(&self, vol: &FloorVolume) -> Result<()> {
        self.clients
            .controller
            .clone()
            .controller_unpublish_volume(proto::ControllerUnpublishVolumeRequest {
                volume_id: vol.id.clone(),
                node_id: self.node_id.clone(),
                ..Default::default()
            })
            .await
            .context("ControllerUnpublishVolume (floor)")?;
        Ok(())
    }

    /// Floor cold: ControllerPublish + NodeStage + NodePublish + 1 fsync,
    /// timed; then the three unpublish RPCs, not timed.
    pub async fn cold(&self, vol: &mut FloorVolume) -> Result<Duration> {
        std::fs::create_dir_all(&vol.staging)
            .with_context(|| format!("create {}", vol.staging.display()))?;
        let t0 = Instant::now();
        self.controller_publish(vol).await?;
        self.node_stage(vol).await?;
        self.node_publish(vol).await?;
        self.sync_once()?;
        let took = t0.elapsed();
        self.node_unpublish(vol).await?;
        self.node_unstage(vol).await?;
        self.controller_unpublish(vol).await?;
        Ok(took)
    }

    /// Brings a volume to staged (VOL_READY), for the warm floor.
    pub async fn stage(&self, vol: &mut FloorVolume) -> Result<()> {
        self.controller_publish(vol).await?;
        self.node_stage(vol).await
    }

    /// Floor warm: NodePublish + 1 fsync on a staged volume, timed; then
    /// NodeUnpublish, not timed.
    pub async fn warm(&self, vol: &FloorVolume) -> Result<Duration> {
        let t0 = Instant::now();
        self.node_publish(vol).await?;
        self.sync_once()?;
        let took = t0.elapsed();
        self.node_unpublish(vol).await?;
        Ok(took)
    }

    /// Takes a staged volume back down (NodeUnstage, ControllerUnpublish).
    pub async fn unstage(&self, vol: &FloorVolume) -> Result<()> {
        self.node_unstage(vol).await?;
        self.controller_unpublish(vol).await
    }

    /// Stops the plugin (SIGTERM, then SIGKILL after 2 s) and reaps it.
    pub async fn stop(mut self) {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(2);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Floor {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
