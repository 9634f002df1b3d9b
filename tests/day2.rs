//! Day-2 expansion paths (issue 15) against the real bundled plugin, real loop devices and real
//! ext4/xfs: a node expansion that fails at the next publish (the publish still succeeds, the
//! expansion stays pending and `status` says so, a warning is logged, a later publish finishes
//! it); an ext4 volume grown while not in use, grown offline at its next stage and seen at its
//! new size with its data by the next workload; an ext4 volume grown in use on a host where the
//! plugin cannot grow a mounted ext4 (no CAP_SYS_RESOURCE) told why and what to do, and grown
//! at its next stage; an offline-only plugin refused while the volume is in use and growing it
//! once released; a plugin without snapshot, clone, expand or modify capability refused for each
//! before any RPC (its call log shows none); `status` showing a volume's content source.
//!
//! What a workload sees is read from a fresh mount namespace (`unshare -m`) with the volume's
//! mount point bound in, as a container's is.

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use csi_isolator::error_chain::full_message;
use csi_isolator::mount::ProcMountTable;
use csi_isolator::provider::bundled::bundled_config;
use csi_isolator::provider::state::{ExpandStep, Expansion};
use csi_isolator::provider::status::{scan, VolumeStatus};
use csi_isolator::provider::{CreateSpec, ProviderConfig, StorageProvider};
use csi_isolator_testing::{isolator_command, plugin_bin, require_root, status_volumes, Sandbox};

const CLI: &str = env!("CARGO_BIN_EXE_csi-isolator");

const MIB: u64 = 1 << 20;

/// Everything this test process logs at WARN and above (one subscriber per process).
fn logs() {
    csi_isolator_testing::logs::capture(tracing::Level::WARN);
}

use csi_isolator_testing::logs::captured;

fn config(sb: &Sandbox, plugin_args: &[String]) -> ProviderConfig {
    let work = sb.join("work");
    let mut c = bundled_config(Path::new(plugin_bin()), &work, "day2", plugin_args);
    c.ready_timeout = Duration::from_secs(10);
    c.socket_dir = sb.join("s");
    c
}

async fn start(sb: &Sandbox, plugin_args: &[String]) -> Arc<StorageProvider> {
    let p = StorageProvider::start(config(sb, plugin_args))
        .await
        .expect("start provider");
    if let Some(pid) = p.plugin_pid() {
        sb.track(pid);
    }
    p
}

async fn create(p: &StorageProvider, name: &str, size: u64, fs_type: &str) -> String {
    let mut spec = CreateSpec::new(name, size);
    spec.capability.fs_type = fs_type.to_string();
    p.create_volume(spec)
        .await
        .unwrap()
        .source_id()
        .unwrap()
        .to_string()
}

fn status_of(sb: &Sandbox, id: &str) -> VolumeStatus {
    let report = scan(&sb.join("work"), &ProcMountTable::new()).unwrap();
    report
        .volumes
        .into_iter()
        .find(|v| v.volume_id == id)
        .unwrap_or_else(|| panic!("{id} in the status"))
}

/// `csi-isolator status`'s text.
fn status_text(sb: &Sandbox) -> String {
    let out = isolator_command(CLI, &sb.join("work"))
        .arg("status")
        .output()
        .unwrap();
    String::from_utf8(out.stdout).unwrap()
}

/// What a workload with the volume at `mount_point` sees: its filesystem's size in bytes and
/// the content of its file `kept`, from a fresh mount namespace with the volume bound in.
fn seen_by_a_workload(sb: &Sandbox, mount_point: &Path) -> (u64, String) {
    let inside = sb.mkdir(format!("ns-{}", rand_suffix()));
    let out = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c"])
        .arg(r#"mount --bind "$1" "$2" && stat -f -c '%b %S' "$2" && cat "$2/kept""#)
        .arg("sh")
        .arg(mount_point)
        .arg(&inside)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let (first, kept) = text.split_once('\n').unwrap();
    let (blocks, size) = first.split_once(' ').unwrap();
    let bytes = blocks.parse::<u64>().unwrap() * size.parse::<u64>().unwrap();
    (bytes, kept.to_string())
}

fn rand_suffix() -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    N.fetch_add(1, Ordering::Relaxed).to_string()
}

fn keep(mount_point: &Path, what: &str) {
    let file = mount_point.join("kept");
    std::fs::write(&file, what).unwrap();
    std::fs::File::open(&file).unwrap().sync_all().unwrap();
}

/// Whether this process may grow a mounted ext4 (CAP_SYS_RESOURCE, bit 24, in CapEff).
fn has_cap_sys_resource() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let eff = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .unwrap()
        .trim();
    u64::from_str_radix(eff, 16).unwrap() & (1 << 24) != 0
}

fn calls(log: &Path, rpc: &str) -> usize {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.starts_with(rpc))
        .count()
}

