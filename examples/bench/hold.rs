//! The hidden `--hold N` mode: a serve-like process (the provider in
//! process, its plugin managed) that creates and publishes N volumes, one
//! container each, then reports its own memory and the latency of a status
//! scan and of ensure-all with all of them in use as one JSON line on stdout, and waits for stdin
//! to close.
//!
//! It runs in its own mount namespace (made a slave of the host's before
//! any thread exists), so its 2N mounts never reach the host and vanish
//! with it and its plugin, whatever happens to the parent.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use futures::{StreamExt, TryStreamExt};
use nix::mount::{mount, MsFlags};
use serde::{Deserialize, Serialize};

use csi_isolator::mount::{ns, MountTable, ProcMountTable};
use csi_isolator::provider::bundled::bundled_config;
use csi_isolator::provider::{status, CreateSpec, StorageProvider, UnpublishPolicy};

use crate::machine::status_kib;
use crate::stats::Samples;

/// How many creates and publishes run at once while setting up.
const SETUP_CONCURRENCY: usize = 16;
/// Status scans measured (fewer with many volumes: each reads every checkpoint).
fn scan_runs(count: usize) -> usize {
    if count > 2000 {
        10
    } else {
        50
    }
}
/// Publishes measured with every volume in use.
const PUBLISHES: usize = 20;

/// What the hold child reports.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct HoldReport {
    /// Volumes published (one container each).
    pub volumes: usize,
    /// Time to create and publish them all.
    pub setup_ms: f64,
    /// The process's VmRSS once they are published, KiB.
    pub vm_rss_kib: u64,
    /// Its peak RSS (VmHWM), KiB.
    pub vm_hwm_kib: u64,
    /// The managed plugin's VmRSS, KiB.
    pub plugin_rss_kib: u64,
    /// Lines of the namespace's mount table.
    pub mounts: usize,
    /// Volumes the status scan saw, all mounted.
    pub scan_volumes: usize,
    /// Status scan latency, p50, microseconds.
    pub scan_p50_us: f64,
    /// Status scan latency, p99, microseconds.
    pub scan_p99_us: f64,
    /// publish() for a new container of an already published volume, p50, microseconds.
    pub publish_p50_us: f64,
    /// Same, p99.
    pub publish_p99_us: f64,
    /// publish_for_container() of one published volume (ensure-all over every volume in use), p50.
    pub pfc_p50_us: f64,
    /// Same, p99.
    pub pfc_p99_us: f64,
    /// The first ensure-all sweep after the start (ensure_in_use alone: no publish, no durable
    /// write), which checks every volume in use, microseconds.
    pub full_sweep_us: f64,
    /// Later ensure-all sweeps with nothing changed, p50, microseconds.
    pub idle_sweep_p50_us: f64,
    /// Same, p99.
    pub idle_sweep_p99_us: f64,
    /// How the provider learns of volumes unmounted behind its back.
    pub watch: String,
}

/// Entry point of the child: own mount namespace, then the runtime.
pub fn main(count: usize, dir: PathBuf, plugin: PathBuf) -> Result<()> {
    // Single-threaded here: the whole process moves into the new namespace.
    ns::unshare_mount_namespace().context("unshare the mount namespace")?;
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_SLAVE,
        None::<&str>,
    )
    .context("make / a recursive slave")?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("build the tokio runtime")?;
    rt.block_on(run(count, &dir, &plugin))
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

async fn run(count: usize, dir: &Path, plugin: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    let mut config = bundled_config(plugin, dir, "hold", &[crate::backing_arg()]);
    config.policy = UnpublishPolicy::LastUse;
    config.socket_dir = dir.join("s");
    let provider = StorageProvider::start(config)
        .await
        .context("start the hold provider")?;
    let result = measure(&provider, count, dir).await;
    if let Ok(report) = &result {
        println!("{}", serde_json::to_string(report)?);
        // Hold everything until the parent closes our stdin.
        let _ = tokio::task::spawn_blocking(|| {
            let mut sink = Vec::new();
            let _ = std::io::stdin().read_to_end(&mut sink);
        })
        .await;
    }
    provider.shutdown(Duration::from_secs(2)).await;
    result.map(|_| ())
}

