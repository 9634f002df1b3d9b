//! The work dir, its lock, a managed plugin's socket directory and its log
//! against another local user (issue 18, findings 5, 6, 9 and 10), end to
//! end as root with the real `csi-isolator` binary, the bundled plugin and a
//! real unprivileged uid (`nobody`, through `setresuid` in a forked child):
//! - a work dir another user owns, or one beneath a directory others may
//!   write, is refused by `run`, `volume`, `status`, `serve` and both OCI
//!   hooks before anything is
//!   created or opened in it, naming the directory, its owner and mode;
//!   beneath a root-owned directory in a sticky one (as `/tmp`) it is fine;
//! - `run.lock` and `plugin.log` are never opened through a planted
//!   symbolic link;
//! - `nobody` can neither open `run.lock` nor stop launches by holding it;
//! - the work dir is 0711 and its subdirectories 0700 after a run, and an
//!   older, wider layout is narrowed;
//! - a plugin socket directory someone else made first is refused, and no
//!   plugin socket is made in it;
//! - a plugin that writes without end leaves `plugin.log` under its cap.
//!
//! Every test works in its own sandbox, removed pass or fail.

use csi_isolator_testing::plugin_bin;
use std::ffi::CString;
use std::io::Read;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{symlink, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use csi_isolator::provider::bundled::BUNDLED_TYPE;
use csi_isolator::provider::supervisor::{PluginCommand, Supervisor, PLUGIN_LOG_MAX_BYTES};
use csi_isolator::resource::Layout;
use csi_isolator_testing::unprivileged::{as_nobody, Outcome, NOBODY_UID};
use csi_isolator_testing::{require_root, Sandbox};
use nix::errno::Errno;

const CLI: &str = env!("CARGO_BIN_EXE_csi-isolator");

/// `csi-isolator --work-dir WORK`, with managed plugin sockets under
/// `socket_dir` when the work dir is too deep for them.
fn cli(work: &Path, socket_dir: &Path) -> Command {
    let mut c = Command::new(CLI);
    c.arg("--work-dir")
        .arg(work)
        .env_remove("RUST_LOG")
        .env("CSI_ISOLATOR_SOCKET_DIR", socket_dir);
    c
}

fn output(cmd: &mut Command) -> Output {
    cmd.output().expect("run csi-isolator")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// `run --volume a:1M:a -- true`.
fn run_true(work: &Path, socket_dir: &Path) -> Output {
    output(cli(work, socket_dir).args(["run", "--volume", "a:1M:a", "--", "true"]))
}

fn mode(path: &Path) -> u32 {
    std::fs::symlink_metadata(path)
        .unwrap_or_else(|e| panic!("stat {}: {e}", path.display()))
        .mode()
        & 0o7777
}

fn chmod(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .unwrap_or_else(|e| panic!("chmod {}: {e}", path.display()));
}

fn chown_nobody(path: &Path) {
    std::os::unix::fs::lchown(path, Some(NOBODY_UID), None)
        .unwrap_or_else(|e| panic!("chown {}: {e}", path.display()));
}

/// The names in `dir`, sorted.
fn names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("list {}: {e}", dir.display()))
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

fn errno_of(e: std::io::Error) -> Errno {
    Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO))
}

fn assert_refused(out: &Output, what: &str, needles: &[&str]) {
    let err = text(&out.stderr);
    assert!(!out.status.success(), "{what} must be refused: {err}");
    for needle in needles {
        assert!(err.contains(needle), "{what}: {needle:?} missing in: {err}");
    }
}

/// A work dir `<sb>/w` that `nobody` owns (mode 0755), and the managed plugin's socket dir.
fn nobodys_work_dir(sb: &Sandbox) -> (PathBuf, PathBuf) {
    let work = sb.mkdir("w");
    chown_nobody(&work);
    (work, sb.join("s"))
}

