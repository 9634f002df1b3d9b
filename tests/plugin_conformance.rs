//! Conformance of the test plugin with the CSI spec, for mount volumes, in both backings, and
//! for block volumes (served by the loop backing, refused by the dir backing).
//!
//! These are our own tests of the behaviours the official conformance suite (csi-sanity from
//! kubernetes-csi/csi-test, `pkg/sanity/{identity,controller,node}.go`) checks, spec by spec,
//! driven like that suite drives a plugin: a staging directory and a target parent created by
//! the "CO", the target itself left to the plugin, and after each spec the suite's cleanup
//! order (NodeUnpublish, NodeUnstage, ControllerUnpublish, DeleteVolume) for every volume the
//! spec created. Each spec ends by asserting no mount and no loop device is left.

use csi_isolator_testing::plugin_bin;
use std::collections::{HashMap, HashSet};
use std::path::PathBuf;

use csi_isolator::csi::proto;
use csi_isolator::csi::proto::volume_capability::access_mode::Mode;
use csi_isolator_testing::{
    block_capability, mount_capability, raw_clients, require_root, PluginProcess, RawClients,
    Sandbox, Tmpfs,
};
use tonic::Code;

/// csi-sanity's test volume size is configurable; a small one keeps loop images cheap.
const SIZE: i64 = 16 << 20;

fn cap() -> proto::VolumeCapability {
    mount_capability(Mode::SingleNodeWriter)
}

fn code<T: std::fmt::Debug>(r: Result<T, tonic::Status>) -> Code {
    match r {
        Ok(v) => panic!("expected an error, got {v:?}"),
        Err(s) => s.code(),
    }
}

/// What a spec published, so cleanup can undo it in the suite's order.
#[derive(Default)]
struct Published {
    node: Option<String>,
    staged: bool,
    targets: Vec<PathBuf>,
}

struct Suite {
    sandbox: Sandbox,
    _plugin: PluginProcess,
    c: RawClients,
    staging: PathBuf,
    target_parent: PathBuf,
    volumes: Vec<(String, Published)>,
    counter: u32,
    /// A tmpfs holding the plugin's work dir, unmounted by `cleanup`.
    tmpfs: Option<Tmpfs>,
    /// The backing the plugin runs (`dir` or `loop`).
    backing: String,
    /// The capability the helpers create, publish and stage with (mount unless a spec says).
    access: proto::VolumeCapability,
    /// The access mode of the capability the helpers carry (SINGLE_NODE_WRITER unless a
    /// spec says otherwise).
    mode: Mode,
}

async fn suite(backing: &str) -> Suite {
    suite_with(backing, None).await
}

/// A suite whose plugin keeps its work dir on a tmpfs of `size` (mount option syntax, e.g.
/// `2T`): a filesystem no other test writes to, so the plugin's GetCapacity, which is bounded
/// by the free space of that filesystem, answers figures a test can predict.
async fn suite_on_tmpfs(backing: &str, size: &str) -> Suite {
    suite_with(backing, Some(size)).await
}

/// A suite whose plugin offers VOLUME_MOUNT_GROUP (`--volume-mount-group`).
async fn suite_offering_volume_mount_group(backing: &str) -> Suite {
    suite_with_flags(backing, None, &["--volume-mount-group"]).await
}

async fn suite_with(backing: &str, tmpfs_size: Option<&str>) -> Suite {
    suite_with_flags(backing, tmpfs_size, &[]).await
}

async fn suite_with_flags(backing: &str, tmpfs_size: Option<&str>, flags: &[&str]) -> Suite {
    require_root();
    let sandbox = Sandbox::new("plugin-conformance");
    let tmpfs = tmpfs_size.map(|size| Tmpfs::mount(&sandbox, "plugin/work", size));
    let mut args = vec!["--backing", backing];
    args.extend_from_slice(flags);
    let plugin = PluginProcess::start(&sandbox, plugin_bin(), &args).await;
    let c = raw_clients(&plugin.socket())
        .await
        .expect("connect to plugin");
    let staging = sandbox.mkdir("csi-staging");
    let target_parent = sandbox.mkdir("csi-mount");
    Suite {
        sandbox,
        _plugin: plugin,
        c,
        staging,
        target_parent,
        volumes: Vec::new(),
        counter: 0,
        tmpfs,
        backing: backing.to_string(),
        access: cap(),
        mode: Mode::SingleNodeWriter,
    }
}

impl Suite {
    fn unique(&mut self, prefix: &str) -> String {
        self.counter += 1;
        format!("{prefix}-{}-{}", std::process::id(), self.counter)
    }

    fn target(&self) -> PathBuf {
        self.target_parent.join("target")
    }

    fn published(&mut self, id: &str) -> &mut Published {
        let i = self
            .volumes
            .iter()
            .position(|(v, _)| v == id)
            .expect("volume created by this spec");
        &mut self.volumes[i].1
    }

    async fn node_id(&mut self) -> String {
        let info = self
            .c
            .node
            .node_get_info(proto::NodeGetInfoRequest {})
            .await
            .unwrap()
            .into_inner();
        assert!(!info.node_id.is_empty());
        info.node_id
    }

    /// The capability the helpers carry: the suite's access type with its access mode.
    fn capability(&self) -> proto::VolumeCapability {
        let mut cap = self.access.clone();
        cap.access_mode = Some(proto::volume_capability::AccessMode {
            mode: self.mode as i32,
        });
        cap
    }

    fn create_req(&self, name: &str, required: i64) -> proto::CreateVolumeRequest {
        proto::CreateVolumeRequest {
            name: name.into(),
            volume_capabilities: vec![self.capability()],
            capacity_range: (required > 0).then_some(proto::CapacityRange {
                required_bytes: required,
                limit_bytes: 0,
            }),
            ..Default::default()
        }
    }

    /// CreateVolume that must succeed; the volume is deleted by cleanup.
    async fn must_create(&mut self, req: proto::CreateVolumeRequest) -> proto::Volume {
        let vol = self
            .c
            .controller
            .create_volume(req)
            .await
            .unwrap()
            .into_inner()
            .volume
            .unwrap();
        assert!(!vol.volume_id.is_empty());
        if !self.volumes.iter().any(|(v, _)| *v == vol.volume_id) {
            self.volumes
                .push((vol.volume_id.clone(), Published::default()));
        }
        vol
    }

    async fn create(&mut self, prefix: &str) -> proto::Volume {
        let name = self.unique(prefix);
        let req = self.create_req(&name, SIZE);
        self.must_create(req).await
    }

    async fn controller_publish(
        &mut self,
        vol: &proto::Volume,
        node: &str,
    ) -> HashMap<String, String> {
        let req = proto::ControllerPublishVolumeRequest {
            volume_id: vol.volume_id.clone(),
            node_id: node.into(),
            volume_capability: Some(self.capability()),
            volume_context: vol.volume_context.clone(),
            readonly: false,
            ..Default::default()
        };
        let resp = self
            .c
            .controller
            .controller_publish_volume(req)
            .await
            .unwrap()
            .into_inner();
        self.published(&vol.volume_id).node = Some(node.to_string());
        resp.publish_context
    }

    async fn node_stage(&mut self, vol: &proto::Volume, ctx: &HashMap<String, String>) {
        let req = proto::NodeStageVolumeRequest {
            volume_id: vol.volume_id.clone(),
            staging_target_path: self.staging.display().to_string(),
            volume_capability: Some(self.capability()),
            volume_context: vol.volume_context.clone(),
            publish_context: ctx.clone(),
            ..Default::default()
        };
        self.c.node.node_stage_volume(req).await.unwrap();
        self.published(&vol.volume_id).staged = true;
    }

    async fn node_publish(&mut self, vol: &proto::Volume, ctx: &HashMap<String, String>) {
        let target = self.target();
        self.node_publish_at(vol, ctx, target).await.unwrap();
    }

