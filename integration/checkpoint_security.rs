//! Checkpoints read back by `csi-isolator run` cannot turn it against the host (issue 18, finding 5):
//! a checkpoint planted in the work dir (written here as root, in the real format) that names a
//! foreign pid, a sandbox with `..`, the sandbox `/`, host binds outside its sandbox, or a path with a
//! symlink swapped in makes `run` signal, unmount and remove nothing; it is set aside and reported.
//! And a real workload that a SIGKILLed `run` left behind is still stopped and cleaned up.
//!
//! Everything runs as root against the real binary, real mounts and real processes; every process and
//! mount a test makes lives in (or is tracked by) its `Sandbox`, which undoes it, pass or fail.

use csi_isolator::error_chain::FullMessage;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use csi_isolator::isolator::{ContainerConfig, ContainerRecord};
use csi_isolator::launcher::process::{mount_view, process_start_time};
use csi_isolator::mount::{MountTable, ProcMountTable};
use csi_isolator_testing::{processes_mentioning, require_root, Sandbox};

mod common;
use common::{config, Agent};
use csi_isolator::resource::VolumeMode;

const CLI: &str = env!("CARGO_BIN_EXE_csi-isolator");

fn cli(sb: &Sandbox) -> Command {
    let mut c = Command::new(CLI);
    c.arg("--work-dir")
        .arg(sb.join("work"))
        .env("CSI_ISOLATOR_SOCKET_DIR", sb.join("s"))
        .env_remove("RUST_LOG")
        .env_remove("CSI_ISOLATOR_CRASH_AFTER_WRITE");
    c
}

fn output(cmd: &mut Command) -> Output {
    cmd.output().expect("run csi-isolator")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A clean `run` on the sandbox's work dir: the work dir then exists as an earlier run left it.
fn earlier_run(sb: &Sandbox) {
    let out = output(cli(sb).args(["run", "--", "true"]));
    assert!(out.status.success(), "first run: {}", text(&out.stderr));
}

fn record(id: &str, sandbox: &Path) -> ContainerRecord {
    let config = ContainerConfig {
        sandbox: sandbox.to_path_buf(),
        ..ContainerConfig::default()
    };
    ContainerRecord::new(id, config, Vec::new())
}

/// Writes `rec` where the isolator keeps it, as the isolator does (JSON, 0600).
fn plant(work: &Path, rec: &ContainerRecord) -> PathBuf {
    let dir = work.join("isolators/volume/csi").join(&rec.container_id);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("state.json");
    std::fs::write(&path, serde_json::to_vec_pretty(rec).unwrap()).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    path
}

/// The planted checkpoint was set aside (reported, never acted on): `state.json` is gone and a
/// `state.json.corrupt-*` holds it.
fn assert_set_aside(path: &Path) {
    assert!(!path.exists(), "{} is still there", path.display());
    let dir = path.parent().unwrap();
    let aside = std::fs::read_dir(dir)
        .map(|d| {
            d.flatten().any(|e| {
                e.file_name()
                    .to_string_lossy()
                    .starts_with("state.json.corrupt-")
            })
        })
        .unwrap_or(false);
    assert!(aside, "{}: not set aside", path.display());
}

fn mount_tmpfs(at: &Path) {
    std::fs::create_dir_all(at).unwrap();
    nix::mount::mount(
        Some("decoy"),
        at,
        Some("tmpfs"),
        nix::mount::MsFlags::empty(),
        Some("size=1m"),
    )
    .unwrap_or_else(|e| panic!("mount tmpfs at {}: {e}", at.display()));
    std::fs::write(at.join("precious"), b"keep me").unwrap();
}

/// Takes down a decoy the test mounted itself, once it has proved the code left it alone (the
/// sandbox fails a test that leaves a mount behind).
fn unmount_decoy(at: &Path) {
    nix::mount::umount(at).unwrap_or_else(|e| panic!("unmount the decoy {}: {e}", at.display()));
}

fn is_mount_point(at: &Path) -> bool {
    ProcMountTable::new()
        .mounts_under(at)
        .unwrap()
        .iter()
        .any(|m| m.mount_point == at)
}

fn alive(child: &mut std::process::Child) -> bool {
    child.try_wait().unwrap().is_none()
}

/// Finding 5: a planted checkpoint with the pid of a host process (a `sleep` this test started, and
/// pid 1), each with its real start time, in the exact form of an earlier run's container: `run`
/// signals neither (both are in its own mount namespace, where a workload never is).
#[test]
fn planted_checkpoint_pids_are_not_signalled() {
    require_root();
    let sb = Sandbox::new("ckpt-pid");
    let work = sb.join("work");
    earlier_run(&sb);
    let mut sleep = sb
        .spawn(Command::new("sleep").arg("1000").stdin(Stdio::null()))
        .expect("start sleep");
    let pid = sleep.id();
    let start = process_start_time(pid).expect("the sleep's start time");

    let mut foreign = record("run-foreign", &work.join("sandboxes/run-foreign"));
    foreign.pid = Some(pid);
    foreign.pid_start = Some(start);
    let mut init = record("run-init", &work.join("sandboxes/run-init"));
    init.pid = Some(1);
    init.pid_start = Some(process_start_time(1).expect("pid 1's start time"));
    init.mount_view = mount_view(1);
    plant(&work, &foreign);
    plant(&work, &init);

    let out = output(cli(&sb).args(["run", "--", "true"]));
    assert!(out.status.success(), "run: {}", text(&out.stderr));
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        alive(&mut sleep),
        "the host's sleep was signalled: {}",
        text(&out.stderr)
    );
    assert_eq!(
        process_start_time(pid),
        Some(start),
        "the sleep is the same process"
    );
    let stderr = text(&out.stderr);
    // Both planted records are refused, each logged: the foreign sleep and pid 1.
    assert_eq!(
        stderr.matches("not signalling the pid").count(),
        2,
        "both refusals are logged: {stderr}"
    );

    let _ = sleep.kill();
    let _ = sleep.wait();
    sb.untrack(pid);
}

