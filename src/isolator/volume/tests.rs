//! Unit tests of the isolator's lifecycle steps without root: mount calls go to the recording
//! [`FakeSyscall`] (it is also the mount table), the providers are a recording [`Publisher`] double
//! and process facts come from a [`Processes`] double. Nothing here mounts, enters a namespace or
//! needs a plugin: the one real kernel call on the way is `unshare(CLONE_FS)` of the namespace
//! thread, which any user may make. Each test checks the calls recorded and the checkpoint written.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use futures::future::BoxFuture;

use super::*;
use crate::error_chain::FullMessage;
use crate::isolator::process_check::PidFacts;
use crate::launcher::process::MountView;
use crate::mount::{Call, CallKind, FakeSyscall, Hardening};
use crate::provider::ProviderError;
use crate::resource::VolumeMode;

const PROVIDER: &str = "p1";
const MOUNTS_ROOT: &str = "./csi/t/n/mounts";

/// The providers as the isolator sees them: users per volume, every request recorded.
#[derive(Debug, Default)]
struct FakePublisher {
    calls: Mutex<Vec<String>>,
    users: Mutex<BTreeMap<String, BTreeSet<String>>>,
    read_only: Mutex<BTreeSet<String>>,
    hardening: Mutex<BTreeMap<String, Hardening>>,
    fail_publish: Mutex<Option<String>>,
    /// Whether the plugins take a volume's group (VOLUME_MOUNT_GROUP): then every asked group
    /// comes back as the one the volume was staged with.
    takes_groups: Mutex<bool>,
}

fn volume_ids(resources: &[Resource]) -> Vec<String> {
    let mut ids: Vec<String> = resources
        .iter()
        .filter_map(|r| r.source_id().map(str::to_string))
        .collect();
    ids.sort();
    ids
}

impl FakePublisher {
    fn calls(&self) -> Vec<String> {
        std::mem::take(&mut *self.calls.lock().unwrap())
    }

    fn record(&self, call: String) {
        self.calls.lock().unwrap().push(call);
    }

    fn users_of(&self, volume: &str) -> BTreeSet<String> {
        self.users
            .lock()
            .unwrap()
            .get(volume)
            .cloned()
            .unwrap_or_default()
    }
}

