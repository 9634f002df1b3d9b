//! Root-only tests of the namespace launcher against the real kernel: volumes applied in a new mount
//! namespace, read-only binds, exit statuses, pid namespaces, pivot into a busybox rootfs (with hostile
//! symlinks at the targets), failures before exec, and mounting into / unmounting from a running container.
//!
//! Every test asserts that nothing is left mounted under its sandbox and that the host's mount table is
//! the same before and after; the `Sandbox` kills the workloads it tracks when dropped, pass or fail.

use csi_isolator::error_chain::FullMessage;
use std::ffi::OsString;
use std::fs;
use std::os::unix::fs::symlink;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::{Duration, Instant};

use csi_isolator::launcher::{self, inject, LaunchError, LaunchSpec, Launched};
use csi_isolator::mount::{MountTable, ProcMountTable};
use csi_isolator::mount::{TargetRoot, VolumeMount, SANDBOX_IN_ROOTFS};
use csi_isolator_testing::{busybox_rootfs, host_mount_points, require_root, Sandbox};
use nix::sys::signal::Signal;

mod common;
use common::{assert_clean, read};

const TIMEOUT: Duration = Duration::from_secs(20);

fn mount_points_of(pid: u32) -> Vec<PathBuf> {
    ProcMountTable::for_pid(pid)
        .mounts()
        .expect("read the container's mount table")
        .into_iter()
        .map(|m| m.mount_point)
        .collect()
}

fn volume(
    source: &Path,
    root: TargetRoot,
    target: &str,
    container_path: &str,
    readonly: bool,
    id: &str,
) -> VolumeMount {
    VolumeMount {
        source: source.to_path_buf(),
        source_root: None,
        root,
        target: PathBuf::from(target),
        container_path: container_path.to_string(),
        readonly,
        volume_id: Some(id.to_string()),
        provider_id: None,
        block: false,
        propagation: Default::default(),
        hardening: Default::default(),
    }
}

fn shell(sandbox: &Path, script: &str) -> LaunchSpec {
    LaunchSpec {
        argv: vec![
            OsString::from("sh"),
            OsString::from("-c"),
            OsString::from(script),
        ],
        env: vec![(OsString::from("PATH"), OsString::from("/usr/bin:/bin"))],
        sandbox: sandbox.to_path_buf(),
        ..LaunchSpec::default()
    }
}

/// Launches, registers the workload with the sandbox (killed on drop), and returns it.
fn start(sb: &Sandbox, spec: &LaunchSpec) -> Launched {
    let launched = launcher::launch(&csi_isolator::mount::LinuxSyscall::new(), spec)
        .unwrap_or_else(|e| panic!("launch: {e}"));
    sb.track(launched.pid());
    launched
}