/// Each command was refused naming the work dir, its owner, its mode and the fix, and nothing
/// was made in the work dir, no plugin started, the directory left as it was.
fn assert_refused_in_nobodys_work_dir(work: &Path, socket_dir: &Path, refused: &[(&str, Output)]) {
    let dir = work.display().to_string();
    let needles = [
        dir.as_str(),
        "not owned by root",
        "owner uid 65534",
        "mode 0755",
        "chown root",
        "--work-dir",
    ];
    for (what, out) in refused {
        assert_refused(out, what, &needles);
        assert!(names(work).is_empty(), "{what} made {:?}", names(work));
    }
    assert!(!socket_dir.exists(), "no plugin was started");
    assert_eq!(mode(work), 0o755, "the foreign dir is left as it was");
}

#[test]
fn a_work_dir_owned_by_nobody_is_refused_before_anything_is_made_in_it() {
    require_root();
    let sb = Sandbox::new("wdsec-owner");
    let (work, socket_dir) = nobodys_work_dir(&sb);
    let refused = [
        ("run", run_true(&work, &socket_dir)),
        (
            "volume create",
            output(cli(&work, &socket_dir).args(["volume", "create", "v", "1M"])),
        ),
        ("status", output(cli(&work, &socket_dir).arg("status"))),
    ];
    assert_refused_in_nobodys_work_dir(&work, &socket_dir, &refused);
}

/// `oci-hook STAGE` on `work` with the container state `state` on stdin.
fn hook(work: &Path, socket_dir: &Path, stage: &str, state: &str) -> Output {
    use std::io::Write;
    let mut child = cli(work, socket_dir)
        .args(["oci-hook", stage])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start the hook");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(state.as_bytes())
        .unwrap();
    child.wait_with_output().expect("wait for the hook")
}

/// The other entry points that take a work dir, `serve` and both hooks, refuse one another user
/// owns before anything is made in it, as `run`, `volume` and `status` do.
#[test]
fn serve_and_the_hooks_refuse_a_work_dir_owned_by_nobody() {
    require_root();
    let sb = Sandbox::new("wdsec-owner-entries");
    let (work, socket_dir) = nobodys_work_dir(&sb);
    let socket = sb.join("isolator.sock");
    let serve = output(
        cli(&work, &socket_dir)
            .args(["serve", "--socket"])
            .arg(&socket),
    );
    // A bundle with a volume annotation, so create-runtime goes as far as the work dir.
    let bundle = sb.mkdir("bundle");
    std::fs::create_dir(bundle.join("rootfs")).unwrap();
    std::fs::write(
        bundle.join("config.json"),
        r#"{"ociVersion":"1.0.2","root":{"path":"rootfs"},"annotations":{"io.csi-isolator.volumes":"a:1M:/data"}}"#,
    )
    .unwrap();
    let state = format!(
        r#"{{"ociVersion":"1.0.2","id":"c1","status":"creating","pid":{},"bundle":"{}"}}"#,
        std::process::id(),
        bundle.display()
    );
    let refused = [
        ("serve", serve),
        (
            "oci-hook create-runtime",
            hook(&work, &socket_dir, "create-runtime", &state),
        ),
        (
            "oci-hook poststop",
            hook(&work, &socket_dir, "poststop", &state),
        ),
    ];
    assert_refused_in_nobodys_work_dir(&work, &socket_dir, &refused);
    assert!(!socket.exists(), "serve bound its socket");
    sb.assert_no_mounts_under();
}

#[test]
fn a_work_dir_beneath_a_world_writable_dir_is_refused_naming_that_dir() {
    require_root();
    let sb = Sandbox::new("wdsec-open");
    let socket_dir = sb.join("s");
    let open = sb.mkdir("open");
    chmod(&open, 0o777);
    let work = open.join("w");
    let dir = open.display().to_string();
    let needles = [
        dir.as_str(),
        "writable by group or others and not sticky",
        "owner uid 0",
        "mode 0777",
        "chmod go-w",
    ];
    for (what, out) in [
        ("run", run_true(&work, &socket_dir)),
        (
            "volume list",
            output(cli(&work, &socket_dir).args(["volume", "list"])),
        ),
        ("status", output(cli(&work, &socket_dir).arg("status"))),
    ] {
        assert_refused(&out, what, &needles);
        assert!(!work.exists(), "{what} created the work dir");
    }
}

