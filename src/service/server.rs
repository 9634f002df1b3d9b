//! The gRPC handlers of the `Isolator` service.
//!
//! Each handler is two lines: the operation (a method returning
//! `Result<_, ServiceError>`, which checks the request and calls the
//! library) and `IsolatorService::reply`, the one place a result is
//! counted, logged and turned into a response or a `tonic::Status`.
//! Container ids are checked to be one safe path component before the
//! isolator sees them (they become checkpoint paths).
//!
//! Each call's operation runs in a task of its own, so a caller that goes
//! away, or whose request timeout fires, gets its answer (`CANCELLED`) while
//! the operation still runs to its end: a publish or an update is never cut
//! short halfway by the transport.
//!
//! `Isolate` accepts only the prepared container's process, since `Update`
//! later mounts into the mount namespace of the pid it records: the pid must
//! exist; it must not be in serve's own mount namespace (an update would
//! mount on the host); and when the container has a rootfs, the process's
//! root (`/proc/<pid>/root`) must be that rootfs, the same directory by
//! device and inode (the OCI hook's check). Otherwise the call fails with
//! `FAILED_PRECONDITION`, naming the container, the pid and what was seen.

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use tonic::{Code, Request, Response, Status};

use crate::isolator::VolumeIsolator;
use crate::memory;
use crate::mount::MountTable;
use crate::provider::snapshot::SourceName;
use crate::provider::stats;
use crate::provider::status::scan;
use crate::provider::{Capability, CreateSpec, ImportSpec, StorageProvider};
use crate::resource::{Resource, VolumeMode};
use crate::service::convert;
use crate::service::error::{full_message, ServiceError};
use crate::service::metrics::{PublishOp, ServiceMetrics};
use crate::service::proto;
use crate::service::proto::isolator_server::Isolator;

/// The `Isolator` service over one [`VolumeIsolator`] and its providers.
#[derive(Debug, Clone)]
pub struct IsolatorService {
    isolator: Arc<VolumeIsolator>,
    work_dir: PathBuf,
    table: Arc<dyn MountTable>,
    metrics: Arc<ServiceMetrics>,
    /// Operations running at once, whether or not their caller still waits: an operation outlives a
    /// cancelled call (see [`run`](Self::run)), so tonic's per-connection limit, which ends with the
    /// call, cannot bound them.
    operations: Arc<tokio::sync::Semaphore>,
}

type Reply<T> = Result<Response<T>, Status>;

impl IsolatorService {
    /// A service over `isolator` (whose work dir is `work_dir`); `table` is
    /// read for the status report, `metrics` counts the calls; at most
    /// `max_operations` operations run at once (more wait for a slot).
    pub fn new(
        isolator: Arc<VolumeIsolator>,
        work_dir: impl Into<PathBuf>,
        table: Arc<dyn MountTable>,
        metrics: Arc<ServiceMetrics>,
        max_operations: usize,
    ) -> Self {
        IsolatorService {
            isolator,
            work_dir: work_dir.into(),
            table,
            metrics,
            operations: Arc::new(tokio::sync::Semaphore::new(max_operations.max(1))),
        }
    }

    /// The isolator served.
    pub fn isolator(&self) -> &Arc<VolumeIsolator> {
        &self.isolator
    }

    /// Counts the call, logs a failure once, and converts the result.
    fn reply<T>(&self, method: &'static str, result: Result<T, ServiceError>) -> Reply<T> {
        let code = result
            .as_ref()
            .map_or_else(ServiceError::code, |_| Code::Ok);
        self.metrics.request(method, code);
        if let Err(e) = &result {
            tracing::warn!(method, code = ?code, error = %full_message(e), "isolator call failed");
        }
        result.map(Response::new).map_err(Status::from)
    }

