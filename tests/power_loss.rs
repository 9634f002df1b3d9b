//! Power loss, which SIGKILL does not simulate (after a kill the kernel still writes back every
//! page and directory entry; after a power cut only what was made durable survives).
//!
//! A run is recorded at the durable seam (`csi_isolator::durable::record`: every write, fsync,
//! create, rename, unlink, mkdir and directory fsync of the isolator's container checkpoints,
//! the provider's records and the bundled plugin's records and new storage, every process
//! appending to one log). From the log, `csi_isolator_testing::powerloss` builds every state a
//! power cut after each operation could leave (its module doc states the model); each state must
//! keep every promise (a durable operation that returned success); then sampled states (evenly
//! over the run, `powerloss_runs::sample_states`; each test prints how many it checked and how
//! many it recovered), written back to disk, must recover with an empty mount table (a reboot).
//! The runs:
//! - create → publish → release through the CLI and the plugin (dir backing): every state
//!   recovered; provider and plugin agree, no returned use lost, the volume works;
//! - the isolator's path: `run` with the bundled plugin's loop backing (create, container
//!   checkpoint, publish, launch, cleanup): a use the provider records always has its
//!   container's isolator checkpoint; recovery by the next `run` leaves one volume (the one the
//!   plugin recorded, once it had), unused, and no checkpoint, mount or loop device;
//! - day-2 operations (modify, expand, snapshot create/delete, import, destroy, the destroy of an
//!   import): what each returned command did is kept (parameters, size, snapshot, import,
//!   removal), provider and plugin agree on volumes and snapshots;
//! - a loop volume's offline expansion: the grow marker is durable wherever the plugin's record
//!   holds the new capacity.
//!
//! Outside the model, and why that is sound:
//! - a loop image's bytes (mkfs output, megabytes) are not recorded: the plugin fsyncs the image
//!   and syncs its directory before the record naming it is promised (checked on the log,
//!   `images_synced_before_their_record`), and a formatted image stands in where the model keeps
//!   the image's name. Data a container writes and fsyncs inside a published loop volume reaches
//!   the image through the loop driver (each ext4 flush becomes an fsync of the image file,
//!   docs/benchmarks.md; an unmount at NodeUnstage flushes too): proving it survives needs a real
//!   power cut of the host, which the seam cannot model; no test pretends to. For the dir
//!   backing, a container's data is the host filesystem's business; the dir backing's snapshot
//!   copies (`copy_tree`) are not fsynced, so a snapshot of a dir volume may lose data, not its
//!   record, to a power cut (the test backing; the loop backing's copy is fsynced).
//! - directories and files no recorded operation makes (the work dir's skeleton, the plugin's
//!   log, lock files): taken as durable from the start; each is made again at startup when
//!   missing. A volume's `mounts/<id>` and `mounts/<id>/staging`, made unsynced at its create
//!   and (staging) again after each unstage: a power cut that undoes them costs the next
//!   publish their making (it makes any it does not find).
//! - best-effort removals left unrecorded and unsynced, each harmless if a power cut undoes it:
//!   the provider's `remove_empty_dir` of a volume's staging and mount directories and the
//!   `rmdir` of its emptied volume directory (empty directories; the provider's startup removes
//!   a volume directory with no record and sweeps orphaned mount directories); the plugin's
//!   removal of a deleted volume's or snapshot's tombstone and of a failed copy (the rename to
//!   the tombstone is the durable step; the store finishes tombstones at its next open); the
//!   freeze marker after a thaw (an extra, harmless thaw at the next start); sockets and their
//!   temporary names (made afresh at every start); `run`'s sandbox directory (see below). The
//!   grow marker's removal is recorded but not synced: one brought back costs the next stage an
//!   e2fsck and a resize2fs with nothing to do. The isolator's `rmdir` of an emptied container
//!   checkpoint directory is recorded and not synced (recovery removes an empty one).
//! - known leak, not a durability one (SIGKILL shows it too): the sandbox directory
//!   `sandboxes/<id>` of a `run` that did not finish is left by the next run's recovery (it
//!   cleans the container up, not the directory); nothing is mounted in it.
//!
//! The tests that set the log's variable in this process's environment hold `LOG_ENV_LOCK`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Instant;

use csi_isolator::durable::record::{self, LOG_ENV};
use csi_isolator::provider::checkpoint::CRASH_AFTER_WRITE_ENV;
use csi_isolator::provider::status::{scan_with, ScanOptions};
use csi_isolator::provider::summary::SUMMARY_FILE;
use csi_isolator::provider::{VolumeRecord, VolumeState};
use csi_isolator_testing::powerloss::{self, crash_states, lost_promises, read_log, Op, Tree};
use csi_isolator_testing::powerloss_runs::{
    copy_sparse, first_promise, images_in, images_synced_before_their_record, promises_kept,
    sample_states, stand_in_images, with_unrecorded, PLUGIN_RECORD,
};
use csi_isolator_testing::{mount_points_under, plugin_bin, require_root, PluginProcess, Sandbox};

