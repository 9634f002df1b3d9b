//! `csi-isolator docker-plugin` killed (SIGKILL, by the crash-point hook
//! `CSI_ISOLATOR_CRASH_AFTER_WRITE=N`) at every crash point of a `Mount` and
//! of an `Unmount`, at the protocol level (HTTP on its socket, the bundled
//! plugin, real mounts; no engine). For each N: a plugin armed with N serves
//! the call and dies (its caller sees the connection close without an
//! answer); the next plugin, started without the hook, recovers; the call is
//! made again, as a user re-runs `docker run` (Docker does not retry a failed
//! Mount) or as Docker sends the Unmount of an ID it knows again. Then:
//! - after recovery the Mount ID is a user exactly when the volume is
//!   published (and mounted), under the last-use policy;
//! - after the retried Mount the volume is published for that ID alone,
//!   mounted, and holds what was written before; after the retried Unmount it
//!   is unpublished with no user and nothing is mounted under the work dir.
//!
//! The same again for a Mount and an Unmount of an ID while a second ID holds the volume: it
//! stays published and mounted for the second throughout, the first is a user after the retried
//! Mount and is not after the retried Unmount.
//!
//! Crash points counted while the plugin starts (recovery's own writes) come
//! first; a plugin that dies before it is ready is recovered from the same
//! way. The loop over N ends when the call completes without a crash; the
//! number of points survived is printed.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use csi_isolator::provider::checkpoint::CRASH_AFTER_WRITE_ENV;
use csi_isolator_testing::files::is_mounted;
use csi_isolator_testing::{
    mount_points_under, require_root, DockerPluginProcess, PluginProcess, Sandbox,
};
use nix::sys::signal::Signal;
use serde_json::{json, Value};

const BIN: &str = env!("CARGO_BIN_EXE_csi-isolator");
const TIMEOUT: Duration = Duration::from_secs(30);
/// Guards the loop over N against a call that never completes.
const MAX_POINTS: u32 = 40;
/// The Mount ID (Docker sends 64 hex digits).
const ID: &str = "cccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccc";
/// A second Mount ID, holding the volume while `ID` comes and goes.
const OTHER: &str = "dddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddd";

/// The test's sandbox and the CSI plugin its docker-plugins use.
struct Harness {
    sb: Sandbox,
    /// The separately started CSI plugin (over `--plugin-endpoint`), if any: it stays up
    /// through every crash of the docker-plugins.
    csi: Option<PluginProcess>,
    /// The docker-plugin's arguments that name its CSI plugin (none for the bundled one).
    args: Vec<String>,
}

impl Harness {
    /// The sandbox, and with `endpoint` a separately started `csi-test-plugin --backing loop`.
    fn new(label: &str, endpoint: bool) -> Harness {
        require_root();
        let sb = Sandbox::new(label);
        let (csi, args) = if endpoint {
            let csi = PluginProcess::start_loop_blocking(&sb);
            let args = vec!["--plugin-endpoint".to_string(), csi.endpoint()];
            (Some(csi), args)
        } else {
            (None, Vec::new())
        };
        Harness { sb, csi, args }
    }
}

/// A docker-plugin on the test's work dir and socket.
struct Plugin(DockerPluginProcess);

impl Plugin {
    /// Starts it, armed to die at crash point `crash_at` when given; `None` when it died
    /// before it printed its ready line (a crash point of its start-up).
    fn start(h: &Harness, crash_at: Option<u32>) -> Option<Plugin> {
        let sb = &h.sb;
        let n = crash_at.map(|n| n.to_string());
        let envs: Vec<(&str, &str)> = n
            .as_deref()
            .map(|n| (CRASH_AFTER_WRITE_ENV, n))
            .into_iter()
            .collect();
        // Unpublished at the last Unmount, so each round starts from CREATED.
        let args: Vec<&str> = h
            .args
            .iter()
            .map(String::as_str)
            .chain(["--unpublish-delay=0"])
            .collect();
        let started = DockerPluginProcess::try_start(
            sb,
            BIN,
            &sb.join("work"),
            &sb.join("d/csi-isolator.sock"),
            &args,
            &envs,
        );
        match started {
            Ok(plugin) => Some(Plugin(plugin)),
            Err((status, log)) => {
                assert_eq!(
                    status.signal(),
                    Some(9),
                    "docker-plugin exited before it was ready, not at a crash point: {status}\n{log}"
                );
                None
            }
        }
    }

    fn work(&self) -> &Path {
        &self.0.work
    }

