//! The `csi-isolator` command end to end, as a user runs it: the built
//! binaries, the bundled plugin (or an external one), real namespaces.

use csi_isolator_testing::plugin_bin;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use csi_isolator::mount::{MountTable, ProcMountTable};
use csi_isolator_testing::{
    busybox_rootfs, isolator_command, processes_mentioning, require_root, PluginProcess, Sandbox,
};

const CLI: &str = env!("CARGO_BIN_EXE_csi-isolator");

fn cli(work: &Path) -> Command {
    isolator_command(CLI, work)
}

fn output(cmd: &mut Command) -> Output {
    cmd.output().expect("run csi-isolator")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn assert_nothing_left(sb: &Sandbox, work: &Path) {
    sb.assert_no_mounts_under();
    sb.assert_no_loop_devices();
    let lock = std::fs::File::open(work.join("run.lock")).expect("the lock file stays");
    assert!(
        nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusiveNonblock).is_ok(),
        "nobody holds the work-dir lock"
    );
    let procs = processes_mentioning(work);
    assert!(procs.is_empty(), "processes left: {procs:?}");
}

#[test]
fn a_second_run_reads_what_the_first_wrote() {
    require_root();
    let sb = Sandbox::new("cli-twice");
    let work = sb.join("work");
    let first = output(cli(&work).args([
        "run",
        "--volume",
        "data:32M:data",
        "--",
        "sh",
        "-c",
        "echo first >> data/log; cat data/log",
    ]));
    assert!(first.status.success(), "{}", text(&first.stderr));
    assert_eq!(text(&first.stdout), "first\n");
    let second = output(cli(&work).args([
        "run",
        "--volume",
        "data:32M:data",
        "--",
        "sh",
        "-c",
        "echo second >> data/log; cat data/log; exit 7",
    ]));
    assert_eq!(
        second.status.code(),
        Some(7),
        "the workload's status: {}",
        text(&second.stderr)
    );
    assert_eq!(text(&second.stdout), "first\nsecond\n");
    // status: one volume, not in use, not mounted, nothing disagrees.
    let status = output(cli(&work).args(["status", "--json"]));
    assert!(status.status.success(), "{}", text(&status.stdout));
    let report: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    let vols = report["volumes"].as_array().unwrap();
    assert_eq!(vols.len(), 1);
    assert_eq!(vols[0]["name"], "data");
    assert_eq!(vols[0]["state"], "CREATED");
    assert_eq!(vols[0]["mounted"], false);
    assert_nothing_left(&sb, &work);
}

