//! create-runtime: the annotated volumes published and mounted into the container before its pivot.

use super::*;
use crate::error_chain::Chain;

/// create-runtime: publishes the annotated volumes and mounts them into the container (see the module
/// doc). Returns the mounts made (empty for a container without volume annotations).
#[tracing::instrument(skip_all, fields(container_id = %state.id))]
pub async fn create_runtime(
    opts: &HookOptions,
    state: &State,
) -> Result<Vec<VolumeMount>, HookError> {
    let id = state.id.as_str();
    validate_id(id)?;
    let bundle = BundleConfig::read(id, &state.bundle)?;
    let mut annotations = state.annotations.clone();
    annotations.extend(bundle.annotations.clone());
    let wanted = HookVolumes::from_annotations(id, &annotations)?;
    if wanted.is_empty() {
        return Ok(Vec::new());
    }
    // Everything that needs no provider is judged before the work dir is touched.
    let tenant = opts.policy.tenant(id, &annotations)?;
    admit_parameters(id, &opts.policy, &wanted.parameters)?;
    admit_annotation_mounts(id, &opts.policy, &wanted.volumes)?;
    if tenant == Tenant::Single {
        tracing::info!(
            container = id,
            "single tenant (no --tenant-annotation): every container that can set annotations can name every volume this hook made"
        );
    }
    let named = wanted
        .volumes
        .iter()
        .map(|arg| {
            let scoped =
                tenant
                    .scoped_name(&arg.source)
                    .map_err(|reason| HookError::VolumeName {
                        container: id.to_string(),
                        volume: arg.source.clone(),
                        tenant: tenant.clone(),
                        reason,
                    })?;
            Ok(Wanted { arg, scoped })
        })
        .collect::<Result<Vec<_>, HookError>>()?;
    let pid = state
        .pid
        .filter(|p| *p > 0)
        .and_then(|p| u32::try_from(p).ok())
        .ok_or_else(|| HookError::NoPid {
            container: id.to_string(),
        })?;
    let rootfs = std::fs::canonicalize(&bundle.rootfs).map_err(|source| HookError::Rootfs {
        container: id.to_string(),
        path: bundle.rootfs.clone(),
        source,
    })?;

    let work_dir = crate::workdir::canonical(&opts.work_dir)?;
    let config = opts.provider_config(id, &work_dir)?;
    // What the configuration tells about the provider, checked before the lock and the plugin.
    let configured_root = (!config.plugin_type.is_empty()).then(|| {
        crate::resource::Layout::new(&work_dir, &config.plugin_type, &config.plugin_name)
            .relative_mount_root()
    });
    admit_resources(
        id,
        &opts.policy,
        &wanted.resources,
        &OwnVolumes {
            provider_id: Some(config.provider_id.as_str()).filter(|p| !p.is_empty()),
            mounts_root: configured_root.as_deref(),
            volumes: None,
            tenant: &tenant,
        },
    )?;
    let lock = lock_work_dir(&work_dir, opts.lock_timeout).await?;
    let provider = StorageProvider::start(config)
        .await
        .map_err(|source| HookError::Provider {
            container: id.to_string(),
            source: Box::new(source),
        })?;
    let request = Request {
        work_dir: &work_dir,
        policy: &opts.policy,
        id,
        pid,
        rootfs: &rootfs,
        user: bundle.user.clone(),
        tenant: &tenant,
        sys: &opts.sys,
    };
    let result = create_with_provider(&request, &named, &wanted, provider.clone()).await;
    provider.shutdown(PLUGIN_STOP_GRACE).await;
    drop(lock);
    result
}

/// One create-runtime, once the work dir is canonical and the container's tenant known.
struct Request<'a> {
    work_dir: &'a Path,
    policy: &'a HookPolicy,
    id: &'a str,
    pid: u32,
    rootfs: &'a Path,
    user: Option<String>,
    tenant: &'a Tenant,
    sys: &'a Arc<dyn Syscall>,
}