async fn measure(provider: &StorageProvider, count: usize, dir: &Path) -> Result<HoldReport> {
    let t0 = Instant::now();
    let ids: Vec<String> = futures::stream::iter(0..count)
        .map(|i| async move {
            let res = provider
                .create_volume(CreateSpec::new(format!("hold-{i}"), 1 << 20))
                .await
                .with_context(|| format!("create volume hold-{i}"))?;
            let id = res
                .source_id()
                .context("created resource without a volume id")?
                .to_string();
            provider
                .publish(&id, &format!("c{i}"))
                .await
                .with_context(|| format!("publish {id}"))?;
            anyhow::Ok(id)
        })
        .buffer_unordered(SETUP_CONCURRENCY)
        .try_collect()
        .await?;
    let setup = t0.elapsed();

    let vm_rss_kib = status_kib("self", "VmRSS:").unwrap_or(0);
    let vm_hwm_kib = status_kib("self", "VmHWM:").unwrap_or(0);
    let plugin_rss_kib = provider
        .plugin_pid()
        .and_then(|p| status_kib(&p.to_string(), "VmRSS:"))
        .unwrap_or(0);

    let table = ProcMountTable::new();
    let mounts = table.mounts().context("read the mount table")?.len();
    let mut scans = Samples::new();
    let mut scan_volumes = 0;
    for _ in 0..scan_runs(count) {
        let t = Instant::now();
        let report = status::scan(dir, &table).context("status scan")?;
        scans.push(t.elapsed());
        scan_volumes = report.volumes.iter().filter(|v| v.mounted).count();
    }
    ensure!(
        scan_volumes == count,
        "status scan saw {scan_volumes} mounted volumes, expected {count}"
    );

    let first = ids.first().context("no volume")?.clone();
    // The setup's dirty pages go to disk first, untimed: otherwise the first fsync below pays
    // for writing back N creates.
    nix::unistd::sync();
    // Ensure-all alone: the first sweep after the start checks every volume in use (so would one
    // after the watch lost events); with the watch, later ones with nothing changed check none.
    let none = std::collections::HashSet::new();
    let t = Instant::now();
    let failed = provider.ensure_in_use(&none).await;
    let full_sweep = t.elapsed();
    ensure!(failed.is_empty(), "the first sweep failed: {failed:?}");
    let mut idle_sweeps = Samples::new();
    for _ in 0..PUBLISHES {
        let t = Instant::now();
        provider.ensure_in_use(&none).await;
        idle_sweeps.push(t.elapsed());
    }
    let mut publishes = Samples::new();
    let mut pfcs = Samples::new();
    for i in 0..PUBLISHES {
        let c = format!("probe-a{i}");
        let t = Instant::now();
        provider.publish(&first, &c).await?;
        publishes.push(t.elapsed());
        provider.release(&first, &c).await?;
        let c = format!("probe-b{i}");
        let t = Instant::now();
        provider
            .publish_for_container(&c, std::slice::from_ref(&first))
            .await?;
        pfcs.push(t.elapsed());
        provider.release(&first, &c).await?;
    }
    Ok(HoldReport {
        volumes: ids.len(),
        setup_ms: setup.as_secs_f64() * 1e3,
        vm_rss_kib,
        vm_hwm_kib,
        plugin_rss_kib,
        mounts,
        scan_volumes,
        scan_p50_us: micros(scans.p50()),
        scan_p99_us: micros(scans.p99()),
        publish_p50_us: micros(publishes.p50()),
        publish_p99_us: micros(publishes.p99()),
        pfc_p50_us: micros(pfcs.p50()),
        pfc_p99_us: micros(pfcs.p99()),
        full_sweep_us: micros(full_sweep),
        idle_sweep_p50_us: micros(idle_sweeps.p50()),
        idle_sweep_p99_us: micros(idle_sweeps.p99()),
        watch: provider.mount_watch_mode().to_string(),
    })
}