/// Finding 5: planted checkpoints whose paths lead out of the work dir: a sandbox
/// `<work_dir>/sandboxes/../../decoy` swept for binds, the sandbox `/` with a host bind on a decoy
/// tmpfs, run's own sandbox form with host binds outside it (absolute, and through `..`). After
/// `run`'s recovery every decoy tmpfs is still mounted, the decoy directory and its files are still
/// there, and each checkpoint is set aside and reported.
#[test]
fn planted_checkpoint_paths_unmount_and_remove_nothing() {
    require_root();
    let sb = Sandbox::new("ckpt-paths");
    let work = sb.join("work");
    earlier_run(&sb);
    let decoy = sb.mkdir("decoy");
    std::fs::write(decoy.join("file"), b"keep me").unwrap();
    let swept = decoy.join("swept");
    let bound = decoy.join("bound");
    let bound_up = decoy.join("bound-up");
    let by_root = decoy.join("by-root");
    for m in [&swept, &bound, &bound_up, &by_root] {
        mount_tmpfs(m);
    }

    let mut dotdot = record(
        "run-dotdot",
        &work.join("sandboxes").join("..").join("..").join("decoy"),
    );
    dotdot.binds_in_sandbox = true;
    let mut root = record("run-root", Path::new("/"));
    root.host_binds = vec![by_root.clone()];
    let mut outside = record("run-outside", &work.join("sandboxes/run-outside"));
    outside.host_binds = vec![bound.clone()];
    let mut up = record("run-up", &work.join("sandboxes/run-up"));
    up.host_binds = vec![work.join("sandboxes/run-up/../../../decoy/bound-up")];
    up.binds_in_sandbox = true;
    let planted: Vec<PathBuf> = [&dotdot, &root, &outside, &up]
        .into_iter()
        .map(|r| plant(&work, r))
        .collect();

    let out = output(cli(&sb).args(["run", "--", "true"]));
    assert!(out.status.success(), "run: {}", text(&out.stderr));

    for m in [&swept, &bound, &bound_up, &by_root] {
        assert!(
            is_mount_point(m),
            "{} was unmounted: {}",
            m.display(),
            text(&out.stderr)
        );
        assert_eq!(std::fs::read(m.join("precious")).unwrap(), b"keep me");
    }
    assert_eq!(std::fs::read(decoy.join("file")).unwrap(), b"keep me");
    for p in &planted {
        assert_set_aside(p);
    }
    let stderr = text(&out.stderr);
    assert!(stderr.contains("set aside"), "reported: {stderr}");
    for m in [&swept, &bound, &bound_up, &by_root] {
        unmount_decoy(m);
    }
}

