//! What a real driver needs, end to end with the built binaries: CreateVolume
//! parameters from `volume create` (the bundled plugin in require mode refuses
//! a create without them and echoes what it got in the volume context), a
//! second create with other parameters refused by key (or with another access mode), import of a volume the
//! provider does not know (`volume list --plugin` shows it, a run reads what
//! it held, destroy keeps it in the plugin unless `--delete`), and the
//! messages for disks the provider does not know.

use csi_isolator_testing::plugin_bin;
use std::path::Path;
use std::process::{Command, Output};

use csi_isolator_testing::{isolator_command, require_root, PluginProcess, Sandbox};

const CLI: &str = env!("CARGO_BIN_EXE_csi-isolator");

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// `csi-isolator --work-dir WORK volume --plugin-endpoint EP ARGS...`.
fn volume(work: &Path, endpoint: &str, args: &[&str]) -> Output {
    isolator_command(CLI, work)
        .args(["volume", "--plugin-endpoint", endpoint])
        .args(args)
        .output()
        .expect("run csi-isolator")
}

fn ok(out: Output, what: &str) -> String {
    assert!(out.status.success(), "{what} failed: {}", text(&out.stderr));
    text(&out.stdout)
}

fn refused(out: Output, what: &str) -> String {
    assert!(
        !out.status.success(),
        "{what} succeeded: {}",
        text(&out.stdout)
    );
    text(&out.stderr)
}

/// The plugin's volume ids, asked over CSI.
async fn plugin_ids(plugin: &PluginProcess) -> Vec<String> {
    plugin
        .listed()
        .await
        .into_iter()
        .filter_map(|e| e.volume.map(|v| v.volume_id))
        .collect()
}

#[tokio::test]
async fn volume_create_parameters_reach_create_volume() {
    require_root();
    let sb = Sandbox::new("params-create");
    let plugin = PluginProcess::start(
        &sb,
        plugin_bin(),
        &[
            "--backing",
            "dir",
            "--require-parameters",
            "server,share=/export",
        ],
    )
    .await;
    let work = sb.join("work");
    let ep = plugin.endpoint();

    // Without them: the plugin refuses, naming the key; nothing is recorded.
    let err = refused(volume(&work, &ep, &["create", "v", "8M"]), "create without");
    assert!(
        err.contains("InvalidArgument") || err.contains("INVALID_ARGUMENT"),
        "{err}"
    );
    assert!(err.contains("parameter 'server'"), "{err}");
    let err = refused(
        volume(
            &work,
            &ep,
            &[
                "create",
                "v",
                "8M",
                "--param",
                "server=s1",
                "--param",
                "share=/other",
            ],
        ),
        "create with a wrong value",
    );
    assert!(err.contains("parameter 'share'"), "{err}");
    assert!(plugin_ids(&plugin).await.is_empty());

    // With them: accepted, echoed back in the volume context, recorded, shown.
    let res: serde_json::Value = serde_json::from_str(&ok(
        volume(
            &work,
            &ep,
            &[
                "create",
                "v",
                "8M",
                "--param",
                "server=s1",
                "--param",
                "share=/export",
            ],
        ),
        "create with",
    ))
    .unwrap();
    let metadata = &res["disk"]["source"]["metadata"];
    let labels = serde_json::to_string(metadata).unwrap();
    assert!(
        labels.contains("parameter.server") && labels.contains("s1"),
        "{labels}"
    );
    let list: serde_json::Value =
        serde_json::from_str(&ok(volume(&work, &ep, &["list", "--json"]), "list")).unwrap();
    assert_eq!(list[0]["parameters"]["server"], "s1");
    assert_eq!(list[0]["parameters"]["share"], "/export");
    assert_eq!(list[0]["volume_context"]["parameter.share"], "/export");
    let status = isolator_command(CLI, &work)
        .args(["status", "--json"])
        .output()
        .unwrap();
    let status: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(status["volumes"][0]["parameters"]["server"], "s1");

    // The same create again is the same volume; another set is refused by key.
    ok(
        volume(
            &work,
            &ep,
            &[
                "create",
                "v",
                "8M",
                "--param",
                "share=/export",
                "--param",
                "server=s1",
            ],
        ),
        "the same create again",
    );
    let err = refused(
        volume(
            &work,
            &ep,
            &[
                "create",
                "v",
                "8M",
                "--param",
                "server=s2",
                "--param",
                "share=/export",
            ],
        ),
        "create with other parameters",
    );
    assert!(
        err.contains("other CreateVolume parameters") && err.contains("key 'server'"),
        "{err}"
    );
    let err = refused(
        volume(&work, &ep, &["create", "v", "8M"]),
        "create with none",
    );
    assert!(err.contains("key 'server'"), "{err}");
    // The same parameters with another access mode: refused, naming both capabilities.
    let err = refused(
        volume(
            &work,
            &ep,
            &[
                "create",
                "v",
                "8M",
                "--param",
                "share=/export",
                "--param",
                "server=s1",
                "--access-mode",
                "MULTI_NODE_MULTI_WRITER",
            ],
        ),
        "create with another access mode",
    );
    assert!(
        err.contains("exists with capability SINGLE_NODE_WRITER, not MULTI_NODE_MULTI_WRITER"),
        "{err}"
    );
    assert_eq!(plugin_ids(&plugin).await.len(), 1);

    // A run by name uses the volume with its parameters; the plugin refuses nothing.
    let out = isolator_command(CLI, &work)
        .args(["run", "--plugin-endpoint", &ep, "--volume", "v:8M:data"])
        .args(["--", "sh", "-c", "echo ok > data/f; cat data/f"])
        .output()
        .unwrap();
    assert_eq!(ok(out, "run by name"), "ok\n");
    ok(volume(&work, &ep, &["destroy", "v"]), "destroy");
    assert!(plugin_ids(&plugin).await.is_empty());
    sb.assert_no_mounts_under();
}

