//! The bundled plugin as a multi-node driver: one `--mode controller` plugin and two
//! `--mode node` plugins (their own `--node-id` and work dirs, the controller's work dir as
//! their `--shared-dir`), each a separate process, driven over real gRPC in the order a CO
//! drives them: CreateVolume and ControllerPublish at the controller (the node id from the
//! node plugin's NodeGetInfo), NodeStage and NodePublish at the node. Real mounts, in both
//! backings; each test ends with no mount and no loop device left (the sandbox checks).

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use csi_isolator::csi::proto;
use csi_isolator::csi::proto::plugin_capability::service::Type as ServiceType;
use csi_isolator::csi::proto::volume_capability::access_mode::Mode;
use csi_isolator_testing::{
    mount_capability, plugin_bin, raw_clients, require_root, PluginProcess, RawClients, Sandbox,
};
use tonic::Code;

const SIZE: i64 = 16 << 20;
const VOLUME_DIR_KEY: &str = "csi-test-plugin/volume-dir";

struct Node {
    plugin: PluginProcess,
    c: RawClients,
    id: String,
    staging: PathBuf,
    target: PathBuf,
}

struct Cluster {
    // Dropped last: its drop sweeps and reports whatever a failed test left.
    nodes: Vec<Node>,
    controller: PluginProcess,
    ctl: RawClients,
    sandbox: Sandbox,
}

async fn cluster(backing: &str) -> Cluster {
    cluster_with(backing, &[]).await
}

/// A cluster whose three plugins all get `flags` too.
async fn cluster_with(backing: &str, flags: &[&str]) -> Cluster {
    require_root();
    let sandbox = Sandbox::new("plugin-multinode");
    let mut args = vec!["--backing", backing, "--mode", "controller"];
    args.extend_from_slice(flags);
    let controller = PluginProcess::start_named(&sandbox, "controller", plugin_bin(), &args).await;
    let ctl = raw_clients(&controller.socket()).await.expect("connect");
    let mut cluster = Cluster {
        nodes: Vec::new(),
        controller,
        ctl,
        sandbox,
    };
    for id in ["node-x", "node-y"] {
        let shared = cluster.controller.work_dir().display().to_string();
        let mut args = vec![
            "--backing",
            backing,
            "--mode",
            "node",
            "--node-id",
            id,
            "--shared-dir",
            &shared,
        ];
        args.extend_from_slice(flags);
        let plugin = PluginProcess::start_named(&cluster.sandbox, id, plugin_bin(), &args).await;
        let mut c = raw_clients(&plugin.socket()).await.expect("connect");
        // The CO learns the node's id from its node plugin.
        let info = c
            .node
            .node_get_info(proto::NodeGetInfoRequest {})
            .await
            .unwrap()
            .into_inner();
        assert_eq!(info.node_id, id);
        let staging = cluster.sandbox.mkdir(format!("{id}-staging"));
        let target = cluster.sandbox.mkdir(format!("{id}-pods")).join("target");
        cluster.nodes.push(Node {
            plugin,
            c,
            id: info.node_id,
            staging,
            target,
        });
    }
    cluster
}

