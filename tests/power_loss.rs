//! Power loss, which SIGKILL does not simulate (after a kill the kernel still writes back every
//! page and directory entry; after a power cut only what was made durable survives).
//!
//! A run is recorded at the durable seam (`csi_isolator::durable::record`: every write, fsync,
//! create, rename, unlink, mkdir and directory fsync of the provider's checkpoints and of the
//! bundled plugin's records, both processes appending to one log). From the log,
//! `csi_isolator_testing::powerloss` builds every state a power cut after each operation could
//! leave (its module doc states the model); each state must keep every promise (a durable
//! operation that returned success), and, written back to disk, must recover: the plugin and
//! a new provider process start from it with an empty mount table (a reboot), and then the
//! provider and the plugin agree, no use that had returned success is lost, the volume still
//! works and nothing is leaked.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Instant;

use csi_isolator::durable::record::{self, LOG_ENV};
use csi_isolator::provider::checkpoint::CRASH_AFTER_WRITE_ENV;
use csi_isolator::provider::{VolumeRecord, VolumeState};
use csi_isolator_testing::powerloss::{
    self, check_promises, crash_states, lost_promises, read_log, Node, Op, Tree,
};
use csi_isolator_testing::{plugin_bin, require_root, PluginProcess, Sandbox};

const CLI: &str = env!("CARGO_BIN_EXE_csi-isolator");

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
        let out = self.run(args);
        assert!(
            out.status.success(),
            "{what}: csi-isolator {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }
}

/// The log's length now (the boundaries of the run's commands).
fn logged(log: &Path) -> usize {
    read_log(log).unwrap().len()
}

/// The entries of `fin` that no recorded operation makes (the plugin's backing, made outside
/// the seam), added to `base` as if they had been there, durable, from the start.
fn with_unrecorded_dirs(mut base: Tree, fin: &Tree, ops: &[Op]) -> Tree {
    let made: Vec<&Path> = ops
        .iter()
        .filter_map(|op| match op {
            Op::Mkdir { path } => Some(path.as_path()),
            Op::Rename { to, .. } => Some(to.as_path()),
            _ => None,
        })
        .collect();
    let named = |p: &Path| ops.iter().any(|op| op.paths().contains(&p));
    for (path, node) in fin {
        let unrecorded = match node {
            Node::Dir(_) => !made.iter().any(|m| path.starts_with(m)),
            Node::File(..) => !named(path),
        };
        if unrecorded {
            base.entry(path.clone()).or_insert_with(|| node.clone());
        }
    }
    base
}

#[tokio::test(flavor = "current_thread")]
async fn every_power_cut_of_create_publish_release_recovers() {
    require_root();
    let started = Instant::now();
    let sb = Sandbox::new("powerloss");
    let log = sb.join("ops.jsonl");
    std::fs::write(&log, b"").unwrap();
    // Inherited by the plugin and by every csi-isolator run of the recorded part; this test
    // binary's other test does not read the environment.
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
    let index = |n: usize| all[..n].iter().filter(|op| under(op)).count();
    let (end_create, end_publish, end_release) = (
        index(after_create),
        index(after_publish),
        index(after_release),
    );
    let ops: Vec<Op> = all.into_iter().filter(|op| under(op)).collect();
    let base = with_unrecorded_dirs(base, &scan_all(), &ops);
    let states = crash_states(&base, &ops);
    eprintln!(
        "{} ops recorded (create {end_create}, publish {}, release {}), {} crash states",
        ops.len(),
        end_publish - end_create,
        end_release - end_publish,
        states.len()
    );

    let mut recovered = 0;
    for state in &states {
        let k = state.point;
        let lost = check_promises(&ops, state);
        assert!(lost.is_empty(), "{}", lost[0]);
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
        "{recovered} power-loss crash states checked and recovered in {:.1?}",
        started.elapsed()
    );
    assert!(
        recovered >= ops.len() / 2,
        "too few crash states: {recovered}"
    );
}