#[test]
fn hostile_parameters_are_refused_before_the_plugin() {
    require_root();
    let sb = Sandbox::new("params-hostile");
    let work = sb.join("work");
    let long = format!("k={}", "v".repeat(5000));
    let cases: [(&[&str], &str); 5] = [
        (&["--param", "novalue"], "give KEY=VALUE"),
        (&["--param", "a b=1"], "other than letters"),
        (
            &["--param", "csi.storage.k8s.io/node-stage-secret-name=s"],
            "secrets never travel",
        ),
        (&["--param", "a=1", "--param", "a=2"], "given twice"),
        (&["--param", &long], "4096 bytes"),
    ];
    for (args, want) in cases {
        let out = isolator_command(CLI, &work)
            .args(["volume", "--plugin-arg=--backing=dir", "create", "v", "8M"])
            .args(args)
            .output()
            .unwrap();
        let err = refused(out, want);
        assert!(err.contains(want), "{args:?}: {err}");
    }
    sb.assert_no_mounts_under();
}

#[tokio::test]
async fn an_imported_volume_is_run_with_its_data_and_kept_on_destroy() {
    require_root();
    let sb = Sandbox::new("import");
    let plugin = PluginProcess::start(&sb, plugin_bin(), &["--backing", "dir"]).await;
    let ep = plugin.endpoint();
    // Another CO (its own work dir) makes a volume and writes into it: behind our back.
    let other = sb.join("other");
    let res: serde_json::Value =
        serde_json::from_str(&ok(volume(&other, &ep, &["create", "old", "8M"]), "create")).unwrap();
    let id = res["disk"]["source"]["id"].as_str().unwrap().to_string();
    let mount = ok(
        volume(&other, &ep, &["publish", "old", "--container", "c"]),
        "publish",
    );
    std::fs::write(Path::new(mount.trim()).join("before"), "from before\n").unwrap();
    ok(
        volume(&other, &ep, &["release", "old", "--container", "c"]),
        "release",
    );

    let work = sb.join("work");
    // `list --plugin` shows it: the plugin has it, this provider does not know it.
    let listed = ok(volume(&work, &ep, &["list", "--plugin"]), "list --plugin");
    assert!(listed.contains(&id), "{listed}");
    let listed: serde_json::Value = serde_json::from_str(&ok(
        volume(&work, &ep, &["list", "--plugin", "--json"]),
        "list --plugin --json",
    ))
    .unwrap();
    assert_eq!(listed[0]["volume_id"], id.as_str());

    // Before the import, a resource naming it says how to import it, and nothing is mounted.
    let resources = sb.join("res.json");
    let mut r = res.clone();
    r["disk"]["volume"] = serde_json::json!({"container_path": "data", "mode": "RW"});
    std::fs::write(&resources, serde_json::to_string(&[&r]).unwrap()).unwrap();
    let out = isolator_command(CLI, &work)
        .args(["run", "--plugin-endpoint", &ep, "--resources"])
        .arg(&resources)
        .args(["--", "true"])
        .output()
        .unwrap();
    let err = refused(out, "run of an unknown volume");
    assert!(
        err.contains("unknown volume") && err.contains("volume import"),
        "{err}"
    );
    assert!(!err.contains("cannot remove the sandbox"), "{err}");
    sb.assert_no_mounts_under();

    // Imported, it runs with the data it held.
    let imported: serde_json::Value = serde_json::from_str(&ok(
        volume(
            &work,
            &ep,
            &["import", "mine", "--volume-id", &id, "--capacity", "8M"],
        ),
        "import",
    ))
    .unwrap();
    assert_eq!(imported["disk"]["source"]["id"], id.as_str());
    ok(
        volume(&work, &ep, &["import", "mine", "--volume-id", &id]),
        "the same import again",
    );
    let err = refused(
        volume(&work, &ep, &["import", "again", "--volume-id", &id]),
        "import of a recorded id under another name",
    );
    assert!(err.contains("already recorded as 'mine'"), "{err}");
    let listed = ok(volume(&work, &ep, &["list", "--plugin"]), "list --plugin");
    assert!(!listed.contains(&id), "{listed}");
    let out = isolator_command(CLI, &work)
        .args(["run", "--plugin-endpoint", &ep, "--volume", "mine:8M:data"])
        .args(["--", "cat", "data/before"])
        .output()
        .unwrap();
    assert_eq!(ok(out, "run"), "from before\n");
    let list: serde_json::Value =
        serde_json::from_str(&ok(volume(&work, &ep, &["list", "--json"]), "list")).unwrap();
    assert_eq!(list[0]["pre_provisioned"], true);

    // Destroy forgets it and leaves it in the plugin; --delete deletes it.
    ok(volume(&work, &ep, &["destroy", "mine"]), "destroy");
    assert!(plugin_ids(&plugin).await.contains(&id));
    ok(
        volume(&work, &ep, &["import", "mine", "--volume-id", &id]),
        "import once more",
    );
    ok(
        volume(&work, &ep, &["destroy", "mine", "--delete"]),
        "destroy --delete",
    );
    assert!(!plugin_ids(&plugin).await.contains(&id));
    // The other CO's record stays; its destroy finds the volume gone (idempotent DeleteVolume).
    ok(
        volume(&other, &ep, &["destroy", "old"]),
        "the other's destroy",
    );
    sb.assert_no_mounts_under();
}