impl Publisher for FakePublisher {
    fn publish<'a>(
        &'a self,
        container: &'a str,
        resources: &'a [Resource],
        groups: &'a crate::provider::MountGroups,
    ) -> BoxFuture<'a, Result<crate::provider::MountGroups, ProviderError>> {
        Box::pin(async move {
            let ids = volume_ids(resources);
            if groups.is_empty() {
                self.record(format!("publish {container} {ids:?}"));
            } else {
                let asked: Vec<String> = groups
                    .iter()
                    .map(|((_, v), g)| format!("{v}:{g}"))
                    .collect();
                self.record(format!("publish {container} {ids:?} groups {asked:?}"));
            }
            if let Some(bad) = self.fail_publish.lock().unwrap().clone() {
                if ids.contains(&bad) {
                    return Err(ProviderError::UnknownVolume {
                        volume: bad,
                        provider: PROVIDER.to_string(),
                    });
                }
            }
            let mut users = self.users.lock().unwrap();
            for id in ids {
                users.entry(id).or_default().insert(container.to_string());
            }
            Ok(if *self.takes_groups.lock().unwrap() {
                groups.clone()
            } else {
                Default::default()
            })
        })
    }

    fn republish<'a>(
        &'a self,
        batch: &'a [crate::provider::Republish],
    ) -> BoxFuture<'a, crate::provider::Republished> {
        Box::pin(async move {
            let mut containers = Vec::new();
            for c in batch {
                let published = self.publish(&c.container_id, &c.resources, &c.groups).await;
                containers.push(published.map(|_| ()));
            }
            crate::provider::Republished {
                containers,
                unensured: Vec::new(),
            }
        })
    }

    fn unpublish<'a>(
        &'a self,
        container: &'a str,
        resources: &'a [Resource],
    ) -> BoxFuture<'a, Result<(), ProviderError>> {
        Box::pin(async move {
            let ids = volume_ids(resources);
            self.record(format!("unpublish {container} {ids:?}"));
            let mut users = self.users.lock().unwrap();
            for id in ids {
                users.entry(id).or_default().remove(container);
            }
            Ok(())
        })
    }

    fn release_container<'a>(
        &'a self,
        container: &'a str,
    ) -> BoxFuture<'a, Result<(), ProviderError>> {
        Box::pin(async move {
            self.record(format!("release_container {container}"));
            for users in self.users.lock().unwrap().values_mut() {
                users.remove(container);
            }
            Ok(())
        })
    }

    fn hardening<'a>(
        &'a self,
        _provider_id: &'a str,
        volume_id: &'a str,
    ) -> BoxFuture<'a, Hardening> {
        Box::pin(async move {
            self.hardening
                .lock()
                .unwrap()
                .get(volume_id)
                .copied()
                .unwrap_or_default()
        })
    }

    fn read_only_reason<'a>(
        &'a self,
        _provider_id: &'a str,
        volume_id: &'a str,
    ) -> BoxFuture<'a, Option<String>> {
        Box::pin(async move {
            self.read_only
                .lock()
                .unwrap()
                .contains(volume_id)
                .then(|| "published read-only".to_string())
        })
    }

    fn users(&self) -> BoxFuture<'_, Vec<VolumeUsers>> {
        Box::pin(async move {
            self.users
                .lock()
                .unwrap()
                .iter()
                .map(|(v, users)| VolumeUsers {
                    provider_id: PROVIDER.to_string(),
                    volume_id: v.clone(),
                    users: users.iter().cloned().collect(),
                })
                .collect()
        })
    }

    fn release<'a>(
        &'a self,
        _provider_id: &'a str,
        volume_id: &'a str,
        container: &'a str,
    ) -> BoxFuture<'a, Result<(), ProviderError>> {
        Box::pin(async move {
            self.record(format!("release {volume_id} {container}"));
            if let Some(users) = self.users.lock().unwrap().get_mut(volume_id) {
                users.remove(container);
            }
            Ok(())
        })
    }
}

/// Processes as a double says they are: every pid a container's process started at `start`, in
/// another mount namespace than the agent's (whose pid is never a test's).
#[derive(Debug)]
struct FakeProcesses {
    start: Mutex<u64>,
}

const VIEW: MountView = MountView {
    namespace: (4, 4026532000),
    root: (2049, 2),
};

impl Processes for FakeProcesses {
    fn facts(&self, _pid: u32) -> PidFacts {
        PidFacts {
            start: Some(*self.start.lock().unwrap()),
            in_our_mount_namespace: Some(false),
            view: Some(VIEW),
        }
    }

    fn own_pid(&self) -> u32 {
        // Not the test's pid, which plays the container's process (its /proc entries are readable).
        u32::from(u16::MAX) + 1
    }
}

struct Rig {
    _dir: tempfile::TempDir,
    work: PathBuf,
    sandbox: PathBuf,
    sys: Arc<FakeSyscall>,
    publisher: Arc<FakePublisher>,
    processes: Arc<FakeProcesses>,
}

impl Rig {
    fn new() -> Rig {
        let dir = tempfile::tempdir().unwrap();
        let base = std::fs::canonicalize(dir.path()).unwrap();
        let work = base.join("work");
        let sandbox = base.join("sandbox");
        std::fs::create_dir_all(&work).unwrap();
        std::fs::create_dir_all(&sandbox).unwrap();
        Rig {
            _dir: dir,
            work,
            sandbox,
            sys: Arc::new(FakeSyscall::new()),
            publisher: Arc::new(FakePublisher::default()),
            processes: Arc::new(FakeProcesses {
                start: Mutex::new(500),
            }),
        }
    }

    /// An isolator on the rig's work dir (a second one is what a restarted agent builds).
    fn isolator(&self) -> VolumeIsolator {
        VolumeIsolator::with_publisher(
            &self.work,
            self.publisher.clone(),
            self.sys.clone(),
            self.sys.clone(),
        )
        .with_processes(self.processes.clone())
    }

