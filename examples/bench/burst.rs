//! Section 4: bursts of containers started at once through the isolator (prepare, launch, wait,
//! cleanup), each size's runs interleaved with the others', and the 256-vs-16 targets.
//!
//! Why interleaved: a run's cost depends on what ran before it on this machine, not only on its
//! own size. On the VM's journal-less ext4 every new inode costs more the more were deleted in
//! the last minutes (the allocator skips them), and every burst deletes some (the plugin's
//! targets, the renewed staging directories); the journals grow until their compaction. Run one
//! size after another (all of 16's runs, then all of 256's), the later size paid for the earlier
//! ones: `--bursts 16:5,256:2` gave 256 vs 16 96–107 %, `--bursts 256:2,16:5` 114–132 %, the same
//! code. So each size's runs are spread evenly through the section ([`schedule`]: run k of a
//! size with r runs at (2k+1)/2r of the way), and every size sees on average the same history.
//! What one run leaves behind does not favour the size that follows it: with a 300 ms pause
//! before every run, interleaved, 256 vs 16 stayed at 126–129 % (122 % three times without).
//! The sizes run the same number of launches by default (16 × 32, 64 × 8, 256 × 2: 512 each),
//! so each adds as much to that history.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};

use csi_isolator::isolator::{ContainerConfig, VolumeIsolator};
use csi_isolator::launcher::{self, LaunchSpec};
use csi_isolator::mount::{LinuxSyscall, ProcMountTable};
use csi_isolator::provider::{Manager, StorageProvider};
use csi_isolator::resource::{Resource, VolumeMode};
use csi_isolator_testing::Sandbox;

use crate::stats::{fmt_dur, verdict, Samples};
use crate::{progress, Plan, Vol};

/// One row of section 4: every run of one burst size.
#[derive(Debug)]
pub struct ConcRow {
    label: String,
    containers: usize,
    runs: usize,
    throughput: f64,
    latency: Samples,
    /// fsync/fdatasync/syncfs calls of this process (the isolator's and the provider's
    /// checkpoints and journals) per container launch, over all of its runs.
    fsyncs: f64,
    /// Of those: the provider's journal batches, the isolator's, and the rest (state files,
    /// directories, compactions), per launch.
    by_source: (f64, f64, f64),
    /// The plugin's own, in its process (its report, `--report-syncs`), per launch; `None`
    /// when it could not be asked.
    plugin_fsyncs: Option<f64>,
}

/// The order of section 4's runs: for each run, the index in `sizes` (CONTAINERS, RUNS) of the
/// size it runs. Run k (from 0) of a size with r runs takes its place at (2k+1)/2r of the way
/// through the section. Ties before the middle go to the size listed first, after it to the
/// size listed last, so that the order mirrors around the middle (`16:2,256:2` runs 16, 256,
/// 256, 16); sizes tied at the middle itself (each with an odd number of runs) keep their
/// listed order. Each size appears exactly its RUNS times, and, but for those, its runs' mean
/// place is the middle of the section, whatever the others'.
pub fn schedule(sizes: &[(usize, usize)]) -> Vec<usize> {
    // (numerator, denominator, size index): (2k+1)/(2r), compared exactly.
    let mut slots: Vec<(u128, u128, usize)> = sizes
        .iter()
        .enumerate()
        .flat_map(|(i, &(_, runs))| {
            (0..runs).map(move |k| (2 * k as u128 + 1, 2 * runs as u128, i))
        })
        .collect();
    slots.sort_by(|a, b| {
        (a.0 * b.1).cmp(&(b.0 * a.1)).then_with(|| {
            // Tied: at the same place, so the same side of the middle.
            if 2 * a.0 > a.1 {
                b.2.cmp(&a.2)
            } else {
                a.2.cmp(&b.2)
            }
        })
    });
    slots.into_iter().map(|(_, _, i)| i).collect()
}

/// The syncs the bundled plugin reports having made (GetPluginInfo's manifest, when it runs
/// with `--report-syncs`).
async fn plugin_syncs(provider: &StorageProvider) -> Option<u64> {
    let info = provider
        .client()
        .get_plugin_info(csi_isolator::csi::proto::GetPluginInfoRequest {})
        .await
        .ok()?;
    info.manifest
        .get(csi_isolator::provider::bundled::SYNCS_KEY)?
        .parse()
        .ok()
}

