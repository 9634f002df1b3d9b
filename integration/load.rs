//! Load: 500 container lifecycles against the real kernel, as root, with
//! random interleavings of launch, update and cleanup over 20 shared CSI
//! volumes, run concurrently the way an agent runs them. Afterwards nothing
//! may be left: no mount (the host mount table equals the one before), no
//! loop device of the sandbox, no process, no file descriptor of this
//! process; every volume state agrees with the plugin and the mount table
//! (the `csi-isolator status` scan), and every marker the containers wrote
//! into their volumes is still there.
//!
//! The choices (which operation, which container, which volumes, ro or rw)
//! come from a seeded RNG: the seed is printed and can be set with
//! `CSI_ISOLATOR_LOAD_SEED`. Operations run as concurrent tokio tasks, so
//! the timing of their interleaving is not fixed by the seed; the choices
//! made at each step are (given the same completions).
//!
//! Two providers of the bundled plugin share the agent work dir: one backs
//! its volumes with directories, the other with ext4 images on loop
//! devices, so loop-device leaks are checked too.
//!
//! File descriptors: `/proc/self/fd` is compared twice. Once while the
//! providers are up (measured after they started and created the volumes,
//! and again after the run, before they shut down): the providers' plugin
//! connections are open then, and at every pause in the run the count must
//! be that plus exactly one pidfd per live workload. And once for the whole
//! test: at the start, and after the providers were shut down and dropped.

use csi_isolator_testing::plugin_bin;
use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::fs;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use csi_isolator::isolator::{ContainerConfig, VolumeIsolator};
use csi_isolator::launcher::{self, LaunchSpec, Launched};
use csi_isolator::mount::SANDBOX_IN_ROOTFS;
use csi_isolator::mount::{LinuxSyscall, MountTable, ProcMountTable};
use csi_isolator::provider::bundled::bundled_config;
use csi_isolator::provider::status::scan;
use csi_isolator::provider::{CreateSpec, Manager, StorageProvider, VolumeState};
use csi_isolator::resource::{Resource, VolumeMode};
use csi_isolator_testing::{busybox_rootfs, host_mount_points, require_root, Sandbox};
use nix::sys::signal::Signal;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::task::JoinSet;

const MIB: u64 = 1024 * 1024;

/// Container lifecycles in one run.
const CONTAINERS: usize = 500;
/// Shared volumes.
const VOLUMES: usize = 20;
/// How many of them are ext4-on-loop (the others are directories).
const LOOP_VOLUMES: usize = 6;
/// Containers alive (launching, running or being cleaned up) at once.
const MAX_ALIVE: usize = 16;
/// Operations in flight at once.
const MAX_IN_FLIGHT: usize = 8;
/// Volumes one container uses at most.
const MAX_VOLUMES_PER_CONTAINER: usize = 4;
/// After every this many launches the run pauses until no operation is in
/// flight and checks the whole model against the providers and the kernel.
const CHECK_EVERY: usize = 100;
/// Environment variable that overrides the seed.
const SEED_ENV: &str = "CSI_ISOLATOR_LOAD_SEED";
/// The seed when the environment sets none.
const DEFAULT_SEED: u64 = 0x0c51_1500;
/// Bound on one wait inside an operation (its marker, reaping its
/// workload); a whole operation gets twice that.
const OP_TIMEOUT: Duration = Duration::from_secs(30);

/// One shared volume.
struct Volume {
    /// `v00`..`v19`: its CreateVolume name and its container path.
    name: String,
    provider: Arc<StorageProvider>,
    id: String,
    /// The resource that hands it out (no `disk.volume` yet).
    resource: Resource,
}

impl Volume {
    fn for_container(&self, readonly: bool) -> Resource {
        let mode = if readonly {
            VolumeMode::Ro
        } else {
            VolumeMode::Rw
        };
        self.resource.clone().with_volume(&self.name, mode)
    }

    fn marker(&self, container: &str) -> PathBuf {
        self.provider
            .mount_point(&self.id)
            .join(format!("marker-{container}"))
    }
}

/// A live container, owned by whichever task operates on it.
struct Container {
    id: String,
    config: ContainerConfig,
    /// Volume index -> read-only.
    volumes: BTreeMap<usize, bool>,
    process: Launched,
}

impl Container {
    fn resources(&self, vols: &[Volume]) -> Vec<Resource> {
        self.volumes
            .iter()
            .map(|(i, ro)| vols[*i].for_container(*ro))
            .collect()
    }

    /// The sandbox as the container sees it.
    fn sandbox_inside(&self) -> PathBuf {
        if self.config.rootfs.is_some() {
            PathBuf::from(SANDBOX_IN_ROOTFS)
        } else {
            self.config.sandbox.clone()
        }
    }
}

/// Counters and timings, shared by the tasks.
#[derive(Default)]
struct Stats {
    launched: AtomicU64,
    updates: AtomicU64,
    updates_add: AtomicU64,
    updates_remove: AtomicU64,
    cleanups: AtomicU64,
    container_mounts: AtomicU64,
    container_unmounts: AtomicU64,
    launch_us: AtomicU64,
    launch_max_us: AtomicU64,
    prepare_us: AtomicU64,
    exec_us: AtomicU64,
    update_us: AtomicU64,
    update_max_us: AtomicU64,
    cleanup_us: AtomicU64,
    cleanup_max_us: AtomicU64,
    isolator_cleanup_us: AtomicU64,
}

