//! Prepare for the Docker/OCI path: prepare, then the volumes bound on the host into the sandbox.

use super::*;

impl VolumeIsolator {
    /// Prepare for the Docker/OCI path: [`prepare`](Self::prepare), then each
    /// volume bind-mounted on the host into `<sandbox>/<container_path>`
    /// (recorded, so cleanup unmounts it); returns the runtime's mounts.
    pub async fn prepare_oci(
        &self,
        container_id: &str,
        config: ContainerConfig,
    ) -> Result<(LaunchInfo, OciPrepared), IsolatorError> {
        let sandbox = config.sandbox.clone();
        let launch = self.prepare(container_id, config).await?;
        // Durably say that binds will be made in the sandbox before making
        // them, so cleanup after a crash in between still sweeps them.
        self.mark_host_binds(container_id).await?;
        // The binds (and, on failure, their rollback's EBUSY retries) in one trip to the
        // blocking pool.
        let (sys, bound) = (self.sys.clone(), launch.clone());
        match blocking(move || oci::prepare(&*sys, &sandbox, &bound)).await {
            Ok(prepared) => {
                // A crash point with the binds made and not yet recorded: recovery then finds
                // them by the mark alone.
                crate::provider::checkpoint::crash_point();
                self.record_host_binds(container_id, prepared.host_binds.clone())
                    .await?;
                Ok((launch, prepared))
            }
            Err(e) => {
                let _ = self.cleanup(container_id).await;
                Err(IsolatorError::Oci {
                    container: container_id.to_string(),
                    source: Box::new(e),
                })
            }
        }
    }

    async fn mark_host_binds(&self, container_id: &str) -> Result<(), IsolatorError> {
        self.modify(container_id, |rec| rec.binds_in_sandbox = true)
            .await
    }

    /// Records mounts made on the host for the container (Docker/OCI path),
    /// so cleanup unmounts them.
    pub async fn record_host_binds(
        &self,
        container_id: &str,
        binds: Vec<PathBuf>,
    ) -> Result<(), IsolatorError> {
        self.modify(container_id, |rec| rec.host_binds.extend(binds))
            .await
    }
}
