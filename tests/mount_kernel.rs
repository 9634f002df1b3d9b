//! `crate::mount` against the real kernel: bind mounts, read-only remounts, propagation, unmount retries,
//! the new mount API, resolution inside a hostile root, and loop devices with ext4.
//!
//! Needs root. Every test works in its own temp dir, and a guard unmounts everything below it and detaches
//! its loop devices when the test ends, pass or fail; each test also asserts that nothing is left mounted.

use csi_isolator::error_chain::FullMessage;
use std::fs;
use std::io::Write;
use std::os::fd::AsFd;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use csi_isolator::mount::resolve::{create_in_root_fallback, open_in_root_fallback};
use csi_isolator::mount::{
    self, create_in_root, fd_path, open_in_root, unmount_all_under, unmount_with_retry,
    LinuxSyscall, MountError, MountFlags, MountTable, ProcMountTable, Propagation, Syscall,
    UnmountOutcome,
};
use nix::errno::Errno;

fn require_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "tests/mount_kernel.rs needs root (mounts, loop devices): run it as root"
    );
}

/// A unique temp dir whose mounts and loop devices are torn down on drop.
struct Sandbox {
    dir: tempfile::TempDir,
    /// The canonical path (what mountinfo shows).
    path: PathBuf,
}

impl Sandbox {
    fn new() -> Self {
        require_root();
        let dir = tempfile::Builder::new()
            .prefix("mount-kernel-")
            .tempdir()
            .unwrap();
        let path = fs::canonicalize(dir.path()).unwrap();
        Sandbox { dir, path }
    }

    fn mkdir(&self, rel: &str) -> PathBuf {
        let p = self.path.join(rel);
        fs::create_dir_all(&p).unwrap();
        p
    }

    fn mounts(&self) -> Vec<mount::MountInfo> {
        ProcMountTable::new().mounts_under(&self.path).unwrap()
    }

    fn assert_clean(&self) {
        let left = self.mounts();
        assert!(
            left.is_empty(),
            "mounts left under {}: {left:#?}",
            self.path.display()
        );
        let loops = mount::find_backed_under(&self.path).unwrap();
        assert!(loops.is_empty(), "loop devices left: {loops:?}");
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        if let Err(e) = unmount_all_under(&LinuxSyscall, &ProcMountTable::new(), &self.path) {
            eprintln!("cleanup: {e}");
        }
        // Anything still there (e.g. an unmount failed): detach lazily.
        for m in ProcMountTable::new()
            .mounts_under(&self.path)
            .unwrap_or_default()
        {
            let _ = LinuxSyscall.unmount(&m.mount_point, true);
        }
        for (device, _) in mount::find_backed_under(&self.path).unwrap_or_default() {
            let _ = mount::detach(&device);
        }
        let _ = &self.dir;
    }
}

fn write_file(path: &Path, text: &str) -> std::io::Result<()> {
    let mut f = fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .open(path)?;
    f.write_all(text.as_bytes())
}

fn erofs(result: std::io::Result<()>) -> bool {
    matches!(result, Err(e) if e.raw_os_error() == Some(libc::EROFS))
}

#[test]
fn bind_mount_and_readonly_remount() {
    let sb = Sandbox::new();
    let src = sb.mkdir("src");
    let dst = sb.mkdir("dst");
    write_file(&src.join("f"), "hello").unwrap();
    let sys = LinuxSyscall;

    sys.bind_mount(&src, &dst, false).unwrap();
    let table = ProcMountTable::new();
    let m = table
        .find(&dst)
        .unwrap()
        .expect("bind mount is in the table");
    assert!(!m.is_readonly());
    assert_eq!(fs::read_to_string(dst.join("f")).unwrap(), "hello");
    write_file(&dst.join("g"), "rw").unwrap();

    sys.remount_bind_readonly(&dst).unwrap();
    assert!(table.find(&dst).unwrap().unwrap().is_readonly());
    assert!(
        erofs(write_file(&dst.join("f"), "x")),
        "write on a read-only bind must fail with EROFS"
    );
    // Only the bind is read-only, not the source.
    write_file(&src.join("f"), "changed").unwrap();
    assert_eq!(fs::read_to_string(dst.join("f")).unwrap(), "changed");

    assert_eq!(
        unmount_with_retry(&sys, &dst, 3, Duration::from_millis(10)).unwrap(),
        UnmountOutcome::Unmounted
    );
    sb.assert_clean();
}