#[tokio::test]
async fn an_import_the_plugin_does_not_confirm_is_refused() {
    require_root();
    let sb = Sandbox::new("import-refused");
    let plugin = PluginProcess::start(&sb, plugin_bin(), &["--backing", "dir"]).await;
    let ep = plugin.endpoint();
    let work = sb.join("work");
    let err = refused(
        volume(
            &work,
            &ep,
            &["import", "ghost", "--volume-id", "no-such-volume"],
        ),
        "import of a volume the plugin lacks",
    );
    assert!(
        err.contains("NotFound") || err.contains("not found"),
        "{err}"
    );
    let err = refused(
        volume(&work, &ep, &["import", "x", "--volume-id", "a\u{7}b"]),
        "import of a control character",
    );
    assert!(err.contains("control character"), "{err}");
    // A plugin that answers ValidateVolumeCapabilities without confirming the access mode.
    let liar = PluginProcess::start_named(
        &sb,
        "liar",
        plugin_bin(),
        &["--backing", "dir", "--lie", "ValidateVolumeCapabilities"],
    )
    .await;
    let err = refused(
        volume(
            &work,
            &liar.endpoint(),
            &["import", "unconfirmed", "--volume-id", "vol-1"],
        ),
        "import the plugin does not confirm",
    );
    assert!(
        err.contains("did not confirm access mode SINGLE_NODE_WRITER")
            && err.contains("--access-mode"),
        "{err}"
    );
    let list: serde_json::Value =
        serde_json::from_str(&ok(volume(&work, &ep, &["list", "--json"]), "list")).unwrap();
    assert_eq!(list, serde_json::json!([]));
    // Every provider directory (`csi/<type>/<name>`) of the work dir, then the intents in each.
    let providers: Vec<std::path::PathBuf> = std::fs::read_dir(work.join("csi"))
        .expect("the work dir has a csi/ directory")
        .flatten()
        .flat_map(|t| std::fs::read_dir(t.path()).into_iter().flatten().flatten())
        .map(|n| n.path())
        .collect();
    assert!(
        !providers.is_empty(),
        "no provider directory under {}",
        work.display()
    );
    let layout_intents = providers
        .iter()
        .filter_map(|p| std::fs::read_dir(p.join("creating")).ok())
        .flat_map(|d| d.flatten())
        .count();
    assert_eq!(layout_intents, 0, "no import intent left");
}

