//! The test plugin's volume lifecycle against the real kernel, over its socket, for both
//! backings: every step twice (idempotency), read-only and read-write publishes, out-of-order
//! calls, capability switches, restarts and fault injection. Every test ends with no mount and
//! no loop device left behind by the plugin (asserted before the sandbox's own cleanup).

use csi_isolator_testing::plugin_bin;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use csi_isolator::csi::proto;
use csi_isolator::csi::proto::volume_capability::access_mode::Mode;
use csi_isolator_testing::{
    block_capability, mount_capability, raw_clients, require_root, PluginProcess, RawClients,
    Sandbox,
};
use tonic::Code;

const NODE: &str = "test-node";
const MIB: i64 = 1 << 20;

struct Env {
    sandbox: Sandbox,
    plugin: PluginProcess,
    c: RawClients,
    /// The plugin's faults file (initially empty): tests change faults by rewriting it.
    faults: PathBuf,
}

async fn setup(backing: &'static str, extra: &[&str]) -> Env {
    require_root();
    let sandbox = Sandbox::new("plugin-lifecycle");
    let faults = sandbox.join("faults");
    std::fs::write(&faults, "").unwrap();
    let faults_arg = faults.display().to_string();
    let mut args = vec![
        "--backing",
        backing,
        "--node-id",
        NODE,
        "--faults-file",
        &faults_arg,
    ];
    args.extend_from_slice(extra);
    let plugin = PluginProcess::start(&sandbox, plugin_bin(), &args).await;
    let c = raw_clients(&plugin.socket())
        .await
        .expect("connect to plugin");
    Env {
        sandbox,
        plugin,
        c,
        faults,
    }
}

impl Env {
    async fn reconnect(&mut self) {
        self.c = raw_clients(&self.plugin.socket())
            .await
            .expect("reconnect to plugin");
    }

    /// The directory the CO would create for a target (the plugin creates the target itself).
    fn target(&self, name: &str) -> PathBuf {
        self.sandbox.mkdir(format!("co/pods/{name}")).join("target")
    }

    fn staging(&self, name: &str) -> PathBuf {
        self.sandbox.mkdir(format!("co/staging/{name}"))
    }

    fn finish(self) {
        self.sandbox.assert_no_mounts_under();
        self.sandbox.assert_no_loop_devices();
    }

    async fn create(&mut self, name: &str, bytes: i64) -> Result<proto::Volume, tonic::Status> {
        let req = proto::CreateVolumeRequest {
            name: name.into(),
            capacity_range: Some(proto::CapacityRange {
                required_bytes: bytes,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![mount_capability(Mode::SingleNodeWriter)],
            ..Default::default()
        };
        Ok(self
            .c
            .controller
            .create_volume(req)
            .await?
            .into_inner()
            .volume
            .expect("volume"))
    }

    async fn delete(&mut self, id: &str) -> Result<(), tonic::Status> {
        let req = proto::DeleteVolumeRequest {
            volume_id: id.into(),
            ..Default::default()
        };
        self.c.controller.delete_volume(req).await.map(drop)
    }

    async fn cpublish(
        &mut self,
        id: &str,
        readonly: bool,
    ) -> Result<HashMap<String, String>, tonic::Status> {
        let req = proto::ControllerPublishVolumeRequest {
            volume_id: id.into(),
            node_id: NODE.into(),
            volume_capability: Some(mount_capability(Mode::SingleNodeWriter)),
            readonly,
            ..Default::default()
        };
        Ok(self
            .c
            .controller
            .controller_publish_volume(req)
            .await?
            .into_inner()
            .publish_context)
    }

    async fn cunpublish(&mut self, id: &str) -> Result<(), tonic::Status> {
        let req = proto::ControllerUnpublishVolumeRequest {
            volume_id: id.into(),
            node_id: NODE.into(),
            ..Default::default()
        };
        self.c
            .controller
            .controller_unpublish_volume(req)
            .await
            .map(drop)
    }

    async fn stage(
        &mut self,
        id: &str,
        staging: &Path,
        ctx: &HashMap<String, String>,
    ) -> Result<(), tonic::Status> {
        let req = proto::NodeStageVolumeRequest {
            volume_id: id.into(),
            staging_target_path: staging.display().to_string(),
            volume_capability: Some(mount_capability(Mode::SingleNodeWriter)),
            publish_context: ctx.clone(),
            ..Default::default()
        };
        self.c.node.node_stage_volume(req).await.map(drop)
    }

    async fn unstage(&mut self, id: &str, staging: &Path) -> Result<(), tonic::Status> {
        let req = proto::NodeUnstageVolumeRequest {
            volume_id: id.into(),
            staging_target_path: staging.display().to_string(),
        };
        self.c.node.node_unstage_volume(req).await.map(drop)
    }

    async fn publish(
        &mut self,
        id: &str,
        staging: Option<&Path>,
        target: &Path,
        readonly: bool,
        ctx: &HashMap<String, String>,
    ) -> Result<(), tonic::Status> {
        let req = proto::NodePublishVolumeRequest {
            volume_id: id.into(),
            staging_target_path: staging.map(|s| s.display().to_string()).unwrap_or_default(),
            target_path: target.display().to_string(),
            volume_capability: Some(mount_capability(Mode::SingleNodeWriter)),
            readonly,
            publish_context: ctx.clone(),
            ..Default::default()
        };
        self.c.node.node_publish_volume(req).await.map(drop)
    }

    async fn unpublish(&mut self, id: &str, target: &Path) -> Result<(), tonic::Status> {
        let req = proto::NodeUnpublishVolumeRequest {
            volume_id: id.into(),
            target_path: target.display().to_string(),
        };
        self.c.node.node_unpublish_volume(req).await.map(drop)
    }

    fn mounts_at(&self, path: &Path) -> Vec<csi_isolator::mount::MountInfo> {
        self.sandbox
            .mounts_under()
            .into_iter()
            .filter(|m| m.mount_point == path)
            .collect()
    }
}

fn code<T: std::fmt::Debug>(r: Result<T, tonic::Status>) -> Code {
    match r {
        Ok(v) => panic!("expected an error, got {v:?}"),
        Err(s) => s.code(),
    }
}

fn write_fails_with_erofs(path: &Path) {
    let err =
        std::fs::write(path, b"nope").expect_err("write through a read-only publish must fail");
    assert_eq!(err.raw_os_error(), Some(libc::EROFS), "{err}");
}

/// Runs each named test body once per backing.
macro_rules! both_backings {
    ($($name:ident),* $(,)?) => {
        mod dir {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name("dir").await
                }
            )*
        }
        mod loop_backing {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name("loop").await
                }
            )*
        }
    };
}

