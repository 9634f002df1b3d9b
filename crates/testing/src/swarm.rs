//! Several Docker Swarm nodes on one machine (issue 13): each node a private dockerd in a
//! network namespace of its own and a mount namespace of its own ([`Dockerd::start_on_node`]),
//! the namespaces joined by a veth pair with test addresses, each node with its own
//! `csi-isolator docker-plugin` under the same driver name.
//!
//! Swarm makes bridges with addresses in dockerd's network namespace, so it never runs in the
//! host's (`../shared/ENGINES.md`). A namespace is pinned on a file in a sandbox (`unshare
//! --net=FILE`; `ip netns add` would mount `/run/netns` in the host's table, which tests
//! running alongside compare before and after). The veth pair is made inside the first node's
//! namespace and its peer moved to the second's: the host's namespace never holds it, and it
//! goes with the namespaces. Every guard here cleans up however the test ends; the test checks
//! that the host's network is as it was ([`HostNetwork`]).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use csi_isolator::mount::{MountTable, ProcMountTable};
use nix::sys::signal::Signal;

use crate::engines::{Dockerd, EngineCli, ENGINE_TIMEOUT};
use crate::{DockerPluginProcess, Sandbox};

/// Runs `program args`, which must succeed: its stdout.
pub fn run_ok(program: &str, args: &[&str]) -> String {
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
pub fn installed(program: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {program}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Panics, naming the tools, unless `ip`, `unshare` and `nsenter` are installed (the tests
/// never skip).
pub fn require_namespace_tools() {
    for tool in ["ip", "unshare", "nsenter"] {
        assert!(
            installed(tool),
            "`{tool}` is not installed (iproute2, util-linux): this test does not skip"
        );
    }
}

/// Waits (bounded by [`ENGINE_TIMEOUT`]) until `check` gives a value; its error is what it
/// saw instead, shown with `log()` if the wait fails.
pub fn wait_for<T>(
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

/// A network namespace pinned by a bind mount on a file (`unshare --net=FILE`), its loopback
/// up; when dropped, every process left in it is killed and the file unmounted and removed.
#[derive(Debug)]
pub struct NetNs {
    path: PathBuf,
    pinned: bool,
}

impl NetNs {
    /// Makes the namespace, pinned on `path` (created; in a sandbox).
    pub fn add(path: &Path) -> NetNs {
        std::fs::write(path, "").expect("create the netns file");
        let p = path.to_str().expect("UTF-8 sandbox path");
        run_ok("unshare", &[&format!("--net={p}"), "true"]);
        let ns = NetNs {
            path: path.to_path_buf(),
            pinned: true,
        };
        ns.run(&["ip", "link", "set", "lo", "up"]);
        ns
    }

    /// The file it is pinned on.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `args` in the namespace (`nsenter --net=FILE`), which must succeed: its stdout.
    pub fn run(&self, args: &[&str]) -> String {
        let net = format!("--net={}", self.path.display());
        let mut all = vec![net.as_str()];
        all.extend_from_slice(args);
        run_ok("nsenter", &all)
    }

    /// Pids of the processes in this namespace.
    pub fn processes(&self) -> Vec<u32> {
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
    pub fn delete(mut self) {
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
        // Only a failed test gets here with processes inside (a dockerd, its containerd, a
        // task's container): they are the test's.
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

/// Joins two namespaces by a veth pair, `a_name` with `a_addr` (CIDR) in `a` and `b_name` with
/// `b_addr` in `b`, both up. Made inside `a` and its peer moved to `b`, so the host's namespace
/// never holds either end; the pair goes when either namespace goes.
pub fn veth_pair(a: &NetNs, a_name: &str, a_addr: &str, b: &NetNs, b_name: &str, b_addr: &str) {
    let b_path = b.path.to_str().expect("UTF-8 sandbox path");
    a.run(&[
        "ip", "link", "add", a_name, "type", "veth", "peer", "name", b_name, "netns", b_path,
    ]);
    a.run(&["ip", "addr", "add", a_addr, "dev", a_name]);
    a.run(&["ip", "link", "set", a_name, "up"]);
    b.run(&["ip", "addr", "add", b_addr, "dev", b_name]);
    b.run(&["ip", "link", "set", b_name, "up"]);
}

/// A directory bound onto itself and made shared, so that mounts made under it in the host's
/// namespace reach the slave copies other mount namespaces took of it (the host's root is
/// private here). Unmounted (lazily, with what is below it) when dropped; [`SharedDir::unmount`]
/// checks nothing was left below it first.
#[derive(Debug)]
pub struct SharedDir {
    path: PathBuf,
    mounted: bool,
}

impl SharedDir {
    /// Makes `path` (in a sandbox) and binds it shared.
    pub fn new(path: &Path) -> SharedDir {
        std::fs::create_dir_all(path).expect("mkdir the shared dir");
        let p = path.to_str().expect("UTF-8 sandbox path");
        run_ok("mount", &["--bind", p, p]);
        let dir = SharedDir {
            path: path.to_path_buf(),
            mounted: true,
        };
        run_ok("mount", &["--make-shared", p]);
        dir
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Unmounts it after checking that nothing is mounted below it.
    pub fn unmount(mut self) {
        let below: Vec<PathBuf> = crate::mount_points_under(&self.path)
            .into_iter()
            .filter(|p| p != &self.path)
            .collect();
        assert!(
            below.is_empty(),
            "mounts left under {}: {below:?}",
            self.path.display()
        );
        self.mounted = false;
        nix::mount::umount(&self.path).expect("unmount the shared dir");
    }
}

impl Drop for SharedDir {
    fn drop(&mut self) {
        if self.mounted {
            let _ = nix::mount::umount2(&self.path, nix::mount::MntFlags::MNT_DETACH);
        }
    }
}

/// When dropped while the test is failing, removes every service and container of a test's
/// dockerd (the only ones it has): a task's container would outlive the dockerd, containerd and
/// shims the sandbox kills. Dropped before dockerd is stopped.
pub struct RemoveTasks<'a>(pub &'a Dockerd);

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

/// What a test must leave as it found it in the host's network namespace.
#[derive(Debug, PartialEq, Eq)]
pub struct HostNetwork {
    /// `NAME KIND` of each interface.
    pub links: Vec<String>,
    /// `NAME FAMILY ADDRESS` of each address.
    pub addresses: Vec<String>,
    /// `/proc/sys/net/ipv4/ip_forward`.
    pub ip_forward: String,
    /// `iptables-save` without its comments and packet counters, if installed.
    pub iptables: Option<String>,
    /// `nft list ruleset` without counters, if installed.
    pub nft: Option<String>,
}

impl HostNetwork {
    /// Reads it now.
    pub fn read() -> HostNetwork {
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

/// The host's mount points outside the temp dir (where every test's sandbox is): a test that
/// keeps its engines' mounts in their own mount namespaces finds them unchanged.
pub fn host_mounts_outside_temp() -> Vec<PathBuf> {
    let tmp = std::fs::canonicalize(std::env::temp_dir()).expect("canonicalize temp dir");
    let mut points: Vec<PathBuf> = ProcMountTable::new()
        .mounts()
        .expect("read the host's mount table")
        .into_iter()
        .map(|m| m.mount_point)
        .filter(|p| !p.starts_with(&tmp))
        .collect();
    points.sort();
    points
}

/// Whether process `pid` is in another mount namespace than this process.
pub fn in_other_mount_namespace(pid: u32) -> bool {
    use std::os::unix::fs::MetadataExt;
    let theirs = std::fs::metadata(format!("/proc/{pid}/ns/mnt"))
        .unwrap_or_else(|e| panic!("read process {pid}'s mount namespace: {e}"));
    let mine = std::fs::metadata("/proc/self/ns/mnt").expect("read this mount namespace");
    (theirs.dev(), theirs.ino()) != (mine.dev(), mine.ino())
}

/// One node of a test swarm, in its own sandbox: its network namespace (`netns`), its shared
/// dir (`shared`, the docker-plugin's work dir below it), its dir of plugin sockets (bound
/// over `/run/docker/plugins` in its dockerd's mount namespace), its dockerd. The test starts
/// the node's docker-plugin ([`SwarmNode::start_plugin`]) before its dockerd
/// ([`SwarmNode::start_dockerd`]).
#[derive(Debug)]
pub struct SwarmNode {
    /// The node's name in messages.
    pub name: String,
    /// Its address on the veth pair (no prefix).
    pub addr: String,
    /// Its network namespace.
    pub netns: NetNs,
    /// Mounts under it reach the node's dockerd.
    pub shared: SharedDir,
    /// Where its plugin sockets are on the host.
    pub plugins: PathBuf,
    /// The sandbox of its files; declared last, so dropped after what is in it.
    pub sb: Sandbox,
}

impl SwarmNode {
    /// A node `name` (a short label) with address `addr`, its namespace made.
    pub fn new(name: &str, addr: &str) -> SwarmNode {
        let sb = Sandbox::new(&format!("sw-{name}"));
        let netns = NetNs::add(&sb.join("netns"));
        let shared = SharedDir::new(&sb.join("s"));
        let plugins = sb.mkdir("plugins");
        SwarmNode {
            name: name.to_string(),
            addr: addr.to_string(),
            netns,
            shared,
            plugins,
            sb,
        }
    }

    /// The socket a plugin named `driver` of this node listens on (on the host).
    pub fn plugin_socket(&self, driver: &str) -> PathBuf {
        self.plugins.join(format!("{driver}.sock"))
    }

    /// Starts `cli docker-plugin` for `driver` on this node: its work dir under the shared dir,
    /// its socket in the node's plugin dir, `args` added.
    pub fn start_plugin(&self, cli: &str, driver: &str, args: &[&str]) -> DockerPluginProcess {
        DockerPluginProcess::start(
            &self.sb,
            cli,
            &self.shared.path().join("w"),
            &self.plugin_socket(driver),
            args,
        )
    }

    /// Starts the node's dockerd ([`Dockerd::start_on_node`]) and checks it runs in the
    /// node's network namespace.
    pub fn start_dockerd(&self) -> Dockerd {
        let etc = self.sb.mkdir("etc-docker");
        let e = Dockerd::start_on_node(
            &self.sb,
            self.netns.path(),
            &self.plugins,
            &etc,
            self.shared.path(),
        );
        let in_netns = self.netns.processes();
        assert!(
            in_netns.contains(&e.pid()),
            "node {}: dockerd {} is not in netns {}: {in_netns:?}",
            self.name,
            e.pid(),
            self.netns.path().display()
        );
        assert!(
            in_other_mount_namespace(e.pid()),
            "node {}: dockerd {} is in the host's mount namespace",
            self.name,
            e.pid()
        );
        e
    }

    /// Imports the busybox rootfs tar `tar` into `e` as `image` (`ENV PATH=/bin`), so every node
    /// has the service's image under one name (no registry is reachable).
    pub fn import_image(e: &Dockerd, tar: &Path, image: &str) {
        e.ok(&[
            "import",
            "--change",
            "ENV PATH=/bin",
            tar.to_str().expect("UTF-8 sandbox path"),
            image,
        ]);
    }
}