/// `status` asks about thousands of mount points at once, each volume's target and staging path
/// under its provider's `mounts/`: the statx answers are the table's, entry by entry.
#[test]
fn thousands_of_mount_points_are_answered_as_the_table_says() {
    let sb = Sandbox::new();
    let sys = LinuxSyscall;
    let src = sb.mkdir("src");
    let leaves = ["target", "staging"];
    // Two providers' `mounts/`, 2,500 volumes each, a target and a staging path per volume; a
    // few of them bind-mounted, spread over both.
    let mut paths = Vec::new();
    for provider in ["a", "b"] {
        for i in 0..2500 {
            for leaf in leaves {
                paths.push(sb.mkdir(&format!("{provider}/mounts/v{i:04}/{leaf}")));
            }
        }
    }
    let mounted: Vec<usize> = (0..paths.len()).step_by(997).collect();
    for &i in &mounted {
        sys.bind_mount(&src, &paths[i], false).unwrap();
    }
    let table = ProcMountTable::new();
    let listed: std::collections::HashSet<PathBuf> = table
        .mounts()
        .unwrap()
        .into_iter()
        .map(|m| m.mount_point)
        .collect();
    let names: Vec<String> = (0..2500).map(|i| format!("v{i:04}")).collect();
    for (p, provider) in ["a", "b"].into_iter().enumerate() {
        // Every volume, and one whose directory does not exist (both false).
        let mut entries: Vec<&str> = names.iter().map(String::as_str).collect();
        entries.push("gone");
        let dir = sb.path.join(provider).join("mounts");
        let answers = table.mount_points_beneath(&dir, &entries, &leaves).unwrap();
        let expected: Vec<bool> = (0..2500 * 2)
            .map(|i| mounted.contains(&(p * 5000 + i)))
            .chain([false, false])
            .collect();
        assert_eq!(answers, expected, "{provider}");
        // The same as the default answer from the whole table.
        let from_table: Vec<bool> = entries
            .iter()
            .flat_map(|e| leaves.map(|leaf| listed.contains(&dir.join(e).join(leaf))))
            .collect();
        assert_eq!(answers, from_table, "{provider}");
    }
    // A `mounts/` that does not exist: every answer false; no entry: no answer.
    let none = table
        .mount_points_beneath(&sb.path.join("c/mounts"), &["v0000"], &leaves)
        .unwrap();
    assert_eq!(none, [false, false]);
    let dir = sb.path.join("a/mounts");
    assert!(table
        .mount_points_beneath(&dir, &[], &leaves)
        .unwrap()
        .is_empty());
    // The answers are the statx's, not the table's: a target hidden under a later mount over its
    // volume's directory is listed by the table, but the path no longer reaches it.
    let hidden = sb.path.join("a/mounts/v0000");
    sys.bind_mount(&src, &hidden, false).unwrap();
    let answers = table
        .mount_points_beneath(&dir, &["v0000"], &leaves)
        .unwrap();
    assert_eq!(answers, [false, false]);
    assert!(
        table.is_mount_point(&paths[0]).unwrap(),
        "the table lists it"
    );
    // An entry that is not one component is answered from the table.
    let answers = table
        .mount_points_beneath(&sb.path.join("a"), &["mounts/v0000"], &["target"])
        .unwrap();
    assert_eq!(answers, [true]);
    sys.unmount(&hidden, false).unwrap();
    for &i in &mounted {
        sys.unmount(&paths[i], false).unwrap();
    }
    sb.assert_clean();
}

/// The kernel says whether a mount has children (`listmount`, no table; Linux 6.8, which this
/// machine runs: an older kernel answers `None` and this test fails), and a sweep beneath a
/// volume's mount point trusts it: nothing beneath, nothing read or unmounted; a mount beneath
/// (as a container's rshared copy leaves), swept, the mount point itself kept.
#[test]
fn child_mounts_are_asked_of_the_kernel_and_the_sweep_beneath_follows() {
    let sb = Sandbox::new();
    let sys = LinuxSyscall;
    let src = sb.mkdir("src");
    let inner = sb.mkdir("src/inner");
    let other = sb.mkdir("other");
    let target = sb.mkdir("target");
    let table = ProcMountTable::new();
    // Not a mount root: the kernel is not asked.
    assert_eq!(table.has_child_mounts(&target).unwrap(), None);
    sys.bind_mount(&src, &target, false).unwrap();
    assert_eq!(table.has_child_mounts(&target).unwrap(), Some(false));
    assert_eq!(
        mount::unmount_all_beneath(&sys, &table, &target).unwrap(),
        0
    );
    sys.bind_mount(&other, &target.join("inner"), false)
        .unwrap();
    // A child of a child: the first level says so.
    sys.bind_mount(&src, &target.join("inner"), false).unwrap();
    assert_eq!(table.has_child_mounts(&target).unwrap(), Some(true));
    assert_eq!(table.has_child_mounts(&inner).unwrap(), None);
    assert_eq!(
        mount::unmount_all_beneath(&sys, &table, &target).unwrap(),
        2
    );
    assert_eq!(table.has_child_mounts(&target).unwrap(), Some(false));
    assert!(table.is_mount_point(&target).unwrap());
    // A mount stacked on the volume's (as a container's rshared copy could stack one): what is
    // beneath the lower one is not the top one's children, so the kernel's answer is not taken.
    sys.bind_mount(&other, &target.join("inner"), false)
        .unwrap();
    sys.bind_mount(&other, &target, false).unwrap();
    assert_eq!(table.has_child_mounts(&target).unwrap(), None);
    sys.unmount(&target, false).unwrap();
    assert_eq!(table.has_child_mounts(&target).unwrap(), Some(true));
    assert_eq!(
        mount::unmount_all_beneath(&sys, &table, &target).unwrap(),
        1
    );
    sys.unmount(&target, false).unwrap();
    sb.assert_clean();
}

#[test]
fn readonly_remount_keeps_locked_flags() {
    let sb = Sandbox::new();
    let dev = Path::new("tmpfs");
    let dst = sb.mkdir("t");
    let sys = LinuxSyscall;
    let flags = MountFlags {
        nosuid: true,
        nodev: true,
        noexec: true,
        readonly: false,
        noatime: false,
    };
    sys.mount_filesystem(dev, &dst, "tmpfs", flags, "size=1m")
        .unwrap();
    let bind = sb.mkdir("b");
    sys.bind_mount(&dst, &bind, false).unwrap();
    sys.remount_bind_readonly(&bind).unwrap();
    let m = ProcMountTable::new().find(&bind).unwrap().unwrap();
    for opt in ["ro", "nosuid", "nodev", "noexec"] {
        assert!(
            m.mount_options.iter().any(|o| o == opt),
            "{opt} missing in {:?}",
            m.mount_options
        );
    }
    assert_eq!(m.fs_type, "tmpfs");
    assert_eq!(
        unmount_all_under(&sys, &ProcMountTable::new(), &sb.path).unwrap(),
        2
    );
    sb.assert_clean();
}

