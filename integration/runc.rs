//! The Docker/OCI containerizer path against a real OCI runtime: volumes are
//! bound into the sandbox on the host by `isolator::oci::prepare`, the bundle's
//! config.json gets the matching `mounts` entries, Debian's `runc` runs a
//! busybox container that reads and writes them, and `oci::cleanup` leaves
//! nothing mounted under the sandbox.
//!
//! Needs root, `runc` on PATH and `/bin/busybox` (package busybox-static);
//! nothing is installed at test time (`.ci/run` installs them).

use csi_isolator_testing::plugin_bin;
use std::fs;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::time::Duration;

use csi_isolator::isolator::oci::{self, OciPrepared};
use csi_isolator::isolator::LaunchInfo;
use csi_isolator::mount::{
    Hardening, TargetRoot, VolumeMount, VolumePropagation, SANDBOX_IN_ROOTFS,
};
use csi_isolator::mount::{LinuxSyscall, MountTable, ProcMountTable};
use csi_isolator::provider::bundled::bundled_config;
use csi_isolator::provider::{CreateSpec, StorageProvider};
use csi_isolator::service::proto;
use csi_isolator::service::proto::isolator_client::IsolatorClient;
use csi_isolator_testing::{require_root, require_runc, runc_run, RuncBundle, RuncRun, Sandbox};

const RUN_TIMEOUT: Duration = Duration::from_secs(60);

/// Root and runc, or a panic saying what is missing (busybox is checked when the bundle is built).
fn require_tools() {
    require_root();
    require_runc();
}

/// An OCI bundle and a container sandbox inside a test sandbox.
struct Bundle {
    /// The container's sandbox (where volumes are bound on the host).
    sandbox: PathBuf,
    /// The busybox bundle, its config with the sandbox mount added.
    runc: RuncBundle,
}

fn build_bundle(sb: &Sandbox) -> Bundle {
    let sandbox = sb.mkdir("sandbox");
    let mut runc = RuncBundle::new(sb, "bundle");
    // The whole sandbox appears where Mesos tasks expect it; relative
    // container paths land below it.
    runc.config["mounts"]
        .as_array_mut()
        .expect("runc spec writes a mounts array")
        .push(serde_json::json!({
            "destination": SANDBOX_IN_ROOTFS,
            "type": "bind",
            "source": sandbox.to_str().unwrap(),
            "options": ["rbind", "rprivate", "rw"],
        }));
    Bundle { sandbox, runc }
}

fn volume(source: &Path, container_path: &str, readonly: bool, id: &str) -> VolumeMount {
    let (root, target) = match container_path.strip_prefix('/') {
        Some(rel) => (TargetRoot::Rootfs, PathBuf::from(rel)),
        None => (TargetRoot::Sandbox, PathBuf::from(container_path)),
    };
    VolumeMount {
        source: source.to_path_buf(),
        source_root: None,
        root,
        target,
        container_path: container_path.to_string(),
        readonly,
        volume_id: Some(id.to_string()),
        provider_id: None,
        block: false,
        propagation: Default::default(),
        hardening: Default::default(),
    }
}

/// The bundled plugin's provider on `work`, its plugin process tracked by the sandbox.
async fn start_provider(
    sb: &Sandbox,
    work: &Path,
) -> (std::sync::Arc<StorageProvider>, Option<u32>) {
    let mut config = bundled_config(Path::new(plugin_bin()), work, "default", &[]);
    config.socket_dir = sb.join("s");
    config.ready_timeout = Duration::from_secs(10);
    let provider = StorageProvider::start(config)
        .await
        .expect("start provider");
    let plugin_pid = provider.plugin_pid();
    if let Some(pid) = plugin_pid {
        sb.track(pid);
    }
    (provider, plugin_pid)
}

/// Stops what [`start_provider`] started, then checks that no mount or loop device is left.
async fn stop_provider(
    sb: &Sandbox,
    provider: std::sync::Arc<StorageProvider>,
    plugin_pid: Option<u32>,
) {
    provider.shutdown(Duration::from_secs(5)).await;
    if let Some(pid) = plugin_pid {
        sb.untrack(pid);
    }
    sb.assert_no_mounts_under();
    sb.assert_no_loop_devices();
}

/// Writes config.json with `script` as the process and `prepared`'s mounts,
/// then runs the container to completion with `runc run` (no terminal).
fn run(sb: &Sandbox, bundle: &Bundle, name: &str, prepared: &OciPrepared, script: &str) -> RuncRun {
    let mut config = bundle.runc.config_for(script);
    prepared.apply_to_config(&mut config);
    let id = format!("csi-oci-{name}-{}", std::process::id());
    runc_run(sb, &bundle.runc, &id, &config, RUN_TIMEOUT)
}

/// `runc delete`, then `oci::cleanup`; returns how many mounts cleanup took down.
fn finish(bundle: &Bundle, r: RuncRun) -> usize {
    let out = r.guard.delete();
    assert!(
        out.status.success(),
        "runc delete {}: {}",
        r.guard.id(),
        String::from_utf8_lossy(&out.stderr)
    );
    oci::cleanup(
        &LinuxSyscall::new(),
        &ProcMountTable::new(),
        &bundle.sandbox,
    )
    .expect("oci cleanup")
}

fn assert_ran(r: &RuncRun) {
    assert_eq!(
        r.code,
        Some(0),
        "container failed\nstdout:\n{}\nstderr:\n{}",
        r.stdout,
        r.stderr
    );
}

#[test]
fn rw_volumes_absolute_and_relative_are_written_through() {
    require_tools();
    let sb = Sandbox::new("runc-rw");
    let bundle = build_bundle(&sb);
    let vol = sb.mkdir("vol");
    let cache = sb.mkdir("cache");
    fs::write(vol.join("seed"), "from the host\n").unwrap();
    let launch = LaunchInfo {
        mounts: vec![
            volume(&vol, "/data", false, "vol-data"),
            volume(&cache, "cache/x", false, "vol-cache"),
        ],
    };
    let sys = LinuxSyscall::new();
    let prepared = oci::prepare(&sys, &bundle.sandbox, &launch).expect("prepare");
    assert_eq!(
        prepared.host_binds,
        vec![bundle.sandbox.join("data"), bundle.sandbox.join("cache/x")]
    );
    let table = ProcMountTable::new();
    for host in &prepared.host_binds {
        assert!(
            table.is_mount_point(host).unwrap(),
            "{} bound",
            host.display()
        );
    }
    assert_eq!(
        prepared.mounts[1].destination,
        format!("{SANDBOX_IN_ROOTFS}/cache/x")
    );

    let r = run(
        &sb,
        &bundle,
        "rw",
        &prepared,
        "cat /data/seed && echo written-inside > /data/out \
         && echo relative > /mnt/mesos/sandbox/cache/x/rel && ls /mnt/mesos/sandbox",
    );
    assert_ran(&r);
    assert!(r.stdout.contains("from the host"), "stdout: {}", r.stdout);
    assert!(r.stdout.contains("data"), "sandbox listing: {}", r.stdout);
    assert_eq!(
        fs::read_to_string(vol.join("out")).unwrap(),
        "written-inside\n"
    );
    assert_eq!(fs::read_to_string(cache.join("rel")).unwrap(), "relative\n");

    assert_eq!(finish(&bundle, r), 2);
    sb.assert_no_mounts_under();
    // The data stays in the volumes, not in the sandbox's target directories.
    assert!(!bundle.sandbox.join("data/out").exists());
    assert!(vol.join("out").exists());
}