both_backings!(
    full_lifecycle_twice_each,
    out_of_order_calls_are_rejected,
    without_stage_publish_does_it_all,
    without_controller_publish,
    node_only_plugin_adopts_volumes,
    restart_keeps_volumes_and_mounts,
    counted_failures_then_success,
    exit_in_kills_mid_call,
    concurrent_publishes_of_one_target_mount_once,
    a_retry_after_the_client_gave_up_never_overlaps_the_first_call,
    create_waits_for_a_running_delete_of_the_same_name,
    a_busy_volume_is_not_unpublished,
    a_foreign_mount_is_never_taken_for_the_volume,
    repeated_calls_with_another_capability_are_refused,
    mount_flags_are_applied_or_refused,
    fs_type_is_made_at_create_and_required_after,
);

/// A mount capability with access `mode` and `flags`.
fn capability(mode: Mode, flags: &[&str]) -> proto::VolumeCapability {
    let mut cap = mount_capability(mode);
    if let Some(proto::volume_capability::AccessType::Mount(m)) = &mut cap.access_type {
        m.mount_flags = flags.iter().map(|f| f.to_string()).collect();
    }
    cap
}

async fn full_lifecycle_twice_each(backing: &'static str) {
    let mut env = setup(backing, &[]).await;
    let vol = env.create("data", 32 * MIB).await.unwrap();
    let again = env.create("data", 32 * MIB).await.unwrap();
    assert_eq!(vol.volume_id, again.volume_id);
    assert!(vol.capacity_bytes >= 32 * MIB);
    let id = vol.volume_id.clone();
    assert!(id.starts_with("vol-") && id.len() == 20, "{id}");

    let ctx = env.cpublish(&id, false).await.unwrap();
    assert!(!ctx.is_empty());
    assert_eq!(env.cpublish(&id, false).await.unwrap(), ctx);

    let staging = env.staging("data");
    env.stage(&id, &staging, &ctx).await.unwrap();
    env.stage(&id, &staging, &ctx).await.unwrap();
    let staged = env.mounts_at(&staging);
    assert_eq!(staged.len(), 1, "one mount at staging: {staged:?}");
    if backing == "loop" {
        assert_eq!(staged[0].fs_type, "ext4");
    }

    let rw = env.target("rw");
    let ro = env.target("ro");
    for _ in 0..2 {
        env.publish(&id, Some(&staging), &rw, false, &ctx)
            .await
            .unwrap();
        env.publish(&id, Some(&staging), &ro, true, &ctx)
            .await
            .unwrap();
    }
    assert_eq!(env.mounts_at(&rw).len(), 1);
    assert_eq!(env.mounts_at(&ro).len(), 1);
    assert!(env.mounts_at(&ro)[0].is_readonly());
    assert!(!env.mounts_at(&rw)[0].is_readonly());

    std::fs::write(rw.join("hello"), b"world").unwrap();
    assert_eq!(std::fs::read(staging.join("hello")).unwrap(), b"world");
    assert_eq!(std::fs::read(ro.join("hello")).unwrap(), b"world");
    write_fails_with_erofs(&ro.join("other"));
    if backing == "dir" {
        let data = env
            .plugin
            .work_dir()
            .join("volumes")
            .join(&id)
            .join("data/hello");
        assert_eq!(std::fs::read(data).unwrap(), b"world");
    }

    let stats = env
        .c
        .node
        .node_get_volume_stats(proto::NodeGetVolumeStatsRequest {
            volume_id: id.clone(),
            volume_path: rw.display().to_string(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let bytes = stats
        .usage
        .iter()
        .find(|u| u.unit == proto::volume_usage::Unit::Bytes as i32)
        .expect("bytes usage");
    assert!(
        bytes.total > 0 && bytes.used > 0 && bytes.available <= bytes.total,
        "{bytes:?}"
    );
    assert!(stats
        .usage
        .iter()
        .any(|u| u.unit == proto::volume_usage::Unit::Inodes as i32));

    for _ in 0..2 {
        env.unpublish(&id, &rw).await.unwrap();
        env.unpublish(&id, &ro).await.unwrap();
    }
    assert!(
        !rw.exists() && !ro.exists(),
        "the plugin removes the targets it created"
    );
    for _ in 0..2 {
        env.unstage(&id, &staging).await.unwrap();
    }
    assert!(env.mounts_at(&staging).is_empty());
    assert!(staging.exists(), "the staging dir belongs to the CO");
    env.sandbox.assert_no_loop_devices();
    for _ in 0..2 {
        env.cunpublish(&id).await.unwrap();
    }
    for _ in 0..2 {
        env.delete(&id).await.unwrap();
    }
    assert!(!env.plugin.work_dir().join("volumes").join(&id).exists());
    let calls = env.plugin.calls();
    assert_eq!(
        calls
            .iter()
            .filter(|l| **l == format!("NodeStageVolume {id}"))
            .count(),
        2
    );
    assert_eq!(
        calls
            .iter()
            .filter(|l| **l == format!("DeleteVolume {id}"))
            .count(),
        2
    );
    env.finish();
}

async fn out_of_order_calls_are_rejected(backing: &'static str) {
    let mut env = setup(backing, &["--capacity", "256M"]).await;
    let id = env.create("v", 16 * MIB).await.unwrap().volume_id;
    let staging = env.staging("v");
    let target = env.target("v");
    let none = HashMap::new();

    // Node calls before ControllerPublish, and without its publish_context.
    assert_eq!(
        code(env.stage(&id, &staging, &none).await),
        Code::FailedPrecondition
    );
    let ctx = env.cpublish(&id, false).await.unwrap();
    assert_eq!(
        code(env.stage(&id, &staging, &none).await),
        Code::FailedPrecondition
    );
    assert_eq!(
        code(
            env.publish(&id, Some(&staging), &target, false, &none)
                .await
        ),
        Code::FailedPrecondition
    );
    // NodePublish before NodeStage.
    assert_eq!(
        code(env.publish(&id, Some(&staging), &target, false, &ctx).await),
        Code::FailedPrecondition
    );
    assert!(!target.exists());
    // Incompatible ControllerPublish.
    assert_eq!(code(env.cpublish(&id, true).await), Code::AlreadyExists);

    env.stage(&id, &staging, &ctx).await.unwrap();
    env.publish(&id, Some(&staging), &target, false, &ctx)
        .await
        .unwrap();
    assert_eq!(
        code(env.publish(&id, Some(&staging), &target, true, &ctx).await),
        Code::AlreadyExists
    );
    // Another volume onto the same target.
    let other = env.create("other", 16 * MIB).await.unwrap().volume_id;
    let other_ctx = env.cpublish(&other, false).await.unwrap();
    let other_staging = env.staging("other");
    env.stage(&other, &other_staging, &other_ctx).await.unwrap();
    assert_eq!(
        code(
            env.publish(&other, Some(&other_staging), &target, false, &other_ctx)
                .await
        ),
        Code::AlreadyExists
    );
    // Staging path holding another volume.
    assert_eq!(
        code(env.stage(&other, &staging, &other_ctx).await),
        Code::AlreadyExists
    );

    assert_eq!(
        code(env.unstage(&id, &staging).await),
        Code::FailedPrecondition
    );
    assert_eq!(code(env.delete(&id).await), Code::FailedPrecondition);
    env.unpublish(&id, &target).await.unwrap();
    assert_eq!(
        code(env.delete(&id).await),
        Code::FailedPrecondition,
        "still staged and controller-published"
    );
    env.cunpublish(&id).await.unwrap();
    assert_eq!(
        code(env.delete(&id).await),
        Code::FailedPrecondition,
        "still staged"
    );
    env.unstage(&id, &staging).await.unwrap();
    env.delete(&id).await.unwrap();

    // Unknown volumes and nodes. Unstage and unpublish of an unknown volume are NOT_FOUND
    // too (the spec's "volume does not exist"), and leave the CO's directories alone.
    assert_eq!(
        code(env.stage("vol-nope", &staging, &ctx).await),
        Code::NotFound
    );
    assert_eq!(
        code(env.unstage("vol-nope", &staging).await),
        Code::NotFound
    );
    std::fs::create_dir_all(&target).unwrap();
    assert_eq!(
        code(env.unpublish("vol-nope", &target).await),
        Code::NotFound
    );
    assert!(
        staging.is_dir() && target.is_dir(),
        "the CO's directories stay"
    );
    std::fs::remove_dir(&target).unwrap();
    assert_eq!(
        code(
            env.publish("vol-nope", Some(&staging), &target, false, &ctx)
                .await
        ),
        Code::NotFound
    );
    let wrong_node = proto::ControllerPublishVolumeRequest {
        volume_id: other.clone(),
        node_id: "elsewhere".into(),
        volume_capability: Some(mount_capability(Mode::SingleNodeWriter)),
        ..Default::default()
    };
    assert_eq!(
        code(env.c.controller.controller_publish_volume(wrong_node).await),
        Code::NotFound
    );

    // Capacity: more than the total, more than what is left, inverted ranges, block.
    assert_eq!(code(env.create("huge", 512 * MIB).await), Code::OutOfRange);
    assert_eq!(
        code(env.create("big", 250 * MIB).await),
        Code::ResourceExhausted
    );
    let inverted = proto::CreateVolumeRequest {
        name: "inverted".into(),
        capacity_range: Some(proto::CapacityRange {
            required_bytes: 32 * MIB,
            limit_bytes: 16 * MIB,
        }),
        volume_capabilities: vec![mount_capability(Mode::SingleNodeWriter)],
        ..Default::default()
    };
    assert_eq!(
        code(env.c.controller.create_volume(inverted).await),
        Code::InvalidArgument
    );
    let block = proto::CreateVolumeRequest {
        name: "block".into(),
        volume_capabilities: vec![block_capability(Mode::SingleNodeWriter)],
        ..Default::default()
    };
    // Block access is served by the loop backing only (a raw image on a loop device).
    if backing == "dir" {
        assert_eq!(
            code(env.c.controller.create_volume(block).await),
            Code::InvalidArgument
        );
    } else {
        let made = env.c.controller.create_volume(block).await.unwrap();
        let id = made.into_inner().volume.unwrap().volume_id;
        env.c
            .controller
            .delete_volume(proto::DeleteVolumeRequest {
                volume_id: id,
                ..Default::default()
            })
            .await
            .unwrap();
    }
    let capacity = env
        .c
        .controller
        .get_capacity(proto::GetCapacityRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(capacity.available_capacity, 256 * MIB - 16 * MIB);

    env.unstage(&other, &other_staging).await.unwrap();
    env.cunpublish(&other).await.unwrap();
    env.delete(&other).await.unwrap();
    env.finish();
}

async fn without_stage_publish_does_it_all(backing: &'static str) {
    let mut env = setup(backing, &["--no-stage"]).await;
    let caps = env
        .c
        .node
        .node_get_capabilities(proto::NodeGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    let stage_cap = proto::node_service_capability::rpc::Type::StageUnstageVolume as i32;
    assert!(!caps.capabilities.iter().any(|c| matches!(
        &c.r#type,
        Some(proto::node_service_capability::Type::Rpc(r)) if r.r#type == stage_cap
    )));
    let id = env.create("v", 16 * MIB).await.unwrap().volume_id;
    let ctx = env.cpublish(&id, false).await.unwrap();
    let staging = env.staging("unused");
    assert_eq!(
        code(env.stage(&id, &staging, &ctx).await),
        Code::Unimplemented
    );
    assert_eq!(code(env.unstage(&id, &staging).await), Code::Unimplemented);

    let rw = env.target("rw");
    let ro = env.target("ro");
    // Read-only first: later read-write publishes must not inherit its read-only flag.
    for _ in 0..2 {
        env.publish(&id, None, &ro, true, &ctx).await.unwrap();
        env.publish(&id, None, &rw, false, &ctx).await.unwrap();
    }
    std::fs::write(rw.join("f"), b"x").unwrap();
    assert_eq!(std::fs::read(ro.join("f")).unwrap(), b"x");
    write_fails_with_erofs(&ro.join("g"));
    if backing == "loop" {
        assert_eq!(env.mounts_at(&rw)[0].fs_type, "ext4");
        assert_eq!(
            env.sandbox.loop_devices().len(),
            1,
            "one loop device however many targets"
        );
    }
    // Unpublishing the first target keeps the second one working.
    env.unpublish(&id, &rw).await.unwrap();
    assert_eq!(std::fs::read(ro.join("f")).unwrap(), b"x");
    env.unpublish(&id, &ro).await.unwrap();
    env.unpublish(&id, &ro).await.unwrap();
    env.sandbox.assert_no_loop_devices();
    // Data survives a full unpublish / publish cycle.
    env.publish(&id, None, &rw, false, &ctx).await.unwrap();
    assert_eq!(std::fs::read(rw.join("f")).unwrap(), b"x");
    env.unpublish(&id, &rw).await.unwrap();
    env.cunpublish(&id).await.unwrap();
    env.delete(&id).await.unwrap();
    env.finish();
}

async fn without_controller_publish(backing: &'static str) {
    let mut env = setup(backing, &["--no-controller-publish"]).await;
    let caps = env
        .c
        .controller
        .controller_get_capabilities(proto::ControllerGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    let publish_cap =
        proto::controller_service_capability::rpc::Type::PublishUnpublishVolume as i32;
    assert!(!caps.capabilities.iter().any(|c| matches!(
        &c.r#type,
        Some(proto::controller_service_capability::Type::Rpc(r)) if r.r#type == publish_cap
    )));
    let id = env.create("v", 16 * MIB).await.unwrap().volume_id;
    assert_eq!(code(env.cpublish(&id, false).await), Code::Unimplemented);
    assert_eq!(code(env.cunpublish(&id).await), Code::Unimplemented);
    let none = HashMap::new();
    let staging = env.staging("v");
    let target = env.target("v");
    env.stage(&id, &staging, &none).await.unwrap();
    env.publish(&id, Some(&staging), &target, false, &none)
        .await
        .unwrap();
    std::fs::write(target.join("f"), b"x").unwrap();
    env.unpublish(&id, &target).await.unwrap();
    env.unstage(&id, &staging).await.unwrap();
    env.delete(&id).await.unwrap();
    env.finish();
}

async fn node_only_plugin_adopts_volumes(backing: &'static str) {
    let mut env = setup(backing, &["--no-controller"]).await;
    let caps = env
        .c
        .identity
        .get_plugin_capabilities(proto::GetPluginCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(caps.capabilities.is_empty(), "{caps:?}");
    assert_eq!(code(env.create("v", 16 * MIB).await), Code::Unimplemented);
    let none = HashMap::new();
    let staging = env.staging("pre");
    let target = env.target("pre");
    env.stage("pre-provisioned", &staging, &none).await.unwrap();
    env.publish("pre-provisioned", Some(&staging), &target, false, &none)
        .await
        .unwrap();
    std::fs::write(target.join("f"), b"x").unwrap();
    env.unpublish("pre-provisioned", &target).await.unwrap();
    env.unstage("pre-provisioned", &staging).await.unwrap();
    env.finish();
}

async fn restart_keeps_volumes_and_mounts(backing: &'static str) {
    let mut env = setup(backing, &[]).await;
    let id = env.create("keep", 16 * MIB).await.unwrap().volume_id;
    let ctx = env.cpublish(&id, true).await.unwrap();
    let staging = env.staging("keep");
    let target = env.target("keep");
    env.stage(&id, &staging, &ctx).await.unwrap();
    env.publish(&id, Some(&staging), &target, false, &ctx)
        .await
        .unwrap();
    std::fs::write(target.join("f"), b"before").unwrap();

    env.plugin.kill();
    env.plugin.restart().await;
    env.reconnect().await;

    assert_eq!(env.create("keep", 16 * MIB).await.unwrap().volume_id, id);
    let list = env
        .c
        .controller
        .list_volumes(proto::ListVolumesRequest::default())
        .await
        .unwrap()
        .into_inner();
    let entry = list
        .entries
        .iter()
        .find(|e| e.volume.as_ref().unwrap().volume_id == id)
        .expect("volume listed after restart");
    assert_eq!(
        entry.status.as_ref().unwrap().published_node_ids,
        vec![NODE.to_string()]
    );
    // The controller publish (readonly) was remembered.
    assert_eq!(code(env.cpublish(&id, false).await), Code::AlreadyExists);
    assert_eq!(env.cpublish(&id, true).await.unwrap(), ctx);
    // Node state comes from the mount table: repeating the calls is a no-op.
    env.stage(&id, &staging, &ctx).await.unwrap();
    env.publish(&id, Some(&staging), &target, false, &ctx)
        .await
        .unwrap();
    assert_eq!(env.mounts_at(&target).len(), 1);
    assert_eq!(std::fs::read(target.join("f")).unwrap(), b"before");
    env.unpublish(&id, &target).await.unwrap();
    env.unstage(&id, &staging).await.unwrap();
    env.cunpublish(&id).await.unwrap();
    env.delete(&id).await.unwrap();
    env.finish();
}

async fn counted_failures_then_success(backing: &'static str) {
    let mut env = setup(
        backing,
        &[
            "--fail",
            "CreateVolume=UNAVAILABLE:2",
            "--delay",
            "GetCapacity=300",
        ],
    )
    .await;
    assert_eq!(code(env.create("f", 16 * MIB).await), Code::Unavailable);
    assert_eq!(code(env.create("f", 16 * MIB).await), Code::Unavailable);
    let id = env.create("f", 16 * MIB).await.unwrap().volume_id;
    let calls: Vec<String> = env
        .plugin
        .calls()
        .into_iter()
        .filter(|l| !l.starts_with("Probe"))
        .collect();
    assert_eq!(calls, vec!["CreateVolume f"; 3]);
    let started = Instant::now();
    env.c
        .controller
        .get_capacity(proto::GetCapacityRequest::default())
        .await
        .unwrap();
    assert!(started.elapsed() >= Duration::from_millis(300));

    // Faults changed on the running plugin through its faults file.
    std::fs::write(
        &env.faults,
        "fail DeleteVolume=INTERNAL:1\nfail ListVolumes=ABORTED\n",
    )
    .unwrap();
    assert_eq!(code(env.delete(&id).await), Code::Internal);
    for _ in 0..3 {
        let list = env
            .c
            .controller
            .list_volumes(proto::ListVolumesRequest::default())
            .await;
        assert_eq!(code(list), Code::Aborted, "no count: fails every time");
    }
    env.delete(&id).await.unwrap();
    // Rewriting the file replaces the faults (and re-arms counted ones).
    std::fs::write(&env.faults, "fail DeleteVolume=INTERNAL:1\n").unwrap();
    env.c
        .controller
        .list_volumes(proto::ListVolumesRequest::default())
        .await
        .unwrap();
    assert_eq!(code(env.delete(&id).await), Code::Internal);
    env.delete(&id).await.unwrap();
    env.finish();
}

async fn exit_in_kills_mid_call(backing: &'static str) {
    let mut env = setup(backing, &[]).await;
    let id = env.create("x", 16 * MIB).await.unwrap().volume_id;
    let ctx = env.cpublish(&id, false).await.unwrap();
    let staging = env.staging("x");
    let target = env.target("x");

    // After the side effect: the staging mount exists, the caller gets no reply.
    std::fs::write(&env.faults, "exit-in NodeStageVolume:after\n").unwrap();
    assert!(env.stage(&id, &staging, &ctx).await.is_err());
    let status = env.plugin.wait_exit(Duration::from_secs(10)).await;
    assert_eq!(status.code(), Some(137));
    assert_eq!(env.mounts_at(&staging).len(), 1, "the side effect happened");
    std::fs::write(&env.faults, "exit-in NodePublishVolume:before\n").unwrap();
    env.plugin.restart().await;
    env.reconnect().await;
    env.stage(&id, &staging, &ctx).await.unwrap();
    assert_eq!(env.mounts_at(&staging).len(), 1, "re-staging is a no-op");

    // Before the side effect: nothing mounted at the target.
    assert!(env
        .publish(&id, Some(&staging), &target, false, &ctx)
        .await
        .is_err());
    let status = env.plugin.wait_exit(Duration::from_secs(10)).await;
    assert_eq!(status.code(), Some(137));
    assert!(env.mounts_at(&target).is_empty());
    assert!(!target.exists());
    std::fs::write(&env.faults, "").unwrap();
    env.plugin.restart().await;
    env.reconnect().await;
    env.publish(&id, Some(&staging), &target, false, &ctx)
        .await
        .unwrap();
    env.unpublish(&id, &target).await.unwrap();
    env.unstage(&id, &staging).await.unwrap();
    env.cunpublish(&id).await.unwrap();
    env.delete(&id).await.unwrap();
    let calls = env.plugin.calls();
    let stages = calls
        .iter()
        .filter(|l| **l == format!("NodeStageVolume {id}"))
        .count();
    assert_eq!(stages, 2);
    env.finish();
}

async fn concurrent_publishes_of_one_target_mount_once(backing: &'static str) {
    let mut env = setup(backing, &[]).await;
    let id = env.create("c", 16 * MIB).await.unwrap().volume_id;
    let ctx = env.cpublish(&id, false).await.unwrap();
    let staging = env.staging("c");
    env.stage(&id, &staging, &ctx).await.unwrap();
    let target = env.target("c");
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let mut node = env.c.node.clone();
        let req = proto::NodePublishVolumeRequest {
            volume_id: id.clone(),
            staging_target_path: staging.display().to_string(),
            target_path: target.display().to_string(),
            volume_capability: Some(mount_capability(Mode::SingleNodeWriter)),
            publish_context: ctx.clone(),
            ..Default::default()
        };
        tasks.push(tokio::spawn(async move {
            node.node_publish_volume(req).await.map(drop)
        }));
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    assert_eq!(
        env.mounts_at(&target).len(),
        1,
        "serialized per volume: exactly one mount"
    );
    env.unpublish(&id, &target).await.unwrap();
    env.unstage(&id, &staging).await.unwrap();
    env.cunpublish(&id).await.unwrap();
    env.delete(&id).await.unwrap();
    env.finish();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_shuts_down_gracefully_and_removes_the_socket() {
    use std::os::unix::fs::PermissionsExt;
    let mut env = setup("dir", &[]).await;
    let socket = env.plugin.socket();
    let mode = std::fs::metadata(&socket).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "socket mode {mode:o}");
    let pid = env.plugin.pid().expect("running");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let status = env.plugin.wait_exit(Duration::from_secs(10)).await;
    assert!(status.success(), "{status}");
    assert!(!socket.exists(), "socket removed on shutdown");
    // A stale socket file (left by a SIGKILL) does not stop a new start.
    std::fs::write(&socket, b"").unwrap();
    env.plugin.restart().await;
    env.reconnect().await;
    env.c.identity.probe(proto::ProbeRequest {}).await.unwrap();
    env.finish();
}

/// Finding: the per-volume lock must be held by the work itself, not by the RPC handler that
/// tonic drops when the client gives up. A call stalled mid-work (after its checks, before
/// its side effect) is abandoned by its client and retried at once: the retry must wait for
/// the first call's work, so there is exactly one effect.
async fn a_retry_after_the_client_gave_up_never_overlaps_the_first_call(backing: &'static str) {
    let mut env = setup(backing, &[]).await;
    std::fs::write(&env.faults, "stall CreateVolume=700\n").unwrap();
    let req = proto::CreateVolumeRequest {
        name: "once".into(),
        capacity_range: Some(proto::CapacityRange {
            required_bytes: 16 * MIB,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![mount_capability(Mode::SingleNodeWriter)],
        ..Default::default()
    };
    let mut impatient = tonic::Request::new(req.clone());
    impatient.set_timeout(Duration::from_millis(150));
    let gave_up = tokio::time::timeout(
        Duration::from_millis(200),
        env.c.controller.create_volume(impatient),
    )
    .await;
    assert!(
        !matches!(gave_up, Ok(Ok(_))),
        "the stalled call answered in time"
    );
    let id = env
        .c
        .controller
        .create_volume(req)
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap()
        .volume_id;
    let listed = env
        .c
        .controller
        .list_volumes(proto::ListVolumesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .entries;
    assert_eq!(listed.len(), 1, "one CreateVolume effect: {listed:?}");
    let dirs = std::fs::read_dir(env.plugin.work_dir().join("volumes"))
        .unwrap()
        .count();
    assert_eq!(dirs, 1, "one volume directory");

    std::fs::write(&env.faults, "stall NodePublishVolume=700\n").unwrap();
    let ctx = env.cpublish(&id, false).await.unwrap();
    let staging = env.staging("once");
    env.stage(&id, &staging, &ctx).await.unwrap();
    let target = env.target("once");
    let req = proto::NodePublishVolumeRequest {
        volume_id: id.clone(),
        staging_target_path: staging.display().to_string(),
        target_path: target.display().to_string(),
        volume_capability: Some(mount_capability(Mode::SingleNodeWriter)),
        publish_context: ctx.clone(),
        ..Default::default()
    };
    let mut impatient = tonic::Request::new(req.clone());
    impatient.set_timeout(Duration::from_millis(150));
    let gave_up = tokio::time::timeout(
        Duration::from_millis(200),
        env.c.node.node_publish_volume(impatient),
    )
    .await;
    assert!(
        !matches!(gave_up, Ok(Ok(_))),
        "the stalled call answered in time"
    );
    env.c.node.node_publish_volume(req).await.unwrap();
    assert_eq!(
        env.mounts_at(&target).len(),
        1,
        "one NodePublishVolume effect"
    );

    std::fs::write(&env.faults, "").unwrap();
    env.unpublish(&id, &target).await.unwrap();
    assert!(env.mounts_at(&target).is_empty());
    env.unstage(&id, &staging).await.unwrap();
    env.cunpublish(&id).await.unwrap();
    env.delete(&id).await.unwrap();
    env.finish();
}

/// CreateVolume of a name whose volume is being deleted waits for the delete, then creates
/// a new volume: it never returns the id the delete is removing.
async fn create_waits_for_a_running_delete_of_the_same_name(backing: &'static str) {
    let mut env = setup(backing, &[]).await;
    let old = env.create("race", 16 * MIB).await.unwrap().volume_id;
    std::fs::write(&env.faults, "stall DeleteVolume=600\n").unwrap();
    let mut controller = env.c.controller.clone();
    let delete = {
        let req = proto::DeleteVolumeRequest {
            volume_id: old.clone(),
            ..Default::default()
        };
        tokio::spawn(async move { controller.delete_volume(req).await.map(drop) })
    };
    tokio::time::sleep(Duration::from_millis(150)).await;
    let new = env.create("race", 16 * MIB).await.unwrap().volume_id;
    delete.await.unwrap().unwrap();
    assert_ne!(new, old, "create answered with the volume being deleted");
    let listed: Vec<String> = env
        .c
        .controller
        .list_volumes(proto::ListVolumesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .entries
        .into_iter()
        .map(|e| e.volume.unwrap().volume_id)
        .collect();
    assert_eq!(listed, vec![new.clone()]);
    std::fs::write(&env.faults, "").unwrap();
    env.delete(&new).await.unwrap();
    env.finish();
}

/// A volume in use (a process works in it) is not unpublished: no lazy detach behind the
/// user's back, FAILED_PRECONDITION instead, and the volume cannot be deleted meanwhile.
async fn a_busy_volume_is_not_unpublished(backing: &'static str) {
    let mut env = setup(backing, &["--no-stage"]).await;
    let id = env.create("busy", 16 * MIB).await.unwrap().volume_id;
    let ctx = env.cpublish(&id, false).await.unwrap();
    let target = env.target("busy");
    env.publish(&id, None, &target, false, &ctx).await.unwrap();
    let mut user = env
        .sandbox
        .spawn(
            std::process::Command::new("sleep")
                .arg("60")
                .current_dir(&target),
        )
        .unwrap();
    let status = env.unpublish(&id, &target).await.unwrap_err();
    assert_eq!(
        status.code(),
        Code::FailedPrecondition,
        "{}",
        status.message()
    );
    assert!(status.message().contains("busy"), "{}", status.message());
    assert_eq!(
        env.mounts_at(&target).len(),
        1,
        "still mounted, not detached"
    );
    env.cunpublish(&id).await.unwrap();
    assert_eq!(code(env.delete(&id).await), Code::FailedPrecondition);
    let _ = user.kill();
    let _ = user.wait();
    env.sandbox.untrack(user.id());
    env.unpublish(&id, &target).await.unwrap();
    assert!(!target.exists());
    env.delete(&id).await.unwrap();
    env.finish();
}

/// A mount that is not the volume's (a tmpfs someone put on top of the target, or at a path
/// that never held the volume) is refused by name and left mounted: the plugin never unmounts
/// what it did not mount.
async fn a_foreign_mount_is_never_taken_for_the_volume(backing: &'static str) {
    let mut env = setup(backing, &["--no-stage"]).await;
    let id = env.create("covered", 16 * MIB).await.unwrap().volume_id;
    let ctx = env.cpublish(&id, false).await.unwrap();
    let target = env.target("covered");
    env.publish(&id, None, &target, false, &ctx).await.unwrap();
    let tmpfs = |path: &Path| {
        let ok = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "foreign"])
            .arg(path)
            .status()
            .unwrap()
            .success();
        assert!(ok, "mount tmpfs at {}", path.display());
    };
    let umount = |path: &Path| {
        assert!(std::process::Command::new("umount")
            .arg(path)
            .status()
            .unwrap()
            .success());
    };

    // Covered: the tmpfs on top is not the volume.
    tmpfs(&target);
    let status = env.unpublish(&id, &target).await.unwrap_err();
    assert_eq!(
        status.code(),
        Code::FailedPrecondition,
        "{}",
        status.message()
    );
    assert_eq!(env.mounts_at(&target).len(), 2, "both mounts stay");
    umount(&target);

    // A path that never held the volume, with a foreign mount on it.
    let other = env.target("other");
    std::fs::create_dir(&other).unwrap();
    tmpfs(&other);
    let status = env.unpublish(&id, &other).await.unwrap_err();
    assert_eq!(
        status.code(),
        Code::FailedPrecondition,
        "{}",
        status.message()
    );
    assert!(
        status.message().contains("not this volume"),
        "{}",
        status.message()
    );
    assert_eq!(env.mounts_at(&other).len(), 1, "the foreign mount stays");
    umount(&other);
    std::fs::remove_dir(&other).unwrap();

    env.unpublish(&id, &target).await.unwrap();
    env.cunpublish(&id).await.unwrap();
    env.delete(&id).await.unwrap();
    env.finish();
}

/// A repeated ControllerPublish, NodeStage or NodePublish with another capability is
/// ALREADY_EXISTS (not OK), also after a plugin restart (the capability is persisted).
async fn repeated_calls_with_another_capability_are_refused(backing: &'static str) {
    let mut env = setup(backing, &[]).await;
    let id = env.create("caps", 16 * MIB).await.unwrap().volume_id;
    let writer = capability(Mode::SingleNodeWriter, &[]);
    let reader = capability(Mode::SingleNodeReaderOnly, &[]);
    let cpublish = |cap: &proto::VolumeCapability| proto::ControllerPublishVolumeRequest {
        volume_id: id.clone(),
        node_id: NODE.into(),
        volume_capability: Some(cap.clone()),
        ..Default::default()
    };
    let ctx = env
        .c
        .controller
        .controller_publish_volume(cpublish(&writer))
        .await
        .unwrap()
        .into_inner()
        .publish_context;
    let staging = env.staging("caps");
    let target = env.target("caps");
    let stage = |cap: &proto::VolumeCapability| proto::NodeStageVolumeRequest {
        volume_id: id.clone(),
        staging_target_path: staging.display().to_string(),
        volume_capability: Some(cap.clone()),
        publish_context: ctx.clone(),
        ..Default::default()
    };
    let publish = |cap: &proto::VolumeCapability| proto::NodePublishVolumeRequest {
        volume_id: id.clone(),
        staging_target_path: staging.display().to_string(),
        target_path: target.display().to_string(),
        volume_capability: Some(cap.clone()),
        publish_context: ctx.clone(),
        ..Default::default()
    };
    env.c.node.node_stage_volume(stage(&writer)).await.unwrap();
    env.c
        .node
        .node_publish_volume(publish(&writer))
        .await
        .unwrap();
    for round in ["running", "restarted"] {
        let c = &mut env.c;
        assert_eq!(
            code(
                c.controller
                    .controller_publish_volume(cpublish(&reader))
                    .await
            ),
            Code::AlreadyExists,
            "{round}"
        );
        c.controller
            .controller_publish_volume(cpublish(&writer))
            .await
            .unwrap();
        assert_eq!(
            code(c.node.node_stage_volume(stage(&reader)).await),
            Code::AlreadyExists,
            "{round}"
        );
        c.node.node_stage_volume(stage(&writer)).await.unwrap();
        assert_eq!(
            code(c.node.node_publish_volume(publish(&reader)).await),
            Code::AlreadyExists,
            "{round}"
        );
        c.node.node_publish_volume(publish(&writer)).await.unwrap();
        env.plugin.restart().await;
        env.reconnect().await;
    }
    assert_eq!(env.mounts_at(&target).len(), 1);
    assert_eq!(env.mounts_at(&staging).len(), 1);
    // After unpublish the target is free for another capability.
    env.unpublish(&id, &target).await.unwrap();
    env.c
        .node
        .node_publish_volume(publish(&reader))
        .await
        .unwrap();
    env.unpublish(&id, &target).await.unwrap();
    env.unstage(&id, &staging).await.unwrap();
    env.cunpublish(&id).await.unwrap();
    env.delete(&id).await.unwrap();
    env.finish();
}

/// Mount flags are never silently ignored: `ro`, `noatime`, `noexec`, `nosuid` and `nodev` are
/// applied on the staging and target mounts (seen in the mount table, and `noexec` refusing a
/// program); a flag that would weaken the host or that the plugin does not know, `ro` beside
/// `rw`, and `rw` beside readonly=true are INVALID_ARGUMENT naming the flag, with nothing made.
async fn mount_flags_are_applied_or_refused(backing: &'static str) {
    let mut env = setup(backing, &[]).await;
    for (flag, words) in [
        ("suid", "would weaken"),
        ("dev", "would weaken"),
        ("nolock,vers=4.2", "is not supported"),
    ] {
        let create = proto::CreateVolumeRequest {
            name: "flags".into(),
            volume_capabilities: vec![capability(Mode::SingleNodeWriter, &[flag])],
            ..Default::default()
        };
        let status = env.c.controller.create_volume(create).await.unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{flag}");
        let message = status.message();
        assert!(
            message.contains(&format!("{flag:?}")) && message.contains(words),
            "{message}"
        );
    }
    let id = env.create("flags", 16 * MIB).await.unwrap().volume_id;
    let ctx = env.cpublish(&id, false).await.unwrap();
    let staging = env.staging("flags");
    let stage = proto::NodeStageVolumeRequest {
        volume_id: id.clone(),
        staging_target_path: staging.display().to_string(),
        volume_capability: Some(capability(Mode::SingleNodeWriter, &["noatime", "noexec"])),
        publish_context: ctx.clone(),
        ..Default::default()
    };
    env.c.node.node_stage_volume(stage).await.unwrap();
    let staged = env.mounts_at(&staging);
    assert_eq!(staged.len(), 1, "{staged:?}");
    for flag in ["noatime", "noexec", "nosuid", "nodev"] {
        assert!(
            staged[0].mount_options.iter().any(|o| o == flag),
            "{flag} at staging: {:?}",
            staged[0].mount_options
        );
    }
    let target = env.target("flags");
    let publish = |target: &Path, flags: &[&str], readonly: bool| proto::NodePublishVolumeRequest {
        volume_id: id.clone(),
        staging_target_path: staging.display().to_string(),
        target_path: target.display().to_string(),
        volume_capability: Some(capability(Mode::SingleNodeWriter, flags)),
        publish_context: ctx.clone(),
        readonly,
        ..Default::default()
    };
    for (flags, readonly, words) in [
        (&["ro", "rw"][..], false, "contradict each other"),
        (&["rw"], true, "contradicts readonly=true"),
        (&["exec"], false, "\"exec\" would weaken"),
        (&["nodiratime"], false, "\"nodiratime\" is not supported"),
    ] {
        let status = env
            .c
            .node
            .node_publish_volume(publish(&target, flags, readonly))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{flags:?}");
        assert!(status.message().contains(words), "{}", status.message());
        assert!(!target.exists(), "nothing made for {flags:?}");
    }
    let all = ["noatime", "noexec", "nosuid", "nodev"];
    for _ in 0..2 {
        env.c
            .node
            .node_publish_volume(publish(&target, &all, false))
            .await
            .unwrap();
    }
    let mounts = env.mounts_at(&target);
    assert_eq!(mounts.len(), 1, "{mounts:?}");
    for flag in all {
        assert!(
            mounts[0].mount_options.iter().any(|o| o == flag),
            "{flag} at the target: {:?}",
            mounts[0].mount_options
        );
    }
    assert!(!mounts[0].is_readonly());
    // noexec is the kernel's, not a word in a table: a program there does not run.
    let program = target.join("run.sh");
    std::fs::write(&program, b"#!/bin/sh\nexit 0\n").unwrap();
    std::fs::set_permissions(
        &program,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let err = std::process::Command::new(&program).status().unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EACCES), "{err}");
    // The same target with other flags is another capability: refused, the mount kept.
    assert_eq!(
        code(
            env.c
                .node
                .node_publish_volume(publish(&target, &["noatime"], false))
                .await
        ),
        Code::AlreadyExists
    );
    let ro = env.target("ro");
    for _ in 0..2 {
        env.c
            .node
            .node_publish_volume(publish(&ro, &["ro"], false))
            .await
            .unwrap();
    }
    let mounts = env.mounts_at(&ro);
    assert_eq!(mounts.len(), 1);
    assert!(mounts[0].is_readonly(), "the ro mount flag was applied");
    write_fails_with_erofs(&ro.join("f"));
    env.unpublish(&id, &ro).await.unwrap();
    env.unpublish(&id, &target).await.unwrap();
    env.unstage(&id, &staging).await.unwrap();
    env.cunpublish(&id).await.unwrap();
    env.delete(&id).await.unwrap();
    env.finish();
}

/// A capability with access `mode`, fs type `fs_type` and no flags.
fn fs_capability(fs_type: &str) -> proto::VolumeCapability {
    let mut cap = mount_capability(Mode::SingleNodeWriter);
    if let Some(proto::volume_capability::AccessType::Mount(m)) = &mut cap.access_type {
        m.fs_type = fs_type.to_string();
    }
    cap
}

/// The fs type is the loop backing's mkfs at CreateVolume (ext4 by default), recorded in the
/// volume's context and required of every later capability that names one; a type the backing
/// cannot make is INVALID_ARGUMENT naming it, and the dir backing makes none.
async fn fs_type_is_made_at_create_and_required_after(backing: &'static str) {
    let mut env = setup(backing, &[]).await;
    let create = |name: &str, fs_type: &str| proto::CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(proto::CapacityRange {
            required_bytes: 16 * MIB,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![fs_capability(fs_type)],
        ..Default::default()
    };
    let refused = if backing == "dir" { "ext4" } else { "ntfs" };
    let status = env
        .c
        .controller
        .create_volume(create("bad", refused))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().contains(&format!("fs_type {refused:?}")),
        "{}",
        status.message()
    );
    if backing == "dir" {
        env.finish();
        return;
    }
    let vol = env
        .c
        .controller
        .create_volume(create("e3", "ext3"))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    assert_eq!(
        vol.volume_context.get("fs_type").map(String::as_str),
        Some("ext3")
    );
    // The same name with another filesystem is another volume.
    assert_eq!(
        code(env.c.controller.create_volume(create("e3", "ext4")).await),
        Code::AlreadyExists
    );
    let id = vol.volume_id;
    let validate = |fs_type: &str| proto::ValidateVolumeCapabilitiesRequest {
        volume_id: id.clone(),
        volume_capabilities: vec![fs_capability(fs_type)],
        ..Default::default()
    };
    let answer = |r: proto::ValidateVolumeCapabilitiesResponse| (r.confirmed.is_some(), r.message);
    let (confirmed, message) = answer(
        env.c
            .controller
            .validate_volume_capabilities(validate("ext4"))
            .await
            .unwrap()
            .into_inner(),
    );
    assert!(!confirmed && message.contains("\"ext3\""), "{message}");
    let (confirmed, _) = answer(
        env.c
            .controller
            .validate_volume_capabilities(validate("ext3"))
            .await
            .unwrap()
            .into_inner(),
    );
    assert!(confirmed);
    let ctx = env.cpublish(&id, false).await.unwrap();
    let staging = env.staging("e3");
    // A stage naming no fs type gets the volume's.
    env.stage(&id, &staging, &ctx).await.unwrap();
    let staged = env.mounts_at(&staging);
    assert_eq!(staged.len(), 1);
    assert_eq!(staged[0].fs_type, "ext3");
    let target = env.target("e3");
    let publish = proto::NodePublishVolumeRequest {
        volume_id: id.clone(),
        staging_target_path: staging.display().to_string(),
        target_path: target.display().to_string(),
        volume_capability: Some(fs_capability("ext4")),
        publish_context: ctx.clone(),
        ..Default::default()
    };
    let status = env.c.node.node_publish_volume(publish).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().contains("\"ext4\"") && status.message().contains("\"ext3\""),
        "{}",
        status.message()
    );
    assert!(!target.exists());
    env.unstage(&id, &staging).await.unwrap();
    env.cunpublish(&id).await.unwrap();
    env.delete(&id).await.unwrap();
    env.finish();
}

/// A loop volume really has the size asked for: its filesystem is about that big (ext4
/// metadata and the journal take a part), and writing past it fails with ENOSPC.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loop_volumes_have_real_capacity() {
    let mut env = setup("loop", &["--no-stage"]).await;
    for (name, size) in [("big", 64 * MIB), ("small", 8 * MIB)] {
        let vol = env.create(name, size).await.unwrap();
        assert_eq!(vol.capacity_bytes, size);
        let id = vol.volume_id;
        let ctx = env.cpublish(&id, false).await.unwrap();
        let target = env.target(name);
        env.publish(&id, None, &target, false, &ctx).await.unwrap();
        let st = nix::sys::statvfs::statvfs(&target).unwrap();
        let total = st.blocks() as i64 * st.fragment_size() as i64;
        assert!(
            total <= size && total >= size * 8 / 10,
            "{name}: filesystem of {total} bytes for a {size}-byte volume"
        );
        if name == "small" {
            let chunk = vec![0xa5u8; 1 << 20];
            let mut file = std::fs::File::create(target.join("fill")).unwrap();
            let mut written = 0i64;
            let err = loop {
                use std::io::Write;
                match file.write_all(&chunk).and_then(|()| file.sync_all()) {
                    Ok(()) => written += chunk.len() as i64,
                    Err(e) => break e,
                }
                assert!(written <= size, "wrote {written} bytes into {size}");
            };
            assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
            drop(file);
        }
        env.unpublish(&id, &target).await.unwrap();
        env.cunpublish(&id).await.unwrap();
        env.delete(&id).await.unwrap();
    }
    env.finish();
}