#[test]
fn stdin_passes_through_and_read_only_volumes_stay_unchanged() {
    require_root();
    let sb = Sandbox::new("cli-stdin");
    let work = sb.join("work");
    let mut child = cli(&work)
        .args([
            "run",
            "--volume",
            "ro:16M:ro:ro",
            "--",
            "sh",
            "-c",
            "read line; echo got:$line; echo x > ro/f",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child.stdin.take().unwrap().write_all(b"hello\n").unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(text(&out.stdout), "got:hello\n");
    assert_ne!(
        out.status.code(),
        Some(0),
        "a write into a read-only volume fails"
    );
    assert!(
        text(&out.stderr).contains("Read-only file system"),
        "{}",
        text(&out.stderr)
    );
    assert_nothing_left(&sb, &work);
}

#[test]
fn sigint_stops_the_workload_and_cleans_everything_up() {
    require_root();
    let sb = Sandbox::new("cli-sigint");
    let work = sb.join("work");
    let pidfile = sb.join("workload.pid");
    let script = format!("echo $$ > {}; exec sleep 60", pidfile.display());
    let child = cli(&work)
        .args(["run", "--volume", "v:16M:v", "--", "sh", "-c", &script])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    sb.track(child.id());
    let deadline = Instant::now() + Duration::from_secs(20);
    while !pidfile.exists() || std::fs::read_to_string(&pidfile).unwrap().trim().is_empty() {
        assert!(Instant::now() < deadline, "the workload never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    let workload: i32 = std::fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    // While it runs: published and mounted, the lock held.
    assert!(!ProcMountTable::new()
        .mounts_under(&work)
        .unwrap()
        .is_empty());
    assert!(work.join("run.lock").exists());
    let busy = output(cli(&work).args(["run", "--volume", "v:16M:v", "--", "true"]));
    assert!(!busy.status.success());
    assert!(
        text(&busy.stderr).contains("in use by another csi-isolator"),
        "{}",
        text(&busy.stderr)
    );

    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGINT,
    )
    .unwrap();
    let pid = child.id();
    let out = child.wait_with_output().unwrap();
    sb.untrack(pid);
    assert_eq!(
        out.status.code(),
        Some(128 + 15),
        "the workload died of SIGTERM: {}",
        text(&out.stderr)
    );
    assert!(
        !Path::new(&format!("/proc/{workload}")).exists(),
        "workload gone"
    );
    assert_nothing_left(&sb, &work);
}

#[test]
fn resources_json_and_an_external_plugin() {
    require_root();
    let sb = Sandbox::new("cli-resources");
    let plugin = PluginProcess::start(&sb, plugin_bin(), &["--backing", "loop"]).await_blocking();
    let work = sb.join("work");
    let endpoint = plugin.endpoint();
    let created = output(cli(&work).args([
        "volume",
        "--plugin-endpoint",
        &endpoint,
        "create",
        "db",
        "16M",
    ]));
    assert!(created.status.success(), "{}", text(&created.stderr));
    let mut res: serde_json::Value = serde_json::from_slice(&created.stdout).unwrap();
    res["disk"]["volume"] = serde_json::json!({"container_path": "db", "mode": "RW"});
    let file = sb.join("resources.json");
    std::fs::write(
        &file,
        serde_json::to_vec(
            &serde_json::json!([res, {"name": "cpus", "type": "SCALAR", "scalar": {"value": 1}}]),
        )
        .unwrap(),
    )
    .unwrap();
    let out = output(
        cli(&work)
            .args(["run", "--plugin-endpoint", &endpoint, "--resources"])
            .arg(&file)
            .args([
                "--",
                "sh",
                "-c",
                "df -T db | tail -1 | grep -q ext4 && echo ok > db/f && cat db/f",
            ]),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "ok\n");
    let destroyed =
        output(cli(&work).args(["volume", "--plugin-endpoint", &endpoint, "destroy", "db"]));
    assert!(destroyed.status.success(), "{}", text(&destroyed.stderr));
    drop(plugin);
    assert_nothing_left(&sb, &work);
}

trait Blocking {
    type Out;
    fn await_blocking(self) -> Self::Out;
}
impl<F: std::future::Future> Blocking for F {
    type Out = F::Output;
    fn await_blocking(self) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(self)
    }
}

#[test]
fn rootfs_pivot_with_a_volume_at_an_absolute_path() {
    require_root();
    let sb = Sandbox::new("cli-rootfs");
    let work = sb.join("work");
    let rootfs = busybox_rootfs(&sb, "rootfs");
    let out = output(cli(&work).arg("run").arg("--rootfs").arg(&rootfs).args([
        "--volume",
        "abs:16M:/srv/data",
        "--",
        "/bin/sh",
        "-c",
        "echo inside > /srv/data/f && cat /srv/data/f && pwd",
    ]));
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "inside\n/mnt/mesos/sandbox\n");
    assert!(
        !rootfs.join("srv/data/f").exists(),
        "the write went to the volume, not the rootfs"
    );
    assert_nothing_left(&sb, &work);
}

#[test]
fn errors_are_written_for_people() {
    require_root();
    let sb = Sandbox::new("cli-errors");
    let work = sb.join("work");
    let bad = output(cli(&work).args(["run", "--volume", "data:64M", "--", "true"]));
    assert_eq!(bad.status.code(), Some(2));
    assert!(
        text(&bad.stderr).contains("missing CONTAINER_PATH"),
        "{}",
        text(&bad.stderr)
    );

    let unreachable = output(cli(&work).args([
        "run",
        "--plugin-endpoint",
        "unix:///nonexistent/csi.sock",
        "--plugin-timeout",
        "1",
        "--volume",
        "a:1M:a",
        "--",
        "true",
    ]));
    assert!(!unreachable.status.success());
    let msg = text(&unreachable.stderr);
    assert!(
        msg.contains("unix:///nonexistent/csi.sock") && msg.contains("did not appear"),
        "{msg}"
    );
    assert_eq!(msg.lines().count(), 1, "one line: {msg}");

    let unprivileged = output(
        Command::new("setpriv")
            .env("CSI_ISOLATOR_SOCKET_DIR", sb.join("s"))
            .args(["--bounding-set=-sys_admin", CLI, "--work-dir"])
            .arg(&work)
            .args(["run", "--volume", "a:1M:a", "--", "true"]),
    );
    assert!(!unprivileged.status.success());
    assert_eq!(
        text(&unprivileged.stderr).trim(),
        "csi-isolator: csi-isolator run needs CAP_SYS_ADMIN (it creates mount namespaces and bind mounts): run it as root"
    );

    assert!(output(cli(&work).args(["volume", "create", "inuse", "8M"]))
        .status
        .success());
    assert!(
        output(cli(&work).args(["volume", "publish", "inuse", "--container", "c-42"]))
            .status
            .success()
    );
    let refused = output(cli(&work).args(["volume", "destroy", "inuse"]));
    assert!(!refused.status.success());
    assert!(
        text(&refused.stderr).contains("in use by container(s) c-42"),
        "{}",
        text(&refused.stderr)
    );
    assert!(
        output(cli(&work).args(["volume", "release", "inuse", "--container", "c-42"]))
            .status
            .success()
    );
    assert!(output(cli(&work).args(["volume", "destroy", "inuse"]))
        .status
        .success());

    let failing = output(cli(&work).args([
        "run",
        "--plugin-arg=--fail=NodePublishVolume=PERMISSION_DENIED",
        "--volume",
        "x:8M:x",
        "--",
        "sh",
        "-c",
        "echo should-not-run",
    ]));
    assert!(!failing.status.success());
    let msg = text(&failing.stderr);
    assert!(
        msg.contains("NodePublishVolume") && msg.contains("PERMISSION_DENIED"),
        "{msg}"
    );
    assert!(
        !text(&failing.stdout).contains("should-not-run"),
        "failed before exec"
    );
    assert_nothing_left(&sb, &work);
}

#[test]
fn the_long_mount_form_creates_with_its_options_and_refuses_what_differs() {
    require_root();
    let sb = Sandbox::new("cli-mount");
    let work = sb.join("work");
    let made = output(cli(&work).args([
        "run",
        "--mount",
        "source=db,target=db,size=16M,fs-type=ext4",
        "--mount",
        "src=ref,dst=ref,size=8M,ro",
        "--",
        "sh",
        "-c",
        "echo kept > db/f; cat db/f; echo x > ref/f",
    ]));
    assert_ne!(made.status.code(), Some(0), "ref is read-only");
    assert_eq!(text(&made.stdout), "kept\n", "{}", text(&made.stderr));
    assert!(
        text(&made.stderr).contains("Read-only file system"),
        "{}",
        text(&made.stderr)
    );
    let status = output(cli(&work).args(["volume", "list", "--json"]));
    let listed: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    let db = listed
        .as_array()
        .and_then(|vols| vols.iter().find(|v| v["name"] == "db"))
        .unwrap_or_else(|| panic!("db listed: {listed}"));
    assert_eq!(db["capability"]["fs_type"], "ext4", "{db}");

    // The same volume by its short form, and by the long one without options: used as it is.
    let again = output(cli(&work).args([
        "run",
        "--volume",
        "db:16M:db",
        "--mount",
        "source=ref,target=ref,size=8M,readonly",
        "--",
        "cat",
        "db/f",
    ]));
    assert!(again.status.success(), "{}", text(&again.stderr));
    assert_eq!(text(&again.stdout), "kept\n");

    // Other options than the volume has: refused before anything runs.
    let other = output(cli(&work).args([
        "run",
        "--mount",
        "source=db,target=db,size=16M,access-mode=MULTI_NODE_READER_ONLY",
        "--",
        "true",
    ]));
    assert!(!other.status.success());
    assert!(
        text(&other.stderr).contains(
            "volume 'db' exists with capability SINGLE_NODE_WRITER fs_type=ext4, not MULTI_NODE_READER_ONLY fs_type=ext4"
        ),
        "{}",
        text(&other.stderr)
    );

    for (entry, says) in [
        (
            "source=a,target=a,size=1M,colour=red",
            "option 'colour': unknown key",
        ),
        ("source=a,target=a", "option 'size': is required"),
    ] {
        let bad = output(cli(&work).args(["run", "--mount", entry, "--", "true"]));
        assert_eq!(bad.status.code(), Some(2), "{entry}");
        assert!(
            text(&bad.stderr).contains(says),
            "{entry}: {}",
            text(&bad.stderr)
        );
    }
    assert_nothing_left(&sb, &work);
}

/// The per-mount options of the workload's mount at `target` (relative to its sandbox), read from
/// its own mount table.
const MOUNT_OPTIONS_OF: &str = "awk -v t=\"/$1\" 'substr($5, length($5) - length(t) + 1) == t { print $6 }' /proc/self/mountinfo";

#[test]
fn a_volumes_hardening_flags_stay_on_the_containers_copy_and_no_others() {
    require_root();
    let sb = Sandbox::new("cli-hardening");
    let work = sb.join("work");
    let run = output(cli(&work).args([
        "run",
        "--mount",
        "source=hard,target=hard,size=8M,mount-flags=nosuid:nodev:noexec",
        "--mount",
        "source=plain,target=plain,size=8M",
        "--mount",
        "source=roh,target=roh,size=8M,ro,mount-flags=nosuid",
        "--",
        "sh",
        "-c",
        &format!(
            "f() {{ {MOUNT_OPTIONS_OF}; }}; echo \"hard $(f hard)\"; echo \"plain $(f plain)\"; echo \"roh $(f roh)\""
        ),
    ]));
    assert!(run.status.success(), "{}", text(&run.stderr));
    let out = text(&run.stdout);
    let options = |name: &str| -> Vec<String> {
        let line = out
            .lines()
            .find(|l| l.starts_with(&format!("{name} ")))
            .unwrap_or_else(|| panic!("{name} in {out}"));
        line.split_whitespace()
            .nth(1)
            .unwrap_or_else(|| panic!("{name} has no mount in the container: {out}"))
            .split(',')
            .map(str::to_string)
            .collect()
    };
    // What the volume asks is on the container's copy ...
    for flag in ["nosuid", "nodev", "noexec"] {
        assert!(options("hard").contains(&flag.to_string()), "{out}");
    }
    // ... kept through a read-only copy's remount ...
    let roh = options("roh");
    assert!(
        roh.contains(&"ro".to_string()) && roh.contains(&"nosuid".to_string()),
        "{out}"
    );
    assert!(!roh.contains(&"nodev".to_string()), "{out}");
    // ... and a volume that asks nothing gets none of the host mount point's nosuid,nodev.
    let plain = options("plain");
    for flag in ["nosuid", "nodev", "noexec"] {
        assert!(!plain.contains(&flag.to_string()), "{out}");
    }
    assert_nothing_left(&sb, &work);
}

#[test]
fn a_non_root_workload_writes_the_volumes_it_does_not_share() {
    require_root();
    let sb = Sandbox::new("cli-user");
    let work = sb.join("work");
    let script = "id -u; id -g; id -G; echo mine > data/f && stat -c '%u:%g' data/f; \
                  ! touch ref/f 2>/dev/null && echo ref-refused";
    let out = output(cli(&work).args([
        "run",
        "--user",
        "4321:4322",
        "--mount",
        "source=data,target=data,size=8M",
        "--volume",
        "ref:8M:ref:ro",
        "--",
        "sh",
        "-c",
        script,
    ]));
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        "4321\n4322\n4322\n4321:4322\nref-refused\n",
        "the workload's user, its one group, its file; the read-only volume untouched"
    );

    // The volume root was changed once: root's, the workload's group, group-writable, setgid.
    // Published again for a look at its root, as a root workload sees it.
    let root = output(cli(&work).args([
        "run",
        "--volume",
        "data:8M:data",
        "--volume",
        "ref:8M:ref:ro",
        "--",
        "stat",
        "-c",
        "%u:%g %a",
        "data",
        "ref",
    ]));
    assert!(root.status.success(), "{}", text(&root.stderr));
    assert_eq!(text(&root.stdout), "0:4322 2775\n0:0 755\n");

    // Another user of the same (unshared) volume gets it for its group, and reads what was there.
    let other = output(cli(&work).args([
        "run",
        "--user",
        "5000:5001",
        "--volume",
        "data:8M:data",
        "--",
        "sh",
        "-c",
        "cat data/f && echo theirs > data/g && stat -c '%u:%g' data/g",
    ]));
    assert!(other.status.success(), "{}", text(&other.stderr));
    assert_eq!(text(&other.stdout), "mine\n5000:5001\n");

    for (user, says) in [
        (
            "no-such-user-here",
            "--user: user 'no-such-user-here' is not in the host's user database",
        ),
        ("1000:", "expected UID[:GID] or NAME[:GROUP]"),
    ] {
        let bad =
            output(cli(&work).args(["run", "--user", user, "--volume", "x:8M:x", "--", "true"]));
        assert!(!bad.status.success(), "{user}");
        assert!(
            text(&bad.stderr).contains(says),
            "{user}: {}",
            text(&bad.stderr)
        );
    }
    let listed = output(cli(&work).args(["volume", "list", "--json"]));
    let listed: serde_json::Value = serde_json::from_slice(&listed.stdout).unwrap();
    assert!(
        !listed.as_array().unwrap().iter().any(|v| v["name"] == "x"),
        "a bad user is refused before any volume is made: {listed}"
    );

    // A shared volume (`shared: {}`, Mesos' marker) is left as it is: its users would fight over it.
    let created = output(cli(&work).args(["volume", "create", "common", "8M"]));
    assert!(created.status.success(), "{}", text(&created.stderr));
    let mut res: serde_json::Value = serde_json::from_slice(&created.stdout).unwrap();
    res["disk"]["volume"] = serde_json::json!({"container_path": "common", "mode": "RW"});
    res["shared"] = serde_json::json!({});
    let file = sb.join("shared.json");
    std::fs::write(
        &file,
        serde_json::to_vec(&serde_json::json!([res])).unwrap(),
    )
    .unwrap();
    let shared = output(
        cli(&work)
            .args(["run", "--user", "4321:4322", "--resources"])
            .arg(&file)
            .args([
                "--",
                "sh",
                "-c",
                "stat -c '%u:%g %a' common; ! touch common/f 2>/dev/null",
            ]),
    );
    assert!(shared.status.success(), "{}", text(&shared.stderr));
    assert_eq!(text(&shared.stdout), "0:0 755\n");
    assert_nothing_left(&sb, &work);
}

