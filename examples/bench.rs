//! `cargo run --release --example bench [-- --quick]`: what publishing and
//! launching cost, next to the least they could cost, on this machine.
//!
//! One run prints, with the machine at the top:
//! 1. the floor: the CSI RPCs of a publish issued back to back by the raw
//!    generated clients straight to a `csi-test-plugin`, plus one fsync;
//! 2. publish through the provider, cold and warm, per volume, with its
//!    ratio to the floor and its fsyncs and durable writes;
//! 3. launching `/bin/true` in a new mount namespace with 0, 1, 8, 64 volumes;
//! 4. 1 to 256 containers at once through the isolator (prepare, launch,
//!    wait, cleanup), each with its own volume, and 64 sharing one;
//! 5. a serve-like child process holding 1,000 published volumes: its RSS
//!    and the latency of a status scan;
//! 6. what the default (loop) backing costs beside the directory backing:
//!    `csi-isolator run` with a new volume and with an existing one;
//! 7. node scale: a real `serve` and a real `docker-plugin` holding 1,000 and
//!    `--node-scale` (10,000) volumes on the directory backing, and
//!    `--node-scale-loop` (1,000) on the loop backing: RSS, the `status` CLI,
//!    serve's restart after SIGKILL, and each figure's growth
//!    (`--node-scale-only`: this section alone);
//!
//! (`--burst-only`: section 4 alone; `--publish-only`: sections 1-2 alone.)
//!
//! and the targets with PASS or MISS. Everything lives in one unique temp
//! dir that is unmounted and removed at the end, on error and on Ctrl-C.
//! It needs root (mounts, mount namespaces).

#[path = "bench/backing.rs"]
mod backing;
#[path = "bench/burst.rs"]
mod burst;
#[path = "bench/docker_api.rs"]
mod docker_api;
#[path = "bench/floor.rs"]
mod floor;
#[path = "bench/hold.rs"]
mod hold;
#[path = "bench/machine.rs"]
mod machine;
#[path = "bench/scale.rs"]
mod scale;
#[path = "bench/serve.rs"]
mod serve;
#[path = "bench/stats.rs"]
mod stats;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use clap::Parser;
use futures::{StreamExt, TryStreamExt};
use tokio::io::AsyncBufReadExt;

use csi_isolator::isolator::targets::volume_mounts;
use csi_isolator::isolator::ContainerConfig;
use csi_isolator::launcher::{self, LaunchSpec};
use csi_isolator::mount::{MountTable, ProcMountTable};
use csi_isolator::provider::bundled::{bundled_config, bundled_plugin_path, BUNDLED_BINARY};
use csi_isolator::provider::checkpoint;
use csi_isolator::provider::{CreateSpec, StorageProvider, UnpublishPolicy};
use csi_isolator::resource::{Resource, VolumeMode};
use csi_isolator_testing::Sandbox;

use floor::Floor;
use hold::HoldReport;
use stats::{fmt_dur, ratio, verdict, Samples};

/// Capacity of every volume (directory backing: bookkeeping only).
const VOLUME_BYTES: u64 = 1 << 20;

/// The backing of sections 1-5: the directory backing, as in every run before the loop
/// backing became the default, so that the figures compare with the history; section 6
/// measures what the default (loop) backing costs beside it.
pub const BACKING: &str = "dir";

/// The plugin argument that selects [`BACKING`].
pub fn backing_arg() -> String {
    format!("--backing={BACKING}")
}

#[derive(Debug, Parser)]
#[command(
    name = "bench",
    about = "csi-isolator benchmark: publish vs. the raw CSI floor, launch with volumes, concurrency, \
             memory with 1,000 published volumes. Run as root.",
    after_help = "Example:\n  cargo run --release --example bench -- --quick"
)]
struct Args {
    /// Fewer iterations (a sanity run of well under a minute).
    #[arg(long)]
    quick: bool,
    /// The csi-test-plugin binary (default: next to this example's directory, built if missing).
    #[arg(long, env = "CSI_TEST_PLUGIN")]
    plugin: Option<PathBuf>,
    /// Volumes the serve-like child holds (default 1000).
    #[arg(long)]
    hold_volumes: Option<usize>,
    /// Volumes in use for the ensure-all-at-scale measure, beside --hold-volumes (default 10000;
    /// quick: 2000; 0: not measured).
    #[arg(long)]
    scale_volumes: Option<usize>,
    /// Section 7: the largest number of volumes serve and docker-plugin hold on the directory
    /// backing, beside 1,000 (default 10000; quick: 2000; 0: section 7 not run).
    #[arg(long)]
    node_scale: Option<usize>,
    /// Section 7: volumes on the loop backing (default 1000; quick: 200; 0: none). Each is a
    /// loop device and an ext4 mount, held twice (serve and docker-plugin), one point after another.
    #[arg(long)]
    node_scale_loop: Option<usize>,
    /// Run section 7 alone.
    #[arg(long)]
    node_scale_only: bool,
    /// Run section 4 (the concurrent launches) alone.
    #[arg(long, conflicts_with = "node_scale_only")]
    burst_only: bool,
    /// Run sections 1-2 (publish, cold and warm, against the floor) alone.
    #[arg(long, conflicts_with_all = ["node_scale_only", "burst_only"])]
    publish_only: bool,
    /// Section 4's bursts instead of the default ones, as CONTAINERS:RUNS,... (e.g. `16:64` or
    /// `16:32,256:2`), for profiling one size at a time. The sizes' runs are interleaved, each
    /// size's spread evenly through the section. The 256-vs-16 target is judged only when both
    /// sizes run.
    #[arg(long, value_parser = parse_burst, value_delimiter = ',')]
    bursts: Option<Vec<(usize, usize)>>,
    /// Section 4 without the launch: each container is prepared and cleaned up, but no
    /// namespace is made and no workload runs (what the isolator and its plugin cost alone).
    #[arg(long)]
    burst_without_launch: bool,
    /// Section 4's workloads on the host's paths (no rootfs: the launch copies the bench's whole
    /// mount namespace) instead of pivoted into a busybox rootfs, as an engine's containers are.
    #[arg(long)]
    burst_host_paths: bool,
    /// Internal: be the serve-like child holding N volumes.
    #[arg(long, hide = true)]
    hold: Option<usize>,
    /// Internal: the hold child's work dir.
    #[arg(long, hide = true)]
    hold_dir: Option<PathBuf>,
}

