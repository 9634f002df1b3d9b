//! The shipped systemd unit, `contrib/systemd/csi-isolator-docker-plugin.service`: its
//! `ExecStart` command line runs the real binary as systemd would (the work dir and socket
//! moved into the sandbox, `$NOTIFY_SOCKET` set), which serves, says `READY=1` only once its
//! socket answers, says `STOPPING=1` at SIGTERM and exits cleanly; the unit names what the docs
//! promise (`Type=notify`, `KillMode=mixed`, ordered before `docker.service`); and
//! `systemd-analyze verify` reads it without a complaint.
//!
//! Needs root (docker-plugin mounts) and `systemd-analyze` (Debian's systemd, installed by
//! `.ci/run`): without them the tests fail, they never skip.

use std::io::{Read, Write};
use std::os::unix::net::{UnixDatagram, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use csi_isolator_testing::{processes_mentioning, require_root, Sandbox};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

const BIN: &str = env!("CARGO_BIN_EXE_csi-isolator");
const UNIT: &str = "csi-isolator-docker-plugin.service";

fn unit_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("contrib/systemd")
        .join(UNIT)
}

fn unit_text() -> String {
    std::fs::read_to_string(unit_path()).expect("read the shipped unit")
}

/// The values of `key=` in the unit, in order (no continuation lines: the unit has none).
fn values(unit: &str, key: &str) -> Vec<String> {
    unit.lines()
        .filter_map(|l| l.strip_prefix(key)?.strip_prefix('='))
        .map(str::to_string)
        .collect()
}

/// `ExecStart`'s words (the unit quotes nothing, so systemd splits it on spaces too).
fn exec_start(unit: &str) -> Vec<String> {
    let lines = values(unit, "ExecStart");
    assert_eq!(lines.len(), 1, "one ExecStart: {lines:?}");
    let line = &lines[0];
    assert!(
        !line.contains(['"', '\'', '\\', '$', '%']),
        "ExecStart needs no quoting, variables or specifiers: {line}"
    );
    line.split_whitespace().map(str::to_string).collect()
}

/// Replaces the value after `flag` (which must be there) with `value`.
fn replace_value(args: &mut [String], flag: &str, value: &Path) {
    let at = args
        .iter()
        .position(|a| a == flag)
        .unwrap_or_else(|| panic!("ExecStart names no {flag}: {args:?}"));
    args[at + 1] = value.display().to_string();
}

/// One notification datagram (10 s at most).
fn notification(socket: &UnixDatagram) -> String {
    socket
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("set read timeout");
    let mut buf = [0u8; 1024];
    let n = socket
        .recv(&mut buf)
        .expect("a notification from the service");
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

#[test]
fn the_units_exec_start_serves_notifies_ready_then_stopping_and_exits_cleanly() {
    require_root();
    let unit = unit_text();
    assert_eq!(values(&unit, "Type"), ["notify"]);
    assert_eq!(values(&unit, "KillMode"), ["mixed"]);
    let before = values(&unit, "Before").join(" ");
    assert!(
        before.split_whitespace().any(|u| u == "docker.service"),
        "{before}"
    );

    let mut args = exec_start(&unit);
    let program = args.remove(0);
    assert!(
        program.starts_with('/') && program.ends_with("/csi-isolator"),
        "ExecStart runs {program}"
    );
    assert_eq!(
        args.iter().filter(|a| !a.starts_with('-')).count(),
        // `docker-plugin` and the two values replaced below.
        3,
        "ExecStart has arguments this test does not account for: {args:?}"
    );
    let sb = Sandbox::new("unit");
    let work = sb.mkdir("work");
    let socket = sb.join("plugins/csi-isolator.sock");
    replace_value(&mut args, "--work-dir", &work);
    replace_value(&mut args, "--socket", &socket);
    let notify_path = sb.join("notify");
    let notify = UnixDatagram::bind(&notify_path).expect("bind the notify socket");

    let log = sb.join("docker-plugin.log");
    let mut cmd = Command::new(BIN);
    cmd.args(&args)
        .env("NOTIFY_SOCKET", &notify_path)
        .env("CSI_ISOLATOR_SOCKET_DIR", sb.join("s"))
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("create the log"));
    let mut child = sb.spawn(&mut cmd).expect("spawn the unit's command");
    let read_log = || std::fs::read_to_string(&log).unwrap_or_default();

    let ready = notification(&notify);
    assert!(
        ready.lines().next() == Some("READY=1"),
        "{ready}\n{}",
        read_log()
    );
    assert!(ready.contains(&socket.display().to_string()), "{ready}");
    // Ready means serving: the first call is answered.
    let mut conn = UnixStream::connect(&socket).expect("connect once READY=1 came");
    conn.write_all(
        b"POST /Plugin.Activate HTTP/1.1\r\nHost: plugin\r\nContent-Length: 2\r\n\r\n{}",
    )
    .expect("send Activate");
    let mut answer = String::new();
    conn.read_to_string(&mut answer).expect("read the answer");
    assert!(
        answer.starts_with("HTTP/1.1 200") && answer.contains("VolumeDriver"),
        "{answer}"
    );

    // The managed plugin (the only other process naming the sandbox) does not get the
    // readiness socket: it must not report for the service.
    let plugins: Vec<u32> = processes_mentioning(sb.path())
        .into_iter()
        .filter(|&pid| pid != child.id())
        .collect();
    assert!(
        !plugins.is_empty(),
        "no managed plugin runs\n{}",
        read_log()
    );
    for pid in plugins {
        let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        assert!(
            !environ
                .split(|&b| b == 0)
                .any(|var| var.starts_with(b"NOTIFY_SOCKET=")),
            "the managed plugin {pid} inherited NOTIFY_SOCKET"
        );
    }

    kill(Pid::from_raw(child.id() as i32), Signal::SIGTERM).expect("SIGTERM");
    assert_eq!(notification(&notify), "STOPPING=1");
    let status = csi_isolator_testing::engines::wait_bounded(&mut child, "docker-plugin");
    sb.untrack(child.id());
    assert!(status.success(), "{status}\n{}", read_log());
    assert!(!socket.exists(), "the socket is left");
    let left = processes_mentioning(sb.path());
    assert!(left.is_empty(), "processes left: {left:?}");
    sb.assert_no_mounts_under();
}

#[test]
fn systemd_analyze_verify_accepts_the_unit() {
    let present = Command::new("systemd-analyze")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        present,
        "`systemd-analyze` is not installed: run .ci/run (it installs Debian's systemd); this test does not skip"
    );
    // verify checks that ExecStart's program exists: the copy runs the binary under test.
    let unit = unit_text();
    let installed = exec_start(&unit)[0].clone();
    let sb = Sandbox::new("unit-verify");
    let copy = sb.join(UNIT);
    std::fs::write(
        &copy,
        unit.replace(
            &format!("ExecStart={installed} "),
            &format!("ExecStart={BIN} "),
        ),
    )
    .expect("write the unit's copy");
    // --man=no: the man page (`csi-isolator man`) need not be installed here.
    let out = Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(&copy)
        .output()
        .expect("run systemd-analyze");
    let stderr = String::from_utf8_lossy(&out.stderr);
    // verify exits 0 after some complaints (an unknown value is "ignoring"): any output fails.
    assert!(
        out.status.success() && stderr.trim().is_empty(),
        "systemd-analyze verify: {}\n{stderr}",
        out.status
    );
}