    /// One POST: `Some((status, answer))`, or `None` when the connection closed without an
    /// answer (the process died).
    fn post(&self, endpoint: &str, body: &Value) -> Option<(u16, Value)> {
        let mut s = UnixStream::connect(&self.0.socket).expect("connect to docker-plugin");
        s.set_read_timeout(Some(TIMEOUT)).expect("read timeout");
        let body = body.to_string();
        write!(
            s,
            "POST {endpoint} HTTP/1.1\r\nHost: plugin\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .expect("send the request");
        let mut text = String::new();
        match s.read_to_string(&mut text) {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return None,
            Err(e) => panic!("{endpoint}: read the answer: {e}"),
        }
        let (head, answer) = text.split_once("\r\n\r\n")?;
        let status = head
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("{endpoint}: no status: {head}"));
        let answer = serde_json::from_str(answer)
            .unwrap_or_else(|e| panic!("{endpoint}: answer is not JSON ({e}): {answer}"));
        Some((status, answer))
    }

    /// A POST that must succeed: its answer.
    fn ok(&self, endpoint: &str, body: Value) -> Value {
        let (status, answer) = self
            .post(endpoint, &body)
            .unwrap_or_else(|| panic!("{endpoint}: no answer"));
        assert_eq!(status, 200, "{endpoint}: {answer}");
        answer
    }

    /// `Get` of the volume: (its users, its mount point while published).
    fn get(&self) -> (Vec<String>, String) {
        let got = self.ok("/VolumeDriver.Get", json!({"Name": "v"}));
        let users = serde_json::from_value(got["Volume"]["Status"]["users"].clone())
            .expect("users are strings");
        let mountpoint = got["Volume"]["Mountpoint"].as_str().unwrap_or("");
        (users, mountpoint.to_string())
    }

    /// SIGTERM, and a clean exit.
    fn stop(self, sb: &Sandbox) {
        let status = self.0.stop(sb, Signal::SIGTERM);
        assert!(status.success(), "docker-plugin: {status}");
    }
}

/// SIGKILL for a plugin still armed (a clean stop could reach its crash point).
fn kill_now(sb: &Sandbox, plugin: Plugin) {
    plugin.0.stop(sb, Signal::SIGKILL);
}

/// A plugin without the hook, after a crash: the ID is a user exactly when the volume is
/// published and mounted. Returns the plugin and whether the ID was kept.
fn recovered(h: &Harness, what: &str, n: u32) -> (Plugin, bool) {
    let plugin = Plugin::start(h, None).expect("a plugin without the hook starts");
    let (users, mountpoint) = plugin.get();
    let kept = match users.as_slice() {
        [] => false,
        [id] if id == ID => true,
        other => panic!("{what} crash point {n}: users after recovery {other:?}"),
    };
    let mounted = mount_points_under(plugin.work());
    if kept {
        assert!(
            is_mounted(Path::new(&mountpoint)),
            "{what} crash point {n}: a user but {mountpoint:?} is not mounted ({mounted:?})"
        );
    } else {
        assert_eq!(mountpoint, "", "{what} crash point {n}: no user, published");
        assert!(
            mounted.is_empty(),
            "{what} crash point {n}: no user, yet mounted: {mounted:?}"
        );
    }
    (plugin, kept)
}

/// A plugin without the hook, after a crash of a call for [`ID`] while [`OTHER`] holds the
/// volume: `OTHER` is still a user, `ID` may or may not be, and the volume is published and
/// mounted.
fn recovered_shared(h: &Harness, call: &str, n: u32) -> Plugin {
    let plugin = Plugin::start(h, None).expect("a plugin without the hook starts");
    let (users, mountpoint) = plugin.get();
    assert!(
        users.iter().any(|u| u == OTHER) && users.iter().all(|u| u == OTHER || u == ID),
        "shared {call} crash point {n}: users after recovery {users:?}"
    );
    assert!(
        is_mounted(Path::new(&mountpoint)),
        "shared {call} crash point {n}: {mountpoint:?} is not mounted"
    );
    plugin
}

/// Mount the ID (the volume ends published for it alone, holding `marker`), then Unmount it
/// (nothing mounted, no user).
fn mount_then_unmount(plugin: &Plugin, what: &str, n: u32) {
    let answer = plugin.ok("/VolumeDriver.Mount", json!({"Name": "v", "ID": ID}));
    let mountpoint = PathBuf::from(answer["Mountpoint"].as_str().expect("a Mountpoint"));
    assert!(is_mounted(&mountpoint), "{what} crash point {n}");
    assert_eq!(plugin.get().0, [ID], "{what} crash point {n}");
    assert_eq!(
        std::fs::read(mountpoint.join("marker")).expect("read the marker"),
        b"kept",
        "{what} crash point {n}: the data survived"
    );
    plugin.ok("/VolumeDriver.Unmount", json!({"Name": "v", "ID": ID}));
    assert_eq!(
        plugin.get(),
        (vec![], String::new()),
        "{what} crash point {n}"
    );
    let mounted = mount_points_under(plugin.work());
    assert!(mounted.is_empty(), "{what} crash point {n}: {mounted:?}");
}

