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
    let work = dir.join("work");
    std::fs::create_dir_all(&work).with_context(|| format!("create {}", work.display()))?;
    let socket = dir.join("isolator.sock");
    let log = std::fs::File::create(dir.join("serve.log")).context("create serve log")?;
    let mut cmd = tokio::process::Command::new(bin);
    cmd.arg("--work-dir")
        .arg(&work)
        .arg("serve")
        .arg("--socket")
        .arg(&socket)
        .arg(format!("--plugin-arg={}", crate::backing_arg()))
        .stdin(Stdio::null())
        .stdout(log.try_clone().context("dup serve log")?)
        .stderr(log)
        .kill_on_drop(true);
    // SAFETY: the closure runs in the forked child before exec and makes raw system calls only
    // (prctl, unshare, mount with static C strings): async-signal-safe, no allocation, no lock.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0
                || libc::unshare(libc::CLONE_NEWNS) != 0
                || libc::mount(
                    std::ptr::null(),
                    c"/".as_ptr(),
                    std::ptr::null(),
                    libc::MS_REC | libc::MS_SLAVE,
                    std::ptr::null(),
                ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd
        .spawn()
        .with_context(|| format!("spawn {} serve", bin.display()))?;
    let pid = child.id().context("serve pid")?;
    sandbox.track(pid);
    let result = drive(&socket, dir, count, pid, &mut child).await;
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
    result.with_context(|| format!("see {}", dir.join("serve.log").display()))
}

async fn drive(
    socket: &Path,
    dir: &Path,
    count: usize,
    pid: u32,
    child: &mut tokio::process::Child,
) -> Result<ServeReport> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let client = loop {
        if let Some(status) = child.try_wait()? {
            bail!("serve exited before it was ready ({status})");
        }
        if let Ok(channel) = connect_unix(socket).await {
            let mut c = IsolatorClient::new(channel);
            if c.recover(proto::RecoverRequest::default()).await.is_ok() {
                break c;
            }
        }
        ensure!(Instant::now() < deadline, "serve not ready after 30 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let t0 = Instant::now();
    futures::stream::iter(0..count)
        .map(|i| {
            let mut c = client.clone();
            async move {
                let created = c
                    .create_volume(proto::CreateVolumeRequest {
                        name: format!("serve-{i}"),
                        capacity_bytes: 1 << 20,
                        container_path: "data".into(),
                        ..Default::default()
                    })
                    .await
                    .with_context(|| format!("CreateVolume serve-{i}"))?
                    .into_inner();
                let sandbox = dir.join("sandboxes").join(i.to_string());
                std::fs::create_dir_all(&sandbox)?;
                c.prepare(proto::PrepareRequest {
                    container_id: format!("s{i}"),
                    config: Some(proto::ContainerConfig {
                        resources_json: format!("[{}]", created.resource_json),
                        sandbox: sandbox.to_string_lossy().into_owned(),
                        ..Default::default()
                    }),
                })
                .await
                .with_context(|| format!("Prepare s{i}"))?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(16)
        .try_collect::<Vec<()>>()
        .await?;
    let setup = t0.elapsed();
    let pid = pid.to_string();
    Ok(ServeReport {
        volumes: count,
        setup,
        vm_rss_kib: status_kib(&pid, "VmRSS:").context("read serve's VmRSS")?,
        vm_hwm_kib: status_kib(&pid, "VmHWM:").unwrap_or(0),
    })
}
