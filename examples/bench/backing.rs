//! Section 6: what the default backing (an ext4 image on a loop device: capacity enforced)
//! costs beside the directory backing (nothing enforced), measured end to end as a user pays
//! it: `csi-isolator run --volume NAME:64M:data -- true`, each run starting the bundled plugin
//! and ending with the volume released. A first run creates the volume (mkfs for the loop
//! backing); a later run finds it. The two backings alternate, each in its own work dir.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{ensure, Context, Result};

use crate::stats::{fmt_dur, ratio, verdict, Samples};

/// Latencies of one backing.
#[derive(Clone, Debug, Default)]
pub struct BackingRuns {
    /// `volume create` of a new volume.
    pub create: Samples,
    /// `run` that creates its volume.
    pub first: Samples,
    /// `run` of a volume that exists.
    pub later: Samples,
}

/// Both backings.
#[derive(Clone, Debug)]
pub struct BackingReport {
    pub dir: BackingRuns,
    pub default: BackingRuns,
}

fn run_once(cli: &Path, work: &Path, backing: &str, volume: &str) -> Result<()> {
    cli_once(
        cli,
        work,
        backing,
        &[
            "run".into(),
            format!("--plugin-arg=--backing={backing}"),
            "--volume".into(),
            format!("{volume}:64M:data"),
            "--".into(),
            "true".into(),
        ],
    )
}

fn create_once(cli: &Path, work: &Path, backing: &str, volume: &str) -> Result<()> {
    cli_once(
        cli,
        work,
        backing,
        &[
            "volume".into(),
            format!("--plugin-arg=--backing={backing}"),
            "create".into(),
            volume.into(),
            "64M".into(),
        ],
    )
}

fn cli_once(cli: &Path, work: &Path, backing: &str, args: &[String]) -> Result<()> {
    let status = Command::new(cli)
        .arg("--work-dir")
        .arg(work)
        .args(args)
        .env("CSI_ISOLATOR_SOCKET_DIR", work.with_file_name("s"))
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .with_context(|| format!("start {}", cli.display()))?;
    ensure!(
        status.success(),
        "csi-isolator {} ({backing} backing) in {}: {status}",
        args.join(" "),
        work.display()
    );
    Ok(())
}

/// `n` first and `n` later runs per backing, alternating, under `dir`.
pub fn measure(cli: &Path, dir: &Path, n: usize) -> Result<BackingReport> {
    let work = |b: &str| -> Result<PathBuf> {
        let w = dir.join(b).join("work");
        std::fs::create_dir_all(&w).with_context(|| format!("create {}", w.display()))?;
        Ok(w)
    };
    let (dir_work, loop_work) = (work("dir")?, work("loop")?);
    let mut report = BackingReport {
        dir: BackingRuns::default(),
        default: BackingRuns::default(),
    };
    // One unmeasured run each, so that page cache and binaries are warm for both.
    run_once(cli, &dir_work, "dir", "warmup")?;
    run_once(cli, &loop_work, "loop", "warmup")?;
    for i in 0..n {
        let volume = format!("v{i}");
        for (backing, work, runs) in [
            ("dir", &dir_work, &mut report.dir),
            ("loop", &loop_work, &mut report.default),
        ] {
            let t = Instant::now();
            create_once(cli, work, backing, &format!("c{i}"))?;
            runs.create.push(t.elapsed());
            let t = Instant::now();
            run_once(cli, work, backing, &volume)?;
            runs.first.push(t.elapsed());
            let t = Instant::now();
            run_once(cli, work, backing, &volume)?;
            runs.later.push(t.elapsed());
        }
    }
    Ok(report)
}

/// Prints section 6 and adds its targets: a first run with the default backing at most 1.5×
/// one with `dir`, a later run no dearer than `dir`'s (within 10 %: two runs of a process
/// that starts a plugin differ by that much from noise alone).
pub fn print(r: &BackingReport, targets: &mut Vec<(String, String, bool)>) {
    println!("\n6. BACKING COST: `csi-isolator run --volume NAME:64M:data -- true` end to end (plugin start included)");
    println!("  {:<52} {:>5} {:>10} {:>10}", "", "n", "p50", "p99");
    for (label, s) in [
        (
            "`volume create` (plugin start, CreateVolume), dir",
            &r.dir.create,
        ),
        (
            "`volume create` (plugin start, CreateVolume), loop",
            &r.default.create,
        ),
        ("first run (creates the volume), dir", &r.dir.first),
        (
            "first run (creates the volume), loop (default)",
            &r.default.first,
        ),
        ("later run (volume exists), dir", &r.dir.later),
        (
            "later run (volume exists), loop (default)",
            &r.default.later,
        ),
    ] {
        println!(
            "  {:<52} {:>5} {:>10} {:>10}",
            label,
            s.len(),
            fmt_dur(s.p50()),
            fmt_dur(s.p99())
        );
    }
    let create = ratio(r.default.create.p50(), r.dir.create.p50());
    println!("  create loop vs dir: {create:.2}×");
    let first = ratio(r.default.first.p50(), r.dir.first.p50());
    let later = ratio(r.default.later.p50(), r.dir.later.p50());
    println!(
        "  first run loop vs dir: {first:.2}×  target <= 1.5×: {}",
        verdict(first <= 1.5)
    );
    println!(
        "  later run loop vs dir: {later:.2}×  target <= 1.1×: {}",
        verdict(later <= 1.1)
    );
    targets.push((
        "first run, default (loop) backing <= 1.5× dir".into(),
        format!("{first:.2}×"),
        first <= 1.5,
    ));
    targets.push((
        "later run, default (loop) backing <= 1.1× dir".into(),
        format!("{later:.2}×"),
        later <= 1.1,
    ));
}
