//! `csi-isolator run`: one workload with CSI volumes, start to finish.
//!
//! Contract: the volumes named by `--volume` are created if they do not
//! exist yet (the same name is the same volume next time) or taken from
//! `--resources`; they are published through the provider, the workload
//! runs in a new mount namespace with each volume at its container path,
//! and whatever happens (exit, failure, SIGINT, SIGTERM) everything is
//! cleaned up before returning the workload's status: its volumes are
//! released (unpublished on last use), the managed plugin is stopped, the
//! sandbox and the work-dir lock are removed. One `run` or `serve` uses a
//! work dir at a time (an exclusive lock); a run that crashed is cleaned up
//! by the next one's recovery.

use crate::error_chain::Chain;
use crate::io_step::IoStep;
use std::collections::HashSet;
use std::ffi::OsString;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal::Signal;
use tokio::signal::unix::{signal, SignalKind};

use crate::isolator::checkpoint_paths::{is_run_container, run_sandbox};
use crate::isolator::{ContainerConfig, IsolatorError, VolumeIsolator};
use crate::launcher::{self, LaunchError, LaunchSpec};
use crate::mount::MountTable;
use crate::provider::{MountSpec, ProviderConfig, ProviderError, StorageProvider};
use crate::resource::{validate_container_id, Resource};
use crate::workdir::{self, require_mount_privilege, WorkDirError};

/// What `run` does.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// The agent work dir.
    pub work_dir: PathBuf,
    /// The provider (bundled plugin or an endpoint).
    pub provider: ProviderConfig,
    /// Volumes to create (if new) and mount (`--mount`, and `--volume` in its short form).
    pub volumes: Vec<MountSpec>,
    /// Resources (Mesos JSON) to mount as given.
    pub resources: Vec<Resource>,
    /// A root filesystem to pivot into.
    pub rootfs: Option<PathBuf>,
    /// The container id (default: `run-<random>`).
    pub container_id: Option<String>,
    /// The command and its arguments.
    pub argv: Vec<OsString>,
    /// How long the workload gets to exit after SIGTERM before SIGKILL.
    pub stop_grace: Duration,
    /// The user the workload runs as (`UID[:GID]` or `NAME[:GROUP]`; `None`: root).
    pub user: Option<String>,
}

/// `run` failed before or around the workload.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The work dir, its lock or the privilege check failed.
    #[error(transparent)]
    WorkDir(#[from] WorkDirError),
    /// SIGINT or SIGTERM arrived before the workload started.
    #[error("stopped by a signal before the workload started")]
    Stopped,
    /// The command line was wrong.
    #[error("{0}")]
    Usage(String),
    /// A file or directory of the run could not be made.
    #[error(transparent)]
    Io(#[from] IoStep),
    /// An absolute container path given without `--rootfs` names a host
    /// directory, and this one is missing or not a directory. Nothing is
    /// created on the host's own paths, so this is refused before anything
    /// is created or published.
    #[error("{flag}: container path {container_path} {problem} on the host, and without --rootfs an absolute container path is a host directory (nothing is created there): use a relative path such as {relative} (it lands in the sandbox), create the directory {container_path} on the host, or give --rootfs")]
    HostTarget {
        /// The flag that named it (`--volume ARG` or `--resources FILE`).
        flag: String,
        /// The container path as given.
        container_path: String,
        /// What is wrong with it there.
        problem: &'static str,
        /// The same path made relative, to suggest.
        relative: String,
    },
    /// The provider failed (plugin unreachable, create failed...).
    #[error(transparent)]
    Provider(Box<ProviderError>),
    /// The isolator failed (publish failed, bad target...).
    #[error(transparent)]
    Isolator(Box<IsolatorError>),
    /// The workload could not be started.
    #[error(transparent)]
    Launch(Box<LaunchError>),
}

impl From<ProviderError> for RunError {
    fn from(e: ProviderError) -> Self {
        RunError::Provider(Box::new(e))
    }
}

impl From<IsolatorError> for RunError {
    fn from(e: IsolatorError) -> Self {
        RunError::Isolator(Box::new(e))
    }
}

impl From<LaunchError> for RunError {
    fn from(e: LaunchError) -> Self {
        RunError::Launch(Box::new(e))
    }
}

/// Signals received so far (SIGINT or SIGTERM): the first asks to stop
/// after the current step, a second one cancels the step in flight.
type Stops = tokio::sync::watch::Receiver<u32>;

fn watch_signals() -> Result<Stops, RunError> {
    let install = |kind: SignalKind, name: &str| {
        signal(kind).map_err(|source| {
            RunError::Io(IoStep::new(
                "install signal handler for",
                PathBuf::from(name),
                source,
            ))
        })
    };
    let mut sigint = install(SignalKind::interrupt(), "SIGINT")?;
    let mut sigterm = install(SignalKind::terminate(), "SIGTERM")?;
    let (tx, rx) = tokio::sync::watch::channel(0u32);
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = sigint.recv() => {}
                _ = sigterm.recv() => {}
            }
            tx.send_modify(|n| *n += 1);
            if tx.is_closed() {
                return;
            }
        }
    });
    Ok(rx)
}

