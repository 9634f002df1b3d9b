//! A volume holds what was asked for: with the embedded default (the bundled plugin's loop
//! backing) a workload that writes past its volume's size gets ENOSPC, the host filesystem
//! loses no more than the volume's size, and `df` inside shows that size; the plugin refuses
//! volumes its filesystem could not hold; the `dir` backing, which enforces nothing, says so.
//!
//! Each test keeps the work dir on its own tmpfs, so free space is measured on a filesystem no
//! other test writes to.

use csi_isolator_testing::plugin_bin;
use std::path::Path;
use std::process::{Command, Output};

use csi_isolator::csi::proto;
use csi_isolator::csi::proto::volume_capability::access_mode::Mode;
use csi_isolator::mount::MountTable;
use csi_isolator_testing::{
    isolator_command, mount_capability, raw_clients, require_root, PluginProcess, Sandbox, Tmpfs,
};
use tonic::Code;

const CLI: &str = env!("CARGO_BIN_EXE_csi-isolator");
const MIB: u64 = 1 << 20;

fn cli(work: &Path) -> Command {
    isolator_command(CLI, work)
}

fn ok(cmd: &mut Command) -> String {
    let out: Output = cmd.output().expect("run csi-isolator");
    assert!(
        out.status.success(),
        "{cmd:?}: {}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// What the workload reports: the volume's size as `stat -f` sees it inside, and how `dd`
/// of 64 MiB into it ended.
const WRITE_64M: &str = "stat -f -c 'blocks=%b bsize=%S' data; \
     dd if=/dev/zero of=data/big bs=1M count=64 2>&1; echo dd=$?; sync";

fn field(out: &str, key: &str) -> u64 {
    out.split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{key}=")))
        .unwrap_or_else(|| panic!("no {key}= in {out}"))
        .parse()
        .unwrap()
}

/// Runs `WRITE_64M` in a container with a 32 MiB volume on a work dir on its own 256 MiB
/// tmpfs; returns the workload's output and how many bytes the tmpfs lost to the run.
fn write_past_a_32m_volume(sb: &Sandbox, plugin_args: &[&str]) -> (String, u64) {
    let fs = Tmpfs::mount(sb, "fs", "256M");
    let work = fs.path().join("work");
    // The volume is made first, so that what the run itself adds is the data written.
    let mut create = cli(&work);
    create.arg("volume");
    for a in plugin_args {
        create.arg(format!("--plugin-arg={a}"));
    }
    ok(create.args(["create", "data", "32M"]));
    let before = fs.free();
    let mut run = cli(&work);
    run.arg("run");
    for a in plugin_args {
        run.arg(format!("--plugin-arg={a}"));
    }
    let out = ok(run.args(["--volume", "data:32M:data", "--", "sh", "-c", WRITE_64M]));
    let lost = before.saturating_sub(fs.free());
    let mut destroy = cli(&work);
    destroy.arg("volume");
    for a in plugin_args {
        destroy.arg(format!("--plugin-arg={a}"));
    }
    ok(destroy.args(["destroy", "data"]));
    sb.assert_no_loop_devices();
    (out, lost)
}

#[test]
fn a_workload_writing_past_its_volume_gets_enospc_and_the_host_loses_no_more_than_its_size() {
    require_root();
    let sb = Sandbox::new("capacity-enospc");
    let (out, lost) = write_past_a_32m_volume(&sb, &[]);
    assert!(
        out.contains("No space left on device"),
        "dd must fail with ENOSPC: {out}"
    );
    assert_ne!(field(&out, "dd"), 0, "{out}");
    // df inside: the volume's size, less ext4's own metadata and journal (its 4 MiB journal
    // is most of a 32 MiB volume's overhead: about 21 %).
    let size = field(&out, "blocks") * field(&out, "bsize");
    assert!(
        (24 * MIB..=32 * MIB).contains(&size),
        "the workload sees {size} bytes for a 32 MiB volume: {out}"
    );
    // The host filesystem paid for what was written (so the measure measures), and no more
    // than the volume's size (plus the plugin's and the provider's small files).
    assert!(
        (16 * MIB..=34 * MIB).contains(&lost),
        "the work dir's filesystem lost {lost} bytes to a 32 MiB volume"
    );
    sb.assert_no_mounts_under();
}

/// The control: the `dir` backing, which the plugin says does not enforce capacity, lets the
/// same workload write all 64 MiB through a "32M" volume.
#[test]
fn the_dir_backing_lets_a_workload_write_past_its_size_and_status_says_so() {
    require_root();
    let sb = Sandbox::new("capacity-dir");
    let (out, lost) = write_past_a_32m_volume(&sb, &["--backing=dir"]);
    assert_eq!(field(&out, "dd"), 0, "{out}");
    assert!(lost >= 64 * MIB, "{lost}: {out}");

    // status: the size and, for dir volumes, that it is not enforced; the resource JSON's
    // metadata carries the same.
    let fs = Tmpfs::mount(&sb, "fs2", "64M");
    let work = fs.path().join("work");
    let resource = ok(cli(&work).args([
        "volume",
        "--plugin-arg=--backing=dir",
        "create",
        "plain",
        "8M",
    ]));
    let resource: serde_json::Value = serde_json::from_str(&resource).unwrap();
    let labels = resource["disk"]["source"]["metadata"]["labels"]
        .as_array()
        .unwrap_or_else(|| panic!("no labels: {resource}"));
    assert!(
        labels.contains(&serde_json::json!({"key": "capacity_enforced", "value": "false"})),
        "{resource}"
    );
    let status = ok(cli(&work).arg("status"));
    assert!(
        status.contains("    size: 8.0 MiB, not enforced: the volume is a plain directory"),
        "{status}"
    );
    let json: serde_json::Value =
        serde_json::from_str(&ok(cli(&work).args(["status", "--json"]))).unwrap();
    assert_eq!(json["volumes"][0]["capacity_enforced"], false, "{json}");
    assert_eq!(json["volumes"][0]["capacity_bytes"], 8 * MIB, "{json}");
    ok(cli(&work).args(["volume", "--plugin-arg=--backing=dir", "destroy", "plain"]));

    // The default backing says it holds its size.
    ok(cli(&work).args(["volume", "create", "bounded", "8M"]));
    let status = ok(cli(&work).arg("status"));
    assert!(status.contains("    size: 8.0 MiB (enforced)"), "{status}");
    ok(cli(&work).args(["volume", "destroy", "bounded"]));
    drop(fs);
    sb.assert_no_mounts_under();
    sb.assert_no_loop_devices();
}

/// The plugin never promises more than its filesystem can hold: sparse images count at their
/// full size until written, GetCapacity says what is left, and a CreateVolume beyond it is
/// refused RESOURCE_EXHAUSTED naming the filesystem; a `limit_bytes` below the smallest image
/// the loop backing makes is OUT_OF_RANGE.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_volume_never_promises_more_than_the_filesystem_holds() {
    require_root();
    let sb = Sandbox::new("capacity-fs");
    let fs = Tmpfs::mount(&sb, "plugin/work", "64M");
    let mut plugin = PluginProcess::start(&sb, plugin_bin(), &[]).await;
    let mut c = raw_clients(&plugin.socket()).await.expect("connect");
    let create = |name: &str, required: u64, limit: u64| proto::CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(proto::CapacityRange {
            required_bytes: required as i64,
            limit_bytes: limit as i64,
        }),
        volume_capabilities: vec![mount_capability(Mode::SingleNodeWriter)],
        ..Default::default()
    };
    let capacity = |c: &mut csi_isolator_testing::RawClients| {
        let mut controller = c.controller.clone();
        async move {
            controller
                .get_capacity(proto::GetCapacityRequest::default())
                .await
                .unwrap()
                .into_inner()
                .available_capacity as u64
        }
    };
    let empty = capacity(&mut c).await;
    assert!(empty <= 64 * MIB && empty > 60 * MIB, "{empty}");

    let mut ids = Vec::new();
    for name in ["a", "b"] {
        let vol = c
            .controller
            .create_volume(create(name, 16 * MIB, 0))
            .await
            .unwrap()
            .into_inner()
            .volume
            .unwrap();
        ids.push(vol.volume_id);
    }
    // Two 16 MiB images promised: what is left is the free space less what they may still
    // fill, not the free space (which they have hardly touched).
    let left = capacity(&mut c).await;
    let free = fs.free();
    assert!(free > 60 * MIB, "the images are sparse: {free} free");
    assert!(
        left <= 64 * MIB - 32 * MIB && left > 24 * MIB,
        "{left} left of 64 MiB with 32 MiB promised"
    );

    let err = c
        .controller
        .create_volume(create("c", 40 * MIB, 0))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    assert!(
        err.message().contains("but the filesystem of")
            && err
                .message()
                .contains("beyond what existing volumes may still fill"),
        "{}",
        err.message()
    );
    // What GetCapacity said is left can be had.
    let vol = c
        .controller
        .create_volume(create("c", left, left))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    ids.push(vol.volume_id);

    // The loop backing's smallest image is 8 MiB: a limit below it is out of range.
    let err = c
        .controller
        .create_volume(create("tiny", MIB, 2 * MIB))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::OutOfRange, "{err:?}");

    for id in ids {
        c.controller
            .delete_volume(proto::DeleteVolumeRequest {
                volume_id: id,
                ..Default::default()
            })
            .await
            .unwrap();
    }
    // Everything given back (within what the plugin's own files take).
    let back = capacity(&mut c).await;
    assert!(back.abs_diff(empty) < MIB, "{back} after, {empty} before");
    plugin.kill();
    drop(fs);
    sb.assert_no_mounts_under();
    sb.assert_no_loop_devices();
}