    /// Runs `op` on a clone of the service in a task of its own (see the
    /// module doc), then [`reply`](Self::reply)s in that task too, so the
    /// call is counted and logged even when the caller is gone.
    async fn run<T, F>(
        &self,
        method: &'static str,
        op: impl FnOnce(IsolatorService) -> F,
    ) -> Reply<T>
    where
        T: Send + 'static,
        F: Future<Output = Result<T, ServiceError>> + Send + 'static,
    {
        // The slot is taken while the caller waits (a caller that gives up before it gets one starts
        // nothing) and held by the operation to its end, however the call ends.
        let slot = self
            .operations
            .clone()
            .acquire_owned()
            .await
            .expect("the operations semaphore is never closed");
        let this = self.clone();
        let call = op(this.clone());
        let task = tokio::spawn(async move {
            let result = call.await;
            drop(slot);
            this.reply(method, result)
        });
        match task.await {
            Ok(reply) => reply,
            // The task is never aborted: the only way it ends early is a panic.
            Err(e) => std::panic::resume_unwind(e.into_panic()),
        }
    }

    /// The provider a volume request names (empty: the only one).
    fn provider(&self, provider_id: &str) -> Result<Arc<StorageProvider>, ServiceError> {
        let manager = self.isolator.manager();
        if provider_id.is_empty() {
            let all: Vec<&Arc<StorageProvider>> = manager.providers().collect();
            return match all.as_slice() {
                [only] => Ok(Arc::clone(only)),
                _ => Err(ServiceError::AmbiguousProvider { count: all.len() }),
            };
        }
        manager
            .get(provider_id)
            .cloned()
            .ok_or_else(|| ServiceError::UnknownProvider {
                provider: provider_id.to_string(),
                known: manager.providers().map(|p| p.id().to_string()).collect(),
            })
    }

    async fn create_volume(
        &self,
        req: proto::CreateVolumeRequest,
    ) -> Result<proto::CreateVolumeResponse, ServiceError> {
        let provider = self.provider(&req.provider_id)?;
        if req.name.is_empty() {
            return Err(invalid("name", "is empty"));
        }
        let mut spec = CreateSpec::new(&req.name, req.capacity_bytes);
        spec.capability = capability(
            &req.access_mode,
            &req.access_type,
            &req.fs_type,
            &req.mount_flags,
        )?;
        spec.parameters = req.parameters.into_iter().collect();
        spec.secrets_file = secrets_file(&req.secrets_file);
        let from = match (req.from_snapshot.is_empty(), req.from_volume.is_empty()) {
            (true, true) => None,
            (false, true) => Some(SourceName::Snapshot(req.from_snapshot)),
            (true, false) => Some(SourceName::Volume(req.from_volume)),
            (false, false) => {
                return Err(invalid(
                    "from_snapshot",
                    "and from_volume are both set: give one",
                ))
            }
        };
        let resource = provider.create_volume_from(spec, from).await?;
        Ok(volume_answer(
            &provider,
            resource,
            &req.container_path,
            req.readonly,
        ))
    }

    /// Disks with a profile and no volume yet become volumes of their
    /// provider first (Mesos' CREATE_DISK), with the profile's parameters.
    async fn create_profile_disks(&self, resources: &mut [Resource]) -> Result<(), ServiceError> {
        for provider in self.isolator.manager().providers() {
            provider.create_profile_disks(resources).await?;
        }
        Ok(())
    }

    async fn import_volume(
        &self,
        req: proto::ImportVolumeRequest,
    ) -> Result<proto::CreateVolumeResponse, ServiceError> {
        let provider = self.provider(&req.provider_id)?;
        let spec = ImportSpec {
            name: req.name,
            volume_id: req.volume_id,
            capacity_bytes: req.capacity_bytes,
            capability: capability(
                &req.access_mode,
                &req.access_type,
                &req.fs_type,
                &req.mount_flags,
            )?,
            volume_context: req.volume_context.into_iter().collect(),
        };
        let resource = provider
            .import_volume_with_secrets(spec, secrets_file(&req.secrets_file))
            .await?;
        Ok(volume_answer(
            &provider,
            resource,
            &req.container_path,
            req.readonly,
        ))
    }

    async fn destroy_volume(
        &self,
        req: proto::DestroyVolumeRequest,
    ) -> Result<proto::DestroyVolumeResponse, ServiceError> {
        let provider = self.provider(&req.provider_id)?;
        if req.volume_id.is_empty() {
            return Err(invalid("volume_id", "is empty"));
        }
        provider
            .destroy_volume_with(&req.volume_id, req.delete_imported)
            .await?;
        Ok(proto::DestroyVolumeResponse {})
    }

