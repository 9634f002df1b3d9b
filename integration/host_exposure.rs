//! Issue 18, findings 2 and 3, end to end as root on the real kernel: what a container writes into its
//! volume gains nothing through the volume's host paths, and a symlink it plants inside a volume never
//! redirects a later mount.
//!
//! - The host-side staging and target mounts carry nosuid,nodev (the bundled plugin mounts with them, and
//!   the provider sets them on any plugin's mount roots), while the container's own copy of the volume
//!   does not: a setuid-root binary planted from inside a container runs unprivileged for a host user
//!   even when the directories are opened to that user, and the container sees its volume as before.
//! - The provider's own directories on the way to a volume (`mounts/<id>`) are 0700, and so are the
//!   plugin's: a host user cannot reach a volume's files through them.
//! - A PATH disk's `volumes/roles/<role>/<id>` is opened beneath the volume's mount point without
//!   following symlinks: a symlink planted there (at the end or in the middle) is refused by name, and
//!   nothing of what it points to is mounted or shown.
//!
//! Every test works in its own sandbox and checks that nothing is left mounted.

use csi_isolator_testing::plugin_bin;
use std::ffi::CString;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use csi_isolator::mount::{Call, FakeSyscall, MountTable, ProcMountTable};
use csi_isolator::provider::{PluginSource, ProviderConfig, StorageProvider};
use csi_isolator_testing::unprivileged::{as_nobody, Outcome, NOBODY_UID};
use csi_isolator_testing::{
    isolator_command, processes_mentioning, require_root, PluginProcess, Sandbox,
};
use nix::errno::Errno;

const CLI: &str = env!("CARGO_BIN_EXE_csi-isolator");

/// How long a test waits for the workload to reach a point.
const WAIT: Duration = Duration::from_secs(30);

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
    let procs = processes_mentioning(work);
    assert!(procs.is_empty(), "processes left: {procs:?}");
}

/// (nosuid, nodev) of the mount `path` is on, from statvfs.
fn statvfs_flags(path: &Path) -> (bool, bool) {
    use nix::sys::statvfs::{statvfs, FsFlags};
    let flags = statvfs(path).unwrap().flags();
    (
        flags.contains(FsFlags::ST_NOSUID),
        flags.contains(FsFlags::ST_NODEV),
    )
}

/// The topmost host mount at `path`, which must exist.
fn host_mount(path: &Path) -> csi_isolator::mount::MountInfo {
    ProcMountTable::new()
        .find(path)
        .unwrap()
        .unwrap_or_else(|| panic!("nothing mounted at {}", path.display()))
}

fn has_option(options: &[String], name: &str) -> bool {
    options.iter().any(|o| o == name)
}

/// The host mount under `work` whose mount point ends with `leaf` (`staging`, `target`).
fn volume_mount_point(work: &Path, leaf: &str) -> Option<PathBuf> {
    ProcMountTable::new()
        .mounts_under(work)
        .unwrap()
        .into_iter()
        .map(|m| m.mount_point)
        .find(|p| p.file_name().is_some_and(|n| n == leaf))
}

/// Adds search (and read) permission for others on every directory from `top` down to `dir`, both
/// included: what the product closes, the test opens, to prove the layer below on its own.
fn open_path_for_others(top: &Path, dir: &Path) {
    let mut cur = top.to_path_buf();
    let rest = dir.strip_prefix(top).unwrap().to_path_buf();
    let mut dirs = vec![cur.clone()];
    for c in rest.components() {
        cur.push(c);
        dirs.push(cur.clone());
    }
    for d in dirs {
        let mode = std::fs::metadata(&d).unwrap().permissions().mode();
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(mode | 0o005)).unwrap();
    }
}