/// Runs `step` unless a stop was asked for; a second signal cancels it.
async fn step<T>(stops: &Stops, f: impl std::future::Future<Output = T>) -> Result<T, RunError> {
    if *stops.borrow() > 0 {
        return Err(RunError::Stopped);
    }
    let mut stops = stops.clone();
    tokio::select! {
        out = f => Ok(out),
        _ = stops.wait_for(|n| *n >= 2) => Err(RunError::Stopped),
    }
}

/// Runs the workload; returns its exit code (128 + signal if killed).
pub async fn run(mut opts: RunOptions) -> Result<i32, RunError> {
    require_mount_privilege("csi-isolator run")?;
    let stops = watch_signals()?;
    if opts.argv.is_empty() {
        return Err(RunError::Usage(
            "no command given (csi-isolator run [OPTIONS] -- COMMAND [ARG...])".into(),
        ));
    }
    let container_id = opts
        .container_id
        .clone()
        .unwrap_or_else(|| format!("run-{:016x}", rand::random::<u64>()));
    validate_container_id(&container_id)
        .map_err(|e| RunError::Usage(crate::error_chain::full_message(&e)))?;
    // An unknown `disk.volume.mode` is refused before anything starts (it
    // would never be mounted read-write, but the user should know why).
    for r in &opts.resources {
        r.check_volume_mode()
            .map_err(|e| RunError::Usage(crate::error_chain::full_message(&e)))?;
    }
    check_host_targets(&opts)?;
    // Resolved once, before anything is made; prepare and the launch read the numbers.
    if let Some(user) = &opts.user {
        let c = crate::isolator::ownership::resolve_user(user)
            .map_err(|reason| RunError::Usage(format!("--user: {reason}")))?;
        opts.user = Some(format!("{}:{}", c.uid, c.gid));
    }
    opts.work_dir = workdir::canonical(&opts.work_dir)?;
    // The checkpoint records the rootfs as the kernel names it: a read-back
    // refuses a path that is not normal and absolute.
    if let Some(rootfs) = &opts.rootfs {
        let canonical = std::fs::canonicalize(rootfs).map_err(|source| {
            RunError::Io(IoStep::new("resolve --rootfs", rootfs.clone(), source))
        })?;
        opts.rootfs = Some(canonical);
    }
    opts.provider.work_dir = opts.work_dir.clone();
    let _lock = workdir::lock(&opts.work_dir, None).await?;

    let provider = step(&stops, StorageProvider::start(opts.provider.clone())).await??;
    let result = run_with_provider(&opts, &container_id, provider.clone(), &stops).await;
    provider.shutdown(Duration::from_secs(5)).await;
    match result {
        Err(RunError::Stopped) => Ok(130),
        other => other,
    }
}

