//! CSI secrets from a volume's secrets file, end to end against the bundled plugin in
//! `--require-secrets` mode (it refuses any RPC whose secrets are not exactly those of its
//! operation): each operation's secret reaches exactly its RPCs, a swapped mapping fails at the
//! RPC it reaches, a rotated file is used at the next call, a restarted provider still sends
//! them (the checkpoint holds the path), and bad files are refused by name before anything is
//! written or sent. After each run the secret values are looked for, and must be absent, in
//! every file under the work dir (checkpoints, the managed plugin's log at TRACE), in the
//! plugin's call log, in this process's own logs at TRACE (tonic and h2 included), in
//! `status --json` and in the metrics.

use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use csi_isolator::error_chain::full_message;
use csi_isolator::provider::bundled::bundled_config;
use csi_isolator::provider::{CreateSpec, ImportSpec, ProviderConfig, StorageProvider};
use csi_isolator_testing::{isolator_command, plugin_bin, require_root, Sandbox};

const CLI: &str = env!("CARGO_BIN_EXE_csi-isolator");
const MIB: u64 = 1024 * 1024;

/// Everything this test process logs, at TRACE, every target (one subscriber per process);
/// the managed plugin inherits RUST_LOG, so its log (under the work dir) is at TRACE too.
fn logs() {
    csi_isolator_testing::logs::capture(tracing::Level::TRACE);
    std::env::set_var("RUST_LOG", "trace");
}

use csi_isolator_testing::logs::captured;

/// Secret values unique to this run, one per operation: `<op>-<tag>-<unique>`.
struct Values {
    unique: String,
}

impl Values {
    fn new() -> Values {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        Values {
            unique: format!("{}x{nanos}", std::process::id()),
        }
    }

    fn of(&self, op: &str, tag: &str) -> String {
        format!("SeCrEt-{op}-{tag}-{}", self.unique)
    }

    /// A secrets file's JSON: every operation its own value (under the key `token`), with
    /// `tag`; `swap` exchanges the values of two operations.
    fn file(&self, tag: &str, swap: Option<(&str, &str)>) -> String {
        let mut ops: BTreeMap<&str, String> = [
            "create",
            "controller_publish",
            "node_stage",
            "node_publish",
            "controller_expand",
            "node_expand",
        ]
        .into_iter()
        .map(|op| (op, self.of(op, tag)))
        .collect();
        if let Some((a, b)) = swap {
            let (va, vb) = (ops[a].clone(), ops[b].clone());
            ops.insert(a, vb);
            ops.insert(b, va);
        }
        let json: serde_json::Map<String, serde_json::Value> = ops
            .into_iter()
            .map(|(op, v)| {
                (
                    op.to_string(),
                    serde_json::json!({ "user": "csi", "token": v }),
                )
            })
            .collect();
        serde_json::Value::Object(json).to_string()
    }

    /// What every value of every tag holds, for the search.
    fn needle(&self) -> String {
        format!("-{}", self.unique)
    }
}

/// Writes a secrets file root's alone (0600), replacing the content in place.
fn write_secrets(path: &Path, text: &str) {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .unwrap();
    f.write_all(text.as_bytes()).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
}

struct Setup {
    sb: Sandbox,
    work: PathBuf,
    /// What the plugin requires.
    plugin_file: PathBuf,
    /// What the volume's calls carry.
    volume_file: PathBuf,
    calls: PathBuf,
    values: Values,
}

impl Setup {
    fn new(label: &str) -> Setup {
        require_root();
        logs();
        let sb = Sandbox::new(label);
        let work = sb.mkdir("work");
        let dir = sb.mkdir("secrets");
        let values = Values::new();
        let plugin_file = dir.join("plugin.json");
        let volume_file = dir.join("volume.json");
        write_secrets(&plugin_file, &values.file("v1", None));
        write_secrets(&volume_file, &values.file("v1", None));
        let calls = sb.join("calls.log");
        Setup {
            sb,
            work,
            plugin_file,
            volume_file,
            calls,
            values,
        }
    }

    fn config(&self) -> ProviderConfig {
        let args: Vec<String> = [
            "--backing",
            "dir",
            "--require-secrets",
            self.plugin_file.to_str().unwrap(),
            "--log-calls",
            self.calls.to_str().unwrap(),
        ]
        .map(String::from)
        .to_vec();
        let mut c = bundled_config(Path::new(plugin_bin()), &self.work, "default", &args);
        c.ready_timeout = Duration::from_secs(10);
        c.socket_dir = self.sb.join("s");
        c
    }

    async fn start(&self) -> Arc<StorageProvider> {
        let p = StorageProvider::start(self.config())
            .await
            .unwrap_or_else(|e| panic!("start the provider: {}", full_message(&e)));
        if let Some(pid) = p.plugin_pid() {
            self.sb.track(pid);
        }
        p
    }