/// Runs `program` with `args` as nobody with stdout into `out` (a file nobody may write); the outcome
/// of the exec (the program's exit code, or why it could not run).
fn exec_as_nobody(program: &Path, args: &[&str], out: &Path) -> Outcome {
    // Everything allocated before the fork: the child only makes syscalls.
    let program = CString::new(program.as_os_str().as_encoded_bytes()).unwrap();
    let argv: Vec<CString> = args.iter().map(|a| CString::new(*a).unwrap()).collect();
    let out = CString::new(out.as_os_str().as_encoded_bytes()).unwrap();
    as_nobody(move || {
        let fd = nix::fcntl::open(
            out.as_c_str(),
            nix::fcntl::OFlag::O_WRONLY | nix::fcntl::OFlag::O_TRUNC,
            nix::sys::stat::Mode::empty(),
        )?;
        // SAFETY: dup2 onto stdout of this single-threaded forked child; `fd` stays open until exec.
        if unsafe { libc::dup2(std::os::fd::AsRawFd::as_raw_fd(&fd), 1) } < 0 {
            return Err(Errno::last());
        }
        let e = nix::unistd::execv(&program, &argv).unwrap_err();
        Err(e)
    })
}

fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < WAIT, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Finding 2: root in a container copies `id` into its volume as 4755. On the host the staging and target
/// mounts carry nosuid,nodev (statvfs and the mount table), the provider's `mounts/<id>` is 0700 (nobody
/// cannot read the file through it), and even with every directory on the way opened by the test, nobody
/// running the planted binary through the host path gets no euid 0. Inside the container the volume is not
/// nosuid,nodev (its own mount table), as before.
#[test]
fn a_setuid_binary_planted_from_a_container_gives_a_host_user_no_privilege() {
    require_root();
    let sb = Sandbox::new("host-suid");
    let work = sb.join("work");
    let script = "set -e
cp /usr/bin/id data/id
chmod 4755 data/id
grep \" $PWD/data \" /proc/self/mountinfo > data/container-mountinfo
touch data/ready
i=0
while [ ! -e data/go ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done
test -e data/go";
    let mut child = sb
        .spawn(
            cli(&work)
                .args(["run", "--volume", "data:32M:data", "--", "sh", "-c", script])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped()),
        )
        .unwrap();
    let mut target = None;
    wait_for("the workload to plant its binary", || {
        target = volume_mount_point(&work, "target").filter(|t| t.join("ready").exists());
        target.is_some()
    });
    let target = target.unwrap();
    let staging = volume_mount_point(&work, "staging").expect("the bundled plugin stages");
    let planted = target.join("id");
    let meta = std::fs::metadata(&planted).unwrap();
    assert_eq!(
        (meta.uid(), meta.mode() & 0o7777),
        (0, 0o4755),
        "a setuid-root binary"
    );

    // The host side: nosuid,nodev on both mounts, by statvfs and by the mount table.
    for path in [&staging, &target] {
        assert_eq!(statvfs_flags(path), (true, true), "{}", path.display());
        let m = host_mount(path);
        assert!(
            has_option(&m.mount_options, "nosuid") && has_option(&m.mount_options, "nodev"),
            "{m:?}"
        );
    }
    // The container's side: its own mount of the volume is neither.
    let line = std::fs::read_to_string(target.join("container-mountinfo")).unwrap();
    let options: Vec<String> = line
        .split_whitespace()
        .nth(5)
        .unwrap_or_else(|| panic!("a mountinfo line: {line:?}"))
        .split(',')
        .map(str::to_string)
        .collect();
    assert!(
        !has_option(&options, "nosuid") && !has_option(&options, "nodev"),
        "the container sees its volume as before: {line}"
    );

    // The provider's directory on the way is root's alone: with everything above it opened, nobody
    // still cannot reach the file.
    let mount_dir = target.parent().unwrap().to_path_buf();
    assert_eq!(std::fs::metadata(&mount_dir).unwrap().mode() & 0o777, 0o700);
    open_path_for_others(sb.path(), mount_dir.parent().unwrap());
    let planted_c = CString::new(planted.as_os_str().as_encoded_bytes()).unwrap();
    let read = as_nobody(move || {
        nix::fcntl::open(
            planted_c.as_c_str(),
            nix::fcntl::OFlag::O_RDONLY,
            nix::sys::stat::Mode::empty(),
        )
        .map(|_| 0)
    });
    assert_eq!(read, Outcome::Failed(Errno::EACCES), "mounts/<id> is 0700");

    // Now the directories opened too: only nosuid stands between nobody and euid 0.
    open_path_for_others(sb.path(), &mount_dir);
    let out = sb.join("euid");
    std::fs::write(&out, b"").unwrap();
    std::fs::set_permissions(&out, std::fs::Permissions::from_mode(0o666)).unwrap();
    assert_eq!(
        exec_as_nobody(&planted, &["id", "-u"], &out),
        Outcome::Ok(0),
        "the planted binary ran"
    );
    assert_eq!(
        std::fs::read_to_string(&out).unwrap().trim(),
        NOBODY_UID.to_string(),
        "no euid 0 through the host path"
    );

    std::fs::write(target.join("go"), b"").unwrap();
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(start.elapsed() < WAIT, "run did not end");
        std::thread::sleep(Duration::from_millis(50));
    };
    sb.untrack(child.id());
    let out = child.wait_with_output().unwrap();
    assert!(status.success(), "{}", text(&out.stderr));
    assert_nothing_left(&sb, &work);
}