    /// The resource of volume `id` at `container_path`, its published directory made.
    fn volume(&self, id: &str, container_path: &str, mode: VolumeMode) -> Resource {
        let r = Resource::csi_volume(PROVIDER, id, MOUNTS_ROOT, 8, None, None, [("k", "v")])
            .with_volume(container_path, mode);
        std::fs::create_dir_all(r.host_path(&self.work).unwrap()).unwrap();
        r
    }

    fn config(&self, resources: Vec<Resource>) -> ContainerConfig {
        ContainerConfig {
            resources,
            sandbox: self.sandbox.clone(),
            rootfs: None,
            user: None,
        }
    }

    fn checkpoint(&self, container: &str) -> Option<ContainerRecord> {
        let bytes = crate::isolator::journal::read_checkpoint(&self.work, container).unwrap()?;
        Some(serde_json::from_slice(&bytes).unwrap())
    }
}

fn targets(rec: &ContainerRecord) -> Vec<String> {
    rec.mounts
        .iter()
        .map(|m| format!("{}@{}", volume_name(m), m.target.display()))
        .collect()
}

#[tokio::test]
async fn prepare_records_the_container_then_publishes() {
    let rig = Rig::new();
    let iso = rig.isolator();
    let data = rig.volume("vol-1", "data", VolumeMode::Rw);
    let launch = iso
        .prepare("c1", rig.config(vec![data.clone()]))
        .await
        .unwrap();
    assert_eq!(launch.mounts.len(), 1);
    assert_eq!(launch.mounts[0].source, data.host_path(&rig.work).unwrap());
    assert_eq!(launch.mounts[0].target, Path::new("data"));
    assert_eq!(rig.publisher.calls(), ["publish c1 [\"vol-1\"]"]);
    let rec = rig.checkpoint("c1").expect("checkpoint written");
    assert_eq!(rec.mounts, launch.mounts);
    assert_eq!(rec.pid, None);
    // Prepare mounts nothing itself: the launcher applies the mounts.
    assert_eq!(rig.sys.calls(), []);
    // A second prepare of the same container is refused and changes nothing.
    let err = iso.prepare("c1", rig.config(vec![data])).await.unwrap_err();
    assert!(err.full_message().contains("c1"), "{err}");
    assert_eq!(rig.publisher.calls(), Vec::<String>::new());
}

#[tokio::test]
async fn a_non_root_workload_asks_the_plugin_for_its_group_on_volumes_it_writes_alone() {
    let rig = Rig::new();
    let iso = rig.isolator();
    *rig.publisher.takes_groups.lock().unwrap() = true;
    let data = rig.volume("vol-1", "data", VolumeMode::Rw);
    let read = rig.volume("vol-2", "read", VolumeMode::Ro);
    let mut config = rig.config(vec![data.clone(), read]);
    config.user = Some("1234:5678".into());
    iso.prepare("c1", config).await.unwrap();
    // The read-only volume asks none; the plugin staged vol-1 with the group, so the isolator
    // changes nothing itself (the directory keeps its group).
    assert_eq!(
        rig.publisher.calls(),
        ["publish c1 [\"vol-1\", \"vol-2\"] groups [\"vol-1:5678\"]"]
    );
    let meta = std::fs::metadata(data.host_path(&rig.work).unwrap()).unwrap();
    use std::os::unix::fs::MetadataExt;
    assert_ne!(meta.gid(), 5678);
    assert_ne!(
        meta.mode() & ownership::GRANTED_BITS,
        ownership::GRANTED_BITS
    );
    // A root workload asks no group.
    let mut config = rig.config(vec![rig.volume("vol-3", "data", VolumeMode::Rw)]);
    config.user = Some("0:5678".into());
    iso.prepare("c2", config).await.unwrap();
    assert_eq!(rig.publisher.calls(), ["publish c2 [\"vol-3\"]"]);
}

