//! The Identity service: plugin name and version, plugin capabilities, readiness.

use tonic::{Request, Response, Status};

use super::{LockKey, Plugin, PluginError, PluginService};
use csi_isolator::csi::proto;
use csi_isolator::csi::proto::plugin_capability::service::Type as ServiceType;
use csi_isolator::csi::proto::plugin_capability::volume_expansion::Type as ExpansionType;

impl Plugin {
    fn plugin_info(
        &self,
        _req: proto::GetPluginInfoRequest,
    ) -> Result<proto::GetPluginInfoResponse, PluginError> {
        let mut manifest: std::collections::HashMap<String, String> = [(
            "backing".to_string(),
            self.backing.kind().as_str().to_string(),
        )]
        .into();
        if self.config.report_syncs {
            manifest.insert(
                csi_isolator::provider::bundled::SYNCS_KEY.to_string(),
                csi_isolator::durable::syncs().to_string(),
            );
        }
        Ok(proto::GetPluginInfoResponse {
            name: self.config.name.clone(),
            vendor_version: self.config.vendor_version.clone(),
            manifest,
        })
    }

    fn plugin_capabilities(
        &self,
        _req: proto::GetPluginCapabilitiesRequest,
    ) -> Result<proto::GetPluginCapabilitiesResponse, PluginError> {
        let mut capabilities = Vec::new();
        if self.config.controller {
            capabilities.push(proto::PluginCapability {
                r#type: Some(proto::plugin_capability::Type::Service(
                    proto::plugin_capability::Service {
                        r#type: ServiceType::ControllerService as i32,
                    },
                )),
            });
        }
        if !self.config.topology.is_empty() {
            capabilities.push(proto::PluginCapability {
                r#type: Some(proto::plugin_capability::Type::Service(
                    proto::plugin_capability::Service {
                        r#type: ServiceType::VolumeAccessibilityConstraints as i32,
                    },
                )),
            });
        }
        let expansion = match self.expansion() {
            super::Expansion::None => None,
            super::Expansion::Online => Some(ExpansionType::Online),
            super::Expansion::Offline => Some(ExpansionType::Offline),
        };
        if let Some(t) = expansion {
            capabilities.push(proto::PluginCapability {
                r#type: Some(proto::plugin_capability::Type::VolumeExpansion(
                    proto::plugin_capability::VolumeExpansion { r#type: t as i32 },
                )),
            });
        }
        Ok(proto::GetPluginCapabilitiesResponse { capabilities })
    }

    fn probe(&self, _req: proto::ProbeRequest) -> Result<proto::ProbeResponse, PluginError> {
        Ok(proto::ProbeResponse { ready: Some(true) })
    }
}

#[tonic::async_trait]
impl proto::identity_server::Identity for PluginService {
    async fn get_plugin_info(
        &self,
        request: Request<proto::GetPluginInfoRequest>,
    ) -> Result<Response<proto::GetPluginInfoResponse>, Status> {
        self.call(
            "GetPluginInfo",
            "",
            LockKey::None,
            request.into_inner(),
            Plugin::plugin_info,
        )
        .await
    }

    async fn get_plugin_capabilities(
        &self,
        request: Request<proto::GetPluginCapabilitiesRequest>,
    ) -> Result<Response<proto::GetPluginCapabilitiesResponse>, Status> {
        let req = request.into_inner();
        self.call(
            "GetPluginCapabilities",
            "",
            LockKey::None,
            req,
            Plugin::plugin_capabilities,
        )
        .await
    }

    async fn probe(
        &self,
        request: Request<proto::ProbeRequest>,
    ) -> Result<Response<proto::ProbeResponse>, Status> {
        self.call(
            "Probe",
            "",
            LockKey::None,
            request.into_inner(),
            Plugin::probe,
        )
        .await
    }
}