/// Every `plugin.log` under the work dir, read together.
fn plugin_logs(work: &Path) -> String {
    let mut out = String::new();
    let mut dirs = vec![work.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = entry.path();
            let kind = entry.file_type().unwrap();
            if kind.is_dir() {
                dirs.push(path);
            } else if kind.is_file() && entry.file_name() == "plugin.log" {
                out.push_str(&std::fs::read_to_string(&path).unwrap_or_default());
            }
        }
    }
    out
}

#[test]
fn a_plugin_with_volume_mount_group_gives_the_workloads_group_its_volume() {
    require_root();
    let sb = Sandbox::new("cli-mount-group");
    let work = sb.join("work");
    const GRANTED_BY_THE_ISOLATOR: &str = "volume root made writable for the workload's group";
    let script =
        "id -u; id -g; echo mine > data/f && stat -c '%u:%g' data/f; stat -c '%u:%g %a' data";
    let out = output(cli(&work).env("RUST_LOG", "info").args([
        "run",
        "--plugin-arg=--volume-mount-group",
        "--user",
        "1234:5678",
        "--mount",
        "source=data,target=data,size=8M",
        "--",
        "sh",
        "-c",
        script,
    ]));
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "1234\n5678\n1234:5678\n0:5678 2775\n");
    // The plugin did it, at NodeStage and NodePublish with the gid; the isolator did not.
    let log = plugin_logs(&work);
    let given: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("volume root given the volume_mount_group"))
        .collect();
    assert!(
        given.len() == 2 && given.iter().all(|l| l.contains("5678")),
        "{log}"
    );
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("volume root left to the plugin")
            && !stderr.contains(GRANTED_BY_THE_ISOLATOR),
        "{stderr}"
    );

    // The same volume through a plugin without the capability (the plugin refuses a group
    // then, so this run also shows none is sent): the isolator's own rule makes it writable.
    let out = output(cli(&work).env("RUST_LOG", "info").args([
        "run",
        "--user",
        "1234:6000",
        "--volume",
        "data:8M:data",
        "--",
        "sh",
        "-c",
        "cat data/f && echo theirs > data/g && stat -c '%u:%g %a' data",
    ]));
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "mine\n0:6000 2775\n");
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains(GRANTED_BY_THE_ISOLATOR)
            && !stderr.contains("volume root left to the plugin"),
        "{stderr}"
    );
    assert_nothing_left(&sb, &work);
}

