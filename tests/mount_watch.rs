//! The mount watch against the real kernel, and ensure-all driven by it: a volume unmounted behind
//! the provider's back (by another process, `umount` or `umount -l`) is found and repaired by the
//! next launch, with fanotify mount events and with the mountinfo poll; mounts that are not ours
//! mark nothing; a launch with nothing changed checks no other volume. Root only; real mounts,
//! the real bundled plugin (dir backing).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use csi_isolator::mount::{
    FanotifyWatch, LinuxSyscall, MountChanges, MountError, MountInfo, MountTable, MountWatch,
    PollWatch, ProcMountTable, RootCheck, WatchMode,
};
use csi_isolator::provider::bundled::bundled_config;
use csi_isolator::provider::{CreateSpec, ProviderConfig, StorageProvider};
use csi_isolator_testing::files::is_mounted;
use csi_isolator_testing::{plugin_bin, require_root, Sandbox};

fn config(work: &Path) -> ProviderConfig {
    let args = vec!["--backing".to_string(), "dir".to_string()];
    let mut c = bundled_config(Path::new(plugin_bin()), work, "default", &args);
    c.ready_timeout = Duration::from_secs(10);
    c.socket_dir = work.parent().unwrap().join("s");
    c
}

/// The real table, counting the mount checks (one statx each) asked of it.
#[derive(Debug, Default)]
struct CountingTable {
    inner: ProcMountTable,
    checks: AtomicUsize,
}

impl CountingTable {
    fn taken(&self) -> usize {
        self.checks.swap(0, Ordering::SeqCst)
    }
}

impl MountTable for CountingTable {
    fn mounts(&self) -> Result<Vec<MountInfo>, MountError> {
        self.inner.mounts()
    }
    fn is_mount_root(&self, path: &Path) -> Result<bool, MountError> {
        self.checks.fetch_add(1, Ordering::SeqCst);
        self.inner.is_mount_root(path)
    }
    fn check_mount_root(&self, path: &Path) -> Result<RootCheck, MountError> {
        self.checks.fetch_add(1, Ordering::SeqCst);
        self.inner.check_mount_root(path)
    }
}

fn watch_of(mode: WatchMode) -> Box<dyn MountWatch> {
    match mode {
        WatchMode::Fanotify => Box::new(
            FanotifyWatch::open().expect("fanotify mount events (this suite needs Linux 6.15+)"),
        ),
        WatchMode::Poll => Box::new(PollWatch::open().expect("poll /proc/self/mountinfo")),
        WatchMode::None => Box::new(csi_isolator::mount::NoWatch),
    }
}

fn run(cmd: &mut Command) {
    let status = cmd.status().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(status.success(), "{cmd:?}: {status}");
}

/// A bind mount of a fresh directory onto another, in the sandbox; its unique mount id.
fn bind(sb: &Sandbox, name: &str) -> (PathBuf, u64) {
    let from = sb.mkdir(format!("{name}-from"));
    let onto = sb.mkdir(format!("{name}-onto"));
    run(Command::new("mount").arg("--bind").arg(&from).arg(&onto));
    let check = ProcMountTable::new().check_mount_root(&onto).unwrap();
    assert!(check.mounted, "{} mounted", onto.display());
    (onto, check.unique_id.expect("statx STATX_MNT_ID_UNIQUE"))
}

fn detached(changes: MountChanges) -> Vec<u64> {
    match changes {
        MountChanges::Detached(ids) => ids,
        other => panic!("expected detach events, got {other:?}"),
    }
}

#[test]
fn fanotify_reports_the_detach_by_another_process_once_its_umount_has_returned() {
    require_root();
    let sb = Sandbox::new("watch-fan");
    let watch = FanotifyWatch::open().expect("fanotify mount events on Linux 6.15+");
    let (plain, plain_id) = bind(&sb, "plain");
    let (lazy, lazy_id) = bind(&sb, "lazy");
    // Attach events are not reported.
    let _ = watch.changes();
    run(Command::new("umount").arg(&plain));
    // Nothing waited for: the event was queued before umount(2) returned to the other process.
    let ids = detached(watch.changes());
    assert!(ids.contains(&plain_id), "{ids:?} lacks {plain_id}");
    assert!(!ids.contains(&lazy_id));
    run(Command::new("umount").arg("-l").arg(&lazy));
    let ids = detached(watch.changes());
    assert!(ids.contains(&lazy_id), "{ids:?} lacks {lazy_id}");
    assert!(!ids.contains(&plain_id), "an event is read once");
    sb.assert_no_mounts_under();
}