#[test]
fn a_work_dir_beneath_a_root_dir_in_a_sticky_dir_is_accepted() {
    require_root();
    let sb = Sandbox::new("wdsec-sticky");
    let sticky = sb.mkdir("tmp");
    chmod(&sticky, 0o1777);
    let work = sticky.join("root-owned").join("w");
    let out = run_true(&work, &sb.join("s"));
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        mode(&sticky.join("root-owned")),
        0o755,
        "a parent made on the way"
    );
    assert_eq!(mode(&work), 0o711);
    // The same directory made first by nobody is refused.
    let theirs = sticky.join("theirs");
    let made = as_nobody(|| std::fs::create_dir(&theirs).map(|()| 0).map_err(errno_of));
    assert_eq!(made, Outcome::Ok(0));
    let out = run_true(&theirs.join("w"), &sb.join("s"));
    assert_refused(&out, "run", &["theirs", "owner uid 65534"]);
    assert!(names(&theirs).is_empty());
    sb.assert_no_mounts_under();
}

#[test]
fn a_symlink_planted_at_run_lock_is_not_followed() {
    require_root();
    let sb = Sandbox::new("wdsec-lock-link");
    let socket_dir = sb.join("s");
    let work = sb.mkdir("w");
    let victim = sb.join("victim");
    std::fs::write(&victim, "victim\n").unwrap();
    chmod(&victim, 0o644);
    symlink(&victim, work.join("run.lock")).unwrap();
    let out = run_true(&work, &socket_dir);
    assert_refused(
        &out,
        "run",
        &["run.lock is a symbolic link (not followed)", "remove it"],
    );
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "victim\n");
    assert_eq!(mode(&victim), 0o644, "the victim's mode is untouched");
    // A dangling one is not followed to create a file either.
    let absent = sb.join("created-through-the-link");
    std::fs::remove_file(work.join("run.lock")).unwrap();
    symlink(&absent, work.join("run.lock")).unwrap();
    let out = output(cli(&work, &socket_dir).args(["volume", "list"]));
    assert_refused(&out, "volume list", &["run.lock is a symbolic link"]);
    assert!(!absent.exists(), "root created a file through the link");
}

#[test]
fn a_symlink_planted_at_plugin_log_is_not_followed() {
    require_root();
    let sb = Sandbox::new("wdsec-log-link");
    let socket_dir = sb.join("s");
    let work = sb.join("w");
    let first = run_true(&work, &socket_dir);
    assert!(first.status.success(), "{}", text(&first.stderr));
    let log = Layout::new(&work, BUNDLED_TYPE, "default")
        .plugin_dir()
        .join("plugin.log");
    assert!(log.is_file(), "{} after a run", log.display());
    let victim = sb.join("victim");
    std::fs::write(&victim, "victim\n").unwrap();
    std::fs::remove_file(&log).unwrap();
    symlink(&victim, &log).unwrap();
    let out = run_true(&work, &socket_dir);
    assert_refused(
        &out,
        "run",
        &["plugin.log is a symbolic link (not followed)"],
    );
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "victim\n");
    let absent = sb.join("created-through-the-link");
    std::fs::remove_file(&log).unwrap();
    symlink(&absent, &log).unwrap();
    let out = run_true(&work, &socket_dir);
    assert_refused(&out, "run", &["plugin.log is a symbolic link"]);
    assert!(!absent.exists(), "root created a file through the link");
    sb.assert_no_mounts_under();
}

/// Reads one byte from `fd`, waiting at most `limit`.
fn read_byte(fd: &OwnedFd, limit: Duration) -> u8 {
    let start = Instant::now();
    loop {
        let mut pfd = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd on the stack, for the duration of the call.
        let n = unsafe { libc::poll(&mut pfd, 1, 100) };
        if n > 0 {
            let mut byte = [0u8; 1];
            let mut file = std::fs::File::from(fd.try_clone().unwrap());
            file.read_exact(&mut byte).unwrap();
            return byte[0];
        }
        assert!(
            start.elapsed() < limit,
            "no word from the child in {limit:?}"
        );
    }
}

