//! Hostile trees at the mount targets, end to end with real containers (as root, real namespaces):
//! - a symlink swapped in and out of a target (renameat2 RENAME_EXCHANGE in a tight loop) while the isolator
//!   launches a container or updates a running one: the class of runc's CVE-2021-30465. The mount must
//!   never land outside the container's tree, and nothing may leak once the container is gone;
//! - targets that are FIFOs, device nodes, regular files and hard links to host files: refused by name
//!   before anything is mounted, on launch and on update;
//! - a rootfs that is itself a symlink: resolved once; a rootfs resolving to `/` is refused.
//!
//! Every test compares the host mount table with the one before and checks the volumes end unpublished.

use csi_isolator::error_chain::FullMessage;
use std::ffi::CString;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use csi_isolator::isolator::ContainerConfig;
use csi_isolator::mount::{MountTable, ProcMountTable};
use csi_isolator::provider::VolumeState;
use csi_isolator::resource::{Resource, VolumeMode};
use csi_isolator_testing::{
    busybox_rootfs, host_mount_points, in_other_tests_temp, require_root, Sandbox,
};
use nix::sys::signal::Signal;

mod common;
use common::*;

/// Exchanges two paths (a directory and a symlink) as fast as it can until dropped.
struct Swapper {
    stop: Arc<AtomicBool>,
    swaps: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Swapper {
    fn start(a: &Path, b: &Path) -> Swapper {
        let stop = Arc::new(AtomicBool::new(false));
        let swaps = Arc::new(AtomicU64::new(0));
        let (a, b) = (
            CString::new(a.as_os_str().as_bytes()).unwrap(),
            CString::new(b.as_os_str().as_bytes()).unwrap(),
        );
        let thread = {
            let (stop, swaps) = (stop.clone(), swaps.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    // SAFETY: renameat2 with two valid NUL-terminated paths relative to the cwd; it only
                    // reads them.
                    let rc = unsafe {
                        libc::renameat2(
                            libc::AT_FDCWD,
                            a.as_ptr(),
                            libc::AT_FDCWD,
                            b.as_ptr(),
                            libc::RENAME_EXCHANGE,
                        )
                    };
                    if rc == 0 {
                        swaps.fetch_add(1, Ordering::Relaxed);
                    } else {
                        // One side may be missing for a moment (the isolator creating it): keep going.
                        std::thread::yield_now();
                    }
                }
            })
        };
        Swapper {
            stop,
            swaps,
            thread: Some(thread),
        }
    }

    fn stop(&mut self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
        self.swaps.load(Ordering::Relaxed)
    }
}