    /// Creates `name` with the volume's secrets file; its id.
    async fn create(&self, p: &StorageProvider, name: &str) -> String {
        p.create_volume(self.spec(name))
            .await
            .unwrap_or_else(|e| panic!("create {name}: {}", full_message(&e)))
            .source_id()
            .unwrap()
            .to_string()
    }

    fn spec(&self, name: &str) -> CreateSpec {
        let mut spec = CreateSpec::new(name, 4 * MIB);
        spec.secrets_file = Some(self.volume_file.clone());
        spec
    }

    /// The plugin's call log: `<RPC> <volume>` lines, readiness probes left out.
    fn calls(&self) -> Vec<String> {
        std::fs::read_to_string(&self.calls)
            .unwrap_or_default()
            .lines()
            .filter(|l| {
                !l.starts_with("Probe") && !l.starts_with("Get") && !l.contains("GetCapabilities")
            })
            .map(|l| l.split(' ').next().unwrap().to_string())
            .collect()
    }

    /// Fails if a secret value is in any file under the work dir (checkpoints, intents, the
    /// managed plugin's log and data), in the call log, in this process's logs or in `status`.
    fn assert_no_secret_anywhere(&self, also: &[(&str, &str)]) {
        let needle = self.values.needle();
        let mut files = Vec::new();
        walk(&self.work, &mut files);
        files.push(self.calls.clone());
        let plugin_log = files.iter().find(|f| f.ends_with("plugin.log")).unwrap();
        assert!(
            std::fs::read_to_string(plugin_log)
                .unwrap()
                .contains("TRACE"),
            "the plugin logged at TRACE (the search is not vacuous)"
        );
        for f in &files {
            let bytes = std::fs::read(f).unwrap_or_default();
            assert!(
                !String::from_utf8_lossy(&bytes).contains(&needle),
                "a secret value is in {}",
                f.display()
            );
        }
        let logs = captured();
        assert!(
            logs.contains("NodeStageVolume") || logs.contains("CreateVolume"),
            "this process's logs hold the calls (the search is not vacuous)"
        );
        assert!(
            !logs.contains(&needle),
            "a secret value is in this process's logs"
        );
        let status = isolator_command(CLI, &self.work)
            .args(["status", "--json"])
            .output()
            .unwrap();
        let status = String::from_utf8_lossy(&status.stdout).into_owned();
        assert!(status.contains("volume"), "status answered: {status}");
        assert!(
            !status.contains(&needle),
            "a secret value is in status: {status}"
        );
        for (what, text) in also {
            assert!(
                !text.contains(&needle),
                "a secret value is in {what}: {text}"
            );
        }
    }
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let Ok(t) = e.file_type() else { continue };
        if t.is_dir() {
            walk(&e.path(), out);
        } else if t.is_file() {
            out.push(e.path());
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_operations_secrets_reach_exactly_its_rpcs_and_nowhere_else() {
    let s = Setup::new("secrets-reach");
    let p = s.start().await;
    let id = p
        .create_volume(s.spec("vault"))
        .await
        .unwrap_or_else(|e| panic!("create: {}", full_message(&e)))
        .source_id()
        .unwrap()
        .to_string();
    let recorded = p.volume(&id).await.unwrap();
    assert_eq!(
        recorded.secrets_file.as_deref(),
        Some(s.volume_file.as_path())
    );
    let mp = p
        .publish(&id, "c1")
        .await
        .unwrap_or_else(|e| panic!("publish: {}", full_message(&e)));
    assert!(mp.exists());
    let metrics = p.client().metrics().encode_prometheus("csi_isolator");
    assert!(metrics.contains("NodeStageVolume"), "{metrics}");
    let checkpoint = String::from_utf8(
        csi_isolator::provider::checkpoint::read_state(p.layout(), &id)
            .unwrap()
            .expect("a checkpoint"),
    )
    .unwrap();
    assert!(
        checkpoint.contains(s.volume_file.to_str().unwrap()),
        "the checkpoint holds the reference: {checkpoint}"
    );
    // While it is published (status reads the checkpoints and the mount table).
    s.assert_no_secret_anywhere(&[("metrics", &metrics)]);
    p.release(&id, "c1").await.unwrap();
    p.destroy_volume(&id).await.unwrap();
    // Every RPC that carries secrets was sent, and accepted: the plugin refuses any whose
    // secrets are not exactly those of its operation.
    let calls = s.calls();
    for rpc in [
        "CreateVolume",
        "ControllerPublishVolume",
        "NodeStageVolume",
        "NodePublishVolume",
        "NodeUnpublishVolume",
        "NodeUnstageVolume",
        "ControllerUnpublishVolume",
        "DeleteVolume",
    ] {
        assert!(calls.iter().any(|c| c == rpc), "{rpc} not sent: {calls:?}");
    }
    p.shutdown(Duration::from_secs(5)).await;
    s.assert_no_secret_anywhere(&[]);
    s.sb.assert_no_mounts_under();
}

/// Two operations' secrets swapped in the volume's file: the first RPC of either is refused
/// (UNAUTHENTICATED naming the key, never a value), and nothing stays half-published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_swapped_mapping_fails_at_the_rpc_it_reaches() {
    let s = Setup::new("secrets-swap");
    write_secrets(
        &s.volume_file,
        &s.values.file("v1", Some(("node_stage", "node_publish"))),
    );
    let p = s.start().await;
    let id = s.create(&p, "swapped").await;
    let err = p.publish(&id, "c1").await.unwrap_err();
    let msg = full_message(&err);
    assert_eq!(err.csi_code(), Some(tonic::Code::Unauthenticated), "{msg}");
    assert!(msg.contains("NodeStageVolume"), "{msg}");
    assert!(msg.contains("secret 'token' has another value"), "{msg}");
    assert!(!msg.contains(&s.values.needle()), "{msg}");
    assert!(s.sb.mounts_under().is_empty(), "rolled back");
    // The same file with create and controller_publish swapped: CreateVolume is refused,
    // nothing is recorded.
    write_secrets(
        &s.volume_file,
        &s.values.file("v1", Some(("create", "controller_publish"))),
    );
    let err = p.create_volume(s.spec("other")).await.unwrap_err();
    let msg = full_message(&err);
    assert_eq!(err.csi_code(), Some(tonic::Code::Unauthenticated), "{msg}");
    assert!(msg.contains("CreateVolume"), "{msg}");
    assert!(p.find_by_name("other").await.is_none());
    // The first volume goes with its (right) controller_publish and create secrets.
    write_secrets(&s.volume_file, &s.values.file("v1", None));
    p.destroy_volume(&id).await.unwrap();
    p.shutdown(Duration::from_secs(5)).await;
    s.assert_no_secret_anywhere(&[("an error", &msg)]);
}

/// The file changed after the publish: the release's calls carry the new secrets (the plugin
/// expects only those now), so the file is read at each call, not kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_file_is_used_at_the_next_call() {
    let s = Setup::new("secrets-rotate");
    let p = s.start().await;
    let id = s.create(&p, "rotated").await;
    p.publish(&id, "c1").await.unwrap();
    // The plugin's secrets rotate first: the old ones the volume still sends are refused.
    write_secrets(&s.plugin_file, &s.values.file("v2", None));
    let err = p.release(&id, "c1").await.unwrap_err();
    let msg = full_message(&err);
    assert_eq!(err.csi_code(), Some(tonic::Code::Unauthenticated), "{msg}");
    assert!(msg.contains("ControllerUnpublishVolume"), "{msg}");
    // Then the volume's: the next call carries them.
    write_secrets(&s.volume_file, &s.values.file("v2", None));
    p.release(&id, "c1").await.unwrap();
    p.destroy_volume(&id).await.unwrap();
    p.shutdown(Duration::from_secs(5)).await;
    s.assert_no_secret_anywhere(&[("an error", &msg)]);
    s.sb.assert_no_mounts_under();
}

