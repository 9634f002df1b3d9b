//! Snapshots and clones through `csi-isolator volume`, as a user runs them, with the bundled
//! plugin in both backings: a volume made from a snapshot holds the snapshot's data and not
//! the source's later writes; a clone holds the source's data as it was and not its later
//! writes; snapshots outlive their source volume (said on destroy) and go with `snapshot
//! delete`; a plugin without the capability, an unknown name and a taken name are refused
//! before any RPC and change nothing.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use csi_isolator_testing::files::files_named;
use csi_isolator_testing::{isolator_command, processes_mentioning, require_root, Sandbox};

const CLI: &str = env!("CARGO_BIN_EXE_csi-isolator");

fn cli(work: &Path, backing: &str) -> Command {
    let mut c = isolator_command(CLI, work);
    c.arg("volume")
        .arg(format!("--plugin-arg=--backing={backing}"));
    c
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn ok(cmd: &mut Command) -> Output {
    let out = cmd.output().expect("run csi-isolator");
    assert!(
        out.status.success(),
        "{cmd:?}: {}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    out
}

fn refused(cmd: &mut Command, says: &str) {
    let out = cmd.output().expect("run csi-isolator");
    assert!(!out.status.success(), "{cmd:?} succeeded");
    assert!(
        text(&out.stderr).contains(says),
        "{cmd:?}: {}",
        text(&out.stderr)
    );
}

fn publish(work: &Path, backing: &str, volume: &str, container: &str) -> PathBuf {
    let out = ok(cli(work, backing).args(["publish", volume, "--container", container]));
    PathBuf::from(text(&out.stdout).trim())
}

fn release(work: &Path, backing: &str, volume: &str, container: &str) {
    ok(cli(work, backing).args(["release", volume, "--container", container]));
}

fn snapshots(work: &Path, backing: &str) -> Vec<serde_json::Value> {
    let out = ok(cli(work, backing).args(["snapshot", "list", "--json"]));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn assert_nothing_left(sb: &Sandbox, work: &Path) {
    sb.assert_no_mounts_under();
    sb.assert_no_loop_devices();
    let procs = processes_mentioning(work);
    assert!(procs.is_empty(), "processes left: {procs:?}");
}

fn from_a_snapshot_and_a_clone(backing: &str) {
    let sb = Sandbox::new(&format!("snapshots-{backing}"));
    let work = sb.join("work");
    ok(cli(&work, backing).args(["create", "src", "16M"]));
    let at = publish(&work, backing, "src", "c1");
    std::fs::write(at.join("data"), "first").unwrap();
    // A snapshot of a volume in use (the bundled plugin makes the copy consistent).
    let taken = ok(cli(&work, backing).args(["snapshot", "create", "src", "snap1"]));
    let said = text(&taken.stdout);
    assert!(
        said.starts_with("snap-") && said.trim_end().ends_with(" bytes"),
        "{said}"
    );
    // The same name again is the same snapshot.
    let again = ok(cli(&work, backing).args(["snapshot", "create", "src", "snap1"]));
    assert_eq!(text(&again.stdout), said);
    std::fs::write(at.join("data"), "second").unwrap();
    std::fs::write(at.join("later"), "x").unwrap();

    ok(cli(&work, backing).args(["create", "restored", "16M", "--from-snapshot", "snap1"]));
    let r = publish(&work, backing, "restored", "c2");
    assert_eq!(std::fs::read_to_string(r.join("data")).unwrap(), "first");
    assert!(!r.join("later").exists(), "a write after the snapshot");

    ok(cli(&work, backing).args(["create", "copy", "16M", "--from-volume", "src"]));
    let c = publish(&work, backing, "copy", "c3");
    assert_eq!(std::fs::read_to_string(c.join("data")).unwrap(), "second");
    std::fs::write(at.join("data"), "third").unwrap();
    assert_eq!(std::fs::read_to_string(c.join("data")).unwrap(), "second");
    // And the new volumes are their own: writes to them leave the source alone.
    std::fs::write(r.join("data"), "mine").unwrap();
    assert_eq!(std::fs::read_to_string(at.join("data")).unwrap(), "third");

    let listed = snapshots(&work, backing);
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0]["name"], "snap1");
    assert_eq!(listed[0]["source_name"], "src");
    assert!(listed[0].get("pending").is_none(), "{listed:?}");
    let vols = ok(cli(&work, backing).args(["list", "--json"]));
    let vols: Vec<serde_json::Value> = serde_json::from_slice(&vols.stdout).unwrap();
    let restored = vols.iter().find(|v| v["name"] == "restored").unwrap();
    assert_eq!(restored["content_source"]["snapshot"]["name"], "snap1");
    let copy = vols.iter().find(|v| v["name"] == "copy").unwrap();
    assert_eq!(copy["content_source"]["volume"]["name"], "src");
    // A name taken by a snapshot of another volume.
    refused(
        cli(&work, backing).args(["snapshot", "create", "copy", "snap1"]),
        "taken by a snapshot of volume 'src'",
    );
    // The same volume name from another source.
    refused(
        cli(&work, backing).args(["create", "restored", "16M", "--from-volume", "src"]),
        "content source",
    );

    for (v, c) in [("src", "c1"), ("restored", "c2"), ("copy", "c3")] {
        release(&work, backing, v, c);
    }
    // The source goes; its snapshot stays, and is said to.
    let gone = ok(cli(&work, backing).args(["destroy", "src"]));
    assert!(
        text(&gone.stderr).contains("its snapshots snap1 stay"),
        "{}",
        text(&gone.stderr)
    );
    ok(cli(&work, backing).args(["create", "again", "16M", "--from-snapshot", "snap1"]));
    let a = publish(&work, backing, "again", "c4");
    assert_eq!(std::fs::read_to_string(a.join("data")).unwrap(), "first");
    release(&work, backing, "again", "c4");
    ok(cli(&work, backing).args(["snapshot", "delete", "snap1"]));
    assert!(snapshots(&work, backing).is_empty());
    refused(
        cli(&work, backing).args(["snapshot", "delete", "snap1"]),
        "there is no snapshot 'snap1'",
    );
    for v in ["restored", "copy", "again"] {
        ok(cli(&work, backing).args(["destroy", v]));
    }
    let plugin_snapshots = work.join("csi");
    assert!(
        !has_dir_named(&plugin_snapshots, "snapshots"),
        "a snapshot directory is left under {}",
        plugin_snapshots.display()
    );
    assert_nothing_left(&sb, &work);
}

/// Whether a non-empty directory named `name` is under `dir`.
fn has_dir_named(dir: &Path, name: &str) -> bool {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return false;
    };
    entries.flatten().any(|e| {
        let p = e.path();
        p.is_dir()
            && ((e.file_name() == name
                && std::fs::read_dir(&p)
                    .map(|mut d| d.next().is_some())
                    .unwrap_or(false))
                || has_dir_named(&p, name))
    })
}

