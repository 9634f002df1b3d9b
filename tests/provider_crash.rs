//! Crash at every durable write (and right after every RPC, before its
//! result is recorded): for each such point N of create, publish,
//! release (unpublish) and destroy, the `csi-isolator` process is killed
//! with SIGKILL right after write N (`CSI_ISOLATOR_CRASH_AFTER_WRITE=N`, a
//! real kill, not an early return), a new process recovers, and then the
//! state files, the plugin's view and the mount table must agree, with
//! nothing leaked. The plugin runs on its own (an agent crash does not take
//! it down) and is asked for its view over CSI.

use csi_isolator_testing::plugin_bin;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use csi_isolator::csi::proto;
use csi_isolator::mount::{MountTable, ProcMountTable};
use csi_isolator::provider::checkpoint::CRASH_AFTER_WRITE_ENV;
use csi_isolator::provider::{VolumeRecord, VolumeState};
use csi_isolator::resource::Layout;
use csi_isolator_testing::{raw_clients, require_root, PluginProcess, Sandbox};

const CLI: &str = env!("CARGO_BIN_EXE_csi-isolator");
const TYPE: &str = csi_isolator::provider::bundled::BUNDLED_TYPE;

struct Agent {
    work: PathBuf,
    endpoint: String,
    policy: &'static str,
}

impl Agent {
    fn run(&self, args: &[&str], crash_after: Option<u32>) -> Output {
        let mut cmd = Command::new(CLI);
        cmd.arg("--work-dir")
            .arg(&self.work)
            .args([
                "volume",
                "--plugin-endpoint",
                &self.endpoint,
                "--policy",
                self.policy,
            ])
            .args(args)
            .env_remove(CRASH_AFTER_WRITE_ENV);
        if let Some(n) = crash_after {
            cmd.env(CRASH_AFTER_WRITE_ENV, n.to_string());
        }
        cmd.output().expect("run csi-isolator")
    }

    fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args, None);
        assert!(
            out.status.success(),
            "csi-isolator {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    /// A fresh process: it recovers on start; `list --json` shows the result.
    fn recover(&self) -> Vec<VolumeRecord> {
        serde_json::from_str(&self.ok(&["list", "--json"])).unwrap()
    }

    fn layout(&self) -> Layout {
        Layout::new(&self.work, TYPE, "default")
    }
}

fn mounted_under(dir: &Path) -> Vec<PathBuf> {
    ProcMountTable::new()
        .mounts_under(dir)
        .unwrap()
        .into_iter()
        .map(|m| m.mount_point)
        .collect()
}

/// The plugin's view of a volume: (exists, controller-published, published at `target`).
async fn plugin_view(plugin: &PluginProcess, id: &str, target: &Path) -> (bool, bool, bool) {
    let listed = plugin.listed().await;
    let entry = listed
        .iter()
        .find(|e| e.volume.as_ref().map(|v| v.volume_id.as_str()) == Some(id));
    let controller_published = entry
        .and_then(|e| e.status.as_ref())
        .is_some_and(|s| !s.published_node_ids.is_empty());
    let mut raw = raw_clients(&plugin.socket()).await.unwrap();
    let stats = raw
        .node
        .node_get_volume_stats(proto::NodeGetVolumeStatsRequest {
            volume_id: id.to_string(),
            volume_path: target.display().to_string(),
            ..Default::default()
        })
        .await;
    // NOT_FOUND is the plugin's "not published there"; any other error is a broken plugin, not a no.
    let node_published = match stats {
        Ok(_) => true,
        Err(s) if s.code() == tonic::Code::NotFound => false,
        Err(s) => panic!("NodeGetVolumeStats of {id}: {s}"),
    };
    (entry.is_some(), controller_published, node_published)
}

/// `status` read through the volume summary (when current) and by the full scan answer alike.
fn same_status(agent: &Agent, n: u32) {
    use csi_isolator::provider::status::{scan_with, ScanOptions};
    let table = ProcMountTable::new();
    let scan = |use_summary| {
        let how = ScanOptions {
            use_summary,
            ..ScanOptions::default()
        };
        serde_json::to_string(&scan_with(&agent.work, &table, how).unwrap()).unwrap()
    };
    assert_eq!(
        scan(true),
        scan(false),
        "write {n}: status through the summary differs from the full scan"
    );
}

/// No temporary files, no create intents, no orphaned mount directories.
fn assert_tidy(agent: &Agent, records: &[VolumeRecord]) {
    let layout = agent.layout();
    for rec in records {
        let dir = layout.volume_dir(&rec.volume_id);
        for e in std::fs::read_dir(&dir).unwrap() {
            let name = e.unwrap().file_name();
            assert_eq!(name, "volume.state", "stray file in {}", dir.display());
        }
    }
    let intents = std::fs::read_dir(layout.creating_dir())
        .map(|d| d.count())
        .unwrap_or(0);
    assert_eq!(intents, 0, "create intents left");
    if let Ok(d) = std::fs::read_dir(layout.mounts_dir()) {
        let known: Vec<String> = records
            .iter()
            .map(|r| csi_isolator::resource::encode_volume_id(&r.volume_id))
            .collect();
        for e in d {
            let name = e.unwrap().file_name().to_string_lossy().into_owned();
            assert!(known.contains(&name), "orphaned mount directory {name}");
        }
    }
}

