//! A block volume's publish and unpublish through `serve`, killed (SIGKILL, by the crash-point
//! hook `CSI_ISOLATOR_CRASH_AFTER_WRITE=N`) at every crash point: Prepare of a container using
//! the volume (ControllerPublish, NodeStage: the loop device attached and bound onto the staged
//! device file, NodePublish: the target file made and the device bound onto it), then its
//! Cleanup (the reverse). For each N, a fresh serve recovers (the container is not known any
//! more) and then: Status shows the volume CREATED, unused, its target not mounted, with no
//! disagreement; the plugin agrees over CSI that the volume is not published anywhere; nothing is
//! left mounted under the sandbox and no loop device is attached to its image. The loop over N
//! ends when Prepare and Cleanup complete without crashing.

use std::fs::File;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use csi_isolator::csi::transport::connect_unix;
use csi_isolator::provider::checkpoint::CRASH_AFTER_WRITE_ENV;
use csi_isolator::service::proto::isolator_client::IsolatorClient;
use csi_isolator::service::proto::{
    CleanupRequest, ContainerConfig, CreateVolumeRequest, DestroyVolumeRequest, PrepareRequest,
    RecoverRequest, StatusRequest,
};
use csi_isolator_testing::{processes_mentioning, require_root, wait_for_serve_ready, Sandbox};
use tonic::transport::Channel;

const BIN: &str = env!("CARGO_BIN_EXE_csi-isolator");
const TIMEOUT: Duration = Duration::from_secs(30);
const MAX_POINTS: u32 = 60;

struct World {
    sb: Sandbox,
    work: PathBuf,
    serve: Option<Child>,
    serves: u32,
}

impl World {
    fn start(&mut self, crash_after: Option<u32>) {
        self.serves += 1;
        let log = File::create(self.sb.join(format!("serve-{}.log", self.serves))).unwrap();
        let mut cmd = Command::new(BIN);
        cmd.env("CSI_ISOLATOR_SOCKET_DIR", self.sb.join("s"))
            .env_remove(CRASH_AFTER_WRITE_ENV)
            .arg("--work-dir")
            .arg(&self.work)
            .arg("serve")
            .arg("--socket")
            .arg(self.sb.join("isolator.sock"))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log);
        if let Some(n) = crash_after {
            cmd.env(CRASH_AFTER_WRITE_ENV, n.to_string());
        }
        let mut child = self.sb.spawn(&mut cmd).expect("spawn serve");
        wait_for_serve_ready(&mut child, TIMEOUT);
        self.serve = Some(child);
    }

    async fn client(&self) -> IsolatorClient<Channel> {
        IsolatorClient::new(connect_unix(&self.sb.join("isolator.sock")).await.unwrap())
    }

    /// Waits for serve's exit (SIGTERM first if `stop`) and for its plugin to be gone.
    fn end(&mut self, stop: bool) -> ExitStatus {
        let mut child = self.serve.take().expect("serve runs");
        if stop {
            nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(child.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            )
            .unwrap();
        }
        let deadline = Instant::now() + TIMEOUT;
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            assert!(Instant::now() < deadline, "serve did not exit");
            std::thread::sleep(Duration::from_millis(10));
        };
        self.sb.untrack(child.id());
        while !processes_mentioning(&self.work).is_empty() {
            assert!(Instant::now() < deadline, "the plugin outlived serve");
            std::thread::sleep(Duration::from_millis(10));
        }
        status
    }
}

