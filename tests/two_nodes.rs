//! Two nodes on one machine: two csi-isolator work dirs, each with its own node-mode bundled
//! plugin (its own `--node-id` and plugin work dir), and one controller-mode plugin they share.
//! A single-node volume moves between them: a publish on Y while X holds it is refused before
//! the workload starts and leaves nothing on Y; after X releases it, Y publishes it and sees X's
//! data; a volume created on X (its resource JSON, relative roots) is used on Y under Y's work
//! dir, through `run --resources` and through `serve`. A dead node is fenced with `volume
//! detach`, and finds its attachment gone when it comes back.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use csi_isolator_testing::crash::{start_serve, stop_serve};
use csi_isolator_testing::{
    isolator_command, mount_points_under, plugin_bin, processes_mentioning, require_root,
    status_volumes, PluginProcess, Sandbox,
};

const CLI: &str = env!("CARGO_BIN_EXE_csi-isolator");

fn output(cmd: &mut Command) -> Output {
    cmd.output().expect("run csi-isolator")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

use csi_isolator_testing::block_on;

/// One "node": a csi-isolator work dir and its node plugin.
struct Node {
    id: &'static str,
    work: PathBuf,
    plugin: PluginProcess,
}

/// A controller-mode plugin and two nodes reaching its volumes.
struct Cluster {
    controller: PluginProcess,
    x: Node,
    y: Node,
}

impl Cluster {
    fn start(sb: &Sandbox) -> Cluster {
        Self::start_with(sb, &[])
    }

    /// With `flags` added to every plugin's command line.
    fn start_with(sb: &Sandbox, flags: &[&str]) -> Cluster {
        block_on(async {
            let mut args = vec!["--mode", "controller"];
            args.extend_from_slice(flags);
            let controller =
                PluginProcess::start_named(sb, "controller", plugin_bin(), &args).await;
            let shared = controller.work_dir();
            let mut nodes = Vec::new();
            for id in ["node-x", "node-y"] {
                let mut args = vec![
                    "--mode",
                    "node",
                    "--node-id",
                    id,
                    "--shared-dir",
                    shared.to_str().unwrap(),
                ];
                args.extend_from_slice(flags);
                let plugin = PluginProcess::start_named(sb, id, plugin_bin(), &args).await;
                nodes.push(Node {
                    id,
                    work: sb.join(format!("work-{id}")),
                    plugin,
                });
            }
            let y = nodes.pop().unwrap();
            let x = nodes.pop().unwrap();
            Cluster { controller, x, y }
        })
    }

    /// `csi-isolator` on `node`, its plugin flags given after `verb` (`run`, `volume`, `serve`).
    fn cli(&self, node: &Node, verb: &str) -> Command {
        let mut cmd = isolator_command(CLI, &node.work);
        cmd.arg(verb).args([
            "--plugin-endpoint".to_string(),
            node.plugin.endpoint(),
            "--controller-endpoint".to_string(),
            self.controller.endpoint(),
        ]);
        cmd
    }

    /// The nodes the controller says `volume_id` is published to (ListVolumes).
    fn published_nodes(&self, volume_id: &str) -> Vec<String> {
        nodes_of(&block_on(self.controller.listed()), volume_id)
    }

    /// How many times the controller received `rpc` for `volume_id` (its call log names the
    /// RPC and the volume).
    fn calls(&self, rpc: &str, volume_id: &str) -> usize {
        self.controller
            .calls()
            .iter()
            .filter(|l| {
                let mut words = l.split_whitespace();
                words.next() == Some(rpc) && words.next() == Some(volume_id)
            })
            .count()
    }
}

/// The nodes ListVolumes' `listed` says `volume_id` is published to, sorted.
fn nodes_of(
    listed: &[csi_isolator::csi::proto::list_volumes_response::Entry],
    volume_id: &str,
) -> Vec<String> {
    let entry = listed
        .iter()
        .find(|e| e.volume.as_ref().is_some_and(|v| v.volume_id == volume_id))
        .unwrap_or_else(|| panic!("the controller lists {volume_id}"));
    let mut nodes = entry.status.clone().unwrap().published_node_ids;
    nodes.sort();
    nodes
}

/// `volume create NAME 16M` on `node`: its resource JSON, the volume's id.
fn create(cl: &Cluster, node: &Node, name: &str) -> (serde_json::Value, String) {
    let out = output(cl.cli(node, "volume").args(["create", name, "16M"]));
    assert!(out.status.success(), "create: {}", text(&out.stderr));
    let res: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let id = res["disk"]["source"]["id"].as_str().unwrap().to_string();
    let root = res["disk"]["source"]["mount"]["root"].as_str().unwrap();
    assert!(root.starts_with("./csi/"), "a relative root: {res}");
    (res, id)
}

/// `volume import NAME --volume-id ID` on `node`.
fn import(cl: &Cluster, node: &Node, name: &str, id: &str) {
    let out = output(cl.cli(node, "volume").args([
        "import",
        name,
        "--volume-id",
        id,
        "--capacity",
        "16M",
    ]));
    assert!(out.status.success(), "import: {}", text(&out.stderr));
}

/// A resources file holding `res` at container path `data`.
fn resources_file(sb: &Sandbox, name: &str, res: &serde_json::Value) -> PathBuf {
    let mut res = res.clone();
    res["disk"]["volume"] = serde_json::json!({"container_path": "data", "mode": "RW"});
    let file = sb.join(name);
    std::fs::write(
        &file,
        serde_json::to_vec(&serde_json::json!([res])).unwrap(),
    )
    .unwrap();
    file
}

/// `run --resources FILE -- sh -c SCRIPT` on `node`.
fn run_with(cl: &Cluster, node: &Node, file: &Path, script: &str) -> Output {
    output(
        cl.cli(node, "run")
            .arg("--resources")
            .arg(file)
            .args(["--", "sh", "-c", script]),
    )
}

/// `node`'s record of `volume_id` in `status --json`.
fn status_of(node: &Node, volume_id: &str) -> serde_json::Value {
    status_volumes(CLI, &node.work)
        .into_iter()
        .find(|v| v["volume_id"] == volume_id)
        .unwrap_or_else(|| panic!("{} records {volume_id}", node.id))
}

/// Nothing of the volume on `node`: no mounts, no target directory, and its staging directory
/// (which lives as long as the volume) empty.
fn nothing_on(node: &Node) {
    assert!(
        mount_points_under(&node.work).is_empty(),
        "no mount on {}: {:?}",
        node.id,
        mount_points_under(&node.work)
    );
    let mounts = node.work.join("csi");
    let left: Vec<PathBuf> = walk(&mounts)
        .into_iter()
        .filter(|p| {
            let under_mounts = p.components().any(|c| c.as_os_str() == "mounts");
            let staged = p.parent().and_then(Path::file_name) == Some("staging".as_ref());
            under_mounts && (p.file_name().is_some_and(|n| n == "target") || staged)
        })
        .collect();
    assert!(
        left.is_empty(),
        "no target dir, nothing in a staging dir on {}: {left:?}",
        node.id
    );
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in entries.flatten() {
        let p = e.path();
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            out.extend(walk(&p));
        }
        out.push(p);
    }
    out
}

