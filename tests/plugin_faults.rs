//! Plugin faults beyond crashes and hangs: a plugin that answers nonsense, and a plugin
//! replaced by another process between two calls. Real `csi-test-plugin` processes on real
//! Unix sockets inside a sandbox, driven by a storage provider reaching them by endpoint
//! (unmanaged), with real mounts. Every case checks the error the caller gets, the RPCs the
//! plugin received (its call log), the state on disk (the provider's checkpoints and what the
//! plugin reports over CSI) and that nothing is left mounted.

use csi_isolator::error_chain::FullMessage;
use csi_isolator_testing::plugin_bin;
use std::collections::BTreeSet;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use csi_isolator::csi::{proto, ClientOptions, CsiError, RetryPolicy};
use csi_isolator::provider::bundled::{bundled_config, BUNDLED_TYPE};
use csi_isolator::provider::{
    CreateSpec, PluginSource, ProviderConfig, ProviderError, StorageProvider, VolumeRecord,
    VolumeState,
};
use csi_isolator::resource::encode_volume_id;
use csi_isolator_testing::files::is_mounted;
use csi_isolator_testing::{raw_clients, require_root, PluginProcess, Sandbox};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tonic::Code;

const MIB: u64 = 1024 * 1024;

/// Quick retries, so a case that exhausts them does not take minutes.
fn client_options() -> ClientOptions {
    ClientOptions {
        deadline: Duration::from_secs(10),
        connect_timeout: Duration::from_secs(10),
        retry: RetryPolicy {
            max_attempts: 20,
            initial_backoff: Duration::from_millis(20),
            max_backoff: Duration::from_millis(200),
            max_total: Duration::from_secs(20),
            multiplier: 2.0,
        },
    }
}

/// A provider for the external plugin at `endpoint`, its type asked from GetPluginInfo.
async fn provider(work: &Path, endpoint: String) -> Arc<StorageProvider> {
    let mut c = ProviderConfig::new("", "ext", work, PluginSource::Endpoint(endpoint));
    c.provider_id.clear();
    c.client = client_options();
    StorageProvider::start(c).await.expect("start provider")
}

/// One sandbox with an external plugin (its faults in a file the test rewrites) and a
/// provider using it.
struct Rig {
    plugin: PluginProcess,
    provider: Arc<StorageProvider>,
    faults: PathBuf,
    sb: Sandbox,
}

impl Rig {
    async fn new(label: &str, extra: &[&str]) -> Rig {
        require_root();
        let sb = Sandbox::new(label);
        let faults = sb.join("faults");
        std::fs::write(&faults, "").unwrap();
        let faults_arg = format!("--faults-file={}", faults.display());
        let mut args = vec![faults_arg.as_str()];
        args.extend_from_slice(extra);
        let plugin = PluginProcess::start(&sb, plugin_bin(), &args).await;
        let work = sb.mkdir("work");
        let provider = provider(&work, plugin.endpoint()).await;
        Rig {
            plugin,
            provider,
            faults,
            sb,
        }
    }

    /// Replaces the plugin's faults (the plugin re-reads the file when its mtime changes).
    fn set_faults(&self, text: &str) {
        std::fs::write(&self.faults, text).unwrap();
    }

    async fn create(&self, name: &str) -> String {
        self.provider
            .create_volume(CreateSpec::new(name, 16 * MIB))
            .await
            .unwrap_or_else(|e| panic!("create {name}: {e}"))
            .source_id()
            .unwrap()
            .to_string()
    }

    /// The call log from line `from` on, as "<RPC> <volume>" lines, leaving out the Probe
    /// calls of the test's own readiness checks.
    fn calls_since(&self, from: usize) -> Vec<String> {
        self.plugin
            .calls()
            .into_iter()
            .skip(from)
            .filter(|l| l != "Probe -")
            .collect()
    }

    fn calls_len(&self) -> usize {
        self.plugin.calls().len()
    }

    /// What the plugin says about a volume over CSI: (exists, published node ids).
    async fn plugin_view(&self, id: &str) -> Option<Vec<String>> {
        self.plugin
            .listed()
            .await
            .into_iter()
            .find(|e| e.volume.as_ref().unwrap().volume_id == id)
            .map(|e| e.status.unwrap_or_default().published_node_ids)
    }