/// Creates the volume `name` and returns its resource JSON turned into a PATH disk holding the
/// persistent volume `r1`/`pv1` at `pv` in the sandbox.
fn path_disk_resource(work: &Path, name: &str) -> serde_json::Value {
    let created = output(cli(work).args(["volume", "create", name, "32M"]));
    assert!(created.status.success(), "{}", text(&created.stderr));
    let mut res: serde_json::Value = serde_json::from_slice(&created.stdout).unwrap();
    let root = res["disk"]["source"]["mount"]["root"].clone();
    assert!(root.is_string(), "{res}");
    let source = res["disk"]["source"].as_object_mut().unwrap();
    source.remove("mount");
    source.insert("type".into(), "PATH".into());
    source.insert("path".into(), serde_json::json!({ "root": root }));
    res["disk"]["persistence"] = serde_json::json!({ "id": "pv1" });
    res["disk"]["volume"] = serde_json::json!({ "container_path": "pv", "mode": "RW" });
    res["reservations"] = serde_json::json!([{ "type": "DYNAMIC", "role": "r1" }]);
    res
}

/// A root-only decoy directory holding `secret`, as `<sb>/<rel>/<inner>`.
fn decoy(sb: &Sandbox, rel: &str, inner: &str) -> PathBuf {
    let top = sb.mkdir(rel);
    let dir = sb.mkdir(Path::new(rel).join(inner));
    std::fs::write(dir.join("secret"), b"decoy-secret\n").unwrap();
    std::fs::set_permissions(&top, std::fs::Permissions::from_mode(0o700)).unwrap();
    dir
}

/// Finding 3: a first run plants a symlink inside a PATH disk's volume, at the persistent volume's own
/// entry or at `volumes` in the middle; a second run given persistent volume `pv1` on that disk is
/// refused naming the symlink, shows nothing of the decoy, and leaves the host mount table as it was.
#[test]
fn a_symlinked_persistent_volume_path_is_refused_by_name_and_nothing_is_mounted() {
    require_root();
    let sb = Sandbox::new("host-pv-link");
    let work = sb.join("work");
    let last = decoy(&sb, "decoy-last", "");
    let middle = decoy(&sb, "decoy-middle", "roles/r1/pv1");
    let cases = [
        (
            "disk-last",
            format!(
                "mkdir -p data/volumes/roles/r1 && ln -s {} data/volumes/roles/r1/pv1",
                last.display()
            ),
            "volumes/roles/r1/pv1 is a symlink",
        ),
        (
            "disk-middle",
            format!("ln -s {} data/volumes", sb.join("decoy-middle").display()),
            "volumes is a symlink",
        ),
    ];
    for (name, plant, refused) in cases {
        let res = path_disk_resource(&work, name);
        // The first run writes into the volume what any container could.
        let first = output(cli(&work).args([
            "run",
            "--volume",
            &format!("{name}:32M:data"),
            "--",
            "sh",
            "-c",
            &plant,
        ]));
        assert!(first.status.success(), "{name}: {}", text(&first.stderr));

        let file = sb.join(format!("{name}.json"));
        std::fs::write(
            &file,
            serde_json::to_vec(&serde_json::json!([res])).unwrap(),
        )
        .unwrap();
        let before: Vec<PathBuf> = sb
            .mounts_under()
            .into_iter()
            .map(|m| m.mount_point)
            .collect();
        let second = output(cli(&work).args(["run", "--resources"]).arg(&file).args([
            "--",
            "sh",
            "-c",
            "cat pv/secret; echo reached",
        ]));
        let (stdout, stderr) = (text(&second.stdout), text(&second.stderr));
        assert!(!second.status.success(), "{name}: {stdout}");
        assert!(stderr.contains(refused), "{name}: {stderr}");
        assert!(
            !stdout.contains("decoy-secret") && !stdout.contains("reached"),
            "{name}: the workload never ran: {stdout}"
        );
        let after: Vec<PathBuf> = sb
            .mounts_under()
            .into_iter()
            .map(|m| m.mount_point)
            .collect();
        assert_eq!(before, after, "{name}: the host mount table is unchanged");
        for m in ProcMountTable::new().mounts().unwrap() {
            assert!(
                !m.root.to_string_lossy().contains("decoy"),
                "{name}: the decoy was mounted: {m:?}"
            );
        }
        let destroyed = output(cli(&work).args(["volume", "destroy", name]));
        assert!(destroyed.status.success(), "{}", text(&destroyed.stderr));
    }
    assert_eq!(
        std::fs::read_to_string(middle.join("secret")).unwrap(),
        "decoy-secret\n",
        "the decoy is untouched"
    );
    assert_nothing_left(&sb, &work);
}