#[test]
fn a_volume_is_published_only_where_its_topology_reaches() {
    require_root();
    let sb = Sandbox::new("cli-topology");
    let work = sb.join("work");
    let zone = |z: &str| format!("--plugin-arg=--topology=topology.example.com/zone={z}");
    let made = output(cli(&work).args([
        "run",
        &zone("a"),
        "--volume",
        "v:8M:v",
        "--",
        "sh",
        "-c",
        "echo here > v/f",
    ]));
    assert!(made.status.success(), "{}", text(&made.stderr));
    let status = output(cli(&work).args(["status", "--json"]));
    let report: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(
        report["volumes"][0]["accessible_topology"],
        serde_json::json!([{"topology.example.com/zone": "a"}]),
        "{report}"
    );
    let shown = output(cli(&work).args(["status"]));
    assert!(
        text(&shown.stdout).contains("reachable from: topology.example.com/zone=a"),
        "{}",
        text(&shown.stdout)
    );

    // The same node, now in another zone: refused before any RPC touches the volume.
    let elsewhere =
        output(cli(&work).args(["run", &zone("b"), "--volume", "v:8M:v", "--", "true"]));
    assert!(!elsewhere.status.success());
    assert!(
        text(&elsewhere.stderr).contains(
            "can be reached only from topology.example.com/zone=a (its CreateVolume answer), and this node is at topology.example.com/zone=b"
        ),
        "{}",
        text(&elsewhere.stderr)
    );
    // Back in its zone, the data is there; a plugin without topology says nothing against it.
    for plugin_arg in [zone("a"), "--plugin-arg=--name=csi-test".to_string()] {
        let back =
            output(cli(&work).args(["run", &plugin_arg, "--volume", "v:8M:v", "--", "cat", "v/f"]));
        assert!(
            back.status.success(),
            "{plugin_arg}: {}",
            text(&back.stderr)
        );
        assert_eq!(text(&back.stdout), "here\n");
    }
    assert_nothing_left(&sb, &work);
}

