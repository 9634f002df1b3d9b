//! A modification through `csi-isolator volume modify`, killed (SIGKILL, by the crash-point hook
//! `CSI_ISOLATOR_CRASH_AFTER_WRITE=N`) at every crash point of the command (its start-up
//! writes, the intent written, ControllerModifyVolume answered, the result recorded). For each
//! N, the next command (which recovers on start) finds the modification finished: the intent is
//! durable before the RPC and ControllerModifyVolume is idempotent. Then the record's
//! `mutable_parameters` are the ones asked, no intent is left in its checkpoint, the plugin's
//! own record holds the same values (the plugin and the record agree), and the same modify
//! again is no change. The loop over N ends when the modify completes without crashing.

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Command, Output};

use csi_isolator_testing::files::files_named;
use csi_isolator_testing::{isolator_command, processes_mentioning, require_root, Sandbox};

const BIN: &str = env!("CARGO_BIN_EXE_csi-isolator");
const MAX_POINTS: u32 = 60;
const DIR: &str = "--plugin-arg=--backing=dir";

fn cli(work: &Path) -> Command {
    isolator_command(BIN, work)
}

fn run(cmd: &mut Command) -> Output {
    cmd.output().expect("run csi-isolator")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn wanted() -> serde_json::Value {
    serde_json::json!({"iops": "500", "tier": "fast"})
}

/// One run crashing at point `n`; whether it crashed.
fn crash_once(n: u32) -> bool {
    let sb = Sandbox::new("modify-crash");
    let work = sb.join("work");
    let made = run(cli(&work).args(["volume", DIR, "create", "v", "8M"]));
    assert!(made.status.success(), "{}", text(&made.stderr));

    let modify = ["volume", DIR, "modify", "v", "tier=fast", "iops=500"];
    let out = run(cli(&work)
        .args(modify)
        .env("CSI_ISOLATOR_CRASH_AFTER_WRITE", n.to_string()));
    let crashed = match out.status.signal() {
        Some(9) => true,
        _ => {
            assert!(out.status.success(), "point {n}: {}", text(&out.stderr));
            false
        }
    };

    // The next command recovers on start.
    let listed = run(cli(&work).args(["volume", DIR, "list", "--json"]));
    assert!(
        listed.status.success(),
        "point {n}: {}",
        text(&listed.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&listed.stdout).unwrap();
    assert_eq!(v[0]["mutable_parameters"], wanted(), "point {n}: {v}");
    let ours = files_named(&work, "volume.state");
    assert_eq!(ours.len(), 1, "point {n}: {ours:?}");
    let record = std::fs::read_to_string(&ours[0]).unwrap();
    assert!(!record.contains("modifying"), "point {n}: {record}");
    let theirs = files_named(&work, "volume.json");
    assert_eq!(theirs.len(), 1, "point {n}: {theirs:?}");
    let plugin: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&theirs[0]).unwrap()).unwrap();
    assert_eq!(
        plugin["mutable_parameters"],
        wanted(),
        "point {n}: {plugin}"
    );

    let again = run(cli(&work).args(modify));
    assert!(again.status.success(), "point {n}: {}", text(&again.stderr));
    assert_eq!(text(&again.stdout), "iops=500\ntier=fast\n", "point {n}");
    let gone = run(cli(&work).args(["volume", DIR, "destroy", "v"]));
    assert!(gone.status.success(), "point {n}: {}", text(&gone.stderr));
    sb.assert_no_mounts_under();
    sb.assert_no_loop_devices();
    let procs = processes_mentioning(&work);
    assert!(procs.is_empty(), "point {n}: processes left: {procs:?}");
    crashed
}

#[test]
fn a_modification_survives_a_crash_at_every_point() {
    require_root();
    let mut n = 1;
    while crash_once(n) {
        n += 1;
        assert!(n < MAX_POINTS, "the modification never completed");
    }
    let survived = n - 1;
    eprintln!("modify_crash: crash points survived: {survived}");
    // At least the intent, ControllerModifyVolume's answer and the record of its result.
    assert!(survived >= 3, "only {survived} crash points");
}

/// serve's ModifyVolume: the parameters set (answered and in Status' `mutable_parameters`),
/// a plugin's refusal INVALID_ARGUMENT and leaving them as they were.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_modify_volume_sets_and_status_shows_them() {
    use csi_isolator::service::proto::{CreateVolumeRequest, ModifyVolumeRequest, StatusRequest};
    require_root();
    let sb = Sandbox::new("modify-serve");
    let mut w = csi_isolator_testing::crash::ServeRuns::new(sb, BIN);
    w.start(None);
    let mut c = w.client().await;
    let v = c
        .create_volume(CreateVolumeRequest {
            name: "tiered".into(),
            capacity_bytes: 16 << 20,
            container_path: "data".into(),
            ..Default::default()
        })
        .await
        .expect("CreateVolume")
        .into_inner();
    let asked = |pairs: &[(&str, &str)]| ModifyVolumeRequest {
        volume_id: v.volume_id.clone(),
        mutable_parameters: pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..Default::default()
    };
    let wanted: std::collections::HashMap<String, String> =
        [("tier".to_string(), "fast".to_string())].into();
    let now = c
        .modify_volume(asked(&[("tier", "fast")]))
        .await
        .expect("ModifyVolume")
        .into_inner();
    assert_eq!(now.mutable_parameters, wanted);
    let refused = c
        .modify_volume(asked(&[("tier", "gold")]))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
    let empty = c.modify_volume(asked(&[])).await.unwrap_err();
    assert_eq!(empty.code(), tonic::Code::InvalidArgument, "{empty:?}");
    let st = c.status(StatusRequest {}).await.unwrap().into_inner();
    assert_eq!(st.volumes[0].mutable_parameters, wanted, "{st:?}");
    w.finish(c, &[&v.volume_id]).await;
}