impl Drop for World {
    fn drop(&mut self) {
        if let Some(mut child) = self.serve.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if std::thread::panicking() {
            for k in 1..=self.serves {
                let log = self.sb.join(format!("serve-{k}.log"));
                eprintln!(
                    "--- {}\n{}",
                    log.display(),
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            }
        }
    }
}

fn prepare(resource: &str, sandbox: &str) -> PrepareRequest {
    PrepareRequest {
        container_id: "c1".into(),
        config: Some(ContainerConfig {
            resources_json: format!("[{resource}]"),
            sandbox: sandbox.into(),
            ..Default::default()
        }),
    }
}

/// One run crashing at point `n`; whether it crashed.
async fn crash_once(n: u32) -> bool {
    let sb = Sandbox::new("block-crash");
    let work = sb.join("work");
    let sandbox = sb.mkdir("sandboxes/c1");
    let mut w = World {
        sb,
        work,
        serve: None,
        serves: 0,
    };
    w.start(None);
    let mut c = w.client().await;
    let v = c
        .create_volume(CreateVolumeRequest {
            name: "blk".into(),
            capacity_bytes: 16 << 20,
            container_path: "disk".into(),
            access_type: "block".into(),
            ..Default::default()
        })
        .await
        .expect("CreateVolume")
        .into_inner();
    drop(c);
    assert!(w.end(true).success());

    w.start(Some(n));
    let mut c = w.client().await;
    let sandbox = sandbox.to_str().unwrap().to_string();
    let outcome = async {
        let info = c
            .prepare(prepare(&v.resource_json, &sandbox))
            .await?
            .into_inner();
        assert!(info.mounts.len() == 1 && info.mounts[0].block, "{info:?}");
        c.cleanup(CleanupRequest {
            container_id: "c1".into(),
        })
        .await?;
        Ok::<(), tonic::Status>(())
    }
    .await;
    drop(c);
    let crashed = match outcome {
        Ok(()) => {
            assert!(w.end(true).success());
            false
        }
        Err(status) => {
            let exit = w.end(false);
            assert_eq!(
                exit.signal(),
                Some(9),
                "point {n}: {status} without the crash"
            );
            true
        }
    };

    w.start(None);
    let mut c = w.client().await;
    let r = c
        .recover(RecoverRequest {
            known_container_ids: Vec::new(),
        })
        .await
        .expect("Recover")
        .into_inner();
    assert!(r.corrupt.is_empty(), "point {n}: {r:?}");
    let st = c
        .status(StatusRequest {})
        .await
        .expect("Status")
        .into_inner();
    assert_eq!(st.volumes.len(), 1, "point {n}: {st:?}");
    let vol = &st.volumes[0];
    assert_eq!(vol.access_type, "block");
    assert_eq!(vol.state, "CREATED", "point {n}: {vol:?}");
    assert!(vol.users.is_empty() && !vol.mounted, "point {n}: {vol:?}");
    assert!(vol.disagreement.is_empty(), "point {n}: {vol:?}");
    assert!(st.containers.is_empty(), "point {n}: {st:?}");
    let left: Vec<_> =
        w.sb.mounts_under()
            .into_iter()
            .map(|m| m.mount_point)
            .collect();
    assert!(left.is_empty(), "point {n}: mounts left: {left:?}");
    w.sb.assert_no_loop_devices();
    // And it still serves: a Prepare after recovery publishes it again.
    c.prepare(prepare(&v.resource_json, &sandbox))
        .await
        .expect("Prepare after recovery");
    c.cleanup(CleanupRequest {
        container_id: "c1".into(),
    })
    .await
    .expect("Cleanup after recovery");
    c.destroy_volume(DestroyVolumeRequest {
        volume_id: v.volume_id.clone(),
        ..Default::default()
    })
    .await
    .expect("DestroyVolume");
    drop(c);
    assert!(w.end(true).success());
    w.sb.assert_no_mounts_under();
    w.sb.assert_no_loop_devices();
    crashed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_volumes_publish_and_unpublish_survive_a_crash_at_every_point() {
    require_root();
    let mut n = 1;
    while crash_once(n).await {
        n += 1;
        assert!(n < MAX_POINTS, "the operation never completed");
    }
    eprintln!("block_crash: crash points survived: {}", n - 1);
    // Prepare's container record and publish intent, the steps' RPCs and results, and
    // Cleanup's: well above a handful.
    let survived = n - 1;
    assert!(survived >= 6, "only {survived} crash points");
}