#[test]
fn dir_volumes_from_a_snapshot_and_a_clone_hold_their_data() {
    require_root();
    from_a_snapshot_and_a_clone("dir");
}

#[test]
fn loop_volumes_from_a_snapshot_and_a_clone_hold_their_data() {
    require_root();
    from_a_snapshot_and_a_clone("loop");
}

/// A plugin without CREATE_DELETE_SNAPSHOT or CLONE_VOLUME, and unknown names, are refused
/// before any RPC, naming what to do; nothing is recorded.
#[test]
fn what_cannot_be_done_is_refused_before_any_rpc() {
    require_root();
    let sb = Sandbox::new("snapshots-refused");
    let work = sb.join("work");
    let b = "dir";
    ok(cli(&work, b).args(["create", "v", "8M"]));
    refused(
        cli(&work, b).args([
            "--plugin-arg=--no-snapshots",
            "snapshot",
            "create",
            "v",
            "s",
        ]),
        "the plugin cannot take snapshots (its controller has no CREATE_DELETE_SNAPSHOT)",
    );
    refused(
        cli(&work, b).args(["snapshot", "create", "nope", "s"]),
        "no volume with id or name 'nope'",
    );
    refused(
        cli(&work, b).args(["snapshot", "create", "v", "bad\u{1}name"]),
        "invalid snapshot",
    );
    refused(
        cli(&work, b).args(["create", "w", "8M", "--from-snapshot", "nope"]),
        "there is no snapshot 'nope'",
    );
    refused(
        cli(&work, b).args(["create", "w", "8M", "--from-volume", "nope"]),
        "there is no volume 'nope'",
    );
    refused(
        cli(&work, b).args([
            "--plugin-arg=--no-clones",
            "create",
            "w",
            "8M",
            "--from-volume",
            "v",
        ]),
        "the plugin cannot clone volumes (its controller has no CLONE_VOLUME)",
    );
    ok(cli(&work, b).args(["snapshot", "create", "v", "s"]));
    refused(
        cli(&work, b).args([
            "--plugin-arg=--no-snapshots",
            "create",
            "w",
            "8M",
            "--from-snapshot",
            "s",
        ]),
        "the plugin cannot take snapshots",
    );
    refused(
        cli(&work, b).args([
            "create",
            "w",
            "8M",
            "--from-snapshot",
            "s",
            "--from-volume",
            "v",
        ]),
        "cannot be used with",
    );
    let vols = ok(cli(&work, b).args(["list", "--json"]));
    let vols: Vec<serde_json::Value> = serde_json::from_slice(&vols.stdout).unwrap();
    assert_eq!(vols.len(), 1, "{vols:?}");
    assert_eq!(snapshots(&work, b).len(), 1);
    ok(cli(&work, b).args(["snapshot", "delete", "s"]));
    ok(cli(&work, b).args(["destroy", "v"]));
    assert!(!has_dir_named(&work.join("csi"), "snapshots"));
    assert_nothing_left(&sb, &work);
}