/// Finding 5: a sandbox path with a symlink swapped in. An earlier run's container whose sandbox is
/// now a symlink to a decoy directory holding a tmpfs, swept for binds; and one whose host bind is a
/// symlink to another decoy tmpfs: `run` follows neither, unmounts nothing, and sets both aside.
#[test]
fn a_symlink_swapped_into_a_checkpointed_path_is_refused() {
    require_root();
    let sb = Sandbox::new("ckpt-link");
    let work = sb.join("work");
    earlier_run(&sb);
    let decoy = sb.mkdir("decoy");
    let swept = decoy.join("swept");
    let bound = decoy.join("bound");
    mount_tmpfs(&swept);
    mount_tmpfs(&bound);

    let linked = work.join("sandboxes/run-linked");
    std::os::unix::fs::symlink(&decoy, &linked).unwrap();
    let mut sweep = record("run-linked", &linked);
    sweep.binds_in_sandbox = true;
    let sandbox = sb.mkdir("work/sandboxes/run-bindlink");
    std::os::unix::fs::symlink(&bound, sandbox.join("data")).unwrap();
    let mut bind = record("run-bindlink", &sandbox);
    bind.host_binds = vec![sandbox.join("data")];
    let planted = [plant(&work, &sweep), plant(&work, &bind)];

    let out = output(cli(&sb).args(["run", "--", "true"]));
    assert!(out.status.success(), "run: {}", text(&out.stderr));
    for m in [&swept, &bound] {
        assert!(
            is_mount_point(m),
            "{} was unmounted: {}",
            m.display(),
            text(&out.stderr)
        );
        assert_eq!(std::fs::read(m.join("precious")).unwrap(), b"keep me");
    }
    for p in &planted {
        assert_set_aside(p);
    }
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("symbolic links") || stderr.contains("ELOOP"),
        "the symlink is named: {stderr}"
    );
    unmount_decoy(&swept);
    unmount_decoy(&bound);
}