#[test]
fn a_block_volume_by_the_long_form_is_a_device_file_the_workload_writes() {
    require_root();
    let sb = Sandbox::new("cli-block");
    let work = sb.join("work");
    let mount = "source=raw,target=disk,size=16M,type=block";
    let write = output(cli(&work).args([
        "run",
        "--mount",
        mount,
        "--",
        "sh",
        "-c",
        "test -b disk && printf block-data | dd of=disk conv=notrunc status=none && echo written",
    ]));
    assert!(write.status.success(), "{}", text(&write.stderr));
    assert_eq!(text(&write.stdout), "written\n");
    let read =
        output(cli(&work).args(["run", "--mount", mount, "--", "sh", "-c", "head -c 10 disk"]));
    assert!(read.status.success(), "{}", text(&read.stderr));
    assert_eq!(text(&read.stdout), "block-data");
    // The same name asked as a filesystem: refused, naming both.
    let other = output(cli(&work).args([
        "run",
        "--mount",
        "source=raw,target=disk,size=16M,type=mount",
        "--",
        "true",
    ]));
    assert!(!other.status.success());
    assert!(
        text(&other.stderr).contains("volume 'raw' exists with capability"),
        "{}",
        text(&other.stderr)
    );
    assert_nothing_left(&sb, &work);
}