/// Iteration counts of one run.
#[derive(Clone, Debug)]
struct Plan {
    name: &'static str,
    cold: usize,
    warm: usize,
    launch: usize,
    /// (containers, runs)
    concurrency: Vec<(usize, usize)>,
    shared: (usize, usize),
    hold: usize,
    /// Volumes in use for the second ensure-all measure (0: none).
    scale: usize,
    /// Section 7's points: (volumes, backing), smallest first per backing.
    node_scale: Vec<(usize, &'static str)>,
    /// Section 7 alone.
    node_scale_only: bool,
    /// Section 4 alone.
    burst_only: bool,
    /// Sections 1-2 alone.
    publish_only: bool,
    /// Section 4 launches each container's workload (else prepare and cleanup only).
    launch_in_burst: bool,
    /// Section 4's workloads pivot into a busybox rootfs (else they run on the host's paths).
    burst_in_rootfs: bool,
}

impl Plan {
    fn new(args: &Args) -> Plan {
        let (quick, hold, scale) = (args.quick, args.hold_volumes, args.scale_volumes);
        let mut node_scale = Vec::new();
        let dir = args.node_scale.unwrap_or(if quick { 2000 } else { 10_000 });
        if dir > 0 {
            node_scale.extend([(dir.min(1000), "dir"), (dir, "dir")]);
        }
        let looped = args
            .node_scale_loop
            .unwrap_or(if quick { 200 } else { 1000 });
        if looped > 0 {
            node_scale.extend([(looped.min(1000), "loop"), (looped, "loop")]);
        }
        node_scale.dedup();
        let (node_scale_only, burst_only, publish_only) =
            (args.node_scale_only, args.burst_only, args.publish_only);
        let launch_in_burst = !args.burst_without_launch;
        let burst_in_rootfs = !args.burst_host_paths;
        let mut plan = if quick {
            Plan {
                name: "quick",
                cold: 30,
                warm: 60,
                launch: 30,
                concurrency: vec![(1, 3), (16, 1), (64, 1), (256, 1)],
                shared: (64, 1),
                hold: hold.unwrap_or(1000),
                scale: scale.unwrap_or(2000),
                node_scale,
                node_scale_only,
                burst_only,
                publish_only,
                launch_in_burst,
                burst_in_rootfs,
            }
        } else {
            Plan {
                name: "full",
                cold: 200,
                warm: 500,
                launch: 200,
                concurrency: vec![(1, 20), (16, 32), (64, 8), (256, 2)],
                shared: (64, 3),
                hold: hold.unwrap_or(1000),
                scale: scale.unwrap_or(10_000),
                node_scale,
                node_scale_only,
                burst_only,
                publish_only,
                launch_in_burst,
                burst_in_rootfs,
            }
        };
        if let Some(bursts) = &args.bursts {
            plan.concurrency = bursts.clone();
        }
        plan
    }