#[tokio::test]
async fn a_failed_prepare_leaves_no_checkpoint_and_no_use() {
    let rig = Rig::new();
    let iso = rig.isolator();
    let data = rig.volume("vol-1", "data", VolumeMode::Rw);
    *rig.publisher.fail_publish.lock().unwrap() = Some("vol-1".to_string());
    let err = iso
        .prepare("c1", rig.config(vec![data.clone()]))
        .await
        .unwrap_err()
        .full_message();
    assert!(err.contains("c1") && err.contains("vol-1"), "{err}");
    assert_eq!(rig.publisher.calls(), ["publish c1 [\"vol-1\"]"]);
    assert!(rig.checkpoint("c1").is_none(), "checkpoint left behind");
    // A read-write mount of a read-only volume is refused before anything is recorded or published.
    *rig.publisher.fail_publish.lock().unwrap() = None;
    rig.publisher
        .read_only
        .lock()
        .unwrap()
        .insert("vol-1".into());
    let err = iso
        .prepare("c1", rig.config(vec![data]))
        .await
        .unwrap_err()
        .full_message();
    assert!(err.contains("published read-only"), "{err}");
    assert_eq!(rig.publisher.calls(), Vec::<String>::new());
    assert!(rig.checkpoint("c1").is_none());
}

#[tokio::test]
async fn update_mounts_through_the_seam_and_records_what_is_mounted() {
    let rig = Rig::new();
    let iso = rig.isolator();
    let data = rig.volume("vol-1", "data", VolumeMode::Rw);
    let more = rig.volume("vol-2", "more", VolumeMode::Ro);
    iso.prepare("c1", rig.config(vec![data.clone()]))
        .await
        .unwrap();
    // The test process plays the container's (its /proc/<pid>/root and ns/mnt are readable).
    let pid = std::process::id();
    iso.isolate("c1", pid).await.unwrap();
    let rec = rig.checkpoint("c1").unwrap();
    assert_eq!(
        (rec.pid, rec.pid_start, rec.mount_view),
        (Some(pid), Some(500), Some(VIEW))
    );
    rig.publisher.calls();

    // Added: published, then cloned, made read-only and attached from inside the namespace.
    iso.update("c1", vec![data.clone(), more.clone()])
        .await
        .unwrap();
    assert_eq!(
        rig.publisher.calls(),
        ["publish c1 [\"vol-2\"]", "unpublish c1 []"]
    );
    let kinds: Vec<CallKind> = rig.sys.calls().iter().map(Call::kind).collect();
    assert_eq!(
        kinds,
        [
            CallKind::OpenTreeCloneFd,
            CallKind::ChangeMountFlags,
            CallKind::SetReadonlyByFd,
            CallKind::EnterMountNamespace,
            CallKind::MoveMountToFd,
            CallKind::SetPropagationByFd,
        ]
    );
    assert!(
        matches!(&rig.sys.calls()[0], Call::OpenTreeCloneFd { source, .. } if *source == more.host_path(&rig.work).unwrap()),
        "{:?}",
        rig.sys.calls()
    );
    assert!(
        rig.sandbox.join("more").is_dir(),
        "target made in the sandbox"
    );
    let rec = rig.checkpoint("c1").unwrap();
    assert_eq!(targets(&rec), ["vol-1@data", "vol-2@more"]);
    assert_eq!(rec.config.resources.len(), 2);

    // Removed: unmounted (nothing is really mounted there: no unmount call is due), recorded,
    // released.
    rig.sys.clear_calls();
    iso.update("c1", vec![more.clone()]).await.unwrap();
    assert_eq!(
        rig.publisher.calls(),
        ["publish c1 []", "unpublish c1 [\"vol-1\"]"]
    );
    let kinds: Vec<CallKind> = rig.sys.calls().iter().map(Call::kind).collect();
    assert_eq!(kinds, [CallKind::EnterMountNamespace]);
    assert_eq!(targets(&rig.checkpoint("c1").unwrap()), ["vol-2@more"]);
    assert_eq!(rig.publisher.users_of("vol-1"), BTreeSet::new());
}

#[tokio::test]
async fn update_asks_the_plugin_for_the_workloads_group_on_a_volume_it_adds() {
    let rig = Rig::new();
    let iso = rig.isolator();
    *rig.publisher.takes_groups.lock().unwrap() = true;
    let data = rig.volume("vol-1", "data", VolumeMode::Rw);
    let more = rig.volume("vol-2", "more", VolumeMode::Rw);
    let mut config = rig.config(vec![data.clone()]);
    config.user = Some("1234:5678".into());
    iso.prepare("c1", config).await.unwrap();
    iso.isolate("c1", std::process::id()).await.unwrap();
    rig.publisher.calls();
    iso.update("c1", vec![data, more]).await.unwrap();
    assert_eq!(
        rig.publisher.calls(),
        [
            "publish c1 [\"vol-2\"] groups [\"vol-2:5678\"]",
            "unpublish c1 []"
        ]
    );
    assert_eq!(
        targets(&rig.checkpoint("c1").unwrap()),
        ["vol-1@data", "vol-2@more"]
    );
}