/// `volume list --plugin` follows ListVolumes' `next_token` to the last page: more volumes than
/// one page holds, made behind the provider's back, are all listed, and the provider's own are not.
#[tokio::test]
async fn volume_list_plugin_shows_every_page() {
    use csi_isolator::csi::proto;
    use csi_isolator::csi::proto::volume_capability::access_mode::Mode;
    use csi_isolator::provider::{PluginVolume, LIST_PAGE_ENTRIES};
    use csi_isolator_testing::{mount_capability, raw_clients, Tmpfs};
    require_root();
    let sb = Sandbox::new("list-pages");
    // A thousand creates, each made durable: on a tmpfs, so that fsync costs nothing.
    let fs = Tmpfs::mount(&sb, "plugin/work", "1G");
    let plugin = PluginProcess::start(&sb, plugin_bin(), &["--backing", "dir"]).await;
    let ep = plugin.endpoint();
    let work = sb.join("work");
    // The provider's own volumes: known, so never listed.
    let mut known = Vec::new();
    for name in ["ours-1", "ours-2"] {
        let res: serde_json::Value =
            serde_json::from_str(&ok(volume(&work, &ep, &["create", name, "1M"]), "create"))
                .unwrap();
        known.push(res["disk"]["source"]["id"].as_str().unwrap().to_string());
    }
    // More than a page of volumes made straight in the plugin.
    let theirs = usize::try_from(LIST_PAGE_ENTRIES).unwrap() + 7;
    let mut raw = raw_clients(&plugin.socket()).await.unwrap();
    let mut made = Vec::new();
    for i in 0..theirs {
        let v = raw
            .controller
            .create_volume(proto::CreateVolumeRequest {
                name: format!("theirs-{i}"),
                capacity_range: Some(proto::CapacityRange {
                    required_bytes: 4096,
                    limit_bytes: 0,
                }),
                volume_capabilities: vec![mount_capability(Mode::SingleNodeWriter)],
                ..Default::default()
            })
            .await
            .unwrap_or_else(|s| panic!("CreateVolume theirs-{i}: {s}"))
            .into_inner()
            .volume
            .unwrap();
        made.push(v.volume_id);
    }
    made.sort();
    let list_calls = || {
        plugin
            .calls()
            .iter()
            .filter(|l| l.starts_with("ListVolumes "))
            .count()
    };
    let before = list_calls();

    let listed: Vec<PluginVolume> = serde_json::from_str(&ok(
        volume(&work, &ep, &["list", "--plugin", "--json"]),
        "list --plugin --json",
    ))
    .unwrap();
    let ids: Vec<String> = listed.into_iter().map(|v| v.volume_id).collect();
    assert_eq!(ids.len(), theirs, "every volume made behind its back");
    assert_eq!(ids, made);
    for id in &known {
        assert!(!ids.contains(id), "its own volume {id} listed");
    }
    // It took more than one ListVolumes to get them.
    let pages = list_calls() - before;
    assert!(
        pages >= 2,
        "{pages} ListVolumes call(s) for {} volumes",
        theirs + known.len()
    );
    // The table has a line per volume too.
    let table = ok(volume(&work, &ep, &["list", "--plugin"]), "list --plugin");
    assert_eq!(
        table.lines().count(),
        theirs + 1,
        "a header and a line per volume"
    );

    for name in ["ours-1", "ours-2"] {
        ok(volume(&work, &ep, &["destroy", name]), "destroy");
    }
    drop(plugin);
    drop(fs);
    sb.assert_no_mounts_under();
}