#[test]
fn nobody_can_neither_open_nor_hold_run_lock() {
    require_root();
    let sb = Sandbox::new("wdsec-lock-hold");
    let socket_dir = sb.join("s");
    let work = sb.join("w");
    let first = run_true(&work, &socket_dir);
    assert!(first.status.success(), "{}", text(&first.stderr));
    let lock = work.join("run.lock");
    assert_eq!(mode(&lock), 0o600);
    let path = CString::new(lock.as_os_str().as_bytes()).unwrap();
    // nobody tries to take the lock and keep it for a while; it tells us
    // through a pipe whether it got it ('h') or not ('n').
    let (reader, writer) = nix::unistd::pipe().unwrap();
    let holder = std::thread::spawn(move || {
        as_nobody(move || {
            // SAFETY: a valid NUL-terminated path; the fd is ours alone.
            let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
            let got = fd >= 0
                // SAFETY: `fd` is an open descriptor of this process.
                && unsafe { libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) } == 0;
            let errno = Errno::last();
            let word = if got { b"h" } else { b"n" };
            // SAFETY: one byte from a valid buffer to the pipe's write end.
            unsafe { libc::write(writer.as_raw_fd(), word.as_ptr().cast(), 1) };
            if got {
                std::thread::sleep(Duration::from_secs(5));
                return Ok(0);
            }
            Err(errno)
        })
    });
    let word = read_byte(&reader, Duration::from_secs(15));
    let second = run_true(&work, &socket_dir);
    let outcome = holder.join().unwrap();
    assert_eq!(word, b'n', "nobody took the lock");
    assert_eq!(outcome, Outcome::Failed(Errno::EACCES));
    assert!(
        second.status.success(),
        "a launch while nobody tried to hold the lock: {}",
        text(&second.stderr)
    );
    sb.assert_no_mounts_under();
}

/// A `run.lock` an older version left 0644, opened and locked by `nobody` before the upgrade:
/// the next launch does not wait for that holder, it replaces the lock file with a fresh
/// root-only one (nobody keeps a lock on a file that is no longer the lock).
#[test]
fn a_lock_held_by_another_user_since_before_the_upgrade_does_not_stop_launches() {
    require_root();
    let sb = Sandbox::new("wdsec-lock-old");
    let socket_dir = sb.join("s");
    let work = sb.join("w");
    let first = run_true(&work, &socket_dir);
    assert!(first.status.success(), "{}", text(&first.stderr));
    let lock = work.join("run.lock");
    // As an older version left it.
    chmod(&lock, 0o644);
    let old_ino = std::fs::metadata(&lock).unwrap().ino();
    let path = CString::new(lock.as_os_str().as_bytes()).unwrap();
    let (reader, writer) = nix::unistd::pipe().unwrap();
    let release = sb.join("release");
    let release_in_child = release.clone();
    let holder = std::thread::spawn(move || {
        as_nobody(move || {
            // SAFETY: a valid NUL-terminated path; the fd is ours alone.
            let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
            let got = fd >= 0
                // SAFETY: `fd` is an open descriptor of this process.
                && unsafe { libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) } == 0;
            let errno = Errno::last();
            let word = if got { b"h" } else { b"n" };
            // SAFETY: one byte from a valid buffer to the pipe's write end.
            unsafe { libc::write(writer.as_raw_fd(), word.as_ptr().cast(), 1) };
            if !got {
                return Err(errno);
            }
            let started = Instant::now();
            while !release_in_child.exists() && started.elapsed() < Duration::from_secs(20) {
                std::thread::sleep(Duration::from_millis(20));
            }
            Ok(0)
        })
    });
    let word = read_byte(&reader, Duration::from_secs(15));
    let started = Instant::now();
    let second = run_true(&work, &socket_dir);
    let took = started.elapsed();
    std::fs::write(&release, b"").unwrap();
    let outcome = holder.join().unwrap();
    assert_eq!(word, b'h', "nobody could not take the old lock");
    assert_eq!(outcome, Outcome::Ok(0));
    assert!(
        second.status.success(),
        "a launch while nobody held the old lock: {}",
        text(&second.stderr)
    );
    assert!(took < Duration::from_secs(10), "the launch waited {took:?}");
    assert!(text(&second.stderr).contains("replaced it with a fresh root-only lock file"));
    assert_eq!(mode(&lock), 0o600);
    assert_ne!(std::fs::metadata(&lock).unwrap().ino(), old_ino);
    sb.assert_no_mounts_under();
}