#[test]
fn propagation_changes_show_in_mountinfo() {
    let sb = Sandbox::new();
    let dst = sb.mkdir("p");
    let sys = LinuxSyscall;
    sys.mount_filesystem(Path::new("tmpfs"), &dst, "tmpfs", MountFlags::default(), "")
        .unwrap();
    let sub = sb.mkdir("p/sub");
    sys.mount_filesystem(Path::new("tmpfs"), &sub, "tmpfs", MountFlags::default(), "")
        .unwrap();
    let table = ProcMountTable::new();
    let find = |p: &Path| table.find(p).unwrap().unwrap();

    sys.set_propagation(&dst, Propagation::Private, true)
        .unwrap();
    assert_eq!(find(&dst).shared_peer_group(), None);
    assert_eq!(find(&sub).shared_peer_group(), None);

    sys.set_propagation(&dst, Propagation::Shared, false)
        .unwrap();
    let group = find(&dst).shared_peer_group();
    assert!(group.is_some(), "{:?}", find(&dst).optional_fields);
    assert_eq!(
        find(&sub).shared_peer_group(),
        None,
        "non-recursive change must not reach sub"
    );

    // A bind of a shared mount joins its peer group; making it a slave turns that group into its master.
    let peer = sb.mkdir("peer");
    sys.bind_mount(&dst, &peer, false).unwrap();
    assert_eq!(find(&peer).shared_peer_group(), group);
    sys.set_propagation(&peer, Propagation::Slave, false)
        .unwrap();
    assert_eq!(find(&peer).master_peer_group(), group);
    assert_eq!(find(&peer).shared_peer_group(), None);

    sys.set_propagation(&dst, Propagation::Unbindable, true)
        .unwrap();
    assert!(find(&dst).is_unbindable());
    assert!(find(&sub).is_unbindable());
    let err = sys.bind_mount(&dst, &sb.mkdir("nope"), false).unwrap_err();
    assert_eq!(err.errno(), Some(Errno::EINVAL), "{err}");

    let err = sys
        .set_propagation(&sb.mkdir("plain"), Propagation::Private, false)
        .unwrap_err();
    assert!(matches!(err, MountError::Propagation { .. }), "{err}");

    assert_eq!(unmount_all_under(&sys, &table, &sb.path).unwrap(), 3);
    sb.assert_clean();
}

#[test]
fn unmount_of_a_non_mount_is_not_mounted() {
    let sb = Sandbox::new();
    let dir = sb.mkdir("plain");
    let err = LinuxSyscall.unmount(&dir, false).unwrap_err();
    assert!(
        matches!(err, MountError::NotMounted { ref target } if *target == dir),
        "{err}"
    );
    assert_eq!(
        unmount_with_retry(&LinuxSyscall, &dir, 3, Duration::ZERO).unwrap(),
        UnmountOutcome::NotMounted
    );
    // A missing path is an error, not "not mounted".
    let err = LinuxSyscall
        .unmount(&sb.path.join("missing"), false)
        .unwrap_err();
    assert_eq!(err.errno(), Some(Errno::ENOENT));
    sb.assert_clean();
}

#[test]
fn busy_mount_is_detached_after_retries() {
    let sb = Sandbox::new();
    let dst = sb.mkdir("busy");
    let sys = LinuxSyscall;
    sys.mount_filesystem(Path::new("tmpfs"), &dst, "tmpfs", MountFlags::default(), "")
        .unwrap();
    // An open file keeps the mount busy.
    let held = fs::File::create(dst.join("held")).unwrap();
    let err = sys.unmount(&dst, false).unwrap_err();
    assert_eq!(err.errno(), Some(Errno::EBUSY), "{err}");

    let start = Instant::now();
    let outcome = unmount_with_retry(&sys, &dst, 3, Duration::from_millis(20)).unwrap();
    assert_eq!(outcome, UnmountOutcome::Detached);
    assert!(
        start.elapsed() >= Duration::from_millis(60),
        "three retries 20ms apart"
    );
    assert!(!ProcMountTable::new().is_mount_point(&dst).unwrap());
    // The detached file system lives on for the holder.
    held.metadata().unwrap();
    drop(held);
    sb.assert_clean();
}

#[test]
fn open_tree_move_mount_onto_created_target() {
    let sb = Sandbox::new();
    let src = sb.mkdir("vol");
    write_file(&src.join("data"), "volume").unwrap();
    let root = sb.mkdir("rootfs");
    let sys = LinuxSyscall;

    let target = create_in_root(&root, Path::new("/mnt/a/b"), false).unwrap();
    assert_eq!(fd_path(target.as_fd()).unwrap(), root.join("mnt/a/b"));
    let tree = sys.open_tree_clone(&src, true).unwrap();
    sys.set_readonly_by_fd(tree.as_fd(), true).unwrap();
    sys.move_mount_to_fd(tree.as_fd(), target.as_fd()).unwrap();

    let at = root.join("mnt/a/b");
    let m = ProcMountTable::new()
        .find(&at)
        .unwrap()
        .expect("moved mount is in the table");
    assert!(m.is_readonly());
    assert_eq!(fs::read_to_string(at.join("data")).unwrap(), "volume");
    assert!(erofs(write_file(&at.join("data"), "x")));
    write_file(&src.join("data"), "still writable").unwrap();

    // A file target made with create_in_root(last_is_file) takes a file bind through /proc/self/fd.
    let file_target = create_in_root(&root, Path::new("etc/hosts"), true).unwrap();
    sys.bind_mount_to_fd(&src.join("data"), file_target.as_fd(), false)
        .unwrap();
    assert_eq!(
        fs::read_to_string(root.join("etc/hosts")).unwrap(),
        "still writable"
    );

    drop((tree, target, file_target));
    assert_eq!(
        unmount_all_under(&sys, &ProcMountTable::new(), &sb.path).unwrap(),
        2
    );
    sb.assert_clean();
}

