//! Volume stats and health (issue 15 item 2) against the real bundled plugin and real mounts:
//! figures after writing N MiB (loop and dir backings), through `provider::stats`, serve's
//! `/metrics` render (kubelet's gauges) and `csi-isolator status --stats --json` (plain `status`
//! asks no plugin); a damaged backing shown
//! abnormal; a plugin without GET_VOLUME_STATS showing nothing and no error; a plugin that hangs
//! on NodeGetVolumeStats not holding up the others beyond the deadline.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use csi_isolator::mount::ProcMountTable;
use csi_isolator::provider::bundled::bundled_config;
use csi_isolator::provider::stats::{self, VolumeStats};
use csi_isolator::provider::status::{scan, StatusReport, VolumeStatus};
use csi_isolator::provider::{CreateSpec, Manager, ProviderConfig, StorageProvider};
use csi_isolator_testing::files::{find_below, write_mib};
use csi_isolator_testing::{exposition, plugin_bin, require_root, Sandbox};

const MIB: u64 = 1 << 20;
const BLOCK: i64 = 4096;

fn config(work: &Path, name: &str, plugin_args: &[&str]) -> ProviderConfig {
    let args: Vec<String> = plugin_args.iter().map(|s| s.to_string()).collect();
    let mut c = bundled_config(Path::new(plugin_bin()), work, name, &args);
    c.ready_timeout = Duration::from_secs(10);
    c.socket_dir = work.parent().unwrap().join("s");
    c
}

async fn start(sb: &Sandbox, c: ProviderConfig) -> Arc<StorageProvider> {
    let p = StorageProvider::start(c).await.expect("start provider");
    if let Some(pid) = p.plugin_pid() {
        sb.track(pid);
    }
    p
}

/// Creates and publishes `name` of `size` for container `c1`; returns its id and mount point.
async fn published(p: &StorageProvider, name: &str, size: u64) -> (String, PathBuf) {
    let id = p
        .create_volume(CreateSpec::new(name, size))
        .await
        .unwrap()
        .source_id()
        .unwrap()
        .to_string();
    let mp = p.publish(&id, "c1").await.unwrap();
    (id, mp)
}

async fn finish(p: Arc<StorageProvider>, ids: &[String]) {
    for id in ids {
        p.release(id, "c1").await.unwrap();
        p.destroy_volume(id).await.unwrap();
    }
    p.shutdown(Duration::from_secs(5)).await;
}

async fn report_of(
    work: &Path,
    providers: &[&Arc<StorageProvider>],
    deadline: Duration,
) -> StatusReport {
    let mut report = scan(work, &ProcMountTable::new()).unwrap();
    let clients: BTreeMap<_, _> = providers
        .iter()
        .map(|p| (p.plugin().to_string(), p.client().clone()))
        .collect();
    stats::attach(&mut report, &clients, deadline).await;
    report
}

fn volume<'r>(report: &'r StatusReport, id: &str) -> &'r VolumeStatus {
    report
        .volumes
        .iter()
        .find(|v| v.volume_id == id)
        .unwrap_or_else(|| panic!("{id} in {report:?}"))
}

fn used(s: &VolumeStats) -> i64 {
    s.bytes_used.expect("bytes_used") as i64
}

/// kubelet's gauges of `volume` from serve's `/metrics` render.
fn gauges(p: &Arc<StorageProvider>, work: &Path, volume: &str) -> BTreeMap<String, f64> {
    let mut manager = Manager::new();
    manager.add(p.clone());
    let metrics = csi_isolator::service::metrics::ServiceMetrics::default();
    let text = metrics.render(&manager, work, &ProcMountTable::new());
    let families = exposition::parse(&text).unwrap_or_else(|e| panic!("{e} in {text}"));
    families
        .iter()
        .filter(|f| f.name.starts_with("kubelet_volume_stats_"))
        .flat_map(|f| {
            f.samples
                .iter()
                .filter(|s| s.label("volume") == Some(volume))
                .map(|s| (f.name.clone(), s.value))
        })
        .collect()
}

