//! `csi-isolator serve` end to end, as root: the built binary with the
//! bundled plugin, driven over its Unix socket with the generated client,
//! containers started by the namespace launcher, metrics read over HTTP.
//! Every test ends with no mount, no loop device and no process left.

use std::net::SocketAddr;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use csi_isolator::csi::transport::connect_unix;
use csi_isolator::launcher::{self, LaunchSpec, Launched};
use csi_isolator::mount::VolumeMount;
use csi_isolator::mount::{MountTable, ProcMountTable};
use csi_isolator::service::proto::isolator_client::IsolatorClient;
use csi_isolator::service::proto::{
    self, CleanupRequest, ContainerConfig, CreateVolumeRequest, DestroyVolumeRequest,
    IsolateRequest, PrepareRequest, RecoverRequest, StatusRequest, TargetRoot, UpdateRequest,
};
use csi_isolator_testing::{
    exposition, processes_mentioning, require_root, wait_for_serve_ready, Sandbox,
};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::transport::Channel;
use tonic::Code;

const BIN: &str = env!("CARGO_BIN_EXE_csi-isolator");
const MIB: u64 = 1024 * 1024;
const TIMEOUT: Duration = Duration::from_secs(30);
const PLUGIN: &str = "csi-test-plugin.csi-isolator.io/default";

/// A running `csi-isolator serve`; killed (SIGKILL) if still running when dropped.
struct Serve {
    child: Child,
    socket: PathBuf,
    metrics: Option<SocketAddr>,
    lines: Vec<String>,
}

impl Serve {
    /// Starts serve on `work` and waits for its `ready` line.
    fn start(sb: &Sandbox, work: &Path, socket: &Path, metrics_wanted: bool) -> Serve {
        Serve::start_with(sb, work, socket, metrics_wanted, &[])
    }

    /// [`Serve::start`] with more arguments to `serve`.
    fn start_with(
        sb: &Sandbox,
        work: &Path,
        socket: &Path,
        metrics_wanted: bool,
        args: &[&str],
    ) -> Serve {
        let mut cmd = Command::new(BIN);
        // Managed plugin sockets stay inside the sandbox.
        cmd.env("CSI_ISOLATOR_SOCKET_DIR", sb.join("s"));
        cmd.arg("--work-dir")
            .arg(work)
            .arg("serve")
            .arg("--socket")
            .arg(socket);
        if metrics_wanted {
            cmd.args(["--metrics", "127.0.0.1:0"]);
        }
        cmd.args(args);
        let mut child = sb
            .spawn(cmd.stdout(Stdio::piped()).stderr(Stdio::inherit()))
            .expect("spawn csi-isolator serve");
        let lines = wait_for_serve_ready(&mut child, TIMEOUT);
        let metrics = lines.iter().find_map(|l| {
            l.strip_prefix("csi-isolator serve: metrics on http://")
                .and_then(|rest| rest.strip_suffix("/metrics"))
                .map(|addr| addr.parse().expect("metrics address"))
        });
        assert_eq!(
            metrics.is_some(),
            metrics_wanted,
            "metrics line in {lines:?}"
        );
        Serve {
            child,
            socket: socket.to_path_buf(),
            metrics,
            lines,
        }
    }

    async fn client(&self) -> IsolatorClient<Channel> {
        let channel = connect_unix(&self.socket)
            .await
            .expect("connect to the service socket");
        IsolatorClient::new(channel)
    }

    /// SIGTERM, then waits for the exit.
    fn terminate(&mut self, sb: &Sandbox) -> ExitStatus {
        kill(Pid::from_raw(self.child.id() as i32), Signal::SIGTERM).unwrap();
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
        std::thread::sleep(Duration::from_millis(20));
    }
}