async fn create_with_provider(
    req: &Request<'_>,
    named: &[Wanted<'_>],
    wanted: &HookVolumes,
    provider: Arc<StorageProvider>,
) -> Result<Vec<VolumeMount>, HookError> {
    let raw_resources = wanted.resources.as_slice();
    let id = req.id;
    let isolator = VolumeIsolator::on_host(req.work_dir, provider.clone(), req.sys.clone());
    reap_stale(&isolator, req.work_dir, id).await;

    let records = provider.volumes().await;
    let known: BTreeMap<String, Option<String>> = records
        .iter()
        .map(|r| (r.volume_id.clone(), r.name.clone()))
        .collect();
    let root = provider.layout().relative_mount_root();
    admit_resources(
        id,
        req.policy,
        raw_resources,
        &OwnVolumes {
            provider_id: Some(provider.id()),
            mounts_root: Some(&root),
            volumes: Some(&known),
            tenant: req.tenant,
        },
    )?;
    // The caps, before any CreateVolume: the volumes this container would add to its tenant's.
    let mut new: Vec<(&str, u64)> = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for w in named {
        let exists = records
            .iter()
            .any(|r| r.name.as_deref() == Some(w.scoped.as_str()));
        if !exists && seen.insert(w.scoped.as_str()) {
            new.push((w.arg.source.as_str(), w.arg.volume.size_bytes.unwrap_or(0)));
        }
    }
    let used = Usage::of_tenant(req.tenant, &records);
    if let Err((volume, exceeded)) = check_caps(req.policy, used, &new) {
        return Err(HookError::CapExceeded {
            container: id.to_string(),
            volume: volume.to_string(),
            tenant: req.tenant.clone(),
            exceeded,
        });
    }

    let mut resources = raw_resources.to_vec();
    // Volume id -> the name in the annotation and its tenant, so errors name the volume as the user
    // wrote it.
    let mut names: BTreeMap<String, String> = BTreeMap::new();
    for w in named {
        let v = w.arg;
        let mut spec = v.create_spec(&w.scoped);
        let existing = records
            .iter()
            .find(|r| r.name.as_deref() == Some(w.scoped.as_str()));
        if let Some(existing) = existing {
            // A volume that exists is used with its capability, never with other options than
            // the annotation asked for.
            v.check_against(existing)
                .map_err(|source| HookError::CreateVolume {
                    container: id.to_string(),
                    volume: v.source.clone(),
                    tenant: req.tenant.clone(),
                    source: Box::new(source),
                })?;
            spec.capability = existing.capability.clone();
            if v.volume.secrets.is_none() {
                spec.secrets_file = existing.secrets_file.clone();
            }
        }
        // Parameters the annotation gives must be the volume's; without any, a volume that
        // exists is used as it was created.
        match (wanted.parameters.get(&v.source), existing) {
            (Some(set), _) => spec.parameters = set.clone(),
            (None, Some(existing)) => spec.parameters = existing.parameters.to_btree(),
            (None, None) => {}
        }
        let res = provider
            .create_volume(spec)
            .await
            .map_err(|source| HookError::CreateVolume {
                container: id.to_string(),
                volume: v.source.clone(),
                tenant: req.tenant.clone(),
                source: Box::new(source),
            })?;
        tracing::info!(volume = %v.source, tenant = %req.tenant, volume_id = res.source_id().unwrap_or("-"), "volume for the container");
        if let Some(vid) = res.source_id() {
            names.insert(vid.to_string(), format!("'{}' of {}", v.source, req.tenant));
        }
        resources.push(v.use_of(res));
    }

    let sandbox = container_dir(req.work_dir, id);
    let (hook_dir, dir) = (req.work_dir.join(HOOK_DIR), sandbox.clone());
    crate::offload::blocking(move || {
        make_real_dir(&hook_dir)?;
        make_real_dir(&dir)
    })
    .await?;
    let config = ContainerConfig {
        resources,
        sandbox: sandbox.clone(),
        rootfs: Some(req.rootfs.to_path_buf()),
        user: req.user.clone(),
    };
    let launch = match isolator.prepare(id, config).await {
        Ok(launch) => launch,
        Err(e) => {
            remove_container_dir(req.work_dir, id).await;
            return Err(e.into());
        }
    };
    let mut attached: Vec<OwnedFd> = Vec::new();
    let mut failure = launch
        .mounts
        .iter()
        .find(|m| m.block)
        .map(|m| HookError::BlockVolume {
            container: id.to_string(),
            volume: m.volume_id.clone().unwrap_or_else(|| "-".into()),
            container_path: m.container_path.clone(),
        });
    for m in &launch.mounts {
        if failure.is_some() {
            break;
        }
        // The namespace thread is joined: off the runtime's workers.
        let (sys, container, pid) = (req.sys.clone(), id.to_string(), req.pid);
        let (rootfs, mount) = (req.rootfs.to_path_buf(), m.clone());
        let mounted = tokio::task::spawn_blocking(move || {
            mount_into_rootfs(&*sys, &container, pid, &rootfs, &mount)
        })
        .await
        .unwrap_or_else(|source| {
            Err(mount_error(
                id,
                m,
                RootfsMountError::Task {
                    step: "attach",
                    source,
                },
            ))
        });
        match mounted {
            Ok(tree) => attached.push(tree),
            Err(mut e) => {
                if let HookError::Mount { volume, .. } = &mut e {
                    if let Some(name) = names.get(volume.as_str()) {
                        *volume = format!("{name} ({volume})");
                    }
                }
                failure = Some(e);
                break;
            }
        }
    }
    if failure.is_none() {
        if let Err(e) = isolator.isolate(id, req.pid).await {
            failure = Some(e.into());
        }
    }
    if let Some(e) = failure {
        let (sys, pid) = (req.sys.clone(), req.pid);
        let undone =
            tokio::task::spawn_blocking(move || unmount_in_namespace(&*sys, pid, &attached))
                .await
                .unwrap_or_else(|source| {
                    Err(RootfsMountError::Task {
                        step: "unmount",
                        source,
                    })
                });
        if let Err(undo) = undone {
            tracing::error!(container_id = id, error = %Chain(&undo), "unmount from the container failed");
        }
        if let Err(undo) = isolator.cleanup(id).await {
            tracing::error!(container_id = id, error = %Chain(&undo), "release after a failed create-runtime failed");
        }
        remove_container_dir(req.work_dir, id).await;
        return Err(e);
    }
    tracing::info!(
        container_id = id,
        pid = req.pid,
        tenant = %req.tenant,
        mounts = launch.mounts.len(),
        "volumes mounted into the container"
    );
    Ok(launch.mounts)
}
