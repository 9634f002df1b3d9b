//! `cargo run --release --example engine_bench [-- --runs N]`: what a csi-isolator volume costs
//! a real engine's `run`, against the engine's own `local` driver, and what `docker-plugin`
//! holds in memory with 1,000 volumes.
//!
//! 1. Docker: a private dockerd (no bridge, no firewall rule, every directory in a temp dir)
//!    with `csi-isolator docker-plugin` on the bundled plugin (its default backing, ext4 on
//!    loop); `docker run --rm --network none -v V:/data IMAGE true` with a csi-isolator volume
//!    and with a `local` one, in turn (A B A B ...), after a warm-up: p50, p99 and the ratio.
//! 2. Podman: the same through `containers.conf`'s `[engine.volume_plugins]`.
//! 3. `docker-plugin` (directory backing, so that 1,000 volumes need no 1,000 loop devices)
//!    given 1,000 `Create`s and 1,000 `Mount`s over its socket, 16 at a time: its VmRSS and
//!    VmHWM, and its managed plugin's apart. Then every volume is unmounted and removed.
//!
//! Needs root, dockerd and podman (`.ci/run` installs them). Everything lives under one temp
//! dir; the host paths the engines make are restored (`csi_isolator_testing::engines`).

// The benchmark's own helpers, shared with `bench`; not every one is used here.
#[path = "bench/docker_api.rs"]
mod docker_api;
#[allow(dead_code)]
#[path = "bench/machine.rs"]
mod machine;
#[allow(dead_code)]
#[path = "bench/stats.rs"]
mod stats;

use std::path::Path;
use std::process::{Command, ExitCode, Output};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use clap::Parser;
use nix::sys::signal::Signal;

use csi_isolator::docker_plugin::DEFAULT_UNPUBLISH_DELAY;
use csi_isolator_testing::engines::{
    require_engine, unique, Dockerd, EngineCli, HostPaths, Podman, DOCKER_HOST_PATHS,
    DOCKER_PLUGINS_DIR, PODMAN_HOST_PATHS,
};
use csi_isolator_testing::{processes_mentioning, DockerPluginProcess, Sandbox};
use docker_api::{call, call_ok, fan_out, mount_id};

use machine::status_kib;
use stats::{fmt_dur, ratio, verdict, Samples};

/// The `docker run` target: a csi-isolator volume within 10 % of the local driver.
const RUN_TARGET: f64 = 1.10;
/// The memory target for docker-plugin with 1,000 volumes, MiB.
const RSS_TARGET_MIB: f64 = 50.0;
/// Calls in flight at once while making the 1,000 volumes.
const CONCURRENCY: usize = 16;

#[derive(Debug, Parser)]
#[command(
    name = "engine_bench",
    about = "csi-isolator with real engines: `docker run` / `podman run` with a csi-isolator \
             volume against the local driver, and docker-plugin's memory with 1,000 volumes. \
             Run as root.",
    after_help = "Example:\n  cargo run --release --example engine_bench -- --runs 20"
)]
struct Args {
    /// Counted runs of each command (after 3 warm-up runs each).
    #[arg(long, default_value_t = 40)]
    runs: usize,
    /// Volumes docker-plugin holds for the memory figure.
    #[arg(long, default_value_t = 1000)]
    volumes: usize,
    /// docker-plugin's `--policy` for the run sections: last-use (its default: unpublished
    /// when the last container leaves) or keep (published until removed).
    #[arg(long, default_value = "last-use")]
    policy: String,
    /// docker-plugin's `--unpublish-delay` for the run sections, seconds (default: its own).
    #[arg(long, default_value_t = DEFAULT_UNPUBLISH_DELAY.as_secs())]
    unpublish_delay: u64,
    /// Skip Podman.
    #[arg(long)]
    no_podman: bool,
}

