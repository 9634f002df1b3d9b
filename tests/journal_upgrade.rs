//! The upgrade path to the journal: a work dir written by the release before it (no journal,
//! every change in its `volume.state`) recovers under this one.
//!
//! `tests/fixtures/workdir-v1-no-journal.tgz` was made with that release's binary (the
//! bundled plugin, loop backing) under `/tmp/fx/work`: `made` created; `used` created and
//! published for container `c-1`, the process then gone (its mounts are not in the fixture:
//! after a reboot, or an unmount behind its back); `gone` created, then its destroy killed at
//! its first durable write (`destroying` recorded). The plugin's records name their targets by
//! absolute path: they are rewritten to where the fixture is unpacked.

use std::path::Path;
use std::process::Command;

use csi_isolator_testing::{isolator_command, require_root, status_volumes, Sandbox};

const CLI: &str = env!("CARGO_BIN_EXE_csi-isolator");
const FIXTURE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/workdir-v1-no-journal.tgz"
);
const MADE_AT: &str = "/tmp/fx/work";

fn unpack(sb: &Sandbox) -> std::path::PathBuf {
    let out = Command::new("tar")
        .arg("-xzf")
        .arg(FIXTURE)
        .arg("-C")
        .arg(sb.path())
        .output()
        .expect("run tar");
    assert!(out.status.success(), "unpack the fixture: {out:?}");
    let work = sb.join("work");
    let data = work.join("csi/csi-test-plugin.csi-isolator.io/default/plugin/data/volumes");
    for e in std::fs::read_dir(&data).unwrap() {
        let p = e.unwrap().path().join("volume.json");
        let text = std::fs::read_to_string(&p).unwrap();
        std::fs::write(&p, text.replace(MADE_AT, &work.display().to_string())).unwrap();
    }
    work
}

fn ok(work: &Path, args: &[&str]) -> String {
    let out = isolator_command(CLI, work).args(args).output().unwrap();
    assert!(out.status.success(), "{args:?}: {out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn a_work_dir_of_the_release_before_the_journal_recovers() {
    require_root();
    let sb = Sandbox::new("journal-upgrade");
    let work = unpack(&sb);
    let base = work.join("csi/csi-test-plugin.csi-isolator.io/default");
    assert!(!base.join("journal").exists(), "the fixture has no journal");

    // The first start recovers: the destroy is finished, the used volume republished.
    let listed = ok(&work, &["volume", "list", "--json"]);
    let names: Vec<String> = serde_json::from_str::<serde_json::Value>(&listed)
        .unwrap()
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(names.len(), 2, "{listed}");
    assert!(names.contains(&"made".into()) && names.contains(&"used".into()));

    let status = status_volumes(CLI, &work);
    let by_name = |n: &str| {
        status
            .iter()
            .find(|v| v["name"] == n)
            .unwrap_or_else(|| panic!("{n} in {status:?}"))
            .clone()
    };
    assert_eq!(by_name("made")["state"], "CREATED");
    let used = by_name("used");
    assert_eq!(used["state"], "PUBLISHED", "{used}");
    assert_eq!(used["users"], serde_json::json!(["c-1"]));
    assert_eq!(used["mounted"], true, "{used}");
    assert!(used["disagreement"].is_null(), "{used}");

    // The journal now exists, empty after the recovery's compaction; the state files hold it
    // all, each with its format version.
    let (parsed, _) = csi_isolator::durable::journal::read(&base.join("journal"))
        .unwrap()
        .expect("a journal");
    assert!(parsed.entries.is_empty(), "{parsed:?}");
    let mut files = 0;
    for e in std::fs::read_dir(base.join("volumes")).unwrap() {
        let state = e.unwrap().path().join("volume.state");
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&state).unwrap()).unwrap();
        assert_eq!(v["format"], 1, "{}", state.display());
        files += 1;
    }
    assert_eq!(files, 2);

    // And it keeps working: release, destroy, nothing left.
    ok(&work, &["volume", "release", "used", "--container", "c-1"]);
    ok(&work, &["volume", "destroy", "used"]);
    ok(&work, &["volume", "destroy", "made"]);
    assert!(status_volumes(CLI, &work).is_empty());
    sb.assert_no_mounts_under();
    sb.assert_no_loop_devices();
}

/// The figure the journal is for: 16 publishes at once share their fdatasyncs. Counts the
/// provider's syncs (state-file fsyncs and journal syncs, `checkpoint::fsyncs`) per publish,
/// and per release, compaction included, and prints them; before the journal a cold publish
/// cost 4 (2 atomic writes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_publishes_share_their_syncs() {
    use csi_isolator::provider::{CreateSpec, PluginSource, ProviderConfig, StorageProvider};
    use csi_isolator_testing::{plugin_bin, PluginProcess};
    require_root();
    let sb = Sandbox::new("journal-syncs");
    let plugin = PluginProcess::start(&sb, plugin_bin(), &["--backing", "dir"]).await;
    let mut config = ProviderConfig::new(
        "",
        "default",
        sb.join("work"),
        PluginSource::Endpoint(plugin.endpoint()),
    );
    config.provider_id.clear();
    let provider = StorageProvider::start(config).await.unwrap();
    const N: usize = 16;
    let mut ids = Vec::new();
    for i in 0..N {
        let id = provider
            .create_volume(CreateSpec::new(format!("v{i}"), 4 << 20))
            .await
            .unwrap()
            .source_id()
            .unwrap()
            .to_string();
        ids.push(id);
    }
    let f0 = csi_isolator::durable::syncs();
    futures::future::join_all(ids.iter().map(|id| provider.publish(id, "c1")))
        .await
        .into_iter()
        .for_each(|r| {
            r.unwrap();
        });
    let publish = (csi_isolator::durable::syncs() - f0) as f64 / N as f64;
    let f0 = csi_isolator::durable::syncs();
    futures::future::join_all(ids.iter().map(|id| provider.release(id, "c1")))
        .await
        .into_iter()
        .for_each(|r| r.unwrap());
    provider.compact_journal().await;
    let release = (csi_isolator::durable::syncs() - f0) as f64 / N as f64;
    eprintln!(
        "{N} concurrent publishes: {publish:.2} syncs per publish; {N} releases and a compaction: {release:.2} per release (before the journal: 4 per publish)"
    );
    assert!(
        publish < 4.0,
        "{publish} syncs per publish: no batch shared"
    );
    for id in &ids {
        provider.destroy_volume(id).await.unwrap();
    }
    provider.shutdown(std::time::Duration::from_secs(5)).await;
    drop(provider);
    sb.assert_no_mounts_under();
}
