//! `csi-isolator run` killed (SIGKILL, by the crash-point hook) at every
//! crash point of a launch and its cleanup; the next `run` on the work dir
//! recovers. Afterwards: the volume is unpublished and unused, `status`
//! finds no disagreement, nothing is mounted or running, no sandbox or
//! container checkpoint is left, and every line a workload wrote is still
//! in the volume.

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Command, Output};

use csi_isolator::mount::{MountTable, ProcMountTable};
use csi_isolator::provider::checkpoint::CRASH_AFTER_WRITE_ENV;
use csi_isolator_testing::{processes_mentioning, require_root, Sandbox};

const CLI: &str = env!("CARGO_BIN_EXE_csi-isolator");

fn run(sb: &Sandbox, args: &[&str], crash_after: Option<u32>) -> Output {
    let mut cmd = Command::new(CLI);
    cmd.arg("--work-dir")
        .arg(sb.join("work"))
        .env("CSI_ISOLATOR_SOCKET_DIR", sb.join("s"))
        .env_remove(CRASH_AFTER_WRITE_ENV)
        .args(args);
    if let Some(n) = crash_after {
        cmd.env(CRASH_AFTER_WRITE_ENV, n.to_string());
    }
    cmd.output().expect("run csi-isolator")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn run_killed_at_every_crash_point_is_recovered_by_the_next_run() {
    require_root();
    for n in 1..60u32 {
        let sb = Sandbox::new("run-crash");
        let work = sb.join("work");
        // A first, clean run writes a line and creates the volume.
        let first = run(
            &sb,
            &[
                "run",
                "--volume",
                "v:8M:v",
                "--",
                "sh",
                "-c",
                "echo first >> v/log",
            ],
            None,
        );
        assert!(first.status.success(), "{}", text(&first.stderr));
        let second = run(
            &sb,
            &[
                "run",
                "--volume",
                "v:8M:v",
                "--",
                "sh",
                "-c",
                "echo second >> v/log",
            ],
            Some(n),
        );
        if second.status.success() {
            let crashed = n - 1;
            assert!(crashed >= 4, "only {crashed} crash points in a run");
            eprintln!("crash points survived: {crashed}");
            return;
        }
        assert_eq!(
            second.status.signal(),
            Some(9),
            "point {n}: {}",
            text(&second.stderr)
        );

        // The next run recovers, then reads everything written so far.
        let third = run(
            &sb,
            &["run", "--volume", "v:8M:v", "--", "cat", "v/log"],
            None,
        );
        assert!(third.status.success(), "point {n}: {}", text(&third.stderr));
        let log = text(&third.stdout);
        assert!(log.starts_with("first\n"), "point {n}: data lost: {log:?}");
        assert!(
            log == "first\n" || log == "first\nsecond\n",
            "point {n}: {log:?}"
        );

        let status = run(&sb, &["status", "--json"], None);
        assert!(
            status.status.success(),
            "point {n}: disagreement: {}",
            text(&status.stdout)
        );
        let report: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
        let vols = report["volumes"].as_array().unwrap();
        assert_eq!(vols.len(), 1, "point {n}: one volume");
        assert_eq!(vols[0]["state"], "CREATED", "point {n}");
        assert_eq!(vols[0]["users"].as_array().unwrap().len(), 0, "point {n}");
        assert!(
            ProcMountTable::new()
                .mounts_under(Path::new(&work))
                .unwrap()
                .is_empty(),
            "point {n}: nothing mounted"
        );
        let procs = processes_mentioning(&work);
        assert!(procs.is_empty(), "point {n}: processes left: {procs:?}");
        let isolator_state = work.join("isolators/volume/csi");
        let left = std::fs::read_dir(&isolator_state)
            .map(|d| d.count())
            .unwrap_or(0);
        assert_eq!(left, 0, "point {n}: container checkpoints left");
        // The killed run's sandbox went with its container (the third run removed its own).
        let sandboxes: Vec<_> = std::fs::read_dir(work.join("sandboxes"))
            .map(|d| d.flatten().map(|e| e.file_name()).collect())
            .unwrap_or_default();
        assert!(
            sandboxes.is_empty(),
            "point {n}: sandboxes left: {sandboxes:?}"
        );
        sb.assert_no_mounts_under();
    }
    panic!("the run never completed");
}
