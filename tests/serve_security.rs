//! `csi-isolator serve` against the attacks of issue 18 (findings 7 and 8),
//! as root, with the built binary: a local user on the service socket, an
//! `Isolate` with a pid that is not the container's, a flood of idle
//! connections to `/metrics`, metrics on a non-loopback address. Steps of
//! another local user run as a real unprivileged uid in a forked child
//! (`csi_isolator_testing::unprivileged`). Every test ends with no mount
//! and no process left.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use csi_isolator::csi::transport::connect_unix;
use csi_isolator::launcher::{self, LaunchSpec, Launched};
use csi_isolator::service::proto::isolator_client::IsolatorClient;
use csi_isolator::service::proto::{
    CleanupRequest, ContainerConfig, CreateVolumeRequest, IsolateRequest, PrepareRequest,
    StatusRequest,
};
use csi_isolator_testing::unprivileged::{as_nobody, run_as, Outcome, NOBODY_UID, NOGROUP_GID};
use csi_isolator_testing::{
    busybox_rootfs, isolator_command, processes_mentioning, require_root, wait_for_serve_ready,
    Sandbox,
};
use nix::errno::Errno;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::transport::Channel;
use tonic::Code;

const BIN: &str = env!("CARGO_BIN_EXE_csi-isolator");
const TIMEOUT: Duration = Duration::from_secs(30);

/// The HTTP/2 client preface and an empty SETTINGS frame: a gRPC server
/// answers with its own SETTINGS frame.
const H2_HELLO: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00";

/// A running `csi-isolator serve` whose stderr is collected; killed if
/// still running when dropped.
struct Serve {
    child: Child,
    socket: PathBuf,
    metrics: Option<SocketAddr>,
    stderr: Arc<Mutex<String>>,
}