    /// NodePublishVolume at `target` (a path in the suite's target directory, which the plugin
    /// creates), recorded for cleanup when it succeeds.
    async fn node_publish_at(
        &mut self,
        vol: &proto::Volume,
        ctx: &HashMap<String, String>,
        target: PathBuf,
    ) -> Result<(), tonic::Status> {
        let req = proto::NodePublishVolumeRequest {
            volume_id: vol.volume_id.clone(),
            staging_target_path: self.staging.display().to_string(),
            target_path: target.display().to_string(),
            volume_capability: Some(self.capability()),
            volume_context: vol.volume_context.clone(),
            publish_context: ctx.clone(),
            ..Default::default()
        };
        self.c.node.node_publish_volume(req).await?;
        let published = self.published(&vol.volume_id);
        if !published.targets.contains(&target) {
            published.targets.push(target);
        }
        Ok(())
    }

    /// The suite's AfterEach: undo everything in CO order, then check nothing is left.
    async fn cleanup(mut self) {
        for (id, p) in std::mem::take(&mut self.volumes) {
            for target in &p.targets {
                let req = proto::NodeUnpublishVolumeRequest {
                    volume_id: id.clone(),
                    target_path: target.display().to_string(),
                };
                self.c.node.node_unpublish_volume(req).await.unwrap();
            }
            if p.staged {
                let req = proto::NodeUnstageVolumeRequest {
                    volume_id: id.clone(),
                    staging_target_path: self.staging.display().to_string(),
                };
                self.c.node.node_unstage_volume(req).await.unwrap();
            }
            if let Some(node) = &p.node {
                let req = proto::ControllerUnpublishVolumeRequest {
                    volume_id: id.clone(),
                    node_id: node.clone(),
                    ..Default::default()
                };
                self.c
                    .controller
                    .controller_unpublish_volume(req)
                    .await
                    .unwrap();
            }
            let req = proto::DeleteVolumeRequest {
                volume_id: id.clone(),
                ..Default::default()
            };
            self.c.controller.delete_volume(req).await.unwrap();
        }
        let left = self
            .c
            .controller
            .list_volumes(proto::ListVolumesRequest::default())
            .await
            .unwrap()
            .into_inner();
        assert!(left.entries.is_empty(), "volumes left: {:?}", left.entries);
        drop(self.tmpfs.take());
        self.sandbox.assert_no_mounts_under();
        self.sandbox.assert_no_loop_devices();
    }
}

/// Runs each spec once per backing.
macro_rules! both_backings {
    ($($name:ident),* $(,)?) => {
        mod dir {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let s = super::suite("dir").await;
                    super::$name(s).await
                }
            )*
        }
        mod loop_backing {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let s = super::suite("loop").await;
                    super::$name(s).await
                }
            )*
        }
    };
}

/// Runs each spec once per backing, the plugin's work dir on a 2 TiB tmpfs: more room than
/// the plugin's default total capacity (1 TiB), so that total decides what GetCapacity says.
macro_rules! both_backings_on_a_roomy_filesystem {
    ($($name:ident),* $(,)?) => {
        mod roomy_dir {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let s = super::suite_on_tmpfs("dir", "2T").await;
                    super::$name(s).await
                }
            )*
        }
        mod roomy_loop_backing {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let s = super::suite_on_tmpfs("loop", "2T").await;
                    super::$name(s).await
                }
            )*
        }
    };
}

/// Runs each spec once per backing, the plugin offering VOLUME_MOUNT_GROUP.
macro_rules! both_backings_offering_volume_mount_group {
    ($($name:ident),* $(,)?) => {
        mod mount_group_dir {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let s = super::suite_offering_volume_mount_group("dir").await;
                    super::$name(s).await
                }
            )*
        }
        mod mount_group_loop_backing {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let s = super::suite_offering_volume_mount_group("loop").await;
                    super::$name(s).await
                }
            )*
        }
    };
}

both_backings_offering_volume_mount_group!(
    volume_mount_group_makes_the_volume_root_writable_for_the_group,
    volume_mount_group_that_is_not_a_gid_is_refused,
);

both_backings_on_a_roomy_filesystem!(
    get_capacity_without_optional_values,
    volumes_of_the_suites_default_size_fit_the_default_capacity,
);

both_backings!(
    identity_get_plugin_info_returns_appropriate_information,
    identity_get_plugin_capabilities_returns_known_capabilities,
    identity_probe_is_ready,
    controller_get_capabilities_returns_known_capabilities,
    list_volumes_returns_appropriate_values,
    list_volumes_rejects_invalid_starting_token,
    list_volumes_shows_new_and_hides_deleted_volumes,
    list_volumes_paginates,
    create_volume_fails_without_name,
    create_volume_fails_without_capabilities,
    create_volume_single_node_writer_no_capacity,
    create_volume_single_node_writer_with_capacity,
    create_volume_same_name_same_capacity_is_idempotent,
    create_volume_same_name_different_capacity_fails,
    create_volume_with_maximum_length_name,
    delete_volume_fails_without_id,
    delete_volume_succeeds_for_unknown_id,
    delete_volume_returns_appropriate_values,
    validate_capabilities_fails_without_id,
    validate_capabilities_fails_without_capabilities,
    validate_capabilities_returns_appropriate_values,
    validate_capabilities_fails_for_unknown_volume,
    controller_publish_fails_without_volume_id,
    controller_publish_fails_without_node_id,
    controller_publish_fails_without_capability,
    controller_publish_fails_for_unknown_volume,
    controller_publish_fails_for_unknown_node,
    controller_publish_fails_when_published_incompatibly,
    controller_volume_lifecycle_works,
    controller_volume_lifecycle_is_idempotent,
    controller_unpublish_fails_without_volume_id,
    node_get_capabilities_returns_known_capabilities,
    node_get_info_returns_appropriate_values,
    node_publish_fails_without_volume_id,
    node_publish_fails_without_target_path,
    node_publish_fails_without_capability,
    node_unpublish_fails_without_volume_id,
    node_unpublish_fails_without_target_path,
    node_unpublish_removes_target_path,
    node_unpublish_fails_for_unknown_volume,
    node_unstage_fails_for_unknown_volume,
    node_stage_fails_without_volume_id,
    node_stage_fails_without_staging_path,
    node_stage_fails_without_capability,
    node_unstage_fails_without_volume_id,
    node_unstage_fails_without_staging_path,
    node_volume_stats_fails_without_volume_id,
    node_volume_stats_fails_without_volume_path,
    node_volume_stats_fails_for_unknown_volume,
    node_volume_stats_fails_for_wrong_path,
    node_full_flow_works,
    node_full_flow_is_idempotent,
    block_volumes_are_served_exactly_by_the_loop_backing,
    block_and_mount_access_do_not_mix,
    block_node_full_flow_places_the_device_at_a_target_file,
    block_node_full_flow_is_idempotent,
    single_node_multi_writer_publishes_at_two_targets,
    single_node_single_writer_refuses_a_second_target,
    xfs_volumes_are_made_by_the_loop_backing_at_its_minimum_size,
    volume_mount_group_is_refused_without_the_capability,
);

// ---- Identity ----

async fn identity_get_plugin_info_returns_appropriate_information(mut s: Suite) {
    let info =
        s.c.identity
            .get_plugin_info(proto::GetPluginInfoRequest {})
            .await
            .unwrap()
            .into_inner();
    assert!(
        !info.name.is_empty() && info.name.len() <= 63,
        "{}",
        info.name
    );
    assert!(!info.vendor_version.is_empty());
    s.cleanup().await;
}

async fn identity_get_plugin_capabilities_returns_known_capabilities(mut s: Suite) {
    use proto::plugin_capability::service::Type;
    let caps =
        s.c.identity
            .get_plugin_capabilities(proto::GetPluginCapabilitiesRequest {})
            .await
            .unwrap()
            .into_inner();
    let mut controller = false;
    for c in &caps.capabilities {
        if let Some(proto::plugin_capability::Type::Service(svc)) = &c.r#type {
            let t = Type::try_from(svc.r#type).expect("known service capability");
            controller |= t == Type::ControllerService;
        }
    }
    assert!(controller, "CONTROLLER_SERVICE offered by default");
    s.cleanup().await;
}