async fn finish(sb: &Sandbox, p: Arc<StorageProvider>, id: &str, container: &str) {
    p.release(id, container).await.unwrap();
    p.destroy_volume(id).await.unwrap();
    p.shutdown(Duration::from_secs(5)).await;
    sb.assert_no_mounts_under();
    sb.assert_no_loop_devices();
}

/// An xfs volume grown while not in use waits for its node call; the first publish's
/// NodeExpandVolume fails (injected): the publish succeeds at the old size, the expansion stays
/// pending (status says so), a warning names the volume; the next publish finishes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_node_expansion_at_publish_stays_pending_and_the_next_publish_finishes_it() {
    require_root();
    logs();
    let sb = Sandbox::new("day2-pending");
    let log = sb.join("calls.log");
    let p = start(
        &sb,
        &[
            "--backing=loop".into(),
            "--fail=NodeExpandVolume=INTERNAL:1".into(),
            format!("--log-calls={}", log.display()),
        ],
    )
    .await;
    let id = create(&p, "pending", 300 * MIB, "xfs").await;
    let mp = p.publish(&id, "c1").await.unwrap();
    keep(&mp, "before the growth\n");
    let (before, _) = seen_by_a_workload(&sb, &mp);
    p.release(&id, "c1").await.unwrap();

    let grown = p.expand_volume(&id, 400 * MIB).await.unwrap();
    assert!(grown.node_pending, "{grown:?}");
    assert_eq!(calls(&log, "NodeExpandVolume"), 0);
    let pending = Some(Expansion {
        to_bytes: 400 * MIB,
        step: ExpandStep::Node,
    });
    assert_eq!(status_of(&sb, &id).expansion, pending);

    let mp = p.publish(&id, "c2").await.expect("the publish succeeds");
    assert_eq!(calls(&log, "NodeExpandVolume"), 1, "the node call was made");
    assert_eq!(status_of(&sb, &id).expansion, pending, "still pending");
    let text = status_text(&sb);
    assert!(
        text.contains("    expansion pending: to 419430400 bytes: NodeExpandVolume waits for the volume's next publish on this node"),
        "{text}"
    );
    let json = status_volumes(CLI, &sb.join("work"));
    assert_eq!(json[0]["expansion"]["step"], "node", "{json:?}");
    let (seen, kept) = seen_by_a_workload(&sb, &mp);
    assert_eq!(kept, "before the growth\n");
    assert!(
        seen < before + 50 * MIB,
        "{seen} after a failed growth, {before} before"
    );
    let warned = captured();
    assert!(
        warned.contains("NodeExpandVolume after publish failed") && warned.contains(&id),
        "{warned}"
    );
    p.release(&id, "c2").await.unwrap();

    let mp = p.publish(&id, "c3").await.unwrap();
    assert_eq!(calls(&log, "NodeExpandVolume"), 2);
    assert_eq!(status_of(&sb, &id).expansion, None, "finished");
    let (seen, kept) = seen_by_a_workload(&sb, &mp);
    assert_eq!(kept, "before the growth\n");
    assert!(
        seen >= before + 95 * MIB,
        "{seen} after the growth, {before} before"
    );
    finish(&sb, p, &id, "c3").await;
}

/// An ext4 loop volume grown while no container uses it: the next workload sees the new size
/// (its filesystem grown offline at the next stage, which needs no CAP_SYS_RESOURCE) and the
/// data written before; nothing stays pending.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ext4_volume_grown_while_not_in_use_shows_its_new_size_in_the_next_workload() {
    require_root();
    let sb = Sandbox::new("day2-ext4-offline");
    let p = start(&sb, &["--backing=loop".into()]).await;
    let id = create(&p, "grown", 64 * MIB, "ext4").await;
    let mp = p.publish(&id, "c1").await.unwrap();
    keep(&mp, "ext4 data\n");
    let (before, _) = seen_by_a_workload(&sb, &mp);
    p.release(&id, "c1").await.unwrap();

    let grown = p.expand_volume(&id, 160 * MIB).await.unwrap();
    assert_eq!(grown.capacity_bytes, 160 * MIB, "{grown:?}");
    let mp = p.publish(&id, "c2").await.unwrap();
    assert_eq!(status_of(&sb, &id).expansion, None);
    let (seen, kept) = seen_by_a_workload(&sb, &mp);
    assert_eq!(kept, "ext4 data\n");
    assert!(
        seen >= before + 80 * MIB,
        "the workload sees {seen} bytes, it saw {before}"
    );
    finish(&sb, p, &id, "c2").await;
}