/// A node-only plugin (no controller service, so no LIST_VOLUMES and no
/// ValidateVolumeCapabilities, no DeleteVolume): `volume list --plugin` says it cannot list and
/// how to import; an import is recorded without asking the plugin and runs with the data the
/// volume held; `destroy --delete` is refused before anything is recorded (recorded, no destroy
/// could ever finish), so a plain destroy still forgets it.
#[tokio::test]
async fn a_node_only_plugin_imports_without_validation() {
    require_root();
    let sb = Sandbox::new("import-node-only");
    // The volume is made, and written, while the plugin still has its controller service.
    let plugin = PluginProcess::start(&sb, plugin_bin(), &["--backing", "dir"]).await;
    let other = sb.join("other");
    let ep = plugin.endpoint();
    let res: serde_json::Value =
        serde_json::from_str(&ok(volume(&other, &ep, &["create", "old", "8M"]), "create")).unwrap();
    let id = res["disk"]["source"]["id"].as_str().unwrap().to_string();
    let mount = ok(
        volume(&other, &ep, &["publish", "old", "--container", "c"]),
        "publish",
    );
    std::fs::write(Path::new(mount.trim()).join("before"), "from before\n").unwrap();
    ok(
        volume(&other, &ep, &["release", "old", "--container", "c"]),
        "release",
    );
    drop(plugin);
    // The same plugin work dir, served without a controller.
    let plugin = PluginProcess::start(
        &sb,
        plugin_bin(),
        &[
            "--backing",
            "dir",
            "--no-controller",
            "--no-controller-publish",
        ],
    )
    .await;
    let work = sb.join("work");
    let err = refused(
        volume(&work, &ep, &["list", "--plugin"]),
        "list --plugin of a node-only plugin",
    );
    assert!(
        err.contains("does not offer LIST_VOLUMES")
            && err.contains("volume import NAME --volume-id ID"),
        "{err}"
    );
    let calls_before = plugin.calls().len();
    ok(
        volume(
            &work,
            &ep,
            &[
                "import",
                "mine",
                "--volume-id",
                &id,
                "--context",
                "server=s1",
            ],
        ),
        "import",
    );
    let asked: Vec<String> = plugin.calls()[calls_before..].to_vec();
    assert!(
        !asked
            .iter()
            .any(|c| c.starts_with("ValidateVolumeCapabilities")),
        "{asked:?}"
    );
    let out = isolator_command(CLI, &work)
        .args(["run", "--plugin-endpoint", &ep, "--volume", "mine:8M:data"])
        .args(["--", "cat", "data/before"])
        .output()
        .unwrap();
    assert_eq!(ok(out, "run"), "from before\n");
    // It cannot be deleted there: --delete is refused up front and changes nothing, so a plain
    // destroy still forgets it.
    let err = refused(
        volume(&work, &ep, &["destroy", "mine", "--delete"]),
        "destroy --delete on a plugin without DeleteVolume",
    );
    assert!(
        err.contains("does not offer CREATE_DELETE_VOLUME") && err.contains("without --delete"),
        "{err}"
    );
    let list: serde_json::Value =
        serde_json::from_str(&ok(volume(&work, &ep, &["list", "--json"]), "list")).unwrap();
    assert_eq!(list[0]["volume_context"]["server"], "s1", "{list}");
    assert_eq!(list[0]["destroying"], false, "{list}");
    assert_ne!(list[0]["delete_imported"], true, "{list}");
    ok(volume(&work, &ep, &["destroy", "mine"]), "destroy");
    let list = ok(volume(&work, &ep, &["list", "--json"]), "list");
    assert_eq!(list.trim(), "[]");
    // Kept in the plugin, data and all.
    ok(
        volume(&work, &ep, &["import", "again", "--volume-id", &id]),
        "import again",
    );
    let out = isolator_command(CLI, &work)
        .args(["run", "--plugin-endpoint", &ep, "--volume", "again:8M:data"])
        .args(["--", "cat", "data/before"])
        .output()
        .unwrap();
    assert_eq!(ok(out, "run after the destroy"), "from before\n");
    ok(volume(&work, &ep, &["destroy", "again"]), "destroy");
    sb.assert_no_mounts_under();
}

#[test]
fn a_disk_without_provider_id_must_exist() {
    require_root();
    let sb = Sandbox::new("agent-disk");
    let work = sb.join("work");
    let missing = sb.join("prepared-by-the-operator");
    let resources = sb.join("res.json");
    let disk = serde_json::json!([{
        "name": "disk", "type": "SCALAR", "scalar": {"value": 64},
        "disk": {
            "source": {"type": "MOUNT", "mount": {"root": missing}},
            "volume": {"container_path": "data", "mode": "RW"}
        }
    }]);
    std::fs::write(&resources, disk.to_string()).unwrap();
    let run = || -> Command {
        let mut c = isolator_command(CLI, &work);
        c.args(["run", "--plugin-arg=--backing=dir", "--resources"])
            .arg(&resources)
            .args(["--", "cat", "data/f"]);
        c
    };
    let err = refused(run().output().unwrap(), "run of a missing agent disk");
    assert!(
        err.contains("has no provider_id")
            && err.contains(&missing.display().to_string())
            && err.contains("does not exist"),
        "{err}"
    );
    assert!(!err.contains("open_tree"), "{err}");
    sb.assert_no_mounts_under();
    // Prepared by the operator, it is mounted.
    std::fs::create_dir(&missing).unwrap();
    std::fs::write(missing.join("f"), "prepared\n").unwrap();
    let out = run().output().unwrap();
    assert_eq!(ok(out, "run of a prepared agent disk"), "prepared\n");
    sb.assert_no_mounts_under();
}

#[test]
fn a_refused_create_leaves_no_sandbox_warning() {
    require_root();
    let sb = Sandbox::new("refused-create");
    let work = sb.join("work");
    let out = isolator_command(CLI, &work)
        .env("RUST_LOG", "warn")
        .args([
            "run",
            "--plugin-arg=--backing=dir",
            "--plugin-arg=--require-parameters=server",
            "--volume",
            "v:8M:data",
            "--",
            "true",
        ])
        .output()
        .unwrap();
    let err = refused(out, "run whose CreateVolume is refused");
    assert!(err.contains("parameter 'server'"), "{err}");
    assert!(!err.contains("cannot remove the sandbox"), "{err}");
    sb.assert_no_mounts_under();
}

/// The bundled provider's id, which resources name.
const PROVIDER: &str = "csi-test-plugin.csi-isolator.io.default";

