//! `csi-isolator docker-plugin` serving a Docker Swarm service (issue 12): a single-node swarm
//! whose task mounts a volume of the plugin's driver through `--mount
//! type=volume,volume-driver=D`, the way every node of a cluster runs it (Docker 20.10 has no
//! Swarm cluster volumes: a legacy socket plugin serves the tasks of its own node).
//!
//! Swarm makes bridges (`docker_gwbridge`, the ingress network's) with addresses in dockerd's
//! network namespace, so the test never runs it in the host's (`../shared/ENGINES.md`): it makes
//! a network namespace of its own, pinned on a file in its sandbox (`unshare --net=FILE`; `ip
//! netns add` would add mounts at `/run/netns` that other tests see in the host's mount table),
//! starts a private dockerd in it with `nsenter --net=FILE` ([`Dockerd::start_in_netns`]) and
//! reaches it over its Unix socket, as it reaches the plugin's socket in `/run/docker/plugins`
//! (sockets are files: the namespace does not hide them). After the swarm is left and dockerd
//! stopped, the namespace is deleted however the test ends ([`NetNs`] is a drop guard; a failing
//! test also removes its services and containers first, [`RemoveTasks`]), and the test checks
//! that nothing is left and that the host's network is as it was: the same interfaces and
//! addresses, the same `ip_forward`, the same firewall rules (`iptables-save`, `nft list
//! ruleset`, when installed).
//!
//! Runs under the machine-wide engine-test lock (`HostPaths`) and in the `docker-engine` test
//! group. Needs root, `dockerd`, `ip` (iproute2), `unshare` and `nsenter`: without them it fails,
//! it never skips.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use csi_isolator_testing::engines::{
    require_engine, unique, Dockerd, EngineCli, HostPaths, DOCKER_HOST_PATHS, DOCKER_PLUGINS_DIR,
    ENGINE_TIMEOUT,
};
use csi_isolator_testing::{
    mount_points_under, processes_mentioning, recorded_volumes, require_root, DockerPluginProcess,
    Sandbox,
};
use nix::sys::signal::Signal;

const BIN: &str = env!("CARGO_BIN_EXE_csi-isolator");

/// Runs `program args`, which must succeed: its stdout.
fn run_ok(program: &str, args: &[&str]) -> String {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("run {program} {args:?}: {e}"));
    assert!(
        out.status.success(),
        "{program} {args:?}: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Whether `program` is on the PATH.
fn installed(program: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {program}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// A network namespace of the test's, pinned by a bind mount on a file in the sandbox (`unshare
/// --net=FILE`), its loopback up; when dropped, every process left in it is killed and the file
/// unmounted and removed. Not `ip netns add`: that mounts `/run/netns` and `/run/netns/NAME` in
/// the host's mount table, which tests running alongside compare before and after.
struct NetNs {
    path: PathBuf,
    pinned: bool,
}

impl NetNs {
    fn add(path: &Path) -> NetNs {
        std::fs::write(path, "").expect("create the netns file");
        let p = path.to_str().expect("UTF-8 sandbox path");
        run_ok("unshare", &[&format!("--net={p}"), "true"]);
        let ns = NetNs {
            path: path.to_path_buf(),
            pinned: true,
        };
        run_ok(
            "nsenter",
            &[&format!("--net={p}"), "ip", "link", "set", "lo", "up"],
        );
        ns
    }

    /// Pids of the processes in this namespace.
    fn processes(&self) -> Vec<u32> {
        use std::os::unix::fs::MetadataExt;
        let Ok(ns) = std::fs::metadata(&self.path) else {
            return Vec::new();
        };
        let mut pids = Vec::new();
        for entry in std::fs::read_dir("/proc").expect("read /proc").flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<u32>().ok())
            else {
                continue;
            };
            let Ok(net) = std::fs::metadata(entry.path().join("ns/net")) else {
                continue;
            };
            if net.dev() == ns.dev() && net.ino() == ns.ino() {
                pids.push(pid);
            }
        }
        pids
    }

    /// Deletes the namespace after checking that no process is left in it.
    fn delete(mut self) {
        let left = self.processes();
        assert!(
            left.is_empty(),
            "processes left in netns {}: {left:?}",
            self.path.display()
        );
        self.remove();
        assert!(
            !self.path.exists(),
            "netns file {} is left",
            self.path.display()
        );
    }

    fn remove(&mut self) {
        if !self.pinned {
            return;
        }
        self.pinned = false;
        // Only a failed test gets here with processes inside (dockerd and its containerd, when
        // the test did not stop them): they are the test's.
        for pid in self.processes() {
            eprintln!(
                "netns {}: killing process {pid} left in it",
                self.path.display()
            );
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), Signal::SIGKILL);
        }
        match nix::mount::umount2(&self.path, nix::mount::MntFlags::MNT_DETACH) {
            Ok(()) => eprintln!("deleted netns {}", self.path.display()),
            Err(e) => eprintln!("umount netns {}: {e}", self.path.display()),
        }
        if let Err(e) = std::fs::remove_file(&self.path) {
            eprintln!("remove {}: {e}", self.path.display());
        }
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        self.remove();
    }
}