async fn run_with_provider(
    opts: &RunOptions,
    container_id: &str,
    provider: Arc<StorageProvider>,
    stops: &Stops,
) -> Result<i32, RunError> {
    let isolator = VolumeIsolator::on_host(
        &opts.work_dir,
        provider.clone(),
        Arc::new(crate::mount::LinuxSyscall::new()),
    );
    let table = isolator.mount_table();
    // We hold the work dir's lock, so no other `run` is live: containers of
    // earlier runs (sandboxes under <work_dir>/sandboxes) are gone, and a
    // workload such a run left behind when it was killed is stopped first.
    // Others (the OCI hook's) belong to their own containerizer and are kept.
    // So are uses recorded with no isolator checkpoint at all (`volume
    // publish --container X`, or a containerizer driving the provider
    // itself): the isolator writes a container's checkpoint before its first
    // publish, so such a use was never an isolator's, `run` cannot tell
    // whether X lives, and only whoever recorded it ends it (`volume
    // release`). A container whose checkpoint is unreadable still counts as
    // checkpointed (its directory names it): it was an isolator's.
    // An earlier run's container is one whose sandbox is exactly
    // `<work_dir>/sandboxes/<its id>`; `checkpointed` lists only records
    // whose paths are safe to act on, so one that is corrupt, planted or
    // names anything else is neither stopped nor kept: recovery sets it
    // aside and touches nothing it names.
    let (stale, others): (Vec<_>, Vec<_>) = isolator
        .checkpointed()
        .into_iter()
        .partition(|c| is_run_container(c, &opts.work_dir));
    for c in &stale {
        kill_stale_workload(c).await;
    }
    let mut others: Vec<String> = others.into_iter().map(|c| c.container_id).collect();
    let with_checkpoint: HashSet<String> = isolator.checkpointed_ids();
    for v in provider.volumes().await {
        for user in v.users {
            if !with_checkpoint.contains(&user) && !others.contains(&user) {
                tracing::info!(volume_id = %v.volume_id, container_id = %user, "keeping a use recorded outside the isolator");
                others.push(user);
            }
        }
    }
    let recovered = step(stops, isolator.recover(&others)).await??;
    remove_stale_sandboxes(&*table, &opts.work_dir, &isolator.checkpointed_ids());
    if !recovered.cleaned.is_empty() {
        tracing::warn!(containers = ?recovered.cleaned, "cleaned up after an earlier run that did not finish");
    }

    let sandbox = run_sandbox(&opts.work_dir, container_id);
    let outcome =
        prepare_and_supervise(opts, container_id, &provider, &isolator, &sandbox, stops).await;
    let cleaned = isolator.cleanup(container_id).await;
    remove_sandbox(&*table, &sandbox);
    let code = outcome?;
    cleaned?;
    Ok(code)
}

async fn prepare_and_supervise(
    opts: &RunOptions,
    container_id: &str,
    provider: &StorageProvider,
    isolator: &VolumeIsolator,
    sandbox: &Path,
    stops: &Stops,
) -> Result<i32, RunError> {
    let mut resources = opts.resources.clone();
    // Disks with a profile and no volume yet (Mesos' CREATE_DISK): created first.
    step(stops, provider.create_profile_disks(&mut resources)).await??;
    for v in &opts.volumes {
        // A volume of that name already there is handed out as it is, with the
        // parameters it was created with (`volume create --param`).
        let res = step(stops, provider.volume_for_mount(v)).await??;
        resources.push(v.use_of(res));
    }
    mkdir(sandbox)?;
    let config = ContainerConfig {
        resources,
        sandbox: sandbox.to_path_buf(),
        rootfs: opts.rootfs.clone(),
        user: opts.user.clone(),
    };
    let info = step(stops, isolator.prepare(container_id, config)).await??;
    // Numbers since the start (no lookup): the same answer prepare had.
    let user = match &opts.user {
        Some(u) => Some(crate::isolator::ownership::resolve_user(u).map_err(RunError::Usage)?),
        None => None,
    };
    let spec = LaunchSpec {
        argv: opts.argv.clone(),
        env: Vec::new(),
        sandbox: sandbox.to_path_buf(),
        rootfs: opts.rootfs.clone(),
        mounts: info.mounts,
        pid_namespace: false,
        user,
    };
    if *stops.borrow() > 0 {
        return Err(RunError::Stopped);
    }
    supervise(isolator, container_id, spec, opts.stop_grace, stops.clone()).await
}