/// A profiles file (root's, 0644, in a root-owned directory) with profile
/// `shared` giving `share=/from-profile`, `elsewhere` giving `share=/elsewhere`
/// and `bare` giving no parameter.
fn profiles_file(sb: &Sandbox) -> std::path::PathBuf {
    let dir = sb.mkdir("profiles");
    let file = dir.join("profiles.json");
    std::fs::write(
        &file,
        r#"{"profile_matrix": {
            "shared": {
                "volume_capabilities": {"mount": {}, "access_mode": {"mode": "SINGLE_NODE_WRITER"}},
                "create_parameters": {"share": "/from-profile"}},
            "elsewhere": {
                "volume_capabilities": {"mount": {}, "access_mode": {"mode": "SINGLE_NODE_WRITER"}},
                "create_parameters": {"share": "/elsewhere"}},
            "bare": {
                "volume_capabilities": {"mount": {}, "access_mode": {"mode": "SINGLE_NODE_WRITER"}}}}}"#,
    )
    .unwrap();
    file
}

/// A disk of the bundled provider with a profile and no volume yet, named by its persistence id.
fn profile_disk(profile: &str, name: &str) -> serde_json::Value {
    serde_json::json!({
        "name": "disk", "type": "SCALAR", "scalar": {"value": 16},
        "provider_id": {"value": PROVIDER},
        "disk": {
            "source": {"type": "RAW", "profile": profile},
            "persistence": {"id": name},
            "volume": {"container_path": "data", "mode": "RW"}
        }
    })
}

// Multi-threaded: the client's connection must answer serve's shutdown (HTTP/2 GOAWAY and PING)
// while the test waits for serve to exit, or serve waits out its 10 s grace period.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_takes_parameters_imports_and_profile_disks() {
    use csi_isolator::service::proto::isolator_client::IsolatorClient;
    use csi_isolator::service::proto::{
        CleanupRequest, ContainerConfig, CreateVolumeRequest, ImportVolumeRequest, PrepareRequest,
        StatusRequest,
    };
    require_root();
    let sb = Sandbox::new("params-serve");
    let work = sb.join("work");
    let socket = sb.join("serve.sock");
    let profiles = profiles_file(&sb);
    let mut cmd = isolator_command(CLI, &work);
    cmd.args([
        "serve",
        "--plugin-arg=--backing=dir",
        "--plugin-arg=--require-parameters=share",
        "--disk-profiles",
    ])
    .arg(&profiles)
    .arg("--socket")
    .arg(&socket)
    .stdout(std::process::Stdio::piped());
    let mut child = sb.spawn(&mut cmd).expect("spawn serve");
    csi_isolator_testing::wait_for_serve_ready(&mut child, std::time::Duration::from_secs(30));
    let channel = csi_isolator::csi::transport::connect_unix(&socket)
        .await
        .unwrap();
    let mut c = IsolatorClient::new(channel);

    // CreateVolume: refused without the parameter, accepted with it, refused with another value.
    let create = |share: Option<&str>| CreateVolumeRequest {
        name: "v".into(),
        capacity_bytes: 8 << 20,
        parameters: share
            .map(|s| [("share".to_string(), s.to_string())].into())
            .unwrap_or_default(),
        ..Default::default()
    };
    let err = c.create_volume(create(None)).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("parameter 'share'"), "{err:?}");
    let made = c
        .create_volume(create(Some("/export")))
        .await
        .unwrap()
        .into_inner();
    assert!(
        made.resource_json.contains("parameter.share"),
        "{}",
        made.resource_json
    );
    let err = c.create_volume(create(Some("/other"))).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::AlreadyExists, "{err:?}");
    assert!(err.message().contains("key 'share'"), "{err:?}");
    let bad = CreateVolumeRequest {
        parameters: [("a b".to_string(), "x".to_string())].into(),
        ..create(None)
    };
    let err = c.create_volume(bad).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");

    // ImportVolume: an id the plugin lacks is refused by it, a recorded id under another name too.
    let import = |name: &str, id: &str| ImportVolumeRequest {
        name: name.into(),
        volume_id: id.into(),
        ..Default::default()
    };
    let err = c.import_volume(import("ghost", "nope")).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound, "{err:?}");
    let err = c
        .import_volume(import("again", &made.volume_id))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("already recorded as 'v'"), "{err:?}");

    // Prepare with a profile disk: created with the profile's parameters, then published.
    let sandbox = sb.mkdir("sandbox");
    let prepare = |resources: serde_json::Value| PrepareRequest {
        container_id: "c1".into(),
        config: Some(ContainerConfig {
            resources_json: resources.to_string(),
            sandbox: sandbox.display().to_string(),
            ..Default::default()
        }),
    };
    let err = c
        .prepare(prepare(serde_json::json!([profile_disk("slow", "pv1")])))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("disk profile 'slow'"), "{err:?}");
    let info = c
        .prepare(prepare(serde_json::json!([profile_disk("shared", "pv1")])))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.mounts.len(), 1);
    let status = c.status(StatusRequest {}).await.unwrap().into_inner();
    let pv1 = status.volumes.iter().find(|v| v.name == "pv1").unwrap();
    assert_eq!(pv1.parameters["share"], "/from-profile");
    assert_eq!(pv1.state, "PUBLISHED");
    c.cleanup(CleanupRequest {
        container_id: "c1".into(),
    })
    .await
    .unwrap();
    drop(c);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let status = child.wait().expect("wait for serve");
    sb.untrack(child.id());
    assert!(status.success(), "serve exited with {status:?}");
    sb.assert_no_mounts_under();
}