/// When dropped while the test is failing, removes every service and container of the test's
/// dockerd (the only ones it has): a task's container would outlive the dockerd, containerd and
/// shims the sandbox kills, its processes in namespaces and a cgroup of their own. Dropped
/// before dockerd is stopped.
struct RemoveTasks<'a>(&'a Dockerd);

impl Drop for RemoveTasks<'_> {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        let ids = |args: &[&str]| -> Vec<String> {
            let out = self.0.docker(args);
            String::from_utf8_lossy(&out.stdout)
                .split_whitespace()
                .map(str::to_string)
                .collect()
        };
        for service in ids(&["service", "ls", "-q"]) {
            let out = self.0.docker(&["service", "rm", &service]);
            eprintln!("docker service rm {service}: {}", out.status);
        }
        for container in ids(&["ps", "-aq"]) {
            let out = self.0.docker(&["rm", "-f", &container]);
            eprintln!("docker rm -f {container}: {}", out.status);
        }
    }
}

/// What the test must leave as it found it in the host's network namespace.
#[derive(Debug, PartialEq, Eq)]
struct HostNetwork {
    /// `NAME KIND` of each interface.
    links: Vec<String>,
    /// `NAME FAMILY ADDRESS` of each address.
    addresses: Vec<String>,
    ip_forward: String,
    /// `iptables-save` without its comments and packet counters, if installed.
    iptables: Option<String>,
    /// `nft list ruleset` without counters, if installed.
    nft: Option<String>,
}

impl HostNetwork {
    fn read() -> HostNetwork {
        let links = run_ok("ip", &["-o", "-d", "link", "show"])
            .lines()
            .map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                // `N: NAME: <FLAGS> … link/TYPE …`: the name and the link type.
                let name = f.get(1).copied().unwrap_or("").trim_end_matches(':');
                let kind = f.iter().find(|w| w.starts_with("link/")).unwrap_or(&"");
                format!("{name} {kind}")
            })
            .collect();
        let addresses = run_ok("ip", &["-o", "addr", "show"])
            .lines()
            .map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                f.get(1..4).unwrap_or_default().join(" ")
            })
            .collect();
        let ip_forward = std::fs::read_to_string("/proc/sys/net/ipv4/ip_forward")
            .expect("read ip_forward")
            .trim()
            .to_string();
        let iptables = installed("iptables-save").then(|| {
            run_ok("iptables-save", &[])
                .lines()
                .filter(|l| !l.starts_with('#'))
                .map(|l| match l.find(" [") {
                    // `:CHAIN POLICY [packets:bytes]`
                    Some(i) if l.starts_with(':') => &l[..i],
                    _ => l,
                })
                .collect::<Vec<_>>()
                .join("\n")
        });
        let nft = installed("nft").then(|| {
            run_ok("nft", &["list", "ruleset"])
                .lines()
                .map(|l| match l.find("counter packets") {
                    Some(i) => &l[..i],
                    None => l,
                })
                .collect::<Vec<_>>()
                .join("\n")
        });
        HostNetwork {
            links,
            addresses,
            ip_forward,
            iptables,
            nft,
        }
    }
}