async fn figures_follow_writes(label: &str, backing: &str) {
    require_root();
    let sb = Sandbox::new(label);
    let work = sb.mkdir("work");
    let p = start(&sb, config(&work, "default", &["--backing", backing])).await;
    let (id, mp) = published(&p, "data", 64 * MIB).await;
    let deadline = Duration::from_secs(5);

    let before = report_of(&work, &[&p], deadline).await;
    let v = volume(&before, &id);
    assert_eq!(v.stats_unavailable, None);
    let s0 = v.stats.clone().expect("stats");
    let c0 = v.condition.clone().expect("condition");
    assert!(!c0.abnormal, "{c0:?}");
    if backing == "loop" {
        // The volume's own ext4: its total is the image less what ext4 keeps for itself.
        let total = s0.bytes_total.unwrap();
        assert!((48 * MIB..=64 * MIB).contains(&total), "{s0:?}");
    }

    write_mib(&mp, 8);
    let after = report_of(&work, &[&p], deadline).await;
    let s1 = volume(&after, &id).stats.clone().expect("stats");
    let grew = used(&s1) - used(&s0);
    if backing == "loop" {
        // Nothing else writes to the volume's own filesystem: within a block of what was written.
        assert!(
            (grew - 8 * MIB as i64).abs() <= BLOCK,
            "used grew by {grew}: {s0:?} -> {s1:?}"
        );
        assert!(s1.inodes_used.unwrap() > s0.inodes_used.unwrap());
    } else {
        // The dir backing reports the work dir's filesystem, which others write too.
        assert!(grew > 0, "{s0:?} -> {s1:?}");
    }

    // serve's /metrics: kubelet's gauges, labelled by the volume's name.
    let work2 = work.clone();
    let p2 = p.clone();
    let g = tokio::task::spawn_blocking(move || gauges(&p2, &work2, "data"))
        .await
        .unwrap();
    let g_used = g["kubelet_volume_stats_used_bytes"] as i64;
    if backing == "loop" {
        assert!((g_used - used(&s1)).abs() <= BLOCK, "{g:?} vs {s1:?}");
        assert_eq!(
            g["kubelet_volume_stats_capacity_bytes"] as u64,
            s1.bytes_total.unwrap()
        );
    }
    assert_eq!(
        g["kubelet_volume_stats_health_status_abnormal"], 0.0,
        "{g:?}"
    );
    for name in [
        "kubelet_volume_stats_available_bytes",
        "kubelet_volume_stats_inodes",
        "kubelet_volume_stats_inodes_free",
        "kubelet_volume_stats_inodes_used",
    ] {
        assert!(g.contains_key(name), "{name} in {g:?}");
    }

    // Damage: what holds the data goes away (moved aside, and back for the cleanup).
    let storage = find_below(
        &p.layout().plugin_dir(),
        if backing == "loop" {
            "image.ext4"
        } else {
            "data"
        },
    );
    let aside = storage.with_extension("moved");
    std::fs::rename(&storage, &aside).unwrap();
    let damaged = report_of(&work, &[&p], deadline).await;
    let c = volume(&damaged, &id).condition.clone().expect("condition");
    assert!(c.abnormal, "{c:?}");
    assert!(c.message.contains("is gone"), "{c:?}");
    let work2 = work.clone();
    let p2 = p.clone();
    let g = tokio::task::spawn_blocking(move || gauges(&p2, &work2, "data"))
        .await
        .unwrap();
    assert_eq!(
        g["kubelet_volume_stats_health_status_abnormal"], 1.0,
        "{g:?}"
    );
    std::fs::rename(&aside, &storage).unwrap();

    finish(p, &[id]).await;
    sb.assert_no_mounts_under();
    sb.assert_no_loop_devices();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loop_volume_figures_follow_writes_and_damage_shows_abnormal() {
    figures_follow_writes("stats-loop", "loop").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dir_volume_figures_follow_writes_and_damage_shows_abnormal() {
    figures_follow_writes("stats-dir", "dir").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_without_volume_stats_shows_none_and_no_error() {
    require_root();
    let sb = Sandbox::new("stats-none");
    let work = sb.mkdir("work");
    let p = start(
        &sb,
        config(&work, "default", &["--backing", "dir", "--no-volume-stats"]),
    )
    .await;
    let (id, _mp) = published(&p, "data", 16 * MIB).await;
    let report = report_of(&work, &[&p], Duration::from_secs(5)).await;
    let v = volume(&report, &id);
    assert_eq!(
        (&v.stats, &v.condition, &v.stats_unavailable),
        (&None, &None, &None)
    );
    // Not even asked.
    let asked = p
        .client()
        .metrics()
        .snapshot()
        .get("NodeGetVolumeStats")
        .map_or(0, |s| s.pending + s.finished + s.failed + s.cancelled);
    assert_eq!(asked, 0);
    finish(p, &[id]).await;
    sb.assert_no_mounts_under();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_hanging_on_stats_times_out_and_the_others_show() {
    require_root();
    let sb = Sandbox::new("stats-hang");
    let work = sb.mkdir("work");
    let slow = start(
        &sb,
        config(
            &work,
            "slow",
            &["--backing", "dir", "--delay", "NodeGetVolumeStats=60000"],
        ),
    )
    .await;
    let fine = start(&sb, config(&work, "fine", &["--backing", "dir"])).await;
    let (slow_id, _) = published(&slow, "stuck", 16 * MIB).await;
    let (fine_id, _) = published(&fine, "fine", 16 * MIB).await;
    let deadline = Duration::from_millis(500);
    let started = Instant::now();
    let report = report_of(&work, &[&slow, &fine], deadline).await;
    let took = started.elapsed();
    assert!(took < Duration::from_secs(2), "took {took:?}");
    let stuck = volume(&report, &slow_id);
    assert!(
        stuck
            .stats_unavailable
            .as_deref()
            .is_some_and(|w| w.contains("timed out")),
        "{stuck:?}"
    );
    assert_eq!(stuck.stats, None);
    assert!(volume(&report, &fine_id).stats.is_some());
    // The publish path is not held up by the hanging stats call.
    let (second, _) = published(&slow, "second", 16 * MIB).await;
    finish(slow, &[slow_id, second]).await;
    finish(fine, &[fine_id]).await;
    sb.assert_no_mounts_under();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_stats_shows_stats_from_the_running_managed_plugin() {
    require_root();
    let sb = Sandbox::new("stats-cli");
    let work = sb.mkdir("work");
    let c = config(&work, "default", &["--backing", "loop"]);
    let socket_dir = c.socket_dir.clone();
    let p = start(&sb, c).await;
    let (id, mp) = published(&p, "data", 64 * MIB).await;
    write_mib(&mp, 4);
    let out = tokio::task::spawn_blocking({
        let work = work.clone();
        move || {
            csi_isolator_testing::isolator_command(env!("CARGO_BIN_EXE_csi-isolator"), &work)
                .args(["status", "--stats", "--json", "--plugin-socket-dir"])
                .arg(&socket_dir)
                .output()
                .unwrap()
        }
    })
    .await
    .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let json: serde_json::Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    let v = json["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["volume_id"] == id.as_str())
        .unwrap();
    let used = v["stats"]["bytes_used"]
        .as_u64()
        .unwrap_or_else(|| panic!("{v}"));
    assert!(used >= 4 * MIB, "{v}");
    assert!(
        v["stats"]["bytes_total"].as_u64().unwrap() <= 64 * MIB,
        "{v}"
    );
    assert_eq!(v["condition"]["abnormal"], false, "{v}");
    // The table's usage line.
    let table = tokio::task::spawn_blocking({
        let work = work.clone();
        let socket_dir = work.parent().unwrap().join("s");
        move || {
            csi_isolator_testing::isolator_command(env!("CARGO_BIN_EXE_csi-isolator"), &work)
                .args(["status", "--stats", "--plugin-socket-dir"])
                .arg(&socket_dir)
                .output()
                .unwrap()
        }
    })
    .await
    .unwrap();
    let table = String::from_utf8_lossy(&table.stdout);
    assert!(
        table
            .lines()
            .any(|l| l.trim_start().starts_with("usage: ") && l.contains("healthy")),
        "{table}"
    );
    finish(p, &[id]).await;
    sb.assert_no_mounts_under();
    sb.assert_no_loop_devices();
}

/// Stats are opt-in: plain `status` (and `--no-stats`, still accepted) sends no
/// NodeGetVolumeStats to the running plugin and shows no usage; `--stats` does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_status_asks_no_plugin_for_stats() {
    require_root();
    let sb = Sandbox::new("stats-opt-in");
    let work = sb.mkdir("work");
    let log = sb.join("calls.log");
    let log_arg = format!("--log-calls={}", log.display());
    let c = config(&work, "default", &["--backing", "dir", &log_arg]);
    let socket_dir = c.socket_dir.clone();
    let p = start(&sb, c).await;
    let (id, _) = published(&p, "data", 16 * MIB).await;
    let stats_calls = || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.starts_with("NodeGetVolumeStats"))
            .count()
    };
    let status = |extra: &'static [&'static str]| {
        let (work, socket_dir) = (work.clone(), socket_dir.clone());
        tokio::task::spawn_blocking(move || {
            let out =
                csi_isolator_testing::isolator_command(env!("CARGO_BIN_EXE_csi-isolator"), &work)
                    .arg("status")
                    .args(extra)
                    .arg("--plugin-socket-dir")
                    .arg(&socket_dir)
                    .output()
                    .unwrap();
            assert!(out.status.success(), "status {extra:?}: {out:?}");
            String::from_utf8(out.stdout).unwrap()
        })
    };
    for extra in [
        &["--json"][..],
        &[],
        &["--no-stats"],
        &["--no-stats", "--json"],
    ] {
        let text = status(extra).await.unwrap();
        assert!(
            text.contains(&id),
            "status {extra:?} lists the volume: {text}"
        );
        assert!(
            !text.contains("usage:") && !text.contains("\"stats\"") && !text.contains("condition"),
            "status {extra:?} shows no stats: {text}"
        );
        assert_eq!(
            stats_calls(),
            0,
            "status {extra:?} asked the plugin for stats"
        );
    }
    // The log is not vacuous: --stats asks, once per published volume.
    let text = status(&["--stats", "--json"]).await.unwrap();
    assert!(text.contains("\"bytes_total\""), "{text}");
    assert_eq!(stats_calls(), 1);
    finish(p, &[id]).await;
    sb.assert_no_mounts_under();
}