async fn identity_probe_is_ready(mut s: Suite) {
    let probe =
        s.c.identity
            .probe(proto::ProbeRequest {})
            .await
            .unwrap()
            .into_inner();
    assert_ne!(probe.ready, Some(false));
    s.cleanup().await;
}

// ---- Controller ----

async fn controller_get_capabilities_returns_known_capabilities(mut s: Suite) {
    use proto::controller_service_capability::rpc::Type;
    let caps =
        s.c.controller
            .controller_get_capabilities(proto::ControllerGetCapabilitiesRequest {})
            .await
            .unwrap()
            .into_inner();
    let mut seen = HashSet::new();
    for c in &caps.capabilities {
        let Some(proto::controller_service_capability::Type::Rpc(rpc)) = &c.r#type else {
            panic!("capability without rpc: {c:?}");
        };
        let t = Type::try_from(rpc.r#type).expect("known controller capability");
        assert_ne!(t, Type::Unknown);
        seen.insert(t);
    }
    for want in [
        Type::CreateDeleteVolume,
        Type::PublishUnpublishVolume,
        Type::ListVolumes,
        Type::GetCapacity,
        Type::ListVolumesPublishedNodes,
        Type::SingleNodeMultiWriter,
    ] {
        assert!(seen.contains(&want), "{want:?} missing");
    }
    s.cleanup().await;
}

async fn get_capacity_without_optional_values(mut s: Suite) {
    let before =
        s.c.controller
            .get_capacity(proto::GetCapacityRequest::default())
            .await
            .unwrap()
            .into_inner();
    let vol = s.create("sanity-capacity").await;
    let after =
        s.c.controller
            .get_capacity(proto::GetCapacityRequest::default())
            .await
            .unwrap()
            .into_inner();
    assert_eq!(
        after.available_capacity,
        before.available_capacity - vol.capacity_bytes
    );
    s.cleanup().await;
}

async fn list_volumes_returns_appropriate_values(mut s: Suite) {
    s.create("sanity-list").await;
    let vols =
        s.c.controller
            .list_volumes(proto::ListVolumesRequest::default())
            .await
            .unwrap()
            .into_inner();
    for e in &vols.entries {
        assert!(!e.volume.as_ref().unwrap().volume_id.is_empty());
    }
    assert_eq!(vols.entries.len(), 1);
    s.cleanup().await;
}

async fn list_volumes_rejects_invalid_starting_token(mut s: Suite) {
    let req = proto::ListVolumesRequest {
        starting_token: "invalid-token".into(),
        ..Default::default()
    };
    assert_eq!(code(s.c.controller.list_volumes(req).await), Code::Aborted);
    s.cleanup().await;
}