    async fn expand_volume(
        &self,
        req: proto::ExpandVolumeRequest,
    ) -> Result<proto::ExpandVolumeResponse, ServiceError> {
        let provider = self.provider(&req.provider_id)?;
        if req.volume_id.is_empty() {
            return Err(invalid("volume_id", "is empty"));
        }
        let done = provider
            .expand_volume(&req.volume_id, req.capacity_bytes)
            .await?;
        Ok(proto::ExpandVolumeResponse {
            capacity_bytes: done.capacity_bytes,
            node_expansion_pending: done.node_pending,
        })
    }

    // ---- snapshots ----

    async fn create_snapshot(
        &self,
        req: proto::CreateSnapshotRequest,
    ) -> Result<proto::SnapshotInfo, ServiceError> {
        let provider = self.provider(&req.provider_id)?;
        if req.volume_id.is_empty() {
            return Err(invalid("volume_id", "is empty"));
        }
        let rec = provider.create_snapshot(&req.volume_id, &req.name).await?;
        Ok(snapshot_info(rec))
    }

    async fn delete_snapshot(
        &self,
        req: proto::DeleteSnapshotRequest,
    ) -> Result<proto::DeleteSnapshotResponse, ServiceError> {
        let provider = self.provider(&req.provider_id)?;
        if req.name.is_empty() {
            return Err(invalid("name", "is empty"));
        }
        provider.delete_snapshot(&req.name).await?;
        Ok(proto::DeleteSnapshotResponse {})
    }

    async fn list_snapshots(
        &self,
        req: proto::ListSnapshotsRequest,
    ) -> Result<proto::ListSnapshotsResponse, ServiceError> {
        let provider = self.provider(&req.provider_id)?;
        let snapshots = provider.snapshots().await;
        Ok(proto::ListSnapshotsResponse {
            snapshots: snapshots.into_iter().map(snapshot_info).collect(),
        })
    }

    async fn modify_volume(
        &self,
        req: proto::ModifyVolumeRequest,
    ) -> Result<proto::ModifyVolumeResponse, ServiceError> {
        let provider = self.provider(&req.provider_id)?;
        if req.volume_id.is_empty() {
            return Err(invalid("volume_id", "is empty"));
        }
        let asked = req.mutable_parameters.into_iter().collect();
        let now = provider.modify_volume(&req.volume_id, &asked).await?;
        Ok(proto::ModifyVolumeResponse {
            mutable_parameters: now.into_iter().collect(),
        })
    }

    async fn prepare(&self, req: proto::PrepareRequest) -> Result<proto::LaunchInfo, ServiceError> {
        container_id(&req.container_id)?;
        let mut config = convert::container_config(req.config)?;
        self.create_profile_disks(&mut config.resources).await?;
        let publishes = has_provider_volumes(&config.resources);
        let started = Instant::now();
        let info = self.isolator.prepare(&req.container_id, config).await?;
        if publishes {
            self.metrics
                .observe_publish(PublishOp::Prepare, started.elapsed());
        }
        Ok(info.into())
    }

    async fn prepare_oci(
        &self,
        req: proto::PrepareRequest,
    ) -> Result<proto::OciLaunchInfo, ServiceError> {
        container_id(&req.container_id)?;
        let mut config = convert::container_config(req.config)?;
        self.create_profile_disks(&mut config.resources).await?;
        let publishes = has_provider_volumes(&config.resources);
        let started = Instant::now();
        let (_, prepared) = self.isolator.prepare_oci(&req.container_id, config).await?;
        if publishes {
            self.metrics
                .observe_publish(PublishOp::Prepare, started.elapsed());
        }
        Ok(prepared.into())
    }

    async fn isolate(
        &self,
        req: proto::IsolateRequest,
    ) -> Result<proto::IsolateResponse, ServiceError> {
        let (id, pid) = (req.container_id.as_str(), req.pid);
        container_id(id)?;
        if pid == 0 {
            return Err(invalid("pid", "is 0"));
        }
        self.isolator.isolate_verified(id, pid).await?;
        Ok(proto::IsolateResponse {})
    }