const CLI: &str = env!("CARGO_BIN_EXE_csi-isolator");

/// Held by each test that sets [`LOG_ENV`] in this process's environment (inherited by the
/// plugin and the commands it runs), so that under a runner that shares the process (cargo
/// test) no test records into another's log.
static LOG_ENV_LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The real `write_atomic`, recorded at the seam, keeps its promise in every crash state; the
/// same recorded sequence with its directory fsync, or its file fsync, removed (the planted
/// bugs) breaks it, and the checker says so.
#[test]
fn the_checker_passes_the_real_write_atomic_and_fails_the_planted_bugs() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("r");
    std::fs::create_dir(&root).unwrap();
    let log = dir.path().join("ops.jsonl");
    let base = powerloss::scan(dir.path());
    record::record_to(&log).unwrap();
    csi_isolator::durable::write_atomic(&root.join("volume.state"), b"{\"v\":1}", 0o600).unwrap();
    csi_isolator::durable::write_atomic(&root.join("volume.state"), b"{\"v\":2}", 0o600).unwrap();
    record::stop_recording();
    let ops: Vec<Op> = read_log(&log)
        .unwrap()
        .into_iter()
        .filter(|op| op.paths().iter().all(|p| p.starts_with(&root)))
        .collect();
    assert_eq!(ops.len(), 12, "{ops:?}");

    let (lost, states) = lost_promises(&base, &ops);
    assert!(lost.is_empty(), "{lost:?}");
    eprintln!("real write_atomic: {states} crash states checked, no promise broken");

    let without = |pred: fn(&Op) -> bool| -> Vec<Op> {
        // The bug in the second write only: the first is durable before it starts.
        let mut ops = ops.clone();
        let at = ops.iter().rposition(pred).unwrap();
        ops.remove(at);
        ops
    };
    let (lost, states) = lost_promises(&base, &without(|op| matches!(op, Op::FsyncDir { .. })));
    assert!(
        !lost.is_empty(),
        "a rename without its directory fsync passed {states} states"
    );
    eprintln!("planted bug, no directory fsync: {}", lost[0]);
    assert!(lost[0]
        .to_string()
        .contains("returned success, not durable"));
    let (lost, states) = lost_promises(&base, &without(|op| matches!(op, Op::Fsync { .. })));
    assert!(
        !lost.is_empty(),
        "a write without its fsync passed {states} states"
    );
    eprintln!("planted bug, no file fsync: {}", lost[0]);
}

struct Agent {
    work: PathBuf,
    endpoint: String,
}

impl Agent {
    fn run(&self, args: &[&str]) -> Output {
        Command::new(CLI)
            .arg("--work-dir")
            .arg(&self.work)
            .args([
                "volume",
                "--plugin-endpoint",
                &self.endpoint,
                "--policy",
                "last-use",
            ])
            .args(args)
            .env_remove(CRASH_AFTER_WRITE_ENV)
            .output()
            .expect("run csi-isolator")
    }

    fn ok(&self, args: &[&str], what: &str) -> String {
        succeeded(self.run(args), args, what)
    }
}

/// The log's length now (the boundaries of the run's commands).
fn logged(log: &Path) -> usize {
    read_log(log).unwrap().len()
}

/// The most crash states of create → publish → release that are recovered one by one (the
/// binary's tests together stay near a minute on the 2-core test machine).
const CLI_STATES_RECOVERED: usize = 80;