#[test]
fn after_a_run_the_work_dir_is_closed_to_other_users() {
    require_root();
    let sb = Sandbox::new("wdsec-modes");
    let socket_dir = sb.join("s");
    let work = sb.join("w");
    let out = output(cli(&work, &socket_dir).args([
        "run",
        "--volume",
        "a:1M:a",
        "--",
        "sh",
        "-c",
        "echo secret > a/f",
    ]));
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(mode(&work), 0o711, "work dir");
    for sub in ["csi", "isolators", "oci-hook", "sandboxes"] {
        assert_eq!(mode(&work.join(sub)), 0o700, "{sub}/");
    }
    let layout = Layout::new(&work, BUNDLED_TYPE, "default");
    assert_eq!(mode(&work.join("run.lock")), 0o600, "run.lock");
    assert_eq!(
        mode(&layout.plugin_dir().join("plugin.log")),
        0o600,
        "plugin.log"
    );
    let listed = as_nobody(|| std::fs::read_dir(&work).map(|_| 0).map_err(errno_of));
    assert_eq!(
        listed,
        Outcome::Failed(Errno::EACCES),
        "nobody lists the work dir"
    );
    let mounts = layout.mounts_dir();
    let reached = as_nobody(|| std::fs::read_dir(&mounts).map(|_| 0).map_err(errno_of));
    assert_eq!(
        reached,
        Outcome::Failed(Errno::EACCES),
        "nobody reaches the mount points"
    );
    sb.assert_no_mounts_under();
}

#[test]
fn an_older_wider_layout_is_narrowed() {
    require_root();
    let sb = Sandbox::new("wdsec-older");
    let socket_dir = sb.join("s");
    let work = sb.mkdir("w");
    for sub in ["csi", "isolators"] {
        std::fs::create_dir(work.join(sub)).unwrap();
        chmod(&work.join(sub), 0o755);
    }
    std::fs::write(work.join("run.lock"), "").unwrap();
    chmod(&work.join("run.lock"), 0o644);
    chmod(&work, 0o755);
    let out = run_true(&work, &socket_dir);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(mode(&work), 0o711, "work dir");
    assert_eq!(mode(&work.join("csi")), 0o700, "csi/");
    assert_eq!(mode(&work.join("isolators")), 0o700, "isolators/");
    assert_eq!(mode(&work.join("run.lock")), 0o600, "run.lock");
    sb.assert_no_mounts_under();
}

/// Where the bundled plugin's socket goes for `work` with `socket_dir`
/// (asserted to be the short path under `socket_dir`).
fn short_socket(work: &Path, socket_dir: &Path) -> PathBuf {
    let socket = Layout::new(work, BUNDLED_TYPE, "default").plugin_socket(socket_dir);
    assert!(
        socket.starts_with(socket_dir),
        "the work dir is too short for the socket to move: {}",
        socket.display()
    );
    socket
}