    async fn update(
        &self,
        req: proto::UpdateRequest,
    ) -> Result<proto::UpdateResponse, ServiceError> {
        container_id(&req.container_id)?;
        let mut resources = convert::resources("resources_json", &req.resources_json)?;
        self.create_profile_disks(&mut resources).await?;
        let publishes = has_provider_volumes(&resources);
        let started = Instant::now();
        self.isolator.update(&req.container_id, resources).await?;
        if publishes {
            self.metrics
                .observe_publish(PublishOp::Update, started.elapsed());
        }
        Ok(proto::UpdateResponse {})
    }

    async fn cleanup(
        &self,
        req: proto::CleanupRequest,
    ) -> Result<proto::CleanupResponse, ServiceError> {
        container_id(&req.container_id)?;
        self.isolator.cleanup(&req.container_id).await?;
        Ok(proto::CleanupResponse {})
    }

    async fn recover(
        &self,
        req: proto::RecoverRequest,
    ) -> Result<proto::RecoverResponse, ServiceError> {
        for id in &req.known_container_ids {
            container_id(id)?;
        }
        let report = self.isolator.recover(&req.known_container_ids).await?;
        // Counts: the ids of a node's thousands of containers would make one line of hundreds of
        // kilobytes; they go to the debug level (and the answer carries them).
        tracing::info!(
            recovered = report.recovered.len(),
            cleaned = report.cleaned.len(),
            released_uses = report.released_uses.len(),
            corrupt = report.corrupt.len(),
            failures = report.failures.len(),
            "isolator recovered"
        );
        tracing::debug!(recovered = ?report.recovered, cleaned = ?report.cleaned, "isolator recovered: containers");
        give_back_free_heap();
        Ok(report.into())
    }

    async fn status(&self) -> Result<proto::StatusResponse, ServiceError> {
        let (work_dir, table) = (self.work_dir.clone(), self.table.clone());
        let mut report = tokio::task::spawn_blocking(move || scan(&work_dir, &*table))
            .await
            .expect("the status scan does not panic")
            .map_err(|source| ServiceError::MountTable { source })?;
        let clients = stats::provider_clients(self.isolator.manager());
        stats::attach(&mut report, &clients, stats::DEFAULT_DEADLINE).await;
        let containers = self.isolator.containers().await;
        Ok(convert::status(report, &containers))
    }
}

/// Returns the allocator's free pages to the kernel once a recovery is done. Recovery reads
/// every checkpoint of the node at once, on many blocking threads: what they free stays in the
/// allocator's arenas ([`crate::memory`]). Measured at 10,000 containers in docs/benchmarks.md
/// ("10,000 volumes"). Logs the resident size before and after.
fn give_back_free_heap() {
    let before = memory::resident_kib();
    let released = memory::give_back_free_heap();
    tracing::info!(
        before_kib = ?before,
        after_kib = ?memory::resident_kib(),
        released,
        "free heap given back to the kernel after recovery"
    );
}

fn invalid(field: &'static str, reason: impl Into<String>) -> ServiceError {
    ServiceError::InvalidArgument {
        field,
        reason: reason.into(),
    }
}

fn container_id(id: &str) -> Result<(), ServiceError> {
    crate::resource::validate_container_id(id)
        .map_err(|e| invalid("container_id", crate::error_chain::full_message(&e)))
}

/// The capability of a request's access mode (empty: the default), access type (empty:
/// mount), fs type and mount flags (a block volume has neither).
fn capability(
    access_mode: &str,
    access_type: &str,
    fs_type: &str,
    mount_flags: &[String],
) -> Result<Capability, ServiceError> {
    let mut capability = Capability::default();
    if !access_mode.is_empty() {
        capability
            .set_access_mode(access_mode)
            .map_err(|e| invalid("access_mode", e.to_string()))?;
    }
    capability.access_type = crate::provider::AccessType::parse(access_type)
        .map_err(|e| invalid("access_type", e.to_string()))?;
    capability
        .set_mount(fs_type, mount_flags)
        .map_err(|e| invalid(e.field, e.to_string()))?;
    Ok(capability)
}