#[test]
fn a_single_node_volume_is_handed_off_from_x_to_y_with_run() {
    require_root();
    let sb = Sandbox::new("two-nodes-handoff");
    let cl = Cluster::start(&sb);
    let (res, id) = create(&cl, &cl.x, "data");
    let on_x = resources_file(&sb, "on-x.json", &res);
    let out = run_with(&cl, &cl.x, &on_x, "echo written-on-x > data/f");
    assert!(out.status.success(), "run on X: {}", text(&out.stderr));
    // X holds it for a container.
    let out = output(
        cl.cli(&cl.x, "volume")
            .args(["publish", "data", "--container", "cx"]),
    );
    assert!(out.status.success(), "publish on X: {}", text(&out.stderr));
    assert_eq!(cl.published_nodes(&id), ["node-x"]);

    let unpublishes = cl.calls("ControllerUnpublishVolume", &id);
    let publishes = cl.calls("ControllerPublishVolume", &id);
    // Y knows the volume by id, and its resource JSON (relative roots) names it.
    import(&cl, &cl.y, "data", &id);
    let on_y = resources_file(&sb, "on-y.json", &res);
    let marker = sb.join("workload-ran");
    let script = format!("touch {} && cat data/f", marker.display());
    let out = run_with(&cl, &cl.y, &on_y, &script);
    let err = text(&out.stderr);
    assert!(
        !out.status.success(),
        "refused on Y while X holds it: {err}"
    );
    assert!(!marker.exists(), "the workload never started");
    for part in [id.as_str(), "node-x", "node-y", "volume detach", "--node"] {
        assert!(err.contains(part), "the error names {part:?}: {err}");
    }
    // Nothing half-done on Y: the record as imported, nothing mounted or made.
    let rec = status_of(&cl.y, &id);
    assert_eq!(rec["state"], "CREATED", "{rec}");
    assert!(
        rec["users"].as_array().is_none_or(|u| u.is_empty()),
        "no use recorded on Y: {rec}"
    );
    nothing_on(&cl.y);
    assert_eq!(cl.published_nodes(&id), ["node-x"], "X still holds it");
    assert_eq!(
        cl.calls("ControllerUnpublishVolume", &id),
        unpublishes,
        "no unpublish was sent for Y, where nothing was published"
    );

    // X releases it (last use, last-use policy): ControllerUnpublished from X.
    let out = output(
        cl.cli(&cl.x, "volume")
            .args(["release", "data", "--container", "cx"]),
    );
    assert!(out.status.success(), "release on X: {}", text(&out.stderr));
    assert!(cl.published_nodes(&id).is_empty());
    nothing_on(&cl.x);

    // The retry on Y succeeds and sees X's data; the roots resolved under Y's work dir.
    let out = run_with(
        &cl,
        &cl.y,
        &on_y,
        "cat data/f && echo written-on-y >> data/f",
    );
    assert!(out.status.success(), "run on Y: {}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "written-on-x\n");
    assert!(cl.published_nodes(&id).is_empty(), "released after the run");
    let mount_point = status_of(&cl.y, &id)["mount_point"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        Path::new(&mount_point).starts_with(&cl.y.work),
        "the relative root resolved under Y's work dir: {mount_point}"
    );
    // The refused try, X's check at its next start (the release) that it still holds the
    // volume, and the retry.
    assert_eq!(cl.calls("ControllerPublishVolume", &id), publishes + 3);

    // And back: X reads what Y wrote.
    let out = run_with(&cl, &cl.x, &on_x, "cat data/f");
    assert!(
        out.status.success(),
        "run on X again: {}",
        text(&out.stderr)
    );
    assert_eq!(text(&out.stdout), "written-on-x\nwritten-on-y\n");

    let out = output(cl.cli(&cl.y, "volume").args(["destroy", "data"]));
    assert!(out.status.success(), "forget on Y: {}", text(&out.stderr));
    let out = output(cl.cli(&cl.x, "volume").args(["destroy", "data"]));
    assert!(out.status.success(), "destroy on X: {}", text(&out.stderr));
    nothing_on(&cl.x);
    nothing_on(&cl.y);
    sb.assert_no_mounts_under();
    sb.assert_no_loop_devices();
    assert!(processes_mentioning(&cl.x.work).is_empty());
    assert!(processes_mentioning(&cl.y.work).is_empty());
}

#[test]
fn serve_on_y_imports_a_volume_made_on_x_and_publishes_it_once_x_released_it() {
    use csi_isolator::service::proto::{
        isolator_client::IsolatorClient, CleanupRequest, ContainerConfig, ImportVolumeRequest,
        PrepareRequest, StatusRequest,
    };
    require_root();
    let sb = Sandbox::new("two-nodes-serve");
    let cl = Cluster::start(&sb);
    let (res, id) = create(&cl, &cl.x, "data");
    let on_x = resources_file(&sb, "on-x.json", &res);
    let out = run_with(&cl, &cl.x, &on_x, "echo written-on-x > data/f");
    assert!(out.status.success(), "run on X: {}", text(&out.stderr));
    let out = output(
        cl.cli(&cl.x, "volume")
            .args(["publish", "data", "--container", "cx"]),
    );
    assert!(out.status.success(), "publish on X: {}", text(&out.stderr));

    let socket = sb.join("serve-y.sock");
    let args = [
        "--plugin-endpoint".to_string(),
        cl.y.plugin.endpoint(),
        "--controller-endpoint".to_string(),
        cl.controller.endpoint(),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let serve = start_serve(&sb, CLI, &cl.y.work, &socket, &args, None).expect("serve on Y");
    let mut res_y = res.clone();
    res_y["disk"]["volume"] = serde_json::json!({"container_path": "data", "mode": "RW"});
    let resources_json = serde_json::to_string(&serde_json::json!([res_y])).unwrap();
    let sandbox = sb.mkdir("sandboxes/cy");
    let prepare = |c: &mut IsolatorClient<_>| {
        let request = PrepareRequest {
            container_id: "cy".into(),
            config: Some(ContainerConfig {
                resources_json: resources_json.clone(),
                sandbox: sandbox.to_string_lossy().into(),
                ..Default::default()
            }),
        };
        let mut c: IsolatorClient<tonic::transport::Channel> = c.clone();
        async move { c.prepare(request).await }
    };
    block_on(async {
        let mut c = IsolatorClient::new(
            csi_isolator::csi::transport::connect_unix(&socket)
                .await
                .unwrap(),
        );
        // A resource naming a volume Y does not know is refused: serve adopts no volume
        // from a resource JSON, it is imported first.
        let refused = prepare(&mut c).await.expect_err("unknown on Y");
        assert_eq!(refused.code(), tonic::Code::NotFound, "{refused:?}");
        assert!(refused.message().contains("volume import"), "{refused:?}");
        let imported = c
            .import_volume(ImportVolumeRequest {
                name: "data".into(),
                volume_id: id.clone(),
                capacity_bytes: 16 << 20,
                ..Default::default()
            })
            .await
            .expect("ImportVolume on Y")
            .into_inner();
        assert_eq!(
            imported.provider_id, res["provider_id"]["value"],
            "one provider id on both nodes"
        );

        // X holds it: refused before anything is recorded, naming the volume and X.
        let refused = prepare(&mut c).await.expect_err("X holds it");
        assert_eq!(
            refused.code(),
            tonic::Code::FailedPrecondition,
            "{refused:?}"
        );
        for part in [id.as_str(), "node-x", "node-y", "volume detach"] {
            assert!(refused.message().contains(part), "{part}: {refused:?}");
        }
        let status = c
            .status(StatusRequest::default())
            .await
            .unwrap()
            .into_inner();
        let v = status.volumes.iter().find(|v| v.volume_id == id).unwrap();
        assert_eq!(
            (v.state.as_str(), v.users.len(), v.mounted),
            ("CREATED", 0, false),
            "{v:?}"
        );
        nothing_on(&cl.y);

        // X releases; Y's retry publishes it under Y's work dir, with X's data.
        let out = output(
            cl.cli(&cl.x, "volume")
                .args(["release", "data", "--container", "cx"]),
        );
        assert!(out.status.success(), "release on X: {}", text(&out.stderr));
        let info = prepare(&mut c).await.expect("published on Y").into_inner();
        assert_eq!(info.mounts.len(), 1, "{info:?}");
        let source = PathBuf::from(&info.mounts[0].source);
        assert!(
            source.starts_with(cl.y.work.join("csi")),
            "the relative root resolved under Y's work dir: {}",
            source.display()
        );
        assert_eq!(
            std::fs::read_to_string(source.join("f")).unwrap(),
            "written-on-x\n"
        );
        assert_eq!(nodes_of(&cl.controller.listed().await, &id), ["node-y"]);
        c.cleanup(CleanupRequest {
            container_id: "cy".into(),
        })
        .await
        .expect("cleanup on Y");
        assert!(nodes_of(&cl.controller.listed().await, &id).is_empty());
    });
    stop_serve(&sb, serve);
    nothing_on(&cl.y);
    let out = output(cl.cli(&cl.y, "volume").args(["destroy", "data"]));
    assert!(out.status.success(), "forget on Y: {}", text(&out.stderr));
    let out = output(cl.cli(&cl.x, "volume").args(["destroy", "data"]));
    assert!(out.status.success(), "destroy on X: {}", text(&out.stderr));
    sb.assert_no_mounts_under();
    sb.assert_no_loop_devices();
}

/// `volume detach ID --node NODE [flags]` run against `work`, with the controller only.
fn detach(cl: &Cluster, work: &Path, id: &str, node: &str, flags: &[&str]) -> Output {
    output(
        isolator_command(CLI, work)
            .arg("volume")
            .args([
                "--controller-endpoint".to_string(),
                cl.controller.endpoint(),
            ])
            .args(["detach", id, "--node", node])
            .args(flags),
    )
}

/// X holds `data` for container `cx` and dies with its node plugin (its record still lists
/// `cx`, whose container is gone; its mounts stay, as a hung node's would).
fn x_holds_and_dies(sb: &Sandbox, cl: &mut Cluster) -> (serde_json::Value, String) {
    let (res, id) = create(cl, &cl.x, "data");
    let on_x = resources_file(sb, "on-x.json", &res);
    let out = run_with(cl, &cl.x, &on_x, "echo written-on-x > data/f");
    assert!(out.status.success(), "run on X: {}", text(&out.stderr));
    let out = output(
        cl.cli(&cl.x, "volume")
            .args(["publish", "data", "--container", "cx"]),
    );
    assert!(out.status.success(), "publish on X: {}", text(&out.stderr));
    assert_eq!(cl.published_nodes(&id), ["node-x"]);
    cl.x.plugin.kill();
    (res, id)
}

/// Y imports the volume, reads X's data in a container, then holds it for `cy`.
fn y_takes_over(sb: &Sandbox, cl: &Cluster, res: &serde_json::Value, id: &str) {
    import(cl, &cl.y, "data", id);
    let on_y = resources_file(sb, "on-y.json", res);
    let out = run_with(
        cl,
        &cl.y,
        &on_y,
        "cat data/f && echo written-on-y >> data/f",
    );
    assert!(out.status.success(), "run on Y: {}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "written-on-x\n");
    let out = output(
        cl.cli(&cl.y, "volume")
            .args(["publish", "data", "--container", "cy"]),
    );
    assert!(out.status.success(), "publish on Y: {}", text(&out.stderr));
    assert_eq!(cl.published_nodes(id), ["node-y"]);
}

/// X comes back (its node plugin, then an agent start, whose recovery runs): returns the
/// agent's stderr.
fn x_comes_back(cl: &mut Cluster) -> String {
    block_on(cl.x.plugin.restart());
    let out = output(cl.cli(&cl.x, "volume").args(["list", "--json"]));
    assert!(out.status.success(), "start on X: {}", text(&out.stderr));
    text(&out.stderr)
}

/// What X reports after coming back: the volume fenced, the use of `cx` lost, nothing of it
/// left on X, and Y still the only holder.
fn x_reports_the_lost_use(cl: &Cluster, id: &str, stderr: Option<&str>, why: &str) {
    for part in stderr.map_or(Vec::new(), |_| vec![id, "cx", "lost"]) {
        let stderr = stderr.unwrap();
        assert!(stderr.contains(part), "X warns naming {part:?}: {stderr}");
    }
    let rec = status_of(&cl.x, id);
    assert_eq!(rec["state"], "CREATED", "{rec}");
    assert!(rec["users"].as_array().unwrap().is_empty(), "{rec}");
    assert_eq!(
        rec["fenced"]["lost_users"],
        serde_json::json!(["cx"]),
        "{rec}"
    );
    assert_eq!(rec["fenced"]["torn_down"], true, "{rec}");
    assert!(
        rec["fenced"]["why"].as_str().unwrap().contains(why),
        "{why}: {rec}"
    );
    nothing_on(&cl.x);
    assert_eq!(cl.published_nodes(id), ["node-y"], "Y still holds it alone");
    let status = output(isolator_command(CLI, &cl.x.work).arg("status"));
    let shown = text(&status.stdout);
    assert!(
        shown.contains("fenced") && shown.contains("cx"),
        "status on X: {shown}"
    );
}

fn clean_up(sb: &Sandbox, cl: &Cluster) {
    let out = output(
        cl.cli(&cl.y, "volume")
            .args(["release", "data", "--container", "cy"]),
    );
    assert!(out.status.success(), "release on Y: {}", text(&out.stderr));
    for node in [&cl.y, &cl.x] {
        let out = output(cl.cli(node, "volume").args(["destroy", "data"]));
        assert!(
            out.status.success(),
            "destroy on {}: {}",
            node.id,
            text(&out.stderr)
        );
        nothing_on(node);
    }
    sb.assert_no_mounts_under();
    sb.assert_no_loop_devices();
}

#[test]
fn a_dead_node_is_fenced_with_volume_detach_and_tears_down_when_it_comes_back() {
    require_root();
    let sb = Sandbox::new("two-nodes-fence");
    // Dir backing: X's mounts of the dead node stay while Y uses the volume.
    let mut cl = Cluster::start_with(&sb, &["--backing", "dir"]);
    let (res, id) = x_holds_and_dies(&sb, &mut cl);

    // X's record lists cx: refused without --force, naming the use and the way out.
    let x_work = cl.x.work.clone();
    let out = detach(&cl, &x_work, &id, "node-x", &[]);
    let err = text(&out.stderr);
    assert!(!out.status.success(), "refused: {err}");
    for part in [id.as_str(), "node-x", "cx", "--force"] {
        assert!(err.contains(part), "{part}: {err}");
    }
    assert_eq!(cl.published_nodes(&id), ["node-x"], "nothing sent");
    // Another work dir holds no record of it on node-x: refused too, without --force.
    let out = detach(&cl, &cl.y.work, &id, "node-x", &[]);
    let err = text(&out.stderr);
    assert!(!out.status.success() && err.contains("no record"), "{err}");

    let publishes = cl.calls("ControllerPublishVolume", &id);
    let out = detach(&cl, &x_work, &id, "node-x", &["--force"]);
    assert!(out.status.success(), "forced: {}", text(&out.stderr));
    assert!(text(&out.stdout).contains("cx"), "{}", text(&out.stdout));
    assert!(cl.published_nodes(&id).is_empty());
    let rec = status_of(&cl.x, &id);
    assert_eq!(rec["fenced"]["unpublished"], true, "{rec}");
    // A rerun is harmless (the fence is there, the call idempotent).
    let out = detach(&cl, &x_work, &id, "node-x", &[]);
    assert!(out.status.success(), "rerun: {}", text(&out.stderr));

    y_takes_over(&sb, &cl, &res, &id);
    let publishes_y = cl.calls("ControllerPublishVolume", &id);
    let unpublishes = cl.calls("ControllerUnpublishVolume", &id);

    let stderr = x_comes_back(&mut cl);
    assert_eq!(
        cl.calls("ControllerPublishVolume", &id),
        publishes_y,
        "X did not publish it again"
    );
    assert!(
        cl.calls("ControllerUnpublishVolume", &id) <= unpublishes + 1,
        "at most one idempotent ControllerUnpublish from X"
    );
    assert!(publishes_y > publishes);
    x_reports_the_lost_use(&cl, &id, Some(&stderr), "volume detach");
    // A second start does nothing more.
    let (p, u) = (
        cl.calls("ControllerPublishVolume", &id),
        cl.calls("ControllerUnpublishVolume", &id),
    );
    x_comes_back(&mut cl);
    assert_eq!(
        (
            cl.calls("ControllerPublishVolume", &id),
            cl.calls("ControllerUnpublishVolume", &id)
        ),
        (p, u)
    );
    // X asking for it while Y holds it is refused as any second node is.
    let out = output(
        cl.cli(&cl.x, "volume")
            .args(["publish", "data", "--container", "cx2"]),
    );
    let err = text(&out.stderr);
    assert!(!out.status.success() && err.contains("node-y"), "{err}");
    nothing_on(&cl.x);
    clean_up(&sb, &cl);
}

#[test]
fn a_node_whose_record_was_not_fenced_takes_the_controllers_refusal_as_a_fence() {
    require_root();
    let sb = Sandbox::new("two-nodes-unfenced");
    let mut cl = Cluster::start_with(&sb, &["--backing", "dir"]);
    let (res, id) = x_holds_and_dies(&sb, &mut cl);
    // X's disk cannot be reached: detach from elsewhere, by id, forced.
    let elsewhere = sb.mkdir("operator");
    let out = detach(&cl, &elsewhere, &id, "node-x", &["--force"]);
    assert!(out.status.success(), "forced: {}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("no record"),
        "{}",
        text(&out.stdout)
    );
    assert!(cl.published_nodes(&id).is_empty());
    y_takes_over(&sb, &cl, &res, &id);

    // X comes back with its record unfenced: it asks the controller once, is refused
    // (Y holds it), and takes that as the fence.
    let publishes = cl.calls("ControllerPublishVolume", &id);
    let stderr = x_comes_back(&mut cl);
    assert_eq!(
        cl.calls("ControllerPublishVolume", &id),
        publishes + 1,
        "one ControllerPublish, refused"
    );
    x_reports_the_lost_use(&cl, &id, Some(&stderr), "node-y");
    // Never again: a second start sends nothing.
    let p = cl.calls("ControllerPublishVolume", &id);
    x_comes_back(&mut cl);
    assert_eq!(cl.calls("ControllerPublishVolume", &id), p);
    clean_up(&sb, &cl);
}

/// `volume detach` killed (SIGKILL) at each of its crash points: in the journal's settling (a
/// rerun needs `--force` again there: nothing is fenced yet), after the fence is written, after
/// ControllerUnpublish returned and before that is recorded, after the record (a rerun without
/// `--force` finishes it); X's return tears down as after an uninterrupted detach.
#[test]
fn a_detach_killed_at_each_crash_point_is_finished_by_a_rerun() {
    /// The crash points of `volume detach` before its fence's write: the journal's settling.
    const SETTLING_POINTS: usize = 1;
    use std::os::unix::process::ExitStatusExt;
    require_root();
    let mut point = 1;
    let mut fence_durable_from = None;
    loop {
        let sb = Sandbox::new(&format!("two-nodes-detach-crash-{point}"));
        let mut cl = Cluster::start_with(&sb, &["--backing", "dir"]);
        let (res, id) = x_holds_and_dies(&sb, &mut cl);
        let x_work = cl.x.work.clone();
        let out = output(
            isolator_command(CLI, &x_work)
                .env(
                    csi_isolator::provider::checkpoint::CRASH_AFTER_WRITE_ENV,
                    point.to_string(),
                )
                .arg("volume")
                .args([
                    "--controller-endpoint".to_string(),
                    cl.controller.endpoint(),
                ])
                .args(["detach", &id, "--node", "node-x", "--force"]),
        );
        let crashed = out.status.signal() == Some(9);
        assert!(
            crashed || out.status.success(),
            "point {point}: {}",
            text(&out.stderr)
        );
        // The first points are the journal's settling (write-back, the summary's removal), before
        // the fence: a rerun is refused without --force there, as before the first run, and
        // fences nothing. From the fence's write on, the fence is durable: the rerun needs no
        // --force, at that point and at every later one.
        let out = detach(&cl, &x_work, &id, "node-x", &[]);
        if out.status.success() {
            fence_durable_from.get_or_insert(point);
            eprintln!("point {point}: the rerun needed no --force");
        } else {
            assert!(
                fence_durable_from.is_none(),
                "rerun after point {point} refused, yet the fence was durable after point {:?}: {}",
                fence_durable_from,
                text(&out.stderr)
            );
            assert!(
                text(&out.stderr).contains("give --force"),
                "rerun after point {point}: {}",
                text(&out.stderr)
            );
            let rec = status_of(&cl.x, &id);
            assert!(rec["fenced"].is_null(), "point {point}: {rec}");
            let out = detach(&cl, &x_work, &id, "node-x", &["--force"]);
            assert!(
                out.status.success(),
                "forced rerun after point {point}: {}",
                text(&out.stderr)
            );
        }
        let rec = status_of(&cl.x, &id);
        assert_eq!(rec["fenced"]["unpublished"], true, "point {point}: {rec}");
        assert!(cl.published_nodes(&id).is_empty(), "point {point}");
        y_takes_over(&sb, &cl, &res, &id);
        let publishes = cl.calls("ControllerPublishVolume", &id);
        let stderr = x_comes_back(&mut cl);
        assert_eq!(
            cl.calls("ControllerPublishVolume", &id),
            publishes,
            "point {point}"
        );
        x_reports_the_lost_use(&cl, &id, Some(&stderr), "volume detach");
        clean_up(&sb, &cl);
        if !crashed {
            // The settling's points (the journal's write-back, the summary's removal) come first,
            // then three at least from the fence's write on.
            let from = fence_durable_from.expect("no crash point left the fence durable");
            assert_eq!(
                from,
                SETTLING_POINTS + 1,
                "the fence is durable only from point {from}, not right after the settling"
            );
            assert!(
                point - from >= 3,
                "three crash points at least from the fence's write on, got {}",
                point - from
            );
            break;
        }
        point += 1;
    }
}

#[test]
fn a_killed_serve_on_x_is_fenced_and_its_next_start_tears_down() {
    use csi_isolator::service::proto::{
        isolator_client::IsolatorClient, ContainerConfig, PrepareRequest,
    };
    require_root();
    let sb = Sandbox::new("two-nodes-serve-killed");
    let mut cl = Cluster::start_with(&sb, &["--backing", "dir"]);
    let (res, id) = create(&cl, &cl.x, "data");
    let on_x = resources_file(&sb, "on-x.json", &res);
    let out = run_with(&cl, &cl.x, &on_x, "echo written-on-x > data/f");
    assert!(out.status.success(), "run on X: {}", text(&out.stderr));
    let socket = sb.join("serve-x.sock");
    let args = [
        "--plugin-endpoint".to_string(),
        cl.x.plugin.endpoint(),
        "--controller-endpoint".to_string(),
        cl.controller.endpoint(),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut res_x = res.clone();
    res_x["disk"]["volume"] = serde_json::json!({"container_path": "data", "mode": "RW"});
    let resources_json = serde_json::to_string(&serde_json::json!([res_x])).unwrap();
    let sandbox = sb.mkdir("sandboxes/cx");
    let mut serve = start_serve(&sb, CLI, &cl.x.work, &socket, &args, None).expect("serve on X");
    block_on(async {
        let mut c = IsolatorClient::new(
            csi_isolator::csi::transport::connect_unix(&socket)
                .await
                .unwrap(),
        );
        c.prepare(PrepareRequest {
            container_id: "cx".into(),
            config: Some(ContainerConfig {
                resources_json: resources_json.clone(),
                sandbox: sandbox.to_string_lossy().into(),
                ..Default::default()
            }),
        })
        .await
        .expect("prepared on X");
    });
    assert_eq!(cl.published_nodes(&id), ["node-x"]);
    // X dies: SIGKILL of its serve and of its node plugin.
    serve.kill().unwrap();
    serve.wait().unwrap();
    sb.untrack(serve.id());
    cl.x.plugin.kill();

    let x_work = cl.x.work.clone();
    let out = detach(&cl, &x_work, &id, "node-x", &[]);
    let err = text(&out.stderr);
    assert!(!out.status.success() && err.contains("cx"), "{err}");
    let out = detach(&cl, &x_work, &id, "node-x", &["--force"]);
    assert!(out.status.success(), "forced: {}", text(&out.stderr));
    y_takes_over(&sb, &cl, &res, &id);

    // X's serve starts again: its recovery tears down without publishing again.
    let publishes = cl.calls("ControllerPublishVolume", &id);
    block_on(cl.x.plugin.restart());
    let serve = start_serve(&sb, CLI, &cl.x.work, &socket, &args, None).expect("serve on X again");
    assert_eq!(cl.calls("ControllerPublishVolume", &id), publishes);
    x_reports_the_lost_use(&cl, &id, None, "volume detach");
    stop_serve(&sb, serve);
    clean_up(&sb, &cl);
}

/// `cmd` on `node` armed to be killed (SIGKILL) at crash point `point`: whether it was.
fn killed_at(cl: &Cluster, node: &Node, point: u32, args: &[&str]) -> bool {
    use std::os::unix::process::ExitStatusExt;
    let out = output(
        cl.cli(node, "volume")
            .env(
                csi_isolator::provider::checkpoint::CRASH_AFTER_WRITE_ENV,
                point.to_string(),
            )
            .args(args),
    );
    let killed = out.status.signal() == Some(9);
    assert!(
        killed || out.status.success(),
        "{args:?} at point {point}: {}",
        text(&out.stderr)
    );
    killed
}

/// The handoff killed at every crash point, on both sides: X's release (down to
/// ControllerUnpublish) and Y's publish (from ControllerPublish). After each, the node's next
/// start finishes it; the volume is never published to both nodes, Y ends up with X's data, and
/// nothing is left on either node.
#[test]
fn a_handoff_killed_at_each_crash_point_on_either_node_converges() {
    require_root();
    for side in ["release on X", "publish on Y"] {
        let mut point = 1;
        loop {
            let sb = Sandbox::new(&format!("two-nodes-handoff-crash-{point}"));
            let cl = Cluster::start_with(&sb, &["--backing", "dir"]);
            let (res, id) = create(&cl, &cl.x, "data");
            let on_x = resources_file(&sb, "on-x.json", &res);
            let out = run_with(&cl, &cl.x, &on_x, "echo written-on-x > data/f");
            assert!(out.status.success(), "run on X: {}", text(&out.stderr));
            let out =
                output(
                    cl.cli(&cl.x, "volume")
                        .args(["publish", "data", "--container", "cx"]),
                );
            assert!(out.status.success(), "publish on X: {}", text(&out.stderr));
            import(&cl, &cl.y, "data", &id);
            let release = ["release", "data", "--container", "cx"];
            let publish = ["publish", "data", "--container", "cy"];
            let killed = if side == "release on X" {
                let killed = killed_at(&cl, &cl.x, point, &release);
                assert!(cl.published_nodes(&id).len() <= 1);
                // X's next start finishes the release.
                let out = output(cl.cli(&cl.x, "volume").args(["list"]));
                assert!(out.status.success(), "{}", text(&out.stderr));
                let out = output(cl.cli(&cl.y, "volume").args(publish));
                assert!(out.status.success(), "publish on Y: {}", text(&out.stderr));
                killed
            } else {
                let out = output(cl.cli(&cl.x, "volume").args(release));
                assert!(out.status.success(), "release on X: {}", text(&out.stderr));
                let killed = killed_at(&cl, &cl.y, point, &publish);
                // Y's next start finishes the publish for its durable user.
                let out = output(cl.cli(&cl.y, "volume").args(["list"]));
                assert!(out.status.success(), "{}", text(&out.stderr));
                killed
            };
            assert_eq!(cl.published_nodes(&id), ["node-y"], "{side}, point {point}");
            nothing_on(&cl.x);
            let rec = status_of(&cl.y, &id);
            assert_eq!(rec["state"], "PUBLISHED", "{side}, point {point}: {rec}");
            let target = PathBuf::from(rec["mount_point"].as_str().unwrap());
            assert_eq!(
                std::fs::read_to_string(target.join("f")).unwrap(),
                "written-on-x\n",
                "{side}, point {point}"
            );
            clean_up(&sb, &cl);
            if !killed {
                assert!(point > 1, "{side}: no crash point reached");
                break;
            }
            point += 1;
        }
    }
}