#[test]
fn a_plugin_socket_dir_made_first_by_another_user_is_refused() {
    require_root();
    let sb = Sandbox::new("wdsec-socket-dir");
    let work = sb.join("a-work-dir-deep-enough-for-the-short-socket-path");
    // A shared place, as /tmp or /run/user: root-owned and sticky.
    let shared = sb.mkdir("shared");
    chmod(&shared, 0o1777);
    let socket_dir = shared.join("s");
    let socket = short_socket(&work, &socket_dir);
    // nobody makes the socket dir first, open to all.
    let made = as_nobody(|| {
        std::fs::create_dir(&socket_dir)
            .and_then(|()| {
                std::fs::set_permissions(&socket_dir, std::fs::Permissions::from_mode(0o777))
            })
            .map(|()| 0)
            .map_err(errno_of)
    });
    assert_eq!(made, Outcome::Ok(0));
    let out = output(
        cli(&work, Path::new("/nonexistent"))
            .arg("run")
            .arg("--plugin-socket-dir")
            .arg(&socket_dir)
            .args(["--volume", "a:1M:a", "--", "true"]),
    );
    let dir = socket_dir.display().to_string();
    assert_refused(
        &out,
        "run",
        &[
            dir.as_str(),
            "plugin socket dir",
            "not owned by root",
            "owner uid 65534",
            "mode 0777",
            "--plugin-socket-dir",
        ],
    );
    assert!(names(&socket_dir).is_empty(), "{:?}", names(&socket_dir));
    assert!(!socket.exists());

    // The plugin's own directory made first, under a root-owned socket dir:
    // refused when another user owns it, and when it is not 0700.
    let socket_dir = sb.mkdir("s2");
    let socket = short_socket(&work, &socket_dir);
    let hash_dir = socket.parent().unwrap();
    std::fs::create_dir(hash_dir).unwrap();
    chmod(hash_dir, 0o700);
    chown_nobody(hash_dir);
    let out = output(cli(&work, &socket_dir).args(["run", "--volume", "a:1M:a", "--", "true"]));
    let dir = hash_dir.display().to_string();
    assert_refused(
        &out,
        "run",
        &[dir.as_str(), "not owned by root", "owner uid 65534"],
    );
    assert!(!socket.exists());
    std::os::unix::fs::lchown(hash_dir, Some(0), None).unwrap();
    chmod(hash_dir, 0o755);
    let out = output(cli(&work, &socket_dir).args(["run", "--volume", "a:1M:a", "--", "true"]));
    assert_refused(
        &out,
        "run",
        &[dir.as_str(), "not mode 0700", "mode 0755", "remove"],
    );
    assert!(!socket.exists());
    // Made by us, it serves.
    std::fs::remove_dir(hash_dir).unwrap();
    let out = output(cli(&work, &socket_dir).args(["run", "--volume", "a:1M:a", "--", "true"]));
    assert!(out.status.success(), "{}", text(&out.stderr));
    sb.assert_no_mounts_under();
}

#[tokio::test]
async fn plugin_log_stays_under_its_cap_while_the_plugin_writes_a_lot() {
    require_root();
    let sb = Sandbox::new("wdsec-log-cap");
    let dir = sb.join("p");
    let log = dir.join("plugin.log");
    let rotated = dir.join("plugin.log.1");
    // Three caps' worth of output, then a marker, then the real plugin.
    let flood = 3 * PLUGIN_LOG_MAX_BYTES;
    let script = format!(
        "head -c {flood} /dev/zero | tr '\\0' x; echo; echo end-of-flood >&2; exec \"$0\" --work-dir \"$1\""
    );
    let command = PluginCommand {
        program: PathBuf::from("/bin/sh"),
        args: vec![
            "-c".into(),
            script,
            plugin_bin().into(),
            sb.join("data").display().to_string(),
        ],
        env: Vec::new(),
    };
    let sup = Supervisor::start(
        "test/log-cap".into(),
        command,
        dir.join("csi.sock"),
        log.clone(),
        Duration::from_secs(60),
    )
    .await
    .expect("the plugin starts after its flood");
    sb.track(sup.pid().unwrap());
    // The flood went through the pipe before the plugin could serve; the
    // marker follows it into the current log.
    let start = Instant::now();
    while !std::fs::read(&log)
        .map(|b| b.windows(12).any(|w| w == b"end-of-flood"))
        .unwrap_or(false)
    {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the marker never reached the log"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let size = std::fs::metadata(&log).unwrap().len();
    let old = std::fs::metadata(&rotated).expect("rotated").len();
    assert!(size <= PLUGIN_LOG_MAX_BYTES, "plugin.log is {size} bytes");
    assert!(old <= PLUGIN_LOG_MAX_BYTES, "plugin.log.1 is {old} bytes");
    assert!(
        old > PLUGIN_LOG_MAX_BYTES / 2,
        "plugin.log.1 holds the flood's tail"
    );
    assert_eq!(mode(&log), 0o600);
    assert_eq!(mode(&rotated), 0o600);
    assert_eq!(mode(&dir), 0o700);
    sup.stop(Duration::from_secs(5)).await;
}