/// Hostile snapshot names (a caller's): path-like names are CSI-valid names, recorded under
/// their encoding inside `snapshots/` and nowhere else; names CSI bans are refused before
/// anything is written; a name is never a path.
#[test]
fn hostile_snapshot_names_stay_names() {
    require_root();
    let sb = Sandbox::new("snapshots-names");
    let work = sb.join("work");
    let b = "dir";
    ok(cli(&work, b).args(["create", "v", "8M"]));
    let long = "x".repeat(129);
    for bad in [long.as_str(), "", "a\u{7f}b"] {
        refused(
            cli(&work, b).args(["snapshot", "create", "v", bad]),
            "invalid snapshot",
        );
    }
    let names = ["../../escape", "/etc/passwd", ".", "a/../b"];
    for name in names {
        ok(cli(&work, b).args(["snapshot", "create", "v", name]));
    }
    let listed: Vec<String> = snapshots(&work, b)
        .iter()
        .map(|s| s["name"].as_str().unwrap().to_string())
        .collect();
    let mut want: Vec<String> = names.iter().map(|n| n.to_string()).collect();
    want.sort();
    assert_eq!(listed, want);
    // Every record is one level under a `snapshots/` directory, nothing escaped it.
    let records = files_named(&work, "snapshot.state");
    assert_eq!(records.len(), names.len(), "{records:?}");
    for r in &records {
        assert_eq!(
            r.parent().unwrap().parent().unwrap().file_name().unwrap(),
            "snapshots",
            "{}",
            r.display()
        );
    }
    assert!(!sb.join("escape").exists() && !work.join("escape").exists());
    for name in names {
        ok(cli(&work, b).args(["snapshot", "delete", name]));
    }
    ok(cli(&work, b).args(["destroy", "v"]));
    assert!(files_named(&work, "snapshot.state").is_empty());
    assert_nothing_left(&sb, &work);
}

