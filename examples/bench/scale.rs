//! Node scale (issue 16): a real `csi-isolator serve` and a real `csi-isolator docker-plugin`
//! holding N published volumes each, N = 1,000 and 10,000, on the directory backing and on the
//! default (loop) one: their VmRSS/VmHWM, the wall time of the `csi-isolator status` CLI (the
//! default, the state scan alone, and `--stats`, every published volume's NodeGetVolumeStats), and
//! how long serve takes to answer again after a SIGKILL (its recovery of all N).
//!
//! Both run in one mount namespace held by a `sleep` child (a slave of the host's), so that
//! serve's mounts outlive the killed serve, as on a node, and the status CLI sees them; they all
//! vanish with that namespace at the end, and the self-clearing loop devices with them, which
//! [`measure`] checks.

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};

use csi_isolator::mount;
use csi_isolator::service::proto;
use csi_isolator_testing::Sandbox;

use crate::docker_api::{call_ok, fan_out, mount_id};
use crate::machine::status_kib;
use crate::serve;
use crate::stats::{fmt_dur, verdict, Samples};

/// Resident memory target of serve and docker-plugin at 10,000 volumes (issue 16).
const RSS_TARGET_MIB: f64 = 64.0;
/// `csi-isolator status` wall-time target (p50).
const STATUS_TARGET: Duration = Duration::from_millis(100);
/// Restart target: SIGKILL to answering again, every volume recovered.
const RESTART_TARGET: Duration = Duration::from_secs(2);
/// Runs of the status CLI per point.
const STATUS_RUNS: usize = 5;
/// Runs of `true` and of `unshare -m true` per point (a new mount namespace's cost).
const NEW_NS_RUNS: usize = 20;

/// One point: N volumes on one backing.
#[derive(Clone, Debug)]
pub struct Point {
    pub volumes: usize,
    pub backing: String,
    /// serve: N CreateVolume + Prepare over its socket, 16 at a time.
    pub serve_setup: Duration,
    pub serve_rss_kib: u64,
    pub serve_hwm_kib: u64,
    /// Wall time of `csi-isolator status --json` (the CLI process: the state scan, no RPC).
    pub status: Samples,
    /// The same with `--stats` (every published volume's NodeGetVolumeStats).
    pub status_stats: Samples,
    /// Volumes the last `--stats` run reported "stats unavailable" for (timed out).
    pub stats_unavailable: usize,
    /// Mounts in the namespace (every volume's staging and target, and the host's).
    pub mounts: usize,
    /// `unshare -m true` run in the namespace: a new mount namespace copied from it and torn
    /// down, as every container launch makes (this project's launcher, runc, any engine), with
    /// the process's start and exit.
    pub new_ns: Samples,
    /// `true` run in the namespace the same way: the process's start and exit alone.
    pub plain: Samples,
    /// SIGKILL of serve, then spawn to its first answered Recover.
    pub restart: Duration,
    /// serve's VmRSS after the restart.
    pub restarted_rss_kib: u64,
    /// docker-plugin: N Create + Mount over its socket, 16 at a time.
    pub docker_setup: Duration,
    pub docker_rss_kib: u64,
    pub docker_hwm_kib: u64,
}

/// The `sleep` child whose mount namespace serve, status and docker-plugin share.
struct Namespace {
    child: std::process::Child,
    ns: std::fs::File,
}

impl Namespace {
    fn new(sandbox: &Sandbox) -> Result<Namespace> {
        let mut cmd = std::process::Command::new("sleep");
        cmd.arg("infinity")
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        serve::in_namespace(&mut cmd, None);
        let child = cmd.spawn().context("spawn the namespace holder (sleep)")?;
        sandbox.track(child.id());
        let ns = std::fs::File::open(format!("/proc/{}/ns/mnt", child.id()))
            .context("open the holder's mount namespace")?;
        Ok(Namespace { child, ns })
    }

    /// The namespace's mount table.
    fn mountinfo(&self) -> Result<String> {
        std::fs::read_to_string(format!("/proc/{}/mountinfo", self.child.id()))
            .context("read the holder's mountinfo")
    }

    /// Mounts at or below `dir` in this namespace.
    fn mounts_under(&self, dir: &Path) -> Result<usize> {
        let text = self.mountinfo()?;
        let dir = dir.to_string_lossy();
        Ok(text
            .lines()
            .filter_map(|l| l.split(' ').nth(4))
            .filter(|p| p.starts_with(&*dir))
            .count())
    }

