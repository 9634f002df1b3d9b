//! Scaffolding shared by the isolator integration tests: an "agent" (a provider with the bundled plugin, a
//! volume isolator over it) in a test sandbox, and real containers from the namespace launcher.
#![allow(dead_code)]

pub use csi_isolator_testing::plugin_bin;
use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::sync::Arc;
use std::time::Duration;

use csi_isolator::isolator::{ContainerConfig, LaunchInfo, VolumeIsolator};
use csi_isolator::launcher::{self, LaunchSpec, Launched};
use csi_isolator::mount::{LinuxSyscall, ProcMountTable};
use csi_isolator::provider::bundled::bundled_config;
use csi_isolator::provider::{CreateSpec, Manager, ProviderConfig, StorageProvider};
use csi_isolator::resource::{Resource, VolumeMode};
use csi_isolator_testing::{host_mount_points, Sandbox};
use nix::sys::signal::Signal;

pub const MIB: u64 = 1024 * 1024;
pub const TIMEOUT: Duration = Duration::from_secs(20);

pub struct Agent {
    pub provider: Arc<StorageProvider>,
    pub isolator: VolumeIsolator,
    pub work: PathBuf,
}

impl Agent {
    pub async fn start(sb: &Sandbox, work_rel: &str, plugin_args: &[&str]) -> Agent {
        let work = sb.mkdir(work_rel);
        let args: Vec<String> = plugin_args.iter().map(|s| s.to_string()).collect();
        let mut c = bundled_config(Path::new(plugin_bin()), &work, "default", &args);
        c.socket_dir = sb.join("s");
        Self::with_config(c).await
    }

    pub async fn with_config(c: ProviderConfig) -> Agent {
        let work = c.work_dir.clone();
        let provider = StorageProvider::start(c).await.expect("start provider");
        let mut manager = Manager::new();
        manager.add(provider.clone());
        let isolator = VolumeIsolator::new(
            &work,
            Arc::new(manager),
            Arc::new(LinuxSyscall::new()),
            Arc::new(ProcMountTable::new()),
        );
        Agent {
            provider,
            isolator,
            work,
        }
    }

    pub async fn volume(&self, name: &str, container_path: &str, mode: VolumeMode) -> Resource {
        self.provider
            .create_volume(CreateSpec::new(name, 16 * MIB))
            .await
            .expect("create volume")
            .with_volume(container_path, mode)
    }

    pub async fn stop(self) {
        self.provider.shutdown(Duration::from_secs(5)).await;
    }

    /// The end of a test: destroys `volumes` (each must have no user left), stops the provider and
    /// checks the host mount table is as it was `before` and nothing is mounted in the sandbox.
    pub async fn destroy_and_stop(self, sb: &Sandbox, before: &[PathBuf], volumes: &[&Resource]) {
        for r in volumes {
            let id = r.source_id().expect("a CSI volume");
            self.provider
                .destroy_volume(id)
                .await
                .unwrap_or_else(|e| panic!("destroy {id}: {e}"));
        }
        self.stop().await;
        assert_clean(sb, before);
    }
}

pub fn config(
    sb: &Sandbox,
    container: &str,
    resources: Vec<Resource>,
    rootfs: Option<PathBuf>,
) -> ContainerConfig {
    ContainerConfig {
        resources,
        sandbox: sb.mkdir(format!("sandboxes/{container}")),
        rootfs,
        user: None,
    }
}

pub fn spec(cfg: &ContainerConfig, info: &LaunchInfo, script: &str) -> LaunchSpec {
    LaunchSpec {
        argv: vec!["sh".into(), "-c".into(), OsString::from(script)],
        env: vec![("PATH".into(), "/usr/bin:/bin".into())],
        sandbox: cfg.sandbox.clone(),
        rootfs: cfg.rootfs.clone(),
        mounts: info.mounts.clone(),
        pid_namespace: false,
        user: None,
    }
}

pub async fn start(sb: &Sandbox, spec: LaunchSpec) -> Launched {
    let launched = tokio::task::spawn_blocking(move || {
        launcher::launch(&csi_isolator::mount::LinuxSyscall::new(), &spec)
    })
    .await
    .unwrap()
    .unwrap_or_else(|e| panic!("launch: {e}"));
    sb.track(launched.pid());
    launched
}

pub async fn finish(sb: &Sandbox, launched: &mut Launched) -> ExitStatus {
    let status = tokio::time::timeout(TIMEOUT, launched.wait_async())
        .await
        .unwrap_or_else(|_| {
            let _ = launched.kill(Signal::SIGKILL);
            panic!("workload still running after {TIMEOUT:?}")
        })
        .expect("wait");
    sb.untrack(launched.pid());
    status
}

pub async fn run(sb: &Sandbox, spec: LaunchSpec) -> ExitStatus {
    let mut l = start(sb, spec).await;
    finish(sb, &mut l).await
}

pub fn read(p: &Path) -> String {
    fs::read_to_string(p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()))
}

pub fn assert_clean(sb: &Sandbox, before: &[PathBuf]) {
    assert_eq!(
        host_mount_points(sb),
        before,
        "the host mount table changed"
    );
    sb.assert_no_mounts_under();
}