#[tokio::test(flavor = "current_thread")]
async fn every_power_cut_of_create_publish_release_recovers() {
    require_root();
    let started = Instant::now();
    let _env = LOG_ENV_LOCK.lock().await;
    let sb = Sandbox::new("powerloss");
    let log = sb.join("ops.jsonl");
    std::fs::write(&log, b"").unwrap();
    // Inherited by the plugin and by every csi-isolator run of the recorded part (under
    // LOG_ENV_LOCK).
    std::env::set_var(LOG_ENV, &log);
    let mut plugin = PluginProcess::start(&sb, plugin_bin(), &["--backing", "dir"]).await;
    let agent = Agent {
        work: sb.mkdir("work"),
        endpoint: plugin.endpoint(),
    };
    let pwork = plugin.work_dir();
    let roots = [agent.work.clone(), pwork.clone()];
    let scan_all = || -> Tree { roots.iter().flat_map(|r| powerloss::scan(r)).collect() };
    let base = scan_all();
    // The plugin's own start (its use journal made, or compacted at open when due) is in the base scan,
    // not in the recorded run: the log starts again here (every process appends with O_APPEND,
    // so their next records land at the new end). So that start is not cut by a power loss in
    // this test; the use journal's compaction is, in the plugin store's own test
    // (`store::tests::a_power_cut_loses_no_change_that_returned`).
    std::fs::write(&log, b"").unwrap();
    let start = logged(&log);
    let created: serde_json::Value =
        serde_json::from_str(&agent.ok(&["create", "v", "8M"], "create")).unwrap();
    let id = created["disk"]["source"]["id"]
        .as_str()
        .unwrap()
        .to_string();
    let after_create = logged(&log);
    agent.ok(&["publish", "v", "--container", "c1"], "publish");
    let after_publish = logged(&log);
    agent.ok(&["release", "v", "--container", "c1"], "release");
    let after_release = logged(&log);
    std::env::remove_var(LOG_ENV);
    plugin.kill();
    sb.assert_no_mounts_under();

    let all = read_log(&log).unwrap();
    assert!(
        start == 0,
        "nothing recorded before the run: {:?}",
        &all[..start]
    );
    // Indices into `ops` (the part under the two roots) of the command boundaries.
    let under = |op: &Op| {
        op.paths()
            .iter()
            .all(|p| roots.iter().any(|r| p.starts_with(r)))
    };
    // The plugin's new volume directory is made durable before its record (it used to be
    // made outside the seam, its parent never synced).
    assert!(
        ops_under_have_mkdir(&all, &pwork, &id),
        "the plugin's volume directory is not made at the seam"
    );
    let index = |n: usize| all[..n].iter().filter(|op| under(op)).count();
    let (end_create, end_publish, end_release) = (
        index(after_create),
        index(after_publish),
        index(after_release),
    );
    let ops: Vec<Op> = all.into_iter().filter(|op| under(op)).collect();
    let base = with_unrecorded(base, &scan_all(), &ops);
    let every = crash_states(&base, &ops);
    let total = every.len();
    for state in &every {
        let lost = promises_kept(&ops, state);
        assert!(lost.is_empty(), "{}", lost[0]);
    }
    // The volume summary's crash points (its write in each compaction's write-back, before the
    // syncfs and the journal's reset): in every state a power cut could leave, `status` through
    // the summary says what the full scan says.
    let mut summaries = 0;
    let scratch = sb.mkdir("status-scratch");
    for state in &every {
        let mut tree = powerloss::Tree::new();
        for (path, node) in state.tree.range(agent.work.clone()..) {
            if !path.starts_with(&agent.work) {
                break;
            }
            tree.insert(
                scratch.join(path.strip_prefix(&agent.work).unwrap()),
                node.clone(),
            );
        }
        summaries += usize::from(tree.keys().any(|p| p.ends_with(SUMMARY_FILE)));
        powerloss::materialize(&tree, &scratch).unwrap();
        let scan = |use_summary| {
            let how = ScanOptions {
                use_summary,
                ..ScanOptions::default()
            };
            let table = csi_isolator::mount::FakeSyscall::new();
            serde_json::to_string(&scan_with(&scratch, &table, how).unwrap()).unwrap()
        };
        assert_eq!(
            scan(true),
            scan(false),
            "power cut after op {}: status through the summary differs from the full scan",
            state.point
        );
    }
    eprintln!("{total} crash states: status through the summary as the full scan ({summaries} with a summary)");
    assert!(summaries > 0, "no crash state holds a volume summary");
    let states = sample_states(every, CLI_STATES_RECOVERED);
    eprintln!(
        "{} ops recorded (create {end_create}, publish {}, release {}), {total} crash states checked against the promises, {} sampled and recovered",
        ops.len(),
        end_publish - end_create,
        end_release - end_publish,
        states.len()
    );

    let mut recovered = 0;
    for state in &states {
        let k = state.point;
        for r in &roots {
            powerloss::materialize(&state.tree, r).unwrap();
        }
        // A reboot: no mounts (none are left: each state's run unmounts), a fresh plugin.
        sb.assert_no_mounts_under();
        plugin.restart().await;
        let what = format!("power cut after op {k}");
        let records: Vec<VolumeRecord> =
            serde_json::from_str(&agent.ok(&["list", "--json"], &what)).unwrap();
        let listed = plugin.listed().await;
        let plugin_ids: Vec<String> = listed
            .iter()
            .filter_map(|e| e.volume.as_ref().map(|v| v.volume_id.clone()))
            .collect();
        let ours: Vec<String> = records.iter().map(|r| r.volume_id.clone()).collect();
        // State and plugin agree: nothing leaked in the plugin, nothing recorded that it lacks.
        assert_eq!(ours, plugin_ids, "{what}: provider and plugin disagree");
        if k >= end_create {
            assert_eq!(
                ours,
                std::slice::from_ref(&id),
                "{what}: the created volume is lost"
            );
        }
        if let Some(rec) = records.first() {
            let users: Vec<&String> = rec.users.iter().collect();
            // Publish returned, release not begun.
            if k == end_publish {
                assert_eq!(users, ["c1"], "{what}: the returned publish is lost");
            }
            if k >= end_release {
                assert!(users.is_empty(), "{what}: the returned release is undone");
                assert_eq!(rec.state, VolumeState::Created, "{what}");
            }
            // The volume still works; then every use is released.
            agent.ok(&["publish", "v", "--container", "c2"], &what);
            agent.ok(&["release", "v", "--container", "c2"], &what);
            if users.iter().any(|u| *u == "c1") {
                agent.ok(&["release", "v", "--container", "c1"], &what);
            }
        }
        sb.assert_no_mounts_under();
        recovered += 1;
    }
    plugin.kill();
    sb.assert_no_loop_devices();
    eprintln!(
        "{recovered} power-loss crash states recovered in {:.1?}",
        started.elapsed()
    );
    assert!(recovered >= 20, "too few crash states: {recovered}");
}