impl Serve {
    /// Starts serve on `<sb>/work` with `args` after `serve`, its soft
    /// descriptor limit lowered to `nofile` if given, and waits for `ready`.
    fn start(sb: &Sandbox, args: &[&str], nofile: Option<u64>) -> Serve {
        let socket = sb.join("isolator.sock");
        let mut cmd = Command::new(BIN);
        cmd.env("CSI_ISOLATOR_SOCKET_DIR", sb.join("s"))
            .env("RUST_LOG", "warn")
            .env("NO_COLOR", "1")
            .arg("--work-dir")
            .arg(sb.join("work"))
            .arg("serve")
            .arg("--socket")
            .arg(&socket)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(n) = nofile {
            // SAFETY: between fork and exec the closure only calls getrlimit/setrlimit, which are
            // async-signal-safe system calls on a stack variable.
            unsafe {
                cmd.pre_exec(move || {
                    let mut lim = libc::rlimit {
                        rlim_cur: 0,
                        rlim_max: 0,
                    };
                    if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    lim.rlim_cur = n.min(lim.rlim_max);
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                })
            };
        }
        let mut child = sb.spawn(&mut cmd).expect("spawn csi-isolator serve");
        let stderr = Arc::new(Mutex::new(String::new()));
        let (err_pipe, collected) = (child.stderr.take().unwrap(), stderr.clone());
        std::thread::spawn(move || {
            for line in BufReader::new(err_pipe).lines() {
                let Ok(line) = line else { break };
                let mut all = collected.lock().unwrap();
                all.push_str(&line);
                all.push('\n');
            }
        });
        let lines = wait_for_serve_ready(&mut child, TIMEOUT);
        let metrics = lines.iter().find_map(|l| {
            l.strip_prefix("csi-isolator serve: metrics on http://")
                .and_then(|rest| rest.strip_suffix("/metrics"))
                .map(|addr| addr.parse().expect("metrics address"))
        });
        Serve {
            child,
            socket,
            metrics,
            stderr,
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    async fn client(&self) -> IsolatorClient<Channel> {
        IsolatorClient::new(
            connect_unix(&self.socket)
                .await
                .expect("connect to the service socket"),
        )
    }

    /// SIGTERM, waits for a clean exit, and checks nothing is left.
    fn stop(mut self, sb: &Sandbox) {
        kill(Pid::from_raw(self.pid() as i32), Signal::SIGTERM).unwrap();
        let deadline = Instant::now() + TIMEOUT;
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            assert!(Instant::now() < deadline, "serve did not exit");
            std::thread::sleep(Duration::from_millis(20));
        };
        sb.untrack(self.child.id());
        assert!(
            status.success(),
            "serve exited with {status:?}: {}",
            self.stderr()
        );
        assert_eq!(
            processes_mentioning(sb.path()),
            Vec::<u32>::new(),
            "processes left"
        );
        sb.assert_no_mounts_under();
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn errno_of(e: &std::io::Error) -> Errno {
    Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO))
}

/// A step for another user: connects to `socket` and greets it in HTTP/2.
/// `Ok(1)`: the server answered (it took the connection); `Ok(0)`: the
/// connection was closed without a word; `Ok(2)`: silence for 5 s.
fn greet(socket: &Path) -> Result<u8, Errno> {
    let mut s = std::os::unix::net::UnixStream::connect(socket).map_err(|e| errno_of(&e))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(|e| errno_of(&e))?;
    // A write to a connection already closed fails (EPIPE, SIGPIPE is ignored); the read says.
    let _ = s.write_all(H2_HELLO);
    let mut buf = [0u8; 64];
    match s.read(&mut buf) {
        Ok(0) => Ok(0),
        Ok(_) => Ok(1),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => Ok(0),
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(2),
        Err(e) => Err(errno_of(&e)),
    }
}

async fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<String> {
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n").as_bytes())
        .await?;
    let mut out = String::new();
    s.read_to_string(&mut out).await?;
    Ok(out)
}

/// The value of one exact series in a scrape.
fn sample(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no series {series} in\n{text}"))
        .parse()
        .unwrap()
}

const REFUSED_PEER: &str =
    "csi_isolator_connections_refused_total{listener=\"grpc\",reason=\"peer\"}";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_refuses_a_connection_from_another_user_by_its_credentials() {
    require_root();
    let sb = Sandbox::new("serve-peer");
    let serve = Serve::start(&sb, &["--metrics", "127.0.0.1:0"], None);
    // Open the socket file to everyone: what refuses now is the credential check.
    std::fs::set_permissions(&serve.socket, std::fs::Permissions::from_mode(0o666)).unwrap();

    assert_eq!(
        as_nobody(|| greet(&serve.socket)),
        Outcome::Ok(0),
        "a connection from nobody must be closed without an answer"
    );
    // A flood of refusals is counted in full but logged a bounded number of times.
    let flood = 30;
    assert_eq!(
        as_nobody(|| {
            for _ in 0..flood {
                if greet(&serve.socket)? != 0 {
                    return Ok(1);
                }
            }
            Ok(0)
        }),
        Outcome::Ok(0)
    );
    let body = http_get(serve.metrics.unwrap(), "/metrics").await.unwrap();
    // The body may be up to a second old: wait it out once if needed.
    let body = if sample(&body, REFUSED_PEER) < f64::from(flood + 1) {
        tokio::time::sleep(Duration::from_millis(1100)).await;
        http_get(serve.metrics.unwrap(), "/metrics").await.unwrap()
    } else {
        body
    };
    assert_eq!(sample(&body, REFUSED_PEER), f64::from(flood + 1));
    let err = serve.stderr();
    let warnings = err
        .matches("connection refused: the peer is neither root")
        .count();
    assert!((1..=10).contains(&warnings), "{warnings} warnings:\n{err}");
    let first = err
        .lines()
        .find(|l| l.contains("the peer is neither root"))
        .unwrap();
    for field in [
        format!("uid={NOBODY_UID}"),
        format!("gid={NOGROUP_GID}"),
        "pid=".into(),
    ] {
        assert!(first.contains(&field), "{field} missing from {first}");
    }

    // Root is still served.
    let mut c = serve.client().await;
    c.status(StatusRequest {}).await.expect("Status as root");
    drop(c);
    serve.stop(&sb);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_admits_the_allowed_group_and_no_one_else() {
    require_root();
    let sb = Sandbox::new("serve-group");
    let gid = 45_321;
    let serve = Serve::start(&sb, &["--allow-group", &gid.to_string()], None);
    let meta = std::fs::symlink_metadata(&serve.socket).unwrap();
    assert_eq!(
        (meta.permissions().mode() & 0o777, meta.uid(), meta.gid()),
        (0o660, 0, gid),
        "the socket is the group's, and no one else's"
    );
    // A member of the group (as its gid) is served, through the file mode and the check.
    assert_eq!(
        run_as(NOBODY_UID, gid, || greet(&serve.socket)),
        Outcome::Ok(1)
    );
    // Anyone else is refused by the file mode...
    assert_eq!(
        as_nobody(|| greet(&serve.socket)),
        Outcome::Failed(Errno::EACCES)
    );
    // ...and by the credential check where the file mode would let them in.
    std::fs::set_permissions(&serve.socket, std::fs::Permissions::from_mode(0o666)).unwrap();
    assert_eq!(as_nobody(|| greet(&serve.socket)), Outcome::Ok(0));
    assert_eq!(
        run_as(NOBODY_UID, gid, || greet(&serve.socket)),
        Outcome::Ok(1)
    );
    serve.stop(&sb);
}

fn launch_sleep(sb: &Sandbox, sandbox: &Path, rootfs: Option<&Path>) -> Launched {
    let spec = LaunchSpec {
        argv: vec!["sleep".into(), "60".into()],
        env: vec![("PATH".into(), "/bin:/usr/bin".into())],
        sandbox: sandbox.to_path_buf(),
        rootfs: rootfs.map(Path::to_path_buf),
        ..Default::default()
    };
    let launched = launcher::launch(&csi_isolator::mount::LinuxSyscall::new(), &spec)
        .unwrap_or_else(|e| panic!("launch: {e}"));
    sb.track(launched.pid());
    launched
}

async fn stop_launched(sb: &Sandbox, mut l: Launched) {
    l.kill(Signal::SIGKILL).unwrap();
    tokio::time::timeout(TIMEOUT, l.wait_async())
        .await
        .expect("the process exits")
        .unwrap();
    sb.untrack(l.pid());
}

async fn isolate(c: &mut IsolatorClient<Channel>, id: &str, pid: u32) -> Result<(), tonic::Status> {
    c.isolate(IsolateRequest {
        container_id: id.into(),
        pid,
    })
    .await
    .map(|_| ())
}

fn expect_refused(result: Result<(), tonic::Status>, says: &[&str]) {
    let s = result.expect_err("Isolate must refuse a pid that is not the container's");
    assert_eq!(s.code(), Code::FailedPrecondition, "{s:?}");
    for part in says {
        assert!(
            s.message().contains(part),
            "{part:?} not in {:?}",
            s.message()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn isolate_refuses_a_pid_that_is_not_the_container() {
    require_root();
    let sb = Sandbox::new("serve-isolate");
    let serve = Serve::start(&sb, &[], None);
    let mut c = serve.client().await;
    let prepare = |id: &str, sandbox: &Path, rootfs: Option<&Path>| PrepareRequest {
        container_id: id.into(),
        config: Some(ContainerConfig {
            resources_json: "[]".into(),
            sandbox: sandbox.to_string_lossy().into(),
            rootfs: rootfs
                .map(|r| r.to_string_lossy().into())
                .unwrap_or_default(),
            ..Default::default()
        }),
    };

    // Without a rootfs: any pid in serve's own mount namespace is refused.
    let plain = sb.mkdir("sandboxes/plain");
    c.prepare(prepare("plain", &plain, None)).await.unwrap();
    let me = std::process::id();
    expect_refused(
        isolate(&mut c, "plain", me).await,
        &["'plain'", &format!("pid {me}"), "own mount namespace"],
    );
    let mut host_sleeper = sb
        .spawn(Command::new("sleep").arg("60"))
        .expect("spawn sleep");
    let host_pid = host_sleeper.id();
    expect_refused(
        isolate(&mut c, "plain", host_pid).await,
        &[&format!("pid {host_pid}"), "own mount namespace"],
    );
    let pid_max: u32 = std::fs::read_to_string("/proc/sys/kernel/pid_max")
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    expect_refused(
        isolate(&mut c, "plain", pid_max).await,
        &[&format!("pid {pid_max}"), "no such process"],
    );

    // With a rootfs: the process's root must be that rootfs.
    let rootfs = busybox_rootfs(&sb, "images/mine");
    let other_rootfs = busybox_rootfs(&sb, "images/other");
    let boxed = sb.mkdir("sandboxes/boxed");
    c.prepare(prepare("boxed", &boxed, Some(&rootfs)))
        .await
        .unwrap();
    let (sbr, boxed_ref, other_ref) = (&sb, boxed.clone(), other_rootfs.clone());
    let elsewhere = tokio::task::block_in_place(|| launch_sleep(sbr, &boxed_ref, Some(&other_ref)));
    expect_refused(
        isolate(&mut c, "boxed", elsewhere.pid()).await,
        &["'boxed'", "is not the container's rootfs"],
    );
    // A process of another mount namespace whose root is the host's.
    let (sbr, plain_ref) = (&sb, plain.clone());
    let genuine_plain = tokio::task::block_in_place(|| launch_sleep(sbr, &plain_ref, None));
    expect_refused(
        isolate(&mut c, "boxed", genuine_plain.pid()).await,
        &["is not the container's rootfs"],
    );
    expect_refused(isolate(&mut c, "boxed", me).await, &["own mount namespace"]);

    // The genuine processes are accepted.
    isolate(&mut c, "plain", genuine_plain.pid())
        .await
        .expect("the container's own process (no rootfs)");
    let (sbr, boxed_ref, rootfs_ref) = (&sb, boxed.clone(), rootfs.clone());
    let genuine_boxed =
        tokio::task::block_in_place(|| launch_sleep(sbr, &boxed_ref, Some(&rootfs_ref)));
    isolate(&mut c, "boxed", genuine_boxed.pid())
        .await
        .expect("the container's own process (in its rootfs)");
    let st = c.status(StatusRequest {}).await.unwrap().into_inner();
    let mut pids: Vec<(String, u32)> = st
        .containers
        .iter()
        .map(|k| (k.container_id.clone(), k.pid))
        .collect();
    pids.sort();
    assert_eq!(
        pids,
        vec![
            ("boxed".to_string(), genuine_boxed.pid()),
            ("plain".to_string(), genuine_plain.pid())
        ],
        "only the accepted pids are recorded"
    );

    for id in ["plain", "boxed"] {
        c.cleanup(CleanupRequest {
            container_id: id.into(),
        })
        .await
        .unwrap();
    }
    drop(c);
    for l in [elsewhere, genuine_plain, genuine_boxed] {
        stop_launched(&sb, l).await;
    }
    host_sleeper.kill().unwrap();
    host_sleeper.wait().unwrap();
    sb.untrack(host_pid);
    serve.stop(&sb);
}

fn fd_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}

/// Raises the calling process's soft descriptor limit to its hard limit.
fn raise_nofile() -> Result<(), Errno> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into the live stack variable.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(Errno::last());
    }
    lim.rlim_cur = lim.rlim_max;
    // SAFETY: setrlimit reads one rlimit from the live stack variable.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
        return Err(Errno::last());
    }
    Ok(())
}

/// Creates its file when dropped: the signal for a step of another user to let go.
struct Release(PathBuf);

impl Drop for Release {
    fn drop(&mut self) {
        let _ = std::fs::write(&self.0, b"");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_metrics_connections_from_another_user_leave_serve_answering() {
    require_root();
    let sb = Sandbox::new("serve-flood");
    // The usual default soft limit: what the flood of the issue exhausted.
    let serve = Serve::start(&sb, &["--metrics", "127.0.0.1:0"], Some(1024));
    let addr = serve.metrics.unwrap();
    let before = fd_count(serve.pid());

    const FLOOD: usize = 2_000;
    let (ready_r, ready_w): (OwnedFd, OwnedFd) = nix::unistd::pipe().unwrap();
    let release = sb.join("release");
    let release_in_child = release.clone();
    // Lets the flooder go however this test ends, so it never holds its connections past it.
    let _release_on_exit = Release(release.clone());
    let mut conns: Vec<std::net::TcpStream> = Vec::with_capacity(FLOOD);
    let flooder = std::thread::spawn(move || {
        as_nobody(move || {
            let started = Instant::now();
            raise_nofile()?;
            // A connect may time out while the listen backlog is full: try again, for 8 s at most.
            while conns.len() < FLOOD && started.elapsed() < Duration::from_secs(8) {
                if let Ok(s) = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
                    conns.push(s);
                }
            }
            let opened = conns.len();
            let _ = nix::unistd::write(ready_w.as_fd(), b"r");
            // Hold every connection until the test is done (within the step's time limit).
            while !release_in_child.exists() && started.elapsed() < Duration::from_secs(18) {
                std::thread::sleep(Duration::from_millis(20));
            }
            drop(conns);
            // 1: all of them; else 2 + how many hundreds.
            Ok(if opened == FLOOD {
                1
            } else {
                (2 + opened / 100) as u8
            })
        })
    });
    // Wait for the flood to be in place.
    let mut pfd = libc::pollfd {
        fd: ready_r.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: poll reads and writes one pollfd in the live stack variable; the fd stays open.
    let n = unsafe { libc::poll(&mut pfd, 1, 15_000) };
    assert_eq!(n, 1, "the flood did not start in time");

    // serve holds a bounded number of descriptors, however many connections wait.
    let during = fd_count(serve.pid());
    let bound = before + 32 + 16;
    let started = Instant::now();
    // gRPC answers at once.
    let mut c = tokio::time::timeout(Duration::from_secs(5), serve.client())
        .await
        .expect("connect to serve during the flood");
    tokio::time::timeout(Duration::from_secs(5), c.status(StatusRequest {}))
        .await
        .expect("Status in time during the flood")
        .expect("Status during the flood");
    // A scrape is served once the idle connections reach their deadline (5 s).
    let scraped = loop {
        if let Ok(Ok(r)) =
            tokio::time::timeout(Duration::from_secs(2), http_get(addr, "/metrics")).await
        {
            if r.starts_with("HTTP/1.1 200 OK") {
                break r;
            }
        }
        assert!(
            started.elapsed() < Duration::from_secs(12),
            "no scrape answered within 12 s of the flood"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let scrape_took = started.elapsed();
    std::fs::write(&release, b"").unwrap();
    let flooded = flooder.join().unwrap();
    assert!(
        during <= bound,
        "serve holds {during} descriptors during the flood (before: {before}, bound {bound})"
    );
    // All 2,000, or (on a loaded machine, where connects wait on the full backlog) at least
    // 1,100 in the flood's 8 s: more than serve's 1,024 descriptors, and well past the metrics
    // listener's 32 slots, either way.
    assert!(
        matches!(flooded, Outcome::Ok(n) if n == 1 || n >= 2 + 11),
        "the flood opened too few connections to test anything: {flooded:?}"
    );
    assert!(scrape_took < Duration::from_secs(12), "{scrape_took:?}");
    let refused = sample(
        &scraped,
        "csi_isolator_connections_refused_total{listener=\"metrics\",reason=\"capacity\"}",
    );
    assert!(refused >= 1_000.0, "refused {refused}");
    drop(c);
    serve.stop(&sb);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_on_loopback_for_a_bare_port_and_a_wider_address_is_warned_about() {
    require_root();
    const WARNING: &str = "which is not a loopback address";
    let sb = Sandbox::new("serve-expose");
    let serve = Serve::start(&sb, &["--metrics", "0"], None);
    let addr = serve.metrics.unwrap();
    assert!(addr.ip().is_loopback(), "{addr}");
    assert!(http_get(addr, "/metrics")
        .await
        .unwrap()
        .starts_with("HTTP/1.1 200 OK"));
    assert!(!serve.stderr().contains(WARNING), "{}", serve.stderr());
    serve.stop(&sb);

    let serve = Serve::start(&sb, &["--metrics", "0.0.0.0:0"], None);
    let deadline = Instant::now() + Duration::from_secs(5);
    while !serve.stderr().contains(WARNING) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let err = serve.stderr();
    let line = err
        .lines()
        .find(|l| l.contains(WARNING))
        .unwrap_or_else(|| panic!("no warning for 0.0.0.0:\n{err}"));
    assert!(line.contains("WARN") && line.contains("volumes"), "{line}");
    serve.stop(&sb);
}

/// A root connection that greeted serve in HTTP/2 and got its answer: admitted, holding a slot.
fn admitted_connection(socket: &Path) -> std::os::unix::net::UnixStream {
    let mut s = std::os::unix::net::UnixStream::connect(socket).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(H2_HELLO).expect("greet");
    let mut buf = [0u8; 64];
    let n = s
        .read(&mut buf)
        .expect("serve answers an admitted connection");
    assert!(n > 0, "an admitted connection was closed");
    s
}

/// serve's own bounds (finding 10): connections over `--max-connections` are closed at once and
/// counted, a slot is given back when its connection goes, and a call that outlasts
/// `--request-timeout` is answered CANCELLED while its operation still runs to its end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_bounds_connections_and_call_time() {
    require_root();
    let sb = Sandbox::new("serve-bounds");
    let serve = Serve::start(
        &sb,
        &[
            "--metrics",
            "0",
            "--max-connections",
            "2",
            "--request-timeout",
            "1",
            "--plugin-arg=--backing=dir",
            "--plugin-arg=--delay=CreateVolume=3000",
        ],
        None,
    );
    let addr = serve.metrics.unwrap();
    let capacity = "csi_isolator_connections_refused_total{listener=\"grpc\",reason=\"capacity\"}";

    let idle = [
        admitted_connection(&serve.socket),
        admitted_connection(&serve.socket),
    ];
    // A third connection is closed without a word.
    assert_eq!(greet(&serve.socket), Ok(0));
    let scraped = http_get(addr, "/metrics").await.unwrap();
    assert!(sample(&scraped, capacity) >= 1.0, "{scraped}");
    // The slots come back with their connections.
    drop(idle);
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut c = loop {
        if greet(&serve.socket) == Ok(1) {
            break serve.client().await;
        }
        assert!(Instant::now() < deadline, "no slot came back");
        std::thread::sleep(Duration::from_millis(50));
    };

    // CreateVolume waits 3 s in the plugin; the caller is answered after 1 s.
    let started = Instant::now();
    let answer = c
        .create_volume(CreateVolumeRequest {
            name: "slow".into(),
            capacity_bytes: 1 << 20,
            ..Default::default()
        })
        .await;
    let took = started.elapsed();
    let status = answer.expect_err("a call past the request timeout");
    assert_eq!(status.code(), Code::Cancelled, "{status:?}");
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_millis(2900),
        "answered after {took:?}"
    );
    // The operation was not cut short: the volume is created once the plugin answers.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let volumes = c
            .status(StatusRequest {})
            .await
            .unwrap()
            .into_inner()
            .volumes;
        if volumes
            .iter()
            .any(|v| v.name == "slow" && v.state == "CREATED")
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the cancelled CreateVolume never finished: {volumes:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(c);
    serve.stop(&sb);
}

/// Runs `serve --socket socket` on `<sb>/work`, which must refuse to start; returns its stderr.
fn serve_refused_with_socket(sb: &Sandbox, socket: &Path) -> String {
    let out = isolator_command(BIN, &sb.join("work"))
        .arg("serve")
        .arg("--socket")
        .arg(socket)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .expect("run csi-isolator serve");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "serve started: {stderr}");
    assert_eq!(processes_mentioning(sb.path()), Vec::<u32>::new());
    stderr
}

/// A `--socket` in a directory another user may write in is refused before anything is bound: the
/// socket is renamed into that directory, where such a user could swap it for one of their own.
#[test]
fn a_socket_in_a_directory_others_may_write_is_refused() {
    require_root();
    let sb = Sandbox::new("serve-sec-sockdir");
    let shared = sb.mkdir("shared");
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).unwrap();
    let stderr = serve_refused_with_socket(&sb, &shared.join("isolator.sock"));
    assert!(
        stderr.contains("serve socket dir")
            && stderr.contains(&shared.display().to_string())
            && stderr.contains("writable by group or others")
            && stderr.contains("--socket"),
        "{stderr}"
    );
    let left: Vec<_> = std::fs::read_dir(&shared).unwrap().flatten().collect();
    assert!(left.is_empty(), "made in the shared dir: {left:?}");
}

/// The socket's missing parent directories are made only beneath a path that passed the rule:
/// root makes nothing inside another user's directory, or through their symbolic link, on the
/// way to a `--socket` that is then refused.
#[test]
fn no_socket_directory_is_made_through_another_users_directory_or_link() {
    require_root();
    let sb = Sandbox::new("serve-sec-sockpar");
    // A sticky, world-writable directory as /tmp is, where a user made things first.
    let sticky = sb.mkdir("sticky");
    std::fs::set_permissions(&sticky, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let theirs = sticky.join("theirs");
    std::fs::create_dir(&theirs).unwrap();
    std::os::unix::fs::chown(&theirs, Some(NOBODY_UID), Some(NOGROUP_GID)).unwrap();
    let elsewhere = sb.mkdir("elsewhere");
    let link = sticky.join("link");
    std::os::unix::fs::symlink(&elsewhere, &link).unwrap();
    std::os::unix::fs::lchown(&link, Some(NOBODY_UID), Some(NOGROUP_GID)).unwrap();

    let stderr = serve_refused_with_socket(&sb, &theirs.join("sub/d/i.sock"));
    assert!(
        stderr.contains("serve socket dir")
            && stderr.contains(&theirs.display().to_string())
            && stderr.contains("not owned by root")
            && stderr.contains(&format!("owner uid {NOBODY_UID}")),
        "{stderr}"
    );
    assert!(
        !theirs.join("sub").exists(),
        "made inside nobody's directory"
    );

    let stderr = serve_refused_with_socket(&sb, &link.join("sub/i.sock"));
    assert!(
        stderr.contains("serve socket dir") && stderr.contains(&link.display().to_string()),
        "{stderr}"
    );
    assert!(
        !elsewhere.join("sub").exists(),
        "made through nobody's link"
    );
}