/// Waits (bounded) for the workload to exit, then forgets its pid.
fn finish(sb: &Sandbox, launched: &mut Launched) -> ExitStatus {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        if let Some(status) = launched.try_wait().expect("try_wait") {
            sb.untrack(launched.pid());
            return status;
        }
        if Instant::now() > deadline {
            let _ = launched.kill(Signal::SIGKILL);
            panic!(
                "workload {} still running after {TIMEOUT:?}",
                launched.pid()
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn run(sb: &Sandbox, spec: &LaunchSpec) -> ExitStatus {
    let mut launched = start(sb, spec);
    finish(sb, &mut launched)
}

fn wait_for_file(path: &Path) -> String {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        if let Ok(text) = fs::read_to_string(path) {
            if !text.is_empty() {
                return text;
            }
        }
        assert!(
            Instant::now() < deadline,
            "{} did not appear within {TIMEOUT:?}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn workload_writes_into_its_volume_in_a_new_mount_namespace() {
    require_root();
    let sb = Sandbox::new("launch-rw");
    let sandbox = sb.mkdir("sandbox");
    let source = sb.mkdir("vol1");
    let before = host_mount_points(&sb);

    let mut spec = shell(
        &sandbox,
        &format!(
            "grep -q ' {sandbox}/data ' /proc/self/mountinfo || exit 3; echo hello > data/file; pwd > where",
            sandbox = sandbox.display()
        ),
    );
    spec.mounts = vec![volume(
        &source,
        TargetRoot::Sandbox,
        "data",
        "data",
        false,
        "vol-1",
    )];
    let status = run(&sb, &spec);

    assert_eq!(status.code(), Some(0), "workload failed: {status}");
    assert_eq!(read(&source.join("file")), "hello\n");
    assert_eq!(
        read(&sandbox.join("where")).trim(),
        sandbox.to_str().unwrap()
    );
    // The host never saw the mount: the target is an empty directory here.
    assert!(sandbox.join("data").is_dir());
    assert!(!sandbox.join("data/file").exists());
    assert_clean(&sb, &before);
}

#[test]
fn readonly_volume_refuses_writes() {
    require_root();
    let sb = Sandbox::new("launch-ro");
    let sandbox = sb.mkdir("sandbox");
    let source = sb.mkdir("vol1");
    fs::write(source.join("existing"), "keep").unwrap();
    let before = host_mount_points(&sb);

    let mut spec = shell(
        &sandbox,
        "cat data/existing > seen; touch data/new 2> err; echo $? > rc; echo x >> data/existing 2>> err; echo $? >> rc",
    );
    spec.mounts = vec![volume(
        &source,
        TargetRoot::Sandbox,
        "data",
        "data",
        true,
        "vol-ro",
    )];
    let status = run(&sb, &spec);

    assert_eq!(status.code(), Some(0), "workload failed: {status}");
    assert_eq!(read(&sandbox.join("seen")), "keep");
    let rcs: Vec<String> = read(&sandbox.join("rc"))
        .lines()
        .map(str::to_string)
        .collect();
    assert!(rcs.iter().all(|rc| rc != "0"), "a write succeeded: {rcs:?}");
    let err = read(&sandbox.join("err"));
    assert!(err.contains("Read-only file system"), "stderr: {err}");
    assert!(!source.join("new").exists());
    assert_eq!(read(&source.join("existing")), "keep");
    assert_clean(&sb, &before);
}

#[test]
fn exit_status_and_signals_pass_through() {
    require_root();
    let sb = Sandbox::new("launch-exit");
    let sandbox = sb.mkdir("sandbox");
    let before = host_mount_points(&sb);

    assert_eq!(run(&sb, &shell(&sandbox, "exit 7")).code(), Some(7));

    let mut sleeper = start(&sb, &shell(&sandbox, "exec sleep 100"));
    sleeper.kill(Signal::SIGKILL).expect("kill");
    let status = finish(&sb, &mut sleeper);
    assert_eq!(status.signal(), Some(libc::SIGKILL), "status {status}");
    assert!(matches!(
        sleeper.kill(Signal::SIGTERM),
        Err(LaunchError::Reaped { .. })
    ));
    assert_clean(&sb, &before);
}

#[test]
fn missing_program_is_reported_before_returning() {
    require_root();
    let sb = Sandbox::new("launch-noprog");
    let sandbox = sb.mkdir("sandbox");
    let spec = LaunchSpec {
        argv: vec![OsString::from("csi-isolator-no-such-program")],
        sandbox: sandbox.clone(),
        ..LaunchSpec::default()
    };
    let err = launcher::launch(&csi_isolator::mount::LinuxSyscall::new(), &spec)
        .expect_err("exec must fail");
    assert!(
        matches!(
            err,
            LaunchError::Exec {
                errno: nix::errno::Errno::ENOENT,
                ..
            }
        ),
        "{err}"
    );
    assert!(
        err.full_message().contains("csi-isolator-no-such-program"),
        "{err}"
    );
    sb.assert_no_mounts_under();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pid_namespace_makes_the_workload_pid_1() {
    require_root();
    let sb = Sandbox::new("launch-pidns");
    let sandbox = sb.mkdir("sandbox");
    let before = host_mount_points(&sb);

    let mut spec = shell(
        &sandbox,
        "echo $$ > pid; cat /proc/1/comm > comm; ls /proc > procs",
    );
    spec.pid_namespace = true;
    // From a multi-threaded tokio runtime, as `run` does it.
    let mut launched = tokio::task::spawn_blocking(move || {
        launcher::launch(&csi_isolator::mount::LinuxSyscall::new(), &spec)
    })
    .await
    .expect("join")
    .unwrap_or_else(|e| panic!("launch: {e}"));
    sb.track(launched.pid());
    let status = tokio::time::timeout(TIMEOUT, launched.wait_async())
        .await
        .expect("workload timed out")
        .expect("wait");
    sb.untrack(launched.pid());

    assert_eq!(status.code(), Some(0), "workload failed: {status}");
    assert_eq!(read(&sandbox.join("pid")).trim(), "1");
    assert_eq!(read(&sandbox.join("comm")).trim(), "sh");
    // A fresh proc: only the few processes of the new namespace are there.
    let pids = read(&sandbox.join("procs"))
        .split_whitespace()
        .filter(|e| e.chars().all(|c| c.is_ascii_digit()))
        .count();
    assert!(pids <= 3, "proc shows {pids} processes");
    assert_clean(&sb, &before);
}

#[test]
fn rootfs_pivot_shows_volumes_and_the_sandbox() {
    rootfs_pivot("launch-rootfs");
    assert_eq!(other_mount_namespaces("self").len(), 1, "no launch seed");
}

/// The same with the launch seed switched off (`CSI_ISOLATOR_LAUNCH_SEED=off`): the namespace is
/// copied from the test's, and no seed is made.
#[test]
fn rootfs_pivot_without_the_launch_seed() {
    // Before any launch of this process (each test runs in its own).
    std::env::set_var(launcher::SEED_ENV, "off");
    rootfs_pivot("launch-rootfs-noseed");
    assert!(
        other_mount_namespaces("self").is_empty(),
        "a launch seed was made"
    );
}

fn rootfs_pivot(label: &str) {
    require_root();
    let sb = Sandbox::new(label);
    let sandbox = sb.mkdir("sandbox");
    let rootfs = busybox_rootfs(&sb, "images/rootfs");
    let data = sb.mkdir("vol-data");
    fs::write(data.join("marker"), "data-volume").unwrap();
    let svol = sb.mkdir("vol-sandbox");
    fs::write(svol.join("marker"), "sandbox-volume").unwrap();
    let before = host_mount_points(&sb);

    let mut spec = shell(
        &sandbox,
        "pwd > pwd; cat /data/marker > seen-data; cat svol/marker > seen-svol; \
         echo $$ > pid; ls / > listing; echo written > /data/from-container",
    );
    spec.env = vec![(OsString::from("PATH"), OsString::from("/bin"))];
    spec.rootfs = Some(rootfs.clone());
    spec.pid_namespace = true;
    spec.mounts = vec![
        volume(
            &data,
            TargetRoot::Rootfs,
            "data",
            "/data",
            false,
            "vol-data",
        ),
        volume(
            &svol,
            TargetRoot::Sandbox,
            "svol",
            "svol",
            false,
            "vol-svol",
        ),
    ];
    let status = run(&sb, &spec);

    assert_eq!(status.code(), Some(0), "workload failed: {status}");
    assert_eq!(read(&sandbox.join("pwd")).trim(), SANDBOX_IN_ROOTFS);
    assert_eq!(read(&sandbox.join("seen-data")), "data-volume");
    assert_eq!(read(&sandbox.join("seen-svol")), "sandbox-volume");
    assert_eq!(read(&sandbox.join("pid")).trim(), "1");
    let listing = read(&sandbox.join("listing"));
    assert!(listing.lines().any(|l| l == "data"), "listing: {listing}");
    assert!(listing.lines().any(|l| l == "bin"), "listing: {listing}");
    assert_eq!(read(&data.join("from-container")), "written\n");
    // The target and the sandbox mount point were created inside the rootfs, nothing is mounted there.
    assert!(rootfs.join("data").is_dir());
    assert!(!rootfs.join("data/marker").exists());
    assert!(rootfs.join("mnt/mesos/sandbox").is_dir());
    assert_clean(&sb, &before);
}

/// The mount namespaces this process holds an fd of, other than its own: (fd, link).
fn other_mount_namespaces(pid: &str) -> Vec<(u32, String)> {
    let own = fs::read_link(format!("/proc/{pid}/ns/mnt")).unwrap();
    fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let link = fs::read_link(e.path()).ok()?;
            let fd = e.file_name().to_str()?.parse().ok()?;
            (link.to_string_lossy().starts_with("mnt:[") && link != own)
                .then(|| (fd, link.to_string_lossy().into_owned()))
        })
        .collect()
}

/// A container with a rootfs is built in a namespace unshared from the launch seed, which holds
/// two private mounts (its tmpfs and this process's /proc), not from the test's namespace: the
/// seed exists once a rootfs launch has run, holds exactly that, is close-on-exec, and the
/// workload holds no fd of it; the workload's mounts are its own (rootfs, sandbox, volume, proc).
#[test]
fn a_rootfs_container_is_built_from_the_seed() {
    require_root();
    let sb = Sandbox::new("launch-seed");
    let sandbox = sb.mkdir("sandbox");
    let rootfs = busybox_rootfs(&sb, "rootfs");
    let data = sb.mkdir("vol-data");
    let before = host_mount_points(&sb);
    assert!(
        other_mount_namespaces("self").is_empty(),
        "a namespace fd before any launch"
    );

    let mut spec = shell(&sandbox, "echo up > ready; exec sleep 30");
    spec.env = vec![(OsString::from("PATH"), OsString::from("/bin"))];
    spec.rootfs = Some(rootfs.clone());
    spec.pid_namespace = true;
    spec.mounts = vec![volume(
        &data,
        TargetRoot::Rootfs,
        "data",
        "/data",
        false,
        "vol-data",
    )];
    let mut launched = start(&sb, &spec);
    wait_for_file(&sandbox.join("ready"));

    let mut seen = mount_points_of(launched.pid());
    seen.sort();
    let want: Vec<PathBuf> = ["/", "/data", "/mnt/mesos/sandbox", "/proc"]
        .iter()
        .map(PathBuf::from)
        .collect();
    assert_eq!(seen, want, "the workload's mounts");
    assert!(
        other_mount_namespaces(&launched.pid().to_string()).is_empty(),
        "the workload holds a mount namespace fd"
    );

    let seeds = other_mount_namespaces("self");
    assert_eq!(seeds.len(), 1, "the seed, held once: {seeds:?}");
    let (fd, _) = seeds[0];
    // SAFETY: the fd is this process's, open for as long as the process runs (the seed's).
    let seed = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd as i32) };
    let flags = nix::fcntl::fcntl(seed, nix::fcntl::FcntlArg::F_GETFD).unwrap();
    assert!(
        nix::fcntl::FdFlag::from_bits_truncate(flags).contains(nix::fcntl::FdFlag::FD_CLOEXEC),
        "the seed's fd is inherited by children"
    );
    let table = csi_isolator::mount::ns::in_namespace(
        &csi_isolator::mount::LinuxSyscall::new(),
        seed,
        "read-seed",
        |_| fs::read_to_string("/proc/thread-self/mountinfo").unwrap(),
    )
    .unwrap();
    let lines: Vec<Vec<&str>> = table
        .lines()
        .map(|l| l.split(' ').collect::<Vec<_>>())
        .collect();
    assert_eq!(lines.len(), 2, "the seed's mounts: {table}");
    let at = |point: &str| {
        lines
            .iter()
            .find(|f| f[4] == point)
            .unwrap_or_else(|| panic!("{point} in the seed: {table}"))
    };
    let root = at("/");
    let dash = root.iter().position(|f| *f == "-").unwrap();
    assert_eq!(
        &root[dash + 1..dash + 3],
        ["tmpfs", "csi-isolator-seed"],
        "{table}"
    );
    for flag in ["nosuid", "nodev", "noexec"] {
        assert!(root[5].split(',').any(|f| f == flag), "{flag}: {table}");
    }
    assert_eq!(at("/proc")[dash + 1], "proc", "{table}");
    for f in &lines {
        // Optional fields (shared:N, master:N) sit between the options and the "-".
        let dash = f.iter().position(|x| *x == "-").unwrap();
        assert_eq!(dash, 6, "a seed mount is not private: {table}");
    }

    launched.kill(Signal::SIGKILL).unwrap();
    let _ = launched.wait();
    assert_clean(&sb, &before);
}

#[test]
fn symlinked_targets_stay_inside_the_rootfs() {
    require_root();
    let sb = Sandbox::new("launch-symlink");
    let sandbox = sb.mkdir("sandbox");
    // Deep enough that "../../.." from <rootfs>/deep lands at <sandbox root>/a, inside the test sandbox.
    let rootfs = busybox_rootfs(&sb, "a/b/rootfs");
    symlink("/etc", rootfs.join("etc-link")).unwrap();
    fs::create_dir(rootfs.join("deep")).unwrap();
    symlink("../../..", rootfs.join("deep/up")).unwrap();
    let marker = format!("csi-isolator-marker-{}", std::process::id());
    let vol1 = sb.mkdir("vol1");
    fs::write(vol1.join(&marker), "one").unwrap();
    let vol2 = sb.mkdir("vol2");
    fs::write(vol2.join(&marker), "two").unwrap();
    let before = host_mount_points(&sb);

    let mut spec = shell(
        &sandbox,
        &format!(
            "cat /etc-link/{m} > seen1; cat /etc/{m} > seen1-etc; cat /escaped/{m} > seen2; cat /deep/up/escaped/{m} > seen2-link",
            m = marker
        ),
    );
    spec.env = vec![(OsString::from("PATH"), OsString::from("/bin"))];
    spec.rootfs = Some(rootfs.clone());
    spec.mounts = vec![
        volume(
            &vol1,
            TargetRoot::Rootfs,
            "etc-link",
            "/etc-link",
            false,
            "vol-etc",
        ),
        volume(
            &vol2,
            TargetRoot::Rootfs,
            "deep/up/escaped",
            "/deep/up/escaped",
            false,
            "vol-up",
        ),
    ];
    let status = run(&sb, &spec);

    assert_eq!(status.code(), Some(0), "workload failed: {status}");
    assert_eq!(read(&sandbox.join("seen1")), "one");
    assert_eq!(read(&sandbox.join("seen1-etc")), "one");
    assert_eq!(read(&sandbox.join("seen2")), "two");
    assert_eq!(read(&sandbox.join("seen2-link")), "two");
    // Landed inside the rootfs: the targets were created there ...
    assert!(rootfs.join("etc").is_dir());
    assert!(rootfs.join("escaped").is_dir());
    // ... and not where the symlinks point on the host.
    assert!(!Path::new("/etc").join(&marker).exists());
    assert!(!sb.join("a/escaped").exists());
    assert!(!host_mount_points(&sb)
        .iter()
        .any(|p| p == Path::new("/etc")));
    assert_clean(&sb, &before);
}

#[test]
fn failing_mount_fails_the_launch_before_exec() {
    require_root();
    let sb = Sandbox::new("launch-fail");
    let sandbox = sb.mkdir("sandbox");
    let good = sb.mkdir("vol-good");
    let before = host_mount_points(&sb);

    let mut spec = shell(&sandbox, "touch ran");
    spec.mounts = vec![
        volume(
            &good,
            TargetRoot::Sandbox,
            "good",
            "good",
            false,
            "vol-good",
        ),
        volume(
            &sb.join("does-not-exist"),
            TargetRoot::Sandbox,
            "missing",
            "missing",
            false,
            "vol-missing",
        ),
    ];
    let err = launcher::launch(&csi_isolator::mount::LinuxSyscall::new(), &spec)
        .expect_err("a missing source must fail the launch");
    let message = err.full_message();
    assert!(matches!(err, LaunchError::CloneSource { .. }), "{message}");
    assert!(message.contains("vol-missing"), "{message}");
    assert!(message.contains("ENOENT"), "{message}");
    assert!(!sandbox.join("ran").exists(), "the workload ran");
    assert!(!sandbox.join("missing").exists(), "a target was created");
    assert_clean(&sb, &before);
}

#[test]
fn host_target_must_exist() {
    require_root();
    let sb = Sandbox::new("launch-host");
    let sandbox = sb.mkdir("sandbox");
    let source = sb.mkdir("vol");
    fs::write(source.join("marker"), "host-target").unwrap();
    let existing = sb.mkdir("host-dir");
    let before = host_mount_points(&sb);

    // An existing host path: mounted in the container's namespace only.
    let target = existing
        .strip_prefix("/")
        .unwrap()
        .to_str()
        .unwrap()
        .to_string();
    let mut spec = shell(
        &sandbox,
        &format!("cat {}/marker > seen", existing.display()),
    );
    spec.mounts = vec![volume(
        &source,
        TargetRoot::Host,
        &target,
        existing.to_str().unwrap(),
        false,
        "vol-h",
    )];
    assert_eq!(run(&sb, &spec).code(), Some(0));
    assert_eq!(read(&sandbox.join("seen")), "host-target");
    assert!(!existing.join("marker").exists());

    // A missing one is not created.
    let missing = sb.join("host-missing");
    let target = missing
        .strip_prefix("/")
        .unwrap()
        .to_str()
        .unwrap()
        .to_string();
    spec.mounts = vec![volume(
        &source,
        TargetRoot::Host,
        &target,
        missing.to_str().unwrap(),
        false,
        "vol-h2",
    )];
    let err = launcher::launch(&csi_isolator::mount::LinuxSyscall::new(), &spec)
        .expect_err("missing host target");
    // Said as what to do, not as a kernel error.
    assert!(
        matches!(err, LaunchError::TargetMissingOnHost { .. }),
        "{err}"
    );
    let text = err.full_message();
    assert!(
        text.contains("vol-h2") && text.contains("use a relative container path"),
        "{text}"
    );
    assert!(!missing.exists());
    assert_clean(&sb, &before);
}

#[test]
fn inject_into_a_running_container_and_take_it_away() {
    require_root();
    let sb = Sandbox::new("inject");
    let sandbox = sb.mkdir("sandbox");
    let source = sb.mkdir("vol");
    fs::write(source.join("ready"), "injected").unwrap();
    let before = host_mount_points(&sb);

    let spec = shell(
        &sandbox,
        "while [ ! -e data/ready ]; do sleep 0.1; done; cat data/ready > seen; \
         while [ -e data/ready ]; do sleep 0.1; done; echo gone > gone",
    );
    let mut container = start(&sb, &spec);
    let pid = container.pid();
    std::thread::sleep(Duration::from_millis(200));
    assert!(!sandbox.join("seen").exists());

    let m = volume(
        &source,
        TargetRoot::Sandbox,
        "data",
        "data",
        false,
        "vol-late",
    );
    inject::mount_into(&csi_isolator::mount::LinuxSyscall::new(), pid, &m, &sandbox)
        .unwrap_or_else(|e| panic!("mount_into: {e}"));
    assert_eq!(wait_for_file(&sandbox.join("seen")), "injected");
    let target = sandbox.join("data");
    assert!(
        mount_points_of(pid).contains(&target),
        "not mounted in the container"
    );
    assert_eq!(host_mount_points(&sb), before, "the host saw the mount");

    inject::unmount_from(
        &csi_isolator::mount::LinuxSyscall::new(),
        pid,
        &m,
        &sandbox,
        false,
    )
    .unwrap_or_else(|e| panic!("unmount_from: {e}"));
    let status = finish(&sb, &mut container);
    assert_eq!(status.code(), Some(0), "container failed: {status}");
    assert_eq!(read(&sandbox.join("gone")), "gone\n");
    assert!(
        source.join("ready").exists(),
        "the volume's data must survive"
    );
    assert_clean(&sb, &before);
}

#[test]
fn inject_into_a_pivoted_container_in_a_pid_namespace() {
    require_root();
    let sb = Sandbox::new("inject-rootfs");
    let sandbox = sb.mkdir("sandbox");
    let rootfs = busybox_rootfs(&sb, "rootfs");
    // A hostile symlink where the volume will go: must stay inside the rootfs.
    symlink("/etc", rootfs.join("late")).unwrap();
    let source = sb.mkdir("vol");
    fs::write(source.join("ready"), "late-volume").unwrap();
    let before = host_mount_points(&sb);

    let mut spec = shell(
        &sandbox,
        "while [ ! -e /late/ready ]; do sleep 0.1; done; cat /late/ready > seen; \
         touch /late/x 2> err && echo writable > mode || echo readonly > mode; \
         while [ -e /late/ready ]; do sleep 0.1; done; echo gone > gone",
    );
    spec.env = vec![(OsString::from("PATH"), OsString::from("/bin"))];
    spec.rootfs = Some(rootfs.clone());
    spec.pid_namespace = true;
    let mut container = start(&sb, &spec);
    let pid = container.pid();

    let m = volume(
        &source,
        TargetRoot::Rootfs,
        "late",
        "/late",
        true,
        "vol-late-ro",
    );
    inject::mount_into(
        &csi_isolator::mount::LinuxSyscall::new(),
        pid,
        &m,
        Path::new(SANDBOX_IN_ROOTFS),
    )
    .unwrap_or_else(|e| panic!("mount_into: {e}"));
    assert_eq!(wait_for_file(&sandbox.join("seen")), "late-volume");
    assert_eq!(wait_for_file(&sandbox.join("mode")), "readonly\n");
    assert!(!source.join("x").exists());
    assert!(
        rootfs.join("etc").is_dir(),
        "the symlink was followed inside the rootfs"
    );
    assert!(!Path::new("/etc/ready").exists());
    // Where it really landed, as the container sees it: its own /etc, inside the rootfs.
    assert_eq!(
        read(&PathBuf::from(format!("/proc/{pid}/root/etc/ready"))),
        "late-volume"
    );
    assert_eq!(host_mount_points(&sb), before, "the host saw the mount");

    inject::unmount_from(
        &csi_isolator::mount::LinuxSyscall::new(),
        pid,
        &m,
        Path::new(SANDBOX_IN_ROOTFS),
        false,
    )
    .unwrap_or_else(|e| panic!("unmount_from: {e}"));
    let status = finish(&sb, &mut container);
    assert_eq!(status.code(), Some(0), "container failed: {status}");
    assert_eq!(read(&sandbox.join("gone")), "gone\n");
    assert_clean(&sb, &before);
}

#[test]
fn inject_into_a_missing_process_names_it() {
    require_root();
    let sb = Sandbox::new("inject-missing");
    let source = sb.mkdir("vol");
    let m = volume(&source, TargetRoot::Sandbox, "data", "data", false, "vol-x");
    // pid_max is at most 2^22: this pid never exists.
    let pid = u32::MAX - 1;
    let err = inject::mount_into(
        &csi_isolator::mount::LinuxSyscall::new(),
        pid,
        &m,
        &sb.join("sandbox"),
    )
    .expect_err("no such process");
    assert!(matches!(err, LaunchError::OpenNamespace { .. }), "{err}");
    assert!(err.full_message().contains(&pid.to_string()), "{err}");
    sb.assert_no_mounts_under();
}

#[test]
fn file_volume_is_bound_onto_a_created_file() {
    require_root();
    let sb = Sandbox::new("launch-file");
    let sandbox = sb.mkdir("sandbox");
    let vol = sb.mkdir("vol");
    let source = vol.join("config");
    fs::write(&source, "from-the-volume").unwrap();
    let before = host_mount_points(&sb);

    let mut spec = shell(&sandbox, "cat etc/config > seen; echo changed > etc/config");
    spec.mounts = vec![volume(
        &source,
        TargetRoot::Sandbox,
        "etc/config",
        "etc/config",
        false,
        "vol-file",
    )];
    assert_eq!(run(&sb, &spec).code(), Some(0));

    assert_eq!(read(&sandbox.join("seen")), "from-the-volume");
    assert_eq!(read(&source), "changed\n");
    // The mount point was created as an empty file, and is still one on the host.
    assert!(sandbox.join("etc/config").is_file());
    assert_eq!(read(&sandbox.join("etc/config")), "");
    assert_clean(&sb, &before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_launches_from_a_busy_runtime() {
    require_root();
    let sb = Sandbox::new("launch-many");
    let before = host_mount_points(&sb);
    // Keep the allocator and its locks busy on other threads while the launcher forks.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let churn: Vec<_> = (0..3)
        .map(|_| {
            let stop = stop.clone();
            tokio::spawn(async move {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let v: Vec<String> = (0..256).map(|i| i.to_string()).collect();
                    std::hint::black_box(v);
                    tokio::task::yield_now().await;
                }
            })
        })
        .collect();

    let mut tasks = Vec::new();
    for i in 0..16 {
        let sandbox = sb.mkdir(format!("sandbox-{i}"));
        let source = sb.mkdir(format!("vol-{i}"));
        let mut spec = shell(&sandbox, &format!("echo {i} > data/out"));
        spec.mounts = vec![volume(
            &source,
            TargetRoot::Sandbox,
            "data",
            "data",
            false,
            "vol",
        )];
        tasks.push(tokio::task::spawn_blocking(move || {
            let mut launched = launcher::launch(&csi_isolator::mount::LinuxSyscall::new(), &spec)
                .map_err(|e| e.full_message())?;
            let status = launched.wait().map_err(|e| e.full_message())?;
            Ok::<_, String>((source, status))
        }));
    }
    for (i, task) in tasks.into_iter().enumerate() {
        let (source, status) = tokio::time::timeout(TIMEOUT, task)
            .await
            .expect("launch timed out")
            .expect("join")
            .unwrap_or_else(|e| panic!("launch {i}: {e}"));
        assert_eq!(status.code(), Some(0), "workload {i}: {status}");
        assert_eq!(read(&source.join("out")).trim(), i.to_string());
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for c in churn {
        c.await.expect("churn task");
    }
    assert_clean(&sb, &before);
}

#[test]
fn unmount_from_takes_only_the_volumes_own_mount() {
    require_root();
    let sys = csi_isolator::mount::LinuxSyscall::new();
    let sb = Sandbox::new("inject-identity");
    let sandbox = sb.mkdir("sandbox");
    let (a, b) = (sb.mkdir("vol-a"), sb.mkdir("vol-b"));
    let before = host_mount_points(&sb);
    let mut container = start(
        &sb,
        &shell(&sandbox, "while [ ! -e stop ]; do sleep 0.05; done"),
    );
    let pid = container.pid();

    let a_data = volume(&a, TargetRoot::Sandbox, "data", "data", false, "vol-a");
    let a_copy = volume(&a, TargetRoot::Sandbox, "copy", "copy", false, "vol-a");
    let b_data = volume(&b, TargetRoot::Sandbox, "data", "data", false, "vol-b");
    for m in [&a_data, &a_copy, &b_data] {
        inject::mount_into(&sys, pid, m, &sandbox).unwrap_or_else(|e| panic!("mount_into: {e}"));
    }
    let count = |p: &Path| mount_points_of(pid).iter().filter(|m| *m == p).count();
    let (data, copy) = (sandbox.join("data"), sandbox.join("copy"));
    assert_eq!((count(&data), count(&copy)), (2, 1));

    // vol-b is on top of vol-a at data: taking vol-a there is refused, nothing is unmounted.
    let err = inject::unmount_from(&sys, pid, &a_data, &sandbox, true).unwrap_err();
    assert!(matches!(err, LaunchError::NotTheVolume { .. }), "{err}");
    assert!(err.full_message().contains("not the volume's"), "{err}");
    assert_eq!((count(&data), count(&copy)), (2, 1));

    // In order: vol-b, then vol-a at data; its other mount at copy stays (the sweep is off).
    inject::unmount_from(&sys, pid, &b_data, &sandbox, false).unwrap();
    assert_eq!((count(&data), count(&copy)), (1, 1));
    inject::unmount_from(&sys, pid, &a_data, &sandbox, true).unwrap();
    assert_eq!((count(&data), count(&copy)), (0, 1));
    // Nothing left at data: done, again.
    inject::unmount_from(&sys, pid, &a_data, &sandbox, true).unwrap();
    inject::unmount_from(&sys, pid, &a_copy, &sandbox, false).unwrap();
    assert_eq!(count(&copy), 0);

    fs::write(sandbox.join("stop"), "").unwrap();
    let status = finish(&sb, &mut container);
    assert_eq!(status.code(), Some(0), "container failed: {status}");
    assert_clean(&sb, &before);
}