/// The answer to CreateVolume and ImportVolume: the resource, with
/// `disk.volume` when a container path is given.
fn volume_answer(
    provider: &StorageProvider,
    mut resource: Resource,
    container_path: &str,
    readonly: bool,
) -> proto::CreateVolumeResponse {
    if !container_path.is_empty() {
        let mode = if readonly {
            VolumeMode::Ro
        } else {
            VolumeMode::Rw
        };
        resource = resource.with_volume(container_path, mode);
    }
    proto::CreateVolumeResponse {
        resource_json: serde_json::to_string(&resource).expect("a resource always serializes"),
        volume_id: resource.source_id().unwrap_or_default().to_string(),
        provider_id: provider.id().to_string(),
    }
}

/// Whether any resource is a provider's disk (so the call publishes).
fn has_provider_volumes(resources: &[Resource]) -> bool {
    resources
        .iter()
        .any(|r| r.is_disk() && r.provider_id().is_some())
}

#[tonic::async_trait]
impl Isolator for IsolatorService {
    async fn create_volume(
        &self,
        request: Request<proto::CreateVolumeRequest>,
    ) -> Reply<proto::CreateVolumeResponse> {
        let req = request.into_inner();
        self.run("CreateVolume", |s| async move {
            IsolatorService::create_volume(&s, req).await
        })
        .await
    }

    async fn destroy_volume(
        &self,
        request: Request<proto::DestroyVolumeRequest>,
    ) -> Reply<proto::DestroyVolumeResponse> {
        let req = request.into_inner();
        self.run("DestroyVolume", |s| async move {
            IsolatorService::destroy_volume(&s, req).await
        })
        .await
    }

    async fn expand_volume(
        &self,
        request: Request<proto::ExpandVolumeRequest>,
    ) -> Reply<proto::ExpandVolumeResponse> {
        let req = request.into_inner();
        self.run("ExpandVolume", |s| async move {
            IsolatorService::expand_volume(&s, req).await
        })
        .await
    }

    // ---- snapshots ----

    async fn create_snapshot(
        &self,
        request: Request<proto::CreateSnapshotRequest>,
    ) -> Reply<proto::SnapshotInfo> {
        let req = request.into_inner();
        self.run("CreateSnapshot", |s| async move {
            IsolatorService::create_snapshot(&s, req).await
        })
        .await
    }

    async fn delete_snapshot(
        &self,
        request: Request<proto::DeleteSnapshotRequest>,
    ) -> Reply<proto::DeleteSnapshotResponse> {
        let req = request.into_inner();
        self.run("DeleteSnapshot", |s| async move {
            IsolatorService::delete_snapshot(&s, req).await
        })
        .await
    }

    async fn list_snapshots(
        &self,
        request: Request<proto::ListSnapshotsRequest>,
    ) -> Reply<proto::ListSnapshotsResponse> {
        let req = request.into_inner();
        self.run("ListSnapshots", |s| async move {
            IsolatorService::list_snapshots(&s, req).await
        })
        .await
    }

    async fn import_volume(
        &self,
        request: Request<proto::ImportVolumeRequest>,
    ) -> Reply<proto::CreateVolumeResponse> {
        let req = request.into_inner();
        self.run("ImportVolume", |s| async move {
            IsolatorService::import_volume(&s, req).await
        })
        .await
    }

    async fn prepare(&self, request: Request<proto::PrepareRequest>) -> Reply<proto::LaunchInfo> {
        let req = request.into_inner();
        self.run("Prepare", |s| async move {
            IsolatorService::prepare(&s, req).await
        })
        .await
    }

    async fn prepare_oci(
        &self,
        request: Request<proto::PrepareRequest>,
    ) -> Reply<proto::OciLaunchInfo> {
        let req = request.into_inner();
        self.run("PrepareOci", |s| async move {
            IsolatorService::prepare_oci(&s, req).await
        })
        .await
    }

    async fn isolate(
        &self,
        request: Request<proto::IsolateRequest>,
    ) -> Reply<proto::IsolateResponse> {
        let req = request.into_inner();
        self.run("Isolate", |s| async move {
            IsolatorService::isolate(&s, req).await
        })
        .await
    }

    async fn update(&self, request: Request<proto::UpdateRequest>) -> Reply<proto::UpdateResponse> {
        let req = request.into_inner();
        self.run("Update", |s| async move {
            IsolatorService::update(&s, req).await
        })
        .await
    }