/// The snapshot calls carry the `snapshot` entry of the source volume's secrets file (the
/// plugin, under `--require-secrets`, refuses any other): with the right one the snapshot is
/// taken and deleted; with a wrong one CreateSnapshot is refused UNAUTHENTICATED, naming the
/// key and never the value, and the refused snapshot leaves no record.
#[test]
fn snapshot_calls_carry_the_snapshot_secrets() {
    use std::os::unix::fs::PermissionsExt;
    require_root();
    let sb = Sandbox::new("snapshots-secrets");
    let work = sb.join("work");
    let secret = |value: &str| {
        format!(
            r#"{{"create": {{"k": "c"}}, "node_publish": {{}}, "snapshot": {{"sk": "{value}"}}}}"#
        )
    };
    let write = |name: &str, text: &str| {
        let path = sb.join(name);
        std::fs::write(&path, text).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        path.display().to_string()
    };
    let required = write("plugin.json", &secret("right-value"));
    let right = write("right.json", &secret("right-value"));
    let wrong = write("wrong.json", &secret("wrong-value"));
    let plugin = format!("--plugin-arg=--require-secrets={required}");
    let cli = |work: &Path| {
        let mut c = cli(work, "dir");
        c.arg(&plugin);
        c
    };
    ok(cli(&work).args(["create", "good", "8M", "--secrets", &right]));
    ok(cli(&work).args(["create", "bad", "8M", "--secrets", &wrong]));
    ok(cli(&work).args(["snapshot", "create", "good", "s1"]));
    let out = cli(&work)
        .args(["snapshot", "create", "bad", "s2"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("CreateSnapshot") && err.contains("'sk'") && err.contains("UNAUTHENTICATED"),
        "{err}"
    );
    assert!(
        !err.contains("wrong-value") && !err.contains("right-value"),
        "{err}"
    );
    let names: Vec<_> = snapshots(&work, "dir")
        .iter()
        .map(|s| s["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(names, ["s1"]);
    ok(cli(&work).args(["snapshot", "delete", "s1"]));
    for v in ["good", "bad"] {
        ok(cli(&work).args(["destroy", v]));
    }
    assert!(files_named(&work, "snapshot.state").is_empty());
    assert_nothing_left(&sb, &work);
}

/// serve's snapshot RPCs refuse with the codes their contract gives, before any RPC: an unknown
/// volume or snapshot is NOT_FOUND, a name taken by a snapshot of another volume ALREADY_EXISTS,
/// both content sources INVALID_ARGUMENT; nothing is recorded by a refusal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_refuses_with_the_contracts_codes() {
    use csi_isolator::service::proto::{
        CreateSnapshotRequest, CreateVolumeRequest, DeleteSnapshotRequest, DestroyVolumeRequest,
        ListSnapshotsRequest,
    };
    use tonic::Code;
    require_root();
    let mut w = csi_isolator_testing::crash::ServeRuns::new(Sandbox::new("snapshots-serve"), CLI);
    w.start(None);
    let mut c = w.client().await;
    let mut ids = Vec::new();
    for name in ["a", "b"] {
        let v = c
            .create_volume(CreateVolumeRequest {
                name: name.into(),
                capacity_bytes: 8 << 20,
                ..Default::default()
            })
            .await
            .expect("CreateVolume")
            .into_inner();
        ids.push(v.volume_id);
    }
    let snap = |volume_id: &str, name: &str| CreateSnapshotRequest {
        volume_id: volume_id.into(),
        name: name.into(),
        ..Default::default()
    };
    let taken = c
        .create_snapshot(snap(&ids[0], "s"))
        .await
        .expect("CreateSnapshot")
        .into_inner();
    assert!(taken.snapshot_id.starts_with("snap-") && taken.pending.is_empty());
    let code = |r: Result<tonic::Response<_>, tonic::Status>| match r {
        Ok(tonic::Response { .. }) => panic!("not refused"),
        Err(status) => status.code(),
    };
    assert_eq!(
        c.create_snapshot(snap("vol-nope", "t"))
            .await
            .unwrap_err()
            .code(),
        Code::NotFound
    );
    assert_eq!(
        c.create_snapshot(snap(&ids[1], "s"))
            .await
            .unwrap_err()
            .code(),
        Code::AlreadyExists
    );
    assert_eq!(
        c.create_snapshot(snap(&ids[0], ""))
            .await
            .unwrap_err()
            .code(),
        Code::InvalidArgument
    );
    let from = |snapshot: &str, volume: &str| CreateVolumeRequest {
        name: "c".into(),
        capacity_bytes: 8 << 20,
        from_snapshot: snapshot.into(),
        from_volume: volume.into(),
        ..Default::default()
    };
    assert_eq!(
        code(c.create_volume(from("nope", "")).await),
        Code::NotFound
    );
    assert_eq!(
        code(c.create_volume(from("", "nope")).await),
        Code::NotFound
    );
    assert_eq!(
        code(c.create_volume(from("s", "a")).await),
        Code::InvalidArgument
    );
    assert_eq!(
        c.delete_snapshot(DeleteSnapshotRequest {
            name: "nope".into(),
            ..Default::default()
        })
        .await
        .unwrap_err()
        .code(),
        Code::NotFound
    );
    let listed = c
        .list_snapshots(ListSnapshotsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .snapshots;
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].source_volume_id, ids[0]);
    c.delete_snapshot(DeleteSnapshotRequest {
        name: "s".into(),
        ..Default::default()
    })
    .await
    .expect("DeleteSnapshot");
    for id in ids {
        c.destroy_volume(DestroyVolumeRequest {
            volume_id: id,
            ..Default::default()
        })
        .await
        .expect("DestroyVolume");
    }
    drop(c);
    assert!(w.end(true).success());
    w.sb.assert_no_mounts_under();
    w.sb.assert_no_loop_devices();
}