/// One container through the whole pipeline (without `launch`: prepared and cleaned up, no
/// namespace, no workload); returns when it is cleaned up.
async fn container(
    isolator: Arc<VolumeIsolator>,
    id: String,
    config: ContainerConfig,
    start: Arc<tokio::sync::Barrier>,
    launch: bool,
) -> Result<Instant> {
    start.wait().await;
    let sandbox = config.sandbox.clone();
    let rootfs = config.rootfs.clone();
    let info = isolator
        .prepare(&id, config)
        .await
        .with_context(|| format!("prepare {id}"))?;
    let spec = LaunchSpec {
        argv: vec![OsString::from("/bin/true")],
        sandbox,
        rootfs,
        mounts: info.mounts,
        ..Default::default()
    };
    let ran = async {
        if !launch {
            return anyhow::Ok(());
        }
        let mut launched = tokio::task::spawn_blocking(move || {
            launcher::launch(&csi_isolator::mount::LinuxSyscall::new(), &spec)
        })
        .await
        .context("launch thread")?
        .with_context(|| format!("launch {id}"))?;
        let status = launched.wait_async().await?;
        ensure!(status.success(), "/bin/true in {id}: {status}");
        anyhow::Ok(())
    }
    .await;
    let cleaned = isolator
        .cleanup(&id)
        .await
        .with_context(|| format!("cleanup {id}"));
    ran?;
    cleaned?;
    Ok(Instant::now())
}

/// What every burst of section 4 runs through.
struct Bursts<'a> {
    plan: &'a Plan,
    isolator: Arc<VolumeIsolator>,
    provider: &'a StorageProvider,
    sandbox: &'a Sandbox,
    /// The workloads' rootfs (`None`: on the host's paths).
    rootfs: Option<PathBuf>,
}

/// What the runs of one size have measured so far.
struct Tally {
    containers: usize,
    runs: usize,
    latency: Samples,
    wall: Duration,
    syncs: u64,
    provider_journal: u64,
    isolator_journal: u64,
    /// `None` once the plugin could not say, for one run.
    plugin: Option<u64>,
}

impl Tally {
    fn new(containers: usize) -> Tally {
        Tally {
            containers,
            runs: 0,
            latency: Samples::new(),
            wall: Duration::ZERO,
            syncs: 0,
            provider_journal: 0,
            isolator_journal: 0,
            plugin: Some(0),
        }
    }

    fn row(self, label: &str) -> ConcRow {
        let launches = (self.containers * self.runs) as f64;
        let per_launch = |n: u64| n as f64 / launches;
        let rest = self.syncs - self.provider_journal - self.isolator_journal;
        ConcRow {
            label: label.to_string(),
            containers: self.containers,
            runs: self.runs,
            throughput: launches / self.wall.as_secs_f64(),
            latency: self.latency,
            fsyncs: per_launch(self.syncs),
            by_source: (
                per_launch(self.provider_journal),
                per_launch(self.isolator_journal),
                per_launch(rest),
            ),
            plugin_fsyncs: self.plugin.map(per_launch),
        }
    }
}