    /// Every mount of the namespace.
    fn mounts(&self) -> Result<usize> {
        Ok(self.mountinfo()?.lines().count())
    }

    fn end(mut self, sandbox: &Sandbox) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        sandbox.untrack(self.child.id());
    }
}

/// Measures one point under `dir` (created), leaving nothing mounted or attached.
pub async fn measure(
    bin: &Path,
    dir: &Path,
    volumes: usize,
    backing: &str,
    sandbox: &Sandbox,
) -> Result<Point> {
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    let ns = Namespace::new(sandbox)?;
    let result = measure_in(bin, dir, volumes, backing, &ns, sandbox).await;
    ns.end(sandbox);
    // The namespace's end unmounted everything; the loop devices clear themselves shortly after.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let left = mount::find_backed_under(dir).context("list loop devices")?;
        if left.is_empty() {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "{} loop devices backed under {} still attached 30 s after their namespace ended",
            left.len(),
            dir.display()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    result
}

async fn measure_in(
    bin: &Path,
    dir: &Path,
    volumes: usize,
    backing: &str,
    ns: &Namespace,
    sandbox: &Sandbox,
) -> Result<Point> {
    let serve_dir = dir.join("serve");
    let socket = serve_dir.join("isolator.sock");
    let args = [format!("--plugin-arg=--backing={backing}")];
    let logged =
        |e: anyhow::Error| e.context(format!("see {}", serve_dir.join("serve.log").display()));

    // serve: N volumes, each prepared for its own container.
    let mut child = serve::spawn(bin, &serve_dir, &socket, &args, Some(&ns.ns))?;
    let mut pid = child.id().context("serve pid")?;
    sandbox.track(pid);
    let (client, _) = serve::ready(
        &socket,
        &mut child,
        Duration::from_secs(30),
        proto::RecoverRequest::default(),
    )
    .await
    .map_err(logged)?;
    let t0 = Instant::now();
    serve::prepare_all(&client, &serve_dir, "n", volumes)
        .await
        .map_err(logged)?;
    let serve_setup = t0.elapsed();
    drop(client);
    let serve_rss_kib = status_kib(&pid.to_string(), "VmRSS:").context("serve's VmRSS")?;
    let serve_hwm_kib = status_kib(&pid.to_string(), "VmHWM:").unwrap_or(0);
    let published = ns.mounts_under(&serve_dir)?;
    ensure!(
        published >= volumes,
        "{published} mounts under {} for {volumes} prepared containers",
        serve_dir.display()
    );

    pause_for_profiling(&serve_dir, pid, ns).await?;

    // status: the CLI process, as an operator runs it, and with --stats.
    let work = serve_dir.join("work");
    let (status, _) = status_cli(bin, &work, volumes, &[], ns)?;
    let (status_stats, stats_unavailable) = status_cli(bin, &work, volumes, &["--stats"], ns)?;
    let mounts = ns.mounts()?;
    let (new_ns, plain) = new_namespace_cost(ns)?;

    // Restart: SIGKILL, then a new serve on the same work dir until it answers the
    // containerizer's Recover naming every container as still running.
    let known = proto::RecoverRequest {
        known_container_ids: (0..volumes).map(|i| serve::container_id("n", i)).collect(),
    };
    child.start_kill().context("SIGKILL serve")?;
    let _ = child.wait().await;
    sandbox.untrack(pid);
    let t0 = Instant::now();
    let mut child = serve::spawn(bin, &serve_dir, &socket, &args, Some(&ns.ns))?;
    pid = child.id().context("restarted serve pid")?;
    sandbox.track(pid);
    let (client, answer) = serve::ready(&socket, &mut child, Duration::from_secs(120), known)
        .await
        .map_err(logged)?;
    let restart = t0.elapsed();
    drop(client);
    ensure!(
        answer.recovered.len() == volumes,
        "serve recovered {} of {volumes} containers after the restart",
        answer.recovered.len()
    );
    let restarted_rss_kib = status_kib(&pid.to_string(), "VmRSS:").unwrap_or(0);
    pause_for_profiling(&serve_dir, pid, ns).await?;
    let still = ns.mounts_under(&serve_dir)?;
    ensure!(
        still >= volumes,
        "after the restart {still} mounts under {}, {volumes} before",
        serve_dir.display()
    );
    serve::stop(&mut child, pid, sandbox).await;

    // docker-plugin: N Create + Mount.
    let (docker_setup, docker_rss_kib, docker_hwm_kib) =
        docker_plugin(bin, &dir.join("docker"), volumes, backing, ns, sandbox).await?;

    Ok(Point {
        volumes,
        backing: backing.to_string(),
        serve_setup,
        serve_rss_kib,
        serve_hwm_kib,
        status,
        status_stats,
        stats_unavailable,
        mounts,
        new_ns,
        plain,
        restart,
        restarted_rss_kib,
        docker_setup,
        docker_rss_kib,
        docker_hwm_kib,
    })
}

/// What a new mount namespace costs in `ns`, as a container launch makes one: `unshare -m true`
/// and `true`, [`NEW_NS_RUNS`] of each, taken in turn, each spawned into `ns`; returns both.
fn new_namespace_cost(ns: &Namespace) -> Result<(Samples, Samples)> {
    let mut new_ns = Samples::new();
    let mut plain = Samples::new();
    for _ in 0..NEW_NS_RUNS {
        for (argv, into) in [
            (&["unshare", "-m", "true"][..], &mut new_ns),
            (&["true"][..], &mut plain),
        ] {
            let mut cmd = std::process::Command::new(argv[0]);
            cmd.args(&argv[1..])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped());
            serve::in_namespace(&mut cmd, Some(&ns.ns));
            let t = Instant::now();
            let out = cmd
                .output()
                .with_context(|| format!("run {}", argv.join(" ")))?;
            into.push(t.elapsed());
            ensure!(
                out.status.success(),
                "{}: {} ({})",
                argv.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
    }
    Ok((new_ns, plain))
}

/// With `CSI_BENCH_PAUSE=FILE` in the environment (for profiling `status` and a restart by
/// hand), creates FILE after a point's setup and again after its restart, says where everything
/// is, and waits (at most an hour) each time until FILE is removed.
async fn pause_for_profiling(serve_dir: &Path, pid: u32, ns: &Namespace) -> Result<()> {
    let Some(file) = std::env::var_os("CSI_BENCH_PAUSE") else {
        return Ok(());
    };
    let file = Path::new(&file);
    std::fs::write(file, b"").with_context(|| format!("create {}", file.display()))?;
    eprintln!(
        "paused: serve {pid} on {} in the mount namespace of pid {}; remove {} to go on",
        serve_dir.display(),
        ns.child.id(),
        file.display()
    );
    let deadline = Instant::now() + Duration::from_secs(3600);
    while file.exists() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Ok(())
}

/// [`STATUS_RUNS`] runs of `bin --work-dir WORK status --json EXTRA > FILE` in the namespace:
/// their wall times and how many volumes the last one had no stats for (none without
/// `--stats`). Each must list `volumes` volumes and exit 0 (every volume agrees with the mount
/// table). The report (megabytes at 10,000) goes to a file beside WORK, as an operator's
/// `> FILE` sends it, and is read after the clock stops: a pipe would time this process's own
/// reading of it too, on the same two cores.
fn status_cli(
    bin: &Path,
    work: &Path,
    volumes: usize,
    extra: &[&str],
    ns: &Namespace,
) -> Result<(Samples, usize)> {
    let mut times = Samples::new();
    let mut unavailable = 0;
    let report = work.with_file_name("status.json");
    for _ in 0..STATUS_RUNS {
        let file = std::fs::File::create(&report)
            .with_context(|| format!("create {}", report.display()))?;
        let mut cmd = std::process::Command::new(bin);
        cmd.arg("--work-dir")
            .arg(work)
            .args(["status", "--json"])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(file)
            .stderr(Stdio::piped());
        serve::in_namespace(&mut cmd, Some(&ns.ns));
        let t = Instant::now();
        let out = cmd.output().context("run csi-isolator status")?;
        times.push(t.elapsed());
        let stdout =
            std::fs::read(&report).with_context(|| format!("read {}", report.display()))?;
        ensure!(
            out.status.success(),
            "csi-isolator status {extra:?}: {} ({})",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
        let json: serde_json::Value =
            serde_json::from_slice(&stdout).context("parse status --json")?;
        let listed = json["volumes"].as_array().map_or(&[][..], |v| v.as_slice());
        ensure!(
            listed.len() == volumes,
            "status {extra:?} listed {} volumes, {volumes} prepared",
            listed.len()
        );
        unavailable = listed
            .iter()
            .filter(|v| v.get("stats_unavailable").is_some())
            .count();
    }
    Ok((times, unavailable))
}

/// docker-plugin in the namespace given `volumes` Creates and Mounts: the time, its VmRSS and
/// VmHWM; stopped with SIGTERM after.
async fn docker_plugin(
    bin: &Path,
    dir: &Path,
    volumes: usize,
    backing: &str,
    ns: &Namespace,
    sandbox: &Sandbox,
) -> Result<(Duration, u64, u64)> {
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    let socket = dir.join("csi-isolator.sock");
    let log_path = dir.join("docker-plugin.log");
    let log = std::fs::File::create(&log_path).context("create docker-plugin log")?;
    let mut cmd = tokio::process::Command::new(bin);
    cmd.arg("--work-dir")
        .arg(dir.join("work"))
        .arg("docker-plugin")
        .arg("--socket")
        .arg(&socket)
        .arg(format!("--plugin-arg=--backing={backing}"))
        .stdin(Stdio::null())
        .stdout(log.try_clone().context("dup docker-plugin log")?)
        .stderr(log)
        .kill_on_drop(true);
    serve::in_namespace(cmd.as_std_mut(), Some(&ns.ns));
    let mut child = cmd.spawn().context("spawn docker-plugin")?;
    let pid = child.id().context("docker-plugin pid")?;
    sandbox.track(pid);
    let result = async {
        let deadline = Instant::now() + Duration::from_secs(30);
        while call_ok(&socket, "Plugin.Activate", "{}").is_err() {
            ensure!(
                child.try_wait()?.is_none(),
                "docker-plugin exited before it answered"
            );
            ensure!(
                Instant::now() < deadline,
                "docker-plugin did not answer in 30 s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let t0 = Instant::now();
        let sock = socket.clone();
        tokio::task::spawn_blocking(move || {
            fan_out(volumes, 16, |i| {
                let name = format!("d{i}");
                call_ok(
                    &sock,
                    "VolumeDriver.Create",
                    &format!(r#"{{"Name":"{name}","Opts":{{"size":"1M"}}}}"#),
                )?;
                call_ok(
                    &sock,
                    "VolumeDriver.Mount",
                    &format!(r#"{{"Name":"{name}","ID":"{}"}}"#, mount_id(i)),
                )?;
                Ok(())
            })
        })
        .await
        .context("the docker-plugin clients")??;
        let setup = t0.elapsed();
        let rss = status_kib(&pid.to_string(), "VmRSS:").context("docker-plugin's VmRSS")?;
        let hwm = status_kib(&pid.to_string(), "VmHWM:").unwrap_or(0);
        anyhow::Ok((setup, rss, hwm))
    }
    .await;
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGTERM,
    );
    if tokio::time::timeout(Duration::from_secs(10), child.wait())
        .await
        .is_err()
    {
        let _ = child.kill().await;
    }
    sandbox.untrack(pid);
    result.with_context(|| format!("see {}", log_path.display()))
}

/// Prints the points, their targets and each figure's growth from the smallest to the largest
/// point of a backing.
pub fn print(points: &[Point], targets: &mut Vec<(String, String, bool)>) {
    if points.is_empty() {
        return;
    }
    let mib = |kib: u64| kib as f64 / 1024.0;
    println!(
        "\n7. NODE SCALE: real `serve` and `docker-plugin` holding N published volumes each (one shared mount namespace)"
    );
    println!(
        "  {:>6} {:>7}  {:>9} {:>16}  {:>9} {:>9}  {:>9} {:>9}  {:>9} {:>9}  {:>9} {:>16}",
        "N",
        "backing",
        "serve set",
        "serve RSS (HWM)",
        "status",
        "status",
        "--stats",
        "--stats",
        "restart",
        "RSS after",
        "dp set",
        "dp RSS (HWM)"
    );
    println!(
        "  {:>6} {:>7}  {:>9} {:>16}  {:>9} {:>9}  {:>9} {:>9}  {:>9} {:>9}  {:>9} {:>16}",
        "", "", "up", "MiB", "p50", "max", "p50", "max", "", "restart", "up", "MiB"
    );
    for p in points {
        println!(
            "  {:>6} {:>7}  {:>9} {:>16}  {:>9} {:>9}  {:>9} {:>9}  {:>9} {:>9.1}  {:>9} {:>16}",
            p.volumes,
            p.backing,
            fmt_dur(p.serve_setup),
            format!("{:.1} ({:.1})", mib(p.serve_rss_kib), mib(p.serve_hwm_kib)),
            fmt_dur(p.status.p50()),
            fmt_dur(p.status.percentile(100.0)),
            fmt_dur(p.status_stats.p50()),
            fmt_dur(p.status_stats.percentile(100.0)),
            fmt_dur(p.restart),
            mib(p.restarted_rss_kib),
            fmt_dur(p.docker_setup),
            format!(
                "{:.1} ({:.1})",
                mib(p.docker_rss_kib),
                mib(p.docker_hwm_kib)
            ),
        );
        if p.stats_unavailable > 0 {
            println!(
                "         status --stats at {} {}: {} volumes without stats (not reached within the CLI's deadline)",
                p.volumes, p.backing, p.stats_unavailable
            );
        }
        let at = format!("{} {}", p.volumes, p.backing);
        targets.push((
            format!("serve RSS, {at} < 64 MiB"),
            format!("{:.1} MiB", mib(p.serve_rss_kib)),
            mib(p.serve_rss_kib) < RSS_TARGET_MIB,
        ));
        targets.push((
            format!("docker-plugin RSS, {at} < 64 MiB"),
            format!("{:.1} MiB", mib(p.docker_rss_kib)),
            mib(p.docker_rss_kib) < RSS_TARGET_MIB,
        ));
        targets.push((
            format!("status CLI p50, {at} < 100 ms"),
            fmt_dur(p.status.p50()),
            p.status.p50() < STATUS_TARGET,
        ));
        targets.push((
            format!("serve restart, {at} < 2 s"),
            fmt_dur(p.restart),
            p.restart < RESTART_TARGET,
        ));
    }
    println!(
        "  (status: `csi-isolator status --json > FILE`, the CLI process, {STATUS_RUNS} runs: the state scan alone (the default), and \
         with --stats, the plugin's NodeGetVolumeStats of every volume; restart: SIGKILL, then spawn to the answered Recover naming every container; \
         RSS after: serve's VmRSS after the restart)"
    );
    for p in points {
        let new_ns = p.new_ns.p50().saturating_sub(p.plain.p50());
        println!(
            "  a new mount namespace at {} {} ({} mounts in it): {} (`unshare -m true` p50 {} against `true` {}, {NEW_NS_RUNS} runs each): \
             the kernel copies and tears down every mount, in every container launch of any engine; not a target",
            p.volumes,
            p.backing,
            p.mounts,
            fmt_dur(new_ns),
            fmt_dur(p.new_ns.p50()),
            fmt_dur(p.plain.p50()),
        );
    }
    let mut backings: Vec<&str> = points.iter().map(|p| p.backing.as_str()).collect();
    backings.dedup();
    for b in backings {
        let of: Vec<&Point> = points.iter().filter(|p| p.backing == b).collect();
        let (Some(small), Some(big)) = (
            of.iter().min_by_key(|p| p.volumes),
            of.iter().max_by_key(|p| p.volumes),
        ) else {
            continue;
        };
        if small.volumes == big.volumes {
            continue;
        }
        let n = big.volumes as f64 / small.volumes as f64;
        let g = |a: f64, b: f64| a / b.max(1e-9);
        let growth = [
            (
                "serve RSS",
                g(big.serve_rss_kib as f64, small.serve_rss_kib as f64),
            ),
            (
                "docker-plugin RSS",
                g(big.docker_rss_kib as f64, small.docker_rss_kib as f64),
            ),
            (
                "status p50",
                g(
                    big.status.p50().as_secs_f64(),
                    small.status.p50().as_secs_f64(),
                ),
            ),
            (
                "status --stats p50",
                g(
                    big.status_stats.p50().as_secs_f64(),
                    small.status_stats.p50().as_secs_f64(),
                ),
            ),
            (
                "restart",
                g(big.restart.as_secs_f64(), small.restart.as_secs_f64()),
            ),
        ];
        println!(
            "  growth {} → {} ({b}, ×{n:.0} volumes; linear or better: ≤ ×{n:.0}): {}",
            small.volumes,
            big.volumes,
            growth
                .iter()
                .map(|(what, r)| format!("{what} ×{r:.2} {}", verdict(*r <= n * 1.1)))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
}