/// An ext4 loop volume grown while a workload uses it. Where the plugin cannot grow a mounted
/// ext4 (no CAP_SYS_RESOURCE, as on this project's VM) the expansion fails saying why and what
/// to do, stays pending (status says so), and the volume's next stage grows it offline: the
/// next workload sees the new size and the data. Where it can, the workload sees it at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ext4_volume_grown_in_use_says_why_it_cannot_and_grows_at_its_next_stage() {
    require_root();
    let sb = Sandbox::new("day2-ext4-online");
    let p = start(&sb, &["--backing=loop".into()]).await;
    let id = create(&p, "busy", 64 * MIB, "ext4").await;
    let mp = p.publish(&id, "c1").await.unwrap();
    keep(&mp, "in use\n");
    let (before, _) = seen_by_a_workload(&sb, &mp);

    let expanded = p.expand_volume(&id, 160 * MIB).await;
    let mp = if has_cap_sys_resource() {
        expanded.expect("an online ext4 grow with CAP_SYS_RESOURCE");
        mp
    } else {
        let err = expanded.expect_err("no CAP_SYS_RESOURCE: the mounted ext4 cannot grow");
        let said = full_message(&err);
        for words in [
            "NodeExpandVolume",
            "needs CAP_SYS_RESOURCE",
            "release the volume from every container",
            "next stage grows it offline",
        ] {
            assert!(said.contains(words), "{words:?} in {said}");
        }
        assert_eq!(
            status_of(&sb, &id).expansion,
            Some(Expansion {
                to_bytes: 160 * MIB,
                step: ExpandStep::Node,
            })
        );
        let (still, _) = seen_by_a_workload(&sb, &mp);
        assert!(still < before + 10 * MIB, "{still} vs {before}");
        p.release(&id, "c1").await.unwrap();
        p.publish(&id, "c2").await.unwrap()
    };
    assert_eq!(status_of(&sb, &id).expansion, None);
    let (seen, kept) = seen_by_a_workload(&sb, &mp);
    assert_eq!(kept, "in use\n");
    assert!(
        seen >= before + 80 * MIB,
        "the workload sees {seen} bytes, it saw {before}"
    );
    let last = if has_cap_sys_resource() { "c1" } else { "c2" };
    finish(&sb, p, &id, last).await;
}

/// `status` (the scan behind the text, `--json` and serve's Status) shows where a volume's
/// content came from: the snapshot it was made from, the volume it was cloned from.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_shows_what_a_volume_was_made_from() {
    require_root();
    let sb = Sandbox::new("day2-source");
    let p = start(&sb, &["--backing=dir".into()]).await;
    let id = create(&p, "origin", 8 * MIB, "").await;
    p.create_snapshot(&id, "nightly").await.unwrap();
    let from_snapshot = p
        .create_volume_from(
            CreateSpec::new("restored", 8 * MIB),
            Some(snapshot_name("nightly")),
        )
        .await
        .unwrap()
        .source_id()
        .unwrap()
        .to_string();
    let clone = p
        .create_volume_from(
            CreateSpec::new("copy", 8 * MIB),
            Some(volume_name("origin")),
        )
        .await
        .unwrap()
        .source_id()
        .unwrap()
        .to_string();
    assert_eq!(status_of(&sb, &id).content_source, None);
    let shown = |id: &str| {
        let v = status_of(&sb, id);
        let json = serde_json::to_value(&v).unwrap();
        (
            v.content_source.unwrap().label(),
            json["content_source"].clone(),
        )
    };
    let (label, json) = shown(&from_snapshot);
    assert_eq!(label, "snapshot:nightly");
    assert_eq!(json["snapshot"]["name"], "nightly", "{json}");
    let (label, json) = shown(&clone);
    assert_eq!(label, "volume:origin");
    assert_eq!(json["volume"]["name"], "origin", "{json}");
    let text = status_text(&sb);
    for line in [
        "    made from snapshot 'nightly'\n",
        "    cloned from volume 'origin'\n",
    ] {
        assert!(text.contains(line), "{line:?} in {text}");
    }
    assert_eq!(
        text.matches("made from").count() + text.matches("cloned from").count(),
        2,
        "{text}"
    );
    for v in [&from_snapshot, &clone] {
        p.destroy_volume(v).await.unwrap();
    }
    p.delete_snapshot("nightly").await.unwrap();
    p.destroy_volume(&id).await.unwrap();
    p.shutdown(Duration::from_secs(5)).await;
    sb.assert_no_mounts_under();
}

fn snapshot_name(name: &str) -> csi_isolator::provider::snapshot::SourceName {
    csi_isolator::provider::snapshot::SourceName::Snapshot(name.into())
}

fn volume_name(name: &str) -> csi_isolator::provider::snapshot::SourceName {
    csi_isolator::provider::snapshot::SourceName::Volume(name.into())
}