    async fn cleanup(
        &self,
        request: Request<proto::CleanupRequest>,
    ) -> Reply<proto::CleanupResponse> {
        let req = request.into_inner();
        self.run("Cleanup", |s| async move {
            IsolatorService::cleanup(&s, req).await
        })
        .await
    }

    async fn recover(
        &self,
        request: Request<proto::RecoverRequest>,
    ) -> Reply<proto::RecoverResponse> {
        let req = request.into_inner();
        self.run("Recover", |s| async move {
            IsolatorService::recover(&s, req).await
        })
        .await
    }

    async fn status(
        &self,
        _request: Request<proto::StatusRequest>,
    ) -> Reply<proto::StatusResponse> {
        self.run(
            "Status",
            |s| async move { IsolatorService::status(&s).await },
        )
        .await
    }

    async fn modify_volume(
        &self,
        request: Request<proto::ModifyVolumeRequest>,
    ) -> Reply<proto::ModifyVolumeResponse> {
        let req = request.into_inner();
        self.run("ModifyVolume", |s| async move {
            IsolatorService::modify_volume(&s, req).await
        })
        .await
    }
}

/// A request's `secrets_file` (empty: none). The provider checks it (absolute, root's alone,
/// the format) before anything is written.
fn secrets_file(field: &str) -> Option<std::path::PathBuf> {
    (!field.is_empty()).then(|| std::path::PathBuf::from(field))
}

/// A snapshot record as the service answers it.
fn snapshot_info(rec: crate::provider::snapshot::SnapshotRecord) -> proto::SnapshotInfo {
    use crate::provider::snapshot::SnapshotStep;
    proto::SnapshotInfo {
        name: rec.name,
        snapshot_id: rec.snapshot_id,
        source_volume_id: rec.source_volume_id,
        size_bytes: rec.size_bytes,
        ready_to_use: rec.ready_to_use,
        creation_time: rec.creation_time,
        pending: match rec.pending {
            None => String::new(),
            Some(SnapshotStep::Create) => "create".into(),
            Some(SnapshotStep::Delete) => "delete".into(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mount::FakeSyscall;
    use crate::provider::Manager;

    fn service(max_operations: usize) -> IsolatorService {
        let fake = Arc::new(FakeSyscall::new());
        let isolator = Arc::new(VolumeIsolator::new(
            "/w",
            Arc::new(Manager::new()),
            fake.clone(),
            fake.clone(),
        ));
        IsolatorService::new(
            isolator,
            "/w",
            fake,
            Arc::new(ServiceMetrics::default()),
            max_operations,
        )
    }

    /// An operation keeps its slot after its caller gave up (a cancelled call), so callers that
    /// cancel cannot start more operations than the cap.
    #[tokio::test]
    async fn an_operation_keeps_its_slot_after_its_caller_gives_up() {
        let s = service(1);
        let (release, released) = tokio::sync::oneshot::channel::<()>();
        let (started_tx, started) = tokio::sync::oneshot::channel::<()>();
        let first = {
            let s = s.clone();
            tokio::spawn(async move {
                s.run("Status", move |_| async move {
                    let _ = started_tx.send(());
                    let _ = released.await;
                    Ok(proto::StatusResponse::default())
                })
                .await
            })
        };
        started.await.unwrap();
        // The caller goes away; its operation goes on and holds the only slot.
        first.abort();
        let second_ran = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = second_ran.clone();
        let second = tokio::spawn({
            let s = s.clone();
            async move {
                s.run("Status", move |_| async move {
                    flag.store(true, std::sync::atomic::Ordering::SeqCst);
                    Ok(proto::StatusResponse::default())
                })
                .await
            }
        });
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        assert!(
            !second_ran.load(std::sync::atomic::Ordering::SeqCst),
            "a second operation started while the first still held the only slot"
        );
        release.send(()).unwrap();
        tokio::time::timeout(std::time::Duration::from_secs(5), second)
            .await
            .expect("the second operation runs once the first is done")
            .unwrap()
            .unwrap();
        assert!(second_ran.load(std::sync::atomic::Ordering::SeqCst));
    }
}