/// The provider, driving any plugin (here the real plugin, external), asks the mount seam to harden the
/// staging path, then the target, after NodePublishVolume (recorded by the fake seam),
/// and makes its `mounts/<id>` 0700; the plugin's own directories are 0700 too.
#[test]
fn the_provider_hardens_any_plugins_mounts_and_keeps_its_directories_private() {
    require_root();
    let sb = Sandbox::new("host-provider");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        // A store an earlier version left open is closed when the plugin opens it.
        let old_store = sb.mkdir("plugin/work/volumes");
        std::fs::set_permissions(&old_store, std::fs::Permissions::from_mode(0o755)).unwrap();
        let plugin = PluginProcess::start(&sb, plugin_bin(), &[]).await;
        let work = sb.mkdir("work");
        let mut config = ProviderConfig::new(
            "",
            "default",
            &work,
            PluginSource::Endpoint(plugin.endpoint()),
        );
        config.socket_dir = sb.join("s");
        let fake = Arc::new(FakeSyscall::new());
        let provider =
            StorageProvider::start_with(config, fake.clone(), Arc::new(ProcMountTable::new()))
                .await
                .expect("start provider");
        let spec = csi_isolator::provider::CreateSpec::new("v", 16 << 20);
        let res = provider.create_volume(spec).await.unwrap();
        let id = res.source_id().unwrap().to_string();
        let target = provider.publish(&id, "c1").await.unwrap();
        let staging = target.parent().unwrap().join("staging");
        let hardened: Vec<PathBuf> = fake
            .calls()
            .into_iter()
            .filter_map(|c| match c {
                Call::HardenMountRoot { target } => Some(target),
                _ => None,
            })
            .collect();
        assert_eq!(hardened, vec![staging.clone(), target.clone()]);
        for dir in [
            target.parent().unwrap(),
            target.parent().unwrap().parent().unwrap(),
        ] {
            assert_eq!(
                std::fs::metadata(dir).unwrap().mode() & 0o777,
                0o700,
                "{}",
                dir.display()
            );
        }
        let store = plugin.work_dir().join("volumes");
        assert_eq!(std::fs::metadata(&store).unwrap().mode() & 0o777, 0o700);
        for entry in std::fs::read_dir(&store).unwrap() {
            let dir = entry.unwrap().path();
            assert_eq!(
                std::fs::metadata(&dir).unwrap().mode() & 0o777,
                0o700,
                "{}",
                dir.display()
            );
        }
        provider.release(&id, "c1").await.unwrap();
        provider.destroy_volume(&id).await.unwrap();
        provider.shutdown(Duration::from_secs(5)).await;
        drop(plugin);
    });
    sb.assert_no_mounts_under();
    sb.assert_no_loop_devices();
}