    /// The volume's checkpoint as written on disk (its journal's last entry, else its state
    /// file: what a recovery would read).
    fn state_file(&self, id: &str) -> VolumeRecord {
        let bytes = csi_isolator::provider::checkpoint::read_state(self.provider.layout(), id)
            .unwrap_or_else(|e| panic!("read the checkpoint of {id}: {e}"))
            .unwrap_or_else(|| panic!("no checkpoint of {id}"));
        serde_json::from_slice(&bytes).unwrap()
    }

    /// Asserts that the volume is back where it started: CREATED with no users in memory
    /// and on disk, no intent pending, not published to the node by the plugin, nothing
    /// mounted.
    async fn assert_back_to_created(&self, id: &str) {
        let rec = self.provider.volume(id).await.unwrap();
        assert_eq!(rec.state, VolumeState::Created, "{rec:?}");
        assert!(rec.users.is_empty(), "{rec:?}");
        assert!(rec.publish_context.is_empty(), "{rec:?}");
        let disk = self.state_file(id);
        assert_eq!(disk.state, VolumeState::Created, "{disk:?}");
        assert_eq!(disk.towards, None, "{disk:?}");
        assert!(disk.users.is_empty(), "{disk:?}");
        assert!(disk.node_id.is_none(), "{disk:?}");
        assert_eq!(
            self.plugin_view(id).await,
            Some(Vec::new()),
            "the plugin still has volume {id} published to a node"
        );
        // The staging directory lives as long as the volume: nothing mounted there, nothing in it.
        let staging = self.provider.layout().staging_path(id);
        assert!(!is_mounted(&staging), "{} still staged", staging.display());
        if let Ok(entries) = std::fs::read_dir(&staging) {
            assert_eq!(entries.count(), 0, "{} empty", staging.display());
        }
        self.sb.assert_no_mounts_under();
    }

    /// The fault gone, the volume publishes and releases normally.
    async fn assert_works_again(&self, id: &str) {
        let mp = self.provider.publish(id, "c-retry").await.unwrap();
        assert!(is_mounted(&mp), "{} mounted", mp.display());
        std::fs::write(mp.join("ok"), b"ok").unwrap();
        self.provider.release(id, "c-retry").await.unwrap();
        self.assert_back_to_created(id).await;
    }

    async fn finish(self, ids: &[&str]) {
        for id in ids {
            self.provider.destroy_volume(id).await.unwrap();
        }
        self.sb.assert_no_mounts_under();
    }
}

fn lines(id: &str, rpcs: &[&str]) -> Vec<String> {
    rpcs.iter().map(|rpc| format!("{rpc} {id}")).collect()
}

/// The calls of a first publish that failed at `failed` and was rolled back: the node id
/// is asked once; every step up to the failed one is sent, then every backward step from the
/// intent's goal (PUBLISHED) down.
fn publish_rolled_back(id: &str, failed: &str) -> Vec<String> {
    let forward = [
        "ControllerPublishVolume",
        "NodeStageVolume",
        "NodePublishVolume",
    ];
    let sent = forward.iter().position(|r| *r == failed).unwrap() + 1;
    let mut want = vec!["NodeGetInfo -".to_string()];
    want.extend(lines(id, &forward[..sent]));
    want.extend(lines(
        id,
        &[
            "NodeUnpublishVolume",
            "NodeUnstageVolume",
            "ControllerUnpublishVolume",
        ],
    ));
    want
}

fn csi_source(err: &ProviderError) -> &CsiError {
    match err {
        ProviderError::Csi { source, .. } => source,
        other => panic!("expected a CSI error, got: {other}"),
    }
}