#[test]
fn docker_plugin_killed_at_every_crash_point_of_mount_and_unmount_recovers() {
    crash_points(Harness::new("docker-crash", false));
}

/// The same over `--plugin-endpoint`: a separately started CSI plugin that survives every
/// crash of the docker-plugins.
#[test]
fn docker_plugin_over_an_endpoint_killed_at_every_crash_point_of_mount_and_unmount_recovers() {
    crash_points(Harness::new("docker-crash-ep", true));
}

fn crash_points(h: Harness) {
    let sb = &h.sb;

    // The volume, holding a marker.
    let plugin = Plugin::start(&h, None).expect("start docker-plugin");
    plugin.ok(
        "/VolumeDriver.Create",
        json!({"Name": "v", "Opts": {"size": "8M"}}),
    );
    let answer = plugin.ok("/VolumeDriver.Mount", json!({"Name": "v", "ID": ID}));
    let mountpoint = PathBuf::from(answer["Mountpoint"].as_str().expect("a Mountpoint"));
    std::fs::write(mountpoint.join("marker"), b"kept").expect("write the marker");
    plugin.ok("/VolumeDriver.Unmount", json!({"Name": "v", "ID": ID}));
    plugin.stop(sb);

    // Mount: unpublished, no user, before each; published for the ID after the retry.
    let mut survived = 0;
    for n in 1..=MAX_POINTS {
        assert!(n < MAX_POINTS, "Mount still crashed at point {n}");
        let Some(armed) = Plugin::start(&h, Some(n)) else {
            survived += 1;
            let (plugin, _) = recovered(&h, "Mount (start-up)", n);
            mount_then_unmount(&plugin, "Mount (start-up)", n);
            plugin.stop(sb);
            continue;
        };
        let mut armed = armed;
        match armed.post("/VolumeDriver.Mount", &json!({"Name": "v", "ID": ID})) {
            Some((200, _)) => {
                // No crash point left: the call completed. The hook is still armed: check
                // with a plugin without it.
                kill_now(sb, armed);
                let (plugin, kept) = recovered(&h, "Mount (completed)", n);
                assert!(kept, "Mount answered, then forgotten");
                mount_then_unmount(&plugin, "Mount (completed)", n);
                plugin.stop(sb);
                break;
            }
            Some((status, answer)) => panic!("Mount at crash point {n}: {status} {answer}"),
            None => {}
        }
        let status = armed.0.wait(sb);
        assert_eq!(status.signal(), Some(9), "Mount crash point {n}: {status}");
        survived += 1;
        let (plugin, _) = recovered(&h, "Mount", n);
        mount_then_unmount(&plugin, "Mount", n);
        plugin.stop(sb);
    }
    eprintln!("Mount: {survived} crash points survived");
    let mount_points = survived;

    // Unmount of the last user: published for the ID before each; unpublished after the retry.
    survived = 0;
    for n in 1..=MAX_POINTS {
        assert!(n < MAX_POINTS, "Unmount still crashed at point {n}");
        let plugin = Plugin::start(&h, None).expect("start docker-plugin");
        plugin.ok("/VolumeDriver.Mount", json!({"Name": "v", "ID": ID}));
        plugin.stop(sb);
        let Some(mut armed) = Plugin::start(&h, Some(n)) else {
            survived += 1;
            let (plugin, kept) = recovered(&h, "Unmount (start-up)", n);
            assert!(kept, "start-up crash point {n} dropped the use");
            plugin.ok("/VolumeDriver.Unmount", json!({"Name": "v", "ID": ID}));
            mount_then_unmount(&plugin, "Unmount (start-up)", n);
            plugin.stop(sb);
            continue;
        };
        match armed.post("/VolumeDriver.Unmount", &json!({"Name": "v", "ID": ID})) {
            Some((200, _)) => {
                kill_now(sb, armed);
                let (plugin, kept) = recovered(&h, "Unmount (completed)", n);
                assert!(!kept, "Unmount answered, then the use came back");
                mount_then_unmount(&plugin, "Unmount (completed)", n);
                plugin.stop(sb);
                break;
            }
            Some((status, answer)) => panic!("Unmount at crash point {n}: {status} {answer}"),
            None => {}
        }
        let status = armed.0.wait(sb);
        assert_eq!(
            status.signal(),
            Some(9),
            "Unmount crash point {n}: {status}"
        );
        survived += 1;
        let (plugin, _) = recovered(&h, "Unmount", n);
        // Docker sends the Unmount of the ID it knows again.
        plugin.ok("/VolumeDriver.Unmount", json!({"Name": "v", "ID": ID}));
        assert_eq!(
            plugin.get(),
            (vec![], String::new()),
            "Unmount crash point {n}"
        );
        let mounted = mount_points_under(plugin.work());
        assert!(mounted.is_empty(), "Unmount crash point {n}: {mounted:?}");
        mount_then_unmount(&plugin, "Unmount", n);
        plugin.stop(sb);
    }
    eprintln!("Unmount: {survived} crash points survived");
    assert!(
        mount_points > 0 && survived > 0,
        "the hook never fired: is CSI_ISOLATOR_CRASH_AFTER_WRITE still read?"
    );

    // The same with a second ID holding the volume throughout: Mount and Unmount of a user that
    // is not the last (the volume stays published whatever happens).
    let plugin = Plugin::start(&h, None).expect("start docker-plugin");
    plugin.ok("/VolumeDriver.Mount", json!({"Name": "v", "ID": OTHER}));
    plugin.stop(sb);
    for (call, before, after) in [
        ("/VolumeDriver.Mount", false, true),
        ("/VolumeDriver.Unmount", true, false),
    ] {
        let mut survived = 0;
        for n in 1..=MAX_POINTS {
            assert!(n < MAX_POINTS, "shared {call} still crashed at point {n}");
            if before {
                let plugin = Plugin::start(&h, None).expect("start docker-plugin");
                plugin.ok("/VolumeDriver.Mount", json!({"Name": "v", "ID": ID}));
                plugin.stop(sb);
            }
            let completed = match Plugin::start(&h, Some(n)) {
                None => false,
                Some(mut armed) => match armed.post(call, &json!({"Name": "v", "ID": ID})) {
                    Some((200, _)) => {
                        kill_now(sb, armed);
                        true
                    }
                    Some((status, answer)) => {
                        panic!("shared {call} at crash point {n}: {status} {answer}")
                    }
                    None => {
                        let status = armed.0.wait(sb);
                        assert_eq!(status.signal(), Some(9), "shared {call} {n}: {status}");
                        false
                    }
                },
            };
            let plugin = recovered_shared(&h, call, n);
            // The call again (a re-run, or Docker's Unmount of the ID it knows).
            plugin.ok(call, json!({"Name": "v", "ID": ID}));
            let (users, mountpoint) = plugin.get();
            let want: Vec<&str> = if after { vec![ID, OTHER] } else { vec![OTHER] };
            let mut users = users;
            users.sort();
            assert_eq!(users, want, "shared {call} crash point {n}");
            assert!(is_mounted(Path::new(&mountpoint)), "shared {call} {n}");
            if after {
                plugin.ok("/VolumeDriver.Unmount", json!({"Name": "v", "ID": ID}));
            }
            plugin.stop(sb);
            if completed {
                break;
            }
            survived += 1;
        }
        eprintln!("{call} beside another user: {survived} crash points survived");
        assert!(survived > 0, "shared {call}: the hook never fired");
    }
    let plugin = Plugin::start(&h, None).expect("start docker-plugin");
    plugin.ok("/VolumeDriver.Unmount", json!({"Name": "v", "ID": OTHER}));
    assert_eq!(plugin.get(), (vec![], String::new()));
    plugin.stop(sb);

    // Removed: nothing left.
    let plugin = Plugin::start(&h, None).expect("start docker-plugin");
    plugin.ok("/VolumeDriver.Remove", json!({"Name": "v"}));
    let listed = plugin.ok("/VolumeDriver.List", json!({}));
    assert_eq!(listed["Volumes"], json!([]));
    plugin.stop(sb);
    if let Some(csi) = &h.csi {
        // The same CSI plugin throughout, and nothing left in it.
        let pid = csi.pid().expect("the CSI plugin runs");
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        assert!(
            !stat.is_empty()
                && !stat
                    .rsplit(')')
                    .next()
                    .unwrap_or("")
                    .trim_start()
                    .starts_with('Z'),
            "the CSI plugin did not stay up: {stat:?}"
        );
        let calls = csi.calls();
        let count = |rpc: &str| calls.iter().filter(|c| c.starts_with(rpc)).count();
        assert_eq!(count("CreateVolume "), 1, "{calls:?}");
        assert_eq!(count("DeleteVolume "), 1, "{calls:?}");
    }
    let Harness { sb, csi, .. } = h;
    drop(csi);
    sb.assert_no_mounts_under();
    sb.assert_no_loop_devices();
}
