//! A driver whose controller and node plugins run apart (`--controller-endpoint` beside
//! `--plugin-endpoint`): the bundled plugin as two processes, `--mode controller` and `--mode
//! node`, each logging the RPCs it receives. Every Controller RPC must reach the controller
//! plugin only, every Node RPC the node plugin only; a controller endpoint that is another
//! driver, or no controller at all, is refused before any volume call.

use std::path::Path;
use std::process::{Command, Output};

use csi_isolator::service::proto::{CreateVolumeRequest, DestroyVolumeRequest, StatusRequest};
use csi_isolator_testing::crash::{start_serve, stop_serve};
use csi_isolator_testing::{
    isolator_command, plugin_bin, processes_mentioning, require_root, PluginProcess, Sandbox,
};

const CLI: &str = env!("CARGO_BIN_EXE_csi-isolator");

fn cli(work: &Path) -> Command {
    isolator_command(CLI, work)
}

fn output(cmd: &mut Command) -> Output {
    cmd.output().expect("run csi-isolator")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

use csi_isolator_testing::block_on;

/// The RPC names a plugin received, in order, without its readiness probes.
fn rpcs(plugin: &PluginProcess) -> Vec<String> {
    plugin
        .calls()
        .iter()
        .filter_map(|line| line.split_whitespace().next().map(str::to_string))
        .filter(|rpc| rpc != "Probe")
        .collect()
}

/// The Controller service's volume RPCs (the capability and identity calls aside).
const CONTROLLER_RPCS: &[&str] = &[
    "CreateVolume",
    "DeleteVolume",
    "ControllerPublishVolume",
    "ControllerUnpublishVolume",
    "ValidateVolumeCapabilities",
    "ListVolumes",
    "GetCapacity",
];

/// A controller-mode plugin and a node-mode plugin (node id `node-x`) reaching its volumes.
struct Split {
    controller: PluginProcess,
    node: PluginProcess,
}

impl Split {
    fn start(sb: &Sandbox) -> Split {
        block_on(async {
            let controller = PluginProcess::start_named(
                sb,
                "controller",
                plugin_bin(),
                &["--mode", "controller"],
            )
            .await;
            let shared = controller.work_dir();
            let node = PluginProcess::start_named(
                sb,
                "node",
                plugin_bin(),
                &[
                    "--mode",
                    "node",
                    "--node-id",
                    "node-x",
                    "--shared-dir",
                    shared.to_str().unwrap(),
                ],
            )
            .await;
            Split { controller, node }
        })
    }

    /// The flags naming both plugins.
    fn args(&self) -> [String; 4] {
        [
            "--plugin-endpoint".into(),
            self.node.endpoint(),
            "--controller-endpoint".into(),
            self.controller.endpoint(),
        ]
    }

    /// Asserts that since the last call each plugin received only its own service's volume
    /// RPCs, and returns them (controller's, node's); the logs are read from the start, so
    /// `seen` counts what earlier calls returned.
    fn since(&self, seen: &mut (usize, usize)) -> (Vec<String>, Vec<String>) {
        let c = rpcs(&self.controller)[seen.0..].to_vec();
        let n = rpcs(&self.node)[seen.1..].to_vec();
        *seen = (seen.0 + c.len(), seen.1 + n.len());
        for rpc in &c {
            assert!(
                !rpc.starts_with("Node"),
                "a Node RPC reached the controller plugin: {c:?}"
            );
        }
        for rpc in &n {
            assert!(
                !CONTROLLER_RPCS.contains(&rpc.as_str()) && !rpc.starts_with("Controller"),
                "a Controller RPC reached the node plugin: {n:?}"
            );
        }
        (c, n)
    }
}

fn has(rpcs: &[String], rpc: &str) -> bool {
    rpcs.iter().any(|r| r == rpc)
}

#[test]
fn run_and_volume_drive_the_controller_and_the_node_plugin_apart() {
    require_root();
    let sb = Sandbox::new("split-run");
    let split = Split::start(&sb);
    let work = sb.join("work");
    let mut seen = (0, 0);

    let out = output(cli(&work).arg("run").args(split.args()).args([
        "--volume",
        "data:16M:data",
        "--",
        "sh",
        "-c",
        "echo written-on-x > data/f && cat data/f",
    ]));
    assert!(out.status.success(), "run: {}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "written-on-x\n");
    let (c, n) = split.since(&mut seen);
    for rpc in [
        "CreateVolume",
        "ControllerPublishVolume",
        "ControllerUnpublishVolume",
    ] {
        assert!(has(&c, rpc), "{rpc} reached the controller plugin: {c:?}");
    }
    for rpc in [
        "NodeGetInfo",
        "NodeStageVolume",
        "NodePublishVolume",
        "NodeUnpublishVolume",
        "NodeUnstageVolume",
    ] {
        assert!(has(&n, rpc), "{rpc} reached the node plugin: {n:?}");
    }
    // The last use unpublished the volume from the node and from the controller.
    sb.assert_no_mounts_under();
    sb.assert_no_loop_devices();

    // A second run publishes the same volume again and reads what the first wrote.
    let out = output(cli(&work).arg("run").args(split.args()).args([
        "--volume",
        "data:16M:data",
        "--",
        "cat",
        "data/f",
    ]));
    assert!(out.status.success(), "second run: {}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "written-on-x\n");
    let (c, n) = split.since(&mut seen);
    assert!(!has(&c, "CreateVolume"), "the volume exists: {c:?}");
    assert!(has(&c, "ControllerPublishVolume"), "{c:?}");
    assert!(has(&n, "NodePublishVolume"), "{n:?}");

    // volume create / publish / list / destroy.
    let created = output(
        cli(&work)
            .arg("volume")
            .args(split.args())
            .args(["create", "more", "16M"]),
    );
    assert!(
        created.status.success(),
        "create: {}",
        text(&created.stderr)
    );
    let published = output(cli(&work).arg("volume").args(split.args()).args([
        "publish",
        "more",
        "--container",
        "u1",
    ]));
    assert!(
        published.status.success(),
        "publish: {}",
        text(&published.stderr)
    );
    let (c, n) = split.since(&mut seen);
    assert!(
        has(&c, "CreateVolume") && has(&c, "ControllerPublishVolume"),
        "{c:?}"
    );
    assert!(
        has(&n, "NodeStageVolume") && has(&n, "NodePublishVolume"),
        "{n:?}"
    );

    let status = output(cli(&work).args(["status", "--json"]));
    assert!(status.status.success(), "status: {}", text(&status.stderr));
    let status: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    let text_status = status.to_string();
    assert!(text_status.contains("\"PUBLISHED\""), "{text_status}");

    let listed = output(
        cli(&work)
            .arg("volume")
            .args(split.args())
            .args(["list", "--json"]),
    );
    assert!(listed.status.success(), "list: {}", text(&listed.stderr));
    let listed: serde_json::Value = serde_json::from_slice(&listed.stdout).unwrap();
    let names: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v["name"].as_str())
        .collect();
    assert!(
        names.contains(&"data") && names.contains(&"more"),
        "{listed}"
    );

    // A release by a command without the controller it was published with (only the node
    // plugin named) is refused at ControllerUnpublish, not skipped: the controller would hold
    // the volume for node-x for good.
    let (_, _) = split.since(&mut seen);
    let without = output(cli(&work).arg("volume").args(&split.args()[..2]).args([
        "release",
        "more",
        "--container",
        "u1",
    ]));
    let err = text(&without.stderr);
    assert!(!without.status.success(), "release without the controller");
    assert!(
        err.contains("ControllerPublished to node 'node-x'")
            && err.contains("--controller-endpoint"),
        "{err}"
    );
    // The node side went down before the refusal (it was this node's to undo).
    let (c, unstaged) = split.since(&mut seen);
    assert!(!has(&c, "ControllerUnpublishVolume"), "{c:?}");
    let released = output(cli(&work).arg("volume").args(split.args()).args([
        "release",
        "more",
        "--container",
        "u1",
    ]));
    assert!(
        released.status.success(),
        "release: {}",
        text(&released.stderr)
    );
    for name in ["more", "data"] {
        let destroyed = output(
            cli(&work)
                .arg("volume")
                .args(split.args())
                .args(["destroy", name]),
        );
        assert!(
            destroyed.status.success(),
            "destroy {name}: {}",
            text(&destroyed.stderr)
        );
    }
    let (c, n) = split.since(&mut seen);
    assert!(has(&c, "ControllerUnpublishVolume"), "{c:?}");
    assert_eq!(
        c.iter().filter(|r| *r == "DeleteVolume").count(),
        2,
        "{c:?}"
    );
    assert!(
        has(&n, "NodeUnstageVolume") || has(&unstaged, "NodeUnstageVolume"),
        "{n:?} {unstaged:?}"
    );
    assert!(
        block_on(split.controller.listed()).is_empty(),
        "the controller plugin has no volume left"
    );
    sb.assert_no_mounts_under();
    sb.assert_no_loop_devices();
    assert!(processes_mentioning(&work).is_empty());
}

#[test]
fn serve_drives_the_controller_and_the_node_plugin_apart() {
    require_root();
    let sb = Sandbox::new("split-serve");
    let split = Split::start(&sb);
    let work = sb.join("work");
    let socket = sb.join("serve.sock");
    let args = split.args();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let serve = start_serve(&sb, CLI, &work, &socket, &args, None).expect("serve starts");
    let mut seen = (0, 0);
    block_on(async {
        let mut c = csi_isolator::service::proto::isolator_client::IsolatorClient::new(
            csi_isolator::csi::transport::connect_unix(&socket)
                .await
                .unwrap(),
        );
        let v = c
            .create_volume(CreateVolumeRequest {
                name: "served".into(),
                capacity_bytes: 16 << 20,
                container_path: "data".into(),
                ..Default::default()
            })
            .await
            .expect("CreateVolume through serve")
            .into_inner();
        let status = c
            .status(StatusRequest::default())
            .await
            .unwrap()
            .into_inner();
        assert!(
            status.volumes.iter().any(|s| s.volume_id == v.volume_id),
            "{status:?}"
        );
        c.destroy_volume(DestroyVolumeRequest {
            volume_id: v.volume_id,
            ..Default::default()
        })
        .await
        .expect("DestroyVolume through serve");
    });
    let (cc, _) = split.since(&mut seen);
    assert!(
        has(&cc, "CreateVolume") && has(&cc, "DeleteVolume"),
        "{cc:?}"
    );

    // Another driver takes the controller's socket: the controller client's re-check refuses
    // it, naming both names, and no volume call reaches it.
    let mut split = split;
    split.controller.kill();
    let impostor_dir = sb.mkdir("impostor");
    let mut impostor = sb
        .spawn(
            Command::new(plugin_bin())
                .arg("--endpoint")
                .arg(split.controller.endpoint())
                .arg("--work-dir")
                .arg(impostor_dir.join("work"))
                .arg("--log-calls")
                .arg(impostor_dir.join("calls.log"))
                .args(["--mode", "controller", "--name", "impostor.example.io"]),
        )
        .expect("start the impostor");
    let refused = block_on(async {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while tokio::net::UnixStream::connect(split.controller.socket())
            .await
            .is_err()
        {
            assert!(std::time::Instant::now() < deadline, "the impostor listens");
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        let mut c = csi_isolator::service::proto::isolator_client::IsolatorClient::new(
            csi_isolator::csi::transport::connect_unix(&socket)
                .await
                .unwrap(),
        );
        c.create_volume(CreateVolumeRequest {
            name: "after-swap".into(),
            capacity_bytes: 16 << 20,
            ..Default::default()
        })
        .await
        .expect_err("a volume call to another driver is refused")
    });
    let message = refused.message().to_string();
    for part in [
        "impostor.example.io",
        csi_isolator::provider::bundled::BUNDLED_TYPE,
    ] {
        assert!(message.contains(part), "{part}: {message}");
    }
    let impostor_calls =
        std::fs::read_to_string(impostor_dir.join("calls.log")).unwrap_or_default();
    assert!(!impostor_calls.contains("CreateVolume"), "{impostor_calls}");
    let pid = impostor.id();
    let _ = impostor.kill();
    let _ = impostor.wait();
    sb.untrack(pid);
    stop_serve(&sb, serve);
    sb.assert_no_mounts_under();
    sb.assert_no_loop_devices();
}

/// `volume create` with `flags`: must fail before any volume call, saying `expected`.
fn refused(sb: &Sandbox, flags: &[String], expected: &[&str], plugins: &[&PluginProcess]) {
    let work = sb.join("work");
    let out = output(
        cli(&work)
            .arg("volume")
            .args(flags)
            .args(["create", "never", "16M"]),
    );
    let err = text(&out.stderr);
    assert!(!out.status.success(), "refused: {err}");
    for part in expected {
        assert!(err.contains(part), "the error says {part:?}: {err}");
    }
    for p in plugins {
        assert!(
            !has(&rpcs(p), "CreateVolume"),
            "no volume call was sent: {:?}",
            rpcs(p)
        );
    }
}

#[test]
fn a_controller_endpoint_of_another_driver_or_without_a_controller_is_refused_at_start() {
    require_root();
    let sb = Sandbox::new("split-refused");
    let split = Split::start(&sb);
    let (other, node_only) = block_on(async {
        let other = PluginProcess::start_named(
            &sb,
            "other",
            plugin_bin(),
            &["--backing", "dir", "--name", "other.example.io"],
        )
        .await;
        let node_only = PluginProcess::start_named(
            &sb,
            "node-only",
            plugin_bin(),
            &[
                "--mode",
                "node",
                "--node-id",
                "node-y",
                "--shared-dir",
                split.controller.work_dir().to_str().unwrap(),
            ],
        )
        .await;
        (other, node_only)
    });

    // Another driver at the controller endpoint: both names and both endpoints are named.
    let flags = [
        "--plugin-endpoint".to_string(),
        split.node.endpoint(),
        "--controller-endpoint".to_string(),
        other.endpoint(),
    ];
    refused(
        &sb,
        &flags,
        &[
            "other.example.io",
            csi_isolator::provider::bundled::BUNDLED_TYPE,
            &other.endpoint(),
            &split.node.endpoint(),
        ],
        &[&other, &split.node],
    );

    // A node plugin (no CONTROLLER_SERVICE) at the controller endpoint.
    let flags = [
        "--plugin-endpoint".to_string(),
        split.node.endpoint(),
        "--controller-endpoint".to_string(),
        node_only.endpoint(),
    ];
    refused(
        &sb,
        &flags,
        &["CONTROLLER_SERVICE", &node_only.endpoint()],
        &[&node_only, &split.node],
    );

    // The bundled plugin serves both: a controller endpoint beside it is refused.
    let flags = [
        "--controller-endpoint".to_string(),
        split.controller.endpoint(),
    ];
    refused(
        &sb,
        &flags,
        &["--plugin-endpoint", "bundled"],
        &[&split.controller],
    );

    // A controller endpoint that is not a socket is refused at once.
    let file = sb.join("not-a-socket");
    std::fs::write(&file, b"").unwrap();
    let flags = [
        "--plugin-endpoint".to_string(),
        split.node.endpoint(),
        "--controller-endpoint".to_string(),
        format!("unix://{}", file.display()),
    ];
    refused(
        &sb,
        &flags,
        &["--controller-endpoint", "is not a socket"],
        &[&split.node],
    );
    sb.assert_no_mounts_under();
    sb.assert_no_loop_devices();
}
