//! `csi-isolator serve` killed (SIGKILL, by the crash-point hook
//! `CSI_ISOLATOR_CRASH_AFTER_WRITE=N`) at every crash point of a launch
//! (Prepare + Isolate; and PrepareOci + Isolate, the volumes bound on the
//! host into the sandbox), an update that adds a volume, an update that removes
//! one, a cleanup and a volume destroy. For each operation and each N: the
//! preconditions are set up on a serve without the hook (volumes created,
//! containers running in their own mount namespaces, each having written a
//! marker into its read-write volumes), that serve is stopped, a serve armed
//! with N runs the operation and dies, a fresh serve is started and the
//! containerizer calls Recover with the containers that still run. Then:
//! - Status reports no disagreement and no unreadable checkpoint; the plugin
//!   (asked over CSI) agrees with every volume's state;
//! - a volume is used exactly by the live containers whose records mount it,
//!   published (and mounted) iff it is used (last-use policy);
//! - nothing is mounted under the sandbox but the targets and staging paths
//!   of published volumes; a live container's namespace has exactly its
//!   recorded volumes under its sandbox, readable and writable, the same
//!   file system as the host's mount point;
//! - every marker a container wrote is still there.
//!
//! Finally everything is cleaned up (Cleanup, DestroyVolume, the containers
//! killed) and nothing is left mounted or running. The loop over N ends when
//! the operation completes without crashing; the number of crash points
//! survived is printed per operation.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::future::Future;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use csi_isolator::csi::proto as csi;
use csi_isolator::csi::transport::connect_unix;
use csi_isolator::launcher::{self, LaunchSpec, Launched};
use csi_isolator::mount::VolumeMount;
use csi_isolator::mount::{MountTable, ProcMountTable};
use csi_isolator::provider::bundled::BUNDLED_TYPE;
use csi_isolator::provider::checkpoint::CRASH_AFTER_WRITE_ENV;
use csi_isolator::resource::Layout;
use csi_isolator::service::proto::isolator_client::IsolatorClient;
use csi_isolator::service::proto::{
    self, CleanupRequest, ContainerConfig, CreateVolumeRequest, DestroyVolumeRequest,
    IsolateRequest, PrepareRequest, RecoverRequest, StatusRequest, UpdateRequest,
};
use csi_isolator_testing::{
    processes_mentioning, raw_clients, require_root, wait_for_serve_ready, Sandbox,
};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tonic::transport::Channel;

const BIN: &str = env!("CARGO_BIN_EXE_csi-isolator");
const MIB: u64 = 1024 * 1024;
const TIMEOUT: Duration = Duration::from_secs(30);
/// Guards the loop over N against an operation that never completes.
const MAX_POINTS: u32 = 60;

type Client = IsolatorClient<Channel>;