impl Stats {
    fn time(total: &AtomicU64, max: Option<&AtomicU64>, since: Instant) {
        let us = since.elapsed().as_micros() as u64;
        total.fetch_add(us, Ordering::Relaxed);
        if let Some(max) = max {
            max.fetch_max(us, Ordering::Relaxed);
        }
    }
}

/// Everything the operation tasks share.
struct Ctx {
    sb: Arc<Sandbox>,
    work: PathBuf,
    rootfs: PathBuf,
    isolator: VolumeIsolator,
    providers: Vec<Arc<StorageProvider>>,
    volumes: Vec<Volume>,
    stats: Stats,
}

/// What a finished operation hands back to the driver.
enum Done {
    Launched(Container),
    Updated(Container),
    Cleaned,
}

/// A launch the driver decided on.
struct LaunchPlan {
    id: String,
    volumes: BTreeMap<usize, bool>,
    marker: usize,
    rootfs: bool,
}

/// An update the driver decided on.
enum Change {
    Add(usize, bool),
    Remove(usize),
}

/// Cleanup on failure: the sandbox kills the pids registered with it
/// (workloads and plugins), unmounts everything under it and detaches its
/// loop devices when its last reference goes. This registers the plugins
/// with it, and unregisters them after their orderly shutdown.
struct PluginGuard {
    sb: Arc<Sandbox>,
    pids: Mutex<Vec<u32>>,
}

impl PluginGuard {
    fn register(&self, provider: &StorageProvider) {
        if let Some(pid) = provider.plugin_pid() {
            self.sb.track(pid);
            self.pids.lock().unwrap().push(pid);
        }
    }

    /// After an orderly shutdown the plugins are reaped: forget their pids,
    /// so a recycled pid is never killed.
    fn disarm(&self) {
        for pid in self.pids.lock().unwrap().drain(..) {
            self.sb.untrack(pid);
        }
    }
}

fn seed() -> u64 {
    match std::env::var(SEED_ENV) {
        Ok(s) => {
            let s = s.trim();
            let parsed = match s.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16),
                None => s.parse(),
            };
            parsed.unwrap_or_else(|e| panic!("{SEED_ENV}={s:?} is not a u64: {e}"))
        }
        Err(_) => DEFAULT_SEED,
    }
}

/// `fds` without the launcher's seed: the one mount namespace fd the launcher holds for the
/// process's life once it has launched a container with a rootfs (at most one, checked).
fn without_seed(fds: &[(i32, String)]) -> Vec<(i32, String)> {
    let (seeds, rest): (Vec<_>, Vec<_>) = fds
        .iter()
        .cloned()
        .partition(|(_, l)| l.starts_with("mnt:["));
    assert!(
        seeds.len() <= 1,
        "{} mount namespace fds: {fds:?}",
        seeds.len()
    );
    rest
}

/// This process's open fds as (fd, what it points at), leaving out the one
/// used to list them.
fn open_fds() -> Vec<(i32, String)> {
    let me = format!("/proc/{}/fd", std::process::id());
    let mut fds: Vec<(i32, String)> = fs::read_dir("/proc/self/fd")
        .expect("list /proc/self/fd")
        .flatten()
        .filter_map(|e| {
            let fd: i32 = e.file_name().to_str()?.parse().ok()?;
            let target = fs::read_link(e.path()).ok()?.display().to_string();
            Some((fd, target))
        })
        .filter(|(_, target)| *target != me)
        .collect();
    fds.sort();
    fds
}

/// Processes that belong to this test: children of this process (zombies
/// included) and processes whose cwd, root or command line is in the
/// sandbox. Returned as "pid (comm): why".
fn related_processes(sb: &Sandbox) -> Vec<String> {
    let me = std::process::id();
    let sandbox = sb.path().to_string_lossy().into_owned();
    let mut out = Vec::new();
    let Ok(entries) = fs::read_dir("/proc") else {
        return out;
    };
    for e in entries.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if pid == me {
            continue;
        }
        let dir = e.path();
        let Ok(stat) = fs::read_to_string(dir.join("stat")) else {
            continue;
        };
        let comm = stat
            .find('(')
            .zip(stat.rfind(')'))
            .map(|(a, b)| stat[a + 1..b].to_string())
            .unwrap_or_default();
        let rest = stat.rfind(')').map(|i| &stat[i + 1..]).unwrap_or("");
        let mut fields = rest.split_whitespace();
        let state = fields.next().unwrap_or("?").to_string();
        let ppid: Option<u32> = fields.next().and_then(|p| p.parse().ok());
        let mut why = Vec::new();
        if ppid == Some(me) {
            why.push(format!("child of the test (state {state})"));
        }
        for link in ["cwd", "root"] {
            if let Ok(target) = fs::read_link(dir.join(link)) {
                if target.starts_with(sb.path()) {
                    why.push(format!("{link} {}", target.display()));
                }
            }
        }
        if let Ok(cmdline) = fs::read(dir.join("cmdline")) {
            if String::from_utf8_lossy(&cmdline).contains(&sandbox) {
                why.push("command line names the sandbox".to_string());
            }
        }
        if !why.is_empty() {
            out.push(format!("{pid} ({comm}): {}", why.join(", ")));
        }
    }
    out.sort();
    out
}