impl Cluster {
    async fn create(&mut self, name: &str, mode: Mode) -> proto::Volume {
        self.ctl
            .controller
            .create_volume(proto::CreateVolumeRequest {
                name: name.into(),
                volume_capabilities: vec![mount_capability(mode)],
                capacity_range: Some(proto::CapacityRange {
                    required_bytes: SIZE,
                    limit_bytes: 0,
                }),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .volume
            .unwrap()
    }

    async fn attach(
        &mut self,
        node: usize,
        vol: &proto::Volume,
        mode: Mode,
    ) -> Result<HashMap<String, String>, tonic::Status> {
        let node_id = self.nodes[node].id.clone();
        self.ctl
            .controller
            .controller_publish_volume(proto::ControllerPublishVolumeRequest {
                volume_id: vol.volume_id.clone(),
                node_id,
                volume_capability: Some(mount_capability(mode)),
                volume_context: vol.volume_context.clone(),
                ..Default::default()
            })
            .await
            .map(|r| r.into_inner().publish_context)
    }

    async fn detach(&mut self, node: usize, vol: &proto::Volume) {
        let node_id = self.nodes[node].id.clone();
        self.ctl
            .controller
            .controller_unpublish_volume(proto::ControllerUnpublishVolumeRequest {
                volume_id: vol.volume_id.clone(),
                node_id,
                ..Default::default()
            })
            .await
            .unwrap();
    }

    async fn stage(
        &mut self,
        node: usize,
        vol: &proto::Volume,
        mode: Mode,
        ctx: &HashMap<String, String>,
    ) -> Result<(), tonic::Status> {
        let n = &mut self.nodes[node];
        n.c.node
            .node_stage_volume(proto::NodeStageVolumeRequest {
                volume_id: vol.volume_id.clone(),
                staging_target_path: n.staging.display().to_string(),
                volume_capability: Some(mount_capability(mode)),
                volume_context: vol.volume_context.clone(),
                publish_context: ctx.clone(),
                ..Default::default()
            })
            .await
            .map(|_| ())
    }

    /// NodeStage and NodePublish on `node`.
    async fn mount(
        &mut self,
        node: usize,
        vol: &proto::Volume,
        mode: Mode,
        ctx: &HashMap<String, String>,
    ) {
        self.stage(node, vol, mode, ctx).await.unwrap();
        let n = &mut self.nodes[node];
        n.c.node
            .node_publish_volume(proto::NodePublishVolumeRequest {
                volume_id: vol.volume_id.clone(),
                staging_target_path: n.staging.display().to_string(),
                target_path: n.target.display().to_string(),
                volume_capability: Some(mount_capability(mode)),
                volume_context: vol.volume_context.clone(),
                publish_context: ctx.clone(),
                ..Default::default()
            })
            .await
            .unwrap();
    }

    /// NodeUnpublish and NodeUnstage on `node`.
    async fn unmount(&mut self, node: usize, vol: &proto::Volume) {
        let n = &mut self.nodes[node];
        n.c.node
            .node_unpublish_volume(proto::NodeUnpublishVolumeRequest {
                volume_id: vol.volume_id.clone(),
                target_path: n.target.display().to_string(),
            })
            .await
            .unwrap();
        n.c.node
            .node_unstage_volume(proto::NodeUnstageVolumeRequest {
                volume_id: vol.volume_id.clone(),
                staging_target_path: n.staging.display().to_string(),
            })
            .await
            .unwrap();
    }

    async fn delete(&mut self, vol: &proto::Volume) {
        self.ctl
            .controller
            .delete_volume(proto::DeleteVolumeRequest {
                volume_id: vol.volume_id.clone(),
                ..Default::default()
            })
            .await
            .unwrap();
    }

    /// ListVolumes' published_node_ids of `vol`, sorted, checked against ControllerGetVolume's.
    async fn published_nodes(&mut self, vol: &proto::Volume) -> Vec<String> {
        let listed = self.listed_nodes(vol).await;
        let got = self
            .ctl
            .controller
            .controller_get_volume(proto::ControllerGetVolumeRequest {
                volume_id: vol.volume_id.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(got.volume.unwrap().volume_id, vol.volume_id);
        let mut nodes = got.status.unwrap().published_node_ids;
        nodes.sort();
        assert_eq!(nodes, listed, "ControllerGetVolume and ListVolumes agree");
        listed
    }

    async fn listed_nodes(&mut self, vol: &proto::Volume) -> Vec<String> {
        let entries = self
            .ctl
            .controller
            .list_volumes(proto::ListVolumesRequest::default())
            .await
            .unwrap()
            .into_inner()
            .entries;
        let entry = entries
            .into_iter()
            .find(|e| e.volume.as_ref().unwrap().volume_id == vol.volume_id)
            .expect("listed");
        let mut nodes = entry.status.unwrap().published_node_ids;
        nodes.sort();
        nodes
    }

    /// The controller's record of `vol`, as it is on disk.
    fn controller_record(&self, vol: &proto::Volume) -> serde_json::Value {
        let dir = PathBuf::from(&vol.volume_context[VOLUME_DIR_KEY]);
        assert!(dir.starts_with(self.controller.work_dir().join("volumes")));
        serde_json::from_slice(&std::fs::read(dir.join("volume.json")).unwrap()).unwrap()
    }

    /// The volume records under a node plugin's own work dir.
    fn node_records(&self, node: usize) -> usize {
        let volumes = self.nodes[node].plugin.work_dir().join("volumes");
        std::fs::read_dir(volumes)
            .map(|d| d.filter(|e| e.is_ok()).count())
            .unwrap_or(0)
    }

    fn read(&self, node: usize, file: &str) -> String {
        std::fs::read_to_string(self.nodes[node].target.join(file)).unwrap()
    }

    fn write(&self, node: usize, file: &str, text: &str) {
        std::fs::write(self.nodes[node].target.join(file), text).unwrap();
    }

    fn finish(self) {
        self.sandbox.assert_no_mounts_under();
        self.sandbox.assert_no_loop_devices();
    }
}

fn has_service(caps: &proto::GetPluginCapabilitiesResponse, t: ServiceType) -> bool {
    caps.capabilities.iter().any(|c| {
        matches!(&c.r#type, Some(proto::plugin_capability::Type::Service(s)) if s.r#type == t as i32)
    })
}

async fn each_serves_its_half(backing: &str) {
    let mut cl = cluster(backing).await;
    let caps = cl
        .ctl
        .identity
        .get_plugin_capabilities(proto::GetPluginCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(has_service(&caps, ServiceType::ControllerService));
    let status = cl
        .ctl
        .node
        .node_get_info(proto::NodeGetInfoRequest {})
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unimplemented, "{status:?}");
    let status = cl
        .ctl
        .node
        .node_get_capabilities(proto::NodeGetCapabilitiesRequest {})
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unimplemented, "{status:?}");
    let n = &mut cl.nodes[0].c;
    let caps = n
        .identity
        .get_plugin_capabilities(proto::GetPluginCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(
        !has_service(&caps, ServiceType::ControllerService),
        "{caps:?}"
    );
    let status = n
        .controller
        .controller_get_capabilities(proto::ControllerGetCapabilitiesRequest {})
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unimplemented, "{status:?}");
    let status = n
        .controller
        .create_volume(proto::CreateVolumeRequest {
            name: "v".into(),
            volume_capabilities: vec![mount_capability(Mode::SingleNodeWriter)],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unimplemented, "{status:?}");
    assert!(n
        .node
        .node_get_capabilities(proto::NodeGetCapabilitiesRequest {})
        .await
        .is_ok());
    cl.finish();
}

#[tokio::test]
async fn each_mode_serves_its_half_dir() {
    each_serves_its_half("dir").await;
}

#[tokio::test]
async fn each_mode_serves_its_half_loop() {
    each_serves_its_half("loop").await;
}

async fn moves_between_nodes(backing: &str) {
    let mut cl = cluster(backing).await;
    let mode = Mode::SingleNodeWriter;
    let vol = cl.create("moving", mode).await;
    let ctx = cl.attach(0, &vol, mode).await.unwrap();
    assert_eq!(ctx[VOLUME_DIR_KEY], vol.volume_context[VOLUME_DIR_KEY]);
    cl.mount(0, &vol, mode, &ctx).await;
    cl.write(0, "hello", "written on x");
    // Node-local state is the node's: the controller's record holds the publication alone.
    let record = cl.controller_record(&vol);
    assert_eq!(record["published_nodes"].as_object().unwrap().len(), 1);
    assert!(record["staged"].as_object().unwrap().is_empty(), "{record}");
    assert!(
        record["published"].as_object().unwrap().is_empty(),
        "{record}"
    );
    assert_eq!(cl.node_records(0), 1);
    assert_eq!(cl.published_nodes(&vol).await, ["node-x"]);

    // A second node for a single-node volume: refused, naming the volume and the holder.
    let status = cl.attach(1, &vol, mode).await.unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    assert!(status.message().contains(&vol.volume_id), "{status:?}");
    assert!(
        status.message().contains("published to node node-x"),
        "{status:?}"
    );
    assert!(
        status.message().contains("node node-y must wait"),
        "{status:?}"
    );
    // An over-long node id (CSI: at most 256 bytes) is refused before anything is recorded.
    let status = cl
        .ctl
        .controller
        .controller_publish_volume(proto::ControllerPublishVolumeRequest {
            volume_id: vol.volume_id.clone(),
            node_id: "n".repeat(257),
            volume_capability: Some(mount_capability(Mode::MultiNodeMultiWriter)),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    // And a node plugin the controller did not publish to refuses to mount it.
    let status = cl.stage(1, &vol, mode, &ctx).await.unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    assert!(
        status
            .message()
            .contains("not controller-published to node node-y"),
        "{status:?}"
    );
    assert!(cl
        .sandbox
        .mounts_under()
        .iter()
        .all(|m| !m.mount_point.starts_with(&cl.nodes[1].staging)));
    assert_eq!(
        cl.node_records(1),
        0,
        "a refused stage leaves y no record of the volume"
    );
    assert_eq!(cl.published_nodes(&vol).await, ["node-x"]);

    // Handoff: released on x, then y publishes it and reads x's data.
    cl.unmount(0, &vol).await;
    cl.detach(0, &vol).await;
    assert_eq!(
        cl.node_records(0),
        0,
        "x forgot the volume it no longer uses"
    );
    assert!(cl.published_nodes(&vol).await.is_empty());
    let ctx = cl.attach(1, &vol, mode).await.unwrap();
    cl.mount(1, &vol, mode, &ctx).await;
    assert_eq!(cl.read(1, "hello"), "written on x");
    assert_eq!(cl.published_nodes(&vol).await, ["node-y"]);
    // x's old publish_context no longer opens it on x.
    let status = cl.stage(0, &vol, mode, &ctx).await.unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    cl.unmount(1, &vol).await;
    cl.detach(1, &vol).await;
    cl.delete(&vol).await;
    cl.finish();
}

#[tokio::test]
async fn a_single_node_volume_moves_between_nodes_dir() {
    moves_between_nodes("dir").await;
}

#[tokio::test]
async fn a_single_node_volume_moves_between_nodes_loop() {
    moves_between_nodes("loop").await;
}

async fn multi_writer_on_both(backing: &str) {
    let mut cl = cluster(backing).await;
    let mode = Mode::MultiNodeMultiWriter;
    let vol = cl.create("shared", mode).await;
    let ctx_x = cl.attach(0, &vol, mode).await.unwrap();
    let ctx_y = cl.attach(1, &vol, mode).await.unwrap();
    assert_ne!(ctx_x, ctx_y, "each node gets its own attachment");
    cl.mount(0, &vol, mode, &ctx_x).await;
    cl.mount(1, &vol, mode, &ctx_y).await;
    assert_eq!(cl.published_nodes(&vol).await, ["node-x", "node-y"]);
    cl.write(0, "from-x", "x");
    cl.write(1, "from-y", "y");
    assert_eq!(cl.read(1, "from-x"), "x");
    assert_eq!(cl.read(0, "from-y"), "y");
    // A node's publish_context is its own: y cannot use x's.
    let status = cl.stage(1, &vol, mode, &ctx_x).await.unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    // A single-node publish beside them is refused, naming the other holder.
    let status = cl
        .attach(0, &vol, Mode::SingleNodeWriter)
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    assert!(
        status.message().contains("published to node node-y"),
        "{status:?}"
    );
    cl.unmount(0, &vol).await;
    cl.detach(0, &vol).await;
    // Unpublishing x removed x alone; y still reads and writes.
    assert_eq!(cl.published_nodes(&vol).await, ["node-y"]);
    cl.write(1, "after", "y again");
    assert_eq!(cl.read(1, "after"), "y again");
    cl.unmount(1, &vol).await;
    cl.detach(1, &vol).await;
    cl.delete(&vol).await;
    cl.finish();
}

#[tokio::test]
async fn a_multi_node_multi_writer_volume_is_used_on_both_nodes_dir() {
    multi_writer_on_both("dir").await;
}

#[tokio::test]
async fn a_multi_node_multi_writer_volume_is_used_on_both_nodes_loop() {
    multi_writer_on_both("loop").await;
}

/// A controller without PUBLISH_UNPUBLISH_VOLUME: the node plugins find the volume through
/// the volume_context CreateVolume returned.
async fn without_controller_publish(backing: &str) {
    let mut cl = cluster_with(backing, &["--no-controller-publish"]).await;
    let mode = Mode::SingleNodeWriter;
    let vol = cl.create("unattached", mode).await;
    let none = HashMap::new();
    cl.mount(0, &vol, mode, &none).await;
    cl.write(0, "f", "from x");
    cl.unmount(0, &vol).await;
    cl.mount(1, &vol, mode, &none).await;
    assert_eq!(cl.read(1, "f"), "from x");
    cl.unmount(1, &vol).await;
    // Without any context naming it, a node cannot find a volume it never saw.
    let mut bare = vol.clone();
    bare.volume_context.clear();
    let status = cl.stage(0, &bare, mode, &none).await.unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    assert!(status.message().contains(VOLUME_DIR_KEY), "{status:?}");
    cl.delete(&vol).await;
    cl.finish();
}

#[tokio::test]
async fn without_controller_publish_the_volume_context_locates_the_volume_dir() {
    without_controller_publish("dir").await;
}

#[tokio::test]
async fn without_controller_publish_the_volume_context_locates_the_volume_loop() {
    without_controller_publish("loop").await;
}

/// A node plugin's own state survives its SIGKILL: restarted, it answers repeated calls
/// idempotently and tears its mounts down from its own records (no context needed), while
/// unknown volumes and missing fields are refused as the CSI spec says.
async fn node_restart(backing: &str) {
    let mut cl = cluster(backing).await;
    let mode = Mode::SingleNodeWriter;
    let vol = cl.create("restarted", mode).await;
    let ctx = cl.attach(0, &vol, mode).await.unwrap();
    cl.mount(0, &vol, mode, &ctx).await;
    cl.write(0, "f", "kept");
    cl.nodes[0].plugin.restart().await;
    cl.nodes[0].c = raw_clients(&cl.nodes[0].plugin.socket())
        .await
        .expect("connect");
    // The same calls again: OK, nothing mounted twice.
    let before = cl.sandbox.mounts_under().len();
    cl.mount(0, &vol, mode, &ctx).await;
    assert_eq!(cl.sandbox.mounts_under().len(), before);
    assert_eq!(cl.read(0, "f"), "kept");
    let n = &mut cl.nodes[0].c;
    let unknown = proto::NodeUnstageVolumeRequest {
        volume_id: "no-such-volume".into(),
        staging_target_path: "/nonexistent".into(),
    };
    let status = n.node.node_unstage_volume(unknown).await.unwrap_err();
    assert_eq!(status.code(), Code::NotFound, "{status:?}");
    let status = n
        .node
        .node_stage_volume(proto::NodeStageVolumeRequest {
            staging_target_path: "/nonexistent".into(),
            volume_capability: Some(mount_capability(mode)),
            publish_context: ctx.clone(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    cl.unmount(0, &vol).await;
    cl.detach(0, &vol).await;
    cl.delete(&vol).await;
    cl.finish();
}

#[tokio::test]
async fn a_restarted_node_plugin_keeps_its_own_state_dir() {
    node_restart("dir").await;
}

#[tokio::test]
async fn a_restarted_node_plugin_keeps_its_own_state_loop() {
    node_restart("loop").await;
}

/// Hostile contexts: a node plugin mounts only a volume directory under its shared dir, the
/// very volume the request names, reached without a symlink.
async fn hostile_locations(backing: &str) {
    let mut cl = cluster(backing).await;
    let mode = Mode::SingleNodeWriter;
    let vol = cl.create("target", mode).await;
    let other = cl.create("other", mode).await;
    let ctx = cl.attach(0, &vol, mode).await.unwrap();
    let volumes = cl.controller.work_dir().join("volumes");
    let outside = cl.sandbox.mkdir("outside");
    std::fs::write(outside.join("secret"), "host data").unwrap();
    let link = volumes.join("vol-link");
    std::os::unix::fs::symlink(&outside, &link).unwrap();
    let claims = [
        ("/etc".to_string(), "not a volume directory under"),
        (
            outside.display().to_string(),
            "not a volume directory under",
        ),
        (
            format!("{}/../../outside", volumes.display()),
            "canonically spelled",
        ),
        (format!("{}/", ctx[VOLUME_DIR_KEY]), "canonically spelled"),
        ("relative/vol".to_string(), "canonically spelled"),
        (link.display().to_string(), "leads elsewhere"),
        (other.volume_context[VOLUME_DIR_KEY].clone(), "holds volume"),
        (String::new(), "is empty"),
    ];
    for (claim, why) in claims {
        let mut bad = ctx.clone();
        bad.insert(VOLUME_DIR_KEY.into(), claim.clone());
        let status = cl.stage(0, &vol, mode, &bad).await.unwrap_err();
        assert_eq!(
            status.code(),
            Code::InvalidArgument,
            "{claim:?}: {status:?}"
        );
        assert!(status.message().contains(why), "{claim:?}: {status:?}");
        assert!(status.message().contains(VOLUME_DIR_KEY), "{status:?}");
        assert!(
            cl.sandbox.mounts_under().is_empty(),
            "{claim:?} mounted something"
        );
        assert_eq!(cl.node_records(0), 0, "{claim:?}: nothing recorded");
    }
    std::fs::remove_file(&link).unwrap();
    // The honest context still works afterwards.
    cl.mount(0, &vol, mode, &ctx).await;
    cl.write(0, "ok", "ok");
    cl.unmount(0, &vol).await;
    cl.detach(0, &vol).await;
    cl.delete(&vol).await;
    cl.delete(&other).await;
    assert_eq!(
        std::fs::read_to_string(outside.join("secret")).unwrap(),
        "host data"
    );
    cl.finish();
}

#[tokio::test]
async fn a_node_plugin_refuses_locations_outside_its_shared_dir_dir() {
    hostile_locations("dir").await;
}

#[tokio::test]
async fn a_node_plugin_refuses_locations_outside_its_shared_dir_loop() {
    hostile_locations("loop").await;
}

/// Bounds a call on a node plugin: a planted file must never wedge it.
async fn bounded<T>(call: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(20), call)
        .await
        .expect("the node plugin answered within 20 s")
}

/// What a writer of the shared dir may plant inside a real volume's directory, and what the
/// node plugin's refusal must say.
enum Plant {
    /// `data` (dir backing) a symbolic link to `/`.
    DataToRoot,
    /// The image (loop backing) a symbolic link to another file.
    ImageLink,
    /// The image a device node (of /dev/zero's numbers) in place of the file.
    ImageDevice,
    /// The image a second name of another file.
    ImageHardLink,
    /// A FIFO at `volume.json` (reading it would block forever).
    RecordFifo,
    /// A `volume.json` over the size a node plugin reads.
    RecordHuge,
    /// `volume.json` a symbolic link to a copy of the real record.
    RecordLink,
}

impl Plant {
    /// Plants in `dir`, moving the real entry aside; returns what the refusal must contain.
    fn plant(&self, dir: &std::path::Path, sandbox: &Sandbox) -> &'static str {
        use std::os::unix::fs::symlink;
        let aside =
            |name: &str| std::fs::rename(dir.join(name), dir.join(format!("{name}.real"))).unwrap();
        let other = sandbox.join("other-file");
        std::fs::write(&other, vec![0u8; 4096]).unwrap();
        match self {
            Plant::DataToRoot => {
                aside("data");
                symlink("/", dir.join("data")).unwrap();
                "data is a symbolic link"
            }
            Plant::ImageLink => {
                aside("image.ext4");
                symlink(&other, dir.join("image.ext4")).unwrap();
                "image.ext4 is a symbolic link"
            }
            Plant::ImageDevice => {
                aside("image.ext4");
                nix::sys::stat::mknod(
                    &dir.join("image.ext4"),
                    nix::sys::stat::SFlag::S_IFCHR,
                    nix::sys::stat::Mode::from_bits_truncate(0o600),
                    nix::sys::stat::makedev(1, 5),
                )
                .unwrap();
                "image.ext4 is not a regular file"
            }
            Plant::ImageHardLink => {
                aside("image.ext4");
                std::fs::hard_link(&other, dir.join("image.ext4")).unwrap();
                "image.ext4 is a file of 2 hard links"
            }
            Plant::RecordFifo => {
                aside("volume.json");
                nix::unistd::mkfifo(
                    &dir.join("volume.json"),
                    nix::sys::stat::Mode::from_bits_truncate(0o600),
                )
                .unwrap();
                "not a regular file"
            }
            Plant::RecordHuge => {
                aside("volume.json");
                let mut huge = std::fs::read(dir.join("volume.json.real")).unwrap();
                huge.resize(2 << 20, b' ');
                std::fs::write(dir.join("volume.json"), huge).unwrap();
                "over 1048576 bytes"
            }
            Plant::RecordLink => {
                let copy = sandbox.join("record-copy.json");
                std::fs::copy(dir.join("volume.json"), &copy).unwrap();
                aside("volume.json");
                symlink(&copy, dir.join("volume.json")).unwrap();
                "a symbolic link"
            }
        }
    }

    /// Puts the real entry back.
    fn remove(&self, dir: &std::path::Path, sandbox: &Sandbox) {
        let name = match self {
            Plant::DataToRoot => "data",
            Plant::ImageLink | Plant::ImageDevice | Plant::ImageHardLink => "image.ext4",
            Plant::RecordFifo | Plant::RecordHuge | Plant::RecordLink => "volume.json",
        };
        std::fs::remove_file(dir.join(name)).unwrap();
        std::fs::rename(dir.join(format!("{name}.real")), dir.join(name)).unwrap();
        let _ = std::fs::remove_file(sandbox.join("other-file"));
    }
}

/// Things planted inside a real volume's directory (what a writer of the shared dir could do):
/// each refused, naming what is wrong, with nothing mounted, no loop device attached, no node
/// record kept, and the plugin answering other calls at once; the honest volume works after.
async fn planted_storage(backing: &str, plants: &[Plant]) {
    let mut cl = cluster(backing).await;
    let mode = Mode::SingleNodeWriter;
    let vol = cl.create("planted", mode).await;
    let ctx = cl.attach(0, &vol, mode).await.unwrap();
    let dir = PathBuf::from(&ctx[VOLUME_DIR_KEY]);
    for plant in plants {
        let why = plant.plant(&dir, &cl.sandbox);
        let status = bounded(cl.stage(0, &vol, mode, &ctx)).await.unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{why}: {status:?}");
        assert!(status.message().contains(why), "{why}: {status:?}");
        assert!(
            status.message().contains(&dir.display().to_string()),
            "{status:?}"
        );
        assert!(
            cl.sandbox.mounts_under().is_empty(),
            "{why}: mounted something"
        );
        assert!(
            cl.sandbox.loop_devices().is_empty(),
            "{why}: attached a loop device"
        );
        assert!(
            csi_isolator::mount::find_by_backing_file(std::path::Path::new("/dev/zero"))
                .unwrap()
                .is_empty()
                && csi_isolator::mount::find_by_backing_file(&cl.sandbox.join("other-file"))
                    .unwrap()
                    .is_empty(),
            "{why}: attached a loop device"
        );
        assert_eq!(cl.node_records(0), 0, "{why}: nothing recorded");
        // Not wedged: the same node plugin answers another call at once.
        bounded(
            cl.nodes[0]
                .c
                .node
                .node_get_capabilities(proto::NodeGetCapabilitiesRequest {}),
        )
        .await
        .unwrap();
        plant.remove(&dir, &cl.sandbox);
    }
    // The honest volume still works.
    cl.mount(0, &vol, mode, &ctx).await;
    cl.write(0, "ok", "ok");
    cl.unmount(0, &vol).await;
    cl.detach(0, &vol).await;
    cl.delete(&vol).await;
    cl.finish();
}

const RECORD_PLANTS: [Plant; 3] = [Plant::RecordFifo, Plant::RecordHuge, Plant::RecordLink];

#[tokio::test]
async fn a_node_plugin_refuses_what_is_planted_in_a_volume_dir_dir() {
    planted_storage("dir", &[Plant::DataToRoot]).await;
    planted_storage("dir", &RECORD_PLANTS).await;
}

#[tokio::test]
async fn a_node_plugin_refuses_what_is_planted_in_a_volume_dir_loop() {
    planted_storage(
        "loop",
        &[Plant::ImageLink, Plant::ImageDevice, Plant::ImageHardLink],
    )
    .await;
    planted_storage("loop", &RECORD_PLANTS).await;
}

/// Runs the plugin binary with `args` and returns its exit status and stderr (it must exit:
/// these are refused configurations).
fn refused_start(sandbox: &Sandbox, args: &[&str]) -> String {
    let log = sandbox.join("refused.log");
    let mut child = sandbox
        .spawn(
            std::process::Command::new(plugin_bin())
                .args(args)
                .stderr(std::fs::File::create(&log).unwrap())
                .stdout(std::process::Stdio::null()),
        )
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the plugin started with {args:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    sandbox.untrack(child.id());
    assert!(!status.success(), "{args:?}");
    std::fs::read_to_string(&log).unwrap()
}

#[test]
fn a_node_plugin_needs_a_shared_dir_apart_from_its_own() {
    require_root();
    let sb = Sandbox::new("plugin-multinode-config");
    let shared = sb.mkdir("shared");
    let endpoint = format!("unix://{}", sb.join("csi.sock").display());
    let shared_s = shared.display().to_string();
    let inside = shared.join("node").display().to_string();
    let own = sb.join("node").display().to_string();
    let missing = sb.join("missing").display().to_string();
    let base = ["--endpoint", endpoint.as_str(), "--mode", "node"];
    let run = |more: &[&str]| {
        let args: Vec<&str> = base.iter().chain(more).copied().collect();
        refused_start(&sb, &args)
    };
    let err = run(&["--work-dir", &own]);
    assert!(err.contains("--shared-dir"), "{err}");
    let err = run(&["--work-dir", &inside, "--shared-dir", &shared_s]);
    assert!(err.contains("overlap"), "{err}");
    let err = run(&["--work-dir", &own, "--shared-dir", &missing]);
    assert!(err.contains("start the controller first"), "{err}");
    // Root mounts what the shared dir names: another user able to write it is refused.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).unwrap();
    let err = run(&["--work-dir", &own, "--shared-dir", &shared_s]);
    assert!(err.contains("writable by group or others"), "{err}");
    assert!(err.contains("shared dir"), "{err}");
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::os::unix::fs::chown(&shared, Some(65534), None).unwrap();
    let err = run(&["--work-dir", &own, "--shared-dir", &shared_s]);
    assert!(err.contains("not owned by root"), "{err}");
    std::os::unix::fs::chown(&shared, Some(0), None).unwrap();
    let err = refused_start(
        &sb,
        &[
            "--endpoint",
            &endpoint,
            "--work-dir",
            &own,
            "--shared-dir",
            &shared_s,
        ],
    );
    assert!(err.contains("--shared-dir is for --mode node"), "{err}");
}