#[test]
fn fanotify_reports_every_mount_of_a_subtree_detached_lazily() {
    require_root();
    let sb = Sandbox::new("watch-tree");
    let watch = FanotifyWatch::open().unwrap();
    let (top, top_id) = bind(&sb, "top");
    let inner = top.join("inner");
    std::fs::create_dir(&inner).unwrap();
    let src = sb.mkdir("inner-src");
    run(Command::new("mount").arg("--bind").arg(&src).arg(&inner));
    let inner_id = ProcMountTable::new()
        .check_mount_root(&inner)
        .unwrap()
        .unique_id
        .unwrap();
    let _ = watch.changes();
    run(Command::new("umount").arg("-l").arg(&top));
    let ids = detached(watch.changes());
    assert!(
        ids.contains(&top_id) && ids.contains(&inner_id),
        "{ids:?} lacks {top_id} or {inner_id}"
    );
    sb.assert_no_mounts_under();
}

#[test]
fn the_mountinfo_poll_reports_a_change_as_unknown() {
    require_root();
    let sb = Sandbox::new("watch-poll");
    let watch = PollWatch::open().unwrap();
    let (onto, _) = bind(&sb, "p");
    assert_eq!(watch.changes(), MountChanges::Unknown);
    run(Command::new("umount").arg(&onto));
    assert_eq!(watch.changes(), MountChanges::Unknown);
    sb.assert_no_mounts_under();
}

/// A provider with `n` volumes each in use by its own container, watched as `mode` says, after
/// one launch has settled what the first sweep after a start checks.
async fn provider_in_use(
    sb: &Sandbox,
    mode: WatchMode,
    n: usize,
) -> (Arc<StorageProvider>, Arc<CountingTable>, Vec<String>) {
    let work = sb.mkdir("work");
    let table = Arc::new(CountingTable::default());
    let p = StorageProvider::start_watched(
        config(&work),
        Arc::new(LinuxSyscall::new()),
        table.clone(),
        watch_of(mode),
    )
    .await
    .expect("start the provider");
    assert_eq!(p.mount_watch_mode(), mode);
    let mut ids = Vec::new();
    for i in 0..n {
        let r = p
            .create_volume(CreateSpec::new(format!("v{i}"), 1 << 20))
            .await
            .unwrap();
        let id = r.source_id().unwrap().to_string();
        p.publish_for_container(&format!("c{i}"), std::slice::from_ref(&id))
            .await
            .unwrap();
        ids.push(id);
    }
    table.taken();
    (p, table, ids)
}

async fn tear_down(sb: &Sandbox, p: Arc<StorageProvider>, ids: &[String]) {
    for (i, id) in ids.iter().enumerate() {
        p.release_container(&format!("c{i}")).await.unwrap();
        p.destroy_volume(id).await.unwrap();
    }
    p.shutdown(Duration::from_secs(5)).await;
    sb.assert_no_mounts_under();
}