/// Whether the log holds the mkdir of the plugin's directory for volume `id`, durable (its
/// parent synced) before the plugin's record in it is promised.
fn ops_under_have_mkdir(ops: &[Op], plugin_work: &Path, id: &str) -> bool {
    let Some(mk) = ops.iter().position(|op| {
        matches!(op, Op::Mkdir { path } if path.starts_with(plugin_work) && path.ends_with(id))
    }) else {
        return false;
    };
    let Op::Mkdir { path: dir } = &ops[mk] else {
        unreachable!()
    };
    let parent = dir.parent().unwrap();
    let record = dir.join(PLUGIN_RECORD);
    let promised = first_promise(ops, |p| p == record).unwrap_or(ops.len());
    ops[mk..promised]
        .iter()
        .any(|op| matches!(op, Op::FsyncDir { path } if path == parent))
}

/// What one `csi-isolator` command of the isolator's path runs with.
struct Runner {
    work: PathBuf,
    sockets: PathBuf,
}

impl Runner {
    fn cmd(&self, args: &[&str]) -> Output {
        Command::new(CLI)
            .arg("--work-dir")
            .arg(&self.work)
            .env("CSI_ISOLATOR_SOCKET_DIR", &self.sockets)
            .env_remove(CRASH_AFTER_WRITE_ENV)
            .env_remove(LOG_ENV)
            .args(args)
            .output()
            .expect("run csi-isolator")
    }

    fn ok(&self, args: &[&str], what: &str) -> String {
        succeeded(self.cmd(args), args, what)
    }

    /// `status --json`, which exits 1 when a checkpoint and the mount table disagree (as they
    /// may after a reboot, before recovery): the report is read either way.
    fn status(&self, what: &str) -> serde_json::Value {
        let out = self.cmd(&["status", "--json"]);
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "{what}: status --json ({}): {e}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            )
        })
    }
}

/// The most crash states of the isolator's path that are recovered one by one (each recovery
/// is a `run` with a loop mount, 0.1 to 0.3 s on the 2-core test machine).
const RUN_STATES_RECOVERED: usize = 48;