#[tokio::test]
async fn update_refuses_a_pid_that_is_no_longer_the_containers() {
    let rig = Rig::new();
    let iso = rig.isolator();
    let data = rig.volume("vol-1", "data", VolumeMode::Rw);
    let more = rig.volume("vol-2", "more", VolumeMode::Rw);
    iso.prepare("c1", rig.config(vec![data.clone()]))
        .await
        .unwrap();
    iso.isolate("c1", std::process::id()).await.unwrap();
    rig.publisher.calls();
    let before = rig.checkpoint("c1").unwrap();
    // The pid now names a process started later: reused.
    *rig.processes.start.lock().unwrap() = 501;
    let err = iso
        .update("c1", vec![data, more])
        .await
        .unwrap_err()
        .full_message();
    assert!(err.contains("belongs to another process"), "{err}");
    assert_eq!(rig.publisher.calls(), Vec::<String>::new());
    assert_eq!(rig.sys.calls(), []);
    assert_eq!(rig.checkpoint("c1").unwrap(), before);
}

#[tokio::test]
async fn a_failed_mount_records_what_is_mounted_and_releases_the_rest() {
    let rig = Rig::new();
    let iso = rig.isolator();
    let data = rig.volume("vol-1", "data", VolumeMode::Rw);
    let more = rig.volume("vol-2", "more", VolumeMode::Rw);
    iso.prepare("c1", rig.config(vec![data.clone()]))
        .await
        .unwrap();
    iso.isolate("c1", std::process::id()).await.unwrap();
    rig.publisher.calls();
    rig.sys
        .fail(CallKind::MoveMountToFd, nix::errno::Errno::EPERM, 1);
    let err = iso
        .update("c1", vec![data, more])
        .await
        .unwrap_err()
        .full_message();
    assert!(err.contains("mount") && err.contains("vol-2"), "{err}");
    // vol-2 was published for the update, then released since it did not make it in.
    assert_eq!(
        rig.publisher.calls(),
        ["publish c1 [\"vol-2\"]", "unpublish c1 [\"vol-2\"]"]
    );
    assert_eq!(targets(&rig.checkpoint("c1").unwrap()), ["vol-1@data"]);
    assert_eq!(
        rig.publisher.users_of("vol-1"),
        BTreeSet::from(["c1".to_string()])
    );
}

#[tokio::test]
async fn cleanup_releases_every_use_and_removes_the_checkpoint() {
    let rig = Rig::new();
    let iso = rig.isolator();
    let data = rig.volume("vol-1", "data", VolumeMode::Rw);
    iso.prepare("c1", rig.config(vec![data])).await.unwrap();
    rig.publisher.calls();
    iso.cleanup("c1").await.unwrap();
    assert_eq!(rig.publisher.calls(), ["release_container c1"]);
    assert!(rig.checkpoint("c1").is_none());
    assert!(!checkpoint_path(&rig.work, "c1").parent().unwrap().exists());
    assert_eq!(rig.sys.calls(), []);
    // Idempotent.
    iso.cleanup("c1").await.unwrap();
    assert_eq!(rig.publisher.calls(), ["release_container c1"]);
}