#[tokio::test]
async fn an_empty_publish_context_fails_node_stage_and_is_rolled_back() {
    let rig = Rig::new("faults-ctx", &[]).await;
    let id = rig.create("v").await;
    rig.set_faults("lie ControllerPublishVolume:empty-context\n");
    let from = rig.calls_len();
    let err = rig.provider.publish(&id, "c1").await.unwrap_err();
    // An empty publish_context is legal CSI, so ControllerPublish cannot be refused; the
    // plugin's node side, which needs it, refuses NodeStage, and the provider says which
    // RPC, which volume and what.
    let text = err.full_message();
    assert_eq!(
        csi_source(&err).code(),
        Some(Code::FailedPrecondition),
        "{text}"
    );
    assert!(
        text.starts_with(&format!(
            "volume '{id}': NodeStageVolume of volume '{id}' failed: FAILED_PRECONDITION: "
        )) && text.contains("publish_context does not match"),
        "{text}"
    );
    // Rolled back from the goal of the operation's intent down (NodeUnpublish of a target
    // never published is a no-op), the staging attempt, then the controller publish.
    assert_eq!(
        rig.calls_since(from),
        publish_rolled_back(&id, "NodeStageVolume")
    );
    rig.assert_back_to_created(&id).await;

    rig.set_faults("");
    rig.assert_works_again(&id).await;
    rig.finish(&[&id]).await;
}

#[tokio::test]
async fn a_node_stage_that_stages_nothing_is_caught_by_node_publish_and_rolled_back() {
    // Whether NodeStage mounted anything is not the CO's to check: the spec leaves the
    // staging path to the plugin (a plugin may keep nothing there). The lie shows when
    // NodePublish, which needs the staged volume, fails; the provider rolls back all three.
    let rig = Rig::new("faults-stage", &[]).await;
    let id = rig.create("v").await;
    rig.set_faults("lie NodeStageVolume\n");
    let from = rig.calls_len();
    let err = rig.provider.publish(&id, "c1").await.unwrap_err();
    let text = err.full_message();
    assert_eq!(
        csi_source(&err).code(),
        Some(Code::FailedPrecondition),
        "{text}"
    );
    assert!(
        text.starts_with(&format!(
            "volume '{id}': NodePublishVolume of volume '{id}' failed: FAILED_PRECONDITION: "
        )) && text.contains("not staged at"),
        "{text}"
    );
    assert_eq!(
        rig.calls_since(from),
        publish_rolled_back(&id, "NodePublishVolume")
    );
    rig.assert_back_to_created(&id).await;

    rig.set_faults("");
    rig.assert_works_again(&id).await;
    rig.finish(&[&id]).await;
}

#[tokio::test]
async fn a_create_answering_another_volumes_id_never_overwrites_it() {
    let rig = Rig::new("faults-reused-id", &[]).await;
    let first = rig.create("first").await;
    let mp = rig.provider.publish(&first, "c1").await.unwrap();
    std::fs::write(mp.join("precious"), "data").unwrap();
    let before = rig.state_file(&first);

    rig.set_faults("lie CreateVolume:reused-id\n");
    let err = rig
        .provider
        .create_volume(CreateSpec::new("second", 16 * MIB))
        .await
        .unwrap_err();
    let text = err.full_message();
    assert!(
        text.contains(
            "CreateVolume of 'second' returned the volume_id of another volume already recorded"
        ),
        "{text}"
    );
    // The first volume's state, users and data are untouched; nothing is recorded for the second.
    assert_eq!(rig.state_file(&first), before);
    assert!(rig.provider.find_by_name("second").await.is_none());
    assert_eq!(
        std::fs::read_to_string(mp.join("precious")).unwrap(),
        "data"
    );

    // Once the plugin answers truthfully, the intent kept for "second" leads to its own volume.
    rig.set_faults("");
    let second = rig.create("second").await;
    assert_ne!(second, first);
    assert_eq!(rig.state_file(&first), before);
    rig.provider.release(&first, "c1").await.unwrap();
    rig.finish(&[&first, &second]).await;
}