/// The isolator's path: `csi-isolator run` with the bundled plugin (loop backing, ext4 image)
/// creates a volume, checkpoints the container, publishes, launches a workload that writes
/// into the volume, and cleans up; recorded across the isolator's checkpoints, the provider's
/// and the plugin's records. In every crash state: every promise holds; every use the
/// provider records is a container the isolator has a checkpoint for (else no recovery could
/// ever end it); the image is fsynced before its record is promised. Each sampled state,
/// written back with a reboot's empty mount table, is recovered by the next `run`: one volume,
/// the one the plugin had recorded if it had, unused and unpublished; no container checkpoint,
/// no mount, no loop device left; the provider and the plugin agree.
#[test]
fn every_power_cut_of_a_run_with_a_loop_volume_recovers() {
    require_root();
    let started = Instant::now();
    let sb = Sandbox::new("powerloss-run");
    let log = sb.join("ops.jsonl");
    std::fs::write(&log, b"").unwrap();
    let r = Runner {
        work: sb.mkdir("work"),
        sockets: sb.join("s"),
    };
    let base = powerloss::scan(&r.work);
    let out = Command::new(CLI)
        .arg("--work-dir")
        .arg(&r.work)
        .env("CSI_ISOLATOR_SOCKET_DIR", &r.sockets)
        .env(LOG_ENV, &log)
        .env_remove(CRASH_AFTER_WRITE_ENV)
        .args(["run", "--volume", "v:8M:v", "--", "sh", "-c"])
        .arg("echo kept > v/f && sync v/f")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "recorded run: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    sb.assert_no_mounts_under();
    let fin = powerloss::scan(&r.work);
    let images = images_in(&fin);
    assert_eq!(images.len(), 1, "one loop image: {images:?}");
    let good = sb.join("good.ext4");
    copy_sparse(&images[0], &good);
    let ops: Vec<Op> = read_log(&log)
        .unwrap()
        .into_iter()
        .filter(|op| op.paths().iter().all(|p| p.starts_with(&r.work)))
        .collect();
    let checked = images_synced_before_their_record(&ops).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(checked, 1, "the image's create is recorded");
    let checkpoints = r.work.join("isolators/volume/csi");
    let plugin_volumes = r
        .work
        .join("csi/csi-test-plugin.csi-isolator.io/default/plugin/data/volumes");
    // The volume the plugin recorded, and from which op on.
    let record_at = first_promise(&ops, |p| {
        p.starts_with(&plugin_volumes) && p.ends_with(PLUGIN_RECORD)
    })
    .expect("the plugin's record is promised");
    let recorded_id = ops[record_at].paths()[0]
        .parent()
        .unwrap()
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    // The isolator's checkpoints go through its journal: its first promise is the container's
    // first entry, and the journal the run leaves names the container (its removal last).
    let isolator_journal = csi_isolator::isolator::journal::journal_path(&r.work);
    let isolator_at = first_promise(&ops, |p| p == isolator_journal)
        .expect("the isolator checkpoints the container");
    let named = isolator_journaled(&fin, &isolator_journal);
    assert_eq!(named.len(), 1, "one container journaled: {named:?}");
    let container = named.keys().next().unwrap().clone();
    assert_eq!(
        named[&container], None,
        "the run's cleanup journaled its removal"
    );
    let checkpointed =
        |tree: &Tree, id: &str| match isolator_journaled(tree, &isolator_journal).remove(id) {
            Some(state) => state.is_some(),
            None => tree.contains_key(&checkpoints.join(id).join("state.json")),
        };
    let base = with_unrecorded(base, &fin, &ops);
    let all = powerloss::crash_states(&base, &ops);
    let total = all.len();
    // Every state keeps its promises and has no use without its container's checkpoint.
    for state in &all {
        let lost = promises_kept(&ops, state);
        assert!(lost.is_empty(), "{}", lost[0]);
    }
    let states = sample_states(all, RUN_STATES_RECOVERED);
    eprintln!(
        "run: {} ops recorded (isolator checkpoint first promised at op {isolator_at}, plugin record at op {record_at}), {total} crash states checked against the promises, {} sampled and recovered",
        ops.len(),
        states.len()
    );

    let mut recovered = 0;
    let mut cleaned = 0;
    for state in &states {
        let what = format!("power cut after op {}", state.point);
        powerloss::materialize(&state.tree, &r.work).unwrap();
        let stood_in = stand_in_images(state, &good);
        // A reboot: nothing mounted, no loop device.
        sb.assert_no_mounts_under();
        sb.assert_no_loop_devices();
        // Before recovery: the isolator and the provider agree on the container's uses.
        let before = r.status(&what);
        for v in before["volumes"].as_array().unwrap() {
            for user in v["users"].as_array().unwrap() {
                let user = user.as_str().unwrap();
                assert!(
                    checkpointed(&state.tree, user),
                    "{what}: the provider records a use by {user} of {} with no isolator checkpoint for it",
                    v["volume_id"]
                );
            }
        }
        // Recovery, and the volume still works; a container whose checkpoint survived is
        // found and cleaned up (its use ended: it did not survive the reboot).
        let out = r.cmd(&[
            "run",
            "--volume",
            "v:8M:v",
            "--",
            "sh",
            "-c",
            "test -d v && echo ok",
        ]);
        let logs = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{what}: recovery run failed: {logs}");
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "ok", "{what}");
        if checkpointed(&state.tree, &container) {
            assert!(
                logs.contains("cleaned up after an earlier run") && logs.contains(&container),
                "{what}: the checkpointed container {container} was not recovered: {logs}"
            );
            cleaned += 1;
        }
        let after = r.status(&what);
        let vols = after["volumes"].as_array().unwrap();
        assert_eq!(vols.len(), 1, "{what}: one volume: {after}");
        let v = &vols[0];
        assert_eq!(v["name"], "v", "{what}");
        assert_eq!(v["state"], "CREATED", "{what}: {v}");
        assert!(v["users"].as_array().unwrap().is_empty(), "{what}: {v}");
        assert!(v["disagreement"].is_null(), "{what}: {v}");
        assert!(
            after["unreadable"].as_array().unwrap().is_empty(),
            "{what}: {after}"
        );
        let id = v["volume_id"].as_str().unwrap();
        if state.point > record_at {
            assert_eq!(
                id, recorded_id,
                "{what}: the plugin's volume was lost or replaced"
            );
            assert_eq!(stood_in, 1, "{what}: the recorded volume's image is gone");
        }
        // The plugin holds exactly the provider's volume: nothing leaked, nothing lacking.
        let mut in_plugin: Vec<String> = std::fs::read_dir(&plugin_volumes)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| !n.starts_with('.') && !n.starts_with('+'))
            .collect();
        in_plugin.sort();
        assert_eq!(
            in_plugin,
            [id.to_string()],
            "{what}: provider and plugin disagree"
        );
        // No container checkpoint survives its cleanup.
        let left: Vec<_> = std::fs::read_dir(&checkpoints)
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        assert!(
            left.is_empty(),
            "{what}: container checkpoints left: {left:?}"
        );
        assert!(mount_points_under(sb.path()).is_empty(), "{what}");
        sb.assert_no_loop_devices();
        recovered += 1;
    }
    eprintln!(
        "run: {recovered} power-loss crash states recovered ({cleaned} with the container's checkpoint, found and cleaned up) in {:.1?}",
        started.elapsed()
    );
    assert!(recovered >= 10, "too few crash states: {recovered}");
    assert!(
        cleaned > 0,
        "no sampled state holds the container's checkpoint"
    );
}