#[tokio::test]
async fn cleanup_unmounts_the_host_binds_of_the_oci_path() {
    let rig = Rig::new();
    let iso = rig.isolator();
    let data = rig.volume("vol-1", "data", VolumeMode::Rw);
    let (_, prepared) = iso.prepare_oci("c1", rig.config(vec![data])).await.unwrap();
    let rec = rig.checkpoint("c1").unwrap();
    assert!(rec.binds_in_sandbox);
    assert_eq!(rec.host_binds, prepared.host_binds);
    assert!(!rec.host_binds.is_empty());
    // One bind into the sandbox per host bind: a clone moved onto the target (or, without
    // open_tree, a bind through the source's fd).
    let binds = rig
        .sys
        .calls()
        .iter()
        .filter(|c| matches!(c.kind(), CallKind::MoveMountToFd | CallKind::BindMountToFd))
        .count();
    assert_eq!(binds, rec.host_binds.len());
    rig.sys.clear_calls();
    iso.cleanup("c1").await.unwrap();
    let unmounted: Vec<PathBuf> = rig
        .sys
        .calls()
        .iter()
        .filter(|c| c.kind() == CallKind::Unmount)
        .filter_map(|c| c.target().map(Path::to_path_buf))
        .collect();
    for bind in &rec.host_binds {
        assert!(unmounted.contains(bind), "{bind:?} not in {unmounted:?}");
    }
    assert!(rig.checkpoint("c1").is_none());
}

#[tokio::test]
async fn recover_cleans_up_the_gone_keeps_the_known_and_releases_stale_uses() {
    let rig = Rig::new();
    let first = rig.isolator();
    let a = rig.volume("vol-1", "data", VolumeMode::Rw);
    let b = rig.volume("vol-2", "data", VolumeMode::Rw);
    first.prepare("c1", rig.config(vec![a])).await.unwrap();
    first.prepare("c2", rig.config(vec![b])).await.unwrap();
    // A use no checkpoint has (a container that never got one, or an interrupted update).
    rig.publisher
        .users
        .lock()
        .unwrap()
        .entry("vol-3".into())
        .or_default()
        .insert("c3".into());
    // A checkpoint that does not parse.
    let bad = checkpoint_path(&rig.work, "c4");
    std::fs::create_dir_all(bad.parent().unwrap()).unwrap();
    std::fs::write(&bad, b"{not json").unwrap();
    rig.publisher.calls();

    // The agent restarts: a new isolator, c1 still known.
    let second = rig.isolator();
    let report = second.recover(&["c1".to_string()]).await.unwrap();
    assert_eq!(report.recovered, ["c1"]);
    assert_eq!(report.cleaned, ["c2"]);
    assert_eq!(
        report.released_uses,
        [("vol-3".to_string(), "c3".to_string())]
    );
    assert_eq!(report.corrupt.len(), 1, "{:?}", report.corrupt);
    assert_eq!(report.corrupt[0].0, bad);
    assert!(report.failures.is_empty(), "{:?}", report.failures);
    let mut calls = rig.publisher.calls();
    calls.sort();
    assert_eq!(
        calls,
        [
            "publish c1 [\"vol-1\"]",
            "release vol-3 c3",
            "release_container c2"
        ]
    );
    assert!(rig.checkpoint("c1").is_some());
    assert!(rig.checkpoint("c2").is_none());
    assert!(!bad.exists(), "the corrupt checkpoint is set aside");
    assert_eq!(second.containers().await.len(), 1);
    assert_eq!(rig.sys.calls(), []);
}

#[tokio::test]
async fn a_work_dir_without_the_journal_recovers_from_its_files() {
    let rig = Rig::new();
    let iso = rig.isolator();
    let data = rig.volume("vol-1", "data", VolumeMode::Rw);
    iso.prepare("c1", rig.config(vec![data])).await.unwrap();
    // Journaled, not yet written back.
    assert!(!checkpoint_path(&rig.work, "c1").exists());
    // The release before the journal: the files alone (folded in, then the journal gone).
    iso.compact_journal().unwrap();
    let journal = crate::isolator::journal::journal_path(&rig.work);
    std::fs::remove_file(&journal).unwrap();
    assert!(checkpoint_path(&rig.work, "c1").exists());
    let second = rig.isolator();
    assert_eq!(second.checkpointed().len(), 1);
    let report = second.recover(&["c1".to_string()]).await.unwrap();
    assert_eq!(report.recovered, ["c1"]);
    assert!(report.corrupt.is_empty(), "{report:?}");
    // And it goes on through a new journal.
    second.cleanup("c1").await.unwrap();
    assert!(journal.exists());
    assert!(rig.checkpoint("c1").is_none());
    assert!(!checkpoint_path(&rig.work, "c1").parent().unwrap().exists());
}