impl Args {
    /// The docker-plugin options the run sections used.
    fn described(&self) -> String {
        format!(
            "--policy {} --unpublish-delay {}",
            self.policy, self.unpublish_delay
        )
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    if !nix::unistd::geteuid().is_root() {
        eprintln!("engine_bench: must run as root: it starts dockerd, podman and docker-plugin");
        return ExitCode::from(2);
    }
    let bin = match sibling_binary("csi-isolator") {
        Ok(b) => b,
        Err(e) => {
            eprintln!("engine_bench: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    println!("engine_bench: {}", machine_line());
    let mut failed = false;
    for (name, section) in [
        (
            "docker run",
            docker_section as fn(&Args, &str) -> Result<()>,
        ),
        ("podman run", podman_section),
        ("docker-plugin memory", memory_section),
    ] {
        if name == "podman run" && args.no_podman {
            continue;
        }
        if let Err(e) = section(&args, &bin) {
            eprintln!("engine_bench: {name}: {e:#}");
            failed = true;
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

fn machine_line() -> String {
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let cpu = machine::cpu_model().unwrap_or_else(|| "unknown CPU".into());
    let docker = version("dockerd", &["--version"]);
    let podman = version("podman", &["--version"]);
    format!("{cores} cores ({cpu}); {docker}; {podman}")
}

fn version(program: &str, args: &[&str]) -> String {
    Command::new(program)
        .args(args)
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| format!("{program}: not installed"))
}

/// `name` beside this example's directory (`target/release/`), built by
/// `cargo build --release` (the example's own build builds it too).
fn sibling_binary(name: &str) -> Result<String> {
    let exe = std::env::current_exe().context("this program's path")?;
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .context("the target directory")?;
    let bin = dir.join(name);
    ensure!(
        bin.is_file(),
        "{} is missing: run `cargo build --release` first",
        bin.display()
    );
    Ok(bin.to_string_lossy().into_owned())
}

/// Times `run` for the csi-isolator volume and the local one in turn.
fn alternate(
    runs: usize,
    mut run: impl FnMut(&str) -> Result<Duration>,
) -> Result<(Samples, Samples, Vec<f64>)> {
    for _ in 0..3 {
        run("csi")?;
        run("local")?;
    }
    let (mut csi, mut local, mut pairs) = (Samples::new(), Samples::new(), Vec::new());
    for _ in 0..runs {
        let a = run("csi")?;
        let b = run("local")?;
        pairs.push(ratio(a, b));
        csi.push(a);
        local.push(b);
    }
    Ok((csi, local, pairs))
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}

fn report(engine: &str, plugin_args: &str, csi: &Samples, local: &Samples, pairs: &mut [f64]) {
    let p50 = ratio(csi.p50(), local.p50());
    let pairwise = median(pairs);
    println!(
        "{engine} run, csi-isolator volume: p50 {} p99 {} ({} runs, {plugin_args})",
        fmt_dur(csi.p50()),
        fmt_dur(csi.p99()),
        csi.len()
    );
    println!(
        "{engine} run, local driver:        p50 {} p99 {}",
        fmt_dur(local.p50()),
        fmt_dur(local.p99())
    );
    println!(
        "{engine} run ratio: p50 {p50:.3}x, median of pairs {pairwise:.3}x (target <= {RUN_TARGET:.2}x: {})",
        verdict(p50 <= RUN_TARGET)
    );
}

fn timed(what: &str, out: impl FnOnce() -> Output) -> Result<Duration> {
    let started = Instant::now();
    let out = out();
    let took = started.elapsed();
    if !out.status.success() {
        bail!(
            "{what}: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(took)
}

/// docker-plugin for the run sections, with the policy and delay asked for.
fn start_plugin(args: &Args, sb: &Sandbox, bin: &str, socket: &Path) -> DockerPluginProcess {
    let policy = format!("--policy={}", args.policy);
    let delay = format!("--unpublish-delay={}", args.unpublish_delay);
    DockerPluginProcess::start(sb, bin, &sb.join("work"), socket, &[&policy, &delay])
}

fn docker_section(args: &Args, bin: &str) -> Result<()> {
    require_engine("dockerd", "docker.io");
    let driver = format!("csi-isolator-bench-{}", unique());
    let mut host = HostPaths::claim(DOCKER_HOST_PATHS);
    let socket = Path::new(DOCKER_PLUGINS_DIR).join(format!("{driver}.sock"));
    host.remove_at_end(&socket);
    let sb = Sandbox::new("engine-bench-docker");
    let plugin = start_plugin(args, &sb, bin, &socket);
    let engine = Dockerd::start(&sb);
    let image = engine.import_busybox(&sb);
    engine.ok(&[
        "volume",
        "create",
        "-d",
        &driver,
        "-o",
        "size=64M",
        "bench-csi",
    ]);
    engine.ok(&["volume", "create", "bench-local"]);
    let measured = alternate(args.runs, |which| {
        let volume = format!("bench-{which}:/data");
        timed("docker run", || {
            engine.docker(&[
                "run",
                "--rm",
                "--network",
                "none",
                "-v",
                &volume,
                &image,
                "true",
            ])
        })
    });
    engine.ok(&["volume", "rm", "bench-csi", "bench-local"]);
    engine.ok(&["rmi", &image]);
    engine.stop(&sb);
    let status = plugin.stop(&sb, Signal::SIGTERM);
    ensure!(status.success(), "docker-plugin: {status}");
    drop(sb);
    host.assert_restored();
    let (csi, local, mut pairs) = measured?;
    report("docker", &args.described(), &csi, &local, &mut pairs);
    Ok(())
}

fn podman_section(args: &Args, bin: &str) -> Result<()> {
    require_engine("podman", "podman");
    let host = HostPaths::claim(PODMAN_HOST_PATHS);
    let sb = Sandbox::new("engine-bench-podman");
    let socket = sb.join("plugin/csi-isolator.sock");
    let plugin = start_plugin(args, &sb, bin, &socket);
    let podman = Podman::new(&sb, &[("csibench", &socket)]);
    let image = podman.import_busybox(&sb);
    podman.ok(&[
        "volume",
        "create",
        "--driver",
        "csibench",
        "-o",
        "size=64M",
        "bench-csi",
    ]);
    podman.ok(&["volume", "create", "bench-local"]);
    let measured = alternate(args.runs, |which| {
        let volume = format!("bench-{which}:/data");
        timed("podman run", || {
            podman.command(&["run", "--rm", "-v", &volume, &image, "true"])
        })
    });
    podman.ok(&["volume", "rm", "bench-csi", "bench-local"]);
    podman.ok(&["rmi", &image]);
    let status = plugin.stop(&sb, Signal::SIGTERM);
    ensure!(status.success(), "docker-plugin: {status}");
    drop(podman);
    drop(sb);
    host.assert_restored();
    let (csi, local, mut pairs) = measured?;
    report("podman", &args.described(), &csi, &local, &mut pairs);
    Ok(())
}

fn memory_section(args: &Args, bin: &str) -> Result<()> {
    let sb = Sandbox::new("engine-bench-memory");
    let socket = sb.join("plugin/csi-isolator.sock");
    let work = sb.join("work");
    let plugin =
        DockerPluginProcess::start(&sb, bin, &work, &socket, &["--plugin-arg=--backing=dir"]);
    let pid = plugin.child.id().to_string();
    let count = args.volumes;
    let started = Instant::now();
    let made = fan_out(count, CONCURRENCY, |i| {
        let name = format!("m{i}");
        call_ok(
            &socket,
            "VolumeDriver.Create",
            &format!(r#"{{"Name":"{name}","Opts":{{"size":"1M"}}}}"#),
        )?;
        call_ok(
            &socket,
            "VolumeDriver.Mount",
            &format!(r#"{{"Name":"{name}","ID":"{}"}}"#, mount_id(i)),
        )?;
        Ok(())
    });
    let setup = started.elapsed();
    let rss = status_kib(&pid, "VmRSS:");
    let hwm = status_kib(&pid, "VmHWM:");
    let managed: Vec<u64> = processes_mentioning(&work)
        .into_iter()
        .filter(|p| p.to_string() != pid)
        .filter_map(|p| status_kib(&p.to_string(), "VmRSS:"))
        .collect();
    let started = Instant::now();
    let undone = fan_out(count, CONCURRENCY, |i| {
        let name = format!("m{i}");
        // A volume whose Create failed has nothing to undo; the first error stands.
        let _ = call(
            &socket,
            "VolumeDriver.Unmount",
            &format!(r#"{{"Name":"{name}","ID":"{}"}}"#, mount_id(i)),
        );
        let _ = call(
            &socket,
            "VolumeDriver.Remove",
            &format!(r#"{{"Name":"{name}"}}"#),
        );
        Ok(())
    });
    let teardown = started.elapsed();
    let status = plugin.stop(&sb, Signal::SIGTERM);
    drop(sb);
    made?;
    undone?;
    ensure!(status.success(), "docker-plugin: {status}");
    let mib = |kib: Option<u64>| kib.map_or(f64::NAN, |k| k as f64 / 1024.0);
    println!(
        "docker-plugin with {count} volumes created and mounted (directory backing, {CONCURRENCY} \
         at a time, {} to make, {} to unmount and remove): VmRSS {:.1} MiB, VmHWM {:.1} MiB \
         (target < {RSS_TARGET_MIB:.0} MiB: {}); its managed plugin: {:.1} MiB",
        fmt_dur(setup),
        fmt_dur(teardown),
        mib(rss),
        mib(hwm),
        verdict(mib(hwm) < RSS_TARGET_MIB),
        mib(managed.first().copied()),
    );
    Ok(())
}