#[test]
fn readonly_volume_refuses_writes_inside_and_on_the_host() {
    require_tools();
    let sb = Sandbox::new("runc-ro");
    let bundle = build_bundle(&sb);
    let vol = sb.mkdir("vol");
    fs::write(vol.join("seed"), "keep\n").unwrap();
    let launch = LaunchInfo {
        mounts: vec![volume(&vol, "/data", true, "vol-ro")],
    };
    let sys = LinuxSyscall::new();
    let prepared = oci::prepare(&sys, &bundle.sandbox, &launch).expect("prepare");
    assert_eq!(prepared.mounts[0].options, vec!["rbind", "rprivate", "ro"]);
    // The host bind itself is read-only.
    let err = fs::write(bundle.sandbox.join("data/host-write"), "x").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EROFS), "{err}");
    assert!(ProcMountTable::new()
        .find(&bundle.sandbox.join("data"))
        .unwrap()
        .unwrap()
        .is_readonly());

    let r = run(
        &sb,
        &bundle,
        "ro",
        &prepared,
        "touch /data/inside 2>&1; echo rc=$?; echo more >> /data/seed 2>&1; echo rc2=$?; cat /data/seed",
    );
    assert_ran(&r);
    assert!(r.stdout.contains("rc=1"), "stdout: {}", r.stdout);
    assert!(r.stdout.contains("rc2=1"), "stdout: {}", r.stdout);
    assert!(
        r.stdout.contains("Read-only file system"),
        "stdout: {}",
        r.stdout
    );
    assert!(r.stdout.contains("keep"), "stdout: {}", r.stdout);
    assert!(!vol.join("inside").exists());
    assert!(!vol.join("host-write").exists());
    assert_eq!(fs::read_to_string(vol.join("seed")).unwrap(), "keep\n");

    assert_eq!(finish(&bundle, r), 1);
    sb.assert_no_mounts_under();
}

#[test]
fn a_volumes_hardening_flags_reach_the_runc_container_through_its_ro_remount() {
    require_tools();
    let sb = Sandbox::new("runc-hardening");
    let bundle = build_bundle(&sb);
    let hard = sb.mkdir("hard");
    let plain = sb.mkdir("plain");
    let launch = LaunchInfo {
        mounts: vec![
            VolumeMount {
                hardening: Hardening::of_mount_flags(&["nosuid", "noexec"]),
                ..volume(&hard, "/hard", true, "vol-hard")
            },
            volume(&plain, "/plain", true, "vol-plain"),
        ],
    };
    let sys = LinuxSyscall::new();
    let prepared = oci::prepare(&sys, &bundle.sandbox, &launch).expect("prepare");
    // runc remounts a read-only bind with the flags its options name, and only those: the asked
    // flags travel in the options, and are on the host bind too.
    assert_eq!(
        prepared.mounts[0].options,
        ["rbind", "rprivate", "ro", "nosuid", "noexec"]
    );
    let host = ProcMountTable::new()
        .find(&bundle.sandbox.join("hard"))
        .unwrap()
        .unwrap();
    for flag in ["nosuid", "nodev", "noexec"] {
        assert!(host.mount_options.iter().any(|o| o == flag), "{host:?}");
    }
    let r = run(
        &sb,
        &bundle,
        "hardening",
        &prepared,
        "awk '$5 == \"/hard\" || $5 == \"/plain\" { print $5, $6 }' /proc/self/mountinfo",
    );
    assert_ran(&r);
    let options = |target: &str| options_in(&r.stdout, target);
    let hard_opts = options("/hard");
    for flag in ["ro", "nosuid", "noexec"] {
        assert!(hard_opts.iter().any(|o| o == flag), "{}", r.stdout);
    }
    assert!(options("/plain").iter().any(|o| o == "ro"), "{}", r.stdout);
    let out = r.guard.delete();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Docker's `--mount` cannot name the flags: the hardened volume is given to it without
    // `readonly`, which Docker hands runc as a plain recursive bind (options `rbind`, `rprivate`).
    // That copy keeps every flag of the read-only host bind.
    assert!(
        !prepared.docker_args[1].contains("readonly"),
        "{:?}",
        prepared.docker_args
    );
    assert!(
        prepared.docker_args[3].contains("readonly"),
        "{:?}",
        prepared.docker_args
    );
    let mut as_docker = prepared.clone();
    as_docker.mounts[0].options = vec!["rbind".into(), "rprivate".into()];
    let r = run(
        &sb,
        &bundle,
        "hardening-docker",
        &as_docker,
        "awk '$5 == \"/hard\" { print $5, $6 }' /proc/self/mountinfo; touch /hard/x; echo rc=$?",
    );
    assert_ran(&r);
    let hard_opts = options_in(&r.stdout, "/hard");
    for flag in ["ro", "nosuid", "nodev", "noexec"] {
        assert!(hard_opts.iter().any(|o| o == flag), "{}", r.stdout);
    }
    assert!(r.stdout.contains("rc=1"), "{}", r.stdout);
    assert_eq!(finish(&bundle, r), 2);
    sb.assert_no_mounts_under();
}

/// The per-mount options of `target` in an awk listing of `$5, $6` of a mount table.
fn options_in(listing: &str, target: &str) -> Vec<String> {
    let line = listing
        .lines()
        .find(|l| l.starts_with(&format!("{target} ")))
        .unwrap_or_else(|| panic!("{target} mounted in the container: {listing}"));
    line[target.len() + 1..]
        .split(',')
        .map(str::to_string)
        .collect()
}