    fn max_containers(&self) -> usize {
        self.concurrency.iter().map(|(c, _)| *c).max().unwrap_or(1)
    }
}

/// One pair of `--bursts`: CONTAINERS:RUNS, each at least 1.
fn parse_burst(pair: &str) -> Result<(usize, usize), String> {
    let (containers, runs) = pair
        .split_once(':')
        .ok_or_else(|| format!("{pair:?}: expected CONTAINERS:RUNS, e.g. 16:5"))?;
    let number = |v: &str| match v.trim().parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("{pair:?}: {v:?} is not a count of at least 1")),
    };
    Ok((number(containers)?, number(runs)?))
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(count) = args.hold {
        let (Some(dir), Some(plugin)) = (args.hold_dir.clone(), args.plugin.clone()) else {
            eprintln!("bench --hold needs --hold-dir and --plugin");
            return ExitCode::from(2);
        };
        return match hold::main(count, dir, plugin) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("bench --hold: {e:#}");
                ExitCode::FAILURE
            }
        };
    }
    if !nix::unistd::geteuid().is_root() {
        eprintln!(
            "bench: must run as root: it mounts volumes, creates mount namespaces and runs a CSI \
             plugin (try: sudo -E cargo run --release --example bench)"
        );
        return ExitCode::from(2);
    }
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .init();
    let plan = Plan::new(&args);
    let plugin = match find_plugin(args.plugin.as_deref()) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("bench: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    let sandbox = Sandbox::new("bench");
    let root = sandbox.path().to_path_buf();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("bench: build the tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let outcome = rt.block_on(async {
        tokio::select! {
            r = run(&plan, &plugin, &sandbox) => r.map(|()| None),
            sig = interrupted() => Ok(Some(sig)),
        }
    });
    // Cancels whatever was still running (on error or signal), which drops
    // the providers and so kills their plugins.
    rt.shutdown_timeout(Duration::from_secs(5));
    // Kills what is left, unmounts everything under the temp dir, removes it.
    drop(sandbox);
    let left = ProcMountTable::new()
        .mounts_under(&root)
        .map(|m| m.len())
        .unwrap_or(usize::MAX);
    let cleaned = left == 0 && !root.exists();
    println!(
        "cleanup: {} ({} mounts left under {}, directory {})",
        if cleaned { "ok" } else { "INCOMPLETE" },
        left,
        root.display(),
        if root.exists() {
            "still there"
        } else {
            "removed"
        }
    );
    match outcome {
        Ok(None) if cleaned => ExitCode::SUCCESS,
        Ok(None) => ExitCode::FAILURE,
        Ok(Some(sig)) => {
            eprintln!("bench: interrupted by {sig}; cleaned up");
            ExitCode::from(130)
        }
        Err(e) => {
            eprintln!("bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn interrupted() -> &'static str {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut int), Ok(mut term)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = int.recv() => "SIGINT",
        _ = term.recv() => "SIGTERM",
    }
}

/// The plugin binary: given, or next to this example's directory (built
/// with cargo first when missing or older than this binary).
fn find_plugin(given: Option<&Path>) -> Result<PathBuf> {
    if let Some(p) = given {
        ensure!(p.is_file(), "plugin {} is not a file", p.display());
        return Ok(p.to_path_buf());
    }
    let mtime = |p: &Path| p.metadata().and_then(|m| m.modified()).ok();
    let exe = std::env::current_exe().context("find this executable")?;
    let found = bundled_plugin_path();
    let stale = match &found {
        None => true,
        Some(p) => mtime(p) < mtime(&exe),
    };
    if stale {
        if let Some(cargo) = std::env::var_os("CARGO") {
            let mut cmd = std::process::Command::new(cargo);
            cmd.args([
                "build",
                "--quiet",
                "--workspace",
                "--bin",
                BUNDLED_BINARY,
                "--bin",
                "csi-isolator",
                "--manifest-path",
            ])
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml"));
            if !cfg!(debug_assertions) {
                cmd.arg("--release");
            }
            eprintln!("bench: building {BUNDLED_BINARY} ({cmd:?})");
            match cmd.status() {
                Ok(s) if s.success() => {}
                Ok(s) => eprintln!("bench: building {BUNDLED_BINARY} failed ({s})"),
                Err(e) => eprintln!("bench: cannot run cargo: {e}"),
            }
        }
    }
    bundled_plugin_path().with_context(|| {
        format!(
            "{BUNDLED_BINARY} not found next to {}: run `cargo build --release -p {BUNDLED_BINARY}` \
             or set CSI_TEST_PLUGIN",
            exe.display()
        )
    })
}

/// Prints a progress line on stderr.
fn progress(text: &str) {
    eprintln!("bench: {text}");
}

async fn start_provider(
    plugin: &Path,
    work: &Path,
    name: &str,
    policy: UnpublishPolicy,
    sandbox: &Sandbox,
) -> Result<Arc<StorageProvider>> {
    let mut config = bundled_config(
        plugin,
        work,
        name,
        &[backing_arg(), "--report-syncs".to_string()],
    );
    config.policy = policy;
    config.socket_dir = sandbox.join("s");
    let provider = StorageProvider::start(config)
        .await
        .with_context(|| format!("start provider {name}"))?;
    if let Some(pid) = provider.plugin_pid() {
        sandbox.track(pid);
    }
    Ok(provider)
}

async fn stop_provider(provider: &StorageProvider, sandbox: &Sandbox) {
    let pid = provider.plugin_pid();
    provider.shutdown(Duration::from_secs(5)).await;
    if let Some(pid) = pid {
        sandbox.untrack(pid);
    }
}

/// A volume of the provider: its id and the resource that hands it out.
#[derive(Clone, Debug)]
struct Vol {
    id: String,
    resource: Resource,
}

async fn create_pool(provider: &StorageProvider, prefix: &str, n: usize) -> Result<Vec<Vol>> {
    let mut vols: Vec<(usize, Vol)> = futures::stream::iter(0..n)
        .map(|i| async move {
            let name = format!("{prefix}-{i}");
            let resource = provider
                .create_volume(CreateSpec::new(&name, VOLUME_BYTES))
                .await
                .with_context(|| format!("create volume {name}"))?;
            let id = resource
                .source_id()
                .context("created resource without a volume id")?
                .to_string();
            anyhow::Ok((i, Vol { id, resource }))
        })
        .buffer_unordered(8)
        .try_collect()
        .await?;
    vols.sort_by_key(|(i, _)| *i);
    Ok(vols.into_iter().map(|(_, v)| v).collect())
}

/// Sections 1 and 2.
#[derive(Debug, Default)]
struct PublishResults {
    floor_cold: Samples,
    floor_warm: Samples,
    cold: Samples,
    warm: Samples,
    cold_fsyncs: f64,
    cold_writes: f64,
    warm_fsyncs: f64,
    warm_writes: f64,
}

/// Everything one run measured.
#[derive(Debug)]
struct Results {
    publish: PublishResults,
    launch: Vec<(usize, Samples)>,
    conc: Vec<burst::ConcRow>,
    held: HoldReport,
    /// The same child with [`Plan::scale`] volumes (`None`: not measured).
    scaled: Option<HoldReport>,
    served: std::result::Result<serve::ServeReport, String>,
    backing: backing::BackingReport,
    /// Section 7's points.
    node: Vec<scale::Point>,
}

async fn run(plan: &Plan, plugin: &Path, sandbox: &Sandbox) -> Result<()> {
    let work = sandbox.mkdir("work");
    let started = Instant::now();
    let header = format!(
        "csi-isolator benchmark ({} run{})\n{}\nplugin: {} (directory backing); every volume {} MiB",
        plan.name,
        if cfg!(debug_assertions) {
            ", DEBUG BUILD: not representative"
        } else {
            ""
        },
        machine::describe(&work),
        plugin.display(),
        VOLUME_BYTES >> 20
    );
    progress(&format!("temp dir {}", sandbox.path().display()));
    let serve_bin = plugin.with_file_name("csi-isolator");
    if plan.node_scale_only {
        let node = measure_node_scale(plan, &serve_bin, sandbox).await?;
        let rule = "-".repeat(112);
        println!("{rule}\n{header}\n{rule}");
        let mut targets = Vec::new();
        scale::print(&node, &mut targets);
        print_targets(plan, &targets, started.elapsed());
        println!("{rule}");
        return Ok(());
    }

    if plan.burst_only {
        let provider =
            start_provider(plugin, &work, "cold", UnpublishPolicy::LastUse, sandbox).await?;
        progress(&format!(
            "creating {} volumes (not timed)",
            plan.max_containers()
        ));
        let pool = create_pool(&provider, "vol", plan.max_containers()).await?;
        progress("[4/7] concurrent containers through the isolator");
        let conc = burst::measure(plan, &provider, &pool, &work, sandbox).await?;
        stop_provider(&provider, sandbox).await;
        let rule = "-".repeat(112);
        println!("{rule}\n{header}\n{rule}");
        let mut targets = Vec::new();
        burst::print(plan, &conc, &mut targets);
        print_targets(plan, &targets, started.elapsed());
        println!("{rule}");
        return Ok(());
    }

    let cold = start_provider(plugin, &work, "cold", UnpublishPolicy::LastUse, sandbox).await?;
    let warm = start_provider(plugin, &work, "warm", UnpublishPolicy::Keep, sandbox).await?;
    let mut floor = Floor::start(plugin, &sandbox.join("floor"), sandbox).await?;

    let pool_size = if plan.publish_only {
        plan.cold + 1
    } else {
        (plan.cold + 1).max(plan.max_containers()).max(64)
    };
    progress(&format!("creating {pool_size} volumes (not timed)"));
    let pool = create_pool(&cold, "vol", pool_size).await?;

    progress(&format!(
        "[1-2/7] publish: {} cold, {} warm, floor and provider interleaved",
        plan.cold, plan.warm
    ));
    let publish = measure_publish(plan, &cold, &warm, &mut floor, &pool).await?;
    let floor_pid = floor.pid();
    floor.stop().await;
    sandbox.untrack(floor_pid);
    stop_provider(&warm, sandbox).await;
    if plan.publish_only {
        stop_provider(&cold, sandbox).await;
        let rule = "-".repeat(112);
        println!("{rule}\n{header}\n{rule}");
        let mut targets = Vec::new();
        print_publish(&publish, &mut targets);
        print_targets(plan, &targets, started.elapsed());
        println!("{rule}");
        return Ok(());
    }

    progress(&format!(
        "[3/7] launch /bin/true with 0, 1, 8, 64 volumes, {} each",
        plan.launch
    ));
    let launch = measure_launch(plan, &cold, &pool, &work, sandbox).await?;

    progress("[4/7] concurrent containers through the isolator");
    let conc = burst::measure(plan, &cold, &pool, &work, sandbox).await?;
    stop_provider(&cold, sandbox).await;

    progress(&format!(
        "[5/7] serve-like child holding {} published volumes",
        plan.hold
    ));
    let held = measure_hold(plan.hold, plugin, sandbox).await?;
    let scaled = if plan.scale > 0 {
        progress(&format!(
            "  ensure-all at scale: serve-like child holding {} published volumes",
            plan.scale
        ));
        Some(measure_hold(plan.scale, plugin, sandbox).await?)
    } else {
        None
    };
    let served = if serve::available(&serve_bin) {
        progress(&format!(
            "  optional: csi-isolator serve with {} volumes prepared through its socket",
            plan.hold
        ));
        serve::measure(&serve_bin, &sandbox.join("serve"), plan.hold, sandbox)
            .await
            .map_err(|e| format!("{e:#}"))
    } else {
        Err(format!("{} has no serve verb", serve_bin.display()))
    };

    let runs = if plan.name == "quick" { 5 } else { 20 };
    progress(&format!(
        "[6/7] backing cost: {runs} first and {runs} later `csi-isolator run`s per backing"
    ));
    let backing = backing::measure(&serve_bin, &sandbox.join("backing"), runs)?;
    let node = measure_node_scale(plan, &serve_bin, sandbox).await?;

    let results = Results {
        publish,
        launch,
        conc,
        held,
        scaled,
        served,
        backing,
        node,
    };
    print_report(&header, plan, &results, started.elapsed());
    Ok(())
}

async fn measure_publish(
    plan: &Plan,
    cold: &StorageProvider,
    warm: &StorageProvider,
    floor: &mut Floor,
    pool: &[Vol],
) -> Result<PublishResults> {
    let mut r = PublishResults::default();
    let mut floor_vols = Vec::with_capacity(plan.cold + 1);
    for i in 0..=plan.cold {
        floor_vols.push(floor.create(&format!("floor-{i}"), VOLUME_BYTES).await?);
    }
    // One untimed round of each first (connections, page cache, directories).
    floor.cold(&mut floor_vols[plan.cold]).await?;
    let v = &pool[plan.cold];
    cold.publish(&v.id, "cold-warmup").await?;
    cold.release(&v.id, "cold-warmup").await?;

    let (mut fsyncs, mut writes) = (0, 0);
    for i in 0..plan.cold {
        r.floor_cold.push(floor.cold(&mut floor_vols[i]).await?);
        let v = &pool[i];
        let container = format!("cold-{i}");
        let (f0, w0) = (csi_isolator::durable::syncs(), checkpoint::durable_writes());
        let t0 = Instant::now();
        cold.publish(&v.id, &container)
            .await
            .with_context(|| format!("publish {} (cold)", v.id))?;
        r.cold.push(t0.elapsed());
        fsyncs += csi_isolator::durable::syncs() - f0;
        writes += checkpoint::durable_writes() - w0;
        cold.release(&v.id, &container).await?;
    }
    r.cold_fsyncs = fsyncs as f64 / plan.cold as f64;
    r.cold_writes = writes as f64 / plan.cold as f64;

    // Warm: the provider's volume was published and released under Keep
    // (still PUBLISHED, no user); the floor's volume is staged.
    let wv = create_pool(warm, "warm", 1).await?.remove(0);
    warm.publish(&wv.id, "warm-setup").await?;
    warm.release(&wv.id, "warm-setup").await?;
    let mut fv = floor.create("floor-warm", VOLUME_BYTES).await?;
    floor.stage(&mut fv).await?;
    floor.warm(&fv).await?;
    let (mut fsyncs, mut writes) = (0, 0);
    for i in 0..plan.warm {
        r.floor_warm.push(floor.warm(&fv).await?);
        let container = format!("warm-{i}");
        let (f0, w0) = (csi_isolator::durable::syncs(), checkpoint::durable_writes());
        let t0 = Instant::now();
        warm.publish(&wv.id, &container)
            .await
            .with_context(|| format!("publish {} (warm)", wv.id))?;
        r.warm.push(t0.elapsed());
        fsyncs += csi_isolator::durable::syncs() - f0;
        writes += checkpoint::durable_writes() - w0;
        warm.release(&wv.id, &container).await?;
    }
    r.warm_fsyncs = fsyncs as f64 / plan.warm as f64;
    r.warm_writes = writes as f64 / plan.warm as f64;
    floor.unstage(&fv).await?;
    // The keep policy left it published: unpublished and deleted, so that nothing stays
    // mounted when the sandbox checks for leftovers.
    warm.destroy_volume(&wv.id)
        .await
        .with_context(|| format!("destroy {} (warm)", wv.id))?;
    Ok(r)
}

/// The mounts of `vols` at `v0`, `v1`, ... in `sandbox`, the way `prepare` makes them.
fn launch_spec(vols: &[Vol], sandbox: &Path, work: &Path) -> Result<LaunchSpec> {
    let resources: Vec<Resource> = vols
        .iter()
        .enumerate()
        .map(|(i, v)| {
            v.resource
                .clone()
                .with_volume(&format!("v{i}"), VolumeMode::Rw)
        })
        .collect();
    let config = ContainerConfig {
        resources: resources.clone(),
        sandbox: sandbox.to_path_buf(),
        rootfs: None,
        user: None,
    };
    let mounts = volume_mounts("launch", &config, &resources, work)?;
    Ok(LaunchSpec {
        argv: vec![OsString::from("/bin/true")],
        sandbox: sandbox.to_path_buf(),
        mounts,
        ..Default::default()
    })
}

async fn measure_launch(
    plan: &Plan,
    provider: &StorageProvider,
    pool: &[Vol],
    work: &Path,
    sandbox: &Sandbox,
) -> Result<Vec<(usize, Samples)>> {
    const COUNTS: [usize; 4] = [0, 1, 8, 64];
    let holder = "launch-holder";
    let ids: Vec<String> = pool[..64].iter().map(|v| v.id.clone()).collect();
    provider.publish_for_container(holder, &ids).await?;
    let dir = sandbox.mkdir("sandboxes/launch");
    let specs: Vec<(usize, LaunchSpec)> = COUNTS
        .iter()
        .map(|&k| Ok((k, launch_spec(&pool[..k], &dir, work)?)))
        .collect::<Result<_>>()?;
    let n = plan.launch;
    let measured = tokio::task::spawn_blocking(move || -> Result<Vec<(usize, Samples)>> {
        let mut out: Vec<(usize, Samples)> = COUNTS.iter().map(|&k| (k, Samples::new())).collect();
        // Round 0 is a warm-up (it also creates the targets in the sandbox).
        for round in 0..=n {
            for (slot, (k, spec)) in specs.iter().enumerate() {
                let t0 = Instant::now();
                let mut launched =
                    launcher::launch(&csi_isolator::mount::LinuxSyscall::new(), spec)
                        .with_context(|| format!("launch with {k} volumes"))?;
                let status = launched.wait().context("wait for /bin/true")?;
                let took = t0.elapsed();
                ensure!(status.success(), "/bin/true with {k} volumes: {status}");
                if round > 0 {
                    out[slot].1.push(took);
                }
            }
        }
        Ok(out)
    })
    .await
    .context("launch thread")??;
    provider.release_container(holder).await?;
    Ok(measured)
}

async fn measure_hold(count: usize, plugin: &Path, sandbox: &Sandbox) -> Result<HoldReport> {
    let exe = std::env::current_exe().context("find this executable")?;
    let dir = sandbox.join(format!("hold-{count}"));
    let mut child = tokio::process::Command::new(exe)
        .arg("--hold")
        .arg(count.to_string())
        .arg("--hold-dir")
        .arg(&dir)
        .arg("--plugin")
        .arg(plugin)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .context("spawn the hold child")?;
    let pid = child.id().unwrap_or(0);
    sandbox.track(pid);
    let stdout = child.stdout.take().context("hold child stdout")?;
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let line = tokio::time::timeout(Duration::from_secs(600), lines.next_line())
        .await
        .context("the hold child did not report within 600 s")?
        .context("read the hold child's report")?;
    // Closing stdin lets it go; its mounts vanish with its namespace.
    drop(child.stdin.take());
    let status = match tokio::time::timeout(Duration::from_secs(15), child.wait()).await {
        Ok(s) => s.ok(),
        Err(_) => {
            let _ = child.kill().await;
            None
        }
    };
    sandbox.untrack(pid);
    let line =
        line.with_context(|| format!("the hold child exited without a report ({status:?})"))?;
    serde_json::from_str(&line).with_context(|| format!("parse the hold child's report: {line}"))
}

/// Ensure-all at scale: a launch (publish_for_container of a volume already published) against a
/// publish of a new user, with 1,000 and with [`Plan::scale`] volumes in use, and how the launch
/// grows from one to the other. Target (issue 16): at most twice the publish, at both sizes.
fn print_ensure_all(
    held: &HoldReport,
    scaled: Option<&HoldReport>,
    targets: &mut Vec<(String, String, bool)>,
) {
    let us = |v: f64| fmt_dur(Duration::from_secs_f64(v / 1e6));
    println!(
        "\nENSURE-ALL AT SCALE (serve-like child, every volume in use by its own container; watch: {})",
        held.watch
    );
    println!(
        "  {:>7}  {:>19}  {:>19}  {:>13}  {:>10}  {:>19}",
        "in use",
        "publish new user",
        "launch (ensure-all)",
        "ratio p50",
        "full sweep",
        "sweep, no change"
    );
    println!(
        "  {:>7}  {:>9} {:>9}  {:>9} {:>9}  {:>13}  {:>10}  {:>9} {:>9}",
        "", "p50", "p99", "p50", "p99", "(target ≤ 2×)", "(1st)", "p50", "p99"
    );
    let rows: Vec<&HoldReport> = std::iter::once(held).chain(scaled).collect();
    for r in &rows {
        let ratio = r.pfc_p50_us / r.publish_p50_us.max(1e-3);
        println!(
            "  {:>7}  {:>9} {:>9}  {:>9} {:>9}  {:>12.2}×  {:>10}  {:>9} {:>9}",
            r.volumes,
            us(r.publish_p50_us),
            us(r.publish_p99_us),
            us(r.pfc_p50_us),
            us(r.pfc_p99_us),
            ratio,
            us(r.full_sweep_us),
            us(r.idle_sweep_p50_us),
            us(r.idle_sweep_p99_us)
        );
        targets.push((
            format!("ensure-all with {} in use ≤ 2× a publish", r.volumes),
            format!("{ratio:.2}×"),
            ratio <= 2.0,
        ));
    }
    if let Some(big) = scaled {
        println!(
            "  growth {} → {} volumes in use: launch p50 ×{:.2}, p99 ×{:.2}; publish p50 ×{:.2}; sweep with no change p50 ×{:.2}; full sweep ×{:.2}",
            held.volumes,
            big.volumes,
            big.pfc_p50_us / held.pfc_p50_us.max(1e-3),
            big.pfc_p99_us / held.pfc_p99_us.max(1e-3),
            big.publish_p50_us / held.publish_p50_us.max(1e-3),
            big.idle_sweep_p50_us / held.idle_sweep_p50_us.max(1e-3),
            big.full_sweep_us / held.full_sweep_us.max(1e-3)
        );
    }
}

/// Issue 16's targets for a publish through the provider, as a ratio to its floor (p50).
const COLD_TARGET: f64 = 1.2;
const WARM_TARGET: f64 = 0.5;

/// Sections 1-2: the floor's and the provider's publishes, cold and warm, and their targets
/// (issue 16's: cold <= 1.2x its floor, warm <= 0.5x).
fn print_publish(p: &PublishResults, targets: &mut Vec<(String, String, bool)>) {
    println!("1-2. PUBLISH, per volume (latency of one call; fsyncs/writes: provider process only, per publish)");
    println!(
        "  {:<66} {:>5} {:>9} {:>9} {:>7} {:>7}",
        "", "n", "p50", "p99", "fsyncs", "writes"
    );
    let row = |label: &str, s: &Samples, fsyncs: &str, writes: &str| {
        println!(
            "  {:<66} {:>5} {:>9} {:>9} {:>7} {:>7}",
            label,
            s.len(),
            fmt_dur(s.p50()),
            fmt_dur(s.p99()),
            fsyncs,
            writes
        );
    };
    row(
        "floor cold: raw CtrlPublish+NodeStage+NodePublish, +1 fsync",
        &p.floor_cold,
        "1",
        "-",
    );
    row(
        "provider cold: publish(), volume CREATED -> PUBLISHED",
        &p.cold,
        &format!("{:.1}", p.cold_fsyncs),
        &format!("{:.1}", p.cold_writes),
    );
    let cold_ratio = ratio(p.cold.p50(), p.floor_cold.p50());
    println!(
        "  {:<66} {:>5} {:>8.2}x {:>8.2}x   target p50 <= {COLD_TARGET}x: {}",
        "  ratio cold / floor cold",
        "",
        cold_ratio,
        ratio(p.cold.p99(), p.floor_cold.p99()),
        verdict(cold_ratio <= COLD_TARGET)
    );
    row(
        "floor warm: raw NodePublish on a staged volume, +1 fsync",
        &p.floor_warm,
        "1",
        "-",
    );
    row(
        "provider warm: publish(), already PUBLISHED (policy keep), new user",
        &p.warm,
        &format!("{:.1}", p.warm_fsyncs),
        &format!("{:.1}", p.warm_writes),
    );
    let warm_ratio = ratio(p.warm.p50(), p.floor_warm.p50());
    println!(
        "  {:<66} {:>5} {:>8.2}x {:>8.2}x   target p50 <= {WARM_TARGET}x: {}",
        "  ratio warm / floor warm",
        "",
        warm_ratio,
        ratio(p.warm.p99(), p.floor_warm.p99()),
        verdict(warm_ratio <= WARM_TARGET)
    );
    println!("  (the plugin's own fsyncs, in its process, are part of both floor and provider RPCs and not counted)");
    targets.push((
        format!("warm publish <= {WARM_TARGET}x its floor (p50)"),
        format!("{warm_ratio:.2}x"),
        warm_ratio <= WARM_TARGET,
    ));
    targets.push((
        format!("cold publish <= {COLD_TARGET}x its floor (p50)"),
        format!("{cold_ratio:.2}x"),
        cold_ratio <= COLD_TARGET,
    ));
}

fn print_report(header: &str, plan: &Plan, results: &Results, elapsed: Duration) {
    let Results {
        publish: p,
        launch,
        conc,
        held,
        scaled,
        served,
        backing: backing_report,
        node,
    } = results;
    let mut targets: Vec<(String, String, bool)> = Vec::new();
    let rule = "-".repeat(112);
    println!("{rule}\n{header}\n{rule}");

    print_publish(p, &mut targets);

    println!("\n3. LAUNCH /bin/true in a new mount namespace, volumes bind-mounted into its sandbox (launch + wait)");
    println!(
        "  {:<20} {:>5} {:>9} {:>9} {:>14} {:>14}",
        "volumes", "n", "p50", "p99", "p50 vs 0 vol", "p99 vs 0 vol"
    );
    let base = &launch[0].1;
    for (k, s) in launch {
        println!(
            "  {:<20} {:>5} {:>9} {:>9} {:>13.2}x {:>13.2}x",
            k,
            s.len(),
            fmt_dur(s.p50()),
            fmt_dur(s.p99()),
            ratio(s.p50(), base.p50()),
            ratio(s.p99(), base.p99())
        );
    }
    let by = |k: usize| launch.iter().find(|(c, _)| *c == k).map(|(_, s)| s);
    if let (Some(one), Some(eight)) = (by(1), by(8)) {
        let r = ratio(eight.p50(), one.p50());
        println!(
            "  8 volumes vs 1: {r:.2}x (p50), {:.2}x (p99)   target p50 <= 2x: {}",
            ratio(eight.p99(), one.p99()),
            verdict(r <= 2.0)
        );
        targets.push((
            "launch with 8 volumes <= 2x with 1 (p50)".into(),
            format!("{r:.2}x"),
            r <= 2.0,
        ));
    }

    println!();
    burst::print(plan, conc, &mut targets);

    let mib = |kib: u64| kib as f64 / 1024.0;
    println!(
        "\n5. SERVE-LIKE PROCESS holding {} published volumes (child process: provider in process, managed plugin; own mount namespace)",
        held.volumes
    );
    println!(
        "  setup: {} creates + publishes (16 at a time) in {:.1} s; mount table then {} lines",
        held.volumes,
        held.setup_ms / 1e3,
        held.mounts
    );
    let rss_ok = mib(held.vm_rss_kib) < 50.0;
    println!(
        "  VmRSS {:.1} MiB (peak VmHWM {:.1} MiB); plugin VmRSS {:.1} MiB   target < 50 MiB: {}",
        mib(held.vm_rss_kib),
        mib(held.vm_hwm_kib),
        mib(held.plugin_rss_kib),
        verdict(rss_ok)
    );
    let us = |v: f64| fmt_dur(Duration::from_secs_f64(v / 1e6));
    println!(
        "  status scan (provider::status::scan, {} volumes mounted): p50 {}  p99 {}  (50 runs)",
        held.scan_volumes,
        us(held.scan_p50_us),
        us(held.scan_p99_us)
    );
    println!(
        "  with all {} in use: publish() new user p50 {} p99 {}; publish_for_container() (ensure-all) p50 {} p99 {}  (20 runs)",
        held.volumes,
        us(held.publish_p50_us),
        us(held.publish_p99_us),
        us(held.pfc_p50_us),
        us(held.pfc_p99_us)
    );
    targets.push((
        format!("{} published volumes under 50 MiB RSS", held.volumes),
        format!("{:.1} MiB", mib(held.vm_rss_kib)),
        rss_ok,
    ));
    match served {
        Ok(s) => println!(
            "  optional, real `csi-isolator serve` ({} volumes created + prepared via its socket in {:.1} s): \
             VmRSS {:.1} MiB (VmHWM {:.1} MiB)",
            s.volumes,
            s.setup.as_secs_f64(),
            mib(s.vm_rss_kib),
            mib(s.vm_hwm_kib)
        ),
        Err(e) => println!("  optional `csi-isolator serve`: not measured ({e})"),
    }
    if held.volumes < 1000 {
        println!("  (fewer than the 1,000 volumes of the target: --hold-volumes)");
    }
    print_ensure_all(held, scaled.as_ref(), &mut targets);
    backing::print(backing_report, &mut targets);
    scale::print(node, &mut targets);
    print_targets(plan, &targets, elapsed);
    println!("{rule}");
}

/// The targets' summary: each judged target, its figure and PASS or MISS.
fn print_targets(plan: &Plan, targets: &[(String, String, bool)], elapsed: Duration) {
    println!(
        "\nTARGETS ({} run, {:.0} s)",
        plan.name,
        elapsed.as_secs_f64()
    );
    for (what, value, pass) in targets {
        println!("  {:<54} {:>10}  {}", what, value, verdict(*pass));
    }
}

/// Section 7: every point of [`Plan::node_scale`], one after another, each under its own dir.
async fn measure_node_scale(
    plan: &Plan,
    bin: &Path,
    sandbox: &Sandbox,
) -> Result<Vec<scale::Point>> {
    let mut points = Vec::new();
    for &(volumes, backing) in &plan.node_scale {
        progress(&format!(
            "[7/7] node scale: serve and docker-plugin with {volumes} volumes on the {backing} backing"
        ));
        let dir = sandbox.join(format!("node-{backing}-{volumes}"));
        points.push(scale::measure(bin, &dir, volumes, backing, sandbox).await?);
        // Their files are not needed once measured (10,000 volumes' worth of directories).
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(points)
}