/// Through the command a user types: a `volume create` (and a `run` that would create) larger
/// than the work dir's filesystem can hold is refused with the plugin's RESOURCE_EXHAUSTED and
/// its reason, and nothing is recorded, mounted or attached.
#[test]
fn a_volume_larger_than_the_filesystem_is_refused_through_the_cli_and_nothing_is_recorded() {
    require_root();
    let sb = Sandbox::new("capacity-cli-full");
    let fs = Tmpfs::mount(&sb, "fs", "64M");
    let work = fs.path().join("work");
    let refused = |out: Output, what: &str| {
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(!out.status.success(), "{what} succeeded: {err}");
        assert!(
            err.contains("RESOURCE_EXHAUSTED") && err.contains("but the filesystem of"),
            "{what}: {err}"
        );
    };
    refused(
        cli(&work)
            .args(["volume", "create", "big", "200M"])
            .output()
            .expect("run csi-isolator"),
        "volume create",
    );
    refused(
        cli(&work)
            .args(["run", "--volume", "big:200M:data", "--", "true"])
            .output()
            .expect("run csi-isolator"),
        "run",
    );
    let listed = ok(cli(&work).args(["volume", "list", "--json"]));
    let listed: serde_json::Value = serde_json::from_str(&listed).expect("list --json");
    assert_eq!(
        listed.as_array().map(Vec::len),
        Some(0),
        "recorded: {listed}"
    );
    // What fits is still made.
    ok(cli(&work).args(["volume", "create", "fits", "16M"]));
    ok(cli(&work).args(["volume", "destroy", "fits"]));
    let left = csi_isolator::mount::ProcMountTable::new()
        .mounts_under(&work)
        .expect("read the mount table");
    assert!(left.is_empty(), "mounted under the work dir: {left:?}");
    drop(fs);
    sb.assert_no_mounts_under();
    sb.assert_no_loop_devices();
}