/// Runs one RPC with a deadline (a hung service fails the test instead of
/// hanging it).
async fn rpc<T>(
    what: &str,
    call: impl Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> Result<T, tonic::Status> {
    match tokio::time::timeout(TIMEOUT, call).await {
        Ok(r) => r.map(tonic::Response::into_inner),
        Err(_) => panic!("{what}: no answer within {TIMEOUT:?}"),
    }
}

/// Waits for `child` to exit (bounded) and returns its status.
fn wait_exit(child: &mut Child) -> ExitStatus {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        assert!(
            Instant::now() < deadline,
            "process {} did not exit within {TIMEOUT:?}",
            child.id()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// `<sandbox>` as seen through the container's root (its mount namespace).
fn inside(pid: u32, sandbox: &Path) -> PathBuf {
    PathBuf::from(format!("/proc/{pid}/root")).join(sandbox.strip_prefix("/").unwrap())
}

/// A running `csi-isolator serve`; killed if still running when dropped.
struct Serve {
    child: Child,
    socket: PathBuf,
}

impl Serve {
    async fn client(&self) -> Client {
        IsolatorClient::new(
            connect_unix(&self.socket)
                .await
                .expect("connect to the service socket"),
        )
    }

    /// SIGTERM, then waits for the exit.
    fn terminate(&mut self, sb: &Sandbox) -> ExitStatus {
        kill(Pid::from_raw(self.child.id() as i32), Signal::SIGTERM).unwrap();
        self.wait(sb)
    }

    /// Waits for the exit (bounded).
    fn wait(&mut self, sb: &Sandbox) -> ExitStatus {
        let status = wait_exit(&mut self.child);
        sb.untrack(self.child.id());
        status
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A container: a process in its own mount namespace, started by the
/// crate's launcher with the mounts Prepare returned.
struct Container {
    sandbox: PathBuf,
    launched: Launched,
    /// Prepared with PrepareOci: its volumes are bound on the host into its sandbox (the
    /// runtime's binds), not by the launcher in its namespace.
    oci: bool,
}

#[derive(Clone, Copy, Debug)]
enum Op {
    /// Prepare c1 with volumes a (new) and b (already used by c0), launch
    /// it, write markers, Isolate.
    Launch,
    /// The same through PrepareOci: the volumes bound on the host into c1's
    /// sandbox, the container seeing them there as a runtime's binds.
    LaunchOci,
    /// Update c1 from [a] to [a, b].
    UpdateAdd,
    /// Update c1 from [a, b] to [b].
    UpdateRemove,
    /// Cleanup of the exited c1 ([a, b]) while c2 ([b]) runs on.
    Cleanup,
    /// DestroyVolume of the unused a (it holds data) while c1 ([b]) runs.
    Destroy,
}

impl Op {
    fn label(self) -> &'static str {
        match self {
            Op::Launch => "launch",
            Op::LaunchOci => "launch-oci",
            Op::UpdateAdd => "update-add",
            Op::UpdateRemove => "update-remove",
            Op::Cleanup => "cleanup",
            Op::Destroy => "destroy",
        }
    }
}

/// One crash scenario's world: the sandbox, the volumes, the containers,
/// and what the containers wrote.
struct World {
    serve: Option<Serve>,
    containers: BTreeMap<String, Container>,
    /// Containers the containerizer knows that have exited (not cleaned up yet).
    exited: BTreeSet<String>,
    /// Volume name -> its CreateVolume answer.
    volumes: BTreeMap<String, proto::CreateVolumeResponse>,
    /// Volumes whose destroy was attempted: they may be gone.
    destroying: BTreeSet<String>,
    /// (volume name, file, content) written by containers.
    markers: Vec<(String, String, String)>,
    serves: u32,
    label: String,
    work: PathBuf,
    sb: Sandbox,
}

impl Drop for World {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for k in 1..=self.serves {
                let log = self.sb.join(format!("serve-{k}.log"));
                let text = std::fs::read_to_string(&log).unwrap_or_default();
                let lines: Vec<&str> = text.lines().collect();
                let tail = &lines[lines.len().saturating_sub(40)..];
                eprintln!("--- {} (last 40 lines)\n{}", log.display(), tail.join("\n"));
            }
        }
    }
}

impl World {
    fn new(op: Op, n: u32) -> World {
        let sb = Sandbox::new("serve-crash");
        World {
            serve: None,
            containers: BTreeMap::new(),
            exited: BTreeSet::new(),
            volumes: BTreeMap::new(),
            destroying: BTreeSet::new(),
            markers: Vec::new(),
            serves: 0,
            label: format!("{} at crash point {n}", op.label()),
            work: sb.join("work"),
            sb,
        }
    }

    /// Starts serve (armed with `crash_after` if set) and waits for `ready`.
    fn start_serve(&mut self, crash_after: Option<u32>) {
        assert!(self.serve.is_none(), "one serve at a time");
        self.serves += 1;
        let log = File::options()
            .create(true)
            .append(true)
            .open(self.sb.join(format!("serve-{}.log", self.serves)))
            .unwrap();
        let socket = self.sb.join("isolator.sock");
        let mut cmd = Command::new(BIN);
        // Managed plugin sockets stay inside the sandbox.
        cmd.env("CSI_ISOLATOR_SOCKET_DIR", self.sb.join("s"))
            .env_remove(CRASH_AFTER_WRITE_ENV)
            .arg("--work-dir")
            .arg(&self.work)
            .arg("serve")
            .arg("--socket")
            .arg(&socket)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log);
        if let Some(n) = crash_after {
            cmd.env(CRASH_AFTER_WRITE_ENV, n.to_string());
        }
        let mut child = self.sb.spawn(&mut cmd).expect("spawn csi-isolator serve");
        wait_for_serve_ready(&mut child, TIMEOUT);
        self.serve = Some(Serve { child, socket });
    }

    async fn client(&self) -> Client {
        self.serve.as_ref().expect("serve runs").client().await
    }

    /// Stops serve with SIGTERM; it must exit cleanly.
    fn stop_serve(&mut self) {
        let mut serve = self.serve.take().expect("serve runs");
        let status = serve.terminate(&self.sb);
        assert!(
            status.success(),
            "{}: serve exited with {status:?}",
            self.label
        );
        self.wait_plugin_gone();
    }

    /// The managed plugin dies with serve (parent-death signal); waits until
    /// no process mentions the work dir any more.
    fn wait_plugin_gone(&self) {
        let deadline = Instant::now() + TIMEOUT;
        loop {
            let left = processes_mentioning(&self.work);
            if left.is_empty() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{}: processes still running on the work dir: {left:?}",
                self.label
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn known(&self) -> Vec<String> {
        self.containers
            .keys()
            .chain(&self.exited)
            .cloned()
            .collect()
    }

    fn live(&self) -> Vec<String> {
        self.containers.keys().cloned().collect()
    }

    fn name_of(&self, volume_id: &str) -> String {
        self.volumes
            .iter()
            .find(|(_, v)| v.volume_id == volume_id)
            .map(|(n, _)| n.clone())
            .unwrap_or_else(|| panic!("{}: unknown volume {volume_id}", self.label))
    }

    fn resources(&self, names: &[&str]) -> String {
        let items: Vec<&str> = names
            .iter()
            .map(|n| self.volumes[*n].resource_json.as_str())
            .collect();
        format!("[{}]", items.join(","))
    }

    async fn recover(&self, c: &mut Client, known: Vec<String>) -> proto::RecoverResponse {
        let r = rpc(
            "Recover",
            c.recover(RecoverRequest {
                known_container_ids: known,
            }),
        )
        .await
        .unwrap_or_else(|s| panic!("{}: Recover: {s}", self.label));
        assert!(r.corrupt.is_empty(), "{}: {r:?}", self.label);
        r
    }

    async fn create(&mut self, c: &mut Client, name: &str) {
        let v = rpc(
            "CreateVolume",
            c.create_volume(CreateVolumeRequest {
                name: name.into(),
                capacity_bytes: 16 * MIB,
                container_path: name.into(),
                ..Default::default()
            }),
        )
        .await
        .unwrap_or_else(|s| panic!("{}: CreateVolume {name}: {s}", self.label));
        self.volumes.insert(name.to_string(), v);
    }

    /// Prepare (PrepareOci if `oci`), launch, write a marker into every read-write volume,
    /// Isolate. An error names the call that failed; the container counts
    /// as running from its launch on.
    async fn start_container(
        &mut self,
        c: &mut Client,
        id: &str,
        volumes: &[&str],
    ) -> Result<(), String> {
        self.start(c, id, volumes, false).await
    }

    async fn start(
        &mut self,
        c: &mut Client,
        id: &str,
        volumes: &[&str],
        oci: bool,
    ) -> Result<(), String> {
        let sandbox = self.sb.mkdir(format!("sandboxes/{id}"));
        let request = PrepareRequest {
            container_id: id.into(),
            config: Some(ContainerConfig {
                resources_json: self.resources(volumes),
                sandbox: sandbox.to_string_lossy().into(),
                ..Default::default()
            }),
        };
        let (records, mounts) = if oci {
            let info = rpc("PrepareOci", c.prepare_oci(request))
                .await
                .map_err(|s| format!("PrepareOci {id}: {s}"))?;
            assert_eq!(info.mounts.len(), volumes.len(), "{}: {info:?}", self.label);
            // The runtime's binds are already in the sandbox on the host: the container's new
            // namespace, a copy of the host's, has them.
            let records: Vec<(String, bool)> = volumes
                .iter()
                .zip(&info.mounts)
                .map(|(name, m)| {
                    assert_eq!(Path::new(&m.source), sandbox.join(name), "{}", self.label);
                    (name.to_string(), m.options.iter().any(|o| o == "ro"))
                })
                .collect();
            (records, Vec::new())
        } else {
            let info = rpc("Prepare", c.prepare(request))
                .await
                .map_err(|s| format!("Prepare {id}: {s}"))?;
            assert_eq!(info.mounts.len(), volumes.len(), "{}: {info:?}", self.label);
            let records = info
                .mounts
                .iter()
                .map(|m| (m.target.clone(), m.readonly))
                .collect();
            let mounts: Vec<VolumeMount> = info
                .mounts
                .iter()
                .cloned()
                .map(|m| VolumeMount::try_from(m).unwrap())
                .collect();
            (records, mounts)
        };
        let spec = LaunchSpec {
            argv: vec!["sleep".into(), "1000".into()],
            sandbox: sandbox.clone(),
            mounts,
            ..Default::default()
        };
        let launched = tokio::task::block_in_place(|| {
            launcher::launch(&csi_isolator::mount::LinuxSyscall::new(), &spec)
        })
        .unwrap_or_else(|e| panic!("{}: launch {id}: {e}", self.label));
        let pid = launched.pid();
        self.sb.track(pid);
        for (target, readonly) in &records {
            if *readonly {
                continue;
            }
            // Volumes are created with their name as the container path.
            let name = target.clone();
            let file = format!("{id}.marker");
            let content = format!("{id} wrote this into {name}");
            std::fs::write(inside(pid, &sandbox).join(target).join(&file), &content)
                .unwrap_or_else(|e| panic!("{}: {id} writes into {name}: {e}", self.label));
            self.markers.push((name, file, content));
        }
        self.containers.insert(
            id.to_string(),
            Container {
                sandbox,
                launched,
                oci,
            },
        );
        rpc(
            "Isolate",
            c.isolate(IsolateRequest {
                container_id: id.into(),
                pid,
            }),
        )
        .await
        .map_err(|s| format!("Isolate {id}: {s}"))?;
        Ok(())
    }

    /// Kills a container and reaps it.
    async fn stop_container(&mut self, id: &str) {
        let mut ctr = self.containers.remove(id).expect("a running container");
        ctr.launched.kill(Signal::SIGKILL).unwrap();
        tokio::time::timeout(TIMEOUT, ctr.launched.wait_async())
            .await
            .expect("the container exits")
            .unwrap();
        self.sb.untrack(ctr.launched.pid());
        self.exited.insert(id.to_string());
    }

    /// The preconditions of `op` (on a serve without the crash hook).
    async fn set_up(&mut self, op: Op, c: &mut Client) {
        let label = self.label.clone();
        self.recover(c, Vec::new()).await;
        self.create(c, "a").await;
        self.create(c, "b").await;
        let must = |r: Result<(), String>| r.unwrap_or_else(|e| panic!("{label}: set-up: {e}"));
        match op {
            Op::Launch | Op::LaunchOci => must(self.start_container(c, "c0", &["b"]).await),
            Op::UpdateAdd => must(self.start_container(c, "c1", &["a"]).await),
            Op::UpdateRemove => must(self.start_container(c, "c1", &["a", "b"]).await),
            Op::Cleanup => {
                must(self.start_container(c, "c1", &["a", "b"]).await);
                must(self.start_container(c, "c2", &["b"]).await);
                self.stop_container("c1").await;
            }
            Op::Destroy => {
                // a gets data, then is released (last use: unpublished).
                must(self.start_container(c, "c0", &["a"]).await);
                self.stop_container("c0").await;
                rpc(
                    "Cleanup",
                    c.cleanup(CleanupRequest {
                        container_id: "c0".into(),
                    }),
                )
                .await
                .unwrap_or_else(|s| panic!("{label}: Cleanup c0: {s}"));
                self.exited.remove("c0");
                must(self.start_container(c, "c1", &["b"]).await);
            }
        }
    }

    /// The operation under test; an error names the call that failed.
    async fn operate(&mut self, op: Op, c: &mut Client) -> Result<(), String> {
        match op {
            Op::Launch => self.start_container(c, "c1", &["a", "b"]).await,
            Op::LaunchOci => self.start(c, "c1", &["a", "b"], true).await,
            Op::UpdateAdd | Op::UpdateRemove => {
                let to: &[&str] = if matches!(op, Op::UpdateAdd) {
                    &["a", "b"]
                } else {
                    &["b"]
                };
                let resources_json = self.resources(to);
                rpc(
                    "Update",
                    c.update(UpdateRequest {
                        container_id: "c1".into(),
                        resources_json,
                    }),
                )
                .await
                .map(|_| ())
                .map_err(|s| format!("Update c1: {s}"))
            }
            Op::Cleanup => {
                rpc(
                    "Cleanup",
                    c.cleanup(CleanupRequest {
                        container_id: "c1".into(),
                    }),
                )
                .await
                .map_err(|s| format!("Cleanup c1: {s}"))?;
                self.exited.remove("c1");
                Ok(())
            }
            Op::Destroy => {
                self.destroying.insert("a".into());
                let v = &self.volumes["a"];
                rpc(
                    "DestroyVolume",
                    c.destroy_volume(DestroyVolumeRequest {
                        volume_id: v.volume_id.clone(),
                        provider_id: v.provider_id.clone(),
                        ..Default::default()
                    }),
                )
                .await
                .map_err(|s| format!("DestroyVolume a: {s}"))?;
                self.volumes.remove("a");
                self.markers.retain(|(v, _, _)| v != "a");
                Ok(())
            }
        }
    }

    /// Checks every invariant (see the module doc) on the running serve.
    async fn check(&mut self, c: &mut Client) {
        let label = self.label.clone();
        let st = rpc("Status", c.status(StatusRequest {}))
            .await
            .unwrap_or_else(|s| panic!("{label}: Status: {s}"));
        assert!(st.unreadable.is_empty(), "{label}: {:?}", st.unreadable);
        for v in &st.volumes {
            assert_eq!(v.disagreement, "", "{label}: {v:?}");
        }

        // The volumes: those created, less destroyed ones; nothing else.
        let present: BTreeSet<String> = st.volumes.iter().map(|v| v.volume_id.clone()).collect();
        for name in self.destroying.clone() {
            let gone = self
                .volumes
                .get(&name)
                .is_some_and(|v| !present.contains(&v.volume_id));
            if gone {
                self.volumes.remove(&name);
                self.markers.retain(|(v, _, _)| *v != name);
            }
        }
        let expected: BTreeSet<String> =
            self.volumes.values().map(|v| v.volume_id.clone()).collect();
        assert_eq!(present, expected, "{label}: volumes");

        // The containers: exactly the live ones, with their pids.
        let records: BTreeMap<String, &proto::ContainerStatus> = st
            .containers
            .iter()
            .map(|r| (r.container_id.clone(), r))
            .collect();
        assert_eq!(
            records.keys().cloned().collect::<Vec<_>>(),
            self.live(),
            "{label}: containers"
        );

        // Users: exactly the live containers that mount the volume; published
        // and mounted iff used (last-use policy).
        for v in &st.volumes {
            let mounting: BTreeSet<String> = st
                .containers
                .iter()
                .filter(|r| r.mounts.iter().any(|m| m.volume_id == v.volume_id))
                .map(|r| r.container_id.clone())
                .collect();
            let users: BTreeSet<String> = v.users.iter().cloned().collect();
            let name = self.name_of(&v.volume_id);
            assert_eq!(users, mounting, "{label}: users of {name}: {v:?}");
            if users.is_empty() {
                assert_eq!(
                    (v.state.as_str(), v.mounted),
                    ("CREATED", false),
                    "{label}: {name}"
                );
            } else {
                assert_eq!(
                    (v.state.as_str(), v.mounted),
                    ("PUBLISHED", true),
                    "{label}: {name}"
                );
            }
        }

        // The plugin agrees: the same volumes, controller- and
        // node-published iff PUBLISHED.
        let socket =
            Layout::new(&self.work, BUNDLED_TYPE, "default").plugin_socket(&self.sb.join("s"));
        let mut raw = raw_clients(&socket)
            .await
            .unwrap_or_else(|e| panic!("{label}: connect to the plugin: {e}"));
        let listed = rpc(
            "ListVolumes",
            raw.controller
                .list_volumes(csi::ListVolumesRequest::default()),
        )
        .await
        .unwrap();
        let in_plugin: BTreeSet<String> = listed
            .entries
            .iter()
            .filter_map(|e| e.volume.as_ref().map(|v| v.volume_id.clone()))
            .collect();
        assert_eq!(in_plugin, present, "{label}: the plugin's volumes");
        for v in &st.volumes {
            let published = v.state == "PUBLISHED";
            let controller = listed
                .entries
                .iter()
                .find(|e| {
                    e.volume
                        .as_ref()
                        .is_some_and(|x| x.volume_id == v.volume_id)
                })
                .and_then(|e| e.status.as_ref())
                .is_some_and(|s| !s.published_node_ids.is_empty());
            let node = rpc(
                "NodeGetVolumeStats",
                raw.node
                    .node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
                        volume_id: v.volume_id.clone(),
                        volume_path: v.mount_point.clone(),
                        ..Default::default()
                    }),
            )
            .await;
            // NOT_FOUND is the plugin's "not published there"; anything else is a broken plugin.
            let node = match node {
                Ok(_) => true,
                Err(s) if s.code() == tonic::Code::NotFound => false,
                Err(s) => panic!("{label}: NodeGetVolumeStats of {}: {s}", v.volume_id),
            };
            let name = self.name_of(&v.volume_id);
            assert_eq!(
                (controller, node),
                (published, published),
                "{label}: the plugin's view of {name} ({})",
                v.state
            );
        }

        // The host: nothing mounted under the sandbox but the targets and
        // staging paths of published volumes, and the binds of live OCI containers.
        let mut allowed = BTreeSet::new();
        for (id, ctr) in self.containers.iter().filter(|(_, c)| c.oci) {
            for m in &records[id].mounts {
                allowed.insert(ctr.sandbox.join(&m.target));
            }
        }
        for v in st.volumes.iter().filter(|v| v.state == "PUBLISHED") {
            let target = PathBuf::from(&v.mount_point);
            allowed.insert(target.parent().unwrap().join("staging"));
            allowed.insert(target);
        }
        let host: BTreeSet<PathBuf> = ProcMountTable::new()
            .mounts_under(self.sb.path())
            .unwrap()
            .into_iter()
            .map(|m| m.mount_point)
            .collect();
        assert_eq!(host, allowed, "{label}: host mounts under the sandbox");

        // Each live container: exactly its recorded volumes under its
        // sandbox, readable and writable, the host's file system.
        for (id, ctr) in &self.containers {
            let rec = records[id];
            let pid = ctr.launched.pid();
            assert_eq!(rec.pid, pid, "{label}: pid of {id}");
            let in_ns: BTreeSet<PathBuf> = ProcMountTable::for_pid(pid)
                .mounts_under(&ctr.sandbox)
                .unwrap()
                .into_iter()
                .map(|m| m.mount_point)
                .collect();
            let want: BTreeSet<PathBuf> = rec
                .mounts
                .iter()
                .map(|m| ctr.sandbox.join(&m.target))
                .collect();
            assert_eq!(in_ns, want, "{label}: mounts in {id}'s namespace");
            for m in &rec.mounts {
                let name = self.name_of(&m.volume_id);
                let dir = inside(pid, &ctr.sandbox).join(&m.target);
                let probe = format!("{id}.probe");
                std::fs::write(dir.join(&probe), &label)
                    .unwrap_or_else(|e| panic!("{label}: {id} writes into {name}: {e}"));
                assert_eq!(
                    std::fs::read_to_string(Path::new(&m.source).join(&probe)).ok(),
                    Some(label.clone()),
                    "{label}: {id}'s {name} is the host's"
                );
                std::fs::remove_file(dir.join(&probe)).unwrap();
                for (_, file, content) in self.markers.iter().filter(|(v, _, _)| *v == name) {
                    assert_eq!(
                        std::fs::read_to_string(dir.join(file)).ok().as_ref(),
                        Some(content),
                        "{label}: {file} in {name}, seen by {id}"
                    );
                }
            }
        }
    }

    /// Reads every marker back (through a Prepare that publishes every
    /// volume), then cleans everything up and checks nothing is left.
    async fn tear_down(&mut self, c: &mut Client) {
        let label = self.label.clone();
        let names: Vec<String> = self.volumes.keys().cloned().collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let sandbox = self.sb.mkdir("sandboxes/reader");
        let info = rpc(
            "Prepare",
            c.prepare(PrepareRequest {
                container_id: "reader".into(),
                config: Some(ContainerConfig {
                    resources_json: self.resources(&refs),
                    sandbox: sandbox.to_string_lossy().into(),
                    ..Default::default()
                }),
            }),
        )
        .await
        .unwrap_or_else(|s| panic!("{label}: Prepare reader: {s}"));
        // Every marker's volume is among them, so none goes unread.
        assert_eq!(
            info.mounts.len(),
            names.len(),
            "{label}: the reader got {} mounts for {} volumes",
            info.mounts.len(),
            names.len()
        );
        for m in &info.mounts {
            let name = self.name_of(&m.volume_id);
            for (_, file, content) in self.markers.iter().filter(|(v, _, _)| *v == name) {
                assert_eq!(
                    std::fs::read_to_string(Path::new(&m.source).join(file))
                        .ok()
                        .as_ref(),
                    Some(content),
                    "{label}: data lost: {file} in {name}"
                );
            }
        }
        let mut cleanup = Vec::from(["reader".to_string()]);
        for id in self.live() {
            self.stop_container(&id).await;
        }
        cleanup.extend(std::mem::take(&mut self.exited));
        for id in cleanup {
            rpc(
                "Cleanup",
                c.cleanup(CleanupRequest {
                    container_id: id.clone(),
                }),
            )
            .await
            .unwrap_or_else(|s| panic!("{label}: Cleanup {id}: {s}"));
        }
        for (name, v) in std::mem::take(&mut self.volumes) {
            rpc(
                "DestroyVolume",
                c.destroy_volume(DestroyVolumeRequest {
                    volume_id: v.volume_id.clone(),
                    provider_id: v.provider_id.clone(),
                    ..Default::default()
                }),
            )
            .await
            .unwrap_or_else(|s| panic!("{label}: DestroyVolume {name}: {s}"));
        }
        let st = rpc("Status", c.status(StatusRequest {})).await.unwrap();
        assert!(
            st.volumes.is_empty() && st.containers.is_empty(),
            "{label}: left after cleanup: {st:?}"
        );
        self.stop_serve();
        self.sb.assert_no_mounts_under();
        self.sb.assert_no_loop_devices();
        assert_eq!(
            processes_mentioning(self.sb.path()),
            Vec::<u32>::new(),
            "{label}: processes left"
        );
    }
}

/// One scenario: `op` on a serve that dies at crash point `n`. Returns
/// whether it crashed (false: the operation completed first).
async fn crash_once(op: Op, n: u32) -> bool {
    let mut w = World::new(op, n);
    let label = w.label.clone();

    // 1. The preconditions, on a serve without the crash hook.
    w.start_serve(None);
    let mut c = w.client().await;
    w.set_up(op, &mut c).await;
    drop(c);
    w.stop_serve();

    // 2. The operation, on a serve armed to die at crash point n. The
    //    containerizer recovers first (with every container it knows). Recovery folds the
    //    isolator's journal into its checkpoint files: its crash points (write-back, syncfs,
    //    reset) are crashed at like the operation's, and the next serve must recover from them.
    w.start_serve(Some(n));
    let mut c = w.client().await;
    let recovered = rpc(
        "Recover",
        c.recover(RecoverRequest {
            known_container_ids: w.known(),
        }),
    )
    .await;
    let outcome = match recovered {
        Ok(r) => {
            assert!(r.corrupt.is_empty(), "{label}: {r:?}");
            w.operate(op, &mut c).await
        }
        Err(s) => Err(format!("Recover ({s})")),
    };
    drop(c);
    let mut serve = w.serve.take().unwrap();
    let crashed = match outcome {
        Ok(()) => {
            let status = serve.terminate(&w.sb);
            // The clean stop compacts the provider's journal; a crash at one of its points
            // is a crash like any other: the next serve must recover from it.
            if status.signal() == Some(9) {
                true
            } else {
                assert!(status.success(), "{label}: serve exited with {status:?}");
                false
            }
        }
        Err(call) => {
            let status = serve.wait(&w.sb);
            assert_eq!(
                status.signal(),
                Some(9),
                "{label}: {call} failed without the crash: serve exited with {status:?}"
            );
            true
        }
    };
    drop(serve);
    w.wait_plugin_gone();

    // 3. A new serve; Recover with the containers that still run; check.
    w.start_serve(None);
    let mut c = w.client().await;
    let r = w.recover(&mut c, w.live()).await;
    let recovered: BTreeSet<String> = r.recovered.iter().cloned().collect();
    assert_eq!(
        recovered,
        w.live().into_iter().collect(),
        "{label}: recovered containers"
    );
    w.check(&mut c).await;
    w.tear_down(&mut c).await;
    crashed
}

/// Steps N through every crash point of `op`, prints how many were
/// crashed at (and survived), and fails below `at_least`.
async fn crash_at_every_point(op: Op, at_least: u32) {
    require_root();
    let started = Instant::now();
    let mut n = 1;
    while crash_once(op, n).await {
        n += 1;
        assert!(
            n < MAX_POINTS,
            "{}: the operation never completed",
            op.label()
        );
    }
    let crashed = n - 1;
    eprintln!(
        "serve_crash {}: crash points survived: {crashed} ({:.1?})",
        op.label(),
        started.elapsed()
    );
    assert!(
        crashed >= at_least,
        "{}: only {crashed} crash points, expected at least {at_least}",
        op.label()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn launch_survives_a_crash_at_every_point() {
    // At least: the container's checkpoint, a's first intent, the pid.
    crash_at_every_point(Op::Launch, 3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn launch_through_prepare_oci_survives_a_crash_at_every_point() {
    // At least: the container's checkpoint, a's first intent, the binds' mark, the binds made
    // and not recorded, their record.
    crash_at_every_point(Op::LaunchOci, 5).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn update_adding_a_volume_survives_a_crash_at_every_point() {
    // At least: b's first intent, the container's checkpoint.
    crash_at_every_point(Op::UpdateAdd, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn update_removing_a_volume_survives_a_crash_at_every_point() {
    // At least: the container's checkpoint, a's first unpublish intent.
    crash_at_every_point(Op::UpdateRemove, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleanup_survives_a_crash_at_every_point() {
    // At least: a's first unpublish intent, the checkpoint's removal.
    crash_at_every_point(Op::Cleanup, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn destroy_survives_a_crash_at_every_point() {
    // At least: the destroying mark, the checkpoint's removal.
    crash_at_every_point(Op::Destroy, 2).await;
}