/// Pids of this process's children.
fn children() -> BTreeSet<u32> {
    let me = std::process::id();
    let mut out = BTreeSet::new();
    let Ok(entries) = fs::read_dir("/proc") else {
        return out;
    };
    for e in entries.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        let ppid = stat
            .rfind(')')
            .and_then(|i| stat[i + 1..].split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        if ppid == Some(me) {
            out.insert(pid);
        }
    }
    out
}

/// The volume mounts a container's mount namespace shows under its
/// sandbox, as (path inside, read-only), sorted; a stacked mount shows
/// twice.
fn container_mounts(c: &Container) -> Result<Vec<(PathBuf, bool)>, String> {
    let inside = c.sandbox_inside();
    let mounts = ProcMountTable::for_pid(c.process.pid())
        .mounts()
        .map_err(|e| format!("{}: read its mount table: {e}", c.id))?;
    let mut got: Vec<(PathBuf, bool)> = mounts
        .into_iter()
        .filter(|m| m.mount_point.starts_with(&inside) && m.mount_point != inside)
        .map(|m| {
            let ro = m.mount_options.iter().any(|o| o == "ro");
            (m.mount_point, ro)
        })
        .collect();
    got.sort();
    Ok(got)
}

/// The container's namespace holds exactly its volumes, each once, with the
/// right mode; the provider has it as a user of each, published.
async fn check_container(ctx: &Ctx, c: &Container) -> Result<(), String> {
    let inside = c.sandbox_inside();
    let mut want: Vec<(PathBuf, bool)> = c
        .volumes
        .iter()
        .map(|(i, ro)| (inside.join(&ctx.volumes[*i].name), *ro))
        .collect();
    want.sort();
    let got = container_mounts(c)?;
    if got != want {
        return Err(format!(
            "{}: its mount namespace shows {got:?}, expected {want:?}",
            c.id
        ));
    }
    for i in c.volumes.keys() {
        let v = &ctx.volumes[*i];
        let rec = v
            .provider
            .volume(&v.id)
            .await
            .ok_or_else(|| format!("volume {} unknown to its provider", v.id))?;
        if !rec.users.contains(&c.id) || rec.state != VolumeState::Published {
            return Err(format!(
                "{}: volume {} ({}) is {} with users {:?}",
                c.id, v.name, v.id, rec.state, rec.users
            ));
        }
    }
    Ok(())
}