#[test]
fn mount_setattr_readonly_on_attached_mount() {
    let sb = Sandbox::new();
    let src = sb.mkdir("src");
    let dst = sb.mkdir("dst");
    let sys = LinuxSyscall;
    sys.bind_mount(&src, &dst, false).unwrap();
    write_file(&dst.join("f"), "rw").unwrap();
    let fd = open_in_root(&sb.path, Path::new("dst")).unwrap();
    sys.set_readonly_by_fd(fd.as_fd(), false).unwrap();
    assert!(ProcMountTable::new()
        .find(&dst)
        .unwrap()
        .unwrap()
        .is_readonly());
    assert!(erofs(write_file(&dst.join("f"), "x")));
    // Not the root of a mount: the kernel refuses.
    let inner = open_in_root(&sb.path, Path::new("src")).unwrap();
    let err = sys.set_readonly_by_fd(inner.as_fd(), false).unwrap_err();
    assert_eq!(err.errno(), Some(Errno::EINVAL), "{err}");
    drop((fd, inner));
    assert_eq!(
        unmount_with_retry(&sys, &dst, 3, Duration::from_millis(10)).unwrap(),
        UnmountOutcome::Unmounted
    );
    sb.assert_clean();
}

/// A hostile container root: symlinks to the host's /etc and above the root, at the target and in parents.
fn hostile_root(sb: &Sandbox) -> PathBuf {
    let root = sb.mkdir("root");
    fs::create_dir_all(root.join("x/y")).unwrap();
    symlink("/etc", root.join("to-etc")).unwrap();
    symlink("../../..", root.join("x/y/up")).unwrap();
    symlink("../../../../../../etc", root.join("x/y/up-etc")).unwrap();
    symlink("/etc/passwd", root.join("passwd")).unwrap();
    symlink("/etc", root.join("x/y/abs-etc")).unwrap();
    symlink("loop-b", root.join("loop-a")).unwrap();
    symlink("loop-a", root.join("loop-b")).unwrap();
    root
}

type Opener = fn(&Path, &Path) -> Result<std::os::fd::OwnedFd, MountError>;
type Creator = fn(&Path, &Path, bool) -> Result<std::os::fd::OwnedFd, MountError>;

fn check_resolution(open: Opener, create: Creator) {
    let sb = Sandbox::new();
    let root = hostile_root(&sb);
    let under = |p: &Path| {
        let got = fd_path(open(&root, p).unwrap().as_fd()).unwrap();
        assert!(
            got.starts_with(&root),
            "{} resolved to {} outside {}",
            p.display(),
            got.display(),
            root.display()
        );
        got
    };
    // ".." and "/" never leave the root.
    assert_eq!(under(Path::new("x/y/up")), root);
    assert_eq!(under(Path::new("../../..")), root);
    assert_eq!(under(Path::new("/")), root);
    assert_eq!(under(Path::new("x/y/up/x")), root.join("x"));
    // Symlinks to the host's /etc do not reach it: there is no etc in this root yet.
    for p in [
        "to-etc",
        "to-etc/passwd",
        "x/y/up-etc",
        "passwd",
        "x/y/up/etc",
        "x/y/abs-etc/passwd",
        "/etc/passwd",
    ] {
        let err = open(&root, Path::new(p)).unwrap_err();
        assert_eq!(err.errno(), Some(Errno::ENOENT), "{p}: {err}");
    }
    let err = open(&root, Path::new("loop-a")).unwrap_err();
    assert_eq!(err.errno(), Some(Errno::ELOOP), "{err}");

    // Creating through the symlinks creates inside the root.
    let target = create(&root, Path::new("to-etc"), false).unwrap();
    assert_eq!(fd_path(target.as_fd()).unwrap(), root.join("etc"));
    let deep = create(&root, Path::new("x/y/up-etc/ssl/certs"), false).unwrap();
    assert_eq!(fd_path(deep.as_fd()).unwrap(), root.join("etc/ssl/certs"));
    // An absolute link deep inside restarts at the root, not at the host's /.
    let again = create(&root, Path::new("x/y/abs-etc"), false).unwrap();
    assert_eq!(fd_path(again.as_fd()).unwrap(), root.join("etc"));
    let file = create(&root, Path::new("passwd"), true).unwrap();
    assert_eq!(fd_path(file.as_fd()).unwrap(), root.join("etc/passwd"));
    assert!(root.join("etc/passwd").is_file());

    // A bind onto the resolved fd lands in the root, and the host's /etc is untouched.
    let host_etc_before = fs::read_dir("/etc").unwrap().count();
    let vol = sb.mkdir("vol");
    write_file(&vol.join("marker"), "vol").unwrap();
    LinuxSyscall
        .bind_mount_to_fd(&vol, target.as_fd(), false)
        .unwrap();
    let table = ProcMountTable::new();
    assert!(table.is_mount_point(&root.join("etc")).unwrap());
    assert!(!table
        .mounts()
        .unwrap()
        .iter()
        .any(|m| m.mount_point == Path::new("/etc")));
    assert!(!Path::new("/etc/marker").exists());
    assert_eq!(fs::read_dir("/etc").unwrap().count(), host_etc_before);
    assert_eq!(fs::read_to_string(root.join("etc/marker")).unwrap(), "vol");

    drop((target, deep, again, file));
    assert_eq!(
        unmount_all_under(&LinuxSyscall, &table, &sb.path).unwrap(),
        1
    );
    sb.assert_clean();
}

#[test]
fn resolution_stays_in_root_with_openat2() {
    check_resolution(open_in_root, create_in_root);
}

#[test]
fn resolution_stays_in_root_with_fallback_walk() {
    check_resolution(open_in_root_fallback, create_in_root_fallback);
}