/// A workload an earlier, killed `run` left running: stop it before its
/// volumes are released, only if the pid is still that process. A pidfd is
/// opened first and the checks
/// ([`not_still_the_container`](crate::isolator::process_check::not_still_the_container)) made after, twice
/// around the namespace reads; the signal goes through the pidfd, so a pid
/// recycled at any point is never hit (the pidfd names the process it was
/// opened on, and fails with ESRCH once that one has exited).
async fn kill_stale_workload(c: &crate::isolator::ContainerRecord) {
    use crate::isolator::process_check::{not_still_the_container, PidFacts};
    use crate::launcher::process::{
        open_pidfd, pidfd_exited, pidfd_send_signal, process_start_time,
    };
    use std::os::fd::AsFd;
    let Some(pid) = c.pid else {
        return;
    };
    let own = std::process::id();
    // Refusals that need no /proc read come first: pid 1 is never even opened.
    let nothing = PidFacts {
        start: c.pid_start,
        in_our_mount_namespace: Some(false),
        view: c.mount_view,
    };
    if let Some(why) = not_still_the_container(pid, c.pid_start, c.mount_view, own, &nothing) {
        tracing::warn!(container_id = %c.container_id, pid, why, "not signalling the pid in an earlier run's checkpoint");
        return;
    }
    let pidfd = match open_pidfd(pid) {
        Ok(fd) => fd,
        Err(errno) => {
            tracing::debug!(container_id = %c.container_id, pid, %errno, "the earlier run's workload is gone");
            return;
        }
    };
    let facts = PidFacts::read(pid);
    // The start time again, after the namespace reads: they were of the same process.
    let refusal = not_still_the_container(pid, c.pid_start, c.mount_view, own, &facts)
        .or((process_start_time(pid) != facts.start).then_some("it changed while it was checked"));
    if let Some(why) = refusal {
        tracing::warn!(container_id = %c.container_id, pid, why, "not signalling the pid in an earlier run's checkpoint");
        return;
    }
    tracing::warn!(container_id = %c.container_id, pid, "stopping a workload an earlier run left behind");
    if let Err(errno) = pidfd_send_signal(pidfd.as_fd(), Signal::SIGKILL) {
        tracing::debug!(container_id = %c.container_id, pid, %errno, "the earlier run's workload is gone");
        return;
    }
    for _ in 0..100 {
        if pidfd_exited(pidfd.as_fd(), 0) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tracing::error!(container_id = %c.container_id, pid, "the earlier run's workload did not exit after SIGKILL");
}

/// Starts the workload, forwards SIGINT/SIGTERM to it (then SIGKILL after
/// the grace period) and returns its exit code.
async fn supervise(
    isolator: &VolumeIsolator,
    container_id: &str,
    spec: LaunchSpec,
    grace: Duration,
    mut stops: Stops,
) -> Result<i32, RunError> {
    let sys = isolator.syscall();
    let mut launched = tokio::task::spawn_blocking(move || launcher::launch(&*sys, &spec))
        .await
        .expect("the launch task does not panic")?;
    if let Err(e) = isolator.isolate(container_id, launched.pid()).await {
        let _ = launched.kill(Signal::SIGKILL);
        let _ = launched.wait_async().await;
        return Err(e.into());
    }
    // On SIGINT/SIGTERM: SIGTERM to the workload once, SIGKILL after the grace period.
    let mut kill_at: Option<tokio::time::Instant> = None;
    let mut signalled = *stops.borrow_and_update() > 0;
    if signalled {
        let _ = launched.kill(Signal::SIGTERM);
        kill_at = Some(tokio::time::Instant::now() + grace);
    }
    let status = loop {
        let deadline = kill_at;
        tokio::select! {
            status = launched.wait_async() => break status?,
            changed = stops.changed() => {
                if changed.is_err() {
                    continue;
                }
            }
            _ = tokio::time::sleep_until(deadline.unwrap_or_else(tokio::time::Instant::now)), if deadline.is_some() => {
                tracing::warn!(pid = launched.pid(), "workload still running after {grace:?}: SIGKILL");
                let _ = launched.kill(Signal::SIGKILL);
                kill_at = None;
                continue;
            }
        }
        if !signalled {
            signalled = true;
            tracing::info!(pid = launched.pid(), "stopping the workload (SIGTERM)");
            let _ = launched.kill(Signal::SIGTERM);
            kill_at = Some(tokio::time::Instant::now() + grace);
        }
    };
    Ok(status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(0)))
}