#[tokio::test]
async fn create_volume_answers_that_break_the_spec_are_refused() {
    let rig = Rig::new("faults-create", &[]).await;
    let cases = [
        (
            "empty-id",
            "failed: invalid response: a volume with an empty volume_id (the field is REQUIRED)",
        ),
        (
            "small-capacity",
            "less than the required_bytes 16777216 asked for",
        ),
        (
            "bad-utf8",
            "failed: invalid response: the plugin's reply does not decode (failed to decode Protobuf message: Volume.volume_id: CreateVolumeResponse.volume: invalid string value: data is not UTF-8 encoded)",
        ),
    ];
    for (mode, problem) in cases {
        let name = format!("v-{mode}");
        rig.set_faults(&format!("lie CreateVolume:{mode}\n"));
        let err = rig
            .provider
            .create_volume(CreateSpec::new(&name, 16 * MIB))
            .await
            .unwrap_err();
        let text = err.full_message();
        assert!(
            matches!(
                csi_source(&err),
                CsiError::InvalidResponse {
                    rpc: "CreateVolume",
                    ..
                }
            ),
            "{mode}: {text}"
        );
        assert!(
            text.starts_with(&format!(
                "volume '{name}': CreateVolume of volume named '{name}' "
            )),
            "{mode}: {text}"
        );
        assert!(text.contains(problem), "{mode}: {text}");
        // Nothing recorded: no volume, no checkpoint. The plugin did create it (the lie is
        // in the answer only), so the answer was ambiguous: the intent stays, and asking
        // again by name finds the volume.
        assert!(rig.provider.find_by_name(&name).await.is_none(), "{mode}");
        assert!(rig
            .provider
            .volumes()
            .await
            .iter()
            .all(|r| r.name.as_deref() != Some(name.as_str())));
        let intent = rig.provider.layout().create_intent(&name);
        assert!(intent.exists(), "{mode}: intent kept");

        rig.set_faults("");
        let id = rig.create(&name).await;
        assert!(!intent.exists(), "{mode}: intent removed once recorded");
        let rec = rig.state_file(&id);
        assert_eq!(rec.name.as_deref(), Some(name.as_str()));
        assert!(rec.capacity_bytes >= 16 * MIB, "{mode}: {rec:?}");
        // One volume of that name in the plugin: the retry found the first one.
        let mut raw = raw_clients(&rig.plugin.socket()).await.unwrap();
        let listed = raw
            .controller
            .list_volumes(proto::ListVolumesRequest::default())
            .await
            .unwrap()
            .into_inner();
        assert!(listed
            .entries
            .iter()
            .any(|e| e.volume.as_ref().unwrap().volume_id == id));
        let creates: Vec<String> = rig
            .plugin
            .calls()
            .into_iter()
            .filter(|l| *l == format!("CreateVolume {name}"))
            .collect();
        assert_eq!(creates.len(), 2, "{mode}: {creates:?}");
        rig.provider.destroy_volume(&id).await.unwrap();
    }
    let listed = raw_clients(&rig.plugin.socket())
        .await
        .unwrap()
        .controller
        .list_volumes(proto::ListVolumesRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(
        listed.entries.is_empty(),
        "no volume left behind in the plugin"
    );
    rig.finish(&[]).await;
}

#[tokio::test]
async fn hostile_volume_ids_never_become_paths_unencoded() {
    // Volume ids are the plugin's to choose and may hold anything a string can; the
    // provider must only ever use them encoded.
    let prefix = "../../../escape/..%2F/.hidden/";
    let rig = Rig::new("faults-ids", &[&format!("--id-prefix={prefix}")]).await;
    let id = rig.create("v").await;
    assert!(id.starts_with(prefix), "{id}");
    let layout = rig.provider.layout().clone();
    let encoded = encode_volume_id(&id);
    assert!(
        !encoded.contains('/') && encoded != "." && encoded != "..",
        "{encoded}"
    );
    let mp = rig.provider.publish(&id, "c1").await.unwrap();
    assert_eq!(mp, layout.mounts_dir().join(&encoded).join("target"));
    assert!(is_mounted(&mp));
    std::fs::write(mp.join("data"), b"inside").unwrap();
    assert_eq!(
        layout.state_file(&id),
        layout.volumes_dir().join(&encoded).join("volume.state")
    );
    // Written back by a compaction, under its encoded name.
    rig.provider.compact_journal().await;
    assert!(layout.state_file(&id).is_file());
    // Nothing named after the id's path syntax appeared anywhere in the sandbox.
    let escaped = find_named(rig.sb.path(), "escape");
    assert!(escaped.is_empty(), "{escaped:?}");
    let resource = rig
        .provider
        .resource_for(&rig.provider.volume(&id).await.unwrap());
    assert_eq!(resource.source_id(), Some(id.as_str()));
    rig.provider.release(&id, "c1").await.unwrap();
    rig.assert_back_to_created(&id).await;
    rig.provider.destroy_volume(&id).await.unwrap();
    // The removal is journaled; the compaction removes the state file and its directory.
    assert!(csi_isolator::provider::checkpoint::read_state(&layout, &id)
        .unwrap()
        .is_none());
    rig.provider.compact_journal().await;
    assert!(!layout.volumes_dir().join(&encoded).exists());
    assert!(!layout.mounts_dir().join(&encoded).exists());
    assert!(find_named(rig.sb.path(), "escape").is_empty());
    rig.finish(&[]).await;
}

/// Paths under `dir` (not following symlinks, not crossing into mounts) with a component
/// named `name`.
fn find_named(dir: &Path, name: &str) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if entry.file_name() == name {
                found.push(path.clone());
            }
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                todo.push(path);
            }
        }
    }
    found
}