#[test]
fn fallback_walk_matches_openat2_on_plain_paths() {
    let sb = Sandbox::new();
    let root = hostile_root(&sb);
    fs::create_dir_all(root.join("a/b/c")).unwrap();
    symlink("b/c", root.join("a/rel")).unwrap();
    for p in [
        "a",
        "a/b/c",
        "a/rel",
        "a/rel/..",
        "./a/./b",
        "a/b/c/../../b",
        "x/y/up/a/rel",
    ] {
        let k = fd_path(open_in_root(&root, Path::new(p)).unwrap().as_fd()).unwrap();
        let w = fd_path(open_in_root_fallback(&root, Path::new(p)).unwrap().as_fd()).unwrap();
        assert_eq!(k, w, "{p}");
    }
    let err = open_in_root_fallback(&root, Path::new("a/b/c/missing/x")).unwrap_err();
    assert_eq!(err.errno(), Some(Errno::ENOENT));
    write_file(&root.join("a/file"), "").unwrap();
    let err = open_in_root_fallback(&root, Path::new("a/file/x")).unwrap_err();
    assert_eq!(err.errno(), Some(Errno::ENOTDIR));
    sb.assert_clean();
}

/// The loop devices backed by `file`, waiting a little for the kernel to finish an autoclear.
fn wait_no_loop(file: &Path) -> Vec<PathBuf> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let found = mount::find_by_backing_file(file).unwrap();
        if found.is_empty() || Instant::now() > deadline {
            return found;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn make_ext4(sb: &Sandbox) -> PathBuf {
    let img = sb.path.join("disk.img");
    fs::File::create(&img).unwrap().set_len(16 << 20).unwrap();
    let status = std::process::Command::new("mkfs.ext4")
        .args(["-q", "-F"])
        .arg(&img)
        .status()
        .unwrap();
    assert!(status.success(), "mkfs.ext4 failed: {status}");
    img
}

#[test]
fn loop_device_with_ext4() {
    let sb = Sandbox::new();
    let img = make_ext4(&sb);
    let dev = mount::attach(&img, false).unwrap();
    assert_eq!(dev.path, PathBuf::from(format!("/dev/loop{}", dev.number)));
    assert_eq!(
        mount::find_by_backing_file(&img).unwrap(),
        vec![dev.path.clone()]
    );
    assert_eq!(
        mount::find_backed_under(&sb.path).unwrap(),
        vec![(dev.path.clone(), img.clone())]
    );

    let mnt = sb.mkdir("mnt");
    let sys = LinuxSyscall;
    sys.mount_filesystem(&dev.path, &mnt, "ext4", MountFlags::default(), "")
        .unwrap();
    let m = ProcMountTable::new().find(&mnt).unwrap().unwrap();
    assert_eq!(m.fs_type, "ext4");
    assert_eq!(m.source, dev.path.display().to_string());
    // The filesystem's device names its backing file in sysfs, one read: the image, not another
    // file; a device that is no loop device (the sandbox's own filesystem) is backed by nothing.
    assert!(mount::is_backed_by(m.major, m.minor, &img));
    assert!(!mount::is_backed_by(
        m.major,
        m.minor,
        &sb.path.join("other.img")
    ));
    let host = std::os::unix::fs::MetadataExt::dev(&fs::metadata(&sb.path).unwrap());
    let (major, minor) = (nix::sys::stat::major(host), nix::sys::stat::minor(host));
    assert!(!mount::is_backed_by(major as u32, minor as u32, &img));
    assert_eq!(
        mount::backing_file_of(m.major, m.minor),
        Some(fs::canonicalize(&img).unwrap())
    );
    assert_eq!(mount::backing_file_of(major as u32, minor as u32), None);
    write_file(&mnt.join("hello"), "ext4").unwrap();
    nix::unistd::sync();

    assert_eq!(
        unmount_with_retry(&sys, &mnt, 3, Duration::from_millis(10)).unwrap(),
        UnmountOutcome::Unmounted
    );
    let path = dev.path.clone();
    dev.detach().unwrap();
    assert_eq!(wait_no_loop(&img), Vec::<PathBuf>::new());
    // Detaching a free device is fine.
    mount::detach(&path).unwrap();

    // The data reached the image: mount it again read-only.
    let dev = mount::attach(&img, true).unwrap();
    let ro = MountFlags {
        readonly: true,
        ..MountFlags::default()
    };
    sys.mount_filesystem(&dev.path, &mnt, "ext4", ro, "")
        .unwrap();
    // With autoclear the mount keeps the device; dropping our handle does not free it.
    drop(dev);
    assert_eq!(fs::read_to_string(mnt.join("hello")).unwrap(), "ext4");
    assert!(erofs(write_file(&mnt.join("hello"), "x")));
    assert_eq!(mount::find_by_backing_file(&img).unwrap().len(), 1);
    LinuxSyscall.unmount(&mnt, false).unwrap();
    assert_eq!(
        wait_no_loop(&img),
        Vec::<PathBuf>::new(),
        "autoclear frees the device on unmount"
    );
    sb.assert_clean();
}

#[test]
fn dropped_loop_device_is_freed_and_deleted_backing_file_is_found() {
    let sb = Sandbox::new();
    let img = sb.path.join("raw.img");
    fs::File::create(&img).unwrap().set_len(1 << 20).unwrap();
    let dev = mount::attach(&img, false).unwrap();
    fs::remove_file(&img).unwrap();
    // The kernel reports "<path> (deleted)" now; lookups still find it by the old path.
    let sysfs =
        fs::read_to_string(format!("/sys/block/loop{}/loop/backing_file", dev.number)).unwrap();
    assert!(sysfs.trim_end().ends_with(" (deleted)"), "{sysfs:?}");
    assert_eq!(
        mount::find_by_backing_file(&img).unwrap(),
        vec![dev.path.clone()]
    );
    drop(dev);
    assert_eq!(wait_no_loop(&img), Vec::<PathBuf>::new());
    sb.assert_clean();
}

/// A bind of a fresh directory onto `target` (created), with a marker file naming it.
fn bind_marked(sb: &Sandbox, source_rel: &str, target: &Path) {
    let source = sb.mkdir(source_rel);
    fs::write(source.join("marker"), source_rel).unwrap();
    fs::create_dir_all(target).unwrap();
    LinuxSyscall.bind_mount(&source, target, false).unwrap();
}

#[test]
fn unmount_without_symlinks_refuses_a_path_swapped_after_the_table_was_read() {
    let sb = Sandbox::new();
    let ours = sb.path.join("sandbox/a/b");
    let decoy = sb.path.join("decoy/b");
    bind_marked(&sb, "vol", &ours);
    bind_marked(&sb, "other", &decoy);
    // The container renames a parent of our mount point and puts a symlink to the decoy in its place.
    fs::rename(sb.path.join("sandbox/a"), sb.path.join("sandbox/moved")).unwrap();
    symlink(sb.path.join("decoy"), sb.path.join("sandbox/a")).unwrap();

    let err = LinuxSyscall.unmount_no_symlinks(&ours, false).unwrap_err();
    assert_eq!(err.errno(), Some(Errno::ELOOP), "{err}");
    assert!(err.full_message().contains("sandbox/a"), "{err}");
    let points: Vec<PathBuf> = sb.mounts().into_iter().map(|m| m.mount_point).collect();
    assert!(
        points.contains(&decoy),
        "the decoy was unmounted: {points:?}"
    );
    assert!(
        points.contains(&sb.path.join("sandbox/moved/b")),
        "{points:?}"
    );
    // Not vacuous: the path-following unmount of the same path takes the decoy down.
    LinuxSyscall.unmount(&ours, false).unwrap();
    assert!(!sb.mounts().iter().any(|m| m.mount_point == decoy));

    // A last component that is a symlink to a mount point is not followed either.
    bind_marked(&sb, "other2", &decoy);
    symlink(&decoy, sb.path.join("sandbox/c")).unwrap();
    assert!(matches!(
        LinuxSyscall.unmount_no_symlinks(&sb.path.join("sandbox/c"), false),
        Err(MountError::NotMounted { .. })
    ));
    assert!(sb.mounts().iter().any(|m| m.mount_point == decoy));

    // The real mount point, named without symlinks, goes; a missing parent is "not mounted".
    let moved = sb.path.join("sandbox/moved/b");
    assert_eq!(
        mount::unmount_no_symlinks_with_retry(&LinuxSyscall, &moved, 0, Duration::ZERO).unwrap(),
        UnmountOutcome::Unmounted
    );
    assert!(matches!(
        LinuxSyscall.unmount_no_symlinks(&sb.path.join("nowhere/b"), false),
        Err(MountError::NotMounted { .. })
    ));
    // unmount_all_under takes what is left, by the table's paths.
    assert_eq!(
        unmount_all_under(&LinuxSyscall, &ProcMountTable::new(), &sb.path).unwrap(),
        1
    );
    sb.assert_clean();
}

#[test]
fn unmount_at_a_directory_fd_detaches_a_busy_mount_after_retries() {
    let sb = Sandbox::new();
    let target = sb.path.join("t/m");
    bind_marked(&sb, "vol", &target);
    let dir = mount::open_dir_no_symlinks(&sb.path.join("t")).unwrap();
    let busy = fs::File::open(target.join("marker")).unwrap();
    let name = std::ffi::OsStr::new("m");
    let outcome = mount::retry_unmount(&target, 2, Duration::from_millis(10), |detach| {
        LinuxSyscall.unmount_at(dir.as_fd(), name, detach)
    })
    .unwrap();
    assert_eq!(outcome, UnmountOutcome::Detached);
    drop(busy);
    assert!(matches!(
        LinuxSyscall.unmount_at(dir.as_fd(), name, false),
        Err(MountError::NotMounted { .. })
    ));
    for bad in ["", "a/b", "..", ".", "m/"] {
        let err = LinuxSyscall
            .unmount_at(dir.as_fd(), std::ffi::OsStr::new(bad), false)
            .unwrap_err();
        assert_eq!(err.errno(), Some(Errno::EINVAL), "{bad:?}: {err}");
    }
    sb.assert_clean();
}

#[test]
fn parent_in_root_follows_symlinks_inside_the_root_only() {
    let sb = Sandbox::new();
    let root = sb.mkdir("root");
    sb.mkdir("root/etc");
    sb.mkdir("outside/y");
    sb.mkdir("root/outside");
    symlink("etc", root.join("late")).unwrap();
    symlink("../../../outside/y", root.join("up")).unwrap();
    symlink("/etc/../etc/deeper", root.join("abs")).unwrap();
    symlink("loop", root.join("loop")).unwrap();
    symlink("..", root.join("dotdot")).unwrap();
    let dir_of = |fd: std::os::fd::OwnedFd| fd_path(fd.as_fd()).unwrap();
    let cases: [(&str, PathBuf, &str); 5] = [
        ("/late", root.clone(), "etc"),
        ("late/x", root.join("etc"), "x"),
        ("/up", root.join("outside"), "y"),
        ("abs", root.join("etc"), "deeper"),
        ("plain/missing", root.join("plain"), "missing"),
    ];
    sb.mkdir("root/plain");
    for (path, dir, name) in cases {
        let (fd, got) = mount::open_parent_in_root(&root, Path::new(path))
            .unwrap_or_else(|e| panic!("{path}: {e}"));
        assert_eq!((dir_of(fd), got.to_str().unwrap()), (dir, name), "{path}");
    }
    for (path, errno) in [
        ("loop", Errno::ELOOP),
        ("dotdot", Errno::EINVAL),
        ("/", Errno::EINVAL),
    ] {
        let err = mount::open_parent_in_root(&root, Path::new(path)).unwrap_err();
        assert_eq!(err.errno(), Some(errno), "{path}: {err}");
    }
    sb.assert_clean();
}

#[test]
fn no_symlink_opening_refuses_every_symlink_with_openat2_and_with_the_walk() {
    let sb = Sandbox::new();
    let root = sb.mkdir("root");
    sb.mkdir("root/a/b");
    sb.mkdir("elsewhere/b");
    fs::write(root.join("a/file"), "x").unwrap();
    symlink(sb.path.join("elsewhere"), root.join("link")).unwrap();
    symlink("b", root.join("a/last")).unwrap();
    type Opener = fn(&Path, &Path) -> Result<std::os::fd::OwnedFd, MountError>;
    let openers: [(&str, Opener); 2] = [
        ("openat2", mount::open_dir_no_symlinks_in),
        ("walk", mount::resolve::open_dir_no_symlinks_in_fallback),
    ];
    for (how, open) in openers {
        let fd = open(&root, Path::new("/a/b")).unwrap_or_else(|e| panic!("{how}: {e}"));
        assert_eq!(fd_path(fd.as_fd()).unwrap(), root.join("a/b"), "{how}");
        let fd = open(&root, Path::new("/")).unwrap_or_else(|e| panic!("{how}: {e}"));
        assert_eq!(fd_path(fd.as_fd()).unwrap(), root, "{how}");
        for (path, errno) in [
            ("/link/b", Errno::ELOOP),
            ("/link", Errno::ELOOP),
            ("/a/last", Errno::ELOOP),
            ("/a/file", Errno::ENOTDIR),
            ("/a/missing", Errno::ENOENT),
            ("/a/../a", Errno::EINVAL),
            ("a/b", Errno::EINVAL),
        ] {
            let err = open(&root, Path::new(path)).unwrap_err();
            assert_eq!(err.errno(), Some(errno), "{how} {path}: {err}");
        }
    }
    sb.assert_clean();
}

fn has_option(m: &mount::MountInfo, option: &str) -> bool {
    m.mount_options.iter().any(|o| o == option)
}

/// (nosuid, nodev) of the mount `path` is on, as statvfs reports them.
fn statvfs_host_flags(path: &Path) -> (bool, bool) {
    use nix::sys::statvfs::{statvfs, FsFlags};
    let flags = statvfs(path).unwrap().flags();
    (
        flags.contains(FsFlags::ST_NOSUID),
        flags.contains(FsFlags::ST_NODEV),
    )
}

/// A volume's sub-path is opened beneath its trusted root without following any symlink: at the end
/// (`volumes/roles/r1/pv1 -> decoy`) or in the middle (`volumes -> ...`), refused naming the component; a
/// plain one is cloned from its fd (`open_tree(fd, "", AT_EMPTY_PATH)`) and lands where the fd is.
#[test]
fn clone_beneath_an_anchor_refuses_symlinks_and_clones_from_the_fd() {
    let sb = Sandbox::new();
    let decoy = sb.mkdir("decoy");
    write_file(&decoy.join("secret"), "decoy").unwrap();
    let anchor = sb.mkdir("vol");
    let roles = sb.mkdir("vol/volumes/roles/r1");
    symlink(&decoy, roles.join("pv1")).unwrap();
    fs::create_dir(roles.join("real")).unwrap();
    write_file(&roles.join("real/data"), "volume").unwrap();
    let other = sb.mkdir("other");
    symlink(anchor.join("volumes"), other.join("volumes")).unwrap();
    // A relative symlink that stays beneath the anchor is refused just the same.
    symlink("real", roles.join("alias")).unwrap();

    let cases = [
        (&anchor, "volumes/roles/r1/pv1", "volumes/roles/r1/pv1"),
        (&other, "volumes/roles/r1/real", "volumes"),
        (&anchor, "volumes/roles/r1/alias", "volumes/roles/r1/alias"),
    ];
    for (root, rest, component) in cases {
        let err = mount::open_beneath_no_symlinks(root, Path::new(rest)).unwrap_err();
        match &err {
            MountError::SymlinkBeneath {
                component: got,
                root: r,
                ..
            } => {
                assert_eq!(got, Path::new(component), "{err}");
                assert_eq!(r, root);
            }
            other => panic!("{rest} beneath {}: {other}", root.display()),
        }
        assert!(
            err.full_message()
                .contains(&format!("{component} is a symlink")),
            "{err}"
        );
    }
    for bad in ["../decoy", "/volumes", "volumes/../../decoy"] {
        let err = mount::open_beneath_no_symlinks(&anchor, Path::new(bad)).unwrap_err();
        assert_eq!(err.errno(), Some(Errno::EINVAL), "{bad}: {err}");
    }

    let sys = LinuxSyscall;
    let source =
        mount::open_beneath_no_symlinks(&anchor, Path::new("volumes/roles/r1/real")).unwrap();
    let tree = sys.open_tree_clone_fd(source.as_fd(), true).unwrap();
    let dst = sb.mkdir("dst");
    let target = open_in_root(&sb.path, Path::new("dst")).unwrap();
    sys.move_mount_to_fd(tree.as_fd(), target.as_fd()).unwrap();
    assert_eq!(fs::read_to_string(dst.join("data")).unwrap(), "volume");
    let m = ProcMountTable::new().find(&dst).unwrap().unwrap();
    assert!(m.root.ends_with("vol/volumes/roles/r1/real"), "{m:?}");
    assert!(!dst.join("secret").exists());

    // An empty rest is the anchor itself, opened as given.
    let whole = mount::open_beneath_no_symlinks(&anchor, Path::new("")).unwrap();
    assert_eq!(fd_path(whole.as_fd()).unwrap(), anchor);

    drop((source, tree, target, whole));
    unmount_all_under(&sys, &ProcMountTable::new(), &sb.path).unwrap();
    sb.assert_clean();
}

/// nosuid,nodev go on a path only when it is itself a mount root (and on the mounts below it); a plain
/// directory, a missing path or a symlink to a mount is `false`, and the file system holding it is never
/// touched.
#[test]
fn harden_changes_only_a_mount_root() {
    let sb = Sandbox::new();
    let sys = LinuxSyscall;
    let plain = sb.mkdir("plain");
    assert_eq!(
        statvfs_host_flags(&plain),
        (false, false),
        "the test needs a suid-capable fs"
    );
    assert!(!sys.harden_mount_root(&plain).unwrap());
    assert!(!sys.harden_mount_root(&sb.path.join("missing")).unwrap());
    assert_eq!(
        statvfs_host_flags(&plain),
        (false, false),
        "the parent fs untouched"
    );

    let src = sb.mkdir("src");
    let target = sb.mkdir("target");
    sys.bind_mount(&src, &target, false).unwrap();
    let sub = sb.mkdir("target/sub");
    sys.mount_filesystem(
        Path::new("tmpfs"),
        &sub,
        "tmpfs",
        MountFlags::default(),
        "size=1m",
    )
    .unwrap();
    symlink(&target, sb.path.join("link")).unwrap();
    assert!(
        !sys.harden_mount_root(&sb.path.join("link")).unwrap(),
        "a symlink is no mount root"
    );
    assert_eq!(statvfs_host_flags(&target), (false, false));

    assert!(sys.harden_mount_root(&target).unwrap());
    assert_eq!(statvfs_host_flags(&target), (true, true));
    assert_eq!(statvfs_host_flags(&sub), (true, true), "recursive");
    let table = ProcMountTable::new();
    for at in [&target, &sub] {
        let m = table.find(at).unwrap().unwrap();
        assert!(has_option(&m, "nosuid") && has_option(&m, "nodev"), "{m:?}");
    }
    // Idempotent, and the source's own file system is still suid-capable.
    assert!(sys.harden_mount_root(&target).unwrap());
    assert_eq!(statvfs_host_flags(&src), (false, false));

    unmount_all_under(&sys, &ProcMountTable::new(), &sb.path).unwrap();
    sb.assert_clean();
}

/// A container's copy of a hardened host mount clears nosuid,nodev on the copy only (mount_setattr
/// attr_clr on the detached tree), through the one clone sequence (`launcher::clone_source`); the bind-remount fallback
/// sets and clears the same flags on an attached mount.
#[test]
fn clearing_flags_on_a_clone_leaves_the_host_mount_hardened() {
    use csi_isolator::mount::{TargetRoot, VolumeMount};
    let sb = Sandbox::new();
    let sys = LinuxSyscall;
    let data = sb.mkdir("data");
    let host = sb.mkdir("host");
    sys.bind_mount(&data, &host, false).unwrap();
    assert!(sys.harden_mount_root(&host).unwrap());
    fs::create_dir_all(host.join("volumes/roles/r1/pv1")).unwrap();
    write_file(&host.join("volumes/roles/r1/pv1/f"), "pv").unwrap();

    let m = VolumeMount {
        source: host.join("volumes/roles/r1/pv1"),
        source_root: Some(host.clone()),
        root: TargetRoot::Sandbox,
        target: PathBuf::from("data"),
        container_path: "data".into(),
        readonly: false,
        volume_id: Some("pv1".into()),
        provider_id: None,
        block: false,
        propagation: Default::default(),
        hardening: Default::default(),
    };
    let at = csi_isolator::launcher::VolumeRef::new(&m, &sb.path);
    let tree = csi_isolator::launcher::clone_source(&sys, &m, &at)
        .unwrap()
        .into_complete_tree()
        .expect("a complete tree on a kernel with open_tree and mount_setattr");
    let dst = sb.mkdir("container");
    let target = open_in_root(&sb.path, Path::new("container")).unwrap();
    sys.move_mount_to_fd(tree.as_fd(), target.as_fd()).unwrap();
    assert_eq!(fs::read_to_string(dst.join("f")).unwrap(), "pv");
    assert_eq!(
        statvfs_host_flags(&dst),
        (false, false),
        "the copy is as before"
    );
    assert_eq!(
        statvfs_host_flags(&host),
        (true, true),
        "the host mount stays hardened"
    );

    // Planted symlink: refused by name, nothing cloned.
    fs::remove_dir_all(host.join("volumes/roles/r1/pv1")).unwrap();
    symlink(&data, host.join("volumes/roles/r1/pv1")).unwrap();
    let err = match csi_isolator::launcher::clone_source(&sys, &m, &at) {
        Ok(_) => panic!("a symlinked source was cloned"),
        Err(e) => e,
    };
    assert!(
        err.full_message()
            .contains("volumes/roles/r1/pv1 is a symlink"),
        "{err}"
    );

    // The fallback for kernels without mount_setattr, on an attached mount.
    sys.remount_bind_with(&dst, MountFlags::HOST_ONLY, MountFlags::NONE)
        .unwrap();
    assert_eq!(statvfs_host_flags(&dst), (true, true));
    sys.remount_bind_with(&dst, MountFlags::READONLY, MountFlags::HOST_ONLY)
        .unwrap();
    assert_eq!(statvfs_host_flags(&dst), (false, false));
    assert!(ProcMountTable::new()
        .find(&dst)
        .unwrap()
        .unwrap()
        .is_readonly());

    drop((tree, target));
    unmount_all_under(&sys, &ProcMountTable::new(), &sb.path).unwrap();
    sb.assert_clean();
}