/// A plugin without CREATE_DELETE_SNAPSHOT, CLONE_VOLUME, EXPAND_VOLUME and MODIFY_VOLUME: each
/// of the four operations is refused by the isolator saying which capability is missing, and
/// the plugin's call log shows that none of their RPCs reached it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_without_the_capabilities_sees_no_rpc_of_the_refused_operations() {
    require_root();
    let sb = Sandbox::new("day2-no-caps");
    let log = sb.join("calls.log");
    let p = start(
        &sb,
        &[
            "--backing=dir".into(),
            "--no-snapshots".into(),
            "--no-clones".into(),
            "--expansion=none".into(),
            "--no-modify".into(),
            format!("--log-calls={}", log.display()),
        ],
    )
    .await;
    let id = create(&p, "origin", 8 * MIB, "").await;
    let said = |e: csi_isolator::provider::ProviderError| full_message(&e);
    let refusals = [
        (
            said(p.create_snapshot(&id, "s").await.unwrap_err()),
            "the plugin cannot take snapshots (its controller has no CREATE_DELETE_SNAPSHOT)",
        ),
        (
            said(p.delete_snapshot("s").await.unwrap_err()),
            "the plugin cannot take snapshots",
        ),
        (
            said(
                p.create_volume_from(
                    CreateSpec::new("restored", 8 * MIB),
                    Some(snapshot_name("s")),
                )
                .await
                .unwrap_err(),
            ),
            "the plugin cannot take snapshots",
        ),
        (
            said(
                p.create_volume_from(CreateSpec::new("copy", 8 * MIB), Some(volume_name("origin")))
                    .await
                    .unwrap_err(),
            ),
            "the plugin cannot clone volumes (its controller has no CLONE_VOLUME)",
        ),
        (
            said(p.expand_volume(&id, 16 * MIB).await.unwrap_err()),
            "the plugin cannot expand volumes (neither its controller nor its node service has EXPAND_VOLUME)",
        ),
        (
            said(
                p.modify_volume(&id, &[("tier".to_string(), "fast".to_string())].into())
                    .await
                    .unwrap_err(),
            ),
            "the plugin cannot modify volumes (its controller service has no MODIFY_VOLUME)",
        ),
    ];
    for (message, words) in &refusals {
        assert!(message.contains(words), "{words:?} in {message}");
    }
    for rpc in [
        "CreateSnapshot",
        "DeleteSnapshot",
        "ControllerExpandVolume",
        "NodeExpandVolume",
        "ControllerModifyVolume",
    ] {
        assert_eq!(calls(&log, rpc), 0, "{rpc} reached the plugin");
    }
    assert_eq!(calls(&log, "CreateVolume"), 1, "only the origin's");
    // The log is the plugin's: it holds the calls that were made.
    assert!(calls(&log, "ControllerGetCapabilities") > 0);
    p.destroy_volume(&id).await.unwrap();
    p.shutdown(Duration::from_secs(5)).await;
    sb.assert_no_mounts_under();
}

/// A plugin that expands offline only (`--expansion offline`): `expand` of a volume a container
/// uses is refused by the isolator before any RPC, naming the user; once released it is grown
/// (the image by ControllerExpandVolume, the ext4 offline at the next stage) and the next
/// workload sees the new size and the data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_offline_only_plugin_is_refused_in_use_and_grows_the_volume_once_released() {
    require_root();
    let sb = Sandbox::new("day2-offline");
    let log = sb.join("calls.log");
    let p = start(
        &sb,
        &[
            "--backing=loop".into(),
            "--expansion=offline".into(),
            format!("--log-calls={}", log.display()),
        ],
    )
    .await;
    let id = create(&p, "offline", 64 * MIB, "ext4").await;
    let mp = p.publish(&id, "c1").await.unwrap();
    keep(&mp, "offline data\n");
    let (before, _) = seen_by_a_workload(&sb, &mp);
    let refused = full_message(&p.expand_volume(&id, 160 * MIB).await.unwrap_err());
    assert!(
        refused.contains("used by c1: stop them and retry"),
        "{refused}"
    );
    assert_eq!(calls(&log, "ControllerExpandVolume"), 0);
    assert_eq!(status_of(&sb, &id).expansion, None, "nothing pending");
    p.release(&id, "c1").await.unwrap();

    p.expand_volume(&id, 160 * MIB).await.unwrap();
    assert_eq!(calls(&log, "ControllerExpandVolume"), 1);
    let mp = p.publish(&id, "c2").await.unwrap();
    assert_eq!(status_of(&sb, &id).expansion, None);
    let (seen, kept) = seen_by_a_workload(&sb, &mp);
    assert_eq!(kept, "offline data\n");
    assert!(
        seen >= before + 80 * MIB,
        "the workload sees {seen} bytes, it saw {before}"
    );
    // Stats are read on demand only: publishes and expansions asked for none.
    assert_eq!(calls(&log, "NodeGetVolumeStats"), 0);
    finish(&sb, p, &id, "c2").await;
}