#[test]
fn symlink_planted_in_sandbox_keeps_the_bind_inside() {
    require_tools();
    let sb = Sandbox::new("runc-link");
    let bundle = build_bundle(&sb);
    let vol = sb.mkdir("vol");
    let outside = sb.mkdir("outside");
    // What a container could leave in its sandbox between runs.
    symlink("/etc", bundle.sandbox.join("data")).unwrap();
    symlink("../outside", bundle.sandbox.join("up")).unwrap();
    let table = ProcMountTable::new();
    let etc_mounts_before = table
        .mounts()
        .unwrap()
        .iter()
        .filter(|m| m.mount_point == Path::new("/etc"))
        .count();
    let vol2 = sb.mkdir("vol2");
    let launch = LaunchInfo {
        mounts: vec![
            volume(&vol, "/data", false, "vol-link"),
            volume(&vol2, "up/v", false, "vol-up"),
        ],
    };
    let sys = LinuxSyscall::new();
    let prepared = oci::prepare(&sys, &bundle.sandbox, &launch).expect("prepare");
    // "/etc" resolved with the sandbox as root, "../outside" clamped at it.
    assert_eq!(
        prepared.host_binds,
        vec![bundle.sandbox.join("etc"), bundle.sandbox.join("outside/v")]
    );
    for m in &prepared.mounts {
        assert!(
            Path::new(&m.source).starts_with(&bundle.sandbox),
            "{m:?} outside the sandbox"
        );
    }
    let etc_mounts_after = table
        .mounts()
        .unwrap()
        .iter()
        .filter(|m| m.mount_point == Path::new("/etc"))
        .count();
    assert_eq!(
        etc_mounts_after, etc_mounts_before,
        "nothing mounted on /etc"
    );
    assert!(!outside.join("v").exists(), "nothing created outside");
    assert_eq!(
        fs::read_link(bundle.sandbox.join("data")).unwrap(),
        Path::new("/etc")
    );

    let marker = format!("csi-oci-marker-{}", std::process::id());
    let r = run(
        &sb,
        &bundle,
        "link",
        &prepared,
        &format!("echo mine > /data/{marker} && echo up > /mnt/mesos/sandbox/up/v/f"),
    );
    assert_ran(&r);
    assert_eq!(fs::read_to_string(vol.join(&marker)).unwrap(), "mine\n");
    assert!(
        !Path::new("/etc").join(&marker).exists(),
        "host /etc untouched"
    );
    // The sandbox's `up` link is followed inside the container too; it
    // resolves to the bind, so the volume received the write.
    assert_eq!(fs::read_to_string(vol2.join("f")).unwrap(), "up\n");
    assert!(!outside.join("v").exists());

    assert_eq!(finish(&bundle, r), 2);
    sb.assert_no_mounts_under();
}