#[test]
fn run_creates_a_profile_disk_with_the_profiles_parameters() {
    require_root();
    let sb = Sandbox::new("params-profile-run");
    let work = sb.join("work");
    let profiles = profiles_file(&sb);
    let resources = sb.join("res.json");
    let run_with = |profiles_flag: bool, disk: serde_json::Value| {
        std::fs::write(&resources, serde_json::json!([disk]).to_string()).unwrap();
        let mut c = isolator_command(CLI, &work);
        c.args([
            "run",
            "--plugin-arg=--backing=dir",
            "--plugin-arg=--require-parameters=share=/from-profile",
        ]);
        if profiles_flag {
            c.arg("--disk-profiles").arg(&profiles);
        }
        c.arg("--resources")
            .arg(&resources)
            .args(["--", "sh", "-c", "echo hi > data/f; cat data/f"])
            .output()
            .unwrap()
    };
    let run = |profiles_flag: bool| run_with(profiles_flag, profile_disk("shared", "pv1"));
    let list = || -> serde_json::Value {
        serde_json::from_str(&ok(
            isolator_command(CLI, &work)
                .args(["volume", "--plugin-arg=--backing=dir", "list", "--json"])
                .output()
                .unwrap(),
            "list",
        ))
        .unwrap()
    };
    let err = refused(run(false), "run without a profiles file");
    assert!(
        err.contains("disk profile 'shared'") && err.contains("--disk-profiles"),
        "{err}"
    );
    // A profile without the parameter: the plugin refuses the create, naming it; nothing recorded.
    let err = refused(
        run_with(true, profile_disk("bare", "pv0")),
        "run of a profile without the parameter",
    );
    assert!(err.contains("parameter 'share'"), "{err}");
    assert_eq!(list(), serde_json::json!([]));
    // A profile disk without the persistence id that names its volume.
    let mut unnamed = profile_disk("shared", "x");
    unnamed["disk"]
        .as_object_mut()
        .unwrap()
        .remove("persistence");
    let err = refused(run_with(true, unnamed), "run of an unnamed profile disk");
    assert!(err.contains("needs disk.persistence.id"), "{err}");
    assert_eq!(list(), serde_json::json!([]));
    sb.assert_no_mounts_under();

    assert_eq!(ok(run(true), "run with the profiles file"), "hi\n");
    let list = list();
    assert_eq!(list[0]["name"], "pv1");
    assert_eq!(list[0]["profile"], "shared");
    assert_eq!(
        list[0]["volume_context"]["parameter.share"],
        "/from-profile"
    );
    // The same name through a profile with other parameters: refused by key.
    let err = refused(
        run_with(true, profile_disk("elsewhere", "pv1")),
        "run of the same disk with another profile",
    );
    assert!(
        err.contains("other CreateVolume parameters") && err.contains("key 'share'"),
        "{err}"
    );
    // The same resource again is the same volume.
    assert_eq!(ok(run(true), "a second run"), "hi\n");
    sb.assert_no_mounts_under();
}