/// A provider started again knows the volume's secrets file from its checkpoint: the
/// unpublish and delete it sends carry their secrets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_provider_sends_the_secrets_of_the_recorded_file() {
    let s = Setup::new("secrets-restart");
    let p = s.start().await;
    let id = s.create(&p, "kept").await;
    p.publish(&id, "c1").await.unwrap();
    p.shutdown(Duration::from_secs(5)).await;
    drop(p);
    let p = s.start().await;
    assert_eq!(
        p.volume(&id).await.unwrap().secrets_file.as_deref(),
        Some(s.volume_file.as_path())
    );
    p.release(&id, "c1").await.unwrap();
    p.destroy_volume(&id).await.unwrap();
    let calls = s.calls();
    assert!(calls.iter().any(|c| c == "DeleteVolume"), "{calls:?}");
    p.shutdown(Duration::from_secs(5)).await;
    s.assert_no_secret_anywhere(&[]);
    s.sb.assert_no_mounts_under();
}

/// An import records the file too; ValidateVolumeCapabilities carries none (the plugin
/// refuses any there), the later calls carry theirs, DeleteVolume (`--delete`) included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_imported_volume_carries_its_secrets_from_the_first_publish() {
    use csi_isolator::csi::proto;
    let s = Setup::new("secrets-import");
    let p = s.start().await;
    // A volume made in the plugin behind the provider's back (with the create secrets the
    // plugin requires).
    let socket = csi_isolator::csi::transport::socket_path(p.client().endpoint()).unwrap();
    let mut raw = csi_isolator_testing::raw_clients(&socket).await.unwrap();
    let create = serde_json::from_str::<serde_json::Value>(&s.values.file("v1", None)).unwrap()
        ["create"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_string()))
        .collect();
    let made = raw
        .controller
        .create_volume(proto::CreateVolumeRequest {
            name: "made-elsewhere".into(),
            volume_capabilities: vec![csi_isolator_testing::mount_capability(
                proto::volume_capability::access_mode::Mode::SingleNodeWriter,
            )],
            secrets: create,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    let spec = ImportSpec {
        name: "imported".into(),
        volume_id: made.volume_id.clone(),
        capacity_bytes: 0,
        capability: Default::default(),
        volume_context: made.volume_context.into_iter().collect(),
    };
    p.import_volume_with_secrets(spec.clone(), Some(s.volume_file.clone()))
        .await
        .unwrap_or_else(|e| panic!("import: {}", full_message(&e)));
    // The same import naming another file (or none) is refused.
    let err = p.import_volume(spec).await.unwrap_err();
    assert!(
        full_message(&err).contains("exists with secrets file"),
        "{err}"
    );
    let id = made.volume_id;
    p.publish(&id, "c1")
        .await
        .unwrap_or_else(|e| panic!("publish: {}", full_message(&e)));
    p.release(&id, "c1").await.unwrap();
    p.destroy_volume_with(&id, true).await.unwrap();
    let calls = s.calls();
    for rpc in [
        "ValidateVolumeCapabilities",
        "NodeStageVolume",
        "DeleteVolume",
    ] {
        assert!(calls.iter().any(|c| c == rpc), "{rpc} not sent: {calls:?}");
    }
    p.shutdown(Duration::from_secs(5)).await;
    s.assert_no_secret_anywhere(&[]);
    s.sb.assert_no_mounts_under();
}

/// Files that are not root's alone, or not a secrets file, are refused naming the file and
/// what is wrong (never the content), before an intent is written or CreateVolume sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_secrets_files_are_refused_by_name_before_anything_is_sent() {
    let s = Setup::new("secrets-bad");
    let p = s.start().await;
    let dir = s.sb.mkdir("bad");
    let good = s.values.file("v1", None);
    let value = s.values.of("create", "v1");
    let file = |name: &str, text: &str, mode: u32| {
        let path = dir.join(name);
        write_secrets(&path, text);
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        path
    };
    let open_dir = s.sb.mkdir("open-dir");
    std::fs::set_permissions(&open_dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let in_open_dir = open_dir.join("s.json");
    write_secrets(&in_open_dir, &good);
    let cases: Vec<(PathBuf, &str)> = vec![
        (file("world.json", &good, 0o644), "open to group or others"),
        (file("group.json", &good, 0o640), "open to group or others"),
        (file("gw.json", &good, 0o620), "writable by group or others"),
        (
            {
                let link = dir.join("link.json");
                std::os::unix::fs::symlink(&s.volume_file, &link).unwrap();
                link
            },
            "a symbolic link",
        ),
        (
            {
                let f = file("nobody.json", &good, 0o600);
                std::os::unix::fs::chown(&f, Some(65534), Some(65534)).unwrap();
                f
            },
            "not owned by root",
        ),
        (
            {
                let f = file("linked.json", &good, 0o600);
                std::fs::hard_link(&f, dir.join("linked-too.json")).unwrap();
                f
            },
            "several hard links",
        ),
        (
            file(
                "big.json",
                &format!("{good}{}", " ".repeat(65 * 1024)),
                0o600,
            ),
            "over 65536 bytes",
        ),
        (
            file(
                "truncated.json",
                &format!("{{\"create\": {{\"token\": \"{value}\""),
                0o600,
            ),
            "not JSON",
        ),
        (
            file(
                "unknown.json",
                &format!("{{\"node_unstage\": {{\"token\": \"{value}\"}}}}"),
                0o600,
            ),
            "unknown operation 'node_unstage'",
        ),
        (
            file(
                "number.json",
                &format!("{{\"node_stage\": {{\"token\": [\"{value}\"]}}}}"),
                0o600,
            ),
            "the value of secret 'token' is not a string",
        ),
        (s.sb.mkdir("a-dir.json"), "not a regular file"),
        (
            {
                let fifo = dir.join("fifo.json");
                nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600))
                    .unwrap();
                fifo
            },
            "not a regular file",
        ),
        (dir.join("missing.json"), "open"),
        (PathBuf::from("relative.json"), "not an absolute path"),
        (in_open_dir, "secrets file's directory"),
    ];
    for (i, (path, want)) in cases.into_iter().enumerate() {
        let name = format!("bad-{i}");
        let mut spec = CreateSpec::new(&name, 4 * MIB);
        spec.secrets_file = Some(path.clone());
        let err = p.create_volume(spec).await.unwrap_err();
        let msg = full_message(&err);
        assert!(
            msg.contains(&format!("secrets file {}", path.display())),
            "{}: the file is not named: {msg}",
            path.display()
        );
        assert!(msg.contains(want), "{}: {msg}", path.display());
        assert!(!msg.contains(&s.values.needle()), "{msg}");
        assert!(p.find_by_name(&name).await.is_none());
        assert!(
            !p.layout().create_intent(&name).exists(),
            "{}: an intent was written",
            path.display()
        );
    }
    assert!(
        !s.calls().iter().any(|c| c == "CreateVolume"),
        "CreateVolume was sent: {:?}",
        s.calls()
    );
    // A second create of a name with another file (here: none) is refused naming both.
    let id = s.create(&p, "good").await;
    let err = p
        .create_volume(CreateSpec::new("good", 4 * MIB))
        .await
        .unwrap_err();
    assert!(
        full_message(&err).contains(&format!(
            "exists with secrets file {}, not none",
            s.volume_file.display()
        )),
        "{err}"
    );
    p.destroy_volume(&id).await.unwrap();
    p.shutdown(Duration::from_secs(5)).await;
    s.assert_no_secret_anywhere(&[]);
}