#[tokio::test]
async fn replies_that_do_not_decode_are_refused_and_their_work_undone() {
    let rig = Rig::new("faults-wire", &[]).await;
    let id = rig.create("v").await;

    // NodeStage stages for real, then answers bytes that are not protobuf: the provider
    // must not take it as done, and must undo the staging it was not told about.
    rig.set_faults("lie NodeStageVolume:garbage\n");
    let from = rig.calls_len();
    let err = rig.provider.publish(&id, "c1").await.unwrap_err();
    let text = err.full_message();
    assert!(
        matches!(
            csi_source(&err),
            CsiError::InvalidResponse {
                rpc: "NodeStageVolume",
                ..
            }
        ),
        "{text}"
    );
    assert_eq!(
        text,
        format!("volume '{id}': NodeStageVolume of volume '{id}' failed: invalid response: the plugin's reply does not decode (failed to decode Protobuf message: invalid wire type value: 7)")
    );
    assert_eq!(
        rig.calls_since(from),
        publish_rolled_back(&id, "NodeStageVolume"),
        "not retried, rolled back"
    );
    rig.assert_back_to_created(&id).await;

    // ControllerPublish publishes for real, then answers a publish_context value that is
    // not UTF-8.
    rig.set_faults("lie ControllerPublishVolume:bad-utf8\n");
    let from = rig.calls_len();
    let err = rig.provider.publish(&id, "c1").await.unwrap_err();
    let text = err.full_message();
    assert!(
        text.starts_with(&format!("volume '{id}': ControllerPublishVolume of volume '{id}' failed: invalid response: the plugin's reply does not decode ("))
            && text.contains("not UTF-8"),
        "{text}"
    );
    assert_eq!(
        rig.calls_since(from),
        lines(
            &id,
            &[
                "ControllerPublishVolume",
                "NodeUnpublishVolume",
                "NodeUnstageVolume",
                "ControllerUnpublishVolume"
            ]
        )
    );
    rig.assert_back_to_created(&id).await;

    rig.set_faults("");
    rig.assert_works_again(&id).await;
    rig.finish(&[&id]).await;
}

/// Stops the plugin gracefully (SIGTERM: it removes its socket) and waits for it.
async fn stop(plugin: &mut PluginProcess) {
    let pid = plugin.pid().expect("plugin running");
    kill(Pid::from_raw(pid as i32), Signal::SIGTERM).unwrap();
    let status = plugin.wait_exit(Duration::from_secs(10)).await;
    assert!(status.success(), "graceful stop: {status}");
    assert!(!plugin.socket().exists(), "socket removed on SIGTERM");
}

/// (inode, ctime) of a socket file.
fn socket_file(path: &Path) -> (u64, i64, i64) {
    let m = std::fs::metadata(path).unwrap();
    (m.ino(), m.ctime(), m.ctime_nsec())
}

