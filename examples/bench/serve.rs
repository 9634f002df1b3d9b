//! Optional: the RSS of a real `csi-isolator serve` holding N volumes, each
//! created and prepared (published) for its own container through the
//! service socket. The service runs in its own mount namespace (a slave of
//! the host's, made in the child before exec), so its mounts vanish with it
//! and its plugin.

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use futures::{StreamExt, TryStreamExt};

use csi_isolator::csi::transport::connect_unix;
use csi_isolator::service::proto;
use csi_isolator::service::proto::isolator_client::IsolatorClient;
use csi_isolator_testing::Sandbox;

use crate::machine::status_kib;

/// What was measured.
#[derive(Clone, Debug)]
pub struct ServeReport {
    /// Volumes prepared (one container each).
    pub volumes: usize,
    /// Time to create and prepare them all.
    pub setup: Duration,
    /// serve's VmRSS then, KiB.
    pub vm_rss_kib: u64,
    /// serve's VmHWM, KiB.
    pub vm_hwm_kib: u64,
}

/// Whether `bin serve --help` works (the verb exists in this build).
pub fn available(bin: &Path) -> bool {
    std::process::Command::new(bin)
        .args(["serve", "--help"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Starts `bin serve` under `dir`, prepares `count` containers with one new
/// volume each, reads its memory, then stops it (SIGTERM).
pub async fn measure(
    bin: &Path,
    dir: &Path,
    count: usize,
    sandbox: &Sandbox,
) -> Result<ServeReport> {
    let socket = dir.join("isolator.sock");
    // The bundled plugin's backing, as serve passes it on (serve has no backing of its own).
    let backing = format!("--plugin-arg={}", crate::backing_arg());
    let mut child = spawn(bin, dir, &socket, &[backing], None)?;
    let pid = child.id().context("serve pid")?;
    sandbox.track(pid);
    let result = drive(&socket, dir, count, pid, &mut child).await;
    stop(&mut child, pid, sandbox).await;
    result.with_context(|| format!("see {}", dir.join("serve.log").display()))
}

/// Spawns `bin --work-dir DIR/work serve --socket SOCKET ARGS...`, logging to `DIR/serve.log`
/// (appended), killed with its parent. In `namespace` (an open `/proc/PID/ns/mnt`) when given,
/// else in a new mount namespace of its own (a slave of the host's), so that its mounts vanish
/// with it.
pub fn spawn(
    bin: &Path,
    dir: &Path,
    socket: &Path,
    args: &[String],
    namespace: Option<&std::fs::File>,
) -> Result<tokio::process::Child> {
    let work = dir.join("work");
    std::fs::create_dir_all(&work).with_context(|| format!("create {}", work.display()))?;
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("serve.log"))
        .context("open serve log")?;
    let mut cmd = tokio::process::Command::new(bin);
    cmd.arg("--work-dir")
        .arg(&work)
        .arg("serve")
        .arg("--socket")
        .arg(socket)
        .args(args)
        .stdin(Stdio::null())
        .stdout(log.try_clone().context("dup serve log")?)
        .stderr(log)
        .kill_on_drop(true);
    in_namespace(cmd.as_std_mut(), namespace);
    cmd.spawn()
        .with_context(|| format!("spawn {} serve", bin.display()))
}

/// Makes `cmd`'s child die with its parent and enter `namespace` (an open `/proc/PID/ns/mnt`),
/// or a new mount namespace of its own, a slave of the host's, when `None`.
pub fn in_namespace(cmd: &mut std::process::Command, namespace: Option<&std::fs::File>) {
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    let fd = namespace.map(|f| f.as_raw_fd());
    // SAFETY: the closure runs in the forked child before exec and makes raw system calls only
    // (prctl, setns or unshare, mount with static C strings): async-signal-safe, no allocation,
    // no lock. The fd stays open in the parent for as long as `cmd` is spawned from.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            let entered = match fd {
                Some(fd) => libc::setns(fd, libc::CLONE_NEWNS) == 0,
                None => {
                    libc::unshare(libc::CLONE_NEWNS) == 0
                        && libc::mount(
                            std::ptr::null(),
                            c"/".as_ptr(),
                            std::ptr::null(),
                            libc::MS_REC | libc::MS_SLAVE,
                            std::ptr::null(),
                        ) == 0
                }
            };
            if !entered {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Stops serve with SIGTERM (SIGKILL after 10 s) and forgets its pid.
pub async fn stop(child: &mut tokio::process::Child, pid: u32, sandbox: &Sandbox) {
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGTERM,
    );
    if tokio::time::timeout(Duration::from_secs(10), child.wait())
        .await
        .is_err()
    {
        let _ = child.kill().await;
    }
    sandbox.untrack(pid);
}

/// A client once serve answers `recover` (its own recovery, then the containerizer's, done),
/// within `wait`, and the answer.
pub async fn ready(
    socket: &Path,
    child: &mut tokio::process::Child,
    wait: Duration,
    recover: proto::RecoverRequest,
) -> Result<(
    IsolatorClient<tonic::transport::Channel>,
    proto::RecoverResponse,
)> {
    let deadline = Instant::now() + wait;
    loop {
        if let Some(status) = child.try_wait()? {
            bail!("serve exited before it was ready ({status})");
        }
        if let Ok(channel) = connect_unix(socket).await {
            let mut c = IsolatorClient::new(channel);
            if let Ok(answer) = c.recover(recover.clone()).await {
                return Ok((c, answer.into_inner()));
            }
        }
        ensure!(
            Instant::now() < deadline,
            "serve not ready after {} s",
            wait.as_secs()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The id of the `i`-th container [`prepare_all`] prepares.
pub fn container_id(prefix: &str, i: usize) -> String {
    format!("{prefix}-c{i}")
}

/// Creates `count` volumes `PREFIX-i` through serve and prepares container [`container_id`] with
/// each (its sandbox under `dir/sandboxes`), 16 at a time.
pub async fn prepare_all(
    client: &IsolatorClient<tonic::transport::Channel>,
    dir: &Path,
    prefix: &str,
    count: usize,
) -> Result<()> {
    futures::stream::iter(0..count)
        .map(|i| {
            let mut c = client.clone();
            async move {
                let name = format!("{prefix}-{i}");
                let created = c
                    .create_volume(proto::CreateVolumeRequest {
                        name: name.clone(),
                        capacity_bytes: 1 << 20,
                        container_path: "data".into(),
                        ..Default::default()
                    })
                    .await
                    .with_context(|| format!("CreateVolume {name}"))?
                    .into_inner();
                let sandbox = dir.join("sandboxes").join(i.to_string());
                std::fs::create_dir_all(&sandbox)?;
                c.prepare(proto::PrepareRequest {
                    container_id: container_id(prefix, i),
                    config: Some(proto::ContainerConfig {
                        resources_json: format!("[{}]", created.resource_json),
                        sandbox: sandbox.to_string_lossy().into_owned(),
                        ..Default::default()
                    }),
                })
                .await
                .with_context(|| format!("Prepare {}", container_id(prefix, i)))?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(16)
        .try_collect::<Vec<()>>()
        .await?;
    Ok(())
}

async fn drive(
    socket: &Path,
    dir: &Path,
    count: usize,
    pid: u32,
    child: &mut tokio::process::Child,
) -> Result<ServeReport> {
    let (client, _) = ready(
        socket,
        child,
        Duration::from_secs(30),
        proto::RecoverRequest::default(),
    )
    .await?;
    let t0 = Instant::now();
    prepare_all(&client, dir, "serve", count).await?;
    let setup = t0.elapsed();
    let pid = pid.to_string();
    Ok(ServeReport {
        volumes: count,
        setup,
        vm_rss_kib: status_kib(&pid, "VmRSS:").context("read serve's VmRSS")?,
        vm_hwm_kib: status_kib(&pid, "VmHWM:").unwrap_or(0),
    })
}