/// The most crash states of the day-2 run that are recovered one by one.
const DAY2_STATES_RECOVERED: usize = 64;

/// The plugin's own entries (volume or snapshot directories) under `dir`; tombstones
/// (`+deleted-…`, older `.deleted-…`) and temporary names left out.
fn plugin_entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| !n.starts_with('.') && !n.starts_with('+'))
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// Day-2 operations through the CLI and the real plugin (dir backing): modify, expand,
/// snapshot create, import, snapshot delete, destroy, and the destroy of an imported volume
/// (forgotten, kept in the plugin), recorded after a create. In every crash state every promise
/// holds; each sampled state, recovered by a fresh plugin and the next command, keeps what each
/// command that had returned did: a modification's parameters, an expansion's size, a
/// snapshot taken and not yet deleted (and none after its delete, in the plugin either), an
/// import, a destroy (the volume never comes back, in the provider or the plugin), the
/// forgetting of an imported volume (gone from the provider, still in the plugin); and the
/// provider and the plugin agree on the volumes and the snapshots.
#[tokio::test(flavor = "current_thread")]
async fn every_power_cut_of_day2_operations_keeps_what_returned() {
    require_root();
    let started = Instant::now();
    let _env = LOG_ENV_LOCK.lock().await;
    let sb = Sandbox::new("powerloss-day2");
    let log = sb.join("ops.jsonl");
    std::fs::write(&log, b"").unwrap();
    std::env::set_var(LOG_ENV, &log);
    let mut plugin = PluginProcess::start(&sb, plugin_bin(), &["--backing", "dir"]).await;
    // A volume in the plugin only, to import: made before the recorded part.
    let foreign = {
        use csi_isolator::csi::proto;
        let mut c = csi_isolator_testing::raw_clients(&plugin.socket())
            .await
            .unwrap();
        c.controller
            .create_volume(proto::CreateVolumeRequest {
                name: "foreign".into(),
                capacity_range: Some(proto::CapacityRange {
                    required_bytes: 8 << 20,
                    limit_bytes: 0,
                }),
                volume_capabilities: vec![csi_isolator_testing::mount_capability(
                    proto::volume_capability::access_mode::Mode::SingleNodeWriter,
                )],
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .volume
            .unwrap()
            .volume_id
    };
    let agent = Agent {
        work: sb.mkdir("work"),
        endpoint: plugin.endpoint(),
    };
    let pwork = plugin.work_dir();
    let roots = [agent.work.clone(), pwork.clone()];
    let scan_all = || -> Tree { roots.iter().flat_map(|r| powerloss::scan(r)).collect() };
    let base = scan_all();
    let start = logged(&log);
    let steps: [(&str, Vec<&str>); 8] = [
        ("create", vec!["create", "v", "8M"]),
        ("modify", vec!["modify", "v", "tier=fast", "iops=500"]),
        ("expand", vec!["expand", "v", "16M"]),
        ("snapshot create", vec!["snapshot", "create", "v", "s1"]),
        (
            "import",
            vec!["import", "w", "--volume-id", &foreign, "--capacity", "8M"],
        ),
        ("snapshot delete", vec!["snapshot", "delete", "s1"]),
        ("destroy", vec!["destroy", "v"]),
        ("forget", vec!["destroy", "w"]),
    ];
    let mut ends = Vec::new();
    let mut v_id = String::new();
    for (what, args) in &steps {
        let out = agent.ok(args, what);
        if *what == "create" {
            let created: serde_json::Value = serde_json::from_str(&out).unwrap();
            v_id = created["disk"]["source"]["id"]
                .as_str()
                .unwrap()
                .to_string();
        }
        ends.push(logged(&log));
    }
    std::env::remove_var(LOG_ENV);
    plugin.kill();
    sb.assert_no_mounts_under();

    let all = read_log(&log).unwrap();
    let under = |op: &Op| {
        op.paths()
            .iter()
            .all(|p| roots.iter().any(|r| p.starts_with(r)))
    };
    // Before `start`: the foreign volume's create, durable (the plugin synced it) before the
    // base tree was scanned.
    let index = |n: usize| all[start..n].iter().filter(|op| under(op)).count();
    let end: Vec<usize> = ends.iter().map(|&n| index(n)).collect();
    let step = |name: &str| steps.iter().position(|(w, _)| *w == name).unwrap();
    // Where a step returned, and where it began (its predecessor returned): between the two
    // its effect may or may not be there.
    let at = |name: &str| end[step(name)];
    let begun = |name: &str| end[step(name) - 1];
    let ops: Vec<Op> = all[start..]
        .iter()
        .filter(|op| under(op))
        .cloned()
        .collect();
    let base = with_unrecorded(base, &scan_all(), &ops);
    let every = crash_states(&base, &ops);
    let total = every.len();
    for state in &every {
        let lost = promises_kept(&ops, state);
        assert!(lost.is_empty(), "{}", lost[0]);
    }
    let states = sample_states(every, DAY2_STATES_RECOVERED);
    let shape: Vec<String> = steps
        .iter()
        .zip(&end)
        .map(|((w, _), e)| format!("{w} ends at {e}"))
        .collect();
    eprintln!(
        "day-2: {} ops recorded ({}), {total} crash states checked against the promises, {} sampled and recovered",
        ops.len(),
        shape.join(", "),
        states.len()
    );

    let plugin_volumes = pwork.join("volumes");
    let plugin_snapshots = pwork.join("snapshots");
    let mut recovered = 0;
    for state in &states {
        let k = state.point;
        let what = format!("power cut after op {k}");
        for r in &roots {
            powerloss::materialize(&state.tree, r).unwrap();
        }
        sb.assert_no_mounts_under();
        plugin.restart().await;
        let records: Vec<serde_json::Value> =
            serde_json::from_str(&agent.ok(&["list", "--json"], &what)).unwrap();
        let snaps: Vec<serde_json::Value> =
            serde_json::from_str(&agent.ok(&["snapshot", "list", "--json"], &what)).unwrap();
        let by_name = |n: &str| records.iter().find(|r| r["name"] == n);
        let mut ours: Vec<String> = records
            .iter()
            .map(|r| r["volume_id"].as_str().unwrap().to_string())
            .collect();
        // The foreign volume is the plugin's whether or not it is imported.
        if !ours.contains(&foreign) {
            ours.push(foreign.clone());
        }
        ours.sort();
        assert_eq!(
            plugin_entries(&plugin_volumes),
            ours,
            "{what}: provider and plugin disagree on the volumes"
        );
        let v = by_name("v");
        if k >= at("create") && k < begun("destroy") {
            let v = v.unwrap_or_else(|| panic!("{what}: the created volume is lost"));
            assert_eq!(v["volume_id"], v_id.as_str(), "{what}");
        }
        if k >= at("destroy") {
            assert!(v.is_none(), "{what}: the destroyed volume came back: {v:?}");
        }
        if let Some(v) = v.filter(|_| k >= at("modify")) {
            assert_eq!(
                v["mutable_parameters"],
                serde_json::json!({"iops": "500", "tier": "fast"}),
                "{what}: the modification is lost"
            );
        }
        if let Some(v) = v.filter(|_| k >= at("expand")) {
            assert!(
                v["capacity_bytes"].as_u64().unwrap() >= 16 << 20,
                "{what}: the expansion is lost: {v}"
            );
        }
        let snap_ids: Vec<String> = snaps
            .iter()
            .map(|s| s["snapshot_id"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(
            plugin_entries(&plugin_snapshots),
            snap_ids,
            "{what}: provider and plugin disagree on the snapshots"
        );
        if k >= at("snapshot create") && k < begun("snapshot delete") {
            assert_eq!(snaps.len(), 1, "{what}: the snapshot is lost");
            assert_eq!(snaps[0]["name"], "s1", "{what}");
        }
        if k >= at("snapshot delete") {
            assert!(snaps.is_empty(), "{what}: the deleted snapshot came back");
        }
        let w = by_name("w");
        if k >= at("import") && k < begun("forget") {
            let w = w.unwrap_or_else(|| panic!("{what}: the import is lost"));
            assert_eq!(w["volume_id"], foreign.as_str(), "{what}");
        }
        if k >= at("forget") {
            assert!(w.is_none(), "{what}: the forgotten import came back");
        }
        sb.assert_no_mounts_under();
        recovered += 1;
    }
    plugin.kill();
    sb.assert_no_loop_devices();
    eprintln!(
        "day-2: {recovered} power-loss crash states recovered in {:.1?}",
        started.elapsed()
    );
    assert!(recovered >= 20, "too few crash states: {recovered}");
}

/// A loop volume's offline expansion (`volume expand` with the bundled plugin, the volume not
/// published): the plugin marks the filesystem as smaller than its grown image for the next
/// stage to grow. That marker is made durable before the plugin's record with the new capacity
/// is promised (on the log), and in every crash state where that record holds the new capacity
/// the marker is there: a power cut never leaves a filesystem smaller than the capacity
/// ControllerExpandVolume answered with nothing to grow it.
#[test]
fn every_power_cut_of_a_loop_expansion_keeps_the_grow_marker_with_the_capacity() {
    require_root();
    let sb = Sandbox::new("powerloss-expand");
    let log = sb.join("ops.jsonl");
    std::fs::write(&log, b"").unwrap();
    let r = Runner {
        work: sb.mkdir("work"),
        sockets: sb.join("s"),
    };
    r.ok(&["volume", "create", "v", "8M"], "create");
    let base = powerloss::scan(&r.work);
    let out = Command::new(CLI)
        .arg("--work-dir")
        .arg(&r.work)
        .env("CSI_ISOLATOR_SOCKET_DIR", &r.sockets)
        .env(LOG_ENV, &log)
        .env_remove(CRASH_AFTER_WRITE_ENV)
        .args(["volume", "expand", "v", "16M"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "recorded expand: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ops: Vec<Op> = read_log(&log)
        .unwrap()
        .into_iter()
        .filter(|op| op.paths().iter().all(|p| p.starts_with(&r.work)))
        .collect();
    let marker_name = "filesystem-smaller-than-image";
    let is_record =
        |p: &Path| p.ends_with(PLUGIN_RECORD) && p.to_string_lossy().contains("/plugin/");
    let record_at = ops
        .iter()
        .position(|op| match op {
            Op::Promised(powerloss::Promise::Written { path, bytes }) if is_record(path) => {
                serde_json::from_slice::<serde_json::Value>(bytes).unwrap()["capacity_bytes"]
                    == 16 << 20
            }
            _ => false,
        })
        .expect("the plugin records the new capacity");
    let marker_at = first_promise(&ops, |p| p.ends_with(marker_name));
    assert!(
        marker_at.is_some_and(|m| m < record_at),
        "the grow marker is not durable before the record with the new capacity (marker promised at {marker_at:?}, record at {record_at})"
    );
    let record = ops[record_at].paths()[0].to_path_buf();
    let marker = record.with_file_name(marker_name);
    let base = with_unrecorded(base, &powerloss::scan(&r.work), &ops);
    let states = crash_states(&base, &ops);
    for state in &states {
        let lost = promises_kept(&ops, state);
        assert!(lost.is_empty(), "{}", lost[0]);
        let Some(powerloss::Node::File(_, bytes)) = state.tree.get(&record) else {
            panic!(
                "power cut after op {}: the plugin's record is gone",
                state.point
            );
        };
        let Ok(rec) = serde_json::from_slice::<serde_json::Value>(bytes) else {
            continue;
        };
        if rec["capacity_bytes"] == 16 << 20 {
            assert!(
                state.tree.contains_key(&marker),
                "power cut after op {}: the record holds the new capacity, the grow marker is gone",
                state.point
            );
        }
    }
    eprintln!(
        "loop expansion: {} ops recorded, {} crash states checked",
        ops.len(),
        states.len()
    );
    r.ok(&["volume", "destroy", "v"], "destroy");
    sb.assert_no_mounts_under();
    sb.assert_no_loop_devices();
}

/// What the isolator's journal in `tree` says of each container (its complete entries
/// replayed, as recovery reads them); nothing when the tree has no journal.
fn isolator_journaled(
    tree: &Tree,
    journal: &Path,
) -> std::collections::BTreeMap<String, Option<Vec<u8>>> {
    match tree.get(journal) {
        Some(powerloss::Node::File(_, bytes)) => {
            let parsed = csi_isolator::durable::journal::parse(bytes)
                .unwrap_or_else(|e| panic!("the isolator journal is refused: {e}"));
            csi_isolator::isolator::journal::replay(&parsed.entries).0
        }
        _ => Default::default(),
    }
}

/// The stdout of a csi-isolator command that must have succeeded (`what` says which step).
fn succeeded(out: Output, args: &[&str], what: &str) -> String {
    assert!(
        out.status.success(),
        "{what}: csi-isolator {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}