/// Replaces the plugin of `rig` by a new process with `args` on the same socket, work dir
/// and call log.
async fn replace(rig: &mut Rig, args: &[&str], graceful: bool) {
    let before = socket_file(&rig.plugin.socket());
    if graceful {
        stop(&mut rig.plugin).await;
    } else {
        rig.plugin.kill();
    }
    let faults_arg = format!("--faults-file={}", rig.faults.display());
    let mut all = vec![faults_arg.as_str()];
    all.extend_from_slice(args);
    rig.plugin = PluginProcess::start(&rig.sb, plugin_bin(), &all).await;
    assert_ne!(
        socket_file(&rig.plugin.socket()),
        before,
        "a new socket file"
    );
}

#[tokio::test]
async fn a_new_version_of_the_plugin_on_the_same_socket_is_followed() {
    let mut rig = Rig::new("faults-upgrade", &["--vendor-version=1.0"]).await;
    let id = rig.create("v").await;
    let mp = rig.provider.publish(&id, "c1").await.unwrap();
    std::fs::write(mp.join("kept"), b"across the upgrade").unwrap();

    replace(&mut rig, &["--vendor-version=2.0"], true).await;
    let from = rig.calls_len();
    rig.provider.release(&id, "c1").await.unwrap();
    // The new process was checked (same name), its capabilities learned again, then the
    // volume calls went on where they were.
    let mut want = vec![
        "GetPluginInfo -".to_string(),
        "GetPluginCapabilities -".to_string(),
        "ControllerGetCapabilities -".to_string(),
        "NodeGetCapabilities -".to_string(),
    ];
    want.extend(lines(
        &id,
        &[
            "NodeUnpublishVolume",
            "NodeUnstageVolume",
            "ControllerUnpublishVolume",
        ],
    ));
    assert_eq!(rig.calls_since(from), want);
    rig.assert_back_to_created(&id).await;
    let info = raw_clients(&rig.plugin.socket())
        .await
        .unwrap()
        .identity
        .get_plugin_info(proto::GetPluginInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.vendor_version, "2.0");

    // No state lost: the data is there when published by the new version.
    let mp = rig.provider.publish(&id, "c2").await.unwrap();
    assert_eq!(
        std::fs::read(mp.join("kept")).unwrap(),
        b"across the upgrade"
    );
    rig.provider.release(&id, "c2").await.unwrap();
    rig.assert_back_to_created(&id).await;
    rig.finish(&[&id]).await;
}

#[tokio::test]
async fn a_different_driver_on_the_same_socket_is_refused() {
    let mut rig = Rig::new("faults-other", &[]).await;
    let id = rig.create("v").await;
    let mp = rig.provider.publish(&id, "c1").await.unwrap();

    // Killed (its socket file stays), and another driver takes the socket path over.
    replace(
        &mut rig,
        &["--name=other-driver.example.com", "--vendor-version=9.9"],
        false,
    )
    .await;
    let from = rig.calls_len();
    let err = rig.provider.release(&id, "c1").await.unwrap_err();
    let text = err.full_message();
    assert!(
        matches!(csi_source(&err), CsiError::PluginReplaced { .. }),
        "{text}"
    );
    assert_eq!(
        text,
        format!(
            "volume '{id}': the plugin at {} is now 'other-driver.example.com' (vendor version '9.9'), not '{BUNDLED_TYPE}' as before; volume calls are not sent to a different driver",
            rig.plugin.endpoint()
        )
    );
    // The other driver was only asked who it is; no volume call reached it.
    assert_eq!(rig.calls_since(from), vec!["GetPluginInfo -".to_string()]);
    assert!(is_mounted(&mp), "the volume is left as it was");
    let rec = rig.provider.volume(&id).await.unwrap();
    assert!(rec.users.is_empty(), "the release itself is recorded");
    // Every later call is refused too, for as long as the other driver is there.
    let again = rig.provider.release(&id, "c1").await.unwrap_err();
    assert!(
        matches!(csi_source(&again), CsiError::PluginReplaced { .. }),
        "{again}"
    );

    // The right driver is back: the release finishes.
    replace(&mut rig, &[], true).await;
    rig.provider.release(&id, "c1").await.unwrap();
    assert!(!is_mounted(&mp));
    rig.assert_back_to_created(&id).await;
    rig.finish(&[&id]).await;
}

