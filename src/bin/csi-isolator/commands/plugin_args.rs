//! Options naming the provider a command works on, shared by the verbs.

use std::path::Path;

use anyhow::{bail, Context};
use clap::Args;
use csi_isolator::provider::bundled::{bundled_config, bundled_plugin_path};
use csi_isolator::provider::{PluginSource, ProviderConfig, UnpublishPolicy};

use super::text;

/// Which plugin, and how its volumes are handled.
#[derive(Debug, Args)]
pub struct PluginArgs {
    /// A CSI plugin already serving this endpoint (unix:///PATH); without it
    /// the bundled csi-test-plugin is started under the work dir.
    #[arg(long, value_name = "unix:///PATH", value_parser = text())]
    pub plugin_endpoint: Option<String>,
    /// The driver's controller plugin, when it runs apart from its node plugin
    /// (unix:///PATH): Controller RPCs go there, Node RPCs to --plugin-endpoint (required
    /// with it). Both must be the same driver (GetPluginInfo name); without it one plugin
    /// serves both.
    #[arg(long, value_name = "unix:///PATH", value_parser = text())]
    pub controller_endpoint: Option<String>,
    /// The plugin instance name (a path component of the layout).
    #[arg(long, default_value = "default", value_parser = text())]
    pub plugin_name: String,
    /// Extra argument for the bundled plugin (repeatable), e.g. --plugin-arg=--backing=loop.
    #[arg(
        long,
        value_name = "ARG",
        allow_hyphen_values = true,
        value_parser = text()
    )]
    pub plugin_arg: Vec<String>,
    /// When an unused volume is unpublished: last-use or keep.
    #[arg(long, default_value = "last-use")]
    pub policy: UnpublishPolicy,
    /// Where a managed plugin's socket goes when the path under the work dir is
    /// too long for a Unix socket address.
    #[arg(
        long,
        env = "CSI_ISOLATOR_SOCKET_DIR",
        default_value = csi_isolator::resource::SHORT_SOCKET_DIR,
        value_name = "DIR"
    )]
    pub plugin_socket_dir: std::path::PathBuf,
    /// Seconds to wait for the plugin to come up and answer Probe.
    #[arg(long, default_value = "30", value_name = "SECS")]
    pub plugin_timeout: u64,
    /// Disk profiles, in the JSON of Mesos' URI disk profile adaptor ({"profile_matrix": {NAME:
    /// {"volume_capabilities": ..., "create_parameters": {...}}}}): a disk resource of this
    /// provider with disk.source.profile and no disk.source.id is created with that profile's
    /// parameters and capability, named by its disk.persistence.id. Must be root's alone.
    #[arg(long, value_name = "FILE")]
    pub disk_profiles: Option<std::path::PathBuf>,
}

impl PluginArgs {
    /// The provider configuration these options describe.
    pub fn config(&self, work_dir: &Path) -> anyhow::Result<ProviderConfig> {
        let mut config = match &self.plugin_endpoint {
            Some(endpoint) => {
                if !self.plugin_arg.is_empty() {
                    bail!(
                        "--plugin-arg only applies to the bundled plugin, not to --plugin-endpoint"
                    );
                }
                let mut c = ProviderConfig::new(
                    "",
                    &self.plugin_name,
                    work_dir,
                    PluginSource::Endpoint(endpoint.clone()),
                );
                c.provider_id.clear();
                c
            }
            None => {
                let program = bundled_plugin_path().context(
                    "the bundled csi-test-plugin was not found next to csi-isolator (build both, or pass --plugin-endpoint)",
                )?;
                bundled_config(&program, work_dir, &self.plugin_name, &self.plugin_arg)
            }
        };
        // The provider refuses a controller endpoint beside the managed (bundled) plugin, which
        // serves both services.
        config.controller_endpoint = self.controller_endpoint.clone();
        config.policy = self.policy;
        config.socket_dir = self.plugin_socket_dir.clone();
        config.client.connect_timeout = std::time::Duration::from_secs(self.plugin_timeout);
        config.ready_timeout = std::time::Duration::from_secs(self.plugin_timeout);
        if let Some(file) = &self.disk_profiles {
            config.disk_profiles = Some(std::sync::Arc::new(
                csi_isolator::provider::profiles::load(file)?,
            ));
        }
        Ok(config)
    }
}