/// One burst: `tally.containers` containers started at once; container j gets `volume(j)` (of
/// the provider); each one's workload launched as the plan says. Adds what it measured to
/// `tally`.
async fn burst(
    on: &Bursts<'_>,
    label: &str,
    tally: &mut Tally,
    volume: &impl Fn(usize) -> Resource,
) -> Result<()> {
    let Bursts {
        plan,
        isolator,
        provider,
        sandbox,
        rootfs,
    } = on;
    let (n, run) = (tally.containers, tally.runs);
    let f0 = csi_isolator::durable::syncs();
    let (p0, i0) = (provider.journal_batches(), isolator.journal_batches());
    let plugin0 = plugin_syncs(provider).await;
    let start = Arc::new(tokio::sync::Barrier::new(n + 1));
    let mut tasks = Vec::with_capacity(n);
    for j in 0..n {
        let id = format!("{label}-{n}-r{run}-{j}");
        let dir = sandbox.mkdir(format!("sandboxes/{id}"));
        let config = ContainerConfig {
            resources: vec![volume(j).with_volume("data", VolumeMode::Rw)],
            sandbox: dir,
            rootfs: rootfs.clone(),
            user: None,
        };
        tasks.push(tokio::spawn(container(
            isolator.clone(),
            id,
            config,
            start.clone(),
            plan.launch_in_burst,
        )));
    }
    let t0 = Instant::now();
    start.wait().await;
    let mut last = t0;
    let mut first_err = None;
    for t in tasks {
        match t.await.context("container task")? {
            Ok(done) => {
                tally.latency.push(done - t0);
                last = last.max(done);
            }
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    tally.wall += last - t0;
    tally.runs += 1;
    tally.syncs += csi_isolator::durable::syncs() - f0;
    tally.provider_journal += provider.journal_batches() - p0;
    tally.isolator_journal += isolator.journal_batches() - i0;
    let plugin1 = plugin_syncs(provider).await;
    tally.plugin = tally
        .plugin
        .zip(plugin0.zip(plugin1))
        .map(|(sum, (a, b))| sum + (b - a));
    Ok(())
}

/// Every run of `sizes` (CONTAINERS, RUNS), in [`schedule`]'s order; one row per size, in
/// `sizes`' order.
async fn bursts(
    on: &Bursts<'_>,
    label: &str,
    sizes: &[(usize, usize)],
    volume: impl Fn(usize) -> Resource,
) -> Result<Vec<ConcRow>> {
    let mut tallies: Vec<Tally> = sizes.iter().map(|&(n, _)| Tally::new(n)).collect();
    for i in schedule(sizes) {
        burst(on, label, &mut tallies[i], &volume).await?;
    }
    Ok(tallies.into_iter().map(|t| t.row(label)).collect())
}

/// Section 4: one untimed container, the plan's sizes each container with its own volume
/// (interleaved), then the shared volume's bursts.
pub async fn measure(
    plan: &Plan,
    provider: &Arc<StorageProvider>,
    pool: &[Vol],
    work: &Path,
    sandbox: &Sandbox,
) -> Result<Vec<ConcRow>> {
    let mut manager = Manager::new();
    manager.add(provider.clone());
    let isolator = Arc::new(VolumeIsolator::new(
        work,
        Arc::new(manager),
        Arc::new(LinuxSyscall::new()),
        Arc::new(ProcMountTable::new()),
    ));
    let rootfs = plan
        .burst_in_rootfs
        .then(|| csi_isolator_testing::busybox_rootfs(sandbox, "burst-rootfs"));
    let on = Bursts {
        plan,
        isolator,
        provider,
        sandbox,
        rootfs,
    };
    bursts(&on, "warmup", &[(1, 1)], |_| pool[0].resource.clone()).await?;
    let sizes: Vec<String> = plan
        .concurrency
        .iter()
        .map(|(n, runs)| format!("{n} x {runs}"))
        .collect();
    progress(&format!(
        "  containers x runs, own volume each, interleaved: {}",
        sizes.join(", ")
    ));
    let mut rows = bursts(&on, "own", &plan.concurrency, |j| pool[j].resource.clone()).await?;
    let (n, runs) = plan.shared;
    progress(&format!(
        "  {n} containers x {runs} runs, one shared volume"
    ));
    rows.extend(bursts(&on, "shared", &[plan.shared], |_| pool[0].resource.clone()).await?);
    let left = provider
        .volumes()
        .await
        .into_iter()
        .filter(|r| !r.users.is_empty())
        .count();
    if left != 0 {
        bail!("{left} volumes still have users after the concurrency runs");
    }
    Ok(rows)
}

/// Prints section 4 and adds its judged targets to `targets`.
pub fn print(plan: &Plan, conc: &[ConcRow], targets: &mut Vec<(String, String, bool)>) {
    if plan.launch_in_burst {
        let workload = if plan.burst_in_rootfs {
            "/bin/true pivoted into a busybox rootfs"
        } else {
            "/bin/true on the host's paths (--burst-host-paths)"
        };
        println!("4. CONCURRENCY: containers started at once; each: isolator.prepare (publish) + launch {workload} + wait + isolator.cleanup (unpublish)");
    } else {
        println!("4. CONCURRENCY WITHOUT THE LAUNCH (--burst-without-launch): containers started at once; each: isolator.prepare (publish) + isolator.cleanup (unpublish); no namespace, no workload; the targets are not judged");
    }
    // Without the launch, the targets are printed but not judged.
    let mut judged_here = Vec::new();
    let judged = |ok: bool| {
        if plan.launch_in_burst {
            verdict(ok).to_string()
        } else {
            "not judged (no launch)".to_string()
        }
    };
    println!(
        "  {:<12} {:>4} {:>9} {:>11} {:>9} {:>9} {:>13} {:>20} {:>7}",
        "containers",
        "runs",
        "volumes",
        "launches/s",
        "p50 lat",
        "p99 lat",
        "fsyncs/launch",
        "prov.j/isol.j/other",
        "plugin"
    );
    for r in conc {
        let volumes = if r.label == "shared" {
            "1 shared".to_string()
        } else {
            "own each".to_string()
        };
        let (pj, ij, other) = r.by_source;
        println!(
            "  {:<12} {:>4} {:>9} {:>11.1} {:>9} {:>9} {:>13.2} {:>20} {:>7}",
            r.containers,
            r.runs,
            volumes,
            r.throughput,
            fmt_dur(r.latency.p50()),
            fmt_dur(r.latency.p99()),
            r.fsyncs,
            format!("{pj:.2}/{ij:.2}/{other:.2}"),
            r.plugin_fsyncs
                .map_or("?".to_string(), |p| format!("{p:.2}"))
        );
    }
    println!("  (latency: from the burst's start to that container's cleanup done; launches/s: containers / wall time;");
    println!("   the sizes' runs interleaved, each size's spread evenly through the section)");
    println!("  (fsyncs/launch: the isolator's and the provider's together, this process, journal batches shared;");
    println!("   by source: the provider's journal batches / the isolator's / the rest (state files, directories,");
    println!("   compactions); plugin: the bundled plugin's own, in its process, as it reports them, not in the total)");
    if let Some(c256) = conc
        .iter()
        .find(|r| r.label == "own" && r.containers == 256)
    {
        let ok = c256.fsyncs <= 1.5;
        println!(
            "  fsyncs per launch at 256: {:.2}   target <= 1.5: {}   (the plugin's own, apart: {})",
            c256.fsyncs,
            judged(ok),
            c256.plugin_fsyncs
                .map_or("not reported".to_string(), |p| format!("{p:.2}"))
        );
        judged_here.push((
            "fsyncs per launch at 256 (isolator + provider) <= 1.5".into(),
            format!("{:.2}", c256.fsyncs),
            ok,
        ));
    }
    let own = |n: usize| conc.iter().find(|r| r.label == "own" && r.containers == n);
    if let (Some(c16), Some(c256)) = (own(16), own(256)) {
        let r = c256.throughput / c16.throughput;
        println!(
            "  throughput 256 vs 16: {:.0}%   target >= 100%: {}",
            r * 100.0,
            judged(r >= 1.0)
        );
        judged_here.push((
            "256 concurrent >= 100% of the throughput of 16".into(),
            format!("{:.0}%", r * 100.0),
            r >= 1.0,
        ));
    }
    if plan.launch_in_burst {
        targets.extend(judged_here);
    }
}

#[cfg(test)]
mod tests {
    use super::schedule;

    /// Each size's places in the schedule (0-based positions of its runs).
    fn places(order: &[usize], size: usize) -> Vec<usize> {
        (0..order.len()).filter(|&p| order[p] == size).collect()
    }

    /// Every run once; each size's mean place the middle (no size ties at the middle here).
    fn assert_centred(sizes: &[(usize, usize)]) {
        let order = schedule(sizes);
        assert_eq!(order.len(), sizes.iter().map(|&(_, r)| r).sum::<usize>());
        let middle = (order.len() - 1) as f64 / 2.0;
        for (i, &(_, runs)) in sizes.iter().enumerate() {
            let at = places(&order, i);
            assert_eq!(at.len(), runs, "size {i}");
            let mean = at.iter().sum::<usize>() as f64 / runs as f64;
            assert!(
                (mean - middle).abs() < 1e-9,
                "{sizes:?}: size {i}'s mean place {mean}, the middle {middle}: {order:?}"
            );
        }
    }

    #[test]
    fn every_run_is_scheduled_once_and_each_size_centred() {
        // The full plan's, without ties; then ties before and after the middle.
        assert_centred(&[(1, 20), (16, 32), (64, 8), (256, 2)]);
        assert_centred(&[(16, 2), (256, 2)]);
        assert_centred(&[(16, 4), (64, 4), (256, 2)]);
        assert_centred(&[(16, 32), (256, 2)]);
    }

    #[test]
    fn the_default_bursts_put_256_in_each_half_of_16s_runs() {
        let order = schedule(&[(16, 32), (256, 2)]);
        let big = places(&order, 1);
        let small = places(&order, 0);
        // 256's two runs at 1/4 and 3/4: 8 of 16's runs before the first, 16 between, 8 after.
        assert_eq!(small.iter().filter(|&&p| p < big[0]).count(), 8);
        assert_eq!(small.iter().filter(|&&p| p > big[1]).count(), 8);
    }

    #[test]
    fn ties_mirror_around_the_middle() {
        assert_eq!(schedule(&[(16, 2), (256, 2)]), vec![0, 1, 1, 0]);
        assert_eq!(schedule(&[(256, 2), (16, 2)]), vec![0, 1, 1, 0]);
        // At the middle itself: listed order (the quick plan's).
        assert_eq!(
            schedule(&[(1, 3), (16, 1), (64, 1), (256, 1)]),
            vec![0, 0, 1, 2, 3, 0]
        );
        assert_eq!(schedule(&[(16, 2), (256, 1)]), vec![0, 1, 0]);
        assert_eq!(schedule(&[(16, 3)]), vec![0, 0, 0]);
        assert!(schedule(&[]).is_empty());
    }
}
