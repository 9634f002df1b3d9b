//! `csi-isolator docker-plugin` at the protocol level: real HTTP/1.1
//! requests from the test on the real Unix socket, the bundled CSI plugin,
//! real mounts. Real engines: `docker_engine.rs`, `podman_engine.rs`; crash points:
//! `docker_plugin_crash.rs`.

use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::{Duration, Instant};

use csi_isolator_testing::files::{find_below, is_mounted};
use csi_isolator_testing::unprivileged::{as_nobody, Outcome};
use csi_isolator_testing::{mount_points_under, require_root, DockerPluginProcess, Sandbox};
use nix::errno::Errno;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const BIN: &str = env!("CARGO_BIN_EXE_csi-isolator");
const TIMEOUT: Duration = Duration::from_secs(30);
const CONTENT_TYPE: &str = "application/vnd.docker.plugins.v1.2+json";

/// The service under test (the scaffolding's process) with this file's protocol helpers.
struct Plugin(DockerPluginProcess);

impl std::ops::Deref for Plugin {
    type Target = DockerPluginProcess;
    fn deref(&self) -> &DockerPluginProcess {
        &self.0
    }
}

impl Plugin {
    fn start(sb: &Sandbox, args: &[&str]) -> Plugin {
        let (work, socket) = (sb.join("work"), sb.join("d/csi-isolator.sock"));
        Plugin(DockerPluginProcess::start(sb, BIN, &work, &socket, args))
    }

    fn stop(self, sb: &Sandbox, signal: Signal) -> ExitStatus {
        self.0.stop(sb, signal)
    }

    /// One POST; the status and the JSON answer.
    async fn post(&self, endpoint: &str, body: Value) -> (u16, Value) {
        let (status, text) = request(&self.socket, "POST", endpoint, &body.to_string()).await;
        let value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("{endpoint}: answer is not JSON ({e}): {text}"));
        (status, value)
    }

    /// A POST that must succeed: its answer.
    async fn ok(&self, endpoint: &str, body: Value) -> Value {
        let (status, answer) = self.post(endpoint, body).await;
        assert_eq!(status, 200, "{endpoint}: {answer}");
        assert_eq!(
            answer.get("Err").and_then(Value::as_str).unwrap_or(""),
            "",
            "{endpoint}: {answer}"
        );
        answer
    }

    /// A POST that must fail: its `Err`.
    async fn err(&self, endpoint: &str, body: Value) -> String {
        let (status, answer) = self.post(endpoint, body).await;
        assert_eq!(status, 500, "{endpoint}: {answer}");
        answer["Err"].as_str().expect("an Err").to_string()
    }
}

/// One HTTP/1.1 request on the socket; the status and the body.
async fn request(socket: &Path, method: &str, path: &str, body: &str) -> (u16, String) {
    let exchange = async {
        let mut s = tokio::net::UnixStream::connect(socket).await.unwrap();
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: plugin\r\nContent-Type: {CONTENT_TYPE}\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        s.write_all(head.as_bytes()).await.unwrap();
        // A server that refuses a large body may close before reading it all.
        let _ = s.write_all(body.as_bytes()).await;
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out).await;
        String::from_utf8(out).unwrap()
    };
    let text = tokio::time::timeout(TIMEOUT, exchange)
        .await
        .unwrap_or_else(|_| panic!("{path}: no answer within {TIMEOUT:?}"));
    let (head, body) = text
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("{path}: no HTTP answer: {text:?}"));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("{path}: no status: {head}"));
    assert!(
        head.to_ascii_lowercase()
            .contains(&format!("content-type: {CONTENT_TYPE}")),
        "{path}: {head}"
    );
    (status, body.to_string())
}