#[tokio::test]
async fn a_replacement_without_stage_unstage_is_probed_again() {
    let mut rig = Rig::new("faults-caps", &[]).await;
    let staged = rig.create("staged").await;
    let fresh = rig.create("fresh").await;
    let mp = rig.provider.publish(&staged, "c1").await.unwrap();
    let staging = rig.provider.layout().staging_path(&staged);
    assert!(is_mounted(&staging));
    assert!(rig
        .provider
        .client()
        .current_capabilities()
        .node
        .stage_unstage_volume());

    replace(&mut rig, &["--no-stage"], true).await;
    // Publishing another volume uses what the new plugin offers: no NodeStage.
    let from = rig.calls_len();
    let fresh_mp = rig.provider.publish(&fresh, "c2").await.unwrap();
    assert!(is_mounted(&fresh_mp));
    assert!(!rig
        .provider
        .client()
        .current_capabilities()
        .node
        .stage_unstage_volume());
    // (The node id was asked once, by the first publish.)
    let mut want = vec![
        "GetPluginInfo -".to_string(),
        "GetPluginCapabilities -".to_string(),
        "ControllerGetCapabilities -".to_string(),
        "NodeGetCapabilities -".to_string(),
    ];
    want.extend(lines(
        &fresh,
        &["ControllerPublishVolume", "NodePublishVolume"],
    ));
    assert_eq!(rig.calls_since(from), want);

    // The volume staged by the old plugin cannot be unstaged by the new one: NodeUnpublish
    // is done, NodeUnstage is not sent (the plugin does not offer it) and the release fails
    // naming the mount that is left, instead of skipping it unseen.
    let from = rig.calls_len();
    let err = rig.provider.release(&staged, "c1").await.unwrap_err();
    let text = err.full_message();
    assert!(
        matches!(
            err,
            ProviderError::PluginMisbehaved {
                rpc: "NodeUnstageVolume",
                ..
            }
        ),
        "{text}"
    );
    assert_eq!(
        text,
        format!(
            "volume '{staged}': NodeUnstageVolume cannot be sent: the plugin no longer offers STAGE_UNSTAGE_VOLUME, yet the volume is still staged at {}",
            staging.display()
        )
    );
    assert_eq!(
        rig.calls_since(from),
        lines(&staged, &["NodeUnpublishVolume"])
    );
    assert!(!is_mounted(&mp));
    assert!(
        is_mounted(&staging),
        "left for a plugin that can unstage it"
    );
    let disk = rig.state_file(&staged);
    assert_eq!(
        disk.towards,
        Some(VolumeState::Created),
        "the unpublish intent is kept: {disk:?}"
    );

    // A plugin with staging again: the release finishes, and the other volume, published
    // without staging, is released with whatever the plugin now offers.
    replace(&mut rig, &[], true).await;
    rig.provider.release(&staged, "c1").await.unwrap();
    rig.assert_back_to_created_but(&staged, &[&fresh]).await;
    rig.provider.release(&fresh, "c2").await.unwrap();
    rig.assert_back_to_created(&fresh).await;
    rig.assert_back_to_created(&staged).await;
    let seen: BTreeSet<String> = rig.plugin.calls().into_iter().collect();
    assert!(seen.contains(&format!("NodeUnstageVolume {staged}")));
    rig.finish(&[&staged, &fresh]).await;
}