/// The Docker/OCI path: the host bind into `<sandbox>` is a host path, so it carries nosuid,nodev, and a
/// runc container given that bind (`rbind`) sees the volume nosuid,nodev too; reads and writes work as
/// before.
#[test]
fn the_oci_host_bind_and_a_runc_container_given_it_see_nosuid_nodev() {
    use csi_isolator::isolator::oci;
    use csi_isolator::isolator::LaunchInfo;
    use csi_isolator::mount::LinuxSyscall;
    use csi_isolator::mount::{TargetRoot, VolumeMount};
    use csi_isolator_testing::{require_runc, runc_run, RuncBundle};
    require_root();
    require_runc();
    let sb = Sandbox::new("host-oci");
    let sandbox = sb.mkdir("sandbox");
    let vol = sb.mkdir("vol");
    std::fs::write(vol.join("seed"), b"seed\n").unwrap();
    let bundle = RuncBundle::new(&sb, "bundle");
    let launch = LaunchInfo {
        mounts: vec![VolumeMount {
            source: vol.clone(),
            source_root: None,
            root: TargetRoot::Rootfs,
            target: PathBuf::from("data"),
            container_path: "/data".into(),
            readonly: false,
            volume_id: Some("v".into()),
            provider_id: None,
            block: false,
            propagation: Default::default(),
            hardening: Default::default(),
        }],
    };
    let sys = LinuxSyscall::new();
    let prepared = oci::prepare(&sys, &sandbox, &launch).expect("prepare");
    let host = &prepared.host_binds[0];
    assert_eq!(statvfs_flags(host), (true, true), "{}", host.display());
    let mut config = bundle
        .config_for("cat /data/seed && echo out > /data/f && grep ' /data ' /proc/self/mountinfo");
    prepared.apply_to_config(&mut config);
    let r = runc_run(&sb, &bundle, "host-oci", &config, WAIT);
    assert_eq!(r.code, Some(0), "{}\n{}", r.stdout, r.stderr);
    let mut lines = r.stdout.lines();
    assert_eq!(lines.next(), Some("seed"));
    let options: Vec<String> = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(5))
        .unwrap_or_else(|| panic!("a mountinfo line: {}", r.stdout))
        .split(',')
        .map(str::to_string)
        .collect();
    assert!(
        has_option(&options, "nosuid") && has_option(&options, "nodev"),
        "the runc container sees the host bind's flags: {options:?}"
    );
    assert_eq!(std::fs::read_to_string(vol.join("f")).unwrap(), "out\n");
    let deleted = r.guard.delete();
    assert!(deleted.status.success());
    oci::cleanup(&sys, &ProcMountTable::new(), &sandbox).unwrap();
    sb.assert_no_mounts_under();
}