#[test]
fn cleanup_after_a_failed_prepare_finds_nothing_left() {
    require_tools();
    let sb = Sandbox::new("runc-fail");
    let bundle = build_bundle(&sb);
    let vol = sb.mkdir("vol");
    let launch = LaunchInfo {
        mounts: vec![
            volume(&vol, "/a", false, "vol-a"),
            volume(&sb.join("missing"), "/b", false, "vol-missing"),
        ],
    };
    let err = oci::prepare(&LinuxSyscall::new(), &bundle.sandbox, &launch).unwrap_err();
    let msg = err.to_string();
    assert!(msg.starts_with("volume vol-missing: stat source "), "{msg}");
    sb.assert_no_mounts_under();
    assert_eq!(
        oci::cleanup(
            &LinuxSyscall::new(),
            &ProcMountTable::new(),
            &bundle.sandbox
        )
        .unwrap(),
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn csi_volume_is_bound_through_runc() {
    require_tools();
    let sb = Sandbox::new("runc-csi");
    let bundle = build_bundle(&sb);
    let work = sb.mkdir("work");
    let (provider, plugin_pid) = start_provider(&sb, &work).await;
    let res = provider
        .create_volume(CreateSpec::new("v", 16 << 20))
        .await
        .expect("create volume");
    let id = res.source_id().expect("volume id").to_string();
    let mount_point = provider.publish(&id, "c1").await.expect("publish");
    let table = ProcMountTable::new();
    assert!(table.is_mount_point(&mount_point).unwrap());

    let launch = LaunchInfo {
        mounts: vec![VolumeMount {
            source: mount_point.clone(),
            source_root: None,
            root: TargetRoot::Rootfs,
            target: PathBuf::from("data"),
            container_path: "/data".to_string(),
            readonly: false,
            volume_id: Some(id.clone()),
            provider_id: Some(provider.id().to_string()),
            block: false,
            propagation: Default::default(),
            hardening: Default::default(),
        }],
    };
    let sys = LinuxSyscall::new();
    let prepared = oci::prepare(&sys, &bundle.sandbox, &launch).expect("prepare");
    assert_eq!(prepared.host_binds, vec![bundle.sandbox.join("data")]);
    assert!(
        prepared.docker_args[1]
            .contains(&format!("source={}", bundle.sandbox.join("data").display())),
        "{:?}",
        prepared.docker_args
    );

    let r = run(
        &sb,
        &bundle,
        "csi",
        &prepared,
        "echo on-the-csi-volume > /data/hello && ls /data",
    );
    assert_ran(&r);
    assert!(r.stdout.contains("hello"), "stdout: {}", r.stdout);
    assert_eq!(
        fs::read_to_string(mount_point.join("hello")).unwrap(),
        "on-the-csi-volume\n"
    );

    assert_eq!(finish(&bundle, r), 1);
    // Only the container's bind went away: the published volume stays.
    assert!(table.is_mount_point(&mount_point).unwrap());
    assert!(table.mounts_under(&bundle.sandbox).unwrap().is_empty());

    provider.release(&id, "c1").await.expect("release");
    assert!(!table.is_mount_point(&mount_point).unwrap());
    provider.destroy_volume(&id).await.expect("destroy volume");
    stop_provider(&sb, provider, plugin_pid).await;
}

const CLI: &str = env!("CARGO_BIN_EXE_csi-isolator");

/// `csi-isolator serve` on `<sb>/work`, killed when dropped.
struct Serve {
    child: std::process::Child,
    socket: PathBuf,
}

impl Serve {
    fn start(sb: &Sandbox) -> Serve {
        let socket = sb.join("isolator.sock");
        let mut cmd = csi_isolator_testing::isolator_command(CLI, &sb.join("work"));
        cmd.arg("serve")
            .arg("--socket")
            .arg(&socket)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit());
        let mut child = sb.spawn(&mut cmd).expect("start csi-isolator serve");
        csi_isolator_testing::wait_for_serve_ready(&mut child, RUN_TIMEOUT);
        Serve { child, socket }
    }

    async fn client(&self) -> IsolatorClient<tonic::transport::Channel> {
        IsolatorClient::new(
            csi_isolator::csi::transport::connect_unix(&self.socket)
                .await
                .expect("connect to serve"),
        )
    }

    /// The end of a test: every volume is released (CREATED), is destroyed, and serve stops
    /// cleanly with no mount and no loop device left.
    async fn destroy_released_and_stop(
        self,
        sb: &Sandbox,
        mut c: IsolatorClient<tonic::transport::Channel>,
    ) {
        let st = c
            .status(proto::StatusRequest {})
            .await
            .expect("Status")
            .into_inner();
        for v in &st.volumes {
            assert_eq!(v.state, "CREATED", "released on last use: {v:?}");
            c.destroy_volume(proto::DestroyVolumeRequest {
                volume_id: v.volume_id.clone(),
                ..Default::default()
            })
            .await
            .expect("DestroyVolume");
        }
        drop(c);
        self.stop(sb);
        sb.assert_no_mounts_under();
        sb.assert_no_loop_devices();
    }

    /// SIGTERM and a clean exit.
    fn stop(mut self, sb: &Sandbox) {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .unwrap();
        let status = self.child.wait().unwrap();
        sb.untrack(self.child.id());
        assert!(status.success(), "serve exited with {status:?}");
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

/// The Docker/OCI path through `serve`: PrepareOci publishes the volume and binds it into the
/// sandbox on the host, runc runs a container given the answer's `mounts` entries, the container
/// writes through them; Cleanup takes the binds down and releases the volume; nothing is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_prepare_oci_binds_volumes_for_runc() {
    require_tools();
    let sb = Sandbox::new("runc-serve");
    let bundle = build_bundle(&sb);
    let serve = Serve::start(&sb);
    let mut c = serve.client().await;
    let mut resources = Vec::new();
    for (name, path) in [("abs", "/data"), ("rel", "work/rel")] {
        let v = c
            .create_volume(proto::CreateVolumeRequest {
                name: name.into(),
                capacity_bytes: 16 << 20,
                container_path: path.into(),
                ..Default::default()
            })
            .await
            .expect("CreateVolume")
            .into_inner();
        resources.push(v.resource_json);
    }
    let request = |id: &str| proto::PrepareRequest {
        container_id: id.into(),
        config: Some(proto::ContainerConfig {
            resources_json: format!("[{}]", resources.join(",")),
            sandbox: bundle.sandbox.to_str().unwrap().into(),
            rootfs: bundle.runc.rootfs.to_str().unwrap().into(),
            ..Default::default()
        }),
    };
    let info = c
        .prepare_oci(request("c1"))
        .await
        .expect("PrepareOci")
        .into_inner();
    let destinations: Vec<&str> = info.mounts.iter().map(|m| m.destination.as_str()).collect();
    assert_eq!(
        destinations,
        ["/data".to_string(), format!("{SANDBOX_IN_ROOTFS}/work/rel")]
    );
    let table = ProcMountTable::new();
    for m in &info.mounts {
        let source = Path::new(&m.source);
        assert!(
            source.starts_with(&bundle.sandbox),
            "{} is not in the sandbox",
            m.source
        );
        assert!(
            table.is_mount_point(source).unwrap(),
            "{} not bound",
            m.source
        );
        assert_eq!(m.r#type, "bind");
        assert_eq!(m.options, ["rbind", "rprivate", "rw"]);
    }
    assert_eq!(info.docker_args.len(), 4);
    assert_eq!(info.docker_args[0], "--mount");
    // The same container id again is refused: it is prepared already.
    let again = c
        .prepare_oci(request("c1"))
        .await
        .expect_err("a second PrepareOci");
    assert_eq!(again.code(), tonic::Code::AlreadyExists, "{again:?}");

    let prepared = OciPrepared {
        host_binds: Vec::new(),
        mounts: info
            .mounts
            .iter()
            .map(|m| oci::OciMount {
                destination: m.destination.clone(),
                kind: m.r#type.clone(),
                source: m.source.clone(),
                options: m.options.clone(),
            })
            .collect(),
        docker_args: info.docker_args.clone(),
        devices: Vec::new(),
    };
    let script = format!(
        "echo abs > /data/hello && echo rel > {SANDBOX_IN_ROOTFS}/work/rel/hello && cat /data/hello"
    );
    let r = run(&sb, &bundle, "serve", &prepared, &script);
    assert_ran(&r);
    assert_eq!(r.stdout.trim(), "abs");
    let out = r.guard.delete();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The data is in the volumes, seen through the published mount points.
    let st = c
        .status(proto::StatusRequest {})
        .await
        .expect("Status")
        .into_inner();
    assert_eq!(st.volumes.len(), 2);
    for v in &st.volumes {
        assert_eq!(v.state, "PUBLISHED", "{v:?}");
        assert_eq!(
            fs::read_to_string(Path::new(&v.mount_point).join("hello")).unwrap(),
            format!("{}\n", v.name)
        );
    }

    c.cleanup(proto::CleanupRequest {
        container_id: "c1".into(),
    })
    .await
    .expect("Cleanup");
    assert!(table.mounts_under(&bundle.sandbox).unwrap().is_empty());
    serve.destroy_released_and_stop(&sb, c).await;
}

/// rslave through runc: the OCI entry carries `rslave` (Docker's value `bind-propagation=rslave`), the
/// host bind stays a peer of the (now shared) volume mount point, and runc's copy, under its default
/// rootfsPropagation, follows it: a tmpfs mounted on the host under the volume while the container
/// runs is seen inside; beside it, a private volume sees nothing of the same kind of mount.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_later_host_mount_reaches_an_rslave_volume_through_runc_and_not_a_private_one() {
    require_tools();
    let sb = Sandbox::new("runc-rslave");
    let bundle = build_bundle(&sb);
    let work = sb.mkdir("work");
    let (provider, plugin_pid) = start_provider(&sb, &work).await;
    let mut mounts = Vec::new();
    let mut points = Vec::new();
    for (name, propagation) in [
        ("slave", VolumePropagation::Rslave),
        ("private", VolumePropagation::Private),
    ] {
        let res = provider
            .create_volume(CreateSpec::new(name, 16 << 20))
            .await
            .expect("create volume");
        let id = res.source_id().expect("volume id").to_string();
        let mount_point = provider.publish(&id, "c1").await.expect("publish");
        fs::create_dir(mount_point.join("sub")).unwrap();
        mounts.push(VolumeMount {
            propagation,
            provider_id: Some(provider.id().to_string()),
            ..volume(&mount_point, &format!("/{name}"), false, &id)
        });
        points.push((id, mount_point));
    }
    let sys = LinuxSyscall::new();
    let prepared = oci::prepare(&sys, &bundle.sandbox, &LaunchInfo { mounts }).expect("prepare");
    assert_eq!(prepared.mounts[0].options, ["rbind", "rslave", "rw"]);
    assert_eq!(prepared.mounts[1].options, ["rbind", "rprivate", "rw"]);
    assert!(
        prepared.docker_args[1].ends_with(",bind-propagation=rslave"),
        "{:?}",
        prepared.docker_args
    );
    assert!(!prepared.docker_args[3].contains("bind-propagation"));

    let (slave_mp, private_mp) = (points[0].1.clone(), points[1].1.clone());
    let nested: Vec<PathBuf> = vec![slave_mp.join("sub"), private_mp.join("sub")];
    let r = std::thread::scope(|scope| {
        let running = scope.spawn(|| {
            run(
                &sb,
                &bundle,
                "rslave",
                &prepared,
                "touch /slave/ready; while [ ! -e /slave/go ]; do sleep 0.05; done; \
                 cat /slave/sub/marker; echo; cat /private/sub/marker; echo end",
            )
        });
        let deadline = std::time::Instant::now() + RUN_TIMEOUT;
        while !slave_mp.join("ready").exists() {
            assert!(
                std::time::Instant::now() < deadline,
                "the container never started"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        // The container runs: these mounts are "later" ones.
        for at in &nested {
            nix::mount::mount(
                Some("tmpfs"),
                at,
                Some("tmpfs"),
                nix::mount::MsFlags::empty(),
                Some("size=1M"),
            )
            .unwrap();
            fs::write(at.join("marker"), "from-the-host").unwrap();
        }
        fs::write(slave_mp.join("go"), "").unwrap();
        running.join().unwrap()
    });
    for at in &nested {
        nix::mount::umount2(at, nix::mount::MntFlags::MNT_DETACH).unwrap();
    }
    assert_ran(&r);
    assert_eq!(
        r.stdout, "from-the-host\nend\n",
        "rslave sees the host's later mount, private does not; stderr: {}",
        r.stderr
    );
    assert_eq!(finish(&bundle, r), 2);
    let table = ProcMountTable::new();
    for (id, mount_point) in &points {
        provider.release(id, "c1").await.expect("release");
        assert!(!table.is_mount_point(mount_point).unwrap());
        provider.destroy_volume(id).await.expect("destroy volume");
    }
    stop_provider(&sb, provider, plugin_pid).await;
}

/// serve carries a resource's `disk.volume.mount_propagation` through: Prepare's mounts name it
/// (`VolumeMount.propagation`, field 9), PrepareOci's entries carry `rshared` and Docker's
/// `bind-propagation=rshared`, and an unknown mode is refused as the caller's error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_carries_mount_propagation_to_prepare_and_prepare_oci() {
    require_tools();
    let sb = Sandbox::new("runc-serve-prop");
    let bundle = build_bundle(&sb);
    let serve = Serve::start(&sb);
    let mut c = serve.client().await;
    let mut resources = Vec::new();
    for (name, path, mode) in [
        ("slave", "/slave", "HOST_TO_CONTAINER"),
        ("shared", "/shared", "BIDIRECTIONAL"),
        ("plain", "/plain", ""),
    ] {
        let v = c
            .create_volume(proto::CreateVolumeRequest {
                name: name.into(),
                capacity_bytes: 16 << 20,
                container_path: path.into(),
                ..Default::default()
            })
            .await
            .expect("CreateVolume")
            .into_inner();
        let mut r: serde_json::Value = serde_json::from_str(&v.resource_json).unwrap();
        if !mode.is_empty() {
            r["disk"]["volume"]["mount_propagation"] = serde_json::json!({ "mode": mode });
        }
        resources.push(r);
    }
    let request =
        |id: &str, resources: &[serde_json::Value], sandbox: &Path| proto::PrepareRequest {
            container_id: id.into(),
            config: Some(proto::ContainerConfig {
                resources_json: serde_json::to_string(resources).unwrap(),
                sandbox: sandbox.to_str().unwrap().into(),
                rootfs: bundle.runc.rootfs.to_str().unwrap().into(),
                ..Default::default()
            }),
        };
    let ns_sandbox = sb.mkdir("ns-sandbox");
    let info = c
        .prepare(request("ns", &resources, &ns_sandbox))
        .await
        .expect("Prepare")
        .into_inner();
    let got: Vec<(&str, &str)> = info
        .mounts
        .iter()
        .map(|m| (m.container_path.as_str(), m.propagation.as_str()))
        .collect();
    assert_eq!(
        got,
        [
            ("/slave", "rslave"),
            ("/shared", "rshared"),
            ("/plain", "private")
        ]
    );
    let oci = c
        .prepare_oci(request("oci", &resources, &bundle.sandbox))
        .await
        .expect("PrepareOci")
        .into_inner();
    let options: Vec<&str> = oci.mounts.iter().map(|m| m.options[1].as_str()).collect();
    assert_eq!(options, ["rslave", "rshared", "rprivate"]);
    assert!(
        oci.docker_args[3].ends_with(",bind-propagation=rshared"),
        "{:?}",
        oci.docker_args
    );

    let mut bad = resources[0].clone();
    bad["disk"]["volume"]["mount_propagation"]["mode"] = "SLAVE".into();
    let err = c
        .prepare(request("bad", &[bad], &sb.mkdir("bad-sandbox")))
        .await
        .expect_err("an unknown propagation");
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    assert!(
        err.message().contains("mount_propagation"),
        "{}",
        err.message()
    );

    for id in ["ns", "oci"] {
        c.cleanup(proto::CleanupRequest {
            container_id: id.into(),
        })
        .await
        .expect("Cleanup");
    }
    serve.destroy_released_and_stop(&sb, c).await;
}

/// The runtime-spec entries a prepared block volume gives runc, as a container sees them.
fn block_script(write: bool) -> String {
    let read = "dd if=/blockdev bs=512 skip=8 count=1 2>/dev/null | head -c 15";
    if write {
        format!(
            "test -b /blockdev && printf written-by-runc | dd of=/blockdev bs=512 seek=8 conv=notrunc,fsync 2>/dev/null && {read}"
        )
    } else {
        format!("test -b /blockdev && {read}")
    }
}

/// A block volume through runc: no host bind, the device given by number (`linux.devices` and
/// one `linux.resources.devices` rule); a container opens, writes and reads it at its path, a
/// second container reads what the first wrote; a container without the entries cannot open
/// the device even with the node in its sandbox.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_volume_is_a_device_through_runc() {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    require_tools();
    let sb = Sandbox::new("runc-block");
    let bundle = build_bundle(&sb);
    let work = sb.mkdir("work");
    let (provider, plugin_pid) = start_provider(&sb, &work).await;
    let mut spec = CreateSpec::new("b", 16 << 20);
    spec.capability.access_type = csi_isolator::provider::AccessType::Block;
    let res = provider.create_volume(spec).await.expect("create volume");
    let id = res.source_id().expect("volume id").to_string();
    let device = provider.publish(&id, "c1").await.expect("publish");
    let meta = fs::metadata(&device).unwrap();
    assert!(meta.file_type().is_block_device(), "{meta:?}");

    let mut mount = volume(&device, "/blockdev", false, &id);
    mount.block = true;
    let launch = LaunchInfo {
        mounts: vec![mount],
    };
    let sys = LinuxSyscall::new();
    let prepared = oci::prepare(&sys, &bundle.sandbox, &launch).expect("prepare");
    assert!(prepared.host_binds.is_empty() && prepared.mounts.is_empty());
    assert_eq!(
        prepared.devices,
        [oci::OciDevice {
            path: "/blockdev".into(),
            major: nix::sys::stat::major(meta.rdev()),
            minor: nix::sys::stat::minor(meta.rdev()),
            access: "rw".into(),
        }]
    );
    assert_eq!(
        prepared.docker_args,
        [
            "--device".to_string(),
            format!("{}:/blockdev:rw", device.display())
        ]
    );

    let r = run(&sb, &bundle, "block-w", &prepared, &block_script(true));
    assert_ran(&r);
    assert_eq!(r.stdout, "written-by-runc");
    assert_eq!(finish(&bundle, r), 0);
    let r = run(&sb, &bundle, "block-r", &prepared, &block_script(false));
    assert_ran(&r);
    assert_eq!(r.stdout, "written-by-runc");
    assert_eq!(finish(&bundle, r), 0);

    // Without the entries, a node of the same device (made where the container can reach it) is
    // refused by runc's default device rules: the entries are what lets a container in.
    nix::sys::stat::mknod(
        &bundle.sandbox.join("node"),
        nix::sys::stat::SFlag::S_IFBLK,
        nix::sys::stat::Mode::from_bits_truncate(0o666),
        meta.rdev(),
    )
    .unwrap();
    let denied = format!(
        "dd if={SANDBOX_IN_ROOTFS}/node bs=512 count=1 of=/dev/null 2>&1 && echo opened || echo refused"
    );
    let r = run(&sb, &bundle, "block-none", &OciPrepared::default(), &denied);
    assert_ran(&r);
    // EPERM is the device cgroup's answer (nodev would be EACCES).
    assert!(
        r.stdout.contains("refused") && r.stdout.contains("Operation not permitted"),
        "{}",
        r.stdout
    );
    assert_eq!(finish(&bundle, r), 0);
    fs::remove_file(bundle.sandbox.join("node")).unwrap();

    provider.release(&id, "c1").await.expect("release");
    provider.destroy_volume(&id).await.expect("destroy volume");
    stop_provider(&sb, provider, plugin_pid).await;
}

/// A block volume through `serve`: CreateVolume with `access_type` "block" (an unknown one is
/// refused), Status says "block", PrepareOci answers the device (no mount, no host bind) and
/// runc's containers write and then read it; Cleanup releases it; nothing is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_prepare_oci_gives_a_block_volume_as_a_device() {
    require_tools();
    let sb = Sandbox::new("runc-serve-block");
    let bundle = build_bundle(&sb);
    let serve = Serve::start(&sb);
    let mut c = serve.client().await;
    let create = |access_type: &str| proto::CreateVolumeRequest {
        name: "blk".into(),
        capacity_bytes: 16 << 20,
        container_path: "/blockdev".into(),
        access_type: access_type.into(),
        ..Default::default()
    };
    let refused = c
        .create_volume(create("raw"))
        .await
        .expect_err("unknown access type");
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
    let v = c
        .create_volume(create("block"))
        .await
        .expect("CreateVolume")
        .into_inner();
    assert!(
        v.resource_json.contains(r#""type":"BLOCK""#),
        "{}",
        v.resource_json
    );
    let request = |id: &str| proto::PrepareRequest {
        container_id: id.into(),
        config: Some(proto::ContainerConfig {
            resources_json: format!("[{}]", v.resource_json),
            sandbox: bundle.sandbox.to_str().unwrap().into(),
            rootfs: bundle.runc.rootfs.to_str().unwrap().into(),
            ..Default::default()
        }),
    };
    for (container, write) in [("c1", true), ("c2", false)] {
        let info = c
            .prepare_oci(request(container))
            .await
            .expect("PrepareOci")
            .into_inner();
        assert!(info.mounts.is_empty(), "{:?}", info.mounts);
        assert_eq!(info.devices.len(), 1, "{:?}", info.devices);
        assert_eq!(info.devices[0].path, "/blockdev");
        assert_eq!(info.docker_args[0], "--device");
        let prepared = OciPrepared {
            devices: info
                .devices
                .iter()
                .map(|d| oci::OciDevice {
                    path: d.path.clone(),
                    major: d.major,
                    minor: d.minor,
                    access: d.access.clone(),
                })
                .collect(),
            ..OciPrepared::default()
        };
        let r = run(&sb, &bundle, container, &prepared, &block_script(write));
        assert_ran(&r);
        assert_eq!(r.stdout, "written-by-runc", "{container}: {}", r.stderr);
        let out = r.guard.delete();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        // runc made the node in the rootfs, which this bundle shares between its containers
        // (an engine gives each container a fresh one): the next publish may attach another
        // loop device, so the next container must get a node of its own numbers.
        fs::remove_file(bundle.runc.rootfs.join("blockdev")).unwrap();
        let st = c
            .status(proto::StatusRequest {})
            .await
            .expect("Status")
            .into_inner();
        assert_eq!(st.volumes.len(), 1);
        assert_eq!(st.volumes[0].access_type, "block");
        assert_eq!(st.volumes[0].state, "PUBLISHED");
        c.cleanup(proto::CleanupRequest {
            container_id: container.into(),
        })
        .await
        .expect("Cleanup");
    }
    c.destroy_volume(proto::DestroyVolumeRequest {
        volume_id: v.volume_id.clone(),
        ..Default::default()
    })
    .await
    .expect("DestroyVolume");
    drop(c);
    serve.stop(&sb);
    sb.assert_no_mounts_under();
    sb.assert_no_loop_devices();
}

/// The runtime-spec entries of serve's PrepareOci answer as an [`OciPrepared`] (the answer's
/// `rootfs_propagation` is derived again from the entries' options).
fn prepared_from(info: &proto::OciLaunchInfo) -> OciPrepared {
    OciPrepared {
        mounts: info
            .mounts
            .iter()
            .map(|m| oci::OciMount {
                destination: m.destination.clone(),
                kind: m.r#type.clone(),
                source: m.source.clone(),
                options: m.options.clone(),
            })
            .collect(),
        docker_args: info.docker_args.clone(),
        ..OciPrepared::default()
    }
}

/// A resource of serve's CreateVolume answer with `disk.volume.mount_propagation` set (`""`: none).
async fn create_with_propagation(
    c: &mut IsolatorClient<tonic::transport::Channel>,
    name: &str,
    container_path: &str,
    mode: &str,
) -> serde_json::Value {
    let v = c
        .create_volume(proto::CreateVolumeRequest {
            name: name.into(),
            capacity_bytes: 16 << 20,
            container_path: container_path.into(),
            ..Default::default()
        })
        .await
        .expect("CreateVolume")
        .into_inner();
    let mut r: serde_json::Value = serde_json::from_str(&v.resource_json).unwrap();
    if !mode.is_empty() {
        r["disk"]["volume"]["mount_propagation"] = serde_json::json!({ "mode": mode });
    }
    r
}

/// serve's published mount point of each volume, by name.
async fn mount_points(
    c: &mut IsolatorClient<tonic::transport::Channel>,
) -> std::collections::HashMap<String, PathBuf> {
    c.status(proto::StatusRequest {})
        .await
        .expect("Status")
        .into_inner()
        .volumes
        .into_iter()
        .filter(|v| !v.mount_point.is_empty())
        .map(|v| (v.name, PathBuf::from(v.mount_point)))
        .collect()
}

/// Gives the bundle's process CAP_SYS_ADMIN (the container mounts a tmpfs of its own).
fn with_sys_admin(config: &mut serde_json::Value) {
    for set in ["bounding", "effective", "permitted"] {
        config["process"]["capabilities"][set]
            .as_array_mut()
            .expect("runc spec lists capabilities")
            .push("CAP_SYS_ADMIN".into());
    }
}

/// Waits (bounded) for `path` to exist.
fn wait_for_file(path: &Path, what: &str) {
    let deadline = std::time::Instant::now() + RUN_TIMEOUT;
    while !path.exists() {
        assert!(std::time::Instant::now() < deadline, "{what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Mounts a 1 MiB tmpfs at `at` holding `marker` (a driver's nested mount made on the host).
fn nested_tmpfs(at: &Path) {
    nix::mount::mount(
        Some("tmpfs"),
        at,
        Some("tmpfs"),
        nix::mount::MsFlags::empty(),
        Some("size=1M"),
    )
    .unwrap_or_else(|e| panic!("mount a tmpfs at {}: {e}", at.display()));
    fs::write(at.join("marker"), "from-the-host").unwrap();
}

/// Propagation through serve's PrepareOci and runc, all three modes in one container: a tmpfs the
/// container mounts under its rshared volume appears under the volume's host mount point (the
/// answer's `rootfs_propagation` makes runc's copy a peer, not a slave), a tmpfs mounted on the host
/// under the rslave volume while the container runs is seen inside, the same under the private one
/// is not; the container's mount is swept when the volume is released (nothing left).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_prepare_oci_propagation_reaches_runc_both_ways() {
    require_tools();
    let sb = Sandbox::new("runc-serve-rshared");
    let bundle = build_bundle(&sb);
    let serve = Serve::start(&sb);
    let mut c = serve.client().await;
    let mut resources = Vec::new();
    for (name, mode) in [
        ("shared", "BIDIRECTIONAL"),
        ("slave", "HOST_TO_CONTAINER"),
        ("plain", ""),
    ] {
        resources.push(create_with_propagation(&mut c, name, &format!("/{name}"), mode).await);
    }
    let info = c
        .prepare_oci(proto::PrepareRequest {
            container_id: "c1".into(),
            config: Some(proto::ContainerConfig {
                resources_json: serde_json::to_string(&resources).unwrap(),
                sandbox: bundle.sandbox.to_str().unwrap().into(),
                rootfs: bundle.runc.rootfs.to_str().unwrap().into(),
                ..Default::default()
            }),
        })
        .await
        .expect("PrepareOci")
        .into_inner();
    assert_eq!(info.rootfs_propagation, "rshared");
    let prepared = prepared_from(&info);
    let mps = mount_points(&mut c).await;
    let (shared_mp, slave_mp, plain_mp) = (&mps["shared"], &mps["slave"], &mps["plain"]);
    fs::create_dir(shared_mp.join("inner")).unwrap();
    fs::create_dir(slave_mp.join("sub")).unwrap();
    fs::create_dir(plain_mp.join("sub")).unwrap();

    let mut config = bundle.runc.config_for(
        "mount -t tmpfs tmpfs /shared/inner && echo from-the-container > /shared/inner/m && \
         touch /slave/ready && while [ ! -e /slave/go ]; do sleep 0.05; done; \
         cat /slave/sub/marker; echo; cat /plain/sub/marker; echo end",
    );
    with_sys_admin(&mut config);
    prepared.apply_to_config(&mut config);
    assert_eq!(config["linux"]["rootfsPropagation"], "rshared");
    let id = format!("csi-oci-rshared-{}", std::process::id());
    let nested = [slave_mp.join("sub"), plain_mp.join("sub")];
    let (r, container_mount) = std::thread::scope(|scope| {
        let running = scope.spawn(|| runc_run(&sb, &bundle.runc, &id, &config, RUN_TIMEOUT));
        let ready = slave_mp.join("ready");
        while !ready.exists() {
            assert!(
                !running.is_finished(),
                "the container ended before it was ready"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        // The container's own mount, seen on the host under the volume's mount point.
        let container_mount = fs::read_to_string(shared_mp.join("inner/m"));
        // The container runs: these mounts are "later" ones.
        for at in &nested {
            nested_tmpfs(at);
        }
        fs::write(slave_mp.join("go"), "").unwrap();
        (running.join().unwrap(), container_mount)
    });
    for at in &nested {
        nix::mount::umount2(at, nix::mount::MntFlags::MNT_DETACH).unwrap();
    }
    assert_ran(&r);
    assert_eq!(
        container_mount.ok().as_deref(),
        Some("from-the-container\n"),
        "rshared: the container's mount reaches the host"
    );
    assert_eq!(
        r.stdout, "from-the-host\nend\n",
        "rslave sees the host's later mount, private does not; stderr: {}",
        r.stderr
    );
    let out = r.guard.delete();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    c.cleanup(proto::CleanupRequest {
        container_id: "c1".into(),
    })
    .await
    .expect("Cleanup");
    let table = ProcMountTable::new();
    assert!(
        !table.is_mount_point(&shared_mp.join("inner")).unwrap(),
        "the container's mount was swept at release"
    );
    serve.destroy_released_and_stop(&sb, c).await;
}

/// The pid of the running runc container `id` (`runc state`).
fn runc_pid(bundle: &RuncBundle, id: &str) -> u32 {
    let out = std::process::Command::new("runc")
        .arg("--root")
        .arg(&bundle.state)
        .args(["state", id])
        .output()
        .expect("run `runc state`");
    assert!(
        out.status.success(),
        "runc state {id}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let state: serde_json::Value = serde_json::from_slice(&out.stdout).expect("runc state JSON");
    state["pid"].as_u64().expect("runc state has a pid") as u32
}

/// The update path with rslave, through serve and runc: a container started from PrepareOci with one
/// volume is Isolated by its runc pid, then gains an rslave volume by Update; a tmpfs mounted on the
/// host under that volume's mount point afterwards is seen inside. Cleanup leaves nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_update_gives_a_running_runc_container_an_rslave_volume() {
    require_tools();
    let sb = Sandbox::new("runc-update-rslave");
    let bundle = build_bundle(&sb);
    let serve = Serve::start(&sb);
    let mut c = serve.client().await;
    let base = create_with_propagation(&mut c, "base", "/data", "").await;
    let slave = create_with_propagation(&mut c, "slave", "/slave", "HOST_TO_CONTAINER").await;
    let info = c
        .prepare_oci(proto::PrepareRequest {
            container_id: "c1".into(),
            config: Some(proto::ContainerConfig {
                resources_json: serde_json::to_string(&[&base]).unwrap(),
                sandbox: bundle.sandbox.to_str().unwrap().into(),
                rootfs: bundle.runc.rootfs.to_str().unwrap().into(),
                ..Default::default()
            }),
        })
        .await
        .expect("PrepareOci")
        .into_inner();
    assert_eq!(info.rootfs_propagation, "");
    let mut config = bundle.runc.config_for(
        "touch /data/ready; while [ ! -e /slave/go ]; do sleep 0.05; done; \
         cat /slave/sub/marker; echo; echo end",
    );
    prepared_from(&info).apply_to_config(&mut config);
    let data_mp = mount_points(&mut c).await["base"].clone();
    let id = format!("csi-oci-update-{}", std::process::id());
    let rt = tokio::runtime::Handle::current();
    let (r, slave_mp) = tokio::task::block_in_place(|| {
        std::thread::scope(|scope| {
            let running = scope.spawn(|| runc_run(&sb, &bundle.runc, &id, &config, RUN_TIMEOUT));
            wait_for_file(&data_mp.join("ready"), "the container never started");
            let pid = runc_pid(&bundle.runc, &id);
            let slave_mp = rt.block_on(async {
                c.isolate(proto::IsolateRequest {
                    container_id: "c1".into(),
                    pid,
                })
                .await
                .expect("Isolate");
                c.update(proto::UpdateRequest {
                    container_id: "c1".into(),
                    resources_json: serde_json::to_string(&[&base, &slave]).unwrap(),
                })
                .await
                .expect("Update");
                mount_points(&mut c).await["slave"].clone()
            });
            // The container runs with its new volume: this mount is a "later" one.
            fs::create_dir(slave_mp.join("sub")).unwrap();
            nested_tmpfs(&slave_mp.join("sub"));
            fs::write(slave_mp.join("go"), "").unwrap();
            (running.join().unwrap(), slave_mp)
        })
    });
    nix::mount::umount2(&slave_mp.join("sub"), nix::mount::MntFlags::MNT_DETACH).unwrap();
    assert_ran(&r);
    assert_eq!(
        r.stdout, "from-the-host\nend\n",
        "rslave by update sees the host's later mount; stderr: {}",
        r.stderr
    );
    let out = r.guard.delete();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    c.cleanup(proto::CleanupRequest {
        container_id: "c1".into(),
    })
    .await
    .expect("Cleanup");
    serve.destroy_released_and_stop(&sb, c).await;
}

/// The mount flags xfs tests ask for, as `mount-flags=` and as CreateVolume's `mount_flags`.
const XFS_FLAGS: [&str; 4] = ["noatime", "nosuid", "nodev", "noexec"];

/// The `/proc/self/mountinfo` line (as a container printed it) whose mount point ends with
/// `suffix`: its mount options and its fs type.
fn mountinfo_entry(mountinfo: &str, suffix: &str) -> (Vec<String>, String) {
    mountinfo
        .lines()
        .find_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let fields: Vec<&str> = left.split(' ').collect();
            if !fields.get(4)?.ends_with(suffix) {
                return None;
            }
            let options = fields.get(5)?.split(',').map(str::to_string).collect();
            Some((options, right.split(' ').next()?.to_string()))
        })
        .unwrap_or_else(|| panic!("no mount at …{suffix} in:\n{mountinfo}"))
}

/// Asserts the entry is xfs with every one of [`XFS_FLAGS`].
fn assert_xfs_with_flags(mountinfo: &str, suffix: &str) {
    let (options, fs_type) = mountinfo_entry(mountinfo, suffix);
    assert_eq!(fs_type, "xfs", "{options:?}");
    for flag in XFS_FLAGS {
        assert!(
            options.iter().any(|o| o == flag),
            "{flag} missing at …{suffix}: {options:?}"
        );
    }
}

/// `fs-type=xfs` through the namespace launcher: `csi-isolator run --mount
/// source=x,target=x,size=16M,fs-type=xfs,mount-flags=…` gets a volume of xfs' minimum size
/// (mkfs.xfs makes nothing under 300 MiB), and the container's `/proc/self/mountinfo` shows it xfs,
/// noatime, nosuid, nodev and noexec; the workload writes it; nothing is left.
#[test]
fn xfs_with_mount_flags_through_run() {
    require_root();
    let sb = Sandbox::new("run-xfs");
    let work = sb.join("work");
    let mount = format!(
        "source=x,target=x,size=16M,fs-type=xfs,mount-flags={}",
        XFS_FLAGS.join(":")
    );
    let out = csi_isolator_testing::isolator_command(CLI, &work)
        .args(["run", "--mount", &mount, "--"])
        .args([
            "sh",
            "-c",
            "echo on-xfs > x/f && cat x/f && cat /proc/self/mountinfo",
        ])
        .output()
        .expect("run csi-isolator run");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.starts_with("on-xfs\n"), "{stdout}");
    assert_xfs_with_flags(&stdout, "/x");
    let listed = csi_isolator_testing::isolator_command(CLI, &work)
        .args(["volume", "list", "--json"])
        .output()
        .expect("run csi-isolator volume list");
    let listed: serde_json::Value = serde_json::from_slice(&listed.stdout).unwrap();
    let x = &listed[0];
    assert_eq!(x["capability"]["fs_type"], "xfs", "{listed}");
    let destroyed = csi_isolator_testing::isolator_command(CLI, &work)
        .args(["volume", "destroy", "x"])
        .output()
        .expect("run csi-isolator volume destroy");
    assert!(
        destroyed.status.success(),
        "{}",
        String::from_utf8_lossy(&destroyed.stderr)
    );
    sb.assert_no_mounts_under();
    sb.assert_no_loop_devices();
}

/// `fs_type` "xfs" and mount flags through serve's CreateVolume and PrepareOci to runc: the volume
/// is the 300 MiB xfs' minimum (16 MiB asked), the container's `/proc/self/mountinfo` shows it xfs,
/// noatime, nosuid, nodev and noexec, the container writes it; Cleanup and DestroyVolume leave
/// nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xfs_with_mount_flags_through_serve_and_runc() {
    require_tools();
    let sb = Sandbox::new("runc-xfs");
    let bundle = build_bundle(&sb);
    let serve = Serve::start(&sb);
    let mut c = serve.client().await;
    let v = c
        .create_volume(proto::CreateVolumeRequest {
            name: "x".into(),
            capacity_bytes: 16 << 20,
            container_path: "/x".into(),
            fs_type: "xfs".into(),
            mount_flags: XFS_FLAGS.iter().map(|f| f.to_string()).collect(),
            ..Default::default()
        })
        .await
        .expect("CreateVolume")
        .into_inner();
    let info = c
        .prepare_oci(proto::PrepareRequest {
            container_id: "c1".into(),
            config: Some(proto::ContainerConfig {
                resources_json: format!("[{}]", v.resource_json),
                sandbox: bundle.sandbox.to_str().unwrap().into(),
                rootfs: bundle.runc.rootfs.to_str().unwrap().into(),
                ..Default::default()
            }),
        })
        .await
        .expect("PrepareOci")
        .into_inner();
    let st = c
        .status(proto::StatusRequest {})
        .await
        .expect("Status")
        .into_inner();
    assert_eq!(st.volumes[0].capacity_bytes, 300 << 20, "{:?}", st.volumes);
    let r = run(
        &sb,
        &bundle,
        "xfs",
        &prepared_from(&info),
        "echo on-xfs > /x/f && cat /x/f && cat /proc/self/mountinfo",
    );
    assert_ran(&r);
    assert!(r.stdout.starts_with("on-xfs\n"), "{}", r.stdout);
    assert_xfs_with_flags(&r.stdout, "/x");
    let out = r.guard.delete();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    c.cleanup(proto::CleanupRequest {
        container_id: "c1".into(),
    })
    .await
    .expect("Cleanup");
    c.destroy_volume(proto::DestroyVolumeRequest {
        volume_id: v.volume_id.clone(),
        ..Default::default()
    })
    .await
    .expect("DestroyVolume");
    drop(c);
    serve.stop(&sb);
    sb.assert_no_mounts_under();
    sb.assert_no_loop_devices();
}
