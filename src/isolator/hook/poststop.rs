//! poststop: the container's uses released, its checkpoint and directory removed.

use super::*;

/// poststop: releases the container's use of its volumes (see the module doc). Idempotent.
#[tracing::instrument(skip_all, fields(container_id = %state.id))]
pub async fn poststop(opts: &HookOptions, state: &State) -> Result<(), HookError> {
    let id = state.id.as_str();
    validate_id(id)?;
    let work_dir = crate::workdir::canonical(&opts.work_dir)?;
    let checkpoint = crate::isolator::volume::checkpoint_root(&work_dir).join(id);
    let sandbox = container_dir(&work_dir, id);
    if std::fs::symlink_metadata(&checkpoint).is_err()
        && std::fs::symlink_metadata(&sandbox).is_err()
    {
        // Never prepared by create-runtime (or already cleaned up): nothing is in use.
        return Ok(());
    }
    let config = opts.provider_config(id, &work_dir)?;
    let lock = lock_work_dir(&work_dir, opts.lock_timeout).await?;
    let provider = StorageProvider::start(config)
        .await
        .map_err(|source| HookError::Provider {
            container: id.to_string(),
            source: Box::new(source),
        })?;
    let isolator = VolumeIsolator::on_host(&work_dir, provider.clone(), opts.sys.clone());
    let result = isolator.cleanup(id).await.map_err(HookError::from);
    if result.is_ok() {
        remove_container_dir(&work_dir, id).await;
    }
    provider.shutdown(PLUGIN_STOP_GRACE).await;
    drop(lock);
    result
}