/// `run --mount ...,propagation=rslave`: a tmpfs the host mounts under the volume's mount point
/// while the workload runs reaches it; with the default (private) it does not. The provider
/// sweeps the tmpfs at unpublish.
#[test]
fn a_host_mount_made_later_under_the_volume_reaches_an_rslave_run_only() {
    require_root();
    let sb = Sandbox::new("cli-rslave");
    let work = sb.join("work");
    for (name, propagation, tries, seen) in [
        ("slave", "rslave", 200, true),
        ("private", "private", 40, false),
    ] {
        let script = format!(
            "touch {name}/ready; i=0; while [ ! -e {name}/sub/marker ] && [ $i -lt {tries} ]; do sleep 0.05; i=$((i+1)); done; \
             cat {name}/sub/marker 2>/dev/null || echo unseen"
        );
        let mount = format!("source={name},target={name},size=8M,propagation={propagation}");
        let child = cli(&work)
            .args(["run", "--mount", &mount, "--", "sh", "-c", &script])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // The volume's host mount point, once the workload runs with its copy in place (it marks
        // the volume first): a host mount made before the copy is cloned would be in it whatever
        // the propagation (bounded wait).
        let started = Instant::now();
        let mount_point = loop {
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "{name} never published"
            );
            let status = output(cli(&work).args(["status", "--json"]));
            let report: serde_json::Value =
                serde_json::from_slice(&status.stdout).unwrap_or_default();
            let found = report["volumes"].as_array().and_then(|vols| {
                vols.iter()
                    .find(|v| {
                        v["name"] == name
                            && v["mounted"] == true
                            && v["users"].as_array().is_some_and(|u| !u.is_empty())
                    })
                    .and_then(|v| v["mount_point"].as_str().map(std::path::PathBuf::from))
            });
            if let Some(p) = found.filter(|p| p.join("ready").exists()) {
                break p;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let sub = mount_point.join("sub");
        std::fs::create_dir_all(&sub).unwrap();
        nix::mount::mount(
            Some("tmpfs"),
            &sub,
            Some("tmpfs"),
            nix::mount::MsFlags::empty(),
            None::<&str>,
        )
        .unwrap();
        std::fs::write(sub.join("marker"), "from-the-host\n").unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "{name}: {}", text(&out.stderr));
        let want = if seen { "from-the-host\n" } else { "unseen\n" };
        assert_eq!(text(&out.stdout), want, "{name}");
        let _ = nix::mount::umount2(&sub, nix::mount::MntFlags::MNT_DETACH);
    }
    assert_nothing_left(&sb, &work);
}

/// `volume create --type block`: the resource printed is a BLOCK disk, `volume publish` prints a
/// block device file (the plugin's loop device); a workload then opens, writes and reads it back;
/// release and destroy leave nothing. Options are read by `--mount`'s parser: the same name asked as a filesystem is
/// refused naming both capabilities.
#[test]
fn volume_create_type_block_is_published_as_a_device_file() {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    require_root();
    let sb = Sandbox::new("cli-create-block");
    let work = sb.join("work");
    let created = output(cli(&work).args(["volume", "create", "raw", "16M", "--type", "block"]));
    assert!(created.status.success(), "{}", text(&created.stderr));
    let res: serde_json::Value = serde_json::from_slice(&created.stdout).unwrap();
    assert_eq!(res["disk"]["source"]["type"], "BLOCK", "{res}");
    let published = output(cli(&work).args(["volume", "publish", "raw", "--container", "c1"]));
    assert!(published.status.success(), "{}", text(&published.stderr));
    let device = text(&published.stdout).trim().to_string();
    let meta = std::fs::symlink_metadata(&device).unwrap();
    assert!(meta.file_type().is_block_device(), "{device}: {meta:?}");
    // The host's copy sits under the provider's nodev mounts (not opened here): a loop device.
    assert_eq!(
        nix::sys::stat::major(meta.rdev()),
        7,
        "{device}: a loop device"
    );
    let again = output(cli(&work).args(["volume", "create", "raw", "16M", "--type", "mount"]));
    assert!(!again.status.success());
    assert!(
        text(&again.stderr).contains("volume 'raw' exists with capability"),
        "{}",
        text(&again.stderr)
    );
    let released = output(cli(&work).args(["volume", "release", "raw", "--container", "c1"]));
    assert!(released.status.success(), "{}", text(&released.stderr));
    // A workload opens, writes and reads back the volume the CLI made, as a device file.
    let used = output(cli(&work).args([
        "run",
        "--mount",
        "source=raw,target=disk,size=16M,type=block",
        "--",
        "sh",
        "-c",
        "test -b disk && printf block-data | dd of=disk conv=notrunc status=none && head -c 10 disk",
    ]));
    assert!(used.status.success(), "{}", text(&used.stderr));
    assert_eq!(text(&used.stdout), "block-data");
    let destroyed = output(cli(&work).args(["volume", "destroy", "raw"]));
    assert!(destroyed.status.success(), "{}", text(&destroyed.stderr));
    assert_nothing_left(&sb, &work);
}