async fn create(
    client: &mut IsolatorClient<Channel>,
    name: &str,
    container_path: &str,
) -> proto::CreateVolumeResponse {
    client
        .create_volume(CreateVolumeRequest {
            name: name.into(),
            capacity_bytes: 16 * MIB,
            container_path: container_path.into(),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|s| panic!("CreateVolume {name}: {s}"))
        .into_inner()
}

fn list(resources: &[&proto::CreateVolumeResponse]) -> String {
    let items: Vec<&str> = resources.iter().map(|r| r.resource_json.as_str()).collect();
    format!("[{}]", items.join(","))
}

async fn status(client: &mut IsolatorClient<Channel>) -> proto::StatusResponse {
    client
        .status(StatusRequest {})
        .await
        .expect("Status")
        .into_inner()
}

/// (state, users, mounted) of a volume per Status.
async fn volume(client: &mut IsolatorClient<Channel>, id: &str) -> (String, Vec<String>, bool) {
    let s = status(client).await;
    let v = s
        .volumes
        .iter()
        .find(|v| v.volume_id == id)
        .unwrap_or_else(|| panic!("volume {id} not in status {s:?}"));
    assert_eq!(v.plugin, PLUGIN);
    assert_eq!(v.disagreement, "", "{v:?}");
    (v.state.clone(), v.users.clone(), v.mounted)
}

fn expect_code<T: std::fmt::Debug>(
    result: Result<tonic::Response<T>, tonic::Status>,
    code: Code,
    says: &str,
) {
    match result {
        Ok(r) => panic!("expected {code:?}, got {r:?}"),
        Err(s) => {
            assert_eq!(s.code(), code, "{s:?}");
            assert!(
                s.message().contains(says),
                "{says:?} not in {:?}",
                s.message()
            );
        }
    }
}

async fn http_get(addr: SocketAddr, path: &str) -> String {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = String::new();
    tokio::time::timeout(TIMEOUT, s.read_to_string(&mut out))
        .await
        .expect("metrics response in time")
        .unwrap();
    out
}

/// Checks the exposition format with the strict 0.0.4 reader (families
/// declared once, HELP then TYPE, samples inside their family, counters
/// named with `_total`, histograms cumulative up to `+Inf` = `_count`, no
/// OpenMetrics-only line) and returns each family's (name, kind).
fn check_exposition(text: &str) -> Vec<(String, String)> {
    exposition::parse(text)
        .unwrap_or_else(|e| panic!("not Prometheus text 0.0.4: {e}\n{text}"))
        .into_iter()
        .map(|f| (f.name, f.kind))
        .collect()
}

/// The value of one exact series.
fn sample(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no series {series} in\n{text}"))
        .parse()
        .unwrap()
}

fn launch_sleep(sb: &Sandbox, sandbox: &Path, mounts: Vec<VolumeMount>) -> Launched {
    let spec = LaunchSpec {
        argv: vec!["sleep".into(), "60".into()],
        sandbox: sandbox.to_path_buf(),
        mounts,
        ..Default::default()
    };
    let launched = launcher::launch(&csi_isolator::mount::LinuxSyscall::new(), &spec)
        .unwrap_or_else(|e| panic!("launch: {e}"));
    sb.track(launched.pid());
    launched
}

fn mounted_in(pid: u32, path: &Path) -> bool {
    ProcMountTable::for_pid(pid)
        .mounts()
        .unwrap()
        .iter()
        .any(|m| m.mount_point == path)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_end_to_end() {
    require_root();
    let sb = Sandbox::new("serve");
    let work = sb.join("work");
    let socket = sb.join("isolator.sock");
    let mut serve = Serve::start(&sb, &work, &socket, true);
    let meta = std::fs::symlink_metadata(&socket).unwrap();
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.permissions().mode() & 0o777, 0o600, "socket mode");
    assert!(work.join("run.lock").exists());
    let mut c = serve.client().await;

    // A containerizer recovers first; nothing to do on a fresh work dir.
    let r = c
        .recover(RecoverRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(r.recovered.is_empty() && r.cleaned.is_empty(), "{r:?}");

    let data = create(&mut c, "data", "data").await;
    let extra = create(&mut c, "extra", "extra").await;
    assert!(!data.volume_id.is_empty() && data.volume_id != extra.volume_id);
    assert_eq!(
        create(&mut c, "data", "data").await,
        data,
        "same name, same volume"
    );

    // Prepare: published, one sandbox mount.
    let sandbox = sb.mkdir("sandboxes/c1");
    let info = c
        .prepare(PrepareRequest {
            container_id: "c1".into(),
            config: Some(ContainerConfig {
                resources_json: list(&[&data]),
                sandbox: sandbox.to_string_lossy().into(),
                ..Default::default()
            }),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.mounts.len(), 1, "{info:?}");
    let m = &info.mounts[0];
    assert_eq!(m.root(), TargetRoot::Sandbox);
    assert_eq!(
        (m.target.as_str(), m.container_path.as_str()),
        ("data", "data")
    );
    assert_eq!(m.volume_id, data.volume_id);
    assert_eq!(m.provider_id, data.provider_id);
    assert!(!m.readonly);
    let (state, users, mounted) = volume(&mut c, &data.volume_id).await;
    assert_eq!(
        (state.as_str(), users, mounted),
        ("PUBLISHED", vec!["c1".to_string()], true)
    );
    assert_eq!(volume(&mut c, &extra.volume_id).await.0, "CREATED");
    expect_code(
        c.prepare(PrepareRequest {
            container_id: "c1".into(),
            config: Some(ContainerConfig {
                sandbox: sandbox.to_string_lossy().into(),
                ..Default::default()
            }),
        })
        .await,
        Code::AlreadyExists,
        "already prepared",
    );

    // Launch the container with the returned mounts; isolate it.
    let mounts: Vec<VolumeMount> = info
        .mounts
        .iter()
        .cloned()
        .map(|m| VolumeMount::try_from(m).unwrap())
        .collect();
    let (sb_ref, sandbox_ref) = (&sb, sandbox.clone());
    let mut sleeper = tokio::task::block_in_place(|| launch_sleep(sb_ref, &sandbox_ref, mounts));
    let pid = sleeper.pid();
    // A write inside the container lands on the volume.
    let inside =
        PathBuf::from(format!("/proc/{pid}/root")).join(sandbox.strip_prefix("/").unwrap());
    std::fs::write(inside.join("data/hello"), b"from c1").unwrap();
    assert_eq!(
        std::fs::read(Path::new(&m.source).join("hello")).unwrap(),
        b"from c1"
    );
    c.isolate(IsolateRequest {
        container_id: "c1".into(),
        pid,
    })
    .await
    .unwrap();

    // Update: a second volume is published and mounted into the running container.
    c.update(UpdateRequest {
        container_id: "c1".into(),
        resources_json: list(&[&data, &extra]),
    })
    .await
    .unwrap();
    assert!(
        mounted_in(pid, &sandbox.join("extra")),
        "extra not mounted in the container"
    );
    assert!(mounted_in(pid, &sandbox.join("data")));
    assert!(
        !ProcMountTable::new()
            .is_mount_point(&sandbox.join("extra"))
            .unwrap(),
        "not on the host"
    );
    assert_eq!(volume(&mut c, &extra.volume_id).await.0, "PUBLISHED");
    // Update: the first volume is removed: unmounted from the container, unpublished (last use).
    c.update(UpdateRequest {
        container_id: "c1".into(),
        resources_json: list(&[&extra]),
    })
    .await
    .unwrap();
    assert!(
        !mounted_in(pid, &sandbox.join("data")),
        "data still mounted in the container"
    );
    let (state, users, mounted) = volume(&mut c, &data.volume_id).await;
    assert_eq!(
        (state.as_str(), users.len(), mounted),
        ("CREATED", 0, false)
    );
    let st = status(&mut c).await;
    assert_eq!(st.containers.len(), 1, "{st:?}");
    assert_eq!(st.containers[0].pid, pid);
    assert_eq!(st.containers[0].mounts.len(), 1);
    assert_eq!(st.containers[0].mounts[0].volume_id, extra.volume_id);

    // Errors and their codes.
    expect_code(
        c.isolate(IsolateRequest {
            container_id: "nope".into(),
            pid,
        })
        .await,
        Code::NotFound,
        "unknown container 'nope'",
    );
    expect_code(
        c.update(UpdateRequest {
            container_id: "nope".into(),
            resources_json: "[]".into(),
        })
        .await,
        Code::NotFound,
        "unknown container 'nope'",
    );
    expect_code(
        c.prepare(PrepareRequest {
            container_id: "c2".into(),
            config: Some(ContainerConfig {
                resources_json: "[{\"name\": \"disk\",".into(),
                sandbox: sandbox.to_string_lossy().into(),
                ..Default::default()
            }),
        })
        .await,
        Code::InvalidArgument,
        "config.resources_json",
    );
    expect_code(
        c.update(UpdateRequest {
            container_id: "c1".into(),
            resources_json: "{\"not\": \"a list\"}".into(),
        })
        .await,
        Code::InvalidArgument,
        "resources_json",
    );
    expect_code(
        c.cleanup(CleanupRequest {
            container_id: "../c1".into(),
        })
        .await,
        Code::InvalidArgument,
        "container id",
    );
    // The same rule as the command line's: a ',' would make USERS columns ambiguous.
    for bad in ["a,b", "c\n1"] {
        expect_code(
            c.cleanup(CleanupRequest {
                container_id: bad.into(),
            })
            .await,
            Code::InvalidArgument,
            "container id",
        );
    }
    expect_code(
        c.destroy_volume(DestroyVolumeRequest {
            volume_id: extra.volume_id.clone(),
            ..Default::default()
        })
        .await,
        Code::FailedPrecondition,
        "in use by container(s) c1",
    );
    expect_code(
        c.destroy_volume(DestroyVolumeRequest {
            volume_id: "no-such-volume".into(),
            ..Default::default()
        })
        .await,
        Code::NotFound,
        "no-such-volume",
    );
    expect_code(
        c.create_volume(CreateVolumeRequest {
            name: "x".into(),
            access_mode: "SOMETIMES_WRITER".into(),
            ..Default::default()
        })
        .await,
        Code::InvalidArgument,
        "SOMETIMES_WRITER",
    );

    // Metrics.
    let addr = serve.metrics.expect("metrics address printed");
    let response = http_get(addr, "/metrics").await;
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
    assert!(
        head.contains("Content-Type: text/plain; version=0.0.4"),
        "{head}"
    );
    assert!(
        head.contains(&format!("Content-Length: {}\r\n", body.len())),
        "{head}"
    );
    let families = check_exposition(body);
    for (name, kind) in [
        ("csi_isolator_requests_total", "counter"),
        ("csi_isolator_publish_duration_seconds", "histogram"),
        ("csi_isolator_volumes", "gauge"),
        ("csi_isolator_volumes_published", "gauge"),
        ("csi_isolator_plugin_terminations_total", "counter"),
        ("csi_isolator_csi_finished_total", "counter"),
        ("csi_isolator_csi_failed_total", "counter"),
        ("csi_isolator_csi_latency_seconds", "histogram"),
    ] {
        assert!(
            families.contains(&(name.to_string(), kind.to_string())),
            "{name} {kind} missing: {families:?}"
        );
    }
    let p = format!("plugin=\"{PLUGIN}\"");
    assert_eq!(
        sample(
            body,
            "csi_isolator_publish_duration_seconds_count{op=\"prepare\"}"
        ),
        1.0
    );
    assert_eq!(
        sample(
            body,
            "csi_isolator_publish_duration_seconds_count{op=\"update\"}"
        ),
        2.0
    );
    assert_eq!(
        sample(
            body,
            "csi_isolator_publish_duration_seconds_bucket{op=\"prepare\",le=\"+Inf\"}"
        ),
        1.0
    );
    assert_eq!(
        sample(body, &format!("csi_isolator_volumes_published{{{p}}}")),
        1.0
    );
    assert_eq!(
        sample(
            body,
            &format!("csi_isolator_volumes{{{p},state=\"CREATED\"}}")
        ),
        1.0
    );
    assert_eq!(
        sample(
            body,
            &format!("csi_isolator_plugin_terminations_total{{{p}}}")
        ),
        0.0
    );
    assert!(
        sample(
            body,
            &format!("csi_isolator_csi_finished_total{{{p},rpc=\"NodePublishVolume\"}}")
        ) >= 2.0
    );
    assert_eq!(
        sample(
            body,
            "csi_isolator_requests_total{method=\"Isolate\",code=\"NOT_FOUND\"}"
        ),
        1.0
    );
    assert_eq!(
        sample(
            body,
            "csi_isolator_requests_total{method=\"Prepare\",code=\"OK\"}"
        ),
        1.0
    );
    let missing = http_get(addr, "/other").await;
    assert!(missing.starts_with("HTTP/1.1 404 "), "{missing}");

    // Cleanup: unmounted on the host side, released, unpublished on last use.
    c.cleanup(CleanupRequest {
        container_id: "c1".into(),
    })
    .await
    .unwrap();
    assert_eq!(volume(&mut c, &extra.volume_id).await.0, "CREATED");
    assert!(status(&mut c).await.containers.is_empty());
    c.cleanup(CleanupRequest {
        container_id: "c1".into(),
    })
    .await
    .expect("cleanup is idempotent");
    sleeper.kill(Signal::SIGKILL).unwrap();
    tokio::time::timeout(TIMEOUT, sleeper.wait_async())
        .await
        .expect("container exits")
        .unwrap();
    sb.untrack(pid);

    // Recover with no live container cleans up a prepared one.
    let sandbox2 = sb.mkdir("sandboxes/c2");
    c.prepare(PrepareRequest {
        container_id: "c2".into(),
        config: Some(ContainerConfig {
            resources_json: list(&[&data]),
            sandbox: sandbox2.to_string_lossy().into(),
            ..Default::default()
        }),
    })
    .await
    .unwrap();
    assert_eq!(volume(&mut c, &data.volume_id).await.0, "PUBLISHED");
    let r = c
        .recover(RecoverRequest {
            known_container_ids: vec![],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.cleaned, vec!["c2".to_string()], "{r:?}");
    let (state, users, mounted) = volume(&mut c, &data.volume_id).await;
    assert_eq!(
        (state.as_str(), users.len(), mounted),
        ("CREATED", 0, false)
    );

    for v in [&data, &extra] {
        c.destroy_volume(DestroyVolumeRequest {
            volume_id: v.volume_id.clone(),
            provider_id: v.provider_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    }
    assert!(status(&mut c).await.volumes.is_empty());
    drop(c);

    // SIGTERM: exits 0, socket and lock gone, plugin stopped, nothing mounted.
    let status = serve.terminate(&sb);
    assert!(status.success(), "serve exited with {status:?}");
    assert!(!socket.exists(), "socket left behind");
    let lock = std::fs::File::open(work.join("run.lock")).expect("the lock file stays");
    assert!(
        nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusiveNonblock).is_ok(),
        "nobody holds the work-dir lock"
    );
    assert_eq!(
        processes_mentioning(sb.path()),
        Vec::<u32>::new(),
        "processes left"
    );
    sb.assert_no_mounts_under();
    sb.assert_no_loop_devices();
    assert!(serve
        .lines
        .iter()
        .any(|l| l.contains("isolator on unix://")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_replaces_a_stale_socket_and_refuses_to_share() {
    require_root();
    let sb = Sandbox::new("serve-busy");
    let work = sb.join("work");
    let socket = sb.join("isolator.sock");
    // A socket nobody listens on any more: a service that died.
    drop(std::os::unix::net::UnixListener::bind(&socket).unwrap());
    assert!(socket.exists());
    let mut serve = Serve::start(&sb, &work, &socket, false);
    assert!(serve.metrics.is_none());
    let mut c = serve.client().await;
    assert!(status(&mut c).await.volumes.is_empty());

    // The same work dir: refused by the lock.
    let out = Command::new(BIN)
        .arg("--work-dir")
        .arg(&work)
        .args(["serve", "--socket"])
        .arg(sb.join("other.sock"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("is in use by another csi-isolator process"),
        "{err}"
    );
    // Another work dir on the same, live socket: refused, the socket untouched.
    let out = Command::new(BIN)
        .arg("--work-dir")
        .arg(sb.join("work2"))
        .args(["serve", "--socket"])
        .arg(&socket)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("in use by a running service"), "{err}");
    assert!(
        status(&mut c).await.containers.is_empty(),
        "first service still answers"
    );
    drop(c);

    let status = serve.terminate(&sb);
    assert!(status.success(), "serve exited with {status:?}");
    assert!(!socket.exists());
    assert_eq!(
        processes_mentioning(sb.path()),
        Vec::<u32>::new(),
        "processes left"
    );
    sb.assert_no_mounts_under();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_plugin_terminations() {
    require_root();
    let sb = Sandbox::new("serve-plugin");
    let work = sb.join("work");
    let mut serve = Serve::start(&sb, &work, &sb.join("isolator.sock"), true);
    let addr = serve.metrics.unwrap();
    let series = format!("csi_isolator_plugin_terminations_total{{plugin=\"{PLUGIN}\"}}");
    let body = http_get(addr, "/metrics").await;
    assert_eq!(sample(&body, &series), 0.0);

    // The managed plugin is the one other process started with our work dir.
    let serve_pid = serve.child.id();
    let plugins: Vec<u32> = processes_mentioning(&work)
        .into_iter()
        .filter(|p| *p != serve_pid)
        .collect();
    assert_eq!(plugins.len(), 1, "plugin processes: {plugins:?}");
    kill(Pid::from_raw(plugins[0] as i32), Signal::SIGKILL).unwrap();
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let body = http_get(addr, "/metrics").await;
        check_exposition(body.split_once("\r\n\r\n").unwrap().1);
        if sample(&body, &series) == 1.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "termination not counted:\n{body}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The restarted plugin serves again.
    let mut c = serve.client().await;
    let v = create(&mut c, "after-restart", "").await;
    c.destroy_volume(DestroyVolumeRequest {
        volume_id: v.volume_id,
        provider_id: String::new(),
        ..Default::default()
    })
    .await
    .unwrap();
    drop(c);

    assert!(serve.terminate(&sb).success());
    assert_eq!(
        processes_mentioning(sb.path()),
        Vec::<u32>::new(),
        "processes left"
    );
    sb.assert_no_mounts_under();
}

/// The `csi_operations_seconds` samples of a scrape (kubelet's histogram) whose
/// `method_name` and `grpc_status_code` are given, by sample name.
fn operations<'f>(
    families: &'f [exposition::Family],
    method: &str,
    code: &str,
) -> Vec<&'f exposition::Sample> {
    exposition::family(families, "csi_operations_seconds")
        .expect("csi_operations_seconds in the scrape")
        .samples
        .iter()
        .filter(|s| {
            s.label("method_name") == Some(method) && s.label("grpc_status_code") == Some(code)
        })
        .collect()
}

fn operations_count(families: &[exposition::Family], method: &str, code: &str) -> f64 {
    operations(families, method, code)
        .iter()
        .find(|s| s.name == "csi_operations_seconds_count")
        .map_or(0.0, |s| s.value)
}

/// A scrape rendered after now (a body is reused for a second).
async fn fresh_scrape(addr: SocketAddr) -> Vec<exposition::Family> {
    tokio::time::sleep(Duration::from_millis(1100)).await;
    scrape(addr).await
}

async fn scrape(addr: SocketAddr) -> Vec<exposition::Family> {
    let response = http_get(addr, "/metrics").await;
    let (_, body) = response.split_once("\r\n\r\n").unwrap();
    exposition::parse(body).unwrap_or_else(|e| panic!("not Prometheus text 0.0.4: {e}\n{body}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn csi_operations_seconds_is_kubelets_histogram_and_shows_a_failing_call() {
    require_root();
    let sb = Sandbox::new("serve-csi-ops");
    let work = sb.join("work");
    // The first CreateVolume the plugin gets fails (RESOURCE_EXHAUSTED is not retried).
    let mut serve = Serve::start_with(
        &sb,
        &work,
        &sb.join("isolator.sock"),
        true,
        &["--plugin-arg=--fail=CreateVolume=RESOURCE_EXHAUSTED:1"],
    );
    let addr = serve.metrics.unwrap();
    const CREATE: &str = "/csi.v1.Controller/CreateVolume";

    let before = scrape(addr).await;
    let ops = exposition::family(&before, "csi_operations_seconds").unwrap();
    assert_eq!(ops.kind, "histogram");
    // Connecting probed the plugin and asked for its name: full gRPC method names, gRPC's
    // spelling of the code, the plugin's GetPluginInfo name as the driver.
    let probes = operations(&before, "/csi.v1.Identity/Probe", "OK");
    assert!(operations_count(&before, "/csi.v1.Identity/Probe", "OK") >= 1.0);
    assert!(operations_count(&before, "/csi.v1.Identity/GetPluginInfo", "OK") >= 1.0);
    for s in &probes {
        assert_eq!(
            s.label("driver_name"),
            Some("csi-test-plugin.csi-isolator.io"),
            "{s:?}"
        );
        assert_eq!(s.label("plugin"), Some(PLUGIN), "{s:?}");
    }
    // kubelet's buckets.
    let bounds: Vec<&str> = probes
        .iter()
        .filter(|s| s.name == "csi_operations_seconds_bucket")
        .map(|s| s.label("le").unwrap())
        .collect();
    assert_eq!(
        bounds,
        [
            "0.1", "0.25", "0.5", "1", "2.5", "5", "10", "15", "25", "50", "120", "300", "600",
            "+Inf"
        ]
    );
    assert_eq!(operations_count(&before, CREATE, "OK"), 0.0);
    assert_eq!(operations_count(&before, CREATE, "ResourceExhausted"), 0.0);

    let mut c = serve.client().await;
    let failed = c
        .create_volume(CreateVolumeRequest {
            name: "refused".into(),
            capacity_bytes: 16 * MIB,
            ..Default::default()
        })
        .await;
    assert!(failed.is_err(), "{failed:?}");
    let after_failure = fresh_scrape(addr).await;
    assert_eq!(
        operations_count(&after_failure, CREATE, "ResourceExhausted"),
        1.0
    );
    assert_eq!(operations_count(&after_failure, CREATE, "OK"), 0.0);

    let v = create(&mut c, "accepted", "").await;
    let after = fresh_scrape(addr).await;
    assert_eq!(operations_count(&after, CREATE, "ResourceExhausted"), 1.0);
    assert_eq!(operations_count(&after, CREATE, "OK"), 1.0);
    // One observation per call, in the +Inf bucket too.
    let inf = operations(&after, CREATE, "OK")
        .into_iter()
        .find(|s| s.label("le") == Some("+Inf"))
        .unwrap()
        .value;
    assert_eq!(inf, 1.0);

    c.destroy_volume(DestroyVolumeRequest {
        volume_id: v.volume_id,
        provider_id: String::new(),
        ..Default::default()
    })
    .await
    .unwrap();
    drop(c);
    assert!(serve.terminate(&sb).success());
    assert_eq!(
        processes_mentioning(sb.path()),
        Vec::<u32>::new(),
        "processes left"
    );
    sb.assert_no_mounts_under();
}

/// A target the kernel refuses in a running container (a regular file where the volume is to be
/// mounted) comes back as the caller's error, INVALID_ARGUMENT, naming the container, the step, the
/// volume and the target, not as INTERNAL; nothing stays published for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn update_onto_a_file_target_is_invalid_argument_naming_step_and_target() {
    require_root();
    let sb = Sandbox::new("serve-refused-target");
    let work = sb.join("work");
    let socket = sb.join("isolator.sock");
    let mut serve = Serve::start(&sb, &work, &socket, false);
    let mut c = serve.client().await;
    let data = create(&mut c, "data", "data").await;
    let sandbox = sb.mkdir("sandboxes/c1");
    c.prepare(PrepareRequest {
        container_id: "c1".into(),
        config: Some(ContainerConfig {
            sandbox: sandbox.to_string_lossy().into(),
            ..Default::default()
        }),
    })
    .await
    .unwrap();
    std::fs::write(sandbox.join("data"), b"not a directory").unwrap();
    let (sb_ref, sandbox_ref) = (&sb, sandbox.clone());
    let mut sleeper =
        tokio::task::block_in_place(|| launch_sleep(sb_ref, &sandbox_ref, Vec::new()));
    c.isolate(IsolateRequest {
        container_id: "c1".into(),
        pid: sleeper.pid(),
    })
    .await
    .unwrap();

    let refused = c
        .update(UpdateRequest {
            container_id: "c1".into(),
            resources_json: list(&[&data]),
        })
        .await
        .expect_err("a file target is refused");
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    let says = refused.message();
    for part in [
        "container 'c1': mount volume",
        data.volume_id.as_str(),
        "at data in container root",
        "not a directory: refused",
    ] {
        assert!(says.contains(part), "{part:?} not in {says:?}");
    }
    let (state, users, mounted) = volume(&mut c, &data.volume_id).await;
    assert_eq!(
        (state.as_str(), users.len(), mounted),
        ("CREATED", 0, false)
    );

    sleeper.kill(Signal::SIGKILL).unwrap();
    tokio::time::timeout(TIMEOUT, sleeper.wait_async())
        .await
        .expect("the sleeper exits")
        .unwrap();
    sb.untrack(sleeper.pid());
    c.cleanup(CleanupRequest {
        container_id: "c1".into(),
    })
    .await
    .unwrap();
    c.destroy_volume(DestroyVolumeRequest {
        volume_id: data.volume_id.clone(),
        provider_id: data.provider_id.clone(),
        ..Default::default()
    })
    .await
    .unwrap();
    drop(c);
    let status = serve.terminate(&sb);
    assert!(status.success(), "serve exited with {status:?}");
    sb.assert_no_mounts_under();
    sb.assert_no_loop_devices();
}

/// A volume made straight in the plugin, behind serve's back, with `content` written into
/// `file` through the plugin's own node calls (ControllerPublish, NodeStage, NodePublish, then
/// all undone): what an administrator or another CO leaves behind. Returns its id.
async fn made_behind_serves_back(
    sb: &Sandbox,
    plugin: &csi_isolator_testing::PluginProcess,
    file: &str,
    content: &str,
) -> String {
    use csi_isolator::csi::proto as csi;
    use csi_isolator::csi::proto::volume_capability::access_mode::Mode;
    use csi_isolator_testing::{mount_capability, raw_clients};
    let mut raw = raw_clients(&plugin.socket()).await.unwrap();
    let cap = mount_capability(Mode::SingleNodeWriter);
    let node_id = raw
        .node
        .node_get_info(csi::NodeGetInfoRequest {})
        .await
        .unwrap()
        .into_inner()
        .node_id;
    let id = raw
        .controller
        .create_volume(csi::CreateVolumeRequest {
            name: "made-by-hand".into(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: 16 * MIB as i64,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![cap.clone()],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap()
        .volume_id;
    let publish_context = raw
        .controller
        .controller_publish_volume(csi::ControllerPublishVolumeRequest {
            volume_id: id.clone(),
            node_id: node_id.clone(),
            volume_capability: Some(cap.clone()),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .publish_context;
    let staging = sb.mkdir("by-hand/staging");
    let target = sb.mkdir("by-hand/pod").join("target");
    raw.node
        .node_stage_volume(csi::NodeStageVolumeRequest {
            volume_id: id.clone(),
            staging_target_path: staging.display().to_string(),
            volume_capability: Some(cap.clone()),
            publish_context: publish_context.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    raw.node
        .node_publish_volume(csi::NodePublishVolumeRequest {
            volume_id: id.clone(),
            staging_target_path: staging.display().to_string(),
            target_path: target.display().to_string(),
            volume_capability: Some(cap),
            publish_context,
            ..Default::default()
        })
        .await
        .unwrap();
    std::fs::write(target.join(file), content).unwrap();
    raw.node
        .node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
            volume_id: id.clone(),
            target_path: target.display().to_string(),
        })
        .await
        .unwrap();
    raw.node
        .node_unstage_volume(csi::NodeUnstageVolumeRequest {
            volume_id: id.clone(),
            staging_target_path: staging.display().to_string(),
        })
        .await
        .unwrap();
    raw.controller
        .controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest {
            volume_id: id.clone(),
            node_id,
            ..Default::default()
        })
        .await
        .unwrap();
    sb.assert_no_mounts_under();
    id
}

/// Prepares `id` with `resources` in a sandbox of its own, launches a sleeper with the returned
/// mounts and returns it with its sandbox.
async fn prepare_and_launch(
    c: &mut IsolatorClient<Channel>,
    sb: &Sandbox,
    id: &str,
    resources: String,
) -> (Launched, PathBuf) {
    let sandbox = sb.mkdir(format!("sandboxes/{id}"));
    let info = c
        .prepare(PrepareRequest {
            container_id: id.into(),
            config: Some(ContainerConfig {
                resources_json: resources,
                sandbox: sandbox.to_string_lossy().into(),
                ..Default::default()
            }),
        })
        .await
        .unwrap_or_else(|s| panic!("Prepare {id}: {s}"))
        .into_inner();
    let mounts: Vec<VolumeMount> = info
        .mounts
        .into_iter()
        .map(|m| VolumeMount::try_from(m).unwrap())
        .collect();
    let launched = tokio::task::block_in_place(|| launch_sleep(sb, &sandbox, mounts));
    (launched, sandbox)
}

/// Kills and reaps a sleeper.
async fn stop(sb: &Sandbox, mut sleeper: Launched) {
    sleeper.kill(Signal::SIGKILL).unwrap();
    tokio::time::timeout(TIMEOUT, sleeper.wait_async())
        .await
        .expect("the sleeper exits")
        .unwrap();
    sb.untrack(sleeper.pid());
}

/// Serve's ImportVolume adopts a volume made behind its back: a container prepared with the
/// resource it returns reads what was written before the import; DestroyVolume then forgets it
/// and leaves it, data and all, in the plugin, unless `delete_imported` is set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_imports_a_volume_and_a_container_reads_it() {
    use csi_isolator_testing::PluginProcess;
    require_root();
    let sb = Sandbox::new("serve-import");
    let plugin = PluginProcess::start(
        &sb,
        csi_isolator_testing::plugin_bin(),
        &["--backing", "dir"],
    )
    .await;
    let id = made_behind_serves_back(&sb, &plugin, "before", "written before the import\n").await;
    let work = sb.join("work");
    let ep = plugin.endpoint();
    let mut serve = Serve::start_with(
        &sb,
        &work,
        &sb.join("isolator.sock"),
        false,
        &["--plugin-endpoint", &ep],
    );
    let mut c = serve.client().await;
    let import = || proto::ImportVolumeRequest {
        name: "adopted".into(),
        volume_id: id.clone(),
        capacity_bytes: 16 * MIB,
        container_path: "data".into(),
        ..Default::default()
    };
    let imported = c.import_volume(import()).await.unwrap().into_inner();
    assert_eq!(imported.volume_id, id);
    let find = |s: &proto::StatusResponse| s.volumes.iter().find(|v| v.volume_id == id).cloned();
    let v = find(&status(&mut c).await).expect("the imported volume in status");
    assert_eq!(
        (v.name.as_str(), v.state.as_str(), v.imported),
        ("adopted", "CREATED", true)
    );

    // A container prepared with it reads the data written before the import, and writes more.
    let (sleeper, sandbox) = prepare_and_launch(&mut c, &sb, "c1", list(&[&imported])).await;
    let inside = PathBuf::from(format!("/proc/{}/root", sleeper.pid()))
        .join(sandbox.strip_prefix("/").unwrap())
        .join("data");
    assert_eq!(
        std::fs::read_to_string(inside.join("before")).unwrap(),
        "written before the import\n"
    );
    std::fs::write(inside.join("after"), "written by c1\n").unwrap();
    assert_eq!(find(&status(&mut c).await).unwrap().state, "PUBLISHED");
    stop(&sb, sleeper).await;
    c.cleanup(CleanupRequest {
        container_id: "c1".into(),
    })
    .await
    .unwrap();

    // Destroy forgets it; the plugin keeps it, with its data: imported again, a container reads
    // what c1 wrote.
    let destroy = |delete_imported| DestroyVolumeRequest {
        volume_id: id.clone(),
        delete_imported,
        ..Default::default()
    };
    c.destroy_volume(destroy(false)).await.unwrap();
    assert!(find(&status(&mut c).await).is_none(), "still recorded");
    let in_plugin = || async {
        plugin
            .listed()
            .await
            .iter()
            .any(|e| e.volume.as_ref().is_some_and(|v| v.volume_id == id))
    };
    assert!(
        in_plugin().await,
        "deleted in the plugin without delete_imported"
    );
    let again = c.import_volume(import()).await.unwrap().into_inner();
    let (sleeper, sandbox) = prepare_and_launch(&mut c, &sb, "c2", list(&[&again])).await;
    let inside = PathBuf::from(format!("/proc/{}/root", sleeper.pid()))
        .join(sandbox.strip_prefix("/").unwrap())
        .join("data");
    assert_eq!(
        std::fs::read_to_string(inside.join("after")).unwrap(),
        "written by c1\n"
    );
    stop(&sb, sleeper).await;
    c.cleanup(CleanupRequest {
        container_id: "c2".into(),
    })
    .await
    .unwrap();

    // With delete_imported, DeleteVolume goes to the plugin too.
    c.destroy_volume(destroy(true)).await.unwrap();
    assert!(find(&status(&mut c).await).is_none());
    assert!(
        !in_plugin().await,
        "kept in the plugin with delete_imported"
    );
    drop(c);
    let status = serve.terminate(&sb);
    assert!(status.success(), "serve exited with {status:?}");
    drop(plugin);
    assert_eq!(
        processes_mentioning(sb.path()),
        Vec::<u32>::new(),
        "processes left"
    );
    sb.assert_no_mounts_under();
    sb.assert_no_loop_devices();
}

/// The bundled provider's id, which resources name.
const PROVIDER: &str = "csi-test-plugin.csi-isolator.io.default";

/// A profiles file (root's, 0644, in a root-owned directory) whose profile `shared` gives
/// `share=/from-profile`.
fn profiles_file(sb: &Sandbox) -> PathBuf {
    let file = sb.mkdir("profiles").join("profiles.json");
    std::fs::write(
        &file,
        r#"{"profile_matrix": {"shared": {
            "volume_capabilities": {"mount": {}, "access_mode": {"mode": "SINGLE_NODE_WRITER"}},
            "create_parameters": {"share": "/from-profile"}}}}"#,
    )
    .unwrap();
    file
}

/// A Mesos disk of the bundled provider with `profile` and no volume yet, named by its
/// persistence id, at `path` in the container.
fn profile_disk(profile: &str, name: &str, path: &str) -> serde_json::Value {
    serde_json::json!({
        "name": "disk", "type": "SCALAR", "scalar": {"value": 16},
        "provider_id": {"value": PROVIDER},
        "disk": {
            "source": {"type": "RAW", "profile": profile},
            "persistence": {"id": name},
            "volume": {"container_path": path, "mode": "RW"}
        }
    })
}

/// A disk without provider_id (an agent disk the operator prepares) at `root` on the host.
fn agent_disk(root: &Path, path: &str) -> serde_json::Value {
    serde_json::json!({
        "name": "disk", "type": "SCALAR", "scalar": {"value": 16},
        "disk": {
            "source": {"type": "MOUNT", "mount": {"root": root}},
            "volume": {"container_path": path, "mode": "RW"}
        }
    })
}

/// PrepareOci and Update take Mesos disks with a profile: each becomes a volume created with the
/// profile's parameters (the plugin refuses a create without them), then published. An Update
/// naming a disk the provider does not know, or an agent disk that is not there, is refused with
/// a message that says so, and nothing new is mounted, on the host or in the container.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepare_oci_and_update_create_profile_disks_and_refuse_unknown_disks() {
    require_root();
    let sb = Sandbox::new("serve-profiles");
    let work = sb.join("work");
    let profiles = profiles_file(&sb);
    let profiles_arg = profiles.display().to_string();
    let mut serve = Serve::start_with(
        &sb,
        &work,
        &sb.join("isolator.sock"),
        false,
        &[
            "--plugin-arg=--require-parameters=share=/from-profile",
            "--disk-profiles",
            &profiles_arg,
        ],
    );
    let mut c = serve.client().await;
    let by_name = |s: &proto::StatusResponse, name: &str| {
        s.volumes
            .iter()
            .find(|v| v.name == name)
            .cloned()
            .unwrap_or_else(|| panic!("no volume {name} in {s:?}"))
    };

    // PrepareOci: the profile disk is created with the profile's parameters and bound on the host.
    let oci_sandbox = sb.mkdir("sandboxes/oci");
    let info = c
        .prepare_oci(PrepareRequest {
            container_id: "oci".into(),
            config: Some(ContainerConfig {
                resources_json: serde_json::json!([profile_disk("shared", "pv-oci", "data")])
                    .to_string(),
                sandbox: oci_sandbox.to_string_lossy().into(),
                ..Default::default()
            }),
        })
        .await
        .unwrap_or_else(|s| panic!("PrepareOci: {s}"))
        .into_inner();
    assert_eq!(info.mounts.len(), 1, "{info:?}");
    let bind = PathBuf::from(&info.mounts[0].source);
    assert_eq!(bind, oci_sandbox.join("data"));
    assert!(ProcMountTable::new().is_mount_point(&bind).unwrap());
    let v = by_name(&status(&mut c).await, "pv-oci");
    assert_eq!(v.parameters["share"], "/from-profile", "{v:?}");
    assert_eq!(
        (v.state.as_str(), v.users.as_slice()),
        ("PUBLISHED", &["oci".to_string()][..])
    );
    c.cleanup(CleanupRequest {
        container_id: "oci".into(),
    })
    .await
    .unwrap();
    assert!(!ProcMountTable::new().is_mount_point(&bind).unwrap());

    // Update: a running container gets a profile disk, created and mounted into it.
    let sandbox = sb.mkdir("sandboxes/c1");
    c.prepare(PrepareRequest {
        container_id: "c1".into(),
        config: Some(ContainerConfig {
            sandbox: sandbox.to_string_lossy().into(),
            ..Default::default()
        }),
    })
    .await
    .unwrap();
    let (sb_ref, sandbox_ref) = (&sb, sandbox.clone());
    let sleeper = tokio::task::block_in_place(|| launch_sleep(sb_ref, &sandbox_ref, Vec::new()));
    let pid = sleeper.pid();
    c.isolate(IsolateRequest {
        container_id: "c1".into(),
        pid,
    })
    .await
    .unwrap();
    let disk = profile_disk("shared", "pv-upd", "data");
    c.update(UpdateRequest {
        container_id: "c1".into(),
        resources_json: serde_json::json!([disk]).to_string(),
    })
    .await
    .unwrap_or_else(|s| panic!("Update with a profile disk: {s}"));
    assert!(
        mounted_in(pid, &sandbox.join("data")),
        "not mounted in the container"
    );
    let v = by_name(&status(&mut c).await, "pv-upd");
    assert_eq!(v.parameters["share"], "/from-profile", "{v:?}");
    assert_eq!(v.state, "PUBLISHED");

    // Update naming what the provider cannot mount: refused, saying so; nothing more mounted.
    let host_mounts = || sb.mounts_under().len();
    let mounted_before = host_mounts();
    let gone = c
        .create_volume(CreateVolumeRequest {
            name: "gone".into(),
            capacity_bytes: 16 * MIB,
            container_path: "ghost".into(),
            parameters: [("share".to_string(), "/from-profile".to_string())].into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    c.destroy_volume(DestroyVolumeRequest {
        volume_id: gone.volume_id.clone(),
        ..Default::default()
    })
    .await
    .unwrap();
    let unknown: serde_json::Value = serde_json::from_str(&gone.resource_json).unwrap();
    let missing = sb.join("never-prepared");
    let file = sb.join("a-file");
    std::fs::write(&file, "not a directory").unwrap();
    let cases = [
        (
            unknown,
            Code::NotFound,
            vec!["unknown volume", gone.volume_id.as_str(), "volume import"],
        ),
        (
            agent_disk(&missing, "agent"),
            Code::FailedPrecondition,
            vec!["has no provider_id", "does not exist"],
        ),
        (
            agent_disk(&file, "agent"),
            Code::FailedPrecondition,
            vec!["has no provider_id", "is not a directory"],
        ),
    ];
    let missing_text = missing.display().to_string();
    let file_text = file.display().to_string();
    for (extra, code, says) in cases {
        let refused = c
            .update(UpdateRequest {
                container_id: "c1".into(),
                resources_json: serde_json::json!([disk, extra]).to_string(),
            })
            .await
            .expect_err("an update with a disk the provider cannot mount");
        assert_eq!(refused.code(), code, "{refused:?}");
        for part in says {
            assert!(
                refused.message().contains(part),
                "{part:?} not in {refused:?}"
            );
        }
        if code == Code::FailedPrecondition {
            let path = if refused.message().contains("does not exist") {
                &missing_text
            } else {
                &file_text
            };
            assert!(refused.message().contains(path.as_str()), "{refused:?}");
        }
        for target in ["ghost", "agent"] {
            assert!(
                !mounted_in(pid, &sandbox.join(target)),
                "{target} mounted in the container"
            );
        }
        assert!(mounted_in(pid, &sandbox.join("data")), "data unmounted");
        assert_eq!(host_mounts(), mounted_before, "{:?}", sb.mounts_under());
        let st = status(&mut c).await;
        assert_eq!(st.containers[0].mounts.len(), 1, "{st:?}");
        assert!(st.volumes.iter().all(|v| v.volume_id != gone.volume_id));
    }

    // Out again, then everything goes.
    c.update(UpdateRequest {
        container_id: "c1".into(),
        resources_json: "[]".into(),
    })
    .await
    .unwrap();
    assert!(!mounted_in(pid, &sandbox.join("data")));
    stop(&sb, sleeper).await;
    c.cleanup(CleanupRequest {
        container_id: "c1".into(),
    })
    .await
    .unwrap();
    for name in ["pv-oci", "pv-upd"] {
        let v = by_name(&status(&mut c).await, name);
        assert_eq!(v.state, "CREATED");
        c.destroy_volume(DestroyVolumeRequest {
            volume_id: v.volume_id,
            ..Default::default()
        })
        .await
        .unwrap();
    }
    drop(c);
    let status = serve.terminate(&sb);
    assert!(status.success(), "serve exited with {status:?}");
    assert_eq!(
        processes_mentioning(sb.path()),
        Vec::<u32>::new(),
        "processes left"
    );
    sb.assert_no_mounts_under();
    sb.assert_no_loop_devices();
}

/// Serve's CreateVolume passes fs_type and mount_flags to the plugin: a real container's own
/// mount table (`/proc/<pid>/mountinfo`, its namespace) shows its volume as ext3 with noexec
/// and noatime, and Status reports the capability. A form the service refuses (an fs type that
/// is no name) and a flag the plugin refuses are INVALID_ARGUMENT naming them, nothing
/// recorded; a second container of a SINGLE_NODE_SINGLE_WRITER volume is FAILED_PRECONDITION
/// naming the volume, the mode and the holder, before anything is mounted for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_passes_fs_type_and_mount_flags_and_the_container_sees_them() {
    require_root();
    let sb = Sandbox::new("serve-flags");
    let work = sb.join("work");
    let mut serve = Serve::start(&sb, &work, &sb.join("isolator.sock"), false);
    let mut c = serve.client().await;
    let request = |name: &str, fs_type: &str, flags: &[&str]| CreateVolumeRequest {
        name: name.into(),
        capacity_bytes: 16 * MIB,
        access_mode: "SINGLE_NODE_SINGLE_WRITER".into(),
        container_path: "data".into(),
        fs_type: fs_type.into(),
        mount_flags: flags.iter().map(|f| f.to_string()).collect(),
        ..Default::default()
    };
    for (fs_type, flags, words) in [
        (
            "ext4 -o x",
            &[][..],
            "'ext4 -o x' is not a filesystem type name",
        ),
        ("ext3", &["suid"], "\"suid\" would weaken"),
        ("ntfs", &[], "fs_type \"ntfs\" is not supported"),
    ] {
        let status = c
            .create_volume(request("refused", fs_type, flags))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert!(status.message().contains(words), "{}", status.message());
    }
    // A block volume has neither (CSI's block capability carries none): refused, not dropped.
    for (fs_type, flags, words) in [
        ("ext4", &[][..], "'ext4' asked for a block volume"),
        (
            "",
            &["noatime"][..],
            "asked for a block volume, which is not mounted",
        ),
    ] {
        let status = c
            .create_volume(CreateVolumeRequest {
                access_type: "block".into(),
                ..request("refused-block", fs_type, flags)
            })
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert!(status.message().contains(words), "{}", status.message());
    }
    let created = c
        .create_volume(request("flagged", "ext3", &["noexec", "noatime"]))
        .await
        .unwrap()
        .into_inner();
    let s = status(&mut c).await;
    assert_eq!(s.volumes.len(), 1, "only the created volume: {s:?}");
    let v = &s.volumes[0];
    assert_eq!(
        (
            v.access_mode.as_str(),
            v.fs_type.as_str(),
            v.mount_flags.clone()
        ),
        (
            "SINGLE_NODE_SINGLE_WRITER",
            "ext3",
            vec!["noexec".to_string(), "noatime".to_string()]
        )
    );

    let (sleeper, sandbox) = prepare_and_launch(&mut c, &sb, "c1", list(&[&created])).await;
    let table = ProcMountTable::for_pid(sleeper.pid()).mounts().unwrap();
    let data = sandbox.join("data");
    let seen = table
        .iter()
        .rev()
        .find(|m| m.mount_point == data)
        .unwrap_or_else(|| panic!("no mount at {} in the container: {table:?}", data.display()));
    assert_eq!(seen.fs_type, "ext3", "{seen:?}");
    for flag in ["noexec", "noatime"] {
        assert!(
            seen.mount_options.iter().any(|o| o == flag),
            "{flag} in the container: {seen:?}"
        );
    }
    assert!(!seen.is_readonly());

    let other = sb.mkdir("sandboxes/c2");
    let status = c
        .prepare(PrepareRequest {
            container_id: "c2".into(),
            config: Some(ContainerConfig {
                resources_json: list(&[&created]),
                sandbox: other.to_string_lossy().into(),
                ..Default::default()
            }),
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    for words in [
        format!("volume '{}'", created.volume_id),
        "access mode SINGLE_NODE_SINGLE_WRITER".to_string(),
        "container 'c1' uses it already".to_string(),
    ] {
        assert!(status.message().contains(&words), "{}", status.message());
    }
    assert!(!mounted_in(std::process::id(), &other.join("data")));

    stop(&sb, sleeper).await;
    c.cleanup(CleanupRequest {
        container_id: "c1".into(),
    })
    .await
    .unwrap();
    c.destroy_volume(DestroyVolumeRequest {
        volume_id: created.volume_id.clone(),
        ..Default::default()
    })
    .await
    .unwrap();
    drop(c);
    let status = serve.terminate(&sb);
    assert!(status.success(), "serve exited with {status:?}");
    sb.assert_no_mounts_under();
    sb.assert_no_loop_devices();
}

/// Serve carries a volume's topology and a workload's user: a volume created in zone a is shown
/// reachable from it in Status, and refused by Prepare (FAILED_PRECONDITION naming both zones,
/// nothing mounted) when serve's node moves to zone b; back in zone a, a Prepare with
/// `ContainerConfig.user` makes the unshared volume root writable for the workload's group, and
/// a workload launched as that user writes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_refuses_a_volume_outside_its_topology_and_lets_a_non_root_workload_write() {
    require_root();
    let sb = Sandbox::new("serve-topology-user");
    let work = sb.join("work");
    let socket = sb.join("isolator.sock");
    let zone = |z: &str| format!("--plugin-arg=--topology=topology.example.com/zone={z}");
    let start = |z: &str| Serve::start_with(&sb, &work, &socket, false, &[zone(z).as_str()]);

    let mut serve = start("a");
    let mut c = serve.client().await;
    let created = create(&mut c, "zoned", "data").await;
    let s = status(&mut c).await;
    let segments: Vec<_> = s.volumes[0]
        .accessible_topology
        .iter()
        .map(|t| t.segments.clone())
        .collect();
    assert_eq!(
        segments,
        [std::collections::HashMap::from([(
            "topology.example.com/zone".to_string(),
            "a".to_string()
        )])],
        "{s:?}"
    );
    drop(c);
    assert!(serve.terminate(&sb).success());

    // The node is now in zone b: refused before anything is published or mounted.
    let mut serve = start("b");
    let mut c = serve.client().await;
    let sandbox = sb.mkdir("sandboxes/elsewhere");
    let refused = c
        .prepare(PrepareRequest {
            container_id: "elsewhere".into(),
            config: Some(ContainerConfig {
                resources_json: list(&[&created]),
                sandbox: sandbox.to_string_lossy().into(),
                ..Default::default()
            }),
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
    assert!(
        refused.message().contains(
            "can be reached only from topology.example.com/zone=a (its CreateVolume answer), and this node is at topology.example.com/zone=b"
        ),
        "{}",
        refused.message()
    );
    sb.assert_no_mounts_under();
    drop(c);
    assert!(serve.terminate(&sb).success());

    // Back in zone a, as user 4321 of group 4322.
    let mut serve = start("a");
    let mut c = serve.client().await;
    let sandbox = sb.mkdir("sandboxes/owner");
    let info = c
        .prepare(PrepareRequest {
            container_id: "owner".into(),
            config: Some(ContainerConfig {
                resources_json: list(&[&created]),
                sandbox: sandbox.to_string_lossy().into(),
                user: "4321:4322".into(),
                ..Default::default()
            }),
        })
        .await
        .unwrap_or_else(|s| panic!("Prepare owner: {s}"))
        .into_inner();
    let mounts: Vec<VolumeMount> = info
        .mounts
        .into_iter()
        .map(|m| VolumeMount::try_from(m).unwrap())
        .collect();
    let host = mounts[0].source.clone();
    std::fs::set_permissions(&sandbox, std::fs::Permissions::from_mode(0o755)).unwrap();
    let spec = LaunchSpec {
        argv: vec!["sh".into(), "-c".into(), "echo mine > data/f".into()],
        env: vec![("PATH".into(), "/usr/bin:/bin".into())],
        sandbox: sandbox.clone(),
        mounts,
        user: Some(csi_isolator::launcher::Credentials {
            uid: 4321,
            gid: 4322,
        }),
        ..Default::default()
    };
    let mut launched = tokio::task::block_in_place(|| {
        launcher::launch(&csi_isolator::mount::LinuxSyscall::new(), &spec)
            .unwrap_or_else(|e| panic!("launch: {e}"))
    });
    sb.track(launched.pid());
    let exit = tokio::time::timeout(TIMEOUT, launched.wait_async())
        .await
        .expect("the workload exits")
        .unwrap();
    sb.untrack(launched.pid());
    assert!(
        exit.success(),
        "the non-root workload wrote its volume: {exit:?}"
    );
    let written = std::fs::metadata(host.join("f")).unwrap();
    use std::os::unix::fs::MetadataExt;
    assert_eq!((written.uid(), written.gid()), (4321, 4322));
    assert_eq!(std::fs::read_to_string(host.join("f")).unwrap(), "mine\n");
    c.cleanup(CleanupRequest {
        container_id: "owner".into(),
    })
    .await
    .unwrap();
    c.destroy_volume(DestroyVolumeRequest {
        volume_id: created.volume_id.clone(),
        ..Default::default()
    })
    .await
    .unwrap();
    drop(c);
    assert!(serve.terminate(&sb).success());
    sb.assert_no_mounts_under();
    sb.assert_no_loop_devices();
}

/// The size a workload sees of the filesystem at `path` in process `pid`'s mount namespace.
fn seen_size(pid: u32, path: &Path) -> u64 {
    let inside = PathBuf::from(format!("/proc/{pid}/root")).join(path.strip_prefix("/").unwrap());
    let st = nix::sys::statvfs::statvfs(&inside).unwrap();
    st.blocks() * st.fragment_size()
}

/// ExpandVolume grows a volume in use online: a running workload's own statvfs sees the new size
/// (xfs on the loop backing: ControllerExpandVolume grows the image, NodeExpandVolume the mounted
/// filesystem) and its data is still there; Status reports the new capacity. A smaller size, a
/// size of 0 and an empty id are refused before any RPC; the same size again is no change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expand_volume_grows_a_volume_under_a_running_workload() {
    require_root();
    let sb = Sandbox::new("serve-expand");
    let work = sb.join("work");
    let mut serve = Serve::start(&sb, &work, &sb.join("isolator.sock"), false);
    let mut c = serve.client().await;
    let created = c
        .create_volume(CreateVolumeRequest {
            name: "grown".into(),
            capacity_bytes: 300 * MIB,
            container_path: "data".into(),
            fs_type: "xfs".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let (sleeper, sandbox) = prepare_and_launch(&mut c, &sb, "c1", list(&[&created])).await;
    let data = sandbox.join("data");
    let inside = PathBuf::from(format!("/proc/{}/root", sleeper.pid()))
        .join(data.strip_prefix("/").unwrap());
    std::fs::write(inside.join("kept"), "before the growth\n").unwrap();
    let before = seen_size(sleeper.pid(), &data);
    assert!(before < 300 * MIB, "{before}");

    let grown = c
        .expand_volume(proto::ExpandVolumeRequest {
            volume_id: created.volume_id.clone(),
            capacity_bytes: 400 * MIB,
            ..Default::default()
        })
        .await
        .unwrap_or_else(|s| panic!("ExpandVolume: {s}"))
        .into_inner();
    assert!(grown.capacity_bytes >= 400 * MIB, "{grown:?}");
    assert!(!grown.node_expansion_pending, "{grown:?}");
    let after = seen_size(sleeper.pid(), &data);
    assert!(
        after >= before + 95 * MIB,
        "the workload sees {after} bytes, it saw {before}"
    );
    assert_eq!(
        std::fs::read_to_string(inside.join("kept")).unwrap(),
        "before the growth\n"
    );
    let s = status(&mut c).await;
    assert_eq!(s.volumes[0].capacity_bytes, grown.capacity_bytes, "{s:?}");

    for (size, code, words) in [
        (100 * MIB, Code::OutOfRange, "cannot shrink"),
        (0, Code::InvalidArgument, "a size of 0"),
    ] {
        let refused = c
            .expand_volume(proto::ExpandVolumeRequest {
                volume_id: created.volume_id.clone(),
                capacity_bytes: size,
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(refused.code(), code, "{refused:?}");
        assert!(refused.message().contains(words), "{}", refused.message());
    }
    let empty = c
        .expand_volume(proto::ExpandVolumeRequest::default())
        .await
        .unwrap_err();
    assert_eq!(empty.code(), Code::InvalidArgument, "{empty:?}");
    let again = c
        .expand_volume(proto::ExpandVolumeRequest {
            volume_id: created.volume_id.clone(),
            capacity_bytes: grown.capacity_bytes,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.capacity_bytes, grown.capacity_bytes);

    stop(&sb, sleeper).await;
    c.cleanup(CleanupRequest {
        container_id: "c1".into(),
    })
    .await
    .unwrap();
    c.destroy_volume(DestroyVolumeRequest {
        volume_id: created.volume_id.clone(),
        ..Default::default()
    })
    .await
    .unwrap();
    drop(c);
    assert!(serve.terminate(&sb).success());
    sb.assert_no_mounts_under();
    sb.assert_no_loop_devices();
}

/// Status over the wire: a running workload's writes show in the volume's stats (within a block
/// of what it wrote, on the loop backing's own filesystem) with a normal condition, and a volume
/// made from a snapshot or cloned from a volume carries its `content_source`
/// (`snapshot:NAME`, `volume:NAME`), the volume made empty none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_shows_a_workloads_usage_and_what_a_volume_was_made_from() {
    require_root();
    let sb = Sandbox::new("serve-day2-status");
    let work = sb.join("work");
    let mut serve = Serve::start(&sb, &work, &sb.join("isolator.sock"), false);
    let mut c = serve.client().await;
    let made = |name: &str, from_snapshot: &str, from_volume: &str| CreateVolumeRequest {
        name: name.into(),
        capacity_bytes: 64 * MIB,
        container_path: "data".into(),
        from_snapshot: from_snapshot.into(),
        from_volume: from_volume.into(),
        ..Default::default()
    };
    let src = c
        .create_volume(made("src", "", ""))
        .await
        .unwrap()
        .into_inner();
    let (sleeper, sandbox) = prepare_and_launch(&mut c, &sb, "c1", list(&[&src])).await;
    let inside = PathBuf::from(format!("/proc/{}/root", sleeper.pid()))
        .join(sandbox.join("data").strip_prefix("/").unwrap());
    let stats_of = |s: &proto::StatusResponse, id: &str| {
        let v = s.volumes.iter().find(|v| v.volume_id == id).unwrap();
        (v.stats.clone().expect("stats"), v.condition.clone())
    };
    let (before, _) = stats_of(&status(&mut c).await, &src.volume_id);
    {
        use std::io::Write;
        let mut f = std::fs::File::create(inside.join("payload")).unwrap();
        for _ in 0..8 {
            f.write_all(&vec![0x5a; MIB as usize]).unwrap();
        }
        f.sync_all().unwrap();
    }
    let (after, condition) = stats_of(&status(&mut c).await, &src.volume_id);
    assert_eq!(after.unavailable, "", "{after:?}");
    let grew = after.bytes_used.unwrap() as i64 - before.bytes_used.unwrap() as i64;
    assert!(
        (grew - 8 * MIB as i64).abs() <= 4096,
        "used grew by {grew}: {before:?} -> {after:?}"
    );
    assert!(!condition.expect("a condition").abnormal);

    c.create_snapshot(proto::CreateSnapshotRequest {
        volume_id: src.volume_id.clone(),
        name: "nightly".into(),
        ..Default::default()
    })
    .await
    .unwrap_or_else(|s| panic!("CreateSnapshot: {s}"));
    let restored = c
        .create_volume(made("restored", "nightly", ""))
        .await
        .unwrap_or_else(|s| panic!("CreateVolume from a snapshot: {s}"))
        .into_inner();
    let copy = c
        .create_volume(made("copy", "", "src"))
        .await
        .unwrap_or_else(|s| panic!("CreateVolume from a volume: {s}"))
        .into_inner();
    let s = status(&mut c).await;
    let source = |id: &str| {
        s.volumes
            .iter()
            .find(|v| v.volume_id == id)
            .unwrap()
            .content_source
            .clone()
    };
    assert_eq!(source(&src.volume_id), "");
    assert_eq!(source(&restored.volume_id), "snapshot:nightly");
    assert_eq!(source(&copy.volume_id), "volume:src");

    stop(&sb, sleeper).await;
    c.cleanup(CleanupRequest {
        container_id: "c1".into(),
    })
    .await
    .unwrap();
    for v in [&restored, &copy, &src] {
        c.destroy_volume(DestroyVolumeRequest {
            volume_id: v.volume_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    }
    c.delete_snapshot(proto::DeleteSnapshotRequest {
        name: "nightly".into(),
        ..Default::default()
    })
    .await
    .unwrap();
    drop(c);
    assert!(serve.terminate(&sb).success());
    sb.assert_no_mounts_under();
    sb.assert_no_loop_devices();
}