impl Rig {
    /// [`Rig::assert_back_to_created`] for `id` while the volumes `others` are still
    /// published (so mounts of theirs are allowed).
    async fn assert_back_to_created_but(&self, id: &str, others: &[&str]) {
        let rec = self.provider.volume(id).await.unwrap();
        assert_eq!(rec.state, VolumeState::Created, "{rec:?}");
        let disk = self.state_file(id);
        assert_eq!((disk.state, disk.towards), (VolumeState::Created, None));
        assert_eq!(self.plugin_view(id).await, Some(Vec::new()));
        let mounts_dir = self.provider.layout().mounts_dir();
        let allowed: Vec<PathBuf> = others
            .iter()
            .map(|o| mounts_dir.join(encode_volume_id(o)))
            .collect();
        let left: Vec<PathBuf> = self
            .sb
            .mounts_under()
            .into_iter()
            .map(|m| m.mount_point)
            .filter(|p| !allowed.iter().any(|a| p.starts_with(a)))
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }
}

#[tokio::test]
async fn a_supervised_plugin_restarted_after_a_crash_is_checked_again() {
    require_root();
    let sb = Sandbox::new("faults-managed");
    let work = sb.mkdir("work");
    let log = sb.join("calls.log");
    let log_arg = format!("--log-calls={}", log.display());
    let mut c = bundled_config(Path::new(plugin_bin()), &work, "default", &[log_arg]);
    c.ready_timeout = Duration::from_secs(10);
    c.socket_dir = sb.join("s");
    c.client = client_options();
    let p = StorageProvider::start(c).await.unwrap();
    let id = p
        .create_volume(CreateSpec::new("v", 16 * MIB))
        .await
        .unwrap()
        .source_id()
        .unwrap()
        .to_string();
    let mp = p.publish(&id, "c1").await.unwrap();
    let pid = p.plugin_pid().unwrap();
    kill(Pid::from_raw(pid as i32), Signal::SIGKILL).unwrap();
    // The supervisor restarts it (a new process binds a new socket file).
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while p.plugin_pid().is_none_or(|p| p == pid) {
        assert!(std::time::Instant::now() < deadline, "not restarted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let from = std::fs::read_to_string(&log).unwrap().lines().count();
    p.release(&id, "c1").await.unwrap();
    assert!(!is_mounted(&mp));
    let after: Vec<String> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .skip(from)
        .filter(|l| *l != "Probe -")
        .map(str::to_string)
        .collect();
    let mut want = vec![
        "GetPluginInfo -".to_string(),
        "GetPluginCapabilities -".to_string(),
        "ControllerGetCapabilities -".to_string(),
        "NodeGetCapabilities -".to_string(),
    ];
    want.extend(lines(
        &id,
        &[
            "NodeUnpublishVolume",
            "NodeUnstageVolume",
            "ControllerUnpublishVolume",
        ],
    ));
    assert_eq!(after, want);
    assert_eq!(p.plugin_terminations(), 1);
    p.destroy_volume(&id).await.unwrap();
    p.shutdown(Duration::from_secs(5)).await;
    sb.assert_no_mounts_under();
}

#[tokio::test]
async fn a_backward_step_answered_not_found_counts_as_done() {
    let rig = Rig::new("faults-not-found", &[]).await;
    let id = rig.create("nf").await;
    let mp = rig.provider.publish(&id, "c1").await.unwrap();
    // The volume was unpublished behind the provider's back, and the plugin no longer knows the
    // target: it answers NodeUnpublishVolume with NOT_FOUND.
    let mut raw = raw_clients(&rig.plugin.socket()).await.unwrap();
    raw.node
        .node_unpublish_volume(proto::NodeUnpublishVolumeRequest {
            volume_id: id.clone(),
            target_path: mp.display().to_string(),
        })
        .await
        .unwrap();
    rig.set_faults("fail NodeUnpublishVolume=NOT_FOUND:1\n");
    let from = rig.calls_len();
    rig.provider.release(&id, "c1").await.unwrap();
    let calls = rig.calls_since(from);
    assert_eq!(
        calls.first().map(String::as_str),
        Some(format!("NodeUnpublishVolume {id}").as_str()),
        "{calls:?}"
    );
    // The release went on past it to the end.
    assert!(
        calls.contains(&format!("NodeUnstageVolume {id}"))
            && calls.contains(&format!("ControllerUnpublishVolume {id}")),
        "{calls:?}"
    );
    rig.assert_back_to_created(&id).await;
    rig.set_faults("");
    rig.assert_works_again(&id).await;
    rig.finish(&[&id]).await;
}