async fn wait_for_marker(ctx: &Ctx, c: &mut Container, vol: usize) -> Result<(), String> {
    let path = ctx.volumes[vol].marker(&c.id);
    let want = format!("{}\n", c.id);
    let deadline = Instant::now() + OP_TIMEOUT;
    loop {
        if fs::read_to_string(&path).is_ok_and(|s| s == want) {
            return Ok(());
        }
        if let Some(status) = c
            .process
            .try_wait()
            .map_err(|e| format!("{}: wait: {e}", c.id))?
        {
            ctx.sb.untrack(c.process.pid());
            return Err(format!(
                "{}: the workload exited ({status}) before its marker {} appeared",
                c.id,
                path.display()
            ));
        }
        if Instant::now() > deadline {
            return Err(format!(
                "{}: marker {} not written within {OP_TIMEOUT:?}",
                c.id,
                path.display()
            ));
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// prepare + launch + isolate, then waits for the workload's marker.
async fn launch_op(ctx: Arc<Ctx>, plan: LaunchPlan) -> Result<Done, String> {
    let started = Instant::now();
    let id = plan.id.clone();
    let sandbox = ctx.sb.mkdir(format!("sandboxes/{id}"));
    let config = ContainerConfig {
        resources: plan
            .volumes
            .iter()
            .map(|(i, ro)| ctx.volumes[*i].for_container(*ro))
            .collect(),
        sandbox: sandbox.clone(),
        rootfs: plan.rootfs.then(|| ctx.rootfs.clone()),
        user: None,
    };
    let info = ctx
        .isolator
        .prepare(&id, config.clone())
        .await
        .map_err(|e| format!("{id}: prepare: {e}"))?;
    Stats::time(&ctx.stats.prepare_us, None, started);
    if info.mounts.len() != plan.volumes.len() {
        return Err(format!(
            "{id}: prepare returned {} mounts for {} volumes",
            info.mounts.len(),
            plan.volumes.len()
        ));
    }
    let marker_vol = &ctx.volumes[plan.marker].name;
    let script = format!("echo {id} > {marker_vol}/marker-{id} && exec sleep 1000");
    let spec = LaunchSpec {
        argv: vec!["sh".into(), "-c".into(), OsString::from(script)],
        env: vec![("PATH".into(), "/usr/bin:/bin".into())],
        sandbox,
        rootfs: config.rootfs.clone(),
        mounts: info.mounts.clone(),
        pid_namespace: false,
        user: None,
    };
    let exec_start = Instant::now();
    let process = tokio::task::spawn_blocking(move || {
        launcher::launch(&csi_isolator::mount::LinuxSyscall::new(), &spec)
    })
    .await
    .map_err(|e| format!("{id}: launch task: {e}"))?
    .map_err(|e| format!("{id}: launch: {e}"))?;
    // From here on the sandbox kills the workload if the test fails.
    ctx.sb.track(process.pid());
    Stats::time(&ctx.stats.exec_us, None, exec_start);
    let mut c = Container {
        id,
        config,
        volumes: plan.volumes,
        process,
    };
    ctx.isolator
        .isolate(&c.id, c.process.pid())
        .await
        .map_err(|e| format!("{}: isolate: {e}", c.id))?;
    wait_for_marker(&ctx, &mut c, plan.marker).await?;
    check_container(&ctx, &c).await?;
    let s = &ctx.stats;
    s.launched.fetch_add(1, Ordering::Relaxed);
    s.container_mounts
        .fetch_add(c.volumes.len() as u64, Ordering::Relaxed);
    Stats::time(&s.launch_us, Some(&s.launch_max_us), started);
    Ok(Done::Launched(c))
}

/// Adds or removes one volume of a running container.
async fn update_op(ctx: Arc<Ctx>, mut c: Container, change: Change) -> Result<Done, String> {
    let started = Instant::now();
    let removed = match change {
        Change::Add(i, ro) => {
            c.volumes.insert(i, ro);
            None
        }
        Change::Remove(i) => {
            c.volumes.remove(&i);
            Some(i)
        }
    };
    let resources = c.resources(&ctx.volumes);
    ctx.isolator
        .update(&c.id, resources)
        .await
        .map_err(|e| format!("{}: update: {e}", c.id))?;
    check_container(&ctx, &c).await?;
    if let Some(i) = removed {
        let v = &ctx.volumes[i];
        let rec = v.provider.volume(&v.id).await.unwrap();
        if rec.users.contains(&c.id) {
            return Err(format!(
                "{}: still a user of {} after the update removed it",
                c.id, v.name
            ));
        }
    }
    let s = &ctx.stats;
    s.updates.fetch_add(1, Ordering::Relaxed);
    if removed.is_some() {
        s.updates_remove.fetch_add(1, Ordering::Relaxed);
        s.container_unmounts.fetch_add(1, Ordering::Relaxed);
    } else {
        s.updates_add.fetch_add(1, Ordering::Relaxed);
        s.container_mounts.fetch_add(1, Ordering::Relaxed);
    }
    Stats::time(&s.update_us, Some(&s.update_max_us), started);
    Ok(Done::Updated(c))
}

/// Kills the workload, reaps it, cleans the container up and removes its
/// (then empty) sandbox.
async fn cleanup_op(ctx: Arc<Ctx>, mut c: Container) -> Result<Done, String> {
    let started = Instant::now();
    let pid = c.process.pid();
    c.process
        .kill(Signal::SIGKILL)
        .map_err(|e| format!("{}: kill: {e}", c.id))?;
    let status = tokio::time::timeout(OP_TIMEOUT, c.process.wait_async())
        .await
        .map_err(|_| format!("{}: still running {OP_TIMEOUT:?} after SIGKILL", c.id))?
        .map_err(|e| format!("{}: wait: {e}", c.id))?;
    ctx.sb.untrack(pid);
    if status.signal() != Some(libc::SIGKILL) {
        return Err(format!(
            "{}: the workload ended by itself ({status}) before it was killed",
            c.id
        ));
    }
    let iso_start = Instant::now();
    ctx.isolator
        .cleanup(&c.id)
        .await
        .map_err(|e| format!("{}: cleanup: {e}", c.id))?;
    Stats::time(&ctx.stats.isolator_cleanup_us, None, iso_start);
    for i in c.volumes.keys() {
        let v = &ctx.volumes[*i];
        let rec = v.provider.volume(&v.id).await.unwrap();
        if rec.users.contains(&c.id) {
            return Err(format!(
                "{}: still a user of {} after cleanup",
                c.id, v.name
            ));
        }
    }
    if ctx.isolator.checkpoint_root().join(&c.id).exists() {
        return Err(format!("{}: checkpoint left after cleanup", c.id));
    }
    // The sandbox holds only the empty mount targets: the volumes were
    // mounted in the container's namespace only. remove_dir (not
    // remove_dir_all) fails on anything else, a mount included.
    let entries =
        fs::read_dir(&c.config.sandbox).map_err(|e| format!("{}: list sandbox: {e}", c.id))?;
    for e in entries.flatten() {
        fs::remove_dir(e.path()).map_err(|err| {
            format!(
                "{}: sandbox entry {} is not an empty directory: {err}",
                c.id,
                e.path().display()
            )
        })?;
    }
    fs::remove_dir(&c.config.sandbox).map_err(|e| format!("{}: remove sandbox: {e}", c.id))?;
    let s = &ctx.stats;
    s.cleanups.fetch_add(1, Ordering::Relaxed);
    s.container_unmounts
        .fetch_add(c.volumes.len() as u64, Ordering::Relaxed);
    Stats::time(&s.cleanup_us, Some(&s.cleanup_max_us), started);
    Ok(Done::Cleaned)
}

/// Loop devices backed by files in the sandbox, per backing file.
fn loop_devices_by_image(sb: &Sandbox) -> BTreeMap<PathBuf, Vec<PathBuf>> {
    let mut by_image: BTreeMap<PathBuf, Vec<PathBuf>> = BTreeMap::new();
    for (dev, image) in sb.loop_devices() {
        by_image.entry(image).or_default().push(dev);
    }
    by_image
}

/// With no operation in flight: every volume's users are exactly the live
/// containers that use it, it is published iff it has users, the status
/// scan sees no disagreement, the isolator knows exactly the live
/// containers, every live container's namespace is as expected, this
/// process's children are the live workloads and the plugins, no ext4
/// image is attached to two loop devices at once, no container keeps a
/// stale copy of a volume mount, and the test process holds no fd beyond
/// one pidfd per live workload.
async fn check_consistent(ctx: &Ctx, live: &[Container], base_fds: &[(i32, String)], label: &str) {
    let mut users: Vec<BTreeSet<String>> = vec![BTreeSet::new(); ctx.volumes.len()];
    for c in live {
        for i in c.volumes.keys() {
            users[*i].insert(c.id.clone());
        }
        if let Err(e) = check_container(ctx, c).await {
            panic!("{label}: {e}");
        }
    }
    let mut published_loop = 0;
    for (i, v) in ctx.volumes.iter().enumerate() {
        let rec = v.provider.volume(&v.id).await.unwrap();
        assert_eq!(
            rec.users, users[i],
            "{label}: users of {} ({})",
            v.name, v.id
        );
        let want = if users[i].is_empty() {
            VolumeState::Created
        } else {
            VolumeState::Published
        };
        assert_eq!(rec.state, want, "{label}: state of {} ({})", v.name, v.id);
        if i < LOOP_VOLUMES && want == VolumeState::Published {
            published_loop += 1;
        }
    }
    let report = scan(&ctx.work, &ProcMountTable::new()).expect("status scan");
    assert!(
        report.unreadable.is_empty(),
        "{label}: unreadable state files: {:?}",
        report.unreadable
    );
    assert_eq!(
        report.volumes.len(),
        ctx.volumes.len(),
        "{label}: status scan"
    );
    for st in &report.volumes {
        assert_eq!(
            st.disagreement, None,
            "{label}: status of {} ({})",
            st.volume_id, st.plugin
        );
        assert_eq!(
            st.mounted,
            !st.users.is_empty(),
            "{label}: {} mounted vs users {:?}",
            st.volume_id,
            st.users
        );
    }
    let known: BTreeSet<String> = ctx
        .isolator
        .containers()
        .await
        .into_iter()
        .map(|r| r.container_id)
        .collect();
    let want: BTreeSet<String> = live.iter().map(|c| c.id.clone()).collect();
    assert_eq!(known, want, "{label}: containers the isolator knows");
    let on_disk: BTreeSet<String> = ctx
        .isolator
        .checkpointed()
        .into_iter()
        .map(|r| r.container_id)
        .collect();
    assert_eq!(on_disk, want, "{label}: containers checkpointed");
    let mut expected_children: BTreeSet<u32> = live.iter().map(|c| c.process.pid()).collect();
    expected_children.extend(ctx.providers.iter().filter_map(|p| p.plugin_pid()));
    assert_eq!(
        children(),
        expected_children,
        "{label}: children of the test process (workloads and plugins only, no zombies)"
    );
    let loops = loop_devices_by_image(&ctx.sb);
    // A container's namespace is a copy of the host's at launch: it must not
    // keep a volume the host has unmounted since (the kernel drops such copies
    // when the plugin removes the mount point directory). A stale copy would
    // pin the loop device, and a re-stage would put a second ext4 instance
    // on the same image.
    let csi = ctx.work.join("csi");
    let host: BTreeSet<PathBuf> = ProcMountTable::new()
        .mounts_under(&csi)
        .expect("read the host mount table")
        .into_iter()
        .map(|m| m.mount_point)
        .collect();
    for c in live {
        let stale: Vec<PathBuf> = ProcMountTable::for_pid(c.process.pid())
            .mounts()
            .unwrap_or_else(|e| panic!("{label}: {}: read its mount table: {e}", c.id))
            .into_iter()
            .map(|m| m.mount_point)
            .filter(|p| p.starts_with(&csi) && !host.contains(p))
            .collect();
        assert!(
            stale.is_empty(),
            "{label}: {} keeps volume mounts the host no longer has: {stale:?}",
            c.id
        );
    }
    for (image, devs) in &loops {
        assert_eq!(
            devs.len(),
            1,
            "{label}: {} is attached to several loop devices at once: {devs:?}",
            image.display()
        );
    }
    // Each live workload's `Launched` holds one pidfd, and the launcher holds its seed's
    // namespace (one fd for the process's life, made at the first launch with a rootfs, if
    // there was none before); nothing else may have stayed open.
    let (fds, base) = (without_seed(&open_fds()), without_seed(base_fds));
    assert_eq!(
        fds.len(),
        base.len() + live.len(),
        "{label}: fds of the test process (the launch seed aside): {} before the run, one pidfd \
         per live workload ({}); now {fds:?}, before {base:?}",
        base.len(),
        live.len()
    );
    println!(
        "{label}: {} live containers, {published_loop}/{LOOP_VOLUMES} loop volumes published, \
         {} loop devices of the sandbox, {} fds",
        live.len(),
        loops.len(),
        fds.len()
    );
}

/// Every marker a container wrote is in its volume, with its content, and
/// there are no others.
async fn check_markers(ctx: &Ctx, expected: &BTreeMap<usize, BTreeSet<String>>) -> usize {
    let mut found = 0;
    for (i, v) in ctx.volumes.iter().enumerate() {
        let mp = v.provider.publish(&v.id, "load-check").await.unwrap();
        let mut seen = BTreeSet::new();
        for e in fs::read_dir(&mp).unwrap().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(c) = name.strip_prefix("marker-") {
                let text = fs::read_to_string(e.path()).unwrap();
                assert_eq!(text, format!("{c}\n"), "content of {name} in {}", v.name);
                seen.insert(c.to_string());
            }
        }
        let want = expected.get(&i).cloned().unwrap_or_default();
        let lost: Vec<_> = want.difference(&seen).collect();
        let extra: Vec<_> = seen.difference(&want).collect();
        assert!(
            lost.is_empty() && extra.is_empty(),
            "markers of {} ({}): lost {lost:?}, unexpected {extra:?}",
            v.name,
            v.id
        );
        found += seen.len();
        v.provider.release(&v.id, "load-check").await.unwrap();
    }
    found
}

/// `e2fsck -fn` on every ext4 image of the loop plugin: all clean.
fn fsck_images(provider: &StorageProvider) -> usize {
    fn images(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in fs::read_dir(dir).into_iter().flatten().flatten() {
            let p = e.path();
            let Ok(ft) = e.file_type() else { continue };
            if ft.is_dir() {
                images(&p, out);
            } else if ft.is_file() && p.extension().is_some_and(|x| x == "ext4") {
                out.push(p);
            }
        }
    }
    let mut found = Vec::new();
    images(&provider.layout().plugin_data_dir(), &mut found);
    assert_eq!(found.len(), LOOP_VOLUMES, "ext4 images: {found:?}");
    for image in &found {
        let out = std::process::Command::new("e2fsck")
            .arg("-fn")
            .arg(image)
            .output()
            .expect("run e2fsck (package e2fsprogs)");
        assert!(
            out.status.success(),
            "e2fsck -fn {}: {}\n{}{}",
            image.display(),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    found.len()
}

fn plugin_calls(path: &Path) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for line in fs::read_to_string(path).unwrap_or_default().lines() {
        let rpc = line.split_whitespace().next().unwrap_or("").to_string();
        *counts.entry(rpc).or_insert(0) += 1;
    }
    counts
}

fn ms(us: &AtomicU64, n: &AtomicU64) -> String {
    let n = n.load(Ordering::Relaxed).max(1);
    format!(
        "{:.1} ms",
        us.load(Ordering::Relaxed) as f64 / n as f64 / 1000.0
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn five_hundred_containers_leave_nothing_behind() {
    require_root();
    let seed = seed();
    println!("seed {seed:#x} (set {SEED_ENV} to replay)");
    let sb = Arc::new(Sandbox::new("load"));
    let plugins = PluginGuard {
        sb: sb.clone(),
        pids: Mutex::new(Vec::new()),
    };
    let mounts_before = host_mount_points(&sb);
    let loops_before = sb.loop_devices();
    assert!(
        loops_before.is_empty(),
        "a fresh sandbox has no loop devices"
    );
    let fds_at_start = open_fds();
    let started = Instant::now();

    // Two providers of the bundled plugin in one agent work dir.
    let work = sb.mkdir("work");
    let mut manager = Manager::new();
    let mut providers = Vec::new();
    for (name, args) in [("dir", vec![]), ("loop", vec!["--backing", "loop"])] {
        let mut args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        args.push("--log-calls".into());
        args.push(sb.join(format!("calls-{name}.log")).display().to_string());
        let mut c = bundled_config(Path::new(plugin_bin()), &work, name, &args);
        c.socket_dir = sb.join("s");
        let provider = StorageProvider::start(c).await.expect("start provider");
        plugins.register(&provider);
        manager.add(provider.clone());
        providers.push(provider);
    }
    let (dir_provider, loop_provider) = (providers[0].clone(), providers[1].clone());
    let mut volumes = Vec::new();
    for i in 0..VOLUMES {
        let name = format!("v{i:02}");
        let provider = if i < LOOP_VOLUMES {
            loop_provider.clone()
        } else {
            dir_provider.clone()
        };
        let resource = provider
            .create_volume(CreateSpec::new(&name, 16 * MIB))
            .await
            .unwrap_or_else(|e| panic!("create volume {name}: {e}"));
        let id = resource.source_id().unwrap().to_string();
        volumes.push(Volume {
            name,
            provider,
            id,
            resource,
        });
    }
    let isolator = VolumeIsolator::new(
        &work,
        Arc::new(manager),
        Arc::new(LinuxSyscall::new()),
        Arc::new(ProcMountTable::new()),
    );
    let rootfs = busybox_rootfs(&sb, "rootfs");
    let ctx = Arc::new(Ctx {
        sb: sb.clone(),
        work: work.clone(),
        rootfs,
        isolator,
        providers: providers.clone(),
        volumes,
        stats: Stats::default(),
    });
    // The runtime, both plugin connections and the providers are up.
    let fds_before = open_fds();
    let setup = started.elapsed();

    // The driver: picks operations with the seeded RNG and runs them as
    // concurrent tasks; a container is owned by at most one task at a time.
    let mut rng = StdRng::seed_from_u64(seed);
    let mut idle: Vec<Container> = Vec::new();
    let mut alive = 0usize;
    let (mut max_alive, mut alive_sum, mut decisions) = (0usize, 0usize, 0usize);
    let mut next = 0usize;
    let mut next_check = CHECK_EVERY;
    let mut markers: BTreeMap<usize, BTreeSet<String>> = BTreeMap::new();
    let mut pending_markers: BTreeMap<String, usize> = BTreeMap::new();
    let mut failures: Vec<String> = Vec::new();
    let mut tasks: JoinSet<Result<Done, String>> = JoinSet::new();
    let loop_start = Instant::now();
    loop {
        let draining = !failures.is_empty() || (next == next_check && next_check <= CONTAINERS);
        if draining || tasks.len() >= MAX_IN_FLIGHT {
            if let Some(joined) = tasks.join_next().await {
                handle(
                    joined,
                    &mut idle,
                    &mut alive,
                    &mut markers,
                    &mut pending_markers,
                    &mut failures,
                );
                continue;
            }
            if !failures.is_empty() {
                break;
            }
            if draining {
                check_consistent(&ctx, &idle, &fds_before, &format!("after {next} launches")).await;
                next_check += CHECK_EVERY;
                continue;
            }
        }
        if next == CONTAINERS && alive == 0 && tasks.is_empty() {
            break;
        }
        let can_launch = next < CONTAINERS && alive < MAX_ALIVE;
        let ending = next == CONTAINERS;
        let w_launch = if can_launch { 3 } else { 0 };
        let (w_update, w_cleanup) = if idle.is_empty() {
            (0, 0)
        } else if ending || alive >= MAX_ALIVE * 3 / 4 {
            (2, 3)
        } else {
            (2, 1)
        };
        let total = w_launch + w_update + w_cleanup;
        if total == 0 {
            match tasks.join_next().await {
                Some(joined) => {
                    handle(
                        joined,
                        &mut idle,
                        &mut alive,
                        &mut markers,
                        &mut pending_markers,
                        &mut failures,
                    );
                    continue;
                }
                None => panic!("the driver is stuck: nothing to do and nothing in flight"),
            }
        }
        let pick = rng.random_range(0..total);
        decisions += 1;
        alive_sum += alive;
        if pick < w_launch {
            let id = format!("c{next:03}");
            next += 1;
            alive += 1;
            max_alive = max_alive.max(alive);
            let k = rng.random_range(1..=MAX_VOLUMES_PER_CONTAINER);
            let mut vols = BTreeMap::new();
            for i in rand::seq::index::sample(&mut rng, VOLUMES, k) {
                vols.insert(i, rng.random_bool(0.5));
            }
            let rw: Vec<usize> = vols
                .iter()
                .filter(|(_, ro)| !**ro)
                .map(|(i, _)| *i)
                .collect();
            let marker = if rw.is_empty() {
                let first = *vols.keys().next().unwrap();
                vols.insert(first, false);
                first
            } else {
                rw[rng.random_range(0..rw.len())]
            };
            pending_markers.insert(id.clone(), marker);
            let plan = LaunchPlan {
                id,
                volumes: vols,
                marker,
                rootfs: rng.random_bool(0.5),
            };
            tasks.spawn(bounded("launch", launch_op(ctx.clone(), plan)));
        } else {
            let c = idle.swap_remove(rng.random_range(0..idle.len()));
            if pick < w_launch + w_update {
                let n = c.volumes.len();
                let add = n < MAX_VOLUMES_PER_CONTAINER && (n == 1 || rng.random_bool(0.5));
                let change = if add {
                    let free: Vec<usize> = (0..VOLUMES)
                        .filter(|i| !c.volumes.contains_key(i))
                        .collect();
                    Change::Add(free[rng.random_range(0..free.len())], rng.random_bool(0.5))
                } else {
                    let have: Vec<usize> = c.volumes.keys().copied().collect();
                    Change::Remove(have[rng.random_range(0..have.len())])
                };
                tasks.spawn(bounded("update", update_op(ctx.clone(), c, change)));
            } else {
                tasks.spawn(bounded("cleanup", cleanup_op(ctx.clone(), c)));
            }
        }
    }
    if !failures.is_empty() {
        panic!(
            "seed {seed:#x}: {} operation(s) failed:\n{}",
            failures.len(),
            failures.join("\n")
        );
    }
    let run = loop_start.elapsed();
    assert!(idle.is_empty() && alive == 0);

    // Everything cleaned up: the model, the providers, the scan agree.
    check_consistent(&ctx, &idle, &fds_before, "after the last cleanup").await;
    let marker_count = check_markers(&ctx, &markers).await;
    let images = fsck_images(&loop_provider);
    for v in &ctx.volumes {
        v.provider
            .destroy_volume(&v.id)
            .await
            .unwrap_or_else(|e| panic!("destroy {} ({}): {e}", v.name, v.id));
    }
    for p in &ctx.providers {
        assert!(p.volumes().await.is_empty(), "{} still has volumes", p.id());
    }
    let report = scan(&work, &ProcMountTable::new()).expect("status scan");
    assert!(
        report.volumes.is_empty() && report.unreadable.is_empty(),
        "status after destroy: {report:?}"
    );
    assert!(ctx.isolator.containers().await.is_empty());
    let fds_after = open_fds();

    // Shut everything down.
    for p in &ctx.providers {
        p.shutdown(Duration::from_secs(5)).await;
    }
    plugins.disarm();
    let stats = match Arc::try_unwrap(ctx) {
        Ok(ctx) => ctx.stats,
        Err(_) => panic!("a task still holds the context"),
    };
    drop((providers, dir_provider, loop_provider));
    let fds_at_end = open_fds();

    let s = &stats;
    let dir_calls = plugin_calls(&sb.join("calls-dir.log"));
    let loop_calls = plugin_calls(&sb.join("calls-loop.log"));
    let get = |c: &BTreeMap<String, usize>, k: &str| c.get(k).copied().unwrap_or(0);
    println!(
        "containers launched {}, updates {} ({} adds, {} removes), cleanups {}",
        s.launched.load(Ordering::Relaxed),
        s.updates.load(Ordering::Relaxed),
        s.updates_add.load(Ordering::Relaxed),
        s.updates_remove.load(Ordering::Relaxed),
        s.cleanups.load(Ordering::Relaxed),
    );
    println!(
        "mounts into containers {}, unmounts from running containers or with them {}; \
         plugin mounts: dir NodeStage {} NodePublish {} NodeUnpublish {} NodeUnstage {}, \
         loop NodeStage {} NodePublish {} NodeUnpublish {} NodeUnstage {}",
        s.container_mounts.load(Ordering::Relaxed),
        s.container_unmounts.load(Ordering::Relaxed),
        get(&dir_calls, "NodeStageVolume"),
        get(&dir_calls, "NodePublishVolume"),
        get(&dir_calls, "NodeUnpublishVolume"),
        get(&dir_calls, "NodeUnstageVolume"),
        get(&loop_calls, "NodeStageVolume"),
        get(&loop_calls, "NodePublishVolume"),
        get(&loop_calls, "NodeUnpublishVolume"),
        get(&loop_calls, "NodeUnstageVolume"),
    );
    println!(
        "containers alive at once: at most {max_alive}, {:.1} on average",
        alive_sum as f64 / decisions.max(1) as f64
    );
    println!("markers found {marker_count}, ext4 images clean {images}");
    println!(
        "elapsed: setup {:.2?}, run {:.2?}, total {:.2?}; per op: launch {} (prepare {}, exec {}; max {:.1} ms), \
         update {} (max {:.1} ms), cleanup {} (isolator {}; max {:.1} ms)",
        setup,
        run,
        started.elapsed(),
        ms(&s.launch_us, &s.launched),
        ms(&s.prepare_us, &s.launched),
        ms(&s.exec_us, &s.launched),
        s.launch_max_us.load(Ordering::Relaxed) as f64 / 1000.0,
        ms(&s.update_us, &s.updates),
        s.update_max_us.load(Ordering::Relaxed) as f64 / 1000.0,
        ms(&s.cleanup_us, &s.cleanups),
        ms(&s.isolator_cleanup_us, &s.cleanups),
        s.cleanup_max_us.load(Ordering::Relaxed) as f64 / 1000.0,
    );
    let providers_fds: Vec<&(i32, String)> = fds_before
        .iter()
        .filter(|fd| !fds_at_start.contains(fd))
        .collect();
    println!(
        "fds: at start {}, before the run {} (held by the providers: {providers_fds:?}), \
         after the run {}, at the end {}",
        fds_at_start.len(),
        fds_before.len(),
        fds_after.len(),
        fds_at_end.len()
    );

    assert_eq!(
        s.launched.load(Ordering::Relaxed),
        CONTAINERS as u64,
        "launched"
    );
    assert_eq!(
        s.cleanups.load(Ordering::Relaxed),
        CONTAINERS as u64,
        "cleaned up"
    );
    // The launcher's seed (see `check_consistent`) stays for the process's life.
    assert_eq!(
        without_seed(&fds_after),
        without_seed(&fds_before),
        "fds of the test process across the run"
    );
    assert_eq!(
        without_seed(&fds_at_end),
        without_seed(&fds_at_start),
        "fds of the test process once the providers are gone"
    );
    let procs = related_processes(&sb);
    assert!(procs.is_empty(), "processes left: {procs:#?}");
    assert_eq!(
        host_mount_points(&sb),
        mounts_before,
        "the host mount table changed"
    );
    sb.assert_no_mounts_under();
    sb.assert_no_loop_devices();
}

/// Routes a finished task's outcome into the driver's model.
fn handle(
    joined: Result<Result<Done, String>, tokio::task::JoinError>,
    idle: &mut Vec<Container>,
    alive: &mut usize,
    markers: &mut BTreeMap<usize, BTreeSet<String>>,
    pending: &mut BTreeMap<String, usize>,
    failures: &mut Vec<String>,
) {
    match joined {
        Ok(Ok(Done::Launched(c))) => {
            let vol = pending.remove(&c.id).expect("a planned launch");
            markers.entry(vol).or_default().insert(c.id.clone());
            idle.push(c);
        }
        Ok(Ok(Done::Updated(c))) => idle.push(c),
        Ok(Ok(Done::Cleaned)) => *alive -= 1,
        Ok(Err(e)) => failures.push(e),
        Err(e) => failures.push(format!("task panicked: {e}")),
    }
}

/// Runs an operation, bounded: a hung one fails the run instead of the
/// run hanging (the sandbox then kills what it left).
async fn bounded(
    op: &'static str,
    fut: impl std::future::Future<Output = Result<Done, String>>,
) -> Result<Done, String> {
    tokio::time::timeout(OP_TIMEOUT * 2, fut)
        .await
        .unwrap_or_else(|_| Err(format!("{op} did not finish within {:?}", OP_TIMEOUT * 2)))
}