/// Waits (bounded by [`ENGINE_TIMEOUT`]) until `check` gives a value; its error is what it
/// saw instead, shown if the wait fails.
fn wait_for<T>(
    what: &str,
    mut check: impl FnMut() -> Result<T, String>,
    log: impl Fn() -> String,
) -> T {
    let started = Instant::now();
    loop {
        let seen = match check() {
            Ok(value) => {
                eprintln!("{what}: {:?}", started.elapsed());
                return value;
            }
            Err(seen) => seen,
        };
        assert!(
            started.elapsed() < ENGINE_TIMEOUT,
            "{what}: not within {ENGINE_TIMEOUT:?}; last seen: {seen}\n{}",
            log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn a_swarm_service_task_writes_into_a_volume_of_the_driver_and_the_host_network_is_untouched() {
    require_root();
    require_engine("dockerd", "docker.io");
    for tool in ["ip", "unshare", "nsenter"] {
        assert!(
            installed(tool),
            "`{tool}` is not installed (iproute2, util-linux): this test does not skip"
        );
    }
    let id = unique();
    let driver = format!("csi-isolator-test-{id}");
    let mut host = HostPaths::claim(DOCKER_HOST_PATHS);
    let network_before = HostNetwork::read();
    let socket = Path::new(DOCKER_PLUGINS_DIR).join(format!("{driver}.sock"));
    host.remove_at_end(&socket);
    let sb = Sandbox::new("swarm");
    let netns = NetNs::add(&sb.join("netns"));
    let plugin = DockerPluginProcess::start(&sb, BIN, &sb.join("work"), &socket, &[]);
    let e = Dockerd::start_in_netns(&sb, &netns.path);
    let in_netns = netns.processes();
    assert!(
        in_netns.contains(&e.pid()),
        "dockerd {} is not in netns {}: {in_netns:?}",
        e.pid(),
        netns.path.display()
    );
    let reap = RemoveTasks(&e);
    let image = e.import_busybox(&sb);
    let logs = || format!("dockerd:\n{}\ndocker-plugin:\n{}", e.log(), plugin.log());

    // Swarm places a task only on a node whose description lists its volume driver, and dockerd
    // lists a socket plugin only once something made it look in /run/docker/plugins (moby#32380:
    // the task stays Pending with "missing plugin"). `volume ls` asks every plugin there.
    e.ok(&["volume", "ls"]);
    let drivers = e.ok(&["info", "--format", "{{json .Plugins.Volume}}"]);
    assert!(drivers.contains(&format!("\"{driver}\"")), "{drivers}");
    e.ok(&[
        "swarm",
        "init",
        "--advertise-addr",
        "127.0.0.1",
        "--listen-addr",
        "127.0.0.1:2377",
    ]);
    assert_eq!(
        e.ok(&["info", "--format", "{{.Swarm.LocalNodeState}}"]),
        "active"
    );
    let described = e.ok(&[
        "node",
        "inspect",
        "self",
        "--format",
        "{{json .Description.Engine.Plugins}}",
    ]);
    assert!(
        described.contains(&format!("\"Type\":\"Volume\",\"Name\":\"{driver}\"")),
        "the node does not offer the driver: {described}"
    );

    let service = format!("csi-swarm-{id}");
    let volume = "swarmvol";
    e.ok(&[
        "service",
        "create",
        "--detach",
        "--name",
        &service,
        "--no-resolve-image",
        "--restart-condition",
        "none",
        "--stop-grace-period",
        "1s",
        "--mount",
        &format!(
            "type=volume,source={volume},target=/data,volume-driver={driver},volume-opt=size=16M"
        ),
        &image,
        "sh",
        "-c",
        "echo from-swarm > /data/f; sleep 3600",
    ]);
    wait_for(
        "the task runs",
        || {
            let states = e.ok(&[
                "service",
                "ps",
                "--no-trunc",
                "--format",
                "{{.CurrentState}}|{{.Error}}",
                &service,
            ]);
            let failed = states
                .lines()
                .find(|l| l.starts_with("Failed") || l.starts_with("Rejected"));
            assert!(failed.is_none(), "the task failed: {states}\n{}", logs());
            match states.lines().any(|l| l.starts_with("Running")) {
                true => Ok(()),
                false => Err(states),
            }
        },
        logs,
    );

    // Docker made the volume through the plugin (its driver; the plugin's record, published for
    // one Mount ID, 16 MiB).
    assert_eq!(
        e.ok(&[
            "volume",
            "inspect",
            "--format",
            "{{.Driver}} {{.Scope}}",
            volume
        ]),
        format!("{driver} local")
    );
    let status = e.volume_status(volume);
    assert_eq!(status["capacity_bytes"], 16 << 20, "{status}");
    assert_eq!(
        status["users"].as_array().map(Vec::len),
        Some(1),
        "{status}"
    );
    assert_eq!(status["state"], "PUBLISHED", "{status}");

    // The task wrote into the plugin's mount, and a plain container reads it back.
    let mountpoint = e.ok(&["volume", "inspect", "--format", "{{.Mountpoint}}", volume]);
    assert!(
        Path::new(&mountpoint).starts_with(&plugin.work),
        "mount point {mountpoint} is not under the plugin's work dir"
    );
    let written = wait_for(
        "the task writes",
        || match std::fs::read_to_string(Path::new(&mountpoint).join("f")) {
            Ok(s) if !s.is_empty() => Ok(s),
            Ok(_) => Err("an empty file".to_string()),
            Err(e) => Err(e.to_string()),
        },
        logs,
    );
    assert_eq!(written, "from-swarm\n");
    assert_eq!(
        e.ok(&[
            "run",
            "--rm",
            "--network",
            "none",
            "-v",
            &format!("{volume}:/data"),
            &image,
            "cat",
            "/data/f",
        ]),
        "from-swarm"
    );

    // Removing the service stops and removes its task's container: Docker sends its Unmount and
    // the last use unpublishes the volume.
    e.ok(&["service", "rm", &service]);
    let label = format!("label=com.docker.swarm.service.name={service}");
    wait_for(
        "the task's container goes",
        || match e.ok(&["ps", "-a", "--filter", &label]) {
            ps if ps.lines().count() <= 1 => Ok(()),
            ps => Err(ps),
        },
        logs,
    );
    wait_for(
        "the volume is unpublished",
        || match mount_points_under(&plugin.work) {
            mounts if mounts.is_empty() => Ok(()),
            mounts => Err(format!("{mounts:?}")),
        },
        logs,
    );
    e.ok(&["volume", "rm", volume]);
    assert_eq!(
        e.ok(&[
            "volume",
            "ls",
            "-q",
            "--filter",
            &format!("driver={driver}")
        ]),
        ""
    );
    e.ok(&["swarm", "leave", "--force"]);
    assert_eq!(
        e.ok(&["info", "--format", "{{.Swarm.LocalNodeState}}"]),
        "inactive"
    );
    e.ok(&["rmi", &image]);
    drop(reap);
    e.stop(&sb);

    let work = plugin.work.clone();
    let log = plugin.log();
    let status = plugin.stop(&sb, Signal::SIGTERM);
    assert!(status.success(), "docker-plugin: {status}\n{log}");
    // DeleteVolume ran: the work dir records no volume any more.
    assert_eq!(recorded_volumes(BIN, &work), Vec::<String>::new(), "{log}");

    netns.delete();
    sb.assert_no_mounts_under();
    sb.assert_no_loop_devices();
    let left = processes_mentioning(sb.path());
    assert!(left.is_empty(), "processes left: {left:?}");
    drop(sb);
    host.assert_restored();
    assert_eq!(
        HostNetwork::read(),
        network_before,
        "the host's network namespace changed"
    );
}
