//! The `csi-test-plugin` binary as a CO starts it: from `CSI_ENDPOINT`, answering Identity
//! over its socket, refusing a bad flag before it touches anything, and leaving on SIGTERM
//! with its socket removed.
//!
//! Besides testing the binary, this file is why `cargo nextest run --all-targets` (the
//! README's test command) builds it on a clean clone: cargo builds a package's binaries for
//! its integration tests only, and every test of the root package that starts the bundled
//! plugin finds it in the same target directory.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use csi_isolator::csi::proto::identity_client::IdentityClient;
use csi_isolator::csi::proto::{GetPluginInfoRequest, ProbeRequest};
use csi_isolator::csi::transport::{connect_unix, endpoint_for};

const BIN: &str = env!("CARGO_BIN_EXE_csi-test-plugin");

fn wait_for(what: &str, deadline: Duration, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < deadline, "{what} within {deadline:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn it_serves_identity_at_csi_endpoint_and_leaves_on_sigterm_removing_its_socket() {
    let dir = tempfile::tempdir().expect("temporary dir");
    let socket = dir.path().join("csi.sock");
    // Killed however the test ends, so no plugin outlives it.
    struct Reap(std::process::Child);
    impl Drop for Reap {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut child = Reap(
        Command::new(BIN)
            .env("CSI_ENDPOINT", endpoint_for(&socket))
            .arg("--work-dir")
            .arg(dir.path().join("data"))
            .args(["--backing", "dir", "--name", "binary.test.csi"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start csi-test-plugin"),
    );
    let pid = nix::unistd::Pid::from_raw(child.0.id() as i32);
    wait_for("the socket appears", Duration::from_secs(10), || {
        socket.exists() || child.0.try_wait().ok().flatten().is_some()
    });
    assert!(
        child.0.try_wait().unwrap().is_none(),
        "the plugin exited early"
    );

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (name, ready) = runtime.block_on(async {
        let mut identity = IdentityClient::new(connect_unix(&socket).await.expect("connect"));
        let info = identity
            .get_plugin_info(GetPluginInfoRequest {})
            .await
            .expect("GetPluginInfo")
            .into_inner();
        let probe = identity
            .probe(ProbeRequest {})
            .await
            .expect("Probe")
            .into_inner();
        (info.name, probe.ready)
    });
    // The connection goes with the runtime: a graceful shutdown waits for open connections.
    drop(runtime);
    assert_eq!(name, "binary.test.csi");
    assert_eq!(ready, Some(true));

    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).expect("SIGTERM");
    let mut status = None;
    wait_for(
        "the plugin exits on SIGTERM",
        Duration::from_secs(10),
        || {
            status = child.0.try_wait().expect("wait");
            status.is_some()
        },
    );
    assert!(status.unwrap().success(), "exit status {status:?}");
    assert!(!socket.exists(), "the socket is removed on SIGTERM");
}

#[test]
fn an_unknown_backing_is_refused_before_anything_is_made() {
    let dir = tempfile::tempdir().expect("temporary dir");
    let work = dir.path().join("data");
    let out = Command::new(BIN)
        .args(["--endpoint", &endpoint_for(&dir.path().join("csi.sock"))])
        .arg("--work-dir")
        .arg(&work)
        .args(["--backing", "tape"])
        .output()
        .expect("run csi-test-plugin");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("tape"), "names the bad value: {stderr}");
    assert!(!Path::new(&work).exists(), "made nothing: {stderr}");
    assert!(!dir.path().join("csi.sock").exists());
}

#[test]
fn a_require_secrets_file_others_can_read_is_refused_before_anything_is_made() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("temporary dir");
    let work = dir.path().join("data");
    let secrets = dir.path().join("secrets.json");
    std::fs::write(
        &secrets,
        r#"{"node_stage": {"password": "hunter2-never-shown"}}"#,
    )
    .unwrap();
    std::fs::set_permissions(&secrets, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = Command::new(BIN)
        .args(["--endpoint", &endpoint_for(&dir.path().join("csi.sock"))])
        .arg("--work-dir")
        .arg(&work)
        .arg("--require-secrets")
        .arg(&secrets)
        .output()
        .expect("run csi-test-plugin");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("--require-secrets {}", secrets.display()))
            && stderr.contains("open to group or others"),
        "names the file and the problem: {stderr}"
    );
    assert!(!stderr.contains("hunter2"), "{stderr}");
    assert!(!Path::new(&work).exists(), "made nothing: {stderr}");
}