async fn unmounted_behind_the_back_is_repaired_by_the_next_launch(mode: WatchMode, lazy: bool) {
    require_root();
    let sb = Sandbox::new("watch-repair");
    let (p, _, ids) = provider_in_use(&sb, mode, 3).await;
    let target = p.mount_point(&ids[1]);
    let mut umount = Command::new("umount");
    if lazy {
        umount.arg("-l");
    }
    run(umount.arg(&target));
    assert!(!is_mounted(&target));
    // The next launch (container c0 again, which uses another volume) repairs it.
    p.publish_for_container("c0", std::slice::from_ref(&ids[0]))
        .await
        .unwrap();
    assert!(is_mounted(&target), "{mode:?}: repaired by the next launch");
    // And again, its new mount being the one watched now.
    run(Command::new("umount").arg(&target));
    p.publish_for_container("c0", std::slice::from_ref(&ids[0]))
        .await
        .unwrap();
    assert!(is_mounted(&target), "{mode:?}: repaired a second time");
    tear_down(&sb, p, &ids).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fanotify_an_unmounted_target_is_repaired_by_the_next_launch() {
    unmounted_behind_the_back_is_repaired_by_the_next_launch(WatchMode::Fanotify, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fanotify_a_lazily_unmounted_target_is_repaired_by_the_next_launch() {
    unmounted_behind_the_back_is_repaired_by_the_next_launch(WatchMode::Fanotify, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poll_an_unmounted_target_is_repaired_by_the_next_launch() {
    unmounted_behind_the_back_is_repaired_by_the_next_launch(WatchMode::Poll, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poll_a_lazily_unmounted_target_is_repaired_by_the_next_launch() {
    unmounted_behind_the_back_is_repaired_by_the_next_launch(WatchMode::Poll, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_fanotify_a_launch_checks_only_its_own_volume_whatever_else_mounts_on_the_host() {
    require_root();
    let sb = Sandbox::new("watch-count");
    let (p, table, ids) = provider_in_use(&sb, WatchMode::Fanotify, 6).await;
    // Nothing changed: the launch checks its own volume, none of the five others.
    p.publish_for_container("c0", std::slice::from_ref(&ids[0]))
        .await
        .unwrap();
    assert_eq!(table.taken(), 1);
    // Mounts come and go elsewhere on the host (here in the sandbox; other processes' too):
    // none is ours, nothing is marked.
    for i in 0..3 {
        let (onto, _) = bind(&sb, &format!("foreign{i}"));
        run(Command::new("umount").arg(&onto));
    }
    p.publish_for_container("c0", std::slice::from_ref(&ids[0]))
        .await
        .unwrap();
    assert_eq!(table.taken(), 1);
    // One of ours goes: the launch checks it too, and only it.
    run(Command::new("umount").arg(p.mount_point(&ids[3])));
    p.publish_for_container("c0", std::slice::from_ref(&ids[0]))
        .await
        .unwrap();
    // Its own, volume 3's, and the statx that learns volume 3's new mount.
    assert_eq!(table.taken(), 3);
    assert!(is_mounted(&p.mount_point(&ids[3])));
    tear_down(&sb, p, &ids).await;
}

/// Enough mounts and unmounts in the sandbox to overflow a fanotify queue of the kernel's
/// default bound (`/proc/sys/fs/fanotify/max_queued_events`): two events per pair.
fn flood(sb: &Sandbox) {
    let bound: usize = std::fs::read_to_string("/proc/sys/fs/fanotify/max_queued_events")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(16384);
    let (from, onto) = (sb.mkdir("flood-from"), sb.mkdir("flood-onto"));
    for _ in 0..bound / 2 + 64 {
        nix::mount::mount(
            Some(&from),
            &onto,
            None::<&str>,
            nix::mount::MsFlags::MS_BIND,
            None::<&str>,
        )
        .expect("bind for the flood");
        nix::mount::umount2(&onto, nix::mount::MntFlags::empty()).expect("unbind for the flood");
    }
}

#[test]
fn a_fanotify_queue_overflow_is_unknown_not_nothing() {
    require_root();
    let sb = Sandbox::new("watch-flood");
    let watch = FanotifyWatch::open().unwrap();
    flood(&sb);
    assert_eq!(watch.changes(), MountChanges::Unknown);
    // Read out: the next look starts clean.
    let (onto, id) = bind(&sb, "after");
    run(Command::new("umount").arg(&onto));
    assert!(detached(watch.changes()).contains(&id));
    sb.assert_no_mounts_under();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unmount_lost_in_an_overflow_is_still_repaired_by_the_next_launch() {
    require_root();
    let sb = Sandbox::new("watch-lost");
    let (p, table, ids) = provider_in_use(&sb, WatchMode::Fanotify, 3).await;
    let target = p.mount_point(&ids[2]);
    // The queue is full first, so the kernel drops the detach event of the target.
    flood(&sb);
    run(Command::new("umount").arg(&target));
    p.publish_for_container("c0", std::slice::from_ref(&ids[0]))
        .await
        .unwrap();
    assert!(is_mounted(&target), "repaired by the full sweep");
    // The full sweep checked every volume in use.
    assert!(table.taken() >= 3);
    tear_down(&sb, p, &ids).await;
}