/// The genuine case still works: `run` SIGKILLed while its workload runs leaves the workload behind
/// (in its own mount namespace, with the volume mounted); the next `run` stops it through its pidfd
/// and cleans everything up.
#[test]
fn a_workload_left_by_a_killed_run_is_still_stopped_and_cleaned_up() {
    require_root();
    let sb = Sandbox::new("ckpt-stale");
    let work = sb.join("work");
    let mut first = sb
        .spawn(
            cli(&sb)
                .args([
                    "run",
                    "--volume",
                    "v:8M:v",
                    "--",
                    "sh",
                    "-c",
                    "echo first >> v/log; exec sleep 1000",
                ])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null()),
        )
        .expect("start run");
    // Wait (bounded) for the workload's pid in the checkpoint.
    let root = work.join("isolators/volume/csi");
    let deadline = Instant::now() + Duration::from_secs(30);
    let (pid, start) = loop {
        // The checkpoint as recovery reads it: the isolator's journal, then the files.
        let journaled = csi_isolator::isolator::journal::read_journaled(&work).unwrap_or_default();
        let files = std::fs::read_dir(&root)
            .map(|d| {
                d.flatten()
                    .filter_map(|e| std::fs::read(e.path().join("state.json")).ok())
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default();
        let found = journaled
            .into_values()
            .flatten()
            .chain(files)
            .find_map(|bytes| {
                let rec: ContainerRecord = serde_json::from_slice(&bytes).ok()?;
                Some((rec.pid?, rec.pid_start?))
            });
        if let Some(found) = found {
            break found;
        }
        assert!(
            Instant::now() < deadline,
            "the run never recorded its workload"
        );
        assert!(alive(&mut first), "the first run ended early");
        std::thread::sleep(Duration::from_millis(20));
    };
    sb.track(pid);
    // Let the workload write its line (it execs sleep afterwards).
    let log_deadline = Instant::now() + Duration::from_secs(10);
    while std::fs::read(format!("/proc/{pid}/cmdline")).map_or(true, |c| !c.starts_with(b"sleep")) {
        assert!(
            Instant::now() < log_deadline,
            "the workload never reached its sleep"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    first.kill().unwrap();
    first.wait().unwrap();
    sb.untrack(first.id());
    assert_eq!(
        process_start_time(pid),
        Some(start),
        "the workload outlives its run"
    );

    let out = output(cli(&sb).args(["run", "--volume", "v:8M:v", "--", "cat", "v/log"]));
    assert!(out.status.success(), "next run: {}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "first\n");
    let deadline = Instant::now() + Duration::from_secs(5);
    while process_start_time(pid) == Some(start) {
        assert!(
            Instant::now() < deadline,
            "the stale workload is still running"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    sb.untrack(pid);
    assert!(
        ProcMountTable::new()
            .mounts_under(&work)
            .unwrap()
            .is_empty(),
        "nothing mounted under the work dir"
    );
    let status = output(cli(&sb).args(["status", "--json"]));
    assert!(
        status.status.success(),
        "disagreement: {}",
        text(&status.stdout)
    );
    let left = std::fs::read_dir(&root).map(|d| d.count()).unwrap_or(0);
    assert_eq!(left, 0, "container checkpoints left");
    let procs = processes_mentioning(&work);
    assert!(procs.is_empty(), "processes left: {procs:?}");
    sb.assert_no_mounts_under();
}

/// Finding 5, through the library as serve's `Recover` drives it: checkpoints naming a `..`
/// sandbox, the sandbox `/` with a host bind on a decoy tmpfs, and a sandbox that is a symlink to the
/// decoy are set aside and listed in `IsolatorRecovery::corrupt` with the reason; none is cleaned
/// up, and the decoy stays mounted.
#[tokio::test]
async fn recover_sets_aside_and_reports_unsafe_checkpoints() {
    require_root();
    let sb = Sandbox::new("ckpt-recover");
    let agent = Agent::start(&sb, "work", &[]).await;
    let work = agent.work.clone();
    let decoy = sb.mkdir("decoy");
    let m = decoy.join("m");
    mount_tmpfs(&m);
    let linked = sb.join("linked");
    std::os::unix::fs::symlink(&decoy, &linked).unwrap();

    let mut dotdot = record("c-dotdot", &work.join("sandboxes/../../decoy"));
    dotdot.binds_in_sandbox = true;
    let mut root = record("c-root", Path::new("/"));
    root.host_binds = vec![m.clone()];
    let mut link = record("c-link", &linked);
    link.binds_in_sandbox = true;
    let planted: Vec<PathBuf> = [&dotdot, &root, &link]
        .into_iter()
        .map(|r| plant(&work, r))
        .collect();

    let report = agent.isolator.recover(&[]).await.unwrap();
    assert!(report.cleaned.is_empty(), "{report:?}");
    assert!(report.recovered.is_empty(), "{report:?}");
    for (p, says) in planted
        .iter()
        .zip(["'..'", "root directory", "symbolic links"])
    {
        let (_, reason) = report
            .corrupt
            .iter()
            .find(|(path, _)| path == p)
            .unwrap_or_else(|| panic!("{} not reported: {report:?}", p.display()));
        assert!(reason.contains(says), "{}: {reason}", p.display());
        assert_set_aside(p);
    }
    assert!(is_mount_point(&m), "the decoy was unmounted");
    assert_eq!(std::fs::read(m.join("precious")).unwrap(), b"keep me");
    assert!(agent.isolator.containers().await.is_empty());
    agent.stop().await;
    unmount_decoy(&m);
}

/// Finding 5, at cleanup of a container the isolator made itself: its sandbox (holding the host bind
/// of its volume) is swapped for a symlink to a decoy directory with a tmpfs. Cleanup refuses by
/// name and unmounts nothing through the symlink (a string-based canonicalize would have swept the
/// decoy); once the sandbox is put back, cleanup goes through.
#[tokio::test]
async fn cleanup_refuses_a_sandbox_swapped_for_a_symlink() {
    require_root();
    let sb = Sandbox::new("ckpt-cleanup");
    let agent = Agent::start(&sb, "work", &[]).await;
    let res = agent.volume("v", "data", VolumeMode::Rw).await;
    let cfg = config(&sb, "c1", vec![res], None);
    let sandbox = cfg.sandbox.clone();
    let (_, prepared) = agent.isolator.prepare_oci("c1", cfg).await.unwrap();
    assert_eq!(prepared.host_binds, vec![sandbox.join("data")]);
    let decoy = sb.mkdir("decoy");
    mount_tmpfs(&decoy.join("data"));

    let moved = sb.join("sandboxes/c1-moved");
    std::fs::rename(&sandbox, &moved).unwrap();
    std::os::unix::fs::symlink(&decoy, &sandbox).unwrap();
    let err = agent
        .isolator
        .cleanup("c1")
        .await
        .unwrap_err()
        .full_message();
    assert!(
        err.contains("not trusted") && err.contains("symbolic links"),
        "{err}"
    );
    assert!(
        is_mount_point(&decoy.join("data")),
        "the decoy was unmounted"
    );
    assert!(
        is_mount_point(&moved.join("data")),
        "the bind was left alone"
    );

    std::fs::remove_file(&sandbox).unwrap();
    std::fs::rename(&moved, &sandbox).unwrap();
    agent.isolator.cleanup("c1").await.unwrap();
    assert!(
        !is_mount_point(&sandbox.join("data")),
        "cleanup took the bind down"
    );
    assert!(is_mount_point(&decoy.join("data")));
    agent.stop().await;
    unmount_decoy(&decoy.join("data"));
}