enum Op {
    Create,
    Publish,
    Release,
    Destroy,
    /// `import` of a volume made in the plugin behind the provider's back.
    Import,
    /// `destroy` of an imported volume: forgotten, kept in the plugin.
    DestroyImported,
}

/// Makes a volume in the plugin directly (CSI CreateVolume), as another CO would: its id.
async fn made_behind_our_back(plugin: &PluginProcess) -> String {
    let mut raw = raw_clients(&plugin.socket()).await.unwrap();
    let cap = csi_isolator::provider::Capability::default().to_proto();
    raw.controller
        .create_volume(proto::CreateVolumeRequest {
            name: "theirs".into(),
            capacity_range: Some(proto::CapacityRange {
                required_bytes: 8 << 20,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![cap],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap()
        .volume_id
}

/// Runs `op` with a crash after write `n`; returns false when the operation
/// completed without reaching write `n` (every write has been crashed at).
async fn crash_once(op: &Op, n: u32) -> bool {
    let sb = Sandbox::new("crash");
    let plugin = PluginProcess::start(&sb, plugin_bin(), &[]).await;
    let agent = Agent {
        work: sb.mkdir("work"),
        endpoint: plugin.endpoint(),
        policy: if matches!(op, Op::Destroy | Op::DestroyImported) {
            "keep"
        } else {
            "last-use"
        },
    };
    let mut id = None;
    let theirs = if matches!(op, Op::Import | Op::DestroyImported) {
        Some(made_behind_our_back(&plugin).await)
    } else {
        None
    };
    if matches!(op, Op::DestroyImported) {
        agent.ok(&["import", "v", "--volume-id", theirs.as_deref().unwrap()]);
        agent.ok(&["publish", "v", "--container", "c1"]);
        agent.ok(&["release", "v", "--container", "c1"]);
    }
    if !matches!(op, Op::Create | Op::Import | Op::DestroyImported) {
        let res: serde_json::Value =
            serde_json::from_str(&agent.ok(&["create", "v", "8M"])).unwrap();
        id = Some(res["disk"]["source"]["id"].as_str().unwrap().to_string());
    }
    if matches!(op, Op::Release | Op::Destroy) {
        agent.ok(&["publish", "v", "--container", "c1"]);
    }
    if matches!(op, Op::Destroy) {
        agent.ok(&["release", "v", "--container", "c1"]);
    }
    let import_args;
    let args: &[&str] = match op {
        Op::Create => &["create", "v", "8M"],
        Op::Publish => &["publish", "v", "--container", "c1"],
        Op::Release => &["release", "v", "--container", "c1"],
        Op::Destroy | Op::DestroyImported => &["destroy", "v"],
        Op::Import => {
            import_args = ["import", "v", "--volume-id", theirs.as_deref().unwrap()];
            &import_args
        }
    };
    let out = agent.run(args, Some(n));
    if out.status.success() {
        // Completed without a crash: a publish leaves the volume mounted, so take it down.
        if matches!(op, Op::Publish) {
            agent.ok(&["release", "v", "--container", "c1"]);
        }
        sb.assert_no_mounts_under();
        return false;
    }
    assert_eq!(
        out.status.signal(),
        Some(9),
        "write {n}: expected death by SIGKILL, got {:?}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );

    // The volume summary has its crash points with the compaction's: whatever a crash left,
    // `status` from it says what the full scan says, before and after the recovery.
    same_status(&agent, n);
    let records = agent.recover();
    same_status(&agent, n);
    assert_tidy(&agent, &records);
    let work = agent.work.clone();
    match op {
        Op::Create => {
            assert_eq!(records.len(), 1, "write {n}: exactly one volume named v");
            let rec = &records[0];
            assert_eq!(rec.name.as_deref(), Some("v"));
            assert_eq!(rec.state, VolumeState::Created);
            let (exists, _, _) =
                plugin_view(&plugin, &rec.volume_id, Path::new("/nonexistent")).await;
            assert!(exists, "write {n}: the plugin has the volume");
            assert_eq!(
                plugin.listed().await.len(),
                1,
                "write {n}: no second volume in the plugin"
            );
        }
        Op::Publish => {
            let rec = &records[0];
            let target = agent.layout().target_path(&rec.volume_id);
            assert_eq!(rec.state, VolumeState::Published, "write {n}");
            assert_eq!(
                rec.users.iter().collect::<Vec<_>>(),
                vec!["c1"],
                "write {n}"
            );
            assert!(
                mounted_under(&work).contains(&target),
                "write {n}: target mounted"
            );
            assert_eq!(
                plugin_view(&plugin, &rec.volume_id, &target).await,
                (true, true, true),
                "write {n}"
            );
        }
        Op::Release => {
            let rec = &records[0];
            let target = agent.layout().target_path(&rec.volume_id);
            assert_eq!(rec.state, VolumeState::Created, "write {n}");
            assert!(rec.users.is_empty(), "write {n}");
            assert!(
                mounted_under(&work).is_empty(),
                "write {n}: nothing mounted"
            );
            assert_eq!(
                plugin_view(&plugin, &rec.volume_id, &target).await,
                (true, false, false),
                "write {n}"
            );
        }
        Op::Import => {
            let theirs = theirs.as_deref().unwrap();
            assert_eq!(records.len(), 1, "write {n}: exactly one volume named v");
            let rec = &records[0];
            assert_eq!(rec.name.as_deref(), Some("v"));
            assert_eq!(rec.volume_id, theirs, "write {n}");
            assert!(rec.pre_provisioned, "write {n}: recorded as imported");
            assert_eq!(rec.state, VolumeState::Created);
            let (exists, _, _) = plugin_view(&plugin, theirs, Path::new("/nonexistent")).await;
            assert!(exists, "write {n}: the plugin still has it");
        }
        Op::DestroyImported => {
            let theirs = theirs.as_deref().unwrap();
            assert!(records.is_empty(), "write {n}: volume forgotten");
            assert!(!agent.layout().state_file(theirs).exists());
            assert!(
                mounted_under(&work).is_empty(),
                "write {n}: nothing mounted"
            );
            let target = agent.layout().target_path(theirs);
            assert_eq!(
                plugin_view(&plugin, theirs, &target).await,
                (true, false, false),
                "write {n}: kept in the plugin, unpublished"
            );
        }
        Op::Destroy => {
            assert!(records.is_empty(), "write {n}: volume forgotten");
            let id = id.as_deref().unwrap();
            assert!(!agent.layout().state_file(id).exists());
            assert!(
                mounted_under(&work).is_empty(),
                "write {n}: nothing mounted"
            );
            let target = agent.layout().target_path(id);
            assert_eq!(
                plugin_view(&plugin, id, &target).await,
                (false, false, false),
                "write {n}"
            );
        }
    }
    // The volume still works after recovery: a full cycle, then gone.
    if !matches!(op, Op::Destroy | Op::DestroyImported) {
        agent.ok(&["publish", "v", "--container", "c2"]);
        agent.ok(&["release", "v", "--container", "c2"]);
        if matches!(op, Op::Publish) {
            agent.ok(&["release", "v", "--container", "c1"]);
        }
        agent.ok(&["destroy", "v", "--delete"]);
    }
    sb.assert_no_mounts_under();
    true
}

async fn crash_at_every_write(op: Op, at_least: u32) {
    require_root();
    let mut n = 1;
    while crash_once(&op, n).await {
        n += 1;
        assert!(n < 50, "the operation never completed");
    }
    let crashed = n - 1;
    assert!(
        crashed >= at_least,
        "only {crashed} durable writes crashed at, expected at least {at_least}"
    );
    eprintln!("crash points survived: {crashed}");
}

#[tokio::test]
async fn crash_at_every_write_of_create() {
    // The intent, CreateVolume returned, the volume's first checkpoint, the
    // intent's removal.
    crash_at_every_write(Op::Create, 4).await;
}

#[tokio::test]
async fn crash_at_every_write_of_publish() {
    // The intent (with the new user), each of ControllerPublish, NodeStage,
    // NodePublish returned, the final state.
    crash_at_every_write(Op::Publish, 5).await;
}

#[tokio::test]
async fn crash_at_every_write_of_release() {
    // The intent (with the user's removal), each of NodeUnpublish,
    // NodeUnstage, ControllerUnpublish returned, the final state.
    crash_at_every_write(Op::Release, 5).await;
}

#[tokio::test]
async fn crash_at_every_write_of_destroy() {
    // The mark, the intent, the three backward RPCs returned, the final
    // state, DeleteVolume returned, the checkpoint's removal.
    crash_at_every_write(Op::Destroy, 8).await;
}

#[tokio::test]
async fn crash_at_every_write_of_import() {
    // The intent, ValidateVolumeCapabilities returned, the volume's first
    // checkpoint, the intent's removal.
    crash_at_every_write(Op::Import, 4).await;
}

#[tokio::test]
async fn crash_at_every_write_of_destroy_of_an_imported_volume() {
    // The mark, the intent, the three backward RPCs returned, the final
    // state, the checkpoint's removal (no DeleteVolume: the volume stays).
    crash_at_every_write(Op::DestroyImported, 7).await;
}