/// `volume create` and `volume import` refuse a bad `--type`, `--fs-type`, `--mount-flag`,
/// `--access-mode` or `--secrets` by name with `--mount`'s words, before anything is recorded or
/// sent; an fs type or a flag the plugin does not apply is refused by the plugin, naming it, and
/// nothing is recorded either.
#[test]
fn volume_options_are_refused_by_name() {
    require_root();
    let sb = Sandbox::new("cli-create-options");
    let work = sb.join("work");
    let calls = sb.join("calls.log");
    let log_calls = format!("--plugin-arg=--log-calls={}", calls.display());
    for (flags, says) in [
        (
            &["--type", "tape"][..],
            "option '--type': unknown type 'tape' (expected mount or block)",
        ),
        (
            &["--fs-type", "ext4;rm"],
            "option '--fs-type': 'ext4;rm' is not a filesystem type name",
        ),
        (
            &["--mount-flag", "noatime", "--mount-flag", "a::b"],
            "option '--mount-flag': flag '' is empty",
        ),
        (
            &["--type", "block", "--fs-type", "ext4"],
            "option 'fs-type': 'ext4' asked for a block volume, which has no filesystem",
        ),
        (
            &["--type", "block", "--mount-flag", "noatime"],
            "option 'mount-flags': asked for a block volume",
        ),
        (
            &["--access-mode", "ANY"],
            "option '--access-mode': unknown CSI access mode 'ANY'",
        ),
        (
            &["--secrets", "etc/vault.json"],
            "option '--secrets': 'etc/vault.json' is not an absolute path",
        ),
    ] {
        for verb in [
            &["create", "v", "16M"][..],
            &["import", "v", "--volume-id", "vol-x"],
        ] {
            let out = output(
                cli(&work)
                    .args(["volume", &log_calls])
                    .args(verb)
                    .args(flags),
            );
            assert!(!out.status.success(), "{verb:?} {flags:?}");
            let err = text(&out.stderr);
            let name = format!("volume {} v: {says}", verb[0]);
            assert!(err.contains(&name), "{verb:?} {flags:?}: {err}");
        }
    }
    let sent = std::fs::read_to_string(&calls).unwrap_or_default();
    assert!(sent.contains("Probe"), "the plugin was asked: {sent}");
    assert!(
        !sent.contains("CreateVolume") && !sent.contains("ValidateVolumeCapabilities"),
        "nothing reached the plugin: {sent}"
    );
    // Well formed, but not what the bundled plugin applies: its refusal, naming the value.
    for (flags, says) in [
        (
            &["--fs-type", "nosuchfs"][..],
            "fs_type \"nosuchfs\" is not supported",
        ),
        (
            &["--mount-flag", "frobnicate"],
            "mount flag \"frobnicate\" is not supported",
        ),
    ] {
        let out = output(
            cli(&work)
                .args(["volume", "create", "v", "16M"])
                .args(flags),
        );
        assert!(!out.status.success(), "{flags:?}");
        let err = text(&out.stderr);
        assert!(
            err.contains(says) && err.contains("CreateVolume"),
            "{flags:?}: {err}"
        );
    }
    let listed = output(cli(&work).args(["volume", "list", "--json"]));
    assert!(listed.status.success(), "{}", text(&listed.stderr));
    assert_eq!(text(&listed.stdout).trim(), "[]");
    assert_nothing_left(&sb, &work);
}

/// A listing whose reader is gone (`csi-isolator volume list | head -0`) ends quietly with the
/// shell's code for SIGPIPE (141), as `ls` does, not with a panic on EPIPE; the process keeps
/// ignoring SIGPIPE itself (it talks to its plugin over sockets).
#[test]
fn a_listing_into_a_closed_pipe_ends_quietly() {
    require_root();
    let sb = Sandbox::new("cli-pipe");
    let work = sb.join("work");
    let made = output(cli(&work).args(["volume", "create", "v", "8M"]));
    assert!(made.status.success(), "{}", text(&made.stderr));
    for args in [
        &["volume", "list", "--json"][..],
        &["volume", "list"][..],
        &["status", "--json"][..],
        &["status"][..],
    ] {
        let (reader, writer) = nix::unistd::pipe().unwrap();
        drop(reader);
        let out = cli(&work)
            .args(args)
            .stdout(Stdio::from(writer))
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        assert_eq!(text(&out.stderr), "", "{args:?}");
        assert_eq!(out.status.code(), Some(141), "{args:?}: {:?}", out.status);
    }
    let gone = output(cli(&work).args(["volume", "destroy", "v"]));
    assert!(gone.status.success(), "{}", text(&gone.stderr));
    assert_nothing_left(&sb, &work);
}