async fn list_volumes_shows_new_and_hides_deleted_volumes(mut s: Suite) {
    let count = |s: &mut Suite| {
        let mut c = s.c.controller.clone();
        async move {
            c.list_volumes(proto::ListVolumesRequest::default())
                .await
                .unwrap()
                .into_inner()
                .entries
                .len()
        }
    };
    let total = count(&mut s).await;
    let req = s.create_req("sanity", 0);
    let vol = s.must_create(req).await;
    assert_eq!(count(&mut s).await, total + 1);
    s.c.controller
        .delete_volume(proto::DeleteVolumeRequest {
            volume_id: vol.volume_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    s.volumes.clear();
    assert_eq!(count(&mut s).await, total);
    s.cleanup().await;
}

async fn list_volumes_paginates(mut s: Suite) {
    let mut created = HashSet::new();
    for _ in 0..5 {
        created.insert(s.create("sanity-page").await.volume_id);
    }
    let mut seen = Vec::new();
    let mut token = String::new();
    loop {
        let req = proto::ListVolumesRequest {
            max_entries: 2,
            starting_token: token.clone(),
        };
        let page = s.c.controller.list_volumes(req).await.unwrap().into_inner();
        assert!(page.entries.len() <= 2);
        seen.extend(
            page.entries
                .into_iter()
                .map(|e| e.volume.unwrap().volume_id),
        );
        if page.next_token.is_empty() {
            break;
        }
        token = page.next_token;
    }
    assert_eq!(seen.len(), 5, "no duplicates: {seen:?}");
    assert_eq!(seen.into_iter().collect::<HashSet<_>>(), created);
    s.cleanup().await;
}

/// csi-sanity's default TestVolumeSize is 10 GiB, and its pagination spec creates several
/// volumes of it: the plugin's default capacity must hold them where the filesystem has the
/// room (loop images are sparse, and mkfs.ext4 of a 10 GiB image stays fast). On a smaller
/// disk the plugin refuses what it could not hold (see tests/capacity.rs): run csi-sanity with
/// `--csi.testvolumesize` below the free space then.
async fn volumes_of_the_suites_default_size_fit_the_default_capacity(mut s: Suite) {
    const TEN_GIB: i64 = 10 << 30;
    let mut created = HashSet::new();
    for _ in 0..4 {
        let name = s.unique("sanity-default-size");
        let req = s.create_req(&name, TEN_GIB);
        let vol = s.must_create(req).await;
        assert!(vol.capacity_bytes >= TEN_GIB);
        created.insert(vol.volume_id);
    }
    let mut seen = HashSet::new();
    let mut token = String::new();
    loop {
        let req = proto::ListVolumesRequest {
            max_entries: 3,
            starting_token: token.clone(),
        };
        let page = s.c.controller.list_volumes(req).await.unwrap().into_inner();
        seen.extend(
            page.entries
                .into_iter()
                .map(|e| e.volume.unwrap().volume_id),
        );
        if page.next_token.is_empty() {
            break;
        }
        token = page.next_token;
    }
    assert_eq!(seen, created);
    let capacity =
        s.c.controller
            .get_capacity(proto::GetCapacityRequest::default())
            .await
            .unwrap()
            .into_inner();
    assert_eq!(capacity.available_capacity, (1 << 40) - 4 * TEN_GIB);
    s.cleanup().await;
}

async fn create_volume_fails_without_name(mut s: Suite) {
    let req = proto::CreateVolumeRequest::default();
    assert_eq!(
        code(s.c.controller.create_volume(req).await),
        Code::InvalidArgument
    );
    s.cleanup().await;
}

async fn create_volume_fails_without_capabilities(mut s: Suite) {
    let req = proto::CreateVolumeRequest {
        name: s.unique("sanity-controller-create-no-volume-capabilities"),
        ..Default::default()
    };
    assert_eq!(
        code(s.c.controller.create_volume(req).await),
        Code::InvalidArgument
    );
    s.cleanup().await;
}

async fn create_volume_single_node_writer_no_capacity(mut s: Suite) {
    let name = s.unique("sanity-controller-create-single-no-capacity");
    let req = s.create_req(&name, 0);
    let vol = s.must_create(req).await;
    assert!(vol.capacity_bytes > 0);
    s.cleanup().await;
}

async fn create_volume_single_node_writer_with_capacity(mut s: Suite) {
    let name = s.unique("sanity-controller-create-single-with-capacity");
    let req = s.create_req(&name, SIZE);
    let vol = s.must_create(req).await;
    assert!(vol.capacity_bytes >= SIZE);
    s.cleanup().await;
}

async fn create_volume_same_name_same_capacity_is_idempotent(mut s: Suite) {
    let name = s.unique("sanity-controller-create-twice");
    let req = s.create_req(&name, SIZE);
    let v1 = s.must_create(req.clone()).await;
    let v2 = s.must_create(req).await;
    assert!(v1.capacity_bytes >= SIZE && v2.capacity_bytes >= SIZE);
    assert_eq!(v1.volume_id, v2.volume_id);
    s.cleanup().await;
}

async fn create_volume_same_name_different_capacity_fails(mut s: Suite) {
    let name = s.unique("sanity-controller-create-twice-different");
    let mut req = s.create_req(&name, SIZE);
    req.capacity_range.as_mut().unwrap().limit_bytes = SIZE;
    s.must_create(req).await;
    let mut req = s.create_req(&name, 2 * SIZE);
    req.capacity_range.as_mut().unwrap().limit_bytes = 2 * SIZE;
    assert_eq!(
        code(s.c.controller.create_volume(req).await),
        Code::AlreadyExists
    );
    s.cleanup().await;
}

async fn create_volume_with_maximum_length_name(mut s: Suite) {
    let mut name = s.unique("sanity-controller-create-maxlen");
    while name.len() < 128 {
        name.push('x');
    }
    let req = s.create_req(&name, SIZE);
    let vol = s.must_create(req).await;
    assert!(vol.capacity_bytes >= SIZE);
    s.cleanup().await;
}

async fn delete_volume_fails_without_id(mut s: Suite) {
    let req = proto::DeleteVolumeRequest::default();
    assert_eq!(
        code(s.c.controller.delete_volume(req).await),
        Code::InvalidArgument
    );
    s.cleanup().await;
}

async fn delete_volume_succeeds_for_unknown_id(mut s: Suite) {
    let req = proto::DeleteVolumeRequest {
        volume_id: "fake-volume-id".into(),
        ..Default::default()
    };
    s.c.controller.delete_volume(req).await.unwrap();
    s.cleanup().await;
}

async fn delete_volume_returns_appropriate_values(mut s: Suite) {
    let vol = s.create("sanity-controller-create-appropriate").await;
    let req = proto::DeleteVolumeRequest {
        volume_id: vol.volume_id,
        ..Default::default()
    };
    s.c.controller.delete_volume(req).await.unwrap();
    s.volumes.clear();
    s.cleanup().await;
}

async fn validate_capabilities_fails_without_id(mut s: Suite) {
    let req = proto::ValidateVolumeCapabilitiesRequest::default();
    assert_eq!(
        code(s.c.controller.validate_volume_capabilities(req).await),
        Code::InvalidArgument
    );
    s.cleanup().await;
}

async fn validate_capabilities_fails_without_capabilities(mut s: Suite) {
    let vol = s.create("sanity-controller-validate-nocaps").await;
    let req = proto::ValidateVolumeCapabilitiesRequest {
        volume_id: vol.volume_id,
        ..Default::default()
    };
    assert_eq!(
        code(s.c.controller.validate_volume_capabilities(req).await),
        Code::InvalidArgument
    );
    s.cleanup().await;
}

async fn validate_capabilities_returns_appropriate_values(mut s: Suite) {
    let vol = s.create("sanity-controller-validate").await;
    let req = proto::ValidateVolumeCapabilitiesRequest {
        volume_id: vol.volume_id,
        volume_capabilities: vec![cap()],
        ..Default::default()
    };
    let resp =
        s.c.controller
            .validate_volume_capabilities(req)
            .await
            .unwrap()
            .into_inner();
    let confirmed = resp.confirmed.expect("a mount capability is supported");
    assert!(!confirmed.volume_capabilities.is_empty());
    s.cleanup().await;
}

async fn validate_capabilities_fails_for_unknown_volume(mut s: Suite) {
    let req = proto::ValidateVolumeCapabilitiesRequest {
        volume_id: "fake-volume-id".into(),
        volume_capabilities: vec![cap()],
        ..Default::default()
    };
    assert_eq!(
        code(s.c.controller.validate_volume_capabilities(req).await),
        Code::NotFound
    );
    s.cleanup().await;
}

async fn controller_publish_fails_without_volume_id(mut s: Suite) {
    let req = proto::ControllerPublishVolumeRequest::default();
    assert_eq!(
        code(s.c.controller.controller_publish_volume(req).await),
        Code::InvalidArgument
    );
    s.cleanup().await;
}

async fn controller_publish_fails_without_node_id(mut s: Suite) {
    let req = proto::ControllerPublishVolumeRequest {
        volume_id: "fake-volume-id".into(),
        ..Default::default()
    };
    assert_eq!(
        code(s.c.controller.controller_publish_volume(req).await),
        Code::InvalidArgument
    );
    s.cleanup().await;
}

async fn controller_publish_fails_without_capability(mut s: Suite) {
    let req = proto::ControllerPublishVolumeRequest {
        volume_id: "fake-volume-id".into(),
        node_id: "fake-node-id".into(),
        ..Default::default()
    };
    assert_eq!(
        code(s.c.controller.controller_publish_volume(req).await),
        Code::InvalidArgument
    );
    s.cleanup().await;
}

async fn controller_publish_fails_for_unknown_volume(mut s: Suite) {
    let req = proto::ControllerPublishVolumeRequest {
        volume_id: "fake-volume-id".into(),
        node_id: "fake-node-id".into(),
        volume_capability: Some(cap()),
        ..Default::default()
    };
    assert_eq!(
        code(s.c.controller.controller_publish_volume(req).await),
        Code::NotFound
    );
    s.cleanup().await;
}

async fn controller_publish_fails_for_unknown_node(mut s: Suite) {
    let vol = s.create("sanity-controller-wrong-node").await;
    let req = proto::ControllerPublishVolumeRequest {
        volume_id: vol.volume_id,
        node_id: "fake-node-id".into(),
        volume_capability: Some(cap()),
        ..Default::default()
    };
    assert_eq!(
        code(s.c.controller.controller_publish_volume(req).await),
        Code::NotFound
    );
    s.cleanup().await;
}

async fn controller_publish_fails_when_published_incompatibly(mut s: Suite) {
    let vol = s.create("sanity-controller-published-incompatible").await;
    let node = s.node_id().await;
    s.controller_publish(&vol, &node).await;
    let req = proto::ControllerPublishVolumeRequest {
        volume_id: vol.volume_id.clone(),
        node_id: node,
        volume_capability: Some(cap()),
        readonly: true,
        ..Default::default()
    };
    assert_eq!(
        code(s.c.controller.controller_publish_volume(req).await),
        Code::AlreadyExists
    );
    s.cleanup().await;
}

/// csi-sanity's VolumeLifecycle: create, ControllerPublish `count` times, ControllerUnpublish
/// `count` times, delete.
async fn volume_lifecycle(mut s: Suite, count: usize) {
    let node = s.node_id().await;
    let vol = s.create("sanity-controller-publish").await;
    let mut contexts = HashSet::new();
    for _ in 0..count {
        let ctx = s.controller_publish(&vol, &node).await;
        contexts.insert(format!(
            "{:?}",
            ctx.into_iter()
                .collect::<std::collections::BTreeMap<_, _>>()
        ));
    }
    assert_eq!(
        contexts.len(),
        1,
        "a repeated publish returns the same publish_context"
    );
    for _ in 0..count {
        let req = proto::ControllerUnpublishVolumeRequest {
            volume_id: vol.volume_id.clone(),
            node_id: node.clone(),
            ..Default::default()
        };
        s.c.controller
            .controller_unpublish_volume(req)
            .await
            .unwrap();
    }
    s.published(&vol.volume_id).node = None;
    s.cleanup().await;
}

async fn controller_volume_lifecycle_works(s: Suite) {
    volume_lifecycle(s, 1).await;
}

async fn controller_volume_lifecycle_is_idempotent(s: Suite) {
    volume_lifecycle(s, 3).await;
}

async fn controller_unpublish_fails_without_volume_id(mut s: Suite) {
    let req = proto::ControllerUnpublishVolumeRequest::default();
    assert_eq!(
        code(s.c.controller.controller_unpublish_volume(req).await),
        Code::InvalidArgument
    );
    s.cleanup().await;
}

// ---- Node ----

async fn node_get_capabilities_returns_known_capabilities(mut s: Suite) {
    use proto::node_service_capability::rpc::Type;
    let caps =
        s.c.node
            .node_get_capabilities(proto::NodeGetCapabilitiesRequest {})
            .await
            .unwrap()
            .into_inner();
    let mut seen = HashSet::new();
    for c in &caps.capabilities {
        let Some(proto::node_service_capability::Type::Rpc(rpc)) = &c.r#type else {
            panic!("capability without rpc: {c:?}");
        };
        seen.insert(Type::try_from(rpc.r#type).expect("known node capability"));
    }
    assert!(seen.contains(&Type::StageUnstageVolume));
    assert!(seen.contains(&Type::GetVolumeStats));
    assert!(seen.contains(&Type::SingleNodeMultiWriter));
    s.cleanup().await;
}

async fn node_get_info_returns_appropriate_values(mut s: Suite) {
    let info =
        s.c.node
            .node_get_info(proto::NodeGetInfoRequest {})
            .await
            .unwrap()
            .into_inner();
    assert!(!info.node_id.is_empty());
    assert!(info.max_volumes_per_node >= 0);
    s.cleanup().await;
}

async fn node_publish_fails_without_volume_id(mut s: Suite) {
    let req = proto::NodePublishVolumeRequest::default();
    assert_eq!(
        code(s.c.node.node_publish_volume(req).await),
        Code::InvalidArgument
    );
    s.cleanup().await;
}

async fn node_publish_fails_without_target_path(mut s: Suite) {
    let req = proto::NodePublishVolumeRequest {
        volume_id: "fake-volume-id".into(),
        ..Default::default()
    };
    assert_eq!(
        code(s.c.node.node_publish_volume(req).await),
        Code::InvalidArgument
    );
    s.cleanup().await;
}

async fn node_publish_fails_without_capability(mut s: Suite) {
    let req = proto::NodePublishVolumeRequest {
        volume_id: "fake-volume-id".into(),
        target_path: s.target().display().to_string(),
        ..Default::default()
    };
    assert_eq!(
        code(s.c.node.node_publish_volume(req).await),
        Code::InvalidArgument
    );
    s.cleanup().await;
}

async fn node_unpublish_fails_without_volume_id(mut s: Suite) {
    let req = proto::NodeUnpublishVolumeRequest::default();
    assert_eq!(
        code(s.c.node.node_unpublish_volume(req).await),
        Code::InvalidArgument
    );
    s.cleanup().await;
}

async fn node_unpublish_fails_without_target_path(mut s: Suite) {
    let req = proto::NodeUnpublishVolumeRequest {
        volume_id: "fake-volume-id".into(),
        ..Default::default()
    };
    assert_eq!(
        code(s.c.node.node_unpublish_volume(req).await),
        Code::InvalidArgument
    );
    s.cleanup().await;
}

async fn node_unpublish_removes_target_path(mut s: Suite) {
    let vol = s.create("sanity-node-unpublish-volume").await;
    let node = s.node_id().await;
    let ctx = s.controller_publish(&vol, &node).await;
    s.node_stage(&vol, &ctx).await;
    s.node_publish(&vol, &ctx).await;
    let target = s.target();
    assert!(target.is_dir(), "the plugin creates the target");
    let req = proto::NodeUnpublishVolumeRequest {
        volume_id: vol.volume_id.clone(),
        target_path: target.display().to_string(),
    };
    s.c.node.node_unpublish_volume(req).await.unwrap();
    assert!(!target.exists(), "the plugin removes the target it created");
    s.cleanup().await;
}

/// The spec's "Volume does not exist" (NOT_FOUND); the CO's directory stays.
async fn node_unpublish_fails_for_unknown_volume(mut s: Suite) {
    let target = s.target();
    std::fs::create_dir(&target).unwrap();
    let req = proto::NodeUnpublishVolumeRequest {
        volume_id: "fake-volume-id".into(),
        target_path: target.display().to_string(),
    };
    assert_eq!(
        code(s.c.node.node_unpublish_volume(req).await),
        Code::NotFound
    );
    assert!(target.is_dir());
    std::fs::remove_dir(&target).unwrap();
    s.cleanup().await;
}

async fn node_unstage_fails_for_unknown_volume(mut s: Suite) {
    let req = proto::NodeUnstageVolumeRequest {
        volume_id: "fake-volume-id".into(),
        staging_target_path: s.staging.display().to_string(),
    };
    assert_eq!(
        code(s.c.node.node_unstage_volume(req).await),
        Code::NotFound
    );
    assert!(s.staging.is_dir());
    s.cleanup().await;
}

async fn node_stage_fails_without_volume_id(mut s: Suite) {
    let req = proto::NodeStageVolumeRequest {
        staging_target_path: s.staging.display().to_string(),
        volume_capability: Some(cap()),
        publish_context: HashMap::from([("device".to_string(), "/dev/mock".to_string())]),
        ..Default::default()
    };
    assert_eq!(
        code(s.c.node.node_stage_volume(req).await),
        Code::InvalidArgument
    );
    s.cleanup().await;
}

async fn node_stage_fails_without_staging_path(mut s: Suite) {
    let req = proto::NodeStageVolumeRequest {
        volume_id: "fake-volume-id".into(),
        volume_capability: Some(cap()),
        publish_context: HashMap::from([("device".to_string(), "/dev/mock".to_string())]),
        ..Default::default()
    };
    assert_eq!(
        code(s.c.node.node_stage_volume(req).await),
        Code::InvalidArgument
    );
    s.cleanup().await;
}

async fn node_stage_fails_without_capability(mut s: Suite) {
    let vol = s.create("sanity-node-stage-nocaps").await;
    let req = proto::NodeStageVolumeRequest {
        volume_id: vol.volume_id,
        staging_target_path: s.staging.display().to_string(),
        publish_context: HashMap::from([("device".to_string(), "/dev/mock".to_string())]),
        ..Default::default()
    };
    assert_eq!(
        code(s.c.node.node_stage_volume(req).await),
        Code::InvalidArgument
    );
    s.cleanup().await;
}

async fn node_unstage_fails_without_volume_id(mut s: Suite) {
    let req = proto::NodeUnstageVolumeRequest {
        staging_target_path: s.staging.display().to_string(),
        ..Default::default()
    };
    assert_eq!(
        code(s.c.node.node_unstage_volume(req).await),
        Code::InvalidArgument
    );
    s.cleanup().await;
}

async fn node_unstage_fails_without_staging_path(mut s: Suite) {
    let req = proto::NodeUnstageVolumeRequest {
        volume_id: "fake-volume-id".into(),
        ..Default::default()
    };
    assert_eq!(
        code(s.c.node.node_unstage_volume(req).await),
        Code::InvalidArgument
    );
    s.cleanup().await;
}

async fn node_volume_stats_fails_without_volume_id(mut s: Suite) {
    let req = proto::NodeGetVolumeStatsRequest {
        volume_path: "some/path".into(),
        ..Default::default()
    };
    assert_eq!(
        code(s.c.node.node_get_volume_stats(req).await),
        Code::InvalidArgument
    );
    s.cleanup().await;
}

async fn node_volume_stats_fails_without_volume_path(mut s: Suite) {
    let req = proto::NodeGetVolumeStatsRequest {
        volume_id: "fake-volume-id".into(),
        ..Default::default()
    };
    assert_eq!(
        code(s.c.node.node_get_volume_stats(req).await),
        Code::InvalidArgument
    );
    s.cleanup().await;
}

async fn node_volume_stats_fails_for_unknown_volume(mut s: Suite) {
    let req = proto::NodeGetVolumeStatsRequest {
        volume_id: "fake-volume-id".into(),
        volume_path: "some/path".into(),
        ..Default::default()
    };
    assert_eq!(
        code(s.c.node.node_get_volume_stats(req).await),
        Code::NotFound
    );
    s.cleanup().await;
}

async fn node_volume_stats_fails_for_wrong_path(mut s: Suite) {
    let vol = s.create("sanity-node-get-volume-stats").await;
    let node = s.node_id().await;
    let ctx = s.controller_publish(&vol, &node).await;
    s.node_stage(&vol, &ctx).await;
    s.node_publish(&vol, &ctx).await;
    for path in [
        "some/path".to_string(),
        s.target_parent.display().to_string(),
    ] {
        let req = proto::NodeGetVolumeStatsRequest {
            volume_id: vol.volume_id.clone(),
            volume_path: path.clone(),
            ..Default::default()
        };
        assert_eq!(
            code(s.c.node.node_get_volume_stats(req).await),
            Code::NotFound,
            "{path}"
        );
    }
    s.cleanup().await;
}

/// csi-sanity's runControllerTest: create, ControllerPublish, NodeStage and NodePublish
/// `count` times each, NodeGetVolumeStats on the target; cleanup undoes it.
async fn node_full_flow(mut s: Suite, count: usize) {
    let node = s.node_id().await;
    let vol = s.create("sanity-node-full").await;
    let ctx = s.controller_publish(&vol, &node).await;
    for _ in 0..count {
        s.node_stage(&vol, &ctx).await;
    }
    for _ in 0..count {
        s.node_publish(&vol, &ctx).await;
    }
    let req = proto::NodeGetVolumeStatsRequest {
        volume_id: vol.volume_id.clone(),
        volume_path: s.target().display().to_string(),
        ..Default::default()
    };
    let stats =
        s.c.node
            .node_get_volume_stats(req)
            .await
            .unwrap()
            .into_inner();
    assert!(!stats.usage.is_empty());
    let mounts: Vec<_> = s
        .sandbox
        .mounts_under()
        .into_iter()
        .map(|m| m.mount_point)
        .collect();
    assert_eq!(
        mounts.iter().filter(|m| **m == s.target()).count(),
        1,
        "{mounts:?}"
    );
    assert_eq!(
        mounts.iter().filter(|m| **m == s.staging).count(),
        1,
        "{mounts:?}"
    );
    s.cleanup().await;
}

async fn node_full_flow_works(s: Suite) {
    node_full_flow(s, 1).await;
}

async fn node_full_flow_is_idempotent(s: Suite) {
    node_full_flow(s, 3).await;
}

// ---- fs types ----

/// A mount capability asking for `fs_type` and `flags`.
fn mount_with(fs_type: &str, flags: &[&str]) -> proto::VolumeCapability {
    let mut c = cap();
    c.access_type = Some(proto::volume_capability::AccessType::Mount(
        proto::volume_capability::MountVolume {
            fs_type: fs_type.into(),
            mount_flags: flags.iter().map(|f| f.to_string()).collect(),
            ..Default::default()
        },
    ));
    c
}

/// `fs_type` "xfs": the dir backing refuses it INVALID_ARGUMENT (its volumes are directories); the
/// loop backing makes an xfs filesystem, raising a smaller request to the 300 MiB mkfs.xfs makes at
/// least (CSI lets a volume be larger than `required_bytes`) and refusing a `limit_bytes` under it
/// OUT_OF_RANGE naming the minimum; staged and published with mount flags, the target is xfs with
/// them in the mount table, and the volume holds a file.
async fn xfs_volumes_are_made_by_the_loop_backing_at_its_minimum_size(mut s: Suite) {
    const MIN: i64 = 300 << 20;
    s.access = mount_with("xfs", &["noatime", "nosuid", "nodev", "noexec"]);
    let name = s.unique("sanity-xfs");
    if s.backing == "dir" {
        let req = s.create_req(&name, SIZE);
        assert_eq!(
            code(s.c.controller.create_volume(req).await),
            Code::InvalidArgument
        );
        return s.cleanup().await;
    }
    let mut limited = s.create_req(&name, SIZE);
    limited.capacity_range = Some(proto::CapacityRange {
        required_bytes: SIZE,
        limit_bytes: SIZE,
    });
    let refused =
        s.c.controller
            .create_volume(limited)
            .await
            .expect_err("a limit under xfs' minimum");
    assert_eq!(refused.code(), Code::OutOfRange, "{refused:?}");
    assert!(
        refused.message().contains(&MIN.to_string()) && refused.message().contains("xfs"),
        "{}",
        refused.message()
    );
    let req = s.create_req(&name, SIZE);
    let vol = s.must_create(req).await;
    assert_eq!(vol.capacity_bytes, MIN, "raised to the minimum");
    // Exactly the minimum asked as the limit is served too.
    let exact_name = s.unique("sanity-xfs-exact");
    let mut exact = s.create_req(&exact_name, MIN);
    exact.capacity_range = Some(proto::CapacityRange {
        required_bytes: MIN,
        limit_bytes: MIN,
    });
    assert_eq!(s.must_create(exact).await.capacity_bytes, MIN);
    let answer =
        s.c.controller
            .validate_volume_capabilities(proto::ValidateVolumeCapabilitiesRequest {
                volume_id: vol.volume_id.clone(),
                volume_capabilities: vec![s.capability()],
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
    assert!(answer.confirmed.is_some(), "{answer:?}");

    let node = s.node_id().await;
    let ctx = s.controller_publish(&vol, &node).await;
    s.node_stage(&vol, &ctx).await;
    s.node_publish(&vol, &ctx).await;
    let target = s
        .sandbox
        .mounts_under()
        .into_iter()
        .find(|m| m.mount_point == s.target())
        .expect("the target is mounted");
    assert_eq!(target.fs_type, "xfs", "{target:?}");
    for flag in ["noatime", "nosuid", "nodev", "noexec"] {
        assert!(
            target.mount_options.iter().any(|o| o == flag),
            "{flag} missing: {target:?}"
        );
    }
    std::fs::write(s.target().join("f"), "on-xfs").unwrap();
    assert_eq!(
        std::fs::read_to_string(s.target().join("f")).unwrap(),
        "on-xfs"
    );
    s.cleanup().await;
}

// ---- Block volumes ----

fn block() -> proto::VolumeCapability {
    block_capability(Mode::SingleNodeWriter)
}

/// CreateVolume with block access: served by the loop backing, refused INVALID_ARGUMENT by the
/// dir backing (it has no device to give); ValidateVolumeCapabilities and GetCapacity agree.
async fn block_volumes_are_served_exactly_by_the_loop_backing(mut s: Suite) {
    let name = s.unique("sanity-block");
    let mut req = s.create_req(&name, SIZE);
    req.volume_capabilities = vec![block()];
    let capacity =
        s.c.controller
            .get_capacity(proto::GetCapacityRequest {
                volume_capabilities: vec![block()],
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
    if s.backing == "dir" {
        assert_eq!(
            code(s.c.controller.create_volume(req).await),
            Code::InvalidArgument
        );
        assert_eq!(
            capacity.available_capacity, 0,
            "no room for what is not served"
        );
        let vol = s.create("sanity-block-validate").await;
        let answer =
            s.c.controller
                .validate_volume_capabilities(proto::ValidateVolumeCapabilitiesRequest {
                    volume_id: vol.volume_id.clone(),
                    volume_capabilities: vec![block()],
                    ..Default::default()
                })
                .await
                .unwrap()
                .into_inner();
        assert!(answer.confirmed.is_none(), "{answer:?}");
        assert!(answer.message.contains("block"), "{}", answer.message);
    } else {
        assert!(capacity.available_capacity > 0);
        s.access = block();
        let vol = s.must_create(req).await;
        let answer =
            s.c.controller
                .validate_volume_capabilities(proto::ValidateVolumeCapabilitiesRequest {
                    volume_id: vol.volume_id.clone(),
                    volume_capabilities: vec![block()],
                    ..Default::default()
                })
                .await
                .unwrap()
                .into_inner();
        assert!(answer.confirmed.is_some(), "{answer:?}");
    }
    s.cleanup().await;
}

/// A volume is a raw device or a filesystem: CreateVolume mixing both is refused, a block
/// volume is not validated, published or staged for mount access, nor a mount volume for
/// block access, and a same-name CreateVolume with the other access type conflicts.
async fn block_and_mount_access_do_not_mix(mut s: Suite) {
    let name = s.unique("sanity-mixed");
    let mut mixed = s.create_req(&name, SIZE);
    mixed.volume_capabilities = vec![cap(), block()];
    assert_eq!(
        code(s.c.controller.create_volume(mixed).await),
        Code::InvalidArgument
    );
    if s.backing == "dir" {
        return s.cleanup().await;
    }
    let node = s.node_id().await;
    let mount_vol = s.create("sanity-mount-side").await;
    let mut again = s.create_req(
        &format!("sanity-mount-side-{}-{}", std::process::id(), s.counter),
        SIZE,
    );
    again.volume_capabilities = vec![block()];
    assert_eq!(
        code(s.c.controller.create_volume(again).await),
        Code::AlreadyExists
    );
    s.access = block();
    let block_vol = s.create("sanity-block-side").await;
    for (vol, wrong) in [(&mount_vol, block()), (&block_vol, cap())] {
        let answer =
            s.c.controller
                .validate_volume_capabilities(proto::ValidateVolumeCapabilitiesRequest {
                    volume_id: vol.volume_id.clone(),
                    volume_capabilities: vec![wrong.clone()],
                    ..Default::default()
                })
                .await
                .unwrap()
                .into_inner();
        assert!(answer.confirmed.is_none(), "{answer:?}");
        let publish = proto::ControllerPublishVolumeRequest {
            volume_id: vol.volume_id.clone(),
            node_id: node.clone(),
            volume_capability: Some(wrong.clone()),
            ..Default::default()
        };
        assert_eq!(
            code(s.c.controller.controller_publish_volume(publish).await),
            Code::InvalidArgument
        );
    }
    // Node calls: a block volume staged for mount access is refused, and nothing is made.
    let ctx = s.controller_publish(&block_vol, &node).await;
    let stage = proto::NodeStageVolumeRequest {
        volume_id: block_vol.volume_id.clone(),
        staging_target_path: s.staging.display().to_string(),
        volume_capability: Some(cap()),
        publish_context: ctx.clone(),
        ..Default::default()
    };
    assert_eq!(
        code(s.c.node.node_stage_volume(stage).await),
        Code::InvalidArgument
    );
    // Read-only block access is not something this plugin does: refused, not ignored.
    s.node_stage(&block_vol, &ctx).await;
    let publish = proto::NodePublishVolumeRequest {
        volume_id: block_vol.volume_id.clone(),
        staging_target_path: s.staging.display().to_string(),
        target_path: s.target().display().to_string(),
        volume_capability: Some(block()),
        publish_context: ctx,
        readonly: true,
        ..Default::default()
    };
    assert_eq!(
        code(s.c.node.node_publish_volume(publish).await),
        Code::InvalidArgument
    );
    assert!(!s.target().exists(), "nothing made at the target");
    s.cleanup().await;
}

/// csi-sanity's node flow with block access: the plugin creates the target as a file and
/// places the device there (a block device of the volume's size, which keeps what is written
/// through it); stats say the size; NodeUnpublish removes the file.
async fn block_node_full_flow(mut s: Suite, count: usize) {
    use std::io::{Read, Seek, SeekFrom, Write};
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    if s.backing == "dir" {
        // Nor staged or published for block access (a dir volume has no device).
        let vol = s.create("sanity-dir-as-block").await;
        let stage = proto::NodeStageVolumeRequest {
            volume_id: vol.volume_id.clone(),
            staging_target_path: s.staging.display().to_string(),
            volume_capability: Some(block()),
            ..Default::default()
        };
        assert_eq!(
            code(s.c.node.node_stage_volume(stage).await),
            Code::InvalidArgument
        );
        let publish = proto::NodePublishVolumeRequest {
            volume_id: vol.volume_id.clone(),
            staging_target_path: s.staging.display().to_string(),
            target_path: s.target().display().to_string(),
            volume_capability: Some(block()),
            ..Default::default()
        };
        assert_eq!(
            code(s.c.node.node_publish_volume(publish).await),
            Code::InvalidArgument
        );
        assert!(!s.target().exists());
        return s.cleanup().await;
    }
    s.access = block();
    let node = s.node_id().await;
    let vol = s.create("sanity-block-full").await;
    let ctx = s.controller_publish(&vol, &node).await;
    for _ in 0..count {
        s.node_stage(&vol, &ctx).await;
    }
    for _ in 0..count {
        s.node_publish(&vol, &ctx).await;
    }
    let target = s.target();
    let meta = std::fs::metadata(&target).unwrap();
    assert!(meta.file_type().is_block_device(), "{meta:?}");
    // The device there is a loop device of this volume's image, of the volume's size.
    let (major, minor) = (libc::major(meta.rdev()), libc::minor(meta.rdev()));
    let sys = PathBuf::from(format!("/sys/dev/block/{major}:{minor}"));
    let backing = std::fs::read_to_string(sys.join("loop/backing_file")).unwrap();
    assert!(backing.contains(&vol.volume_id), "{backing}");
    let sectors: u64 = std::fs::read_to_string(sys.join("size"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_eq!(sectors * 512, vol.capacity_bytes as u64);
    // A host path is no way into the device: the target is nodev, like every mount the plugin
    // makes (containers get their own clone, or the device by number under their cgroup).
    let opened = std::fs::OpenOptions::new().read(true).open(&target);
    assert_eq!(opened.unwrap_err().raw_os_error(), Some(libc::EACCES));
    // What is written to the device stays there (through the device's own node).
    let node = loop_node(major, minor);
    let mut dev = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&node)
        .unwrap();
    dev.seek(SeekFrom::Start(4096)).unwrap();
    dev.write_all(b"written through the device").unwrap();
    dev.sync_all().unwrap();
    drop(dev);
    let mut again = std::fs::File::open(&node).unwrap();
    again.seek(SeekFrom::Start(4096)).unwrap();
    let mut back = [0u8; 26];
    again.read_exact(&mut back).unwrap();
    assert_eq!(&back, b"written through the device");
    drop(again);
    let req = proto::NodeGetVolumeStatsRequest {
        volume_id: vol.volume_id.clone(),
        volume_path: target.display().to_string(),
        ..Default::default()
    };
    let stats =
        s.c.node
            .node_get_volume_stats(req)
            .await
            .unwrap()
            .into_inner();
    assert_eq!(stats.usage.len(), 1, "{stats:?}");
    assert_eq!(stats.usage[0].total, vol.capacity_bytes);
    let mounts: Vec<_> = s
        .sandbox
        .mounts_under()
        .into_iter()
        .map(|m| m.mount_point)
        .collect();
    assert_eq!(
        mounts.iter().filter(|m| **m == target).count(),
        1,
        "{mounts:?}"
    );
    let unpublish = proto::NodeUnpublishVolumeRequest {
        volume_id: vol.volume_id.clone(),
        target_path: target.display().to_string(),
    };
    s.c.node.node_unpublish_volume(unpublish).await.unwrap();
    assert!(!target.exists(), "NodeUnpublish removes the target file");
    s.published(&vol.volume_id).targets.clear();
    s.cleanup().await;
}

/// `/dev/loopN` of a loop device's numbers.
fn loop_node(major: u32, minor: u32) -> PathBuf {
    use std::os::unix::fs::MetadataExt;
    std::fs::read_dir("/dev")
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("loop"))
        })
        .find(|p| std::fs::metadata(p).is_ok_and(|m| m.rdev() == libc::makedev(major, minor)))
        .expect("the loop device's node in /dev")
}

async fn block_node_full_flow_places_the_device_at_a_target_file(s: Suite) {
    block_node_full_flow(s, 1).await;
}

async fn block_node_full_flow_is_idempotent(s: Suite) {
    block_node_full_flow(s, 3).await;
}

// ---- SINGLE_NODE_MULTI_WRITER (the node capability, and the two access modes it allows) ----

/// csi-sanity's SINGLE_NODE_MULTI_WRITER spec: a volume of that mode published at two target
/// paths of one node, each a mount of the volume, each seeing what the other writes.
async fn single_node_multi_writer_publishes_at_two_targets(mut s: Suite) {
    s.mode = Mode::SingleNodeMultiWriter;
    let node = s.node_id().await;
    let vol = s.create("sanity-snmw").await;
    let ctx = s.controller_publish(&vol, &node).await;
    s.node_stage(&vol, &ctx).await;
    let (first, second) = (s.target_parent.join("a"), s.target_parent.join("b"));
    for target in [&first, &second] {
        s.node_publish_at(&vol, &ctx, target.clone()).await.unwrap();
    }
    let mounts: Vec<_> = s
        .sandbox
        .mounts_under()
        .into_iter()
        .map(|m| m.mount_point)
        .collect();
    for target in [&first, &second] {
        assert_eq!(
            mounts.iter().filter(|m| *m == target).count(),
            1,
            "{mounts:?}"
        );
    }
    std::fs::write(first.join("from-a"), b"shared").unwrap();
    assert_eq!(std::fs::read(second.join("from-a")).unwrap(), b"shared");
    s.cleanup().await;
}

/// csi-sanity's SINGLE_NODE_SINGLE_WRITER spec: published at one target, a second target path
/// is FAILED_PRECONDITION (the CO exceeded the volume's capability) and nothing is made there;
/// the first publish is repeatable.
async fn single_node_single_writer_refuses_a_second_target(mut s: Suite) {
    s.mode = Mode::SingleNodeSingleWriter;
    let node = s.node_id().await;
    let vol = s.create("sanity-snsw").await;
    let ctx = s.controller_publish(&vol, &node).await;
    s.node_stage(&vol, &ctx).await;
    let (first, second) = (s.target_parent.join("a"), s.target_parent.join("b"));
    s.node_publish_at(&vol, &ctx, first.clone()).await.unwrap();
    let status = s
        .node_publish_at(&vol, &ctx, second.clone())
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    assert!(
        status.message().contains("SINGLE_NODE_SINGLE_WRITER"),
        "{}",
        status.message()
    );
    assert!(!second.exists(), "nothing made at the second target");
    s.node_publish_at(&vol, &ctx, first).await.unwrap();
    s.cleanup().await;
}

// ---- VOLUME_MOUNT_GROUP ----

/// The suite's mount capability carrying `volume_mount_group` = `group`.
fn with_mount_group(group: &str) -> proto::VolumeCapability {
    let mut c = cap();
    if let Some(proto::volume_capability::AccessType::Mount(m)) = c.access_type.as_mut() {
        m.volume_mount_group = group.to_string();
    }
    c
}

fn node_capabilities_have(caps: &proto::NodeGetCapabilitiesResponse, want: i32) -> bool {
    caps.capabilities.iter().any(|c| {
        matches!(&c.r#type, Some(proto::node_service_capability::Type::Rpc(rpc)) if rpc.r#type == want)
    })
}

/// A plugin with VOLUME_MOUNT_GROUP makes the volume accessible to the group NodeStage and
/// NodePublish carry (the spec: readable and writable by it, new entries too): the root
/// gets the group and g+rwxs, and a process of another user in that group writes there.
async fn volume_mount_group_makes_the_volume_root_writable_for_the_group(mut s: Suite) {
    use std::os::unix::fs::MetadataExt;
    use std::os::unix::process::CommandExt;
    let caps =
        s.c.node
            .node_get_capabilities(proto::NodeGetCapabilitiesRequest {})
            .await
            .unwrap()
            .into_inner();
    let group = proto::node_service_capability::rpc::Type::VolumeMountGroup as i32;
    assert!(node_capabilities_have(&caps, group), "{caps:?}");
    s.access = with_mount_group("5678");
    let node = s.node_id().await;
    let vol = s.create("sanity-mount-group").await;
    let ctx = s.controller_publish(&vol, &node).await;
    s.node_stage(&vol, &ctx).await;
    s.node_publish(&vol, &ctx).await;
    // Repeated, as a CO retries: the same answer, nothing changed.
    s.node_stage(&vol, &ctx).await;
    s.node_publish(&vol, &ctx).await;
    for root in [s.staging.clone(), s.target()] {
        let meta = std::fs::metadata(&root).unwrap();
        assert_eq!(meta.gid(), 5678, "{}", root.display());
        assert_eq!(
            meta.mode() & 0o2070,
            0o2070,
            "{}: {:o}",
            root.display(),
            meta.mode()
        );
        assert_eq!(meta.uid(), 0, "the owner is left as it was");
    }
    let written = s.target().join("from-the-group");
    let status = std::process::Command::new("/bin/sh")
        .arg("-c")
        .arg(format!("echo data > '{}'", written.display()))
        .uid(1234)
        .gid(5678)
        .status()
        .unwrap();
    assert!(status.success(), "uid 1234 gid 5678 could not write");
    let meta = std::fs::metadata(&written).unwrap();
    assert_eq!(
        (meta.uid(), meta.gid()),
        (1234, 5678),
        "set-group-id keeps the group"
    );
    s.cleanup().await;
}

/// A `volume_mount_group` that is not a decimal gid is INVALID_ARGUMENT, in NodeStage and in
/// NodePublish, before anything is mounted.
async fn volume_mount_group_that_is_not_a_gid_is_refused(mut s: Suite) {
    let node = s.node_id().await;
    let vol = s.create("sanity-bad-group").await;
    let ctx = s.controller_publish(&vol, &node).await;
    for bad in [
        "staff",
        "-1",
        " 5",
        "5x",
        "4294967295",
        "4294967296",
        "99999999999999999999",
    ] {
        s.access = with_mount_group(bad);
        let req = proto::NodeStageVolumeRequest {
            volume_id: vol.volume_id.clone(),
            staging_target_path: s.staging.display().to_string(),
            volume_capability: Some(s.capability()),
            volume_context: vol.volume_context.clone(),
            publish_context: ctx.clone(),
            ..Default::default()
        };
        let status = s.c.node.node_stage_volume(req).await.unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{bad}: {status:?}");
        assert!(
            status.message().contains("volume_mount_group"),
            "{}",
            status.message()
        );
        assert!(s.sandbox.mounts_under().is_empty(), "{bad}: mounted");
    }
    s.access = cap();
    s.node_stage(&vol, &ctx).await;
    for bad in ["staff", "4294967295"] {
        s.access = with_mount_group(bad);
        let target = s.target();
        let status = s
            .node_publish_at(&vol, &ctx, target.clone())
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{bad}: {status:?}");
        assert!(!target.exists(), "{bad}: nothing made at the target");
    }
    s.cleanup().await;
}

/// Without VOLUME_MOUNT_GROUP the plugin does not advertise it and refuses a request that
/// carries a group (a CO must not send one): csi-isolator's own tests against this plugin
/// with non-root workloads therefore show that it sends none then.
async fn volume_mount_group_is_refused_without_the_capability(mut s: Suite) {
    let caps =
        s.c.node
            .node_get_capabilities(proto::NodeGetCapabilitiesRequest {})
            .await
            .unwrap()
            .into_inner();
    let group = proto::node_service_capability::rpc::Type::VolumeMountGroup as i32;
    assert!(!node_capabilities_have(&caps, group), "{caps:?}");
    let node = s.node_id().await;
    let vol = s.create("sanity-no-group-cap").await;
    let ctx = s.controller_publish(&vol, &node).await;
    s.access = with_mount_group("5678");
    let req = proto::NodeStageVolumeRequest {
        volume_id: vol.volume_id.clone(),
        staging_target_path: s.staging.display().to_string(),
        volume_capability: Some(s.capability()),
        volume_context: vol.volume_context.clone(),
        publish_context: ctx.clone(),
        ..Default::default()
    };
    let status = s.c.node.node_stage_volume(req).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(
        status.message().contains("VOLUME_MOUNT_GROUP"),
        "{}",
        status.message()
    );
    s.access = cap();
    s.cleanup().await;
}