/// Refuses, before any volume is created or published, an absolute
/// container path without `--rootfs` that is not a directory on the host.
/// The mount resolves the target by fd later all the same; this only says
/// up front, in the user's terms, what that would fail on.
fn check_host_targets(opts: &RunOptions) -> Result<(), RunError> {
    if opts.rootfs.is_some() {
        return Ok(());
    }
    let from_volumes = opts
        .volumes
        .iter()
        .map(|v| (format!("volume '{}'", v.source), v.target.as_str()));
    let from_resources = opts.resources.iter().filter_map(|r| {
        let path = r.container_path()?;
        Some((format!("--resources ({})", r.describe()), path))
    });
    for (flag, container_path) in from_volumes.chain(from_resources) {
        // A path the isolator refuses lexically (`..` above the root, the
        // root itself) gets that refusal, which names the container path.
        if !container_path.starts_with('/')
            || crate::isolator::targets::target_of(container_path, false).is_err()
        {
            continue;
        }
        let problem = match std::fs::metadata(container_path) {
            Ok(m) if m.is_dir() => continue,
            Ok(_) => "is not a directory",
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => "does not exist",
            // Anything else (EACCES, ELOOP...) is left to the mount, which
            // names the step and the errno.
            Err(_) => continue,
        };
        let relative = container_path.trim_start_matches('/');
        return Err(RunError::HostTarget {
            flag,
            container_path: container_path.to_string(),
            problem,
            relative: if relative.is_empty() {
                "data"
            } else {
                relative
            }
            .to_string(),
        });
    }
    Ok(())
}

fn mkdir(path: &Path) -> Result<(), RunError> {
    std::fs::create_dir_all(path)
        .map_err(|source| RunError::Io(IoStep::new("create directory", path, source)))
}

/// Removes the sandboxes of earlier runs that recovery is done with: we hold the work dir's
/// lock, so no run is live, and a sandbox whose container has no checkpoint left (cleaned up
/// just now, or killed before its first checkpoint) is only a killed run's leftover. One whose
/// checkpoint is still there (its cleanup failed) is kept for the next run's recovery; an entry
/// that is not a plain directory is left alone.
fn remove_stale_sandboxes(table: &dyn MountTable, work_dir: &Path, checkpointed: &HashSet<String>) {
    let Ok(entries) =
        std::fs::read_dir(work_dir.join(crate::isolator::checkpoint_paths::RUN_SANDBOXES))
    else {
        return;
    };
    for entry in entries.flatten() {
        let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
        let name = entry.file_name();
        if is_dir && !name.to_str().is_some_and(|n| checkpointed.contains(n)) {
            remove_sandbox(table, &entry.path());
        }
    }
}

/// Removes the sandbox unless something is still mounted under it (then
/// its content may be a volume's data: keep it and say so).
fn remove_sandbox(table: &dyn MountTable, sandbox: &Path) {
    match table.mounts_under(sandbox) {
        Ok(m) if m.is_empty() => match std::fs::remove_dir_all(sandbox) {
            // A run that failed before its sandbox was made (a CreateVolume refused) has none.
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                tracing::warn!(sandbox = %sandbox.display(), error = %Chain(&e), "cannot remove the sandbox");
            }
            _ => {}
        },
        _ => tracing::error!(sandbox = %sandbox.display(), "still mounted under the sandbox; kept"),
    }
}