const A: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
const B: &str = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_is_created_inspected_mounted_twice_unmounted_and_removed() {
    require_root();
    let sb = Sandbox::new("docker-life");
    let p = Plugin::start(&sb, &[]);

    let meta = std::fs::metadata(&p.socket).unwrap();
    assert_eq!(
        meta.permissions().mode() & 0o777,
        0o600,
        "the socket is owner-only"
    );
    assert_eq!(meta.uid(), 0);

    assert_eq!(
        p.ok("/Plugin.Activate", json!({})).await,
        json!({"Implements": ["VolumeDriver"]})
    );
    assert_eq!(
        p.ok("/VolumeDriver.Capabilities", json!({})).await,
        json!({"Capabilities": {"Scope": "local"}})
    );
    // Docker asks Get before Create.
    let missing = p.err("/VolumeDriver.Get", json!({"Name": "data"})).await;
    assert!(
        missing.contains("'data'") && missing.contains("no such volume"),
        "{missing}"
    );

    p.ok(
        "/VolumeDriver.Create",
        json!({"Name": "data", "Opts": {"size": "16M", "access-mode": "SINGLE_NODE_WRITER"}}),
    )
    .await;
    // The same Create again is the same volume; other options are refused naming the key.
    p.ok(
        "/VolumeDriver.Create",
        json!({"Name": "data", "Opts": {"size": "16M"}}),
    )
    .await;
    let differs = p
        .err(
            "/VolumeDriver.Create",
            json!({"Name": "data", "Opts": {"size": "16M", "tier": "gold"}}),
        )
        .await;
    assert!(
        differs.contains("tier") && differs.contains("VolumeDriver.Create volume 'data'"),
        "{differs}"
    );
    // Podman leaves Opts out; Docker may send null.
    p.ok(
        "/VolumeDriver.Create",
        json!({"Name": "other", "Opts": null}),
    )
    .await;

    let got = p.ok("/VolumeDriver.Get", json!({"Name": "data"})).await;
    let volume = &got["Volume"];
    assert_eq!(volume["Name"], "data");
    assert_eq!(volume["Mountpoint"], "", "not published yet");
    let status = &volume["Status"];
    assert!(
        status["volume_id"].as_str().is_some_and(|s| !s.is_empty()),
        "{got}"
    );
    assert!(
        status["plugin"].as_str().unwrap().contains("default"),
        "{got}"
    );
    assert_eq!(status["capacity_bytes"], 16 << 20, "{got}");
    assert_eq!(status["users"], json!([]));
    let listed = p.ok("/VolumeDriver.List", json!({})).await;
    let mut names: Vec<&str> = listed["Volumes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["Name"].as_str().unwrap())
        .collect();
    names.sort_unstable();
    assert_eq!(names, ["data", "other"]);
    assert_eq!(
        p.ok("/VolumeDriver.Path", json!({"Name": "data"})).await["Mountpoint"],
        ""
    );

    // Two Mount IDs share one publish.
    let first = p
        .ok("/VolumeDriver.Mount", json!({"Name": "data", "ID": A}))
        .await;
    let mountpoint = PathBuf::from(first["Mountpoint"].as_str().unwrap());
    assert!(mountpoint.starts_with(&p.work), "{}", mountpoint.display());
    assert!(
        is_mounted(&mountpoint),
        "{} is not a mount",
        mountpoint.display()
    );
    std::fs::write(mountpoint.join("file"), b"written").unwrap();
    let second = p
        .ok("/VolumeDriver.Mount", json!({"Name": "data", "ID": B}))
        .await;
    assert_eq!(second["Mountpoint"], first["Mountpoint"]);
    assert_eq!(
        p.ok("/VolumeDriver.Path", json!({"Name": "data"})).await["Mountpoint"],
        first["Mountpoint"]
    );
    let got = p.ok("/VolumeDriver.Get", json!({"Name": "data"})).await;
    assert_eq!(got["Volume"]["Status"]["users"], json!([A, B]));
    assert_eq!(got["Volume"]["Status"]["state"], "PUBLISHED");

    // Remove is refused while mounted, naming the holders.
    let busy = p.err("/VolumeDriver.Remove", json!({"Name": "data"})).await;
    assert!(
        busy.contains(A) && busy.contains(B) && busy.contains("in use"),
        "{busy}"
    );

    p.ok("/VolumeDriver.Unmount", json!({"Name": "data", "ID": A}))
        .await;
    assert!(
        is_mounted(&mountpoint),
        "the second user keeps it published"
    );
    assert_eq!(std::fs::read(mountpoint.join("file")).unwrap(), b"written");
    p.ok("/VolumeDriver.Unmount", json!({"Name": "data", "ID": B}))
        .await;
    assert!(
        !is_mounted(&mountpoint),
        "unpublished after the last Unmount"
    );
    assert!(
        mount_points_under(&p.work).is_empty(),
        "{:?}",
        mount_points_under(&p.work)
    );

    p.ok("/VolumeDriver.Remove", json!({"Name": "data"})).await;
    p.ok("/VolumeDriver.Remove", json!({"Name": "other"})).await;
    let gone = p.err("/VolumeDriver.Get", json!({"Name": "data"})).await;
    assert!(gone.contains("no such volume"), "{gone}");
    assert_eq!(
        p.ok("/VolumeDriver.List", json!({})).await["Volumes"],
        json!([])
    );

    let socket = p.socket.clone();
    assert!(p.stop(&sb, Signal::SIGTERM).success());
    assert!(!socket.exists(), "the socket is removed at exit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_options_and_bad_requests_are_refused_by_name() {
    require_root();
    let sb = Sandbox::new("docker-bad");
    let p = Plugin::start(&sb, &["--scope", "global"]);
    assert_eq!(
        p.ok("/VolumeDriver.Capabilities", json!({})).await,
        json!({"Capabilities": {"Scope": "global"}})
    );
    for (opts, says) in [
        (
            json!({"size": "lots"}),
            "option 'size': invalid size 'lots'",
        ),
        (
            json!({"access-mode": "RWX"}),
            "option 'access-mode': unknown CSI access mode 'RWX'",
        ),
        (
            json!({"mount-flags": ""}),
            "option 'mount-flags': empty value",
        ),
        (json!({"bad key": "x"}), "option 'bad key'"),
        (
            json!({"csi.storage.k8s.io/node-stage-secret-name": "s"}),
            "secret",
        ),
    ] {
        let e = p
            .err("/VolumeDriver.Create", json!({"Name": "v", "Opts": opts}))
            .await;
        assert!(
            e.contains("VolumeDriver.Create volume 'v'") && e.contains(says),
            "{opts}: {e}"
        );
    }
    let e = p
        .err("/VolumeDriver.Create", json!({"Name": "bad\u{7}name"}))
        .await;
    assert!(e.contains("control character"), "{e}");
    assert_eq!(
        p.ok("/VolumeDriver.List", json!({})).await["Volumes"],
        json!([]),
        "nothing was created"
    );

    p.ok("/VolumeDriver.Create", json!({"Name": "v"})).await;
    let e = p.err("/VolumeDriver.Mount", json!({"Name": "v"})).await;
    assert!(
        e.contains("VolumeDriver.Mount") && e.contains("no ID"),
        "{e}"
    );
    let e = p
        .err("/VolumeDriver.Mount", json!({"Name": "v", "ID": "../x"}))
        .await;
    assert!(e.contains("container id") && e.contains("'v'"), "{e}");
    let e = p
        .err("/VolumeDriver.Mount", json!({"Name": "nope", "ID": A}))
        .await;
    assert!(e.contains("'nope'") && e.contains("no such volume"), "{e}");
    let (status, text) = request(&p.socket, "POST", "/VolumeDriver.Create", "{not json").await;
    assert_eq!(status, 500, "{text}");
    assert!(text.contains("not valid JSON"), "{text}");

    let (status, text) = request(&p.socket, "POST", "/VolumeDriver.Nope", "{}").await;
    assert_eq!(status, 404, "{text}");
    let (status, text) = request(&p.socket, "GET", "/VolumeDriver.List", "").await;
    assert_eq!(status, 405, "{text}");
    let huge = json!({"Name": "v", "Opts": {"k": "x".repeat(200 * 1024)}}).to_string();
    let (status, text) = request(&p.socket, "POST", "/VolumeDriver.Create", &huge).await;
    assert_eq!(status, 413, "{text}");
    assert!(text.contains("over 65536 bytes"), "{text}");
    // A head past the 16 KiB hyper is allowed to buffer: refused (431) or the connection closed,
    // never served, never held open.
    let answer = tokio::time::timeout(TIMEOUT, async {
        let mut s = tokio::net::UnixStream::connect(&p.socket).await.unwrap();
        let head = format!(
            "POST /VolumeDriver.List HTTP/1.1\r\nHost: plugin\r\nX-Big: {}\r\nContent-Length: 2\r\n\r\n{{}}",
            "x".repeat(64 * 1024)
        );
        // The server may close before reading it all.
        let _ = s.write_all(head.as_bytes()).await;
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out).await;
        String::from_utf8_lossy(&out).into_owned()
    })
    .await
    .expect("an oversized head is answered or closed in time");
    assert!(
        answer.is_empty() || answer.starts_with("HTTP/1.1 431"),
        "an oversized head was served: {answer:?}"
    );
    // Still serving.
    p.ok("/VolumeDriver.Remove", json!({"Name": "v"})).await;
    assert!(p.stop(&sb, Signal::SIGTERM).success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_csi_publish_answers_its_error_and_leaves_nothing_mounted() {
    require_root();
    let sb = Sandbox::new("docker-fail");
    let p = Plugin::start(
        &sb,
        &["--plugin-arg=--fail=NodePublishVolume=PERMISSION_DENIED"],
    );
    p.ok(
        "/VolumeDriver.Create",
        json!({"Name": "v", "Opts": {"size": "8M"}}),
    )
    .await;
    let e = p
        .err("/VolumeDriver.Mount", json!({"Name": "v", "ID": A}))
        .await;
    assert!(
        e.contains("VolumeDriver.Mount volume 'v'")
            && e.contains("NodePublishVolume")
            && e.contains("PERMISSION_DENIED: NodePublishVolume: injected fault"),
        "{e}"
    );
    assert!(
        mount_points_under(&p.work).is_empty(),
        "{:?}",
        mount_points_under(&p.work)
    );
    let got = p.ok("/VolumeDriver.Get", json!({"Name": "v"})).await;
    assert_eq!(got["Volume"]["Status"]["users"], json!([]), "{got}");
    assert_eq!(got["Volume"]["Mountpoint"], "");
    p.ok("/VolumeDriver.Remove", json!({"Name": "v"})).await;
    assert!(p.stop(&sb, Signal::SIGTERM).success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mounts_outlive_a_stopped_or_killed_plugin_and_the_next_one_serves_the_unmount() {
    require_root();
    let sb = Sandbox::new("docker-kill");
    let p = Plugin::start(&sb, &[]);
    p.ok(
        "/VolumeDriver.Create",
        json!({"Name": "v", "Opts": {"size": "8M"}}),
    )
    .await;
    let mounted = p
        .ok("/VolumeDriver.Mount", json!({"Name": "v", "ID": A}))
        .await;
    let mountpoint = PathBuf::from(mounted["Mountpoint"].as_str().unwrap());
    std::fs::write(mountpoint.join("file"), b"kept").unwrap();

    // SIGTERM: the volume in use stays published.
    assert!(p.stop(&sb, Signal::SIGTERM).success());
    assert!(
        is_mounted(&mountpoint),
        "SIGTERM left the volume in use published"
    );

    // SIGKILL, the next one keeps it and serves the Unmount.
    let p = Plugin::start(&sb, &[]);
    assert!(is_mounted(&mountpoint));
    let got = p.ok("/VolumeDriver.Get", json!({"Name": "v"})).await;
    assert_eq!(got["Volume"]["Status"]["users"], json!([A]));
    assert_eq!(got["Volume"]["Mountpoint"], mounted["Mountpoint"]);
    let status = p.stop(&sb, Signal::SIGKILL);
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(9)
    );
    assert!(is_mounted(&mountpoint), "a killed plugin leaves the mount");
    assert_eq!(std::fs::read(mountpoint.join("file")).unwrap(), b"kept");

    let p = Plugin::start(&sb, &[]);
    assert!(
        is_mounted(&mountpoint),
        "recovery keeps a volume with a user published"
    );
    p.ok("/VolumeDriver.Unmount", json!({"Name": "v", "ID": A}))
        .await;
    assert!(!is_mounted(&mountpoint));
    assert!(
        mount_points_under(&p.work).is_empty(),
        "{:?}",
        mount_points_under(&p.work)
    );
    p.ok("/VolumeDriver.Remove", json!({"Name": "v"})).await;
    assert!(p.stop(&sb, Signal::SIGTERM).success());
}

/// Connects as `nobody` and sends a request: 0 when closed without an
/// answer, 1 when answered.
fn ask_as_nobody(socket: &Path) -> Result<u8, Errno> {
    let errno = |e: &std::io::Error| Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO));
    let mut s = std::os::unix::net::UnixStream::connect(socket).map_err(|e| errno(&e))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(|e| errno(&e))?;
    let _ =
        s.write_all(b"POST /VolumeDriver.List HTTP/1.1\r\nHost: p\r\nContent-Length: 2\r\n\r\n{}");
    let mut buf = [0u8; 64];
    match s.read(&mut buf) {
        Ok(0) => Ok(0),
        Ok(_) => Ok(1),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => Ok(0),
        Err(e) => Err(errno(&e)),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_root_may_use_the_socket() {
    require_root();
    let sb = Sandbox::new("docker-peer");
    let p = Plugin::start(&sb, &[]);
    // Let other users reach the socket's directory: the socket itself must refuse them.
    let dir = p.socket.parent().unwrap();
    assert_eq!(
        std::fs::metadata(dir).unwrap().permissions().mode() & 0o777,
        0o700
    );
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711)).unwrap();
    // The file mode refuses other users first...
    assert_eq!(
        as_nobody(|| ask_as_nobody(&p.socket)),
        Outcome::Failed(Errno::EACCES)
    );
    // ...and with the socket opened to all, the peer's credentials do.
    std::fs::set_permissions(&p.socket, std::fs::Permissions::from_mode(0o666)).unwrap();
    assert_eq!(
        as_nobody(|| ask_as_nobody(&p.socket)),
        Outcome::Ok(0),
        "a connection from nobody is closed without an answer"
    );
    assert!(
        p.log()
            .contains("docker plugin socket: connection refused: the peer is neither root"),
        "{}",
        p.log()
    );
    p.ok("/VolumeDriver.List", json!({})).await;
    assert!(p.stop(&sb, Signal::SIGTERM).success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_a_mount_in_flight_finish_and_keeps_it_published() {
    require_root();
    let sb = Sandbox::new("docker-drain");
    let calls = sb.join("calls");
    let log_calls = format!("--plugin-arg=--log-calls={}", calls.display());
    let p = Plugin::start(
        &sb,
        &["--plugin-arg=--delay=NodePublishVolume=3000", &log_calls],
    );
    p.ok(
        "/VolumeDriver.Create",
        json!({"Name": "v", "Opts": {"size": "8M"}}),
    )
    .await;
    let socket = p.socket.clone();
    let mount = tokio::spawn(async move {
        request(
            &socket,
            "POST",
            "/VolumeDriver.Mount",
            &json!({"Name": "v", "ID": A}).to_string(),
        )
        .await
    });
    // The Mount is in flight once the plugin got its NodePublishVolume (logged before the delay).
    let started = Instant::now();
    while !std::fs::read_to_string(&calls)
        .unwrap_or_default()
        .contains("NodePublishVolume")
    {
        assert!(
            started.elapsed() < TIMEOUT,
            "the Mount never reached the plugin"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let pid = p.child.id();
    kill(Pid::from_raw(pid as i32), Signal::SIGTERM).unwrap();
    // No new calls once the signal is taken.
    let signalled = Instant::now();
    while tokio::net::UnixStream::connect(&p.socket).await.is_ok() {
        assert!(
            signalled.elapsed() < TIMEOUT,
            "new connections are still taken {TIMEOUT:?} after SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        !mount.is_finished(),
        "the listener closed while the Mount was in flight"
    );
    let (status, text) = mount.await.unwrap();
    assert_eq!(status, 200, "the Mount in flight is answered: {text}");
    let answer: Value = serde_json::from_str(&text).unwrap();
    let mountpoint = PathBuf::from(answer["Mountpoint"].as_str().unwrap());
    assert!(p.stop(&sb, Signal::SIGTERM).success());
    assert!(
        is_mounted(&mountpoint),
        "the drained Mount's volume stays published"
    );

    let p = Plugin::start(&sb, &[]);
    p.ok("/VolumeDriver.Unmount", json!({"Name": "v", "ID": A}))
        .await;
    assert!(!is_mounted(&mountpoint));
    p.ok("/VolumeDriver.Remove", json!({"Name": "v"})).await;
    assert!(p.stop(&sb, Signal::SIGTERM).success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_the_last_unmount_a_volume_stays_published_for_the_unpublish_delay_then_goes() {
    require_root();
    let sb = Sandbox::new("docker-delay");
    let calls = sb.join("calls");
    let log_calls = format!("--plugin-arg=--log-calls={}", calls.display());
    let p = Plugin::start(&sb, &["--unpublish-delay=5", &log_calls]);
    let node_calls = || {
        std::fs::read_to_string(&calls)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.starts_with("Node") && !l.starts_with("NodeGet"))
            .count()
    };
    p.ok(
        "/VolumeDriver.Create",
        json!({"Name": "data", "Opts": {"size": "16M"}}),
    )
    .await;
    let mounted = p
        .ok("/VolumeDriver.Mount", json!({"Name": "data", "ID": A}))
        .await;
    let target = PathBuf::from(mounted["Mountpoint"].as_str().unwrap());
    p.ok("/VolumeDriver.Unmount", json!({"Name": "data", "ID": A}))
        .await;
    assert!(is_mounted(&target), "published during the delay");
    // The next container within the delay gets the same mount, with no call to the plugin.
    let published = node_calls();
    let again = p
        .ok("/VolumeDriver.Mount", json!({"Name": "data", "ID": B}))
        .await;
    assert_eq!(again["Mountpoint"], mounted["Mountpoint"]);
    assert_eq!(
        node_calls(),
        published,
        "{:?}",
        std::fs::read_to_string(&calls)
    );
    let left = Instant::now();
    p.ok("/VolumeDriver.Unmount", json!({"Name": "data", "ID": B}))
        .await;
    while is_mounted(&target) {
        assert!(
            left.elapsed() < Duration::from_secs(20),
            "still published 20 s after the last Unmount (delay 5 s)"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        left.elapsed() >= Duration::from_secs(4),
        "unpublished after {:?}, before the delay",
        left.elapsed()
    );
    // A volume removed while it waits is unpublished and deleted at once.
    p.ok("/VolumeDriver.Mount", json!({"Name": "data", "ID": A}))
        .await;
    p.ok("/VolumeDriver.Unmount", json!({"Name": "data", "ID": A}))
        .await;
    assert!(is_mounted(&target));
    p.ok("/VolumeDriver.Remove", json!({"Name": "data"})).await;
    assert!(!is_mounted(&target), "Remove unpublished it");
    let missing = p.err("/VolumeDriver.Get", json!({"Name": "data"})).await;
    assert!(missing.contains("no such volume"), "{missing}");
    assert!(p.stop(&sb, Signal::SIGTERM).success());
    sb.assert_no_mounts_under();
    sb.assert_no_loop_devices();
}

/// The test's stand-in for a container engine's API: `GET /containers/json?all=1` on a Unix
/// socket, answered with whatever the test sets, each answer served recorded.
struct FakeEngine {
    socket: PathBuf,
    answer: std::sync::Arc<std::sync::Mutex<EngineAnswer>>,
    served: std::sync::Arc<std::sync::Mutex<Vec<&'static str>>>,
    task: tokio::task::JoinHandle<()>,
}

/// What the fake engine answers.
#[derive(Clone)]
enum EngineAnswer {
    /// A 200 with this body; the label names it in `served`.
    Body(&'static str, Vec<u8>),
    /// Raw bytes (a whole HTTP answer, or not).
    Raw(&'static str, Vec<u8>),
    /// Nothing: the connection is held open and never answered.
    Silent,
}

impl EngineAnswer {
    /// A listing of containers, each `(state, [volume names])`.
    fn listing(label: &'static str, containers: &[(&str, &[&str])]) -> EngineAnswer {
        let list: Vec<Value> = containers
            .iter()
            .enumerate()
            .map(|(i, (state, volumes))| {
                json!({
                    "Id": format!("{i:064x}"),
                    "State": state,
                    "Mounts": volumes.iter().map(|v| json!({"Type": "volume", "Name": v, "Driver": "csi-isolator", "Source": "", "Destination": "/data"})).collect::<Vec<_>>(),
                })
            })
            .collect();
        EngineAnswer::Body(label, Value::Array(list).to_string().into_bytes())
    }

    fn label(&self) -> &'static str {
        match self {
            EngineAnswer::Body(l, _) | EngineAnswer::Raw(l, _) => l,
            EngineAnswer::Silent => "silent",
        }
    }
}

impl FakeEngine {
    /// Serves `answer` on `socket` (made 0666 in a directory the test chose).
    fn start(socket: &Path, answer: EngineAnswer) -> FakeEngine {
        let _ = std::fs::remove_file(socket);
        let listener = tokio::net::UnixListener::bind(socket).unwrap();
        let answer = std::sync::Arc::new(std::sync::Mutex::new(answer));
        let served = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (a, s) = (answer.clone(), served.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut conn, _)) = listener.accept().await else {
                    return;
                };
                let (a, s) = (a.clone(), s.clone());
                tokio::spawn(async move {
                    let mut head = Vec::new();
                    let mut buf = [0u8; 4096];
                    while !head.ends_with(b"\r\n\r\n") {
                        match conn.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                    }
                    assert!(
                        head.starts_with(b"GET /containers/json?all=1 HTTP/1.1\r\n"),
                        "{}",
                        String::from_utf8_lossy(&head)
                    );
                    let answer = a.lock().unwrap().clone();
                    s.lock().unwrap().push(answer.label());
                    match answer {
                        EngineAnswer::Body(_, body) => {
                            let head = format!(
                                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
                                body.len()
                            );
                            let _ = conn.write_all(head.as_bytes()).await;
                            let _ = conn.write_all(&body).await;
                        }
                        EngineAnswer::Raw(_, bytes) => {
                            let _ = conn.write_all(&bytes).await;
                        }
                        EngineAnswer::Silent => {
                            tokio::time::sleep(Duration::from_secs(30)).await;
                        }
                    }
                });
            }
        });
        FakeEngine {
            socket: socket.to_path_buf(),
            answer,
            served,
            task,
        }
    }

    fn set(&self, answer: EngineAnswer) {
        *self.answer.lock().unwrap() = answer;
    }

    /// How many answers labelled `label` were served.
    fn served(&self, label: &str) -> usize {
        self.served
            .lock()
            .unwrap()
            .iter()
            .filter(|l| **l == label)
            .count()
    }

    /// Waits (bounded) until `n` answers labelled `label` were served.
    async fn wait_served(&self, label: &str, n: usize) {
        let deadline = tokio::time::Instant::now() + TIMEOUT;
        while self.served(label) < n {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the plugin asked the engine {} times for '{label}', not {n}",
                self.served(label)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn stop(self) {
        self.task.abort();
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// The users `Get` shows for a volume.
async fn users_of(p: &Plugin, name: &str) -> Vec<String> {
    let got = p.ok("/VolumeDriver.Get", json!({"Name": name})).await;
    got["Volume"]["Status"]["users"]
        .as_array()
        .unwrap()
        .iter()
        .map(|u| u.as_str().unwrap().to_string())
        .collect()
}

/// A directory every user may reach, for an engine socket.
fn engine_dir(sb: &Sandbox) -> PathBuf {
    // Root's and closed to others: the plugin refuses an engine socket anyone else could plant.
    sb.mkdir("engine")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_use_made_while_the_engine_lists_no_holder_survives_and_is_released_only_after_two_unheld_listings(
) {
    require_root();
    let sb = Sandbox::new("docker-engine-rule");
    let socket = engine_dir(&sb).join("engine.sock");
    let engine = FakeEngine::start(&socket, EngineAnswer::listing("none", &[]));
    let endpoint = format!("unix://{}", socket.display());
    // The interval is well above a Mount's time (tens of ms here): a listing taken while the
    // Mount runs would otherwise be a first unheld observation of its use.
    let p = Plugin::start(&sb, &["--engine", &endpoint, "--engine-interval", "3"]);
    p.ok("/VolumeDriver.Create", json!({"Name": "v"})).await;
    p.ok("/VolumeDriver.Create", json!({"Name": "w"})).await;

    // A Mount right after a listing that says nothing holds v (Docker's container was not
    // created yet when the engine answered).
    engine.wait_served("none", 1).await;
    let before = engine.served("none");
    engine.wait_served("none", before + 1).await;
    let mounted = p
        .ok("/VolumeDriver.Mount", json!({"Name": "v", "ID": A}))
        .await;
    let mountpoint = PathBuf::from(mounted["Mountpoint"].as_str().unwrap());
    // The next listing still shows no holder: one unheld observation releases nothing.
    let seen = engine.served("none");
    engine.wait_served("none", seen + 1).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(users_of(&p, "v").await, [A], "{}", p.log());
    // Now the container shows (created, then running): v stays held however long.
    engine.set(EngineAnswer::listing("created", &[("created", &["v"])]));
    engine.wait_served("created", 1).await;
    engine.set(EngineAnswer::listing(
        "running",
        &[("running", &["v"]), ("exited", &["w"])],
    ));
    engine.wait_served("running", 2).await;
    assert_eq!(users_of(&p, "v").await, [A]);
    assert!(is_mounted(&mountpoint));

    // The container exits without an Unmount: two listings an interval apart release A.
    engine.set(EngineAnswer::listing("exited", &[("exited", &["v"])]));
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    while !users_of(&p, "v").await.is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "{}", p.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        engine.served("exited") >= 2,
        "released after {} unheld listing(s)",
        engine.served("exited")
    );
    assert!(
        !is_mounted(&mountpoint),
        "the last use's release unpublished it"
    );
    assert!(mount_points_under(&p.work).is_empty());
    let log = p.log();
    let released = log
        .lines()
        .find(|l| l.contains("engine reconciliation: releasing a use"))
        .unwrap_or_else(|| panic!("no release logged: {log}"));
    assert!(
        released.contains("INFO") && released.contains(A) && released.contains("volume"),
        "{released}"
    );
    // The volume itself stays; a new Mount works as before.
    p.ok("/VolumeDriver.Mount", json!({"Name": "v", "ID": B}))
        .await;
    p.ok("/VolumeDriver.Unmount", json!({"Name": "v", "ID": B}))
        .await;
    p.ok("/VolumeDriver.Remove", json!({"Name": "v"})).await;
    p.ok("/VolumeDriver.Remove", json!({"Name": "w"})).await;
    assert!(p.stop(&sb, Signal::SIGTERM).success());
    engine.stop();
}

/// Serves `GET /containers/json` as `nobody` on `socket` for `secs` seconds, answering that
/// nothing holds anything: how many connections it accepted. The socket is bound by root (in a
/// directory only root may write) and listened on again by `nobody`: a connection carries the
/// credentials of the last `listen`, so the plugin sees a socket served by `nobody`.
fn serve_as_nobody(socket: &Path, secs: u64) -> u8 {
    use std::os::fd::AsRawFd;
    let listener = std::os::unix::net::UnixListener::bind(socket).expect("bind the engine socket");
    let outcome = as_nobody(move || {
        let errno = |e: std::io::Error| Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO));
        // SAFETY: listen(2) on a socket this process owns.
        if unsafe { libc::listen(listener.as_raw_fd(), 16) } != 0 {
            return Err(Errno::last());
        }
        listener.set_nonblocking(true).map_err(errno)?;
        let deadline = std::time::Instant::now() + Duration::from_secs(secs);
        let mut accepted = 0u8;
        while std::time::Instant::now() < deadline {
            match listener.accept() {
                Ok((mut s, _)) => {
                    accepted = accepted.saturating_add(1);
                    let _ = s.set_nonblocking(false);
                    let _ = s.write_all(
                        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n[]",
                    );
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
        Ok(accepted.min(127))
    });
    match outcome {
        Outcome::Ok(n) => n,
        other => panic!("the engine as nobody failed: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_or_absent_engine_answers_release_nothing() {
    require_root();
    let sb = Sandbox::new("docker-engine-hostile");
    let socket = engine_dir(&sb).join("engine.sock");
    let endpoint = format!("unix://{}", socket.display());
    // No engine yet: unreachable.
    let p = Plugin::start(
        &sb,
        &[
            "--engine",
            &endpoint,
            "--engine-interval",
            "1",
            "--engine-timeout",
            "1",
        ],
    );
    p.ok("/VolumeDriver.Create", json!({"Name": "v"})).await;
    let mounted = p
        .ok("/VolumeDriver.Mount", json!({"Name": "v", "ID": A}))
        .await;
    let mountpoint = PathBuf::from(mounted["Mountpoint"].as_str().unwrap());
    let kept = |p: &Plugin, what: &str| {
        let log = p.log();
        assert!(is_mounted(&mountpoint), "{what}: {log}");
        log
    };
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(users_of(&p, "v").await, [A]);
    let log = kept(&p, "unreachable");
    assert!(
        log.contains(&format!("engine {endpoint}: connect"))
            && log.contains("no listing this round, so nothing is released"),
        "{log}"
    );

    let oversized = {
        let mut body = b"[".to_vec();
        body.resize(33 << 20, b' ');
        body.push(b']');
        body
    };
    let engine = FakeEngine::start(&socket, EngineAnswer::listing("none", &[]));
    for (answer, step) in [
        (
            EngineAnswer::Body("garbage", b"[{\"State\":\"exited\",".to_vec()),
            "parse the answer of GET /containers/json?all=1 as a list of containers",
        ),
        (
            EngineAnswer::Body("oversized", oversized),
            "read the answer of GET /containers/json?all=1: over 33554432 bytes",
        ),
        (
            EngineAnswer::Silent,
            "send GET /containers/json and read the answer's head: not done within 1 s",
        ),
        (
            EngineAnswer::Raw(
                "status",
                b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 2\r\n\r\n[]".to_vec(),
            ),
            "GET /containers/json?all=1 answered 500",
        ),
    ] {
        let label = answer.label();
        engine.set(answer);
        engine.wait_served(label, 3).await;
        assert_eq!(users_of(&p, "v").await, [A], "{label}");
        let log = kept(&p, label);
        assert!(
            log.contains(&format!("engine {endpoint}: {step}")),
            "{label}: {log}"
        );
    }
    engine.stop();

    // An engine socket served by another user than root is not asked at all.
    let accepted = tokio::task::spawn_blocking({
        let socket = socket.clone();
        move || serve_as_nobody(&socket, 4)
    })
    .await
    .unwrap();
    assert!(accepted >= 2, "the plugin tried {accepted} time(s)");
    let _ = std::fs::remove_file(&socket);
    assert_eq!(users_of(&p, "v").await, [A]);
    let log = kept(&p, "nobody");
    assert!(
        log.contains(&format!(
            "engine {endpoint}: its socket is served by uid 65534, not root"
        )),
        "{log}"
    );

    // The control: a root engine saying nothing holds v gets A released.
    let engine = FakeEngine::start(&socket, EngineAnswer::listing("none", &[]));
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    while !users_of(&p, "v").await.is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "{}", p.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(engine.served("none") >= 2);
    assert!(!is_mounted(&mountpoint));
    p.ok("/VolumeDriver.Remove", json!({"Name": "v"})).await;
    assert!(p.stop(&sb, Signal::SIGTERM).success());
    engine.stop();
}

#[test]
fn a_bad_engine_endpoint_or_an_engine_flag_without_engine_is_refused_before_anything_starts() {
    require_root();
    let sb = Sandbox::new("docker-engine-flags");
    let work = sb.join("work");
    let socket = sb.join("d/csi-isolator.sock");
    // An engine socket where another user could put one of their choosing.
    let theirs = sb.mkdir("nobody-owns");
    nix::unistd::chown(&theirs, Some(nix::unistd::Uid::from_raw(65534)), None).unwrap();
    let open_to_all = sb.mkdir("open-to-all");
    std::fs::set_permissions(&open_to_all, std::fs::Permissions::from_mode(0o777)).unwrap();
    let in_theirs = format!("unix://{}/docker.sock", theirs.display());
    let in_open = format!("unix://{}/docker.sock", open_to_all.display());
    for (args, expected) in [
        (&["--engine", in_theirs.as_str()][..], "engine socket dir"),
        (&["--engine", in_open.as_str()][..], "engine socket dir"),
        (
            &["--engine", "tcp://127.0.0.1:2375"][..],
            "expected unix:///ABSOLUTE/PATH",
        ),
        (
            &["--engine", "/var/run/docker.sock"][..],
            "expected unix:///",
        ),
        (&["--engine-interval", "5"][..], "--engine"),
        (
            &["--engine", "unix:///run/x.sock", "--engine-interval", "0"][..],
            "--engine-interval",
        ),
    ] {
        let out = csi_isolator_testing::isolator_command(BIN, &work)
            .arg("docker-plugin")
            .arg("--socket")
            .arg(&socket)
            .args(args)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}: {stderr}");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
        assert!(
            !socket.exists() && !work.exists(),
            "{args:?} made something"
        );
    }
}

/// `csi-isolator volume ARGS` on the plugin's work dir (while no plugin runs): its stderr.
fn volume_command(work: &Path, args: &[&str]) -> String {
    let out = csi_isolator_testing::isolator_command(BIN, work)
        .arg("volume")
        .args(args)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "volume {args:?}: {stderr}");
    stderr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bare_mount_id_of_an_earlier_version_is_kept_by_the_engine_and_ended_by_unmount_and_a_use_is_released_by_hand(
) {
    require_root();
    let sb = Sandbox::new("docker-users");
    let socket = engine_dir(&sb).join("engine.sock");
    let engine = FakeEngine::start(&socket, EngineAnswer::listing("none", &[]));
    let endpoint = format!("unix://{}", socket.display());
    let args = ["--engine", endpoint.as_str(), "--engine-interval", "1"];
    let p = Plugin::start(&sb, &args);
    p.ok("/VolumeDriver.Create", json!({"Name": "v"})).await;
    let work = p.work.clone();
    assert!(p.stop(&sb, Signal::SIGTERM).success());

    // An earlier version recorded the bare Mount ID (as `volume publish` records a container).
    let mountpoint = PathBuf::from(
        String::from_utf8(
            csi_isolator_testing::isolator_command(BIN, &work)
                .args(["volume", "publish", "v", "--container", A])
                .output()
                .unwrap()
                .stdout,
        )
        .unwrap()
        .trim(),
    );
    assert!(is_mounted(&mountpoint));
    let p = Plugin::start(&sb, &args);
    let served = engine.served("none");
    engine.wait_served("none", served + 3).await;
    assert_eq!(
        users_of(&p, "v").await,
        [A],
        "the engine says nothing holds v, but a bare ID is not docker-plugin's to release"
    );
    assert!(is_mounted(&mountpoint));
    p.ok("/VolumeDriver.Unmount", json!({"Name": "v", "ID": A}))
        .await;
    assert!(!is_mounted(&mountpoint), "Unmount ends the bare ID too");

    // A use whose Unmount never came, released by hand while no plugin runs.
    p.ok("/VolumeDriver.Mount", json!({"Name": "v", "ID": B}))
        .await;
    assert!(is_mounted(&mountpoint));
    assert!(p.stop(&sb, Signal::SIGTERM).success());
    volume_command(
        &work,
        &["release", "v", "--container", &format!("docker-plugin/{B}")],
    );
    assert!(!is_mounted(&mountpoint));
    volume_command(&work, &["destroy", "v"]);
    assert!(mount_points_under(&work).is_empty());
    engine.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mount_its_caller_stopped_waiting_for_is_undone_when_it_finishes() {
    require_root();
    let sb = Sandbox::new("docker-late");
    // Every NodePublishVolume takes 3 s; the engine is answered after 1 s.
    let p = Plugin::start(
        &sb,
        &[
            "--call-timeout=1",
            "--plugin-arg=--delay=NodePublishVolume=3000",
        ],
    );
    p.ok(
        "/VolumeDriver.Create",
        json!({"Name": "v", "Opts": {"size": "16M"}}),
    )
    .await;
    let no_use_left = |what: &'static str| {
        let p = &p;
        async move {
            let started = Instant::now();
            loop {
                // Get waits for the Mount under way; past the 1 s call timeout it answers 500.
                let (status, got) = p.post("/VolumeDriver.Get", json!({"Name": "v"})).await;
                if status == 200
                    && got["Volume"]["Status"]["users"] == json!([])
                    && mount_points_under(&p.work).is_empty()
                {
                    return;
                }
                assert!(
                    started.elapsed() < Duration::from_secs(20),
                    "{what}: the late Mount was not undone: {got}\n{}",
                    p.log()
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };

    // Answered at the call timeout, naming it and what to raise; undone once it ends.
    let started = Instant::now();
    let err = p
        .err("/VolumeDriver.Mount", json!({"Name": "v", "ID": A}))
        .await;
    assert!(
        started.elapsed() < Duration::from_millis(2500),
        "answered after {:?}",
        started.elapsed()
    );
    assert!(
        err.contains("not done within 1 s") && err.contains("volume_plugin_timeout"),
        "{err}"
    );
    no_use_left("after the call timeout").await;
    assert!(p.log().contains("undone"), "{}", p.log());

    // A caller that hangs up (as Podman does after its 5 s) gets the same.
    let socket = p.socket.clone();
    let body = json!({"Name": "v", "ID": B}).to_string();
    let gone =
        tokio::spawn(async move { request(&socket, "POST", "/VolumeDriver.Mount", &body).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    gone.abort();
    let _ = gone.await;
    no_use_left("after the caller left").await;

    // A Mount in time is kept.
    let p2_args = ["--plugin-arg=--delay=NodePublishVolume=3000"];
    assert!(p.stop(&sb, Signal::SIGTERM).success());
    let p = Plugin::start(&sb, &p2_args);
    let mounted = p
        .ok("/VolumeDriver.Mount", json!({"Name": "v", "ID": A}))
        .await;
    assert!(is_mounted(Path::new(
        mounted["Mountpoint"].as_str().unwrap()
    )));
    p.ok("/VolumeDriver.Unmount", json!({"Name": "v", "ID": A}))
        .await;
    p.ok("/VolumeDriver.Remove", json!({"Name": "v"})).await;
    assert!(p.stop(&sb, Signal::SIGTERM).success());
    sb.assert_no_mounts_under();
    sb.assert_no_loop_devices();
}

/// `Get` of a published volume carries its usage and condition from NodeGetVolumeStats
/// (issue 15's "the Docker plugin's Get Status"): what a writer adds shows within a block, a
/// volume whose backing went away shows abnormal, and an unpublished volume has no figures
/// (nothing is asked of the plugin for it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_shows_a_published_volumes_usage_and_condition() {
    require_root();
    const MIB: i64 = 1 << 20;
    const BLOCK: i64 = 4096;
    let sb = Sandbox::new("docker-plugin-get-stats");
    let p = Plugin::start(&sb, &[]);
    p.ok(
        "/VolumeDriver.Create",
        json!({"Name": "data", "Opts": {"size": "64M"}}),
    )
    .await;
    let unpublished = p.ok("/VolumeDriver.Get", json!({"Name": "data"})).await;
    let status = &unpublished["Volume"]["Status"];
    assert!(
        status.get("stats").is_none_or(Value::is_null),
        "{unpublished}"
    );

    let mounted = p
        .ok("/VolumeDriver.Mount", json!({"Name": "data", "ID": A}))
        .await;
    let mountpoint = PathBuf::from(mounted["Mountpoint"].as_str().unwrap());
    let used = |got: &Value| -> i64 {
        got["Volume"]["Status"]["stats"]["bytes_used"]
            .as_i64()
            .unwrap_or_else(|| panic!("no bytes_used: {got}"))
    };
    let before = p.ok("/VolumeDriver.Get", json!({"Name": "data"})).await;
    let total = before["Volume"]["Status"]["stats"]["bytes_total"]
        .as_i64()
        .unwrap();
    assert!((48 * MIB..=64 * MIB).contains(&total), "{before}");
    assert_eq!(
        before["Volume"]["Status"]["condition"]["abnormal"], false,
        "{before}"
    );
    {
        let mut f = std::fs::File::create(mountpoint.join("payload")).unwrap();
        let chunk = vec![0x5au8; MIB as usize];
        for _ in 0..8 {
            f.write_all(&chunk).unwrap();
        }
        f.sync_all().unwrap();
    }
    let after = p.ok("/VolumeDriver.Get", json!({"Name": "data"})).await;
    let grew = used(&after) - used(&before);
    assert!(
        (grew - 8 * MIB).abs() <= BLOCK,
        "used grew by {grew}: {before} -> {after}"
    );

    // What holds the data goes away (moved aside, and back for the cleanup).
    let image = find_below(&p.work.join("csi"), "image.ext4");
    let aside = image.with_extension("moved");
    std::fs::rename(&image, &aside).unwrap();
    let damaged = p.ok("/VolumeDriver.Get", json!({"Name": "data"})).await;
    std::fs::rename(&aside, &image).unwrap();
    let condition = &damaged["Volume"]["Status"]["condition"];
    assert_eq!(condition["abnormal"], true, "{damaged}");
    assert!(
        condition["message"].as_str().unwrap().contains("is gone"),
        "{damaged}"
    );

    p.ok("/VolumeDriver.Unmount", json!({"Name": "data", "ID": A}))
        .await;
    p.ok("/VolumeDriver.Remove", json!({"Name": "data"})).await;
    let work = p.work.clone();
    p.stop(&sb, Signal::SIGTERM);
    assert!(mount_points_under(&work).is_empty());
    sb.assert_no_loop_devices();
}