impl Drop for Swapper {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Who a published volume's mount is: (major, minor, root) of its mount at `target` on the host; every
/// bind of it shares them.
type Identity = (u32, u32, PathBuf);

fn identity(target: &Path) -> Identity {
    let m = ProcMountTable::new()
        .mounts()
        .unwrap()
        .into_iter()
        .rev()
        .find(|m| m.mount_point == target)
        .unwrap_or_else(|| panic!("{} is not mounted on the host", target.display()));
    (m.major, m.minor, m.root)
}

/// Mounts of the volume `id` in the mount namespace of `pid` that lie outside `allowed`. Copies of the
/// provider's own mounts in the work dir `work` (a container without a rootfs starts with a copy of the
/// host's table) are not, nor are copies of other tests' mounts under the temp dir outside `sb`: a
/// loop device that backed another test's volume when the copy was taken may back ours now, with
/// the same device number and root.
fn foreign_mounts(
    sb: &Sandbox,
    pid: u32,
    id: &Identity,
    work: &Path,
    allowed: &Path,
) -> Vec<PathBuf> {
    ProcMountTable::for_pid(pid)
        .mounts()
        .unwrap_or_else(|e| panic!("mountinfo of {pid}: {e}"))
        .into_iter()
        .filter(|m| (m.major, m.minor, &m.root) == (id.0, id.1, &id.2))
        .map(|m| m.mount_point)
        .filter(|p| !p.starts_with(work) && !p.starts_with(allowed))
        .filter(|p| !in_other_tests_temp(sb, p))
        .collect()
}

/// Where the provider publishes `volume` (its target on the host, canonical as the mount table has it).
fn published_target(agent: &Agent, volume: &Resource) -> PathBuf {
    let mp = agent.provider.mount_point(volume.source_id().unwrap());
    let parent = std::fs::canonicalize(mp.parent().unwrap()).unwrap();
    parent.join(mp.file_name().unwrap())
}

fn listing(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Prepares container `id`, starts `script` in it and isolates it (a running container `update` can
/// reach).
async fn start_isolated(
    agent: &Agent,
    sb: &Sandbox,
    id: &str,
    cfg: &ContainerConfig,
    script: &str,
) -> csi_isolator::launcher::Launched {
    let info = agent.isolator.prepare(id, cfg.clone()).await.unwrap();
    let running = start(sb, spec(cfg, &info, script)).await;
    agent.isolator.isolate(id, running.pid()).await.unwrap();
    running
}

/// Kills a container started by [`start_isolated`] and waits for it to be gone.
async fn kill_and_reap(sb: &Sandbox, mut running: csi_isolator::launcher::Launched) {
    running.kill(Signal::SIGKILL).unwrap();
    finish(sb, &mut running).await;
}

/// Kills a container started by [`start_isolated`] and cleans it up.
async fn kill_and_clean_up(
    agent: &Agent,
    sb: &Sandbox,
    id: &str,
    running: csi_isolator::launcher::Launched,
) {
    kill_and_reap(sb, running).await;
    agent.isolator.cleanup(id).await.unwrap();
}

async fn assert_unpublished(agent: &Agent, volumes: &[&Resource]) {
    for v in volumes {
        let id = v.source_id().unwrap();
        let state = agent.provider.volume(id).await.unwrap();
        assert_eq!(state.state, VolumeState::Created, "{id}: {state:?}");
        assert!(state.users.is_empty(), "{id}: {state:?}");
    }
}

#[tokio::test]
async fn a_symlink_swapped_in_while_updating_a_running_container_never_moves_the_mount_outside() {
    require_root();
    let sb = Sandbox::new("hostile-swap-update");
    let before = host_mount_points(&sb);
    let agent = Agent::start(&sb, "work", &[]).await;
    let vol = agent.volume("v", "data", VolumeMode::Rw).await;
    let ident = {
        let id = vol.source_id().unwrap();
        agent.provider.publish(id, "probe").await.unwrap();
        let ident = identity(&published_target(&agent, &vol));
        agent.provider.release(id, "probe").await.unwrap();
        ident
    };
    let work = fs::canonicalize(&agent.work).unwrap();
    let outside = sb.mkdir("outside");
    fs::write(outside.join("host-file"), "host").unwrap();

    let c1 = config(&sb, "c1", vec![], None);
    let running = start_isolated(&agent, &sb, "c1", &c1, "exec sleep 1000").await;
    let pid = running.pid();

    // The container's tree: `data` is a directory, `swap` a symlink to a host directory; a tight loop
    // exchanges the two names.
    fs::create_dir(c1.sandbox.join("data")).unwrap();
    symlink(&outside, c1.sandbox.join("swap")).unwrap();
    let mut swapper = Swapper::start(&c1.sandbox.join("data"), &c1.sandbox.join("swap"));

    let (mut added, mut removed, mut refused) = (0, 0, 0);
    for round in 0..40 {
        match agent.isolator.update("c1", vec![vol.clone()]).await {
            Ok(()) => added += 1,
            Err(e) => {
                refused += 1;
                eprintln!("round {round}: add refused: {e}");
            }
        }
        let foreign = foreign_mounts(&sb, pid, &ident, &work, &c1.sandbox);
        assert!(
            foreign.is_empty(),
            "round {round}: mounts outside the sandbox: {foreign:?}"
        );
        match agent.isolator.update("c1", vec![]).await {
            Ok(()) => {
                removed += 1;
                // Wherever the swaps moved the mount point to, the volume is gone from the container.
                let left: Vec<PathBuf> = ProcMountTable::for_pid(pid)
                    .mounts()
                    .unwrap()
                    .into_iter()
                    .map(|m| m.mount_point)
                    .filter(|p| p.starts_with(&c1.sandbox))
                    .collect();
                assert!(
                    left.is_empty(),
                    "round {round}: removed, yet mounted at {left:?}"
                );
            }
            Err(e) => {
                refused += 1;
                eprintln!("round {round}: remove refused: {e}");
            }
        }
        let foreign = foreign_mounts(&sb, pid, &ident, &work, &c1.sandbox);
        assert!(
            foreign.is_empty(),
            "round {round}: mounts outside the sandbox: {foreign:?}"
        );
    }
    let swaps = swapper.stop();
    eprintln!(
        "update under a swapping symlink: {added} adds, {removed} removes, {refused} refused, {swaps} swaps"
    );
    assert!(
        swaps > 100,
        "the swapper barely ran ({swaps} swaps): the race was not exercised"
    );
    assert!(added > 0 && removed > 0, "no update went through");
    assert_eq!(listing(&outside), vec!["host-file".to_string()]);
    assert_eq!(
        fs::read_to_string(outside.join("host-file")).unwrap(),
        "host"
    );

    kill_and_clean_up(&agent, &sb, "c1", running).await;
    assert_unpublished(&agent, &[&vol]).await;
    agent
        .provider
        .destroy_volume(vol.source_id().unwrap())
        .await
        .unwrap();
    agent.stop().await;
    assert_clean(&sb, &before);
}

#[tokio::test]
async fn a_symlink_swapped_in_while_launching_never_moves_the_mount_outside() {
    require_root();
    let sb = Sandbox::new("hostile-swap-launch");
    let before = host_mount_points(&sb);
    let agent = Agent::start(&sb, "work", &[]).await;
    let vol = agent.volume("v", "data", VolumeMode::Rw).await;
    let work = fs::canonicalize(&agent.work).unwrap();
    let outside = sb.mkdir("outside");

    let (mut launched, mut refused, mut swaps) = (0, 0, 0);
    for round in 0..20 {
        let id = format!("c{round}");
        let cfg = config(&sb, &id, vec![vol.clone()], None);
        fs::create_dir(cfg.sandbox.join("data")).unwrap();
        symlink(&outside, cfg.sandbox.join("swap")).unwrap();
        let mut swapper = Swapper::start(&cfg.sandbox.join("data"), &cfg.sandbox.join("swap"));
        let info = agent.isolator.prepare(&id, cfg.clone()).await.unwrap();
        // Taken each round: a volume staged again may sit on another loop device, and the
        // one it had may meanwhile back another test's volume.
        let ident = identity(&published_target(&agent, &vol));
        let spec = spec(&cfg, &info, "exec sleep 1000");
        let result = tokio::task::spawn_blocking(move || {
            csi_isolator::launcher::launch(&csi_isolator::mount::LinuxSyscall::new(), &spec)
        })
        .await
        .unwrap();
        swaps += swapper.stop();
        match result {
            Ok(mut running) => {
                launched += 1;
                sb.track(running.pid());
                let foreign = foreign_mounts(&sb, running.pid(), &ident, &work, &cfg.sandbox);
                assert!(
                    foreign.is_empty(),
                    "{id}: mounts outside the sandbox: {foreign:?}"
                );
                running.kill(Signal::SIGKILL).unwrap();
                finish(&sb, &mut running).await;
            }
            Err(e) => {
                refused += 1;
                eprintln!("{id}: launch refused: {e}");
            }
        }
        agent.isolator.cleanup(&id).await.unwrap();
    }
    eprintln!(
        "launch under a swapping symlink: {launched} launched, {refused} refused, {swaps} swaps"
    );
    assert!(swaps > 100, "the swapper barely ran ({swaps} swaps)");
    assert!(launched > 0, "no launch went through");
    assert!(listing(&outside).is_empty(), "{:?}", listing(&outside));
    assert_unpublished(&agent, &[&vol]).await;
    agent
        .provider
        .destroy_volume(vol.source_id().unwrap())
        .await
        .unwrap();
    agent.stop().await;
    assert_clean(&sb, &before);
}

/// A rootfs whose `/fifo`, `/null`, `/file` and `/hard` (a hard link to a file outside it) are not
/// directories, plus a sandbox FIFO.
fn hostile_targets(sb: &Sandbox, rootfs: &Path, sandbox: &Path) -> PathBuf {
    let secret = sb.join("secret");
    fs::write(&secret, "host secret").unwrap();
    nix::unistd::mkfifo(
        &rootfs.join("fifo"),
        nix::sys::stat::Mode::from_bits_truncate(0o644),
    )
    .unwrap();
    nix::sys::stat::mknod(
        &rootfs.join("null"),
        nix::sys::stat::SFlag::S_IFCHR,
        nix::sys::stat::Mode::from_bits_truncate(0o666),
        libc::makedev(1, 3),
    )
    .unwrap();
    fs::write(rootfs.join("file"), "plain").unwrap();
    fs::hard_link(&secret, rootfs.join("hard")).unwrap();
    nix::unistd::mkfifo(
        &sandbox.join("pipe"),
        nix::sys::stat::Mode::from_bits_truncate(0o644),
    )
    .unwrap();
    secret
}

#[tokio::test]
async fn targets_that_are_fifos_devices_files_or_hard_links_are_refused_by_name() {
    require_root();
    let sb = Sandbox::new("hostile-kinds");
    let before = host_mount_points(&sb);
    let agent = Agent::start(&sb, "work", &[]).await;
    let rootfs = busybox_rootfs(&sb, "rootfs");
    let probe = config(&sb, "probe", vec![], Some(rootfs.clone()));
    let secret = hostile_targets(&sb, &rootfs, &probe.sandbox);

    let cases = [
        ("/fifo", "a FIFO"),
        ("/null", "a character device"),
        ("/file", "a regular file"),
        ("/hard", "a regular file"),
        ("pipe", "a FIFO"),
    ];
    let mut tried = 0;
    for (i, (path, kind)) in cases.iter().enumerate() {
        let vol = agent.volume(&format!("k{i}"), path, VolumeMode::Rw).await;
        let id = format!("k{i}");
        let cfg = ContainerConfig {
            resources: vec![vol.clone()],
            ..probe.clone()
        };
        let info = agent.isolator.prepare(&id, cfg.clone()).await.unwrap();
        let spec = spec(&cfg, &info, "echo escaped > /fifo");
        let err = tokio::task::spawn_blocking(move || {
            csi_isolator::launcher::launch(&csi_isolator::mount::LinuxSyscall::new(), &spec)
        })
        .await
        .unwrap()
        .err()
        .unwrap_or_else(|| panic!("{path}: launched onto {kind}"));
        let text = err.full_message();
        assert!(
            text.contains(&format!("the target is {kind}, not a directory"))
                && text.contains(path.trim_start_matches('/')),
            "{path}: {text}"
        );
        agent.isolator.cleanup(&id).await.unwrap();
        assert_unpublished(&agent, &[&vol]).await;
        agent
            .provider
            .destroy_volume(vol.source_id().unwrap())
            .await
            .unwrap();
        tried += 1;
    }

    // The same on update: a running container gains a volume at a FIFO, refused, nothing changes.
    let vol = agent.volume("late", "/fifo", VolumeMode::Rw).await;
    let c1 = ContainerConfig {
        resources: vec![],
        ..probe.clone()
    };
    let running = start_isolated(&agent, &sb, "c1", &c1, "exec sleep 1000").await;
    let err = agent
        .isolator
        .update("c1", vec![vol.clone()])
        .await
        .unwrap_err();
    assert!(
        err.full_message()
            .contains("the target is a FIFO, not a directory"),
        "{err}"
    );
    assert_unpublished(&agent, &[&vol]).await;
    tried += 1;
    kill_and_clean_up(&agent, &sb, "c1", running).await;
    agent
        .provider
        .destroy_volume(vol.source_id().unwrap())
        .await
        .unwrap();

    eprintln!("non-directory targets refused: {tried}");
    assert_eq!(fs::read_to_string(&secret).unwrap(), "host secret");
    assert_eq!(fs::read_to_string(rootfs.join("file")).unwrap(), "plain");
    agent.stop().await;
    assert_clean(&sb, &before);
}

#[tokio::test]
async fn a_rootfs_given_through_a_symlink_is_resolved_once_and_never_the_host_root() {
    require_root();
    let sb = Sandbox::new("hostile-rootfs-link");
    let before = host_mount_points(&sb);
    let agent = Agent::start(&sb, "work", &[]).await;
    let real = busybox_rootfs(&sb, "images/busybox");
    let link = sb.join("rootfs");
    symlink(&real, &link).unwrap();
    let vol = agent.volume("v", "/data", VolumeMode::Rw).await;

    let c1 = config(&sb, "c1", vec![vol.clone()], Some(link.clone()));
    let info = agent.isolator.prepare("c1", c1.clone()).await.unwrap();
    let status = run(&sb, spec(&c1, &info, "echo through-link > /data/marker")).await;
    assert!(status.success());
    assert!(
        real.join("data").is_dir(),
        "the target was made in the real rootfs"
    );
    agent.isolator.cleanup("c1").await.unwrap();
    let id = vol.source_id().unwrap();
    let mp = agent.provider.publish(id, "check").await.unwrap();
    assert_eq!(
        fs::read_to_string(mp.join("marker")).unwrap(),
        "through-link\n"
    );
    agent.provider.release(id, "check").await.unwrap();

    // A rootfs that resolves to the host's root is refused before anything is mounted.
    let to_root = sb.join("rootfs-to-host");
    symlink("/", &to_root).unwrap();
    let host_data_before = Path::new("/data").exists();
    let c2 = config(&sb, "c2", vec![vol.clone()], Some(to_root.clone()));
    let info = agent.isolator.prepare("c2", c2.clone()).await.unwrap();
    let published_only = host_mount_points(&sb);
    let spec2 = spec(&c2, &info, "true");
    let err = tokio::task::spawn_blocking(move || {
        csi_isolator::launcher::launch(&csi_isolator::mount::LinuxSyscall::new(), &spec2)
    })
    .await
    .unwrap()
    .err()
    .unwrap_or_else(|| panic!("a rootfs resolving to / was accepted"));
    assert!(
        err.full_message()
            .contains("resolves to /, which cannot be a container's root"),
        "{err}"
    );
    // Refused before anything: no target made on the host, nothing mounted.
    assert_eq!(Path::new("/data").exists(), host_data_before);
    assert_eq!(host_mount_points(&sb), published_only);
    agent.isolator.cleanup("c2").await.unwrap();
    assert_unpublished(&agent, &[&vol]).await;
    agent.provider.destroy_volume(id).await.unwrap();
    agent.stop().await;
    assert_clean(&sb, &before);
}

#[tokio::test]
async fn an_update_is_refused_once_the_container_process_moved_to_another_mount_namespace() {
    require_root();
    let sb = Sandbox::new("hostile-ns-escape");
    let before = host_mount_points(&sb);
    let agent = Agent::start(&sb, "work", &[]).await;
    let vol = agent.volume("v", "data", VolumeMode::Rw).await;
    let c1 = config(&sb, "c1", vec![], None);
    // The workload leaves the namespace it was isolated in (same pid: unshare execs sleep).
    let running = start_isolated(
        &agent,
        &sb,
        "c1",
        &c1,
        "while [ ! -e go ]; do sleep 0.02; done; exec unshare -m --propagation private sleep 1000",
    )
    .await;
    let pid = running.pid();
    let ns_before = fs::read_link(format!("/proc/{pid}/ns/mnt")).unwrap();
    fs::write(c1.sandbox.join("go"), "").unwrap();
    let deadline = std::time::Instant::now() + TIMEOUT;
    while fs::read_link(format!("/proc/{pid}/ns/mnt")).unwrap() == ns_before {
        assert!(
            std::time::Instant::now() < deadline,
            "the workload never left its namespace"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }

    let err = agent
        .isolator
        .update("c1", vec![vol.clone()])
        .await
        .unwrap_err();
    assert!(
        err.full_message()
            .contains("moved to another mount namespace or root since it was isolated"),
        "{err}"
    );
    // Nothing was published or mounted for it.
    assert_unpublished(&agent, &[&vol]).await;
    assert!(ProcMountTable::for_pid(pid)
        .mounts()
        .unwrap()
        .iter()
        .all(|m| !m.mount_point.starts_with(&c1.sandbox)));

    kill_and_clean_up(&agent, &sb, "c1", running).await;
    agent
        .provider
        .destroy_volume(vol.source_id().unwrap())
        .await
        .unwrap();
    agent.stop().await;
    assert_clean(&sb, &before);
}

#[tokio::test]
async fn update_refuses_a_container_without_a_live_isolated_process() {
    require_root();
    let sb = Sandbox::new("hostile-pid");
    let before = host_mount_points(&sb);
    let agent = Agent::start(&sb, "work", &[]).await;
    let vol = agent.volume("v", "data", VolumeMode::Rw).await;
    let update = |id: &'static str| {
        let vol = vol.clone();
        let isolator = &agent.isolator;
        async move {
            isolator
                .update(id, vec![vol])
                .await
                .unwrap_err()
                .full_message()
        }
    };

    // Not isolated yet: no pid to mount into.
    let c1 = config(&sb, "c1", vec![], None);
    agent.isolator.prepare("c1", c1.clone()).await.unwrap();
    let err = update("c1").await;
    assert!(
        err.contains("has no known pid: call isolate first"),
        "{err}"
    );

    // "Isolated" with the agent's own pid: mounting there would mount on the host.
    agent
        .isolator
        .isolate("c1", std::process::id())
        .await
        .unwrap();
    let err = update("c1").await;
    assert!(
        err.contains("it is in the agent's own mount namespace"),
        "{err}"
    );

    // A process that is gone (killed and reaped).
    let c2 = config(&sb, "c2", vec![], None);
    let running = start_isolated(&agent, &sb, "c2", &c2, "exec sleep 1000").await;
    kill_and_reap(&sb, running).await;
    let err = update("c2").await;
    assert!(err.contains("no such process"), "{err}");

    // Nothing was published for any of them, nothing mounted on the host.
    assert_unpublished(&agent, &[&vol]).await;
    assert_eq!(host_mount_points(&sb), before);
    for id in ["c1", "c2"] {
        agent.isolator.cleanup(id).await.unwrap();
    }
    agent
        .provider
        .destroy_volume(vol.source_id().unwrap())
        .await
        .unwrap();
    agent.stop().await;
    assert_clean(&sb, &before);
}