/// A profile of block volumes (`volume_capabilities.block`): a RAW or BLOCK profile disk through it
/// is a block volume, a device file in the container that one run writes and the next reads; a
/// MOUNT disk through it, and a BLOCK disk through a profile of mount volumes, are refused naming
/// both, nothing created.
#[test]
fn a_block_profile_disk_is_a_device_file_in_the_container() {
    require_root();
    let sb = Sandbox::new("profile-block");
    let work = sb.join("work");
    let profiles = sb.mkdir("profiles").join("profiles.json");
    std::fs::write(
        &profiles,
        r#"{"profile_matrix": {
            "raw": {"volume_capabilities": {"block": {}, "access_mode": {"mode": "SINGLE_NODE_WRITER"}}},
            "fs": {"volume_capabilities": {"mount": {"fs_type": "ext4"}, "access_mode": {"mode": "SINGLE_NODE_WRITER"}}}}}"#,
    )
    .unwrap();
    let resources = sb.join("res.json");
    let run = |disk: serde_json::Value, script: &str| {
        std::fs::write(&resources, serde_json::json!([disk]).to_string()).unwrap();
        isolator_command(CLI, &work)
            .args(["run", "--disk-profiles"])
            .arg(&profiles)
            .arg("--resources")
            .arg(&resources)
            .args(["--", "sh", "-c", script])
            .output()
            .unwrap()
    };
    let typed = |kind: &str, profile: &str, name: &str| {
        let mut disk = profile_disk(profile, name);
        disk["disk"]["source"]["type"] = kind.into();
        disk
    };
    let list = || -> Vec<String> {
        let out = isolator_command(CLI, &work)
            .args(["volume", "list", "--json"])
            .output()
            .unwrap();
        let listed: serde_json::Value = serde_json::from_str(&ok(out, "list")).unwrap();
        let mut volumes: Vec<String> = listed
            .as_array()
            .unwrap()
            .iter()
            .map(|v| format!("{} {}", v["name"], v["capability"]["access_type"]))
            .collect();
        volumes.sort();
        volumes
    };
    let err = refused(
        run(typed("MOUNT", "raw", "pv-m"), "true"),
        "a MOUNT disk through a block profile",
    );
    assert!(
        err.contains("disk.source.type MOUNT asks for a mount volume, but disk profile 'raw' makes block volumes"),
        "{err}"
    );
    let err = refused(
        run(typed("BLOCK", "fs", "pv-b"), "true"),
        "a BLOCK disk through a mount profile",
    );
    assert!(
        err.contains("disk.source.type BLOCK asks for a block volume, but disk profile 'fs' makes mount volumes"),
        "{err}"
    );
    assert!(list().is_empty(), "nothing created: {:?}", list());

    let wrote = ok(
        run(
            profile_disk("raw", "pv-raw"),
            "test -b data && printf block-data | dd of=data conv=notrunc status=none && echo written",
        ),
        "a RAW disk through a block profile",
    );
    assert_eq!(wrote, "written\n");
    let read = ok(
        run(
            typed("BLOCK", "raw", "pv-raw"),
            "test -b data && head -c 10 data",
        ),
        "the same disk, typed BLOCK",
    );
    assert_eq!(read, "block-data");
    let fs = ok(
        run(
            typed("MOUNT", "fs", "pv-fs"),
            "test -d data && df -T data | tail -1 | grep -q ext4 && echo fs",
        ),
        "a MOUNT disk through a mount profile",
    );
    assert_eq!(fs, "fs\n");
    assert_eq!(
        list(),
        ["\"pv-fs\" null", "\"pv-raw\" \"block\""],
        "a block volume and a mount one"
    );
    sb.assert_no_mounts_under();
    sb.assert_no_loop_devices();
}

#[test]
fn a_profiles_file_someone_else_can_write_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    require_root();
    let sb = Sandbox::new("params-profile-attack");
    let work = sb.join("work");
    let good = profiles_file(&sb);
    let list = |file: &Path| {
        isolator_command(CLI, &work)
            .args(["volume", "--plugin-arg=--backing=dir", "--disk-profiles"])
            .arg(file)
            .args(["list"])
            .output()
            .unwrap()
    };
    ok(list(&good), "list with a root-only profiles file");
    // Writable by others.
    std::fs::set_permissions(&good, std::fs::Permissions::from_mode(0o666)).unwrap();
    let err = refused(list(&good), "a world-writable profiles file");
    assert!(err.contains("writable by group or others"), "{err}");
    std::fs::set_permissions(&good, std::fs::Permissions::from_mode(0o644)).unwrap();
    // Owned by another user.
    std::os::unix::fs::chown(&good, Some(65534), None).unwrap();
    let err = refused(list(&good), "a profiles file of nobody's");
    assert!(err.contains("not owned by root"), "{err}");
    std::os::unix::fs::chown(&good, Some(0), None).unwrap();
    // A symbolic link to it.
    let link = sb.join("profiles/link.json");
    std::os::unix::fs::symlink(&good, &link).unwrap();
    let err = refused(list(&link), "a symlinked profiles file");
    assert!(err.contains("symbolic link"), "{err}");
    // In a directory others can write.
    let open = sb.mkdir("open");
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    let planted = open.join("p.json");
    std::fs::copy(&good, &planted).unwrap();
    let err = refused(list(&planted), "a profiles file in an open directory");
    assert!(err.contains("writable by group or others"), "{err}");
    // Oversized.
    std::fs::write(&good, vec![b' '; (1 << 20) + 1]).unwrap();
    let err = refused(list(&good), "an oversized profiles file");
    assert!(err.contains("over 1048576 bytes"), "{err}");
}