/// `volume expand`: a dir-backed volume grows (no node step) and its record says so; a plugin
/// without EXPAND_VOLUME, a smaller size and a size of 0 are refused by name before any RPC, and
/// change nothing.
#[test]
fn volume_expand_grows_a_volume_and_refuses_what_cannot_be_done() {
    require_root();
    let sb = Sandbox::new("cli-expand");
    let work = sb.join("work");
    let dir = "--plugin-arg=--backing=dir";
    let made = output(cli(&work).args(["volume", dir, "create", "v", "8M"]));
    assert!(made.status.success(), "{}", text(&made.stderr));
    let grown = output(cli(&work).args(["volume", dir, "expand", "v", "16M"]));
    assert!(grown.status.success(), "{}", text(&grown.stderr));
    assert_eq!(text(&grown.stdout), "16777216 bytes\n");
    let capacity = || {
        let listed = output(cli(&work).args(["volume", dir, "list", "--json"]));
        let v: serde_json::Value = serde_json::from_slice(&listed.stdout).unwrap();
        v[0]["capacity_bytes"].as_u64().unwrap()
    };
    assert_eq!(capacity(), 16 << 20);
    for (args, says) in [
        (
            vec!["volume", dir, "expand", "v", "8M"],
            "csi-isolator: expand volume '",
        ),
        (vec!["volume", dir, "expand", "v", "8M"], "cannot shrink"),
        (vec!["volume", dir, "expand", "v", "0"], "invalid SIZE '0'"),
        (
            vec!["volume", dir, "--plugin-arg=--expansion=none", "expand", "v", "32M"],
            "the plugin cannot expand volumes (neither its controller nor its node service has EXPAND_VOLUME)",
        ),
    ] {
        let refused = output(cli(&work).args(&args));
        assert!(!refused.status.success(), "{args:?}");
        assert!(
            text(&refused.stderr).contains(says),
            "{args:?}: {}",
            text(&refused.stderr)
        );
    }
    assert_eq!(capacity(), 16 << 20);
    let gone = output(cli(&work).args(["volume", dir, "destroy", "v"]));
    assert!(gone.status.success(), "{}", text(&gone.stderr));
    assert_nothing_left(&sb, &work);
}

/// `volume modify`: ControllerModifyVolume with the parameters given, recorded in the volume's
/// record (`list --json`); the refusals (before any RPC, or the plugin's) change nothing and
/// leave nothing pending: the next modify works.
#[test]
fn volume_modify_changes_mutable_parameters_and_refuses_what_cannot_be_done() {
    require_root();
    let sb = Sandbox::new("cli-modify");
    let work = sb.join("work");
    let dir = "--plugin-arg=--backing=dir";
    let made = output(cli(&work).args(["volume", dir, "create", "v", "8M"]));
    assert!(made.status.success(), "{}", text(&made.stderr));
    let changed = output(cli(&work).args(["volume", dir, "modify", "v", "tier=fast", "iops=500"]));
    assert!(changed.status.success(), "{}", text(&changed.stderr));
    assert_eq!(text(&changed.stdout), "iops=500\ntier=fast\n");
    let again = output(cli(&work).args(["volume", dir, "modify", "v", "iops=600"]));
    assert!(again.status.success(), "{}", text(&again.stderr));
    assert_eq!(text(&again.stdout), "iops=600\ntier=fast\n");
    let recorded = || {
        let listed = output(cli(&work).args(["volume", dir, "list", "--json"]));
        let v: serde_json::Value = serde_json::from_slice(&listed.stdout).unwrap();
        v[0]["mutable_parameters"].clone()
    };
    assert_eq!(
        recorded(),
        serde_json::json!({"iops": "600", "tier": "fast"})
    );
    let status = output(cli(&work).args(["status", "--json"]));
    assert!(status.status.success(), "{}", text(&status.stderr));
    let st: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(
        st["volumes"][0]["mutable_parameters"],
        serde_json::json!({"iops": "600", "tier": "fast"}),
        "{st}"
    );
    let shown = output(cli(&work).args(["status"]));
    assert!(
        text(&shown.stdout).contains("    mutable parameters: iops=600 tier=fast\n"),
        "{}",
        text(&shown.stdout)
    );
    for (args, says) in [
        // The plugin's refusal (INVALID_ARGUMENT) leaves no intent behind.
        (
            vec!["volume", dir, "modify", "v", "tier=gold"],
            "tier 'gold' is not one of",
        ),
        (
            vec![
                "volume",
                dir,
                "modify",
                "v",
                "csi.storage.k8s.io/provisioner-secret-name=x",
            ],
            "would carry a secret",
        ),
        (vec!["volume", dir, "modify", "v", "tier"], "volume modify:"),
        (
            vec![
                "volume",
                dir,
                "--plugin-arg=--no-modify",
                "modify",
                "v",
                "tier=standard",
            ],
            "the plugin cannot modify volumes (its controller service has no MODIFY_VOLUME)",
        ),
    ] {
        let refused = output(cli(&work).args(&args));
        assert!(!refused.status.success(), "{args:?}");
        assert!(
            text(&refused.stderr).contains(says),
            "{args:?}: {}",
            text(&refused.stderr)
        );
    }
    assert_eq!(
        recorded(),
        serde_json::json!({"iops": "600", "tier": "fast"})
    );
    let after = output(cli(&work).args(["volume", dir, "modify", "v", "tier=standard"]));
    assert!(after.status.success(), "{}", text(&after.stderr));
    assert_eq!(text(&after.stdout), "iops=600\ntier=standard\n");
    let gone = output(cli(&work).args(["volume", dir, "destroy", "v"]));
    assert!(gone.status.success(), "{}", text(&gone.stderr));
    assert_nothing_left(&sb, &work);
}