/// The bundled plugin on its own (driven over raw CSI, no provider): its staging and target mounts carry
/// nosuid,nodev with both backings (the binds and the ext4 loop mount), its own directories are 0700,
/// and the dir backing's data directory (the volume's root as containers see it) keeps its mode.
#[test]
fn the_bundled_plugin_mounts_nosuid_nodev_with_both_backings() {
    use csi_isolator::csi::proto;
    use csi_isolator_testing::{mount_capability, raw_clients};
    require_root();
    let sb = Sandbox::new("host-plugin");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        for backing in ["dir", "loop"] {
            let plugin = PluginProcess::start_named(
                &sb,
                backing,
                plugin_bin(),
                &["--backing", backing, "--no-controller-publish"],
            )
            .await;
            let mut c = raw_clients(&plugin.socket()).await.unwrap();
            let cap =
                || mount_capability(proto::volume_capability::access_mode::Mode::SingleNodeWriter);
            let vol = c
                .controller
                .create_volume(proto::CreateVolumeRequest {
                    name: format!("v-{backing}"),
                    capacity_range: Some(proto::CapacityRange {
                        required_bytes: 16 << 20,
                        limit_bytes: 0,
                    }),
                    volume_capabilities: vec![cap()],
                    ..Default::default()
                })
                .await
                .unwrap()
                .into_inner()
                .volume
                .unwrap();
            let base = sb.mkdir(format!("{backing}-mounts"));
            let (staging, target) = (base.join("staging"), base.join("target"));
            c.node
                .node_stage_volume(proto::NodeStageVolumeRequest {
                    volume_id: vol.volume_id.clone(),
                    staging_target_path: staging.display().to_string(),
                    volume_capability: Some(cap()),
                    volume_context: vol.volume_context.clone(),
                    ..Default::default()
                })
                .await
                .unwrap();
            c.node
                .node_publish_volume(proto::NodePublishVolumeRequest {
                    volume_id: vol.volume_id.clone(),
                    staging_target_path: staging.display().to_string(),
                    target_path: target.display().to_string(),
                    volume_capability: Some(cap()),
                    volume_context: vol.volume_context.clone(),
                    ..Default::default()
                })
                .await
                .unwrap();
            for path in [&staging, &target] {
                assert_eq!(
                    statvfs_flags(path),
                    (true, true),
                    "{backing}: {}",
                    path.display()
                );
                let m = host_mount(path);
                assert!(
                    has_option(&m.mount_options, "nosuid") && has_option(&m.mount_options, "nodev"),
                    "{backing}: {m:?}"
                );
            }
            let store = plugin.work_dir().join("volumes");
            assert_eq!(std::fs::metadata(&store).unwrap().mode() & 0o777, 0o700);
            for entry in std::fs::read_dir(&store).unwrap() {
                let dir = entry.unwrap().path();
                assert_eq!(
                    std::fs::metadata(&dir).unwrap().mode() & 0o777,
                    0o700,
                    "{}",
                    dir.display()
                );
                if backing == "dir" {
                    let data = std::fs::metadata(dir.join("data")).unwrap();
                    assert_eq!(
                        data.mode() & 0o777,
                        0o755,
                        "the volume's root keeps its mode"
                    );
                }
            }
            c.node
                .node_unpublish_volume(proto::NodeUnpublishVolumeRequest {
                    volume_id: vol.volume_id.clone(),
                    target_path: target.display().to_string(),
                })
                .await
                .unwrap();
            c.node
                .node_unstage_volume(proto::NodeUnstageVolumeRequest {
                    volume_id: vol.volume_id.clone(),
                    staging_target_path: staging.display().to_string(),
                })
                .await
                .unwrap();
            c.controller
                .delete_volume(proto::DeleteVolumeRequest {
                    volume_id: vol.volume_id.clone(),
                    ..Default::default()
                })
                .await
                .unwrap();
            drop(plugin);
        }
    });
    sb.assert_no_mounts_under();
    sb.assert_no_loop_devices();
}

/// A volume published by an older version, whose host-side mounts carry no nosuid,nodev, is hardened
/// when a provider next starts on the work dir, without being published again.
#[test]
fn mounts_published_before_hardening_are_hardened_at_the_next_start() {
    require_root();
    let sb = Sandbox::new("host-upgrade");
    let work = sb.join("work");
    let ok = |what: &str, out: Output| {
        assert!(
            out.status.success(),
            "{what}: {}{}",
            text(&out.stdout),
            text(&out.stderr)
        )
    };
    ok(
        "create",
        output(cli(&work).args(["volume", "create", "old", "16M"])),
    );
    ok(
        "publish",
        output(cli(&work).args(["volume", "publish", "old", "--container", "c1"])),
    );
    let staging = volume_mount_point(&work, "staging").expect("the bundled plugin stages");
    let target = volume_mount_point(&work, "target").expect("the target is mounted");
    // What an older version left: the same mounts without the host-only flags.
    for path in [&staging, &target] {
        let out = Command::new("mount")
            .args(["-o", "remount,bind,suid,dev"])
            .arg(path)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "remount {}: {}",
            path.display(),
            text(&out.stderr)
        );
        assert_eq!(statvfs_flags(path), (false, false), "{}", path.display());
    }
    // Any command that starts the provider recovers it.
    ok("list", output(cli(&work).args(["volume", "list"])));
    for path in [&staging, &target] {
        assert_eq!(statvfs_flags(path), (true, true), "{}", path.display());
    }
    ok(
        "release",
        output(cli(&work).args(["volume", "release", "old", "--container", "c1"])),
    );
    assert_nothing_left(&sb, &work);
}