/// `csi-isolator serve` (a process of its own, logging at TRACE to a file) against a plugin in
/// `--require-secrets` mode started apart: CreateVolume with `secrets_file`, Prepare publishes,
/// then serve is SIGKILLed; the next serve's Recover cleans the container up and unpublishes
/// with the secrets of the recorded file. A bad file is FAILED_PRECONDITION naming it. No
/// value in serve's log, the plugin's log, the work dir, Status or `/metrics`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_sends_secrets_across_a_crash_and_never_shows_them() {
    use csi_isolator::service::proto::{
        self, isolator_client::IsolatorClient, ContainerConfig, PrepareRequest, RecoverRequest,
    };
    use std::process::{Command, Stdio};
    let s = Setup::new("secrets-serve");
    let plugin = csi_isolator_testing::PluginProcess::start(
        &s.sb,
        plugin_bin(),
        &[
            "--backing",
            "dir",
            "--require-secrets",
            s.plugin_file.to_str().unwrap(),
        ],
    )
    .await;
    let socket = s.sb.join("isolator.sock");
    let serve_log = s.sb.join("serve.log");
    let start_serve = || {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&serve_log)
            .unwrap();
        let mut cmd = Command::new(CLI);
        cmd.env("RUST_LOG", "trace")
            .arg("--work-dir")
            .arg(&s.work)
            .args(["serve", "--metrics", "127.0.0.1:0", "--plugin-endpoint"])
            .arg(plugin.endpoint())
            .arg("--socket")
            .arg(&socket)
            .stdout(Stdio::piped())
            .stderr(log);
        let mut child = s.sb.spawn(&mut cmd).expect("spawn serve");
        let lines = csi_isolator_testing::wait_for_serve_ready(&mut child, Duration::from_secs(30));
        let metrics: std::net::SocketAddr = lines
            .iter()
            .find_map(|l| {
                l.strip_prefix("csi-isolator serve: metrics on http://")?
                    .strip_suffix("/metrics")
            })
            .expect("metrics address")
            .parse()
            .unwrap();
        (child, metrics)
    };
    let client = || async {
        let channel = csi_isolator::csi::transport::connect_unix(&socket)
            .await
            .unwrap();
        IsolatorClient::new(channel)
    };
    let (mut serve, _) = start_serve();
    let mut c = client().await;
    let bad = s.sb.join("secrets/world.json");
    write_secrets(&bad, &s.values.file("v1", None));
    std::fs::set_permissions(&bad, std::fs::Permissions::from_mode(0o644)).unwrap();
    let refused = c
        .create_volume(proto::CreateVolumeRequest {
            name: "bad".into(),
            capacity_bytes: 4 * MIB,
            secrets_file: bad.to_string_lossy().into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition, "{refused}");
    assert!(
        refused
            .message()
            .contains(&format!("secrets file {}", bad.display())),
        "{refused}"
    );
    let created = c
        .create_volume(proto::CreateVolumeRequest {
            name: "vault".into(),
            capacity_bytes: 4 * MIB,
            container_path: "data".into(),
            secrets_file: s.volume_file.to_string_lossy().into(),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("CreateVolume: {e}"))
        .into_inner();
    let sandbox = s.sb.mkdir("sandboxes/c1");
    let info = c
        .prepare(PrepareRequest {
            container_id: "c1".into(),
            config: Some(ContainerConfig {
                resources_json: format!("[{}]", created.resource_json),
                sandbox: sandbox.to_string_lossy().into(),
                ..Default::default()
            }),
        })
        .await
        .unwrap_or_else(|e| panic!("Prepare: {e}"))
        .into_inner();
    assert_eq!(info.mounts.len(), 1);
    // Killed while the volume is published for c1.
    serve.kill().unwrap();
    serve.wait().unwrap();
    s.sb.untrack(serve.id());
    let (mut serve, metrics) = start_serve();
    let mut c = client().await;
    let r = c
        .recover(RecoverRequest::default())
        .await
        .unwrap_or_else(|e| panic!("Recover: {e}"))
        .into_inner();
    assert_eq!(r.cleaned, vec!["c1".to_string()], "{r:?}");
    let calls = plugin.calls();
    assert!(
        calls
            .iter()
            .any(|l| l.starts_with("ControllerUnpublishVolume")),
        "the recovered release unpublished (with its secrets, or the plugin refuses): {calls:?}"
    );
    let status = format!("{:?}", c.status(proto::StatusRequest {}).await.unwrap());
    assert!(status.contains(&created.volume_id), "{status}");
    let scraped = {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut conn = tokio::net::TcpStream::connect(metrics).await.unwrap();
        conn.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut out = String::new();
        conn.read_to_string(&mut out).await.unwrap();
        out
    };
    assert!(scraped.contains("ControllerUnpublishVolume"), "{scraped}");
    c.destroy_volume(proto::DestroyVolumeRequest {
        volume_id: created.volume_id.clone(),
        ..Default::default()
    })
    .await
    .unwrap_or_else(|e| panic!("DestroyVolume: {e}"));
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(serve.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    assert!(serve.wait().unwrap().success());
    s.sb.untrack(serve.id());
    let serve_log = std::fs::read_to_string(&serve_log).unwrap();
    assert!(serve_log.contains("TRACE"), "serve logged at TRACE");
    let plugin_log = plugin.stderr();
    assert!(plugin_log.contains("TRACE"), "the plugin logged at TRACE");
    let needle = s.values.needle();
    for (what, text) in [
        ("serve's log", &serve_log),
        ("the plugin's log", &plugin_log),
        ("Status", &status),
        ("/metrics", &scraped),
        ("a refusal", &refused.message().to_string()),
    ] {
        assert!(!text.contains(&needle), "a secret value is in {what}");
    }
    let mut files = Vec::new();
    walk(&s.work, &mut files);
    walk(plugin.dir(), &mut files);
    assert!(
        files.iter().any(|f| f.ends_with("stderr.log")),
        "the plugin's log is searched: {files:?}"
    );
    for f in files {
        let text = String::from_utf8_lossy(&std::fs::read(&f).unwrap_or_default()).into_owned();
        assert!(
            !text.contains(&needle),
            "a secret value is in {}",
            f.display()
        );
    }
    s.sb.assert_no_mounts_under();
}

/// The volume's file removed while it is published: the release's node calls (which carry no
/// secrets) still go, ControllerUnpublish fails naming the file, and the volume keeps its
/// intent; with the file back, the next release finishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_gone_fails_only_the_calls_that_carry_secrets() {
    let s = Setup::new("secrets-gone");
    let p = s.start().await;
    let id = s.create(&p, "gone").await;
    p.publish(&id, "c1").await.unwrap();
    let kept = std::fs::read_to_string(&s.volume_file).unwrap();
    std::fs::remove_file(&s.volume_file).unwrap();
    let err = p.release(&id, "c1").await.unwrap_err();
    let msg = full_message(&err);
    assert!(
        msg.contains(&format!(
            "ControllerUnpublishVolume: secrets file {}: open",
            s.volume_file.display()
        )),
        "{msg}"
    );
    let calls = s.calls();
    assert!(
        calls.ends_with(&["NodeUnpublishVolume".into(), "NodeUnstageVolume".into()]),
        "{calls:?}"
    );
    write_secrets(&s.volume_file, &kept);
    p.release(&id, "c1").await.unwrap();
    assert_eq!(
        s.calls().last().map(String::as_str),
        Some("ControllerUnpublishVolume")
    );
    p.destroy_volume(&id).await.unwrap();
    p.shutdown(Duration::from_secs(5)).await;
    s.assert_no_secret_anywhere(&[("an error", &msg)]);
    s.sb.assert_no_mounts_under();
}

/// `run --mount ...,secrets=FILE`, the one parser's key: the volume's calls carry the file's
/// secrets (the plugin requires them), a run without the key uses the recorded file, another
/// file is refused naming both, and a mount without secrets on a fresh volume fails at the
/// first RPC that needs them, leaving nothing.
#[test]
fn run_mount_names_the_secrets_file() {
    let s = Setup::new("secrets-run-mount");
    let run = |mount: &str| {
        isolator_command(CLI, &s.work)
            .env("RUST_LOG", "trace")
            .args([
                "run",
                "--plugin-arg=--backing=dir",
                &format!("--plugin-arg=--require-secrets={}", s.plugin_file.display()),
                "--mount",
                mount,
                "--",
                "sh",
                "-c",
                "echo kept >> v/f; cat v/f",
            ])
            .output()
            .unwrap()
    };
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    let with = format!(
        "source=vault,target=v,size=4M,secrets={}",
        s.volume_file.display()
    );
    let first = run(&with);
    assert!(first.status.success(), "{}", text(&first.stderr));
    assert_eq!(text(&first.stdout), "kept\n");
    assert!(
        text(&first.stderr).contains("TRACE"),
        "the search below is not vacuous"
    );
    let again = run("source=vault,target=v,size=4M");
    assert!(
        again.status.success(),
        "the recorded file: {}",
        text(&again.stderr)
    );
    assert_eq!(text(&again.stdout), "kept\nkept\n");
    let other = s.sb.join("secrets/other.json");
    write_secrets(&other, &s.values.file("v1", None));
    let moved = run(&format!(
        "source=vault,target=v,size=4M,secrets={}",
        other.display()
    ));
    assert!(!moved.status.success());
    assert!(
        text(&moved.stderr).contains(&other.display().to_string()),
        "names the file asked: {}",
        text(&moved.stderr)
    );
    let bare = run("source=fresh,target=v,size=4M");
    assert!(!bare.status.success(), "no secrets: refused by the plugin");
    assert!(
        text(&bare.stderr).contains("CreateVolume"),
        "{}",
        text(&bare.stderr)
    );
    for out in [&first, &again, &moved, &bare] {
        assert!(
            !text(&out.stderr).contains(&s.values.needle()),
            "a secret value shown: {}",
            text(&out.stderr)
        );
    }
    let mut files = Vec::new();
    walk(&s.work, &mut files);
    let plugin_log = files.iter().find(|f| f.ends_with("plugin.log")).unwrap();
    assert!(std::fs::read_to_string(plugin_log)
        .unwrap()
        .contains("TRACE"));
    for f in &files {
        let bytes = std::fs::read(f).unwrap_or_default();
        let found = String::from_utf8_lossy(&bytes).contains(&s.values.needle());
        assert!(!found, "a secret value is in {}", f.display());
    }
    s.sb.assert_no_mounts_under();
}

/// A disk profile's `secrets_file` (csi-isolator's extension key): a profile disk made through it
/// carries the file's secrets to its RPCs (the plugin requires them); a profile without it fails
/// at CreateVolume; the same disk through a profile naming another file is refused naming that
/// file. No secret value is shown or written anywhere.
#[test]
fn a_profile_names_the_secrets_file() {
    let s = Setup::new("secrets-profile");
    let other = s.sb.join("secrets/other.json");
    write_secrets(&other, &s.values.file("v1", None));
    let profiles = s.sb.mkdir("profiles").join("profiles.json");
    std::fs::write(
        &profiles,
        serde_json::json!({"profile_matrix": {
            "vault": {"volume_capabilities": {"mount": {}}, "secrets_file": s.volume_file},
            "moved": {"secrets_file": other},
            "bare": {}}})
        .to_string(),
    )
    .unwrap();
    let resources = s.sb.join("res.json");
    let run = |profile: &str, name: &str| {
        let disk = serde_json::json!([{
            "name": "disk", "type": "SCALAR", "scalar": {"value": 4},
            "provider_id": {"value": "csi-test-plugin.csi-isolator.io.default"},
            "disk": {"source": {"type": "RAW", "profile": profile},
                     "persistence": {"id": name},
                     "volume": {"container_path": "data", "mode": "RW"}}}]);
        std::fs::write(&resources, disk.to_string()).unwrap();
        isolator_command(CLI, &s.work)
            .env("RUST_LOG", "trace")
            .args([
                "run",
                "--plugin-arg=--backing=dir",
                &format!("--plugin-arg=--require-secrets={}", s.plugin_file.display()),
                "--disk-profiles",
            ])
            .arg(&profiles)
            .arg("--resources")
            .arg(&resources)
            .args(["--", "sh", "-c", "echo kept >> data/f; cat data/f"])
            .output()
            .unwrap()
    };
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    let first = run("vault", "pv1");
    assert!(first.status.success(), "{}", text(&first.stderr));
    assert_eq!(text(&first.stdout), "kept\n");
    assert!(
        text(&first.stderr).contains("TRACE"),
        "the search below is not vacuous"
    );
    let again = run("vault", "pv1");
    assert!(again.status.success(), "{}", text(&again.stderr));
    assert_eq!(text(&again.stdout), "kept\nkept\n");
    let moved = run("moved", "pv1");
    assert!(!moved.status.success());
    assert!(
        text(&moved.stderr).contains(&other.display().to_string()),
        "names the file asked: {}",
        text(&moved.stderr)
    );
    let bare = run("bare", "pv2");
    assert!(!bare.status.success(), "no secrets: refused by the plugin");
    assert!(
        text(&bare.stderr).contains("CreateVolume"),
        "{}",
        text(&bare.stderr)
    );
    for out in [&first, &again, &moved, &bare] {
        assert!(
            !text(&out.stderr).contains(&s.values.needle()),
            "a secret value shown: {}",
            text(&out.stderr)
        );
    }
    let mut files = Vec::new();
    walk(&s.work, &mut files);
    for f in &files {
        let bytes = std::fs::read(f).unwrap_or_default();
        let found = String::from_utf8_lossy(&bytes).contains(&s.values.needle());
        assert!(!found, "a secret value is in {}", f.display());
    }
    s.sb.assert_no_mounts_under();
}

/// `volume create --secrets FILE` and `volume import --secrets FILE`, against a plugin that
/// requires the secrets: a create without them fails at CreateVolume; with them the volume is
/// created, published (stage and publish carry them) and deleted; an import of it by id in
/// another work dir without them fails at its first publish, with them it is published. No
/// secret value is shown or written anywhere.
#[test]
fn volume_create_and_import_take_the_secrets_file() {
    let s = Setup::new("secrets-volume-cli");
    let plugin = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(csi_isolator_testing::PluginProcess::start(
            &s.sb,
            plugin_bin(),
            &[
                "--backing",
                "dir",
                "--require-secrets",
                s.plugin_file.to_str().unwrap(),
            ],
        ));
    let endpoint = plugin.endpoint();
    let secrets = s.volume_file.display().to_string();
    let imported = s.sb.mkdir("imported");
    let mut shown = Vec::new();
    let mut volume = |work: &Path, args: &[&str], succeeds: bool| -> String {
        let out = isolator_command(CLI, work)
            .env("RUST_LOG", "trace")
            .args(["volume", "--plugin-endpoint", &endpoint])
            .args(args)
            .output()
            .unwrap();
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        );
        assert_eq!(out.status.success(), succeeds, "{args:?}: {stderr}");
        shown.push(format!("{stdout}{stderr}"));
        if succeeds {
            stdout
        } else {
            stderr
        }
    };
    let err = volume(&s.work, &["create", "bare", "4M"], false);
    assert!(err.contains("CreateVolume"), "{err}");
    let created = volume(
        &s.work,
        &["create", "vault", "4M", "--secrets", &secrets],
        true,
    );
    let res: serde_json::Value = serde_json::from_str(&created).unwrap();
    let id = res["disk"]["source"]["id"].as_str().unwrap().to_string();
    volume(&s.work, &["publish", "vault", "--container", "c1"], true);
    volume(&s.work, &["release", "vault", "--container", "c1"], true);

    // Without the file (a work dir of its own: the same id is recorded once per work dir).
    let plain = s.sb.mkdir("plain");
    volume(&plain, &["import", "plain", "--volume-id", &id], true);
    let err = volume(&plain, &["publish", "plain", "--container", "c2"], false);
    assert!(
        err.contains("ControllerPublishVolume") && err.contains("secret 'token' is missing"),
        "the RPC refused is named: {err}"
    );
    volume(
        &imported,
        &["import", "kept", "--volume-id", &id, "--secrets", &secrets],
        true,
    );
    volume(&imported, &["publish", "kept", "--container", "c2"], true);
    volume(&imported, &["release", "kept", "--container", "c2"], true);
    volume(&imported, &["destroy", "kept"], true);

    volume(&s.work, &["destroy", "vault"], true);
    for text in &shown {
        assert!(
            !text.contains(&s.values.needle()),
            "a secret value shown: {text}"
        );
    }
    let mut files = Vec::new();
    walk(&s.work, &mut files);
    walk(&imported, &mut files);
    walk(&plain, &mut files);
    for f in &files {
        let bytes = std::fs::read(f).unwrap_or_default();
        let found = String::from_utf8_lossy(&bytes).contains(&s.values.needle());
        assert!(!found, "a secret value is in {}", f.display());
    }
    drop(plugin);
    s.sb.assert_no_mounts_under();
}
